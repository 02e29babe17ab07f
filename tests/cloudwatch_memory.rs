//! The CloudWatch Logs sources over days, on the simulation's CloudWatch Logs (`sim/logs.rs`: the
//! real SDK client answered from memory, on paused time, with tokens that expire after 24 hours as
//! the service's do). What moto cannot show: moto's tokens never expire.

#[path = "support/calls.rs"]
mod calls;
#[allow(dead_code)]
#[path = "sim/logs.rs"]
mod logs;
#[path = "support/recorder.rs"]
mod recorder;
#[path = "support/wait.rs"]
mod wait;

use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use calls::Calls;
use logs::LogsService;
use shardwise::lease::{Checkpoint, LeaseSettings, LeaseStore, MemoryLeaseStore, NewLease};
use shardwise::paged::{CloudWatchLogs, CloudWatchLogsFilter, PagePosition, PagedSource};
use shardwise::receipts::MemoryReceipts;
use shardwise::testing::{HostClock, on_host};
use shardwise::{Consumer, Delivery, Outcome, Running};
use wait::wait_for;

const GROUP: &str = "/app/orders";
const DAY: Duration = Duration::from_secs(24 * 3600);

async fn consumer(service: &LogsService, store: &MemoryLeaseStore, calls: &Calls) -> Running {
    consumer_with(service, store, calls, Some(shardwise::paged::RETIRE_AFTER)).await
}

/// [`consumer`], its streams retiring after `retire` without news (`None`: never).
async fn consumer_with(
    service: &LogsService,
    store: &MemoryLeaseStore,
    calls: &Calls,
    retire: Option<Duration>,
) -> Running {
    let source = CloudWatchLogs::new(service.client(), GROUP).retire_after(retire);
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
    put_into(service, "s0", n)
}

/// Puts `n` events into `stream`, a millisecond apart; their ids as the source names them.
fn put_into(service: &LogsService, stream: &str, n: usize) -> Vec<String> {
    let now = service.now();
    let batch: Vec<(i64, String)> = (0..n)
        .map(|i| (now - 1_000 + i as i64, format!("{stream} event {i}")))
        .collect();
    let stored = service
        .put(stream, &batch, Duration::ZERO)
        .expect("accepted");
    stored.into_iter().map(|e| e.id).collect()
}

fn has_row(store: &MemoryLeaseStore, stream: &str) -> bool {
    store.snapshot().iter().any(|r| r.shard_id == stream)
}

fn applied(store: &MemoryLeaseStore) -> Option<PagePosition> {
    store
        .snapshot()
        .into_iter()
        .find(|r| r.shard_id == "s0")
        .and_then(|r| r.progress?.applied_position)
}

/// A stream quiet for a day holds a token past its 24 hours: the one the service issued with the
/// last events, handed back unchanged at every poll since (polls 5 minutes apart; streams that
/// never retire). The source reads on from the last event's time, and so does a worker that
/// starts after a day with the fleet down. Every event is handled once; before, the partition
/// failed at every attempt and nothing after the quiet day was read.
#[tokio::test(start_paused = true)]
async fn a_stream_read_on_after_a_quiet_day_and_after_a_day_with_the_fleet_down() {
    read_on_after_a_quiet_day(None).await;
}

/// The same with streams retiring after an hour without news (the default): the stream retires
/// during the quiet day and is not polled; woken by the events after it, it reads on from its
/// stored cursor, whose token expired.
#[tokio::test(start_paused = true)]
async fn a_retired_stream_woken_after_a_quiet_day_reads_on_past_its_expired_token() {
    read_on_after_a_quiet_day(Some(shardwise::paged::RETIRE_AFTER)).await;
}

async fn read_on_after_a_quiet_day(retire: Option<Duration>) {
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 7);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let mut expected = put(&service, 3);

    let running = consumer_with(&service, &store, &calls, retire).await;
    wait_for("the first events", Duration::from_secs(900), || {
        calls.len() == 3
    })
    .await;
    tokio::time::sleep(DAY + Duration::from_secs(3600)).await;
    if retire.is_some() {
        assert_eq!(service.counts().expired_tokens, 0, "retired: never polled");
        assert!(store.snapshot()[0].retired_at.is_some(), "retired");
    } else {
        assert!(
            service.counts().expired_tokens >= 1,
            "the polls' token expired during the quiet day"
        );
    }
    expected.extend(put(&service, 2));
    wait_for(
        "the events after the quiet day",
        Duration::from_secs(900),
        || calls.len() == 5,
    )
    .await;
    let recovered = service.counts().expired_tokens;
    assert!(recovered >= 1, "the token had expired during the quiet day");
    running.shutdown(Duration::from_secs(5)).await;

    tokio::time::sleep(DAY + Duration::from_secs(3600)).await;
    expected.extend(put(&service, 2));
    let running = consumer_with(&service, &store, &calls, retire).await;
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
    // The applied position claims every group (one timestamp and ingestion time) before the
    // last event's: its group's prefix, below each of its members.
    let last = service.events("s0").pop().unwrap();
    let group = PagePosition::from_parts(&[last.timestamp as u64, last.ingestion as u64]);
    assert_eq!(applied(&store), Some(group));
}

/// A log stream deleted while it is read ends its partition: its row is deleted, and a stream
/// created again under the same name gets a new row and is read from its first event. Before,
/// the fetch's `ResourceNotFoundException` failed the partition at every attempt: its row stayed,
/// taken and released again and again, and a stream created again was read (if at all) from the
/// old stream's token.
#[tokio::test(start_paused = true)]
async fn a_deleted_stream_ends_its_partition_and_one_created_again_is_read_from_its_start() {
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 11);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    service.create_stream("s1");
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let mut expected = put_into(&service, "s0", 3);
    expected.extend(put_into(&service, "s1", 2));

    let running = consumer(&service, &store, &calls).await;
    wait_for("the first events", Duration::from_secs(900), || {
        calls.len() == 5
    })
    .await;
    assert!(has_row(&store, "s1"));

    let deleted = service.delete_stream("s1");
    assert_eq!(deleted.len(), 2);
    wait_for(
        "the deleted stream's row to be deleted",
        Duration::from_secs(900),
        || !has_row(&store, "s1"),
    )
    .await;
    assert!(has_row(&store, "s0"), "the other stream's row stays");

    service.create_stream("s1");
    tokio::time::sleep(Duration::from_secs(1)).await;
    expected.extend(put_into(&service, "s1", 2));
    expected.extend(put(&service, 1));
    wait_for(
        "the events of the stream created again, and of the other stream",
        Duration::from_secs(900),
        || calls.len() == 8,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(120)).await;
    running.shutdown(Duration::from_secs(5)).await;

    let mut handled = calls.ids();
    handled.sort();
    expected.sort();
    assert_eq!(handled, expected, "every event once");
}

/// Streams deleted from a group of 200 (4 pages of DescribeLogStreams): each costs two or three
/// look-ups by its name (the fetch's, whether one of its name was created since, and the
/// reader's, whether it is still listed; an audit that meets it first asks once more), not
/// listings of the group. Before, each not-found fetch listed the whole group, and each
/// partition's end asked for a sync, another listing: 66 requests for these 10, 25 now (issue
/// 55, defect 3: a thousand deleted streams, a thousand listings).
#[tokio::test(start_paused = true)]
async fn a_deleted_stream_costs_look_ups_of_its_name_not_listings_of_the_group() {
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 59);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let mut expected = Vec::new();
    for i in 0..200 {
        let stream = format!("s{i:03}");
        service.create_stream(&stream);
        expected.extend(put_into(&service, &stream, 1));
    }
    let source = CloudWatchLogs::new(service.client(), GROUP);
    let recorded = calls.clone();
    let running = Consumer::paged(Arc::new(source), "app", move |d: Delivery| {
        recorded.push("w1", &d);
        async { Outcome::Ack }
    })
    .worker_id("w1")
    .poll_interval(Duration::from_secs(30))
    .lease_settings(
        LeaseSettings::default()
            .lease_duration(Duration::from_secs(60))
            .scan_interval(Duration::from_secs(20))
            // No periodic listing within the test's window: what is counted is the deletions'.
            .shard_sync_interval(Duration::from_secs(6 * 3600)),
    )
    .lease_store(Arc::new(store.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("every stream's event", Duration::from_secs(1800), || {
        calls.len() == 200
    })
    .await;
    tokio::time::sleep(Duration::from_secs(60)).await;

    let before = service.counts().describe_log_streams;
    for i in (0..200).step_by(20) {
        service.delete_stream(&format!("s{i:03}"));
    }
    wait_for(
        "the deleted streams' rows deleted",
        Duration::from_secs(1800),
        || store.snapshot().len() == 190,
    )
    .await;
    let spent = service.counts().describe_log_streams - before;
    running.shutdown(Duration::from_secs(5)).await;

    let mut handled = calls.ids();
    handled.sort();
    expected.sort();
    assert_eq!(handled, expected, "every event once");
    assert!(
        spent <= 3 * 10,
        "10 deleted streams cost {spent} DescribeLogStreams requests"
    );
}

/// A log stream deleted and created again under its name before the reader notices (5 s later,
/// between two polls) is another stream: the token of the old one is refused, and the listing
/// names the stream as before. The reader knows the stream by its name and its creation time:
/// the old stream's partition ends, its row is deleted, and the new stream is read from its first
/// event under a new row, older events (timestamps before the old stream's last) and newer ones
/// alike. Before, the refused token was recovered from the old stream's last timestamp, so the
/// new stream's older events were never asked for.
#[tokio::test(start_paused = true)]
async fn a_stream_created_again_under_its_name_is_read_whole_as_a_new_stream() {
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 37);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    service.create_stream("s1");
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let mut expected = put_into(&service, "s0", 3);
    expected.extend(put_into(&service, "s1", 3));
    let running = consumer(&service, &store, &calls).await;
    wait_for("the first events", Duration::from_secs(900), || {
        calls.len() == 6
    })
    .await;

    // Between two polls (5 minutes apart): deleted, and created again 5 s later with 20 events
    // older than the old stream's last (2 hours old: beyond the late-event audit's window, so only
    // a read of the new stream from its start finds them) and 20 newer.
    tokio::time::sleep(Duration::from_secs(30)).await;
    service.delete_stream("s1");
    tokio::time::sleep(Duration::from_secs(5)).await;
    service.create_stream("s1");
    let now = service.now();
    let batch: Vec<(i64, String)> = (0..20)
        .map(|i| (now - 7_200_000 + i, format!("s1 again, older {i}")))
        .chain((0..20).map(|i| (now - 1_000 + i, format!("s1 again, newer {i}"))))
        .collect();
    expected.extend(
        service
            .put("s1", &batch, Duration::ZERO)
            .expect("accepted")
            .into_iter()
            .map(|e| e.id),
    );
    wait_for(
        "the stream created again, read whole",
        Duration::from_secs(1800),
        || calls.len() == 46,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(600)).await;
    running.shutdown(Duration::from_secs(5)).await;

    let mut handled = calls.ids();
    handled.sort();
    expected.sort();
    assert_eq!(handled, expected, "every event once");
    assert_eq!(
        metrics.counter(
            "shardwise_paged_partitions_recreated_total",
            "logs:/app/orders"
        ),
        Some(1)
    );
}

/// Streams' rows left at SHARD_END by owners that ended them as gone and stopped or failed a
/// write (a throttled call) before deleting them, while the streams were created again under
/// their names: one held by nobody (the deletion failed), one still naming this worker id (its
/// release failed, or it was killed: this process does not hold it), one naming a worker that
/// died. Scans delete them (the last once its counter stood still for a lease duration) and the
/// sync makes new rows: every stream is read whole. Before, nothing deleted such rows (no worker
/// takes an ended row) and the streams were never read again: long logs seeds 35 (a release
/// throttled) and 149 (a deletion throttled).
#[tokio::test(start_paused = true)]
async fn streams_listed_again_over_rows_left_at_shard_end_by_gone_partitions_are_read_whole() {
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 41);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let mut expected = Vec::new();
    for (stream, owner) in [("s0", None), ("s1", Some("w1")), ("s2", Some("w-dead"))] {
        service.create_stream(stream);
        expected.extend(put_into(&service, stream, 3));
        let left = NewLease {
            stream: "logs:/app/orders".into(),
            shard_id: stream.into(),
            checkpoint: Checkpoint::ShardEnd,
            parents: Vec::new(),
        };
        assert!(store.create(&left).await.unwrap());
        if let Some(owner) = owner {
            let row = store
                .snapshot()
                .into_iter()
                .find(|r| r.shard_id == stream)
                .unwrap();
            store.take(&row, owner).await.unwrap().expect("taken");
        }
    }
    let running = consumer(&service, &store, &calls).await;
    wait_for("the streams' new rows", Duration::from_secs(900), || {
        calls.len() == 9
    })
    .await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    running.shutdown(Duration::from_secs(5)).await;

    let mut handled = calls.ids();
    handled.sort();
    expected.sort();
    assert_eq!(handled, expected, "every event of every stream once");
    for row in store.snapshot() {
        assert_ne!(row.checkpoint, Checkpoint::ShardEnd, "a new row: {row:?}");
    }
}

/// A group read by timestamp after a pause of three days: the backlog is read in polls of one
/// catch-up step (10 minutes of event time) each, every step closed before the next begins, so
/// the row's `closedThrough` follows the events handled, memory holds one step's events, and no
/// poll lives long enough for its token to expire; each step is read once (4,320 events read for
/// 4,320 new; waiting for the loop's first word rather than for the start to move read each step
/// about 20 times: 86,290). Before, the first poll after the pause read
/// the three days whole: nothing closed until it ended (every event was handled with
/// `closedThrough` still at the pause), the open groups held the whole backlog, and past 24 hours
/// the token expired and the poll started over (issue 55, defect 4).
#[tokio::test(start_paused = true)]
async fn a_backlog_of_days_is_read_in_steps_each_closed_before_the_next() {
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 43);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    // Each event handled: its timestamp, and the row's `closedThrough` then.
    type Handled = Vec<(i64, Option<i64>)>;
    let closed_at_handling: Arc<std::sync::Mutex<Handled>> = Arc::default();
    let start = |calls: &Calls| {
        let (calls, rows, seen) = (calls.clone(), store.clone(), closed_at_handling.clone());
        let source = CloudWatchLogsFilter::new(service.client(), GROUP).page_limit(50);
        Consumer::paged(Arc::new(source), "app", move |d: Delivery| {
            calls.push("w1", &d);
            let closed = rows
                .snapshot()
                .first()
                .and_then(|r| r.progress.as_ref()?.closed_through);
            let ts = d
                .arrived_at()
                .map(|t| t.duration_since(UNIX_EPOCH).unwrap().as_millis() as i64)
                .unwrap();
            seen.lock().unwrap().push((ts, closed));
            async { Outcome::Ack }
        })
        .worker_id("w1")
        .poll_interval(Duration::from_secs(60))
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
    };
    // A first run closes the empty group through the present, then the fleet stops.
    let running = start(&calls).await.unwrap();
    wait_for("a first close", Duration::from_secs(900), || {
        store
            .snapshot()
            .first()
            .and_then(|r| r.progress.as_ref()?.closed_through)
            .is_some()
    })
    .await;
    running.shutdown(Duration::from_secs(5)).await;
    let paused_at = service.now();

    // Three days later: an event a minute put during the pause (4,320), all ingested now.
    tokio::time::sleep(3 * DAY).await;
    let batch: Vec<(i64, String)> = (0..3 * 24 * 60)
        .map(|i| (paused_at + 60_000 * (i + 1), format!("minute {i}")))
        .collect();
    let mut expected: Vec<String> = batch
        .chunks(1_000)
        .flat_map(|chunk| service.put("s0", chunk, Duration::ZERO).expect("accepted"))
        .map(|e| e.event_id)
        .collect();
    let read_before = service.counts().events;
    let running = start(&calls).await.unwrap();
    wait_for("the backlog", Duration::from_secs(6 * 3600), || {
        calls.len() == expected.len()
    })
    .await;
    let read = service.counts().events - read_before;
    running.shutdown(Duration::from_secs(5)).await;

    let mut handled = calls.ids();
    handled.sort();
    expected.sort();
    assert_eq!(handled, expected, "every event once");
    // Each event was handled with the row closed through at most two steps and the close
    // horizon behind it: the steps before were closed first.
    let step = 600_000;
    let seen = closed_at_handling.lock().unwrap();
    let behind: Vec<&(i64, Option<i64>)> = seen
        .iter()
        .filter(|(ts, closed)| closed.is_none_or(|c| c < ts - 3 * step))
        .take(5)
        .collect();
    assert!(
        behind.len() <= 1,
        "events handled while closedThrough lagged by more than three steps: {behind:?}"
    );
    // Each step read once: events read over events new, at most 1.5 (the audits of the last
    // hour, once back at the present, read some again).
    assert!(
        read * 2 <= expected.len() as u64 * 3,
        "{read} events read for {} new",
        expected.len()
    );
}

/// An application's client as the SDK makes it retries a throttled call 3 times on its own: the
/// sources make one attempt a call and ask again themselves, so every request passes the
/// source's budget and every throttled answer the service gives is counted in
/// `shardwise_paged_throttled_total`, for both sources. Before, the SDK's retries sent requests
/// no budget saw, and the metric counted a third of the throttled answers or fewer (issue 55,
/// defect 7).
#[tokio::test(start_paused = true)]
async fn every_throttled_answer_is_counted_whatever_the_applications_client_retries() {
    for by_time in [false, true] {
        let metrics = recorder::Metrics::default();
        let _metrics = metrics::set_default_local_recorder(&metrics);
        let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
        let _deterministic = shardwise::testing::simulate(base, 47);
        let service = LogsService::new(GROUP, 1_767_225_600_000);
        service.create_stream("s0");
        let store = MemoryLeaseStore::new();
        let calls = Calls::default();
        let mut expected: Vec<String> = service
            .put(
                "s0",
                &(0..5)
                    .map(|i| (service.now() - 600_000 + i, format!("event {i}")))
                    .collect::<Vec<_>>(),
                Duration::ZERO,
            )
            .expect("accepted")
            .into_iter()
            .map(|e| if by_time { e.event_id } else { e.id })
            .collect();
        // The account throttled for the first two minutes: listings, looks and reads.
        service.throttle_until(service.now() + 120_000);
        let client = service.client_with_sdk_retries();
        let (source, name): (Arc<dyn PagedSource>, String) = if by_time {
            (
                Arc::new(CloudWatchLogsFilter::new(client, GROUP)),
                format!("logs-by-time:{GROUP}"),
            )
        } else {
            (
                Arc::new(CloudWatchLogs::new(client, GROUP)),
                format!("logs:{GROUP}"),
            )
        };
        let recorded = calls.clone();
        let running = Consumer::paged(source, "app", move |d: Delivery| {
            recorded.push("w1", &d);
            async { Outcome::Ack }
        })
        .worker_id("w1")
        .poll_interval(Duration::from_secs(30))
        .lease_store(Arc::new(store.clone()))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
        wait_for("every event", Duration::from_secs(1800), || {
            calls.len() == 5
        })
        .await;
        running.shutdown(Duration::from_secs(5)).await;

        let mut handled = calls.ids();
        handled.sort();
        expected.sort();
        assert_eq!(handled, expected, "every event once (by time: {by_time})");
        let throttled = service.counts().throttled;
        assert!(throttled > 0, "the throttling was met");
        assert_eq!(
            metrics.counter("shardwise_paged_throttled_total", &name),
            Some(throttled),
            "every throttled answer counted (by time: {by_time})"
        );
    }
}

/// A group keeping events a day, its stream read again after the fleet was down 30 hours while
/// an event an hour came: the first reads are of events older than the group keeps them, which
/// the service may have deleted unread. The reader says so: `shardwise_paged_behind_retention_total`
/// counts the pages read that far behind and a warning names the partition, and
/// `shardwise_millis_behind_latest` (as for a Kinesis shard) shows the lag while catching up and
/// 0 once at the present. Before, nothing: events the retention deleted were lost silently
/// (issue 55, defect 7). After a pause of 6 hours, nothing is counted. Both sources.
#[tokio::test(start_paused = true)]
async fn reading_behind_the_groups_retention_is_counted_and_the_lag_reported() {
    for (by_time, down_hours) in [(false, 30), (false, 6), (true, 30), (true, 6)] {
        let metrics = recorder::Metrics::default();
        let _metrics = metrics::set_default_local_recorder(&metrics);
        let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
        let _deterministic = shardwise::testing::simulate(base, 53);
        let service = LogsService::new(GROUP, 1_767_225_600_000);
        service.set_retention(1);
        service.create_stream("s0");
        let store = MemoryLeaseStore::new();
        let calls = Calls::default();
        let (name, lag) = if by_time {
            (format!("logs-by-time:{GROUP}"), GROUP.to_string())
        } else {
            (format!("logs:{GROUP}"), "s0".to_string())
        };
        let start = |calls: &Calls| {
            let client = service.client();
            let source: Arc<dyn PagedSource> = if by_time {
                Arc::new(CloudWatchLogsFilter::new(client, GROUP))
            } else {
                Arc::new(CloudWatchLogs::new(client, GROUP))
            };
            let recorded = calls.clone();
            Consumer::paged(source, "app", move |d: Delivery| {
                recorded.push("w1", &d);
                async { Outcome::Ack }
            })
            .worker_id("w1")
            .poll_interval(Duration::from_secs(30))
            .lease_store(Arc::new(store.clone()))
            .build()
            .unwrap()
            .run()
        };
        put_into(&service, "s0", 1);
        let running = start(&calls).await.unwrap();
        wait_for("the first event", Duration::from_secs(900), || {
            calls.len() == 1
        })
        .await;
        tokio::time::sleep(Duration::from_secs(600)).await;
        running.shutdown(Duration::from_secs(5)).await;
        for _ in 0..down_hours {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            put_into(&service, "s0", 1);
        }
        let running = start(&calls).await.unwrap();
        wait_for("the events of the pause", Duration::from_secs(3600), || {
            calls.len() == 1 + down_hours
        })
        .await;
        tokio::time::sleep(Duration::from_secs(900)).await;
        let at_present = metrics.gauge("shardwise_millis_behind_latest", &lag);
        running.shutdown(Duration::from_secs(5)).await;

        let behind = metrics.counter("shardwise_paged_behind_retention_total", &name);
        if down_hours > 24 {
            assert!(
                behind.is_some_and(|n| n > 0),
                "read behind the retention, counted (by time: {by_time}): {behind:?}"
            );
        } else {
            assert_eq!(behind, None, "within the retention (by time: {by_time})");
        }
        assert_eq!(at_present, Some(0.0), "at the present (by time: {by_time})");
    }
}

/// A poll of `FilterLogEvents` held up for more than a day (throttling that lasts) holds a
/// `nextToken` the service refuses when it answers again. The source asks the poll's query again
/// from its start: the attempt goes on under the same lease, and what it handed out already is
/// known to it. Before, the refused token failed the attempt: the lease was given back and taken
/// again, and the next attempt handed every event of the open groups out again (each of the five
/// twice, no ledger here).
#[tokio::test(start_paused = true)]
async fn a_filter_poll_whose_token_expired_under_lasting_throttling_is_read_again_under_the_same_lease()
 {
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 13);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let expected: Vec<String> = service
        .put(
            "s0",
            &(0..5)
                // Ten minutes old: behind the close horizon (5 minutes), read by the first poll.
                .map(|i| (service.now() - 600_000 + i, format!("event {i}")))
                .collect::<Vec<_>>(),
            Duration::ZERO,
        )
        .expect("accepted")
        .into_iter()
        .map(|e| e.event_id)
        .collect();

    // One event a page; the first event handled throttles the account for 25 hours.
    let source = CloudWatchLogsFilter::new(service.client(), GROUP).page_limit(1);
    let (throttle, recorded) = (service.clone(), calls.clone());
    let running = Consumer::paged(Arc::new(source), "app", move |d: Delivery| {
        if recorded.len() == 0 {
            throttle.throttle_until(throttle.now() + 25 * 3600 * 1000);
        }
        recorded.push("w1", &d);
        async { Outcome::Ack }
    })
    .worker_id("w1")
    .poll_interval(Duration::from_secs(60))
    .max_backoff(Duration::from_secs(600))
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
    .unwrap();
    wait_for("the first events", Duration::from_secs(300), || {
        calls.len() >= 1
    })
    .await;
    assert!(calls.len() < 5, "the throttling held the poll up");
    let epoch = |store: &MemoryLeaseStore| {
        store
            .snapshot()
            .into_iter()
            .find(|r| r.shard_id == GROUP)
            .map(|r| (r.owner.clone(), r.owner_epoch))
    };
    let held = epoch(&store);
    // Slept through rather than polled: a wait polls every 10 ms of simulated time.
    tokio::time::sleep(DAY + Duration::from_secs(3600)).await;
    wait_for(
        "every event, after the throttling",
        Duration::from_secs(3600),
        || calls.len() >= 5,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert!(
        service.counts().expired_tokens >= 1,
        "the poll's token expired while the account was throttled"
    );
    assert_eq!(epoch(&store), held, "the same lease, never given back");
    running.shutdown(Duration::from_secs(5)).await;
    let mut handled = calls.ids();
    handled.sort();
    let mut expected = expected;
    expected.sort();
    assert_eq!(handled, expected, "every event once");
}

/// DescribeLogStreams answers 50 streams a page, at 5 requests a second for the whole account: a
/// group of 400 streams is listed in 8 pages, and (with this worker's budget set past the quota)
/// the sixth, asked in the same second, is throttled. The listing asks for that page again after a back-off, keeping the five it has, and
/// is complete. Before, the first throttled page failed the whole listing (and so every listing
/// of a group of more than 250 streams read faster than the quota).
#[tokio::test(start_paused = true)]
async fn a_listing_throttled_midway_keeps_its_pages_and_completes() {
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    let expected: Vec<String> = (0..400).map(|i| format!("stream-{i:03}")).collect();
    for stream in &expected {
        service.create_stream(stream);
    }
    // A budget past the account's quota: as if other workers spent the rest of it.
    let source =
        CloudWatchLogs::new(service.client(), GROUP).describe_log_streams_per_second(100.0);
    let listed = source.partitions().await.expect("a complete listing");
    assert_eq!(listed, expected);
    assert!(
        service.counts().throttled >= 1,
        "the listing was throttled midway"
    );
}

/// A worker keeps to its GetLogEvents budget (5 requests a second by default): 100 streams with
/// an event each are read without a throttled request, their first fetches spaced over about 20
/// s. Before, every stream was fetched in the same instant and the account's quota (25 a second)
/// throttled the rest.
#[tokio::test(start_paused = true)]
async fn a_worker_keeps_to_its_request_budget_and_is_not_throttled() {
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 17);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    let mut expected = Vec::new();
    for i in 0..100 {
        let stream = format!("s{i:03}");
        service.create_stream(&stream);
        expected.extend(put_into(&service, &stream, 1));
    }
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let running = consumer(&service, &store, &calls).await;
    wait_for("every stream's event", Duration::from_secs(600), || {
        calls.len() == 100
    })
    .await;
    running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(service.counts().throttled, 0, "{:?}", service.counts());
    let mut handled = calls.ids();
    handled.sort();
    expected.sort();
    assert_eq!(handled, expected, "every event once");
}

/// Puts a batch of `(how long ago, message)` events into `stream` now: behind every token issued
/// past their timestamps. Their ids as the source names them.
fn put_late(service: &LogsService, stream: &str, events: &[(Duration, &str)]) -> Vec<String> {
    let now = service.now();
    let batch: Vec<(i64, String)> = events
        .iter()
        .map(|(ago, message)| (now - ago.as_millis() as i64, message.to_string()))
        .collect();
    service
        .put(stream, &batch, Duration::ZERO)
        .expect("accepted")
        .into_iter()
        .map(|e| e.id)
        .collect()
}

/// CloudWatch Logs takes events up to 14 days old, and `GetLogEvents` read forward never
/// returns one put behind its token. The audit (every 5 minutes, 1 hour of lateness by default)
/// reads the stream again behind the cursor and hands each late event out once: late events put
/// while the worker reads (10 and 50 minutes old), and while no worker runs (90 minutes old,
/// behind the cursor, found by the audit the next worker begins with). Nothing else is handed
/// out twice, and an event later than the window (3 hours) is not looked for. Before, no late
/// event was ever read: a silent skip, with no metric.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn late_events_put_behind_the_cursor_are_found_by_an_audit_and_handled_once() {
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 19);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let minutes = |m: u64| Duration::from_secs(60 * m);
    let mut expected = put(&service, 3);

    let running = consumer(&service, &store, &calls).await;
    wait_for("the first events", Duration::from_secs(60), || {
        calls.len() == 3
    })
    .await;
    tokio::time::sleep(minutes(1)).await;
    expected.extend(put_late(
        &service,
        "s0",
        &[(minutes(10), "late 10 min"), (minutes(50), "late 50 min")],
    ));
    expected.extend(put(&service, 1));
    wait_for("the late events, by an audit", minutes(6), || {
        calls.len() == 6
    })
    .await;
    let late = || metrics.counter("shardwise_paged_late_events_total", "s0");
    assert_eq!(late(), Some(2));
    // Later audits find nothing more.
    tokio::time::sleep(minutes(20)).await;
    assert_eq!(calls.len(), 6, "{:?}", calls.ids());
    running.shutdown(Duration::from_secs(5)).await;

    // While no worker runs, a late event arrives; and one later than the window (and than the
    // time since the last audit).
    tokio::time::sleep(minutes(60)).await;
    // 90 minutes old: behind the cursor, which stands at the last event read (80 minutes ago).
    expected.extend(put_late(&service, "s0", &[(minutes(90), "late 90 min")]));
    let too_late = put_late(&service, "s0", &[(minutes(180), "late 3 hours")]);
    let running = consumer(&service, &store, &calls).await;
    wait_for(
        "the late event put while no worker ran",
        Duration::from_secs(60),
        || calls.len() == 7,
    )
    .await;
    tokio::time::sleep(minutes(20)).await;
    running.shutdown(Duration::from_secs(5)).await;

    let mut handled = calls.ids();
    handled.sort();
    expected.sort();
    assert_eq!(handled, expected, "every event once");
    assert!(!handled.contains(&too_late[0]), "later than the window");
    assert_eq!(late(), Some(3));
}

/// A host clock a minute ahead of the service's. An audit's mark vouches for every event ingested
/// at or before it; made by the host's clock, it vouched for a minute the service had not reached
/// yet, and a late event ingested in that minute was never handed out, nothing logged or counted.
/// Marks are made by the service's time now (the `Date` of its answers). A late event (10 minutes
/// old) put every 2 s for 5 minutes: every one handed out, once. Before, the ones put in the 30 s
/// after the first forward read were never handed out.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn late_events_are_found_under_a_host_clock_a_minute_ahead_of_the_service() {
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 31);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let minutes = |m: u64| Duration::from_secs(60 * m);
    let mut expected = put(&service, 3);
    let ahead = HostClock::new(60_000, 0);
    let running = on_host(ahead, consumer(&service, &store, &calls)).await;
    wait_for("the first events", Duration::from_secs(60), || {
        calls.len() == 3
    })
    .await;
    for i in 0..150 {
        let message = format!("late {i}");
        expected.extend(put_late(&service, "s0", &[(minutes(10), message.as_str())]));
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    // Two audit intervals after the last one.
    tokio::time::sleep(minutes(11)).await;
    running.shutdown(Duration::from_secs(5)).await;
    let mut handled = calls.ids();
    handled.sort();
    expected.sort();
    let missing: Vec<&String> = expected.iter().filter(|e| !handled.contains(e)).collect();
    assert!(
        missing.is_empty(),
        "{} never handed out: {missing:?}",
        missing.len()
    );
    assert_eq!(handled, expected, "every event once");
    assert_eq!(
        metrics.counter("shardwise_paged_late_events_total", "s0"),
        Some(150)
    );
}

/// Events that become readable by `GetLogEvents` 3 minutes after their ingestion (AWS states no
/// bound on that delay; the service's pipeline keeps a stream's order). An audit's mark vouches
/// for every event ingested at or before it; made 30 s before the audit, it vouched for events
/// not readable yet, and a late event ingested in the 2.5 minutes before the mark was never
/// handed out, nothing logged or counted. The mark now stays at or before the newest ingestion
/// the forward read saw, and for a stream with nothing recent, 15 minutes before the audit
/// (`readable_within`). A late event (10 minutes old) put every 2 s for 5 minutes, into a busy
/// stream (an event every 2 s as well) and into a quiet one: every one handed out, once.
/// Before, most of those put in the minutes before each audit were never handed out.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn late_events_readable_minutes_after_their_ingestion_are_found() {
    for busy in [false, true] {
        late_events_readable_after(Duration::from_secs(180), busy).await;
    }
}

async fn late_events_readable_after(delay: Duration, busy: bool) {
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 37);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let minutes = |m: u64| Duration::from_secs(60 * m);
    let mut expected = put(&service, 3);
    let running = consumer(&service, &store, &calls).await;
    wait_for("the first events", Duration::from_secs(60), || {
        calls.len() == 3
    })
    .await;
    service.set_readability_delay(delay);
    for i in 0..150 {
        let message = format!("late {i}");
        expected.extend(put_late(&service, "s0", &[(minutes(10), message.as_str())]));
        if busy {
            expected.extend(put_late(
                &service,
                "s0",
                &[(Duration::ZERO, format!("now {i}").as_str())],
            ));
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    // Readable, and two audit intervals after.
    tokio::time::sleep(delay + minutes(11)).await;
    running.shutdown(Duration::from_secs(5)).await;
    let mut handled = calls.ids();
    handled.sort();
    expected.sort();
    let missing: Vec<&String> = expected.iter().filter(|e| !handled.contains(e)).collect();
    assert!(
        missing.is_empty(),
        "busy {busy}: {} never handed out: {missing:?}",
        missing.len()
    );
    assert_eq!(handled, expected, "busy {busy}: every event once");
}

/// `FilterLogEvents` finds an event once it is searchable, which AWS does not bound. Here the
/// group's index lags 8 minutes behind its ingestion (longer than the 5-minute close horizon)
/// while events come every 2 s for 5 minutes: one with the present's timestamp, one 30 minutes
/// old (within the hour of lateness). Before, an audit begun at `S` marked every event ingested
/// by `S` less the horizon as handed out, those not yet searchable too, and the audits after
/// it, finding them, took them for replays: **180 of 300** never handed out, nothing logged or
/// counted. Now an audit vouches for no event ingested after the newest one it read, and for a
/// group with nothing recent not for the last 15 minutes.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn filter_events_searchable_minutes_after_their_ingestion_are_found() {
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 41);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let source = CloudWatchLogsFilter::new(service.client(), GROUP);
    let recorded = calls.clone();
    let running = Consumer::paged(Arc::new(source), "app", move |d: Delivery| {
        recorded.push("w1", &d);
        async { Outcome::Ack }
    })
    .worker_id("w1")
    .poll_interval(Duration::from_secs(5))
    .checkpoint_interval(Duration::from_secs(1))
    .lease_store(Arc::new(store.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    let put_ago = |ago: Duration, message: String, searchable: Duration| -> Vec<String> {
        let at = service.now() - ago.as_millis() as i64;
        service
            .put("s0", &[(at, message)], searchable)
            .unwrap()
            .into_iter()
            .map(|e| e.event_id)
            .collect()
    };
    let lag = Duration::from_secs(8 * 60);
    let mut expected = put_ago(Duration::from_secs(1), "first".into(), Duration::ZERO);
    wait_for("the first event", Duration::from_secs(600), || {
        calls.len() == 1
    })
    .await;
    for i in 0..150 {
        expected.extend(put_ago(Duration::ZERO, format!("now {i}"), lag));
        expected.extend(put_ago(
            Duration::from_secs(30 * 60),
            format!("late {i}"),
            lag,
        ));
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    // Searchable, and three audit intervals after.
    tokio::time::sleep(lag + Duration::from_secs(16 * 60)).await;
    running.shutdown(Duration::from_secs(5)).await;
    let mut handled = calls.ids();
    handled.sort();
    expected.sort();
    let missing: Vec<&String> = expected.iter().filter(|e| !handled.contains(e)).collect();
    assert!(
        missing.is_empty(),
        "{} of {} never handed out: {missing:?}",
        missing.len(),
        expected.len() - 1
    );
    assert_eq!(handled, expected, "every event once");
}

/// `FilterLogEvents` over hours, with the defaults (close horizon 5 minutes, lateness 1 hour,
/// audited every 5 minutes): 5 events a second into 5 streams for 3 hours. Polls read only what
/// is new (up to the close horizon), so the open groups hold about the horizon's events and the
/// requests stay near the minimum the events need; the audit's identities hold about the
/// lateness window's. Every event is handled once. Before, the lateness bound (14 days) kept every
/// event in an open group and every poll read everything again: open events grew with the run
/// and each poll took more pages.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_filter_consumer_holds_memory_and_reads_bounded_by_its_horizons_over_hours() {
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 23);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    let streams: Vec<String> = (0..5).map(|i| format!("s{i}")).collect();
    for stream in &streams {
        service.create_stream(stream);
    }
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let source = CloudWatchLogsFilter::new(service.client(), GROUP);
    let recorded = calls.clone();
    let poll = Duration::from_secs(5);
    let running = Consumer::paged(Arc::new(source), "app", move |d: Delivery| {
        recorded.push("w1", &d);
        async { Outcome::Ack }
    })
    .worker_id("w1")
    .lanes(4)
    .poll_interval(poll)
    .checkpoint_interval(Duration::from_secs(1))
    .lease_store(Arc::new(store.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();

    let run = Duration::from_secs(3 * 3600);
    let step = Duration::from_secs(10);
    let (mut expected, mut peak_open, mut peak_remembered) = (Vec::new(), 0.0f64, 0.0f64);
    let gauge = |name: &str| metrics.gauge(name, GROUP).unwrap_or_default();
    for i in 0..(run.as_secs() / step.as_secs()) {
        // 50 events every 10 s: 10 into each stream, their timestamps within the last 2 s.
        for stream in &streams {
            let now = service.now();
            let batch: Vec<(i64, String)> = (0..10)
                .map(|k| (now - 2_000 + k * 200, format!("{stream} {i} {k}")))
                .collect();
            let stored = service.put(stream, &batch, Duration::from_secs(2)).unwrap();
            expected.extend(stored.into_iter().map(|e| e.event_id));
        }
        tokio::time::sleep(step).await;
        peak_open = peak_open.max(gauge("shardwise_paged_open_events"));
        peak_remembered = peak_remembered.max(gauge("shardwise_paged_remembered_events"));
    }
    tokio::time::sleep(Duration::from_secs(600)).await;
    running.shutdown(Duration::from_secs(5)).await;
    let requests = service.counts().requests;

    let mut handled = calls.ids();
    handled.sort();
    expected.sort();
    assert_eq!(handled.len(), expected.len(), "every event handled once");
    assert_eq!(handled, expected, "every event once");
    // 5 a second: the close horizon and a poll hold about 1,500; the lateness window about
    // 18,000 (and up to an audit interval more before it is trimmed).
    let rate = 5.0;
    assert!(
        peak_open <= rate * (300.0 + 2.0 * poll.as_secs_f64()) * 1.2,
        "open events peaked at {peak_open}"
    );
    assert!(
        peak_remembered <= rate * (3600.0 + 300.0 + 300.0) * 1.1,
        "remembered identities peaked at {peak_remembered}"
    );
    // The minimum: a request a poll, a page (10,000 events, the source's default) for the new
    // events, and each audit's pages (an hour's 18,000 events: 2, and one more).
    let page = 10_000;
    let elapsed = run.as_secs() + 600;
    let polls = elapsed / poll.as_secs();
    let audits = elapsed / 300;
    let minimum = polls + expected.len() as u64 / page + audits * (18_000 / page + 2);
    assert!(
        requests <= 2 * minimum,
        "{requests} requests; the events and polls need {minimum}"
    );
    eprintln!(
        "{} events over 3 h: open events peaked at {peak_open}, remembered identities at {peak_remembered}, {requests} requests (minimum {minimum})",
        expected.len()
    );
}

/// A log group read by timestamp where one event fails for two hours (a line the handler cannot
/// take until a fix is deployed; retried in place, as by default): its group holds
/// `closedThrough` behind it for the two hours, while an event a second comes. The polls go on
/// after what they proved, not from the held group: the events the service returns stay within
/// twice what the new events and the audits' windows need. Before, every poll read again every
/// event since the failing one (an hour in, 3,600 a poll, every 5 s): found by the long logs
/// simulation's poison events, whose seeds by timestamp ran a hundred times slower.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_filter_poll_goes_on_after_what_it_proved_while_a_failing_event_holds_its_group() {
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 41);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let source = CloudWatchLogsFilter::new(service.client(), GROUP);
    let recorded = calls.clone();
    let hold = Duration::from_secs(2 * 3600);
    let fixed_at = tokio::time::Instant::now() + hold;
    let poll = Duration::from_secs(5);
    let running = Consumer::paged(Arc::new(source), "app", move |d: Delivery| {
        recorded.push("w1", &d);
        let poison = d.payload().as_ref() == b"poison";
        async move {
            if poison && tokio::time::Instant::now() < fixed_at {
                Outcome::RetryAfter(Duration::from_secs(60))
            } else {
                Outcome::Ack
            }
        }
    })
    .worker_id("w1")
    .poll_interval(poll)
    .checkpoint_interval(Duration::from_secs(1))
    .lease_store(Arc::new(store.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();

    let mut expected = Vec::new();
    let first = service.now();
    let poison = service
        .put(
            "s0",
            &[(first, "poison".to_string())],
            Duration::from_secs(2),
        )
        .unwrap();
    let run = Duration::from_secs(3 * 3600);
    let step = Duration::from_secs(10);
    for i in 0..(run.as_secs() / step.as_secs()) {
        let now = service.now();
        let batch: Vec<(i64, String)> = (0..10)
            .map(|k| (now - 2_000 + k * 100, format!("{i} {k}")))
            .collect();
        let stored = service.put("s0", &batch, Duration::from_secs(2)).unwrap();
        expected.extend(stored.into_iter().map(|e| e.event_id));
        tokio::time::sleep(step).await;
    }
    tokio::time::sleep(Duration::from_secs(600)).await;
    running.shutdown(Duration::from_secs(5)).await;

    let handled = calls.ids();
    let poison_id = poison[0].event_id.clone();
    assert!(
        calls.count(&poison_id) >= 100,
        "the failing event ran again for two hours ({} calls)",
        calls.count(&poison_id)
    );
    let mut others: Vec<String> = handled.into_iter().filter(|id| *id != poison_id).collect();
    others.sort();
    expected.sort();
    assert_eq!(others, expected, "every other event once");
    // The new events once, and each audit's window (an hour, 3,600 events; one every 5
    // minutes); twice that at most.
    let elapsed = run.as_secs() + 600;
    let needed = expected.len() as u64 + (elapsed / 300) * 3_600;
    let served = service.counts().events;
    assert!(
        served <= 2 * needed,
        "{served} events returned; the new events and the audits need {needed}"
    );
    eprintln!("{served} events returned over 3 h 10 min (needed {needed})");
}

/// A log group read by timestamp, stopped and started again: the audit's durable mark (written
/// with a close) shows what the earlier attempt handed out, so the next worker's first audit hands
/// out only what arrived since; a late event put while no worker ran is handled once. Before, the
/// first audit after a restart had only its memory, now empty, and handed out again every event of
/// its window (an hour) without a receipt ledger.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_filter_consumer_started_again_hands_out_only_what_arrived_since_its_audit_mark() {
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 29);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    for stream in ["s0", "s1"] {
        service.create_stream(stream);
    }
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let start = || {
        let source = CloudWatchLogsFilter::new(service.client(), GROUP);
        let recorded = calls.clone();
        Consumer::paged(Arc::new(source), "app", move |d: Delivery| {
            recorded.push("w1", &d);
            async { Outcome::Ack }
        })
        .worker_id("w1")
        .poll_interval(Duration::from_secs(5))
        .checkpoint_interval(Duration::from_secs(1))
        .lease_store(Arc::new(store.clone()))
        .build()
        .unwrap()
        .run()
    };
    let put_now = |stream: &str, n: i64, tag: &str| -> Vec<String> {
        let now = service.now();
        let batch: Vec<(i64, String)> = (0..n)
            .map(|i| (now - 1_000 + i, format!("{stream} {tag} {i}")))
            .collect();
        service
            .put(stream, &batch, Duration::from_secs(2))
            .unwrap()
            .into_iter()
            .map(|e| e.event_id)
            .collect()
    };
    let running = start().await.unwrap();
    let mut expected = Vec::new();
    // Twenty minutes of events, then a quiet quarter of an hour (three audits).
    for minute in 0..20 {
        for stream in ["s0", "s1"] {
            expected.extend(put_now(stream, 5, &format!("minute {minute}")));
        }
        tokio::time::sleep(Duration::from_secs(60)).await;
    }
    tokio::time::sleep(Duration::from_secs(15 * 60)).await;
    assert_eq!(calls.len(), expected.len(), "every event, once");
    running.shutdown(Duration::from_secs(5)).await;
    let row = store
        .snapshot()
        .into_iter()
        .find(|r| r.shard_id == GROUP)
        .unwrap();
    let mark = row
        .progress
        .and_then(|p| p.resume_cursor)
        .map(|c| c.to_string());
    assert!(
        mark.as_deref().is_some_and(|m| m.starts_with("audited|")),
        "{mark:?}"
    );

    // Ten minutes down; a late event arrives behind closedThrough (30 minutes old).
    tokio::time::sleep(Duration::from_secs(600)).await;
    let now = service.now();
    let late: Vec<String> = service
        .put(
            "s1",
            &[(now - 30 * 60_000, "late".to_string())],
            Duration::from_secs(2),
        )
        .unwrap()
        .into_iter()
        .map(|e| e.event_id)
        .collect();
    expected.extend(late);
    let running = start().await.unwrap();
    tokio::time::sleep(Duration::from_secs(15 * 60)).await;
    running.shutdown(Duration::from_secs(5)).await;

    let mut handled = calls.ids();
    handled.sort();
    expected.sort();
    assert_eq!(handled, expected, "every event once, the late one too");
}

/// A worker killed while a page is half settled leaves its resume cursor (promoted at page
/// barriers) behind its applied position. A late event put between the two, after the durable
/// audit mark, is read by the next worker's forward read below the applied position (taken for a
/// replay) and so only an audit can hand it out. Before, the attempt's first audit ran before the
/// forward read, covered only what lay behind the resume cursor, and moved the mark past the
/// late event: it was never handed out. Now the first audit waits until the forward read has
/// passed the applied position.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_late_event_between_the_resume_cursor_and_the_applied_position_is_handed_out_after_a_crash()
 {
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 29);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let start = |worker: &'static str, hold: Option<String>| {
        let calls = calls.clone();
        let source = CloudWatchLogs::new(service.client(), GROUP).page_limit(4);
        Consumer::paged(Arc::new(source), "app", move |d: Delivery| {
            let held = hold.as_deref() == d.paged_event_id();
            if !held {
                calls.push(worker, &d);
            }
            async move {
                if held {
                    std::future::pending::<()>().await;
                }
                Outcome::Ack
            }
        })
        .worker_id(worker)
        .lanes(4)
        .poll_interval(Duration::from_secs(5))
        .checkpoint_interval(Duration::from_secs(1))
        .lease_settings(
            LeaseSettings::default()
                .lease_duration(Duration::from_secs(10))
                .scan_interval(Duration::from_secs(2)),
        )
        .lease_store(Arc::new(store.clone()))
        .build()
        .unwrap()
        .run()
    };
    let first = put(&service, 4);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let second = put(&service, 4);
    let w1 = start("w1", Some(second[3].clone())).await.unwrap();
    let timestamp = |id: &str| id.split('-').next().unwrap().parse::<i64>().unwrap();
    let below = PagePosition::from_parts(&[timestamp(&second[3]) as u64]);
    wait_for(
        "the second page settled but for its last",
        Duration::from_secs(60),
        || {
            calls.len() == 7
                && applied(&store).is_some_and(|a| {
                    a < below && a > PagePosition::from_parts(&[timestamp(&second[2]) as u64])
                })
        },
    )
    .await;
    // Late: stamped between the second page's second and third events, put after the mark.
    tokio::time::sleep(Duration::from_secs(60)).await;
    let late = service
        .put(
            "s0",
            &[(timestamp(&second[1]), "late".to_string())],
            Duration::ZERO,
        )
        .expect("accepted")[0]
        .id
        .clone();
    tokio::time::sleep(Duration::from_secs(1)).await;
    w1.abort();
    tokio::time::sleep(Duration::from_secs(60)).await;

    let w2 = start("w2", None).await.unwrap();
    wait_for(
        "the late event and the held one",
        Duration::from_secs(600),
        || {
            let ids = calls.ids();
            ids.contains(&late) && ids.contains(&second[3])
        },
    )
    .await;
    w2.shutdown(Duration::from_secs(5)).await;
    let ids = calls.ids();
    for id in first.iter().chain(&second).chain([&late]) {
        assert!(ids.contains(id), "{id} handled: {ids:?}");
    }
}

/// Handler calls by message: (worker, message, attempt).
type Messages = Arc<std::sync::Mutex<Vec<(String, String, u32)>>>;

/// A consumer on `s0` of `service` with the receipt ledger `receipts`, whose handler records
/// each call by message, and answers `Retry` to the message `stall` (every attempt) and an ack to
/// everything else.
async fn by_message(
    service: &LogsService,
    store: &MemoryLeaseStore,
    receipts: &MemoryReceipts,
    worker: &'static str,
    page_limit: u32,
    stall: Option<&'static str>,
    seen: &Messages,
) -> Running {
    by_message_with(
        service,
        store,
        receipts,
        worker,
        Some(page_limit),
        stall,
        false,
        seen,
    )
    .await
}

fn handled(seen: &Messages, worker: &str, message: &str) -> usize {
    seen.lock()
        .unwrap()
        .iter()
        .filter(|(w, m, _)| w == worker && m == message)
        .count()
}

/// One batch of PutLogEvents stamps `a`, `b` and `c` with one millisecond: a group of equal
/// timestamp and ingestion time. A worker handles `a` and `b`, and `c` keeps failing when it
/// stops, so its applied position lies in the group and its cursor before it. Then the group's
/// retention deletes `a` (CloudWatch Logs deletes events "up to 72 hours" after their retention,
/// and says nothing of a group going together). Before, the next worker counted `b` and `c` as
/// the group's first and second (`-0`, `-1`), both at or below the applied position: `c` was
/// taken for a replay and never handled.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_event_is_handled_after_a_restart_when_retention_deleted_an_earlier_one_of_its_group() {
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 31);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    let store = MemoryLeaseStore::new();
    let receipts = MemoryReceipts::new();
    let seen = Messages::default();
    let at = service.now() - 1_000;
    let batch: Vec<(i64, String)> = ["a", "b", "c"]
        .iter()
        .map(|m| (at, m.to_string()))
        .collect();
    service.put("s0", &batch, Duration::ZERO).expect("accepted");

    let w1 = by_message(&service, &store, &receipts, "w1", 100, Some("c"), &seen).await;
    wait_for(
        "a and b handled, c failing",
        Duration::from_secs(120),
        || {
            handled(&seen, "w1", "a") == 1
                && handled(&seen, "w1", "b") == 1
                && handled(&seen, "w1", "c") >= 2
        },
    )
    .await;
    // Time for the applied position's write.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(applied(&store).is_some(), "the settled prefix was written");
    w1.abort();
    service.delete_event("s0", "a").expect("a was stored");
    tokio::time::sleep(Duration::from_secs(30)).await;

    let w2 = by_message(&service, &store, &receipts, "w2", 100, None, &seen).await;
    wait_for(
        "c handled by the next worker",
        Duration::from_secs(300),
        || handled(&seen, "w2", "c") == 1,
    )
    .await;
    w2.shutdown(Duration::from_secs(5)).await;
    assert_eq!(handled(&seen, "w2", "a"), 0, "a is gone");
}

/// The same group, read in pages of two: the first page (`a`, `b`) passes its barrier, so the
/// stored cursor's token comes after `b`; `c` keeps failing. The worker stops, retention deletes
/// `a`, and a day later the token has expired: the next worker reads again from `b`'s time.
/// Before, counting the group again from its first event named `b` and `c` as `-0` and `-1`, at
/// or below the applied position (`b`'s `-1`): `c` was taken for a replay. Now what lies up to
/// `b` is passed over by name, and `c` and `d` are handed out.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_event_is_handled_after_a_token_recovery_when_retention_deleted_an_earlier_one_of_its_group()
 {
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 37);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    let store = MemoryLeaseStore::new();
    let receipts = MemoryReceipts::new();
    let seen = Messages::default();
    let at = service.now() - 1_000;
    let batch: Vec<(i64, String)> = ["a", "b", "c", "d"]
        .iter()
        .map(|m| (at, m.to_string()))
        .collect();
    service.put("s0", &batch, Duration::ZERO).expect("accepted");

    let w1 = by_message(&service, &store, &receipts, "w1", 2, Some("c"), &seen).await;
    wait_for(
        "a, b, d handled, c failing",
        Duration::from_secs(120),
        || {
            ["a", "b", "d"].iter().all(|m| handled(&seen, "w1", m) == 1)
                && handled(&seen, "w1", "c") >= 2
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    w1.abort();
    service.delete_event("s0", "a").expect("a was stored");
    tokio::time::sleep(DAY + Duration::from_secs(3600)).await;

    let expired = service.counts().expired_tokens;
    let w2 = by_message(&service, &store, &receipts, "w2", 2, None, &seen).await;
    wait_for(
        "c handled by the next worker",
        Duration::from_secs(300),
        || handled(&seen, "w2", "c") == 1,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    w2.shutdown(Duration::from_secs(5)).await;
    assert!(
        service.counts().expired_tokens > expired,
        "the stored token had expired"
    );
    assert_eq!(handled(&seen, "w2", "a"), 0, "a is gone");
    assert_eq!(handled(&seen, "w2", "b"), 0, "b lies behind the cursor");
}

/// An event's name comes from its message, not from its place in its group: `q`, whose group's
/// first event `p` was deleted before anyone read it, keeps its own name (before, it was named
/// `-0`, `p`'s name, and a receipt or effect keyed on it was keyed on `p`'s). Exact repeats
/// (same timestamp, ingestion time and message) are told apart by their occurrence, also when
/// a page boundary splits their group: every event once, under the name the service's model
/// gives it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn events_are_named_by_their_messages_and_exact_repeats_by_their_occurrence() {
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 41);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let at = service.now() - 10_000;
    let mut expected = Vec::new();
    // A group whose first event retention took before the first read.
    let first: Vec<(i64, String)> = ["p", "q"].iter().map(|m| (at, m.to_string())).collect();
    let stored = service.put("s0", &first, Duration::ZERO).unwrap();
    service.delete_event("s0", "p").unwrap();
    let (p, q) = (stored[0].clone(), stored[1].clone());
    assert_eq!(
        q.id,
        shardwise::paged::log_event_identity(at, q.ingestion, "q", 0).0
    );
    assert_ne!(p.id, q.id);
    expected.push(q.id);
    tokio::time::sleep(Duration::from_millis(5)).await;
    // Exact repeats, in pages of two: [x y] [x x] [z w]; the second and third pages go on
    // with the group, whose earlier messages are counted again.
    let repeats: Vec<(i64, String)> = ["x", "y", "x", "x", "z", "x"]
        .iter()
        .map(|m| (at + 1, m.to_string()))
        .collect();
    let stored = service.put("s0", &repeats, Duration::ZERO).unwrap();
    expected.extend(stored.iter().map(|e| e.id.clone()));
    let occurrences: Vec<u64> = stored.iter().map(|e| e.occurrence).collect();
    assert_eq!(occurrences, [0, 0, 1, 2, 0, 3]);

    let source = CloudWatchLogs::new(service.client(), GROUP).page_limit(2);
    let recorder = calls.clone();
    let running = Consumer::paged(Arc::new(source), "app", move |d: Delivery| {
        recorder.push("w1", &d);
        async { Outcome::Ack }
    })
    .worker_id("w1")
    .poll_interval(Duration::from_secs(5))
    .lease_store(Arc::new(store.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    wait_for("every event", Duration::from_secs(120), || {
        calls.len() >= expected.len()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(calls.ids(), expected, "each once, under its own name");
}

/// A consumer of `service` named `worker` without a receipt ledger, whose handler records each
/// message it is given.
async fn recording(
    service: &LogsService,
    store: &MemoryLeaseStore,
    worker: &'static str,
    seen: &Messages,
) -> Running {
    let seen = seen.clone();
    let source = CloudWatchLogs::new(service.client(), GROUP);
    Consumer::paged(Arc::new(source), "app", move |d: Delivery| {
        let message = String::from_utf8_lossy(d.payload()).into_owned();
        seen.lock()
            .unwrap()
            .push((worker.to_string(), message, d.attempt()));
        async { Outcome::Ack }
    })
    .worker_id(worker)
    .poll_interval(Duration::from_secs(5))
    .checkpoint_interval(Duration::from_secs(1))
    .lease_settings(
        LeaseSettings::default()
            .lease_duration(Duration::from_secs(10))
            .scan_interval(Duration::from_secs(2)),
    )
    .lease_store(Arc::new(store.clone()))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap()
}

/// What a graceful lease move of a busy stream (an event a second for 4 minutes, w1 stops, w2
/// reads on) hands out: the events both owners handed out, and those neither did. With
/// `readable_late`, a late event (10 minutes old) is put just before the stop, readable only 20 s
/// later (after the stopping owner's last audit).
async fn graceful_move(readable_late: bool, metrics: &recorder::Metrics) -> (usize, Vec<String>) {
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 37);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    let store = MemoryLeaseStore::new();
    let seen = Messages::default();
    let mut expected = Vec::new();
    let put_one = |i: usize, expected: &mut Vec<String>| {
        let message = format!("event {i}");
        service
            .put("s0", &[(service.now(), message.clone())], Duration::ZERO)
            .expect("accepted");
        expected.push(message);
    };

    let first = recording(&service, &store, "w1", &seen).await;
    for i in 0..240 {
        put_one(i, &mut expected);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // Settled and written before the stop: the stop alone decides what the next owner rereads.
    wait_for("w1 handles every event", Duration::from_secs(30), || {
        seen.lock().unwrap().len() == 240
    })
    .await;
    if readable_late {
        service
            .put(
                "s0",
                &[(service.now() - 600_000, "late".to_string())],
                Duration::from_secs(20),
            )
            .expect("accepted");
        expected.push("late".to_string());
    }
    first.shutdown(Duration::from_secs(5)).await;
    assert_eq!(
        metrics.counter("shardwise_paged_final_audits_total", "logs:/app/orders"),
        Some(1)
    );

    let second = recording(&service, &store, "w2", &seen).await;
    for i in 240..300 {
        put_one(i, &mut expected);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // Past the second owner's first audit, and its next one.
    tokio::time::sleep(Duration::from_secs(6 * 60)).await;
    second.shutdown(Duration::from_secs(5)).await;

    let seen = seen.lock().unwrap().clone();
    let by = |worker: &str| -> std::collections::HashSet<String> {
        seen.iter()
            .filter(|(w, _, _)| w == worker)
            .map(|(_, m, _)| m.clone())
            .collect()
    };
    let (w1, w2) = (by("w1"), by("w2"));
    let missing = expected
        .into_iter()
        .filter(|m| !w1.contains(m) && !w2.contains(m))
        .collect();
    (w1.intersection(&w2).count(), missing)
}

/// A graceful lease move of a busy stream (a deploy). A cursor's audit mark moved only with an
/// audit (every 5 minutes), and the next owner's first audit hands out again every event
/// ingested since the mark that it does not remember: up to the audit interval and the
/// allowance of the stream, after every deploy. Now a graceful stop audits once more before the
/// final write, and vouches in its cursor for what it handed out of the allowance (30 s) before
/// that audit's mark (a count and a digest of their identities); the next owner's first audit
/// finds exactly those there and hands none of them out again: 0 of 240 events here (240 before
/// the final audit, every one since the first read's mark; 28 with the audit and without what it
/// vouches for). Every event is handled.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_graceful_lease_move_of_a_busy_stream_hands_nothing_out_again() {
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    let (again, missing) = graceful_move(false, &metrics).await;
    assert!(missing.is_empty(), "never handed out: {missing:?}");
    assert_eq!(again, 0, "events handed out by both owners");
    assert!(metrics.counter("shardwise_paged_replays_total", "s0") >= Some(20));
}

/// What a graceful stop vouches for is only trusted whole: a late event put just before the
/// stop and readable only after the stopping owner's last audit lies in the vouched range, so
/// the next owner's first audit returns more than was vouched for, and hands out every event of
/// the range (the late one among them; the rest again, at least once): never skipped.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_late_event_readable_only_after_a_graceful_stop_is_handed_out_by_the_next_owner() {
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    let (again, missing) = graceful_move(true, &metrics).await;
    assert!(missing.is_empty(), "never handed out: {missing:?}");
    assert!(again > 0, "the vouched range is handed out again");
}

/// [`by_message`] (pages of `page_limit`, or the source's default), told to resume past expired
/// receipts or not.
#[allow(clippy::too_many_arguments)]
async fn by_message_with(
    service: &LogsService,
    store: &MemoryLeaseStore,
    receipts: &MemoryReceipts,
    worker: &'static str,
    page_limit: Option<u32>,
    stall: Option<&'static str>,
    resume: bool,
    seen: &Messages,
) -> Running {
    let seen = seen.clone();
    let source = CloudWatchLogs::new(service.client(), GROUP);
    let source = match page_limit {
        Some(limit) => source.page_limit(limit),
        None => source,
    };
    let builder = Consumer::paged(Arc::new(source), "app", move |d: Delivery| {
        let message = String::from_utf8_lossy(d.payload()).into_owned();
        let outcome = if Some(message.as_str()) == stall {
            Outcome::Retry
        } else {
            Outcome::Ack
        };
        seen.lock()
            .unwrap()
            .push((worker.to_string(), message, d.attempt()));
        async move { outcome }
    })
    .worker_id(worker)
    .poll_interval(Duration::from_secs(5))
    .checkpoint_interval(Duration::from_secs(1))
    .lease_settings(
        LeaseSettings::default()
            .lease_duration(Duration::from_secs(10))
            .scan_interval(Duration::from_secs(2)),
    )
    .lease_store(Arc::new(store.clone()))
    .receipts(Arc::new(receipts.clone()));
    let builder = if resume {
        builder.resume_past_expired_receipts()
    } else {
        builder
    };
    builder.build().unwrap().run().await.unwrap()
}

/// [`by_message_with`] with the source's default page size.
async fn by_message_resuming(
    service: &LogsService,
    store: &MemoryLeaseStore,
    receipts: &MemoryReceipts,
    worker: &'static str,
    stall: Option<&'static str>,
    resume: bool,
    seen: &Messages,
) -> Running {
    by_message_with(service, store, receipts, worker, None, stall, resume, seen).await
}

/// A log group that never expires its events, and receipts that do (2 days here; 7 by default
/// on the command line). Receipts were kept for good before, one per event with no end. A
/// replay needs the receipts of what was handled after the durable progress: an event failing in
/// place holds the cursor while the events after it are handled; the worker is killed, and the
/// fleet stays down 5 days. The next worker refuses the stream (their receipts expired: it would
/// apply their effects again), counted and logged, and takes it again after growing waits; an
/// operator resumes past the expired receipts, and the events are handled again, the failing
/// one too. A stream held all along (its audits keep its mark new) is never refused.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_stream_whose_progress_is_older_than_receipts_are_kept_is_refused_until_resumed() {
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 41);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    let store = MemoryLeaseStore::new();
    let receipts = MemoryReceipts::new().retention(2 * DAY, 41);
    let seen = Messages::default();
    let at = service.now() - 1_000;
    let batch: Vec<(i64, String)> = ["a", "stall", "c", "d"]
        .iter()
        .enumerate()
        .map(|(i, m)| (at + i as i64, m.to_string()))
        .collect();
    service.put("s0", &batch, Duration::ZERO).expect("accepted");

    let w1 = by_message_resuming(
        &service,
        &store,
        &receipts,
        "w1",
        Some("stall"),
        false,
        &seen,
    )
    .await;
    wait_for(
        "c and d handled, stall failing",
        Duration::from_secs(120),
        || handled(&seen, "w1", "c") == 1 && handled(&seen, "w1", "stall") >= 2,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    w1.abort();
    // Down five days: the receipts of a, c and d expired, and TTL deleted them (within 48 hours).
    tokio::time::sleep(5 * DAY).await;
    assert_eq!(receipts.expired(), 3);

    let refused = || metrics.counter("shardwise_paged_expired_receipts_total", "s0");
    let w2 = by_message_resuming(&service, &store, &receipts, "w2", None, false, &seen).await;
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert!(refused() >= Some(2), "refused, and again: {:?}", refused());
    assert_eq!(handled(&seen, "w2", "c"), 0, "c not handled again unasked");
    w2.shutdown(Duration::from_secs(5)).await;

    let w3 = by_message_resuming(&service, &store, &receipts, "w3", None, true, &seen).await;
    wait_for(
        "stall handled once resumed",
        Duration::from_secs(120),
        || handled(&seen, "w3", "stall") == 1,
    )
    .await;
    w3.shutdown(Duration::from_secs(5)).await;
    assert_eq!(
        handled(&seen, "w3", "c"),
        1,
        "handled again, as the operator chose"
    );
}

/// A stream held all along is never refused: its audits (every 5 minutes) move its mark, and so
/// what a replay needs, with them. Events handled at the start; the worker reads the quiet
/// stream for a day and a half (receipts kept a day), then hands it over gracefully: the next worker reads on,
/// refusing nothing and handling nothing again.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_stream_held_longer_than_receipts_are_kept_is_not_refused_at_a_move() {
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 43);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    let store = MemoryLeaseStore::new();
    let receipts = MemoryReceipts::new().retention(DAY, 43);
    let seen = Messages::default();
    put(&service, 3);
    let w1 = by_message_resuming(&service, &store, &receipts, "w1", None, false, &seen).await;
    tokio::time::sleep(DAY + DAY / 2).await;
    w1.shutdown(Duration::from_secs(5)).await;
    put(&service, 2);
    let w2 = by_message_resuming(&service, &store, &receipts, "w2", None, false, &seen).await;
    wait_for("the new events", Duration::from_secs(120), || {
        seen.lock().unwrap().len() == 5
    })
    .await;
    w2.shutdown(Duration::from_secs(5)).await;
    assert_eq!(
        metrics.counter("shardwise_paged_expired_receipts_total", "s0"),
        None
    );
}

/// A late event put behind `closedThrough` (50 minutes old, within the hour's lateness) just
/// before the worker is killed, so that no audit read it; the fleet is down 20 hours. The next
/// worker catches up in steps, and the steps read only ahead of `closedThrough`. Before, no audit
/// ran during a catch-up, and the first one back at the present started its window 20 hours past
/// the late event: it was never handed out, nothing counted (the long logs simulation, seed 5 of
/// its first 200: "1 never handed out"). Now an audit due during a catch-up reads behind its
/// start, and the late event is handed out.
#[tokio::test(start_paused = true)]
async fn a_late_event_behind_closed_through_is_found_when_the_next_worker_catches_up_in_steps() {
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 47);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.create_stream("s0");
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let start = |calls: &Calls| {
        let calls = calls.clone();
        let source = CloudWatchLogsFilter::new(service.client(), GROUP);
        Consumer::paged(Arc::new(source), "app", move |d: Delivery| {
            calls.push("w1", &d);
            async { Outcome::Ack }
        })
        .worker_id("w1")
        .poll_interval(Duration::from_secs(5))
        .checkpoint_interval(Duration::from_secs(1))
        .lease_settings(
            LeaseSettings::default()
                .lease_duration(Duration::from_secs(10))
                .scan_interval(Duration::from_secs(2)),
        )
        .lease_store(Arc::new(store.clone()))
        .build()
        .unwrap()
        .run()
    };
    let closed = || {
        store
            .snapshot()
            .first()
            .and_then(|r| r.progress.as_ref()?.closed_through)
    };
    let running = start(&calls).await.unwrap();
    let mut expected = Vec::new();
    for minute in 0..30 {
        let now = service.now();
        expected.extend(
            service
                .put("s0", &[(now, format!("minute {minute}"))], Duration::ZERO)
                .expect("accepted")
                .into_iter()
                .map(|e| e.event_id),
        );
        tokio::time::sleep(Duration::from_secs(60)).await;
    }
    wait_for(
        "closed past the late event",
        Duration::from_secs(600),
        || closed().is_some_and(|c| c > service.now() - 50 * 60_000),
    )
    .await;
    let now = service.now();
    let late: Vec<String> = service
        .put(
            "s0",
            &[(now - 50 * 60_000, "late".to_string())],
            Duration::ZERO,
        )
        .expect("accepted")
        .into_iter()
        .map(|e| e.event_id)
        .collect();
    running.abort();
    assert!(closed().is_some_and(|c| c > now - 50 * 60_000));
    expected.extend(late.iter().cloned());

    tokio::time::sleep(Duration::from_secs(20 * 3600)).await;
    let running = start(&calls).await.unwrap();
    wait_for("caught up", Duration::from_secs(6 * 3600), || {
        closed().is_some_and(|c| c > service.now() - 3_600_000)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(600)).await;
    running.shutdown(Duration::from_secs(5)).await;
    let handled = calls.ids();
    assert!(
        handled.contains(&late[0]),
        "the late event was never handed out"
    );
    let mut unique = handled.clone();
    unique.sort();
    unique.dedup();
    expected.sort();
    assert_eq!(unique, expected, "every event");
}

/// Lambda's pattern: a log stream per execution environment, busy for a while and then silent
/// for good, while CloudWatch keeps it. A stream with nothing new for an hour (the default)
/// retires: its last audit runs, its progress is written, and its row is left unowned with
/// `retiredAt`; nobody renews it or reads it. A listing of the group showing it took events after
/// that (`lastIngestionTime`) wakes it: it is read on from its cursor, new events and late ones
/// (30 minutes old) handed out once. Before, every stream stayed open for good: a lease renewal
/// every few seconds and a GetLogEvents every poll interval for each dead stream.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn idle_streams_retire_cost_no_reads_or_lease_writes_and_wake_when_they_take_events() {
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 23);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    let streams = ["s0", "s1", "s2"];
    let mut expected = Vec::new();
    for stream in streams {
        service.create_stream(stream);
        expected.extend(put_into(&service, stream, 3));
    }
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let hours = |h: u64| Duration::from_secs(3600 * h);
    let running = consumer(&service, &store, &calls).await;
    wait_for("the first events", Duration::from_secs(120), || {
        calls.len() == 9
    })
    .await;

    // Two hours later every stream has retired.
    tokio::time::sleep(hours(2)).await;
    let rows = store.snapshot();
    for row in &rows {
        assert!(
            row.retired_at.is_some() && row.owner.is_none(),
            "{} is retired: {row:?}",
            row.shard_id
        );
    }
    // Three hours more: no read of a retired stream, no write to its row.
    let reads = |stream: &str| {
        service
            .counts()
            .get_log_events
            .get(stream)
            .copied()
            .unwrap_or(0)
    };
    let reads_before: Vec<u64> = streams.iter().map(|s| reads(s)).collect();
    tokio::time::sleep(hours(3)).await;
    let reads_after: Vec<u64> = streams.iter().map(|s| reads(s)).collect();
    assert_eq!(reads_after, reads_before, "retired streams are not read");
    assert_eq!(store.snapshot(), rows, "retired rows are not written");
    assert_eq!(
        metrics.counter("shardwise_paged_partitions_retired_total", "w1"),
        Some(3)
    );

    // s1 takes new events, and s2 a late one (30 minutes old): both wake and are read on.
    expected.extend(put_into(&service, "s1", 2));
    expected.extend(put_late(
        &service,
        "s2",
        &[(Duration::from_secs(1800), "late 30 min")],
    ));
    wait_for(
        "the woken streams' events",
        Duration::from_secs(600),
        || calls.len() == 12,
    )
    .await;
    let s0 = store
        .snapshot()
        .into_iter()
        .find(|r| r.shard_id == "s0")
        .unwrap();
    assert!(s0.retired_at.is_some(), "s0 took nothing and sleeps on");
    assert_eq!(
        reads("s0"),
        reads_before[0],
        "s0 is not read: {:?}",
        service.counts()
    );
    assert_eq!(
        metrics.counter("shardwise_paged_partitions_woken_total", "w1"),
        Some(2)
    );
    tokio::time::sleep(Duration::from_secs(600)).await;
    running.shutdown(Duration::from_secs(5)).await;
    let mut handled = calls.ids();
    handled.sort();
    expected.sort();
    assert_eq!(handled, expected, "every event once");
}

/// Retired streams deleted: the next listing no longer names one, which wakes its row; its
/// reader finds the stream gone and the row is deleted. A retired stream deleted and created
/// again under its name, with events, wakes (the new stream's `lastIngestionTime`), is found to
/// be another stream (its creation time), ends, and the new stream is read from its first event
/// under a row of its own. DescribeLogStreams shows each ingestion 20 minutes late here.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn retired_streams_deleted_or_created_again_end_and_the_new_ones_are_read_whole() {
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 29);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    service.set_activity_lag(Duration::from_secs(1200));
    let mut expected = Vec::new();
    for stream in ["s0", "s1", "s2"] {
        service.create_stream(stream);
        expected.extend(put_into(&service, stream, 2));
    }
    let store = MemoryLeaseStore::new();
    let calls = Calls::default();
    let running = consumer(&service, &store, &calls).await;
    wait_for("the first events", Duration::from_secs(120), || {
        calls.len() == 6
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2 * 3600)).await;
    assert!(
        store.snapshot().iter().all(|r| r.retired_at.is_some()),
        "{:?}",
        store.snapshot()
    );

    service.delete_stream("s1");
    service.delete_stream("s2");
    tokio::time::sleep(Duration::from_secs(1)).await;
    service.create_stream("s2");
    tokio::time::sleep(Duration::from_secs(1)).await;
    expected.extend(put_into(&service, "s2", 3));
    wait_for(
        "the deleted stream's row to go",
        Duration::from_secs(600),
        || !has_row(&store, "s1"),
    )
    .await;
    wait_for(
        "the stream created again, read whole (after the listing's 20 minutes)",
        Duration::from_secs(3600),
        || calls.len() == 9,
    )
    .await;
    let s0 = store
        .snapshot()
        .into_iter()
        .find(|r| r.shard_id == "s0")
        .unwrap();
    assert!(s0.retired_at.is_some(), "s0 sleeps on");
    tokio::time::sleep(Duration::from_secs(600)).await;
    running.shutdown(Duration::from_secs(5)).await;
    let mut handled = calls.ids();
    handled.sort();
    expected.sort();
    assert_eq!(handled, expected, "every event once");
}
