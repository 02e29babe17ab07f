//! Enhanced fan-out: records pushed by `SubscribeToShard` to a registered stream consumer, as a
//! [`RecordSource`], so that one reader, and everything built on it, serves both ways of reading.
//!
//! The reader asks a source for an iterator at a start position and then for pages at iterators.
//! Here an iterator is a position, not a service token: `efo|STREAM|SHARD|TYPE|VALUE`, the
//! starting position of a subscription (`AT_SEQUENCE_NUMBER`, `AFTER_SEQUENCE_NUMBER`,
//! `TRIM_HORIZON`, `LATEST`, `AT_TIMESTAMP`). A page is the next event of the subscription that
//! serves that position, and its next iterator is `AFTER_SEQUENCE_NUMBER` of the event's
//! continuation sequence number; at the end of a closed shard the event names the children and
//! has no continuation, so the page has no next iterator and the reader ends the shard as it does
//! on a `GetRecords` with no `NextShardIterator`.
//!
//! ```text
//!   no subscription ──get_records(it)──► SubscribeToShard from it ──► open, serving it
//!   open, serving it ──get_records(it)──► next event ──► open, serving AFTER continuation
//!   open ──ends (5 minutes) / errors / no event within the stall timeout──► no subscription
//!   open, serving X ──get_records(Y ≠ X) (the reader went back after an error)──► dropped
//! ```
//!
//! Because every iterator is a position, dropping a subscription is always safe: the next call
//! subscribes again from the position it names, so an ended, failed, stalled or cut subscription
//! loses nothing and repeats nothing the reader had not already skipped (`after`). Backpressure is
//! the transport's: the reader asks for the next event only once the last page was taken by the
//! pipeline, and meanwhile the unread events wait in the connection (HTTP/2 flow control, or TCP
//! over HTTP/1.1), which stops the service from sending more.
//!
//! Kinesis marks the end of a closed shard with an event that names its children; a caught-up
//! subscription also checks, at most every [`FanOut::end_check_interval`], with one
//! GetShardIterator and GetRecords at its position, whether the shard was read to its end (where
//! that event does not come: kinesis-mock sends none). The subscriptions themselves come from a
//! [`Subscribe`]: `SubscribeToShard`, or a model of it (`testing::Subscriptions`) that the
//! simulation reads through this same code.
//!
//! The consumer is registered (or found) when the consumer starts, under the application's name
//! unless another is chosen, and tagged `shardwise:application` with the application: a consumer
//! of that name that carries another application's tag, or none, is reported and never used (two
//! applications on one consumer would take each other's subscriptions every 5 seconds). Nothing
//! deregisters it but `shardwise stream deregister-consumer`.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use aws_sdk_kinesis::operation::subscribe_to_shard::SubscribeToShardOutput;
use aws_sdk_kinesis::primitives::DateTime;
use aws_sdk_kinesis::types::{
    ConsumerStatus, ShardIteratorType, StartingPosition, SubscribeToShardEventStream,
};
use futures::future::BoxFuture;
use tracing::{debug, info};

use super::source::{
    KinesisRecords, Page, RawRecord, ReadError, RecordSource, StartAt, classify, dated, raw_record,
};
use crate::error::Error;
use crate::position::SequenceNumber;

/// The tag a shardwise-registered consumer carries: the application that registered it.
pub const APPLICATION_TAG: &str = "shardwise:application";

/// How long a consumer found without [`APPLICATION_TAG`] is watched for the tag before it is taken
/// for another's: a worker that registered it may be tagging it.
const UNTAGGED_PATIENCE: Duration = Duration::from_secs(10);

/// Enhanced fan-out settings ([`ConsumerBuilder::enhanced_fan_out`](crate::ConsumerBuilder::enhanced_fan_out)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FanOut {
    pub(crate) consumer_name: Option<String>,
    pub(crate) stall_timeout: Duration,
    pub(crate) register_timeout: Duration,
    pub(crate) end_check_interval: Duration,
}

impl Default for FanOut {
    fn default() -> Self {
        Self {
            consumer_name: None,
            stall_timeout: Duration::from_secs(30),
            register_timeout: Duration::from_secs(120),
            end_check_interval: Duration::from_secs(10),
        }
    }
}

impl FanOut {
    /// Enhanced fan-out under a consumer named after the application.
    pub fn new() -> Self {
        Self::default()
    }

    /// The stream consumer's name (1 to 128 of `[a-zA-Z0-9_.-]`; default: the application).
    pub fn consumer_name(mut self, name: impl Into<String>) -> Self {
        self.consumer_name = Some(name.into());
        self
    }

    /// A subscription that brings no event for this long (the service sends one at least every
    /// 5 seconds, with no records when there are none) is taken for stalled and made again from
    /// its position. Default 30 s.
    pub fn stall_timeout(mut self, d: Duration) -> Self {
        self.stall_timeout = d;
        self
    }

    /// How long the start waits for a newly registered consumer to become `ACTIVE`. Default
    /// 2 minutes.
    pub fn register_timeout(mut self, d: Duration) -> Self {
        self.register_timeout = d;
        self
    }

    /// A caught-up subscription (an event with no records, nothing behind) checks at most this
    /// often whether its shard was closed and read to its end, with one GetShardIterator and
    /// GetRecords at its position. Kinesis marks the end of a closed shard with an event that
    /// names its children; this check finds it where that event does not come (kinesis-mock
    /// sends none). Default 10 s.
    pub fn end_check_interval(mut self, d: Duration) -> Self {
        self.end_check_interval = d;
        self
    }

    /// Checks the consumer name Kinesis will take (1 to 128 of `[a-zA-Z0-9_.-]`) and the
    /// timeouts (not zero).
    pub(crate) fn validate(&self, application: &str) -> Result<(), crate::error::ConfigError> {
        let name = self.name_for(application);
        let valid = (1..=128).contains(&name.len())
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
        if !valid {
            return Err(crate::error::ConfigError::new(
                "consumer_name",
                name,
                "a stream consumer's name is 1 to 128 of a-z, A-Z, 0-9, `_`, `.` and `-` (without consumer_name it is the application's)",
            ));
        }
        for (field, d) in [
            ("stall_timeout", self.stall_timeout),
            ("register_timeout", self.register_timeout),
            ("end_check_interval", self.end_check_interval),
        ] {
            if d.is_zero() {
                return Err(crate::error::ConfigError::new(
                    field,
                    d,
                    "must be more than zero",
                ));
            }
        }
        Ok(())
    }

    /// The consumer name for `application`.
    pub(crate) fn name_for(&self, application: &str) -> String {
        self.consumer_name
            .clone()
            .unwrap_or_else(|| application.to_string())
    }
}

/// Where a subscription starts: what an iterator of this source names.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Iter {
    stream: String,
    shard: String,
    start: StartAt,
}

impl fmt::Display for Iter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (kind, value) = match &self.start {
            StartAt::TrimHorizon => ("TRIM_HORIZON", String::new()),
            StartAt::Latest => ("LATEST", String::new()),
            StartAt::AtTimestamp(t) => (
                "AT_TIMESTAMP",
                t.duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_millis()
                    .to_string(),
            ),
            StartAt::AtSequence(s) => ("AT_SEQUENCE_NUMBER", s.to_string()),
            StartAt::AfterSequence(s) => ("AFTER_SEQUENCE_NUMBER", s.to_string()),
        };
        write!(f, "efo|{}|{}|{kind}|{value}", self.stream, self.shard)
    }
}

impl Iter {
    fn parse(text: &str) -> Option<Self> {
        let mut parts = text.split('|');
        if parts.next()? != "efo" {
            return None;
        }
        let (stream, shard, kind, value) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let sequence = || SequenceNumber::parse(value).ok();
        let start = match kind {
            "TRIM_HORIZON" => StartAt::TrimHorizon,
            "LATEST" => StartAt::Latest,
            "AT_TIMESTAMP" => StartAt::AtTimestamp(
                SystemTime::UNIX_EPOCH + Duration::from_millis(value.parse().ok()?),
            ),
            "AT_SEQUENCE_NUMBER" => StartAt::AtSequence(sequence()?),
            "AFTER_SEQUENCE_NUMBER" => StartAt::AfterSequence(sequence()?),
            _ => return None,
        };
        Some(Self {
            stream: stream.to_string(),
            shard: shard.to_string(),
            start,
        })
    }

    fn starting_position(&self) -> StartingPosition {
        let b = StartingPosition::builder();
        let b = match &self.start {
            StartAt::TrimHorizon => b.r#type(ShardIteratorType::TrimHorizon),
            StartAt::Latest => b.r#type(ShardIteratorType::Latest),
            StartAt::AtTimestamp(t) => b
                .r#type(ShardIteratorType::AtTimestamp)
                .timestamp(DateTime::from(*t)),
            StartAt::AtSequence(s) => b
                .r#type(ShardIteratorType::AtSequenceNumber)
                .sequence_number(s.to_string()),
            StartAt::AfterSequence(s) => b
                .r#type(ShardIteratorType::AfterSequenceNumber)
                .sequence_number(s.to_string()),
        };
        b.build().expect("the type is set")
    }
}

/// What one event of a subscription says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Event {
    /// The records, in shard order.
    pub records: Vec<RawRecord>,
    /// Where the next subscription goes on (after it); `None` before any record was read when
    /// the event does not say.
    pub continuation: Option<SequenceNumber>,
    /// How far behind the tip of the shard the event is.
    pub millis_behind_latest: i64,
    /// The shard is closed and every record was sent: the event names its children.
    pub ended: bool,
}

/// The events of one subscription, oldest first.
pub trait Events: Send + 'static {
    /// The next event; `None` once the subscription is over (it lasts 5 minutes).
    fn next(&mut self) -> BoxFuture<'_, Result<Option<Event>, ReadError>>;
}

/// Opens subscriptions to shards: `SubscribeToShard` ([`FanOutRecords::new`]), or a model of it
/// for tests and simulations ([`FanOutRecords::with`]).
pub trait Subscribe: Send + Sync + fmt::Debug + 'static {
    /// A subscription to `shard` of `stream` from `from`.
    fn subscribe<'a>(
        &'a self,
        stream: &'a str,
        shard: &'a str,
        from: &'a StartAt,
    ) -> BoxFuture<'a, Result<Box<dyn Events>, ReadError>>;
}

/// The least time between subscriptions to one shard that end at once: Kinesis takes one
/// SubscribeToShard a second per consumer and shard.
const RESUBSCRIBE_PAUSE: Duration = Duration::from_secs(1);

/// An open subscription and the iterator (position) its next event continues from.
struct Subscription {
    serves: String,
    events: Box<dyn Events>,
}

/// `SubscribeToShard` for the stream consumer registered by [`FanOutRecords::register`].
#[derive(Debug)]
struct KinesisSubscriber {
    client: aws_sdk_kinesis::Client,
    settings: FanOut,
    /// Consumer ARN and name by stream.
    consumers: Mutex<HashMap<String, (String, String)>>,
}

/// A `SubscribeToShard` event stream.
struct KinesisEvents(SubscribeToShardOutput);

impl Events for KinesisEvents {
    fn next(&mut self) -> BoxFuture<'_, Result<Option<Event>, ReadError>> {
        Box::pin(async move {
            loop {
                let event = self.0.event_stream.recv().await.map_err(|e| {
                    match e.as_service_error() {
                        // The last subscription to the shard still holds it: try again after a
                        // back-off. (An event-stream error carries no error code, only its kind.)
                        Some(s) if s.is_resource_in_use_exception() => ReadError::Throttled,
                        // The consumer or the shard is gone: the reader finds out which.
                        Some(s) if s.is_resource_not_found_exception() => ReadError::NotFound,
                        _ => classify(e),
                    }
                })?;
                let event = match event {
                    None => return Ok(None),
                    Some(SubscribeToShardEventStream::SubscribeToShardEvent(event)) => event,
                    Some(other) => {
                        debug!(?other, "an event of an unknown kind: skipped");
                        continue;
                    }
                };
                let records = event
                    .records
                    .into_iter()
                    .map(raw_record)
                    .collect::<Result<Vec<_>, ReadError>>()?;
                let ended = event.continuation_sequence_number.is_empty()
                    && event.child_shards.as_ref().is_some_and(|c| !c.is_empty());
                let continuation = if event.continuation_sequence_number.is_empty() {
                    None
                } else {
                    Some(
                        SequenceNumber::parse(&event.continuation_sequence_number)
                            .map_err(|e| ReadError::Other(Box::new(e)))?,
                    )
                };
                return Ok(Some(Event {
                    records,
                    continuation,
                    millis_behind_latest: event.millis_behind_latest,
                    ended,
                }));
            }
        })
    }
}

impl Subscribe for KinesisSubscriber {
    fn subscribe<'a>(
        &'a self,
        stream: &'a str,
        shard: &'a str,
        from: &'a StartAt,
    ) -> BoxFuture<'a, Result<Box<dyn Events>, ReadError>> {
        Box::pin(async move {
            let arn = self
                .consumers
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(stream)
                .map(|(arn, _)| arn.clone())
                .ok_or_else(|| {
                    ReadError::Other(
                        format!("no enhanced fan-out consumer is registered for stream `{stream}`")
                            .into(),
                    )
                })?;
            let at = Iter {
                stream: stream.to_string(),
                shard: shard.to_string(),
                start: from.clone(),
            };
            let out = self
                .client
                .subscribe_to_shard()
                .consumer_arn(arn)
                .shard_id(shard)
                .starting_position(at.starting_position())
                .send()
                .await
                .map_err(|e| {
                    let code = e
                        .as_service_error()
                        .and_then(|e| aws_sdk_kinesis::error::ProvideErrorMetadata::code(e))
                        .map(str::to_string);
                    metrics::counter!("shardwise_fanout_subscribe_failures_total", "stream" => stream.to_string(), "code" => code.clone().unwrap_or_else(|| "other".into()))
                        .increment(1);
                    match code.as_deref() {
                        // Another subscription of this consumer holds the shard (the last
                        // owner's, for up to 5 seconds after it was made): try again after a
                        // back-off.
                        Some("ResourceInUseException") => ReadError::Throttled,
                        _ => classify(e),
                    }
                })?;
            Ok(Box::new(KinesisEvents(out)) as Box<dyn Events>)
        })
    }
}

impl KinesisSubscriber {
    async fn register(&self, stream: &str, application: &str) -> Result<String, Error> {
        let name = self.settings.name_for(application);
        let stream_arn = self
            .client
            .describe_stream_summary()
            .stream_name(stream)
            .send()
            .await
            .map_err(|e| Error::kinesis("DescribeStreamSummary", stream, e))?
            .stream_description_summary
            .map(|s| s.stream_arn)
            .ok_or_else(|| Error::Corrupt {
                what: "DescribeStreamSummary answer",
                detail: format!("no stream description for `{stream}`"),
            })?;
        let arn = match self.find(stream, &stream_arn, &name).await? {
            Some(arn) => {
                self.check_owner(stream, &name, &arn, application).await?;
                arn
            }
            None => {
                match self
                    .client
                    .register_stream_consumer()
                    .stream_arn(&stream_arn)
                    .consumer_name(&name)
                    .tags(APPLICATION_TAG, application)
                    .send()
                    .await
                {
                    Ok(out) => {
                        let arn =
                            out.consumer
                                .map(|c| c.consumer_arn)
                                .ok_or_else(|| Error::Corrupt {
                                    what: "RegisterStreamConsumer answer",
                                    detail: format!("no consumer for `{name}`"),
                                })?;
                        info!(stream, consumer = %name, %arn, "registered the enhanced fan-out consumer");
                        self.tag(stream, &arn, application).await?;
                        arn
                    }
                    // Registered meanwhile (another worker of this application, or another one).
                    Err(e)
                        if e.as_service_error().and_then(|e| {
                            aws_sdk_kinesis::error::ProvideErrorMetadata::code(e)
                        }) == Some("ResourceInUseException") =>
                    {
                        let arn = self.describe(stream, &stream_arn, &name).await?.0;
                        self.check_owner(stream, &name, &arn, application).await?;
                        arn
                    }
                    Err(e) => return Err(Error::kinesis("RegisterStreamConsumer", stream, e)),
                }
            }
        };
        self.wait_active(stream, &stream_arn, &name).await?;
        self.consumers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(stream.to_string(), (arn.clone(), name));
        Ok(arn)
    }

    /// The consumer registered for `stream` is known to be gone: DescribeStreamConsumer by its
    /// ARN answers ResourceNotFoundException, or describes it `DELETING`. Any other answer (an
    /// error, a consumer in another state) is not taken for gone.
    async fn gone(&self, stream: &str) -> Option<Error> {
        let (arn, name) = self
            .consumers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(stream)
            .cloned()?;
        let answer = self
            .client
            .describe_stream_consumer()
            .consumer_arn(arn)
            .send()
            .await;
        let gone = match answer {
            Err(e) => {
                e.as_service_error()
                    .and_then(|e| aws_sdk_kinesis::error::ProvideErrorMetadata::code(e))
                    == Some("ResourceNotFoundException")
            }
            // Being deleted: as gone, it takes no subscription again.
            Ok(out) => out
                .consumer_description
                .is_some_and(|c| c.consumer_status == ConsumerStatus::Deleting),
        };
        gone.then(|| Error::ConsumerGone {
            stream: stream.to_string(),
            consumer: name,
        })
    }

    /// The ARN of the consumer named `name`, if the stream has one (ListStreamConsumers).
    async fn find(
        &self,
        stream: &str,
        stream_arn: &str,
        name: &str,
    ) -> Result<Option<String>, Error> {
        let mut pages = self
            .client
            .list_stream_consumers()
            .stream_arn(stream_arn)
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| Error::kinesis("ListStreamConsumers", stream, e))?;
            if let Some(consumer) = page
                .consumers
                .unwrap_or_default()
                .into_iter()
                .find(|c| c.consumer_name == name)
            {
                return Ok(Some(consumer.consumer_arn));
            }
        }
        Ok(None)
    }

    async fn describe(
        &self,
        stream: &str,
        stream_arn: &str,
        name: &str,
    ) -> Result<(String, ConsumerStatus), Error> {
        let description = self
            .client
            .describe_stream_consumer()
            .stream_arn(stream_arn)
            .consumer_name(name)
            .send()
            .await
            .map_err(|e| Error::kinesis("DescribeStreamConsumer", stream, e))?
            .consumer_description
            .ok_or_else(|| Error::Corrupt {
                what: "DescribeStreamConsumer answer",
                detail: format!("no description of consumer `{name}`"),
            })?;
        Ok((description.consumer_arn, description.consumer_status))
    }

    /// The application tag on the consumer.
    async fn owner(&self, stream: &str, arn: &str) -> Result<Option<String>, Error> {
        let tags = self
            .client
            .list_tags_for_resource()
            .resource_arn(arn)
            .send()
            .await
            .map_err(|e| Error::kinesis("ListTagsForResource", stream, e))?;
        Ok(tags
            .tags
            .unwrap_or_default()
            .into_iter()
            .find(|t| t.key == APPLICATION_TAG)
            .and_then(|t| t.value))
    }

    /// Tags a consumer just registered, where the registration's own tags were not kept (some
    /// emulators drop them; on AWS the tag is there and nothing is written).
    async fn tag(&self, stream: &str, arn: &str, application: &str) -> Result<(), Error> {
        if self.owner(stream, arn).await?.as_deref() == Some(application) {
            return Ok(());
        }
        self.client
            .tag_resource()
            .resource_arn(arn)
            .tags(APPLICATION_TAG, application)
            .send()
            .await
            .map_err(|e| Error::kinesis("TagResource", stream, e))?;
        Ok(())
    }

    async fn check_owner(
        &self,
        stream: &str,
        name: &str,
        arn: &str,
        application: &str,
    ) -> Result<(), Error> {
        // A consumer with no tag may be one another worker of this application registered a
        // moment ago and is tagging now (where the registration's tags were not kept): it is
        // taken for someone else's only once it stays untagged for `UNTAGGED_PATIENCE`.
        let deadline = tokio::time::Instant::now() + UNTAGGED_PATIENCE;
        loop {
            let holder = match self.owner(stream, arn).await? {
                Some(owner) if owner == application => return Ok(()),
                None if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    continue;
                }
                holder => holder,
            };
            return Err(Error::ConsumerInUse {
                stream: stream.to_string(),
                consumer: name.to_string(),
                application: application.to_string(),
                holder,
            });
        }
    }

    async fn wait_active(&self, stream: &str, stream_arn: &str, name: &str) -> Result<(), Error> {
        let deadline = tokio::time::Instant::now() + self.settings.register_timeout;
        let mut wait = Duration::from_millis(50);
        loop {
            match self.describe(stream, stream_arn, name).await?.1 {
                ConsumerStatus::Active => return Ok(()),
                ConsumerStatus::Deleting => {
                    return Err(Error::Kinesis {
                        operation: "DescribeStreamConsumer",
                        stream: stream.to_string(),
                        shard: None,
                        source: format!("consumer `{name}` is being deregistered").into(),
                    });
                }
                status => {
                    if tokio::time::Instant::now() >= deadline {
                        return Err(Error::Kinesis {
                            operation: "DescribeStreamConsumer",
                            stream: stream.to_string(),
                            shard: None,
                            source: format!(
                                "consumer `{name}` still {status:?} after {:?}",
                                self.settings.register_timeout
                            )
                            .into(),
                        });
                    }
                    debug!(
                        stream,
                        consumer = name,
                        ?status,
                        "waiting for the consumer to become ACTIVE"
                    );
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(1));
                }
            }
        }
    }
}

/// [`RecordSource`] on enhanced fan-out (see the module docs). Register the stream's consumer
/// with [`register`](Self::register) before reading.
#[derive(Clone)]
pub struct FanOutRecords {
    subscriber: Arc<dyn Subscribe>,
    /// GetShardIterator and GetRecords, for the end check.
    poller: Arc<dyn RecordSource>,
    /// The Kinesis subscriber, which registers consumers (`None` with a model).
    kinesis: Option<Arc<KinesisSubscriber>>,
    settings: FanOut,
    /// Open subscriptions by (stream, shard).
    open: Arc<Mutex<HashMap<(String, String), Subscription>>>,
    /// When each shard's end was last checked.
    checked: Arc<Mutex<HashMap<(String, String), tokio::time::Instant>>>,
}

impl fmt::Debug for FanOutRecords {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FanOutRecords")
            .field("subscriber", &self.subscriber)
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl FanOutRecords {
    /// Reads with this client (a copy of it that also reads each answer's date).
    pub fn new(client: aws_sdk_kinesis::Client, settings: FanOut) -> Self {
        let (client, clock) = dated(&client);
        let kinesis = Arc::new(KinesisSubscriber {
            client: client.clone(),
            settings: settings.clone(),
            consumers: Mutex::default(),
        });
        Self {
            subscriber: kinesis.clone(),
            poller: Arc::new(KinesisRecords::from_dated(client, clock)),
            kinesis: Some(kinesis),
            settings,
            open: Arc::default(),
            checked: Arc::default(),
        }
    }

    /// Reads through `subscriber` (a model of SubscribeToShard, for tests and simulations), with
    /// `poller` for the end check; nothing to register.
    pub fn with(
        subscriber: Arc<dyn Subscribe>,
        poller: Arc<dyn RecordSource>,
        settings: FanOut,
    ) -> Self {
        Self {
            subscriber,
            poller,
            kinesis: None,
            settings,
            open: Arc::default(),
            checked: Arc::default(),
        }
    }

    /// Finds or registers the consumer of `stream` for `application` and waits until it is
    /// `ACTIVE`; returns its ARN. A consumer of that name registered for another application, or
    /// not by shardwise, fails with [`Error::ConsumerInUse`]. A model needs none: `""`.
    pub async fn register(&self, stream: &str, application: &str) -> Result<String, Error> {
        match &self.kinesis {
            Some(kinesis) => kinesis.register(stream, application).await,
            None => Ok(String::new()),
        }
    }

    /// A subscription from `at`, serving the iterator `serves`; one whose answer does not come
    /// within the stall timeout is as stalled as one whose events stop.
    async fn subscribe(&self, at: &Iter, serves: String) -> Result<Subscription, ReadError> {
        let events = tokio::time::timeout(
            self.settings.stall_timeout,
            self.subscriber.subscribe(&at.stream, &at.shard, &at.start),
        )
        .await
        .map_err(|_| self.stalled(at))??;
        metrics::counter!("shardwise_fanout_subscriptions_total", "stream" => at.stream.clone())
            .increment(1);
        debug!(stream = %at.stream, shard = %at.shard, from = %serves, "subscribed");
        Ok(Subscription { serves, events })
    }

    /// Whether the caught-up shard `key` is due for a check of its end: at most once per
    /// [`FanOut::end_check_interval`].
    fn end_check_due(&self, key: &(String, String)) -> bool {
        let now = tokio::time::Instant::now();
        let mut checked = self.checked.lock().unwrap_or_else(PoisonError::into_inner);
        match checked.get(key) {
            Some(last) if now.duration_since(*last) < self.settings.end_check_interval => false,
            _ => {
                checked.insert(key.clone(), now);
                true
            }
        }
    }

    /// Whether the shard was read to its end at `at`: a GetRecords there returns no record and
    /// no next iterator (a closed shard with nothing after the position). Any doubt (an error, a
    /// record) answers no: the subscription goes on.
    async fn read_to_end(&self, at: &Iter) -> bool {
        let Ok(iterator) = self
            .poller
            .shard_iterator(&at.stream, &at.shard, &at.start)
            .await
        else {
            return false;
        };
        match self.poller.get_records(&iterator, 1).await {
            Ok(page) => page.records.is_empty() && page.next_iterator.is_none(),
            Err(_) => false,
        }
    }

    /// No answer or event within the stall timeout: the subscription is dropped and made again.
    fn stalled(&self, at: &Iter) -> ReadError {
        metrics::counter!("shardwise_fanout_stalls_total", "stream" => at.stream.clone())
            .increment(1);
        ReadError::Other(
            format!(
                "nothing from the subscription to {} within {:?}: subscribing again",
                at.shard, self.settings.stall_timeout
            )
            .into(),
        )
    }

    fn take(&self, key: &(String, String), iterator: &str) -> Option<Subscription> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        // One serving another position is of no use: the reader went back after an error.
        open.remove(key).filter(|s| s.serves == iterator)
    }

    /// The next event of the subscription serving `iterator`, made if there is none.
    async fn next_page(&self, iterator: &str) -> Result<Page, ReadError> {
        let at = Iter::parse(iterator).ok_or_else(|| {
            ReadError::Other(format!("not an enhanced fan-out iterator: `{iterator}`").into())
        })?;
        let key = (at.stream.clone(), at.shard.clone());
        let mut current = self.take(&key, iterator);
        // A subscription that ends at once twice in a row: an empty page, the reader asks again.
        for _ in 0..2 {
            let mut sub = match current.take() {
                Some(sub) => sub,
                None => self.subscribe(&at, iterator.to_string()).await?,
            };
            let event = tokio::time::timeout(self.settings.stall_timeout, sub.events.next())
                .await
                .map_err(|_| self.stalled(&at))??;
            // The subscription's 5 minutes are over: subscribe again from here.
            let Some(event) = event else { continue };
            let Event {
                records,
                continuation,
                millis_behind_latest,
                mut ended,
            } = event;
            // Where the next event goes on: after the continuation, or where this one began
            // when it names none.
            let next = match continuation {
                Some(continuation) => Iter {
                    start: StartAt::AfterSequence(continuation),
                    ..at.clone()
                },
                None => at.clone(),
            };
            if !ended && records.is_empty() && millis_behind_latest == 0 && self.end_check_due(&key)
            {
                ended = self.read_to_end(&next).await;
            }
            let next_iterator = (!ended).then(|| {
                let next = next.to_string();
                sub.serves = next.clone();
                self.open
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(key.clone(), sub);
                next
            });
            if ended {
                debug!(stream = %at.stream, shard = %at.shard, "the shard ended");
            }
            return Ok(Page {
                records,
                next_iterator,
                millis_behind_latest: Some(millis_behind_latest),
            });
        }
        // Two subscriptions in a row ended at once. The reader of a pushing source asks again
        // without a pause, so the pause is here: a subscription a second per shard, the
        // service's own limit for a consumer.
        tokio::time::sleep(RESUBSCRIBE_PAUSE).await;
        Ok(Page {
            records: Vec::new(),
            next_iterator: Some(iterator.to_string()),
            millis_behind_latest: None,
        })
    }
}

impl RecordSource for FanOutRecords {
    fn service_time(&self) -> Option<SystemTime> {
        self.poller.service_time()
    }

    fn pushes(&self) -> bool {
        true
    }

    fn shard_iterator<'a>(
        &'a self,
        stream: &'a str,
        shard: &'a str,
        start: &'a StartAt,
    ) -> BoxFuture<'a, Result<String, ReadError>> {
        let at = Iter {
            stream: stream.to_string(),
            shard: shard.to_string(),
            start: start.clone(),
        };
        Box::pin(async move { Ok(at.to_string()) })
    }

    fn get_records<'a>(
        &'a self,
        iterator: &'a str,
        _limit: i32,
    ) -> BoxFuture<'a, Result<Page, ReadError>> {
        Box::pin(self.next_page(iterator))
    }

    fn explain_not_found<'a>(
        &'a self,
        stream: &'a str,
        _shard: &'a str,
    ) -> BoxFuture<'a, Option<Error>> {
        Box::pin(async move {
            match &self.kinesis {
                Some(kinesis) => kinesis.gone(stream).await,
                None => None,
            }
        })
    }

    fn release(&self, stream: &str, shard: &str) {
        self.open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&(stream.to_string(), shard.to_string()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_consumer_name_kinesis_refuses_is_refused_at_build() {
        assert!(FanOut::new().validate("billing-app_2.v1").is_ok());
        let long = "a".repeat(129);
        for (fan_out, app) in [
            (FanOut::new(), "billing app"),
            (FanOut::new().consumer_name(""), "billing"),
            (FanOut::new().consumer_name(long.as_str()), "billing"),
            (FanOut::new().consumer_name("a/b"), "billing"),
        ] {
            assert_eq!(fan_out.validate(app).unwrap_err().field(), "consumer_name");
        }
        let err = FanOut::new()
            .stall_timeout(Duration::ZERO)
            .validate("billing")
            .unwrap_err();
        assert_eq!(err.field(), "stall_timeout");
    }

    /// Subscriptions that end before their first event, counted.
    #[derive(Debug, Default)]
    struct EndAtOnce(std::sync::atomic::AtomicUsize);

    struct Over;

    impl Events for Over {
        fn next(&mut self) -> BoxFuture<'_, Result<Option<Event>, ReadError>> {
            Box::pin(async { Ok(None) })
        }
    }

    impl Subscribe for EndAtOnce {
        fn subscribe<'a>(
            &'a self,
            _stream: &'a str,
            _shard: &'a str,
            _from: &'a StartAt,
        ) -> BoxFuture<'a, Result<Box<dyn Events>, ReadError>> {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Box::pin(async { Ok(Box::new(Over) as Box<dyn Events>) })
        }
    }

    #[tokio::test(start_paused = true)]
    async fn subscriptions_that_end_at_once_are_made_at_most_twice_a_second() {
        let subscriber = Arc::new(EndAtOnce::default());
        let stream = crate::testing::MemoryStream::new("orders", 1);
        let source = FanOutRecords::with(subscriber.clone(), Arc::new(stream), FanOut::new());
        let iterator = source
            .shard_iterator("orders", "shardId-000000000000", &StartAt::TrimHorizon)
            .await
            .unwrap();
        let started = tokio::time::Instant::now();
        for _ in 0..5 {
            let page = source.get_records(&iterator, 100).await.unwrap();
            assert!(page.records.is_empty());
            assert_eq!(page.next_iterator.as_deref(), Some(iterator.as_str()));
        }
        // The reader of a pushing source asks again at once: 5 asks, 10 subscriptions, 5 s.
        assert_eq!(subscriber.0.load(std::sync::atomic::Ordering::Relaxed), 10);
        assert!(started.elapsed() >= Duration::from_secs(5));
    }

    #[test]
    fn an_iterator_names_its_position_and_reads_back() {
        let seq = SequenceNumber::parse("49590338271490256608559692538361571095921575989136588898")
            .unwrap();
        for start in [
            StartAt::TrimHorizon,
            StartAt::Latest,
            StartAt::AtTimestamp(SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_123)),
            StartAt::AtSequence(seq),
            StartAt::AfterSequence(seq),
        ] {
            let it = Iter {
                stream: "orders".into(),
                shard: "shardId-000000000001".into(),
                start,
            };
            assert_eq!(Iter::parse(&it.to_string()), Some(it.clone()), "{it}");
        }
        assert_eq!(Iter::parse("AAAAAAAAAAGc..."), None);
        assert_eq!(
            Iter::parse("efo|orders|shardId-1|AT_SEQUENCE_NUMBER|x"),
            None
        );
    }
}
