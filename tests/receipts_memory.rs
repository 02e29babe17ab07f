//! Receipts with the real consumer on the in-memory stream, lease store and ledger: effects applied
//! exactly once across crashes (the handler runs twice, the effect does not), a retry copy
//! recognised by its origin, held events that hold the checkpoint until made terminal or
//! released, crashes and lost answers around every receipt write, and effects that cannot be
//! committed.

#[path = "support/calls.rs"]
mod calls;
#[path = "support/wait.rs"]
mod wait;

use calls::Calls;
use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use wait::wait_for;

use futures::future::BoxFuture;
use shardwise::consumer::Settled;
use shardwise::envelope::{self, Headers, RETRY_COUNT_HEADER};
use shardwise::lease::{Checkpoint, LeaseSettings, MemoryLeaseStore};
use shardwise::receipts::{
    Apply, Committed, Disposition, Effect, Effects, EventId, MemoryReceipts, Receipt, ReceiptStore,
    Recorded, key,
};
use shardwise::retry::{
    DEAD_LETTER_REASON_HEADER, ORIGIN_SEQUENCE_HEADER, ORIGIN_SHARD_HEADER, ORIGIN_STREAM_HEADER,
};
use shardwise::testing::{Faults, MemoryStream, MemoryStreams};
use shardwise::{Consumer, ConsumerBuilder, Delivery, Error, Outcome, Position};

const COUNTS: &str = "counts";

fn builder<F>(
    stream: &MemoryStream,
    store: &MemoryLeaseStore,
    receipts: Arc<dyn ReceiptStore>,
    worker: &str,
    handler: F,
) -> ConsumerBuilder<F>
where
    F: Fn(Delivery) -> BoxFuture<'static, Outcome> + Send + Sync + 'static,
{
    Consumer::builder(stream.name(), "receipts-app", handler)
        .worker_id(worker)
        .lanes(2)
        .poll_interval(Duration::from_millis(200))
        .checkpoint_interval(Duration::from_millis(300))
        .hold_poll_interval(Duration::from_millis(100))
        .lease_settings(
            LeaseSettings::default()
                .lease_duration(Duration::from_millis(900))
                .scan_interval(Duration::from_millis(50)),
        )
        .in_memory(stream, store)
        .record_sink(Arc::new(stream.clone()))
        .receipts(receipts)
}

/// A handler that counts each record id once into the `counts` table, taking `took` a record.
fn counting(
    worker: &str,
    calls: &Calls,
    took: Duration,
) -> impl Fn(Delivery) -> BoxFuture<'static, Outcome> + Clone + use<> {
    let (worker, calls) = (worker.to_string(), calls.clone());
    move |d: Delivery| {
        calls.push(&worker, &d);
        let id = String::from_utf8_lossy(d.payload()).into_owned();
        Box::pin(async move {
            tokio::time::sleep(took).await;
            Outcome::Apply(Effect::update(COUNTS, key("id", id)).add("count", 1).into())
        })
    }
}

fn counts(
    receipts: &MemoryReceipts,
    ids: impl IntoIterator<Item = u64>,
) -> BTreeMap<u64, Option<i64>> {
    ids.into_iter()
        .map(|id| {
            (
                id,
                receipts.number(COUNTS, &key("id", id.to_string()), "count"),
            )
        })
        .collect()
}

fn assert_each_counted_once(receipts: &MemoryReceipts, n: u64) {
    let wrong: Vec<_> = counts(receipts, 0..n)
        .into_iter()
        .filter(|(_, c)| *c != Some(1))
        .collect();
    assert!(wrong.is_empty(), "counters not exactly 1: {wrong:?}");
}

#[tokio::test(start_paused = true)]
async fn effects_are_applied_once_across_a_crash_while_the_handler_runs_twice() {
    let stream = MemoryStream::new("orders", 2);
    let store = MemoryLeaseStore::new();
    let receipts = MemoryReceipts::new().table(COUNTS, &["id"]);
    let n = 300u64;
    for id in 0..n {
        stream.put(&format!("key-{}", id % 7), id.to_string());
    }
    let calls = Calls::default();
    let first = builder(
        &stream,
        &store,
        Arc::new(receipts.clone()),
        "w1",
        counting("w1", &calls, Duration::from_millis(3)),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("half the records applied", Duration::from_secs(20), || {
        receipts.receipts().len() >= n as usize / 2
    })
    .await;
    first.abort(); // kill -9: applied, not all checkpointed
    let second = builder(
        &stream,
        &store,
        Arc::new(receipts.clone()),
        "w2",
        counting("w2", &calls, Duration::ZERO),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("every record applied", Duration::from_secs(20), || {
        receipts.receipts().len() == n as usize
    })
    .await;
    wait_for(
        "the checkpoints at the end",
        Duration::from_secs(10),
        || {
            store.snapshot().iter().all(|r| {
                stream
                    .records()
                    .iter()
                    .filter(|s| s.shard_id == r.shard_id)
                    .last()
                    .is_none_or(|last| {
                        r.checkpoint == Checkpoint::At(Position::new(last.record.sequence, 0))
                    })
            })
        },
    )
    .await;
    second.shutdown(Duration::from_secs(2)).await;
    assert!(
        calls.len() > n as usize,
        "records handled again after the crash: {} calls for {n}",
        calls.len()
    );
    assert_each_counted_once(&receipts, n);
    assert_eq!(receipts.writes(), n, "one effect write per record, no more");
}

#[tokio::test(start_paused = true)]
async fn a_retry_copy_of_an_applied_event_is_a_replay_by_its_origin() {
    let stream = MemoryStream::new("orders", 1);
    let store = MemoryLeaseStore::new();
    let receipts = MemoryReceipts::new().table(COUNTS, &["id"]);
    let (shard, sequence) = stream.put("k", "7");
    let settled: Arc<Mutex<Vec<(EventId, Settled)>>> = Arc::default();
    let s = settled.clone();
    let calls = Calls::default();
    let running = builder(
        &stream,
        &store,
        Arc::new(receipts.clone()),
        "w1",
        counting("w1", &calls, Duration::ZERO),
    )
    .delivery_hooks(move |d: &Delivery, how: &Settled| {
        s.lock().unwrap().push((d.event_id(), how.clone()))
    })
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("the original applied", Duration::from_secs(10), || {
        settled.lock().unwrap().len() == 1
    })
    .await;
    // A copy of it (as a retry of attempt 1 would write, or another consumer's copy).
    let mut headers = Headers::new();
    headers.insert(RETRY_COUNT_HEADER, "1");
    headers.insert(ORIGIN_STREAM_HEADER, "orders");
    headers.insert(ORIGIN_SHARD_HEADER, shard.clone());
    headers.insert(ORIGIN_SEQUENCE_HEADER, sequence.to_string());
    stream.put("k", envelope::encode(&headers, b"7"));
    wait_for("the copy settled", Duration::from_secs(10), || {
        settled.lock().unwrap().len() == 2
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    let settled = settled.lock().unwrap().clone();
    let original = EventId::kinesis("orders", &shard, &Position::new(sequence, 0));
    assert_eq!(settled[0], (original.clone(), Settled::Applied));
    assert_eq!(
        settled[1],
        (original, Settled::Replayed),
        "the copy has the original's identity"
    );
    assert_eq!(calls.count("7"), 2, "the handler ran for both");
    assert_eq!(counts(&receipts, [7]), BTreeMap::from([(7, Some(1))]));
}

/// A handler that holds the record `held` the first time it sees it, and acks everything else.
fn holding(
    held: &'static str,
    calls: &Calls,
) -> impl Fn(Delivery) -> BoxFuture<'static, Outcome> + Clone + use<> {
    let calls = calls.clone();
    move |d: Delivery| {
        let first = calls.count(held) == 0;
        calls.push("w1", &d);
        let hold = d.payload().as_ref() == held.as_bytes() && first;
        Box::pin(async move {
            if hold {
                Outcome::Hold("operator review".into())
            } else {
                Outcome::Ack
            }
        })
    }
}

fn checkpoint(store: &MemoryLeaseStore) -> Checkpoint {
    store.snapshot()[0].checkpoint.clone()
}

#[tokio::test(start_paused = true)]
async fn a_held_event_holds_the_checkpoint_until_it_is_made_terminal() {
    let stream = MemoryStream::new("orders", 1);
    let store = MemoryLeaseStore::new();
    let receipts = MemoryReceipts::new();
    let (shard, held_at) = stream.put("k1", "held");
    stream.put("k2", "a");
    let (_, last) = stream.put("k3", "b");
    let calls = Calls::default();
    let running = builder(
        &stream,
        &store,
        Arc::new(receipts.clone()),
        "w1",
        holding("held", &calls),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    let held = EventId::kinesis("orders", &shard, &Position::new(held_at, 0));
    wait_for("the hold recorded", Duration::from_secs(10), || {
        receipts.receipts().iter().any(|r| r.event == held)
    })
    .await;
    wait_for("the others handled", Duration::from_secs(10), || {
        calls.len() == 3
    })
    .await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        checkpoint(&store),
        Checkpoint::TrimHorizon,
        "the held record holds the checkpoint"
    );
    // An operator settles it for good.
    assert_eq!(
        receipts
            .record(
                &held,
                &Disposition::Quarantined("not ours".into()),
                "operator"
            )
            .await
            .unwrap(),
        Recorded::Recorded
    );
    wait_for("the checkpoint past it", Duration::from_secs(10), || {
        checkpoint(&store) == Checkpoint::At(Position::new(last, 0))
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    assert_eq!(
        calls.count("held"),
        1,
        "a terminal receipt settles it without handling it again"
    );
}

#[tokio::test(start_paused = true)]
async fn a_released_hold_is_handled_again() {
    let stream = MemoryStream::new("orders", 1);
    let store = MemoryLeaseStore::new();
    let receipts = MemoryReceipts::new();
    let (shard, held_at) = stream.put("k1", "held");
    let (_, last) = stream.put("k2", "a");
    let calls = Calls::default();
    let running = builder(
        &stream,
        &store,
        Arc::new(receipts.clone()),
        "w1",
        holding("held", &calls),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    let held = EventId::kinesis("orders", &shard, &Position::new(held_at, 0));
    wait_for("the hold recorded", Duration::from_secs(10), || {
        !receipts.receipts().is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(checkpoint(&store), Checkpoint::TrimHorizon);
    assert!(
        receipts.release(&held).await.unwrap(),
        "an operator releases it"
    );
    wait_for("handled again and past", Duration::from_secs(10), || {
        checkpoint(&store) == Checkpoint::At(Position::new(last, 0))
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    assert_eq!(
        calls.count("held"),
        2,
        "released: handled a second time (acked then)"
    );
    assert_eq!(
        receipts.receipts(),
        Vec::<Receipt>::new(),
        "an ack writes no receipt"
    );
}

/// A hold released after its shard was split (read to its end, reading no more): the record is
/// handled again, the parent then ends and its children are read. (Found by the simulation, seed
/// 94: the redelivery went to lanes closed at the shard's end and the shard task panicked.)
#[tokio::test(start_paused = true)]
async fn a_hold_released_after_the_shard_was_read_to_its_end_is_handled_and_the_shard_ends() {
    let stream = MemoryStream::new("orders", 1);
    let store = MemoryLeaseStore::new();
    let receipts = MemoryReceipts::new();
    let (shard, held_at) = stream.put("k1", "held");
    stream.put("k2", "a");
    let calls = Calls::default();
    let running = builder(
        &stream,
        &store,
        Arc::new(receipts.clone()),
        "w1",
        holding("held", &calls),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    let held = EventId::kinesis("orders", &shard, &Position::new(held_at, 0));
    wait_for("the hold recorded", Duration::from_secs(10), || {
        !receipts.receipts().is_empty() && calls.len() == 2
    })
    .await;
    let (left, right) = stream.split(&shard);
    // Each child gets a record only once the parent is split.
    stream.put("k3", "after the split");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        checkpoint(&store),
        Checkpoint::TrimHorizon,
        "the held record holds the parent's end"
    );
    assert!(receipts.release(&held).await.unwrap(), "released");
    wait_for(
        "the parent ended and a child read",
        Duration::from_secs(10),
        || calls.count("after the split") == 1,
    )
    .await;
    let rows = store.snapshot();
    let parent = rows
        .iter()
        .find(|r| r.shard_id == shard)
        .expect("the parent's row");
    assert_eq!(parent.checkpoint, Checkpoint::ShardEnd);
    assert!(
        rows.iter()
            .any(|r| r.shard_id == left || r.shard_id == right)
    );
    running.shutdown(Duration::from_secs(2)).await;
    assert_eq!(calls.count("held"), 2, "released: handled a second time");
}

/// A ledger whose commits can be held back (a crash before the receipt write).
#[derive(Debug, Clone)]
struct Gated {
    inner: MemoryReceipts,
    open: Arc<tokio::sync::Semaphore>,
}

impl ReceiptStore for Gated {
    fn prepare(&self) -> BoxFuture<'_, Result<(), Error>> {
        self.inner.prepare()
    }
    fn get<'a>(&'a self, e: &'a EventId) -> BoxFuture<'a, Result<Option<Receipt>, Error>> {
        self.inner.get(e)
    }
    fn record<'a>(
        &'a self,
        e: &'a EventId,
        d: &'a Disposition,
        by: &'a str,
    ) -> BoxFuture<'a, Result<Recorded, Error>> {
        self.inner.record(e, d, by)
    }
    fn release<'a>(&'a self, e: &'a EventId) -> BoxFuture<'a, Result<bool, Error>> {
        self.inner.release(e)
    }
    fn commit<'a>(
        &'a self,
        applies: &'a [Apply],
        by: &'a str,
    ) -> BoxFuture<'a, Result<Vec<Committed>, Error>> {
        Box::pin(async move {
            let _permit = self.open.acquire().await.expect("open");
            self.inner.commit(applies, by).await
        })
    }
    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Receipt>, Error>> {
        self.inner.list(limit)
    }
}

#[tokio::test(start_paused = true)]
async fn crashes_before_and_after_the_receipt_write_lose_nothing_and_apply_nothing_twice() {
    let stream = MemoryStream::new("orders", 1);
    let store = MemoryLeaseStore::new();
    let receipts = MemoryReceipts::new().table(COUNTS, &["id"]);
    let n = 40u64;
    for id in 0..n {
        stream.put(&format!("key-{}", id % 3), id.to_string());
    }
    let calls = Calls::default();

    // 1. Before the receipt write: handled, commit held back, crash.
    let gate = Gated {
        inner: receipts.clone(),
        open: Arc::new(tokio::sync::Semaphore::new(0)),
    };
    let w1 = builder(
        &stream,
        &store,
        Arc::new(gate.clone()),
        "w1",
        counting("w1", &calls, Duration::ZERO),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    // Retried in place (the default), a delivery answered with effects parks its key until
    // they commit: each of the three keys' first record is handled, and nothing more.
    wait_for("handled, not committed", Duration::from_secs(10), || {
        calls.len() >= 3
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(calls.len(), 3, "the keys wait for their commits");
    w1.abort();
    assert!(receipts.receipts().is_empty(), "nothing was durable");

    // 2. After the receipt write, its answer lost (the write happened, the worker saw an error),
    //    then a crash before any checkpoint: the next owner replays them.
    receipts.inject(3, Faults::default().lost_answer(0.5).error(0.1));
    let w2 = builder(
        &stream,
        &store,
        Arc::new(receipts.clone()),
        "w2",
        counting("w2", &calls, Duration::ZERO),
    )
    .checkpoint_interval(Duration::from_millis(800))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    // Simulated time: in place, each key's commits go one at a time, and half their answers are
    // lost, each loss backing off before the delivery runs again.
    wait_for("some applied", Duration::from_secs(120), || {
        receipts.receipts().len() >= n as usize / 2
    })
    .await;
    w2.abort();
    receipts.heal();

    // 3. A clean owner finishes.
    let w3 = builder(
        &stream,
        &store,
        Arc::new(receipts.clone()),
        "w3",
        counting("w3", &calls, Duration::ZERO),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("everything applied", Duration::from_secs(20), || {
        receipts.receipts().len() == n as usize
    })
    .await;
    let (_, last) = (0, stream.records().last().unwrap().record.sequence);
    wait_for("the checkpoint at the end", Duration::from_secs(10), || {
        checkpoint(&store) == Checkpoint::At(Position::new(last, 0))
    })
    .await;
    w3.shutdown(Duration::from_secs(2)).await;
    assert_each_counted_once(&receipts, n);
    assert!(
        calls.len() > n as usize,
        "handled more than once: {}",
        calls.len()
    );
}

#[tokio::test(start_paused = true)]
async fn effects_that_can_never_commit_are_dead_lettered_with_the_reason_and_nothing_is_written() {
    let stream = MemoryStream::new("orders", 1);
    let dlq = MemoryStream::new("orders-dlq", 1);
    let store = MemoryLeaseStore::new();
    let receipts = MemoryReceipts::new().table(COUNTS, &["id"]);
    stream.put("k", "too-many");
    stream.put("k", "no-table");
    let (_, last) = stream.put("k", "fine");
    let handler = |d: Delivery| -> BoxFuture<'static, Outcome> {
        let effects: Effects = match d.payload().as_ref() {
            b"too-many" => (0..100)
                .map(|i| Effect::update(COUNTS, key("id", format!("x{i}"))).add("count", 1))
                .collect(),
            b"no-table" => Effect::update("missing-table", key("id", "y"))
                .add("count", 1)
                .into(),
            _ => Effect::update(COUNTS, key("id", "fine"))
                .add("count", 1)
                .into(),
        };
        Box::pin(async move { Outcome::Apply(effects) })
    };
    let running = builder(&stream, &store, Arc::new(receipts.clone()), "w1", handler)
        .max_attempts(NonZeroU32::new(3).unwrap())
        .dead_letter("orders-dlq")
        .record_sink(Arc::new(MemoryStreams::new([stream.clone(), dlq.clone()])))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for(
        "two dead letters and the checkpoint past them",
        Duration::from_secs(10),
        || dlq.records().len() == 2 && checkpoint(&store) == Checkpoint::At(Position::new(last, 0)),
    )
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    let reasons: Vec<String> = dlq
        .records()
        .iter()
        .map(|r| {
            envelope::decode(r.record.data.clone())
                .headers
                .get_str(DEAD_LETTER_REASON_HEADER)
                .unwrap()
                .to_string()
        })
        .collect();
    assert!(reasons[0].contains("at most 100"), "{}", reasons[0]);
    assert!(
        reasons[1].contains("missing-table") && reasons[1].contains("does not exist"),
        "{}",
        reasons[1]
    );
    assert_eq!(
        receipts.number(COUNTS, &key("id", "x0"), "count"),
        None,
        "nothing written"
    );
    assert_eq!(
        receipts.number(COUNTS, &key("id", "fine"), "count"),
        Some(1)
    );
    assert_eq!(
        stream.records().len(),
        3,
        "no retry copies for effects that can never commit"
    );
}

#[tokio::test(start_paused = true)]
async fn receipt_outcomes_without_a_ledger_hold_the_checkpoint() {
    let stream = MemoryStream::new("orders", 1);
    let store = MemoryLeaseStore::new();
    stream.put("k", "1");
    let calls = Calls::default();
    let c = calls.clone();
    let running = Consumer::builder(stream.name(), "no-ledger", move |d: Delivery| {
        c.push("w", &d);
        async { Outcome::Apply(Effects::new()) }
    })
    .worker_id("w")
    .checkpoint_interval(Duration::from_millis(50))
    .lease_settings(
        LeaseSettings::default()
            .lease_duration(Duration::from_millis(900))
            .scan_interval(Duration::from_millis(50)),
    )
    .in_memory(&stream, &store)
    .record_sink(Arc::new(stream.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("handled", Duration::from_secs(5), || calls.len() == 1).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        checkpoint(&store),
        Checkpoint::TrimHorizon,
        "not settled without a ledger"
    );
    running.shutdown(Duration::from_secs(1)).await;
}

/// The memory ledger deletes an applied receipt as DynamoDB's TTL does: never before it expires,
/// and within 48 hours after, each at its own time; held receipts stay. A commit after the
/// deletion applies again: what a replay after an outage longer than the retention would do.
/// `expiresAt` is written from the committing host's clock, as `DynamoDbReceipts` writes it, and
/// TTL deletes by the service's: receipts written on a host 10 hours behind expire 10 hours early,
/// so all are gone 48 hours after that (39 hours after the commit for receipts kept an hour);
/// stamped by the service's clock, about a fifth would still be there.
#[tokio::test(start_paused = true)]
async fn a_receipt_expires_by_the_clock_of_the_host_that_wrote_it() {
    use shardwise::receipts::TTL_DELETION_DELAY;
    use shardwise::testing::{HostClock, on_host};
    let _simulated = shardwise::testing::simulate(
        std::time::UNIX_EPOCH + Duration::from_secs(1_000 * 86_400),
        11,
    );
    let hour = Duration::from_secs(3600);
    let receipts = MemoryReceipts::new()
        .table(COUNTS, &["id"])
        .retention(hour, 11);
    let all: Vec<Apply> = (0..200)
        .map(|id: u64| Apply {
            event: EventId::new(format!("e{id}")),
            effects: Effect::update(COUNTS, key("id", id.to_string()))
                .add("count", 1)
                .into(),
        })
        .collect();
    let behind = HostClock::new(-10 * 3_600_000, 0);
    let committed = on_host(behind, receipts.commit(&all, "w1")).await.unwrap();
    assert!(committed.iter().all(|c| *c == Committed::Applied));
    tokio::time::sleep(TTL_DELETION_DELAY + hour - 10 * hour + Duration::from_secs(1)).await;
    assert_eq!(
        receipts.expired(),
        200,
        "deleted by 48 hours after their host's expiresAt"
    );
}

#[tokio::test(start_paused = true)]
async fn the_memory_ledger_deletes_expired_receipts_within_48_hours_as_ttl_does() {
    use shardwise::receipts::TTL_DELETION_DELAY;
    let _simulated = shardwise::testing::simulate(std::time::UNIX_EPOCH, 7);
    let hour = Duration::from_secs(3600);
    let receipts = MemoryReceipts::new()
        .table(COUNTS, &["id"])
        .retention(hour, 7);
    assert_eq!(ReceiptStore::retention(&receipts), Some(hour));
    let apply = |id: u64| Apply {
        event: EventId::new(format!("e{id}")),
        effects: Effect::update(COUNTS, key("id", id.to_string()))
            .add("count", 1)
            .into(),
    };
    let all: Vec<Apply> = (0..100).map(apply).collect();
    assert!(
        receipts
            .commit(&all, "w1")
            .await
            .unwrap()
            .iter()
            .all(|c| *c == Committed::Applied)
    );
    let held = EventId::new("held");
    receipts
        .record(&held, &Disposition::Held("review".into()), "w1")
        .await
        .unwrap();

    // Expired, not yet deleted: every replay still finds its receipt.
    tokio::time::sleep(hour + Duration::from_secs(1)).await;
    assert!(
        receipts
            .commit(&all, "w2")
            .await
            .unwrap()
            .iter()
            .all(|c| *c == Committed::Replay)
    );
    // A day later some are gone and some not; 48 hours later all are.
    tokio::time::sleep(TTL_DELETION_DELAY / 2).await;
    let gone = receipts.expired();
    assert!(gone > 10 && gone < 90, "{gone} of 100 deleted halfway");
    tokio::time::sleep(TTL_DELETION_DELAY / 2).await;
    assert_eq!(
        receipts.get(&held).await.unwrap().map(|r| r.disposition),
        Some(Disposition::Held("review".into()))
    );
    assert_eq!(receipts.expired(), 100);
    assert_eq!(
        receipts.commit(&all[..1], "w3").await.unwrap(),
        vec![Committed::Applied],
        "with its receipt gone, the event applies again"
    );
    assert_eq!(receipts.number(COUNTS, &key("id", "0"), "count"), Some(2));
}

/// A consumer refuses a ledger kept shorter than the stream keeps records (an in-memory stream
/// with the service's limits keeps them for its retention; without, for good), and runs on one
/// kept as long.
#[tokio::test(start_paused = true)]
async fn a_ledger_kept_shorter_than_the_stream_keeps_records_is_refused() {
    let day = Duration::from_secs(24 * 3600);
    let calls = Calls::default();
    let start = |stream: &MemoryStream, kept: Duration| {
        let receipts = MemoryReceipts::new()
            .table(COUNTS, &["id"])
            .retention(kept, 1);
        builder(
            stream,
            &MemoryLeaseStore::new(),
            Arc::new(receipts),
            "w1",
            counting("w1", &calls, Duration::ZERO),
        )
        .build()
        .unwrap()
        .run()
    };
    let forever = MemoryStream::new("kept-forever", 1);
    match start(&forever, 30 * day).await {
        Ok(_) => panic!("ran on a stream that keeps records for good"),
        Err(e) => assert!(e.to_string().contains("keeps events for good"), "{e}"),
    }
    let stream = MemoryStream::new("kept-a-day", 1);
    stream.service_limits(day);
    match start(&stream, day / 2).await {
        Ok(_) => panic!("ran with receipts kept half as long as the records"),
        Err(e) => assert!(e.to_string().contains("receipt_retention"), "{e}"),
    }
    start(&stream, day)
        .await
        .expect("kept as long")
        .shutdown(Duration::from_secs(1))
        .await;
}
