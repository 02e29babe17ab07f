//! `shardwise consume`: runs a consumer with leases and checkpoints and prints one JSON line per
//! handled delivery on stdout. SIGTERM and SIGINT shut down gracefully (final checkpoints, leases
//! released). It is also the black-box worker of the process-level tests and the demo.

use std::io::Write;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use base64::Engine;
use serde_json::{Value, json};
use shardwise::lease::{InitialPosition, LeaseSettings};
use shardwise::{Consumer, Delivery, Ordering, Outcome};
use tokio::signal::unix::{SignalKind, signal};

use crate::common::{Ctx, Failure, Result, json_object, parse_rfc3339};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The stream to consume.
    #[arg(long, value_name = "STREAM")]
    stream: String,

    /// The application: names the lease table, shared by every worker of the application.
    #[arg(long, value_name = "APP")]
    app: String,

    /// This worker's id in the lease table (default: host name and process id).
    #[arg(long, value_name = "ID")]
    worker_id: Option<String>,

    /// Lanes per shard.
    #[arg(long, value_name = "N", default_value_t = 1)]
    lanes: usize,

    /// Order between lanes: per partition key, or none.
    #[arg(long, value_name = "per-key|none", default_value = "per-key", value_parser = parse_ordering)]
    ordering: Ordering,

    /// Time each delivery takes in the handler.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    handler_delay_ms: u64,

    /// Where shards new to the application start.
    #[arg(long, value_name = "trim-horizon|latest|at-timestamp:RFC3339", default_value = "trim-horizon", value_parser = parse_start)]
    start: InitialPosition,

    /// Attempts a record gets, counting the first delivery.
    #[arg(long, value_name = "N")]
    max_attempts: Option<NonZeroU32>,

    /// The stream spent records go to.
    #[arg(long, value_name = "STREAM")]
    dead_letter: Option<String>,

    /// Records with one of these partition keys get `--fail-outcome` instead of ack.
    #[arg(long, value_name = "K1,K2", value_delimiter = ',')]
    fail_keys: Vec<String>,

    /// What the listed keys get.
    #[arg(long, value_name = "retry|retry-after:MS|drop", default_value = "retry", value_parser = parse_outcome)]
    fail_outcome: Outcome,

    /// Lease duration (renewed every third of it).
    #[arg(long, value_name = "MS", default_value_t = 10_000)]
    lease_duration_ms: u64,

    /// How often the lease table is scanned to take and steal leases.
    #[arg(long, value_name = "MS", default_value_t = 2_000)]
    scan_interval_ms: u64,

    /// Least time between two checkpoint writes of a shard.
    #[arg(long, value_name = "MS", default_value_t = 1_000)]
    checkpoint_interval_ms: u64,

    /// Wait between polls once caught up.
    #[arg(long, value_name = "MS", default_value_t = 1_000)]
    poll_interval_ms: u64,

    /// How long a graceful shutdown lets running handlers finish.
    #[arg(long, value_name = "MS", default_value_t = 10_000)]
    shutdown_deadline_ms: u64,

    /// Let an idle shard whose last read was empty at the tip advance its frontier coordinate to
    /// (now - this allowance); without it an idle shard holds the frontier.
    #[arg(long, value_name = "MS")]
    caught_up_skew_ms: Option<u64>,

    /// Print nothing per delivery (for throughput measurements); a count goes to stderr at exit.
    #[arg(long)]
    quiet: bool,
}

fn parse_ordering(s: &str) -> std::result::Result<Ordering, String> {
    match s {
        "per-key" => Ok(Ordering::PerKey),
        "none" => Ok(Ordering::None),
        other => Err(format!("`{other}`: expected per-key or none")),
    }
}

fn parse_start(s: &str) -> std::result::Result<InitialPosition, String> {
    match s {
        "trim-horizon" => Ok(InitialPosition::TrimHorizon),
        "latest" => Ok(InitialPosition::Latest),
        other => {
            let ts = other.strip_prefix("at-timestamp:").ok_or_else(|| {
                format!("`{other}`: expected trim-horizon, latest or at-timestamp:RFC3339")
            })?;
            Ok(InitialPosition::AtTimestamp(parse_rfc3339(ts)?))
        }
    }
}

fn parse_outcome(s: &str) -> std::result::Result<Outcome, String> {
    match s {
        "retry" => Ok(Outcome::Retry),
        "drop" => Ok(Outcome::Drop),
        other => {
            let ms = other
                .strip_prefix("retry-after:")
                .ok_or_else(|| format!("`{other}`: expected retry, retry-after:MS or drop"))?;
            let ms: u64 = ms
                .parse()
                .map_err(|_| format!("`{ms}` is not a number of milliseconds"))?;
            Ok(Outcome::RetryAfter(Duration::from_millis(ms)))
        }
    }
}

fn outcome_name(o: Outcome) -> String {
    match o {
        Outcome::Ack => "ack".into(),
        Outcome::Drop => "drop".into(),
        Outcome::Retry => "retry".into(),
        Outcome::RetryAfter(d) => format!("retry-after:{}", d.as_millis()),
        _ => "other".into(),
    }
}

/// One JSON line for a handled delivery.
fn line(d: &Delivery, worker: &str, outcome: Outcome) -> String {
    let data = match std::str::from_utf8(d.payload()) {
        Ok(text) => ("data", Value::from(text)),
        Err(_) => (
            "data_b64",
            Value::from(base64::engine::general_purpose::STANDARD.encode(d.payload())),
        ),
    };
    let arrived = d
        .arrived_at()
        .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
        .map(|d| json!(d.as_millis() as u64))
        .unwrap_or(Value::Null);
    json_object(&[
        ("shard", json!(d.shard())),
        ("sequence", json!(d.sequence_number().to_string())),
        ("subsequence", json!(d.sub_sequence())),
        ("partition_key", json!(d.partition_key())),
        ("attempt", json!(d.attempt())),
        ("worker", json!(worker)),
        ("lane", json!(d.lane())),
        ("outcome", json!(outcome_name(outcome))),
        ("arrived_ms", arrived),
        data,
    ])
}

pub(crate) async fn run(args: Args, ctx: &Ctx) -> Result<()> {
    let worker = args
        .worker_id
        .clone()
        .unwrap_or_else(shardwise::consumer::default_worker_id);
    let delay = Duration::from_millis(args.handler_delay_ms);
    let fail_keys: Arc<Vec<String>> = Arc::new(args.fail_keys.clone());
    let fail_outcome = args.fail_outcome;
    let quiet = args.quiet;
    let handled = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (w, h) = (worker.clone(), handled.clone());
    let handler = move |d: Delivery| {
        let (w, h, fail_keys) = (w.clone(), h.clone(), fail_keys.clone());
        async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let outcome = if fail_keys.iter().any(|k| k == d.partition_key()) {
                fail_outcome
            } else {
                Outcome::Ack
            };
            h.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if !quiet {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "{}", line(&d, &w, outcome));
            }
            outcome
        }
    };
    let lease = LeaseSettings::default()
        .lease_duration(Duration::from_millis(args.lease_duration_ms))
        .scan_interval(Duration::from_millis(args.scan_interval_ms));
    let mut builder = Consumer::builder(args.stream.clone(), args.app.clone(), handler)
        .worker_id(worker.clone())
        .lanes(args.lanes)
        .ordering(args.ordering)
        .lease_settings(lease)
        .initial_position(args.start)
        .checkpoint_interval(Duration::from_millis(args.checkpoint_interval_ms))
        .poll_interval(Duration::from_millis(args.poll_interval_ms))
        .aws_config(ctx.config().clone());
    if let Some(n) = args.max_attempts {
        builder = builder.max_attempts(n);
    }
    if let Some(ms) = args.caught_up_skew_ms {
        builder = builder.caught_up_frontier(Duration::from_millis(ms));
    }
    if let Some(dl) = &args.dead_letter {
        builder = builder.dead_letter(dl.clone());
    }
    let consumer = builder
        .build()
        .map_err(|e| Failure::caused_by("invalid settings", e))?;

    let mut term = signal(SignalKind::terminate())
        .map_err(|e| Failure::caused_by("installing a SIGTERM handler", e))?;
    let mut int = signal(SignalKind::interrupt())
        .map_err(|e| Failure::caused_by("installing a SIGINT handler", e))?;
    let running = consumer
        .run()
        .await
        .map_err(|e| Failure::caused_by(format!("cannot consume `{}`", args.stream), e))?;
    tracing::info!(worker = %worker, "consuming; SIGTERM or SIGINT stops gracefully");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    let report = running
        .shutdown(Duration::from_millis(args.shutdown_deadline_ms))
        .await;
    eprintln!(
        "{}",
        json_object(&[
            ("event", json!("shutdown")),
            ("worker", json!(worker)),
            (
                "handled",
                json!(handled.load(std::sync::atomic::Ordering::Relaxed))
            ),
            ("shards_stopped", json!(report.shards_stopped)),
            ("leases_released", json!(report.leases_released)),
            ("deadline_passed", json!(report.deadline_passed)),
        ])
    );
    Ok(())
}
