//! SSE framing of A2A streams: each event is one `data:` line holding a full
//! JSON-RPC success response with the request's id.

use super::envelope::success_body;
use crate::protocol::StreamResponse;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{BoxStream, StreamExt};
use serde_json::value::RawValue;
use std::convert::Infallible;
use std::time::Duration;

/// An SSE response carrying `events`, each wrapped with `id`.
pub fn sse_response(id: Box<RawValue>, events: BoxStream<'static, StreamResponse>) -> Response {
    let frames = events.map(move |event| {
        let data = match success_body(&id, &event) {
            Ok(body) => String::from_utf8(body).unwrap_or_default(),
            Err(err) => String::from_utf8(super::error_body(Some(&id), &err)).unwrap_or_default(),
        };
        Ok::<_, Infallible>(Event::default().data(data))
    });
    Sse::new(frames)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}
