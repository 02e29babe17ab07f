//! One owned shard: reader -> lanes -> tracker -> coalesced, fenced checkpoints.
//!
//! States and what each write is conditioned on:
//!
//! ```text
//! READING ──stop──► DRAINING ──drained or deadline──► FINAL CHECKPOINT ──► Stopped
//!    │                                                     ▲
//!    └──reader at end──► ENDING ──drained──► SHARD_END write ──► Ended (lease released)
//! any state ──lease lost (token) or a write refused as Lost──► Lost (no further writes)
//! ```
//!
//! Every checkpoint write is the store's fenced write: owner and ownership epoch of this lease, and
//! a position greater than the stored one. At most one write is in flight, and at most one starts
//! per `checkpoint_interval`; an idle shard writes nothing. SHARD_END is written only once every
//! delivery of the shard has settled.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::config::Settings;
use super::lanes::{Finished, Lanes};
use crate::checkpoint::Checkpoint;
use crate::envelope::Headers;
use crate::error::{AckError, Error};
use crate::frontier::{self, ShardProgress};
use crate::handler::{Delivery, Handler, Outcome};
use crate::lease::{CheckpointWrite, HeldLease, LeaseStore, Ownership};
use crate::position::Position;
use crate::producer::Producer;
use crate::retry::{RetryPlan, RetryPolicy};
use crate::shard::reader::{ReaderMessage, ShardReader};
use crate::shard::source::RecordSource;
use crate::time::millis;
use crate::track::{DeliveryId, Tracker};

/// How a shard's run ended.
#[derive(Debug)]
pub(crate) enum ShardExit {
    /// Read to its end, every delivery settled, SHARD_END written.
    Ended(Ownership),
    /// Stopped on request; the final checkpoint was written (or attempted).
    Stopped(Ownership),
    /// The lease was lost: nothing more was written.
    Lost(Ownership),
    /// Reading failed for good (stream or shard gone).
    Failed(Ownership, Error),
}

/// What a shard needs from the consumer.
pub(crate) struct ShardContext<H> {
    pub(crate) handler: Arc<H>,
    pub(crate) source: Arc<dyn RecordSource>,
    pub(crate) store: Arc<dyn LeaseStore>,
    pub(crate) settings: Arc<Settings>,
    /// Writes retry copies and dead letters.
    pub(crate) producer: Producer,
    /// What retries become.
    pub(crate) retry: Arc<RetryPolicy>,
    /// Graceful stop: stop reading, drain, write the final checkpoint.
    pub(crate) stop: CancellationToken,
    /// The drain deadline passed: abort running handlers and write what has settled.
    pub(crate) abort: CancellationToken,
}

impl<H> Clone for ShardContext<H> {
    fn clone(&self) -> Self {
        Self {
            handler: self.handler.clone(),
            source: self.source.clone(),
            store: self.store.clone(),
            settings: self.settings.clone(),
            producer: self.producer.clone(),
            retry: self.retry.clone(),
            stop: self.stop.clone(),
            abort: self.abort.clone(),
        }
    }
}

/// A tracked delivery: its position and arrival time (ms).
type Entry = (Position, Option<i64>);

struct Checkpointer {
    store: Arc<dyn LeaseStore>,
    ownership: Ownership,
    /// Settled through here but not yet written.
    pending: Option<Position>,
    in_flight: Option<InFlight>,
    labels: [(&'static str, String); 2],
    /// Frontier inputs besides the tracker (see `frontier::complete_through`).
    last_settled: Option<i64>,
    caught_up_at: Option<i64>,
    /// The stored `completeThrough`: what this shard's coordinate never goes below.
    floor: Option<i64>,
    caught_up_skew: Option<Duration>,
    frontier_interval: Duration,
    frontier_written_at: Option<Instant>,
}

struct InFlight {
    to: Position,
    complete_through: Option<i64>,
    handle: JoinHandle<Result<CheckpointWrite, Error>>,
}

impl Checkpointer {
    fn complete_through(&self, tracker: &Tracker<Entry>) -> Option<i64> {
        frontier::complete_through(
            &ShardProgress {
                oldest_unsettled: tracker.oldest_unsettled().and_then(|e| e.1),
                last_settled: self.last_settled,
                caught_up_at: self.caught_up_at,
                floor: self.floor,
            },
            self.caught_up_skew,
        )
    }

    fn start(&mut self, to: Position, complete_through: Option<i64>) {
        let store = self.store.clone();
        let ownership = self.ownership.clone();
        self.in_flight = Some(InFlight {
            to,
            complete_through,
            handle: tokio::spawn(async move {
                store
                    .checkpoint(&ownership, &Checkpoint::At(to), complete_through)
                    .await
            }),
        });
    }

    /// Starts a write of the pending position if none is in flight.
    fn maybe_start(&mut self, tracker: &Tracker<Entry>) {
        if self.in_flight.is_none()
            && let Some(to) = self.pending.take()
        {
            let ct = self.complete_through(tracker);
            self.start(to, ct);
        }
    }

    /// For an idle, caught-up shard: raises `completeThrough` alone, at most once per frontier
    /// interval, and only with a clock-skew allowance configured. `Err(())`: the lease is lost.
    async fn maybe_advance_frontier(&mut self, tracker: &Tracker<Entry>) -> Result<(), ()> {
        if self.caught_up_skew.is_none()
            || self.pending.is_some()
            || self.in_flight.is_some()
            || !tracker.is_drained()
            || self
                .frontier_written_at
                .is_some_and(|t| t.elapsed() < self.frontier_interval)
        {
            return Ok(());
        }
        let Some(ct) = self.complete_through(tracker) else {
            return Ok(());
        };
        if self.floor.is_some_and(|f| f >= ct) {
            return Ok(());
        }
        self.frontier_written_at = Some(Instant::now());
        match self.store.advance_frontier(&self.ownership, ct).await {
            Ok(CheckpointWrite::Written) => {
                self.floor = Some(ct);
                Ok(())
            }
            Ok(CheckpointWrite::NotNewer) => Ok(()),
            Ok(CheckpointWrite::Lost) => Err(()),
            Err(e) => {
                warn!(shard = %self.ownership.shard_id, error = %e, "frontier write failed; will retry");
                Ok(())
            }
        }
    }

    /// Waits for the write in flight. `Err(())`: the lease is lost.
    async fn finish(&mut self) -> Result<(), ()> {
        let Some(write) = self.in_flight.take() else {
            return Ok(());
        };
        let result = write.handle.await.unwrap_or_else(|e| {
            Err(Error::Corrupt {
                what: "checkpoint task",
                detail: e.to_string(),
            })
        });
        self.record(write.to, write.complete_through, result)
    }

    fn record(
        &mut self,
        to: Position,
        complete_through: Option<i64>,
        result: Result<CheckpointWrite, Error>,
    ) -> Result<(), ()> {
        match result {
            Ok(CheckpointWrite::Written) => {
                metrics::counter!("shardwise_checkpoint_writes_total", &self.labels).increment(1);
                debug!(shard = %self.ownership.shard_id, checkpoint = %to, ?complete_through, "checkpoint written");
                if complete_through.is_some() {
                    self.floor = self.floor.max(complete_through);
                }
                Ok(())
            }
            Ok(CheckpointWrite::NotNewer) => {
                debug!(shard = %self.ownership.shard_id, checkpoint = %to, "checkpoint not newer than the stored one");
                Ok(())
            }
            Ok(CheckpointWrite::Lost) => Err(()),
            Err(e) => {
                warn!(shard = %self.ownership.shard_id, error = %e, "checkpoint write failed; will retry");
                if self.pending.is_none_or(|p| p < to) {
                    self.pending = Some(to);
                }
                Ok(())
            }
        }
    }

    /// Writes everything settled, waiting for it. `Err(())`: the lease is lost.
    async fn flush(&mut self, tracker: &Tracker<Entry>) -> Result<(), ()> {
        self.finish().await?;
        for _ in 0..3 {
            let Some(to) = self.pending.take() else {
                return Ok(());
            };
            let ct = self.complete_through(tracker);
            let result = self
                .store
                .checkpoint(&self.ownership, &Checkpoint::At(to), ct)
                .await;
            self.record(to, ct, result)?;
        }
        Ok(())
    }
}

/// Runs one shard until it ends, is stopped, or its lease is lost.
pub(crate) async fn run_shard<H: Handler>(ctx: ShardContext<H>, held: HeldLease) -> ShardExit {
    let settings = &ctx.settings;
    let ownership = held.ownership.clone();
    let shard: Arc<str> = Arc::from(ownership.shard_id.as_str());
    let stream: Arc<str> = Arc::from(ownership.stream.as_str());
    let lost = held.cancel.clone();
    let labels = [
        ("stream", ownership.stream.clone()),
        ("shard", ownership.shard_id.clone()),
    ];
    info!(stream = %stream, shard = %shard, epoch = ownership.epoch, checkpoint = %held.lease.checkpoint, "shard started");

    let mut checkpointer = Checkpointer {
        store: ctx.store.clone(),
        ownership: ownership.clone(),
        pending: None,
        in_flight: None,
        labels: labels.clone(),
        last_settled: None,
        caught_up_at: None,
        floor: held.lease.complete_through,
        caught_up_skew: settings.caught_up_skew,
        frontier_interval: settings.frontier_interval,
        frontier_written_at: None,
    };

    let (reader_tx, mut reader_rx) = mpsc::channel(1);
    let reader_cancel = lost.child_token();
    let mut reading = match ShardReader::new(
        ctx.source.clone(),
        &ownership.stream,
        &ownership.shard_id,
        &held.lease.checkpoint,
        settings.reader,
    ) {
        Some(reader) => {
            tokio::spawn(reader.run(reader_tx, reader_cancel.clone()));
            true
        }
        None => false, // already at SHARD_END
    };
    let mut ended = !reading;
    let _stop_reader = reader_cancel.clone().drop_guard();

    let (finished_tx, mut finished_rx) = mpsc::unbounded_channel::<Finished>();
    let mut lanes = Lanes::start(
        settings.lanes,
        settings.ordering,
        ctx.handler.clone(),
        finished_tx,
    );
    let mut tracker: Tracker<Entry> = Tracker::new(ownership.epoch);
    let mut refused: HashSet<DeliveryId> = HashSet::new();
    let (durable_tx, mut durable_rx) = mpsc::unbounded_channel::<DeliveryId>();
    let mut retries: JoinSet<()> = JoinSet::new();
    let mut tick = tokio::time::interval(settings.checkpoint_interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut aborted = false;

    let exit = loop {
        let room = tracker.window() < settings.max_in_flight;
        let writing = checkpointer.in_flight.is_some();
        tokio::select! {
            biased;
            _ = lost.cancelled() => break Exit::Lost,
            _ = ctx.abort.cancelled(), if !aborted => {
                aborted = true;
                lanes.abort();
                retries.abort_all();
                reading = false;
                reader_cancel.cancel();
            }
            _ = ctx.stop.cancelled(), if reading => {
                reading = false;
                reader_cancel.cancel();
                lanes.close();
            }
            result = async { (&mut checkpointer.in_flight.as_mut().expect("writing").handle).await }, if writing => {
                let write = checkpointer.in_flight.take().expect("writing");
                let result = result.unwrap_or_else(|e| Err(Error::Corrupt { what: "checkpoint task", detail: e.to_string() }));
                if checkpointer.record(write.to, write.complete_through, result).is_err() {
                    break Exit::Lost;
                }
            }
            Some(done) = finished_rx.recv() => {
                lanes.finished(&done.delivery);
                match resolve(done, &ctx.retry, &mut refused, settings) {
                    Resolved::Settle(id) => settle(&mut tracker, &mut checkpointer, id),
                    Resolved::Hold => {}
                    Resolved::Write(write) => {
                        retries.spawn(write.run(ctx.producer.clone(), durable_tx.clone()));
                    }
                }
                metrics::gauge!("shardwise_in_flight", &labels).set(tracker.unsettled() as f64);
            }
            Some(id) = durable_rx.recv() => {
                settle(&mut tracker, &mut checkpointer, id);
                metrics::gauge!("shardwise_in_flight", &labels).set(tracker.unsettled() as f64);
            }
            Some(_) = retries.join_next(), if !retries.is_empty() => {}
            msg = reader_rx.recv(), if reading && room => match msg {
                Some(ReaderMessage::Records { records, millis_behind_latest }) => {
                    if let Some(ms) = millis_behind_latest {
                        metrics::gauge!("shardwise_millis_behind_latest", &labels).set(ms as f64);
                    }
                    checkpointer.caught_up_at = (records.is_empty() && millis_behind_latest == Some(0))
                        .then(|| millis(SystemTime::now()));
                    for r in records {
                        let id = tracker.track((r.position, r.arrived_at.map(millis)));
                        let lane = lanes.assign(&r.partition_key);
                        let delivery = Delivery::from_blob(stream.clone(), shard.clone(), r.position, r.partition_key, r.data)
                            .set_arrived_at(r.arrived_at)
                            .set_explicit_hash_key(r.explicit_hash_key)
                            .id(id)
                            .lane(lane)
                            .build();
                        lanes.dispatch(delivery);
                    }
                    metrics::gauge!("shardwise_in_flight", &labels).set(tracker.unsettled() as f64);
                }
                Some(ReaderMessage::End) => {
                    reading = false;
                    ended = true;
                    lanes.close();
                }
                Some(ReaderMessage::Failed(e)) => break Exit::Failed(e),
                None => { reading = false; }
            },
            _ = tick.tick() => {
                checkpointer.maybe_start(&tracker);
                if checkpointer.maybe_advance_frontier(&tracker).await.is_err() {
                    break Exit::Lost;
                }
            }
        }
        let draining = !reading;
        if draining
            && (tracker.is_drained() || aborted)
            && (ended || ctx.stop.is_cancelled() || aborted)
        {
            break if ended && tracker.is_drained() {
                Exit::End
            } else {
                Exit::Stop
            };
        }
        if draining && tracker.unsettled() == refused.len() && ctx.stop.is_cancelled() {
            // Only refused retries are left: they hold the checkpoint until the next owner rereads.
            break Exit::Stop;
        }
    };

    retries.abort_all();
    match exit {
        Exit::Lost => {
            lanes.abort();
            info!(stream = %stream, shard = %shard, "lease lost: shard stopped, nothing more written");
            ShardExit::Lost(ownership)
        }
        Exit::Failed(e) => {
            lanes.abort();
            let _ = checkpointer.flush(&tracker).await;
            ShardExit::Failed(ownership, e)
        }
        Exit::Stop | Exit::End => {
            lanes.abort();
            if checkpointer.flush(&tracker).await.is_err() {
                return ShardExit::Lost(ownership);
            }
            if matches!(exit, Exit::End) {
                match ctx
                    .store
                    .checkpoint(&ownership, &Checkpoint::ShardEnd, None)
                    .await
                {
                    Ok(CheckpointWrite::Written | CheckpointWrite::NotNewer) => {
                        info!(stream = %stream, shard = %shard, "shard ended: every delivery settled, SHARD_END written");
                        return ShardExit::Ended(ownership);
                    }
                    Ok(CheckpointWrite::Lost) => return ShardExit::Lost(ownership),
                    Err(e) => return ShardExit::Failed(ownership, e),
                }
            }
            ShardExit::Stopped(ownership)
        }
    }
}

enum Exit {
    Lost,
    Stop,
    End,
    Failed(Error),
}

fn settle(tracker: &mut Tracker<Entry>, checkpointer: &mut Checkpointer, id: DeliveryId) {
    if let Some((to, arrived)) = tracker.settle(id).advanced_to() {
        checkpointer.pending = Some(*to);
        if arrived.is_some() {
            checkpointer.last_settled = *arrived;
        }
    }
}

/// What a finished delivery needs next.
enum Resolved {
    /// Terminal: settle it now.
    Settle(DeliveryId),
    /// Refused retry: leave it unsettled.
    Hold,
    /// A copy or dead letter to write first; it settles once written.
    Write(PendingWrite),
}

/// A retry copy or dead letter on its way to a stream.
struct PendingWrite {
    id: DeliveryId,
    delivery: Delivery,
    stream: String,
    headers: Headers,
    delay: Duration,
    dead_letter: bool,
}

impl PendingWrite {
    /// Waits out the delay, then writes until it succeeds (backing off between failures) and
    /// reports the delivery durable. Aborted with its shard: the original then stays unsettled and
    /// is read again by the next owner, so nothing is lost.
    async fn run(self, producer: Producer, durable: mpsc::UnboundedSender<DeliveryId>) {
        tokio::time::sleep(self.delay).await;
        let mut failures = 0u32;
        loop {
            let d = &self.delivery;
            match producer
                .put(&self.stream, d.partition_key(), &self.headers, d.payload())
                .await
            {
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
                        seq = %d.position(),
                        to = %self.stream,
                        attempt = d.attempt(),
                        written_to = %written.shard_id,
                        "{what}"
                    );
                    let _ = durable.send(self.id);
                    return;
                }
                Err(e) => {
                    failures += 1;
                    let wait = crate::backoff::jittered(failures, Duration::from_secs(5));
                    warn!(
                        stream = d.stream(),
                        shard = d.shard(),
                        seq = %d.position(),
                        to = %self.stream,
                        error = %e,
                        ?wait,
                        "writing a retry copy or dead letter failed; the original stays unsettled"
                    );
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }
}

/// Applies a handler's outcome: terminal outcomes settle; retries follow the retry policy.
fn resolve(
    done: Finished,
    policy: &RetryPolicy,
    refused: &mut HashSet<DeliveryId>,
    settings: &Settings,
) -> Resolved {
    let Some(id) = done.delivery.id() else {
        return Resolved::Hold;
    };
    let outcome_label = match done.outcome {
        Outcome::Ack => "ack",
        Outcome::Drop => "drop",
        Outcome::Retry => "retry",
        Outcome::RetryAfter(_) => "retry_after",
    };
    metrics::counter!("shardwise_records_total", "stream" => settings.stream.clone(), "outcome" => outcome_label).increment(1);
    let d = done.delivery;
    match policy.plan(done.outcome, &d) {
        None => Resolved::Settle(id),
        Some(RetryPlan::Refuse) => {
            let err = AckError::Unsupported {
                reason: "declare max_attempts or a dead-letter stream to retry on Kinesis",
            };
            if refused.insert(id) {
                metrics::counter!("shardwise_retries_refused_total", "stream" => settings.stream.clone()).increment(1);
                warn!(
                    stream = d.stream(),
                    shard = d.shard(),
                    seq = %d.position(),
                    partition_key = d.partition_key(),
                    error = %err,
                    "retry refused: the record stays unsettled and holds the checkpoint; the next owner rereads it"
                );
            }
            Resolved::Hold
        }
        Some(RetryPlan::Drop { attempts }) => {
            warn!(
                stream = d.stream(),
                shard = d.shard(),
                seq = %d.position(),
                partition_key = d.partition_key(),
                attempts,
                "attempts spent and no dead-letter stream: settled as a drop"
            );
            Resolved::Settle(id)
        }
        Some(RetryPlan::Copy {
            stream,
            delay,
            headers,
        }) => Resolved::Write(PendingWrite {
            id,
            delivery: d,
            stream,
            headers,
            delay,
            dead_letter: false,
        }),
        Some(RetryPlan::DeadLetter { stream, headers }) => Resolved::Write(PendingWrite {
            id,
            delivery: d,
            stream,
            headers,
            delay: Duration::ZERO,
            dead_letter: true,
        }),
    }
}
