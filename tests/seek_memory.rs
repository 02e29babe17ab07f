//! Seek and the frontier on the in-memory stream and lease store.

#[path = "support/wait.rs"]
mod wait;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use wait::wait_for;

use shardwise::lease::{Checkpoint, LeaseSettings, MemoryLeaseStore};
use shardwise::seek::SeekTarget;
use shardwise::testing::MemoryStream;
use shardwise::{Consumer, Delivery, Outcome, Running};

/// Handled ids with how often each was handled.
#[derive(Debug, Default, Clone)]
struct Log(Arc<Mutex<Vec<u64>>>);

impl Log {
    fn counts(&self) -> HashMap<u64, usize> {
        let mut m = HashMap::new();
        for id in self.0.lock().unwrap().iter() {
            *m.entry(*id).or_default() += 1;
        }
        m
    }
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

fn id_of(d: &Delivery) -> u64 {
    std::str::from_utf8(d.payload()).unwrap().parse().unwrap()
}

async fn start(
    stream: &MemoryStream,
    store: &MemoryLeaseStore,
    log: &Log,
    slow: Option<u64>,
    skew: Option<Duration>,
) -> Running {
    let l = log.clone();
    let mut b = Consumer::builder(stream.name(), "seek-app", move |d: Delivery| {
        let l = l.clone();
        async move {
            let id = id_of(&d);
            if Some(id) == slow && d.attempt() == 1 && l.0.lock().unwrap().iter().all(|x| *x != id)
            {
                tokio::time::sleep(Duration::from_millis(1500)).await;
            }
            l.0.lock().unwrap().push(id);
            Outcome::Ack
        }
    })
    .worker_id("w1")
    .lanes(4)
    .poll_interval(Duration::from_millis(200))
    .get_records_limit(100)
    .checkpoint_interval(Duration::from_millis(20))
    .frontier_interval(Duration::from_millis(100))
    .lease_settings(
        LeaseSettings::default()
            .lease_duration(Duration::from_millis(900))
            .scan_interval(Duration::from_millis(100)),
    )
    .in_memory(stream, store);
    if let Some(skew) = skew {
        b = b.caught_up_frontier(skew);
    }
    b.build().unwrap().run().await.unwrap()
}

fn key(cp: &Checkpoint) -> String {
    cp.sort_key()
}

#[tokio::test(start_paused = true)]
async fn seeking_back_to_the_trim_horizon_redelivers_everything_and_late_acks_move_nothing() {
    let stream = MemoryStream::new("orders", 2);
    let store = MemoryLeaseStore::new();
    for id in 0..400u64 {
        stream.put(&format!("key-{}", id % 8), id.to_string());
    }
    let log = Log::default();
    // Record 150 is slow the first time: it is still running when the seek lands.
    let running = start(&stream, &store, &log, Some(150), None).await;
    wait_for("most of the first pass", Duration::from_secs(20), || {
        log.len() >= 300
    })
    .await;
    assert!(!log.counts().contains_key(&150), "150 still running");

    let before: Vec<u64> = log.counts().into_keys().collect();
    let report = running.seek(&SeekTarget::TrimHorizon).await.unwrap();
    assert_eq!(report.moved.len(), 2);
    // From here on, each shard's stored checkpoint starts at the trim horizon and only moves
    // forward: a late settlement from before the seek would jump it ahead and then back.
    let mut last: HashMap<String, String> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    let again = |log: &Log| {
        let counts = log.counts();
        before.iter().filter(|id| counts[*id] >= 2).count()
    };
    while again(&log) < before.len() || log.counts().len() < 400 {
        for row in store.snapshot() {
            let k = key(&row.checkpoint);
            if let Some(prev) = last.get(&row.shard_id) {
                assert!(
                    k >= *prev,
                    "checkpoint of {} went back after the seek: {} < {}",
                    row.shard_id,
                    k,
                    prev
                );
            }
            last.insert(row.shard_id.clone(), k);
        }
        assert!(
            Instant::now() < deadline,
            "not everything was redelivered: {} ids, {} of {} read before the seek came again; rows {:?}",
            log.counts().len(),
            again(&log),
            before.len(),
            store.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    running.shutdown(Duration::from_secs(3)).await;
    let counts = log.counts();
    assert_eq!(counts.len(), 400, "nothing skipped");
    assert!(
        before.iter().all(|id| counts[id] >= 2),
        "everything handled before the seek came again"
    );
    assert_eq!(
        counts[&150], 1,
        "the slow record's late ack was dropped with its lease; it came once, after the seek"
    );
    assert!(
        store
            .snapshot()
            .iter()
            .all(|r| r.seek_epoch == 1 && r.owner_epoch >= 2)
    );
}

#[tokio::test(start_paused = true)]
async fn seeking_to_a_timestamp_redelivers_the_records_that_arrived_since() {
    let stream = MemoryStream::new("orders", 2);
    let store = MemoryLeaseStore::new();
    for id in 0..200u64 {
        stream.put(&format!("key-{}", id % 8), id.to_string());
    }
    std::thread::sleep(Duration::from_millis(20));
    let t = SystemTime::now();
    std::thread::sleep(Duration::from_millis(20));
    for id in 200..400u64 {
        stream.put(&format!("key-{}", id % 8), id.to_string());
    }
    let log = Log::default();
    let running = start(&stream, &store, &log, None, None).await;
    wait_for("the first pass", Duration::from_secs(20), || {
        log.len() >= 400
    })
    .await;
    running.seek(&SeekTarget::Timestamp(t)).await.unwrap();
    wait_for("the second pass", Duration::from_secs(20), || {
        log.len() >= 600
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    running.shutdown(Duration::from_secs(3)).await;
    let counts = log.counts();
    assert!(
        (0..200).all(|id| counts[&id] == 1),
        "records before the time are not redelivered"
    );
    assert!(
        (200..400).all(|id| counts[&id] == 2),
        "records since the time are redelivered"
    );
}

#[tokio::test(start_paused = true)]
async fn a_seek_to_a_captured_position_rereads_from_that_record() {
    let stream = MemoryStream::new("orders", 1);
    let store = MemoryLeaseStore::new();
    for id in 0..50u64 {
        stream.put("k", id.to_string());
    }
    let captured: Arc<Mutex<Option<Delivery>>> = Arc::default();
    let log = Log::default();
    let (l, c) = (log.clone(), captured.clone());
    let running = Consumer::builder(stream.name(), "seek-app", move |d: Delivery| {
        if id_of(&d) == 30 {
            c.lock().unwrap().get_or_insert(d.clone());
        }
        l.0.lock().unwrap().push(id_of(&d));
        std::future::ready(Outcome::Ack)
    })
    .worker_id("w1")
    .poll_interval(Duration::from_millis(200))
    .checkpoint_interval(Duration::from_millis(20))
    .lease_settings(
        LeaseSettings::default()
            .lease_duration(Duration::from_millis(900))
            .scan_interval(Duration::from_millis(100)),
    )
    .in_memory(&stream, &store)
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("all", Duration::from_secs(10), || log.len() >= 50).await;
    let d = captured.lock().unwrap().clone().unwrap();
    running
        .seek(&SeekTarget::Position {
            shard_id: d.shard().to_string(),
            position: *d.position(),
        })
        .await
        .unwrap();
    wait_for("the reread", Duration::from_secs(10), || log.len() >= 70).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    running.shutdown(Duration::from_secs(3)).await;
    let all = log.0.lock().unwrap().clone();
    assert_eq!(
        &all[50..],
        &(30..50).collect::<Vec<_>>()[..],
        "reread from record 30, inclusive"
    );
}

#[tokio::test(start_paused = true)]
async fn the_frontier_agrees_with_the_handled_log_and_reaches_the_tip_when_caught_up() {
    let stream = MemoryStream::new("orders", 3);
    let store = MemoryLeaseStore::new();
    let arrivals: Arc<Mutex<HashMap<u64, i64>>> = Arc::default();
    let put = |from: u64, to: u64| {
        for id in from..to {
            stream.put(&format!("key-{}", id % 16), id.to_string());
        }
        for r in stream.records() {
            let id: u64 = std::str::from_utf8(&r.record.data)
                .unwrap()
                .parse()
                .unwrap();
            let ms = r
                .record
                .arrived_at
                .unwrap()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_millis() as i64;
            arrivals.lock().unwrap().insert(id, ms);
        }
    };
    put(0, 300);
    let log = Log::default();
    let running = start(&stream, &store, &log, None, Some(Duration::from_millis(50))).await;
    let frontier = running.frontier();
    let mut checks = 0;
    let mut last_scalar = None;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut written_more = false;
    loop {
        let f = frontier.borrow().clone();
        if let Some(t) = f.scalar {
            // Everything that arrived at or before the frontier has been handled.
            let handled = log.counts();
            for (id, at) in arrivals.lock().unwrap().iter() {
                if *at <= t {
                    assert!(
                        handled.contains_key(id),
                        "frontier {t} passed unhandled record {id} (arrived {at})"
                    );
                }
            }
            assert!(last_scalar.is_none_or(|l| t >= l), "the frontier went back");
            last_scalar = Some(t);
            checks += 1;
        }
        if log.len() >= 300 && !written_more {
            tokio::time::sleep(Duration::from_millis(100)).await;
            put(300, 400);
            written_more = true;
        }
        let newest = arrivals.lock().unwrap().values().copied().max().unwrap();
        if log.len() >= 400 && last_scalar.is_some_and(|t| t >= newest) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the frontier never reached the newest record (at {last_scalar:?}, {} handled)",
            log.len()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        checks > 5,
        "the frontier was observed while consuming ({checks})"
    );
    assert_eq!(frontier.borrow().members.len(), 3);
    running.shutdown(Duration::from_secs(3)).await;
}
