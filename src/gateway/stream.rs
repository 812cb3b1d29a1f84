//! The event stream of one task, as SendStreamingMessage and SubscribeToTask
//! deliver it: a snapshot or the task's first event, then every later event
//! in ledger order, replaying from the ledger when the watcher falls behind.

use super::Gateway;
use crate::error::GatewayError;
use crate::protocol::StreamResponse;
use crate::store::TaskRecord;
use crate::store::hub::LedgerEvent;
use futures::stream::{BoxStream, StreamExt};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::broadcast;

/// First wait before a failed replay is tried again; it doubles, up to
/// [`MAX_REPLAY_RETRY`].
const REPLAY_RETRY: Duration = Duration::from_millis(100);

/// Longest wait between a stream's replay attempts.
const MAX_REPLAY_RETRY: Duration = Duration::from_secs(2);

/// A task's events for one subscriber.
pub struct TaskEventStream {
    gateway: Arc<Gateway>,
    task_id: String,
    watcher: broadcast::Receiver<Arc<LedgerEvent>>,
    /// Shared with the ledger's fan-out, so 1 000 subscribers of one task
    /// clone and encode each event once, not 1 000 times.
    queue: VecDeque<Arc<LedgerEvent>>,
    last_seq: u64,
    /// A replay stopped at a page's end: the next follows once the queue
    /// is sent, whether or not a new event comes.
    replay_unfinished: bool,
    /// SendStreamingMessage ends at an interrupted state too; SubscribeToTask
    /// only at a terminal one.
    end_on_interrupt: bool,
    done: bool,
    /// Baton stopped it: its last item is [`GatewayError::Stopping`].
    stopping: bool,
}

impl TaskEventStream {
    /// The current task, then every event after it.
    pub fn from_snapshot(
        gateway: Arc<Gateway>,
        record: &TaskRecord,
        watcher: broadcast::Receiver<Arc<LedgerEvent>>,
        end_on_interrupt: bool,
    ) -> Self {
        let done = record.task.status.state.is_terminal();
        Self {
            gateway,
            task_id: record.task.id.clone(),
            watcher,
            queue: VecDeque::from([Arc::new(LedgerEvent::new(
                record.task.id.clone(),
                record.last_seq,
                StreamResponse::Task(record.task.view(None, true)),
            ))]),
            last_seq: record.last_seq,
            replay_unfinished: false,
            end_on_interrupt,
            done,
            stopping: false,
        }
    }

    /// Every event of a new task from its first (its snapshot).
    pub fn from_start(
        gateway: Arc<Gateway>,
        task_id: String,
        watcher: broadcast::Receiver<Arc<LedgerEvent>>,
    ) -> Self {
        Self {
            gateway,
            task_id,
            watcher,
            queue: VecDeque::new(),
            last_seq: 0,
            replay_unfinished: false,
            end_on_interrupt: true,
            done: false,
            stopping: false,
        }
    }

    fn is_final(&self, event: &StreamResponse) -> bool {
        event
            .state()
            .is_some_and(|s| s.is_terminal() || (self.end_on_interrupt && s.is_interrupted()))
    }

    /// Fills the queue from the ledger's log after `last_seq`, once durable,
    /// a page at a time.
    /// A ledger that cannot say (its log or sled failing) is asked again,
    /// backing off, rather than the stream ending as if the task had: a
    /// client reading to the end would take that for the whole stream.
    async fn replay(&mut self) {
        let mut backoff = REPLAY_RETRY;
        loop {
            let replayed = self
                .gateway
                .ledger
                .durable_events_after(&self.task_id, self.last_seq)
                .await;
            match replayed {
                Ok(page) => {
                    for event in page.events {
                        self.last_seq = event.seq;
                        self.queue.push_back(Arc::new(event));
                    }
                    self.replay_unfinished = page.more;
                    return;
                }
                Err(err) => {
                    tracing::warn!(task_id = %self.task_id, %err, ?backoff, "stream replay failed; trying again");
                }
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                _ = self.gateway.shutdown.cancelled() => {
                    self.stop();
                    return;
                }
            }
            backoff = (backoff * 2).min(MAX_REPLAY_RETRY);
        }
    }

    async fn next_event(&mut self) -> Option<Result<Arc<LedgerEvent>, GatewayError>> {
        loop {
            if let Some(event) = self.queue.pop_front() {
                if self.is_final(&event.event) {
                    self.done = true;
                    self.queue.clear();
                }
                return Some(Ok(event));
            }
            if self.done {
                return std::mem::take(&mut self.stopping).then(|| {
                    Err(GatewayError::Stopping {
                        task_id: self.task_id.clone(),
                    })
                });
            }
            if self.replay_unfinished {
                self.replay().await;
                continue;
            }
            tokio::select! {
                received = self.watcher.recv() => match received {
                    Ok(event) if event.seq <= self.last_seq => {}
                    Ok(event) if event.seq == self.last_seq + 1 => {
                        self.last_seq = event.seq;
                        self.queue.push_back(event);
                    }
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => self.replay().await,
                    Err(broadcast::error::RecvError::Closed) => {
                        self.watcher = self.gateway.ledger.hub().watch(&self.task_id);
                        self.replay().await;
                    }
                },
                _ = self.gateway.shutdown.cancelled() => self.stop(),
            }
        }
    }

    /// Ends the stream at a stop: what is queued is dropped (the ledger
    /// keeps it for a resubscription), and the stream's last item says so.
    fn stop(&mut self) {
        self.done = true;
        self.stopping = true;
        self.queue.clear();
    }

    /// The events as a stream that ends after the final one, or with an
    /// error when Baton stops first.
    pub fn into_stream(self) -> BoxStream<'static, Result<Arc<LedgerEvent>, GatewayError>> {
        futures::stream::unfold(self, |mut stream| async move {
            stream.next_event().await.map(|event| (event, stream))
        })
        .boxed()
    }
}
