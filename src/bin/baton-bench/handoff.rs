//! The handoff figure: one two-hop transfer (DESIGN.md §3.3, way 2) with a
//! typed artifact, against two direct calls to the same two agents.
//!
//! `transfer-source` completes its own task with a handoff payload naming
//! `typed-target` and a `returnSchema`; a gateway that transfers moves the
//! same gateway task to `typed-target`, whose data artifact must satisfy the
//! schema. A gateway that does not transfer completes the task with the
//! source's payload message, and [`measure_transfer`] says so.

use crate::client::Connection;
use crate::load::{json_rpc, message_params};
use crate::upstream::AgentKind;
use anyhow::Context as _;
use bytes::Bytes;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The transfer source's JSON-RPC path through Baton.
const SOURCE_THROUGH_BATON: &str = "/agents/transfer-source/a2a";

/// What the handoff figure found.
pub enum TransferOutcome {
    /// The gateway did not transfer; why it is thought so.
    NotAvailable(String),
    /// Median times over the samples.
    Measured {
        /// Samples taken.
        samples: usize,
        /// One blocking SendMessage through Baton, transfer included.
        through: Duration,
        /// SendMessage to the source, then to the target, directly.
        direct_pair: Duration,
    },
}

/// Whether a gateway task came back transferred: COMPLETED, with the
/// target's typed artifact (`amount`) on it.
pub fn is_transferred(task: &serde_json::Value) -> bool {
    let completed = task["status"]["state"] == "TASK_STATE_COMPLETED";
    let typed = task["artifacts"].as_array().is_some_and(|artifacts| {
        artifacts.iter().any(|artifact| {
            artifact["parts"]
                .as_array()
                .is_some_and(|parts| parts.iter().any(|part| part["data"]["amount"].is_number()))
        })
    });
    completed && typed
}

/// Tries one transfer through Baton; when it works, times `samples` of them
/// against the two direct calls.
pub async fn measure_transfer(
    baton: SocketAddr,
    upstream: SocketAddr,
    samples: usize,
) -> anyhow::Result<TransferOutcome> {
    let mut through_baton = Connection::open(baton).await?;
    let first = send(&mut through_baton, SOURCE_THROUGH_BATON, 0).await?;
    let task = &first.1["result"]["task"];
    if !is_transferred(task) {
        let state = task["status"]["state"]
            .as_str()
            .unwrap_or("no task")
            .to_string();
        return Ok(TransferOutcome::NotAvailable(format!(
            "gateway returned {state} without the target's typed artifact: transfers not supported"
        )));
    }
    let mut direct = Connection::open(upstream).await?;
    let mut through_times = Vec::with_capacity(samples);
    let mut direct_times = Vec::with_capacity(samples);
    for n in 1..=samples as u64 {
        let (elapsed, reply) = send(&mut through_baton, SOURCE_THROUGH_BATON, n).await?;
        anyhow::ensure!(
            is_transferred(&reply["result"]["task"]),
            "transfer {n} did not complete with a typed artifact: {reply}"
        );
        through_times.push(elapsed);
        let (source, _) = send(&mut direct, AgentKind::TransferSource.path(), n).await?;
        let (target, _) = send(&mut direct, AgentKind::TypedTarget.path(), n).await?;
        direct_times.push(source + target);
    }
    Ok(TransferOutcome::Measured {
        samples,
        through: median(&mut through_times),
        direct_pair: median(&mut direct_times),
    })
}

/// One blocking SendMessage: how long it took, and the reply.
async fn send(
    connection: &mut Connection,
    path: &str,
    id: u64,
) -> anyhow::Result<(Duration, serde_json::Value)> {
    let body: Bytes = json_rpc(id, "SendMessage", &message_params("handoff-", ""));
    let sent = Instant::now();
    let (_, bytes) = tokio::time::timeout(
        crate::client::CALL_TIMEOUT,
        connection.post_whole(path, body),
    )
    .await
    .context("SendMessage timed out")??;
    let elapsed = sent.elapsed();
    Ok((elapsed, serde_json::from_slice(&bytes)?))
}

fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times.get(times.len() / 2).copied().unwrap_or_default()
}
