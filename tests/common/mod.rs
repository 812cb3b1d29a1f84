//! Test harness: a real Baton on 127.0.0.1:0 over a sled ledger in a
//! temporary directory, a JSON-RPC client, an SSE reader, and test agents.
#![allow(dead_code)]

pub mod agents;

use baton::agents::{Agent, AgentHandle, builtin_agents};
use baton::auth::KeyStore;
use baton::gateway::{Gateway, GatewaySettings};
use baton::netguard::OutboundPolicy;
use baton::push::{PushDispatcher, PushSettings};
use baton::registry::fetch::CardFetcher;
use baton::registry::{Directory, Registry};
use baton::server::connections::ConnectionLimits;
use baton::server::{self, AppState, ServerSettings};
use baton::store::Ledger;
use futures::StreamExt;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

/// How long any single wait in a test may take before it fails.
pub const WAIT: Duration = Duration::from_secs(10);

/// A change to the gateway settings of one test.
type Tune = dyn FnOnce(&mut GatewaySettings);

/// Builds a Baton for one test.
pub struct BatonBuilder {
    agents: Vec<AgentHandle>,
    default_agent: String,
    push_enabled: bool,
    allow_loopback: bool,
    max_body_bytes: usize,
    connections: ConnectionLimits,
    push_settings: PushSettings,
    api_keys: Option<String>,
    routing: baton::handoff::routing::RoutingRules,
    tune: Option<Box<Tune>>,
    router_only: bool,
    tls: baton::tls::ClientTls,
}

fn directory_secured(registry: &Registry, keys: &KeyStore) {
    registry.directory().set_secured(!keys.is_open());
}

/// Upstream settings with short timeouts and quick polls, so that tests
/// against remote agents fail fast.
pub fn fast_upstream() -> baton::upstream::UpstreamSettings {
    baton::upstream::UpstreamSettings {
        request_timeout: Duration::from_secs(3),
        stream_idle_timeout: Duration::from_secs(5),
        poll_initial: Duration::from_millis(20),
        poll_max: Duration::from_millis(200),
        ..baton::upstream::UpstreamSettings::default()
    }
}

/// A builder with the built-in agents, `echo` as default, push on and
/// loopback webhooks allowed.
pub fn baton() -> BatonBuilder {
    BatonBuilder {
        agents: builtin_agents(),
        default_agent: "echo".into(),
        push_enabled: true,
        allow_loopback: true,
        max_body_bytes: 4 * 1024 * 1024,
        connections: ConnectionLimits::default(),
        push_settings: PushSettings {
            initial_backoff: Duration::from_millis(50),
            ..PushSettings::default()
        },
        api_keys: None,
        routing: Default::default(),
        router_only: false,
        tls: baton::tls::ClientTls::default(),
        tune: None,
    }
}

impl BatonBuilder {
    /// Adds an agent.
    pub fn agent(mut self, id: &str, agent: impl Agent) -> Self {
        self.agents.push(AgentHandle {
            id: id.into(),
            agent: Arc::new(agent),
        });
        self
    }

    /// Sets the default agent.
    pub fn default_agent(mut self, id: &str) -> Self {
        self.default_agent = id.into();
        self
    }

    /// Turns push notifications off.
    pub fn without_push(mut self) -> Self {
        self.push_enabled = false;
        self
    }

    /// At most `permits` push POSTs in flight at once.
    pub fn push_in_flight(mut self, permits: usize) -> Self {
        self.push_settings.max_in_flight = permits;
        self
    }

    /// Refuses loopback webhooks (the production default).
    pub fn without_loopback(mut self) -> Self {
        self.allow_loopback = false;
        self
    }

    /// Requires API keys: `"acme=KEY1,globex=KEY2"`.
    pub fn api_keys(mut self, keys: &str) -> Self {
        self.api_keys = Some(keys.into());
        self
    }

    /// Routing rules, as `[[route]]` tables in TOML.
    pub fn routing(mut self, toml_rules: &str) -> Self {
        #[derive(serde::Deserialize)]
        struct Rules {
            route: Vec<baton::handoff::routing::RouteRule>,
        }
        let rules: Rules = toml::from_str(toml_rules).expect("routing TOML");
        self.routing = baton::handoff::routing::RoutingRules::compile(&rules.route).expect("rules");
        self
    }

    /// Adjusts the gateway settings (ack timeout, retry delay, escalation).
    pub fn tune(mut self, tune: impl FnOnce(&mut GatewaySettings) + 'static) -> Self {
        self.tune = Some(Box::new(tune));
        self
    }

    /// Caps request bodies.
    pub fn max_body_bytes(mut self, bytes: usize) -> Self {
        self.max_body_bytes = bytes;
        self
    }

    /// Sets the bounds on inbound connections.
    pub fn connections(mut self, limits: ConnectionLimits) -> Self {
        self.connections = limits;
        self
    }

    /// Serves `server::app`, the router alone, instead of `server::run`,
    /// whose front door takes JSON-RPC calls past it.
    pub fn router_only(mut self) -> Self {
        self.router_only = true;
        self
    }

    /// Verifies `https` agents, cards and webhooks with `tls`'s roots.
    pub fn tls(mut self, tls: baton::tls::ClientTls) -> Self {
        self.tls = tls;
        self
    }

    /// Starts Baton on 127.0.0.1:0.
    pub async fn start(self) -> TestBaton {
        let dir = tempfile::tempdir().expect("temp dir");
        let ledger = Arc::new(Ledger::open(dir.path()).expect("open ledger"));
        let policy = OutboundPolicy {
            allow: if self.allow_loopback {
                vec!["127.0.0.0/8".parse().unwrap(), "::1/128".parse().unwrap()]
            } else {
                Vec::new()
            },
            tls: self.tls,
        };
        let push = PushDispatcher::start(&ledger, policy.clone(), self.push_settings);
        let shutdown_token = CancellationToken::new();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let base = format!("http://127.0.0.1:{}", addr.port());
        let directory = Arc::new(Directory::new(&base, self.push_enabled));
        let registry = Arc::new(Registry::new(
            ledger.clone(),
            directory.clone(),
            CardFetcher::new(policy.clone(), Duration::from_secs(2), 1024 * 1024),
            baton::launch::remote_agents(policy),
        ));
        for handle in self.agents {
            registry.add_builtin(handle, "local");
        }
        registry.reserve_ids(self.routing.tenant_labels().map(str::to_string));
        let mut settings = GatewaySettings {
            task_timeout: Duration::from_secs(30),
            push_enabled: self.push_enabled,
            routing: Arc::new(self.routing),
            ..GatewaySettings::default()
        };
        if let Some(tune) = self.tune {
            tune(&mut settings);
        }
        let gateway = Gateway::new(ledger.clone(), directory, push, settings, shutdown_token);
        let keys = KeyStore::load(None, self.api_keys.as_deref()).expect("test keys");
        directory_secured(&registry, &keys);
        let state = AppState::new(
            gateway.clone(),
            registry.clone(),
            keys,
            ServerSettings {
                public_url: base.clone(),
                default_agent: self.default_agent,
                max_body_bytes: self.max_body_bytes,
                connections: self.connections,
            },
        );
        let (stop, stopped) = oneshot::channel::<()>();
        let stopped = async move {
            let _ = stopped.await;
        };
        let server = if self.router_only {
            let router = server::app(state).into_make_service();
            tokio::spawn(async move {
                let served = axum::serve(listener, router).with_graceful_shutdown(stopped);
                served.await.expect("the router serves until stopped");
            })
        } else {
            tokio::spawn(server::run(
                listener,
                state,
                stopped,
                Duration::from_secs(2),
            ))
        };
        TestBaton {
            base,
            http: reqwest::Client::new(),
            gateway,
            registry,
            ledger,
            next_id: AtomicU64::new(1),
            stop: Some(stop),
            server,
            _dir: dir,
        }
    }
}

/// A running Baton.
pub struct TestBaton {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    /// A plain HTTP client.
    pub http: reqwest::Client,
    /// The gateway inside.
    pub gateway: Arc<Gateway>,
    /// Its ledger.
    pub ledger: Arc<Ledger>,
    /// Its agent registry.
    pub registry: Arc<Registry>,
    next_id: AtomicU64,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<()>,
    _dir: tempfile::TempDir,
}

/// A reply as seen on the wire.
pub struct Reply {
    /// HTTP status.
    pub status: reqwest::StatusCode,
    /// Response headers.
    pub headers: reqwest::header::HeaderMap,
    /// The JSON body.
    pub body: Value,
}

impl Reply {
    /// The JSON-RPC error code, if the reply is an error.
    pub fn code(&self) -> Option<i64> {
        self.body["error"]["code"].as_i64()
    }

    /// The JSON-RPC result; panics on an error reply.
    pub fn result(&self) -> &Value {
        assert!(
            self.body.get("error").is_none(),
            "expected a result, got {}",
            self.body
        );
        &self.body["result"]
    }
}

impl TestBaton {
    /// Full URL of a path.
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// Posts raw bytes with the given headers.
    pub async fn post_raw(
        &self,
        path: &str,
        body: impl Into<reqwest::Body>,
        headers: &[(&str, &str)],
    ) -> Reply {
        let mut request = self.http.post(self.url(path)).body(body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = tokio::time::timeout(WAIT, request.send())
            .await
            .expect("reply in time")
            .expect("HTTP request");
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = response.bytes().await.expect("body");
        let body = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
            panic!(
                "non-JSON reply {status}: {}",
                String::from_utf8_lossy(&bytes)
            )
        });
        Reply {
            status,
            headers,
            body,
        }
    }

    /// Posts a JSON value with the standard A2A headers.
    pub async fn post_json(&self, path: &str, body: &Value) -> Reply {
        self.post_raw(path, body.to_string(), &STANDARD_HEADERS)
            .await
    }

    /// The Prometheus text Baton serves at `/metrics`.
    pub async fn metrics(&self) -> String {
        let response = self.http.get(self.url("/metrics")).send().await.unwrap();
        response.text().await.unwrap()
    }

    /// Calls a method on `path` (e.g. `/a2a`).
    pub async fn call_at(&self, path: &str, method: &str, params: Value) -> Reply {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.post_json(
            path,
            &json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}),
        )
        .await
    }

    /// SendMessage of `message` to the scenario agent's own endpoint.
    pub async fn send_to_scenario(&self, message: Value) -> Reply {
        self.call_at(
            "/agents/scenario/a2a",
            "SendMessage",
            json!({"message": message}),
        )
        .await
    }

    /// Calls a method on `path` as the agency holding API key `key`.
    pub async fn call_as(&self, path: &str, key: &str, method: &str, params: Value) -> Reply {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let body = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        let authorization = format!("Bearer {key}");
        let mut headers = STANDARD_HEADERS.to_vec();
        headers.push(("authorization", &authorization));
        self.post_raw(path, body.to_string(), &headers).await
    }

    /// Calls a method on `/a2a`.
    pub async fn call(&self, method: &str, params: Value) -> Reply {
        self.call_at("/a2a", method, params).await
    }

    /// SendMessage of a text to `/a2a`, returning the result.
    pub async fn send_text(&self, message_id: &str, text: &str, extra: Value) -> Value {
        let mut params = json!({"message": user_message(message_id, text)});
        merge(&mut params, extra);
        self.call("SendMessage", params).await.result().clone()
    }

    /// Opens an SSE stream and reads events until it ends (or `max` events).
    pub async fn stream_at(&self, path: &str, method: &str, params: Value, max: usize) -> SseReply {
        let response = self.open_stream(path, method, params).await;
        read_sse(response, max).await
    }

    /// Opens an SSE request and returns the response without reading it.
    pub async fn open_stream(&self, path: &str, method: &str, params: Value) -> reqwest::Response {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let body = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        let mut request = self.http.post(self.url(path)).body(body.to_string());
        for (name, value) in STANDARD_HEADERS {
            request = request.header(name, value);
        }
        tokio::time::timeout(WAIT, request.header("accept", "text/event-stream").send())
            .await
            .expect("stream opens in time")
            .expect("HTTP request")
    }

    /// Stops the server.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = tokio::time::timeout(WAIT, &mut self.server).await;
    }
}

/// Serves `app` on 127.0.0.1:0 for the rest of the test; its base URL,
/// `http://127.0.0.1:PORT`.
pub async fn serve_on_loopback(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    base
}

/// The headers every A2A 1.0 client sends.
pub const STANDARD_HEADERS: [(&str, &str); 2] =
    [("content-type", "application/json"), ("a2a-version", "1.0")];

/// What an SSE response held.
pub struct SseReply {
    /// The response Content-Type.
    pub content_type: String,
    /// Each `data:` payload, parsed.
    pub events: Vec<Value>,
    /// Whether the server closed the stream (rather than `max` being reached).
    pub closed: bool,
}

/// Reads SSE `data:` events until the stream closes or `max` arrive.
pub async fn read_sse(response: reqwest::Response, max: usize) -> SseReply {
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let mut events = Vec::new();
    let mut buffer = String::new();
    let mut body = response.bytes_stream();
    let mut closed = false;
    let read = async {
        while let Some(chunk) = body.next().await {
            buffer.push_str(&String::from_utf8_lossy(&chunk.expect("stream chunk")));
            while let Some(end) = buffer.find("\n\n") {
                let frame: String = buffer.drain(..end + 2).collect();
                for line in frame.lines() {
                    if let Some(data) = line.strip_prefix("data:") {
                        events.push(serde_json::from_str(data.trim()).expect("event is JSON"));
                    }
                }
                if events.len() >= max {
                    return;
                }
            }
        }
        closed = true;
    };
    tokio::time::timeout(WAIT, read)
        .await
        .expect("stream ends in time");
    SseReply {
        content_type,
        events,
        closed,
    }
}

/// A user message with one text part.
pub fn user_message(message_id: &str, text: &str) -> Value {
    json!({"messageId": message_id, "role": "ROLE_USER", "parts": [{"text": text}]})
}

/// A user message with one text part on the existing task `task_id` (an
/// answer, or a follow-up).
pub fn user_message_on(task_id: impl serde::Serialize, message_id: &str, text: &str) -> Value {
    let mut message = user_message(message_id, text);
    message["taskId"] = json!(task_id);
    message
}

/// Shallow-merges the members of `extra` into `target`.
pub fn merge(target: &mut Value, extra: Value) {
    if let (Some(target), Value::Object(extra)) = (target.as_object_mut(), extra) {
        target.extend(extra);
    }
}

/// A fresh unique message id with a prefix.
pub fn message_id(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// A handoff payload from `from` with a fresh handoffId, merged with
/// `target` (`{"to": ...}` or `{"toSkill": ...}`) and `extra`.
pub fn handoff_payload(from: &str, target: Value, extra: Value) -> Value {
    let mut payload = json!({
        "handoffId": format!("hf_{}", message_id("x")),
        "from": from,
        "reason": "specialization",
        "goal": "Refund the duplicate March charge.",
        "summary": "The customer was charged twice for invoice INV-0342.",
        "keyFacts": {"invoice": "INV-0342", "amount": 42.0},
    });
    merge(&mut payload, target);
    merge(&mut payload, extra);
    payload
}

/// The part carrying the handoff `payload`.
pub fn handoff_part(payload: Value) -> Value {
    json!({"data": payload, "mediaType": baton::handoff::payload::HANDOFF_MEDIA_TYPE})
}

/// A user message whose one part is the handoff `payload`.
pub fn handoff_message(payload: Value) -> Value {
    json!({
        "messageId": message_id("h"),
        "role": "ROLE_USER",
        "parts": [handoff_part(payload)]
    })
}

/// The headers of a JSON-RPC post that sets `Baton-Deadline`.
pub fn deadline_headers(deadline: &str) -> [(&'static str, &str); 3] {
    [
        ("content-type", "application/json"),
        ("a2a-version", "1.0"),
        ("baton-deadline", deadline),
    ]
}

/// The names of the task's artifacts, in order.
pub fn artifact_names(task: &Value) -> Vec<&str> {
    task["artifacts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a["name"].as_str())
        .collect()
}

/// The reason code in a status message (`application/vnd.baton.status.v1+json`), or "".
pub fn reason_of(message: &Value) -> &str {
    message["parts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["mediaType"] == "application/vnd.baton.status.v1+json")
        .and_then(|p| p["data"]["reason"].as_str())
        .unwrap_or("")
}

/// Polls `done` until it holds; fails the test as `what` past `WAIT`.
pub async fn wait_until(what: &str, done: impl Fn() -> bool) {
    let until = std::time::Instant::now() + WAIT;
    while !done() {
        assert!(std::time::Instant::now() < until, "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The reason code of a task's current status.
pub fn reason(task: &Value) -> &str {
    reason_of(&task["status"]["message"])
}

/// The counts of `baton_task_transition_seconds` in a Prometheus `text`,
/// each as its labels and count (`{from="…",to="…"} 1`).
pub fn transition_counts(text: &str) -> Vec<&str> {
    text.lines()
        .filter_map(|line| line.strip_prefix("baton_task_transition_seconds_count"))
        .collect()
}

impl TestBaton {
    /// Sends "work" to agent `id` (SendMessage on `/agents/{id}/a2a`), which
    /// must end the task FAILED with reason `expected`; the task.
    pub async fn send_fails_with(&self, id: &str, expected: &str) -> Value {
        let params = json!({"message": user_message(&message_id("m"), "work")});
        let path = format!("/agents/{id}/a2a");
        let reply = self.call_at(&path, "SendMessage", params).await;
        let task = reply.result()["task"].clone();
        assert_eq!(task["status"]["state"], "TASK_STATE_FAILED", "{task}");
        assert_eq!(reason(&task), expected);
        task
    }

    /// A registry JSON-RPC call at `/registry`.
    pub async fn registry(&self, method: &str, params: Value) -> Reply {
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params});
        self.post_json("/registry", &body).await
    }

    /// The card this Baton publishes for its agent `agent`.
    pub async fn published_card(&self, agent: &str) -> Value {
        let url = self.url(&format!("/agents/{agent}/.well-known/agent-card.json"));
        let response = tokio::time::timeout(WAIT, self.http.get(url).send())
            .await
            .expect("card in time")
            .expect("card fetch");
        response.json().await.expect("card JSON")
    }

    /// Polls GetTask on `path` until the task reaches `state`; panics after [`WAIT`].
    /// Waits for task `task_id` to fail with `DEADLINE_EXCEEDED`, and
    /// checks it did so within `bound` of `deadline`; returns the task.
    pub async fn failed_at_deadline(
        &self,
        path: &str,
        task_id: &str,
        deadline: chrono::DateTime<chrono::Utc>,
        bound: chrono::Duration,
    ) -> Value {
        let failed = self
            .wait_for_state(path, task_id, "TASK_STATE_FAILED")
            .await;
        assert_eq!(reason(&failed), "DEADLINE_EXCEEDED", "{failed}");
        let late = chrono::Utc::now() - deadline;
        assert!(late < bound, "failed {late} after the deadline");
        failed
    }

    pub async fn wait_for_state(&self, path: &str, task_id: &str, state: &str) -> Value {
        let wait = async {
            loop {
                let reply = self.call_at(path, "GetTask", json!({"id": task_id})).await;
                let task = reply.result().clone();
                if task["status"]["state"] == state {
                    return task;
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        };
        tokio::time::timeout(WAIT, wait)
            .await
            .unwrap_or_else(|_| panic!("task {task_id} did not reach {state} in time"))
    }
}
