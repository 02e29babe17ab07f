//! A long seed: seven simulated days of one log group, read by the real `paged::CloudWatchLogs`
//! source (GetLogEvents) through the real SDK client from the simulated service (`sim/logs.rs`),
//! with the real consumer and the memory lease store under paused time.
//!
//! The seed lays out the week as phases: bursts of `PutLogEvents` batches into the group's streams,
//! quiet hours and quiet days, outages of the whole fleet (up to 30 hours, one in four 2 to 4
//! days: the fleet comes back among events the group's retention is deleting), workers that crash,
//! stop and start, streams created and deleted (half of those deleted created again at once under
//! their name), Lambda's pattern (a burst starts one to three new streams one time in two, and
//! four puts in five go to the three newest streams, so older ones fall silent for hours or for
//! good, retire, and now and then take an event again and wake; DescribeLogStreams shows an
//! ingestion in `lastIngestionTime` up to 30 minutes late; in one seed in three GetLogEvents
//! returns a batch up to 1 to 10 minutes after its ingestion, a stream's batches in the order
//! they were ingested), late batches in bursts (one in 40, 1 to 50 minutes late) and on their
//! own (timestamps up to 13 days
//! old), account-wide throttling that lasts minutes, and lease-table throttling (all of it, half
//! its calls, or the roster item) for 2 to 20 minutes. The service's tokens expire after 24
//! hours, pages stop at 10,000 events or 1 MB, and GetLogEvents is throttled past 25 requests/s.
//! Every worker runs on a host of its own whose wall clock is up to 9 s ahead or behind the
//! service's, in one seed in three up to 5 minutes, and drifts up to 10 ppm (`testing::HostClock`). Each line logged is its own (a
//! random id); a third of a batch's lines after its first share the millisecond before them, so
//! groups of one timestamp and ingestion time are common, and one batch in ten repeats a line
//! exactly in one millisecond.
//!
//! In half the seeds the handler applies an effect per event (a counter, committed with the
//! event's receipt in `MemoryReceipts`), the group keeps events 1 or 3 days (each deleted at
//! its own time up to 72 hours later), and TTL deletes each receipt within 48 hours after it
//! expired. The ledger keeps receipts as long as the group keeps events, or, in a quarter of
//! those seeds, shorter (1, 6 or 24 hours: an operator's mistake, which the consumer must
//! refuse; the world then keeps them as long). Outages begin while events come, so some are
//! applied and not yet checkpointed when the fleet goes down for up to 30 hours.
//!
//! Checked at every write of the lease store: a stream's applied position never goes down, and
//! every event at or below it, bar late ones (found by the source's audit later), has settled.
//! At the end, after a quiet phase of two hours with a worker up, every event of every stream
//! that still exists has settled, late ones within the audit's window (1 hour) included, bar
//! those the group's retention deleted first; and no event's effect was applied twice. Late
//! events later than the window are counted and reported beside the seed's result, and so are
//! exact repeats a deletion of a twin left ambiguous (GetLogEvents cannot tell them apart: the
//! source's declared limit, docs/paged.md), which are not owed under their own names.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_dynamodb::types::AttributeValue;
use md5::{Digest, Md5};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shardwise::consumer::Settled;
use shardwise::lease::{Change, LeaseSettings, MemoryLeaseStore};
use shardwise::paged::{
    CloudWatchLogs, CloudWatchLogsFilter, FILTER_CLOSE_HORIZON, FILTER_LATENESS, LATE_EVENT_WINDOW,
    PagePosition, PagedSource,
};
use shardwise::receipts::{Effect, MemoryReceipts, key};
use shardwise::testing::{HostClock, Layered, on_host};
use shardwise::{Consumer, Delivery, Outcome, Running};
use tokio::time::Instant;

use crate::logs::{LogEvent, LogsService};
use crate::model::EventLog;
use crate::watchdog::Watchdog;
use crate::world::SeedResult;

const GROUP: &str = "/sim/app";
const HOUR: u64 = 3_600;
/// How long a long seed runs before its quiet phase: a week (`SHARDWISE_SIM_DAYS` days).
fn week() -> Duration {
    let days = std::env::var("SHARDWISE_SIM_DAYS")
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(7);
    Duration::from_secs(days * 24 * HOUR)
}
/// How long the quiet phase may take.
const QUIET: Duration = Duration::from_secs(2 * HOUR);

/// What the checks see.
#[derive(Default)]
struct Model {
    /// Settled events, `stream/id`.
    settled: BTreeSet<String>,
    /// Events put behind one already stored with a later place: `stream/id`.
    late: BTreeSet<String>,
    /// Of those, the ones later than the source's late-event window: not looked for.
    too_late: BTreeSet<String>,
    /// Every event put, by stream (the service deletes a stream's events with it).
    put: BTreeMap<String, Vec<LogEvent>>,
    /// The furthest place of an event put, by stream.
    furthest: BTreeMap<String, PagePosition>,
    violations: Vec<String>,
    log: EventLog,
    invocations: u64,
    /// Poison events: when the handler first met each (`stream/id`, or the `eventId`).
    poisoned: BTreeMap<String, Instant>,
    /// Events the service deleted for the group's retention (`stream/id`): not owed.
    deleted: Arc<Mutex<BTreeSet<String>>>,
    /// The group is read by timestamp (`CloudWatchLogsFilter`): events are named by their
    /// `eventId`, and the checkpoint is `closedThrough`.
    by_time: bool,
}

impl Model {
    fn event(&mut self, at: Instant, start: Instant, what: String) {
        self.log.push((at - start).as_millis() as u64, what);
    }

    fn violation(&mut self, at: Instant, start: Instant, what: String) {
        self.event(at, start, format!("VIOLATION {what}"));
        self.violations.push(what);
    }

    /// The name the source gives an event, as the delivery hook reports it.
    fn name(&self, stream: &str, event: &LogEvent) -> String {
        if self.by_time {
            event.event_id.clone()
        } else {
            format!("{stream}/{}", event.id)
        }
    }

    /// Whether `event` of `stream` is an exact repeat (the same timestamp, ingestion time and
    /// message as another event of the stream) one of whose twins the group's retention
    /// deleted. GetLogEvents gives nothing else to tell them apart: the source names repeats by
    /// their order, and may hand this one out under the deleted twin's name. Its declared limit
    /// (docs/paged.md), counted at the end, not a violation.
    fn renamed_repeat(&self, stream: &str, event: &LogEvent) -> bool {
        if self.by_time {
            return false;
        }
        let deleted = self.deleted.lock().unwrap();
        self.put.get(stream).is_some_and(|events| {
            // The group first: the end of a failed seed asks this of every unsettled event.
            events.iter().any(|e| {
                (e.timestamp, e.ingestion) == (event.timestamp, event.ingestion)
                    && e.id != event.id
                    && e.message == event.message
                    && deleted.contains(&format!("{stream}/{}", e.id))
            })
        })
    }

    /// Whether `name` is owed: not settled, not late (the audit finds it later, or it is
    /// outside the contract), not deleted by the group's retention.
    fn owed(&self, name: &str) -> bool {
        !self.settled.contains(name)
            && !self.late.contains(name)
            && !self.deleted.lock().unwrap().contains(name)
    }

    /// A write of the lease store, checked. (Only the events a move of the applied position
    /// passes: the ones below it were checked when it passed them.)
    fn change(&self, change: &Change) -> Option<String> {
        if self.by_time {
            return self.closed(change);
        }
        let after = change.after.as_ref()?;
        let applied = after.progress.as_ref()?.applied_position.clone()?;
        let before = change
            .before
            .as_ref()
            .and_then(|b| b.progress.as_ref()?.applied_position.clone());
        if before.as_ref() == Some(&applied) {
            return None;
        }
        if change.operation != "seek"
            && let Some(before) = &before
            && applied < *before
        {
            return Some(format!(
                "{}: applied position went down from {before} to {applied} ({})",
                after.shard_id, change.operation
            ));
        }
        let stream = &after.shard_id;
        for event in self.put.get(stream).into_iter().flatten() {
            let at = &event.position;
            if *at > applied || before.as_ref().is_some_and(|b| at <= b) {
                continue;
            }
            let name = self.name(stream, event);
            if self.owed(&name) && !self.renamed_repeat(stream, event) {
                return Some(format!(
                    "{stream}: applied position {applied} passes {}, which has not settled ({})",
                    event.id, change.operation
                ));
            }
        }
        None
    }
}

impl Model {
    /// A write of the lease store by the source read by timestamp, checked: `closedThrough`
    /// never goes down (bar a seek), and every event stamped at or before it has settled, bar
    /// late ones and deleted ones.
    fn closed(&self, change: &Change) -> Option<String> {
        let after = change.after.as_ref()?;
        let closed = after.progress.as_ref()?.closed_through?;
        let before = change
            .before
            .as_ref()
            .and_then(|b| b.progress.as_ref()?.closed_through);
        if before == Some(closed) {
            return None;
        }
        if change.operation != "seek"
            && let Some(before) = before
            && closed < before
        {
            return Some(format!(
                "closedThrough went down from {before} to {closed} ({})",
                change.operation
            ));
        }
        for (stream, events) in &self.put {
            for event in events {
                if event.timestamp > closed || before.is_some_and(|b| event.timestamp <= b) {
                    continue;
                }
                let name = self.name(stream, event);
                if self.owed(&name) {
                    return Some(format!(
                        "closedThrough {closed} passes {name} ({stream}, stamped {}), which has not settled ({})",
                        event.timestamp, change.operation
                    ));
                }
            }
        }
        None
    }
}

struct World {
    seed: u64,
    rng: StdRng,
    service: LogsService,
    store: Arc<Layered<Watchdog>>,
    model: Arc<Mutex<Model>>,
    start: Instant,
    workers: Vec<Option<Running>>,
    lanes: usize,
    poll: Duration,
    streams: u32,
    /// Each worker's host clock: ms ahead of the service's (behind when negative), drift in ppm.
    clocks: Vec<(i64, i64)>,
    /// The lease store under the watchdog, for its faults and limits.
    memory: MemoryLeaseStore,
    /// In half the seeds the handler applies an effect per event with a receipt, the group has
    /// a retention and the ledger's receipts are deleted by TTL.
    ledger: Option<Ledger>,
    /// Whether a deleted stream is created again under its name at once (half of them), drawn
    /// apart from the other decisions.
    again: StdRng,
    /// Lambda's pattern, drawn apart: a burst starts a new stream (an execution environment) one
    /// time in two, and a put goes to one of the three newest streams four times in five, so
    /// older streams fall silent for hours or for good (and retire), and now and then take an
    /// event again (and wake).
    lambda: StdRng,
    /// In one seed in three GetLogEvents returns a batch only minutes after its ingestion (a
    /// stream's batches in the order they were ingested): the pipeline's delay, redrawn one put
    /// in twenty up to this (1 to 10 minutes), drawn apart.
    readable: StdRng,
    slow: Option<u64>,
}

/// The receipt ledger of a seed with effects.
struct Ledger {
    receipts: MemoryReceipts,
    /// The group's retention, in days.
    days: i64,
    /// How long receipts are kept: as long as the group keeps events, or (a quarter of these
    /// seeds) an operator's mistake, shorter, which the consumer must refuse.
    kept: Duration,
}

impl Ledger {
    /// The least a receipt must be kept: the retention, CloudWatch Logs' deletion delay, and
    /// the 2 hours a timestamp may lie ahead (what the source reports).
    fn enough(&self) -> Duration {
        Duration::from_secs(self.days as u64 * 24 * HOUR + 74 * HOUR)
    }
}

const COUNTS: &str = "counts";

impl World {
    fn new(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x1009_0007);
        let start = Instant::now();
        let service = LogsService::new(GROUP, crate::paged::base_ms());
        // Drawn apart, so that the seeds without effects keep their worlds.
        let mut choose = StdRng::seed_from_u64(seed ^ 0x7ec1_9715);
        let ledger = choose.random_bool(0.5).then(|| {
            let days = [1, 3][choose.random_range(0..2)];
            service.set_retention(days);
            let mut ledger = Ledger {
                receipts: MemoryReceipts::new().table(COUNTS, &["id"]),
                days,
                kept: Duration::ZERO,
            };
            ledger.kept = if choose.random_ratio(1, 4) {
                Duration::from_secs([1, 6, 24][choose.random_range(0..3)] * HOUR)
            } else {
                ledger.enough()
            };
            ledger.receipts = ledger.receipts.clone().retention(ledger.kept, seed);
            ledger
        });
        // A third of the seeds read the group by timestamp (FilterLogEvents).
        let by_time = StdRng::seed_from_u64(seed ^ 0xf11e_7e75).random_ratio(1, 3);
        let store = MemoryLeaseStore::new();
        store.service_limits();
        let memory = store.clone();
        let model = Arc::new(Mutex::new(Model {
            deleted: service.deleted(),
            by_time,
            ..Model::default()
        }));
        let observer = model.clone();
        store.observe(Arc::new(move |change: &Change| {
            let mut model = observer.lock().unwrap();
            let now = Instant::now();
            if let Some(violation) = model.change(change) {
                model.violation(now, start, violation);
            }
            if let Some(after) = &change.after {
                let applied = after
                    .progress
                    .as_ref()
                    .and_then(|p| p.applied_position.clone());
                let line = format!(
                    "store {} {} owner={:?} applied={applied:?}",
                    change.operation, after.shard_id, after.owner
                );
                model.event(now, start, line);
            }
        }));
        let report = model.clone();
        let watchdog = Watchdog::new(start, move |at, what| {
            report.lock().unwrap().violation(at, start, what);
        });
        let store = Arc::new(Layered::new(Arc::new(store), watchdog));
        let workers = rng.random_range(1..=3);
        // In one seed in three the hosts are minutes off the service's clock (up to 5 minutes
        // ahead or behind), drawn apart from the other decisions so the other seeds stay as they
        // were.
        let mut far = StdRng::seed_from_u64(seed ^ 0x0c10_c4ed);
        let minutes_off = far.random_bool(1.0 / 3.0);
        let clocks = (0..workers)
            .map(|_| {
                let near = (rng.random_range(-9_000..=9_000), rng.random_range(-10..=10));
                if minutes_off {
                    (far.random_range(-300_000..=300_000), near.1)
                } else {
                    near
                }
            })
            .collect();
        let mut world = Self {
            seed,
            lanes: rng.random_range(1..=4),
            poll: Duration::from_secs(rng.random_range(2..=30)),
            rng,
            service,
            store,
            model,
            start,
            workers: (0..workers).map(|_| None).collect(),
            streams: 0,
            clocks,
            memory,
            ledger,
            again: StdRng::seed_from_u64(seed ^ 0x0a9a_1e5e),
            lambda: StdRng::seed_from_u64(seed ^ 0x1a3b_dae0),
            readable: StdRng::seed_from_u64(seed ^ 0x0de1_a4ed),
            slow: None,
        };
        if world.readable.random_bool(1.0 / 3.0) {
            world.slow = Some(world.readable.random_range(60_000..=600_000));
        }
        // DescribeLogStreams shows an ingestion in `lastIngestionTime` up to 30 minutes late
        // (AWS: "typically in less than an hour"): what wakes a retired stream.
        let lag = world.lambda.random_range(0..=1_800);
        world.service.set_activity_lag(Duration::from_secs(lag));
        for _ in 0..world.rng.random_range(1..=3) {
            world.create_stream();
        }
        world
    }

    fn event(&self, what: String) {
        self.model
            .lock()
            .unwrap()
            .event(Instant::now(), self.start, what);
    }

    fn create_stream(&mut self) {
        let name = format!("s{}", self.streams);
        self.streams += 1;
        self.service.create_stream(&name);
        self.event(format!("create {name}"));
    }

    /// Puts a batch of 1 to 5 events into a random stream; `late` ms before now when given.
    fn put(&mut self, late: Option<i64>) {
        let streams = self.service.streams();
        if streams.is_empty() {
            return;
        }
        let pick = self.rng.random_range(0..streams.len());
        // Mostly one of the newest streams (by creation), as an application's busy
        // environments; the draw of `rng` is kept, so the rest of the seed stays.
        let stream = if self.lambda.random_ratio(4, 5) {
            let newest = self.service.newest_streams(3);
            newest[self.lambda.random_range(0..newest.len())].clone()
        } else {
            streams[pick].clone()
        };
        let now = self.service.now();
        let newest = late.map_or(now, |l| now - l);
        let mut previous: Option<i64> = None;
        let mut batch: Vec<(i64, String)> = (0..self.rng.random_range(1..=5))
            .map(|_| {
                // A third of the lines after the first share the millisecond before them (a
                // burst logged at once): groups of one timestamp and ingestion time.
                let t = match previous {
                    Some(t) if self.rng.random_ratio(1, 3) => t,
                    _ => newest - self.rng.random_range(0..2_000),
                };
                previous = Some(t);
                // One event in twenty is large: pages also end at 1 MB.
                let size = if self.rng.random_ratio(1, 20) {
                    30_000
                } else {
                    200
                };
                // A line of its own (a request id, a counter), as most log lines are.
                let line = format!("{:016x} ", self.rng.random::<u64>());
                let pad = "x".repeat(size - line.len());
                (t, line + &pad)
            })
            .collect();
        // One batch in ten repeats a line exactly, in the same millisecond: a group with
        // exact repeats, told apart only by their order.
        if self.rng.random_ratio(1, 10) {
            let again = batch[self.rng.random_range(0..batch.len())].clone();
            for _ in 0..self.rng.random_range(1..=2) {
                batch.push(again.clone());
            }
        }
        batch.sort_by_key(|(t, _)| *t);
        if let Some(slow) = self.slow
            && self.readable.random_ratio(1, 20)
        {
            let delay = self.readable.random_range(0..=slow);
            self.service
                .set_readability_delay(Duration::from_millis(delay));
            // Read by timestamp: the group's search index lags as much, in order.
            self.service.set_search_lag(Duration::from_millis(delay));
            self.event(format!("readable {delay} ms after ingestion"));
        }
        let delay = Duration::from_millis(self.rng.random_range(200..120_000));
        let Some(stored) = self.service.put(&stream, &batch, delay) else {
            self.event(format!("put {stream} refused"));
            return;
        };
        let mut guard = self.model.lock().unwrap();
        let model = &mut *guard;
        let line = format!(
            "put {stream} {:?}{}",
            stored.iter().map(|e| e.id.as_str()).collect::<Vec<_>>(),
            if late.is_some() { " late" } else { "" }
        );
        model.event(Instant::now(), self.start, line);
        if model.by_time {
            // Read by timestamp, an event is late when it was put late: the forward poll closes
            // its time before it is searchable. The audit looks back an hour (its lateness);
            // later than that is outside the contract.
            for event in &stored {
                // Or when the group's index lags past the close horizon: the forward poll may
                // close its time before it is searchable.
                let unsearchable =
                    event.searchable - event.timestamp > FILTER_CLOSE_HORIZON.as_millis() as i64;
                if late.is_some() || unsearchable {
                    model.late.insert(event.event_id.clone());
                    if event.ingestion - event.timestamp > FILTER_LATENESS.as_millis() as i64 {
                        model.too_late.insert(event.event_id.clone());
                    }
                }
            }
            model.put.entry(stream.clone()).or_default().extend(stored);
            return;
        }
        let events = model.put.entry(stream.clone()).or_default();
        for event in stored {
            // Behind an event already stored: a forward token issued past that one never returns
            // it (it may still be read, if no reader has passed that place yet).
            let furthest = model
                .furthest
                .entry(stream.clone())
                .or_insert_with(|| PagePosition::from_bytes(Vec::new()));
            // By group (timestamp and ingestion time): a group's events are placed by name.
            let group = PagePosition::from_parts(&[event.timestamp as u64, event.ingestion as u64]);
            if group < *furthest {
                let name = format!("{stream}/{}", event.id);
                if event.ingestion - event.timestamp > LATE_EVENT_WINDOW.as_millis() as i64 {
                    model.too_late.insert(name.clone());
                }
                model.late.insert(name);
            } else {
                *furthest = group;
            }
            events.push(event);
        }
    }

    async fn start_worker(&mut self, n: usize) {
        let worker = format!("w{n}");
        let (model, start, seed) = (self.model.clone(), self.start, self.seed);
        let effects = self.ledger.is_some();
        let w = worker.clone();
        let by_time = self.model.lock().unwrap().by_time;
        let name_of = move |d: &Delivery| {
            let id = d.paged_event_id().unwrap_or_default();
            if by_time {
                id.to_string()
            } else {
                format!("{}/{id}", d.shard())
            }
        };
        let end = self.start + week();
        let handler = move |d: Delivery| {
            let name = name_of(&d);
            let mut h = Md5::new();
            h.update(seed.to_le_bytes());
            h.update(name.as_bytes());
            let event = h.clone().finalize();
            h.update(d.attempt().to_le_bytes());
            let roll = h.finalize();
            // One event in 2,000 is poison: the handler cannot take it until a fix is deployed
            // 1 to 4 days after it first failed (over a weekend), by the week's end at the
            // latest. It asks to run again in 10 minutes meanwhile, holding its stream's applied
            // position (a failure blocks the barrier), while the group's retention may delete
            // the events before it.
            let poison = (u16::from_le_bytes([event[0], event[1]]) % 2_000 == 0).then(|| {
                let first = *model
                    .lock()
                    .unwrap()
                    .poisoned
                    .entry(name.clone())
                    .or_insert_with(Instant::now);
                let hold = Duration::from_secs(24 * HOUR + u64::from(event[2]) * 72 * HOUR / 256);
                (first + hold).min(end)
            });
            let outcome = if poison.is_some_and(|fixed| Instant::now() < fixed) {
                Outcome::RetryAfter(Duration::from_secs(600))
            } else if roll[0] % 100 < 5 && d.attempt() < 3 {
                Outcome::Retry
            } else if effects {
                Outcome::Apply(
                    Effect::update(COUNTS, key("id", name.as_str()))
                        .add("count", 1)
                        .into(),
                )
            } else {
                Outcome::Ack
            };
            let took = Duration::from_millis(u64::from(roll[1] % 50));
            {
                let mut model = model.lock().unwrap();
                model.invocations += 1;
                let line = format!(
                    "call {w} {name} attempt={} -> {}",
                    d.attempt(),
                    outcome.label()
                );
                model.event(Instant::now(), start, line);
            }
            async move {
                tokio::time::sleep(took).await;
                outcome
            }
        };
        let settled = self.model.clone();
        let source: Arc<dyn PagedSource> = if by_time {
            Arc::new(CloudWatchLogsFilter::new(self.service.client(), GROUP))
        } else {
            Arc::new(CloudWatchLogs::new(self.service.client(), GROUP))
        };
        let (offset, drift) = self.clocks[n];
        let mut consumer = Consumer::paged(source, "sim", handler)
            .worker_id(&worker)
            .lanes(self.lanes)
            .poll_interval(self.poll)
            .checkpoint_interval(Duration::from_secs(1))
            .lease_settings(
                LeaseSettings::default()
                    .lease_duration(Duration::from_secs(30))
                    .scan_interval(Duration::from_secs(10)),
            )
            .lease_store(self.store.clone())
            .delivery_hooks(move |d: &Delivery, how: &Settled| {
                let name = name_of(d);
                let mut model = settled.lock().unwrap();
                model.settled.insert(name.clone());
                model.event(Instant::now(), start, format!("settled {name} {how:?}"));
            });
        if let Some(ledger) = &self.ledger {
            consumer = consumer.receipts(Arc::new(ledger.receipts.clone()));
        }
        // A ledger kept shorter than a contract's own horizon is refused at build.
        let running = match consumer.build() {
            Ok(consumer) => on_host(HostClock::new(offset, drift), consumer.run()).await,
            Err(e) => Err(e.into()),
        };
        match running {
            Ok(running) => {
                self.event(format!("start {worker}"));
                self.workers[n] = Some(running);
            }
            Err(e) => {
                self.event(format!("start {worker} failed: {e}"));
                // Refused for a ledger kept shorter than the group keeps events: the operator
                // keeps receipts as long, and the worker is started again later.
                if let Some(ledger) = &mut self.ledger
                    && e.to_string().contains("receipt_retention")
                {
                    ledger.kept = ledger.enough();
                    ledger.receipts = ledger.receipts.clone().retention(ledger.kept, self.seed);
                    let line = format!("receipts kept {:?} now", ledger.kept);
                    self.event(line);
                }
            }
        }
    }

    async fn crash(&mut self, n: usize) {
        if let Some(running) = self.workers[n].take() {
            self.event(format!("crash w{n}"));
            running.abort();
        }
    }

    /// What remains owed: events of live streams that have not settled, bar late ones the
    /// audit does not look for (later than its window).
    fn unsettled(&self) -> Vec<String> {
        let live: BTreeSet<String> = self.service.streams().into_iter().collect();
        let model = self.model.lock().unwrap();
        model
            .put
            .iter()
            .filter(|(stream, _)| live.contains(*stream))
            .flat_map(|(stream, events)| events.iter().map(move |e| (stream, e)))
            .filter_map(|(stream, e)| {
                let name = model.name(stream, e);
                let owed = !model.settled.contains(&name)
                    && !model.too_late.contains(&name)
                    && !model.deleted.lock().unwrap().contains(&name);
                // (The scan for a deleted twin only for what is owed otherwise.)
                (owed && !model.renamed_repeat(stream, e)).then_some(name)
            })
            .collect()
    }

    async fn run(mut self) -> SeedResult {
        let clocks = format!("host clocks (ms ahead, ppm) {:?}", self.clocks);
        self.event(clocks);
        let by_time = self.model.lock().unwrap().by_time;
        self.event(
            if by_time {
                "read by timestamp (FilterLogEvents)"
            } else {
                "read stream by stream (GetLogEvents)"
            }
            .into(),
        );
        for n in 0..self.workers.len() {
            self.start_worker(n).await;
        }
        let end = self.start + week();
        while Instant::now() < end {
            match self.rng.random_range(0..100) {
                // A burst: a batch every 1 to 10 s for 2 to 30 minutes.
                0..=39 => {
                    let until =
                        Instant::now() + Duration::from_secs(self.rng.random_range(120..1_800));
                    self.event("burst".into());
                    if self.lambda.random_bool(0.5) {
                        for _ in 0..self.lambda.random_range(1..=3) {
                            self.create_stream();
                        }
                    }
                    while Instant::now() < until {
                        self.put(None);
                        // One batch in 40 of a burst is late by 1 to 50 minutes (a retried
                        // batch), drawn apart: late events while a stream is busy, and while its
                        // events take minutes to become readable.
                        if self.readable.random_ratio(1, 40) {
                            let late = self.readable.random_range(60_000..3_000_000);
                            self.put(Some(late));
                        }
                        let gap = Duration::from_secs(self.rng.random_range(1..=10));
                        tokio::time::sleep(gap).await;
                    }
                }
                // Quiet hours, or a quiet day and more.
                40..=59 => {
                    let hours = if self.rng.random_bool(0.3) {
                        self.rng.random_range(24..=30)
                    } else {
                        self.rng.random_range(1..=8)
                    };
                    self.event(format!("quiet {hours} h"));
                    tokio::time::sleep(Duration::from_secs(hours * HOUR)).await;
                }
                // The whole fleet down for 1 to 30 hours; one outage in four lasts 2 to 4 days
                // (a consumer switched off over a long weekend), and the fleet comes back to
                // streams whose oldest unread events the group's retention is deleting.
                60..=66 => {
                    let mut hours = self.rng.random_range(1..=30);
                    // Drawn apart, so that the seed's other draws stay.
                    let mut long = StdRng::seed_from_u64(
                        self.seed ^ 0x0ff_5173 ^ ((Instant::now() - self.start).as_secs() << 20),
                    );
                    if long.random_ratio(1, 4) {
                        hours = long.random_range(48..=96);
                    }
                    // It begins while events come: some handled and not yet checkpointed.
                    for _ in 0..self.rng.random_range(0..=20) {
                        self.put(None);
                        let gap = Duration::from_millis(self.rng.random_range(50..=500));
                        tokio::time::sleep(gap).await;
                    }
                    self.event(format!("outage {hours} h"));
                    for n in 0..self.workers.len() {
                        self.crash(n).await;
                    }
                    tokio::time::sleep(Duration::from_secs(hours * HOUR)).await;
                    for n in 0..self.workers.len() {
                        self.start_worker(n).await;
                    }
                }
                // Late events: timestamps a minute to an hour old (the audit's window), or up to
                // 13 days.
                67..=74 => {
                    let late = if self.rng.random_bool(0.5) {
                        self.rng.random_range(60_000..HOUR as i64 * 1_000 - 60_000)
                    } else {
                        self.rng.random_range(60_000..13 * 24 * HOUR as i64 * 1_000)
                    };
                    self.put(Some(late));
                }
                // A worker crashes, stops, or starts.
                75..=84 => {
                    let n = self.rng.random_range(0..self.workers.len());
                    if self.workers[n].is_none() {
                        self.start_worker(n).await;
                    } else if self.rng.random_bool(0.5) {
                        self.crash(n).await;
                    } else if let Some(running) = self.workers[n].take() {
                        self.event(format!("stop w{n}"));
                        running.shutdown(Duration::from_secs(5)).await;
                    }
                }
                85..=89 => self.create_stream(),
                90..=91 => {
                    let streams = self.service.streams();
                    if streams.len() > 1 {
                        let stream = streams[self.rng.random_range(0..streams.len())].clone();
                        let gone = self.service.delete_stream(&stream);
                        self.event(format!("delete {stream} ({} events)", gone.len()));
                        // Gone with the stream: no longer owed.
                        let deleted = self.service.deleted();
                        let mut deleted = deleted.lock().unwrap();
                        for event in gone {
                            deleted.insert(format!("{stream}/{}", event.id));
                            deleted.insert(event.event_id);
                        }
                        drop(deleted);
                        // Half the time a stream of its name is created again at once: another
                        // stream, which its readers must read from its first event.
                        if self.again.random_bool(0.5) {
                            self.service.create_stream(&stream);
                            self.event(format!("create {stream} again"));
                        }
                    }
                }
                // The lease table throttled for 2 to 20 minutes.
                92..=94 => {
                    let stream = format!("logs:{GROUP}");
                    let line = crate::long_stream::lease_trouble(
                        &mut self.rng,
                        &self.memory,
                        &stream,
                        self.seed,
                    )
                    .await;
                    self.event(line);
                }
                // Account-wide throttling for 2 to 20 minutes.
                _ => {
                    let minutes = self.rng.random_range(2..=20);
                    self.event(format!("throttled {minutes} min"));
                    self.service
                        .throttle_until(self.service.now() + minutes as i64 * 60_000);
                }
            }
            tokio::time::sleep(Duration::from_secs(self.rng.random_range(1..=60))).await;
        }

        // Quiet: a worker up, no throttling, until everything owed has settled.
        self.service.throttle_until(0);
        if self.workers.iter().all(Option::is_none) {
            self.start_worker(0).await;
        }
        let quiet_end = Instant::now() + QUIET;
        loop {
            let owed = self.unsettled();
            if owed.is_empty() {
                break;
            }
            if Instant::now() >= quiet_end {
                let what = format!(
                    "not done two hours after the week: {} events unsettled, first {:?}",
                    owed.len(),
                    &owed[..owed.len().min(5)]
                );
                let mut model = self.model.lock().unwrap();
                model.violation(Instant::now(), self.start, what);
                break;
            }
            tokio::time::sleep(Duration::from_secs(10)).await;
        }
        for running in self.workers.iter_mut().filter_map(Option::take) {
            running.shutdown(Duration::from_secs(5)).await;
        }
        let counts = self.service.counts();
        self.service.sweep();
        let ledger = self.ledger.as_ref().map(|ledger| {
            // No effect applied twice: every event's counter is at most 1.
            let mut model = self.model.lock().unwrap();
            for item in ledger.receipts.items(COUNTS) {
                let (Some(AttributeValue::S(id)), Some(AttributeValue::N(count))) =
                    (item.get("id"), item.get("count"))
                else {
                    continue;
                };
                if count != "1" {
                    let what = format!("the effect of {id} was applied {count} times");
                    model.violation(Instant::now(), self.start, what);
                }
            }
            format!(
                "; group keeps {} d, receipts kept {:?}, {} receipts deleted by TTL, {} events deleted by the group's retention",
                ledger.days,
                ledger.kept,
                ledger.receipts.expired(),
                model.deleted.lock().unwrap().len()
            )
        });
        let mut model = std::mem::take(&mut *self.model.lock().unwrap());
        let late_unread = model
            .late
            .iter()
            .filter(|name| !model.settled.contains(*name))
            .count();
        // Exact repeats a deletion of a twin made ambiguous, and not settled under their own
        // names (the source's declared limit).
        let renamed = model
            .put
            .iter()
            .flat_map(|(stream, events)| events.iter().map(move |e| (stream, e)))
            .filter(|(stream, e)| {
                !model.settled.contains(&model.name(stream, e)) && model.renamed_repeat(stream, e)
            })
            .count();
        let summary = format!(
            "end: {} requests, {} throttled, {} expired tokens, {} late events ({} later than the window; {late_unread} never handed out), {renamed} exact repeats named as a deleted twin{}",
            counts.requests,
            counts.throttled,
            counts.expired_tokens,
            model.late.len(),
            model.too_late.len(),
            ledger.unwrap_or_default(),
        );
        model.event(Instant::now(), self.start, summary);
        SeedResult {
            seed: self.seed,
            hash: model.log.hash(),
            violations: model.violations,
            trace: model.log.tail(),
            events: model.log.count(),
            invocations: model.invocations,
        }
    }
}

/// Runs one long seed.
pub fn run_seed(seed: u64) -> SeedResult {
    // Made inside the runtime: its start is the paused clock's, not the host's a moment before
    // the runtime existed (under load that moment was 1.4 s, and the seed's trace moved with it).
    crate::world::run_paused(seed, async move { World::new(seed).run().await })
}
