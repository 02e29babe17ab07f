//! The lease manager in a deterministic simulation: the in-memory lease store, a fixed shard list,
//! and paused tokio time. Dropping a manager without `shutdown` is a crash (kill -9): its tasks stop
//! and nothing is released.

use shardwise::paged::PagedProgress;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use shardwise::Error;
use shardwise::lease::{
    Checkpoint, CheckpointWrite, LeaseEvent, LeaseManager, LeaseSettings, LeaseStore,
    MemoryLeaseStore,
};
use shardwise::shard::discovery::{ShardInfo, ShardLister};
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
    LeaseManager::start(
        Arc::new(store.clone()),
        shards.clone(),
        STREAM,
        name,
        LeaseSettings::default(),
        Arc::new(()),
    )
    .await
    .expect("manager starts")
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

/// Counts every store call (each is one DynamoDB request for the DynamoDB store; a Scan of a
/// small table is one page).
#[derive(Debug)]
struct Counting {
    inner: MemoryLeaseStore,
    calls: std::sync::atomic::AtomicU64,
}

impl Counting {
    fn tick(&self) {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl LeaseStore for Counting {
    fn prepare(&self) -> BoxFuture<'_, Result<(), Error>> {
        self.tick();
        self.inner.prepare()
    }
    fn list<'a>(
        &'a self,
        stream: &'a str,
    ) -> BoxFuture<'a, Result<Vec<shardwise::lease::Lease>, Error>> {
        self.tick();
        self.inner.list(stream)
    }
    fn get<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<shardwise::lease::Lease>, Error>> {
        self.tick();
        self.inner.get(stream, shard_id)
    }
    fn create<'a>(
        &'a self,
        lease: &'a shardwise::lease::NewLease,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.tick();
        self.inner.create(lease)
    }
    fn take<'a>(
        &'a self,
        seen: &'a shardwise::lease::Lease,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Option<shardwise::lease::Lease>, Error>> {
        self.tick();
        self.inner.take(seen, owner)
    }
    fn renew<'a>(
        &'a self,
        held: &'a shardwise::lease::Ownership,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.tick();
        self.inner.renew(held)
    }
    fn checkpoint<'a>(
        &'a self,
        held: &'a shardwise::lease::Ownership,
        to: &'a Checkpoint,
        complete_through: Option<i64>,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        self.tick();
        self.inner.checkpoint(held, to, complete_through)
    }
    fn paged_checkpoint<'a>(
        &'a self,
        held: &'a shardwise::lease::Ownership,
        expected: &'a PagedProgress,
        to: &'a PagedProgress,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        self.tick();
        self.inner.paged_checkpoint(held, expected, to)
    }
    fn release<'a>(
        &'a self,
        held: &'a shardwise::lease::Ownership,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.tick();
        self.inner.release(held)
    }
    fn seek<'a>(
        &'a self,
        moves: &'a [shardwise::lease::SeekMove],
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.tick();
        self.inner.seek(moves)
    }
    fn advance_frontier<'a>(
        &'a self,
        held: &'a shardwise::lease::Ownership,
        ct: i64,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        self.tick();
        self.inner.advance_frontier(held, ct)
    }
    fn delete<'a>(
        &'a self,
        seen: &'a shardwise::lease::Lease,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.tick();
        self.inner.delete(seen)
    }
    fn set_children<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
        children: &'a [String],
    ) -> BoxFuture<'a, Result<(), Error>> {
        self.tick();
        self.inner.set_children(stream, shard_id, children)
    }

    fn request<'a>(
        &'a self,
        seen: &'a shardwise::lease::Lease,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.tick();
        self.inner.request(seen, taker)
    }

    fn pass<'a>(
        &'a self,
        held: &'a shardwise::lease::Ownership,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.tick();
        self.inner.pass(held, taker)
    }

    fn membership<'a>(
        &'a self,
        stream: &'a str,
    ) -> BoxFuture<'a, Result<Option<shardwise::frontier::Membership>, Error>> {
        {
            self.tick();
            self.inner.membership(stream)
        }
    }

    fn publish_membership<'a>(
        &'a self,
        stream: &'a str,
        expected: Option<u64>,
        next: &'a shardwise::frontier::Membership,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        {
            self.tick();
            self.inner.publish_membership(stream, expected, next)
        }
    }
}

#[tokio::test(start_paused = true)]
async fn an_idle_worker_costs_about_26_store_requests_per_held_lease_per_minute() {
    let store = Arc::new(Counting {
        inner: MemoryLeaseStore::new(),
        calls: Default::default(),
    });
    let shards = Shards::open(4);
    let (manager, _events) = LeaseManager::start(
        store.clone(),
        shards,
        STREAM,
        "idle",
        LeaseSettings::default(),
        Arc::new(()),
    )
    .await
    .unwrap();
    until(Duration::from_secs(10), || manager.held().len() == 4).await;
    let before = store.calls.load(std::sync::atomic::Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(600)).await;
    let calls = store.calls.load(std::sync::atomic::Ordering::Relaxed) - before;
    let per_lease_minute = calls as f64 / 4.0 / 10.0;
    eprintln!(
        "idle: {calls} store requests in 10 min for 4 leases = {per_lease_minute:.1} per held lease per minute"
    );
    // Renewals: 60 s / (10 s / 3) = 18 per lease; scans every 2 s and a shard sync a minute are
    // shared by the worker's leases: (30 + 2) / 4 = 8 per lease.
    assert!(
        (25.0..=27.0).contains(&per_lease_minute),
        "{per_lease_minute}"
    );
}
