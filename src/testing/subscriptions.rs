//! A model of `SubscribeToShard` over any [`RecordSource`], for enhanced fan-out in tests and
//! simulations ([`FanOutRecords::with`](crate::shard::fanout::FanOutRecords::with)).
//!
//! A subscription opens an iterator at its starting position and sends an event at once and then
//! one a second ([`Subscriptions::every`] for another period), each with what one GetRecords there returns (as kinesis-mock does; Kinesis
//! pushes as records arrive): the records, the last one's sequence number as the continuation,
//! how far behind the tip it is, and at the end of a closed shard an event that says so. It ends
//! after 5 minutes, as Kinesis ends every subscription. Whatever the source fails with (an
//! injected fault, a throttle) ends the event stream with that error; an expired iterator reads
//! as a cut connection.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::position::SequenceNumber;
use crate::shard::fanout::{Event, Events, Subscribe};
use crate::shard::source::{ReadError, RecordSource, StartAt};

/// How long a subscription lasts.
const LIFETIME: Duration = Duration::from_secs(300);
/// The time between two events.
const EVENT_INTERVAL: Duration = Duration::from_secs(1);

/// Subscriptions over a record source.
#[derive(Debug, Clone)]
pub struct Subscriptions {
    source: Arc<dyn RecordSource>,
    every: Duration,
}

impl Subscriptions {
    /// Subscriptions that read `source`, an event a second.
    pub fn over(source: Arc<dyn RecordSource>) -> Self {
        Self {
            source,
            every: EVENT_INTERVAL,
        }
    }

    /// An event every `d` instead (a short one models Kinesis pushing records as they arrive).
    pub fn every(mut self, d: Duration) -> Self {
        self.every = d;
        self
    }
}

struct Subscription {
    source: Arc<dyn RecordSource>,
    every: Duration,
    iterator: String,
    opened: tokio::time::Instant,
    sent: bool,
    continuation: Option<SequenceNumber>,
}

impl Subscribe for Subscriptions {
    fn subscribe<'a>(
        &'a self,
        stream: &'a str,
        shard: &'a str,
        from: &'a StartAt,
    ) -> BoxFuture<'a, Result<Box<dyn Events>, ReadError>> {
        Box::pin(async move {
            let iterator = self.source.shard_iterator(stream, shard, from).await?;
            Ok(Box::new(Subscription {
                source: self.source.clone(),
                every: self.every,
                iterator,
                opened: tokio::time::Instant::now(),
                sent: false,
                continuation: None,
            }) as Box<dyn Events>)
        })
    }
}

impl Events for Subscription {
    fn next(&mut self) -> BoxFuture<'_, Result<Option<Event>, ReadError>> {
        Box::pin(async move {
            if self.sent {
                tokio::time::sleep(self.every).await;
            }
            if self.opened.elapsed() >= LIFETIME {
                return Ok(None);
            }
            self.sent = true;
            let page = match self.source.get_records(&self.iterator, 10_000).await {
                Err(ReadError::ExpiredIterator) => {
                    return Err(ReadError::Other(
                        "the subscription's connection was cut".into(),
                    ));
                }
                other => other?,
            };
            if let Some(last) = page.records.last() {
                self.continuation = Some(last.sequence);
            }
            let ended = page.next_iterator.is_none();
            if let Some(next) = page.next_iterator {
                self.iterator = next;
            }
            Ok(Some(Event {
                records: page.records,
                continuation: self.continuation,
                millis_behind_latest: page.millis_behind_latest.unwrap_or(0),
                ended,
            }))
        })
    }
}
