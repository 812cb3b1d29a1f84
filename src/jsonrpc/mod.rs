//! JSON-RPC 2.0 over HTTP POST: the envelope, the error replies, the
//! method dispatch onto the gateway, and SSE framing of streams.
//!
//! Error policy: every failure is answered with HTTP 200 and a JSON-RPC error
//! body (the official SDK clients parse JSON-RPC errors only from 200 replies),
//! except an oversized body (413) and an unknown agent path (404), which still
//! carry a JSON-RPC error body. The id is echoed with its JSON type; when the
//! id itself is unusable the reply has `"id": null`.

pub mod dispatch;
pub mod envelope;
pub mod sse;

pub use envelope::{RpcRequest, error_body, parse_request, success_body};
