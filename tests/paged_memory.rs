//! Paged sources with the real consumer on the scripted event API and the memory lease store:
//! every event handled, the page barrier (seed 003's walkthroughs, executed with their numbers),
//! crashes at each point of a page's life, overlapping, replayed, empty and stuck pages, lost
//! answers, order violations that stop a partition, retries in place, and seeks.

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
use shardwise::lease::{Checkpoint, Lease, LeaseSettings, LeaseStore, MemoryLeaseStore, NewLease};
use shardwise::paged::{Contract, Cursor, PagePosition, PagedProgress, PagedSource};
use shardwise::receipts::{
    Disposition, Effect, Effects, EventId, Expect, MemoryReceipts, ReceiptStore, key,
};
use shardwise::testing::{EventApi, Script, ScriptedEvent};
use shardwise::{Consumer, ConsumerBuilder, Delivery, Outcome, Running};

const SOURCE: &str = "events";

type Handler = Arc<dyn Fn(Delivery) -> BoxFuture<'static, Outcome> + Send + Sync>;

fn builder(
    api: &EventApi,
    store: &MemoryLeaseStore,
    worker: &str,
    handler: Handler,
) -> ConsumerBuilder<impl shardwise::Handler> {
    Consumer::paged(Arc::new(api.clone()), "paged-app", move |d: Delivery| {
        handler(d)
    })
    .worker_id(worker)
    .lanes(4)
    .poll_interval(Duration::from_millis(200))
    .checkpoint_interval(Duration::from_millis(50))
    .lease_settings(
        LeaseSettings::default()
            .lease_duration(Duration::from_millis(900))
            .scan_interval(Duration::from_millis(50)),
    )
    .lease_store(Arc::new(store.clone()))
}

/// A handler that records its calls and answers `outcome(delivery)`.
fn handler(
    worker: &str,
    calls: &Calls,
    outcome: impl Fn(&Delivery) -> Outcome + Send + Sync + 'static,
) -> Handler {
    let (worker, calls, outcome) = (worker.to_string(), calls.clone(), Arc::new(outcome));
    Arc::new(move |d: Delivery| {
        calls.push(&worker, &d);
        let answer = outcome(&d);
        Box::pin(async move { answer })
    })
}

fn acks(worker: &str, calls: &Calls) -> Handler {
    handler(worker, calls, |_| Outcome::Ack)
}

fn row(store: &MemoryLeaseStore, partition: &str) -> Lease {
    store
        .snapshot()
        .into_iter()
        .find(|r| r.stream == SOURCE && r.shard_id == partition)
        .expect("a row for the partition")
}

fn progress(store: &MemoryLeaseStore, partition: &str) -> PagedProgress {
    row(store, partition).progress.unwrap_or_default()
}

fn applied(store: &MemoryLeaseStore, partition: &str) -> Option<u64> {
    progress(store, partition)
        .applied_position
        .and_then(|p| p.as_u64())
}

fn p(n: u64) -> PagePosition {
    PagePosition::from_u64(n)
}

fn event(id: &str, position: u64) -> ScriptedEvent {
    ScriptedEvent {
        id: id.into(),
        position,
        payload: id.to_string().into(),
        timestamp: None,
        key: None,
    }
}

/// A source whose partition `p` holds events `p-1`, `p-2`, ... with these keys.
fn keyed(keys: &[&str]) -> EventApi {
    let api = EventApi::new(SOURCE);
    for (n, key) in (1..).zip(keys) {
        api.append(
            "p",
            ScriptedEvent {
                key: Some(key.to_string()),
                ..event(&format!("p-{n}"), n)
            },
        );
    }
    api
}

/// Gives `partition` a row whose durable progress is `progress`, as a crashed earlier owner left it.
async fn start_at(store: &MemoryLeaseStore, partition: &str, progress: &PagedProgress) {
    let new = NewLease {
        stream: SOURCE.into(),
        shard_id: partition.into(),
        checkpoint: Checkpoint::TrimHorizon,
        parents: vec![],
    };
    assert!(store.create(&new).await.unwrap());
    let seen = store.get(SOURCE, partition).await.unwrap().unwrap();
    let mine = store.take(&seen, "setup").await.unwrap().unwrap();
    let held = mine.ownership().unwrap();
    // Barrier writes, one version at a time, up to the version asked for.
    let mut stored = PagedProgress::default();
    for version in 1..=progress.checkpoint_version {
        let to = PagedProgress {
            checkpoint_version: version,
            ..progress.clone()
        };
        let written = store.paged_checkpoint(&held, &stored, &to).await.unwrap();
        assert_eq!(written, shardwise::lease::CheckpointWrite::Written);
        stored = to;
    }
    assert!(store.release(&held).await.unwrap());
}

#[tokio::test(start_paused = true)]
async fn every_event_of_every_partition_is_handled_once_and_the_cursor_follows() {
    let api = EventApi::new(SOURCE).page_size(7);
    for partition in ["a", "b", "c"] {
        for n in 0..100 {
            api.push(partition, format!("{partition}{n}"));
        }
    }
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let running = builder(&api, &store, "w1", acks("w1", &calls))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("every event", Duration::from_secs(20), || {
        calls.all().len() >= 300
    })
    .await;
    // Events added while the traversal runs are read too.
    for partition in ["a", "b", "c"] {
        api.push(partition, "late");
    }
    wait_for("the late ones", Duration::from_secs(20), || {
        calls.all().len() >= 303
    })
    .await;
    wait_for("the barriers", Duration::from_secs(10), || {
        ["a", "b", "c"]
            .iter()
            .all(|p| applied(&store, p) == Some(101))
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    let ids = calls.ids();
    let distinct: std::collections::BTreeSet<_> = ids.iter().collect();
    assert_eq!((ids.len(), distinct.len()), (303, 303), "each once");
    for partition in ["a", "b", "c"] {
        let progress = progress(&store, partition);
        assert_eq!(progress.applied_position, Some(p(101)));
        assert!(progress.resume_cursor.is_some());
        assert!(progress.checkpoint_version >= 1);
        // Order per partition: positions increase (one lane per key would be stricter; keys are
        // the event ids here, so the order is the dispatch order checked by the barrier).
    }
}

/// Seed 003's walkthrough, executed: the durable checkpoint is C7 with applied position 105;
/// fetching C7 returns 104, 106 and 107, then C8. The worker applies 106, records 106, and
/// crashes before 107. The cursor is still C7; the next worker recognises 104 and 106 as complete,
/// applies 107 only, and only then replaces C7 with C8.
#[tokio::test(start_paused = true)]
async fn the_c7_walkthrough_crash_before_107_then_retry() {
    let api = EventApi::new(SOURCE).contract(Contract::default());
    for (id, position) in [("e104", 104), ("e106", 106), ("e107", 107)] {
        api.append("p", event(id, position));
    }
    let c7 = api.cursor("p", 0);
    let store = MemoryLeaseStore::new();
    start_at(
        &store,
        "p",
        &PagedProgress {
            resume_cursor: Some(c7.clone()),
            applied_position: Some(p(105)),
            checkpoint_version: 4,
            closed_through: None,
            receipts_since: None,
        },
    )
    .await;
    let calls = Calls::default();
    // Worker 1 acks 106; 107 never finishes (the crash comes first).
    let w1 = handler("w1", &calls, |d| {
        match d.page_position().unwrap().as_u64() {
            Some(107) => Outcome::Hold("never".into()),
            _ => Outcome::Ack,
        }
    });
    let hang: Handler = Arc::new(move |d: Delivery| {
        let answer = w1(d.clone());
        Box::pin(async move {
            if d.page_position().unwrap().as_u64() == Some(107) {
                std::future::pending::<()>().await;
            }
            answer.await
        })
    });
    let running = builder(&api, &store, "w1", hang)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("106 recorded", Duration::from_secs(10), || {
        applied(&store, "p") == Some(106)
    })
    .await;
    wait_for("107 handed out", Duration::from_secs(10), || {
        calls.of("w1").contains(&"e107".to_string())
    })
    .await;
    running.abort(); // the crash
    let after_crash = progress(&store, "p");
    assert_eq!(
        after_crash.resume_cursor.as_ref(),
        Some(&c7),
        "C8 was never promoted"
    );
    assert_eq!(after_crash.checkpoint_version, 4);
    assert_eq!(calls.of("w1"), ["e106", "e107"], "104 was a replay");

    let w2 = builder(&api, &store, "w2", acks("w2", &calls))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("the barrier", Duration::from_secs(10), || {
        progress(&store, "p").checkpoint_version == 5
    })
    .await;
    w2.shutdown(Duration::from_secs(2)).await;
    assert_eq!(
        calls.of("w2"),
        ["e107"],
        "104 and 106 complete, 107 applied"
    );
    let done = progress(&store, "p");
    assert_eq!(done.applied_position, Some(p(107)));
    assert_ne!(done.resume_cursor.as_ref(), Some(&c7), "C8 replaced C7");
}

/// Seed 003's quarantine boundary, executed: a page holds 210, 211 and 212. 210 and 212 are
/// durable, 211 is only held (a reversible hold, not terminal): the applied position stays at 210
/// and the next cursor stays pending. Once a durable quarantine receipt binds 211 to a final
/// disposition, the prefix extends through 212 and the barrier passes.
#[tokio::test(start_paused = true)]
async fn the_quarantine_boundary_210_211_212() {
    let api = EventApi::new(SOURCE).contract(Contract::default());
    for position in [210, 211, 212] {
        api.append("p", event(&format!("e{position}"), position));
    }
    let store = MemoryLeaseStore::new();
    start_at(
        &store,
        "p",
        &PagedProgress {
            resume_cursor: Some(api.cursor("p", 0)),
            applied_position: Some(p(209)),
            checkpoint_version: 1,
            closed_through: None,
            receipts_since: None,
        },
    )
    .await;
    let receipts = MemoryReceipts::new();
    let calls = Calls::default();
    let running = builder(
        &api,
        &store,
        "w1",
        handler("w1", &calls, |d| {
            match d.page_position().unwrap().as_u64() {
                Some(211) => Outcome::Hold("operator review".into()),
                _ => Outcome::Ack,
            }
        }),
    )
    .receipts(Arc::new(receipts.clone()))
    .hold_poll_interval(Duration::from_millis(50))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    let e211 = EventId::paged(SOURCE, "p", "e211");
    wait_for("the hold recorded", Duration::from_secs(10), || {
        receipts.receipts().iter().any(|r| r.event == e211)
    })
    .await;
    wait_for("210 applied", Duration::from_secs(10), || {
        applied(&store, "p") == Some(210)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let held = progress(&store, "p");
    assert_eq!(
        held.applied_position,
        Some(p(210)),
        "212 settled, but 211 holds the prefix"
    );
    assert_eq!(
        held.checkpoint_version, 1,
        "the next cursor is still pending"
    );
    // An operator makes it terminal.
    receipts
        .record(
            &e211,
            &Disposition::Quarantined("bad schema".into()),
            "operator",
        )
        .await
        .unwrap();
    wait_for("the barrier", Duration::from_secs(10), || {
        progress(&store, "p").checkpoint_version == 2
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    assert_eq!(applied(&store, "p"), Some(212));
    assert_eq!(
        calls.count("e211"),
        1,
        "settled by its receipt, not handled again"
    );
}

/// Overlapping pages, a page served twice, empty pages with advancing tokens, a token that does
/// not advance, lost answers and throttling, all while the traversal runs: every event is handled
/// once (overlaps are skipped, nothing is lost) and the barrier ends at the last event.
#[tokio::test(start_paused = true)]
async fn misbehaving_pages_neither_lose_nor_repeat_events() {
    let api = EventApi::new(SOURCE).page_size(5);
    for n in 0..60 {
        api.push("p", format!("{n}"));
    }
    for script in [
        Script::Overlap(3),
        Script::EmptyAdvancing,
        Script::ReplayPrevious,
        Script::LoseResponse,
        Script::Unchanged,
        Script::Throttle,
        Script::EmptyAdvancing,
        Script::Overlap(7),
        Script::ReplayPrevious,
    ] {
        api.script("p", script);
    }
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let running = builder(&api, &store, "w1", acks("w1", &calls))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("every event", Duration::from_secs(20), || {
        applied(&store, "p") == Some(60)
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    let ids = calls.ids();
    let expected: Vec<String> = (1..=60).map(|n| format!("p-{n}")).collect();
    let mut sorted = ids.clone();
    sorted.sort_by_key(|id| id[2..].parse::<u64>().unwrap());
    assert_eq!(sorted, expected, "every event once");
}

/// Caught up, the API keeps answering with the request's token: the reader backs off for the poll
/// interval, doubled with every unchanged answer in a row up to the idle bound (30 s by default),
/// instead of spinning; the first event after a quiet spell is read within that bound, and the
/// waits start again from the poll interval. (Before the idle bound, a quiet partition was
/// fetched every poll interval for ever: 5 to 15 fetches in 2 s here, 300 in a minute.)
#[tokio::test(start_paused = true)]
async fn a_token_that_does_not_advance_is_fetched_again_after_a_wait_that_grows_while_idle() {
    let api = EventApi::new(SOURCE);
    api.push("p", "only");
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let running = builder(&api, &store, "w1", acks("w1", &calls))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("the event", Duration::from_secs(10), || {
        calls.all().len() == 1
    })
    .await;
    let before = api.fetches();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let fetches = api.fetches() - before;
    // 200 ms, then 400, 800, 1,600...: 2 to 5 fetches in 2 s, not thousands.
    assert!((2..=5).contains(&fetches), "{fetches} fetches in 2 s");
    let before = api.fetches();
    tokio::time::sleep(Duration::from_secs(300)).await;
    let fetches = api.fetches() - before;
    // At most one every 30 s once the waits reached the bound.
    assert!((8..=14).contains(&fetches), "{fetches} fetches in 5 min");
    // Read within the bound; the event after it within the poll interval's first waits.
    for (event, what, limit) in [
        ("after a quiet spell", "the event after the quiet spell", 31),
        (
            "soon after",
            "the next event, read at the poll interval again",
            2,
        ),
    ] {
        let handled = calls.all().len();
        api.push("p", event);
        wait_for(what, Duration::from_secs(limit), || {
            calls.all().len() == handled + 1
        })
        .await;
    }
    running.shutdown(Duration::from_secs(2)).await;
}

/// A source that answers a quiet partition with empty pages and a new token each time is followed
/// after a wait, never in a tight loop (the waits grow as for an unchanged token). Before, each
/// such page was followed at once: a thousand of them in no time.
#[tokio::test(start_paused = true)]
async fn empty_pages_with_new_tokens_are_followed_after_a_wait() {
    let api = EventApi::new(SOURCE);
    api.push("p", "first");
    for _ in 0..1_000 {
        api.script("p", Script::EmptyAdvancing);
    }
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let running = builder(&api, &store, "w1", acks("w1", &calls))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let fetches = api.fetches();
    running.shutdown(Duration::from_secs(2)).await;
    // 200 ms doubling to 30 s: 0.2 + 0.4 + ... + 25.6 s is 51 s, then one more.
    assert!((7..=12).contains(&fetches), "{fetches} fetches in a minute");
}

/// A page that breaks the source's order stops the partition's attempt: nothing of it is
/// handled, the progress stays before it, and the lease is given back (the next attempt stops
/// there too, for investigation; it never skips).
// On real time: under paused time it does not finish (not looked into yet; on real time the
// failed partition is taken again twice in 3 s, so it is no tight loop).
#[tokio::test(start_paused = true)]
async fn order_violations_stop_the_partition_without_skipping() {
    type Case = (&'static str, Vec<ScriptedEvent>);
    let cases: Vec<Case> = vec![
        (
            "a regression",
            vec![event("a", 1), event("b", 2), event("c", 3), event("z", 2)],
        ),
        (
            "two identities at one position",
            vec![event("a", 1), event("b", 2), event("c", 3), event("x", 3)],
        ),
        (
            "a gap",
            vec![event("a", 1), event("b", 2), event("c", 3), event("e", 5)],
        ),
    ];
    for (what, events) in cases {
        let api = EventApi::new(SOURCE).page_size(3);
        for e in events {
            api.append("p", e);
        }
        let store = MemoryLeaseStore::new();
        let calls = Calls::default();
        let running = builder(&api, &store, "w1", acks("w1", &calls))
            .build()
            .unwrap()
            .run()
            .await
            .unwrap();
        wait_for(what, Duration::from_secs(10), || {
            progress(&store, "p").applied_position == Some(p(3))
        })
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        running.shutdown(Duration::from_secs(2)).await;
        assert_eq!(
            calls.ids(),
            ["a", "b", "c"],
            "{what}: nothing of the bad page handled"
        );
        assert_eq!(applied(&store, "p"), Some(3), "{what}");
    }
}

/// A retry runs the event again in place, as the next attempt, holding the barrier meanwhile;
/// once a declared cap is spent the event gets a `quarantined` receipt (with the reason and its
/// attempts) before it settles: never a drop.
#[tokio::test(start_paused = true)]
async fn retries_run_in_place_and_a_spent_event_is_quarantined_by_receipt() {
    let api = EventApi::new(SOURCE);
    for n in 0..5 {
        api.push("p", format!("{n}"));
    }
    let store = MemoryLeaseStore::new();
    let receipts = MemoryReceipts::new();
    let calls = Calls::default();
    let running = builder(
        &api,
        &store,
        "w1",
        handler("w1", &calls, |d| {
            match (d.event_id().as_str(), d.attempt()) {
                (id, 1 | 2) if id.ends_with("p-2") => Outcome::Retry,
                (id, _) if id.ends_with("p-4") => Outcome::RetryAfter(Duration::from_millis(100)),
                _ => Outcome::Ack,
            }
        }),
    )
    .max_attempts(NonZeroU32::new(3).unwrap())
    .receipts(Arc::new(receipts.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("everything settled", Duration::from_secs(20), || {
        applied(&store, "p") == Some(5)
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    let attempts: BTreeMap<String, Vec<u32>> =
        calls
            .all()
            .into_iter()
            .fold(BTreeMap::new(), |mut m, (_, id, a)| {
                m.entry(id).or_default().push(a);
                m
            });
    assert_eq!(attempts["p-2"], [1, 2, 3], "acked at the third attempt");
    assert_eq!(attempts["p-4"], [1, 2, 3], "spent after three");
    assert_eq!(attempts["p-1"], [1]);
    let receipt = receipts
        .get(&EventId::new(format!("paged/{SOURCE}/p/p-4")))
        .await
        .unwrap()
        .expect("the spent event's receipt");
    let Disposition::Quarantined(reason) = &receipt.disposition else {
        panic!("quarantined, not {:?}", receipt.disposition);
    };
    assert!(
        reason.contains("attempts spent: 3 of 3"),
        "the reason and the attempts: {reason}"
    );
}

/// The default path (seed 003, rule 1): with no cap declared, an event whose downstream is down
/// runs again in place with a backoff for as long as it fails, holds the page barrier
/// (`appliedPosition` never passes it), and the consumer's health names it with its attempts;
/// once the downstream is back it is handled, and only then does the barrier pass.
#[tokio::test(start_paused = true)]
async fn with_no_cap_a_failing_event_retries_in_place_until_it_succeeds() {
    let api = EventApi::new(SOURCE);
    for n in 0..5 {
        api.push("p", format!("{n}"));
    }
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let up = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // What the row said each time the failing event was handed out.
    let applied_then: Arc<Mutex<Vec<Option<u64>>>> = Arc::default();
    let running = builder(
        &api,
        &store,
        "w1",
        handler("w1", &calls, {
            let (up, store, applied_then) = (up.clone(), store.clone(), applied_then.clone());
            move |d| {
                if !d.event_id().as_str().ends_with("p-2") {
                    return Outcome::Ack;
                }
                applied_then.lock().unwrap().push(applied(&store, "p"));
                match up.load(std::sync::atomic::Ordering::SeqCst) {
                    true => Outcome::Ack,
                    false => Outcome::Retry,
                }
            }
        }),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    // Three attempts within 100 + 200 ms, the fifth after 1.5 s: no default cap ends it.
    wait_for("five failed attempts", Duration::from_secs(20), || {
        calls.count("p-2") >= 5
    })
    .await;
    let health = running.health();
    let shard = health.shards.iter().find(|s| s.shard == "p").expect("p");
    let oldest = shard
        .oldest_retry
        .as_ref()
        .expect("the failing event named");
    assert_eq!(oldest.event, format!("paged/{SOURCE}/p/p-2"));
    assert!(oldest.attempts >= 5, "{oldest:?}");
    assert_eq!(shard.retrying, 1);
    assert!(
        applied(&store, "p").is_none_or(|a| a < 2),
        "the barrier passed the failing event: {:?}",
        applied(&store, "p")
    );
    up.store(true, std::sync::atomic::Ordering::SeqCst);
    wait_for("everything settled", Duration::from_secs(20), || {
        applied(&store, "p") == Some(5)
    })
    .await;
    let after = running.health();
    assert_eq!(after.shards[0].retrying, 0, "{after:?}");
    assert!(after.shards[0].oldest_retry.is_none());
    running.shutdown(Duration::from_secs(2)).await;
    let tries = calls.count("p-2");
    assert!(
        applied_then
            .lock()
            .unwrap()
            .iter()
            .all(|a| a.is_none_or(|a| a < 2)),
        "applied passed the event while it failed: {:?}",
        applied_then.lock().unwrap()
    );
    let attempts: Vec<u32> = calls
        .all()
        .into_iter()
        .filter(|(_, id, _)| id == "p-2")
        .map(|(_, _, a)| a)
        .collect();
    assert_eq!(
        attempts,
        (1..=tries as u32).collect::<Vec<_>>(),
        "one attempt after another"
    );
    for id in ["p-1", "p-3", "p-4", "p-5"] {
        assert_eq!(calls.count(id), 1, "{id}");
    }
}

/// Invariant 6 through retries in place: while an event waits to run again, the later events of
/// its key wait behind it (and run after it succeeded, in order); events of other keys go on.
#[tokio::test(start_paused = true)]
async fn the_events_of_a_key_wait_behind_one_that_runs_again_in_place() {
    let api = keyed(&["k", "k", "other", "k", "other"]);
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let running = builder(
        &api,
        &store,
        "w1",
        handler("w1", &calls, |d| {
            // p-1 fails twice, then succeeds.
            if d.paged_event_id() == Some("p-1") && d.attempt() < 3 {
                Outcome::Retry
            } else {
                Outcome::Ack
            }
        }),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("everything settled", Duration::from_secs(30), || {
        applied(&store, "p") == Some(5)
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    let all = calls.all();
    let at = |id: &str, attempt: u32| calls.at(id, attempt);
    let succeeded = at("p-1", 3);
    assert!(
        at("p-2", 1) > succeeded && at("p-4", 1) > at("p-2", 1),
        "the events of key k ran out of order: {all:?}"
    );
    assert!(
        at("p-3", 1) < succeeded && at("p-5", 1) < succeeded,
        "the other key waited for the retries: {all:?}"
    );
    for id in ["p-2", "p-3", "p-4", "p-5"] {
        assert_eq!(calls.count(id), 1, "{id}: {all:?}");
    }
}

/// Effects whose condition the ledger refuses send their event the retry way: it runs again in
/// place, and the later events of its key wait for it, as for a retry the handler answered. (Until
/// 2026-12-04 its lane went on with the key while the effects were committed, so a later event of
/// the key ran before the refused one ran again; a paged simulation seed with keys found it.)
#[tokio::test(start_paused = true)]
async fn the_events_of_a_key_wait_behind_effects_whose_condition_is_refused() {
    let api = keyed(&["k", "k", "other", "k"]);
    let store = MemoryLeaseStore::new();
    let receipts = MemoryReceipts::new().table("counts", &["id"]);
    let calls = Calls::default();
    let running = builder(
        &api,
        &store,
        "w1",
        handler("w1", &calls, |d| {
            let id = d.paged_event_id().unwrap().to_string();
            let count = Effect::update("counts", key("id", id.as_str())).add("count", 1);
            // p-1's first effects check an item that does not exist: the commit is refused.
            if id == "p-1" && d.attempt() == 1 {
                Outcome::Apply(Effects::new().with(count).with(Effect::check(
                    "counts",
                    key("id", "absent"),
                    Expect::Exists,
                )))
            } else {
                Outcome::Apply(count.into())
            }
        }),
    )
    .receipts(Arc::new(receipts.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("everything settled", Duration::from_secs(30), || {
        applied(&store, "p") == Some(4)
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    let all = calls.all();
    let at = |id: &str, attempt: u32| calls.at(id, attempt);
    assert!(
        at("p-2", 1) > at("p-1", 2) && at("p-4", 1) > at("p-2", 1),
        "the events of key k ran out of order: {all:?}"
    );
    assert!(
        at("p-3", 1) < at("p-1", 2),
        "the other key waited for the retry: {all:?}"
    );
    for n in 1..=4 {
        assert_eq!(
            receipts.number("counts", &key("id", format!("p-{n}")), "count"),
            Some(1),
            "p-{n}: {all:?}"
        );
    }
}

/// With a cap and a dead-letter stream, a spent event is written to the stream (with its
/// partition, position, identity, timestamp, attempts and reason) before it settles; a dead
/// letter that cannot be written yet holds the barrier until it is.
#[tokio::test(start_paused = true)]
async fn a_spent_event_goes_to_the_dead_letter_stream_before_it_settles() {
    use shardwise::envelope;
    use shardwise::retry::{
        ATTEMPTS_HEADER, DEAD_LETTER_REASON_HEADER, EVENT_ID_HEADER, EVENT_TIMESTAMP_HEADER,
        ORIGIN_SHARD_HEADER, PAGE_POSITION_HEADER,
    };
    use shardwise::testing::{MemoryStream, MemoryStreams};
    let api = EventApi::new(SOURCE);
    for n in 0..4 {
        api.push("p", format!("{n}"));
    }
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let dlq = MemoryStream::new("events-dlq", 1);
    let sink = MemoryStreams::new([dlq.clone()]);
    let running = builder(
        &api,
        &store,
        "w1",
        handler("w1", &calls, |d| {
            match d.event_id().as_str().ends_with("p-1") {
                true => Outcome::Retry,
                false => Outcome::Ack,
            }
        }),
    )
    .max_attempts(NonZeroU32::new(2).unwrap())
    .dead_letter("events-dlq")
    .record_sink(Arc::new(sink.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    // The dead-letter stream disappears: the spent event's dead letter cannot be written, and the
    // event holds the barrier (nothing passes position 1) until it can.
    sink.remove("events-dlq");
    wait_for("the dead letter stuck", Duration::from_secs(20), || {
        running.stuck_writes().len() == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        applied(&store, "p"),
        None,
        "the barrier passed an unwritten dead letter"
    );
    assert_eq!(calls.count("p-1"), 2, "two attempts, then spent");
    sink.add(dlq.clone());
    wait_for("everything settled", Duration::from_secs(60), || {
        applied(&store, "p") == Some(4)
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    assert_eq!(calls.count("p-1"), 2, "written, not handled again");
    let letters = dlq.records();
    assert_eq!(letters.len(), 1, "one dead letter");
    let letter = envelope::decode(letters[0].record.data.clone());
    let h = &letter.headers;
    assert_eq!(h.get_str(ORIGIN_SHARD_HEADER), Some("p"), "the partition");
    assert_eq!(
        h.get_str(EVENT_ID_HEADER),
        Some(format!("paged/{SOURCE}/p/p-1").as_str())
    );
    assert_eq!(h.get_str(PAGE_POSITION_HEADER), Some("0000000000000001"));
    assert!(h.get_str(EVENT_TIMESTAMP_HEADER).is_some(), "{h:?}");
    assert_eq!(h.get_str(ATTEMPTS_HEADER), Some("2"));
    assert!(
        h.get_str(DEAD_LETTER_REASON_HEADER)
            .is_some_and(|r| r.contains("attempts spent: 2 of 2")),
        "{h:?}"
    );
    assert_eq!(
        letter.payload.as_ref(),
        b"0",
        "the first event pushed is p-1"
    );
}

/// Seed 003: a cap, a handler timeout or a maximum age on a paged consumer with neither a
/// receipt ledger nor a dead-letter stream would end an event's attempts with nothing durable to
/// record it, so the build refuses it, naming the fields; with either it builds.
#[test]
fn a_cap_without_a_ledger_or_a_dead_letter_stream_is_refused_at_build() {
    let api = EventApi::new(SOURCE);
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let base = || builder(&api, &store, "w1", acks("w1", &calls));
    let cap = NonZeroU32::new(3).unwrap();
    let second = Duration::from_secs(1);
    let cases: Vec<(&str, ConsumerBuilder<_>, &str)> = vec![
        ("a cap", base().max_attempts(cap), "max_attempts"),
        (
            "a handler timeout",
            base().handler_timeout(second),
            "handler_timeout",
        ),
        (
            "a maximum age",
            base().max_record_age(second),
            "max_record_age",
        ),
        (
            "all three",
            base()
                .max_attempts(cap)
                .handler_timeout(second)
                .max_record_age(second),
            "max_attempts",
        ),
    ];
    for (what, builder, field) in cases {
        let err = builder.build().expect_err(what);
        assert_eq!(err.field(), field, "{what}: {err}");
        assert!(err.reason().contains("dead_letter"), "{what}: {err}");
    }
    let err = base()
        .max_attempts(cap)
        .max_record_age(second)
        .build()
        .unwrap_err();
    assert_eq!(err.value(), "3", "{err}");
    assert!(
        err.reason().contains("max_attempts, max_record_age"),
        "every field named: {err}"
    );
    assert!(base().build().is_ok(), "no cap: retries in place");
    assert!(
        base()
            .max_attempts(cap)
            .receipts(Arc::new(MemoryReceipts::new()))
            .build()
            .is_ok()
    );
    assert!(base().max_attempts(cap).dead_letter("dlq").build().is_ok());
}

/// Receipts must outlive every replay (issue 23, item 2): a source read by timestamp with a
/// lateness bound hands an event out again for that long plus the audit window, so a ledger that
/// deletes applied receipts sooner is refused at build, naming both; one kept long enough builds,
/// and so does one that keeps receipts for good (the memory ledger).
#[test]
fn receipts_kept_shorter_than_the_sources_replays_are_refused_at_build() {
    use shardwise::paged::{AUDIT_WINDOW, Finality, Timestamps, Traversal};
    use shardwise::receipts::DynamoDbReceipts;
    let day = Duration::from_secs(86_400);
    let api = EventApi::new(SOURCE).contract(Contract::default().timestamps(Timestamps::new(
        Traversal::Complete,
        Finality::Lateness(14 * day),
    )));
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let client = aws_sdk_dynamodb::Client::from_conf(
        aws_sdk_dynamodb::Config::builder()
            .behavior_version(aws_sdk_dynamodb::config::BehaviorVersion::latest())
            .region(aws_sdk_dynamodb::config::Region::new("us-east-1"))
            .build(),
    );
    let ledger = |kept: Duration| {
        Arc::new(DynamoDbReceipts::new(client.clone(), "receipts", "paged-app").retention(kept))
    };
    let err = builder(&api, &store, "w1", acks("w1", &calls))
        .receipts(ledger(7 * day))
        .build()
        .expect_err("7 days of receipts for 14 days of replays");
    assert_eq!(err.field(), "receipt_retention", "{err}");
    assert_eq!(err.value(), "604800s", "{err}");
    assert!(
        err.reason().contains("1209660 s (14.00 days)"),
        "the horizon named: {err}"
    );
    assert!(
        builder(&api, &store, "w1", acks("w1", &calls))
            .receipts(ledger(14 * day + AUDIT_WINDOW))
            .build()
            .is_ok()
    );
    assert!(
        builder(&api, &store, "w1", acks("w1", &calls))
            .receipts(Arc::new(MemoryReceipts::new()))
            .build()
            .is_ok()
    );
}

/// Effects with receipts across crashes at each point: before a commit (the handler ran), after it
/// (the receipt is durable but the barrier is not), and after the barrier. Whatever the crash
/// point, every counter ends at exactly 1 and nothing is skipped.
#[tokio::test(start_paused = true)]
async fn effects_apply_once_across_crashes_before_and_after_commits_and_barriers() {
    let api = EventApi::new(SOURCE).page_size(4);
    for n in 0..12 {
        api.push("p", format!("{n}"));
    }
    let store = MemoryLeaseStore::new();
    let receipts = MemoryReceipts::new().table("counts", &["id"]);
    let calls = Calls::default();
    let counting = |worker: &str| {
        handler(worker, &calls, |d| {
            let id = d.paged_event_id().unwrap().to_string();
            Outcome::Apply(
                Effect::update("counts", key("id", id))
                    .add("count", 1)
                    .into(),
            )
        })
    };
    for (round, worker) in ["w1", "w2", "w3"].iter().enumerate() {
        let running = builder(&api, &store, worker, counting(worker))
            .receipts(Arc::new(receipts.clone()))
            .build()
            .unwrap()
            .run()
            .await
            .unwrap();
        // Crash at different moments: after some commits, before/after a barrier.
        let target = 3 + round * 4;
        wait_for("progress", Duration::from_secs(10), || {
            receipts.receipts().len() >= target.min(12)
        })
        .await;
        running.abort();
        tokio::time::sleep(Duration::from_millis(1_000)).await; // the lease expires
    }
    let last = builder(&api, &store, "w4", counting("w4"))
        .receipts(Arc::new(receipts.clone()))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("everything", Duration::from_secs(20), || {
        applied(&store, "p") == Some(12)
    })
    .await;
    last.shutdown(Duration::from_secs(2)).await;
    for n in 1..=12 {
        assert_eq!(
            receipts.number("counts", &key("id", format!("p-{n}")), "count"),
            Some(1),
            "p-{n}"
        );
    }
}

/// A seek to the trim horizon reads every partition again from its first page; a page fetched
/// before the seek cannot pass its barrier after it (the version moved).
#[tokio::test(start_paused = true)]
async fn a_seek_reads_the_partitions_again_from_their_first_page() {
    let api = EventApi::new(SOURCE).page_size(3);
    for n in 0..9 {
        api.push("p", format!("{n}"));
    }
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let running = builder(&api, &store, "w1", acks("w1", &calls))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("everything", Duration::from_secs(10), || {
        applied(&store, "p") == Some(9)
    })
    .await;
    let version = progress(&store, "p").checkpoint_version;
    let report = running
        .seek(&shardwise::seek::SeekTarget::TrimHorizon)
        .await
        .unwrap();
    assert_eq!(report.moved, ["p"]);
    wait_for("everything again", Duration::from_secs(10), || {
        calls.all().len() >= 18
    })
    .await;
    wait_for("the barrier again", Duration::from_secs(10), || {
        applied(&store, "p") == Some(9) && progress(&store, "p").checkpoint_version > version + 1
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    assert_eq!(calls.count("p-1"), 2);
}

/// Starting from a cursor the source gives for a time is what a seek to a time does; a source
/// without one refuses it, naming the source.
#[tokio::test(start_paused = true)]
async fn a_seek_to_a_time_needs_a_source_that_can_start_at_one() {
    let api = EventApi::new(SOURCE);
    api.push("p", "x");
    let store = MemoryLeaseStore::new();
    let err = shardwise::seek::seek_paged(
        &store,
        &api as &dyn PagedSource,
        &shardwise::seek::SeekTarget::Timestamp(std::time::SystemTime::now()),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("cannot start at a time"), "{err}");
    let _ = Cursor::new("unused");
    let _: Option<Running> = None;
}

/// A source read by timestamp whose one-hour lateness bound keeps every group open (as 14 days
/// would), with `events` events `p-1`.. in partition `p`, a second apart, from a minute ago; and
/// now, in ms.
fn open_groups(events: i64) -> (EventApi, i64) {
    use shardwise::paged::{Finality, Timestamps, Traversal};
    let api = EventApi::new(SOURCE).contract(Contract::default().timestamps(Timestamps::new(
        Traversal::Complete,
        Finality::Lateness(Duration::from_secs(3_600)),
    )));
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    for n in 1..=events {
        api.push_at("p", &format!("p-{n}"), now - 60_000 + n * 1_000, "e");
    }
    (api, now)
}

/// Issue 23, item 2: a source read by timestamp reads its open groups again after a restart (here
/// a one-hour lateness bound keeps every group open, as 14 days would). With a ledger every
/// outcome leaves a receipt (an ack and a drop too), so the next attempt recognises what an
/// earlier one finished without calling the handler: the new owner handles only the new event.
#[tokio::test(start_paused = true)]
async fn after_a_restart_no_event_an_earlier_attempt_finished_reaches_the_handler_again() {
    let (api, now) = open_groups(6);
    let store = MemoryLeaseStore::new();
    let receipts = MemoryReceipts::new().table("counts", &["id"]);
    let calls = Calls::default();
    let answer = |d: &Delivery| {
        let id = d.paged_event_id().unwrap().to_string();
        match id.as_str() {
            "p-2" => Outcome::Drop,
            "p-3" => Outcome::Apply(
                Effect::update("counts", key("id", id.as_str()))
                    .add("count", 1)
                    .into(),
            ),
            _ => Outcome::Ack,
        }
    };
    let first = builder(&api, &store, "w1", handler("w1", &calls, answer))
        .receipts(Arc::new(receipts.clone()))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("six receipts", Duration::from_secs(20), || {
        receipts.receipts().len() == 6
    })
    .await;
    first.shutdown(Duration::from_secs(2)).await;
    assert_eq!(calls.of("w1").len(), 6, "{:?}", calls.all());
    assert!(
        receipts
            .receipts()
            .iter()
            .all(|r| r.disposition == Disposition::Applied),
        "an ack and a drop leave an applied receipt with no effects"
    );

    api.push_at("p", "p-7", now, "e");
    let second = builder(&api, &store, "w2", handler("w2", &calls, answer))
        .receipts(Arc::new(receipts.clone()))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("the new event handled", Duration::from_secs(20), || {
        calls.count("p-7") == 1
    })
    .await;
    // Long enough for two more polls of the open groups.
    tokio::time::sleep(Duration::from_millis(600)).await;
    second.shutdown(Duration::from_secs(2)).await;
    assert_eq!(
        calls.of("w2"),
        ["p-7"],
        "the second owner handles only what the first did not finish"
    );
    assert_eq!(
        receipts.number("counts", &key("id", "p-3"), "count"),
        Some(1)
    );

    // A seek asks for the events again: receipts recorded before it do not stop them (the row
    // says when it was sought), and effects still apply once.
    let an_hour_ago = std::time::SystemTime::now() - Duration::from_secs(3_600);
    let moved = shardwise::seek::seek_paged(
        &store,
        &api,
        &shardwise::seek::SeekTarget::Timestamp(an_hour_ago),
    )
    .await
    .unwrap();
    assert_eq!(moved.moved, ["p"]);
    let third = builder(&api, &store, "w3", handler("w3", &calls, answer))
        .receipts(Arc::new(receipts.clone()))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("every event handled again", Duration::from_secs(20), || {
        calls.of("w3").len() == 7
    })
    .await;
    third.shutdown(Duration::from_secs(2)).await;
    let mut again = calls.of("w3");
    again.sort();
    assert_eq!(again, ["p-1", "p-2", "p-3", "p-4", "p-5", "p-6", "p-7"]);
    assert_eq!(
        receipts.number("counts", &key("id", "p-3"), "count"),
        Some(1)
    );
}

/// A seek stamps the row by the seeking host's clock and receipts carry the recording host's: a
/// seek from a host whose clock is 10 s behind the workers' still reaches every event again.
/// Before, a receipt recorded before the seek (by the true time) but stamped after it (by a
/// clock ahead) stopped the handler, and the events handled in the 10 s before the seek were not
/// read again; the same held for a receipt recorded in the seek's own millisecond.
#[tokio::test(start_paused = true)]
async fn a_seek_from_a_host_whose_clock_is_behind_still_reaches_every_event_again() {
    use shardwise::testing::{HostClock, on_host};
    let (api, _) = open_groups(4);
    let store = MemoryLeaseStore::new();
    let receipts = MemoryReceipts::new();
    let calls = Calls::default();
    let first = builder(&api, &store, "w1", handler("w1", &calls, |_| Outcome::Ack))
        .receipts(Arc::new(receipts.clone()))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("four receipts", Duration::from_secs(20), || {
        receipts.receipts().len() == 4
    })
    .await;
    first.shutdown(Duration::from_secs(2)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;

    let an_hour_ago = std::time::SystemTime::now() - Duration::from_secs(3_600);
    let behind = HostClock::new(-10_000, 0);
    let moved = on_host(
        behind,
        shardwise::seek::seek_paged(
            &store,
            &api,
            &shardwise::seek::SeekTarget::Timestamp(an_hour_ago),
        ),
    )
    .await
    .unwrap();
    assert_eq!(moved.moved, ["p"]);
    let second = builder(&api, &store, "w2", handler("w2", &calls, |_| Outcome::Ack))
        .receipts(Arc::new(receipts.clone()))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("every event handled again", Duration::from_secs(20), || {
        calls.of("w2").len() == 4
    })
    .await;
    second.shutdown(Duration::from_secs(2)).await;
    let mut again = calls.of("w2");
    again.sort();
    assert_eq!(again, ["p-1", "p-2", "p-3", "p-4"]);
}

/// The lease store's progress writes, as a flaky network makes them: the first barrier write
/// (the first to move the version) is applied and its answer lost; the writes after it fail without effect until one that differs from the first has
/// failed too; then every write goes through.
#[derive(Debug, Default, Clone)]
struct LostThenFailed(Arc<Mutex<(Option<PagedProgress>, bool)>>);

impl shardwise::testing::Layer for LostThenFailed {
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: shardwise::testing::Call<'a>,
        forward: BoxFuture<'a, Result<T, shardwise::Error>>,
    ) -> BoxFuture<'a, Result<T, shardwise::Error>> {
        let shardwise::testing::Call::PagedCheckpoint { to, .. } = call else {
            return forward;
        };
        let failed = || shardwise::Error::DynamoDb {
            operation: "UpdateItem",
            table: "paged-app".into(),
            source: "connection reset".into(),
        };
        // What this write meets: applied with its answer lost, failed, or let through.
        let meets = {
            let mut state = self.0.lock().unwrap();
            match &state.0 {
                // Applied writes that leave the version alone go through.
                None if to.checkpoint_version == 0 => "through",
                None => {
                    state.0 = Some(to.clone());
                    "lost answer"
                }
                Some(_) if state.1 => "through",
                Some(first) => {
                    if first != to {
                        state.1 = true;
                    }
                    "failed"
                }
            }
        };
        Box::pin(async move {
            match meets {
                "through" => forward.await,
                "failed" => Err(failed()),
                _ => {
                    forward.await?;
                    Err(failed())
                }
            }
        })
    }
}

/// A write applied with its answer lost, then a different write failing without effect: the next
/// write is refused as not newer, and the row holds the first. The attempt keeps every write
/// whose answer was an error in mind, so it recognises the first as stored and goes on; it does
/// not call itself stale, give the partition back and hand its settled events out again.
#[tokio::test(start_paused = true)]
async fn a_write_whose_answer_was_lost_is_recognised_after_a_later_write_failed() {
    let api = EventApi::new(SOURCE).page_size(2);
    for _ in 0..12 {
        api.push("a", "e");
    }
    let memory = MemoryLeaseStore::new();
    let flaky = LostThenFailed::default();
    let calls = Calls::default();
    let slow = {
        let calls = calls.clone();
        Arc::new(move |d: Delivery| {
            calls.push("w1", &d);
            Box::pin(async move {
                tokio::time::sleep(Duration::from_millis(40)).await;
                Outcome::Ack
            }) as BoxFuture<'static, Outcome>
        }) as Handler
    };
    let running = builder(&api, &memory, "w1", slow)
        .lanes(1)
        .lease_store(Arc::new(shardwise::testing::Layered::new(
            Arc::new(memory.clone()),
            flaky.clone(),
        )))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("every event written", Duration::from_secs(20), || {
        applied(&memory, "a") == Some(12)
    })
    .await;
    running.shutdown(Duration::from_secs(2)).await;
    assert!(
        flaky.0.lock().unwrap().1,
        "a second, different write failed"
    );
    let ids = calls.ids();
    let expected: Vec<String> = (1..=12).map(|n| format!("a-{n}")).collect();
    assert_eq!(ids, expected, "each event once, in order");
}

/// The lease store as the workers reach it, with every `take` counted and taking a simulated
/// millisecond (past the 50th, a second): a loop of takes lets paused time run, rather than hold
/// it still for ever.
#[derive(Debug, Default)]
struct SlowTakes {
    takes: std::sync::atomic::AtomicU32,
}

impl shardwise::testing::Layer for SlowTakes {
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: shardwise::testing::Call<'a>,
        forward: BoxFuture<'a, Result<T, shardwise::Error>>,
    ) -> BoxFuture<'a, Result<T, shardwise::Error>> {
        Box::pin(async move {
            if call.method() == "take" {
                let before = self.takes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                // Past 50 takes, a second each: a loop fails the test soon instead of running on.
                let pause = if before < 50 { 1 } else { 1_000 };
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
            forward.await
        })
    }
}

/// A partition whose work fails for good (here its stored cursor is refused) is released and
/// taken again after waits that double up to `FAILED_LEASE_MAX_WAIT`: a handful of attempts a
/// minute, not a loop of take, fetch and release as fast as the table and the source answer
/// (without the waits: 110 takes in the minute here, paced only by `SlowTakes`; with the memory
/// store alone, paused time never moved again).
#[tokio::test(start_paused = true)]
async fn a_partition_that_fails_for_good_is_taken_again_after_growing_waits() {
    let api = EventApi::new(SOURCE);
    api.push("p", "a");
    let memory = MemoryLeaseStore::new();
    let refused = PagedProgress {
        resume_cursor: Some(Cursor::new("a token the source never made")),
        checkpoint_version: 1,
        ..PagedProgress::default()
    };
    start_at(&memory, "p", &refused).await;
    let store = Arc::new(shardwise::testing::Layered::new(
        Arc::new(memory.clone()),
        SlowTakes::default(),
    ));
    let calls = Calls::default();
    let running = builder(&api, &memory, "w1", acks("w1", &calls))
        .lease_store(store.clone())
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let takes = store
        .layer()
        .takes
        .load(std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(300)).await;
    let later = store
        .layer()
        .takes
        .load(std::sync::atomic::Ordering::SeqCst);
    running.shutdown(Duration::from_secs(2)).await;
    // Waits of 0.1, 0.2, 0.4 ... 25.6 s (each plus up to itself in jitter): at most 10 in the
    // first minute; then one per wait of up to 5 minutes (plus jitter).
    assert!(
        (3..=10).contains(&takes),
        "{takes} takes in the first minute"
    );
    assert!(
        (1..=8).contains(&(later - takes)),
        "{} takes in the next five minutes",
        later - takes
    );
    assert!(
        calls.ids().is_empty(),
        "nothing was read: the cursor is refused"
    );
    assert_eq!(progress(&memory, "p"), refused, "the row is as it was");
}
