//! What the lease table costs and how fast leases balance, live on the DynamoDB emulator, with
//! every request counted by an SDK interceptor (`cargo bench -p shardwise-bench --bench leases`):
//!
//! 1. four workers start together on a new 200-shard stream: time until each holds its 50, and
//!    every write, by kind, with the conditional writes the table refused;
//! 2. steady state at 1, 3, 4 and 8 balanced workers: requests and read units a minute (Scan read
//!    units from the items' sizes by DynamoDB's rules, consistent reads, 4 KB a unit), and what
//!    that gives at 1,000 shards and 20 workers;
//! 3. a fourth worker joins three balanced ones: time until it holds its 50, and the handoffs.
//!
//! The workers are real consumers (default lease settings: 10 s lease, renewed every 3.3 s,
//! scan interval 2 s) reading an in-memory stream of 200 shards with 20 records each, handled at
//! the start, so every row carries a checkpoint and the windows count the lease protocol alone.
//! Steady-state windows are 150 s: a balanced worker scans every lease duration x workers. Needs the emulators (`envs=$(scripts/emulators start) && eval
//! "$envs"`); skipped without `AWS_ENDPOINT_URL_DYNAMODB`. Under `cargo test` (no `--bench`
//! argument) it runs once at a tiny size (8 shards, short windows), so the bench cannot rot.
//!
//! `SHARDWISE_BENCH_LATENCY_MS=20-50` puts a TCP proxy between the workers and DynamoDB that
//! holds every chunk a worker sends for a random 20 to 50 ms (the latency of a real network and
//! a slower store than moto on loopback); the figures then say what that costs.
//! `RUST_LOG=shardwise=info` prints the library's log to stderr.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_config::BehaviorVersion;
use aws_sdk_dynamodb::config::interceptors::{
    AfterDeserializationInterceptorContextRef, BeforeTransmitInterceptorContextRef,
};
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_smithy_types::config_bag::{Storable, StoreReplace};
use serde_json::Value;
use shardwise::lease::{DynamoDbLeaseStore, LeaseSettings};
use shardwise::testing::MemoryStream;
use shardwise::{Consumer, Delivery, Outcome, Running};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One request as counted: its kind, and what it cost.
#[derive(Debug, Clone, Default)]
struct Tally {
    requests: u64,
    refused: u64,
    /// Read units of consistent reads (Scan, GetItem).
    read_units: u64,
}

#[derive(Debug, Default)]
struct Counter {
    by_kind: Mutex<BTreeMap<&'static str, Tally>>,
    /// Item sizes seen in scans, for the per-row estimate.
    scanned_items: Mutex<(u64, u64)>,
}

impl Counter {
    fn snapshot(&self) -> BTreeMap<&'static str, Tally> {
        self.by_kind.lock().unwrap().clone()
    }

    fn reset(&self) {
        self.by_kind.lock().unwrap().clear();
    }

    fn bytes_per_row(&self) -> f64 {
        let (bytes, items) = *self.scanned_items.lock().unwrap();
        bytes as f64 / items.max(1) as f64
    }
}

/// What a request was, decided from the request before it is sent.
#[derive(Debug, Clone)]
struct Kind(&'static str);

impl Storable for Kind {
    type Storer = StoreReplace<Self>;
}

#[derive(Debug)]
struct Counting(Arc<Counter>);

fn kind_of(target: &str, body: &Value) -> &'static str {
    let op = target.rsplit('.').next().unwrap_or(target);
    let key = body["Key"]["leaseKey"]["S"]
        .as_str()
        .or(body["Item"]["leaseKey"]["S"].as_str())
        .unwrap_or_default();
    let update = body["UpdateExpression"].as_str().unwrap_or_default();
    match op {
        "Scan" => "scan",
        "GetItem" => "get",
        "PutItem" if key.starts_with("~membership#") => "membership",
        "PutItem" => "create",
        "DeleteItem" => "delete",
        "TransactWriteItems" => "transaction",
        "DescribeTable" | "CreateTable" | "DescribeContinuousBackups" | "TagResource" => "table",
        "BatchGetItem" => "roster read",
        "UpdateItem" if key.starts_with("~workers#") && update.contains("#beat = :beat") => "beat",
        "UpdateItem" if key.starts_with("~workers#") => "forget",
        "UpdateItem" if key.starts_with("~membership#") => "membership",
        "UpdateItem" if update == "SET #counter = #counter + :one" => "renew",
        "UpdateItem" if update.contains("SET #wanted = :taker") => "request",
        "UpdateItem" if update.contains("SET #owner = :taker") => "pass",
        "UpdateItem" if update.contains("SET #owner = :owner") => "take",
        "UpdateItem" if update.starts_with("REMOVE #owner") => "release",
        "UpdateItem" => "checkpoint or other update",
        _ => "other",
    }
}

/// An item's size by DynamoDB's rules (attribute names + values; numbers about one byte per two
/// digits + 1; lists and maps 3 bytes + 1 per element).
fn item_size(item: &serde_json::Map<String, Value>) -> u64 {
    item.iter()
        .map(|(name, value)| name.len() as u64 + value_size(value))
        .sum()
}

fn value_size(value: &Value) -> u64 {
    let Some((tag, v)) = value.as_object().and_then(|o| o.iter().next()) else {
        return 0;
    };
    match tag.as_str() {
        "S" | "B" => v.as_str().map_or(0, |s| s.len() as u64),
        "N" => v.as_str().map_or(1, |n| {
            n.trim_start_matches('-').len().div_ceil(2) as u64 + 1
        }),
        "BOOL" | "NULL" => 1,
        "L" => {
            3 + v
                .as_array()
                .map_or(0, |l| l.iter().map(|e| value_size(e) + 1).sum())
        }
        "M" => 3 + v.as_object().map_or(0, |m| item_size(m) + m.len() as u64),
        "SS" => v.as_array().map_or(0, |l| {
            l.iter()
                .map(|e| e.as_str().unwrap_or("").len() as u64)
                .sum()
        }),
        _ => 1,
    }
}

impl Intercept for Counting {
    fn name(&self) -> &'static str {
        "Counting"
    }

    fn read_before_transmit(
        &self,
        context: &BeforeTransmitInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        let request = context.request();
        let target = request.headers().get("x-amz-target").unwrap_or_default();
        let body: Value = request
            .body()
            .bytes()
            .and_then(|b| serde_json::from_slice(b).ok())
            .unwrap_or(Value::Null);
        cfg.interceptor_state()
            .store_put(Kind(kind_of(target, &body)));
        Ok(())
    }

    fn read_after_deserialization(
        &self,
        context: &AfterDeserializationInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        cfg: &mut ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        let kind = cfg.load::<Kind>().map_or("unknown", |k| k.0);
        let response = context.response();
        let bytes = response.body().bytes().unwrap_or_default();
        let refused = !response.status().is_success()
            && std::str::from_utf8(bytes).is_ok_and(|b| {
                b.contains("ConditionalCheckFailed") || b.contains("TransactionCanceled")
            });
        let mut read_units = 0;
        if kind == "scan" || kind == "get" || kind == "roster read" {
            let body: Value = serde_json::from_slice(bytes).unwrap_or(Value::Null);
            let items: Vec<&serde_json::Map<String, Value>> = match kind {
                "scan" => body["Items"]
                    .as_array()
                    .map(|a| a.iter().filter_map(Value::as_object).collect())
                    .unwrap_or_default(),
                "roster read" => body["Responses"]
                    .as_object()
                    .into_iter()
                    .flat_map(|tables| tables.values())
                    .filter_map(Value::as_array)
                    .flatten()
                    .filter_map(Value::as_object)
                    .collect(),
                _ => body["Item"].as_object().into_iter().collect(),
            };
            let sizes: Vec<u64> = items.iter().map(|i| item_size(i)).collect();
            let bytes: u64 = sizes.iter().sum();
            if kind == "scan" {
                // A scan is billed on every item it reads, filtered or not; the filter here drops
                // only the roster and membership items, counted with the rows.
                let scanned = body["ScannedCount"].as_u64().unwrap_or(sizes.len() as u64);
                let per_item = bytes as f64 / sizes.len().max(1) as f64;
                let billed = (per_item * scanned as f64) as u64;
                read_units = billed.div_ceil(4096).max(1);
                let mut seen = self.0.scanned_items.lock().unwrap();
                seen.0 += bytes;
                seen.1 += sizes.len() as u64;
            } else {
                // Each item of a batch is billed on its own, rounded up to 4 KB.
                read_units = sizes
                    .iter()
                    .map(|b| b.div_ceil(4096).max(1))
                    .sum::<u64>()
                    .max(1);
            }
        }
        let mut by_kind = self.0.by_kind.lock().unwrap();
        let tally = by_kind.entry(kind).or_default();
        tally.requests += 1;
        tally.refused += u64::from(refused);
        tally.read_units += read_units;
        Ok(())
    }
}

struct Scale {
    shards: u32,
    window: Duration,
    settings: LeaseSettings,
    /// Wait after balancing before a window, so the scans that follow a change are over.
    settle: Duration,
}

struct Bench {
    sdk: aws_config::SdkConfig,
    counter: Arc<Counter>,
    stream: MemoryStream,
    table: String,
    scale: Scale,
    /// The delaying proxy's endpoint, when there is one.
    through: Option<String>,
}

impl Bench {
    async fn worker(&self, id: &str) -> Running {
        let mut config = aws_sdk_dynamodb::config::Builder::from(&self.sdk)
            .interceptor(Counting(self.counter.clone()));
        if let Some(proxy) = &self.through {
            config = config.endpoint_url(proxy);
        }
        let config = config.build();
        let client = aws_sdk_dynamodb::Client::from_conf(config);
        Consumer::builder(self.stream.name(), "bench-leases", |_d: Delivery| async {
            Outcome::Ack
        })
        .worker_id(id)
        .lease_settings(self.scale.settings.clone())
        .lease_store(Arc::new(DynamoDbLeaseStore::new(client, &self.table)))
        .record_source(Arc::new(self.stream.clone()))
        .shard_lister(Arc::new(self.stream.clone()))
        .build()
        .expect("settings")
        .run()
        .await
        .expect("start")
    }

    /// Waits until every worker holds its share (ceil or floor of shards / workers); the time
    /// since `start`.
    async fn balanced(&self, workers: &[(String, Running)], start: Instant) -> Duration {
        let limit = Duration::from_secs(180);
        let n = self.scale.shards as usize;
        let (low, high) = (n / workers.len(), n.div_ceil(workers.len()));
        loop {
            let held: Vec<usize> = workers.iter().map(|(_, r)| r.shards().len()).collect();
            if held.iter().all(|h| (low..=high).contains(h)) && held.iter().sum::<usize>() == n {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < limit,
                "not balanced within {limit:?}: {held:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Counts a window of steady state; returns requests and read units a minute by kind.
    async fn steady(&self, workers: usize) -> (BTreeMap<&'static str, Tally>, f64) {
        tokio::time::sleep(self.scale.settle).await;
        self.counter.reset();
        tokio::time::sleep(self.scale.window).await;
        let counts = self.counter.snapshot();
        let minutes = self.scale.window.as_secs_f64() / 60.0;
        let per_minute = |v: u64| v as f64 / minutes;
        println!("  steady state, {workers} workers, per minute:");
        for (kind, t) in &counts {
            println!(
                "    {kind:<28} {:>8.1} requests {:>8.1} read units",
                per_minute(t.requests),
                per_minute(t.read_units)
            );
        }
        let reads: u64 = counts.values().map(|t| t.read_units).sum();
        (counts, per_minute(reads))
    }
}

fn print_writes(what: &str, counts: &BTreeMap<&'static str, Tally>) {
    println!("  {what}:");
    for (kind, t) in counts {
        println!(
            "    {kind:<28} {:>6} requests, {:>4} refused",
            t.requests, t.refused
        );
    }
}

async fn shut_down(workers: Vec<(String, Running)>) {
    futures::future::join_all(
        workers
            .into_iter()
            .map(|(_, r)| r.shutdown(Duration::from_secs(10))),
    )
    .await;
}

/// A TCP proxy on loopback in front of `upstream` (`host:port`) that holds each chunk a client
/// sends for a random delay in `delay` before passing it on (answers pass at once). Returns the
/// proxy's endpoint URL.
async fn delaying_proxy(upstream: String, delay: (u64, u64)) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let url = format!("http://{}", listener.local_addr().expect("an address"));
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else {
                return;
            };
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                    return;
                };
                let (mut client_read, mut client_write) = client.into_split();
                let (mut server_read, mut server_write) = server.into_split();
                let to_server = async move {
                    let mut buffer = vec![0u8; 64 * 1024];
                    loop {
                        let n = match client_read.read(&mut buffer).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        let ms = rand::random_range(delay.0..=delay.1);
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        if server_write.write_all(&buffer[..n]).await.is_err() {
                            return;
                        }
                    }
                };
                let to_client = tokio::io::copy(&mut server_read, &mut client_write);
                let _ = tokio::join!(to_server, to_client);
            });
        }
    });
    url
}

#[tokio::main]
async fn main() {
    shardwise_bench::log_from_env();
    let measuring = std::env::args().any(|a| a == "--bench");
    if std::env::var_os("AWS_ENDPOINT_URL_DYNAMODB").is_none() {
        println!("leases: skipped (no AWS_ENDPOINT_URL_DYNAMODB; start the emulators first)");
        return;
    }
    let scale = if measuring {
        Scale {
            shards: 200,
            window: Duration::from_secs(150),
            settings: LeaseSettings::default(),
            settle: Duration::from_secs(15),
        }
    } else {
        Scale {
            shards: 8,
            window: Duration::from_secs(2),
            settings: LeaseSettings::default()
                .lease_duration(Duration::from_secs(2))
                .scan_interval(Duration::from_millis(200)),
            settle: Duration::from_secs(2),
        }
    };
    let sdk = aws_config::defaults(BehaviorVersion::latest()).load().await;
    let mut through = None;
    if let Ok(range) = std::env::var("SHARDWISE_BENCH_LATENCY_MS") {
        let (low, high) = range
            .split_once('-')
            .map_or((range.as_str(), range.as_str()), |(l, h)| (l, h));
        let delay = (
            low.trim()
                .parse()
                .expect("SHARDWISE_BENCH_LATENCY_MS: LOW-HIGH in ms"),
            high.trim()
                .parse()
                .expect("SHARDWISE_BENCH_LATENCY_MS: LOW-HIGH in ms"),
        );
        let endpoint = std::env::var("AWS_ENDPOINT_URL_DYNAMODB").unwrap_or_default();
        let upstream = endpoint.trim_start_matches("http://").trim_end_matches('/');
        let proxy = delaying_proxy(upstream.to_string(), delay).await;
        println!(
            "leases: every chunk a worker sends to DynamoDB held {}-{} ms by a proxy ({proxy} -> {endpoint})",
            delay.0, delay.1
        );
        through = Some(proxy);
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let stream = MemoryStream::new("bench-leases", scale.shards);
    // Records on every shard, so every row carries a checkpoint (and its size) as in production.
    for key in 0..scale.shards * 20 {
        stream.put(&format!("key-{key}"), key.to_string());
    }
    let bench = Bench {
        sdk,
        counter: Arc::default(),
        stream,
        table: format!("bench-leases-{nanos}"),
        scale,
        through,
    };
    let shards = bench.scale.shards;
    println!(
        "leases: {shards} shards, lease duration {:?}, scan interval {:?} (DynamoDB on {})",
        bench.scale.settings.lease_duration,
        bench.scale.settings.scan_interval,
        std::env::var("AWS_ENDPOINT_URL_DYNAMODB").unwrap_or_default()
    );

    // 1. Four workers start together on a new table.
    let names = ["w1", "w2", "w3", "w4"];
    let started = Instant::now();
    let runs = futures::future::join_all(names.iter().map(|n| bench.worker(n))).await;
    let mut workers: Vec<(String, Running)> =
        names.iter().map(|n| n.to_string()).zip(runs).collect();
    let took = bench.balanced(&workers, started).await;
    let counts = bench.counter.snapshot();
    println!(
        "1. four workers started together: balanced {:.1} s after the start",
        took.as_secs_f64()
    );
    print_writes("requests until balanced", &counts);
    let refused: u64 = counts.values().map(|t| t.refused).sum();
    println!("  conditional writes refused: {refused}");

    // 2. Steady state at 4, then 3 workers (one leaves gracefully), then 8.
    let (_, reads4) = bench.steady(4).await;
    let (_, leaving) = workers.pop().expect("four");
    leaving.shutdown(Duration::from_secs(10)).await;
    let took = bench.balanced(&workers, Instant::now()).await;
    println!(
        "  a worker left (graceful shutdown): the other three balanced {:.1} s after it stopped",
        took.as_secs_f64()
    );
    let (_, reads3) = bench.steady(3).await;

    // 3. A fourth worker joins three balanced ones.
    bench.counter.reset();
    let joined = Instant::now();
    workers.push(("w4".into(), bench.worker("w4").await));
    let took = bench.balanced(&workers, joined).await;
    println!(
        "3. a fourth worker joined three balanced ones: it held its share {:.1} s after its start",
        took.as_secs_f64()
    );
    print_writes("requests until balanced", &bench.counter.snapshot());

    for n in ["w5", "w6", "w7", "w8"] {
        workers.push((n.into(), bench.worker(n).await));
    }
    bench.balanced(&workers, Instant::now()).await;
    let (counts8, reads8) = bench.steady(8).await;

    // And down to one worker: the other seven leave gracefully.
    while workers.len() > 1 {
        let (_, leaving) = workers.pop().expect("more than one");
        leaving.shutdown(Duration::from_secs(10)).await;
    }
    bench.balanced(&workers, Instant::now()).await;
    let (_, reads1) = bench.steady(1).await;

    let per_row = bench.counter.bytes_per_row();
    let scans_per_minute = counts8.get("scan").map_or(0, |t| t.requests) as f64
        / (bench.scale.window.as_secs_f64() / 60.0);
    // At 1,000 shards and 20 workers: the table is scanned as often in all (about once per lease
    // duration), each scan reading 1,000 rows of this size; renewals are 18 a minute a lease.
    let lease = bench.scale.settings.lease_duration.as_secs_f64();
    let scans_at_scale = 60.0 / lease;
    let units_per_scan = (1000.0 * per_row / 4096.0).ceil();
    let before = 20.0 * (60.0 / bench.scale.settings.scan_interval.as_secs_f64()) * units_per_scan;
    println!(
        "2. read units a minute at steady state: {reads1:.0} (1 worker), {reads3:.0} (3), {reads4:.0} (4), {reads8:.0} (8); {scans_per_minute:.1} scans a minute with 8"
    );
    println!(
        "   estimate at 1,000 shards and 20 workers: {:.0} read units a minute ({scans_at_scale:.0} scans x {units_per_scan:.0} units; {per_row:.0} bytes a row), against {before:.0} when every worker scanned every scan interval",
        scans_at_scale * units_per_scan
    );
    shut_down(workers).await;
    let client = aws_sdk_dynamodb::Client::new(&bench.sdk);
    let _ = client.delete_table().table_name(&bench.table).send().await;
}
