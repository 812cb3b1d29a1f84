//! One HTTP/1.1 exchange on a plain TCP connection to an agent, written and
//! read by the calling task itself.
//!
//! Unary calls are on every relayed send. hyper's client drives each
//! connection from a task of its own, so every call crossed two tasks and
//! their channels each way (~15 k instructions of the connection's task per
//! call, callgrind). Here the call writes its request and reads the answer
//! on the socket directly: the head is parsed by `httparse` (hyper's own
//! parser), bodies by Content-Length, chunked coding, or the connection's
//! close. Streams and `https` stay on hyper.

use hyper::http::{HeaderValue, StatusCode};
use std::io::{self, IoSlice};
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::net::TcpStream;

/// Most header lines an answer may have.
const MAX_HEADERS: usize = 64;

/// Longest answer head read before it is refused.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// First capacity of an answer's buffer: a typical answer's head and body
/// arrive in one read.
const ANSWER_CAPACITY: usize = 4096;

/// An agent's whole answer to one call: all a caller reads of it.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub content_type: Option<HeaderValue>,
    /// The body, decoded from its transfer coding.
    pub body: Vec<u8>,
}

/// Why an exchange failed.
#[derive(Debug)]
pub enum Failed {
    /// Not one byte of the request reached the connection, so it may be
    /// sent again on another.
    Unsent(io::Error),
    /// The connection failed once the request had (partly) left.
    Io(io::Error),
    /// The connection closed before any of the answer arrived.
    Closed,
    /// The body is longer than the caller's limit.
    TooLarge,
    /// What came back is not HTTP/1.1 this client reads.
    Malformed(String),
}

/// A finished exchange.
#[derive(Debug)]
pub struct Exchanged {
    pub answer: Answer,
    /// The agent keeps the connection open for another request.
    pub reusable: bool,
    /// How much of the request had left when the answer was complete; an
    /// agent may answer before it read all of it.
    pub sent: usize,
}

/// A request as it goes on the wire: its head and its body.
#[derive(Debug)]
pub struct Outgoing {
    pub head: Vec<u8>,
    pub body: bytes::Bytes,
}

impl Outgoing {
    pub fn len(&self) -> usize {
        self.head.len() + self.body.len()
    }

    /// The parts not yet sent once `sent` bytes have left.
    fn rest(&self, sent: usize) -> [IoSlice<'_>; 2] {
        let head = self.head.get(sent..).unwrap_or_default();
        let body = &self.body[sent.saturating_sub(self.head.len())..];
        [IoSlice::new(head), IoSlice::new(body)]
    }

    /// Writes what is left from `sent` on, as far as the socket takes it.
    fn poll_send(
        &self,
        cx: &mut Context<'_>,
        stream: &mut (impl AsyncWrite + Unpin),
        sent: &mut usize,
    ) -> Poll<io::Result<()>> {
        while *sent < self.len() {
            let rest = self.rest(*sent);
            match Pin::new(&mut *stream).poll_write_vectored(cx, &rest) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(written)) => *sent += written,
                Poll::Ready(Err(err)) => return Poll::Ready(Err(err)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Sends what is left from `sent` on.
    pub async fn finish(&self, stream: &mut TcpStream, mut sent: usize) -> io::Result<()> {
        std::future::poll_fn(|cx| self.poll_send(cx, stream, &mut sent)).await
    }
}

/// Sends `request` and reads the whole answer, at most `limit` bytes of
/// body. The answer is read while the request is still being written: an
/// agent may refuse a request before reading all of it.
pub async fn exchange(
    stream: &mut TcpStream,
    request: &Outgoing,
    limit: usize,
) -> Result<Exchanged, Failed> {
    let (mut reader, mut writer) = stream.split();
    let mut sent = 0;
    let mut write_failed = None;
    let mut read = std::pin::pin!(read_answer(&mut reader, limit));
    let outcome = std::future::poll_fn(|cx| {
        if write_failed.is_none()
            && let Poll::Ready(Err(err)) = request.poll_send(cx, &mut writer, &mut sent)
        {
            write_failed = Some(err);
        }
        match read.as_mut().poll(cx) {
            Poll::Ready(read) => Poll::Ready(Some(read)),
            // A connection that cannot take the request will not answer it.
            Poll::Pending if write_failed.is_some() => Poll::Ready(None),
            Poll::Pending => Poll::Pending,
        }
    })
    .await;
    match (outcome, write_failed) {
        (Some(Ok((answer, keep_alive))), write_failed) => Ok(Exchanged {
            answer,
            reusable: keep_alive && write_failed.is_none(),
            sent,
        }),
        // Nothing left: however the read ended (a close, a reset), the
        // request never reached the agent.
        (_, Some(err)) if sent == 0 => Err(Failed::Unsent(err)),
        // The agent's close is what failed the write: say why it failed.
        (Some(Err(Failed::Closed)) | None, Some(err)) => Err(Failed::Io(err)),
        (Some(Err(failed)), _) => Err(failed),
        (None, None) => unreachable!("the exchange ends with an answer or a failed write"),
    }
}

/// How an answer's body is delimited.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Framing {
    Length(usize),
    Chunked,
    /// Until the agent closes the connection.
    Close,
}

/// Reads one answer: skips interim (1xx) heads, then reads the body as the
/// final head frames it. Also says whether the connection stays open.
async fn read_answer(
    reader: &mut (impl AsyncRead + Unpin),
    limit: usize,
) -> Result<(Answer, bool), Failed> {
    let mut buffer = Vec::with_capacity(ANSWER_CAPACITY);
    let mut start = 0;
    // How long the head was at its last parse, and at its last look for
    // the blank line that ends it: 0 before the first.
    let (mut parsed, mut scanned) = (0, 0);
    // Empty lines before the status line, dropped as they come: httparse
    // skips them, but each would make the head worth parsing again.
    let mut skipped = 0;
    loop {
        let empty = empty_lines_at(&buffer[start..]);
        if empty > 0 {
            buffer.drain(start..start + empty);
            skipped += empty;
            (parsed, scanned) = (0, 0);
        }
        let seen = buffer.len() - start;
        // A lone `\r` may start one more empty line.
        let head_begun = buffer[start..] != *b"\r";
        if seen > scanned && head_begun && worth_parsing(&buffer[start..], parsed, scanned) {
            parsed = seen;
            if let Some(head) = parse_head(&buffer[start..])? {
                let body_start = start + head.length;
                if head.status.is_informational() {
                    // Dropped, so that interim heads without end stay
                    // bounded by the head limit (and the caller's timeout).
                    buffer.drain(..body_start);
                    (start, parsed, scanned, skipped) = (0, 0, 0, 0);
                    continue;
                }
                let Head {
                    status,
                    content_type,
                    framing,
                    keep_alive,
                    ..
                } = head;
                let (body, exact) = read_body(reader, buffer, body_start, framing, limit).await?;
                let answer = Answer {
                    status,
                    content_type,
                    body,
                };
                return Ok((answer, keep_alive && exact && framing != Framing::Close));
            }
        }
        scanned = seen;
        if buffer.len() - start + skipped > MAX_HEAD_BYTES {
            return Err(Failed::Malformed(format!(
                "the answer's head is longer than {MAX_HEAD_BYTES} bytes"
            )));
        }
        if fill(reader, &mut buffer).await.map_err(Failed::Io)? == 0 {
            return Err(if buffer.is_empty() && skipped == 0 {
                Failed::Closed
            } else {
                Failed::Io(io::ErrorKind::UnexpectedEof.into())
            });
        }
    }
}

/// Whether the start of an answer, incomplete when `parsed` bytes of it
/// were parsed and `scanned` looked at, is worth parsing again. A head is
/// whole only once a blank line ends it, so it is parsed when one may have
/// arrived, or when it doubled since its last parse (which still finds a
/// malformed head early): an agent feeding its head a byte at a time costs
/// linear parsing, not quadratic.
fn worth_parsing(head: &[u8], parsed: usize, scanned: usize) -> bool {
    if parsed == 0 || head.len() >= parsed.saturating_mul(2) {
        return true;
    }
    // A blank line is "\n\n" or "\n\r\n"; its first bytes may have come
    // with the earlier reads.
    let fresh = &head[scanned.saturating_sub(2)..];
    memchr::memchr_iter(b'\n', fresh)
        .any(|at| matches!(&fresh[at + 1..], [b'\n', ..] | [b'\r', b'\n', ..]))
}

/// The length of the empty lines (`\n` or `\r\n`) at the start of `bytes`;
/// a lone `\r` at its end waits for what follows it.
fn empty_lines_at(bytes: &[u8]) -> usize {
    let mut length = 0;
    loop {
        match &bytes[length..] {
            [b'\n', ..] => length += 1,
            [b'\r', b'\n', ..] => length += 2,
            _ => return length,
        }
    }
}

/// An answer's head, as far as the client acts on it.
struct Head {
    status: StatusCode,
    content_type: Option<HeaderValue>,
    framing: Framing,
    keep_alive: bool,
    /// Its length in bytes, the blank line included.
    length: usize,
}

/// The head at the start of `bytes`, or `None` until all of it is there.
fn parse_head(bytes: &[u8]) -> Result<Option<Head>, Failed> {
    #[cfg(test)]
    tests::counted_parse();
    let malformed = |why: String| Failed::Malformed(format!("the answer's head: {why}"));
    let mut headers = [const { MaybeUninit::uninit() }; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut []);
    let length = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut response,
        bytes,
        &mut headers,
    ) {
        Ok(httparse::Status::Complete(length)) => length,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(err) => return Err(malformed(err.to_string())),
    };
    let code = response.code.unwrap_or_default();
    let status = StatusCode::from_u16(code).map_err(|e| malformed(e.to_string()))?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(malformed("101 Switching Protocols to a POST".into()));
    }
    let mut content_type = None;
    let mut content_length = None;
    let mut chunked = false;
    let mut close = response.version != Some(1);
    for header in response.headers.iter() {
        let name = header.name;
        if name.eq_ignore_ascii_case("content-type") {
            content_type = HeaderValue::from_bytes(header.value).ok();
        } else if name.eq_ignore_ascii_case("content-length") {
            // Digits only: `parse` would also take a sign.
            let digits = header.value.trim_ascii();
            let length = (!digits.is_empty() && digits.iter().all(u8::is_ascii_digit))
                .then(|| std::str::from_utf8(digits).ok()?.parse::<usize>().ok())
                .flatten()
                .ok_or_else(|| malformed("an invalid Content-Length".into()))?;
            if content_length.is_some_and(|earlier| earlier != length) {
                return Err(malformed("two different Content-Lengths".into()));
            }
            content_length = Some(length);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            // Baton asks for no coding (no TE header) and undoes none but
            // chunked: a body still compressed would pass for JSON that is
            // not.
            if !header.value.trim_ascii().eq_ignore_ascii_case(b"chunked") {
                return Err(malformed(format!(
                    "the transfer coding {:?} is not supported",
                    String::from_utf8_lossy(header.value)
                )));
            }
            chunked = true;
        } else if name.eq_ignore_ascii_case("connection") {
            close |= header
                .value
                .split(|&b| b == b',')
                .any(|token| token.trim_ascii().eq_ignore_ascii_case(b"close"));
        }
    }
    let framing = if status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        Framing::Length(0)
    } else {
        match (chunked, content_length) {
            (true, _) => Framing::Chunked,
            (false, Some(length)) => Framing::Length(length),
            (false, None) => Framing::Close,
        }
    };
    // Both lengths given: the message is suspect (RFC 9112 §6.3), so the
    // connection is not used again.
    close |= chunked && content_length.is_some();
    Ok(Some(Head {
        status,
        content_type,
        framing,
        keep_alive: !close,
        length,
    }))
}

/// Reads the body that starts at `start` in `buffer` and returns it, and
/// whether it ended exactly where the data read so far does (nothing more
/// came with it, so the connection can take another request).
async fn read_body(
    reader: &mut (impl AsyncRead + Unpin),
    mut buffer: Vec<u8>,
    start: usize,
    framing: Framing,
    limit: usize,
) -> Result<(Vec<u8>, bool), Failed> {
    let eof = || Failed::Io(io::ErrorKind::UnexpectedEof.into());
    match framing {
        Framing::Length(length) => {
            if length > limit {
                return Err(Failed::TooLarge);
            }
            let end = start + length;
            buffer.reserve(end.saturating_sub(buffer.len()));
            while buffer.len() < end {
                if fill(reader, &mut buffer).await.map_err(Failed::Io)? == 0 {
                    return Err(eof());
                }
            }
            let exact = buffer.len() == end;
            buffer.truncate(end);
            buffer.drain(..start);
            Ok((buffer, exact))
        }
        Framing::Close => {
            loop {
                if buffer.len() - start > limit {
                    return Err(Failed::TooLarge);
                }
                if fill(reader, &mut buffer).await.map_err(Failed::Io)? == 0 {
                    break;
                }
            }
            buffer.drain(..start);
            Ok((buffer, false))
        }
        Framing::Chunked => {
            let mut body = Vec::new();
            let mut at = start;
            // The trailers' length so far, once the last chunk was read.
            let mut trailers = None;
            loop {
                let step = match trailers {
                    None => dechunk(&buffer[at..], &mut body, limit)?,
                    Some(_) => trailer_line(&buffer[at..]),
                };
                match step {
                    Dechunked::Data(used) => at += used,
                    Dechunked::Last(used) => {
                        at += used;
                        trailers = Some(0);
                    }
                    Dechunked::Trailer(used) => {
                        at += used;
                        let read = trailers.unwrap_or_default() + used;
                        // Trailers carry nothing used: no more of them
                        // than a head may have.
                        if read > MAX_HEAD_BYTES {
                            return Err(chunks_malformed());
                        }
                        trailers = Some(read);
                    }
                    Dechunked::End(used) => return Ok((body, at + used == buffer.len())),
                    Dechunked::More(wanted) => {
                        // Only the chunk not yet decoded is kept; with its
                        // framing it may not grow past the limit by more
                        // than a head may.
                        buffer.drain(..at);
                        at = 0;
                        if buffer.len() > limit.saturating_add(MAX_HEAD_BYTES) {
                            return Err(Failed::TooLarge);
                        }
                        // Decoded again only once what it waits for may be
                        // there: a line's end, or the chunk's data. Framing
                        // or data fed a byte at a time costs linear work,
                        // not quadratic.
                        loop {
                            let before = buffer.len();
                            if fill(reader, &mut buffer).await.map_err(Failed::Io)? == 0 {
                                return Err(eof());
                            }
                            match wanted {
                                Wanted::Bytes(length) if buffer.len() >= length => break,
                                Wanted::Bytes(_) => {}
                                Wanted::LineEnd => {
                                    if line_end(&buffer[before.saturating_sub(1)..]).is_some() {
                                        break;
                                    }
                                    if buffer.len() > MAX_HEAD_BYTES {
                                        return Err(chunks_malformed());
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// One step of chunked decoding.
#[derive(Debug, PartialEq)]
enum Dechunked {
    /// A chunk of this many bytes (framing included) was decoded.
    Data(usize),
    /// The last chunk's size line, this many bytes, was read: trailers,
    /// if any, and an empty line follow.
    Last(usize),
    /// A trailer line of this many bytes was read.
    Trailer(usize),
    /// The empty line that ends the trailers, this many bytes, was read.
    End(usize),
    /// More bytes are needed.
    More(Wanted),
}

/// What a step of chunked decoding waits for.
#[derive(Debug, PartialEq)]
enum Wanted {
    /// The end of a line: a size line or a trailer.
    LineEnd,
    /// This many bytes from the chunk's start: its size line, data and CRLF.
    Bytes(usize),
}

fn chunks_malformed() -> Failed {
    Failed::Malformed("the answer's chunked body is invalid".into())
}

/// Decodes the chunk at the start of `bytes` into `body`.
fn dechunk(bytes: &[u8], body: &mut Vec<u8>, limit: usize) -> Result<Dechunked, Failed> {
    #[cfg(test)]
    tests::counted_parse();
    // httparse reads a size line without digits as zero, the last chunk.
    if bytes.first().is_some_and(|b| !b.is_ascii_hexdigit()) {
        return Err(chunks_malformed());
    }
    let (size_line, size) = match httparse::parse_chunk_size(bytes) {
        Ok(httparse::Status::Complete(found)) => found,
        // A size line longer than a head may be is refused.
        Ok(httparse::Status::Partial) if bytes.len() > MAX_HEAD_BYTES => {
            return Err(chunks_malformed());
        }
        Ok(httparse::Status::Partial) => return Ok(Dechunked::More(Wanted::LineEnd)),
        Err(_) => return Err(chunks_malformed()),
    };
    if size == 0 {
        return Ok(Dechunked::Last(size_line));
    }
    let size = usize::try_from(size).map_err(|_| Failed::TooLarge)?;
    if body.len().saturating_add(size) > limit {
        return Err(Failed::TooLarge);
    }
    let end = size_line + size;
    if bytes.len() < end + 2 {
        return Ok(Dechunked::More(Wanted::Bytes(end + 2)));
    }
    if &bytes[end..end + 2] != b"\r\n" {
        return Err(chunks_malformed());
    }
    body.extend_from_slice(&bytes[size_line..end]);
    Ok(Dechunked::Data(end + 2))
}

/// Reads the trailer line at the start of `bytes`: the trailers end at an
/// empty line.
fn trailer_line(bytes: &[u8]) -> Dechunked {
    #[cfg(test)]
    tests::counted_parse();
    match line_end(bytes) {
        None => Dechunked::More(Wanted::LineEnd),
        Some(0) => Dechunked::End(2),
        Some(end) => Dechunked::Trailer(end + 2),
    }
}

/// Where the first CRLF in `bytes` starts: chunked framing's lines end in
/// one.
fn line_end(bytes: &[u8]) -> Option<usize> {
    memchr::memmem::find(bytes, b"\r\n")
}

/// Reads once into `buffer`'s spare room, growing it when full; 0 at the
/// end of the stream.
async fn fill(reader: &mut (impl AsyncRead + Unpin), buffer: &mut Vec<u8>) -> io::Result<usize> {
    if buffer.len() == buffer.capacity() {
        buffer.reserve(buffer.capacity().max(ANSWER_CAPACITY));
    }
    reader.read_buf(buffer).await
}

/// Whether an idle connection is still open: the agent has not closed it
/// nor sent anything unasked. Costs a system call only when the runtime
/// saw the socket become readable. (`try_read` reads that readiness
/// without spending the task's budget, which `poll_read_ready` does: once
/// spent, it says `Pending` of a closed connection too.)
pub fn is_open(stream: &TcpStream) -> bool {
    let mut probe = [0u8; 1];
    matches!(stream.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        /// How often this thread parsed a head or chunked framing.
        static PARSES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    pub(super) fn counted_parse() {
        PARSES.with(|parses| parses.set(parses.get() + 1));
    }

    async fn answer_of(wire: &[u8]) -> Result<(Answer, bool), Failed> {
        read_answer(&mut &wire[..], 1024).await
    }

    /// Gives its bytes one per read, as an agent dripping its answer.
    struct Drip<'a>(&'a [u8]);

    impl AsyncRead for Drip<'_> {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            if let Some((&first, rest)) = self.0.split_first() {
                buf.put_slice(&[first]);
                self.0 = rest;
            }
            Poll::Ready(Ok(()))
        }
    }

    /// The answer read a byte at a time, and how often its head or its
    /// chunked framing was parsed.
    async fn dripped(wire: &[u8]) -> (Result<(Answer, bool), Failed>, usize) {
        PARSES.with(|parses| parses.set(0));
        let answer = read_answer(&mut Drip(wire), 64 * 1024).await;
        (answer, PARSES.with(|parses| parses.get()))
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_head_dripped_a_byte_at_a_time_is_parsed_a_few_times() {
        let mut wire = b"HTTP/1.1 200 OK\r\n".to_vec();
        for line in 0..40 {
            wire.extend(format!("x-filler-{line}: {}\r\n", "v".repeat(1000)).as_bytes());
        }
        wire.extend(b"content-length: 2\r\n\r\n{}");
        assert!(wire.len() > MAX_HEAD_BYTES / 2 && wire.len() < MAX_HEAD_BYTES);
        let (answer, parses) = dripped(&wire).await;
        let (answer, keep) = answer.unwrap();
        assert_eq!((answer.body.as_slice(), keep), (&b"{}"[..], true));
        // Once per doubling and once at the blank line, not once per byte.
        assert!(parses <= 20, "{parses} parses");

        // Bare line feeds end a head too, and interim heads before it.
        for wire in [
            &b"HTTP/1.1 200 OK\ncontent-length: 2\n\n{}"[..],
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}",
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\n\r\n{}",
        ] {
            let (answer, _) = dripped(wire).await;
            let text = String::from_utf8_lossy(wire);
            assert_eq!(answer.expect(&text).0.body, b"{}", "{text}");
        }
        // Empty lines before the status line are skipped once, not parsed
        // again at each byte, and count against the head's limit.
        let blank = b"\r\n\n".repeat(MAX_HEAD_BYTES / 6);
        let wire = [
            &blank[..],
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}",
        ]
        .concat();
        let (answer, parses) = dripped(&wire).await;
        assert_eq!(answer.unwrap().0.body, b"{}");
        assert!(parses <= 20, "{parses} parses");
        let (answer, parses) = dripped(&blank.repeat(3)).await;
        assert!(matches!(answer, Err(Failed::Malformed(_))), "{answer:?}");
        assert!(parses <= 6, "{parses} parses");
        // What is not HTTP is still refused before its head could end.
        for wire in [&b"SMTP ready\r\n"[..], b"HTTP/1.1 20x OK\r\n"] {
            let (answer, parses) = dripped(wire).await;
            assert!(matches!(answer, Err(Failed::Malformed(_))), "{answer:?}");
            assert!(parses <= 6, "{parses} parses");
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn chunked_framing_dripped_a_byte_at_a_time_is_parsed_once_a_line() {
        let head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
        let mut wire = head.to_vec();
        wire.extend(format!("5;ext={}\r\nhello\r\n0\r\n", "x".repeat(20_000)).as_bytes());
        for line in 0..1000 {
            wire.extend(format!("x-trailer-{line}: 1\r\n").as_bytes());
        }
        wire.extend(b"\r\n");
        let (answer, parses) = dripped(&wire).await;
        let (answer, keep) = answer.unwrap();
        assert_eq!((answer.body.as_slice(), keep), (&b"hello"[..], true));
        // About twice a line, where each byte of framing or chunk data used
        // to scan it all again.
        assert!(parses <= 2_100, "{parses} parses for {} bytes", wire.len());

        // A long chunk after a long size line: its data does not have the
        // line parsed again at every read.
        let mut wire = head.to_vec();
        let data = "d".repeat(30_000);
        wire.extend(
            format!(
                "{:x};ext={}\r\n{data}\r\n0\r\n\r\n",
                data.len(),
                "x".repeat(20_000)
            )
            .as_bytes(),
        );
        let (answer, parses) = dripped(&wire).await;
        assert_eq!(answer.unwrap().0.body.len(), data.len());
        assert!(parses <= 50, "{parses} parses for {} bytes", wire.len());

        // Framing without end is still refused at a head's length.
        let mut endless = head.to_vec();
        endless.extend(format!("5;ext={}", "x".repeat(MAX_HEAD_BYTES)).as_bytes());
        let (answer, _) = dripped(&endless).await;
        assert!(matches!(answer, Err(Failed::Malformed(_))), "{answer:?}");
        let mut endless = head.to_vec();
        endless.extend(b"0\r\n");
        endless.extend(b"x-trailer: 1\r\n".repeat(MAX_HEAD_BYTES / 8));
        let (answer, _) = dripped(&endless).await;
        assert!(matches!(answer, Err(Failed::Malformed(_))), "{answer:?}");
    }

    #[tokio::test]
    async fn a_length_delimited_answer_keeps_the_connection() {
        let (answer, keep) = answer_of(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\ncontent-length: 2\r\n\r\n{}",
        )
        .await
        .unwrap();
        assert_eq!(answer.status, StatusCode::OK);
        assert_eq!(answer.content_type.unwrap(), "application/json");
        assert_eq!(answer.body, b"{}");
        assert!(keep);
    }

    #[tokio::test]
    async fn interim_heads_are_skipped_and_chunks_joined() {
        let wire = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n3;ext=1\r\nabc\r\n2\r\nde\r\n0\r\nx-trailer: 1\r\n\r\n";
        let (answer, keep) = answer_of(wire).await.unwrap();
        assert_eq!(answer.body, b"abcde");
        assert!(keep);
    }

    #[tokio::test]
    async fn a_close_or_an_unframed_body_ends_the_connection() {
        let (answer, keep) = answer_of(b"HTTP/1.1 200 OK\r\n\r\nto the end")
            .await
            .unwrap();
        assert_eq!((answer.body.as_slice(), keep), (&b"to the end"[..], false));
        let (_, keep) = answer_of(
            b"HTTP/1.1 200 OK\r\nConnection: keep-alive, close\r\ncontent-length: 0\r\n\r\n",
        )
        .await
        .unwrap();
        assert!(!keep);
        let (_, keep) = answer_of(b"HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n")
            .await
            .unwrap();
        assert!(!keep);
        // Bytes after the answer were never asked for.
        let (_, keep) = answer_of(b"HTTP/1.1 204 No Content\r\n\r\nextra")
            .await
            .unwrap();
        assert!(!keep);
    }

    #[tokio::test]
    async fn bad_answers_fail_by_their_fault() {
        assert!(matches!(answer_of(b"").await, Err(Failed::Closed)));
        assert!(matches!(
            answer_of(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nab").await,
            Err(Failed::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof
        ));
        assert!(matches!(
            answer_of(b"HTTP/1.1 200 OK\r\ncontent-length: 2000\r\n\r\n").await,
            Err(Failed::TooLarge)
        ));
        assert!(matches!(
            answer_of(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n800\r\n").await,
            Err(Failed::TooLarge)
        ));
        // Trailers without end are framing without bound.
        let mut endless = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n".to_vec();
        endless.extend(b"x-trailer: 1\r\n".repeat(MAX_HEAD_BYTES / 8));
        assert!(matches!(
            answer_of(&endless).await,
            Err(Failed::Malformed(_))
        ));
        assert!(matches!(
            answer_of(b"HTTP/1.1 200 OK\r\n\r\n").await.map(|(a, _)| a.body),
            Ok(body) if body.is_empty()
        ));
        for wire in [
            &b"SMTP ready\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: +2\r\n\r\n{}",
            b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabc\r\n",
            b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
            // A coding Baton would not undo.
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
            // A stray line between chunks is no last chunk.
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nab\r\n\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n;x\r\n\r\n",
        ] {
            assert!(
                matches!(answer_of(wire).await, Err(Failed::Malformed(_))),
                "{}",
                String::from_utf8_lossy(wire)
            );
        }
    }

    #[tokio::test]
    async fn a_request_on_a_connection_the_agent_reset_never_left() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut stream = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        accepted.set_zero_linger().unwrap();
        drop(accepted);
        // The runtime has seen the reset: the read fails at once too.
        stream.readable().await.unwrap();
        let request = Outgoing {
            head: b"POST / HTTP/1.1\r\ncontent-length: 2\r\n\r\n".to_vec(),
            body: bytes::Bytes::from_static(b"{}"),
        };
        let failed = exchange(&mut stream, &request, 1024).await.unwrap_err();
        assert!(matches!(failed, Failed::Unsent(_)), "{failed:?}");
    }

    #[test]
    fn the_rest_of_a_request_spans_head_and_body() {
        let request = Outgoing {
            head: b"head".to_vec(),
            body: bytes::Bytes::from_static(b"body"),
        };
        let rest = |sent| {
            let [head, body] = request.rest(sent);
            [head.to_vec(), body.to_vec()]
        };
        assert_eq!(rest(0), [b"head".to_vec(), b"body".to_vec()]);
        assert_eq!(rest(3), [b"d".to_vec(), b"body".to_vec()]);
        assert_eq!(rest(6), [Vec::new(), b"dy".to_vec()]);
    }
}
