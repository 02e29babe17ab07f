//! The lease store in memory: the same conditions and typed answers as the DynamoDB store, for
//! tests and deterministic simulations. With the `testing` feature it also injects faults and
//! reports every change it applies.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use futures::future::BoxFuture;

use super::row::{Checkpoint, Lease, NewLease, Ownership, lease_key};
use super::store::{
    CheckpointWrite, LeaseStore, MAX_SEEK_MOVES, Renewal, Roster, SeekMove, paged_write_holds,
};
use crate::error::Error;
use crate::frontier::Membership;
use crate::paged::PagedProgress;

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
#[derive(Clone, Default)]
pub struct MemoryLeaseStore {
    rows: Arc<Mutex<BTreeMap<String, Lease>>>,
    /// Published frontier memberships, by stream.
    memberships: Arc<Mutex<BTreeMap<String, Membership>>>,
    /// Worker rosters, by stream.
    rosters: Arc<Mutex<BTreeMap<String, Roster>>>,
    #[cfg(any(test, feature = "testing"))]
    faults: crate::testing::faults::Injector,
    #[cfg(any(test, feature = "testing"))]
    observer: Arc<Mutex<Option<Observer>>>,
    #[cfg(any(test, feature = "testing"))]
    items: Arc<Mutex<ItemLimits>>,
}

/// Write limits on single items (the roster and membership items every worker writes), as
/// DynamoDB keeps them: "a single partition can support a maximum of ... 1,000 write capacity
/// units" per second (Developer Guide, "Partitions and data distribution"); a write of an item up to
/// 1 KB takes one. Past the limit, or while an item is throttled by the test, a write fails as
/// throttled, without effect.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Default)]
struct ItemLimits {
    /// The per-item limit is kept ([`MemoryLeaseStore::service_limits`]).
    on: bool,
    /// Writes in the current second, by item: the second's start and the count.
    writes: BTreeMap<String, (tokio::time::Instant, u32)>,
    /// Items every write of which is throttled now.
    throttled: std::collections::BTreeSet<String>,
}

/// Writes a second a single item takes ("1,000 write capacity units per second" a partition).
#[cfg(any(test, feature = "testing"))]
pub const ITEM_WRITES_PER_SECOND: u32 = 1_000;

/// Called with every change the store applies, under the store's lock (so in the order the changes
/// happened). It must not call the store.
#[cfg(any(test, feature = "testing"))]
pub type Observer = Arc<dyn Fn(&Change) + Send + Sync>;

/// One change the store applied: the operation and the row before and after (`None` for a row
/// that did not exist, or was deleted).
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Change {
    /// The [`LeaseStore`] method, e.g. `"checkpoint"`.
    pub operation: &'static str,
    /// The row before.
    pub before: Option<Lease>,
    /// The row after.
    pub after: Option<Lease>,
}

impl fmt::Debug for MemoryLeaseStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryLeaseStore")
            .field("rows", &self.rows().len())
            .finish_non_exhaustive()
    }
}

/// The item of `stream`'s roster, named as the DynamoDB store keys it.
fn roster_item(stream: &str) -> String {
    format!("~workers#{stream}")
}

/// The item of `stream`'s frontier membership, named as the DynamoDB store keys it.
fn membership_item(stream: &str) -> String {
    format!("~membership#{stream}")
}

/// The rows under the lock, and the changes made to them (reported once the operation is done).
struct Rows<'s> {
    rows: MutexGuard<'s, BTreeMap<String, Lease>>,
    changes: Vec<(&'static str, Option<Lease>, Option<Lease>)>,
}

impl Rows<'_> {
    /// Applies `f` to the row at `key`, recording the change when `f` says it made one.
    fn change(
        &mut self,
        operation: &'static str,
        key: &str,
        f: impl FnOnce(&mut Lease) -> bool,
    ) -> bool {
        let Some(row) = self.rows.get_mut(key) else {
            return false;
        };
        let before = row.clone();
        let changed = f(row);
        if changed {
            self.changes
                .push((operation, Some(before), Some(row.clone())));
        }
        changed
    }

    fn held(&self, held: &Ownership) -> bool {
        self.rows.get(&held.key()).is_some_and(|row| {
            row.owner.as_deref() == Some(held.owner.as_str()) && row.owner_epoch == held.epoch
        })
    }
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

    /// Injects `faults` into every later call, drawn from a generator seeded with `seed`: the
    /// same calls in the same order meet the same faults. Clones share them.
    #[cfg(any(test, feature = "testing"))]
    pub fn inject(&self, seed: u64, faults: crate::testing::Faults) {
        self.faults.set(seed, faults);
    }

    /// Stops injecting faults.
    #[cfg(any(test, feature = "testing"))]
    pub fn heal(&self) {
        self.faults.clear();
    }

    /// Keeps DynamoDB's limit on single items from now on: a stream's roster and membership items
    /// take at most [`ITEM_WRITES_PER_SECOND`] writes a second; more fail as throttled.
    #[cfg(any(test, feature = "testing"))]
    pub fn service_limits(&self) {
        self.items().on = true;
    }

    /// Throttles every write of `stream`'s roster item (its workers' beats) until called again
    /// with `false`: a hot item that DynamoDB throttles for minutes.
    #[cfg(any(test, feature = "testing"))]
    pub fn throttle_roster(&self, stream: &str, throttled: bool) {
        let item = roster_item(stream);
        let mut items = self.items();
        if throttled {
            items.throttled.insert(item);
        } else {
            items.throttled.remove(&item);
        }
    }

    #[cfg(any(test, feature = "testing"))]
    fn items(&self) -> MutexGuard<'_, ItemLimits> {
        self.items.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a write of `item`, or refuses it as throttled (see [`ItemLimits`]).
    #[cfg(any(test, feature = "testing"))]
    fn write_item(&self, operation: &'static str, item: &str) -> Result<(), Error> {
        let throttled = || Error::DynamoDb {
            operation,
            table: "memory".into(),
            source: format!("throttled: item {item}").into(),
        };
        let mut items = self.items();
        if items.throttled.contains(item) {
            return Err(throttled());
        }
        if !items.on {
            return Ok(());
        }
        let now = tokio::time::Instant::now();
        let (since, count) = items.writes.entry(item.to_string()).or_insert((now, 0));
        if now.duration_since(*since) >= std::time::Duration::from_secs(1) {
            (*since, *count) = (now, 0);
        }
        if *count >= ITEM_WRITES_PER_SECOND {
            return Err(throttled());
        }
        *count += 1;
        Ok(())
    }

    /// [`call`](Self::call) for a write of the single item `item`, within its limits.
    fn call_item<'a, T: Send + 'a>(
        &'a self,
        operation: &'static str,
        item: String,
        op: impl FnOnce(&mut Rows<'_>) -> T + Send + 'a,
    ) -> BoxFuture<'a, Result<T, Error>> {
        Box::pin(async move {
            #[cfg(any(test, feature = "testing"))]
            self.write_item(operation, &item)?;
            let _ = item;
            self.call(operation, true, op).await
        })
    }

    /// Calls `observer` with every change applied from now on (see [`Observer`]).
    #[cfg(any(test, feature = "testing"))]
    pub fn observe(&self, observer: Observer) {
        *self.observer.lock().unwrap_or_else(PoisonError::into_inner) = Some(observer);
    }

    fn rows(&self) -> MutexGuard<'_, BTreeMap<String, Lease>> {
        // Every operation leaves the map consistent before it can panic: a poisoned lock is safe.
        self.rows.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `op` atomically under the lock, reporting its changes; with faults injected, the call
    /// may fail before it (no effect) or after it (its answer lost).
    fn call<'a, T: Send + 'a>(
        &'a self,
        operation: &'static str,
        write: bool,
        op: impl FnOnce(&mut Rows<'_>) -> T + Send + 'a,
    ) -> BoxFuture<'a, Result<T, Error>> {
        Box::pin(async move {
            #[cfg(any(test, feature = "testing"))]
            {
                use crate::testing::Fault;
                let injected = |what: &str| Error::DynamoDb {
                    operation,
                    table: "memory".into(),
                    source: format!("injected fault: {what}").into(),
                };
                match self.faults.draw(write, false) {
                    None | Some(Fault::ExpiredIterator) => {}
                    Some(Fault::Error) => return Err(injected("error")),
                    Some(Fault::Throttle) => return Err(injected("throttled")),
                    Some(Fault::Timeout(after)) => {
                        tokio::time::sleep(after).await;
                        return Err(injected("timed out"));
                    }
                    Some(Fault::LostAnswer(after)) => {
                        let _ = self.apply(op);
                        tokio::time::sleep(after).await;
                        return Err(injected("timed out after the write was applied"));
                    }
                    Some(Fault::SlowAnswer(after)) => {
                        let answer = self.apply(op);
                        tokio::time::sleep(after).await;
                        return Ok(answer);
                    }
                }
            }
            let _ = (operation, write);
            Ok(self.apply(op))
        })
    }

    fn apply<T>(&self, op: impl FnOnce(&mut Rows<'_>) -> T) -> T {
        let mut rows = Rows {
            rows: self.rows(),
            changes: Vec::new(),
        };
        let result = op(&mut rows);
        #[cfg(any(test, feature = "testing"))]
        if !rows.changes.is_empty() {
            let observer = self
                .observer
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            if let Some(observer) = observer {
                for (operation, before, after) in rows.changes.drain(..) {
                    observer(&Change {
                        operation,
                        before,
                        after,
                    });
                }
            }
        }
        result
    }
}

impl LeaseStore for MemoryLeaseStore {
    fn prepare(&self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async { Ok(()) })
    }

    fn list<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<Vec<Lease>, Error>> {
        self.call("list", false, move |rows| {
            let mut found: Vec<Lease> = rows
                .rows
                .values()
                .filter(|row| row.stream == stream)
                .cloned()
                .collect();
            found.sort_by(|a, b| a.shard_id.cmp(&b.shard_id));
            found
        })
    }

    fn get<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Lease>, Error>> {
        self.call("get", false, move |rows| {
            rows.rows.get(&lease_key(stream, shard_id)).cloned()
        })
    }

    fn create<'a>(&'a self, lease: &'a NewLease) -> BoxFuture<'a, Result<bool, Error>> {
        self.call("create", true, move |rows| {
            let key = lease_key(&lease.stream, &lease.shard_id);
            if rows.rows.contains_key(&key) {
                return false;
            }
            let row = Lease {
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
                seek_skipped: None,
                sought_at: None,
                progress: None,
                wanted_by: None,
            };
            rows.changes.push(("create", None, Some(row.clone())));
            rows.rows.insert(key, row);
            true
        })
    }

    fn take<'a>(
        &'a self,
        seen: &'a Lease,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Option<Lease>, Error>> {
        self.call("take", true, move |rows| {
            let mut taken = None;
            rows.change("take", &seen.key(), |row| {
                if row.counter != seen.counter || row.owner != seen.owner {
                    return false;
                }
                row.owner = Some(owner.to_owned());
                row.counter += 1;
                row.owner_epoch += 1;
                row.wanted_by = None;
                taken = Some(row.clone());
                true
            });
            taken
        })
    }

    fn renew<'a>(&'a self, held: &'a Ownership) -> BoxFuture<'a, Result<Renewal, Error>> {
        self.call("renew", true, move |rows| {
            if !rows.held(held) {
                return Renewal::Lost;
            }
            let mut wanted_by = None;
            rows.change("renew", &held.key(), |row| {
                row.counter += 1;
                wanted_by = row.wanted_by.clone();
                true
            });
            Renewal::Renewed { wanted_by }
        })
    }

    fn checkpoint<'a>(
        &'a self,
        held: &'a Ownership,
        to: &'a Checkpoint,
        complete_through: Option<i64>,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        self.call("checkpoint", true, move |rows| {
            if !rows.held(held) {
                return CheckpointWrite::Lost;
            }
            let written = rows.change("checkpoint", &held.key(), |row| {
                if row.checkpoint.sort_key() >= to.sort_key() {
                    return false;
                }
                row.checkpoint = to.clone();
                // Only upwards, as the DynamoDB store's condition has it.
                row.complete_through = row.complete_through.max(complete_through);
                true
            });
            if written {
                CheckpointWrite::Written
            } else {
                CheckpointWrite::NotNewer
            }
        })
    }

    fn paged_checkpoint<'a>(
        &'a self,
        held: &'a Ownership,
        expected: &'a PagedProgress,
        to: &'a PagedProgress,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        self.call("paged_checkpoint", true, move |rows| {
            if !rows.held(held) {
                return CheckpointWrite::Lost;
            }
            let written = rows.change("paged_checkpoint", &held.key(), |row| {
                if !paged_write_holds(row.progress.as_ref(), expected, to) {
                    return false;
                }
                row.progress = Some(to.clone());
                true
            });
            if written {
                CheckpointWrite::Written
            } else {
                CheckpointWrite::NotNewer
            }
        })
    }

    fn seek<'a>(&'a self, moves: &'a [SeekMove]) -> BoxFuture<'a, Result<bool, Error>> {
        // "TransactWriteItems ... groups up to 100 action requests"; "the aggregate size of the
        // items in the transaction cannot exceed 4 MB" (API reference, TransactWriteItems). The
        // DynamoDB store refuses more rows than 100, and so does this one; 100 rows of a few
        // hundred bytes stay far inside 4 MB.
        if moves.len() > MAX_SEEK_MOVES {
            return Box::pin(std::future::ready(Err(Error::Corrupt {
                what: "seek",
                detail: format!(
                    "{} rows must move together, more than one transaction takes ({MAX_SEEK_MOVES})",
                    moves.len()
                ),
            })));
        }
        self.call("seek", true, move |rows| {
            let all_as_seen = moves.iter().all(|m| {
                rows.rows
                    .get(&m.seen.key())
                    .is_some_and(|row| row.seek_epoch == m.seen.seek_epoch)
            });
            if !all_as_seen {
                return false;
            }
            for m in moves {
                rows.change("seek", &m.seen.key(), |row| {
                    row.checkpoint = m.to.clone();
                    if let Some(progress) = &m.progress {
                        let version = row.progress.as_ref().map_or(0, |p| p.checkpoint_version);
                        row.progress = Some(PagedProgress {
                            checkpoint_version: version + 1,
                            ..progress.clone()
                        });
                    }
                    row.seek_epoch += 1;
                    row.seek_skipped = m.skipped.clone();
                    row.sought_at = Some(crate::time::millis(crate::time::now()));
                    row.owner_epoch += 1;
                    row.owner = None;
                    row.wanted_by = None;
                    row.counter += 1;
                    true
                });
            }
            true
        })
    }

    fn advance_frontier<'a>(
        &'a self,
        held: &'a Ownership,
        complete_through: i64,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        self.call("advance_frontier", true, move |rows| {
            if !rows.held(held) {
                return CheckpointWrite::Lost;
            }
            let written = rows.change("advance_frontier", &held.key(), |row| {
                if row
                    .complete_through
                    .is_some_and(|ct| ct >= complete_through)
                {
                    return false;
                }
                row.complete_through = Some(complete_through);
                true
            });
            if written {
                CheckpointWrite::Written
            } else {
                CheckpointWrite::NotNewer
            }
        })
    }

    fn delete<'a>(&'a self, seen: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        self.call("delete", true, move |rows| {
            let key = seen.key();
            let deletable = rows.rows.get(&key).is_some_and(|row| {
                row.checkpoint == Checkpoint::ShardEnd && row.counter == seen.counter
            });
            if deletable {
                let before = rows.rows.remove(&key);
                rows.changes.push(("delete", before, None));
            }
            deletable
        })
    }

    fn release<'a>(&'a self, held: &'a Ownership) -> BoxFuture<'a, Result<bool, Error>> {
        self.call("release", true, move |rows| {
            rows.held(held)
                && rows.change("release", &held.key(), |row| {
                    row.owner = None;
                    row.counter += 1;
                    row.wanted_by = None;
                    true
                })
        })
    }

    fn set_children<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
        children: &'a [String],
    ) -> BoxFuture<'a, Result<(), Error>> {
        self.call("set_children", true, move |rows| {
            rows.change("set_children", &lease_key(stream, shard_id), |row| {
                row.children = children.to_vec();
                true
            });
        })
    }

    fn request<'a>(
        &'a self,
        seen: &'a Lease,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.call("request", true, move |rows| {
            rows.change("request", &seen.key(), |row| {
                if row.owner.is_none()
                    || row.owner != seen.owner
                    || row.owner_epoch != seen.owner_epoch
                    || row.wanted_by.is_some()
                {
                    return false;
                }
                row.wanted_by = Some(taker.to_string());
                true
            })
        })
    }

    fn pass<'a>(
        &'a self,
        held: &'a Ownership,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.call("pass", true, move |rows| {
            rows.held(held)
                && rows.change("pass", &held.key(), |row| {
                    if row.wanted_by.as_deref() != Some(taker) {
                        return false;
                    }
                    row.owner = Some(taker.to_string());
                    row.owner_epoch += 1;
                    row.counter += 1;
                    row.wanted_by = None;
                    true
                })
        })
    }

    fn membership<'a>(
        &'a self,
        stream: &'a str,
    ) -> BoxFuture<'a, Result<Option<Membership>, Error>> {
        let memberships = self.memberships.clone();
        self.call("membership", false, move |_| {
            memberships
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(stream)
                .cloned()
        })
    }

    fn publish_membership<'a>(
        &'a self,
        stream: &'a str,
        expected: Option<u64>,
        next: &'a Membership,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        let memberships = self.memberships.clone();
        self.call_item("publish_membership", membership_item(stream), move |_| {
            let mut memberships = memberships.lock().unwrap_or_else(PoisonError::into_inner);
            if memberships.get(stream).map(|m| m.epoch) != expected {
                return false;
            }
            memberships.insert(stream.to_string(), next.clone());
            true
        })
    }

    fn beat<'a>(
        &'a self,
        stream: &'a str,
        worker: &'a str,
        beat: u64,
        announce: bool,
    ) -> BoxFuture<'a, Result<Roster, Error>> {
        let rosters = self.rosters.clone();
        self.call_item("beat", roster_item(stream), move |_| {
            let mut rosters = rosters.lock().unwrap_or_else(PoisonError::into_inner);
            let roster = rosters.entry(stream.to_string()).or_default();
            let before = roster.beats.insert(worker.to_string(), beat);
            roster.founder.get_or_insert_with(|| worker.to_string());
            if announce {
                roster.changes += 1;
            }
            Roster {
                beat_before: before,
                ..roster.clone()
            }
        })
    }

    fn forget<'a>(
        &'a self,
        stream: &'a str,
        worker: &'a str,
        seen: Option<u64>,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        let rosters = self.rosters.clone();
        self.call_item("forget", roster_item(stream), move |_| {
            let mut rosters = rosters.lock().unwrap_or_else(PoisonError::into_inner);
            let roster = match (seen, rosters.get_mut(stream)) {
                (_, Some(roster)) => roster,
                (Some(_), None) => return false,
                (None, None) => rosters.entry(stream.to_string()).or_default(),
            };
            match (seen, roster.beats.get(worker)) {
                (Some(seen), Some(&beat)) if beat != seen => false,
                (Some(_), None) => false,
                (Some(_), Some(_)) => {
                    roster.beats.remove(worker);
                    true
                }
                (None, _) => {
                    roster.beats.remove(worker);
                    roster.changes += 1;
                    true
                }
            }
        })
    }
}
