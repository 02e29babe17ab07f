//! Lambda's event filtering (`ConsumerBuilder::filter`) on the in-memory stream and lease store:
//! the real lanes, tracker and checkpoints. A record no pattern matches settles without reaching
//! the handler, so the checkpoint moves past it; never skipped unsettled.

#[path = "support/recorder.rs"]
mod recorder;
#[path = "support/wait.rs"]
mod wait;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shardwise::filter::FilterCriteria;
use shardwise::lease::{Checkpoint, LeaseSettings, LeaseStore, MemoryLeaseStore};
use shardwise::testing::MemoryStream;
use shardwise::{
    Batched, Batching, Consumer, ConsumerBuilder, Delivery, Handler, Outcome, Position,
};
use wait::wait_for;

/// Orders only: `{"Filters":[{"Pattern":"{\"data\":{\"kind\":[\"order\"]}}"}]}`.
fn orders() -> FilterCriteria {
    FilterCriteria::parse(r#"{"Filters":[{"Pattern":"{\"data\":{\"kind\":[\"order\"]}}"}]}"#)
        .unwrap()
}

/// Puts `n` records over 12 keys: an order, a quote (JSON that does not match) and a line that
/// is not JSON, in turn. Returns the orders' numbers.
fn put(stream: &MemoryStream, n: u64) -> BTreeSet<u64> {
    let mut orders = BTreeSet::new();
    for i in 0..n {
        let data = match i % 3 {
            0 => {
                orders.insert(i);
                format!(r#"{{"kind":"order","n":{i}}}"#)
            }
            1 => format!(r#"{{"kind":"quote","n":{i}}}"#),
            _ => format!("kind=order n={i}"),
        };
        stream.put(&format!("key-{}", i % 12), data);
    }
    orders
}

fn number(d: &Delivery) -> u64 {
    let value: serde_json::Value = serde_json::from_slice(d.payload()).unwrap();
    value["n"].as_u64().unwrap()
}

/// Every shard's checkpoint is at its last record: the filtered ones settled.
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

/// A consumer of `stream` with quick leases and checkpoints.
fn on_stream<H: Handler>(
    stream: &MemoryStream,
    store: &MemoryLeaseStore,
    handler: H,
) -> ConsumerBuilder<H> {
    Consumer::builder(stream.name(), "filter-app", handler)
        .worker_id("w1")
        .poll_interval(Duration::from_millis(200))
        .checkpoint_interval(Duration::from_millis(50))
        .lease_settings(
            LeaseSettings::default()
                .lease_duration(Duration::from_millis(1500))
                .scan_interval(Duration::from_millis(100)),
        )
        .in_memory(stream, store)
}

fn filtered(metrics: &recorder::Metrics, stream: &MemoryStream) -> u64 {
    let shards: BTreeSet<String> = stream.records().into_iter().map(|r| r.shard_id).collect();
    shards
        .iter()
        .filter_map(|shard| metrics.counter("shardwise_records_filtered_total", shard))
        .sum()
}

/// 300 records, a third orders: the handler gets each order once and nothing else; the 200
/// others are counted as filtered and the checkpoints reach every shard's last record.
#[tokio::test(start_paused = true)]
async fn only_records_a_pattern_matches_reach_the_handler_and_the_rest_settle() {
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    let stream = MemoryStream::new("orders", 2);
    let store = MemoryLeaseStore::new();
    let orders_put = put(&stream, 300);
    let seen: Arc<Mutex<Vec<u64>>> = Arc::default();
    let handled = seen.clone();
    let handler = move |d: Delivery| {
        handled.lock().unwrap().push(number(&d));
        async { Outcome::Ack }
    };
    let running = on_stream(&stream, &store, handler)
        .lanes(3)
        .filter(orders())
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("every order", Duration::from_secs(20), || {
        seen.lock().unwrap().len() >= orders_put.len()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.shutdown(Duration::from_secs(2)).await;
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 100, "each order once");
    assert_eq!(seen.iter().copied().collect::<BTreeSet<_>>(), orders_put);
    assert_eq!(filtered(&metrics, &stream), 200);
    checkpointed_through_the_end(&stream, &store).await;
}

/// A batch handler behind the filter gets batches of orders only; an order it answers `Retry`
/// for the first time runs again (in place, the default), and the checkpoints reach the end.
#[tokio::test(start_paused = true)]
async fn a_batch_holds_only_matching_records_and_a_retried_one_runs_again() {
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    let stream = MemoryStream::new("orders", 1);
    let store = MemoryLeaseStore::new();
    let orders_put = put(&stream, 90);
    type Seen = Arc<Mutex<Vec<(u64, u32)>>>;
    let seen: Seen = Arc::default();
    let batches: Arc<Mutex<Vec<usize>>> = Arc::default();
    let (handled, sizes) = (seen.clone(), batches.clone());
    let handler = move |batch: Vec<Delivery>| {
        let (handled, sizes) = (handled.clone(), sizes.clone());
        async move {
            sizes.lock().unwrap().push(batch.len());
            batch
                .iter()
                .map(|d| {
                    let n = number(d);
                    handled.lock().unwrap().push((n, d.attempt()));
                    // Order 30 fails its first attempt.
                    if n == 30 && d.attempt() == 1 {
                        Outcome::Retry
                    } else {
                        Outcome::Ack
                    }
                })
                .collect()
        }
    };
    let batched = Batched::new(handler, Batching::new(10, Duration::from_millis(20)));
    let running = on_stream(&stream, &store, batched)
        .filter(orders())
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("every order, 30 twice", Duration::from_secs(30), || {
        seen.lock().unwrap().len() > orders_put.len()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.shutdown(Duration::from_secs(2)).await;
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.iter().all(|(n, _)| orders_put.contains(n)),
        "only orders reach the handler: {seen:?}"
    );
    assert_eq!(
        seen.iter().map(|(n, _)| *n).collect::<BTreeSet<_>>(),
        orders_put
    );
    assert_eq!(seen.len(), orders_put.len() + 1, "order 30 twice: {seen:?}");
    assert!(seen.contains(&(30, 2)));
    assert!(batches.lock().unwrap().iter().all(|n| (1..=10).contains(n)));
    assert_eq!(filtered(&metrics, &stream), 60);
    checkpointed_through_the_end(&stream, &store).await;
}

/// A paged source behind the filter: its events' payloads are filtered as a record's data is;
/// the filtered events settle, so the partition's applied position reaches its last event.
#[tokio::test(start_paused = true)]
async fn a_paged_sources_events_are_filtered_and_the_applied_position_reaches_the_end() {
    use shardwise::paged::PagePosition;
    use shardwise::testing::EventApi;
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    let api = EventApi::new("events").page_size(7);
    for n in 0..60u64 {
        let payload = if n % 2 == 0 {
            format!(r#"{{"kind":"order","n":{n}}}"#)
        } else {
            format!(r#"{{"kind":"quote","n":{n}}}"#)
        };
        api.push("p", payload);
    }
    let store = MemoryLeaseStore::new();
    let seen: Arc<Mutex<Vec<u64>>> = Arc::default();
    let handled = seen.clone();
    let running = Consumer::paged(Arc::new(api.clone()), "paged-app", move |d: Delivery| {
        handled.lock().unwrap().push(number(&d));
        async { Outcome::Ack }
    })
    .worker_id("w1")
    .poll_interval(Duration::from_millis(200))
    .checkpoint_interval(Duration::from_millis(50))
    .lease_settings(
        LeaseSettings::default()
            .lease_duration(Duration::from_millis(900))
            .scan_interval(Duration::from_millis(50)),
    )
    .lease_store(Arc::new(store.clone()))
    .filter(orders())
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    let applied = || {
        store
            .snapshot()
            .into_iter()
            .find(|r| r.shard_id == "p")
            .and_then(|r| r.progress?.applied_position)
    };
    wait_for("the last event applied", Duration::from_secs(20), || {
        applied() == Some(PagePosition::from_u64(60))
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        (0..60).step_by(2).collect::<Vec<u64>>(),
        "the orders, once, in order"
    );
    assert_eq!(
        metrics.counter("shardwise_records_filtered_total", "p"),
        Some(30)
    );
}
