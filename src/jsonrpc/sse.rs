//! SSE framing of A2A streams: each event is one `data:` line holding a full
//! JSON-RPC success response with the request's id.
//!
//! Frames are built as bytes here rather than through axum's `Sse`: a
//! compact JSON body holds no raw newline, so one `data:` line always fits,
//! and one allocation per subscriber per event is all a fan-out costs.

use super::envelope::success_body;
use crate::error::GatewayError;
use crate::protocol::StreamResponse;
use crate::store::hub::LedgerEvent;
use axum::body::{Body, Bytes};
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderName};
use axum::response::{IntoResponse, Response};
use futures::stream::{BoxStream, StreamExt};
use serde_json::value::RawValue;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

/// How often an idle stream sends a comment, so proxies keep it open.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// The headers of every SSE response.
const SSE_HEADERS: [(HeaderName, &str); 2] = [
    (CONTENT_TYPE, "text/event-stream"),
    (CACHE_CONTROL, "no-cache"),
];

/// An SSE response carrying `events`, each wrapped with `id`. Each event's
/// JSON is encoded once and shared by every stream that carries it.
pub fn sse_response(
    id: Box<RawValue>,
    events: BoxStream<'static, Result<Arc<LedgerEvent>, GatewayError>>,
) -> Response {
    let mut keep_alive =
        tokio::time::interval_at(tokio::time::Instant::now() + KEEP_ALIVE, KEEP_ALIVE);
    keep_alive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let frames = futures::stream::unfold(
        (events, keep_alive, id),
        |(mut events, mut keep_alive, id)| async move {
            let frame = tokio::select! {
                event = events.next() => match event? {
                    Ok(event) => data_frame(&id, event.json()),
                    Err(err) => error_frame(&id, &err),
                },
                _ = keep_alive.tick() => Bytes::from_static(b":\n\n"),
            };
            keep_alive.reset();
            Some((Ok::<_, Infallible>(frame), (events, keep_alive, id)))
        },
    );
    (SSE_HEADERS, Body::from_stream(frames)).into_response()
}

/// An SSE response carrying `event` alone, wrapped with `id`: a send the
/// agent answered with a message, which is no task's event.
pub fn sse_single(id: &RawValue, event: &StreamResponse) -> Response {
    let json = serde_json::value::to_raw_value(event);
    (SSE_HEADERS, data_frame(id, json.as_deref())).into_response()
}

/// `data: <JSON-RPC response>` and the blank line that ends the event.
fn data_frame<E: std::fmt::Display>(id: &RawValue, event_json: Result<&RawValue, E>) -> Bytes {
    let encoded = event_json
        .map_err(|e| GatewayError::Internal(format!("cannot encode event: {e}")))
        .and_then(|json| success_body(id, json));
    match encoded {
        Ok(body) => frame_of(&body),
        Err(err) => error_frame(id, &err),
    }
}

/// `data: <JSON-RPC error response>` and the blank line.
fn error_frame(id: &RawValue, err: &GatewayError) -> Bytes {
    frame_of(&super::error_body(Some(id), err))
}

fn frame_of(body: &[u8]) -> Bytes {
    let mut frame = Vec::with_capacity(body.len() + 8);
    frame.extend_from_slice(b"data: ");
    frame.extend_from_slice(body);
    frame.extend_from_slice(b"\n\n");
    Bytes::from(frame)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Message, Part};

    #[test]
    fn a_frame_is_one_data_line_even_for_text_with_newlines() {
        let message = Message::agent(vec![Part::text("two\nlines")]);
        let event = LedgerEvent::new("t".into(), 1, StreamResponse::Message(message));
        let id = RawValue::from_string("7".into()).unwrap();
        let frame = data_frame(&id, event.json());
        let text = std::str::from_utf8(&frame).unwrap();
        assert!(text.starts_with("data: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":"));
        assert!(text.ends_with("\n\n"));
        assert_eq!(text.matches('\n').count(), 2, "{text}");
        let json: serde_json::Value = serde_json::from_str(&text[6..]).unwrap();
        assert_eq!(json["result"]["message"]["parts"][0]["text"], "two\nlines");
    }
}
