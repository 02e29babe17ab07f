//! CloudWatch Logs as a paged source: one partition per log stream of a log group, read forward with
//! `GetLogEvents` and its `nextForwardToken`.
//!
//! `GetLogEvents` gives no event identity: only a timestamp, an ingestion time and a message. One
//! `PutLogEvents` batch may stamp several events with one millisecond, so events of a stream form
//! *groups* of one timestamp and ingestion time, which the service returns in an order of its
//! own, and retention may delete some events of a group before others. An event is named by what
//! no deletion changes (see [`log_event_identity`]): its timestamp, its ingestion time, the digest
//! of its message, and its occurrence among the group's events with that same message (0 unless
//! the line repeats exactly). Its position is the same four numbers, and the source declares
//! [`Contract::groups`]: progress counts whole groups (the applied position claims only the groups
//! before the one the settled prefix reached), so a group is a replay only once all of it settled.
//! Counting occurrences across a page boundary needs the group's earlier messages: this source's
//! cursor carries the last event (its place in its group and its name) beside the service's token,
//! and a page that goes on with a group of several events read before it reads that millisecond
//! again to count them. A cursor is `v5|` and JSON (serde; fields absent when empty):
//!
//! ```text
//! v5|{"c":<creation ms>,"s":<start ms>,"f":<floor ms>,"t":"<forward token>",
//!     "l":{"t":<timestamp>,"i":<ingestion>,"k":<place>,"n":[<digest>,<n>]},"a":<mark>,
//!     "r":{"a":<mark>,"l":<event>} (an audit's pages),"v":{"a":..,"t":..,"n":..,"d":".."} (vouched)}
//! ```
//!
//! (versions 1 to 4, fields split by `|`, written before, are still read). A log stream is its name and its
//! `creationTime`: a stream can be deleted and created again under its name, and the new one is
//! another stream. Each listing (DescribeLogStreams) keeps every stream's creation time, a cursor
//! carries the one of the stream it reads, and a fetch whose cursor names another creation than
//! the stream of that name has now (at once, when the listing saw it; or when the stream is not
//! found or its token refused, asked for that stream alone) ends the partition
//! ([`FetchError::Gone`](super::FetchError::Gone), `shardwise_paged_partitions_recreated_total`,
//! a warning): its row is deleted once its deliveries settled, and the new stream is read from
//! its first event under a row of its own. Before, the old cursor went on over the new stream: a
//! refused token was recovered from the old stream's last timestamp, and the new stream's older
//! events were never asked for.
//!
//! Exact repeats (the same timestamp, ingestion time and message) are told apart only by their
//! order: when retention deletes one of them before a later one is read, the later one is handed
//! out under the deleted one's name, or, read again by the attempt that handed that one out, taken
//! for it (docs/paged.md, "Groups of one timestamp and ingestion time").
//! [`CloudWatchLogsFilter`](super::CloudWatchLogsFilter) names events by `eventId` instead.
//!
//! shardwise never looks inside (cursors are opaque to the consumer); this module alone makes and
//! reads them. At the end of a stream the service returns the request's token again: the cursor
//! comes back unchanged and the reader backs off.
//!
//! Tokens expire: "The token expires after 24 hours" (GetLogEvents), and the token handed back at
//! the end of a stream keeps its age, so a stream quiet for a day (or a fleet down for one) holds
//! an expired token. A token the service refuses (`InvalidParameterException`) is recovered from
//! the cursor's last event: the stream is read again from that event's timestamp, from the head,
//! with no token, and what comes up to that event (found by its name) is passed over as behind the
//! cursor (were it gone, its whole group is handed out again). Each recovery is logged and counted
//! (`shardwise_paged_cursor_recoveries_total`).
//!
//! The contract: empty pages with a new token are zero-item pages; positions are not dense; and a
//! forward traversal never goes back (no backfill): `GetLogEvents` returns a stream's events in
//! order from the token's place, so an event at or below the applied prefix is one already read (a
//! replayed page), settled without the handler. Should the service ever return an event below one
//! already read (above the applied prefix, in an earlier group, where nothing was handed out), the
//! partition stops with an order violation rather than guess. Late events come through the audit below.
//!
//! Late events. CloudWatch Logs accepts events up to 14 days old (and 2 hours ahead), and a
//! forward token marks a place in the stream's order by timestamp: an event put later with a
//! timestamp before that place is never returned by later pages. So the forward read cannot see
//! late events, and an audit finds them (on by default; [`CloudWatchLogs::late_event_window`],
//! [`CloudWatchLogs::late_event_audit_interval`], [`CloudWatchLogs::without_late_events`]):
//!
//! - The forward cursor carries a **mark** `A`, an ingestion time: every event behind the cursor
//!   ingested at or before `A`, and at most the window late, was handed out. The first forward
//!   read marks a cursor, and each audit marks it again, with its start less
//!   [`AUDIT_ALLOWANCE`] (30 s: the delay before an event can be read, and the `Date` header's
//!   whole seconds), but never past the ingestion of the newest event the forward read returned,
//!   nor before the start less [`READABLE_WITHIN`] (15 minutes): a stream's events become
//!   readable in the order they were ingested, so a stream whose events take minutes to become
//!   readable is marked by what was readable. Every mark is made by the service's time, from
//!   the `Date` of its answers, never this host's clock: a host a minute ahead would vouch for a
//!   minute the service had not reached. Before an answer carried a date nothing is marked or
//!   audited. An event readable more than [`CloudWatchLogs::readable_within`] after its
//!   ingestion, or more than the allowance after it and after a later event of its stream, is
//!   not found by the audit (the API states no bound on that delay).
//! - Every [`LATE_EVENT_AUDIT_INTERVAL`] (5 minutes), as each attempt starts (once its forward
//!   read has passed the applied position it starts from, which the resume cursor, promoted at
//!   page barriers, may lie behind: the audit covers what is behind the cursor it is given, and
//!   its mark vouches for everything ingested before it), and once a stream
//!   that brought events has been quiet for twice the allowance, the reader audits: it reads the
//!   stream again (`startTime` = `A` less the window, `endTime` past the cursor's last event,
//!   pages of 10,000) and the source returns the events ingested after `A` up to that last
//!   event. The attempt hands out those it did not hand out before (it remembers what it handed
//!   out since shortly before the previous audit): each is late, handed out once, counted in
//!   `shardwise_paged_late_events_total` and logged with its partition and timestamp. Then the
//!   reader reads on from the cursor marked with the audit's start less the allowance, which is
//!   promoted only once every late event settled. An event a forward page returns at or below
//!   the applied prefix is taken for a replay, not remembered: were it late, the audit finds it.
//! - After a restart the reader's memory is gone: an event the audit returns at or below the
//!   applied position the attempt started from may be one an earlier attempt read. A receipt
//!   ledger settles such an event as a replay; without one it is handled again (never skipped).
//!   These are the events ingested since the durable mark: at most one audit interval of them,
//!   none after a graceful stop that came after a quiet spell's audit.
//! - The window ([`LATE_EVENT_WINDOW`], 1 hour by default) bounds what is looked for: an event
//!   later than the window plus the time since the last audit is not found. Cost: each audit
//!   reads the window again, 2 requests for a quiet stream and about (events in the window)
//!   / 10,000 + 1 for a busy one; 500 quiet streams take about 3.3 GetLogEvents a second.
//!
//! moto's tokens are indexes, so an event put behind them also moves the events after it one
//! place on, and the next page repeats one, which is recognised as read.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_cloudwatchlogs::Client;
use aws_sdk_cloudwatchlogs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_cloudwatchlogs::operation::describe_log_streams::DescribeLogStreamsError;
use aws_sdk_cloudwatchlogs::operation::get_log_events::{GetLogEventsError, GetLogEventsOutput};
use aws_sdk_cloudwatchlogs::types::OutputLogEvent;
use bytes::Bytes;
use futures::future::BoxFuture;
use md5::{Digest, Md5};
use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

use super::budget::{Budget, Priority};
use super::{
    Audit, Contract, Cursor, FetchError, Page, PagePosition, PagedEvent, PagedSource, Vouched,
};
use crate::backoff::Backoff;
use crate::error::Error;
use crate::shard::source::ReadDate;
use crate::time::ServiceClock;

/// The events of one page at most (the API's own limit is 10,000).
const DEFAULT_PAGE_LIMIT: i32 = 1_000;

/// An audit's pages are as large as the API allows: it rereads.
const AUDIT_PAGE_LIMIT: i32 = 10_000;

/// How late an event may arrive and still be found, by default: 1 hour.
pub const LATE_EVENT_WINDOW: Duration = Duration::from_secs(3600);

/// How long a stream may have nothing new before it retires, by default: 1 hour.
pub const RETIRE_AFTER: Duration = Duration::from_secs(3600);

/// How often a stream is audited for late events, by default: every 5 minutes.
pub const LATE_EVENT_AUDIT_INTERVAL: Duration = Duration::from_secs(300);

/// What an audit allows for: an event ingested this long before the audit begins may not be
/// readable yet, or the worker's clock may be ahead of the service's by up to this (10 s of skew
/// and 20 s for the delay before an event can be read). The audit marks itself this long before
/// its start, so such an event comes in the next audit.
pub const AUDIT_ALLOWANCE: Duration = Duration::from_secs(30);

/// How long after its ingestion an event may become readable, by default: 15 minutes (AWS states
/// no bound). A stream's events are taken to become readable in the order they were ingested:
/// an audit's mark never passes the newest ingestion the forward read has seen, nor lies more
/// than this before the audit (see [`CloudWatchLogs::readable_within`]).
pub const READABLE_WITHIN: Duration = Duration::from_secs(15 * 60);

/// How old an event PutLogEvents accepts: no audit looks further back.
const MAX_EVENT_AGE_MS: i64 = 14 * 24 * 3600 * 1000;

/// How much later than its retention says CloudWatch Logs may still return an event
/// (PutRetentionPolicy: deletion "typically takes up to 72 hours after that").
pub const DELETION_DELAY: Duration = Duration::from_secs(72 * 3600);

/// How far ahead of the service's clock an event's timestamp may lie (PutLogEvents: 2 hours);
/// retention counts from the timestamp.
const MAX_EVENT_AHEAD: Duration = Duration::from_secs(2 * 3600);

/// How long the log group `group` keeps an event after it was handed out: its retention
/// (`retentionInDays`; none is "never expire"), plus the deletion delay and the 2 hours an
/// event's timestamp may lie ahead. An error names a group that does not exist.
pub(crate) async fn group_retention(
    client: &Client,
    group: &str,
    name: &str,
    kept: &Kept,
) -> Result<crate::receipts::SourceRetention, Error> {
    use crate::receipts::SourceRetention;
    // Asked again while it fails for a while (the sources' client makes one attempt a call).
    let patience = tokio::time::Instant::now() + LISTING_PATIENCE;
    let mut waits = Backoff::new(Duration::from_secs(5));
    let groups = loop {
        match client
            .describe_log_groups()
            .log_group_name_prefix(group)
            .send()
            .await
        {
            Ok(groups) => break groups,
            Err(e) if transient(&e) && tokio::time::Instant::now() < patience => {
                if throttled(&e) {
                    metrics::counter!("shardwise_paged_throttled_total", "source" => name.to_string()).increment(1);
                }
                tokio::time::sleep(waits.next()).await;
            }
            Err(e) => {
                return Err(Error::Paged {
                    source_name: name.to_string(),
                    partition: String::new(),
                    what: "describing the log group failed",
                    source: Box::new(e),
                });
            }
        }
    };
    let Some(found) = groups
        .log_groups()
        .iter()
        .find(|g| g.log_group_name() == Some(group))
    else {
        return Err(Error::Paged {
            source_name: name.to_string(),
            partition: group.to_string(),
            what: "log group not found",
            source: format!("there is no log group `{group}`").into(),
        });
    };
    kept.set(found.retention_in_days());
    Ok(match found.retention_in_days() {
        Some(days) => SourceRetention::For(
            Duration::from_secs(u64::try_from(days).unwrap_or(0) * 86_400)
                + DELETION_DELAY
                + MAX_EVENT_AHEAD,
        ),
        None => SourceRetention::Forever,
    })
}

/// How long a log group keeps its events, as last described (`retentionInDays`), and when: the
/// age past which an event may be deleted unread. Clones share it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Kept(Arc<std::sync::Mutex<Option<Described>>>);

/// When a group was described, and its `retentionInDays` then (`None`: never expire).
type Described = (tokio::time::Instant, Option<i32>);

impl Kept {
    /// How often a source describes its group again for it, at most.
    const REFRESH: Duration = Duration::from_secs(3600);

    fn set(&self, days: Option<i32>) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some((tokio::time::Instant::now(), days));
    }

    /// The age past which the group may delete an event (`None`: never, or not described yet).
    pub(crate) fn deletes_after(&self) -> Option<Duration> {
        let days = (*self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner))?
        .1?;
        Some(Duration::from_secs(
            u64::try_from(days).unwrap_or(0) * 86_400,
        ))
    }

    /// Whether the group is due to be described again.
    pub(crate) fn stale(&self) -> bool {
        (*self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner))
        .is_none_or(|(at, _)| at.elapsed() >= Self::REFRESH)
    }
}

/// A worker's GetLogEvents requests a second by default: five workers stay inside the
/// account's quota of 25.
pub const GET_LOG_EVENTS_PER_SECOND: f64 = 5.0;

/// How long after the newest event read from a stream its reads count as an idle stream's,
/// which wait behind busy streams' in the worker's request budget (up to a minute).
const IDLE_AFTER: Duration = Duration::from_secs(600);

/// A worker's DescribeLogStreams requests a second by default (the account's quota is 5).
pub const DESCRIBE_LOG_STREAMS_PER_SECOND: f64 = 1.0;

/// The log streams of a log group, each a partition, read with `GetLogEvents`.
///
/// Each worker keeps to a request budget per API (clones share it): by default
/// [`GET_LOG_EVENTS_PER_SECOND`] and [`DESCRIBE_LOG_STREAMS_PER_SECOND`], so a handful of workers
/// stay inside the account's quotas (25 and 5 requests a second, shared by every reader of the
/// account and Region). Throttling that comes anyway is backed off with jitter and counted in
/// `shardwise_paged_throttled_total`.
#[derive(Clone)]
pub struct CloudWatchLogs {
    client: Client,
    /// The service's time, from the `Date` of its answers: every mark is made by it.
    clock: Arc<ServiceClock>,
    /// Each stream's `creationTime`, by name, from the newest listing (or look-up of one): a
    /// stream is its name and its creation, since one can be deleted and created again.
    created: Arc<std::sync::Mutex<HashMap<String, i64>>>,
    /// Each stream's `lastIngestionTime`, by name, from the newest listing (or look-up): a
    /// retired stream taking events again is woken by it.
    ingested: Arc<std::sync::Mutex<HashMap<String, i64>>>,
    /// How long a stream may have nothing new before it retires (`None`: never).
    retire_after: Option<Duration>,
    group: Arc<str>,
    name: Arc<str>,
    limit: i32,
    reads: Arc<Budget>,
    listings: Arc<Budget>,
    /// The group's retention, described at most hourly.
    kept: Kept,
    late_events: Option<LateEvents>,
}

/// How the source looks for late events.
#[derive(Debug, Clone, Copy)]
struct LateEvents {
    window: Duration,
    every: Duration,
    readable_within: Duration,
}

impl LateEvents {
    /// The mark of an audit (or of a cursor's first forward read) begun at service time `now`,
    /// the forward read having returned an event ingested at `seen` (ms): every event ingested at
    /// or before it was readable when the audit began, if either an event is readable within
    /// [`AUDIT_ALLOWANCE`] of its ingestion, or a stream's events become readable in the order
    /// they were ingested and within [`readable_within`](CloudWatchLogs::readable_within). So
    /// the mark is `now` less the allowance, but not past `seen` (the events ingested before it
    /// were readable when it was read: a stream whose reads lag by minutes is marked by what
    /// they showed), nor, for a stream with nothing recent, before `now` less `readable_within`.
    fn mark(&self, now: i64, seen: Option<i64>) -> i64 {
        super::vouched_through(now, AUDIT_ALLOWANCE, seen, Some(self.readable_within))
    }
}

impl fmt::Debug for CloudWatchLogs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CloudWatchLogs")
            .field("group", &self.group)
            .field("limit", &self.limit)
            .field("reads", &self.reads)
            .field("listings", &self.listings)
            .field("late_events", &self.late_events)
            .finish_non_exhaustive()
    }
}

impl CloudWatchLogs {
    /// Reads the log group `group`; the source is named `logs:<group>` in the lease table.
    pub fn new(client: Client, group: impl Into<String>) -> Self {
        let group: String = group.into();
        let (client, clock) = dated(&client);
        Self {
            client,
            clock,
            created: Arc::default(),
            ingested: Arc::default(),
            retire_after: Some(RETIRE_AFTER),
            name: format!("logs:{group}").into(),
            group: group.into(),
            limit: DEFAULT_PAGE_LIMIT,
            reads: Arc::new(Budget::per_second(GET_LOG_EVENTS_PER_SECOND)),
            listings: Arc::new(Budget::per_second(DESCRIBE_LOG_STREAMS_PER_SECOND)),
            kept: Kept::default(),
            late_events: Some(LateEvents {
                window: LATE_EVENT_WINDOW,
                every: LATE_EVENT_AUDIT_INTERVAL,
                readable_within: READABLE_WITHIN,
            }),
        }
    }

    /// How late an event may arrive and still be found by the audit (default
    /// [`LATE_EVENT_WINDOW`], 1 hour; CloudWatch Logs takes events up to 14 days old). Each
    /// audit reads the stream again from this far behind the previous audit, so a longer window
    /// costs reads in proportion (see the module's docs).
    pub fn late_event_window(mut self, window: Duration) -> Self {
        if let Some(late) = self.late_events.as_mut() {
            late.window = window;
        }
        self
    }

    /// How often each stream is audited for late events (default
    /// [`LATE_EVENT_AUDIT_INTERVAL`], 5 minutes). A late event is handed out within about this
    /// long of its arrival.
    pub fn late_event_audit_interval(mut self, every: Duration) -> Self {
        if let Some(late) = self.late_events.as_mut() {
            late.every = every.max(Duration::from_secs(1));
        }
        self
    }

    /// How long after its ingestion an event may become readable (default [`READABLE_WITHIN`],
    /// 15 minutes; AWS states no bound). Audits assume a stream's events become readable in the
    /// order they were ingested: an audit's mark (everything ingested at or before it was handed
    /// out) never passes the newest ingestion the forward read has seen, so a stream whose
    /// events take minutes to become readable is marked by what was readable; and for a stream
    /// with nothing recent it lies this long before the audit (or [`AUDIT_ALLOWANCE`], when
    /// the forward read saw an event ingested that recently). A late event that became
    /// readable later than both allow is not looked for. A longer bound costs little: a
    /// stream's audits start that much earlier, and the reader remembers what it handed out
    /// that much longer.
    pub fn readable_within(mut self, within: Duration) -> Self {
        if let Some(late) = self.late_events.as_mut() {
            late.readable_within = within;
        }
        self
    }

    /// How long a stream may have nothing new before it retires (default [`RETIRE_AFTER`], 1
    /// hour; `None`: never). A retired stream costs no lease writes and no reads: its row is left
    /// unowned until a listing of the group shows it took events after what was read
    /// (`lastIngestionTime`), which AWS updates "typically in less than an hour", so a stream
    /// that wakes is read that much later at worst (nothing is skipped: it is read on from its
    /// cursor). Streams are listed every `shard_sync_interval` (one DescribeLogStreams per 50
    /// streams). A source without late-event audits never retires a stream.
    pub fn retire_after(mut self, after: Option<Duration>) -> Self {
        self.retire_after = after;
        self
    }

    /// No audit for late events: an event put behind what was read is never read (for streams
    /// whose producers never put late events, which then cost no reads).
    pub fn without_late_events(mut self) -> Self {
        self.late_events = None;
        self
    }

    /// This worker's GetLogEvents requests a second, at most (default
    /// [`GET_LOG_EVENTS_PER_SECOND`]). Share the account's quota of 25 among the workers.
    pub fn get_log_events_per_second(mut self, rate: f64) -> Self {
        self.reads = Arc::new(Budget::per_second(rate));
        self
    }

    /// This worker's DescribeLogStreams requests a second, at most (default
    /// [`DESCRIBE_LOG_STREAMS_PER_SECOND`]; the account's quota is 5).
    pub fn describe_log_streams_per_second(mut self, rate: f64) -> Self {
        self.listings = Arc::new(Budget::per_second(rate));
        self
    }

    /// At most this many events per page (1 to 10,000; default 1,000).
    pub fn page_limit(mut self, limit: u32) -> Self {
        self.limit = limit.clamp(1, 10_000) as i32;
        self
    }

    /// The log group.
    pub fn group(&self) -> &str {
        &self.group
    }
}

/// What a cursor of this source holds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct LogCursor {
    /// The `creationTime` of the stream read: one deleted and created again under its name is
    /// another stream, never read on from this cursor.
    #[serde(rename = "c", default, skip_serializing_if = "Option::is_none")]
    created: Option<i64>,
    /// `startTime` of every request of this traversal (a seek to a time, a recovery, an audit).
    #[serde(rename = "s", default, skip_serializing_if = "Option::is_none")]
    start: Option<i64>,
    /// A seek's time: nothing before it is handed out, late or not.
    #[serde(rename = "f", default, skip_serializing_if = "Option::is_none")]
    floor: Option<i64>,
    /// The service's forward token.
    #[serde(rename = "t", default, skip_serializing_if = "Option::is_none")]
    token: Option<String>,
    /// The last event before this cursor.
    #[serde(rename = "l", default, skip_serializing_if = "Option::is_none")]
    last: Option<Last>,
    /// Audited through this ingestion time (ms): every event behind the cursor that was
    /// ingested at or before it, and at most the late-event window late, was handed out.
    #[serde(rename = "a", default, skip_serializing_if = "Option::is_none")]
    audited: Option<i64>,
    /// Set on the cursors of an audit's pages: what the audit returns.
    #[serde(rename = "r", default, skip_serializing_if = "Option::is_none")]
    audit: Option<AuditRange>,
    /// What the attempt that stopped at this cursor handed out of the events ingested in the
    /// allowance before its mark (see [`Vouched`]); carried by the forward reads until the
    /// next audit, whose mark replaces it.
    #[serde(rename = "v", default, skip_serializing_if = "Option::is_none")]
    vouched: Option<VouchedRange>,
}

/// An audit's events: those at or before `through` (the forward cursor's last event when the
/// audit began) ingested after `after` (the forward cursor's mark), from the request's
/// `startTime` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct AuditRange {
    #[serde(rename = "a", default, skip_serializing_if = "Option::is_none")]
    after: Option<i64>,
    #[serde(rename = "l")]
    through: Last,
}

/// [`Vouched`] as a cursor carries it (its digest in hex).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct VouchedRange {
    #[serde(rename = "a")]
    after: i64,
    #[serde(rename = "t")]
    through: i64,
    #[serde(rename = "n")]
    count: u64,
    #[serde(rename = "d")]
    digest: String,
}

impl VouchedRange {
    fn of(vouched: &Vouched) -> Self {
        Self {
            after: vouched.after,
            through: vouched.through,
            count: vouched.count,
            digest: format!("{:032x}", vouched.digest),
        }
    }

    /// `None` for a digest that is not one (the cursor then vouches for nothing).
    fn vouched(&self) -> Option<Vouched> {
        Some(Vouched {
            after: self.after,
            through: self.through,
            count: self.count,
            digest: u128::from_str_radix(&self.digest, 16).ok()?,
        })
    }
}

/// An event as a cursor remembers it: where it stands in the service's order, and which one it
/// is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Last {
    #[serde(rename = "t")]
    timestamp: i64,
    #[serde(rename = "i")]
    ingestion: i64,
    /// Its place among the events of its group (same timestamp and ingestion time) as read: so
    /// many were read before it.
    k: u64,
    /// Its message's digest and its occurrence among the group's events with that message (its
    /// name); `None` in a cursor written before names were taken from the message.
    #[serde(rename = "n", default, skip_serializing_if = "Option::is_none")]
    name: Option<(u64, u64)>,
}

impl Last {
    fn group(&self) -> (i64, i64) {
        (self.timestamp, self.ingestion)
    }
}

impl LogCursor {
    /// Version 5: `v5|` and the cursor as JSON (serde), fields absent when empty.
    fn encode(&self) -> Cursor {
        Cursor::new(format!(
            "v5|{}",
            serde_json::to_string(self).expect("a cursor is plain data")
        ))
    }

    /// A cursor of any version written so far: 5 (JSON), or 1 to 4 (fields split by hand, read
    /// as they were written).
    fn decode(cursor: &Cursor) -> Result<Self, String> {
        let text = std::str::from_utf8(cursor.as_bytes())
            .map_err(|_| "a cursor of CloudWatch Logs is text".to_string())?;
        match text.strip_prefix("v5|") {
            Some(json) => serde_json::from_str(json)
                .map_err(|e| format!("`{text}` is not a cursor of CloudWatch Logs: {e}")),
            None => Self::decode_split(cursor),
        }
    }

    /// Versions 1 to 4.
    fn decode_split(cursor: &Cursor) -> Result<Self, String> {
        let text = std::str::from_utf8(cursor.as_bytes())
            .map_err(|_| "a cursor of CloudWatch Logs is text".to_string())?;
        let number = |s: &str| -> Result<Option<i64>, String> {
            if s.is_empty() {
                return Ok(None);
            }
            s.parse()
                .map(Some)
                .map_err(|_| format!("`{s}` in cursor `{text}` is not a number"))
        };
        let hex = |s: &str| {
            u64::from_str_radix(s, 16)
                .map_err(|_| format!("`{s}` in cursor `{text}` is not a digest"))
        };
        // An event: `ts:ingest:k[:digest:occurrence]` (versions 1 and 2 kept the first three in
        // fields of their own, and named an event by `k`).
        let event = |parts: &[&str]| -> Result<Option<Last>, String> {
            let (ts, ingest, k) = match parts {
                [ts, ingest, k] | [ts, ingest, k, _, _] => {
                    (number(ts)?, number(ingest)?, number(k)?)
                }
                _ => return Err(format!("cursor `{text}` names half an event")),
            };
            let name = match parts {
                [_, _, _, "", ""] => None,
                [_, _, _, digest, occurrence] => Some((
                    hex(digest)?,
                    number(occurrence)?
                        .and_then(|n| u64::try_from(n).ok())
                        .ok_or_else(|| format!("cursor `{text}` names half an event"))?,
                )),
                _ => None,
            };
            match (ts, ingest, k) {
                (Some(timestamp), Some(ingestion), Some(k)) => Ok(Some(Last {
                    timestamp,
                    ingestion,
                    k: u64::try_from(k)
                        .map_err(|_| format!("cursor `{text}` counts below zero"))?,
                    name,
                })),
                (None, None, None) if name.is_none() => Ok(None),
                _ => Err(format!("cursor `{text}` names half an event")),
            }
        };
        let audit_of = |audit: &str, with_name: bool| -> Result<Option<AuditRange>, String> {
            if audit.is_empty() {
                return Ok(None);
            }
            let parts: Vec<&str> = audit.split(':').collect();
            let expected = if with_name { 6 } else { 4 };
            if parts.len() != expected {
                return Err(format!("cursor `{text}` names half an audit"));
            }
            let through = event(&parts[1..])?
                .ok_or_else(|| format!("cursor `{text}` names an audit through nothing"))?;
            Ok(Some(AuditRange {
                after: number(parts[0])?,
                through,
            }))
        };
        // Version 4 is version 3 with the stream's creation time first.
        let (created, text) = match text.strip_prefix("v4|") {
            Some(rest) => {
                let (created, rest) = rest
                    .split_once('|')
                    .ok_or_else(|| format!("`{text}` is not a cursor of CloudWatch Logs"))?;
                (number(created)?, format!("v3|{rest}"))
            }
            None => (None, text.to_string()),
        };
        let text = text.as_str();
        // The token comes last: whatever it holds, it cannot shift the fields before it. A
        // cursor of version 1 (before audits) has no mark and no audit.
        let (start, floor, last, audited, audit, token) = if text.starts_with("v1|") {
            let fields: Vec<&str> = text.splitn(6, '|').collect();
            let [_, start, ts, ingest, k, token] = fields[..] else {
                return Err(format!("`{text}` is not a cursor of CloudWatch Logs"));
            };
            (start, None, event(&[ts, ingest, k])?, None, None, token)
        } else if text.starts_with("v2|") {
            let fields: Vec<&str> = text.splitn(9, '|').collect();
            let [_, start, floor, ts, ingest, k, audited, audit, token] = fields[..] else {
                return Err(format!("`{text}` is not a cursor of CloudWatch Logs"));
            };
            (
                start,
                number(floor)?,
                event(&[ts, ingest, k])?,
                number(audited)?,
                audit_of(audit, false)?,
                token,
            )
        } else {
            let fields: Vec<&str> = text.splitn(7, '|').collect();
            let [version, start, floor, last, audited, audit, token] = fields[..] else {
                return Err(format!("`{text}` is not a cursor of CloudWatch Logs"));
            };
            if version != "v3" {
                return Err(format!("cursor version `{version}` is unknown"));
            }
            let last = if last.is_empty() {
                None
            } else {
                let parts: Vec<&str> = last.split(':').collect();
                if parts.len() != 5 {
                    return Err(format!("cursor `{text}` names half an event"));
                }
                event(&parts)?
            };
            (
                start,
                number(floor)?,
                last,
                number(audited)?,
                audit_of(audit, true)?,
                token,
            )
        };
        Ok(Self {
            created,
            start: number(start)?,
            floor,
            token: (!token.is_empty()).then(|| token.to_string()),
            last,
            audited,
            audit,
            vouched: None,
        })
    }
}

fn millis(time: SystemTime) -> i64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A copy of `client` whose answers' `Date` goes to the returned clock: the service's time, which
/// every mark is made by (a host clock a minute ahead would mark as read what the service has not
/// yet ingested). The copy makes one attempt a call: the SDK's own retries (3 attempts by
/// default) would send requests the source's budget never sees and throttled answers
/// `shardwise_paged_throttled_total` never counts; each caller backs off and asks again itself,
/// within its budget.
pub(super) fn dated(client: &Client) -> (Client, Arc<ServiceClock>) {
    let (read_date, clock) = ReadDate::new();
    let config = client
        .config()
        .to_builder()
        .interceptor(read_date)
        .retry_config(aws_sdk_cloudwatchlogs::config::retry::RetryConfig::disabled())
        .build();
    (Client::from_conf(config), clock)
}

/// Whether a failed call may succeed if asked again: throttled, a server error, or no answer (a
/// timeout, a connection that failed). What the service refused (a missing group, bad
/// parameters) may not.
pub(super) fn transient<E: ProvideErrorMetadata>(e: &SdkError<E>) -> bool {
    match e {
        SdkError::ServiceError(service) => throttled(e) || service.raw().status().is_server_error(),
        SdkError::TimeoutError(_) | SdkError::DispatchFailure(_) | SdkError::ResponseError(_) => {
            true
        }
        _ => false,
    }
}

fn allowance_ms() -> i64 {
    i64::try_from(AUDIT_ALLOWANCE.as_millis()).unwrap_or(i64::MAX)
}

/// How long a listing of the log streams goes on asking for a throttled page again.
const LISTING_PATIENCE: Duration = Duration::from_secs(120);

/// Whether the service asked to slow down (both CloudWatch Logs sources ask this).
pub(super) fn throttled<E: ProvideErrorMetadata>(e: &SdkError<E>) -> bool {
    e.as_service_error()
        .and_then(ProvideErrorMetadata::code)
        .is_some_and(|c| c.contains("Throttl"))
}

/// Whether the service refused the request's parameters (an expired token is one).
fn refused(e: &SdkError<GetLogEventsError>) -> bool {
    matches!(
        e.as_service_error(),
        Some(GetLogEventsError::InvalidParameterException(_))
    )
}

/// Whether the stream (or the group) does not exist.
fn not_found(e: &SdkError<GetLogEventsError>) -> bool {
    matches!(
        e.as_service_error(),
        Some(GetLogEventsError::ResourceNotFoundException(_))
    )
}

fn fetch_error(e: SdkError<GetLogEventsError>) -> FetchError {
    match e.as_service_error() {
        Some(GetLogEventsError::ResourceNotFoundException(_)) => FetchError::NotFound,
        Some(GetLogEventsError::InvalidParameterException(_)) => {
            FetchError::InvalidCursor(Box::new(e))
        }
        Some(_) if throttled(&e) => FetchError::Throttled,
        _ => FetchError::Other(Box::new(e)),
    }
}

/// An event's group: its timestamp and ingestion time.
fn group(event: &OutputLogEvent) -> (i64, i64) {
    (
        event.timestamp.unwrap_or_default(),
        event.ingestion_time.unwrap_or_default(),
    )
}

fn number(n: i64) -> u64 {
    u64::try_from(n).unwrap_or_default()
}

/// The digest of a message that names its event: the first 8 bytes of its MD5, big-endian.
fn digest(message: &str) -> u64 {
    let digest = Md5::digest(message.as_bytes());
    let mut first = [0; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

fn identity(
    timestamp: i64,
    ingestion: i64,
    digest: u64,
    occurrence: u64,
) -> (String, PagePosition) {
    (
        format!("{timestamp}-{ingestion}-{digest:016x}-{occurrence}"),
        PagePosition::from_parts(&[number(timestamp), number(ingestion), digest, occurrence]),
    )
}

/// The identity and the position [`CloudWatchLogs`] gives an event of a log stream: its
/// timestamp, ingestion time and message, and `occurrence`, how many events of the stream with
/// all three the same come before it in the service's order (0 for all but exact repeats). The
/// identity reads `{timestamp}-{ingestion}-{digest}-{occurrence}`, the digest the first 8 bytes
/// of the message's MD5 in hex; the position orders by timestamp and ingestion time, and the
/// events of one group (both the same) by their names, not by the service's order (see the
/// module docs).
pub fn log_event_identity(
    timestamp: i64,
    ingestion: i64,
    message: &str,
    occurrence: u64,
) -> (String, PagePosition) {
    identity(timestamp, ingestion, digest(message), occurrence)
}

impl CloudWatchLogs {
    /// How many events with each message digest the group of `last` held up to and including
    /// it, as the service serves the group now: the count a page that goes on with the group
    /// starts from. One event is known from the cursor; more are read again (the group's
    /// timestamp only, from the head), which happens only when a page ends inside a group of
    /// several events.
    async fn names_before(
        &self,
        partition: &str,
        last: &Last,
    ) -> Result<HashMap<u64, u64>, SdkError<GetLogEventsError>> {
        let mut names = HashMap::new();
        if last.k == 0
            && let Some((digest, _)) = last.name
        {
            names.insert(digest, 1);
            return Ok(names);
        }
        let mut read = 0;
        let mut token: Option<String> = None;
        loop {
            self.reads.acquire().await;
            let page = self
                .client
                .get_log_events()
                .log_group_name(self.group.as_ref())
                .log_stream_name(partition)
                .start_from_head(true)
                .start_time(last.timestamp)
                .end_time(last.timestamp.saturating_add(1))
                .limit(AUDIT_PAGE_LIMIT)
                .set_next_token(token.clone())
                .send()
                .await?;
            for event in page.events() {
                if group(event) != last.group() {
                    continue;
                }
                if read > last.k {
                    return Ok(names);
                }
                *names
                    .entry(digest(event.message.as_deref().unwrap_or_default()))
                    .or_insert(0) += 1;
                read += 1;
            }
            match page.next_forward_token {
                Some(next)
                    if !page.events.as_ref().is_none_or(Vec::is_empty)
                        && token.as_ref() != Some(&next) =>
                {
                    token = Some(next);
                }
                _ => return Ok(names),
            }
        }
    }
}

impl CloudWatchLogs {
    /// A read of a stream whose newest event read was ingested more than [`IDLE_AFTER`] ago (by
    /// the service's time) lets reads of busy streams go first: hundreds of silent streams
    /// polled until they retire would otherwise delay the busy streams' audits by the whole
    /// queue. A stream never read is busy (a new stream is read at once).
    fn priority(&self, at: &LogCursor) -> Priority {
        let newest = at
            .audit
            .map(|audit| audit.through.ingestion)
            .or(at.last.map(|last| last.ingestion));
        let idle_after = i64::try_from(IDLE_AFTER.as_millis()).unwrap_or(i64::MAX);
        match (newest, self.service_ms()) {
            (Some(newest), Some(now)) if newest < now.saturating_sub(idle_after) => Priority::Idle,
            _ => Priority::Busy,
        }
    }

    async fn get_log_events(
        &self,
        partition: &str,
        at: &LogCursor,
    ) -> Result<GetLogEventsOutput, SdkError<GetLogEventsError>> {
        self.reads.acquire_as(self.priority(at)).await;
        // An audit reads through its last event's timestamp (`endTime` is exclusive).
        let end = at.audit.map(|a| a.through.timestamp.saturating_add(1));
        self.client
            .get_log_events()
            .log_group_name(self.group.as_ref())
            .log_stream_name(partition)
            .start_from_head(true)
            .limit(if end.is_some() {
                AUDIT_PAGE_LIMIT
            } else {
                self.limit
            })
            .set_start_time(at.start)
            .set_end_time(end)
            .set_next_token(at.token.clone())
            .send()
            .await
    }
}

impl CloudWatchLogs {
    /// The service's time now (ms), once an answer carried a date.
    fn service_ms(&self) -> Option<i64> {
        self.clock.reached().map(crate::time::millis)
    }

    /// The creation time of the stream `partition` names, as the newest listing or look-up saw
    /// it.
    fn listed_creation(&self, partition: &str) -> Option<i64> {
        self.created
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(partition)
            .copied()
    }

    /// The creation time of the stream `partition` names now (`None`: there is none), asked of
    /// the service for that stream alone (one DescribeLogStreams by its name), and remembered.
    async fn creation_of(
        &self,
        partition: &str,
    ) -> Result<Option<i64>, SdkError<DescribeLogStreamsError>> {
        self.listings.acquire().await;
        let page = self
            .client
            .describe_log_streams()
            .log_group_name(self.group.as_ref())
            .log_stream_name_prefix(partition)
            .send()
            .await?;
        let found = page
            .log_streams()
            .iter()
            .find(|s| s.log_stream_name() == Some(partition));
        let created = found.and_then(|s| s.creation_time());
        let ingested = found.and_then(|s| s.last_ingestion_time());
        {
            let mut known = self
                .ingested
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match ingested {
                Some(at) => known.insert(partition.to_string(), at),
                None => known.remove(partition),
            };
        }
        let mut known = self
            .created
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match created {
            Some(at) => known.insert(partition.to_string(), at),
            None => known.remove(partition),
        };
        Ok(created)
    }

    /// The stream a cursor of `partition` read was deleted, and one of its name created since
    /// (counted and logged once, by the forward read, not by an audit that meets it first).
    fn recreated(&self, partition: &str, at: &LogCursor) -> FetchError {
        if at.audit.is_some() {
            return FetchError::Gone;
        }
        metrics::counter!("shardwise_paged_partitions_recreated_total", "source" => self.name.to_string()).increment(1);
        warn!(source = %self.name, partition, "the log stream read was deleted and one of its name created since: the old one's partition ends, and the new stream is read from its start");
        FetchError::Gone
    }
}

impl PagedSource for CloudWatchLogs {
    fn name(&self) -> &str {
        &self.name
    }

    fn service_time(&self) -> Option<SystemTime> {
        self.clock.reached()
    }

    /// Events of one timestamp and ingestion time form a group (positions share their first
    /// 16 bytes).
    fn contract(&self) -> Contract {
        Contract::default().groups(16).names_reused()
    }

    /// The log group's retention ([`DELETION_DELAY`] and 2 hours added); "never expire" keeps
    /// events for good.
    fn retention(&self) -> BoxFuture<'_, Result<crate::receipts::SourceRetention, Error>> {
        Box::pin(group_retention(
            &self.client,
            &self.group,
            &self.name,
            &self.kept,
        ))
    }

    /// The group's `retentionInDays`, described with the listing at most hourly.
    fn deletes_after(&self) -> Option<Duration> {
        self.kept.deletes_after()
    }

    /// Every log stream of the group, page by page. A throttled (or failed) page is asked again
    /// after a back-off (the pages read so far are kept) for up to 2 minutes from the last page
    /// answered: the
    /// account's DescribeLogStreams quota (5 requests a second) is shared by every worker, and a
    /// listing that gave up at the first throttled page would never finish for a group of many
    /// streams. A listing is complete or an error, never a part: a stream missing from it would
    /// read as a stream that is gone.
    fn partitions(&self) -> BoxFuture<'_, Result<Vec<String>, Error>> {
        Box::pin(async move {
            let failed = |e: SdkError<DescribeLogStreamsError>| Error::Paged {
                source_name: self.name.to_string(),
                partition: String::new(),
                what: "listing the log streams failed",
                source: Box::new(e),
            };
            // Patience counts from the last page answered: a listing of hundreds of pages at the
            // budget's pace goes on as long as each page comes within it.
            // The group's retention, for the signal of reading behind it (hourly; a failure
            // leaves the last one known).
            if self.kept.stale()
                && let Err(e) =
                    group_retention(&self.client, &self.group, &self.name, &self.kept).await
            {
                debug!(source = %self.name, error = &e as &dyn std::error::Error, "describing the log group for its retention failed");
            }
            let mut patience = tokio::time::Instant::now() + LISTING_PATIENCE;
            let mut waits = Backoff::new(Duration::from_secs(5));
            let mut names = Vec::new();
            let mut created = HashMap::new();
            let mut ingested = HashMap::new();
            let mut token: Option<String> = None;
            loop {
                self.listings.acquire().await;
                let page = match self
                    .client
                    .describe_log_streams()
                    .log_group_name(self.group.as_ref())
                    .set_next_token(token.clone())
                    .send()
                    .await
                {
                    Ok(page) => page,
                    Err(e) if transient(&e) && tokio::time::Instant::now() < patience => {
                        if throttled(&e) {
                            metrics::counter!("shardwise_paged_throttled_total", "source" => self.name.to_string()).increment(1);
                        }
                        let wait = waits.next();
                        debug!(source = %self.name, streams = names.len(), ?wait, error = %DisplayErrorContext(&e), "a page of the log streams' listing failed; asking for it again");
                        tokio::time::sleep(wait).await;
                        continue;
                    }
                    Err(e) => return Err(failed(e)),
                };
                waits.reset();
                patience = tokio::time::Instant::now() + LISTING_PATIENCE;
                for stream in page.log_streams() {
                    if let Some(name) = stream.log_stream_name() {
                        names.push(name.to_string());
                        if let Some(at) = stream.creation_time() {
                            created.insert(name.to_string(), at);
                        }
                        if let Some(at) = stream.last_ingestion_time() {
                            ingested.insert(name.to_string(), at);
                        }
                    }
                }
                match page.next_token {
                    // The same token again would be a loop: the listing ends there.
                    Some(next) if token.as_ref() != Some(&next) => token = Some(next),
                    _ => break,
                }
            }
            names.sort();
            names.dedup();
            // A complete listing: what it does not name no longer exists.
            *self
                .created
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = created;
            *self
                .ingested
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = ingested;
            Ok(names)
        })
    }

    /// One DescribeLogStreams by the stream's name (its prefix), not a listing of the group:
    /// deleting a thousand streams costs a thousand requests, not a thousand listings.
    fn listed<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            self.creation_of(partition)
                .await
                .map(|created| created.is_some())
                .map_err(|e| Error::Paged {
                    source_name: self.name.to_string(),
                    partition: partition.to_string(),
                    what: "looking up the log stream failed",
                    source: Box::new(e),
                })
        })
    }

    fn fetch<'a>(
        &'a self,
        partition: &'a str,
        cursor: Option<&'a Cursor>,
    ) -> BoxFuture<'a, Result<Page, FetchError>> {
        Box::pin(async move {
            let mut at = match cursor {
                Some(c) => LogCursor::decode(c).map_err(|e| FetchError::InvalidCursor(e.into()))?,
                None => LogCursor::default(),
            };
            // The stream the cursor reads, by its creation time: a cursor without one (a first
            // page, a seek, a cursor of an older version) takes the listed stream's.
            let listed = self.listed_creation(partition);
            match (at.created, listed) {
                (Some(read), Some(now)) if read != now => {
                    return Err(self.recreated(partition, &at));
                }
                (None, now) => at.created = now,
                _ => {}
            }
            if let Some(audit) = at.audit
                && at
                    .start
                    .is_some_and(|start| start > audit.through.timestamp)
            {
                // An audit with nothing to read (its window is empty).
                return Ok(Page::default());
            }
            // After a recovery, the event the refused token came after: what the read from its
            // time returns up to it lies behind the cursor.
            let mut behind: Option<Last> = None;
            let output = match self.get_log_events(partition, &at).await {
                // Not found, or its token refused: first, whether a stream of its name was
                // created since (the one read is then gone for good).
                Err(e) if not_found(&e) || (at.token.is_some() && refused(&e)) => {
                    if let (Some(read), Ok(Some(now))) =
                        (at.created, self.creation_of(partition).await)
                        && read != now
                    {
                        return Err(self.recreated(partition, &at));
                    }
                    if not_found(&e) {
                        Err(e)
                    } else {
                        // An expired (or otherwise refused) token: read again from the last
                        // event's time, from the head, and go on after that event.
                        let from = at.last.map(|l| l.timestamp).or(at.start);
                        warn!(source = %self.name, partition, from, audit = at.audit.is_some(), error = %DisplayErrorContext(&e), "the service refused the cursor's token; reading the stream again from the last event's time");
                        metrics::counter!("shardwise_paged_cursor_recoveries_total", "source" => self.name.to_string()).increment(1);
                        behind = at.last;
                        at = LogCursor {
                            start: from,
                            token: None,
                            // The read starts at a group's first event: names are counted afresh.
                            last: None,
                            ..at
                        };
                        self.get_log_events(partition, &at).await
                    }
                }
                answer => answer,
            }
            .map_err(fetch_error)?;
            // The page may go on with the group (same timestamp and ingestion time) of the
            // cursor's last event: its names count the group's messages read before the page.
            let mut names = match (output.events().first(), at.last) {
                (Some(first), Some(before)) if group(first) == before.group() => self
                    .names_before(partition, &before)
                    .await
                    .map_err(fetch_error)?,
                _ => HashMap::new(),
            };
            let mut last = at.last;
            let read: Vec<Last> = output
                .events()
                .iter()
                .map(|event| {
                    let (timestamp, ingestion) = group(event);
                    let k = match last {
                        Some(before) if before.group() == (timestamp, ingestion) => before.k + 1,
                        _ => {
                            names.clear();
                            0
                        }
                    };
                    let digest = digest(event.message.as_deref().unwrap_or_default());
                    let seen = names.entry(digest).or_insert(0);
                    let this = Last {
                        timestamp,
                        ingestion,
                        k,
                        name: Some((digest, *seen)),
                    };
                    *seen += 1;
                    last = Some(this);
                    this
                })
                .collect();
            // Behind a recovered cursor: the groups before its event's, and in that group the
            // events up to it in the service's order, found by its name. Were it gone, or an
            // exact repeat (whose name a deleted twin may have shifted), the whole group is
            // handed out again: never skipped for a line that does not repeat.
            let pass = behind.map_or(0, |b| {
                let earlier = read.iter().take_while(|e| e.group() < b.group()).count();
                let Some((digest, 0)) = b.name else {
                    return earlier;
                };
                let mut twins = read.iter().enumerate().filter(|(_, e)| {
                    e.group() == b.group() && e.name.is_some_and(|n| n.0 == digest)
                });
                match (twins.next(), twins.next()) {
                    (Some((at, _)), None) => at + 1,
                    _ => earlier,
                }
            });
            let mut beyond = false;
            let mut events = Vec::with_capacity(output.events().len() - pass);
            for (event, this) in output.events().iter().zip(&read).skip(pass) {
                let mut through = false;
                if let Some(audit) = at.audit {
                    // An audit returns what may be late: at or before the event the forward
                    // cursor had read when it began, ingested after the previous audit's mark.
                    // In that event's group the service's order decides: the audit ends with
                    // it (were it gone, the rest of the group comes too, which is harmless).
                    if this.group() > audit.through.group() {
                        beyond = true;
                        break;
                    }
                    through =
                        this.group() == audit.through.group() && this.name == audit.through.name;
                    if audit.after.is_some_and(|after| this.ingestion <= after) {
                        if through {
                            beyond = true;
                            break;
                        }
                        continue;
                    }
                }
                let (digest, occurrence) = this.name.unwrap_or_default();
                let (id, position) = identity(this.timestamp, this.ingestion, digest, occurrence);
                events.push(PagedEvent {
                    id,
                    position,
                    payload: Bytes::from(event.message.clone().unwrap_or_default()),
                    timestamp: Some(UNIX_EPOCH + Duration::from_millis(number(this.timestamp))),
                    key: None,
                });
                if through {
                    beyond = true;
                    break;
                }
            }
            let given = at.token.clone();
            let token = output.next_forward_token.clone();
            if at.audit.is_some() && (beyond || token.is_none() || token == given) {
                // The audit read its window to the end: the end of the stream's events before
                // its `endTime` (the same token back), or past its last event.
                return Ok(Page {
                    events,
                    next: None,
                    watermark: None,
                });
            }
            // The first forward read of a cursor without a mark marks it: every event ingested
            // before now (less the allowance) is behind the cursor or ahead of it in this read.
            // By the service's time (this answer's `Date`): without one, the cursor is marked by
            // a later read.
            let audited = at.audited.or_else(|| {
                let late = self.late_events.filter(|_| at.audit.is_none())?;
                let now = self.service_ms()?;
                Some(late.mark(now, last.map(|l| l.ingestion)))
            });
            let next = LogCursor {
                created: at.created,
                start: at.start,
                floor: at.floor,
                // A token missing from the answer keeps the request's: fetched again after a
                // back-off.
                token: token.or(given),
                last,
                audited,
                audit: at.audit,
                vouched: at.vouched.clone(),
            };
            Ok(Page {
                events,
                next: Some(next.encode()),
                watermark: None,
            })
        })
    }

    fn audit_interval(&self) -> Option<Duration> {
        self.late_events.map(|late| late.every)
    }

    /// An audit behind the forward cursor: the events ingested after its mark, with timestamps
    /// from the mark less the window (an event at most the window late, ingested after the mark,
    /// has no earlier timestamp) through the cursor's last event. The audited cursor is marked
    /// with the audit's start less [`AUDIT_ALLOWANCE`]. A cursor without a mark (written before
    /// audits) is only marked: what was put behind it before is not looked for.
    fn audit(&self, _partition: &str, cursor: &Cursor) -> Option<Audit> {
        let late = self.late_events?;
        let at = LogCursor::decode(cursor).ok()?;
        if at.audit.is_some() {
            return None;
        }
        let through = at.last?;
        // The service's time: a mark by a host clock ahead of it would vouch for events it has
        // not ingested yet. Before an answer carried a date, nothing is audited.
        let now = self.service_ms()?;
        let mark = late.mark(now, Some(through.ingestion));
        let then = LogCursor {
            audited: Some(at.audited.map_or(mark, |a| a.max(mark))),
            // The new mark passes what was vouched for.
            vouched: None,
            ..at.clone()
        };
        // What the attempt that stopped at this cursor vouched for, of the range after its mark.
        let vouched = at
            .vouched
            .as_ref()
            .filter(|v| Some(v.after) == at.audited)
            .and_then(VouchedRange::vouched);
        let window = i64::try_from(late.window.as_millis()).unwrap_or(i64::MAX);
        let start = match at.audited {
            Some(after) => after
                .saturating_sub(window)
                .max(now.saturating_sub(MAX_EVENT_AGE_MS))
                .max(at.floor.unwrap_or(i64::MIN)),
            // Nothing to look for: a start past the window's end reads nothing.
            None => through.timestamp.saturating_add(1),
        };
        let pages = LogCursor {
            created: at.created,
            start: Some(start),
            floor: None,
            token: None,
            last: None,
            audited: None,
            audit: Some(AuditRange {
                after: at.audited,
                through,
            }),
            vouched: None,
        };
        // What this audit's mark leaves to the next audit was handed out at most this long
        // before this audit began, and the allowance after.
        let lag = Duration::from_millis(u64::try_from(now - mark).unwrap_or(0));
        Some(
            Audit::new(pages.encode(), then.encode(), lag + AUDIT_ALLOWANCE)
                .quiet(AUDIT_ALLOWANCE * 2)
                .vouched(vouched),
        )
    }

    /// Streams retire after [`retire_after`](CloudWatchLogs::retire_after) without news (1
    /// hour by default), when late events are audited.
    fn retire_after(&self) -> Option<Duration> {
        self.late_events?;
        self.retire_after
    }

    /// The forward cursor's audit mark: every event ingested at or before it (and at most the
    /// late-event window late) was handed out.
    fn read_through(&self, cursor: &Cursor) -> Option<i64> {
        self.late_events?;
        let at = LogCursor::decode(cursor).ok()?;
        if at.audit.is_some() {
            return None;
        }
        at.audited
    }

    /// The stream's `lastIngestionTime`, as the newest listing (or look-up) gave it.
    fn last_activity(&self, partition: &str) -> Option<i64> {
        self.ingested
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(partition)
            .copied()
    }

    /// The allowance before an audited cursor's mark: events ingested in it may have been read
    /// forward (or by the audit) and come back in the next audit.
    fn vouch_range(&self, cursor: &Cursor) -> Option<(i64, i64)> {
        self.late_events?;
        let at = LogCursor::decode(cursor).ok()?;
        if at.audit.is_some() {
            return None;
        }
        let mark = at.audited?;
        Some((mark, mark.saturating_add(allowance_ms())))
    }

    fn vouch(&self, cursor: &Cursor, vouched: &Vouched) -> Option<Cursor> {
        let at = LogCursor::decode(cursor).ok()?;
        if at.audit.is_some() || at.audited != Some(vouched.after) {
            return None;
        }
        Some(
            LogCursor {
                vouched: Some(VouchedRange::of(vouched)),
                ..at
            }
            .encode(),
        )
    }

    /// With audits: every event after the durable cursor was read after its mark was made (the
    /// forward read or the audit that made it began after it), and an audit returns only events
    /// ingested after it.
    fn bounds_replays(&self) -> bool {
        self.late_events.is_some()
    }

    /// The durable cursor's audit mark.
    fn receipts_needed_since(&self, progress: &super::PagedProgress) -> Option<i64> {
        self.late_events?;
        LogCursor::decode(progress.resume_cursor.as_ref()?)
            .ok()?
            .audited
    }

    /// The ingestion time the event's position carries (its second part).
    fn ingested(&self, event: &PagedEvent) -> Option<i64> {
        let bytes: [u8; 8] = event.position.as_bytes().get(8..16)?.try_into().ok()?;
        i64::try_from(u64::from_be_bytes(bytes)).ok()
    }

    fn cursor_at(&self, _partition: &str, time: SystemTime) -> Option<Cursor> {
        Some(
            LogCursor {
                start: Some(millis(time)),
                floor: Some(millis(time)),
                ..LogCursor::default()
            }
            .encode(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mark_passes_neither_the_newest_ingestion_read_nor_the_allowance() {
        let late = LateEvents {
            window: LATE_EVENT_WINDOW,
            every: LATE_EVENT_AUDIT_INTERVAL,
            readable_within: Duration::from_secs(600),
        };
        let now = 10_000_000;
        // A busy stream read up to a second ago: the allowance.
        assert_eq!(late.mark(now, Some(now - 1_000)), now - 30_000);
        // Reads lagging 3 minutes behind the service: what they showed.
        assert_eq!(late.mark(now, Some(now - 180_000)), now - 180_000);
        // Nothing recent, or nothing read: the bound.
        assert_eq!(late.mark(now, Some(now - 3_600_000)), now - 600_000);
        assert_eq!(late.mark(now, None), now - 600_000);
        // A bound shorter than the allowance: the allowance.
        let short = LateEvents {
            readable_within: Duration::from_secs(10),
            ..late
        };
        assert_eq!(short.mark(now, None), now - 30_000);
    }

    fn last(timestamp: i64, ingestion: i64, k: u64, name: Option<(u64, u64)>) -> Last {
        Last {
            timestamp,
            ingestion,
            k,
            name,
        }
    }

    #[test]
    fn cursors_round_trip_and_bad_ones_are_refused() {
        let cursors = [
            LogCursor::default(),
            LogCursor {
                start: Some(1_764_000_000_000),
                ..LogCursor::default()
            },
            LogCursor {
                created: Some(1_762_000_000_000),
                start: None,
                floor: Some(1_763_000_000_000),
                token: Some(
                    "f/00000000000000000000000000000000000000000000000000000009|odd".into(),
                ),
                last: Some(last(
                    1_764_000_000_123,
                    1_764_000_000_200,
                    2,
                    Some((0xfedc_ba98_7654_3210, 1)),
                )),
                audited: Some(1_764_000_000_500),
                audit: None,
                vouched: Some(VouchedRange::of(&Vouched {
                    after: 1_764_000_000_500,
                    through: 1_764_000_030_500,
                    count: 3,
                    digest: u128::MAX - 7,
                })),
            },
            LogCursor {
                created: None,
                start: Some(1_763_996_400_500),
                floor: None,
                token: Some("f/1".into()),
                last: Some(last(1_764_000_000_100, 1_764_000_000_100, 0, Some((7, 0)))),
                audited: None,
                audit: Some(AuditRange {
                    after: Some(1_764_000_000_500),
                    through: last(1_764_000_000_123, 1_764_000_000_200, 2, Some((1, 2))),
                }),
                vouched: None,
            },
            // An event carried over from a cursor of version 2 keeps having no name.
            LogCursor {
                last: Some(last(5, 6, 0, None)),
                audit: Some(AuditRange {
                    after: None,
                    through: last(5, 6, 0, None),
                }),
                ..LogCursor::default()
            },
        ];
        for cursor in cursors {
            assert_eq!(LogCursor::decode(&cursor.encode()).unwrap(), cursor);
        }
        // Cursors written before: version 1 (no mark) and 2 (events named by their place).
        assert_eq!(
            LogCursor::decode(&Cursor::new("v1||5|6|0|f/1")).unwrap(),
            LogCursor {
                token: Some("f/1".into()),
                last: Some(last(5, 6, 0, None)),
                ..LogCursor::default()
            }
        );
        assert_eq!(
            LogCursor::decode(&Cursor::new("v2|7|8|5|6|1|9|10:5:6:1|f/1")).unwrap(),
            LogCursor {
                created: None,
                start: Some(7),
                floor: Some(8),
                token: Some("f/1".into()),
                last: Some(last(5, 6, 1, None)),
                audited: Some(9),
                audit: Some(AuditRange {
                    after: Some(10),
                    through: last(5, 6, 1, None),
                }),
                vouched: None,
            }
        );
        // Version 4: version 3 with the stream's creation time first.
        assert_eq!(
            LogCursor::decode(&Cursor::new(
                "v4|1762000000000|7||5:6:1:00000000000000ff:0|9||f/1"
            ))
            .unwrap(),
            LogCursor {
                created: Some(1_762_000_000_000),
                start: Some(7),
                token: Some("f/1".into()),
                last: Some(last(5, 6, 1, Some((0xff, 0)))),
                audited: Some(9),
                ..LogCursor::default()
            }
        );
        // Version 3 (no creation time) is read as a cursor of a stream of unknown creation.
        assert_eq!(
            LogCursor::decode(&Cursor::new("v3|7||5:6:1:00000000000000ff:0|||f/1")).unwrap(),
            LogCursor {
                start: Some(7),
                token: Some("f/1".into()),
                last: Some(last(5, 6, 1, Some((0xff, 0)))),
                ..LogCursor::default()
            }
        );
        for bad in [
            "v5|{}x",
            "v5|{\"q\":1}",
            "v5|{\"l\":{\"t\":1}}",
            "v5||||||",
            "v4|x||||||",
            "v4",
            "v3|x|||||",
            "v3|||5:6|||",
            "v3|||5:6:0:zz:0|||f/1",
            "v3|||5:6:0:1:|||f/1",
            "v3|||||1:5:6:0:1|",
            "v3|||||:|",
            "v2|x|||||||",
            "v2|||||||",
            "v2|||5|||||f/1",
            "v2|||||||1:2|",
            "v2|||||||:|",
            "v1|x||||",
            "v1||5|||f/1",
            "v1||f/1",
        ] {
            assert!(LogCursor::decode(&Cursor::new(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_event_is_named_by_its_message_and_placed_in_its_group() {
        let (id, position) = log_event_identity(1_764_000_000_123, 1_764_000_000_200, "hello", 1);
        // md5("hello") = 5d41402abc4b2a76b9719d911017c592
        assert_eq!(id, "1764000000123-1764000000200-5d41402abc4b2a76-1");
        assert_eq!(
            position,
            PagePosition::from_parts(&[
                1_764_000_000_123,
                1_764_000_000_200,
                0x5d41_402a_bc4b_2a76,
                1
            ])
        );
        // Its group's prefix: below every member, above every earlier group.
        let group = position.prefix(16);
        assert!(group < position);
        assert!(
            PagePosition::from_parts(&[1_764_000_000_123, 1_764_000_000_199, u64::MAX, 9]) < group
        );
    }
}
