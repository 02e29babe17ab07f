//! Reads one shard: resumes from its checkpoint, polls within the service's limits, backs off on
//! throttling and errors, recovers expired iterators, and notices the end of a closed shard.
//!
//! The reader runs as its own task and hands batches over a channel of capacity one, so a shard
//! whose deliveries are all in flight simply stops being read (backpressure) and a slow handler
//! never cancels a read half-way.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::source::{Page, ReadError, RecordSource, StartAt};
use crate::backoff::Backoff;
use crate::checkpoint::Checkpoint;
use crate::kpl::{self, Deaggregated};
use crate::position::Position;
#[cfg(feature = "cloudwatch-logs")]
use crate::subscription::{self, Unpacked};

/// Reading limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReaderSettings {
    /// Records per GetRecords call (1 to 10,000).
    pub limit: i32,
    /// Wait between calls once caught up with the tip.
    pub poll_interval: Duration,
    /// Least time between two GetRecords calls on one shard (Kinesis allows 5 per second).
    pub min_call_interval: Duration,
    /// Longest backoff after throttling or errors.
    pub max_backoff: Duration,
    /// Paged sources: the longest wait between fetches of a partition that stays idle (the poll
    /// interval doubles with each page in a row that brings nothing, up to this).
    pub idle_poll_max: Duration,
    /// Records are CloudWatch Logs subscription documents: each log event is a record
    /// (`crate::subscription`, feature `cloudwatch-logs`).
    pub cloudwatch_subscription: bool,
}

impl Default for ReaderSettings {
    fn default() -> Self {
        Self {
            limit: 10_000,
            poll_interval: Duration::from_secs(1),
            min_call_interval: Duration::from_millis(200),
            max_backoff: Duration::from_secs(5),
            idle_poll_max: Duration::from_secs(30),
            cloudwatch_subscription: false,
        }
    }
}

/// One record to deliver: a plain Kinesis record or one sub-record of a KPL aggregate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadRecord {
    /// Sequence number and sub-sequence.
    pub position: Position,
    /// Partition key (the sub-record's own, inside an aggregate).
    pub partition_key: String,
    /// Explicit hash key, when the aggregate carried one.
    pub explicit_hash_key: Option<String>,
    /// The data blob (may hold a header envelope).
    pub data: Bytes,
    /// When Kinesis accepted the record.
    pub arrived_at: Option<SystemTime>,
    /// Headers the reader gives it (a CloudWatch Logs event's origin), in place of any the data
    /// carries.
    pub headers: Option<crate::envelope::Headers>,
}

/// What the reader task sends.
#[derive(Debug)]
pub(crate) enum ReaderMessage {
    /// Records in shard order (possibly none, to report lag).
    Records {
        /// The records.
        records: Vec<ReadRecord>,
        /// How far behind the tip this batch is.
        millis_behind_latest: Option<i64>,
    },
    /// The shard is closed and has been read to its end.
    End,
    /// The stream or the shard is not found: deleted, or the shard aged out of retention.
    Gone,
}

/// Where to start reading a shard with this checkpoint, and what to skip once there: the
/// checkpointed position itself and, for a partly handled KPL aggregate, its handled sub-records.
/// `None` when the shard is already at its end.
pub(crate) fn resume_point(checkpoint: &Checkpoint) -> Option<(StartAt, Option<Position>)> {
    Some(match checkpoint {
        Checkpoint::TrimHorizon => (StartAt::TrimHorizon, None),
        Checkpoint::Latest => (StartAt::Latest, None),
        Checkpoint::AtTimestamp(t) => (StartAt::AtTimestamp(*t), None),
        Checkpoint::At(p) => (StartAt::AtSequence(*p.sequence()), Some(*p)),
        Checkpoint::Before(p) => (
            StartAt::AtSequence(*p.sequence()),
            p.sub_sequence()
                .checked_sub(1)
                .map(|sub| Position::new(*p.sequence(), sub)),
        ),
        Checkpoint::ShardEnd => return None,
    })
}

/// Reads a shard, starting from `checkpoint`, until its end, `cancel`, or the receiver is dropped.
#[derive(Debug)]
pub(crate) struct ShardReader {
    source: Arc<dyn RecordSource>,
    stream: String,
    shard: String,
    settings: ReaderSettings,
    start: StartAt,
    /// Records at or before this position were already delivered or checkpointed: skip them.
    after: Option<Position>,
}

impl ShardReader {
    /// A reader resuming from `checkpoint`; `None` if the shard already ended.
    pub(crate) fn new(
        source: Arc<dyn RecordSource>,
        stream: &str,
        shard: &str,
        checkpoint: &Checkpoint,
        settings: ReaderSettings,
    ) -> Option<Self> {
        let (start, after) = resume_point(checkpoint)?;
        Some(Self {
            source,
            stream: stream.to_string(),
            shard: shard.to_string(),
            settings,
            start,
            after,
        })
    }

    /// Reads until the end, cancellation, or a dropped receiver.
    pub(crate) async fn run(mut self, out: mpsc::Sender<ReaderMessage>, cancel: CancellationToken) {
        let msg = tokio::select! {
            biased;
            _ = cancel.cancelled() => None,
            msg = self.read(&out) => msg,
        };
        self.source.release(&self.stream, &self.shard);
        if let Some(msg) = msg {
            let _ = out.send(msg).await;
        }
    }

    /// The read loop; returns the final message (end or failure), or `None` if the receiver went away.
    async fn read(&mut self, out: &mpsc::Sender<ReaderMessage>) -> Option<ReaderMessage> {
        let mut iterator: Option<String> = None;
        let mut backoff = Backoff::new(self.settings.max_backoff);
        let mut next_call = Instant::now();
        loop {
            let current = match iterator.take() {
                Some(it) => it,
                None => match self.open().await {
                    Ok(it) => it,
                    Err(ReadError::NotFound) => return Some(ReaderMessage::Gone),
                    Err(e) => {
                        self.back_off(backoff.next(), &e).await;
                        continue;
                    }
                },
            };
            tokio::time::sleep_until(next_call).await;
            let called = Instant::now();
            let page = match self.source.get_records(&current, self.settings.limit).await {
                Ok(page) => page,
                Err(ReadError::ExpiredIterator) => {
                    debug!(shard = %self.shard, "iterator expired; reopening after the last record read");
                    continue; // `iterator` is None: reopen from `start`/`after`
                }
                Err(ReadError::NotFound) => return Some(ReaderMessage::Gone),
                Err(e) => {
                    self.back_off(backoff.next(), &e).await;
                    iterator = Some(current);
                    continue;
                }
            };
            backoff.reset();
            let Page {
                records,
                next_iterator,
                millis_behind_latest,
            } = page;
            let empty = records.is_empty();
            let unchanged = next_iterator.as_deref() == Some(current.as_str());
            let batch = self.unpack(records);
            if let Some(last) = batch.last() {
                self.after = Some(last.position);
                self.start = StartAt::AtSequence(*last.position.sequence());
            }
            if !batch.is_empty() || millis_behind_latest.is_some() {
                let msg = ReaderMessage::Records {
                    records: batch,
                    millis_behind_latest,
                };
                if out.send(msg).await.is_err() {
                    return None;
                }
            }
            let Some(next) = next_iterator else {
                return Some(ReaderMessage::End);
            };
            let caught_up = empty && (millis_behind_latest == Some(0) || unchanged);
            next_call = called
                + if self.source.pushes() {
                    Duration::ZERO
                } else if caught_up {
                    self.settings
                        .poll_interval
                        .max(self.settings.min_call_interval)
                } else {
                    self.settings.min_call_interval
                };
            iterator = Some(next);
        }
    }

    async fn open(&self) -> Result<String, ReadError> {
        self.source
            .shard_iterator(&self.stream, &self.shard, &self.start)
            .await
    }

    async fn back_off(&self, wait: Duration, error: &ReadError) {
        match error {
            ReadError::Throttled => debug!(shard = %self.shard, ?wait, "throttled; backing off"),
            e => {
                warn!(shard = %self.shard, error = e as &dyn std::error::Error, ?wait, "read failed; backing off")
            }
        }
        tokio::time::sleep(wait).await;
    }

    /// A CloudWatch Logs subscription record's events, added to `out`; `false` when the record is
    /// to be delivered whole (not a subscription document: counted and warned when it is gzip).
    #[cfg(feature = "cloudwatch-logs")]
    fn log_events(&self, r: &super::source::RawRecord, out: &mut Vec<ReadRecord>) -> bool {
        if !self.settings.cloudwatch_subscription {
            return false;
        }
        match subscription::unpack(&r.data) {
            Unpacked::Events(events) => {
                out.extend(events.into_iter().map(|e| ReadRecord {
                    position: Position::new(r.sequence, e.sub_sequence),
                    partition_key: if e.log_stream.is_empty() {
                        r.partition_key.clone()
                    } else {
                        e.log_stream.clone()
                    },
                    explicit_hash_key: None,
                    headers: Some(e.headers()),
                    data: e.message,
                    arrived_at: r.arrived_at,
                }));
                true
            }
            Unpacked::Control => {
                debug!(shard = %self.shard, sequence = %r.sequence, "a CloudWatch Logs control message: nothing to deliver");
                true
            }
            Unpacked::Corrupt(why) => {
                warn!(shard = %self.shard, sequence = %r.sequence, why, "not a CloudWatch Logs subscription document: delivered as one plain record");
                metrics::counter!("shardwise_cloudwatch_corrupt_total").increment(1);
                false
            }
            // A retry copy of an event (an envelope carrying its headers) belongs here.
            Unpacked::Plain if crate::envelope::looks_enveloped(&r.data) => false,
            Unpacked::Plain => {
                warn!(shard = %self.shard, sequence = %r.sequence, "a record that is not gzip on a CloudWatch Logs subscription stream: delivered as one plain record");
                metrics::counter!("shardwise_cloudwatch_corrupt_total").increment(1);
                false
            }
        }
    }

    /// Without the `cloudwatch-logs` feature nothing is a subscription document.
    #[cfg(not(feature = "cloudwatch-logs"))]
    fn log_events(&self, _: &super::source::RawRecord, _: &mut Vec<ReadRecord>) -> bool {
        false
    }

    /// Unpacks KPL aggregates and drops what is at or before `after`.
    fn unpack(&self, records: Vec<super::source::RawRecord>) -> Vec<ReadRecord> {
        let mut out = Vec::with_capacity(records.len());
        for r in records {
            match kpl::deaggregate(&r.data) {
                Deaggregated::Aggregate(subs) => {
                    out.extend(subs.into_iter().map(|s| ReadRecord {
                        position: Position::new(r.sequence, s.sub_sequence),
                        partition_key: s.partition_key,
                        explicit_hash_key: s.explicit_hash_key,
                        data: s.data,
                        arrived_at: r.arrived_at,
                        headers: None,
                    }));
                }
                other => {
                    if let Deaggregated::Corrupt(why) = other {
                        warn!(shard = %self.shard, sequence = %r.sequence, why, "corrupt KPL aggregate: delivered as one plain record");
                        metrics::counter!("shardwise_kpl_corrupt_total").increment(1);
                    } else if self.log_events(&r, &mut out) {
                        continue;
                    }
                    out.push(ReadRecord {
                        position: Position::new(r.sequence, 0),
                        partition_key: r.partition_key,
                        explicit_hash_key: None,
                        data: r.data,
                        arrived_at: r.arrived_at,
                        headers: None,
                    });
                }
            }
        }
        if let Some(after) = self.after {
            out.retain(|r| r.position > after);
        }
        out
    }
}
