//! SSE framing of A2A streams: each event is one `data:` line holding a full
//! JSON-RPC success response with the request's id.

use super::envelope::success_body;
use crate::error::GatewayError;
use crate::store::hub::LedgerEvent;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{BoxStream, StreamExt};
use serde_json::value::RawValue;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

/// An SSE response carrying `events`, each wrapped with `id`. Each event's
/// JSON is encoded once and shared by every stream that carries it.
pub fn sse_response(id: Box<RawValue>, events: BoxStream<'static, Arc<LedgerEvent>>) -> Response {
    let frames = events.map(move |event| {
        let encoded = event
            .json()
            .map_err(|e| GatewayError::Internal(format!("cannot encode event: {e}")))
            .and_then(|json| success_body(&id, json));
        let data = match encoded {
            Ok(body) => String::from_utf8(body).unwrap_or_default(),
            Err(err) => String::from_utf8(super::error_body(Some(&id), &err)).unwrap_or_default(),
        };
        Ok::<_, Infallible>(Event::default().data(data))
    });
    Sse::new(frames)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}
