//! A CloudWatch Logs subscription filter's Kinesis stream, live on moto: moto's CloudWatch Logs
//! writes each `PutLogEvents` batch of a subscribed group to moto's Kinesis as one gzip document,
//! as the service does, and the consumer (`ConsumerBuilder::cloudwatch_subscription`) reads it an
//! event at a time. A worker killed in the middle of a record's events is followed by another
//! that starts after the last event checkpointed; nothing is skipped. An event retried as a copy
//! comes back with its headers, and the copy is no stranger on the stream.

#[path = "support/logs.rs"]
mod logs;
#[path = "support/recorder.rs"]
mod recorder;
mod support;

use std::collections::BTreeMap;
use std::io::Write;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_cloudwatchlogs::types::InputLogEvent;
use logs::{logs_client, moto_kinesis, subscribed_stream};
use shardwise::consumer::RetryMode;
use shardwise::lease::{Checkpoint, LeaseSettings, LeaseStore};
use shardwise::producer::KinesisSink;
use shardwise::shard::discovery::KinesisShards;
use shardwise::shard::source::KinesisRecords;
use shardwise::subscription::{EVENT_ID_HEADER, LOG_GROUP_HEADER, TIMESTAMP_HEADER};
use shardwise::{Consumer, Delivery, Outcome, Position, Running};
use support::wait::{wait_for, wait_for_async};

/// One handled event: the worker, its position and attempt, log stream (partition key),
/// message, and headers (group, event id, timestamp).
#[derive(Debug, Clone)]
struct Seen {
    worker: &'static str,
    position: Position,
    attempt: u32,
    stream: String,
    message: String,
    group: Option<String>,
    event_id: Option<String>,
    timestamp: Option<String>,
}

type Handled = Arc<Mutex<Vec<Seen>>>;

/// The message of the event that fails once.
const RETRIED: &str = "1-16";

async fn start(
    worker: &'static str,
    kinesis: &aws_sdk_kinesis::Client,
    stream: &str,
    app: &str,
    handled: &Handled,
) -> Running {
    let handled = handled.clone();
    let handler = move |d: Delivery| {
        let handled = handled.clone();
        async move {
            let header = |name| d.headers().get_str(name).map(str::to_string);
            handled.lock().unwrap().push(Seen {
                worker,
                position: *d.position(),
                attempt: d.attempt(),
                stream: d.partition_key().to_string(),
                message: String::from_utf8_lossy(d.payload()).into_owned(),
                group: header(LOG_GROUP_HEADER),
                event_id: header(EVENT_ID_HEADER),
                timestamp: header(TIMESTAMP_HEADER),
            });
            tokio::time::sleep(Duration::from_millis(40)).await;
            // One event fails once: it comes back as a counted copy.
            if d.payload().as_ref() == RETRIED.as_bytes() && d.attempt() == 1 {
                return Outcome::Retry;
            }
            Outcome::Ack
        }
    };
    Consumer::builder(stream, app, handler)
        .worker_id(worker)
        .cloudwatch_subscription()
        .get_records_limit(1)
        .poll_interval(Duration::from_millis(200))
        .checkpoint_interval(Duration::from_millis(100))
        .lease_settings(
            LeaseSettings::default()
                .lease_duration(Duration::from_secs(3))
                .scan_interval(Duration::from_millis(300)),
        )
        .retries(RetryMode::Copy)
        .max_attempts(NonZeroU32::new(3).unwrap())
        .record_source(Arc::new(KinesisRecords::new(kinesis.clone())))
        .shard_lister(Arc::new(KinesisShards::new(kinesis.clone())))
        .record_sink(Arc::new(KinesisSink::new(kinesis.clone())))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(bytes).unwrap();
    encoder.finish().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_streams_events_are_read_one_at_a_time_across_a_killed_worker() {
    let _live = live_or_skip!();
    let warnings = recorder::Logs::default();
    let _ = tracing::subscriber::set_global_default(warnings.clone());
    let logs = logs_client().await;
    let kinesis = moto_kinesis().await;
    let stream = support::unique_name("cwl-sub");
    let group = format!("/aws/lambda/{}", support::unique_name("fn"));
    let app = support::unique_name("cwl-sub-app");
    subscribed_stream(&logs, &kinesis, &group, &stream).await;
    // The check CloudWatch Logs writes when a filter is created, and a record that is no
    // subscription document (delivered whole).
    let control = r#"{"messageType":"CONTROL_MESSAGE","owner":"CloudwatchLogs","logGroup":"","logStream":"","subscriptionFilters":[],"logEvents":[{"id":"","timestamp":0,"message":"CWL CONTROL MESSAGE: Checking health of destination Kinesis stream."}]}"#;
    for (key, data) in [
        ("control", gzip(control.as_bytes())),
        ("plain", b"not a document".to_vec()),
    ] {
        kinesis
            .put_record()
            .stream_name(&stream)
            .partition_key(key)
            .data(aws_sdk_kinesis::primitives::Blob::new(data))
            .send()
            .await
            .unwrap();
    }
    // Two log streams, each PutLogEvents batch one record of 6 events.
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let mut sent = BTreeMap::new();
    for (s, log_stream) in ["2026/12/07/[$LATEST]aaaa", "2026/12/07/[$LATEST]bbbb"]
        .into_iter()
        .enumerate()
    {
        logs.create_log_stream()
            .log_group_name(&group)
            .log_stream_name(log_stream)
            .send()
            .await
            .unwrap();
        for batch in 0..3 {
            let events: Vec<InputLogEvent> = (0..6)
                .map(|i| {
                    let n = batch * 6 + i;
                    sent.insert(format!("{s}-{n}"), log_stream.to_string());
                    InputLogEvent::builder()
                        .timestamp(now + n)
                        .message(format!("{s}-{n}"))
                        .build()
                        .unwrap()
                })
                .collect();
            logs.put_log_events()
                .log_group_name(&group)
                .log_stream_name(log_stream)
                .set_log_events(Some(events))
                .send()
                .await
                .unwrap();
        }
    }

    let handled: Handled = Arc::default();
    let first = start("w1", &kinesis, &stream, &app, &handled).await;
    // Killed in the middle of a record's events, after a checkpoint inside one.
    let store = shardwise::lease::DynamoDbLeaseStore::new(
        aws_sdk_dynamodb::Client::new(
            &aws_config::defaults(aws_config::BehaviorVersion::latest())
                .load()
                .await,
        ),
        &app,
    );
    wait_for(
        "w1 checkpoints inside a record",
        Duration::from_secs(60),
        || handled.lock().unwrap().len() >= 10,
    )
    .await;
    wait_for_async(
        "a checkpoint between events",
        Duration::from_secs(30),
        || {
            let (store, stream) = (store.clone(), stream.clone());
            async move {
                let rows = store.list(&stream).await.unwrap_or_default();
                rows.iter()
                    .any(|r| matches!(r.checkpoint, Checkpoint::At(p) if p.sub_sequence() > 0))
            }
        },
    )
    .await;
    first.abort();
    let row = store.list(&stream).await.unwrap().remove(0);
    let Checkpoint::At(killed_at) = row.checkpoint else {
        panic!("w1 checkpointed: {row:?}");
    };
    let second = start("w2", &kinesis, &stream, &app, &handled).await;
    wait_for("every event handled", Duration::from_secs(60), || {
        let handled = handled.lock().unwrap();
        sent.keys()
            .all(|m| handled.iter().any(|s| &s.message == m && s.attempt == 1))
            && handled
                .iter()
                .any(|s| s.message == RETRIED && s.attempt == 2)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    second.shutdown(Duration::from_secs(5)).await;

    let handled = handled.lock().unwrap().clone();
    // Every event, with where it came from; the plain record whole; the control message not.
    for s in handled.iter().filter(|s| s.message != "not a document") {
        assert_eq!(s.group.as_deref(), Some(group.as_str()), "{s:?}");
        assert_eq!(Some(&s.stream), sent.get(&s.message), "{s:?}");
        assert!(
            s.event_id.as_ref().is_some_and(|id| !id.is_empty()),
            "{s:?}"
        );
        let n: i64 = s.message.split('-').nth(1).unwrap().parse().unwrap();
        assert_eq!(s.timestamp, Some((now + n).to_string()), "{s:?}");
    }
    assert!(
        handled
            .iter()
            .any(|s| s.message == "not a document" && s.group.is_none()),
        "the plain record, whole: {handled:?}"
    );
    assert!(
        !handled.iter().any(|s| s.message.contains("CONTROL")),
        "the control message is no delivery: {handled:?}"
    );
    // The copy: the event again, its headers kept, read as what it is (no warning about it).
    let copy = handled
        .iter()
        .find(|s| s.message == RETRIED && s.attempt == 2)
        .expect("the copy handled");
    assert_eq!(copy.group.as_deref(), Some(group.as_str()), "{copy:?}");
    assert_eq!(Some(&copy.stream), sent.get(RETRIED), "{copy:?}");
    let about_the_copy = format!("sequence={}", copy.position.sequence());
    assert!(
        !warnings
            .text()
            .split_whitespace()
            .any(|word| word == about_the_copy),
        "a warning about the copy ({about_the_copy}): {}",
        warnings.text()
    );
    // w2 started after w1's checkpoint, inside a record: nothing at or before it again, and
    // nothing after it skipped.
    assert!(killed_at.sub_sequence() > 0, "{killed_at:?}");
    let w2: Vec<&Seen> = handled.iter().filter(|s| s.worker == "w2").collect();
    assert!(
        w2.iter().all(|s| s.position > killed_at),
        "w2 handled what w1 checkpointed (through {killed_at:?}): {w2:?}"
    );
    let mut positions: Vec<Position> = handled
        .iter()
        .filter(|s| s.attempt == 1)
        .map(|s| s.position)
        .collect();
    positions.sort();
    positions.dedup();
    assert_eq!(positions.len(), sent.len() + 1, "{handled:?}");
    // Each log stream's events in order, per worker (a copy comes back later, by design).
    for worker in ["w1", "w2"] {
        for log_stream in sent.values() {
            let order: Vec<i64> = handled
                .iter()
                .filter(|s| s.worker == worker && &s.stream == log_stream && s.attempt == 1)
                .map(|s| s.message.split('-').nth(1).unwrap().parse().unwrap())
                .collect();
            assert!(order.is_sorted(), "{worker} {log_stream}: {order:?}");
        }
    }
}
