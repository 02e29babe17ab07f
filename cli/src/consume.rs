//! `shardwise consume`: runs a consumer with leases and checkpoints and prints one JSON line per
//! handled delivery on stdout. SIGTERM and SIGINT shut down gracefully (final checkpoints, leases
//! released). It is also the black-box worker of the process-level tests and the demo.

use std::io::Write;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};
use aws_config::SdkConfig;
use base64::Engine;
use serde::Serialize;
use shardwise::consumer::{OnSpent, RetryMode, Settled};
use shardwise::destination::{Destination, S3Destination, SnsDestination, SqsDestination};
use shardwise::filter::{FilterCriteria, Filtered};
use shardwise::lease::{InitialPosition, LeaseSettings};
use shardwise::observe::Metrics;
use shardwise::paged::{CloudWatchLogs, CloudWatchLogsFilter, PagedSource};
use shardwise::receipts::{DynamoDbReceipts, Effect, ReceiptStore, SourceRetention, key};
use shardwise::shard::discovery::{KinesisShards, ShardLister};
use shardwise::shard::fanout::FanOut;
use shardwise::subscription;
use shardwise::window::{WindowSlots, Windowed};
use shardwise::{
    Batching, ConfigError, Consumer, ConsumerBuilder, Delivery, DeliveryOrder, Handler, Outcome,
    Running, ShutdownReport,
};
use tokio::signal::unix::{SignalKind, signal};

use crate::common::{Ctx, Result};
use crate::exec::runner::{LAMBDA_MAX_TIMEOUT, Runner, Runtime, parse_runtime};
use crate::exec::{EventSource, Exec, ExecSettings, ExecWindows, Format, STOP_GRACE};
use crate::flag_error::{Source, invalid_setting};
use crate::table_flags::TableFlags;
use crate::target::{START_VALUES, parse_start, time_help};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The stream to consume.
    #[arg(
        long,
        env = "SHARDWISE_STREAM",
        value_name = "STREAM",
        required_unless_present = "log_group"
    )]
    stream: Option<String>,

    /// Instead of a stream: a CloudWatch Logs log group, each log stream a partition read with
    /// `GetLogEvents` (lines then carry `partition`, `position`, `id` and `timestamp`).
    #[arg(
        long,
        env = "SHARDWISE_LOG_GROUP",
        value_name = "GROUP",
        conflicts_with = "stream"
    )]
    log_group: Option<String>,

    /// With --log-group: read the whole group by timestamp through `FilterLogEvents` instead,
    /// checkpointed by closing timestamp groups (`closed_through` in `leases --json`); `id` is the
    /// event's `eventId`, `partition` the log group.
    #[arg(long, env = "SHARDWISE_BY_TIMESTAMP", requires = "log_group")]
    by_timestamp: bool,

    /// With --by-timestamp: how far behind the present a poll stops, e.g. `5m`, `30s` (default
    /// 5m). Events are read, and their timestamp groups closed, once they are this old: it
    /// covers the delay before CloudWatch can search an event, and clock skew.
    #[arg(long, env = "SHARDWISE_CLOSE_HORIZON", value_name = "DURATION", requires = "by_timestamp", value_parser = humantime::parse_duration)]
    close_horizon: Option<Duration>,

    /// With --by-timestamp: how late (behind the close horizon) an event may arrive and still be
    /// handled, e.g. `10m`, `2h`, `14d` (default 1h; CloudWatch takes events up to 14 days old).
    /// An audit reads this window again every 5 minutes; its events' identities are kept in
    /// memory (16 bytes each).
    #[arg(long, env = "SHARDWISE_LATENESS", value_name = "DURATION", requires = "by_timestamp", value_parser = humantime::parse_duration)]
    lateness: Option<Duration>,

    /// With --log-group (read stream by stream): how long a log stream may have nothing new
    /// before it retires, e.g. `30m`, `6h` (default 1h; `0s`: never). A retired stream costs no
    /// lease writes and no reads until a listing of the group shows it took events since
    /// (`lastIngestionTime`); `leases` shows it `retired`.
    #[arg(long, env = "SHARDWISE_RETIRE_AFTER", value_name = "DURATION", requires = "log_group", conflicts_with = "by_timestamp", value_parser = humantime::parse_duration)]
    retire_after: Option<Duration>,

    /// Lambda's event filtering: a `FilterCriteria` as the AWS CLI takes it
    /// (`{"Filters":[{"Pattern":"{\"data\":{\"kind\":[\"order\"]}}"}]}`), or a file holding one.
    /// A record whose data no pattern matches (or is not JSON) is acknowledged without reaching
    /// the handler and counted in `shardwise_records_filtered_total`; up to 5 patterns, on
    /// `data`, in Lambda's rule syntax. A malformed one fails the start, saying where.
    #[arg(long, env = "SHARDWISE_FILTER_CRITERIA", value_name = "FILE|JSON")]
    filter_criteria: Option<String>,

    /// With --log-group: how long after its ingestion an event may become readable (searchable,
    /// with --by-timestamp), e.g. `5m`, `1h` (default 15m; AWS states no bound). An audit for
    /// late events never vouches for an event ingested after the newest one it read, nor (with
    /// nothing that recent) for the last DURATION: a late event readable later than that, and
    /// later than the allowance (30 s; the close horizon with --by-timestamp), is not looked for.
    #[arg(long, env = "SHARDWISE_READABLE_WITHIN", value_name = "DURATION", requires = "log_group", value_parser = humantime::parse_duration)]
    readable_within: Option<Duration>,

    /// The application, shared by every worker of the application; names the lease table unless
    /// --lease-table does.
    #[arg(long, env = "SHARDWISE_APP", value_name = "APP")]
    app: String,

    /// The DynamoDB lease table (default: the application's name).
    #[arg(long, env = "SHARDWISE_LEASE_TABLE", value_name = "NAME")]
    lease_table: Option<String>,

    #[command(flatten)]
    table: TableFlags,

    /// This worker's id in the lease table (default: host name, process id and a random part).
    #[arg(long, env = "SHARDWISE_WORKER_ID", value_name = "ID")]
    worker_id: Option<String>,

    /// Lanes per shard.
    #[arg(long, env = "SHARDWISE_LANES", value_name = "N", default_value_t = 1)]
    lanes: usize,

    /// Order between lanes: per partition key, or none.
    #[arg(long, env = "SHARDWISE_ORDERING", value_name = "per-key|none", default_value = "per-key", value_parser = parse_ordering)]
    ordering: DeliveryOrder,

    /// Time each delivery takes in the built-in handler, e.g. `5ms`.
    #[arg(long, env = "SHARDWISE_HANDLER_DELAY", value_name = "DURATION", default_value = "0s", value_parser = humantime::parse_duration, help_heading = DEMO)]
    handler_delay: Duration,

    #[arg(
        long,
        env = "SHARDWISE_START",
        value_name = START_VALUES,
        default_value = "trim-horizon",
        value_parser = parse_start,
        help = concat!("Where shards new to the application start. ", time_help!()),
    )]
    start: InitialPosition,

    /// Attempts a record gets, counting the first delivery. Without it a failing record runs again
    /// in place until it succeeds (or is older than --max-record-age), as Lambda retries until a
    /// record expires. With it, a spent record goes to --dead-letter or --on-failure, with
    /// --receipts gets a quarantined receipt, or with --on-spent drop is dropped; one of these is
    /// required (with --retries copy, a spent record without one is dropped).
    #[arg(long, env = "SHARDWISE_MAX_ATTEMPTS", value_name = "N")]
    max_attempts: Option<NonZeroU32>,

    /// Read with enhanced fan-out: records are pushed to this application's own registered
    /// stream consumer (SubscribeToShard: 2 MB/s per shard of its own, not shared with other
    /// readers) instead of polled with GetRecords. The consumer is registered at start if it does
    /// not exist, tagged shardwise:application=APP; one of another application is refused.
    /// `shardwise stream deregister-consumer` removes it.
    #[arg(long, env = "SHARDWISE_EFO", conflicts_with = "log_group")]
    efo: bool,

    /// The stream is a CloudWatch Logs subscription filter's destination (gzip documents of log
    /// events): each log event is one delivery, its message the `data`, its log stream the
    /// `partition_key` (a stream's events in order), and `log_group`, `log_event_id` and
    /// `log_timestamp` on its line; a checkpoint can fall between a record's events. A control
    /// message is skipped; a record that is not such a document is delivered whole, with a
    /// warning and shardwise_cloudwatch_corrupt_total. Without it a handler gets the gzip data
    /// as it is (what a Lambda function subscribed through Kinesis decodes itself).
    #[arg(
        long,
        env = "SHARDWISE_CLOUDWATCH_SUBSCRIPTION",
        conflicts_with = "log_group"
    )]
    cloudwatch_subscription: bool,

    /// With --efo: the stream consumer's name (default: --app).
    #[arg(
        long,
        env = "SHARDWISE_CONSUMER_NAME",
        value_name = "NAME",
        requires = "efo"
    )]
    consumer_name: Option<String>,

    /// Where a failing Kinesis record runs again: `in-place` (the default) runs it again on its
    /// lane after a back-off (100 ms doubling to 5 s, with jitter; retry-after:MS waits MS), the
    /// later records of its key waiting behind it, other keys going on, as Lambda's trigger and
    /// KCL do. `copy` writes a counted copy (ruststream's x-ruststream-retry-count) at the tip of
    /// the stream, where every other consumer of it reads it too, or of --retry-stream; it needs
    /// --max-attempts or --dead-letter (or --on-failure). (With --log-group retries always run
    /// in place.)
    #[arg(long, env = "SHARDWISE_RETRIES", value_name = "in-place|copy", default_value = "in-place", value_parser = parse_retries)]
    retries: RetryMode,

    /// With --retries copy: write retry copies to this Kinesis stream instead of the one read, so
    /// that other consumers of that stream never see them. This process reads the retry stream
    /// too, in the same application and lease table and with the same handler, and its copies
    /// of copies stay in it.
    #[arg(
        long,
        env = "SHARDWISE_RETRY_STREAM",
        value_name = "STREAM",
        conflicts_with = "log_group"
    )]
    retry_stream: Option<String>,

    /// `drop` drops a record retried in place whose attempts are spent (--max-attempts,
    /// --max-record-age) when there is no --dead-letter (a warning and
    /// shardwise_records_total{outcome="spent"}).
    #[arg(long, env = "SHARDWISE_ON_SPENT", value_name = "drop", value_parser = parse_on_spent)]
    on_spent: Option<OnSpent>,

    /// Where spent records go instead of a --dead-letter stream: `sqs:QUEUE_URL` (one message a
    /// record), `s3:BUCKET/PREFIX` (one object a record, at PREFIX STREAM/SHARD/SEQUENCE-SUB.json)
    /// or `sns:TOPIC_ARN` (one message a record, Lambda's failure record with the document's
    /// fields beside it), each a JSON document with the record's data (base64), stream, shard,
    /// sequence number, partition key, arrival time, attempts and reason. Checked at start.
    #[arg(long, env = "SHARDWISE_ON_FAILURE", value_name = "sqs:URL|s3:BUCKET/PREFIX|sns:TOPIC_ARN", value_parser = parse_on_failure, conflicts_with = "dead_letter")]
    on_failure: Option<OnFailure>,

    /// The Kinesis stream spent records (with --log-group: spent events, with their partition,
    /// position, identity, timestamp, attempts and reason) go to, written before they settle.
    #[arg(long, env = "SHARDWISE_DEAD_LETTER", value_name = "STREAM")]
    dead_letter: Option<String>,

    /// Records with one of these partition keys get `--fail-outcome` instead of ack (the built-in
    /// handler).
    #[arg(long, env = "SHARDWISE_FAIL_KEYS", value_name = "K1,K2", value_delimiter = ',', help_heading = DEMO)]
    fail_keys: Vec<String>,

    /// What the listed keys get; `hold:REASON` and `quarantine:REASON` need --receipts.
    #[arg(long, env = "SHARDWISE_FAIL_OUTCOME", value_name = "retry|retry-after:MS|drop|hold:REASON|quarantine:REASON", default_value = "retry", value_parser = parse_outcome, help_heading = DEMO)]
    fail_outcome: Outcome,

    /// Lease duration (renewed every third of it), e.g. `10s`.
    #[arg(long, env = "SHARDWISE_LEASE_DURATION", value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    lease_duration: Duration,

    /// How often the lease table is scanned to take and steal leases.
    #[arg(long, env = "SHARDWISE_SCAN_INTERVAL", value_name = "DURATION", default_value = "2s", value_parser = humantime::parse_duration)]
    scan_interval: Duration,

    /// How often one worker lists the stream's shards (the log group's streams) to create rows
    /// for new ones (KCL's `shardSyncIntervalMillis`); a retired log stream that took events is
    /// woken by such a listing.
    #[arg(long, env = "SHARDWISE_SHARD_SYNC_INTERVAL", value_name = "DURATION", default_value = "60s", value_parser = humantime::parse_duration)]
    shard_sync_interval: Duration,

    /// Cooperative handoff: how long a worker asked for one of its leases lets in-flight
    /// deliveries settle before it aborts them, checkpoints and hands the lease over.
    #[arg(long, env = "SHARDWISE_HANDOFF_TIMEOUT", value_name = "DURATION", default_value = "5s", value_parser = humantime::parse_duration)]
    handoff_timeout: Duration,

    /// Least time between two checkpoint writes of a shard.
    #[arg(long, env = "SHARDWISE_CHECKPOINT_INTERVAL", value_name = "DURATION", default_value = "1s", value_parser = humantime::parse_duration)]
    checkpoint_interval: Duration,

    /// Wait between polls once caught up.
    #[arg(long, env = "SHARDWISE_POLL_INTERVAL", value_name = "DURATION", default_value = "1s", value_parser = humantime::parse_duration)]
    poll_interval: Duration,

    /// How long a graceful shutdown lets running handlers finish (a container's termination
    /// grace period must be longer).
    #[arg(long, env = "SHARDWISE_SHUTDOWN_DEADLINE", value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    shutdown_deadline: Duration,

    /// Let an idle shard whose last read was empty at the tip advance its frontier coordinate to
    /// (now - this allowance); without it an idle shard holds the frontier.
    #[arg(long, env = "SHARDWISE_CAUGHT_UP_SKEW", value_name = "DURATION", value_parser = humantime::parse_duration)]
    caught_up_skew: Option<Duration>,

    /// Keep a receipt ledger in this DynamoDB table (`APP-receipts` when no TABLE is given;
    /// created on first use): effects are committed exactly once, with their event's receipt.
    /// Lines are then printed as deliveries settle, with `replay`.
    #[arg(long, env = "SHARDWISE_RECEIPTS", value_name = "TABLE", num_args = 0..=1, default_missing_value = "")]
    receipts: Option<String>,

    /// With --receipts: for each delivery whose payload is JSON with an `id`, add 1 to the
    /// number `count` of the item whose string key `id` is that id in this table (created on
    /// first use), in one transaction with the event's receipt (the built-in handler).
    #[arg(long, env = "SHARDWISE_COUNT_INTO", value_name = "TABLE", requires = "receipts", help_heading = DEMO)]
    count_into: Option<String>,

    /// With --receipts: how often a held record's receipt is read to see whether an operator
    /// quarantined (settled) or released (handle again) it.
    #[arg(long, env = "SHARDWISE_HOLD_POLL_INTERVAL", value_name = "DURATION", default_value = "5s", value_parser = humantime::parse_duration, requires = "receipts")]
    hold_poll_interval: Duration,

    /// With --receipts: how long applied receipts are kept (DynamoDB TTL), e.g. `7d`, `36h`
    /// (default: as long as the source keeps events, the stream's retention or the log group's
    /// plus its deletion delay, and at least 7d, or with --by-timestamp the close horizon plus
    /// the lateness if that is longer: a receipt must outlive every replay, and a shorter one is
    /// refused). For a log group that never expires events, 7d, and a stream whose progress is
    /// older than the receipts are kept is refused (see --resume-past-expired-receipts). Held
    /// and quarantined receipts stay.
    #[arg(long, env = "SHARDWISE_RECEIPT_RETENTION", value_name = "DURATION", value_parser = humantime::parse_duration)]
    receipt_retention: Option<Duration>,

    /// With --receipts on a log group that never expires events: read on a stream whose
    /// progress is older than the receipts are kept (the fleet was down longer, or an event
    /// failed in place that long), handling again what their receipts would have settled (its
    /// effects may be applied a second time). Without it such a stream is refused, with an error
    /// that names it, until it is sought or this is given.
    #[arg(
        long,
        env = "SHARDWISE_RESUME_PAST_EXPIRED_RECEIPTS",
        requires = "receipts"
    )]
    resume_past_expired_receipts: bool,

    /// Print nothing per delivery (for throughput measurements); a count goes to stderr at exit.
    #[arg(long, env = "SHARDWISE_QUIET")]
    quiet: bool,

    /// Run this program as the handler (through `sh -c`): one JSON object per delivery on its
    /// stdin, one outcome per line on its stdout (the README's "Any program as the handler" has
    /// the protocol). A program that exits, hangs past --handler-timeout or writes garbage is
    /// restarted with back-off and gets its unanswered deliveries again. When shutdown starts it
    /// reads `{"shutdown": {"deadline_ms": N}}`; at the end it gets SIGTERM, and SIGKILL if still
    /// running 5 s later.
    #[arg(long, env = "SHARDWISE_EXEC", value_name = "'CMD ARGS'", group = "handler_program", conflicts_with_all = ["handler_delay", "handler_delay_ms", "fail_keys", "count_into"])]
    exec: Option<String>,

    /// With --exec: the lines' format. `shardwise`: the protocol's own. `lambda`: Lambda's Kinesis
    /// event, `{"id": B, "event": {"Records": [...]}, "records": [...]}`, a batch of up to --batch
    /// records (default 100, Lambda's) of one lane of one shard, answered `{"id": B, "response":
    /// R}` with what the function returned (`{"batchItemFailures": [{"itemIdentifier": SEQ}]}`
    /// retries those records and every later one of the batch) or `{"id": B, "error": E}` (the
    /// whole batch is retried). Not with --log-group.
    #[arg(long, env = "SHARDWISE_EXEC_FORMAT", value_name = "shardwise|lambda", requires = "exec", value_parser = parse_exec_format)]
    exec_format: Option<ExecFormat>,

    /// Run an unmodified AWS Lambda handler, `MODULE.FUNCTION` as Lambda's Handler setting names
    /// it (`lambda_function.lambda_handler`, `index.handler`): a runner shipped with shardwise
    /// imports it from --lambda-dir and calls it with each batch's Kinesis event and a Lambda
    /// context, as --exec children speaking --exec-format lambda. A function that raises fails its
    /// batch; one returning batchItemFailures fails those records and every later one. Checked
    /// at start: a handler that cannot load stops consume with the reason.
    #[arg(long, env = "SHARDWISE_LAMBDA_HANDLER", value_name = "MODULE.FUNCTION", group = "handler_program", conflicts_with_all = ["handler_delay", "handler_delay_ms", "fail_keys", "count_into", "log_group"])]
    lambda_handler: Option<String>,

    /// With --lambda-handler: `python` (python3 on the PATH) or `node` (Lambda's identifiers such
    /// as python3.12 or nodejs20.x name the language too). Default: from the module's file in
    /// --lambda-dir (MODULE.py, or MODULE.js, .mjs or .cjs).
    #[arg(long, env = "SHARDWISE_LAMBDA_RUNTIME", value_name = "python|node", requires = "lambda_handler", value_parser = parse_runtime)]
    lambda_runtime: Option<Runtime>,

    /// With --lambda-handler: the function's directory, its working directory and where its
    /// module is imported from (Lambda's task root). Default: the current directory.
    #[arg(
        long,
        env = "SHARDWISE_LAMBDA_DIR",
        value_name = "DIR",
        requires = "lambda_handler"
    )]
    lambda_dir: Option<PathBuf>,

    /// With --lambda-handler or --exec-format lambda: the function's name in the context
    /// (`function_name`, `functionName`, the ARNs, the log group). Default: --app.
    #[arg(long, env = "SHARDWISE_LAMBDA_FUNCTION_NAME", value_name = "NAME")]
    lambda_function_name: Option<String>,

    /// With --exec or --lambda-handler: how many copies of the program run (default: --lanes).
    /// The deliveries of one lane of one shard always go to the same one, one (batch) at a time.
    #[arg(
        long,
        env = "SHARDWISE_EXEC_CHILDREN",
        value_name = "N",
        requires = "handler_program"
    )]
    exec_children: Option<usize>,

    /// With --exec: hand deliveries over in batches of up to N, one line per batch, answered
    /// with one outcome per delivery. With Lambda's format: the most records of an event
    /// (default 100).
    #[arg(
        long,
        env = "SHARDWISE_BATCH",
        value_name = "N",
        requires = "handler_program"
    )]
    batch: Option<usize>,

    /// With --batch (or Lambda's format): how long a lane waits after a batch's first delivery
    /// for more (default 50ms; with Lambda's format 0s, the event source mapping's default
    /// MaximumBatchingWindowInSeconds: a batch is what was read and is waiting).
    #[arg(long, env = "SHARDWISE_BATCH_WAIT", value_name = "DURATION", value_parser = humantime::parse_duration, requires = "handler_program")]
    batch_wait: Option<Duration>,

    /// With --exec and batches (Lambda's format, or --batch): a batch that fails as a whole (a
    /// Lambda function that raises; in shardwise's format, an answer with no outcomes) is handled
    /// again in halves, each failing half split again down to the record that fails, which alone
    /// takes the retry path; the halves that succeed settle (Lambda's BisectBatchOnFunctionError:
    /// a batch of N finds its poison record in log2(N) splits). Off by default, as in Lambda.
    #[arg(
        long,
        env = "SHARDWISE_BISECT_BATCH_ON_ERROR",
        requires = "handler_program"
    )]
    bisect_batch_on_error: bool,

    /// With Lambda's format (--lambda-handler, --exec-format lambda): Lambda's tumbling windows
    /// (TumblingWindowInSeconds) of DURATION, 1s to 15m, by the records' arrival time. The
    /// function gets `window`, `state` (what it returned last for the shard and window; `{}` at
    /// first), `shardId`, `eventSourceARN`, `isFinalInvokeForWindow` and
    /// `isWindowTerminatedEarly`, and must answer `state` (an answer without it fails the call);
    /// a final call without records ends each window. The state is kept in the lease table with
    /// the checkpoint. One lane per shard (--lanes 1), retries in place.
    #[arg(long, env = "SHARDWISE_TUMBLING_WINDOW", value_name = "DURATION", value_parser = humantime::parse_duration)]
    tumbling_window: Option<Duration>,

    /// How long one delivery (or batch) may take. The built-in handler's delivery then takes the
    /// retry path; with --exec the program is restarted and gets the delivery again (and after
    /// three restarts with it in flight, it takes the retry path). A Lambda handler's context
    /// counts its remaining time down from it (default there: 15m, Lambda's longest).
    #[arg(long, env = "SHARDWISE_HANDLER_TIMEOUT", value_name = "DURATION", value_parser = humantime::parse_duration)]
    handler_timeout: Option<Duration>,

    /// Records that arrived longer ago than this are not handled: they go to --dead-letter, or are
    /// dropped without one (counted in shardwise_records_expired_total), e.g. `1h`, `30m`.
    #[arg(long, env = "SHARDWISE_MAX_RECORD_AGE", value_name = "DURATION", value_parser = humantime::parse_duration)]
    max_record_age: Option<Duration>,

    /// Serve Prometheus metrics on `/metrics`, and `/healthz` and `/readyz`, at this address
    /// (`0.0.0.0:9100` for a kubelet's probes; `127.0.0.1:9100` for this host only).
    #[arg(long, env = "SHARDWISE_METRICS_ADDR", value_name = "ADDR")]
    metrics_addr: Option<SocketAddr>,

    /// Write the metrics as CloudWatch Embedded Metric Format, one JSON document per line on
    /// stderr every --metrics-emf-interval: the CloudWatch agent, Fluent Bit or Lambda-style log
    /// shipping turn them into CloudWatch metrics without an API call. KCL's names where one
    /// exists (MillisBehindLatest, RecordsProcessed, CurrentLeases, TakenLeases, LostLeases);
    /// dimensions: application (--app), then stream, shard, ...
    #[arg(long, env = "SHARDWISE_METRICS_EMF")]
    metrics_emf: bool,

    /// With --metrics-emf: the CloudWatch namespace.
    #[arg(
        long,
        env = "SHARDWISE_METRICS_EMF_NAMESPACE",
        value_name = "NAMESPACE",
        default_value = "shardwise",
        requires = "metrics_emf"
    )]
    metrics_emf_namespace: String,

    /// With --metrics-emf: how often documents are written, e.g. `60s` (CloudWatch's standard
    /// resolution is a minute).
    #[arg(long, env = "SHARDWISE_METRICS_EMF_INTERVAL", value_name = "DURATION", default_value = "60s", value_parser = humantime::parse_duration, requires = "metrics_emf")]
    metrics_emf_interval: Duration,

    /// A gauge not updated for this long is no longer reported (a shard's gauges are updated
    /// every checkpoint interval while this worker holds it), e.g. `30s`.
    #[arg(long, env = "SHARDWISE_METRICS_IDLE_TIMEOUT", value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    metrics_idle_timeout: Duration,

    /// The spellings in milliseconds of the duration flags, accepted for one release with a
    /// warning (`--lease-duration-ms 10000` is `--lease-duration 10s`).
    #[command(flatten)]
    deprecated: DeprecatedMillis,
}

/// `--exec-format`: the lines a handler program reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ExecFormat {
    Shardwise,
    Lambda,
}

fn parse_exec_format(s: &str) -> std::result::Result<ExecFormat, String> {
    match s {
        "shardwise" => Ok(ExecFormat::Shardwise),
        "lambda" => Ok(ExecFormat::Lambda),
        other => Err(format!("`{other}`: expected shardwise or lambda")),
    }
}

/// Lambda's default batch size for a Kinesis event source.
const LAMBDA_BATCH: usize = 100;

/// Lambda's default batching window for a Kinesis event source (MaximumBatchingWindowInSeconds).
const LAMBDA_BATCH_WINDOW: Duration = Duration::ZERO;

/// How long a lane waits for a batch of `--exec` deliveries to fill, unless `--batch-wait` says.
const BATCH_WAIT: Duration = Duration::from_millis(50);

/// `--help`'s heading for the built-in handler's flags, which only the demo and tests use.
const DEMO: &str = "Demo and test handler (without --exec)";

/// The duration flags' old spellings in milliseconds, hidden from `--help`: accepted for one
/// release, each with a warning naming its new spelling ([`Args::take_deprecated`]).
#[derive(Debug, Default, clap::Args)]
struct DeprecatedMillis {
    #[arg(long, value_name = "MS", hide = true, conflicts_with = "handler_delay")]
    handler_delay_ms: Option<u64>,
    #[arg(
        long,
        value_name = "MS",
        hide = true,
        conflicts_with = "lease_duration"
    )]
    lease_duration_ms: Option<u64>,
    #[arg(long, value_name = "MS", hide = true, conflicts_with = "scan_interval")]
    scan_interval_ms: Option<u64>,
    #[arg(
        long,
        value_name = "MS",
        hide = true,
        conflicts_with = "handoff_timeout"
    )]
    handoff_timeout_ms: Option<u64>,
    #[arg(
        long,
        value_name = "MS",
        hide = true,
        conflicts_with = "checkpoint_interval"
    )]
    checkpoint_interval_ms: Option<u64>,
    #[arg(long, value_name = "MS", hide = true, conflicts_with = "poll_interval")]
    poll_interval_ms: Option<u64>,
    #[arg(
        long,
        value_name = "MS",
        hide = true,
        conflicts_with = "shutdown_deadline"
    )]
    shutdown_deadline_ms: Option<u64>,
    #[arg(
        long,
        value_name = "MS",
        hide = true,
        conflicts_with = "caught_up_skew"
    )]
    caught_up_skew_ms: Option<u64>,
    #[arg(
        long,
        value_name = "MS",
        hide = true,
        conflicts_with = "hold_poll_interval"
    )]
    hold_poll_interval_ms: Option<u64>,
    #[arg(long, value_name = "MS", hide = true, conflicts_with = "batch_wait")]
    batch_wait_ms: Option<u64>,
    #[arg(
        long,
        value_name = "MS",
        hide = true,
        conflicts_with = "handler_timeout"
    )]
    handler_timeout_ms: Option<u64>,
}

/// A duration as the flags take it (`1s 500ms`).
fn duration(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

impl Args {
    /// Applies the old spellings in milliseconds given (`--lease-duration-ms`), and the warning
    /// for each: they are accepted for one release.
    fn take_deprecated(&mut self) -> Vec<String> {
        let old = std::mem::take(&mut self.deprecated);
        let mut warnings = Vec::new();
        let mut apply = |ms: Option<u64>, flag: &str, to: &mut Duration| {
            if let Some(ms) = ms {
                *to = Duration::from_millis(ms);
                warnings.push(format!(
                    "--{flag}-ms is deprecated and goes in the next release: use --{flag} {}",
                    duration(*to)
                ));
            }
        };
        apply(
            old.handler_delay_ms,
            "handler-delay",
            &mut self.handler_delay,
        );
        apply(
            old.lease_duration_ms,
            "lease-duration",
            &mut self.lease_duration,
        );
        apply(
            old.scan_interval_ms,
            "scan-interval",
            &mut self.scan_interval,
        );
        apply(
            old.handoff_timeout_ms,
            "handoff-timeout",
            &mut self.handoff_timeout,
        );
        apply(
            old.checkpoint_interval_ms,
            "checkpoint-interval",
            &mut self.checkpoint_interval,
        );
        apply(
            old.poll_interval_ms,
            "poll-interval",
            &mut self.poll_interval,
        );
        apply(
            old.shutdown_deadline_ms,
            "shutdown-deadline",
            &mut self.shutdown_deadline,
        );
        apply(
            old.hold_poll_interval_ms,
            "hold-poll-interval",
            &mut self.hold_poll_interval,
        );
        let mut optional = |ms: Option<u64>, flag: &str, to: &mut Option<Duration>| {
            let mut d = to.unwrap_or_default();
            apply(ms, flag, &mut d);
            if ms.is_some() {
                *to = Some(d);
            }
        };
        optional(
            old.caught_up_skew_ms,
            "caught-up-skew",
            &mut self.caught_up_skew,
        );
        optional(old.batch_wait_ms, "batch-wait", &mut self.batch_wait);
        optional(
            old.handler_timeout_ms,
            "handler-timeout",
            &mut self.handler_timeout,
        );
        warnings
    }

    /// `--filter-criteria`, read: the JSON itself when it starts with `{`, else the file it names.
    fn filter_criteria(&self) -> Result<Option<FilterCriteria>> {
        let Some(given) = &self.filter_criteria else {
            return Ok(None);
        };
        let text = if given.trim_start().starts_with('{') {
            given.clone()
        } else {
            std::fs::read_to_string(given)
                .with_context(|| format!("invalid --filter-criteria: cannot read {given}"))?
        };
        FilterCriteria::parse(&text)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("invalid --filter-criteria: {e}"))
    }

    /// The receipt table, when `--receipts` was given.
    fn receipt_table(&self) -> Option<String> {
        self.receipts.as_ref().map(|table| {
            if table.is_empty() {
                format!("{}-receipts", self.app)
            } else {
                table.clone()
            }
        })
    }

    /// What is consumed, for messages: the stream, or `log group G`.
    fn what(&self) -> String {
        match (&self.stream, &self.log_group) {
            (Some(stream), _) => format!("`{stream}`"),
            (None, Some(group)) => format!("log group `{group}`"),
            (None, None) => "nothing".into(),
        }
    }

    /// The paged source's name in the lease table, with --log-group.
    fn source_name(&self) -> Option<String> {
        self.log_group.as_ref().map(|group| {
            if self.by_timestamp {
                format!("logs-by-time:{group}")
            } else {
                format!("logs:{group}")
            }
        })
    }

    /// `--receipt-retention`, or by default 7 days, or the source's replay horizon if longer
    /// (a log group read by timestamp hands events out again for its close horizon and, by the
    /// audit, its lateness).
    fn receipt_retention(&self) -> Duration {
        self.receipt_retention.unwrap_or_else(|| {
            let horizon = self.by_timestamp.then(|| {
                self.close_horizon
                    .unwrap_or(shardwise::paged::FILTER_CLOSE_HORIZON)
                    + self.lateness.unwrap_or(shardwise::paged::FILTER_LATENESS)
            });
            shardwise::receipts::DEFAULT_RETENTION.max(horizon.unwrap_or_default())
        })
    }

    /// This worker's id: `--worker-id`, or the library's default.
    fn worker(&self) -> String {
        self.worker_id
            .clone()
            .unwrap_or_else(shardwise::consumer::default_worker_id)
    }

    /// The value the user typed for the flag that sets `err`'s setting; `None` when the flag was
    /// not given (see [`source_of`]).
    fn given(&self, err: &ConfigError) -> Option<String> {
        match err.field() {
            "stream" => self.stream.clone().or_else(|| self.source_name()),
            "application" => Some(self.app.clone()),
            "lease_table" => self.lease_table.clone(),
            "billing" | "tags" => self.table.given(err),
            "worker_id" => self.worker_id.clone(),
            "lanes" => Some(self.lanes.to_string()),
            "poll_interval" => Some(duration(self.poll_interval)),
            "checkpoint_interval" => Some(duration(self.checkpoint_interval)),
            "lease_duration" | "renew_interval" => Some(duration(self.lease_duration)),
            "scan_interval" => Some(duration(self.scan_interval)),
            "handoff_timeout" => Some(duration(self.handoff_timeout)),
            "dead_letter" => self.dead_letter.clone(),
            "retries" => Some(
                match self.retries {
                    RetryMode::Copy => "copy",
                    _ => "in-place",
                }
                .to_string(),
            ),
            "retry_stream" => self.retry_stream.clone(),
            "on_failure" => self.on_failure.as_ref().map(|o| match o {
                OnFailure::Sqs(url) => format!("sqs:{url}"),
                OnFailure::Sns(arn) => format!("sns:{arn}"),
                OnFailure::S3 { bucket, prefix } => format!("s3:{bucket}/{prefix}"),
            }),
            "on_spent" => self.on_spent.map(|_| "drop".to_string()),
            "max_attempts" => self.max_attempts.map(|n| n.to_string()),
            "receipt_retention" => self
                .receipt_retention
                .map(|d| humantime::format_duration(d).to_string()),
            "hold_poll_interval" => Some(duration(self.hold_poll_interval)),
            "handler_timeout" => self.handler_timeout.map(duration),
            "max_record_age" => self
                .max_record_age
                .map(|d| humantime::format_duration(d).to_string()),
            _ => None,
        }
    }
}

/// Where each library setting a [`ConfigError`] can name comes from on this command line.
fn source_of(setting: &str) -> Option<Source> {
    let flag = match setting {
        "stream" => "--stream",
        "application" => "--app",
        "lease_table" => "--lease-table",
        "billing" | "tags" => return TableFlags::source_of(setting),
        "worker_id" => "--worker-id",
        "lanes" => "--lanes",
        "poll_interval" => "--poll-interval",
        "checkpoint_interval" => "--checkpoint-interval",
        // The lease is renewed every third of its duration.
        "lease_duration" | "renew_interval" => "--lease-duration",
        "scan_interval" => "--scan-interval",
        "handoff_timeout" => "--handoff-timeout",
        "dead_letter" => "--dead-letter",
        "retries" => "--retries",
        "retry_stream" => "--retry-stream",
        "on_failure" => "--on-failure",
        "on_spent" => "--on-spent",
        "consumer_name" => "--consumer-name",
        "max_attempts" => "--max-attempts",
        "receipt_retention" => "--receipt-retention",
        "hold_poll_interval" => "--hold-poll-interval",
        "handler_timeout" => "--handler-timeout",
        "max_record_age" => "--max-record-age",
        "initial_position" => "--start",
        "region" => return Some(Source::Environment),
        _ => return None,
    };
    Some(Source::Flag(flag))
}

/// An on-failure destination as `--on-failure` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum OnFailure {
    Sqs(String),
    Sns(String),
    S3 { bucket: String, prefix: String },
}

fn parse_on_failure(s: &str) -> std::result::Result<OnFailure, String> {
    if let Some(url) = s.strip_prefix("sqs:") {
        if !url.starts_with("http://") && !url.starts_with("https://") {
            return Err(format!(
                "`{s}`: sqs: takes the queue's URL (https://sqs.REGION.amazonaws.com/ACCOUNT/QUEUE)"
            ));
        }
        return Ok(OnFailure::Sqs(url.to_string()));
    }
    if let Some(arn) = s.strip_prefix("sns:") {
        if !arn.starts_with("arn:") || arn.split(':').nth(2) != Some("sns") {
            return Err(format!(
                "`{s}`: sns: takes the topic's ARN (arn:aws:sns:REGION:ACCOUNT:TOPIC)"
            ));
        }
        return Ok(OnFailure::Sns(arn.to_string()));
    }
    if let Some(path) = s.strip_prefix("s3://").or_else(|| s.strip_prefix("s3:")) {
        let (bucket, prefix) = path.split_once('/').unwrap_or((path, ""));
        if bucket.len() < 3 || bucket.len() > 63 {
            return Err(format!(
                "`{s}`: s3: takes BUCKET/PREFIX, the bucket 3 to 63 characters"
            ));
        }
        return Ok(OnFailure::S3 {
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
        });
    }
    Err(format!(
        "`{s}`: expected sqs:QUEUE_URL, s3:BUCKET/PREFIX or sns:TOPIC_ARN"
    ))
}

impl OnFailure {
    /// The destination, with clients from `config` (S3 by path when an endpoint is configured,
    /// as emulators need).
    fn destination(&self, config: &SdkConfig) -> Arc<dyn Destination> {
        match self {
            OnFailure::Sqs(url) => Arc::new(SqsDestination::new(
                shardwise::aws_sdk_sqs::Client::new(config),
                url.clone(),
            )),
            OnFailure::Sns(arn) => Arc::new(SnsDestination::new(
                shardwise::aws_sdk_sns::Client::new(config),
                arn.clone(),
            )),
            OnFailure::S3 { bucket, prefix } => {
                let by_path = config.endpoint_url().is_some()
                    || std::env::var_os("AWS_ENDPOINT_URL_S3").is_some();
                let s3 = shardwise::aws_sdk_s3::config::Builder::from(config)
                    .force_path_style(by_path)
                    .build();
                Arc::new(S3Destination::new(
                    shardwise::aws_sdk_s3::Client::from_conf(s3),
                    bucket.clone(),
                    prefix.clone(),
                ))
            }
        }
    }
}

fn parse_retries(s: &str) -> std::result::Result<RetryMode, String> {
    match s {
        "copy" => Ok(RetryMode::Copy),
        "in-place" => Ok(RetryMode::InPlace),
        other => Err(format!("`{other}`: expected copy or in-place")),
    }
}

fn parse_on_spent(s: &str) -> std::result::Result<OnSpent, String> {
    match s {
        "drop" => Ok(OnSpent::Drop),
        other => Err(format!("`{other}`: expected drop")),
    }
}

fn parse_ordering(s: &str) -> std::result::Result<DeliveryOrder, String> {
    match s {
        "per-key" => Ok(DeliveryOrder::PerKey),
        "none" => Ok(DeliveryOrder::None),
        other => Err(format!("`{other}`: expected per-key or none")),
    }
}

fn parse_outcome(s: &str) -> std::result::Result<Outcome, String> {
    let expected =
        || format!("`{s}`: expected retry, retry-after:MS, drop, hold:REASON or quarantine:REASON");
    match s {
        "retry" => return Ok(Outcome::Retry),
        "drop" => return Ok(Outcome::Drop),
        _ => {}
    }
    let (name, argument) = s.split_once(':').ok_or_else(expected)?;
    match name {
        "retry-after" => {
            let ms: u64 = argument
                .parse()
                .map_err(|_| format!("`{argument}` is not a number of milliseconds"))?;
            Ok(Outcome::RetryAfter(Duration::from_millis(ms)))
        }
        "hold" => Ok(Outcome::Hold(argument.to_owned())),
        "quarantine" => Ok(Outcome::Quarantine(argument.to_owned())),
        _ => Err(expected()),
    }
}

fn outcome_name(o: &Outcome) -> String {
    match o {
        Outcome::RetryAfter(d) => format!("retry-after:{}", d.as_millis()),
        other => other.label().into(),
    }
}

/// The line printed for a handled delivery.
#[derive(Debug, Serialize)]
struct HandledLine<'a> {
    shard: &'a str,
    sequence: String,
    subsequence: u64,
    partition_key: &'a str,
    attempt: u32,
    worker: &'a str,
    lane: usize,
    outcome: String,
    arrived_ms: Option<u64>,
    /// With --cloudwatch-subscription: the log event's group, id and timestamp (its log stream
    /// is the partition key).
    #[serde(skip_serializing_if = "Option::is_none")]
    log_group: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    log_event_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    log_timestamp: Option<i64>,
    #[serde(flatten)]
    payload: Payload<'a>,
    /// With receipts: whether the delivery settled from an existing receipt (its effects were
    /// not applied again).
    #[serde(skip_serializing_if = "Option::is_none")]
    replay: Option<bool>,
}

/// The line printed for a handled event of a paged source (a log group).
#[derive(Debug, Serialize)]
struct EventLine<'a> {
    partition: &'a str,
    position: String,
    id: &'a str,
    timestamp: Option<u64>,
    attempt: u32,
    worker: &'a str,
    lane: usize,
    outcome: String,
    #[serde(flatten)]
    payload: Payload<'a>,
    /// With receipts: whether the event settled from an existing receipt.
    #[serde(skip_serializing_if = "Option::is_none")]
    replay: Option<bool>,
}

/// A payload: `data` when it is UTF-8, else `data_b64`.
#[derive(Debug, Serialize)]
enum Payload<'a> {
    #[serde(rename = "data")]
    Text(&'a str),
    #[serde(rename = "data_b64")]
    Base64(String),
}

/// The line printed to stderr at exit.
#[derive(Debug, Serialize)]
struct ShutdownLine<'a> {
    event: &'static str,
    worker: &'a str,
    handled: u64,
    shards_stopped: usize,
    leases_released: usize,
    deadline_passed: bool,
}

fn payload(d: &Delivery) -> Payload<'_> {
    match std::str::from_utf8(d.payload()) {
        Ok(text) => Payload::Text(text),
        Err(_) => Payload::Base64(base64::engine::general_purpose::STANDARD.encode(d.payload())),
    }
}

/// The JSON line of a handled delivery: a record's, or a paged event's.
fn json_line(d: &Delivery, worker: &str, outcome: String, replay: Option<bool>) -> Option<String> {
    let Some(position) = d.page_position() else {
        let mut line = line(d, worker, &Outcome::Ack);
        line.outcome = outcome;
        line.replay = replay;
        return serde_json::to_string(&line).ok();
    };
    let event = d.event_id();
    let prefix = format!("paged/{}/{}/", d.stream(), d.shard());
    let line = EventLine {
        partition: d.shard(),
        position: position.to_string(),
        id: event
            .as_str()
            .strip_prefix(&prefix)
            .unwrap_or(event.as_str()),
        timestamp: millis(d.arrived_at()),
        attempt: d.attempt(),
        worker,
        lane: d.lane(),
        outcome,
        payload: payload(d),
        replay,
    };
    serde_json::to_string(&line).ok()
}

fn millis(at: Option<SystemTime>) -> Option<u64> {
    at.and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
}

/// One JSON line for a handled record.
fn line<'a>(d: &'a Delivery, worker: &'a str, outcome: &Outcome) -> HandledLine<'a> {
    HandledLine {
        shard: d.shard(),
        sequence: d.sequence_number().to_string(),
        subsequence: d.sub_sequence(),
        partition_key: d.partition_key(),
        attempt: d.attempt(),
        worker,
        lane: d.lane(),
        outcome: outcome_name(outcome),
        arrived_ms: millis(d.arrived_at()),
        log_group: d.headers().get_str(subscription::LOG_GROUP_HEADER),
        log_event_id: d.headers().get_str(subscription::EVENT_ID_HEADER),
        log_timestamp: d
            .headers()
            .get_str(subscription::TIMESTAMP_HEADER)
            .and_then(|t| t.parse().ok()),
        payload: payload(d),
        replay: None,
    }
}

/// The outcome named on a line printed as a delivery settles (with receipts).
fn settled_name(how: &Settled) -> &'static str {
    match how {
        Settled::Acked => "ack",
        Settled::Dropped => "drop",
        Settled::Copied(_) => "retry",
        Settled::DeadLettered(_) => "dead-letter",
        Settled::Spent => "spent",
        Settled::Applied | Settled::Replayed => "apply",
        Settled::Quarantined => "quarantine",
        Settled::Resolved => "resolved",
        _ => "other",
    }
}

/// What the demonstration handler with `--count-into` answers: one counter increment per
/// record whose payload is JSON with an `id`, an ack otherwise.
fn count_effect(d: &Delivery, table: &str) -> Outcome {
    let id = serde_json::from_slice::<serde_json::Value>(d.payload())
        .ok()
        .and_then(|v| match v.get("id")? {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Null => None,
            other => Some(other.to_string()),
        });
    match id {
        Some(id) => Outcome::Apply(Effect::update(table, key("id", id)).add("count", 1).into()),
        None => Outcome::Ack,
    }
}

fn shutdown_line<'a>(worker: &'a str, handled: u64, report: &ShutdownReport) -> ShutdownLine<'a> {
    ShutdownLine {
        event: "shutdown",
        worker,
        handled,
        shards_stopped: report.shards_stopped,
        leases_released: report.leases_released,
        deadline_passed: report.deadline_passed,
    }
}

/// Builds the consumer, naming the flag of a setting it rejects.
fn build<H: Handler>(builder: ConsumerBuilder<H>, args: &Args) -> Result<Consumer<H>> {
    builder
        .build()
        .map_err(|err| invalid_setting(&err, args.given(&err), source_of))
}

/// How long the source `args` name keeps its events, for the ledger's default retention.
async fn source_retention(args: &Args, ctx: &Ctx) -> Result<SourceRetention> {
    let retention = match (&args.log_group, &args.stream) {
        (Some(group), _) => {
            let logs = aws_sdk_cloudwatchlogs::Client::new(ctx.config());
            CloudWatchLogs::new(logs, group.clone()).retention().await
        }
        (None, Some(stream)) => KinesisShards::new(ctx.kinesis()).retention(stream).await,
        (None, None) => Ok(SourceRetention::Unknown),
    };
    Ok(retention?)
}

/// The consumer `args` describe, not yet built.
fn builder<H: Handler>(args: &Args, handler: H, config: SdkConfig) -> ConsumerBuilder<H> {
    let stream = args.stream.clone().unwrap_or_default();
    builder_reading(args, &stream, handler, config)
}

/// [`builder`], reading the Kinesis `stream` (unless `args` name a log group).
fn builder_reading<H: Handler>(
    args: &Args,
    stream: &str,
    handler: H,
    config: SdkConfig,
) -> ConsumerBuilder<H> {
    let lease = LeaseSettings::default()
        .lease_duration(args.lease_duration)
        .scan_interval(args.scan_interval)
        .shard_sync_interval(args.shard_sync_interval)
        .handoff_timeout(args.handoff_timeout);
    let builder = match (&args.log_group, stream) {
        (Some(group), _) => {
            let logs = aws_sdk_cloudwatchlogs::Client::new(&config);
            let source: Arc<dyn PagedSource> = if args.by_timestamp {
                let mut filter = CloudWatchLogsFilter::new(logs, group.clone());
                if let Some(horizon) = args.close_horizon {
                    filter = filter.close_horizon(horizon);
                }
                if let Some(lateness) = args.lateness {
                    filter = filter.lateness(lateness);
                }
                if let Some(within) = args.readable_within {
                    filter = filter.readable_within(within);
                }
                Arc::new(filter)
            } else {
                let mut source = CloudWatchLogs::new(logs, group.clone());
                if let Some(within) = args.readable_within {
                    source = source.readable_within(within);
                }
                Arc::new(match args.retire_after {
                    Some(after) if after.is_zero() => source.retire_after(None),
                    Some(after) => source.retire_after(Some(after)),
                    None => source,
                })
            };
            Consumer::paged(source, args.app.clone(), handler)
        }
        (None, _) => Consumer::builder(stream, args.app.clone(), handler),
    };
    let destination = args.on_failure.as_ref().map(|o| o.destination(&config));
    let mut builder = builder
        .worker_id(args.worker())
        .lanes(args.lanes)
        .ordering(args.ordering)
        .lease_settings(lease)
        .lease_table_options(args.table.options())
        .initial_position(args.start)
        .checkpoint_interval(args.checkpoint_interval)
        .poll_interval(args.poll_interval)
        .hold_poll_interval(args.hold_poll_interval)
        .aws_config(config);
    if args.resume_past_expired_receipts {
        builder = builder.resume_past_expired_receipts();
    }
    if let Some(table) = &args.lease_table {
        builder = builder.lease_table(table.clone());
    }
    if let Some(n) = args.max_attempts {
        builder = builder.max_attempts(n);
    }
    if let Some(skew) = args.caught_up_skew {
        builder = builder.caught_up_frontier(skew);
    }
    if let Some(dl) = &args.dead_letter {
        builder = builder.dead_letter(dl.clone());
    }
    if let Some(destination) = destination {
        builder = builder.on_failure(destination);
    }
    builder = builder.retries(args.retries);
    if let Some(stream) = &args.retry_stream {
        builder = builder.retry_stream(stream.clone());
    }
    if args.cloudwatch_subscription {
        builder = builder.cloudwatch_subscription();
    }
    if args.efo {
        let mut fan_out = FanOut::new();
        if let Some(name) = &args.consumer_name {
            fan_out = fan_out.consumer_name(name.clone());
        }
        builder = builder.enhanced_fan_out(fan_out);
    }
    if let Some(what) = args.on_spent {
        builder = builder.on_spent(what);
    }
    // With --exec the timeout restarts the program instead (see `exec.rs`).
    if args.exec.is_none() {
        builder.set_handler_timeout(args.handler_timeout);
    }
    builder.set_max_record_age(args.max_record_age);
    builder
}

/// The flags of a log group, refused without `--log-group` (clap's `requires` lets them through
/// beside `--stream`).
fn log_group_only(args: &Args) -> Result<()> {
    if args.log_group.is_none() {
        for (flag, given, what) in [
            (
                "--retire-after",
                args.retire_after.is_some(),
                "a log group read stream by stream",
            ),
            (
                "--readable-within",
                args.readable_within.is_some(),
                "a log group",
            ),
        ] {
            if given {
                bail!("{flag} is for {what}: add --log-group");
            }
        }
    }
    Ok(())
}

pub(crate) async fn run(mut args: Args, ctx: &Ctx) -> Result<()> {
    for warning in args.take_deprecated() {
        tracing::warn!("{warning}");
    }
    if matches!(args.fail_outcome, Outcome::Hold(_) | Outcome::Quarantine(_))
        && args.receipts.is_none()
    {
        bail!(
            "--fail-outcome {}: holding or quarantining a record records a receipt; add --receipts",
            outcome_name(&args.fail_outcome)
        );
    }
    log_group_only(&args)?;
    let criteria = args.filter_criteria()?;
    if args.batch == Some(0) {
        bail!("invalid --batch 0: must be at least 1");
    }
    if args.exec_children == Some(0) {
        bail!("invalid --exec-children 0: must be at least 1");
    }
    if args.handler_timeout == Some(Duration::ZERO) {
        bail!("invalid --handler-timeout 0s: must be above zero");
    }
    // Installed first, so that every metric from the start is recorded.
    let metrics = crate::observe::install(crate::observe::Outputs {
        prometheus: args.metrics_addr.is_some(),
        emf: args.metrics_emf.then(|| {
            (
                args.metrics_emf_namespace.clone(),
                args.metrics_emf_interval,
                args.app.clone(),
            )
        }),
        gauge_idle: args.metrics_idle_timeout,
    })?;
    // One id for this process: the default is random, and every consumer and printed line of
    // the process names the same one.
    let worker = args.worker();
    args.worker_id = Some(worker.clone());
    let receipts = args.receipt_table();
    let printer = Printer {
        worker: worker.clone(),
        // With receipts a line is printed as each delivery settles (it says whether it was a
        // replay); without, as the handler finishes.
        print: !args.quiet && receipts.is_none(),
        handled: Arc::default(),
    };
    let lambda = args.lambda_handler.is_some() || args.exec_format == Some(ExecFormat::Lambda);
    if args.tumbling_window.is_some() && !lambda {
        bail!(
            "--tumbling-window runs a Lambda handler on windows: add --lambda-handler or --exec-format lambda"
        );
    }
    match exec_settings(&args, ctx, &worker).await? {
        Some(settings) => {
            let windows = args.tumbling_window.map(|width| {
                let batching = settings
                    .batching
                    .unwrap_or_else(|| Batching::new(LAMBDA_BATCH, LAMBDA_BATCH_WINDOW));
                (width, batching)
            });
            let exec = Exec::start(settings);
            let children = exec.clone();
            let (exec_ref, metrics) = (Some(&children), metrics.as_ref());
            let consumed = match windows {
                Some((width, batching)) => {
                    let windowed = Windowed::new(ExecWindows(exec), width, batching);
                    consume_printed(&args, ctx, windowed, criteria, printer, exec_ref, metrics)
                        .await
                }
                None => {
                    consume_printed(&args, ctx, exec, criteria, printer, exec_ref, metrics).await
                }
            };
            // Once the consumer has stopped (or could not start): SIGTERM, then the grace.
            children.stop().await;
            consumed
        }
        None => {
            let handler = demo_handler(&args);
            consume_printed(
                &args,
                ctx,
                handler,
                criteria,
                printer,
                None,
                metrics.as_ref(),
            )
            .await
        }
    }
}

/// [`consume`] with `inner` as the handler, each outcome printed and the filter criteria
/// applied in front of it.
async fn consume_printed<H: Handler + Clone>(
    args: &Args,
    ctx: &Ctx,
    inner: H,
    criteria: Option<FilterCriteria>,
    printer: Printer,
    exec: Option<&Exec>,
    metrics: Option<&Metrics>,
) -> Result<()> {
    let handler = Printing {
        inner,
        printer: printer.clone(),
    };
    let handler = Filtered::new(handler, criteria);
    consume(args, ctx, handler, printer, exec, metrics).await
}

/// The handler program `args` name, if any: `--exec`, or a Lambda handler's runner (checked
/// here: one that cannot load fails the start).
async fn exec_settings(args: &Args, ctx: &Ctx, worker: &str) -> Result<Option<ExecSettings>> {
    let lambda = args.lambda_handler.is_some() || args.exec_format == Some(ExecFormat::Lambda);
    if lambda && args.log_group.is_some() {
        bail!(
            "--exec-format lambda writes Lambda's Kinesis event: it reads a --stream, not a --log-group"
        );
    }
    let function = args
        .lambda_function_name
        .clone()
        .unwrap_or_else(|| args.app.clone());
    let source = if lambda {
        Some(Arc::new(event_source(args, ctx, &function).await))
    } else {
        None
    };
    let (command, env, dir) = match (&args.exec, &args.lambda_handler, &source) {
        (Some(command), _, _) => (command.clone(), Vec::new(), None),
        (None, Some(handler), Some(source)) => {
            let given = args
                .lambda_dir
                .clone()
                .unwrap_or_else(|| PathBuf::from("."));
            let dir = std::fs::canonicalize(&given)
                .with_context(|| format!("invalid --lambda-dir {}", given.display()))?;
            let runtime = match args.lambda_runtime {
                Some(runtime) => runtime,
                None => Runtime::infer(handler, &dir).map_err(anyhow::Error::msg)?,
            };
            let runner = Runner {
                runtime,
                handler: handler.clone(),
                function_name: function,
                function_arn: source.function_arn().to_string(),
                timeout: args.handler_timeout.unwrap_or(LAMBDA_MAX_TIMEOUT),
            };
            runner.check(&dir).await.map_err(|why| {
                anyhow::anyhow!(
                    "cannot load --lambda-handler {handler} from {}: {why}",
                    dir.display()
                )
            })?;
            (runner.command(), runner.env(), Some(dir))
        }
        _ => return Ok(None),
    };
    Ok(Some(ExecSettings {
        command,
        children: args.exec_children.unwrap_or(args.lanes),
        timeout: args.handler_timeout,
        batching: batching(args, lambda),
        worker: worker.to_string(),
        grace: STOP_GRACE,
        format: source.map_or(Format::Shardwise, Format::Lambda),
        env,
        dir,
    }))
}

/// How a handler program's deliveries are batched: as `--batch` and `--batch-wait` say, or with
/// Lambda's format as an event source mapping's defaults do (batches of up to 100, no batching
/// window); without either, one at a time.
fn batching(args: &Args, lambda: bool) -> Option<Batching> {
    let size = args.batch.or(lambda.then_some(LAMBDA_BATCH))?;
    let wait = args.batch_wait.unwrap_or(if lambda {
        LAMBDA_BATCH_WINDOW
    } else {
        BATCH_WAIT
    });
    Some(Batching::new(size, wait).bisect_on_failure(args.bisect_batch_on_error))
}

/// Where Lambda's event says its records come from: the stream's ARN as Kinesis gives it (or,
/// when it cannot be asked, one made of the configured region and the stream's name: the
/// consumer's start then says what is wrong with the stream).
async fn event_source(args: &Args, ctx: &Ctx, function: &str) -> EventSource {
    let stream = args.stream.clone().unwrap_or_default();
    let described = ctx
        .kinesis()
        .describe_stream_summary()
        .stream_name(&stream)
        .send()
        .await;
    let arn = match described {
        Ok(out) => out.stream_description_summary.map(|s| s.stream_arn),
        Err(e) => {
            tracing::debug!(stream = %stream, error = %e, "DescribeStreamSummary for the Lambda event's eventSourceARN");
            None
        }
    };
    let arn = arn.unwrap_or_else(|| {
        let region = ctx.config().region().map(ToString::to_string);
        format!(
            "arn:aws:kinesis:{}:000000000000:stream/{stream}",
            region.unwrap_or_default()
        )
    });
    EventSource::new(&arn, function)
}

/// The built-in demonstration handler: waits `--handler-delay`, answers `--fail-outcome`
/// for `--fail-keys`, counts into `--count-into`, acks the rest.
fn demo_handler(args: &Args) -> impl Handler + Clone + use<> {
    let delay = args.handler_delay;
    let fail_keys: Arc<Vec<String>> = Arc::new(args.fail_keys.clone());
    let fail_outcome = args.fail_outcome.clone();
    let count_into: Option<Arc<str>> = args.count_into.as_deref().map(Arc::from);
    move |d: Delivery| {
        let (fail_keys, fail_outcome, count_into) =
            (fail_keys.clone(), fail_outcome.clone(), count_into.clone());
        async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            if fail_keys.iter().any(|k| k == d.partition_key()) {
                fail_outcome
            } else if let Some(table) = &count_into {
                count_effect(&d, table)
            } else {
                Outcome::Ack
            }
        }
    }
}

/// Prints a line per handled delivery (unless printing as deliveries settle) and counts them.
#[derive(Debug, Clone)]
struct Printer {
    worker: String,
    print: bool,
    handled: Arc<AtomicU64>,
}

impl Printer {
    fn handled(&self, d: &Delivery, outcome: &Outcome) {
        self.handled.fetch_add(1, Ordering::Relaxed);
        if self.print
            && let Some(text) = json_line(d, &self.worker, outcome_name(outcome), None)
        {
            let _ = writeln!(std::io::stdout().lock(), "{text}");
        }
    }
}

/// A handler whose deliveries are printed as it finishes them.
#[derive(Clone)]
struct Printing<H> {
    inner: H,
    printer: Printer,
}

impl<H: Handler> Handler for Printing<H> {
    async fn handle(&self, delivery: Delivery) -> Outcome {
        let outcome = self.inner.handle(delivery.clone()).await;
        self.printer.handled(&delivery, &outcome);
        outcome
    }

    fn batching(&self) -> Option<Batching> {
        self.inner.batching()
    }

    async fn handle_batch(&self, batch: Vec<Delivery>) -> Vec<Outcome> {
        let outcomes = self.inner.handle_batch(batch.clone()).await;
        if outcomes.is_empty() {
            // The batch failed as a whole: each of its deliveries failed this call.
            for d in &batch {
                self.printer.handled(d, &Outcome::Retry);
            }
        }
        for (d, o) in batch.iter().zip(&outcomes) {
            self.printer.handled(d, o);
        }
        outcomes
    }

    fn window_slots(&self) -> Option<&Arc<WindowSlots>> {
        self.inner.window_slots()
    }

    fn close_window_if_over(
        &self,
        stream: &str,
        shard: &str,
        now_ms: i64,
    ) -> impl std::future::Future<Output = bool> + Send {
        self.inner.close_window_if_over(stream, shard, now_ms)
    }
}

/// Runs the consumer with `handler` until SIGTERM or SIGINT, then shuts it down gracefully.
/// With `--retry-stream`, a second consumer reads the retry stream with the same handler, in the
/// same application and lease table, and both stop together.
async fn consume<H: Handler + Clone>(
    args: &Args,
    ctx: &Ctx,
    handler: H,
    printer: Printer,
    exec: Option<&Exec>,
    metrics: Option<&Metrics>,
) -> Result<()> {
    let worker = printer.worker.clone();
    let ledger = match args.receipt_table() {
        Some(table) => Some(receipt_ledger(args, ctx, &table).await?),
        None => None,
    };
    let consumer = build(
        with_receipts(
            builder(args, handler.clone(), ctx.config().clone()),
            &ledger,
            args,
        ),
        args,
    )?;
    // Copies written to a retry stream are read here too: a copy nobody reads is never handled.
    let retry_stream = args
        .retry_stream
        .as_ref()
        .filter(|retry| Some(*retry) != args.stream.as_ref());
    let retry_consumer = match retry_stream {
        Some(stream) => {
            let reading = builder_reading(args, stream, handler, ctx.config().clone());
            Some(build(with_receipts(reading, &ledger, args), args)?)
        }
        None => None,
    };

    let stats = exec.map(|exec| exec.stats.clone());
    let endpoints = metrics.map(|metrics| crate::observe::endpoints(metrics, stats));
    if let (Some(addr), Some(endpoints)) = (args.metrics_addr, &endpoints) {
        endpoints
            .serve(addr)
            .await
            .with_context(|| format!("cannot listen on --metrics-addr {addr}"))?;
    }
    let mut term = signal(SignalKind::terminate()).context("installing a SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing a SIGINT handler")?;
    let started = |err| match err {
        shardwise::Error::Config(err) => invalid_setting(&err, args.given(&err), source_of),
        err => anyhow::Error::new(err).context(format!("cannot consume {}", args.what())),
    };
    let running = consumer.run().await.map_err(started)?;
    let retrying = match retry_consumer {
        Some(consumer) => Some(consumer.run().await.map_err(started)?),
        None => None,
    };
    if let Some(endpoints) = &endpoints {
        endpoints.watch(&running);
    }
    let mut fatal = running.fatal();
    let mut retry_fatal = retrying.as_ref().map(Running::fatal);
    tracing::info!(worker = %worker, "consuming; SIGTERM or SIGINT stops gracefully");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
        _ = fatal.wait_for(Option::is_some) => {}
        _ = async {
            match &mut retry_fatal {
                Some(fatal) => drop(fatal.wait_for(Option::is_some).await),
                None => std::future::pending().await,
            }
        } => {}
    }
    if let Some(exec) = exec {
        // Before anything else: a handler program may use the time left to finish cleanly.
        exec.notice_shutdown(args.shutdown_deadline);
    }
    let deadline = args.shutdown_deadline;
    let (mut report, retry_report) = tokio::join!(running.shutdown(deadline), async {
        match retrying {
            Some(retrying) => Some(retrying.shutdown(deadline).await),
            None => None,
        }
    });
    if let Some(retry_report) = retry_report {
        report.shards_stopped += retry_report.shards_stopped;
        report.leases_released += retry_report.leases_released;
        report.deadline_passed |= retry_report.deadline_passed;
        report.abandoned.extend(retry_report.abandoned);
    }
    if let Some(metrics) = metrics {
        // The last interval's EMF documents.
        metrics.flush_emf().context("writing the EMF metrics")?;
    }
    let handled = printer.handled.load(Ordering::Relaxed);
    eprintln!(
        "{}",
        serde_json::to_string(&shutdown_line(&worker, handled, &report))?
    );
    // A consumer stopped on its own (its stream was deleted): exit with why.
    let stopped_by = fatal.borrow().clone();
    if let Some(error) = stopped_by {
        return Err(
            anyhow::anyhow!("{error}").context(format!("stopped consuming {}", args.what()))
        );
    }
    let retry_stopped_by = retry_fatal.and_then(|fatal| fatal.borrow().clone());
    match (retry_stopped_by, retry_stream) {
        (Some(error), Some(stream)) => Err(anyhow::anyhow!("{error}")
            .context(format!("stopped consuming the retry stream `{stream}`"))),
        _ => Ok(()),
    }
}

/// The receipt ledger in `table`, kept as long as `args` says (or as the source keeps its
/// events), its tables made ready.
async fn receipt_ledger(args: &Args, ctx: &Ctx, table: &str) -> Result<Arc<DynamoDbReceipts>> {
    let ledger = DynamoDbReceipts::new(ctx.dynamodb(), table.to_string(), args.app.clone());
    let ledger = match (args.receipt_retention, source_retention(args, ctx).await?) {
        (Some(kept), _) => ledger.retention(kept),
        // Receipts outlive every replay the source can make: as long as it keeps events.
        (None, SourceRetention::For(keeps)) => {
            ledger.retention(args.receipt_retention().max(keeps))
        }
        // Receipts expire all the same; a stream whose progress is older than they are kept is
        // refused until an operator says how to go on.
        (None, SourceRetention::Forever) => {
            let kept = args.receipt_retention();
            eprintln!(
                "shardwise: the log group keeps its events for good; receipts are kept {:.1} days, and a stream whose progress is older than that (the fleet down that long, an event failing in place that long) is refused until you seek it or pass --resume-past-expired-receipts",
                kept.as_secs_f64() / 86_400.0
            );
            ledger.retention(kept)
        }
        (None, _) => ledger.retention(args.receipt_retention()),
    };
    ledger
        .prepare()
        .await
        .with_context(|| format!("cannot keep receipts in `{table}`"))?;
    if let Some(counts) = &args.count_into {
        ledger
            .ensure_effect_table(counts, "id")
            .await
            .with_context(|| format!("cannot count into `{counts}`"))?;
    }
    Ok(Arc::new(ledger))
}

/// `builder` with the receipt ledger, if any, and a line printed as each delivery settles.
fn with_receipts<H: Handler>(
    builder: ConsumerBuilder<H>,
    ledger: &Option<Arc<DynamoDbReceipts>>,
    args: &Args,
) -> ConsumerBuilder<H> {
    let Some(ledger) = ledger else {
        return builder;
    };
    let (worker, quiet) = (args.worker(), args.quiet);
    builder
        .receipts(ledger.clone())
        .delivery_hooks(move |d: &Delivery, how: &Settled| {
            if quiet {
                return;
            }
            let replay = Some(*how == Settled::Replayed);
            if let Some(text) = json_line(d, &worker, settled_name(how).to_string(), replay) {
                let _ = writeln!(std::io::stdout().lock(), "{text}");
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use shardwise::lease::{Billing, TableOptions};
    use shardwise::{Position, SequenceNumber};

    /// `consume`'s flags, a later one overriding an earlier one.
    #[derive(Debug, Parser)]
    #[command(args_override_self = true)]
    struct Command {
        #[command(flatten)]
        args: Args,
    }

    fn args(extra: &[&str]) -> Args {
        let argv = ["consume", "--stream", "orders", "--app", "billing"];
        Command::parse_from(argv.iter().chain(extra)).args
    }

    /// The message `consume` fails with for these flags, before calling AWS.
    fn rejection(extra: &[&str]) -> String {
        let args = args(extra);
        let handler = |_: Delivery| async { Outcome::Ack };
        let config = SdkConfig::builder().build();
        match build(builder(&args, handler, config), &args) {
            Ok(_) => panic!("{extra:?} accepted"),
            Err(err) => err.to_string(),
        }
    }

    /// Every flag can come from the environment, as `SHARDWISE_` and its name (the old
    /// millisecond spellings, hidden, cannot).
    #[test]
    fn every_flag_can_come_from_the_environment_under_its_own_name() {
        let command = <Command as clap::CommandFactory>::command();
        let mut checked = 0;
        for arg in command.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if arg.is_hide_set() || long == "help" {
                assert!(arg.get_env().is_none(), "--{long}");
                continue;
            }
            let want = format!("SHARDWISE_{}", long.to_uppercase().replace('-', "_"));
            assert_eq!(
                arg.get_env().and_then(|e| e.to_str()),
                Some(want.as_str()),
                "--{long}"
            );
            checked += 1;
        }
        assert!(checked >= 45, "{checked} flags");
    }

    #[test]
    fn filter_criteria_are_read_from_json_or_a_file_and_a_malformed_one_says_where() {
        let json = r#"{"Filters":[{"Pattern":"{\"data\":{\"kind\":[\"order\"]}}"}]}"#;
        let criteria = args(&["--filter-criteria", json])
            .filter_criteria()
            .unwrap();
        let criteria = criteria.expect("criteria");
        assert!(criteria.matches_data(br#"{"kind":"order"}"#));
        assert!(!criteria.matches_data(br#"{"kind":"quote"}"#));
        let dir = std::env::temp_dir().join(format!("filter-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("criteria.json");
        std::fs::write(&file, json).unwrap();
        let from_file = args(&["--filter-criteria", file.to_str().unwrap()])
            .filter_criteria()
            .unwrap();
        assert_eq!(from_file, Some(criteria));
        assert_eq!(args(&[]).filter_criteria().unwrap(), None);
        let missing = args(&["--filter-criteria", "/nonexistent/criteria.json"])
            .filter_criteria()
            .unwrap_err();
        assert_eq!(
            missing.to_string(),
            "invalid --filter-criteria: cannot read /nonexistent/criteria.json"
        );
        let bad = r#"{"Filters":[{"Pattern":"{\"data\":{\"kind\":[{\"prefx\":\"o\"}]}}"}]}"#;
        let refused = args(&["--filter-criteria", bad])
            .filter_criteria()
            .unwrap_err();
        assert_eq!(
            refused.to_string(),
            "invalid --filter-criteria: Filters[0].Pattern: data.kind[0].prefx: unknown operator \"prefx\" (Lambda's: equals-ignore-case, prefix, suffix, anything-but, numeric, exists)"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn readable_within_is_a_duration_of_the_log_group_read_either_way() {
        let parse = |extra: &[&str]| {
            let argv = ["consume", "--log-group", "/app/orders", "--app", "billing"];
            Command::try_parse_from(argv.iter().chain(extra)).map(|c| c.args)
        };
        let parsed = parse(&["--readable-within", "5m"]).unwrap();
        assert_eq!(parsed.readable_within, Some(Duration::from_secs(300)));
        assert_eq!(parse(&[]).unwrap().readable_within, None);
        assert!(parse(&["--readable-within", "soon"]).is_err());
        // Read by timestamp too (searchable within it).
        let by_time = parse(&["--by-timestamp", "--readable-within", "20m"]).unwrap();
        assert_eq!(by_time.readable_within, Some(Duration::from_secs(1200)));
        assert!(log_group_only(&parsed).is_ok());
        for (flag, what) in [
            ("--readable-within", "a log group"),
            ("--retire-after", "a log group read stream by stream"),
        ] {
            let refused = log_group_only(&args(&[flag, "5m"])).unwrap_err();
            assert_eq!(
                refused.to_string(),
                format!("{flag} is for {what}: add --log-group")
            );
        }
    }

    #[test]
    fn a_lambda_handler_or_the_lambda_format_is_one_handler_program() {
        let parse = |extra: &[&str]| {
            let argv = ["consume", "--stream", "orders", "--app", "billing"];
            Command::try_parse_from(argv.iter().chain(extra)).map(|c| c.args)
        };
        let args = parse(&[
            "--lambda-handler",
            "app.handler",
            "--lambda-runtime",
            "nodejs20.x",
            "--batch",
            "10",
            "--exec-children",
            "2",
            "--batch-wait",
            "20ms",
        ])
        .unwrap();
        assert_eq!(args.lambda_runtime, Some(Runtime::Node));
        assert_eq!((args.batch, args.exec_children), (Some(10), Some(2)));
        let args = parse(&["--exec", "python3 h.py", "--exec-format", "lambda"]).unwrap();
        assert_eq!(args.exec_format, Some(ExecFormat::Lambda));
        for rejected in [
            // One handler program at a time.
            &["--exec", "python3 h.py", "--lambda-handler", "app.handler"][..],
            // The format is --exec's (a Lambda handler's runner speaks Lambda's).
            &["--exec-format", "lambda"],
            &["--lambda-runtime", "python"],
            &["--lambda-dir", "fn"],
            &["--batch", "10"],
            &["--batch-wait", "10ms"],
            &[
                "--lambda-handler",
                "app.handler",
                "--lambda-runtime",
                "java21",
            ],
            &["--exec", "x", "--exec-format", "kcl"],
            &["--lambda-handler", "app.handler", "--fail-keys", "k"],
        ] {
            assert!(parse(rejected).is_err(), "{rejected:?} accepted");
        }
    }

    /// A Lambda handler gets the event source mapping's defaults: batches of up to 100 with no
    /// batching window, and retries in place without a cap or an age limit (until the record
    /// succeeds: Lambda's MaximumRetryAttempts and MaximumRecordAgeInSeconds of -1), bisect off.
    #[test]
    fn lambdas_handlers_get_the_event_source_mappings_defaults() {
        for lambda in [
            &["--lambda-handler", "app.handler"][..],
            &["--exec", "python3 h.py", "--exec-format", "lambda"],
        ] {
            let args = args(lambda);
            let batching = batching(&args, true).expect("batches");
            assert_eq!(
                (batching.max_size, batching.max_wait, batching.bisect),
                (100, Duration::ZERO, false),
                "{lambda:?}"
            );
            assert_eq!(args.retries, RetryMode::InPlace, "{lambda:?}");
            assert_eq!(
                (args.max_attempts, args.max_record_age, args.dead_letter),
                (None, None, None)
            );
        }
        // --exec in its own format: one at a time unless --batch; then a 50 ms window.
        let own = args(&["--exec", "python3 h.py"]);
        assert_eq!(batching(&own, false), None);
        let batched = args(&["--exec", "python3 h.py", "--batch", "10"]);
        let b = batching(&batched, false).expect("batches");
        assert_eq!((b.max_size, b.max_wait), (10, Duration::from_millis(50)));
        // Either can be set.
        let set = args(&[
            "--lambda-handler",
            "app.handler",
            "--batch",
            "10",
            "--batch-wait",
            "1s",
        ]);
        let b = batching(&set, true).expect("batches");
        assert_eq!((b.max_size, b.max_wait), (10, Duration::from_secs(1)));
    }

    #[test]
    fn the_old_millisecond_spellings_set_the_durations_with_a_warning_each() {
        let mut args = args(&["--lease-duration-ms", "1500", "--handler-timeout-ms", "250"]);
        let warnings = args.take_deprecated();
        assert_eq!(args.lease_duration, Duration::from_millis(1500));
        assert_eq!(args.handler_timeout, Some(Duration::from_millis(250)));
        assert_eq!(args.scan_interval, Duration::from_secs(2), "untouched");
        assert_eq!(
            warnings,
            [
                "--lease-duration-ms is deprecated and goes in the next release: use --lease-duration 1s 500ms",
                "--handler-timeout-ms is deprecated and goes in the next release: use --handler-timeout 250ms",
            ]
        );
    }

    #[test]
    fn a_rejected_setting_names_the_flag_and_the_value_given() {
        let cases: &[(&[&str], &str)] = &[
            (
                &["--stream", "no spaces"],
                r#"invalid --stream "no spaces": must be 1 to 128 characters of [a-zA-Z0-9_.-]"#,
            ),
            // The application names the table unless --lease-table does (named as the flag).
            (
                &["--app", "ab"],
                "invalid --app ab: names the DynamoDB lease table: 3 to 255 characters of \
                 [a-zA-Z0-9_.-] (or name the table with --lease-table)",
            ),
            (
                &["--lease-table", "a/b"],
                "invalid --lease-table a/b: a DynamoDB table name: 3 to 255 characters of \
                 [a-zA-Z0-9_.-]",
            ),
            (
                &["--billing-mode", "provisioned:0,5"],
                "invalid --billing-mode provisioned:0,5: provisioned read and write capacity \
                 must each be at least 1",
            ),
            // The tag whose key is refused, among others.
            (
                &["--tag", "team=billing", "--tag", "aws:owner=me"],
                "invalid --tag aws:owner=me: a tag key is 1 to 128 characters and does not start \
                 with `aws:`",
            ),
            (
                &["--worker-id", ""],
                r#"invalid --worker-id "": must be 1 to 256 characters"#,
            ),
            (&["--lanes", "0"], "invalid --lanes 0: must be 1 to 1024"),
            (
                &["--lanes", "1025"],
                "invalid --lanes 1025: must be 1 to 1024",
            ),
            (
                &["--poll-interval", "10ms"],
                "invalid --poll-interval 10ms: must be at least 200ms (Kinesis allows 5 \
                 GetRecords calls per second per shard)",
            ),
            (
                &["--checkpoint-interval", "0ms"],
                "invalid --checkpoint-interval 0s: must be above zero",
            ),
            // The other setting in the reason is named as its flag too.
            (
                &["--checkpoint-interval", "10000ms"],
                "invalid --checkpoint-interval 10s: must be shorter than \
                 --lease-duration (10s)",
            ),
            (
                &["--lease-duration", "50ms", "--checkpoint-interval", "10ms"],
                "invalid --lease-duration 50ms: must be at least 100ms",
            ),
            (
                &["--scan-interval", "0ms"],
                "invalid --scan-interval 0s: must be above zero",
            ),
            (
                &["--dead-letter", "orders"],
                "invalid --dead-letter orders: must not be the stream being consumed",
            ),
            (
                &["--handler-timeout", "0ms"],
                "invalid --handler-timeout 0s: must be above zero",
            ),
            (
                &["--max-record-age", "10ms"],
                "invalid --max-record-age 10ms: must be at least 1s (arrival times are whole \
                 milliseconds from another clock)",
            ),
            // Retries run in place by default: a cap alone has nowhere to send a spent record.
            (
                &["--max-attempts", "3"],
                "invalid --max-attempts 3: with retries in place, --max-attempts ends a record's \
                 attempts, and a spent record needs somewhere to go: set --dead-letter (a \
                 dead-letter stream), --on-failure (a queue or bucket) or a receipt ledger \
                 (receipts: it is then quarantined), or say with --on-spent that it may be \
                 dropped; without any, leave it unset and a failing record runs again until it \
                 succeeds (or is older than --max-record-age, which drops it)",
            ),
            // Copies need a bound, so that no retry is refused record by record.
            (
                &["--retries", "copy"],
                "invalid --retries copy: copy mode writes counted copies only under a declared \
                 bound: set --max-attempts (a cap on attempts) or --dead-letter (a dead-letter \
                 stream, or --on-failure: a queue or bucket), or retry in place (the default), \
                 where a failing record runs again until it succeeds",
            ),
            (
                &["--retry-stream", "orders-retries"],
                "invalid --retry-stream orders-retries: a retry stream takes retry copies, and \
                 retries run in place (the default): choose copy mode for retries too, or leave \
                 --retry-stream unset",
            ),
            (
                &[
                    "--retries",
                    "copy",
                    "--dead-letter",
                    "orders-dlq",
                    "--retry-stream",
                    "orders-dlq",
                ],
                "invalid --retry-stream orders-dlq: must not be the dead-letter stream: spent \
                 records would be read again as retries",
            ),
            (
                &["--dead-letter", "dead letters"],
                r#"invalid --dead-letter "dead letters": must be a stream name: 1 to 128 characters of [a-zA-Z0-9_.-]"#,
            ),
        ];
        for (extra, expected) in cases {
            assert_eq!(rejection(extra), *expected, "{extra:?}");
        }
    }

    #[test]
    fn on_failure_names_a_queue_url_or_a_bucket_and_prefix() {
        let url = "https://sqs.eu-west-1.amazonaws.com/123456789012/spent";
        assert_eq!(
            parse_on_failure(&format!("sqs:{url}")),
            Ok(OnFailure::Sqs(url.into()))
        );
        for (given, bucket, prefix) in [
            ("s3:spent-records/failed/", "spent-records", "failed/"),
            ("s3://spent-records/failed/", "spent-records", "failed/"),
            ("s3:spent-records", "spent-records", ""),
        ] {
            assert_eq!(
                parse_on_failure(given),
                Ok(OnFailure::S3 {
                    bucket: bucket.into(),
                    prefix: prefix.into()
                }),
                "{given}"
            );
        }
        let topic = "arn:aws:sns:eu-west-1:123456789012:spent";
        assert_eq!(
            parse_on_failure(&format!("sns:{topic}")),
            Ok(OnFailure::Sns(topic.into()))
        );
        for bad in [
            "sqs:spent",
            "s3:ab/x",
            "kinesis:spent",
            "spent",
            "sns:spent",
            "sns:arn:aws:sqs:eu-west-1:123456789012:spent",
        ] {
            assert!(parse_on_failure(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn settings_no_flag_reaches_are_named_by_what_sets_them() {
        let args = args(&["--lease-duration", "900ms", "--max-attempts", "3"]);
        let cases = [
            // Renewals follow --lease-duration.
            (
                ConfigError::new("renew_interval", Duration::ZERO, "must be above zero"),
                "invalid --lease-duration 900ms: must be above zero",
            ),
            (
                ConfigError::new("max_attempts", 3, "must be at most 2"),
                "invalid --max-attempts 3: must be at most 2",
            ),
            // A region comes from the environment: the library's words name the variable.
            (
                ConfigError::new(
                    "region",
                    "none",
                    "no AWS region is configured: set AWS_REGION (or the region of an AWS_PROFILE)",
                ),
                "no AWS region is configured: set AWS_REGION (or the region of an AWS_PROFILE)",
            ),
            // No flag sets it: the library's message as it is.
            (
                ConfigError::new("max_in_flight", 0, "must be at least 1"),
                "invalid `max_in_flight` = 0: must be at least 1",
            ),
        ];
        for (err, expected) in cases {
            let message = invalid_setting(&err, args.given(&err), source_of).to_string();
            assert_eq!(message, expected);
        }
    }

    #[test]
    fn lease_table_flags_become_table_options() {
        assert_eq!(args(&[]).table.options(), TableOptions::default());
        let args = args(&[
            "--lease-table",
            "billing-leases",
            "--billing-mode",
            "provisioned:7,3",
            "--tag",
            "team=billing",
            "--point-in-time-recovery",
        ]);
        assert_eq!(args.lease_table.as_deref(), Some("billing-leases"));
        assert_eq!(
            args.table.options(),
            TableOptions::default()
                .billing(Billing::Provisioned { read: 7, write: 3 })
                .tag("team", "billing")
                .point_in_time_recovery(true)
        );
    }

    #[test]
    fn lines_keep_their_fields_and_order() {
        let sequence =
            SequenceNumber::parse("49590338271490256608559692538361571095921575989136588898")
                .unwrap();
        let text = Delivery::builder("s", "shardId-000000000001", Position::new(sequence, 3))
            .partition_key("key-1")
            .payload("{\"id\":7}")
            .arrived_at(SystemTime::UNIX_EPOCH + Duration::from_millis(1_764_452_220_123))
            .attempt(2)
            .lane(3)
            .build();
        let outcome = Outcome::RetryAfter(Duration::from_millis(250));
        assert_eq!(
            serde_json::to_string(&line(&text, "w-1", &outcome)).unwrap(),
            r#"{"shard":"shardId-000000000001","sequence":"49590338271490256608559692538361571095921575989136588898","subsequence":3,"partition_key":"key-1","attempt":2,"worker":"w-1","lane":3,"outcome":"retry-after:250","arrived_ms":1764452220123,"data":"{\"id\":7}"}"#
        );
        let sequence = SequenceNumber::parse("1").unwrap();
        let binary = Delivery::builder("s", "shardId-000000000000", Position::new(sequence, 0))
            .partition_key("k\"q")
            .payload(vec![0xffu8, 0, 1])
            .build();
        assert_eq!(
            serde_json::to_string(&line(&binary, "w", &Outcome::Ack)).unwrap(),
            r#"{"shard":"shardId-000000000000","sequence":"1","subsequence":0,"partition_key":"k\"q","attempt":1,"worker":"w","lane":0,"outcome":"ack","arrived_ms":null,"data_b64":"/wAB"}"#
        );
        let mut report = ShutdownReport::default();
        report.shards_stopped = 2;
        report.leases_released = 1;
        assert_eq!(
            serde_json::to_string(&shutdown_line("w-1", 42, &report)).unwrap(),
            r#"{"event":"shutdown","worker":"w-1","handled":42,"shards_stopped":2,"leases_released":1,"deadline_passed":false}"#
        );
    }

    #[test]
    fn fail_outcomes_parse_as_typed_and_name_what_is_expected() {
        let cases = [
            ("retry", Outcome::Retry),
            ("drop", Outcome::Drop),
            (
                "retry-after:250",
                Outcome::RetryAfter(Duration::from_millis(250)),
            ),
            (
                "hold:check the price",
                Outcome::Hold("check the price".into()),
            ),
            (
                "quarantine:bad:json",
                Outcome::Quarantine("bad:json".into()),
            ),
        ];
        for (text, outcome) in cases {
            assert_eq!(parse_outcome(text).unwrap(), outcome, "{text}");
        }
        for text in ["ack", "hold", "retry-after:soon", "later:5"] {
            let err = parse_outcome(text).unwrap_err();
            assert!(
                err.contains(&format!("`{text}`")) || err.contains("milliseconds"),
                "{err}"
            );
        }
        assert!(parse_outcome("ack").unwrap_err().contains("hold:REASON"));
    }
}
