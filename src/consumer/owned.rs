//! One loop for everything a worker owns: a Kinesis shard ([`shard`](super::shard)), a paged
//! partition ([`partition`](super::partition)) and a partition read by timestamp
//! ([`timestamps`](super::timestamps)). What differs between them is their [`Progress`]: how a
//! lease's progress is prepared (the LATEST pin), read into deliveries, advanced as deliveries
//! settle, proposed for a write, and what a stored or failed write changes. The loop owns the rest.
//!
//! ```text
//! TAKEN ──prepare──► READING ──stop──► DRAINING ──drained, or only held deliveries left, or deadline──► FINAL WRITES ──► Stopped
//!                       │
//!                       ├──nothing more to read, every delivery settled, the progress ends──► SHARD_END ──► Ended
//!                       └──the source cannot be read on, or a write finds the attempt stale──► FINAL WRITES ──► Failed
//! any state ──lease given up (token)──► FINAL WRITES of what settled (fenced: refused if the row moved) ──► Lost
//! any state ──a write refused as Lost──► Lost (nothing more written)
//! ```
//!
//! Every write is the store's fenced write: owner and ownership epoch of this lease, and a
//! condition on what is stored that the progress states (a greater position, or a
//! compare-and-swap of the progress it last stored). At most one write is in flight, at most one
//! starts per `checkpoint_interval`, and a progress with nothing settled proposes none. When the
//! work is over and which write ends it is decided by [`ending::step`](super::ending::step).

use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::mpsc;
use tokio::task::{JoinError, JoinHandle};
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::ending::{Reading, Step};
use super::health;
use super::pipeline::{Advance, Pipeline, PipelineContext, Retries};
use crate::checkpoint::Checkpoint;
use crate::error::Error;
use crate::handler::Handler;
use crate::lease::{CheckpointWrite, HeldLease, LeaseStore, Ownership};
use crate::track::Tracker;

/// What every owned lease needs from the consumer.
pub(crate) struct OwnedContext<H> {
    /// What its deliveries need.
    pub(crate) pipeline: PipelineContext<H>,
    pub(crate) store: Arc<dyn LeaseStore>,
    /// Graceful stop: stop reading, drain, write the final progress.
    pub(crate) stop: CancellationToken,
    /// The drain deadline passed: abort running handlers and write what has settled.
    pub(crate) abort: CancellationToken,
}

impl<H> Clone for OwnedContext<H> {
    fn clone(&self) -> Self {
        Self {
            pipeline: self.pipeline.clone(),
            store: self.store.clone(),
            stop: self.stop.clone(),
            abort: self.abort.clone(),
        }
    }
}

/// How an owned lease's run ended.
#[derive(Debug)]
pub(crate) enum Exit {
    /// Every record has a durable outcome (read to its end, or aged out), SHARD_END written.
    Ended(Ownership),
    /// Ended, and the partition is gone from its source: its row is to be deleted.
    Gone(Ownership),
    /// Stopped on request; the final progress was written (or attempted).
    Stopped(Ownership),
    /// Stopped because it was idle, its final progress written: its row is to be retired at
    /// this time (the provider's, ms) until the source lists activity after it.
    Retired(Ownership, i64),
    /// The lease was lost: nothing more was written.
    Lost(Ownership),
    /// Reading failed for good (the source is gone, a cursor refused, the pages broke the
    /// source's order), or the attempt found itself stale. The lease is released.
    Failed(Ownership, Error),
}

/// Why a paged partition is refused, if its replay may need receipts that expired: the ledger
/// deletes receipts while the source still keeps their events, the durable progress needs
/// receipts recorded since `since` (the provider's time, ms), and the ledger keeps them for less
/// than that has been, unless the consumer resumes past them. (With a source that deletes
/// events, the ledger keeps receipts longer than the events, and nothing is refused.) The
/// refusal releases the lease (it is taken again after growing waits, and refused again) until
/// an operator seeks the partition or resumes past the expired receipts.
pub(crate) fn refuse_past_expired_receipts<H: Handler>(
    ctx: &OwnedContext<H>,
    ownership: &Ownership,
    since: Option<i64>,
    now_ms: i64,
) -> Option<Error> {
    if !ctx.pipeline.receipts_expire_first {
        return None;
    }
    let (Some(since), Some(kept)) = (
        since,
        ctx.pipeline.receipts.as_ref().and_then(|r| r.retention()),
    ) else {
        return None;
    };
    if !crate::receipts::receipts_may_have_expired(kept, since, now_ms) {
        return None;
    }
    let days = |ms: i64| ms as f64 / 86_400_000.0;
    let age = days(now_ms.saturating_sub(since));
    let kept_days = kept.as_secs_f64() / 86_400.0;
    if ctx.pipeline.settings.resume_past_expired_receipts {
        warn!(source = %ownership.stream, partition = %ownership.shard_id, progress_age_days = age, receipts_kept_days = kept_days, "the partition's progress is older than receipts are kept: read on as told (resume_past_expired_receipts); events handled since may be handled again, their effects applied a second time");
        return None;
    }
    metrics::counter!("shardwise_paged_expired_receipts_total", "stream" => ownership.stream.clone(), "shard" => ownership.shard_id.clone()).increment(1);
    let why = format!(
        "its durable progress needs receipts recorded {age:.2} days ago, and receipts are kept {kept_days:.2} days: the events handled since would be handed out again with their receipts gone and their effects applied a second time; seek the partition (`shardwise seek`), or resume past the expired receipts (`--resume-past-expired-receipts`, `ConsumerBuilder::resume_past_expired_receipts`)"
    );
    error!(source = %ownership.stream, partition = %ownership.shard_id, "partition refused: {why}");
    Some(Error::paged(ownership, "receipts may have expired", why))
}

/// What became of a write.
#[derive(Debug)]
pub(crate) enum Answer<W> {
    /// `W` is stored: this write, or an earlier one of this attempt whose answer was lost.
    Stored(W),
    /// Refused: what is stored is as new as this write or newer. Nothing to do.
    NotNewer,
    /// The lease is not ours any more.
    Lost,
    /// The lease is ours, but what is stored moved under this attempt: it stops, and the lease is
    /// given back so the next owner reads again from what is stored.
    Stale(Error),
    /// The write failed; it may have been stored. It is proposed again later.
    Failed(Error),
    /// The write was refused, and what is stored could not be read to tell why. Nothing changes;
    /// it is proposed again later.
    Unread(Error),
}

impl<W> Answer<W> {
    /// The store's answer to a fenced write of `write`.
    pub(crate) fn of(write: W, result: Result<CheckpointWrite, Error>) -> Self {
        match result {
            Ok(CheckpointWrite::Written) => Answer::Stored(write),
            Ok(CheckpointWrite::NotNewer) => Answer::NotNewer,
            Ok(CheckpointWrite::Lost) => Answer::Lost,
            Err(e) => Answer::Failed(e),
        }
    }
}

/// What a reader's message did.
#[derive(Debug)]
pub(crate) enum Read {
    /// A page was read and its deliveries handed out; reading goes on.
    Page,
    /// A page was read, and nothing comes after it.
    LastPage,
    /// Something besides a page (a traversal's end): reading goes on.
    Note,
    /// Nothing more can be read: a closed shard read to its end, or one that aged out.
    Over(Reading),
    /// The source cannot be read on.
    Failed(Error),
}

/// A progress ready to read: `reader` is `None` when there is nothing left to read.
pub(crate) struct Prepared<P: Progress> {
    pub(crate) progress: P,
    pub(crate) reader: Option<mpsc::Receiver<P::Message>>,
    /// A reader with a last step to take at a graceful stop (a final audit) is told to finish
    /// with this token, and read until it ends, rather than cancelled.
    pub(crate) finish: Option<CancellationToken>,
}

/// The lease is lost.
#[derive(Debug)]
pub(crate) struct Lost;

/// What differs between the kinds of lease a worker owns.
pub(crate) trait Progress: Sized + Send + 'static {
    /// What every lease of this kind reads from.
    type Source: Clone + Send + Sync + 'static;
    /// What the reader hands over.
    type Message: Send + 'static;
    /// What a tracked delivery leaves for the progress once it settles.
    type Entry: Send + Sync + 'static;
    /// A write this progress proposes.
    type Write: Clone + Send + std::fmt::Debug + 'static;

    /// How a failing delivery is retried.
    const RETRIES: Retries;

    /// Prepares the lease's progress from its row and starts its reader (stopped by `reader`).
    /// `Err`: the run is over before it began.
    fn prepare<H: Handler>(
        source: &Self::Source,
        ctx: &OwnedContext<H>,
        held: &HeldLease,
        reader: CancellationToken,
    ) -> impl Future<Output = Result<Prepared<Self>, Exit>> + Send;

    /// Takes the reader's message: tracks and dispatches its deliveries.
    fn read<H: Handler>(
        &mut self,
        message: Self::Message,
        pipeline: &mut Pipeline<H, Self::Entry>,
    ) -> impl Future<Output = Read> + Send;

    /// The settled prefix moved.
    fn advanced(&mut self, advance: Advance<Self::Entry>);

    /// The next write, if anything settled since the last one.
    fn propose(&mut self, tracker: &Tracker<Self::Entry>) -> Option<Self::Write>;

    /// Makes `write`, fenced by the lease: run as its own task.
    fn write(&self, write: &Self::Write) -> BoxFuture<'static, Answer<Self::Write>>;

    /// `write` is stored.
    fn stored(&mut self, write: Self::Write);

    /// `write` failed, and may have been stored.
    fn failed(&mut self, write: Self::Write);

    /// Whether progress settled that no write has taken yet.
    fn unwritten(&self) -> bool {
        false
    }

    /// Every checkpoint interval, after a write was proposed (`writing`: one is in flight).
    fn tick(
        &mut self,
        _tracker: &Tracker<Self::Entry>,
        _writing: bool,
    ) -> impl Future<Output = Result<(), Lost>> + Send {
        async { Ok(()) }
    }

    /// Before SHARD_END is written: what must happen first (a tumbling window's final call).
    /// An error stops the attempt instead; the next one reads the shard's end again.
    fn before_end(&mut self) -> impl Future<Output = Result<(), Error>> + Send {
        async { Ok(()) }
    }

    /// Whether the lease's work is over once everything is written: SHARD_END may be written.
    fn ends(&self) -> bool;

    /// Whether what the lease names is gone from its source (a deleted log stream): once ended,
    /// its row is deleted rather than kept at SHARD_END.
    fn gone(&self) -> bool {
        false
    }

    /// Whether the lease's work had nothing new for as long as its source lets a partition
    /// retire ([`PagedSource::retire_after`](crate::paged::PagedSource::retire_after)); asked
    /// every checkpoint interval while nothing is unsettled or being written. `true` stops it
    /// as a graceful stop would, then retires its row at [`retired_at`](Self::retired_at).
    fn idle(&self) -> bool {
        false
    }

    /// After a retirement's final writes: the time its row retires at (`None`: the stored
    /// progress does not tell, and the lease is released instead).
    fn retired_at(&self) -> Option<i64> {
        None
    }
}

/// A write in flight.
struct InFlight<W> {
    write: W,
    handle: JoinHandle<Answer<W>>,
}

/// Why the loop stopped.
enum Halt {
    /// A write was refused: the row names another owner or epoch.
    Lost,
    /// The manager let the lease go (its token): its hold ran out while renewals went
    /// unanswered, or it saw the row move.
    GivenUp,
    Stop,
    End,
    Failed(Error),
}

/// The gauge of deliveries in flight (`shardwise_in_flight`), zeroed when the lease stops here (so
/// a lease that moved to another worker does not keep reporting its last load from this one).
/// Registered once per partition: it is set at every turn of the loop.
struct InFlightGauge(metrics::Gauge);

impl InFlightGauge {
    fn new(labels: &[(&'static str, String); 2]) -> Self {
        Self(metrics::gauge!("shardwise_in_flight", labels))
    }

    fn set(&self, n: usize) {
        self.0.set(n as f64);
    }
}

impl Drop for InFlightGauge {
    fn drop(&mut self) {
        self.set(0);
    }
}

/// The lease a progress runs under: who holds it (every write is fenced by it), where it is
/// stored, its names as deliveries carry them, and its metric labels.
pub(crate) struct Leased {
    pub(crate) ownership: Ownership,
    pub(crate) store: Arc<dyn LeaseStore>,
    /// The stream, or the paged source.
    pub(crate) stream: Arc<str>,
    /// The shard, or the partition.
    pub(crate) shard: Arc<str>,
    pub(crate) labels: [(&'static str, String); 2],
}

impl Leased {
    pub(crate) fn new(ownership: &Ownership, store: &Arc<dyn LeaseStore>) -> Self {
        Self {
            ownership: ownership.clone(),
            store: store.clone(),
            stream: Arc::from(ownership.stream.as_str()),
            shard: Arc::from(ownership.shard_id.as_str()),
            labels: [
                ("stream", ownership.stream.clone()),
                ("shard", ownership.shard_id.clone()),
            ],
        }
    }
}

/// Runs one owned lease until it ends, is stopped, fails, or is lost.
pub(crate) async fn run_owned<H: Handler, P: Progress>(
    ctx: OwnedContext<H>,
    source: P::Source,
    held: HeldLease,
) -> Exit {
    let ownership = held.ownership.clone();
    let lost = held.cancel.clone();
    let reader_cancel = lost.child_token();
    let _stop_reader = reader_cancel.clone().drop_guard();
    let Prepared {
        mut progress,
        reader,
        finish,
    } = match P::prepare(&source, &ctx, &held, reader_cancel.clone()).await {
        Ok(prepared) => prepared,
        Err(exit) => return exit,
    };
    let (mut reading, mut messages) = match reader {
        Some(messages) => (Reading::Open, messages),
        None => (Reading::Closed, mpsc::channel(1).1),
    };
    let mut owned = Owned {
        health: ctx.pipeline.health.enter(&ownership.shard_id),
        lease: Leased::new(&ownership, &ctx.store),
        in_flight: None,
    };
    let gauge = InFlightGauge::new(&owned.lease.labels);
    let settings = &ctx.pipeline.settings;
    // A Kinesis consumer may run its retries in place too.
    let retries = if ctx.pipeline.retry.in_place {
        Retries::InPlace
    } else {
        P::RETRIES
    };
    let mut pipeline: Pipeline<H, P::Entry> = Pipeline::new(
        ctx.pipeline.clone(),
        owned.lease.ownership.epoch,
        retries,
        Some(held.hold.clone()),
    );
    let mut tick = tokio::time::interval(settings.checkpoint_interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut aborted = false;
    let mut finishing = false;
    // Stopping gracefully because the partition was idle: its row retires after the final writes.
    let mut retiring = false;

    let halt = loop {
        let room = pipeline.has_room();
        let writing = owned.in_flight.is_some();
        tokio::select! {
            biased;
            _ = lost.cancelled() => break Halt::GivenUp,
            _ = ctx.abort.cancelled(), if !aborted => {
                aborted = true;
                pipeline.abort_handlers();
                if reading == Reading::Open {
                    reading = Reading::Stopped;
                }
                reader_cancel.cancel();
            }
            _ = ctx.stop.cancelled(), if reading == Reading::Open && !finishing => {
                match &finish {
                    // Read on until the reader ends (the channel closes): what its last step
                    // hands over is handled and settles before the final writes.
                    Some(finish) => {
                        finishing = true;
                        finish.cancel();
                    }
                    None => {
                        reading = Reading::Stopped;
                        reader_cancel.cancel();
                    }
                }
            }
            answer = async { (&mut owned.in_flight.as_mut().expect("writing").handle).await }, if writing => {
                let write = owned.in_flight.take().expect("writing").write;
                match owned.answered(&mut progress, write, joined(answer)) {
                    Ok(_) => {}
                    Err(Stale::Lost) => break Halt::Lost,
                    Err(Stale::Attempt(e)) => break Halt::Failed(e),
                }
            }
            advance = pipeline.next() => {
                if let Some(advance) = advance {
                    progress.advanced(advance);
                    owned.health.pending();
                }
                gauge.set(pipeline.unsettled());
            }
            message = messages.recv(), if reading == Reading::Open && room => match message {
                None => reading = Reading::Stopped,
                Some(message) => {
                    let read = progress.read(message, &mut pipeline).await;
                    pipeline.flush();
                    match read {
                        Read::Page => owned.health.read(),
                        Read::LastPage => {
                            owned.health.read();
                            reading = Reading::Closed;
                        }
                        Read::Note => {}
                        Read::Over(over) => reading = over,
                        Read::Failed(e) => break Halt::Failed(e),
                    }
                    gauge.set(pipeline.unsettled());
                }
            },
            _ = tick.tick() => {
                gauge.set(pipeline.unsettled());
                pipeline.tick();
                if owned.in_flight.is_none() && let Some(write) = progress.propose(pipeline.tracker()) {
                    owned.start(&progress, write);
                }
                if progress.tick(pipeline.tracker(), owned.in_flight.is_some()).await.is_err() {
                    break Halt::Lost;
                }
                // Idle for its source's retirement time, everything settled and written: stop
                // as a graceful stop does (its reader's last step included), then retire.
                if !retiring
                    && reading == Reading::Open
                    && !finishing
                    && !ctx.stop.is_cancelled()
                    && owned.in_flight.is_none()
                    && pipeline.unsettled() == 0
                    && progress.idle()
                {
                    retiring = true;
                    match &finish {
                        Some(finish) => {
                            finishing = true;
                            finish.cancel();
                        }
                        None => {
                            reading = Reading::Stopped;
                            reader_cancel.cancel();
                        }
                    }
                }
            }
        }
        // A reader told to finish that waits for room no delivery will make (only held ones
        // left) is stopped as a cancelled one would be.
        if finishing
            && reading == Reading::Open
            && !pipeline.has_room()
            && pipeline.step(Reading::Stopped, true, aborted) == Step::Stop
        {
            reading = Reading::Stopped;
            reader_cancel.cancel();
        }
        match pipeline.step(reading, ctx.stop.is_cancelled() || retiring, aborted) {
            Step::Continue => {}
            Step::Stop => break Halt::Stop,
            Step::End => break Halt::End,
        }
    };

    pipeline.abort();
    let ownership = owned.lease.ownership.clone();
    match halt {
        Halt::Lost => {
            info!(stream = %ownership.stream, shard = %ownership.shard_id, "lease lost: stopped, nothing more written");
            Exit::Lost(ownership)
        }
        Halt::GivenUp => {
            // Given up is not taken: when the hold ran out because renewals were answered late
            // (a stalled store, a starved host), the row most likely still names this worker and
            // epoch. What settled is written then, fenced by owner and epoch as every write, so
            // the next owner (often this worker again) does not handle it again; a row another
            // worker took refuses it. Nothing is handed out any more: the handlers are aborted.
            match owned.flush(&mut progress, pipeline.tracker()).await {
                Ok(()) => {
                    info!(stream = %ownership.stream, shard = %ownership.shard_id, "lease given up: stopped; what settled is written (fenced: the row still named this worker and epoch), if anything was left to write")
                }
                Err(_) => {
                    info!(stream = %ownership.stream, shard = %ownership.shard_id, "lease lost: stopped, nothing more written")
                }
            }
            Exit::Lost(ownership)
        }
        Halt::Failed(e) => {
            let _ = owned.flush(&mut progress, pipeline.tracker()).await;
            Exit::Failed(ownership, e)
        }
        Halt::Stop | Halt::End => {
            match owned.flush(&mut progress, pipeline.tracker()).await {
                Ok(()) => {}
                Err(Stale::Lost) => return Exit::Lost(ownership),
                Err(Stale::Attempt(e)) => return Exit::Failed(ownership, e),
            }
            if matches!(halt, Halt::End) && progress.ends() {
                if let Err(e) = progress.before_end().await {
                    return Exit::Failed(ownership, e);
                }
                match owned
                    .lease
                    .store
                    .checkpoint(&ownership, &Checkpoint::ShardEnd, None)
                    .await
                {
                    Ok(CheckpointWrite::Written | CheckpointWrite::NotNewer) => {
                        info!(stream = %ownership.stream, shard = %ownership.shard_id, "ended: every delivery settled, SHARD_END written");
                        if progress.gone() {
                            return Exit::Gone(ownership);
                        }
                        return Exit::Ended(ownership);
                    }
                    Ok(CheckpointWrite::Lost) => return Exit::Lost(ownership),
                    Err(e) => return Exit::Failed(ownership, e),
                }
            }
            if retiring
                && matches!(halt, Halt::Stop)
                && let Some(at) = progress.retired_at()
            {
                info!(stream = %ownership.stream, shard = %ownership.shard_id, read_through = at, "idle: stopped, its final progress written, to retire");
                return Exit::Retired(ownership, at);
            }
            info!(stream = %ownership.stream, shard = %ownership.shard_id, "stopped: what settled is written");
            Exit::Stopped(ownership)
        }
    }
}

/// Why writing stops.
enum Stale {
    /// The lease is lost.
    Lost,
    /// The attempt is stale.
    Attempt(Error),
}

/// The loop's own state besides the progress: the lease, its health slot, the write in flight.
struct Owned<W> {
    lease: Leased,
    health: health::Entry,
    in_flight: Option<InFlight<W>>,
}

/// The most writes a final flush makes, and the most failures it takes before it gives up (what
/// is stored stays; the next owner reads again from it). One write covers everything settled on
/// Kinesis; a paged barrier needs two (an applied write, then the cursor), more only when a write
/// raced with a settlement.
const FLUSH_WRITES: usize = 8;
const FLUSH_FAILURES: usize = 3;

impl<W: Clone + Send + std::fmt::Debug + 'static> Owned<W> {
    fn start<P: Progress<Write = W>>(&mut self, progress: &P, write: W) {
        let handle = tokio::spawn(crate::time::carry(progress.write(&write)));
        self.in_flight = Some(InFlight { write, handle });
    }

    /// Takes a write's answer into the progress. `Ok(true)`: it reached the store; `Ok(false)`: it
    /// failed and is proposed again.
    fn answered<P: Progress<Write = W>>(
        &self,
        progress: &mut P,
        write: W,
        answer: Answer<W>,
    ) -> Result<bool, Stale> {
        let (stream, shard) = (&self.lease.ownership.stream, &self.lease.ownership.shard_id);
        match answer {
            Answer::Stored(stored) => {
                metrics::counter!("shardwise_checkpoint_writes_total", &self.lease.labels)
                    .increment(1);
                debug!(%stream, %shard, write = ?stored, "written");
                progress.stored(stored);
                self.health.written(progress.unwritten());
                Ok(true)
            }
            Answer::NotNewer => {
                debug!(%stream, %shard, ?write, "not newer than what is stored");
                self.health.written(progress.unwritten());
                Ok(true)
            }
            Answer::Lost => Err(Stale::Lost),
            Answer::Stale(e) => Err(Stale::Attempt(e)),
            Answer::Failed(e) => {
                warn!(%stream, %shard, ?write, error = &e as &dyn std::error::Error, "write failed; it is made again");
                progress.failed(write);
                Ok(false)
            }
            Answer::Unread(e) => {
                warn!(%stream, %shard, ?write, error = &e as &dyn std::error::Error, "write refused, and reading the row back failed; it is made again");
                Ok(false)
            }
        }
    }

    /// Waits for the write in flight, then writes what the progress proposes until nothing is
    /// left, [`FLUSH_WRITES`] were made, or [`FLUSH_FAILURES`] failed.
    async fn flush<P: Progress<Write = W>>(
        &mut self,
        progress: &mut P,
        tracker: &Tracker<P::Entry>,
    ) -> Result<(), Stale> {
        if let Some(InFlight { write, handle }) = self.in_flight.take() {
            self.answered(progress, write, joined(handle.await))?;
        }
        let mut failures = 0;
        for _ in 0..FLUSH_WRITES {
            let Some(write) = progress.propose(tracker) else {
                return Ok(());
            };
            // Made here, not in a task of its own: nothing else runs meanwhile.
            let answer = std::panic::AssertUnwindSafe(progress.write(&write))
                .catch_unwind()
                .await
                .unwrap_or_else(|panic| interrupted(Some(panic)));
            if !self.answered(progress, write, answer)? {
                failures += 1;
                if failures == FLUSH_FAILURES {
                    warn!(stream = %self.lease.ownership.stream, shard = %self.lease.ownership.shard_id, failures, "the final writes keep failing: what is stored stays, and the next owner reads again from it");
                    return Ok(());
                }
            }
        }
        Ok(())
    }
}

/// A write task that did not answer: it panicked (in shardwise or in the store it called) or the
/// runtime is shutting down. The write may or may not have been made.
fn joined<W>(answer: Result<Answer<W>, JoinError>) -> Answer<W> {
    answer.unwrap_or_else(|e| {
        interrupted(if e.is_panic() {
            Some(e.into_panic())
        } else {
            None
        })
    })
}

/// A write that panicked (`Some`: its payload) or was cancelled.
fn interrupted<W>(panic: Option<Box<dyn std::any::Any + Send>>) -> Answer<W> {
    let detail = match panic {
        Some(payload) => {
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".to_string());
            format!("it panicked: {message}")
        }
        None => "its task was cancelled (the runtime is shutting down)".to_string(),
    };
    Answer::Failed(Error::Interrupted {
        what: "checkpoint write",
        detail,
    })
}
