//! A long Kinesis seed: a simulated day of one stream, read by the real consumer from the memory
//! stream with the service's limits and clocks on (`MemoryStream::service_limits`: iterators that
//! expire after 5 minutes, 5 GetRecords calls and 2 MiB per second per shard shared by every
//! reader, records trimmed after 24 hours), with the memory lease store under paused time.
//!
//! The seed lays out the day as phases: bursts of records, quiet hours, outages of the whole fleet
//! (up to 6 hours, inside the retention period), workers that crash, stop and start (a quarter
//! of the starts stopped again 0.1 to 5 s later, while their first requests for leases are
//! under way), a second
//! process with a worker's id for minutes to hours, splits and merges, and throttling of every
//! read that lasts minutes, and of the lease table (all of it, half its calls, or the roster item)
//! for 2 to 20 minutes; the lease store keeps DynamoDB's 1,000 writes a second per item; and a
//! worker's path to the lease table that turns slow (its next renewal applied and answered 2 to
//! 10 s late, or every call of 1 to 20 s applied at once and answered at the end, as a stalled
//! proxy does) and then breaks for 30 s to 3 minutes while it still reads the stream. A third of
//! the seeds start at the trim horizon, a third at a time
//! stamp, a third at LATEST (the day begins once every shard's start is pinned, with a burst; what
//! was put before the workers started is not owed).
//!
//! About three seeds in ten read with enhanced fan-out (`testing::Subscriptions` over the stream:
//! an event a second, subscriptions ended every 5 minutes and cut when the stream's iterator
//! expires, so a day holds hundreds of resubscriptions per shard).
//!
//! Every worker runs on a host of its own whose wall clock is up to 9 s ahead or behind the
//! stream's and drifts up to 10 ppm (0.9 s a day), the twin of worker 0 on another; the stream
//! keeps the true time (`testing::HostClock`).
//!
//! Checked at every write of the lease store: a shard's checkpoint never passes a record that has
//! not been handled (at `SHARD_END`, every record of the shard). Checked at every dispatch: a
//! lease another worker took as expired (without asking for it) sees no dispatch of its previous
//! owner after the take. Checked in every quiet phase, the lease duration plus two scan
//! intervals (50 s) after the last change: every readable lease (not ended, its parents ended) is
//! held by a running worker's process that took it under the row's epoch. At the end, after a
//! quiet hour
//! with a worker up, every record put has been handled (none was trimmed unread: no outage outlasts
//! the retention period).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use md5::{Digest, Md5};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shardwise::lease::LeaseStore;
use shardwise::lease::{Change, Checkpoint, InitialPosition, LeaseSettings, MemoryLeaseStore};
use shardwise::shard::fanout::{FanOut, FanOutRecords};
use shardwise::shard::source::RecordSource;
use shardwise::testing::{
    Call, Faults, HostClock, Layer, Layered, MemoryStream, Subscriptions, on_host,
};
use shardwise::{Consumer, Delivery, Outcome, Running, SequenceNumber};
use tokio::time::Instant;

use crate::model::EventLog;
use crate::watchdog::Watchdog;
use crate::world::SeedResult;

const STREAM: &str = "orders";
const HOUR: u64 = 3_600;
const DAY: Duration = Duration::from_secs(24 * HOUR);
const QUIET: Duration = Duration::from_secs(HOUR);
/// How long a lease may go unread after a change once the fleet is quiet: the lease duration
/// (30 s) plus two scan intervals (10 s).
const UNREAD_BOUND: Duration = Duration::from_secs(30 + 2 * 10);

#[derive(Default)]
struct Model {
    /// Records put: shard -> (sequence number, id).
    put: BTreeMap<String, Vec<(SequenceNumber, String)>>,
    handled: BTreeSet<String>,
    /// Records put before a LATEST start's workers began: not owed.
    before_start: BTreeSet<String>,
    violations: Vec<String>,
    log: EventLog,
    invocations: u64,
    /// When each (shard, owner epoch) was taken by another worker that had not asked for it:
    /// the lease had expired, so its owner must have stopped dispatching before (issue 27,
    /// defect 6).
    expired: BTreeMap<(String, u64), Instant>,
    /// Which process took each (shard, owner epoch) (lease hooks; a process is one consumer run:
    /// a restart or a twin under the same worker id is another).
    held_by: BTreeMap<(String, u64), u64>,
    /// When each (shard, owner epoch) was given up by its holder (lost, or let go when its hold
    /// ran out).
    given_up: BTreeMap<(String, u64), Instant>,
    /// Leases of processes that crashed or stopped before giving them up: not owed.
    left_behind: BTreeSet<(String, u64)>,
    /// Processes that crashed or stopped (a take of theirs still in flight may land after).
    down: BTreeSet<u64>,
}

impl Model {
    /// Process `process` stopped or crashed: what it still held is no longer its to give up.
    fn process_down(&mut self, process: u64) {
        self.down.insert(process);
        for (key, holder) in &self.held_by {
            if *holder == process && !self.given_up.contains_key(key) {
                self.left_behind.insert(key.clone());
            }
        }
    }

    /// `process` gave up the lease of `shard` it held under `epoch`: no later than another worker
    /// took it as expired (issue 27: a worker gives a lease up before anyone can judge it free).
    fn gave_up(&mut self, at: Instant, start: Instant, process: u64, shard: &str, epoch: u64) {
        let key = (shard.to_string(), epoch);
        self.event(
            at,
            start,
            format!("p{process} gave up {shard} epoch {epoch}"),
        );
        self.given_up.entry(key.clone()).or_insert(at);
        if let Some(taken) = self.expired.get(&key).copied()
            && self.held_by.get(&key) == Some(&process)
            && !self.left_behind.contains(&key)
            && at > taken
        {
            let what = format!(
                "p{process} gave up {shard} epoch {epoch} {} ms after another worker took it as expired",
                (at - taken).as_millis()
            );
            self.violation(at, start, what);
        }
    }

    /// Leases taken as expired whose holder, still running, never gave them up.
    fn never_given_up(&self) -> Vec<String> {
        self.expired
            .keys()
            .filter(|key| !self.given_up.contains_key(*key) && !self.left_behind.contains(*key))
            .filter_map(|key| {
                let holder = self.held_by.get(key)?;
                Some(format!("p{holder} never gave up {} epoch {}", key.0, key.1))
            })
            .collect()
    }

    fn event(&mut self, at: Instant, start: Instant, what: String) {
        self.log.push((at - start).as_millis() as u64, what);
    }

    fn violation(&mut self, at: Instant, start: Instant, what: String) {
        self.event(at, start, format!("VIOLATION {what}"));
        self.violations.push(what);
    }

    /// Notes a lease taken as expired (not asked for, from another worker).
    fn taken(&mut self, change: &Change, at: Instant) {
        if let (Some(before), Some(after)) = (&change.before, &change.after)
            && change.operation == "take"
            && before.owner.is_some()
            && before.owner != after.owner
            && before.wanted_by != after.owner
        {
            self.expired
                .insert((after.shard_id.clone(), before.owner_epoch), at);
        }
    }

    /// A write of the lease store, checked: the checkpoint passes no record left unhandled.
    fn change(&self, change: &Change) -> Option<String> {
        let after = change.after.as_ref()?;
        if change
            .before
            .as_ref()
            .is_some_and(|b| b.checkpoint == after.checkpoint)
        {
            return None;
        }
        let through = match &after.checkpoint {
            Checkpoint::At(position) => Some(*position.sequence()),
            Checkpoint::ShardEnd => None,
            _ => return None,
        };
        let records = self.put.get(&after.shard_id)?;
        let passed = records
            .iter()
            .filter(|(sequence, _)| through.as_ref().is_none_or(|t| sequence <= t))
            .find(|(_, id)| !self.handled.contains(id) && !self.before_start.contains(id))?;
        Some(format!(
            "{}: checkpoint {:?} passes {} ({}), which was never handled ({})",
            after.shard_id, after.checkpoint, passed.1, passed.0, change.operation
        ))
    }
}

struct World {
    seed: u64,
    rng: StdRng,
    stream: MemoryStream,
    store: Arc<Layered<Watchdog>>,
    /// The store under the watchdog, for its faults and limits.
    memory: MemoryLeaseStore,
    model: Arc<Mutex<Model>>,
    start: Instant,
    workers: Vec<Option<Running>>,
    /// The process running as each worker (see [`Model::held_by`]), and the next process's
    /// number.
    processes: Vec<Option<u64>>,
    next_process: u64,
    lanes: usize,
    poll: Duration,
    /// Every worker reads with enhanced fan-out (`testing::Subscriptions` over the stream: an
    /// event a second, each subscription ended after 5 minutes, cut when the stream's iterator
    /// expires, throttled with the stream's reads).
    fan_out: bool,
    initial: InitialPosition,
    records: u64,
    /// Each worker's host clock: ms ahead of the stream's (behind when negative), drift in ppm.
    clocks: Vec<(i64, i64)>,
    /// Each worker's path to the lease table.
    links: Vec<Link>,
}

/// A worker's path to the lease table, which can turn slow and then break, in one of two ways:
/// its next renewal is applied and answered late while the rest passes, or the whole path stalls
/// (every call sent for a while is applied at once and answered when the stall ends: a proxy or
/// a network holding answers). Then every call waits until the path is back (the stream is still
/// read and records handled meanwhile).
#[derive(Debug, Clone, Default)]
struct Link {
    /// The trouble to come, taken by the next renewal (or by the next call of any kind for a
    /// stall).
    armed: Arc<Mutex<Option<PathTrouble>>>,
    /// Calls wait until then.
    cut_until: Arc<Mutex<Option<Instant>>>,
    /// A stall under way: calls sent before the first instant are answered then; calls sent
    /// after it wait until the second (the cut).
    stalled: Arc<Mutex<Option<(Instant, Instant)>>>,
    /// When the cut of a renewal whose answer is on its way late will end: set as the renewal
    /// takes the armed fault, before `cut_until` is (which waits for the late answer), so the
    /// liveness check sees a cut that has begun as a slow answer.
    cut_ends: Arc<Mutex<Option<Instant>>>,
}

/// How a worker's path to the lease table turns slow before it breaks for `cut`.
#[derive(Debug, Clone, Copy)]
struct PathTrouble {
    slow: Duration,
    cut: Duration,
    /// Every call sent in the next `slow` is answered at its end (beats and renewals alike),
    /// rather than the next renewal alone answered `slow` late.
    stall: bool,
}

impl Layer for Link {
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: Call<'a>,
        forward: BoxFuture<'a, Result<T, shardwise::Error>>,
    ) -> BoxFuture<'a, Result<T, shardwise::Error>> {
        Box::pin(async move {
            let until = *self.cut_until.lock().unwrap();
            if let Some(until) = until {
                tokio::time::sleep_until(until).await;
            }
            let stalled = {
                let mut armed = self.armed.lock().unwrap();
                let mut stalled = self.stalled.lock().unwrap();
                if let Some(trouble) = armed.take_if(|t| t.stall) {
                    let answered = Instant::now() + trouble.slow;
                    *stalled = Some((answered, answered + trouble.cut));
                    *self.cut_ends.lock().unwrap() = Some(answered + trouble.cut);
                }
                *stalled
            };
            let held = match stalled {
                Some((answered, back)) if Instant::now() >= answered => {
                    tokio::time::sleep_until(back).await;
                    None
                }
                Some((answered, _)) => Some(answered),
                None => None,
            };
            let answer = forward.await;
            if let Some(answered) = held {
                tokio::time::sleep_until(answered).await;
                return answer;
            }
            let armed = if call.method() == "renew" {
                self.armed.lock().unwrap().take()
            } else {
                None
            };
            if let Some(PathTrouble { slow, cut, .. }) = armed {
                *self.cut_ends.lock().unwrap() = Some(Instant::now() + slow + cut);
                tokio::time::sleep(slow).await;
                *self.cut_until.lock().unwrap() = Some(Instant::now() + cut);
            }
            answer
        })
    }
}

impl World {
    fn new(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x0da7_5ea1);
        let start = Instant::now();
        let stream = MemoryStream::new(STREAM, rng.random_range(1..=3));
        stream.service_limits(DAY);
        let memory = MemoryLeaseStore::new();
        memory.service_limits();
        let model = Arc::new(Mutex::new(Model::default()));
        let observer = model.clone();
        memory.observe(Arc::new(move |change: &Change| {
            let mut model = observer.lock().unwrap();
            let now = Instant::now();
            if let Some(violation) = model.change(change) {
                model.violation(now, start, violation);
            }
            model.taken(change, now);
            if let Some(after) = &change.after
                && change
                    .before
                    .as_ref()
                    .is_none_or(|b| b.checkpoint != after.checkpoint || b.owner != after.owner)
            {
                let line = format!(
                    "store {} {} owner={:?} checkpoint={:?}",
                    change.operation, after.shard_id, after.owner, after.checkpoint
                );
                model.event(now, start, line);
            }
        }));
        let report = model.clone();
        let watchdog = Watchdog::new(start, move |at, what| {
            report.lock().unwrap().violation(at, start, what);
        });
        let initial = match rng.random_range(0..3) {
            0 => InitialPosition::TrimHorizon,
            1 => InitialPosition::AtTimestamp(crate::world::base()),
            _ => InitialPosition::Latest,
        };
        let workers = rng.random_range(1..=3);
        // One more for the twin of worker 0, on a host of its own.
        let clocks = (0..=workers)
            .map(|_| (rng.random_range(-9_000..=9_000), rng.random_range(-10..=10)))
            .collect();
        Self {
            seed,
            lanes: rng.random_range(1..=4),
            poll: Duration::from_millis(rng.random_range(500..=5_000)),
            // Its own generator: the other draws of a seed stay as they were.
            fan_out: StdRng::seed_from_u64(seed ^ 0x0fa0_0e70).random_bool(0.3),
            rng,
            stream,
            store: Arc::new(Layered::new(Arc::new(memory.clone()), watchdog)),
            memory,
            model,
            start,
            workers: (0..workers).map(|_| None).collect(),
            processes: (0..workers).map(|_| None).collect(),
            next_process: 0,
            initial,
            records: 0,
            links: (0..=workers).map(|_| Link::default()).collect(),
            clocks,
        }
    }

    fn event(&self, what: String) {
        self.model
            .lock()
            .unwrap()
            .event(Instant::now(), self.start, what);
    }

    fn put(&mut self) {
        let key = format!("k{}", self.rng.random_range(0..20));
        let id = format!("r{}", self.records);
        self.records += 1;
        let (shard, sequence) = self.stream.put(&key, id.clone());
        let mut model = self.model.lock().unwrap();
        model.event(Instant::now(), self.start, format!("put {id} {shard}"));
        model.put.entry(shard).or_default().push((sequence, id));
    }

    /// A LATEST start: records put before the workers, then the workers, then a wait until every
    /// shard's start is pinned (at most 10 minutes). Returns whether all were.
    async fn begin_at_latest(&mut self) -> bool {
        for _ in 0..self.rng.random_range(1..=20) {
            self.put();
        }
        {
            let mut model = self.model.lock().unwrap();
            let before: Vec<String> = model
                .put
                .values()
                .flatten()
                .map(|(_, id)| id.clone())
                .collect();
            model.before_start.extend(before);
        }
        tokio::time::sleep(Duration::from_millis(self.rng.random_range(0..=2_000))).await;
        for n in 0..self.workers.len() {
            self.start_worker(n).await;
        }
        let deadline = Instant::now() + Duration::from_secs(600);
        while Instant::now() < deadline {
            let mut pinned = true;
            for shard in self.stream.open_shards() {
                let row = self.store.get(STREAM, &shard).await.ok().flatten();
                pinned &= row.is_some_and(|r| r.checkpoint != Checkpoint::Latest);
            }
            if pinned {
                self.event("every LATEST start pinned".into());
                return true;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        false
    }

    async fn start_worker(&mut self, n: usize) {
        if let Some((running, process)) = self.consumer(n).await {
            self.workers[n] = Some(running);
            self.processes[n] = Some(process);
        }
    }

    /// Worker `n`'s process stopped or crashed.
    fn down(&mut self, n: usize) {
        if let Some(process) = self.processes[n].take() {
            self.model.lock().unwrap().process_down(process);
        }
    }

    /// Worker `n`'s consumer, started (a second process with the same worker id, when worker `n`
    /// is up: hosts that share a name, PID 1 in containers).
    async fn consumer(&mut self, n: usize) -> Option<(Running, u64)> {
        let worker = format!("w{n}");
        let process = self.next_process;
        self.next_process += 1;
        let (model, start, seed) = (self.model.clone(), self.start, self.seed);
        let w = worker.clone();
        let dispatched = self.model.clone();
        let dispatcher = worker.clone();
        let handler = move |d: Delivery| {
            let id = String::from_utf8_lossy(d.payload()).into_owned();
            {
                // A lease taken as expired sees no dispatch of its previous owner after the take.
                let epoch = d.id().map_or(0, |i| i.epoch());
                let mut model = dispatched.lock().unwrap();
                let now = Instant::now();
                if let Some(taken) = model.expired.get(&(d.shard().to_string(), epoch)).copied()
                    && now > taken
                {
                    let what = format!(
                        "{dispatcher} dispatches {id} of {} under epoch {epoch}, {} ms after another worker took the lease as expired",
                        d.shard(),
                        (now - taken).as_millis()
                    );
                    model.violation(now, start, what);
                }
            }
            let mut h = Md5::new();
            h.update(seed.to_le_bytes());
            h.update(id.as_bytes());
            let took = Duration::from_millis(u64::from(h.finalize()[0] % 50));
            let model = model.clone();
            let w = w.clone();
            async move {
                tokio::time::sleep(took).await;
                let mut model = model.lock().unwrap();
                model.invocations += 1;
                model.handled.insert(id.clone());
                model.event(Instant::now(), start, format!("handled {w} {id}"));
                Outcome::Ack
            }
        };
        let stream = Arc::new(self.stream.clone());
        let source: Arc<dyn RecordSource> = if self.fan_out {
            Arc::new(FanOutRecords::with(
                Arc::new(Subscriptions::over(stream.clone())),
                stream.clone(),
                FanOut::new(),
            ))
        } else {
            stream.clone()
        };
        // Worker 0's twin (worker 0 up) runs on the last host.
        let host = if self.workers[n].is_some() {
            self.clocks.len() - 1
        } else {
            n
        };
        let (offset, drift) = self.clocks[host];
        let consumer = Consumer::builder(STREAM, "sim", handler)
            .worker_id(&worker)
            .lanes(self.lanes)
            .poll_interval(self.poll)
            .checkpoint_interval(Duration::from_secs(5))
            .initial_position(self.initial)
            .lease_settings(
                LeaseSettings::default()
                    .lease_duration(Duration::from_secs(30))
                    .scan_interval(Duration::from_secs(10)),
            )
            .lease_store(Arc::new(Layered::new(
                self.store.clone(),
                self.links[host].clone(),
            )))
            .record_source(source)
            .shard_lister(stream.clone())
            .record_sink(stream)
            .hooks(Arc::new(Holds {
                process,
                model: self.model.clone(),
                start: self.start,
            }))
            .build()
            .expect("settings");
        let running = on_host(HostClock::new(offset, drift), consumer.run()).await;
        match running {
            Ok(running) => {
                self.event(format!("start {worker} (p{process})"));
                Some((running, process))
            }
            Err(e) => {
                self.event(format!("start {worker} failed: {e}"));
                None
            }
        }
    }

    fn crash(&mut self, n: usize) {
        if let Some(running) = self.workers[n].take() {
            self.event(format!("crash w{n}"));
            running.abort();
            self.down(n);
        }
    }

    /// A worker that has just started is stopped again in a quarter of its starts, 0.1 to 5 s
    /// later (an autoscaler that changed its mind, a deploy rolled back): its requests for
    /// leases may be under way (an owner passes within about half a second of a request), and an
    /// owner may pass one to it after it left (issue 27, defect 1).
    async fn scale_in_during_join(&mut self, n: usize) {
        // Drawn apart from the seed's generator, so its other draws stay as they were.
        let mut rng = StdRng::seed_from_u64(
            self.seed
                ^ 0x5ca1_e000
                ^ (n as u64) << 32
                ^ (Instant::now() - self.start).as_millis() as u64,
        );
        if !rng.random_bool(0.25) {
            return;
        }
        let after = Duration::from_millis(rng.random_range(100..=5_000));
        tokio::time::sleep(after).await;
        if let Some(running) = self.workers[n].take() {
            self.event(format!(
                "stop w{n} {} ms after its start (scale-in)",
                after.as_millis()
            ));
            running.shutdown(Duration::from_secs(5)).await;
            self.down(n);
        }
    }

    /// Once the fleet is quiet, every lease is read again within the lease duration plus two
    /// scan intervals of the last change (issue 25): checked that long into a quiet phase, after
    /// the end of any cut-off of a worker's path to the lease table (also one whose slow answer,
    /// which it begins with, is still on its way). Not checked with no worker up, nor while a
    /// cut-off is still to come.
    async fn check_leases_read(&mut self) {
        if self.workers.iter().all(Option::is_none)
            || self.links.iter().any(|l| l.armed.lock().unwrap().is_some())
        {
            return;
        }
        let mut last_change = Instant::now();
        for link in &self.links {
            let until = *link.cut_until.lock().unwrap();
            let ends = *link.cut_ends.lock().unwrap();
            if let Some(until) = until.max(ends) {
                last_change = last_change.max(until);
            }
        }
        tokio::time::sleep_until(last_change + UNREAD_BOUND).await;
        let unread = self.unread_leases();
        if !unread.is_empty() {
            let what = format!(
                "leases unread {} s after the last change, the fleet quiet: {unread:?}",
                UNREAD_BOUND.as_secs()
            );
            self.model
                .lock()
                .unwrap()
                .violation(Instant::now(), self.start, what);
        }
    }

    /// The readable leases (not at `SHARD_END`, every parent's row at it) that no running process
    /// reads: the row must name a running worker whose process took it under the row's epoch
    /// and has not given it up.
    fn unread_leases(&self) -> Vec<String> {
        let rows: Vec<_> = self
            .memory
            .snapshot()
            .into_iter()
            .filter(|r| r.stream == STREAM && r.shard_id.starts_with("shardId-"))
            .collect();
        let ended: BTreeSet<&str> = rows
            .iter()
            .filter(|r| r.checkpoint == Checkpoint::ShardEnd)
            .map(|r| r.shard_id.as_str())
            .collect();
        let model = self.model.lock().unwrap();
        rows.iter()
            .filter(|r| {
                r.checkpoint != Checkpoint::ShardEnd
                    && r.parents.iter().all(|p| ended.contains(p.as_str()))
            })
            .filter(|r| {
                let key = (r.shard_id.clone(), r.owner_epoch);
                let reader = r
                    .owner
                    .as_deref()
                    .and_then(|o| o.strip_prefix('w')?.parse::<usize>().ok())
                    .and_then(|n| self.processes.get(n).copied().flatten());
                reader.is_none()
                    || model.held_by.get(&key) != reader.as_ref()
                    || model.given_up.contains_key(&key)
            })
            .map(|r| format!("{} owner {:?} epoch {}", r.shard_id, r.owner, r.owner_epoch))
            .collect()
    }

    fn unhandled(&self) -> Vec<String> {
        let model = self.model.lock().unwrap();
        model
            .put
            .values()
            .flatten()
            .filter(|(_, id)| !model.handled.contains(id) && !model.before_start.contains(id))
            .map(|(_, id)| id.clone())
            .collect()
    }

    async fn run(mut self) -> SeedResult {
        let clocks = format!("host clocks (ms ahead, ppm) {:?}", self.clocks);
        self.event(clocks);
        if self.fan_out {
            self.event("reading with enhanced fan-out".to_string());
        }
        let mut burst_first = false;
        if self.initial == InitialPosition::Latest {
            if !self.begin_at_latest().await {
                let what = "a LATEST start not pinned within 10 minutes".to_string();
                self.model
                    .lock()
                    .unwrap()
                    .violation(Instant::now(), self.start, what);
            }
            burst_first = true;
        } else {
            for n in 0..self.workers.len() {
                self.start_worker(n).await;
            }
        }
        let end = self.start + DAY;
        while Instant::now() < end {
            let draw = self.rng.random_range(0..100);
            match if std::mem::take(&mut burst_first) {
                0
            } else {
                draw
            } {
                0..=44 => {
                    let minutes = self.rng.random_range(1..=20);
                    self.event(format!("burst {minutes} min"));
                    let until = Instant::now() + Duration::from_secs(minutes * 60);
                    while Instant::now() < until {
                        for _ in 0..self.rng.random_range(1..=5) {
                            self.put();
                        }
                        let gap = Duration::from_millis(self.rng.random_range(100..=2_000));
                        tokio::time::sleep(gap).await;
                    }
                }
                45..=59 => {
                    let hours = self.rng.random_range(1..=6);
                    self.event(format!("quiet {hours} h"));
                    let end = Instant::now() + Duration::from_secs(hours * HOUR);
                    self.check_leases_read().await;
                    tokio::time::sleep_until(end).await;
                }
                60..=64 => {
                    let hours = self.rng.random_range(1..=6);
                    self.event(format!("outage {hours} h"));
                    for n in 0..self.workers.len() {
                        self.crash(n);
                    }
                    tokio::time::sleep(Duration::from_secs(hours * HOUR)).await;
                    for n in 0..self.workers.len() {
                        self.start_worker(n).await;
                    }
                }
                65..=77 => {
                    let n = self.rng.random_range(0..self.workers.len());
                    if self.workers[n].is_none() {
                        self.start_worker(n).await;
                        self.scale_in_during_join(n).await;
                    } else if self.rng.random_bool(0.5) {
                        self.crash(n);
                    } else if let Some(running) = self.workers[n].take() {
                        self.event(format!("stop w{n}"));
                        running.shutdown(Duration::from_secs(5)).await;
                        self.down(n);
                    }
                }
                // A second process with worker 0's id, for 10 minutes to 3 hours.
                78..=79 => {
                    let minutes = self.rng.random_range(10..=180);
                    self.event(format!("twin of w0 for {minutes} min"));
                    if let Some((twin, process)) = self.consumer(0).await {
                        tokio::time::sleep(Duration::from_secs(minutes * 60)).await;
                        self.event("twin of w0 stops".into());
                        twin.shutdown(Duration::from_secs(5)).await;
                        self.model.lock().unwrap().process_down(process);
                    }
                }
                80..=86 => {
                    let open = self.stream.open_shards();
                    if open.len() < 6 {
                        let shard = open[self.rng.random_range(0..open.len())].clone();
                        let children = self.stream.split(&shard);
                        self.event(format!("split {shard} -> {children:?}"));
                    }
                }
                87..=91 => {
                    let pairs = self.stream.adjacent_open_shards();
                    if !pairs.is_empty() {
                        let (a, b) = pairs[self.rng.random_range(0..pairs.len())].clone();
                        let child = self.stream.merge(&a, &b);
                        self.event(format!("merge {a} {b} -> {child}"));
                    }
                }
                92..=94 => {
                    let minutes = self.rng.random_range(2..=20);
                    self.event(format!("throttled {minutes} min"));
                    self.stream
                        .inject(self.seed, Faults::default().throttle(1.0));
                    tokio::time::sleep(Duration::from_secs(minutes * 60)).await;
                    self.stream.heal();
                }
                _ if self.rng.random_bool(0.4) => {
                    let line = lease_trouble(&mut self.rng, &self.memory, STREAM, self.seed).await;
                    self.event(line);
                }
                // A worker's path to the lease table turns slow, then breaks for 30 s to 3
                // minutes: its next renewal is answered 2 to 10 s late, or every call of the next
                // 1 to 20 s (beats too) is answered at its end (both within an attempt: 25 s).
                _ => {
                    let n = self.rng.random_range(0..self.workers.len());
                    let slow = Duration::from_millis(self.rng.random_range(2_000..10_000));
                    let cut = Duration::from_secs(self.rng.random_range(30..=180));
                    // Drawn from what was drawn, so the seed's other draws stay as they were.
                    let mut flavour = StdRng::seed_from_u64(
                        self.seed ^ (slow.as_millis() as u64) << 8 ^ cut.as_secs() << 40,
                    );
                    let stall = flavour.random_bool(0.5);
                    let (slow, what) = if stall {
                        let slow = Duration::from_millis(flavour.random_range(1_000..20_000));
                        let what = format!(
                            "every call of w{n} for {} ms answered at the end",
                            slow.as_millis()
                        );
                        (slow, what)
                    } else {
                        (
                            slow,
                            format!("w{n}'s next renewal answered {} ms late", slow.as_millis()),
                        )
                    };
                    self.event(format!(
                        "{what}, then no lease table for {} s",
                        cut.as_secs()
                    ));
                    *self.links[n].armed.lock().unwrap() = Some(PathTrouble { slow, cut, stall });
                }
            }
            tokio::time::sleep(Duration::from_secs(self.rng.random_range(1..=60))).await;
        }

        self.stream.heal();
        if self.workers.iter().all(Option::is_none) {
            self.start_worker(0).await;
        }
        let quiet_end = Instant::now() + QUIET;
        loop {
            let owed = self.unhandled();
            if owed.is_empty() {
                break;
            }
            if Instant::now() >= quiet_end {
                let trimmed = self.stream.trimmed().len();
                let what = format!(
                    "not done an hour after the day: {} records unhandled ({trimmed} trimmed), first {:?}",
                    owed.len(),
                    &owed[..owed.len().min(5)]
                );
                self.model
                    .lock()
                    .unwrap()
                    .violation(Instant::now(), self.start, what);
                break;
            }
            tokio::time::sleep(Duration::from_secs(10)).await;
        }
        {
            let mut model = self.model.lock().unwrap();
            for what in model.never_given_up() {
                model.violation(Instant::now(), self.start, what);
            }
        }
        for running in self.workers.iter_mut().filter_map(Option::take) {
            running.shutdown(Duration::from_secs(5)).await;
        }
        let reads = self.stream.reads();
        let mut model = std::mem::take(&mut *self.model.lock().unwrap());
        let summary = format!("end: {} records, {reads} GetRecords calls", self.records);
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

/// Tells the model when a process's lease manager takes a lease and when it gives one up (lost,
/// or let go when its hold ran out).
struct Holds {
    process: u64,
    model: Arc<Mutex<Model>>,
    start: Instant,
}

impl shardwise::lease::LeaseHooks for Holds {
    fn lease_taken(&self, lease: &shardwise::Lease) {
        let mut model = self.model.lock().unwrap();
        let key = (lease.shard_id.clone(), lease.owner_epoch);
        // A take that lands after its process went down is left behind with it.
        if model.down.contains(&self.process) {
            model.left_behind.insert(key.clone());
        }
        model.held_by.insert(key, self.process);
    }

    fn lease_lost(&self, ownership: &shardwise::lease::Ownership) {
        self.model.lock().unwrap().gave_up(
            Instant::now(),
            self.start,
            self.process,
            &ownership.shard_id,
            ownership.epoch,
        );
    }
}

/// DynamoDB trouble that lasts, as a hot partition or an exhausted table meets it: for 2 to 20
/// minutes every call of the lease table is throttled, or half of them, or every write of the
/// stream's roster item (the workers' beats). Returns what it was, for the trace.
pub async fn lease_trouble(
    rng: &mut StdRng,
    memory: &MemoryLeaseStore,
    stream: &str,
    seed: u64,
) -> String {
    let minutes = rng.random_range(2..=20);
    let what = match rng.random_range(0..3) {
        0 => {
            memory.inject(seed, Faults::default().throttle(1.0));
            "the lease table"
        }
        1 => {
            memory.inject(seed, Faults::default().throttle(0.5));
            "half the lease table's calls"
        }
        _ => {
            memory.throttle_roster(stream, true);
            "the roster item"
        }
    };
    tokio::time::sleep(Duration::from_secs(minutes * 60)).await;
    memory.heal();
    memory.throttle_roster(stream, false);
    format!("{what} throttled for {minutes} min")
}

/// Runs one long Kinesis seed.
pub fn run_seed(seed: u64) -> SeedResult {
    // Made inside the runtime: its start is the paused clock's, not the host's a moment before
    // the runtime existed (under load that moment was 1.4 s, and the seed's trace moved with it).
    crate::world::run_paused(seed, async move { World::new(seed).run().await })
}
