//! What the process tests share: the `shardwise` binary as workers (spawned, signalled, killed),
//! the handled-record log they append to, records put and trickled onto a stream, the lease table
//! read raw from DynamoDB, and the checks every test makes on the log (nothing skipped, order per
//! key, duplicates).

use aws_sdk_dynamodb::types::AttributeValue;
use aws_sdk_kinesis::types::ShardIteratorType;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::support;

pub const BIN: &str = env!("CARGO_BIN_EXE_shardwise");

/// Short lease settings that keep the tests quick (3 s lease, 1 s renew, 500 ms scan).
pub const FAST: &[&str] = &[
    "--lease-duration",
    "3000ms",
    "--scan-interval",
    "500ms",
    "--checkpoint-interval",
    "200ms",
    "--poll-interval",
    "200ms",
];

/// The emulators are shared by the tests of this file, two of which run at a time. A test that
/// loads them heavily (moto's transactions copy whole tables under Python's lock, stalling every
/// other request for seconds) takes them alone (`write`), so the lease timings of the others
/// (3 s leases in `FAST`) are not judged against a stalled emulator; every other test takes its
/// turn alongside one more (`read`).
pub static EMULATORS: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

// ---------------------------------------------------------------------------------------------
// The handled-record log

/// One handled delivery, as a worker printed it, with the time this test read the line.
#[derive(Debug, Clone)]
pub struct Handled {
    pub at: Instant,
    pub worker: String,
    pub shard: String,
    pub sequence: String,
    pub key: String,
    pub id: u64,
    /// The outcome the line names (with receipts, how the delivery settled).
    pub outcome: String,
    /// With receipts: settled from an existing receipt (its effects were not applied again).
    pub replay: bool,
}

/// Every line every worker of a test printed, in the order this test read them (each worker's
/// lines keep that worker's order).
#[derive(Clone)]
pub struct Log {
    pub t0: Instant,
    pub lines: Arc<Mutex<Vec<Handled>>>,
    pub garbage: Arc<Mutex<Vec<String>>>,
}

impl Default for Log {
    fn default() -> Self {
        Log {
            t0: Instant::now(),
            lines: Arc::default(),
            garbage: Arc::default(),
        }
    }
}

impl Log {
    pub fn push_raw(&self, line: &str, at: Instant) {
        match parse_line(line, at) {
            Some(h) => self.lines.lock().unwrap().push(h),
            None => self.garbage.lock().unwrap().push(line.to_owned()),
        }
    }

    pub fn len(&self) -> usize {
        self.lines.lock().unwrap().len()
    }

    pub fn snapshot(&self) -> Vec<Handled> {
        self.lines.lock().unwrap().clone()
    }

    pub fn distinct_ids(&self) -> usize {
        let lines = self.lines.lock().unwrap();
        lines.iter().map(|h| h.id).collect::<HashSet<_>>().len()
    }

    pub fn count_of(&self, worker: &str) -> usize {
        let lines = self.lines.lock().unwrap();
        lines.iter().filter(|h| h.worker == worker).count()
    }

    /// Writes every line (ms since the log was made, worker, shard, sequence, key, id) to a file next
    /// to the workers' stderr, for investigation.
    pub fn dump(&self, name: &str) {
        let t0 = self.t0;
        use std::fmt::Write as _;
        let mut text = String::new();
        for h in self.lines.lock().unwrap().iter() {
            let _ = writeln!(
                text,
                "{} {} {} {} {} {}",
                h.at.saturating_duration_since(t0).as_millis(),
                h.worker,
                h.shard,
                h.sequence,
                h.key,
                h.id
            );
        }
        let path = log_dir().join(format!("{name}.log"));
        std::fs::write(&path, text).expect("write the log");
        eprintln!("log of handled records: {}", path.display());
    }

    /// Asserts every stdout line was a delivery line.
    pub fn assert_no_garbage(&self) {
        let garbage = self.garbage.lock().unwrap();
        assert!(
            garbage.is_empty(),
            "stdout lines that are not deliveries: {:?}",
            &garbage[..garbage.len().min(5)]
        );
    }
}

pub fn parse_line(line: &str, at: Instant) -> Option<Handled> {
    let v: Value = serde_json::from_str(line).ok()?;
    let data: Value = serde_json::from_str(v["data"].as_str()?).ok()?;
    Some(Handled {
        at,
        worker: v["worker"].as_str()?.to_owned(),
        shard: v["shard"].as_str()?.to_owned(),
        sequence: v["sequence"].as_str()?.to_owned(),
        key: v["partition_key"].as_str()?.to_owned(),
        replay: v["replay"].as_bool().unwrap_or(false),
        outcome: v["outcome"].as_str()?.to_owned(),
        id: data["id"].as_u64()?,
    })
}

// ---------------------------------------------------------------------------------------------
// Workers

/// Where worker stderr files and dumped logs go.
pub fn log_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("process_live");
    std::fs::create_dir_all(&dir).expect("a directory for worker logs");
    dir
}

/// A `shardwise consume` child. Dropping it kills the process (so a failing test leaves none).
pub struct Worker {
    pub id: String,
    pub child: Child,
    pub reader: Option<std::thread::JoinHandle<()>>,
    pub stderr: PathBuf,
    pub exit: Option<ExitStatus>,
}

impl Worker {
    pub fn spawn(stream: &str, app: &str, id: &str, args: &[&str], log: &Log) -> Worker {
        Self::spawn_with_env(stream, app, id, args, &[], log)
    }

    /// [`spawn`](Self::spawn), with these environment variables set for the worker (and the
    /// programs it runs).
    pub fn spawn_with_env(
        stream: &str,
        app: &str,
        id: &str,
        args: &[&str],
        env: &[(&str, String)],
        log: &Log,
    ) -> Worker {
        let dir = log_dir();
        let stderr = dir.join(format!("{app}-{id}.stderr"));
        let file = File::create(&stderr).expect("a worker stderr file");
        let mut child = Command::new(BIN)
            .args([
                "consume",
                "--stream",
                stream,
                "--app",
                app,
                "--worker-id",
                id,
            ])
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env(
                "RUST_LOG",
                std::env::var(format!("SHARDWISE_TEST_WORKER_LOG_{id}"))
                    .unwrap_or_else(|_| "shardwise=info,warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(file)
            .spawn()
            .expect("spawn shardwise consume");
        let stdout = child.stdout.take().expect("piped stdout");
        let log = log.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let at = Instant::now();
                match line {
                    Ok(line) => log.push_raw(&line, at),
                    Err(_) => return,
                }
            }
        });
        eprintln!(
            "worker {id}: pid {}, stderr {}",
            child.id(),
            stderr.display()
        );
        Worker {
            id: id.to_owned(),
            child,
            reader: Some(reader),
            stderr,
            exit: None,
        }
    }

    /// Asks for a graceful shutdown.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM {} failed", self.child.id());
    }

    /// SIGKILL; returns the instant the signal was sent.
    pub async fn kill9(&mut self) -> Instant {
        self.child.kill().expect("SIGKILL");
        let at = Instant::now();
        self.wait_exit(Duration::from_secs(10)).await;
        at
    }

    /// Waits for the process to exit (and its stdout to be read to the end); returns its status
    /// and the instant the exit was noticed (within ~10 ms).
    pub async fn wait_exit(&mut self, timeout: Duration) -> (ExitStatus, Instant) {
        let deadline = Instant::now() + timeout;
        let (status, at) = loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                break (status, Instant::now());
            }
            assert!(
                Instant::now() < deadline,
                "worker {} did not exit within {timeout:?}; stderr: {}",
                self.id,
                self.stderr_tail()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        self.exit = Some(status);
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        (status, at)
    }

    /// SIGTERM, then asserts a zero exit status within `timeout`.
    pub async fn stop_gracefully(&mut self, timeout: Duration) -> Instant {
        self.terminate();
        let (status, at) = self.wait_exit(timeout).await;
        assert!(
            status.success(),
            "worker {} exited with {status} after SIGTERM; stderr: {}",
            self.id,
            self.stderr_tail()
        );
        at
    }

    pub fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if self.exit.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Other commands

/// Runs `shardwise` with `args` to completion (warnings logged only).
async fn run(args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(BIN)
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("run shardwise")
}

/// Runs `shardwise` to completion and returns stdout (asserting success).
pub async fn shardwise(args: &[&str]) -> String {
    let out = run(args).await;
    assert!(
        out.status.success(),
        "shardwise {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

/// `shardwise put`: ids `start..start + count`, key `key-{id % keys}`.
pub async fn put(stream: &str, count: u64, keys: u64, start: u64) {
    shardwise(&[
        "put",
        "--stream",
        stream,
        "--count",
        &count.to_string(),
        "--keys",
        &keys.to_string(),
        "--start-id",
        &start.to_string(),
    ])
    .await;
}

/// A background writer putting `batch` records every `every`, ids increasing from `start`.
pub struct Trickle {
    pub stop: Arc<AtomicBool>,
    pub next: Arc<AtomicU64>,
    pub task: tokio::task::JoinHandle<()>,
}

impl Trickle {
    pub fn start(stream: &str, keys: u64, start: u64, batch: u64, every: Duration) -> Trickle {
        let stop = Arc::new(AtomicBool::new(false));
        let next = Arc::new(AtomicU64::new(start));
        let (s, n, stream) = (stop.clone(), next.clone(), stream.to_owned());
        let task = tokio::spawn(async move {
            while !s.load(AtomicOrdering::SeqCst) {
                let from = n.load(AtomicOrdering::SeqCst);
                let began = Instant::now();
                put(&stream, batch, keys, from).await;
                n.store(from + batch, AtomicOrdering::SeqCst);
                tokio::time::sleep(every.saturating_sub(began.elapsed())).await;
            }
        });
        Trickle { stop, next, task }
    }

    /// Stops writing; returns the end of the ids written (`start..end`).
    pub async fn stop(self) -> u64 {
        self.stop.store(true, AtomicOrdering::SeqCst);
        self.task.await.expect("trickle task");
        self.next.load(AtomicOrdering::SeqCst)
    }
}

/// Polls `progress` every 20 ms until it reaches `goal`, for as long as it keeps moving: panics
/// with `what` once it has not moved for `stall`. A wait that follows the work it waits for, so
/// a slow machine (or a slow emulator) makes the test slower, not red, while a stuck consumer
/// still fails within `stall`. Returns the largest gap between two moves, for the report.
pub async fn while_progressing(
    what: &str,
    goal: u64,
    stall: Duration,
    mut progress: impl FnMut() -> u64,
) -> Duration {
    let (mut last, mut moved) = (progress(), Instant::now());
    let mut longest = Duration::ZERO;
    while last < goal {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = progress();
        if now != last {
            longest = longest.max(moved.elapsed());
            (last, moved) = (now, Instant::now());
        }
        assert!(
            moved.elapsed() < stall,
            "no progress for {stall:?} waiting: {what} ({last} of {goal})"
        );
    }
    longest
}

// ---------------------------------------------------------------------------------------------
// The lease table

/// One lease row, read raw from DynamoDB.
#[derive(Debug, Clone)]
pub struct Row {
    pub shard: String,
    pub owner: Option<String>,
    pub counter: u64,
    pub checkpoint: String,
    pub sub: u64,
    pub parents: Vec<String>,
    pub children: Vec<String>,
}

/// A checkpoint's order: start sentinels, then sequence numbers by (length, digits), sub-sequence,
/// then SHARD_END.
pub fn checkpoint_order(checkpoint: &str, sub: u64) -> (u8, usize, String, u64) {
    if checkpoint == "SHARD_END" {
        (2, 0, String::new(), 0)
    } else if !checkpoint.is_empty() && checkpoint.bytes().all(|b| b.is_ascii_digit()) {
        (1, checkpoint.len(), checkpoint.to_owned(), sub)
    } else {
        (0, 0, String::new(), 0)
    }
}

/// Sequence numbers compared as numbers.
pub fn seq_order(sequence: &str) -> (usize, &str) {
    (sequence.len(), sequence)
}

pub fn attr_s(item: &HashMap<String, AttributeValue>, name: &str) -> Option<String> {
    match item.get(name) {
        Some(AttributeValue::S(s)) => Some(s.clone()),
        _ => None,
    }
}

pub fn attr_n(item: &HashMap<String, AttributeValue>, name: &str) -> u64 {
    match item.get(name) {
        Some(AttributeValue::N(n)) => n.parse().unwrap_or(0),
        _ => 0,
    }
}

pub fn attr_list(item: &HashMap<String, AttributeValue>, name: &str) -> Vec<String> {
    let mut out: Vec<String> = match item.get(name) {
        Some(AttributeValue::L(l)) => l.iter().filter_map(|v| v.as_s().ok().cloned()).collect(),
        Some(AttributeValue::Ss(s)) => s.clone(),
        _ => Vec::new(),
    };
    out.sort();
    out
}

/// The stream's rows of the application's lease table (consistent Scan); empty while the table
/// does not exist yet.
pub async fn try_rows(live: &support::Live, app: &str, stream: &str) -> Result<Vec<Row>, String> {
    let items = live
        .dynamodb
        .scan()
        .table_name(app)
        .consistent_read(true)
        .into_paginator()
        .items()
        .send()
        .try_collect()
        .await;
    let items = match items {
        Ok(items) => items,
        Err(e)
            if e.as_service_error()
                .is_some_and(|e| e.is_resource_not_found_exception()) =>
        {
            return Ok(Vec::new());
        }
        Err(e) => return Err(format!("{e:?}")),
    };
    let mut rows: Vec<Row> = items
        .iter()
        .filter(|item| attr_s(item, "streamName").as_deref() == Some(stream))
        .map(|item| Row {
            shard: attr_s(item, "shardId").unwrap_or_default(),
            owner: attr_s(item, "leaseOwner"),
            counter: attr_n(item, "leaseCounter"),
            checkpoint: attr_s(item, "checkpoint").unwrap_or_default(),
            sub: attr_n(item, "checkpointSub"),
            parents: attr_list(item, "parentShardIds"),
            children: attr_list(item, "childShardIds"),
        })
        .collect();
    rows.sort_by(|a, b| a.shard.cmp(&b.shard));
    Ok(rows)
}

pub async fn rows(live: &support::Live, app: &str, stream: &str) -> Vec<Row> {
    try_rows(live, app, stream)
        .await
        .expect("scan the lease table")
}

/// Leases per owner (unowned rows and ended shards are not counted).
pub fn load(rows: &[Row]) -> BTreeMap<String, usize> {
    let mut load = BTreeMap::new();
    for r in rows {
        if let Some(owner) = &r.owner
            && r.checkpoint != "SHARD_END"
        {
            *load.entry(owner.clone()).or_insert(0) += 1;
        }
    }
    load
}

/// Polls the table until `cond` holds; returns the rows that satisfied it.
pub async fn wait_rows(
    live: &support::Live,
    app: &str,
    stream: &str,
    what: &str,
    timeout: Duration,
    cond: impl Fn(&[Row]) -> bool,
) -> Vec<Row> {
    let deadline = Instant::now() + timeout;
    let mut last = Vec::new();
    loop {
        if let Ok(rows) = try_rows(live, app, stream).await {
            if cond(&rows) {
                return rows;
            }
            last = rows;
        }
        assert!(
            Instant::now() < deadline,
            "timed out ({timeout:?}) waiting for the lease table: {what}; last rows: {last:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One read of the lease table: `began` before the Scan was sent, `at` once it answered, so
/// every write the rows show happened before `at`, and every write they do not show happened
/// after `began`.
#[derive(Debug, Clone)]
pub struct Sample {
    pub began: Instant,
    pub at: Instant,
    pub rows: Vec<Row>,
}

pub type Samples = Vec<Sample>;

/// Samples the lease table in the background and checks that no checkpoint moves backwards.
pub struct Watcher {
    pub samples: Arc<Mutex<Samples>>,
    pub regressions: Arc<Mutex<Vec<String>>>,
    pub stop: Arc<AtomicBool>,
    pub task: tokio::task::JoinHandle<()>,
}

impl Watcher {
    pub fn start(live: &support::Live, app: &str, stream: &str, every: Duration) -> Watcher {
        let samples: Arc<Mutex<Samples>> = Arc::default();
        let regressions: Arc<Mutex<Vec<String>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (live, app, stream) = (live.clone(), app.to_owned(), stream.to_owned());
        let (s, r, st) = (samples.clone(), regressions.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let mut last: HashMap<String, (String, u64)> = HashMap::new();
            while !st.load(AtomicOrdering::SeqCst) {
                let began = Instant::now();
                if let Ok(rows) = try_rows(&live, &app, &stream).await {
                    let at = Instant::now();
                    for row in &rows {
                        if let Some((cp, sub)) = last.get(&row.shard)
                            && checkpoint_order(&row.checkpoint, row.sub)
                                < checkpoint_order(cp, *sub)
                        {
                            r.lock().unwrap().push(format!(
                                "{}: checkpoint went back from {cp}.{sub} to {}.{} (owner {:?})",
                                row.shard, row.checkpoint, row.sub, row.owner
                            ));
                        }
                        last.insert(row.shard.clone(), (row.checkpoint.clone(), row.sub));
                    }
                    s.lock().unwrap().push(Sample { began, at, rows });
                }
                tokio::time::sleep(every.saturating_sub(began.elapsed())).await;
            }
        });
        Watcher {
            samples,
            regressions,
            stop,
            task,
        }
    }

    /// Stops sampling, asserts no checkpoint went backwards, and returns the samples.
    pub async fn finish(self) -> Samples {
        self.stop.store(true, AtomicOrdering::SeqCst);
        self.task.await.expect("watcher task");
        let regressions = self.regressions.lock().unwrap().clone();
        let samples = std::mem::take(&mut *self.samples.lock().unwrap());
        assert!(
            !samples.is_empty(),
            "the lease table was never sampled during the run"
        );
        assert!(
            regressions.is_empty(),
            "checkpoints moved backwards: {regressions:#?}"
        );
        samples
    }

    pub fn samples(&self) -> Samples {
        self.samples.lock().unwrap().clone()
    }
}

// ---------------------------------------------------------------------------------------------
// Checks on the log

/// Asserts every id in `0..n` was handled at least once (and nothing else was).
pub fn assert_nothing_skipped(lines: &[Handled], n: u64) {
    let seen: BTreeSet<u64> = lines.iter().map(|h| h.id).collect();
    let missing: Vec<u64> = (0..n).filter(|id| !seen.contains(id)).collect();
    assert!(
        missing.is_empty(),
        "{} of {n} ids were never handled (skipped): first {:?}",
        missing.len(),
        &missing[..missing.len().min(20)]
    );
    let unknown: Vec<u64> = seen.iter().copied().filter(|id| *id >= n).collect();
    assert!(unknown.is_empty(), "ids never written: {unknown:?}");
}

/// Ids handled more than once, with their counts.
pub fn duplicates(lines: &[Handled]) -> BTreeMap<u64, usize> {
    let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
    for h in lines {
        *counts.entry(h.id).or_insert(0) += 1;
    }
    counts.retain(|_, c| *c > 1);
    counts
}

/// Extra deliveries (lines beyond the first of each id).
pub fn extra_deliveries(lines: &[Handled]) -> usize {
    duplicates(lines).values().map(|c| c - 1).sum()
}

/// Per-key order: within `lines` (in log order), each key's ids strictly increase. Also checks that
/// the key matches the id (`key-{id % keys}`).
pub fn order_violations<'a>(
    lines: impl IntoIterator<Item = &'a Handled>,
    keys: u64,
) -> Vec<String> {
    let mut last: HashMap<&str, &Handled> = HashMap::new();
    let mut out = Vec::new();
    for h in lines {
        if h.key != format!("key-{}", h.id % keys) {
            out.push(format!("id {} came with key {}", h.id, h.key));
        }
        if let Some(before) = last.get(h.key.as_str())
            && before.id >= h.id
        {
            out.push(format!(
                "{}: id {} ({} {} seq {}) after id {} ({} {} seq {})",
                h.key,
                h.id,
                h.worker,
                h.shard,
                h.sequence,
                before.id,
                before.worker,
                before.shard,
                before.sequence
            ));
        }
        last.insert(h.key.as_str(), h);
    }
    out
}

pub fn assert_order(lines: &[Handled], keys: u64, what: &str) {
    let violations = order_violations(lines, keys);
    assert!(
        violations.is_empty(),
        "per-key order broken ({what}): {} violations, first: {:#?}",
        violations.len(),
        &violations[..violations.len().min(10)]
    );
}

pub fn assert_order_per_worker(lines: &[Handled], keys: u64) {
    let workers: BTreeSet<&str> = lines.iter().map(|h| h.worker.as_str()).collect();
    for w in workers {
        let mine: Vec<Handled> = lines.iter().filter(|h| h.worker == w).cloned().collect();
        assert_order(&mine, keys, &format!("worker {w}"));
    }
}

pub fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Every record of one shard in order: (sequence, id).
pub async fn read_shard(live: &support::Live, stream: &str, shard: &str) -> Vec<(String, u64)> {
    read_records(live, stream, shard)
        .await
        .into_iter()
        .map(|(sequence, data)| {
            let data: Value = serde_json::from_slice(&data).expect("JSON data");
            (sequence, data["id"].as_u64().expect("an id"))
        })
        .collect()
}

/// Every record of one shard in order: (sequence, data).
pub async fn read_records(
    live: &support::Live,
    stream: &str,
    shard: &str,
) -> Vec<(String, Vec<u8>)> {
    let mut iterator = live
        .kinesis
        .get_shard_iterator()
        .stream_name(stream)
        .shard_id(shard)
        .shard_iterator_type(ShardIteratorType::TrimHorizon)
        .send()
        .await
        .expect("GetShardIterator")
        .shard_iterator
        .expect("an iterator");
    let mut out = Vec::new();
    loop {
        let page = live
            .kinesis
            .get_records()
            .shard_iterator(&iterator)
            .limit(10_000)
            .send()
            .await
            .expect("GetRecords");
        for r in page.records() {
            out.push((r.sequence_number().to_owned(), r.data().as_ref().to_vec()));
        }
        if page.records().is_empty() && page.millis_behind_latest() == Some(0) {
            return out;
        }
        match page.next_shard_iterator {
            Some(next) => iterator = next,
            None => return out,
        }
    }
}

pub async fn cleanup(live: &support::Live, stream: &str, app: &str) {
    live.delete_stream(stream).await;
    live.delete_table(app).await;
}

/// Per shard and worker, the spans in which the worker printed lines for the shard: runs of its
/// lines with gaps below `gap`.
pub fn spans(
    lines: &[Handled],
    gap: Duration,
) -> BTreeMap<(String, String), Vec<(Instant, Instant)>> {
    let mut out: BTreeMap<(String, String), Vec<(Instant, Instant)>> = BTreeMap::new();
    for h in lines {
        let spans = out.entry((h.shard.clone(), h.worker.clone())).or_default();
        match spans.last_mut() {
            Some((_, end)) if h.at.saturating_duration_since(*end) < gap => {
                *end = (*end).max(h.at);
            }
            _ => spans.push((h.at, h.at)),
        }
    }
    out
}

/// Runs `shardwise` expecting it to fail, and returns stderr.
pub async fn shardwise_fails(args: &[&str]) -> String {
    let out = run(args).await;
    assert!(
        !out.status.success(),
        "shardwise {args:?} succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stderr).expect("utf-8 stderr")
}

/// The receipts `shardwise receipts --json` lists for `app` (restricted to `id` if given).
pub async fn receipts_of(app: &str, id: Option<&str>) -> Vec<serde_json::Value> {
    let mut args = vec!["receipts", "--app", app, "--json"];
    if let Some(id) = id {
        args.extend(["--id", id]);
    }
    shardwise(&args)
        .await
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON receipt"))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// A production worker: any program as the handler, metrics and health

/// The examples' Python handler, as `--exec` runs it, with `delay_ms` of work per record.
pub fn python_handler(delay_ms: u64) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/exec_handler.py");
    format!("HANDLER_DELAY_MS={delay_ms} python3 -u {script}")
}

/// Whether process `pid` runs: it exists and is not a zombie (an orphan that exited stays a zombie
/// until the container's init reaps it, and some inits never do).
pub fn running(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // `PID (COMM) STATE ...`: the state follows the last parenthesis (COMM may hold any).
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().next());
    !matches!(state, Some("Z" | "X") | None)
}

/// The process ids of `pid`'s children (Linux: `/proc/PID/task/*/children`).
pub fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for task in tasks.flatten() {
            if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
                out.extend(
                    text.split_whitespace()
                        .filter_map(|p| p.parse::<u32>().ok()),
                );
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// A free TCP port on the loopback.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// A plain HTTP/1.1 GET: the status code and the body.
pub async fn http_get(port: u16, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the metrics address");
    let request = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    conn.write_all(request.as_bytes()).await.expect("write");
    let mut response = String::new();
    conn.read_to_string(&mut response).await.expect("read");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_owned());
    (status, body)
}

/// The value of the Prometheus sample `name{labels}` whose labels include every `want`.
pub fn sample(text: &str, name: &str, want: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .find(|(series, _)| {
            (series == &name || series.starts_with(&format!("{name}{{")))
                && want.iter().all(|w| series.contains(w))
        })
        .and_then(|(_, v)| v.parse().ok())
}
