//! `shardwise consume --log-group` as a black box against moto's CloudWatch Logs and DynamoDB:
//! a worker is killed with SIGKILL mid-run while events keep arriving, another takes over, and
//! every event of every log stream is handled (read from the workers' JSON lines), the paged
//! checkpoints in the lease table never move back, `shardwise leases --json` shows them, and
//! SIGTERM stops the last worker gracefully. The same with `--by-timestamp --close-horizon 2s`, which
//! reads the whole group through `FilterLogEvents` and checkpoints `closed_through`, which
//! `shardwise frontier --log-group G --by-timestamp` reports as the application's frontier.

#[path = "../../tests/support/logs.rs"]
mod logs;
#[path = "../../tests/support/mod.rs"]
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use aws_sdk_cloudwatchlogs::types::InputLogEvent;
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_shardwise");

const FAST: &[&str] = &[
    "--lease-duration",
    "3000ms",
    "--scan-interval",
    "500ms",
    "--checkpoint-interval",
    "200ms",
    "--poll-interval",
    "200ms",
];

/// A `shardwise consume --log-group` child whose stdout lines are collected; killed when dropped.
struct Worker {
    child: Child,
    reader: Option<std::thread::JoinHandle<()>>,
    stderr: std::path::PathBuf,
}

impl Worker {
    fn spawn(
        group: &str,
        app: &str,
        id: &str,
        extra: &[&str],
        lines: &Arc<Mutex<Vec<Value>>>,
    ) -> Worker {
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("logs_live");
        std::fs::create_dir_all(&dir).unwrap();
        let stderr = dir.join(format!("{app}-{id}.stderr"));
        let mut child = Command::new(BIN)
            .args([
                "consume",
                "--log-group",
                group,
                "--app",
                app,
                "--worker-id",
                id,
                "--lanes",
                "4",
                "--handler-delay",
                "10ms",
            ])
            .args(FAST)
            .args(extra)
            .env("RUST_LOG", "shardwise=info,warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(File::create(&stderr).unwrap())
            .spawn()
            .expect("spawn shardwise consume");
        let stdout = child.stdout.take().unwrap();
        let lines = lines.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let value: Value = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
                lines.lock().unwrap().push(value);
            }
        });
        Worker {
            child,
            reader: Some(reader),
            stderr,
        }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    async fn wait_exit(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                if let Some(reader) = self.reader.take() {
                    reader.join().expect("the stdout reader");
                }
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "no exit; stderr: {}",
                self.stderr()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

async fn put(
    logs: &aws_sdk_cloudwatchlogs::Client,
    group: &str,
    stream: &str,
    range: std::ops::Range<u32>,
) {
    let at = now_ms() - 30_000;
    let events = range
        .map(|i| {
            InputLogEvent::builder()
                .timestamp(at + i64::from(i / 4))
                .message(format!("{stream}:{i}"))
                .build()
                .unwrap()
        })
        .collect();
    let out = logs
        .put_log_events()
        .log_group_name(group)
        .log_stream_name(stream)
        .set_log_events(Some(events))
        .send()
        .await
        .unwrap();
    assert!(out.rejected_log_events_info.is_none(), "{out:?}");
}

/// The paged progress of every row: partition -> (applied position bytes, version).
async fn progress(live: &support::Live, table: &str) -> BTreeMap<String, (Option<Vec<u8>>, u64)> {
    let Ok(out) = live
        .dynamodb
        .scan()
        .table_name(table)
        .consistent_read(true)
        .send()
        .await
    else {
        return BTreeMap::new();
    };
    // Lease rows only (the table also holds the frontier membership item, without a shard).
    out.items()
        .iter()
        .filter_map(|item| Some((item.get("shardId")?.as_s().ok()?.clone(), item)))
        .map(|(shard, item)| {
            let applied = item
                .get("appliedPosition")
                .and_then(|v| v.as_b().ok())
                .map(|b| b.as_ref().to_vec());
            let version = item
                .get("checkpointVersion")
                .and_then(|v| v.as_n().ok())
                .map_or(0, |n| n.parse().unwrap());
            (shard, (applied, version))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consume_log_group_survives_kill_9_and_skips_nothing() {
    let live = live_or_skip!();
    assert!(
        std::env::var("AWS_ENDPOINT_URL_CLOUDWATCH_LOGS").is_ok(),
        "AWS_ENDPOINT_URL_CLOUDWATCH_LOGS is not set: start the emulators with scripts/emulators"
    );
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .load()
        .await;
    let logs = aws_sdk_cloudwatchlogs::Client::new(&config);
    let group = support::unique_name("/shardwise/cli");
    let app = support::unique_name("logs-app");
    logs.create_log_group()
        .log_group_name(&group)
        .send()
        .await
        .unwrap();
    let streams = ["api", "worker/1"];
    for stream in streams {
        logs.create_log_stream()
            .log_group_name(&group)
            .log_stream_name(stream)
            .send()
            .await
            .unwrap();
        put(&logs, &group, stream, 0..400).await;
    }

    let lines = Arc::new(Mutex::new(Vec::<Value>::new()));
    let mut w1 = Worker::spawn(&group, &app, "w1", &[], &lines);
    // Watch the lease table: applied positions and versions never move back.
    let watching = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let watcher = {
        let (live, app, watching) = (live.clone(), app.clone(), watching.clone());
        tokio::spawn(async move {
            let mut last: BTreeMap<String, (Option<Vec<u8>>, u64)> = BTreeMap::new();
            let mut samples = 0;
            while watching.load(std::sync::atomic::Ordering::SeqCst) {
                for (shard, (applied, version)) in progress(&live, &app).await {
                    if let Some((was_applied, was_version)) = last.get(&shard) {
                        assert!(
                            applied >= *was_applied,
                            "{shard}: applied position went back"
                        );
                        assert!(version >= *was_version, "{shard}: version went back");
                    }
                    last.insert(shard, (applied, version));
                }
                samples += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            samples
        })
    };
    let count = |lines: &Arc<Mutex<Vec<Value>>>| lines.lock().unwrap().len();
    let deadline = Instant::now() + Duration::from_secs(30);
    while count(&lines) < 250 {
        assert!(
            Instant::now() < deadline,
            "w1 handled {}; stderr: {}",
            count(&lines),
            w1.stderr()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Mid-run, with events still arriving: SIGKILL.
    put(&logs, &group, "api", 400..500).await;
    w1.child.kill().unwrap();
    w1.wait_exit(Duration::from_secs(5)).await;
    let by_w1 = count(&lines);
    put(&logs, &group, "worker/1", 400..500).await;

    let mut w2 = Worker::spawn(&group, &app, "w2", &[], &lines);
    let expected: BTreeSet<String> = streams
        .iter()
        .flat_map(|s| (0..500).map(move |i| format!("{s}:{i}")))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let seen: BTreeSet<String> = lines
            .lock()
            .unwrap()
            .iter()
            .filter_map(|v| v["data"].as_str().map(str::to_string))
            .collect();
        if expected.is_subset(&seen) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} events; stderr of w2: {}",
            expected.intersection(&seen).count(),
            expected.len(),
            w2.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The lease table as `shardwise leases --json` prints it.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let out = Command::new(BIN)
        .args(["leases", "--app", &app, "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    for row in &rows {
        assert_eq!(row["stream"], format!("logs:{group}"));
        assert_eq!(row["owner"], "w2");
        assert!(
            row["resume_cursor"].as_str().unwrap().starts_with("v5|"),
            "{row}"
        );
        assert!(row["applied_position"].as_str().is_some(), "{row}");
        assert!(row["checkpoint_version"].as_u64().unwrap() >= 1, "{row}");
    }

    // SIGTERM: a graceful stop, with its report.
    let status = Command::new("kill")
        .args(["-TERM", &w2.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(w2.wait_exit(Duration::from_secs(15)).await.success());
    assert!(
        w2.stderr().contains(r#""event":"shutdown""#),
        "{}",
        w2.stderr()
    );
    watching.store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(watcher.await.unwrap() > 3, "the lease table was watched");

    let lines = lines.lock().unwrap().clone();
    let mut per_event: BTreeMap<String, usize> = BTreeMap::new();
    for line in &lines {
        for field in ["partition", "position", "id", "timestamp", "worker", "data"] {
            assert!(!line[field].is_null(), "`{field}` missing: {line}");
        }
        let data = line["data"].as_str().unwrap();
        let (stream, _) = data.rsplit_once(':').unwrap();
        assert_eq!(line["partition"], stream, "{line}");
        *per_event.entry(data.to_string()).or_default() += 1;
    }
    let duplicates: usize = per_event.values().map(|n| n - 1).sum();
    eprintln!(
        "log group: {} events, {} lines ({by_w1} by w1 before SIGKILL), {duplicates} handled twice, 0 missing",
        expected.len(),
        lines.len()
    );
    let _ = logs.delete_log_group().log_group_name(&group).send().await;
    let _ = live.dynamodb.delete_table().table_name(&app).send().await;
}

/// The rows as `shardwise leases --app APP --json` prints them, by partition.
fn leases(app: &str) -> BTreeMap<String, Value> {
    let out = Command::new(BIN)
        .args(["leases", "--app", app, "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .map(|row| (row["shard"].as_str().unwrap().to_string(), row))
        .collect()
}

/// `consume --log-group G --retire-after 2s --shard-sync-interval 1s` on moto: a stream with
/// nothing new retires (once it has been quiet longer than the audit's 30 s allowance too):
/// `leases --json` shows it `retired` with `retired_at_ms`, unowned, while a stream taking an
/// event every second stays owned. Events put into the retired stream wake it: moto's
/// DescribeLogStreams reports them in `lastIngestionTime`, the next listing wakes the row, and
/// they are handled, every event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consume_log_group_retires_an_idle_stream_and_wakes_it_when_it_takes_events() {
    let live = live_or_skip!();
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .load()
        .await;
    let logs = aws_sdk_cloudwatchlogs::Client::new(&config);
    let group = support::unique_name("/shardwise/retire");
    let app = support::unique_name("retire-app");
    logs.create_log_group()
        .log_group_name(&group)
        .send()
        .await
        .unwrap();
    for stream in ["idle", "busy"] {
        logs.create_log_stream()
            .log_group_name(&group)
            .log_stream_name(stream)
            .send()
            .await
            .unwrap();
        put(&logs, &group, stream, 0..20).await;
    }
    let lines = Arc::new(Mutex::new(Vec::<Value>::new()));
    let retiring = ["--retire-after", "2s", "--shard-sync-interval", "1s"];
    let mut w1 = Worker::spawn(&group, &app, "w1", &retiring, &lines);
    let handled = |lines: &Arc<Mutex<Vec<Value>>>| -> BTreeMap<String, usize> {
        let mut per_event = BTreeMap::new();
        for line in lines.lock().unwrap().iter() {
            *per_event
                .entry(line["data"].as_str().unwrap().to_string())
                .or_default() += 1;
        }
        per_event
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while handled(&lines).len() < 40 {
        assert!(Instant::now() < deadline, "stderr: {}", w1.stderr());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // `busy` takes an event every second; `idle` nothing.
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut next = 20;
    let retired = loop {
        put(&logs, &group, "busy", next..next + 1).await;
        next += 1;
        let rows = leases(&app);
        if rows.get("idle").is_some_and(|r| r["state"] == "retired") {
            break rows;
        }
        assert!(
            Instant::now() < deadline,
            "idle never retired: {rows:?}; stderr: {}",
            w1.stderr()
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    assert_eq!(retired["idle"]["owner"], Value::Null, "{retired:?}");
    assert!(
        retired["idle"]["retired_at_ms"].as_i64().is_some(),
        "{retired:?}"
    );
    assert_eq!(retired["busy"]["state"], "owned", "{retired:?}");
    assert!(
        retired["busy"].get("retired_at_ms").is_none(),
        "{retired:?}"
    );

    // Events in the retired stream wake it.
    put(&logs, &group, "idle", 20..30).await;
    let expected: BTreeSet<String> = (0..30)
        .map(|i| format!("idle:{i}"))
        .chain((0..next).map(|i| format!("busy:{i}")))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let seen: BTreeSet<String> = handled(&lines).into_keys().collect();
        if expected.is_subset(&seen) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "missing {:?}; stderr: {}",
            expected.difference(&seen).collect::<Vec<_>>(),
            w1.stderr()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let woken = leases(&app);
    assert_eq!(woken["idle"]["owner"], "w1", "{woken:?}");
    assert!(woken["idle"].get("retired_at_ms").is_none(), "{woken:?}");
    let status = Command::new("kill")
        .args(["-TERM", &w1.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(w1.wait_exit(Duration::from_secs(15)).await.success());
    let twice: Vec<(String, usize)> = handled(&lines)
        .into_iter()
        .filter(|(_, n)| *n > 1)
        .collect();
    assert!(twice.is_empty(), "handled more than once: {twice:?}");
    assert!(
        w1.stderr().contains("idle partition retired"),
        "{}",
        w1.stderr()
    );
    let _ = logs.delete_log_group().log_group_name(&group).send().await;
    let _ = live.dynamodb.delete_table().table_name(&app).send().await;
}

/// `consume --log-group G --by-timestamp --close-horizon 2s --lateness 2s`: the group read by timestamp through
/// `FilterLogEvents`, SIGKILL mid-run while events keep arriving, a second worker finishes: every
/// event handled (by its `eventId`), `closed_through` never moves back and `leases --json` shows
/// it, and SIGTERM stops gracefully.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consume_log_group_by_timestamp_survives_kill_9_and_skips_nothing() {
    let live = live_or_skip!();
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .load()
        .await;
    let logs = aws_sdk_cloudwatchlogs::Client::new(&config);
    let group = support::unique_name("/shardwise/cli-by-time");
    let app = support::unique_name("logs-time-app");
    logs.create_log_group()
        .log_group_name(&group)
        .send()
        .await
        .unwrap();
    let streams = ["api", "worker/1"];
    for stream in streams {
        logs.create_log_stream()
            .log_group_name(&group)
            .log_stream_name(stream)
            .send()
            .await
            .unwrap();
        put(&logs, &group, stream, 0..400).await;
    }
    let extra = [
        "--by-timestamp",
        "--close-horizon",
        "2s",
        "--lateness",
        "2s",
    ];
    let lines = Arc::new(Mutex::new(Vec::<Value>::new()));
    let mut w1 = Worker::spawn(&group, &app, "w1", &extra, &lines);
    let closed = |live: support::Live, app: String| async move {
        let out = live
            .dynamodb
            .scan()
            .table_name(&app)
            .consistent_read(true)
            .send()
            .await
            .ok()?;
        out.items()
            .iter()
            .find(|item| item.contains_key("shardId"))?
            .get("closedThrough")?
            .as_n()
            .ok()?
            .parse::<i64>()
            .ok()
    };
    let watching = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let watcher = {
        let (live, app, watching) = (live.clone(), app.clone(), watching.clone());
        tokio::spawn(async move {
            let (mut last, mut samples) = (None, 0);
            while watching.load(std::sync::atomic::Ordering::SeqCst) {
                let now = closed(live.clone(), app.clone()).await;
                assert!(
                    now >= last,
                    "closed_through went back: {last:?} then {now:?}"
                );
                last = now;
                samples += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            samples
        })
    };
    let count = |lines: &Arc<Mutex<Vec<Value>>>| lines.lock().unwrap().len();
    let deadline = Instant::now() + Duration::from_secs(30);
    while count(&lines) < 250 {
        assert!(
            Instant::now() < deadline,
            "w1 handled {}; stderr: {}",
            count(&lines),
            w1.stderr()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    put(&logs, &group, "api", 400..500).await;
    w1.child.kill().unwrap();
    w1.wait_exit(Duration::from_secs(5)).await;
    let by_w1 = count(&lines);
    let closed_at_kill = closed(live.clone(), app.clone()).await;
    put(&logs, &group, "worker/1", 400..500).await;

    let mut w2 = Worker::spawn(&group, &app, "w2", &extra, &lines);
    let expected: BTreeSet<String> = streams
        .iter()
        .flat_map(|s| (0..500).map(move |i| format!("{s}:{i}")))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let seen: BTreeSet<String> = lines
            .lock()
            .unwrap()
            .iter()
            .filter_map(|v| v["data"].as_str().map(str::to_string))
            .collect();
        if expected.is_subset(&seen) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {} events; stderr of w2: {}",
            expected.intersection(&seen).count(),
            expected.len(),
            w2.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Every event is 30 s old: with a 2 s bound, the last one's group closes.
    let last = lines
        .lock()
        .unwrap()
        .iter()
        .filter_map(|v| v["timestamp"].as_i64())
        .max()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while closed(live.clone(), app.clone()).await < Some(last) {
        assert!(Instant::now() < deadline, "never closed through {last}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let out = Command::new(BIN)
        .args(["leases", "--app", &app, "--json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 1, "one partition, the group: {rows:?}");
    assert_eq!(rows[0]["stream"], format!("logs-by-time:{group}"));
    assert_eq!(rows[0]["shard"], group.as_str());
    assert!(
        rows[0]["closed_through"].as_i64().unwrap() >= last,
        "{}",
        rows[0]
    );
    // `shardwise frontier` for the paged application: one member, the group, complete through its
    // closed timestamp, under membership epoch 1.
    let out = Command::new(BIN)
        .args([
            "frontier",
            "--app",
            &app,
            "--log-group",
            &group,
            "--by-timestamp",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let f: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(f["stream"], format!("logs-by-time:{group}"), "{f}");
    assert_eq!(f["epoch"], "0000000000000001", "{f}");
    assert!(f["frontier_ms"].as_i64().unwrap() >= last, "{f}");
    assert_eq!(f["members"][0]["shard"], group.as_str(), "{f}");
    assert!(
        f["members"][0]["checkpoint_version"].as_u64().unwrap() >= 1,
        "{f}"
    );

    let status = Command::new("kill")
        .args(["-TERM", &w2.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    assert!(w2.wait_exit(Duration::from_secs(15)).await.success());
    watching.store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(watcher.await.unwrap() > 3, "the lease table was watched");

    let lines = lines.lock().unwrap().clone();
    let mut per_event: BTreeMap<String, usize> = BTreeMap::new();
    let mut ids: BTreeMap<String, String> = BTreeMap::new();
    for line in &lines {
        for field in ["partition", "position", "id", "timestamp", "worker", "data"] {
            assert!(!line[field].is_null(), "`{field}` missing: {line}");
        }
        assert_eq!(line["partition"], group.as_str(), "{line}");
        let data = line["data"].as_str().unwrap().to_string();
        let id = line["id"].as_str().unwrap().to_string();
        // The same event always carries the same eventId.
        assert_eq!(ids.entry(data.clone()).or_insert(id.clone()), &id, "{line}");
        *per_event.entry(data).or_default() += 1;
    }
    let duplicates: usize = per_event.values().map(|n| n - 1).sum();
    eprintln!(
        "log group by timestamp: {} events, {} lines ({by_w1} by w1 before SIGKILL, closed through {closed_at_kill:?}), {duplicates} handled twice, 0 missing",
        expected.len(),
        lines.len()
    );
    let _ = logs.delete_log_group().log_group_name(&group).send().await;
    let _ = live.dynamodb.delete_table().table_name(&app).send().await;
}

/// `consume --log-group G --receipts`: receipts outlive the group's events. With no
/// `--receipt-retention`, a group that never expires events has its receipts kept 7 days (a
/// notice says so, and that a stream whose progress is older is refused until sought or resumed
/// past them) and the consumer runs; a `--receipt-retention` shorter than a group with a
/// retention keeps events is refused, naming the flag and both figures.
#[tokio::test]
async fn consume_with_receipts_keeps_them_as_long_as_the_log_group_keeps_events() {
    let live = live_or_skip!();
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .load()
        .await;
    let logs = aws_sdk_cloudwatchlogs::Client::new(&config);
    let group = support::unique_name("/shardwise/kept");
    let app = support::unique_name("kept-app");
    logs.create_log_group()
        .log_group_name(&group)
        .send()
        .await
        .unwrap();
    let lines = Arc::new(Mutex::new(Vec::<Value>::new()));

    let mut forever = Worker::spawn(&group, &app, "w1", &["--receipts"], &lines);
    let notice = "receipts are kept 7.0 days, and a stream whose progress is older";
    let deadline = Instant::now() + Duration::from_secs(20);
    while !forever.stderr().contains(notice) {
        assert!(
            forever.child.try_wait().unwrap().is_none(),
            "exited: {}",
            forever.stderr()
        );
        assert!(Instant::now() < deadline, "no notice: {}", forever.stderr());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        forever.child.try_wait().unwrap().is_none(),
        "a ledger kept 7 days runs: {}",
        forever.stderr()
    );
    drop(forever);

    logs.put_retention_policy()
        .log_group_name(&group)
        .retention_in_days(1)
        .send()
        .await
        .unwrap();
    let mut short = Worker::spawn(
        &group,
        &app,
        "w2",
        &["--receipts", "--receipt-retention", "1day"],
        &lines,
    );
    let status = short.wait_exit(Duration::from_secs(20)).await;
    assert!(!status.success());
    let stderr = short.stderr();
    assert!(
        stderr.contains("error: invalid --receipt-retention")
            && stderr.contains("keeps an event for up to 4.08 days"),
        "{stderr}"
    );
    live.delete_table(&format!("{app}-receipts")).await;
    live.delete_table(&app).await;
}

/// `consume --stream S --cloudwatch-subscription` on the Kinesis stream a subscription filter
/// writes to (moto's CloudWatch Logs and Kinesis, one server): one line per log event, its
/// message as `data`, its log stream as `partition_key`, and `log_group`, `log_event_id` and
/// `log_timestamp`, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consume_a_subscription_filters_stream_handles_each_log_event() {
    let _live = live_or_skip!();
    let moto = std::env::var("AWS_ENDPOINT_URL_CLOUDWATCH_LOGS")
        .expect("AWS_ENDPOINT_URL_CLOUDWATCH_LOGS is not set: start the emulators");
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .load()
        .await;
    let logs = aws_sdk_cloudwatchlogs::Client::new(&config);
    let kinesis = logs::moto_kinesis().await;
    let stream = support::unique_name("cli-cwl-sub");
    let group = support::unique_name("/aws/lambda/cli");
    let app = support::unique_name("cli-cwl-app");
    logs::subscribed_stream(&logs, &kinesis, &group, &stream).await;
    logs.create_log_stream()
        .log_group_name(&group)
        .log_stream_name("s1")
        .send()
        .await
        .unwrap();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    for batch in 0..2 {
        let events: Vec<InputLogEvent> = (0..5)
            .map(|i| {
                InputLogEvent::builder()
                    .timestamp(now + batch * 5 + i)
                    .message(format!("line {}", batch * 5 + i))
                    .build()
                    .unwrap()
            })
            .collect();
        logs.put_log_events()
            .log_group_name(&group)
            .log_stream_name("s1")
            .set_log_events(Some(events))
            .send()
            .await
            .unwrap();
    }
    let lines: Arc<Mutex<Vec<Value>>> = Arc::default();
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("logs_live");
    std::fs::create_dir_all(&dir).unwrap();
    let stderr = dir.join(format!("{app}.stderr"));
    let mut child = Command::new(BIN)
        .args([
            "consume",
            "--stream",
            &stream,
            "--app",
            &app,
            "--cloudwatch-subscription",
        ])
        .args(FAST)
        // The stream is moto's (where its subscription filters write); the lease table too.
        .env("AWS_ENDPOINT_URL_KINESIS", &moto)
        .env("RUST_LOG", "shardwise=info,warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(File::create(&stderr).unwrap())
        .spawn()
        .expect("spawn shardwise consume");
    let stdout = child.stdout.take().unwrap();
    let collected = lines.clone();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let value: Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"));
            collected.lock().unwrap().push(value);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    while lines.lock().unwrap().len() < 10 {
        assert!(
            Instant::now() < deadline,
            "10 lines: {:?}; stderr: {}",
            lines.lock().unwrap(),
            std::fs::read_to_string(&stderr).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = reader.join();
    let lines = lines.lock().unwrap().clone();
    let mut seen: Vec<i64> = Vec::new();
    for line in &lines {
        let data = line["data"].as_str().unwrap();
        let n: i64 = data.strip_prefix("line ").unwrap().parse().unwrap();
        assert_eq!(line["partition_key"], "s1", "{line}");
        assert_eq!(line["log_group"], group.as_str(), "{line}");
        assert_eq!(line["log_timestamp"], now + n, "{line}");
        assert!(
            line["log_event_id"]
                .as_str()
                .is_some_and(|id| !id.is_empty()),
            "{line}"
        );
        assert_eq!(line["subsequence"], n % 5, "{line}");
        seen.push(n);
    }
    assert_eq!(
        seen,
        (0..10).collect::<Vec<_>>(),
        "in order, once each: {lines:?}"
    );
}
