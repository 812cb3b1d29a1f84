//! In-memory fan-out of ledger events to the streams watching each task.
//!
//! Each task with watchers has one broadcast channel. Events arrive here only
//! after they are durable, in ledger order, each with its sequence number, so
//! a watcher that falls behind can replay the gap from the ledger's event log.

use crate::protocol::StreamResponse;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::broadcast;

/// Every how many `watch` calls unwatched channels are dropped.
const SWEEP_EVERY: u64 = 1024;

/// Events the channel of a streamed task holds before a watcher that falls
/// behind must replay: the largest single write (an agent's burst of 64
/// events, and the task's snapshot) fits, so a stream that keeps reading
/// never replays.
const STREAM_CAPACITY: usize = 128;

/// Events the channel made for a blocking send holds. The send looks only
/// for a settled state, and reads the record after a lag. tokio builds every
/// slot when a channel is made, and each blocking send that must wait makes
/// one: 32 slots instead of 256 took ~3 µs off a send's worker time (README,
/// round 10).
const OUTCOME_CAPACITY: usize = 32;

/// One durable event of one task.
#[derive(Debug)]
pub struct LedgerEvent {
    /// The task.
    pub task_id: String,
    /// Position in the task's event log, from 1.
    pub seq: u64,
    /// The event.
    pub event: StreamResponse,
    /// The event as JSON, encoded once however many streams carry it.
    json: std::sync::OnceLock<Box<serde_json::value::RawValue>>,
}

impl LedgerEvent {
    /// Event `seq` of `task_id`.
    pub fn new(task_id: String, seq: u64, event: StreamResponse) -> Self {
        Self {
            task_id,
            seq,
            event,
            json: std::sync::OnceLock::new(),
        }
    }

    /// The event as JSON (encoded on first use, then shared).
    pub fn json(&self) -> Result<&serde_json::value::RawValue, serde_json::Error> {
        if let Some(json) = self.json.get() {
            return Ok(json);
        }
        let json = serde_json::value::to_raw_value(&self.event)?;
        Ok(self.json.get_or_init(|| json))
    }
}

/// A callback for every durable event (push delivery hooks in here).
pub type EventSink = Box<dyn Fn(&std::sync::Arc<LedgerEvent>) + Send + Sync>;

/// One task's broadcast channel.
struct Channel {
    sender: broadcast::Sender<std::sync::Arc<LedgerEvent>>,
    capacity: usize,
}

impl Channel {
    fn new(capacity: usize) -> Self {
        Self {
            sender: broadcast::channel(capacity).0,
            capacity,
        }
    }
}

/// Fan-out of durable events to per-task watchers.
#[derive(Default)]
pub struct EventHub {
    // std Mutex: only map operations under it, no await.
    channels: Mutex<HashMap<String, Channel>>,
    sinks: Mutex<Vec<EventSink>>,
    watches: AtomicU64,
}

impl EventHub {
    /// Watches `task_id` for a stream; the receiver gets every event
    /// published after this call. A smaller channel, made for a blocking
    /// send, is replaced: its receivers see it closed and watch again.
    pub fn watch(&self, task_id: &str) -> broadcast::Receiver<std::sync::Arc<LedgerEvent>> {
        self.subscribe(task_id, STREAM_CAPACITY)
    }

    /// Watches `task_id` for a blocking send, which only needs to see the
    /// task settle: the task's channel if it has one, else a small one.
    pub fn watch_outcome(&self, task_id: &str) -> broadcast::Receiver<std::sync::Arc<LedgerEvent>> {
        self.subscribe(task_id, OUTCOME_CAPACITY)
    }

    fn subscribe(
        &self,
        task_id: &str,
        capacity: usize,
    ) -> broadcast::Receiver<std::sync::Arc<LedgerEvent>> {
        let mut channels = self.channels.lock().expect("hub lock");
        // A task that stops without a terminal event (interrupted, abandoned)
        // leaves its channel behind; sweep those now and then.
        if self.watches.fetch_add(1, Ordering::Relaxed) % SWEEP_EVERY == 0 {
            channels.retain(|_, channel| channel.sender.receiver_count() > 0);
        }
        if let Some(channel) = channels.get_mut(task_id) {
            if channel.capacity < capacity {
                *channel = Channel::new(capacity);
            }
            return channel.sender.subscribe();
        }
        // The id is copied only for a task's first channel.
        let channel = Channel::new(capacity);
        let receiver = channel.sender.subscribe();
        channels.insert(task_id.to_string(), channel);
        receiver
    }

    /// How many tasks have a channel.
    #[cfg(test)]
    pub(crate) fn watched_tasks(&self) -> usize {
        self.channels.lock().expect("hub lock").len()
    }

    /// Adds a callback that sees every durable event.
    pub fn add_sink(&self, sink: EventSink) {
        self.sinks.lock().expect("hub lock").push(sink);
    }

    /// Publishes one durable event.
    pub fn publish(&self, event: std::sync::Arc<LedgerEvent>) {
        for sink in self.sinks.lock().expect("hub lock").iter() {
            sink(&event);
        }
        let mut channels = self.channels.lock().expect("hub lock");
        let terminal = event.event.state().is_some_and(|s| s.is_terminal());
        if let Some(Channel { sender, .. }) = channels.get(&event.task_id) {
            if sender.receiver_count() > 0 {
                let _ = sender.send(event.clone());
            }
            // Nothing follows a terminal event; watchers drain, then see Closed.
            if terminal || sender.receiver_count() == 0 {
                channels.remove(&event.task_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{TaskState, TaskStatus, TaskStatusUpdateEvent};
    use std::sync::Arc;
    use tokio::sync::broadcast::error::TryRecvError;

    fn publish_working(hub: &EventHub, task_id: &str, events: u64) {
        for seq in 1..=events {
            let event = StreamResponse::StatusUpdate(TaskStatusUpdateEvent {
                task_id: task_id.to_string(),
                context_id: "ctx".into(),
                status: TaskStatus::now(TaskState::Working, None),
                ..TaskStatusUpdateEvent::default()
            });
            hub.publish(Arc::new(LedgerEvent::new(task_id.to_string(), seq, event)));
        }
    }

    #[test]
    fn a_stream_takes_the_largest_write_whole_where_a_blocking_send_falls_behind() {
        let largest_write = 65;
        let hub = EventHub::default();
        let mut outcome = hub.watch_outcome("t1");
        publish_working(&hub, "t1", largest_write);
        assert!(matches!(outcome.try_recv(), Err(TryRecvError::Lagged(_))));

        let mut stream = hub.watch("t2");
        publish_working(&hub, "t2", largest_write);
        for seq in 1..=largest_write {
            assert_eq!(stream.try_recv().unwrap().seq, seq);
        }
    }

    #[test]
    fn a_stream_replaces_a_blocking_sends_smaller_channel() {
        let hub = EventHub::default();
        let mut outcome = hub.watch_outcome("t");
        let mut stream = hub.watch("t");
        publish_working(&hub, "t", 1);
        assert_eq!(stream.try_recv().unwrap().seq, 1);
        // The send's receiver sees its channel closed, and watches again.
        assert!(matches!(outcome.try_recv(), Err(TryRecvError::Closed)));
        let mut outcome = hub.watch_outcome("t");
        let mut second_stream = hub.watch("t");
        publish_working(&hub, "t", 1);
        assert_eq!(outcome.try_recv().unwrap().seq, 1);
        assert_eq!(second_stream.try_recv().unwrap().seq, 1);
        assert_eq!(stream.try_recv().unwrap().seq, 1);
    }
}
