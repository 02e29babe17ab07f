//! Receipts: a durable record per event identity of what became of it, so that replays (after a
//! crash, a lease move, a seek, a retry copy) are recognised and their effects not applied twice.
//!
//! - [`EventId`]: the stable identity of an event, the same for every delivery of it: for Kinesis,
//!   stream, shard, sequence number and sub-sequence of the record as first read; a retry copy
//!   carries the identity of the record it was copied from (its origin headers).
//! - [`Disposition`]: `applied` and `quarantined` are terminal; `held` (retry later, operator
//!   review) is not, and blocks the checkpoint like an unsettled delivery until it is made
//!   terminal or released.
//! - [`ReceiptStore`]: the ledger. [`DynamoDbReceipts`] keeps it in a DynamoDB table (created on
//!   first use, expiring receipts by TTL after a retention you set); the `testing` feature adds an
//!   in-memory one.
//! - [`Effects`]: the DynamoDB writes a delivery causes. A handler that answers
//!   [`Outcome::Apply`](crate::Outcome::Apply) has them committed together with the `applied`
//!   receipt in one transaction, conditioned on no terminal receipt existing: a replay finds the
//!   receipt, nothing is written again, and the delivery settles as a replay.
//!
//! Exactly-once effects hold for writes that go through the ledger (effects in its transaction, or a
//! sink with its own idempotency keyed by the event identity, checked with
//! [`ReceiptStore::get`] and recorded with [`ReceiptStore::record`]); a side effect outside them
//! (an HTTP call without an idempotency key) can still happen twice.

mod dynamodb;
mod effect;
#[cfg(any(test, feature = "testing"))]
pub(crate) mod memory;

use std::fmt;
use std::time::{Duration, SystemTime};

use futures::future::BoxFuture;

pub use dynamodb::DynamoDbReceipts;
pub use effect::{
    Change, Effect, Effects, Expect, Item, MAX_ITEM_BYTES, MAX_TRANSACTION_BYTES,
    MAX_TRANSACTION_ITEMS, Value, key,
};
#[cfg(any(test, feature = "testing"))]
pub use memory::{MemoryReceipts, TTL_DELETION_DELAY};

pub(crate) use effect::{check_limits, item_size};

use crate::error::Error;
use crate::position::Position;

/// How long receipts are kept by default: they must outlive every replay, so keep them at least as
/// long as the stream keeps records (Kinesis: 24 hours by default, up to 365 days).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The stable identity of an event.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventId(String);

impl EventId {
    /// An identity of the caller's making (a paged source's event id, say).
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// A Kinesis record's identity: `kinesis/STREAM/SHARD/SEQUENCE.SUB`.
    ///
    /// ```
    /// use shardwise::receipts::EventId;
    /// use shardwise::{Position, SequenceNumber};
    /// let p = Position::new(SequenceNumber::parse("4959").unwrap(), 2);
    /// assert_eq!(EventId::kinesis("orders", "shardId-000000000001", &p).as_str(), "kinesis/orders/shardId-000000000001/4959.2");
    /// ```
    pub fn kinesis(stream: &str, shard: &str, position: &Position) -> Self {
        Self(format!(
            "kinesis/{stream}/{shard}/{}.{}",
            position.sequence(),
            position.sub_sequence()
        ))
    }

    /// The identity of an event of a paged source: `paged/SOURCE/PARTITION/ID`, with the event's
    /// own stable identity.
    ///
    /// ```
    /// use shardwise::receipts::EventId;
    /// assert_eq!(EventId::paged("logs:/app", "web-1", "17").as_str(), "paged/logs:/app/web-1/17");
    /// ```
    pub fn paged(source: &str, partition: &str, id: &str) -> Self {
        Self(format!("paged/{source}/{partition}/{id}"))
    }

    /// The identity as stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// How long a source keeps an event it handed out: a replay of a handled event can come as long
/// as the source still holds it, however long the fleet was down before, so a ledger that deletes
/// receipts sooner lets the replay apply the event's effects a second time. A consumer with a
/// receipt ledger asks its source at start and refuses to run on a ledger kept shorter
/// ([`check_retention`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SourceRetention {
    /// The source deletes an event at the latest this long after it was handed out (a Kinesis
    /// stream's retention period; a log group's retention, its deletion delay and the 2 hours
    /// an event's timestamp may lie ahead).
    For(Duration),
    /// The source never deletes events (a log group whose retention is "never expire").
    Forever,
    /// The source does not say (the default of a [`PagedSource`](crate::paged::PagedSource) of
    /// one's own): the consumer runs, and warns.
    Unknown,
}

/// Whether a ledger that keeps `applied` receipts for `kept` (`None`: for good) outlives every
/// replay `source` (named `name`) can make; the error says what to change.
pub fn check_retention(
    kept: Option<Duration>,
    source: SourceRetention,
    name: &str,
) -> Result<(), crate::ConfigError> {
    let Some(kept) = kept else {
        return Ok(());
    };
    let days = |d: Duration| d.as_secs_f64() / 86_400.0;
    match source {
        SourceRetention::For(keeps) if kept < keeps => Err(crate::ConfigError::new(
            "receipt_retention",
            kept,
            format!(
                "`{name}` keeps an event for up to {:.2} days, and after an outage a handled event can be handed out again until then; receipts kept {:.2} days would be gone by then and the replay would apply its effects a second time: keep receipts at least {:.2} days",
                days(keeps),
                days(kept),
                days(keeps)
            ),
        )),
        SourceRetention::Forever => Err(crate::ConfigError::new(
            "receipt_retention",
            kept,
            format!(
                "`{name}` keeps events for good, so after an outage longer than the receipts' {:.2} days a handled event handed out again would apply its effects a second time: give the source a retention (a log group's retention policy) and keep receipts that long, or keep receipts for good",
                days(kept)
            ),
        )),
        SourceRetention::For(_) => Ok(()),
        SourceRetention::Unknown => {
            tracing::warn!(source = %name, receipt_retention_days = days(kept), "the source does not say how long it keeps events: a replay after an outage longer than the receipts are kept would apply effects a second time");
            Ok(())
        }
    }
}

/// How much earlier than this host's clock another host's may have dated a receipt's expiry:
/// receipts a replay needs are taken for gone this long before they expire.
pub const RECEIPT_CLOCK_MARGIN: Duration = Duration::from_secs(3600);

/// Whether a replay of a partition may need receipts that expired: its progress needs receipts
/// recorded since `since_ms` (the provider's time, ms), it is `now_ms`, and receipts are kept
/// `kept`. With [`RECEIPT_CLOCK_MARGIN`] for the clocks of the hosts that recorded them.
pub fn receipts_may_have_expired(kept: Duration, since_ms: i64, now_ms: i64) -> bool {
    let kept_ms = i64::try_from(kept.as_millis()).unwrap_or(i64::MAX);
    let margin_ms = i64::try_from(RECEIPT_CLOCK_MARGIN.as_millis()).unwrap_or(0);
    now_ms.saturating_sub(since_ms) > kept_ms.saturating_sub(margin_ms)
}

/// What became of an event.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Disposition {
    /// Its effects are durable (terminal).
    Applied,
    /// Set aside for good by policy, with the reason (terminal).
    Quarantined(String),
    /// Waiting (retry later, operator review), with the reason: not terminal. It blocks the
    /// checkpoint until it is made terminal or released.
    Held(String),
}

impl Disposition {
    /// Whether the event is done with: the checkpoint may pass it.
    pub fn is_terminal(&self) -> bool {
        !matches!(self, Disposition::Held(_))
    }

    /// `applied`, `quarantined` or `held`, as stored.
    pub fn label(&self) -> &'static str {
        match self {
            Disposition::Applied => "applied",
            Disposition::Quarantined(_) => "quarantined",
            Disposition::Held(_) => "held",
        }
    }

    /// The reason of a quarantine or hold.
    pub fn reason(&self) -> Option<&str> {
        match self {
            Disposition::Applied => None,
            Disposition::Quarantined(r) | Disposition::Held(r) => Some(r),
        }
    }

    pub(crate) fn from_stored(label: &str, reason: Option<String>) -> Option<Self> {
        let reason = reason.unwrap_or_default();
        Some(match label {
            "applied" => Disposition::Applied,
            "quarantined" => Disposition::Quarantined(reason),
            "held" => Disposition::Held(reason),
            _ => return None,
        })
    }
}

/// One receipt as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Receipt {
    /// The event.
    pub event: EventId,
    /// What became of it.
    pub disposition: Disposition,
    /// When it was recorded.
    pub recorded_at: SystemTime,
    /// The worker (or tool) that recorded it.
    pub by: String,
}

/// What [`ReceiptStore::record`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Recorded {
    /// Stored (in place of a held receipt, if there was one).
    Recorded,
    /// A terminal receipt already existed; nothing changed.
    Exists(Receipt),
}

/// One delivery's effects, to commit with its `applied` receipt.
#[derive(Debug, Clone, PartialEq)]
pub struct Apply {
    /// The event.
    pub event: EventId,
    /// Its writes.
    pub effects: Effects,
}

/// What became of one [`Apply`] of a [`ReceiptStore::commit`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Committed {
    /// The effects and the receipt are durable.
    Applied,
    /// A terminal receipt already existed: nothing was written (a replay).
    Replay,
    /// An effect's own condition did not hold: nothing was written.
    Refused(String),
    /// The effects cannot be committed at all (over a limit, a missing table, an unknown key
    /// schema): nothing was written.
    Invalid(String),
}

/// The ledger of receipts, and the committer of effects with them.
///
/// Every write is conditioned so that a terminal receipt is never overwritten: a replay cannot
/// undo or repeat what is done. Cancelling a returned future is safe: a write reached the store or
/// did not, and repeating it finds the receipt.
pub trait ReceiptStore: Send + Sync + fmt::Debug + 'static {
    /// Makes sure the ledger exists with the right key schema (creating it if configured to), or
    /// fails naming the table and what is wrong.
    fn prepare(&self) -> BoxFuture<'_, Result<(), Error>>;

    /// The receipt of an event, read consistently.
    fn get<'a>(&'a self, event: &'a EventId) -> BoxFuture<'a, Result<Option<Receipt>, Error>>;

    /// Records a disposition for an event that has no terminal receipt (a held one is replaced).
    fn record<'a>(
        &'a self,
        event: &'a EventId,
        disposition: &'a Disposition,
        by: &'a str,
    ) -> BoxFuture<'a, Result<Recorded, Error>>;

    /// Removes a held receipt, so the event is handled again. `false` when there was none, or it
    /// was terminal (left alone).
    fn release<'a>(&'a self, event: &'a EventId) -> BoxFuture<'a, Result<bool, Error>>;

    /// Commits each [`Apply`] atomically with its `applied` receipt, all in one transaction where
    /// possible; one answer per apply, in order. Errors are for the store being unreachable.
    fn commit<'a>(
        &'a self,
        applies: &'a [Apply],
        by: &'a str,
    ) -> BoxFuture<'a, Result<Vec<Committed>, Error>>;

    /// Receipts in the ledger (of this application), at most `limit`, for inspection.
    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Receipt>, Error>>;

    /// How long an `applied` receipt is kept before the store may delete it (`None`: for
    /// good). A consumer whose source can replay an event for longer is refused at build (see
    /// [`Contract::replay_horizon`](crate::paged::Contract::replay_horizon)). A wrapper forwards it.
    fn retention(&self) -> Option<Duration> {
        None
    }

    /// Whether the event has a terminal receipt (`applied` or `quarantined`): for a handler whose
    /// sink has its own idempotency (an HTTP API with idempotency keys, an S3 object named by the
    /// event), the work already done. Record it with [`record`](Self::record) once the sink
    /// accepted it:
    ///
    /// ```
    /// # use shardwise::receipts::{Disposition, EventId, MemoryReceipts, ReceiptStore};
    /// # futures::executor::block_on(async {
    /// let ledger = MemoryReceipts::new();
    /// let event = EventId::new("kinesis/orders/shardId-000000000000/42.0");
    /// if !ledger.seen(&event).await? {
    ///     // ... write to the sink, keyed by `event` ...
    ///     ledger.record(&event, &Disposition::Applied, "worker-1").await?;
    /// }
    /// assert!(ledger.seen(&event).await?);
    /// # Ok::<(), shardwise::Error>(()) });
    /// ```
    fn seen<'a>(&'a self, event: &'a EventId) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            Ok(self
                .get(event)
                .await?
                .is_some_and(|r| r.disposition.is_terminal()))
        })
    }
}

#[allow(dead_code)]
fn _object_safe(_: &dyn ReceiptStore) {}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    #[test]
    fn receipts_must_outlive_every_replay_the_source_can_make() {
        let refused = |kept, source| {
            check_retention(Some(kept), source, "orders")
                .expect_err("refused")
                .to_string()
        };
        // Kept shorter than the source keeps events: a replay after a long outage finds no receipt.
        let shorter = refused(DAY, SourceRetention::For(7 * DAY));
        assert!(shorter.contains("receipt_retention"), "{shorter}");
        assert!(shorter.contains("7.00 days"), "{shorter}");
        // A source that never deletes events can replay after any outage.
        let forever = refused(30 * DAY, SourceRetention::Forever);
        assert!(forever.contains("keeps events for good"), "{forever}");

        for (kept, source) in [
            (Some(7 * DAY), SourceRetention::For(7 * DAY)),
            (Some(8 * DAY), SourceRetention::For(7 * DAY)),
            (None, SourceRetention::Forever),
            (None, SourceRetention::For(DAY)),
            (Some(DAY), SourceRetention::Unknown),
        ] {
            assert!(
                check_retention(kept, source, "orders").is_ok(),
                "{kept:?} against {source:?}"
            );
        }
    }

    #[test]
    fn receipts_may_have_expired_past_their_retention_less_the_clock_margin() {
        let day_ms = 86_400_000;
        let kept = Duration::from_secs(2 * 86_400);
        let since = 1_764_000_000_000;
        // Within the retention less an hour: there.
        assert!(!receipts_may_have_expired(
            kept,
            since,
            since + 2 * day_ms - 3_600_001
        ));
        assert!(!receipts_may_have_expired(
            kept,
            since,
            since + 2 * day_ms - 3_600_000
        ));
        // Past it: a host whose clock ran an hour behind may have expired them.
        assert!(receipts_may_have_expired(
            kept,
            since,
            since + 2 * day_ms - 3_599_999
        ));
        assert!(receipts_may_have_expired(kept, since, since + 5 * day_ms));
        // A progress dated ahead of now needs nothing old.
        assert!(!receipts_may_have_expired(kept, since, since - day_ms));
    }
}
