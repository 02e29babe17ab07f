//! One simulated day of a log group read by timestamp (issue 26, item 3), printed as a table:
//! `cargo bench -p shardwise-bench --bench logs_day` (`-- --hours N` for another length).
//!
//! 100 events a second over 50 log streams, put into the simulated CloudWatch Logs
//! (tests/sim/logs.rs: the real SDK client answered from memory, with the service's page limits,
//! quotas, searchable delay and token expiry) and read by `paged::CloudWatchLogsFilter` with every
//! setting at its default (close horizon 5 min, lateness 1 h, an audit every 5 min, a poll a second,
//! 2 FilterLogEvents requests a second) on tokio's paused clock. One event in a thousand is put
//! late, 1 to 50 minutes behind its time (inside the lateness), and must be found by the audit.
//!
//! Each hour the table shows: the events put and handled, the peak of the consumer's gauges
//! (`shardwise_paged_open_events`, `shardwise_paged_remembered_events`), the heap the consumer
//! holds (the process's live heap, counted by the allocator, less what the simulated service and
//! the benchmark's own ledger hold), resident memory (which includes the service), and the
//! requests against the minimum the events need (a request a poll and the new events in pages, as
//! the issue counts it) and the pages the audits read at least (each audit's window in pages). At the end: every event handled exactly once.
//!
//! The service forgets events more than 90 minutes old (the audit reads 65 minutes back), so its
//! memory is flat too. Under `cargo test` the bench runs 20 simulated minutes at a tenth of the
//! rate, so it cannot rot.

#[allow(dead_code)]
#[path = "../../tests/sim/logs.rs"]
mod logs;
#[path = "../../tests/support/recorder.rs"]
mod recorder;

use std::alloc::System;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use logs::LogsService;
use shardwise::lease::MemoryLeaseStore;
use shardwise::paged::CloudWatchLogsFilter;
use shardwise::{Consumer, Delivery, Outcome};
use stats_alloc::{INSTRUMENTED_SYSTEM, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const GROUP: &str = "/app/orders";
const STREAMS: usize = 50;
/// The default page limit of the source, for the minimum.
const PAGE: u64 = 10_000;

struct Scale {
    hours: f64,
    events_per_second: u64,
}

/// Bytes live on the heap now, by the allocator's count (a reallocation counts its difference in
/// one of the two).
fn live_heap() -> i64 {
    let stats = GLOBAL.stats();
    stats.bytes_allocated as i64 - stats.bytes_deallocated as i64
}

fn resident() -> u64 {
    procfs::process::Process::myself()
        .and_then(|p| p.status())
        .ok()
        .and_then(|s| s.vmrss)
        .map_or(0, |kb| kb * 1024)
}

/// Which events were handled, by the service's event id (a bit each), and how many twice.
#[derive(Default)]
struct Ledger {
    seen: Mutex<Vec<u64>>,
    handled: AtomicU64,
    twice: AtomicU64,
}

impl Ledger {
    fn with_capacity(events: u64) -> Self {
        Self {
            seen: Mutex::new(vec![0; events.div_ceil(64) as usize + 1]),
            ..Self::default()
        }
    }

    fn bytes(&self) -> i64 {
        (self.seen.lock().unwrap().capacity() * 8) as i64
    }

    fn record(&self, id: u64) {
        let mut seen = self.seen.lock().unwrap();
        let (word, bit) = ((id / 64) as usize, 1u64 << (id % 64));
        if word >= seen.len() {
            seen.resize(word + 1, 0);
        }
        if seen[word] & bit != 0 {
            self.twice.fetch_add(1, Ordering::Relaxed);
        }
        seen[word] |= bit;
        self.handled.fetch_add(1, Ordering::Relaxed);
    }

    /// Ids in `1..=put` never handled.
    fn missing(&self, put: u64) -> u64 {
        let seen = self.seen.lock().unwrap();
        (1..=put)
            .filter(|id| seen[(id / 64) as usize] & (1 << (id % 64)) == 0)
            .count() as u64
    }
}

#[derive(Default)]
struct Hour {
    put: u64,
    open: f64,
    remembered: f64,
    heap: i64,
    resident: u64,
    requests: u64,
    minimum: u64,
    audit_pages: u64,
}

fn mb(bytes: f64) -> f64 {
    bytes / 1_048_576.0
}

fn main() {
    let measuring = std::env::args().any(|a| a == "--bench");
    let hours = std::env::args()
        .skip_while(|a| a != "--hours")
        .nth(1)
        .and_then(|h| h.parse().ok());
    let scale = if measuring {
        Scale {
            hours: hours.unwrap_or(24.0),
            events_per_second: 100,
        }
    } else {
        Scale {
            hours: hours.unwrap_or(1.0 / 3.0),
            events_per_second: 10,
        }
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a runtime");
    runtime.block_on(day(&scale));
}

async fn day(scale: &Scale) {
    let metrics = recorder::Metrics::default();
    let _metrics = metrics::set_default_local_recorder(&metrics);
    let base = UNIX_EPOCH + Duration::from_secs(1_767_225_600);
    let _deterministic = shardwise::testing::simulate(base, 26);
    let service = LogsService::new(GROUP, 1_767_225_600_000);
    let streams: Vec<String> = (0..STREAMS).map(|i| format!("i-{i:04}")).collect();
    for stream in &streams {
        service.create_stream(stream);
    }
    let total = (scale.hours * 3600.0) as u64 * scale.events_per_second;
    let ledger = Arc::new(Ledger::with_capacity(total + total / 100));
    let recorded = ledger.clone();
    let running = Consumer::paged(
        Arc::new(CloudWatchLogsFilter::new(service.client(), GROUP)),
        "bench-app",
        move |d: Delivery| {
            let id = d.paged_event_id().and_then(|id| id.parse().ok());
            recorded.record(id.expect("an event id of the service"));
            async { Outcome::Ack }
        },
    )
    .worker_id("bench")
    .lease_store(Arc::new(MemoryLeaseStore::new()))
    .build()
    .expect("a consumer")
    .run()
    .await
    .expect("running");

    let gauge = |name: &str| metrics.gauge(name, GROUP).unwrap_or_default();
    // Events are put every 10 s: each stream's share, stamped over the last 10 s, searchable
    // after 2 s; one in a thousand stamped 1 to 50 minutes earlier.
    let step = Duration::from_secs(10);
    let per_step = scale.events_per_second * step.as_secs();
    let steps = (scale.hours * 3600.0 / step.as_secs_f64()) as u64;
    let steps_per_hour = 3600 / step.as_secs();
    let (mut put, mut late, mut requests_before) = (0u64, 0u64, 0u64);
    let mut hour = Hour::default();
    let mut rows = Vec::new();
    let heap_start = live_heap();
    println!(
        "{:>5} {:>9} {:>9} {:>8} {:>10} {:>13} {:>11} {:>9} {:>9} {:>11}",
        "hour",
        "put",
        "handled",
        "open",
        "remembered",
        "consumer heap",
        "resident",
        "requests",
        "minimum",
        "audit pages"
    );
    for i in 0..steps {
        let now = service.now();
        for (s, stream) in streams.iter().enumerate() {
            let share =
                per_step / STREAMS as u64 + u64::from((s as u64) < per_step % STREAMS as u64);
            let batch: Vec<(i64, String)> = (0..share)
                .map(|k| {
                    let n = put + k;
                    let stamp = if n % 1_000 == 999 {
                        late += 1;
                        now - 60_000 * (1 + (n / 1_000) as i64 % 50)
                    } else {
                        now - 10_000 + (k as i64 * 10_000 / share as i64)
                    };
                    (stamp, format!("{stream} request {n} took {} ms", n % 997))
                })
                .collect();
            put += share;
            service
                .put(stream, &batch, Duration::from_secs(2))
                .expect("accepted");
        }
        hour.put += per_step;
        tokio::time::sleep(step).await;
        hour.open = hour.open.max(gauge("shardwise_paged_open_events"));
        hour.remembered = hour
            .remembered
            .max(gauge("shardwise_paged_remembered_events"));
        let held = live_heap() - heap_start - service.held_bytes() as i64 - ledger.bytes();
        hour.heap = hour.heap.max(held);
        hour.resident = hour.resident.max(resident());
        if (i + 1) % (steps_per_hour / 6) == 0 {
            service.forget_before(service.now() - 90 * 60_000);
        }
        if (i + 1) % steps_per_hour == 0 || i + 1 == steps {
            let requests = service.counts().requests;
            hour.requests = requests - requests_before;
            requests_before = requests;
            let seconds = (((i % steps_per_hour) + 1) * step.as_secs()) as f64;
            hour.minimum = minimum(seconds, hour.put);
            hour.audit_pages = audit_pages(seconds, scale.events_per_second);
            println!(
                "{:>5} {:>9} {:>9} {:>8} {:>10} {:>10.1} MB {:>8.1} MB {:>9} {:>9} {:>11}",
                rows.len() + 1,
                hour.put,
                ledger.handled.load(Ordering::Relaxed),
                hour.open,
                hour.remembered,
                mb(hour.heap as f64),
                mb(hour.resident as f64),
                hour.requests,
                hour.minimum,
                hour.audit_pages
            );
            rows.push(std::mem::take(&mut hour));
        }
    }
    // The last events close 5 minutes after they are put; the late ones wait for an audit.
    tokio::time::sleep(Duration::from_secs(15 * 60)).await;
    running.shutdown(Duration::from_secs(10)).await;

    let handled = ledger.handled.load(Ordering::Relaxed);
    let twice = ledger.twice.load(Ordering::Relaxed);
    let missing = ledger.missing(put);
    let counts = service.counts();
    println!(
        "{put} events put ({late} late), {handled} handled, {missing} missing, {twice} handled twice; \
         {} requests, {} throttled, {} expired tokens",
        counts.requests, counts.throttled, counts.expired_tokens
    );
    let peak = |f: fn(&Hour) -> f64| rows.iter().map(f).fold(0.0, f64::max);
    let minutes = scale.hours * 60.0;
    println!(
        "peaks: open events {}, remembered identities {}, consumer heap {:.1} MB, resident {:.1} MB; \
         requests a minute {:.1} (minimum {:.1}, and the audits' pages {:.1})",
        peak(|h| h.open),
        peak(|h| h.remembered),
        mb(peak(|h| h.heap as f64)),
        mb(peak(|h| h.resident as f64)),
        rows.iter().map(|h| h.requests).sum::<u64>() as f64 / minutes,
        rows.iter().map(|h| h.minimum).sum::<u64>() as f64 / minutes,
        rows.iter().map(|h| h.audit_pages).sum::<u64>() as f64 / minutes,
    );
    assert_eq!(missing, 0, "every event handled");
    assert_eq!(twice, 0, "no event handled twice");
    assert_eq!(handled, put, "every event once");
}

/// The requests `seconds` of events need at least, as the issue counts them: a request a poll
/// (one a second) and the new events in pages. The audits' pages (every 5 minutes, the window of
/// an hour and the close horizon) come on top, and are shown beside it.
fn minimum(seconds: f64, put: u64) -> u64 {
    seconds as u64 + put.div_ceil(PAGE)
}

/// The pages the audits of `seconds` read at least.
fn audit_pages(seconds: f64, rate: u64) -> u64 {
    (seconds / 300.0) as u64 * (rate * (3600 + 300)).div_ceil(PAGE)
}
