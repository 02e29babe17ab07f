//! End-to-end figures for the consumer, printed as a table (`cargo bench -p shardwise-bench --bench consumer`):
//!
//! 1. in-process pipeline throughput with a no-op handler (memory stream and lease store);
//! 2. a 2 ms handler on one shard with 1, 4 and 8 lanes (per-key order, 64 keys);
//! 3. live: the consumer against a raw GetRecords loop on the same emulator, same stream, same run;
//! 4. live: time from `shardwise consume` process start to its first record;
//! 5. receipts: records/s settled with transactional effects (a counter per record, committed with
//!    its receipt) against plain acks, in process (memory ledger) and live (DynamoDB ledger);
//! 6. paged: events/s read from the scripted event API over HTTP (4 partitions, pages of 200): a raw
//!    page loop (fetch, follow the token, nothing else) against the consumer (lanes, tracker, page
//!    barrier, progress writes to the memory lease store), same server, same run, in 5 alternating
//!    rounds (median);
//! 7. start: from start to the first record of a one-shard stream, a raw GetRecords loop against
//!    a consumer (a new application, and the same one started again), alternating rounds;
//! 8. fanout: enhanced fan-out against polling in one run: put-to-handler delay at 200 records/s
//!    over 4 shards (p50, p99), in memory with a push every 20 ms for 30 s, and on kinesis-mock
//!    for 60 s; and records/s reading a full stream, in memory (200,000 records, the push as
//!    prompt as the reader) and on kinesis-mock.
//!
//! Parts 3 to 5, 7 and 8 need the emulators (`envs=$(scripts/emulators start) && eval "$envs"`) and are
//! skipped without `AWS_ENDPOINT_URL_KINESIS`. Name parts to run only those:
//! `cargo bench -p shardwise-bench --bench consumer -- paged` (pipeline, lanes, receipts, paged, live, start, fanout). Under `cargo test` (no `--bench` argument) every
//! part runs once at a tiny size, so the bench cannot rot. `RUST_LOG=shardwise=debug` prints the
//! library's log to stderr. `--features mimalloc` runs everything on mimalloc instead of the
//! system's allocator.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use aws_config::BehaviorVersion;
use aws_sdk_kinesis::primitives::Blob;
use aws_sdk_kinesis::types::{PutRecordsRequestEntry, ShardIteratorType, StreamStatus};
use shardwise::consumer::Settled;
use shardwise::lease::{LeaseSettings, MemoryLeaseStore};
use shardwise::paged::PagedSource;
use shardwise::receipts::{DynamoDbReceipts, Effect, MemoryReceipts, ReceiptStore, key};
use shardwise::testing::{EventApi, HttpEvents, MemoryStream};
use shardwise::{Consumer, ConsumerBuilder, Delivery, Outcome};

struct Scale {
    pipeline_records: u64,
    lane_records: u64,
    live_records: u64,
    receipt_records: u64,
    live_receipt_records: u64,
    paged_events: u64,
    paged_rounds: u32,
    start_rounds: u32,
}

/// CPU time this process has used (user and system), from /proc: the ticks are 10 ms.
/// With `--features mimalloc`, every part runs on mimalloc instead of the system's allocator.
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The allocator this run uses, for the printed figures.
const ALLOCATOR_NAME: &str = if cfg!(feature = "mimalloc") {
    "mimalloc"
} else {
    "the system allocator"
};

fn cpu_used() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command (which may hold spaces): state is the 3rd field, utime the 14th.
    let rest = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<u64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|f| f.parse().ok())
        .collect();
    Duration::from_millis(fields.iter().sum::<u64>() * 10)
}

fn lease() -> LeaseSettings {
    LeaseSettings::default()
        .lease_duration(Duration::from_secs(3))
        .scan_interval(Duration::from_millis(100))
}

/// Runs a consumer over `stream` until `count` records are handled; returns the seconds from the
/// first delivery to the last.
async fn consume_memory(stream: &MemoryStream, count: u64, lanes: usize, delay: Duration) -> f64 {
    let handled = Arc::new(AtomicU64::new(0));
    let first: Arc<std::sync::OnceLock<Instant>> = Arc::default();
    let (h, f) = (handled.clone(), first.clone());
    let running = Consumer::builder(stream.name(), "bench-app", move |_d: Delivery| {
        let (h, f) = (h.clone(), f.clone());
        async move {
            f.get_or_init(Instant::now);
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            h.fetch_add(1, Ordering::Relaxed);
            Outcome::Ack
        }
    })
    .worker_id("bench")
    .lanes(lanes)
    .poll_interval(Duration::from_millis(200))
    .lease_settings(lease())
    .in_memory(stream, &MemoryLeaseStore::new())
    .build()
    .expect("settings")
    .run()
    .await
    .expect("start");
    while handled.load(Ordering::Relaxed) < count {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let secs = first.get().expect("a delivery").elapsed().as_secs_f64();
    running.shutdown(Duration::from_secs(5)).await;
    secs
}

async fn pipeline(scale: &Scale) {
    let n = scale.pipeline_records;
    let stream = MemoryStream::new("pipeline", 4);
    for i in 0..n {
        stream.put(&format!("key-{}", i % 256), format!("{{\"id\":{i}}}"));
    }
    let secs = consume_memory(&stream, n, 4, Duration::ZERO).await;
    println!(
        "pipeline, no-op handler, 4 shards x 4 lanes, {n} records: {:.0} records/s",
        n as f64 / secs
    );
}

async fn lanes(scale: &Scale) {
    let n = scale.lane_records;
    let mut rates = Vec::new();
    for lanes in [1usize, 4, 8] {
        let stream = MemoryStream::new("lanes", 1);
        for i in 0..n {
            stream.put(&format!("key-{}", i % 64), format!("{{\"id\":{i}}}"));
        }
        let secs = consume_memory(&stream, n, lanes, Duration::from_millis(2)).await;
        let rate = n as f64 / secs;
        rates.push(rate);
        println!("2 ms handler, 1 shard, {lanes} lanes, {n} records: {rate:.0} records/s");
    }
    println!("  8 lanes / 1 lane = {:.2}x", rates[2] / rates[0]);
}

/// The handler of the receipts figures: with `counts`, one effect per record (add 1 to the
/// record's counter, committed with its receipt); without, an ack.
fn count_or_ack(counts: Option<&'static str>) -> impl Fn(Delivery) -> std::future::Ready<Outcome> {
    move |d: Delivery| {
        std::future::ready(match counts {
            Some(table) => {
                let id = String::from_utf8_lossy(d.payload()).into_owned();
                Outcome::Apply(Effect::update(table, key("id", id)).add("count", 1).into())
            }
            None => Outcome::Ack,
        })
    }
}

/// Runs `builder` until `count` deliveries settled; returns records/s from `run()` to the last.
async fn settled_rate<H: shardwise::Handler>(builder: ConsumerBuilder<H>, count: u64) -> f64 {
    let settled = Arc::new(AtomicU64::new(0));
    let s = settled.clone();
    let started = Instant::now();
    let running = builder
        .delivery_hooks(move |_: &Delivery, _: &Settled| {
            s.fetch_add(1, Ordering::Relaxed);
        })
        .build()
        .expect("settings")
        .run()
        .await
        .expect("start");
    while settled.load(Ordering::Relaxed) < count {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let secs = started.elapsed().as_secs_f64();
    running.shutdown(Duration::from_secs(5)).await;
    count as f64 / secs
}

/// In process: effects with the memory ledger against acks, 4 shards x 4 lanes.
async fn receipts_memory(scale: &Scale) {
    let n = scale.receipt_records;
    let mut rates = Vec::new();
    for counts in [None, Some("counts")] {
        let stream = MemoryStream::new("receipts", 4);
        for i in 0..n {
            stream.put(&format!("key-{}", i % 256), format!("{i}"));
        }
        let ledger: Arc<dyn ReceiptStore> =
            Arc::new(MemoryReceipts::new().table("counts", &["id"]));
        let builder = Consumer::builder(stream.name(), "bench-app", count_or_ack(counts))
            .worker_id("bench")
            .lanes(4)
            .poll_interval(Duration::from_millis(200))
            .lease_settings(lease())
            .in_memory(&stream, &MemoryLeaseStore::new())
            .receipts(ledger);
        rates.push(settled_rate(builder, n).await);
    }
    println!(
        "receipts in process (memory ledger), {n} records over 4 shards x 4 lanes: acks {:.0} records/s, effects {:.0} records/s ({:.0}% of acks)",
        rates[0],
        rates[1],
        100.0 * rates[1] / rates[0]
    );
}

/// Creates a stream of `shards` shards holding records `0..n` over 256 keys, the payload of id `i`
/// being `payload(i)`.
async fn filled_stream(
    kinesis: &aws_sdk_kinesis::Client,
    name: &str,
    shards: i32,
    n: u64,
    payload: fn(u64) -> String,
) {
    kinesis
        .create_stream()
        .stream_name(name)
        .shard_count(shards)
        .send()
        .await
        .expect("create");
    loop {
        let s = kinesis
            .describe_stream_summary()
            .stream_name(name)
            .send()
            .await
            .expect("describe");
        if s.stream_description_summary()
            .is_some_and(|d| *d.stream_status() == StreamStatus::Active)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ids: Vec<u64> = (0..n).collect();
    for chunk in ids.chunks(500) {
        let entries = chunk
            .iter()
            .map(|i| {
                PutRecordsRequestEntry::builder()
                    .partition_key(format!("key-{}", i % 256))
                    .data(Blob::new(payload(*i)))
                    .build()
                    .unwrap()
            })
            .collect::<Vec<_>>();
        kinesis
            .put_records()
            .stream_name(name)
            .set_records(Some(entries))
            .send()
            .await
            .expect("put");
    }
}

/// Live: effects with the DynamoDB ledger against acks on the same stream (fresh applications).
async fn receipts_live(scale: &Scale, config: &aws_config::SdkConfig) {
    let n = scale.live_receipt_records;
    let kinesis = aws_sdk_kinesis::Client::new(config);
    let dynamodb = shardwise::aws_sdk_dynamodb::Client::new(config);
    let tag = format!(
        "{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos()
    );
    let stream = format!("bench-receipts-{tag}");
    filled_stream(&kinesis, &stream, 4, n, |i| i.to_string()).await;
    let counts: &'static str = Box::leak(format!("bench-counts-{tag}").into_boxed_str());
    let ledger_table = format!("bench-receipts-{tag}");
    let mut rates = Vec::new();
    for (i, effects) in [None, Some(counts)].into_iter().enumerate() {
        let ledger = DynamoDbReceipts::new(dynamodb.clone(), &ledger_table, "bench");
        ledger.prepare().await.expect("the ledger");
        ledger
            .ensure_effect_table(counts, "id")
            .await
            .expect("the counts table");
        let builder = Consumer::builder(
            stream.clone(),
            format!("bench-app-{i}-{tag}"),
            count_or_ack(effects),
        )
        .worker_id("bench")
        .lanes(4)
        .lease_settings(lease())
        .aws_config(config.clone())
        .receipts(Arc::new(ledger));
        rates.push(settled_rate(builder, n).await);
    }
    println!(
        "receipts live (DynamoDB ledger on moto), {n} records over 4 shards x 4 lanes: acks {:.0} records/s, effects {:.0} records/s ({:.0}% of acks)",
        rates[0],
        rates[1],
        100.0 * rates[1] / rates[0]
    );
    let _ = kinesis.delete_stream().stream_name(&stream).send().await;
    for table in [ledger_table.as_str(), counts] {
        let _ = dynamodb.delete_table().table_name(table).send().await;
    }
    for i in 0..2 {
        let _ = dynamodb
            .delete_table()
            .table_name(format!("bench-app-{i}-{tag}"))
            .send()
            .await;
    }
}

/// A shard iterator at the trim horizon of `shard`: where each raw loop starts.
async fn trim_horizon(kinesis: &aws_sdk_kinesis::Client, stream: &str, shard: &str) -> String {
    kinesis
        .get_shard_iterator()
        .stream_name(stream)
        .shard_id(shard)
        .shard_iterator_type(ShardIteratorType::TrimHorizon)
        .send()
        .await
        .expect("GetShardIterator")
        .shard_iterator
        .expect("an iterator")
}

async fn live(scale: &Scale) {
    if std::env::var("AWS_ENDPOINT_URL_KINESIS").is_err() {
        println!(
            "live parts skipped: AWS_ENDPOINT_URL_KINESIS is not set (start scripts/emulators)"
        );
        return;
    }
    let config = aws_config::defaults(BehaviorVersion::latest()).load().await;
    let kinesis = aws_sdk_kinesis::Client::new(&config);
    let tag = std::process::id();
    let stream = format!("bench-{tag}-{}", Instant::now().elapsed().as_nanos());
    let shards = 4;
    let n = scale.live_records;
    filled_stream(&kinesis, &stream, shards, n, |i| format!("{{\"id\":{i}}}")).await;

    // Raw loop: one task per shard, GetRecords (10,000) until caught up, no processing.
    let shard_ids: Vec<String> = kinesis
        .list_shards()
        .stream_name(&stream)
        .send()
        .await
        .expect("list")
        .shards()
        .iter()
        .map(|s| s.shard_id().to_string())
        .collect();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for shard in shard_ids {
        let (k, s) = (kinesis.clone(), stream.clone());
        tasks.push(tokio::spawn(async move {
            let mut it = trim_horizon(&k, &s, &shard).await;
            let mut got = 0u64;
            loop {
                let page = k
                    .get_records()
                    .shard_iterator(&it)
                    .limit(10_000)
                    .send()
                    .await
                    .unwrap();
                got += page.records().len() as u64;
                if page.records().is_empty() && page.millis_behind_latest() == Some(0) {
                    return got;
                }
                it = page.next_shard_iterator.unwrap();
            }
        }));
    }
    let mut raw_total = 0;
    for t in tasks {
        raw_total += t.await.unwrap();
    }
    let raw_secs = start.elapsed().as_secs_f64();
    assert_eq!(raw_total, n);

    // The consumer, same stream, a fresh application: from run() to the last record.
    let handled = Arc::new(AtomicU64::new(0));
    let h = handled.clone();
    let app = format!("bench-app-{tag}-{}", Instant::now().elapsed().as_nanos());
    let started = Instant::now();
    let running = Consumer::builder(stream.clone(), app, move |_d: Delivery| {
        h.fetch_add(1, Ordering::Relaxed);
        std::future::ready(Outcome::Ack)
    })
    .worker_id("bench")
    .lanes(4)
    .lease_settings(lease())
    .aws_config(config.clone())
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    while handled.load(Ordering::Relaxed) < n {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let consumer_secs = started.elapsed().as_secs_f64();
    running.shutdown(Duration::from_secs(5)).await;
    println!(
        "live, {n} records over {shards} shards: raw GetRecords loop {:.0} records/s ({raw_secs:.2} s), consumer {:.0} records/s ({consumer_secs:.2} s, lease start included) = {:.0}% of raw",
        n as f64 / raw_secs,
        n as f64 / consumer_secs,
        100.0 * raw_secs / consumer_secs
    );

    // Process start to first record.
    let bin = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/shardwise");
    let bin = if bin.exists() {
        bin
    } else {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/shardwise")
    };
    if bin.exists() {
        let t0 = Instant::now();
        let mut child = Command::new(&bin)
            .args([
                "consume",
                "--stream",
                &stream,
                "--app",
                &format!("bench-first-{tag}"),
                "--worker-id",
                "first",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn shardwise");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let first = t0.elapsed();
        let _ = child.kill();
        let _ = child.wait();
        println!(
            "process start to first record ({}): {:.0} ms",
            bin.display(),
            first.as_secs_f64() * 1000.0
        );
    } else {
        println!("process start to first record skipped: build the shardwise binary first");
    }
    let _ = kinesis.delete_stream().stream_name(&stream).send().await;
    receipts_live(scale, &config).await;
}

/// Live: from start to the first record of a one-shard stream that holds records, with default
/// settings, in `rounds` alternating rounds, each with new clients: a raw loop (ListShards,
/// GetShardIterator at TRIM_HORIZON, GetRecords) against a consumer of a fresh application (its
/// lease table created, the roster, the shard sync, the take), and the same application started
/// again after a graceful stop (the table, row and checkpoint there: a restart or a deploy).
/// Prints each round and the medians.
async fn start(rounds: u32) {
    if std::env::var("AWS_ENDPOINT_URL_KINESIS").is_err() {
        println!("start skipped: AWS_ENDPOINT_URL_KINESIS is not set (start scripts/emulators)");
        return;
    }
    let config = aws_config::defaults(BehaviorVersion::latest()).load().await;
    let kinesis = aws_sdk_kinesis::Client::new(&config);
    let dynamodb = shardwise::aws_sdk_dynamodb::Client::new(&config);
    let tag = format!(
        "{}-{}",
        std::process::id(),
        Instant::now().elapsed().as_nanos()
    );
    let stream = format!("bench-start-{tag}");
    filled_stream(&kinesis, &stream, 1, 100, |i| format!("{{\"id\":{i}}}")).await;
    let (mut raws, mut fresh, mut again, mut named) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 1..=rounds {
        let t0 = Instant::now();
        let k = aws_sdk_kinesis::Client::new(&config);
        let shard = k
            .list_shards()
            .stream_name(&stream)
            .send()
            .await
            .expect("list")
            .shards()[0]
            .shard_id()
            .to_string();
        let mut it = trim_horizon(&k, &stream, &shard).await;
        loop {
            let page = k
                .get_records()
                .shard_iterator(&it)
                .send()
                .await
                .expect("records");
            if !page.records().is_empty() {
                break;
            }
            it = page.next_shard_iterator.expect("an open shard");
        }
        let raw = t0.elapsed();
        let app = format!("bench-start-{tag}-{round}");
        let first = first_record(&stream, &app, &config, None).await;
        // The first run may have handled and checkpointed every record: new ones for the next.
        put_one(&kinesis, &stream, round).await;
        let restart = first_record(&stream, &app, &config, None).await;
        // A worker id set by the operator (a pod's name), stopped gracefully and started again
        // under it: the stop removed its roster entry, so the new process takes at once (after
        // a kill -9 the entry still holds the dead process's beat, and the new one beats once
        // more, a beat interval later, before it takes: see `LeaseManager::start`).
        let mut by_name = Duration::ZERO;
        for _ in 0..2 {
            put_one(&kinesis, &stream, round).await;
            by_name = first_record(&stream, &app, &config, Some("bench-named")).await;
        }
        println!(
            "start round {round}: raw loop {:.0} ms, consumer of a new application {:.0} ms (+{:.0}), started again {:.0} ms (+{:.0}), started again under the same worker id {:.0} ms",
            ms(raw),
            ms(first),
            ms(first) - ms(raw),
            ms(restart),
            ms(restart) - ms(raw),
            ms(by_name)
        );
        raws.push(ms(raw));
        fresh.push(ms(first));
        again.push(ms(restart));
        named.push(ms(by_name));
        let _ = dynamodb.delete_table().table_name(&app).send().await;
    }
    let (raw, fresh, again, named) = (median(raws), median(fresh), median(again), median(named));
    println!(
        "start to first record, one shard, default settings, {rounds} rounds (medians): raw loop {raw:.0} ms, consumer of a new application {fresh:.0} ms (+{:.0} ms), the same application started again {again:.0} ms (+{:.0} ms), started again under the worker id it ran under {named:.0} ms",
        fresh - raw,
        again - raw
    );
    let _ = kinesis.delete_stream().stream_name(&stream).send().await;
}

/// Puts one record, so that a consumer started again has one after its checkpoint.
async fn put_one(kinesis: &aws_sdk_kinesis::Client, stream: &str, round: u32) {
    kinesis
        .put_record()
        .stream_name(stream)
        .partition_key("again")
        .data(Blob::new(format!("{{\"again\":{round}}}")))
        .send()
        .await
        .expect("put");
}

/// The middle of `v` (the upper one of an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// From `build()` to the first record handled by a consumer of `app` with default settings (and
/// the default worker id unless `worker` names one); stops it gracefully.
async fn first_record(
    stream: &str,
    app: &str,
    config: &aws_config::SdkConfig,
    worker: Option<&str>,
) -> Duration {
    let first = Arc::new(tokio::sync::Notify::new());
    let f = first.clone();
    let t0 = Instant::now();
    let mut builder =
        Consumer::builder(stream.to_string(), app.to_string(), move |_d: Delivery| {
            f.notify_one();
            std::future::ready(Outcome::Ack)
        })
        .aws_config(config.clone());
    if let Some(worker) = worker {
        builder = builder.worker_id(worker);
    }
    let running = builder
        .build()
        .expect("settings")
        .run()
        .await
        .expect("start");
    first.notified().await;
    let took = t0.elapsed();
    running.shutdown(Duration::from_secs(5)).await;
    took
}

/// The scripted event API over HTTP: a raw page loop against the consumer, same server, in
/// `rounds` alternating rounds (this machine's speed wanders by a third from minute to minute: each
/// round's pair ran back to back). Prints each round and the medians.
async fn paged(scale: &Scale) {
    const PARTITIONS: [&str; 4] = ["p0", "p1", "p2", "p3"];
    let n = scale.paged_events;
    let api = EventApi::new("bench-events").page_size(200);
    for i in 0..n {
        api.push(PARTITIONS[(i % 4) as usize], format!("{{\"id\":{i}}}"));
    }
    let server = api
        .serve("127.0.0.1:0".parse().unwrap())
        .await
        .expect("an HTTP port");
    let source = HttpEvents::new("bench-events", server.url());
    let mut ratios = Vec::new();
    let mut cpus = Vec::new();
    for round in 1..=scale.paged_rounds {
        let (raw, raw_cpu) = paged_raw(&source, &PARTITIONS, n).await;
        let (consumer, with_start, consumer_cpu) = paged_consumer(&source, n).await;
        println!(
            "paged round {round}: raw page loop {raw:.0} events/s, consumer {consumer:.0} events/s from its first delivery ({:.0}% of raw), {with_start:.0} events/s with its start; CPU per event (server included): raw {raw_cpu:.0} ns, consumer {consumer_cpu:.0} ns",
            100.0 * consumer / raw
        );
        ratios.push(consumer / raw);
        cpus.push((raw_cpu, consumer_cpu));
    }
    println!(
        "paged, scripted event API over HTTP, {n} events over 4 partitions, pages of 200, {ALLOCATOR_NAME}, {} rounds: consumer at {:.0}% of the raw page loop (median; rounds {}); CPU per event (server included), medians: raw {:.0} ns, consumer {:.0} ns",
        ratios.len(),
        100.0 * median(ratios.clone()),
        ratios
            .iter()
            .map(|r| format!("{:.0}%", 100.0 * r))
            .collect::<Vec<_>>()
            .join(", "),
        median(cpus.iter().map(|c| c.0).collect()),
        median(cpus.iter().map(|c| c.1).collect()),
    );
}

/// The raw loop: each partition read to its end, one page after another, concurrently. Events/s
/// and CPU ns per event.
async fn paged_raw(source: &HttpEvents, partitions: &[&str], n: u64) -> (f64, f64) {
    let started = Instant::now();
    let cpu = cpu_used();
    let read: u64 = futures::future::join_all(partitions.iter().map(|partition| {
        let source = source.clone();
        async move {
            let (mut cursor, mut events) = (None, 0u64);
            loop {
                let page = source
                    .fetch(partition, cursor.as_ref())
                    .await
                    .expect("a page");
                events += page.events.len() as u64;
                if page.events.is_empty() {
                    return events;
                }
                cursor = page.next;
            }
        }
    }))
    .await
    .into_iter()
    .sum();
    assert_eq!(read, n);
    let raw = n as f64 / started.elapsed().as_secs_f64();
    (raw, (cpu_used() - cpu).as_secs_f64() * 1e9 / n as f64)
}

/// The consumer on a fresh lease store (so from the first event), timed from its first delivery
/// (the raw loop has no lease to take) to its last settlement, and from `run()`. Events/s both
/// ways and CPU ns per event.
async fn paged_consumer(source: &HttpEvents, n: u64) -> (f64, f64, f64) {
    let first: Arc<std::sync::OnceLock<Instant>> = Arc::default();
    let settled = Arc::new(AtomicU64::new(0));
    let (f, done) = (first.clone(), settled.clone());
    let started = Instant::now();
    let cpu = cpu_used();
    let running = Consumer::paged(
        Arc::new(source.clone()),
        "bench-app",
        move |_d: Delivery| {
            f.get_or_init(Instant::now);
            std::future::ready(Outcome::Ack)
        },
    )
    .worker_id("bench")
    .lanes(4)
    .poll_interval(Duration::from_millis(200))
    .lease_settings(lease())
    .lease_store(Arc::new(MemoryLeaseStore::new()))
    .delivery_hooks(move |_: &Delivery, _: &Settled| {
        done.fetch_add(1, Ordering::Relaxed);
    })
    .build()
    .expect("settings")
    .run()
    .await
    .expect("start");
    while settled.load(Ordering::Relaxed) < n {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let with_start = n as f64 / started.elapsed().as_secs_f64();
    let from_first = n as f64 / first.get().expect("a delivery").elapsed().as_secs_f64();
    let consumer_cpu = (cpu_used() - cpu).as_secs_f64() * 1e9 / n as f64;
    running.shutdown(Duration::from_secs(5)).await;
    (from_first, with_start, consumer_cpu)
}

/// Milliseconds since the epoch on this host.
fn now_ms() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
        * 1000.0
}

/// The `q` quantile of `v` (sorted here).
fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// A handler that counts records and, for payloads `sent=<ms>`, records put-to-handler delays.
fn timed(
    delays: Arc<std::sync::Mutex<Vec<f64>>>,
    handled: Arc<AtomicU64>,
) -> impl Fn(Delivery) -> std::future::Ready<Outcome> + Send + Sync + 'static {
    move |d: Delivery| {
        if let Some(sent) = std::str::from_utf8(d.payload())
            .ok()
            .and_then(|p| p.strip_prefix("sent="))
            .and_then(|t| t.parse::<f64>().ok())
        {
            delays.lock().unwrap().push(now_ms() - sent);
        }
        handled.fetch_add(1, Ordering::Relaxed);
        std::future::ready(Outcome::Ack)
    }
}

/// A consumer of `stream` for a fresh application, polling or with enhanced fan-out, with a
/// [`timed`] handler.
async fn timed_consumer(
    config: &aws_config::SdkConfig,
    stream: &str,
    fan_out: bool,
    delays: Arc<std::sync::Mutex<Vec<f64>>>,
    handled: Arc<AtomicU64>,
) -> shardwise::Running {
    let app = format!(
        "bench-{}-{}-{}",
        if fan_out { "efo" } else { "poll" },
        std::process::id(),
        Instant::now().elapsed().as_nanos()
    );
    let mut builder = Consumer::builder(stream.to_string(), app, timed(delays, handled))
        .worker_id("bench")
        .lanes(4)
        .aws_config(config.clone());
    if fan_out {
        builder = builder.enhanced_fan_out(shardwise::shard::fanout::FanOut::new());
    }
    builder.build().unwrap().run().await.unwrap()
}

/// Live: enhanced fan-out against polling (default poll interval, 1 s) in one run on the
/// emulator. Latency: a producer puts `rate` records a second over 4 shards for `seconds`, while
/// a polling consumer and a fan-out consumer (each its own application) read the same stream;
/// each record's delay from put to handler, p50 and p99. Throughput: a stream of `full` records
/// over 4 shards read from the start by each, one after the other.
async fn fanout(seconds: u64, rate: u64, full: u64) {
    if std::env::var("AWS_ENDPOINT_URL_KINESIS").is_err() {
        println!("fanout skipped: AWS_ENDPOINT_URL_KINESIS is not set (start scripts/emulators)");
        return;
    }
    let config = aws_config::defaults(BehaviorVersion::latest()).load().await;
    let kinesis = aws_sdk_kinesis::Client::new(&config);
    let tag = std::process::id();
    let stream = format!("bench-efo-{tag}-{}", Instant::now().elapsed().as_nanos());
    filled_stream(&kinesis, &stream, 4, 0, |_| String::new()).await;

    let (poll_delays, efo_delays) = (Arc::default(), Arc::default());
    let (poll_n, efo_n) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let polling = timed_consumer(
        &config,
        &stream,
        false,
        Arc::clone(&poll_delays),
        poll_n.clone(),
    )
    .await;
    let pushed = timed_consumer(
        &config,
        &stream,
        true,
        Arc::clone(&efo_delays),
        efo_n.clone(),
    )
    .await;
    while polling.shards().len() < 4 || pushed.shards().len() < 4 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Both read every shard: give the subscriptions and first polls a moment.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let per_tick = (rate / 10).max(1);
    let mut sent = 0u64;
    let began = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    while began.elapsed() < Duration::from_secs(seconds) {
        tick.tick().await;
        let entries = (0..per_tick)
            .map(|i| {
                PutRecordsRequestEntry::builder()
                    .partition_key(format!("key-{}", (sent + i) % 64))
                    .data(Blob::new(format!("sent={:.3}", now_ms())))
                    .build()
                    .unwrap()
            })
            .collect::<Vec<_>>();
        kinesis
            .put_records()
            .stream_name(&stream)
            .set_records(Some(entries))
            .send()
            .await
            .expect("put");
        sent += per_tick;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while (poll_n.load(Ordering::Relaxed) < sent || efo_n.load(Ordering::Relaxed) < sent)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    polling.shutdown(Duration::from_secs(5)).await;
    pushed.shutdown(Duration::from_secs(5)).await;
    let mut poll: Vec<f64> = poll_delays.lock().unwrap().clone();
    let mut efo: Vec<f64> = efo_delays.lock().unwrap().clone();
    println!(
        "fan-out vs polling, {sent} records put at {rate}/s over 4 shards for {seconds} s, put to handler: polling (poll interval 1 s) p50 {:.0} ms p99 {:.0} ms ({} records); fan-out p50 {:.0} ms p99 {:.0} ms ({} records)",
        quantile(&mut poll, 0.5),
        quantile(&mut poll, 0.99),
        poll.len(),
        quantile(&mut efo, 0.5),
        quantile(&mut efo, 0.99),
        efo.len()
    );
    let _ = kinesis.delete_stream().stream_name(&stream).send().await;

    let stream = format!(
        "bench-efo-full-{tag}-{}",
        Instant::now().elapsed().as_nanos()
    );
    filled_stream(&kinesis, &stream, 4, full, |i| format!("{{\"id\":{i}}}")).await;
    let mut rates = Vec::new();
    for fan_out in [false, true] {
        let handled = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let running =
            timed_consumer(&config, &stream, fan_out, Arc::default(), handled.clone()).await;
        while handled.load(Ordering::Relaxed) == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let first = started.elapsed().as_secs_f64();
        while handled.load(Ordering::Relaxed) < full {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let secs = started.elapsed().as_secs_f64();
        running.shutdown(Duration::from_secs(5)).await;
        rates.push((full as f64 / (secs - first), secs - first, first));
    }
    println!(
        "fan-out vs polling, a full stream of {full} records over 4 shards read from the start: polling {:.0} records/s from the first record to the last ({:.2} s; run() to the first record {:.2} s), fan-out {:.0} records/s ({:.2} s; run() to the first record {:.2} s, the consumer's registration included)",
        rates[0].0, rates[0].1, rates[0].2, rates[1].0, rates[1].1, rates[1].2
    );
    let _ = kinesis.delete_stream().stream_name(&stream).send().await;
}

/// In memory: the same comparison where the push is prompt. kinesis-mock pushes an event a
/// second; Kinesis pushes records as they arrive (~70 ms documented from put to read). Here a
/// polling consumer (default settings) and a fan-out consumer (`FanOutRecords` over
/// `testing::Subscriptions`, an event every 20 ms) read one in-memory stream of 4 shards while
/// `rate` records a second are put for `seconds`: what the reader and pipeline add to a push.
async fn fanout_memory(seconds: u64, rate: u64) {
    let stream = MemoryStream::new("fanout", 4);
    let (poll_delays, efo_delays) = (
        Arc::new(std::sync::Mutex::new(Vec::new())),
        Arc::new(std::sync::Mutex::new(Vec::new())),
    );
    let (poll_n, efo_n) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let polling = Consumer::builder(
        stream.name(),
        "poll",
        timed(poll_delays.clone(), poll_n.clone()),
    )
    .worker_id("bench")
    .lanes(4)
    .in_memory(&stream, &MemoryLeaseStore::new())
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    let source = shardwise::shard::fanout::FanOutRecords::with(
        Arc::new(
            shardwise::testing::Subscriptions::over(Arc::new(stream.clone()))
                .every(Duration::from_millis(20)),
        ),
        Arc::new(stream.clone()),
        shardwise::shard::fanout::FanOut::new(),
    );
    let pushed = Consumer::builder(
        stream.name(),
        "efo",
        timed(efo_delays.clone(), efo_n.clone()),
    )
    .worker_id("bench")
    .lanes(4)
    .in_memory(&stream, &MemoryLeaseStore::new())
    .record_source(Arc::new(source))
    .build()
    .unwrap()
    .run()
    .await
    .unwrap();
    while polling.shards().len() < 4 || pushed.shards().len() < 4 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let per_tick = (rate / 100).max(1);
    let mut sent = 0u64;
    let began = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    while began.elapsed() < Duration::from_secs(seconds) {
        tick.tick().await;
        for i in 0..per_tick {
            stream.put(
                &format!("key-{}", (sent + i) % 64),
                format!("sent={:.3}", now_ms()),
            );
        }
        sent += per_tick;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while (poll_n.load(Ordering::Relaxed) < sent || efo_n.load(Ordering::Relaxed) < sent)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    polling.shutdown(Duration::from_secs(5)).await;
    pushed.shutdown(Duration::from_secs(5)).await;
    let mut poll: Vec<f64> = poll_delays.lock().unwrap().clone();
    let mut efo: Vec<f64> = efo_delays.lock().unwrap().clone();
    println!(
        "fan-out vs polling in memory (a push every 20 ms), {sent} records put at {rate}/s over 4 shards for {seconds} s, put to handler: polling p50 {:.1} ms p99 {:.1} ms ({} records); fan-out p50 {:.1} ms p99 {:.1} ms ({} records)",
        quantile(&mut poll, 0.5),
        quantile(&mut poll, 0.99),
        poll.len(),
        quantile(&mut efo, 0.5),
        quantile(&mut efo, 0.99),
        efo.len()
    );
}

/// In memory: a full stream of `n` records over 4 shards read from the start by a polling
/// consumer (default settings: pages of up to 10,000 records, the next asked for at once while
/// pages bring records) and by a fan-out consumer (`testing::Subscriptions` pushing the next
/// event, up to 10,000 records, as soon as the reader took the last). Records/s from the first
/// record to the last, median of `rounds`: what each read path and the pipeline behind it carry
/// when the service is not the limit (on Kinesis both are held to 2 MB/s per shard for one
/// application; polling's is shared with every other reader of the stream, fan-out's is each
/// application's own).
async fn fanout_memory_full(n: u64, rounds: usize) {
    let stream = MemoryStream::new("fanout-full", 4);
    for i in 0..n {
        stream.put(&format!("key-{}", i % 64), format!("{{\"id\":{i}}}"));
    }
    let (mut poll, mut efo) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        for fan_out in [false, true] {
            let handled = Arc::new(AtomicU64::new(0));
            let mut builder = Consumer::builder(
                stream.name(),
                if fan_out { "efo" } else { "poll" },
                timed(Arc::default(), handled.clone()),
            )
            .worker_id("bench")
            .lanes(4)
            .in_memory(&stream, &MemoryLeaseStore::new());
            if fan_out {
                builder =
                    builder.record_source(Arc::new(shardwise::shard::fanout::FanOutRecords::with(
                        Arc::new(
                            shardwise::testing::Subscriptions::over(Arc::new(stream.clone()))
                                .every(Duration::ZERO),
                        ),
                        Arc::new(stream.clone()),
                        shardwise::shard::fanout::FanOut::new(),
                    )));
            }
            let running = builder.build().unwrap().run().await.unwrap();
            while handled.load(Ordering::Relaxed) == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let first = Instant::now();
            while handled.load(Ordering::Relaxed) < n {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let rate = n as f64 / first.elapsed().as_secs_f64();
            running.shutdown(Duration::from_secs(5)).await;
            if fan_out { &mut efo } else { &mut poll }.push(rate);
        }
    }
    let rounds_of = |v: &[f64]| {
        v.iter()
            .map(|r| format!("{r:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "fan-out vs polling in memory, a full stream of {n} records over 4 shards read from the start, records/s from the first record to the last (median of {rounds}): polling {:.0} ({}), fan-out {:.0} ({})",
        quantile(&mut poll.clone(), 0.5),
        rounds_of(&poll),
        quantile(&mut efo.clone(), 0.5),
        rounds_of(&efo),
    );
}

fn main() {
    let benching = std::env::args().any(|a| a == "--bench");
    let scale = if benching {
        Scale {
            pipeline_records: 200_000,
            lane_records: 2_000,
            live_records: 20_000,
            receipt_records: 100_000,
            live_receipt_records: 5_000,
            paged_events: 1_000_000,
            paged_rounds: 5,
            start_rounds: 7,
        }
    } else {
        Scale {
            pipeline_records: 500,
            lane_records: 40,
            live_records: 0,
            receipt_records: 200,
            live_receipt_records: 0,
            paged_events: 800,
            paged_rounds: 1,
            start_rounds: 1,
        }
    };
    shardwise_bench::log_from_env();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    // `cargo bench --bench consumer -- paged lanes` runs only the parts named.
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let part = |name: &str| only.is_empty() || only.iter().any(|o| o == name);
    rt.block_on(async {
        if part("pipeline") {
            pipeline(&scale).await;
        }
        if part("lanes") {
            lanes(&scale).await;
        }
        if part("receipts") {
            receipts_memory(&scale).await;
        }
        if part("paged") {
            paged(&scale).await;
        }
        if benching && part("live") {
            live(&scale).await;
        }
        if benching && part("start") {
            start(scale.start_rounds).await;
        }
        if part("fanout") {
            fanout_memory(if benching { 30 } else { 1 }, 200).await;
            if benching {
                fanout_memory_full(200_000, 3).await;
            } else {
                fanout_memory_full(400, 1).await;
            }
        }
        if benching && part("fanout") {
            fanout(60, 200, scale.live_records).await;
        }
    });
}
