//! Server-sent events decoding: bytes in, complete events out.
//!
//! Follows the HTML event-stream rules the A2A SSE binding relies on: one
//! byte-order mark at the start is skipped, lines end in LF, CR or CRLF, `:`
//! starts a comment (keep-alives), `data:` lines of one event are joined with
//! LF, a blank line dispatches the event, and an event left unterminated when
//! the stream closes is dropped.

/// One dispatched event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SseEvent {
    /// The `event:` type; empty for the default (`message`).
    pub event: String,
    /// The joined `data:` lines.
    pub data: String,
}

/// Incremental decoder; feed it chunks as they arrive.
#[derive(Debug, Default)]
pub(crate) struct SseDecoder {
    /// Bytes of a line not yet terminated.
    line: Vec<u8>,
    event: String,
    data: String,
    has_data: bool,
    /// The last chunk ended in a line's CR: an LF first in the next one
    /// ends nothing more.
    after_cr: bool,
    /// A line has ended, so a byte-order mark is no longer skipped.
    past_first_line: bool,
}

/// UTF-8's byte-order mark, which a stream may start with.
const BOM: &[u8] = b"\xEF\xBB\xBF";

impl SseDecoder {
    /// Bytes held for the event being assembled, to cap what an agent can
    /// make the gateway buffer.
    pub fn pending_bytes(&self) -> usize {
        self.line.len() + self.data.len()
    }

    /// Decodes a chunk, returning every event it completes.
    pub fn push(&mut self, mut chunk: &[u8]) -> Vec<SseEvent> {
        let mut events = Vec::new();
        if self.after_cr && !chunk.is_empty() {
            // The LF of a CRLF split across chunks: its line ended at the CR.
            if chunk[0] == b'\n' {
                chunk = &chunk[1..];
            }
            self.after_cr = false;
        }
        while let Some(end) = memchr::memchr2(b'\n', b'\r', chunk) {
            self.line.extend_from_slice(&chunk[..end]);
            let ended_in_cr = chunk[end] == b'\r';
            chunk = &chunk[end + 1..];
            if ended_in_cr {
                match chunk.first() {
                    Some(b'\n') => chunk = &chunk[1..],
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
            let line = std::mem::take(&mut self.line);
            let line = match line.strip_prefix(BOM) {
                Some(rest) if !self.past_first_line => rest,
                _ => &line,
            };
            self.past_first_line = true;
            if let Some(event) = self.line_done(line) {
                events.push(event);
            }
        }
        self.line.extend_from_slice(chunk);
        events
    }

    fn line_done(&mut self, line: &[u8]) -> Option<SseEvent> {
        if line.is_empty() {
            let event = std::mem::take(&mut self.event);
            let data = std::mem::take(&mut self.data);
            let has_data = std::mem::replace(&mut self.has_data, false);
            // An event without data lines is not dispatched (keep-alives, bare ids).
            return has_data.then_some(SseEvent { event, data });
        }
        if line[0] == b':' {
            return None;
        }
        let line = String::from_utf8_lossy(line);
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line.as_ref(), ""),
        };
        match field {
            "event" => self.event = value.to_string(),
            "data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            // `id` and `retry` steer browser reconnection; A2A resumes with
            // SubscribeToTask instead, so they are ignored.
            _ => {}
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(chunks: &[&str]) -> Vec<SseEvent> {
        let mut decoder = SseDecoder::default();
        chunks
            .iter()
            .flat_map(|chunk| decoder.push(chunk.as_bytes()))
            .collect()
    }

    fn data(text: &str) -> SseEvent {
        SseEvent {
            event: String::new(),
            data: text.into(),
        }
    }

    #[test]
    fn frames_split_anywhere_decode_the_same() {
        let cases: &[(&[&str], Vec<SseEvent>)] = &[
            (&["data: {\"a\":1}\n\n"], vec![data("{\"a\":1}")]),
            (&["da", "ta: x\n", "\n"], vec![data("x")]),
            (&["data: x\r\n\r\n"], vec![data("x")]),
            (
                &["data: a\r", "\ndata: b\r\n\r", "", "\n"],
                vec![data("a\nb")],
            ),
            (&["data: x\r\rdata: y\r\r"], vec![data("x"), data("y")]),
            (&["data: a\rdata: b\n\r\n"], vec![data("a\nb")]),
            (
                &["\u{FEFF}data: first\n\ndata: second\n\n"],
                vec![data("first"), data("second")],
            ),
            (&["\u{FEFF}\n\u{FEFF}data: x\n\n"], vec![]),
            (&["data:x\n\ndata: y\n\n"], vec![data("x"), data("y")]),
            (&["data: a\ndata: b\n\n"], vec![data("a\nb")]),
            (&[": keep-alive\n\n"], vec![]),
            (&["id: 7\nretry: 10\n\n"], vec![]),
            (&["data: unterminated\n"], vec![]),
            (
                &["event: error\ndata: {}\n\n"],
                vec![SseEvent {
                    event: "error".into(),
                    data: "{}".into(),
                }],
            ),
        ];
        for (chunks, expected) in cases {
            assert_eq!(&decode(chunks), expected, "{chunks:?}");
        }
    }

    #[test]
    fn a_byte_order_mark_split_across_chunks_is_skipped() {
        let mut decoder = SseDecoder::default();
        let mut events = decoder.push(b"\xEF");
        events.extend(decoder.push(b"\xBB\xBFdata: x\n\n"));
        assert_eq!(events, [data("x")]);
    }
}
