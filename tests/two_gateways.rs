//! Two Baton processes in series (DESIGN.md §3.1): gateway A forwards to
//! gateway B, whose agent hands the work back to an agent behind A. The hop
//! limit and cycle detection hold across both gateways, and `baton trace`
//! lists the hops of a task.

mod common;
#[path = "common/process.rs"]
mod process;

use baton::demo::vendor::{Received, Reply, VendorAgent};
use baton::protocol::TaskState;
use common::{handoff_message, handoff_payload, message_id, reason, user_message};
use process::BatonProcess;
use serde_json::{Value, json};

fn gateway(data: &std::path::Path) -> BatonProcess {
    BatonProcess::builder(data)
        .args(["--allow-upstream", "127.0.0.0/8,::1"])
        .start()
}

/// The card `gateway` publishes for its agent `id`.
async fn published(gateway: &BatonProcess, id: &str) -> Value {
    let (status, card) = gateway
        .get_json(&format!("/agents/{id}/.well-known/agent-card.json"))
        .await;
    assert!(status.is_success(), "card of {id}: {status}");
    card
}

async fn register(gateway: &BatonProcess, id: &str, card: Value) {
    gateway
        .registry("RegisterAgent", json!({"id": id, "card": card}))
        .await;
}

/// An agent that completes every task with `text`.
async fn completing(name: &str, skill: &str, text: &'static str) -> VendorAgent {
    VendorAgent::start(name, &[skill], move |_| Reply::Complete {
        text: Some(text.into()),
        artifacts: vec![],
    })
    .await
    .unwrap()
}

/// The first SendMessage `agent` received, and its handoff control.
fn first_send(agent: &VendorAgent) -> (Received, Value) {
    let seen = agent
        .sends()
        .into_iter()
        .next()
        .expect("the agent was reached through both gateways");
    let control = seen.params["message"]["metadata"]["urn:baton:handoff:v1"].clone();
    (seen, control)
}

async fn send(gateway: &BatonProcess, path: &str, text: &str, metadata: Value) -> Value {
    let mut message = user_message(&message_id("g"), text);
    message["metadata"] = metadata;
    let reply = gateway
        .rpc(path, "SendMessage", json!({"message": message}))
        .await;
    assert!(reply.get("error").is_none(), "{reply}");
    reply["result"]["task"].clone()
}

#[tokio::test]
async fn hop_limits_and_cycles_hold_across_two_gateways() {
    // `x` lives behind A; `relay` behind B hands the work back toward A.
    let x = completing("x", "finish", "finished behind A").await;
    let relay = VendorAgent::start("relay", &["relay"], |turn| {
        let to = if turn.message.text().contains("cycle") {
            "back"
        } else {
            "onward"
        };
        Reply::Handoff {
            payload: json!({
                "handoffId": format!("hf_{}", uuid::Uuid::new_v4()),
                "from": "relay", "to": to, "reason": "specialization",
                "goal": "Finish the work behind gateway A.", "summary": "Relayed once.",
                "context": {"policy": "STRUCTURED"},
            }),
            state: TaskState::Completed,
        }
    })
    .await
    .unwrap();

    let dir_a = tempfile::tempdir().unwrap();
    let dir_b = tempfile::tempdir().unwrap();
    let a = gateway(dir_a.path());
    let b = gateway(dir_b.path());
    register(&a, "x", serde_json::to_value(x.card()).unwrap()).await;
    register(&b, "relay", serde_json::to_value(relay.card()).unwrap()).await;
    // A reaches B's relay as `bgw`; B reaches A's `bgw` as `back` (a way
    // round the loop) and A's `x` as `onward`.
    register(&a, "bgw", published(&b, "relay").await).await;
    register(&b, "back", published(&a, "bgw").await).await;
    register(&b, "onward", published(&a, "x").await).await;

    // A → B → relay → back to A's x: three hops, within the default limit.
    let task = send(&a, "/agents/bgw/a2a", "please finish", json!({})).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    let (seen, control) = first_send(&x);
    assert_eq!(control["chain"], json!(["bgw", "relay", "onward", "x"]));
    assert_eq!(control["hops"], 4);
    assert_eq!(seen.headers["baton-hops"], "4");

    // The same route with maxHops 3 set by the client: A refuses the last hop.
    let task = send(
        &a,
        "/agents/bgw/a2a",
        "please finish",
        json!({"urn:baton:handoff:v1": {"maxHops": 3}}),
    )
    .await;
    assert_eq!(task["status"]["state"], "TASK_STATE_REJECTED", "{task}");
    assert_eq!(reason(&task), "HOP_LIMIT_EXCEEDED", "{task}");

    // relay hands to `back`, which is A's `bgw` again: A sees the cycle.
    let task = send(&a, "/agents/bgw/a2a", "cycle", json!({})).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_REJECTED", "{task}");
    assert_eq!(reason(&task), "HANDOFF_CYCLE", "{task}");
    assert_eq!(x.sends().len(), 1, "refused work never reached x");

    // `baton trace` on B lists both hops of B's task: relay, then onward.
    let b_tasks = b.call("ListTasks", json!({})).await;
    let transferred = b_tasks["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["metadata"]["urn:baton:handoff:v1"]["chain"][2] == "onward")
        .expect("B's task of the first run")
        .clone();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_baton"))
        .args([
            "trace",
            transferred["id"].as_str().unwrap(),
            "--url",
            &b.base,
        ])
        .output()
        .unwrap();
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{printed}");
    assert!(
        printed.contains("relay") && printed.contains("onward"),
        "{printed}"
    );
    assert!(printed.contains("transfer"), "{printed}");

    relay.stop().await;
    x.stop().await;
}

#[tokio::test]
async fn a_gateway_may_reach_an_agent_under_the_id_it_has_behind_the_other() {
    // `billing` lives behind B; A publishes B's `billing` under the same id.
    let billing = completing("billing", "refunds", "refunded behind B").await;
    let dir_a = tempfile::tempdir().unwrap();
    let dir_b = tempfile::tempdir().unwrap();
    let a = gateway(dir_a.path());
    let b = gateway(dir_b.path());
    register(&b, "billing", serde_json::to_value(billing.card()).unwrap()).await;
    register(&a, "billing", published(&b, "billing").await).await;

    // One agent reached through two gateways: two hops, no cycle.
    let task = send(&a, "/agents/billing/a2a", "refund me", json!({})).await;
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{task}");
    let (_, control) = first_send(&billing);
    assert_eq!(control["chain"], json!(["billing"]));
    assert_eq!(control["hops"], 2);

    // Work that left the agent for another and comes back is a cycle still.
    let task = send(
        &a,
        "/agents/billing/a2a",
        "again",
        json!({"urn:baton:handoff:v1": {"chain": ["billing", "triage"], "hops": 2}}),
    )
    .await;
    assert_eq!(task["status"]["state"], "TASK_STATE_REJECTED", "{task}");
    assert_eq!(reason(&task), "HANDOFF_CYCLE", "{task}");

    // A handoff to it, which A routes and B receives with its payload, is
    // the same delivery one hop on, not a cycle either.
    let payload = handoff_payload("triage", json!({"to": "billing"}), json!({}));
    let message = json!({"message": handoff_message(payload)});
    let reply = a.rpc("/a2a", "SendMessage", message).await;
    let task = &reply["result"]["task"];
    assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED", "{reply}");
    let handed = billing.sends().into_iter().last().unwrap();
    let control = &handed.params["message"]["metadata"]["urn:baton:handoff:v1"];
    assert_eq!(control["chain"], json!(["billing"]), "{control}");
    assert_eq!(control["hops"], 2);
}
