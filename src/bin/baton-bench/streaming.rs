//! Figures that need tasks held open: SSE fan-out of one task's event to
//! many `SubscribeToTask` streams, and Baton's memory per task in flight.
//! The fast upstream holds a streaming task WORKING until it is released.

use crate::client::{Connection, SseReader, rpc};
use crate::load::{self, json_rpc, latency_histogram, message_params};
use crate::upstream::{FakeUpstream, HOLD_PREFIX, LONG_PREFIX};
use anyhow::{Context as _, bail};
use futures::StreamExt as _;
use hdrhistogram::Histogram;
use serde_json::json;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// Longest any wait of these figures may take.
const WAIT_LIMIT: Duration = Duration::from_secs(60);

/// Connections opened at once: stays well inside the listen backlog.
const OPENING_AT_ONCE: usize = 32;

/// The JSON-RPC path of the streaming upstream agent through Baton.
pub const STREAMING_AGENT_PATH: &str = "/agents/fast-stream/a2a";

/// Creates a task the upstream holds WORKING, without waiting for it
/// (`returnImmediately`), and returns its gateway task id.
pub async fn create_held_task(baton: SocketAddr) -> anyhow::Result<String> {
    let params = message_params(
        HOLD_PREFIX,
        r#","configuration":{"returnImmediately":true}"#,
    );
    let body: serde_json::Value = serde_json::from_str(&format!(
        r#"{{"jsonrpc":"2.0","id":1,"method":"SendMessage","params":{params}}}"#
    ))?;
    let result = rpc(baton, STREAMING_AGENT_PATH, body).await?;
    result["task"]["id"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("SendMessage returned no task: {result}"))
}

/// Streams one task of `chunks` chunks through Baton to its end; returns
/// the events received.
pub async fn long_stream(baton: SocketAddr, chunks: usize) -> anyhow::Result<usize> {
    let params = message_params(&format!("{LONG_PREFIX}{chunks}-"), "");
    let body = json_rpc(1, "SendStreamingMessage", &params);
    let stream = async {
        let mut connection = Connection::open(baton).await?;
        let response = connection.post(STREAMING_AGENT_PATH, body).await?;
        let mut events = SseReader::new(response.into_body());
        let mut received = 0;
        while let Some(event) = events.next_event().await? {
            received += 1;
            if crate::client::find(&event, b"TASK_STATE_COMPLETED").is_some() {
                return Ok(received);
            }
        }
        bail!("the stream ended after {received} events, before the task completed")
    };
    tokio::time::timeout(WAIT_LIMIT, stream).await?
}

/// Waits until `check` holds, polling, for at most [`WAIT_LIMIT`].
async fn wait_until(what: &str, mut check: impl FnMut() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + WAIT_LIMIT;
    while !check() {
        if Instant::now() > deadline {
            bail!("{what}: not reached within {WAIT_LIMIT:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Delivery latency of one event to every subscriber of one task.
pub struct FanOut {
    /// Subscribers that were open when the event was triggered.
    pub subscribers: usize,
    /// Subscribers that received it.
    pub delivered: usize,
    /// From the trigger at the upstream to each subscriber's receipt, in ns.
    pub latency: Histogram<u64>,
}

/// Opens `subscribers` SubscribeToTask streams on one held task, releases
/// the task at the upstream, and times the next event at each subscriber.
/// The latency covers upstream → Baton → durable ledger write → fan-out.
pub async fn fan_out(
    baton: SocketAddr,
    upstream: &FakeUpstream,
    subscribers: usize,
) -> anyhow::Result<FanOut> {
    let task_id = create_held_task(baton).await?;
    wait_until("the upstream holding the task", || upstream.held() >= 1).await?;
    let subscribed = Arc::new(AtomicUsize::new(0));
    let (trigger_tx, trigger_rx) = tokio::sync::watch::channel(None::<Instant>);
    let opening = Arc::new(Semaphore::new(OPENING_AT_ONCE));
    let mut handles = Vec::with_capacity(subscribers);
    for n in 0..subscribers {
        let subscribed = subscribed.clone();
        let opening = opening.clone();
        let mut trigger = trigger_rx.clone();
        let body = json_rpc(
            n as u64,
            "SubscribeToTask",
            &json!({ "id": task_id }).to_string(),
        );
        handles.push(tokio::spawn(async move {
            let subscribe = async {
                let permit = opening.acquire().await?;
                let mut connection = Connection::open(baton).await?;
                let response = connection.post("/a2a", body).await?;
                let mut events = SseReader::new(response.into_body());
                // The first event is the task snapshot: from here on this subscriber is live.
                next_data_event(&mut events).await?;
                drop(permit);
                subscribed.fetch_add(1, Ordering::SeqCst);
                next_data_event(&mut events).await?;
                let received = Instant::now();
                let triggered = *trigger.wait_for(Option::is_some).await?;
                anyhow::Ok(received.saturating_duration_since(triggered.unwrap_or(received)))
            };
            tokio::time::timeout(WAIT_LIMIT * 2, subscribe).await?
        }));
    }
    let all_subscribed = wait_until("every subscriber live", || {
        subscribed.load(Ordering::SeqCst) >= subscribers
    })
    .await;
    let live = subscribed.load(Ordering::SeqCst);
    let _ = trigger_tx.send(Some(Instant::now()));
    upstream.release();
    let mut latency = latency_histogram();
    let mut delivered = 0;
    let mut first_error = None;
    for handle in handles {
        match handle.await? {
            Ok(elapsed) => {
                delivered += 1;
                load::record(&mut latency, elapsed);
            }
            Err(err) => {
                first_error.get_or_insert(err);
            }
        }
    }
    all_subscribed.with_context(|| {
        format!("{live} of {subscribers} subscribed; first failure: {first_error:?}")
    })?;
    if delivered == 0 {
        bail!("no subscriber received the event: {first_error:?}");
    }
    Ok(FanOut {
        subscribers: live,
        delivered,
        latency,
    })
}

/// The next event with a `data:` line (keep-alive comments skipped).
async fn next_data_event(events: &mut SseReader) -> anyhow::Result<()> {
    loop {
        match events.next_event().await? {
            Some(event)
                if event.starts_with(b"data:")
                    || crate::client::find(&event, b"\ndata:").is_some() =>
            {
                return Ok(());
            }
            Some(_) => {}
            None => bail!("the stream ended early"),
        }
    }
}

/// Baton's resident memory before and with tasks held in flight.
pub struct InFlightMemory {
    /// Tasks held.
    pub tasks: usize,
    /// VmRSS before, in KiB.
    pub before_kib: u64,
    /// VmRSS with the tasks in flight, in KiB.
    pub during_kib: u64,
}

impl InFlightMemory {
    /// RSS growth per 1 000 tasks in flight, in KiB.
    pub fn per_thousand_kib(&self) -> f64 {
        (self.during_kib as f64 - self.before_kib as f64) * 1000.0 / self.tasks.max(1) as f64
    }
}

/// Holds `tasks` tasks WORKING at the upstream (each with its upstream
/// stream open through Baton), reads Baton's RSS, then lets them complete.
pub async fn in_flight_memory(
    baton: SocketAddr,
    upstream: &FakeUpstream,
    tasks: usize,
    read_rss_kib: impl Fn() -> anyhow::Result<u64>,
) -> anyhow::Result<InFlightMemory> {
    let before_kib = read_rss_kib()?;
    let created: Vec<anyhow::Result<String>> = futures::stream::iter(0..tasks)
        .map(|_| create_held_task(baton))
        .buffer_unordered(16)
        .collect()
        .await;
    let failed = created.iter().filter(|r| r.is_err()).count();
    let measured = async {
        if let Some(Err(err)) = created.into_iter().find(Result::is_err) {
            bail!("{failed} of {tasks} held tasks failed to start; first: {err:#}");
        }
        wait_until("every task held at the upstream", || {
            upstream.held() >= tasks
        })
        .await?;
        // Let Baton settle (buffers, first events written) before reading.
        tokio::time::sleep(Duration::from_millis(500)).await;
        read_rss_kib()
    }
    .await;
    upstream.release();
    let drained = wait_until("held tasks completing", || upstream.held() == 0).await;
    let during_kib = measured?;
    drained?;
    Ok(InFlightMemory {
        tasks,
        before_kib,
        during_kib,
    })
}
