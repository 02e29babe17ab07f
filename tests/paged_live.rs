//! Paged sources live: the scripted event API behind its real HTTP server, read by the consumer
//! through `HttpEvents`, with the lease table and the receipt ledger on the DynamoDB emulator.
//!
//! Seed 003's validation list, executed: a crash at each point of a page's life (before and after
//! each effect commit, before and after a durable quarantine receipt, before and after each page
//! barrier and each progress write), then a restart; overlapping, replayed, empty and stuck pages;
//! a lost barrier answer; a stale concurrent attempt with the same version; a reversible hold that
//! blocks the barrier until it is made terminal; a failing event retried in place until it
//! succeeds, or quarantined at its cap. After each: no event skipped, `appliedPosition`
//! never above an event without a durable outcome and never lowered, and every effect applied once.

#[path = "support/logs.rs"]
mod logs;
#[path = "support/recorder.rs"]
mod recorder;
mod support;
#[path = "support/tables.rs"]
mod tables;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::calls::{Calls, id_of};
use support::wait::wait_for_async;

use futures::StreamExt;
use logs::{logs_client, put_logs};
use shardwise::lease::{LeaseSettings, LeaseStore};
use shardwise::paged::{CloudWatchLogs, PagePosition, PagedProgress, PagedSource};
use shardwise::receipts::{Disposition, Effect, EventId, ReceiptStore, key};
use shardwise::testing::{Crash, CrashPoint, EventApi, HttpEvents, Script, When};
use shardwise::{Consumer, ConsumerBuilder, Delivery, Outcome};
use tables::Tables;

const APP: &str = "paged-live";
static LOGS: std::sync::OnceLock<recorder::Logs> = std::sync::OnceLock::new();

/// The warnings of this test binary, kept to print when a case fails.
fn logs() -> &'static recorder::Logs {
    LOGS.get_or_init(|| {
        let logs = recorder::Logs::default();
        let _ = tracing::subscriber::set_global_default(logs.clone());
        logs
    })
}

impl Tables {
    /// Waits until partition `p` of `source` has applied through position `n`.
    async fn wait_applied(&self, source: &str, n: u64, limit: Duration) {
        wait_for_async(&format!("{source}: applied {n}"), limit, || async move {
            applied(&self.progress(source, "p").await) == n
        })
        .await;
    }

    /// The positions (1..=n) whose events have a terminal receipt.
    async fn terminal(&self, source: &str, partition: &str, n: u64) -> Vec<u64> {
        let mut done = Vec::new();
        for position in 1..=n {
            let event = EventId::paged(source, partition, &format!("{partition}-{position}"));
            if self.receipts.seen(&event).await.unwrap() {
                done.push(position);
            }
        }
        done
    }
}

fn applied(progress: &PagedProgress) -> u64 {
    progress
        .applied_position
        .as_ref()
        .and_then(PagePosition::as_u64)
        .unwrap_or(0)
}

fn settings() -> LeaseSettings {
    LeaseSettings::default()
        .lease_duration(Duration::from_millis(2_000))
        .scan_interval(Duration::from_millis(200))
}

fn builder<H: shardwise::Handler>(
    source: &HttpEvents,
    tables: &Tables,
    worker: &str,
    handler: H,
) -> ConsumerBuilder<H> {
    Consumer::paged(Arc::new(source.clone()), APP, handler)
        .worker_id(worker)
        .lanes(1)
        .poll_interval(Duration::from_millis(200))
        .checkpoint_interval(Duration::from_millis(20))
        .hold_poll_interval(Duration::from_millis(100))
        .lease_settings(settings())
        .lease_store(tables.leases.clone())
        .receipts(tables.receipts.clone())
}

/// Watches a partition's row while a case runs: the applied position and the version never go
/// down, and every event at or below the applied position has a terminal receipt when the row is
/// read (receipts are durable before the progress that counts them).
fn watch(tables: Arc<Tables>, source: String) -> (tokio::task::JoinHandle<u32>, Arc<AtomicBool>) {
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let handle = tokio::spawn(async move {
        let (mut last_applied, mut last_version, mut reads) = (0, 0, 0);
        while !stopped.load(Ordering::SeqCst) {
            let progress = tables.progress(&source, "p").await;
            let now = applied(&progress);
            assert!(
                now >= last_applied,
                "{source}: applied went down from {last_applied} to {now}"
            );
            assert!(
                progress.checkpoint_version >= last_version,
                "{source}: version went down"
            );
            // Terminal receipts are never removed: what was checked stays checked.
            for position in last_applied + 1..=now {
                let event = EventId::paged(&source, "p", &format!("p-{position}"));
                assert!(
                    tables.receipts.seen(&event).await.unwrap(),
                    "{source}: applied {now} passes {position}, which has no durable outcome"
                );
            }
            (last_applied, last_version) = (now, progress.checkpoint_version);
            reads += 1;
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        reads
    });
    (handle, stop)
}

/// The handler of the crash cases: each event adds 1 to its counter with its receipt, except the
/// poison one (position 6), which is quarantined. The third event of each page takes `slow`, so
/// the first two are written as a settled prefix before the page completes: long enough, for
/// the cases that die at that write, for the write before it to be answered by a loaded moto
/// too (at 300 ms the whole page now and then completed first, and the crash point never came).
fn counting(counts: String, case: String, calls: Calls, slow: Duration) -> impl shardwise::Handler {
    move |d: Delivery| {
        let (counts, case, calls) = (counts.clone(), case.clone(), calls.clone());
        async move {
            calls.push("", &d);
            let third = d
                .page_position()
                .and_then(|p| p.as_u64())
                .is_some_and(|p| p % 4 == 3);
            tokio::time::sleep(if third {
                slow
            } else {
                Duration::from_millis(15)
            })
            .await;
            if d.payload().as_ref() == b"poison" {
                return Outcome::Quarantine("poison".into());
            }
            Outcome::Apply(
                Effect::update(&counts, key("id", format!("{case}/{}", id_of(&d))))
                    .add("count", 1)
                    .into(),
            )
        }
    }
}

const EVENTS: u64 = 12;

/// One crash case: its own source (12 events on partition `p`, pages of 4, the 6th is poison)
/// on the shared tables. The first worker dies at `crash`; the row is checked as it left it; a
/// second worker finishes. Then every event has a terminal receipt, each applied effect counts 1,
/// the poison one none, and the applied position is 12.
async fn crash_case(tables: Arc<Tables>, point: CrashPoint, nth: u32, when: When) -> String {
    let name = format!("crash-{point:?}-{nth}-{when:?}").to_lowercase();
    // Effect commits and receipts are chosen by event (several may commit together); barriers
    // and progress writes by their number.
    let crash = match point {
        CrashPoint::Commit | CrashPoint::Quarantine => {
            Crash::on_event(point, EventId::paged(&name, "p", &format!("p-{nth}")), when)
        }
        _ => Crash::on_position(point, PagePosition::from_u64(nth.into()), when),
    };
    let api = EventApi::new(name.clone()).page_size(4);
    for n in 1..=EVENTS {
        api.push("p", if n == 6 { "poison" } else { "fine" });
    }
    let server = api.serve("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let source = HttpEvents::new(name.clone(), server.url());
    let (watcher, stop) = watch(tables.clone(), name.clone());
    let calls = Calls::default();

    let slow = Duration::from_millis(if point == CrashPoint::Progress {
        2_000
    } else {
        300
    });
    let first = builder(
        &source,
        &tables,
        "w1",
        counting(tables.counts.clone(), name.clone(), calls.clone(), slow),
    )
    .lease_store(crash.leases(tables.leases.clone()))
    .receipts(crash.receipts(tables.receipts.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(30), crash.wait())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{name}: the crash point was never reached ({} writes of its kind)\n{}",
                crash.writes(),
                LOGS.get().map(|l| l.text()).unwrap_or_default()
            )
        });
    eprintln!("{name}: crashed after {:?}", started.elapsed());
    first.abort();

    // As the dead worker left it: nothing above the applied position lacks a durable outcome.
    let left = tables.progress(&name, "p").await;
    let done = tables.terminal(&name, "p", EVENTS).await;
    assert!(
        (1..=applied(&left)).all(|p| done.contains(&p)),
        "{name}: left applied {} with only {done:?} durable",
        applied(&left)
    );

    let second = builder(
        &source,
        &tables,
        "w2",
        counting(tables.counts.clone(), name.clone(), calls.clone(), slow),
    )
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    tables
        .wait_applied(&name, EVENTS, Duration::from_secs(40))
        .await;
    second.shutdown(Duration::from_secs(5)).await;
    stop.store(true, Ordering::SeqCst);
    let reads = watcher.await.expect("the watcher's checks held");
    assert!(reads >= 1, "{name}: the row was watched");

    assert_eq!(
        tables.terminal(&name, "p", EVENTS).await.len() as u64,
        EVENTS,
        "{name}: an event was skipped"
    );
    for n in 1..=EVENTS {
        let id = format!("p-{n}");
        let expected = (n != 6).then_some(1);
        assert_eq!(
            tables.count(&format!("{name}/{id}")).await,
            expected,
            "{name}: {id}'s effect (handled {} times)",
            calls.count(&id)
        );
    }
    name
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_every_point_of_a_page_loses_nothing_and_applies_each_effect_once() {
    let live = live_or_skip!();
    logs();
    let tables = Arc::new(Tables::new(live, APP).await);
    let mut cases = Vec::new();
    // Before and after the commit of each event's effects (the 6th is quarantined instead).
    for n in (1..=EVENTS as u32).filter(|n| *n != 6) {
        cases.push((CrashPoint::Commit, n, When::Before));
        cases.push((CrashPoint::Commit, n, When::After));
    }
    // Before and after the durable quarantine receipt of the poison event.
    cases.push((CrashPoint::Quarantine, 6, When::Before));
    cases.push((CrashPoint::Quarantine, 6, When::After));
    // Before and after the barrier of each page (pages of four: the barrier passing 4, 8, 12).
    for end in [4, 8, 12] {
        cases.push((CrashPoint::Barrier, end, When::Before));
        cases.push((CrashPoint::Barrier, end, When::After));
    }
    // Before and after a write of the settled prefix within a page (the third event of each page
    // is slow, so the first two are written before the page completes).
    for prefix in [2, 6] {
        cases.push((CrashPoint::Progress, prefix, When::Before));
        cases.push((CrashPoint::Progress, prefix, When::After));
    }
    let total = cases.len();
    let done: Vec<String> = futures::stream::iter(cases)
        .map(|(point, nth, when)| crash_case(tables.clone(), point, nth, when))
        .buffer_unordered(4)
        .collect()
        .await;
    assert_eq!(done.len(), total);
    Arc::into_inner(tables).unwrap().drop_all().await;
}

/// The handler of the retry cases: each event adds 1 to its counter with its receipt, except the
/// failing one (position 5), which answers `Retry` while its downstream is down: for 300 ms after
/// its first call, or for good.
fn failing_at_5(
    counts: String,
    case: String,
    calls: Calls,
    down_for: Option<Duration>,
) -> impl shardwise::Handler {
    let first_call: Arc<Mutex<Option<Instant>>> = Arc::default();
    move |d: Delivery| {
        let (counts, case, calls) = (counts.clone(), case.clone(), calls.clone());
        let first_call = first_call.clone();
        async move {
            calls.push("", &d);
            if id_of(&d) == "p-5" {
                let since = *first_call.lock().unwrap().get_or_insert_with(Instant::now);
                if down_for.is_none_or(|down| since.elapsed() < down) {
                    return Outcome::Retry;
                }
            }
            Outcome::Apply(
                Effect::update(&counts, key("id", format!("{case}/{}", id_of(&d))))
                    .add("count", 1)
                    .into(),
            )
        }
    }
}

/// Seed 003, rule 1, on the default path and with a cap, live: an event whose downstream fails
/// for 300 ms (three attempts at 0, 100 and 300 ms) runs again in place until it succeeds, with
/// no cap declared; with `max_attempts(3)` and an event that never succeeds, the third failure
/// records a `quarantined` receipt. The row watcher checks throughout that the applied position
/// never passes an event without a terminal receipt; at the end every counter is exactly 1 (none
/// for the quarantined event).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_event_retries_in_place_until_it_succeeds_or_is_quarantined_at_its_cap() {
    let live = live_or_skip!();
    logs();
    let tables = Arc::new(Tables::new(live, APP).await);
    for capped in [false, true] {
        let name = support::unique_name(if capped {
            "retry-capped"
        } else {
            "retry-default"
        });
        let (_api, _server, source) = serve(&name, EVENTS, 4).await;
        let (watcher, stop) = watch(tables.clone(), name.clone());
        let calls = Calls::default();
        let down_for = (!capped).then_some(Duration::from_millis(300));
        let mut consumer = builder(
            &source,
            &tables,
            "w1",
            failing_at_5(tables.counts.clone(), name.clone(), calls.clone(), down_for),
        )
        .lanes(4);
        if capped {
            consumer = consumer.max_attempts(std::num::NonZeroU32::new(3).unwrap());
        }
        let running = consumer.build().unwrap().run().await.unwrap();
        tables
            .wait_applied(&name, EVENTS, Duration::from_secs(30))
            .await;
        running.shutdown(Duration::from_secs(5)).await;
        stop.store(true, Ordering::SeqCst);
        let reads = watcher.await.expect("the watcher's checks held");
        assert!(reads >= 1, "{name}: the row was watched");

        let tries = calls.count("p-5");
        let receipt = tables
            .receipts
            .get(&EventId::paged(&name, "p", "p-5"))
            .await
            .unwrap()
            .expect("p-5 has a receipt");
        if capped {
            assert_eq!(tries, 3, "{name}: three attempts, then spent");
            let Disposition::Quarantined(reason) = &receipt.disposition else {
                panic!("{name}: quarantined, not {:?}", receipt.disposition);
            };
            assert!(reason.contains("attempts spent: 3 of 3"), "{reason}");
        } else {
            assert!(
                tries >= 3,
                "{name}: handled until it succeeded ({tries} times)"
            );
            assert_eq!(receipt.disposition, Disposition::Applied);
        }
        for n in 1..=EVENTS {
            let id = format!("p-{n}");
            let expected = (!(capped && n == 5)).then_some(1);
            assert_eq!(
                tables.count(&format!("{name}/{id}")).await,
                expected,
                "{name}: {id}'s effect (handled {} times)",
                calls.count(&id)
            );
        }
        eprintln!("{name}: p-5 handled {tries} times");
    }
    Arc::into_inner(tables).unwrap().drop_all().await;
}

/// Issue 23, item 3: an effect DynamoDB refuses for the whole request (an update that would grow
/// an item past 400 KB, which no check before the write can see) sits in a ledger batch with
/// others. The batch is split, the others commit, and the event it is for ends quarantined by
/// receipt (no cap, no dead letter: the ledger is its durable outcome); the barrier passes every
/// event only once each has its outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_effect_the_store_refuses_as_a_whole_is_quarantined_and_its_batch_commits() {
    let live = live_or_skip!();
    logs();
    let tables = Arc::new(Tables::new(live, APP).await);
    let name = support::unique_name("too-big");
    let big = format!("{name}/big");
    tables
        .live
        .dynamodb
        .put_item()
        .table_name(&tables.counts)
        .item(
            "id",
            aws_sdk_dynamodb::types::AttributeValue::S(big.clone()),
        )
        .item(
            "blob",
            aws_sdk_dynamodb::types::AttributeValue::S("x".repeat(300_000)),
        )
        .send()
        .await
        .expect("the 300 KB item");
    let (_api, _server, source) = serve(&name, EVENTS, 12).await;
    let (watcher, stop) = watch(tables.clone(), name.clone());
    let calls = Calls::default();
    let (counts, case, seen) = (tables.counts.clone(), name.clone(), calls.clone());
    let handler = move |d: Delivery| {
        let (counts, case, calls) = (counts.clone(), case.clone(), seen.clone());
        async move {
            calls.push("", &d);
            let id = id_of(&d);
            let mut effects = shardwise::receipts::Effects::new()
                .with(Effect::update(&counts, key("id", format!("{case}/{id}"))).add("count", 1));
            if id == "p-5" {
                effects.push(
                    Effect::update(&counts, key("id", format!("{case}/big")))
                        .set("more", "y".repeat(200_000)),
                );
            }
            Outcome::Apply(effects)
        }
    };
    let running = builder(&source, &tables, "w1", handler)
        .lanes(8)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    tables
        .wait_applied(&name, EVENTS, Duration::from_secs(60))
        .await;
    running.shutdown(Duration::from_secs(5)).await;
    stop.store(true, Ordering::SeqCst);
    watcher.await.expect("the watcher's checks held");
    let receipt = tables
        .receipts
        .get(&EventId::paged(&name, "p", "p-5"))
        .await
        .unwrap()
        .expect("p-5 has a receipt");
    let Disposition::Quarantined(reason) = &receipt.disposition else {
        panic!("quarantined, not {:?}", receipt.disposition);
    };
    assert!(reason.contains("ValidationException"), "{reason}");
    eprintln!(
        "{name}: a batch was split: {}",
        logs().text().contains("refused as a whole")
    );
    for n in 1..=EVENTS {
        let id = format!("p-{n}");
        let expected = (n != 5).then_some(1);
        assert_eq!(
            tables.count(&format!("{name}/{id}")).await,
            expected,
            "{id}'s effect (handled {} times)",
            calls.count(&id)
        );
    }
    Arc::into_inner(tables).unwrap().drop_all().await;
}

/// A consumer on one source of `n` events (partition `p`, pages of `page`) over HTTP.
async fn serve(
    name: &str,
    n: u64,
    page: usize,
) -> (EventApi, shardwise::testing::EventServer, HttpEvents) {
    let api = EventApi::new(name.to_string()).page_size(page);
    for _ in 0..n {
        api.push("p", "x");
    }
    let server = api.serve("127.0.0.1:0".parse().unwrap()).await.unwrap();
    let source = HttpEvents::new(name.to_string(), server.url());
    (api, server, source)
}

fn acking(calls: Calls) -> impl shardwise::Handler {
    move |d: Delivery| {
        calls.push("", &d);
        async { Outcome::Ack }
    }
}

/// Overlapping pages, a page served twice, empty pages with advancing tokens, a token that does
/// not advance, lost answers and throttling, over HTTP: every event once; caught up, the stuck
/// token is fetched after the poll interval, doubled with each unchanged answer (not in a spin).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misbehaving_pages_over_http_neither_lose_nor_repeat_events() {
    let live = live_or_skip!();
    let tables = Tables::new(live, APP).await;
    let name = support::unique_name("misbehaving");
    let (api, _server, source) = serve(&name, 40, 5).await;
    for script in [
        Script::Overlap(3),
        Script::EmptyAdvancing,
        Script::ReplayPrevious,
        Script::LoseResponse,
        Script::Unchanged,
        Script::Throttle,
        Script::EmptyAdvancing,
        Script::EmptyAdvancing,
        Script::Overlap(7),
        Script::ReplayPrevious,
    ] {
        api.script("p", script);
    }
    let calls = Calls::default();
    let running = builder(&source, &tables, "w1", acking(calls.clone()))
        .lanes(4)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    tables
        .wait_applied(&name, 40, Duration::from_secs(30))
        .await;
    let before = api.fetches();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let fetches = api.fetches() - before;
    running.shutdown(Duration::from_secs(5)).await;
    for n in 1..=40 {
        assert_eq!(calls.count(&format!("p-{n}")), 1, "p-{n}");
    }
    assert_eq!(calls.all().len(), 40);
    // 200 ms, 400, 800, 1,600...: 2 to 6 in 2 s (before the idle bound: 5 to 15, one a poll).
    assert!(
        (2..=6).contains(&fetches),
        "{fetches} fetches of a stuck token in 2 s at a 200 ms poll interval"
    );
    tables.drop_all().await;
}

/// A barrier is stored but its answer is lost: the worker rereads the row, finds what it meant to
/// store, and goes on. No event is handled twice and no version is skipped or repeated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_barrier_answer_is_found_stored_and_the_partition_goes_on() {
    let live = live_or_skip!();
    let tables = Tables::new(live, APP).await;
    let name = support::unique_name("lost-answer");
    let (_api, _server, source) = serve(&name, 8, 4).await;
    let lose = Crash::on_position(
        CrashPoint::Barrier,
        PagePosition::from_u64(4),
        When::LoseAnswer,
    );
    let calls = Calls::default();
    // Page 2 settles before the write is tried again (300 ms later), so the next write is another
    // one (page 2's barrier), conditioned on what the worker believed stored: it must recognise
    // the lost write in the row rather than call its own attempt stale.
    let slow = {
        let calls = calls.clone();
        move |d: Delivery| {
            calls.push("", &d);
            let late = d.page_position().and_then(PagePosition::as_u64) > Some(4);
            async move {
                if late {
                    tokio::time::sleep(Duration::from_millis(40)).await;
                }
                Outcome::Ack
            }
        }
    };
    let running = builder(&source, &tables, "w1", slow)
        .checkpoint_interval(Duration::from_millis(300))
        .lease_store(lose.leases(tables.leases.clone()))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    tables.wait_applied(&name, 8, Duration::from_secs(20)).await;
    running.shutdown(Duration::from_secs(5)).await;
    assert!(
        lose.writes() >= 1 && !lose.crashed(),
        "the answer was lost, the worker lived"
    );
    let progress = tables.progress(&name, "p").await;
    // One barrier write per promotion (pages that settle together are promoted at once), and the
    // lost one was not written again as a second version.
    assert!(
        (1..=2).contains(&progress.checkpoint_version),
        "{progress:?}"
    );
    for n in 1..=8 {
        assert_eq!(calls.count(&format!("p-{n}")), 1, "p-{n}");
    }
    tables.drop_all().await;
}

/// Two attempts of one partition with the same version: while this worker handles page 1, another
/// attempt (the test, with the same lease) passes page 1's barrier first. This worker's write then
/// loses the compare-and-swap, rereads, sees newer progress, and stops its attempt without
/// overwriting it; the partition goes on from the stored progress. Nothing is lowered or skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_attempt_with_the_same_version_rereads_and_never_overwrites_newer_progress() {
    let live = live_or_skip!();
    let tables = Tables::new(live, APP).await;
    let name = support::unique_name("stale");
    let (api, _server, source) = serve(&name, 8, 4).await;
    let (open, opened) = tokio::sync::watch::channel(false);
    let calls = Calls::default();
    let handler = {
        let calls = calls.clone();
        move |d: Delivery| {
            calls.push("", &d);
            let mut opened = opened.clone();
            async move {
                if id_of(&d) == "p-2" {
                    let _ = opened.wait_for(|open| *open).await;
                }
                Outcome::Ack
            }
        }
    };
    let running = builder(&source, &tables, "w1", handler)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for_async("p-2 handed out", Duration::from_secs(20), || {
        let calls = calls.clone();
        async move { calls.count("p-2") == 1 }
    })
    .await;
    // The other attempt: same lease, same version, it passes page 1's barrier first.
    let row = tables.leases.get(&name, "p").await.unwrap().unwrap();
    let ownership = row.ownership().unwrap();
    let expected = row.progress.clone().unwrap_or_default();
    assert_eq!(expected.checkpoint_version, 0);
    let theirs = PagedProgress {
        resume_cursor: Some(api.cursor("p", 4)),
        applied_position: Some(PagePosition::from_u64(4)),
        checkpoint_version: 1,
        closed_through: None,
        receipts_since: None,
    };
    assert_eq!(
        tables
            .leases
            .paged_checkpoint(&ownership, &expected, &theirs)
            .await
            .unwrap(),
        shardwise::lease::CheckpointWrite::Written
    );
    open.send(true).unwrap();
    // This attempt's writes lose; the progress is never lowered nor replaced by the stale one.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = theirs.clone();
    loop {
        let now = tables.progress(&name, "p").await;
        assert!(
            now.checkpoint_version >= last.checkpoint_version,
            "{now:?} after {last:?}"
        );
        assert!(applied(&now) >= applied(&last), "{now:?} after {last:?}");
        if now.checkpoint_version == 1 {
            assert_eq!(
                now, theirs,
                "the stale attempt overwrote the newer progress"
            );
        }
        last = now;
        if applied(&last) == 8 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the partition never went on: {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(
        last.checkpoint_version, 2,
        "the next attempt passed page 2 from theirs"
    );
    // Page 1 was read once: the next attempt started from their cursor, not from the stale one.
    // p-1 and p-2 were handed out before their progress was written. p-3 and p-4 at most once:
    // the stale attempt stops at its first write that loses, and when p-1's applied position is
    // written late (after theirs, while p-2 still waits: under load in CI at 60b7263; with a
    // 400 ms checkpoint interval and the open held 900 ms every time) it stops before its lane
    // reaches p-3. Their progress says page 1 is done, so nobody reads p-3 and p-4 again.
    // Page 2 may have been handed out by the stale attempt before its write lost (it recorded
    // nothing of it), so at least once.
    for n in 1..=8 {
        let count = calls.count(&format!("p-{n}"));
        let expected = match n {
            1 | 2 => count == 1,
            3 | 4 => count <= 1,
            _ => count >= 1,
        };
        assert!(expected, "p-{n} handled {count} times");
    }
    tables.drop_all().await;
}

/// A reversible hold blocks the barrier: the applied position stops before the held event and the
/// page's cursor stays pending, though later events settled; an operator's terminal receipt lets
/// both pass, and the held event is not handled again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reversible_hold_blocks_the_barrier_until_it_is_made_terminal() {
    let live = live_or_skip!();
    let tables = Tables::new(live, APP).await;
    let name = support::unique_name("hold");
    let (_api, _server, source) = serve(&name, 8, 4).await;
    let calls = Calls::default();
    let handler = {
        let calls = calls.clone();
        move |d: Delivery| {
            calls.push("", &d);
            let held = id_of(&d) == "p-3";
            async move {
                if held {
                    Outcome::Hold("operator review".into())
                } else {
                    Outcome::Ack
                }
            }
        }
    };
    let running = builder(&source, &tables, "w1", handler)
        .lanes(4)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let p3 = EventId::paged(&name, "p", "p-3");
    wait_for_async("the hold and p-4", Duration::from_secs(20), || {
        let (tables, p3, calls) = (&tables, &p3, calls.clone());
        async move { calls.count("p-4") == 1 && tables.receipts.get(p3).await.unwrap().is_some() }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let blocked = tables.progress(&name, "p").await;
    assert_eq!(
        applied(&blocked),
        2,
        "p-4 settled, but p-3 holds the prefix"
    );
    assert_eq!(
        blocked.checkpoint_version, 0,
        "page 1's cursor is still pending"
    );
    tables
        .receipts
        .record(
            &p3,
            &Disposition::Quarantined("bad schema".into()),
            "operator",
        )
        .await
        .unwrap();
    tables.wait_applied(&name, 8, Duration::from_secs(20)).await;
    running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(
        calls.count("p-3"),
        1,
        "settled by its receipt, not handled again"
    );
    let version = tables.progress(&name, "p").await.checkpoint_version;
    assert!(
        (1..=2).contains(&version),
        "one or two barriers after the hold: {version}"
    );
    tables.drop_all().await;
}

// ---------------------------------------------------------------------------------------------
// CloudWatch Logs on moto

/// Every (partition, id, message) a handler saw.
#[derive(Debug, Default, Clone)]
struct Seen(Arc<Mutex<Vec<(String, String, String)>>>);

impl Seen {
    fn handler(&self) -> impl shardwise::Handler {
        let seen = self.clone();
        move |d: Delivery| {
            seen.0.lock().unwrap().push((
                d.shard().to_string(),
                id_of(&d),
                String::from_utf8_lossy(d.payload()).into_owned(),
            ));
            async { Outcome::Ack }
        }
    }
    fn messages(&self, partition: &str) -> Vec<String> {
        let all = self.0.lock().unwrap();
        all.iter()
            .filter(|(p, ..)| p == partition)
            .map(|(.., m)| m.clone())
            .collect()
    }
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// A log group on moto read as a paged source: every log stream a partition, pages of 4 through
/// `nextForwardToken`, events sharing a millisecond told apart, the same token at the end of a
/// stream (caught up) followed again when new events arrive, a crash and a restart that skip
/// nothing, and a seek to a time that reads again from the first event at or after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cloudwatch_log_group_is_read_stream_by_stream_without_skipping() {
    let live = live_or_skip!();
    logs();
    let logs = logs_client().await;
    let tables = Tables::new(live, APP).await;
    let group = support::unique_name("/shardwise/paged");
    logs.create_log_group()
        .log_group_name(&group)
        .send()
        .await
        .unwrap();
    let streams = ["web", "2026/12/01/[$LATEST]worker"];
    for stream in streams {
        logs.create_log_stream()
            .log_group_name(&group)
            .log_stream_name(stream)
            .send()
            .await
            .unwrap();
    }
    // A minute ago: CloudWatch refuses events older than 14 days.
    let base = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
        - 60_000;
    for stream in streams {
        put_logs(&logs, &group, stream, base, "m", 0..25).await;
    }
    let source = CloudWatchLogs::new(logs.clone(), &group).page_limit(4);
    assert_eq!(source.name(), format!("logs:{group}"));
    assert_eq!(source.partitions().await.unwrap(), {
        let mut s: Vec<String> = streams.iter().map(|s| s.to_string()).collect();
        s.sort();
        s
    });
    let seen = Seen::default();
    let run = |worker: &str| {
        Consumer::paged(Arc::new(source.clone()), APP, seen.handler())
            .worker_id(worker)
            .lanes(2)
            .poll_interval(Duration::from_millis(200))
            .checkpoint_interval(Duration::from_millis(20))
            .lease_settings(settings())
            .lease_store(tables.leases.clone())
            .build()
            .unwrap()
            .run()
    };
    let w1 = run("w1").await.unwrap();
    let expect =
        |range: std::ops::Range<i64>| -> Vec<String> { range.map(|i| format!("m{i}")).collect() };
    let wait_all = |n: usize| {
        let seen = seen.clone();
        async move {
            wait_for_async(&format!("{n} events"), Duration::from_secs(30), || {
                let seen = seen.clone();
                async move { seen.len() >= n }
            })
            .await
        }
    };
    wait_all(50).await;
    for stream in streams {
        let mut got = seen.messages(stream);
        got.sort_by_key(|m| m[1..].parse::<u32>().unwrap());
        assert_eq!(got, expect(0..25), "{stream}: each event once");
    }
    // Ties: three events per millisecond, one batch (one ingestion time), each named by its
    // message (no line repeats: occurrence 0).
    let handled = seen.0.lock().unwrap().clone();
    let ids: Vec<String> = handled.iter().map(|(_, id, _)| id.clone()).collect();
    let mut per_group = std::collections::BTreeMap::<(String, String), usize>::new();
    for (stream, id, message) in &handled {
        let i: i64 = message[1..].parse().unwrap();
        let ingestion: i64 = id.split('-').nth(1).unwrap().parse().unwrap();
        assert_eq!(
            *id,
            shardwise::paged::log_event_identity(base + i / 3, ingestion, message, 0).0
        );
        *per_group
            .entry((
                stream.clone(),
                id.rsplitn(3, '-').nth(2).unwrap().to_string(),
            ))
            .or_default() += 1;
    }
    assert_eq!(per_group.values().max(), Some(&3), "{ids:?}");
    assert_eq!(
        ids.iter().collect::<BTreeSet<_>>().len(),
        50,
        "identities are distinct"
    );

    // Caught up, the stream answers with the request's token; new events are read when they come.
    tokio::time::sleep(Duration::from_millis(600)).await;
    put_logs(&logs, &group, "web", base + 100, "n", 0..5).await;
    wait_all(55).await;

    // A crash, then another worker: nothing skipped (what came after the last barrier may repeat).
    w1.abort();
    let durable = tables.progress(source.name(), "web").await;
    assert!(
        durable
            .resume_cursor
            .as_ref()
            .is_some_and(|c| c.to_string().starts_with("v5|"))
    );
    put_logs(&logs, &group, "web", base + 200, "o", 0..6).await;
    let w2 = run("w2").await.unwrap();
    wait_for_async("o0..o5 after the crash", Duration::from_secs(30), || {
        let seen = seen.clone();
        async move { (0..6).all(|i| seen.messages("web").contains(&format!("o{i}"))) }
    })
    .await;

    // A seek to the time of m15 (ms base + 5): every stream is read again from m15.
    let before = seen.len();
    let report = shardwise::seek::seek_paged(
        tables.leases.as_ref(),
        &source,
        &shardwise::seek::SeekTarget::Timestamp(
            std::time::UNIX_EPOCH + Duration::from_millis(base as u64 + 5),
        ),
    )
    .await
    .unwrap();
    assert_eq!(report.moved.len(), 2);
    let expected: BTreeSet<String> = expect(15..25)
        .into_iter()
        .chain((0..5).map(|i| format!("n{i}")))
        .chain((0..6).map(|i| format!("o{i}")))
        .collect();
    // Until every event expected again is read (the worker keeps to its request budget, 5
    // GetLogEvents a second, 4 events a page here), then a little longer for anything unexpected.
    wait_for_async("the reread", Duration::from_secs(30), || {
        let (seen, expected) = (seen.clone(), expected.clone());
        async move {
            let again = &seen.0.lock().unwrap()[before..];
            streams
                .iter()
                .all(|s| again.iter().filter(|(p, ..)| p == s).count() >= 10)
                && expected
                    .iter()
                    .all(|m| again.iter().any(|(p, _, got)| p == "web" && got == m))
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    w2.shutdown(Duration::from_secs(5)).await;
    let again: Vec<(String, String, String)> = seen.0.lock().unwrap()[before..].to_vec();
    let reread: BTreeSet<&str> = again
        .iter()
        .filter(|(p, ..)| p == "web")
        .map(|(.., m)| m.as_str())
        .collect();
    assert_eq!(
        reread,
        expected.iter().map(String::as_str).collect(),
        "from m15 on, and nothing before it"
    );
    logs.delete_log_group()
        .log_group_name(&group)
        .send()
        .await
        .unwrap();
    tables.drop_all().await;
}

/// Late events on moto: events put behind what was read (moto takes events up to 14 days old, as
/// CloudWatch does) are found by the audit and handled once, with nothing read before them
/// handled again. moto's tokens are indexes into the stream's events by timestamp, so a late event
/// also moves the forward token's place: the next forward page repeats an event, recognised as
/// read. Before, no late event was read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_cloudwatch_events_put_behind_the_cursor_are_handled_once() {
    let live = live_or_skip!();
    logs();
    let logs = logs_client().await;
    let tables = Tables::new(live, APP).await;
    let group = support::unique_name("/shardwise/late");
    logs.create_log_group()
        .log_group_name(&group)
        .send()
        .await
        .unwrap();
    logs.create_log_stream()
        .log_group_name(&group)
        .log_stream_name("web")
        .send()
        .await
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    put_logs(&logs, &group, "web", now - 60_000, "m", 0..6).await;
    let source =
        CloudWatchLogs::new(logs.clone(), &group).late_event_audit_interval(Duration::from_secs(1));
    let seen = Seen::default();
    let worker = Consumer::paged(Arc::new(source.clone()), APP, seen.handler())
        .worker_id("w1")
        .poll_interval(Duration::from_millis(200))
        .checkpoint_interval(Duration::from_millis(20))
        .lease_settings(settings())
        .lease_store(tables.leases.clone())
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let wait_all = |n: usize| {
        let seen = seen.clone();
        async move {
            wait_for_async(&format!("{n} events"), Duration::from_secs(30), || {
                let seen = seen.clone();
                async move { seen.len() >= n }
            })
            .await
        }
    };
    wait_all(6).await;
    // Ten minutes and half an hour behind the events read.
    put_logs(&logs, &group, "web", now - 600_000, "late", 0..3).await;
    put_logs(&logs, &group, "web", now - 1_800_000, "later", 0..2).await;
    wait_all(11).await;
    // Audits go on, a second apart: nothing more comes.
    tokio::time::sleep(Duration::from_secs(3)).await;
    worker.shutdown(Duration::from_secs(5)).await;
    let mut got = seen.messages("web");
    got.sort();
    let mut expected: Vec<String> = (0..6)
        .map(|i| format!("m{i}"))
        .chain((0..3).map(|i| format!("late{i}")))
        .chain((0..2).map(|i| format!("later{i}")))
        .collect();
    expected.sort();
    assert_eq!(got, expected, "each event once");
    logs.delete_log_group()
        .log_group_name(&group)
        .send()
        .await
        .unwrap();
    tables.drop_all().await;
}

/// A receipt ledger that deletes receipts before the log group deletes the events is refused at
/// start: after an outage longer than the receipts are kept, the events handled just before it are
/// handed out again from the last barrier and their effects would apply a second time. Both
/// CloudWatch Logs sources take the group's retention from DescribeLogGroups. A group that never
/// expires events runs with receipts that expire: each partition is checked as it is taken
/// (`cloudwatch_memory::a_stream_whose_progress_is_older_than_receipts_are_kept_is_refused_until_resumed`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_that_forgets_before_the_log_group_does_is_refused() {
    use shardwise::paged::{CloudWatchLogsFilter, DELETION_DELAY};
    use shardwise::receipts::{DynamoDbReceipts, SourceRetention};
    let live = live_or_skip!();
    logs();
    let logs = logs_client().await;
    let tables = Tables::new(live, APP).await;
    let group = support::unique_name("/shardwise/kept");
    logs.create_log_group()
        .log_group_name(&group)
        .send()
        .await
        .unwrap();
    let day = Duration::from_secs(86_400);
    let table = support::unique_name("kept-receipts");
    let ledger = |kept: Option<Duration>| {
        let ledger = DynamoDbReceipts::new(tables.live.dynamodb.clone(), &table, APP);
        Arc::new(match kept {
            Some(kept) => ledger.retention(kept),
            None => ledger.keep_forever(),
        })
    };
    let start = |source: Arc<dyn PagedSource>, kept: Option<Duration>| {
        Consumer::paged(source, APP, |_d: Delivery| async { Outcome::Ack })
            .worker_id("w1")
            .lease_settings(settings())
            .lease_store(tables.leases.clone())
            .receipts(ledger(kept))
            .build()
            .unwrap()
            .run()
    };
    let refusal = |result: Result<shardwise::Running, shardwise::Error>| match result {
        Ok(_) => panic!("a ledger kept shorter than the log group keeps events ran"),
        Err(e) => e.to_string(),
    };
    let by_stream: Arc<dyn PagedSource> = Arc::new(CloudWatchLogs::new(logs.clone(), &group));
    let by_time: Arc<dyn PagedSource> = Arc::new(CloudWatchLogsFilter::new(logs.clone(), &group));

    // A group that never expires its events: both sources bound what a replay needs (each
    // partition is checked as it is taken), so a finite retention runs, and so does for good.
    for source in [&by_stream, &by_time] {
        assert_eq!(source.retention().await.unwrap(), SourceRetention::Forever);
        assert!(source.bounds_replays());
        start(source.clone(), Some(day))
            .await
            .expect("receipts kept a day")
            .shutdown(Duration::from_secs(5))
            .await;
    }
    start(by_stream.clone(), None)
        .await
        .expect("receipts kept for good")
        .shutdown(Duration::from_secs(5))
        .await;

    // Seven days: the events stay up to 72 hours longer, and a timestamp may lie 2 hours ahead.
    logs.put_retention_policy()
        .log_group_name(&group)
        .retention_in_days(7)
        .send()
        .await
        .unwrap();
    let keeps = 7 * day + DELETION_DELAY + Duration::from_secs(2 * 3600);
    for source in [&by_stream, &by_time] {
        assert_eq!(
            source.retention().await.unwrap(),
            SourceRetention::For(keeps)
        );
        let refused = refusal(start(source.clone(), Some(7 * day)).await);
        assert!(refused.contains("10.08 days"), "{refused}");
    }
    start(by_stream.clone(), Some(keeps))
        .await
        .expect("receipts kept as long as the group keeps events")
        .shutdown(Duration::from_secs(5))
        .await;

    // A group that is not there is named.
    let missing = CloudWatchLogs::new(logs.clone(), format!("{group}-missing"));
    let err = missing.retention().await.unwrap_err().to_string();
    assert!(err.contains("log group not found"), "{err}");
    tables.live.delete_table(&table).await;
    tables.drop_all().await;
}
