//! The lease manager in a deterministic simulation: the in-memory lease store, a fixed shard list,
//! and paused tokio time. Dropping a manager without `shutdown` is a crash (kill -9): its tasks stop
//! and nothing is released.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use shardwise::Error;
use shardwise::lease::{
    Checkpoint, CheckpointWrite, LeaseEvent, LeaseManager, LeaseSettings, LeaseStore,
    MemoryLeaseStore,
};
use shardwise::shard::discovery::{ShardInfo, ShardLister};
use shardwise::testing::{Call, Layer, Layered};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::time::Instant;

#[derive(Debug, Default)]
struct Shards(Mutex<Vec<ShardInfo>>);

impl Shards {
    fn open(n: usize) -> Arc<Self> {
        let shards = (0..n)
            .map(|i| ShardInfo {
                shard_id: format!("shardId-{i:012}"),
                parents: vec![],
                closed: false,
            })
            .collect();
        Arc::new(Self(Mutex::new(shards)))
    }
}

impl ShardLister for Shards {
    fn list_shards<'a>(&'a self, _stream: &'a str) -> BoxFuture<'a, Result<Vec<ShardInfo>, Error>> {
        let shards = self.0.lock().unwrap().clone();
        Box::pin(async move { Ok(shards) })
    }
}

const STREAM: &str = "orders";

async fn worker(
    store: &MemoryLeaseStore,
    shards: &Arc<Shards>,
    name: &str,
) -> (LeaseManager, UnboundedReceiver<LeaseEvent>) {
    start_on(Arc::new(store.clone()), shards, name)
        .await
        .expect("manager starts")
}

/// A manager with the default settings on `store` (any store: counted, failing), as started.
async fn start_on(
    store: Arc<dyn LeaseStore>,
    shards: &Arc<Shards>,
    name: &str,
) -> Result<(LeaseManager, UnboundedReceiver<LeaseEvent>), Error> {
    LeaseManager::start(
        store,
        shards.clone(),
        STREAM,
        name,
        LeaseSettings::default(),
        Arc::new(()),
    )
    .await
}

fn owned_by(store: &MemoryLeaseStore, worker: &str) -> usize {
    store
        .snapshot()
        .iter()
        .filter(|l| l.owner.as_deref() == Some(worker))
        .count()
}

/// Advances time in small steps until `done` holds; returns the time it took.
async fn until(limit: Duration, mut done: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "not reached within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    start.elapsed()
}

#[tokio::test(start_paused = true)]
async fn two_workers_split_eight_shards_and_stay_balanced() {
    let store = MemoryLeaseStore::new();
    let shards = Shards::open(8);
    let (a, mut a_events) = worker(&store, &shards, "a").await;
    let (b, mut b_events) = worker(&store, &shards, "b").await;
    // Converged: the table says 4/4, and each worker's own view agrees (a worker learns a lease was
    // stolen from it at its next renewal at the latest).
    until(Duration::from_secs(60), || {
        owned_by(&store, "a") == 4
            && owned_by(&store, "b") == 4
            && a.held().len() + b.held().len() == 8
    })
    .await;

    // Drain what happened so far, then watch a minute of steady state: no lease changes hands.
    while a_events.try_recv().is_ok() {}
    while b_events.try_recv().is_ok() {}
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(a_events.try_recv().is_err(), "a's leases churned");
    assert!(b_events.try_recv().is_err(), "b's leases churned");
    assert_eq!((owned_by(&store, "a"), owned_by(&store, "b")), (4, 4));
}

#[tokio::test(start_paused = true)]
async fn a_crashed_workers_leases_move_within_lease_duration_plus_one_scan() {
    let store = MemoryLeaseStore::new();
    let shards = Shards::open(8);
    let (a, _a_events) = worker(&store, &shards, "a").await;
    let (b, _b_events) = worker(&store, &shards, "b").await;
    until(Duration::from_secs(60), || owned_by(&store, "b") == 4).await;

    drop(b); // kill -9: no release
    let settings = LeaseSettings::default();
    let took = until(Duration::from_secs(60), || owned_by(&store, "a") == 8).await;
    assert!(
        took <= settings.lease_duration + settings.scan_interval * 2,
        "failover took {took:?}"
    );
    assert!(
        took >= settings.lease_duration,
        "leases were taken before they expired: {took:?}"
    );
    assert_eq!(a.held().len(), 8);
}

/// A worker killed after a quiet spell (the others scan only every idle interval, so the counters
/// they last read are old): its leases still move within a lease duration, a scan and a beat of
/// its last renewal, at every phase of its renewal round. A roster-dead owner's counter must be
/// seen still for two renewal rounds before its lease counts as expired; the others read the
/// counters while its silence runs out, not first at its death.
#[tokio::test(start_paused = true)]
async fn a_worker_killed_after_a_quiet_spell_loses_its_leases_within_a_lease_duration_and_a_scan() {
    let settings = LeaseSettings::default();
    for phase_ms in [0, 700, 1_400, 2_100, 2_800] {
        let store = MemoryLeaseStore::new();
        let shards = Shards::open(8);
        let (a, _a_events) = worker(&store, &shards, "a").await;
        let (b, _b_events) = worker(&store, &shards, "b").await;
        until(Duration::from_secs(60), || owned_by(&store, "b") == 4).await;
        tokio::time::sleep(Duration::from_secs(60) + Duration::from_millis(phase_ms)).await;

        drop(b); // kill -9: no release, no more renewals or beats
        let took = until(Duration::from_secs(60), || owned_by(&store, "a") == 8).await;
        eprintln!("killed {phase_ms} ms into a quiet minute's end: a held all 8 after {took:?}");
        assert!(
            took <= settings.lease_duration + settings.scan_interval + Duration::from_secs(1),
            "killed {phase_ms} ms into the phase: failover took {took:?}"
        );
        assert_eq!(a.held().len(), 8);
        a.shutdown().await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_graceful_shutdown_is_taken_over_within_one_scan() {
    let store = MemoryLeaseStore::new();
    let shards = Shards::open(4);
    let (a, _a_events) = worker(&store, &shards, "a").await;
    let (b, _b_events) = worker(&store, &shards, "b").await;
    until(Duration::from_secs(60), || owned_by(&store, "b") == 2).await;

    assert_eq!(b.shutdown().await, 2, "both leases released");
    assert_eq!(owned_by(&store, "b"), 0);
    let took = until(Duration::from_secs(60), || owned_by(&store, "a") == 4).await;
    assert!(
        took <= LeaseSettings::default().scan_interval,
        "handoff took {took:?}"
    );
    drop(a);
}

#[tokio::test(start_paused = true)]
async fn a_stolen_lease_cancels_the_victims_work_within_one_renewal() {
    let store = MemoryLeaseStore::new();
    let shards = Shards::open(4);
    let (a, mut a_events) = worker(&store, &shards, "a").await;
    let mut tokens = Vec::new();
    until(Duration::from_secs(10), || {
        while let Ok(LeaseEvent::Acquired(held)) = a_events.try_recv() {
            tokens.push(*held);
        }
        tokens.len() == 4
    })
    .await;

    let (_b, _b_events) = worker(&store, &shards, "b").await;
    until(Duration::from_secs(60), || owned_by(&store, "b") >= 1).await;
    let stolen_at = Instant::now();
    let stolen: Vec<_> = store
        .snapshot()
        .into_iter()
        .filter(|l| l.owner.as_deref() == Some("b"))
        .collect();
    let victim = tokens
        .iter()
        .find(|h| h.ownership.shard_id == stolen[0].shard_id)
        .expect("a held it");
    until(Duration::from_secs(10), || victim.cancel.is_cancelled()).await;
    assert!(
        stolen_at.elapsed() <= LeaseSettings::default().renew_interval + Duration::from_millis(100)
    );

    // The zombie's checkpoint is refused by the store.
    let write = store
        .checkpoint(&victim.ownership, &Checkpoint::ShardEnd, None)
        .await
        .unwrap();
    assert_eq!(write, CheckpointWrite::Lost);
    drop(a);
}

#[tokio::test(start_paused = true)]
async fn children_are_taken_only_after_their_parent_reaches_shard_end() {
    let store = MemoryLeaseStore::new();
    let shards = Arc::new(Shards(Mutex::new(vec![ShardInfo {
        shard_id: "parent".into(),
        parents: vec![],
        closed: false,
    }])));
    let (a, mut events) = worker(&store, &shards, "a").await;
    let parent = loop {
        if let Some(LeaseEvent::Acquired(h)) = events.recv().await {
            let h = *h;
            break h;
        }
    };

    // Split: the parent closes, two children appear.
    {
        let mut list = shards.0.lock().unwrap();
        list[0].closed = true;
        for c in ["left", "right"] {
            list.push(ShardInfo {
                shard_id: c.into(),
                parents: vec!["parent".into()],
                closed: false,
            });
        }
    }
    a.sync_soon();
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(a.held().len(), 1, "children wait while the parent is open");
    let rows = store.snapshot();
    let child = rows
        .iter()
        .find(|l| l.shard_id == "left")
        .expect("child row created");
    assert_eq!(
        child.checkpoint,
        Checkpoint::TrimHorizon,
        "children start at the trim horizon"
    );

    assert_eq!(
        store
            .checkpoint(&parent.ownership, &Checkpoint::ShardEnd, None)
            .await
            .unwrap(),
        CheckpointWrite::Written
    );
    a.shard_ended(&parent.ownership).await.unwrap();
    until(Duration::from_secs(10), || a.held().len() == 2).await;
    let mut held: Vec<String> = a.held().into_iter().map(|o| o.shard_id).collect();
    held.sort();
    assert_eq!(held, ["left", "right"]);
}

#[tokio::test]
async fn invalid_settings_are_refused_naming_the_field() {
    let store = MemoryLeaseStore::new();
    let err = LeaseManager::start(
        Arc::new(store),
        Shards::open(1),
        STREAM,
        "a",
        LeaseSettings::default().renew_interval(Duration::from_secs(9)),
        Arc::new(()),
    )
    .await
    .expect_err("renewing at 9 s with a 10 s lease is refused");
    let Error::Config(e) = err else {
        panic!("not a config error: {err}")
    };
    assert_eq!(e.field(), "renew_interval");
}

/// Counts every store call by method (each is one DynamoDB request for the DynamoDB store; a Scan
/// of a small table is one page), and the conditional takes and creates the store refused; fails
/// every beat while `beats_fail` is set (the roster item is unreachable for this worker), and
/// every renewal while `renewals_fail` is.
#[derive(Debug, Default)]
struct Counting {
    calls: Mutex<std::collections::BTreeMap<&'static str, u64>>,
    refused: std::sync::atomic::AtomicU64,
    beats_fail: std::sync::atomic::AtomicBool,
    renewals_fail: std::sync::atomic::AtomicBool,
    /// Fails this many takes (steals among them), then none.
    takes_fail: std::sync::atomic::AtomicU64,
    /// Holds every answer this long (ms) after the store behind gave it: each request is
    /// applied at once and answered late, as behind a slow network or on a starved CPU.
    late_answers_ms: std::sync::atomic::AtomicU64,
}

/// The memory store behind a [`Counting`] layer.
fn counting(memory: MemoryLeaseStore) -> Arc<Layered<Counting>> {
    Arc::new(Layered::new(Arc::new(memory), Counting::default()))
}

impl Counting {
    fn refused(&self) -> u64 {
        self.refused.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn count(&self, method: &str) -> u64 {
        self.calls.lock().unwrap().get(method).copied().unwrap_or(0)
    }

    fn total(&self) -> u64 {
        self.calls.lock().unwrap().values().sum()
    }

    fn counts(&self) -> std::collections::BTreeMap<&'static str, u64> {
        self.calls.lock().unwrap().clone()
    }
}

impl Layer for Counting {
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: Call<'a>,
        forward: BoxFuture<'a, Result<T, Error>>,
    ) -> BoxFuture<'a, Result<T, Error>> {
        *self.calls.lock().unwrap().entry(call.method()).or_default() += 1;
        let fails = match call {
            Call::Beat { .. } => self.beats_fail.load(std::sync::atomic::Ordering::Relaxed),
            Call::Renew(_) => self
                .renewals_fail
                .load(std::sync::atomic::Ordering::Relaxed),
            Call::Take { .. } => self
                .takes_fail
                .fetch_update(
                    std::sync::atomic::Ordering::Relaxed,
                    std::sync::atomic::Ordering::Relaxed,
                    |n| n.checked_sub(1),
                )
                .is_ok(),
            _ => false,
        };
        if fails {
            return Box::pin(async {
                Err(Error::Config(shardwise::ConfigError::new(
                    "beat",
                    "unreachable",
                    "injected",
                )))
            });
        }
        Box::pin(async move {
            let answer = forward.await;
            let late = self
                .late_answers_ms
                .load(std::sync::atomic::Ordering::Relaxed);
            if late > 0 {
                tokio::time::sleep(Duration::from_millis(late)).await;
            }
            if let Ok(answer) = &answer {
                let answer = answer as &dyn std::any::Any;
                let refused = match call {
                    Call::Create { .. } => answer.downcast_ref::<bool>() == Some(&false),
                    Call::Take { .. } => answer
                        .downcast_ref::<Option<shardwise::Lease>>()
                        .is_some_and(Option::is_none),
                    _ => false,
                };
                if refused {
                    self.refused
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
            answer
        })
    }
}

/// The counting layer itself: a create of a row that exists and a take of a row someone else
/// took are counted as refused (the fleet test below asserts there are none).
#[tokio::test]
async fn the_counting_layer_counts_a_refused_create_and_a_refused_take() {
    let store = counting(MemoryLeaseStore::new());
    let new = shardwise::NewLease {
        stream: STREAM.into(),
        shard_id: "shardId-000000000000".into(),
        checkpoint: Checkpoint::TrimHorizon,
        parents: vec![],
    };
    assert!(store.create(&new).await.unwrap());
    assert!(!store.create(&new).await.unwrap());
    let seen = store.get(STREAM, &new.shard_id).await.unwrap().unwrap();
    assert!(store.take(&seen, "a").await.unwrap().is_some());
    assert!(store.take(&seen, "b").await.unwrap().is_none());
    assert_eq!(store.layer().refused(), 2);
    assert_eq!(
        (store.layer().count("create"), store.layer().count("take")),
        (2, 2)
    );
}

#[tokio::test(start_paused = true)]
async fn an_idle_worker_costs_about_34_store_requests_per_held_lease_per_minute() {
    let store = counting(MemoryLeaseStore::new());
    let shards = Shards::open(4);
    let (manager, _events) = start_on(store.clone(), &shards, "idle").await.unwrap();
    until(Duration::from_secs(10), || manager.held().len() == 4).await;
    let (before, scans) = (store.layer().total(), store.layer().count("list"));
    tokio::time::sleep(Duration::from_secs(600)).await;
    let calls = store.layer().total() - before;
    let per_lease_minute = calls as f64 / 4.0 / 10.0;
    eprintln!(
        "idle: {calls} store requests in 10 min for 4 leases = {per_lease_minute:.1} per held lease per minute"
    );
    // Renewals: 60 s / (10 s / 3) = 18 per lease. Shared by the worker's leases: a beat every
    // 1 s (60) and, balanced and alone, a scan about every lease duration (6): 66 / 4 = 16.5 per
    // lease.
    assert!(
        (34.0..=35.0).contains(&per_lease_minute),
        "{per_lease_minute}"
    );
    let scans = (store.layer().count("list") - scans) as f64 / 10.0;
    assert!(
        (5.7..=6.3).contains(&scans),
        "one quiet scan every 10 s (20 % either way): {scans} a minute"
    );
}

/// Balanced workers that see nothing move scan about once per lease duration between them,
/// however many they are: the table's reads stop growing with the number of workers (before the
/// roster, every worker scanned every 2 s).
#[tokio::test(start_paused = true)]
async fn balanced_workers_read_the_table_about_once_per_lease_duration_whatever_their_number() {
    for workers in [1usize, 2, 4, 8] {
        let store = counting(MemoryLeaseStore::new());
        let shards = Shards::open(16);
        let mut running = Vec::new();
        for w in 0..workers {
            let (manager, events) = start_on(store.clone(), &shards, &format!("w{w}"))
                .await
                .unwrap();
            running.push((manager, events));
        }
        until(Duration::from_secs(120), || {
            running.iter().all(|(m, _)| m.held().len() == 16 / workers)
        })
        .await;
        // Let the last handoffs and the scans after them settle, then count ten minutes.
        tokio::time::sleep(Duration::from_secs(60)).await;
        for (_, events) in &mut running {
            while events.try_recv().is_ok() {}
        }
        let (scans, renewals, beats) = (
            store.layer().count("list"),
            store.layer().count("renew"),
            store.layer().count("beat"),
        );
        tokio::time::sleep(Duration::from_secs(600)).await;
        let per_minute = |now: u64, before: u64| (now - before) as f64 / 10.0;
        let scans = per_minute(store.layer().count("list"), scans);
        let renewals = per_minute(store.layer().count("renew"), renewals);
        let beats = per_minute(store.layer().count("beat"), beats);
        eprintln!(
            "{workers} workers on 16 shards: {scans:.1} scans, {renewals:.1} renewals, {beats:.1} beats a minute"
        );
        // Each worker scans every lease duration x workers: 6 scans a minute in all.
        assert!(
            (5.0..=7.0).contains(&scans),
            "{workers} workers: {scans} scans a minute"
        );
        assert_eq!(
            renewals,
            16.0 * 18.0,
            "{workers} workers: renewals unchanged"
        );
        assert_eq!(
            beats,
            workers as f64 * 60.0,
            "{workers} workers: a beat every 1 s each"
        );
        for (_, events) in &mut running {
            let mut churn = 0;
            while events.try_recv().is_ok() {
                churn += 1;
            }
            assert_eq!(churn, 0, "{workers} workers: leases moved at steady state");
        }
        for (manager, _) in running {
            manager.shutdown().await;
        }
    }
}

/// Starts `name` on `store` and answers its handoff requests as the consumer does: a lease asked
/// for is released at once (its final checkpoint needs nothing here), which passes it on.
async fn cooperating(
    store: Arc<dyn LeaseStore>,
    shards: &Arc<Shards>,
    name: &str,
    settings: LeaseSettings,
) -> Arc<LeaseManager> {
    cooperating_after(store, shards, name, settings, Duration::ZERO).await
}

/// [`cooperating`], releasing a lease asked for only after `drain` (in-flight deliveries that
/// take that long to settle) and, when `drain` is not zero, two checkpoint writes through `store`
/// (one under way when the drain ends, and the final one the consumer writes before the release).
async fn cooperating_after(
    store: Arc<dyn LeaseStore>,
    shards: &Arc<Shards>,
    name: &str,
    settings: LeaseSettings,
    drain: Duration,
) -> Arc<LeaseManager> {
    let writer = store.clone();
    let (manager, mut events) =
        LeaseManager::start(store, shards.clone(), STREAM, name, settings, Arc::new(()))
            .await
            .expect("manager starts");
    let manager = Arc::new(manager);
    let weak = Arc::downgrade(&manager);
    tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            let LeaseEvent::Acquired(held) = event else {
                continue;
            };
            let weak = weak.clone();
            let writer = writer.clone();
            tokio::spawn(async move {
                tokio::select! {
                    _ = held.cancel.cancelled() => {}
                    _ = held.handoff.cancelled() => {
                        if !drain.is_zero() {
                            // The drain, a checkpoint write under way when it ends, the final one.
                            tokio::time::sleep(drain).await;
                            for _ in 0..2 {
                                let _ = writer
                                    .checkpoint(&held.ownership, &held.lease.checkpoint, None)
                                    .await;
                            }
                        }
                        if let Some(manager) = weak.upgrade() {
                            let _ = manager.release(&held.ownership).await;
                        }
                    }
                }
            });
        }
    });
    manager
}

/// A fourth worker joining three balanced ones on 200 shards asks for its whole share at once,
/// spread over the three, and holds it within a few scans; nothing is stolen.
#[tokio::test(start_paused = true)]
async fn a_worker_joining_three_balanced_ones_on_200_shards_reaches_its_share_within_30_s() {
    let memory = MemoryLeaseStore::new();
    let store: Arc<dyn LeaseStore> = Arc::new(memory.clone());
    let shards = Shards::open(200);
    let mut workers = Vec::new();
    for name in ["a", "b", "c"] {
        workers.push(cooperating(store.clone(), &shards, name, LeaseSettings::default()).await);
    }
    until(Duration::from_secs(120), || {
        ["a", "b", "c"]
            .iter()
            .all(|w| (66..=67).contains(&owned_by(&memory, w)))
    })
    .await;
    tokio::time::sleep(Duration::from_secs(30)).await;

    let d = cooperating(store.clone(), &shards, "d", LeaseSettings::default()).await;
    let took = until(Duration::from_secs(30), || d.held().len() == 50).await;
    eprintln!("d reached its share of 50 in {took:?}");
    let loads: Vec<usize> = ["a", "b", "c", "d"]
        .iter()
        .map(|w| owned_by(&memory, w))
        .collect();
    assert_eq!(loads.iter().sum::<usize>(), 200, "{loads:?}");
    assert!(loads.iter().all(|n| n.abs_diff(50) <= 1), "{loads:?}");
    assert!(
        memory.snapshot().iter().all(|l| l.wanted_by.is_none()),
        "no request left pending"
    );
}

/// Holds every handoff request this long before it reaches the store (a store loaded by the
/// owners' passes and final checkpoints, behind a network).
#[derive(Debug)]
struct SlowRequests(Duration);

impl Layer for SlowRequests {
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: Call<'a>,
        forward: BoxFuture<'a, Result<T, Error>>,
    ) -> BoxFuture<'a, Result<T, Error>> {
        if !matches!(call, Call::Request { .. }) {
            return forward;
        }
        let slow = self.0;
        Box::pin(async move {
            tokio::time::sleep(slow).await;
            forward.await
        })
    }
}

/// A joining worker asks for its 50 leases 16 at a time: the rows passed to it are taken at its
/// next scan, not after all 50 requests went out one by one. Before, each request of a scan
/// waited for the one before it: at 300 ms a request, 15 s of requests held up the next scan
/// (the leases bench through 20-50 ms of latency showed the same: a join's requests spread over
/// 9 s while the passed rows waited).
#[tokio::test(start_paused = true)]
async fn a_joining_workers_slow_requests_do_not_hold_up_its_takes() {
    let memory = MemoryLeaseStore::new();
    let store: Arc<dyn LeaseStore> = Arc::new(memory.clone());
    let shards = Shards::open(200);
    let mut workers = Vec::new();
    for name in ["a", "b", "c"] {
        workers.push(cooperating(store.clone(), &shards, name, LeaseSettings::default()).await);
    }
    until(Duration::from_secs(120), || {
        ["a", "b", "c"]
            .iter()
            .all(|w| (66..=67).contains(&owned_by(&memory, w)))
    })
    .await;
    tokio::time::sleep(Duration::from_secs(30)).await;

    let slow: Arc<dyn LeaseStore> = Arc::new(Layered::new(
        Arc::new(memory.clone()),
        SlowRequests(Duration::from_millis(300)),
    ));
    let d = cooperating(slow, &shards, "d", LeaseSettings::default()).await;
    let took = until(Duration::from_secs(60), || d.held().len() == 50).await;
    eprintln!("d reached its share of 50 in {took:?}");
    assert!(
        took < Duration::from_secs(8),
        "d reached its share in {took:?}"
    );
}

/// Four workers starting at the same moment on a new 200-shard stream: one creates the rows, each
/// takes only the leases that fall to it, and not one conditional write is refused.
#[tokio::test(start_paused = true)]
async fn four_workers_starting_together_share_200_new_shards_without_a_refused_write() {
    let memory = MemoryLeaseStore::new();
    let store = counting(memory.clone());
    let shards = Shards::open(200);
    let names = ["a", "b", "c", "d"];
    let started = futures::future::join_all(names.iter().map(|name| {
        cooperating(
            store.clone() as Arc<dyn LeaseStore>,
            &shards,
            name,
            LeaseSettings::default(),
        )
    }))
    .await;
    let took = until(Duration::from_secs(20), || {
        names.iter().all(|w| owned_by(&memory, w) == 50)
    })
    .await;
    eprintln!("balanced in {took:?}");
    assert_eq!(store.layer().count("create"), 200, "each row created once");
    assert_eq!(store.layer().refused(), 0, "a take or create was refused");
    assert_eq!(
        store.layer().count("request"),
        0,
        "nothing had to move by handoff"
    );
    drop(started);
}

/// Worker "a" on a memory store of 8 shards, and "b" on the same store behind a [`Counting`]
/// layer (to fail or slow its calls), balanced at 4 leases each: the store, b's layer, and each
/// manager with its events.
async fn beside_a_counted_worker() -> (
    MemoryLeaseStore,
    Arc<Layered<Counting>>,
    (LeaseManager, UnboundedReceiver<LeaseEvent>),
    (LeaseManager, UnboundedReceiver<LeaseEvent>),
) {
    let memory = MemoryLeaseStore::new();
    let shards = Shards::open(8);
    let counted = counting(memory.clone());
    let (a, a_events) = worker(&memory, &shards, "a").await;
    let (b, b_events) = start_on(counted.clone(), &shards, "b").await.unwrap();
    until(Duration::from_secs(60), || b.held().len() == 4).await;
    (memory, counted, (a, a_events), (b, b_events))
}

/// For a minute, checked every 100 ms: `b` keeps exactly `held_by_b`, and `a` its 4 leases,
/// taking none of b's.
async fn neither_moves_for_a_minute(
    a: &LeaseManager,
    b: &LeaseManager,
    held_by_b: &[shardwise::lease::Ownership],
) {
    for _ in 0..600 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(b.held(), held_by_b, "b keeps its leases");
        assert_eq!(a.held().len(), 4, "a takes none of them");
    }
}

/// A worker whose beat cannot be written (the roster item throttled, say) while its renewals
/// land keeps its leases, and the others, though they judge it dead by the roster, leave them: its
/// counters move. It takes nothing while silent. Before, it gave up every lease after 6.7 s of
/// failed beats and the others took them all (issue 27, defect 2).
#[tokio::test(start_paused = true)]
async fn a_worker_whose_beat_fails_while_its_renewals_land_keeps_its_leases() {
    let (memory, failing, (a, _a_events), (b, _b_events)) = beside_a_counted_worker().await;
    let held_by_b = b.held();

    failing
        .layer()
        .beats_fail
        .store(true, std::sync::atomic::Ordering::Relaxed);
    // A minute of failed beats: long past the others' judgement (a lease duration and a beat).
    neither_moves_for_a_minute(&a, &b, &held_by_b).await;
    let owners = |owner: &str| {
        memory
            .snapshot()
            .iter()
            .filter(|r| r.owner.as_deref() == Some(owner))
            .count()
    };
    assert_eq!((owners("a"), owners("b")), (4, 4));

    failing
        .layer()
        .beats_fail
        .store(false, std::sync::atomic::Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(
        b.held(),
        held_by_b,
        "nothing moved when the beats came back"
    );
    drop((a, b));
}

/// Every answer of the store reaching a worker 4 s late, for a minute (each request applied at
/// once, as behind a slow network or on a starved CPU): past the 3.3 s a renewal used to be
/// waited for, well inside the 10 s lease. The worker keeps its leases, since each renewal counts
/// from its send once its answer comes, and the other worker takes none of them: their counters
/// move. Before, every renewal timed out and the worker gave up all four leases within 7 s, and
/// the other took them (issue 27, "a slow answer is not a lost one").
#[tokio::test(start_paused = true)]
async fn a_worker_whose_store_answers_four_seconds_late_keeps_its_leases() {
    let (_memory, slow, (a, _a_events), (b, mut b_events)) = beside_a_counted_worker().await;
    let held_by_b = b.held();
    let renewals_before = slow.layer().count("renew");

    slow.layer()
        .late_answers_ms
        .store(4_000, std::sync::atomic::Ordering::Relaxed);
    neither_moves_for_a_minute(&a, &b, &held_by_b).await;
    // A slow store is not sent more: at most the renewals of a store that answers at once.
    let renewals = slow.layer().count("renew") - renewals_before;
    let rounds = 60_000 / LeaseSettings::default().renew_interval.as_millis() as u64 + 1;
    assert!(
        renewals <= 4 * rounds,
        "{renewals} renewals of 4 leases in {rounds} rounds"
    );
    slow.layer()
        .late_answers_ms
        .store(0, std::sync::atomic::Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(
        b.held(),
        held_by_b,
        "nothing moved when the answers came back"
    );
    while let Ok(event) = b_events.try_recv() {
        assert!(
            !matches!(event, LeaseEvent::Lost(_)),
            "b lost a lease: {event:?}"
        );
    }
    drop((a, b));
}

/// A worker cut off from the store (beats and renewals fail) gives up its leases before the others
/// judge them free, and they take them over: a worker the roster says is dead, whose counters stay
/// still, holds nothing.
#[tokio::test(start_paused = true)]
async fn a_worker_whose_beat_and_renewals_fail_gives_up_its_leases_and_the_others_take_them() {
    let (_memory, failing, (a, _a_events), (b, _b_events)) = beside_a_counted_worker().await;

    for fail in [&failing.layer().beats_fail, &failing.layer().renewals_fail] {
        fail.store(true, std::sync::atomic::Ordering::Relaxed);
    }
    // Taken once b is dead by the roster (a lease duration and a beat) and its counters were
    // seen still for two renewal rounds and a quarter: never while b still holds one.
    let settings = LeaseSettings::default();
    let start = Instant::now();
    let mut gave_up = None;
    while a.held().len() < 8 {
        let (held_by_a, held_by_b) = (a.held(), b.held());
        assert!(
            held_by_a
                .iter()
                .all(|o| held_by_b.iter().all(|p| p.shard_id != o.shard_id)),
            "a holds a shard b still holds: {held_by_a:?} {held_by_b:?}"
        );
        if held_by_b.is_empty() && gave_up.is_none() {
            gave_up = Some(start.elapsed());
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "a never took them"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let gave_up = gave_up.expect("b gave up before a took them");
    assert!(
        gave_up <= settings.lease_duration,
        "b held on for {gave_up:?}"
    );
    drop(b);
}

/// A worker joining one that has stopped answering (paused with SIGSTOP, or killed: to the joiner
/// they look alike) while its beat and counters still look fresh: the joiner asks for its share,
/// gets no answer, and steals once its patience (handoff timeout + one scan + one renewal) is
/// over, long before it could judge the owner's leases expired or the owner dead (a lease
/// duration, and a beat, of its own observation). The settings are those of the process test
/// `an_owner_paused_past_the_handoff_timeout_is_stolen_from_and_fenced`.
#[tokio::test(start_paused = true)]
async fn a_silent_owner_still_in_the_roster_is_stolen_from_after_the_handoff_patience() {
    let store = MemoryLeaseStore::new();
    let shards = Shards::open(4);
    let settings = LeaseSettings::default()
        .lease_duration(Duration::from_secs(20))
        .scan_interval(Duration::from_millis(500))
        .handoff_timeout(Duration::from_secs(1));
    let start = |name: &'static str| {
        LeaseManager::start(
            Arc::new(store.clone()),
            shards.clone(),
            STREAM,
            name,
            settings.clone(),
            Arc::new(()),
        )
    };
    let (a, _a_events) = start("a").await.unwrap();
    until(Duration::from_secs(30), || owned_by(&store, "a") == 4).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    drop(a); // silent from now on: no renewal, no beat, no answer

    let (b, _b_events) = start("b").await.unwrap();
    let patience = settings.handoff_timeout + settings.scan_interval + settings.renew_interval;
    let took = until(Duration::from_secs(60), || owned_by(&store, "b") == 2).await;
    assert!(
        took >= patience,
        "b had its share after {took:?}, before its patience ({patience:?}) ran out"
    );
    assert!(
        took <= patience + settings.scan_interval * 2,
        "b had its share only after {took:?}: it waited for expiry (the lease duration is {:?}) \
         instead of stealing after its patience ({patience:?})",
        settings.lease_duration
    );
    // Then a is dead by the roster, and b takes the rest.
    let all = until(Duration::from_secs(60), || owned_by(&store, "b") == 4).await;
    assert!(
        took + all <= settings.lease_duration + settings.beat_interval + settings.scan_interval * 2,
        "the rest came after {:?}",
        took + all
    );
    drop(b);
}

/// A balanced worker that scans rarely still learns of a handoff request within one renewal:
/// the renewal returns the row with the request.
#[tokio::test(start_paused = true)]
async fn a_quiet_owner_notices_a_handoff_request_within_one_renewal() {
    let store = MemoryLeaseStore::new();
    let shards = Shards::open(2);
    let (a, mut events) = worker(&store, &shards, "a").await;
    let mut held = Vec::new();
    until(Duration::from_secs(10), || {
        while let Ok(LeaseEvent::Acquired(h)) = events.try_recv() {
            held.push(*h);
        }
        held.len() == 2
    })
    .await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    let row = store
        .get(STREAM, &held[0].ownership.shard_id)
        .await
        .unwrap()
        .unwrap();
    assert!(store.request(&row, "b").await.unwrap());
    let noticed = until(Duration::from_secs(30), || held[0].handoff.is_cancelled()).await;
    assert!(
        noticed <= LeaseSettings::default().renew_interval,
        "noticed after {noticed:?}"
    );
    assert!(!held[1].handoff.is_cancelled());
    drop(a);
}

/// A worker that beats but never takes what falls to it (stopped mid-way, or misbehaving) does
/// not strand leases: after a lease duration, anyone with room takes them.
#[tokio::test(start_paused = true)]
async fn leases_falling_to_a_worker_that_never_takes_them_are_taken_after_a_lease_duration() {
    let store = MemoryLeaseStore::new();
    let shards = Shards::open(8);
    let ghost = tokio::spawn({
        let store = store.clone();
        async move {
            for beat in 1.. {
                store.beat(STREAM, 0, "ghost", beat, false).await.unwrap();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (a, _events) = worker(&store, &shards, "a").await;
    // a counts the ghost: its share is 4, and it takes only the leases that fall to it.
    until(Duration::from_secs(5), || a.held().len() == 4).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(a.held().len(), 4, "the ghost's leases were taken at once");
    // The ghost's share stays free for a lease duration, then a takes it (its share now counts
    // the ghost as holding nothing: the target is still 4, so it takes them as neglected).
    let took = until(Duration::from_secs(30), || owned_by(&store, "a") == 8).await;
    assert!(
        took <= LeaseSettings::default().lease_duration
            + LeaseSettings::default().scan_interval * 2,
        "{took:?}"
    );
    ghost.abort();
}

/// A lease another worker asked for whose shard then reaches its end is released at SHARD_END,
/// not passed: a taker never takes an ended row, so a pass left it owned by a worker that never
/// read it, and an owned row is never cleaned up (issue 27, defect 7). Before, the row named b.
#[tokio::test(start_paused = true)]
async fn an_ended_shard_asked_for_is_released_not_passed() {
    let store = MemoryLeaseStore::new();
    let shards = Shards::open(1);
    let (a, mut events) = worker(&store, &shards, "a").await;
    let mut held = Vec::new();
    until(Duration::from_secs(10), || {
        while let Ok(LeaseEvent::Acquired(h)) = events.try_recv() {
            held.push(*h);
        }
        held.len() == 1
    })
    .await;
    let ownership = held[0].ownership.clone();
    let row = store
        .get(STREAM, &ownership.shard_id)
        .await
        .unwrap()
        .unwrap();
    assert!(store.request(&row, "b").await.unwrap());
    // The handoff is noticed; meanwhile the shard was read to its end.
    until(Duration::from_secs(30), || held[0].handoff.is_cancelled()).await;
    assert_eq!(
        store
            .checkpoint(&ownership, &Checkpoint::ShardEnd, None)
            .await
            .unwrap(),
        CheckpointWrite::Written
    );
    a.shard_ended(&ownership).await.unwrap();
    let row = store
        .get(STREAM, &ownership.shard_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.checkpoint, Checkpoint::ShardEnd);
    assert_eq!(row.owner, None, "released, not passed to b");
    drop(a);
}

/// A lease asked for by a worker that is not alive by the roster (it never beat, or it was scaled
/// in or killed after asking) is released, not handed over: a row naming a worker that is gone
/// waits for the others to judge it by its counter alone (minutes apart, at quiet scans). One
/// asked for by a worker that beats is handed over (issue 27, defect 1).
#[tokio::test(start_paused = true)]
async fn a_lease_asked_for_by_a_worker_that_is_gone_is_released_not_passed() {
    let store = MemoryLeaseStore::new();
    let shards = Shards::open(2);
    let (a, mut events) = worker(&store, &shards, "a").await;
    let mut held = Vec::new();
    until(Duration::from_secs(10), || {
        while let Ok(LeaseEvent::Acquired(h)) = events.try_recv() {
            held.push(*h);
        }
        held.len() == 2
    })
    .await;
    let row_of = |held: &shardwise::lease::HeldLease| {
        let (store, shard) = (store.clone(), held.ownership.shard_id.clone());
        async move { store.get(STREAM, &shard).await.unwrap().unwrap() }
    };

    // "gone" asks and is never seen beating.
    assert!(
        store
            .request(&row_of(&held[0]).await, "gone")
            .await
            .unwrap()
    );
    until(Duration::from_secs(30), || held[0].handoff.is_cancelled()).await;
    assert!(a.release(&held[0].ownership).await.unwrap());
    let row = row_of(&held[0]).await;
    assert_ne!(row.owner.as_deref(), Some("gone"), "{row:?}");

    // "alive" beats, then asks: the lease is handed over.
    let beating = {
        let store = store.clone();
        tokio::spawn(async move {
            for beat in 1.. {
                store.beat(STREAM, 0, "alive", beat, false).await.unwrap();
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        store
            .request(&row_of(&held[1]).await, "alive")
            .await
            .unwrap()
    );
    until(Duration::from_secs(30), || held[1].handoff.is_cancelled()).await;
    assert!(a.release(&held[1].ownership).await.unwrap());
    assert_eq!(row_of(&held[1]).await.owner.as_deref(), Some("alive"));
    beating.abort();
    drop(a);
}

/// A worker shutting down releases the rows passed to it that it has not taken yet: nobody else
/// would take them before their counters went still for a lease duration (issue 27, defect 1).
#[tokio::test(start_paused = true)]
async fn a_worker_shutting_down_releases_leases_passed_to_it_and_not_taken() {
    let store = MemoryLeaseStore::new();
    let shards = Shards::open(2);
    let (a, mut events) = worker(&store, &shards, "a").await;
    let mut held = Vec::new();
    until(Duration::from_secs(10), || {
        while let Ok(LeaseEvent::Acquired(h)) = events.try_recv() {
            held.push(*h);
        }
        held.len() == 2
    })
    .await;
    // b beats (alive) but takes nothing: it stops taking before the pass comes.
    let (b, _b_events) = worker(&store, &shards, "b").await;
    b.stop_taking();
    let row = store
        .get(STREAM, &held[0].ownership.shard_id)
        .await
        .unwrap()
        .unwrap();
    assert!(store.request(&row, "b").await.unwrap());
    until(Duration::from_secs(30), || held[0].handoff.is_cancelled()).await;
    assert!(a.release(&held[0].ownership).await.unwrap());
    let passed = store
        .get(STREAM, &held[0].ownership.shard_id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(passed.owner.as_deref(), Some("b"), "handed over to b");
    assert_eq!(b.held().len(), 0, "b took nothing");
    b.shutdown().await;
    let after = store
        .get(STREAM, &held[0].ownership.shard_id)
        .await
        .unwrap()
        .unwrap();
    assert_ne!(after.owner.as_deref(), Some("b"), "{after:?}");
    drop(a);
}

/// Holds every pass this long before it reaches the store (a slow network, a store under load).
#[derive(Debug)]
struct SlowPasses(Duration);

impl Layer for SlowPasses {
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: Call<'a>,
        forward: BoxFuture<'a, Result<T, Error>>,
    ) -> BoxFuture<'a, Result<T, Error>> {
        if !matches!(call, Call::Pass { .. }) {
            return forward;
        }
        let slow = self.0;
        Box::pin(async move {
            tokio::time::sleep(slow).await;
            forward.await
        })
    }
}

/// A lease is Passing from the moment its work ended until the pass answers: the owner's scans
/// meanwhile see the row still naming it and leave it alone. Before, the lease was dropped from
/// what the worker held before the pass was sent, and a scan in that window took "a row naming
/// me that I do not hold" back: the pass was then refused (the epoch had moved), the taker's
/// request was gone, and the owner read the shard again (issue 27, the state no diagram named).
#[tokio::test(start_paused = true)]
async fn a_lease_being_passed_is_not_taken_back_by_its_owners_scan() {
    let memory = MemoryLeaseStore::new();
    let shards = Shards::open(2);
    let slow = Arc::new(Layered::new(
        Arc::new(memory.clone()),
        SlowPasses(Duration::from_secs(5)),
    ));
    let (a, mut events) = start_on(slow, &shards, "a").await.unwrap();
    let a = Arc::new(a);
    let mut held = Vec::new();
    until(Duration::from_secs(10), || {
        while let Ok(LeaseEvent::Acquired(h)) = events.try_recv() {
            held.push(*h);
        }
        held.len() == 2
    })
    .await;
    // "alive" beats and takes nothing; every beat after the first raises the roster's changes,
    // so a scans about once a second.
    let beating = {
        let store = memory.clone();
        tokio::spawn(async move {
            for beat in 1.. {
                store
                    .beat(STREAM, 0, "alive", beat, beat > 1)
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(1_000)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    let shard = held[1].ownership.shard_id.clone();
    let row = memory.get(STREAM, &shard).await.unwrap().unwrap();
    assert!(memory.request(&row, "alive").await.unwrap());
    until(Duration::from_secs(30), || held[1].handoff.is_cancelled()).await;
    let passed = a.release(&held[1].ownership).await.unwrap();
    let row = memory.get(STREAM, &shard).await.unwrap().unwrap();
    let mut taken_back = 0;
    while let Ok(event) = events.try_recv() {
        if let LeaseEvent::Acquired(h) = event
            && h.ownership.shard_id == shard
        {
            taken_back += 1;
        }
    }
    assert_eq!(
        taken_back, 0,
        "the owner took back the lease it was passing"
    );
    assert!(passed, "the pass was refused: {row:?}");
    assert_eq!(row.owner.as_deref(), Some("alive"), "{row:?}");
    beating.abort();
}

/// A steal that fails (the store's answer is an error) is tried again: the request stays while
/// the row still names this worker as its taker. Before, the failed steal forgot the request while
/// the row kept `wantedBy`: nobody asked again and nobody stole, and the worker stayed below its
/// share behind an owner that renews but never hands over (issue 27, defect 4).
#[tokio::test(start_paused = true)]
async fn a_steal_that_fails_is_tried_again() {
    let memory = MemoryLeaseStore::new();
    let shards = Shards::open(8);
    // a renews but never answers a handoff request (a stuck shard task, an older version).
    let (a, _a_events) = worker(&memory, &shards, "a").await;
    until(Duration::from_secs(30), || a.held().len() == 8).await;
    let failing = counting(memory.clone());
    failing
        .layer()
        .takes_fail
        .store(4, std::sync::atomic::Ordering::Relaxed);
    let (b, _b_events) = start_on(failing.clone(), &shards, "b").await.unwrap();
    until(Duration::from_secs(120), || b.held().len() == 4).await;
    assert_eq!(
        failing
            .layer()
            .takes_fail
            .load(std::sync::atomic::Ordering::Relaxed),
        0,
        "the first four takes failed"
    );
    drop((a, b));
}

/// Leases still naming an owner that is gone (killed), whose share falls to a worker that never
/// takes them, are taken by anyone after two lease durations, as free ones are after one. Before,
/// an expired lease that named an owner was shared out by rank only: the worker it fell to never
/// took it, and it stayed unread (issue 27, defect 1).
#[tokio::test(start_paused = true)]
async fn expired_leases_of_a_gone_owner_falling_to_a_worker_that_never_takes_them_are_taken() {
    let store = MemoryLeaseStore::new();
    let shards = Shards::open(8);
    let (gone, _gone_events) = worker(&store, &shards, "gone").await;
    until(Duration::from_secs(10), || gone.held().len() == 8).await;
    let ghost = tokio::spawn({
        let store = store.clone();
        async move {
            for beat in 1.. {
                store.beat(STREAM, 0, "ghost", beat, false).await.unwrap();
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(gone); // killed: no renewal, no beat
    let (a, _events) = worker(&store, &shards, "a").await;
    until(Duration::from_secs(60), || a.held().len() >= 4).await;
    let settings = LeaseSettings::default();
    let took = until(Duration::from_secs(120), || owned_by(&store, "a") == 8).await;
    assert!(
        took <= settings.lease_duration * 2 + settings.scan_interval * 2,
        "{took:?}"
    );
    ghost.abort();
}

/// Two processes under one worker id (containers with host networking share the host name and
/// run as PID 1; an operator copies a `--worker-id`). The second refuses to start, naming the id,
/// and the first keeps every lease. Before, the second started, took every row naming the id as
/// its own from an earlier life, and the two traded the leases back and forth.
#[tokio::test(start_paused = true)]
async fn a_second_process_under_a_running_workers_id_refuses_to_start_and_the_first_keeps_its_leases()
 {
    let store = MemoryLeaseStore::new();
    let shards = Shards::open(4);
    let (first, mut events) = worker(&store, &shards, "web-1").await;
    until(Duration::from_secs(30), || first.held().len() == 4).await;
    while events.try_recv().is_ok() {}

    let second = start_on(Arc::new(store.clone()), &shards, "web-1").await;
    let Err(err) = second else {
        panic!("the second process started");
    };
    assert!(matches!(err, Error::WorkerIdInUse { .. }), "{err:?}");
    assert!(err.to_string().contains("worker id `web-1`"), "{err}");

    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(first.held().len(), 4, "the first kept every lease");
    assert!(
        events.try_recv().is_err(),
        "the first's leases did not move"
    );
    assert!(!first.probe().gave_way());
    first.shutdown().await;
}

/// A worker restarted under its own id after a crash (its nonce is left in the roster) is not a
/// second process: it starts a beat interval later and takes its leases back.
#[tokio::test(start_paused = true)]
async fn a_worker_restarted_under_its_id_after_a_crash_starts_and_takes_its_leases_back() {
    let settings = LeaseSettings::default();
    let store = MemoryLeaseStore::new();
    let shards = Shards::open(4);
    let (crashed, _events) = worker(&store, &shards, "web-1").await;
    until(Duration::from_secs(30), || crashed.held().len() == 4).await;
    drop(crashed); // kill -9

    let started = Instant::now();
    let (restarted, _events) = worker(&store, &shards, "web-1").await;
    let start = started.elapsed();
    assert!(
        start <= settings.beat_interval + Duration::from_millis(100),
        "started after {start:?}"
    );
    let took = until(Duration::from_secs(30), || restarted.held().len() == 4).await;
    assert!(
        took <= settings.scan_interval,
        "took its leases back after {took:?}"
    );
    restarted.shutdown().await;
}

/// A worker restarted under its own id after a crash, whose predecessor's last beat lands after
/// the restart (a request sent just before the crash, delayed on its way): one beat of another
/// process is not a second process, so the restarted worker keeps its leases and runs on.
/// Before, it took the late beat for a twin that came before it, gave up every lease and stopped
/// (the simulation found it: short seed 7576 once beats were waited for longer).
#[tokio::test(start_paused = true)]
async fn a_crashed_workers_last_beat_landing_after_its_restart_is_not_a_second_process() {
    let store = MemoryLeaseStore::new();
    let shards = Shards::open(4);
    let (crashed, _events) = worker(&store, &shards, "web-1").await;
    until(Duration::from_secs(30), || crashed.held().len() == 4).await;
    // The beat the crashed process last wrote, as the roster holds it (read by a passer-by that
    // leaves again).
    let roster = store.beat(STREAM, 0, "reader", 1, false).await.unwrap();
    store.forget(STREAM, 0, "reader", None).await.unwrap();
    let last = roster.beats["web-1"];
    drop(crashed); // kill -9, with one more beat on its way

    let (restarted, mut events) = worker(&store, &shards, "web-1").await;
    until(Duration::from_secs(30), || restarted.held().len() == 4).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    // The beat on its way lands: the crashed process's next count.
    store
        .beat(STREAM, 0, "web-1", last + 1, false)
        .await
        .unwrap();
    for _ in 0..200 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            restarted.held().len(),
            4,
            "the restarted worker keeps its leases"
        );
        assert!(
            !restarted.probe().gave_way(),
            "the restarted worker gave way"
        );
    }
    while let Ok(event) = events.try_recv() {
        assert!(
            !matches!(event, LeaseEvent::Stop(_) | LeaseEvent::Lost(_)),
            "{event:?}"
        );
    }
    restarted.shutdown().await;
}

/// Two processes under one id started at the same moment: whichever order their beats take, one
/// ends up holding every lease and the other none (it refused to start, or gave way once it saw
/// the other's beats, and says so in its probe).
#[tokio::test(start_paused = true)]
async fn twins_started_together_end_with_one_holding_every_lease() {
    for _ in 0..5 {
        let store = MemoryLeaseStore::new();
        let shards = Shards::open(4);
        let start = || start_on(Arc::new(store.clone()), &shards, "web-1");
        let (a, b) = tokio::join!(start(), start());
        let running: Vec<_> = [a, b]
            .into_iter()
            .filter_map(|started| match started {
                Ok((manager, events)) => Some((manager, events)),
                Err(e) => {
                    assert!(matches!(e, Error::WorkerIdInUse { .. }), "{e:?}");
                    None
                }
            })
            .collect();
        assert!(!running.is_empty(), "one of them runs");
        tokio::time::sleep(Duration::from_secs(60)).await;
        let holding: Vec<usize> = running.iter().map(|(m, _)| m.held().len()).collect();
        eprintln!("started: {}, holding {holding:?}", running.len());
        let gave_way = running.iter().filter(|(m, _)| m.probe().gave_way()).count();
        assert!(holding.contains(&4), "one holds every lease: {holding:?}");
        assert_eq!(holding.iter().sum::<usize>(), 4, "{holding:?}");
        assert_eq!(gave_way, running.len() - 1, "the other gave way");
        // The one that gave way stops; the rows and the roster entry are the other's.
        let (stopped, kept): (Vec<_>, Vec<_>) =
            running.into_iter().partition(|(m, _)| m.probe().gave_way());
        for (manager, _) in stopped {
            assert_eq!(manager.shutdown().await, 0);
        }
        let (holder, mut events) = kept.into_iter().next().expect("the holder");
        while events.try_recv().is_ok() {}
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!(holder.held().len(), 4, "the holder kept every lease");
        assert!(
            events.try_recv().is_err(),
            "the holder's leases did not move"
        );
        holder.shutdown().await;
    }
}

/// Twins both past their start: the second started while the first's beats went unwritten, so
/// its check at start saw nothing and it retook the rows naming the id. Once the first's beats
/// are written again, the second (whose first beat found the first's) gives way without a write
/// and takes nothing more; the first takes its rows back and keeps them.
#[tokio::test(start_paused = true)]
async fn a_twin_that_started_unseen_gives_way_once_the_first_beats_again() {
    let memory = MemoryLeaseStore::new();
    let shards = Shards::open(4);
    let beats = counting(memory.clone());
    let (first, _first_events) = start_on(beats.clone(), &shards, "web-1").await.unwrap();
    until(Duration::from_secs(30), || first.held().len() == 4).await;

    let unwritten = |on| {
        beats
            .layer()
            .beats_fail
            .store(on, std::sync::atomic::Ordering::Relaxed);
    };
    unwritten(true);
    let (second, mut second_events) = worker(&memory, &shards, "web-1").await;
    until(Duration::from_secs(30), || !second.held().is_empty()).await;
    assert!(!second.probe().gave_way());

    unwritten(false);
    until(Duration::from_secs(60), || {
        second.probe().gave_way() && second.held().is_empty() && first.held().len() == 4
    })
    .await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(first.held().len(), 4, "the first keeps every lease");
    assert!(second.held().is_empty(), "the second takes nothing more");
    let mut stop = None;
    while let Ok(event) = second_events.try_recv() {
        if let LeaseEvent::Stop(error) = event {
            stop = Some(error);
        }
    }
    let stop = stop.expect("the second tells its consumer to stop");
    assert!(matches!(*stop, Error::WorkerIdInUse { .. }), "{stop:?}");
    assert!(!first.probe().gave_way());
    assert_eq!(second.shutdown().await, 0);
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(
        first.held().len(),
        4,
        "the second's shutdown left the id's rows alone"
    );
    first.shutdown().await;
}

/// Hides the rows it names from `list` and `get`, as a scan of DynamoDB that passed a row's place
/// before the row was created does not return it (issue 27, defect 8).
#[derive(Debug, Default)]
struct Hide(Mutex<Vec<String>>);

impl Layer for Hide {
    fn view(&self, row: shardwise::Lease) -> Option<shardwise::Lease> {
        (!self.0.lock().unwrap().contains(&row.shard_id)).then_some(row)
    }
}

/// A scan that misses a parent's row (a paginated scan racing the sync that creates rows one by
/// one) does not take the child for one whose parent aged out: the listing still names the
/// parent, so the child waits, and is not read before its parent. Before, a missing parent row
/// counted as ended, and the child was read from TRIM_HORIZON at once: per-key order across the
/// split lost.
#[tokio::test(start_paused = true)]
async fn a_child_whose_parent_row_a_scan_missed_waits_for_its_parent() {
    let shards = Arc::new(Shards(Mutex::new(vec![
        ShardInfo {
            shard_id: "parent".into(),
            parents: vec![],
            closed: true,
        },
        ShardInfo {
            shard_id: "child".into(),
            parents: vec!["parent".into()],
            closed: false,
        },
    ])));
    let memory = MemoryLeaseStore::new();
    let hidden = Arc::new(Layered::new(Arc::new(memory.clone()), Hide::default()));
    hidden.layer().0.lock().unwrap().push("parent".into());
    let (a, _events) = start_on(hidden.clone(), &shards, "a").await.unwrap();
    assert_eq!(memory.snapshot().len(), 2, "both rows exist");
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(a.held().is_empty(), "the child waits: {:?}", a.held());

    hidden.layer().0.lock().unwrap().clear();
    until(Duration::from_secs(30), || a.held().len() == 1).await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    let held: Vec<String> = a.held().into_iter().map(|o| o.shard_id).collect();
    assert_eq!(
        held,
        ["parent"],
        "the parent first; the child waits for its end"
    );
    a.shutdown().await;
}

/// Renewals pass until armed; the next one is applied at once and answered 3 s later (inside the
/// attempt timeout), and every renewal after it fails.
#[derive(Debug, Default)]
struct LateThenFailing(Mutex<LateState>);

#[derive(Debug, Default)]
struct LateState {
    armed: bool,
    failing: bool,
    /// When the late renewal was applied.
    applied_at: Option<Instant>,
}

impl Layer for LateThenFailing {
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: Call<'a>,
        forward: BoxFuture<'a, Result<T, Error>>,
    ) -> BoxFuture<'a, Result<T, Error>> {
        if !matches!(call, Call::Renew(_)) {
            return forward;
        }
        let mut state = self.0.lock().unwrap();
        if state.failing {
            return Box::pin(async {
                Err(Error::Config(shardwise::ConfigError::new(
                    "renew",
                    "unreachable",
                    "injected",
                )))
            });
        }
        if !std::mem::take(&mut state.armed) {
            return forward;
        }
        state.failing = true;
        drop(state);
        Box::pin(async move {
            let answer = forward.await;
            self.0.lock().unwrap().applied_at = Some(Instant::now());
            tokio::time::sleep(Duration::from_secs(3)).await;
            answer
        })
    }
}

/// Issue 27, defect 6: the others judge a lease from when they saw its counter move, which is no
/// earlier than when the renewal was applied; so the owner judges it from when the last renewal
/// that landed was sent, not from when its answer came. A renewal answered 3 s late, then failing
/// renewals: the owner gives the lease up at least half a renewal interval (the margin of
/// `LeaseSettings::hold_until`, docs/leases.md) before the others may see it expired (the renewal
/// applied + lease_duration). Judged from the answer, it would give it up 3 s later, after the
/// others may take it. (This test asked for a whole renewal interval while renewals were given
/// up round by round; a renewal answered 4 s late could then never keep a lease, which issue 27
/// requires, and docs/leases.md has always promised 1.7 s at the defaults.)
#[tokio::test(start_paused = true)]
async fn a_renewal_answered_late_is_judged_from_when_it_was_sent() {
    let memory = MemoryLeaseStore::new();
    let shards = Shards::open(1);
    let layer = Arc::new(Layered::new(
        Arc::new(memory.clone()),
        LateThenFailing::default(),
    ));
    let (a, mut events) = start_on(layer.clone(), &shards, "a").await.unwrap();
    until(Duration::from_secs(30), || a.held().len() == 1).await;
    while events.try_recv().is_ok() {}
    layer.layer().0.lock().unwrap().armed = true;
    let lost_at = loop {
        match events.recv().await.expect("the manager runs") {
            LeaseEvent::Lost(_) => break Instant::now(),
            _ => continue,
        }
    };
    let applied_at = layer.layer().0.lock().unwrap().applied_at.expect("applied");
    let settings = LeaseSettings::default();
    let others_may_take = applied_at + settings.lease_duration;
    assert!(
        lost_at + settings.renew_interval / 2 <= others_may_take,
        "given up {:?} after the late renewal was applied; the others may see it expired {:?} after",
        lost_at - applied_at,
        settings.lease_duration
    );
}

/// How long each lease row has been unread (no owner, or an owner that is not alive), sampled
/// every 100 ms from the store: the longest such spell since the last [`Unread::take`].
struct Unread {
    alive: Arc<Mutex<std::collections::HashSet<String>>>,
    longest: Arc<Mutex<(Duration, String)>>,
    sampler: tokio::task::JoinHandle<()>,
}

impl Unread {
    fn watch(memory: &MemoryLeaseStore, alive: &[String]) -> Self {
        let alive = Arc::new(Mutex::new(
            alive
                .iter()
                .cloned()
                .collect::<std::collections::HashSet<String>>(),
        ));
        let longest = Arc::new(Mutex::new((Duration::ZERO, String::new())));
        let sampler = tokio::spawn({
            let (memory, alive, longest) = (memory.clone(), alive.clone(), longest.clone());
            async move {
                let mut since: std::collections::HashMap<String, Instant> =
                    std::collections::HashMap::new();
                loop {
                    let now = Instant::now();
                    let live = alive.lock().unwrap().clone();
                    for row in memory.snapshot() {
                        let read = row.owner.as_ref().is_some_and(|o| live.contains(o))
                            || row.checkpoint.is_shard_end();
                        if read {
                            since.remove(&row.shard_id);
                            continue;
                        }
                        let from = *since.entry(row.shard_id.clone()).or_insert(now);
                        let mut longest = longest.lock().unwrap();
                        if now - from > longest.0 {
                            *longest = (now - from, row.shard_id.clone());
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        });
        Self {
            alive,
            longest,
            sampler,
        }
    }

    fn alive(&self, worker: &str, alive: bool) {
        let mut set = self.alive.lock().unwrap();
        if alive {
            set.insert(worker.to_string());
        } else {
            set.remove(worker);
        }
    }

    fn take(&self) -> (Duration, String) {
        std::mem::take(&mut *self.longest.lock().unwrap())
    }
}

impl Drop for Unread {
    fn drop(&mut self) {
        self.sampler.abort();
    }
}

/// Issue 27, at fleet scale: 2,000 shards and 200 workers with 40-character ids (host name, pid and
/// a random part), DynamoDB's per-item limit kept (1,000 write units a second, a unit per KB
/// written). Started together, the fleet balances (10 leases each) within 60 s; at steady state no
/// item takes more than 500 write units a second; then each single change, once the fleet is
/// quiet (a join, a leave, a kill -9, a scale-in during a join), leaves no lease unread (no owner,
/// or an owner that is gone) longer than a lease duration and two scan intervals.
///
/// Defect 2: the roster's write rate must not grow with the square of the fleet. One roster item
/// of 200 entries is about 11 KB: 11 units a beat, 2,200 a second from 200 workers, so beats were
/// throttled and the fleet never balanced. Split into sections of at most 32 workers, it does.
#[tokio::test(start_paused = true)]
async fn a_fleet_of_200_workers_on_2000_shards_balances_and_each_change_leaves_no_lease_unread() {
    let settings = LeaseSettings::default();
    let bound = settings.lease_duration + settings.scan_interval * 2;
    let memory = MemoryLeaseStore::new();
    memory.service_limits();
    let counted = counting(memory.clone());
    let store: Arc<dyn LeaseStore> = counted.clone();
    let shards = Shards::open(2_000);
    let id = |i: usize| {
        format!(
            "ip-10-0-{:03}-{:03}.eu-west-1.compute.internal-{:06}",
            i / 7,
            i % 7,
            i * 31
        )
    };
    let mut names: Vec<String> = (0..200).map(id).collect();
    assert!(names.iter().all(|n| n.len() >= 40));
    let mut workers = futures::future::join_all(
        names
            .iter()
            .map(|name| cooperating(store.clone(), &shards, name, settings.clone())),
    )
    .await;
    let balanced = |workers: &[Arc<LeaseManager>]| {
        let loads: Vec<usize> = workers.iter().map(|w| w.held().len()).collect();
        let (min, max) = (loads.iter().min().copied(), loads.iter().max().copied());
        loads.iter().sum::<usize>() == 2_000
            && max.zip(min).is_some_and(|(max, min)| max - min <= 1)
    };
    let took = until(Duration::from_secs(60), || balanced(&workers)).await;
    eprintln!("200 workers balanced 2,000 shards in {took:?}");
    eprintln!("starting: busiest item {:?}", memory.busiest_item());
    tokio::time::sleep(Duration::from_secs(10)).await;
    // Requests a minute at steady state, by kind, for the whole fleet.
    let before = counted.layer().counts();
    tokio::time::sleep(Duration::from_secs(20)).await;
    let per_minute: Vec<(&str, u64)> = counted
        .layer()
        .counts()
        .into_iter()
        .map(|(kind, n)| (kind, (n - before.get(kind).copied().unwrap_or(0)) * 3))
        .filter(|(_, n)| *n > 0)
        .collect();
    eprintln!("steady: requests a minute by kind: {per_minute:?}");
    let rate = |kind: &str| {
        per_minute
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(0, |(_, n)| *n)
    };
    // 2,000 leases renewed every 3.3 s, 200 beats a second: nothing else grows with the fleet.
    assert!(rate("renew") <= 2_000 * 19, "{per_minute:?}");
    assert!(rate("beat") <= 200 * 61, "{per_minute:?}");
    assert_eq!(
        rate("take") + rate("request") + rate("pass"),
        0,
        "nothing moves: {per_minute:?}"
    );
    let loads: Vec<usize> = names.iter().map(|w| owned_by(&memory, w)).collect();
    assert!(loads.iter().all(|n| *n == 10), "steady: {loads:?}");
    let (item, units) = memory.busiest_item().expect("items were written");
    eprintln!("steady: busiest item {item}: {units} write units in one second");
    assert!(
        units <= 500,
        "{item} took {units} write units in one second"
    );

    // The roster holds every worker once (each moved worker removed the entry it left), in 8
    // sections of about 25.
    let everyone = |store: Arc<dyn LeaseStore>| async move {
        let count = store.read_roster(STREAM, &[0]).await.unwrap()[0]
            .sections
            .unwrap();
        let all: Vec<u32> = (0..count).collect();
        let sections = store.read_roster(STREAM, &all).await.unwrap();
        let mut entries: Vec<String> = sections
            .iter()
            .flat_map(|s| s.beats.keys().cloned())
            .collect();
        entries.sort();
        (count, entries)
    };
    let sorted = |names: &[String]| {
        let mut sorted = names.to_vec();
        sorted.sort();
        sorted
    };
    let (count, entries) = everyone(store.clone()).await;
    assert_eq!(count, 8);
    assert_eq!(entries, sorted(&names), "each worker once");

    let unread = Unread::watch(&memory, &names);
    let quiet = |what: &str, unread: &Unread| {
        let (longest, shard) = unread.take();
        eprintln!("{what}: the longest a lease was unread: {longest:?} ({shard})");
        assert!(
            longest <= bound,
            "{what}: {shard} was unread for {longest:?}, past {bound:?}"
        );
    };

    // A join: the 201st worker takes its share (9 or 10) by handoff.
    names.push(id(200));
    unread.alive(&names[200], true);
    workers.push(cooperating(store.clone(), &shards, &names[200], settings.clone()).await);
    let took = until(Duration::from_secs(60), || balanced(&workers)).await;
    eprintln!("a join: balanced again in {took:?}");
    tokio::time::sleep(Duration::from_secs(20)).await;
    quiet("a join", &unread);

    // A leave (graceful): its leases are released and taken.
    let leaving = Arc::try_unwrap(workers.remove(7)).expect("one owner");
    let left = names.remove(7);
    leaving.shutdown().await;
    unread.alive(&left, false);
    let took = until(Duration::from_secs(60), || balanced(&workers)).await;
    eprintln!("a leave: balanced again in {took:?}");
    tokio::time::sleep(Duration::from_secs(20)).await;
    quiet("a leave", &unread);

    // A kill -9: no release, no more renewals or beats.
    let killed = names.remove(11);
    unread.alive(&killed, false);
    drop(workers.remove(11));
    let took = until(Duration::from_secs(60), || balanced(&workers)).await;
    eprintln!("a kill -9: balanced again in {took:?}");
    tokio::time::sleep(Duration::from_secs(20)).await;
    quiet("a kill -9", &unread);

    // A scale-in during a join: a worker joins, asks for its share, and is killed before it
    // holds it all.
    let joining = id(201);
    unread.alive(&joining, true);
    let joiner = cooperating(store.clone(), &shards, &joining, settings.clone()).await;
    until(Duration::from_secs(30), || {
        memory
            .snapshot()
            .iter()
            .any(|r| r.wanted_by.as_deref() == Some(joining.as_str()))
    })
    .await;
    unread.alive(&joining, false);
    drop(joiner);
    let took = until(Duration::from_secs(60), || balanced(&workers)).await;
    eprintln!("a scale-in during a join: balanced again in {took:?}");
    tokio::time::sleep(Duration::from_secs(20)).await;
    quiet("a scale-in during a join", &unread);

    // One worker leaves and starts again under its id (reading the count first, it beats in its
    // own section): it takes its share back and is in the roster once.
    let leaving = Arc::try_unwrap(workers.remove(3)).expect("one owner");
    leaving.shutdown().await;
    let back = cooperating(store.clone(), &shards, &names[3], settings.clone()).await;
    workers.insert(3, back);
    until(Duration::from_secs(60), || balanced(&workers)).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (_, entries) = everyone(store.clone()).await;
    assert_eq!(entries, sorted(&names), "each live worker once");
    drop(workers);
}

/// Starts `name` on `store` and answers its handoff requests as a consumer whose drain takes
/// `drain` does: a lease asked for is released (which passes it on) `drain` after the request was
/// noticed. Returns the manager and the number of leases it lost (taken from it: stolen).
async fn draining(
    store: Arc<dyn LeaseStore>,
    shards: &Arc<Shards>,
    name: &str,
    drain: Duration,
) -> (Arc<LeaseManager>, Arc<std::sync::atomic::AtomicU64>) {
    let (manager, mut events) = start_on(store, shards, name).await.expect("manager starts");
    let manager = Arc::new(manager);
    let lost = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let weak = Arc::downgrade(&manager);
    let counted = lost.clone();
    tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            match event {
                LeaseEvent::Acquired(held) => {
                    let weak = weak.clone();
                    tokio::spawn(async move {
                        tokio::select! {
                            _ = held.cancel.cancelled() => {}
                            _ = held.handoff.cancelled() => {
                                tokio::time::sleep(drain).await;
                                if let Some(manager) = weak.upgrade() {
                                    let _ = manager.release(&held.ownership).await;
                                }
                            }
                        }
                    });
                }
                LeaseEvent::Lost(_) => {
                    counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                _ => {}
            }
        }
    });
    (manager, lost)
}

/// Issue 27, defect 5: a taker's patience counts from the owner's acknowledgement, not from its
/// own request. The owner's store answers 4 s late (each write applied at once), so it notices a
/// request up to 7.3 s after it was made (a renewal interval, and the answer's delay); then it
/// drains for the whole handoff timeout (5 s) and writes its final checkpoint (4 s more for the
/// answer): 9 s. Before, the taker stole after 10.3 s from its request, while the owner was still
/// draining (every lease it asked for was stolen, each record in flight handled twice); now the
/// owner stamps the row when it notices, the taker waits 10.3 s from seeing that, and every lease
/// is passed.
#[tokio::test(start_paused = true)]
async fn a_slow_owner_draining_for_the_whole_handoff_timeout_passes_every_lease_asked_for() {
    let memory = MemoryLeaseStore::new();
    let shards = Shards::open(8);
    let slow = counting(memory.clone());
    let (a, stolen) = draining(slow.clone(), &shards, "a", Duration::from_secs(9)).await;
    until(Duration::from_secs(30), || a.held().len() == 8).await;
    slow.layer()
        .late_answers_ms
        .store(4_000, std::sync::atomic::Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let acknowledged = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let taken_from_a = Arc::new(std::sync::atomic::AtomicU64::new(0));
    memory.observe({
        let (acknowledged, taken_from_a) = (acknowledged.clone(), taken_from_a.clone());
        Arc::new(move |change: &shardwise::lease::Change| {
            let from_a = change
                .before
                .as_ref()
                .is_some_and(|r| r.owner.as_deref() == Some("a"));
            match change.operation {
                "acknowledge" => {
                    acknowledged.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                "take" if from_a => {
                    taken_from_a.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                _ => {}
            }
        })
    });

    let b = cooperating(
        Arc::new(memory.clone()),
        &shards,
        "b",
        LeaseSettings::default(),
    )
    .await;
    let took = until(Duration::from_secs(60), || b.held().len() == 4).await;
    eprintln!("b holds its share after {took:?}");
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(
        (
            taken_from_a.load(std::sync::atomic::Ordering::Relaxed),
            stolen.load(std::sync::atomic::Ordering::Relaxed)
        ),
        (0, 0),
        "leases were stolen from the draining owner"
    );
    assert_eq!((owned_by(&memory, "a"), owned_by(&memory, "b")), (4, 4));
    assert_eq!(
        acknowledged.load(std::sync::atomic::Ordering::Relaxed),
        4,
        "each request acknowledged"
    );
    drop((a, b));
}

/// What the issue 57 scale-in tests bound: a lease whose reader left is read again within a
/// lease duration and two scans.
fn unread_bound() -> Duration {
    let settings = LeaseSettings::default();
    settings.lease_duration + settings.scan_interval * 2
}

/// Holds every pass this long before it reaches the store, and notes that one began.
#[derive(Debug, Default)]
struct SlowPassesNoted {
    delay: Duration,
    began: Arc<std::sync::atomic::AtomicBool>,
}

impl Layer for SlowPassesNoted {
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: Call<'a>,
        forward: BoxFuture<'a, Result<T, Error>>,
    ) -> BoxFuture<'a, Result<T, Error>> {
        if !matches!(call, Call::Pass { .. }) {
            return forward;
        }
        self.began.store(true, std::sync::atomic::Ordering::SeqCst);
        let delay = self.delay;
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            forward.await
        })
    }
}

/// Waits until the row of `shard` names one of `takers` (a take writes the row), and asserts
/// that it came within [`unread_bound`].
async fn assert_read_again_by(memory: &MemoryLeaseStore, shard: &str, takers: &[&str]) {
    let took = until(Duration::from_secs(300), || {
        memory
            .snapshot()
            .iter()
            .any(|l| l.shard_id == shard && takers.contains(&l.owner.as_deref().unwrap_or("")))
    })
    .await;
    assert!(
        took <= unread_bound(),
        "the lease was read again after {took:?}, over {:?}",
        unread_bound()
    );
}

/// A graceful scale-in while a lease is being passed to the leaving worker: b asks, the owner's
/// pass is under way (slow), b shuts down (it holds nothing and no row names it yet) and leaves
/// the roster, then the pass lands and the row names b. Nobody judged b dead (it left the roster
/// rather than going silent), so the row waited for a quiet scan: 16-24 s at two live workers,
/// 27-40 min at 200 (issue 57, defect 1). Now a worker gone from the roster is judged as one whose
/// beat stopped when it left, and a row naming it is watched at the scan interval.
#[tokio::test(start_paused = true)]
async fn a_lease_passed_to_a_worker_that_left_meanwhile_is_read_again_within_a_lease_duration_and_two_scans()
 {
    let memory = MemoryLeaseStore::new();
    let shards = Shards::open(4);
    let began = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let slow = Arc::new(Layered::new(
        Arc::new(memory.clone()),
        SlowPassesNoted {
            delay: Duration::from_secs(3),
            began: began.clone(),
        },
    ));
    let a = cooperating(slow, &shards, "a", LeaseSettings::default()).await;
    until(Duration::from_secs(10), || owned_by(&memory, "a") == 4).await;
    let c = cooperating(
        Arc::new(memory.clone()),
        &shards,
        "c",
        LeaseSettings::default(),
    )
    .await;
    until(Duration::from_secs(60), || owned_by(&memory, "c") == 2).await;
    let (b, _b_events) = worker(&memory, &shards, "b").await;
    b.stop_taking();
    tokio::time::sleep(Duration::from_secs(3)).await;
    began.store(false, std::sync::atomic::Ordering::SeqCst);

    let row = memory
        .snapshot()
        .into_iter()
        .find(|l| l.owner.as_deref() == Some("a"))
        .unwrap();
    let shard = row.shard_id.clone();
    assert!(memory.request(&row, "b").await.unwrap());
    until(Duration::from_secs(30), || {
        began.load(std::sync::atomic::Ordering::SeqCst)
    })
    .await;
    b.shutdown().await;
    until(Duration::from_secs(10), || {
        memory
            .snapshot()
            .iter()
            .any(|l| l.shard_id == shard && l.owner.as_deref() == Some("b"))
    })
    .await;

    assert_read_again_by(&memory, &shard, &["a", "c"]).await;
    drop((a, c));
}

/// The error an injected fault answers with.
fn injected(what: &'static str, why: &str) -> Error {
    Error::Config(shardwise::ConfigError::new(
        what,
        "",
        format!("injected: {why}"),
    ))
}

/// Fails every release (a store that is down while a worker shuts down).
#[derive(Debug)]
struct FailingReleases;

impl Layer for FailingReleases {
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: Call<'a>,
        forward: BoxFuture<'a, Result<T, Error>>,
    ) -> BoxFuture<'a, Result<T, Error>> {
        if !matches!(call, Call::Release(_)) {
            return forward;
        }
        Box::pin(async { Err(injected("release", "the store is unreachable")) })
    }
}

/// A release that fails at shutdown strands the lease the same way: the row names a worker
/// that left the roster (issue 57, defect 1).
#[tokio::test(start_paused = true)]
async fn a_lease_whose_release_failed_at_shutdown_is_read_again_within_a_lease_duration_and_two_scans()
 {
    let memory = MemoryLeaseStore::new();
    let shards = Shards::open(4);
    let store: Arc<dyn LeaseStore> = Arc::new(memory.clone());
    let a = cooperating(store.clone(), &shards, "a", LeaseSettings::default()).await;
    until(Duration::from_secs(10), || owned_by(&memory, "a") == 4).await;
    let c = cooperating(store, &shards, "c", LeaseSettings::default()).await;
    until(Duration::from_secs(60), || owned_by(&memory, "c") == 2).await;
    let failing = Arc::new(Layered::new(Arc::new(memory.clone()), FailingReleases));
    let (b, _b_events) = start_on(failing, &shards, "b").await.unwrap();
    until(Duration::from_secs(60), || b.held().len() == 1).await;
    let shard = b.held()[0].shard_id.clone();

    assert_eq!(b.shutdown().await, 0, "the release failed");
    let row = memory.get(STREAM, &shard).await.unwrap().unwrap();
    assert_eq!(row.owner.as_deref(), Some("b"), "{row:?}");

    assert_read_again_by(&memory, &shard, &["a", "c"]).await;
    drop((a, c));
}

/// Fails the roster's calls (beats and reads) until `until`: a roster item throttled while a
/// process starts.
#[derive(Debug)]
struct ThrottledRoster {
    until: Instant,
}

impl Layer for ThrottledRoster {
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: Call<'a>,
        forward: BoxFuture<'a, Result<T, Error>>,
    ) -> BoxFuture<'a, Result<T, Error>> {
        if !matches!(call, Call::Beat { .. } | Call::ReadRoster { .. })
            || Instant::now() >= self.until
        {
            return forward;
        }
        Box::pin(async { Err(injected("roster", "ProvisionedThroughputExceededException")) })
    }
}

/// A second process under a running worker's id, started while the roster item is throttled
/// (issue 57, defect 4): its start-up check acts only on a beat that landed, so it used to start,
/// count its (unwritten) beat as fresh, and retake at its first scan every row naming the id: two
/// processes read the same shards until one saw two beats of the other. Now a worker takes no
/// lease before a beat of its own has landed, and none while the first beat that landed found
/// another process's beat and a second has not landed yet; then it gives way.
#[tokio::test(start_paused = true)]
async fn a_second_process_started_under_a_throttled_roster_takes_nothing_and_gives_way() {
    let store = MemoryLeaseStore::new();
    let shards = Shards::open(4);
    let (first, mut events) = worker(&store, &shards, "web-1").await;
    until(Duration::from_secs(30), || first.held().len() == 4).await;
    while events.try_recv().is_ok() {}

    let throttled = Arc::new(Layered::new(
        Arc::new(store.clone()),
        ThrottledRoster {
            until: Instant::now() + Duration::from_secs(8),
        },
    ));
    let second = start_on(throttled, &shards, "web-1").await;
    let second = match second {
        Ok((second, _events)) => Some(second),
        Err(Error::WorkerIdInUse { .. }) => None,
        Err(e) => panic!("{e}"),
    };
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let Some(second) = &second {
            assert_eq!(second.held().len(), 0, "the second process took leases");
        }
        assert!(
            events.try_recv().is_err(),
            "the first process lost a lease to its twin"
        );
    }
    assert_eq!(first.held().len(), 4, "the first kept every lease");
    if let Some(second) = &second {
        assert!(
            second.probe().gave_way(),
            "the second gave way once its beats landed"
        );
    }
    assert!(!first.probe().gave_way());
    first.shutdown().await;
}

/// Applies and answers every call made from `from` on `late` after it is made (a store, or a
/// path to it, whose writes land seconds late).
#[derive(Debug)]
struct LandingLate {
    late: Duration,
    from: Instant,
}

impl Layer for LandingLate {
    fn around<'a, T: Send + 'static>(
        &'a self,
        _call: Call<'a>,
        forward: BoxFuture<'a, Result<T, Error>>,
    ) -> BoxFuture<'a, Result<T, Error>> {
        if Instant::now() < self.from {
            return forward;
        }
        let late = self.late;
        Box::pin(async move {
            tokio::time::sleep(late).await;
            forward.await
        })
    }
}

/// Counts the takes of rows another worker owns (steals), and notes each row as seen.
#[derive(Debug, Default)]
struct Steals(std::sync::atomic::AtomicUsize, Mutex<Vec<String>>);

impl Layer for Steals {
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: Call<'a>,
        forward: BoxFuture<'a, Result<T, Error>>,
    ) -> BoxFuture<'a, Result<T, Error>> {
        if let Call::Take { seen, owner } = call
            && seen.owner.as_deref().is_some_and(|o| o != owner)
        {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.1.lock().unwrap().push(format!("{seen:?}"));
        }
        forward
    }
}

/// An owner whose writes land 4.5 s late, and which drains for the handoff timeout, then finds a
/// checkpoint write under way, then writes its final checkpoint and passes, is not stolen from
/// while it renews (issue 57, defect 6): it holds the lease by design all along (its renewals
/// land within its hold). After its acknowledgement the taker waited 10.3 s, the owner needed
/// 5 s and three writes of 4.5 s, and the taker stole: both handled the same records. Now, while the owner's counter moves, the taker waits as
/// long as the owner's writes may take to land (twice the renewal attempt limit more); a
/// silent owner is stolen from as soon as before.
#[tokio::test(start_paused = true)]
async fn an_owner_whose_writes_land_late_hands_over_without_being_stolen_from() {
    let memory = MemoryLeaseStore::new();
    let shards = Shards::open(2);
    let settings = LeaseSettings::default();
    let late = Arc::new(Layered::new(
        Arc::new(memory.clone()),
        LandingLate {
            late: Duration::from_millis(4_500),
            from: Instant::now() + Duration::from_secs(20),
        },
    ));
    let a = cooperating_after(
        late,
        &shards,
        "a",
        settings.clone(),
        settings.handoff_timeout,
    )
    .await;
    until(Duration::from_secs(15), || owned_by(&memory, "a") == 2).await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(
        owned_by(&memory, "a"),
        2,
        "a keeps its leases while answered late"
    );
    let steals = Arc::new(Layered::new(Arc::new(memory.clone()), Steals::default()));
    let b = cooperating(steals.clone(), &shards, "b", settings.clone()).await;
    until(Duration::from_secs(120), || owned_by(&memory, "b") == 1).await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(
        steals.layer().0.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "b stole from an owner that was handing the lease over: {:?}",
        steals.layer().1.lock().unwrap()
    );
    assert_eq!((owned_by(&memory, "a"), owned_by(&memory, "b")), (1, 1));
    drop((a, b));
}
