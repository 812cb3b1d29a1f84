//! Remote A2A agents: a JSON-RPC client for one agent endpoint and the
//! [`Agent`](crate::agents::Agent) that proxies the gateway's tasks to it.
//!
//! The gateway owns the task ids its callers see; a [`RemoteAgent`] forwards
//! each message to its upstream (always as an A2A 1.0 client, streaming when
//! the card says so, else `returnImmediately` plus polling), reports the
//! upstream's ids once (`AgentEvent::Bound`), and then only what changed, so
//! the ledger holds the upstream's progress under the gateway's ids.
//!
//! Error policy: every upstream fault is an [`AgentError`](crate::agents::AgentError)
//! of its own kind and is never swallowed. No connection (refused, DNS,
//! refused by the outbound guard) is `Unreachable`; no answer in time is
//! `Timeout`; a body that is not JSON is `NotJson`; JSON that is not a
//! JSON-RPC 2.0 response, or whose result is not the A2A object the method
//! returns, is `InvalidResponse` (-32006 at the gateway); a JSON-RPC error
//! object is `Refused` with its code, message and data unchanged. Only a
//! transport fault while *following* a task the upstream already took is
//! retried (by polling), because the task lives on upstream regardless.

pub mod client;
mod http1;
pub mod remote;
mod sse;
mod transport;

pub use client::{UpstreamClient, UpstreamStream};
pub use remote::RemoteAgent;
pub use transport::{error_chain, has_io_cause};

use std::time::Duration;

/// Longest wait for a TCP connection to an agent.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait for a whole unary call (request sent, answer read).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest silence on an open stream. Baton itself sends an SSE keep-alive
/// every 15 s, so a minute of nothing means the stream is dead.
pub const DEFAULT_STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// First delay between two GetTask polls.
pub const DEFAULT_POLL_INITIAL: Duration = Duration::from_millis(50);
/// Longest delay between two GetTask polls.
pub const DEFAULT_POLL_MAX: Duration = Duration::from_secs(2);
/// Longest run of failed polls (no connection, no answer) while following a
/// task the agent holds; as long as the default task timeout, so a task's
/// own deadline ends the wait first.
pub const DEFAULT_FOLLOW_OUTAGE: Duration = Duration::from_secs(300);
/// Largest answer (or single SSE event) accepted from an agent.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

/// Timeouts, polling and size limits of calls to one agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpstreamSettings {
    /// Longest wait for a TCP connection.
    pub connect_timeout: Duration,
    /// Longest wait for a unary call, and for a stream's response headers.
    pub request_timeout: Duration,
    /// Longest silence on an open stream before it counts as timed out.
    pub stream_idle_timeout: Duration,
    /// First delay between polls; doubled after each poll that saw no change.
    pub poll_initial: Duration,
    /// Cap of the poll delay.
    pub poll_max: Duration,
    /// How long polls may keep failing for want of a connection or an
    /// answer before following the task gives up.
    pub follow_outage: Duration,
    /// Largest answer accepted; bigger ones are invalid responses, so a
    /// faulty agent cannot exhaust the gateway's memory.
    pub max_body_bytes: usize,
}

impl Default for UpstreamSettings {
    fn default() -> Self {
        Self {
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            stream_idle_timeout: DEFAULT_STREAM_IDLE_TIMEOUT,
            poll_initial: DEFAULT_POLL_INITIAL,
            poll_max: DEFAULT_POLL_MAX,
            follow_outage: DEFAULT_FOLLOW_OUTAGE,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        }
    }
}

/// Why a client for an agent could not be set up (configuration, not a call).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpstreamConfigError {
    /// The card declares no `JSONRPC` interface.
    #[error("the agent card {0:?} declares no JSONRPC interface")]
    NoJsonRpcInterface(String),
    /// The endpoint is not an absolute http(s) URL.
    #[error("{0}")]
    BadUrl(String),
}
