//! A vendor agent kit: a minimal A2A 1.0 JSON-RPC agent of the kind another
//! vendor runs, with no Baton logic on its side of the wire, only the A2A
//! types. `baton demo` and the integration tests put Baton in front of a few
//! of these on ephemeral ports.
//!
//! Each agent answers by a script, a function from a [`Turn`] to a [`Reply`],
//! keeps its tasks in memory, and records every call it receives so that tests
//! can check what reached it, with which control headers, and when. Its card
//! declares `streaming: false`, so Baton forwards with `returnImmediately` and
//! polls `GetTask`.

use crate::handoff::payload::HANDOFF_MEDIA_TYPE;
use crate::protocol::{
    AgentCapabilities, AgentCard, AgentInterface, AgentSkill, Artifact, Message, Part, Task,
    TaskState, TaskStatus, methods,
};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Request headers kept in [`Received::headers`]: the handoff control of
/// DESIGN.md §3.1 and the protocol version.
pub const RECORDED_HEADERS: &[&str] = &[
    "traceparent",
    "tracestate",
    "baton-hops",
    "baton-chain",
    "baton-deadline",
    "a2a-version",
    "a2a-extensions",
];

/// How long [`Reply::Silent`] holds a request open before giving up.
const SILENT_HOLD: Duration = Duration::from_secs(60);

// JSON-RPC and A2A error codes, written out here because a vendor does not
// share Baton's error type.
const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;
const METHOD_NOT_FOUND: i64 = -32601;
const INVALID_PARAMS: i64 = -32602;
const TASK_NOT_FOUND: i64 = -32001;
const TASK_NOT_CANCELABLE: i64 = -32002;
const UNSUPPORTED_OPERATION: i64 = -32004;
const INTERNAL_ERROR: i64 = -32603;

/// What the script sees of one incoming message.
#[derive(Clone, Debug)]
pub struct Turn {
    /// The message as received.
    pub message: Message,
    /// Set when the message continues one of this agent's own tasks.
    pub task_id: Option<String>,
    /// That task's history at this agent before this message (empty for a new task).
    pub history: Vec<Message>,
}

/// How the agent answers a [`Turn`].
#[derive(Clone, Debug)]
pub enum Reply {
    /// The task COMPLETED with these artifacts, and the text as status message.
    Complete {
        /// Status message text, if any.
        text: Option<String>,
        /// The task's outputs.
        artifacts: Vec<Artifact>,
    },
    /// The task INPUT_REQUIRED, the question as status message.
    AskInput(String),
    /// A transfer (DESIGN.md §3.3): the status message carries `payload` as a
    /// data part of the handoff media type, and the task is left in `state`.
    Handoff {
        /// The handoff payload object.
        payload: Value,
        /// Usually COMPLETED or INPUT_REQUIRED.
        state: TaskState,
    },
    /// A direct Message reply; no task.
    Message(String),
    /// The task stays WORKING until canceled.
    Working,
    /// No answer at all: the request is held open (up to a minute, or until
    /// [`VendorAgent::stop`]), then answered -32603, to provoke acknowledgement
    /// timeouts. No task is created.
    Silent,
    /// The task FAILED, with this text as status message.
    Fail(String),
    /// The reply, with its task created at once but the answer held back
    /// this long (until [`VendorAgent::stop`] at most): a slow agent.
    Late(Duration, Box<Reply>),
    /// The task WORKING at once, in the answer too, and moved to the reply's
    /// status this much later, unless canceled first: a long job whose end
    /// only `GetTask` tells.
    Later(Duration, Box<Reply>),
}

impl Reply {
    /// A COMPLETED task with one artifact named `name` holding a JSON data
    /// part (`application/json`).
    pub fn artifact(name: &str, data: Value) -> Self {
        let mut part = Part::data(data);
        part.media_type = "application/json".into();
        Self::Complete {
            text: None,
            artifacts: vec![Artifact {
                artifact_id: uuid::Uuid::new_v4().to_string(),
                name: name.into(),
                parts: vec![part],
                ..Artifact::default()
            }],
        }
    }
}

/// One JSON-RPC call the agent received.
#[derive(Clone, Debug)]
pub struct Received {
    /// The JSON-RPC method.
    pub method: String,
    /// Its params, as sent.
    pub params: Value,
    /// The [`RECORDED_HEADERS`] present, by lower-case name.
    pub headers: BTreeMap<String, String>,
    /// When the call arrived.
    pub at: DateTime<Utc>,
}

type Script = dyn Fn(&Turn) -> Reply + Send + Sync;

/// What the handlers share. A std `Mutex` is enough: no lock is held across
/// an `.await`.
struct Inner {
    card: AgentCard,
    script: Box<Script>,
    tasks: Mutex<HashMap<String, Task>>,
    received: Mutex<Vec<Received>>,
    cancels: Mutex<Vec<(String, DateTime<Utc>)>>,
    /// New tasks get a context id of the agent's own ([`VendorAgent::mint_own_contexts`]).
    own_contexts: AtomicBool,
    shutdown: CancellationToken,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panicking script must not wedge the recorder for the rest of a test.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A running vendor agent on `127.0.0.1`.
pub struct VendorAgent {
    addr: SocketAddr,
    inner: Arc<Inner>,
    server: tokio::task::JoinHandle<()>,
}

impl VendorAgent {
    /// Starts on `127.0.0.1:0` with a card named `id` declaring `skills`,
    /// answering every message by `script`.
    pub async fn start(
        id: &str,
        skills: &[&str],
        script: impl Fn(&Turn) -> Reply + Send + Sync + 'static,
    ) -> std::io::Result<Self> {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let inner = Arc::new(Inner {
            card: vendor_card(id, skills, &format!("http://{addr}")),
            script: Box::new(script),
            tasks: Mutex::default(),
            received: Mutex::default(),
            cancels: Mutex::default(),
            own_contexts: AtomicBool::new(false),
            shutdown: CancellationToken::new(),
        });
        let app = Router::new()
            .route("/.well-known/agent-card.json", get(serve_card))
            .route("/a2a", post(serve_rpc))
            .with_state(inner.clone());
        let shutdown = inner.shutdown.clone();
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await;
        });
        Ok(Self {
            addr,
            inner,
            server,
        })
    }

    /// The base URL, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The agent's AgentCard, as served at `/.well-known/agent-card.json`.
    pub fn card(&self) -> AgentCard {
        self.inner.card.clone()
    }

    /// Every JSON-RPC call received so far, oldest first.
    pub fn received(&self) -> Vec<Received> {
        lock(&self.inner.received).clone()
    }

    /// Every SendMessage received so far, oldest first.
    pub fn sends(&self) -> Vec<Received> {
        lock(&self.inner.received)
            .iter()
            .filter(|call| call.method == "SendMessage")
            .cloned()
            .collect()
    }

    /// Every CancelTask received so far: the task id and the arrival time.
    pub fn cancels(&self) -> Vec<(String, DateTime<Utc>)> {
        lock(&self.inner.cancels).clone()
    }

    /// From now on a new task gets a context id of the agent's own, whatever
    /// context the caller named: accepting a client's `contextId` is a MAY
    /// (spec §3.4), so the agent's contexts may not be the gateway's.
    pub fn mint_own_contexts(&self) {
        self.inner.own_contexts.store(true, Ordering::Relaxed);
    }

    /// A copy of one of the agent's tasks.
    pub fn task(&self, id: &str) -> Option<Task> {
        lock(&self.inner.tasks).get(id).cloned()
    }

    /// Ends every task still open here COMPLETED, as an agent closing its
    /// tasks on its own would; returns how many it ended.
    pub fn complete_open_tasks(&self) -> usize {
        let mut tasks = lock(&self.inner.tasks);
        let open = tasks
            .values_mut()
            .filter(|task| !task.status.state.is_terminal());
        let mut ended = 0;
        for task in open {
            task.status = TaskStatus::now(TaskState::Completed, None);
            ended += 1;
        }
        ended
    }

    /// Stops serving; requests held by [`Reply::Silent`] are released.
    pub async fn stop(self) {
        self.inner.shutdown.cancel();
        let _ = self.server.await;
    }
}

/// A valid 1.0 card for a vendor agent at `base`.
fn vendor_card(id: &str, skills: &[&str], base: &str) -> AgentCard {
    let modes = vec!["text/plain".to_string(), "application/json".to_string()];
    AgentCard {
        name: id.into(),
        description: format!("{id}: a vendor agent (no Baton inside)"),
        supported_interfaces: vec![AgentInterface {
            url: format!("{base}/a2a"),
            protocol_binding: "JSONRPC".into(),
            tenant: String::new(),
            protocol_version: "1.0".into(),
        }],
        version: "1.0.0".into(),
        capabilities: AgentCapabilities {
            streaming: Some(false),
            push_notifications: Some(false),
            ..AgentCapabilities::default()
        },
        default_input_modes: modes.clone(),
        default_output_modes: modes,
        skills: skills
            .iter()
            .map(|skill| AgentSkill {
                id: (*skill).into(),
                name: (*skill).into(),
                description: format!("{id} handles {skill}"),
                tags: vec![(*skill).into()],
                ..AgentSkill::default()
            })
            .collect(),
        ..AgentCard::default()
    }
}

async fn serve_card(State(inner): State<Arc<Inner>>) -> Json<AgentCard> {
    Json(inner.card.clone())
}

/// A JSON-RPC failure: code and message.
type RpcError = (i64, String);

async fn serve_rpc(
    State(inner): State<Arc<Inner>>,
    headers: HeaderMap,
    body: String,
) -> Json<Value> {
    let request: Value = match serde_json::from_str(&body) {
        Ok(request) => request,
        Err(err) => return Json(rpc_reply(&Value::Null, Err((PARSE_ERROR, err.to_string())))),
    };
    let id = request.get("id").cloned().unwrap_or(Value::Null);
    let Some(method) = request.get("method").and_then(Value::as_str) else {
        return Json(rpc_reply(&id, Err((INVALID_REQUEST, "no method".into()))));
    };
    let params = request.get("params").cloned().unwrap_or(Value::Null);
    lock(&inner.received).push(Received {
        method: method.into(),
        params: params.clone(),
        headers: RECORDED_HEADERS
            .iter()
            .filter_map(|name| {
                let value = headers.get(*name)?.to_str().ok()?;
                Some((name.to_string(), value.to_string()))
            })
            .collect(),
        at: Utc::now(),
    });
    let result = match method {
        methods::SEND_MESSAGE => send_message(&inner, &params).await,
        methods::GET_TASK => task_id(&params).and_then(|id| {
            let tasks = lock(&inner.tasks);
            let task = tasks.get(&id).ok_or_else(|| not_found(&id))?;
            Ok(json!(task))
        }),
        methods::CANCEL_TASK => task_id(&params).and_then(|id| cancel(&inner, &id)),
        methods::SEND_STREAMING_MESSAGE => Err((
            UNSUPPORTED_OPERATION,
            "streaming is not supported; see capabilities.streaming".into(),
        )),
        other => Err((METHOD_NOT_FOUND, format!("unknown method {other}"))),
    };
    Json(rpc_reply(&id, result))
}

fn rpc_reply(id: &Value, result: Result<Value, RpcError>) -> Value {
    match result {
        Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
        Err((code, message)) => {
            json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
        }
    }
}

fn task_id(params: &Value) -> Result<String, RpcError> {
    match params.get("id").and_then(Value::as_str) {
        Some(id) if !id.is_empty() => Ok(id.into()),
        _ => Err((INVALID_PARAMS, "params.id is required".into())),
    }
}

fn not_found(id: &str) -> RpcError {
    (TASK_NOT_FOUND, format!("task {id} not found"))
}

fn cancel(inner: &Inner, id: &str) -> Result<Value, RpcError> {
    lock(&inner.cancels).push((id.into(), Utc::now()));
    let mut tasks = lock(&inner.tasks);
    let task = tasks.get_mut(id).ok_or_else(|| not_found(id))?;
    if task.status.state.is_terminal() {
        return Err((
            TASK_NOT_CANCELABLE,
            format!("task {id} is already finished"),
        ));
    }
    task.status = TaskStatus::now(TaskState::Canceled, None);
    Ok(json!(task))
}

async fn send_message(inner: &Arc<Inner>, params: &Value) -> Result<Value, RpcError> {
    let message: Message = params
        .get("message")
        .cloned()
        .and_then(|m| serde_json::from_value(m).ok())
        .ok_or_else(|| {
            (
                INVALID_PARAMS,
                "params.message is missing or invalid".into(),
            )
        })?;
    let return_immediately = params
        .pointer("/configuration/returnImmediately")
        .and_then(Value::as_bool)
        .unwrap_or(false);

    // A continuation resumes one of this agent's tasks; anything else is new.
    let (turn, mut task) = if message.task_id.is_empty() {
        let context_id =
            if message.context_id.is_empty() || inner.own_contexts.load(Ordering::Relaxed) {
                uuid::Uuid::new_v4().to_string()
            } else {
                message.context_id.clone()
            };
        let task = Task {
            id: uuid::Uuid::new_v4().to_string(),
            context_id,
            ..Task::default()
        };
        let turn = Turn {
            message: message.clone(),
            task_id: None,
            history: Vec::new(),
        };
        (turn, task)
    } else {
        let task = lock(&inner.tasks)
            .get(&message.task_id)
            .cloned()
            .ok_or_else(|| not_found(&message.task_id))?;
        if task.status.state.is_terminal() {
            return Err((
                UNSUPPORTED_OPERATION,
                format!("task {} is already finished", task.id),
            ));
        }
        let turn = Turn {
            message: message.clone(),
            task_id: Some(task.id.clone()),
            history: task.history.clone(),
        };
        (turn, task)
    };

    let (reply, held, settles_after) = match (inner.script)(&turn) {
        Reply::Late(held, reply) => (*reply, Some(held), None),
        Reply::Later(after, reply) => (*reply, None, Some(after)),
        reply => (reply, None, None),
    };
    let (state, status_text, artifacts, payload) = match reply {
        Reply::Message(text) => {
            let mut answer = Message::agent(vec![Part::text(text)]);
            answer.context_id = task.context_id;
            return Ok(json!({"message": answer}));
        }
        Reply::Silent => {
            tokio::select! {
                _ = tokio::time::sleep(SILENT_HOLD) => {}
                _ = inner.shutdown.cancelled() => {}
            }
            return Err((INTERNAL_ERROR, "the agent stayed silent".into()));
        }
        Reply::Complete { text, artifacts } => (TaskState::Completed, text, artifacts, None),
        Reply::AskInput(question) => (TaskState::InputRequired, Some(question), Vec::new(), None),
        Reply::Handoff { payload, state } => (state, None, Vec::new(), Some(payload)),
        Reply::Working => (TaskState::Working, None, Vec::new(), None),
        Reply::Fail(reason) => (TaskState::Failed, Some(reason), Vec::new(), None),
        Reply::Late(..) | Reply::Later(..) => {
            return Err((INTERNAL_ERROR, "a late reply must hold another".into()));
        }
    };

    let mut incoming = message;
    incoming.task_id = task.id.clone();
    incoming.context_id = task.context_id.clone();
    task.history.push(incoming);
    let mut parts: Vec<Part> = status_text.into_iter().map(Part::text).collect();
    if let Some(payload) = payload {
        let mut part = Part::data(payload);
        part.media_type = HANDOFF_MEDIA_TYPE.into();
        parts.push(part);
    }
    let status_message = (!parts.is_empty()).then(|| {
        let mut status = Message::agent(parts);
        status.task_id = task.id.clone();
        status.context_id = task.context_id.clone();
        status
    });
    task.artifacts.extend(artifacts);

    // With returnImmediately the caller sees the task WORKING and learns the
    // outcome by GetTask, as it would from a slower agent.
    let final_status = TaskStatus::now(state, status_message.clone());
    let answered_working = return_immediately || settles_after.is_some();
    task.status = if answered_working {
        TaskStatus::now(TaskState::Working, None)
    } else {
        final_status.clone()
    };
    if !answered_working {
        task.history.extend(status_message);
    }
    let answer = json!({"task": task});
    let id = task.id.clone();
    lock(&inner.tasks).insert(id.clone(), task);
    if let Some(after) = settles_after {
        let inner = inner.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(after) => settle(&inner, &id, final_status),
                _ = inner.shutdown.cancelled() => {}
            }
        });
    } else if return_immediately {
        settle(inner, &id, final_status);
    }
    if let Some(held) = held {
        tokio::select! {
            _ = tokio::time::sleep(held) => {}
            _ = inner.shutdown.cancelled() => {}
        }
    }
    Ok(answer)
}

/// Moves a task that was answered early to its scripted status, unless it
/// was canceled in between.
fn settle(inner: &Inner, id: &str, status: TaskStatus) {
    let mut tasks = lock(&inner.tasks);
    if let Some(task) = tasks.get_mut(id)
        && task.status.state == TaskState::Working
    {
        task.history.extend(status.message.clone());
        task.status = status;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn call(agent: &VendorAgent, method: &str, params: Value) -> Value {
        reqwest::Client::new()
            .post(format!("{}/a2a", agent.url()))
            .header("A2A-Version", "1.0")
            .json(&json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    fn user(text: &str, task_id: &str) -> Value {
        json!({"messageId": uuid::Uuid::new_v4().to_string(), "role": "ROLE_USER",
               "taskId": task_id, "parts": [{"text": text}]})
    }

    #[tokio::test]
    async fn answers_by_script_and_records_calls() {
        let agent = VendorAgent::start("billing", &["refunds"], |turn| match &turn.task_id {
            None => Reply::AskInput("which invoice?".into()),
            Some(_) if turn.history.len() == 2 => {
                Reply::artifact("refund", json!({"invoice": turn.message.text()}))
            }
            Some(_) => Reply::Fail("lost the thread".into()),
        })
        .await
        .unwrap();

        let card: Value = reqwest::get(format!("{}/.well-known/agent-card.json", agent.url()))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            card["supportedInterfaces"][0]["url"],
            format!("{}/a2a", agent.url())
        );
        assert_eq!(card["capabilities"]["streaming"], false);
        assert_eq!(card["skills"][0]["id"], "refunds");
        let validated = crate::registry::schema::CardValidator::shared().validate(&card);
        assert!(validated.is_ok(), "{validated:?}");

        let first = call(
            &agent,
            "SendMessage",
            json!({"message": user("refund", "")}),
        )
        .await;
        let task = &first["result"]["task"];
        assert_eq!(
            task["status"]["state"], "TASK_STATE_INPUT_REQUIRED",
            "{first}"
        );
        let id = task["id"].as_str().unwrap();

        let params =
            json!({"message": user("INV-0342", id), "configuration": {"returnImmediately": true}});
        let second = call(&agent, "SendMessage", params).await;
        assert_eq!(
            second["result"]["task"]["status"]["state"],
            "TASK_STATE_WORKING"
        );
        let got = call(&agent, "GetTask", json!({"id": id})).await;
        assert_eq!(
            got["result"]["status"]["state"], "TASK_STATE_COMPLETED",
            "{got}"
        );
        assert_eq!(got["result"]["artifacts"][0]["name"], "refund");
        assert_eq!(
            got["result"]["artifacts"][0]["parts"][0]["data"]["invoice"],
            "INV-0342"
        );
        assert_eq!(
            got["result"]["artifacts"][0]["parts"][0]["mediaType"],
            "application/json"
        );

        let again = call(&agent, "CancelTask", json!({"id": id})).await;
        assert_eq!(again["error"]["code"], TASK_NOT_CANCELABLE);
        let unknown = call(&agent, "CancelTask", json!({"id": "nope"})).await;
        assert_eq!(unknown["error"]["code"], TASK_NOT_FOUND);
        let stream = call(&agent, "SendStreamingMessage", json!({})).await;
        assert_eq!(stream["error"]["code"], UNSUPPORTED_OPERATION);
        let other = call(&agent, "ListTasks", json!({})).await;
        assert_eq!(other["error"]["code"], METHOD_NOT_FOUND);

        let received = agent.received();
        assert_eq!(received.len(), 7);
        assert_eq!(received[0].method, "SendMessage");
        assert_eq!(received[0].headers["a2a-version"], "1.0");
        assert_eq!(agent.cancels().len(), 2);
        agent.stop().await;
    }

    #[tokio::test]
    async fn working_tasks_cancel_and_handoffs_carry_the_payload() {
        let agent = VendorAgent::start("triage", &["triage"], |turn| {
            if turn.message.text() == "wait" {
                Reply::Working
            } else {
                Reply::Handoff {
                    payload: json!({"handoffId": "hf_1", "to": "billing"}),
                    state: TaskState::Completed,
                }
            }
        })
        .await
        .unwrap();

        let working = call(&agent, "SendMessage", json!({"message": user("wait", "")})).await;
        let id = working["result"]["task"]["id"]
            .as_str()
            .unwrap()
            .to_string();
        assert_eq!(
            working["result"]["task"]["status"]["state"],
            "TASK_STATE_WORKING"
        );
        let canceled = call(&agent, "CancelTask", json!({"id": id})).await;
        assert_eq!(canceled["result"]["status"]["state"], "TASK_STATE_CANCELED");
        assert_eq!(agent.cancels()[0].0, id);

        let handoff = call(&agent, "SendMessage", json!({"message": user("help", "")})).await;
        let part = &handoff["result"]["task"]["status"]["message"]["parts"][0];
        assert_eq!(part["mediaType"], HANDOFF_MEDIA_TYPE);
        assert_eq!(part["data"]["to"], "billing");
        assert_eq!(
            handoff["result"]["task"]["status"]["state"],
            "TASK_STATE_COMPLETED"
        );
        agent.stop().await;
    }

    #[tokio::test]
    async fn silent_agents_hold_the_request_until_stopped() {
        let agent = VendorAgent::start("mute", &["nothing"], |_| Reply::Silent)
            .await
            .unwrap();
        let url = format!("{}/a2a", agent.url());
        let pending = tokio::spawn(async move {
            reqwest::Client::new()
                .post(url)
                .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "SendMessage",
                              "params": {"message": user("hello", "")}}))
                .send()
                .await
        });
        let held = tokio::time::timeout(Duration::from_millis(300), async {
            while agent.received().is_empty() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(held.is_ok(), "the call arrived");
        assert!(!pending.is_finished(), "no answer yet");
        agent.stop().await;
        let _ = tokio::time::timeout(Duration::from_secs(5), pending)
            .await
            .expect("released at stop");
    }
}
