//! Consumer settings: validated once, at `build()`, naming the field and the value on error.

use std::num::NonZeroU32;
use std::time::Duration;

use crate::error::ConfigError;
use crate::lease::{InitialPosition, LeaseSettings, TableOptions};
use crate::shard::reader::ReaderSettings;

/// How deliveries of one shard are spread over its lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum DeliveryOrder {
    /// Deliveries with the same partition key run one at a time, in shard order (key hash -> lane).
    #[default]
    PerKey,
    /// Any idle lane takes the next delivery: most parallel, no order between deliveries.
    None,
}

/// Where a Kinesis record whose handler asks for a retry (or panics, or runs past
/// `handler_timeout`) runs again. A paged source always runs it again in place: it has no stream
/// to copy to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum RetryMode {
    /// Again on its lane after a capped exponential back-off with jitter (100 ms doubling to
    /// 5 s; `RetryAfter(d)`: after `d`), as Lambda's Kinesis trigger and KCL applications retry:
    /// while it waits, the later records of its partition key wait behind it (with
    /// [`DeliveryOrder::None`], only the record itself), other keys go on, and the checkpoint
    /// holds behind it. It runs until it succeeds, its `max_attempts` are spent or it is older
    /// than `max_record_age`. The default.
    #[default]
    InPlace,
    /// A counted copy at the tip of the stream (ruststream's `x-ruststream-retry-count`), or of
    /// the [`retry_stream`](super::ConsumerBuilder::retry_stream); the record settles once the
    /// copy is written. Every consumer of that stream reads the copy (another application,
    /// Firehose), and per-key order is lost for it. Needs `max_attempts` or a dead-letter
    /// stream (`dead_letter`, `on_failure`): without either it is refused at build.
    Copy,
}

/// What becomes of a Kinesis record retried in place whose attempts are spent
/// (`max_attempts`, `max_record_age`) when no dead-letter stream takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnSpent {
    /// It is dropped (a warning, `shardwise_records_total{outcome="spent"}`): the application says
    /// it can lose such records.
    Drop,
}

/// The old name of [`DeliveryOrder`], which shadowed `std::cmp::Ordering` in a glob import.
#[deprecated(since = "0.2.0", note = "renamed `DeliveryOrder`")]
pub type Ordering = DeliveryOrder;

/// Everything a consumer runs with besides its handler and clients.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Settings {
    /// The stream to read.
    pub stream: String,
    /// The application; workers of one application share the stream. It names the lease table
    /// unless [`lease_table`](Self::lease_table) does.
    pub application: String,
    /// The DynamoDB lease table, when not named after the application.
    pub lease_table: Option<String>,
    /// How a missing lease table is created.
    pub lease_table_options: TableOptions,
    /// This worker's id in the lease table.
    pub worker_id: String,
    /// Lanes per shard.
    pub lanes: usize,
    /// DeliveryOrder between lanes.
    pub ordering: DeliveryOrder,
    /// Deliveries held per shard between the checkpoint and the newest read, at most (the reader
    /// pauses at this bound; one GetRecords page may overshoot it).
    pub max_in_flight: usize,
    /// Reading limits.
    pub reader: ReaderSettings,
    /// Least time between two checkpoint writes of one shard.
    pub checkpoint_interval: Duration,
    /// Lease timing and balancing, and where new shards start.
    pub lease: LeaseSettings,
    /// Attempts a record gets, counting the first delivery; `None`: in place, a failing record
    /// runs again until it succeeds (or is older than `max_record_age`).
    pub max_attempts: Option<NonZeroU32>,
    /// Where records go when their attempts are spent.
    pub dead_letter: Option<String>,
    /// Where a Kinesis record that asks for a retry runs again.
    pub retries: RetryMode,
    /// With [`RetryMode::Copy`]: the stream copies are written to; `None`: the stream read.
    pub retry_stream: Option<String>,
    /// What becomes of a record retried in place whose attempts are spent when no dead-letter
    /// stream takes it; `None`: a bound on attempts needs a dead-letter stream (refused at build).
    pub on_spent: Option<OnSpent>,
    /// Read with enhanced fan-out (SubscribeToShard) instead of GetRecords.
    pub fan_out: Option<crate::shard::fanout::FanOut>,
    /// With a clock-skew allowance, an idle shard whose last read was empty at the tip advances its
    /// frontier coordinate to (now - allowance); without one, an idle shard holds it.
    pub caught_up_skew: Option<Duration>,
    /// Least time between two frontier-only writes of an idle shard.
    pub frontier_interval: Duration,
    /// How often the receipts of held deliveries are read, to settle the ones made terminal and
    /// handle again the ones released.
    pub hold_poll_interval: Duration,
    /// Read on a paged partition whose receipts a replay may need could have expired (its
    /// durable progress older than the ledger keeps receipts), handling again what they would
    /// have settled; by default such a partition is refused until an operator says so (see
    /// [`ConsumerBuilder::resume_past_expired_receipts`](super::ConsumerBuilder::resume_past_expired_receipts)).
    pub resume_past_expired_receipts: bool,
    /// How far back from the local clock a LATEST start is pinned (see
    /// [`ConsumerBuilder::latest_margin`](super::ConsumerBuilder::latest_margin)).
    pub latest_margin: Duration,
    /// What to do with a source read by timestamp whose contracts cannot prove a group complete.
    pub unproven: Unproven,
    /// How long one delivery (or one batch) may run before it is given up as a retry; `None`: as
    /// long as it takes.
    pub handler_timeout: Option<Duration>,
    /// Records that arrived longer ago than this are not handled: they go to the dead-letter
    /// stream when there is one, else they are dropped (Lambda's `MaximumRecordAgeInSeconds`).
    pub max_record_age: Option<Duration>,
}

/// What a consumer does with a source read by timestamp whose contracts cannot prove a timestamp
/// group complete (no complete traversal, or no finality): such a source can never be
/// checkpointed past a timestamp without risking a skip (seed 000).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unproven {
    /// Refuse to start, saying why (the default).
    #[default]
    Refuse,
    /// Read it anyway: nothing is ever closed, and every poll reads every open group again from
    /// the last closed timestamp (receipts make the replays harmless; a metric counts them).
    Replay,
}

/// The default [`Settings::latest_margin`]: records that arrived up to this long before a LATEST
/// start are delivered too. The start is the stream service's time (from the `Date` of its
/// answers), so the margin covers the difference between that time and the records' arrival
/// timestamps; for a source whose answers carry no date, this host's clock running ahead of them.
pub const DEFAULT_LATEST_MARGIN: Duration = Duration::from_secs(5);

/// The default worker id: host name, process id and a random part, e.g. `web-1-3f9a2c`. Host name
/// and process id alone clash: containers with host networking share the host name and each runs
/// its process as PID 1, and two workers with one id would take each other's leases as their own.
pub fn default_worker_id() -> String {
    let host = gethostname::gethostname();
    format!(
        "{}-{}-{:06x}",
        host.to_string_lossy(),
        std::process::id(),
        rand::random::<u32>() & 0xff_ffff
    )
}

impl Settings {
    pub(crate) fn new(stream: String, application: String) -> Self {
        Self {
            stream,
            application,
            lease_table: None,
            lease_table_options: TableOptions::default(),
            worker_id: default_worker_id(),
            lanes: 1,
            ordering: DeliveryOrder::PerKey,
            max_in_flight: 10_000,
            reader: ReaderSettings::default(),
            checkpoint_interval: Duration::from_secs(1),
            lease: LeaseSettings::default(),
            max_attempts: None,
            dead_letter: None,
            retries: RetryMode::InPlace,
            retry_stream: None,
            on_spent: None,
            fan_out: None,
            caught_up_skew: None,
            frontier_interval: Duration::from_secs(5),
            latest_margin: DEFAULT_LATEST_MARGIN,
            unproven: Unproven::Refuse,
            hold_poll_interval: Duration::from_secs(5),
            resume_past_expired_receipts: false,
            handler_timeout: None,
            max_record_age: None,
        }
    }

    /// Checks every field; the error names the first bad one and its value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !valid_name(&self.stream, 128) {
            return Err(ConfigError::new(
                "stream",
                &self.stream,
                "must be 1 to 128 characters of [a-zA-Z0-9_.-]",
            ));
        }
        self.validate_rest()
    }

    /// [`validate`](Self::validate) for a paged source, whose name (`logs:/aws/lambda/orders`) is
    /// the provider's: 1 to 1,024 characters, none of them control characters.
    pub(crate) fn validate_paged(&self) -> Result<(), ConfigError> {
        if self.stream.is_empty()
            || self.stream.len() > 1024
            || self.stream.chars().any(char::is_control)
        {
            return Err(ConfigError::new(
                "stream",
                &self.stream,
                "a paged source's name must be 1 to 1,024 characters, none of them control characters",
            ));
        }
        self.validate_rest()
    }

    fn validate_rest(&self) -> Result<(), ConfigError> {
        if self.lease_table.is_none()
            && (!valid_name(&self.application, 255) || self.application.len() < 3)
        {
            return Err(ConfigError::new(
                "application",
                &self.application,
                "names the DynamoDB lease table: 3 to 255 characters of [a-zA-Z0-9_.-] (or name the table with lease_table)",
            ));
        }
        if self.application.is_empty() {
            return Err(ConfigError::new(
                "application",
                &self.application,
                "must not be empty",
            ));
        }
        if let Some(table) = &self.lease_table
            && (!valid_name(table, 255) || table.len() < 3)
        {
            return Err(ConfigError::new(
                "lease_table",
                table,
                "a DynamoDB table name: 3 to 255 characters of [a-zA-Z0-9_.-]",
            ));
        }
        self.lease_table_options.validate()?;
        if self.worker_id.is_empty() || self.worker_id.len() > 256 {
            return Err(ConfigError::new(
                "worker_id",
                &self.worker_id,
                "must be 1 to 256 characters",
            ));
        }
        if !(1..=1024).contains(&self.lanes) {
            return Err(ConfigError::new("lanes", self.lanes, "must be 1 to 1024"));
        }
        if self.max_in_flight == 0 {
            return Err(ConfigError::new(
                "max_in_flight",
                self.max_in_flight,
                "must be at least 1",
            ));
        }
        if !(1..=10_000).contains(&self.reader.limit) {
            return Err(ConfigError::new(
                "get_records_limit",
                self.reader.limit,
                "must be 1 to 10000",
            ));
        }
        if self.reader.poll_interval < Duration::from_millis(200) {
            return Err(ConfigError::new(
                "poll_interval",
                self.reader.poll_interval,
                "must be at least 200ms (Kinesis allows 5 GetRecords calls per second per shard)",
            ));
        }
        if self.checkpoint_interval.is_zero() {
            return Err(ConfigError::new(
                "checkpoint_interval",
                self.checkpoint_interval,
                "must be above zero",
            ));
        }
        if self.checkpoint_interval >= self.lease.lease_duration {
            return Err(ConfigError::new(
                "checkpoint_interval",
                self.checkpoint_interval,
                format!(
                    "must be shorter than lease_duration ({:?})",
                    self.lease.lease_duration
                ),
            ));
        }
        if let Some(dl) = &self.dead_letter {
            if !valid_name(dl, 128) {
                return Err(ConfigError::new(
                    "dead_letter",
                    dl,
                    "must be a stream name: 1 to 128 characters of [a-zA-Z0-9_.-]",
                ));
            }
            if *dl == self.stream {
                return Err(ConfigError::new(
                    "dead_letter",
                    dl,
                    "must not be the stream being consumed",
                ));
            }
        }
        if let Some(retry) = &self.retry_stream {
            if !valid_name(retry, 128) {
                return Err(ConfigError::new(
                    "retry_stream",
                    retry,
                    "must be a stream name: 1 to 128 characters of [a-zA-Z0-9_.-]",
                ));
            }
            if self.dead_letter.as_ref() == Some(retry) {
                return Err(ConfigError::new(
                    "retry_stream",
                    retry,
                    "must not be the dead-letter stream: spent records would be read again as retries",
                ));
            }
        }
        if self.hold_poll_interval.is_zero() {
            return Err(ConfigError::new(
                "hold_poll_interval",
                self.hold_poll_interval,
                "must be above zero",
            ));
        }
        if self.frontier_interval.is_zero() {
            return Err(ConfigError::new(
                "frontier_interval",
                self.frontier_interval,
                "must be above zero",
            ));
        }
        if let Some(t) = self.handler_timeout
            && t.is_zero()
        {
            return Err(ConfigError::new("handler_timeout", t, "must be above zero"));
        }
        if let Some(age) = self.max_record_age
            && age < Duration::from_secs(1)
        {
            return Err(ConfigError::new(
                "max_record_age",
                age,
                "must be at least 1s (arrival times are whole milliseconds from another clock)",
            ));
        }
        self.lease.validate()
    }

    /// The DynamoDB lease table: [`lease_table`](Self::lease_table), or the application's name.
    pub fn lease_table(&self) -> &str {
        self.lease_table.as_deref().unwrap_or(&self.application)
    }

    /// Where new shards start.
    pub fn initial_position(&self) -> InitialPosition {
        self.lease.initial_position
    }
}

fn valid_name(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

#[cfg(test)]
mod tests {
    #[test]
    fn default_worker_ids_carry_a_random_part() {
        let (a, b) = (super::default_worker_id(), super::default_worker_id());
        assert_ne!(
            a, b,
            "two processes on one host with one PID must not share an id"
        );
        let prefix = format!("-{}-", std::process::id());
        assert!(a.contains(&prefix), "{a}");
        let random = a.rsplit('-').next().unwrap();
        assert_eq!(random.len(), 6, "{a}");
        assert!(random.chars().all(|c| c.is_ascii_hexdigit()), "{a}");
    }

    use super::*;

    fn ok() -> Settings {
        Settings::new("orders".into(), "billing".into())
    }

    #[test]
    fn defaults_are_valid() {
        ok().validate().unwrap();
    }

    #[test]
    fn each_bad_field_is_named_with_its_value() {
        type Breaker = Box<dyn Fn(&mut Settings)>;
        let cases: Vec<(&str, Breaker)> = vec![
            ("stream", Box::new(|s| s.stream = "no spaces".into())),
            ("application", Box::new(|s| s.application = "ab".into())),
            (
                "lease_table",
                Box::new(|s| s.lease_table = Some("a b".into())),
            ),
            (
                "billing",
                Box::new(|s| {
                    s.lease_table_options.billing =
                        crate::lease::Billing::Provisioned { read: 0, write: 5 }
                }),
            ),
            (
                "tags",
                Box::new(|s| {
                    s.lease_table_options.tags = vec![("aws:reserved".into(), "x".into())]
                }),
            ),
            ("worker_id", Box::new(|s| s.worker_id = String::new())),
            ("lanes", Box::new(|s| s.lanes = 0)),
            ("max_in_flight", Box::new(|s| s.max_in_flight = 0)),
            ("get_records_limit", Box::new(|s| s.reader.limit = 10_001)),
            (
                "poll_interval",
                Box::new(|s| s.reader.poll_interval = Duration::from_millis(10)),
            ),
            (
                "checkpoint_interval",
                Box::new(|s| s.checkpoint_interval = Duration::from_secs(60)),
            ),
            (
                "dead_letter",
                Box::new(|s| s.dead_letter = Some("orders".into())),
            ),
            (
                "retry_stream",
                Box::new(|s| s.retry_stream = Some("retries please".into())),
            ),
            (
                "retry_stream",
                Box::new(|s| {
                    s.dead_letter = Some("orders-dlq".into());
                    s.retry_stream = Some("orders-dlq".into());
                }),
            ),
            (
                "renew_interval",
                Box::new(|s| s.lease.renew_interval = Duration::from_secs(8)),
            ),
            (
                "handler_timeout",
                Box::new(|s| s.handler_timeout = Some(Duration::ZERO)),
            ),
            (
                "max_record_age",
                Box::new(|s| s.max_record_age = Some(Duration::from_millis(10))),
            ),
        ];
        for (field, break_it) in cases {
            let mut s = ok();
            break_it(&mut s);
            let err = s.validate().expect_err(field);
            assert_eq!(err.field(), field);
            assert!(err.to_string().contains(field), "{err}");
        }
    }
}
