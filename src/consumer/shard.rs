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

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::checkpointer::{Checkpointer, Entry};
use super::ending::{Reading, Step};
use super::pipeline::{Advance, Pipeline, PipelineContext, Retries};
use crate::backoff::Backoff;
use crate::checkpoint::Checkpoint;
use crate::error::Error;
use crate::handler::{Delivery, Handler};
use crate::lease::{CheckpointWrite, HeldLease, LeaseStore, Ownership};
use crate::position::Position;
use crate::shard::discovery::ShardLister;
use crate::shard::reader::{ReaderMessage, ShardReader};
use crate::shard::source::{ReadError, RecordSource};
use crate::time::millis;

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
    /// What its deliveries need.
    pub(crate) pipeline: PipelineContext<H>,
    pub(crate) source: Arc<dyn RecordSource>,
    /// Tells a shard that aged out of retention from a stream that is gone.
    pub(crate) lister: Arc<dyn ShardLister>,
    pub(crate) store: Arc<dyn LeaseStore>,
    /// Graceful stop: stop reading, drain, write the final checkpoint.
    pub(crate) stop: CancellationToken,
    /// The drain deadline passed: abort running handlers and write what has settled.
    pub(crate) abort: CancellationToken,
}

impl<H> Clone for ShardContext<H> {
    fn clone(&self) -> Self {
        Self {
            pipeline: self.pipeline.clone(),
            source: self.source.clone(),
            lister: self.lister.clone(),
            store: self.store.clone(),
            stop: self.stop.clone(),
            abort: self.abort.clone(),
        }
    }
}

/// The shard's gauges: refreshed every checkpoint interval while the shard is held here (so an
/// exporter that drops idle series keeps them), and zeroed when the shard stops here, so a shard
/// that moved to another worker does not keep reporting its last lag and load from this one.
struct Gauges {
    labels: [(&'static str, String); 2],
    /// The last `MillisBehindLatest` read.
    behind: std::cell::Cell<i64>,
}

impl Gauges {
    fn in_flight(&self, n: usize) {
        metrics::gauge!("shardwise_in_flight", &self.labels).set(n as f64);
    }

    fn millis_behind(&self, ms: i64) {
        self.behind.set(ms);
        metrics::gauge!("shardwise_millis_behind_latest", &self.labels).set(ms as f64);
    }

    /// Sets every gauge again: the deliveries in flight, the last lag read, and the end-to-end
    /// age (now minus the arrival of the oldest unsettled delivery; 0 with none).
    fn refresh(&self, in_flight: usize, oldest_arrival_ms: Option<i64>) {
        self.in_flight(in_flight);
        self.millis_behind(self.behind.get());
        let age = oldest_arrival_ms.map_or(0, |ms| (millis(crate::time::now()) - ms).max(0));
        self.record_age(age as f64 / 1000.0);
    }

    fn record_age(&self, seconds: f64) {
        metrics::gauge!("shardwise_record_age_seconds", &self.labels).set(seconds);
    }
}

impl Drop for Gauges {
    fn drop(&mut self) {
        self.in_flight(0);
        self.millis_behind(0);
        self.record_age(0.0);
    }
}

/// Runs one shard until it ends, is stopped, or its lease is lost.
pub(crate) async fn run_shard<H: Handler>(ctx: ShardContext<H>, held: HeldLease) -> ShardExit {
    let settings = &ctx.pipeline.settings;
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
        behind: std::cell::Cell::new(0),
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
        health: ctx.pipeline.health.enter(&ownership.shard_id),
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

    let mut pipeline: Pipeline<H, Entry> =
        Pipeline::new(ctx.pipeline.clone(), ownership.epoch, Retries::Copies);
    let mut last_read: Option<Position> = None;
    let mut tick = tokio::time::interval(settings.checkpoint_interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut aborted = false;

    let exit = loop {
        let room = pipeline.has_room();
        let writing = checkpointer.in_flight.is_some();
        tokio::select! {
            biased;
            _ = lost.cancelled() => break Exit::Lost,
            _ = ctx.abort.cancelled(), if !aborted => {
                aborted = true;
                pipeline.abort_handlers();
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
            advance = pipeline.next() => {
                if let Some(advance) = advance {
                    advanced(&mut checkpointer, advance);
                }
                gauges.in_flight(pipeline.unsettled());
            }
            msg = reader_rx.recv(), if reading == Reading::Open && room => match msg {
                Some(ReaderMessage::Records { records, millis_behind_latest }) => {
                    checkpointer.health.read();
                    if let Some(ms) = millis_behind_latest {
                        gauges.millis_behind(ms);
                    }
                    checkpointer.caught_up_at = (records.is_empty() && millis_behind_latest == Some(0))
                        .then(|| millis(crate::time::now()));
                    for r in records {
                        last_read = Some(r.position);
                        let (id, lane) = pipeline.track((r.position, r.arrived_at.map(millis)), &r.partition_key);
                        let delivery = Delivery::from_blob(stream.clone(), shard.clone(), r.position, r.partition_key, r.data)
                            .set_arrived_at(r.arrived_at)
                            .set_explicit_hash_key(r.explicit_hash_key)
                            .id(id)
                            .lane(lane)
                            .build();
                        pipeline.dispatch(delivery);
                    }
                    gauges.in_flight(pipeline.unsettled());
                }
                Some(ReaderMessage::End) => reading = Reading::Closed,
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
                gauges.refresh(pipeline.unsettled(), pipeline.tracker().oldest_unsettled().and_then(|e| e.1));
                pipeline.tick();
                checkpointer.maybe_start(pipeline.tracker());
                if checkpointer.maybe_advance_frontier(pipeline.tracker()).await.is_err() {
                    break Exit::Lost;
                }
            }
        }
        match pipeline.step(reading, ctx.stop.is_cancelled(), aborted) {
            Step::Continue => {}
            Step::Stop => break Exit::Stop,
            Step::End => break Exit::End,
        }
    };

    pipeline.abort();
    match exit {
        Exit::Lost => {
            info!(stream = %stream, shard = %shard, "lease lost: shard stopped, nothing more written");
            ShardExit::Lost(ownership)
        }
        Exit::Failed(e) => {
            let _ = checkpointer.flush(pipeline.tracker()).await;
            ShardExit::Failed(ownership, e)
        }
        Exit::Stop | Exit::End => {
            if checkpointer.flush(pipeline.tracker()).await.is_err() {
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
    let to = Checkpoint::AtTimestamp(
        now.checked_sub(ctx.pipeline.settings.latest_margin)
            .unwrap_or(now),
    );
    let mut backoff = Backoff::new(ctx.pipeline.settings.reader.max_backoff);
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

/// The settled prefix moved: the checkpoint may follow.
fn advanced(checkpointer: &mut Checkpointer, advance: Advance<Entry>) {
    let (to, arrived) = advance.entry;
    checkpointer.pending = Some(to);
    checkpointer.health.pending();
    if arrived.is_some() {
        checkpointer.last_settled = arrived;
    }
}
