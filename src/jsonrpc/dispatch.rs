//! Method dispatch: decodes params for each A2A method, calls the gateway,
//! and shapes the reply as JSON or as an SSE stream.

use super::envelope::{RpcRequest, decode_params, error_body, success_body};
use super::sse::{sse_response, sse_single};
use crate::error::GatewayError;
use crate::gateway::{CallContext, Gateway, SendOutcome};
use crate::protocol::{AgentCard, StreamResponse, methods};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::future::BoxFuture;
use serde::Serialize;
use serde_json::value::RawValue;
use std::sync::Arc;

/// A JSON reply with HTTP 200 (or `status`).
pub fn json_reply(status: StatusCode, body: Vec<u8>) -> Response {
    let mut response = (status, body).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// A JSON-RPC error reply with HTTP 200.
pub fn error_reply(id: Option<&RawValue>, error: &GatewayError) -> Response {
    json_reply(StatusCode::OK, error_body(id, error))
}

fn ok<T: Serialize>(id: &RawValue, result: Result<T, GatewayError>) -> Response {
    match result.and_then(|value| success_body(id, &value)) {
        Ok(body) => json_reply(StatusCode::OK, body),
        Err(err) => error_reply(Some(id), &err),
    }
}

/// Serves one request. `extended_card` is what GetExtendedAgentCard answers.
///
/// A plain function that boxes each method's own future: as one `async fn`
/// its future was as large as the largest method's (15 KB, measured), and
/// every request paid for allocating and copying all of it.
pub fn dispatch<'a>(
    gateway: &'a Arc<Gateway>,
    ctx: &'a CallContext,
    request: RpcRequest<'a>,
    extended_card: Result<&'a AgentCard, GatewayError>,
) -> BoxFuture<'a, Response> {
    let id = request.id;
    let params = request.params;
    let answered =
        |response: Response| -> BoxFuture<'a, Response> { Box::pin(std::future::ready(response)) };
    // With push off, each config method is -32003 whatever its params
    // (spec §3.3.4), not a complaint about them.
    if methods::PUSH_CONFIG_METHODS.contains(&&*request.method)
        && let Err(err) = gateway.check_push_enabled()
    {
        return answered(error_reply(Some(id), &err));
    }
    match &*request.method {
        methods::SEND_MESSAGE => match decode_params(params) {
            Ok(req) => Box::pin(async move { ok(id, gateway.send_message(ctx, req).await) }),
            Err(err) => answered(error_reply(Some(id), &err)),
        },
        methods::SEND_STREAMING_MESSAGE => match decode_params(params) {
            Ok(req) => Box::pin(async move {
                match gateway.send_streaming_message(ctx, req).await {
                    Ok(SendOutcome::Message(message)) => {
                        sse_single(id, &StreamResponse::Message(message))
                    }
                    Ok(SendOutcome::Task(events)) => {
                        sse_response(id.to_owned(), events.into_stream())
                    }
                    Err(err) => error_reply(Some(id), &err),
                }
            }),
            Err(err) => answered(error_reply(Some(id), &err)),
        },
        methods::GET_TASK => match decode_params(params) {
            Ok(req) => Box::pin(async move { ok(id, gateway.get_task(ctx, req).await) }),
            Err(err) => answered(error_reply(Some(id), &err)),
        },
        methods::LIST_TASKS => match decode_params(params) {
            Ok(req) => Box::pin(async move { ok(id, gateway.list_tasks(ctx, req).await) }),
            Err(err) => answered(error_reply(Some(id), &err)),
        },
        methods::CANCEL_TASK => match decode_params(params) {
            Ok(req) => Box::pin(async move { ok(id, gateway.cancel_task(ctx, req).await) }),
            Err(err) => answered(error_reply(Some(id), &err)),
        },
        methods::SUBSCRIBE_TO_TASK => match decode_params(params) {
            Ok(req) => Box::pin(async move {
                match gateway.subscribe(ctx, req).await {
                    Ok(events) => sse_response(id.to_owned(), events.into_stream()),
                    Err(err) => error_reply(Some(id), &err),
                }
            }),
            Err(err) => answered(error_reply(Some(id), &err)),
        },
        methods::CREATE_PUSH_CONFIG => match decode_params(params) {
            Ok(req) => Box::pin(async move { ok(id, gateway.create_push_config(ctx, req).await) }),
            Err(err) => answered(error_reply(Some(id), &err)),
        },
        methods::GET_PUSH_CONFIG => match decode_params(params) {
            Ok(req) => Box::pin(async move { ok(id, gateway.get_push_config(ctx, req).await) }),
            Err(err) => answered(error_reply(Some(id), &err)),
        },
        methods::LIST_PUSH_CONFIGS => match decode_params(params) {
            Ok(req) => Box::pin(async move { ok(id, gateway.list_push_configs(ctx, req).await) }),
            Err(err) => answered(error_reply(Some(id), &err)),
        },
        methods::DELETE_PUSH_CONFIG => match decode_params(params) {
            // google.protobuf.Empty: `{}`.
            Ok(req) => Box::pin(async move {
                let deleted = gateway.delete_push_config(ctx, req).await;
                ok(id, deleted.map(|()| serde_json::json!({})))
            }),
            Err(err) => answered(error_reply(Some(id), &err)),
        },
        methods::GET_EXTENDED_AGENT_CARD => answered(ok(
            id,
            decode_params::<crate::protocol::GetExtendedAgentCardRequest>(params)
                .and(extended_card),
        )),
        other => {
            // `methods::ALL`, which the front door checks first, lists only
            // the methods matched above.
            debug_assert!(!methods::ALL.contains(&other), "{other} has no arm");
            answered(error_reply(Some(id), &unknown_method(other)))
        }
    }
}

/// The error for a method A2A 1.0 does not have (-32601).
pub fn unknown_method(name: &str) -> GatewayError {
    GatewayError::MethodNotFound(format!("{name:?} is not an A2A 1.0 method"))
}
