//! The consumer in-process against the live emulators: KPL aggregates (built here with prost via
//! `kpl::aggregate`) deaggregated and resumed mid-aggregate, corrupt aggregates delivered whole, and
//! retries: counted copies, dead letters, delays, failing writes and refusals.

mod support;

use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::wait::wait_for;

use aws_sdk_dynamodb::types::AttributeValue;
use aws_sdk_kinesis::primitives::Blob;
use bytes::Bytes;
use shardwise::envelope::{self, Format, Headers};
use shardwise::lease::LeaseSettings;
use shardwise::retry::{ATTEMPTS_HEADER, DEAD_LETTER_REASON_HEADER, ORIGIN_SEQUENCE_HEADER};
use shardwise::testing::{HostClock, on_host};
use shardwise::{Consumer, ConsumerBuilder, Delivery, Outcome, kpl};
use support::Live;

/// (payload, partition key, sequence, sub-sequence, attempt)
type Seen = Arc<Mutex<Vec<(Vec<u8>, String, String, u64, u32)>>>;

fn builder<F, Fut>(stream: &str, app: &str, handler: F) -> ConsumerBuilder<F>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Outcome> + Send,
{
    Consumer::builder(stream, app, handler)
        .worker_id("live-w1")
        .poll_interval(Duration::from_millis(200))
        .checkpoint_interval(Duration::from_millis(100))
        .lease_settings(
            LeaseSettings::default()
                .lease_duration(Duration::from_millis(3000))
                .scan_interval(Duration::from_millis(200)),
        )
}

/// `builder` with retries as counted copies on the stream, three attempts at most.
fn copying<F, Fut>(builder: ConsumerBuilder<F>) -> ConsumerBuilder<F>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Outcome> + Send,
{
    builder
        .retries(shardwise::consumer::RetryMode::Copy)
        .max_attempts(NonZeroU32::new(3).unwrap())
}

fn record(seen: &Seen, d: &Delivery) {
    seen.lock().unwrap().push((
        d.payload().to_vec(),
        d.partition_key().to_string(),
        d.sequence_number().to_string(),
        d.sub_sequence(),
        d.attempt(),
    ));
}

async fn put_blob(live: &Live, stream: &str, key: &str, blob: Bytes) -> String {
    live.kinesis
        .put_record()
        .stream_name(stream)
        .partition_key(key)
        .data(Blob::new(blob))
        .send()
        .await
        .expect("PutRecord")
        .sequence_number
}

/// The stored checkpoint and sub-sequence of the stream's one shard.
async fn stored_checkpoint(live: &Live, app: &str, stream: &str) -> (String, u64) {
    let out = live
        .dynamodb
        .get_item()
        .table_name(app)
        .key(
            "leaseKey",
            AttributeValue::S(format!("{stream}#shardId-000000000000")),
        )
        .consistent_read(true)
        .send()
        .await
        .expect("GetItem");
    let item = out.item().expect("lease row");
    let cp = item
        .get("checkpoint")
        .and_then(|v| v.as_s().ok())
        .cloned()
        .unwrap_or_default();
    let sub = item
        .get("checkpointSub")
        .and_then(|v| v.as_n().ok())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    (cp, sub)
}

/// Every record of the stream's shards, decoded.
async fn read_all(live: &Live, stream: &str) -> Vec<envelope::Decoded> {
    live.read_records(stream)
        .await
        .iter()
        .map(|r| envelope::decode(Bytes::copy_from_slice(r.data().as_ref())))
        .collect()
}

#[tokio::test]
async fn kpl_aggregates_are_deaggregated_and_resume_mid_aggregate() {
    let live = live_or_skip!();
    let stream = support::unique_name("kpl");
    let app = support::unique_name("kpl-app");
    live.create_stream(&stream, 1).await;
    let subs: Vec<(String, Option<String>, Bytes)> = (0..10)
        .map(|i| {
            (
                format!("user-{}", i % 3),
                None,
                Bytes::from(format!("sub-{i}")),
            )
        })
        .collect();
    let seq = put_blob(&live, &stream, "agg", kpl::aggregate(&subs)).await;
    // A corrupt aggregate (digest broken) is delivered whole, as one plain record.
    let mut corrupt = kpl::aggregate(&subs).to_vec();
    let last = corrupt.len() - 1;
    corrupt[last] ^= 0xFF;
    put_blob(&live, &stream, "bad", Bytes::from(corrupt.clone())).await;

    // First run: sub-record 6 keeps failing (retried in place, the default), so the checkpoint
    // stops inside the aggregate at 5, and sub-record 9, of sub-record 6's key, waits behind it.
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let running = builder(&stream, &app, move |d: Delivery| {
        record(&s, &d);
        let hold = d.payload().as_ref() == b"sub-6";
        async move { if hold { Outcome::Retry } else { Outcome::Ack } }
    })
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    let firsts = || -> Vec<(Vec<u8>, String, String, u64, u32)> {
        let seen = seen.lock().unwrap();
        seen.iter().filter(|r| r.4 == 1).cloned().collect()
    };
    wait_for("10 first deliveries", Duration::from_secs(20), || {
        firsts().len() >= 10
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.shutdown(Duration::from_secs(3)).await;
    {
        let firsts = firsts();
        let subs: Vec<usize> = (0..9).collect();
        for (i, (data, key, s, sub, _)) in subs.iter().zip(&firsts) {
            assert_eq!(data, format!("sub-{i}").as_bytes());
            assert_eq!(key, &format!("user-{}", i % 3), "the sub-record's own key");
            assert_eq!((s.as_str(), *sub), (seq.as_str(), *i as u64));
        }
        assert_eq!(
            firsts[9].0, corrupt,
            "corrupt aggregate delivered byte for byte"
        );
        assert_eq!(firsts[9].3, 0);
        assert_eq!(firsts.len(), 10, "sub-9 waits behind sub-6: {firsts:?}");
        let seen = seen.lock().unwrap();
        assert!(
            seen.iter().filter(|r| r.0 == b"sub-6").count() >= 2,
            "sub-6 ran again in place"
        );
    }
    assert_eq!(
        stored_checkpoint(&live, &app, &stream).await,
        (seq.clone(), 5)
    );

    // Second run resumes at the aggregate and skips the sub-records already checkpointed.
    let again: Seen = Arc::default();
    let a = again.clone();
    let running = builder(&stream, &app, move |d: Delivery| {
        record(&a, &d);
        async { Outcome::Ack }
    })
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("the rest", Duration::from_secs(20), || {
        again.lock().unwrap().len() >= 5
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.shutdown(Duration::from_secs(3)).await;
    let again = again.lock().unwrap().clone();
    let subs_again: Vec<u64> = again.iter().filter(|r| r.2 == seq).map(|r| r.3).collect();
    assert_eq!(subs_again, [6, 7, 8, 9], "resumed at sub-record 6");
    assert_eq!(again.len(), 5, "then the corrupt record, nothing else");
    live.delete_stream(&stream).await;
}

#[tokio::test]
async fn retries_count_attempts_over_copies_then_dead_letter_with_payload_and_headers() {
    let live = live_or_skip!();
    let stream = support::unique_name("retry");
    let dlq = support::unique_name("retry-dlq");
    let app = support::unique_name("retry-app");
    live.create_stream(&stream, 2).await;
    live.create_stream(&dlq, 1).await;
    let mut headers = Headers::new();
    headers.insert("tenant", "acme");
    let poison = Bytes::from_static(b"\x00poison\xff");
    let original = put_blob(
        &live,
        &stream,
        "bad-key",
        envelope::encode(&headers, &poison),
    )
    .await;
    put_blob(&live, &stream, "good-key", Bytes::from_static(b"fine")).await;

    let seen: Seen = Arc::default();
    let s = seen.clone();
    let running = builder(&stream, &app, move |d: Delivery| {
        record(&s, &d);
        let bad = d.partition_key() == "bad-key";
        async move { if bad { Outcome::Retry } else { Outcome::Ack } }
    })
    .retries(shardwise::consumer::RetryMode::Copy)
    .max_attempts(NonZeroU32::new(3).unwrap())
    .dead_letter(dlq.clone())
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("three attempts", Duration::from_secs(30), || {
        seen.lock()
            .unwrap()
            .iter()
            .filter(|r| r.1 == "bad-key")
            .count()
            >= 3
    })
    .await;
    let letters = loop {
        let letters = read_all(&live, &dlq).await;
        if !letters.is_empty() {
            break letters;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    running.shutdown(Duration::from_secs(3)).await;

    let attempts: Vec<u32> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|r| r.1 == "bad-key")
        .map(|r| r.4)
        .collect();
    assert_eq!(attempts, [1, 2, 3]);
    assert_eq!(letters.len(), 1);
    let letter = &letters[0];
    assert_eq!(letter.format, Format::Rsk2);
    assert_eq!(letter.payload, poison, "payload byte for byte");
    assert_eq!(letter.headers.get_str("tenant"), Some("acme"));
    assert_eq!(letter.headers.get_str(ATTEMPTS_HEADER), Some("3"));
    assert!(letter.headers.get_str(DEAD_LETTER_REASON_HEADER).is_some());
    assert_eq!(
        letter.headers.get_str(ORIGIN_SEQUENCE_HEADER),
        Some(original.as_str())
    );
    live.delete_stream(&stream).await;
    live.delete_stream(&dlq).await;
}

#[tokio::test]
async fn a_missing_dead_letter_stream_fails_the_start_naming_it() {
    let live = live_or_skip!();
    let stream = support::unique_name("dlq-missing");
    let dlq = support::unique_name("dlq-misspelled");
    let app = support::unique_name("dlq-app");
    live.create_stream(&stream, 1).await;
    let err = builder(&stream, &app, |_d: Delivery| async { Outcome::Ack })
        .dead_letter(dlq.clone())
        .build()
        .unwrap()
        .run()
        .await
        .expect_err("a missing dead-letter stream fails the start");
    assert!(
        matches!(&err, shardwise::Error::StreamNotFound { stream } if *stream == dlq),
        "{err:?}"
    );
    let tables = live.dynamodb.list_tables().send().await.unwrap();
    assert!(
        !tables.table_names().contains(&app),
        "nothing was started: no lease table"
    );
    live.delete_stream(&stream).await;
}

#[tokio::test]
async fn a_dead_letter_stream_deleted_while_running_holds_the_checkpoint_until_it_exists_again() {
    let live = live_or_skip!();
    let stream = support::unique_name("dlq-gone");
    let dlq = support::unique_name("dlq-later");
    let app = support::unique_name("dlq-app");
    live.create_stream(&stream, 1).await;
    live.create_stream(&dlq, 1).await;
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let running = builder(&stream, &app, move |d: Delivery| {
        record(&s, &d);
        let bad = d.partition_key() == "bad-key";
        async move { if bad { Outcome::Retry } else { Outcome::Ack } }
    })
    .retries(shardwise::consumer::RetryMode::Copy)
    .max_attempts(NonZeroU32::new(1).unwrap())
    .dead_letter(dlq.clone())
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    live.delete_stream(&dlq).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while live
        .kinesis
        .describe_stream_summary()
        .stream_name(&dlq)
        .send()
        .await
        .is_ok()
    {
        assert!(
            Instant::now() < deadline,
            "the dead-letter stream was never deleted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let poison = put_blob(&live, &stream, "bad-key", Bytes::from_static(b"poison")).await;
    let after = put_blob(&live, &stream, "good-key", Bytes::from_static(b"fine")).await;
    wait_for("both", Duration::from_secs(20), || {
        seen.lock().unwrap().len() >= 2
    })
    .await;
    wait_for("the stuck write to show", Duration::from_secs(20), || {
        !running.stuck_writes().is_empty()
    })
    .await;
    let stuck = running.stuck_writes();
    assert_eq!(stuck.len(), 1, "{stuck:?}");
    assert_eq!(stuck[0].position.sequence().to_string(), poison);
    assert_eq!(stuck[0].to, dlq);
    assert!(stuck[0].error.contains(&dlq), "{}", stuck[0].error);
    let (cp, _) = stored_checkpoint(&live, &app, &stream).await;
    assert_eq!(
        cp, "TRIM_HORIZON",
        "the unwritten dead letter holds the checkpoint"
    );

    live.create_stream(&dlq, 1).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if stored_checkpoint(&live, &app, &stream).await.0 == after {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the checkpoint never passed the dead letter"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(read_all(&live, &dlq).await.len(), 1);
    assert!(running.stuck_writes().is_empty());
    running.shutdown(Duration::from_secs(3)).await;
    live.delete_stream(&stream).await;
    live.delete_stream(&dlq).await;
}

#[tokio::test]
async fn retry_after_copies_arrive_after_the_delay_and_a_crash_meanwhile_replays_the_original() {
    let live = live_or_skip!();
    let stream = support::unique_name("later");
    let app = support::unique_name("later-app");
    live.create_stream(&stream, 1).await;
    put_blob(&live, &stream, "slow", Bytes::from_static(b"wait")).await;
    let delay = Duration::from_millis(1500);

    // A worker that stops (its deadline passes) during the delay: nothing is written, the
    // original stays unsettled.
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let handler = move |d: Delivery| {
        record(&s, &d);
        async move { Outcome::RetryAfter(delay) }
    };
    let running = copying(builder(&stream, &app, handler.clone()))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("the first delivery", Duration::from_secs(20), || {
        !seen.lock().unwrap().is_empty()
    })
    .await;
    let report = running.shutdown(Duration::from_millis(200)).await;
    assert!(report.deadline_passed, "stopped during the delay");
    assert_eq!(
        read_all(&live, &stream).await.len(),
        1,
        "no copy was written"
    );
    assert_eq!(
        stored_checkpoint(&live, &app, &stream).await.0,
        "TRIM_HORIZON"
    );

    // The next worker gets the original again, and this time waits out the delay.
    let started = Instant::now();
    let running = copying(builder(&stream, &app, handler))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("a copy", Duration::from_secs(30), || {
        seen.lock().unwrap().iter().any(|r| r.4 == 2)
    })
    .await;
    running.shutdown(Duration::from_secs(1)).await;
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen[0].4, 1);
    assert_eq!(seen[1].4, 1, "the original replayed after the stop");
    assert!(started.elapsed() >= delay);
    let copy = read_all(&live, &stream).await;
    assert_eq!(copy.len(), 2);
    assert_eq!(copy[1].headers.attempt(), 2);
    live.delete_stream(&stream).await;
}

#[tokio::test]
async fn a_refused_retry_holds_the_checkpoint_while_later_records_are_handled() {
    let live = live_or_skip!();
    let stream = support::unique_name("refused");
    let app = support::unique_name("refused-app");
    live.create_stream(&stream, 1).await;
    let mut seqs = Vec::new();
    for i in 0..10 {
        seqs.push(
            put_blob(
                &live,
                &stream,
                &format!("k{i}"),
                Bytes::from(format!("{i}")),
            )
            .await,
        );
    }
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let running = builder(&stream, &app, move |d: Delivery| {
        record(&s, &d);
        let hold = d.payload().as_ref() == b"3";
        async move { if hold { Outcome::Retry } else { Outcome::Ack } }
    })
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("all ten", Duration::from_secs(20), || {
        seen.lock().unwrap().len() >= 10
    })
    .await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        stored_checkpoint(&live, &app, &stream).await.0,
        seqs[2],
        "held right before the refused record"
    );
    running.shutdown(Duration::from_secs(2)).await;

    let again: Seen = Arc::default();
    let a = again.clone();
    let running = builder(&stream, &app, move |d: Delivery| {
        record(&a, &d);
        async { Outcome::Ack }
    })
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("the reread", Duration::from_secs(20), || {
        again.lock().unwrap().len() >= 7
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    let reread: Vec<String> = again
        .lock()
        .unwrap()
        .iter()
        .map(|r| String::from_utf8(r.0.clone()).unwrap())
        .collect();
    assert_eq!(
        reread,
        ["3", "4", "5", "6", "7", "8", "9"],
        "the next owner rereads from the checkpoint"
    );
    live.delete_stream(&stream).await;
}

#[tokio::test]
async fn an_application_starting_at_a_timestamp_reads_what_arrived_since() {
    let live = live_or_skip!();
    let stream = support::unique_name("at-ts");
    let app = support::unique_name("at-ts-app");
    live.create_stream(&stream, 2).await;
    for i in 0..10 {
        put_blob(
            &live,
            &stream,
            &format!("k{i}"),
            Bytes::from(format!("old-{i}")),
        )
        .await;
    }
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let t = std::time::SystemTime::now();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    for i in 0..10 {
        put_blob(
            &live,
            &stream,
            &format!("k{i}"),
            Bytes::from(format!("new-{i}")),
        )
        .await;
    }
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let running = builder(&stream, &app, move |d: Delivery| {
        record(&s, &d);
        async { Outcome::Ack }
    })
    .initial_position(shardwise::lease::InitialPosition::AtTimestamp(t))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("the new records", Duration::from_secs(20), || {
        seen.lock().unwrap().len() >= 10
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.shutdown(Duration::from_secs(3)).await;
    let mut got: Vec<String> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|r| String::from_utf8(r.0.clone()).unwrap())
        .collect();
    got.sort();
    let mut want: Vec<String> = (0..10).map(|i| format!("new-{i}")).collect();
    want.sort();
    assert_eq!(got, want, "only what arrived since the start time");
    live.delete_stream(&stream).await;
}

/// A worker whose clock runs 60 s ahead starts a new application at LATEST on kinesis-mock. The
/// pin is taken from the `Date` of Kinesis's answers, so the records written after the worker
/// holds the shard are all handled; pinned by this host's clock (55 s in the stream's future) they
/// would not be, as an AT_TIMESTAMP iterator returns only records that arrived at or after it.
#[tokio::test]
async fn a_latest_start_on_a_host_whose_clock_runs_ahead_reads_what_arrives_next() {
    let live = live_or_skip!();
    let stream = support::unique_name("ahead");
    let app = support::unique_name("ahead-app");
    live.create_stream(&stream, 1).await;
    put_blob(&live, &stream, "k", Bytes::from_static(b"before")).await;
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let consumer = builder(&stream, &app, move |d: Delivery| {
        record(&s, &d);
        async { Outcome::Ack }
    })
    .initial_position(shardwise::lease::InitialPosition::Latest)
    .build()
    .unwrap();
    let running = on_host(HostClock::new(60_000, 0), consumer.run())
        .await
        .unwrap();
    wait_for("the shard held", Duration::from_secs(20), || {
        !running.shards().is_empty()
    })
    .await;
    // The pin is written before the first read; a second covers the Date header's truncation.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for i in 0..10 {
        put_blob(&live, &stream, "k", Bytes::from(format!("after-{i}"))).await;
    }
    // (The pin lies the LATEST margin back, so the record written before may come too: the
    // wait counts only the ones written after.)
    wait_for(
        "the 10 records written after the start",
        Duration::from_secs(20),
        || {
            seen.lock()
                .unwrap()
                .iter()
                .filter(|r| r.0.starts_with(b"after"))
                .count()
                >= 10
        },
    )
    .await;
    running.shutdown(Duration::from_secs(3)).await;
    let got: Vec<String> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|r| String::from_utf8(r.0.clone()).unwrap())
        .filter(|p| p.starts_with("after"))
        .collect();
    let want: Vec<String> = (0..10).map(|i| format!("after-{i}")).collect();
    assert_eq!(got, want, "every record written after the start, in order");
    live.delete_stream(&stream).await;
}

/// A receipt ledger that deletes receipts before the stream trims the records is refused at
/// start (a replay after a longer outage would apply effects again), naming the stream's
/// retention as DescribeStreamSummary reports it; one kept as long runs.
#[tokio::test]
async fn a_ledger_that_forgets_before_the_stream_trims_is_refused() {
    use shardwise::receipts::DynamoDbReceipts;
    let live = live_or_skip!();
    let stream = support::unique_name("kept");
    let app = support::unique_name("kept-app");
    let ledger_table = support::unique_name("kept-receipts");
    live.create_stream(&stream, 1).await;
    let start = |kept: Duration| {
        let ledger =
            DynamoDbReceipts::new(live.dynamodb.clone(), &ledger_table, &app).retention(kept);
        builder(&stream, &app, |_d: Delivery| async { Outcome::Ack })
            .receipts(Arc::new(ledger))
            .build()
            .unwrap()
            .run()
    };
    // kinesis-mock keeps the service's default, 24 hours.
    let refused = match start(Duration::from_secs(3600)).await {
        Ok(_) => panic!("a ledger kept an hour ran on a stream that keeps records a day"),
        Err(e) => e.to_string(),
    };
    assert!(refused.contains("receipt_retention"), "{refused}");
    assert!(
        refused.contains("keeps an event for up to 1.00 days"),
        "{refused}"
    );
    start(Duration::from_secs(24 * 3600))
        .await
        .expect("a ledger kept as long as the stream keeps records")
        .shutdown(Duration::from_secs(5))
        .await;
    live.delete_table(&ledger_table).await;
    live.delete_table(&app).await;
    live.delete_stream(&stream).await;
}

/// Retries in place on kinesis-mock: a key whose record fails three times and then succeeds is
/// handled in order (its later records wait), another key is not held up, nothing is written to
/// the stream, and the checkpoint never passes the failing record; a record that always fails
/// goes to the dead-letter stream after `max_attempts`, all attempts made on the original.
#[tokio::test]
async fn retries_in_place_keep_the_key_in_order_and_dead_letter_a_record_that_keeps_failing() {
    let live = live_or_skip!();
    let stream = support::unique_name("inplace");
    let dlq = support::unique_name("inplace-dlq");
    let app = support::unique_name("inplace-app");
    live.create_stream(&stream, 1).await;
    live.create_stream(&dlq, 1).await;
    let first = put_blob(&live, &stream, "fine", Bytes::from_static(b"z0")).await;
    for (key, payload) in [
        ("k1", "a1"),
        ("k1", "a2"),
        ("k2", "b1"),
        ("poison", "p1"),
        ("k1", "a3"),
        ("k2", "b2"),
    ] {
        put_blob(&live, &stream, key, Bytes::from(payload)).await;
    }
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let running = builder(&stream, &app, move |d: Delivery| {
        record(&s, &d);
        let fails = match d.payload().as_ref() {
            b"a1" => d.attempt() <= 3,
            b"p1" => true,
            _ => false,
        };
        async move { if fails { Outcome::Retry } else { Outcome::Ack } }
    })
    .lanes(3)
    .retries(shardwise::consumer::RetryMode::InPlace)
    .max_attempts(NonZeroU32::new(5).unwrap())
    .dead_letter(dlq.clone())
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    let payloads = |seen: &Seen| -> Vec<(String, u32)> {
        seen.lock()
            .unwrap()
            .iter()
            .map(|r| (String::from_utf8_lossy(&r.0).into_owned(), r.4))
            .collect()
    };
    wait_for("k2's records", Duration::from_secs(30), || {
        payloads(&seen).iter().any(|(p, _)| p == "b2")
    })
    .await;
    if !payloads(&seen).contains(&("a1".to_string(), 4)) {
        let (checkpoint, _) = stored_checkpoint(&live, &app, &stream).await;
        assert!(
            checkpoint == first || checkpoint == "TRIM_HORIZON",
            "the checkpoint passed a1 while it waited: {checkpoint}"
        );
    }
    let letters = loop {
        let letters = read_all(&live, &dlq).await;
        if !letters.is_empty() && payloads(&seen).iter().any(|(p, _)| p == "a3") {
            break letters;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    running.shutdown(Duration::from_secs(5)).await;

    let calls = payloads(&seen);
    let at = |payload: &str, attempt: u32| {
        calls
            .iter()
            .position(|(p, a)| p == payload && *a == attempt)
            .unwrap_or_else(|| panic!("{payload} attempt {attempt} in {calls:?}"))
    };
    assert!(
        at("a2", 1) > at("a1", 4) && at("a3", 1) > at("a2", 1),
        "k1 out of order: {calls:?}"
    );
    assert!(at("b1", 1) < at("a1", 2), "k2 waited: {calls:?}");
    let poison: Vec<u32> = calls
        .iter()
        .filter(|(p, _)| p == "p1")
        .map(|(_, a)| *a)
        .collect();
    assert_eq!(poison, [1, 2, 3, 4, 5]);
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].payload.as_ref(), b"p1");
    assert_eq!(letters[0].headers.get_str(ATTEMPTS_HEADER), Some("5"));
    assert_eq!(
        read_all(&live, &stream).await.len(),
        7,
        "nothing was written to the stream"
    );
    live.delete_stream(&stream).await;
    live.delete_stream(&dlq).await;
}
