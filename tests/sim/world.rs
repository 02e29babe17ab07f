//! One seed's world: an in-memory stream and lease store shared by simulated workers, a chaos
//! phase driven by the seed, then a quiet phase in which everything owed must be handled.

use std::cell::Cell;
use std::collections::BTreeSet;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::FutureExt;
use futures::future::BoxFuture;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shardwise::consumer::{OnSpent, RetryMode};
use shardwise::lease::{Change, InitialPosition, LeaseSettings, LeaseStore, MemoryLeaseStore};
use shardwise::receipts::{Disposition, Effect, Effects, MemoryReceipts, ReceiptStore, key};
use shardwise::seek::SeekTarget;
use shardwise::shard::fanout::{FanOut, FanOutRecords};
use shardwise::testing::{Faults, Layered, MemoryStream, MemoryStreams, Subscriptions};
use shardwise::window::{WindowAnswer, WindowCall, WindowHandler, Windowed};
use shardwise::{
    Batched, Batching, Consumer, Delivery, Handler, Outcome, Position, Running, ShutdownReport,
};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::model::{COUNTS, Call, KEYS, Model};
use crate::wrap::{Gate, Queue, Receipts, Store, Stream};

/// Wall time at the start of every run (2026-01-01T00:00:00Z).
pub fn base() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_767_225_600)
}

const STREAM: &str = "orders";
const DLQ: &str = "orders-dlq";
const APP: &str = "sim";

const LEASE: Duration = Duration::from_secs(2);
const SCAN: Duration = Duration::from_millis(200);
/// How long a stale owner may go on dispatching after its lease moved on: a renewal interval
/// (it notices at its next renewal) and its timeout, a scan, and slack.
pub const STALE_BOUND: Duration = Duration::from_millis(2 * 667 + 200 + 300);
/// The chaos phase.
const CHAOS: Duration = Duration::from_secs(20);
/// The most the quiet phase may take before what is owed counts as stuck.
const QUIET: Duration = Duration::from_secs(120);
const STEP: Duration = Duration::from_millis(50);
/// How often the operator looks at held receipts during the chaos phase.
const OPERATOR: Duration = Duration::from_secs(1);

thread_local! {
    static START: Cell<Option<Instant>> = const { Cell::new(None) };
    /// Panics other than the simulated handler panics, raised on this thread (each seed runs on
    /// one thread).
    static PANICS: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Records a panic of shardwise itself: the seed running on this thread fails with it.
pub fn panicked(what: String) {
    PANICS.with_borrow_mut(|p| p.push(what));
}

/// Milliseconds of simulated time since the run started.
pub fn now_ms() -> u64 {
    START
        .get()
        .map_or(0, |start| (Instant::now() - start).as_millis() as u64)
}

/// What one seed decided about the world.
#[derive(Debug, Clone)]
struct Scenario {
    seed: u64,
    shards: u32,
    keys: u64,
    lanes: usize,
    max_attempts: u32,
    dead_letter: bool,
    start: InitialPosition,
    workers: usize,
    caught_up_frontier: bool,
    /// Records carry up to this many bytes of padding.
    max_padding: usize,
    /// Handlers answer with effects, quarantines and holds too, through a receipt ledger.
    receipts: bool,
    /// Deliveries go to the handler in batches of up to this many (`Batched`).
    batch: Option<usize>,
    /// A handler (or batch) running longer than this is dropped and retried.
    handler_timeout: Option<Duration>,
    /// Retries run in place (`RetryMode::InPlace`) instead of as copies; without a dead-letter
    /// stream, a spent record is dropped (`OnSpent::Drop`). Not with batches: a batch's records
    /// of the failing one's key ran in it (bisection is not built).
    in_place: bool,
    /// With retries in place and no dead-letter stream: spent records go to a queue (an
    /// on-failure destination) whose writes fail or lose their answers now and then, instead of
    /// being dropped.
    queue: bool,
    /// Retry settings left at their defaults: no `max_attempts`, dead-letter stream, retry mode
    /// or `on_spent`, so a failing record runs again in place until it succeeds (Lambda's
    /// default). Only where nothing else bounds or records attempts: no batches, handler
    /// timeout or receipts.
    defaults: bool,
    /// Shards are read with enhanced fan-out: subscriptions (the model of SubscribeToShard over
    /// the simulated stream, an event a second, ended every 5 minutes, failing with the stream's
    /// faults) instead of GetRecords polls.
    fan_out: bool,
    /// Records are JSON and a `FilterCriteria` (Lambda's) lets only orders reach the handler: one
    /// record in five is a quote, which must settle without it.
    filter: bool,
    /// Tumbling windows of this width (`window::Windowed`): the handler gets each shard's records
    /// in calls by window with the state it answered last (the ids aggregated so far), and a
    /// final call per window. One lane, retries in place; no batches, timeouts or receipts.
    window: Option<Duration>,
    /// The most records a window call gets.
    window_batch: usize,
    /// (time, action), in time order.
    actions: Vec<(Duration, Action)>,
}

#[derive(Debug, Clone, Copy)]
enum Action {
    Put(u64),
    Split,
    Merge,
    Crash,
    Stop,
    Start,
    /// A worker cut off for this long: at once, or right after its next lease-store call of a
    /// method (a renewal or a beat) was applied and then answered this late.
    Pause(Duration, Option<(&'static str, Duration)>),
    Steal,
    Seek,
    AgeOut,
    StoreFaults(bool),
    StreamFaults(bool),
    /// A worker's beats refused as throttled for this long while its renewals land (the roster
    /// item throttled for its writes), then, when given, the worker cut off from the lease table
    /// for this long: the others may judge it dead by the roster before its counters stop.
    BeatsRefused(Duration, Option<Duration>),
}

impl Scenario {
    fn from_seed(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let start = match rng.random_range(0..10) {
            0..=5 => InitialPosition::TrimHorizon,
            6..=7 => InitialPosition::Latest,
            _ => InitialPosition::AtTimestamp(
                base() + Duration::from_millis(rng.random_range(0..3_000)),
            ),
        };
        let mut actions = Vec::new();
        let n = rng.random_range(4..=24);
        for _ in 0..n {
            let at = Duration::from_millis(rng.random_range(0..CHAOS.as_millis() as u64));
            let action = match rng.random_range(0..100) {
                0..=29 => Action::Put(rng.random_range(1..=12)),
                30..=36 => Action::Split,
                37..=40 => Action::Merge,
                41..=48 => Action::Crash,
                49..=53 => Action::Stop,
                54..=62 => Action::Start,
                63..=68 => Action::Pause(
                    Duration::from_millis(rng.random_range(500..5_000)),
                    rng.random_bool(0.5).then(|| {
                        let method = ["renew", "beat"][rng.random_range(0..2)];
                        (method, Duration::from_millis(rng.random_range(0..700)))
                    }),
                ),
                69..=73 => Action::Steal,
                74..=81 => Action::Seek,
                82..=84 => Action::AgeOut,
                85..=91 => Action::StoreFaults(rng.random_bool(0.6)),
                _ => Action::StreamFaults(rng.random_bool(0.6)),
            };
            actions.push((at, action));
        }
        // Apart from the other decisions, so that seeds without it stay as they were.
        let mut beats = StdRng::seed_from_u64(seed ^ 0xbea7_5eed);
        if beats.random_bool(0.3) {
            let at = Duration::from_millis(beats.random_range(0..CHAOS.as_millis() as u64));
            let refused = Duration::from_millis(beats.random_range(500..6_000));
            let cut = beats
                .random_bool(0.7)
                .then(|| Duration::from_millis(beats.random_range(300..4_000)));
            actions.push((at, Action::BeatsRefused(refused, cut)));
        }
        actions.sort_by_key(|(at, _)| *at);
        Self {
            seed,
            shards: rng.random_range(1..=3),
            keys: rng.random_range(1..=6),
            lanes: rng.random_range(1..=3),
            max_attempts: rng.random_range(1..=4),
            dead_letter: rng.random_bool(0.5),
            start,
            workers: rng.random_range(1..=3),
            caught_up_frontier: rng.random_bool(0.3),
            max_padding: [1, 64, 4_096][rng.random_range(0..3)],
            // Apart from the other decisions, so seeds without receipts stay as they were.
            receipts: StdRng::seed_from_u64(seed ^ 0x7ece_1475).random_bool(0.5),
            // Likewise, and never for the regression seeds (491, 94).
            batch: matches!(seed % 10, 2 | 6 | 7)
                .then(|| StdRng::seed_from_u64(seed ^ 0xba7c_4e55).random_range(2..=8)),
            handler_timeout: matches!(seed % 10, 3 | 6 | 8).then(|| {
                Duration::from_millis(
                    StdRng::seed_from_u64(seed ^ 0x71e0_0075).random_range(120..=600),
                )
            }),
            // Apart from the other decisions too.
            in_place: !matches!(seed % 10, 2 | 6 | 7)
                && StdRng::seed_from_u64(seed ^ 0x1a9c_e000).random_bool(0.4),
            queue: StdRng::seed_from_u64(seed ^ 0x0c0e_0e00).random_bool(0.5),
            defaults: false,
            fan_out: StdRng::seed_from_u64(seed ^ 0x0fa0_0e70).random_bool(0.3),
            // Apart from the other decisions too.
            filter: StdRng::seed_from_u64(seed ^ 0x0f17_7e75).random_bool(0.3),
            window: None,
            window_batch: 1,
            actions,
        }
        .timeouts_dead_letter()
        .retry_defaults()
        .windowed()
    }

    /// The seeds ending in 0, 5 or 9 without receipts (never the regression seeds, never with
    /// batches or timeouts) run on tumbling windows of 1, 2 or 3 s: one lane, retries in place.
    fn windowed(mut self) -> Self {
        let mut rng = StdRng::seed_from_u64(self.seed ^ 0x0a1d_0e5e);
        if matches!(self.seed % 10, 0 | 5 | 9) && !self.receipts {
            self.window = Some(Duration::from_secs(rng.random_range(1..=3)));
            self.window_batch = rng.random_range(1..=8);
            self.lanes = 1;
            self.in_place = true;
        }
        self
    }

    /// One seed in four of those that can (apart from the other decisions) leaves the retry
    /// settings at their defaults.
    fn retry_defaults(mut self) -> Self {
        self.defaults = self.batch.is_none()
            && self.handler_timeout.is_none()
            && !self.receipts
            && StdRng::seed_from_u64(self.seed ^ 0xdefa_0175).random_bool(0.25);
        if self.defaults {
            self.in_place = true;
            self.dead_letter = false;
        }
        self
    }

    /// A delivery dropped past the handler timeout at its last attempt is dead-lettered, so that
    /// its outcome is visible to the model (without a dead-letter stream it would be dropped in
    /// silence, like a retry at the cap, which the model cannot tell from a lost lease).
    fn timeouts_dead_letter(mut self) -> Self {
        if self.handler_timeout.is_some() {
            self.dead_letter = true;
        }
        self
    }
}

/// What a handler does with a delivery: decided by the seed, the record and the attempt alone, so
/// every owner does the same. With receipts, some acks become effects (a counter for the record
/// and one for its key, in one transaction), quarantines or holds.
fn decide(seed: u64, id: u64, attempt: u32, receipts: Option<&str>) -> (Option<Outcome>, Duration) {
    let mut z = seed
        ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ u64::from(attempt).wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let duration = Duration::from_millis((z >> 40) % 250);
    let outcome = match z % 100 {
        0..=71 => Some(Outcome::Ack),
        72..=79 => Some(Outcome::Drop),
        80..=88 => Some(Outcome::Retry),
        89..=94 => Some(Outcome::RetryAfter(Duration::from_millis(
            100 + (z >> 20) % 1_500,
        ))),
        95..=96 => None, // a panic
        _ => Some(Outcome::Ack),
    };
    let outcome = match (outcome, receipts) {
        (Some(Outcome::Ack), Some(partition_key)) => Some(match (z >> 8) % 100 {
            0..=49 => Outcome::Apply(Effects::from_iter([
                Effect::update(COUNTS, key("id", id.to_string())).add("count", 1),
                Effect::update(KEYS, key("key", partition_key)).add("count", 1),
            ])),
            50..=54 => Outcome::Quarantine(format!("id {id} quarantined")),
            55..=59 => Outcome::Hold(format!("id {id} held")),
            _ => Outcome::Ack,
        }),
        (outcome, _) => outcome,
    };
    (outcome, duration)
}

/// A handler call in flight: marks its key free again if the call is dropped before it finishes
/// (its shard stopped or was lost).
struct InFlight {
    model: Arc<Mutex<Model>>,
    call: Call,
    done: bool,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if !self.done {
            self.model.lock().unwrap().abandoned(&self.call);
        }
    }
}

#[derive(Debug)]
enum Slot {
    Down,
    Up { running: Running, gate: Gate },
    Stopping(JoinHandle<ShutdownReport>),
}

/// The result of one seed.
pub struct SeedResult {
    pub seed: u64,
    pub hash: [u8; 16],
    pub violations: Vec<String>,
    pub trace: Vec<String>,
    pub events: u64,
    pub invocations: u64,
}

pub struct World {
    scenario: Scenario,
    rng: StdRng,
    /// Record sizes, apart so they do not shift the other decisions.
    sizes: StdRng,
    model: Arc<Mutex<Model>>,
    stream: MemoryStream,
    sink: MemoryStreams,
    store: MemoryLeaseStore,
    /// The receipt ledger and effect tables (seeds with receipts).
    ledger: Option<MemoryReceipts>,
    /// The operator's choices and the ledger's fault seeds, apart from the other decisions.
    operator: StdRng,
    /// The queue's fault draws and rates (error, lost answer), shared by every worker.
    queue_faults: Arc<Mutex<(StdRng, f64, f64)>>,
    slots: Vec<Slot>,
    next_id: u64,
}

impl World {
    fn new(seed: u64) -> Self {
        let scenario = Scenario::from_seed(seed);
        let stream = MemoryStream::new(STREAM, scenario.shards);
        let dlq = MemoryStream::new(DLQ, 1);
        let sink = MemoryStreams::new([stream.clone(), dlq]);
        let store = MemoryLeaseStore::new();
        let ledger = scenario.receipts.then(|| {
            MemoryReceipts::new()
                .table(COUNTS, &["id"])
                .table(KEYS, &["key"])
        });
        let model = Arc::new(Mutex::new(
            Model::new(STALE_BOUND, stream.clone(), ledger.clone())
                .in_place(scenario.in_place)
                .filtered(scenario.filter)
                .windowed(
                    scenario.window,
                    seed,
                    (!scenario.defaults).then_some(scenario.max_attempts),
                ),
        ));
        let observer = model.clone();
        store.observe(Arc::new(move |change: &Change| {
            observer.lock().unwrap().change(now_ms(), change);
        }));
        Self {
            slots: (0..scenario.workers).map(|_| Slot::Down).collect(),
            rng: StdRng::seed_from_u64(seed.wrapping_mul(31).wrapping_add(7)),
            sizes: StdRng::seed_from_u64(seed ^ 0x5151_5151),
            scenario,
            model,
            stream,
            sink,
            store,
            ledger,
            operator: StdRng::seed_from_u64(seed ^ 0x0be7_a709),
            queue_faults: Arc::new(Mutex::new((
                StdRng::seed_from_u64(seed ^ 0x0c0e_0e01),
                0.1,
                0.05,
            ))),
            next_id: 0,
        }
    }

    /// Whether spent records go to the queue (retries in place, no dead-letter stream).
    fn queued(&self) -> bool {
        self.scenario.in_place
            && self.scenario.queue
            && !self.scenario.dead_letter
            && !self.scenario.defaults
    }

    /// The attempt at which a retry is spent (on the defaults nothing caps attempts), and
    /// whether a spent record is written somewhere (a dead-letter stream, or the queue, which
    /// takes spent records only with retries in place and no dead-letter stream).
    fn spending(&self) -> (u32, bool) {
        let cap = if self.scenario.defaults {
            u32::MAX
        } else {
            self.scenario.max_attempts
        };
        (cap, self.scenario.dead_letter || self.queued())
    }

    fn event(&self, what: String) {
        self.model.lock().unwrap().event(now_ms(), what);
    }

    fn put(&mut self, n: u64) {
        for _ in 0..n {
            let id = self.next_id;
            self.next_id += 1;
            let key = format!("k{}", id % self.scenario.keys);
            let padding = self.sizes.random_range(0..self.scenario.max_padding);
            let payload = if self.scenario.filter {
                crate::model::filtered_payload(id, padding)
            } else {
                format!("{id}|{}", "x".repeat(padding))
            };
            let (shard, seq) = self.stream.put(&key, payload);
            self.event(format!("put id={id} key={key} -> {shard} {seq}"));
        }
    }

    fn handler(
        &self,
        worker: String,
    ) -> impl Fn(Delivery) -> BoxFuture<'static, Outcome> + Send + Sync + 'static {
        let model = self.model.clone();
        let seed = self.scenario.seed;
        let (cap, dead_letter) = self.spending();
        let receipts = self.scenario.receipts;
        move |d: Delivery| {
            let call = Call::of(&worker, &d);
            model.lock().unwrap().started(now_ms(), &call);
            let (outcome, took) = decide(
                seed,
                call.id,
                call.attempt,
                receipts.then_some(d.partition_key()),
            );
            let mut guard = InFlight {
                model: model.clone(),
                call,
                done: false,
            };
            Box::pin(async move {
                tokio::time::sleep(took).await;
                let terminal = matches!(outcome, Some(Outcome::Ack | Outcome::Drop));
                // A retry at the cap without a dead-letter stream is settled as a drop at once.
                let settles = terminal || (guard.call.attempt >= cap && !dead_letter);
                guard.done = true;
                guard.model.lock().unwrap().finished(
                    now_ms(),
                    &guard.call,
                    outcome.clone(),
                    settles,
                );
                match outcome {
                    Some(o) => o,
                    None => std::panic::panic_any("simulated handler panic"),
                }
            })
        }
    }

    /// The window handler of a windowed seed: its state is the ids aggregated so far (JSON).
    /// A call fails whole one time in twenty (no state: every record retried); otherwise its
    /// records are handled in order as [`decide`] says, and from the first that does not settle
    /// (a retry, or a panic, which a window handler answers as a failure) every later one is
    /// answered as a retry, as Lambda retries from the first failure. One final call in five
    /// fails.
    fn window_handler(&self, worker: String) -> impl WindowHandler {
        let model = self.model.clone();
        let seed = self.scenario.seed;
        let (cap, dead_letter) = self.spending();
        move |call: WindowCall| {
            let (model, worker) = (model.clone(), worker.clone());
            async move {
                let mut ids: Vec<u64> = call
                    .state
                    .as_ref()
                    .map(|s| serde_json::from_slice(s).expect("the state is the ids"))
                    .unwrap_or_default();
                let records: Vec<(Position, u64)> = call
                    .records
                    .iter()
                    .map(|d| (*d.position(), crate::model::id_of(d.payload())))
                    .collect();
                let fails = model.lock().unwrap().window_call(
                    now_ms(),
                    &worker,
                    &call,
                    call.state.as_ref().map(|_| ids.as_slice()),
                    &records,
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
                if call.is_final {
                    if fails {
                        return WindowAnswer::failed();
                    }
                    model
                        .lock()
                        .unwrap()
                        .window_closed(now_ms(), &call.shard_id, call.window);
                    return WindowAnswer::acked(call.state.unwrap_or_default(), 0);
                }
                let mut outcomes = Vec::with_capacity(call.records.len());
                let mut failing = fails;
                for d in &call.records {
                    let record = Call::of(&worker, d);
                    let spent = record.attempt >= cap;
                    if failing {
                        // After a failure the runtime answers a retry for the rest unhandled.
                        model
                            .lock()
                            .unwrap()
                            .passed_over(now_ms(), &record, spent, dead_letter);
                        outcomes.push(Outcome::Retry);
                        continue;
                    }
                    model.lock().unwrap().started(now_ms(), &record);
                    let mut guard = InFlight {
                        model: model.clone(),
                        call: record,
                        done: false,
                    };
                    let (decided, took) = decide(seed, guard.call.id, guard.call.attempt, None);
                    tokio::time::sleep(took).await;
                    let outcome = match decided {
                        Some(o @ (Outcome::Ack | Outcome::Drop)) => o,
                        // A retry, or a panic (a window handler answers it as a failure).
                        _ => Outcome::Retry,
                    };
                    let settles = matches!(outcome, Outcome::Ack | Outcome::Drop);
                    failing = !settles;
                    guard.done = true;
                    let mut m = guard.model.lock().unwrap();
                    m.finished(
                        now_ms(),
                        &guard.call,
                        Some(outcome.clone()),
                        settles || (spent && !dead_letter),
                    );
                    if settles {
                        ids.push(guard.call.id);
                        m.aggregated(&guard.call, call.window);
                    } else if spent {
                        m.spent(&guard.call);
                    }
                    drop(m);
                    outcomes.push(outcome);
                }
                if fails {
                    return WindowAnswer::failed();
                }
                WindowAnswer::new(serde_json::to_vec(&ids).expect("ids as JSON"), outcomes)
            }
        }
    }

    async fn start(&mut self, slot: usize) {
        if !matches!(self.slots[slot], Slot::Down) {
            return;
        }
        let worker = format!("w{slot}");
        self.model.lock().unwrap().worker_up(&worker);
        let gate = Gate::new();
        let store = Arc::new(Layered::new(
            Arc::new(self.store.clone()),
            Store {
                gate: gate.clone(),
                worker: worker.clone(),
                model: self.model.clone(),
            },
        ));
        let stream = Arc::new(Stream {
            inner: self.stream.clone(),
            sink: self.sink.clone(),
            gate: gate.clone(),
            worker: worker.clone(),
            model: self.model.clone(),
        });
        if let Some(width) = self.scenario.window {
            let batching = Batching::new(self.scenario.window_batch, Duration::from_millis(50));
            let windowed = Windowed::new(self.window_handler(worker.clone()), width, batching);
            let result = self
                .run_worker(windowed, &worker, &gate, store, stream)
                .await;
            self.started(slot, &worker, gate, result);
            return;
        }
        let handler = self.handler(worker.clone());
        let result = match self.scenario.batch {
            None => {
                self.run_worker(handler, &worker, &gate, store, stream)
                    .await
            }
            Some(size) => {
                // One delivery after another, a panic answered as a retry of that one alone, as
                // the lanes answer a single delivery's panic.
                let handler = Arc::new(handler);
                let batch = move |batch: Vec<Delivery>| {
                    let handler = handler.clone();
                    let run: BoxFuture<'static, Vec<Outcome>> = Box::pin(async move {
                        let mut outcomes = Vec::with_capacity(batch.len());
                        for d in batch {
                            let outcome = std::panic::AssertUnwindSafe(handler(d))
                                .catch_unwind()
                                .await
                                .unwrap_or(Outcome::Retry);
                            outcomes.push(outcome);
                        }
                        outcomes
                    });
                    run
                };
                let batching = Batching::new(size, Duration::from_millis(50));
                self.run_worker(Batched::new(batch, batching), &worker, &gate, store, stream)
                    .await
            }
        };
        self.started(slot, &worker, gate, result);
    }

    fn started(
        &mut self,
        slot: usize,
        worker: &str,
        gate: Gate,
        result: Result<Running, shardwise::Error>,
    ) {
        match result {
            Ok(running) => {
                self.event(format!("worker {worker} started"));
                self.slots[slot] = Slot::Up { running, gate };
            }
            Err(e) => self.event(format!("worker {worker} failed to start: {e}")),
        }
    }

    /// Builds and runs worker `worker`'s consumer around `handler`.
    async fn run_worker<H: Handler>(
        &self,
        handler: H,
        worker: &str,
        gate: &Gate,
        store: Arc<Layered<Store>>,
        stream: Arc<Stream>,
    ) -> Result<Running, shardwise::Error> {
        let s = &self.scenario;
        let mut builder = Consumer::builder(STREAM, APP, handler)
            .worker_id(worker)
            .lanes(s.lanes)
            .max_in_flight(40)
            .get_records_limit(20)
            .poll_interval(Duration::from_millis(200))
            .checkpoint_interval(Duration::from_millis(100))
            .lease_settings(
                LeaseSettings::default()
                    .lease_duration(LEASE)
                    .scan_interval(SCAN)
                    .shard_sync_interval(Duration::from_secs(1)),
            )
            .initial_position(s.start)
            .lease_store(store)
            .record_source(if s.fan_out {
                Arc::new(FanOutRecords::with(
                    Arc::new(Subscriptions::over(stream.clone())),
                    stream.clone(),
                    FanOut::new(),
                ))
            } else {
                stream.clone()
            })
            .shard_lister(stream.clone())
            .record_sink(stream)
            .hooks(Arc::new(GiveUps {
                worker: worker.to_string(),
                model: self.model.clone(),
            }));
        if !s.defaults {
            builder = builder.max_attempts(NonZeroU32::new(s.max_attempts).unwrap());
        }
        if s.dead_letter {
            builder = builder.dead_letter(DLQ);
        }
        if s.defaults {
            // Nothing set: retries in place, unbounded.
        } else if s.in_place {
            builder = builder.retries(RetryMode::InPlace);
            if self.queued() {
                builder = builder.on_failure(Arc::new(Queue {
                    gate: gate.clone(),
                    worker: worker.to_string(),
                    model: self.model.clone(),
                    faults: self.queue_faults.clone(),
                }));
            } else if !s.dead_letter {
                builder = builder.on_spent(OnSpent::Drop);
            }
        } else {
            builder = builder.retries(RetryMode::Copy);
        }
        if let Some(ledger) = &self.ledger {
            builder = builder
                .receipts(Arc::new(Receipts {
                    inner: ledger.clone(),
                    gate: gate.clone(),
                    worker: worker.to_string(),
                    model: self.model.clone(),
                }))
                .hold_poll_interval(Duration::from_millis(500));
        }
        if s.caught_up_frontier {
            builder = builder
                .caught_up_frontier(Duration::from_millis(500))
                .frontier_interval(Duration::from_secs(1));
        }
        builder.set_handler_timeout(s.handler_timeout);
        if s.filter {
            let orders = shardwise::filter::FilterCriteria::parse(crate::model::ORDERS_ONLY)
                .expect("a valid filter");
            return builder
                .filter(orders)
                .build()
                .expect("valid settings")
                .run()
                .await;
        }
        builder.build().expect("valid settings").run().await
    }

    fn pick_up(&mut self) -> Option<usize> {
        let up: Vec<usize> = (0..self.slots.len())
            .filter(|i| matches!(self.slots[*i], Slot::Up { .. }))
            .collect();
        (!up.is_empty()).then(|| up[self.rng.random_range(0..up.len())])
    }

    fn pick_down(&mut self) -> Option<usize> {
        let down: Vec<usize> = (0..self.slots.len())
            .filter(|i| matches!(self.slots[*i], Slot::Down))
            .collect();
        (!down.is_empty()).then(|| down[self.rng.random_range(0..down.len())])
    }

    async fn act(&mut self, action: Action) {
        match action {
            Action::Put(n) => self.put(n),
            Action::Split => {
                let open = self.stream.open_shards();
                if open.len() < 6 {
                    let shard = open[self.rng.random_range(0..open.len())].clone();
                    let (a, b) = self.stream.split(&shard);
                    self.event(format!("split {shard} -> {a} {b}"));
                }
            }
            Action::Merge => {
                let pairs = self.stream.adjacent_open_shards();
                if !pairs.is_empty() {
                    let (a, b) = pairs[self.rng.random_range(0..pairs.len())].clone();
                    let child = self.stream.merge(&a, &b);
                    self.event(format!("merge {a} {b} -> {child}"));
                }
            }
            Action::Crash => {
                if let Some(i) = self.pick_up()
                    && let Slot::Up { running, .. } =
                        std::mem::replace(&mut self.slots[i], Slot::Down)
                {
                    self.event(format!("worker w{i} crashes"));
                    running.abort();
                    self.model.lock().unwrap().forget_worker(&format!("w{i}"));
                }
            }
            Action::Stop => {
                if let Some(i) = self.pick_up()
                    && let Slot::Up { running, gate } =
                        std::mem::replace(&mut self.slots[i], Slot::Down)
                {
                    self.event(format!("worker w{i} stops"));
                    gate.set_cut(false);
                    let deadline = Duration::from_millis(self.rng.random_range(100..3_000));
                    self.slots[i] = Slot::Stopping(tokio::spawn(running.shutdown(deadline)));
                    self.model.lock().unwrap().forget_worker(&format!("w{i}"));
                }
            }
            Action::Start => {
                if let Some(i) = self.pick_down() {
                    self.start(i).await;
                }
            }
            Action::Pause(d, after_an_answer) => {
                if let Some(i) = self.pick_up()
                    && let Slot::Up { gate, .. } = &self.slots[i]
                {
                    if let Some((method, slow)) = after_an_answer {
                        self.event(format!("worker w{i} to be cut off after its next {method}"));
                        gate.arm(method, slow, d);
                        return;
                    }
                    self.event(format!("worker w{i} cut off for {} ms", d.as_millis()));
                    gate.set_cut(true);
                    let gate = gate.clone();
                    let model = self.model.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(d).await;
                        gate.set_cut(false);
                        model
                            .lock()
                            .unwrap()
                            .event(now_ms(), format!("worker w{i} back"));
                    });
                }
            }
            Action::BeatsRefused(refused, cut) => {
                if let Some(i) = self.pick_up()
                    && let Slot::Up { gate, .. } = &self.slots[i]
                {
                    self.event(format!(
                        "worker w{i}: its beats refused for {} ms",
                        refused.as_millis()
                    ));
                    gate.refuse_beats(true);
                    let gate = gate.clone();
                    let model = self.model.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(refused).await;
                        if let Some(cut) = cut {
                            gate.set_table_cut(true);
                            model.lock().unwrap().event(
                                now_ms(),
                                format!(
                                    "worker w{i} cut off from the lease table for {} ms",
                                    cut.as_millis()
                                ),
                            );
                            gate.refuse_beats(false);
                            tokio::time::sleep(cut).await;
                            gate.set_table_cut(false);
                        } else {
                            gate.refuse_beats(false);
                        }
                        model
                            .lock()
                            .unwrap()
                            .event(now_ms(), format!("worker w{i}: its beats land again"));
                    });
                }
            }
            Action::Steal => {
                if let Ok(rows) = self.store.list(STREAM).await {
                    let owned: Vec<_> = rows.into_iter().filter(|r| r.owner.is_some()).collect();
                    if !owned.is_empty() {
                        let row = owned[self.rng.random_range(0..owned.len())].clone();
                        let taken = self.store.take(&row, "thief").await;
                        self.event(format!(
                            "thief takes {}: {:?}",
                            row.shard_id,
                            taken.map(|t| t.is_some())
                        ));
                    }
                }
            }
            Action::Seek => {
                let target = self.seek_target();
                self.event(format!("seek to {target:?}"));
                if target == SeekTarget::Latest {
                    self.model.lock().unwrap().seeking_latest(Some(now_ms()));
                }
                let result =
                    shardwise::seek::seek(&self.store, &self.stream, STREAM, &target).await;
                self.model.lock().unwrap().seeking_latest(None);
                self.event(format!("seek done: {:?}", result.map(|r| r.moved)));
            }
            Action::AgeOut => {
                let lineage = self.stream.lineage();
                let closed: Vec<String> = lineage
                    .into_iter()
                    .filter(|(_, _, closed, aged)| *closed && !aged)
                    .map(|(s, ..)| s)
                    .collect();
                if !closed.is_empty() {
                    let shard = closed[self.rng.random_range(0..closed.len())].clone();
                    self.stream.age_out(&shard);
                    self.model.lock().unwrap().aged_out(&shard);
                    self.event(format!("retention trims {shard}"));
                }
            }
            Action::StoreFaults(on) => {
                if on {
                    let seed = self.rng.random();
                    self.store.inject(
                        seed,
                        Faults::default()
                            .error(0.03)
                            .throttle(0.02)
                            .lost_answer(0.02)
                            .slow_answer(0.03)
                            .timeout(
                                0.02,
                                Duration::from_millis(self.rng.random_range(100..1_500)),
                            ),
                    );
                } else {
                    self.store.heal();
                }
                if let Some(ledger) = &self.ledger {
                    if on {
                        let seed = self.operator.random();
                        ledger.inject(
                            seed,
                            Faults::default()
                                .error(0.03)
                                .throttle(0.02)
                                .lost_answer(0.03)
                                .timeout(0.02, Duration::from_millis(800)),
                        );
                    } else {
                        ledger.heal();
                    }
                }
                self.event(format!("store faults {on}"));
            }
            Action::StreamFaults(on) => {
                if on {
                    let seed = self.rng.random();
                    self.stream.inject(
                        seed,
                        Faults::default()
                            .error(0.03)
                            .throttle(0.03)
                            .lost_answer(0.02)
                            .expired_iterator(0.03)
                            .timeout(0.01, Duration::from_millis(700)),
                    );
                } else {
                    self.stream.heal();
                }
                self.event(format!("stream faults {on}"));
            }
        }
    }

    fn seek_target(&mut self) -> SeekTarget {
        match self.rng.random_range(0..4) {
            0 => SeekTarget::TrimHorizon,
            1 => SeekTarget::Latest,
            2 => SeekTarget::Timestamp(
                base() + Duration::from_millis(self.rng.random_range(0..=now_ms().max(1))),
            ),
            _ => {
                let records = self.stream.records();
                let listed: BTreeSet<String> = self
                    .stream
                    .lineage()
                    .into_iter()
                    .filter(|(.., aged)| !aged)
                    .map(|(s, ..)| s)
                    .collect();
                let candidates: Vec<_> = records
                    .iter()
                    .filter(|r| listed.contains(&r.shard_id))
                    .collect();
                if candidates.is_empty() {
                    return SeekTarget::TrimHorizon;
                }
                let r = candidates[self.rng.random_range(0..candidates.len())];
                SeekTarget::Position {
                    shard_id: r.shard_id.clone(),
                    position: Position::new(r.record.sequence, 0),
                }
            }
        }
    }

    /// The operator: each held receipt is released (handled again) or quarantined (settled),
    /// half and half; `settle_all` quarantines every one (the quiet phase).
    fn operate(&mut self, settle_all: bool) {
        let Some(ledger) = self.ledger.clone() else {
            return;
        };
        let held: Vec<_> = ledger
            .receipts()
            .into_iter()
            .filter(|r| !r.disposition.is_terminal())
            .collect();
        for receipt in held {
            let release = !settle_all && self.operator.random_bool(0.5);
            let (ledger, model) = (ledger.clone(), self.model.clone());
            tokio::spawn(async move {
                let event = receipt.event;
                let what = if release {
                    format!("release {event}: {:?}", ledger.release(&event).await)
                } else {
                    let quarantined = Disposition::Quarantined("operator".into());
                    let recorded = ledger.record(&event, &quarantined, "operator").await;
                    format!("quarantine {event}: {recorded:?}")
                };
                model
                    .lock()
                    .unwrap()
                    .event(now_ms(), format!("operator {what}"));
            });
        }
    }

    /// Samples what workers expose: their frontier.
    fn sample(&mut self) {
        let mut model = self.model.lock().unwrap();
        for (i, slot) in self.slots.iter().enumerate() {
            if let Slot::Up { running, .. } = slot {
                let f = running.frontier().borrow().clone();
                model.frontier(now_ms(), &format!("w{i}"), &f);
            }
        }
    }

    async fn reap(&mut self) {
        for slot in &mut self.slots {
            if let Slot::Stopping(handle) = slot
                && handle.is_finished()
            {
                let _ = handle.await;
                *slot = Slot::Down;
            }
        }
    }

    async fn run(mut self) -> SeedResult {
        if let Some(width) = self.scenario.window {
            let s = &self.scenario;
            self.event(format!(
                "windows of {width:?}, calls of up to {} records, max_attempts {}, dead letter {}, defaults {}, filter {}",
                s.window_batch, s.max_attempts, s.dead_letter, s.defaults, s.filter
            ));
        }
        let first = self.rng.random_range(0..20);
        self.put(first);
        for i in 0..self.slots.len() {
            self.start(i).await;
        }
        let actions = std::mem::take(&mut self.scenario.actions);
        let mut pending = actions.into_iter().peekable();
        let t0 = Instant::now();
        let mut operated = Duration::ZERO;
        while t0.elapsed() < CHAOS {
            if t0.elapsed() >= operated + OPERATOR {
                operated = t0.elapsed();
                self.operate(false);
            }
            while let Some((at, _)) = pending.peek()
                && *at <= t0.elapsed()
            {
                let (_, action) = pending.next().unwrap();
                self.act(action).await;
            }
            tokio::time::sleep(STEP).await;
            self.sample();
            self.reap().await;
        }

        // The quiet phase: no more faults or partitions, at least one worker, and everything owed
        // must get handled.
        self.store.heal();
        self.stream.heal();
        if let Some(ledger) = &self.ledger {
            ledger.heal();
        }
        for slot in &self.slots {
            if let Slot::Up { gate, .. } = slot {
                gate.set_cut(false);
            }
        }
        self.event("quiet".into());
        let quiet = Instant::now();
        loop {
            self.reap().await;
            if !self.slots.iter().any(|s| matches!(s, Slot::Up { .. }))
                && let Some(i) = self.pick_down()
            {
                self.start(i).await;
            }
            tokio::time::sleep(STEP).await;
            self.sample();
            self.operate(true);
            let (owed, uncovered, unclosed) = {
                let mut model = self.model.lock().unwrap();
                model.refresh();
                (model.owed(), model.uncovered(), model.unclosed_windows())
            };
            if owed.is_empty() && uncovered.is_empty() && unclosed.is_empty() {
                break;
            }
            if quiet.elapsed() > QUIET {
                let mut model = self.model.lock().unwrap();
                let first: Vec<String> = owed
                    .iter()
                    .take(5)
                    .map(|(s, p, after)| format!("{s} {p} (after {after} ms)"))
                    .collect();
                let what = format!(
                    "stuck: {} records never handled (skipped or stuck), first {first:?}; {} not covered by a checkpoint, first {:?}; {} windows without a final call, first {:?}",
                    owed.len(),
                    uncovered.len(),
                    &uncovered[..uncovered.len().min(3)],
                    unclosed.len(),
                    &unclosed[..unclosed.len().min(3)]
                );
                model.event(now_ms(), format!("VIOLATION {what}"));
                model.violations.push(what);
                break;
            }
        }
        {
            let mut model = self.model.lock().unwrap();
            for what in model.never_given_up() {
                model.event(now_ms(), format!("VIOLATION {what}"));
                model.violations.push(what);
            }
        }
        // Stop everyone gracefully; their final checkpoints must cover everything handled.
        for slot in std::mem::take(&mut self.slots) {
            match slot {
                Slot::Up { running, .. } => {
                    running.shutdown(Duration::from_secs(10)).await;
                }
                Slot::Stopping(handle) => {
                    let _ = handle.await;
                }
                Slot::Down => {}
            }
        }
        let uncovered = self.model.lock().unwrap().uncovered();
        if !uncovered.is_empty() {
            let mut model = self.model.lock().unwrap();
            let what = format!(
                "{} records handled but behind the final checkpoints, first {:?}",
                uncovered.len(),
                &uncovered[..uncovered.len().min(3)]
            );
            model.event(now_ms(), format!("VIOLATION {what}"));
            model.violations.push(what);
        }
        let model = self.model.lock().unwrap();
        SeedResult {
            seed: self.scenario.seed,
            hash: model.log.hash(),
            violations: model.violations.clone(),
            trace: model.log.tail(),
            events: model.log.count(),
            invocations: model.invocations,
        }
    }
}

/// Runs one seed on a fresh current-thread runtime with paused time.
pub fn run_seed(seed: u64) -> SeedResult {
    run_paused(seed, async move {
        START.set(Some(Instant::now()));
        let result = World::new(seed).run().await;
        START.set(None);
        result
    })
}

/// Runs one seed's world on a fresh current-thread runtime with paused time, with shardwise's
/// wall clock and jitter following the seed; a panic of shardwise on this thread fails the seed.
pub fn run_paused(seed: u64, world: impl Future<Output = SeedResult>) -> SeedResult {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime");
    runtime.block_on(async move {
        let _deterministic = shardwise::testing::simulate(base(), seed);
        let mut result = world.await;
        for panic in PANICS.take() {
            result
                .violations
                .push(format!("shardwise panicked: {panic}"));
        }
        result
    })
}

/// Tells the model when a worker's manager takes a lease and when it gives one up (lost, or let
/// go when its hold ran out).
struct GiveUps {
    worker: String,
    model: Arc<Mutex<Model>>,
}

impl shardwise::lease::LeaseHooks for GiveUps {
    fn lease_taken(&self, lease: &shardwise::Lease) {
        self.model
            .lock()
            .unwrap()
            .acquired(&lease.shard_id, lease.owner_epoch);
    }

    fn lease_lost(&self, ownership: &shardwise::lease::Ownership) {
        self.model.lock().unwrap().gave_up(
            now_ms(),
            &self.worker,
            &ownership.shard_id,
            ownership.epoch,
        );
    }
}
