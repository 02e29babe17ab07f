//! Paged event sources: partitioned APIs read page by page with an opaque continuation cursor
//! (CloudWatch Logs' `GetLogEvents`, an HTTP events endpoint), leased, tracked and checkpointed like
//! Kinesis shards.
//!
//! A partition is read from its durable `resume_cursor`. Each page's next cursor stays in memory
//! until every event of that page has a durable terminal outcome; only then does a page barrier
//! replace `resume_cursor`, by a compare-and-swap on the cursor and `checkpoint_version` the page
//! was fetched with. Between barriers, `applied_position` records the end of the source-ordered
//! prefix whose events are durable, so a retried page knows which of its events are replays. See
//! `docs/paged.md` for the row, the states and every write's condition.
//!
//! A cursor is opaque to shardwise: it is stored and handed back, and compared for equality only
//! (a cursor that comes back unchanged means nothing new: back off), never parsed, ordered or
//! incremented. Positions, which the source defines, are what orders events.
//!
//! A source that can resume only by timestamp declares [`Contract::timestamps`]: its partitions
//! are polled strictly after the durable `closed_through` ([`PagedSource::poll_after`]) and
//! checkpointed by closing timestamp groups when the declared [`Traversal`] and [`Finality`]
//! contracts prove them complete (seed 000).

mod barrier;
#[cfg(feature = "cloudwatch-logs")]
mod budget;
#[cfg(feature = "cloudwatch-logs")]
mod cloudwatch;
#[cfg(feature = "cloudwatch-logs")]
mod cloudwatch_filter;
mod groups;
mod lister;
mod order;
pub(crate) mod reader;

use std::fmt;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::future::BoxFuture;
use smallvec::SmallVec;

use crate::error::BoxError;

pub(crate) use barrier::{Barrier, BarrierWrite};
#[cfg(feature = "cloudwatch-logs")]
pub use cloudwatch::{
    AUDIT_ALLOWANCE, CloudWatchLogs, DELETION_DELAY, DESCRIBE_LOG_STREAMS_PER_SECOND,
    GET_LOG_EVENTS_PER_SECOND, LATE_EVENT_AUDIT_INTERVAL, LATE_EVENT_WINDOW, READABLE_WITHIN,
    RETIRE_AFTER, log_event_identity,
};
#[cfg(feature = "cloudwatch-logs")]
pub use cloudwatch_filter::{
    CLOUDWATCH_LATENESS, CloudWatchLogsFilter, FILTER_AUDIT_INTERVAL, FILTER_CATCH_UP_STEP,
    FILTER_CLOSE_HORIZON, FILTER_LATENESS, FILTER_LOG_EVENTS_PER_SECOND,
};
pub use groups::{Finality, Traversal};
pub(crate) use groups::{Groups, Seen};
pub(crate) use lister::PartitionLister;
pub use order::OrderError;
pub(crate) use order::{Order, Verdict};

/// A provider's continuation token, as the source encodes it: opaque bytes.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Cursor(Bytes);

impl Cursor {
    /// A cursor holding these bytes.
    pub fn new(bytes: impl Into<Bytes>) -> Self {
        Self(bytes.into())
    }

    /// The bytes, for the source that made them.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Cursor({self})")
    }
}

impl fmt::Display for Cursor {
    /// The bytes as text when they are printable, otherwise in hex.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match std::str::from_utf8(&self.0) {
            Ok(text) if text.chars().all(|c| !c.is_control()) => f.write_str(text),
            _ => self.0.iter().try_for_each(|b| write!(f, "{b:02x}")),
        }
    }
}

/// Where an event stands in its partition's total order, as the source defines it: bytes compared
/// byte by byte (DynamoDB compares binary attributes the same way). Build one from a number with
/// [`from_u64`](Self::from_u64), from several with [`from_parts`](Self::from_parts).
///
/// Up to 24 bytes (three numbers) are held inline: a position is cloned into the order check, the
/// tracker and the delivery of every event, and those clones allocate nothing.
#[derive(PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PagePosition(SmallVec<[u8; 24]>);

impl Clone for PagePosition {
    /// A copy of the bytes (`SmallVec`'s own clone collects them one by one).
    fn clone(&self) -> Self {
        Self(SmallVec::from_slice(&self.0))
    }
}

impl PagePosition {
    /// These bytes, in this order.
    pub fn from_bytes(bytes: impl Into<Bytes>) -> Self {
        Self(SmallVec::from_slice(&bytes.into()))
    }

    /// A number: eight bytes, big-endian, so byte order is numeric order.
    pub fn from_u64(n: u64) -> Self {
        Self(SmallVec::from_slice(&n.to_be_bytes()))
    }

    /// Several numbers, compared in turn (each eight bytes, big-endian).
    pub fn from_parts(parts: &[u64]) -> Self {
        Self(parts.iter().flat_map(|p| p.to_be_bytes()).collect())
    }

    /// The number of a position made by [`from_u64`](Self::from_u64).
    pub fn as_u64(&self) -> Option<u64> {
        Some(u64::from_be_bytes(self.0.as_ref().try_into().ok()?))
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Its first `len` bytes (all of it when shorter): the group it belongs to, which sorts
    /// before every member of the group and after every position of an earlier group.
    pub(crate) fn prefix(&self, len: usize) -> Self {
        Self(SmallVec::from_slice(&self.0[..len.min(self.0.len())]))
    }
}

impl fmt::Debug for PagePosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PagePosition({self})")
    }
}

impl fmt::Display for PagePosition {
    /// A number as a number, several as `a.b.c`, anything else in hex.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.0.is_empty() && self.0.len().is_multiple_of(8) {
            for (i, chunk) in self.0.chunks(8).enumerate() {
                let n = u64::from_be_bytes(chunk.try_into().expect("eight bytes"));
                if i > 0 {
                    f.write_str(".")?;
                }
                write!(f, "{n}")?;
            }
            return Ok(());
        }
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// One event of a page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedEvent {
    /// Its stable identity within the partition: the same every time the event is read, whatever
    /// page it comes in. Receipts are keyed by it.
    pub id: String,
    /// Its place in the partition's total order.
    pub position: PagePosition,
    /// The payload.
    pub payload: Bytes,
    /// When it happened, if the source says.
    pub timestamp: Option<SystemTime>,
    /// Events with the same key are handled one at a time, in order; `None` orders it against
    /// nothing (lanes run it whenever one is free).
    pub key: Option<String>,
}

/// One answer of a fetch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Page {
    /// The events, in the partition's order.
    pub events: Vec<PagedEvent>,
    /// Where the next fetch continues; `None` once the partition has ended and will have no more
    /// events (most sources never end a partition). For a source read by timestamp
    /// ([`Contract::timestamps`]), `None` ends one poll's traversal instead: the next poll starts
    /// again from [`PagedSource::poll_after`].
    pub next: Option<Cursor>,
    /// The provider's finality watermark (ms since the Unix epoch), when it reports one: no event
    /// at or before it can still arrive in this partition. Only a source whose contract says so
    /// ([`Finality::Watermark`]) is believed.
    pub watermark: Option<i64>,
}

/// What an empty page with a new cursor means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EmptyPages {
    /// A page that happens to hold nothing: its cursor is followed, and promoted like any page's
    /// (the provider documents that the new cursor skips nothing).
    ZeroItems,
    /// Nothing can be concluded: the new cursor is not followed; the same cursor is fetched again
    /// after a back-off.
    Refetch,
}

/// What a source promises about its partitions; the consumer acts on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Contract {
    /// What an empty page with a new cursor means.
    pub empty_pages: EmptyPages,
    /// Events may appear later at positions at or below ones already read (late backfills). Then a
    /// position at or below the applied prefix proves nothing: only a receipt shows an event
    /// already has its outcome, and a position below the last one read is a backfill, not a
    /// regression.
    pub backfill: bool,
    /// Positions are consecutive numbers ([`PagePosition::from_u64`]): a jump over a number is a gap
    /// the source forbids, and stops the partition.
    pub dense: bool,
    /// The source can resume only by timestamp (seed 000): each poll reads, from
    /// [`PagedSource::poll_after`], every event strictly after the partition's `closed_through`,
    /// and a timestamp's group closes only as these contracts allow. `None`: a source of
    /// continuation cursors, read by the page barrier.
    pub timestamps: Option<Timestamps>,
    /// Events whose positions share their first this many bytes form a group (for CloudWatch
    /// Logs, the events of a stream with one timestamp and one ingestion time): the source
    /// returns a group's events in an order of its own, and the provider may delete some of them
    /// while others stay. Progress then counts whole groups: the applied position never claims
    /// part of one (it is written as the group's prefix, the bytes every member starts with,
    /// once every earlier group settled), an event is a replay only when its group lies wholly
    /// below it, and an event of the group last read that this attempt did not hand out is
    /// handed out wherever it comes. `None`: every position stands alone.
    pub groups: Option<usize>,
    /// A partition's name may be given to a new partition once the old one is gone (CloudWatch
    /// Logs: a log stream deleted and created again). Such a source ends a partition only when it
    /// is gone, so a row at SHARD_END that nobody holds is a gone partition's, left behind when
    /// its owner stopped, or failed a write, between the writes that end it (SHARD_END, then the
    /// row's deletion): lease scans delete it, and a partition listed under its name gets a new
    /// row and is read from its start. `false`: an ended partition's row stays while the source
    /// lists it (a partition that ended by itself is never read again).
    pub names_reused: bool,
}

/// What a source read by timestamp promises: whether a poll enumerates every event of a
/// timestamp, and what proves a timestamp final. The consumer closes a group only when both give
/// the observation its meaning (`docs/paged.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Timestamps {
    /// Whether one poll can enumerate every event of a timestamp.
    pub traversal: Traversal,
    /// What proves that no earlier event can still arrive.
    pub finality: Finality,
    /// How far behind `closedThrough` the late-event audit reads again (default
    /// [`AUDIT_WINDOW`]): an event that arrives later than the finality contract allows, but
    /// within this much behind `closedThrough`, is found and handed out.
    pub audit_window: Duration,
    /// How long after its ingestion an event may take to become readable when the source makes
    /// its events readable in the order they were ingested (CloudWatch Logs' index: AWS states
    /// no bound). With it, an audit never vouches for an event ingested after the newest one it
    /// read, nor, when it read nothing that recent, for this last span (see [`vouched_through`]).
    /// `None` (the default): an event is readable within the [`Finality::Lateness`] bound.
    pub readable_within: Option<Duration>,
}

impl Timestamps {
    /// These contracts, audited [`AUDIT_WINDOW`] behind `closedThrough`.
    pub fn new(traversal: Traversal, finality: Finality) -> Self {
        Self {
            traversal,
            finality,
            audit_window: AUDIT_WINDOW,
            readable_within: None,
        }
    }

    /// Declares that events become readable in the order they were ingested, each within
    /// `within` of its ingestion (see [`Timestamps::readable_within`](Self#structfield.readable_within)).
    pub fn readable_within(mut self, within: Duration) -> Self {
        self.readable_within = Some(within);
        self
    }

    /// Audits `window` behind `closedThrough` for late events (the identities of that window's
    /// events are kept in memory, about 16 bytes each).
    pub fn audit_window(mut self, window: Duration) -> Self {
        self.audit_window = window;
        self
    }

    /// Whether a group can ever be closed under them: a complete traversal and some finality.
    pub fn can_close(&self) -> bool {
        self.traversal == Traversal::Complete && self.finality != Finality::Unproven
    }
}

impl Default for Contract {
    /// Zero-item empty pages, no backfills, positions with gaps allowed.
    fn default() -> Self {
        Self {
            empty_pages: EmptyPages::ZeroItems,
            backfill: false,
            dense: false,
            timestamps: None,
            groups: None,
            names_reused: false,
        }
    }
}

impl Contract {
    /// Sets what an empty page with a new cursor means.
    pub fn empty_pages(mut self, empty_pages: EmptyPages) -> Self {
        self.empty_pages = empty_pages;
        self
    }

    /// Sets whether events may be backfilled below positions already read.
    pub fn backfill(mut self, backfill: bool) -> Self {
        self.backfill = backfill;
        self
    }

    /// Sets whether positions are consecutive numbers.
    pub fn dense(mut self, dense: bool) -> Self {
        self.dense = dense;
        self
    }

    /// Declares that events whose positions share their first `prefix` bytes form a group (see
    /// [`Contract::groups`](Self#structfield.groups)).
    pub fn groups(mut self, prefix: usize) -> Self {
        self.groups = Some(prefix);
        self
    }

    /// Declares that a partition's name may be given to a new partition once the old one is
    /// gone, and that partitions end only when gone (see
    /// [`Contract::names_reused`](Self#structfield.names_reused)).
    pub fn names_reused(mut self) -> Self {
        self.names_reused = true;
        self
    }

    /// Declares the source read by timestamp, under these contracts.
    pub fn timestamps(mut self, timestamps: Timestamps) -> Self {
        self.timestamps = Some(timestamps);
        self
    }

    /// How far back an event already handled can be handed out again after a restart, when the
    /// contract bounds it: a source read by timestamp with a lateness bound `L` reads again every
    /// event after its `closedThrough` (which trails the newest poll by `L`) and audits its
    /// [`audit window`](Timestamps::audit_window) further back, so `L` + the audit window. A receipt deleted sooner than
    /// this lets a replayed event's effects apply twice, so a consumer with a receipt ledger whose
    /// retention is shorter is refused at build. `None`: the contract sets no bound (a source of
    /// cursors replays only the pages after its last barrier; a backfilling source, or one closed
    /// by a watermark or later timestamps, bounds it by what the provider keeps). Either way,
    /// after an outage a replay can come as long as the provider keeps the event: that bound is
    /// [`PagedSource::retention`], checked at start.
    pub fn replay_horizon(&self) -> Option<Duration> {
        let timestamps = self.timestamps?;
        match timestamps.finality {
            Finality::Lateness(lateness) => Some(lateness + timestamps.audit_window),
            _ => None,
        }
    }
}

/// How far behind `closedThrough` a source read by timestamp is read again by default (every
/// tenth poll, or every [`PagedSource::audit_interval`]) to find events that arrived later than
/// its contract promised.
pub const AUDIT_WINDOW: Duration = Duration::from_secs(60);

/// Why a fetch failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FetchError {
    /// The provider asked to slow down: back off and fetch the same cursor again.
    #[error("throttled")]
    Throttled,
    /// The partition does not exist (any more).
    #[error("partition not found")]
    NotFound,
    /// What the cursor reads is gone for good, though a partition of its name may exist: a log
    /// stream deleted and created again under its name is another stream. The partition ends
    /// (its row is deleted once every delivery settled), and the partition of that name now is
    /// read from its start under a row of its own.
    #[error("the partition the cursor reads is gone (another exists under its name)")]
    Gone,
    /// The provider refused the cursor (expired, or not its own): the partition's attempt stops.
    #[error("cursor refused")]
    InvalidCursor(#[source] BoxError),
    /// Anything else (a timeout, a lost answer, a server error): fetched again with back-off.
    #[error("fetch failed")]
    Other(#[source] BoxError),
}

/// A partitioned API read page by page.
///
/// Cancelling a returned future is safe: a fetch has no effects (a page fetched and lost is fetched
/// again from the same cursor).
pub trait PagedSource: Send + Sync + fmt::Debug + 'static {
    /// The source's name, unique in the lease table: lease rows (as their stream) and event
    /// identities carry it, e.g. `logs:/aws/lambda/orders`.
    fn name(&self) -> &str;

    /// What the source promises.
    fn contract(&self) -> Contract;

    /// Every partition, in a stable order.
    fn partitions(&self) -> BoxFuture<'_, Result<Vec<String>, crate::Error>>;

    /// Whether the source lists `partition` now: asked when a fetch finds it missing, to tell a
    /// partition that is gone from one not visible yet. The default lists every partition; a
    /// source that can ask for one alone should (a group of thousands of streams takes dozens of
    /// pages to list).
    fn listed<'a>(&'a self, partition: &'a str) -> BoxFuture<'a, Result<bool, crate::Error>> {
        Box::pin(async move { Ok(self.partitions().await?.iter().any(|p| p == partition)) })
    }

    /// The page of `partition` at `cursor` (`None`: its first page).
    fn fetch<'a>(
        &'a self,
        partition: &'a str,
        cursor: Option<&'a Cursor>,
    ) -> BoxFuture<'a, Result<Page, FetchError>>;

    /// A cursor whose pages start with the first event at or after `time`, for a seek; `None`
    /// when the source cannot start at a time.
    fn cursor_at(&self, partition: &str, time: SystemTime) -> Option<Cursor> {
        let _ = (partition, time);
        None
    }

    /// Late events, for a source whose forward reading cannot return an event put behind its
    /// cursor (CloudWatch Logs' `GetLogEvents`): how often the reader audits behind the forward
    /// cursor ([`audit`](Self::audit)). `None` (the default): the source does not audit. For a
    /// source read by timestamp: how often a poll reads the audit window behind `closedThrough`
    /// again ([`Timestamps::audit_window`]); `None`: every tenth poll.
    fn audit_interval(&self) -> Option<Duration> {
        None
    }

    /// An audit behind the forward cursor `cursor` of `partition`, or `None` when there is
    /// nothing to audit (nothing read yet, or no event could be late behind it). The reader
    /// fetches [`Audit::pages`] until a page without a next cursor, hands out every event it did
    /// not hand out before in this attempt (a late event), and then reads on from
    /// [`Audit::then`], which the source marks as audited: the source returns, in a later audit,
    /// only events that arrived after this one began.
    fn audit(&self, partition: &str, cursor: &Cursor) -> Option<Audit> {
        let _ = (partition, cursor);
        None
    }

    /// When the provider ingested `event` (ms since the Unix epoch), if the source knows. A
    /// source read by timestamp that says lets the consumer keep a durable mark of its
    /// late-event audits, so that after a restart the audit hands out again only what arrived
    /// since the last one, not its whole window.
    fn ingested(&self, event: &PagedEvent) -> Option<i64> {
        let _ = event;
        None
    }

    /// A time the provider's clock has certainly reached, from its answers (the `Date` of the
    /// newest, carried on by this host's clock since it arrived), for every time-based mark a
    /// reader makes (a poll's start, an audit's mark). `None` (the default): the provider's
    /// answers carry no time, and this host's clock stands in for it.
    fn service_time(&self) -> Option<SystemTime> {
        None
    }

    /// For a source read by timestamp ([`Contract::timestamps`]): the cursor of a poll's first
    /// page, whose pages hold every event of `partition` strictly after `after` (ms since the Unix
    /// epoch; `None`: from the first event). `None` when the source cannot (the partition fails).
    fn poll_after(&self, partition: &str, after: Option<i64>) -> Option<Cursor> {
        let _ = (partition, after);
        None
    }

    /// The age past which the provider may delete an event (a log group's `retentionInDays`),
    /// when it says: a partition read further behind than this may lose events unread, which
    /// the reader reports (a warning, `shardwise_paged_behind_retention_total`). `None` (the
    /// default): the provider keeps events for good, or does not say.
    fn deletes_after(&self) -> Option<Duration> {
        None
    }

    /// For a source read by timestamp: how much event time one poll need cover at most. A
    /// partition further behind (a pause of days) catches up in polls of this span, one after
    /// the other: each closes what it read before the next begins, so memory holds one step's
    /// events and no continuation lives long enough to expire. `None` (the default): every poll
    /// reads through to the present.
    fn poll_step(&self) -> Option<Duration> {
        None
    }

    /// [`poll_after`](Self::poll_after), with the poll's events bounded to timestamps before
    /// `before` (exclusive; `None`: unbounded), which the reader passes for a step of a catch-up
    /// ([`poll_step`](Self::poll_step)). A poll may read more than asked (the default ignores
    /// the bound): what it proves is bounded by the reader, not by the source.
    fn poll_before(
        &self,
        partition: &str,
        after: Option<i64>,
        before: Option<i64>,
    ) -> Option<Cursor> {
        let _ = before;
        self.poll_after(partition, after)
    }

    /// For a source that audits: the ingestion times `(after, through]` (ms) whose events the
    /// next attempt's first audit behind `cursor` (an audited cursor an attempt stops at) returns
    /// though the stopping attempt may have handed them out (the source's allowance before the
    /// audit's mark). `None` (the default): nothing is vouched for, and the next attempt hands
    /// such events out again.
    fn vouch_range(&self, cursor: &Cursor) -> Option<(i64, i64)> {
        let _ = cursor;
        None
    }

    /// `cursor` (whose [`vouch_range`](Self::vouch_range) `vouched` covers) carrying `vouched`, so
    /// that the next attempt's first audit ([`Audit::vouched`]) can tell the events of that range
    /// it returns were all handed out. `None` (the default): the source cannot carry it.
    fn vouch(&self, cursor: &Cursor, vouched: &Vouched) -> Option<Cursor> {
        let _ = (cursor, vouched);
        None
    }

    /// How long a partition may have nothing new before it retires (`None`, the default: never):
    /// its owner stops it gracefully (its last audit included), writes its final progress and
    /// retires its row ([`LeaseStore::retire`](crate::lease::LeaseStore::retire)) at
    /// [`read_through`](Self::read_through) of that progress; nobody renews or reads it until
    /// [`last_activity`](Self::last_activity) is after that time. For sources whose partitions
    /// stop receiving for good without being deleted (CloudWatch Logs' streams, one per Lambda
    /// execution environment).
    fn retire_after(&self) -> Option<Duration> {
        None
    }

    /// The provider's ingestion time (ms) through which a partition read to `cursor` (forward to
    /// its end, its last audit done) has handed out everything it is owed: what the provider
    /// takes in after this time shows in [`last_activity`](Self::last_activity). `None` (the
    /// default): the cursor does not tell, and the partition does not retire.
    fn read_through(&self, cursor: &Cursor) -> Option<i64> {
        let _ = cursor;
        None
    }

    /// When the provider last took something into `partition` (ms, its clock), as the newest
    /// [`partitions`](Self::partitions) listing said: a retired partition is woken once this is
    /// after its retirement. `None` (the default): not known.
    fn last_activity(&self, partition: &str) -> Option<i64> {
        let _ = partition;
        None
    }

    /// Whether [`receipts_needed_since`](Self::receipts_needed_since) bounds every replay of a
    /// partition (default `false`; for a source read by timestamp the consumer bounds them by
    /// the row's `closedThrough` itself). A source that keeps events for good and says so may run with
    /// a receipt ledger that deletes receipts: each partition is checked as it is taken, and one
    /// whose receipts may have expired is refused.
    fn bounds_replays(&self) -> bool {
        false
    }

    /// For a source that [bounds replays](Self::bounds_replays): the provider's time (ms) since
    /// which every receipt a replay from `progress` can need was recorded (every event a later
    /// attempt can hand out again was first handed out at or after it). `None`: none is needed
    /// (nothing was handed out from this progress), or the progress does not say.
    fn receipts_needed_since(&self, progress: &PagedProgress) -> Option<i64> {
        let _ = progress;
        None
    }

    /// How long the provider keeps an event: after an outage a handled event can be handed out
    /// again until the provider deletes it, so a consumer with a receipt ledger keeps receipts
    /// at least that long (it asks once, at start, and refuses to run otherwise). The default
    /// does not say, and the consumer warns: implement it when the provider deletes events.
    fn retention(&self) -> BoxFuture<'_, Result<crate::receipts::SourceRetention, crate::Error>> {
        Box::pin(std::future::ready(Ok(
            crate::receipts::SourceRetention::Unknown,
        )))
    }
}

/// One audit of a partition for late events ([`PagedSource::audit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Audit {
    /// The cursor of the audit's first page. Its pages hold the events that may be late: every
    /// event behind the forward cursor that arrived since the last audit began, within the
    /// source's window (some of them read forward already); the last page has no next cursor.
    pub pages: Cursor,
    /// The forward cursor to read on from once the audit's pages were read: the one audited,
    /// marked as audited through the audit's start.
    pub then: Cursor,
    /// How long after it was read forward an event can still come back in an audit (the
    /// source's allowance for the delay before an event can be read, and for clock skew, twice):
    /// the reader remembers what it handed out that long before the previous audit began.
    pub remember: Duration,
    /// How long a stream that brought events must be quiet before an audit's mark passes every
    /// event read (an audit is made then, so a restart after it has nothing to check again):
    /// `remember` unless the source says ([`quiet`](Self::quiet)).
    pub quiet: Duration,
    /// What the attempt that stopped at the audited cursor vouched for
    /// ([`PagedSource::vouch`]): the events of its range this audit returns are known when they
    /// are exactly the ones vouched for, and are not handed out again.
    pub vouched: Option<Vouched>,
}

impl Audit {
    /// An audit reading `pages`, then reading on from `then`; events come back in it for up to
    /// `remember` after they were read forward.
    pub fn new(pages: Cursor, then: Cursor, remember: Duration) -> Self {
        Self {
            pages,
            then,
            remember,
            quiet: remember,
            vouched: None,
        }
    }

    /// The audit, with a stream's quiet spell of `quiet` before its mark passes every event read.
    pub fn quiet(mut self, quiet: Duration) -> Self {
        self.quiet = quiet;
        self
    }

    /// The audit with what the attempt that stopped at its cursor vouched for.
    pub fn vouched(mut self, vouched: Option<Vouched>) -> Self {
        self.vouched = vouched;
        self
    }
}

/// The events an attempt handed out in a range of ingestion times `(after, through]`, as a count
/// and a digest of their identities (the sum of each identity's MD5, as a 128-bit number: the
/// same whatever the order, and a different set gives the same sum by chance only). An attempt
/// that stops gracefully vouches for what its last audit's mark leaves to the next attempt's
/// first audit; that audit passes over the events of the range it returns when they sum to the
/// same, and hands every one of them out again otherwise (never skipped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Vouched {
    /// The range's start (exclusive), ms.
    pub after: i64,
    /// The range's end (inclusive), ms.
    pub through: i64,
    /// How many events.
    pub count: u64,
    /// The sum of their identities' digests.
    pub digest: u128,
}

impl Vouched {
    /// Nothing yet, over `(after, through]`.
    pub fn new(after: i64, through: i64) -> Self {
        Self {
            after,
            through,
            count: 0,
            digest: 0,
        }
    }

    /// Whether an event ingested at `ingested` (ms) lies in the range.
    pub fn covers(&self, ingested: i64) -> bool {
        ingested > self.after && ingested <= self.through
    }

    /// Adds the event `id` (each identity once).
    pub fn add(&mut self, id: &str) {
        use md5::{Digest, Md5};
        let digest = Md5::digest(id.as_bytes());
        let mut bytes = [0; 16];
        bytes.copy_from_slice(&digest);
        self.count += 1;
        self.digest = self.digest.wrapping_add(u128::from_be_bytes(bytes));
    }
}

/// Counts late events handed out: found by an audit behind the applied position, or at or
/// before `closed_through` without a terminal receipt (the source broke the finality contract
/// that closed their group).
pub(crate) const LATE_EVENTS: &str = "shardwise_paged_late_events_total";

#[allow(dead_code)]
/// Through which ingestion time (ms) a read begun at `start` (service time) saw every event
/// that existed: `start` less `allowance` (the time an event may take to become readable), but,
/// when events become readable in the order they were ingested within `readable_within`, not
/// past `newest` (the newest ingestion the read returned: everything ingested before it was
/// readable when it was read, so a read lagging by minutes vouches for what it showed), nor,
/// with nothing that recent read, past `start` less `readable_within`. Without such a bound:
/// `start` less `allowance`.
pub fn vouched_through(
    start: i64,
    allowance: Duration,
    newest: Option<i64>,
    readable_within: Option<Duration>,
) -> i64 {
    let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
    let allowed = start.saturating_sub(ms(allowance));
    match readable_within {
        None => allowed,
        Some(within) => {
            let slow = start.saturating_sub(ms(within));
            allowed.min(newest.map_or(slow, |newest| newest.max(slow)))
        }
    }
}

fn _object_safe(_: &dyn PagedSource) {}

/// A paged partition's durable progress, as its lease row keeps it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PagedProgress {
    /// Where the next fetch starts (`None`: the partition's first page).
    pub resume_cursor: Option<Cursor>,
    /// The end of the source-ordered prefix whose events have durable terminal outcomes.
    pub applied_position: Option<PagePosition>,
    /// The compare-and-swap generation: +1 on every page barrier and every seek.
    pub checkpoint_version: u64,
    /// For a source read by timestamp (seed 000): the latest timestamp (ms) whose whole group of
    /// events has durable terminal outcomes; polls query strictly after it. It moves only forward,
    /// with the version. (For such a source `resume_cursor` holds the late-event audit's mark,
    /// `audited|<ingested through>|<from>`, when the source tells ingestion times.)
    pub closed_through: Option<i64>,
    /// The provider's time (ms) since which every receipt a replay from this progress can need
    /// was recorded, as far as the attempt that wrote it knows: when the page that brought the
    /// resume cursor was read (every event after it was handed out later), or, while the
    /// cursor stays, when that was or the attempt began. `None`: not known (a row written
    /// before, a seek). With a receipt ledger that deletes receipts, a partition whose
    /// progress needs receipts older than they are kept is refused.
    pub receipts_since: Option<i64>,
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_read_vouches_neither_past_the_newest_ingestion_it_returned_nor_the_allowance() {
        use super::vouched_through;
        use std::time::Duration;
        let (start, allowance) = (10_000_000, Duration::from_secs(30));
        let within = Some(Duration::from_secs(600));
        // A busy source read up to a second ago: the allowance.
        assert_eq!(
            vouched_through(start, allowance, Some(start - 1_000), within),
            start - 30_000
        );
        // Reads lagging 3 minutes behind the service: what they showed.
        assert_eq!(
            vouched_through(start, allowance, Some(start - 180_000), within),
            start - 180_000
        );
        // Nothing recent, or nothing read: the bound.
        assert_eq!(
            vouched_through(start, allowance, Some(start - 3_600_000), within),
            start - 600_000
        );
        assert_eq!(
            vouched_through(start, allowance, None, within),
            start - 600_000
        );
        // A bound shorter than the allowance: the allowance.
        let short = Some(Duration::from_secs(10));
        assert_eq!(
            vouched_through(start, allowance, None, short),
            start - 30_000
        );
        // No bound declared: the allowance, whatever was read.
        assert_eq!(
            vouched_through(start, allowance, Some(start - 180_000), None),
            start - 30_000
        );
    }

    use super::*;

    #[test]
    fn positions_order_as_their_numbers_and_print_as_them() {
        let p = |n| PagePosition::from_u64(n);
        assert!(p(9) < p(10) && p(255) < p(256) && p(0) < p(u64::MAX));
        assert_eq!(p(105).to_string(), "105");
        assert_eq!(p(105).as_u64(), Some(105));
        let parts = PagePosition::from_parts(&[1_764_000_000_000, 3]);
        assert!(parts < PagePosition::from_parts(&[1_764_000_000_000, 4]));
        assert!(parts < PagePosition::from_parts(&[1_764_000_000_001, 0]));
        assert_eq!(parts.to_string(), "1764000000000.3");
        assert_eq!(parts.as_u64(), None);
        assert_eq!(
            PagePosition::from_bytes(&b"\x01\xff"[..]).to_string(),
            "01ff"
        );
    }

    #[test]
    fn cursors_print_as_text_or_hex() {
        assert_eq!(Cursor::new("f/0000042").to_string(), "f/0000042");
        assert_eq!(Cursor::new(vec![0u8, 1, 254]).to_string(), "0001fe");
    }
}
