//! Batch handlers, handler timeouts and the maximum record age, on the in-memory stream and lease
//! store: the real lanes, tracker and checkpoints.

#[path = "support/wait.rs"]
mod wait;

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use wait::wait_for;

use shardwise::envelope;
use shardwise::lease::{Checkpoint, LeaseSettings, LeaseStore, MemoryLeaseStore};
use shardwise::retry::DEAD_LETTER_REASON_HEADER;
use shardwise::testing::{MemoryStream, MemoryStreams};
use shardwise::{
    Batched, Batching, Consumer, ConsumerBuilder, Delivery, Handler, Outcome, Position, Running,
};

#[path = "support/recorder.rs"]
mod recorder;

fn consumer<H: Handler>(
    stream: &MemoryStream,
    sink: &MemoryStreams,
    store: &MemoryLeaseStore,
    handler: H,
) -> ConsumerBuilder<H> {
    Consumer::builder(stream.name(), "batch-app", handler)
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

fn id_of(d: &Delivery) -> u64 {
    std::str::from_utf8(d.payload()).unwrap().parse().unwrap()
}

/// Every shard's checkpoint is at its last record.
async fn checkpointed_through_the_end(stream: &MemoryStream, store: &MemoryLeaseStore) {
    let mut last: BTreeMap<String, Position> = BTreeMap::new();
    for r in stream.records() {
        last.insert(r.shard_id.clone(), Position::new(r.record.sequence, 0));
    }
    for (shard, position) in last {
        let row = store.get(&stream.name(), &shard).await.unwrap().unwrap();
        assert_eq!(row.checkpoint, Checkpoint::At(position), "{shard}");
    }
}

/// A batch handler gets batches of at most `max_size` deliveries of one lane of one shard, in
/// shard order; every record is handled once, the order per key holds across batches, and the
/// checkpoints end at each shard's last record.
#[tokio::test(start_paused = true)]
async fn batches_hold_one_lanes_deliveries_in_order_up_to_the_size() {
    let stream = MemoryStream::new("orders", 2);
    let sink = MemoryStreams::new([stream.clone()]);
    let store = MemoryLeaseStore::new();
    let (n, keys) = (600u64, 12u64);
    for id in 0..n {
        stream.put(&format!("key-{}", id % keys), id.to_string());
    }
    type Batches = Arc<Mutex<Vec<Vec<(String, usize, String, u64)>>>>;
    let batches: Batches = Arc::default();
    let seen = batches.clone();
    let handler = move |batch: Vec<Delivery>| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push(
                batch
                    .iter()
                    .map(|d| {
                        (
                            d.shard().to_string(),
                            d.lane(),
                            d.partition_key().to_string(),
                            id_of(d),
                        )
                    })
                    .collect(),
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
            vec![Outcome::Ack; batch.len()]
        }
    };
    let running = consumer(
        &stream,
        &sink,
        &store,
        Batched::new(handler, Batching::new(25, Duration::from_millis(20))),
    )
    .lanes(3)
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    let count = || batches.lock().unwrap().iter().map(Vec::len).sum::<usize>() as u64;
    wait_for("every record", Duration::from_secs(20), || count() >= n).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    running.shutdown(Duration::from_secs(2)).await;

    let batches = batches.lock().unwrap().clone();
    assert_eq!(count(), n, "each record once");
    assert!(batches.iter().all(|b| (1..=25).contains(&b.len())));
    assert!(
        batches.iter().any(|b| b.len() > 1),
        "records were batched: {:?}",
        batches.iter().map(Vec::len).collect::<Vec<_>>()
    );
    for b in &batches {
        assert!(
            b.iter().all(|d| d.0 == b[0].0 && d.1 == b[0].1),
            "one lane of one shard"
        );
    }
    let mut last: BTreeMap<String, u64> = BTreeMap::new();
    for (_, _, key, id) in batches.iter().flatten() {
        if let Some(prev) = last.insert(key.clone(), *id) {
            assert!(prev < *id, "{key}: {id} after {prev}");
        }
    }
    checkpointed_through_the_end(&stream, &store).await;
}

/// As Lambda's batch item failures: the outcomes say which deliveries of a batch to retry, and a
/// batch answered with fewer outcomes than deliveries retries the ones left out. Retried records
/// come back as counted copies (attempt 2) and the checkpoint still reaches the end.
#[tokio::test(start_paused = true)]
async fn a_batch_answer_retries_what_it_says_and_what_it_leaves_out() {
    let stream = MemoryStream::new("orders", 1);
    let sink = MemoryStreams::new([stream.clone()]);
    let store = MemoryLeaseStore::new();
    for id in 0..40u64 {
        stream.put(&format!("key-{}", id % 4), id.to_string());
    }
    let attempts: Arc<Mutex<BTreeMap<u64, Vec<u32>>>> = Arc::default();
    let seen = attempts.clone();
    let handler = move |batch: Vec<Delivery>| {
        let seen = seen.clone();
        async move {
            for d in &batch {
                seen.lock()
                    .unwrap()
                    .entry(id_of(d))
                    .or_default()
                    .push(d.attempt());
            }
            let mut outcomes = Vec::new();
            for d in &batch {
                let id = id_of(d);
                // First attempts: multiples of 10 fail; the answer stops at id 35 (35..39 are left
                // without an outcome).
                if d.attempt() == 1 && id >= 35 {
                    break;
                }
                outcomes.push(if d.attempt() == 1 && id.is_multiple_of(10) {
                    Outcome::Retry
                } else {
                    Outcome::Ack
                });
            }
            outcomes
        }
    };
    let running = consumer(
        &stream,
        &sink,
        &store,
        Batched::new(handler, Batching::new(50, Duration::from_millis(50))),
    )
    .retries(shardwise::consumer::RetryMode::Copy)
    .max_attempts(NonZeroU32::new(3).unwrap())
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    let retried: Vec<u64> = [0, 10, 20, 30, 35, 36, 37, 38, 39].to_vec();
    wait_for("the retries", Duration::from_secs(20), || {
        let seen = attempts.lock().unwrap();
        retried
            .iter()
            .all(|id| seen.get(id).is_some_and(|a| a.len() == 2))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    running.shutdown(Duration::from_secs(2)).await;
    let attempts = attempts.lock().unwrap().clone();
    for id in 0..40u64 {
        let expected: &[u32] = if retried.contains(&id) { &[1, 2] } else { &[1] };
        assert_eq!(attempts[&id], expected, "id {id}");
    }
    checkpointed_through_the_end(&stream, &store).await;
}

/// Runs `builder` with a 500 ms handler timeout and three attempts, retried as copies.
async fn with_timeout<H: Handler>(builder: ConsumerBuilder<H>) -> Running {
    builder
        .retries(shardwise::consumer::RetryMode::Copy)
        .handler_timeout(Duration::from_millis(500))
        .max_attempts(NonZeroU32::new(3).unwrap())
        .build()
        .unwrap()
        .run()
        .await
        .unwrap()
}

/// A handler that runs past `handler_timeout` is dropped and its delivery takes the retry path
/// (a counted copy); per batch, the whole batch does. The timeouts are counted.
#[tokio::test(flavor = "current_thread")]
async fn a_handler_past_its_timeout_is_retried_one_delivery_or_one_batch_at_a_time() {
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    for batched in [false, true] {
        let stream = MemoryStream::new("orders", 1);
        let sink = MemoryStreams::new([stream.clone()]);
        let store = MemoryLeaseStore::new();
        for id in 0..6u64 {
            stream.put("one-key", id.to_string());
        }
        let attempts: Arc<Mutex<Vec<(u64, u32)>>> = Arc::default();
        let seen = attempts.clone();
        // Id 3 hangs on its first attempt.
        let slow = move |d: Delivery| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push((id_of(&d), d.attempt()));
                if id_of(&d) == 3 && d.attempt() == 1 {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                }
                Outcome::Ack
            }
        };
        let running: Running = if batched {
            let per_delivery = Arc::new(slow);
            let batch = move |batch: Vec<Delivery>| {
                let handler = per_delivery.clone();
                async move {
                    let mut out = Vec::new();
                    for d in batch {
                        out.push(handler(d).await);
                    }
                    out
                }
            };
            with_timeout(consumer(
                &stream,
                &sink,
                &store,
                Batched::new(batch, Batching::new(10, Duration::from_millis(100))),
            ))
            .await
        } else {
            with_timeout(consumer(&stream, &sink, &store, slow)).await
        };
        wait_for("the retried copies", Duration::from_secs(20), || {
            attempts.lock().unwrap().iter().filter(|a| a.1 == 2).count()
                >= if batched { 6 } else { 1 }
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        running.shutdown(Duration::from_secs(2)).await;
        let attempts = attempts.lock().unwrap().clone();
        let second: Vec<u64> = attempts.iter().filter(|a| a.1 == 2).map(|a| a.0).collect();
        if batched {
            // The batch [0..5] timed out as a whole: ids 0, 1, 2 had been handled but had no
            // outcome yet, 4 and 5 had not been reached; all six come back as copies.
            assert_eq!(second, [0, 1, 2, 3, 4, 5], "{attempts:?}");
        } else {
            assert_eq!(second, [3], "{attempts:?}");
        }
        checkpointed_through_the_end(&stream, &store).await;
    }
    assert_eq!(
        metrics.counter("shardwise_handler_timeouts_total", "orders"),
        Some(1 + 6),
        "one delivery, then one batch of six"
    );
}

/// Records older than `max_record_age` never reach the handler: with a dead-letter stream they
/// are dead-lettered with the reason, without one they are dropped; either way they are counted
/// and the checkpoint passes them. Younger records are handled.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn records_older_than_the_maximum_age_are_dead_lettered_or_dropped_unhandled() {
    let _simulated = shardwise::testing::simulate(
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000),
        7,
    );
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    for dead_letter in [true, false] {
        let stream = MemoryStream::new("orders", 1);
        let dlq = MemoryStream::new("orders-dlq", 1);
        let sink = MemoryStreams::new([stream.clone(), dlq.clone()]);
        let store = MemoryLeaseStore::new();
        for id in 0..5u64 {
            stream.put("k", id.to_string());
        }
        // Two hours later, five more.
        tokio::time::sleep(Duration::from_secs(7200)).await;
        for id in 5..10u64 {
            stream.put("k", id.to_string());
        }
        let handled: Arc<Mutex<Vec<u64>>> = Arc::default();
        let seen = handled.clone();
        let mut builder = consumer(&stream, &sink, &store, move |d: Delivery| {
            seen.lock().unwrap().push(id_of(&d));
            std::future::ready(Outcome::Ack)
        })
        .max_record_age(Duration::from_secs(3600));
        if dead_letter {
            builder = builder.dead_letter("orders-dlq");
        }
        let running = builder.build().unwrap().run().await.unwrap();
        wait_for("the young records", Duration::from_secs(30), || {
            handled.lock().unwrap().len() == 5
        })
        .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        running.shutdown(Duration::from_secs(2)).await;
        assert_eq!(*handled.lock().unwrap(), [5, 6, 7, 8, 9]);
        let letters: Vec<String> = dlq
            .records()
            .iter()
            .map(|r| {
                let letter = envelope::decode(r.record.data.clone());
                assert!(
                    letter
                        .headers
                        .get_str(DEAD_LETTER_REASON_HEADER)
                        .is_some_and(|r| r.contains("record too old")),
                    "{:?}",
                    letter.headers
                );
                String::from_utf8(letter.payload.to_vec()).unwrap()
            })
            .collect();
        if dead_letter {
            assert_eq!(letters, ["0", "1", "2", "3", "4"]);
        } else {
            assert!(letters.is_empty());
        }
        checkpointed_through_the_end(&stream, &store).await;
    }
    assert_eq!(
        metrics.counter("shardwise_records_expired_total", "orders"),
        Some(10),
        "five dead-lettered, then five dropped"
    );
}

/// A batch that fails as a whole (the handler panics on a poison record) is handled again in
/// halves where its batching bisects (Lambda's `BisectBatchOnFunctionError`): a batch of 100
/// finds its one poison record in at most 7 splits; every other record settles once from the
/// half that succeeded, the poison takes the retry way alone (here in place: spent after its
/// second attempt and dropped, as `on_spent` says), and the checkpoint reaches the end.
#[tokio::test(start_paused = true)]
async fn a_failed_batch_is_bisected_down_to_its_poison_record() {
    // A batch fails as a whole by panicking, or by answering no outcome at all (a Lambda
    // function that raised, through `--exec`).
    for answers_nothing in [false, true] {
        let stream = MemoryStream::new("orders", 1);
        let sink = MemoryStreams::new([stream.clone()]);
        let store = MemoryLeaseStore::new();
        let (n, poison) = (100u64, 37u64);
        for id in 0..n {
            stream.put(&format!("key-{}", id % 7), id.to_string());
        }
        // Each call: the ids it got, and whether it answered (false: it panicked).
        type Calls = Arc<Mutex<Vec<(Vec<u64>, bool)>>>;
        let calls: Calls = Arc::default();
        let seen = calls.clone();
        let handler = move |batch: Vec<Delivery>| {
            let seen = seen.clone();
            async move {
                let ids: Vec<u64> = batch.iter().map(id_of).collect();
                let fails = ids.contains(&poison);
                seen.lock().unwrap().push((ids, !fails));
                if fails {
                    if answers_nothing {
                        // No outcome at all: the batch failed as a whole.
                        return Vec::new();
                    }
                    panic!("poison record {poison}");
                }
                vec![Outcome::Ack; batch.len()]
            }
        };
        let batching = Batching::new(100, Duration::from_secs(1)).bisect_on_failure(true);
        let running = consumer(&stream, &sink, &store, Batched::new(handler, batching))
            .retries(shardwise::consumer::RetryMode::InPlace)
            .max_attempts(NonZeroU32::new(2).unwrap())
            .on_spent(shardwise::consumer::OnSpent::Drop)
            .build()
            .unwrap()
            .run()
            .await
            .unwrap();
        let last = stream.records().last().unwrap().record.sequence;
        wait_for("everything settled", Duration::from_secs(30), || {
            store.snapshot()[0].checkpoint == Checkpoint::At(Position::new(last, 0))
        })
        .await;
        running.shutdown(Duration::from_secs(2)).await;
        let calls = calls.lock().unwrap().clone();
        assert_eq!(calls[0].0.len(), 100, "one batch of 100 first: {calls:?}");
        let failed: Vec<usize> = calls
            .iter()
            .filter(|(_, answered)| !answered)
            .map(|(ids, _)| ids.len())
            .collect();
        // The whole batch, each split's failing half down to the poison alone, then its second
        // attempt, alone too.
        assert_eq!(failed.first(), Some(&100));
        let splits = failed.iter().skip(1).take_while(|len| **len > 1).count() + 1;
        assert!(splits <= 7, "{splits} splits: {failed:?}");
        assert_eq!(&failed[failed.len() - 2..], [1, 1], "{failed:?}");
        for id in (0..n).filter(|id| *id != poison) {
            let answered = calls
                .iter()
                .filter(|(ids, answered)| *answered && ids.contains(&id))
                .count();
            assert_eq!(answered, 1, "id {id} settled from one half: {calls:?}");
        }
    }
}
