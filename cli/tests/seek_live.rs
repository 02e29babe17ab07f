//! Seek and the frontier against the live emulators, driven through the `shardwise` CLI where a
//! user would: `shardwise seek` while consumers run and while none run, and `shardwise frontier`
//! checked against the handled-record log.

#[path = "../../tests/support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use support::wait::wait_for;

use aws_sdk_kinesis::primitives::{Blob, DateTime, DateTimeFormat};
use aws_sdk_kinesis::types::PutRecordsRequestEntry;
use serde_json::Value;
use shardwise::lease::{DynamoDbLeaseStore, LeaseSettings, LeaseStore};
use shardwise::{Consumer, Delivery, Outcome, Running};
use support::Live;

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

async fn put(live: &Live, stream: &str, ids: std::ops::Range<u64>) {
    let ids: Vec<u64> = ids.collect();
    for chunk in ids.chunks(16) {
        let entries = chunk
            .iter()
            .map(|id| {
                PutRecordsRequestEntry::builder()
                    .partition_key(format!("key-{}", id % 16))
                    .data(Blob::new(id.to_string()))
                    .build()
                    .unwrap()
            })
            .collect::<Vec<_>>();
        let out = live
            .kinesis
            .put_records()
            .stream_name(stream)
            .set_records(Some(entries))
            .send()
            .await
            .unwrap();
        assert_eq!(out.failed_record_count(), Some(0));
    }
}

/// (id, arrival ms) of every record of the stream.
async fn arrivals(live: &Live, stream: &str) -> Vec<(u64, i64)> {
    live.read_records(stream)
        .await
        .iter()
        .map(|r| {
            let id = std::str::from_utf8(r.data().as_ref())
                .unwrap()
                .parse()
                .unwrap();
            let at = r
                .approximate_arrival_timestamp()
                .unwrap()
                .to_millis()
                .unwrap();
            (id, at)
        })
        .collect()
}

async fn consume(stream: &str, app: &str, log: &Log, delay: Duration) -> Running {
    let l = log.clone();
    Consumer::builder(stream, app, move |d: Delivery| {
        let l = l.clone();
        async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            l.0.lock()
                .unwrap()
                .push(std::str::from_utf8(d.payload()).unwrap().parse().unwrap());
            Outcome::Ack
        }
    })
    .worker_id("seek-live")
    .lanes(4)
    .poll_interval(Duration::from_millis(200))
    .get_records_limit(50)
    .max_in_flight(50)
    .checkpoint_interval(Duration::from_millis(100))
    .caught_up_frontier(Duration::from_millis(0))
    .frontier_interval(Duration::from_millis(200))
    .lease_settings(
        LeaseSettings::default()
            .lease_duration(Duration::from_millis(3000))
            .scan_interval(Duration::from_millis(200)),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap()
}

fn cli(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_shardwise"))
        .args(args)
        .output()
        .expect("run shardwise");
    assert!(
        out.status.success(),
        "shardwise {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test]
async fn seek_to_the_trim_horizon_while_consuming_redelivers_everything_and_checkpoints_never_go_back()
 {
    let live = live_or_skip!();
    let stream = support::unique_name("seek-th");
    let app = support::unique_name("seek-th-app");
    live.create_stream(&stream, 2).await;
    put(&live, &stream, 0..300).await;
    let log = Log::default();
    let running = consume(&stream, &app, &log, Duration::from_millis(2)).await;
    wait_for("the first pass", Duration::from_secs(60), || {
        log.len() >= 300
    })
    .await;

    let out = cli(&[
        "seek",
        "--app",
        &app,
        "--stream",
        &stream,
        "--to",
        "trim-horizon",
    ]);
    let report: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(report["moved"].as_array().unwrap().len(), 2);
    let store = DynamoDbLeaseStore::new(live.dynamodb.clone(), &app);
    let mut last: HashMap<String, String> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while log.counts().values().filter(|n| **n >= 2).count() < 300 {
        for row in store.list(&stream).await.unwrap() {
            let k = row.checkpoint.sort_key();
            if let Some(prev) = last.get(&row.shard_id) {
                assert!(
                    k >= *prev,
                    "checkpoint of {} went back after the seek",
                    row.shard_id
                );
            }
            last.insert(row.shard_id, k);
        }
        assert!(
            Instant::now() < deadline,
            "not redelivered: {} of 300",
            log.counts().values().filter(|n| **n >= 2).count()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    running.shutdown(Duration::from_secs(3)).await;
    live.delete_stream(&stream).await;
}

#[tokio::test]
async fn seek_by_timestamp_with_no_consumer_running_redelivers_what_arrived_since() {
    let live = live_or_skip!();
    let stream = support::unique_name("seek-ts");
    let app = support::unique_name("seek-ts-app");
    live.create_stream(&stream, 2).await;
    put(&live, &stream, 0..100).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let t = SystemTime::now();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    put(&live, &stream, 100..200).await;
    let log = Log::default();
    let running = consume(&stream, &app, &log, Duration::ZERO).await;
    wait_for("the first pass", Duration::from_secs(30), || {
        log.len() >= 200
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.shutdown(Duration::from_secs(3)).await;

    let when = DateTime::from(t).fmt(DateTimeFormat::DateTime).unwrap();
    cli(&[
        "seek",
        "--app",
        &app,
        "--stream",
        &stream,
        "--to",
        &format!("timestamp:{when}"),
    ]);
    let running = consume(&stream, &app, &log, Duration::ZERO).await;
    wait_for("the second pass", Duration::from_secs(30), || {
        log.len() >= 300
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.shutdown(Duration::from_secs(3)).await;
    let counts = log.counts();
    assert!(
        (0..100).all(|id| counts[&id] == 1),
        "nothing before the time is redelivered"
    );
    assert!(
        (100..200).all(|id| counts[&id] == 2),
        "everything since the time is redelivered"
    );
    live.delete_stream(&stream).await;
}

#[tokio::test]
async fn the_frontier_printed_by_the_cli_agrees_with_the_handled_log() {
    let live = live_or_skip!();
    let stream = support::unique_name("frontier");
    let app = support::unique_name("frontier-app");
    live.create_stream(&stream, 3).await;
    put(&live, &stream, 0..400).await;
    let log = Log::default();
    let running = consume(&stream, &app, &log, Duration::from_millis(3)).await;
    let arrivals = arrivals(&live, &stream).await;
    let newest = arrivals.iter().map(|a| a.1).max().unwrap();
    let mut samples = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = cli(&["frontier", "--app", &app, "--stream", &stream, "--json"]);
        let f: Value = serde_json::from_str(out.trim()).unwrap();
        let handled = log.counts();
        if let Some(t) = f["frontier_ms"].as_i64() {
            for (id, at) in &arrivals {
                assert!(
                    *at > t || handled.contains_key(id),
                    "frontier {t} passed unhandled record {id} (arrived {at})"
                );
            }
            samples += 1;
            if t >= newest {
                break;
            }
        } else {
            assert!(f["why_none"].is_string(), "no scalar says why: {f}");
        }
        assert!(
            Instant::now() < deadline,
            "the frontier never reached the newest record: {f}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(samples >= 1);
    assert_eq!(log.counts().len(), 400);
    running.shutdown(Duration::from_secs(3)).await;
    live.delete_stream(&stream).await;
}
