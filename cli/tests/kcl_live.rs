//! `shardwise import-kcl` against a real KCL lease table: kcl-rs (PyPI `kcl-rs`, a Rust port of
//! KCL 3.x that writes KCL's own lease schema) consumes a stream of KPL aggregates and plain
//! records with a split, checkpoints part way (inside an aggregate too, and a prepared checkpoint
//! it never commits) and stops; `shardwise import-kcl` and a `shardwise consume` worker go on from
//! KCL's checkpoints. Plus a dry run (a multi-stream KCL table with an AT_TIMESTAMP row), a
//! refusal while KCL still holds a lease, and the errors for tables that are not KCL's.
//!
//! The KCL application is `scripts/lib/kcl_consumer.py`, run with the Python of the emulators'
//! venv, where `scripts/emulators install` puts kcl-rs.
//!
//! `envs=$(scripts/emulators start) && eval "$envs" && SHARDWISE_LIVE=require cargo test -p shardwise-cli --test kcl_live`

#[allow(dead_code)]
mod process;
#[path = "../../tests/support/mod.rs"]
mod support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use aws_sdk_dynamodb::types::AttributeValue;
use aws_sdk_kinesis::primitives::Blob;
use bytes::Bytes;
use serde_json::{Value, json};
use shardwise::kpl;

use process::{BIN, FAST, Log, Worker, attr_n, attr_s, log_dir, secs};
use support::{Live, unique_name};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// One KCL application at a time: each runs a KCL scheduler (several threads) beside moto and
/// kinesis-mock on the test machine.
static KCL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The emulators' Python with kcl-rs, or `None` (after saying why) when it is not installed and
/// `SHARDWISE_LIVE=require` is not set; with it, a missing kcl-rs fails the test.
fn kcl_python(test: &str) -> Option<PathBuf> {
    let python = Path::new(ROOT).join(".emulators/venv/bin/python");
    let imports = Command::new(&python)
        .args(["-c", "import kcl_rs"])
        .output()
        .is_ok_and(|o| o.status.success());
    if imports {
        return Some(python);
    }
    let why = format!(
        "`{test}` needs kcl-rs in {}: run `scripts/emulators install`",
        python.display()
    );
    if std::env::var("SHARDWISE_LIVE").is_ok_and(|v| v == "require") {
        panic!("{why} (SHARDWISE_LIVE=require)");
    }
    eprintln!("skipping: {why}");
    None
}

// ---------------------------------------------------------------------------------------------
// The KCL application

/// `scripts/lib/kcl_consumer.py` running: its JSON lines as they come. Dropping it kills it.
struct Kcl {
    child: Child,
    lines: Arc<Mutex<Vec<Value>>>,
    reader: Option<std::thread::JoinHandle<()>>,
    stderr: PathBuf,
}

impl Kcl {
    fn spawn(python: &Path, name: &str, args: &[&str]) -> Kcl {
        let stderr = log_dir().join(format!("{name}-kcl.stderr"));
        let mut child = Command::new(python)
            .arg(Path::new(ROOT).join("scripts/lib/kcl_consumer.py"))
            .args(args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(File::create(&stderr).expect("a stderr file for KCL"))
            .spawn()
            .expect("run kcl_consumer.py");
        let stdout = child.stdout.take().expect("piped stdout");
        let lines: Arc<Mutex<Vec<Value>>> = Arc::default();
        let sink = lines.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let value = serde_json::from_str(&line).unwrap_or(json!({ "garbage": line }));
                sink.lock().unwrap().push(value);
            }
        });
        eprintln!("kcl: pid {}, stderr {}", child.id(), stderr.display());
        Kcl {
            child,
            lines,
            reader: Some(reader),
            stderr,
        }
    }

    fn events(&self, event: &str) -> Vec<Value> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|v| v["event"] == event)
            .cloned()
            .collect()
    }

    fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Waits for a line with this `event`.
    async fn wait_for(&mut self, event: &str, timeout: Duration) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(v) = self.events(event).pop() {
                return v;
            }
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                panic!(
                    "kcl_consumer.py exited ({status}) before `{event}`; lines {:?}; stderr:\n{}",
                    self.lines.lock().unwrap(),
                    self.stderr_tail()
                );
            }
            assert!(
                Instant::now() < deadline,
                "no `{event}` from kcl_consumer.py within {timeout:?}; stderr:\n{}",
                self.stderr_tail()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGTERM (a graceful shutdown), then waits for a zero exit.
    async fn stop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        self.wait_exit(Duration::from_secs(60)).await;
    }

    async fn wait_exit(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "kcl_consumer.py did not exit within {timeout:?}; stderr:\n{}",
                self.stderr_tail()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        assert!(
            status.success(),
            "kcl_consumer.py exited with {status}; stderr:\n{}",
            self.stderr_tail()
        );
    }
}

impl Drop for Kcl {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Records: plain ones and KPL aggregates, each user record `{"id": N}`

/// One user record as written: where it landed.
#[derive(Debug, Clone)]
struct Put {
    id: u64,
    shard: String,
    sequence: String,
    sub: u64,
}

/// (digits, sequence, sub-sequence): positions in shard order.
fn position(sequence: &str, sub: u64) -> (usize, String, u64) {
    (sequence.len(), sequence.to_owned(), sub)
}

/// Each shard's hash key range start (a key that lands on it) by shard id, open shards only.
async fn open_shards(live: &Live, stream: &str) -> BTreeMap<String, (u128, u128)> {
    let out = live
        .kinesis
        .list_shards()
        .stream_name(stream)
        .send()
        .await
        .expect("ListShards");
    out.shards()
        .iter()
        .filter(|s| {
            s.sequence_number_range()
                .is_some_and(|r| r.ending_sequence_number().is_none())
        })
        .map(|s| {
            let range = s.hash_key_range().expect("a hash key range");
            (
                s.shard_id().to_owned(),
                (
                    range.starting_hash_key().parse().unwrap(),
                    range.ending_hash_key().parse().unwrap(),
                ),
            )
        })
        .collect()
}

/// Writes to one shard (by explicit hash key, given to every sub-record too, so that KCL, which
/// drops sub-records whose hash key is outside the shard, drops none): a plain record, two
/// aggregates of 4, a plain record, an aggregate of 4. 14 user records from id `next`.
async fn put_block(live: &Live, stream: &str, hash_key: u128, next: &mut u64) -> Vec<Put> {
    let ehk = hash_key.to_string();
    let mut puts = Vec::new();
    for size in [1usize, 4, 4, 1, 4] {
        let ids: Vec<u64> = (*next..*next + size as u64).collect();
        *next += size as u64;
        let data = |id: u64| Bytes::from(json!({ "id": id }).to_string());
        let key = format!("key-{}", ids[0] % 4);
        let blob = if size == 1 {
            data(ids[0])
        } else {
            let subs: Vec<(String, Option<String>, Bytes)> = ids
                .iter()
                .map(|id| (format!("key-{}", id % 4), Some(ehk.clone()), data(*id)))
                .collect();
            kpl::aggregate(&subs)
        };
        let out = live
            .kinesis
            .put_record()
            .stream_name(stream)
            .partition_key(key)
            .explicit_hash_key(&ehk)
            .data(Blob::new(blob.to_vec()))
            .send()
            .await
            .expect("PutRecord");
        for (sub, id) in ids.into_iter().enumerate() {
            puts.push(Put {
                id,
                shard: out.shard_id().to_owned(),
                sequence: out.sequence_number().to_owned(),
                sub: sub as u64,
            });
        }
    }
    puts
}

// ---------------------------------------------------------------------------------------------
// Tables and commands

/// Every item of a table (consistent Scan).
async fn scan(live: &Live, table: &str) -> Vec<HashMap<String, AttributeValue>> {
    live.dynamodb
        .scan()
        .table_name(table)
        .consistent_read(true)
        .into_paginator()
        .items()
        .send()
        .try_collect()
        .await
        .unwrap_or_else(|e| panic!("Scan {table}: {e:?}"))
}

/// KCL's lease rows by shard id (KCL 3.x's other entities left out).
async fn kcl_rows(live: &Live, table: &str) -> BTreeMap<String, HashMap<String, AttributeValue>> {
    scan(live, table)
        .await
        .into_iter()
        .filter(|i| attr_s(i, "entityType").is_none_or(|t| t == "LEASE"))
        .filter_map(|i| {
            let key = attr_s(&i, "leaseKey")?;
            let shard = key.rsplit(':').next()?.to_owned();
            Some((shard, i))
        })
        .collect()
}

async fn table_exists(live: &Live, table: &str) -> bool {
    live.dynamodb
        .describe_table()
        .table_name(table)
        .send()
        .await
        .is_ok()
}

/// The tables a KCL 3.x application makes besides its lease table.
async fn delete_kcl_tables(live: &Live, app: &str) {
    for table in [
        app.to_owned(),
        format!("{app}-CoordinatorState"),
        format!("{app}-WorkerMetricStats"),
    ] {
        live.delete_table(&table).await;
    }
}

async fn cli(args: &[&str]) -> Output {
    tokio::process::Command::new(BIN)
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("run shardwise")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The import's table, by shard: the cells after SHARD (KCL CHECKPOINT, SUB, PENDING, SHARDWISE
/// CHECKPOINT, PARENTS, STATE).
fn import_table(stdout: &str) -> BTreeMap<String, Vec<String>> {
    stdout
        .lines()
        .skip_while(|l| !l.starts_with("SHARD "))
        .skip(1)
        .take_while(|l| l.starts_with("shardId-"))
        .map(|l| {
            let cells: Vec<String> = l.split_whitespace().map(str::to_owned).collect();
            (cells[0].clone(), cells[1..].to_vec())
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The tests

/// A stream of 2 shards, one split after the first block of records: the parent P and the other
/// shard S1 have a block before the split, the children C1, C2 and S1 one after (14 user records
/// a block, 9 of them in aggregates; the split while KCL runs). KCL (kcl-rs, polling, from the
/// trim horizon) handles and
/// checkpoints P up to its 7th record, sub-record 1 of an aggregate of 4, and S1 up to its 10th,
/// a plain record, with a prepared checkpoint at its 17th (inside an aggregate) that it never
/// commits; it never finishes P, so it never reads the children. After the import, a shardwise
/// worker handles exactly the records after KCL's checkpoints (the 7 of P after sub-record 1,
/// the 18 of S1 after the 10th, pending ones included, and every record of the children), each
/// once, and the children only after P.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shardwise_goes_on_exactly_after_kcls_checkpoints_sub_records_and_lineage_included() {
    let live = live_or_skip!();
    let Some(python) = kcl_python("shardwise_goes_on_exactly_after_kcls_checkpoints") else {
        return;
    };
    let _one = KCL.lock().await;
    let t0 = Instant::now();
    let stream = unique_name("kcl-import");
    let kcl_app = unique_name("kcl-app");
    let app = unique_name("sw-app");
    live.create_stream(&stream, 2).await;

    // The first block on each shard; KCL starts, takes its leases and reads; then the split of
    // the first shard and the second block. (KCL started on a stream already split fails on
    // kinesis-mock: its ListShards with ShardFilter FROM_TRIM_HORIZON returns the closed parent
    // together with its children, and KCL 3.x refuses the overlapping hash ranges of an empty
    // lease table's first sync: "Hash range of shards returned ... was incomplete".)
    let shards = open_shards(&live, &stream).await;
    let (parent, s1) = {
        let mut ids = shards.keys();
        (ids.next().unwrap().clone(), ids.next().unwrap().clone())
    };
    let mut next = 0;
    let mut puts = put_block(&live, &stream, shards[&parent].0, &mut next).await;
    puts.extend(put_block(&live, &stream, shards[&s1].0, &mut next).await);

    // KCL, part way.
    let plan = json!({
        parent.clone(): { "checkpoint_after": 7 },
        s1.clone(): { "checkpoint_after": 10, "pending_after": 17 },
    });
    let mut kcl = Kcl::spawn(
        &python,
        &kcl_app,
        &[
            "--stream",
            &stream,
            "--app",
            &kcl_app,
            "--plan",
            &plan.to_string(),
            "--hold",
        ],
    );
    kcl.wait_for("record", Duration::from_secs(240)).await;
    eprintln!("{:.1}s: KCL reads", secs(t0.elapsed()));

    let (start, end) = shards[&parent];
    live.kinesis
        .split_shard()
        .stream_name(&stream)
        .shard_to_split(&parent)
        .new_starting_hash_key((start + (end - start) / 2 + 1).to_string())
        .send()
        .await
        .expect("SplitShard");
    live.wait_stream_active(&stream).await;
    let after_split = open_shards(&live, &stream).await;
    let children: Vec<String> = after_split.keys().filter(|s| **s != s1).cloned().collect();
    assert_eq!(children.len(), 2, "two children: {after_split:?}");
    for shard in children.iter().chain([&s1]) {
        puts.extend(put_block(&live, &stream, after_split[shard].0, &mut next).await);
    }
    let of = |shard: &str| -> Vec<&Put> { puts.iter().filter(|p| p.shard == shard).collect() };
    assert_eq!(of(&parent).len(), 14);
    assert_eq!(of(&s1).len(), 28);
    eprintln!(
        "{:.1}s: 70 records written, {parent} split",
        secs(t0.elapsed())
    );

    kcl.wait_for("done", Duration::from_secs(240)).await;
    // KCL reads the parent to its end and creates its children's leases (before it asks the
    // processor, which never checkpoints SHARD_END there), so the import has KCL's lineage.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let rows = kcl_rows(&live, &kcl_app).await;
        eprintln!("KCL rows: {:?}", rows.keys().collect::<Vec<_>>());
        if children.iter().all(|c| rows.contains_key(c)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "KCL made no leases for the children: {rows:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    kcl.stop().await;
    let kcl_seconds = secs(t0.elapsed());
    eprintln!("{kcl_seconds:.1}s: KCL checkpointed and stopped");

    // What KCL handled and checkpointed is what the table says, mid-aggregate included.
    let handled_by_kcl: Vec<u64> = kcl
        .events("record")
        .iter()
        .map(|r| {
            serde_json::from_str::<Value>(r["data"].as_str().unwrap()).unwrap()["id"]
                .as_u64()
                .unwrap()
        })
        .collect();
    let first_of =
        |shard: &str, n: usize| -> Vec<u64> { of(shard)[..n].iter().map(|p| p.id).collect() };
    let mut want_kcl: Vec<u64> = first_of(&parent, 7);
    want_kcl.extend(first_of(&s1, 10));
    let mut got_kcl = handled_by_kcl.clone();
    got_kcl.sort_unstable();
    want_kcl.sort_unstable();
    assert_eq!(
        got_kcl, want_kcl,
        "KCL handled the first 7 of P and 10 of S1"
    );
    let rows = kcl_rows(&live, &kcl_app).await;
    let checkpoint_of = |shard: &str| {
        let row = &rows[shard];
        (
            attr_s(row, "checkpoint").unwrap(),
            attr_n(row, "checkpointSubSequenceNumber"),
        )
    };
    let p7 = of(&parent)[6];
    assert_eq!(
        checkpoint_of(&parent),
        (p7.sequence.clone(), 1),
        "P's checkpoint: its 7th record, sub-record 1 of an aggregate"
    );
    assert_eq!(p7.sub, 1);
    let s10 = of(&s1)[9];
    assert_eq!(
        checkpoint_of(&s1),
        (s10.sequence.clone(), 0),
        "S1's checkpoint"
    );
    let s17 = of(&s1)[16];
    assert_eq!(
        (
            attr_s(&rows[&s1], "pendingCheckpoint"),
            attr_n(&rows[&s1], "pendingCheckpointSubSequenceNumber")
        ),
        (Some(s17.sequence.clone()), s17.sub),
        "S1's prepared checkpoint"
    );
    assert!(
        s17.sub > 0,
        "the prepared checkpoint is inside an aggregate"
    );
    eprintln!(
        "KCL lease table: {:?}",
        rows.iter()
            .map(|(s, r)| (s, attr_s(r, "checkpoint"), attr_list_s(r, "parentShardId")))
            .collect::<Vec<_>>()
    );

    // The import.
    let out = cli(&[
        "import-kcl",
        "--kcl-table",
        &kcl_app,
        "--stream",
        &stream,
        "--app",
        &app,
        "--failover-time",
        "1s",
    ])
    .await;
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "import-kcl failed: {}\n{stdout}",
        text(&out.stderr)
    );
    eprintln!("{stdout}");
    let table = import_table(&stdout);
    assert_eq!(
        table[&parent][3],
        format!("{}.1", p7.sequence),
        "P's shardwise checkpoint"
    );
    assert_eq!(table[&parent][5], "resume");
    assert_eq!(table[&s1][2], format!("{}.{}", s17.sequence, s17.sub));
    assert_eq!(table[&s1][3], s10.sequence, "S1's shardwise checkpoint");
    assert!(
        stdout.contains(&format!("{s1}: KCL's pendingCheckpoint"))
            && stdout.contains("not taken as done"),
        "the output says the pending checkpoint is not taken: {stdout}"
    );
    let imported = process::rows(&live, &app, &stream).await;
    let row = |shard: &str| imported.iter().find(|r| r.shard == shard).unwrap().clone();
    assert_eq!(
        (row(&parent).checkpoint, row(&parent).sub),
        (p7.sequence.clone(), 1)
    );
    assert_eq!(
        (row(&s1).checkpoint, row(&s1).sub),
        (s10.sequence.clone(), 0)
    );
    for child in &children {
        assert_eq!(
            row(child).parents,
            std::slice::from_ref(&parent),
            "{child}'s lineage, from KCL's row"
        );
        assert_eq!(row(child).checkpoint, "TRIM_HORIZON");
    }

    // Again: the rows have checkpoints now, so it is refused unless forced.
    let again = [
        "import-kcl",
        "--kcl-table",
        &kcl_app,
        "--stream",
        &stream,
        "--app",
        &app,
        "--failover-time",
        "1s",
    ];
    let refused = cli(&again).await;
    let stderr = text(&refused.stderr);
    assert!(!refused.status.success(), "a second import must be refused");
    assert!(
        stderr.contains("already has a row with checkpoint") && stderr.contains("--force"),
        "{stderr}"
    );
    let forced = cli(&[&again[..], &["--force", "--dry-run"]].concat()).await;
    assert!(forced.status.success(), "{}", text(&forced.stderr));
    assert_eq!(import_table(&text(&forced.stdout))[&parent][5], "overwrite");

    // shardwise goes on.
    let expected: BTreeMap<u64, &Put> = puts
        .iter()
        .filter(|p| {
            let done = if p.shard == parent {
                Some(position(&p7.sequence, 1))
            } else if p.shard == s1 {
                Some(position(&s10.sequence, 0))
            } else {
                None
            };
            done.is_none_or(|done| position(&p.sequence, p.sub) > done)
        })
        .map(|p| (p.id, p))
        .collect();
    assert_eq!(expected.len(), 7 + 18 + 28);
    let log = Log::default();
    let mut worker = Worker::spawn(&stream, &app, "w1", FAST, &log);
    let deadline = Instant::now() + Duration::from_secs(90);
    while log.len() < expected.len() {
        assert!(
            Instant::now() < deadline,
            "{} of {} handled; stderr: {}",
            log.len(),
            expected.len(),
            worker.stderr_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Anything more (a record at or before KCL's checkpoints) would come in the next seconds.
    tokio::time::sleep(Duration::from_secs(3)).await;
    worker.stop_gracefully(Duration::from_secs(20)).await;
    log.assert_no_garbage();
    let lines = log.snapshot();
    log.dump(&format!("{app}-consume"));
    let handled: Vec<u64> = lines.iter().map(|h| h.id).collect();
    let distinct: BTreeSet<u64> = handled.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        handled.len(),
        "each record once: {handled:?}"
    );
    assert_eq!(
        distinct,
        expected.keys().copied().collect::<BTreeSet<u64>>(),
        "exactly the records after KCL's checkpoints"
    );
    for h in &lines {
        assert_eq!(
            h.shard, expected[&h.id].shard,
            "record {} on its shard",
            h.id
        );
    }
    // The sub-sequence respected: P starts at sub-record 2 of the aggregate KCL stopped in.
    let first_p = lines.iter().find(|h| h.shard == parent).unwrap();
    assert_eq!(first_p.id, of(&parent)[7].id);
    assert_eq!(
        (of(&parent)[7].sequence.as_str(), of(&parent)[7].sub),
        (p7.sequence.as_str(), 2)
    );
    // S1's first is the record after the 10th, though KCL had prepared a checkpoint further on.
    assert_eq!(
        lines.iter().find(|h| h.shard == s1).unwrap().id,
        of(&s1)[10].id
    );
    // Parents before children.
    let last_parent = lines.iter().rposition(|h| h.shard == parent).unwrap();
    let first_child = lines
        .iter()
        .position(|h| children.contains(&h.shard))
        .unwrap();
    assert!(
        last_parent < first_child,
        "a child's record (line {first_child}) before the parent's last (line {last_parent})"
    );
    let ended = process::rows(&live, &app, &stream).await;
    assert_eq!(
        ended.iter().find(|r| r.shard == parent).unwrap().checkpoint,
        "SHARD_END"
    );
    eprintln!(
        "{:.1}s: {} records handled after KCL's checkpoints, none before (KCL part {kcl_seconds:.1}s)",
        secs(t0.elapsed()),
        lines.len()
    );
    // KCL's table was only read.
    assert_eq!(
        kcl_rows(&live, &kcl_app).await,
        rows,
        "the KCL table is unchanged"
    );

    live.delete_stream(&stream).await;
    live.delete_table(&app).await;
    delete_kcl_tables(&live, &kcl_app).await;
}

fn attr_list_s(item: &HashMap<String, AttributeValue>, name: &str) -> Vec<String> {
    process::attr_list(item, name)
}

/// A multi-stream KCL application (stream identifier `account:stream:creationEpoch`) started at
/// AT_TIMESTAMP checkpoints one shard inside an aggregate and never the other, whose row stays at
/// KCL's AT_TIMESTAMP sentinel. The dry run prints what it would write and writes nothing; without
/// `--at-timestamp` it refuses, naming the flag (the time is in KCL's configuration, not its
/// table).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dry_run_prints_the_rows_it_would_write_and_writes_nothing() {
    let live = live_or_skip!();
    let Some(python) = kcl_python("a_dry_run_prints_the_rows_it_would_write_and_writes_nothing")
    else {
        return;
    };
    let _one = KCL.lock().await;
    let t0 = Instant::now();
    let stream = unique_name("kcl-dry");
    let kcl_app = unique_name("kcl-app");
    let app = unique_name("sw-app");
    live.create_stream(&stream, 2).await;
    let shards = open_shards(&live, &stream).await;
    let ids: Vec<String> = shards.keys().cloned().collect();
    let mut next = 0;
    let mut puts = Vec::new();
    for shard in &ids {
        puts.extend(put_block(&live, &stream, shards[shard].0, &mut next).await);
    }
    let created = live
        .kinesis
        .describe_stream_summary()
        .stream_name(&stream)
        .send()
        .await
        .expect("DescribeStreamSummary")
        .stream_description_summary
        .expect("a summary")
        .stream_creation_timestamp
        .secs();
    let identifier = format!("000000000000:{stream}:{created}");
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        - 600;
    let plan = json!({ ids[0].clone(): { "checkpoint_after": 3 } });
    let mut kcl = Kcl::spawn(
        &python,
        &kcl_app,
        &[
            "--stream",
            &stream,
            "--app",
            &kcl_app,
            "--plan",
            &plan.to_string(),
            "--stream-identifier",
            &identifier,
            "--initial-position",
            "AT_TIMESTAMP",
            "--timestamp",
            &since.to_string(),
        ],
    );
    kcl.wait_for("done", Duration::from_secs(240)).await;
    kcl.wait_exit(Duration::from_secs(60)).await;
    let rows = kcl_rows(&live, &kcl_app).await;
    let key = attr_s(&rows[&ids[0]], "leaseKey").unwrap();
    assert_eq!(
        key,
        format!("{identifier}:{}", ids[0]),
        "a multi-stream lease key"
    );
    assert_eq!(
        attr_s(&rows[&ids[1]], "checkpoint").as_deref(),
        Some("AT_TIMESTAMP")
    );
    let third = puts.iter().filter(|p| p.shard == ids[0]).nth(2).unwrap();
    assert_eq!(third.sub, 1);
    eprintln!("{:.1}s: KCL checkpointed and stopped", secs(t0.elapsed()));

    let args = [
        "import-kcl",
        "--kcl-table",
        &kcl_app,
        "--stream",
        &stream,
        "--app",
        &app,
        "--failover-time",
        "1s",
        "--dry-run",
    ];
    // Without the time of KCL's AT_TIMESTAMP start: refused, naming the flag.
    let out = cli(&args).await;
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(
        !out.status.success(),
        "refused without --at-timestamp: {stdout}"
    );
    assert!(stderr.contains("--at-timestamp"), "{stderr}");
    assert!(stderr.contains("nothing written"), "{stderr}");
    assert_eq!(
        import_table(&stdout)[&ids[1]][5],
        "needs-at-timestamp",
        "{stdout}"
    );

    let out = cli(&[&args[..], &["--at-timestamp", "2026-11-29T21:37:00Z"]].concat()).await;
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}\n{stdout}", text(&out.stderr));
    eprintln!("{stdout}");
    let table = import_table(&stdout);
    assert_eq!(
        table[&ids[0]],
        [
            third.sequence.clone(),
            "1".into(),
            "-".into(),
            format!("{}.1", third.sequence),
            "-".into(),
            "resume".into()
        ]
    );
    assert_eq!(
        table[&ids[1]],
        [
            "AT_TIMESTAMP".to_owned(),
            "0".into(),
            "-".into(),
            "AT_TIMESTAMP(2026-11-29T21:37:00Z)".into(),
            "-".into(),
            "start".into()
        ]
    );
    assert!(stdout.contains("dry run: nothing written"), "{stdout}");
    assert!(
        !table_exists(&live, &app).await,
        "the dry run created the lease table"
    );

    // A stream the multi-stream table has no leases of.
    let out = cli(&[
        "import-kcl",
        "--kcl-table",
        &kcl_app,
        "--stream",
        "another-stream",
        "--app",
        &app,
        "--force",
    ])
    .await;
    let stderr = text(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("no leases of stream `another-stream`") && stderr.contains(&stream),
        "{stderr}"
    );
    eprintln!("{:.1}s", secs(t0.elapsed()));
    live.delete_stream(&stream).await;
    delete_kcl_tables(&live, &kcl_app).await;
}

/// While KCL runs (its leases renewed), the import refuses, names the lease and its owner, and
/// writes nothing; `--force` imports all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_while_kcl_still_holds_a_lease_is_refused() {
    let live = live_or_skip!();
    let Some(python) = kcl_python("an_import_while_kcl_still_holds_a_lease_is_refused") else {
        return;
    };
    let _one = KCL.lock().await;
    let t0 = Instant::now();
    let stream = unique_name("kcl-held");
    let kcl_app = unique_name("kcl-app");
    let app = unique_name("sw-app");
    live.create_stream(&stream, 1).await;
    let shards = open_shards(&live, &stream).await;
    let shard = shards.keys().next().unwrap().clone();
    let mut next = 0;
    let puts = put_block(&live, &stream, shards[&shard].0, &mut next).await;
    let plan = json!({ shard.clone(): { "checkpoint_after": 2 } });
    let mut kcl = Kcl::spawn(
        &python,
        &kcl_app,
        &[
            "--stream",
            &stream,
            "--app",
            &kcl_app,
            "--plan",
            &plan.to_string(),
            "--hold",
        ],
    );
    kcl.wait_for("done", Duration::from_secs(240)).await;
    let owner = attr_s(&kcl_rows(&live, &kcl_app).await[&shard], "leaseOwner");
    assert!(owner.is_some(), "KCL holds the lease");
    eprintln!("{:.1}s: KCL holds {shard}", secs(t0.elapsed()));

    // KCL renews every failover time / 3 (10 s by default): within 5 s its counter moves.
    let args = [
        "import-kcl",
        "--kcl-table",
        &kcl_app,
        "--stream",
        &stream,
        "--app",
        &app,
        "--failover-time",
        "5s",
    ];
    let out = cli(&args).await;
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(!out.status.success(), "refused while KCL runs: {stdout}");
    assert!(
        stderr.contains(&format!(
            "{shard}: KCL worker `{}` still holds the lease",
            owner.as_deref().unwrap()
        )) && stderr.contains("--force"),
        "{stderr}"
    );
    assert_eq!(import_table(&stdout)[&shard][5], "held");
    assert!(!table_exists(&live, &app).await, "nothing written");
    eprintln!("{:.1}s: refused", secs(t0.elapsed()));

    let out = cli(&[&args[..], &["--force"]].concat()).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let row = process::rows(&live, &app, &stream).await.remove(0);
    assert_eq!((row.checkpoint, row.sub), (puts[1].sequence.clone(), 0));
    kcl.stop().await;
    eprintln!("{:.1}s", secs(t0.elapsed()));
    live.delete_stream(&stream).await;
    live.delete_table(&app).await;
    delete_kcl_tables(&live, &kcl_app).await;
}

/// The errors name what is wrong: a missing table, a table without KCL's key, a shardwise lease
/// table given as KCL's, and one table for both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_that_are_not_kcls_are_refused_naming_why() {
    let live = live_or_skip!();
    let stream = unique_name("kcl-errors");
    let app = unique_name("sw-app");
    let import = |kcl_table: &str, app: &str| {
        [
            "import-kcl",
            "--kcl-table",
            kcl_table,
            "--stream",
            &stream,
            "--app",
            app,
            "--force",
        ]
        .map(str::to_owned)
    };
    let fails = |args: [String; 8]| async move {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = cli(&args).await;
        assert!(!out.status.success(), "{args:?} succeeded");
        text(&out.stderr)
    };

    let missing = unique_name("no-such-table");
    let stderr = fails(import(&missing, &app)).await;
    assert!(
        stderr.contains(&format!("the KCL lease table `{missing}` does not exist")),
        "{stderr}"
    );

    let other = unique_name("other-table");
    live.create_table(&other, "id").await;
    let stderr = fails(import(&other, &app)).await;
    assert!(
        stderr.contains("does not have KCL's lease schema") && stderr.contains("id (HASH)"),
        "{stderr}"
    );

    // A shardwise lease table (same key as KCL's) with a row.
    live.create_stream(&stream, 1).await;
    let shardwise_table = unique_name("sw-table");
    process::shardwise(&[
        "seek",
        "--app",
        &shardwise_table,
        "--stream",
        &stream,
        "--to",
        "trim-horizon",
    ])
    .await;
    let stderr = fails(import(&shardwise_table, &app)).await;
    assert!(
        stderr.contains("is not a KCL lease table") && stderr.contains("shardwise lease row"),
        "{stderr}"
    );

    // The default lease table is named after the application, as KCL's is.
    let stderr = fails(import(&shardwise_table, &shardwise_table)).await;
    assert!(stderr.contains("--lease-table"), "{stderr}");

    live.delete_stream(&stream).await;
    for table in [other, shardwise_table] {
        live.delete_table(&table).await;
    }
}

/// The lease table an import creates is billed, tagged and backed up as `consume` would make it
/// (`--billing-mode`, `--tag`, `--point-in-time-recovery`); a flag the library refuses is refused
/// before anything is read or written, naming the flag; a dry run creates nothing. The KCL table
/// is written here as KCL writes a lease that starts at the trim horizon.
#[tokio::test]
async fn an_import_creates_the_lease_table_billed_tagged_and_backed_up_as_given() {
    use aws_sdk_dynamodb::types::BillingMode;
    use shardwise::lease::{DynamoDbLeaseStore, LeaseStore};

    let live = live_or_skip!();
    let stream = unique_name("kcl-table-opts");
    let kcl_table = unique_name("kcl-app");
    let app = unique_name("sw-app");
    live.create_stream(&stream, 1).await;
    let shard = open_shards(&live, &stream)
        .await
        .into_keys()
        .next()
        .expect("a shard");
    live.create_table(&kcl_table, "leaseKey").await;
    live.dynamodb
        .put_item()
        .table_name(&kcl_table)
        .item("leaseKey", AttributeValue::S(shard.clone()))
        .item("checkpoint", AttributeValue::S("TRIM_HORIZON".into()))
        .item("checkpointSubSequenceNumber", AttributeValue::N("0".into()))
        .item("leaseCounter", AttributeValue::N("3".into()))
        .item(
            "ownerSwitchesSinceCheckpoint",
            AttributeValue::N("0".into()),
        )
        .send()
        .await
        .expect("PutItem");
    let import = |extra: &[&str]| {
        let mut args = vec![
            "import-kcl",
            "--kcl-table",
            &kcl_table,
            "--stream",
            &stream,
            "--app",
            &app,
            "--force",
        ];
        args.extend_from_slice(extra);
        args.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let run = |args: Vec<String>| async move {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        cli(&args).await
    };
    let flags = [
        "--billing-mode",
        "provisioned:4,2",
        "--tag",
        "team=orders",
        "--tag",
        "cost-centre=17",
        "--point-in-time-recovery",
    ];

    let out = run(import(&["--tag", "team=orders", "--tag", "aws:owner=me"])).await;
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "a reserved tag key was taken");
    assert!(
        stderr.contains("invalid --tag aws:owner=me: a tag key is 1 to 128 characters"),
        "{stderr}"
    );
    let out = run(import(&["--billing-mode", "provisioned:0,2"])).await;
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "zero read capacity was taken");
    assert!(
        stderr.contains("invalid --billing-mode provisioned:0,2"),
        "{stderr}"
    );
    let out = run(import(&[&flags[..], &["--dry-run"]].concat())).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        !table_exists(&live, &app).await,
        "a refused flag or a dry run created the lease table"
    );

    let out = run(import(&flags)).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let store = DynamoDbLeaseStore::new(live.dynamodb.clone(), &app).create_if_missing(false);
    let rows = store.list(&stream).await.expect("the imported rows");
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].shard_id, shard);

    let settings = live.table_settings(&app).await;
    assert_eq!(
        settings,
        support::TableSettings {
            active: true,
            billing: Some(BillingMode::Provisioned),
            capacity: Some((4, 2)),
            tags: [
                ("cost-centre".into(), "17".into()),
                ("team".into(), "orders".into())
            ]
            .into(),
            point_in_time_recovery: true,
        }
    );

    live.delete_stream(&stream).await;
    for table in [kcl_table, app] {
        live.delete_table(&table).await;
    }
}
