//! The `baton` binary as an operator runs it: tasks, history, artifacts and
//! push configs survive a restart on the same data directory, and a SIGKILL
//! straight after the answers; SIGTERM drains gracefully, closing SSE streams;
//! an idempotency key a crash left claimed is taken over by its next repeat.

mod common;
#[path = "common/process.rs"]
mod process;

use baton::protocol::TaskState;
use common::{
    WAIT, message_id, read_sse, serve_on_loopback, user_message, user_message_on, wait_until,
};
use process::BatonProcess;
use serde_json::json;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A process over the ledger in `data` that may reach agents and webhooks
/// on loopback.
fn loopback_process(data: &std::path::Path) -> BatonProcess {
    BatonProcess::builder(data)
        .args(["--allow-upstream", "127.0.0.0/8,::1"])
        .start()
}

/// The push configs of a task.
async fn push_configs(baton: &BatonProcess, task_id: &str) -> serde_json::Value {
    let params = json!({"taskId": task_id});
    baton.call("ListTaskPushNotificationConfigs", params).await
}

/// Answers a task waiting for input with a message that completes it.
async fn answer(baton: &BatonProcess, task_id: &str) -> serde_json::Value {
    let answer = user_message_on(task_id, &message_id("tck-complete-task"), "answer");
    baton.call("SendMessage", json!({"message": answer})).await
}

#[tokio::test]
async fn tasks_history_artifacts_and_push_configs_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = BatonProcess::start(dir.path());

    let mut ids = Vec::new();
    for prefix in [
        "tck-complete-task",
        "tck-artifact-text",
        "tck-artifact-data",
        "tck-input-required",
    ] {
        let result = first
            .call(
                "SendMessage",
                json!({"message": user_message(&message_id(prefix), prefix)}),
            )
            .await;
        ids.push(result["task"]["id"].as_str().unwrap().to_string());
    }
    let waiting = ids[3].clone();
    first
        .call(
            "CreateTaskPushNotificationConfig",
            json!({"taskId": waiting, "id": "hook", "url": "https://example.com/hook", "token": "secret"}),
        )
        .await;

    // Replies are shaped from what the ledger holds: in memory now, from
    // sled's bytes after the restart; whole, trimmed and without artifacts.
    let task_shapes = [
        json!({}),
        json!({"historyLength": 1}),
        json!({"historyLength": 0}),
    ];
    let list_shapes = [
        json!({"includeArtifacts": true}),
        json!({}),
        json!({"historyLength": 1, "includeArtifacts": true}),
    ];
    let mut before = Vec::new();
    for id in &ids {
        for shape in &task_shapes {
            let mut params = shape.clone();
            params["id"] = json!(id);
            before.push((params.clone(), first.call("GetTask", params).await));
        }
    }
    let trimmed = &before[1].1["history"];
    assert_eq!(trimmed.as_array().map(Vec::len), Some(1), "{trimmed}");
    let mut lists_before = Vec::new();
    for shape in &list_shapes {
        lists_before.push(first.call("ListTasks", shape.clone()).await);
    }
    assert_eq!(lists_before[0]["totalSize"], 4);
    let has_artifacts = |list: &serde_json::Value| {
        list["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t.get("artifacts").is_some())
    };
    assert!(has_artifacts(&lists_before[0]) && !has_artifacts(&lists_before[1]));

    first.terminate();
    assert!(first.wait_exit(WAIT).success());

    let second = BatonProcess::start(dir.path());
    for (params, expected) in &before {
        let after = second.call("GetTask", params.clone()).await;
        assert_eq!(&after, expected, "{params}");
    }
    for (shape, expected) in list_shapes.iter().zip(&lists_before) {
        assert_eq!(
            &second.call("ListTasks", shape.clone()).await,
            expected,
            "{shape}"
        );
    }
    let configs = push_configs(&second, &waiting).await;
    assert_eq!(configs["configs"][0]["token"], "secret");

    // The interrupted task goes on where it stopped.
    let resumed = answer(&second, &waiting).await;
    assert_eq!(resumed["task"]["status"]["state"], "TASK_STATE_COMPLETED");
    assert_eq!(resumed["task"]["history"].as_array().unwrap().len(), 4);
}

#[tokio::test]
async fn a_task_read_back_from_disk_is_still_only_its_owners() {
    let dir = tempfile::tempdir().unwrap();
    let keys = "acme=KEY1,globex=KEY2";
    let mut first = BatonProcess::builder(dir.path())
        .env("BATON_API_KEYS", keys)
        .start();
    let message = user_message(&message_id("tck-artifact-text"), "acme's work");
    let sent = first
        .rpc_as("KEY1", "/a2a", "SendMessage", json!({"message": message}))
        .await;
    let task_id = sent["result"]["task"]["id"]
        .as_str()
        .expect("a task")
        .to_string();
    first.terminate();
    assert!(first.wait_exit(WAIT).success());

    // After the restart the task is read from sled's bytes, not decoded.
    let second = BatonProcess::builder(dir.path())
        .env("BATON_API_KEYS", keys)
        .start();
    let params = json!({"id": task_id});
    let theirs = second
        .rpc_as("KEY2", "/a2a", "GetTask", params.clone())
        .await;
    assert_eq!(theirs["error"]["code"], -32001, "{theirs}");
    assert!(theirs.get("result").is_none());
    let listed = second.rpc_as("KEY2", "/a2a", "ListTasks", json!({})).await;
    assert_eq!(listed["result"]["tasks"], json!([]), "{listed}");
    let own = second.rpc_as("KEY1", "/a2a", "GetTask", params).await;
    assert_eq!(own["result"], sent["result"]["task"], "{own}");
}

#[tokio::test]
async fn every_acknowledged_write_survives_a_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = BatonProcess::start(dir.path());

    // Concurrent sends, so that writes share log syncs and sled applications.
    let sends = (0..24).map(|i| {
        let prefix = [
            "tck-complete-task",
            "tck-input-required",
            "tck-artifact-text",
        ][i % 3];
        first.call(
            "SendMessage",
            json!({"message": user_message(&message_id(prefix), prefix)}),
        )
    });
    let results = futures::future::join_all(sends).await;
    let ids: Vec<String> = results
        .iter()
        .map(|r| r["task"]["id"].as_str().unwrap().to_string())
        .collect();
    let waiting = ids[1].clone();
    first
        .call(
            "CreateTaskPushNotificationConfig",
            json!({"taskId": waiting, "id": "hook", "url": "https://example.com/hook"}),
        )
        .await;
    let mut before = Vec::new();
    for id in &ids {
        before.push(first.call("GetTask", json!({"id": id})).await);
    }
    // Straight after the answers: no clean close, no checkpoint.
    first.kill();

    let second = BatonProcess::start(dir.path());
    for (id, expected) in ids.iter().zip(&before) {
        assert_eq!(&second.call("GetTask", json!({"id": id})).await, expected);
    }
    let listed = second.call("ListTasks", json!({"pageSize": 100})).await;
    assert_eq!(listed["totalSize"], 24);
    let waiting_count = second
        .call("ListTasks", json!({"status": "TASK_STATE_INPUT_REQUIRED"}))
        .await;
    assert_eq!(waiting_count["totalSize"], 8);
    let configs = push_configs(&second, &waiting).await;
    assert_eq!(configs["configs"][0]["id"], "hook");

    // The replayed task goes on where it stopped.
    let resumed = answer(&second, &waiting).await;
    assert_eq!(resumed["task"]["status"]["state"], "TASK_STATE_COMPLETED");
}

#[tokio::test]
async fn a_message_nested_as_deep_as_a_request_may_be_survives_a_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = BatonProcess::start(dir.path());
    // The deepest data part a message may carry; the ledger nests it
    // deeper. (An agent's answers may nest deeper still: the store's own
    // tests read those back at serde_json's limit.)
    let depth = baton::gateway::validate::MAX_VALUE_DEPTH;
    let deep = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
    let mut message = user_message(&message_id("tck-input-required"), "deep");
    message["parts"]
        .as_array_mut()
        .unwrap()
        .push(json!({"data": serde_json::from_str::<serde_json::Value>(&deep).unwrap()}));
    let sent = first.call("SendMessage", json!({"message": message})).await;
    let task_id = sent["task"]["id"].as_str().unwrap().to_string();
    let before = first.call("GetTask", json!({"id": task_id})).await;
    first.kill();

    let second = BatonProcess::start(dir.path());
    assert_eq!(second.call("GetTask", json!({"id": task_id})).await, before);
    let resumed = answer(&second, &task_id).await;
    assert_eq!(resumed["task"]["status"]["state"], "TASK_STATE_COMPLETED");
}

#[tokio::test]
async fn sigterm_closes_streams_and_exits_within_the_grace_period() {
    let dir = tempfile::tempdir().unwrap();
    let mut baton = BatonProcess::start(dir.path());
    let task = baton
        .call(
            "SendMessage",
            json!({"message": user_message(&message_id("tck-input-required"), "wait")}),
        )
        .await;
    let task_id = task["task"]["id"].clone();

    let body =
        json!({"jsonrpc": "2.0", "id": 7, "method": "SubscribeToTask", "params": {"id": task_id}});
    let stream = baton
        .http
        .post(format!("{}/a2a", baton.base))
        .header("content-type", "application/json")
        .header("a2a-version", "1.0")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert!(
        stream.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let reader = tokio::spawn(read_sse(stream, 100));
    tokio::time::sleep(Duration::from_millis(200)).await;

    let started = Instant::now();
    baton.terminate();
    let events = reader.await.unwrap();
    assert!(events.closed, "the open stream ends at shutdown");
    assert_eq!(events.events[0]["result"]["task"]["id"], task_id);
    assert!(baton.wait_exit(WAIT).success());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "drain took {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn work_in_flight_at_a_stop_is_failed_with_the_reason_after_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = BatonProcess::start(dir.path());
    let params = json!({
        "message": user_message(&message_id("test-resubscribe-message-id"), "long"),
        "configuration": {"returnImmediately": true},
    });
    let task = first.call("SendMessage", params).await;
    let task_id = task["task"]["id"].clone();
    first.terminate();
    assert!(first.wait_exit(WAIT).success());

    let second = BatonProcess::start(dir.path());
    let started = Instant::now();
    loop {
        let got = second.call("GetTask", json!({"id": task_id})).await;
        if got["status"]["state"] == "TASK_STATE_FAILED" {
            let reason = got["status"]["message"]["parts"][0]["text"]
                .as_str()
                .unwrap();
            assert!(reason.contains("restarted"), "{reason}");
            assert_eq!(common::reason(&got), "AGENT_FAILED", "{got}");
            break;
        }
        assert!(
            started.elapsed() < WAIT,
            "task still {}",
            got["status"]["state"]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn validate_config_reports_every_problem_with_exit_code_2() {
    let output = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["serve", "--validate-config", "--listen", "nowhere"])
        .args(["--default-agent", "ghost", "--log-format", "xml"])
        .output()
        .expect("run baton");
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    for problem in ["listen", "default-agent", "log-format"] {
        assert!(
            stderr.contains(problem),
            "{problem} missing from:\n{stderr}"
        );
    }

    let output = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["serve", "--validate-config", "--default-agent", "scenario"])
        .env("BATON_LISTEN", "127.0.0.1:9999")
        .output()
        .expect("run baton");
    assert!(output.status.success());
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("127.0.0.1:9999") && stdout.contains("scenario"),
        "{stdout}"
    );
}

#[tokio::test]
async fn a_deadline_passed_while_stopped_ends_a_waiting_task_after_restart() {
    use baton::demo::vendor::{Reply, VendorAgent};
    let asker = VendorAgent::start("asker", &["refund"], |_| {
        Reply::AskInput("which card?".into())
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let start = || loopback_process(dir.path());
    let mut first = start();
    register_vendor(&first, "asker", &asker).await;
    let (message, deadline) = message_due_in("w", "refund", 2500);
    let reply = first
        .rpc(
            "/agents/asker/a2a",
            "SendMessage",
            json!({"message": message}),
        )
        .await;
    let id = reply["result"]["task"]["id"].as_str().unwrap().to_string();
    assert_eq!(
        reply["result"]["task"]["status"]["state"],
        "TASK_STATE_INPUT_REQUIRED"
    );
    first.terminate();
    assert!(first.wait_exit(WAIT).success());

    // The deadline passes while no Baton runs; the next one ends the task.
    sleep_past(deadline).await;
    let second = start();
    assert_failed_at_its_deadline(&second, &id).await;
    assert_eq!(asker.cancels().len(), 1, "the agent was told to stop");
    asker.stop().await;
}

/// A user message whose control sets a deadline `millis` from now.
fn message_due_in(
    prefix: &str,
    text: &str,
    millis: i64,
) -> (serde_json::Value, chrono::DateTime<chrono::Utc>) {
    let deadline = chrono::Utc::now() + chrono::Duration::milliseconds(millis);
    let mut message = user_message(&message_id(prefix), text);
    message["metadata"] = json!({"urn:baton:handoff:v1": {
        "deadline": deadline.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
    }});
    (message, deadline)
}

/// Sleeps until a little after `deadline`.
async fn sleep_past(deadline: chrono::DateTime<chrono::Utc>) {
    let left = (deadline - chrono::Utc::now()).to_std().unwrap_or_default();
    tokio::time::sleep(left + Duration::from_millis(300)).await;
}

/// Registers a vendor agent at `baton` under `id`.
async fn register_vendor(baton: &BatonProcess, id: &str, agent: &baton::demo::vendor::VendorAgent) {
    let card = serde_json::to_value(agent.card()).unwrap();
    baton
        .registry("RegisterAgent", json!({"id": id, "card": card}))
        .await;
}

/// The task once it is COMPLETED or FAILED (as it stands after `WAIT`).
async fn ended(baton: &BatonProcess, id: &str) -> serde_json::Value {
    let until = Instant::now() + WAIT;
    loop {
        let task = baton.call("GetTask", json!({"id": id})).await;
        let state = &task["status"]["state"];
        let ended = state == "TASK_STATE_COMPLETED" || state == "TASK_STATE_FAILED";
        if ended || Instant::now() > until {
            return task;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the task is FAILED, for `DEADLINE_EXCEEDED`.
async fn assert_failed_at_its_deadline(baton: &BatonProcess, id: &str) {
    let task = ended(baton, id).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_FAILED", "{task}");
    assert!(task.to_string().contains("DEADLINE_EXCEEDED"), "{task}");
}

/// A built-in agent cannot take up a task after a restart, and says so;
/// but a task whose deadline passed meanwhile fails for that deadline.
#[tokio::test]
async fn a_deadline_passed_while_stopped_outranks_a_built_in_agents_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = BatonProcess::start(dir.path());
    let (message, deadline) = message_due_in("test-resubscribe-message-id", "long", 1500);
    let params = json!({"message": message, "configuration": {"returnImmediately": true}});
    let task = first.call("SendMessage", params).await;
    let id = task["task"]["id"].as_str().unwrap().to_string();
    first.terminate();
    assert!(first.wait_exit(WAIT).success());

    sleep_past(deadline).await;
    let second = BatonProcess::start(dir.path());
    assert_failed_at_its_deadline(&second, &id).await;
}

/// A task still WORKING at its agent when the gateway stopped is picked up
/// again at start-up, unless its deadline passed meanwhile: then it fails
/// as it would have, and the agent is told to stop.
#[tokio::test]
async fn a_deadline_passed_while_stopped_fails_a_working_task_after_restart() {
    use baton::demo::vendor::{Reply, VendorAgent};
    let worker = VendorAgent::start("worker", &["refund"], |_| Reply::Working)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let start = || loopback_process(dir.path());
    let mut first = start();
    register_vendor(&first, "worker", &worker).await;
    let (message, deadline) = message_due_in("w", "refund", 2500);
    let params = json!({"message": message, "configuration": {"returnImmediately": true}});
    let reply = first.rpc("/agents/worker/a2a", "SendMessage", params).await;
    let id = reply["result"]["task"]["id"].as_str().unwrap().to_string();
    let until = Instant::now() + WAIT;
    while first.call("GetTask", json!({"id": id})).await["status"]["state"] != "TASK_STATE_WORKING"
    {
        assert!(Instant::now() < until, "the task never went WORKING");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.terminate();
    assert!(first.wait_exit(WAIT).success());

    sleep_past(deadline).await;
    let second = start();
    assert_failed_at_its_deadline(&second, &id).await;
    assert_eq!(worker.cancels().len(), 1, "the agent was told to stop");
    worker.stop().await;
}

#[tokio::test]
async fn a_deregistered_id_stays_its_agencys_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let start = || {
        BatonProcess::builder(dir.path())
            .args(["--allow-upstream", "127.0.0.0/8,::1"])
            .env("BATON_API_KEYS", "acme=KEY1,globex=KEY2")
            .start()
    };
    let mut first = start();
    let (status, card) = first
        .get_json("/agents/echo/.well-known/agent-card.json")
        .await;
    assert!(status.is_success());
    let register = json!({"id": "support", "card": card});
    let made = first
        .rpc_as("KEY1", "/registry", "RegisterAgent", register.clone())
        .await;
    assert_eq!(made["result"]["agent"]["owner"], "acme", "{made}");
    let removed = first
        .rpc_as(
            "KEY1",
            "/registry",
            "DeregisterAgent",
            json!({"id": "support"}),
        )
        .await;
    assert_eq!(removed["result"], json!({}), "{removed}");
    // acme's old tasks still name `support`: globex may not take it.
    let taken = first
        .rpc_as("KEY2", "/registry", "RegisterAgent", register.clone())
        .await;
    assert_eq!(taken["error"]["code"], -32602, "{taken}");
    first.terminate();
    assert!(first.wait_exit(WAIT).success());

    let second = start();
    let taken = second
        .rpc_as("KEY2", "/registry", "RegisterAgent", register.clone())
        .await;
    assert_eq!(taken["error"]["code"], -32602, "{taken}");
    // acme may take it again.
    let again = second
        .rpc_as("KEY1", "/registry", "RegisterAgent", register)
        .await;
    assert_eq!(again["result"]["agent"]["owner"], "acme", "{again}");
}

/// A registered agent's record shows its card as served now: after a
/// restart on another port, so under another public URL, not the card
/// published at registration.
#[tokio::test]
async fn an_agents_record_shows_the_card_served_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let start = || loopback_process(dir.path());
    let mut first = start();
    let (status, card) = first
        .get_json("/agents/echo/.well-known/agent-card.json")
        .await;
    assert!(status.is_success());
    let made = first
        .registry("RegisterAgent", json!({"id": "support", "card": card}))
        .await;
    assert!(made["agent"].is_object(), "{made}");
    first.terminate();
    assert!(first.wait_exit(WAIT).success());

    let second = start();
    let port = second.base.rsplit(':').next().unwrap().to_string();
    let (status, served) = second
        .get_json("/agents/support/.well-known/agent-card.json")
        .await;
    assert!(status.is_success());
    let url = served["supportedInterfaces"][0]["url"].as_str().unwrap();
    assert_eq!(url, format!("http://localhost:{port}/agents/support/a2a"));
    let got = second.registry("GetAgent", json!({"id": "support"})).await;
    assert_eq!(got["agent"]["publishedCard"], served, "{got}");
    let found = second.registry("SearchAgents", json!({})).await;
    let listed = found["agents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|agent| agent["id"] == "support")
        .cloned()
        .unwrap();
    assert_eq!(listed["publishedCard"], served);
}

/// A webhook on loopback that answers its first `failing` requests 503,
/// then 200; records the state of each notification it accepts.
async fn flaky_webhook(failing: usize) -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let accepted = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let recorded = accepted.clone();
    let arrived = std::sync::Arc::new(AtomicUsize::new(0));
    let app = axum::Router::new().fallback(move |body: axum::body::Bytes| {
        let (recorded, arrived) = (recorded.clone(), arrived.clone());
        async move {
            if arrived.fetch_add(1, Ordering::SeqCst) < failing {
                return axum::http::StatusCode::SERVICE_UNAVAILABLE;
            }
            let event: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            let state = event["statusUpdate"]["status"]["state"]
                .as_str()
                .or(event["task"]["status"]["state"].as_str())
                .unwrap_or_default()
                .to_string();
            recorded.lock().unwrap().push(state);
            axum::http::StatusCode::OK
        }
    });
    (format!("{}/hook", serve_on_loopback(app).await), accepted)
}

/// Sends a message the agent completes at once, with a push config for
/// the webhook at `url`.
async fn completed_task_with_webhook(baton: &BatonProcess, url: &str) {
    let message = user_message(&message_id("tck-complete-task"), "hi");
    let config = json!({"url": url, "token": "t"});
    let result = baton
        .call(
            "SendMessage",
            json!({"message": message, "configuration": {"taskPushNotificationConfig": config}}),
        )
        .await;
    assert_eq!(
        result["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{result}"
    );
}

// Multi-threaded: the webhook must answer while the test waits, blocking,
// for the process to exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_still_delivers_the_push_notifications_it_holds() {
    // Two refusals first: with retry backoff (0.5 s, doubling, jittered),
    // the task's two notifications take about 1.5 s to be accepted, well
    // within the 3 s grace (three took up to 3.5 s, and CI's load cut it).
    let (url, accepted) = flaky_webhook(2).await;
    let dir = tempfile::tempdir().unwrap();
    let mut baton = loopback_process(dir.path());
    completed_task_with_webhook(&baton, &url).await;
    assert!(accepted.lock().unwrap().is_empty(), "still being retried");

    baton.terminate();
    assert!(baton.wait_exit(WAIT).success(), "{}", baton.logs());
    // Delivered before the process ended, within its shutdown grace.
    assert_eq!(
        *accepted.lock().unwrap(),
        ["TASK_STATE_SUBMITTED", "TASK_STATE_COMPLETED"],
        "{}",
        baton.logs()
    );
}

// Multi-threaded: the webhook must answer while the test waits, blocking,
// for the process to exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_shutdown_grace_bounds_both_the_connections_and_the_push_drain() {
    use tokio::io::AsyncWriteExt as _;
    // A webhook that never accepts: its retries outlast any grace.
    let (url, _accepted) = flaky_webhook(usize::MAX).await;
    let dir = tempfile::tempdir().unwrap();
    let grace = Duration::from_secs(3);
    let mut baton = BatonProcess::builder(dir.path())
        .args(["--allow-upstream", "127.0.0.0/8,::1"])
        .shutdown_grace_secs(grace.as_secs())
        .start();
    completed_task_with_webhook(&baton, &url).await;
    // A request whose body never ends holds its connection open through
    // the whole drain.
    let address = baton.base.trim_start_matches("http://").to_string();
    let mut held = tokio::net::TcpStream::connect(address).await.unwrap();
    held.write_all(
        b"POST /a2a HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n\
          content-length: 1000\r\n\r\n{",
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;

    let started = Instant::now();
    baton.terminate();
    assert!(baton.wait_exit(WAIT).success(), "{}", baton.logs());
    let stopped_in = started.elapsed();
    // Each drain alone would take the whole grace.
    assert!(
        stopped_in < grace + Duration::from_millis(1500),
        "the stop took {stopped_in:?} with a grace of {grace:?}: {}",
        baton.logs()
    );
    drop(held);
}

/// A webhook on loopback that answers 503 until `open` is set, then 200,
/// and records each notification it accepts as (task id, the member of
/// the `StreamResponse`, the state it carries).
async fn webhook_opened_later(
    open: Arc<AtomicBool>,
) -> (String, Arc<std::sync::Mutex<Vec<(String, String, String)>>>) {
    let accepted = Arc::new(std::sync::Mutex::new(Vec::new()));
    let recorded = accepted.clone();
    let app = axum::Router::new().fallback(move |body: axum::body::Bytes| {
        let (open, recorded) = (open.clone(), recorded.clone());
        async move {
            if !open.load(Ordering::SeqCst) {
                return axum::http::StatusCode::SERVICE_UNAVAILABLE;
            }
            let event: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            let (member, inner) = event
                .as_object()
                .and_then(|members| members.iter().next())
                .map(|(member, inner)| (member.clone(), inner.clone()))
                .unwrap_or_default();
            let task_id = inner["taskId"].as_str().or(inner["id"].as_str());
            let state = inner["status"]["state"].as_str().unwrap_or_default();
            let noted = (
                task_id.unwrap_or_default().to_string(),
                member,
                state.to_string(),
            );
            recorded.lock().unwrap().push(noted);
            axum::http::StatusCode::OK
        }
    });
    (format!("{}/hook", serve_on_loopback(app).await), accepted)
}

// Multi-threaded: the webhook must answer while the test waits, blocking,
// for a process to exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_notifications_a_crash_cut_off_are_sent_after_the_restart() {
    let open = Arc::new(AtomicBool::new(false));
    let (url, accepted) = webhook_opened_later(open.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut first = loopback_process(dir.path());
    completed_task_with_webhook(&first, &url).await;
    let listed = first.call("ListTasks", json!({})).await;
    let task_id = listed["tasks"][0]["id"].as_str().unwrap().to_string();
    // Its notifications are still being retried.
    first.kill();
    assert!(accepted.lock().unwrap().is_empty());

    open.store(true, Ordering::SeqCst);
    let mut second = loopback_process(dir.path());
    let completed = (
        task_id.clone(),
        "task".to_string(),
        "TASK_STATE_COMPLETED".to_string(),
    );
    wait_until("the owed notification arrives", || {
        accepted.lock().unwrap().contains(&completed)
    })
    .await;
    // Once handled, what was owed is not sent again.
    second.terminate();
    assert!(second.wait_exit(WAIT).success(), "{}", second.logs());
    let third = loopback_process(dir.path());
    completed_task_with_webhook(&third, &url).await;
    wait_until("the new task's notifications arrive", || {
        accepted.lock().unwrap().len() >= 3
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let to_first: Vec<_> = accepted
        .lock()
        .unwrap()
        .iter()
        .filter(|(id, ..)| *id == task_id)
        .cloned()
        .collect();
    assert_eq!(to_first, [completed], "{}", third.logs());
}

// Multi-threaded: the webhook must answer while the test waits, blocking,
// for a process to exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_push_disabled_nothing_is_sent_and_push_on_again_sends_what_is_owed() {
    let (url, accepted) = webhook_opened_later(Arc::new(AtomicBool::new(true))).await;
    let dir = tempfile::tempdir().unwrap();
    let stop = |mut baton: BatonProcess| {
        baton.terminate();
        assert!(baton.wait_exit(WAIT).success(), "{}", baton.logs());
    };
    let first = loopback_process(dir.path());
    let message = user_message(&message_id("tck-input-required"), "hi");
    let config = json!({"url": url});
    let params =
        json!({"message": message, "configuration": {"taskPushNotificationConfig": config}});
    let reply = first.call("SendMessage", params).await;
    let task_id = reply["task"]["id"].as_str().unwrap().to_string();
    let waiting = "TASK_STATE_INPUT_REQUIRED".to_string();
    let told = |state: &str| accepted.lock().unwrap().iter().any(|(_, _, s)| s == state);
    wait_until("the webhook is told the task waits", || told(&waiting)).await;
    stop(first);
    let heard_before = accepted.lock().unwrap().len();

    let second = BatonProcess::builder(dir.path())
        .args(["--allow-upstream", "127.0.0.0/8,::1", "--disable-push"])
        .start();
    let resumed = answer(&second, &task_id).await;
    assert_eq!(resumed["task"]["status"]["state"], "TASK_STATE_COMPLETED");
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop(second);
    assert_eq!(
        accepted.lock().unwrap().len(),
        heard_before,
        "sent with push off"
    );

    let _third = loopback_process(dir.path());
    let completed = (
        task_id,
        "task".to_string(),
        "TASK_STATE_COMPLETED".to_string(),
    );
    wait_until("the owed notification arrives", || {
        accepted.lock().unwrap().contains(&completed)
    })
    .await;
}

/// A vendor agent named `id` that never answers its first send, and
/// answers every later one with `then`.
async fn silent_at_first(
    id: &str,
    then: baton::demo::vendor::Reply,
) -> baton::demo::vendor::VendorAgent {
    silent_once_among(id, &["waiting"], &Arc::default(), then).await
}

/// A vendor agent `id` declaring `skills` that never answers the first send
/// made to any of the agents sharing `sent_once`, and answers every other
/// with `then`.
async fn silent_once_among(
    id: &str,
    skills: &[&str],
    sent_once: &Arc<AtomicBool>,
    then: baton::demo::vendor::Reply,
) -> baton::demo::vendor::VendorAgent {
    use baton::demo::vendor::{Reply, VendorAgent};
    let sent_once = sent_once.clone();
    VendorAgent::start(id, skills, move |_| {
        if sent_once.swap(true, Ordering::SeqCst) {
            then.clone()
        } else {
            Reply::Silent
        }
    })
    .await
    .unwrap()
}

/// A process over the ledger in `data` with `planner` and `worker`
/// registered, that has been sent `text` for the planner without waiting
/// for the outcome; with the gateway task's id.
async fn planner_task(
    data: &std::path::Path,
    planner: &baton::demo::vendor::VendorAgent,
    worker: &baton::demo::vendor::VendorAgent,
    text: &str,
) -> (BatonProcess, String) {
    let baton = loopback_process(data);
    register_vendor(&baton, "planner", planner).await;
    register_vendor(&baton, "worker", worker).await;
    let params = json!({
        "message": user_message(&message_id("plan"), text),
        "configuration": {"returnImmediately": true},
    });
    let reply = baton
        .rpc("/agents/planner/a2a", "SendMessage", params)
        .await;
    let id = reply["result"]["task"]["id"].as_str().unwrap().to_string();
    (baton, id)
}

/// A send whose agent had not answered when Baton was killed created no
/// task, and no one will fill its idempotency claim: after the restart a
/// repeat takes the key over and runs, and a repeat after that replays it.
#[tokio::test]
async fn a_key_claimed_by_a_send_no_agent_answered_before_a_crash_is_taken_over() {
    use baton::demo::vendor::Reply;
    let done = Reply::Complete {
        text: Some("done".into()),
        artifacts: Vec::new(),
    };
    let vendor = silent_at_first("slowpoke", done).await;
    let dir = tempfile::tempdir().unwrap();
    let mut first = loopback_process(dir.path());
    register_vendor(&first, "slowpoke", &vendor).await;
    let message = user_message(&message_id("once"), "exactly once");
    let send = |baton: &BatonProcess| {
        let body = json!({"jsonrpc": "2.0", "id": 1, "method": "SendMessage",
                          "params": {"message": message}});
        reqwest::Client::new()
            .post(baton.url("/agents/slowpoke/a2a"))
            .header("content-type", "application/json")
            .header("a2a-version", "1.0")
            .header("idempotency-key", "k-1")
            .body(body.to_string())
            .timeout(WAIT)
            .send()
    };
    // The first send is claimed and reaches its agent, which never answers.
    let held = tokio::spawn(send(&first));
    wait_until("the agent got no send", || !vendor.sends().is_empty()).await;
    first.kill();
    let _ = held.await;

    let second = loopback_process(dir.path());
    let reply: serde_json::Value = send(&second).await.unwrap().json().await.unwrap();
    let task = &reply["result"]["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{reply}");
    assert_eq!(vendor.sends().len(), 2);
    let again: serde_json::Value = send(&second).await.unwrap().json().await.unwrap();
    assert_eq!(again["result"]["task"]["id"], task["id"], "{again}");
    assert_eq!(vendor.sends().len(), 2, "the repeat is replayed, not sent");
    vendor.stop().await;
}

/// A planner that hands its task to `worker` with `returnToParent`, leaving
/// its own task in `state`, and answers the turn that brings the result back
/// with `on_result` (into that task if it waits for input, else into its
/// context as a new one).
async fn returning_planner(
    state: TaskState,
    on_result: impl Fn() -> baton::demo::vendor::Reply + Send + Sync + 'static,
) -> baton::demo::vendor::VendorAgent {
    use baton::demo::vendor::{Reply, VendorAgent};
    use baton::handoff::payload::HANDOFF_RESULT_MEDIA_TYPE;
    VendorAgent::start("planner", &["plan"], move |turn| {
        let returned = turn
            .message
            .parts
            .iter()
            .any(|part| part.media_type == HANDOFF_RESULT_MEDIA_TYPE);
        if returned {
            return on_result();
        }
        if turn.task_id.is_some() {
            return Reply::Fail("no handoff result".into());
        }
        let payload = json!({
            "handoffId": "hf_restart", "from": "planner", "to": "worker",
            "reason": "specialization", "goal": "Do the part.",
            "summary": "The plan needs the worker's result.", "returnToParent": true,
        });
        Reply::Handoff { payload, state }
    })
    .await
    .unwrap()
}

/// A transfer's target still working when Baton was killed returns its
/// result to the source after the restart, as it would have without one:
/// the source's own task gets it and finishes the gateway task.
#[tokio::test]
async fn a_result_due_back_to_its_source_at_a_crash_is_returned_after_restart() {
    use baton::demo::vendor::{Reply, VendorAgent};
    let done = || Reply::artifact("plan", json!({"done": true}));
    let planner = returning_planner(TaskState::InputRequired, done).await;
    let worker = VendorAgent::start("worker", &["slow"], |_| {
        let result = Reply::artifact("part", json!({"value": 42}));
        Reply::Later(Duration::from_millis(1500), Box::new(result))
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, id) = planner_task(dir.path(), &planner, &worker, "plan it").await;
    // Killed once the worker holds the task and Baton follows it there.
    let followed = || {
        worker
            .received()
            .iter()
            .any(|call| call.method == "GetTask")
    };
    wait_until("Baton never followed the worker's task", followed).await;
    first.kill();

    let second = loopback_process(dir.path());
    let task = ended(&second, &id).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(common::artifact_names(&task), ["part", "plan"], "{task}");
    assert_eq!(
        planner.sends().len(),
        2,
        "the result went back to the planner"
    );
    assert_eq!(worker.sends().len(), 1);
    planner.stop().await;
    worker.stop().await;
}

/// A result returned to its source that the source had not acknowledged
/// when Baton was killed goes back again after the restart, announced as a
/// retry, with the same messageId, into the source's waiting task.
#[tokio::test]
async fn a_result_returned_unacknowledged_at_a_crash_is_returned_again_after_restart() {
    let [_, returned, again] = returned_across_a_crash(TaskState::InputRequired, false).await;
    assert_eq!(
        returned["taskId"], again["taskId"],
        "into the task it left waiting"
    );
}

/// The same for a source that ended its own task as it handed on: its
/// result goes again into the source's own context (the planner mints its
/// contexts, so that one is not the gateway's), as a new task there, not
/// into the one it ended.
#[tokio::test]
async fn a_result_returned_to_its_sources_context_unacknowledged_at_a_crash_goes_again() {
    let [asked, returned, again] = returned_across_a_crash(TaskState::Completed, true).await;
    assert_eq!(returned["contextId"], again["contextId"]);
    let planners_context = returned["contextId"].as_str().unwrap();
    assert_ne!(
        planners_context, asked["contextId"],
        "the gateway's context"
    );
    for message in [returned, again] {
        assert!(message.get("taskId").is_none(), "a new task: {message}");
    }
}

/// Baton is killed once a result went back to a planner that left its task
/// in `state` and does not answer the result's first delivery; after the
/// restart the task completes with the result delivered again (the same
/// message, announced as a retry). Returns the planner's three messages: the
/// task's, the result's, and the result's again.
async fn returned_across_a_crash(state: TaskState, own_contexts: bool) -> [serde_json::Value; 3] {
    use baton::demo::vendor::{Reply, VendorAgent};
    let heard = AtomicBool::new(false);
    let planner = returning_planner(state, move || {
        if heard.swap(true, Ordering::SeqCst) {
            Reply::artifact("plan", json!({"done": true}))
        } else {
            Reply::Silent
        }
    })
    .await;
    if own_contexts {
        planner.mint_own_contexts();
    }
    let worker = VendorAgent::start("worker", &["part"], |_| {
        Reply::artifact("part", json!({"value": 42}))
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, id) = planner_task(dir.path(), &planner, &worker, "plan it").await;
    wait_until("the result never went back", || planner.sends().len() == 2).await;
    first.kill();

    let second = loopback_process(dir.path());
    let task = ended(&second, &id).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(common::artifact_names(&task), ["part", "plan"], "{task}");
    assert!(task["history"].to_string().contains("RETRY"), "{task}");
    let messages: Vec<_> = planner
        .sends()
        .into_iter()
        .map(|send| send.params["message"].clone())
        .collect();
    let Ok([asked, returned, again]) = <[_; 3]>::try_from(messages) else {
        panic!("three messages to the planner: {task}");
    };
    assert_eq!(
        returned["messageId"], again["messageId"],
        "the same return again"
    );
    assert_eq!(returned["parts"], again["parts"]);
    assert_eq!(worker.sends().len(), 1);
    planner.stop().await;
    worker.stop().await;
    [asked, returned, again]
}

/// Registers `worker` at `first`, sends it `params` there (a handoff,
/// accepted SUBMITTED) and kills `first` once the worker was sent the
/// delivery; the task's id.
async fn accepted_then_killed(
    mut first: BatonProcess,
    worker: &baton::demo::vendor::VendorAgent,
    params: serde_json::Value,
) -> String {
    register_vendor(&first, "worker", worker).await;
    let reply = first.rpc("/a2a", "SendMessage", params).await;
    let task = &reply["result"]["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_SUBMITTED", "{reply}");
    let id = task["id"].as_str().unwrap().to_string();
    wait_until("the worker got no delivery", || !worker.sends().is_empty()).await;
    first.kill();
    id
}

/// A handoff its target had not acknowledged when Baton was killed goes on
/// along the failure ladder after the restart: announced as a retry, and
/// delivered again with the same messageId.
#[tokio::test]
async fn a_handoff_unacknowledged_at_a_crash_is_retried_after_restart() {
    use baton::demo::vendor::Reply;
    let refund = Reply::artifact("refund", json!({"refundId": "rf_1"}));
    let worker = silent_at_first("worker", refund).await;
    let dir = tempfile::tempdir().unwrap();
    let start = || loopback_process(dir.path());
    let payload = common::handoff_payload("triage", json!({"to": "worker"}), json!({}));
    let params = json!({
        "message": common::handoff_message(payload),
        "configuration": {"returnImmediately": true},
    });
    let id = accepted_then_killed(start(), &worker, params).await;

    let second = start();
    let task = ended(&second, &id).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(task["artifacts"][0]["name"], "refund", "{task}");
    let deliveries = worker.sends();
    assert_eq!(deliveries.len(), 2);
    let message_ids: Vec<&serde_json::Value> = deliveries
        .iter()
        .map(|call| &call.params["message"]["messageId"])
        .collect();
    assert_eq!(message_ids[0], message_ids[1], "the same delivery again");
    assert!(task["history"].to_string().contains("RETRY"), "{task}");
    worker.stop().await;
}

/// The caller's answer to an escalated handoff, kept on its hop, goes with
/// the redelivery made after a crash cut the first one off, as it would
/// have without the crash.
#[tokio::test]
async fn an_answer_to_an_escalated_handoff_is_delivered_after_a_crash() {
    use baton::demo::vendor::{Reply, VendorAgent};
    use baton::handoff::payload::HANDOFF_MEDIA_TYPE;
    // Silent to the ladder's two attempts and to the answer's redelivery.
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = calls.clone();
    let worker = VendorAgent::start("worker", &["refund"], move |_| {
        if counted.fetch_add(1, Ordering::SeqCst) < 3 {
            Reply::Silent
        } else {
            Reply::artifact("refund", json!({"refundId": "rf_1"}))
        }
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let start = || escalating_process(dir.path());
    let mut first = start();
    register_vendor(&first, "worker", &worker).await;
    let id = escalated_handoff(&first, json!({"to": "worker"})).await;
    go_ahead(&first, &id).await;
    wait_until("the worker got no redelivery", || worker.sends().len() >= 3).await;
    first.kill();

    let second = start();
    let task = ended(&second, &id).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    let sends = worker.sends();
    let last = sends.last().unwrap().params["message"]["parts"].to_string();
    assert!(last.contains("go ahead"), "{last}");
    assert!(last.contains(HANDOFF_MEDIA_TYPE), "{last}");
    worker.stop().await;
}

/// A process over the ledger in `dir` whose ladder waits 300 ms for an
/// acknowledgement and escalates.
fn escalating_process(dir: &std::path::Path) -> BatonProcess {
    BatonProcess::builder(dir)
        .args(["--allow-upstream", "127.0.0.0/8,::1"])
        .args(["--ack-timeout-ms", "300", "--escalate"])
        .start()
}

/// The id of a handoff from triage to `target` (its `to` or `toSkill`),
/// sent blocking, which the ladder escalated to the caller.
async fn escalated_handoff(baton: &BatonProcess, target: serde_json::Value) -> String {
    let payload = common::handoff_payload("triage", target, json!({}));
    let message = common::handoff_message(payload);
    let reply = baton
        .rpc("/a2a", "SendMessage", json!({"message": message}))
        .await;
    let task = &reply["result"]["task"];
    assert_eq!(
        task["status"]["state"], "TASK_STATE_INPUT_REQUIRED",
        "{reply}"
    );
    task["id"].as_str().unwrap().to_string()
}

/// Answers the escalated task `id` with "go ahead", not waiting for the
/// outcome.
async fn go_ahead(baton: &BatonProcess, id: &str) {
    let answer = user_message_on(id, &message_id("go"), "go ahead");
    let params = json!({"message": answer, "configuration": {"returnImmediately": true}});
    baton.rpc("/a2a", "SendMessage", params).await;
}

/// The same for a handoff the ladder rerouted before it escalated: the
/// answer's redelivery to the alternative holding it begins a new ladder,
/// so after a crash cut it off the alternative gets its retry, as it would
/// have without the crash, and the agent given up on before the escalation
/// is not tried again.
#[tokio::test]
async fn an_answer_to_an_escalated_reroute_is_delivered_after_a_crash() {
    use baton::demo::vendor::{Reply, VendorAgent};
    use baton::handoff::payload::HANDOFF_MEDIA_TYPE;
    // Each is silent to its first two deliveries: the first choice's two
    // attempts, or the reroute's and the answer's redelivery.
    let silent_twice = |id: &'static str| {
        let calls = std::sync::atomic::AtomicUsize::new(0);
        VendorAgent::start(id, &["refunds"], move |_| {
            if calls.fetch_add(1, Ordering::SeqCst) < 2 {
                Reply::Silent
            } else {
                Reply::artifact("refund", json!({"by": id}))
            }
        })
    };
    let agents = [
        silent_twice("refunds-a").await.unwrap(),
        silent_twice("refunds-b").await.unwrap(),
    ];
    let dir = tempfile::tempdir().unwrap();
    let start = || escalating_process(dir.path());
    let mut first = start();
    for agent in &agents {
        register_vendor(&first, &agent.card().name, agent).await;
    }
    let id = escalated_handoff(&first, json!({"toSkill": "refunds"})).await;
    let sends = || agents.iter().map(|a| a.sends().len()).collect::<Vec<_>>();
    let [first_choice, holder] = if sends() == [2, 1] { [0, 1] } else { [1, 0] };
    go_ahead(&first, &id).await;
    wait_until("the holder got no redelivery", || sends()[holder] >= 2).await;
    first.kill();

    let second = start();
    let task = ended(&second, &id).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(
        sends()[first_choice],
        2,
        "given up on before the escalation"
    );
    assert_eq!(sends()[holder], 3, "the reroute, the redelivery, its retry");
    let last = agents[holder].sends().last().unwrap().params["message"]["parts"].to_string();
    assert!(last.contains("go ahead"), "{last}");
    assert!(last.contains(HANDOFF_MEDIA_TYPE), "{last}");
    for agent in agents {
        agent.stop().await;
    }
}

/// The same for a call a routing rule sent by skill (a handoff, DESIGN.md
/// §3.3): after the restart the ladder goes on, by the rule's skill.
#[tokio::test]
async fn a_routed_call_unacknowledged_at_a_crash_is_retried_after_restart() {
    use baton::demo::vendor::Reply;
    let refund = Reply::artifact("refund", json!({"refundId": "rf_1"}));
    let worker = silent_once_among("worker", &["refund"], &Arc::default(), refund).await;
    let dir = tempfile::tempdir().unwrap();
    let config_dir = tempfile::tempdir().unwrap();
    let config = config_dir.path().join("baton.toml");
    std::fs::write(&config, "[[route]]\nwhen = { skill = \"refund\" }\n").unwrap();
    let start = || {
        BatonProcess::builder(dir.path())
            .args(["--allow-upstream", "127.0.0.0/8,::1", "--config"])
            .args([&config])
            .start()
    };
    let params = json!({
        "message": user_message(&message_id("m"), "refund me"),
        "metadata": {"skill": "refund"},
        "configuration": {"returnImmediately": true},
    });
    let id = accepted_then_killed(start(), &worker, params).await;

    let second = start();
    let task = ended(&second, &id).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert!(task["history"].to_string().contains("RETRY"), "{task}");
    assert_eq!(worker.sends().len(), 2);
    worker.stop().await;
}

/// An agent registered under an id a routing rule later names as a tenant
/// label does not take that label's calls after the restart that brings
/// the rule: they follow the rule.
#[tokio::test]
async fn a_stored_agent_does_not_take_the_calls_of_a_tenant_label_named_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let config_dir = tempfile::tempdir().unwrap();
    let config = config_dir.path().join("baton.toml");
    let builder =
        || BatonProcess::builder(dir.path()).args(["--allow-upstream", "127.0.0.0/8,::1"]);
    let mut first = builder().start();
    let (_, card) = first
        .get_json("/agents/scenario/.well-known/agent-card.json")
        .await;
    let registered = first
        .registry("RegisterAgent", json!({"id": "acme", "card": card}))
        .await;
    assert!(registered.get("error").is_none(), "{registered}");
    first.terminate();
    first.wait_exit(Duration::from_secs(20));

    let rule = "[[route]]\nwhen = { tenant = \"acme\" }\nto = { agent = \"echo\" }\n";
    std::fs::write(&config, rule).unwrap();
    let second = builder().args(["--config"]).args([&config]).start();
    second.wait_for_log("tenant label", Duration::from_secs(5));
    let reply = second
        .call(
            "SendMessage",
            json!({"tenant": "acme", "message": user_message(&message_id("m"), "hello")}),
        )
        .await;
    let task = &reply["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{reply}");
    assert_eq!(common::artifact_names(task), ["echo"], "the rule's agent");
}

/// The same for a transfer: the message built for its target is kept until
/// the target acknowledges it, so after the restart the ladder delivers it
/// again, with its messageId, and the target's work completes the task.
#[tokio::test]
async fn a_transfer_unacknowledged_at_a_crash_is_retried_after_restart() {
    use baton::demo::vendor::{Reply, VendorAgent};
    let planner = VendorAgent::start("planner", &["plan"], |_| {
        let payload = json!({
            "handoffId": "hf_transfer_restart", "from": "planner", "to": "worker",
            "reason": "specialization", "goal": "Do the refund.",
            "summary": "The worker does refunds.",
        });
        Reply::Handoff {
            payload,
            state: TaskState::Completed,
        }
    })
    .await
    .unwrap();
    let refund = Reply::artifact("refund", json!({"refundId": "rf_2"}));
    let worker = silent_at_first("worker", refund).await;
    let dir = tempfile::tempdir().unwrap();
    let (mut first, id) = planner_task(dir.path(), &planner, &worker, "refund order 7").await;
    wait_until("the worker got no delivery", || !worker.sends().is_empty()).await;
    first.kill();

    let second = loopback_process(dir.path());
    let task = ended(&second, &id).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(common::artifact_names(&task), ["refund"], "{task}");
    let deliveries = worker.sends();
    assert_eq!(deliveries.len(), 2);
    let messages: Vec<&serde_json::Value> = deliveries
        .iter()
        .map(|call| &call.params["message"])
        .collect();
    assert_eq!(
        messages[0]["messageId"], messages[1]["messageId"],
        "the same delivery again"
    );
    assert_eq!(messages[0]["parts"], messages[1]["parts"]);
    assert!(task["history"].to_string().contains("RETRY"), "{task}");
    let (status, trace) = second.get_json(&format!("/tasks/{id}/trace")).await;
    assert_eq!(status, 200, "{trace}");
    assert_eq!(trace["hops"][1]["kind"], "transfer", "{trace}");
    assert_eq!(trace["hops"][1]["attempts"], 2, "{trace}");
    assert_eq!(planner.sends().len(), 1);
    planner.stop().await;
    worker.stop().await;
}

/// A reroute its alternative had not acknowledged at a crash goes on after
/// the restart as the ladder would have: the alternative had its one
/// attempt, so the next healthy agent with the skill gets the delivery, and
/// the first choice, given up on before the crash, is not tried again.
#[tokio::test]
async fn a_reroute_unacknowledged_at_a_crash_goes_on_to_the_next_alternative() {
    use baton::demo::vendor::{Reply, VendorAgent};
    let first_choice = VendorAgent::start("refunds-a", &["refunds"], |_| Reply::Silent)
        .await
        .unwrap();
    // Whichever alternative is rerouted to first is silent; then both answer.
    let sent_once = Arc::default();
    let alternative = |id: &'static str| {
        let refund = Reply::artifact("refund", json!({"by": id}));
        silent_once_among(id, &["refunds"], &sent_once, refund)
    };
    let alternatives = [
        alternative("refunds-b").await,
        alternative("refunds-c").await,
    ];
    let dir = tempfile::tempdir().unwrap();
    let start = || {
        BatonProcess::builder(dir.path())
            .args(["--allow-upstream", "127.0.0.0/8,::1"])
            .args(["--ack-timeout-ms", "300"])
            .start()
    };
    let mut first = start();
    register_vendor(&first, "refunds-a", &first_choice).await;
    for agent in &alternatives {
        register_vendor(&first, &agent.card().name, agent).await;
    }
    let payload = common::handoff_payload("triage", json!({"toSkill": "refunds"}), json!({}));
    let params = json!({
        "message": common::handoff_message(payload),
        "configuration": {"returnImmediately": true},
    });
    let reply = first.rpc("/a2a", "SendMessage", params).await;
    let id = reply["result"]["task"]["id"].as_str().unwrap().to_string();
    let delivered = || alternatives.iter().map(|a| a.sends().len()).sum::<usize>();
    wait_until("no reroute was delivered", || delivered() > 0).await;
    first.kill();

    let second = start();
    let task = ended(&second, &id).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(common::artifact_names(&task), ["refund"], "{task}");
    assert_eq!(first_choice.sends().len(), 2, "a delivery and its retry");
    for agent in &alternatives {
        let name = agent.card().name;
        let sends = agent.sends();
        assert_eq!(sends.len(), 1, "{name}: one attempt");
        // Each delivery's control names its own agent as the chain's end.
        let control = &sends[0].params["message"]["metadata"]["urn:baton:handoff:v1"];
        assert_eq!(
            control["chain"].as_array().unwrap().last().unwrap(),
            &json!(name)
        );
    }
    assert_eq!(
        task["history"].to_string().matches("REROUTED").count(),
        2,
        "{task}"
    );
    first_choice.stop().await;
    for agent in alternatives {
        agent.stop().await;
    }
}

/// An agent whose one task, `up-1`, waits at AUTH_REQUIRED until
/// `signed_in` is set (out of band): then GetTask and SubscribeToTask show
/// it COMPLETED. Its streams end at once.
async fn agent_signed_in_out_of_band(signed_in: Arc<AtomicBool>) -> String {
    let app = axum::Router::new().fallback(move |body: axum::body::Bytes| {
        let signed_in = signed_in.clone();
        async move {
            let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            let state = if signed_in.load(Ordering::SeqCst) {
                "TASK_STATE_COMPLETED"
            } else {
                "TASK_STATE_AUTH_REQUIRED"
            };
            let task = json!({"id": "up-1", "contextId": "up-ctx", "status": {"state": state}});
            let (content_type, body) = match request["method"].as_str() {
                Some("GetTask") => {
                    let body = json!({"jsonrpc": "2.0", "id": request["id"], "result": task});
                    ("application/json", body.to_string())
                }
                _ => {
                    let event =
                        json!({"jsonrpc": "2.0", "id": request["id"], "result": {"task": task}});
                    ("text/event-stream", format!("data: {event}\n\n"))
                }
            };
            ([(axum::http::header::CONTENT_TYPE, content_type)], body)
        }
    });
    format!("{}/a2a", serve_on_loopback(app).await)
}

/// A task left at AUTH_REQUIRED by a remote agent is followed again after a
/// restart: the agent may go on without a message (A2A §7.6.1).
#[tokio::test]
async fn a_task_at_auth_required_is_followed_again_after_a_restart() {
    let signed_in = Arc::new(AtomicBool::new(false));
    let url = agent_signed_in_out_of_band(signed_in.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let mut first = loopback_process(dir.path());
    let mut card = serde_json::to_value(common::agents::card("auth")).unwrap();
    card["supportedInterfaces"][0]["url"] = json!(url);
    card["capabilities"]["streaming"] = json!(true);
    first
        .registry("RegisterAgent", json!({"id": "auth", "card": card}))
        .await;
    let message = json!({"message": user_message(&message_id("m"), "start")});
    let reply = first.rpc("/agents/auth/a2a", "SendMessage", message).await;
    let task = &reply["result"]["task"];
    assert_eq!(
        task["status"]["state"], "TASK_STATE_AUTH_REQUIRED",
        "{reply}"
    );
    let id = task["id"].as_str().unwrap().to_string();
    first.kill();

    signed_in.store(true, Ordering::SeqCst);
    let second = loopback_process(dir.path());
    let task = ended(&second, &id).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
}

/// An agent answering each streaming send with `chunks` chunks of 1 KiB of
/// one artifact, 2 ms apart, then COMPLETED; returns its card.
async fn chunk_streaming_agent(chunks: usize) -> serde_json::Value {
    use axum::response::IntoResponse;
    use futures::StreamExt;
    let app = axum::Router::new().fallback(move |body: axum::body::Bytes| async move {
        let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let id = request["id"].clone();
        let (task, context) = ("up-1", "up-ctx");
        let chunk = move |i: usize| {
            json!({"artifactUpdate": {"taskId": task, "contextId": context, "append": i > 0,
                "artifact": {"artifactId": "a1", "parts": [{"text": format!("{i:>1024}")}]}}})
        };
        let status = |state: &str| {
            json!({"statusUpdate": {"taskId": task, "contextId": context,
                "status": {"state": state}}})
        };
        let events = std::iter::once(status("TASK_STATE_WORKING"))
            .chain((0..chunks).map(chunk))
            .chain([status("TASK_STATE_COMPLETED")]);
        let stream = futures::stream::iter(events).then(move |event| {
            let frame = json!({"jsonrpc": "2.0", "id": id, "result": event});
            async move {
                tokio::time::sleep(Duration::from_millis(2)).await;
                Ok::<_, std::convert::Infallible>(format!("data: {frame}\n\n"))
            }
        });
        let sse = [(axum::http::header::CONTENT_TYPE, "text/event-stream")];
        (sse, axum::body::Body::from_stream(stream)).into_response()
    });
    let mut card = common::agents::card("writer");
    card.supported_interfaces[0].url = format!("{}/a2a", serve_on_loopback(app).await);
    card.capabilities.streaming = Some(true);
    serde_json::to_value(card).unwrap()
}

/// Bytes of frames in the ledger's log (its segments are zero-filled after them).
fn logged_bytes(data: &std::path::Path) -> usize {
    let entries = std::fs::read_dir(data.join("wal")).unwrap();
    entries
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "log"))
        .map(|segment| std::fs::read(segment).unwrap())
        .map(|bytes| bytes.iter().rposition(|&b| b != 0).map_or(0, |at| at + 1))
        .sum()
}

/// An answer streamed in many chunks makes a large record, whose writes the
/// log holds as what each added: after a SIGKILL straight after the answer
/// the task reads back whole, rebuilt from them.
#[tokio::test]
async fn a_task_streamed_in_many_chunks_survives_a_sigkill_whole() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = loopback_process(dir.path());
    let card = chunk_streaming_agent(48).await;
    first
        .registry("RegisterAgent", json!({"id": "writer", "card": card}))
        .await;
    let message = user_message(&message_id("write"), "write it all");
    let sent = first
        .rpc(
            "/agents/writer/a2a",
            "SendMessage",
            json!({"message": message}),
        )
        .await;
    let task_id = sent["result"]["task"]["id"]
        .as_str()
        .expect("a task")
        .to_string();
    let before = first.call("GetTask", json!({"id": task_id})).await;
    assert_eq!(before["status"]["state"], "TASK_STATE_COMPLETED", "{sent}");
    assert_eq!(
        before["artifacts"][0]["parts"].as_array().unwrap().len(),
        48
    );
    // Whole records would be at least the sum of 1..=48 KiB.
    let logged = logged_bytes(dir.path());
    assert!(logged < 400 * 1024, "{logged} bytes logged");
    first.kill();

    let second = loopback_process(dir.path());
    assert_eq!(second.call("GetTask", json!({"id": task_id})).await, before);
}
