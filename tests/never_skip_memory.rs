//! Never a skip, on the paths that once skipped: a LATEST or AT_TIMESTAMP start whose worker dies
//! before its first checkpoint, a seek to latest followed by a crash, a closed parent that aged out
//! of retention, and seeks while a split's children are read. On the in-memory stream and lease
//! store, with the real consumer.
//!
//! Each test runs on the current-thread runtime, so the tracing subscriber and metrics recorder
//! set for the test thread see every task of the consumer.

#[path = "support/recorder.rs"]
mod recorder;

#[path = "support/wait.rs"]
mod wait;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use wait::wait_for;

use futures::future::BoxFuture;
use shardwise::lease::{
    Checkpoint, InitialPosition, Lease, LeaseSettings, LeaseStore, MemoryLeaseStore,
};
use shardwise::seek::SeekTarget;
use shardwise::testing::{Call, HostClock, Layer, Layered, MemoryStream, on_host};
use shardwise::{Consumer, ConsumerBuilder, Delivery, Error, Outcome, Position, Running};

fn fast_leases() -> LeaseSettings {
    LeaseSettings::default()
        .lease_duration(Duration::from_millis(600))
        .scan_interval(Duration::from_millis(50))
        .shard_sync_interval(Duration::from_millis(200))
}

fn builder<F, Fut>(
    stream: &MemoryStream,
    store: &Arc<dyn LeaseStore>,
    worker: &str,
    handler: F,
) -> ConsumerBuilder<F>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Outcome> + Send,
{
    Consumer::builder(stream.name(), "never-skip", handler)
        .worker_id(worker)
        .poll_interval(Duration::from_millis(200))
        .checkpoint_interval(Duration::from_millis(50))
        .lease_settings(fast_leases())
        .lease_store(store.clone())
        .record_source(Arc::new(stream.clone()))
        .shard_lister(Arc::new(stream.clone()))
}

/// Payloads handled, in the order handlers started.
#[derive(Debug, Default, Clone)]
struct Log(Arc<Mutex<Vec<String>>>);

impl Log {
    fn push(&self, d: &Delivery) {
        self.0
            .lock()
            .unwrap()
            .push(String::from_utf8_lossy(d.payload()).into_owned());
    }
    fn set(&self) -> BTreeSet<String> {
        self.0.lock().unwrap().iter().cloned().collect()
    }
}

/// A handler that records and acks, except that it never finishes the record `stall` (a worker
/// busy with it when it dies has written no checkpoint past it).
fn stalling(
    log: &Log,
    stall: &'static str,
) -> impl Fn(Delivery) -> BoxFuture<'static, Outcome> + Clone + use<> {
    let log = log.clone();
    move |d: Delivery| {
        log.push(&d);
        let stalls = d.payload().as_ref() == stall.as_bytes();
        Box::pin(async move {
            if stalls {
                futures::future::pending::<()>().await;
            }
            Outcome::Ack
        })
    }
}

fn acking(log: &Log) -> impl Fn(Delivery) -> std::future::Ready<Outcome> + Clone + use<> {
    let log = log.clone();
    move |d: Delivery| {
        log.push(&d);
        std::future::ready(Outcome::Ack)
    }
}

fn put_all(stream: &MemoryStream, names: &[String]) {
    for (i, name) in names.iter().enumerate() {
        stream.put(&format!("key-{}", i % 4), name.clone());
    }
}

fn names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// The scenario of the report: one shard, a LATEST start, one lane; the first worker takes the
/// lease and starts reading, 20 records are written, and it dies while its handler holds the first
/// one (so no checkpoint was ever written). The next owner must handle all 20.
#[tokio::test(start_paused = true)]
async fn a_latest_start_killed_before_its_first_checkpoint_skips_nothing() {
    let stream = MemoryStream::new("orders", 1);
    let store: Arc<dyn LeaseStore> = Arc::new(MemoryLeaseStore::new());
    let first_log = Log::default();
    let first = builder(&stream, &store, "w1", stalling(&first_log, "new-0"))
        .initial_position(InitialPosition::Latest)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for(
        "the first worker to hold the shard",
        Duration::from_secs(5),
        || !first.shards().is_empty(),
    )
    .await;
    // Its reader has opened its iterator and polled once.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let new = names("new", 20);
    put_all(&stream, &new);
    wait_for(
        "the first worker to be stuck in the first record",
        Duration::from_secs(5),
        || first_log.set().contains("new-0"),
    )
    .await;
    first.abort(); // kill -9: no checkpoint was written

    let second_log = Log::default();
    let second = builder(&stream, &store, "w2", acking(&second_log))
        .initial_position(InitialPosition::Latest)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let expected: BTreeSet<String> = new.iter().cloned().collect();
    wait_for(
        "the next owner to handle all 20",
        Duration::from_secs(10),
        || second_log.set().is_superset(&expected),
    )
    .await;
    second.shutdown(Duration::from_secs(2)).await;
}

/// A host whose clock runs 30 s ahead of the stream's (far past the 5 s LATEST margin) starts a
/// shard at LATEST. The stream keeps the service's clocks: an AT_TIMESTAMP in its future returns
/// only what arrives after that time. The pin is taken from the stream's answers, so every record
/// written after the worker began reading is handled; pinned by this host's clock it would be 25 s
/// in the stream's future, and the 20 records written now would never be read.
#[tokio::test(start_paused = true)]
async fn a_latest_start_on_a_host_whose_clock_runs_ahead_skips_nothing() {
    let stream = MemoryStream::new("orders", 1);
    stream.service_limits(Duration::from_secs(24 * 3600));
    let store: Arc<dyn LeaseStore> = Arc::new(MemoryLeaseStore::new());
    let log = Log::default();
    let consumer = builder(&stream, &store, "w1", acking(&log))
        .initial_position(InitialPosition::Latest)
        .build()
        .unwrap();
    let running = on_host(HostClock::new(30_000, 0), consumer.run())
        .await
        .unwrap();
    wait_for(
        "the worker to hold the shard",
        Duration::from_secs(5),
        || !running.shards().is_empty(),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let shard = stream.open_shards()[0].clone();
    let pinned = store
        .get("orders", &shard)
        .await
        .unwrap()
        .unwrap()
        .checkpoint;
    let Checkpoint::AtTimestamp(at) = pinned else {
        panic!("a LATEST start is pinned to a time, got {pinned:?}");
    };
    assert!(
        at <= SystemTime::now(),
        "pinned {:?} ahead of the stream's clock",
        at.duration_since(SystemTime::now())
    );
    let new = names("new", 20);
    put_all(&stream, &new);
    let expected: BTreeSet<String> = new.iter().cloned().collect();
    wait_for(
        "all 20 records written after the start",
        Duration::from_secs(10),
        || log.set() == expected,
    )
    .await;
    running.shutdown(Duration::from_secs(2)).await;
}

/// An AT_TIMESTAMP start is already a fixed place: a worker that dies before its first checkpoint
/// leaves the next owner reading from the same time.
#[tokio::test(start_paused = true)]
async fn an_at_timestamp_start_killed_before_its_first_checkpoint_skips_nothing() {
    let stream = MemoryStream::new("orders", 1);
    let store: Arc<dyn LeaseStore> = Arc::new(MemoryLeaseStore::new());
    put_all(&stream, &names("old", 5));
    tokio::time::sleep(Duration::from_millis(20)).await;
    let since = SystemTime::now();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let new = names("new", 20);
    put_all(&stream, &new);
    let first_log = Log::default();
    let first = builder(&stream, &store, "w1", stalling(&first_log, "new-0"))
        .initial_position(InitialPosition::AtTimestamp(since))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for(
        "the first worker to be stuck in the first record",
        Duration::from_secs(5),
        || first_log.set().contains("new-0"),
    )
    .await;
    first.abort();
    let second_log = Log::default();
    let second = builder(&stream, &store, "w2", acking(&second_log))
        .initial_position(InitialPosition::AtTimestamp(since))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let expected: BTreeSet<String> = new.iter().cloned().collect();
    wait_for(
        "the next owner to handle all 20",
        Duration::from_secs(10),
        || second_log.set() == expected,
    )
    .await;
    second.shutdown(Duration::from_secs(2)).await;
    assert!(
        !first_log
            .set()
            .iter()
            .chain(&second_log.set())
            .any(|n| n.starts_with("old")),
        "nothing from before the timestamp"
    );
}

/// A seek to latest, then the worker that retakes the shard dies before its first checkpoint: the
/// records written after the seek are all handled by the next owner.
#[tokio::test(start_paused = true)]
async fn a_seek_to_latest_followed_by_a_crash_skips_nothing_written_after_the_seek() {
    let stream = MemoryStream::new("orders", 1);
    let store: Arc<dyn LeaseStore> = Arc::new(MemoryLeaseStore::new());
    put_all(&stream, &names("before", 10));
    let first_log = Log::default();
    let first = builder(&stream, &store, "w1", stalling(&first_log, "after-0"))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for(
        "the records before the seek",
        Duration::from_secs(5),
        || first_log.set().len() >= 10,
    )
    .await;
    let report = first.seek(&SeekTarget::Latest).await.unwrap();
    assert_eq!(report.moved.len(), 1);
    let after = names("after", 20);
    put_all(&stream, &after);
    wait_for(
        "the shard retaken and stuck in the first new record",
        Duration::from_secs(5),
        || first_log.set().contains("after-0"),
    )
    .await;
    first.abort();
    let second_log = Log::default();
    let second = builder(&stream, &store, "w2", acking(&second_log))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let expected: BTreeSet<String> = after.iter().cloned().collect();
    wait_for(
        "the next owner to handle all 20",
        Duration::from_secs(10),
        || second_log.set().is_superset(&expected),
    )
    .await;
    second.shutdown(Duration::from_secs(2)).await;
}

/// An operator whose clock runs 30 s ahead seeks to latest: the seek moves to the stream's time
/// (from its answers), so the records written after the seek are all handled; by the operator's
/// clock it would move 25 s into the stream's future, past them.
#[tokio::test(start_paused = true)]
async fn a_seek_to_latest_from_a_clock_that_runs_ahead_skips_nothing_written_after_it() {
    let stream = MemoryStream::new("orders", 1);
    stream.service_limits(Duration::from_secs(24 * 3600));
    let store: Arc<dyn LeaseStore> = Arc::new(MemoryLeaseStore::new());
    put_all(&stream, &names("before", 10));
    let log = Log::default();
    let running = builder(&stream, &store, "w1", acking(&log))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for(
        "the records before the seek",
        Duration::from_secs(5),
        || log.set().len() == 10,
    )
    .await;
    let report = on_host(HostClock::new(30_000, 0), running.seek(&SeekTarget::Latest))
        .await
        .unwrap();
    assert_eq!(report.moved.len(), 1);
    let after = names("after", 20);
    put_all(&stream, &after);
    wait_for(
        "the 20 records written after the seek",
        Duration::from_secs(10),
        || log.set().is_superset(&after.iter().cloned().collect()),
    )
    .await;
    running.shutdown(Duration::from_secs(2)).await;
}

/// A closed parent whose unread records were trimmed by retention (it is no longer listed) is
/// ended with a warning naming what was lost, so its children start instead of waiting forever.
#[tokio::test(start_paused = true)]
async fn a_closed_parent_that_aged_out_is_ended_and_its_children_start() {
    let logs = recorder::Logs::default();
    let _logs = tracing::subscriber::set_default(logs.clone());
    let recorder = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&recorder);

    let stream = MemoryStream::new("orders", 1);
    let store: Arc<dyn LeaseStore> = Arc::new(MemoryLeaseStore::new());
    let parent = stream.open_shards()[0].clone();
    put_all(&stream, &names("read", 5));
    let log = Log::default();
    let running = builder(&stream, &store, "w1", acking(&log))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("the first records", Duration::from_secs(5), || {
        log.set().len() == 5
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    let checkpoint = store
        .get("orders", &parent)
        .await
        .unwrap()
        .unwrap()
        .checkpoint;
    assert!(matches!(checkpoint, Checkpoint::At(_)), "{checkpoint:?}");

    // While nobody reads: more records, a split, records in the children, and retention trims
    // the closed parent (its 5 unread records are gone).
    put_all(&stream, &names("trimmed", 5));
    let (a, b) = stream.split(&parent);
    let children = names("child", 16);
    put_all(&stream, &children);
    stream.age_out(&parent);

    let running = builder(&stream, &store, "w1", acking(&log))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let expected: BTreeSet<String> = children.iter().cloned().collect();
    wait_for("the children's records", Duration::from_secs(10), || {
        log.set().is_superset(&expected)
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    if let Some(row) = store.get("orders", &parent).await.unwrap() {
        assert_eq!(row.checkpoint, Checkpoint::ShardEnd, "the parent ended");
    } // (or its row was already cleaned up as an aged-out, ended parent)
    for child in [&a, &b] {
        let row = store.get("orders", child).await.unwrap().unwrap();
        assert!(
            matches!(row.checkpoint, Checkpoint::At(_)),
            "{child}: {:?}",
            row.checkpoint
        );
    }
    let text = logs.text();
    assert!(
        text.contains("aged out of the stream's retention") && text.contains(&parent),
        "the warning says what happened and names the shard:\n{text}"
    );
    assert!(
        text.contains("trimmed unread"),
        "and what was lost:\n{text}"
    );
    assert_eq!(
        recorder.counter("shardwise_shards_aged_out_total", &parent),
        Some(1)
    );
}

/// A lease store that takes its time over each seek write, as a remote table would: a seek that
/// moves shards one by one leaves a window between them.
#[derive(Debug)]
struct SlowSeeks;

impl Layer for SlowSeeks {
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: Call<'a>,
        forward: BoxFuture<'a, Result<T, Error>>,
    ) -> BoxFuture<'a, Result<T, Error>> {
        if !matches!(call, Call::Seek(_)) {
            return forward;
        }
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            forward.await
        })
    }
}

/// A child's delivery handled under the child's current lease while a parent is not at
/// SHARD_END: parent and child read at once.
#[derive(Debug, Default, Clone)]
struct Violations(Arc<Mutex<Vec<String>>>);

/// A handler for a split stream: slow enough that the children are still being read when the seek
/// comes; for each delivery of a child under a current lease, it checks that every parent is at
/// SHARD_END in the table.
fn lineage_checking(
    memory: &MemoryLeaseStore,
    parents: &BTreeMap<String, Vec<String>>,
    log: &Log,
    violations: &Violations,
) -> impl Fn(Delivery) -> BoxFuture<'static, Outcome> + Clone + use<> {
    let (memory, parents, log, violations) = (
        memory.clone(),
        parents.clone(),
        log.clone(),
        violations.clone(),
    );
    move |d: Delivery| {
        log.push(&d);
        let rows: BTreeMap<String, Lease> = memory
            .snapshot()
            .into_iter()
            .map(|r| (r.shard_id.clone(), r))
            .collect();
        let current = rows
            .get(d.shard())
            .is_some_and(|r| Some(r.owner_epoch) == d.id().map(|id| id.epoch()));
        if current {
            for p in parents.get(d.shard()).into_iter().flatten() {
                if rows
                    .get(p)
                    .is_some_and(|r| r.checkpoint != Checkpoint::ShardEnd)
                {
                    violations.0.lock().unwrap().push(format!(
                        "{} of {} handled while its parent {p} is at {}",
                        String::from_utf8_lossy(d.payload()),
                        d.shard(),
                        rows[p].checkpoint
                    ));
                }
            }
        }
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(15)).await;
            Outcome::Ack
        })
    }
}

/// Records written to the split's children: at 15 ms each over two shards of two lanes, reading
/// them takes longer than a seek that moves shards one by one.
const CHILD_RECORDS: usize = 200;

/// Reads a stream of one shard to its end, splits it, and starts reading the children slowly.
async fn split_and_read_children(
    stream: &MemoryStream,
    memory: &MemoryLeaseStore,
    store: &Arc<dyn LeaseStore>,
    log: &Log,
    violations: &Violations,
) -> (Running, String, Vec<Position>) {
    let parent = stream.open_shards()[0].clone();
    let mut parent_positions = Vec::new();
    for (i, name) in names("p", 12).iter().enumerate() {
        let (_, seq) = stream.put(&format!("key-{}", i % 4), name.clone());
        parent_positions.push(Position::new(seq, 0));
    }
    let (a, b) = stream.split(&parent);
    put_all(stream, &names("c", CHILD_RECORDS));
    let lineage = BTreeMap::from([(a, vec![parent.clone()]), (b, vec![parent.clone()])]);
    let running = builder(
        stream,
        store,
        "w1",
        lineage_checking(memory, &lineage, log, violations),
    )
    .lanes(2)
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("the children being read", Duration::from_secs(10), || {
        log.set().iter().filter(|n| n.starts_with('c')).count() >= 6
    })
    .await;
    (running, parent, parent_positions)
}

impl Log {
    fn count(&self, prefix: char) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|n| n.starts_with(prefix))
            .count()
    }
}

fn assert_no_violation(violations: &Violations) {
    let v = violations.0.lock().unwrap();
    assert!(
        v.is_empty(),
        "parent and children were read at once: {v:#?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_seek_of_a_parent_to_a_record_while_its_children_are_read_resets_the_children_with_it() {
    let stream = MemoryStream::new("orders", 1);
    let memory = MemoryLeaseStore::new();
    let store: Arc<dyn LeaseStore> = Arc::new(Layered::new(Arc::new(memory.clone()), SlowSeeks));
    let (log, violations) = (Log::default(), Violations::default());
    let (running, parent, positions) =
        split_and_read_children(&stream, &memory, &store, &log, &violations).await;
    let target = SeekTarget::Position {
        shard_id: parent.clone(),
        position: positions[4],
    };
    let report = running.seek(&target).await.unwrap();
    // The parent is read again from the record to its end (8 of its 12 records)...
    wait_for(
        "the parent read again from the record",
        Duration::from_secs(20),
        || log.count('p') >= 12 + 8,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_no_violation(&violations);
    assert_eq!(
        report.moved.len(),
        3,
        "the parent and both children: {report:?}"
    );
    // ... then the children from their start.
    wait_for(
        "the children read again to their end",
        Duration::from_secs(20),
        || {
            memory
                .snapshot()
                .iter()
                .filter(|r| r.shard_id != parent)
                .all(|r| matches!(r.checkpoint, Checkpoint::At(_)) && r.seek_epoch == 1)
        },
    )
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    assert!(
        log.count('c') >= CHILD_RECORDS + 6,
        "the children were read again"
    );
    assert_no_violation(&violations);
}

#[tokio::test(start_paused = true)]
async fn a_stream_wide_seek_while_children_are_read_never_reopens_a_parent_under_them() {
    let stream = MemoryStream::new("orders", 1);
    let memory = MemoryLeaseStore::new();
    let store: Arc<dyn LeaseStore> = Arc::new(Layered::new(Arc::new(memory.clone()), SlowSeeks));
    let (log, violations) = (Log::default(), Violations::default());
    let (running, _parent, _) =
        split_and_read_children(&stream, &memory, &store, &log, &violations).await;
    let report = running.seek(&SeekTarget::TrimHorizon).await.unwrap();
    wait_for("the parent read again", Duration::from_secs(20), || {
        log.count('p') >= 24
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_no_violation(&violations);
    assert_eq!(report.moved.len(), 3, "{report:?}");
    wait_for(
        "the children read again to their end",
        Duration::from_secs(20),
        || {
            memory.snapshot().iter().all(|r| {
                r.seek_epoch == 1
                    && matches!(r.checkpoint, Checkpoint::At(_) | Checkpoint::ShardEnd)
            })
        },
    )
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    assert!(
        log.count('c') >= CHILD_RECORDS + 6,
        "the children were read again"
    );
    assert_no_violation(&violations);
}
