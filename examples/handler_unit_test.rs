//! Testing a handler without AWS, with the `testing` feature: first the handler alone, on
//! deliveries built by hand; then the real consumer (dispatcher, lanes, tracker, lease manager,
//! fenced checkpoints) on an in-memory stream and lease store. It asserts as it goes and exits 0.
//!
//! ```sh
//! cargo run --example handler_unit_test --features testing
//! ```
//!
//! In your own crate, enable the feature for tests only
//! (`[dev-dependencies] shardwise = { version = "...", features = ["testing"] }`) and put the same
//! code in `#[tokio::test]` functions. No emulators are needed.
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shardwise::lease::{Checkpoint, LeaseSettings, MemoryLeaseStore};
use shardwise::testing::MemoryStream;
use shardwise::{Consumer, Delivery, Handler, Outcome, Position, SequenceNumber};

/// The handler under test: records the ids of `{"id":N}` payloads, drops anything else (a poison
/// record must not hold the checkpoint), and retries `flaky` records once.
#[derive(Debug, Clone, Default)]
struct Orders {
    handled: Arc<Mutex<Vec<u64>>>,
}

impl Orders {
    fn handled(&self) -> Vec<u64> {
        self.handled.lock().unwrap().clone()
    }
}

impl Handler for Orders {
    async fn handle(&self, d: Delivery) -> Outcome {
        let Some(id) = std::str::from_utf8(d.payload())
            .ok()
            .and_then(|s| s.strip_prefix("{\"id\":")?.strip_suffix('}')?.parse().ok())
        else {
            return Outcome::Drop;
        };
        if d.partition_key() == "flaky" && d.attempt() == 1 {
            return Outcome::Retry; // runs again in place, after a back-off
        }
        self.handled.lock().unwrap().push(id);
        Outcome::Ack
    }
}

fn delivery(key: &str, payload: &'static str) -> shardwise::DeliveryBuilder {
    let position = Position::new(SequenceNumber::parse("1").unwrap(), 0);
    Delivery::builder("orders", "shardId-000000000000", position)
        .partition_key(key)
        .payload(payload)
}

/// The handler alone: build deliveries, call it, check the outcome.
async fn unit_tests() {
    let h = Orders::default();
    assert_eq!(
        h.handle(delivery("k", "{\"id\":7}").build()).await,
        Outcome::Ack
    );
    assert_eq!(
        h.handle(delivery("k", "not json").build()).await,
        Outcome::Drop
    );
    assert_eq!(h.handle(delivery("k", "").build()).await, Outcome::Drop);
    let flaky = delivery("flaky", "{\"id\":8}");
    assert_eq!(h.handle(flaky.build()).await, Outcome::Retry);
    // Its next attempt (in place, or a counted copy with `RetryMode::Copy`) is attempt 2.
    let again = delivery("flaky", "{\"id\":8}").attempt(2).build();
    assert_eq!(again.attempt(), 2);
    assert_eq!(h.handle(again).await, Outcome::Ack);
    assert_eq!(h.handled(), [7, 8]);
    println!("unit tests: ok");
}

/// The real consumer on the in-memory backends.
async fn consumer_test() {
    const RECORDS: u64 = 1000;
    let stream = MemoryStream::new("orders", 4);
    for id in 0..RECORDS {
        let key = if id % 100 == 0 {
            "flaky".to_string()
        } else {
            format!("key-{}", id % 16)
        };
        stream.put(&key, format!("{{\"id\":{id}}}"));
    }
    stream.put("key-1", "garbage"); // dropped, and the checkpoint still passes it
    let store = MemoryLeaseStore::new();
    let handler = Orders::default();

    let running = Consumer::builder(stream.name(), "orders-app", handler.clone())
        .worker_id("test-worker")
        .lanes(4)
        // Retries run again in place (the default): nothing is written to the stream.
        .in_memory(&stream, &store)
        // Fast timings: a test should not wait seconds for a lease scan or a checkpoint.
        .lease_settings(LeaseSettings::default().scan_interval(Duration::from_millis(100)))
        .poll_interval(Duration::from_millis(200))
        .checkpoint_interval(Duration::from_millis(50))
        .build()
        .expect("valid settings")
        .run()
        .await
        .expect("starts");

    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while (handler.handled().len() as u64) < RECORDS {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out: {} handled",
            handler.handled().len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Handled does not mean checkpointed yet: shutdown writes the final checkpoints.
    let report = running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(report.leases_released, 4);
    assert!(!report.deadline_passed);

    let handled = handler.handled();
    let distinct: BTreeSet<u64> = handled.iter().copied().collect();
    assert_eq!(distinct, (0..RECORDS).collect(), "every record handled");
    assert_eq!(handled.len() as u64, RECORDS, "each acknowledged once");

    // Every shard's checkpoint is its last record (the retried and the dropped ones included).
    let mut last: HashMap<String, SequenceNumber> = HashMap::new();
    for r in stream.records() {
        last.insert(r.shard_id, r.record.sequence);
    }
    for lease in store.snapshot() {
        let want = Checkpoint::At(Position::new(last[&lease.shard_id], 0));
        assert_eq!(lease.checkpoint, want, "checkpoint of {}", lease.shard_id);
        assert_eq!(lease.owner, None, "released");
    }
    assert_eq!(
        stream.records().len() as u64,
        RECORDS + 1,
        "retried in place: no copies written"
    );
    println!(
        "consumer test: ok ({RECORDS} records, the flaky ones retried in place, 1 dropped, 4 shards checkpointed to the end)"
    );
}

#[tokio::main]
async fn main() {
    unit_tests().await;
    consumer_test().await;
}
