//! `shardwise put`: numbered JSON records, in order per partition key.
//!
//! # Order per key, and why batches never repeat a key
//!
//! PutRecords is not atomic: any entry of a request may fail (throttling, an internal error) while
//! the entries after it succeed. If a request held ids 3 and 19 of one key and 3 failed while 19
//! succeeded, resending 3 would land it after 19 and break the key's order, and nothing can take
//! 19 back. So a request never holds two records of the same key: record `id` has the key
//! `key-{id % K}`, and any run of at most K consecutive ids has K distinct keys, so every request
//! is a run of consecutive ids no longer than K (and at most 500 records and 5 MiB). The failed
//! entries of a request are resent (in their original order) until all succeeded, and only then
//! does the next request start. Every record of a key is therefore written after every
//! lower id of the same key. The price is smaller requests when `--keys` is below 500.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::bail;
use aws_sdk_kinesis::Client;
use aws_sdk_kinesis::primitives::Blob;
use aws_sdk_kinesis::types::PutRecordsRequestEntry;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

use crate::common::{Ctx, Result, backoff, kinesis_error, pause, print_json_lines};

/// Kinesis limits on one PutRecords request and one record (data plus partition key).
const MAX_BATCH_RECORDS: u64 = 500;
const MAX_BATCH_BYTES: usize = 5 * 1024 * 1024;
const MAX_RECORD_BYTES: usize = 1024 * 1024;

/// How often the failed entries of one request are resent before giving up.
const MAX_ATTEMPTS: u32 = 20;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The stream to write to.
    #[arg(long, value_name = "STREAM")]
    stream: String,

    /// How many records to write.
    #[arg(long, value_name = "N")]
    count: u64,

    /// How many partition keys to spread the records over: record `id` gets `key-{id % KEYS}`.
    #[arg(
        long,
        value_name = "K",
        default_value_t = 16,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    keys: u64,

    /// Pad every record's JSON to this many bytes with a `"pad": "xxx..."` field (a record whose
    /// bare `{"id":N}` is already longer is written unpadded).
    #[arg(long, value_name = "BYTES")]
    size: Option<usize>,

    /// The id of the first record; ids increase by one from here.
    #[arg(long, value_name = "I", default_value_t = 0)]
    start_id: u64,
}

/// The line printed once every record is written.
#[derive(Debug, Serialize)]
struct Summary<'a> {
    stream: &'a str,
    written: u64,
    first_id: Option<u64>,
    last_id: Option<u64>,
    seconds: f64,
}

pub(crate) async fn run(args: Args, ctx: &Ctx) -> Result<()> {
    let Some(end) = args.start_id.checked_add(args.count) else {
        bail!(
            "--start-id {} + --count {} is past the largest id",
            args.start_id,
            args.count
        );
    };
    let longest_key = partition_key(args.keys - 1, args.keys).len();
    if let Some(size) = args.size
        && size + longest_key > MAX_RECORD_BYTES
    {
        bail!(
            "--size {size} is too large: a record's data plus its partition key may have at most \
             {MAX_RECORD_BYTES} bytes"
        );
    }

    let client = ctx.kinesis();
    let progress = progress_bar(args.count);
    let started = Instant::now();
    let mut next = args.start_id;
    while next < end {
        let batch = next_batch(next, end, &args);
        let written = batch.len() as u64;
        put_batch(&client, &args.stream, batch).await?;
        next += written;
        progress.inc(written);
    }
    progress.finish_and_clear();

    let written = args.count > 0;
    print_json_lines([Summary {
        stream: &args.stream,
        written: args.count,
        first_id: written.then_some(args.start_id),
        last_id: written.then_some(end - 1),
        seconds: (started.elapsed().as_secs_f64() * 1000.0).round() / 1000.0,
    }])
}

/// One record on its way: its id and the request entry.
type Pending = (u64, PutRecordsRequestEntry);

/// The records of the next request: consecutive ids from `from`, never two of one key (see the
/// module docs), within the request limits.
fn next_batch(from: u64, end: u64, args: &Args) -> Vec<Pending> {
    let max_records = MAX_BATCH_RECORDS.min(args.keys).min(end - from);
    let mut batch = Vec::new();
    let mut bytes = 0;
    for id in from..from + max_records {
        let key = partition_key(id, args.keys);
        let data = record_data(id, args.size);
        let size = key.len() + data.len();
        if !batch.is_empty() && bytes + size > MAX_BATCH_BYTES {
            break;
        }
        bytes += size;
        let entry = PutRecordsRequestEntry::builder()
            .partition_key(key)
            .data(Blob::new(data))
            .build()
            .expect("data and partition key are set");
        batch.push((id, entry));
    }
    batch
}

/// Writes one request's records, resending failed entries (in order) until all are written.
async fn put_batch(client: &Client, stream: &str, mut pending: Vec<Pending>) -> Result<()> {
    let mut delays = backoff(Duration::from_millis(50), Duration::from_secs(2));
    for attempt in 1.. {
        let out = client
            .put_records()
            .stream_name(stream)
            .set_records(Some(pending.iter().map(|(_, e)| e.clone()).collect()))
            .send()
            .await
            .map_err(|e| kinesis_error("PutRecords", stream, None, e))?;
        let results = out.records();
        if results.len() != pending.len() {
            bail!(
                "PutRecords on stream `{stream}` answered {} results for {} records",
                results.len(),
                pending.len()
            );
        }
        if out.failed_record_count().unwrap_or(0) == 0
            && results.iter().all(|r| r.error_code().is_none())
        {
            return Ok(());
        }
        let first_failure = results
            .iter()
            .zip(&pending)
            .find(|(r, _)| r.error_code().is_some())
            .map(|(r, (id, _))| {
                format!(
                    "id {id}: {}: {}",
                    r.error_code().unwrap_or_default(),
                    r.error_message().unwrap_or_default()
                )
            })
            .unwrap_or_default();
        // Keep exactly the failed entries, in their original order.
        let failed: Vec<Pending> = pending
            .into_iter()
            .zip(results)
            .filter(|(_, r)| r.error_code().is_some())
            .map(|(p, _)| p)
            .collect();
        tracing::debug!(
            stream,
            attempt,
            failed = failed.len(),
            first_failure,
            "resending failed PutRecords entries"
        );
        if attempt >= MAX_ATTEMPTS {
            bail!(
                "PutRecords on stream `{stream}`: {} records still failed after {MAX_ATTEMPTS} \
                 attempts (first: {first_failure})",
                failed.len()
            );
        }
        pending = failed;
        pause(&mut delays).await;
    }
    unreachable!("the loop returns")
}

fn partition_key(id: u64, keys: u64) -> String {
    format!("key-{}", id % keys)
}

/// `{"id":<id>}`, padded to `size` bytes when given (never truncated).
fn record_data(id: u64, size: Option<usize>) -> Vec<u8> {
    let bare = format!("{{\"id\":{id}}}");
    let Some(size) = size else {
        return bare.into_bytes();
    };
    // `{"id":N,"pad":""}` is the bare object plus these bytes.
    const PAD_FIELD: usize = r#","pad":"""#.len();
    if size >= bare.len() + PAD_FIELD {
        let pad = "x".repeat(size - bare.len() - PAD_FIELD);
        format!("{{\"id\":{id},\"pad\":\"{pad}\"}}").into_bytes()
    } else if size > bare.len() {
        // Too little room for the field: JSON whitespace before the closing brace.
        let spaces = " ".repeat(size - bare.len());
        format!("{{\"id\":{id}{spaces}}}").into_bytes()
    } else {
        bare.into_bytes()
    }
}

/// A progress bar on stderr when stderr is a terminal; hidden otherwise.
fn progress_bar(count: u64) -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(count), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{bar:30} {human_pos}/{human_len} records, {elapsed} elapsed, eta {eta}",
    ) {
        bar.set_style(style);
    }
    bar
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn args(keys: u64, size: Option<usize>) -> Args {
        Args {
            stream: "s".into(),
            count: 0,
            keys,
            size,
            start_id: 0,
        }
    }

    #[test]
    fn records_are_padded_to_the_size_and_stay_json() {
        for (id, size) in [
            (7, None),
            (7, Some(1)),
            (7, Some(10)),
            (7, Some(16)),
            (7, Some(17)),
        ]
        .into_iter()
        .chain((0..200).map(|n| (123_456, Some(n))))
        {
            let data = record_data(id, size);
            let value: Value = serde_json::from_slice(&data).expect("valid JSON");
            assert_eq!(value["id"], id);
            let bare = format!("{{\"id\":{id}}}").len();
            assert_eq!(data.len(), size.unwrap_or(0).max(bare), "{size:?}");
        }
    }

    #[test]
    fn a_batch_never_holds_two_records_of_one_key() {
        for keys in [1, 3, 16, 499, 500, 501, 2000] {
            let mut from = 5;
            while from < 3000 {
                let batch = next_batch(from, 3000, &args(keys, None));
                let ids: Vec<u64> = batch.iter().map(|(id, _)| *id).collect();
                assert_eq!(ids, (from..from + ids.len() as u64).collect::<Vec<_>>());
                let mut seen = std::collections::HashSet::new();
                for (_, entry) in &batch {
                    assert!(seen.insert(entry.partition_key().to_owned()), "keys {keys}");
                }
                assert!(batch.len() as u64 <= MAX_BATCH_RECORDS.min(keys));
                from += ids.len() as u64;
            }
        }
    }

    /// A one-connection-at-a-time HTTP server answering each request with the next canned
    /// PutRecords response, and recording the ids each request carried.
    async fn fake_kinesis(
        responses: Vec<Value>,
    ) -> (String, tokio::task::JoinHandle<Vec<Vec<u64>>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            let mut requests = Vec::new();
            let mut responses = responses.into_iter();
            'connections: loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                let mut buffer = Vec::new();
                loop {
                    // Headers, then a body of Content-Length bytes.
                    let head_end = loop {
                        if let Some(i) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                            break i + 4;
                        }
                        let mut chunk = [0u8; 4096];
                        let n = socket.read(&mut chunk).await.unwrap();
                        if n == 0 {
                            continue 'connections;
                        }
                        buffer.extend_from_slice(&chunk[..n]);
                    };
                    let head = String::from_utf8_lossy(&buffer[..head_end]).to_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map(|v| v.trim().parse().unwrap())
                        .unwrap_or(0);
                    while buffer.len() < head_end + length {
                        let mut chunk = [0u8; 4096];
                        let n = socket.read(&mut chunk).await.unwrap();
                        buffer.extend_from_slice(&chunk[..n]);
                    }
                    let body: Value =
                        serde_json::from_slice(&buffer[head_end..head_end + length]).unwrap();
                    buffer.drain(..head_end + length);
                    let ids = body["Records"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|r| {
                            use base64::Engine;
                            let data = base64::engine::general_purpose::STANDARD
                                .decode(r["Data"].as_str().unwrap())
                                .unwrap();
                            serde_json::from_slice::<Value>(&data).unwrap()["id"]
                                .as_u64()
                                .unwrap()
                        })
                        .collect();
                    requests.push(ids);
                    let Some(response) = responses.next() else {
                        break 'connections;
                    };
                    let response = response.to_string();
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/x-amz-json-1.1\r\n\
                         content-length: {}\r\n\r\n{response}",
                        response.len()
                    );
                    socket.write_all(reply.as_bytes()).await.unwrap();
                    if responses.len() == 0 {
                        break 'connections;
                    }
                }
            }
            requests
        });
        (url, server)
    }

    fn result(failed: bool) -> Value {
        if failed {
            json!({
                "ErrorCode": "ProvisionedThroughputExceededException",
                "ErrorMessage": "slow down",
            })
        } else {
            json!({"SequenceNumber": "1", "ShardId": "shardId-000000000000"})
        }
    }

    #[tokio::test]
    async fn only_failed_entries_are_resent_in_their_order() {
        let failures = [
            vec![false, true, false, true, true],
            vec![true, false, true],
            vec![false, false],
        ];
        let responses = failures
            .iter()
            .map(|f| {
                let count = f.iter().filter(|f| **f).count();
                json!({
                    "FailedRecordCount": count,
                    "Records": f.iter().map(|f| result(*f)).collect::<Vec<_>>(),
                })
            })
            .collect();
        let (url, server) = fake_kinesis(responses).await;
        let config = aws_sdk_kinesis::Config::builder()
            .behavior_version(aws_config::BehaviorVersion::latest())
            .region(aws_sdk_kinesis::config::Region::new("us-east-1"))
            .credentials_provider(aws_sdk_kinesis::config::Credentials::new(
                "test", "test", None, None, "test",
            ))
            .endpoint_url(url)
            .build();
        let client = Client::from_conf(config);
        let batch = next_batch(10, 15, &args(16, None));
        put_batch(&client, "s", batch).await.expect("written");
        let requests = server.await.unwrap();
        assert_eq!(
            requests,
            [vec![10, 11, 12, 13, 14], vec![11, 13, 14], vec![11, 14]]
        );
    }

    #[test]
    fn large_records_keep_a_request_under_five_mib() {
        let batch = next_batch(0, 1000, &args(1000, Some(1_000_000)));
        assert_eq!(batch.len(), 5);
        let batch = next_batch(0, 1000, &args(1000, Some(100_000)));
        assert_eq!(batch.len(), 52);
    }

    #[test]
    fn the_summary_keeps_its_fields_and_order() {
        let summary = |written, first_id, last_id, seconds| {
            serde_json::to_string(&Summary {
                stream: "s",
                written,
                first_id,
                last_id,
                seconds,
            })
            .unwrap()
        };
        assert_eq!(
            summary(10, Some(5), Some(14), 1.235),
            r#"{"stream":"s","written":10,"first_id":5,"last_id":14,"seconds":1.235}"#
        );
        assert_eq!(
            summary(0, None, None, 0.0),
            r#"{"stream":"s","written":0,"first_id":null,"last_id":null,"seconds":0.0}"#
        );
    }
}
