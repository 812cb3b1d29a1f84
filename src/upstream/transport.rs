//! HTTP/1.1 to agents: hyper's pooled client, used directly.
//!
//! Calls to agents are on every relayed send, so they skip reqwest (which
//! Baton keeps for occasional fetches): reqwest clones each request's
//! headers for redirects and wraps each call in layers for redirects,
//! timeouts and URLs, ~5 % of a relayed send's instructions. What the agent
//! client needs is here: the outbound guard in the resolver (IP literals
//! are checked by the caller), a connect timeout, Nagle off. There is no
//! proxy and no redirect following at this level, so neither can bypass
//! the guard.

use crate::agents::AgentError;
use crate::netguard::{GuardedNames, OutboundPolicy};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use std::fmt::Display;
use std::time::Duration;

/// A pooled HTTP/1.1 client whose connections obey the outbound guard.
pub type Transport = Client<HttpConnector<GuardedNames>, Full<Bytes>>;

/// TCP keepalive on agent connections, as reqwest sets it: a pooled
/// connection whose peer vanished fails fast instead of at the request
/// timeout.
const KEEPALIVE: Duration = Duration::from_secs(15);

/// How long an idle pooled connection is kept.
const POOL_IDLE: Duration = Duration::from_secs(90);

/// A transport for one agent endpoint. `connect_timeout` bounds the name
/// lookup and the TCP connect each.
pub fn transport(policy: &OutboundPolicy, connect_timeout: Duration) -> Transport {
    let resolver = GuardedNames::new(policy, connect_timeout);
    let mut connector = HttpConnector::new_with_resolver(resolver);
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_nodelay(true);
    connector.set_keepalive(Some(KEEPALIVE));
    connector.set_keepalive_interval(Some(KEEPALIVE));
    connector.set_keepalive_retries(Some(3));
    Client::builder(TokioExecutor::new())
        // The timer lets the pool close idle connections in the background.
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(POOL_IDLE)
        .build(connector)
}

/// A failed exchange as the agent error it is: a timeout anywhere in its
/// causes is `Timeout`, anything else `Unreachable`, with every cause named.
pub fn failure(
    label: &(dyn Display + Sync),
    err: &(dyn std::error::Error + 'static),
) -> AgentError {
    let detail = format!("{label}: {}", error_chain(err));
    let mut cause = Some(err);
    while let Some(current) = cause {
        if current
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return AgentError::Timeout(detail);
        }
        cause = current.source();
    }
    AgentError::Unreachable(detail)
}

/// An error and its causes, which say what actually failed (refused,
/// reset, the guard's reason).
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Reads a whole body, refusing more than `limit` bytes: at once when its
/// Content-Length says so (hyper's exact size hint), else as it arrives.
pub async fn read_body(
    label: &(dyn Display + Sync),
    mut body: Incoming,
    limit: usize,
) -> Result<Vec<u8>, AgentError> {
    let too_large =
        || AgentError::InvalidResponse(format!("{label}: the answer is larger than {limit} bytes"));
    let declared = hyper::body::Body::size_hint(&body).exact();
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large());
    }
    let mut collected = Vec::with_capacity(declared.map_or(0, |len| len as usize));
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| failure(label, &e))?;
        if let Ok(data) = frame.into_data() {
            if collected.len() + data.len() > limit {
                return Err(too_large());
            }
            collected.extend_from_slice(&data);
        }
    }
    Ok(collected)
}

/// The next data of a streamed body: `None` at its end.
pub async fn next_chunk(
    label: &(dyn Display + Sync),
    body: &mut Incoming,
) -> Option<Result<Bytes, AgentError>> {
    loop {
        match body.frame().await? {
            Err(err) => return Some(Err(failure(label, &err))),
            // Trailers carry nothing an A2A stream uses.
            Ok(frame) => {
                if let Ok(data) = frame.into_data() {
                    return Some(Ok(data));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error with a cause, as hyper's errors come.
    #[derive(Debug)]
    struct Wrapped(std::io::Error);

    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("client error (Connect)")
        }
    }

    impl std::error::Error for Wrapped {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_timeout_among_the_causes_is_a_timeout_and_the_rest_unreachable() {
        let timed_out = Wrapped(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "HTTP connect timeout",
        ));
        let err = failure(&"SendMessage to x", &timed_out);
        assert!(
            matches!(&err, AgentError::Timeout(why) if why.ends_with("(Connect): HTTP connect timeout")),
            "{err:?}"
        );
        let refused = Wrapped(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        let err = failure(&"SendMessage to x", &refused);
        assert!(
            matches!(&err, AgentError::Unreachable(why) if why.contains("refused")),
            "{err:?}"
        );
    }
}
