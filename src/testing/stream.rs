//! In-memory Kinesis: a stream with shards, records, splits, merges and retention, serving the
//! [`RecordSource`], [`ShardLister`] and [`RecordSink`](crate::producer::RecordSink) traits.
//!
//! [`MemoryStream::service_limits`] makes it keep the service's documented limits and clocks, each
//! from the Kinesis API reference:
//! - GetRecords: "A shard iterator expires 5 minutes after it is returned to the requester"
//!   (`ExpiredIteratorException`).
//! - GetRecords: "Each data record can be up to 1 MiB in size, and each shard can read up to 2 MiB
//!   per second"; "each shard can support up to five read transactions per second", shared by
//!   every reader of the shard; past either, `ProvisionedThroughputExceededException`. A call
//!   returns at most 10,000 records or 10 MiB, and a call that returned much makes the next ones
//!   within 5 seconds throttled (modelled: more than 10 MiB served in the last 5 s throttles).
//! - Retention: records older than the retention period (24 hours by default) are trimmed;
//!   TRIM_HORIZON is "the oldest data record in the shard", and a position before it reads from
//!   there (as the API reference documents for an AT_TIMESTAMP older than the trim horizon).
//! - GetShardIterator AT_TIMESTAMP: "If a record with this exact time stamp does not exist, the
//!   iterator returned is for the next (later) record": the iterator returns only records that
//!   arrived at or after the time stamp, also when the time stamp is in the future (a host clock
//!   ahead), so records put before it are not returned by that iterator.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;

use super::faults::{Fault, Faults, Injector};
use crate::error::Error;
use crate::position::SequenceNumber;
use crate::shard::discovery::{ShardInfo, ShardLister};
use crate::shard::source::{Page, RawRecord, ReadError, RecordSource, StartAt};

#[derive(Debug)]
struct Shard {
    id: String,
    parents: Vec<String>,
    /// Inclusive hash range on a u128 ring.
    range: (u128, u128),
    records: Vec<RawRecord>,
    /// Records before this index are trimmed (past the retention period).
    trimmed: usize,
    /// GetRecords calls served in the last second, and (time, bytes) served in the last 5 s (ms).
    recent_calls: VecDeque<i64>,
    recent_bytes: VecDeque<(i64, usize)>,
    closed: bool,
    /// Past the retention period: no longer listed or readable.
    aged_out: bool,
}

#[derive(Debug)]
struct State {
    name: String,
    shards: BTreeMap<String, Shard>,
    next_shard: u32,
    next_sequence: u128,
    reads: u64,
    /// Every n-th GetRecords call fails as an expired iterator (0: never).
    expire_every: u64,
    /// Every n-th GetRecords call is throttled (0: never).
    throttle_every: u64,
    /// The service's limits and clocks (see the module docs), with this retention period.
    limits: Option<Duration>,
}

/// An in-memory stream. Cloning shares it.
#[derive(Debug, Clone)]
pub struct MemoryStream {
    state: Arc<Mutex<State>>,
    faults: Injector,
}

/// A record as stored, with its shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredRecord {
    /// The shard it went to.
    pub shard_id: String,
    /// The record.
    pub record: RawRecord,
}

fn md5_u128(key: &str) -> u128 {
    use md5::Digest;
    u128::from_be_bytes(md5::Md5::digest(key.as_bytes()).into())
}

impl MemoryStream {
    /// A stream called `name` with `shards` open shards splitting the hash range evenly.
    pub fn new(name: &str, shards: u32) -> Self {
        let mut state = State {
            name: name.to_string(),
            shards: BTreeMap::new(),
            next_shard: 0,
            next_sequence: 49_000_000_000_000_000_000_000_000_000_000_000_000,
            reads: 0,
            expire_every: 0,
            throttle_every: 0,
            limits: None,
        };
        let width = u128::MAX / shards as u128;
        for i in 0..shards {
            let start = width * i as u128;
            let end = if i + 1 == shards {
                u128::MAX
            } else {
                start + width - 1
            };
            state.add_shard(vec![], (start, end));
        }
        Self {
            state: Arc::new(Mutex::new(state)),
            faults: Injector::default(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The state, if `stream` names this stream (else `StreamNotFound`, as Kinesis answers).
    fn named(&self, stream: &str) -> Result<MutexGuard<'_, State>, Error> {
        let state = self.state();
        if stream == state.name {
            Ok(state)
        } else {
            Err(Error::StreamNotFound {
                stream: stream.to_string(),
            })
        }
    }

    /// The stream's name.
    pub fn name(&self) -> String {
        self.state().name.clone()
    }

    /// Deletes the stream, as DeleteStream does: its shards and records are gone, and every call
    /// that names it answers [`Error::StreamNotFound`] from now on.
    pub fn delete(&self) {
        let mut state = self.state();
        state.name.clear();
        state.shards.clear();
    }

    /// Appends a record to the open shard its key hashes to; returns the shard and sequence number.
    pub fn put(&self, partition_key: &str, data: impl Into<Bytes>) -> (String, SequenceNumber) {
        let hash = md5_u128(partition_key);
        let mut state = self.state();
        state.next_sequence += 1;
        let sequence = SequenceNumber::parse(&state.next_sequence.to_string()).expect("digits");
        let shard = state
            .shards
            .values_mut()
            .find(|s| !s.closed && s.range.0 <= hash && hash <= s.range.1)
            .expect("the open shards cover the hash range");
        shard.records.push(RawRecord {
            sequence,
            partition_key: partition_key.to_string(),
            data: data.into(),
            arrived_at: Some(crate::time::service_now()),
        });
        (shard.id.clone(), sequence)
    }

    /// Every record, shard by shard, in shard order.
    pub fn records(&self) -> Vec<StoredRecord> {
        self.state()
            .shards
            .values()
            .flat_map(|s| {
                s.records.iter().map(|r| StoredRecord {
                    shard_id: s.id.clone(),
                    record: r.clone(),
                })
            })
            .collect()
    }

    /// The ids of the open shards.
    pub fn open_shards(&self) -> Vec<String> {
        self.state()
            .shards
            .values()
            .filter(|s| !s.closed)
            .map(|s| s.id.clone())
            .collect()
    }

    /// Splits an open shard at the middle of its hash range; returns the two children.
    pub fn split(&self, shard_id: &str) -> (String, String) {
        let mut state = self.state();
        let parent = state.shards.get_mut(shard_id).expect("shard exists");
        assert!(!parent.closed, "split of a closed shard");
        parent.closed = true;
        let (lo, hi) = parent.range;
        let mid = lo + (hi - lo) / 2;
        let a = state.add_shard(vec![shard_id.to_string()], (lo, mid));
        let b = state.add_shard(vec![shard_id.to_string()], (mid + 1, hi));
        (a, b)
    }

    /// Merges two open shards with adjacent hash ranges; returns the child.
    pub fn merge(&self, shard_id: &str, adjacent: &str) -> String {
        let mut state = self.state();
        let (a, b) = (state.shards[shard_id].range, state.shards[adjacent].range);
        assert!(
            a.1.wrapping_add(1) == b.0 || b.1.wrapping_add(1) == a.0,
            "not adjacent"
        );
        for id in [shard_id, adjacent] {
            let s = state.shards.get_mut(id).expect("shard exists");
            assert!(!s.closed, "merge of a closed shard");
            s.closed = true;
        }
        state.add_shard(
            vec![shard_id.to_string(), adjacent.to_string()],
            (a.0.min(b.0), a.1.max(b.1)),
        )
    }

    /// Pairs of open shards with adjacent hash ranges: what [`merge`](Self::merge) accepts.
    pub fn adjacent_open_shards(&self) -> Vec<(String, String)> {
        let state = self.state();
        let mut open: Vec<&Shard> = state.shards.values().filter(|s| !s.closed).collect();
        open.sort_by_key(|s| s.range.0);
        open.windows(2)
            .filter(|w| w[0].range.1.wrapping_add(1) == w[1].range.0)
            .map(|w| (w[0].id.clone(), w[1].id.clone()))
            .collect()
    }

    /// Every shard's id and parents, and whether it is closed and aged out, in id order.
    pub fn lineage(&self) -> Vec<(String, Vec<String>, bool, bool)> {
        self.state()
            .shards
            .values()
            .map(|s| (s.id.clone(), s.parents.clone(), s.closed, s.aged_out))
            .collect()
    }

    /// Keeps the service's documented limits and clocks from now on (see the module docs):
    /// iterators that expire after 5 minutes, 5 GetRecords calls and 2 MiB per second per shard
    /// shared by every reader, and records trimmed after `retention` (the service's default is
    /// 24 hours). Times are [`simulate`](super::simulate)'s wall clock in a simulation.
    pub fn service_limits(&self, retention: Duration) {
        self.state().limits = Some(retention);
    }

    /// The records trimmed so far (past the retention period), shard by shard.
    pub fn trimmed(&self) -> Vec<StoredRecord> {
        let mut state = self.state();
        state.trim();
        state
            .shards
            .values()
            .flat_map(|s| {
                s.records[..s.trimmed].iter().map(|r| StoredRecord {
                    shard_id: s.id.clone(),
                    record: r.clone(),
                })
            })
            .collect()
    }

    /// Makes every `n`-th GetRecords call fail with an expired iterator (0 turns it off).
    pub fn expire_iterators_every(&self, n: u64) {
        self.state().expire_every = n;
    }

    /// Makes every `n`-th GetRecords call fail as throttled (0 turns it off).
    pub fn throttle_every(&self, n: u64) {
        self.state().throttle_every = n;
    }

    /// Ages a closed shard out of the stream's retention: it is no longer listed or readable.
    pub fn age_out(&self, shard_id: &str) {
        let mut state = self.state();
        let shard = state.shards.get_mut(shard_id).expect("shard exists");
        assert!(shard.closed, "only a closed shard ages out");
        shard.aged_out = true;
    }

    /// Injects `faults` into every later call (iterators, reads, listings and writes), drawn from a
    /// generator seeded with `seed`: the same calls in the same order meet the same faults. A
    /// write whose answer is lost appends its record (a retried write then duplicates it).
    pub fn inject(&self, seed: u64, faults: Faults) {
        self.faults.set(seed, faults);
    }

    /// Stops injecting faults.
    pub fn heal(&self) {
        self.faults.clear();
    }

    /// GetRecords calls served so far.
    pub fn reads(&self) -> u64 {
        self.state().reads
    }
}

/// How long an iterator is good for, with the service's limits.
const ITERATOR_LIFETIME: Duration = Duration::from_secs(300);
/// GetRecords calls per second per shard.
const CALLS_PER_SECOND: usize = 5;
/// Bytes served per shard in any 5 s before the next calls are throttled (2 MiB/s).
const BYTES_PER_5_SECONDS: usize = 10 * 1024 * 1024;
/// What one GetRecords call returns at most.
const CALL_RECORDS: usize = 10_000;
const CALL_BYTES: usize = 10 * 1024 * 1024;

fn now_ms() -> i64 {
    crate::time::millis(crate::time::service_now())
}

/// An iterator: the shard, the index of the next record, and with the service's limits when it
/// was issued and the arrival time before which records are not returned (AT_TIMESTAMP).
#[derive(Debug, PartialEq, Eq)]
struct ShardIterator<'a> {
    shard: &'a str,
    index: usize,
    issued: Option<i64>,
    not_before: Option<i64>,
}

impl<'a> ShardIterator<'a> {
    /// `shard/index`, or with the service's limits `shard/index/issued/not-before` (`-`: none).
    fn encode(&self) -> String {
        match self.issued {
            None => format!("{}/{}", self.shard, self.index),
            Some(issued) => format!(
                "{}/{}/{issued}/{}",
                self.shard,
                self.index,
                self.not_before.map_or("-".into(), |t| t.to_string())
            ),
        }
    }

    fn parse(it: &'a str) -> Option<Self> {
        let mut parts = it.split('/');
        let shard = parts.next()?;
        let index = parts.next()?.parse().ok()?;
        let issued = match parts.next() {
            None => None,
            Some(t) => Some(t.parse().ok()?),
        };
        let not_before = match parts.next() {
            None | Some("-") => None,
            Some(t) => Some(t.parse().ok()?),
        };
        Some(Self {
            shard,
            index,
            issued,
            not_before,
        })
    }
}

impl State {
    /// Trims, with the service's limits, every record older than the retention period.
    fn trim(&mut self) {
        let Some(retention) = self.limits else {
            return;
        };
        let horizon = crate::time::service_now().checked_sub(retention);
        for shard in self.shards.values_mut() {
            while let Some(record) = shard.records.get(shard.trimmed) {
                let old = matches!(
                    (record.arrived_at, horizon),
                    (Some(at), Some(horizon)) if at < horizon
                );
                if !old {
                    break;
                }
                shard.trimmed += 1;
            }
        }
    }

    fn add_shard(&mut self, parents: Vec<String>, range: (u128, u128)) -> String {
        let id = format!("shardId-{:012}", self.next_shard);
        self.next_shard += 1;
        self.shards.insert(
            id.clone(),
            Shard {
                id: id.clone(),
                parents,
                range,
                records: vec![],
                trimmed: 0,
                recent_calls: VecDeque::new(),
                recent_bytes: VecDeque::new(),
                closed: false,
                aged_out: false,
            },
        );
        id
    }
}

/// The stream's own clock, truncated to the second as an answer's `Date` header is: the simulated
/// hosts' clocks ([`HostClock`](crate::testing::HostClock)) do not move it.
fn dated_now() -> std::time::SystemTime {
    let ms = crate::time::millis(crate::time::service_now());
    crate::time::from_millis(ms - ms.rem_euclid(1_000))
}

impl RecordSource for MemoryStream {
    fn service_time(&self) -> Option<std::time::SystemTime> {
        Some(dated_now())
    }

    fn shard_iterator<'a>(
        &'a self,
        stream: &'a str,
        shard: &'a str,
        start: &'a StartAt,
    ) -> BoxFuture<'a, Result<String, ReadError>> {
        let fault = self.faults.draw(false, false);
        let result = (|| {
            let mut state = self.state();
            state.trim();
            if stream != state.name {
                return Err(ReadError::NotFound);
            }
            let limits = state.limits.is_some();
            let s = state
                .shards
                .get(shard)
                .filter(|s| !s.aged_out)
                .ok_or(ReadError::NotFound)?;
            let first = |found: Option<usize>| found.unwrap_or(s.records.len()).max(s.trimmed);
            let index = match start {
                StartAt::TrimHorizon => s.trimmed,
                StartAt::Latest => s.records.len(),
                StartAt::AtTimestamp(t) => first(
                    s.records
                        .iter()
                        .position(|r| r.arrived_at.is_some_and(|a| a >= *t)),
                ),
                StartAt::AtSequence(seq) => {
                    first(s.records.iter().position(|r| r.sequence >= *seq))
                }
                StartAt::AfterSequence(seq) => {
                    first(s.records.iter().position(|r| r.sequence > *seq))
                }
            };
            let not_before = match start {
                StartAt::AtTimestamp(t) if limits => Some(crate::time::millis(*t)),
                _ => None,
            };
            Ok(ShardIterator {
                shard,
                index,
                issued: limits.then(now_ms),
                not_before,
            }
            .encode())
        })();
        read_fault(fault, result)
    }

    fn get_records<'a>(
        &'a self,
        iterator: &'a str,
        limit: i32,
    ) -> BoxFuture<'a, Result<Page, ReadError>> {
        let fault = self.faults.draw(false, true);
        let result = (|| {
            let mut state = self.state();
            state.reads += 1;
            if state.expire_every > 0 && state.reads.is_multiple_of(state.expire_every) {
                return Err(ReadError::ExpiredIterator);
            }
            if state.throttle_every > 0 && state.reads.is_multiple_of(state.throttle_every) {
                return Err(ReadError::Throttled);
            }
            let it = ShardIterator::parse(iterator)
                .ok_or_else(|| ReadError::Other("bad iterator".into()))?;
            if state.limits.is_none() {
                let s = state.shards.get(it.shard).ok_or(ReadError::NotFound)?;
                let end = (it.index + limit.max(1) as usize).min(s.records.len());
                let records = s.records.get(it.index..end).unwrap_or_default().to_vec();
                let at_end = end >= s.records.len();
                return Ok(Page {
                    records,
                    next_iterator: (!(at_end && s.closed))
                        .then(|| ShardIterator { index: end, ..it }.encode()),
                    millis_behind_latest: Some(if at_end { 0 } else { 1000 }),
                });
            }
            state.limited_read(it, limit)
        })();
        read_fault(fault, result)
    }
}

impl State {
    /// GetRecords with the service's limits (see the module docs).
    fn limited_read(&mut self, it: ShardIterator<'_>, limit: i32) -> Result<Page, ReadError> {
        self.trim();
        let now = now_ms();
        if it
            .issued
            .is_none_or(|issued| now - issued > ITERATOR_LIFETIME.as_millis() as i64)
        {
            return Err(ReadError::ExpiredIterator);
        }
        let s = self.shards.get_mut(it.shard).ok_or(ReadError::NotFound)?;
        while s.recent_calls.front().is_some_and(|t| *t <= now - 1_000) {
            s.recent_calls.pop_front();
        }
        while s
            .recent_bytes
            .front()
            .is_some_and(|(t, _)| *t <= now - 5_000)
        {
            s.recent_bytes.pop_front();
        }
        let served: usize = s.recent_bytes.iter().map(|(_, b)| b).sum();
        if s.recent_calls.len() >= CALLS_PER_SECOND || served >= BYTES_PER_5_SECONDS {
            return Err(ReadError::Throttled);
        }
        s.recent_calls.push_back(now);
        let limit = (limit.max(1) as usize).min(CALL_RECORDS);
        let mut index = it.index.max(s.trimmed);
        let (mut records, mut bytes) = (Vec::new(), 0);
        while let Some(record) = s.records.get(index) {
            if records.len() == limit || bytes + record.data.len() > CALL_BYTES {
                break;
            }
            index += 1;
            let before = it
                .not_before
                .is_some_and(|t| record.arrived_at.is_none_or(|a| crate::time::millis(a) < t));
            if !before {
                bytes += record.data.len();
                records.push(record.clone());
            }
        }
        s.recent_bytes.push_back((now, bytes));
        let at_end = index >= s.records.len();
        let behind = s
            .records
            .get(index)
            .and_then(|r| r.arrived_at)
            .and_then(|a| crate::time::service_now().duration_since(a).ok());
        Ok(Page {
            records,
            next_iterator: (!(at_end && s.closed)).then(|| {
                ShardIterator {
                    index,
                    issued: Some(now),
                    ..it
                }
                .encode()
            }),
            millis_behind_latest: Some(behind.map_or(0, |d| d.as_millis() as i64)),
        })
    }
}

/// A read's answer as `fault` makes it: the read had no effect, so only its answer changes.
fn read_fault<T: Send + 'static>(
    fault: Option<Fault>,
    result: Result<T, ReadError>,
) -> BoxFuture<'static, Result<T, ReadError>> {
    Box::pin(async move {
        match fault {
            None => result,
            Some(Fault::Error) => Err(ReadError::Other("injected fault: error".into())),
            Some(Fault::Throttle) => Err(ReadError::Throttled),
            Some(Fault::ExpiredIterator) => Err(ReadError::ExpiredIterator),
            Some(Fault::Timeout(after) | Fault::LostAnswer(after)) => {
                tokio::time::sleep(after).await;
                Err(ReadError::Other("injected fault: timed out".into()))
            }
            Some(Fault::SlowAnswer(after)) => {
                tokio::time::sleep(after).await;
                result
            }
        }
    })
}

/// A call's answer as `fault` makes it (`result` is what happened, if anything did).
fn call_fault<T: Send + 'static>(
    operation: &'static str,
    stream: &str,
    fault: Option<Fault>,
    result: Result<T, Error>,
) -> BoxFuture<'static, Result<T, Error>> {
    let stream = stream.to_string();
    Box::pin(async move {
        let injected = |what: &str, stream: String| Error::Kinesis {
            operation,
            stream,
            shard: None,
            source: format!("injected fault: {what}").into(),
        };
        match fault {
            None | Some(Fault::ExpiredIterator) => result,
            Some(Fault::Error) => Err(injected("error", stream)),
            Some(Fault::Throttle) => Err(injected("throughput exceeded", stream)),
            Some(Fault::Timeout(after)) => {
                tokio::time::sleep(after).await;
                Err(injected("timed out", stream))
            }
            Some(Fault::LostAnswer(after)) => {
                tokio::time::sleep(after).await;
                Err(injected("timed out after the record was written", stream))
            }
            Some(Fault::SlowAnswer(after)) => {
                tokio::time::sleep(after).await;
                result
            }
        }
    })
}

impl ShardLister for MemoryStream {
    fn service_time(&self) -> Option<std::time::SystemTime> {
        Some(dated_now())
    }

    /// The retention of [`service_limits`](Self::service_limits); without them nothing is
    /// trimmed, and records are kept for good.
    fn retention<'a>(
        &'a self,
        stream: &'a str,
    ) -> BoxFuture<'a, Result<crate::receipts::SourceRetention, Error>> {
        let result = self.named(stream).map(|state| match state.limits {
            Some(retention) => crate::receipts::SourceRetention::For(retention),
            None => crate::receipts::SourceRetention::Forever,
        });
        Box::pin(std::future::ready(result))
    }

    fn list_shards<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<Vec<ShardInfo>, Error>> {
        let fault = self.faults.draw(false, false);
        let result = self.named(stream).map(|state| {
            state
                .shards
                .values()
                .filter(|s| !s.aged_out)
                .map(|s| ShardInfo {
                    shard_id: s.id.clone(),
                    parents: s.parents.clone(),
                    closed: s.closed,
                })
                .collect()
        });
        call_fault("ListShards", stream, fault, result)
    }
}

impl crate::producer::RecordSink for MemoryStream {
    fn put<'a>(
        &'a self,
        stream: &'a str,
        partition_key: &'a str,
        data: Bytes,
    ) -> BoxFuture<'a, Result<crate::producer::Written, Error>> {
        let fault = self.faults.draw(true, false);
        let applies = matches!(
            fault,
            None | Some(Fault::LostAnswer(_) | Fault::SlowAnswer(_))
        );
        // The state's lock is let go before the put takes it again.
        let named = self.named(stream).map(drop);
        let result = if let Err(e) = named {
            Err(e)
        } else if applies {
            let (shard_id, sequence) = MemoryStream::put(self, partition_key, data);
            Ok(crate::producer::Written { shard_id, sequence })
        } else {
            Err(Error::Corrupt {
                what: "injected fault",
                detail: "not written".into(),
            })
        };
        call_fault("PutRecord", stream, fault, result)
    }

    fn check<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        let result = self.named(stream).map(drop);
        Box::pin(async move { result })
    }
}

/// Several in-memory streams behind one [`RecordSink`](crate::producer::RecordSink), routed by
/// name: the consumed stream and a dead-letter stream, say. A stream can be added later, to show a
/// write that fails until its stream exists.
#[derive(Debug, Clone, Default)]
pub struct MemoryStreams {
    streams: Arc<Mutex<Vec<MemoryStream>>>,
}

impl MemoryStreams {
    /// Routes writes to these streams.
    pub fn new(streams: impl IntoIterator<Item = MemoryStream>) -> Self {
        Self {
            streams: Arc::new(Mutex::new(streams.into_iter().collect())),
        }
    }

    /// Adds a stream.
    pub fn add(&self, stream: MemoryStream) {
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(stream);
    }
}

impl MemoryStreams {
    fn find(&self, stream: &str) -> Option<MemoryStream> {
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|s| s.name() == stream)
            .cloned()
    }

    /// Removes a stream (as a deletion would): writes to it fail from now on.
    pub fn remove(&self, name: &str) {
        self.streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|s| s.name() != name);
    }
}

impl crate::producer::RecordSink for MemoryStreams {
    fn check<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        let result = match self.find(stream) {
            Some(_) => Ok(()),
            None => Err(Error::StreamNotFound {
                stream: stream.to_string(),
            }),
        };
        Box::pin(async move { result })
    }

    fn put<'a>(
        &'a self,
        stream: &'a str,
        partition_key: &'a str,
        data: Bytes,
    ) -> BoxFuture<'a, Result<crate::producer::Written, Error>> {
        match self.find(stream) {
            Some(s) => Box::pin(async move {
                crate::producer::RecordSink::put(&s, stream, partition_key, data).await
            }),
            None => Box::pin(async move {
                Err(Error::StreamNotFound {
                    stream: stream.to_string(),
                })
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use super::*;

    fn base() -> std::time::SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_767_225_600)
    }

    async fn read(stream: &MemoryStream, iterator: &str) -> Result<Page, ReadError> {
        stream.get_records(iterator, 100).await
    }

    fn data(page: &Page) -> Vec<String> {
        page.records
            .iter()
            .map(|r| String::from_utf8_lossy(&r.data).into_owned())
            .collect()
    }

    #[tokio::test(start_paused = true)]
    async fn with_the_service_limits_iterators_expire_and_reads_are_rationed_per_shard() {
        let _simulated = crate::testing::simulate(base(), 1);
        let stream = MemoryStream::new("s", 1);
        stream.service_limits(Duration::from_secs(24 * 3600));
        stream.put("k", "a");
        let shard = stream.open_shards().remove(0);
        let first = stream
            .shard_iterator("s", &shard, &StartAt::TrimHorizon)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(301)).await;
        assert!(matches!(
            read(&stream, &first).await,
            Err(ReadError::ExpiredIterator)
        ));
        // Five calls a second for the shard, whichever reader makes them.
        let a = stream
            .shard_iterator("s", &shard, &StartAt::TrimHorizon)
            .await
            .unwrap();
        let b = stream
            .shard_iterator("s", &shard, &StartAt::TrimHorizon)
            .await
            .unwrap();
        for it in [&a, &b, &a, &b, &a] {
            assert_eq!(data(&read(&stream, it).await.unwrap()), ["a"]);
        }
        assert!(matches!(read(&stream, &b).await, Err(ReadError::Throttled)));
        tokio::time::sleep(Duration::from_secs(1)).await;
        let page = read(&stream, &b).await.unwrap();
        // Each answer's iterator is new: good for another 5 minutes.
        tokio::time::sleep(Duration::from_secs(299)).await;
        stream.put("k", "b");
        let next = page.next_iterator.unwrap();
        assert_eq!(data(&read(&stream, &next).await.unwrap()), ["b"]);
        // 2 MiB/s: once 10 MiB were served in 5 s (at most 10 MiB per call), the next calls
        // are throttled until the 5 s have passed.
        for _ in 0..12 {
            stream.put("k", vec![0u8; 1024 * 1024]);
        }
        let it = stream
            .shard_iterator("s", &shard, &StartAt::TrimHorizon)
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
        let big = read(&stream, &it).await.unwrap();
        assert_eq!(big.records.len(), 2 + 9, "10 MiB at most per call");
        let rest = read(&stream, &big.next_iterator.unwrap()).await.unwrap();
        assert_eq!(rest.records.len(), 3, "9 MiB served: not yet throttled");
        let tip = rest.next_iterator.unwrap();
        assert!(matches!(
            read(&stream, &tip).await,
            Err(ReadError::Throttled)
        ));
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(read(&stream, &tip).await.unwrap().records.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn with_the_service_limits_old_records_are_trimmed_and_a_future_timestamp_waits() {
        let _simulated = crate::testing::simulate(base(), 1);
        let stream = MemoryStream::new("s", 1);
        stream.service_limits(Duration::from_secs(3600));
        let (shard, old) = stream.put("k", "old");
        tokio::time::sleep(Duration::from_secs(1800)).await;
        stream.put("k", "kept");
        tokio::time::sleep(Duration::from_secs(1801)).await;
        assert_eq!(stream.trimmed().len(), 1);
        for start in [StartAt::TrimHorizon, StartAt::AtSequence(old)] {
            let it = stream.shard_iterator("s", &shard, &start).await.unwrap();
            assert_eq!(data(&read(&stream, &it).await.unwrap()), ["kept"]);
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        // A time stamp 10 s ahead (a host clock ahead): what arrives before it is not returned.
        let ahead = crate::time::service_now() + Duration::from_secs(10);
        let it = stream
            .shard_iterator("s", &shard, &StartAt::AtTimestamp(ahead))
            .await
            .unwrap();
        stream.put("k", "early");
        tokio::time::sleep(Duration::from_secs(11)).await;
        stream.put("k", "late");
        assert_eq!(data(&read(&stream, &it).await.unwrap()), ["late"]);
    }
}
