//! Lanes: the tasks that run the handler. Each lane runs its deliveries one at a time, in the order
//! it received them.
//!
//! With per-key ordering, a key that has deliveries queued or running stays on the lane that has
//! them, so its deliveries run one at a time in shard order; a key with nothing in flight goes to
//! the lane with the fewest deliveries queued. Static hashing would leave lanes unevenly loaded
//! (64 keys over 8 lanes by hash gave 5.3 times one lane's throughput; by load, see
//! `benches/consumer.rs`).

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use foldhash::fast::RandomState;
use futures::FutureExt;
use tokio::sync::{Mutex, mpsc};
use tokio::task::JoinSet;
use tracing::{Instrument, error, info_span, warn};

use super::config::{DeliveryOrder, Settings};
use super::ledger::read_receipt;
use crate::handler::{Delivery, Handler, Outcome, Replayable};
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
}

impl LaneSettings {
    pub(crate) fn of(settings: &Settings, receipts: Option<Arc<dyn ReceiptStore>>) -> Self {
        Self {
            handler_timeout: settings.handler_timeout,
            max_record_age: settings.max_record_age,
            receipts,
        }
    }
}

/// The lanes of one shard. Dropping them aborts every running handler.
#[derive(Debug)]
pub(crate) struct Lanes {
    senders: Vec<mpsc::UnboundedSender<Delivery>>,
    ordering: DeliveryOrder,
    tasks: JoinSet<()>,
    /// Per-key ordering: the lane of each key with deliveries in flight, and how many, by the
    /// key's hash (two keys of one hash share a lane while either is in flight: order holds).
    active: HashMap<u64, (usize, usize), RandomState>,
    keys: RandomState,
    /// Deliveries queued or running per lane.
    load: Vec<usize>,
}

impl Lanes {
    pub(crate) fn start<H: Handler>(
        count: usize,
        ordering: DeliveryOrder,
        handler: Arc<H>,
        finished: mpsc::UnboundedSender<Finished>,
        settings: LaneSettings,
    ) -> Self {
        let mut tasks = JoinSet::new();
        let mut senders = Vec::new();
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
            senders,
            ordering,
            tasks,
            active: HashMap::default(),
            keys: RandomState::default(),
        }
    }

    /// Picks the lane for the next delivery of `partition_key` and counts it in flight there: the
    /// key's lane while it has deliveries in flight, otherwise the least loaded lane.
    pub(crate) fn assign(&mut self, partition_key: &str) -> usize {
        let lane = match self.ordering {
            DeliveryOrder::None => 0,
            DeliveryOrder::PerKey => {
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
        let key = self.keys.hash_one(delivery.partition_key());
        if let Some((_, n)) = self.active.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                self.active.remove(&key);
            }
        }
    }

    /// Queues a delivery again (its hold was released): on the lane its key has deliveries on now,
    /// if any, so the key still runs one delivery at a time.
    pub(crate) fn redispatch(&mut self, delivery: Delivery) {
        let lane = self.assign(delivery.partition_key());
        self.dispatch(delivery.on_lane(lane));
    }

    /// Queues a delivery on the lane [`Lanes::assign`] gave it. Lanes take work until they are
    /// aborted, also once the shard reads no more: a held delivery released then runs again.
    pub(crate) fn dispatch(&self, delivery: Delivery) {
        let lane = match self.ordering {
            DeliveryOrder::PerKey => delivery.lane(),
            DeliveryOrder::None => 0,
        };
        // No lane means the shard is being torn down; the delivery stays unsettled.
        if let Some(sender) = self.senders.get(lane) {
            let _ = sender.send(delivery);
        }
    }

    /// Aborts every running handler (their deliveries stay unsettled).
    pub(crate) fn abort(&mut self) {
        self.senders.clear();
        self.tasks.abort_all();
    }
}

async fn run_lane<H: Handler>(
    queue: Arc<Mutex<mpsc::UnboundedReceiver<Delivery>>>,
    handler: Arc<H>,
    finished: mpsc::UnboundedSender<Finished>,
    settings: LaneSettings,
) {
    let batching = handler.batching();
    let mut durations = Durations::default();
    loop {
        if batching.is_none() {
            // One delivery at a time: nothing collected, nothing allocated for it.
            let Some(delivery) = queue.lock().await.recv().await else {
                return;
            };
            let done = match answered_before(&settings, &delivery).await {
                Some(done) => done,
                None => {
                    // Called when polled, inside the guard: a handler that panics before its
                    // future exists is caught too.
                    let call = async { handler.handle(delivery.clone()).await };
                    let answer = guarded(&delivery, 1, &settings, &mut durations, call).await;
                    Done::Handled(answer.unwrap_or(Outcome::Retry))
                }
            };
            if finished.send(Finished { delivery, done }).is_err() {
                return;
            }
            continue;
        }
        // The next delivery and the ones behind it, up to the batch size, waiting at most
        // `max_wait` after the first.
        let batch = {
            let mut queue = queue.lock().await;
            let Some(first) = queue.recv().await else {
                return;
            };
            let mut batch = vec![first];
            if let Some(b) = batching {
                let deadline = tokio::time::Instant::now() + b.max_wait;
                while batch.len() < b.max_size {
                    match tokio::time::timeout_at(deadline, queue.recv()).await {
                        Ok(Some(next)) => batch.push(next),
                        Ok(None) | Err(_) => break,
                    }
                }
            }
            batch
        };
        // Too old for the handler, or handled by an earlier attempt: answered at once.
        let mut young = Vec::with_capacity(batch.len());
        for delivery in batch {
            match answered_before(&settings, &delivery).await {
                Some(done) => {
                    if finished.send(Finished { delivery, done }).is_err() {
                        return;
                    }
                }
                None => young.push(delivery),
            }
        }
        let batch = young;
        if batch.is_empty() {
            continue;
        }
        let outcomes = run_batch(&*handler, batch.clone(), &settings, &mut durations).await;
        for (delivery, outcome) in batch.into_iter().zip(outcomes) {
            let done = Done::Handled(outcome);
            if finished.send(Finished { delivery, done }).is_err() {
                return;
            }
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

/// Runs a batch handler on one batch: one outcome per delivery; a panic or a timeout is a retry
/// for each.
async fn run_batch<H: Handler>(
    handler: &H,
    batch: Vec<Delivery>,
    settings: &LaneSettings,
    durations: &mut Durations,
) -> Vec<Outcome> {
    let n = batch.len();
    let first = batch[0].clone();
    let call = async { handler.handle_batch(batch).await };
    match guarded(&first, n, settings, durations, call).await {
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
        None => vec![Outcome::Retry; n],
    }
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
    async fn a_key_stays_on_its_lane_while_in_flight_and_new_keys_go_to_the_least_loaded() {
        let (tx, _rx) = mpsc::unbounded_channel();
        let handler = Arc::new(|_d: Delivery| async { Outcome::Ack });
        let settings = LaneSettings {
            handler_timeout: None,
            max_record_age: None,
            receipts: None,
        };
        let mut lanes = Lanes::start(3, DeliveryOrder::PerKey, handler, tx, settings);
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

    /// A handler that panics when called, before it has a future to run, is a retry like one
    /// whose future panics, and its lane goes on.
    #[tokio::test]
    async fn a_handler_that_panics_before_its_future_exists_is_a_retry() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let handler = Arc::new(|d: Delivery| {
            assert!(d.partition_key() != "poison", "poison record");
            std::future::ready(Outcome::Ack)
        });
        let settings = LaneSettings {
            handler_timeout: None,
            max_record_age: None,
            receipts: None,
        };
        let mut lanes = Lanes::start(1, DeliveryOrder::PerKey, handler, tx, settings);
        for key in ["poison", "fine"] {
            let lane = lanes.assign(key);
            lanes.dispatch(delivery(key, lane));
        }
        for expected in [Outcome::Retry, Outcome::Ack] {
            let done = rx.recv().await.expect("the lane goes on");
            assert!(
                matches!(done.done, Done::Handled(ref o) if *o == expected),
                "{:?}",
                done.done
            );
        }
        lanes.abort();
    }
}
