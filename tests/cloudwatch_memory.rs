//! The CloudWatch Logs sources over days, on the simulation's CloudWatch Logs (`sim/logs.rs`: the
//! real SDK client answered from memory, on paused time, with tokens that expire after 24 hours as
//! the service's do). What moto cannot show: moto's tokens never expire.

#[path = "support/calls.rs"]
mod calls;
#[allow(dead_code)]
#[path = "sim/logs.rs"]
mod logs;
#[path = "support/wait.rs"]
mod wait;

use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use calls::Calls;
use logs::LogsService;
use shardwise::lease::{LeaseSettings, MemoryLeaseStore};
use shardwise::paged::{CloudWatchLogs, PagePosition};
use shardwise::{Consumer, Delivery, Outcome, Running};
use wait::wait_for;

const GROUP: &str = "/app/orders";
const DAY: Duration = Duration::from_secs(24 * 3600);

async fn consumer(service: &LogsService, store: &MemoryLeaseStore, calls: &Calls) -> Running {
    let source = CloudWatchLogs::new(service.client(), GROUP);
    let calls = calls.clone();
    Consumer::paged(Arc::new(source), "app", move |d: Delivery| {
        calls.push("w1", &d);
        async { Outcome::Ack }
    })
    .worker_id("w1")
    .poll_interval(Duration::from_secs(300))
    .checkpoint_interval(Duration::from_secs(10))
    .lease_settings(
        LeaseSettings::default()
            .lease_duration(Duration::from_secs(60))
            .scan_interval(Duration::from_secs(20)),
    )
    .lease_store(Arc::new(store.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap()
}

/// Puts `n` events into stream `s0`, a millisecond apart; their ids as the source names them.
fn put(service: &LogsService, n: usize) -> Vec<String> {
    let now = service.now();
    let batch: Vec<(i64, String)> = (0..n)
        .map(|i| (now - 1_000 + i as i64, format!("event {i}")))
        .collect();
    let stored = service.put("s0", &batch, Duration::ZERO).expect("accepted");
    stored.into_iter().map(|e| e.id).collect()
}

fn applied(store: &MemoryLeaseStore) -> Option<PagePosition> {
    store
        .snapshot()
        .into_iter()
        .find(|r| r.shard_id == "s0")
        .and_then(|r| r.progress?.applied_position)
}

/// A stream quiet for a day holds a token past its 24 hours: the one the service issued with the
/// last events, handed back unchanged at every poll since (polls 5 minutes apart). The source reads on from the last
/// event's time, and so does a worker that starts after a day with the fleet down. Every event is
/// handled once; before, the partition failed at every attempt and nothing after the quiet day
/// was read.
#[tokio::test(start_paused = true)]
async fn a_stream_read_on_after_a_quiet_day_and_after_a_day_with_the_fleet_down() {
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 7);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let mut expected = put(&service, 3);

    let running = consumer(&service, &store, &calls).await;
    wait_for("the first events", Duration::from_secs(900), || {
        calls.len() == 3
    })
    .await;
    tokio::time::sleep(DAY + Duration::from_secs(3600)).await;
    let recovered = service.counts().expired_tokens;
    assert!(
        recovered >= 1,
        "the polls' token expired during the quiet day"
    );
    expected.extend(put(&service, 2));
    wait_for(
        "the events after the quiet day",
        Duration::from_secs(900),
        || calls.len() == 5,
    )
    .await;
    running.shutdown(Duration::from_secs(5)).await;

    tokio::time::sleep(DAY + Duration::from_secs(3600)).await;
    expected.extend(put(&service, 2));
    let running = consumer(&service, &store, &calls).await;
    wait_for(
        "the events after the day down",
        Duration::from_secs(900),
        || calls.len() == 7,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(120)).await;
    running.shutdown(Duration::from_secs(5)).await;

    assert_eq!(calls.ids(), expected, "every event once, in order");
    assert!(
        service.counts().expired_tokens > recovered,
        "the stored token had expired too"
    );
    let last = service.events("s0").pop().unwrap();
    let position =
        PagePosition::from_parts(&[last.timestamp as u64, last.ingestion as u64, last.k]);
    assert_eq!(applied(&store), Some(position));
}
