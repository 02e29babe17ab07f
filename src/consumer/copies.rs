//! Writing retry copies and dead letters: after the delay, until the write succeeds. The original
//! delivery settles only once its copy is durable, so a crash or a lost lease meanwhile replays
//! the original and nothing is lost.
//!
//! A failed write is told apart by [`Error::is_permanent`]:
//! - transient (throttling, a timeout): retried with jittered backoff;
//! - permanent (a missing stream, missing permissions): logged as an error naming the record,
//!   counted, and listed in [`StuckWrites`] (visible on the running consumer), then retried with a
//!   backoff growing to 30 s, so that fixing the cause (creating the stream, granting the action) lets
//!   the record through with nothing lost. The record holds its shard's checkpoint meanwhile;
//! - a retry copy over the record size limit (the envelope and origin headers made it too large)
//!   is spent: it goes to the dead-letter stream with that reason, or settles as a drop without
//!   one. A dead letter over the limit is stuck like any permanent failure.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::FutureExt;
use tokio::sync::mpsc;
use tracing::{error, info, warn};

use super::hooks::Settled;
use crate::backoff::Backoff;
use crate::destination::Destination;
use crate::envelope::Headers;
use crate::error::Error;
use crate::handler::Delivery;
use crate::paged::PagePosition;
use crate::position::Position;
use crate::producer::Producer;
use crate::retry::{RetryPlan, RetryPolicy};
use crate::track::DeliveryId;

/// Longest wait between two attempts of a transient failure.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// Longest wait between two attempts of a permanent failure.
const STUCK_BACKOFF: Duration = Duration::from_secs(30);

/// A copy or dead letter whose write fails for a reason that retrying cannot fix by itself.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StuckWrite {
    /// The shard of the original record.
    pub shard: String,
    /// The original record's position (zero for a paged event).
    pub position: Position,
    /// A paged event's position.
    pub page_position: Option<PagePosition>,
    /// The stream the copy is for (the consumed stream, or the dead-letter stream).
    pub to: String,
    /// Whether it is a dead letter (otherwise a retry copy).
    pub dead_letter: bool,
    /// The error, as displayed.
    pub error: String,
    /// When the write first failed for good.
    pub since: SystemTime,
}

/// The stuck writes of one consumer, shared by its shards. Cloning shares it.
#[derive(Clone, Default)]
pub(crate) struct StuckWrites {
    writes: Arc<Mutex<BTreeMap<(String, String), StuckWrite>>>,
}

impl fmt::Debug for StuckWrites {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StuckWrites")
            .field("count", &self.list().len())
            .finish()
    }
}

impl StuckWrites {
    pub(crate) fn list(&self) -> Vec<StuckWrite> {
        self.lock().values().cloned().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, String), StuckWrite>> {
        self.writes.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Removes a write's entry from [`StuckWrites`] when the write ends, however it ends (written,
/// or aborted with its shard).
struct Entry {
    stuck: StuckWrites,
    key: (String, String),
    listed: bool,
}

impl Drop for Entry {
    fn drop(&mut self) {
        if self.listed {
            self.stuck.lock().remove(&self.key);
        }
    }
}

/// What a write (a copy, a dead letter, a receipt) reports to its shard.
#[derive(Debug)]
pub(crate) enum WriteEvent {
    /// The copy, dead letter or receipt is durable (or the record was spent without a dead-letter
    /// stream): the original settles.
    Durable(DeliveryId, Delivery, Settled),
    /// The write fails for good for now: the original will not settle while this lasts.
    Stuck,
    /// A stuck write got through after all, or ended: no longer stuck.
    Unstuck,
    /// A held receipt is recorded: the delivery waits for it to be made terminal or released.
    Held(DeliveryId, Delivery),
    /// A paged event's retry is due: run this next attempt on its lane.
    Redeliver(Delivery),
}

/// A retry copy or dead letter on its way to a stream.
pub(crate) struct PendingWrite {
    pub(crate) id: DeliveryId,
    pub(crate) delivery: Delivery,
    pub(crate) stream: String,
    pub(crate) headers: Headers,
    pub(crate) delay: Duration,
    pub(crate) dead_letter: bool,
    /// In place: the next run is a new attempt (`false`: the attempt was not made).
    pub(crate) counted: bool,
}

impl PendingWrite {
    pub(crate) fn new(id: DeliveryId, delivery: Delivery, plan: RetryPlan) -> Option<Self> {
        let (stream, headers, delay, dead_letter, counted) = match plan {
            RetryPlan::Copy {
                stream,
                delay,
                headers,
                counted,
            } => (stream, headers, delay, false, counted),
            RetryPlan::DeadLetter { stream, headers } => {
                (stream, headers, Duration::ZERO, true, true)
            }
            RetryPlan::Refuse | RetryPlan::Drop { .. } | RetryPlan::Quarantine { .. } => {
                return None;
            }
        };
        Some(Self {
            id,
            delivery,
            stream,
            headers,
            delay,
            dead_letter,
            counted,
        })
    }

    /// Waits out the delay, then writes until it succeeds. Aborted with its shard: the original
    /// then stays unsettled and is read again by the next owner.
    pub(crate) async fn run(
        mut self,
        producer: Producer,
        destination: Option<Arc<dyn Destination>>,
        policy: Arc<RetryPolicy>,
        stuck: StuckWrites,
        events: mpsc::UnboundedSender<WriteEvent>,
    ) {
        tokio::time::sleep(self.delay).await;
        let d = self.delivery.clone();
        let mut entry = Entry {
            stuck: stuck.clone(),
            key: (d.shard().to_string(), d.locator().to_string()),
            listed: false,
        };
        let mut transient = Backoff::new(MAX_BACKOFF);
        let mut stuck_for = Backoff::new(STUCK_BACKOFF);
        loop {
            // A dead letter goes to the on-failure destination when there is one (the policy then
            // names it as the dead-letter "stream"); anything else to a stream.
            let put = async {
                match (&destination, self.dead_letter) {
                    (Some(destination), true) => destination
                        .send(&d, &self.headers)
                        .await
                        .map(|()| destination.name().to_string()),
                    _ => producer
                        .put(&self.stream, d.partition_key(), &self.headers, d.payload())
                        .await
                        .map(|written| written.shard_id),
                }
            };
            // A producer that panics is a failed write, written again: the task owns a tracked
            // delivery, which must end written or held, never left behind by a dead task.
            let Ok(result) = std::panic::AssertUnwindSafe(put).catch_unwind().await else {
                let wait = transient.next();
                error!(stream = d.stream(), shard = d.shard(), seq = %d.locator(), to = %self.stream, ?wait, "the producer panicked while writing a retry copy or dead letter; writing it again");
                tokio::time::sleep(wait).await;
                continue;
            };
            let error = match result {
                Ok(written) => {
                    let (what, metric) = if self.dead_letter {
                        ("dead letter written", "shardwise_dead_letters_total")
                    } else {
                        ("retry copy written", "shardwise_retries_total")
                    };
                    metrics::counter!(metric, "stream" => d.stream().to_string()).increment(1);
                    info!(
                        stream = d.stream(),
                        shard = d.shard(),
                        seq = %d.locator(),
                        to = %self.stream,
                        attempt = d.attempt(),
                        written_to = %written,
                        "{what}"
                    );
                    if entry.listed {
                        let _ = events.send(WriteEvent::Unstuck);
                    }
                    let how = if self.dead_letter {
                        Settled::DeadLettered(self.stream.clone())
                    } else {
                        Settled::Copied(self.stream.clone())
                    };
                    let _ = events.send(WriteEvent::Durable(self.id, d, how));
                    return;
                }
                Err(e) => e,
            };
            if matches!(error, Error::RecordTooLarge { .. }) && !self.dead_letter {
                // The copy cannot be written at any time: its retries are over.
                let reason = format!("retry copy not written: {error}");
                match policy.spent(&d, reason) {
                    RetryPlan::DeadLetter { stream, headers } => {
                        warn!(stream = d.stream(), shard = d.shard(), seq = %d.locator(), error = &error as &dyn std::error::Error, to = %stream, "retry copy too large: sent to the dead-letter stream instead");
                        self.stream = stream;
                        self.headers = headers;
                        self.dead_letter = true;
                        continue;
                    }
                    _ => {
                        error!(stream = d.stream(), shard = d.shard(), seq = %d.locator(), partition_key = d.partition_key(), error = &error as &dyn std::error::Error, "retry copy too large and no dead-letter stream: settled as a drop");
                        if entry.listed {
                            let _ = events.send(WriteEvent::Unstuck);
                        }
                        let _ = events.send(WriteEvent::Durable(self.id, d, Settled::Spent));
                        return;
                    }
                }
            }
            let permanent = error.is_permanent();
            metrics::counter!(
                "shardwise_copy_write_failures_total",
                "stream" => d.stream().to_string(),
                "permanent" => permanent.to_string()
            )
            .increment(1);
            let wait = if permanent {
                if !entry.listed {
                    error!(
                        stream = d.stream(),
                        shard = d.shard(),
                        seq = %d.locator(),
                        partition_key = d.partition_key(),
                        to = %self.stream,
                        dead_letter = self.dead_letter,
                        error = &error as &dyn std::error::Error,
                        retry_at_most_every = ?STUCK_BACKOFF,
                        "writing a retry copy or dead letter fails for good: the record holds its shard's checkpoint until the cause is fixed"
                    );
                    stuck.lock().insert(
                        entry.key.clone(),
                        StuckWrite {
                            shard: d.shard().to_string(),
                            position: *d.position(),
                            page_position: d.page_position().cloned(),
                            to: self.stream.clone(),
                            dead_letter: self.dead_letter,
                            error: error.to_string(),
                            since: crate::time::now(),
                        },
                    );
                    entry.listed = true;
                    let _ = events.send(WriteEvent::Stuck);
                }
                stuck_for.next()
            } else {
                let wait = transient.next();
                warn!(
                    stream = d.stream(),
                    shard = d.shard(),
                    seq = %d.locator(),
                    to = %self.stream,
                    error = &error as &dyn std::error::Error,
                    ?wait,
                    "writing a retry copy or dead letter failed; the original stays unsettled"
                );
                wait
            };
            tokio::time::sleep(wait).await;
        }
    }
}
