//! HTTP/1.1 to agents: hyper used directly.
//!
//! Calls to agents are on every relayed send, so they skip reqwest (which
//! Baton keeps for occasional fetches): reqwest clones each request's
//! headers for redirects and wraps each call in layers for redirects,
//! timeouts and URLs, ~5 % of a relayed send's instructions. What the agent
//! client needs is here: the outbound guard in the resolver (IP literals
//! are checked by the caller), a connect timeout, Nagle off. There is no
//! proxy and no redirect following at this level, so neither can bypass
//! the guard.
//!
//! Unary calls to an `http` endpoint go over a small pool of plain TCP
//! connections, each exchange written and read by its caller ([`http1`]):
//! a stack of idle connections, checked out and given back once the answer
//! is read and the request all sent; a sweeper closes those idle past 90 s
//! or closed by the agent. hyper-util's pooled
//! client, which streams and anything else use, cost ~8 k instructions more
//! per call than hyper's own connections (its pool key hashing, checkout
//! future, request extensions), and those ~15 k more than the caller's own
//! exchange (a connection task, and channels to it each way). `https`
//! endpoints go over hyper-util's client through rustls, verified against
//! [`OutboundPolicy::tls`].

use super::client::VERSION_HEADER_NAME;
use super::http1::{self, Answer, Failed, Outgoing};
use crate::agents::AgentError;
use crate::netguard::{GuardedNames, OutboundPolicy};
use crate::protocol::PROTOCOL_VERSION;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderName, HeaderValue};
use hyper::{Method, Request, Uri};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use std::collections::VecDeque;
use std::fmt::Display;
use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tokio::net::TcpStream;
use tower_service::Service as _;

/// TCP keepalive on agent connections, as reqwest sets it: a pooled
/// connection whose peer vanished fails fast instead of at the request
/// timeout.
const KEEPALIVE: Duration = Duration::from_secs(15);

/// How long an idle pooled connection is kept.
const POOL_IDLE: Duration = Duration::from_secs(90);

/// Most idle connections kept to one endpoint.
const MAX_IDLE: usize = 256;

/// Room for a typical request's head, which then never regrows.
const HEAD_CAPACITY: usize = 512;

/// How often expired idle connections are closed.
const SWEEP_EVERY: Duration = Duration::from_secs(30);

/// How long a connection whose agent answered before reading all of the
/// request may take to send the rest, and be kept; else it is closed (an
/// agent that refused a large request may never read it). Short under
/// test, where only that bound matters.
const FINISH_SENDING: Duration = if cfg!(test) {
    Duration::from_millis(500)
} else {
    Duration::from_secs(5)
};

/// HTTP/1.1 to one agent endpoint, every connection obeying the outbound
/// guard.
pub struct Transport {
    /// hyper-util's pooled client: streams, and endpoints the direct pool
    /// does not take.
    client: Client<HttpsConnector<HttpConnector<GuardedNames>>, Full<Bytes>>,
    connector: HttpConnector<GuardedNames>,
    /// The endpoint, as hyper's client takes it.
    uri: Uri,
    /// The endpoint as the direct pool sends to it (`http` URLs only).
    direct: Option<Endpoint>,
    pool: Arc<Pool>,
    /// Whether the pool's sweeper runs (it starts with the first connection,
    /// on the runtime).
    sweeping: AtomicBool,
}

/// Idle direct connections, the most recently used last.
#[derive(Default)]
struct Pool {
    idle: Mutex<VecDeque<IdleConnection>>,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("direct", &self.direct.is_some())
            .finish_non_exhaustive()
    }
}

/// Where requests to an endpoint go, as HTTP/1 writes them.
struct Endpoint {
    /// Scheme and authority, for the connector.
    origin: Uri,
    /// What follows the method in every request's head: the target in
    /// origin form (`/path?query`), the version and the Host line.
    after_method: Box<[u8]>,
}

struct IdleConnection {
    stream: TcpStream,
    since: Instant,
}

impl Transport {
    /// A transport for the endpoint `uri`. `connect_timeout` bounds the
    /// name lookup and the TCP connect each.
    pub fn new(uri: &Uri, policy: &OutboundPolicy, connect_timeout: Duration) -> Self {
        let resolver = GuardedNames::new(policy, connect_timeout);
        let mut connector = HttpConnector::new_with_resolver(resolver);
        connector.set_connect_timeout(Some(connect_timeout));
        connector.set_nodelay(true);
        connector.set_keepalive(Some(KEEPALIVE));
        connector.set_keepalive_interval(Some(KEEPALIVE));
        connector.set_keepalive_retries(Some(3));
        // The TLS layer takes `https` URLs; the direct pool stays on `http`.
        connector.enforce_http(false);
        let https = HttpsConnectorBuilder::new()
            .with_tls_config(rustls::ClientConfig::clone(&policy.tls.config()))
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector.clone());
        let client = Client::builder(TokioExecutor::new())
            // The timer lets the pool close idle connections in the background.
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(POOL_IDLE)
            .build(https);
        Self {
            client,
            connector,
            uri: uri.clone(),
            direct: Endpoint::for_uri(uri),
            pool: Arc::default(),
            sweeping: AtomicBool::new(false),
        }
    }

    /// The endpoint.
    #[cfg(test)]
    pub fn uri(&self) -> &Uri {
        &self.uri
    }

    /// Sends a request whose answer streams (hyper-util's client).
    pub fn stream(&self, call: Call<'_>) -> ResponseFuture {
        self.client.request(call.into_request(&self.uri))
    }

    /// One exchange: sends `request` and reads the whole answer, at most
    /// `limit` bytes of body. A request that never left (its pooled
    /// connection had closed) is sent again on another.
    pub async fn call(
        &self,
        call: Call<'_>,
        label: &(dyn Display + Sync),
        limit: usize,
    ) -> Result<Answer, AgentError> {
        let Some(endpoint) = &self.direct else {
            let response = self
                .client
                .request(call.into_request(&self.uri))
                .await
                .map_err(|e| failure(label, &e))?;
            let (parts, body) = response.into_parts();
            return Ok(Answer {
                status: parts.status,
                content_type: parts.headers.get(CONTENT_TYPE).cloned(),
                body: read_body(label, body, limit).await?,
            });
        };
        let request = endpoint.encode(call);
        loop {
            let (mut stream, pooled) = match self.pool.checkout() {
                Some(stream) => (stream, true),
                None => (self.connect(endpoint, label).await?, false),
            };
            match http1::exchange(&mut stream, &request, limit).await {
                Ok(exchanged) => {
                    if exchanged.reusable {
                        self.pool.give_back(stream, request, exchanged.sent);
                    }
                    return Ok(exchanged.answer);
                }
                // It never left: a pooled connection closed meanwhile.
                Err(Failed::Unsent(_)) if pooled => {}
                Err(failed) => return Err(agent_error(label, limit, failed)),
            }
        }
    }

    /// A new connection through the guarded connector.
    async fn connect(
        &self,
        endpoint: &Endpoint,
        label: &(dyn Display + Sync),
    ) -> Result<TcpStream, AgentError> {
        let mut connector = self.connector.clone();
        std::future::poll_fn(|cx| connector.poll_ready(cx))
            .await
            .map_err(|e| failure(label, &e))?;
        let io = connector
            .call(endpoint.origin.clone())
            .await
            .map_err(|e| failure(label, &e))?;
        if !self.sweeping.swap(true, Ordering::Relaxed) {
            tokio::spawn(Pool::sweep(Arc::downgrade(&self.pool)));
        }
        Ok(io.into_inner())
    }
}

/// A failed direct exchange as the agent error it is.
fn agent_error(label: &(dyn Display + Sync), limit: usize, failed: Failed) -> AgentError {
    match failed {
        Failed::Unsent(err) | Failed::Io(err) => failure(label, &err),
        Failed::Closed => AgentError::Unreachable(format!(
            "{label}: the agent closed the connection before answering"
        )),
        Failed::TooLarge => {
            AgentError::InvalidResponse(format!("{label}: the answer is larger than {limit} bytes"))
        }
        Failed::Malformed(why) => AgentError::InvalidResponse(format!("{label}: {why}")),
    }
}

impl Pool {
    /// The most recently used idle connection that is still open and young.
    fn checkout(&self) -> Option<TcpStream> {
        let mut unusable = Vec::new();
        let mut idle = self.idle.lock().expect("transport pool lock");
        let found = loop {
            let Some(idle_connection) = idle.pop_back() else {
                break None;
            };
            if idle_connection.usable(Instant::now()) {
                break Some(idle_connection.stream);
            }
            unusable.push(idle_connection);
        };
        drop(idle);
        // Closed outside the lock.
        drop(unusable);
        found
    }

    /// Keeps a connection whose exchange is over for the next call, once
    /// all of `request` has left, within [`FINISH_SENDING`]; else it is
    /// closed.
    fn give_back(self: &Arc<Self>, mut stream: TcpStream, request: Outgoing, sent: usize) {
        if sent == request.len() {
            self.keep(stream);
            return;
        }
        let pool = self.clone();
        tokio::spawn(async move {
            let finished = tokio::time::timeout(FINISH_SENDING, request.finish(&mut stream, sent));
            if matches!(finished.await, Ok(Ok(()))) {
                pool.keep(stream);
            }
        });
    }

    /// Keeps a connection, letting the oldest idle one go if the pool is full.
    fn keep(&self, stream: TcpStream) {
        let mut idle = self.idle.lock().expect("transport pool lock");
        let evicted = (idle.len() >= MAX_IDLE).then(|| idle.pop_front());
        idle.push_back(IdleConnection {
            stream,
            since: Instant::now(),
        });
        drop(idle);
        drop(evicted);
    }

    /// Closes idle connections that expired, in the background, until the
    /// pool is dropped.
    async fn sweep(pool: Weak<Pool>) {
        let mut tick = tokio::time::interval(SWEEP_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(pool) = pool.upgrade() else {
                return;
            };
            let now = Instant::now();
            let expired: VecDeque<IdleConnection> = {
                let mut idle = pool.idle.lock().expect("transport pool lock");
                let (kept, expired) = std::mem::take(&mut *idle)
                    .into_iter()
                    .partition(|connection| connection.usable(now));
                *idle = kept;
                expired
            };
            // Closed outside the lock.
            drop(expired);
        }
    }
}

impl IdleConnection {
    fn usable(&self, now: Instant) -> bool {
        now.duration_since(self.since) < POOL_IDLE && http1::is_open(&self.stream)
    }
}

impl Endpoint {
    /// The endpoint of an `http` URI; `None` for any other.
    fn for_uri(uri: &Uri) -> Option<Self> {
        if uri.scheme_str() != Some("http") {
            return None;
        }
        let authority = uri.authority()?;
        let origin = Uri::builder()
            .scheme("http")
            .authority(authority.clone())
            .path_and_query("/")
            .build()
            .ok()?;
        let target = uri.path_and_query().map_or("/", |p| p.as_str());
        // The port only when it is not the scheme's own, as clients write Host.
        let host = match uri.port_u16() {
            Some(80) | None => authority.host(),
            Some(_) => authority.as_str(),
        };
        let after_method = format!(" {target} HTTP/1.1\r\nhost: {host}\r\n");
        Some(Self {
            origin,
            after_method: after_method.into_bytes().into_boxed_slice(),
        })
    }

    /// `call` as it goes on the wire to this endpoint, its head written
    /// straight from its fields (no `HeaderMap`). The body goes with a
    /// Content-Length.
    fn encode(&self, call: Call<'_>) -> Outgoing {
        let mut head = Vec::with_capacity(HEAD_CAPACITY);
        head.extend_from_slice(b"POST");
        head.extend_from_slice(&self.after_method);
        call.for_each_header(|name, value| {
            head.extend_from_slice(name.as_bytes());
            head.extend_from_slice(b": ");
            head.extend_from_slice(value);
            head.extend_from_slice(b"\r\n");
        });
        let _ = write!(head, "content-length: {}\r\n\r\n", call.body.len());
        Outgoing {
            head,
            body: Bytes::from(call.body),
        }
    }
}

/// One call to an agent before it takes its transport's form: a POST of a
/// JSON-RPC body with A2A's headers.
pub struct Call<'a> {
    pub body: Vec<u8>,
    /// The media type asked for.
    pub accept: &'static str,
    /// Handoff control headers. The client checked their values: none has a
    /// control character, so each goes on the wire as it is.
    pub extra: &'a [(HeaderName, String)],
    pub authorization: Option<&'a HeaderValue>,
}

impl Call<'_> {
    /// Each of its headers, by name and value; Host and framing are the
    /// transport's.
    fn for_each_header(&self, mut header: impl FnMut(&str, &[u8])) {
        header(VERSION_HEADER_NAME.as_str(), PROTOCOL_VERSION.as_bytes());
        header(CONTENT_TYPE.as_str(), b"application/json");
        header(ACCEPT.as_str(), self.accept.as_bytes());
        for (name, value) in self.extra {
            header(name.as_str(), value.as_bytes());
        }
        if let Some(authorization) = self.authorization {
            header(AUTHORIZATION.as_str(), authorization.as_bytes());
        }
    }

    /// The call as hyper's client sends it to `uri`.
    fn into_request(self, uri: &Uri) -> Request<Full<Bytes>> {
        let mut headers = hyper::HeaderMap::with_capacity(5 + self.extra.len());
        self.for_each_header(|name, value| {
            // Every name is valid, and every value was checked.
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_bytes(value),
            ) {
                headers.append(name, value);
            }
        });
        let mut request = Request::new(Full::new(Bytes::from(self.body)));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = uri.clone();
        *request.headers_mut() = headers;
        request
    }
}

/// A failed exchange as the agent error it is: a timeout anywhere in its
/// causes is `Timeout`, anything else `Unreachable`, with every cause named.
pub fn failure(
    label: &(dyn Display + Sync),
    err: &(dyn std::error::Error + 'static),
) -> AgentError {
    let detail = format!("{label}: {}", error_chain(err));
    if has_io_cause(err, std::io::ErrorKind::TimedOut) {
        return AgentError::Timeout(detail);
    }
    AgentError::Unreachable(detail)
}

/// Whether `err` or one of its causes is an I/O error of `kind`.
pub fn has_io_cause(err: &(dyn std::error::Error + 'static), kind: std::io::ErrorKind) -> bool {
    std::iter::successors(Some(err), |current| current.source()).any(|current| {
        current
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == kind)
    })
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

    /// What a raw HTTP/1.1 agent saw: connections accepted, request heads.
    #[derive(Default)]
    struct Seen {
        connections: usize,
        heads: Vec<String>,
    }

    /// A raw HTTP/1.1 agent on loopback answering `{}`; with `close_after`
    /// it closes each connection after that many answers.
    async fn raw_agent(close_after: Option<usize>) -> (Uri, Arc<Mutex<Seen>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let uri: Uri = format!("http://{}/a2a/agent", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let seen = Arc::new(Mutex::new(Seen::default()));
        let record = seen.clone();
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                record.lock().unwrap().connections += 1;
                let record = record.clone();
                tokio::spawn(async move {
                    let mut answered = 0;
                    let mut buffer = Vec::new();
                    loop {
                        let mut chunk = [0u8; 4096];
                        let read = socket.read(&mut chunk).await.unwrap_or(0);
                        if read == 0 {
                            return;
                        }
                        buffer.extend_from_slice(&chunk[..read]);
                        // Bodies here are short and come with their head.
                        let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") else {
                            continue;
                        };
                        let head = String::from_utf8_lossy(&buffer[..end]).to_string();
                        let length = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length: "))
                            .map_or(0, |n| n.trim().parse::<usize>().unwrap());
                        if buffer.len() < end + 4 + length {
                            continue;
                        }
                        buffer.drain(..end + 4 + length);
                        record.lock().unwrap().heads.push(head);
                        let answer = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
                        socket.write_all(answer.as_bytes()).await.unwrap();
                        answered += 1;
                        if close_after == Some(answered) {
                            return;
                        }
                    }
                });
            }
        });
        (uri, seen)
    }

    fn loopback_policy() -> OutboundPolicy {
        OutboundPolicy {
            allow: vec!["127.0.0.0/8".parse().unwrap()],
            ..OutboundPolicy::default()
        }
    }

    fn post(body: Vec<u8>) -> Call<'static> {
        Call {
            body,
            accept: "application/json",
            extra: &[],
            authorization: None,
        }
    }

    #[tokio::test]
    async fn unary_calls_reuse_one_connection_in_origin_form_with_a_host() {
        let (uri, seen) = raw_agent(None).await;
        let transport = Transport::new(&uri, &loopback_policy(), Duration::from_secs(5));
        for _ in 0..3 {
            let answer = transport
                .call(post(b"{}".to_vec()), &"test", 1024)
                .await
                .unwrap();
            assert_eq!(
                (answer.status.as_u16(), answer.body.as_slice()),
                (200, &b"{}"[..])
            );
        }
        let seen = seen.lock().unwrap();
        assert_eq!(seen.connections, 1);
        assert_eq!(seen.heads.len(), 3);
        let authority = uri.authority().unwrap().as_str().to_string();
        for head in &seen.heads {
            assert!(head.starts_with("POST /a2a/agent HTTP/1.1\r\n"), "{head}");
            assert!(head.contains(&format!("\r\nhost: {authority}")), "{head}");
        }
    }

    #[tokio::test]
    async fn a_call_after_the_agent_closed_the_idle_connection_goes_on_a_new_one() {
        let (uri, seen) = raw_agent(Some(1)).await;
        let transport = Transport::new(&uri, &loopback_policy(), Duration::from_secs(5));
        for _ in 0..3 {
            transport
                .call(post(b"{}".to_vec()), &"test", 1024)
                .await
                .unwrap();
            // Long enough for the connection to see the close.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(seen.lock().unwrap().connections, 3);
    }

    /// More idle connections closed by the agent than a task's budget of
    /// readiness checks (128; spent on a worker of a multi-threaded
    /// runtime, as Baton's are): none of them is lent again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn many_idle_connections_the_agent_closed_are_all_passed_over() {
        let (uri, seen) = raw_agent(Some(1)).await;
        let transport = Transport::new(&uri, &loopback_policy(), Duration::from_secs(5));
        let calls = (0..200).map(|_| transport.call(post(b"{}".to_vec()), &"test", 1024));
        for answer in futures::future::join_all(calls).await {
            answer.unwrap();
        }
        // Long enough for the connections to see the closes.
        tokio::time::sleep(Duration::from_millis(100)).await;
        // In a task of its own, which has a budget, as a request's has.
        let call = tokio::spawn(async move {
            let answer = transport.call(post(b"{}".to_vec()), &"test", 1024).await;
            answer.map(|_| ()).map_err(|err| err.to_string())
        });
        call.await.unwrap().expect("a call on a new connection");
        assert_eq!(seen.lock().unwrap().connections, 201);
    }

    #[tokio::test]
    async fn a_connection_still_sending_when_answered_is_not_lent_again() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // The first connection is answered at once and never read further;
        // the others answer normally.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let uri: Uri = format!("http://{}/", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            for number in 0.. {
                let (mut socket, _) = listener.accept().await.unwrap();
                let mut head = [0u8; 1024];
                let _ = socket.read(&mut head).await.unwrap();
                let status = if number == 0 {
                    "413 Payload Too Large"
                } else {
                    "200 OK"
                };
                let answer = format!("HTTP/1.1 {status}\r\ncontent-length: 0\r\n\r\n");
                socket.write_all(answer.as_bytes()).await.unwrap();
                held.push(socket);
            }
        });
        let transport = Transport::new(&uri, &loopback_policy(), Duration::from_secs(5));
        let large = post(vec![b' '; 32 << 20]);
        let answer = transport.call(large, &"test", 1024).await.unwrap();
        assert_eq!(answer.status.as_u16(), 413);
        // Were the first connection lent again, this would wait for its
        // request to be sent, which never happens.
        let next = tokio::time::timeout(
            Duration::from_secs(3),
            transport.call(post(b"{}".to_vec()), &"test", 1024),
        )
        .await
        .expect("the next call does not wait for the first connection");
        assert_eq!(next.unwrap().status.as_u16(), 200);
    }

    #[tokio::test]
    async fn a_connection_answered_before_its_request_was_read_is_not_lent_until_all_sent() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        const BODY: usize = 8 << 20;
        // Each request is answered right after its head; its body is read
        // (and dropped) after that. Each connection reports its close.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let uri: Uri = format!("http://{}/", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let (closed_tx, mut closed) = tokio::sync::mpsc::unbounded_channel();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                let number = counter.fetch_add(1, Ordering::Relaxed);
                let closed_tx = closed_tx.clone();
                tokio::spawn(async move {
                    let mut chunk = vec![0u8; 64 * 1024];
                    // Body bytes still to come before the next head.
                    let mut unread = 0usize;
                    loop {
                        let read = socket.read(&mut chunk).await.unwrap_or(0);
                        if read == 0 {
                            let _ = closed_tx.send((number, unread));
                            return;
                        }
                        if unread >= read {
                            unread -= read;
                            continue;
                        }
                        let head = String::from_utf8_lossy(&chunk[unread..read]).to_string();
                        let length = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length: "))
                            .map_or(0, |n| n.trim().parse::<usize>().unwrap());
                        let end = head.find("\r\n\r\n").unwrap() + 4;
                        unread = length - (read - unread - end).min(length);
                        let answer = "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                        socket.write_all(answer.as_bytes()).await.unwrap();
                    }
                });
            }
        });
        let transport = Transport::new(&uri, &loopback_policy(), Duration::from_secs(5));
        let large = post(vec![b' '; BODY]);
        let answer = transport.call(large, &"test", 1024).await.unwrap();
        assert_eq!(answer.status.as_u16(), 200);
        let answer = transport
            .call(post(b"{}".to_vec()), &"test", 1024)
            .await
            .unwrap();
        assert_eq!(answer.status.as_u16(), 200);
        // Still sending when the second call came: not lent to it.
        assert_eq!(accepted.load(Ordering::Relaxed), 2);
        // Once its request is all sent, it is kept for the next call.
        let kept = async {
            while transport.pool.idle.lock().unwrap().len() < 2 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(FINISH_SENDING, kept)
            .await
            .expect("the first connection is kept once its request is all sent");
        assert!(closed.try_recv().is_err(), "no connection was closed");
    }

    #[tokio::test]
    async fn a_refused_connection_is_unreachable_and_names_the_call() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let uri: Uri = format!("http://{}/", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        drop(listener);
        let transport = Transport::new(&uri, &loopback_policy(), Duration::from_secs(5));
        let err = transport
            .call(post(b"{}".to_vec()), &"SendMessage to x", 1024)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, AgentError::Unreachable(why) if why.starts_with("SendMessage to x: ")),
            "{err:?}"
        );
    }

    #[test]
    fn only_http_endpoints_take_the_direct_pool() {
        let extra = [(HeaderName::from_static("x-hops"), "1".to_string())];
        let authorization = HeaderValue::from_static("Basic YQ==");
        let head = |uri: &str| {
            let endpoint = Endpoint::for_uri(&uri.parse().unwrap()).unwrap();
            let call = Call {
                body: b"{}".to_vec(),
                accept: "text/event-stream",
                extra: &extra,
                authorization: Some(&authorization),
            };
            String::from_utf8(endpoint.encode(call).head).unwrap()
        };
        assert_eq!(
            head("http://agent.example/a2a?x=1"),
            "POST /a2a?x=1 HTTP/1.1\r\nhost: agent.example\r\na2a-version: 1.0\r\n\
             content-type: application/json\r\naccept: text/event-stream\r\nx-hops: 1\r\n\
             authorization: Basic YQ==\r\ncontent-length: 2\r\n\r\n"
        );
        assert!(
            head("http://10.0.0.1:8080").starts_with("POST / HTTP/1.1\r\nhost: 10.0.0.1:8080\r\n")
        );
        assert!(Endpoint::for_uri(&"https://agent.example/".parse().unwrap()).is_none());
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
