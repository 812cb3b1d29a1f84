//! The closed-loop load generator: N workers, each on its own keep-alive
//! connection, send a request, wait for the whole answer, and send the next,
//! for a warm-up and then a measured window, bounded in time and count.
//! Latencies go into an HDR histogram.

use crate::client::{Connection, count_events, find};
use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::BodyExt as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Builds request number `n`: the path and the body.
pub type RequestFn = dyn Fn(u64) -> (&'static str, Bytes) + Send + Sync;

/// One load point.
pub struct LoadSpec {
    /// Where to send.
    pub addr: SocketAddr,
    /// Workers, one connection each.
    pub concurrency: usize,
    /// Unmeasured lead-in (connections open, caches warm).
    pub warmup: Duration,
    /// The measured window.
    pub duration: Duration,
    /// Most requests measured, whatever the window.
    pub max_requests: u64,
    /// The requests.
    pub request: Arc<RequestFn>,
    /// Bytes a good answer contains (e.g. `"result"`).
    pub expect: &'static [u8],
}

impl LoadSpec {
    /// Slice `round` of `slices` cutting this point's window, for loads
    /// measured alternately (merged with [`LoadResult::absorb`]): the first
    /// slice has the whole warm-up, later ones a share of it, to warm what
    /// the other load's slice left cold.
    pub fn slice(&self, round: u32, slices: u32) -> Self {
        let slices = slices.max(1);
        Self {
            addr: self.addr,
            concurrency: self.concurrency,
            warmup: if round == 0 {
                self.warmup
            } else {
                self.warmup / slices
            },
            duration: self.duration / slices,
            max_requests: self.max_requests / u64::from(slices),
            request: self.request.clone(),
            expect: self.expect,
        }
    }
}

/// What a load point measured.
pub struct LoadResult {
    /// Good answers in the window.
    pub completed: u64,
    /// Failed or unexpected answers in the window.
    pub errors: u64,
    /// SSE events received in the window.
    pub events: u64,
    /// The window's actual length.
    pub elapsed: Duration,
    /// Latency of good answers, in nanoseconds.
    pub latency: Histogram<u64>,
}

impl LoadResult {
    /// Good answers per second.
    pub fn throughput(&self) -> f64 {
        self.completed as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// SSE events per second.
    pub fn events_per_second(&self) -> f64 {
        self.events as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// The latency at `quantile` (0..=1).
    pub fn quantile(&self, quantile: f64) -> Duration {
        Duration::from_nanos(self.latency.value_at_quantile(quantile))
    }

    /// Adds `other`'s answers, window and latencies to this result, as if
    /// one load point had run through both windows.
    pub fn absorb(&mut self, other: &LoadResult) {
        self.completed += other.completed;
        self.errors += other.errors;
        self.events += other.events;
        self.elapsed += other.elapsed;
        self.latency
            .add(&other.latency)
            .expect("latency histograms share one range");
    }

    /// No answers yet: what [`LoadResult::absorb`] adds to.
    pub fn empty() -> Self {
        Self {
            completed: 0,
            errors: 0,
            events: 0,
            elapsed: Duration::ZERO,
            latency: latency_histogram(),
        }
    }

    /// `12 345 req/s, p50 … p99 … p999 …`.
    pub fn summary(&self) -> String {
        let errors = if self.errors > 0 {
            format!(", {} errors", self.errors)
        } else {
            String::new()
        };
        format!(
            "{:.0} req/s, p50 {}, p99 {}, p999 {}{errors}",
            self.throughput(),
            format_duration(self.quantile(0.50)),
            format_duration(self.quantile(0.99)),
            format_duration(self.quantile(0.999)),
        )
    }
}

/// A new latency histogram: 1 µs to 60 s, 3 significant digits, in ns.
pub fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1_000, 60_000_000_000, 3).expect("valid histogram bounds")
}

/// Records `elapsed` in `histogram`, clamped to its range.
pub fn record(histogram: &mut Histogram<u64>, elapsed: Duration) {
    let nanos = (elapsed.as_nanos() as u64).clamp(histogram.low(), histogram.high());
    histogram.saturating_record(nanos);
}

/// `850 µs`, `1.23 ms`, `2.1 s`.
pub fn format_duration(duration: Duration) -> String {
    let micros = duration.as_secs_f64() * 1e6;
    if micros < 1000.0 {
        format!("{micros:.0} µs")
    } else if micros < 1e6 {
        format!("{:.2} ms", micros / 1e3)
    } else {
        format!("{:.2} s", micros / 1e6)
    }
}

/// Runs one load point. `on_window` is called at the start and the end of
/// the measured window (e.g. to read a process's CPU time).
pub async fn run(spec: &LoadSpec, mut on_window: impl FnMut()) -> LoadResult {
    let start = Instant::now();
    let window_start = start + spec.warmup;
    let window_end = window_start + spec.duration;
    let measured = Arc::new(AtomicU64::new(0));
    let next_request = Arc::new(AtomicU64::new(1));
    let mut workers = Vec::with_capacity(spec.concurrency);
    for _ in 0..spec.concurrency {
        let worker = Worker {
            addr: spec.addr,
            request: spec.request.clone(),
            expect: spec.expect,
            window_start,
            window_end,
            max_requests: spec.max_requests,
            measured: measured.clone(),
            next_request: next_request.clone(),
        };
        workers.push(tokio::spawn(worker.run()));
    }
    tokio::time::sleep_until(window_start.into()).await;
    on_window();
    let mut result = LoadResult::empty();
    for worker in workers {
        if let Ok(tally) = worker.await {
            result.completed += tally.completed;
            result.errors += tally.errors;
            result.events += tally.events;
            let _ = result.latency.add(&tally.latency);
        }
    }
    on_window();
    // A count-bounded run ends before the window does.
    result.elapsed = Instant::now()
        .min(window_end)
        .saturating_duration_since(window_start);
    result
}

struct Worker {
    addr: SocketAddr,
    request: Arc<RequestFn>,
    expect: &'static [u8],
    window_start: Instant,
    window_end: Instant,
    max_requests: u64,
    measured: Arc<AtomicU64>,
    next_request: Arc<AtomicU64>,
}

struct Tally {
    completed: u64,
    errors: u64,
    events: u64,
    latency: Histogram<u64>,
}

impl Worker {
    async fn run(self) -> Tally {
        let mut tally = Tally {
            completed: 0,
            errors: 0,
            events: 0,
            latency: latency_histogram(),
        };
        let mut connection: Option<Connection> = None;
        loop {
            let sent = Instant::now();
            if sent >= self.window_end {
                break;
            }
            let in_window = sent >= self.window_start;
            if in_window && self.measured.fetch_add(1, Ordering::Relaxed) >= self.max_requests {
                break;
            }
            if connection.is_none() {
                match Connection::open(self.addr).await {
                    Ok(opened) => connection = Some(opened),
                    Err(_) => {
                        tally.errors += u64::from(in_window);
                        // Refused: do not spin while the server recovers.
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                }
            }
            let Some(open) = connection.as_mut() else {
                continue;
            };
            let n = self.next_request.fetch_add(1, Ordering::Relaxed);
            let (path, body) = (self.request)(n);
            let answer = match open.post(path, body).await {
                Ok(response) if response.status().is_success() => response
                    .into_body()
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .ok(),
                _ => None,
            };
            let good = answer
                .as_ref()
                .filter(|bytes| find(bytes, self.expect).is_some());
            if !in_window {
                if answer.is_none() {
                    connection = None;
                }
                continue;
            }
            match good {
                Some(bytes) => {
                    record(&mut tally.latency, sent.elapsed());
                    tally.completed += 1;
                    tally.events += count_events(bytes);
                }
                None => {
                    tally.errors += 1;
                    if answer.is_none() {
                        connection = None;
                    }
                }
            }
        }
        tally
    }
}

/// Bytes of one JSON-RPC request.
pub fn json_rpc(id: u64, method: &str, params: &str) -> Bytes {
    Bytes::from(format!(
        r#"{{"jsonrpc":"2.0","id":{id},"method":"{method}","params":{params}}}"#
    ))
}

/// The `params` of a message send with a fresh messageId.
pub fn message_params(message_id_prefix: &str, extra: &str) -> String {
    format!(
        r#"{{"message":{{"messageId":"{message_id_prefix}{}","role":"ROLE_USER","parts":[{{"text":"hi"}}]}}{extra}}}"#,
        uuid::Uuid::new_v4()
    )
}
