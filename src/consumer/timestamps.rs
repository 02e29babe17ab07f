//! One owned partition of a source read by timestamp (seed 000): polls strictly after the durable
//! `closed_through` -> timestamp groups -> lanes -> tracker -> a compare-and-swap of
//! `closed_through` and the version once a group is proven complete and every one of its events
//! has a durable terminal outcome (`docs/paged.md`).
//!
//! ```text
//! TAKEN ──► POLLING ──stop──► DRAINING ──drained, or only held deliveries left, or deadline──► FINAL CLOSE ──► Stopped
//!              └──partition gone, poll refused, an event without a timestamp──► Failed (lease released)
//! any state ──lease lost, or a close refused as Lost or as a stale attempt──► Lost (nothing more written)
//! ```
//!
//! Every write is `closed_through: c -> c'` (c' > c) with `checkpoint_version: g -> g + 1`,
//! conditioned on the owner, the epoch, and the row still holding `c` and `g`. At most one is in
//! flight. A write refused as not newer reads the row back: if it holds what this attempt wrote
//! (now or by an earlier write whose answer was lost) the attempt goes on from it; anything else
//! means the attempt is stale, and it stops.

use std::collections::BTreeMap;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;
use tracing::{debug, info, warn};

use super::ending::{Reading, Step};
use super::partition::{PartitionContext, ReadBack, read_back};
use super::pipeline::{Pipeline, Retries};
use super::shard::ShardExit;
use crate::error::Error;
use crate::handler::{Delivery, Handler, Replayable};
use crate::lease::{CheckpointWrite, HeldLease, Ownership};
use crate::paged::reader::{PollMessage, PollReader};
use crate::paged::{Groups, PagePosition, PagedProgress, Seen, Timestamps};

/// Events found at or before `closed_through` without a terminal receipt: the source broke the
/// finality contract that closed their group.
const LATE_EVENTS: &str = "shardwise_paged_late_events_total";
/// How far ahead of the local clock a source may date an event (CloudWatch Logs takes events up
/// to two hours ahead): an event dated later than the attempt's start by more cannot have been
/// handed out by an earlier attempt.
const AHEAD_MS: i64 = 2 * 60 * 60 * 1000;

/// Every this many polls, one reads again the last `AUDIT_MS` behind `closed_through`, to find
/// late events.
const AUDIT_EVERY: u32 = 10;
const AUDIT_MS: i64 = crate::paged::AUDIT_WINDOW.as_millis() as i64;

/// A close in flight: the progress it writes.
struct InFlight {
    to: PagedProgress,
    handle: JoinHandle<Result<CheckpointWrite, Error>>,
}

enum Exit {
    Lost,
    Stop,
    Failed(Error),
}

/// What became of a close.
enum Closed {
    /// Stored (or found stored).
    Done,
    /// Not stored; proposed again later.
    Retry,
    Lost,
    Stale(Error),
}

/// The attempt's state besides the pipeline: the groups, the durable progress, and the write whose
/// answer was lost.
struct Attempt {
    groups: Groups,
    durable: PagedProgress,
    uncertain: Option<PagedProgress>,
    /// Tells the poll reader where the next poll starts.
    after: watch::Sender<Option<i64>>,
}

impl Attempt {
    /// The next close to write, if the groups propose one.
    fn proposal(&self) -> Option<PagedProgress> {
        let through = self.groups.proposal()?;
        Some(PagedProgress {
            closed_through: Some(through),
            checkpoint_version: self.durable.checkpoint_version + 1,
            ..self.durable.clone()
        })
    }

    /// `to` is stored.
    fn stored(&mut self, to: PagedProgress) {
        let through = to.closed_through.expect("a close");
        self.groups.closed(through, to.checkpoint_version);
        self.durable = to;
        self.uncertain = None;
        self.after.send_replace(Some(through));
    }
}

/// Runs one partition of a source read by timestamp until it is stopped, fails, or its lease is
/// lost.
pub(crate) async fn run_timestamp_partition<H: Handler>(
    ctx: PartitionContext<H>,
    held: HeldLease,
    contracts: Timestamps,
) -> ShardExit {
    let settings = ctx.pipeline.settings.clone();
    let ownership = held.ownership.clone();
    let source_name: std::sync::Arc<str> = std::sync::Arc::from(ownership.stream.as_str());
    let partition: std::sync::Arc<str> = std::sync::Arc::from(ownership.shard_id.as_str());
    let lost = held.cancel.clone();
    let labels = [
        ("stream", ownership.stream.clone()),
        ("shard", ownership.shard_id.clone()),
    ];
    let durable = held.lease.progress.clone().unwrap_or_default();
    info!(
        source = %source_name,
        partition = %partition,
        epoch = ownership.epoch,
        closed_through = ?durable.closed_through,
        version = durable.checkpoint_version,
        traversal = ?contracts.traversal,
        finality = ?contracts.finality,
        "partition started: polling strictly after closed_through"
    );
    if !contracts.can_close() {
        warn!(source = %source_name, partition = %partition, traversal = ?contracts.traversal, finality = ?contracts.finality, "the source's contracts cannot prove a timestamp group complete: nothing will ever be closed, and every poll reads the open groups again (receipts make the replays harmless; shardwise_paged_replays_total counts them)");
    }
    // Events dated up to here may have been handled by an earlier attempt (the open groups after
    // `closed_through` are read again): with a ledger, their receipts are read before the handler.
    let earlier_attempts_through = crate::time::millis(crate::time::now()) + AHEAD_MS;
    let sought_at = held.lease.sought_at;
    let (after_tx, after_rx) = watch::channel(durable.closed_through);
    let mut attempt = Attempt {
        groups: Groups::new(
            contracts.traversal,
            contracts.finality,
            durable.closed_through,
            durable.checkpoint_version,
        )
        .remember(AUDIT_MS),
        durable,
        uncertain: None,
        after: after_tx,
    };
    let mut pipeline: Pipeline<H, PagePosition> =
        Pipeline::new(ctx.pipeline.clone(), ownership.epoch, Retries::InPlace);
    // Tracked deliveries of open groups, by tracker index: settled as the settled prefix passes.
    let mut pending: BTreeMap<u64, (i64, String)> = BTreeMap::new();

    let (polls_tx, mut polls_rx) = mpsc::channel(1);
    let reader_cancel = lost.child_token();
    let reader = PollReader {
        source: ctx.source.clone(),
        partition: ownership.shard_id.clone(),
        after: after_rx,
        poll_interval: settings.reader.poll_interval,
        max_backoff: settings.reader.max_backoff,
        audit: Some((AUDIT_EVERY, AUDIT_MS)),
    };
    tokio::spawn(reader.run(polls_tx, reader_cancel.clone()));
    let mut reading = Reading::Open;
    let _stop_reader = reader_cancel.clone().drop_guard();
    let mut in_flight: Option<InFlight> = None;
    let mut tick = tokio::time::interval(settings.checkpoint_interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut aborted = false;
    let in_flight_gauge = || metrics::gauge!("shardwise_in_flight", &labels);
    let health = ctx.pipeline.health.enter(&ownership.shard_id);

    let exit = 'run: loop {
        let room = pipeline.has_room();
        let writing = in_flight.is_some();
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
            result = async { (&mut in_flight.as_mut().expect("writing").handle).await }, if writing => {
                let done = in_flight.take().expect("writing");
                match closed(&ctx, &ownership, &mut attempt, done.to, joined(result)).await {
                    Closed::Done => health.written(false),
                    Closed::Retry => {}
                    Closed::Lost => break Exit::Lost,
                    Closed::Stale(e) => break Exit::Failed(e),
                }
            }
            advance = pipeline.next() => {
                if let Some(advance) = advance {
                    let rest = pending.split_off(&(advance.index + 1));
                    for (timestamp, id) in std::mem::replace(&mut pending, rest).into_values() {
                        attempt.groups.settled(timestamp, &id);
                    }
                    health.pending();
                }
                in_flight_gauge().set(pipeline.unsettled() as f64);
            }
            msg = polls_rx.recv(), if reading == Reading::Open && room => match msg {
                Some(PollMessage::Events(events)) => {
                    health.read();
                    for event in &events {
                        let Some(timestamp) = event.timestamp.map(crate::time::millis) else {
                            warn!(source = %source_name, partition = %partition, id = %event.id, "an event without a timestamp from a source read by timestamp: the partition's attempt stops");
                            break 'run Exit::Failed(Error::Paged {
                                source_name: ownership.stream.clone(),
                                partition: ownership.shard_id.clone(),
                                what: "event without a timestamp",
                                source: format!("event `{}` has no timestamp, and the source is read by timestamp", event.id).into(),
                            });
                        };
                        match attempt.groups.saw(timestamp, &event.id) {
                            Seen::New => {
                                let key = event.key.as_deref().unwrap_or(&event.id);
                                let (id, lane) = pipeline.track(event.position.clone(), key);
                                pending.insert(id.index(), (timestamp, event.id.clone()));
                                let replayable = if timestamp <= earlier_attempts_through {
                                    Replayable::Checked(sought_at)
                                } else {
                                    Replayable::Recorded
                                };
                                let delivery = Delivery::paged(source_name.clone(), partition.clone(), event)
                                    .id(id)
                                    .lane(lane)
                                    .replayable(replayable)
                                    .build();
                                pipeline.dispatch(delivery);
                            }
                            Seen::Again => {
                                metrics::counter!("shardwise_paged_replays_total", &labels).increment(1);
                            }
                            Seen::Late => {
                                // Done by an earlier attempt (its receipt says so), or late: the
                                // receipt check counts it as late only when it is handed out.
                                debug!(source = %source_name, partition = %partition, id = %event.id, timestamp, closed_through = ?attempt.groups.query_after(), "an event at or before closed_through: handled unless its receipt shows it done");
                                let id = pipeline.track_only(event.position.clone());
                                let delivery = Delivery::paged(source_name.clone(), partition.clone(), event)
                                    .id(id)
                                    .replayable(Replayable::Recorded)
                                    .build();
                                pipeline.dispatch_unless_done(delivery, Some(LATE_EVENTS));
                            }
                        }
                    }
                    in_flight_gauge().set(pipeline.unsettled() as f64);
                }
                Some(PollMessage::Traversed { started_ms, watermark }) => {
                    attempt.groups.traversed(started_ms, watermark);
                }
                Some(PollMessage::Failed(error)) => break Exit::Failed(Error::Paged {
                    source_name: ownership.stream.clone(),
                    partition: ownership.shard_id.clone(),
                    what: "fetch failed",
                    source: Box::new(error),
                }),
                None => reading = Reading::Stopped,
            },
            _ = tick.tick() => {
                pipeline.tick();
                if in_flight.is_none() && let Some(to) = attempt.proposal() {
                    in_flight = Some(start(&ctx, &ownership, &attempt.durable, to));
                }
            }
        }
        match pipeline.step(reading, ctx.stop.is_cancelled(), aborted) {
            Step::Continue => {}
            Step::Stop => break Exit::Stop,
            // A source read by timestamp never ends a partition.
            Step::End => break Exit::Stop,
        }
    };

    pipeline.abort();
    in_flight_gauge().set(0.0);
    if let Some(write) = in_flight.take() {
        match closed(
            &ctx,
            &ownership,
            &mut attempt,
            write.to,
            joined(write.handle.await),
        )
        .await
        {
            Closed::Lost => return ShardExit::Lost(ownership),
            Closed::Stale(e) => return ShardExit::Failed(ownership, e),
            Closed::Done | Closed::Retry => {}
        }
    }
    match exit {
        Exit::Lost => {
            info!(source = %source_name, partition = %partition, "lease lost: partition stopped, nothing more written");
            ShardExit::Lost(ownership)
        }
        Exit::Failed(e) => {
            let _ = flush(&ctx, &ownership, &mut attempt).await;
            ShardExit::Failed(ownership, e)
        }
        Exit::Stop => match flush(&ctx, &ownership, &mut attempt).await {
            Closed::Lost => ShardExit::Lost(ownership),
            Closed::Stale(e) => ShardExit::Failed(ownership, e),
            Closed::Done | Closed::Retry => {
                info!(source = %source_name, partition = %partition, closed_through = ?attempt.durable.closed_through, "partition stopped");
                ShardExit::Stopped(ownership)
            }
        },
    }
}

fn joined(
    result: Result<Result<CheckpointWrite, Error>, tokio::task::JoinError>,
) -> Result<CheckpointWrite, Error> {
    result.unwrap_or_else(|e| {
        Err(Error::Corrupt {
            what: "close write task",
            detail: e.to_string(),
        })
    })
}

/// Starts the compare-and-swap of `expected` to `to`.
fn start<H>(
    ctx: &PartitionContext<H>,
    ownership: &Ownership,
    expected: &PagedProgress,
    to: PagedProgress,
) -> InFlight {
    let store = ctx.store.clone();
    let ownership = ownership.clone();
    let expected = expected.clone();
    let write = to.clone();
    InFlight {
        to,
        handle: tokio::spawn(
            async move { store.paged_checkpoint(&ownership, &expected, &write).await },
        ),
    }
}

/// Takes a close's answer into the attempt.
async fn closed<H>(
    ctx: &PartitionContext<H>,
    ownership: &Ownership,
    attempt: &mut Attempt,
    to: PagedProgress,
    result: Result<CheckpointWrite, Error>,
) -> Closed {
    let labels = [
        ("stream", ownership.stream.clone()),
        ("shard", ownership.shard_id.clone()),
    ];
    match result {
        Ok(CheckpointWrite::Written) => {}
        Ok(CheckpointWrite::Lost) => return Closed::Lost,
        Ok(CheckpointWrite::NotNewer) => {
            match read_back(
                ctx.store.as_ref(),
                ownership,
                &to,
                attempt.uncertain.as_ref(),
            )
            .await
            {
                ReadBack::Stored => {}
                ReadBack::Earlier => {
                    let earlier = attempt.uncertain.take().expect("an uncertain close");
                    debug!(source = %ownership.stream, partition = %ownership.shard_id, "an earlier close whose answer was lost is stored");
                    attempt.stored(earlier);
                    return Closed::Done;
                }
                ReadBack::Stale(e) => return Closed::Stale(e),
                ReadBack::Lost => return Closed::Lost,
                ReadBack::Unread => return Closed::Retry,
            }
        }
        Err(e) => {
            warn!(source = %ownership.stream, partition = %ownership.shard_id, error = &e as &dyn std::error::Error, "close failed; it is proposed again");
            attempt.uncertain = Some(to);
            return Closed::Retry;
        }
    }
    metrics::counter!("shardwise_checkpoint_writes_total", &labels).increment(1);
    debug!(source = %ownership.stream, partition = %ownership.shard_id, closed_through = ?to.closed_through, version = to.checkpoint_version, "closed");
    attempt.stored(to);
    Closed::Done
}

/// Writes the close the groups propose now, until none is left (`Done`), a write fails
/// (`Retry`), or the lease is lost or the attempt stale.
async fn flush<H>(
    ctx: &PartitionContext<H>,
    ownership: &Ownership,
    attempt: &mut Attempt,
) -> Closed {
    for _ in 0..4 {
        let Some(to) = attempt.proposal() else {
            return Closed::Done;
        };
        let flight = start(ctx, ownership, &attempt.durable, to);
        let result = joined(flight.handle.await);
        match closed(ctx, ownership, attempt, flight.to, result).await {
            Closed::Done => {}
            other => return other,
        }
    }
    Closed::Done
}
