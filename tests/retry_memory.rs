//! Retries and dead letters on the in-memory streams: retries in place (the default), counted
//! copies, delays, dead letters, and a failing write that holds the checkpoint until it goes
//! through.

#[path = "support/wait.rs"]
mod wait;

use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use wait::wait_for;

use shardwise::consumer::{OnSpent, RetryMode};
use shardwise::envelope::{self, Format};
use shardwise::lease::{Checkpoint, LeaseSettings, MemoryLeaseStore};
use shardwise::producer::MAX_RECORD_BYTES;
use shardwise::receipts::{Disposition, MemoryReceipts};
use shardwise::retry::{ATTEMPTS_HEADER, DEAD_LETTER_REASON_HEADER, ORIGIN_SEQUENCE_HEADER};
use shardwise::testing::{MemoryStream, MemoryStreams};
use shardwise::{Consumer, ConsumerBuilder, Delivery, Error, Outcome, Position, Running};

type Seen = Arc<Mutex<Vec<(String, u32, Instant)>>>;

fn consumer<F, Fut>(
    stream: &MemoryStream,
    sink: &MemoryStreams,
    store: &MemoryLeaseStore,
    handler: F,
) -> ConsumerBuilder<F>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Outcome> + Send,
{
    Consumer::builder(stream.name(), "retry-app", handler)
        .worker_id("w1")
        .poll_interval(Duration::from_millis(200))
        .checkpoint_interval(Duration::from_millis(50))
        .lease_settings(
            LeaseSettings::default()
                .lease_duration(Duration::from_millis(1500))
                .scan_interval(Duration::from_millis(100)),
        )
        .in_memory(stream, store)
        .record_sink(Arc::new(sink.clone()))
}

/// [`consumer`] with retries as counted copies on the stream.
fn copying<F, Fut>(
    stream: &MemoryStream,
    sink: &MemoryStreams,
    store: &MemoryLeaseStore,
    handler: F,
) -> ConsumerBuilder<F>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Outcome> + Send,
{
    consumer(stream, sink, store, handler).retries(RetryMode::Copy)
}

fn recorder(
    seen: &Seen,
    fail: &'static str,
    outcome: Outcome,
) -> impl Fn(Delivery) -> std::future::Ready<Outcome> + Clone + use<> {
    let seen = seen.clone();
    move |d: Delivery| {
        let text = String::from_utf8_lossy(d.payload()).to_string();
        seen.lock()
            .unwrap()
            .push((text.clone(), d.attempt(), Instant::now()));
        std::future::ready(if text == fail {
            outcome.clone()
        } else {
            Outcome::Ack
        })
    }
}

#[tokio::test(start_paused = true)]
async fn attempts_are_counted_over_copies_up_to_the_cap_then_the_record_is_dead_lettered() {
    let stream = MemoryStream::new("orders", 1);
    let dlq = MemoryStream::new("orders-dlq", 1);
    let sink = MemoryStreams::new([stream.clone(), dlq.clone()]);
    let store = MemoryLeaseStore::new();
    // A record from another producer with its own headers.
    let mut headers = envelope::Headers::new();
    headers.insert("tenant", "acme");
    stream.put("k1", envelope::encode(&headers, b"poison"));
    stream.put("k2", "fine");
    let seen: Seen = Arc::default();
    let running = copying(
        &stream,
        &sink,
        &store,
        recorder(&seen, "poison", Outcome::Retry),
    )
    .max_attempts(NonZeroU32::new(3).unwrap())
    .dead_letter("orders-dlq")
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("the dead letter", Duration::from_secs(15), || {
        !dlq.records().is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    running.shutdown(Duration::from_secs(2)).await;

    let attempts: Vec<u32> = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.0 == "poison")
        .map(|s| s.1)
        .collect();
    assert_eq!(
        attempts,
        [1, 2, 3],
        "attempt 1, then copies counted 2 and 3"
    );
    let letters = dlq.records();
    assert_eq!(letters.len(), 1);
    let letter = envelope::decode(letters[0].record.data.clone());
    assert_eq!(letter.format, Format::Rsk2);
    assert_eq!(letter.payload.as_ref(), b"poison", "payload byte for byte");
    assert_eq!(
        letter.headers.get_str("tenant"),
        Some("acme"),
        "the record's own headers"
    );
    assert_eq!(letter.headers.get_str(ATTEMPTS_HEADER), Some("3"));
    assert!(letter.headers.get_str(DEAD_LETTER_REASON_HEADER).is_some());
    assert_eq!(letters[0].record.partition_key, "k1");
    let original = stream.records()[0].record.sequence.to_string();
    assert_eq!(
        letter.headers.get_str(ORIGIN_SEQUENCE_HEADER),
        Some(original.as_str()),
        "one identity across copies"
    );
    // The stream holds the original, the fine record and two counted copies.
    let on_stream: Vec<u32> = stream
        .records()
        .iter()
        .map(|r| envelope::decode(r.record.data.clone()).headers.attempt())
        .collect();
    assert_eq!(on_stream, [1, 1, 2, 3]);
    // Every record settled: the checkpoint is at the last copy.
    let last = stream.records().last().unwrap().record.sequence;
    assert_eq!(
        store.snapshot()[0].checkpoint,
        Checkpoint::At(Position::new(last, 0))
    );
}

// On real time: it measures the delay with the recorder's std::time::Instant.
#[tokio::test]
async fn retry_after_writes_the_copy_no_earlier_than_the_delay_and_holds_the_checkpoint_meanwhile()
{
    let stream = MemoryStream::new("orders", 1);
    let sink = MemoryStreams::new([stream.clone()]);
    let store = MemoryLeaseStore::new();
    stream.put("k1", "later");
    stream.put("k2", "next");
    let seen: Seen = Arc::default();
    let delay = Duration::from_millis(1200);
    let running = copying(
        &stream,
        &sink,
        &store,
        recorder(&seen, "later", Outcome::RetryAfter(delay)),
    )
    .max_attempts(NonZeroU32::new(2).unwrap())
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("both records", Duration::from_secs(10), || {
        seen.lock().unwrap().len() >= 2
    })
    .await;
    let first = seen.lock().unwrap()[0].2;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(stream.records().len(), 2, "no copy before the delay");
    assert!(
        matches!(store.snapshot()[0].checkpoint, Checkpoint::TrimHorizon),
        "the waiting original holds the checkpoint"
    );
    wait_for("the copy", Duration::from_secs(10), || {
        stream.records().len() == 3
    })
    .await;
    wait_for("the copy handled", Duration::from_secs(10), || {
        seen.lock().unwrap().len() >= 3
    })
    .await;
    let copy = seen.lock().unwrap()[2].clone();
    assert_eq!((copy.0.as_str(), copy.1), ("later", 2));
    assert!(
        copy.2 - first >= delay,
        "copy arrived after {:?}",
        copy.2 - first
    );
    running.shutdown(Duration::from_secs(5)).await;
}

#[tokio::test(start_paused = true)]
async fn a_missing_dead_letter_stream_fails_at_start_naming_it() {
    let stream = MemoryStream::new("orders", 1);
    let sink = MemoryStreams::new([stream.clone()]);
    let store = MemoryLeaseStore::new();
    let seen: Seen = Arc::default();
    let err = consumer(&stream, &sink, &store, recorder(&seen, "", Outcome::Ack))
        .dead_letter("orders-dlq-misspelled")
        .build()
        .unwrap()
        .run()
        .await
        .expect_err("a missing dead-letter stream fails the start");
    assert!(
        matches!(&err, Error::StreamNotFound { stream } if stream == "orders-dlq-misspelled"),
        "{err:?}"
    );
    assert!(err.to_string().contains("orders-dlq-misspelled"), "{err}");
    assert!(
        store.snapshot().is_empty(),
        "nothing was started: no lease rows"
    );
}

#[tokio::test(start_paused = true)]
async fn a_dead_letter_stream_lost_while_running_holds_the_checkpoint_visibly_until_it_exists_again()
 {
    let stream = MemoryStream::new("orders", 1);
    let dlq = MemoryStream::new("orders-dlq", 1);
    let sink = MemoryStreams::new([stream.clone(), dlq.clone()]);
    let store = MemoryLeaseStore::new();
    let seen: Seen = Arc::default();
    let running = copying(
        &stream,
        &sink,
        &store,
        recorder(&seen, "poison", Outcome::Retry),
    )
    .max_attempts(NonZeroU32::new(1).unwrap())
    .dead_letter("orders-dlq")
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    // The dead-letter stream is deleted after the start check.
    sink.remove("orders-dlq");
    let (_, poison) = stream.put("k1", "poison");
    stream.put("k2", "fine");
    wait_for("both handled", Duration::from_secs(10), || {
        seen.lock().unwrap().len() >= 2
    })
    .await;
    wait_for("the stuck write to show", Duration::from_secs(5), || {
        !running.stuck_writes().is_empty()
    })
    .await;
    let stuck = running.stuck_writes();
    assert_eq!(stuck.len(), 1, "{stuck:?}");
    assert_eq!(stuck[0].position, Position::new(poison, 0));
    assert_eq!(stuck[0].to, "orders-dlq");
    assert!(stuck[0].dead_letter);
    assert!(stuck[0].error.contains("orders-dlq"), "{}", stuck[0].error);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(
        matches!(store.snapshot()[0].checkpoint, Checkpoint::TrimHorizon),
        "the unwritten dead letter holds the checkpoint: {:?}",
        store.snapshot()[0].checkpoint
    );
    // The stream comes back: the dead letter goes through and the checkpoint passes.
    sink.add(dlq.clone());
    wait_for("the dead letter", Duration::from_secs(15), || {
        dlq.records().len() == 1
    })
    .await;
    let last = stream.records()[1].record.sequence;
    wait_for("the checkpoint to pass", Duration::from_secs(5), || {
        store.snapshot()[0].checkpoint == Checkpoint::At(Position::new(last, 0))
    })
    .await;
    assert!(running.stuck_writes().is_empty(), "no longer stuck");
    running.shutdown(Duration::from_secs(2)).await;
}

#[tokio::test(start_paused = true)]
async fn a_retry_copy_too_large_for_a_record_goes_the_dead_letter_way_and_never_loops() {
    let stream = MemoryStream::new("orders", 1);
    let dlq = MemoryStream::new("orders-dlq", 1);
    let sink = MemoryStreams::new([stream.clone(), dlq.clone()]);
    let store = MemoryLeaseStore::new();
    // The record fits the limit as it is; its copy (with the envelope and origin headers) does not.
    let big = vec![b'x'; MAX_RECORD_BYTES - 2];
    let (_, sequence) = stream.put("k", big.clone());
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let running = copying(&stream, &sink, &store, move |d: Delivery| {
        s.lock().unwrap().push((
            format!("{} bytes", d.payload().len()),
            d.attempt(),
            Instant::now(),
        ));
        std::future::ready(Outcome::Retry)
    })
    .max_attempts(NonZeroU32::new(5).unwrap())
    .dead_letter("orders-dlq")
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("the write to be stuck", Duration::from_secs(10), || {
        !running.stuck_writes().is_empty()
    })
    .await;
    let stuck = running.stuck_writes();
    assert_eq!(stuck.len(), 1);
    assert_eq!(stuck[0].position, Position::new(sequence, 0));
    assert!(
        stuck[0].dead_letter,
        "the copy cannot be written, so the record is spent: its dead letter is what is stuck"
    );
    assert!(
        stuck[0].error.contains("over the limit"),
        "{}",
        stuck[0].error
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(stream.records().len(), 1, "no copy was written");
    assert!(dlq.records().is_empty(), "nor a dead letter");
    assert_eq!(
        seen.lock().unwrap().len(),
        1,
        "handled once: no loop of copies"
    );
    assert!(
        matches!(store.snapshot()[0].checkpoint, Checkpoint::TrimHorizon),
        "the record holds the checkpoint: nothing is lost"
    );
    running.shutdown(Duration::from_secs(2)).await;
}

/// Copy mode needs a bound: without `max_attempts` and without a dead-letter stream a plain
/// `retry()` could never be written, and seed 002's rule would refuse it record by record,
/// holding the checkpoint until a restart. The build refuses that instead, naming both.
#[tokio::test]
async fn copy_mode_without_a_cap_or_a_dead_letter_stream_is_refused_at_build_naming_both() {
    let stream = MemoryStream::new("orders", 1);
    let sink = MemoryStreams::new([stream.clone()]);
    let store = MemoryLeaseStore::new();
    let seen: Seen = Arc::default();
    let err = copying(&stream, &sink, &store, recorder(&seen, "", Outcome::Ack))
        .build()
        .expect_err("copies without a bound");
    assert_eq!(err.field(), "retries");
    let text = err.to_string();
    assert!(
        text.contains("max_attempts") && text.contains("dead_letter"),
        "{text}"
    );
    for bounded in [
        copying(&stream, &sink, &store, recorder(&seen, "", Outcome::Ack))
            .max_attempts(NonZeroU32::new(3).unwrap()),
        copying(&stream, &sink, &store, recorder(&seen, "", Outcome::Ack))
            .dead_letter("orders-dlq"),
    ] {
        bounded.build().expect("either bound is enough");
    }
}

/// In copy mode a dead-letter stream alone caps attempts at the default, so a poison record
/// answered with `RetryAfter` is not copied forever.
#[tokio::test(start_paused = true)]
async fn copies_with_a_dead_letter_stream_alone_stop_at_the_default_cap() {
    let stream = MemoryStream::new("orders", 1);
    let dlq = MemoryStream::new("orders-dlq", 1);
    let sink = MemoryStreams::new([stream.clone(), dlq.clone()]);
    let store = MemoryLeaseStore::new();
    stream.put("k1", "poison");
    stream.put("k2", "fine");
    let seen: Seen = Arc::default();
    let running = copying(
        &stream,
        &sink,
        &store,
        recorder(
            &seen,
            "poison",
            Outcome::RetryAfter(Duration::from_millis(10)),
        ),
    )
    .dead_letter("orders-dlq")
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    let attempts = || {
        seen.lock()
            .unwrap()
            .iter()
            .filter(|(text, _, _)| text == "poison")
            .map(|(_, attempt, _)| *attempt)
            .collect::<Vec<_>>()
    };
    let cap = shardwise::retry::DEFAULT_MAX_ATTEMPTS;
    wait_for("the dead letter", Duration::from_secs(10), || {
        !dlq.records().is_empty()
    })
    .await;
    let last = stream.records().last().unwrap().record.sequence;
    wait_for(
        "the checkpoint to pass the last copy",
        Duration::from_secs(5),
        || store.snapshot()[0].checkpoint == Checkpoint::At(Position::new(last, 0)),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        attempts(),
        (1..=cap).collect::<Vec<_>>(),
        "no copy past the cap"
    );
    assert_eq!(stream.records().len(), 2 + cap as usize - 1);
    assert_eq!(dlq.records().len(), 1);
    running.shutdown(Duration::from_secs(2)).await;
}

/// On default settings (no retry mode, cap or dead-letter stream) a handler that answers
/// `retry()`, `retry_after(d)` or panics gets the record again in place, as Lambda's trigger
/// runs a failing batch again until it succeeds: nothing is written to the stream, the key's
/// later records wait, other keys go on, and the checkpoint passes everything once it succeeds.
/// The waits between attempts follow the stated back-off: after failure n, between half and all
/// of min(100 ms x 2^(n-1), 5 s); `retry_after(d)` waits d.
#[tokio::test(start_paused = true)]
async fn a_retry_on_default_settings_runs_again_in_place_until_it_succeeds() {
    let stream = MemoryStream::new("orders", 2);
    let sink = MemoryStreams::new([stream.clone()]);
    let store = MemoryLeaseStore::new();
    for (key, payload) in [
        ("k1", "retry"),
        ("k1", "retry-next"),
        ("k2", "after"),
        ("k3", "panics"),
        ("k4", "fine"),
    ] {
        stream.put(key, payload);
    }
    /// (payload, attempt, when)
    type Calls = Arc<Mutex<Vec<(String, u32, tokio::time::Instant)>>>;
    let calls: Calls = Arc::default();
    let seen = calls.clone();
    let handler = move |d: Delivery| {
        let text = String::from_utf8_lossy(d.payload()).to_string();
        seen.lock()
            .unwrap()
            .push((text.clone(), d.attempt(), tokio::time::Instant::now()));
        async move {
            match (text.as_str(), d.attempt()) {
                ("retry", 1..=7) => Outcome::Retry,
                ("after", 1..=2) => Outcome::RetryAfter(Duration::from_secs(3)),
                ("panics", 1) => panic!("a handler bug"),
                _ => Outcome::Ack,
            }
        }
    };
    let running = consumer(&stream, &sink, &store, handler)
        .lanes(2)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("every record settled", Duration::from_secs(60), || {
        store.snapshot().iter().all(|row| {
            let last = stream
                .records()
                .iter()
                .filter(|r| r.shard_id == row.shard_id)
                .map(|r| r.record.sequence)
                .max();
            last.is_none_or(|last| row.checkpoint == Checkpoint::At(Position::new(last, 0)))
        })
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;

    let calls = calls.lock().unwrap().clone();
    let of = |payload: &str| -> Vec<(u32, tokio::time::Instant)> {
        calls
            .iter()
            .filter(|(p, _, _)| p == payload)
            .map(|(_, a, t)| (*a, *t))
            .collect()
    };
    let retried = of("retry");
    assert_eq!(
        retried.iter().map(|(a, _)| *a).collect::<Vec<_>>(),
        (1..=8).collect::<Vec<_>>(),
        "seven failures, then the eighth attempt succeeds"
    );
    for (n, pair) in retried.windows(2).enumerate() {
        let failure = n as u32 + 1;
        let full = Duration::from_millis(100 << (failure - 1)).min(Duration::from_secs(5));
        let waited = pair[1].1 - pair[0].1;
        assert!(
            waited >= full / 2 && waited <= full + Duration::from_millis(50),
            "after failure {failure}: waited {waited:?}, back-off {full:?}"
        );
    }
    let after = of("after");
    assert_eq!(after.len(), 3);
    for pair in after.windows(2) {
        assert!(pair[1].1 - pair[0].1 >= Duration::from_secs(3), "{after:?}");
    }
    assert_eq!(of("panics").len(), 2, "a panic is a retry: run again once");
    assert_eq!(of("fine").len(), 1);
    let at = |payload: &str, attempt: u32| {
        calls
            .iter()
            .position(|(p, a, _)| p == payload && *a == attempt)
            .unwrap_or_else(|| panic!("{payload} attempt {attempt} not made: {calls:?}"))
    };
    assert_eq!(of("retry-next").len(), 1);
    assert!(
        at("retry-next", 1) > at("retry", 8),
        "k1's next record waits behind the failing one: {calls:?}"
    );
    assert_eq!(
        stream.records().len(),
        5,
        "nothing was written to the stream"
    );
}

#[tokio::test(start_paused = true)]
async fn records_from_other_producers_arrive_as_plain_payloads_at_attempt_one() {
    let stream = MemoryStream::new("orders", 1);
    let sink = MemoryStreams::new([stream.clone()]);
    let store = MemoryLeaseStore::new();
    let foreign: [&[u8]; 4] = [
        b"{\"json\":1}",
        b"\x00\xff\x10binary",
        b"RSK2\x00\x00\x00\xff",
        b"RSK1 not really",
    ];
    for blob in foreign {
        stream.put("k", blob.to_vec());
    }
    /// (payload, attempt, header count)
    type Got = Arc<Mutex<Vec<(Vec<u8>, u32, usize)>>>;
    let got: Got = Arc::default();
    let g = got.clone();
    let running = consumer(&stream, &sink, &store, move |d: Delivery| {
        g.lock()
            .unwrap()
            .push((d.payload().to_vec(), d.attempt(), d.headers().len()));
        std::future::ready(Outcome::Ack)
    })
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("all four", Duration::from_secs(10), || {
        got.lock().unwrap().len() == 4
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    for ((payload, attempt, headers), blob) in got.lock().unwrap().iter().zip(foreign) {
        assert_eq!(payload.as_slice(), blob, "byte for byte");
        assert_eq!((*attempt, *headers), (1, 0));
    }
}

/// A handler that records every call (payload, attempt, when) and fails `fail`'s first
/// `failures` attempts (`u32::MAX`: every attempt) with `Retry`.
fn failing_first(
    seen: &Seen,
    fail: &'static str,
    failures: u32,
) -> impl Fn(Delivery) -> std::future::Ready<Outcome> + Clone + use<> {
    let seen = seen.clone();
    move |d: Delivery| {
        let text = String::from_utf8_lossy(d.payload()).to_string();
        let failing = text == fail && d.attempt() <= failures;
        seen.lock()
            .unwrap()
            .push((text, d.attempt(), Instant::now()));
        std::future::ready(if failing {
            Outcome::Retry
        } else {
            Outcome::Ack
        })
    }
}

/// Every call made, as (payload, attempt), in order.
fn calls_made(seen: &Seen) -> Vec<(String, u32)> {
    seen.lock()
        .unwrap()
        .iter()
        .map(|(p, a, _)| (p.clone(), *a))
        .collect()
}

/// Waits until the one shard's checkpoint is at its `index`-th record: everything settled.
async fn settled_through(stream: &MemoryStream, store: &MemoryLeaseStore, index: usize) {
    let last = stream.records()[index].record.sequence;
    wait_for("everything settled", Duration::from_secs(10), || {
        store.snapshot()[0].checkpoint == Checkpoint::At(Position::new(last, 0))
    })
    .await;
}

/// Where in `seen` the call of `payload`'s `attempt` is.
fn call_at(seen: &Seen, payload: &str, attempt: u32) -> usize {
    let seen = seen.lock().unwrap();
    seen.iter()
        .position(|(p, a, _)| p == payload && *a == attempt)
        .unwrap_or_else(|| panic!("{payload} attempt {attempt} in {seen:?}"))
}

/// In place (Lambda's and KCL's way), a failing record runs again on its lane after a back-off,
/// as the next attempt, with nothing written to the stream; the later records of its key wait
/// behind it in order, other keys go on, and the checkpoint holds behind it until it succeeds.
#[tokio::test(start_paused = true)]
async fn in_place_a_failing_record_runs_again_and_the_later_records_of_its_key_wait_behind_it() {
    let stream = MemoryStream::new("orders", 1);
    let sink = MemoryStreams::new([stream.clone()]);
    let store = MemoryLeaseStore::new();
    for (key, payload) in [
        ("k0", "z0"),
        ("k1", "a1"),
        ("k1", "a2"),
        ("k2", "b1"),
        ("k1", "a3"),
        ("k2", "b2"),
    ] {
        stream.put(key, payload);
    }
    let seen: Seen = Arc::default();
    let running = consumer(&stream, &sink, &store, failing_first(&seen, "a1", 3))
        .lanes(2)
        .retries(RetryMode::InPlace)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("the other keys", Duration::from_secs(10), || {
        seen.lock().unwrap().iter().any(|(p, _, _)| p == "b2")
    })
    .await;
    tokio::time::sleep(Duration::from_millis(60)).await;
    let waiting = seen
        .lock()
        .unwrap()
        .iter()
        .filter(|(p, _, _)| p == "a1")
        .count();
    assert!(waiting < 4, "a1 still failing: {:?}", seen.lock().unwrap());
    let health = running.health();
    let retry = health.shards[0].oldest_retry.clone().expect("a1 named");
    let a1 = stream.records()[1].record.sequence;
    assert_eq!(
        (retry.key.as_str(), retry.attempts),
        ("k1", waiting as u32),
        "{retry:?}"
    );
    assert!(retry.event.contains(&a1.to_string()), "{retry:?}");
    assert_eq!(health.shards[0].retrying, 1);
    let z0 = stream.records()[0].record.sequence;
    assert_eq!(
        store.snapshot()[0].checkpoint,
        Checkpoint::At(Position::new(z0, 0)),
        "the checkpoint holds behind the failing record"
    );
    settled_through(&stream, &store, 5).await;
    running.shutdown(Duration::from_secs(2)).await;

    let succeeded = call_at(&seen, "a1", 4);
    for attempt in 1..4 {
        assert!(call_at(&seen, "a1", attempt) < succeeded);
    }
    assert!(
        call_at(&seen, "a2", 1) > succeeded && call_at(&seen, "a3", 1) > call_at(&seen, "a2", 1),
        "key k1 out of order: {:?}",
        seen.lock().unwrap()
    );
    assert!(
        call_at(&seen, "b1", 1) < call_at(&seen, "a1", 2)
            && call_at(&seen, "b2", 1) < call_at(&seen, "a1", 2),
        "key k2 waited for k1's back-off: {:?}",
        seen.lock().unwrap()
    );
    assert_eq!(
        stream.records().len(),
        6,
        "nothing was written to the stream"
    );
    assert_eq!(
        seen.lock().unwrap().len(),
        9,
        "a1 four times, the others once"
    );
}

/// In place, a record that keeps failing goes to the dead-letter stream after `max_attempts`,
/// all attempts made on the original; its key's later records wait until the dead letter is
/// written.
#[tokio::test(start_paused = true)]
async fn in_place_a_record_that_keeps_failing_is_dead_lettered_after_max_attempts() {
    let stream = MemoryStream::new("orders", 1);
    let dlq = MemoryStream::new("orders-dlq", 1);
    let sink = MemoryStreams::new([stream.clone(), dlq.clone()]);
    let store = MemoryLeaseStore::new();
    stream.put("k1", "poison");
    stream.put("k1", "after");
    let seen: Seen = Arc::default();
    let running = consumer(
        &stream,
        &sink,
        &store,
        failing_first(&seen, "poison", u32::MAX),
    )
    .retries(RetryMode::InPlace)
    .max_attempts(NonZeroU32::new(3).unwrap())
    .dead_letter("orders-dlq")
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    settled_through(&stream, &store, 1).await;
    running.shutdown(Duration::from_secs(2)).await;
    let calls = calls_made(&seen);
    assert_eq!(
        calls,
        [
            ("poison".to_string(), 1),
            ("poison".to_string(), 2),
            ("poison".to_string(), 3),
            ("after".to_string(), 1)
        ]
    );
    assert_eq!(stream.records().len(), 2, "no copies in place");
    let letters = dlq.records();
    assert_eq!(letters.len(), 1);
    let letter = envelope::decode(letters[0].record.data.clone());
    assert_eq!(letter.payload.as_ref(), b"poison");
    assert_eq!(letter.headers.get_str(ATTEMPTS_HEADER), Some("3"));
}

/// In place, a record whose attempts are spent with no dead-letter stream is dropped only where
/// the application said so: `on_spent(Drop)`, or `max_record_age` (records older than it are not
/// handled, as Lambda discards them); `max_attempts` with neither is refused at build, naming the
/// field.
#[tokio::test(start_paused = true)]
async fn in_place_a_spent_record_is_dropped_only_where_on_spent_says_so() {
    let stream = MemoryStream::new("orders", 1);
    let sink = MemoryStreams::new([stream.clone()]);
    let store = MemoryLeaseStore::new();
    let seen: Seen = Arc::default();
    let refused = |builder: ConsumerBuilder<_>| {
        builder
            .retries(RetryMode::InPlace)
            .build()
            .err()
            .map(|e| e.field().to_string())
    };
    let handler = failing_first(&seen, "poison", u32::MAX);
    assert_eq!(
        refused(
            consumer(&stream, &sink, &store, handler.clone())
                .max_attempts(NonZeroU32::new(2).unwrap())
        ),
        Some("max_attempts".into())
    );
    assert_eq!(
        refused(
            consumer(&stream, &sink, &store, handler.clone())
                .max_record_age(Duration::from_secs(60))
        ),
        None,
        "max_record_age says records older than it are not handled"
    );
    assert_eq!(
        refused(consumer(&stream, &sink, &store, handler.clone())),
        None,
        "no bound: a failing record runs again until it succeeds"
    );

    stream.put("k1", "poison");
    stream.put("k1", "after");
    let running = consumer(&stream, &sink, &store, handler)
        .retries(RetryMode::InPlace)
        .max_attempts(NonZeroU32::new(2).unwrap())
        .on_spent(OnSpent::Drop)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    settled_through(&stream, &store, 1).await;
    running.shutdown(Duration::from_secs(2)).await;
    let calls = calls_made(&seen);
    assert_eq!(
        calls,
        [
            ("poison".to_string(), 1),
            ("poison".to_string(), 2),
            ("after".to_string(), 1)
        ]
    );
}

/// One shard holding z0 (key k0), poison and after (k1), b1 (k2), consumed by `w1` with retries
/// in place and a handler that fails every attempt of poison: the stream, its sink, the lease
/// store, `w1`'s calls and `w1`.
async fn poison_waits_in_place() -> (MemoryStream, MemoryStreams, MemoryLeaseStore, Seen, Running) {
    let stream = MemoryStream::new("orders", 1);
    let sink = MemoryStreams::new([stream.clone()]);
    let store = MemoryLeaseStore::new();
    for (key, payload) in [
        ("k0", "z0"),
        ("k1", "poison"),
        ("k1", "after"),
        ("k2", "b1"),
    ] {
        stream.put(key, payload);
    }
    let seen: Seen = Arc::default();
    let running = consumer(
        &stream,
        &sink,
        &store,
        failing_first(&seen, "poison", u32::MAX),
    )
    .retries(RetryMode::InPlace)
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    (stream, sink, store, seen, running)
}

/// The next owner of that shard, `w2`, which acks everything, run until its last record
/// settled: its calls.
async fn next_owner(
    stream: &MemoryStream,
    sink: &MemoryStreams,
    store: &MemoryLeaseStore,
) -> Vec<(String, u32)> {
    let again: Seen = Arc::default();
    let running = consumer(stream, sink, store, failing_first(&again, "", 0))
        .worker_id("w2")
        .retries(RetryMode::InPlace)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    settled_through(stream, store, 3).await;
    running.shutdown(Duration::from_secs(2)).await;
    calls_made(&again)
}

/// A worker killed while a record waits to run again in place loses nothing: the next owner
/// reads it again from the checkpoint (attempts start again at 1: they are not stored).
#[tokio::test(start_paused = true)]
async fn in_place_a_worker_killed_while_a_record_waits_loses_nothing() {
    let (stream, sink, store, seen, running) = poison_waits_in_place().await;
    wait_for("a few attempts", Duration::from_secs(10), || {
        seen.lock()
            .unwrap()
            .iter()
            .filter(|(p, _, _)| p == "poison")
            .count()
            >= 3
    })
    .await;
    running.abort();
    let z0 = stream.records()[0].record.sequence;
    assert_eq!(
        store.snapshot()[0].checkpoint,
        Checkpoint::At(Position::new(z0, 0))
    );
    assert!(!seen.lock().unwrap().iter().any(|(p, _, _)| p == "after"));

    tokio::time::sleep(Duration::from_secs(2)).await; // the lease expires
    let calls = next_owner(&stream, &sink, &store).await;
    assert!(calls.contains(&("poison".to_string(), 1)), "{calls:?}");
    assert!(calls.contains(&("after".to_string(), 1)), "{calls:?}");
    assert!(!calls.iter().any(|(p, _)| p == "z0"), "{calls:?}");
}

/// In place with a receipt ledger and no dead-letter stream, a spent record gets a terminal
/// `quarantined` receipt (with the reason) and settles, as a paged event does.
#[tokio::test(start_paused = true)]
async fn in_place_with_receipts_a_spent_record_is_quarantined_by_receipt() {
    let stream = MemoryStream::new("orders", 1);
    let sink = MemoryStreams::new([stream.clone()]);
    let store = MemoryLeaseStore::new();
    let receipts = MemoryReceipts::new();
    stream.put("k1", "poison");
    stream.put("k1", "after");
    let seen: Seen = Arc::default();
    let running = consumer(
        &stream,
        &sink,
        &store,
        failing_first(&seen, "poison", u32::MAX),
    )
    .retries(RetryMode::InPlace)
    .max_attempts(NonZeroU32::new(2).unwrap())
    .receipts(Arc::new(receipts.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    settled_through(&stream, &store, 1).await;
    running.shutdown(Duration::from_secs(2)).await;
    let calls = calls_made(&seen);
    assert_eq!(
        calls,
        [
            ("poison".to_string(), 1),
            ("poison".to_string(), 2),
            ("after".to_string(), 1)
        ]
    );
    let quarantined: Vec<String> = receipts
        .receipts()
        .into_iter()
        .filter_map(|r| match r.disposition {
            Disposition::Quarantined(reason) => Some(reason),
            _ => None,
        })
        .collect();
    assert_eq!(quarantined.len(), 1, "{quarantined:?}");
    assert!(quarantined[0].contains("attempts spent"), "{quarantined:?}");
}

/// A graceful stop while a record waits to run again in place drains up to its deadline, then
/// stops with the checkpoint behind the waiting record; the next owner runs it again (its
/// attempts start at 1: they are not stored) before the later records of its key.
#[tokio::test(start_paused = true)]
async fn in_place_a_graceful_stop_leaves_a_waiting_record_to_the_next_owner() {
    let (stream, sink, store, seen, running) = poison_waits_in_place().await;
    wait_for("b1 and a few attempts", Duration::from_secs(10), || {
        let calls = calls_made(&seen);
        calls.iter().any(|(p, _)| p == "b1")
            && calls.iter().filter(|(p, _)| p == "poison").count() >= 3
    })
    .await;
    running.shutdown(Duration::from_secs(1)).await;
    let z0 = stream.records()[0].record.sequence;
    assert_eq!(
        store.snapshot()[0].checkpoint,
        Checkpoint::At(Position::new(z0, 0)),
        "the checkpoint stays behind the waiting record"
    );
    assert!(
        store.snapshot()[0].owner.is_none(),
        "the lease is released for the next owner"
    );
    assert!(
        !calls_made(&seen).iter().any(|(p, _)| p == "after"),
        "k1 waited"
    );

    let calls = next_owner(&stream, &sink, &store).await;
    let at = |payload: &str| calls.iter().position(|(p, _)| p == payload);
    assert_eq!(at("z0"), None, "{calls:?}");
    assert!(calls.contains(&("poison".to_string(), 1)), "{calls:?}");
    assert!(at("poison") < at("after"), "{calls:?}");
}

/// A shard handed to a joining worker while a record of it waits to run again in place: its
/// owner drains up to the handoff timeout, then passes the lease (no steal) with the checkpoint
/// behind the waiting record; the next owner runs it again (attempts from 1) before the later
/// records of its key, and nothing of the shard is skipped.
#[tokio::test(start_paused = true)]
async fn in_place_a_shard_handed_off_while_a_record_waits_passes_behind_it() {
    let stream = MemoryStream::new("orders", 2);
    let sink = MemoryStreams::new([stream.clone()]);
    let store = MemoryLeaseStore::new();
    // A poison record and a later record of its key on each shard, whichever shard is passed.
    let mut poisoned = std::collections::BTreeMap::new();
    for i in 0.. {
        if poisoned.len() == 2 {
            break;
        }
        let key = format!("k{i}");
        let (shard, _) = stream.put(&key, format!("fine-{i}"));
        if let std::collections::btree_map::Entry::Vacant(entry) = poisoned.entry(shard) {
            stream.put(&key, format!("poison-{i}"));
            stream.put(&key, format!("after-{i}"));
            entry.insert(i);
        }
    }
    let handoff_timeout = Duration::from_secs(1);
    let start = |id: &'static str, seen: &Seen, poison: bool| {
        let seen = seen.clone();
        consumer(&stream, &sink, &store, move |d: Delivery| {
            let text = String::from_utf8_lossy(d.payload()).to_string();
            let failing = poison && text.starts_with("poison");
            seen.lock()
                .unwrap()
                .push((text, d.attempt(), Instant::now()));
            std::future::ready(if failing {
                Outcome::Retry
            } else {
                Outcome::Ack
            })
        })
        .worker_id(id)
        .lease_settings(
            LeaseSettings::default()
                .lease_duration(Duration::from_millis(1500))
                .scan_interval(Duration::from_millis(100))
                .handoff_timeout(handoff_timeout),
        )
        .retries(RetryMode::InPlace)
        .build()
        .unwrap()
        .run()
    };
    let first: Seen = Arc::default();
    let w1 = start("w1", &first, true).await.unwrap();
    wait_for(
        "both poisons attempted twice",
        Duration::from_secs(10),
        || {
            let calls = calls_made(&first);
            poisoned.values().all(|i| {
                calls
                    .iter()
                    .filter(|(p, _)| *p == format!("poison-{i}"))
                    .count()
                    >= 2
            })
        },
    )
    .await;

    let second: Seen = Arc::default();
    let asked = tokio::time::Instant::now();
    let w2 = start("w2", &second, false).await.unwrap();
    wait_for("w2 to hold a shard", Duration::from_secs(30), || {
        w2.shards().len() == 1
    })
    .await;
    let passed_after = asked.elapsed();
    eprintln!("the shard passed {passed_after:?} after w2 started");
    let shard = w2.shards()[0].shard_id.clone();
    let i = poisoned[&shard];
    let (poison, after) = (format!("poison-{i}"), format!("after-{i}"));
    wait_for(
        "w2 to run the passed shard's records",
        Duration::from_secs(10),
        || calls_made(&second).iter().any(|(p, _)| *p == after),
    )
    .await;
    w2.shutdown(Duration::from_secs(2)).await;
    w1.shutdown(Duration::from_secs(2)).await;

    let calls = calls_made(&second);
    let at = |payload: &str| calls.iter().position(|(p, _)| p == payload);
    assert_eq!(at(&format!("fine-{i}")), None, "settled before: {calls:?}");
    assert_eq!(
        calls[at(&poison).expect("the waiting record runs again")],
        (poison.clone(), 1),
        "attempts start again at 1: {calls:?}"
    );
    assert!(at(&poison) < at(&after), "{calls:?}");
    assert!(
        !calls_made(&first).iter().any(|(p, _)| *p == after),
        "w1 never ran past the waiting record of the key"
    );
    assert!(
        store.snapshot().iter().all(|l| l.wanted_by.is_none()),
        "the request was answered by a pass"
    );
    // The pass waited for the record up to the handoff timeout, not for a lease to expire.
    assert!(
        passed_after >= handoff_timeout && passed_after < Duration::from_secs(5),
        "passed after {passed_after:?}"
    );
}
