//! Deterministic simulation: the real consumer, lease manager, readers, lanes, tracker, copy
//! writer and seek, on the in-memory stream and lease store under paused Tokio time, with one
//! `u64` seed deciding everything: the workload, handler outcomes and durations, workers that
//! start, stop, crash and are cut off longer than a lease, lease theft, seeks, splits, merges,
//! retention, and faults in the store and the stream (errors, throttling, timeouts, writes whose
//! answer is lost). Half the seeds add a receipt ledger: handlers answer with effects (two
//! counters in one transaction), quarantines and holds, an operator releases or quarantines held
//! records, and the ledger gets faults too. Three seeds in ten hand deliveries to a batch
//! handler (`Batched`), three in ten run under a handler timeout that some handlers exceed, and
//! about three in ten of the others retry in place (`RetryMode::InPlace`) instead of copying
//! (half of those without a dead-letter stream send spent records to a simulated queue, an
//! on-failure destination whose writes fail or lose their answers now and then); one in four of
//! the seeds without batches, timeouts or receipts leaves every retry setting at its default (in
//! place, no cap: a failing record runs again until it succeeds). Three seeds in
//! ten read with enhanced fan-out (`FanOutRecords` over `testing::Subscriptions`, a model of
//! SubscribeToShard on the simulated stream that ends every 5 minutes and fails with its faults).
//! The seeds ending in 0, 5 or 9 without receipts run on tumbling windows of 1 to 3 s
//! (`window::Windowed`, one lane, retries in place): the handler's state is the ids it
//! aggregated, calls and final calls fail now and then, and the model checks each call's state
//! and records (the shard's records of that window in order, none twice, none left out but
//! filtered or spent ones, none of another window), each final call (its window over, its state
//! holding every record aggregated before its first unless a seek undid it) and that every
//! window with aggregated records gets a final call (or its state dropped after `max_attempts`
//! failed ones).
//! Invariants are checked as each event happens (see `sim/model.rs`), among them per-key order
//! within an ownership (in place: a record's next attempt before any later record of its key)
//! and that no effect is applied twice; at the end everything owed must have been handled and be
//! covered by the final checkpoints. A panic in shardwise fails the seed.
//!
//! The paged world (`sim/paged.rs`) does the same for a paged source: the consumer on the scripted
//! event API, with misbehaving pages, crashes, seeks, faults, receipts and ordering keys; it
//! checks seed 003's invariants at every write of the lease store, and per-key order at every
//! handler call.
//!
//! Long seeds (`--long`) live for simulated days against models of the services at their
//! documented limits: a day of Kinesis (`sim/long_stream.rs`) and a week of a CloudWatch Logs
//! group (`sim/long.rs`, on the simulated service of `sim/logs.rs`), with quiet hours and days,
//! fleet outages, lasting throttling (of reads, of the lease table, of its roster item), expiring
//! iterators and tokens, and late events; every worker runs on a host whose wall clock is up to 9 s
//! off the services' and drifts (`testing::HostClock`). The limits modelled, each cited from the
//! service's documentation where it is kept: Kinesis in `src/testing/stream.rs` (module docs),
//! CloudWatch Logs in `sim/logs.rs`, DynamoDB's per-item write limit and transaction size in
//! `src/lease/memory.rs` (`ItemLimits`, `seek`). A watchdog (`sim/watchdog.rs`) fails a seed whose
//! workers loop on the lease table.
//!
//! `cargo test --test sim` runs `SHARDWISE_SIM_SEEDS` seeds (default 1,000), then
//! `SHARDWISE_SIM_PAGED_SEEDS` paged seeds (default a fifth as many), from
//! `SHARDWISE_SIM_FROM` (default 0), then `SHARDWISE_SIM_LONG_SEEDS` long seeds of each kind
//! (default none); `scripts/sim [--long] --seeds N [--paged-seeds P] [--from SEED]` runs any
//! number. Each world ends with `N seeds, V violations, trace HASH`: the same seeds always give
//! the same hash. A failing seed prints its replay command and the last events before the
//! violation.

mod logs;
mod long;
mod long_stream;
mod model;
mod paged;
mod watchdog;
mod world;
mod wrap;

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use md5::{Digest, Md5};

/// Seeds that found real bugs, replayed on every run (the bug each found, fixed, is named).
/// Scenario changes can change what a seed does: when the generator changes, check that each
/// still fails with its fix reverted.
const REGRESSIONS: &[(u64, &str)] = &[
    (
        491,
        "shard sync started grandchildren of a consumed shard at the initial position (LATEST: skipped)",
    ),
    (
        94,
        "a hold released after its shard was read to its end went to closed lanes: the shard task panicked and kept its lease",
    ),
];

/// Long logs seeds (`sim/long.rs`) that found real bugs, replayed whenever long seeds run (the
/// same rule as [`REGRESSIONS`]).
const LONG_LOGS_REGRESSIONS: &[(u64, &str)] = &[(
    20,
    "GetLogEvents named an event by its place in its group: retention deleting an earlier one renamed it onto the deleted one",
)];

/// Replays `regressions` (seed, the bug it found) of a world (`""` for the short one, else
/// its name and a space); whether one violated again.
fn replay(world: &str, regressions: &[(u64, &str)], run: fn(u64) -> world::SeedResult) -> bool {
    let mut failed = false;
    for (seed, bug) in regressions {
        let r = run(*seed);
        if !r.violations.is_empty() {
            failed = true;
            eprintln!(
                "{world}regression seed {seed} ({bug}) violated again: {:#?}",
                r.violations
            );
        }
    }
    failed
}

/// Seeds run twice at the start, to check that a seed always gives the same trace.
const DETERMINISM_CHECKS: u64 = 20;
/// Long seeds run twice at the start.
const LONG_DETERMINISM_CHECKS: u64 = 2;

struct Args {
    seeds: u64,
    /// Seeds of the paged world (default: a fifth of `seeds`).
    paged: u64,
    from: u64,
    trace: bool,
    threads: usize,
    /// Long seeds instead of the short worlds: `seeds` of a day of Kinesis (`sim/long_stream.rs`),
    /// `paged` (default as many) of a week of CloudWatch Logs (`sim/long.rs`).
    long: bool,
    paged_given: bool,
}

fn args() -> Args {
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let seeds = env("SHARDWISE_SIM_SEEDS", 1_000);
    let mut args = Args {
        seeds,
        paged: env("SHARDWISE_SIM_PAGED_SEEDS", seeds / 5),
        from: env("SHARDWISE_SIM_FROM", 0),
        trace: false,
        long: false,
        paged_given: false,
        threads: std::thread::available_parallelism().map_or(2, |n| n.get()),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut number = |what: &str| -> u64 {
            it.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{what} takes a number"))
        };
        match arg.as_str() {
            "--seeds" => {
                args.seeds = number("--seeds");
                args.paged = args.seeds / 5;
            }
            "--paged-seeds" => {
                args.paged = number("--paged-seeds");
                args.paged_given = true;
            }
            "--from" => args.from = number("--from"),
            "--threads" => args.threads = number("--threads") as usize,
            "--trace" => args.trace = true,
            "--long" => args.long = true,
            // What `cargo test` may pass to every test binary.
            _ => {}
        }
    }
    if args.long && !args.paged_given {
        args.paged = args.seeds;
    }
    args
}

/// Where two runs of a seed part, within the trace lines they kept (`SHARDWISE_SIM_TRACE`
/// lines: set it high enough to keep whole runs).
fn first_difference(a: &world::SeedResult, b: &world::SeedResult) {
    let same = a
        .trace
        .iter()
        .zip(&b.trace)
        .take_while(|(x, y)| x == y)
        .count();
    eprintln!(
        "  the kept traces ({} and {} lines) part after {same} equal lines:",
        a.trace.len(),
        b.trace.len()
    );
    for (i, (x, y)) in a
        .trace
        .iter()
        .zip(&b.trace)
        .enumerate()
        .skip(same.saturating_sub(5))
        .take(12)
    {
        eprintln!("  {i:6} {x}\n         {y}");
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn main() {
    // scripts/test runs the simulation's binary itself, beside the other test binaries, and
    // tells the run of `cargo test` to leave it out.
    if std::env::var_os("SHARDWISE_SIM_ELSEWHERE").is_some() {
        println!("sim: run beside the other tests by scripts/test (SHARDWISE_SIM_ELSEWHERE)");
        return;
    }
    let args = args();
    // Simulated handler panics are part of the workload: keep them out of the output. Any other
    // panic is a bug in shardwise: the seed that ran it on this thread fails.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().downcast_ref::<&str>() != Some(&"simulated handler panic") {
            world::panicked(info.to_string());
            report(info);
        }
    }));
    if args.long {
        let mut failed = false;
        let checks = [
            (
                "long kinesis",
                args.seeds,
                long_stream::run_seed as fn(u64) -> world::SeedResult,
            ),
            ("long logs", args.paged, long::run_seed),
        ];
        for (world, count, run) in checks {
            for seed in args.from..args.from + count.min(LONG_DETERMINISM_CHECKS) {
                let (a, b) = (run(seed), run(seed));
                if a.hash != b.hash {
                    failed = true;
                    eprintln!(
                        "{world} seed {seed} is not deterministic: traces {} and {}",
                        hex(&a.hash),
                        hex(&b.hash)
                    );
                }
            }
        }
        failed |= run_world(&args, "long kinesis ", args.seeds, long_stream::run_seed);
        failed |= run_world(&args, "long logs ", args.paged, long::run_seed);
        if args.paged > 0 {
            failed |= replay("long logs ", LONG_LOGS_REGRESSIONS, long::run_seed);
        }
        if failed {
            std::process::exit(1);
        }
        return;
    }
    let mut failed = replay("", REGRESSIONS, world::run_seed);
    for seed in args.from..args.from + args.seeds.min(DETERMINISM_CHECKS) {
        let (a, b) = (world::run_seed(seed), world::run_seed(seed));
        if a.hash != b.hash {
            failed = true;
            eprintln!(
                "seed {seed} is not deterministic: traces {} and {}",
                hex(&a.hash),
                hex(&b.hash)
            );
            first_difference(&a, &b);
        }
    }
    for seed in args.from..args.from + args.paged.min(DETERMINISM_CHECKS / 4) {
        let (a, b) = (paged::run_seed(seed), paged::run_seed(seed));
        if a.hash != b.hash {
            failed = true;
            eprintln!(
                "paged seed {seed} is not deterministic: traces {} and {}",
                hex(&a.hash),
                hex(&b.hash)
            );
            first_difference(&a, &b);
        }
    }
    failed |= run_world(&args, "", args.seeds, world::run_seed);
    failed |= run_world(&args, "paged ", args.paged, paged::run_seed);
    // A few long seeds of each kind after the short ones (scripts/test sets how many).
    let long = std::env::var("SHARDWISE_SIM_LONG_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if long > 0 {
        failed |= run_world(&args, "long kinesis ", long, long_stream::run_seed);
        failed |= run_world(&args, "long logs ", long, long::run_seed);
        failed |= replay("long logs ", LONG_LOGS_REGRESSIONS, long::run_seed);
    }
    if failed {
        std::process::exit(1);
    }
}

/// Runs `count` seeds of one world from `args.from` on `args.threads` threads and prints what
/// they found; true when any seed violated an invariant.
fn run_world(args: &Args, world: &str, count: u64, run: fn(u64) -> world::SeedResult) -> bool {
    let started = Instant::now();
    let next = AtomicU64::new(args.from);
    let end = args.from + count;
    let results = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..args.threads.max(1) {
            scope.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, Ordering::SeqCst);
                    if seed >= end {
                        return;
                    }
                    let result = run(seed);
                    results.lock().unwrap().push(result);
                }
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|r| r.seed);
    let elapsed = started.elapsed().as_secs_f64();

    let mut hasher = Md5::new();
    let mut violations = 0;
    let (mut events, mut invocations) = (0u64, 0u64);
    for r in &results {
        hasher.update(r.hash);
        events += r.events;
        invocations += r.invocations;
        if !r.violations.is_empty() {
            violations += 1;
            eprintln!("\n{world}seed {} violated:", r.seed);
            for v in &r.violations {
                eprintln!("  {v}");
            }
            eprintln!("  last events before it:");
            for line in &r.trace {
                eprintln!("    {line}");
            }
            let long = if world.starts_with("long") {
                "--long "
            } else {
                ""
            };
            if world.is_empty() || world == "long kinesis " {
                eprintln!(
                    "  replay: scripts/sim {long}--seeds 1 --paged-seeds 0 --from {} --trace",
                    r.seed
                );
            } else {
                eprintln!(
                    "  replay: scripts/sim {long}--seeds 0 --paged-seeds 1 --from {} --trace",
                    r.seed
                );
            }
        } else if args.trace {
            for line in &r.trace {
                println!("{line}");
            }
            println!("seed {} trace {}", r.seed, hex(&r.hash));
        }
    }
    let hash = hex(&hasher.finalize()[..8]);
    println!(
        "{world}{:.1} seeds/s ({} seeds in {elapsed:.1} s on {} threads; {events} events, {invocations} handler calls)",
        results.len() as f64 / elapsed,
        results.len(),
        args.threads
    );
    println!(
        "{} {world}seeds, {violations} violations, trace {hash}",
        results.len()
    );
    violations > 0
}
