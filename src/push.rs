//! Push notifications: every durable event of a task is POSTed, as one
//! `StreamResponse`, to each webhook configured for the task. Notifications
//! are queued in memory; the ledger keeps how far each config's were handled,
//! so that a start sends each config whose task went further one
//! notification of the task as it is ([`PushDispatcher::catch_up`]).
//!
//! Events enter a bounded queue per shard (a task always maps to the same
//! shard). The shard reads each event's configs and hands one notification
//! per config to that webhook's own pipeline, which delivers in order: a
//! webhook sees its task's events in order, and one that hangs delays only
//! its own. A full queue drops the notification and counts it rather than
//! slowing the ledger; the webhook's next notification then carries the
//! task as it is, which makes up for what was dropped, or, with none to
//! come, one sent once the queue is empty. Failed deliveries (connection
//! errors, 5xx, 408, 429) are retried with exponential backoff and jitter,
//! or after the wait the answer asks for in `Retry-After` (at most
//! [`MAX_RETRY_AFTER`]); other 4xx answers, and hosts the outbound guard
//! refuses, are final. One given up is still owed: the webhook's next
//! notification is the task as it is, and until one is delivered a start
//! owes it too. A task holds at
//! most [`MAX_CONFIGS_PER_TASK`] configs, and at most
//! [`PushSettings::max_in_flight`] POSTs are in flight at once, over all
//! webhooks, so that many tasks' webhooks cannot take all of Baton's
//! sockets; of those, at most [`PushSettings::max_in_flight_per_host`] to
//! one host, so that one that hangs cannot hold them all. A stop waits,
//! within its grace, for what is still queued ([`PushDispatcher::drain`]).

use crate::error::FieldViolation;
use crate::netguard::OutboundPolicy;
use crate::protocol::{StreamResponse, TaskPushNotificationConfig, TaskState};
use crate::store::hub::LedgerEvent;
use crate::store::{Ledger, LedgerError, PushMark};
use crate::upstream::{error_chain, has_io_cause};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::sync::oneshot::{self, error::TryRecvError};
use tokio::sync::{Semaphore, mpsc};

/// Longest wait a webhook's `Retry-After` is granted: a longer one would
/// hold up the webhook's later notifications for as long.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// The notification token header, as the official SDKs send it.
pub const TOKEN_HEADER: &str = "X-A2A-Notification-Token";

/// Delivery settings.
#[derive(Clone, Debug)]
pub struct PushSettings {
    /// Queue length per shard.
    pub queue_capacity: usize,
    /// Delivery workers (shards).
    pub workers: usize,
    /// Attempts per notification, the first included.
    pub max_attempts: u32,
    /// Wait before the first retry; doubles each time, up to `max_backoff`.
    pub initial_backoff: Duration,
    /// Longest wait between two attempts.
    pub max_backoff: Duration,
    /// Timeout of one POST.
    pub request_timeout: Duration,
    /// POSTs in flight at once, over all webhooks: each holds a connection,
    /// and a task may have many configs (a wait for a retry holds none).
    pub max_in_flight: usize,
    /// Of those, POSTs in flight to one host (name or address, and port):
    /// many tasks' configs may name one webhook host, which may hang.
    pub max_in_flight_per_host: usize,
    /// Notifications held at once over all webhooks (queued, retrying or
    /// owed): each holds its event and body, and a webhook that hangs holds
    /// its pipeline's. Past it a new one is refused as a full queue refuses
    /// it: its webhook is owed the task as it is instead.
    pub max_held: u64,
    /// Whether anything is sent (`--disable-push` turns it off): off, stored
    /// configs are kept and nothing is sent or marked handled, so a start
    /// with push on again sends what they are owed.
    pub enabled: bool,
}

impl Default for PushSettings {
    fn default() -> Self {
        Self {
            queue_capacity: 4096,
            workers: 4,
            // Waits of 0.5, 1, 2, 4, 8, 16 and 30 s (each jittered down to
            // half): a webhook restarting for most of a minute still gets
            // its notifications.
            max_attempts: 8,
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(30),
            request_timeout: Duration::from_secs(10),
            max_in_flight: 256,
            max_in_flight_per_host: 16,
            max_held: 16_384,
            enabled: true,
        }
    }
}

/// Most push configs one task may hold: each is notified of every event.
pub const MAX_CONFIGS_PER_TASK: usize = 10;

/// Checks a push config's fields; `prefix` names where it sits in the params.
fn check_fields(
    config: &TaskPushNotificationConfig,
    prefix: &str,
    violations: &mut Vec<FieldViolation>,
) {
    match reqwest::Url::parse(&config.url) {
        _ if config.url.trim().is_empty() => {
            violations.push(FieldViolation::new(format!("{prefix}url"), "is required"));
        }
        // The HTTP client would send them as a second Authorization header.
        Ok(url) if !url.username().is_empty() || url.password().is_some() => {
            violations.push(FieldViolation::new(
                format!("{prefix}url"),
                "must not carry a user name or password: send credentials in authentication",
            ));
        }
        Ok(url) if matches!(url.scheme(), "http" | "https") && url.host().is_some() => {}
        Ok(_) => violations.push(FieldViolation::new(
            format!("{prefix}url"),
            "must be an absolute http or https URL",
        )),
        Err(err) => violations.push(FieldViolation::new(
            format!("{prefix}url"),
            format!("is not a valid URL: {err}"),
        )),
    }
    if let Some(auth) = &config.authentication {
        if auth.scheme.trim().is_empty() {
            violations.push(FieldViolation::new(
                format!("{prefix}authentication.scheme"),
                "is required",
            ));
        } else if !is_token(&auth.scheme) {
            // It opens the Authorization header: `Bearer x, Basic` would
            // smuggle a second scheme in.
            violations.push(FieldViolation::new(
                format!("{prefix}authentication.scheme"),
                "must be one word (an HTTP token, such as Bearer or Basic)",
            ));
        }
    }
    // Get and Delete take no blank id: one stored would be beyond reach.
    if !config.id.is_empty() && config.id.trim().is_empty() {
        violations.push(FieldViolation::new(
            format!("{prefix}id"),
            "must not be blank: leave it out for Baton to make one",
        ));
    }
    // They go out as header values: refused now rather than failing every
    // delivery later.
    let mut header_value = |field: &str, value: &str| {
        if reqwest::header::HeaderValue::from_str(value).is_err() {
            violations.push(FieldViolation::new(
                format!("{prefix}{field}"),
                "must not contain control characters (it is sent as an HTTP header)",
            ));
        }
    };
    header_value("token", &config.token);
    if let Some(auth) = &config.authentication {
        header_value("authentication.scheme", &auth.scheme);
        header_value("authentication.credentials", &auth.credentials);
    }
}

/// Whether `text` is an HTTP token (RFC 9110 §5.6.2), as an auth scheme is.
fn is_token(text: &str) -> bool {
    !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// Counters of push delivery.
#[derive(Debug, Default)]
pub struct PushStats {
    /// Notifications delivered (2xx).
    pub delivered: AtomicU64,
    /// Notifications given up after the last attempt or a final 4xx.
    pub failed: AtomicU64,
    /// Notifications dropped because a queue was full.
    pub dropped: AtomicU64,
    /// Events and notifications queued and not yet delivered or given up:
    /// what a stop waits for ([`PushDispatcher::drain`]).
    pub pending: AtomicU64,
    /// Of those, the notifications webhooks' pipelines hold (queued,
    /// retrying, or owed), bounded by [`PushSettings::max_held`]; the events
    /// in the shards' queues are bounded by their capacity.
    pub held: AtomicU64,
}

/// Queues events for webhook delivery.
#[derive(Clone)]
pub struct PushDispatcher {
    shards: Arc<Vec<mpsc::Sender<Queued>>>,
    /// Where deliveries may go.
    policy: OutboundPolicy,
    /// Delivery counters.
    pub stats: Arc<PushStats>,
    /// Whether anything is sent ([`PushSettings::enabled`]).
    enabled: bool,
    /// Length of each shard's queue.
    queue_capacity: usize,
    /// Each shard's tasks whose events its full queue dropped.
    gaps: Arc<Vec<Arc<Gaps>>>,
}

impl PushDispatcher {
    /// Starts the workers and hooks them to the ledger's durable events.
    pub fn start(ledger: &Arc<Ledger>, policy: OutboundPolicy, settings: PushSettings) -> Self {
        let client = policy.client(settings.request_timeout);
        let stats = Arc::new(PushStats::default());
        let in_flight = Arc::new(Semaphore::new(settings.max_in_flight.max(1)));
        let hosts = Arc::new(HostSlots::new(settings.max_in_flight_per_host));
        let mut shards = Vec::with_capacity(settings.workers);
        let mut shard_gaps = Vec::with_capacity(settings.workers);
        let workers = settings.workers.max(1);
        for shard in 0..workers {
            let (sender, receiver) = mpsc::channel(settings.queue_capacity);
            shards.push(sender);
            let gaps = Arc::new(Gaps::default());
            shard_gaps.push(gaps.clone());
            let worker = Worker {
                ledger: Arc::downgrade(ledger),
                client: client.clone(),
                policy: policy.clone(),
                settings: settings.clone(),
                stats: stats.clone(),
                in_flight: in_flight.clone(),
                hosts: hosts.clone(),
                gaps,
                shard: (shard, workers),
            };
            tokio::spawn(worker.run(receiver));
        }
        let dispatcher = Self {
            shards: Arc::new(shards),
            policy,
            stats,
            enabled: settings.enabled,
            queue_capacity: settings.queue_capacity,
            gaps: Arc::new(shard_gaps),
        };
        if !settings.enabled {
            return dispatcher;
        }
        let hook = dispatcher.clone();
        let stored = ledger.push_config_count();
        ledger.hub().add_sink(Box::new(move |event| {
            // Most gateways hold no push configs: then no event needs a lookup.
            if stored.load(Ordering::Relaxed) > 0 {
                hook.enqueue(event);
            }
        }));
        dispatcher
    }

    /// Checks a push config's fields, and its URL against the outbound
    /// policy where an IP literal names the host: one that would be refused
    /// at every delivery is refused now. (Names are checked at delivery,
    /// after resolution.) `prefix` names where it sits in the params.
    pub fn check_config(
        &self,
        config: &TaskPushNotificationConfig,
        prefix: &str,
        violations: &mut Vec<FieldViolation>,
    ) {
        check_fields(config, prefix, violations);
        if let Ok(url) = reqwest::Url::parse(&config.url)
            && let Err(reason) = self.policy.check_url(&url)
        {
            violations.push(FieldViolation::new(
                format!("{prefix}url"),
                format!("is refused by the outbound policy: {reason}"),
            ));
        }
    }

    /// Waits, at most `within`, until every event and notification queued
    /// so far was delivered or given up; says whether all were. A stop calls it once
    /// no more work comes in, so that what was made durable is also told.
    pub async fn drain(&self, within: Duration) -> bool {
        let started = tokio::time::Instant::now();
        loop {
            let pending = self.stats.pending.load(Ordering::Acquire);
            if pending == 0 {
                return true;
            }
            if started.elapsed() >= within {
                tracing::warn!(
                    pending,
                    ?within,
                    "push notifications still queued at the stop; dropped"
                );
                return false;
            }
            tokio::time::sleep(DRAIN_POLL).await;
        }
    }

    /// Queues what a restart owes webhooks: to each config whose task has
    /// events whose notifications were never delivered or given up (queued
    /// at a crash, dropped at a full queue, or cut off by a stop's grace),
    /// one notification of the task as it is when its turn comes. Returns
    /// how many tasks are owed one. A stop waits for these as for the rest.
    pub fn catch_up(&self, ledger: &Ledger) -> Result<usize, LedgerError> {
        if !self.enabled {
            return Ok(0);
        }
        let mut owed: Vec<Vec<Queued>> = self.shards.iter().map(|_| Vec::new()).collect();
        let mut tasks = 0;
        for (task_id, config_ids) in ledger.push_backlog()? {
            let shard = shard_of(&task_id, self.shards.len());
            let work = Owed::Latest {
                task_id,
                config_ids,
            };
            owed[shard].push(Queued {
                work,
                _pending: Pending::count(&self.stats),
            });
            tasks += 1;
        }
        // The backlog may be longer than a queue: it waits for room, and
        // leaves half of each queue to live events, which a full queue drops.
        // Each shard is fed on its own, so that a busy one holds up no other.
        let reserve = self.queue_capacity / 2;
        for (queue, owed) in self.shards.iter().zip(owed) {
            if owed.is_empty() {
                continue;
            }
            let queue = queue.clone();
            tokio::spawn(async move {
                for queued in owed {
                    while queue.capacity() <= reserve && !queue.is_closed() {
                        tokio::time::sleep(CATCH_UP_PAUSE).await;
                    }
                    if queue.send(queued).await.is_err() {
                        return;
                    }
                }
            });
        }
        Ok(tasks)
    }

    fn enqueue(&self, event: &Arc<LedgerEvent>) {
        let shard = shard_of(&event.task_id, self.shards.len());
        let queued = Queued {
            work: Owed::Event(event.clone()),
            _pending: Pending::count(&self.stats),
        };
        if self.shards[shard].try_send(queued).is_err() {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            self.gaps[shard].note(&event.task_id);
            tracing::warn!(task_id = %event.task_id, seq = event.seq, "push queue full; notification dropped");
        }
    }
}

/// Tasks whose events a shard's full queue dropped: the shard sends their
/// next event's webhooks the task as it then is instead, which holds what
/// was dropped, and once its queue is empty it sends the rest theirs (a
/// task's last event may be the one dropped).
#[derive(Default)]
struct Gaps {
    /// Whether `tasks` may hold any, or `overflowed` is set: most events
    /// need no lock.
    any: AtomicBool,
    tasks: Mutex<HashSet<String>>,
    /// A drop found `tasks` full: which tasks it was is unknown, so every
    /// event goes out as its task as it is, until the shard, its queue
    /// empty, has the ledger say which webhooks are behind.
    overflowed: AtomicBool,
    /// Wakes the shard, which may be waiting on an empty queue.
    noted: tokio::sync::Notify,
}

/// The most tasks one shard's [`Gaps`] holds.
const MAX_GAPS: usize = 10_000;

impl Gaps {
    fn note(&self, task_id: &str) {
        let mut tasks = self.tasks.lock().expect("push gaps lock");
        if tasks.len() < MAX_GAPS {
            tasks.insert(task_id.to_string());
        } else {
            self.overflowed.store(true, Ordering::Release);
        }
        self.any.store(true, Ordering::Release);
        drop(tasks);
        self.noted.notify_one();
    }

    /// Whether `task_id` may have had an event dropped since this was last
    /// asked.
    fn take(&self, task_id: &str) -> bool {
        if !self.any.load(Ordering::Acquire) {
            return false;
        }
        if self.overflowed.load(Ordering::Acquire) {
            return true;
        }
        let mut tasks = self.tasks.lock().expect("push gaps lock");
        let taken = tasks.remove(task_id);
        self.any.store(!tasks.is_empty(), Ordering::Release);
        taken
    }

    /// Every task noted, and whether more were dropped than noted; both
    /// cleared.
    fn take_all(&self) -> (Vec<String>, bool) {
        // A note sets it after its task, then wakes the shard: none is missed.
        if !self.any.load(Ordering::Acquire) {
            return (Vec::new(), false);
        }
        let mut tasks = self.tasks.lock().expect("push gaps lock");
        let overflowed = self.overflowed.swap(false, Ordering::AcqRel);
        self.any.store(false, Ordering::Release);
        (tasks.drain().collect(), overflowed)
    }
}

/// One of [`PushStats::pending`], counted from its making until it is
/// dropped: however an event or notification ends (delivered, given up,
/// refused by a full queue, or lost with a task that panicked), a stop does
/// not wait for it any more.
struct Pending {
    stats: Arc<PushStats>,
    /// Also one of [`PushStats::held`].
    held: bool,
}

impl Pending {
    fn count(stats: &Arc<PushStats>) -> Self {
        stats.pending.fetch_add(1, Ordering::AcqRel);
        Self {
            stats: stats.clone(),
            held: false,
        }
    }

    /// A notification a shard hands a webhook's pipeline.
    fn held(stats: &Arc<PushStats>) -> Self {
        stats.held.fetch_add(1, Ordering::AcqRel);
        let mut pending = Self::count(stats);
        pending.held = true;
        pending
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.stats.pending.fetch_sub(1, Ordering::AcqRel);
        if self.held {
            self.stats.held.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Work in a shard's queue.
struct Queued {
    work: Owed,
    _pending: Pending,
}

/// What a shard hands out.
enum Owed {
    /// A durable event, to every config of its task.
    Event(Arc<LedgerEvent>),
    /// The task as it is, to these configs of it: what a restart owes them
    /// for events never handled before it ([`PushDispatcher::catch_up`]).
    Latest {
        task_id: String,
        config_ids: Vec<String>,
    },
}

/// A notification's body: `event` as JSON, encoded once for all the
/// webhooks it goes to.
fn encoded(event: &StreamResponse) -> Option<bytes::Bytes> {
    match serde_json::to_vec(event) {
        Ok(body) => Some(bytes::Bytes::from(body)),
        Err(err) => {
            tracing::error!(%err, "cannot encode push notification");
            None
        }
    }
}

fn shard_of(task_id: &str, shards: usize) -> usize {
    let hash = task_id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    (hash % shards as u64) as usize
}

struct Worker {
    ledger: Weak<Ledger>,
    client: reqwest::Client,
    policy: OutboundPolicy,
    settings: PushSettings,
    stats: Arc<PushStats>,
    /// Permits for POSTs in flight, shared by every shard.
    in_flight: Arc<Semaphore>,
    /// Permits for POSTs in flight to each host, shared by every shard.
    hosts: Arc<HostSlots>,
    /// Tasks whose events this shard's full queue dropped.
    gaps: Arc<Gaps>,
    /// This shard's index, and how many there are.
    shard: (usize, usize),
}

/// One notification for one webhook.
struct Notification {
    config: TaskPushNotificationConfig,
    told: Told,
    _pending: Pending,
}

impl Notification {
    /// The task as it is, for a debt (see [`Debt`]).
    fn owed((config, pending): (TaskPushNotificationConfig, Pending)) -> Self {
        Self {
            config,
            told: Told::Latest,
            _pending: pending,
        }
    }
}

/// Permits for POSTs in flight to each webhook host.
struct HostSlots {
    per_host: usize,
    /// The permits by host, and how many hosts it holds before it lets go
    /// of those no POST holds or waits for (doubled from what is left, so
    /// that many hosts in use do not make every POST walk them all).
    hosts: Mutex<(HashMap<String, Arc<Semaphore>>, usize)>,
}

/// The fewest hosts [`HostSlots`] holds before it lets go of any.
const HOST_SLOTS_PRUNE_AT: usize = 1024;

impl HostSlots {
    fn new(per_host: usize) -> Self {
        Self {
            per_host: per_host.max(1),
            hosts: Mutex::new((HashMap::new(), HOST_SLOTS_PRUNE_AT)),
        }
    }

    /// The permits of `url`'s host.
    fn slot(&self, url: &reqwest::Url) -> Arc<Semaphore> {
        let host = url.host_str().unwrap_or_default();
        let key = format!("{host}:{}", url.port_or_known_default().unwrap_or(0));
        let mut held = self.hosts.lock().expect("push hosts lock");
        let (hosts, prune_at) = &mut *held;
        if hosts.len() >= *prune_at {
            hosts.retain(|_, slot| Arc::strong_count(slot) > 1);
            *prune_at = (hosts.len() * 2).max(HOST_SLOTS_PRUNE_AT);
        }
        hosts
            .entry(key)
            .or_insert_with(|| Arc::new(Semaphore::new(self.per_host)))
            .clone()
    }
}

/// How a delivery ended.
#[derive(Debug, PartialEq, Eq)]
enum Delivery {
    /// Delivered, refused for good (a 4xx other than 408 and 429, a host
    /// the outbound guard refuses), or its config deleted: handled.
    Done,
    /// Every attempt failed as a passing fault would (no connection, 5xx,
    /// 408, 429): still owed.
    GivenUp,
}

/// What a notification tells its webhook.
#[derive(Clone)]
enum Told {
    /// A durable event, encoded once for all its task's webhooks.
    Event {
        event: Arc<LedgerEvent>,
        body: bytes::Bytes,
    },
    /// The task as it is when the notification's turn comes (`{"task": …}`):
    /// what a webhook is owed for events it missed, never handled before a
    /// restart or dropped at a full queue.
    Latest,
}

/// Notifications one webhook may have waiting; more are dropped (counted).
const WEBHOOK_QUEUE: usize = 256;

/// How long a start's catch-up waits for room in a shard's queue.
const CATCH_UP_PAUSE: Duration = Duration::from_millis(10);

/// How often a stop looks whether the queues are empty.
const DRAIN_POLL: Duration = Duration::from_millis(10);

/// A webhook's pipeline, as its shard holds it.
struct Pipeline {
    sender: mpsc::Sender<Notification>,
    /// Ends once the pipeline has delivered (or given up) all it took.
    finished: oneshot::Receiver<()>,
    /// What it owes its webhook for a notification its full queue refused.
    debt: Arc<Debt>,
}

/// A webhook's debt of the task as it is, from a notification its full
/// queue refused: paid by the next notification its shard hands it, else
/// by the pipeline itself once its queue is empty (a task's last event may
/// be the one refused). Counted as pending while owed, so that a stop waits
/// for it.
#[derive(Default)]
struct Debt(Mutex<Option<(TaskPushNotificationConfig, Pending)>>);

impl Debt {
    /// Owes `config` a notification; `pending` (the refused one's count)
    /// goes with the debt, or with it already owed.
    fn owe(&self, config: TaskPushNotificationConfig, pending: Pending) {
        let mut debt = self.0.lock().expect("push debt lock");
        if debt.is_none() {
            *debt = Some((config, pending));
        }
    }

    /// The debt, now paid by whoever takes it.
    fn settle(&self) -> Option<(TaskPushNotificationConfig, Pending)> {
        self.0.lock().expect("push debt lock").take()
    }

    fn is_owed(&self) -> bool {
        self.0.lock().expect("push debt lock").is_some()
    }
}

impl Pipeline {
    /// Whether it takes no more and has nothing left to deliver.
    fn is_over(&mut self) -> bool {
        self.sender.is_closed() && !matches!(self.finished.try_recv(), Err(TryRecvError::Empty))
    }
}

/// Fewest pipelines a shard holds before it lets go of idle ones.
const PRUNE_AT_LEAST: usize = 64;

/// How long a webhook's pipeline waits for its next notification before it
/// ends (a later one starts a new pipeline).
const WEBHOOK_IDLE: Duration = Duration::from_secs(60);

impl Worker {
    /// Reads each event's configs and hands one notification per config to
    /// that webhook's own pipeline: a webhook that hangs delays its own
    /// notifications (in order), never another's.
    async fn run(self, mut receiver: mpsc::Receiver<Queued>) {
        let worker = Arc::new(self);
        let mut pipelines: HashMap<(String, String), Pipeline> = HashMap::new();
        // Pipelines that ended idle are let go when the map doubles, not
        // looked over at every event.
        let mut prune_at = PRUNE_AT_LEAST;
        loop {
            let queued = match receiver.try_recv() {
                Ok(queued) => queued,
                Err(mpsc::error::TryRecvError::Disconnected) => return,
                Err(mpsc::error::TryRecvError::Empty) => {
                    if worker.make_up_for_gaps(&mut pipelines, &mut prune_at).await {
                        continue;
                    }
                    tokio::select! {
                        queued = receiver.recv() => match queued {
                            Some(queued) => queued,
                            None => return,
                        },
                        () = worker.gaps.noted.notified() => continue,
                    }
                }
            };
            // Its notifications are counted before the event stops being.
            let (task_id, told, only) = match &queued.work {
                // After a dropped event its webhooks are told the task as
                // it is, which holds what they missed.
                Owed::Event(event) if worker.gaps.take(&event.task_id) => {
                    (event.task_id.as_str(), Told::Latest, None)
                }
                Owed::Event(event) => {
                    let Some(body) = encoded(&event.event) else {
                        continue;
                    };
                    let told = Told::Event {
                        event: event.clone(),
                        body,
                    };
                    (event.task_id.as_str(), told, None)
                }
                Owed::Latest {
                    task_id,
                    config_ids,
                } => (task_id.as_str(), Told::Latest, Some(config_ids.as_slice())),
            };
            worker
                .hand_out(task_id, &told, only, &mut pipelines, &mut prune_at)
                .await;
        }
    }

    /// With the shard's queue empty, tells the webhooks of each task an
    /// event of which it dropped the task as it is; says whether there were
    /// any. Past [`MAX_GAPS`], the ledger says which are behind.
    async fn make_up_for_gaps(
        self: &Arc<Self>,
        pipelines: &mut HashMap<(String, String), Pipeline>,
        prune_at: &mut usize,
    ) -> bool {
        let (tasks, overflowed) = self.gaps.take_all();
        for task_id in &tasks {
            self.hand_out(task_id, &Told::Latest, None, pipelines, prune_at)
                .await;
        }
        if !overflowed {
            return !tasks.is_empty();
        }
        let Some(ledger) = self.ledger.upgrade() else {
            return true;
        };
        let (shard, shards) = self.shard;
        let behind = tokio::task::spawn_blocking(move || ledger.push_backlog()).await;
        match behind {
            Ok(Ok(behind)) => {
                for (task_id, config_ids) in behind {
                    if shard_of(&task_id, shards) == shard {
                        let only = Some(config_ids.as_slice());
                        self.hand_out(&task_id, &Told::Latest, only, pipelines, prune_at)
                            .await;
                    }
                }
            }
            Ok(Err(err)) => {
                tracing::error!(%err, "cannot read which webhooks dropped notifications left behind")
            }
            Err(err) => tracing::error!(%err, "reading dropped notifications' webhooks failed"),
        }
        true
    }

    /// The task `task_id` as it now is, once durable, as an event at its
    /// latest position, with its encoding.
    async fn latest(&self, task_id: &str) -> Option<(Arc<LedgerEvent>, bytes::Bytes)> {
        let ledger = self.ledger.upgrade()?;
        let read = async {
            let found = ledger.get_shared(task_id)?;
            // What was read may still be on its way to disk.
            ledger.sync_unless_failing().await?;
            Ok::<_, LedgerError>(found)
        };
        let record = match read.await {
            Ok(Some(record)) => record,
            Ok(None) => return None,
            Err(err) => {
                tracing::error!(%task_id, %err, "cannot read a task owed a push notification");
                return None;
            }
        };
        let event = StreamResponse::Task(record.task.clone());
        let body = encoded(&event)?;
        let event = LedgerEvent::new(task_id.to_string(), record.last_seq, event);
        Some((Arc::new(event), body))
    }

    /// Hands one notification `told` per config of task `task_id` (or only
    /// to those of `only`) to that webhook's pipeline.
    async fn hand_out(
        self: &Arc<Self>,
        task_id: &str,
        told: &Told,
        only: Option<&[String]>,
        pipelines: &mut HashMap<(String, String), Pipeline>,
        prune_at: &mut usize,
    ) {
        let Some(ledger) = self.ledger.upgrade() else {
            return;
        };
        let configs = match ledger.push_configs(task_id).await {
            Ok(configs) => configs,
            Err(err) => {
                tracing::error!(%task_id, %err, "cannot read push configs");
                return;
            }
        };
        drop(ledger);
        let configs = configs
            .into_iter()
            .filter(|config| only.is_none_or(|ids| ids.contains(&config.id)));
        if pipelines.len() >= *prune_at {
            // One still delivering is kept: its successor waits for it; so
            // is one that owes its webhook the task.
            pipelines.retain(|_, pipeline| pipeline.debt.is_owed() || !pipeline.is_over());
            *prune_at = (pipelines.len() * 2).max(PRUNE_AT_LEAST);
        }
        for config in configs {
            let key = (config.task_id.clone(), config.id.clone());
            let pipeline = pipelines
                .entry(key)
                .or_insert_with(|| Worker::pipeline(self, None, Arc::default()));
            let notification = match pipeline.debt.settle() {
                Some((_, pending)) => Notification::owed((config, pending)),
                None => Notification {
                    config,
                    told: told.clone(),
                    _pending: Pending::held(&self.stats),
                },
            };
            // This one is counted already: past the bound if it is more.
            if self.stats.held.load(Ordering::Acquire) > self.settings.max_held {
                pipeline
                    .debt
                    .owe(notification.config, notification._pending);
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%task_id, bound = self.settings.max_held, "push notifications held at their bound; notification dropped");
                continue;
            }
            let refused = match pipeline.sender.try_send(notification) {
                Ok(()) => None,
                // Ended idle since: a new one takes it, after the old one
                // delivered what it still held, so that the webhook sees
                // the task's events in order.
                Err(mpsc::error::TrySendError::Closed(notification)) => {
                    let (_, earlier) = oneshot::channel();
                    let earlier = std::mem::replace(&mut pipeline.finished, earlier);
                    *pipeline = Worker::pipeline(self, Some(earlier), pipeline.debt.clone());
                    pipeline
                        .sender
                        .try_send(notification)
                        .err()
                        .map(|err| err.into_inner())
                }
                Err(mpsc::error::TrySendError::Full(notification)) => Some(notification),
            };
            if let Some(refused) = refused {
                pipeline.debt.owe(refused.config, refused._pending);
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%task_id, "webhook queue full; notification dropped");
            }
        }
    }

    /// Starts a webhook's pipeline: its notifications delivered one after
    /// another, once the webhook's `earlier` pipeline has finished, until
    /// none comes for [`WEBHOOK_IDLE`]; with its queue empty, it pays its
    /// `debt`.
    fn pipeline(
        worker: &Arc<Self>,
        earlier: Option<oneshot::Receiver<()>>,
        debt: Arc<Debt>,
    ) -> Pipeline {
        let (sender, mut receiver) = mpsc::channel::<Notification>(WEBHOOK_QUEUE);
        let (finish, finished) = oneshot::channel();
        let worker = worker.clone();
        let owed = debt.clone();
        tokio::spawn(async move {
            // An earlier pipeline that ended idle may still be delivering
            // what came in as it closed (or retrying it).
            if let Some(earlier) = earlier {
                let _ = earlier.await;
            }
            // Dropped with this task, however it ends: the next one goes on.
            let _finish = finish;
            // The task's events come in order, but the task as it is
            // ([`Told::Latest`]) is read when its turn comes and holds the
            // events queued behind it: those are not sent after it.
            let mut sent_through = 0;
            // Where the latest such read stood: one no further on shows
            // nothing new. (One no further than the events sent is still
            // sent: it is owed for events this webhook missed.)
            let mut latest_through = None;
            loop {
                let queued = receiver.try_recv().ok();
                let notification = match queued.or_else(|| owed.settle().map(Notification::owed)) {
                    Some(notification) => notification,
                    None => match tokio::time::timeout(WEBHOOK_IDLE, receiver.recv()).await {
                        Ok(Some(notification)) => notification,
                        Ok(None) => return,
                        // No more is taken; what is queued still goes out,
                        // then `recv` ends the loop.
                        Err(_idle) => {
                            receiver.close();
                            continue;
                        }
                    },
                };
                let Notification {
                    config,
                    told,
                    _pending,
                } = notification;
                let told = match told {
                    Told::Event { event, .. } if event.seq <= sent_through => continue,
                    Told::Event { event, body } => match worker.mark(&config) {
                        // Handled, or the config was made after it.
                        Some(mark) if mark.through >= event.seq => continue,
                        // An earlier event was never handled (given up, here
                        // or by a pipeline before this one, or cut off by a
                        // stop): the task as it is holds what it told.
                        Some(mark) if mark.through.saturating_add(1) < event.seq => Told::Latest,
                        _ => Told::Event { event, body },
                    },
                    latest => latest,
                };
                let (event, body, is_latest) = match told {
                    Told::Event { event, body } => (event, body, false),
                    Told::Latest => match worker.latest(&config.task_id).await {
                        Some((event, _)) if latest_through >= Some(event.seq) => continue,
                        Some((event, body)) => (event, body, true),
                        None => continue,
                    },
                };
                sent_through = sent_through.max(event.seq);
                match worker.deliver(&config, &event, body).await {
                    Delivery::Done => {
                        worker.note_handled(&config, &event);
                        if is_latest {
                            latest_through = Some(event.seq);
                        }
                    }
                    // Not marked handled: the webhook's next notification is
                    // the task as it is, and until then a restart owes it.
                    Delivery::GivenUp => {}
                }
            }
        });
        Pipeline {
            sender,
            finished,
            debt,
        }
    }

    /// The config a notification queued for `queued` goes out with: its
    /// task's config of that id as it is now, so that a replaced one (a
    /// rotated token, a moved webhook) gets what was queued for it, and a
    /// deleted one nothing. A ledger that cannot say leaves `queued`.
    async fn current_config(
        &self,
        queued: &TaskPushNotificationConfig,
    ) -> Option<TaskPushNotificationConfig> {
        let ledger = self.ledger.upgrade()?;
        match ledger.get_push_config(&queued.task_id, &queued.id).await {
            Ok(current) => current,
            Err(err) => {
                tracing::warn!(task_id = %queued.task_id, %err, "cannot read a push config before delivery");
                Some(queued.clone())
            }
        }
    }

    /// How far `config`'s notifications were handled. A config made after
    /// an event was queued, deleted and made again under its id included,
    /// stands at its task's last event then: it is owed only what comes
    /// after. `None` if the ledger cannot say.
    fn mark(&self, config: &TaskPushNotificationConfig) -> Option<PushMark> {
        let ledger = self.ledger.upgrade()?;
        match ledger.push_mark(&config.task_id, &config.id) {
            Ok(mark) => mark,
            Err(err) => {
                tracing::warn!(task_id = %config.task_id, %err, "cannot read how far a push config was handled");
                None
            }
        }
    }

    /// Marks `event` handled for `config` in the ledger, so that a restart
    /// does not owe it again (see [`Ledger::push_backlog`]); a config
    /// deleted meanwhile is owed nothing, and the ledger marks none.
    fn note_handled(&self, config: &TaskPushNotificationConfig, event: &LedgerEvent) {
        let Some(ledger) = self.ledger.upgrade() else {
            return;
        };
        let handled = PushMark {
            through: event.seq,
            task_ended: event.event.state().is_some_and(TaskState::is_terminal),
        };
        if let Err(err) = ledger.note_push_handled(&config.task_id, &config.id, handled) {
            tracing::warn!(task_id = %config.task_id, %err, "cannot mark a push notification handled");
        }
    }

    /// Delivers one notification, retrying as the answers allow, until it
    /// is delivered, refused for good or given up, or its config is deleted.
    async fn deliver(
        &self,
        queued: &TaskPushNotificationConfig,
        event: &LedgerEvent,
        body: bytes::Bytes,
    ) -> Delivery {
        let mut backoff = self.settings.initial_backoff;
        for attempt in 1..=self.settings.max_attempts {
            let Some(config) = self.current_config(queued).await else {
                tracing::debug!(task_id = %event.task_id, "push config deleted; notification not sent");
                return Delivery::Done;
            };
            // A config made again under its id since the first attempt is
            // owed only what comes after it (its mark says so).
            if attempt > 1
                && self
                    .mark(&config)
                    .is_some_and(|mark| mark.through >= event.seq)
            {
                return Delivery::Done;
            }
            let url = match self.webhook_url(&config) {
                Ok(url) => url,
                Err(reason) => {
                    tracing::warn!(task_id = %event.task_id, %reason, "push delivery refused");
                    self.stats.failed.fetch_add(1, Ordering::Relaxed);
                    return Delivery::Done;
                }
            };
            let shown = crate::netguard::shown_url(&url);
            let host = self.hosts.slot(&url);
            let mut request = self
                .client
                .post(url)
                .header(reqwest::header::CONTENT_TYPE, "application/a2a+json")
                .body(body.clone());
            if let Some(auth) = &config.authentication {
                request = request.header(
                    reqwest::header::AUTHORIZATION,
                    format!("{} {}", auth.scheme, auth.credentials)
                        .trim_end()
                        .to_string(),
                );
            }
            if !config.token.is_empty() {
                request = request.header(TOKEN_HEADER, &config.token);
            }
            let mut asked_wait = None;
            // Never closed: the semaphores live as long as the workers.
            let host_permit = host.acquire_owned().await.expect("push host semaphore");
            let permit = self.in_flight.acquire().await.expect("push semaphore");
            let retryable = match request.send().await {
                Ok(response) if response.status().is_success() => {
                    self.stats.delivered.fetch_add(1, Ordering::Relaxed);
                    return Delivery::Done;
                }
                Ok(response) => {
                    let status = response.status();
                    tracing::warn!(task_id = %event.task_id, url = %shown, %status, attempt, "push delivery rejected");
                    asked_wait = retry_after(response.headers(), chrono::Utc::now());
                    status.is_server_error()
                        || status == reqwest::StatusCode::TOO_MANY_REQUESTS
                        || status == reqwest::StatusCode::REQUEST_TIMEOUT
                }
                Err(err) => {
                    // The address guard refuses a host it resolved (its
                    // PermissionDenied), and says the same at every attempt.
                    let refused = has_io_cause(&err, std::io::ErrorKind::PermissionDenied);
                    let err = error_chain(&err.without_url());
                    tracing::warn!(task_id = %event.task_id, url = %shown, %err, attempt, "push delivery failed");
                    !refused
                }
            };
            drop((permit, host_permit));
            if !retryable {
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                return Delivery::Done;
            }
            if attempt == self.settings.max_attempts {
                break;
            }
            tokio::time::sleep(asked_wait.unwrap_or_else(|| jittered(backoff))).await;
            backoff = (backoff * 2).min(self.settings.max_backoff);
        }
        self.stats.failed.fetch_add(1, Ordering::Relaxed);
        Delivery::GivenUp
    }

    /// Where `config` is delivered, if the outbound policy lets it be; any
    /// user name and password (from a config stored before they were
    /// refused) is dropped, so that only `authentication` is sent.
    fn webhook_url(&self, config: &TaskPushNotificationConfig) -> Result<reqwest::Url, String> {
        let url = reqwest::Url::parse(&config.url)
            .map_err(|err| format!("the push config has an invalid URL: {err}"))?;
        let url = crate::netguard::without_credentials(&url);
        self.policy.check_url(&url)?;
        Ok(url)
    }
}

/// The wait an answer's `Retry-After` asks for (delay-seconds or an HTTP
/// date, as of `now`), at most [`MAX_RETRY_AFTER`]; `None` without one that
/// parses.
fn retry_after(
    headers: &reqwest::header::HeaderMap,
    now: chrono::DateTime<chrono::Utc>,
) -> Option<Duration> {
    let value = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    let wait = match value.parse::<u64>() {
        Ok(seconds) => Duration::from_secs(seconds),
        // An HTTP date (IMF-fixdate) reads as RFC 2822; one past is now.
        Err(_) => {
            let at = chrono::DateTime::parse_from_rfc2822(value).ok()?;
            (at.with_timezone(&chrono::Utc) - now)
                .to_std()
                .unwrap_or_default()
        }
    };
    Some(wait.min(MAX_RETRY_AFTER))
}

/// Half of `backoff` and a random part of the other half, so that the
/// deliveries a webhook's outage failed together are not retried together.
fn jittered(backoff: Duration) -> Duration {
    let half = backoff / 2;
    let random = f64::from(getrandom::u32().unwrap_or(0)) / f64::from(u32::MAX);
    half + half.mul_f64(random)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Task, TaskStatus, TaskStatusUpdateEvent};
    use crate::store::TaskRecord;

    #[test]
    fn retry_after_reads_seconds_and_dates_within_its_cap() {
        let now = chrono::DateTime::parse_from_rfc3339("2026-12-07T08:49:37Z")
            .unwrap()
            .with_timezone(&chrono::Utc);
        let asked = |value: &str| {
            let mut headers = reqwest::header::HeaderMap::new();
            headers.insert(reqwest::header::RETRY_AFTER, value.parse().unwrap());
            retry_after(&headers, now)
        };
        assert_eq!(asked("3"), Some(Duration::from_secs(3)));
        assert_eq!(asked(" 0 "), Some(Duration::ZERO));
        assert_eq!(asked("86400"), Some(MAX_RETRY_AFTER));
        let in_ten = "Mon, 07 Dec 2026 08:49:47 GMT";
        assert_eq!(asked(in_ten), Some(Duration::from_secs(10)));
        let past = "Mon, 07 Dec 2026 08:00:00 GMT";
        assert_eq!(asked(past), Some(Duration::ZERO));
        assert_eq!(asked("soon"), None);
        assert_eq!(asked("-5"), None);
        let none = reqwest::header::HeaderMap::new();
        assert_eq!(retry_after(&none, now), None);
    }

    #[test]
    fn a_jittered_backoff_lies_between_its_half_and_itself() {
        let backoff = Duration::from_millis(800);
        let waits: Vec<Duration> = (0..64).map(|_| jittered(backoff)).collect();
        assert!(waits.iter().all(|w| *w >= backoff / 2 && *w <= backoff));
        let first = waits[0];
        assert!(waits.iter().any(|w| *w != first), "the waits vary");
    }

    /// A webhook on loopback that records the states it is sent, in order
    /// (`task STATE` for the task as it is); it holds its first answer back
    /// a while.
    async fn slow_first_webhook() -> (String, Arc<Mutex<Vec<String>>>) {
        recording_webhook(0, Duration::from_millis(300)).await
    }

    /// A webhook on loopback that answers 503 to its first `fails`
    /// requests, holds its first answer back `first_delay`, and records the
    /// states of those it takes, as [`slow_first_webhook`] says.
    async fn recording_webhook(
        fails: u64,
        first_delay: Duration,
    ) -> (String, Arc<Mutex<Vec<String>>>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let recorded = seen.clone();
        let arrived = Arc::new(AtomicU64::new(0));
        let app = axum::Router::new().route(
            "/hook",
            axum::routing::post(move |body: String| {
                let (recorded, arrived) = (recorded.clone(), arrived.clone());
                async move {
                    let n = arrived.fetch_add(1, Ordering::SeqCst);
                    if n == 0 {
                        tokio::time::sleep(first_delay).await;
                    }
                    if n < fails {
                        return axum::http::StatusCode::SERVICE_UNAVAILABLE;
                    }
                    let event: serde_json::Value = serde_json::from_str(&body).unwrap();
                    let state = match event.get("task") {
                        Some(task) => format!("task {}", task["status"]["state"]),
                        None => event["statusUpdate"]["status"]["state"].to_string(),
                    };
                    recorded.lock().unwrap().push(state);
                    axum::http::StatusCode::OK
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (url, seen)
    }

    /// Event `seq` of `config`'s task: its status moved to `state`.
    fn event_at(
        config: &TaskPushNotificationConfig,
        state: TaskState,
        seq: u64,
    ) -> Arc<LedgerEvent> {
        let event = StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
            task_id: config.task_id.clone(),
            context_id: "c".into(),
            status: TaskStatus::now(state, None),
            metadata: None,
        });
        Arc::new(LedgerEvent::new(config.task_id.clone(), seq, event))
    }

    fn notification_at(
        worker: &Worker,
        config: &TaskPushNotificationConfig,
        state: TaskState,
        seq: u64,
    ) -> Notification {
        let event = event_at(config, state, seq);
        Notification {
            config: config.clone(),
            told: Told::Event {
                body: encoded(&event.event).unwrap(),
                event,
            },
            _pending: Pending::count(&worker.stats),
        }
    }

    /// A ledger (in its directory) holding one config for a webhook at
    /// `url`, and a worker delivering to loopback.
    async fn worker_for(
        url: String,
    ) -> (
        (tempfile::TempDir, Arc<Ledger>),
        Arc<Worker>,
        TaskPushNotificationConfig,
    ) {
        worker_with(url, PushSettings::default()).await
    }

    /// [`worker_for`] with `settings`.
    async fn worker_with(
        url: String,
        settings: PushSettings,
    ) -> (
        (tempfile::TempDir, Arc<Ledger>),
        Arc<Worker>,
        TaskPushNotificationConfig,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Arc::new(Ledger::open(dir.path()).unwrap());
        let config = TaskPushNotificationConfig {
            id: "hook".into(),
            task_id: "t".into(),
            url,
            ..TaskPushNotificationConfig::default()
        };
        ledger.put_push_config(&config, 10).await.unwrap().unwrap();
        let policy = OutboundPolicy {
            allow: vec!["127.0.0.0/8".parse().unwrap()],
            ..OutboundPolicy::default()
        };
        let worker = Arc::new(Worker {
            ledger: Arc::downgrade(&ledger),
            client: policy.client(settings.request_timeout),
            in_flight: Arc::new(Semaphore::new(settings.max_in_flight)),
            hosts: Arc::new(HostSlots::new(settings.max_in_flight_per_host)),
            policy,
            settings,
            stats: Arc::default(),
            gaps: Arc::default(),
            shard: (0, 1),
        });
        ((dir, ledger), worker, config)
    }

    /// Waits, 10 s at most, until the states `seen` holds are `done`.
    async fn seen_when(seen: &Mutex<Vec<String>>, done: impl Fn(&[String]) -> bool) -> Vec<String> {
        for _ in 0..500 {
            if done(&seen.lock().unwrap()) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        seen.lock().unwrap().clone()
    }

    /// Waits until `seen` holds `count` states.
    async fn until_seen(seen: &Mutex<Vec<String>>, count: usize) -> Vec<String> {
        seen_when(seen, |states| states.len() >= count).await
    }

    /// A dispatcher of one shard whose queue holds one event, once it has
    /// delivered `config`'s task's first event, `first`, to the webhook that
    /// records into `seen`.
    async fn one_slot_dispatcher(
        ledger: &Arc<Ledger>,
        worker: &Worker,
        config: &TaskPushNotificationConfig,
        first: TaskState,
        seen: &Mutex<Vec<String>>,
    ) -> PushDispatcher {
        let settings = PushSettings {
            queue_capacity: 1,
            workers: 1,
            ..PushSettings::default()
        };
        let dispatcher = PushDispatcher::start(ledger, worker.policy.clone(), settings);
        dispatcher.enqueue(&event_at(config, first, 1));
        until_seen(seen, 1).await;
        dispatcher
    }

    /// Stores task `t` of `config`'s, gone through `states`; returns its
    /// latest seq.
    async fn task_in(ledger: &Ledger, states: &[TaskState]) -> u64 {
        let record = TaskRecord {
            task: Task {
                id: "t".into(),
                context_id: "c".into(),
                ..Task::default()
            },
            ..TaskRecord::default()
        };
        let statuses = states.iter().map(|state| {
            StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
                task_id: "t".into(),
                context_id: "c".into(),
                status: TaskStatus::now(*state, None),
                metadata: None,
            })
        });
        let created = ledger.create(record, statuses.collect()).await.unwrap();
        assert_eq!(created.last_seq, states.len() as u64);
        created.last_seq
    }

    fn latest_for(worker: &Worker, config: &TaskPushNotificationConfig) -> Notification {
        Notification {
            config: config.clone(),
            told: Told::Latest,
            _pending: Pending::count(&worker.stats),
        }
    }

    /// Waits until `seen` holds `count` states, then a little more, so that
    /// one too many would show.
    async fn settled(seen: &Mutex<Vec<String>>, count: usize) -> Vec<String> {
        until_seen(seen, count).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        seen.lock().unwrap().clone()
    }

    /// The task as it is, read when its turn comes, holds the events queued
    /// behind it, which its pipeline then skips; later ones go out.
    #[tokio::test]
    async fn events_the_task_as_read_already_holds_are_not_sent_after_it() {
        let (url, seen) = slow_first_webhook().await;
        let ((_dir, ledger), worker, config) = worker_for(url).await;
        let latest = task_in(&ledger, &[TaskState::InputRequired]).await;
        let pipeline = Worker::pipeline(&worker, None, Arc::default());
        pipeline
            .sender
            .try_send(latest_for(&worker, &config))
            .unwrap();
        for (seq, state) in [
            (latest, TaskState::InputRequired),
            (latest + 1, TaskState::Working),
        ] {
            let queued = notification_at(&worker, &config, state, seq);
            pipeline.sender.try_send(queued).unwrap();
        }
        assert_eq!(
            settled(&seen, 2).await,
            [
                "task \"TASK_STATE_INPUT_REQUIRED\"",
                "\"TASK_STATE_WORKING\""
            ]
        );
    }

    /// The task as it is goes out even after an event as late as it (a live
    /// event may overtake what a start owed): it is owed for events the
    /// webhook missed, which that event does not hold. A second read that
    /// shows nothing new is not sent.
    #[tokio::test]
    async fn the_task_as_it_is_goes_out_after_an_event_as_late() {
        let (url, seen) = slow_first_webhook().await;
        let ((_dir, ledger), worker, config) = worker_for(url).await;
        let latest = task_in(&ledger, &[TaskState::Completed]).await;
        let pipeline = Worker::pipeline(&worker, None, Arc::default());
        let event = notification_at(&worker, &config, TaskState::Completed, latest);
        pipeline.sender.try_send(event).unwrap();
        for _ in 0..2 {
            let owed = latest_for(&worker, &config);
            pipeline.sender.try_send(owed).unwrap();
        }
        assert_eq!(
            settled(&seen, 2).await,
            ["\"TASK_STATE_COMPLETED\"", "task \"TASK_STATE_COMPLETED\""]
        );
    }

    /// Events queued before a config was made are not sent to it, also when
    /// it takes the id of one deleted meanwhile.
    #[tokio::test]
    async fn a_config_made_again_under_its_id_gets_only_later_events() {
        let (url, seen) = slow_first_webhook().await;
        let ((_dir, ledger), worker, config) = worker_for(url).await;
        let pipeline = Worker::pipeline(&worker, None, Arc::default());
        let latest = task_in(&ledger, &[TaskState::Working, TaskState::InputRequired]).await;
        ledger.delete_push_config("t", &config.id).await.unwrap();
        ledger.put_push_config(&config, 10).await.unwrap().unwrap();
        let states = [
            (latest - 1, TaskState::Working),
            (latest, TaskState::InputRequired),
            (latest + 1, TaskState::Completed),
        ];
        for (seq, state) in states {
            let queued = notification_at(&worker, &config, state, seq);
            pipeline.sender.try_send(queued).unwrap();
        }
        assert_eq!(settled(&seen, 1).await, ["\"TASK_STATE_COMPLETED\""]);
    }

    /// A config made again under its id while a notification waits for its
    /// retry is not sent it.
    #[tokio::test]
    async fn a_config_made_again_during_a_retry_is_not_sent_the_retried_event() {
        let (url, seen) = recording_webhook(1, Duration::ZERO).await;
        let settings = PushSettings {
            initial_backoff: Duration::from_millis(600),
            ..PushSettings::default()
        };
        let ((_dir, ledger), worker, config) = worker_with(url, settings).await;
        let latest = task_in(&ledger, &[TaskState::Working]).await;
        let pipeline = Worker::pipeline(&worker, None, Arc::default());
        let queued = notification_at(&worker, &config, TaskState::Working, latest);
        pipeline.sender.try_send(queued).unwrap();
        // The first attempt fails at once; its retry waits 300-600 ms.
        tokio::time::sleep(Duration::from_millis(150)).await;
        ledger.delete_push_config("t", &config.id).await.unwrap();
        ledger.put_push_config(&config, 10).await.unwrap().unwrap();
        tokio::time::sleep(Duration::from_millis(900)).await;
        assert!(
            seen.lock().unwrap().is_empty(),
            "{:?}",
            seen.lock().unwrap()
        );
    }

    /// Past the bound on notifications held over all webhooks, more are
    /// refused as a full queue refuses them: their webhook is owed the task
    /// as it is, one notification, however many events were refused.
    #[tokio::test]
    async fn notifications_held_over_all_webhooks_are_bounded() {
        let settings = PushSettings {
            max_held: 8,
            ..PushSettings::default()
        };
        let url = "http://127.0.0.1:9/".to_string();
        let ((_dir, _ledger), worker, config) = worker_with(url, settings).await;
        // A pipeline that never delivers: it holds all it takes.
        let (sender, _receiver) = mpsc::channel(WEBHOOK_QUEUE);
        let (_finish, finished) = oneshot::channel();
        let key = (config.task_id.clone(), config.id.clone());
        let held = Pipeline {
            sender,
            finished,
            debt: Arc::default(),
        };
        let mut pipelines = HashMap::from([(key.clone(), held)]);
        let mut prune_at = PRUNE_AT_LEAST;
        for seq in 1..=40 {
            let told = notification_at(&worker, &config, TaskState::Working, seq).told;
            worker
                .hand_out("t", &told, None, &mut pipelines, &mut prune_at)
                .await;
        }
        // Eight queued and the debt.
        assert_eq!(worker.stats.held.load(Ordering::Relaxed), 9);
        assert_eq!(worker.stats.pending.load(Ordering::Relaxed), 9);
        assert_eq!(worker.stats.dropped.load(Ordering::Relaxed), 32);
        assert!(pipelines[&key].debt.is_owed());
    }

    /// A notification a webhook's full queue refused makes its next one the
    /// task as it then is.
    #[tokio::test]
    async fn a_notification_dropped_at_a_full_webhook_queue_is_made_up_by_the_next() {
        let ((_dir, _ledger), worker, config) = worker_for("http://127.0.0.1:9/".into()).await;
        let (sender, mut receiver) = mpsc::channel(1);
        let (_finish, finished) = oneshot::channel();
        let queue = Pipeline {
            sender,
            finished,
            debt: Arc::default(),
        };
        let key = (config.task_id.clone(), config.id.clone());
        let mut pipelines = HashMap::from([(key.clone(), queue)]);
        let mut prune_at = PRUNE_AT_LEAST;
        let event = |seq| notification_at(&worker, &config, TaskState::Working, seq).told;
        for seq in 1..=3 {
            worker
                .hand_out("t", &event(seq), None, &mut pipelines, &mut prune_at)
                .await;
        }
        assert_eq!(worker.stats.dropped.load(Ordering::Relaxed), 2);
        assert!(pipelines[&key].debt.is_owed());
        let first = receiver.recv().await.unwrap();
        assert!(matches!(first.told, Told::Event { event, .. } if event.seq == 1));
        worker
            .hand_out("t", &event(4), None, &mut pipelines, &mut prune_at)
            .await;
        assert!(matches!(receiver.recv().await.unwrap().told, Told::Latest));
        assert!(!pipelines[&key].debt.is_owed());
        worker
            .hand_out("t", &event(5), None, &mut pipelines, &mut prune_at)
            .await;
        let next = receiver.recv().await.unwrap();
        assert!(matches!(next.told, Told::Event { event, .. } if event.seq == 5));
    }

    /// An event a full shard queue dropped is made up by the next of the
    /// task's events the shard takes: its webhooks are told the task as it
    /// then is, which holds the dropped one.
    #[tokio::test]
    async fn an_event_dropped_at_a_full_shard_queue_is_made_up_by_the_next() {
        let (url, seen) = slow_first_webhook().await;
        let ((_dir, ledger), worker, config) = worker_for(url).await;
        let states = [
            TaskState::Working,
            TaskState::InputRequired,
            TaskState::Completed,
        ];
        task_in(&ledger, &states).await;
        let dispatcher = one_slot_dispatcher(&ledger, &worker, &config, states[0], &seen).await;
        // The shard's worker does not run meanwhile: its queue holds one.
        dispatcher.enqueue(&event_at(&config, states[1], 2));
        dispatcher.enqueue(&event_at(&config, states[2], 3));
        assert_eq!(dispatcher.stats.dropped.load(Ordering::Relaxed), 1);
        assert_eq!(
            settled(&seen, 2).await,
            ["\"TASK_STATE_WORKING\"", "task \"TASK_STATE_COMPLETED\""]
        );
    }

    #[tokio::test]
    async fn a_webhook_s_next_pipeline_waits_for_the_one_that_ended_idle() {
        let (url, seen) = slow_first_webhook().await;
        let (_ledger, worker, config) = worker_for(url).await;
        // A pipeline closes as it ends idle, still holding a notification;
        // the webhook's next one starts while that is being delivered.
        let earlier = Worker::pipeline(&worker, None, Arc::default());
        earlier
            .sender
            .try_send(notification_at(&worker, &config, TaskState::Working, 1))
            .unwrap();
        drop(earlier.sender);
        let next = Worker::pipeline(&worker, Some(earlier.finished), Arc::default());
        next.sender
            .try_send(notification_at(&worker, &config, TaskState::Completed, 2))
            .unwrap();
        let seen = until_seen(&seen, 2).await;
        assert_eq!(seen, ["\"TASK_STATE_WORKING\"", "\"TASK_STATE_COMPLETED\""]);
        // Each is counted out once delivered.
        for _ in 0..100 {
            if worker.stats.pending.load(Ordering::Acquire) == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(worker.stats.pending.load(Ordering::Acquire), 0);
    }

    /// Waits until the last state `seen` holds is `last`.
    async fn until_last(seen: &Mutex<Vec<String>>, last: &str) -> Vec<String> {
        seen_when(seen, |states| states.last().is_some_and(|s| s == last)).await
    }

    /// A notification a webhook's full queue refused is made up once the
    /// queue is empty, though no later one comes: a task's last event may
    /// be the one refused.
    #[tokio::test]
    async fn a_webhook_queue_full_at_a_tasks_last_event_makes_it_up_once_empty() {
        let (url, seen) = slow_first_webhook().await;
        let ((_dir, ledger), worker, config) = worker_for(url).await;
        task_in(&ledger, &[TaskState::Working, TaskState::Completed]).await;
        let mut pipelines = HashMap::new();
        let mut prune_at = PRUNE_AT_LEAST;
        let events = WEBHOOK_QUEUE as u64 + 8;
        for seq in 1..=events {
            let told = notification_at(&worker, &config, TaskState::Working, seq).told;
            worker
                .hand_out("t", &told, None, &mut pipelines, &mut prune_at)
                .await;
        }
        assert!(worker.stats.dropped.load(Ordering::Relaxed) > 0);
        let seen = until_last(&seen, "task \"TASK_STATE_COMPLETED\"").await;
        assert_eq!(
            seen.last().map(String::as_str),
            Some("task \"TASK_STATE_COMPLETED\""),
            "{} notifications",
            seen.len()
        );
        assert!(
            !pipelines[&("t".to_string(), "hook".to_string())]
                .debt
                .is_owed()
        );
    }

    /// An event a full shard queue dropped, with no later event of its
    /// task behind it, is made up once the shard's queue is empty.
    #[tokio::test]
    async fn a_tasks_last_event_dropped_at_a_full_shard_queue_is_made_up_once_it_empties() {
        let (url, seen) = slow_first_webhook().await;
        let ((_dir, ledger), worker, config) = worker_for(url).await;
        let states = [
            TaskState::Working,
            TaskState::InputRequired,
            TaskState::Completed,
        ];
        task_in(&ledger, &states).await;
        let dispatcher = one_slot_dispatcher(&ledger, &worker, &config, states[0], &seen).await;
        // Another task's event fills the queue (the shard's worker does not
        // run meanwhile); this task's last is dropped.
        let other = TaskPushNotificationConfig {
            task_id: "u".into(),
            ..config.clone()
        };
        dispatcher.enqueue(&event_at(&other, TaskState::Working, 1));
        dispatcher.enqueue(&event_at(&config, states[2], 3));
        assert_eq!(dispatcher.stats.dropped.load(Ordering::Relaxed), 1);
        assert_eq!(
            settled(&seen, 2).await,
            ["\"TASK_STATE_WORKING\"", "task \"TASK_STATE_COMPLETED\""]
        );
    }

    /// Past the tasks a shard notes as dropped, which are unknown, every
    /// webhook the ledger finds behind is made up once the queue is empty.
    #[tokio::test]
    async fn drops_past_what_a_shard_notes_are_made_up_from_the_ledger() {
        let (url, seen) = slow_first_webhook().await;
        let ((_dir, ledger), worker, config) = worker_for(url).await;
        let states = [TaskState::Working, TaskState::Completed];
        task_in(&ledger, &states).await;
        let dispatcher = one_slot_dispatcher(&ledger, &worker, &config, states[0], &seen).await;
        let other = |n: usize| TaskPushNotificationConfig {
            task_id: format!("u{n}"),
            ..config.clone()
        };
        for n in 0..=MAX_GAPS {
            dispatcher.enqueue(&event_at(&other(n), TaskState::Working, 1));
        }
        dispatcher.enqueue(&event_at(&config, states[1], 2));
        assert_eq!(
            dispatcher.stats.dropped.load(Ordering::Relaxed),
            MAX_GAPS as u64 + 1
        );
        let seen = until_last(&seen, "task \"TASK_STATE_COMPLETED\"").await;
        assert_eq!(
            seen,
            ["\"TASK_STATE_WORKING\"", "task \"TASK_STATE_COMPLETED\""]
        );
    }

    /// A task in `states` whose webhook at `url` is given its first event on
    /// a pipeline, which gives it up after two failed attempts.
    async fn first_given_up(
        url: String,
        states: &[TaskState],
    ) -> (
        (tempfile::TempDir, Arc<Ledger>),
        Arc<Worker>,
        TaskPushNotificationConfig,
        Pipeline,
    ) {
        let settings = PushSettings {
            max_attempts: 2,
            initial_backoff: Duration::from_millis(10),
            ..PushSettings::default()
        };
        let ((dir, ledger), worker, config) = worker_with(url, settings).await;
        task_in(&ledger, states).await;
        let pipeline = Worker::pipeline(&worker, None, Arc::default());
        let first = notification_at(&worker, &config, states[0], 1);
        pipeline.sender.try_send(first).unwrap();
        for _ in 0..250 {
            if worker.stats.failed.load(Ordering::Relaxed) == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(worker.stats.failed.load(Ordering::Relaxed), 1, "given up");
        ((dir, ledger), worker, config, pipeline)
    }

    /// A notification given up after its last attempt is still owed: the
    /// webhook's next one is the task as it is, and until that is
    /// delivered a restart owes it too.
    #[tokio::test]
    async fn a_notification_given_up_is_owed_by_the_next_and_by_a_restart() {
        let (url, seen) = recording_webhook(2, Duration::ZERO).await;
        let states = [TaskState::Working, TaskState::InputRequired];
        let ((_dir, ledger), worker, config, pipeline) = first_given_up(url, &states).await;
        let owed = vec![("t".to_string(), vec!["hook".to_string()])];
        assert_eq!(ledger.push_backlog().unwrap(), owed, "a restart owes it");

        let next = notification_at(&worker, &config, states[1], 2);
        pipeline.sender.try_send(next).unwrap();
        assert_eq!(
            settled(&seen, 1).await,
            ["task \"TASK_STATE_INPUT_REQUIRED\""]
        );
        assert!(ledger.push_backlog().unwrap().is_empty(), "made up");
    }

    /// A notification given up is owed by the webhook's next one also when
    /// a new pipeline takes it (the one that gave up ended idle).
    #[tokio::test]
    async fn a_notification_given_up_is_owed_by_the_next_pipelines_first() {
        let (url, seen) = recording_webhook(2, Duration::ZERO).await;
        let states = [
            TaskState::Working,
            TaskState::InputRequired,
            TaskState::Working,
        ];
        let ((_dir, ledger), worker, config, pipeline) = first_given_up(url, &states).await;
        drop(pipeline);

        let next = Worker::pipeline(&worker, None, Arc::default());
        let second = notification_at(&worker, &config, states[1], 2);
        next.sender.try_send(second).unwrap();
        assert_eq!(settled(&seen, 1).await, ["task \"TASK_STATE_WORKING\""]);
        assert!(ledger.push_backlog().unwrap().is_empty(), "made up");
        // The task as it was read held the third event, so that is not sent.
        let third = notification_at(&worker, &config, states[2], 3);
        next.sender.try_send(third).unwrap();
        assert_eq!(settled(&seen, 1).await.len(), 1);
    }

    #[test]
    fn a_shard_past_its_bound_of_noted_drops_tells_every_task_as_it_is() {
        let gaps = Gaps::default();
        assert!(!gaps.take("a"));
        gaps.note("a");
        assert!(gaps.take("a"));
        assert!(!gaps.take("a"), "taken once");
        for n in 0..=MAX_GAPS {
            gaps.note(&format!("t{n}"));
        }
        assert!(gaps.take("never-noted"), "past the bound, any task");
        let (tasks, overflowed) = gaps.take_all();
        assert_eq!(tasks.len(), MAX_GAPS);
        assert!(overflowed);
        assert!(!gaps.take("never-noted"), "cleared");
        assert_eq!(gaps.take_all(), (Vec::new(), false));
    }

    /// Get and Delete refuse a blank id, so creating one is refused too.
    #[test]
    fn a_blank_config_id_is_refused() {
        let config = |id: &str| TaskPushNotificationConfig {
            id: id.into(),
            task_id: "t".into(),
            url: "https://hooks.example/a".into(),
            ..TaskPushNotificationConfig::default()
        };
        let fields = |config: &TaskPushNotificationConfig| {
            let mut violations = Vec::new();
            check_fields(config, "p.", &mut violations);
            violations.into_iter().map(|v| v.field).collect::<Vec<_>>()
        };
        assert_eq!(fields(&config(" \t")), ["p.id"]);
        assert!(fields(&config("")).is_empty(), "absent: Baton makes one");
        assert!(fields(&config("a")).is_empty());
    }

    /// A webhook host that hangs holds at most its share of the POSTs in
    /// flight: another host's notification goes out meanwhile.
    #[tokio::test]
    async fn a_hanging_webhook_host_holds_at_most_its_share_of_posts_in_flight() {
        // Takes connections and never answers.
        let hanging = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let hanging_url = format!("http://{}/hook", hanging.local_addr().unwrap());
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((stream, _)) = hanging.accept().await {
                held.push(stream);
            }
        });
        let (url, seen) = slow_first_webhook().await;
        let settings = PushSettings {
            max_in_flight: 4,
            max_in_flight_per_host: 2,
            max_attempts: 1,
            request_timeout: Duration::from_secs(5),
            ..PushSettings::default()
        };
        let ((_dir, ledger), worker, config) = worker_with(url, settings).await;
        for n in 0..4 {
            let stuck = TaskPushNotificationConfig {
                id: format!("stuck{n}"),
                url: hanging_url.clone(),
                ..config.clone()
            };
            ledger.put_push_config(&stuck, 10).await.unwrap().unwrap();
            let event = event_at(&stuck, TaskState::Working, 1);
            let worker = worker.clone();
            tokio::spawn(async move {
                let body = encoded(&event.event).unwrap();
                worker.deliver(&stuck, &event, body).await
            });
        }
        // They take what they may.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let started = std::time::Instant::now();
        let event = event_at(&config, TaskState::Working, 1);
        let body = encoded(&event.event).unwrap();
        assert_eq!(worker.deliver(&config, &event, body).await, Delivery::Done);
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "waited {:?} for the hanging host's POSTs",
            started.elapsed()
        );
        assert_eq!(seen.lock().unwrap().len(), 1);
    }
}
