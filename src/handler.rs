//! What application code sees: a [`Delivery`] in, an [`Outcome`] out.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;

use crate::envelope::{self, Headers};
use crate::paged::{PagePosition, PagedEvent};
use crate::position::{Position, SequenceNumber};
use crate::receipts::{Effects, EventId};
use crate::retry::{
    LEGACY_ORIGIN_HEADERS, ORIGIN_SEQUENCE_HEADER, ORIGIN_SHARD_HEADER, ORIGIN_STREAM_HEADER,
    ORIGIN_SUB_SEQUENCE_HEADER,
};
use crate::track::DeliveryId;
use crate::window::WindowSlots;

/// What the handler decided for one delivery.
///
/// | outcome | effect |
/// |---|---|
/// | `Ack` | settled |
/// | `Drop` | settled: a poison record passes |
/// | `Retry` | runs again in place after a back-off (the default: its key's later deliveries wait, the checkpoint holds behind it), or, with [`RetryMode::Copy`](crate::consumer::RetryMode::Copy), a counted copy goes back to the stream |
/// | `RetryAfter(d)` | the same, after `d`: in place the next attempt runs once `d` has passed; a copy is written then, and the original settles after the copy is durable |
/// | `NotAttempted` | (a batch that stopped before this delivery) in place, runs again after the deliveries before it without spending an attempt; with copies, a `Retry` |
/// | `Apply(effects)` | (with receipts) the DynamoDB writes committed together with the event's `applied` receipt, in one transaction; a replay (the receipt exists) writes nothing and settles |
/// | `Quarantine(reason)` | (with receipts) a terminal `quarantined` receipt, then settled |
/// | `Hold(reason)` | (with receipts) a `held` receipt: the delivery stays unsettled and holds the checkpoint until the receipt is made terminal (settled) or released (handled again) |
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Outcome {
    /// Handled.
    Ack,
    /// Not handled, and never will be: let the checkpoint pass it.
    Drop,
    /// Try again: in place after a back-off (the default), or as a counted copy on the stream.
    Retry,
    /// Try again after the delay: in place, or as a counted copy written then.
    RetryAfter(Duration),
    /// Not handed to the handler's code: a batch handler that stopped at an earlier delivery's
    /// failure, so this one waits for it. In place it runs again after the deliveries before
    /// it, and the attempt does not count toward `max_attempts` (`max_record_age` still
    /// applies); where retries are copies it is a `Retry`.
    NotAttempted,
    /// Commit these DynamoDB writes with the event's receipt, exactly once (needs receipts).
    Apply(Effects),
    /// Set the event aside for good, with the reason (needs receipts).
    Quarantine(String),
    /// Wait (retry later, operator review), with the reason: the event's receipt says `held` and
    /// the checkpoint waits for it (needs receipts).
    Hold(String),
}

impl Outcome {
    /// Whether this outcome settles the delivery without writing anything back.
    pub fn is_terminal(&self) -> bool {
        matches!(self, Outcome::Ack | Outcome::Drop)
    }

    /// The outcome's name, as logs and metrics label it.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Ack => "ack",
            Outcome::Drop => "drop",
            Outcome::Retry => "retry",
            Outcome::RetryAfter(_) => "retry_after",
            Outcome::NotAttempted => "not_attempted",
            Outcome::Apply(_) => "apply",
            Outcome::Quarantine(_) => "quarantine",
            Outcome::Hold(_) => "hold",
        }
    }
}

/// One record handed to the handler. Cloning is cheap (one reference count).
#[derive(Clone)]
pub struct Delivery {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    stream: Arc<str>,
    shard: Arc<str>,
    position: Position,
    /// `None` when none was set: a paged event's own identity stands in (its source gave it no
    /// key); for anything else, the empty key.
    partition_key: Option<String>,
    explicit_hash_key: Option<String>,
    payload: Bytes,
    headers: Headers,
    arrived_at: Option<SystemTime>,
    id: Option<DeliveryId>,
    lane: usize,
    /// Set by hand; `None`: made from the record or the paged event when asked for.
    event: Option<EventId>,
    /// A paged event's position (its `position` is then zero).
    page_position: Option<PagePosition>,
    /// A paged event's own identity, as its source gave it.
    paged_id: Option<String>,
    replayable: Replayable,
}

/// Whether the source can hand an event out again after a restart, past what its checkpoint
/// shows (a source read by timestamp re-reads its open groups and audits; a backfilling source
/// re-reads positions at or below its applied prefix), and so what a receipt ledger does for it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Replayable {
    /// Its checkpoint shows what is done: nothing more.
    #[default]
    No,
    /// Every outcome leaves a terminal receipt (an ack or a drop too), so a later attempt can
    /// recognise it without the handler.
    Recorded,
    /// Recorded, and an earlier attempt may have handled it: its receipt is read on its lane
    /// before the handler runs, and a terminal one settles it as a replay, unless it was recorded
    /// before this time (ms): the partition's last seek, which asked for the event again.
    Checked(Option<i64>),
}

impl Delivery {
    /// Starts a delivery by hand: for handler unit tests and simulations. The runtime builds its
    /// deliveries from the records it reads.
    ///
    /// ```
    /// use shardwise::{Delivery, Position, SequenceNumber};
    /// let d = Delivery::builder("orders", "shardId-000000000000", Position::new(SequenceNumber::parse("1").unwrap(), 0))
    ///     .partition_key("customer-7")
    ///     .payload("hello")
    ///     .build();
    /// assert_eq!(d.attempt(), 1);
    /// ```
    pub fn builder(
        stream: impl Into<Arc<str>>,
        shard: impl Into<Arc<str>>,
        position: Position,
    ) -> DeliveryBuilder {
        DeliveryBuilder {
            stream: stream.into(),
            shard: shard.into(),
            position,
            partition_key: None,
            explicit_hash_key: None,
            payload: Bytes::new(),
            headers: Headers::new(),
            arrived_at: None,
            id: None,
            lane: 0,
            event: None,
            page_position: None,
            paged_id: None,
            replayable: Replayable::No,
        }
    }

    /// A delivery of an event of a paged source: its identity is `paged/SOURCE/PARTITION/ID`, its
    /// partition key the event's key (or its identity, for an event ordered against nothing), its
    /// arrival time the event's timestamp. [`position`](Self::position) is zero:
    /// [`page_position`](Self::page_position) says where it stands.
    ///
    /// ```
    /// use shardwise::Delivery;
    /// use shardwise::paged::{PagePosition, PagedEvent};
    /// let event = PagedEvent {
    ///     id: "e106".into(),
    ///     position: PagePosition::from_u64(106),
    ///     payload: "hello".into(),
    ///     timestamp: None,
    ///     key: None,
    /// };
    /// let d = Delivery::paged("events", "tenant-1", &event).build();
    /// assert_eq!(d.event_id().as_str(), "paged/events/tenant-1/e106");
    /// assert_eq!(d.partition_key(), "e106");
    /// assert_eq!(d.locator().to_string(), "106");
    /// ```
    pub fn paged(
        source: impl Into<Arc<str>>,
        partition: impl Into<Arc<str>>,
        event: &PagedEvent,
    ) -> DeliveryBuilder {
        Self::from_paged(source, partition, event.clone())
    }

    /// [`paged`](Self::paged), taking the event: the consumer's own way, which copies nothing of
    /// it. The event's identity (`paged/SOURCE/PARTITION/ID`) and, without a key, its partition
    /// key are made from its id when asked for.
    pub(crate) fn from_paged(
        source: impl Into<Arc<str>>,
        partition: impl Into<Arc<str>>,
        event: PagedEvent,
    ) -> DeliveryBuilder {
        let mut builder = Self::builder(source, partition, Position::zero())
            .payload(event.payload)
            .set_arrived_at(event.timestamp);
        builder.partition_key = event.key;
        builder.page_position = Some(event.position);
        builder.paged_id = Some(event.id);
        builder
    }

    /// A delivery from a record's data blob as read from the stream: the header envelope, if any,
    /// is unpacked; anything else is a plain payload.
    pub fn from_blob(
        stream: impl Into<Arc<str>>,
        shard: impl Into<Arc<str>>,
        position: Position,
        partition_key: impl Into<String>,
        blob: Bytes,
    ) -> DeliveryBuilder {
        let decoded = envelope::decode(blob);
        Self::builder(stream, shard, position)
            .partition_key(partition_key)
            .payload(decoded.payload)
            .headers(decoded.headers)
    }

    /// The stream the record was read from.
    pub fn stream(&self) -> &str {
        &self.inner.stream
    }

    /// The shard the record was read from.
    pub fn shard(&self) -> &str {
        &self.inner.shard
    }

    /// Where the record stands in its shard (zero for a paged event: see
    /// [`page_position`](Self::page_position)).
    pub fn position(&self) -> &Position {
        &self.inner.position
    }

    /// Where a paged event stands in its partition; `None` for a Kinesis record.
    pub fn page_position(&self) -> Option<&PagePosition> {
        self.inner.page_position.as_ref()
    }

    /// A paged event's own identity as its source gave it (a CloudWatch Logs `eventId`, say);
    /// `None` for a Kinesis record. [`event_id`](Self::event_id) is the identity receipts are
    /// kept under, which also names the source and the partition.
    pub fn paged_event_id(&self) -> Option<&str> {
        self.inner.paged_id.as_deref()
    }

    /// Where the delivery stands, for messages: a record's sequence number (and sub-sequence), a
    /// paged event's position.
    pub fn locator(&self) -> impl std::fmt::Display + '_ {
        Locator(self)
    }

    /// The record's sequence number.
    pub fn sequence_number(&self) -> &SequenceNumber {
        self.inner.position.sequence()
    }

    /// The index inside a KPL aggregate; 0 for a plain record.
    pub fn sub_sequence(&self) -> u64 {
        self.inner.position.sub_sequence()
    }

    /// The partition key the producer wrote.
    pub fn partition_key(&self) -> &str {
        match &self.inner.partition_key {
            Some(key) => key,
            None => self.inner.paged_id.as_deref().unwrap_or(""),
        }
    }

    /// Whether it has a partition key of its own: a paged event without one is keyed by its
    /// identity, and orders against nothing.
    pub(crate) fn has_key(&self) -> bool {
        self.inner.partition_key.is_some()
    }

    /// Whether it is a paged event without a key of its own: ordered against nothing, so its
    /// lane needs no per-key bookkeeping.
    pub(crate) fn unordered(&self) -> bool {
        self.inner.partition_key.is_none() && self.inner.paged_id.is_some()
    }

    /// The explicit hash key, when the producer (or a KPL aggregate) set one.
    pub fn explicit_hash_key(&self) -> Option<&str> {
        self.inner.explicit_hash_key.as_deref()
    }

    /// The application payload, without the header envelope.
    pub fn payload(&self) -> &Bytes {
        &self.inner.payload
    }

    /// The headers the record carried (empty for a plain payload).
    pub fn headers(&self) -> &Headers {
        &self.inner.headers
    }

    /// When Kinesis accepted the record, as the service reported it.
    pub fn arrived_at(&self) -> Option<SystemTime> {
        self.inner.arrived_at
    }

    /// Which attempt this is: 1 for a first delivery, `n + 1` for the copy a retry of attempt `n`
    /// wrote (its `x-ruststream-retry-count` + 1, as ruststream counts).
    pub fn attempt(&self) -> u32 {
        self.inner.headers.attempt()
    }

    /// The id the runtime settles this delivery with, once it is tracked.
    pub fn id(&self) -> Option<DeliveryId> {
        self.inner.id
    }

    /// The lane (0-based) of its shard that runs this delivery.
    pub fn lane(&self) -> usize {
        self.inner.lane
    }

    /// Whether the source can hand it out again after a restart (see [`Replayable`]).
    pub(crate) fn replayable(&self) -> Replayable {
        self.inner.replayable
    }

    /// The same delivery on another lane.
    pub(crate) fn on_lane(&self, lane: usize) -> Delivery {
        Delivery {
            inner: Arc::new(Inner {
                lane,
                ..Inner::clone(&self.inner)
            }),
        }
    }

    /// The same delivery as the next attempt (a paged event retried in place).
    pub(crate) fn next_attempt(&self) -> Delivery {
        let mut headers = self.inner.headers.clone();
        headers.insert(envelope::RETRY_COUNT_HEADER, self.attempt().to_string());
        Delivery {
            inner: Arc::new(Inner {
                headers,
                ..Inner::clone(&self.inner)
            }),
        }
    }

    /// The event's stable identity, the same for every delivery of it: the record's own position
    /// for a record read for the first time; for a retry copy, the record it was first copied from
    /// (its `x-shardwise-origin-*` headers, or those of older shardwise builds); for a copy
    /// ruststream wrote, the record it copied (`kinesis-shard-id`, `kinesis-sequence-number`).
    ///
    /// ```
    /// use shardwise::{Delivery, Position, SequenceNumber};
    /// let d = Delivery::builder("orders", "shardId-000000000000", Position::new(SequenceNumber::parse("42").unwrap(), 0)).build();
    /// assert_eq!(d.event_id().as_str(), "kinesis/orders/shardId-000000000000/42.0");
    /// ```
    pub fn event_id(&self) -> EventId {
        if let Some(event) = &self.inner.event {
            return event.clone();
        }
        if let Some(id) = &self.inner.paged_id {
            return EventId::paged(&self.inner.stream, &self.inner.shard, id);
        }
        let h = &self.inner.headers;
        let origin = |current: &str| {
            h.get_str(current).or_else(|| {
                LEGACY_ORIGIN_HEADERS
                    .iter()
                    .find(|(_, now)| *now == current)
                    .and_then(|(old, _)| h.get_str(old))
            })
        };
        if let Some(sequence) =
            origin(ORIGIN_SEQUENCE_HEADER).and_then(|s| SequenceNumber::parse(s).ok())
        {
            let sub = origin(ORIGIN_SUB_SEQUENCE_HEADER)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            return EventId::kinesis(
                origin(ORIGIN_STREAM_HEADER).unwrap_or(self.stream()),
                origin(ORIGIN_SHARD_HEADER).unwrap_or(self.shard()),
                &Position::new(sequence, sub),
            );
        }
        if h.get(envelope::RETRY_COUNT_HEADER).is_some()
            && let (Some(shard), Some(sequence)) = (
                h.get_str(RUSTSTREAM_SHARD_HEADER),
                h.get_str(RUSTSTREAM_SEQUENCE_HEADER)
                    .and_then(|s| SequenceNumber::parse(s).ok()),
            )
        {
            return EventId::kinesis(self.stream(), shard, &Position::new(sequence, 0));
        }
        EventId::kinesis(self.stream(), self.shard(), self.position())
    }
}

/// The shard a ruststream-kinesis copy's delivery was read from (its reader sets it).
const RUSTSTREAM_SHARD_HEADER: &str = "kinesis-shard-id";
/// The sequence number a ruststream-kinesis copy's delivery had.
const RUSTSTREAM_SEQUENCE_HEADER: &str = "kinesis-sequence-number";

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("stream", &self.stream())
            .field("shard", &self.shard())
            .field("position", &self.locator().to_string())
            .field("partition_key", &self.partition_key())
            .field("attempt", &self.attempt())
            .field("payload_len", &self.payload().len())
            .finish()
    }
}

/// Builds a [`Delivery`]; see [`Delivery::builder`].
#[derive(Debug)]
#[must_use]
pub struct DeliveryBuilder {
    stream: Arc<str>,
    shard: Arc<str>,
    position: Position,
    partition_key: Option<String>,
    explicit_hash_key: Option<String>,
    payload: Bytes,
    headers: Headers,
    arrived_at: Option<SystemTime>,
    id: Option<DeliveryId>,
    lane: usize,
    event: Option<EventId>,
    page_position: Option<PagePosition>,
    paged_id: Option<String>,
    replayable: Replayable,
}

/// A delivery's place, as messages show it.
struct Locator<'a>(&'a Delivery);

impl std::fmt::Display for Locator<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0.inner.page_position {
            Some(p) => p.fmt(f),
            None => self.0.inner.position.fmt(f),
        }
    }
}

impl DeliveryBuilder {
    /// Sets the partition key.
    pub fn partition_key(mut self, key: impl Into<String>) -> Self {
        self.partition_key = Some(key.into());
        self
    }

    /// Sets the explicit hash key.
    pub fn explicit_hash_key(mut self, key: impl Into<String>) -> Self {
        self.explicit_hash_key = Some(key.into());
        self
    }

    /// Sets the payload.
    pub fn payload(mut self, payload: impl Into<Bytes>) -> Self {
        self.payload = payload.into();
        self
    }

    /// Sets the headers.
    pub fn headers(mut self, headers: Headers) -> Self {
        self.headers = headers;
        self
    }

    /// Sets the arrival time.
    pub fn arrived_at(mut self, at: SystemTime) -> Self {
        self.arrived_at = Some(at);
        self
    }

    /// Sets the attempt: writes the retry count `attempt - 1` (attempt 1 removes the header).
    pub fn attempt(mut self, attempt: u32) -> Self {
        self.headers.remove(envelope::RETRY_COUNT_HEADER);
        if attempt > 1 {
            self.headers
                .insert(envelope::RETRY_COUNT_HEADER, (attempt - 1).to_string());
        }
        self
    }

    /// Sets the id the delivery settles with (the runtime sets it when it tracks the delivery).
    /// For tests that drive the tracker and the lanes by hand.
    #[cfg(feature = "testing")]
    pub fn id(self, id: DeliveryId) -> Self {
        self.set_id(id)
    }

    pub(crate) fn set_id(mut self, id: DeliveryId) -> Self {
        self.id = Some(id);
        self
    }

    /// Sets whether the source can hand it out again after a restart.
    pub(crate) fn replayable(mut self, replayable: Replayable) -> Self {
        self.replayable = replayable;
        self
    }

    /// Sets the lane that runs the delivery (the runtime picks it from the partition key). For
    /// tests.
    #[cfg(feature = "testing")]
    pub fn lane(self, lane: usize) -> Self {
        self.set_lane(lane)
    }

    pub(crate) fn set_lane(mut self, lane: usize) -> Self {
        self.lane = lane;
        self
    }

    /// Sets the event's identity (by default it comes from the record; see
    /// [`Delivery::event_id`]).
    pub fn event_id(mut self, event: EventId) -> Self {
        self.event = Some(event);
        self
    }

    /// Sets the arrival time if known.
    pub fn set_arrived_at(mut self, at: Option<SystemTime>) -> Self {
        self.arrived_at = at;
        self
    }

    /// Sets the explicit hash key if known.
    pub fn set_explicit_hash_key(mut self, key: Option<String>) -> Self {
        self.explicit_hash_key = key;
        self
    }

    /// Finishes the delivery.
    pub fn build(self) -> Delivery {
        Delivery {
            inner: Arc::new(Inner {
                stream: self.stream,
                shard: self.shard,
                position: self.position,
                partition_key: self.partition_key,
                explicit_hash_key: self.explicit_hash_key,
                payload: self.payload,
                headers: self.headers,
                arrived_at: self.arrived_at,
                id: self.id,
                lane: self.lane,
                event: self.event,
                page_position: self.page_position,
                paged_id: self.paged_id,
                replayable: self.replayable,
            }),
        }
    }
}

/// Application code: decides an [`Outcome`] for each delivery.
///
/// Deliveries of one partition key reach the handler one at a time, in shard order; deliveries of
/// different keys may run at once on different lanes. A panic is caught and treated as
/// [`Outcome::Retry`].
///
/// Handlers run on the same Tokio runtime as lease renewal. Renewal has its own task and timer, so
/// slow async handlers never delay it, but a handler that blocks its thread (a synchronous sleep,
/// heavy CPU work) can: put blocking work in `tokio::task::spawn_blocking`.
///
/// Any `Fn(Delivery) -> impl Future<Output = Outcome>` closure is a handler:
///
/// ```
/// use shardwise::{Delivery, Handler, Outcome};
/// fn assert_handler<H: Handler>(_: H) {}
/// assert_handler(|d: Delivery| async move {
///     if d.payload().is_empty() { Outcome::Drop } else { Outcome::Ack }
/// });
/// ```
pub trait Handler: Send + Sync + 'static {
    /// Handles one delivery. Cancelled (dropped) only when its shard's lease is lost or shutdown's
    /// deadline passes; the delivery then stays unsettled and is read again by the next owner.
    fn handle(&self, delivery: Delivery) -> impl Future<Output = Outcome> + Send;

    /// How this handler takes deliveries in batches; `None` (the default): one at a time. A
    /// handler that returns `Some` gets [`handle_batch`](Self::handle_batch) calls instead of
    /// [`handle`](Self::handle). [`Batched`] wraps a [`BatchHandler`] this way.
    fn batching(&self) -> Option<Batching> {
        None
    }

    /// Handles a batch: deliveries of one lane of one shard, in shard order, so the deliveries of
    /// one partition key among them are in order. Returns one outcome per delivery, in the same
    /// order; a delivery without one (a shorter answer) is retried. No outcome at all says the
    /// batch failed as a whole, as a panic does: with
    /// [`Batching::bisect_on_failure`] it is handled again in halves, otherwise every delivery
    /// is retried. The default runs
    /// [`handle`](Self::handle) on each in turn. Cancelled as `handle` is.
    fn handle_batch(&self, batch: Vec<Delivery>) -> impl Future<Output = Vec<Outcome>> + Send {
        async move {
            let mut outcomes = Vec::with_capacity(batch.len());
            for delivery in batch {
                outcomes.push(self.handle(delivery).await);
            }
            outcomes
        }
    }

    /// For a handler run on tumbling windows ([`Windowed`](crate::window::Windowed)): its
    /// windows' slots, which the shard loop restores from the lease row and writes with the
    /// checkpoints. `None` (the default) for every other handler; a handler that wraps another
    /// returns the inner one's.
    fn window_slots(&self) -> Option<&Arc<WindowSlots>> {
        None
    }

    /// For a handler run on tumbling windows: the final call of the shard's open window, if
    /// the window ended by `now_ms` and no call runs. `false`: the call failed (the window stays
    /// open). The default does nothing; a handler that wraps another forwards it.
    fn close_window_if_over(
        &self,
        stream: &str,
        shard: &str,
        now_ms: i64,
    ) -> impl Future<Output = bool> + Send {
        let _ = (stream, shard, now_ms);
        async { true }
    }
}

/// How deliveries are batched for a [`BatchHandler`]: a lane hands over up to `max_size`
/// deliveries at once, waiting at most `max_wait` after the first for more to arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Batching {
    /// The most deliveries in one batch (at least 1).
    pub max_size: usize,
    /// How long a lane waits after a batch's first delivery for more.
    pub max_wait: Duration,
    /// Whether a batch whose call fails as a whole (the handler panics or runs past
    /// `handler_timeout`) is handled again in halves, down to the delivery that fails
    /// ([`bisect_on_failure`](Self::bisect_on_failure)).
    pub bisect: bool,
}

impl Batching {
    /// Batches of at most `max_size` deliveries, gathered for at most `max_wait`.
    pub fn new(max_size: usize, max_wait: Duration) -> Self {
        Self {
            max_size,
            max_wait,
            bisect: false,
        }
    }

    /// A batch whose call fails as a whole (the handler panics, runs past `handler_timeout`, or
    /// answers with no outcome at all) is handled again in halves, one after the other, each half that fails split again, down
    /// to the single delivery that fails, which then takes the retry way alone (Lambda's
    /// `BisectBatchOnFunctionError`). The outcomes of the halves that succeed stand: those
    /// deliveries settle and are not handled again (they may have been handed to the failed
    /// calls before: at least once, as always). A batch of `n` with one poison delivery finds it
    /// in `ceil(log2(n))` splits (7 for 100). Without it (the default), every delivery of a
    /// failed batch is a retry. A batch answered with outcomes is never split: per-delivery
    /// outcomes already say which failed.
    pub fn bisect_on_failure(mut self, on: bool) -> Self {
        self.bisect = on;
        self
    }
}

/// Application code that decides outcomes for a batch of deliveries at once, as Lambda's batch
/// item failures do: one [`Outcome`] per delivery, in the order given. Wrap it in [`Batched`] to
/// run it. A batch holds deliveries of one lane of one shard, in shard order; the batches of one
/// lane run one at a time, so the order per partition key holds as with [`Handler`].
///
/// Any `Fn(Vec<Delivery>) -> impl Future<Output = Vec<Outcome>>` closure is a batch handler:
///
/// ```
/// use std::time::Duration;
/// use shardwise::{Batched, Batching, Delivery, Handler, Outcome};
/// fn assert_handler<H: Handler>(_: H) {}
/// let bulk = |batch: Vec<Delivery>| async move {
///     // One bulk write for the whole batch, then an outcome per delivery.
///     batch.iter().map(|_| Outcome::Ack).collect::<Vec<_>>()
/// };
/// assert_handler(Batched::new(bulk, Batching::new(100, Duration::from_millis(50))));
/// ```
pub trait BatchHandler: Send + Sync + 'static {
    /// Handles a batch; see the trait.
    fn handle_batch(&self, batch: Vec<Delivery>) -> impl Future<Output = Vec<Outcome>> + Send;
}

impl<F, Fut> BatchHandler for F
where
    F: Fn(Vec<Delivery>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Vec<Outcome>> + Send,
{
    fn handle_batch(&self, batch: Vec<Delivery>) -> impl Future<Output = Vec<Outcome>> + Send {
        self(batch)
    }
}

/// A [`BatchHandler`] run as a [`Handler`], with its [`Batching`].
#[derive(Debug, Clone)]
pub struct Batched<B> {
    handler: B,
    batching: Batching,
}

impl<B: BatchHandler> Batched<B> {
    /// Runs `handler` on batches made as `batching` says (a `max_size` of 0 counts as 1).
    pub fn new(handler: B, batching: Batching) -> Self {
        let batching = Batching {
            max_size: batching.max_size.max(1),
            ..batching
        };
        Self { handler, batching }
    }
}

impl<B: BatchHandler> Handler for Batched<B> {
    async fn handle(&self, delivery: Delivery) -> Outcome {
        self.handler
            .handle_batch(vec![delivery])
            .await
            .into_iter()
            .next()
            .unwrap_or(Outcome::Retry)
    }

    fn batching(&self) -> Option<Batching> {
        Some(self.batching)
    }

    fn handle_batch(&self, batch: Vec<Delivery>) -> impl Future<Output = Vec<Outcome>> + Send {
        self.handler.handle_batch(batch)
    }
}

impl<F, Fut> Handler for F
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Outcome> + Send,
{
    fn handle(&self, delivery: Delivery) -> impl Future<Output = Outcome> + Send {
        self(delivery)
    }
}
