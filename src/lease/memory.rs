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
    /// Worker rosters, by item (a stream's section: [`roster_item`]).
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
/// units" per second (Developer Guide, "Partitions and data distribution"); a write takes one unit
/// for each KB of the item ("Read/write capacity mode": "one write request unit represents one
/// write for an item up to 1 KB in size"), so a roster section of 200 workers costs about 5 units a
/// write. Past the limit, or while an item is throttled by the test, a write fails as throttled,
/// without effect.
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Default)]
struct ItemLimits {
    /// The per-item limit is kept ([`MemoryLeaseStore::service_limits`]).
    on: bool,
    /// Write units in the current second, by item: the second's start and the count.
    writes: BTreeMap<String, (tokio::time::Instant, u32)>,
    /// The most write units any one second took, by item (counted with the limit off too).
    peaks: BTreeMap<String, u32>,
    /// Items every write of which is throttled now.
    throttled: std::collections::BTreeSet<String>,
}

/// Write units a second a single item takes ("1,000 write capacity units per second" a
/// partition; a write of an item up to 1 KB is one unit).
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

/// The item of `section` of `stream`'s roster, named as the DynamoDB store keys it.
fn roster_item(stream: &str, section: u32) -> String {
    match section {
        0 => format!("~workers#{stream}"),
        k => format!("~workers#{stream}#{k}"),
    }
}

/// The write units a write of a roster item takes: one per KB of the item, sized as DynamoDB sizes
/// items (attribute names and values; a number of up to 20 digits takes at most 11 bytes).
fn roster_units(item: &str, roster: Option<&Roster>) -> u32 {
    let size = "leaseKey".len()
        + item.len()
        + roster.map_or(0, |r| {
            r.beats
                .keys()
                .map(|w| "beat:".len() + w.len() + 11)
                .sum::<usize>()
                + r.founder.as_ref().map_or(0, |f| "founder".len() + f.len())
                + "changes".len()
                + 11
                + "sections".len()
                + 11
        });
    u32::try_from(size.div_ceil(1024))
        .unwrap_or(u32::MAX)
        .max(1)
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

    /// Throttles every write of `stream`'s roster items (its workers' beats, in every section)
    /// until called again with `false`: a hot item that DynamoDB throttles for minutes.
    #[cfg(any(test, feature = "testing"))]
    pub fn throttle_roster(&self, stream: &str, throttled: bool) {
        let item = roster_item(stream, 0);
        let mut items = self.items();
        if throttled {
            items.throttled.insert(item);
        } else {
            items.throttled.remove(&item);
        }
    }

    /// The most write units any single item took in one second since the last call (counted
    /// whether or not [`service_limits`](Self::service_limits) are kept), and which item: the
    /// hot spot a fleet makes.
    #[cfg(any(test, feature = "testing"))]
    pub fn busiest_item(&self) -> Option<(String, u32)> {
        let peaks = std::mem::take(&mut self.items().peaks);
        peaks
            .into_iter()
            .max_by_key(|(item, units)| (*units, std::cmp::Reverse(item.clone())))
    }

    #[cfg(any(test, feature = "testing"))]
    fn items(&self) -> MutexGuard<'_, ItemLimits> {
        self.items.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a write of `units` to `item`, or refuses it as throttled (see [`ItemLimits`]).
    #[cfg(any(test, feature = "testing"))]
    fn write_item(&self, operation: &'static str, item: &str, units: u32) -> Result<(), Error> {
        let throttled = || Error::DynamoDb {
            operation,
            table: "memory".into(),
            source: format!("throttled: item {item}").into(),
        };
        let mut items = self.items();
        // A stream's roster is throttled in every section (`throttle_roster`).
        let roster = item.starts_with("~workers#").then(|| {
            let stream = &item["~workers#".len()..];
            roster_item(stream.rsplit_once('#').map_or(stream, |(s, _)| s), 0)
        });
        if items.throttled.contains(item) || roster.is_some_and(|r| items.throttled.contains(&r)) {
            return Err(throttled());
        }
        let on = items.on;
        let now = tokio::time::Instant::now();
        let (since, count) = items.writes.entry(item.to_string()).or_insert((now, 0));
        if now.duration_since(*since) >= std::time::Duration::from_secs(1) {
            (*since, *count) = (now, 0);
        }
        if on && *count + units > ITEM_WRITES_PER_SECOND {
            return Err(throttled());
        }
        *count += units;
        let count = *count;
        let peak = items.peaks.entry(item.to_string()).or_default();
        *peak = (*peak).max(count);
        Ok(())
    }

    /// [`call`](Self::call) for a write of `units` to the single item `item`, within its limits.
    fn call_item<'a, T: Send + 'a>(
        &'a self,
        operation: &'static str,
        item: String,
        units: u32,
        op: impl FnOnce(&mut Rows<'_>) -> T + Send + 'a,
    ) -> BoxFuture<'a, Result<T, Error>> {
        Box::pin(async move {
            #[cfg(any(test, feature = "testing"))]
            self.write_item(operation, &item, units)?;
            let _ = (item, units);
            self.call(operation, true, op).await
        })
    }

    /// The write units a write of `section` of `stream`'s roster takes now.
    fn roster_units(&self, stream: &str, section: u32) -> u32 {
        let item = roster_item(stream, section);
        let rosters = self.rosters.lock().unwrap_or_else(PoisonError::into_inner);
        roster_units(&item, rosters.get(&item))
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
                handoff_acked: false,
                retired_at: None,
                window: None,
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
                row.handoff_acked = false;
                row.retired_at = None;
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
                if to.is_shard_end() {
                    row.window = None;
                }
                true
            });
            if written {
                CheckpointWrite::Written
            } else {
                CheckpointWrite::NotNewer
            }
        })
    }

    fn checkpoint_window<'a>(
        &'a self,
        held: &'a Ownership,
        to: &'a Checkpoint,
        complete_through: Option<i64>,
        window: Option<&'a crate::window::WindowState>,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        self.call("checkpoint", true, move |rows| {
            if !rows.held(held) {
                return CheckpointWrite::Lost;
            }
            let written = rows.change("checkpoint", &held.key(), |row| {
                if row.checkpoint.sort_key() > to.sort_key() {
                    return false;
                }
                row.checkpoint = to.clone();
                row.complete_through = row.complete_through.max(complete_through);
                row.window = window.cloned();
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
                    row.window = None;
                    row.sought_at = Some(crate::time::millis(crate::time::now()));
                    row.owner_epoch += 1;
                    row.owner = None;
                    row.wanted_by = None;
                    row.handoff_acked = false;
                    row.retired_at = None;
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
                    row.handoff_acked = false;
                    true
                })
        })
    }

    fn retire<'a>(&'a self, held: &'a Ownership, at: i64) -> BoxFuture<'a, Result<bool, Error>> {
        self.call("retire", true, move |rows| {
            rows.held(held)
                && rows.change("retire", &held.key(), |row| {
                    if row.checkpoint.is_shard_end() {
                        return false;
                    }
                    row.owner = None;
                    row.counter += 1;
                    row.wanted_by = None;
                    row.handoff_acked = false;
                    row.retired_at = Some(at);
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
                    row.handoff_acked = false;
                    true
                })
        })
    }

    fn acknowledge<'a>(
        &'a self,
        held: &'a Ownership,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.call("acknowledge", true, move |rows| {
            rows.held(held)
                && rows.change("acknowledge", &held.key(), |row| {
                    if row.wanted_by.as_deref() != Some(taker) || row.handoff_acked {
                        return false;
                    }
                    row.handoff_acked = true;
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
        self.call_item(
            "publish_membership",
            membership_item(stream),
            1,
            move |_| {
                let mut memberships = memberships.lock().unwrap_or_else(PoisonError::into_inner);
                if memberships.get(stream).map(|m| m.epoch) != expected {
                    return false;
                }
                memberships.insert(stream.to_string(), next.clone());
                true
            },
        )
    }

    fn beat<'a>(
        &'a self,
        stream: &'a str,
        section: u32,
        worker: &'a str,
        beat: u64,
        announce: bool,
    ) -> BoxFuture<'a, Result<Roster, Error>> {
        let rosters = self.rosters.clone();
        let item = roster_item(stream, section);
        let units = self.roster_units(stream, section);
        self.call_item("beat", item.clone(), units, move |_| {
            let mut rosters = rosters.lock().unwrap_or_else(PoisonError::into_inner);
            let roster = rosters.entry(item).or_default();
            let before = roster.beats.insert(worker.to_string(), beat);
            roster.founder.get_or_insert_with(|| worker.to_string());
            if announce {
                roster.changes += 1;
            }
            Roster {
                beat_before: before,
                sections: (section == 0).then(|| roster.sections.unwrap_or(1)),
                ..roster.clone()
            }
        })
    }

    fn forget<'a>(
        &'a self,
        stream: &'a str,
        section: u32,
        worker: &'a str,
        seen: Option<u64>,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        let rosters = self.rosters.clone();
        let item = roster_item(stream, section);
        let units = self.roster_units(stream, section);
        self.call_item("forget", item.clone(), units, move |_| {
            let mut rosters = rosters.lock().unwrap_or_else(PoisonError::into_inner);
            let roster = match (seen, rosters.contains_key(&item)) {
                (Some(_), false) => return false,
                _ => rosters.entry(item).or_default(),
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

    fn read_roster<'a>(
        &'a self,
        stream: &'a str,
        sections: &'a [u32],
    ) -> BoxFuture<'a, Result<Vec<Roster>, Error>> {
        let rosters = self.rosters.clone();
        self.call("read_roster", false, move |_| {
            let rosters = rosters.lock().unwrap_or_else(PoisonError::into_inner);
            sections
                .iter()
                .map(|&section| {
                    let mut roster = rosters
                        .get(&roster_item(stream, section))
                        .cloned()
                        .unwrap_or_default();
                    roster.beat_before = None;
                    roster.sections = (section == 0).then(|| roster.sections.unwrap_or(1));
                    roster
                })
                .collect()
        })
    }

    fn split_roster<'a>(
        &'a self,
        stream: &'a str,
        from: u32,
        to: u32,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        let rosters = self.rosters.clone();
        let item = roster_item(stream, 0);
        let units = self.roster_units(stream, 0);
        self.call_item("split_roster", item.clone(), units, move |_| {
            let mut rosters = rosters.lock().unwrap_or_else(PoisonError::into_inner);
            let roster = rosters.entry(item).or_default();
            if roster.sections.unwrap_or(1) != from {
                return false;
            }
            roster.sections = Some(to);
            true
        })
    }
}
