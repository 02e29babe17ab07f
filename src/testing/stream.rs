//! In-memory Kinesis: a stream with shards, records, splits, merges and retention, serving the
//! [`RecordSource`], [`ShardLister`] and [`RecordSink`](crate::producer::RecordSink) traits.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

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

    /// The stream's name.
    pub fn name(&self) -> String {
        self.state().name.clone()
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
            arrived_at: Some(crate::time::now()),
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

impl State {
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
                closed: false,
                aged_out: false,
            },
        );
        id
    }
}

/// Iterators are `shard/index`: the index of the next record to return.
fn parse_iterator(it: &str) -> Option<(&str, usize)> {
    let (shard, index) = it.rsplit_once('/')?;
    Some((shard, index.parse().ok()?))
}

impl RecordSource for MemoryStream {
    fn shard_iterator<'a>(
        &'a self,
        stream: &'a str,
        shard: &'a str,
        start: &'a StartAt,
    ) -> BoxFuture<'a, Result<String, ReadError>> {
        let fault = self.faults.draw(false, false);
        let result = (|| {
            let state = self.state();
            if stream != state.name {
                return Err(ReadError::NotFound);
            }
            let s = state
                .shards
                .get(shard)
                .filter(|s| !s.aged_out)
                .ok_or(ReadError::NotFound)?;
            let index = match start {
                StartAt::TrimHorizon => 0,
                StartAt::Latest => s.records.len(),
                StartAt::AtTimestamp(t) => s
                    .records
                    .iter()
                    .position(|r| r.arrived_at.is_some_and(|a| a >= *t))
                    .unwrap_or(s.records.len()),
                StartAt::AtSequence(seq) => s
                    .records
                    .iter()
                    .position(|r| r.sequence >= *seq)
                    .unwrap_or(s.records.len()),
                StartAt::AfterSequence(seq) => s
                    .records
                    .iter()
                    .position(|r| r.sequence > *seq)
                    .unwrap_or(s.records.len()),
            };
            Ok(format!("{shard}/{index}"))
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
            let (shard, index) =
                parse_iterator(iterator).ok_or_else(|| ReadError::Other("bad iterator".into()))?;
            let s = state.shards.get(shard).ok_or(ReadError::NotFound)?;
            let end = (index + limit.max(1) as usize).min(s.records.len());
            let records = s.records.get(index..end).unwrap_or_default().to_vec();
            let at_end = end >= s.records.len();
            Ok(Page {
                records,
                next_iterator: (!(at_end && s.closed)).then(|| format!("{shard}/{end}")),
                millis_behind_latest: Some(if at_end { 0 } else { 1000 }),
            })
        })();
        read_fault(fault, result)
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
        }
    })
}

impl ShardLister for MemoryStream {
    fn list_shards<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<Vec<ShardInfo>, Error>> {
        let fault = self.faults.draw(false, false);
        let result = {
            let state = self.state();
            if stream != state.name {
                Err(Error::StreamNotFound {
                    stream: stream.to_string(),
                })
            } else {
                Ok(state
                    .shards
                    .values()
                    .filter(|s| !s.aged_out)
                    .map(|s| ShardInfo {
                        shard_id: s.id.clone(),
                        parents: s.parents.clone(),
                        closed: s.closed,
                    })
                    .collect())
            }
        };
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
        let applies = matches!(fault, None | Some(Fault::LostAnswer(_)));
        let result = if stream != self.name() {
            Err(Error::StreamNotFound {
                stream: stream.to_string(),
            })
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
        let result = if stream == self.name() {
            Ok(())
        } else {
            Err(Error::StreamNotFound {
                stream: stream.to_string(),
            })
        };
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
