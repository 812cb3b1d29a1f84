//! `baton demo`: the point of Baton in one command.
//!
//! Three vendor agents that know nothing of Baton (`triage`, `billing`,
//! `technical`) run on loopback behind an in-process Baton with a fresh
//! ledger. A customer's request goes to triage; triage hands the work to
//! billing by a *transfer* (DESIGN.md §3.3); the caller keeps one gateway task,
//! which should end COMPLETED with a `refund` artifact typed by the handoff's
//! `returnSchema`. The demo prints that task, its chain and its trace, and
//! says plainly when the gateway did not do its part.

pub mod trace;
pub mod vendor;

use crate::config::{Config, ServeArgs};
use crate::handoff::payload::find_payload;
use crate::protocol::{
    HANDOFF_EXTENSION, Message, PROTOCOL_VERSION, Part, PartContent, SendMessageResponse, Task,
    TaskState,
};
use anyhow::{Context as _, anyhow};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use vendor::{Reply, Turn, VendorAgent};

pub use trace::print_trace;

/// What the customer asks.
pub const CUSTOMER_REQUEST: &str =
    "I was charged twice for my March invoice, please refund the duplicate";

/// A technical problem, which triage sends on by skill rather than by name.
const TECHNICAL_REQUEST: &str = "The app crashes when I open my invoice settings";

/// Longest the blocking SendMessage may take (also Baton's task timeout).
const TASK_TIMEOUT_SECS: u64 = 30;

/// Runs the demo; exit 0 when the refund came back as a typed artifact.
pub async fn run() -> ExitCode {
    if std::env::var_os("RUST_LOG").is_some() {
        crate::telemetry::init(crate::config::LogFormat::Text);
    }
    match run_demo().await {
        Ok(Verdict::Transferred) => {
            println!(
                "\nOK: one gateway task, handed from triage to billing, came back with a typed refund."
            );
            ExitCode::SUCCESS
        }
        Ok(Verdict::NotTransferred(why)) => {
            println!("\nNOT OK: {why}");
            ExitCode::FAILURE
        }
        Err(err) => {
            eprintln!("baton demo: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// How the refund run ended.
enum Verdict {
    Transferred,
    NotTransferred(String),
}

async fn run_demo() -> anyhow::Result<Verdict> {
    let scratch = ScratchDir::new()?;
    let triage = VendorAgent::start("triage", &["triage"], triage).await?;
    let billing = VendorAgent::start("billing", &["billing", "refunds"], billing).await?;
    let technical = VendorAgent::start("technical", &["troubleshooting"], technical).await?;
    let vendors = [&triage, &billing, &technical];

    let cards = scratch.path().join("agent-cards");
    std::fs::create_dir_all(&cards)?;
    for agent in vendors {
        let card = agent.card();
        std::fs::write(
            cards.join(format!("{}.json", card.name)),
            serde_json::to_vec_pretty(&card)?,
        )?;
    }
    let config = demo_config(scratch.path(), &cards)?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
    let base = format!("http://{}", listener.local_addr()?);
    let stop = CancellationToken::new();
    let baton = tokio::spawn(crate::launch::run(
        config,
        listener,
        stop.clone().cancelled_owned(),
    ));

    wait_ready(&base).await?;

    println!("\nBaton demo: three vendor agents, one gateway, one task.\n");
    for agent in vendors {
        let card = agent.card();
        let skills: Vec<_> = card.skills.iter().map(|s| s.id.as_str()).collect();
        println!(
            "  vendor agent {:<10} {}  skills: {}",
            card.name,
            agent.url(),
            skills.join(", ")
        );
    }
    println!("  baton                   {base}  (fresh ledger in a temp dir)\n");

    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(TASK_TIMEOUT_SECS + 5))
        .build()?;
    let outcome = refund_run(&client, &base).await;
    if outcome.is_ok() {
        skill_run(&client, &base).await;
        println!("\nWhat the vendor agents received (they read only A2A and the Baton-* headers):");
        for agent in vendors {
            println!("  {}", vendor_view(agent));
        }
    }

    stop.cancel();
    match tokio::time::timeout(Duration::from_secs(15), baton).await {
        Ok(Ok(Err(err))) => eprintln!("baton stopped with an error: {err:#}"),
        Ok(Err(err)) => eprintln!("baton panicked: {err}"),
        Err(_) => eprintln!("baton did not stop within 15 s"),
        Ok(Ok(Ok(()))) => {}
    }
    triage.stop().await;
    billing.stop().await;
    technical.stop().await;
    outcome
}

/// The configuration `baton serve` would build from flags: everything in
/// `dir`, loopback upstreams allowed, no keys, no `./baton.toml`.
fn demo_config(dir: &Path, cards: &Path) -> anyhow::Result<Config> {
    let empty_config = dir.join("baton.toml");
    std::fs::write(&empty_config, "")?;
    let args = ServeArgs {
        listen: Some("127.0.0.1:0".into()),
        data: Some(dir.join("data")),
        default_agent: Some("triage".into()),
        allow_upstream: Some(vec!["127.0.0.1".into(), "::1".into()]),
        config: Some(empty_config),
        agent_cards: Some(cards.to_path_buf()),
        keys_file: Some(dir.join("baton-keys.json")),
        task_timeout_secs: Some(TASK_TIMEOUT_SECS),
        shutdown_grace_secs: Some(2),
        ..ServeArgs::default()
    };
    Config::load(&args, &crate::launch::builtin_agent_ids()).map_err(|err| anyhow!("{err}"))
}

/// The customer's refund request: to triage, and (once transfers exist) on to
/// billing within the same gateway task.
async fn refund_run(client: &reqwest::Client, base: &str) -> anyhow::Result<Verdict> {
    println!("user → /agents/triage/a2a: {CUSTOMER_REQUEST:?}");
    let reply = send(
        client,
        &format!("{base}/agents/triage/a2a"),
        CUSTOMER_REQUEST,
    )
    .await?;
    let task = match reply {
        SendMessageResponse::Task(task) => task,
        SendMessageResponse::Message(message) => {
            return Ok(Verdict::NotTransferred(format!(
                "triage answered with a message and no task: {}",
                trace::summary(&message)
            )));
        }
    };
    // A fresh read from the ledger: what any later GetTask would see.
    let task = get_task(client, base, &task.id).await?;

    println!("\ngateway task: {}", task.id);
    println!("final state:  {}", proto_name(task.status.state));
    match refund(&task) {
        Some(refund) => println!("refund:       {refund}"),
        None => println!("refund:       (no artifact named \"refund\")"),
    }
    let control = task
        .metadata
        .as_ref()
        .and_then(|metadata| metadata.get(HANDOFF_EXTENSION))
        .cloned()
        .unwrap_or(Value::Null);
    println!(
        "trace id:     {}",
        control["traceId"].as_str().unwrap_or("-")
    );
    println!("hops:         {}", control["hops"]);
    println!("chain:        {}", chain(&control).join(" → "));
    println!("\ntrace:");
    print_trace(base, &task.id).await;

    Ok(verdict(&task, &chain(&control)))
}

/// A second, shorter line of work: triage hands a technical problem to
/// whichever agent declares the `troubleshooting` skill.
async fn skill_run(client: &reqwest::Client, base: &str) {
    println!("\nuser → /agents/triage/a2a: {TECHNICAL_REQUEST:?}");
    let task = match send(
        client,
        &format!("{base}/agents/triage/a2a"),
        TECHNICAL_REQUEST,
    )
    .await
    {
        Ok(SendMessageResponse::Task(task)) => task,
        Ok(SendMessageResponse::Message(message)) => {
            return println!("  a message, no task: {}", trace::summary(&message));
        }
        Err(err) => return println!("  failed: {err:#}"),
    };
    let control = task
        .metadata
        .as_ref()
        .and_then(|metadata| metadata.get(HANDOFF_EXTENSION))
        .cloned()
        .unwrap_or(Value::Null);
    let chain = chain(&control);
    println!(
        "  gateway task {}  {}  chain {}",
        task.id,
        proto_name(task.status.state),
        chain.join(" → ")
    );
    if !chain.iter().any(|agent| agent == "technical") {
        println!(
            "  transfer not performed: triage asked for toSkill \"troubleshooting\", technical never got the task"
        );
    }
}

/// Success, or why not, in words.
fn verdict(task: &Task, chain: &[String]) -> Verdict {
    if task.status.state == TaskState::Completed && refund(task).is_some() {
        return Verdict::Transferred;
    }
    let handoff_in_status = task
        .status
        .message
        .as_ref()
        .is_some_and(|message| handoff_payload(message).is_some());
    if handoff_in_status && !chain.iter().any(|agent| agent == "billing") {
        return Verdict::NotTransferred(
            "transfer not performed: triage answered with a handoff to billing, and the gateway \
             completed the task with that answer instead of moving it to billing"
                .into(),
        );
    }
    Verdict::NotTransferred(format!(
        "the task ended {} without a typed refund artifact",
        proto_name(task.status.state)
    ))
}

/// The data of the artifact named `refund`, if it has the fields the
/// handoff's `returnSchema` asks for.
fn refund(task: &Task) -> Option<Value> {
    task.artifacts
        .iter()
        .filter(|artifact| artifact.name == "refund")
        .flat_map(|artifact| &artifact.parts)
        .find_map(|part| match &part.content {
            PartContent::Data(data)
                if ["refundId", "amount", "currency"]
                    .iter()
                    .all(|field| data.get(field).is_some()) =>
            {
                Some(data.clone())
            }
            _ => None,
        })
}

fn chain(control: &Value) -> Vec<String> {
    control["chain"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|agent| agent.as_str().map(str::to_owned))
        .collect()
}

fn proto_name(state: TaskState) -> String {
    serde_json::to_value(state)
        .ok()
        .and_then(|name| name.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// One line per vendor agent: its messages with the control headers they
/// carried, and how often it was polled.
fn vendor_view(agent: &VendorAgent) -> String {
    let mut calls: Vec<(String, usize)> = Vec::new();
    for call in agent.received() {
        let header = |name: &str| call.headers.get(name).cloned().unwrap_or("-".into());
        let line = match call.method.as_str() {
            "SendMessage" => format!(
                "SendMessage (Baton-Hops {}, Baton-Chain {})",
                header("baton-hops"),
                header("baton-chain")
            ),
            other => other.to_owned(),
        };
        match calls.iter_mut().find(|(seen, _)| *seen == line) {
            Some((_, count)) => *count += 1,
            None => calls.push((line, 1)),
        }
    }
    let calls: Vec<String> = calls
        .into_iter()
        .map(|(line, count)| format!("{count} × {line}"))
        .collect();
    let name = agent.card().name;
    if calls.is_empty() {
        format!("{name:<10} nothing")
    } else {
        format!("{name:<10} {}", calls.join(", "))
    }
}

/// Waits until the in-process Baton answers `/readyz` (its start-up
/// registers the vendor cards first).
pub(crate) async fn wait_ready(base: &str) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    for _ in 0..200 {
        let ready = client.get(format!("{base}/readyz")).send().await;
        if ready.is_ok_and(|response| response.status().is_success()) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(anyhow!("baton at {base} was not ready within 10 s"))
}

async fn send(
    client: &reqwest::Client,
    url: &str,
    text: &str,
) -> anyhow::Result<SendMessageResponse> {
    let message = json!({
        "messageId": uuid::Uuid::new_v4().to_string(),
        "role": "ROLE_USER",
        "parts": [{"text": text}],
    });
    let result = rpc(client, url, "SendMessage", json!({"message": message})).await?;
    serde_json::from_value(result).context("reading the SendMessage result")
}

async fn get_task(client: &reqwest::Client, base: &str, id: &str) -> anyhow::Result<Task> {
    let result = rpc(client, &format!("{base}/a2a"), "GetTask", json!({"id": id})).await?;
    serde_json::from_value(result).context("reading the GetTask result")
}

/// One A2A JSON-RPC call; a JSON-RPC error becomes an `Err`.
async fn rpc(
    client: &reqwest::Client,
    url: &str,
    method: &str,
    params: Value,
) -> anyhow::Result<Value> {
    let reply: Value = client
        .post(url)
        .header("A2A-Version", PROTOCOL_VERSION)
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}))
        .send()
        .await
        .with_context(|| format!("{method} to {url}"))?
        .json()
        .await
        .with_context(|| format!("{method} reply from {url}"))?;
    match reply.get("result") {
        Some(result) => Ok(result.clone()),
        None => Err(anyhow!("{method} to {url} failed: {}", reply["error"])),
    }
}

/// Triage: billing matters go to `billing` by name, technical ones to any
/// agent with the `troubleshooting` skill; anything else needs a question.
fn triage(turn: &Turn) -> Reply {
    let text = turn.message.text().to_lowercase();
    let mentions = |words: &[&str]| words.iter().any(|word| text.contains(word));
    if mentions(&["crash", "error", "bug"]) {
        Reply::Handoff {
            payload: json!({
                "handoffId": "hf_demo_2",
                "from": "triage",
                "toSkill": "troubleshooting",
                "reason": "capability_boundary",
                "goal": "Find out why the app crashes on the invoice settings page",
                "summary": "The customer's app crashes when opening invoice settings.",
            }),
            state: TaskState::Completed,
        }
    } else if mentions(&["charged", "refund", "invoice"]) {
        Reply::Handoff {
            payload: refund_handoff(),
            state: TaskState::Completed,
        }
    } else {
        Reply::AskInput("Is this about a bill or about a technical problem?".into())
    }
}

/// Triage's transfer of the refund to billing, with the result's shape.
fn refund_handoff() -> Value {
    json!({
        "handoffId": "hf_demo_1",
        "from": "triage",
        "to": "billing",
        "reason": "specialization",
        "goal": "Refund the duplicate March charge",
        "summary": "The customer was charged twice for the March invoice INV-0342 (42.00 EUR) and asks for the duplicate to be refunded.",
        "keyFacts": {"invoice": "INV-0342", "amount": 42.0, "currency": "EUR"},
        "returnSchema": {
            "type": "object",
            "required": ["refundId", "amount", "currency"],
            "properties": {
                "refundId": {"type": "string", "pattern": "^rf_"},
                "amount": {"type": "number", "exclusiveMinimum": 0},
                "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
            },
        },
        "context": {"policy": "SUMMARY"},
    })
}

/// Billing: refunds what the handoff's key facts name; without a handoff it
/// must ask, since it has no other way to know the invoice.
fn billing(turn: &Turn) -> Reply {
    let facts = handoff_payload(&turn.message).map(|payload| payload["keyFacts"].clone());
    let amount = facts.as_ref().and_then(|facts| facts["amount"].as_f64());
    let currency = facts.as_ref().and_then(|facts| facts["currency"].as_str());
    match (amount, currency) {
        (Some(amount), Some(currency)) => {
            let id = uuid::Uuid::new_v4().simple().to_string();
            Reply::artifact(
                "refund",
                json!({"refundId": format!("rf_{}", &id[..12]), "amount": amount, "currency": currency}),
            )
        }
        _ => Reply::AskInput("Which invoice and amount should I refund?".into()),
    }
}

/// Technical: a fixed diagnosis.
fn technical(_: &Turn) -> Reply {
    Reply::Complete {
        text: Some("Cleared the corrupted settings cache; the page opens again.".into()),
        artifacts: vec![crate::protocol::Artifact {
            artifact_id: uuid::Uuid::new_v4().to_string(),
            name: "diagnosis".into(),
            parts: vec![Part::text("settings cache corrupted; cleared")],
            ..Default::default()
        }],
    }
}

/// The handoff payload a message carries: a data part of the handoff media
/// type (or, leniently, any data part with a `handoffId`).
fn handoff_payload(message: &Message) -> Option<&Value> {
    find_payload(message).or_else(|| {
        message.parts.iter().find_map(|part| match &part.content {
            PartContent::Data(data) if data.get("handoffId").is_some() => Some(data),
            _ => None,
        })
    })
}

/// A directory under the system temp dir, removed when dropped.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new() -> std::io::Result<Self> {
        let path = std::env::temp_dir().join(format!("baton-demo-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&path)?;
        Ok(Self(path))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handoff::payload::PayloadValidator;

    #[test]
    fn the_refund_handoff_is_a_valid_payload() {
        let problems = PayloadValidator::shared().validate(&refund_handoff());
        assert!(problems.is_ok(), "{problems:?}");
    }
}
