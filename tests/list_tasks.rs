//! ListTasks over 250 tasks in several contexts and states: cursor
//! pagination with every filter and their combinations, exact totals,
//! newest-status-first order, artifacts and history shaping, and validation.

mod common;

use chrono::{DateTime, Utc};
use common::agents::GatedAgent;
use common::*;
use futures::StreamExt;
use serde_json::{Value, json};
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

const TASKS: usize = 250;
const CONTEXTS: [&str; 3] = ["ctx-alpha", "ctx-beta", "ctx-gamma"];
const STATES: [&str; 4] = [
    "TASK_STATE_COMPLETED",
    "TASK_STATE_INPUT_REQUIRED",
    "TASK_STATE_REJECTED",
    "TASK_STATE_WORKING",
];

/// A task as GetTask reports it once everything has settled.
#[derive(Clone, Debug)]
struct Truth {
    id: String,
    context_id: String,
    state: String,
    timestamp: DateTime<Utc>,
    full: Value,
}

fn parse_ts(text: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(text)
        .unwrap_or_else(|e| panic!("bad timestamp {text:?}: {e}"))
        .with_timezone(&Utc)
}

fn status_ts(task: &Value) -> DateTime<Utc> {
    parse_ts(
        task["status"]["timestamp"]
            .as_str()
            .unwrap_or_else(|| panic!("task without status timestamp: {task}")),
    )
}

/// Creates task `i`: its agent and scenario follow `i`, and so does its context.
async fn create_task(baton: &TestBaton, i: usize) -> String {
    let mut message = if i % 25 == 24 {
        user_message(&message_id("gated"), "hold")
    } else {
        let prefix = [
            "tck-complete-task",
            "tck-artifact-text",
            "tck-input-required",
            "tck-reject-task",
        ][i % 4];
        user_message(&message_id(prefix), &format!("task {i}"))
    };
    match i % 5 {
        0 | 1 => message["contextId"] = json!(CONTEXTS[0]),
        2 => message["contextId"] = json!(CONTEXTS[1]),
        3 => message["contextId"] = json!(CONTEXTS[2]),
        _ => {} // server-assigned
    }
    let reply = if i % 25 == 24 {
        baton
            .call(
                "SendMessage",
                json!({"tenant": "gated", "message": message,
                       "configuration": {"returnImmediately": true}}),
            )
            .await
    } else {
        baton.send_to_scenario(message).await
    };
    let task_id = reply.result()["task"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("send {i} made no task: {}", reply.body))
        .to_string();
    // Some paused tasks get an answer: a third of them complete, a third
    // are asked again (WORKING, then INPUT_REQUIRED anew).
    if i % 25 != 24 && i % 4 == 2 && i % 3 != 2 {
        let prefix = if i % 3 == 0 {
            "tck-complete-task"
        } else {
            "tck-input-required"
        };
        let answer = user_message_on(&task_id, &message_id(prefix), &format!("answer {i}"));
        let reply = baton.send_to_scenario(answer).await;
        assert_eq!(reply.result()["task"]["id"], task_id);
    }
    task_id
}

/// Waits until `task_id` is in `state`; returns the task.
async fn wait_state(baton: &TestBaton, task_id: &str, state: &str) -> Value {
    let start = Instant::now();
    loop {
        let task = baton
            .call("GetTask", json!({"id": task_id}))
            .await
            .result()
            .clone();
        if task["status"]["state"] == state {
            return task;
        }
        assert!(
            start.elapsed() < WAIT,
            "task {task_id} never reached {state}: {task}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What one filter selects.
#[derive(Clone, Debug, Default)]
struct Filter {
    context_id: Option<String>,
    status: Option<&'static str>,
    after: Option<String>,
}

impl Filter {
    fn params(&self) -> Value {
        let mut params = json!({});
        if let Some(c) = &self.context_id {
            params["contextId"] = json!(c);
        }
        if let Some(s) = self.status {
            params["status"] = json!(s);
        }
        if let Some(a) = &self.after {
            params["statusTimestampAfter"] = json!(a);
        }
        params
    }

    fn matches(&self, t: &Truth) -> bool {
        self.context_id.as_ref().is_none_or(|c| *c == t.context_id)
            && self.status.is_none_or(|s| s == t.state)
            && self
                .after
                .as_ref()
                .is_none_or(|a| t.timestamp >= parse_ts(a))
    }
}

/// Pages through ListTasks with `params` and checks every page's envelope;
/// returns the tasks in the order they came.
async fn list_all(
    baton: &TestBaton,
    params: &Value,
    page_size: Option<i64>,
    expected_total: usize,
) -> Vec<Value> {
    let size = page_size.unwrap_or(50) as usize;
    // A sanity bound against a cursor that never ends.
    let max_pages = 2 * expected_total / size + 5;
    let mut token = String::new();
    let mut tasks = Vec::new();
    for page in 0.. {
        assert!(
            page <= max_pages,
            "more pages than {max_pages} for {params}"
        );
        let mut request = params.clone();
        if let Some(ps) = page_size {
            request["pageSize"] = json!(ps);
        }
        if !token.is_empty() {
            request["pageToken"] = json!(token);
        }
        let reply = baton.call("ListTasks", request.clone()).await;
        let result = reply.result();
        let what = format!("ListTasks {request} page {page}");
        assert_eq!(result["pageSize"], json!(size), "{what}: pageSize echoed");
        assert_eq!(
            result["totalSize"],
            json!(expected_total),
            "{what}: totalSize"
        );
        let page_tasks = result["tasks"]
            .as_array()
            .unwrap_or_else(|| panic!("{what}: tasks missing: {result}"));
        assert!(
            page_tasks.len() <= size,
            "{what}: {} tasks",
            page_tasks.len()
        );
        let next = result["nextPageToken"]
            .as_str()
            .unwrap_or_else(|| panic!("{what}: nextPageToken missing: {result}"));
        tasks.extend(page_tasks.iter().cloned());
        if next.is_empty() {
            break;
        }
        assert!(
            !page_tasks.is_empty(),
            "{what}: empty page with a successor"
        );
        token = next.to_string();
    }
    tasks
}

/// Checks a listing against the expected set: no duplicates, same ids,
/// newest status first, and each task as GetTask reports it.
fn check_listing(what: &str, listed: &[Value], expected: &[&Truth]) {
    let ids: Vec<&str> = listed.iter().map(|t| t["id"].as_str().unwrap()).collect();
    let unique: HashSet<&str> = ids.iter().copied().collect();
    let mut seen = HashSet::new();
    let repeated: Vec<&str> = ids.iter().copied().filter(|id| !seen.insert(*id)).collect();
    assert!(
        repeated.is_empty(),
        "{what}: {} of {} listed tasks are repeats, e.g. {:?}",
        repeated.len(),
        ids.len(),
        listed
            .iter()
            .filter(|t| t["id"] == repeated[0])
            .map(|t| &t["status"])
            .collect::<Vec<_>>()
    );
    let want: HashSet<&str> = expected.iter().map(|t| t.id.as_str()).collect();
    assert_eq!(
        unique,
        want,
        "{what}: listed {} tasks, expected {}",
        unique.len(),
        want.len()
    );
    for pair in listed.windows(2) {
        assert!(
            status_ts(&pair[0]) >= status_ts(&pair[1]),
            "{what}: not newest first: {} ({}) before {} ({})",
            pair[0]["id"],
            pair[0]["status"]["timestamp"],
            pair[1]["id"],
            pair[1]["status"]["timestamp"],
        );
    }
    let truth: HashMap<&str, &&Truth> = expected.iter().map(|t| (t.id.as_str(), t)).collect();
    for task in listed {
        let t = truth[task["id"].as_str().unwrap()];
        assert_eq!(task["contextId"], t.context_id, "{what}");
        assert_eq!(task["status"], t.full["status"], "{what}");
    }
}

#[tokio::test]
async fn list_tasks_paginates_250_tasks_with_every_filter() {
    let gated = GatedAgent::new();
    let baton = baton().agent("gated", gated.clone()).start().await;

    let ids: Vec<String> = futures::stream::iter(0..TASKS)
        .map(|i| {
            let baton = &baton;
            async move { create_task(baton, i).await }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), TASKS);

    // Ground truth, once the gated tasks are WORKING and nothing moves.
    let mut truths = Vec::with_capacity(TASKS);
    for id in &ids {
        let task = baton
            .call("GetTask", json!({"id": id}))
            .await
            .result()
            .clone();
        let task = if task["status"]["state"] == "TASK_STATE_WORKING"
            || task["status"]["state"] == "TASK_STATE_SUBMITTED"
        {
            wait_state(&baton, id, "TASK_STATE_WORKING").await
        } else {
            task
        };
        truths.push(Truth {
            id: id.clone(),
            context_id: task["contextId"].as_str().unwrap().to_string(),
            state: task["status"]["state"].as_str().unwrap().to_string(),
            timestamp: status_ts(&task),
            full: task,
        });
    }
    for state in STATES {
        assert!(
            truths.iter().any(|t| t.state == state),
            "no task ended {state}"
        );
    }
    assert!(truths.iter().any(|t| {
        t.full["artifacts"]
            .as_array()
            .is_some_and(|a| !a.is_empty())
    }));

    let mut by_time: Vec<&Truth> = truths.iter().collect();
    by_time.sort_by_key(|t| std::cmp::Reverse(t.timestamp));
    let cutoff = by_time[100].full["status"]["timestamp"]
        .as_str()
        .unwrap()
        .to_string();
    let lone_context = truths
        .iter()
        .find(|t| !CONTEXTS.contains(&t.context_id.as_str()))
        .unwrap()
        .context_id
        .clone();

    let ctx = |c: &str| Some(c.to_string());
    let mut filters = vec![Filter::default()];
    for c in CONTEXTS {
        filters.push(Filter {
            context_id: ctx(c),
            ..Filter::default()
        });
    }
    for s in STATES {
        filters.push(Filter {
            status: Some(s),
            ..Filter::default()
        });
    }
    filters.extend([
        Filter {
            after: Some(cutoff.clone()),
            ..Filter::default()
        },
        Filter {
            context_id: ctx("ctx-alpha"),
            status: Some("TASK_STATE_COMPLETED"),
            after: None,
        },
        Filter {
            context_id: ctx("ctx-beta"),
            status: None,
            after: Some(cutoff.clone()),
        },
        Filter {
            context_id: None,
            status: Some("TASK_STATE_INPUT_REQUIRED"),
            after: Some(cutoff.clone()),
        },
        Filter {
            context_id: ctx("ctx-gamma"),
            status: Some("TASK_STATE_REJECTED"),
            after: Some(cutoff.clone()),
        },
        Filter {
            context_id: ctx("ctx-alpha"),
            status: Some("TASK_STATE_WORKING"),
            after: None,
        },
        Filter {
            context_id: Some(lone_context),
            ..Filter::default()
        },
        Filter {
            context_id: ctx("ctx-nobody-used"),
            ..Filter::default()
        },
        Filter {
            status: Some("TASK_STATE_CANCELED"),
            ..Filter::default()
        },
        Filter {
            after: Some("2000-01-01T00:00:00Z".into()),
            ..Filter::default()
        },
        Filter {
            after: Some("2999-01-01T00:00:00Z".into()),
            ..Filter::default()
        },
    ]);

    for filter in &filters {
        let expected: Vec<&Truth> = truths.iter().filter(|t| filter.matches(t)).collect();
        for page_size in [Some(7), Some(50), Some(100), None] {
            let params = filter.params();
            let listed = list_all(&baton, &params, page_size, expected.len()).await;
            let what = format!("ListTasks {params} pageSize {page_size:?}");
            check_listing(&what, &listed, &expected);
            for task in &listed {
                assert!(
                    task.get("artifacts").is_none(),
                    "{what}: artifacts without includeArtifacts: {task}"
                );
                let t = truths.iter().find(|t| t.id == task["id"]).unwrap();
                assert_eq!(task.get("history"), t.full.get("history"), "{what}");
            }
        }
    }

    // includeArtifacts: true brings each task's artifacts; false leaves them out.
    let all: Vec<&Truth> = truths.iter().collect();
    let listed = list_all(&baton, &json!({"includeArtifacts": true}), Some(100), TASKS).await;
    check_listing("includeArtifacts true", &listed, &all);
    for task in &listed {
        let t = truths.iter().find(|t| t.id == task["id"]).unwrap();
        match t.full.get("artifacts") {
            Some(artifacts) => assert_eq!(&task["artifacts"], artifacts),
            None => assert!(task.get("artifacts").is_none_or(|a| a == &json!([]))),
        }
    }
    let listed = list_all(
        &baton,
        &json!({"includeArtifacts": false}),
        Some(100),
        TASKS,
    )
    .await;
    assert!(listed.iter().all(|t| t.get("artifacts").is_none()));

    // historyLength: 0 leaves out the history; 1 keeps the newest message.
    let listed = list_all(&baton, &json!({"historyLength": 0}), Some(100), TASKS).await;
    for task in &listed {
        assert!(task.get("history").is_none(), "historyLength 0: {task}");
    }
    let listed = list_all(&baton, &json!({"historyLength": 1}), Some(50), TASKS).await;
    for task in &listed {
        let t = truths.iter().find(|t| t.id == task["id"]).unwrap();
        let full = t.full["history"].as_array().unwrap();
        assert_eq!(task["history"], json!([full.last().unwrap()]), "{task}");
    }
    baton.stop().await;
}

#[tokio::test]
async fn list_tasks_rejects_bad_paging_and_filters() {
    let baton = baton().start().await;
    baton.send_text(&message_id("m"), "one", json!({})).await;
    let bad = [
        json!({"pageSize": 0}),
        json!({"pageSize": 101}),
        json!({"pageSize": -1}),
        json!({"pageToken": "garbage"}),
        json!({"pageToken": "%%% not a token %%%"}),
        json!({"pageToken": "this-is-not-a-page-token"}),
        json!({"historyLength": -1}),
        json!({"statusTimestampAfter": "yesterday"}),
    ];
    for params in bad {
        let reply = baton.call("ListTasks", params.clone()).await;
        assert_eq!(
            reply.code(),
            Some(-32602),
            "ListTasks {params}: {}",
            reply.body
        );
    }
    // Every field that fails to decode is named at once; when all decode,
    // every field that fails validation.
    for (params, fields) in [
        (
            json!({"pageSize": "ten", "contextId": "c", "status": "DONE", "statusTimestampAfter": "yesterday"}),
            ["pageSize", "status", "statusTimestampAfter"],
        ),
        (
            json!({"pageSize": 0, "historyLength": -1, "pageToken": "garbage"}),
            ["pageSize", "historyLength", "pageToken"],
        ),
    ] {
        let reply = baton.call("ListTasks", params.clone()).await;
        assert_eq!(reply.code(), Some(-32602), "{params}: {}", reply.body);
        let named: Vec<&str> = reply.body["error"]["data"][0]["fieldViolations"]
            .as_array()
            .expect("fieldViolations")
            .iter()
            .map(|violation| violation["field"].as_str().expect("field"))
            .collect();
        assert_eq!(named, fields, "{params}: {}", reply.body);
    }
    // The edges of the range are fine.
    for size in [1, 100] {
        let reply = baton.call("ListTasks", json!({"pageSize": size})).await;
        assert_eq!(reply.result()["pageSize"], size);
        assert_eq!(reply.result()["totalSize"], 1);
    }
    baton.stop().await;
}

#[tokio::test]
async fn list_tasks_follows_status_changes() {
    let gated = GatedAgent::new();
    let baton = baton().agent("gated", gated.clone()).start().await;
    let mut working = Vec::new();
    for _ in 0..3 {
        let reply = baton
            .call(
                "SendMessage",
                json!({"tenant": "gated", "message": user_message(&message_id("m"), "hold"),
                       "configuration": {"returnImmediately": true}}),
            )
            .await;
        let id = reply.result()["task"]["id"].as_str().unwrap().to_string();
        wait_state(&baton, &id, "TASK_STATE_WORKING").await;
        working.push(id);
    }
    let reply = baton
        .send_to_scenario(user_message(&message_id("tck-input-required"), "ask"))
        .await;
    let paused = reply.result()["task"]["id"].as_str().unwrap().to_string();

    // The oldest WORKING task is told more; the agent reports WORKING again,
    // with a newer status time.
    let before = wait_state(&baton, &working[0], "TASK_STATE_WORKING").await;
    let more = user_message_on(&working[0], &message_id("m"), "more");
    baton
        .call(
            "SendMessage",
            json!({"message": more, "configuration": {"returnImmediately": true}}),
        )
        .await
        .result();
    let start = Instant::now();
    loop {
        let now = wait_state(&baton, &working[0], "TASK_STATE_WORKING").await;
        if now["status"]["timestamp"] != before["status"]["timestamp"] {
            break;
        }
        assert!(
            start.elapsed() < WAIT,
            "the follow-up never reached the agent"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let reply = baton
        .call("ListTasks", json!({"status": "TASK_STATE_WORKING"}))
        .await;
    let result = reply.result();
    let listed: Vec<&str> = result["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        listed,
        [&working[0], &working[2], &working[1]],
        "each WORKING task once, the re-announced one first"
    );
    assert_eq!(
        result["totalSize"], 3,
        "totalSize counts each WORKING task once: {result}"
    );

    // The paused task completes: it moves to the front and between states.
    let answer = user_message_on(&paused, &message_id("tck-complete-task"), "answer");
    baton.send_to_scenario(answer).await.result();
    let all = baton.call("ListTasks", json!({})).await;
    assert_eq!(all.result()["tasks"][0]["id"], paused);
    assert_eq!(all.result()["totalSize"], 4);
    assert_eq!(
        all.result()["tasks"].as_array().unwrap().len(),
        4,
        "{}",
        all.body
    );
    let paused_list = baton
        .call("ListTasks", json!({"status": "TASK_STATE_INPUT_REQUIRED"}))
        .await;
    assert_eq!(
        paused_list.result()["tasks"],
        json!([]),
        "a COMPLETED task is listed as INPUT_REQUIRED"
    );
    assert_eq!(paused_list.result()["totalSize"], 0, "{}", paused_list.body);
    let done = baton
        .call("ListTasks", json!({"status": "TASK_STATE_COMPLETED"}))
        .await;
    assert_eq!(done.result()["totalSize"], 1);
    assert_eq!(done.result()["tasks"][0]["id"], paused);
    baton.stop().await;
}

/// A context Baton mints for a new task is found by ListTasks from its id
/// (that first task has no by-context entry), merged with the tasks that
/// joined the context later; a client's own context of the same shape is
/// indexed like any other.
#[tokio::test]
async fn a_minted_context_lists_its_first_task_with_those_that_joined() {
    let baton = baton().start().await;
    let send = |message: Value| {
        let baton = &baton;
        async move {
            let reply = baton.send_to_scenario(message).await;
            let task = reply.result()["task"].clone();
            (
                task["id"].as_str().unwrap().to_string(),
                task["contextId"].as_str().unwrap().to_string(),
            )
        }
    };
    let (first, context) = send(user_message(&message_id("tck-complete-task"), "one")).await;
    assert_ne!(first, context);
    let mut joining = user_message(&message_id("tck-complete-task"), "two");
    joining["contextId"] = json!(context);
    let (second, second_context) = send(joining).await;
    assert_eq!(second_context, context);

    let list = |params: Value| {
        let baton = &baton;
        async move { baton.call("ListTasks", params).await.result().clone() }
    };
    let ids = |page: &Value| -> Vec<String> {
        page["tasks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["id"].as_str().unwrap().to_string())
            .collect()
    };
    let whole = list(json!({"contextId": context})).await;
    assert_eq!(ids(&whole), [second.as_str(), first.as_str()], "{whole}");
    assert_eq!(whole["totalSize"], 2);
    let completed = list(json!({"contextId": context, "status": "TASK_STATE_COMPLETED"})).await;
    assert_eq!(ids(&completed), [second.as_str(), first.as_str()]);
    assert_eq!(completed["totalSize"], 2);

    let page = list(json!({"contextId": context, "pageSize": 1})).await;
    assert_eq!(ids(&page), [second.as_str()]);
    let token = page["nextPageToken"].as_str().unwrap().to_string();
    let page = list(json!({"contextId": context, "pageSize": 1, "pageToken": token})).await;
    assert_eq!(ids(&page), [first.as_str()]);
    assert_eq!(
        page.get("nextPageToken")
            .and_then(Value::as_str)
            .unwrap_or(""),
        ""
    );

    // The same shape, minted from a task id that does not exist.
    let mut foreign = uuid::Uuid::now_v7().into_bytes();
    foreign[6] = (foreign[6] & 0x0f) | 0x80;
    let foreign = uuid::Uuid::from_bytes(foreign).to_string();
    let mut own = user_message(&message_id("tck-complete-task"), "three");
    own["contextId"] = json!(foreign);
    let (third, _) = send(own).await;
    let listed = list(json!({"contextId": foreign})).await;
    assert_eq!(ids(&listed), [third]);
    assert_eq!(listed["totalSize"], 1);
}
