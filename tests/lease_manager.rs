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
