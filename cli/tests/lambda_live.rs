//! Lambda handlers under `shardwise consume`, live against the emulators: `--lambda-handler` runs
//! Python and Node.js functions unchanged (AWS's own samples among them), their
//! `batchItemFailures` and raises read as Lambda reads them; and what every handler program
//! gains: answers with fields shardwise does not know, and the shutdown notice.
//!
//! Run with the emulators up:
//! `envs=$(scripts/emulators start) && eval "$envs" && SHARDWISE_LIVE=require cargo test -p shardwise-cli --test lambda_live`

#[allow(dead_code)]
mod process;
#[path = "../../tests/support/mod.rs"]
mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;

use process::*;
use support::wait::wait_for;

/// Records per test, over this many partition keys (two records a key).
const RECORDS: u64 = 80;
const KEYS: u64 = 40;

/// A directory of this test's own (a function's code, a program's notes).
fn scratch(name: &str) -> PathBuf {
    let dir = log_dir().join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}

/// AWS's samples, unchanged (see `examples/lambda/README.md`).
fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/lambda")
}

/// A consumer's flags: the fast lease settings, one lane per shard (as Lambda's
/// ParallelizationFactor 1), batches and retries on Lambda's defaults (batches of up to 100 with
/// no batching window; retries in place, Lambda's way: a failed record runs again where it is,
/// its key's later records behind it, until it succeeds), and `extra`.
fn worker_args(extra: &[&str]) -> Vec<String> {
    FAST.iter()
        .chain(&["--handler-timeout", "20s", "--shutdown-deadline", "4s"])
        .chain(extra)
        .map(|s| s.to_string())
        .collect()
}

/// Runs one worker over a fresh stream of [`RECORDS`] records over `keys` keys until each is
/// acked, stops it gracefully, and returns the printed lines and the worker's stderr.
async fn consume_all(name: &str, keys: u64, extra: &[&str]) -> (Vec<Handled>, String) {
    consume_all_with_env(name, keys, extra, &[]).await
}

/// [`consume_all`], with these environment variables for the worker and its programs.
async fn consume_all_with_env(
    name: &str,
    keys: u64,
    extra: &[&str],
    env: &[(&str, String)],
) -> (Vec<Handled>, String) {
    let _turn = EMULATORS.read().await;
    let live = support::live(name)
        .await
        .expect("the emulators (SHARDWISE_LIVE)");
    let stream = support::unique_name(name);
    let app = support::unique_name(&format!("{name}-app"));
    live.create_stream(&stream, 2).await;
    put(&stream, RECORDS, keys, 0).await;
    let log = Log::default();
    let args = worker_args(extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let started = Instant::now();
    let mut worker = Worker::spawn_with_env(&stream, &app, "L", &args, env, &log);
    let acked = || {
        let lines = log.snapshot();
        lines
            .iter()
            .filter(|h| h.outcome == "ack")
            .map(|h| h.id)
            .collect::<BTreeSet<_>>()
            .len() as u64
    };
    wait_for("every record acked", Duration::from_secs(60), || {
        acked() >= RECORDS
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    worker.stop_gracefully(Duration::from_secs(30)).await;
    eprintln!(
        "{name}: {RECORDS} records acked and the worker stopped in {:?}",
        started.elapsed()
    );
    log.assert_no_garbage();
    let stderr = std::fs::read_to_string(&worker.stderr).unwrap_or_default();
    assert!(
        !stderr.contains("handler program replaced"),
        "no handler program was replaced: {}",
        worker.stderr_tail()
    );
    cleanup(&live, &stream, &app).await;
    (log.snapshot(), stderr)
}

/// Every record acked exactly once, the acks of each key in order, and nothing after an ack.
fn assert_acked_once_in_order(lines: &[Handled], keys: u64) {
    let acks: Vec<Handled> = lines
        .iter()
        .filter(|h| h.outcome == "ack")
        .cloned()
        .collect();
    assert_nothing_skipped(&acks, RECORDS);
    assert_eq!(duplicates(&acks), BTreeMap::new(), "acked more than once");
    assert_order(&acks, keys, "acks");
    let outcomes: BTreeSet<&str> = lines.iter().map(|h| h.outcome.as_str()).collect();
    assert!(
        outcomes.iter().all(|o| ["ack", "retry"].contains(o)),
        "{outcomes:?}"
    );
}

/// The ids each printed a `retry` line for (in place: a failed attempt).
fn retried(lines: &[Handled]) -> BTreeSet<u64> {
    lines
        .iter()
        .filter(|h| h.outcome == "retry")
        .map(|h| h.id)
        .collect()
}

/// One batch as the test functions note it: its records' ids in order, the index of the first
/// record the function reported failed, whether it raised, and what its context said.
#[derive(Debug)]
struct Noted {
    ids: Vec<u64>,
    failed_from: Option<usize>,
    raised: bool,
    context: Value,
}

fn noted(path: &Path) -> Vec<Noted> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|line| {
            let v: Value = serde_json::from_str(line).expect("a noted batch");
            Noted {
                ids: v["ids"]
                    .as_array()
                    .expect("ids")
                    .iter()
                    .map(|id| id.as_u64().expect("an id"))
                    .collect(),
                failed_from: v["failed_from"].as_u64().map(|i| i as usize),
                raised: v["raised"].as_bool().unwrap_or(false),
                context: v["context"].clone(),
            }
        })
        .collect()
}

/// What Lambda would retry of these batches: a raising batch whole, else its records from the
/// first one reported failed.
fn to_retry(batches: &[Noted]) -> BTreeSet<u64> {
    let mut out = BTreeSet::new();
    for batch in batches {
        let from = if batch.raised {
            Some(0)
        } else {
            batch.failed_from
        };
        if let Some(from) = from {
            out.extend(&batch.ids[from..]);
        }
    }
    out
}

/// A Python function that reports the records whose id is `% 7 == 3` failed the first time it
/// sees them, noting each batch (and its context) in `notes`. With `one_per_key`, only where no
/// key has two records from there to the end of the event (see
/// [`two_failed_records_of_one_key_in_one_event_keep_their_order`] for why).
fn reporting_function(notes: &Path, one_per_key: bool) -> String {
    format!(
        r#"import base64, json

SEEN = set()


def handler(event, context):
    ids, failed = [], []
    keys = [r["kinesis"]["partitionKey"] for r in event["Records"]]
    for i, record in enumerate(event["Records"]):
        record_id = json.loads(base64.b64decode(record["kinesis"]["data"]))["id"]
        once = not {one_per_key} or len(set(keys[i:])) == len(keys[i:])
        if record_id % 7 == 3 and record_id not in SEEN and once:
            failed.append(record["kinesis"]["sequenceNumber"])
        SEEN.add(record_id)
        ids.append(record_id)
    sequences = [r["kinesis"]["sequenceNumber"] for r in event["Records"]]
    noted = {{
        "ids": ids,
        "failed_from": min((sequences.index(s) for s in failed), default=None),
        "context": {{
            "function_name": context.function_name,
            "function_version": context.function_version,
            "invoked_function_arn": context.invoked_function_arn,
            "memory_limit_in_mb": context.memory_limit_in_mb,
            "aws_request_id": context.aws_request_id,
            "log_group_name": context.log_group_name,
            "log_stream_name": context.log_stream_name,
            "remaining_ms": context.get_remaining_time_in_millis(),
            "event_source_arn": event["Records"][0]["eventSourceARN"],
            "event_id": event["Records"][0]["eventID"],
        }},
    }}
    with open({notes:?}, "a") as notes:
        notes.write(json.dumps(noted) + "\n")
    print("handled", ids)
    return {{"batchItemFailures": [{{"itemIdentifier": s}} for s in failed]}}
"#,
        notes = notes.display().to_string(),
        one_per_key = if one_per_key { "True" } else { "False" },
    )
}

/// A Python function reporting `batchItemFailures` (ids `% 7 == 3`, the first time it sees
/// them): those records and the later ones of their batches are retried, in place, the others
/// handled once; each key's records are acked in order; what it prints does not disturb the
/// protocol; its context carries the function's fields.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_function_reporting_batch_item_failures_gets_those_records_retried() {
    let dir = scratch("lambda-python");
    let notes = dir.join("batches.jsonl");
    std::fs::write(dir.join("app.py"), reporting_function(&notes, true)).unwrap();
    let dir_arg = dir.display().to_string();
    let (lines, stderr) = consume_all(
        "lambda-py",
        KEYS,
        &[
            "--lambda-handler",
            "app.handler",
            "--lambda-runtime",
            "python",
            "--lambda-dir",
            &dir_arg,
            "--lambda-function-name",
            "orders-fn",
            "--batch",
            "10",
        ],
    )
    .await;
    assert_acked_once_in_order(&lines, KEYS);
    let batches = noted(&notes);
    let expected = to_retry(&batches);
    let reported = batches.iter().filter(|b| b.failed_from.is_some()).count();
    assert!(reported > 0, "some batches reported failures");
    assert_eq!(
        retried(&lines),
        expected,
        "retried: exactly what Lambda would"
    );
    assert!(
        expected.len() < RECORDS as usize,
        "the records before the first failure of a batch are not retried"
    );
    // The others: one line each, an ack.
    let once = lines.iter().filter(|h| !expected.contains(&h.id)).count();
    assert_eq!(once, RECORDS as usize - expected.len());
    let context = &batches[0].context;
    assert_eq!(context["function_name"], "orders-fn");
    assert_eq!(context["function_version"], "$LATEST");
    assert_eq!(context["log_group_name"], "/aws/lambda/orders-fn");
    assert!(
        context["invoked_function_arn"]
            .as_str()
            .is_some_and(
                |arn| arn.starts_with("arn:aws:lambda:") && arn.ends_with(":function:orders-fn")
            ),
        "{context}"
    );
    assert!(
        context["event_source_arn"].as_str().is_some_and(
            |arn| arn.starts_with("arn:aws:kinesis:") && arn.contains(":stream/lambda-py")
        ),
        "{context}"
    );
    assert!(
        context["event_id"]
            .as_str()
            .is_some_and(|id| id.starts_with("shardId-")),
        "{context}"
    );
    let remaining = context["remaining_ms"].as_u64().expect("remaining time");
    assert!((15_000..=20_000).contains(&remaining), "{context}");
    let requests: BTreeSet<&str> = batches
        .iter()
        .filter_map(|b| b.context["aws_request_id"].as_str())
        .collect();
    assert_eq!(requests.len(), batches.len(), "a request id per invocation");
    // What the function printed went to the log, not into the protocol.
    assert!(
        stderr.contains("handled ["),
        "the function's prints reach the log"
    );
    eprintln!(
        "python: {} batches, {reported} reporting failures, {} records retried",
        batches.len(),
        expected.len(),
    );
}

/// A handler written with Powertools for AWS Lambda (Python), as its documentation shows it for
/// Kinesis: `BatchProcessor(EventType.KinesisDataStreams)` with the parser's
/// `KinesisDataStreamRecord` model and `process_partial_response`, on every default of
/// `consume` (batches, batching window, retries). Its record handler raises for ids `% 7 == 3`
/// the first time it sees them; the processor reports those as batch item failures (or raises
/// when every record of the batch failed). Every event must validate against Powertools'
/// `KinesisDataStreamModel`, every reported failure is handed again with what follows it in its
/// batch, as Lambda does, and each key's records are acked once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_powertools_batch_processor_gets_its_failures_retried_on_default_flags() {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.emulators/venv/bin");
    let python = venv.join("python3");
    let imports = std::process::Command::new(&python)
        .args(["-c", "import aws_lambda_powertools.utilities.parser"])
        .status();
    assert!(
        imports.is_ok_and(|s| s.success()),
        "{} cannot import aws_lambda_powertools: `scripts/emulators install` puts it there",
        python.display()
    );
    let dir = scratch("lambda-powertools");
    let notes = dir.join("batches.jsonl");
    let function = format!(
        r#"import json

from aws_lambda_powertools.utilities.batch import (
    BatchProcessor,
    EventType,
    process_partial_response,
)
from aws_lambda_powertools.utilities.batch.exceptions import BatchProcessingError
from aws_lambda_powertools.utilities.parser import parse
from aws_lambda_powertools.utilities.parser.models import (
    KinesisDataStreamModel,
    KinesisDataStreamRecord,
)

processor = BatchProcessor(event_type=EventType.KinesisDataStreams, model=KinesisDataStreamRecord)
SEEN = set()


def record_handler(record: KinesisDataStreamRecord):
    record_id = json.loads(record.kinesis.data)["id"]
    first = record_id not in SEEN
    SEEN.add(record_id)
    if record_id % 7 == 3 and first:
        raise ValueError(f"record {{record_id}} fails once")


def lambda_handler(event, context):
    # The whole event through Powertools' model: a field shardwise got wrong fails here.
    parsed = parse(event=event, model=KinesisDataStreamModel)
    ids = [json.loads(r.kinesis.data)["id"] for r in parsed.Records]
    sequences = [r.kinesis.sequenceNumber for r in parsed.Records]
    noted = {{"ids": ids, "failed_from": None, "raised": False}}
    try:
        response = process_partial_response(
            event=event, record_handler=record_handler, processor=processor, context=context
        )
    except BatchProcessingError:
        noted["raised"] = True
        raise
    finally:
        with open({notes:?}, "a") as out:
            if not noted["raised"]:
                failed = [f["itemIdentifier"] for f in response["batchItemFailures"]]
                noted["failed_from"] = min((sequences.index(s) for s in failed), default=None)
            out.write(json.dumps(noted) + "\n")
    return response
"#,
        notes = notes.display().to_string(),
    );
    std::fs::write(dir.join("app.py"), function).unwrap();
    let dir_arg = dir.display().to_string();
    // The interpreter on the PATH is the venv's, which has Powertools (as a Lambda layer would).
    let path = format!(
        "{}:{}",
        venv.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let (lines, _) = consume_all_with_env(
        "lambda-pt",
        KEYS,
        &[
            "--lambda-handler",
            "app.lambda_handler",
            "--lambda-dir",
            &dir_arg,
        ],
        &[("PATH", path)],
    )
    .await;
    assert_acked_once_in_order(&lines, KEYS);
    let batches = noted(&notes);
    assert!(
        batches.iter().any(|b| b.failed_from.is_some() || b.raised),
        "some batches failed: {batches:?}"
    );
    let expected = to_retry(&batches);
    assert!(!expected.is_empty());
    assert_eq!(
        retried(&lines),
        expected,
        "retried: exactly what Lambda would"
    );
    let noted_ids: BTreeSet<u64> = batches.iter().flat_map(|b| b.ids.iter().copied()).collect();
    assert_eq!(
        noted_ids,
        (0..RECORDS).collect(),
        "every event validated against Powertools' model"
    );
    eprintln!(
        "powertools: {} batches, {} failing, {} records retried",
        batches.len(),
        batches
            .iter()
            .filter(|b| b.failed_from.is_some() || b.raised)
            .count(),
        expected.len(),
    );
}

/// A Node.js function (an ES module's async handler, its runtime told by its file) reporting
/// `batchItemFailures`: the same semantics, and Node's context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_function_reporting_batch_item_failures_gets_those_records_retried() {
    let dir = scratch("lambda-node");
    let notes = dir.join("batches.jsonl");
    let function = format!(
        r#"import {{ appendFileSync }} from 'node:fs';

const seen = new Set();

export const handler = async (event, context) => {{
  const ids = [];
  let failedFrom = null;
  const batchItemFailures = [];
  const keys = event.Records.map((record) => record.kinesis.partitionKey);
  event.Records.forEach((record, i) => {{
    const id = JSON.parse(Buffer.from(record.kinesis.data, 'base64').toString()).id;
    // Only where no key has two records from here on (see the Python function).
    const once = new Set(keys.slice(i)).size === keys.length - i;
    if (id % 5 === 1 && !seen.has(id) && once) {{
      batchItemFailures.push({{ itemIdentifier: record.kinesis.sequenceNumber }});
      if (failedFrom === null) failedFrom = i;
    }}
    seen.add(id);
    ids.push(id);
  }});
  await new Promise((resolve) => setTimeout(resolve, 1));
  const noted = {{
    ids,
    failed_from: failedFrom,
    context: {{
      function_name: context.functionName,
      aws_request_id: context.awsRequestId,
      memory_limit_in_mb: context.memoryLimitInMB,
      remaining_ms: context.getRemainingTimeInMillis(),
    }},
  }};
  appendFileSync({notes:?}, JSON.stringify(noted) + '\n');
  console.log('handled', ids.length);
  return {{ batchItemFailures }};
}};
"#,
        notes = notes.display().to_string()
    );
    std::fs::write(dir.join("index.mjs"), function).unwrap();
    let dir_arg = dir.display().to_string();
    let (lines, stderr) = consume_all(
        "lambda-node",
        KEYS,
        &[
            "--lambda-handler",
            "index.handler",
            "--lambda-dir",
            &dir_arg,
            "--batch",
            "10",
        ],
    )
    .await;
    assert_acked_once_in_order(&lines, KEYS);
    let batches = noted(&notes);
    let expected = to_retry(&batches);
    assert!(
        batches.iter().any(|b| b.failed_from.is_some()),
        "some batches reported failures"
    );
    assert_eq!(
        retried(&lines),
        expected,
        "retried: exactly what Lambda would"
    );
    let context = &batches[0].context;
    assert!(
        context["function_name"]
            .as_str()
            .is_some_and(|f| f.starts_with("lambda-node-app")),
        "--app by default: {context}"
    );
    assert_eq!(context["memory_limit_in_mb"], "128");
    assert!(
        context["remaining_ms"]
            .as_u64()
            .is_some_and(|ms| ms > 15_000),
        "{context}"
    );
    assert!(stderr.contains("handled "), "console.log reaches the log");
    eprintln!(
        "node: {} batches, {} records retried",
        batches.len(),
        expected.len()
    );
}

/// `--bisect-batch-on-error` (Lambda's BisectBatchOnFunctionError): a function that raises while
/// its batch holds a poison record (ids `% 20 == 7`, until each has failed alone) has the batch
/// handled again in halves, each failing half split again, down to the poison record alone, which
/// alone takes the retry path. The halves without it settle: no other record is ever retried.
/// Without the flag every record of a raising batch is retried (the test below).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raising_batch_is_bisected_down_to_its_poison_record() {
    let dir = scratch("lambda-bisect");
    let notes = dir.join("batches.jsonl");
    let function = format!(
        r#"import base64, json

ALONE = set()


def handler(event, context):
    ids = [json.loads(base64.b64decode(r["kinesis"]["data"]))["id"] for r in event["Records"]]
    # A poison record fails every call until it has failed alone once.
    poison = [i for i in ids if i % 20 == 7 and i not in ALONE]
    if ids == poison:
        ALONE.update(poison)
    with open({notes:?}, "a") as notes:
        notes.write(json.dumps({{"ids": ids, "raised": bool(poison)}}) + "\n")
    if poison:
        raise ValueError("cannot handle %s" % poison)
"#,
        notes = notes.display().to_string()
    );
    std::fs::write(dir.join("poison.py"), function).unwrap();
    let dir_arg = dir.display().to_string();
    let (lines, _) = consume_all(
        "lambda-bisect",
        KEYS,
        &[
            "--lambda-handler",
            "poison.handler",
            "--lambda-dir",
            &dir_arg,
            "--bisect-batch-on-error",
        ],
    )
    .await;
    assert_acked_once_in_order(&lines, KEYS);
    let poison: BTreeSet<u64> = (0..RECORDS).filter(|i| i % 20 == 7).collect();
    let batches = noted(&notes);
    assert!(
        batches.iter().any(|b| b.raised && b.ids.len() > 1),
        "a batch of several raised: {batches:?}"
    );
    assert_eq!(
        retried(&lines),
        to_retry(&batches),
        "each record of a raising call failed that call"
    );
    // A raising batch of several is handled again at once as its halves, the front half first.
    for (at, batch) in batches.iter().enumerate() {
        if batch.raised && batch.ids.len() > 1 {
            let front = &batch.ids[..batch.ids.len() / 2];
            assert!(
                batches[at + 1..].iter().any(|b| b.ids == front),
                "{:?} raised and was not handled again as its front half {front:?}: {batches:?}",
                batch.ids
            );
        }
    }
    // Every record not poison settled without ever failing alone.
    for b in batches.iter().filter(|b| b.raised && b.ids.len() == 1) {
        assert!(poison.contains(&b.ids[0]), "{:?} failed alone", b.ids);
    }
    // Each poison record failed alone at least once: the halving reached it.
    for id in &poison {
        assert!(
            batches.iter().any(|b| b.raised && b.ids == [*id]),
            "{id} never alone: {batches:?}"
        );
    }
    eprintln!(
        "bisect: {} invocations, {} raised",
        batches.len(),
        batches.iter().filter(|b| b.raised).count()
    );
}

/// A function that raises fails its whole batch: every record of it is retried (in place, in
/// order), the traceback reaches the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_function_that_raises_gets_its_whole_batch_retried() {
    let dir = scratch("lambda-raise");
    let notes = dir.join("batches.jsonl");
    let function = format!(
        r#"import base64, json

SEEN = set()


def handler(event, context):
    ids = [json.loads(base64.b64decode(r["kinesis"]["data"]))["id"] for r in event["Records"]]
    keys = [r["kinesis"]["partitionKey"] for r in event["Records"]]
    # Only an event without two records of one key (see reporting_function).
    once = len(set(keys)) == len(keys)
    poison = [i for i in ids if i % 10 == 5 and i not in SEEN and once]
    SEEN.update(ids)
    with open({notes:?}, "a") as notes:
        notes.write(json.dumps({{"ids": ids, "raised": bool(poison)}}) + "\n")
    if poison:
        raise ValueError("cannot handle %s" % poison)
"#,
        notes = notes.display().to_string()
    );
    std::fs::write(dir.join("raising.py"), function).unwrap();
    let dir_arg = dir.display().to_string();
    let (lines, stderr) = consume_all(
        "lambda-raise",
        KEYS,
        &[
            "--lambda-handler",
            "raising.handler",
            "--lambda-dir",
            &dir_arg,
            "--batch",
            "6",
        ],
    )
    .await;
    assert_acked_once_in_order(&lines, KEYS);
    let batches = noted(&notes);
    let expected = to_retry(&batches);
    assert!(
        batches.iter().any(|b| b.raised && b.ids.len() > 1),
        "a batch of several raised"
    );
    assert_eq!(
        retried(&lines),
        expected,
        "every record of a raising batch retried"
    );
    assert!(
        stderr.contains("ValueError: cannot handle"),
        "the traceback reaches the log"
    );
    assert!(
        stderr.contains("the function failed: ValueError"),
        "the failed batch is logged"
    );
    eprintln!(
        "raise: {} batches, {} records retried",
        batches.len(),
        expected.len()
    );
}

/// AWS's published sample handlers, unchanged (`examples/lambda/`, from aws-samples/serverless-snippets
/// as the Lambda developer guide's "Using Lambda with Kinesis" shows them): the Python one that
/// decodes and prints each record, the Python partial-batch-response one, and the Node.js one,
/// each consuming the whole stream as its own application.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aws_sample_handlers_run_unchanged() {
    let _turn = EMULATORS.read().await;
    let live = support::live("aws_sample_handlers_run_unchanged")
        .await
        .expect("the emulators (SHARDWISE_LIVE)");
    let stream = support::unique_name("lambda-samples");
    live.create_stream(&stream, 1).await;
    put(&stream, RECORDS, KEYS, 0).await;
    let dir = examples().display().to_string();
    let samples = [
        ("lambda_function.lambda_handler", "python"),
        ("batch_item_failures.handler", "python"),
        ("index.handler", "node"),
    ];
    let started = Instant::now();
    let mut workers = Vec::new();
    for (i, (handler, runtime)) in samples.iter().enumerate() {
        let app = support::unique_name(&format!("lambda-sample-{i}"));
        let log = Log::default();
        let args = worker_args(&[
            "--lambda-handler",
            handler,
            "--lambda-runtime",
            runtime,
            "--lambda-dir",
            &dir,
        ]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let worker = Worker::spawn(&stream, &app, &format!("S{i}"), &args, &log);
        workers.push((handler, app, log, worker));
    }
    for (handler, _, log, _) in &workers {
        wait_for(
            &format!("{handler}: every record handled"),
            Duration::from_secs(60),
            || log.distinct_ids() as u64 >= RECORDS,
        )
        .await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    for (handler, app, log, mut worker) in workers {
        worker.stop_gracefully(Duration::from_secs(30)).await;
        log.assert_no_garbage();
        let lines = log.snapshot();
        assert_acked_once_in_order(&lines, KEYS);
        assert_eq!(
            retried(&lines),
            BTreeSet::new(),
            "{handler}: nothing failed"
        );
        let stderr = std::fs::read_to_string(&worker.stderr).unwrap_or_default();
        assert!(
            !stderr.contains("handler program replaced"),
            "{handler}: {}",
            worker.stderr_tail()
        );
        if handler != &"batch_item_failures.handler" {
            // The samples' own prints, through the log.
            assert!(
                stderr.contains("Processed Kinesis Event - EventID: shardId-000000000000:"),
                "{handler}: {}",
                worker.stderr_tail()
            );
            assert!(stderr.contains(r#"Record Data: {"id":"#), "{handler}");
        }
        live.delete_table(&app).await;
    }
    live.delete_stream(&stream).await;
    eprintln!(
        "3 samples, {RECORDS} records each, in {:?}",
        started.elapsed()
    );
}

/// A handler program whose answers carry fields shardwise does not know (a single answer's, a
/// batch's, an outcome's) is not taken for garbage: nothing is killed, every record acked once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_with_unknown_fields_are_taken() {
    let program = r#"python3 -u -c 'import json,sys
for line in sys.stdin:
    r = json.loads(line)
    if "batch" in r:
        outcomes = [{"id": d["id"], "outcome": "ack", "key": d["idempotency_key"]} for d in r["batch"]]
        print(json.dumps({"id": r["id"], "outcomes": outcomes, "took_ms": 1, "host": "h"}))
    elif "id" in r:
        print(json.dumps({"id": r["id"], "outcome": "ack", "trace": {"span": 1}}))'"#;
    let (lines, _) =
        consume_all("lambda-unknown", KEYS, &["--exec", program, "--batch", "5"]).await;
    assert_acked_once_in_order(&lines, KEYS);
    assert_eq!(lines.len() as u64, RECORDS, "each record handled once");
}

/// The shutdown notice: at SIGTERM the worker first writes `{"shutdown": {"deadline_ms": N}}`
/// (N: the shutdown deadline left) to each handler program, before it signals them; a program
/// that then exits with nothing in flight ends there, not replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shutdown_notice_reaches_each_program_before_sigterm() {
    let dir = scratch("lambda-notice");
    let notes = dir.join("notes");
    let program = format!(
        r#"python3 -u -c 'import json,os,signal,sys
notes = open(sys.argv[1], "a", buffering=1)
signal.signal(signal.SIGTERM, lambda *_: (notes.write("SIGTERM %d\n" % os.getpid()), sys.exit(0)))
for line in sys.stdin:
    r = json.loads(line)
    if "shutdown" in r:
        notes.write("notice %d %d\n" % (os.getpid(), r["shutdown"]["deadline_ms"]))
        if os.environ["SHARDWISE_CHILD"] == "0":
            sys.exit(0)
        continue
    print(json.dumps({{"id": r["id"], "outcome": "ack"}}))
signal.pause()' {}"#,
        notes.display()
    );
    let (lines, stderr) = consume_all(
        "lambda-notice",
        KEYS,
        &["--exec", &program, "--exec-children", "2"],
    )
    .await;
    assert_acked_once_in_order(&lines, KEYS);
    let noted = std::fs::read_to_string(&notes).unwrap_or_default();
    let noted: Vec<Vec<&str>> = noted.lines().map(|l| l.split(' ').collect()).collect();
    // Two programs: both told, with the deadline left; the one that exits on
    // the notice never sees SIGTERM, the other sees it after its notice.
    let notices: Vec<&Vec<&str>> = noted.iter().filter(|n| n[0] == "notice").collect();
    assert_eq!(notices.len(), 2, "{noted:?}");
    for notice in &notices {
        let ms: u64 = notice[2].parse().unwrap();
        assert!((3_000..=4_000).contains(&ms), "{noted:?}");
    }
    let terms: Vec<&Vec<&str>> = noted.iter().filter(|n| n[0] == "SIGTERM").collect();
    assert_eq!(terms.len(), 1, "{noted:?}");
    let term_at = noted.iter().position(|n| n[0] == "SIGTERM").unwrap();
    let its_notice = noted
        .iter()
        .position(|n| n[0] == "notice" && n[1] == terms[0][1])
        .expect("the signalled program was told first");
    assert!(its_notice < term_at, "{noted:?}");
    assert!(
        stderr.contains("handler program ended after the shutdown notice"),
        "the program that ended is not replaced"
    );
}

/// The idempotency key a program reads survives a retry copy: the copy (another record, at the
/// tip of the stream) carries its original's key and origin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_copy_carries_its_originals_idempotency_key() {
    let dir = scratch("lambda-key");
    let notes = dir.join("notes.jsonl");
    let program = format!(
        r#"python3 -u -c 'import json,sys
notes = open(sys.argv[1], "a", buffering=1)
for line in sys.stdin:
    d = json.loads(line)
    if "id" not in d:
        continue
    record = json.loads(d["data"])["id"]
    notes.write(json.dumps({{"record": record, "attempt": d["attempt"], "sequence": d["sequence"], "key": d["idempotency_key"], "origin": d["origin"]}}) + "\n")
    outcome = "retry" if record % 10 == 0 and d["attempt"] == 1 else "ack"
    print(json.dumps({{"id": d["id"], "outcome": outcome}}))' {}"#,
        notes.display()
    );
    let (lines, _) = consume_all(
        "lambda-key",
        KEYS,
        &[
            "--exec",
            &program,
            "--retries",
            "copy",
            "--max-attempts",
            "3",
        ],
    )
    .await;
    let acks: Vec<Handled> = lines
        .iter()
        .filter(|h| h.outcome == "ack")
        .cloned()
        .collect();
    assert_nothing_skipped(&acks, RECORDS);
    assert_eq!(duplicates(&acks), BTreeMap::new(), "acked more than once");
    let noted: Vec<Value> = std::fs::read_to_string(&notes)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let of = |record: u64, attempt: u64| {
        noted
            .iter()
            .find(|n| n["record"] == record && n["attempt"] == attempt)
            .unwrap_or_else(|| panic!("record {record}, attempt {attempt}: {noted:?}"))
    };
    let mut copies = 0;
    for record in (0..RECORDS).filter(|r| r % 10 == 0) {
        let (first, copy) = (of(record, 1), of(record, 2));
        assert_ne!(
            first["sequence"], copy["sequence"],
            "a copy is another record"
        );
        assert_eq!(first["key"], copy["key"], "record {record}");
        assert_eq!(first["origin"], copy["origin"], "record {record}");
        assert_eq!(first["origin"]["sequence"], first["sequence"]);
        let key = first["key"].as_str().unwrap();
        assert!(
            key.starts_with("kinesis/lambda-key")
                && key.ends_with(&format!("/{}.0", first["sequence"].as_str().unwrap())),
            "{key}"
        );
        copies += 1;
    }
    eprintln!("{copies} copies carried their original's key");
}

/// Lambda retries a failed record and every later one of its event, so two records of one key
/// can fail together. In place, each runs again on its own back-off; the lane keeps the key
/// parked until both succeeded and runs their next attempts in shard order (before, the later
/// one could run first: 24 order violations in one run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_failed_records_of_one_key_in_one_event_keep_their_order() {
    let dir = scratch("lambda-two-keys");
    let notes = dir.join("batches.jsonl");
    std::fs::write(dir.join("app.py"), reporting_function(&notes, false)).unwrap();
    let dir_arg = dir.display().to_string();
    let (lines, _) = consume_all(
        "lambda-two-keys",
        2,
        &[
            "--lambda-handler",
            "app.handler",
            "--lambda-dir",
            &dir_arg,
            "--batch",
            "10",
        ],
    )
    .await;
    assert_acked_once_in_order(&lines, 2);
}

/// `--filter-criteria` as the AWS CLI takes it (Lambda's `FilterCriteria`; here the records with
/// an id below 40, of 80): only those reach the handler, each once, and the others settle
/// without it, so every shard's checkpoint reaches its last record (Lambda's iterator moves past
/// a filtered record the same way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filter_criteria_let_only_matching_records_reach_the_handler_and_the_rest_settle() {
    let _turn = EMULATORS.read().await;
    let live = support::live("filter")
        .await
        .expect("the emulators (SHARDWISE_LIVE)");
    let stream = support::unique_name("filter");
    let app = support::unique_name("filter-app");
    live.create_stream(&stream, 2).await;
    put(&stream, RECORDS, KEYS, 0).await;
    let criteria = r#"{"Filters":[{"Pattern":"{\"data\":{\"id\":[{\"numeric\":[\"<\",40]}]}}"}]}"#;
    let log = Log::default();
    let args = worker_args(&["--filter-criteria", criteria]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut worker = Worker::spawn(&stream, &app, "F", &args, &log);
    wait_for(
        "the 40 matching records acked",
        Duration::from_secs(60),
        || log.distinct_ids() >= 40,
    )
    .await;
    let mut last = BTreeMap::new();
    for shard in live.shard_ids(&stream).await {
        let records = read_shard(&live, &stream, &shard).await;
        last.insert(shard, records.last().expect("records").0.clone());
    }
    wait_rows(
        &live,
        &app,
        &stream,
        "every shard checkpointed at its last record",
        Duration::from_secs(30),
        |rows| {
            rows.len() == last.len()
                && rows
                    .iter()
                    .all(|r| last.get(&r.shard) == Some(&r.checkpoint))
        },
    )
    .await;
    worker.stop_gracefully(Duration::from_secs(30)).await;
    log.assert_no_garbage();
    let lines = log.snapshot();
    let acked: Vec<u64> = lines
        .iter()
        .filter(|h| h.outcome == "ack")
        .map(|h| h.id)
        .collect();
    assert_eq!(
        acked.iter().copied().collect::<BTreeSet<_>>(),
        (0..40).collect::<BTreeSet<_>>(),
        "ids below 40, and no other"
    );
    assert_eq!(acked.len(), 40, "each once");
    cleanup(&live, &stream, &app).await;
}

/// Lambda's tumbling windows (`--tumbling-window 3s`) with a Python function written as AWS's
/// documentation shows (a count per partition key in `state`, returned every call): each call
/// gets the state the last one returned (`{}` at a window's first), the event carries `window`
/// (3 s apart, in ISO 8601), `shardId`, `eventSourceARN` and the two flags, and each window ends
/// with one final call without records whose state counts every record of the window: together,
/// every record once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tumbling_window_carries_its_state_between_calls_and_ends_with_a_final_call() {
    let _turn = EMULATORS.read().await;
    let live = support::live("window")
        .await
        .expect("the emulators (SHARDWISE_LIVE)");
    let stream = support::unique_name("window");
    let app = support::unique_name("window-app");
    live.create_stream(&stream, 1).await;
    let dir = scratch("lambda-window");
    let notes = dir.join("calls.jsonl");
    std::fs::write(
        dir.join("app.py"),
        format!(
            r#"import base64, json

def handler(event, context):
    noted = {{k: event[k] for k in ("window", "state", "shardId", "eventSourceARN", "isFinalInvokeForWindow", "isWindowTerminatedEarly")}}
    noted["ids"] = [json.loads(base64.b64decode(r["kinesis"]["data"]))["id"] for r in event["Records"]]
    state = dict(event["state"])
    for record in event["Records"]:
        key = record["kinesis"]["partitionKey"]
        state[key] = state.get(key, 0) + 1
    noted["returned"] = state
    with open({notes:?}, "a") as f:
        f.write(json.dumps(noted) + "\n")
    return {{"state": state}}
"#,
            notes = notes.display().to_string(),
        ),
    )
    .unwrap();
    put(&stream, RECORDS, KEYS, 0).await;
    let dir_arg = dir.display().to_string();
    let log = Log::default();
    let args = worker_args(&[
        "--lambda-handler",
        "app.handler",
        "--lambda-runtime",
        "python",
        "--lambda-dir",
        &dir_arg,
        "--batch",
        "10",
        "--tumbling-window",
        "3s",
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut worker = Worker::spawn(&stream, &app, "W", &args, &log);
    let calls = || -> Vec<Value> {
        std::fs::read_to_string(&notes)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("a noted call"))
            .collect()
    };
    let counted = |calls: &[Value]| -> u64 {
        calls
            .iter()
            .filter(|c| c["isFinalInvokeForWindow"] == true)
            .flat_map(|c| c["state"].as_object().expect("a state").values())
            .map(|n| n.as_u64().expect("a count"))
            .sum()
    };
    wait_for(
        "final calls counting every record",
        Duration::from_secs(90),
        || counted(&calls()) >= RECORDS,
    )
    .await;
    worker.stop_gracefully(Duration::from_secs(30)).await;
    log.assert_no_garbage();
    let calls = calls();
    assert_eq!(
        counted(&calls),
        RECORDS,
        "every record counted once: {calls:?}"
    );
    let handled: Vec<u64> = calls
        .iter()
        .flat_map(|c| {
            c["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i.as_u64().unwrap())
        })
        .collect();
    assert_eq!(
        handled.iter().copied().collect::<BTreeSet<_>>(),
        (0..RECORDS).collect::<BTreeSet<_>>()
    );
    assert_eq!(handled.len(), RECORDS as usize, "each record in one call");
    let mut finals = BTreeSet::new();
    let mut returned: BTreeMap<String, Value> = BTreeMap::new();
    for call in &calls {
        let window = &call["window"];
        let (start, end) = (
            window["start"].as_str().expect("start"),
            window["end"].as_str().expect("end"),
        );
        let parse = |t: &str| humantime::parse_rfc3339(t).expect("ISO 8601");
        assert_eq!(
            parse(end).duration_since(parse(start)).unwrap(),
            Duration::from_secs(3),
            "{call}"
        );
        assert!(start.ends_with('Z'), "{call}");
        assert_eq!(call["shardId"], "shardId-000000000000", "{call}");
        assert!(
            call["eventSourceARN"]
                .as_str()
                .is_some_and(|a| a.starts_with("arn:aws:kinesis:") && a.ends_with(&stream)),
            "{call}"
        );
        assert_eq!(call["isWindowTerminatedEarly"], false, "{call}");
        // The state is what the window's last call returned ({} at its first).
        let expected = returned
            .get(start)
            .cloned()
            .unwrap_or_else(|| serde_json::json!({}));
        assert_eq!(call["state"], expected, "{call}");
        assert!(
            !finals.contains(start),
            "a call after its window's final one: {call}"
        );
        if call["isFinalInvokeForWindow"] == true {
            assert!(call["ids"].as_array().unwrap().is_empty(), "{call}");
            finals.insert(start.to_string());
        }
        returned.insert(start.to_string(), call["returned"].clone());
    }
    assert_eq!(
        finals.len(),
        returned.len(),
        "one final call for each window: {calls:?}"
    );
    cleanup(&live, &stream, &app).await;
}
