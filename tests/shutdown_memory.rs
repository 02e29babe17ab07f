//! Shutdown on the in-memory stream, under paused time: the deadline bounds the wait even when the
//! lease table stops answering, and a stopped shard stops reporting its gauges.

#[path = "support/recorder.rs"]
mod recorder;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use shardwise::consumer::SHUTDOWN_GRACE;
use shardwise::lease::{LeaseSettings, LeaseStore, MemoryLeaseStore};
use shardwise::testing::{Call, Layer, Layered, MemoryStream};
use shardwise::{Consumer, Delivery, Error, Outcome, Running};

/// A lease store whose calls stop answering once `hang` is set (a table that hangs); `prepare`
/// always answers.
#[derive(Debug, Clone)]
struct Hanging(Arc<AtomicBool>);

impl Layer for Hanging {
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: Call<'a>,
        forward: BoxFuture<'a, Result<T, Error>>,
    ) -> BoxFuture<'a, Result<T, Error>> {
        if !matches!(call, Call::Prepare) && self.0.load(Ordering::SeqCst) {
            Box::pin(futures::future::pending())
        } else {
            forward
        }
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
    let store = Layered::new(Arc::new(memory.clone()), Hanging(hang.clone()));
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

/// Fails every checkpoint write while set (the LATEST pin is one), counting them.
#[derive(Debug, Clone, Default)]
struct FailingCheckpoints(Arc<AtomicBool>, Arc<std::sync::atomic::AtomicU64>);

impl Layer for FailingCheckpoints {
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: Call<'a>,
        forward: BoxFuture<'a, Result<T, Error>>,
    ) -> BoxFuture<'a, Result<T, Error>> {
        if matches!(call, Call::Checkpoint { .. }) && self.0.load(Ordering::SeqCst) {
            self.1.fetch_add(1, Ordering::SeqCst);
            return Box::pin(async {
                Err(Error::Config(shardwise::ConfigError::new(
                    "checkpoint",
                    "unreachable",
                    "injected",
                )))
            });
        }
        forward
    }
}

/// A LATEST start whose pin keeps failing waits between attempts; a shutdown during a wait stops
/// the shard at once and releases its lease (issue 27, defect 10). Before, the wait ignored the
/// stop: after eight failures the back-off was seconds long and the shutdown's deadline passed
/// with the shard abandoned.
#[tokio::test(start_paused = true)]
async fn a_shutdown_while_the_latest_pin_waits_to_retry_stops_at_once() {
    let stream = MemoryStream::new("orders", 1);
    let memory = MemoryLeaseStore::new();
    let failing = FailingCheckpoints::default();
    failing.0.store(true, Ordering::SeqCst);
    let store = Layered::new(Arc::new(memory.clone()), failing.clone());
    let running = Consumer::builder(stream.name(), "pin-app", |_d: Delivery| async {
        Outcome::Ack
    })
    .worker_id("w1")
    .initial_position(shardwise::InitialPosition::Latest)
    .max_backoff(Duration::from_secs(60))
    .lease_store(Arc::new(store))
    .record_source(Arc::new(stream.clone()))
    .shard_lister(Arc::new(stream.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    until(|| failing.1.load(Ordering::SeqCst) >= 8).await;

    let deadline = Duration::from_secs(2);
    let started = tokio::time::Instant::now();
    let report = running.shutdown(deadline).await;
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "stopped after {:?}",
        started.elapsed()
    );
    assert!(!report.deadline_passed, "{report:?}");
    assert!(report.abandoned.is_empty(), "{report:?}");
    assert_eq!(report.leases_released, 1, "{report:?}");
}

/// A stream deleted while it is consumed: the consumer stops on its own with
/// `Error::StreamNotFound` (`Running::fatal`), each shard stopped and its lease given back, instead
/// of failing every shard, releasing it, taking it again and failing again (issue 27, defect 10).
#[tokio::test(start_paused = true)]
async fn a_deleted_stream_stops_the_consumer_with_a_clear_error() {
    let stream = MemoryStream::new("orders", 2);
    for i in 0..20 {
        stream.put(&format!("k{}", i % 4), i.to_string());
    }
    let memory = MemoryLeaseStore::new();
    let running = start(&stream, Arc::new(memory.clone()), "never").await;
    until(|| running.shards().len() == 2).await;
    let mut fatal = running.fatal();
    assert!(fatal.borrow().is_none());

    stream.delete();
    tokio::time::timeout(Duration::from_secs(60), fatal.wait_for(Option::is_some))
        .await
        .expect("the consumer stops on its own within a minute")
        .unwrap();
    let error = fatal.borrow().clone().unwrap();
    assert!(
        matches!(*error, Error::StreamNotFound { ref stream } if stream == "orders"),
        "{error:?}"
    );
    until(|| running.shards().is_empty()).await;
    let report = running.shutdown(Duration::from_secs(5)).await;
    assert!(!report.deadline_passed, "{report:?}");
    assert!(
        memory.snapshot().iter().all(|r| r.owner.is_none()),
        "every lease given back"
    );
}

/// What the hold test saw, in order.
#[derive(Debug, Clone, PartialEq)]
enum Seen {
    Call(String),
    Frozen,
    Lost,
    Taken,
}

#[derive(Debug, Default, Clone)]
struct Seeing(Arc<std::sync::Mutex<Vec<Seen>>>);

impl shardwise::lease::LeaseHooks for Seeing {
    fn lease_taken(&self, _: &shardwise::lease::Lease) {
        self.0.lock().unwrap().push(Seen::Taken);
    }
    fn lease_lost(&self, _: &shardwise::lease::Ownership) {
        self.0.lock().unwrap().push(Seen::Lost);
    }
}

/// Nothing is handed to the handler once the lease's hold has run out (issue 57, defect 5): the
/// process is frozen for 30 s in the middle of a call (a paused VM, a starved host), so when it
/// runs again every renewal is overdue and others may already have taken the lease. The shard's
/// work used to stop only when the lease task's timer, firing late, cancelled it: the next record
/// was dispatched first. Now the work checks the hold before each dispatch.
#[tokio::test(start_paused = true)]
async fn nothing_is_dispatched_once_the_hold_ran_out_even_before_the_lease_task_gives_it_up() {
    let stream = MemoryStream::new("orders", 1);
    for i in 0..10 {
        stream.put("k", format!("r{i}"));
    }
    let seen = Seeing::default();
    let log = seen.clone();
    let store = MemoryLeaseStore::new();
    let running = Consumer::builder(stream.name(), "hold-app", move |d: Delivery| {
        let payload = String::from_utf8(d.payload().to_vec()).unwrap();
        let log = log.clone();
        async move {
            log.0.lock().unwrap().push(Seen::Call(payload.clone()));
            if payload == "r3" && !log.0.lock().unwrap().contains(&Seen::Frozen) {
                log.0.lock().unwrap().push(Seen::Frozen);
                tokio::time::advance(Duration::from_secs(30)).await;
            }
            Outcome::Ack
        }
    })
    .worker_id("w1")
    .lanes(1)
    .get_records_limit(100)
    .poll_interval(Duration::from_millis(200))
    .checkpoint_interval(Duration::from_millis(50))
    .lease_store(Arc::new(store.clone()))
    .hooks(Arc::new(seen.clone()))
    .record_source(Arc::new(stream.clone()))
    .shard_lister(Arc::new(stream.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    until(|| {
        seen.0
            .lock()
            .unwrap()
            .iter()
            .filter(|s| **s == Seen::Call("r9".into()))
            .count()
            >= 1
            && seen.0.lock().unwrap().contains(&Seen::Lost)
    })
    .await;
    running.shutdown(Duration::from_secs(5)).await;
    let seen = seen.0.lock().unwrap().clone();
    let frozen = seen.iter().position(|s| *s == Seen::Frozen).unwrap();
    let after: Vec<&Seen> = seen[frozen + 1..]
        .iter()
        .take_while(|s| **s != Seen::Lost)
        .collect();
    assert!(
        after.is_empty(),
        "handed out after the hold ran out, before the lease was given up: {after:?} (all: {seen:?})"
    );
}
