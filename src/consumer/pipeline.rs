//! The deliveries of one owned partition (a Kinesis shard or a paged partition), from dispatch to
//! settlement: lanes run the handler, each outcome is carried out, and the tracker says how far the
//! contiguous settled prefix has come. What is read, and how progress is written, belong to the
//! partition's own loop (`shard.rs`, `partition.rs`).
//!
//! Outcomes are carried out as follows:
//! - an ack or a drop settles at once;
//! - a retry writes a copy to the stream (Kinesis), or runs the delivery again on its lane after
//!   the delay (a paged source, which has no stream to copy to). A spent retry writes a dead letter
//!   or drops;
//! - effects are committed with their receipt;
//! - a quarantine or a hold records a receipt.
//!
//! A delivery settles only once its outcome is durable. Until then it holds the prefix, so nothing
//! after it can be checkpointed past it.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tracing::info;

use super::config::Settings;
use super::copies::{PendingWrite, StuckWrites, WriteEvent};
use super::ending::{self, Reading, ShardState, Step};
use super::hooks::{DeliveryHooks, Settled};
use super::lanes::{Done, Finished, FinishedRun, LaneSettings, Lanes};
use super::ledger::{self, Ledger, LedgerEvent};
use super::outcome::{Resolved, resolve};
use crate::handler::{Delivery, Handler, Outcome};
use crate::lease::Hold;
use crate::producer::Producer;
use crate::receipts::{Disposition, ReceiptStore};
use crate::retry::{RetryPlan, RetryPolicy};
use crate::track::{DeliveryId, Tracker};

/// The most finished deliveries one call of [`Pipeline::next`] takes.
const FINISHED_PER_TURN: usize = 256;

/// `shardwise_records_total` of one stream, a counter per outcome, registered once (a metric
/// looked up by its labels for every record costs more than the rest of a no-op handler's
/// delivery).
struct OutcomeCounters {
    stream: String,
    counters: Vec<(&'static str, metrics::Counter)>,
}

impl OutcomeCounters {
    fn new(stream: &str) -> Self {
        Self {
            stream: stream.to_string(),
            counters: Vec::new(),
        }
    }

    fn count(&mut self, outcome: &Outcome) {
        let label = outcome.label();
        if let Some((_, counter)) = self.counters.iter().find(|(l, _)| *l == label) {
            counter.increment(1);
            return;
        }
        let counter = metrics::counter!("shardwise_records_total", "stream" => self.stream.clone(), "outcome" => label);
        counter.increment(1);
        self.counters.push((label, counter));
    }
}

/// Longest wait before a paged event is run again after a plain `Retry`.
const MAX_IN_PLACE_BACKOFF: Duration = Duration::from_secs(5);

/// What a partition's deliveries need from the consumer.
pub(crate) struct PipelineContext<H> {
    pub(crate) handler: Arc<H>,
    pub(crate) settings: Arc<Settings>,
    /// Writes retry copies and dead letters.
    pub(crate) producer: Producer,
    /// What retries become.
    pub(crate) retry: Arc<RetryPolicy>,
    /// Copies and dead letters whose writes fail for good, for every partition of the consumer.
    pub(crate) stuck: StuckWrites,
    /// Where dead letters go when not to a stream.
    pub(crate) destination: Option<Arc<dyn crate::destination::Destination>>,
    /// The receipt ledger, if the consumer has one.
    pub(crate) receipts: Option<Arc<dyn ReceiptStore>>,
    /// The ledger deletes receipts while the source still keeps their events (a source that
    /// keeps events for good and bounds what a replay needs): a partition whose replay may need
    /// expired receipts is refused as it is taken.
    pub(crate) receipts_expire_first: bool,
    /// Told how each delivery settled.
    pub(crate) hooks: Arc<dyn DeliveryHooks>,
    /// Each partition's reads and checkpoint writes, for health.
    pub(crate) health: super::health::Board,
}

impl<H> Clone for PipelineContext<H> {
    fn clone(&self) -> Self {
        Self {
            handler: self.handler.clone(),
            settings: self.settings.clone(),
            producer: self.producer.clone(),
            retry: self.retry.clone(),
            stuck: self.stuck.clone(),
            destination: self.destination.clone(),
            receipts_expire_first: self.receipts_expire_first,
            receipts: self.receipts.clone(),
            hooks: self.hooks.clone(),
            health: self.health.clone(),
        }
    }
}

/// Where a retry goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Retries {
    /// A copy written to the stream (Kinesis).
    Copies,
    /// The delivery run again on its lane (a paged source).
    InPlace,
}

/// The settled prefix moved: every delivery up to arrival `index` has settled, the last at `entry`.
#[derive(Debug)]
pub(crate) struct Advance<E> {
    pub(crate) index: u64,
    pub(crate) entry: E,
}

pub(crate) struct Pipeline<H, E> {
    ctx: PipelineContext<H>,
    retries: Retries,
    lanes: Lanes,
    finished: mpsc::UnboundedReceiver<FinishedRun>,
    tracker: Tracker<E>,
    /// Deliveries whose retry was refused (logged once each).
    refused: HashSet<DeliveryId>,
    /// Deliveries waiting to run again in place whose lane parked their key: they go back to
    /// that lane ([`Lanes::again`]).
    parked: HashSet<DeliveryId>,
    /// Deliveries whose lane parked their key until their outcome is durable (effects being
    /// committed, a quarantine or dead letter being written): the key is unparked when they
    /// settle or are held, or they go back to the lane if their commit is refused.
    releasing: HashSet<DeliveryId>,
    /// Copies and dead letters whose writes fail for good right now.
    stuck_writes: usize,
    write_tx: mpsc::UnboundedSender<WriteEvent>,
    write_rx: mpsc::UnboundedReceiver<WriteEvent>,
    /// Copy writes, receipt records and in-place retry timers.
    tasks: JoinSet<()>,
    ledger: Option<Ledger>,
    worker: Arc<str>,
    /// Events that failed and run again in place, not settled yet (on the health board).
    retrying: usize,
    /// The labels of `shardwise_paged_events_retrying` (stream, partition), once it was set.
    retry_labels: Option<(String, String)>,
    records: OutcomeCounters,
}

impl<H: Handler, E> Pipeline<H, E> {
    /// Starts the lanes; deliveries are tracked under `epoch` (the ownership epoch).
    pub(crate) fn new(
        ctx: PipelineContext<H>,
        epoch: u64,
        retries: Retries,
        hold: Option<Hold>,
    ) -> Self {
        let settings = &ctx.settings;
        let (finished_tx, finished) = mpsc::unbounded_channel::<FinishedRun>();
        let lanes = Lanes::start(
            settings.lanes,
            settings.ordering,
            ctx.handler.clone(),
            finished_tx,
            LaneSettings::of(
                settings,
                ctx.receipts.clone(),
                retries == Retries::InPlace,
                hold,
            ),
        );
        let (write_tx, write_rx) = mpsc::unbounded_channel();
        let worker: Arc<str> = Arc::from(settings.worker_id.as_str());
        let ledger = ctx
            .receipts
            .clone()
            .map(|store| Ledger::new(store, worker.clone(), settings.hold_poll_interval));
        let records = OutcomeCounters::new(&settings.stream);
        Self {
            ctx,
            retries,
            lanes,
            finished,
            tracker: Tracker::new(epoch),
            refused: HashSet::new(),
            parked: HashSet::new(),
            releasing: HashSet::new(),
            stuck_writes: 0,
            write_tx,
            write_rx,
            tasks: JoinSet::new(),
            ledger,
            worker,
            retrying: 0,
            retry_labels: None,
            records,
        }
    }

    /// Tracks the next delivery (`entry` is what the checkpoint is written as) and picks its lane.
    /// `partition_key` `None`: a paged event without a key, ordered against nothing.
    pub(crate) fn track(&mut self, entry: E, partition_key: Option<&str>) -> (DeliveryId, usize) {
        let id = self.tracker.track(entry);
        (id, self.lanes.assign_keyed(partition_key))
    }

    /// Hands a tracked delivery to its lane: sent with the rest of what was read at the next
    /// [`flush`](Self::flush) (the owning loop flushes after each read, and [`next`](Self::next)
    /// before it waits).
    pub(crate) fn dispatch(&mut self, delivery: Delivery) {
        self.lanes.dispatch(delivery);
    }

    /// Sends the lanes what was dispatched since the last flush.
    pub(crate) fn flush(&mut self) {
        self.lanes.flush();
    }

    /// Tracks the next delivery without a lane yet (see [`dispatch_unless_done`](Self::dispatch_unless_done)).
    pub(crate) fn track_only(&mut self, entry: E) -> DeliveryId {
        self.tracker.track(entry)
    }

    /// A tracked delivery that may already have its outcome (a backfilled position at or below
    /// the applied prefix): with receipts, a terminal receipt settles it as a replay and anything
    /// else hands it to its lane; without receipts it goes to its lane (handled again rather than
    /// skipped). `counted` names a counter (labelled by stream and shard) that goes up by one for
    /// each delivery handed to its lane this way.
    pub(crate) fn dispatch_unless_done(
        &mut self,
        delivery: Delivery,
        counted: Option<&'static str>,
    ) {
        let count = move |d: &Delivery| {
            if let Some(name) = counted {
                metrics::counter!(name, "stream" => d.stream().to_string(), "shard" => d.shard().to_string())
                    .increment(1);
            }
        };
        match (self.ctx.receipts.clone(), delivery.id()) {
            (Some(store), Some(id)) => {
                let events = self.write_tx.clone();
                self.tasks.spawn(crate::time::carry(async move {
                    let event = delivery.event_id();
                    match ledger::read_receipt(store.as_ref(), &event, "of a backfilled or late event").await {
                        Some(r) if r.disposition.is_terminal() => {
                            metrics::counter!("shardwise_replays_total", "stream" => delivery.stream().to_string())
                                .increment(1);
                            let _ = events.send(WriteEvent::Durable(id, delivery, Settled::Replayed));
                        }
                        _ => {
                            count(&delivery);
                            let _ = events.send(WriteEvent::Redeliver(delivery));
                        }
                    }
                }));
            }
            _ => {
                count(&delivery);
                self.lanes.redispatch(delivery)
            }
        }
    }

    /// A paged event that may be late or may already have its outcome (found behind the durable
    /// progress by an audit): tracked, and handed out unless its receipt shows it done; counted
    /// in `shardwise_paged_late_events_total` when handed out.
    pub(crate) fn dispatch_late(
        &mut self,
        source: &std::sync::Arc<str>,
        partition: &std::sync::Arc<str>,
        event: &crate::paged::PagedEvent,
    ) where
        E: From<crate::paged::PagePosition>,
    {
        let id = self.track_only(E::from(event.position.clone()));
        let delivery = Delivery::paged(source.clone(), partition.clone(), event)
            .set_id(id)
            .replayable(crate::handler::Replayable::Recorded)
            .build();
        self.dispatch_unless_done(delivery, Some(crate::paged::LATE_EVENTS));
    }

    /// Whether more deliveries may be read: fewer than `max_in_flight` between the oldest unsettled
    /// one and the newest.
    pub(crate) fn has_room(&self) -> bool {
        self.tracker.window() < self.ctx.settings.max_in_flight
    }

    /// Deliveries tracked and not settled.
    pub(crate) fn unsettled(&self) -> usize {
        self.tracker.unsettled()
    }

    /// Deliveries that will not settle by themselves: refused retries, stuck writes, held receipts.
    pub(crate) fn held(&self) -> usize {
        self.refused.len() + self.stuck_writes + self.ledger.as_ref().map_or(0, Ledger::held)
    }

    /// What the owning loop does next ([`ending::step`](super::ending::step)), given how reading
    /// stands and whether it was asked to stop or its deadline passed.
    pub(crate) fn step(&self, reading: Reading, stopping: bool, aborted: bool) -> Step {
        ending::step(&ShardState {
            reading,
            stopping,
            aborted,
            unsettled: self.unsettled(),
            held: self.held(),
        })
    }

    /// The tracker, for what the partition's checkpoint needs to know (the oldest unsettled
    /// delivery, the next arrival index).
    pub(crate) fn tracker(&self) -> &Tracker<E> {
        &self.tracker
    }

    /// Starts what is due on the checkpoint timer: the next receipt commit, the poll of held ones.
    pub(crate) fn tick(&mut self) {
        if let Some(ledger) = self.ledger.as_mut() {
            ledger.start_commit();
            ledger.start_poll();
        }
    }

    /// Waits for the next thing that happens to a delivery (a handler finished, a write or receipt
    /// became durable, a hold was released) and carries it out. Returns how far the settled prefix
    /// moved, if it did.
    ///
    /// Cancellation safe: nothing changes before one of the awaited events is taken, and each of
    /// them is cancellation safe.
    pub(crate) async fn next(&mut self) -> Option<Advance<E>> {
        enum Event {
            Finished(FinishedRun),
            Write(WriteEvent),
            Ledger(Vec<LedgerEvent>),
            Task,
        }
        // Nothing dispatched waits unsent while this waits.
        self.lanes.flush();
        let busy = self.ledger.as_ref().is_some_and(Ledger::busy);
        // Biased, in this order: the same events in the same order always do the same (the
        // simulation relies on it).
        let event = tokio::select! {
            biased;
            Some(done) = self.finished.recv() => Event::Finished(done),
            Some(event) = self.write_rx.recv() => Event::Write(event),
            events = async { self.ledger.as_mut().expect("busy").next().await }, if busy => Event::Ledger(events),
            Some(joined) = self.tasks.join_next(), if !self.tasks.is_empty() => {
                // Every task catches its own panics where a delivery depends on it; one that
                // still panicked is a bug to see.
                if let Err(e) = joined
                    && e.is_panic()
                {
                    tracing::error!(error = %e, "a task of the shard panicked");
                }
                Event::Task
            }
            else => std::future::pending().await,
        };
        match event {
            Event::Finished(run) => {
                // What else the lanes finished meanwhile is taken too (a bounded number, so the
                // owning loop still gets its turn): one turn of that loop for many deliveries.
                let mut taken = run.len();
                let mut furthest = None;
                for done in run {
                    if let Some(advance) = self.on_finished(done) {
                        furthest = Some(advance);
                    }
                }
                while taken < FINISHED_PER_TURN {
                    let Ok(run) = self.finished.try_recv() else {
                        break;
                    };
                    taken += run.len();
                    for done in run {
                        if let Some(advance) = self.on_finished(done) {
                            furthest = Some(advance);
                        }
                    }
                }
                furthest
            }
            Event::Write(event) => match event {
                WriteEvent::Durable(id, d, how) => self.settle(id, &d, &how),
                WriteEvent::Stuck => {
                    self.stuck_writes += 1;
                    None
                }
                WriteEvent::Unstuck => {
                    self.stuck_writes = self.stuck_writes.saturating_sub(1);
                    None
                }
                WriteEvent::Held(id, d) => {
                    self.release(id, &d);
                    if let Some(ledger) = self.ledger.as_mut() {
                        ledger.hold(id, d);
                    }
                    None
                }
                WriteEvent::Redeliver(d) => {
                    match d.id().is_some_and(|id| self.parked.remove(&id)) {
                        true => self.lanes.again(d),
                        false => self.lanes.redispatch(d),
                    }
                    None
                }
            },
            Event::Ledger(events) => {
                let mut furthest = None;
                for event in events {
                    if let Some(advance) = self.on_ledger(event) {
                        furthest = Some(advance);
                    }
                }
                furthest
            }
            Event::Task => None,
        }
    }

    /// A delivery a lane is done with.
    fn on_finished(&mut self, done: Finished) -> Option<Advance<E>> {
        // A retry whose lane parked its key stays in flight there until it succeeds or is given
        // up.
        let parked = self.lanes.parked(&done);
        if !parked {
            self.lanes.finished(&done.delivery);
        }
        match done.done {
            Done::Handled(outcome) => self.resolve(done.delivery, outcome, parked),
            Done::Expired(age) => self.expire(done.delivery, age),
            Done::Replayed => {
                let d = done.delivery;
                metrics::counter!("shardwise_replays_total", "stream" => d.stream().to_string())
                    .increment(1);
                tracing::debug!(stream = d.stream(), shard = d.shard(), seq = %d.locator(), event = %d.event_id(), "replay: an earlier attempt left a terminal receipt; not handled again");
                d.id()
                    .and_then(|id| self.settle(id, &d, &Settled::Replayed))
            }
        }
    }

    /// Stops everything in flight (the partition is over: what did not settle is read again).
    pub(crate) fn abort(&mut self) {
        if self.retrying > 0 {
            self.retrying = 0;
            self.retrying_gauge(None);
        }
        self.tasks.abort_all();
        self.lanes.abort();
        if let Some(ledger) = self.ledger.as_mut() {
            ledger.abort();
        }
    }

    /// Aborts the running handlers only (the drain deadline passed); writes go on.
    pub(crate) fn abort_handlers(&mut self) {
        self.tasks.abort_all();
        self.lanes.abort();
    }

    /// A delivery's outcome is durable: the prefix may pass it, and a key its lane parked for it
    /// goes on.
    fn settle(&mut self, id: DeliveryId, delivery: &Delivery, how: &Settled) -> Option<Advance<E>> {
        let settlement = self.tracker.settle(id);
        if settlement.accepted() {
            self.ctx.hooks.settled(delivery, how);
            if self.retrying > 0
                && let Some(left) = self
                    .ctx
                    .health
                    .settled(delivery.shard(), delivery.event_id().as_str())
            {
                self.retrying = left;
                self.retrying_gauge(Some(delivery));
            }
        }
        self.release(id, delivery);
        match settlement {
            crate::track::Settlement::Advanced { index, position } => Some(Advance {
                index,
                entry: position,
            }),
            _ => None,
        }
    }

    /// A key its lane parked for this delivery goes on, if it did.
    fn release(&mut self, id: DeliveryId, delivery: &Delivery) {
        if !self.releasing.is_empty() && self.releasing.remove(&id) {
            self.lanes.unpark(delivery);
        }
    }

    /// A handler's outcome, carried out. `parked`: its lane parked its key; the key stays parked
    /// while the delivery runs again in place or its outcome is being made durable, and is
    /// unparked once it is.
    fn resolve(
        &mut self,
        delivery: Delivery,
        outcome: Outcome,
        parked: bool,
    ) -> Option<Advance<E>> {
        if delivery.id().is_some() {
            self.records.count(&outcome);
        }
        let on_lane = parked.then(|| delivery.clone());
        let resolved = resolve(
            delivery,
            outcome,
            &self.ctx.retry,
            &mut self.refused,
            &self.ctx.settings,
            self.ledger.is_some(),
        );
        let Some(d) = on_lane else {
            return self.carry_out(resolved);
        };
        match (&resolved, d.id()) {
            (Resolved::Write(write), Some(id))
                if self.retries == Retries::InPlace && !write.dead_letter =>
            {
                self.parked.insert(id);
            }
            (Resolved::Write(_) | Resolved::Apply(..) | Resolved::Record(..), Some(id)) => {
                self.releasing.insert(id);
            }
            _ => {
                let advance = self.carry_out(resolved);
                self.lanes.unpark(&d);
                return advance;
            }
        }
        self.carry_out(resolved)
    }

    fn carry_out(&mut self, resolved: Resolved) -> Option<Advance<E>> {
        match resolved {
            Resolved::Settle(id, d, how) => return self.settle(id, &d, &how),
            Resolved::Hold => {}
            Resolved::Write(write) if self.retries == Retries::InPlace && !write.dead_letter => {
                let d = write.delivery.clone();
                self.retrying = self.ctx.health.retrying(
                    d.shard(),
                    d.event_id().as_str(),
                    d.partition_key(),
                    d.attempt(),
                );
                self.retrying_gauge(Some(&d));
                self.tasks
                    .spawn(crate::time::carry(run_again(write, self.write_tx.clone())));
            }
            Resolved::Write(write) => {
                self.tasks.spawn(crate::time::carry(write.run(
                    self.ctx.producer.clone(),
                    self.ctx.destination.clone(),
                    self.ctx.retry.clone(),
                    self.ctx.stuck.clone(),
                    self.write_tx.clone(),
                )));
            }
            Resolved::Apply(id, d, effects) => {
                if let Some(ledger) = self.ledger.as_mut() {
                    ledger.apply(id, d, effects);
                }
            }
            Resolved::Record(id, d, disposition) => {
                if let Some(store) = self.ctx.receipts.clone() {
                    self.tasks.spawn(crate::time::carry(ledger::record(
                        store,
                        self.worker.clone(),
                        id,
                        d,
                        disposition,
                        self.write_tx.clone(),
                    )));
                }
            }
        }
        None
    }

    /// Sets `shardwise_paged_events_retrying{stream, partition}` to the events of this partition
    /// running again in place (each holds the page barrier). `None`: the partition is over.
    fn retrying_gauge(&mut self, of: Option<&Delivery>) {
        if let Some(d) = of {
            self.retry_labels
                .get_or_insert_with(|| (d.stream().to_string(), d.shard().to_string()));
        }
        let Some((stream, partition)) = self.retry_labels.clone() else {
            return;
        };
        metrics::gauge!("shardwise_paged_events_retrying", "stream" => stream, "partition" => partition)
            .set(self.retrying as f64);
    }

    /// A delivery that will not be tried again: to the dead-letter stream (with `reason`) when
    /// there is one; else settled as a drop (Kinesis), or, paged, recorded as `quarantined` in the
    /// receipt ledger, or held where neither can record it (the build refuses such a consumer).
    fn spend(&mut self, d: Delivery, reason: String) -> Option<Advance<E>> {
        let attempts = d.attempt();
        self.spend_after(d, attempts, reason)
    }

    /// [`spend`](Self::spend), for a delivery that got `attempts` attempts.
    fn spend_after(&mut self, d: Delivery, attempts: u32, reason: String) -> Option<Advance<E>> {
        let id = d.id()?;
        let resolved = match self.ctx.retry.spent_after(&d, attempts, reason) {
            plan @ RetryPlan::DeadLetter { .. } => match PendingWrite::new(id, d, plan) {
                Some(write) => Resolved::Write(write),
                None => Resolved::Hold,
            },
            RetryPlan::Quarantine { reason } => {
                Resolved::Record(id, d, Disposition::Quarantined(reason))
            }
            RetryPlan::Refuse => {
                if self.refused.insert(id) {
                    tracing::error!(
                        stream = d.stream(),
                        partition = d.shard(),
                        seq = %d.locator(),
                        "spent, with neither a dead-letter stream nor a receipt ledger to record it: the event stays unsettled and holds its page"
                    );
                }
                Resolved::Hold
            }
            RetryPlan::Drop { .. } | RetryPlan::Copy { .. } => {
                Resolved::Settle(id, d, Settled::Spent)
            }
        };
        self.carry_out(resolved)
    }

    /// A delivery older than `max_record_age`, never handed to the handler.
    fn expire(&mut self, d: Delivery, age: Duration) -> Option<Advance<E>> {
        let max = self.ctx.settings.max_record_age.unwrap_or_default();
        metrics::counter!("shardwise_records_expired_total", "stream" => d.stream().to_string())
            .increment(1);
        tracing::warn!(
            stream = d.stream(),
            shard = d.shard(),
            seq = %d.locator(),
            partition_key = d.partition_key(),
            age = ?age,
            dead_letter = self.ctx.retry.dead_letter.is_some(),
            "record older than max_record_age: not handled"
        );
        // Its attempt was not made: it got one fewer.
        let attempts = d.attempt().saturating_sub(1);
        self.spend_after(
            d,
            attempts,
            format!(
                "record too old: arrived {:.3} s ago, max_record_age {:.3} s",
                age.as_secs_f64(),
                max.as_secs_f64()
            ),
        )
    }

    /// Carries out what the ledger reports.
    fn on_ledger(&mut self, event: LedgerEvent) -> Option<Advance<E>> {
        match event {
            LedgerEvent::Settle(id, d, how) => self.settle(id, &d, &how),
            LedgerEvent::Retry(d) => {
                // Its lane parked its key while the effects were committed: it runs again there.
                let parked = d.id().is_some_and(|id| self.releasing.remove(&id));
                self.resolve(d, Outcome::Retry, parked)
            }
            LedgerEvent::Spent(d, reason) => {
                self.spend(d, format!("effects not committed: {reason}"))
            }
            LedgerEvent::Redeliver(d) => {
                info!(stream = d.stream(), shard = d.shard(), seq = %d.locator(), "hold released: handled again");
                self.lanes.redispatch(d);
                None
            }
        }
    }
}

/// How long a delivery retried in place with a plain `Retry` waits before attempt `n + 1`: a
/// back-off that doubles with each attempt from 100 ms to at most 5 s, of which the upper half is
/// jitter. The jitter comes from the record's identity and attempt, not a random source: records
/// that failed together spread out, and a run (a simulation seed) is reproducible.
fn in_place_backoff(d: &Delivery) -> Duration {
    use std::hash::{Hash, Hasher};
    let attempt = d.attempt();
    let full = Duration::from_millis(100u64 << attempt.saturating_sub(1).min(6))
        .min(MAX_IN_PLACE_BACKOFF)
        .as_millis() as u64;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    d.event_id().as_str().hash(&mut hasher);
    attempt.hash(&mut hasher);
    Duration::from_millis(full / 2 + hasher.finish() % (full / 2 + 1))
}

/// A delivery retried in place (a paged event, or a Kinesis record with retries in place): after
/// the retry's delay (`RetryAfter(d)`: `d`; a plain `Retry`: [`in_place_backoff`]), the next
/// attempt runs on its lane. The delivery stays unsettled meanwhile; a crash reads it again from
/// the unchanged cursor or checkpoint.
async fn run_again(write: PendingWrite, events: mpsc::UnboundedSender<WriteEvent>) {
    let wait = if write.delay.is_zero() {
        in_place_backoff(&write.delivery)
    } else {
        write.delay
    };
    tokio::time::sleep(wait).await;
    let d = if write.counted {
        write.delivery.next_attempt()
    } else {
        write.delivery
    };
    metrics::counter!("shardwise_retries_total", "stream" => d.stream().to_string()).increment(1);
    info!(stream = d.stream(), partition = d.shard(), seq = %d.locator(), attempt = d.attempt(), "running again in place");
    let _ = events.send(WriteEvent::Redeliver(d));
}
