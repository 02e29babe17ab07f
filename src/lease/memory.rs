//! The lease store in memory: the same conditions and typed answers as the DynamoDB store, for
//! tests and deterministic simulations.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use futures::future::BoxFuture;

use super::row::{Checkpoint, Lease, NewLease, Ownership, lease_key};
use super::store::{CheckpointWrite, LeaseStore, SeekMove};
use crate::error::Error;

/// Leases held in memory. Clones share the same rows, so several simulated workers can race on
/// one table; every operation is atomic under one lock, as a conditional write is in DynamoDB, and
/// happens when its future is first polled.
///
/// ```
/// use shardwise::lease::{Checkpoint, LeaseStore, MemoryLeaseStore, NewLease};
/// # futures::executor::block_on(async {
/// let store = MemoryLeaseStore::new();
/// let new = NewLease {
///     stream: "orders".into(),
///     shard_id: "shardId-000000000000".into(),
///     checkpoint: Checkpoint::TrimHorizon,
///     parents: vec![],
/// };
/// assert!(store.create(&new).await.unwrap());
/// let seen = store.get("orders", "shardId-000000000000").await.unwrap().unwrap();
/// let mine = store.take(&seen, "worker-a").await.unwrap().unwrap();
/// assert_eq!(mine.owner_epoch, 1);
/// assert!(store.take(&seen, "worker-b").await.unwrap().is_none(), "seen is stale now");
/// # });
/// ```
#[derive(Debug, Clone, Default)]
pub struct MemoryLeaseStore {
    rows: Arc<Mutex<BTreeMap<String, Lease>>>,
}

impl MemoryLeaseStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every row, in key order (`stream#shardId`).
    pub fn snapshot(&self) -> Vec<Lease> {
        self.rows().values().cloned().collect()
    }

    fn rows(&self) -> MutexGuard<'_, BTreeMap<String, Lease>> {
        // Every operation leaves the map consistent before it can panic: a poisoned lock is safe.
        self.rows.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn held_by<'r>(
        rows: &'r mut BTreeMap<String, Lease>,
        held: &Ownership,
    ) -> Option<&'r mut Lease> {
        rows.get_mut(&held.key()).filter(|row| {
            row.owner.as_deref() == Some(held.owner.as_str()) && row.owner_epoch == held.epoch
        })
    }
}

impl LeaseStore for MemoryLeaseStore {
    fn prepare(&self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async { Ok(()) })
    }

    fn list<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<Vec<Lease>, Error>> {
        Box::pin(async move {
            let mut rows: Vec<Lease> = self
                .rows()
                .values()
                .filter(|row| row.stream == stream)
                .cloned()
                .collect();
            rows.sort_by(|a, b| a.shard_id.cmp(&b.shard_id));
            Ok(rows)
        })
    }

    fn get<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Lease>, Error>> {
        Box::pin(async move { Ok(self.rows().get(&lease_key(stream, shard_id)).cloned()) })
    }

    fn create<'a>(&'a self, lease: &'a NewLease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            let mut rows = self.rows();
            let key = lease_key(&lease.stream, &lease.shard_id);
            if rows.contains_key(&key) {
                return Ok(false);
            }
            rows.insert(
                key,
                Lease {
                    stream: lease.stream.clone(),
                    shard_id: lease.shard_id.clone(),
                    owner: None,
                    counter: 0,
                    owner_epoch: 0,
                    checkpoint: lease.checkpoint.clone(),
                    parents: lease.parents.clone(),
                    children: Vec::new(),
                    complete_through: None,
                    seek_epoch: 0,
                },
            );
            Ok(true)
        })
    }

    fn take<'a>(
        &'a self,
        seen: &'a Lease,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Option<Lease>, Error>> {
        Box::pin(async move {
            let mut rows = self.rows();
            Ok(rows
                .get_mut(&seen.key())
                .filter(|row| row.counter == seen.counter && row.owner == seen.owner)
                .map(|row| {
                    row.owner = Some(owner.to_owned());
                    row.counter += 1;
                    row.owner_epoch += 1;
                    row.clone()
                }))
        })
    }

    fn renew<'a>(&'a self, held: &'a Ownership) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            let mut rows = self.rows();
            Ok(Self::held_by(&mut rows, held)
                .map(|row| row.counter += 1)
                .is_some())
        })
    }

    fn checkpoint<'a>(
        &'a self,
        held: &'a Ownership,
        to: &'a Checkpoint,
        complete_through: Option<i64>,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        Box::pin(async move {
            let mut rows = self.rows();
            Ok(match Self::held_by(&mut rows, held) {
                None => CheckpointWrite::Lost,
                Some(row) if row.checkpoint.sort_key() >= to.sort_key() => {
                    CheckpointWrite::NotNewer
                }
                Some(row) => {
                    row.checkpoint = to.clone();
                    // Only upwards, as the DynamoDB store's condition has it.
                    row.complete_through = row.complete_through.max(complete_through);
                    CheckpointWrite::Written
                }
            })
        })
    }

    fn seek<'a>(&'a self, moves: &'a [SeekMove]) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            let mut rows = self.rows();
            let all_as_seen = moves.iter().all(|m| {
                rows.get(&m.seen.key())
                    .is_some_and(|row| row.seek_epoch == m.seen.seek_epoch)
            });
            if !all_as_seen {
                return Ok(false);
            }
            for m in moves {
                let row = rows.get_mut(&m.seen.key()).expect("checked above");
                row.checkpoint = m.to.clone();
                row.seek_epoch += 1;
                row.owner_epoch += 1;
                row.owner = None;
                row.counter += 1;
            }
            Ok(true)
        })
    }

    fn advance_frontier<'a>(
        &'a self,
        held: &'a Ownership,
        complete_through: i64,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        Box::pin(async move {
            let mut rows = self.rows();
            Ok(match Self::held_by(&mut rows, held) {
                None => CheckpointWrite::Lost,
                Some(row)
                    if row
                        .complete_through
                        .is_some_and(|ct| ct >= complete_through) =>
                {
                    CheckpointWrite::NotNewer
                }
                Some(row) => {
                    row.complete_through = Some(complete_through);
                    CheckpointWrite::Written
                }
            })
        })
    }

    fn delete<'a>(&'a self, seen: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            let mut rows = self.rows();
            let key = seen.key();
            let deletable = rows.get(&key).is_some_and(|row| {
                row.checkpoint == Checkpoint::ShardEnd && row.counter == seen.counter
            });
            if deletable {
                rows.remove(&key);
            }
            Ok(deletable)
        })
    }

    fn release<'a>(&'a self, held: &'a Ownership) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            let mut rows = self.rows();
            Ok(Self::held_by(&mut rows, held)
                .map(|row| {
                    row.owner = None;
                    row.counter += 1;
                })
                .is_some())
        })
    }

    fn set_children<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
        children: &'a [String],
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            if let Some(row) = self.rows().get_mut(&lease_key(stream, shard_id)) {
                row.children = children.to_vec();
            }
            Ok(())
        })
    }
}
