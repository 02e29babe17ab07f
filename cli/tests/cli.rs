//! The `shardwise` binary, black box, against the live emulators: `stream create/split/merge/
//! describe`, `put` (every id once, in order per key), `leases`, and a lease table created with the
//! options `consume` was given; plus the failures a user meets first (a missing stream, a missing
//! lease table, a missing region, a rejected setting) and what `--help` says.

#[path = "../../tests/support/mod.rs"]
mod support;

use std::collections::{BTreeSet, HashMap};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::BillingMode;
use aws_sdk_kinesis::types::ShardIteratorType;
use serde_json::Value;
use shardwise::lease::{Checkpoint, DynamoDbLeaseStore, LeaseStore, NewLease};
use shardwise::{Position, SequenceNumber};

/// What one run of the binary did.
#[derive(Debug)]
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Run {
    /// Asserts a zero exit status and returns stdout.
    fn ok(self) -> String {
        assert_eq!(self.code, Some(0), "shardwise failed: {self:#?}");
        self.stdout
    }

    /// Asserts exit status 1 with an `error:` report and no panic, and returns stderr.
    fn failed(self) -> String {
        assert_eq!(self.code, Some(1), "expected a failure: {self:#?}");
        assert!(self.stderr.starts_with("error: "), "{self:#?}");
        assert!(!self.stderr.contains("panicked"), "{self:#?}");
        assert!(self.stdout.is_empty(), "{self:#?}");
        self.stderr
    }

    /// stdout as one JSON value per line.
    fn json_lines(self) -> Vec<Value> {
        self.ok()
            .lines()
            .map(|line| serde_json::from_str(line).expect("a JSON line"))
            .collect()
    }
}

/// The binary with `args`; it inherits the AWS_* variables that point at the emulators.
fn command(args: &[&str]) -> tokio::process::Command {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_shardwise"));
    command
        .args(args)
        .env("RUST_LOG", "warn")
        .kill_on_drop(true);
    command
}

/// Runs `command` to its end.
async fn run(mut command: tokio::process::Command) -> Run {
    let out = command.output().await.expect("run shardwise");
    Run {
        code: out.status.code(),
        stdout: String::from_utf8(out.stdout).expect("utf-8 stdout"),
        stderr: String::from_utf8(out.stderr).expect("utf-8 stderr"),
    }
}

/// Runs the binary with `args`.
async fn shardwise(args: &[&str]) -> Run {
    run(command(args)).await
}

/// One record read back: its shard, partition key and data.
#[derive(Debug)]
struct Read {
    shard: String,
    key: String,
    data: Vec<u8>,
}

/// Every record of every shard, each shard in sequence-number order.
async fn read_all(live: &support::Live, stream: &str) -> Vec<Read> {
    let mut records = Vec::new();
    for shard in live.shard_ids(stream).await {
        let mut iterator = live
            .kinesis
            .get_shard_iterator()
            .stream_name(stream)
            .shard_id(&shard)
            .shard_iterator_type(ShardIteratorType::TrimHorizon)
            .send()
            .await
            .expect("GetShardIterator")
            .shard_iterator
            .expect("an iterator");
        let mut last_sequence: Option<String> = None;
        loop {
            let page = live
                .kinesis
                .get_records()
                .shard_iterator(&iterator)
                .limit(1000)
                .send()
                .await
                .expect("GetRecords");
            for r in page.records() {
                let sequence = r.sequence_number().to_owned();
                if let Some(last) = &last_sequence {
                    let (a, b) = (last.len(), sequence.len());
                    assert!((a, last) < (b, &sequence), "sequence numbers increase");
                }
                last_sequence = Some(sequence);
                records.push(Read {
                    shard: shard.clone(),
                    key: r.partition_key().unwrap_or_default().to_owned(),
                    data: r.data().as_ref().to_vec(),
                });
            }
            if page.records().is_empty() && page.millis_behind_latest() == Some(0) {
                break;
            }
            match page.next_shard_iterator {
                Some(next) => iterator = next,
                None => break,
            }
        }
    }
    records
}

fn id_of(data: &[u8]) -> u64 {
    let value: Value = serde_json::from_slice(data).expect("a JSON record");
    value["id"].as_u64().expect("a numeric id")
}

#[tokio::test]
async fn put_writes_every_id_once_in_order_per_key() {
    let live = live_or_skip!();
    let stream = support::unique_name("cli-put");
    let created = shardwise(&["stream", "create", &stream, "--shards", "4"])
        .await
        .ok();
    assert!(created.contains("ACTIVE"), "{created}");

    let summary = shardwise(&["put", "--stream", &stream, "--count", "1000", "--keys", "8"])
        .await
        .json_lines();
    assert_eq!(summary.len(), 1, "{summary:?}");
    let summary = &summary[0];
    assert_eq!(summary["stream"], stream.as_str());
    assert_eq!(summary["written"], 1000);
    assert_eq!(summary["first_id"], 0);
    assert_eq!(summary["last_id"], 999);
    assert!(summary["seconds"].as_f64().is_some_and(|s| s >= 0.0));

    let records = read_all(&live, &stream).await;
    let mut seen = BTreeSet::new();
    // Per (shard, key): the last id read, which must be below the next one of the same key.
    let mut last: HashMap<(String, String), u64> = HashMap::new();
    let mut shard_of_key: HashMap<String, String> = HashMap::new();
    for r in &records {
        let id = id_of(&r.data);
        assert!(seen.insert(id), "id {id} read twice");
        assert_eq!(r.key, format!("key-{}", id % 8), "partition key of id {id}");
        let shard = shard_of_key.entry(r.key.clone()).or_insert(r.shard.clone());
        assert_eq!(*shard, r.shard, "one key, one shard (no resharding)");
        if let Some(before) = last.insert((r.shard.clone(), r.key.clone()), id) {
            assert!(before < id, "{}: id {id} after {before}", r.key);
        }
    }
    assert_eq!(seen, (0..1000).collect::<BTreeSet<u64>>());
    let shards: BTreeSet<&String> = shard_of_key.values().collect();
    assert!(shards.len() > 1, "8 keys spread over several shards");

    shardwise(&["stream", "delete", &stream]).await.ok();
}

#[tokio::test]
async fn put_pads_records_and_starts_at_the_start_id() {
    let live = live_or_skip!();
    let stream = support::unique_name("cli-pad");
    live.create_stream(&stream, 1).await;

    let summary = shardwise(&[
        "put",
        "--stream",
        &stream,
        "--count",
        "20",
        "--keys",
        "3",
        "--size",
        "100",
        "--start-id",
        "500",
    ])
    .await
    .json_lines();
    assert_eq!(summary[0]["written"], 20);
    assert_eq!(summary[0]["first_id"], 500);
    assert_eq!(summary[0]["last_id"], 519);

    let records = read_all(&live, &stream).await;
    let ids: Vec<u64> = records.iter().map(|r| id_of(&r.data)).collect();
    assert_eq!(
        ids,
        (500..520).collect::<Vec<_>>(),
        "one shard: written order"
    );
    for r in &records {
        assert_eq!(r.data.len(), 100);
        let value: Value = serde_json::from_slice(&r.data).unwrap();
        assert!(
            value["pad"]
                .as_str()
                .is_some_and(|p| p.bytes().all(|b| b == b'x'))
        );
        assert_eq!(r.key, format!("key-{}", id_of(&r.data) % 3));
    }
    live.delete_stream(&stream).await;
}

/// `stream describe --json`, keyed by shard id.
async fn describe(stream: &str) -> HashMap<String, Value> {
    shardwise(&["stream", "describe", stream, "--json"])
        .await
        .json_lines()
        .into_iter()
        .map(|v| (v["shard"].as_str().expect("shard").to_owned(), v))
        .collect()
}

fn hash(value: &Value, field: &str) -> u128 {
    value[field].as_str().expect(field).parse().expect("u128")
}

#[tokio::test]
async fn split_closes_the_parent_and_opens_two_children() {
    let _live = live_or_skip!();
    let stream = support::unique_name("cli-split");
    shardwise(&["stream", "create", &stream, "--shards", "1"])
        .await
        .ok();
    let parent = "shardId-000000000000";
    let before = describe(&stream).await;
    assert_eq!(before.len(), 1);
    assert_eq!(before[parent]["state"], "open");

    let said = shardwise(&["stream", "split", &stream, parent]).await.ok();
    assert!(said.contains(&(1u128 << 127).to_string()), "{said}");

    let shards = describe(&stream).await;
    assert_eq!(shards.len(), 3, "{shards:#?}");
    assert_eq!(shards[parent]["state"], "closed");
    assert!(shards[parent]["ending_sequence"].is_string());
    let mut children: Vec<&Value> = shards.values().filter(|s| s["shard"] != parent).collect();
    children.sort_by_key(|c| hash(c, "hash_start"));
    for child in &children {
        assert_eq!(child["state"], "open");
        assert_eq!(child["parents"], serde_json::json!([parent]));
        assert!(said.contains(child["shard"].as_str().unwrap()), "{said}");
    }
    assert_eq!(hash(children[0], "hash_start"), 0);
    assert_eq!(hash(children[0], "hash_end"), (1 << 127) - 1);
    assert_eq!(hash(children[1], "hash_start"), 1 << 127);
    assert_eq!(hash(children[1], "hash_end"), u128::MAX);

    let human = shardwise(&["stream", "describe", &stream]).await.ok();
    let lines: Vec<&str> = human.lines().collect();
    assert_eq!(lines.len(), 4, "{human}");
    assert!(lines[0].starts_with("SHARD"), "{human}");
    assert_eq!(human.matches(" closed ").count(), 1, "{human}");
    assert_eq!(human.matches(" open ").count(), 2, "{human}");

    // A closed shard cannot be split again.
    let err = shardwise(&["stream", "split", &stream, parent])
        .await
        .failed();
    assert!(err.contains("closed"), "{err}");
    shardwise(&["stream", "delete", &stream]).await.ok();
}

#[tokio::test]
async fn merge_joins_two_adjacent_open_shards() {
    let live = live_or_skip!();
    let stream = support::unique_name("cli-merge");
    live.create_stream(&stream, 3).await;
    let err = shardwise(&["stream", "merge", &stream, "0", "2"])
        .await
        .failed();
    assert!(err.contains("not adjacent"), "{err}");

    let said = shardwise(&["stream", "merge", &stream, "0", "1"])
        .await
        .ok();
    let (a, b) = ("shardId-000000000000", "shardId-000000000001");
    let shards = describe(&stream).await;
    assert_eq!(shards.len(), 4, "{shards:#?}");
    assert_eq!(shards[a]["state"], "closed");
    assert_eq!(shards[b]["state"], "closed");
    assert_eq!(shards["shardId-000000000002"]["state"], "open");
    let child = shards
        .values()
        .find(|s| !s["parents"].as_array().unwrap().is_empty())
        .expect("a merged child");
    assert!(said.contains(child["shard"].as_str().unwrap()), "{said}");
    assert_eq!(child["state"], "open");
    let mut parents: Vec<&str> = child["parents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    parents.sort();
    assert_eq!(parents, [a, b]);
    assert_eq!(hash(child, "hash_start"), hash(&shards[a], "hash_start"));
    assert_eq!(hash(child, "hash_end"), hash(&shards[b], "hash_end"));
    live.delete_stream(&stream).await;
}

#[tokio::test]
async fn leases_of_a_missing_table_fail_naming_it() {
    let _live = live_or_skip!();
    let table = support::unique_name("cli-no-table");
    let err = shardwise(&["leases", "--app", &table]).await.failed();
    assert!(err.contains(&format!("`{table}`")), "{err}");
    assert!(err.contains("does not exist"), "{err}");
}

#[tokio::test]
async fn leases_prints_the_rows_of_a_table() {
    let live = live_or_skip!();
    let table = support::unique_name("cli-leases");
    let store = DynamoDbLeaseStore::new(live.dynamodb.clone(), &table);
    store.prepare().await.expect("prepare");
    let (s0, s1) = ("shardId-000000000000", "shardId-000000000001");
    let new = |stream: &str, shard: &str, parents: &[&str]| NewLease {
        stream: stream.into(),
        shard_id: shard.into(),
        checkpoint: Checkpoint::TrimHorizon,
        parents: parents.iter().map(|p| (*p).to_owned()).collect(),
    };
    for lease in [
        new("orders", s0, &[]),
        new("orders", s1, &[s0]),
        new("audit", s0, &[]),
    ] {
        assert!(store.create(&lease).await.expect("create"));
    }
    let seen = store.get("orders", s0).await.unwrap().unwrap();
    store.take(&seen, "worker-1").await.unwrap().expect("taken");
    let seen = store.get("audit", s0).await.unwrap().unwrap();
    let held = store.take(&seen, "worker-2").await.unwrap().expect("taken");
    let held = held.ownership().unwrap();
    store
        .checkpoint(&held, &Checkpoint::ShardEnd, None)
        .await
        .unwrap();
    assert!(store.release(&held).await.unwrap());

    let rows = shardwise(&["leases", "--app", &table, "--stream", "orders", "--json"])
        .await
        .json_lines();
    assert_eq!(rows.len(), 2, "{rows:#?}");
    let (r0, r1) = (&rows[0], &rows[1]);
    assert_eq!(r0["stream"], "orders");
    assert_eq!(r0["shard"], s0);
    assert_eq!(r0["owner"], "worker-1");
    assert_eq!(r0["counter"], 1);
    assert_eq!(r0["epoch"], 1);
    assert_eq!(r0["checkpoint"], "TRIM_HORIZON");
    assert_eq!(r0["sub_sequence"], 0);
    assert_eq!(r0["state"], "owned");
    assert_eq!(r0["parents"], serde_json::json!([]));
    assert_eq!(r0["children"], serde_json::json!([]));
    assert_eq!(r1["shard"], s1);
    assert_eq!(r1["owner"], Value::Null);
    assert_eq!(r1["state"], "free");
    assert_eq!(r1["parents"], serde_json::json!([s0]));

    let all = shardwise(&["leases", "--app", &table, "--json"])
        .await
        .json_lines();
    assert_eq!(all.len(), 3, "{all:#?}");
    let audit = all
        .iter()
        .find(|r| r["stream"] == "audit")
        .expect("audit row");
    assert_eq!(audit["state"], "ended");
    assert_eq!(audit["checkpoint"], "SHARD_END");
    assert_eq!(audit["owner"], Value::Null);

    let human = shardwise(&["leases", "--app", &table]).await.ok();
    let lines: Vec<&str> = human.lines().collect();
    assert_eq!(lines.len(), 4, "{human}");
    assert!(lines[0].starts_with("STREAM"), "{human}");
    let column = lines[0].find("STATE").unwrap();
    for line in &lines[1..] {
        let state = line[column..].split_whitespace().next().unwrap();
        assert!(["owned", "free", "ended"].contains(&state), "{human}");
    }
    assert!(human.contains("worker-1"), "{human}");
    live.delete_table(&table).await;
}

/// `frontier --json` after a forward seek: the row stood complete through the arrival of its last
/// record; a seek to an hour later skips whatever arrives in between, and the frontier reports
/// that range (`skipped_by_seek`: the shard, from and to, the seek epoch) rather than certify it.
#[tokio::test]
async fn frontier_reports_the_range_a_forward_seek_skipped() {
    use aws_sdk_kinesis::primitives::{DateTime, DateTimeFormat};
    let live = live_or_skip!();
    let stream = support::unique_name("cli-skip");
    let table = support::unique_name("cli-skip-app");
    live.create_stream(&stream, 1).await;
    shardwise(&["put", "--stream", &stream, "--count", "3"])
        .await
        .ok();
    let records = live.read_records(&stream).await;
    let last = records.last().expect("three records");
    let arrived = last
        .approximate_arrival_timestamp()
        .and_then(|t| t.to_millis().ok())
        .expect("an arrival time");
    let sequence = SequenceNumber::parse(last.sequence_number()).unwrap();
    let store = DynamoDbLeaseStore::new(live.dynamodb.clone(), &table);
    store.prepare().await.expect("prepare");
    let shard = "shardId-000000000000";
    let new = NewLease {
        stream: stream.clone(),
        shard_id: shard.into(),
        checkpoint: Checkpoint::TrimHorizon,
        parents: vec![],
    };
    assert!(store.create(&new).await.unwrap());
    let seen = store.get(&stream, shard).await.unwrap().unwrap();
    let held = store.take(&seen, "worker-1").await.unwrap().unwrap();
    let held = held.ownership().unwrap();
    store
        .checkpoint(
            &held,
            &Checkpoint::At(Position::new(sequence, 0)),
            Some(arrived),
        )
        .await
        .unwrap();
    assert!(store.release(&held).await.unwrap());

    let unmoved = shardwise(&["frontier", "--app", &table, "--stream", &stream, "--json"])
        .await
        .json_lines();
    assert_eq!(unmoved[0]["skipped_by_seek"], serde_json::json!([]));

    let to = arrived + 3_600_000;
    let when = DateTime::from_millis(to)
        .fmt(DateTimeFormat::DateTime)
        .unwrap();
    shardwise(&[
        "seek",
        "--app",
        &table,
        "--stream",
        &stream,
        "--to",
        &format!("at-timestamp:{when}"),
    ])
    .await
    .ok();
    let frontier = shardwise(&["frontier", "--app", &table, "--stream", &stream, "--json"])
        .await
        .json_lines();
    assert_eq!(
        frontier[0]["skipped_by_seek"],
        serde_json::json!([{
            "shard": shard,
            "from": {"time_ms": arrived},
            "to": {"time_ms": to},
            "seek_epoch": 1,
        }]),
        "{frontier:#?}"
    );
    let human = shardwise(&["frontier", "--app", &table, "--stream", &stream])
        .await
        .ok();
    assert!(
        human.contains(&format!("skipped by seek (epoch 1): {shard} after ")),
        "{human}"
    );

    // A seek back to the trim horizon reads the range again: nothing is reported skipped.
    shardwise(&[
        "seek",
        "--app",
        &table,
        "--stream",
        &stream,
        "--to",
        "trim-horizon",
    ])
    .await
    .ok();
    let frontier = shardwise(&["frontier", "--app", &table, "--stream", &stream, "--json"])
        .await
        .json_lines();
    assert_eq!(frontier[0]["skipped_by_seek"], serde_json::json!([]));
    live.delete_table(&table).await;
    live.delete_stream(&stream).await;
}

#[tokio::test]
async fn put_to_a_missing_stream_fails_naming_it() {
    let _live = live_or_skip!();
    let stream = support::unique_name("cli-no-stream");
    let err = shardwise(&["put", "--stream", &stream, "--count", "10"])
        .await
        .failed();
    assert!(err.contains(&format!("`{stream}` does not exist")), "{err}");
    let err = shardwise(&["stream", "describe", &stream]).await.failed();
    assert!(err.contains(&format!("`{stream}` does not exist")), "{err}");
}

/// Every variable `--help` must explain.
const ENVIRONMENT: [&str; 10] = [
    "AWS_REGION",
    "AWS_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_KINESIS",
    "AWS_ENDPOINT_URL_DYNAMODB",
    "AWS_EC2_METADATA_DISABLED",
    "RUST_LOG",
];

#[tokio::test]
async fn help_lists_the_environment_it_reads() {
    for args in [&["--help"][..], &["consume", "--help"], &["consume", "-h"]] {
        let help = shardwise(args).await.ok();
        let environment = help
            .split_once("Environment:\n")
            .unwrap_or_else(|| panic!("{args:?} has no Environment section: {help}"))
            .1;
        for var in ENVIRONMENT {
            let line = environment
                .lines()
                .find(|line| line.split_whitespace().next() == Some(var))
                .unwrap_or_else(|| panic!("{args:?} does not list {var}: {help}"));
            assert!(
                line.split_whitespace().count() > 2,
                "{var} says what it does: {line}"
            );
        }
    }
}

/// `args` in the environment of a machine with no AWS region anywhere: no variable, empty config
/// files (`empty`), no instance metadata.
fn without_region(args: &[&str], empty: &std::path::Path) -> tokio::process::Command {
    let mut command = command(args);
    command
        .env_remove("AWS_REGION")
        .env_remove("AWS_DEFAULT_REGION")
        .env_remove("AWS_PROFILE")
        .env("AWS_CONFIG_FILE", empty)
        .env("AWS_SHARED_CREDENTIALS_FILE", empty)
        .env("AWS_EC2_METADATA_DISABLED", "true");
    command
}

#[tokio::test]
async fn a_missing_region_is_named_as_aws_region() {
    let empty = std::env::temp_dir().join(support::unique_name("empty-aws-config"));
    std::fs::write(&empty, "").expect("an empty AWS config file");
    let commands: [&[&str]; 6] = [
        &["consume", "--stream", "orders", "--app", "billing"],
        &["put", "--stream", "orders", "--count", "1"],
        &["leases", "--app", "billing"],
        &[
            "seek", "--app", "billing", "--stream", "orders", "--to", "latest",
        ],
        &["frontier", "--app", "billing", "--stream", "orders"],
        &["stream", "describe", "orders"],
    ];
    for args in commands {
        let err = run(without_region(args, &empty)).await.failed();
        assert_eq!(
            err,
            "error: no AWS region is configured: set AWS_REGION (or the region of an \
             AWS_PROFILE)\n",
            "{args:?}"
        );
    }
    let _ = std::fs::remove_file(&empty);
}

/// Every `consume` setting can come from the environment (`SHARDWISE_` and the flag's name):
/// each row is given once as flags and once as variables, and `consume` does the same with both
/// (settings are checked before any call, so a rejected one shows the value it took).
#[tokio::test]
async fn consume_settings_from_the_environment_are_the_flags_given_there() {
    // Each row: the flags, the same settings as variables, and what `consume` answers.
    type Row<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
    let cases: &[Row] = &[
        (
            &["--stream", "orders", "--app", "billing", "--lanes", "0"],
            &[
                ("SHARDWISE_STREAM", "orders"),
                ("SHARDWISE_APP", "billing"),
                ("SHARDWISE_LANES", "0"),
            ],
            "error: invalid --lanes 0: must be 1 to 1024\n",
        ),
        (
            &[
                "--stream",
                "orders",
                "--app",
                "billing",
                "--poll-interval",
                "10ms",
            ],
            &[
                ("SHARDWISE_STREAM", "orders"),
                ("SHARDWISE_APP", "billing"),
                ("SHARDWISE_POLL_INTERVAL", "10ms"),
            ],
            "error: invalid --poll-interval 10ms: must be at least 200ms (Kinesis allows 5 \
             GetRecords calls per second per shard)\n",
        ),
        (
            &[
                "--stream",
                "orders",
                "--app",
                "billing",
                "--checkpoint-interval",
                "20s",
            ],
            &[
                ("SHARDWISE_STREAM", "orders"),
                ("SHARDWISE_APP", "billing"),
                ("SHARDWISE_CHECKPOINT_INTERVAL", "20s"),
            ],
            "error: invalid --checkpoint-interval 20s: must be shorter than --lease-duration (10s)\n",
        ),
        (
            &[
                "--stream",
                "orders",
                "--app",
                "billing",
                "--lease-duration",
                "30s",
                "--checkpoint-interval",
                "40s",
            ],
            &[
                ("SHARDWISE_STREAM", "orders"),
                ("SHARDWISE_APP", "billing"),
                ("SHARDWISE_LEASE_DURATION", "30s"),
                ("SHARDWISE_CHECKPOINT_INTERVAL", "40s"),
            ],
            "error: invalid --checkpoint-interval 40s: must be shorter than --lease-duration (30s)\n",
        ),
        (
            &[
                "--stream",
                "orders",
                "--app",
                "billing",
                "--billing-mode",
                "provisioned:5,0",
            ],
            &[
                ("SHARDWISE_STREAM", "orders"),
                ("SHARDWISE_APP", "billing"),
                ("SHARDWISE_BILLING_MODE", "provisioned:5,0"),
            ],
            "error: invalid --billing-mode provisioned:5,0: provisioned read and write capacity \
             must each be at least 1\n",
        ),
        (
            &[
                "--stream",
                "orders",
                "--app",
                "billing",
                "--fail-keys",
                "a,b",
                "--fail-outcome",
                "hold:x",
            ],
            &[
                ("SHARDWISE_STREAM", "orders"),
                ("SHARDWISE_APP", "billing"),
                ("SHARDWISE_FAIL_KEYS", "a,b"),
                ("SHARDWISE_FAIL_OUTCOME", "hold:x"),
            ],
            "error: --fail-outcome hold: holding or quarantining a record records a receipt; add --receipts\n",
        ),
        (
            &[
                "--stream",
                "orders",
                "--app",
                "billing",
                "--max-record-age",
                "10ms",
            ],
            &[
                ("SHARDWISE_STREAM", "orders"),
                ("SHARDWISE_APP", "billing"),
                ("SHARDWISE_MAX_RECORD_AGE", "10ms"),
            ],
            "error: invalid --max-record-age 10ms: must be at least 1s (arrival times are whole \
             milliseconds from another clock)\n",
        ),
    ];
    for (flags, variables, expected) in cases {
        let args: Vec<&str> = ["consume"].iter().chain(flags.iter()).copied().collect();
        let mut by_flags = command(&args);
        by_flags.env("AWS_REGION", "us-east-1");
        assert_eq!(run(by_flags).await.failed(), *expected, "{flags:?}");
        let mut by_env = command(&["consume"]);
        by_env
            .env("AWS_REGION", "us-east-1")
            .envs(variables.iter().copied());
        assert_eq!(run(by_env).await.failed(), *expected, "{variables:?}");
    }
    // A flag given beside its variable wins.
    let mut both = command(&["consume", "--lanes", "0"]);
    both.env("AWS_REGION", "us-east-1").envs([
        ("SHARDWISE_STREAM", "orders"),
        ("SHARDWISE_APP", "billing"),
        ("SHARDWISE_LANES", "4"),
    ]);
    assert_eq!(
        run(both).await.failed(),
        "error: invalid --lanes 0: must be 1 to 1024\n"
    );
    // `--help` names each variable.
    let help = shardwise(&["consume", "--help"]).await.ok();
    for variable in [
        "SHARDWISE_STREAM",
        "SHARDWISE_WORKER_ID",
        "SHARDWISE_SHUTDOWN_DEADLINE",
        "SHARDWISE_METRICS_EMF",
    ] {
        assert!(
            help.contains(&format!("[env: {variable}")),
            "{variable} in --help:\n{help}"
        );
    }
}

/// The duration flags' old spellings in milliseconds work for one release, with a warning that
/// names the new spelling; the new spellings take `1500ms`, `10s`, `7d`.
#[tokio::test]
async fn millisecond_flags_still_work_for_one_release_with_a_warning() {
    let mut command = command(&[
        "consume",
        "--stream",
        "orders",
        "--app",
        "billing",
        "--lease-duration-ms",
        "2000",
        "--checkpoint-interval",
        "3s",
    ]);
    command.env("AWS_REGION", "us-east-1");
    let run = run(command).await;
    assert!(
        run.stderr.contains(
            "--lease-duration-ms is deprecated and goes in the next release: use --lease-duration 2s"
        ),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.ends_with(
            "error: invalid --checkpoint-interval 3s: must be shorter than --lease-duration (2s)\n"
        ),
        "{}",
        run.stderr
    );
    // Both spellings of one setting: refused.
    let both = shardwise(&[
        "consume",
        "--stream",
        "orders",
        "--app",
        "billing",
        "--lease-duration-ms",
        "2000",
        "--lease-duration",
        "2s",
    ])
    .await;
    assert!(
        both.stderr.contains("cannot be used with"),
        "{}",
        both.stderr
    );
}

#[tokio::test]
async fn a_rejected_setting_names_the_flag_as_typed() {
    let consume = ["consume", "--stream", "orders", "--app", "billing"];
    let cases: [(&[&str], &str); 3] = [
        (
            &["--lanes", "0"],
            "error: invalid --lanes 0: must be 1 to 1024\n",
        ),
        (
            &["--poll-interval", "10ms"],
            "error: invalid --poll-interval 10ms: must be at least 200ms (Kinesis allows 5 \
             GetRecords calls per second per shard)\n",
        ),
        (
            &["--billing-mode", "provisioned:5,0"],
            "error: invalid --billing-mode provisioned:5,0: provisioned read and write capacity \
             must each be at least 1\n",
        ),
    ];
    for (extra, expected) in cases {
        let args: Vec<&str> = consume.iter().chain(extra).copied().collect();
        // Settings are checked before any call: a region is all it needs.
        let mut command = command(&args);
        command.env("AWS_REGION", "us-east-1");
        assert_eq!(run(command).await.failed(), expected, "{extra:?}");
    }
    // A log group's partitions start at their first page; a seek moves them.
    let mut command = command(&[
        "consume",
        "--log-group",
        "/aws/lambda/orders",
        "--app",
        "billing",
        "--start",
        "latest",
    ]);
    command.env("AWS_REGION", "us-east-1");
    assert_eq!(
        run(command).await.failed(),
        "error: invalid --start: a paged source's partitions start at their first page (seek to \
         move them)\n"
    );
    // A cap on a log group with nothing to record a spent event: refused (seed 003, rule 1).
    let mut capped = self::command(&[
        "consume",
        "--log-group",
        "/aws/lambda/orders",
        "--app",
        "billing",
        "--max-attempts",
        "3",
        "--max-record-age",
        "1h",
    ]);
    capped.env("AWS_REGION", "us-east-1");
    let failed = run(capped).await.failed();
    assert!(
        failed.starts_with(
            "error: invalid --max-attempts 3: on a paged source, --max-attempts, --max-record-age \
             can end an event's attempts"
        ) && failed.contains("also set --dead-letter (a dead-letter stream) or a receipt ledger"),
        "{failed}"
    );
}

/// Waits until `done` answers, failing after `limit` or when `consumer` exits first.
async fn wait_while_running<F, Fut>(
    what: &str,
    consumer: &mut tokio::process::Child,
    limit: Duration,
    mut done: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !done().await {
        if let Some(status) = consumer.try_wait().expect("try_wait") {
            panic!("shardwise consume exited with {status} before {what}");
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn consume_creates_the_lease_table_it_is_given_and_the_other_commands_read_it() {
    let live = live_or_skip!();
    let stream = support::unique_name("cli-table-opts");
    let app = support::unique_name("cli-table-app");
    let table = support::unique_name("cli-table");
    live.create_stream(&stream, 1).await;

    let mut consume = command(&[
        "consume",
        "--stream",
        &stream,
        "--app",
        &app,
        "--lease-table",
        &table,
        "--billing-mode",
        "provisioned:7,3",
        "--tag",
        "team=billing",
        "--point-in-time-recovery",
        "--lease-duration",
        "3000ms",
        "--scan-interval",
        "500ms",
    ]);
    let mut consumer = consume
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn shardwise consume");
    let store = DynamoDbLeaseStore::new(live.dynamodb.clone(), &table).create_if_missing(false);
    wait_while_running(
        "the table and its lease row",
        &mut consumer,
        Duration::from_secs(30),
        || async { store.list(&stream).await.is_ok_and(|rows| rows.len() == 1) },
    )
    .await;
    let pid = consumer.id().expect("a running consumer").to_string();
    let killed = tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .expect("run kill");
    assert!(killed.success(), "kill -TERM {pid}");
    let out = tokio::time::timeout(Duration::from_secs(30), consumer.wait_with_output())
        .await
        .expect("consume stops within 30 s of SIGTERM")
        .expect("wait for consume");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "consume failed: {stderr}");
    assert!(stderr.contains(r#""event":"shutdown""#), "{stderr}");

    let settings = live.table_settings(&table).await;
    assert_eq!(
        settings,
        support::TableSettings {
            active: true,
            billing: Some(BillingMode::Provisioned),
            capacity: Some((7, 3)),
            tags: [("team".into(), "billing".into())].into(),
            point_in_time_recovery: true,
        }
    );

    // `leases`, `frontier` and `seek` read the table named by --lease-table, not the app's.
    let rows = shardwise(&["leases", "--app", &app, "--lease-table", &table, "--json"])
        .await
        .json_lines();
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!(rows[0]["stream"], stream.as_str());
    assert_eq!(rows[0]["shard"], "shardId-000000000000");
    assert_eq!(rows[0]["owner"], Value::Null, "released at shutdown");
    let err = shardwise(&["leases", "--app", &app]).await.failed();
    assert!(err.contains(&format!("`{app}`")), "{err}");
    assert!(err.contains("does not exist"), "{err}");

    let frontier = shardwise(&[
        "frontier",
        "--app",
        &app,
        "--lease-table",
        &table,
        "--stream",
        &stream,
        "--json",
    ])
    .await
    .json_lines();
    assert_eq!(frontier[0]["members"].as_array().map(Vec::len), Some(1));

    let sought = shardwise(&[
        "seek",
        "--app",
        &app,
        "--lease-table",
        &table,
        "--stream",
        &stream,
        "--to",
        "at-timestamp:2026-01-01",
    ])
    .await
    .json_lines();
    assert_eq!(
        sought[0]["moved"],
        serde_json::json!(["shardId-000000000000"])
    );
    let row = store.get(&stream, "shardId-000000000000").await.unwrap();
    assert_eq!(
        row.expect("the row").checkpoint,
        Checkpoint::AtTimestamp(std::time::UNIX_EPOCH + Duration::from_secs(1_767_225_600))
    );

    live.delete_table(&table).await;
    live.delete_stream(&stream).await;
}

/// `consume` configured from the environment alone, with `--metrics-emf` and `--log-format json`:
/// every line on stderr is one JSON object, the EMF documents count every record handled under
/// KCL's name and carry the documented units and dimensions (application first).
#[tokio::test]
async fn consume_from_the_environment_writes_emf_metrics_and_json_logs() {
    let live = live_or_skip!();
    let stream = support::unique_name("cli-emf");
    let app = support::unique_name("cli-emf-app");
    live.create_stream(&stream, 2).await;
    shardwise(&["put", "--stream", &stream, "--count", "60"])
        .await
        .ok();
    let mut consume = command(&["consume"]);
    consume
        .envs([
            ("SHARDWISE_STREAM", stream.as_str()),
            ("SHARDWISE_APP", app.as_str()),
            ("SHARDWISE_QUIET", "true"),
            ("SHARDWISE_METRICS_EMF", "true"),
            ("SHARDWISE_METRICS_EMF_INTERVAL", "1s"),
            ("SHARDWISE_LOG_FORMAT", "json"),
            ("SHARDWISE_LEASE_DURATION", "3s"),
            ("SHARDWISE_SCAN_INTERVAL", "500ms"),
            ("RUST_LOG", "info"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut consumer = consume.spawn().expect("spawn shardwise consume");
    let lines: Arc<Mutex<Vec<String>>> = Arc::default();
    let (stderr, kept) = (consumer.stderr.take().unwrap(), lines.clone());
    tokio::spawn(async move {
        use tokio::io::AsyncBufReadExt;
        let mut reader = tokio::io::BufReader::new(stderr).lines();
        while let Ok(Some(line)) = reader.next_line().await {
            kept.lock().unwrap().push(line);
        }
    });
    let processed = |lines: &[String]| -> u64 {
        lines
            .iter()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|d| d.get("_aws").is_some() && d["outcome"] == "ack")
            .filter_map(|d| d["RecordsProcessed"].as_u64())
            .sum()
    };
    wait_while_running(
        "RecordsProcessed to count 60",
        &mut consumer,
        Duration::from_secs(60),
        || {
            let done = processed(&lines.lock().unwrap()) == 60;
            async move { done }
        },
    )
    .await;
    let pid = consumer.id().expect("running").to_string();
    tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .expect("run kill");
    let status = tokio::time::timeout(Duration::from_secs(30), consumer.wait())
        .await
        .expect("stops within 30 s of SIGTERM")
        .expect("wait");
    assert!(status.success(), "{:?}", lines.lock().unwrap());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let lines = lines.lock().unwrap().clone();
    assert_eq!(processed(&lines), 60, "nothing counted twice");
    let (mut logs, mut units) = (0, HashMap::new());
    for line in &lines {
        let value: Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        if value.get("_aws").is_none() {
            if value.get("level").is_some() {
                assert!(value["fields"].is_object(), "{line}");
                logs += 1;
            }
            continue;
        }
        let directive = &value["_aws"]["CloudWatchMetrics"][0];
        assert_eq!(directive["Namespace"], "shardwise", "{line}");
        assert_eq!(directive["Dimensions"][0][0], "application", "{line}");
        assert_eq!(value["application"], app.as_str(), "{line}");
        for metric in directive["Metrics"].as_array().unwrap() {
            let name = metric["Name"].as_str().unwrap().to_string();
            assert!(
                value[&name].is_number() || value[&name].is_array(),
                "{line}"
            );
            units.insert(name, metric["Unit"].as_str().unwrap().to_string());
        }
        if value.get("MillisBehindLatest").is_some() {
            assert!(
                value["shard"].as_str().unwrap().starts_with("shardId-"),
                "{line}"
            );
            assert_eq!(value["stream"], stream.as_str(), "{line}");
        }
    }
    assert!(logs > 0, "the info logs are JSON lines too: {lines:?}");
    for (name, unit) in [
        ("RecordsProcessed", "Count"),
        ("MillisBehindLatest", "Milliseconds"),
        ("CurrentLeases", "Count"),
        ("TakenLeases", "Count"),
        ("shardwise_handler_duration_seconds", "Seconds"),
    ] {
        assert_eq!(
            units.get(name).map(String::as_str),
            Some(unit),
            "{name}: {units:?}"
        );
    }
    live.delete_stream(&stream).await;
}
