//! In-process ledger figures: durable state transitions per second with
//! several writers, and filling a ledger directory with completed tasks for
//! Baton to serve afterwards (sled lets one process open it at a time).

use baton::auth::ANONYMOUS;
use baton::protocol::{
    Artifact, Message, Part, Role, StreamResponse, Task, TaskState, TaskStatus,
    TaskStatusUpdateEvent,
};
use baton::store::{Ledger, LedgerError, TaskRecord};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Agent id written into populated tasks (the benchmark's upstream).
const AGENT: &str = "fast";

/// Most task ids kept to query later.
const SAMPLE_LIMIT: u64 = 10_000;

/// Transitions per second measured with some writers.
pub struct TransitionRate {
    /// Durable transitions in the window.
    pub transitions: u64,
    /// The window.
    pub elapsed: Duration,
}

impl TransitionRate {
    /// Transitions per second.
    pub fn per_second(&self) -> f64 {
        self.transitions as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Runs `writers` tasks, each moving its own task WORKING ↔ INPUT_REQUIRED
/// through `Ledger::update` (which returns after the group-commit flush),
/// on a fresh ledger in `dir`, for `duration` or `max_transitions`.
pub async fn transition_rate(
    dir: &Path,
    writers: usize,
    duration: Duration,
    max_transitions: u64,
) -> anyhow::Result<TransitionRate> {
    let ledger = Arc::new(Ledger::open(dir)?);
    let mut task_ids = Vec::with_capacity(writers);
    for _ in 0..writers {
        let task_id = uuid::Uuid::now_v7().to_string();
        let record = new_record(&task_id);
        let first = working_task(&task_id, &record.task.context_id);
        ledger
            .create(record, vec![StreamResponse::Task(first)])
            .await?;
        task_ids.push(task_id);
    }
    let count = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let end = start + duration;
    let mut handles = Vec::with_capacity(writers);
    for task_id in task_ids {
        let (ledger, count) = (ledger.clone(), count.clone());
        handles.push(tokio::spawn(async move {
            let mut state = TaskState::Working;
            while Instant::now() < end && count.load(Ordering::Relaxed) < max_transitions {
                state = match state {
                    TaskState::Working => TaskState::InputRequired,
                    _ => TaskState::Working,
                };
                let event = status_event(&task_id, state);
                ledger
                    .update(&task_id, |_| Ok::<_, LedgerError>(vec![event]))
                    .await?;
                count.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(())
        }));
    }
    for handle in handles {
        handle.await??;
    }
    let elapsed = start.elapsed();
    close(ledger).await;
    Ok(TransitionRate {
        transitions: count.load(Ordering::Relaxed),
        elapsed,
    })
}

/// Adds `count` completed tasks of the anonymous principal to the ledger in
/// `dir` with `writers` concurrent creators; returns up to [`SAMPLE_LIMIT`]
/// of their ids, spread over the whole set.
pub async fn populate(dir: &Path, count: u64, writers: usize) -> anyhow::Result<Vec<String>> {
    let ledger = Arc::new(Ledger::open(dir)?);
    let next = Arc::new(AtomicU64::new(0));
    let stride = count.div_ceil(SAMPLE_LIMIT).max(1);
    let started = Instant::now();
    let mut handles = Vec::with_capacity(writers);
    for _ in 0..writers {
        let (ledger, next) = (ledger.clone(), next.clone());
        handles.push(tokio::spawn(async move {
            let mut sample = Vec::new();
            loop {
                let n = next.fetch_add(1, Ordering::Relaxed);
                if n >= count {
                    break;
                }
                let task_id = uuid::Uuid::now_v7().to_string();
                let record = new_record(&task_id);
                let task = completed_task(&task_id, &record.task.context_id);
                ledger
                    .create(record, vec![StreamResponse::Task(task)])
                    .await?;
                if n % stride == 0 {
                    sample.push(task_id);
                }
                if (n + 1) % (count / 10).max(1) == 0 {
                    eprintln!(
                        "  stored {} of {count} tasks ({:.0} s)",
                        n + 1,
                        started.elapsed().as_secs_f64()
                    );
                }
            }
            anyhow::Ok(sample)
        }));
    }
    let mut sample = Vec::new();
    for handle in handles {
        sample.extend(handle.await??);
    }
    close(ledger).await;
    Ok(sample)
}

/// Closes the ledger once every writer has let go of it.
async fn close(ledger: Arc<Ledger>) {
    ledger.sync().await;
    ledger.close();
    drop(ledger);
}

/// A record before its first event, in a context of its own, minted from
/// the task id as a send without a contextId makes it.
fn new_record(task_id: &str) -> TaskRecord {
    TaskRecord {
        task: Task {
            id: task_id.to_string(),
            context_id: baton::store::keys::new_context_id(task_id),
            ..Task::default()
        },
        owner: ANONYMOUS.to_string(),
        agent: AGENT.to_string(),
        created_at: chrono::Utc::now(),
        ..TaskRecord::default()
    }
}

fn working_task(task_id: &str, context_id: &str) -> Task {
    Task {
        id: task_id.to_string(),
        context_id: context_id.to_string(),
        status: TaskStatus::now(TaskState::Working, None),
        ..Task::default()
    }
}

/// A task as a completed SendMessage leaves it: the user's message, one
/// artifact, COMPLETED.
fn completed_task(task_id: &str, context_id: &str) -> Task {
    let message = Message {
        message_id: uuid::Uuid::new_v4().to_string(),
        context_id: context_id.to_string(),
        task_id: task_id.to_string(),
        role: Role::User,
        parts: vec![Part::text("hi")],
        ..Message::default()
    };
    Task {
        id: task_id.to_string(),
        context_id: context_id.to_string(),
        status: TaskStatus::now(TaskState::Completed, None),
        artifacts: vec![Artifact {
            artifact_id: "a1".into(),
            parts: vec![Part::text("ok")],
            ..Artifact::default()
        }],
        history: vec![message],
        ..Task::default()
    }
}

fn status_event(task_id: &str, state: TaskState) -> StreamResponse {
    StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
        task_id: task_id.to_string(),
        status: TaskStatus::now(state, None),
        ..TaskStatusUpdateEvent::default()
    })
}
