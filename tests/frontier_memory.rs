//! The frontier end to end: a real paged consumer on the scripted event API (partitions read by
//! timestamp, closed by the source's finality watermark) and the in-memory lease store. The
//! frontier claims only what it has seen (seed 001's membership changes):
//! - a partition the source's listing found before its lease row exists holds the scalar off;
//! - a member whose row is gone while the source still lists it left unsealed: withheld;
//! - a member that joins without coverage, in the same scan as a seek of the others: withheld,
//!   while the seek alone would be published;
//! - a forward seek's skipped range is reported beside the scalar.
//!
//! The lease table is tampered with behind the worker's back where nothing in shardwise would do
//! it (a row deleted or put back by hand), through [`Tampered`].

#[path = "support/wait.rs"]
mod wait;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, UNIX_EPOCH};
use wait::wait_for;

use futures::future::BoxFuture;
use shardwise::frontier::{Frontier, Membership, SeekCoordinate, SkippedRange};
use shardwise::lease::{
    Checkpoint, CheckpointWrite, Lease, LeaseSettings, LeaseStore, MemoryLeaseStore, NewLease,
    Ownership, Renewal, Roster, SeekMove,
};
use shardwise::paged::{Contract, Finality, PagedProgress, Timestamps, Traversal};
use shardwise::seek::SeekTarget;
use shardwise::testing::EventApi;
use shardwise::{Consumer, Delivery, Error, Outcome, Running};

const SOURCE: &str = "frontier-events";
const T10_00: i64 = 1_796_119_200_000;

fn t(n: i64) -> i64 {
    T10_00 + n
}

/// What was done to the table behind the workers' backs.
#[derive(Debug, Default)]
struct Tampering {
    /// Rows deleted by hand: the store no longer shows them.
    hidden: BTreeSet<String>,
    /// Rows put back by hand as an old copy: shown instead of the stored row (and never taken).
    restored: BTreeMap<String, Lease>,
    /// Partitions whose row creation waits until released.
    held_back: BTreeSet<String>,
    /// Partitions whose row creation was asked for while held back.
    asked: BTreeSet<String>,
}

/// The memory lease store, with rows hidden, put back, or their creation held back.
#[derive(Debug, Clone, Default)]
struct Tampered {
    inner: MemoryLeaseStore,
    tampering: Arc<Mutex<Tampering>>,
}

impl Tampered {
    fn with<R>(&self, f: impl FnOnce(&mut Tampering) -> R) -> R {
        f(&mut self.tampering.lock().unwrap())
    }

    /// The row as the workers are shown it.
    fn view(&self, row: Lease) -> Option<Lease> {
        self.with(|t| {
            if t.hidden.contains(&row.shard_id) {
                None
            } else {
                Some(t.restored.get(&row.shard_id).cloned().unwrap_or(row))
            }
        })
    }

    fn stored(&self, partition: &str) -> Option<Lease> {
        self.inner
            .snapshot()
            .into_iter()
            .find(|r| r.stream == SOURCE && r.shard_id == partition)
    }
}

impl LeaseStore for Tampered {
    fn prepare(&self) -> BoxFuture<'_, Result<(), Error>> {
        self.inner.prepare()
    }
    fn list<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<Vec<Lease>, Error>> {
        Box::pin(async move {
            let rows = self.inner.list(stream).await?;
            Ok(rows.into_iter().filter_map(|r| self.view(r)).collect())
        })
    }
    fn get<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Lease>, Error>> {
        Box::pin(async move {
            Ok(self
                .inner
                .get(stream, shard_id)
                .await?
                .and_then(|r| self.view(r)))
        })
    }
    fn create<'a>(&'a self, lease: &'a NewLease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            while self.with(|t| {
                let held = t.held_back.contains(&lease.shard_id);
                if held {
                    t.asked.insert(lease.shard_id.clone());
                }
                held
            }) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            self.inner.create(lease).await
        })
    }
    fn take<'a>(
        &'a self,
        seen: &'a Lease,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Option<Lease>, Error>> {
        Box::pin(async move {
            if self.with(|t| t.restored.contains_key(&seen.shard_id)) {
                return Ok(None);
            }
            self.inner.take(seen, owner).await
        })
    }
    fn renew<'a>(&'a self, held: &'a Ownership) -> BoxFuture<'a, Result<Renewal, Error>> {
        self.inner.renew(held)
    }
    fn checkpoint<'a>(
        &'a self,
        held: &'a Ownership,
        to: &'a Checkpoint,
        complete_through: Option<i64>,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        self.inner.checkpoint(held, to, complete_through)
    }
    fn paged_checkpoint<'a>(
        &'a self,
        held: &'a Ownership,
        expected: &'a PagedProgress,
        to: &'a PagedProgress,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        self.inner.paged_checkpoint(held, expected, to)
    }
    fn release<'a>(&'a self, held: &'a Ownership) -> BoxFuture<'a, Result<bool, Error>> {
        self.inner.release(held)
    }
    fn retire<'a>(&'a self, held: &'a Ownership, at: i64) -> BoxFuture<'a, Result<bool, Error>> {
        self.inner.retire(held, at)
    }
    fn seek<'a>(&'a self, moves: &'a [SeekMove]) -> BoxFuture<'a, Result<bool, Error>> {
        self.inner.seek(moves)
    }
    fn advance_frontier<'a>(
        &'a self,
        held: &'a Ownership,
        complete_through: i64,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        self.inner.advance_frontier(held, complete_through)
    }
    fn delete<'a>(&'a self, seen: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        self.inner.delete(seen)
    }
    fn set_children<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
        children: &'a [String],
    ) -> BoxFuture<'a, Result<(), Error>> {
        self.inner.set_children(stream, shard_id, children)
    }
    fn request<'a>(
        &'a self,
        seen: &'a Lease,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.inner.request(seen, taker)
    }
    fn pass<'a>(
        &'a self,
        held: &'a Ownership,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.inner.pass(held, taker)
    }
    fn beat<'a>(
        &'a self,
        stream: &'a str,
        section: u32,
        worker: &'a str,
        beat: u64,
        announce: bool,
    ) -> BoxFuture<'a, Result<Roster, Error>> {
        self.inner.beat(stream, section, worker, beat, announce)
    }
    fn forget<'a>(
        &'a self,
        stream: &'a str,
        section: u32,
        worker: &'a str,
        seen: Option<u64>,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.inner.forget(stream, section, worker, seen)
    }
    fn acknowledge<'a>(
        &'a self,
        held: &'a Ownership,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.inner.acknowledge(held, taker)
    }
    fn read_roster<'a>(
        &'a self,
        stream: &'a str,
        sections: &'a [u32],
    ) -> BoxFuture<'a, Result<Vec<Roster>, Error>> {
        self.inner.read_roster(stream, sections)
    }
    fn split_roster<'a>(
        &'a self,
        stream: &'a str,
        from: u32,
        to: u32,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.inner.split_roster(stream, from, to)
    }
    fn membership<'a>(
        &'a self,
        stream: &'a str,
    ) -> BoxFuture<'a, Result<Option<Membership>, Error>> {
        self.inner.membership(stream)
    }
    fn publish_membership<'a>(
        &'a self,
        stream: &'a str,
        expected: Option<u64>,
        next: &'a Membership,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.inner.publish_membership(stream, expected, next)
    }
}

/// A source read by timestamp whose partitions are closed by a finality watermark, with
/// `events` (partition, id, timestamp) and `watermarks` (partition, watermark).
fn source(events: &[(&str, &str, i64)], watermarks: &[(&str, i64)]) -> EventApi {
    let contract =
        Contract::default().timestamps(Timestamps::new(Traversal::Complete, Finality::Watermark));
    let api = EventApi::new(SOURCE).page_size(10).contract(contract);
    for (partition, id, at) in events {
        api.push_at(partition, id, *at, id.to_string());
    }
    for (partition, watermark) in watermarks {
        api.watermark(partition, *watermark);
    }
    api
}

async fn run(api: &EventApi, store: &Tampered) -> Running {
    Consumer::paged(Arc::new(api.clone()), "frontier-app", |_: Delivery| {
        std::future::ready(Outcome::Ack)
    })
    .worker_id("w1")
    .lanes(2)
    .poll_interval(Duration::from_millis(200))
    .checkpoint_interval(Duration::from_millis(20))
    .lease_settings(
        LeaseSettings::default()
            .lease_duration(Duration::from_millis(900))
            .scan_interval(Duration::from_millis(50))
            .shard_sync_interval(Duration::from_millis(200)),
    )
    .lease_store(Arc::new(store.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap()
}

/// The consumer's frontier, once it says `ok`.
async fn frontier_where(running: &Running, what: &str, ok: impl Fn(&Frontier) -> bool) -> Frontier {
    let mut watch = running.frontier();
    match tokio::time::timeout(Duration::from_secs(10), watch.wait_for(|f| ok(f))).await {
        Ok(found) => found.expect("the consumer runs").clone(),
        Err(_) => panic!(
            "timed out waiting for the frontier: {what}; it is {:?}",
            *running.frontier().borrow()
        ),
    }
}

/// Samples the frontier every scan for `span`, asserting `holds` of each.
async fn throughout(running: &Running, span: Duration, holds: impl Fn(&Frontier) -> bool) {
    let end = Instant::now() + span;
    while Instant::now() < end {
        let f = running.frontier().borrow().clone();
        assert!(holds(&f), "{f:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// The live observation (A at 130 under epoch 1 while C held an event at 50), closed: C
/// appears in the source with an event older than the scalar, and its row's creation is held
/// back. From the listing that found C on, no scalar is published (and no membership without
/// C) until C's row exists; then C joins under epoch 2 and the scalar waits for C's own
/// coordinate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_listed_before_its_row_exists_holds_the_scalar_below_its_event() {
    let api = source(
        &[("A", "a1", t(100)), ("B", "b1", t(110))],
        &[("A", t(130)), ("B", t(140))],
    );
    let store = Tampered::default();
    let running = run(&api, &store).await;
    let f = frontier_where(&running, "130", |f| f.scalar == Some(t(130))).await;
    assert_eq!(f.epoch, 1);

    store.with(|t| t.held_back.insert("C".into()));
    api.push_at("C", "c1", t(50), "c1");
    wait_for("a listing that found C", Duration::from_secs(10), || {
        store.with(|t| t.asked.contains("C"))
    })
    .await;
    let f = frontier_where(&running, "withheld for C", |f| f.scalar.is_none()).await;
    assert_eq!(f.listed_without_row, ["C"], "{f:?}");
    assert!(f.listed_at.is_some());
    throughout(&running, Duration::from_millis(600), |f| {
        f.scalar.is_none() && f.epoch == 1 && f.listed_without_row == ["C"]
    })
    .await;
    assert_eq!(
        store
            .inner
            .membership(SOURCE)
            .await
            .unwrap()
            .unwrap()
            .members,
        ["A", "B"],
        "no membership without C was published"
    );

    store.with(|t| t.held_back.clear());
    let f = frontier_where(&running, "C joins", |f| f.members.len() == 3).await;
    assert_eq!(
        (f.epoch, f.scalar),
        (2, None),
        "C has no coordinate yet: {f:?}"
    );
    api.watermark("C", t(60));
    let f = frontier_where(&running, "C covered", |f| f.scalar.is_some()).await;
    assert_eq!((f.scalar, f.epoch), (Some(t(60)), 2));
    running.shutdown(Duration::from_secs(3)).await;
}

/// A member removed unsealed: B's row disappears (deleted by hand) while the source still lists
/// B, whose watermark holds the frontier at 90 with an event at 100 past it. The frontier does
/// not drop B and jump to A's 120: the scalar is withheld, naming B, and the epoch stays; once
/// the row is back, B holds it at 90 again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_removed_unsealed_withholds_the_scalar() {
    let api = source(
        &[("A", "a1", t(100)), ("B", "b1", t(80)), ("B", "b2", t(100))],
        &[("A", t(120)), ("B", t(90))],
    );
    let store = Tampered::default();
    let running = run(&api, &store).await;
    let f = frontier_where(&running, "90", |f| f.scalar == Some(t(90))).await;
    assert_eq!(f.epoch, 1);

    store.with(|t| t.hidden.insert("B".into()));
    let f = frontier_where(&running, "B gone", |f| f.members.len() == 1).await;
    assert_eq!(f.scalar, None, "not A's 120: {f:?}");
    throughout(&running, Duration::from_millis(600), |f| {
        f.scalar.is_none()
            && f.epoch == 1
            && f.unproven
                .iter()
                .any(|why| why.starts_with("B left without being sealed"))
    })
    .await;

    store.with(|t| t.hidden.clear());
    let f = frontier_where(&running, "B back", |f| f.scalar.is_some()).await;
    assert_eq!((f.scalar, f.epoch), (Some(t(90)), 1));
    running.shutdown(Duration::from_secs(3)).await;
}

/// A member added without coverage proof, in the same scan as a seek: Z was read to its end
/// after an earlier seek and sealed (it left the membership; its seek epoch is on record). Its
/// row is put back by hand as it was before it ended, open and claiming 500, while a seek of the
/// source rewinds A and B. The seek is its own proof for A and B only: Z proves no coverage, so
/// nothing is published and the scalar is withheld. With Z's row sealed again, the seek alone is
/// published under epoch 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_added_without_coverage_beside_a_seek_withholds_the_scalar() {
    let api = source(
        &[("A", "a1", t(100)), ("B", "b1", t(80))],
        &[("A", t(120)), ("B", t(90))],
    );
    let store = Tampered::default();
    // Z, as an earlier run left it: sought once, read to its end from there, sealed.
    let z = NewLease {
        stream: SOURCE.into(),
        shard_id: "Z".into(),
        checkpoint: Checkpoint::TrimHorizon,
        parents: vec![],
    };
    assert!(store.inner.create(&z).await.unwrap());
    let seen = store.inner.get(SOURCE, "Z").await.unwrap().unwrap();
    assert!(
        store
            .inner
            .seek(&[SeekMove {
                seen,
                to: Checkpoint::TrimHorizon,
                progress: Some(PagedProgress::default()),
                skipped: None,
            }])
            .await
            .unwrap()
    );
    let seen = store.inner.get(SOURCE, "Z").await.unwrap().unwrap();
    let open = store.inner.take(&seen, "earlier").await.unwrap().unwrap();
    let held = open.ownership().unwrap();
    let closed = PagedProgress {
        closed_through: Some(t(500)),
        checkpoint_version: 2,
        ..PagedProgress::default()
    };
    assert_eq!(
        store
            .inner
            .paged_checkpoint(&held, open.progress.as_ref().unwrap(), &closed)
            .await
            .unwrap(),
        CheckpointWrite::Written
    );
    let before_end = store.stored("Z").unwrap();
    assert_eq!(
        store
            .inner
            .checkpoint(&held, &Checkpoint::ShardEnd, None)
            .await
            .unwrap(),
        CheckpointWrite::Written
    );
    assert!(store.inner.release(&held).await.unwrap());

    let running = run(&api, &store).await;
    let f = frontier_where(&running, "90", |f| f.scalar == Some(t(90))).await;
    assert_eq!(f.epoch, 1);
    let published = store.inner.membership(SOURCE).await.unwrap().unwrap();
    assert_eq!(published.members, ["A", "B"], "Z sealed: not a member");
    assert_eq!(
        published.seek_epochs,
        BTreeMap::from([("Z".to_string(), 1)])
    );

    store.with(|t| t.restored.insert("Z".into(), before_end.clone()));
    running
        .seek(&SeekTarget::Timestamp(
            UNIX_EPOCH + Duration::from_millis(t(85) as u64),
        ))
        .await
        .unwrap();
    let f = frontier_where(&running, "Z joins", |f| f.members.len() == 3).await;
    assert_eq!(f.scalar, None, "{f:?}");
    // A and B close again to their watermarks; Z still proves nothing.
    wait_for("A and B closed again", Duration::from_secs(10), || {
        let closed = |p: &str| store.stored(p).and_then(|r| r.progress?.closed_through);
        closed("A") == Some(t(120)) && closed("B") == Some(t(90))
    })
    .await;
    throughout(&running, Duration::from_millis(600), |f| {
        f.scalar.is_none()
            && f.epoch == 1
            && f.unproven.len() == 1
            && f.unproven[0].starts_with("Z joined without coverage")
    })
    .await;

    store.with(|t| t.restored.clear());
    let f = frontier_where(&running, "the seek published", |f| f.epoch == 2).await;
    assert_eq!(f.scalar, Some(t(90)), "{f:?}");
    let published = store.inner.membership(SOURCE).await.unwrap().unwrap();
    assert_eq!(
        published.seek_epochs,
        BTreeMap::from([
            ("A".to_string(), 1),
            ("B".to_string(), 1),
            ("Z".to_string(), 1)
        ])
    );
    running.shutdown(Duration::from_secs(3)).await;
}

/// A seek forward past what A and B had closed skips the events between (a2 at 150, put after
/// the seek, is read by no owner after it): the frontier reports each skipped range, with the
/// seek epoch, beside the scalar it publishes for the next epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_seek_is_reported_beside_the_scalar() {
    let api = source(
        &[("A", "a1", t(100)), ("B", "b1", t(80))],
        &[("A", t(120)), ("B", t(90))],
    );
    let store = Tampered::default();
    let running = run(&api, &store).await;
    frontier_where(&running, "90", |f| f.scalar == Some(t(90))).await;
    running
        .seek(&SeekTarget::Timestamp(
            UNIX_EPOCH + Duration::from_millis(t(200) as u64),
        ))
        .await
        .unwrap();
    api.push_at("A", "a2", t(150), "a2");
    api.push_at("A", "a3", t(250), "a3");
    api.watermark("A", t(300));
    api.watermark("B", t(300));
    let f = frontier_where(&running, "past the seek", |f| f.scalar == Some(t(300))).await;
    assert_eq!(f.epoch, 2, "a seek starts the next epoch");
    let skipped: Vec<(&str, &SkippedRange)> = f
        .skipped_by_seek
        .iter()
        .map(|s| (s.shard_id.as_str(), &s.range))
        .collect();
    let from = |ms| SkippedRange {
        from: SeekCoordinate::Time(ms),
        to: SeekCoordinate::Time(t(200)),
        seek_epoch: 1,
    };
    assert_eq!(skipped, [("A", &from(t(120))), ("B", &from(t(90)))]);
    running.shutdown(Duration::from_secs(3)).await;
}
