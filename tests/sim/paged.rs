//! One seed's paged world: the real consumer on the scripted event API (`testing::EventApi`) and
//! the memory lease store, under paused time. The seed decides the partitions, page size, lanes,
//! workers that start, stop gracefully and crash, seeks, misbehaving pages (replays, overlaps,
//! empty pages with new tokens, unchanged tokens, lost answers, throttling), events arriving while
//! the partitions are read, faults in the lease store and the ledger, handler outcomes (acks,
//! drops, retries in place, and with receipts effects, quarantines and holds an operator settles).
//! A failing event fails (answers `Retry` or `RetryAfter`, panics, or with a ledger answers
//! effects whose condition does not hold) for up to five attempts, and with a ledger some events
//! answer effects that can never be committed (spent at once, quarantined);
//! with a ledger, half the seeds cap attempts at 3 and three in ten time handlers out at 30 ms, so
//! spent events are quarantined by receipt; without one nothing is capped and every event runs
//! again in place until it succeeds.
//!
//! Events carry one of up to three ordering keys, or none (a keyless event orders against
//! nothing). Checked at every handler call (invariant 6, per-key order): within one ownership of
//! a partition (one process, one epoch), no event is handed to the handler after a later event
//! of its key was: an event that runs again (a retry, a panic, a timeout, effects whose condition
//! was refused) runs before the later events of its key. A held event an operator released is
//! handled again out of order, as the operator asked (exempt).
//!
//! Checked at every write of the lease store (seed 003's invariants):
//! - a partition's `appliedPosition` and `checkpointVersion` never go down, except by a seek;
//! - every event at or below `appliedPosition` has a durable outcome (it settled) when the write
//!   is made: the barrier never passes an unsettled event;
//! - no effect is applied twice (every counter is at most 1);
//! - no event settles as `Spent` (settled with no durable outcome: seed 003, rule 1).
//!
//! At the end, after a quiet phase without faults, every event of every partition has settled
//! and each partition's applied position is its last event's.
//!
//! A third of the seeds read the source by timestamp instead (seed 000): events share
//! milliseconds, ties rotate between requests (read through a snapshot per poll) or stay stable,
//! and the finality is a later timestamp, a watermark, or a 2 s lateness bound, chosen by the
//! seed. Checked at every write: `closedThrough` and the version never go down except by a seek,
//! and every event at or before `closedThrough` has settled. At the end every event has settled
//! and every group the contract can prove complete is closed.

use std::collections::{BTreeSet, HashMap};
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use md5::{Digest, Md5};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shardwise::consumer::Settled;
use shardwise::lease::{Change, LeaseSettings, MemoryLeaseStore};
use shardwise::paged::{Contract, Finality, PagedSource, Timestamps, Traversal};
use shardwise::receipts::{
    Disposition, Effect, Effects, Expect, MemoryReceipts, ReceiptStore, key,
};
use shardwise::seek::SeekTarget;
use shardwise::testing::{EventApi, Faults, Script, ScriptedEvent, Ties};
use shardwise::{Consumer, Delivery, Outcome, Running};
use tokio::time::Instant;

use crate::world::SeedResult;

const SOURCE: &str = "sim-events";
const COUNTS: &str = "counts";
const CHAOS: Duration = Duration::from_secs(15);
const QUIET: Duration = Duration::from_secs(120);
const STEP: Duration = Duration::from_millis(50);

/// One ownership of a partition by one process (its number, the partition, the epoch the
/// deliveries were read under) and one ordering key in it.
type KeyRun = (u64, String, u64, String);

/// What the checks see: the events that settled, the violations, and the trace.
#[derive(Default)]
struct Model {
    /// Event ids (`partition-position`) with a durable outcome.
    settled: BTreeSet<String>,
    /// Per key and ownership, the latest event handed to the handler: its arrival index and id.
    latest: HashMap<KeyRun, (u64, String)>,
    /// Events the handler held (an operator's release hands them out again, out of order).
    held: BTreeSet<String>,
    /// The source, when it is read by timestamp (its events' timestamps are checked against
    /// `closedThrough`).
    by_time: Option<EventApi>,
    violations: Vec<String>,
    hasher: Md5,
    tail: Vec<String>,
    events: u64,
    invocations: u64,
}

impl Model {
    fn event(&mut self, at: Instant, start: Instant, what: String) {
        let line = format!("{:>6} {what}", (at - start).as_millis());
        self.hasher.update(line.as_bytes());
        self.events += 1;
        self.tail.push(line);
        if self.tail.len() > crate::model::trace_tail() {
            self.tail.remove(0);
        }
    }

    /// A write of the lease store, checked.
    fn change(&mut self, change: &Change) -> Option<String> {
        if self.by_time.is_some() {
            return self.closed_change(change);
        }
        let after = change.after.as_ref()?;
        let progress = after.progress.clone().unwrap_or_default();
        let applied = progress.applied_position.as_ref().and_then(|p| p.as_u64());
        if change.operation != "seek"
            && let Some(before) = change.before.as_ref().and_then(|b| b.progress.clone())
        {
            let was = before.applied_position.as_ref().and_then(|p| p.as_u64());
            if applied < was {
                return Some(format!(
                    "{}: applied position went down from {was:?} to {applied:?} ({})",
                    after.shard_id, change.operation
                ));
            }
            if progress.checkpoint_version < before.checkpoint_version {
                return Some(format!("{}: checkpoint version went down", after.shard_id));
            }
        }
        for position in 1..=applied.unwrap_or(0) {
            let id = format!("{}-{position}", after.shard_id);
            if !self.settled.contains(&id) {
                return Some(format!(
                    "{}: applied position {} passes {id}, which has no durable outcome ({})",
                    after.shard_id,
                    applied.unwrap_or(0),
                    change.operation
                ));
            }
        }
        None
    }
}

/// Where the per-key order check files a delivery of process `process`, and its arrival index.
fn key_run(process: u64, d: &Delivery) -> (KeyRun, u64) {
    let id = d.id().expect("a delivery the consumer tracks");
    let run = (
        process,
        d.shard().to_string(),
        id.epoch(),
        d.partition_key().to_string(),
    );
    (run, id.index())
}

impl Model {
    /// A handler call, checked for per-key order: no later event of its key in the same
    /// ownership was handed out before it.
    fn called(&mut self, process: u64, d: &Delivery, id: &str) -> Option<String> {
        let (run, index) = key_run(process, d);
        let latest = self.latest.entry(run).or_insert((index, id.to_string()));
        if index >= latest.0 {
            *latest = (index, id.to_string());
            return None;
        }
        (!self.held.contains(id)).then(|| {
            format!(
                "{id} (key {}, attempt {}) was handed to the handler after {}, later in its key",
                d.partition_key(),
                d.attempt(),
                latest.1
            )
        })
    }

    /// A write of a partition read by timestamp, checked: `closedThrough` and the version never go
    /// down except by a seek, and no event at or before `closedThrough` lacks a durable outcome.
    fn closed_change(&mut self, change: &Change) -> Option<String> {
        let after = change.after.as_ref()?;
        let progress = after.progress.clone().unwrap_or_default();
        if change.operation != "seek"
            && let Some(before) = change.before.as_ref().and_then(|b| b.progress.clone())
        {
            if progress.closed_through < before.closed_through {
                return Some(format!(
                    "{}: closedThrough went down from {:?} to {:?} ({})",
                    after.shard_id,
                    before.closed_through,
                    progress.closed_through,
                    change.operation
                ));
            }
            if progress.checkpoint_version < before.checkpoint_version {
                return Some(format!("{}: checkpoint version went down", after.shard_id));
            }
        }
        let closed = progress.closed_through?;
        let api = self.by_time.as_ref()?;
        for event in api.events(&after.shard_id) {
            let at = event.timestamp.map(millis).unwrap_or(i64::MIN);
            if at <= closed && !self.settled.contains(&event.id) {
                return Some(format!(
                    "{}: closedThrough {closed} passes {} at {at}, which has no durable outcome ({})",
                    after.shard_id, event.id, change.operation
                ));
            }
        }
        None
    }
}

fn millis(t: std::time::SystemTime) -> i64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// What the handler does for one attempt: answers, or panics (taken for a retry).
enum Answer {
    Outcome(Outcome),
    Panic,
}

/// What the handler answers for attempt `attempt` of event `id`, and how long it takes. A failing
/// event fails until an attempt of its own (2 to 6), so with a cap of 3 some events are spent and
/// without a cap every event succeeds in the end.
fn decide(seed: u64, id: &str, attempt: u32, receipts: bool) -> (Answer, Duration) {
    let mut h = Md5::new();
    h.update(seed.to_le_bytes());
    h.update(id.as_bytes());
    let fails_until = 2 + u32::from(h.clone().finalize()[2] % 5);
    h.update(attempt.to_le_bytes());
    let bytes = h.finalize();
    let roll = bytes[0] % 100;
    let took = Duration::from_millis(u64::from(bytes[1] % 40));
    if (22..=24).contains(&roll) && attempt < fails_until {
        return (Answer::Panic, took);
    }
    let outcome = match roll {
        0..=7 if attempt < fails_until => Outcome::Retry,
        8..=11 if attempt < fails_until => Outcome::RetryAfter(Duration::from_millis(300)),
        12..=14 => Outcome::Drop,
        // A condition that does not hold (the ledger refuses the commit): the retry way.
        25..=27 if receipts && attempt < fails_until => Outcome::Apply(
            Effects::new()
                .with(Effect::update(COUNTS, key("id", id)).add("count", 1))
                .with(Effect::check(COUNTS, key("id", "never"), Expect::Exists)),
        ),
        // Effects the ledger can never commit (two writes of one item): spent, quarantined.
        28 if receipts && attempt == 1 => Outcome::Apply(
            Effects::new()
                .with(Effect::update(COUNTS, key("id", id)).add("count", 1))
                .with(Effect::delete(COUNTS, key("id", id))),
        ),
        15..=18 if receipts => Outcome::Quarantine("bad".into()),
        19..=21 if receipts && attempt == 1 => Outcome::Hold("review".into()),
        _ if receipts => {
            Outcome::Apply(Effect::update(COUNTS, key("id", id)).add("count", 1).into())
        }
        _ => Outcome::Ack,
    };
    (Answer::Outcome(outcome), took)
}

struct World {
    seed: u64,
    rng: StdRng,
    api: EventApi,
    /// The finality of a source read by timestamp; `None`: read by cursor.
    by_time: Option<Finality>,
    /// The latest timestamp put per partition, and how many events.
    last: std::collections::BTreeMap<String, (i64, u64)>,
    store: MemoryLeaseStore,
    ledger: Option<MemoryReceipts>,
    model: Arc<Mutex<Model>>,
    start: Instant,
    partitions: Vec<String>,
    lanes: usize,
    workers: Vec<Option<Running>>,
    /// With a ledger: a cap of 3 attempts.
    capped: bool,
    /// With a ledger: a handler timeout of 30 ms.
    timeout: bool,
    /// How many ordering keys the events share (a quarter have none), and the generator that
    /// picks each event's.
    keys: u32,
    keying: StdRng,
    /// Processes started so far (each start of a worker is a new process).
    processes: u64,
}

impl World {
    fn new(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x9a9e_d003);
        let partitions: Vec<String> = (0..rng.random_range(1..=3))
            .map(|p| format!("p{p}"))
            .collect();
        let mut api = EventApi::new(SOURCE).page_size(rng.random_range(1..=8));
        // A separate generator, so the cursor seeds run as before.
        let mut kind = StdRng::seed_from_u64(seed ^ 0x7153_0000);
        let by_time = (seed % 3 == 2).then(|| match kind.random_range(0..3) {
            0 => Finality::LaterTimestamp,
            1 => Finality::Watermark,
            _ => Finality::Lateness(Duration::from_secs(2)),
        });
        if let Some(finality) = by_time {
            let contract =
                Contract::default().timestamps(Timestamps::new(Traversal::Complete, finality));
            api = api.contract(contract);
            if kind.random_bool(0.5) {
                api = api.ties(Ties::Rotate).snapshots(true);
            }
        }
        let mut last = std::collections::BTreeMap::new();
        // A separate generator, so the seeds' other choices stay as they were.
        let mut keying = StdRng::seed_from_u64(seed ^ 0x6b65_7973);
        let keys = keying.random_range(1..=3);
        for partition in &partitions {
            for _ in 0..rng.random_range(0..30) {
                let key = pick_key(&mut keying, keys);
                match by_time {
                    None => {
                        push(&api, partition, 0, key);
                    }
                    Some(finality) => {
                        push_at(&api, &mut last, &mut kind, finality, partition, 0, key);
                    }
                }
            }
            api.partition(partition);
        }
        let receipts = rng.random_bool(0.5);
        let store = MemoryLeaseStore::new();
        let model = Arc::new(Mutex::new(Model {
            by_time: by_time.map(|_| api.clone()),
            ..Model::default()
        }));
        let start = Instant::now();
        let observer = model.clone();
        store.observe(Arc::new(move |change: &Change| {
            let mut model = observer.lock().unwrap();
            if let Some(violation) = model.change(change) {
                model.event(Instant::now(), start, format!("VIOLATION {violation}"));
                model.violations.push(violation);
            }
            if let Some(after) = &change.after {
                let p = after.progress.clone().unwrap_or_default();
                let line = format!(
                    "store {} {} owner={:?} applied={:?} closed={:?} version={}",
                    change.operation,
                    after.shard_id,
                    after.owner,
                    p.applied_position.and_then(|a| a.as_u64()),
                    p.closed_through,
                    p.checkpoint_version
                );
                model.event(Instant::now(), start, line);
            }
        }));
        let workers = rng.random_range(1..=3);
        // A separate generator, so the seeds' other choices stay as they were.
        let mut failures = StdRng::seed_from_u64(seed ^ 0x0023_5bad);
        let (capped, timeout) = (failures.random_bool(0.5), failures.random_bool(0.3));
        Self {
            capped,
            timeout,
            keys,
            keying,
            processes: 0,
            seed,
            lanes: rng.random_range(1..=4),
            ledger: receipts.then(|| MemoryReceipts::new().table(COUNTS, &["id"])),
            rng,
            api,
            by_time,
            last,
            store,
            model,
            start,
            partitions,
            workers: (0..workers).map(|_| None).collect(),
        }
    }

    /// Puts an event on `partition` (by timestamp: at a time the contract allows); its id.
    fn put(&mut self, partition: &str) -> String {
        let key = pick_key(&mut self.keying, self.keys);
        let elapsed = (Instant::now() - self.start).as_millis() as i64;
        match self.by_time {
            None => push(&self.api, partition, elapsed, key),
            Some(finality) => push_at(
                &self.api,
                &mut self.last,
                &mut self.rng,
                finality,
                partition,
                elapsed,
                key,
            ),
        }
    }

    /// A source with a finality watermark reports one two seconds behind now: every event put
    /// from now on is later.
    fn watermarks(&self) {
        if self.by_time == Some(Finality::Watermark) {
            let now = base_ms() + (Instant::now() - self.start).as_millis() as i64;
            for partition in &self.partitions {
                self.api.watermark(partition, now - 2_000);
            }
        }
    }

    fn event(&self, what: String) {
        self.model
            .lock()
            .unwrap()
            .event(Instant::now(), self.start, what);
    }

    async fn start_worker(&mut self, n: usize) {
        let worker = format!("w{n}");
        let (model, seed, receipts) = (self.model.clone(), self.seed, self.ledger.is_some());
        let start = self.start;
        let w = worker.clone();
        self.processes += 1;
        let process = self.processes;
        let handler = move |d: Delivery| {
            let id = event_name(&d);
            let (answer, took) = decide(seed, &id, d.attempt(), receipts);
            {
                let mut model = model.lock().unwrap();
                model.invocations += 1;
                let label = match &answer {
                    Answer::Outcome(outcome) => outcome.label(),
                    Answer::Panic => "panic",
                };
                let line = format!("call {w} {id} attempt={} -> {label}", d.attempt());
                model.event(Instant::now(), start, line);
                if let Some(violation) = model.called(process, &d, &id) {
                    model.event(Instant::now(), start, format!("VIOLATION {violation}"));
                    model.violations.push(violation);
                }
                if matches!(answer, Answer::Outcome(Outcome::Hold(_))) {
                    model.held.insert(id);
                }
            }
            async move {
                tokio::time::sleep(took).await;
                match answer {
                    Answer::Outcome(outcome) => outcome,
                    Answer::Panic => panic!("simulated handler panic"),
                }
            }
        };
        let settled = self.model.clone();
        let mut builder = Consumer::paged(Arc::new(self.api.clone()), "sim", handler)
            .worker_id(&worker)
            .lanes(self.lanes)
            .poll_interval(Duration::from_millis(200))
            .checkpoint_interval(Duration::from_millis(100))
            .hold_poll_interval(Duration::from_millis(300))
            .lease_settings(
                LeaseSettings::default()
                    .lease_duration(Duration::from_secs(2))
                    .scan_interval(Duration::from_millis(200)),
            )
            .lease_store(Arc::new(self.store.clone()))
            .delivery_hooks(move |d: &Delivery, how: &Settled| {
                let id = event_name(d);
                let mut model = settled.lock().unwrap();
                if *how == Settled::Spent {
                    // Seed 003, rule 1: a paged event never settles without a durable outcome.
                    let violation = format!("{id} settled as spent, with no durable outcome");
                    model.event(Instant::now(), start, format!("VIOLATION {violation}"));
                    model.violations.push(violation);
                }
                model.settled.insert(id.clone());
                model.event(Instant::now(), start, format!("settled {id} {how:?}"));
            });
        if let Some(ledger) = &self.ledger {
            builder = builder.receipts(Arc::new(ledger.clone()));
            // With a ledger, a cap and a handler timeout (some handlers take up to 40 ms) may end
            // an event's attempts: it is quarantined by receipt. Without one, a failing event
            // runs again until it succeeds.
            if self.capped {
                builder = builder.max_attempts(NonZeroU32::new(3).unwrap());
            }
            if self.timeout {
                builder = builder.handler_timeout(Duration::from_millis(30));
            }
        }
        match builder.build().expect("settings").run().await {
            Ok(running) => {
                self.event(format!("start {worker}"));
                self.workers[n] = Some(running);
            }
            Err(e) => self.event(format!("start {worker} failed: {e}")),
        }
    }

    /// The operator settles held receipts: in the chaos phase it quarantines or releases one at
    /// random; in the quiet phase (`all`) it quarantines every one.
    async fn operator(&mut self, all: bool) {
        let Some(ledger) = self.ledger.clone() else {
            return;
        };
        for receipt in ledger.receipts() {
            if !matches!(receipt.disposition, Disposition::Held(_)) {
                continue;
            }
            if all || self.rng.random_bool(0.5) {
                let answer = ledger
                    .record(
                        &receipt.event,
                        &Disposition::Quarantined("operator".into()),
                        "operator",
                    )
                    .await;
                self.event(format!(
                    "operator quarantines {} -> {}",
                    receipt.event,
                    answer.is_ok()
                ));
            } else {
                let answer = ledger.release(&receipt.event).await;
                self.event(format!("operator releases {} -> {answer:?}", receipt.event));
            }
            if !all {
                return;
            }
        }
    }

    fn script(&mut self) -> Script {
        match self.rng.random_range(0..6) {
            0 => Script::ReplayPrevious,
            1 => Script::Overlap(self.rng.random_range(1..=3)),
            2 => Script::EmptyAdvancing,
            3 => Script::Unchanged,
            4 => Script::LoseResponse,
            _ => Script::Throttle,
        }
    }

    /// Whether every event has settled and every partition's applied position is its last (by
    /// timestamp: every group the contract can prove complete is closed).
    fn done(&self) -> bool {
        let rows = self.store.snapshot();
        let model = self.model.lock().unwrap();
        if let Some(finality) = self.by_time {
            return self.partitions.iter().all(|partition| {
                let events = self.api.events(partition);
                let mut times: Vec<i64> = events
                    .iter()
                    .filter_map(|e| e.timestamp.map(millis))
                    .collect();
                times.sort_unstable();
                times.dedup();
                // A later timestamp proves only the groups before the newest.
                let provable = match finality {
                    Finality::LaterTimestamp => times.iter().rev().nth(1).copied(),
                    _ => times.last().copied(),
                };
                let closed = rows
                    .iter()
                    .find(|r| r.stream == SOURCE && &r.shard_id == partition)
                    .and_then(|r| r.progress.clone())
                    .and_then(|p| p.closed_through);
                closed >= provable && events.iter().all(|e| model.settled.contains(&e.id))
            });
        }
        self.partitions.iter().all(|partition| {
            let events = self.api.events(partition);
            let last = events.last().map(|e| e.position);
            let applied = rows
                .iter()
                .find(|r| r.stream == SOURCE && &r.shard_id == partition)
                .and_then(|r| r.progress.clone())
                .and_then(|p| p.applied_position)
                .and_then(|a| a.as_u64());
            applied == last && events.iter().all(|e| model.settled.contains(&e.id))
        })
    }

    async fn run(mut self) -> SeedResult {
        if self.rng.random_bool(0.5) {
            let faults = Faults::default()
                .error(0.03)
                .lost_answer(0.02)
                .timeout(0.01, Duration::from_millis(500));
            self.store.inject(self.seed, faults);
            if let Some(ledger) = &self.ledger {
                ledger.inject(self.seed ^ 1, faults);
            }
            self.event("faults on".into());
        }
        let chaos_end = Instant::now() + CHAOS;
        while Instant::now() < chaos_end {
            let n = self.rng.random_range(0..self.workers.len());
            let partition =
                self.partitions[self.rng.random_range(0..self.partitions.len())].clone();
            match self.rng.random_range(0..1000) {
                0..=39 if self.workers[n].is_none() => self.start_worker(n).await,
                40..=49 => {
                    if let Some(running) = self.workers[n].take() {
                        self.event(format!("crash w{n}"));
                        running.abort();
                    }
                }
                50..=57 => {
                    if let Some(running) = self.workers[n].take() {
                        self.event(format!("stop w{n}"));
                        running.shutdown(Duration::from_secs(1)).await;
                    }
                }
                58..=60 => {
                    let source: &dyn PagedSource = &self.api;
                    let moved =
                        shardwise::seek::seek_paged(&self.store, source, &SeekTarget::TrimHorizon)
                            .await;
                    self.event(format!("seek -> {:?}", moved.map(|r| r.moved)));
                }
                61..=160 => {
                    let id = self.put(&partition);
                    self.event(format!("put {id}"));
                }
                161..=220 => {
                    let script = self.script();
                    self.event(format!("script {partition} {script:?}"));
                    self.api.script(&partition, script);
                }
                221..=240 => self.operator(false).await,
                _ => {}
            }
            self.watermarks();
            tokio::time::sleep(STEP).await;
        }

        // Quiet: no faults, holds quarantined, a worker up, until everything is settled. The
        // scripts still queued go too: a reader backs off to its idle bound (30 s) after each
        // empty page, so ten queued empty pages would outlast the quiet phase.
        self.api.clear_scripts();
        self.store.inject(self.seed, Faults::none());
        if let Some(ledger) = &self.ledger {
            ledger.inject(self.seed ^ 1, Faults::none());
        }
        if self.workers.iter().all(Option::is_none) {
            self.start_worker(0).await;
        }
        let quiet_end = Instant::now() + QUIET;
        while !self.done() {
            if Instant::now() >= quiet_end {
                let unsettled: Vec<String> = {
                    let model = self.model.lock().unwrap();
                    self.partitions
                        .iter()
                        .flat_map(|p| self.api.events(p))
                        .filter(|e| !model.settled.contains(&e.id))
                        .map(|e| e.id)
                        .collect()
                };
                let rows: Vec<String> = self
                    .store
                    .snapshot()
                    .iter()
                    .map(|r| format!("{} owner={:?} {:?}", r.shard_id, r.owner, r.progress))
                    .collect();
                let what = format!(
                    "not done after the quiet phase: unsettled {:?}, rows {rows:?}",
                    &unsettled[..unsettled.len().min(5)]
                );
                self.event(format!("VIOLATION {what}"));
                self.model.lock().unwrap().violations.push(what);
                break;
            }
            self.operator(true).await;
            self.watermarks();
            tokio::time::sleep(STEP).await;
        }
        for running in self.workers.iter_mut().filter_map(Option::take) {
            running.shutdown(Duration::from_secs(2)).await;
        }
        // No effect twice: every counter at most 1, and exactly 1 for an applied receipt (read by
        // timestamp, an ack leaves an applied receipt too: then 1 only with an applied receipt).
        let acks_recorded = self.by_time.is_some();
        if let Some(ledger) = &self.ledger {
            let applied: BTreeSet<String> = ledger
                .receipts()
                .into_iter()
                .filter(|r| r.disposition == Disposition::Applied)
                .map(|r| r.event.as_str().rsplit('/').next().unwrap().to_string())
                .collect();
            for partition in &self.partitions {
                for event in self.api.events(partition) {
                    let count = ledger.number(COUNTS, &key("id", event.id.as_str()), "count");
                    let expected = applied.contains(&event.id).then_some(1);
                    let wrong = if acks_recorded {
                        count.is_some() && count != expected
                    } else {
                        count != expected
                    };
                    if wrong {
                        let what =
                            format!("{}: counter {count:?}, expected {expected:?}", event.id);
                        self.model.lock().unwrap().violations.push(what);
                    }
                }
            }
        }
        let model = std::mem::take(&mut *self.model.lock().unwrap());
        let mut hash = [0u8; 16];
        hash.copy_from_slice(&model.hasher.finalize());
        SeedResult {
            seed: self.seed,
            hash,
            violations: model.violations,
            trace: model.tail,
            events: model.events,
            invocations: model.invocations,
        }
    }
}

pub fn base_ms() -> i64 {
    millis(crate::world::base())
}

/// An event's ordering key: one of `keys`, or for a quarter of the events none.
fn pick_key(rng: &mut StdRng, keys: u32) -> Option<String> {
    rng.random_bool(0.75)
        .then(|| format!("k{}", rng.random_range(0..keys)))
}

/// Appends an event to `partition` at its next position, stamped `at` (ms); its identity is
/// `PARTITION-POSITION` unless given.
fn append(
    api: &EventApi,
    partition: &str,
    id: Option<String>,
    at: i64,
    key: Option<String>,
) -> String {
    let position = api.events(partition).last().map_or(1, |e| e.position + 1);
    let id = id.unwrap_or_else(|| format!("{partition}-{position}"));
    api.append(
        partition,
        ScriptedEvent {
            id: id.clone(),
            position,
            payload: "e".into(),
            timestamp: Some(std::time::UNIX_EPOCH + Duration::from_millis(at as u64)),
            key,
        },
    );
    id
}

/// Puts the next event of `partition`, `elapsed` ms into the run, for a source read by cursor;
/// returns its id (`p0-7`).
fn push(api: &EventApi, partition: &str, elapsed: i64, key: Option<String>) -> String {
    append(api, partition, None, base_ms() + elapsed, key)
}

/// Puts the next event of `partition` at a time the finality contract allows, `elapsed` ms into
/// the run; returns its id (`p0-7`). A later-timestamp source never goes back (ties are common);
/// the others take events up to a second late.
fn push_at(
    api: &EventApi,
    last: &mut std::collections::BTreeMap<String, (i64, u64)>,
    rng: &mut StdRng,
    finality: Finality,
    partition: &str,
    elapsed: i64,
    key: Option<String>,
) -> String {
    let now = base_ms() + elapsed;
    let (latest, count) = last.get(partition).copied().unwrap_or((now - 1_000, 0));
    let at = match finality {
        Finality::LaterTimestamp => latest.max(now - rng.random_range(0..500)),
        _ => now - rng.random_range(0..1_000),
    };
    let id = append(
        api,
        partition,
        Some(format!("{partition}-{}", count + 1)),
        at,
        key,
    );
    last.insert(partition.to_string(), (latest.max(at), count + 1));
    id
}

/// The event's identity in the source (`p0-7`).
fn event_name(d: &Delivery) -> String {
    d.paged_event_id().unwrap_or_default().to_string()
}

/// Runs one paged seed.
pub fn run_seed(seed: u64) -> SeedResult {
    // Made inside the runtime: its start is the paused clock's, not the host's a moment before
    // the runtime existed (under load that moment was 1.4 s, and the seed's trace moved with it).
    crate::world::run_paused(seed, async move { World::new(seed).run().await })
}
