//! Handoffs between agents of other vendors, over real HTTP (DESIGN.md
//! §3.3, §3.4): direct handoffs with typed artifacts, transfers that keep
//! one gateway task, results returned to the source, the acknowledgement
//! ladder, deadlines, allow lists and skill output schemas. Every upstream
//! is a [`VendorAgent`]: a plain A2A agent with no Baton logic of its own.

mod common;

use baton::demo::vendor::{Reply, VendorAgent};
use baton::gateway::GatewaySettings;
use baton::handoff::payload::{HANDOFF_MEDIA_TYPE, HANDOFF_RESULT_MEDIA_TYPE};
use baton::protocol::{Part, PartContent, TaskState};
use baton::store::TaskLimit;
use common::*;
use serde_json::{Value, json};
use std::time::Duration;

/// Registers a vendor agent at `gateway` under `id`, with `extra` params
/// (`allowFrom`, `skillOutputSchemas`, ...).
async fn register(gateway: &TestBaton, id: &str, agent: &VendorAgent, extra: Value) {
    let mut params = json!({"id": id, "card": agent.card()});
    merge(&mut params, extra);
    let reply = gateway.registry("RegisterAgent", params).await;
    assert!(reply.code().is_none(), "register {id}: {}", reply.body);
}

/// Registers `triage` and `billing`, a vendor agent that refunds; returns
/// `billing`.
async fn register_with_billing(gateway: &TestBaton, triage: &VendorAgent) -> VendorAgent {
    let billing = VendorAgent::start("billing", &["refund"], |_| refund())
        .await
        .unwrap();
    register(gateway, "triage", triage, json!({})).await;
    register(gateway, "billing", &billing, json!({})).await;
    billing
}

/// Billing, asking which charge on a new task and refunding on the answer.
async fn billing_asking_first() -> VendorAgent {
    VendorAgent::start("billing", &["refund"], |turn| match turn.task_id {
        None => Reply::AskInput("Which charge?".into()),
        Some(_) => refund(),
    })
    .await
    .unwrap()
}

/// A vendor agent `id` declaring `skills` that hands every task on to
/// `target` (`{"to": ..}` or `{"toSkill": ..}`) for good.
async fn handing_on(id: &str, skills: &[&str], target: Value) -> VendorAgent {
    let from = id.to_string();
    VendorAgent::start(id, skills, move |_| Reply::Handoff {
        payload: handoff_payload(&from, target.clone(), json!({})),
        state: TaskState::Completed,
    })
    .await
    .unwrap()
}

/// Sends `message` to triage without waiting for the task to end; returns
/// the task's id once `holder` has been sent the work (or after 2 s).
async fn start_at_triage(gateway: &TestBaton, message: Value, holder: &VendorAgent) -> String {
    start_at_triage_until(gateway, message, |_| sends_to(holder) > 0).await
}

/// [`start_at_triage`], returning once `ready` holds for the task's
/// record (or after 2 s).
async fn start_at_triage_until(
    gateway: &TestBaton,
    message: Value,
    ready: impl Fn(&baton::store::TaskRecord) -> bool,
) -> String {
    let params = json!({"message": message, "configuration": {"returnImmediately": true}});
    let reply = gateway
        .call_at("/agents/triage/a2a", "SendMessage", params)
        .await;
    let id = reply.result()["task"]["id"].as_str().unwrap().to_string();
    for _ in 0..100 {
        if gateway.ledger.get(&id).unwrap().is_some_and(|r| ready(&r)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    id
}

/// Cancels the task, and checks that the answer is the task CANCELED.
async fn cancel_answers_canceled(gateway: &TestBaton, id: &str) {
    let canceled = gateway.call("CancelTask", json!({"id": id})).await;
    assert_eq!(
        canceled.result()["status"]["state"],
        "TASK_STATE_CANCELED",
        "{}",
        canceled.body
    );
}

/// Triage's handoff of its task to `target` (`{"to": ..}` or
/// `{"toSkill": ..}`) for the result, its own task left in `state`.
fn triage_hands_off_for_result(target: Value, state: TaskState) -> Reply {
    Reply::Handoff {
        payload: handoff_payload("triage", target, json!({"returnToParent": true})),
        state,
    }
}

/// A triage script that hands a new task off to `target` for its result,
/// leaving its own task `state`, and closes the case (an artifact "case")
/// once the result comes back.
fn triage_closing_the_case(
    target: Value,
    state: TaskState,
) -> impl Fn(&baton::demo::vendor::Turn) -> Reply + Send + Sync + 'static {
    move |turn| {
        if data_of(&turn.message.parts, HANDOFF_RESULT_MEDIA_TYPE).is_some() {
            return Reply::artifact("case", json!({"closed": true}));
        }
        triage_hands_off_for_result(target.clone(), state)
    }
}

/// Every reason code in the task's history, in order.
fn reasons_in_history(task: &Value) -> Vec<String> {
    task["history"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| reason_of(m).to_string())
        .filter(|r| !r.is_empty())
        .collect()
}

fn refund_schema() -> Value {
    json!({
        "type": "object",
        "required": ["refundId", "amount", "currency"],
        "properties": {
            "refundId": {"type": "string"},
            "amount": {"type": "number"},
            "currency": {"type": "string"}
        }
    })
}

fn refund() -> Reply {
    Reply::artifact(
        "refund",
        json!({"refundId": "rf_1", "amount": 42.0, "currency": "EUR"}),
    )
}

fn data_of<'a>(parts: &'a [Part], media_type: &str) -> Option<&'a Value> {
    parts.iter().find_map(|p| match &p.content {
        PartContent::Data(data) if p.media_type == media_type => Some(data),
        _ => None,
    })
}

/// The task FAILED `OUTPUT_SCHEMA_INVALID`, with a violation at `pointer`.
fn assert_failed_the_schema_at(task: &Value, pointer: &str) {
    assert_eq!(task["status"]["state"], "TASK_STATE_FAILED", "{task}");
    assert_eq!(reason(task), "OUTPUT_SCHEMA_INVALID");
    let violations = &task["status"]["message"]["parts"][0]["data"]["detail"]["violations"];
    assert!(violations.to_string().contains(pointer), "{violations}");
}

/// Sends `message` to `path`, then waits for the task to reach `state`.
async fn send_until(gateway: &TestBaton, path: &str, message: Value, state: &str) -> Value {
    let task = send(gateway, path, message).await;
    let task_id = task["id"].as_str().unwrap();
    gateway.wait_for_state("/a2a", task_id, state).await
}

/// The last reason in the task's history is OUTPUT_SCHEMA_INVALID.
fn assert_ended_with_output_schema_invalid(task: &Value) {
    assert_eq!(
        reasons_in_history(task).last().map(String::as_str),
        Some("OUTPUT_SCHEMA_INVALID"),
        "{task}"
    );
}

/// Sends `message` to `path` and waits for the task to settle.
async fn send(gateway: &TestBaton, path: &str, message: Value) -> Value {
    let reply = gateway
        .call_at(path, "SendMessage", json!({"message": message}))
        .await;
    assert!(reply.code().is_none(), "send: {}", reply.body);
    reply.result()["task"].clone()
}

/// A new user message to triage's endpoint (`message_id(prefix)`); the task
/// as the blocking send answers.
async fn send_to_triage(gateway: &TestBaton, prefix: &str, text: &str) -> Value {
    let message = user_message(&message_id(prefix), text);
    send(gateway, "/agents/triage/a2a", message).await
}

async fn get_task(gateway: &TestBaton, id: &str) -> Value {
    gateway
        .call("GetTask", json!({"id": id}))
        .await
        .result()
        .clone()
}

#[tokio::test]
async fn a_direct_handoff_completes_with_a_typed_artifact_or_fails_the_schema() {
    let gateway = baton().start().await;
    let billing = VendorAgent::start("billing", &["refund"], |turn| {
        if turn.message.text().contains("bad") {
            Reply::artifact("refund", json!({"refundId": 7}))
        } else {
            refund()
        }
    })
    .await
    .unwrap();
    register(&gateway, "billing", &billing, json!({})).await;

    let extra = json!({"returnSchema": refund_schema()});
    let task = send(
        &gateway,
        "/a2a",
        handoff_message(handoff_payload(
            "triage",
            json!({"to": "billing"}),
            extra.clone(),
        )),
    )
    .await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(task["artifacts"][0]["name"], "refund");
    assert_eq!(task["artifacts"][0]["parts"][0]["data"]["currency"], "EUR");
    let control = &task["metadata"]["urn:baton:handoff:v1"];
    assert_eq!(control["chain"], json!(["billing"]));

    // The same handoff whose result breaks the schema fails with the violations.
    let mut message = handoff_message(handoff_payload("triage", json!({"to": "billing"}), extra));
    message["parts"]
        .as_array_mut()
        .unwrap()
        .push(json!({"text": "bad"}));
    let task = send(&gateway, "/a2a", message).await;
    assert_failed_the_schema_at(&task, "/artifacts/0/parts/0/data");
    billing.stop().await;
    gateway.stop().await;
}

/// A handoff's returnSchema binds the task's result also when its target
/// hands the task on for good, on top of any schema of that transfer's own.
#[tokio::test]
async fn a_handoff_schema_binds_the_agent_its_target_handed_on_to() {
    let gateway = baton().start().await;
    let calls = std::sync::atomic::AtomicUsize::new(0);
    // The first refund is valid, the next breaks the refund schema only.
    let billing = VendorAgent::start("billing", &["refund"], move |_| {
        match calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 => refund(),
            _ => Reply::artifact("refund", json!({"refundId": 7})),
        }
    })
    .await
    .unwrap();
    let lenient = json!({"returnSchema": {"type": "object"}});
    let triage = VendorAgent::start("triage", &["triage"], move |_| Reply::Handoff {
        payload: handoff_payload("triage", json!({"to": "billing"}), lenient.clone()),
        state: TaskState::Completed,
    })
    .await
    .unwrap();
    register(&gateway, "triage", &triage, json!({})).await;
    register(&gateway, "billing", &billing, json!({})).await;
    let to_triage = || {
        let extra = json!({"returnSchema": refund_schema()});
        handoff_message(handoff_payload("caller", json!({"to": "triage"}), extra))
    };

    let task = send(&gateway, "/a2a", to_triage()).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(artifact_names(&task), ["refund"]);

    let task = send(&gateway, "/a2a", to_triage()).await;
    assert_failed_the_schema_at(&task, "/artifacts/0/parts/0/data");
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// A target that writes into an artifact its source made (the same
/// artifact id, merged in place) made it its own: it is checked against
/// the handoff's returnSchema, and counts as the typed result.
#[tokio::test]
async fn an_artifact_the_target_wrote_into_is_checked_as_its_own() {
    use baton::protocol::Artifact;
    let gateway = baton().start().await;
    let data_artifact = |id: &str, data: Value| Artifact {
        artifact_id: id.into(),
        parts: vec![Part::data(data)],
        ..Artifact::default()
    };
    // Triage makes its `result`, and hands the task on in another artifact.
    let payload = handoff_payload(
        "triage",
        json!({"to": "billing"}),
        json!({"returnSchema": refund_schema()}),
    );
    let mut handoff = Part::data(payload);
    handoff.media_type = HANDOFF_MEDIA_TYPE.into();
    let triage = VendorAgent::start("triage", &["triage"], move |_| Reply::Complete {
        text: None,
        artifacts: vec![
            data_artifact("result", json!({"triaged": true})),
            Artifact {
                artifact_id: "handoff".into(),
                parts: vec![handoff.clone()],
                ..Artifact::default()
            },
        ],
    })
    .await
    .unwrap();
    // Billing answers in `result` too: first a valid refund alone, then an
    // invalid one beside a valid receipt of its own.
    let calls = std::sync::atomic::AtomicUsize::new(0);
    let valid = json!({"refundId": "rf_1", "amount": 42.0, "currency": "EUR"});
    let billing = VendorAgent::start("billing", &["refund"], move |_| {
        let artifacts = match calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 => vec![data_artifact("result", valid.clone())],
            _ => vec![
                data_artifact("result", json!({"refundId": 7})),
                data_artifact("receipt", valid.clone()),
            ],
        };
        Reply::Complete {
            text: None,
            artifacts,
        }
    })
    .await
    .unwrap();
    register(&gateway, "triage", &triage, json!({})).await;
    register(&gateway, "billing", &billing, json!({})).await;

    let task = send_to_triage(&gateway, "t", "refund please").await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(task["artifacts"][0]["parts"][0]["data"]["refundId"], "rf_1");

    let task = send_to_triage(&gateway, "t", "refund please").await;
    assert_failed_the_schema_at(&task, "/artifacts/0/parts/0/data");
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn a_transfer_keeps_one_task_and_follow_ups_reach_the_new_agent() {
    let gateway = baton().start().await;
    let triage = VendorAgent::start("triage", &["triage"], |_| Reply::Handoff {
        payload: handoff_payload(
            "triage",
            json!({"to": "billing"}),
            json!({"returnSchema": refund_schema(), "context": {"policy": "SUMMARY"}}),
        ),
        state: TaskState::Completed,
    })
    .await
    .unwrap();
    // Billing asks which card to refund, then refunds.
    let billing = VendorAgent::start("billing", &["refund"], |turn| {
        if turn.task_id.is_none() {
            Reply::AskInput("Which card should get the refund?".into())
        } else {
            refund()
        }
    })
    .await
    .unwrap();
    register(&gateway, "triage", &triage, json!({})).await;
    register(&gateway, "billing", &billing, json!({})).await;

    let task = send_to_triage(&gateway, "t", "I was charged twice, please refund").await;
    let task_id = task["id"].as_str().unwrap().to_string();
    // The question of the new agent is relayed on the caller's one task.
    assert_eq!(
        task["status"]["state"], "TASK_STATE_INPUT_REQUIRED",
        "{task}"
    );
    assert!(
        task["status"]["message"]["parts"][0]["text"]
            .as_str()
            .unwrap()
            .contains("Which card")
    );
    let control = &task["metadata"]["urn:baton:handoff:v1"];
    assert_eq!(control["chain"], json!(["triage", "billing"]));
    assert_eq!(control["hops"], 2);

    // Billing got the SUMMARY context: goal and summary as text, the cut payload.
    let first = billing.sends().into_iter().next().unwrap();
    let parts = &first.params["message"]["parts"];
    assert!(
        parts[0]["text"]
            .as_str()
            .unwrap()
            .starts_with("Refund the duplicate")
    );
    assert_eq!(parts[1]["data"]["keyFacts"]["invoice"], "INV-0342");
    assert_eq!(first.headers["baton-chain"], "triage,billing");

    // The answer, on the same task and endpoint, goes to billing's own task.
    let answer = user_message_on(&task_id, &message_id("a"), "the Visa ending 4242");
    let task = send(&gateway, "/agents/triage/a2a", answer).await;
    assert_eq!(task["id"], task_id.as_str());
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(task["artifacts"][0]["name"], "refund");
    let sends = billing.sends();
    assert_eq!(sends.len(), 2);
    let billing_task = sends[1].params["message"]["taskId"].as_str().unwrap();
    assert!(
        billing.task(billing_task).is_some(),
        "answer continued billing's task"
    );
    assert_eq!(triage.sends().len(), 1);

    let record = gateway.ledger.get(&task_id).unwrap().unwrap();
    let hops: Vec<_> = record.hops.iter().map(|h| h.agent.as_str()).collect();
    assert_eq!(hops, ["triage", "billing"]);
    assert!(record.hops[1].message_bytes.unwrap() > 0);
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn return_to_parent_delivers_the_result_and_the_source_finishes() {
    let gateway = baton().start().await;
    let triage = VendorAgent::start("triage", &["triage"], |turn| {
        if turn.task_id.is_none() {
            return Reply::Handoff {
                payload: handoff_payload(
                    "triage",
                    json!({"toSkill": "refund"}),
                    json!({"returnToParent": true, "returnSchema": refund_schema()}),
                ),
                state: TaskState::InputRequired,
            };
        }
        // The result came back: the source closes the case with its own artifact.
        let result = data_of(&turn.message.parts, HANDOFF_RESULT_MEDIA_TYPE).cloned();
        match result {
            Some(result) if result["from"] == "billing" => Reply::artifact(
                "case",
                json!({"closed": true, "refundId": result["artifacts"][0]["parts"][0]["data"]["refundId"]}),
            ),
            _ => Reply::Fail("no handoff result".into()),
        }
    })
    .await
    .unwrap();
    // billing's own taskTimeout bounds its work, not what triage does after.
    let billing = VendorAgent::start("billing", &["refund"], |_| refund())
        .await
        .unwrap();
    register(&gateway, "triage", &triage, json!({})).await;
    register(
        &gateway,
        "billing",
        &billing,
        json!({"taskTimeoutMs": 2000}),
    )
    .await;

    let task = send_to_triage(&gateway, "r", "refund please").await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    let deadline = |task: &Value| {
        let control = &task["metadata"]["urn:baton:handoff:v1"];
        let at = control["deadline"].as_str().unwrap_or_default().to_string();
        chrono::DateTime::parse_from_rfc3339(&at).unwrap_or_else(|_| panic!("{task}"))
    };
    let ended = chrono::DateTime::parse_from_rfc3339(task["status"]["timestamp"].as_str().unwrap())
        .unwrap();
    assert!(
        deadline(&task) - ended > chrono::Duration::seconds(20),
        "the task's deadline is triage's again: {task}"
    );
    let names = artifact_names(&task);
    assert_eq!(names, ["refund", "case"]);
    assert_eq!(task["artifacts"][1]["parts"][0]["data"]["refundId"], "rf_1");

    // The result went to triage's own task, which waited for input.
    let sends = triage.sends();
    assert_eq!(sends.len(), 2);
    let returned = &sends[1].params["message"];
    assert!(returned["taskId"].as_str().is_some_and(|t| !t.is_empty()));
    let record = gateway
        .ledger
        .get(task["id"].as_str().unwrap())
        .unwrap()
        .unwrap();
    let hops: Vec<_> = record
        .hops
        .iter()
        .map(|h| format!("{}:{:?}", h.agent, h.kind))
        .collect();
    assert_eq!(hops, ["triage:Call", "billing:Transfer", "triage:Return"]);
    let returned_types: Vec<_> = returned["parts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["mediaType"].as_str().unwrap_or(""))
        .collect();
    assert!(
        !returned_types.contains(&HANDOFF_MEDIA_TYPE),
        "the return leg carries the result, not a new handoff"
    );
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// A source agent that hands every new task to `to` for its result, and
/// closes it with an artifact `name` once the result came back.
async fn source_awaiting_result(
    id: &'static str,
    to: &'static str,
    name: &'static str,
) -> VendorAgent {
    source_awaiting_typed_result(id, to, name, None).await
}

/// [`source_awaiting_result`], its handoff with `return_schema`.
async fn source_awaiting_typed_result(
    id: &'static str,
    to: &'static str,
    name: &'static str,
    return_schema: Option<Value>,
) -> VendorAgent {
    let mut options = json!({"returnToParent": true});
    if let Some(schema) = return_schema {
        options["returnSchema"] = schema;
    }
    VendorAgent::start(id, &[id], move |turn| {
        if turn.task_id.is_none() {
            return Reply::Handoff {
                payload: handoff_payload(id, json!({"to": to}), options.clone()),
                state: TaskState::InputRequired,
            };
        }
        match data_of(&turn.message.parts, HANDOFF_RESULT_MEDIA_TYPE) {
            Some(result) => {
                let got: Vec<_> = result["artifacts"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|a| a["name"].clone())
                    .collect();
                Reply::artifact(name, json!({"from": result["from"], "got": got}))
            }
            None => Reply::Fail("no handoff result".into()),
        }
    })
    .await
    .unwrap()
}

#[tokio::test]
async fn a_result_returns_through_every_source_that_waits_for_it() {
    let gateway = baton().start().await;
    // triage hands to manager, which hands to billing; both wait.
    let triage = source_awaiting_result("triage", "manager", "case").await;
    let manager = source_awaiting_result("manager", "billing", "approval").await;
    let billing = register_with_billing(&gateway, &triage).await;
    register(&gateway, "manager", &manager, json!({})).await;

    let task = send_to_triage(&gateway, "n", "refund please").await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    let names = artifact_names(&task);
    assert_eq!(names, ["refund", "approval", "case"]);
    // Each source got the result of the agent it handed to, with all that
    // was made after it handed on.
    assert_eq!(task["artifacts"][1]["parts"][0]["data"]["from"], "billing");
    assert_eq!(
        task["artifacts"][2]["parts"][0]["data"],
        json!({"from": "manager", "got": ["refund", "approval"]})
    );
    let record = gateway
        .ledger
        .get(task["id"].as_str().unwrap())
        .unwrap()
        .unwrap();
    let hops: Vec<_> = record
        .hops
        .iter()
        .map(|h| format!("{}:{:?}", h.agent, h.kind))
        .collect();
    assert_eq!(
        hops,
        [
            "triage:Call",
            "manager:Transfer",
            "billing:Transfer",
            "manager:Return",
            "triage:Return"
        ]
    );
    for agent in [triage, manager, billing] {
        agent.stop().await;
    }
    gateway.stop().await;
}

/// triage hands a new task to reporter for its result (with
/// `return_schema`); reporter notes something and hands the work on to
/// billing for good. Returns the gateway, triage, billing and the task id.
async fn hand_on_past_reporter(
    return_schema: Option<Value>,
) -> (TestBaton, VendorAgent, VendorAgent, String) {
    let card = common::agents::card("reporter");
    let reporter = ReportThenTransfer {
        card,
        to: "billing",
    };
    let gateway = baton().agent("reporter", reporter).start().await;
    let triage = source_awaiting_typed_result("triage", "reporter", "case", return_schema).await;
    let billing = register_with_billing(&gateway, &triage).await;
    let task = send_to_triage(&gateway, "w", "refund please").await;
    let task_id = task["id"].as_str().unwrap().to_string();
    (gateway, triage, billing, task_id)
}

#[tokio::test]
async fn a_result_handed_on_without_a_return_still_reaches_the_waiting_source() {
    let (gateway, triage, billing, task_id) = hand_on_past_reporter(None).await;
    let task = gateway
        .wait_for_state("/a2a", &task_id, "TASK_STATE_COMPLETED")
        .await;
    let case = task["artifacts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|a| a["name"] == "case")
        .unwrap_or_else(|| panic!("no case artifact: {task}"));
    assert_eq!(
        case["parts"][0]["data"],
        json!({"from": "billing", "got": ["notes", "refund"]})
    );
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn a_result_handed_on_is_checked_against_the_waiting_source_schema() {
    // triage asks for an approval; billing's refund is none.
    let approval = json!({"type": "object", "required": ["approved"]});
    let (gateway, triage, billing, task_id) = hand_on_past_reporter(Some(approval)).await;
    let task = gateway
        .wait_for_state("/a2a", &task_id, "TASK_STATE_FAILED")
        .await;
    assert_ended_with_output_schema_invalid(&task);
    // triage's own task, paused for the result, ends with it.
    assert_its_task_was_canceled(&triage).await;
    assert_eq!(sends_to(&triage), 1, "no result went back");
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn a_handoff_schema_still_binds_its_target_after_a_result_returned_to_it() {
    // The caller hands the task to triage for a closed case; triage asks
    // billing for a refund and closes the case with its own artifact.
    let gateway = baton().start().await;
    let triage = source_awaiting_result("triage", "billing", "case").await;
    let billing = register_with_billing(&gateway, &triage).await;
    let closed_case = json!({"type": "object", "required": ["closed"]});
    let payload = handoff_payload(
        "caller",
        json!({"to": "triage"}),
        json!({"returnSchema": closed_case}),
    );
    let task = send_until(
        &gateway,
        "/a2a",
        handoff_message(payload),
        "TASK_STATE_FAILED",
    )
    .await;
    // Triage's case has no `closed`.
    assert_ended_with_output_schema_invalid(&task);
    assert_eq!(sends_to(&triage), 2, "the refund went back to triage");
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn a_result_returning_through_a_chain_meets_the_first_source_schema() {
    // triage (wants an approval) -> manager, who hands the work to clerk for
    // good -> clerk asks billing for a refund and approves it. Each inner
    // schema holds; triage's does not, as a refund is no approval.
    let gateway = baton().start().await;
    let approval = json!({"type": "object", "required": ["approved"]});
    let triage = source_awaiting_typed_result("triage", "manager", "case", Some(approval)).await;
    let manager = VendorAgent::start("manager", &["manager"], |_| Reply::Handoff {
        payload: handoff_payload(
            "manager",
            json!({"to": "clerk"}),
            json!({"returnSchema": {"type": "object"}}),
        ),
        state: TaskState::Completed,
    })
    .await
    .unwrap();
    let refund_id = json!({"type": "object", "required": ["refundId"]});
    let clerk = source_awaiting_typed_result("clerk", "billing", "approval", Some(refund_id)).await;
    let billing = register_with_billing(&gateway, &triage).await;
    register(&gateway, "manager", &manager, json!({})).await;
    register(&gateway, "clerk", &clerk, json!({})).await;
    let task = send_until(
        &gateway,
        "/agents/triage/a2a",
        user_message(&message_id("x"), "refund please"),
        "TASK_STATE_FAILED",
    )
    .await;
    assert_ended_with_output_schema_invalid(&task);
    assert_eq!(sends_to(&clerk), 2, "billing's refund went back to clerk");
    assert_eq!(sends_to(&triage), 1, "nothing went back to triage");
    assert_its_task_was_canceled(&triage).await;
    for agent in [triage, manager, clerk, billing] {
        agent.stop().await;
    }
    gateway.stop().await;
}

#[tokio::test]
async fn a_cancel_ends_the_task_of_every_source_waiting_for_the_result() {
    let gateway = baton().start().await;
    let triage = source_awaiting_result("triage", "manager", "case").await;
    let manager = source_awaiting_result("manager", "billing", "approval").await;
    let billing = VendorAgent::start("billing", &["refund"], |_| Reply::Working)
        .await
        .unwrap();
    register(&gateway, "triage", &triage, json!({})).await;
    register(&gateway, "manager", &manager, json!({})).await;
    register(&gateway, "billing", &billing, json!({})).await;
    let message = user_message(&message_id("c"), "refund please");
    let id = start_at_triage(&gateway, message, &billing).await;
    assert_eq!(sends_to(&billing), 1, "billing holds the task");
    cancel_answers_canceled(&gateway, &id).await;
    for source in [&triage, &manager] {
        assert_its_task_was_canceled(source).await;
    }
    for agent in [triage, manager, billing] {
        agent.stop().await;
    }
    gateway.stop().await;
}

#[tokio::test]
async fn transfers_are_refused_by_cycle_and_allow_list() {
    let gateway = baton().start().await;
    // Triage hands back to itself: a cycle.
    let triage = VendorAgent::start("triage", &["triage"], |turn| {
        let to = if turn.message.text().contains("loop") {
            "triage"
        } else {
            "billing"
        };
        Reply::Handoff {
            payload: handoff_payload("triage", json!({"to": to}), json!({})),
            state: TaskState::Completed,
        }
    })
    .await
    .unwrap();
    let billing = VendorAgent::start("billing", &["refund"], |_| refund())
        .await
        .unwrap();
    register(&gateway, "triage", &triage, json!({})).await;
    register(
        &gateway,
        "billing",
        &billing,
        json!({"allowFrom": ["intake"]}),
    )
    .await;

    let task = send_to_triage(&gateway, "c", "loop").await;
    assert_eq!(task["status"]["state"], "TASK_STATE_REJECTED", "{task}");
    assert_eq!(reason(&task), "HANDOFF_CYCLE");

    let task = send_to_triage(&gateway, "n", "refund").await;
    assert_eq!(task["status"]["state"], "TASK_STATE_REJECTED", "{task}");
    assert_eq!(reason(&task), "NOT_ALLOWED");
    assert!(billing.received().is_empty(), "nothing reached billing");

    // A direct handoff from an allowed source goes through.
    let task = send(
        &gateway,
        "/a2a",
        handoff_message(handoff_payload(
            "intake",
            json!({"to": "billing"}),
            json!({}),
        )),
    )
    .await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    let task = send(
        &gateway,
        "/a2a",
        handoff_message(handoff_payload(
            "stranger",
            json!({"to": "billing"}),
            json!({}),
        )),
    )
    .await;
    assert_eq!(reason(&task), "NOT_ALLOWED");
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn a_transfer_that_names_no_sender_is_refused_with_its_violations() {
    let gateway = baton().start().await;
    let triage = VendorAgent::start("triage", &["triage"], |turn| {
        let mut payload = handoff_payload("triage", json!({"to": "billing"}), json!({}));
        if turn.message.text().contains("anonymous") {
            payload.as_object_mut().unwrap().remove("from");
        } else {
            payload["from"] = json!("intake");
        }
        Reply::Handoff {
            payload,
            state: TaskState::Completed,
        }
    })
    .await
    .unwrap();
    let billing = register_with_billing(&gateway, &triage).await;

    let task = send_to_triage(&gateway, "a", "anonymous").await;
    assert_eq!(task["status"]["state"], "TASK_STATE_REJECTED", "{task}");
    assert_eq!(reason(&task), "SCHEMA_INVALID");
    let violations = task["status"]["message"]["parts"][0]["data"]["detail"]["violations"].clone();
    assert!(violations.to_string().contains("from"), "{violations}");

    // A payload naming another sender is data passed along, not a transfer.
    let task = send_to_triage(&gateway, "q", "quote").await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert!(billing.received().is_empty(), "nothing reached billing");
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn skill_output_schemas_type_results_of_handoffs_by_skill() {
    let gateway = baton().start().await;
    let billing = VendorAgent::start("billing", &["refund"], |_| {
        Reply::artifact("refund", json!({"refundId": "rf_1"}))
    })
    .await
    .unwrap();
    // However the agency keyed the schema and the handoff spells the skill
    // that chose billing, the schema types the result.
    for (n, key) in ["refund", "Refund", "billing/refund"]
        .into_iter()
        .enumerate()
    {
        let schemas = json!({"skillOutputSchemas": {key: refund_schema()}});
        if n == 0 {
            register(&gateway, "billing", &billing, schemas).await;
        } else {
            let mut params = json!({"id": "billing"});
            merge(&mut params, schemas);
            let reply = gateway.registry("UpdateAgent", params).await;
            assert!(reply.code().is_none(), "{}", reply.body);
        }
        for skill in ["refund", "REFUND", "billing/refund"] {
            let payload = handoff_payload("triage", json!({"toSkill": skill}), json!({}));
            let task = send(&gateway, "/a2a", handoff_message(payload)).await;
            assert_eq!(
                task["status"]["state"], "TASK_STATE_FAILED",
                "{key}, {skill}: {task}"
            );
            assert_eq!(reason(&task), "OUTPUT_SCHEMA_INVALID", "{key}, {skill}");
        }
    }
    billing.stop().await;
    gateway.stop().await;
}

fn quick_ladder(settings: &mut baton::gateway::GatewaySettings) {
    settings.ack_timeout = Duration::from_millis(300);
    settings.retry_delay = Duration::from_millis(200);
}

/// Two agents with skill `refund`: `silent`, which never answers, and
/// `billing`, which refunds.
async fn refund_agents() -> (VendorAgent, VendorAgent) {
    let silent = VendorAgent::start("silent", &["refund"], |_| Reply::Silent)
        .await
        .unwrap();
    let billing = VendorAgent::start("billing", &["refund"], |_| refund())
        .await
        .unwrap();
    (silent, billing)
}

/// A gateway with a quick ladder, and the two refund agents registered
/// there (billing with `billing_policy`).
async fn silent_and_billing(billing_policy: Value) -> (TestBaton, VendorAgent, VendorAgent) {
    let gateway = baton().tune(quick_ladder).start().await;
    let (silent, billing) = refund_agents().await;
    register(&gateway, "silent", &silent, json!({})).await;
    register(&gateway, "billing", &billing, billing_policy).await;
    (gateway, silent, billing)
}

/// Triage's refund, by skill, posted to `path`; the task as the blocking
/// send answers.
async fn refund_by_skill(gateway: &TestBaton, path: &str) -> Value {
    let payload = handoff_payload("triage", json!({"toSkill": "refund"}), json!({}));
    send(gateway, path, handoff_message(payload)).await
}

/// The ladder ended the task (`TARGET_UNAVAILABLE`); the task as stored.
async fn assert_ladder_ended(gateway: &TestBaton, task: &Value) -> Value {
    assert_eq!(task["status"]["state"], "TASK_STATE_FAILED", "{task}");
    assert_eq!(reason(task), "TARGET_UNAVAILABLE", "{task}");
    get_task(gateway, task["id"].as_str().unwrap()).await
}

/// [`assert_ladder_ended`] after one retry and no reroute.
async fn assert_retried_then_unavailable(gateway: &TestBaton, task: &Value) {
    let full = assert_ladder_ended(gateway, task).await;
    assert_eq!(
        reasons_in_history(&full),
        ["RETRY", "TARGET_UNAVAILABLE"],
        "{full}"
    );
}

#[tokio::test]
async fn no_acknowledgement_is_retried_then_rerouted_by_skill() {
    let (gateway, silent, billing) = silent_and_billing(json!({})).await;

    // Addressed to the silent agent, by skill: the ladder may reroute.
    let task = refund_by_skill(&gateway, "/agents/silent/a2a").await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    let full = get_task(&gateway, task["id"].as_str().unwrap()).await;
    assert_eq!(reasons_in_history(&full), ["RETRY", "REROUTED"], "{full}");
    // Both steps were announced while the task was still SUBMITTED.
    let record = gateway
        .ledger
        .get(task["id"].as_str().unwrap())
        .unwrap()
        .unwrap();
    assert_eq!(record.agent, "billing");
    assert_eq!(record.hops[0].attempts, 2);
    assert_eq!(record.hops[1].agent, "billing");
    // The same message (same messageId) was tried twice at the silent agent.
    let tries: Vec<_> = silent
        .sends()
        .into_iter()
        .map(|r| r.params["message"]["messageId"].clone())
        .collect();
    assert_eq!(tries.len(), 2);
    assert_eq!(tries[0], tries[1]);
    assert_eq!(
        full["metadata"]["urn:baton:handoff:v1"]["chain"],
        json!(["billing"])
    );
    silent.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// A call a routing rule sends by skill is a handoff by that skill
/// (DESIGN.md §3.3): without an acknowledgement it is retried, then
/// rerouted to another healthy agent declaring the skill.
#[tokio::test]
async fn a_call_routed_by_a_skill_rule_is_rerouted_by_that_skill() {
    let gateway = baton()
        .tune(quick_ladder)
        .routing("[[route]]\nwhen = { skill = \"refund\" }\n")
        .start()
        .await;
    let (silent, billing) = refund_agents().await;
    register(&gateway, "silent", &silent, json!({})).await;
    register(&gateway, "billing", &billing, json!({})).await;

    // Balanced between the two, so one of two calls goes to `silent` first.
    let mut histories = Vec::new();
    for _ in 0..2 {
        let params = json!({
            "message": user_message(&message_id("m"), "refund me"),
            "metadata": {"skill": "refund"},
        });
        let task = gateway.call("SendMessage", params).await.result()["task"].clone();
        assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
        let full = get_task(&gateway, task["id"].as_str().unwrap()).await;
        histories.push(reasons_in_history(&full));
    }
    histories.sort();
    assert_eq!(histories, [vec![], vec!["RETRY", "REROUTED"]]);
    assert_eq!(sends_to(&silent), 2, "tried, then retried");
    assert_eq!(sends_to(&billing), 2);
    silent.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// The ladder never reroutes to the handoff's sender, as the first choice
/// by skill never picks it: that would hand the work back where it came from.
#[tokio::test]
async fn a_reroute_never_hands_the_work_back_to_its_sender() {
    let (gateway, silent, billing) = silent_and_billing(json!({})).await;
    let payload = handoff_payload("billing", json!({"toSkill": "refund"}), json!({}));
    let task = send(&gateway, "/agents/silent/a2a", handoff_message(payload)).await;
    assert_retried_then_unavailable(&gateway, &task).await;
    assert_eq!(sends_to(&billing), 0, "nothing went back to the sender");
    silent.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// A result typed by the skill that chose its agent is typed, after a
/// reroute, by the output schema the alternative declared for that skill.
#[tokio::test]
async fn a_reroute_types_the_result_by_the_alternatives_skill_schema() {
    let gateway = baton().tune(quick_ladder).start().await;
    let (silent, billing) = refund_agents().await;
    let credit_note = json!({"type": "object", "required": ["creditNoteId"]});
    let declared = |schema: Value| json!({"skillOutputSchemas": {"refund": schema}});
    register(&gateway, "silent", &silent, declared(credit_note)).await;
    register(&gateway, "billing", &billing, declared(refund_schema())).await;

    let task = refund_by_skill(&gateway, "/agents/silent/a2a").await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    let full = get_task(&gateway, task["id"].as_str().unwrap()).await;
    assert_eq!(reasons_in_history(&full), ["RETRY", "REROUTED"], "{full}");

    // A schema the payload names binds whichever agent takes the work.
    let payload = handoff_payload(
        "triage",
        json!({"toSkill": "refund", "returnSchema": {"type": "object", "required": ["creditNoteId"]}}),
        json!({}),
    );
    let task = send(&gateway, "/agents/silent/a2a", handoff_message(payload)).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_FAILED", "{task}");
    assert_eq!(reason(&task), "OUTPUT_SCHEMA_INVALID", "{task}");
    silent.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// The ladder reroutes only to an agent that the first choice's policy
/// checks would have let the work reach: here one that does not allow the
/// sender, so the ladder ends instead.
#[tokio::test]
async fn a_reroute_skips_an_agent_that_does_not_allow_the_sender() {
    let (gateway, silent, billing) = silent_and_billing(json!({"allowFrom": ["support"]})).await;

    let task = refund_by_skill(&gateway, "/agents/silent/a2a").await;
    let full = assert_ladder_ended(&gateway, &task).await;
    assert!(
        !reasons_in_history(&full).contains(&"REROUTED".to_string()),
        "{full}"
    );
    assert_eq!(
        sends_to(&billing),
        0,
        "billing does not take work from triage"
    );
    silent.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// A reroute goes only to a healthy agent (DESIGN.md §3.3), although a
/// first choice may be an unhealthy one when no other has the skill.
#[tokio::test]
async fn a_reroute_skips_an_agent_that_failed_its_health_check() {
    let (gateway, silent, billing) = silent_and_billing(json!({})).await;
    gateway.gateway.directory().set_healthy("billing", false);

    let task = refund_by_skill(&gateway, "/agents/silent/a2a").await;
    assert_retried_then_unavailable(&gateway, &task).await;
    assert_eq!(sends_to(&billing), 0, "billing failed its health check");
    silent.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// With API keys, a reroute also holds the sender to what a first choice
/// would: a sender named by the caller that another agency registered is
/// not let into an agent that guards who may hand it work.
#[tokio::test]
async fn a_reroute_does_not_take_a_sender_another_agency_registered() {
    let gateway = baton()
        .api_keys("acme=KEY1,globex=KEY2")
        .tune(quick_ladder)
        .start()
        .await;
    let (silent, billing) = refund_agents().await;
    let support = VendorAgent::start("support", &["help"], |_| refund())
        .await
        .unwrap();
    let agencies = [
        ("KEY2", "silent", &silent, json!({})),
        ("KEY1", "support", &support, json!({})),
        (
            "KEY1",
            "billing",
            &billing,
            json!({"allowFrom": ["support"]}),
        ),
    ];
    for (key, id, agent, extra) in agencies {
        let mut params = json!({"id": id, "card": agent.card()});
        merge(&mut params, extra);
        let reply = gateway
            .call_as("/registry", key, "RegisterAgent", params)
            .await;
        assert!(reply.code().is_none(), "register {id}: {}", reply.body);
    }

    // globex names acme's `support` as the sender.
    let message = handoff_message(handoff_payload(
        "support",
        json!({"toSkill": "refund"}),
        json!({}),
    ));
    let params = json!({"message": message});
    let reply = gateway
        .call_as("/agents/silent/a2a", "KEY2", "SendMessage", params)
        .await;
    let task = &reply.result()["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_FAILED", "{task}");
    assert_eq!(reason(task), "TARGET_UNAVAILABLE", "{task}");
    let sends = billing.sends().len();
    assert_eq!(
        sends, 0,
        "billing takes no work in support's name from globex"
    );
    for agent in [silent, billing, support] {
        agent.stop().await;
    }
    gateway.stop().await;
}

#[tokio::test]
async fn an_exhausted_ladder_fails_or_escalates() {
    let gateway = baton().tune(quick_ladder).start().await;
    let silent = VendorAgent::start("silent", &["refund"], |_| Reply::Silent)
        .await
        .unwrap();
    register(&gateway, "silent", &silent, json!({})).await;
    let started = std::time::Instant::now();
    let task = send(
        &gateway,
        "/a2a",
        handoff_message(handoff_payload(
            "triage",
            json!({"toSkill": "refund"}),
            json!({}),
        )),
    )
    .await;
    assert_retried_then_unavailable(&gateway, &task).await;
    assert!(started.elapsed() >= Duration::from_millis(800));
    gateway.stop().await;

    let gateway = baton()
        .tune(|s| {
            quick_ladder(s);
            s.escalate = true;
        })
        .start()
        .await;
    register(&gateway, "silent", &silent, json!({})).await;
    let task = send(
        &gateway,
        "/a2a",
        handoff_message(handoff_payload(
            "triage",
            json!({"to": "silent"}),
            json!({}),
        )),
    )
    .await;
    assert_eq!(
        task["status"]["state"], "TASK_STATE_INPUT_REQUIRED",
        "{task}"
    );
    assert_eq!(reason(&task), "ESCALATED");
    silent.stop().await;
    gateway.stop().await;
}

/// The answer to an escalated handoff is kept where a restart's delivery
/// finds it (the hop the delivery began at) until the agent acknowledges
/// the redelivery; the task's first message is not copied again.
#[tokio::test]
async fn an_escalated_handoffs_redelivery_is_kept_until_acknowledged() {
    let gateway = escalating_gateway().await;
    let billing = billing_silent_at_first(&gateway, 3).await;
    let task = handoff_to_billing(&gateway).await;
    let id = task["id"].as_str().unwrap().to_string();
    // The redelivery's first attempt goes unanswered: the retry comes
    // 500 ms later.
    let kept = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let record = gateway.ledger.get(&id).unwrap().unwrap();
        assert!(record.hops[0].undelivered.is_none(), "no copy");
        let at = *record.hops[0].escalation_answers.first().expect("kept");
        serde_json::to_string(&record.task.history[at].parts).unwrap()
    };
    let (task, kept) = tokio::join!(go_ahead(&gateway, &task), kept);
    assert!(kept.contains("go ahead"), "{kept}");
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    let record = gateway.ledger.get(&id).unwrap().unwrap();
    assert!(
        record
            .hops
            .iter()
            .all(|hop| hop.escalation_answers.is_empty())
    );
    billing.stop().await;
    gateway.stop().await;
}

/// While the redelivery an answer to an escalated handoff made waits for
/// the agent's acknowledgement, another message is refused at once, as it
/// is while a handoff is first delivered: it hung, and reached no agent.
#[tokio::test]
async fn a_message_during_an_escalated_handoffs_redelivery_is_refused() {
    let gateway = escalating_gateway().await;
    let billing = billing_silent_at_first(&gateway, 3).await;
    let task = handoff_to_billing(&gateway).await;
    let id = task["id"].as_str().unwrap().to_string();
    let more = async {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let message = user_message_on(&id, &message_id("more"), "also this");
        let started = std::time::Instant::now();
        let reply = gateway
            .call("SendMessage", json!({"message": message}))
            .await;
        (reply, started.elapsed())
    };
    let (task, (reply, took)) = tokio::join!(go_ahead(&gateway, &task), more);
    assert_eq!(reply.code(), Some(-32004), "{}", reply.body);
    assert!(took < Duration::from_secs(1), "took {took:?}");
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    billing.stop().await;
    gateway.stop().await;
}

/// While a result's return leg waits for its source's acknowledgement,
/// a caller's message is refused at once (-32004): there is no task the
/// source has taken up yet for it to continue.
#[tokio::test]
async fn a_message_during_a_return_leg_is_refused() {
    let gateway = baton().tune(quick_ladder).start().await;
    let returned = silent_at_first(1, |_| Reply::artifact("case", json!({"closed": true})));
    let triage = VendorAgent::start("triage", &["triage"], move |turn| {
        if data_of(&turn.message.parts, HANDOFF_RESULT_MEDIA_TYPE).is_none() {
            return triage_hands_off_for_result(json!({"to": "billing"}), TaskState::InputRequired);
        }
        returned(turn)
    })
    .await
    .unwrap();
    let billing = register_with_billing(&gateway, &triage).await;
    let message = user_message(&message_id("r"), "refund please");
    let params = json!({"message": message, "configuration": {"returnImmediately": true}});
    let task = gateway
        .call_at("/agents/triage/a2a", "SendMessage", params)
        .await;
    let id = task.result()["task"]["id"].as_str().unwrap().to_string();
    wait_until("the result never went back", || triage.sends().len() >= 2).await;
    let more = user_message_on(&id, &message_id("more"), "also this");
    let started = std::time::Instant::now();
    let reply = gateway.call("SendMessage", json!({"message": more})).await;
    let took = started.elapsed();
    assert_eq!(reply.code(), Some(-32004), "{}", reply.body);
    assert!(took < Duration::from_secs(1), "took {took:?}");
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// The answer to an escalated direct handoff is taken when the task can
/// hold it once: its redelivery copies neither the task's first message
/// nor the answer into the record again. Once with a large first message,
/// once with a large answer.
#[tokio::test]
async fn an_answer_to_an_escalated_large_handoff_fits_the_task() {
    for large_answer in [false, true] {
        let gateway = baton()
            .tune(|s| {
                quick_ladder(s);
                s.escalate = true;
                s.max_task_bytes = 200_000;
            })
            .start()
            .await;
        let billing = billing_silent_at_first(&gateway, 2).await;
        let long = "x".repeat(110_000);
        let payload = handoff_payload("triage", json!({"to": "billing"}), json!({}));
        let mut message = handoff_message(payload);
        if !large_answer {
            let parts = message["parts"].as_array_mut().unwrap();
            parts.push(json!({"text": long}));
        }
        let task = send(&gateway, "/a2a", message).await;
        assert_eq!(reason(&task), "ESCALATED", "{task}");
        let text = if large_answer {
            long.as_str()
        } else {
            "go ahead"
        };
        let answer = user_message_on(task["id"].as_str().unwrap(), &message_id("go"), text);
        let task = send(&gateway, "/a2a", answer).await;
        assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
        billing.stop().await;
        gateway.stop().await;
    }
}

/// A result returning, later in the same run of the task, to a source
/// that ended its task still goes to that task's context when the run
/// began with an escalated handoff's redelivery: only the redelivery's own
/// turn may not readdress a refusal.
#[tokio::test]
async fn a_later_return_after_a_redelivery_may_still_go_to_its_sources_context() {
    let gateway = escalating_gateway().await;
    let triage = VendorAgent::start(
        "triage",
        &["triage"],
        silent_at_first(
            2,
            triage_closing_the_case(json!({"to": "billing"}), TaskState::InputRequired),
        ),
    )
    .await
    .unwrap();
    let billing = VendorAgent::start("billing", &["refund"], |_| {
        Reply::Later(Duration::from_millis(600), Box::new(refund()))
    })
    .await
    .unwrap();
    register(&gateway, "triage", &triage, json!({})).await;
    register(&gateway, "billing", &billing, json!({})).await;
    let payload = handoff_payload("front", json!({"to": "triage"}), json!({}));
    let task = send(&gateway, "/a2a", handoff_message(payload)).await;
    // Triage closes its task while billing works.
    let closed = async {
        wait_until("billing got no work", || !billing.sends().is_empty()).await;
        triage.complete_open_tasks()
    };
    let (task, closed) = tokio::join!(go_ahead(&gateway, &task), closed);
    assert_eq!(closed, 1);
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(artifact_names(&task), ["refund", "case"], "{task}");
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// The caller's answer to a handoff escalated after a reroute delivers it
/// again to the alternative holding the task, under the task's control
/// (a chain ending with that agent), not the first choice's.
#[tokio::test]
async fn an_escalated_reroute_is_delivered_again_under_the_holders_control() {
    let gateway = escalating_gateway().await;
    let first = VendorAgent::start("a1", &["refund"], |_| Reply::Silent)
        .await
        .unwrap();
    let second = VendorAgent::start("a2", &["refund"], silent_at_first(2, |_| refund()))
        .await
        .unwrap();
    register(&gateway, "a1", &first, json!({})).await;
    register(&gateway, "a2", &second, json!({})).await;
    let payload = handoff_payload("triage", json!({"toSkill": "refund"}), json!({}));
    let task = send(&gateway, "/a2a", handoff_message(payload)).await;
    let task = go_ahead(&gateway, &task).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    let chains: Vec<Value> = second
        .sends()
        .iter()
        .map(|send| send.params["message"]["metadata"]["urn:baton:handoff:v1"]["chain"].clone())
        .collect();
    assert_eq!(chains.len(), 3, "{chains:?}");
    for chain in &chains {
        assert_eq!(chain, &json!(["a2"]), "{chains:?}");
    }
    first.stop().await;
    second.stop().await;
    gateway.stop().await;
}

/// A source that took a returned result into its task but answered after
/// the ackTimeout refuses the retry (its task ended meanwhile): the result
/// is not sent again as a new task, which it would work on twice.
#[tokio::test]
async fn a_refused_retry_of_a_return_does_not_deliver_the_result_again() {
    let gateway = baton().tune(quick_ladder).start().await;
    let results = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = results.clone();
    let triage = VendorAgent::start("triage", &["triage"], move |turn| {
        if data_of(&turn.message.parts, HANDOFF_RESULT_MEDIA_TYPE).is_none() {
            return triage_hands_off_for_result(json!({"to": "billing"}), TaskState::InputRequired);
        }
        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let closed = Reply::artifact("case", json!({"closed": true}));
        Reply::Late(Duration::from_millis(900), Box::new(closed))
    })
    .await
    .unwrap();
    let billing = register_with_billing(&gateway, &triage).await;
    let task = send_to_triage(&gateway, "r", "refund please").await;
    let state = task["status"]["state"].as_str().unwrap_or_default();
    assert!(
        state == "TASK_STATE_FAILED" || state == "TASK_STATE_COMPLETED",
        "{task}"
    );
    assert_eq!(results.load(std::sync::atomic::Ordering::SeqCst), 1);
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// A request may shorten the ackTimeout (`ackTimeoutMs` in its control),
/// never lengthen it: with the gateway's 5 s, 300 ms asked ends the ladder
/// (two attempts, 200 ms apart) in about a second; with the gateway's
/// 300 ms, a minute asked is not taken.
#[tokio::test]
async fn a_request_may_shorten_the_ack_timeout_but_not_lengthen_it() {
    let silent = VendorAgent::start("silent", &["refund"], |_| Reply::Silent)
        .await
        .unwrap();
    let gateways = [
        baton()
            .tune(|s| s.retry_delay = Duration::from_millis(200))
            .start()
            .await,
        baton().tune(quick_ladder).start().await,
    ];
    for (gateway, asked) in gateways.into_iter().zip([300, 60_000]) {
        register(&gateway, "silent", &silent, json!({})).await;
        let payload = handoff_payload("triage", json!({"to": "silent"}), json!({}));
        let mut message = handoff_message(payload);
        message["metadata"] = json!({"urn:baton:handoff:v1": {"ackTimeoutMs": asked}});
        let started = std::time::Instant::now();
        let task = send(&gateway, "/a2a", message).await;
        let took = started.elapsed();
        assert_retried_then_unavailable(&gateway, &task).await;
        assert!(
            took < Duration::from_secs(3),
            "asked {asked} ms, took {took:?}"
        );
        let control = &task["metadata"]["urn:baton:handoff:v1"];
        assert_eq!(control["ackTimeoutMs"], asked, "{control}");
        gateway.stop().await;
    }
    silent.stop().await;
}

/// A script that holds its first `silent` calls unanswered, then answers
/// with `then`.
fn silent_at_first(
    silent: usize,
    then: impl Fn(&baton::demo::vendor::Turn) -> Reply + Send + Sync + 'static,
) -> impl Fn(&baton::demo::vendor::Turn) -> Reply + Send + Sync + 'static {
    let calls = std::sync::atomic::AtomicUsize::new(0);
    move |turn| {
        if calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < silent {
            return Reply::Silent;
        }
        then(turn)
    }
}

/// `billing`, registered, silent to its first `silent` deliveries, then
/// refunding.
async fn billing_silent_at_first(gateway: &TestBaton, silent: usize) -> VendorAgent {
    let billing = VendorAgent::start(
        "billing",
        &["refund"],
        silent_at_first(silent, |_| refund()),
    )
    .await
    .unwrap();
    register(gateway, "billing", &billing, json!({})).await;
    billing
}

/// A direct handoff from triage to billing, sent blocking: the task as it
/// came back.
async fn handoff_to_billing(gateway: &TestBaton) -> Value {
    let payload = handoff_payload("triage", json!({"to": "billing"}), json!({}));
    send(gateway, "/a2a", handoff_message(payload)).await
}

/// A gateway whose ladder is quick and escalates.
async fn escalating_gateway() -> TestBaton {
    baton()
        .tune(|s| {
            quick_ladder(s);
            s.escalate = true;
        })
        .start()
        .await
}

/// Answers the ESCALATED `task` with "go ahead", and returns the task as
/// the answer leaves it.
async fn go_ahead(gateway: &TestBaton, task: &Value) -> Value {
    assert_eq!(
        task["status"]["state"], "TASK_STATE_INPUT_REQUIRED",
        "{task}"
    );
    assert_eq!(reason(task), "ESCALATED");
    let id = task["id"].as_str().unwrap();
    let answer = user_message_on(id, &message_id("go"), "go ahead");
    send(gateway, "/a2a", answer).await
}

/// The media types and texts of the parts of `agent`'s last SendMessage.
fn last_delivery(agent: &VendorAgent) -> (Vec<String>, Vec<String>) {
    let sends = agent.sends();
    let parts = sends.last().unwrap().params["message"]["parts"].clone();
    let parts: Vec<Part> = serde_json::from_value(parts).unwrap();
    let types = parts.iter().map(|p| p.media_type.clone()).collect();
    let texts = parts
        .iter()
        .filter_map(|p| match &p.content {
            PartContent::Text(text) => Some(text.clone()),
            _ => None,
        })
        .collect();
    (types, texts)
}

/// The caller's answer to an escalated direct handoff or transfer delivers
/// the handoff again, its payload with the answer, on a new ladder: the
/// payload was lost, the target got the answer alone.
#[tokio::test]
async fn an_escalated_handoff_is_delivered_again_with_the_callers_answer() {
    for transfer in [false, true] {
        let gateway = escalating_gateway().await;
        let billing = billing_silent_at_first(&gateway, 2).await;
        let triage = VendorAgent::start("triage", &["triage"], |_| Reply::Handoff {
            payload: handoff_payload("triage", json!({"to": "billing"}), json!({})),
            state: TaskState::Completed,
        })
        .await
        .unwrap();
        register(&gateway, "triage", &triage, json!({})).await;
        let task = if transfer {
            send_to_triage(&gateway, "t", "refund please").await
        } else {
            handoff_to_billing(&gateway).await
        };
        let task = go_ahead(&gateway, &task).await;
        assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
        assert_eq!(artifact_names(&task), ["refund"], "{task}");
        let (types, texts) = last_delivery(&billing);
        assert!(types.iter().any(|t| t == HANDOFF_MEDIA_TYPE), "{types:?}");
        assert_eq!(texts.last().map(String::as_str), Some("go ahead"));
        assert_eq!(billing.sends().len(), 3, "two attempts, then the answer's");
        triage.stop().await;
        billing.stop().await;
        gateway.stop().await;
    }
}

/// A redelivery escalated again carries every answer the agent has not
/// acknowledged, in order, whatever the role its caller sent it in: the
/// first answer's facts were lost when the second replaced it.
#[tokio::test]
async fn an_escalated_redelivery_carries_every_unacknowledged_answer() {
    let gateway = escalating_gateway().await;
    // Silent to the ladder's two attempts and to the first answer's two.
    let billing = billing_silent_at_first(&gateway, 4).await;
    let task = handoff_to_billing(&gateway).await;
    let id = task["id"].as_str().unwrap();
    // From an orchestrating agent.
    let mut account = user_message_on(id, &message_id("acct"), "the account is 1234");
    account["role"] = json!("ROLE_AGENT");
    let task = send(&gateway, "/a2a", account).await;
    let task = go_ahead(&gateway, &task).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(
        billing.sends().len(),
        5,
        "two ladders of two, then the last"
    );
    let (types, texts) = last_delivery(&billing);
    assert!(types.iter().any(|t| t == HANDOFF_MEDIA_TYPE), "{types:?}");
    assert_eq!(texts, ["the account is 1234", "go ahead"]);
    let sends = billing.sends();
    let last = &sends.last().unwrap().params["message"]["messageId"];
    assert!(last.as_str().unwrap().starts_with("go"), "{last}");
    billing.stop().await;
    gateway.stop().await;
}

/// The caller's answer to an escalated return leg delivers the result to
/// its source again, with the answer: the source got the answer alone.
#[tokio::test]
async fn an_escalated_return_is_delivered_again_with_the_callers_answer() {
    let gateway = escalating_gateway().await;
    let returned = silent_at_first(2, |turn| {
        if data_of(&turn.message.parts, HANDOFF_RESULT_MEDIA_TYPE).is_some() {
            Reply::artifact("case", json!({"closed": true}))
        } else {
            Reply::Fail("no handoff result".into())
        }
    });
    let triage = VendorAgent::start("triage", &["triage"], move |turn| {
        if turn.task_id.is_none() {
            return triage_hands_off_for_result(json!({"to": "billing"}), TaskState::InputRequired);
        }
        returned(turn)
    })
    .await
    .unwrap();
    let billing = register_with_billing(&gateway, &triage).await;
    let task = send_to_triage(&gateway, "r", "refund please").await;
    let task = go_ahead(&gateway, &task).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(artifact_names(&task), ["refund", "case"], "{task}");
    let (types, texts) = last_delivery(&triage);
    assert!(
        types.iter().any(|t| t == HANDOFF_RESULT_MEDIA_TYPE),
        "{types:?}"
    );
    assert_eq!(texts.last().map(String::as_str), Some("go ahead"));
    let sends = triage.sends();
    let into = &sends.last().unwrap().params["message"]["taskId"];
    assert_eq!(into, &sends[1].params["message"]["taskId"], "its own task");
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// The agent's tasks that got a CancelTask, once `count` have (or after
/// five seconds).
async fn canceled_tasks(agent: &VendorAgent, count: usize) -> Vec<String> {
    for _ in 0..100 {
        if agent.cancels().len() >= count {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    agent.cancels().into_iter().map(|(id, _)| id).collect()
}

#[tokio::test]
async fn a_task_an_abandoned_attempt_created_is_canceled() {
    let gateway = baton().tune(quick_ladder).start().await;
    // Answers the first try only after the ackTimeout, with a task it
    // created at once; the retry completes.
    let calls = std::sync::atomic::AtomicUsize::new(0);
    let slow = VendorAgent::start("slow", &["refund"], move |_| {
        match calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) {
            0 => Reply::Late(Duration::from_millis(900), Box::new(Reply::Working)),
            _ => refund(),
        }
    })
    .await
    .unwrap();
    register(&gateway, "slow", &slow, json!({})).await;
    let message = handoff_message(handoff_payload("triage", json!({"to": "slow"}), json!({})));
    let task = send(&gateway, "/a2a", message).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    let full = get_task(&gateway, task["id"].as_str().unwrap()).await;
    assert_eq!(reasons_in_history(&full), ["RETRY"], "{full}");
    let taken_up = gateway
        .ledger
        .get(task["id"].as_str().unwrap())
        .unwrap()
        .unwrap()
        .upstream
        .unwrap()
        .task_id;

    // The first try's task, learned from its late answer, was canceled;
    // the task the retry created, which the gateway task took up, was not.
    let canceled = canceled_tasks(&slow, 1).await;
    assert_eq!(canceled.len(), 1, "{canceled:?}");
    assert_ne!(canceled[0], taken_up);
    let orphan = slow
        .task(&canceled[0])
        .expect("the first try created a task");
    assert_eq!(orphan.status.state, TaskState::Canceled);
    slow.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn an_exhausted_ladder_cancels_the_tasks_its_attempts_created() {
    let gateway = baton().tune(quick_ladder).start().await;
    let slow = VendorAgent::start("slow", &["refund"], |_| {
        Reply::Late(Duration::from_millis(900), Box::new(Reply::Working))
    })
    .await
    .unwrap();
    register(&gateway, "slow", &slow, json!({})).await;
    let message = handoff_message(handoff_payload("triage", json!({"to": "slow"}), json!({})));
    let task = send(&gateway, "/a2a", message).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_FAILED", "{task}");
    assert_eq!(reason(&task), "TARGET_UNAVAILABLE");
    // Both tries created a task the gateway task never took up.
    let mut canceled = canceled_tasks(&slow, 2).await;
    canceled.dedup();
    assert_eq!(canceled.len(), 2, "{canceled:?}");
    for id in canceled {
        assert_eq!(slow.task(&id).unwrap().status.state, TaskState::Canceled);
    }
    slow.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn a_task_two_abandoned_attempts_share_is_canceled_once() {
    let cancels = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let agent = common::agents::DeduplicatingLateAgent {
        card: common::agents::card("dedup"),
        delay: Duration::from_millis(900),
        cancels: cancels.clone(),
    };
    let gateway = baton()
        .agent("dedup", agent)
        .tune(quick_ladder)
        .start()
        .await;
    let message = handoff_message(handoff_payload("triage", json!({"to": "dedup"}), json!({})));
    let task = send(&gateway, "/a2a", message).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_FAILED", "{task}");
    // Both late answers name the one task; it is canceled once.
    for _ in 0..100 {
        if cancels.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(cancels.load(std::sync::atomic::Ordering::SeqCst), 1);
    gateway.stop().await;
}

/// A Baton whose ladder waits 5 s before a retry (after a 300 ms ackTimeout).
async fn with_a_long_retry_pause() -> TestBaton {
    baton()
        .tune(|settings| {
            quick_ladder(settings);
            settings.retry_delay = Duration::from_secs(5);
        })
        .start()
        .await
}

/// A deadline that falls in the pause before a retry fails the task at the
/// deadline, not once the pause is over.
#[tokio::test]
async fn a_deadline_in_the_pause_before_a_retry_fails_the_task_at_once() {
    let gateway = with_a_long_retry_pause().await;
    let silent = VendorAgent::start("silent", &["refund"], |_| Reply::Silent)
        .await
        .unwrap();
    register(&gateway, "silent", &silent, json!({})).await;
    // After the 300 ms ackTimeout, in the 5 s pause.
    let deadline = chrono::Utc::now() + chrono::Duration::milliseconds(800);
    let mut message = handoff_message(handoff_payload(
        "triage",
        json!({"to": "silent"}),
        json!({}),
    ));
    message["metadata"]["urn:baton:handoff:v1"] = json!({
        "deadline": baton::protocol::wire::format_timestamp(&deadline)
    });
    let reply = gateway
        .call(
            "SendMessage",
            json!({"message": message, "configuration": {"returnImmediately": true}}),
        )
        .await;
    let id = reply.result()["task"]["id"].as_str().unwrap().to_string();
    let seconds = chrono::Duration::seconds(2);
    gateway
        .failed_at_deadline("/a2a", &id, deadline, seconds)
        .await;
    silent.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn a_canceled_task_still_cancels_what_its_abandoned_attempt_created() {
    // The caller cancels while the ladder waits.
    let gateway = with_a_long_retry_pause().await;
    let slow = VendorAgent::start("slow", &["refund"], |_| {
        Reply::Late(Duration::from_millis(900), Box::new(Reply::Working))
    })
    .await
    .unwrap();
    register(&gateway, "slow", &slow, json!({})).await;
    let message = handoff_message(handoff_payload("triage", json!({"to": "slow"}), json!({})));
    let reply = gateway
        .call(
            "SendMessage",
            json!({"message": message, "configuration": {"returnImmediately": true}}),
        )
        .await;
    let id = reply.result()["task"]["id"].as_str().unwrap().to_string();
    // The first attempt was abandoned once the retry is announced.
    for _ in 0..100 {
        if reasons_in_history(&get_task(&gateway, &id).await).contains(&"RETRY".to_string()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cancel_answers_canceled(&gateway, &id).await;
    // The abandoned call went on, learned the agent's task, and canceled it.
    let orphans = canceled_tasks(&slow, 1).await;
    assert_eq!(orphans.len(), 1, "{orphans:?}");
    assert_eq!(
        slow.task(&orphans[0]).unwrap().status.state,
        TaskState::Canceled
    );
    slow.stop().await;
    gateway.stop().await;
}

/// Hands off to `slow`, an agent that creates its task at once but answers
/// only after 900 ms, and returns the gateway task's id at once.
async fn hand_off_to_a_slow_agent(gateway: &TestBaton, metadata: Value) -> (VendorAgent, String) {
    let slow = VendorAgent::start("slow", &["refund"], |_| {
        Reply::Late(Duration::from_millis(900), Box::new(Reply::Working))
    })
    .await
    .unwrap();
    register(gateway, "slow", &slow, json!({})).await;
    let mut message = handoff_message(handoff_payload("triage", json!({"to": "slow"}), json!({})));
    message["metadata"] = metadata;
    let reply = gateway
        .call(
            "SendMessage",
            json!({"message": message, "configuration": {"returnImmediately": true}}),
        )
        .await;
    let id = reply.result()["task"]["id"].as_str().unwrap().to_string();
    (slow, id)
}

/// Asserts that `slow` was sent CancelTask for the one task it created,
/// once (no later duplicate either).
async fn assert_its_task_was_canceled(slow: &VendorAgent) {
    let canceled = canceled_tasks(slow, 1).await;
    assert_eq!(canceled.len(), 1, "{canceled:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(slow.cancels().len(), 1, "{:?}", slow.cancels());
    assert_eq!(
        slow.task(&canceled[0]).unwrap().status.state,
        TaskState::Canceled
    );
}

#[tokio::test]
async fn a_cancel_before_the_target_answers_still_reaches_its_task() {
    let gateway = baton().start().await;
    let (slow, id) = hand_off_to_a_slow_agent(&gateway, Value::Null).await;
    cancel_answers_canceled(&gateway, &id).await;
    // The call went on until the agent named its task, which was canceled.
    assert_its_task_was_canceled(&slow).await;
    slow.stop().await;
    gateway.stop().await;
}

/// Never answers; `ended` is set once its work stops (it returns or is
/// dropped).
struct QuietInProcessAgent {
    card: baton::protocol::AgentCard,
    ended: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// Sets its flag when dropped.
struct SetOnDrop(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[async_trait::async_trait]
impl baton::agents::Agent for QuietInProcessAgent {
    fn card(&self) -> &baton::protocol::AgentCard {
        &self.card
    }

    async fn execute(
        &self,
        request: baton::agents::AgentRequest,
        _: baton::agents::AgentEvents,
    ) -> Result<(), baton::agents::AgentError> {
        let _ended = SetOnDrop(self.ended.clone());
        request.cancel.cancelled().await;
        Ok(())
    }
}

#[tokio::test]
async fn a_canceled_handoff_to_an_in_process_agent_ends_its_work_at_once() {
    let ended = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let quiet = QuietInProcessAgent {
        card: common::agents::card("quiet"),
        ended: ended.clone(),
    };
    let gateway = baton().agent("quiet", quiet).start().await;
    let message = handoff_message(handoff_payload("triage", json!({"to": "quiet"}), json!({})));
    let reply = gateway
        .call(
            "SendMessage",
            json!({"message": message, "configuration": {"returnImmediately": true}}),
        )
        .await;
    let id = reply.result()["task"]["id"].as_str().unwrap().to_string();
    cancel_answers_canceled(&gateway, &id).await;
    // No task of its own to learn and cancel: its work is not kept going.
    for _ in 0..100 {
        if ended.load(std::sync::atomic::Ordering::SeqCst) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ended.load(std::sync::atomic::Ordering::SeqCst));
    gateway.stop().await;
}

#[tokio::test]
async fn a_message_to_a_handoff_no_agent_took_up_yet_is_refused() {
    let gateway = baton().start().await;
    let (slow, id) = hand_off_to_a_slow_agent(&gateway, Value::Null).await;
    let more = user_message_on(&id, &message_id("more"), "one more thing");
    let refused = gateway.call("SendMessage", json!({"message": more})).await;
    assert_eq!(refused.code(), Some(-32004), "{}", refused.body);
    // The attempt goes on alone, and the target's answer is the task's.
    for _ in 0..100 {
        if get_task(&gateway, &id).await["status"]["state"] == "TASK_STATE_WORKING" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        get_task(&gateway, &id).await["status"]["state"],
        "TASK_STATE_WORKING"
    );
    assert_eq!(sends_to(&slow), 1, "the message never reached the agent");
    // Taken up, the task takes more.
    let params = json!({"message": more, "configuration": {"returnImmediately": true}});
    let accepted = gateway.call("SendMessage", params).await;
    assert!(accepted.code().is_none(), "{}", accepted.body);
    slow.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn a_message_to_a_transfer_its_target_has_not_answered_is_refused() {
    let gateway = baton().start().await;
    let triage = handing_on("triage", &["triage"], json!({"to": "slow"})).await;
    let slow = VendorAgent::start("slow", &["refund"], |_| {
        Reply::Late(Duration::from_millis(900), Box::new(Reply::Working))
    })
    .await
    .unwrap();
    register(&gateway, "triage", &triage, json!({})).await;
    register(&gateway, "slow", &slow, json!({})).await;
    let message = user_message(&message_id("t"), "refund please");
    let id = start_at_triage(&gateway, message, &slow).await;
    let more = user_message_on(&id, &message_id("more"), "one more thing");
    let refused = gateway.call("SendMessage", json!({"message": more})).await;
    assert_eq!(refused.code(), Some(-32004), "{}", refused.body);
    assert_eq!(sends_to(&slow), 1, "the message never reached the target");
    triage.stop().await;
    slow.stop().await;
    gateway.stop().await;
}

/// A transfer canceled before its target acknowledged it ends the
/// target's hop, and the delivery kept for a restart goes with it.
#[tokio::test]
async fn a_cancel_ends_an_unacknowledged_transfer_and_drops_its_kept_delivery() {
    let gateway = baton().start().await;
    let triage = handing_on("triage", &["triage"], json!({"to": "silent"})).await;
    let silent = VendorAgent::start("silent", &["refund"], |_| Reply::Silent)
        .await
        .unwrap();
    register(&gateway, "triage", &triage, json!({})).await;
    register(&gateway, "silent", &silent, json!({})).await;
    let message = user_message(&message_id("t"), "refund please");
    let id = start_at_triage(&gateway, message, &silent).await;
    let kept = |id: &str| {
        let record = gateway.ledger.get(id).unwrap().unwrap();
        record.hops.iter().any(|hop| hop.undelivered.is_some())
    };
    assert!(
        kept(&id),
        "the transfer's delivery is kept while unacknowledged"
    );

    cancel_answers_canceled(&gateway, &id).await;
    assert!(!kept(&id), "kept after the cancel");
    let record = gateway.ledger.get(&id).unwrap().unwrap();
    let last = record.hops.last().unwrap();
    assert_eq!(
        (last.agent.as_str(), last.state),
        ("silent", Some(TaskState::Canceled))
    );
    triage.stop().await;
    silent.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn a_deadline_passed_before_the_target_answers_still_reaches_its_task() {
    let gateway = baton().start().await;
    let deadline = chrono::Utc::now() + chrono::Duration::milliseconds(300);
    let control = json!({"urn:baton:handoff:v1": {"deadline": deadline.to_rfc3339()}});
    let (slow, id) = hand_off_to_a_slow_agent(&gateway, control).await;
    assert_its_task_was_canceled(&slow).await;
    let task = get_task(&gateway, &id).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_FAILED", "{task}");
    assert_eq!(reason(&task), "DEADLINE_EXCEEDED");
    slow.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn a_return_leg_past_its_ack_timeout_leaves_the_source_task_alone() {
    let gateway = baton().tune(quick_ladder).start().await;
    // Triage waits for the result on its own task, then answers it late.
    let triage = VendorAgent::start("triage", &["triage"], |turn| {
        if turn.task_id.is_none() {
            let to = json!({"toSkill": "refund"});
            return triage_hands_off_for_result(to, TaskState::InputRequired);
        }
        Reply::Late(Duration::from_millis(900), Box::new(Reply::Working))
    })
    .await
    .unwrap();
    let billing = register_with_billing(&gateway, &triage).await;
    let task = send_to_triage(&gateway, "r", "refund please").await;
    assert_eq!(task["status"]["state"], "TASK_STATE_FAILED", "{task}");
    assert_eq!(reason(&task), "TARGET_UNAVAILABLE");
    // Both late answers are in: each continued triage's own task, which
    // no attempt created, and which the gateway task still holds.
    for _ in 0..100 {
        let answered = triage.sends().len();
        if answered >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(triage.cancels(), [], "the source's task was left alone");
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// A source that finished its own task as it handed off gets the result as
/// a new task in its own context, which need not be the gateway's: this
/// triage names its contexts itself.
#[tokio::test]
async fn a_result_returns_to_a_finished_sources_own_context() {
    let gateway = baton().start().await;
    let triage = VendorAgent::start(
        "triage",
        &["triage"],
        triage_closing_the_case(json!({"to": "billing"}), TaskState::Completed),
    )
    .await
    .unwrap();
    triage.mint_own_contexts();
    let billing = register_with_billing(&gateway, &triage).await;
    let task = send_to_triage(&gateway, "ctx", "refund please").await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    let sends = triage.sends();
    assert_eq!(sends.len(), 2, "{task}");
    let returned = &sends[1].params["message"];
    assert!(returned.get("taskId").is_none(), "a new task: {returned}");
    let context = returned["contextId"].as_str().unwrap_or_default();
    assert!(!context.is_empty(), "{returned}");
    assert_ne!(
        context, task["contextId"],
        "the gateway's context, not triage's"
    );
    assert_ne!(context, sends[0].params["message"]["contextId"]);
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn a_return_leg_to_a_finished_source_cancels_the_tasks_it_abandoned() {
    let gateway = baton().tune(quick_ladder).start().await;
    // Triage finished its own task when it handed off; the result comes
    // back as a new task, which it answers late.
    let triage = VendorAgent::start("triage", &["triage"], |turn| {
        if data_of(&turn.message.parts, HANDOFF_RESULT_MEDIA_TYPE).is_some() {
            return Reply::Late(Duration::from_millis(900), Box::new(Reply::Working));
        }
        triage_hands_off_for_result(json!({"toSkill": "refund"}), TaskState::Completed)
    })
    .await
    .unwrap();
    let billing = register_with_billing(&gateway, &triage).await;
    let task = send_to_triage(&gateway, "r", "refund please").await;
    assert_eq!(task["status"]["state"], "TASK_STATE_FAILED", "{task}");
    assert_eq!(reason(&task), "TARGET_UNAVAILABLE");
    // Each late return created a task at triage that nothing took up.
    let mut canceled = canceled_tasks(&triage, 2).await;
    canceled.dedup();
    assert_eq!(canceled.len(), 2, "{canceled:?}");
    for id in canceled {
        assert_eq!(triage.task(&id).unwrap().status.state, TaskState::Canceled);
    }
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn a_deadline_cancels_a_non_baton_target_within_a_second() {
    let gateway = baton().start().await;
    let slow = VendorAgent::start("slow", &["refund"], |_| Reply::Working)
        .await
        .unwrap();
    register(&gateway, "slow", &slow, json!({})).await;
    let deadline = chrono::Utc::now() + chrono::Duration::milliseconds(1500);
    let mut message = handoff_message(handoff_payload("triage", json!({"to": "slow"}), json!({})));
    message["metadata"] = json!({"urn:baton:handoff:v1": {
        "deadline": deadline.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
    }});
    let reply = gateway
        .call(
            "SendMessage",
            json!({"message": message, "configuration": {"returnImmediately": true}}),
        )
        .await;
    let accepted = &reply.result()["task"];
    assert_eq!(accepted["status"]["state"], "TASK_STATE_SUBMITTED");
    let id = accepted["id"].as_str().unwrap().to_string();
    // The target took the work: WORKING until the deadline.
    let task = gateway
        .wait_for_state("/a2a", &id, "TASK_STATE_WORKING")
        .await;
    assert_eq!(task["status"]["state"], "TASK_STATE_WORKING", "{task}");
    let task = gateway
        .wait_for_state("/a2a", &id, "TASK_STATE_FAILED")
        .await;
    assert_eq!(reason(&task), "DEADLINE_EXCEEDED", "{task}");
    let cancels = slow.cancels();
    assert_eq!(cancels.len(), 1, "the target got one CancelTask");
    let late = cancels[0].1 - deadline;
    assert!(
        late < chrono::Duration::seconds(1) && late > chrono::Duration::milliseconds(-50),
        "CancelTask {late} after the deadline"
    );
    slow.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn a_deadline_also_ends_a_task_waiting_for_input() {
    let gateway = baton().start().await;
    let asker = VendorAgent::start("asker", &["refund"], |_| {
        Reply::AskInput("which card?".into())
    })
    .await
    .unwrap();
    register(&gateway, "asker", &asker, json!({})).await;
    let deadline = chrono::Utc::now() + chrono::Duration::milliseconds(800);
    let mut message = user_message(&message_id("d"), "refund");
    message["metadata"] = json!({"urn:baton:handoff:v1": {
        "deadline": deadline.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
    }});
    let task = send(&gateway, "/agents/asker/a2a", message).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_INPUT_REQUIRED");
    let task = gateway
        .wait_for_state("/a2a", task["id"].as_str().unwrap(), "TASK_STATE_FAILED")
        .await;
    assert_eq!(reason(&task), "DEADLINE_EXCEEDED", "{task}");
    assert_eq!(asker.cancels().len(), 1);
    asker.stop().await;
    gateway.stop().await;
}

/// An agent's own hop limit binds the work it takes up by a transfer, as
/// it does work sent to it first: past it the next transfer is refused.
#[tokio::test]
async fn an_agents_own_hop_limit_binds_a_transfer_to_it() {
    let gateway = baton().start().await;
    let triage = handing_on("triage", &["triage"], json!({"to": "b"})).await;
    let b = handing_on("b", &["b"], json!({"to": "c"})).await;
    let c = handing_on("c", &["c"], json!({"to": "d"})).await;
    let d = VendorAgent::start("d", &["d"], |_| refund()).await.unwrap();
    register(&gateway, "triage", &triage, json!({})).await;
    register(&gateway, "b", &b, json!({"maxHops": 3})).await;
    register(&gateway, "c", &c, json!({})).await;
    register(&gateway, "d", &d, json!({})).await;
    let task = send_to_triage(&gateway, "hops", "hand it on").await;
    assert_eq!(task["status"]["state"], "TASK_STATE_REJECTED", "{task}");
    assert_eq!(reason(&task), "HOP_LIMIT_EXCEEDED", "{task}");
    assert_eq!(d.sends().len(), 0, "d is past b's limit");
    assert_eq!(c.sends().len(), 1, "c is within it");
    for agent in [triage, b, c, d] {
        agent.stop().await;
    }
    gateway.stop().await;
}

/// The same for a reroute: the alternative's own hop limit binds the work
/// from there on, as it would have had it been the first choice.
#[tokio::test]
async fn an_agents_own_hop_limit_binds_a_reroute_to_it() {
    let gateway = baton().tune(quick_ladder).start().await;
    let silent = VendorAgent::start("silent", &["refund"], |_| Reply::Silent)
        .await
        .unwrap();
    let billing = handing_on("billing", &["refund"], json!({"to": "ledger"})).await;
    let ledger = VendorAgent::start("ledger", &["book"], |_| refund())
        .await
        .unwrap();
    register(&gateway, "silent", &silent, json!({})).await;
    register(&gateway, "billing", &billing, json!({"maxHops": 1})).await;
    register(&gateway, "ledger", &ledger, json!({})).await;

    let task = refund_by_skill(&gateway, "/agents/silent/a2a").await;
    assert_eq!(task["status"]["state"], "TASK_STATE_REJECTED", "{task}");
    assert_eq!(reason(&task), "HOP_LIMIT_EXCEEDED", "{task}");
    assert_eq!(sends_to(&billing), 1, "rerouted to billing");
    assert_eq!(sends_to(&ledger), 0, "ledger is past billing's limit");
    for agent in [silent, billing, ledger] {
        agent.stop().await;
    }
    gateway.stop().await;
}

/// A W3C `tracestate` with two vendors' entries.
const TRACE_STATE: &str = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7";

#[tokio::test]
async fn one_trace_id_reaches_the_third_agent_of_a_chain() {
    let gateway = baton().start().await;
    let triage = handing_on("triage", &["triage"], json!({"to": "billing"})).await;
    let billing = handing_on("billing", &["refund"], json!({"toSkill": "diagnose"})).await;
    let technical = VendorAgent::start("technical", &["diagnose"], |_| Reply::Complete {
        text: Some("fixed".into()),
        artifacts: vec![],
    })
    .await
    .unwrap();
    for (id, agent) in [
        ("triage", &triage),
        ("billing", &billing),
        ("technical", &technical),
    ] {
        register(&gateway, id, agent, json!({})).await;
    }
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "SendMessage",
        "params": {"message": user_message(&message_id("tr"), "my card was charged twice and the app crashes")}});
    let response = gateway
        .http
        .post(gateway.url("/agents/triage/a2a"))
        .header("content-type", "application/json")
        .header("a2a-version", "1.0")
        .header("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"))
        .header("tracestate", TRACE_STATE)
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let reply: Value = response.json().await.unwrap();
    let task = &reply["result"]["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{reply}");
    let seen = technical
        .sends()
        .into_iter()
        .next()
        .expect("the third agent was reached");
    assert!(
        seen.headers["traceparent"].contains(trace_id),
        "{:?}",
        seen.headers
    );
    // The vendors' trace state goes with the trace, unchanged, to every hop.
    for agent in [&triage, &technical] {
        let first = &agent.received()[0];
        assert_eq!(
            first.headers["tracestate"], TRACE_STATE,
            "{:?}",
            first.headers
        );
    }
    let control = &seen.params["message"]["metadata"]["urn:baton:handoff:v1"];
    assert_eq!(control["traceId"], trace_id);
    assert_eq!(control["traceState"], TRACE_STATE);
    assert_eq!(control["chain"], json!(["triage", "billing", "technical"]));
    assert_eq!(control["hops"], 3);
    let record = gateway
        .ledger
        .get(task["id"].as_str().unwrap())
        .unwrap()
        .unwrap();
    let agents: Vec<_> = record.hops.iter().map(|h| h.agent.as_str()).collect();
    assert_eq!(agents, ["triage", "billing", "technical"]);
    // `baton trace` lists every hop, with the trace id.
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_baton"))
        .args([
            "trace",
            task["id"].as_str().unwrap(),
            "--url",
            &gateway.base,
        ])
        .output()
        .await
        .unwrap();
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{printed}");
    for needle in ["triage", "billing", "technical", "transfer", trace_id] {
        assert!(
            printed.contains(needle),
            "{needle} missing from:\n{printed}"
        );
    }
    for agent in [triage, billing, technical] {
        agent.stop().await;
    }
    gateway.stop().await;
}

/// Reports an artifact of its own and, in the same breath, hands the task
/// to `to` (as `reporter`).
struct ReportThenTransfer {
    card: baton::protocol::AgentCard,
    to: &'static str,
}

#[async_trait::async_trait]
impl baton::agents::Agent for ReportThenTransfer {
    fn card(&self) -> &baton::protocol::AgentCard {
        &self.card
    }

    async fn execute(
        &self,
        _: baton::agents::AgentRequest,
        events: baton::agents::AgentEvents,
    ) -> Result<(), baton::agents::AgentError> {
        let report = baton::protocol::Artifact {
            artifact_id: "triage-notes".into(),
            name: "notes".into(),
            parts: vec![Part::text("the charge was made twice")],
            ..baton::protocol::Artifact::default()
        };
        events.artifact(report).await;
        let mut transfer = Part::data(handoff_payload(
            "reporter",
            json!({"to": self.to}),
            json!({}),
        ));
        transfer.media_type = HANDOFF_MEDIA_TYPE.into();
        let message = baton::protocol::Message::agent(vec![transfer]);
        events.status(TaskState::Completed, Some(message)).await;
        Ok(())
    }
}

#[tokio::test]
async fn a_transfer_keeps_the_artifacts_reported_with_it() {
    let card = common::agents::card("reporter");
    let gateway = baton()
        .agent("reporter", ReportThenTransfer { card, to: "echo" })
        .start()
        .await;
    let task = send_until(
        &gateway,
        "/agents/reporter/a2a",
        user_message(&message_id("t"), "please sort out my refund"),
        "TASK_STATE_COMPLETED",
    )
    .await;
    let artifacts: Vec<&str> = task["artifacts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a["artifactId"].as_str())
        .collect();
    assert!(artifacts.contains(&"triage-notes"), "{task}");
    gateway.stop().await;
}

/// How many SendMessage calls `agent` received.
fn sends_to(agent: &VendorAgent) -> usize {
    agent.sends().len()
}

#[tokio::test]
async fn a_skill_handoff_skips_agents_in_its_parent_task_chain() {
    let gateway = baton().start().await;
    let alpha = VendorAgent::start("alpha", &["audit"], |_| refund())
        .await
        .unwrap();
    let beta = VendorAgent::start("beta", &["audit"], |_| refund())
        .await
        .unwrap();
    register(&gateway, "alpha", &alpha, json!({})).await;
    register(&gateway, "beta", &beta, json!({})).await;
    // alpha held the parent task, so it is in every child's chain.
    let parent = send(
        &gateway,
        "/agents/alpha/a2a",
        user_message(&message_id("p"), "audit this"),
    )
    .await;
    let parent_id = parent["id"].as_str().unwrap();
    for n in 0..4 {
        let mut message = handoff_message(handoff_payload(
            "triage",
            json!({"toSkill": "audit"}),
            json!({}),
        ));
        message["metadata"] = json!({"urn:baton:handoff:v1": {"parentTaskId": parent_id}});
        let task = send(&gateway, "/a2a", message).await;
        assert_eq!(
            task["status"]["state"], "TASK_STATE_COMPLETED",
            "{n}: {task}"
        );
    }
    assert_eq!(sends_to(&alpha), 1, "only the parent's own call");
    assert_eq!(sends_to(&beta), 4);
    alpha.stop().await;
    beta.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn a_skill_handoff_skips_agents_already_in_the_chain() {
    let gateway = baton().start().await;
    // Triage also refunds, but it held the work before billing did.
    let triage = handing_on("triage", &["triage", "refund"], json!({"to": "billing"})).await;
    let billing = handing_on("billing", &["refund"], json!({"toSkill": "refund"})).await;
    let refunds = VendorAgent::start("refunds", &["refund"], |_| refund())
        .await
        .unwrap();
    for (id, agent) in [
        ("triage", &triage),
        ("billing", &billing),
        ("refunds", &refunds),
    ] {
        register(&gateway, id, agent, json!({})).await;
    }

    // Turns taken between the skill's agents land on each in turn: every
    // transfer must still reach the one outside the chain.
    for n in 0..4 {
        let message = user_message(&message_id(&format!("c{n}")), "refund please");
        let task = send(&gateway, "/agents/triage/a2a", message).await;
        assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    }
    // So must a direct handoff whose control names an agent of the skill.
    for n in 0..4 {
        let mut message = handoff_message(handoff_payload(
            "triage",
            json!({"toSkill": "refund"}),
            json!({}),
        ));
        message["metadata"] = json!({"urn:baton:handoff:v1": {"hops": 1, "chain": ["billing"]}});
        let task = send(&gateway, "/a2a", message).await;
        assert_eq!(
            task["status"]["state"], "TASK_STATE_COMPLETED",
            "{n}: {task}"
        );
    }
    // And one whose chain comes in the Baton-* headers only.
    for n in 0..4 {
        let message = handoff_message(handoff_payload(
            "triage",
            json!({"toSkill": "refund"}),
            json!({}),
        ));
        let body = json!({"jsonrpc": "2.0", "id": n, "method": "SendMessage", "params": {"message": message}});
        let mut headers = STANDARD_HEADERS.to_vec();
        headers.extend([("baton-hops", "1"), ("baton-chain", "billing")]);
        let reply = gateway.post_raw("/a2a", body.to_string(), &headers).await;
        assert_eq!(
            reply.result()["task"]["status"]["state"],
            "TASK_STATE_COMPLETED",
            "{n}: {}",
            reply.body
        );
    }
    assert_eq!(sends_to(&refunds), 12);
    assert_eq!(sends_to(&triage), 4, "triage was only the first hop");
    for agent in [triage, billing, refunds] {
        agent.stop().await;
    }
    gateway.stop().await;
}

#[tokio::test]
async fn a_skill_whose_agents_all_failed_their_health_check_is_still_tried() {
    let gateway = baton().start().await;
    let billing = VendorAgent::start("billing", &["refund"], |_| refund())
        .await
        .unwrap();
    register(&gateway, "billing", &billing, json!({})).await;
    gateway.gateway.directory().set_healthy("billing", false);

    let task = refund_by_skill(&gateway, "/a2a").await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(sends_to(&billing), 1);
    billing.stop().await;
    gateway.stop().await;
}

/// A `toSkill` payload on an agent's own endpoint goes to that agent, even
/// when it failed its health check and another agent with the skill did not.
#[tokio::test]
async fn a_skill_payload_on_an_agents_endpoint_goes_to_it_whatever_its_health() {
    let gateway = baton().start().await;
    let (refunds, billing) = (
        VendorAgent::start("refunds", &["refund"], |_| refund())
            .await
            .unwrap(),
        VendorAgent::start("billing", &["refund"], |_| refund())
            .await
            .unwrap(),
    );
    register(&gateway, "refunds", &refunds, json!({})).await;
    register(&gateway, "billing", &billing, json!({})).await;
    gateway.gateway.directory().set_healthy("billing", false);

    let task = refund_by_skill(&gateway, "/agents/billing/a2a").await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!((sends_to(&billing), sends_to(&refunds)), (1, 0));
    refunds.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// Triage hands its task to billing for the result, waiting on its own
/// task; billing works on and on. Returns both and the gateway task's id.
async fn handed_on_for_its_result(
    gateway: &TestBaton,
    metadata: Value,
) -> (VendorAgent, VendorAgent, String) {
    let triage = VendorAgent::start("triage", &["triage"], |_| {
        triage_hands_off_for_result(json!({"toSkill": "refund"}), TaskState::InputRequired)
    })
    .await
    .unwrap();
    let billing = VendorAgent::start("billing", &["refund"], |_| Reply::Working)
        .await
        .unwrap();
    register(gateway, "triage", &triage, json!({})).await;
    register(gateway, "billing", &billing, json!({})).await;
    let mut message = user_message(&message_id("r"), "refund please");
    message["metadata"] = metadata;
    let id = start_at_triage(gateway, message, &billing).await;
    assert_eq!(sends_to(&billing), 1, "billing holds the task");
    (triage, billing, id)
}

#[tokio::test]
async fn a_cancel_ends_the_task_its_source_keeps_waiting_for_the_result() {
    let gateway = baton().start().await;
    let (triage, billing, id) = handed_on_for_its_result(&gateway, Value::Null).await;
    cancel_answers_canceled(&gateway, &id).await;
    assert_its_task_was_canceled(&billing).await;
    assert_its_task_was_canceled(&triage).await;
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

#[tokio::test]
async fn a_deadline_ends_the_task_its_source_keeps_waiting_for_the_result() {
    let gateway = baton().start().await;
    let deadline = chrono::Utc::now() + chrono::Duration::milliseconds(600);
    let control = json!({"urn:baton:handoff:v1": {"deadline": deadline.to_rfc3339()}});
    let (triage, billing, id) = handed_on_for_its_result(&gateway, control).await;
    assert_its_task_was_canceled(&billing).await;
    assert_its_task_was_canceled(&triage).await;
    let task = get_task(&gateway, &id).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_FAILED", "{task}");
    assert_eq!(reason(&task), "DEADLINE_EXCEEDED");
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// A result can return to its source while a CancelTask waits for the
/// holder's answer: the source then holds the task, its own task resumed,
/// and is asked to cancel it too, whether the old holder answers that it
/// canceled or that its task (now finished) cannot be. A holder whose
/// "cannot be" comes before its result returns does not keep the task
/// from being canceled either: a source waits for that result.
#[tokio::test]
async fn a_cancel_reaches_the_source_a_result_returned_to_meanwhile() {
    for (refuses, answers_at_once) in [(false, false), (true, false), (true, true)] {
        cancel_while_the_result_returns(refuses, answers_at_once).await;
    }
}

/// A holder can answer a CancelTask that its task cannot be canceled (it
/// ended) before the gateway has its end: when that end hands the task on
/// for good, the task is not over, and the cancel goes on to the new holder.
#[tokio::test]
async fn a_cancel_follows_a_handoff_its_holder_made_as_it_refused() {
    let payload = handoff_payload("triage", json!({"to": "billing"}), json!({}));
    let triage = common::agents::HandsOnWhenCanceled::new("triage", payload);
    let gateway = baton().agent("triage", triage).start().await;
    let billing = VendorAgent::start("billing", &["refund"], |_| Reply::Working)
        .await
        .unwrap();
    register(&gateway, "billing", &billing, json!({})).await;
    let message = user_message(&message_id("r"), "refund please");
    let triage_works =
        |record: &baton::store::TaskRecord| record.task.status.state == TaskState::Working;
    let id = start_at_triage_until(&gateway, message, triage_works).await;

    cancel_answers_canceled(&gateway, &id).await;
    let record = gateway.ledger.get(&id).unwrap().unwrap();
    assert_eq!(record.agent, "billing", "the handoff was recorded");
    let task = get_task(&gateway, &id).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_CANCELED", "{task}");
    // The cancel may stop the handoff's send before it leaves; one that
    // reached billing is canceled there.
    tokio::time::sleep(Duration::from_millis(300)).await;
    if sends_to(&billing) > 0 {
        assert_its_task_was_canceled(&billing).await;
    }
    billing.stop().await;
    gateway.stop().await;
}

/// Holders that each hand the task on as they refuse a cancel are asked
/// in turn, four at most: the gateway then cancels the task, and tells the
/// holder it has then, whose own handoff never happens.
#[tokio::test]
async fn a_cancel_asks_at_most_four_holders_that_hand_on_as_they_refuse() {
    let chain = ["triage", "b", "c", "d", "e", "f"];
    let mut builder = baton();
    let mut cancels = Vec::new();
    for pair in chain.windows(2) {
        let payload = handoff_payload(pair[0], json!({"to": pair[1]}), json!({}));
        let agent = common::agents::HandsOnWhenCanceled::new(pair[0], payload);
        cancels.push(agent.cancels.clone());
        builder = builder.agent(pair[0], agent);
    }
    let gateway = builder.start().await;
    let message = user_message(&message_id("r"), "refund please");
    let working =
        |record: &baton::store::TaskRecord| record.task.status.state == TaskState::Working;
    let id = start_at_triage_until(&gateway, message, working).await;

    cancel_answers_canceled(&gateway, &id).await;
    let record = gateway.ledger.get(&id).unwrap().unwrap();
    assert_eq!(record.agent, "e", "four holders asked, the fifth told");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let asked: Vec<usize> = cancels
        .iter()
        .map(|c| c.load(std::sync::atomic::Ordering::Relaxed))
        .collect();
    assert_eq!(asked, [1, 1, 1, 1, 1], "each holder gets one CancelTask");
    assert_eq!(record.task.status.state, TaskState::Canceled);
    gateway.stop().await;
}

async fn cancel_while_the_result_returns(refuses: bool, answers_at_once: bool) {
    let billing = common::agents::FinishesOnCancel::new("billing", refuses);
    let gateway = baton().agent("billing", billing.handle()).start().await;
    let triage = VendorAgent::start("triage", &["triage"], |turn| {
        if turn.task_id.is_some() {
            return Reply::Working;
        }
        triage_hands_off_for_result(json!({"to": "billing"}), TaskState::InputRequired)
    })
    .await
    .unwrap();
    register(&gateway, "triage", &triage, json!({})).await;
    let message = user_message(&message_id("r"), "refund please");
    let billing_holds = |record: &baton::store::TaskRecord| record.agent == "billing";
    let id = start_at_triage_until(&gateway, message, billing_holds).await;

    // Billing finishes as the cancel reaches it; the cancel is answered
    // at once, or only once the result is back at triage.
    if answers_at_once {
        billing.answer.notify_one();
    }
    let result_returned = async {
        if answers_at_once {
            return;
        }
        for _ in 0..250 {
            if sends_to(&triage) == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        billing.answer.notify_one();
    };
    let (canceled, ()) = tokio::join!(
        gateway.call("CancelTask", json!({"id": id})),
        result_returned
    );
    if !answers_at_once {
        assert_eq!(sends_to(&triage), 2, "the result returned to triage");
    }
    assert_eq!(
        canceled.result()["status"]["state"],
        "TASK_STATE_CANCELED",
        "refuses {refuses}, at once {answers_at_once}: {}",
        canceled.body
    );
    assert_its_task_was_canceled(&triage).await;
    triage.stop().await;
    gateway.stop().await;
}

/// The messages a transfer's target got in the history part of its first
/// message (FULL and LAST_N), as their texts.
fn history_texts(billing: &VendorAgent) -> Vec<String> {
    let first = billing
        .sends()
        .into_iter()
        .next()
        .expect("billing got the work");
    let parts = first.params["message"]["parts"].as_array().unwrap().clone();
    let history = parts
        .iter()
        .find(|part| part["mediaType"] == "application/vnd.baton.history.v1+json")
        .unwrap_or_else(|| panic!("no history part in {parts:?}"));
    history["data"]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            m["parts"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect()
}

/// A transfer's target gets the conversation by the payload's context
/// policy (DESIGN.md §3.2): FULL every earlier message, LAST_N the last n.
#[tokio::test]
async fn a_transfer_carries_the_conversation_by_its_context_policy() {
    let mut got = Vec::new();
    for context in [
        json!({"policy": "FULL"}),
        json!({"policy": "LAST_N", "lastN": 1}),
    ] {
        let gateway = baton().start().await;
        // Triage asks which invoice, then hands the work on.
        let target = json!({"to": "billing", "context": context});
        let triage = VendorAgent::start("triage", &["triage"], move |turn| {
            if turn.task_id.is_none() {
                Reply::AskInput("Which invoice?".into())
            } else {
                Reply::Handoff {
                    payload: handoff_payload("triage", target.clone(), json!({})),
                    state: TaskState::Completed,
                }
            }
        })
        .await
        .unwrap();
        let billing = register_with_billing(&gateway, &triage).await;
        let asked = send_to_triage(&gateway, "n", "I was charged twice").await;
        assert_eq!(
            asked["status"]["state"], "TASK_STATE_INPUT_REQUIRED",
            "{asked}"
        );
        let answer = user_message_on(&asked["id"], &message_id("n"), "INV-0342");
        let done = send(&gateway, "/agents/triage/a2a", answer).await;
        assert_eq!(done["status"]["state"], "TASK_STATE_COMPLETED", "{done}");
        got.push(history_texts(&billing));
        triage.stop().await;
        billing.stop().await;
        gateway.stop().await;
    }
    let (full, last) = (&got[0], &got[1]);
    assert!(
        full.len() >= 3,
        "the ask, the question and the answer: {full:?}"
    );
    assert_eq!(
        full.first().map(String::as_str),
        Some("I was charged twice")
    );
    assert_eq!(last, &["INV-0342"], "LAST_N 1: only the answer");
    assert_eq!(last.last(), full.last());
}

/// An agency's own `ackTimeoutMs` shortens the gateway's: the ladder gives
/// up on its silent agent within that, not the gateway's 5 s per attempt.
#[tokio::test]
async fn an_agents_registered_ack_timeout_shortens_the_gateways() {
    let gateway = baton()
        .tune(|settings| settings.retry_delay = Duration::from_millis(200))
        .start()
        .await;
    let silent = VendorAgent::start("silent", &["refund"], |_| Reply::Silent)
        .await
        .unwrap();
    register(&gateway, "silent", &silent, json!({"ackTimeoutMs": 300})).await;

    let started = std::time::Instant::now();
    let task = refund_by_skill(&gateway, "/agents/silent/a2a").await;
    assert_retried_then_unavailable(&gateway, &task).await;
    // Two attempts at the gateway's 5 s would take 10 s.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    silent.stop().await;
    gateway.stop().await;
}

/// Results an agent reports with its transfer count toward the task's size
/// like any report: past `--max-task-bytes` the transfer does not happen and
/// the task fails.
#[tokio::test]
async fn a_transfer_bringing_results_past_the_size_limit_fails_the_task() {
    transfer_past_a_limit_fails_the_task(false, TaskLimit::Bytes).await;
}

/// The same when the transfer is the agent's first report, which creates
/// the task: it is created with the caller's message alone.
#[tokio::test]
async fn a_first_report_transferring_past_the_size_limit_fails_the_task() {
    transfer_past_a_limit_fails_the_task(true, TaskLimit::Bytes).await;
}

/// And for their count: past `--max-task-events` the same.
#[tokio::test]
async fn a_transfer_bringing_results_past_the_event_limit_fails_the_task() {
    transfer_past_a_limit_fails_the_task(false, TaskLimit::Events).await;
}

#[tokio::test]
async fn a_first_report_transferring_past_the_event_limit_fails_the_task() {
    transfer_past_a_limit_fails_the_task(true, TaskLimit::Events).await;
}

/// `triage` transfers with results past `limit`, `at_once` or after
/// reporting WORKING: 2 × 600 KiB under 1 MiB, or 30 under 20 events.
async fn transfer_past_a_limit_fails_the_task(at_once: bool, limit: TaskLimit) {
    let payload = handoff_payload("triage", json!({"to": "echo"}), json!({}));
    let ((artifacts, bytes), tune, reason): (_, fn(&mut GatewaySettings), _) = match limit {
        TaskLimit::Bytes => (
            (2, 600 * 1024),
            |settings| settings.max_task_bytes = 1024 * 1024,
            "TASK_SIZE_EXCEEDED",
        ),
        TaskLimit::Events => (
            (30, 16),
            |settings| settings.max_task_events = 20,
            "EVENT_LIMIT_EXCEEDED",
        ),
    };
    let mut triage =
        common::agents::TransfersWithArtifacts::new("triage", payload, artifacts, bytes);
    if at_once {
        triage = triage.at_once();
    }
    let gateway = baton().agent("triage", triage).tune(tune).start().await;
    let task = gateway.send_fails_with("triage", reason).await;
    assert!(task.get("artifacts").is_none(), "the results were kept");
    let record = gateway
        .ledger
        .get(task["id"].as_str().unwrap())
        .unwrap()
        .unwrap();
    assert_eq!(record.agent, "triage", "no transfer");
    gateway.stop().await;
}

/// A transfer's target asked a question under its own shorter deadline; once
/// its result went back, the source's own deadline holds again, also for a
/// question the source asks after that target's deadline passed.
#[tokio::test]
async fn a_targets_shorter_deadline_does_not_fail_its_source_after_the_return() {
    let gateway = baton().start().await;
    let triage = VendorAgent::start("triage", &["triage"], |turn| {
        if turn.task_id.is_none() {
            return Reply::Handoff {
                payload: handoff_payload(
                    "triage",
                    json!({"toSkill": "refund"}),
                    json!({"returnToParent": true}),
                ),
                state: TaskState::InputRequired,
            };
        }
        Reply::AskInput("Anything else?".into())
    })
    .await
    .unwrap();
    let billing = billing_asking_first().await;
    register(&gateway, "triage", &triage, json!({})).await;
    register(
        &gateway,
        "billing",
        &billing,
        json!({"taskTimeoutMs": 1000}),
    )
    .await;

    let task = send_to_triage(&gateway, "r", "refund please").await;
    assert_eq!(
        task["status"]["state"], "TASK_STATE_INPUT_REQUIRED",
        "{task}"
    );
    let id = task["id"].as_str().unwrap();
    let answer = user_message_on(id, &message_id("a"), "the second one");
    let task = send(&gateway, "/a2a", answer).await;
    assert_eq!(
        task["status"]["state"], "TASK_STATE_INPUT_REQUIRED",
        "{task}"
    );
    assert_eq!(artifact_names(&task), ["refund"], "{task}");

    // Past billing's deadline, triage's question still waits.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let task = get_task(&gateway, id).await;
    assert_eq!(
        task["status"]["state"], "TASK_STATE_INPUT_REQUIRED",
        "{task}"
    );
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// A source that ended its own task at the agent after handing off (for
/// its result) refuses the result into it: the result goes as a new task
/// in that task's context, and the caller's task completes with it.
#[tokio::test]
async fn a_result_returns_as_a_new_task_when_the_sources_own_task_ended() {
    let gateway = baton().start().await;
    let triage = VendorAgent::start(
        "triage",
        &["triage"],
        triage_closing_the_case(json!({"to": "billing"}), TaskState::InputRequired),
    )
    .await
    .unwrap();
    let billing = billing_asking_first().await;
    register(&gateway, "triage", &triage, json!({})).await;
    register(&gateway, "billing", &billing, json!({})).await;

    let task = send_to_triage(&gateway, "r", "refund please").await;
    assert_eq!(
        task["status"]["state"], "TASK_STATE_INPUT_REQUIRED",
        "{task}"
    );
    // Triage gives up waiting and closes its task meanwhile.
    assert_eq!(triage.complete_open_tasks(), 1);
    let id = task["id"].as_str().unwrap();
    let answer = user_message_on(id, &message_id("a"), "the second one");
    let task = send(&gateway, "/a2a", answer).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    assert_eq!(artifact_names(&task), ["refund", "case"], "{task}");
    // The first: the task; the second, refused: into it; the third: anew.
    let sends = triage.sends();
    assert_eq!(sends.len(), 3, "{sends:?}");
    let [first, refused, returned] = [0, 1, 2].map(|i| &sends[i].params["message"]);
    assert!(refused.get("taskId").is_some(), "{refused}");
    assert!(returned.get("taskId").is_none(), "a new task: {returned}");
    assert_eq!(returned["contextId"], first["contextId"], "{returned}");
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}

/// A transfer's target with a lower maxHops of its own binds its own work
/// only: once its result went back, the source hands on under the task's
/// limit again.
#[tokio::test]
async fn a_targets_lower_hop_limit_does_not_bind_its_source_after_the_return() {
    let gateway = baton().start().await;
    let triage = VendorAgent::start("triage", &["triage"], |turn| {
        let (to, returns, state) = match turn.task_id {
            None => ("billing", true, TaskState::InputRequired),
            Some(_) => ("echo", false, TaskState::Completed),
        };
        let extra = json!({"returnToParent": returns});
        let payload = handoff_payload("triage", json!({"to": to}), extra);
        Reply::Handoff { payload, state }
    })
    .await
    .unwrap();
    let billing = VendorAgent::start("billing", &["refund"], |_| refund())
        .await
        .unwrap();
    register(&gateway, "triage", &triage, json!({})).await;
    register(&gateway, "billing", &billing, json!({"maxHops": 2})).await;

    let task = send_to_triage(&gateway, "r", "refund please").await;
    // triage, billing (maxHops 2), back to triage, then echo: hop 4 of 5.
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    let control = &task["metadata"]["urn:baton:handoff:v1"];
    assert_eq!(
        control["chain"],
        json!(["triage", "billing", "triage", "echo"])
    );
    assert_eq!(control["maxHops"], 5, "{control}");
    triage.stop().await;
    billing.stop().await;
    gateway.stop().await;
}
