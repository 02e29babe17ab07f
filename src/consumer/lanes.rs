//! Lanes: the tasks that run the handler. Each lane runs its deliveries one at a time, in the order
//! it received them.
//!
//! With per-key ordering the deliveries of a page go to each lane together (one message per lane
//! per page, [`Lanes::flush`]), and a lane sends back what it finished in runs: everything it
//! finished since it last waited, sent before it waits (for more work, a handler that is not
//! ready at once, a receipt read, or its turn). A no-op handler costs a channel message per run,
//! not two per delivery; a handler that waits still settles each delivery as it finishes.
//!
//! With per-key ordering, a key that has deliveries queued or running stays on the lane that has
//! them, so its deliveries run one at a time in shard order; a key with nothing in flight goes to
//! the lane with the fewest deliveries queued. Static hashing would leave lanes unevenly loaded
//! (64 keys over 8 lanes by hash gave 5.3 times one lane's throughput; by load, see
//! `benches/consumer.rs`).
//!
//! Where a failing delivery runs again in place (a paged source, or a Kinesis consumer with
//! `RetryMode::InPlace`), its lane parks its key when the
//! handler answers with a retry, or with effects whose commit may be refused: the key's later
//! deliveries are put aside, in order, while other keys go on, until the delivery comes back
//! ([`Work::Again`]) and succeeds, or the pipeline unparks the key once its outcome is durable
//! ([`Work::Unpark`]). Several deliveries of one key may park it together (a batch answered with
//! a retry for more than one of them): the key stays parked until each has come back and
//! succeeded or been given up, and their next attempts run one at a time in shard order, each
//! back-off notwithstanding (a later one that comes back first waits for the earlier).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::hash::BuildHasher;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use foldhash::fast::RandomState;
use futures::FutureExt;
use tokio::sync::{Mutex, mpsc};
use tokio::task::JoinSet;
use tracing::{Instrument, error, info, info_span, warn};

use super::config::{DeliveryOrder, Settings};
use super::ledger::read_receipt;
use crate::handler::{Delivery, Handler, Outcome, Replayable};
use crate::lease::Hold;
use crate::receipts::ReceiptStore;

/// A delivery a lane is done with, and how.
#[derive(Debug)]
pub(crate) struct Finished {
    pub(crate) delivery: Delivery,
    pub(crate) done: Done,
}

/// What a lane did with a delivery.
#[derive(Debug)]
pub(crate) enum Done {
    /// The handler decided this outcome.
    Handled(Outcome),
    /// Not handed to the handler: it arrived this long ago, longer than `max_record_age`.
    Expired(Duration),
    /// Not handed to the handler: an earlier attempt handled it (its receipt is terminal).
    Replayed,
}

/// What the lanes need of the consumer's settings.
#[derive(Clone)]
pub(crate) struct LaneSettings {
    pub(crate) handler_timeout: Option<Duration>,
    pub(crate) max_record_age: Option<Duration>,
    /// The receipt ledger, read before the handler runs for a delivery an earlier attempt may
    /// have handled ([`Replayable::Checked`]).
    pub(crate) receipts: Option<Arc<dyn ReceiptStore>>,
    /// Failing deliveries run again on their lane (a paged source) with per-key ordering: a
    /// retry parks its key (see [`parks`]).
    pub(crate) park_retries: bool,
    /// The lease's hold, asked before each call of the handler (`None` in unit tests of the
    /// lanes alone).
    pub(crate) hold: Option<Hold>,
}

impl LaneSettings {
    pub(crate) fn of(
        settings: &Settings,
        receipts: Option<Arc<dyn ReceiptStore>>,
        in_place: bool,
        hold: Option<Hold>,
    ) -> Self {
        Self {
            handler_timeout: settings.handler_timeout,
            max_record_age: settings.max_record_age,
            receipts,
            park_retries: in_place && settings.ordering == DeliveryOrder::PerKey,
            hold,
        }
    }
}

/// Whether a lane that parks retries parked the key of this finished delivery: it has a key (a
/// keyless paged event orders against nothing), and the handler answered with a retry (a panic
/// or a timeout is one) or with effects, whose commit may be refused and send it the retry way.
/// The pipeline then either sends it back ([`Lanes::again`]) or, once its outcome is durable,
/// unparks the key ([`Lanes::unpark`]).
pub(crate) fn parks(park_retries: bool, delivery: &Delivery, done: &Done) -> bool {
    park_retries
        && delivery.has_key()
        && matches!(
            done,
            Done::Handled(
                Outcome::Retry | Outcome::RetryAfter(_) | Outcome::NotAttempted | Outcome::Apply(_)
            )
        )
}

/// What a lane is sent: one delivery, or the deliveries of a page for that lane, in order; a
/// delivery whose key it parked, to run again now; or a key to unpark.
#[derive(Debug)]
pub(crate) enum Work {
    One(Delivery),
    Many(Vec<Delivery>),
    /// The next attempt of the delivery that parked its key: it runs though the key is parked,
    /// and its success unparks the key.
    Again(Delivery),
    /// A delivery that parked this key will not run again (spent, held, or given up): once no
    /// other delivery of the key waits to run again, the key's deliveries put aside run, in order.
    Unpark(String, Option<crate::track::DeliveryId>),
}

/// What a lane finished since it last waited, in the order it finished them.
pub(crate) type FinishedRun = Vec<Finished>;

/// The lanes of one shard. Dropping them aborts every running handler.
#[derive(Debug)]
pub(crate) struct Lanes {
    senders: Vec<mpsc::UnboundedSender<Work>>,
    /// Per-key ordering: deliveries dispatched to each lane and not sent yet (see
    /// [`Lanes::flush`]).
    pending: Vec<Vec<Delivery>>,
    ordering: DeliveryOrder,
    tasks: JoinSet<()>,
    /// Per-key ordering: the lane of each key with deliveries in flight, and how many, by the
    /// key's hash (two keys of one hash share a lane while either is in flight: order holds).
    active: HashMap<u64, (usize, usize), RandomState>,
    keys: RandomState,
    /// Deliveries queued or running per lane.
    load: Vec<usize>,
    /// Whether a retry parks its key ([`LaneSettings::park_retries`]).
    park_retries: bool,
    /// A retry parks the whole lane, not its key alone (see [`park_key`]).
    one_key: bool,
}

/// The key a retry parks on its lane: the delivery's partition key, or, for a handler on tumbling
/// windows (`one_key`), one key for every delivery: a failed record holds every later one of the
/// shard, as Lambda retries a window's records from the first failure, so a window's calls
/// come in shard order.
fn park_key(one_key: bool, delivery: &Delivery) -> &str {
    if one_key {
        ""
    } else {
        delivery.partition_key()
    }
}

impl Lanes {
    pub(crate) fn start<H: Handler>(
        count: usize,
        ordering: DeliveryOrder,
        handler: Arc<H>,
        finished: mpsc::UnboundedSender<FinishedRun>,
        settings: LaneSettings,
    ) -> Self {
        let mut tasks = JoinSet::new();
        let mut senders = Vec::new();
        let park_retries = settings.park_retries;
        let one_key = handler.window_slots().is_some();
        match ordering {
            DeliveryOrder::PerKey => {
                for _ in 0..count {
                    let (tx, rx) = mpsc::unbounded_channel();
                    senders.push(tx);
                    tasks.spawn(crate::time::carry(run_lane(
                        Arc::new(Mutex::new(rx)),
                        handler.clone(),
                        finished.clone(),
                        settings.clone(),
                    )));
                }
            }
            DeliveryOrder::None => {
                let (tx, rx) = mpsc::unbounded_channel();
                senders.push(tx);
                let shared = Arc::new(Mutex::new(rx));
                for _ in 0..count {
                    tasks.spawn(crate::time::carry(run_lane(
                        shared.clone(),
                        handler.clone(),
                        finished.clone(),
                        settings.clone(),
                    )));
                }
            }
        }
        Self {
            load: vec![0; count],
            pending: senders.iter().map(|_| Vec::new()).collect(),
            park_retries,
            one_key,
            senders,
            ordering,
            tasks,
            active: HashMap::default(),
            keys: RandomState::default(),
        }
    }

    /// Picks the lane for the next delivery of `partition_key` and counts it in flight there: the
    /// key's lane while it has deliveries in flight, otherwise the least loaded lane.
    #[cfg(test)]
    pub(crate) fn assign(&mut self, partition_key: &str) -> usize {
        self.assign_keyed(Some(partition_key))
    }

    /// [`assign`](Self::assign) for a delivery with this key, or, for `None` (a paged event
    /// without a key, ordered against nothing), the least loaded lane, with no per-key
    /// bookkeeping.
    pub(crate) fn assign_keyed(&mut self, partition_key: Option<&str>) -> usize {
        let lane = match (self.ordering, partition_key) {
            (DeliveryOrder::None, _) => 0,
            (DeliveryOrder::PerKey, None) => {
                let load = &self.load;
                (0..load.len()).min_by_key(|l| load[*l]).unwrap_or(0)
            }
            (DeliveryOrder::PerKey, Some(partition_key)) => {
                let load = &self.load;
                let (lane, n) = self
                    .active
                    .entry(self.keys.hash_one(partition_key))
                    .or_insert_with(|| {
                        let lane = (0..load.len()).min_by_key(|l| load[*l]).unwrap_or(0);
                        (lane, 0)
                    });
                *n += 1;
                *lane
            }
        };
        if let Some(load) = self.load.get_mut(lane) {
            *load += 1;
        }
        lane
    }

    /// A delivery assigned by [`Lanes::assign`] finished on its lane.
    pub(crate) fn finished(&mut self, delivery: &Delivery) {
        if let Some(load) = self.load.get_mut(delivery.lane()) {
            *load = load.saturating_sub(1);
        }
        if delivery.unordered() {
            return;
        }
        let key = self.keys.hash_one(delivery.partition_key());
        if let Some((_, n)) = self.active.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                self.active.remove(&key);
            }
        }
    }

    /// Queues a delivery again (its hold was released): on the lane its key has deliveries on now,
    /// if any, so the key still runs one delivery at a time. Sent at once, behind whatever was
    /// dispatched to that lane before it.
    pub(crate) fn redispatch(&mut self, delivery: Delivery) {
        let lane = self.assign_keyed(key_of(&delivery));
        self.dispatch(delivery.on_lane(lane));
        self.flush();
    }

    /// Queues a delivery on the lane [`Lanes::assign`] gave it. With per-key ordering it is sent
    /// with the rest of its page at the next [`Lanes::flush`]; without, at once, to whichever lane
    /// is idle first. Lanes take work until they are aborted, also once the shard reads no more: a
    /// held delivery released then runs again.
    pub(crate) fn dispatch(&mut self, delivery: Delivery) {
        match self.ordering {
            DeliveryOrder::PerKey => {
                // No lane means the shard is being torn down; the delivery stays unsettled.
                if let Some(pending) = self.pending.get_mut(delivery.lane()) {
                    pending.push(delivery);
                }
            }
            DeliveryOrder::None => {
                if let Some(sender) = self.senders.first() {
                    let _ = sender.send(Work::One(delivery));
                }
            }
        }
    }

    /// Whether the lane of this finished delivery parked its key ([`parks`]): then it is still
    /// counted in flight there, and comes back with [`again`](Self::again) or ends with
    /// [`unpark`](Self::unpark).
    pub(crate) fn parked(&self, finished: &Finished) -> bool {
        parks(self.park_retries, &finished.delivery, &finished.done)
    }

    /// The next attempt of a delivery whose key its lane parked: to that lane, which runs it
    /// ahead of the key's deliveries put aside.
    pub(crate) fn again(&mut self, delivery: Delivery) {
        self.flush();
        if let Some(sender) = self.senders.get(delivery.lane()) {
            let _ = sender.send(Work::Again(delivery));
        }
    }

    /// A delivery whose key its lane parked will not run again: it is done with its lane, and
    /// the key's deliveries put aside run.
    pub(crate) fn unpark(&mut self, delivery: &Delivery) {
        self.finished(delivery);
        self.flush();
        if let Some(sender) = self.senders.get(delivery.lane()) {
            let _ = sender.send(Work::Unpark(
                park_key(self.one_key, delivery).to_string(),
                delivery.id(),
            ));
        }
    }

    /// Sends every lane what was dispatched to it since the last flush, in dispatch order.
    pub(crate) fn flush(&mut self) {
        for (sender, pending) in self.senders.iter().zip(self.pending.iter_mut()) {
            match pending.len() {
                0 => {}
                1 => {
                    let _ = sender.send(Work::One(pending.pop().expect("one")));
                }
                n => {
                    // The next page's batch is about as large: allocated once, not grown.
                    let batch = std::mem::replace(pending, Vec::with_capacity(n));
                    let _ = sender.send(Work::Many(batch));
                }
            }
        }
    }

    /// Aborts every running handler (their deliveries stay unsettled).
    pub(crate) fn abort(&mut self) {
        self.senders.clear();
        self.pending.clear();
        self.tasks.abort_all();
    }
}

/// The key a delivery is ordered by on its lane: `None` for a paged event without one.
pub(crate) fn key_of(delivery: &Delivery) -> Option<&str> {
    (!delivery.unordered()).then(|| delivery.partition_key())
}

/// A lane's side of its channels: the work it was sent and has not started, and what it finished
/// and has not sent back.
struct LaneQueue {
    work: Arc<Mutex<mpsc::UnboundedReceiver<Work>>>,
    queued: VecDeque<Delivery>,
    finished: mpsc::UnboundedSender<FinishedRun>,
    done: FinishedRun,
    /// Whether a retry parks its key.
    park_retries: bool,
    /// A retry parks the whole lane ([`park_key`]).
    one_key: bool,
    /// Parked keys: the deliveries that parked each, and what waits behind them.
    parked: HashMap<String, Parked>,
    /// Next attempts of parked deliveries whose turn it is: they run before anything queued.
    ready_again: VecDeque<Delivery>,
    /// Deliveries sent back to run again while their key is parked, running now.
    again: Vec<crate::track::DeliveryId>,
}

/// One parked key.
#[derive(Debug, Default)]
struct Parked {
    /// The key's deliveries that parked it and have neither come back and succeeded nor been
    /// given up: its next attempts run in this order.
    waiting: BTreeSet<crate::track::DeliveryId>,
    /// Next attempts that came back while an earlier delivery of the key still waits.
    held: BTreeMap<crate::track::DeliveryId, Delivery>,
    /// The key's other deliveries, put aside in the order they came.
    aside: VecDeque<Delivery>,
}

/// The shard's pipeline is gone: the lane ends.
struct Closed;

impl LaneQueue {
    /// The next delivery to run: a queued one, what was sent meanwhile, or, after sending back
    /// what it finished, whatever comes next; a delivery of a parked key is put aside instead.
    /// `None`: nothing more will come.
    async fn next(&mut self) -> Option<Delivery> {
        loop {
            if let Some(delivery) = self.ready_again.pop_front() {
                return Some(delivery);
            }
            let delivery = match self.queued.pop_front() {
                Some(delivery) => delivery,
                None => match self.receive().await? {
                    Work::One(delivery) => delivery,
                    Work::Many(deliveries) => {
                        self.queued.extend(deliveries);
                        continue;
                    }
                    Work::Again(delivery) => {
                        // Behind an earlier delivery of its key that waits to run again.
                        if let (Some(id), Some(parked)) = (
                            delivery.id(),
                            self.parked.get_mut(park_key(self.one_key, &delivery)),
                        ) && parked.waiting.first().is_some_and(|first| *first < id)
                        {
                            parked.held.insert(id, delivery);
                            continue;
                        }
                        self.again.extend(delivery.id());
                        return Some(delivery);
                    }
                    Work::Unpark(key, id) => {
                        self.given_up(&key, id);
                        continue;
                    }
                },
            };
            if !self.parked.is_empty()
                && let Some(parked) = self.parked.get_mut(park_key(self.one_key, &delivery))
            {
                parked.aside.push_back(delivery);
                continue;
            }
            return Some(delivery);
        }
    }

    /// What was sent to the lane next, sending back what it finished before it waits.
    async fn receive(&mut self) -> Option<Work> {
        let work = self.work.clone();
        // Lanes without per-key order share one queue: waiting for it, what was finished is
        // sent back first.
        let mut work = match work.try_lock() {
            Ok(work) => work,
            Err(_) => {
                self.send_back().ok()?;
                work.lock().await
            }
        };
        match work.try_recv() {
            Ok(work) => Some(work),
            Err(mpsc::error::TryRecvError::Disconnected) => None,
            Err(mpsc::error::TryRecvError::Empty) => {
                self.send_back().ok()?;
                work.recv().await
            }
        }
    }

    /// A delivery is done with: sent back with the rest of the run. A retry parks its key; the
    /// success of a delivery sent back to run again unparks it.
    fn finish(&mut self, delivery: Delivery, done: Done) {
        let again = delivery
            .id()
            .and_then(|id| self.again.iter().position(|a| *a == id))
            .map(|at| self.again.swap_remove(at))
            .is_some();
        if parks(self.park_retries, &delivery, &done) {
            self.parked
                .entry(park_key(self.one_key, &delivery).to_string())
                .or_default()
                .waiting
                .extend(delivery.id());
        } else if again {
            self.given_up(park_key(self.one_key, &delivery), delivery.id());
        }
        self.done.push(Finished { delivery, done });
    }

    /// The delivery `id` of `key` waits to run again no more (it succeeded, or will not run
    /// again: `None`, any of them): the next one's attempt runs if it came back, and once none
    /// waits, the key's deliveries put aside run, in the order they came.
    fn given_up(&mut self, key: &str, id: Option<crate::track::DeliveryId>) {
        let Some(parked) = self.parked.get_mut(key) else {
            return;
        };
        match id {
            Some(id) => {
                parked.waiting.remove(&id);
            }
            None => parked.waiting.clear(),
        }
        if let Some(&first) = parked.waiting.first() {
            if let Some(delivery) = parked.held.remove(&first) {
                self.again.push(first);
                self.ready_again.push_back(delivery);
            }
            return;
        }
        let parked = self.parked.remove(key).expect("looked up above");
        for (id, delivery) in parked.held {
            self.again.push(id);
            self.ready_again.push_back(delivery);
        }
        for delivery in parked.aside.into_iter().rev() {
            self.queued.push_front(delivery);
        }
    }

    /// Sends back what was finished since the last time.
    fn send_back(&mut self) -> Result<(), Closed> {
        if self.done.is_empty() {
            return Ok(());
        }
        self.finished
            .send(std::mem::take(&mut self.done))
            .map_err(|_| Closed)
    }

    /// Whether the lease is held now (at once while it is; else waiting for a renewal that
    /// lands, with what was finished sent back first): `false` once it was given up, or the
    /// pipeline is gone. No hold (the lanes alone): held.
    async fn holds(&mut self, hold: Option<&mut Hold>) -> bool {
        match hold {
            None => true,
            Some(hold) if hold.holds() => true,
            Some(hold) => matches!(self.unless_waiting(hold.held()).await, Ok(true)),
        }
    }

    /// Runs `work` to its end; if it is not ready at once, what was finished is sent back first,
    /// so nothing finished waits behind a handler that waits.
    async fn unless_waiting<T>(&mut self, work: impl Future<Output = T>) -> Result<T, Closed> {
        let mut work = std::pin::pin!(work);
        if let std::task::Poll::Ready(answer) = futures::poll!(work.as_mut()) {
            return Ok(answer);
        }
        self.send_back()?;
        Ok(work.await)
    }
}

async fn run_lane<H: Handler>(
    work: Arc<Mutex<mpsc::UnboundedReceiver<Work>>>,
    handler: Arc<H>,
    finished: mpsc::UnboundedSender<FinishedRun>,
    settings: LaneSettings,
) {
    let batching = handler.batching();
    let mut durations = Durations::default();
    let mut lane = LaneQueue {
        work,
        queued: VecDeque::new(),
        finished,
        done: Vec::new(),
        park_retries: settings.park_retries,
        one_key: handler.window_slots().is_some(),
        parked: HashMap::new(),
        ready_again: VecDeque::new(),
        again: Vec::new(),
    };
    let mut hold = settings.hold.clone();
    loop {
        // A lane that always finds work ready still gives other tasks their turn (and sends back
        // what it finished before it does).
        if lane
            .unless_waiting(tokio::task::coop::consume_budget())
            .await
            .is_err()
        {
            return;
        }
        if batching.is_none() {
            // One delivery at a time: nothing collected, nothing allocated for it.
            let Some(delivery) = lane.next().await else {
                let _ = lane.send_back();
                return;
            };
            let Ok(answered) = lane
                .unless_waiting(answered_before(&settings, &delivery))
                .await
            else {
                return;
            };
            let done = match answered {
                Some(done) => done,
                None => {
                    // Nothing is handed out past the lease's hold, even before the lease task
                    // (late on a starved process) gives the lease up: the work is ending.
                    if !lane.holds(hold.as_mut()).await {
                        return;
                    }
                    // Called when polled, inside the guard: a handler that panics before its
                    // future exists is caught too.
                    let call = async { handler.handle(delivery.clone()).await };
                    let answer = guarded(&delivery, 1, &settings, &mut durations, call);
                    let Ok(answer) = lane.unless_waiting(answer).await else {
                        return;
                    };
                    Done::Handled(answer.unwrap_or(Outcome::Retry))
                }
            };
            lane.finish(delivery, done);
            continue;
        }
        // The next delivery and the ones behind it, up to the batch size, waiting at most
        // `max_wait` after the first.
        let Some(first) = lane.next().await else {
            let _ = lane.send_back();
            return;
        };
        let mut batch = vec![first];
        if let Some(b) = batching {
            let deadline = tokio::time::Instant::now() + b.max_wait;
            while batch.len() < b.max_size {
                match tokio::time::timeout_at(deadline, lane.next()).await {
                    Ok(Some(next)) => batch.push(next),
                    Ok(None) | Err(_) => break,
                }
            }
        }
        // Too old for the handler, or handled by an earlier attempt: answered at once.
        let mut young = Vec::with_capacity(batch.len());
        for delivery in batch {
            let Ok(answered) = lane
                .unless_waiting(answered_before(&settings, &delivery))
                .await
            else {
                return;
            };
            match answered {
                Some(done) => lane.finish(delivery, done),
                None => young.push(delivery),
            }
        }
        let batch = young;
        if batch.is_empty() {
            continue;
        }
        if !lane.holds(hold.as_mut()).await {
            return;
        }
        let bisect = batching.is_some_and(|b| b.bisect);
        let outcomes = run_batch(&*handler, batch.clone(), &settings, &mut durations, bisect);
        let Ok(outcomes) = lane.unless_waiting(outcomes).await else {
            return;
        };
        for (delivery, outcome) in batch.into_iter().zip(outcomes) {
            lane.finish(delivery, Done::Handled(outcome));
        }
    }
}

/// A delivery answered without the handler: too old for it, or handled by an earlier attempt.
async fn answered_before(settings: &LaneSettings, delivery: &Delivery) -> Option<Done> {
    if let Some(age) = settings
        .max_record_age
        .and_then(|max| age_past(delivery, max))
    {
        return Some(Done::Expired(age));
    }
    match (&settings.receipts, delivery.replayable()) {
        (Some(store), Replayable::Checked(sought_at)) => done_before(&**store, delivery, sought_at)
            .await
            .then_some(Done::Replayed),
        _ => None,
    }
}

/// `shardwise_handler_duration_seconds` of the stream a lane's deliveries come from, registered
/// once (not looked up by its labels for every delivery).
#[derive(Default)]
struct Durations(Option<(String, metrics::Histogram)>);

impl Durations {
    fn record(&mut self, stream: &str, took: Duration) {
        let histogram = match &self.0 {
            Some((of, histogram)) if of == stream => histogram,
            _ => {
                let histogram = metrics::histogram!("shardwise_handler_duration_seconds", "stream" => stream.to_string());
                &self.0.insert((stream.to_string(), histogram)).1
            }
        };
        histogram.record(took.as_secs_f64());
    }
}

/// Whether an earlier attempt left `delivery` a terminal receipt since the partition's last seek
/// (`sought_at`, ms: an older receipt is of an event the seek asked for again). Read on the lane,
/// so the deliveries of a key keep their order; a failed (or panicking) read is read again with
/// backoff.
async fn done_before(
    store: &dyn ReceiptStore,
    delivery: &Delivery,
    sought_at: Option<i64>,
) -> bool {
    let receipt = read_receipt(store, &delivery.event_id(), "before handling").await;
    receipt.is_some_and(|r| {
        r.disposition.is_terminal()
            && recorded_since_seek(crate::time::millis(r.recorded_at), sought_at)
    })
}

/// How far apart the wall clocks of the host that seeks and the hosts that record receipts may be
/// for a seek to reach every event it asks for again.
pub(crate) const SEEK_CLOCK_ALLOWANCE: Duration = Duration::from_secs(30);

/// Whether a receipt recorded at `recorded_at` (ms, by the recording host's clock) is known to be
/// later than the partition's last seek at `sought_at` (ms, by the seeking host's clock), so that
/// it stops the handler. The two clocks differ, and a millisecond holds both a receipt and a seek:
/// a receipt is later only by more than [`SEEK_CLOCK_ALLOWANCE`]. Every doubt goes to the seek:
/// an event the seek asked for reaches the handler again (once more, at worst, for a receipt
/// recorded within the allowance after it), never not at all.
fn recorded_since_seek(recorded_at: i64, sought_at: Option<i64>) -> bool {
    sought_at.is_none_or(|s| recorded_at > s + SEEK_CLOCK_ALLOWANCE.as_millis() as i64)
}

/// How long ago `delivery` arrived, when that is longer than `max`.
fn age_past(delivery: &Delivery, max: Duration) -> Option<Duration> {
    let arrived = delivery.arrived_at()?;
    let age = crate::time::now().duration_since(arrived).ok()?;
    (age > max).then_some(age)
}

/// Runs a batch handler on one batch: one outcome per delivery. A panic, a timeout or an answer
/// with no outcome at all fails the whole batch: each delivery is a retry, or, with `bisect`
/// ([`Batching::bisect_on_failure`]), the batch is handled again in halves, one after the other,
/// down to the delivery that fails; the outcomes of the halves that succeed stand.
fn run_batch<'a, H: Handler>(
    handler: &'a H,
    batch: Vec<Delivery>,
    settings: &'a LaneSettings,
    durations: &'a mut Durations,
    bisect: bool,
) -> futures::future::BoxFuture<'a, Vec<Outcome>> {
    Box::pin(async move {
        let n = batch.len();
        let first = batch[0].clone();
        let halves = (bisect && n > 1).then(|| batch.clone());
        let call = async { handler.handle_batch(batch).await };
        let answer = guarded(&first, n, settings, durations, call)
            .await
            // No outcome at all: the batch failed as a whole (a Lambda function that raised).
            .filter(|outcomes| !(outcomes.is_empty() && halves.is_some()));
        match answer {
            // Failed as a whole, not bisected: every delivery is a retry.
            Some(outcomes) if outcomes.is_empty() => vec![Outcome::Retry; n],
            Some(mut outcomes) => {
                if outcomes.len() != n {
                    warn!(
                        stream = first.stream(),
                        shard = first.shard(),
                        seq = %first.locator(),
                        batch = n,
                        outcomes = outcomes.len(),
                        "the batch handler answered with {} outcomes for {n} deliveries: the ones without an outcome are retried",
                        outcomes.len()
                    );
                    outcomes.resize(n, Outcome::Retry);
                }
                outcomes
            }
            None => match halves {
                None => vec![Outcome::Retry; n],
                Some(mut front) => {
                    let back = front.split_off(n / 2);
                    metrics::counter!("shardwise_batch_bisections_total", "stream" => first.stream().to_string())
                        .increment(1);
                    info!(
                        stream = first.stream(),
                        shard = first.shard(),
                        seq = %first.locator(),
                        batch = n,
                        "the batch failed as a whole: handling it again in halves of {} and {}",
                        front.len(),
                        back.len()
                    );
                    let mut outcomes = run_batch(handler, front, settings, durations, true).await;
                    outcomes.extend(run_batch(handler, back, settings, durations, true).await);
                    outcomes
                }
            },
        }
    })
}

/// Runs a handler's call for `n` deliveries from `first` on, in its span, within the handler
/// timeout, and records how long it took. `None`: it panicked or timed out (logged).
async fn guarded<T>(
    first: &Delivery,
    n: usize,
    settings: &LaneSettings,
    durations: &mut Durations,
    call: impl Future<Output = T>,
) -> Option<T> {
    let span = info_span!(
        "delivery",
        stream = first.stream(),
        shard = first.shard(),
        seq = %first.locator(),
        attempt = first.attempt(),
        lane = first.lane(),
        batch = n,
    );
    let started = tokio::time::Instant::now();
    let call = AssertUnwindSafe(call).catch_unwind().instrument(span);
    let answer = match settings.handler_timeout {
        Some(limit) => tokio::time::timeout(limit, call).await.ok(),
        None => Some(call.await),
    };
    durations.record(first.stream(), started.elapsed());
    match answer {
        Some(Ok(answer)) => Some(answer),
        Some(Err(panic)) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic".into());
            error!(
                stream = first.stream(),
                shard = first.shard(),
                seq = %first.locator(),
                partition_key = first.partition_key(),
                batch = n,
                panic = %what,
                "handler panicked: treated as retry"
            );
            None
        }
        None => {
            metrics::counter!("shardwise_handler_timeouts_total", "stream" => first.stream().to_string())
                .increment(n as u64);
            warn!(
                stream = first.stream(),
                shard = first.shard(),
                seq = %first.locator(),
                partition_key = first.partition_key(),
                batch = n,
                timeout = ?settings.handler_timeout,
                "handler timed out: treated as retry"
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Position, SequenceNumber};

    fn delivery(key: &str, lane: usize) -> Delivery {
        Delivery::builder(
            "s",
            "shard",
            Position::new(SequenceNumber::parse("1").unwrap(), 0),
        )
        .partition_key(key)
        .set_lane(lane)
        .build()
    }

    fn lane_settings(park_retries: bool) -> LaneSettings {
        LaneSettings {
            handler_timeout: None,
            max_record_age: None,
            receipts: None,
            park_retries,
            hold: None,
        }
    }

    /// A handler that acks at once, except the delivery of key "slow", which waits until the
    /// returned sender is used.
    fn slow_until_released() -> (
        Arc<impl Fn(Delivery) -> futures::future::BoxFuture<'static, Outcome> + Send + Sync>,
        tokio::sync::oneshot::Sender<()>,
    ) {
        let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
        let release = Arc::new(std::sync::Mutex::new(Some(release_rx)));
        let handler = Arc::new(move |d: Delivery| {
            let wait = (d.partition_key() == "slow")
                .then(|| release.lock().unwrap().take())
                .flatten();
            Box::pin(async move {
                if let Some(wait) = wait {
                    let _ = wait.await;
                }
                Outcome::Ack
            }) as futures::future::BoxFuture<'static, Outcome>
        });
        (handler, release_tx)
    }

    #[test]
    fn a_receipt_stops_a_sought_event_only_when_clearly_later_than_the_seek() {
        let seek = 1_700_000_000_000;
        let allowance = SEEK_CLOCK_ALLOWANCE.as_millis() as i64;
        assert!(recorded_since_seek(seek - 1, None), "no seek: any receipt");
        assert!(
            !recorded_since_seek(seek, Some(seek)),
            "in the seek's millisecond: the seek may have come first"
        );
        assert!(
            !recorded_since_seek(seek + 10_000, Some(seek)),
            "10 s later by a clock 10 s ahead of the seeker's: may be before it"
        );
        assert!(!recorded_since_seek(seek + allowance, Some(seek)));
        assert!(recorded_since_seek(seek + allowance + 1, Some(seek)));
        assert!(!recorded_since_seek(seek - 1, Some(seek)));
    }

    #[tokio::test]
    async fn paged_events_without_a_key_go_to_the_least_loaded_lane_with_no_key_kept() {
        let (tx, _rx) = mpsc::unbounded_channel();
        let handler = Arc::new(|_d: Delivery| async { Outcome::Ack });
        let mut lanes = Lanes::start(3, DeliveryOrder::PerKey, handler, tx, lane_settings(false));
        let keyed = lanes.assign("k");
        let unordered: Vec<usize> = (0..5).map(|_| lanes.assign_keyed(None)).collect();
        // Loads after "k": one on its lane; the five fill the others first, then round.
        let mut load = [0; 3];
        load[keyed] += 1;
        for lane in &unordered {
            load[*lane] += 1;
        }
        assert_eq!(
            load,
            [2, 2, 2],
            "spread by load: {unordered:?} beside {keyed}"
        );
        assert_eq!(
            lanes.active.len(),
            1,
            "only the keyed delivery is kept by key"
        );
        let event = crate::paged::PagedEvent {
            id: "e1".into(),
            position: crate::paged::PagePosition::from_u64(1),
            payload: bytes::Bytes::new(),
            timestamp: None,
            key: None,
        };
        let d = Delivery::paged("source", "p", &event)
            .set_lane(unordered[0])
            .build();
        assert!(d.unordered());
        assert_eq!(key_of(&d), None);
        lanes.finished(&d);
        assert_eq!(lanes.load.iter().sum::<usize>(), 5);
        assert_eq!(lanes.active.len(), 1, "finishing it touches no key");
        // A keyed paged event is ordered by its key.
        let keyed_event = crate::paged::PagedEvent {
            key: Some("k".into()),
            ..event
        };
        let d = Delivery::paged("source", "p", &keyed_event).build();
        assert_eq!(key_of(&d), Some("k"));
        lanes.abort();
    }

    #[tokio::test]
    async fn a_key_stays_on_its_lane_while_in_flight_and_new_keys_go_to_the_least_loaded() {
        let (tx, _rx) = mpsc::unbounded_channel();
        let handler = Arc::new(|_d: Delivery| async { Outcome::Ack });
        let mut lanes = Lanes::start(3, DeliveryOrder::PerKey, handler, tx, lane_settings(false));
        let a = lanes.assign("a");
        assert_eq!(lanes.assign("a"), a, "in flight: same lane");
        let b = lanes.assign("b");
        let c = lanes.assign("c");
        let mut used = vec![a, b, c];
        used.sort();
        assert_eq!(
            used,
            [0, 1, 2],
            "new keys spread over the least loaded lanes"
        );
        // "a" has two in flight on its lane: the next new key avoids it.
        lanes.finished(&delivery("b", b));
        assert_ne!(lanes.assign("d"), a);
        // Once all of "a" finished, it may move.
        lanes.finished(&delivery("a", a));
        lanes.finished(&delivery("a", a));
        assert!(!lanes.active.contains_key(&lanes.keys.hash_one("a")));
        lanes.abort();
    }

    /// The deliveries of a page go to a lane together, and what the lane finished is sent back
    /// before it waits for a handler that is not ready: a delivery that finished is never held
    /// back by the one behind it.
    #[tokio::test]
    async fn what_a_lane_finished_is_sent_back_before_it_waits_for_a_handler() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (handler, release_tx) = slow_until_released();
        let mut lanes = Lanes::start(1, DeliveryOrder::PerKey, handler, tx, lane_settings(false));
        for key in ["quick", "also-quick", "slow"] {
            let lane = lanes.assign(key);
            lanes.dispatch(delivery(key, lane));
        }
        lanes.flush();
        let run = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("the quick ones are sent back while the slow one waits")
            .expect("a run");
        let keys: Vec<_> = run.iter().map(|f| f.delivery.partition_key()).collect();
        assert_eq!(keys, ["quick", "also-quick"]);
        release_tx.send(()).unwrap();
        let run = rx.recv().await.expect("the slow one, once released");
        assert_eq!(run.len(), 1);
        assert_eq!(run[0].delivery.partition_key(), "slow");
        lanes.abort();
    }

    /// Without per-key order the lanes share one queue, which a lane with nothing to do holds
    /// while it waits for work: a lane that finished a delivery sends it back before it waits
    /// for that queue.
    #[tokio::test(start_paused = true)]
    async fn lanes_sharing_a_queue_send_back_what_they_finished_while_they_wait_for_it() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (handler, release_tx) = slow_until_released();
        let mut lanes = Lanes::start(2, DeliveryOrder::None, handler, tx, lane_settings(false));
        for key in ["slow", "quick"] {
            let lane = lanes.assign(key);
            lanes.dispatch(delivery(key, lane));
        }
        lanes.flush();
        let run = rx.recv().await.expect("a run");
        assert_eq!(run[0].delivery.partition_key(), "quick");
        // The lane that ran "quick" now holds the queue, waiting for work.
        tokio::time::sleep(Duration::from_millis(10)).await;
        release_tx.send(()).unwrap();
        let run = tokio::time::timeout(Duration::from_secs(60), rx.recv())
            .await
            .expect("the slow one is sent back while its lane waits for the queue")
            .expect("a run");
        assert_eq!(run[0].delivery.partition_key(), "slow");
        lanes.abort();
    }

    /// What parks a key: with retries in place, a keyed delivery answered with a retry or with
    /// effects (their commit may be refused); never an ack, a keyless paged event, or where
    /// retries are copies.
    #[test]
    fn retries_and_effects_of_keyed_deliveries_park_their_key() {
        let keyed = delivery("k", 0);
        let event = crate::paged::PagedEvent {
            id: "e1".into(),
            position: crate::paged::PagePosition::from_u64(1),
            payload: bytes::Bytes::new(),
            timestamp: None,
            key: None,
        };
        let keyless = Delivery::paged("source", "partition", &event).build();
        let effects = || Outcome::Apply(crate::receipts::Effects::new());
        for (park_retries, d, outcome, parks_key) in [
            (true, &keyed, Outcome::Retry, true),
            (
                true,
                &keyed,
                Outcome::RetryAfter(Duration::from_secs(1)),
                true,
            ),
            (true, &keyed, effects(), true),
            (true, &keyed, Outcome::Ack, false),
            (true, &keyed, Outcome::Drop, false),
            (true, &keyless, Outcome::Retry, false),
            (true, &keyless, effects(), false),
            (false, &keyed, Outcome::Retry, false),
            (false, &keyed, effects(), false),
        ] {
            let label = outcome.label();
            assert_eq!(
                parks(park_retries, d, &Done::Handled(outcome)),
                parks_key,
                "{label}, keyed {}, in place {park_retries}",
                d.has_key()
            );
        }
        assert!(!parks(true, &keyed, &Done::Replayed));
    }

    /// Where retries run in place, a retry parks its key on its lane: the key's later
    /// deliveries wait, in order, until the retried one comes back and succeeds (`again`), or is
    /// given up (`unpark`); other keys go on meanwhile.
    #[tokio::test]
    async fn a_retry_parks_its_key_until_it_comes_back_and_succeeds_or_is_given_up() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        // "a1" and "b1" fail on their first attempt.
        let handler = Arc::new(|d: Delivery| {
            let first = d.attempt() == 1 && d.payload().ends_with(b"1");
            std::future::ready(if first { Outcome::Retry } else { Outcome::Ack })
        });
        let mut lanes = Lanes::start(1, DeliveryOrder::PerKey, handler, tx, lane_settings(true));
        let mut tracker = crate::track::Tracker::new(1);
        let mut sent = Vec::new();
        for (key, name) in [
            ("a", "a1"),
            ("a", "a2"),
            ("b", "b1"),
            ("c", "c1"),
            ("b", "b2"),
        ] {
            let lane = lanes.assign(key);
            let d = Delivery::builder(
                "s",
                "shard",
                Position::new(SequenceNumber::parse("1").unwrap(), 0),
            )
            .partition_key(key)
            .payload(bytes::Bytes::from(name))
            .set_id(tracker.track(()))
            .set_lane(lane)
            .build();
            sent.push(d.clone());
            lanes.dispatch(d);
        }
        lanes.flush();
        let name = |f: &Finished| String::from_utf8_lossy(f.delivery.payload()).into_owned();
        let mut order = Vec::new();
        while order.len() < 3 {
            let run = rx.recv().await.expect("a run");
            order.extend(run.iter().map(name));
        }
        assert_eq!(
            order,
            ["a1", "b1", "c1"],
            "a2 and b2 wait behind their keys' retries"
        );
        assert!(
            tokio::time::timeout(Duration::from_millis(50), rx.recv())
                .await
                .is_err(),
            "nothing of a parked key runs"
        );
        // a1 runs again and succeeds: a2 follows it.
        lanes.again(sent[0].next_attempt());
        let mut order = Vec::new();
        while order.len() < 2 {
            order.extend(rx.recv().await.expect("a run").iter().map(name));
        }
        assert_eq!(order, ["a1", "a2"]);
        // b1 is given up (spent): b2 runs.
        lanes.unpark(&sent[2]);
        let run = rx.recv().await.expect("a run");
        assert_eq!(run.iter().map(name).collect::<Vec<_>>(), ["b2"]);
        lanes.abort();
    }

    /// A handler that panics when called, before it has a future to run, is a retry like one
    /// whose future panics, and its lane goes on.
    #[tokio::test]
    async fn a_handler_that_panics_before_its_future_exists_is_a_retry() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let handler = Arc::new(|d: Delivery| {
            assert!(d.partition_key() != "poison", "poison record");
            std::future::ready(Outcome::Ack)
        });
        let mut lanes = Lanes::start(1, DeliveryOrder::PerKey, handler, tx, lane_settings(false));
        for key in ["poison", "fine"] {
            let lane = lanes.assign(key);
            lanes.dispatch(delivery(key, lane));
        }
        lanes.flush();
        let mut finished = Vec::new();
        while finished.len() < 2 {
            finished.extend(rx.recv().await.expect("the lane goes on"));
        }
        for (done, expected) in finished.into_iter().zip([Outcome::Retry, Outcome::Ack]) {
            assert!(
                matches!(done.done, Done::Handled(ref o) if *o == expected),
                "{:?}",
                done.done
            );
        }
        lanes.abort();
    }
}
