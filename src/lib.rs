//! Baton: an A2A 1.0 gateway whose every task lives in a durable sled ledger.
//!
//! Module map:
//! - [`cli`]: the command line (`baton serve`, `baton keys`, `baton agents`, `baton trace`).
//! - [`config`]: flags, `BATON_*` env and `baton.toml`, validated into `Config`.
//! - [`telemetry`]: tracing subscriber (`RUST_LOG`, text or JSON).
//! - [`launch`]: assembles a running Baton from a `Config`.
//! - [`error`]: `GatewayError` and its one JSON-RPC mapping.
//! - [`protocol`]: A2A 1.0 wire types (exact ProtoJSON), method names.
//! - [`jsonrpc`]: JSON-RPC envelope, method dispatch, SSE framing.
//! - [`gateway`]: the eleven A2A methods over the ledger and the agents.
//! - [`handoff`]: handoff control metadata, payloads, policy and routing.
//! - [`lifecycle`]: task state transitions and event application.
//! - [`store`]: the sled ledger, group-commit flusher and event fan-out.
//! - [`agents`]: the agent trait and the built-in `echo` and `scenario` agents.
//! - [`push`]: webhook delivery of task events.
//! - [`registry`]: the live directory of agents and card publication.
//! - [`schema_support`]: compiling embedded JSON Schemas and wording their errors.
//! - [`netguard`]: the outbound-connection (SSRF) guard.
//! - [`upstream`]: remote A2A agents: the JSON-RPC client and the proxying `RemoteAgent`.
//! - [`server`]: the axum router, card publication, health, shutdown.
//! - [`auth`]: agency API keys: the `KeyStore`, the keys file, bearer checks.
//! - [`registry_client`]: the registry JSON-RPC client behind `baton agents`.
//! - [`demo`]: `baton demo` and the vendor agent kit it and the tests use.
//! - [`metrics`]: handoff metrics in the Prometheus text format (`GET /metrics`).

pub mod agents;
pub mod auth;
pub mod cli;
pub mod config;
pub mod demo;
pub mod error;
pub mod gateway;
pub mod handoff;
pub mod jsonrpc;
pub mod launch;
pub mod lifecycle;
pub mod metrics;
pub mod netguard;
pub mod protocol;
pub mod push;
pub mod registry;
pub mod registry_client;
pub mod schema_support;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod tls;
pub mod upstream;
