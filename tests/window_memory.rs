//! Tumbling windows (Lambda's `TumblingWindowInSeconds`) on the in-memory stream and lease store:
//! the real lanes, tracker and checkpoints, on simulated time.

#[path = "support/wait.rs"]
mod wait;

use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use bytes::Bytes;
use shardwise::lease::{LeaseSettings, LeaseStore, MemoryLeaseStore};
use shardwise::testing::{MemoryStream, MemoryStreams};
use shardwise::window::{Window, WindowAnswer, WindowCall, Windowed};
use shardwise::{Batching, Consumer, Delivery, Outcome, Running};
use wait::wait_for;

const WIDTH: Duration = Duration::from_secs(60);

/// One call as the handler saw it: the worker, the window's start, the state it came with, the
/// records' ids, and whether it was the final call (and ended early).
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    worker: &'static str,
    window: i64,
    state: Option<u64>,
    ids: Vec<u64>,
    is_final: bool,
    early: bool,
}

type Calls = Arc<Mutex<Vec<Seen>>>;

fn id_of(d: &Delivery) -> u64 {
    std::str::from_utf8(d.payload()).unwrap().parse().unwrap()
}

fn count(state: &Option<Bytes>) -> Option<u64> {
    state
        .as_ref()
        .map(|s| std::str::from_utf8(s).unwrap().parse().unwrap())
}

/// A handler that counts its window's records in the state (as text), failing the records
/// `fail` names once each (Lambda's batch item failure: that record and the later ones).
fn counting(
    worker: &'static str,
    calls: &Calls,
    fail: &[u64],
) -> Windowed<impl shardwise::window::WindowHandler> {
    let calls = calls.clone();
    let failing: Arc<Mutex<Vec<u64>>> = Arc::new(Mutex::new(fail.to_vec()));
    let handler = move |call: WindowCall| {
        let (calls, failing) = (calls.clone(), failing.clone());
        async move {
            let before = count(&call.state);
            let ids: Vec<u64> = call.records.iter().map(id_of).collect();
            calls.lock().unwrap().push(Seen {
                worker,
                window: call.window.start_ms,
                state: before,
                ids: ids.clone(),
                is_final: call.is_final,
                early: call.terminated_early,
            });
            let mut outcomes = Vec::new();
            let mut settled = 0;
            for id in &ids {
                let mut failing = failing.lock().unwrap();
                if let Some(i) = failing.iter().position(|f| f == id) {
                    failing.remove(i);
                    break;
                }
                outcomes.push(Outcome::Ack);
                settled += 1;
            }
            WindowAnswer::new((before.unwrap_or(0) + settled).to_string(), outcomes)
        }
    };
    Windowed::new(handler, WIDTH, Batching::new(10, Duration::ZERO))
}

async fn start(
    worker: &'static str,
    stream: &MemoryStream,
    store: &MemoryLeaseStore,
    handler: Windowed<impl shardwise::window::WindowHandler>,
) -> Running {
    let sink = MemoryStreams::new([stream.clone()]);
    Consumer::builder(stream.name(), "window-app", handler)
        .worker_id(worker)
        .poll_interval(Duration::from_millis(500))
        .checkpoint_interval(Duration::from_millis(200))
        .lease_settings(
            LeaseSettings::default()
                .lease_duration(Duration::from_secs(3))
                .scan_interval(Duration::from_millis(500)),
        )
        .in_memory(stream, store)
        .record_sink(Arc::new(sink))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap()
}

fn put(stream: &MemoryStream, ids: std::ops::Range<u64>) {
    for id in ids {
        stream.put(&format!("key-{}", id % 3), id.to_string());
    }
}

/// The handled records, in order, and the final calls' (window, state) pairs.
fn summary(calls: &Calls) -> (Vec<u64>, Vec<(i64, Option<u64>)>) {
    let calls = calls.lock().unwrap();
    let ids = calls.iter().flat_map(|c| c.ids.clone()).collect();
    let finals = calls
        .iter()
        .filter(|c| c.is_final)
        .map(|c| (c.window, c.state))
        .collect();
    (ids, finals)
}

/// Records in two windows of a minute: the calls of a window carry its state (the count so far),
/// a record of the next window brings the first window's final call first, and the second
/// window, quiet past its end, gets its final call while the shard is caught up. A failed record
/// (a batch item failure) is called again with the state of the records before it. The lease
/// row keeps the open window's state with the checkpoint, and none once the window closed.
#[tokio::test(start_paused = true)]
async fn a_windows_calls_carry_its_state_and_end_with_one_final_call() {
    let base_ms = 1_800_000_000_000;
    let _deterministic =
        shardwise::testing::simulate(UNIX_EPOCH + Duration::from_millis(base_ms as u64), 3);
    let t0 = tokio::time::Instant::now();
    let now_ms = || base_ms + t0.elapsed().as_millis() as i64;
    let stream = MemoryStream::new("orders", 1);
    let store = MemoryLeaseStore::new();
    let calls: Calls = Arc::default();
    let running = start("w1", &stream, &store, counting("w1", &calls, &[7])).await;
    let first = Window::of(now_ms(), WIDTH);
    put(&stream, 0..12);
    wait_for(
        "the first window's records",
        Duration::from_secs(20),
        || summary(&calls).0.len() >= 12,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let row = store
        .get(&stream.name(), &stream.open_shards()[0])
        .await
        .unwrap()
        .unwrap();
    let window = row.window.expect("the open window's state is in the row");
    assert_eq!(window.window, first);
    assert_eq!(&window.state[..], b"12");

    // The next window: its first record brings the first window's final call.
    let wait = first.end_ms - now_ms() + 1_000;
    tokio::time::sleep(Duration::from_millis(wait as u64)).await;
    put(&stream, 12..17);
    // Quiet past the second window's end: its final call.
    tokio::time::sleep(WIDTH * 2).await;
    running.shutdown(Duration::from_secs(5)).await;

    let (ids, finals) = summary(&calls);
    // 7 failed once: it and every later record of its call came again.
    assert_eq!(
        {
            let mut sorted = ids.clone();
            sorted.sort();
            sorted.dedup();
            sorted
        },
        (0..17).collect::<Vec<_>>(),
        "every record: {ids:?}"
    );
    assert_eq!(
        finals,
        vec![(first.start_ms, Some(12)), (first.end_ms, Some(5))],
        "one final call per window, with its count: {:?}",
        calls.lock().unwrap()
    );
    let retried = calls
        .lock()
        .unwrap()
        .iter()
        .find(|c| c.ids.first() == Some(&7) && !c.is_final)
        .cloned()
        .expect("7 called again");
    assert_eq!(
        retried.state,
        Some(7),
        "called again with the state of 0..7: {:?}",
        calls.lock().unwrap()
    );
    let row = store
        .get(&stream.name(), &stream.open_shards()[0])
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.window, None, "no window open: {row:?}");
}

/// A worker killed while a window is open: the next owner starts from the row's state (the
/// count through the checkpoint), reads again what was not checkpointed, and the window's final
/// call holds every record's count once.
#[tokio::test(start_paused = true)]
async fn a_windows_state_survives_a_killed_worker() {
    let base_ms = 1_800_000_030_000;
    let _deterministic =
        shardwise::testing::simulate(UNIX_EPOCH + Duration::from_millis(base_ms as u64), 5);
    let t0 = tokio::time::Instant::now();
    let now_ms = || base_ms + t0.elapsed().as_millis() as i64;
    let stream = MemoryStream::new("orders", 1);
    let store = MemoryLeaseStore::new();
    let calls: Calls = Arc::default();
    let running = start("w1", &stream, &store, counting("w1", &calls, &[])).await;
    let first = Window::of(now_ms(), WIDTH);
    put(&stream, 0..10);
    wait_for("w1's records", Duration::from_secs(20), || {
        summary(&calls).0.len() >= 10
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    running.abort();
    put(&stream, 10..15);
    let running = start("w2", &stream, &store, counting("w2", &calls, &[])).await;
    wait_for("w2 takes over", Duration::from_secs(30), || {
        calls.lock().unwrap().iter().any(|c| c.worker == "w2")
    })
    .await;
    let wait = first.end_ms - now_ms() + 1_000;
    if wait > 0 {
        tokio::time::sleep(Duration::from_millis(wait as u64)).await;
    }
    tokio::time::sleep(WIDTH).await;
    running.shutdown(Duration::from_secs(5)).await;
    let calls = calls.lock().unwrap().clone();
    let w2_first = calls.iter().find(|c| c.worker == "w2").unwrap();
    assert_eq!(
        w2_first.state,
        Some(10),
        "w2 started from the row's state: {calls:?}"
    );
    let finals: Vec<&Seen> = calls.iter().filter(|c| c.is_final).collect();
    assert_eq!(finals.len(), 1, "{calls:?}");
    assert_eq!(
        (finals[0].window, finals[0].state),
        (first.start_ms, Some(15))
    );
}

/// A state past `MAX_STATE_BYTES` ends its window early: a final call with
/// `terminated_early` and that state; the window's later records start from no state, and the
/// window ends once more, as Lambda ends a window whose state passes its bound.
#[tokio::test(start_paused = true)]
async fn a_state_grown_past_its_bound_ends_the_window_early() {
    let base_ms: i64 = 1_800_000_000_000;
    let _deterministic =
        shardwise::testing::simulate(UNIX_EPOCH + Duration::from_millis(base_ms as u64), 9);
    let stream = MemoryStream::new("orders", 1);
    let store = MemoryLeaseStore::new();
    let calls: Calls = Arc::default();
    let seen = calls.clone();
    // The state grows by 100 KB a record.
    let handler = move |call: WindowCall| {
        let seen = seen.clone();
        async move {
            let before = call.state.as_ref().map_or(0, |s| s.len());
            seen.lock().unwrap().push(Seen {
                worker: "w1",
                window: call.window.start_ms,
                state: call.state.as_ref().map(|s| s.len() as u64),
                ids: call.records.iter().map(id_of).collect(),
                is_final: call.is_final,
                early: call.terminated_early,
            });
            let n = call.records.len();
            WindowAnswer::acked(vec![b'x'; before + n * 100 * 1024], n)
        }
    };
    let handler = Windowed::new(handler, WIDTH, Batching::new(1, Duration::ZERO));
    let running = start("w1", &stream, &store, handler).await;
    put(&stream, 0..6);
    tokio::time::sleep(WIDTH * 2).await;
    running.shutdown(Duration::from_secs(5)).await;
    let calls = calls.lock().unwrap().clone();
    let finals: Vec<(bool, Option<u64>)> = calls
        .iter()
        .filter(|c| c.is_final)
        .map(|c| (c.early, c.state))
        .collect();
    // 0..3 make 400 KB: ended early; 4 and 5 start again and end with the window.
    assert_eq!(
        finals,
        vec![(true, Some(400 * 1024)), (false, Some(200 * 1024))],
        "{calls:?}"
    );
    let after_early = calls.iter().find(|c| c.ids == vec![4]).unwrap();
    assert_eq!(after_early.state, None, "a fresh state after the early end");
    let ids: Vec<u64> = calls.iter().flat_map(|c| c.ids.clone()).collect();
    assert_eq!(
        ids,
        (0..6).collect::<Vec<_>>(),
        "each record once, in order"
    );
}

/// Each call's window, state, whether final, and its records' attempts.
type Attempts = Arc<Mutex<Vec<(i64, Option<u64>, bool, Vec<u32>)>>>;

/// A handler whose final calls fail `failing` times (every time: `u32::MAX`), noting each call.
fn failing_finals(
    calls: &Attempts,
    failing: u32,
) -> Windowed<impl shardwise::window::WindowHandler> {
    let calls = calls.clone();
    let failed = Arc::new(Mutex::new(0u32));
    let handler = move |call: WindowCall| {
        let (calls, failed) = (calls.clone(), failed.clone());
        async move {
            let before = count(&call.state);
            calls.lock().unwrap().push((
                call.window.start_ms,
                before,
                call.is_final,
                call.records.iter().map(Delivery::attempt).collect(),
            ));
            if call.is_final {
                let mut failed = failed.lock().unwrap();
                if *failed < failing {
                    *failed += 1;
                    return WindowAnswer::failed();
                }
            }
            let n = call.records.len();
            WindowAnswer::acked((before.unwrap_or(0) + n as u64).to_string(), n)
        }
    };
    Windowed::new(handler, WIDTH, Batching::new(10, Duration::ZERO))
}

/// A final call that fails is made again after a back-off while the next window's records wait,
/// without spending their attempts: on default settings until it succeeds; with `max_attempts`
/// the window's state is dropped after that many failed final calls and the shard goes on.
#[tokio::test(start_paused = true)]
async fn a_failing_final_call_is_made_again_and_the_waiting_records_keep_their_attempts() {
    for (failing, max_attempts) in [(6, None), (u32::MAX, Some(2))] {
        let base_ms: i64 = 1_800_000_000_000;
        let _deterministic =
            shardwise::testing::simulate(UNIX_EPOCH + Duration::from_millis(base_ms as u64), 11);
        let t0 = tokio::time::Instant::now();
        let now_ms = || base_ms + t0.elapsed().as_millis() as i64;
        let stream = MemoryStream::new("orders", 1);
        let store = MemoryLeaseStore::new();
        let calls = Arc::default();
        let mut builder =
            Consumer::builder(stream.name(), "window-app", failing_finals(&calls, failing))
                .poll_interval(Duration::from_millis(500))
                .checkpoint_interval(Duration::from_millis(200))
                .in_memory(&stream, &store);
        if let Some(n) = max_attempts {
            builder = builder
                .max_attempts(std::num::NonZeroU32::new(n).unwrap())
                .on_spent(shardwise::consumer::OnSpent::Drop);
        }
        let running = builder.build().unwrap().run().await.unwrap();
        let first = Window::of(now_ms(), WIDTH);
        put(&stream, 0..4);
        // The next window: its records bring the first window's final call.
        tokio::time::sleep(Duration::from_millis(
            (first.end_ms - now_ms() + 1_000) as u64,
        ))
        .await;
        put(&stream, 4..7);
        tokio::time::sleep(Duration::from_secs(20)).await;
        running.shutdown(Duration::from_secs(5)).await;
        let calls = calls.lock().unwrap().clone();
        let finals = calls
            .iter()
            .filter(|c| c.0 == first.start_ms && c.2)
            .count();
        let later: Vec<_> = calls
            .iter()
            .filter(|c| c.0 == first.end_ms && !c.2)
            .collect();
        match max_attempts {
            None => assert_eq!(finals, 7, "six failures, then the final call: {calls:?}"),
            Some(n) => assert_eq!(finals, n as usize, "dropped after {n}: {calls:?}"),
        }
        assert_eq!(
            later.len(),
            1,
            "the next window's records, in one call: {calls:?}"
        );
        assert_eq!(
            later[0].1, None,
            "the next window starts from no state: {calls:?}"
        );
        assert_eq!(
            later[0].3,
            vec![1, 1, 1],
            "no attempt spent waiting: {calls:?}"
        );
        let row = store
            .get(&stream.name(), &stream.open_shards()[0])
            .await
            .unwrap()
            .unwrap();
        assert_ne!(
            row.window.map(|w| w.window),
            Some(first),
            "the first window's state is gone from the row"
        );
    }
}

/// A shard that ends while its window's final call keeps failing: the attempts at its end give up
/// and come again, and `max_attempts` counts the final calls across them, so the window's state
/// is dropped after that many and SHARD_END is written.
#[tokio::test(start_paused = true)]
async fn a_final_call_failing_at_a_shards_end_is_bounded_by_max_attempts_across_attempts() {
    let base_ms: i64 = 1_800_000_000_000;
    let _deterministic =
        shardwise::testing::simulate(UNIX_EPOCH + Duration::from_millis(base_ms as u64), 17);
    let stream = MemoryStream::new("orders", 1);
    let store = MemoryLeaseStore::new();
    let calls: Attempts = Arc::default();
    let running = Consumer::builder(
        stream.name(),
        "window-app",
        failing_finals(&calls, u32::MAX),
    )
    .poll_interval(Duration::from_millis(500))
    .checkpoint_interval(Duration::from_millis(200))
    .max_attempts(std::num::NonZeroU32::new(8).unwrap())
    .on_spent(shardwise::consumer::OnSpent::Drop)
    .in_memory(&stream, &store)
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    let parent = stream.open_shards()[0].clone();
    put(&stream, 0..4);
    tokio::time::sleep(Duration::from_secs(5)).await;
    stream.split(&parent);
    tokio::time::sleep(Duration::from_secs(120)).await;
    running.shutdown(Duration::from_secs(5)).await;
    let calls = calls.lock().unwrap().clone();
    let finals = calls.iter().filter(|c| c.2).count();
    assert_eq!(finals, 8, "{calls:?}");
    let row = store.get(&stream.name(), &parent).await.unwrap().unwrap();
    assert_eq!(
        row.checkpoint,
        shardwise::lease::Checkpoint::ShardEnd,
        "{row:?}"
    );
    assert_eq!(row.window, None);
}

/// A batch that holds two windows' records, the first window's call failing: the later
/// window's records were not handed to the handler and spend no attempt waiting, so at
/// `max_attempts` 1 only the failed call's records from the failure on are spent (Lambda
/// discards a failed invocation's records; it invokes each window apart).
#[tokio::test(start_paused = true)]
async fn a_later_windows_records_in_a_failed_batch_spend_no_attempt() {
    let base_ms: i64 = 1_800_000_000_000;
    let _deterministic =
        shardwise::testing::simulate(UNIX_EPOCH + Duration::from_millis(base_ms as u64), 13);
    let t0 = tokio::time::Instant::now();
    let now_ms = || base_ms + t0.elapsed().as_millis() as i64;
    let stream = MemoryStream::new("orders", 1);
    let store = MemoryLeaseStore::new();
    let first = Window::of(now_ms(), WIDTH);
    put(&stream, 0..3);
    tokio::time::sleep(Duration::from_millis(
        (first.end_ms - now_ms() + 1_000) as u64,
    ))
    .await;
    put(&stream, 3..6);
    let calls: Calls = Arc::default();
    let running = Consumer::builder(stream.name(), "window-app", counting("w1", &calls, &[1]))
        .poll_interval(Duration::from_millis(500))
        .checkpoint_interval(Duration::from_millis(200))
        .max_attempts(std::num::NonZeroU32::new(1).unwrap())
        .on_spent(shardwise::consumer::OnSpent::Drop)
        .in_memory(&stream, &store)
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    tokio::time::sleep(WIDTH * 2).await;
    running.shutdown(Duration::from_secs(5)).await;
    let calls = calls.lock().unwrap().clone();
    let handled: Vec<u64> = calls.iter().flat_map(|c| c.ids.clone()).collect();
    // 0..3 in one call, 1 failing: 1 and 2 spent; 3..6 handled, each once.
    assert_eq!(handled, vec![0, 1, 2, 3, 4, 5], "{calls:?}");
    let finals: Vec<(i64, Option<u64>)> = calls
        .iter()
        .filter(|c| c.is_final)
        .map(|c| (c.window, c.state))
        .collect();
    assert_eq!(
        finals,
        vec![(first.start_ms, Some(1)), (first.end_ms, Some(3))],
        "{calls:?}"
    );
}

/// Windows need a shard's calls in order: more than one lane, no order between lanes, or retry
/// copies are refused at build, naming the setting; so is a width past Lambda's 15 minutes.
#[tokio::test]
async fn settings_that_break_a_windows_order_are_refused_at_build() {
    let stream = MemoryStream::new("orders", 1);
    let store = MemoryLeaseStore::new();
    let builder = |width: Duration| {
        let handler = Windowed::new(
            |call: WindowCall| async move { WindowAnswer::acked("{}", call.records.len()) },
            width,
            Batching::new(10, Duration::ZERO),
        );
        Consumer::builder(stream.name(), "window-app", handler).in_memory(&stream, &store)
    };
    let refused = |result: Result<_, shardwise::ConfigError>| match result {
        Err(e) => e.to_string(),
        Ok(_) => panic!("accepted"),
    };
    assert!(refused(builder(WIDTH).lanes(2).build()).contains("lanes"));
    assert!(
        refused(
            builder(WIDTH)
                .ordering(shardwise::DeliveryOrder::None)
                .build()
        )
        .contains("ordering")
    );
    assert!(
        refused(
            builder(WIDTH)
                .retries(shardwise::consumer::RetryMode::Copy)
                .max_attempts(std::num::NonZeroU32::new(3).unwrap())
                .build()
        )
        .contains("retries")
    );
    assert!(refused(builder(Duration::from_secs(901)).build()).contains("tumbling_window"));
    assert!(builder(WIDTH).build().is_ok());
}
