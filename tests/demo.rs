//! `baton demo` as a user runs it: the binary, in an empty directory, to its
//! end. It starts three vendor agents and a Baton of its own on ephemeral
//! loopback ports, so it needs nothing else running.

#[path = "common/process.rs"]
mod process;

use process::{Finished, run_baton};
use std::time::Duration;

/// Longest the whole demo may take.
const DEMO_BOUND: Duration = Duration::from_secs(90);

fn run_demo() -> Finished {
    let dir = tempfile::tempdir().expect("temp dir");
    run_baton(["demo"], dir.path(), DEMO_BOUND)
}

/// The gateway task id the demo printed, if any.
fn gateway_task_id(stdout: &str) -> Option<String> {
    let line = stdout
        .lines()
        .find(|line| line.starts_with("gateway task: "))?;
    let id = line.trim_start_matches("gateway task: ").trim();
    uuid::Uuid::parse_str(id).ok().map(|_| id.to_owned())
}

#[test]
fn demo_runs_to_the_end_and_prints_the_task_id() {
    let finished = run_demo();
    assert!(
        gateway_task_id(&finished.stdout).is_some(),
        "no gateway task id in:\n{}\n{}",
        finished.stdout,
        finished.stderr
    );
    assert!(
        finished.stdout.contains("\nOK: ") || finished.stdout.contains("\nNOT OK: "),
        "no verdict in:\n{}\n{}",
        finished.stdout,
        finished.stderr
    );
    // 0 once transfers are merged, 1 ("transfer not performed") before.
    assert!(
        matches!(finished.status.code(), Some(0 | 1)),
        "{:?}\n{}",
        finished.status,
        finished.stderr
    );
}

#[test]
fn demo_transfers_to_billing() {
    let finished = run_demo();
    let out = &finished.stdout;
    assert!(finished.status.success(), "{out}\n{}", finished.stderr);
    assert!(gateway_task_id(out).is_some(), "{out}");
    assert!(out.contains("final state:  TASK_STATE_COMPLETED"), "{out}");
    let refund = out
        .lines()
        .find_map(|line| line.strip_prefix("refund:       "))
        .unwrap_or_else(|| panic!("no refund line in:\n{out}"));
    let refund: serde_json::Value = serde_json::from_str(refund).expect("refund is JSON");
    assert!(
        refund["refundId"]
            .as_str()
            .is_some_and(|id| id.starts_with("rf_")),
        "{refund}"
    );
    assert_eq!(refund["amount"], 42.0);
    assert_eq!(refund["currency"], "EUR");
    assert!(out.contains("chain:        triage → billing"), "{out}");
    assert!(out.contains("hops:         2"), "{out}");
    assert!(!out.contains("transfer not performed"), "{out}");
}
