//! One owned partition of a paged source: reader -> order validation -> lanes -> tracker -> page
//! barrier -> compare-and-swap progress writes (`docs/paged.md`).
//!
//! ```text
//! TAKEN ──► READING ──stop──► DRAINING ──drained, or only held deliveries left, or deadline──► FINAL WRITES ──► Stopped
//!              │
//!              ├──page without a next cursor, every delivery settled──► SHARD_END ──► Ended
//!              └──order violation, partition gone, cursor refused──► Failed (lease released)
//! any state ──lease lost, or a write refused as Lost or as a stale attempt──► Lost (nothing more written)
//! ```
//!
//! At most one progress write is in flight, and one starts at most every `checkpoint_interval`.
//! A write refused as not newer is not retried blindly: the row is read back. If it holds what
//! the write meant to store, an earlier attempt of the same write went through and its answer was
//! lost. Anything else means this attempt is stale, and it stops.

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::ending::{Reading, Step};
use super::pipeline::{Pipeline, PipelineContext, Retries};
use super::shard::ShardExit;
use crate::checkpoint::Checkpoint;
use crate::error::Error;
use crate::handler::{Delivery, Handler, Replayable};
use crate::lease::{CheckpointWrite, HeldLease, LeaseStore, Ownership};
use crate::paged::reader::{PageMessage, PageReader};
use crate::paged::{
    Barrier, BarrierWrite, Order, PagePosition, PagedProgress, PagedSource, Verdict,
};

/// What a partition needs from the consumer.
pub(crate) struct PartitionContext<H> {
    /// What its deliveries need.
    pub(crate) pipeline: PipelineContext<H>,
    pub(crate) source: Arc<dyn PagedSource>,
    pub(crate) store: Arc<dyn LeaseStore>,
    /// Graceful stop: stop reading, drain, write the final progress.
    pub(crate) stop: CancellationToken,
    /// The drain deadline passed: abort running handlers and write what has settled.
    pub(crate) abort: CancellationToken,
}

impl<H> Clone for PartitionContext<H> {
    fn clone(&self) -> Self {
        Self {
            pipeline: self.pipeline.clone(),
            source: self.source.clone(),
            store: self.store.clone(),
            stop: self.stop.clone(),
            abort: self.abort.clone(),
        }
    }
}

/// A progress write in flight.
struct InFlight {
    write: BarrierWrite,
    handle: JoinHandle<Result<CheckpointWrite, Error>>,
}

enum Exit {
    Lost,
    Stop,
    End,
    Failed(Error),
}

/// What became of a progress write.
enum Written {
    /// Stored (or found stored): the barrier moved.
    Done,
    /// Not stored; try again later.
    Retry,
    /// Not stored, but an earlier write whose answer was lost was found stored and taken: the
    /// next write is computed from it.
    Recovered,
    /// The lease is lost: stop writing.
    Lost,
    /// The lease is ours but the stored progress moved under this attempt: stop, and give the
    /// lease back so the partition is read again from what is stored.
    Stale(Error),
}

/// Runs one partition until it ends, is stopped, fails, or its lease is lost.
pub(crate) async fn run_partition<H: Handler>(
    ctx: PartitionContext<H>,
    held: HeldLease,
) -> ShardExit {
    let settings = ctx.pipeline.settings.clone();
    let ownership = held.ownership.clone();
    let source_name: Arc<str> = Arc::from(ownership.stream.as_str());
    let partition: Arc<str> = Arc::from(ownership.shard_id.as_str());
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
        cursor = %durable.resume_cursor.as_ref().map_or("(first page)".to_string(), ToString::to_string),
        applied = %durable.applied_position.as_ref().map_or("-".to_string(), ToString::to_string),
        version = durable.checkpoint_version,
        "partition started"
    );
    let contract = ctx.source.contract();
    // A backfilling source hands out events at or below its applied prefix again: with a ledger,
    // every outcome leaves a receipt, which is what tells such an event is done (see `Verdict`).
    let replayable = if contract.backfill {
        Replayable::Recorded
    } else {
        Replayable::No
    };
    let mut order = Order::new(contract, durable.applied_position.clone());
    let mut pipeline: Pipeline<H, PagePosition> =
        Pipeline::new(ctx.pipeline.clone(), ownership.epoch, Retries::InPlace);
    let mut barrier = Barrier::new(durable.clone(), pipeline.tracker().next_index());
    let health = ctx.pipeline.health.enter(&ownership.shard_id);

    let (pages_tx, mut pages_rx) = mpsc::channel(1);
    let reader_cancel = lost.child_token();
    let mut reading = if held.lease.checkpoint.is_shard_end() {
        Reading::Closed
    } else {
        let reader = PageReader {
            source: ctx.source.clone(),
            partition: ownership.shard_id.clone(),
            cursor: durable.resume_cursor.clone(),
            poll_interval: settings.reader.poll_interval,
            max_backoff: settings.reader.max_backoff,
        };
        tokio::spawn(reader.run(pages_tx, reader_cancel.clone()));
        Reading::Open
    };
    let _stop_reader = reader_cancel.clone().drop_guard();
    let mut in_flight: Option<InFlight> = None;
    // A write whose answer was an error: it may have been stored. The next write that is refused as
    // not newer checks the row against it before calling this attempt stale.
    let mut uncertain: Option<BarrierWrite> = None;
    let mut tick = tokio::time::interval(settings.checkpoint_interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut aborted = false;
    let in_flight_gauge = || metrics::gauge!("shardwise_in_flight", &labels);

    let exit = loop {
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
                let result = result.unwrap_or_else(|e| Err(Error::Corrupt { what: "progress write task", detail: e.to_string() }));
                match written(&ctx, &ownership, &mut barrier, &mut order, &mut uncertain, &done.write, result).await {
                    Written::Done | Written::Recovered => health.written(false),
                    Written::Retry => {}
                    Written::Lost => break Exit::Lost,
                    Written::Stale(e) => break Exit::Failed(e),
                }
            }
            advance = pipeline.next() => {
                if let Some(advance) = advance {
                    barrier.settled(advance.index + 1, Some(&advance.entry));
                    health.pending();
                }
                in_flight_gauge().set(pipeline.unsettled() as f64);
            }
            msg = pages_rx.recv(), if reading == Reading::Open && room => match msg {
                Some(PageMessage::Page { events, next, watermark }) => {
                    health.read();
                    let verdicts = match order.classify(&events) {
                        Ok(verdicts) => verdicts,
                        Err(violation) => {
                            metrics::counter!("shardwise_paged_order_violations_total", &labels).increment(1);
                            warn!(source = %source_name, partition = %partition, error = &violation as &dyn std::error::Error, "the page breaks the source's order: the partition's attempt stops (the lease is released; the next owner reads again from the durable cursor)");
                            break Exit::Failed(Error::Paged {
                                source_name: ownership.stream.clone(),
                                partition: ownership.shard_id.clone(),
                                what: "order violation",
                                source: Box::new(violation),
                            });
                        }
                    };
                    let before = pipeline.tracker().next_index();
                    for (event, verdict) in events.iter().zip(verdicts) {
                        match verdict {
                            Verdict::New => {
                                let key = event.key.as_deref().unwrap_or(&event.id);
                                let (id, lane) = pipeline.track(event.position.clone(), key);
                                let delivery = Delivery::paged(source_name.clone(), partition.clone(), event)
                                    .id(id)
                                    .lane(lane)
                                    .replayable(replayable)
                                    .build();
                                pipeline.dispatch(delivery);
                            }
                            Verdict::Backfill => {
                                let id = pipeline.track_only(event.position.clone());
                                let delivery = Delivery::paged(source_name.clone(), partition.clone(), event)
                                    .id(id)
                                    .replayable(replayable)
                                    .build();
                                pipeline.dispatch_unless_done(delivery, None);
                            }
                            Verdict::Replay => {
                                metrics::counter!("shardwise_paged_replays_total", &labels).increment(1);
                                debug!(source = %source_name, partition = %partition, position = %event.position, id = %event.id, "replay: at or below the applied prefix; not handed to the handler");
                            }
                            Verdict::Overlap => {
                                debug!(source = %source_name, partition = %partition, position = %event.position, id = %event.id, "overlap: already handed out");
                            }
                        }
                    }
                    let tracked = pipeline.tracker().next_index() != before;
                    let ended = next.is_none();
                    // A page that brings nothing new and leaves the cursor where it is changes
                    // nothing (a cursor that did not move, read again).
                    let raised = watermark > barrier.fetched_watermark();
                    if tracked || ended || raised || barrier.fetch_cursor() != Some(next.as_ref()) {
                        barrier.fetched(next, pipeline.tracker().next_index(), watermark);
                    }
                    if ended {
                        info!(source = %source_name, partition = %partition, "the partition ended: SHARD_END once every delivery settled");
                        reading = Reading::Closed;
                    }
                    in_flight_gauge().set(pipeline.unsettled() as f64);
                }
                Some(PageMessage::Failed(error)) => break Exit::Failed(Error::Paged {
                    source_name: ownership.stream.clone(),
                    partition: ownership.shard_id.clone(),
                    what: "fetch failed",
                    source: Box::new(error),
                }),
                None => reading = Reading::Stopped,
            },
            _ = tick.tick() => {
                pipeline.tick();
                if in_flight.is_none() && let Some(write) = barrier.next_write().filter(|w| *w != BarrierWrite::End) {
                    in_flight = Some(start(&ctx, &ownership, barrier.durable().clone(), write));
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
    in_flight_gauge().set(0.0);
    if let Some(write) = in_flight.take() {
        // Its answer decides whether the barrier moved; a lost lease ends it below anyway.
        let result = write.handle.await.unwrap_or_else(|e| {
            Err(Error::Corrupt {
                what: "progress write task",
                detail: e.to_string(),
            })
        });
        match written(
            &ctx,
            &ownership,
            &mut barrier,
            &mut order,
            &mut uncertain,
            &write.write,
            result,
        )
        .await
        {
            Written::Lost => return ShardExit::Lost(ownership),
            Written::Stale(e) => return ShardExit::Failed(ownership, e),
            Written::Done | Written::Retry | Written::Recovered => {}
        }
    }
    match exit {
        Exit::Lost => {
            info!(source = %source_name, partition = %partition, "lease lost: partition stopped, nothing more written");
            ShardExit::Lost(ownership)
        }
        Exit::Failed(e) => {
            let _ = flush(&ctx, &ownership, &mut barrier, &mut order, &mut uncertain).await;
            ShardExit::Failed(ownership, e)
        }
        Exit::Stop | Exit::End => {
            match flush(&ctx, &ownership, &mut barrier, &mut order, &mut uncertain).await {
                Written::Lost => return ShardExit::Lost(ownership),
                Written::Stale(e) => return ShardExit::Failed(ownership, e),
                Written::Done | Written::Retry | Written::Recovered => {}
            }
            if matches!(exit, Exit::End) && barrier.next_write() == Some(BarrierWrite::End) {
                match ctx
                    .store
                    .checkpoint(&ownership, &Checkpoint::ShardEnd, None)
                    .await
                {
                    Ok(CheckpointWrite::Written | CheckpointWrite::NotNewer) => {
                        info!(source = %source_name, partition = %partition, "partition ended: every delivery settled, SHARD_END written");
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

/// Starts a progress write from the durable progress.
fn start<H>(
    ctx: &PartitionContext<H>,
    ownership: &Ownership,
    expected: crate::paged::PagedProgress,
    write: BarrierWrite,
) -> InFlight {
    let store = ctx.store.clone();
    let ownership = ownership.clone();
    let to = write
        .progress()
        .expect("the end is a checkpoint write")
        .clone();
    InFlight {
        write,
        handle: tokio::spawn(
            async move { store.paged_checkpoint(&ownership, &expected, &to).await },
        ),
    }
}

/// Takes a progress write's answer into the barrier (and the order's applied prefix).
async fn written<H>(
    ctx: &PartitionContext<H>,
    ownership: &Ownership,
    barrier: &mut Barrier,
    order: &mut Order,
    uncertain: &mut Option<BarrierWrite>,
    write: &BarrierWrite,
    result: Result<CheckpointWrite, Error>,
) -> Written {
    let Some(to) = write.progress() else {
        return Written::Done;
    };
    let labels = [
        ("stream", ownership.stream.clone()),
        ("shard", ownership.shard_id.clone()),
    ];
    match result {
        Ok(CheckpointWrite::Written) => {}
        Ok(CheckpointWrite::Lost) => return Written::Lost,
        Ok(CheckpointWrite::NotNewer) => {
            let earlier = uncertain.as_ref().and_then(BarrierWrite::progress);
            match read_back(ctx.store.as_ref(), ownership, to, earlier).await {
                ReadBack::Stored => {}
                // An earlier write whose answer was an error went through: take it, and compute
                // the next write from it.
                ReadBack::Earlier => {
                    let earlier = uncertain.take().expect("an uncertain write");
                    debug!(source = %ownership.stream, partition = %ownership.shard_id, "an earlier progress write whose answer was lost is stored");
                    if let Some(applied) =
                        earlier.progress().and_then(|t| t.applied_position.as_ref())
                    {
                        order.applied(applied);
                    }
                    barrier.written(&earlier);
                    return Written::Recovered;
                }
                ReadBack::Stale(e) => return Written::Stale(e),
                ReadBack::Lost => return Written::Lost,
                ReadBack::Unread => return Written::Retry,
            }
        }
        Err(e) => {
            warn!(source = %ownership.stream, partition = %ownership.shard_id, error = &e as &dyn std::error::Error, "progress write failed; will retry");
            *uncertain = Some(write.clone());
            return Written::Retry;
        }
    }
    *uncertain = None;
    metrics::counter!("shardwise_checkpoint_writes_total", &labels).increment(1);
    if let Some(applied) = &to.applied_position {
        order.applied(applied);
    }
    barrier.written(write);
    Written::Done
}

/// What the row says after a progress write was refused as not newer.
pub(crate) enum ReadBack {
    /// It holds the write: an earlier try of it went through and its answer was lost.
    Stored,
    /// It holds `earlier`, a write of this attempt whose answer was an error.
    Earlier,
    /// It holds something else under our lease: this attempt is stale.
    Stale(Error),
    /// The lease is not ours any more.
    Lost,
    /// The row could not be read; write again later.
    Unread,
}

/// Under our epoch only we write, so a progress write refused as not newer means one of: this
/// write (or `earlier`, whose answer was lost) is stored, or the attempt is stale. The row tells.
pub(crate) async fn read_back(
    store: &dyn LeaseStore,
    ownership: &Ownership,
    to: &PagedProgress,
    earlier: Option<&PagedProgress>,
) -> ReadBack {
    match store.get(&ownership.stream, &ownership.shard_id).await {
        Ok(Some(row)) if row.ownership().as_ref() == Some(ownership) => {
            if row.progress.as_ref() == Some(to) {
                ReadBack::Stored
            } else if earlier.is_some() && row.progress.as_ref() == earlier {
                ReadBack::Earlier
            } else {
                warn!(source = %ownership.stream, partition = %ownership.shard_id, stored = ?row.progress, meant = ?to, "the stored progress moved under this attempt: it is stale and stops (the lease is given back; the partition is read again from what is stored)");
                ReadBack::Stale(Error::Paged {
                    source_name: ownership.stream.clone(),
                    partition: ownership.shard_id.clone(),
                    what: "stale attempt",
                    source: format!(
                        "stored progress {:?} is not what this attempt wrote ({to:?})",
                        row.progress
                    )
                    .into(),
                })
            }
        }
        Ok(_) => ReadBack::Lost,
        Err(e) => {
            warn!(source = %ownership.stream, partition = %ownership.shard_id, error = &e as &dyn std::error::Error, "reading the row back failed; the write is made again later");
            ReadBack::Unread
        }
    }
}

/// Writes what has settled, one write after another, until nothing is left to write (`Done`), a
/// write fails (`Retry`: what is stored stays, and is read again), or the lease is lost or the
/// attempt stale.
async fn flush<H>(
    ctx: &PartitionContext<H>,
    ownership: &Ownership,
    barrier: &mut Barrier,
    order: &mut Order,
    uncertain: &mut Option<BarrierWrite>,
) -> Written {
    // An applied write, then a barrier: two writes cover everything settled; more only when a
    // write raced with a settlement.
    for _ in 0..8 {
        let Some(write) = barrier.next_write().filter(|w| *w != BarrierWrite::End) else {
            return Written::Done;
        };
        let flight = start(ctx, ownership, barrier.durable().clone(), write);
        let result = flight.handle.await.unwrap_or_else(|e| {
            Err(Error::Corrupt {
                what: "progress write task",
                detail: e.to_string(),
            })
        });
        match written(
            ctx,
            ownership,
            barrier,
            order,
            uncertain,
            &flight.write,
            result,
        )
        .await
        {
            Written::Done | Written::Recovered => {}
            other => return other,
        }
    }
    Written::Done
}
