//! Proxied agents across restarts, with the `baton` binary as an operator
//! runs it: an *upstream* Baton serves the `scenario` agent, and a *gateway*
//! Baton proxies to it through a card in `--agent-cards`. A task in flight
//! when the gateway stops is picked up from the upstream after the restart;
//! agent-card files are registered under owner `local`; a default agent
//! nobody provides fails `--validate-config`.

mod common;
#[path = "common/process.rs"]
mod process;

use common::{message_id, user_message};
use process::{BatonProcess, PROCESS_WAIT, run_baton};
use serde_json::{Value, json};
use std::ffi::OsStr;
use std::path::Path;
use std::time::{Duration, Instant};
use tempfile::TempDir;

/// Longest the gateway may take to finish a task after its restart.
const AFTER_RESTART: Duration = Duration::from_secs(15);

/// An upstream Baton serving `scenario`, whose long-running task lasts
/// 2 × 1.5 s. It runs in its own directory, away from the repository's
/// `agent-cards` and any `baton.toml`.
fn start_upstream(dir: &TempDir) -> BatonProcess {
    let data = dir.path().join("upstream-data");
    let cards = dir.path().join("upstream-cards");
    std::fs::create_dir_all(&cards).unwrap();
    BatonProcess::builder(&data)
        .current_dir(dir.path())
        .default_agent("scenario")
        .env("TCK_STREAMING_TIMEOUT", "1.5")
        .args([OsStr::new("--agent-cards"), cards.as_os_str()])
        .start()
}

/// Writes the upstream's published `scenario` card as `remote.json` into
/// `cards`, and returns it.
async fn publish_remote_card(upstream: &BatonProcess, cards: &Path) -> Value {
    let (status, card) = upstream
        .get_json("/agents/scenario/.well-known/agent-card.json")
        .await;
    assert_eq!(status, 200, "{card}");
    std::fs::create_dir_all(cards).unwrap();
    std::fs::write(cards.join("remote.json"), card.to_string()).unwrap();
    card
}

/// A gateway Baton over `data`, proxying to loopback upstreams, with the
/// cards in `cards` and `remote` serving `/a2a`.
fn start_gateway(dir: &TempDir, data: &Path, cards: &Path) -> BatonProcess {
    BatonProcess::builder(data)
        .current_dir(dir.path())
        .default_agent("remote")
        .args(["--allow-upstream", "127.0.0.1,::1"])
        .args([OsStr::new("--agent-cards"), cards.as_os_str()])
        .start()
}

/// Polls GetTask (bounded) until the task is in `state`; returns the task.
async fn wait_for_state(
    baton: &BatonProcess,
    task_id: &str,
    state: &str,
    bound: Duration,
) -> Value {
    let started = Instant::now();
    loop {
        let task = baton.call("GetTask", json!({"id": task_id})).await;
        if task["status"]["state"] == state {
            return task;
        }
        assert!(
            started.elapsed() < bound,
            "task {task_id} not {state} within {bound:?}: {task}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The agents SearchAgents lists (one page holds them all here).
async fn all_agents(baton: &BatonProcess) -> Vec<Value> {
    let page = baton
        .registry("SearchAgents", json!({"pageSize": 100}))
        .await;
    assert_eq!(page["nextPageToken"], "", "{page}");
    page["agents"].as_array().expect("agents").clone()
}

fn count_of(agents: &[Value], id: &str) -> usize {
    agents.iter().filter(|agent| agent["id"] == id).count()
}

#[tokio::test]
async fn a_proxied_task_in_flight_at_a_gateway_restart_completes_from_the_upstream() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = start_upstream(&dir);
    let cards = dir.path().join("cards");
    publish_remote_card(&upstream, &cards).await;
    let gateway_data = dir.path().join("gateway-data");
    let mut gateway = start_gateway(&dir, &gateway_data, &cards);

    let before = gateway.registry("GetAgent", json!({"id": "remote"})).await["agent"].clone();
    assert_eq!(before["owner"], "local", "{before}");

    let params = json!({
        "message": user_message(&message_id("test-resubscribe-message-id"), "long"),
        "configuration": {"returnImmediately": true},
    });
    let sent = gateway.call("SendMessage", params).await;
    let task_id = sent["task"]["id"].as_str().expect("a task").to_string();
    let context_id = sent["task"]["contextId"].as_str().unwrap().to_string();
    let working = wait_for_state(&gateway, &task_id, "TASK_STATE_WORKING", PROCESS_WAIT).await;
    assert_eq!(working["id"], task_id);

    // The upstream holds the task too, still working.
    let upstream_tasks = upstream.call("ListTasks", json!({})).await;
    assert_eq!(upstream_tasks["totalSize"], 1, "{upstream_tasks}");
    let upstream_task = upstream_tasks["tasks"][0].clone();
    assert_eq!(upstream_task["contextId"], context_id, "{upstream_task}");
    let upstream_id = upstream_task["id"].as_str().unwrap().to_string();

    let stopped = Instant::now();
    gateway.terminate();
    let status = gateway.wait_exit(PROCESS_WAIT);
    assert!(status.success(), "the gateway exited with {status}");
    let still = upstream.call("GetTask", json!({"id": upstream_id})).await;
    assert_eq!(
        still["status"]["state"],
        "TASK_STATE_WORKING",
        "the gateway stopped after the upstream task ended ({:?} after the stop); \
         nothing was left to pick up: {still}",
        stopped.elapsed()
    );

    let gateway = start_gateway(&dir, &gateway_data, &cards);
    let done = wait_for_state(&gateway, &task_id, "TASK_STATE_COMPLETED", AFTER_RESTART).await;
    assert_eq!(done["id"], task_id, "the gateway task keeps its id");
    assert_eq!(done["contextId"], context_id);
    let listed = gateway.call("ListTasks", json!({})).await;
    assert_eq!(listed["totalSize"], 1, "{listed}");
    assert_eq!(listed["tasks"][0]["id"], task_id);

    // The upstream finished its own task, and was not sent the message again.
    let upstream_tasks = upstream.call("ListTasks", json!({})).await;
    assert_eq!(upstream_tasks["totalSize"], 1, "{upstream_tasks}");
    assert_eq!(upstream_tasks["tasks"][0]["id"], upstream_id);
    let upstream_done = upstream.call("GetTask", json!({"id": upstream_id})).await;
    assert_eq!(
        upstream_done["status"]["state"], "TASK_STATE_COMPLETED",
        "{upstream_done}"
    );

    // The registry record survived the restart, once, as first registered.
    let after = gateway.registry("GetAgent", json!({"id": "remote"})).await["agent"].clone();
    assert_eq!(after["owner"], "local", "{after}");
    assert_eq!(after["registeredAt"], before["registeredAt"], "{after}");
    assert_eq!(after["card"], before["card"]);
    let agents = all_agents(&gateway).await;
    assert_eq!(count_of(&agents, "remote"), 1, "{agents:?}");
    assert_eq!(agents.len(), 3, "echo, scenario and remote: {agents:?}");
    let logs = gateway.logs();
    assert!(
        !logs.contains("card not registered") && !logs.contains("already registered"),
        "the restarted gateway complained about its card:\n{logs}"
    );
}

#[tokio::test]
async fn agent_card_files_are_registered_at_start_up_under_owner_local() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = start_upstream(&dir);
    let cards = dir.path().join("cards");
    let card = publish_remote_card(&upstream, &cards).await;
    // A card that is JSON but no AgentCard: skipped, with an error logged.
    std::fs::write(
        cards.join("bogus.json"),
        json!({"name": "Bogus", "skills": "none"}).to_string(),
    )
    .unwrap();
    let gateway = start_gateway(&dir, &dir.path().join("gateway-data"), &cards);

    let record = gateway.registry("GetAgent", json!({"id": "remote"})).await["agent"].clone();
    assert_eq!(record["owner"], "local", "{record}");
    assert_eq!(record["id"], "remote");
    assert_eq!(record["card"]["name"], card["name"]);
    assert!(record.get("builtin").is_none(), "{record}");

    // The published card routes through the gateway.
    let (status, published) = gateway
        .get_json("/agents/remote/.well-known/agent-card.json")
        .await;
    assert_eq!(status, 200, "{published}");
    let interfaces = published["supportedInterfaces"].as_array().unwrap();
    assert_eq!(interfaces.len(), 1, "{published}");
    let public = format!(
        "http://localhost:{}",
        gateway.base.rsplit(':').next().unwrap()
    );
    assert_eq!(
        interfaces[0]["url"],
        format!("{public}/agents/remote/a2a"),
        "{published}"
    );
    assert_eq!(interfaces[0]["protocolBinding"], "JSONRPC");
    assert_ne!(interfaces[0]["url"], card["supportedInterfaces"][0]["url"]);

    // The gateway card lists the agent's skills as remote/<skill>.
    let (status, gateway_card) = gateway.get_json("/.well-known/agent-card.json").await;
    assert_eq!(status, 200);
    let skills: Vec<&str> = gateway_card["skills"]
        .as_array()
        .unwrap()
        .iter()
        .map(|skill| skill["id"].as_str().unwrap())
        .collect();
    let remote_skills: Vec<&Value> = card["skills"].as_array().unwrap().iter().collect();
    assert!(!remote_skills.is_empty());
    for skill in remote_skills {
        let id = format!("remote/{}", skill["id"].as_str().unwrap());
        assert!(
            skills.contains(&id.as_str()),
            "{id} missing from {skills:?}"
        );
    }

    // The invalid card was skipped, logged, and start-up went on.
    let logs = gateway.wait_for_log("bogus.json", PROCESS_WAIT);
    let line = logs
        .lines()
        .find(|line| line.contains("bogus.json"))
        .unwrap();
    assert!(line.contains("ERROR"), "{line}");
    let bogus = gateway
        .rpc("/registry", "GetAgent", json!({"id": "bogus"}))
        .await;
    assert!(bogus.get("error").is_some(), "{bogus}");
    let agents = all_agents(&gateway).await;
    assert_eq!(count_of(&agents, "bogus"), 0, "{agents:?}");
    assert_eq!(count_of(&agents, "remote"), 1, "{agents:?}");

    // And the card's agent answers through the gateway, as the default agent.
    let reply = gateway
        .call(
            "SendMessage",
            json!({"message": user_message(&message_id("tck-complete-task"), "hi")}),
        )
        .await;
    assert_eq!(
        reply["task"]["status"]["state"], "TASK_STATE_COMPLETED",
        "{reply}"
    );
}

#[tokio::test]
async fn a_card_file_that_is_not_json_is_skipped_without_stopping_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = start_upstream(&dir);
    let cards = dir.path().join("cards");
    publish_remote_card(&upstream, &cards).await;
    // Sorted before remote.json, so it is read first.
    std::fs::write(cards.join("broken.json"), "{ this is not JSON").unwrap();
    let gateway = start_gateway(&dir, &dir.path().join("gateway-data"), &cards);

    let logs = gateway.wait_for_log("broken.json", PROCESS_WAIT);
    let line = logs
        .lines()
        .find(|line| line.contains("broken.json"))
        .unwrap();
    assert!(line.contains("ERROR"), "{line}");
    let record = gateway.registry("GetAgent", json!({"id": "remote"})).await["agent"].clone();
    assert_eq!(record["owner"], "local", "{record}");
    assert_eq!(count_of(&all_agents(&gateway).await, "broken"), 0);
}

#[test]
fn validate_config_rejects_a_default_agent_nobody_provides() {
    let dir = tempfile::tempdir().unwrap();
    let cards = dir.path().join("cards");
    std::fs::create_dir_all(&cards).unwrap();
    std::fs::write(cards.join("remote.json"), "{}").unwrap();
    let cards = cards.to_str().unwrap();
    let validate = |default_agent: &str| {
        run_baton(
            [
                "serve",
                "--validate-config",
                "--listen",
                "127.0.0.1:0",
                "--agent-cards",
                cards,
                "--default-agent",
                default_agent,
            ],
            dir.path(),
            PROCESS_WAIT,
        )
    };

    let ghost = validate("ghost");
    assert_eq!(ghost.status.code(), Some(2), "{ghost:?}");
    assert!(
        ghost.stderr.contains("default-agent") && ghost.stderr.contains("\"ghost\""),
        "the problem is not named:\n{}",
        ghost.stderr
    );
    assert!(ghost.stdout.is_empty(), "{ghost:?}");

    // Built-in agents and cards in the directory are agents.
    for known in ["scenario", "echo", "remote"] {
        let run = validate(known);
        assert!(run.status.success(), "{known}: {run:?}");
    }
}
