//! The consumer: leases, shard readers, lanes, checkpoints, and shutdown.

mod checkpointer;
mod config;
mod copies;
mod ending;
mod health;
mod hooks;
mod lanes;
mod ledger;
mod outcome;
mod owned;
mod partition;
mod pipeline;
mod shard;
mod timestamps;

use std::collections::HashMap;
use std::fmt;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_config::{BehaviorVersion, SdkConfig};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

#[allow(deprecated)]
pub use config::Ordering;
pub use config::{
    DEFAULT_LATEST_MARGIN, DeliveryOrder, OnSpent, RetryMode, Settings, Unproven, default_worker_id,
};
pub use copies::StuckWrite;
pub use health::{Health, HealthLimits, RetryingEvent, ShardHealth};
pub use hooks::{DeliveryHooks, Settled};

use crate::destination::Destination;
use crate::error::{ConfigError, Error};
use crate::frontier::Frontier;
use crate::handler::Handler;
use crate::lease::{
    DynamoDbLeaseStore, HeldLease, InitialPosition, LeaseEvent, LeaseHooks, LeaseManager,
    LeaseSettings, LeaseStore, Ownership, TableOptions,
};
use crate::paged::{PagedSource, PartitionLister};
use crate::producer::{KinesisSink, Producer, RecordSink, Unavailable};
use crate::receipts::ReceiptStore;
use crate::retry::RetryPolicy;
use crate::seek::{SeekReport, SeekTarget};
use crate::shard::discovery::{KinesisShards, ShardLister};
use crate::shard::fanout::FanOutRecords;
use crate::shard::source::{KinesisRecords, RecordSource};
use copies::StuckWrites;
use owned::{Exit, OwnedContext, run_owned};
use partition::Pages;
use pipeline::PipelineContext;
use shard::{Shard, Shards};
use timestamps::{Attempt, Timestamped};

/// Builds a [`Consumer`]; every setting is checked by [`build`](Self::build).
#[must_use]
pub struct ConsumerBuilder<H> {
    handler: H,
    settings: Settings,
    sdk: Option<SdkConfig>,
    store: Option<Arc<dyn LeaseStore>>,
    source: Option<Arc<dyn RecordSource>>,
    lister: Option<Arc<dyn ShardLister>>,
    sink: Option<Arc<dyn RecordSink>>,
    hooks: Option<Arc<dyn LeaseHooks>>,
    delivery_hooks: Option<Arc<dyn DeliveryHooks>>,
    receipts: Option<Arc<dyn ReceiptStore>>,
    destination: Option<Arc<dyn Destination>>,
    seek: Option<SeekTarget>,
    reads: Reads,
}

/// What a consumer reads: chosen once, when it is built.
#[derive(Clone)]
enum Reads {
    /// The shards of a Kinesis stream.
    Stream,
    /// The partitions of a paged source.
    Pages(Arc<dyn PagedSource>),
}

impl fmt::Debug for Reads {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reads::Stream => f.write_str("Stream"),
            Reads::Pages(source) => f.debug_tuple("Pages").field(&source.name()).finish(),
        }
    }
}

impl Reads {
    /// What a spent delivery becomes when no dead-letter stream takes it.
    fn spent(&self, ledger: bool, settings: &Settings) -> crate::retry::Spent {
        use crate::retry::Spent;
        match (self, ledger) {
            (Reads::Stream, _) if settings.retries == RetryMode::Copy => Spent::Drop,
            // In place, a record is dropped where the application said so: with on_spent, or,
            // without a cap on attempts, by max_record_age alone (Lambda discards a record older
            // than MaximumRecordAgeInSeconds when it has no on-failure destination). With a
            // ledger it is quarantined by receipt, as a paged event is. The build refuses a cap
            // with none of these: holding it is the last guard.
            (Reads::Stream, ledger) => match (settings.on_spent, ledger) {
                (Some(OnSpent::Drop), _) => Spent::Drop,
                (None, true) => Spent::Quarantine,
                (None, false) if settings.max_attempts.is_none() => Spent::Drop,
                (None, false) => Spent::Hold,
            },
            (Reads::Pages(_), true) => Spent::Quarantine,
            (Reads::Pages(_), false) => Spent::Hold,
        }
    }

    /// Whether a failing delivery runs again where it is (always, for a paged source).
    fn in_place(&self, settings: &Settings) -> bool {
        matches!(self, Reads::Pages(_)) || settings.retries == RetryMode::InPlace
    }

    /// Moves the checkpoints `target` names.
    async fn seek(
        &self,
        store: &dyn LeaseStore,
        lister: &dyn ShardLister,
        stream: &str,
        target: &SeekTarget,
    ) -> Result<SeekReport, Error> {
        match self {
            Reads::Stream => crate::seek::seek(store, lister, stream, target).await,
            Reads::Pages(source) => crate::seek::seek_paged(store, source.as_ref(), target).await,
        }
    }
}

impl<H> fmt::Debug for ConsumerBuilder<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl<H: Handler> ConsumerBuilder<H> {
    /// This worker's id in the lease table (default: host name, process id and a random part).
    pub fn worker_id(mut self, id: impl Into<String>) -> Self {
        self.settings.worker_id = id.into();
        self
    }

    /// Lanes per shard (default 1).
    pub fn lanes(mut self, n: usize) -> Self {
        self.settings.lanes = n;
        self
    }

    /// Ordering between lanes (default: per partition key).
    pub fn ordering(mut self, ordering: DeliveryOrder) -> Self {
        self.settings.ordering = ordering;
        self
    }

    /// Deliveries held per shard at most before the reader pauses (default 10,000).
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.settings.max_in_flight = n;
        self
    }

    /// The stream is a CloudWatch Logs subscription filter's destination: each log event of a
    /// record is one delivery (sub-sequence `i` for the `i`-th; the message as payload; the log
    /// stream as partition key; headers naming the group, stream, event id and timestamp), a
    /// control message none. See [`subscription`](crate::subscription).
    #[cfg(feature = "cloudwatch-logs")]
    pub fn cloudwatch_subscription(mut self) -> Self {
        self.settings.reader.cloudwatch_subscription = true;
        self
    }

    /// Records per GetRecords call (default 10,000).
    pub fn get_records_limit(mut self, n: i32) -> Self {
        self.settings.reader.limit = n;
        self
    }

    /// Wait between polls once caught up (default 1 s, at least 200 ms).
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.settings.reader.poll_interval = d;
        self
    }

    /// The longest wait between tries of a read that was throttled or failed (default 5 s): the
    /// waits double from 100 ms, with jitter, up to it. A longer bound spends less of a quota
    /// shared by the fleet while throttling lasts.
    pub fn max_backoff(mut self, d: Duration) -> Self {
        self.settings.reader.max_backoff = d;
        self
    }

    /// Paged sources: the longest wait between fetches of a partition that stays idle (default
    /// 30 s). The wait starts at the poll interval and doubles with each page in a row that
    /// brings nothing; the first event sets it back.
    pub fn idle_poll_interval(mut self, d: Duration) -> Self {
        self.settings.reader.idle_poll_max = d;
        self
    }

    /// Where shards new to this application start (default: trim horizon).
    ///
    /// A LATEST start is pinned by the shard's first owner, before it reads anything, to the
    /// arrival time (the service's now - [`latest_margin`](Self::latest_margin)); every later owner reads from
    /// there. So every record that arrives after a worker began reading is delivered, even if that
    /// worker dies before its first checkpoint.
    pub fn initial_position(mut self, p: InitialPosition) -> Self {
        self.settings.lease.initial_position = p;
        self
    }

    /// What to do with a source read by timestamp whose contracts cannot prove a timestamp group
    /// complete (default [`Unproven::Refuse`]: `build` fails and says why).
    pub fn unproven(mut self, unproven: Unproven) -> Self {
        self.settings.unproven = unproven;
        self
    }

    /// How far before the stream service's time a LATEST start is pinned (default
    /// [`DEFAULT_LATEST_MARGIN`], 5 s): the allowance between the time its answers carry and its
    /// records' arrival timestamps (or, for a source whose answers carry no date, this host's clock
    /// running ahead of them). Records that arrived within it before the start are delivered too.
    pub fn latest_margin(mut self, margin: Duration) -> Self {
        self.settings.latest_margin = margin;
        self
    }

    /// Least time between two checkpoint writes of one shard (default 1 s).
    pub fn checkpoint_interval(mut self, d: Duration) -> Self {
        self.settings.checkpoint_interval = d;
        self
    }

    /// Lease timing and balancing (the initial position set here is kept).
    pub fn lease_settings(mut self, lease: LeaseSettings) -> Self {
        let initial = self.settings.lease.initial_position;
        self.settings.lease = lease.initial_position(initial);
        self
    }

    /// Attempts a record gets, counting the first delivery. Retried in place (the default), a
    /// record whose attempts are spent goes to the dead-letter stream or the
    /// [`on_failure`](Self::on_failure) destination, with [`receipts`](Self::receipts) gets a
    /// `quarantined` receipt, or is dropped where [`on_spent`](Self::on_spent) says so; with none
    /// of these the build is refused (nothing could take the record). With
    /// [`RetryMode::Copy`], `retry()` writes a counted copy until the attempts are spent.
    ///
    /// A paged source runs a failing event again in place, without a cap unless this is set;
    /// with it, a spent event goes to the dead-letter stream, else gets a `quarantined` receipt,
    /// and a consumer with neither is refused at build (nothing could record the event).
    pub fn max_attempts(mut self, n: NonZeroU32) -> Self {
        self.settings.max_attempts = Some(n);
        self
    }

    /// Where a Kinesis record whose handler asks for a retry (or panics, or runs past
    /// [`handler_timeout`](Self::handler_timeout)) runs again: on its lane, in order with its key
    /// ([`RetryMode::InPlace`], the default, as Lambda's Kinesis trigger and KCL applications
    /// retry), or as a counted copy at the tip of the stream ([`RetryMode::Copy`]). A paged
    /// source always retries in place.
    ///
    /// In place, a failing record runs again after a back-off that doubles from 100 ms to at most
    /// 5 s, with jitter (`RetryAfter(d)`: after `d`), until it succeeds, or until `max_attempts` or
    /// `max_record_age` is reached; then it goes to the dead-letter stream or the
    /// [`on_failure`](Self::on_failure) destination, with [`receipts`](Self::receipts) gets a
    /// `quarantined` receipt, or is dropped where [`on_spent`](Self::on_spent) says so (a bound
    /// with none of these is refused at build). Without a bound it runs again until it succeeds,
    /// and [`Running::health`] names it. Only its key waits: other keys go on, and the shard's
    /// checkpoint holds behind it.
    ///
    /// Copies need a bound: [`RetryMode::Copy`] without `max_attempts` and without a dead-letter
    /// stream ([`dead_letter`](Self::dead_letter) or [`on_failure`](Self::on_failure)) is refused
    /// at build, since a plain `retry()` could then never be written. Copies go to the stream
    /// read, where every other consumer of it reads them too, unless
    /// [`retry_stream`](Self::retry_stream) names another.
    pub fn retries(mut self, mode: RetryMode) -> Self {
        self.settings.retries = mode;
        self
    }

    /// With [`RetryMode::Copy`]: write retry copies to `stream` instead of the stream read, so
    /// other consumers of that stream (another application, Firehose) never see them. Read
    /// `stream` with a consumer of its own, with the same handler and application and this same
    /// `retry_stream` (its copies then stay in it), as `shardwise consume --retry-stream` does:
    /// a copy nobody reads is never handled. Refused at build without copy mode, or when it is
    /// the dead-letter stream.
    pub fn retry_stream(mut self, stream: impl Into<String>) -> Self {
        self.settings.retry_stream = Some(stream.into());
        self
    }

    /// Reads with enhanced fan-out: each shard's records are pushed to this application's own
    /// registered stream consumer (`SubscribeToShard`, 2 MB/s per shard of its own, ~70 ms from
    /// put to read) instead of polled with GetRecords (5 calls/s and 2 MB/s per shard shared by
    /// every polling reader). The consumer is registered (or found) at [`run`](Consumer::run),
    /// named after the application unless [`FanOut::consumer_name`](crate::shard::fanout::FanOut::consumer_name)
    /// says otherwise, and tagged with the application; a consumer of that name that belongs to
    /// another application is reported ([`Error::ConsumerInUse`]), never taken over. It is never
    /// deregistered by shardwise (`shardwise stream deregister-consumer` does it). Everything
    /// else is as with polling: checkpoints, lanes, retries, KPL, splits and merges, seek.
    pub fn enhanced_fan_out(mut self, fan_out: crate::shard::fanout::FanOut) -> Self {
        self.settings.fan_out = Some(fan_out);
        self
    }

    /// What becomes of a record retried in place whose attempts are spent when no dead-letter
    /// stream takes it: [`OnSpent::Drop`] drops it. Not for paged sources (a paged event is never
    /// dropped).
    pub fn on_spent(mut self, what: OnSpent) -> Self {
        self.settings.on_spent = Some(what);
        self
    }

    /// The stream spent records go to (with their payload, every header, and the reason). Without
    /// `max_attempts`, attempts are capped at 3 on Kinesis; a paged source still runs a failing
    /// event again until it succeeds unless `max_attempts` is set, and its dead letters also name
    /// the event's identity, position and timestamp.
    pub fn dead_letter(mut self, stream: impl Into<String>) -> Self {
        self.settings.dead_letter = Some(stream.into());
        self
    }

    /// Where spent records go instead of a dead-letter stream: an SQS queue
    /// ([`SqsDestination`](crate::destination::SqsDestination), feature `sqs`) or an S3 bucket
    /// ([`S3Destination`](crate::destination::S3Destination), feature `s3`), each record with its
    /// payload and where it came from (see [`crate::destination`]). Written before the record
    /// settles, checked at [`run`](Consumer::run); a consumer has one destination, this or
    /// [`dead_letter`](Self::dead_letter).
    pub fn on_failure(mut self, destination: Arc<dyn Destination>) -> Self {
        self.destination = Some(destination);
        self
    }

    /// Lets an idle shard whose last read came back empty at the tip advance its frontier
    /// coordinate to (now - `skew`), written at most once per `frontier_interval` (default 5 s).
    /// Without it an idle shard holds the frontier and writes nothing.
    pub fn caught_up_frontier(mut self, skew: Duration) -> Self {
        self.settings.caught_up_skew = Some(skew);
        self
    }

    /// Least time between two frontier-only writes of an idle shard.
    pub fn frontier_interval(mut self, d: Duration) -> Self {
        self.settings.frontier_interval = d;
        self
    }

    /// Lambda's event filtering ([`FilterCriteria`](crate::filter::FilterCriteria), as an event
    /// source mapping takes it): a record whose data no pattern matches is acknowledged without
    /// reaching the handler and counted in `shardwise_records_filtered_total`; it settles, so
    /// the checkpoint moves past it. The same for a paged source's events (their payload).
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), Box<dyn std::error::Error>> {
    /// use shardwise::filter::FilterCriteria;
    /// use shardwise::{Consumer, Delivery, Outcome};
    ///
    /// let orders = FilterCriteria::parse(
    ///     r#"{"Filters":[{"Pattern":"{\"data\":{\"kind\":[\"order\"]}}"}]}"#,
    /// )?;
    /// let consumer = Consumer::builder("orders", "billing", |_d: Delivery| async { Outcome::Ack })
    ///     .filter(orders)
    ///     .build()?;
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "filter")]
    pub fn filter(
        self,
        criteria: crate::filter::FilterCriteria,
    ) -> ConsumerBuilder<crate::filter::Filtered<H>> {
        ConsumerBuilder {
            handler: crate::filter::Filtered::new(self.handler, Some(criteria)),
            settings: self.settings,
            sdk: self.sdk,
            store: self.store,
            source: self.source,
            lister: self.lister,
            sink: self.sink,
            hooks: self.hooks,
            delivery_hooks: self.delivery_hooks,
            receipts: self.receipts,
            destination: self.destination,
            seek: self.seek,
            reads: self.reads,
        }
    }

    /// How long one delivery (or one batch, for a [`Batched`](crate::Batched) handler) may run:
    /// past it the handler is dropped and the delivery takes the retry path, as if it had
    /// answered [`Outcome::Retry`](crate::Outcome::Retry) (a counted copy, a dead letter once
    /// the attempts are spent; without `max_attempts` or a dead-letter stream the retry is
    /// refused and the record holds the checkpoint; a paged event runs again in place). Counted in
    /// `shardwise_handler_timeouts_total`. Default: no limit. A paged consumer with it needs a
    /// receipt ledger or a dead-letter stream.
    pub fn handler_timeout(mut self, timeout: Duration) -> Self {
        self.settings.handler_timeout = Some(timeout);
        self
    }

    /// Sets or clears the [`handler_timeout`](Self::handler_timeout).
    pub fn set_handler_timeout(&mut self, timeout: Option<Duration>) -> &mut Self {
        self.settings.handler_timeout = timeout;
        self
    }

    /// Records that arrived longer ago than `age` (by their arrival timestamp) are not handed to
    /// the handler: they go to the dead-letter stream when there is one, else they are dropped
    /// with a warning, and either way counted in `shardwise_records_expired_total` (Lambda's
    /// `MaximumRecordAgeInSeconds`). Default: no limit. At least 1 s. A paged event never
    /// settles as a drop: it goes to the dead-letter stream, else gets a `quarantined` receipt,
    /// and a paged consumer with neither is refused at build.
    pub fn max_record_age(mut self, age: Duration) -> Self {
        self.settings.max_record_age = Some(age);
        self
    }

    /// Sets or clears the [`max_record_age`](Self::max_record_age).
    pub fn set_max_record_age(&mut self, age: Option<Duration>) -> &mut Self {
        self.settings.max_record_age = age;
        self
    }

    /// The AWS configuration to build clients from (default: the standard environment).
    pub fn aws_config(mut self, config: SdkConfig) -> Self {
        self.sdk = Some(config);
        self
    }

    /// The DynamoDB lease table's name (default: the application's name). Several applications
    /// can then share a naming scheme of their own, e.g. `billing-orders-leases`.
    pub fn lease_table(mut self, table: impl Into<String>) -> Self {
        self.settings.lease_table = Some(table.into());
        self
    }

    /// How the lease table is created when it does not exist: billing mode (on-demand by
    /// default, or provisioned capacity), tags, point-in-time recovery.
    ///
    /// ```no_run
    /// use shardwise::lease::{Billing, TableOptions};
    /// # fn f<H: shardwise::Handler>(b: shardwise::ConsumerBuilder<H>) -> shardwise::ConsumerBuilder<H> {
    /// b.lease_table_options(
    ///     TableOptions::default()
    ///         .billing(Billing::Provisioned { read: 10, write: 10 })
    ///         .tag("team", "billing")
    ///         .point_in_time_recovery(true),
    /// )
    /// # }
    /// ```
    pub fn lease_table_options(mut self, options: TableOptions) -> Self {
        self.settings.lease_table_options = options;
        self
    }

    /// A lease store other than the DynamoDB table named after the application.
    pub fn lease_store(mut self, store: Arc<dyn LeaseStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// A record source other than Kinesis (tests, simulations).
    pub fn record_source(mut self, source: Arc<dyn RecordSource>) -> Self {
        self.source = Some(source);
        self
    }

    /// A shard lister other than Kinesis ListShards (tests, simulations).
    pub fn shard_lister(mut self, lister: Arc<dyn ShardLister>) -> Self {
        self.lister = Some(lister);
        self
    }

    /// Reads `stream` and keeps leases in `store`, both in memory: for tests (feature `testing`).
    /// The same as [`record_source`](Self::record_source) and
    /// [`shard_lister`](Self::shard_lister) with `stream` and [`lease_store`](Self::lease_store)
    /// with `store`. Retry copies and dead letters still go to Kinesis unless
    /// [`record_sink`](Self::record_sink) sends them elsewhere.
    #[cfg(feature = "testing")]
    pub fn in_memory(
        self,
        stream: &crate::testing::MemoryStream,
        store: &crate::lease::MemoryLeaseStore,
    ) -> Self {
        self.record_source(Arc::new(stream.clone()))
            .shard_lister(Arc::new(stream.clone()))
            .lease_store(Arc::new(store.clone()))
    }

    /// Where retry copies and dead letters are written, other than Kinesis (tests, simulations).
    pub fn record_sink(mut self, sink: Arc<dyn RecordSink>) -> Self {
        self.sink = Some(sink);
        self
    }

    /// Moves the checkpoints to `target` when the consumer starts (before any lease is taken).
    pub fn seek_on_start(mut self, target: SeekTarget) -> Self {
        self.seek = Some(target);
        self
    }

    /// Lease lifecycle hooks.
    pub fn hooks(mut self, hooks: Arc<dyn LeaseHooks>) -> Self {
        self.hooks = Some(hooks);
        self
    }

    /// Told how each delivery settled (acked, copied, applied, replayed, ...).
    pub fn delivery_hooks(mut self, hooks: impl DeliveryHooks) -> Self {
        self.delivery_hooks = Some(Arc::new(hooks));
        self
    }

    /// A receipt ledger: handlers may then answer [`Outcome::Apply`](crate::Outcome::Apply)
    /// (effects committed exactly once, with the event's receipt),
    /// [`Outcome::Quarantine`](crate::Outcome::Quarantine) and
    /// [`Outcome::Hold`](crate::Outcome::Hold). Prepared (its table created) at `run()`.
    ///
    /// ```no_run
    /// use std::sync::Arc;
    /// use shardwise::receipts::{key, DynamoDbReceipts, Effect};
    /// use shardwise::{Consumer, Delivery, Outcome};
    /// # async fn run(client: aws_sdk_dynamodb::Client) -> Result<(), shardwise::Error> {
    /// let receipts = DynamoDbReceipts::new(client, "billing-receipts", "billing");
    /// let consumer = Consumer::builder("orders", "billing", |d: Delivery| async move {
    ///     let order = String::from_utf8_lossy(d.payload()).to_string();
    ///     Outcome::Apply(Effect::update("order-counts", key("order", order)).add("seen", 1).into())
    /// })
    /// .receipts(Arc::new(receipts))
    /// .build()?;
    /// # let _ = consumer; Ok(()) }
    /// ```
    pub fn receipts(mut self, store: Arc<dyn ReceiptStore>) -> Self {
        self.receipts = Some(store);
        self
    }

    /// How often held deliveries' receipts are read (default 5 s).
    pub fn hold_poll_interval(mut self, every: Duration) -> Self {
        self.settings.hold_poll_interval = every;
        self
    }

    /// Reads on a paged partition whose durable progress is older than the receipt ledger keeps
    /// receipts (less an hour for clocks), handling again the events whose receipts may be
    /// gone: their effects may be applied a second time. Without it such a partition is refused
    /// (`shardwise_paged_expired_receipts_total`, an error naming it), for an operator to choose:
    /// this, or a seek of the partition. Only sources that keep events for good and bound what a
    /// replay needs ([`PagedSource::receipts_needed_since`])
    /// run with a ledger that deletes receipts; with any other, the ledger keeps receipts at
    /// least as long as the source keeps events, and no partition is refused.
    pub fn resume_past_expired_receipts(mut self) -> Self {
        self.settings.resume_past_expired_receipts = true;
        self
    }

    /// The checks of a Kinesis consumer's settings, besides [`Settings::validate`]: with retries
    /// in place, a bound on attempts needs somewhere for a spent record to go.
    fn check_stream(&self) -> Result<(), ConfigError> {
        let set = &self.settings;
        set.validate()?;
        self.check_destination()?;
        if let Some(windows) = self.handler.window_slots() {
            let width = windows.width();
            if width > crate::window::MAX_WIDTH || width < Duration::from_secs(1) {
                return Err(ConfigError::new(
                    "tumbling_window",
                    width,
                    "a tumbling window is 1 second to 15 minutes wide, as Lambda's TumblingWindowInSeconds",
                ));
            }
            if set.lanes != 1 {
                return Err(ConfigError::new(
                    "lanes",
                    set.lanes,
                    "tumbling windows run one lane per shard, so a shard's calls come in order with its state (Lambda refuses a ParallelizationFactor above 1 with a window)",
                ));
            }
            if set.retries != RetryMode::InPlace {
                return Err(ConfigError::new(
                    "retries",
                    "Copy",
                    "tumbling windows retry a failed record in place, as Lambda does: a copy would come back in a later window",
                ));
            }
            if set.ordering != DeliveryOrder::PerKey {
                return Err(ConfigError::new(
                    "ordering",
                    set.ordering,
                    "tumbling windows keep a shard's order (a failed record holds every later one), which per-key ordering on one lane gives",
                ));
            }
            if let Some(attempts) = set.max_attempts {
                windows.bound_final_calls(attempts);
            }
        }
        if let Some(fan_out) = &set.fan_out {
            if self.source.is_some() {
                return Err(ConfigError::new(
                    "enhanced_fan_out",
                    fan_out,
                    "enhanced fan-out reads Kinesis: it cannot be combined with record_source",
                ));
            }
            fan_out.validate(&set.application)?;
        }
        if let Some(retry) = &set.retry_stream
            && set.retries != RetryMode::Copy
        {
            return Err(ConfigError::new(
                "retry_stream",
                retry,
                "a retry stream takes retry copies, and retries run in place (the default): choose copy mode for retries too, or leave retry_stream unset",
            ));
        }
        if set.retries == RetryMode::Copy
            && set.max_attempts.is_none()
            && set.dead_letter.is_none()
            && self.destination.is_none()
        {
            // Seed 002's rule refuses a plain retry() copy without a declaration, per record:
            // the record would hold its shard's checkpoint until a restart. Refused here instead.
            return Err(ConfigError::new(
                "retries",
                "Copy",
                "copy mode writes counted copies only under a declared bound: set max_attempts (a cap on attempts) or dead_letter (a dead-letter stream, or on_failure: a queue or bucket), or retry in place (the default), where a failing record runs again until it succeeds",
            ));
        }
        if set.retries == RetryMode::InPlace
            && let Some(n) = set.max_attempts
            && set.dead_letter.is_none()
            && self.destination.is_none()
            && self.receipts.is_none()
            && set.on_spent.is_none()
        {
            return Err(ConfigError::new(
                "max_attempts",
                n,
                "with retries in place, max_attempts ends a record's attempts, and a spent record needs somewhere to go: set dead_letter (a dead-letter stream), on_failure (a queue or bucket) or a receipt ledger (receipts: it is then quarantined), or say with on_spent that it may be dropped; without any, leave it unset and a failing record runs again until it succeeds (or is older than max_record_age, which drops it)",
            ));
        }
        Ok(())
    }

    /// One on-failure destination at most: a dead-letter stream or another.
    fn check_destination(&self) -> Result<(), ConfigError> {
        if let (Some(destination), Some(stream)) = (&self.destination, &self.settings.dead_letter) {
            return Err(ConfigError::new(
                "on_failure",
                destination.name(),
                format!(
                    "a consumer has one on-failure destination, and dead_letter names the stream `{stream}` too: keep one"
                ),
            ));
        }
        Ok(())
    }

    /// The checks of a paged consumer's settings, besides [`Settings::validate_paged`].
    fn check_paged(&self, source: &dyn PagedSource) -> Result<(), ConfigError> {
        self.settings.validate_paged()?;
        self.check_destination()?;
        if self.settings.reader.cloudwatch_subscription {
            return Err(ConfigError::new(
                "cloudwatch_subscription",
                true,
                "a paged source reads its events itself; subscription documents come on a Kinesis stream",
            ));
        }
        if self.handler.window_slots().is_some() {
            return Err(ConfigError::new(
                "tumbling_window",
                source.name(),
                "tumbling windows cut a Kinesis shard's records by their arrival time; a paged source has no shards to carry a window's state",
            ));
        }
        if self.settings.fan_out.is_some() {
            return Err(ConfigError::new(
                "enhanced_fan_out",
                &self.settings.fan_out,
                "enhanced fan-out reads Kinesis shards, not a paged source",
            ));
        }
        if self.settings.retries == RetryMode::Copy {
            return Err(ConfigError::new(
                "retries",
                "Copy",
                "a paged source runs a failing event again in place: it has no stream to copy to",
            ));
        }
        if let Some(retry) = &self.settings.retry_stream {
            return Err(ConfigError::new(
                "retry_stream",
                retry,
                "a paged source runs a failing event again in place: it writes no retry copies",
            ));
        }
        if let Some(what) = self.settings.on_spent {
            return Err(ConfigError::new(
                "on_spent",
                format_args!("{what:?}"),
                "a paged event is never dropped: a spent one goes to the dead-letter stream or gets a quarantined receipt",
            ));
        }
        if self.settings.dead_letter.is_none()
            && self.destination.is_none()
            && self.receipts.is_none()
        {
            // Seed 003, rule 1: an event whose attempts end must get a durable terminal outcome,
            // and with neither a ledger nor a dead-letter stream nothing could record one.
            let set = &self.settings;
            let spending: Vec<(&'static str, String)> = [
                ("max_attempts", set.max_attempts.map(|n| format!("{n:?}"))),
                (
                    "handler_timeout",
                    set.handler_timeout.map(|d| format!("{d:?}")),
                ),
                (
                    "max_record_age",
                    set.max_record_age.map(|d| format!("{d:?}")),
                ),
            ]
            .into_iter()
            .filter_map(|(field, value)| Some((field, value?)))
            .collect();
            if let Some((field, value)) = spending.first() {
                let fields: Vec<&str> = spending.iter().map(|(f, _)| *f).collect();
                return Err(ConfigError::new(
                    field,
                    format_args!("{value}"),
                    format!(
                        "on a paged source, {} can end an event's attempts, and a spent event needs a durable terminal outcome: also set dead_letter (a dead-letter stream) or a receipt ledger (receipts: the event is then quarantined); without either, leave them unset and a failing event runs again in place until it succeeds",
                        fields.join(", ")
                    ),
                ));
            }
        }
        if let Some(receipts) = &self.receipts
            && let (Some(horizon), Some(retention)) =
                (source.contract().replay_horizon(), receipts.retention())
            && retention < horizon
        {
            // A receipt deleted while its event can still be handed out again lets the replay
            // apply the event's effects a second time.
            return Err(ConfigError::new(
                "receipt_retention",
                retention,
                format!(
                    "source `{}` can hand an event out again up to {} s ({:.2} days) after it was handled (its lateness bound and the audit window), so its receipts must be kept at least that long",
                    source.name(),
                    horizon.as_secs(),
                    horizon.as_secs_f64() / 86_400.0
                ),
            ));
        }
        if self.settings.lease.initial_position != InitialPosition::TrimHorizon {
            return Err(ConfigError::new(
                "initial_position",
                self.settings.lease.initial_position,
                "a paged source's partitions start at their first page (seek to move them)",
            ));
        }
        if let Some(contracts) = source.contract().timestamps
            && !contracts.can_close()
        {
            match self.settings.unproven {
                Unproven::Refuse => {
                    return Err(ConfigError::new(
                        "unproven",
                        "Refuse",
                        format!(
                            "source `{}` is read by timestamp with traversal {:?} and finality {:?}: no timestamp group can be proven complete, so shardwise cannot checkpoint it without risking a skip; choose Unproven::Replay to read it anyway (nothing is closed, every poll reads the open groups again, receipts make the replays harmless)",
                            source.name(),
                            contracts.traversal,
                            contracts.finality
                        ),
                    ));
                }
                Unproven::Replay => tracing::warn!(
                    source = source.name(),
                    traversal = ?contracts.traversal,
                    finality = ?contracts.finality,
                    "the source cannot prove a timestamp group complete: nothing will be closed, and every poll reads every open group again"
                ),
            }
        }
        Ok(())
    }

    /// Checks every setting; the error names the field and the value.
    pub fn build(self) -> Result<Consumer<H>, ConfigError> {
        match &self.reads {
            Reads::Stream => self.check_stream()?,
            Reads::Pages(source) => self.check_paged(source.as_ref())?,
        }
        Ok(Consumer {
            handler: Arc::new(self.handler),
            settings: Arc::new(self.settings),
            sdk: self.sdk,
            store: self.store,
            source: self.source,
            lister: self.lister,
            sink: self.sink,
            hooks: self.hooks.unwrap_or_else(|| Arc::new(())),
            delivery_hooks: self.delivery_hooks.unwrap_or_else(|| Arc::new(())),
            receipts: self.receipts,
            destination: self.destination,
            seek: self.seek,
            reads: self.reads,
        })
    }
}

/// Consumes one stream for one application; see [`Consumer::builder`].
pub struct Consumer<H> {
    handler: Arc<H>,
    settings: Arc<Settings>,
    sdk: Option<SdkConfig>,
    store: Option<Arc<dyn LeaseStore>>,
    source: Option<Arc<dyn RecordSource>>,
    lister: Option<Arc<dyn ShardLister>>,
    sink: Option<Arc<dyn RecordSink>>,
    hooks: Arc<dyn LeaseHooks>,
    delivery_hooks: Arc<dyn DeliveryHooks>,
    receipts: Option<Arc<dyn ReceiptStore>>,
    destination: Option<Arc<dyn Destination>>,
    seek: Option<SeekTarget>,
    reads: Reads,
}

impl<H> fmt::Debug for Consumer<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Consumer<()> {
    /// Starts building a consumer of `stream` for `application` (which names the lease table).
    ///
    /// ```no_run
    /// use shardwise::{Consumer, Delivery, Outcome};
    /// # async fn run() -> Result<(), shardwise::Error> {
    /// let consumer = Consumer::builder("orders", "billing", |d: Delivery| async move {
    ///     println!("{}", String::from_utf8_lossy(d.payload()));
    ///     Outcome::Ack
    /// })
    /// .lanes(8)
    /// .build()?;
    /// let running = consumer.run().await?;
    /// tokio::signal::ctrl_c().await.ok();
    /// running.shutdown(std::time::Duration::from_secs(10)).await;
    /// # Ok(()) }
    /// ```
    pub fn builder<H: Handler>(
        stream: impl Into<String>,
        application: impl Into<String>,
        handler: H,
    ) -> ConsumerBuilder<H> {
        ConsumerBuilder {
            handler,
            settings: Settings::new(stream.into(), application.into()),
            sdk: None,
            store: None,
            source: None,
            lister: None,
            sink: None,
            hooks: None,
            delivery_hooks: None,
            receipts: None,
            destination: None,
            seek: None,
            reads: Reads::Stream,
        }
    }

    /// Starts building a consumer of a paged source (see [`crate::paged`]) for `application`:
    /// each partition is leased, read page by page from its durable cursor, and checkpointed by
    /// the page barrier of `docs/paged.md`. The lease rows carry the source's
    /// [`name`](PagedSource::name) as their stream. A retry runs the event again on its lane
    /// (there is no stream to copy it to), up to `max_attempts` (3 by default).
    ///
    /// ```no_run
    /// # async fn run(source: std::sync::Arc<dyn shardwise::paged::PagedSource>) -> Result<(), shardwise::Error> {
    /// use shardwise::{Consumer, Delivery, Outcome};
    /// let consumer = Consumer::paged(source, "audit", |d: Delivery| async move {
    ///     println!("{} {}", d.page_position().unwrap(), String::from_utf8_lossy(d.payload()));
    ///     Outcome::Ack
    /// })
    /// .build()?;
    /// let running = consumer.run().await?;
    /// # running.shutdown(std::time::Duration::from_secs(10)).await; Ok(()) }
    /// ```
    pub fn paged<H: Handler>(
        source: Arc<dyn PagedSource>,
        application: impl Into<String>,
        handler: H,
    ) -> ConsumerBuilder<H> {
        let mut builder = Self::builder(source.name().to_string(), application, handler);
        builder.reads = Reads::Pages(source);
        builder
    }
}

impl<H: Handler> Consumer<H> {
    /// The validated settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Starts consuming: checks the stream exists and the lease table is usable (creating it if
    /// missing), then takes leases and reads. Returns once started; the work runs in background
    /// tasks until [`Running::shutdown`].
    pub async fn run(self) -> Result<Running, Error> {
        let reads = self.reads.clone();
        let stream = matches!(reads, Reads::Stream);
        // A paged consumer reads no Kinesis stream, and writes to one only with a dead-letter
        // stream.
        let reads_stream = stream && (self.source.is_none() || self.lister.is_none());
        let needs_sdk = self.store.is_none()
            || reads_stream
            || (self.sink.is_none() && (stream || self.settings.dead_letter.is_some()));
        let sdk = match (self.sdk, needs_sdk) {
            (Some(c), _) => Some(c),
            (None, true) => Some(aws_config::defaults(BehaviorVersion::latest()).load().await),
            (None, false) => None,
        };
        // The store, source and lister are needed at once; a Kinesis sink without a region fails at
        // its first write, as a stuck write naming the cause.
        if (self.store.is_none() || reads_stream)
            && let Some(config) = &sdk
            && config.region().is_none()
        {
            return Err(ConfigError::new(
                "region",
                "none",
                "no AWS region is configured: set AWS_REGION (or the region of an AWS_PROFILE)",
            )
            .into());
        }
        let kinesis = sdk.as_ref().map(aws_sdk_kinesis::Client::new);
        let store = match self.store {
            Some(s) => s,
            None => Arc::new(
                DynamoDbLeaseStore::new(
                    aws_sdk_dynamodb::Client::new(sdk.as_ref().expect("sdk loaded")),
                    self.settings.lease_table(),
                )
                .table_options(self.settings.lease_table_options.clone()),
            ),
        };
        let sink: Arc<dyn RecordSink> = match (self.sink, &kinesis) {
            (Some(s), _) => s,
            (None, Some(kinesis)) => Arc::new(KinesisSink::new(kinesis.clone())),
            (None, None) => Arc::new(Unavailable),
        };
        let lister: Arc<dyn ShardLister> = match (self.lister, &reads) {
            (Some(l), _) => l,
            (None, Reads::Pages(source)) => Arc::new(PartitionLister(source.clone())),
            (None, Reads::Stream) => {
                Arc::new(KinesisShards::new(kinesis.clone().expect("sdk loaded")))
            }
        };

        let settings = self.settings;
        let producer = Producer::new(sink);
        // A misspelled dead-letter stream fails here, not later as a shard that stops
        // checkpointing.
        if let Some(dead_letter) = &settings.dead_letter {
            producer.check(dead_letter).await?;
        }
        // So does a misspelled retry stream.
        if let Some(retry) = settings
            .retry_stream
            .as_ref()
            .filter(|r| **r != settings.stream)
        {
            producer.check(retry).await?;
        }
        if let Some(destination) = &self.destination {
            destination.check().await?;
        }
        // The stream consumer is registered (or found, and checked to be this application's)
        // before any lease is taken.
        let fan_out = match (&settings.fan_out, &kinesis) {
            (Some(fan_out), Some(kinesis)) => {
                let records = FanOutRecords::new(kinesis.clone(), fan_out.clone());
                records
                    .register(&settings.stream, &settings.application)
                    .await?;
                Some(records)
            }
            _ => None,
        };
        // Receipts that can expire while the source still keeps the events (it keeps them for good
        // and bounds what a replay needs): each partition is checked as it is taken.
        let mut receipts_expire_first = false;
        if let Some(receipts) = &self.receipts {
            receipts.prepare().await?;
            // After an outage a handled event can be handed out again for as long as the source
            // keeps it, however long ago its receipt was written.
            if let Some(kept) = receipts.retention() {
                let (keeps, name, bounded) = match &reads {
                    Reads::Pages(source) => (
                        source.retention().await?,
                        source.name().to_string(),
                        source.bounds_replays(),
                    ),
                    Reads::Stream => (
                        lister.retention(&settings.stream).await?,
                        settings.stream.clone(),
                        false,
                    ),
                };
                if keeps == crate::receipts::SourceRetention::Forever && bounded {
                    // Each partition is checked as it is taken instead: one whose progress is
                    // older than the receipts are kept is refused.
                    receipts_expire_first = true;
                    info!(source = %name, receipt_retention_days = kept.as_secs_f64() / 86_400.0, "the source keeps events for good and receipts expire: a partition whose durable progress is older than the receipts are kept is refused until an operator resumes it (resume_past_expired_receipts) or seeks it");
                } else {
                    crate::receipts::check_retention(Some(kept), keeps, &name)?;
                }
            }
        }
        if let Some(target) = &self.seek {
            reads
                .seek(store.as_ref(), lister.as_ref(), &settings.stream, target)
                .await?;
        }
        let (manager, events) = LeaseManager::start(
            store.clone(),
            lister.clone(),
            settings.stream.clone(),
            settings.worker_id.clone(),
            settings.lease.clone(),
            self.hooks,
        )
        .await?;
        let stop = CancellationToken::new();
        let abort = CancellationToken::new();
        let stuck = StuckWrites::default();
        let health_board = health::Board::default();
        let pipeline = PipelineContext {
            handler: self.handler,
            settings: settings.clone(),
            producer,
            retry: Arc::new(RetryPolicy {
                // A paged event is retried in place, without a cap unless one is declared; a spent
                // one needs a durable outcome (a dead letter, else a quarantined receipt). So is a
                // Kinesis record with retries in place, whose spent end the application chose.
                max_attempts: settings.max_attempts,
                // A spent record's dead letter goes to the stream, or to the destination by its
                // name.
                dead_letter: settings
                    .dead_letter
                    .clone()
                    .or_else(|| self.destination.as_ref().map(|d| d.name().to_string())),
                retry_stream: settings.retry_stream.clone(),
                spent: reads.spent(self.receipts.is_some(), &settings),
                in_place: reads.in_place(&settings),
            }),
            stuck: stuck.clone(),
            destination: self.destination,
            receipts: self.receipts,
            receipts_expire_first,
            hooks: self.delivery_hooks,
            health: health_board.clone(),
        };
        let kind = match &reads {
            Reads::Stream => Kind::Shards(Shards {
                source: match (self.source, fan_out) {
                    (Some(s), _) => s,
                    (None, Some(fan_out)) => Arc::new(fan_out),
                    (None, None) => Arc::new(KinesisRecords::new(kinesis.expect("sdk loaded"))),
                },
                lister: lister.clone(),
            }),
            Reads::Pages(source) => match source.contract().timestamps {
                Some(contracts) => Kind::Timestamps(Timestamped {
                    source: source.clone(),
                    contracts,
                }),
                None => Kind::Pages(source.clone()),
            },
        };
        let work = Work {
            ctx: OwnedContext {
                pipeline,
                store: store.clone(),
                stop: stop.clone(),
                abort: abort.clone(),
            },
            kind,
        };
        let (held_tx, held_rx) = tokio::sync::watch::channel(Vec::new());
        let leases = manager.probe();
        let progress = Arc::new(Mutex::new(ShutdownReport::default()));
        let (fatal_tx, fatal) = tokio::sync::watch::channel(None);
        let supervisor = tokio::spawn(crate::time::carry(supervise(
            manager,
            events,
            work,
            held_tx,
            progress.clone(),
            fatal_tx,
        )));
        info!(stream = %settings.stream, application = %settings.application, worker = %settings.worker_id, "consumer started");
        Ok(Running {
            stop,
            abort,
            supervisor: Some(supervisor),
            progress,
            held: held_rx,
            leases,
            health: health_board,
            lease_duration: settings.lease.lease_duration,
            stuck,
            store,
            lister,
            reads,
            stream: settings.stream.clone(),
            fatal,
        })
    }
}

/// What a consumer's leases are for: the kind of lease, chosen once, and what every lease needs.
struct Work<H> {
    ctx: OwnedContext<H>,
    kind: Kind,
}

enum Kind {
    /// Kinesis shards.
    Shards(Shards),
    /// Partitions of a paged source.
    Pages(Arc<dyn PagedSource>),
    /// Partitions of a source read by timestamp.
    Timestamps(Timestamped),
}

impl<H: Handler> Work<H> {
    /// Starts a lease's work. Its graceful stop and abort are its own, below the worker's: a
    /// handoff request stops this lease alone, and aborts its handlers once the handoff timeout
    /// has passed, so it writes its final progress and is handed over.
    fn spawn(&self, tasks: &mut JoinSet<Exit>, lease: HeldLease) -> tokio::task::AbortHandle {
        let ctx = OwnedContext {
            stop: self.ctx.stop.child_token(),
            abort: self.ctx.abort.child_token(),
            ..self.ctx.clone()
        };
        tokio::spawn(crate::time::carry(handoff(
            lease.handoff.clone(),
            lease.cancel.clone(),
            ctx.stop.clone(),
            ctx.abort.clone(),
            ctx.pipeline.settings.lease.handoff_timeout,
        )));
        match &self.kind {
            Kind::Shards(shards) => tasks.spawn(crate::time::carry(run_owned::<H, Shard>(
                ctx,
                shards.clone(),
                lease,
            ))),
            Kind::Pages(source) => tasks.spawn(crate::time::carry(run_owned::<H, Pages>(
                ctx,
                source.clone(),
                lease,
            ))),
            Kind::Timestamps(source) => tasks.spawn(crate::time::carry(run_owned::<H, Attempt>(
                ctx,
                source.clone(),
                lease,
            ))),
        }
    }
}

/// A shard's handoff: when asked (`handoff`), stop it gracefully, and abort its handlers once
/// `timeout` has passed; nothing once the lease is gone (`done`).
async fn handoff(
    handoff: CancellationToken,
    done: CancellationToken,
    stop: CancellationToken,
    abort: CancellationToken,
    timeout: Duration,
) {
    tokio::select! {
        biased;
        _ = done.cancelled() => return,
        _ = handoff.cancelled() => stop.cancel(),
    }
    tokio::select! {
        biased;
        _ = done.cancelled() => {}
        _ = tokio::time::sleep(timeout) => abort.cancel(),
    }
}

/// How long [`Running::shutdown`] waits after its deadline for the final checkpoints and lease
/// releases of the shards whose handlers were aborted.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// A running consumer. Dropping it without [`shutdown`](Self::shutdown) asks for a graceful stop
/// that goes on in the background (nobody waits for it).
#[must_use = "call shutdown to stop gracefully"]
#[derive(Debug)]
pub struct Running {
    /// The root of every shard's and lane's cancellation: a graceful stop.
    stop: CancellationToken,
    /// The shutdown deadline passed: abort handlers and writes still running.
    abort: CancellationToken,
    supervisor: Option<JoinHandle<ShutdownReport>>,
    /// What the supervisor has done so far, for a shutdown cut short.
    progress: Arc<Mutex<ShutdownReport>>,
    held: tokio::sync::watch::Receiver<Vec<Ownership>>,
    /// The lease manager's renewals, for health.
    leases: crate::lease::LeaseProbe,
    /// Every shard's reads and checkpoint writes, for health.
    health: health::Board,
    lease_duration: Duration,
    stuck: StuckWrites,
    store: Arc<dyn LeaseStore>,
    lister: Arc<dyn ShardLister>,
    reads: Reads,
    stream: String,
    /// Why the consumer stopped on its own, once it did.
    fatal: tokio::sync::watch::Receiver<Option<Arc<Error>>>,
}

/// Reads a consumer's [`Health`] ([`Running::health_probe`]). Cloning shares it.
#[derive(Clone)]
pub struct HealthProbe {
    leases: crate::lease::LeaseProbe,
    board: health::Board,
    lease_duration: Duration,
    stuck: StuckWrites,
    stop: CancellationToken,
}

impl HealthProbe {
    /// The consumer's health now (see [`Running::health`]).
    pub fn health(&self) -> Health {
        Health {
            leases_held: self.leases.held(),
            since_renewal: self.leases.oldest_renewal(),
            since_beat: self.leases.since_beat(),
            lease_duration: self.lease_duration,
            shards: self.board.shards(),
            stuck_writes: self.stuck.list().len(),
            stopping: self.stop.is_cancelled(),
            worker_id_in_use: self.leases.gave_way(),
        }
    }
}

impl std::fmt::Debug for HealthProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HealthProbe")
            .field("lease_duration", &self.lease_duration)
            .finish_non_exhaustive()
    }
}

/// What a shutdown did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Shards stopped with their final checkpoint written.
    pub shards_stopped: usize,
    /// Leases handed back for other workers to take at once.
    pub leases_released: usize,
    /// Whether the deadline passed before every handler finished (their records will be read again).
    pub deadline_passed: bool,
    /// Shards whose final checkpoint or lease release had not finished [`SHUTDOWN_GRACE`] after
    /// the deadline and were abandoned: their leases expire, and the next owner reads again from
    /// the last checkpoint that was written.
    pub abandoned: Vec<String>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Running {
    /// The shards being read now.
    pub fn shards(&self) -> Vec<Ownership> {
        self.held.borrow().clone()
    }

    /// The stream frontier, recomputed from the lease table on every lease scan. While any
    /// receiver it returned is alive, this worker scans every `scan_interval` so that the frontier
    /// stays fresh; with none, a balanced worker scans only every idle scan interval (see
    /// [`LeaseSettings::idle_scan_interval`](crate::lease::LeaseSettings)).
    pub fn frontier(&self) -> tokio::sync::watch::Receiver<Frontier> {
        self.leases.frontier()
    }

    /// How this worker is doing: leases held and how recently they were renewed, each shard's
    /// last read and checkpoint write and how long settled progress has waited to be written,
    /// stuck retry writes. [`Health::problems`] says whether that is healthy.
    ///
    /// ```no_run
    /// # async fn f(running: shardwise::Running) {
    /// let health = running.health();
    /// for problem in health.problems(shardwise::consumer::HealthLimits::default()) {
    ///     eprintln!("unhealthy: {problem}");
    /// }
    /// # }
    /// ```
    pub fn health(&self) -> Health {
        self.health_probe().health()
    }

    /// A handle that reads this consumer's [`Health`] for as long as it is kept, also after
    /// [`shutdown`](Self::shutdown) took the consumer (it then says `stopping`): for a health
    /// endpoint that outlives the consumer or is served before it starts (the `observability`
    /// feature's endpoints keep one).
    pub fn health_probe(&self) -> HealthProbe {
        HealthProbe {
            leases: self.leases.clone(),
            board: self.health.clone(),
            lease_duration: self.lease_duration,
            stuck: self.stuck.clone(),
            stop: self.stop.clone(),
        }
    }

    /// The error that stopped this consumer on its own, once one did: the stream was deleted
    /// ([`Error::StreamNotFound`]), so nothing more can be read from it, or another process
    /// under this worker id came first ([`Error::WorkerIdInUse`]: this one gave its leases up
    /// without a write). By then every shard has stopped (what settled is checkpointed, and a
    /// deleted stream's leases were given back); call
    /// [`shutdown`](Self::shutdown) for the report. Wait for it beside your own stop signal:
    ///
    /// ```no_run
    /// # async fn f(running: shardwise::Running) -> Result<(), std::sync::Arc<shardwise::Error>> {
    /// let mut fatal = running.fatal();
    /// tokio::select! {
    ///     _ = tokio::signal::ctrl_c() => {}
    ///     _ = fatal.wait_for(Option::is_some) => {}
    /// }
    /// running.shutdown(std::time::Duration::from_secs(10)).await;
    /// let failed = fatal.borrow().clone();
    /// failed.map_or(Ok(()), Err)
    /// # }
    /// ```
    pub fn fatal(&self) -> tokio::sync::watch::Receiver<Option<Arc<Error>>> {
        self.fatal.clone()
    }

    /// Retry copies and dead letters whose writes fail for good now (a missing stream, missing
    /// permissions, a dead letter over the size limit). Each holds its shard's checkpoint and is
    /// retried at least every 30 s, so fixing the cause lets it through; nothing is lost meanwhile.
    pub fn stuck_writes(&self) -> Vec<StuckWrite> {
        self.stuck.list()
    }

    /// Moves the stream's checkpoints (or one shard's) while running. The moved shards' current
    /// readers lose their leases (nothing they settle afterwards can write) and are read again
    /// from the new place by whichever worker takes them next.
    ///
    /// Cancellation safe: each shard's move is one conditional write (or one transaction with its
    /// descendants); a dropped call leaves some shards moved and others not.
    pub async fn seek(&self, target: &SeekTarget) -> Result<SeekReport, Error> {
        self.reads
            .seek(
                self.store.as_ref(),
                self.lister.as_ref(),
                &self.stream,
                target,
            )
            .await
    }

    /// Stops at once, as a crash (`kill -9`) would: running handlers are dropped, nothing more is
    /// settled or checkpointed, and the leases are not released, so other workers take them when
    /// they expire and read again from the last checkpoint. For failover tests.
    pub fn abort(mut self) {
        if let Some(supervisor) = self.supervisor.take() {
            supervisor.abort();
        }
    }

    /// Stops gracefully: stops reading, lets lanes finish until `deadline`, writes final
    /// checkpoints, and releases the leases. Records whose handlers did not finish in time stay
    /// unsettled and are read again by the next owner.
    ///
    /// Returns within `deadline` plus [`SHUTDOWN_GRACE`]: once the deadline passes, running
    /// handlers and copy writes are aborted and the final checkpoints and releases get the
    /// grace; shards still not done then are abandoned (listed in
    /// [`ShutdownReport::abandoned`]) and their leases expire.
    ///
    /// Not cancellation safe: dropping the future leaves the graceful stop running in the
    /// background, unwaited.
    pub async fn shutdown(mut self, deadline: Duration) -> ShutdownReport {
        self.stop.cancel();
        let Some(mut supervisor) = self.supervisor.take() else {
            return ShutdownReport::default();
        };
        let mut deadline_passed = false;
        let finished = match tokio::time::timeout(deadline, &mut supervisor).await {
            Ok(result) => Some(result),
            Err(_) => {
                deadline_passed = true;
                self.abort.cancel();
                tokio::time::timeout(SHUTDOWN_GRACE, &mut supervisor)
                    .await
                    .ok()
            }
        };
        let mut report = match finished {
            Some(Ok(report)) => report,
            Some(Err(e)) => {
                error!(
                    error = &e as &dyn std::error::Error,
                    "consumer supervisor failed"
                );
                self.progress
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone()
            }
            None => {
                supervisor.abort();
                let mut report = self
                    .progress
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                report.abandoned = self
                    .held
                    .borrow()
                    .iter()
                    .map(|o| o.shard_id.clone())
                    .collect();
                report.abandoned.sort();
                warn!(abandoned = ?report.abandoned, grace = ?SHUTDOWN_GRACE, "shutdown abandoned shards whose final checkpoint or release did not finish; their leases will expire");
                report
            }
        };
        report.deadline_passed = deadline_passed;
        report
    }
}

async fn supervise<H: Handler>(
    manager: LeaseManager,
    mut events: mpsc::UnboundedReceiver<LeaseEvent>,
    work: Work<H>,
    held: tokio::sync::watch::Sender<Vec<Ownership>>,
    progress: Arc<Mutex<ShutdownReport>>,
    fatal: tokio::sync::watch::Sender<Option<Arc<Error>>>,
) -> ShutdownReport {
    let manager = Arc::new(manager);
    let fatal = Arc::new(fatal);
    let mut shards: JoinSet<Exit> = JoinSet::new();
    // What follows a shard's exit (a pass, a release, the SHARD_END write): each on its own task,
    // so that a slow write holds up no other lease's start or exit (issue 27, defect 5).
    let mut exits: JoinSet<()> = JoinSet::new();
    // Each shard task's lease, to release it if the task panics.
    let mut tasks: HashMap<tokio::task::Id, Ownership> = HashMap::new();
    let stop = work.ctx.stop.clone();
    let exit_task = |exit, tasks: &mut HashMap<tokio::task::Id, Ownership>, stopping| {
        let ownership = task_lease(&exit, tasks);
        let (manager, progress, fatal) = (manager.clone(), progress.clone(), fatal.clone());
        crate::time::carry(async move {
            on_exit(exit, ownership, &manager, &progress, stopping, &fatal).await;
        })
    };
    loop {
        tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            Some(exit) = shards.join_next_with_id() => {
                exits.spawn(exit_task(exit, &mut tasks, stop.is_cancelled()));
            }
            Some(joined) = exits.join_next() => {
                exit_task_failed(joined);
                if fatal.borrow().is_some() {
                    // Nothing more can be read: stop every shard as a shutdown would.
                    stop.cancel();
                }
                held.send_replace(manager.held());
            }
            Some(event) = events.recv() => {
                match event {
                    LeaseEvent::Acquired(lease) => {
                        let ownership = lease.ownership.clone();
                        let task = work.spawn(&mut shards, *lease);
                        tasks.insert(task.id(), ownership);
                    }
                    LeaseEvent::Stop(error) => {
                        fatal.send_if_modified(|fatal| {
                            let first = fatal.is_none();
                            if first {
                                *fatal = Some(error);
                            }
                            first
                        });
                        stop.cancel();
                    }
                    _ => {}
                }
                held.send_replace(manager.held());
            }
        }
    }
    manager.stop_taking();
    loop {
        // Biased, as every select here: with a shard's exit and an exit task's end both ready,
        // an unbiased select picks one at random, and a seed's simulation would not repeat.
        tokio::select! {
            biased;
            Some(exit) = shards.join_next_with_id() => {
                exits.spawn(exit_task(exit, &mut tasks, true));
            }
            Some(joined) = exits.join_next() => {
                exit_task_failed(joined);
                held.send_replace(manager.held());
            }
            else => break,
        }
    }
    held.send_replace(manager.held());
    // Every exit task has finished: the supervisor holds the manager alone.
    let released = match Arc::try_unwrap(manager) {
        Ok(manager) => manager.shutdown().await,
        Err(_) => {
            error!(
                "the lease manager is still shared after every shard's exit: leaving without releasing; the leases will expire"
            );
            0
        }
    };
    held.send_replace(Vec::new());
    let mut report = progress.lock().unwrap_or_else(|e| e.into_inner());
    report.leases_released = released;
    report.clone()
}

/// Logs an exit task that panicked (a bug in shardwise: its lease expires).
fn exit_task_failed(joined: Result<(), tokio::task::JoinError>) {
    if let Err(e) = joined {
        error!(
            error = &e as &dyn std::error::Error,
            "what follows a shard's exit failed; its lease will expire"
        );
    }
}

/// The lease of the shard task that exited (forgotten: its task is gone).
fn task_lease(
    exit: &Result<(tokio::task::Id, Exit), tokio::task::JoinError>,
    tasks: &mut HashMap<tokio::task::Id, Ownership>,
) -> Option<Ownership> {
    let task = match exit {
        Ok((id, _)) => *id,
        Err(e) => e.id(),
    };
    tasks.remove(&task)
}

/// What follows a shard task's exit; `ownership` is its lease, for a task that panicked.
async fn on_exit(
    exit: Result<(tokio::task::Id, Exit), tokio::task::JoinError>,
    ownership: Option<Ownership>,
    manager: &LeaseManager,
    progress: &Mutex<ShutdownReport>,
    stopping: bool,
    fatal: &tokio::sync::watch::Sender<Option<Arc<Error>>>,
) {
    match exit.map(|(_, exit)| exit) {
        Ok(Exit::Ended(o)) => {
            if let Err(e) = manager.shard_ended(&o).await {
                warn!(shard = %o.shard_id, error = &e as &dyn std::error::Error, "releasing an ended shard failed; it will expire");
            }
        }
        Ok(Exit::Gone(o)) => {
            if let Err(e) = manager.partition_gone(&o).await {
                warn!(shard = %o.shard_id, error = &e as &dyn std::error::Error, "deleting the row of a partition that is gone failed; a later scan deletes it");
            }
        }
        Ok(Exit::Retired(o, at)) => match manager.retire(&o, at).await {
            Ok(_) => {}
            Err(e) => {
                warn!(shard = %o.shard_id, error = &e as &dyn std::error::Error, "retiring an idle partition failed; its lease will expire and another worker reads it on");
            }
        },
        Ok(Exit::Stopped(o)) if !stopping => {
            // Stopped alone: a handoff. The final checkpoint is written: pass the lease.
            if let Err(e) = manager.release(&o).await {
                warn!(shard = %o.shard_id, error = &e as &dyn std::error::Error, "handing a lease over failed; it will expire");
            }
        }
        Ok(Exit::Stopped(o)) => {
            info!(shard = %o.shard_id, "shard stopped");
            progress
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .shards_stopped += 1;
        }
        Ok(Exit::Lost(o)) => {
            info!(shard = %o.shard_id, "shard given up: lease lost");
            manager.work_ended(&o);
        }
        Ok(Exit::Failed(o, e @ (Error::StreamNotFound { .. } | Error::ConsumerGone { .. }))) => {
            // The stream was deleted, or the fan-out consumer deregistered: every shard would
            // fail the same way, be released, taken and fail again. The consumer stops instead,
            // saying why.
            error!(shard = %o.shard_id, error = &e as &dyn std::error::Error, "the stream or its fan-out consumer is gone: the consumer stops");
            let _ = manager.release_failed(&o).await;
            fatal.send_if_modified(|fatal| {
                let first = fatal.is_none();
                if first {
                    *fatal = Some(Arc::new(e));
                }
                first
            });
        }
        Ok(Exit::Failed(o, e)) => {
            error!(shard = %o.shard_id, error = &e as &dyn std::error::Error, "shard failed; releasing its lease");
            let _ = manager.release_failed(&o).await;
        }
        Err(e) => {
            // A bug in shardwise: the shard is given back rather than held with nothing reading it.
            error!(
                shard = ownership.as_ref().map(|o| o.shard_id.as_str()),
                error = &e as &dyn std::error::Error,
                "shard task panicked; releasing its lease"
            );
            if let Some(o) = ownership {
                let _ = manager.release_failed(&o).await;
            }
        }
    }
}
