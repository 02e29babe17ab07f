//! Sources read by timestamp, live: the scripted event API's offset pages by timestamp behind its
//! real HTTP server, read by the consumer through `HttpEvents`, with the lease table and the
//! receipt ledger on the DynamoDB emulator.
//!
//! Seed 000's validation list, executed: the retry example (closed through 10:00; A and B at
//! 10:01, crash; C at 10:01 and D at 10:02); a tie group larger than a page; tie order changing
//! between offset requests over an unchanged set (refused, replayed, or read through a snapshot);
//! a crash before and after each receipt and before and after the close; concurrent stale
//! retries; a lost close answer; a late event at the closed timestamp, and one within a lateness
//! bound. A watcher checks the row throughout: `closedThrough` and the version never go down, and
//! every event at or before `closedThrough` has a terminal receipt whenever the row is read.

#[path = "support/logs.rs"]
mod logs;
#[path = "support/recorder.rs"]
mod recorder;
mod support;
#[path = "support/tables.rs"]
mod tables;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use support::calls::{Calls, id_of};
use support::wait::wait_for_async;

use futures::StreamExt;
use logs::{logs_client, put_logs};
use shardwise::lease::{Checkpoint, LeaseSettings, LeaseStore, NewLease};
use shardwise::paged::{Contract, Finality, PagedProgress, PagedSource, Timestamps, Traversal};
use shardwise::receipts::{Disposition, Effect, EventId, ReceiptStore, key};
use shardwise::testing::{Crash, CrashPoint, EventApi, EventServer, HttpEvents, Ties, When};
use shardwise::{Consumer, ConsumerBuilder, Delivery, Outcome, Unproven};
use tables::Tables;

const APP: &str = "timestamps-live";
const T10_00: i64 = 1_796_119_200_000;
const T10_01: i64 = T10_00 + 60_000;
const T10_02: i64 = T10_00 + 120_000;
const T10_03: i64 = T10_00 + 180_000;

/// The metrics of this test binary (sources have unique names, so each test reads its own).
fn metrics() -> &'static recorder::Metrics {
    static METRICS: OnceLock<&'static recorder::Metrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let metrics: &'static recorder::Metrics = Box::leak(Box::default());
        let _ = metrics::set_global_recorder(metrics);
        metrics
    })
}

fn counter(name: &str, source: &str) -> u64 {
    metrics().counter(name, source).unwrap_or(0)
}

fn contracts(traversal: Traversal, finality: Finality) -> Contract {
    Contract::default().timestamps(Timestamps::new(traversal, finality))
}

/// A source of `events` (id, timestamp) on partition `p`, pages of `page`, served over HTTP.
async fn serve(
    name: &str,
    page: usize,
    api: impl FnOnce(EventApi) -> EventApi,
    contract: Contract,
    events: &[(&str, i64)],
) -> (EventApi, EventServer, HttpEvents) {
    let api = api(EventApi::new(name.to_string())
        .page_size(page)
        .contract(contract));
    for (id, t) in events {
        api.push_at("p", id, *t, id.to_string());
    }
    let server = api.serve("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let source = HttpEvents::new(name.to_string(), server.url()).contract(contract);
    (api, server, source)
}

/// Each event adds 1 to its counter, with its receipt; `slow` events take 300 ms, `gate` holds
/// the events it names until it opens.
fn counting(
    tables: &Tables,
    case: &str,
    calls: &Calls,
    slow: &'static [&'static str],
    gate: Option<(&'static str, tokio::sync::watch::Receiver<bool>)>,
) -> impl shardwise::Handler {
    let (counts, case, calls) = (tables.counts.clone(), case.to_string(), calls.clone());
    move |d: Delivery| {
        let (counts, case, calls, gate) =
            (counts.clone(), case.clone(), calls.clone(), gate.clone());
        async move {
            let id = id_of(&d);
            calls.push("", &d);
            if let Some((gated, mut open)) = gate
                && gated == id
            {
                let _ = open.wait_for(|o| *o).await;
            }
            let pause = if slow.contains(&id.as_str()) { 300 } else { 10 };
            tokio::time::sleep(Duration::from_millis(pause)).await;
            Outcome::Apply(
                Effect::update(&counts, key("id", format!("{case}/{id}")))
                    .add("count", 1)
                    .into(),
            )
        }
    }
}

fn builder<H: shardwise::Handler>(
    source: &HttpEvents,
    tables: &Tables,
    worker: &str,
    handler: H,
) -> ConsumerBuilder<H> {
    metrics();
    Consumer::paged(Arc::new(source.clone()), APP, handler)
        .worker_id(worker)
        .lanes(1)
        .poll_interval(Duration::from_millis(200))
        .checkpoint_interval(Duration::from_millis(20))
        .lease_settings(
            LeaseSettings::default()
                .lease_duration(Duration::from_millis(2_000))
                .scan_interval(Duration::from_millis(200))
                .shard_sync_interval(Duration::from_millis(500)),
        )
        .lease_store(tables.leases.clone())
        .receipts(tables.receipts.clone())
}

async fn closed(tables: &Tables, source: &str) -> Option<i64> {
    tables.progress(source, "p").await.closed_through
}

async fn wait_closed(tables: &Tables, source: &str, through: i64) {
    wait_for_async(
        &format!("{source}: closed through {through}"),
        Duration::from_secs(30),
        || async move { closed(tables, source).await == Some(through) },
    )
    .await;
}

/// The partition's row starts closed through `through` (a setup owner writes it and lets go).
async fn start_closed(tables: &Tables, source: &str, through: i64) {
    let new = NewLease {
        stream: source.into(),
        shard_id: "p".into(),
        checkpoint: Checkpoint::TrimHorizon,
        parents: vec![],
    };
    assert!(tables.leases.create(&new).await.unwrap());
    let seen = tables.leases.get(source, "p").await.unwrap().unwrap();
    let mine = tables.leases.take(&seen, "setup").await.unwrap().unwrap();
    let held = mine.ownership().unwrap();
    let to = PagedProgress {
        closed_through: Some(through),
        checkpoint_version: 1,
        ..PagedProgress::default()
    };
    let written = tables
        .leases
        .paged_checkpoint(&held, &PagedProgress::default(), &to)
        .await
        .unwrap();
    assert_eq!(written, shardwise::lease::CheckpointWrite::Written);
    assert!(tables.leases.release(&held).await.unwrap());
}

/// Watches the row while a case runs: `closedThrough` and the version never go down, and every
/// event of `api` at or before `closedThrough` (and after `from`) has a terminal receipt when the
/// row is read. Returns the reads made.
fn watch(
    tables: Arc<Tables>,
    api: EventApi,
    source: String,
    from: Option<i64>,
) -> (tokio::task::JoinHandle<u32>, Arc<AtomicBool>) {
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let handle = tokio::spawn(async move {
        let (mut last, mut reads) = (PagedProgress::default(), 0);
        let mut checked = BTreeSet::new();
        while !stopped.load(Ordering::SeqCst) {
            let now = tables.progress(&source, "p").await;
            assert!(
                now.closed_through >= last.closed_through,
                "{source}: closed_through went down: {last:?} then {now:?}"
            );
            assert!(
                now.checkpoint_version >= last.checkpoint_version,
                "{source}: the version went down: {last:?} then {now:?}"
            );
            if let Some(through) = now.closed_through {
                for event in api.events("p") {
                    let t = event.timestamp.map(shardwise_ms).unwrap();
                    if t > through || from.is_some_and(|f| t <= f) || checked.contains(&event.id) {
                        continue;
                    }
                    let id = EventId::paged(&source, "p", &event.id);
                    assert!(
                        tables.receipts.seen(&id).await.unwrap(),
                        "{source}: closed through {through} passes {} at {t}, which has no durable outcome",
                        event.id
                    );
                    checked.insert(event.id);
                }
            }
            last = now;
            reads += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        reads
    });
    (handle, stop)
}

fn shardwise_ms(t: std::time::SystemTime) -> i64 {
    t.duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as i64
}

async fn assert_counted_once(tables: &Tables, case: &str, ids: &[&str], calls: &Calls) {
    for id in ids {
        assert_eq!(
            tables.count(&format!("{case}/{id}")).await,
            Some(1),
            "{case}: {id}'s effect (handled {} times)",
            calls.count(id)
        );
    }
}

/// Seed 000's retry example, executed with its names: closed through 10:00; one page holds A and B
/// at 10:01, the next C at 10:01 and D at 10:02. A worker durably handles A and B, then crashes
/// (after B's receipt, with C in its handler). The retry queries after 10:00, finds A and B by
/// their receipts (their effects are not applied again), handles C, and closes through 10:01 only
/// once C is durable. The next query, after 10:01, still includes D, which stays open: nothing
/// later proves 10:02 complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_example_closed_through_10_00_a_b_crash_c_d() {
    let live = live_or_skip!();
    let tables = Arc::new(Tables::new(live, APP).await);
    let name = support::unique_name("retry-example");
    let (api, _server, source) = serve(
        &name,
        2,
        |api| api,
        contracts(Traversal::Complete, Finality::LaterTimestamp),
        &[
            ("Z", T10_00),
            ("A", T10_01),
            ("B", T10_01),
            ("C", T10_01),
            ("D", T10_02),
        ],
    )
    .await;
    start_closed(&tables, &name, T10_00).await;
    let (watcher, stop) = watch(tables.clone(), api.clone(), name.clone(), Some(T10_00));
    let calls = Calls::default();
    let crash = Crash::on_event(
        CrashPoint::Commit,
        EventId::paged(&name, "p", "B"),
        When::After,
    );
    let first = builder(
        &source,
        &tables,
        "w1",
        counting(&tables, &name, &calls, &["C"], None),
    )
    .lease_store(crash.leases(tables.leases.clone()))
    .receipts(crash.receipts(tables.receipts.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    tokio::time::timeout(Duration::from_secs(30), crash.wait())
        .await
        .expect("the worker reached B's receipt");
    first.abort();
    assert_eq!(
        closed(&tables, &name).await,
        Some(T10_00),
        "nothing closed before the crash"
    );
    assert_eq!(
        api.polls("p").first(),
        Some(&Some(T10_00)),
        "queries strictly after 10:00"
    );

    let second = builder(
        &source,
        &tables,
        "w2",
        counting(&tables, &name, &calls, &[], None),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_closed(&tables, &name, T10_01).await;
    let polls_at_close = api.polls("p").len();
    wait_for_async("two more polls", Duration::from_secs(10), || {
        let api = api.clone();
        async move { api.polls("p").len() >= polls_at_close + 2 }
    })
    .await;
    // A poll is recorded when the API answers it, D's replay when the reader has read its page:
    // waited for, so a shutdown right after the second poll does not cut its page short.
    wait_for_async("D's replays counted", Duration::from_secs(10), || async {
        counter("shardwise_paged_replays_total", &name) >= 2
    })
    .await;
    second.shutdown(Duration::from_secs(5)).await;
    stop.store(true, Ordering::SeqCst);
    assert!(watcher.await.expect("the watcher's checks held") >= 1);

    assert_eq!(
        closed(&tables, &name).await,
        Some(T10_01),
        "10:02 stays open: nothing later was seen"
    );
    // The next queries are strictly after 10:01, so they still include D (every tenth poll is
    // an audit a minute further back, for late events).
    let after_close = &api.polls("p")[polls_at_close..];
    assert!(after_close.contains(&Some(T10_01)), "{after_close:?}");
    assert!(
        after_close
            .iter()
            .all(|a| *a == Some(T10_01) || *a == Some(T10_01 - 60_000)),
        "{after_close:?}"
    );
    assert_eq!(calls.count("Z"), 0, "10:00 was closed: Z is never read");
    assert_counted_once(&tables, &name, &["A", "B", "C", "D"], &calls).await;
    assert!(
        counter("shardwise_paged_replays_total", &name) >= 2,
        "D's replays are counted"
    );
    Arc::into_inner(tables).unwrap().drop_all().await;
}

/// A tie group larger than a page (seven events at 10:01, pages of two): every page boundary
/// inside it proves nothing, and a quiet newest group stays open however many polls read it
/// again; an event at 10:02 closes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tie_group_larger_than_a_page_closes_only_after_a_later_timestamp() {
    let live = live_or_skip!();
    let tables = Tables::new(live, APP).await;
    let name = support::unique_name("big-tie");
    let ids = ["a", "b", "c", "d", "e", "f", "g"];
    let events: Vec<(&str, i64)> = ids.iter().map(|id| (*id, T10_01)).collect();
    let (api, _server, source) = serve(
        &name,
        2,
        |api| api,
        contracts(Traversal::Complete, Finality::LaterTimestamp),
        &events,
    )
    .await;
    let calls = Calls::default();
    let running = builder(
        &source,
        &tables,
        "w1",
        counting(&tables, &name, &calls, &[], None),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for_async("every tied event handled", Duration::from_secs(20), || {
        let calls = calls.clone();
        async move { ids.iter().all(|id| calls.count(id) == 1) }
    })
    .await;
    let polls = api.polls("p").len();
    wait_for_async("three more polls", Duration::from_secs(10), || {
        let api = api.clone();
        async move { api.polls("p").len() >= polls + 3 }
    })
    .await;
    // A poll is recorded at its first page, a replay when the reader has classified the page
    // holding it: the third re-read is counted a moment after its poll began.
    wait_for_async(
        "three re-reads counted as replays",
        Duration::from_secs(10),
        || {
            let name = name.clone();
            async move { counter("shardwise_paged_replays_total", &name) >= 7 * 3 }
        },
    )
    .await;
    assert_eq!(
        closed(&tables, &name).await,
        None,
        "the group is still open after three re-reads"
    );
    api.push_at("p", "h", T10_02, "h");
    wait_closed(&tables, &name, T10_01).await;
    running.shutdown(Duration::from_secs(5)).await;
    assert_counted_once(&tables, &name, &ids, &calls).await;
    assert_eq!(calls.count("h"), 1);
    tables.drop_all().await;
}

/// Seed 000's counterexample: A, B, C at 10:01 and D at 10:02, pages of two, and a tie order
/// that changes between offset requests over the unchanged set (the second request sees C, A,
/// B, D: offset two returns B and D). Declared without a complete traversal, the source is
/// refused by default; read anyway (`Unproven::Replay`), nothing is ever closed and C is found by
/// a later poll; read through one snapshot per poll, C is read by the first poll and 10:01
/// closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tie_order_that_changes_between_offset_requests_never_skips_c() {
    let events = [("A", T10_01), ("B", T10_01), ("C", T10_01), ("D", T10_02)];
    let unproven = contracts(Traversal::Unproven, Finality::LaterTimestamp);
    let refused = Consumer::paged(
        Arc::new(EventApi::new("rotating").contract(unproven)),
        APP,
        |_: Delivery| async { Outcome::Ack },
    )
    .build()
    .map(|_| ())
    .expect_err("a source without a complete traversal is refused by default");
    let said = refused.to_string();
    assert!(
        said.contains("traversal Unproven") && said.contains("Unproven::Replay"),
        "{said}"
    );

    let live = live_or_skip!();
    let tables = Tables::new(live, APP).await;
    // Read anyway: every poll starts after nothing, and C comes in a later poll.
    let name = support::unique_name("rotating-replay");
    let (api, _server, source) =
        serve(&name, 2, |api| api.ties(Ties::Rotate), unproven, &events).await;
    let calls = Calls::default();
    let running = builder(
        &source,
        &tables,
        "w1",
        counting(&tables, &name, &calls, &[], None),
    )
    .unproven(Unproven::Replay)
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for_async("C handled", Duration::from_secs(20), || {
        let calls = calls.clone();
        async move { calls.count("C") == 1 }
    })
    .await;
    let polls = api.polls("p").len();
    wait_for_async("two more polls", Duration::from_secs(10), || {
        let api = api.clone();
        async move { api.polls("p").len() >= polls + 2 }
    })
    .await;
    running.shutdown(Duration::from_secs(5)).await;
    assert!(polls >= 2, "the first poll skipped C: {polls} polls");
    assert_eq!(closed(&tables, &name).await, None, "nothing is ever closed");
    assert!(api.polls("p").iter().all(Option::is_none));
    assert_counted_once(&tables, &name, &["A", "B", "C", "D"], &calls).await;

    // A snapshot per poll: the same rotating ties, a complete traversal.
    let name = support::unique_name("rotating-snapshot");
    let (api, _server, source) = serve(
        &name,
        2,
        |api| api.ties(Ties::Rotate).snapshots(true),
        contracts(Traversal::Complete, Finality::LaterTimestamp),
        &events,
    )
    .await;
    let calls = Calls::default();
    let running = builder(
        &source,
        &tables,
        "w1",
        counting(&tables, &name, &calls, &[], None),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_closed(&tables, &name, T10_01).await;
    running.shutdown(Duration::from_secs(5)).await;
    assert_counted_once(&tables, &name, &["A", "B", "C", "D"], &calls).await;
    assert_eq!(api.polls("p")[0], None);
    tables.drop_all().await;
}

/// The events of the crash cases: three at 10:01 (a page and a half), two at 10:02, one at
/// 10:03; pages of two.
const CRASH_EVENTS: [(&str, i64); 6] = [
    ("A", T10_01),
    ("B", T10_01),
    ("C", T10_01),
    ("D", T10_02),
    ("E", T10_02),
    ("F", T10_03),
];

/// Where a crash case dies.
#[derive(Debug, Clone, Copy)]
enum CrashAt {
    /// At the commit of this event's effect with its receipt.
    Receipt(&'static str, When),
    /// At the nth close (a write that raises the version).
    Close(u32, When),
}

/// One crash case on its own source: the first worker dies at `crash`, the row is checked as it
/// left it, a second worker closes through 10:02. Every effect counts once.
async fn crash_case(tables: Arc<Tables>, label: String, at: CrashAt) -> String {
    let name = support::unique_name(&label);
    let crash = match at {
        CrashAt::Receipt(id, when) => {
            Crash::on_event(CrashPoint::Commit, EventId::paged(&name, "p", id), when)
        }
        CrashAt::Close(nth, when) => Crash::at(CrashPoint::Barrier, nth, when),
    };
    let (api, _server, source) = serve(
        &name,
        2,
        |api| api,
        contracts(Traversal::Complete, Finality::LaterTimestamp),
        &CRASH_EVENTS,
    )
    .await;
    let (watcher, stop) = watch(tables.clone(), api.clone(), name.clone(), None);
    let calls = Calls::default();
    let first = builder(
        &source,
        &tables,
        "w1",
        counting(&tables, &name, &calls, &["B", "E"], None),
    )
    .lease_store(crash.leases(tables.leases.clone()))
    .receipts(crash.receipts(tables.receipts.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    tokio::time::timeout(Duration::from_secs(30), crash.wait())
        .await
        .unwrap_or_else(|_| panic!("{name}: the crash point was never reached"));
    first.abort();
    let second = builder(
        &source,
        &tables,
        "w2",
        counting(&tables, &name, &calls, &[], None),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_closed(&tables, &name, T10_02).await;
    // F (10:03) stays open: nothing waits for it but its receipt.
    wait_for_async(
        &format!("{name}: F's receipt"),
        Duration::from_secs(30),
        || {
            let (tables, event) = (&tables, EventId::paged(&name, "p", "F"));
            async move { tables.receipts.seen(&event).await.unwrap() }
        },
    )
    .await;
    second.shutdown(Duration::from_secs(5)).await;
    stop.store(true, Ordering::SeqCst);
    assert!(watcher.await.expect("the watcher's checks held") >= 1);
    assert_counted_once(&tables, &name, &["A", "B", "C", "D", "E", "F"], &calls).await;
    name
}

/// A crash before and after each receipt (the commit of each event's effect), and before and
/// after each close: nothing is skipped, nothing applied twice, `closedThrough` never passes an
/// event without a durable outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_and_after_each_receipt_and_each_close_loses_nothing() {
    let live = live_or_skip!();
    let tables = Arc::new(Tables::new(live, APP).await);
    let mut cases = Vec::new();
    for (id, _) in CRASH_EVENTS {
        for when in [When::Before, When::After] {
            cases.push((
                format!("receipt-{id}-{when:?}").to_lowercase(),
                CrashAt::Receipt(id, when),
            ));
        }
    }
    // The closes through 10:01 and 10:02 (a close is a write that raises the version).
    for nth in [1, 2] {
        for when in [When::Before, When::After] {
            cases.push((
                format!("close-{nth}-{when:?}").to_lowercase(),
                CrashAt::Close(nth, when),
            ));
        }
    }
    let total = cases.len();
    let done: Vec<String> = futures::stream::iter(cases)
        .map(|(label, at)| crash_case(tables.clone(), label, at))
        .buffer_unordered(4)
        .collect()
        .await;
    assert_eq!(done.len(), total);
    Arc::into_inner(tables).unwrap().drop_all().await;
}

/// A close whose answer is lost (it was stored): the worker rereads the row, finds its close, and
/// goes on to the next one from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_close_answer_is_found_stored_and_the_partition_goes_on() {
    let live = live_or_skip!();
    let tables = Tables::new(live, APP).await;
    let name = support::unique_name("lost-close");
    let (_api, _server, source) = serve(
        &name,
        2,
        |api| api,
        contracts(Traversal::Complete, Finality::LaterTimestamp),
        &CRASH_EVENTS,
    )
    .await;
    let crash = Crash::at(CrashPoint::Barrier, 1, When::LoseAnswer);
    let calls = Calls::default();
    let running = builder(
        &source,
        &tables,
        "w1",
        counting(&tables, &name, &calls, &[], None),
    )
    .lease_store(crash.leases(tables.leases.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_closed(&tables, &name, T10_02).await;
    running.shutdown(Duration::from_secs(5)).await;
    assert!(!crash.crashed());
    let row = tables.leases.get(&name, "p").await.unwrap().unwrap();
    assert_eq!(
        row.owner, None,
        "the worker kept its lease and released it at shutdown"
    );
    for (id, _) in CRASH_EVENTS {
        assert_eq!(calls.count(id), 1, "{id} handled once");
    }
    tables.drop_all().await;
}

/// Concurrent stale retries: while a worker's attempt is busy with 10:01, another attempt under
/// the same lease closes through 10:01 first. The worker's close (through 10:02, from the old
/// version) loses its compare-and-swap, rereads the row, and stops without writing; the next
/// attempt goes on from 10:01. A retry from an even older version loses too. `closedThrough`
/// never goes down and is never replaced by a stale value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_stale_retries_never_lower_or_replace_closed_through() {
    let live = live_or_skip!();
    let tables = Arc::new(Tables::new(live, APP).await);
    let name = support::unique_name("stale-close");
    let (api, _server, source) = serve(
        &name,
        10,
        |api| api,
        contracts(Traversal::Complete, Finality::LaterTimestamp),
        &[("A", T10_01), ("B", T10_02), ("C", T10_03)],
    )
    .await;
    let (watcher, stop) = watch(tables.clone(), api.clone(), name.clone(), None);
    let (open, opened) = tokio::sync::watch::channel(false);
    let calls = Calls::default();
    let running = builder(
        &source,
        &tables,
        "w1",
        counting(&tables, &name, &calls, &[], Some(("A", opened))),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for_async("A handed out", Duration::from_secs(20), || {
        let calls = calls.clone();
        async move { calls.count("A") == 1 }
    })
    .await;
    // The other attempt: same lease, same version; A's receipt is written as it would have
    // written it, then it closes through 10:01.
    let row = tables.leases.get(&name, "p").await.unwrap().unwrap();
    let ownership = row.ownership().unwrap();
    let stale = row.progress.clone().unwrap_or_default();
    let receipt = EventId::paged(&name, "p", "A");
    tables
        .receipts
        .record(&receipt, &Disposition::Applied, "other")
        .await
        .unwrap();
    let theirs = PagedProgress {
        closed_through: Some(T10_01),
        checkpoint_version: stale.checkpoint_version + 1,
        ..stale.clone()
    };
    assert_eq!(
        tables
            .leases
            .paged_checkpoint(&ownership, &stale, &theirs)
            .await
            .unwrap(),
        shardwise::lease::CheckpointWrite::Written
    );
    open.send(true).unwrap();
    wait_closed(&tables, &name, T10_02).await;
    // A retry from the oldest version loses and changes nothing.
    let now = tables.progress(&name, "p").await;
    let holder = tables
        .leases
        .get(&name, "p")
        .await
        .unwrap()
        .unwrap()
        .ownership()
        .unwrap();
    let older = PagedProgress {
        closed_through: Some(T10_03),
        checkpoint_version: stale.checkpoint_version + 1,
        ..stale.clone()
    };
    assert_eq!(
        tables
            .leases
            .paged_checkpoint(&holder, &stale, &older)
            .await
            .unwrap(),
        shardwise::lease::CheckpointWrite::NotNewer
    );
    assert_eq!(tables.progress(&name, "p").await, now);
    running.shutdown(Duration::from_secs(5)).await;
    stop.store(true, Ordering::SeqCst);
    assert!(watcher.await.expect("the watcher's checks held") >= 1);
    assert!(now.checkpoint_version > theirs.checkpoint_version);
    // A's receipt was the other attempt's; B and C were applied once, whichever attempt ran them.
    assert_counted_once(&tables, &name, &["B", "C"], &calls).await;
    Arc::into_inner(tables).unwrap().drop_all().await;
}

/// A late event at the closed timestamp: under a contract that promised none (a later timestamp
/// proves earlier ones final), it is detected, counted and handled (no receipt has its identity),
/// and `closedThrough` stays. Within a declared lateness bound, the group is not closed until the
/// bound has passed, so an event that arrives late within it is an ordinary new event. With a
/// finality watermark, a group closes once the watermark reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_event_at_the_closed_timestamp_is_counted_or_kept_open_by_the_bound() {
    let live = live_or_skip!();
    let tables = Tables::new(live, APP).await;

    let name = support::unique_name("late-broken");
    let (api, _server, source) = serve(
        &name,
        10,
        |api| api,
        contracts(Traversal::Complete, Finality::LaterTimestamp),
        &[("A", T10_01), ("D", T10_02)],
    )
    .await;
    let calls = Calls::default();
    let running = builder(
        &source,
        &tables,
        "w1",
        counting(&tables, &name, &calls, &[], None),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_closed(&tables, &name, T10_01).await;
    api.push_at("p", "E", T10_01, "late");
    wait_for_async("the late E handled", Duration::from_secs(20), || {
        let calls = calls.clone();
        async move { calls.count("E") == 1 }
    })
    .await;
    running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(counter("shardwise_paged_late_events_total", &name), 1);
    assert_eq!(closed(&tables, &name).await, Some(T10_01));
    assert_counted_once(&tables, &name, &["A", "D", "E"], &calls).await;

    // A lateness bound of 3 s on the wall clock.
    let name = support::unique_name("late-bound");
    let t0 = shardwise_ms(std::time::SystemTime::now());
    let (api, _server, source) = serve(
        &name,
        10,
        |api| api,
        contracts(
            Traversal::Complete,
            Finality::Lateness(Duration::from_secs(3)),
        ),
        &[("A", t0)],
    )
    .await;
    let calls = Calls::default();
    let running = builder(
        &source,
        &tables,
        "w1",
        counting(&tables, &name, &calls, &[], None),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for_async("A handled", Duration::from_secs(20), || {
        let calls = calls.clone();
        async move { calls.count("A") == 1 }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let early = closed(&tables, &name).await;
    assert!(
        early.is_none_or(|c| c < t0),
        "closed through {early:?} within the bound of {t0}"
    );
    api.push_at("p", "E", t0, "late within the bound");
    wait_closed_at_least(&tables, &name, t0).await;
    running.shutdown(Duration::from_secs(5)).await;
    assert!(
        shardwise_ms(std::time::SystemTime::now()) >= t0 + 3_000,
        "closed only after the bound"
    );
    assert_eq!(counter("shardwise_paged_late_events_total", &name), 0);
    assert_counted_once(&tables, &name, &["A", "E"], &calls).await;

    // A finality watermark.
    let name = support::unique_name("watermark");
    let (api, _server, source) = serve(
        &name,
        10,
        |api| api,
        contracts(Traversal::Complete, Finality::Watermark),
        &[("A", T10_01), ("B", T10_02)],
    )
    .await;
    api.watermark("p", T10_01 - 1);
    let calls = Calls::default();
    let running = builder(
        &source,
        &tables,
        "w1",
        counting(&tables, &name, &calls, &[], None),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_closed(&tables, &name, T10_01 - 1).await;
    api.watermark("p", T10_01 + 30_000);
    wait_closed(&tables, &name, T10_01 + 30_000).await;
    running.shutdown(Duration::from_secs(5)).await;
    assert_counted_once(&tables, &name, &["A", "B"], &calls).await;
    tables.drop_all().await;
}

async fn wait_closed_at_least(tables: &Tables, source: &str, through: i64) {
    wait_for_async(
        &format!("{source}: closed through {through} or later"),
        Duration::from_secs(30),
        || async move { closed(tables, source).await.is_some_and(|c| c >= through) },
    )
    .await;
}

/// A log group on moto read by timestamp with `FilterLogEvents`: two streams whose events share
/// milliseconds (three per millisecond in each, and the same milliseconds in both), pages of 4,
/// so ties cross page boundaries and streams. Every event is handled once, by its `eventId`;
/// with a 2 s close horizon the groups close once it has passed; events put
/// after the close are read by the next polls; and an event put late, behind `closedThrough`, is
/// found by the audit, handled and counted as late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_group_read_by_timestamp_with_filter_log_events_skips_nothing() {
    let live = live_or_skip!();
    let logs = logs_client().await;
    let tables = Tables::new(live, APP).await;
    let group = support::unique_name("/shardwise/by-time");
    logs.create_log_group()
        .log_group_name(&group)
        .send()
        .await
        .unwrap();
    for stream in ["web", "worker", "batch"] {
        logs.create_log_stream()
            .log_group_name(&group)
            .log_stream_name(stream)
            .send()
            .await
            .unwrap();
    }
    let base = shardwise_ms(std::time::SystemTime::now()) - 20_000;
    put_logs(&logs, &group, "web", base, "w", 0..25).await;
    put_logs(&logs, &group, "worker", base, "k", 0..25).await;
    // Polls stop 2 s behind the present and close what they read; the audit reads the minute
    // behind `closedThrough` again every 2 s.
    let source = shardwise::paged::CloudWatchLogsFilter::new(logs.clone(), &group)
        .page_limit(4)
        .close_horizon(Duration::from_secs(2))
        .lateness(Duration::from_secs(60))
        .audit_interval(Duration::from_secs(2));
    let name = source.name().to_string();
    let seen: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let handler = {
        let seen = seen.clone();
        move |d: Delivery| {
            seen.lock()
                .unwrap()
                .push((id_of(&d), String::from_utf8_lossy(d.payload()).into_owned()));
            async { Outcome::Ack }
        }
    };
    metrics();
    let running = Consumer::paged(Arc::new(source), APP, handler)
        .worker_id("w1")
        .lanes(2)
        .poll_interval(Duration::from_millis(200))
        .checkpoint_interval(Duration::from_millis(20))
        .lease_store(tables.leases.clone())
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let messages = |seen: &Arc<Mutex<Vec<(String, String)>>>| -> Vec<String> {
        let mut m: Vec<String> = seen
            .lock()
            .unwrap()
            .iter()
            .map(|(_, m)| m.clone())
            .collect();
        m.sort();
        m
    };
    let mut expected: Vec<String> = (0..25)
        .flat_map(|i| [format!("w{i}"), format!("k{i}")])
        .collect();
    expected.sort();
    wait_for_async("the 50 events", Duration::from_secs(20), || {
        let seen = seen.clone();
        let n = expected.len();
        async move { seen.lock().unwrap().len() >= n }
    })
    .await;
    let last = base + 24 / 3;
    let closed_through = || async { tables.progress(&name, &group).await.closed_through };
    wait_for_async(
        "closed through the last put",
        Duration::from_secs(30),
        || async { closed_through().await.is_some_and(|c| c >= last) },
    )
    .await;
    assert_eq!(messages(&seen), expected, "each event once");
    let ids: BTreeSet<String> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|(id, _)| id.clone())
        .collect();
    assert_eq!(ids.len(), 50, "50 distinct eventIds");

    // New events after the close, and a late one behind it (in a third stream).
    let now = shardwise_ms(std::time::SystemTime::now());
    put_logs(&logs, &group, "web", now, "n", 0..4).await;
    put_logs(&logs, &group, "batch", base + 1, "late", 0..1).await;
    for m in ["n0", "n1", "n2", "n3", "late0"] {
        expected.push(m.to_string());
    }
    expected.sort();
    wait_for_async(
        "the new events and the late one",
        Duration::from_secs(20),
        || {
            let seen = seen.clone();
            let n = expected.len();
            async move { seen.lock().unwrap().len() >= n }
        },
    )
    .await;
    wait_for_async(
        "closed through the new events",
        Duration::from_secs(30),
        || async { closed_through().await.is_some_and(|c| c > now) },
    )
    .await;
    running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(messages(&seen), expected, "each event once");
    assert_eq!(counter("shardwise_paged_late_events_total", &name), 1);
    tables.drop_all().await;
}

// ---------------------------------------------------------------------------------------------
// A merged frontier across paged partitions (seed 001)

/// The frontier a running consumer computes, once it says `ok`.
async fn frontier_where(
    running: &shardwise::Running,
    what: &str,
    ok: impl Fn(&shardwise::frontier::Frontier) -> bool,
) -> shardwise::frontier::Frontier {
    let mut watch = running.frontier();
    match tokio::time::timeout(Duration::from_secs(30), watch.wait_for(|f| ok(f))).await {
        Ok(found) => found.expect("the consumer runs").clone(),
        Err(_) => panic!(
            "timed out waiting for the frontier: {what}; it is {:?}",
            *running.frontier().borrow()
        ),
    }
}

/// Seed 001's reasoned example, executed on two partitions of a source read by timestamp with a
/// finality watermark: A complete through 120, B through 90, so the frontier is 90. A retry of an
/// older A page finishes late and loses its compare-and-swap: nothing changes. B proving 110
/// moves the frontier to 110. A stalled B (an event held in its handler) holds the frontier while
/// A goes on. Then a partition C is discovered with an event at 50, before the published frontier:
/// the membership changes to epoch 2 (ordered after 1) and the scalar is withheld until C carries
/// its own coordinate, then it is the minimum over all three. The scalar never passes an event
/// without a durable outcome, and within an epoch it never goes down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reasoned_example_a_120_b_90_then_110_and_a_membership_change() {
    let live = live_or_skip!();
    let tables = Arc::new(Tables::new(live, APP).await);
    let name = support::unique_name("frontier");
    let t = |n: i64| T10_00 + n;
    let contract = contracts(Traversal::Complete, Finality::Watermark);
    let api = EventApi::new(name.clone()).page_size(10).contract(contract);
    for (p, id, at) in [
        ("A", "a1", t(100)),
        ("A", "a2", t(110)),
        ("A", "a3", t(120)),
        ("B", "b1", t(80)),
        ("B", "b2", t(90)),
        ("B", "b3", t(105)),
    ] {
        api.push_at(p, id, at, id.to_string());
    }
    api.watermark("A", t(120));
    api.watermark("B", t(90));
    let server = api.serve("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let source = HttpEvents::new(name.clone(), server.url()).contract(contract);
    let (open, opened) = tokio::sync::watch::channel(false);
    let calls = Calls::default();
    let running = builder(
        &source,
        &tables,
        "w1",
        counting(&tables, &name, &calls, &[], Some(("b4", opened))),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    // B closes 80, then 90 as its events settle: the frontier may show 80 on the way.
    let f = frontier_where(&running, "90", |f| f.scalar >= Some(t(90))).await;
    assert_eq!((f.scalar, f.epoch), (Some(t(90)), 1), "min(120, 90): {f:?}");

    // A retry of an older A page finishes late: its compare-and-swap loses. (A closes 110, then
    // 120, as its events settle: wait for the last.)
    wait_for_async("A through 120", Duration::from_secs(20), || {
        let tables = tables.clone();
        let name = name.clone();
        async move { tables.progress(&name, "A").await.closed_through == Some(t(120)) }
    })
    .await;
    let row = tables.leases.get(&name, "A").await.unwrap().unwrap();
    let a = row.progress.clone().unwrap();
    assert_eq!(a.closed_through, Some(t(120)));
    let older = PagedProgress {
        closed_through: Some(t(110)),
        checkpoint_version: 1,
        ..PagedProgress::default()
    };
    assert_eq!(
        tables
            .leases
            .paged_checkpoint(&row.ownership().unwrap(), &PagedProgress::default(), &older)
            .await
            .unwrap(),
        shardwise::lease::CheckpointWrite::NotNewer
    );
    assert_eq!(tables.progress(&name, "A").await, a, "A unchanged");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(running.frontier().borrow().scalar, Some(t(90)));

    api.watermark("B", t(110));
    let f = frontier_where(&running, "110", |f| f.scalar == Some(t(110))).await;
    assert_eq!(f.epoch, 1);

    // B stalls on b4 (held in its handler); A goes on to 140.
    api.push_at("B", "b4", t(115), "b4");
    api.push_at("A", "a4", t(135), "a4");
    api.watermark("A", t(140));
    api.watermark("B", t(130));
    wait_for_async("A through 140", Duration::from_secs(20), || {
        let tables = tables.clone();
        let name = name.clone();
        async move { tables.progress(&name, "A").await.closed_through == Some(t(140)) }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    let stalled = running.frontier().borrow().clone();
    assert_eq!(stalled.scalar, Some(t(110)), "B holds it: {stalled:?}");
    open.send(true).unwrap();
    let f = frontier_where(&running, "130", |f| f.scalar == Some(t(130))).await;
    assert_eq!(f.epoch, 1);

    // C appears with an event before the frontier.
    api.push_at("C", "c1", t(50), "c1");
    let f = frontier_where(&running, "C joins", |f| f.members.len() == 3).await;
    assert_eq!(f.epoch, 2, "a membership change is the next epoch");
    assert_eq!(f.scalar, None, "C has no coordinate yet: {f:?}");
    let published = tables.leases.membership(&name).await.unwrap().unwrap();
    assert_eq!(published.epoch, 2);
    assert_eq!(published.members, ["A", "B", "C"]);
    api.watermark("C", t(60));
    let f = frontier_where(&running, "C covered", |f| f.scalar.is_some()).await;
    assert_eq!((f.scalar, f.epoch), (Some(t(60)), 2));
    running.shutdown(Duration::from_secs(5)).await;
    assert_counted_once(
        &tables,
        &name,
        &["a1", "a2", "a3", "a4", "b1", "b2", "b3", "b4", "c1"],
        &calls,
    )
    .await;
    Arc::into_inner(tables).unwrap().drop_all().await;
}

/// Partitions of continuation tokens whose pages certify a watermark: it is promoted only by the
/// page barrier, once every event of the page and before it is durable (held back while one is
/// in its handler); replayed pages, empty pages and a lost barrier answer neither lower nor skip
/// it; a quiet page that only raises it moves it; and a partition whose pages certify nothing
/// leaves no scalar, only the vector (no frontier is made up from tokens or positions).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_watermarks_are_promoted_by_the_barrier_and_never_made_up() {
    let live = live_or_skip!();
    let tables = Arc::new(Tables::new(live, APP).await);
    let name = support::unique_name("page-watermarks");
    let api = EventApi::new(name.clone()).page_size(2);
    for n in 0..6 {
        api.push("P", format!("p{n}"));
        api.push("Q", format!("q{n}"));
    }
    api.watermark("P", T10_01);
    for script in [
        shardwise::testing::Script::ReplayPrevious,
        shardwise::testing::Script::EmptyAdvancing,
        shardwise::testing::Script::Overlap(1),
    ] {
        api.script("P", script);
    }
    let server = api.serve("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let source = HttpEvents::new(name.clone(), server.url());
    let crash = Crash::at(CrashPoint::Barrier, 1, When::LoseAnswer);
    let (open, opened) = tokio::sync::watch::channel(false);
    let calls = Calls::default();
    let running = builder(
        &source,
        &tables,
        "w1",
        counting(&tables, &name, &calls, &[], Some(("P-1", opened))),
    )
    .lease_store(crash.leases(tables.leases.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for_async("P-1 in its handler", Duration::from_secs(20), || {
        let calls = calls.clone();
        async move { calls.count("P-1") == 1 }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        tables.progress(&name, "P").await.closed_through,
        None,
        "fetched with the watermark, but its first page has not passed the barrier"
    );
    open.send(true).unwrap();
    wait_for_async("P through 10:01", Duration::from_secs(20), || {
        let tables = tables.clone();
        let name = name.clone();
        async move { tables.progress(&name, "P").await.closed_through == Some(T10_01) }
    })
    .await;
    let f = frontier_where(&running, "P covered", |f| f.missing == ["Q"]).await;
    assert_eq!(f.scalar, None, "Q certifies nothing: {f:?}");
    assert_eq!(f.members.len(), 2, "the vector is there");
    // A quiet P page that only raises the watermark; Q starts certifying one.
    api.watermark("P", T10_03);
    api.watermark("Q", T10_02);
    api.push("Q", "q6");
    let f = frontier_where(&running, "min(P, Q)", |f| f.scalar == Some(T10_02)).await;
    assert_eq!(f.epoch, 1);
    wait_for_async("P through 10:03", Duration::from_secs(20), || {
        let tables = tables.clone();
        let name = name.clone();
        async move { tables.progress(&name, "P").await.closed_through == Some(T10_03) }
    })
    .await;
    running.shutdown(Duration::from_secs(5)).await;
    for n in 1..=6 {
        assert_eq!(calls.count(&format!("P-{n}")), 1, "P-{n}");
    }
    Arc::into_inner(tables).unwrap().drop_all().await;
}

/// A seek of a source read by timestamp to a time closes each partition through the millisecond
/// before it: the next poll reads every event at or after that time again (nothing before it),
/// and the groups close again as they are proven. A seek to the trim horizon removes
/// `closedThrough`: everything is read again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seek_to_a_time_reads_again_from_that_timestamp() {
    let live = live_or_skip!();
    let tables = Tables::new(live, APP).await;
    let name = support::unique_name("seek-by-time");
    let (api, _server, source) = serve(
        &name,
        2,
        |api| api,
        contracts(Traversal::Complete, Finality::LaterTimestamp),
        &[("A", T10_01), ("B", T10_02), ("C", T10_03)],
    )
    .await;
    let calls = Calls::default();
    let run = || async {
        builder(
            &source,
            &tables,
            "w1",
            counting(&tables, &name, &calls, &[], None),
        )
        .build()
        .unwrap()
        .run()
        .await
        .unwrap()
    };
    let running = run().await;
    wait_closed(&tables, &name, T10_02).await;
    running.shutdown(Duration::from_secs(5)).await;
    let before = tables.progress(&name, "p").await;

    let moved = shardwise::seek::seek_paged(
        tables.leases.as_ref(),
        &source,
        &shardwise::seek::SeekTarget::Timestamp(
            std::time::UNIX_EPOCH + Duration::from_millis(T10_02 as u64),
        ),
    )
    .await
    .unwrap();
    assert_eq!(moved.moved, ["p"]);
    let sought = tables.progress(&name, "p").await;
    assert_eq!(sought.closed_through, Some(T10_02 - 1));
    assert!(sought.checkpoint_version > before.checkpoint_version);

    let running = run().await;
    wait_closed(&tables, &name, T10_02).await;
    running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(
        (calls.count("A"), calls.count("B"), calls.count("C")),
        (1, 2, 2),
        "B and C read again, A not"
    );
    assert!(
        api.polls("p").contains(&Some(T10_02 - 1)),
        "a poll strictly after the millisecond before the seek's time"
    );
    assert_counted_once(&tables, &name, &["A", "B", "C"], &calls).await;

    shardwise::seek::seek_paged(
        tables.leases.as_ref(),
        &source,
        &shardwise::seek::SeekTarget::TrimHorizon,
    )
    .await
    .unwrap();
    assert_eq!(tables.progress(&name, "p").await.closed_through, None);
    tables.drop_all().await;
}
