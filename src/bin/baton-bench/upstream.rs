//! The fast upstream: a single-threaded hyper server (a current-thread tokio
//! runtime on its own OS thread) that plays minimal A2A 1.0 agents on
//! loopback. It answers at once with fixed results, so what the benchmark
//! sees through Baton is Baton's cost, not the agent's.
//!
//! The path chooses the agent: `/transfer-source` answers with a handoff
//! payload, `/typed-target` with a typed data artifact, anything else is
//! `fast`. A streaming message whose messageId starts with [`HOLD_PREFIX`]
//! keeps its task WORKING until [`FakeUpstream::release`] (or
//! [`HOLD_LIMIT`]), so Baton can be given tasks in flight on demand.

use anyhow::Context as _;
use bytes::Bytes;
use futures::StreamExt as _;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt as _, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use serde_json::json;
use serde_json::value::RawValue;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{oneshot, watch};

/// A streaming message with this messageId prefix is held WORKING.
pub const HOLD_PREFIX: &str = "hold-";

/// A streaming message with this messageId prefix, followed by a count and
/// a dash (`long-2000-…`), is answered with that many chunks of one artifact.
pub const LONG_PREFIX: &str = "long-";

/// Each chunk of a long stream: 1 KiB of text, one every millisecond, as a
/// model streaming a long answer (paced, so each is its own write).
const LONG_CHUNK_BYTES: usize = 1024;
const LONG_CHUNK_GAP: Duration = Duration::from_millis(1);

/// Longest a held stream stays open without a release.
pub const HOLD_LIMIT: Duration = Duration::from_secs(120);

/// Largest request body the upstream reads.
const MAX_BODY: usize = 1 << 20;

/// Which of the upstream's agents a request is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentKind {
    /// Completes every task at once.
    Fast,
    /// Completes its own task with a handoff payload to `typed-target`.
    TransferSource,
    /// Completes with a data artifact that satisfies the payload's returnSchema.
    TypedTarget,
}

impl AgentKind {
    /// The path prefix of the agent's JSON-RPC interface and card.
    pub fn path(self) -> &'static str {
        match self {
            Self::Fast => "/fast",
            Self::TransferSource => "/transfer-source",
            Self::TypedTarget => "/typed-target",
        }
    }

    fn for_path(path: &str) -> Self {
        [Self::TransferSource, Self::TypedTarget]
            .into_iter()
            .find(|kind| path.starts_with(kind.path()))
            .unwrap_or(Self::Fast)
    }
}

/// The AgentCard of one of the upstream's agents at `base` (`http://ip:port`).
pub fn agent_card(base: &str, kind: AgentKind, name: &str, streaming: bool) -> serde_json::Value {
    json!({
        "name": name,
        "description": "Benchmark upstream: answers every call at once with a fixed result.",
        "supportedInterfaces": [
            {"url": format!("{base}{}", kind.path()), "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}
        ],
        "version": "1.0.0",
        "capabilities": {"streaming": streaming},
        "defaultInputModes": ["text/plain", "application/json"],
        "defaultOutputModes": ["text/plain", "application/json"],
        "skills": [{
            "id": "bench",
            "name": "Benchmark",
            "description": "Completes every task.",
            "tags": ["benchmark"]
        }]
    })
}

/// The running upstream; stops when dropped.
pub struct FakeUpstream {
    /// Where it listens.
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

struct Shared {
    base: String,
    next_task: AtomicU64,
    /// Held streams still open.
    held: AtomicUsize,
    /// Bumped by `release`; a held stream ends once it moves past its start value.
    gate: watch::Sender<u64>,
}

impl FakeUpstream {
    /// Binds 127.0.0.1 on a free port and serves on a new OS thread.
    pub fn start() -> anyhow::Result<Self> {
        let listener =
            std::net::TcpListener::bind("127.0.0.1:0").context("binding the upstream")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            base: format!("http://{addr}"),
            next_task: AtomicU64::new(1),
            held: AtomicUsize::new(0),
            gate: watch::channel(0).0,
        });
        let (stop, stopped) = oneshot::channel();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let serving = shared.clone();
        let thread = std::thread::Builder::new()
            .name("fake-upstream".into())
            .spawn(move || runtime.block_on(serve(listener, serving, stopped)))?;
        Ok(Self {
            addr,
            shared,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// `http://ip:port`.
    pub fn base_url(&self) -> &str {
        &self.shared.base
    }

    /// How many held streams are open.
    pub fn held(&self) -> usize {
        self.shared.held.load(Ordering::SeqCst)
    }

    /// Lets every held stream finish its task now.
    pub fn release(&self) {
        self.shared.gate.send_modify(|generation| *generation += 1);
    }
}

impl Drop for FakeUpstream {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

async fn serve(
    listener: std::net::TcpListener,
    shared: Arc<Shared>,
    mut stopped: oneshot::Receiver<()>,
) {
    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
        return;
    };
    loop {
        let stream = tokio::select! {
            _ = &mut stopped => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                // Out of descriptors or similar: back off instead of spinning.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request| handle(request, shared.clone()));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

type Body = BoxBody<Bytes, Infallible>;

fn full(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    let mut response = Response::new(Full::new(body.into()).boxed());
    *response.status_mut() = status;
    if let Ok(value) = content_type.parse() {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, value);
    }
    response
}

/// The parts of a JSON-RPC request the upstream reads.
#[derive(Deserialize)]
struct Envelope {
    id: Box<RawValue>,
    method: String,
    #[serde(default)]
    params: Params,
}

#[derive(Default, Deserialize)]
struct Params {
    #[serde(default)]
    message: Option<MessageIds>,
    #[serde(default)]
    id: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct MessageIds {
    #[serde(default)]
    message_id: String,
    #[serde(default)]
    context_id: String,
}

async fn handle(
    request: Request<Incoming>,
    shared: Arc<Shared>,
) -> Result<Response<Body>, Infallible> {
    let path = request.uri().path().to_owned();
    let kind = AgentKind::for_path(&path);
    if request.method() == hyper::Method::GET {
        if path.ends_with("/.well-known/agent-card.json") {
            let card = agent_card(&shared.base, kind, "fast", false);
            return Ok(full(StatusCode::OK, "application/json", card.to_string()));
        }
        return Ok(full(StatusCode::NOT_FOUND, "text/plain", "not found"));
    }
    let body = match Limited::new(request.into_body(), MAX_BODY).collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => {
            return Ok(full(
                StatusCode::PAYLOAD_TOO_LARGE,
                "text/plain",
                "too large",
            ));
        }
    };
    let Ok(envelope) = serde_json::from_slice::<Envelope>(&body) else {
        let error =
            r#"{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"parse error"}}"#;
        return Ok(full(StatusCode::OK, "application/json", error));
    };
    Ok(answer(kind, envelope, &shared))
}

fn answer(kind: AgentKind, envelope: Envelope, shared: &Arc<Shared>) -> Response<Body> {
    let id = envelope.id.get();
    let (message_id, context_id) = match &envelope.params.message {
        Some(m) if !m.context_id.is_empty() => (m.message_id.as_str(), m.context_id.as_str()),
        Some(m) => (m.message_id.as_str(), "ctx-upstream"),
        None => ("", "ctx-upstream"),
    };
    let task_id = || format!("up-{}", shared.next_task.fetch_add(1, Ordering::Relaxed));
    let json_reply =
        |result: &str| full(StatusCode::OK, "application/json", rpc_result(id, result));
    match envelope.method.as_str() {
        "SendMessage" => json_reply(&send_result(kind, &task_id(), context_id)),
        "SendStreamingMessage" if message_id.starts_with(HOLD_PREFIX) => {
            held_stream(id, &task_id(), context_id, shared)
        }
        "SendStreamingMessage" if message_id.starts_with(LONG_PREFIX) => {
            let chunks = message_id[LONG_PREFIX.len()..]
                .split('-')
                .next()
                .and_then(|count| count.parse().ok())
                .unwrap_or(1);
            long_stream(id, &task_id(), context_id, chunks)
        }
        "SendStreamingMessage" => {
            let task_id = task_id();
            let events: String = fast_stream(&task_id, context_id)
                .iter()
                .map(|event| sse_event(id, event))
                .collect();
            full(StatusCode::OK, "text/event-stream", events)
        }
        // Baton polls or recovers only when a stream breaks; answer as done.
        "GetTask" => {
            let task_id = envelope.params.id.as_deref().unwrap_or("up-0");
            json_reply(&task_json(task_id, "ctx-upstream", "TASK_STATE_COMPLETED"))
        }
        "CancelTask" => {
            let task_id = envelope.params.id.as_deref().unwrap_or("up-0");
            json_reply(&task_json(task_id, "ctx-upstream", "TASK_STATE_CANCELED"))
        }
        _ => full(
            StatusCode::OK,
            "application/json",
            format!(
                r#"{{"jsonrpc":"2.0","id":{id},"error":{{"code":-32601,"message":"method not found"}}}}"#
            ),
        ),
    }
}

fn rpc_result(id: &str, result: &str) -> String {
    format!(r#"{{"jsonrpc":"2.0","id":{id},"result":{result}}}"#)
}

fn sse_event(id: &str, result: &str) -> String {
    format!("data: {}\n\n", rpc_result(id, result))
}

fn task_json(task_id: &str, context_id: &str, state: &str) -> String {
    format!(
        r#"{{"task":{{"id":"{task_id}","contextId":"{context_id}","status":{{"state":"{state}"}}}}}}"#
    )
}

/// The SendMessage result of each agent: a completed task.
fn send_result(kind: AgentKind, task_id: &str, context_id: &str) -> String {
    let task = match kind {
        AgentKind::Fast => json!({
            "id": task_id, "contextId": context_id,
            "status": {"state": "TASK_STATE_COMPLETED"},
            "artifacts": [{"artifactId": "a1", "parts": [{"text": "ok"}]}]
        }),
        AgentKind::TransferSource => json!({
            "id": task_id, "contextId": context_id,
            "status": {"state": "TASK_STATE_COMPLETED", "message": {
                "messageId": format!("{task_id}-handoff"), "role": "ROLE_AGENT",
                "parts": [{"data": transfer_payload(), "mediaType": baton::handoff::payload::HANDOFF_MEDIA_TYPE}]
            }}
        }),
        AgentKind::TypedTarget => json!({
            "id": task_id, "contextId": context_id,
            "status": {"state": "TASK_STATE_COMPLETED"},
            "artifacts": [{"artifactId": "typed", "name": "quote",
                           "parts": [{"data": {"amount": 42.5, "currency": "EUR"}}]}]
        }),
    };
    json!({ "task": task }).to_string()
}

/// The payload `transfer-source` hands its task to `typed-target` with,
/// asking for a typed result (DESIGN.md §3.2, §3.3).
pub fn transfer_payload() -> serde_json::Value {
    json!({
        "handoffId": "hf_bench",
        "from": "transfer-source",
        "to": "typed-target",
        "reason": "specialization",
        "goal": "Quote an amount for the benchmark.",
        "summary": "The source agent hands the quote to the pricing agent.",
        "returnSchema": {
            "type": "object",
            "required": ["amount", "currency"],
            "properties": {"amount": {"type": "number"}, "currency": {"type": "string"}}
        }
    })
}

/// A task snapshot, a status update with a message, two artifact chunks and
/// the completion: five events.
fn fast_stream(task_id: &str, context_id: &str) -> [String; 5] {
    let ids = task_ids(task_id, context_id);
    [
        task_json(task_id, context_id, "TASK_STATE_WORKING"),
        format!(
            r#"{{"statusUpdate":{{{ids},"status":{{"state":"TASK_STATE_WORKING","message":{{"messageId":"{task_id}-m","role":"ROLE_AGENT","parts":[{{"text":"working"}}]}}}}}}}}"#
        ),
        format!(
            r#"{{"artifactUpdate":{{{ids},"artifact":{{"artifactId":"a1","parts":[{{"text":"chunk-1 "}}]}}}}}}"#
        ),
        format!(
            r#"{{"artifactUpdate":{{{ids},"artifact":{{"artifactId":"a1","parts":[{{"text":"chunk-2"}}]}},"append":true,"lastChunk":true}}}}"#
        ),
        completed_update(&ids),
    ]
}

/// A stream that reports the task WORKING, then `chunks` chunks of one
/// artifact, [`LONG_CHUNK_GAP`] apart, then completes it.
fn long_stream(id: &str, task_id: &str, context_id: &str, chunks: usize) -> Response<Body> {
    let ids = task_ids(task_id, context_id);
    let text = "x".repeat(LONG_CHUNK_BYTES);
    let chunk = |n: usize| {
        let (append, last) = (n > 0, n + 1 == chunks);
        format!(
            r#"{{"artifactUpdate":{{{ids},"artifact":{{"artifactId":"long","parts":[{{"text":"{text}"}}]}},"append":{append},"lastChunk":{last}}}}}"#
        )
    };
    let events: Vec<String> = std::iter::once(task_json(task_id, context_id, "TASK_STATE_WORKING"))
        .chain((0..chunks).map(chunk))
        .chain(std::iter::once(completed_update(&ids)))
        .collect();
    let id = id.to_owned();
    let frames = futures::stream::iter(events)
        .then(|event| async move {
            tokio::time::sleep(LONG_CHUNK_GAP).await;
            event
        })
        .map(move |event| Bytes::from(sse_event(&id, &event)));
    event_stream(frames)
}

/// The `"taskId":…,"contextId":…` members of an event about a task.
fn task_ids(task_id: &str, context_id: &str) -> String {
    format!(r#""taskId":"{task_id}","contextId":"{context_id}""#)
}

/// A status update completing the task its `ids` name.
fn completed_update(ids: &str) -> String {
    format!(r#"{{"statusUpdate":{{{ids},"status":{{"state":"TASK_STATE_COMPLETED"}}}}}}"#)
}

/// A `text/event-stream` response sending `frames` as they come.
fn event_stream(
    frames: impl futures::Stream<Item = Bytes> + Send + Sync + 'static,
) -> Response<Body> {
    let frames = frames.map(|bytes| Ok::<_, Infallible>(Frame::data(bytes)));
    let mut response = Response::new(http_body_util::BodyExt::boxed(StreamBody::new(frames)));
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/event-stream"),
    );
    response
}

/// Counts a held stream while it is open, however it ends.
struct HeldGuard(Arc<Shared>);

impl Drop for HeldGuard {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A stream that reports the task WORKING, waits for the gate, then sends an
/// artifact and completes.
fn held_stream(id: &str, task_id: &str, context_id: &str, shared: &Arc<Shared>) -> Response<Body> {
    let first = sse_event(id, &task_json(task_id, context_id, "TASK_STATE_WORKING"));
    let ids = task_ids(task_id, context_id);
    let rest = [
        format!(r#"{{"artifactUpdate":{{{ids},"artifact":{{"artifactId":"released","parts":[{{"text":"released"}}]}},"lastChunk":true}}}}"#),
        completed_update(&ids),
    ]
    .iter()
    .map(|event| sse_event(id, event))
    .collect::<String>();
    let mut gate = shared.gate.subscribe();
    let start = *gate.borrow_and_update();
    shared.held.fetch_add(1, Ordering::SeqCst);
    let guard = HeldGuard(shared.clone());
    let released = async move {
        let _guard = guard;
        let _ =
            tokio::time::timeout(HOLD_LIMIT, gate.wait_for(|generation| *generation > start)).await;
        Bytes::from(rest)
    };
    let frames = futures::stream::once(async move { Bytes::from(first) })
        .chain(futures::stream::once(released));
    event_stream(frames)
}
