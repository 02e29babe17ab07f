//! Shutdown on the in-memory stream, under paused time: the deadline bounds the wait even when the
//! lease table stops answering, and a stopped shard stops reporting its gauges.

#[path = "support/recorder.rs"]
mod recorder;

use shardwise::paged::PagedProgress;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use shardwise::consumer::SHUTDOWN_GRACE;
use shardwise::lease::{
    Checkpoint, CheckpointWrite, Lease, LeaseSettings, LeaseStore, MemoryLeaseStore, NewLease,
    Ownership, SeekMove,
};
use shardwise::testing::MemoryStream;
use shardwise::{Consumer, Delivery, Error, Outcome, Running};

/// A lease store whose writes stop answering once `hang` is set (a table that hangs).
#[derive(Debug, Clone)]
struct Hanging {
    inner: MemoryLeaseStore,
    hang: Arc<AtomicBool>,
}

impl Hanging {
    fn gate<'a, T: Send + 'a>(
        &'a self,
        f: BoxFuture<'a, Result<T, Error>>,
    ) -> BoxFuture<'a, Result<T, Error>> {
        if self.hang.load(Ordering::SeqCst) {
            Box::pin(futures::future::pending())
        } else {
            f
        }
    }
}

impl LeaseStore for Hanging {
    fn prepare(&self) -> BoxFuture<'_, Result<(), Error>> {
        self.inner.prepare()
    }
    fn list<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<Vec<Lease>, Error>> {
        self.gate(self.inner.list(stream))
    }
    fn get<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Lease>, Error>> {
        self.gate(self.inner.get(stream, shard_id))
    }
    fn create<'a>(&'a self, lease: &'a NewLease) -> BoxFuture<'a, Result<bool, Error>> {
        self.gate(self.inner.create(lease))
    }
    fn take<'a>(
        &'a self,
        seen: &'a Lease,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Option<Lease>, Error>> {
        self.gate(self.inner.take(seen, owner))
    }
    fn renew<'a>(
        &'a self,
        held: &'a Ownership,
    ) -> BoxFuture<'a, Result<shardwise::lease::Renewal, Error>> {
        self.gate(self.inner.renew(held))
    }
    fn checkpoint<'a>(
        &'a self,
        held: &'a Ownership,
        to: &'a Checkpoint,
        complete_through: Option<i64>,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        self.gate(self.inner.checkpoint(held, to, complete_through))
    }
    fn paged_checkpoint<'a>(
        &'a self,
        held: &'a Ownership,
        expected: &'a PagedProgress,
        to: &'a PagedProgress,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        self.gate(self.inner.paged_checkpoint(held, expected, to))
    }
    fn release<'a>(&'a self, held: &'a Ownership) -> BoxFuture<'a, Result<bool, Error>> {
        self.gate(self.inner.release(held))
    }
    fn seek<'a>(&'a self, moves: &'a [SeekMove]) -> BoxFuture<'a, Result<bool, Error>> {
        self.gate(self.inner.seek(moves))
    }
    fn advance_frontier<'a>(
        &'a self,
        held: &'a Ownership,
        complete_through: i64,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        self.gate(self.inner.advance_frontier(held, complete_through))
    }
    fn delete<'a>(&'a self, seen: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        self.gate(self.inner.delete(seen))
    }
    fn set_children<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
        children: &'a [String],
    ) -> BoxFuture<'a, Result<(), Error>> {
        self.gate(self.inner.set_children(stream, shard_id, children))
    }

    fn request<'a>(
        &'a self,
        seen: &'a shardwise::lease::Lease,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.gate(self.inner.request(seen, taker))
    }

    fn pass<'a>(
        &'a self,
        held: &'a shardwise::lease::Ownership,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.gate(self.inner.pass(held, taker))
    }

    fn membership<'a>(
        &'a self,
        stream: &'a str,
    ) -> BoxFuture<'a, Result<Option<shardwise::frontier::Membership>, Error>> {
        self.gate(self.inner.membership(stream))
    }

    fn publish_membership<'a>(
        &'a self,
        stream: &'a str,
        expected: Option<u64>,
        next: &'a shardwise::frontier::Membership,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.gate(self.inner.publish_membership(stream, expected, next))
    }

    fn beat<'a>(
        &'a self,
        stream: &'a str,
        worker: &'a str,
        announce: bool,
    ) -> BoxFuture<'a, Result<shardwise::lease::Roster, Error>> {
        self.gate(self.inner.beat(stream, worker, announce))
    }

    fn forget<'a>(
        &'a self,
        stream: &'a str,
        worker: &'a str,
        seen: Option<u64>,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.gate(self.inner.forget(stream, worker, seen))
    }
}

/// A consumer whose handler acks every record but `stuck`, which never finishes.
async fn start(stream: &MemoryStream, store: Arc<dyn LeaseStore>, stuck: &'static str) -> Running {
    Consumer::builder(stream.name(), "shutdown-app", move |d: Delivery| {
        let never = d.payload().as_ref() == stuck.as_bytes();
        async move {
            if never {
                futures::future::pending::<()>().await;
            }
            Outcome::Ack
        }
    })
    .worker_id("w1")
    .max_in_flight(50)
    .get_records_limit(50)
    .poll_interval(Duration::from_millis(200))
    .checkpoint_interval(Duration::from_millis(50))
    .lease_settings(
        LeaseSettings::default()
            .lease_duration(Duration::from_secs(3))
            .scan_interval(Duration::from_millis(100)),
    )
    .lease_store(store)
    .record_source(Arc::new(stream.clone()))
    .shard_lister(Arc::new(stream.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap()
}

async fn until(mut done: impl FnMut() -> bool) {
    for _ in 0..10_000 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never happened");
}

#[tokio::test(start_paused = true)]
async fn shutdown_returns_within_the_deadline_and_the_grace_even_when_the_table_hangs() {
    let stream = MemoryStream::new("orders", 1);
    for i in 0..10 {
        stream.put("k", i.to_string());
    }
    let memory = MemoryLeaseStore::new();
    let hang = Arc::new(AtomicBool::new(false));
    let store = Hanging {
        inner: memory.clone(),
        hang: hang.clone(),
    };
    let running = start(&stream, Arc::new(store), "3").await;
    until(|| {
        memory.snapshot().first().is_some_and(|r| {
            r.checkpoint.to_string() == stream.records()[2].record.sequence.to_string()
        })
    })
    .await;
    let shard = running.shards()[0].shard_id.clone();
    // The table stops answering: the final checkpoint and the release can never finish.
    hang.store(true, Ordering::SeqCst);
    let deadline = Duration::from_millis(500);
    let started = tokio::time::Instant::now();
    let report = tokio::time::timeout(
        deadline + SHUTDOWN_GRACE + Duration::from_secs(1),
        running.shutdown(deadline),
    )
    .await
    .expect("shutdown returns within its deadline and the grace");
    assert!(started.elapsed() <= deadline + SHUTDOWN_GRACE + Duration::from_millis(50));
    assert!(report.deadline_passed, "{report:?}");
    assert_eq!(report.abandoned, vec![shard], "{report:?}");
    assert_eq!(report.leases_released, 0);
}

#[tokio::test(start_paused = true)]
async fn a_stopped_shard_stops_reporting_its_lag_and_load() {
    let recorder = recorder::Metrics::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let shard = "shardId-000000000000";
    let stream = MemoryStream::new("orders", 1);
    for i in 0..200 {
        stream.put("k", i.to_string());
    }
    let running = start(&stream, Arc::new(MemoryLeaseStore::new()), "0").await;
    until(|| {
        recorder
            .gauge("shardwise_in_flight", shard)
            .is_some_and(|n| n > 0.0)
    })
    .await;
    assert!(
        recorder
            .gauge("shardwise_millis_behind_latest", shard)
            .is_some_and(|ms| ms > 0.0),
        "behind: most records are not read yet"
    );
    running.shutdown(Duration::from_millis(200)).await;
    assert_eq!(recorder.gauge("shardwise_in_flight", shard), Some(0.0));
    assert_eq!(
        recorder.gauge("shardwise_millis_behind_latest", shard),
        Some(0.0)
    );
}
