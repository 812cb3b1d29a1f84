//! Push delivery to a real webhook receiver on loopback: the four
//! push-config methods, a config given inline in SendMessage, every task
//! update POSTed as a bare StreamResponse with the configured credentials,
//! retries after a 500 or a `Retry-After`, a cap on POSTs in flight, a
//! replaced config getting what was queued for it, and the outbound guard
//! refusing loopback.

mod common;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::IntoResponse;
use common::agents::GatedAgent;
use common::*;
use serde_json::{Value, json};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One request the webhook receiver got.
#[derive(Clone, Debug)]
struct Delivery {
    method: Method,
    path: String,
    headers: HeaderMap,
    body: Value,
    /// What the receiver answered.
    answered: StatusCode,
    /// When it arrived.
    at: Instant,
}

impl Delivery {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

#[derive(Default)]
struct Inbox {
    // std Mutex: never held across an await.
    deliveries: Mutex<Vec<Delivery>>,
    /// How many of the next requests to fail, and with what.
    failing: Mutex<(usize, u16)>,
    /// The `Retry-After` a failing answer carries, if any.
    retry_after: Mutex<Option<&'static str>>,
    /// How long each request is held before it is answered.
    hold: Mutex<Duration>,
    /// Requests being held now, and the most ever held at once.
    held: AtomicUsize,
    most_held: AtomicUsize,
}

/// A webhook receiver on 127.0.0.1:0 that records every request.
struct Receiver {
    base: String,
    inbox: Arc<Inbox>,
    server: tokio::task::JoinHandle<()>,
}

async fn record(
    State(inbox): State<Arc<Inbox>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    let body = serde_json::from_slice(&body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()));
    let hold = *inbox.hold.lock().unwrap();
    if !hold.is_zero() {
        let held = inbox.held.fetch_add(1, Ordering::SeqCst) + 1;
        inbox.most_held.fetch_max(held, Ordering::SeqCst);
        tokio::time::sleep(hold).await;
        inbox.held.fetch_sub(1, Ordering::SeqCst);
    }
    let answered = {
        let mut failing = inbox.failing.lock().unwrap();
        if failing.0 > 0 {
            failing.0 -= 1;
            StatusCode::from_u16(failing.1).unwrap()
        } else {
            StatusCode::OK
        }
    };
    inbox.deliveries.lock().unwrap().push(Delivery {
        method,
        path: uri.path().to_string(),
        headers,
        body,
        answered,
        at: Instant::now(),
    });
    let retry_after = *inbox.retry_after.lock().unwrap();
    match retry_after {
        Some(wait) if !answered.is_success() => {
            (answered, [(axum::http::header::RETRY_AFTER, wait)]).into_response()
        }
        _ => answered.into_response(),
    }
}

impl Receiver {
    async fn start() -> Self {
        Self::failing_first(0, 500).await
    }

    /// Answers the first `n` requests with `status`, then 200.
    async fn failing_first(n: usize, status: u16) -> Self {
        let inbox = Arc::new(Inbox::default());
        *inbox.failing.lock().unwrap() = (n, status);
        let app = Router::new().fallback(record).with_state(inbox.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            base: format!("http://127.0.0.1:{port}"),
            inbox,
            server,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn all(&self) -> Vec<Delivery> {
        self.inbox.deliveries.lock().unwrap().clone()
    }

    /// Requests on `path` that were answered 2xx.
    fn accepted(&self, path: &str) -> Vec<Delivery> {
        self.all()
            .into_iter()
            .filter(|d| d.path == path && d.answered.is_success())
            .collect()
    }

    /// Polls (bounded by `WAIT`) until `done` holds for the accepted
    /// deliveries on `path`; returns them.
    async fn wait_accepted(
        &self,
        path: &str,
        what: &str,
        done: impl Fn(&[Delivery]) -> bool,
    ) -> Vec<Delivery> {
        let start = Instant::now();
        loop {
            let got = self.accepted(path);
            if done(&got) {
                return got;
            }
            if start.elapsed() > WAIT {
                let bodies: Vec<_> = self
                    .all()
                    .iter()
                    .map(|d| (d.path.clone(), d.answered, d.body.clone()))
                    .collect();
                panic!("webhook {path}: {what} not seen within {WAIT:?}; received {bodies:#?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until `path` has accepted a terminal statusUpdate.
    async fn wait_terminal(&self, path: &str) -> Vec<Delivery> {
        self.wait_accepted(path, "a terminal statusUpdate", |got| {
            got.iter().any(|d| {
                d.body["statusUpdate"]["status"]["state"]
                    .as_str()
                    .is_some_and(is_terminal)
            })
        })
        .await
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn is_terminal(state: &str) -> bool {
    matches!(
        state,
        "TASK_STATE_COMPLETED"
            | "TASK_STATE_FAILED"
            | "TASK_STATE_CANCELED"
            | "TASK_STATE_REJECTED"
    )
}

/// The one member of a StreamResponse body, with its value.
fn kind(body: &Value) -> (&str, &Value) {
    let object = body
        .as_object()
        .unwrap_or_else(|| panic!("webhook body is not an object: {body}"));
    assert_eq!(
        object.len(),
        1,
        "a StreamResponse has exactly one member: {body}"
    );
    let (key, value) = object.iter().next().unwrap();
    assert!(
        ["task", "message", "statusUpdate", "artifactUpdate"].contains(&key.as_str()),
        "unexpected StreamResponse member {key}: {body}"
    );
    (key.as_str(), value)
}

/// The task id an event is about.
fn event_task_id(body: &Value) -> &str {
    match kind(body) {
        ("task", task) => task["id"].as_str().unwrap_or(""),
        (_, event) => event["taskId"].as_str().unwrap_or(""),
    }
}

fn event_state(body: &Value) -> Option<&str> {
    match kind(body) {
        ("task", task) => task["status"]["state"].as_str(),
        ("statusUpdate", event) => event["status"]["state"].as_str(),
        _ => None,
    }
}

fn content_type_essence(delivery: &Delivery) -> String {
    delivery
        .header("content-type")
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

/// A gated task left WORKING; returns its id and context id.
async fn working_gated_task(baton: &TestBaton, extra: Value) -> (String, String) {
    let mut params = json!({
        "tenant": "gated",
        "message": user_message(&message_id("m"), "work"),
        "configuration": {"returnImmediately": true},
    });
    if let Value::Object(extra) = extra {
        for (k, v) in extra {
            params["configuration"][k] = v;
        }
    }
    let reply = baton.call("SendMessage", params).await;
    let task = &reply.result()["task"];
    (
        task["id"].as_str().unwrap().to_string(),
        task["contextId"].as_str().unwrap().to_string(),
    )
}

/// The push configs task `task_id` holds, as listed.
async fn configs_of(baton: &TestBaton, task_id: &str) -> Vec<Value> {
    let listed = baton
        .call(
            "ListTaskPushNotificationConfigs",
            json!({"taskId": task_id}),
        )
        .await;
    let configs = listed.result()["configs"].as_array();
    configs.expect("configs").clone()
}

/// A scenario task left INPUT_REQUIRED; returns its id.
async fn input_required_task(baton: &TestBaton) -> String {
    let reply = baton
        .send_to_scenario(user_message(&message_id("tck-input-required"), "ask me"))
        .await;
    let task = &reply.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_INPUT_REQUIRED");
    task["id"].as_str().unwrap().to_string()
}

/// Completes an INPUT_REQUIRED scenario task.
async fn complete_scenario_task(baton: &TestBaton, task_id: &str) {
    let message = user_message_on(task_id, &message_id("tck-complete-task"), "here you go");
    let reply = baton.send_to_scenario(message).await;
    assert_eq!(
        reply.result()["task"]["status"]["state"],
        "TASK_STATE_COMPLETED"
    );
}

#[tokio::test]
async fn a_task_holds_ten_push_configs_and_a_hanging_webhook_holds_up_none_of_the_others() {
    let receiver = Receiver::start().await;
    // Takes connections (the kernel's backlog) and never answers.
    let hanging = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hanging_url = format!("http://{}/hook", hanging.local_addr().unwrap());
    let baton = baton().start().await;
    let task_id = input_required_task(&baton).await;
    let create = |id: String, url: String| {
        let baton = &baton;
        let task_id = task_id.clone();
        async move {
            baton
                .call(
                    "CreateTaskPushNotificationConfig",
                    json!({"taskId": task_id, "id": id, "url": url}),
                )
                .await
        }
    };
    // Sorted first, so that one at a time it would be delivered first.
    let first = create("a-hanging".into(), hanging_url).await;
    assert!(first.body.get("result").is_some(), "{}", first.body);
    for n in 0..9 {
        let made = create(format!("b-{n}"), receiver.url(&format!("/hook/b-{n}"))).await;
        assert!(made.body.get("result").is_some(), "{}", made.body);
    }
    let eleventh = create("c".into(), receiver.url("/hook/c")).await;
    assert_eq!(eleventh.code(), Some(-32602), "{}", eleventh.body);
    assert!(
        eleventh.body.to_string().contains("taskId"),
        "{}",
        eleventh.body
    );
    // Replacing one of the ten is no eleventh.
    let replaced = create("b-0".into(), receiver.url("/hook/b-0")).await;
    assert!(replaced.body.get("result").is_some(), "{}", replaced.body);

    // The completion reaches each of the nine others within WAIT, although
    // the hanging webhook takes 10 s an attempt.
    complete_scenario_task(&baton, &task_id).await;
    for n in 0..9 {
        receiver.wait_terminal(&format!("/hook/b-{n}")).await;
    }
}

// Several workers, so that the creates can run at the same time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_creates_pass_the_ten_config_cap_no_more_than_ten_times() {
    let receiver = Receiver::start().await;
    let baton = baton().start().await;
    let task_id = input_required_task(&baton).await;
    let creates = (0..20).map(|n| {
        let params =
            json!({"taskId": task_id, "id": format!("c-{n}"), "url": receiver.url("/hook")});
        baton.call("CreateTaskPushNotificationConfig", params)
    });
    let replies = futures::future::join_all(creates).await;
    let made = replies.iter().filter(|r| r.body.get("result").is_some());
    assert_eq!(made.count(), 10);
    for refused in replies.iter().filter(|r| r.body.get("result").is_none()) {
        assert_eq!(refused.code(), Some(-32602), "{}", refused.body);
    }
    assert_eq!(configs_of(&baton, &task_id).await.len(), 10);

    // A send continuing the task may not add an eleventh inline; the
    // message is not taken.
    let message = user_message_on(&task_id, &message_id("tck-complete-task"), "here you go");
    let configuration =
        json!({"taskPushNotificationConfig": {"url": receiver.url("/hook/eleventh")}});
    let reply = baton
        .call_at(
            "/agents/scenario/a2a",
            "SendMessage",
            json!({"message": message, "configuration": configuration}),
        )
        .await;
    assert_eq!(reply.code(), Some(-32602), "{}", reply.body);
    let says = reply.body.to_string();
    assert!(
        says.contains("configuration.taskPushNotificationConfig"),
        "{says}"
    );
    let task = baton.call("GetTask", json!({"id": task_id})).await;
    assert_eq!(
        task.result()["status"]["state"],
        "TASK_STATE_INPUT_REQUIRED"
    );
}

/// A client may attach its one push config to every message it sends:
/// a continuation carrying the config its task holds (but for the id)
/// adds no second copy, so the webhook is told each event once.
#[tokio::test]
async fn a_continuation_carrying_its_tasks_config_again_adds_no_copy_of_it() {
    let receiver = Receiver::start().await;
    let baton = baton().start().await;
    let configuration = json!({"taskPushNotificationConfig": {
        "url": receiver.url("/hook/same"), "token": "t",
        "authentication": {"scheme": "Bearer", "credentials": "s"},
    }});
    let send = |message: Value| {
        let params = json!({"message": message, "configuration": configuration.clone()});
        baton.call_at("/agents/scenario/a2a", "SendMessage", params)
    };
    let asked = send(user_message(&message_id("tck-input-required"), "ask me")).await;
    let task_id = asked.result()["task"]["id"].as_str().unwrap().to_string();
    let answer = user_message_on(&task_id, &message_id("tck-complete-task"), "here you go");
    let done = send(answer).await;
    assert_eq!(
        done.result()["task"]["status"]["state"],
        "TASK_STATE_COMPLETED",
        "{}",
        done.body
    );
    assert_eq!(configs_of(&baton, &task_id).await.len(), 1);
    receiver.wait_terminal("/hook/same").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let states: Vec<_> = receiver
        .accepted("/hook/same")
        .iter()
        .filter_map(|d| event_state(&d.body).map(str::to_string))
        .collect();
    let completed = states.iter().filter(|s| *s == "TASK_STATE_COMPLETED");
    assert_eq!(completed.count(), 1, "{states:?}");
    baton.stop().await;
}

#[tokio::test]
async fn push_config_methods_success_paths() {
    let receiver = Receiver::start().await;
    let gated = GatedAgent::new();
    let baton = baton().agent("gated", gated.clone()).start().await;
    let (task_id, _) = working_gated_task(&baton, json!({})).await;

    // Create with a client-chosen id: the config is echoed back.
    let created = baton
        .call(
            "CreateTaskPushNotificationConfig",
            json!({
                "taskId": task_id,
                "id": "cfg-1",
                "url": receiver.url("/hook/one"),
                "token": "tok-1",
                "authentication": {"scheme": "Bearer", "credentials": "secret-1"},
            }),
        )
        .await;
    let first = created.result().clone();
    assert_eq!(first["id"], "cfg-1");
    assert_eq!(first["taskId"], task_id);
    assert_eq!(first["url"], receiver.url("/hook/one"));
    assert_eq!(first["token"], "tok-1");
    assert_eq!(first["authentication"]["scheme"], "Bearer");
    assert_eq!(first["authentication"]["credentials"], "secret-1");

    // Create without an id: the server assigns one.
    let created = baton
        .call(
            "CreateTaskPushNotificationConfig",
            json!({"taskId": task_id, "url": receiver.url("/hook/two")}),
        )
        .await;
    let second = created.result().clone();
    let second_id = second["id"].as_str().expect("assigned id").to_string();
    assert!(!second_id.is_empty());
    assert_ne!(second_id, "cfg-1");
    assert_eq!(second["taskId"], task_id);
    assert_eq!(second["url"], receiver.url("/hook/two"));

    // Get returns what Create returned.
    let got = baton
        .call(
            "GetTaskPushNotificationConfig",
            json!({"taskId": task_id, "id": "cfg-1"}),
        )
        .await;
    assert_eq!(got.result(), &first);
    let got = baton
        .call(
            "GetTaskPushNotificationConfig",
            json!({"taskId": task_id, "id": second_id}),
        )
        .await;
    assert_eq!(got.result(), &second);

    // List returns both, on one page.
    let listed = baton
        .call(
            "ListTaskPushNotificationConfigs",
            json!({"taskId": task_id}),
        )
        .await;
    let listed = listed.result();
    let configs = listed["configs"].as_array().expect("configs");
    assert_eq!(configs.len(), 2, "{listed}");
    assert!(configs.contains(&first), "{listed}");
    assert!(configs.contains(&second), "{listed}");
    assert!(
        listed.get("nextPageToken").is_none_or(|t| t == ""),
        "a single page has no next page: {listed}"
    );

    // Delete, and delete again: both succeed.
    for _ in 0..2 {
        let deleted = baton
            .call(
                "DeleteTaskPushNotificationConfig",
                json!({"taskId": task_id, "id": "cfg-1"}),
            )
            .await;
        assert_eq!(deleted.result(), &json!({}));
    }
    let gone = baton
        .call(
            "GetTaskPushNotificationConfig",
            json!({"taskId": task_id, "id": "cfg-1"}),
        )
        .await;
    assert_eq!(gone.code(), Some(-32001), "{}", gone.body);
    // ErrorInfo names the task by its id, and the config.
    let info = &gone.body["error"]["data"][0];
    assert_eq!(info["reason"], "TASK_NOT_FOUND", "{}", gone.body);
    assert_eq!(
        info["metadata"],
        json!({"taskId": task_id, "configId": "cfg-1"}),
        "{}",
        gone.body
    );
    let listed = baton
        .call(
            "ListTaskPushNotificationConfigs",
            json!({"taskId": task_id}),
        )
        .await;
    assert_eq!(listed.result()["configs"], json!([second]));

    // The task finishes: only the remaining config is notified.
    gated.release(1);
    let events = receiver.wait_terminal("/hook/two").await;
    let last = &events.last().unwrap().body;
    assert_eq!(event_state(last), Some("TASK_STATE_COMPLETED"));
    assert!(events.iter().all(|d| event_task_id(&d.body) == task_id));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        receiver.all().iter().all(|d| d.path != "/hook/one"),
        "a deleted config was notified"
    );
    baton.stop().await;
}

#[tokio::test]
async fn inline_config_receives_every_update_as_a_stream_response() {
    let receiver = Receiver::start().await;
    let gated = GatedAgent::new();
    let baton = baton().agent("gated", gated.clone()).start().await;
    let (task_id, context_id) = working_gated_task(
        &baton,
        json!({"taskPushNotificationConfig": {
            "url": receiver.url("/hook/inline"),
            "token": "tok-inline",
            "authentication": {"scheme": "Bearer", "credentials": "cred-inline"},
        }}),
    )
    .await;

    // The inline config is a config of the task like any other.
    let listed = baton
        .call(
            "ListTaskPushNotificationConfigs",
            json!({"taskId": task_id}),
        )
        .await;
    let configs = listed.result()["configs"].as_array().unwrap().clone();
    assert_eq!(configs.len(), 1, "{}", listed.body);
    assert_eq!(configs[0]["taskId"], task_id);
    assert_eq!(configs[0]["url"], receiver.url("/hook/inline"));
    assert_eq!(configs[0]["token"], "tok-inline");
    assert!(configs[0]["id"].as_str().is_some_and(|id| !id.is_empty()));

    gated.release(1);
    let deliveries = receiver.wait_terminal("/hook/inline").await;

    // Every request: a POST with the credentials, the token and the A2A media type.
    for delivery in &deliveries {
        assert_eq!(delivery.method, Method::POST);
        assert_eq!(delivery.header("authorization"), Some("Bearer cred-inline"));
        assert_eq!(
            delivery.header("x-a2a-notification-token"),
            Some("tok-inline")
        );
        assert_eq!(content_type_essence(delivery), "application/a2a+json");
    }

    // The sequence: the task snapshot, then its updates, ending COMPLETED.
    let bodies: Vec<&Value> = deliveries.iter().map(|d| &d.body).collect();
    let (first_kind, snapshot) = kind(bodies[0]);
    assert_eq!(
        first_kind, "task",
        "first notification is the task: {bodies:#?}"
    );
    assert_eq!(snapshot["id"], task_id);
    assert_eq!(snapshot["contextId"], context_id);
    assert_eq!(snapshot["status"]["state"], "TASK_STATE_SUBMITTED");
    for body in &bodies[1..] {
        let (k, event) = kind(body);
        assert!(k == "statusUpdate" || k == "artifactUpdate", "{body}");
        assert_eq!(event["taskId"], task_id);
        assert_eq!(event["contextId"], context_id);
    }
    let kinds: Vec<(&str, Option<&str>)> =
        bodies.iter().map(|b| (kind(b).0, event_state(b))).collect();
    assert_eq!(
        kinds,
        vec![
            ("task", Some("TASK_STATE_SUBMITTED")),
            ("statusUpdate", Some("TASK_STATE_WORKING")),
            ("artifactUpdate", None),
            ("statusUpdate", Some("TASK_STATE_COMPLETED")),
        ],
        "{bodies:#?}"
    );
    assert_eq!(
        bodies[2]["artifactUpdate"]["artifact"]["artifactId"],
        "result"
    );
    assert_eq!(
        bodies[2]["artifactUpdate"]["artifact"]["parts"][0]["text"],
        "done: work"
    );

    // Nothing after the terminal event, and nothing was sent twice.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(receiver.all().len(), 4, "{:#?}", receiver.all());
    baton.stop().await;
}

#[tokio::test]
async fn config_created_on_an_input_required_task_receives_the_rest() {
    let receiver = Receiver::start().await;
    let baton = baton().start().await;
    let task_id = input_required_task(&baton).await;
    let created = baton
        .call_at(
            "/agents/scenario/a2a",
            "CreateTaskPushNotificationConfig",
            json!({
                "taskId": task_id,
                "id": "late",
                "url": receiver.url("/hook/late"),
                "token": "late-token",
                "authentication": {"scheme": "Bearer", "credentials": "late-secret"},
            }),
        )
        .await;
    assert_eq!(created.result()["id"], "late");

    complete_scenario_task(&baton, &task_id).await;
    let deliveries = receiver.wait_terminal("/hook/late").await;
    let states: Vec<(&str, Option<&str>)> = deliveries
        .iter()
        .map(|d| (kind(&d.body).0, event_state(&d.body)))
        .collect();
    assert_eq!(
        states,
        vec![
            ("statusUpdate", Some("TASK_STATE_WORKING")),
            ("statusUpdate", Some("TASK_STATE_COMPLETED")),
        ],
        "{deliveries:#?}"
    );
    for delivery in &deliveries {
        assert_eq!(event_task_id(&delivery.body), task_id);
        assert_eq!(delivery.header("authorization"), Some("Bearer late-secret"));
        assert_eq!(
            delivery.header("x-a2a-notification-token"),
            Some("late-token")
        );
        assert_eq!(content_type_essence(delivery), "application/a2a+json");
    }
    let done = &deliveries[1].body["statusUpdate"]["status"];
    assert_eq!(done["message"]["parts"][0]["text"], "Hello from TCK");
    baton.stop().await;
}

/// A blocking scenario send with an inline config; returns the task id.
async fn completed_with_inline_config(baton: &TestBaton, url: &str) -> String {
    let reply = baton
        .call_at(
            "/agents/scenario/a2a",
            "SendMessage",
            json!({
                "message": user_message(&message_id("tck-complete-task"), "hi"),
                "configuration": {"taskPushNotificationConfig": {"url": url, "token": "t"}},
            }),
        )
        .await;
    let task = &reply.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED");
    task["id"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn a_500_is_retried_and_the_notification_still_arrives() {
    let receiver = Receiver::failing_first(1, 500).await;
    let baton = baton().start().await;
    let task_id = completed_with_inline_config(&baton, &receiver.url("/hook/flaky")).await;
    let accepted = receiver.wait_terminal("/hook/flaky").await;

    let all = receiver.all();
    assert_eq!(all[0].answered, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(all[1].answered, StatusCode::OK);
    assert_eq!(
        all[0].body, all[1].body,
        "the retry resends the same notification"
    );
    assert_eq!(kind(&all[0].body).0, "task");
    assert_eq!(all[1].header("x-a2a-notification-token"), Some("t"));

    let states: Vec<(&str, Option<&str>)> = accepted
        .iter()
        .map(|d| (kind(&d.body).0, event_state(&d.body)))
        .collect();
    assert_eq!(
        states,
        vec![
            ("task", Some("TASK_STATE_SUBMITTED")),
            ("statusUpdate", Some("TASK_STATE_COMPLETED")),
        ]
    );
    assert!(accepted.iter().all(|d| event_task_id(&d.body) == task_id));
    assert_eq!(baton.gateway.push().stats.failed.load(Ordering::Relaxed), 0);
    baton.stop().await;
}

#[tokio::test]
async fn a_retry_after_answer_is_waited_out_before_the_next_attempt() {
    let receiver = Receiver::failing_first(1, 503).await;
    *receiver.inbox.retry_after.lock().unwrap() = Some("1");
    let baton = baton().start().await;
    completed_with_inline_config(&baton, &receiver.url("/hook/busy")).await;
    receiver.wait_terminal("/hook/busy").await;
    let all = receiver.all();
    assert_eq!(all[0].answered, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(all[0].body, all[1].body, "the same notification again");
    // The first retry's own backoff is 200 ms at most.
    let waited = all[1].at - all[0].at;
    assert!(
        waited >= Duration::from_millis(950),
        "retried after {waited:?}"
    );
    baton.stop().await;
}

#[tokio::test]
async fn no_more_posts_are_in_flight_than_the_cap_and_all_arrive() {
    let receiver = Receiver::start().await;
    *receiver.inbox.hold.lock().unwrap() = Duration::from_millis(100);
    let baton = baton().push_in_flight(2).start().await;
    let hooks: Vec<String> = (0..6).map(|n| format!("/hook/capped-{n}")).collect();
    for hook in &hooks {
        completed_with_inline_config(&baton, &receiver.url(hook)).await;
    }
    for hook in &hooks {
        receiver.wait_terminal(hook).await;
    }
    // Six webhooks' pipelines, each with a POST to make at once.
    assert_eq!(receiver.inbox.most_held.load(Ordering::SeqCst), 2);
    assert_eq!(receiver.all().len(), 12, "two notifications per task");
    baton.stop().await;
}

#[tokio::test]
async fn several_5xx_within_the_attempt_budget_still_deliver_in_order() {
    let receiver = Receiver::failing_first(3, 503).await;
    let baton = baton().start().await;
    let task_id = completed_with_inline_config(&baton, &receiver.url("/hook/down")).await;
    let accepted = receiver.wait_terminal("/hook/down").await;
    let all = receiver.all();
    assert!(
        all[..3]
            .iter()
            .all(|d| d.answered == StatusCode::SERVICE_UNAVAILABLE)
    );
    assert!(all[..4].iter().all(|d| d.body == all[0].body));
    assert_eq!(accepted.len(), 2, "{accepted:#?}");
    assert_eq!(kind(&accepted[0].body).0, "task");
    assert_eq!(event_state(&accepted[1].body), Some("TASK_STATE_COMPLETED"));
    assert!(accepted.iter().all(|d| event_task_id(&d.body) == task_id));
    baton.stop().await;
}

/// The id of `task_id`'s one config, once `receiver` got a first attempt.
async fn config_after_an_attempt(baton: &TestBaton, receiver: &Receiver, task_id: &str) -> String {
    wait_until("no first attempt", || !receiver.all().is_empty()).await;
    let listed = baton
        .call_at(
            "/agents/scenario/a2a",
            "ListTaskPushNotificationConfigs",
            json!({"taskId": task_id}),
        )
        .await;
    listed.result()["configs"][0]["id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A deleted config gets nothing more, its retries and queued
/// notifications included.
#[tokio::test]
async fn nothing_is_sent_to_a_config_once_it_is_deleted() {
    let receiver = Receiver::failing_first(usize::MAX, 503).await;
    let baton = baton().start().await;
    let task_id = completed_with_inline_config(&baton, &receiver.url("/hook/gone")).await;
    let config_id = config_after_an_attempt(&baton, &receiver, &task_id).await;
    let deleted = baton
        .call_at(
            "/agents/scenario/a2a",
            "DeleteTaskPushNotificationConfig",
            json!({"taskId": task_id, "id": config_id}),
        )
        .await;
    assert_eq!(deleted.result(), &json!({}));
    // An attempt that passed its check before the delete may still land.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let at_deletion = receiver.all().len();

    // Retries come 200, 400 and 800 ms apart, and the completion's
    // notification after them: without the check, some would land here.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(receiver.all().len(), at_deletion, "{:#?}", receiver.all());
    baton.stop().await;
}

/// A config replaced under its id (a rotated token, a moved webhook) gets
/// what was queued for it, retries included, as it now stands.
#[tokio::test]
async fn a_replaced_config_gets_its_queued_notifications() {
    let down = Receiver::failing_first(usize::MAX, 503).await;
    let moved = Receiver::start().await;
    let baton = baton().start().await;
    let task_id = completed_with_inline_config(&baton, &down.url("/hook/old")).await;
    let config_id = config_after_an_attempt(&baton, &down, &task_id).await;
    let replaced = baton
        .call_at(
            "/agents/scenario/a2a",
            "CreateTaskPushNotificationConfig",
            json!({"taskId": task_id, "id": config_id, "url": moved.url("/hook/new"), "token": "rotated"}),
        )
        .await;
    assert!(replaced.body.get("result").is_some(), "{}", replaced.body);
    let accepted = moved.wait_terminal("/hook/new").await;
    let states: Vec<_> = accepted.iter().map(|d| event_state(&d.body)).collect();
    assert_eq!(
        states,
        [Some("TASK_STATE_SUBMITTED"), Some("TASK_STATE_COMPLETED")]
    );
    assert!(
        accepted
            .iter()
            .all(|d| d.header("x-a2a-notification-token") == Some("rotated"))
    );
    assert_eq!(baton.gateway.push().stats.failed.load(Ordering::Relaxed), 0);
    baton.stop().await;
}

#[tokio::test]
async fn a_4xx_answer_is_final() {
    let receiver = Receiver::failing_first(1, 400).await;
    let baton = baton().start().await;
    completed_with_inline_config(&baton, &receiver.url("/hook/picky")).await;
    receiver.wait_terminal("/hook/picky").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let all = receiver.all();
    // The snapshot was refused once and not retried; the completion arrived.
    assert_eq!(all.len(), 2, "{all:#?}");
    assert_eq!(all[0].answered, StatusCode::BAD_REQUEST);
    assert_eq!(kind(&all[0].body).0, "task");
    assert_eq!(event_state(&all[1].body), Some("TASK_STATE_COMPLETED"));
    assert_eq!(baton.gateway.push().stats.failed.load(Ordering::Relaxed), 1);
    baton.stop().await;
}

#[tokio::test]
async fn without_a_loopback_allowance_nothing_is_delivered_to_loopback() {
    let receiver = Receiver::start().await;
    let baton = baton().without_loopback().start().await;
    let localhost_url = format!(
        "http://localhost:{}/hook/by-name",
        receiver.base.rsplit(':').next().unwrap()
    );

    // An IP literal the guard refuses is refused at once; a name is
    // accepted, and the guard applies at delivery, after DNS.
    let task_id = input_required_task(&baton).await;
    let by_ip = baton
        .call_at(
            "/agents/scenario/a2a",
            "CreateTaskPushNotificationConfig",
            json!({"taskId": task_id, "id": "ip", "url": receiver.url("/hook/ip")}),
        )
        .await;
    assert_eq!(by_ip.code(), Some(-32602), "{}", by_ip.body);
    assert!(
        by_ip.body.to_string().contains("outbound policy"),
        "{}",
        by_ip.body
    );
    let created = baton
        .call_at(
            "/agents/scenario/a2a",
            "CreateTaskPushNotificationConfig",
            json!({"taskId": task_id, "id": "name", "url": localhost_url}),
        )
        .await;
    assert_eq!(created.result()["url"], localhost_url.as_str());
    complete_scenario_task(&baton, &task_id).await;
    // An inline config by name is accepted too.
    let inline_url = localhost_url.replace("/hook/by-name", "/hook/inline");
    completed_with_inline_config(&baton, &inline_url).await;

    // Two events for the config, plus two for the inline one: four
    // notifications, every one given up.
    let stats = baton.gateway.push().stats.clone();
    let start = Instant::now();
    while stats.failed.load(Ordering::Relaxed) < 4 && start.elapsed() < WAIT {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        receiver.all().is_empty(),
        "loopback was contacted: {:#?}",
        receiver.all()
    );
    assert_eq!(stats.failed.load(Ordering::Relaxed), 4);
    assert_eq!(stats.delivered.load(Ordering::Relaxed), 0);
    baton.stop().await;
}
