//! What application code sees: a [`Delivery`] in, an [`Outcome`] out.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;

use crate::envelope::{self, Headers};
use crate::position::{Position, SequenceNumber};
use crate::track::DeliveryId;

/// What the handler decided for one delivery.
///
/// | outcome | effect |
/// |---|---|
/// | `Ack` | settled |
/// | `Drop` | settled: a poison record passes |
/// | `Retry` | a counted copy goes back to the stream (needs `max_attempts` or a dead-letter stream; refused otherwise and the record holds the checkpoint) |
/// | `RetryAfter(d)` | the same copy, written once `d` has passed; the original settles after the copy is durable |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// Handled.
    Ack,
    /// Not handled, and never will be: let the checkpoint pass it.
    Drop,
    /// Try again as a counted copy on the stream.
    Retry,
    /// Try again as a counted copy written after the delay.
    RetryAfter(Duration),
}

impl Outcome {
    /// Whether this outcome settles the delivery without writing anything back.
    pub fn is_terminal(&self) -> bool {
        matches!(self, Outcome::Ack | Outcome::Drop)
    }
}

/// One record handed to the handler. Cloning is cheap (one reference count).
#[derive(Clone)]
pub struct Delivery {
    inner: Arc<Inner>,
}

struct Inner {
    stream: Arc<str>,
    shard: Arc<str>,
    position: Position,
    partition_key: String,
    explicit_hash_key: Option<String>,
    payload: Bytes,
    headers: Headers,
    arrived_at: Option<SystemTime>,
    id: Option<DeliveryId>,
    lane: usize,
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
            partition_key: String::new(),
            explicit_hash_key: None,
            payload: Bytes::new(),
            headers: Headers::new(),
            arrived_at: None,
            id: None,
            lane: 0,
        }
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

    /// Where the record stands in its shard.
    pub fn position(&self) -> &Position {
        &self.inner.position
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
        &self.inner.partition_key
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
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("stream", &self.stream())
            .field("shard", &self.shard())
            .field("position", &self.inner.position.to_string())
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
    partition_key: String,
    explicit_hash_key: Option<String>,
    payload: Bytes,
    headers: Headers,
    arrived_at: Option<SystemTime>,
    id: Option<DeliveryId>,
    lane: usize,
}

impl DeliveryBuilder {
    /// Sets the partition key.
    pub fn partition_key(mut self, key: impl Into<String>) -> Self {
        self.partition_key = key.into();
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
    pub fn id(mut self, id: DeliveryId) -> Self {
        self.id = Some(id);
        self
    }

    /// Sets the lane that runs the delivery.
    pub fn lane(mut self, lane: usize) -> Self {
        self.lane = lane;
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
