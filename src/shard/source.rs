//! Where records come from: GetShardIterator and GetRecords, behind a trait so the runtime can read
//! Kinesis in production and an in-memory stream in tests.

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use aws_sdk_kinesis::config::interceptors::BeforeDeserializationInterceptorContextRef;
use aws_sdk_kinesis::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_kinesis::primitives::{DateTime, DateTimeFormat as Format};
use aws_sdk_kinesis::types::ShardIteratorType;
use bytes::Bytes;
use futures::future::BoxFuture;

use crate::error::BoxError;
use crate::position::SequenceNumber;
use crate::time::ServiceClock;

/// Where to open a shard iterator.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StartAt {
    /// The oldest retained record.
    TrimHorizon,
    /// After the newest record.
    Latest,
    /// The first record that arrived at or after this time.
    AtTimestamp(SystemTime),
    /// The record with this sequence number (and everything after it).
    AtSequence(SequenceNumber),
    /// Everything after the record with this sequence number.
    AfterSequence(SequenceNumber),
}

/// A record as GetRecords returns it (its data may still hold a KPL aggregate or a header envelope).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawRecord {
    /// Sequence number.
    pub sequence: SequenceNumber,
    /// Partition key.
    pub partition_key: String,
    /// The data blob.
    pub data: Bytes,
    /// When Kinesis accepted it.
    pub arrived_at: Option<SystemTime>,
}

/// One GetRecords answer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Page {
    /// The records, in shard order.
    pub records: Vec<RawRecord>,
    /// The iterator for the next call; `None` once a closed shard has been read to its end.
    pub next_iterator: Option<String>,
    /// How far behind the tip of the shard this page is.
    pub millis_behind_latest: Option<i64>,
}

/// Why a read failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReadError {
    /// The shard's read throughput was exceeded: back off and try again.
    #[error("read throughput exceeded")]
    Throttled,
    /// The iterator is older than 5 minutes: open a new one after the last record read.
    #[error("shard iterator expired")]
    ExpiredIterator,
    /// The stream or shard does not exist (deleted, or aged out of retention).
    #[error("stream or shard not found")]
    NotFound,
    /// Anything else: retried with backoff.
    #[error("read failed")]
    Other(#[source] BoxError),
}

/// Reads shards. Cancelling a returned future is safe: reads have no effects.
pub trait RecordSource: Send + Sync + fmt::Debug + 'static {
    /// Opens an iterator on `shard` at `start`.
    fn shard_iterator<'a>(
        &'a self,
        stream: &'a str,
        shard: &'a str,
        start: &'a StartAt,
    ) -> BoxFuture<'a, Result<String, ReadError>>;

    /// Reads up to `limit` records at `iterator`.
    fn get_records<'a>(
        &'a self,
        iterator: &'a str,
        limit: i32,
    ) -> BoxFuture<'a, Result<Page, ReadError>>;

    /// A time the service's clock has certainly reached, as its answers tell it; `None` before
    /// any answer did, or when the service does not say. A LATEST start is pinned there rather
    /// than at this host's clock, which may run ahead of the stream's arrival timestamps.
    fn service_time(&self) -> Option<SystemTime> {
        None
    }

    /// Whether the source pushes records (enhanced fan-out): `get_records` waits for the next
    /// event itself, so the reader calls again at once instead of polling at an interval.
    fn pushes(&self) -> bool {
        false
    }

    /// The reader of `shard` stopped (its end, a handoff, a lost lease, a shutdown): whatever the
    /// source holds open for it can go.
    fn release(&self, _stream: &str, _shard: &str) {}

    /// Why reading `shard` of `stream` answered [`ReadError::NotFound`] although the stream still
    /// lists the shard, when the source can tell: enhanced fan-out's consumer was deregistered
    /// ([`Error::ConsumerGone`](crate::Error::ConsumerGone)). `None` (the default): nothing
    /// beyond the stream's own answer.
    fn explain_not_found<'a>(
        &'a self,
        _stream: &'a str,
        _shard: &'a str,
    ) -> BoxFuture<'a, Option<crate::Error>> {
        Box::pin(async { None })
    }
}

/// [`RecordSource`] on the Kinesis API. It learns the service's clock from the `Date` header of
/// every answer ([`RecordSource::service_time`]).
#[derive(Debug, Clone)]
pub struct KinesisRecords {
    client: aws_sdk_kinesis::Client,
    clock: Arc<ServiceClock>,
}

impl KinesisRecords {
    /// Reads with this client (a copy of it that also reads each answer's date).
    pub fn new(client: aws_sdk_kinesis::Client) -> Self {
        let (client, clock) = dated(&client);
        Self { client, clock }
    }
}

impl KinesisRecords {
    /// Reads with a client already made by [`dated`], whose answers' dates go to `clock`.
    pub(crate) fn from_dated(client: aws_sdk_kinesis::Client, clock: Arc<ServiceClock>) -> Self {
        Self { client, clock }
    }
}

/// A copy of `client` whose answers' dates go to the returned clock.
pub(crate) fn dated(
    client: &aws_sdk_kinesis::Client,
) -> (aws_sdk_kinesis::Client, Arc<ServiceClock>) {
    let (read_date, clock) = ReadDate::new();
    let config = client.config().to_builder().interceptor(read_date).build();
    (aws_sdk_kinesis::Client::from_conf(config), clock)
}

/// Gives each answer's `Date` header, with the time it arrived, to a [`ServiceClock`]: an
/// interceptor for any AWS SDK client (Kinesis, CloudWatch Logs).
#[derive(Debug)]
pub(crate) struct ReadDate(Arc<ServiceClock>);

impl ReadDate {
    /// An interceptor for a client, and the clock it keeps.
    pub(crate) fn new() -> (Self, Arc<ServiceClock>) {
        let clock = Arc::new(ServiceClock::default());
        (Self(Arc::clone(&clock)), clock)
    }
}

impl Intercept for ReadDate {
    fn name(&self) -> &'static str {
        "shardwise::ReadDate"
    }

    fn read_before_deserialization(
        &self,
        context: &BeforeDeserializationInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), aws_sdk_kinesis::error::BoxError> {
        let received = crate::time::now();
        let date = context
            .response()
            .headers()
            .get("date")
            .and_then(|d| DateTime::from_str(d, Format::HttpDate).ok())
            .and_then(|d| SystemTime::try_from(d).ok());
        if let Some(date) = date {
            self.0.observe(date, received);
        }
        Ok(())
    }
}

/// A record as the SDK answers it (GetRecords, a SubscribeToShard event).
pub(crate) fn raw_record(r: aws_sdk_kinesis::types::Record) -> Result<RawRecord, ReadError> {
    let sequence =
        SequenceNumber::parse(&r.sequence_number).map_err(|e| ReadError::Other(Box::new(e)))?;
    Ok(RawRecord {
        sequence,
        // Every Kinesis record has one; the SDK models it as optional.
        partition_key: r.partition_key.unwrap_or_default(),
        data: Bytes::from(r.data.into_inner()),
        arrived_at: r
            .approximate_arrival_timestamp
            .and_then(|t| SystemTime::try_from(t).ok()),
    })
}

pub(crate) fn classify<E, R>(err: aws_sdk_kinesis::error::SdkError<E, R>) -> ReadError
where
    E: aws_sdk_kinesis::error::ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: fmt::Debug + Send + Sync + 'static,
{
    match err.as_service_error().and_then(|e| e.code()) {
        Some("ProvisionedThroughputExceededException") | Some("LimitExceededException") => {
            ReadError::Throttled
        }
        Some("ExpiredIteratorException") => ReadError::ExpiredIterator,
        Some("ResourceNotFoundException") => ReadError::NotFound,
        _ => ReadError::Other(Box::new(err)),
    }
}

impl RecordSource for KinesisRecords {
    fn service_time(&self) -> Option<SystemTime> {
        self.clock.reached()
    }

    fn shard_iterator<'a>(
        &'a self,
        stream: &'a str,
        shard: &'a str,
        start: &'a StartAt,
    ) -> BoxFuture<'a, Result<String, ReadError>> {
        Box::pin(async move {
            let mut req = self
                .client
                .get_shard_iterator()
                .stream_name(stream)
                .shard_id(shard);
            req = match start {
                StartAt::TrimHorizon => req.shard_iterator_type(ShardIteratorType::TrimHorizon),
                StartAt::Latest => req.shard_iterator_type(ShardIteratorType::Latest),
                StartAt::AtTimestamp(t) => req
                    .shard_iterator_type(ShardIteratorType::AtTimestamp)
                    .timestamp(DateTime::from(*t)),
                StartAt::AtSequence(s) => req
                    .shard_iterator_type(ShardIteratorType::AtSequenceNumber)
                    .starting_sequence_number(s.to_string()),
                StartAt::AfterSequence(s) => req
                    .shard_iterator_type(ShardIteratorType::AfterSequenceNumber)
                    .starting_sequence_number(s.to_string()),
            };
            let out = req.send().await.map_err(classify)?;
            out.shard_iterator
                .ok_or_else(|| ReadError::Other("GetShardIterator returned no iterator".into()))
        })
    }

    fn get_records<'a>(
        &'a self,
        iterator: &'a str,
        limit: i32,
    ) -> BoxFuture<'a, Result<Page, ReadError>> {
        Box::pin(async move {
            let out = self
                .client
                .get_records()
                .shard_iterator(iterator)
                .limit(limit)
                .send()
                .await
                .map_err(classify)?;
            let records = out
                .records
                .into_iter()
                .map(raw_record)
                .collect::<Result<Vec<_>, ReadError>>()?;
            Ok(Page {
                records,
                next_iterator: out.next_shard_iterator,
                millis_behind_latest: out.millis_behind_latest,
            })
        })
    }
}
