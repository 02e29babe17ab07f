//! One owned shard: reader -> lanes -> tracker -> coalesced, fenced checkpoints.
//!
//! States and what each write is conditioned on:
//!
//! ```text
//! TAKEN ──checkpoint LATEST──► PIN (fenced write of AT_TIMESTAMP(now - margin)) ──┐
//!   └──any other checkpoint─────────────────────────────────────────────────────┤
//!                                                                                ▼
//! READING ──stop──► DRAINING ──drained, or only held deliveries left, or deadline──► FINAL CHECKPOINT ──► Stopped
//!    │
//!    ├──reader at the end of a closed shard──► ENDING ──every delivery settled──► SHARD_END ──► Ended
//!    └──shard aged out of retention (not listed)──► ENDING (warning, metric) ──────────────────► Ended
//! any state ──lease lost (token) or a write refused as Lost──► Lost (no further writes)
//! ```
//!
//! Every checkpoint write is the store's fenced write: owner and ownership epoch of this lease, and
//! a position greater than the stored one. At most one write is in flight, and at most one starts
//! per `checkpoint_interval`; an idle shard writes nothing. When the work is over and which write
//! ends it is decided by [`ending::step`](super::ending::step), from a table of cases.
//!
//! A LATEST checkpoint is pinned before anything is dispatched: otherwise a worker killed before its
//! first checkpoint would leave LATEST behind, and the next owner would open a new LATEST iterator
//! and skip every record written in between.

use std::collections::HashSet;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::checkpointer::{Checkpointer, Entry};
use super::config::Settings;
use super::copies::{PendingWrite, StuckWrites, WriteEvent};
use super::ending::{self, Reading, ShardState, Step};
use super::hooks::{DeliveryHooks, Settled};
use super::lanes::{Finished, Lanes};
use super::ledger::{self, Ledger, LedgerEvent};
use super::outcome::{Resolved, resolve};
use crate::backoff::Backoff;
use crate::checkpoint::Checkpoint;
use crate::error::Error;
use crate::handler::{Delivery, Handler, Outcome};
use crate::lease::{CheckpointWrite, HeldLease, LeaseStore, Ownership};
use crate::position::Position;
use crate::producer::Producer;
use crate::receipts::ReceiptStore;
use crate::retry::{RetryPlan, RetryPolicy};
use crate::shard::discovery::ShardLister;
use crate::shard::reader::{ReaderMessage, ShardReader};
use crate::shard::source::{ReadError, RecordSource};
use crate::time::millis;
use crate::track::{DeliveryId, Tracker};

/// How a shard's run ended.
#[derive(Debug)]
pub(crate) enum ShardExit {
    /// Every record has a durable outcome (read to its end, or aged out), SHARD_END written.
    Ended(Ownership),
    /// Stopped on request; the final checkpoint was written (or attempted).
    Stopped(Ownership),
    /// The lease was lost: nothing more was written.
    Lost(Ownership),
    /// Reading failed for good (the stream is gone, or the shard cannot be read).
    Failed(Ownership, Error),
}

/// What a shard needs from the consumer.
pub(crate) struct ShardContext<H> {
    pub(crate) handler: Arc<H>,
    pub(crate) source: Arc<dyn RecordSource>,
    /// Tells a shard that aged out of retention from a stream that is gone.
    pub(crate) lister: Arc<dyn ShardLister>,
    pub(crate) store: Arc<dyn LeaseStore>,
    pub(crate) settings: Arc<Settings>,
    /// Writes retry copies and dead letters.
    pub(crate) producer: Producer,
    /// What retries become.
    pub(crate) retry: Arc<RetryPolicy>,
    /// Copies and dead letters whose writes fail for good, for every shard of the consumer.
    pub(crate) stuck: StuckWrites,
    /// The receipt ledger, if the consumer has one.
    pub(crate) receipts: Option<Arc<dyn ReceiptStore>>,
    /// Told how each delivery settled.
    pub(crate) hooks: Arc<dyn DeliveryHooks>,
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
            lister: self.lister.clone(),
            store: self.store.clone(),
            settings: self.settings.clone(),
            producer: self.producer.clone(),
            retry: self.retry.clone(),
            stuck: self.stuck.clone(),
            receipts: self.receipts.clone(),
            hooks: self.hooks.clone(),
            stop: self.stop.clone(),
            abort: self.abort.clone(),
        }
    }
}

/// The shard's gauges; zeroed when the shard stops here, so a shard that moved to another worker
/// does not keep reporting its last lag and load from this one.
struct Gauges {
    labels: [(&'static str, String); 2],
}

impl Gauges {
    fn in_flight(&self, n: usize) {
        metrics::gauge!("shardwise_in_flight", &self.labels).set(n as f64);
    }

    fn millis_behind(&self, ms: i64) {
        metrics::gauge!("shardwise_millis_behind_latest", &self.labels).set(ms as f64);
    }
}

impl Drop for Gauges {
    fn drop(&mut self) {
        self.in_flight(0);
        self.millis_behind(0);
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
    let gauges = Gauges {
        labels: labels.clone(),
    };
    info!(stream = %stream, shard = %shard, epoch = ownership.epoch, checkpoint = %held.lease.checkpoint, "shard started");

    let start = match pin_start(&ctx, &held).await {
        Ok(start) => start,
        Err(exit) => return exit,
    };

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
        &start,
        settings.reader,
    ) {
        Some(reader) => {
            tokio::spawn(reader.run(reader_tx, reader_cancel.clone()));
            Reading::Open
        }
        None => Reading::Closed, // already at SHARD_END
    };
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
    let mut stuck_writes = 0usize;
    let mut last_read: Option<Position> = None;
    let (write_tx, mut write_rx) = mpsc::unbounded_channel::<WriteEvent>();
    let mut retries: JoinSet<()> = JoinSet::new();
    let worker: Arc<str> = Arc::from(settings.worker_id.as_str());
    let mut ledger = ctx
        .receipts
        .clone()
        .map(|store| Ledger::new(store, worker.clone(), settings.hold_poll_interval));
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
                if reading == Reading::Open {
                    reading = Reading::Stopped;
                }
                reader_cancel.cancel();
            }
            _ = ctx.stop.cancelled(), if reading == Reading::Open => {
                reading = Reading::Stopped;
                reader_cancel.cancel();
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
                let resolved = resolve(done.delivery, done.outcome, &ctx.retry, &mut refused, settings, ledger.is_some());
                carry_out(resolved, &ctx, &mut tracker, &mut checkpointer, &mut ledger, &mut retries, &write_tx, &worker);
                gauges.in_flight(tracker.unsettled());
            }
            Some(event) = write_rx.recv() => {
                match event {
                    WriteEvent::Durable(id, d, how) => settle(&mut tracker, &mut checkpointer, &ctx, id, &d, &how),
                    WriteEvent::Stuck => stuck_writes += 1,
                    WriteEvent::Unstuck => stuck_writes = stuck_writes.saturating_sub(1),
                    WriteEvent::Held(id, d) => {
                        if let Some(ledger) = ledger.as_mut() {
                            ledger.hold(id, d);
                        }
                    }
                }
                gauges.in_flight(tracker.unsettled());
            }
            events = async { ledger.as_mut().expect("busy").next().await }, if ledger.as_ref().is_some_and(Ledger::busy) => {
                for event in events {
                    on_ledger(event, &ctx, &mut tracker, &mut checkpointer, &mut ledger, &mut retries, &write_tx, &worker, &mut refused, &mut lanes);
                }
                gauges.in_flight(tracker.unsettled());
            }
            Some(_) = retries.join_next(), if !retries.is_empty() => {}
            msg = reader_rx.recv(), if reading == Reading::Open && room => match msg {
                Some(ReaderMessage::Records { records, millis_behind_latest }) => {
                    if let Some(ms) = millis_behind_latest {
                        gauges.millis_behind(ms);
                    }
                    checkpointer.caught_up_at = (records.is_empty() && millis_behind_latest == Some(0))
                        .then(|| millis(crate::time::now()));
                    for r in records {
                        last_read = Some(r.position);
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
                    gauges.in_flight(tracker.unsettled());
                }
                Some(ReaderMessage::End) => {
                    reading = Reading::Closed;
                }
                Some(ReaderMessage::Gone) => match aged_out(ctx.lister.as_ref(), &ownership).await {
                    Ok(true) => {
                        let read_through = last_read.map_or_else(|| start.to_string(), |p| p.to_string());
                        warn!(
                            stream = %stream,
                            shard = %shard,
                            read_through = %read_through,
                            "shard aged out of the stream's retention before it was read to its end: \
                             its records after {read_through} were trimmed unread; ending it (SHARD_END \
                             once what was read settles) so its children start"
                        );
                        metrics::counter!("shardwise_shards_aged_out_total", &labels).increment(1);
                        reading = Reading::AgedOut;
                    }
                    Ok(false) => break Exit::Failed(Error::Kinesis {
                        operation: "GetRecords",
                        stream: ownership.stream.clone(),
                        shard: Some(ownership.shard_id.clone()),
                        source: Box::new(ReadError::NotFound),
                    }),
                    Err(e) => break Exit::Failed(e),
                },
                None => reading = Reading::Stopped,
            },
            _ = tick.tick() => {
                if let Some(ledger) = ledger.as_mut() {
                    ledger.start_commit();
                    ledger.start_poll();
                }
                checkpointer.maybe_start(&tracker);
                if checkpointer.maybe_advance_frontier(&tracker).await.is_err() {
                    break Exit::Lost;
                }
            }
        }
        let state = ShardState {
            reading,
            stopping: ctx.stop.is_cancelled(),
            aborted,
            unsettled: tracker.unsettled(),
            held: refused.len() + stuck_writes + ledger.as_ref().map_or(0, Ledger::held),
        };
        match ending::step(&state) {
            Step::Continue => {}
            Step::Stop => break Exit::Stop,
            Step::End => break Exit::End,
        }
    };

    retries.abort_all();
    lanes.abort();
    if let Some(ledger) = ledger.as_mut() {
        ledger.abort();
    }
    match exit {
        Exit::Lost => {
            info!(stream = %stream, shard = %shard, "lease lost: shard stopped, nothing more written");
            ShardExit::Lost(ownership)
        }
        Exit::Failed(e) => {
            let _ = checkpointer.flush(&tracker).await;
            ShardExit::Failed(ownership, e)
        }
        Exit::Stop | Exit::End => {
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

/// Replaces a LATEST checkpoint with a fixed start before anything is read: AT_TIMESTAMP of now
/// minus the configured margin (the clock-skew allowance between this host and the stream's
/// arrival timestamps), written fenced by this lease. Every later owner starts at the same place,
/// so a worker that dies before its first checkpoint makes the next one repeat records, never
/// skip them. Any other checkpoint is returned as it is.
async fn pin_start<H>(ctx: &ShardContext<H>, held: &HeldLease) -> Result<Checkpoint, ShardExit> {
    if held.lease.checkpoint != Checkpoint::Latest {
        return Ok(held.lease.checkpoint.clone());
    }
    let ownership = &held.ownership;
    let now = crate::time::now();
    let to = Checkpoint::AtTimestamp(now.checked_sub(ctx.settings.latest_margin).unwrap_or(now));
    let mut backoff = Backoff::new(ctx.settings.reader.max_backoff);
    loop {
        let result = tokio::select! {
            biased;
            _ = held.cancel.cancelled() => return Err(ShardExit::Lost(ownership.clone())),
            _ = ctx.stop.cancelled() => return Err(ShardExit::Stopped(ownership.clone())),
            r = ctx.store.checkpoint(ownership, &to, None) => r,
        };
        let error = match result {
            Ok(CheckpointWrite::Written) => {
                info!(stream = %ownership.stream, shard = %ownership.shard_id, start = %to, "LATEST start pinned before reading");
                return Ok(to);
            }
            Ok(CheckpointWrite::Lost) => return Err(ShardExit::Lost(ownership.clone())),
            // Under our epoch only we write: an earlier attempt of ours was applied but its
            // answer lost. Read back what it stored.
            Ok(CheckpointWrite::NotNewer) => {
                match ctx.store.get(&ownership.stream, &ownership.shard_id).await {
                    Ok(Some(row)) if row.ownership().as_ref() == Some(ownership) => {
                        return Ok(row.checkpoint);
                    }
                    Ok(_) => return Err(ShardExit::Lost(ownership.clone())),
                    Err(e) => e,
                }
            }
            Err(e) => e,
        };
        let wait = backoff.next();
        warn!(stream = %ownership.stream, shard = %ownership.shard_id, error = &error as &dyn std::error::Error, ?wait, "pinning the LATEST start failed; retrying before reading");
        tokio::time::sleep(wait).await;
    }
}

/// Whether a shard that cannot be read aged out of retention: its stream still exists but no
/// longer lists it. An error when the stream itself is gone.
async fn aged_out(lister: &dyn ShardLister, ownership: &Ownership) -> Result<bool, Error> {
    let shards = lister.list_shards(&ownership.stream).await?;
    Ok(!shards.iter().any(|s| s.shard_id == ownership.shard_id))
}

/// A delivery's outcome is durable: the checkpoint may pass it.
fn settle<H>(
    tracker: &mut Tracker<Entry>,
    checkpointer: &mut Checkpointer,
    ctx: &ShardContext<H>,
    id: DeliveryId,
    delivery: &Delivery,
    how: &Settled,
) {
    let settlement = tracker.settle(id);
    if settlement.accepted() {
        ctx.hooks.settled(delivery, how);
    }
    if let Some((to, arrived)) = settlement.advanced_to() {
        checkpointer.pending = Some(*to);
        if arrived.is_some() {
            checkpointer.last_settled = *arrived;
        }
    }
}

/// Carries out what a handler's outcome resolved to.
#[allow(clippy::too_many_arguments)]
fn carry_out<H>(
    resolved: Resolved,
    ctx: &ShardContext<H>,
    tracker: &mut Tracker<Entry>,
    checkpointer: &mut Checkpointer,
    ledger: &mut Option<Ledger>,
    retries: &mut JoinSet<()>,
    write_tx: &mpsc::UnboundedSender<WriteEvent>,
    worker: &Arc<str>,
) {
    match resolved {
        Resolved::Settle(id, d, how) => settle(tracker, checkpointer, ctx, id, &d, &how),
        Resolved::Hold => {}
        Resolved::Write(write) => {
            retries.spawn(write.run(
                ctx.producer.clone(),
                ctx.retry.clone(),
                ctx.stuck.clone(),
                write_tx.clone(),
            ));
        }
        Resolved::Apply(id, d, effects) => {
            if let Some(ledger) = ledger.as_mut() {
                ledger.apply(id, d, effects);
            }
        }
        Resolved::Record(id, d, disposition) => {
            if let Some(store) = ctx.receipts.clone() {
                retries.spawn(ledger::record(
                    store,
                    worker.clone(),
                    id,
                    d,
                    disposition,
                    write_tx.clone(),
                ));
            }
        }
    }
}

/// Carries out what the ledger reports.
#[allow(clippy::too_many_arguments)]
fn on_ledger<H>(
    event: LedgerEvent,
    ctx: &ShardContext<H>,
    tracker: &mut Tracker<Entry>,
    checkpointer: &mut Checkpointer,
    ledger: &mut Option<Ledger>,
    retries: &mut JoinSet<()>,
    write_tx: &mpsc::UnboundedSender<WriteEvent>,
    worker: &Arc<str>,
    refused: &mut HashSet<DeliveryId>,
    lanes: &mut Lanes,
) {
    match event {
        LedgerEvent::Settle(id, d, how) => settle(tracker, checkpointer, ctx, id, &d, &how),
        LedgerEvent::Retry(d) => {
            let resolved = resolve(d, Outcome::Retry, &ctx.retry, refused, &ctx.settings, true);
            carry_out(
                resolved,
                ctx,
                tracker,
                checkpointer,
                ledger,
                retries,
                write_tx,
                worker,
            );
        }
        LedgerEvent::Spent(d, reason) => {
            let Some(id) = d.id() else { return };
            let resolved = match ctx
                .retry
                .spent(&d, format!("effects not committed: {reason}"))
            {
                plan @ RetryPlan::DeadLetter { .. } => match PendingWrite::new(id, d, plan) {
                    Some(write) => Resolved::Write(write),
                    None => Resolved::Hold,
                },
                _ => Resolved::Settle(id, d, Settled::Spent),
            };
            carry_out(
                resolved,
                ctx,
                tracker,
                checkpointer,
                ledger,
                retries,
                write_tx,
                worker,
            );
        }
        LedgerEvent::Redeliver(d) => {
            info!(stream = d.stream(), shard = d.shard(), seq = %d.position(), "hold released: handled again");
            lanes.redispatch(d);
        }
    }
}
