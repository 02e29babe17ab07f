//! A log group in production's shape, read stream by stream (`paged::CloudWatchLogs`,
//! GetLogEvents) with every setting at its default (issue 55, item 2), printed against the
//! issue's targets: `cargo bench -p shardwise-bench --bench logs_production` (`-- --hours N`).
//!
//! The group, in the simulated CloudWatch Logs (tests/sim/logs.rs: the real SDK client answered
//! from memory, its 1 MB and 10,000-event page cap, the account's quotas of 25 GetLogEvents and
//! 5 DescribeLogStreams requests a second, tokens that expire), on tokio's paused clock:
//! - 500 streams, as Lambda leaves them: 20 busy (an execution environment each, together 100
//!   events a second, each stream's batches 1 to 10 s apart) and 480 that took a burst of 20
//!   events in the first hour and nothing since (environments gone; CloudWatch keeps them);
//! - 300-byte lines; one event in 1,000 put late, 1 to 50 minutes behind its time.
//!
//! Reported, beside each target:
//! - bytes the service returned / bytes put (read amplification);
//! - the streams silent for the last hour: GetLogEvents requests and lease-row writes in that
//!   hour, per stream;
//! - late events: the time from their put to their handling, p50 / p99 / max;
//! - CPU per event handled (this process: the consumer, the SDK's requests and answers, and the
//!   simulated service too, so an upper bound), with the machine it ran on;
//! - every event handled once.
//!
//! Not measured here (the other targets): the ceiling in events/s per account and per
//! group, and a 3-day backlog's clearing time. Under `cargo test` the bench runs a tenth of the
//! streams for 40 simulated minutes, so it cannot rot.

#[allow(dead_code)]
#[path = "../../tests/sim/logs.rs"]
mod logs;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use logs::LogsService;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shardwise::lease::{LeaseStore, MemoryLeaseStore};
use shardwise::paged::CloudWatchLogs;
use shardwise::{Consumer, Delivery, Outcome};

const GROUP: &str = "/aws/lambda/orders";
const LINE: usize = 300;

struct Scale {
    hours: f64,
    busy: usize,
    dead: usize,
    events_per_second: u64,
}

/// When each event was put and handled (service ms), by its number.
#[derive(Default)]
struct Ledger {
    put: HashMap<u64, (i64, bool)>,
    handled: HashMap<u64, (i64, u32)>,
}

fn cpu_seconds() -> f64 {
    procfs::process::Process::myself()
        .and_then(|p| p.stat())
        .map(|s| (s.utime + s.stime) as f64 / procfs::ticks_per_second() as f64)
        .unwrap_or_default()
}

fn percentile(sorted: &[i64], p: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let measuring = std::env::args().any(|a| a == "--bench");
    let hours = std::env::args()
        .skip_while(|a| a != "--hours")
        .nth(1)
        .and_then(|h| h.parse().ok());
    let scale = if measuring {
        Scale {
            hours: hours.unwrap_or(3.0),
            busy: 20,
            dead: 480,
            events_per_second: 100,
        }
    } else {
        Scale {
            hours: hours.unwrap_or(2.0 / 3.0),
            busy: 2,
            dead: 48,
            events_per_second: 10,
        }
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a runtime");
    runtime.block_on(production(&scale));
}

async fn production(scale: &Scale) {
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 55);
    let mut rng = StdRng::seed_from_u64(55);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    let busy: Vec<String> = (0..scale.busy).map(|i| format!("busy-{i:03}")).collect();
    let dead: Vec<String> = (0..scale.dead).map(|i| format!("gone-{i:03}")).collect();
    for stream in busy.iter().chain(&dead) {
        service.create_stream(stream);
    }
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let store = MemoryLeaseStore::new();
    // Writes to each row, as the store applies them.
    let writes: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let counted = writes.clone();
    store.observe(Arc::new(move |change: &shardwise::lease::Change| {
        let row = change.after.as_ref().or(change.before.as_ref());
        if let Some(row) = row {
            *counted
                .lock()
                .unwrap()
                .entry(row.shard_id.clone())
                .or_default() += 1;
        }
    }));
    let recorded = ledger.clone();
    let clock = service.clone();
    let running = Consumer::paged(
        Arc::new(CloudWatchLogs::new(service.client(), GROUP)),
        "bench-app",
        move |d: Delivery| {
            let message = String::from_utf8_lossy(d.payload());
            let n: u64 = message
                .split_whitespace()
                .nth(1)
                .and_then(|n| n.parse().ok())
                .expect("an event number");
            let mut ledger = recorded.lock().unwrap();
            let entry = ledger.handled.entry(n).or_insert((clock.now(), 0));
            entry.1 += 1;
            async { Outcome::Ack }
        },
    )
    .worker_id("bench")
    .lease_store(Arc::new(store.clone()) as Arc<dyn LeaseStore>)
    .build()
    .expect("a consumer")
    .run()
    .await
    .expect("running");

    let cpu_start = cpu_seconds();
    let mut n = 0u64;
    let line = |stream: &str, n: u64| {
        let head = format!("{stream} {n} request took {} ms ", n % 997);
        head.clone() + &"x".repeat(LINE.saturating_sub(head.len()))
    };
    // The dead streams' bursts, each at its own time in the first hour.
    let mut bursts: Vec<(Duration, usize)> = (0..dead.len())
        .map(|i| (Duration::from_millis(rng.random_range(0..3_600_000)), i))
        .collect();
    bursts.sort();
    let mut bursts = bursts.into_iter().peekable();
    // Each busy stream's next batch.
    let start = tokio::time::Instant::now();
    let end = start + Duration::from_secs_f64(scale.hours * 3600.0);
    let mut next: Vec<tokio::time::Instant> = busy
        .iter()
        .map(|_| start + Duration::from_millis(rng.random_range(0..10_000)))
        .collect();
    let per_stream = scale.events_per_second as f64 / busy.len() as f64;
    let mut last_put = start;
    while tokio::time::Instant::now() < end {
        let now = tokio::time::Instant::now();
        let service_now = service.now();
        while let Some((at, i)) = bursts.next_if(|(at, _)| start + *at <= now) {
            let _ = at;
            let batch: Vec<(i64, String)> = (0..20)
                .map(|k| {
                    n += 1;
                    ledger.lock().unwrap().put.insert(n, (service_now, false));
                    (service_now - 20 + k, line(&dead[i], n))
                })
                .collect();
            service
                .put(&dead[i], &batch, Duration::from_secs(2))
                .expect("accepted");
        }
        for (s, stream) in busy.iter().enumerate() {
            if next[s] > now {
                continue;
            }
            let gap = Duration::from_millis(rng.random_range(1_000..=10_000));
            let count = (per_stream * gap.as_secs_f64()).round().max(1.0) as u64;
            let batch: Vec<(i64, String)> = (0..count)
                .map(|k| {
                    n += 1;
                    let late = n % 1_000 == 999;
                    ledger.lock().unwrap().put.insert(n, (service_now, late));
                    let stamp = if late {
                        service_now - 60_000 * rng.random_range(1..=50)
                    } else {
                        service_now - 1_000 + (k as i64 * 1_000 / count as i64)
                    };
                    (stamp, line(stream, n))
                })
                .collect::<Vec<_>>();
            let mut batch = batch;
            batch.sort_by_key(|(t, _)| *t);
            service
                .put(stream, &batch, Duration::from_secs(2))
                .expect("accepted");
            next[s] = now + gap;
            last_put = now;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let _ = last_put;
    // The last hour of the run, for the dead streams' cost: measured from an hour before the end.
    // (The loop above ran to `end`; the counts of the last hour were taken at `end - 1 h` below.)
    let quiet_from = service.counts();
    let writes_from = writes.lock().unwrap().clone();
    let quiet = Duration::from_secs(3600).min(Duration::from_secs_f64(scale.hours * 1800.0));
    // Let the late events' audits and the dead streams' retirement run on, nothing put.
    tokio::time::sleep(quiet).await;
    let quiet_to = service.counts();
    let writes_to = writes.lock().unwrap().clone();
    running.shutdown(Duration::from_secs(10)).await;
    let cpu = cpu_seconds() - cpu_start;

    let ledger = ledger.lock().unwrap();
    let put = ledger.put.len() as u64;
    let handled = ledger.handled.len() as u64;
    let twice = ledger.handled.values().filter(|(_, c)| *c > 1).count();
    let missing = ledger
        .put
        .keys()
        .filter(|n| !ledger.handled.contains_key(n))
        .count();
    let mut late: Vec<i64> = ledger
        .put
        .iter()
        .filter(|(_, (_, late))| *late)
        .filter_map(|(n, (at, _))| ledger.handled.get(n).map(|(h, _)| h - at))
        .collect();
    late.sort_unstable();
    // Those put in the last hour of events, when the silent streams had retired.
    let last_hour_from = service.now()
        - quiet.as_millis() as i64
        - 3_600_000.min((scale.hours * 3_600_000.0) as i64 / 2);
    let mut late_after: Vec<i64> = ledger
        .put
        .iter()
        .filter(|(_, (at, late))| *late && *at >= last_hour_from)
        .filter_map(|(n, (at, _))| ledger.handled.get(n).map(|(h, _)| h - at))
        .collect();
    late_after.sort_unstable();
    let counts = service.counts();
    let amplification = counts.bytes_read as f64 / counts.bytes_put.max(1) as f64;
    let dead_reads: u64 = dead
        .iter()
        .map(|s| {
            quiet_to.get_log_events.get(s).copied().unwrap_or(0)
                - quiet_from.get_log_events.get(s).copied().unwrap_or(0)
        })
        .sum();
    let dead_writes: u64 = dead
        .iter()
        .map(|s| writes_to.get(s).copied().unwrap_or(0) - writes_from.get(s).copied().unwrap_or(0))
        .sum();
    let quiet_minutes = quiet.as_secs_f64() / 60.0;
    let per_dead = |total: u64| total as f64 / dead.len() as f64;
    let cpu_per_event = cpu / handled.max(1) as f64 * 1e6;
    let machine = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or_default().trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    println!(
        "{} streams ({} busy, {} silent after a burst in the first hour), {:.1} h of events and {:.0} min quiet, defaults",
        busy.len() + dead.len(),
        busy.len(),
        dead.len(),
        scale.hours,
        quiet_minutes
    );
    println!(
        "{:<58} {:>22} {:>24}",
        "measure", "measured", "target (issue 55)"
    );
    let row = |what: &str, measured: String, target: &str| {
        println!("{what:<58} {measured:>22} {target:>24}");
    };
    row(
        "bytes read / bytes put",
        format!("{amplification:.2}"),
        "<= 1.5",
    );
    row(
        "silent stream: GetLogEvents per 5 min (quiet window)",
        format!("{:.3}", per_dead(dead_reads) / quiet_minutes * 5.0),
        "<= 1",
    );
    row(
        "silent stream: lease-row writes (quiet window)",
        format!("{:.2}", per_dead(dead_writes)),
        "0",
    );
    row(
        "late events: put to handled, p50 / p99 / max (s)",
        format!(
            "{:.0} / {:.0} / {:.0}",
            percentile(&late, 0.5) as f64 / 1e3,
            percentile(&late, 0.99) as f64 / 1e3,
            late.last().copied().unwrap_or_default() as f64 / 1e3
        ),
        "p99 <= 360 (5 min + 1)",
    );
    row(
        "  of them put in the last hour of events: p50 / p99 (s)",
        format!(
            "{:.0} / {:.0}",
            percentile(&late_after, 0.5) as f64 / 1e3,
            percentile(&late_after, 0.99) as f64 / 1e3
        ),
        "p99 <= 360",
    );
    row(
        "CPU per event handled (us, service included)",
        format!("{cpu_per_event:.1}"),
        "<= 2",
    );
    println!(
        "{put} events put ({} late), {handled} handled, {missing} missing, {twice} handled twice; \
         {} requests ({} GetLogEvents, {} DescribeLogStreams), {} throttled; machine: {machine}, CPU {cpu:.1} s",
        late.len(),
        counts.requests,
        counts.get_log_events.values().sum::<u64>(),
        counts.describe_log_streams,
        counts.throttled,
    );
    assert_eq!(missing, 0, "every event handled");
    assert_eq!(twice, 0, "no event handled twice");
}
