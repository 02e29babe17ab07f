//! What the simulation observed, and the invariants checked as each observation arrives: every
//! change the lease store applied, every handler call, every copy written, every frontier seen,
//! and (with receipts) the ledger and effect tables after every commit.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, SystemTime};

use md5::{Digest, Md5};
use shardwise::frontier::Frontier;
use shardwise::lease::{Change, Checkpoint, Lease};
use shardwise::receipts::{Disposition, EventId, MemoryReceipts};
use shardwise::testing::{MemoryStream, StoredRecord};
use shardwise::window::{Window, WindowCall};
use shardwise::{Outcome, Position};

/// The effect tables of the simulation's receipts: each applied event adds 1 to its record's
/// counter (`id`) and to its partition key's (`key`), in one transaction.
pub const COUNTS: &str = "counts";
pub const KEYS: &str = "keys";

/// How many of the last events a failing seed prints (`SHARDWISE_SIM_TRACE` overrides).
pub fn trace_tail() -> usize {
    std::env::var("SHARDWISE_SIM_TRACE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(80)
}

/// The events of one run: hashed in full, the last ones kept for a trace.
pub struct EventLog {
    hasher: Md5,
    tail: VecDeque<String>,
    keep: usize,
    count: u64,
}

impl Default for EventLog {
    fn default() -> Self {
        Self {
            hasher: Md5::new(),
            tail: VecDeque::new(),
            keep: trace_tail(),
            count: 0,
        }
    }
}

impl EventLog {
    pub fn push(&mut self, at_ms: u64, event: String) {
        let line = format!("{at_ms:>7} {event}");
        self.hasher.update(line.as_bytes());
        self.hasher.update(b"\n");
        self.count += 1;
        if self.tail.len() == self.keep {
            self.tail.pop_front();
        }
        self.tail.push_back(line);
    }

    /// The hash of every event so far.
    pub fn hash(&self) -> [u8; 16] {
        self.hasher.clone().finalize().into()
    }

    pub fn tail(&self) -> Vec<String> {
        self.tail.iter().cloned().collect()
    }

    pub fn count(&self) -> u64 {
        self.count
    }
}

/// A record's id: its payload is the id, then `|` and padding of a size the seed chose; in a
/// seed with a filter, JSON with the id ([`filtered_payload`]).
pub fn id_of(payload: &[u8]) -> u64 {
    if payload.first() == Some(&b'{') {
        return serde_json::from_slice::<serde_json::Value>(payload)
            .ok()
            .and_then(|v| v["id"].as_u64())
            .unwrap_or(u64::MAX);
    }
    std::str::from_utf8(payload)
        .ok()
        .and_then(|s| s.split('|').next())
        .and_then(|id| id.parse().ok())
        .unwrap_or(u64::MAX)
}

/// The filter of a seed with one: orders only (Lambda's `FilterCriteria`).
pub const ORDERS_ONLY: &str = r#"{"Filters":[{"Pattern":"{\"data\":{\"kind\":[\"order\"]}}"}]}"#;

/// A record of a seed with a filter: JSON, one in five a quote (which the filter keeps from the
/// handler), padded.
pub fn filtered_payload(id: u64, padding: usize) -> String {
    let kind = if id.is_multiple_of(5) {
        "quote"
    } else {
        "order"
    };
    format!(
        r#"{{"id":{id},"kind":"{kind}","pad":"{}"}}"#,
        "x".repeat(padding)
    )
}

/// Whether the seed's filter keeps the record `data` (its payload, inside any envelope) from the
/// handler.
fn filtered_out(data: &bytes::Bytes) -> bool {
    let decoded = shardwise::envelope::decode(data.clone());
    serde_json::from_slice::<serde_json::Value>(&decoded.payload)
        .is_ok_and(|v| v["kind"] == "quote")
}

/// Milliseconds since the epoch.
fn shardwise_millis(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Where a record stands against a checkpoint.
fn after_start(checkpoint: &Checkpoint, position: &Position, arrived: SystemTime) -> bool {
    match checkpoint {
        Checkpoint::TrimHorizon | Checkpoint::Latest => true,
        Checkpoint::AtTimestamp(t) => arrived >= *t,
        Checkpoint::At(p) => position > p,
        Checkpoint::Before(p) => position >= p,
        Checkpoint::ShardEnd => false,
    }
}

/// Whether a checkpoint covers (promises a durable outcome for) a record.
fn covered_by(checkpoint: &Checkpoint, position: &Position) -> bool {
    match checkpoint {
        Checkpoint::At(p) => position <= p,
        Checkpoint::Before(p) => position < p,
        Checkpoint::ShardEnd => true,
        _ => false,
    }
}

/// The stream as a seek or a start left it: records arriving before `boundary` in `shards` need not
/// be handled (`None` boundary: none are excused), and every other record that existed at `at`
/// must be handled again after `at`.
#[derive(Debug, Clone)]
pub struct Reset {
    pub at_ms: u64,
    pub shards: BTreeSet<String>,
    pub excuse: Excuse,
}

#[derive(Debug, Clone)]
pub enum Excuse {
    /// Nothing is excused: everything is read again.
    Nothing,
    /// Records that arrived before this time.
    ArrivedBefore(SystemTime),
    /// Records of this shard before this position.
    Before(String, Position),
    /// Every record of these shards (ended by a seek to latest).
    All,
}

/// One handler call: which worker, which delivery.
#[derive(Debug, Clone)]
pub struct Call {
    pub worker: String,
    pub shard: String,
    /// The ownership epoch the delivery was read under.
    pub epoch: u64,
    pub position: Position,
    pub key: String,
    /// The record's id (its payload).
    pub id: u64,
    pub attempt: u32,
    /// The delivery's event identity (a copy has its original's).
    pub event: EventId,
}

impl Call {
    /// `worker`'s call on delivery `d`.
    pub fn of(worker: &str, d: &shardwise::Delivery) -> Self {
        Self {
            worker: worker.to_string(),
            shard: d.shard().to_string(),
            epoch: d.id().map_or(0, |i| i.epoch()),
            position: *d.position(),
            key: d.partition_key().to_string(),
            id: id_of(d.payload()),
            attempt: d.attempt(),
            event: d.event_id(),
        }
    }
}

/// The simulation's view of the world and its invariant checks.
pub struct Model {
    pub log: EventLog,
    pub violations: Vec<String>,
    /// The lease rows as the store's change hook reported them.
    rows: BTreeMap<String, Lease>,
    /// When each (shard, epoch) stopped being the row's epoch.
    superseded: BTreeMap<(String, u64), u64>,
    /// When each (shard, epoch) was taken by another worker that had not asked for it: its
    /// lease had expired (the owner silent for a lease duration), so its owner must have
    /// stopped dispatching before (issue 27, defect 6).
    expired: BTreeMap<(String, u64), u64>,
    /// Who took each (shard, epoch), and when.
    takes: BTreeMap<(String, u64), (String, u64)>,
    /// When each (shard, epoch) was given up by its owner (lost, or let go when its hold ran
    /// out): a lease taken as expired must have been given up before (issue 27).
    given_up: BTreeMap<(String, u64), u64>,
    /// Leases whose owner crashed or stopped while it held them: no give-up is owed.
    left_behind: BTreeSet<(String, u64)>,
    /// Leases each worker knew it took (its manager said so): a take whose answer was lost
    /// leaves a row naming a worker that never held it.
    acquired: BTreeSet<(String, u64)>,
    /// Workers crashed or stopped and not started again: what their managers still finish
    /// (a take under way when the world dropped them) is left behind too.
    down: BTreeSet<String>,
    /// The first time each shard's lease was taken: a LATEST start owes every record after it.
    first_take: BTreeMap<String, u64>,
    /// Per (shard, epoch, key): the last position started, and whether it still runs.
    keys: BTreeMap<(String, u64, String), (Option<Position>, bool)>,
    /// Deliveries a handler settled (ack, drop, spent without a dead letter): (worker, shard,
    /// epoch, position).
    settled: BTreeSet<(String, String, u64, Position)>,
    /// Deliveries a handler asked to retry: (worker, shard, epoch, position) -> (id, attempt).
    retried: BTreeMap<(String, String, u64, Position), (u64, u32)>,
    /// Copies and dead letters written: (worker, id, attempt of the delivery retried) -> times.
    copies: BTreeMap<(String, u64, u32), Vec<u64>>,
    /// Completion times of every handling of each record.
    handled: BTreeMap<(String, Position), Vec<u64>>,
    /// How each shard's row was created.
    starts: BTreeMap<String, Checkpoint>,
    pub resets: Vec<Reset>,
    /// Shards that aged out (their unread records are lost to retention, by design).
    aged_out: BTreeSet<String>,
    /// Each worker's last frontier: (membership epoch, scalar).
    frontiers: BTreeMap<String, (u64, Option<i64>)>,
    /// Handler calls that ran (for the summary).
    pub invocations: u64,
    /// The longest a stale owner went on dispatching after its epoch was superseded.
    pub stale_window_ms: u64,
    /// How long a stale owner may go on dispatching after it lost its lease.
    stale_bound_ms: u64,
    lineage: BTreeMap<String, Vec<String>>,
    closed: BTreeSet<String>,
    records: Vec<StoredRecord>,
    stream: MemoryStream,
    /// A seek to latest in progress, asked at this time: a pin later than it would skip records.
    latest_seek: Option<u64>,
    /// The receipt ledger and effect tables, when the seed uses receipts.
    ledger: Option<MemoryReceipts>,
    /// Deliveries a handler answered with apply, quarantine or hold: (worker, shard, epoch,
    /// position) -> event. Durable once the event has a terminal receipt.
    receipted: BTreeMap<(String, String, u64, Position), EventId>,
    /// Held deliveries (shard, epoch, position): a release has them handled again, after later
    /// records of their key.
    held: BTreeSet<(String, u64, Position)>,
    /// The record id of each event seen.
    event_ids: BTreeMap<EventId, u64>,
    /// The ledger check failed once (reported once).
    ledger_broken: bool,
    /// Retries run in place (see [`Model::in_place`]).
    in_place: bool,
    /// A filter keeps quotes from the handler (see [`Model::filtered`]).
    filtered: bool,
    /// Tumbling windows (see [`Model::windowed`]).
    windows: Option<Windows>,
}

impl Windows {
    /// Whether `shard`'s record at `position` was last aggregated by a call no seek undid.
    fn kept(&self, shard: &str, position: &Position) -> bool {
        self.aggregated
            .get(&(shard.to_string(), *position))
            .is_some_and(|(_, epoch)| {
                self.seek_epochs
                    .get(shard)
                    .is_none_or(|sought| epoch >= sought)
            })
    }
}

/// What the model knows of a windowed seed's windows.
struct Windows {
    width: Duration,
    /// Decides which calls fail (one in twenty; a final call one in five).
    fails: rand::rngs::StdRng,
    /// Records a window call settled into its state (acknowledged or dropped), by shard and
    /// position: the window's start and the ownership epoch of the last call that did.
    aggregated: BTreeMap<(String, Position), (i64, u64)>,
    /// The ownership epoch each shard's last seek set: what calls of earlier epochs aggregated
    /// the seek undid (their state is gone from the row).
    seek_epochs: BTreeMap<String, u64>,
    /// Records answered with a retry at their last attempt (spent: settled without the state).
    spent: BTreeSet<(String, Position)>,
    /// Windows whose final call succeeded, or whose state was dropped after `final_cap` failed
    /// final calls, by (shard, window start).
    closed: BTreeSet<(String, i64)>,
    /// How many final calls of a window fail before its state is dropped (`max_attempts`).
    final_cap: Option<u32>,
    /// Final calls that failed in a row, by (worker, shard, window start).
    failed_finals: BTreeMap<(String, String, i64), u32>,
}

impl Model {
    pub fn new(
        stale_bound: Duration,
        stream: MemoryStream,
        ledger: Option<MemoryReceipts>,
    ) -> Self {
        Self {
            log: EventLog::default(),
            violations: Vec::new(),
            rows: BTreeMap::new(),
            superseded: BTreeMap::new(),
            expired: BTreeMap::new(),
            given_up: BTreeMap::new(),
            left_behind: BTreeSet::new(),
            down: BTreeSet::new(),
            acquired: BTreeSet::new(),
            takes: BTreeMap::new(),
            first_take: BTreeMap::new(),
            keys: BTreeMap::new(),
            settled: BTreeSet::new(),
            retried: BTreeMap::new(),
            copies: BTreeMap::new(),
            handled: BTreeMap::new(),
            starts: BTreeMap::new(),
            resets: Vec::new(),
            aged_out: BTreeSet::new(),
            frontiers: BTreeMap::new(),
            invocations: 0,
            stale_window_ms: 0,
            stale_bound_ms: stale_bound.as_millis() as u64,
            lineage: BTreeMap::new(),
            closed: BTreeSet::new(),
            records: Vec::new(),
            stream,
            latest_seek: None,
            ledger,
            receipted: BTreeMap::new(),
            held: BTreeSet::new(),
            event_ids: BTreeMap::new(),
            ledger_broken: false,
            in_place: false,
            filtered: false,
            windows: None,
        }
    }

    /// Records are handled on tumbling windows of `width` (`None`: not), calls failing as the
    /// seed's `fails` generator draws.
    pub fn windowed(mut self, width: Option<Duration>, seed: u64, final_cap: Option<u32>) -> Self {
        self.windows = width.map(|width| Windows {
            final_cap,
            failed_finals: BTreeMap::new(),
            width,
            fails: rand::SeedableRng::seed_from_u64(seed ^ 0x0f_a115),
            aggregated: BTreeMap::new(),
            seek_epochs: BTreeMap::new(),
            spent: BTreeSet::new(),
            closed: BTreeSet::new(),
        });
        self
    }

    /// A filter keeps quotes from the handler: a quote settles without a handler's outcome (it
    /// counts as settled, is never owed), and one reaching the handler is a violation.
    pub fn filtered(mut self, on: bool) -> Self {
        self.filtered = on;
        self
    }

    /// Retries run in place: a delivery may start again at its own position (the next attempt),
    /// never after a later delivery of its key started.
    pub fn in_place(mut self, on: bool) -> Self {
        self.in_place = on;
        self
    }

    pub fn event(&mut self, at_ms: u64, event: impl Into<String>) {
        self.log.push(at_ms, event.into());
    }

    fn violation(&mut self, at_ms: u64, what: String) {
        self.log.push(at_ms, format!("VIOLATION {what}"));
        if self.violations.len() < 20 {
            self.violations.push(format!("at {at_ms} ms: {what}"));
        }
    }

    /// Reads the stream as it is now (records, lineage, which shards are closed).
    pub fn refresh(&mut self) {
        self.records = self.stream.records();
        let lineage = self.stream.lineage();
        self.closed.clear();
        for (shard, parents, closed, aged_out) in lineage {
            if closed {
                self.closed.insert(shard.clone());
            }
            if aged_out {
                self.aged_out.insert(shard.clone());
            }
            self.lineage.insert(shard, parents);
        }
    }

    pub fn aged_out(&mut self, shard: &str) {
        self.aged_out.insert(shard.to_string());
    }

    // -----------------------------------------------------------------------------------------
    // The lease store

    /// A change the store applied (called under the store's lock, in order).
    pub fn change(&mut self, at_ms: u64, change: &Change) {
        let row = change.after.as_ref().or(change.before.as_ref());
        let Some(row) = row else { return };
        let shard = row.shard_id.clone();
        self.event(
            at_ms,
            format!(
                "store {} {shard} {}",
                change.operation,
                change
                    .after
                    .as_ref()
                    .map(describe)
                    .unwrap_or_else(|| "deleted".into())
            ),
        );
        let (Some(before), Some(after)) = (&change.before, &change.after) else {
            if let (None, Some(after)) = (&change.before, &change.after) {
                self.starts.insert(shard.clone(), after.checkpoint.clone());
                self.rows.insert(shard, after.clone());
            } else {
                self.rows.remove(&shard);
            }
            return;
        };
        if after.owner_epoch > before.owner_epoch {
            self.superseded
                .insert((shard.clone(), before.owner_epoch), at_ms);
        }
        // (The world's thief takes leases whenever it likes: a theft, not an expiry.)
        if change.operation == "take"
            && before.owner.is_some()
            && before.owner != after.owner
            && before.wanted_by != after.owner
            && after.owner.as_deref() != Some("thief")
        {
            self.expired
                .insert((shard.clone(), before.owner_epoch), at_ms);
        }
        if change.operation == "take" {
            let owner = after.owner.clone().unwrap_or_default();
            if self.down.contains(&owner) {
                self.left_behind.insert((shard.clone(), after.owner_epoch));
            }
            self.takes
                .insert((shard.clone(), after.owner_epoch), (owner, at_ms));
            self.first_take.entry(shard.clone()).or_insert(at_ms);
        }
        // A checkpoint moves back only by a seek, which bumps the seek epoch.
        if change.operation != "seek" && after.checkpoint.sort_key() < before.checkpoint.sort_key()
        {
            self.violation(
                at_ms,
                format!(
                    "{shard}: checkpoint moved back from {} to {} by {} without a seek",
                    before.checkpoint, after.checkpoint, change.operation
                ),
            );
        }
        if change.operation == "seek" {
            if let Some(windows) = self.windows.as_mut() {
                windows.seek_epochs.insert(shard.clone(), after.owner_epoch);
            }
            if after.seek_epoch <= before.seek_epoch {
                self.violation(at_ms, format!("{shard}: a seek without a new seek epoch"));
            }
            self.refresh();
            let excuse = match &after.checkpoint {
                Checkpoint::TrimHorizon => Excuse::Nothing,
                Checkpoint::AtTimestamp(t) => {
                    if let Some(asked) = self.latest_seek
                        && self.ms_of(*t) > asked
                    {
                        self.violation(
                            at_ms,
                            format!("{shard}: a seek to latest asked at {asked} ms pinned a later start {}", after.checkpoint),
                        );
                    }
                    Excuse::ArrivedBefore(*t)
                }
                Checkpoint::Before(p) => Excuse::Before(shard.clone(), *p),
                Checkpoint::ShardEnd => Excuse::All,
                other => {
                    self.violation(
                        at_ms,
                        format!("{shard}: a seek left {other}, a moving start"),
                    );
                    Excuse::Nothing
                }
            };
            self.resets.push(Reset {
                at_ms,
                shards: BTreeSet::from([shard.clone()]),
                excuse,
            });
        }
        if change.operation == "checkpoint" && after.checkpoint != before.checkpoint {
            self.check_checkpoint(at_ms, before, after);
        }
        self.rows.insert(shard, after.clone());
    }

    /// A checkpoint write from `before` to `after`: every record between must have a durable
    /// outcome from this very ownership, and SHARD_END needs a closed shard.
    fn check_checkpoint(&mut self, at_ms: u64, before: &Lease, after: &Lease) {
        self.refresh();
        let shard = after.shard_id.clone();
        let owner = after.owner.clone().unwrap_or_default();
        let epoch = after.owner_epoch;
        if after.checkpoint == Checkpoint::ShardEnd
            && !self.closed.contains(&shard)
            && !self.aged_out.contains(&shard)
        {
            self.violation(
                at_ms,
                format!("{shard}: SHARD_END written on an open shard"),
            );
        }
        let taken_at = self
            .takes
            .get(&(shard.clone(), epoch))
            .map_or(0, |(_, at)| *at);
        let terminal: BTreeSet<EventId> = self
            .ledger
            .as_ref()
            .map(|l| {
                l.receipts()
                    .into_iter()
                    .filter(|r| r.disposition.is_terminal())
                    .map(|r| r.event)
                    .collect()
            })
            .unwrap_or_default();
        let mut unsettled = Vec::new();
        for r in self.records.iter().filter(|r| r.shard_id == shard) {
            let position = Position::new(r.record.sequence, 0);
            let arrived = r.record.arrived_at.unwrap_or(SystemTime::UNIX_EPOCH);
            if !after_start(&before.checkpoint, &position, arrived)
                || !covered_by(&after.checkpoint, &position)
            {
                continue;
            }
            if self.aged_out.contains(&shard) && after.checkpoint == Checkpoint::ShardEnd {
                continue; // lost to retention: ending it is what the shard's work comes to
            }
            let key = (owner.clone(), shard.clone(), epoch, position);
            let settled = (self.filtered && filtered_out(&r.record.data))
                || self.settled.contains(&key)
                || self.retried.get(&key).is_some_and(|(id, attempt)| {
                    self.copies
                        .get(&(owner.clone(), *id, *attempt))
                        .is_some_and(|times| times.iter().any(|t| *t >= taken_at))
                })
                || self
                    .receipted
                    .get(&key)
                    .is_some_and(|event| terminal.contains(event))
                // A delivery of a batch that timed out before the handler reached it: its copy
                // (or dead letter) by this owner is its outcome.
                || self.copy_written(&r.record.data, Some(owner.as_str()), taken_at);
            if !settled {
                unsettled.push(position.to_string());
            }
        }
        if !unsettled.is_empty() {
            self.violation(
                at_ms,
                format!(
                    "{shard}: {owner} (epoch {epoch}) moved the checkpoint from {} to {} past {} \
                     deliveries without a durable outcome of its own, first {}",
                    before.checkpoint,
                    after.checkpoint,
                    unsettled.len(),
                    unsettled[0]
                ),
            );
        }
    }

    // -----------------------------------------------------------------------------------------
    // Handlers

    /// A handler started on a delivery.
    pub fn started(&mut self, at_ms: u64, call: &Call) {
        let Call {
            worker,
            shard,
            epoch,
            position,
            key,
            id,
            attempt,
            event,
        } = call.clone();
        let (worker, shard, key) = (worker.as_str(), shard.as_str(), key.as_str());
        self.invocations += 1;
        self.event_ids.insert(event, id);
        if self.filtered && id.is_multiple_of(5) {
            self.violation(
                at_ms,
                format!(
                    "{shard}: {worker} handed id={id} (a quote) to the handler past the filter"
                ),
            );
        }
        let released = self.held.remove(&(shard.to_string(), epoch, position));
        self.event(
            at_ms,
            format!(
                "start {worker} {shard}@{epoch} {position} key={key} id={id} attempt={attempt}"
            ),
        );
        let current = self.rows.get(shard).is_some_and(|r| r.owner_epoch == epoch);
        if current {
            // Children only after every parent ended.
            let parents = self.lineage.get(shard).cloned().unwrap_or_default();
            for p in parents {
                if let Some(row) = self.rows.get(&p)
                    && row.checkpoint != Checkpoint::ShardEnd
                {
                    let cp = row.checkpoint.clone();
                    self.violation(
                        at_ms,
                        format!(
                            "{worker} handles {shard} {position} while its parent {p} is at {cp}"
                        ),
                    );
                }
            }
        } else if let Some(taken) = self.expired.get(&(shard.to_string(), epoch)).copied()
            && at_ms > taken
        {
            self.violation(
                at_ms,
                format!(
                    "{worker} dispatches {shard} {position} under epoch {epoch}, {} ms after \
                     another worker took the lease as expired",
                    at_ms - taken
                ),
            );
        } else if let Some(since) = self.superseded.get(&(shard.to_string(), epoch)).copied() {
            // A stale owner: allowed only within a bounded window after it lost the lease.
            let late = at_ms.saturating_sub(since);
            self.stale_window_ms = self.stale_window_ms.max(late);
            if late > self.stale_bound_ms {
                self.violation(
                    at_ms,
                    format!(
                        "{worker} still dispatches {shard} {position} under epoch {epoch}, {late} ms \
                         after the lease moved on (bound {} ms)",
                        self.stale_bound_ms
                    ),
                );
            }
        }
        // Order per key within one ownership, one delivery of a key at a time.
        let state = self
            .keys
            .entry((shard.to_string(), epoch, key.to_string()))
            .or_insert((None, false));
        let (last, running) = *state;
        if running {
            self.violation(
                at_ms,
                format!("{worker} runs two deliveries of key {key} of {shard}@{epoch} at once"),
            );
        } else if let Some(last) = last
            && last >= position
            && !released
            // In place, the same delivery's next attempt: nothing of its key started since.
            && !(self.in_place && last == position && attempt > 1)
        {
            self.violation(
                at_ms,
                format!(
                    "{worker} handles {shard}@{epoch} key {key} out of order (or twice): {position} after {last}"
                ),
            );
        }
        self.keys.insert(
            (shard.to_string(), epoch, key.to_string()),
            (Some(last.map_or(position, |last| last.max(position))), true),
        );
    }

    /// A handler finished with `outcome` (`settles`: the runtime settles it at once).
    pub fn finished(&mut self, at_ms: u64, call: &Call, outcome: Option<Outcome>, settles: bool) {
        let Call {
            worker,
            shard,
            epoch,
            position,
            key,
            id,
            attempt,
            event,
        } = call.clone();
        let (worker, shard, key) = (worker.as_str(), shard.as_str(), key.as_str());
        self.event(
            at_ms,
            format!(
                "done {worker} {shard}@{epoch} {position} id={id} attempt={attempt} {outcome:?}"
            ),
        );
        if let Some(state) = self
            .keys
            .get_mut(&(shard.to_string(), epoch, key.to_string()))
        {
            state.1 = false;
        }
        self.handled
            .entry((shard.to_string(), position))
            .or_default()
            .push(at_ms);
        let key = (worker.to_string(), shard.to_string(), epoch, position);
        if matches!(outcome, Some(Outcome::Hold(_))) {
            self.held.insert((shard.to_string(), epoch, position));
        }
        if matches!(
            outcome,
            Some(Outcome::Apply(_) | Outcome::Quarantine(_) | Outcome::Hold(_))
        ) {
            self.receipted.insert(key, event);
        } else if settles {
            self.settled.insert(key);
        } else {
            self.retried.insert(key, (id, attempt));
        }
    }

    /// A handler was dropped before it finished: its shard stopped or was lost (the delivery
    /// stays unsettled), or it ran past the handler timeout (the runtime writes a copy: the
    /// delivery counts as settled once that copy exists, as a retry does).
    pub fn abandoned(&mut self, call: &Call) {
        if let Some(state) = self
            .keys
            .get_mut(&(call.shard.clone(), call.epoch, call.key.clone()))
        {
            state.1 = false;
        }
        self.retried.insert(
            (
                call.worker.clone(),
                call.shard.clone(),
                call.epoch,
                call.position,
            ),
            (call.id, call.attempt),
        );
    }

    /// A copy or dead letter of the delivery (`id`, `attempt`) was written by `worker`.
    pub fn copied(&mut self, at_ms: u64, worker: &str, id: u64, attempt: u32, to: &str) {
        self.event(
            at_ms,
            format!("copy {worker} id={id} of attempt {attempt} to {to}"),
        );
        self.copies
            .entry((worker.to_string(), id, attempt))
            .or_default()
            .push(at_ms);
    }

    // -----------------------------------------------------------------------------------------
    // Tumbling windows

    /// A window call by `worker` with `state` (the ids its state holds; `None` at a window's
    /// first call) and `records`: every record belongs to the call's window, and the state's
    /// records then the call's are the shard's records of the window in order, none twice and
    /// none left out between them but what the filter kept from the handler or a spent retry.
    /// A final call has its window over (its end passed, a record of a later window read, or the
    /// shard ended) and a state holding every record of the window aggregated before its first,
    /// unless a seek reset the shard since the window's first aggregation. Returns whether the
    /// call is to fail.
    pub fn window_call(
        &mut self,
        at_ms: u64,
        worker: &str,
        call: &WindowCall,
        state: Option<&[u64]>,
        records: &[(Position, u64)],
    ) -> bool {
        let Some(windows) = self.windows.as_mut() else {
            return false;
        };
        let (shard, window) = (call.shard_id.as_str(), call.window);
        let fails =
            rand::Rng::random_bool(&mut windows.fails, if call.is_final { 0.2 } else { 0.05 });
        let ids: Vec<u64> = records.iter().map(|(_, id)| *id).collect();
        self.event(
            at_ms,
            format!(
                "window {worker} {shard} [{}, {}) state={state:?} ids={ids:?}{}{}{}",
                window.start_ms,
                window.end_ms,
                if call.is_final { " final" } else { "" },
                if call.terminated_early { " early" } else { "" },
                if fails { " (fails)" } else { "" },
            ),
        );
        self.refresh();
        let width = self.windows.as_ref().map_or(Duration::ZERO, |w| w.width);
        let mut chain: Vec<u64> = state.unwrap_or_default().to_vec();
        chain.extend(&ids);
        let mut problems = Vec::new();
        let mut last: Option<Position> = None;
        let mut seen = BTreeSet::new();
        for id in &chain {
            let Some(r) = self.records.iter().find(|r| {
                r.shard_id == shard
                    && id_of(&shardwise::envelope::decode(r.record.data.clone()).payload) == *id
            }) else {
                problems.push(format!("id {id} is not a record of {shard}"));
                continue;
            };
            let position = Position::new(r.record.sequence, 0);
            let arrived = r.record.arrived_at.map_or(0, shardwise_millis);
            if Window::of(arrived, width) != window {
                problems.push(format!(
                    "id {id} arrived at {arrived} ms, outside the window"
                ));
            }
            if !seen.insert(*id) {
                problems.push(format!("id {id} twice"));
            }
            if let Some(last) = last {
                if position <= last {
                    problems.push(format!("id {id} at {position} after {last}"));
                }
                let left_out = self.left_out(shard, last, position);
                if !left_out.is_empty() {
                    problems.push(format!(
                        "left out between {last} and {position}: {left_out:?}"
                    ));
                }
            }
            last = Some(position);
        }
        if call.is_final {
            problems.extend(self.final_problems(at_ms, call, &chain));
            if let Some(windows) = self.windows.as_mut() {
                let key = (worker.to_string(), shard.to_string(), window.start_ms);
                if fails {
                    let failed = windows.failed_finals.entry(key).or_default();
                    *failed += 1;
                    if windows.final_cap.is_some_and(|cap| *failed >= cap) {
                        // Its state is dropped: the window is over without a final call.
                        windows.closed.insert((shard.to_string(), window.start_ms));
                    }
                } else {
                    windows.failed_finals.remove(&key);
                }
            }
        }
        if !problems.is_empty() {
            self.violation(
                at_ms,
                format!(
                    "{worker}'s window call on {shard} [{}, {}){}: {}",
                    window.start_ms,
                    window.end_ms,
                    if call.is_final { " (final)" } else { "" },
                    problems.join("; ")
                ),
            );
        }
        fails
    }

    /// The records of `shard` strictly between `from` and `to` that a window's state lacks
    /// though nothing explains it (neither filtered nor spent).
    fn left_out(&self, shard: &str, from: Position, to: Position) -> Vec<String> {
        let Some(windows) = &self.windows else {
            return Vec::new();
        };
        self.records
            .iter()
            .filter(|r| r.shard_id == shard)
            .filter(|r| {
                let p = Position::new(r.record.sequence, 0);
                p > from
                    && p < to
                    && !(self.filtered && filtered_out(&r.record.data))
                    && !windows.spent.contains(&(shard.to_string(), p))
            })
            .map(|r| r.record.sequence.to_string())
            .collect()
    }

    /// What is wrong with a final call whose state holds `chain`.
    fn final_problems(&self, at_ms: u64, call: &WindowCall, chain: &[u64]) -> Vec<String> {
        let Some(windows) = &self.windows else {
            return Vec::new();
        };
        let (shard, window) = (call.shard_id.as_str(), call.window);
        let mut problems = Vec::new();
        let of_window = |r: &&StoredRecord| {
            r.shard_id == shard
                && Window::of(
                    r.record.arrived_at.map_or(0, shardwise_millis),
                    windows.width,
                ) == window
        };
        let service_ms = shardwise_millis(crate::world::base()) + at_ms as i64;
        let later_read = self.records.iter().any(|r| {
            r.shard_id == shard && r.record.arrived_at.map_or(0, shardwise_millis) >= window.end_ms
        });
        if !call.terminated_early
            && window.end_ms > service_ms
            && !later_read
            && !self.closed.contains(shard)
        {
            problems.push(format!(
                "a final call {} ms before the window's end, nothing later on the shard",
                window.end_ms - service_ms
            ));
        }
        let Some(first) = chain.first() else {
            return problems;
        };
        let first_position = self.records.iter().find_map(|r| {
            (r.shard_id == shard
                && id_of(&shardwise::envelope::decode(r.record.data.clone()).payload) == *first)
                .then(|| Position::new(r.record.sequence, 0))
        });
        if let Some(first_position) = first_position {
            let lost: Vec<String> = self
                .records
                .iter()
                .filter(of_window)
                .map(|r| Position::new(r.record.sequence, 0))
                .filter(|p| {
                    *p < first_position
                        && windows.kept(shard, p)
                        && !windows.spent.contains(&(shard.to_string(), *p))
                })
                .map(|p| p.to_string())
                .collect();
            if !lost.is_empty() {
                problems.push(format!(
                    "the state lost records aggregated before its first: {lost:?}"
                ));
            }
        }
        problems
    }

    /// A window call settled `call`'s record into its state.
    pub fn aggregated(&mut self, call: &Call, window: Window) {
        if let Some(windows) = self.windows.as_mut() {
            windows.aggregated.insert(
                (call.shard.clone(), call.position),
                (window.start_ms, call.epoch),
            );
        }
    }

    /// `call`'s record was not handled: an earlier record of its window call failed, or the
    /// call failed whole, and the runtime answers a retry for it (`spent`: at its last attempt,
    /// dead-lettered, or dropped without a dead-letter stream, as Lambda discards a batch).
    pub fn passed_over(&mut self, at_ms: u64, call: &Call, spent: bool, dead_letter: bool) {
        if spent {
            self.finished(at_ms, call, Some(Outcome::Retry), !dead_letter);
            self.spent(call);
            return;
        }
        self.event(
            at_ms,
            format!(
                "passed over {} {}@{} {} id={} attempt={}",
                call.worker, call.shard, call.epoch, call.position, call.id, call.attempt
            ),
        );
        self.retried.insert(
            (
                call.worker.clone(),
                call.shard.clone(),
                call.epoch,
                call.position,
            ),
            (call.id, call.attempt),
        );
    }

    /// `call`'s record was answered with a retry at its last attempt: it is spent, and no
    /// window's state holds it.
    pub fn spent(&mut self, call: &Call) {
        if let Some(windows) = self.windows.as_mut() {
            let record = (call.shard.clone(), call.position);
            // Its last handling is what counts: an earlier owner's aggregation is undone.
            windows.aggregated.remove(&record);
            windows.spent.insert(record);
        }
    }

    /// `shard`'s `window` had its final call answered.
    pub fn window_closed(&mut self, at_ms: u64, shard: &str, window: Window) {
        self.event(
            at_ms,
            format!(
                "window {shard} [{}, {}) closed",
                window.start_ms, window.end_ms
            ),
        );
        if let Some(windows) = self.windows.as_mut() {
            windows.closed.insert((shard.to_string(), window.start_ms));
        }
    }

    /// Windows with aggregated records that no seek undid, and no final call yet (retention
    /// excuses one).
    pub fn unclosed_windows(&self) -> Vec<String> {
        let Some(windows) = &self.windows else {
            return Vec::new();
        };
        let unclosed: BTreeSet<(String, i64)> = windows
            .aggregated
            .iter()
            .filter(|((shard, position), (start, _))| {
                windows.kept(shard, position)
                    && !windows.closed.contains(&(shard.clone(), *start))
                    && !self.aged_out.contains(shard)
            })
            .map(|((shard, _), (start, _))| (shard.clone(), *start))
            .collect();
        unclosed
            .into_iter()
            .map(|(shard, start)| format!("{shard} [{start}, ..)"))
            .collect()
    }

    // -----------------------------------------------------------------------------------------
    // Receipts

    /// After a commit: no record's effect counted more than once, a counter for exactly the
    /// events with an `applied` receipt, and every apply's effects all written (the per-key
    /// counters add up to the applied receipts).
    pub fn check_ledger(&mut self, at_ms: u64) {
        let Some(ledger) = &self.ledger else { return };
        if self.ledger_broken {
            return;
        }
        let applied: Vec<EventId> = ledger
            .receipts()
            .into_iter()
            .filter(|r| r.disposition == Disposition::Applied)
            .map(|r| r.event)
            .collect();
        let applied_ids: BTreeSet<u64> = applied
            .iter()
            .filter_map(|e| self.event_ids.get(e).copied())
            .collect();
        let number = |item: &shardwise::receipts::Item, name: &str| match item.get(name) {
            Some(shardwise::aws_sdk_dynamodb::types::AttributeValue::N(n)) => {
                n.parse::<i64>().unwrap_or(-1)
            }
            _ => -1,
        };
        let mut problems = Vec::new();
        let mut counted = BTreeSet::new();
        for item in ledger.items(COUNTS) {
            let id = match item.get("id") {
                Some(shardwise::aws_sdk_dynamodb::types::AttributeValue::S(id)) => {
                    id.parse().unwrap_or(u64::MAX)
                }
                _ => u64::MAX,
            };
            let count = number(&item, "count");
            if count != 1 {
                problems.push(format!("id {id}'s effect applied {count} times"));
            }
            counted.insert(id);
        }
        if counted != applied_ids {
            let missing: Vec<_> = applied_ids.difference(&counted).take(3).collect();
            let extra: Vec<_> = counted.difference(&applied_ids).take(3).collect();
            problems.push(format!(
                "counters and applied receipts differ: applied without effect {missing:?}, effect without an applied receipt {extra:?}"
            ));
        }
        let per_key: i64 = ledger.items(KEYS).iter().map(|i| number(i, "count")).sum();
        if per_key != applied.len() as i64 {
            problems.push(format!(
                "per-key counters add up to {per_key} for {} applied receipts: an apply wrote part of its effects",
                applied.len()
            ));
        }
        if !problems.is_empty() {
            self.ledger_broken = true;
            self.violation(at_ms, format!("receipts: {}", problems.join("; ")));
        }
    }

    // -----------------------------------------------------------------------------------------
    // The frontier

    pub fn frontier(&mut self, at_ms: u64, worker: &str, frontier: &Frontier) {
        // A withheld scalar (`None`: a member without a coordinate, a partition listed before its
        // row) claims nothing; the next scalar of the epoch must not be below the last one.
        let now = (frontier.epoch, frontier.scalar);
        let last = self.frontiers.get(worker).copied();
        if let Some((epoch, scalar)) = last
            && epoch == now.0
            && scalar.is_some()
            && now.1.is_some()
            && now.1 < scalar
        {
            self.violation(
                at_ms,
                format!(
                    "{worker}'s frontier went down within membership epoch {epoch}: {scalar:?} -> {:?}",
                    now.1
                ),
            );
        }
        let kept = match last {
            Some((epoch, scalar)) if epoch == now.0 && now.1.is_none() => (epoch, scalar),
            _ => now,
        };
        self.frontiers.insert(worker.to_string(), kept);
    }

    /// A worker's manager took the lease of `shard` under `epoch` (and knows it).
    pub fn acquired(&mut self, shard: &str, epoch: u64) {
        self.acquired.insert((shard.to_string(), epoch));
    }

    /// `worker` started (again).
    pub fn worker_up(&mut self, worker: &str) {
        self.down.remove(worker);
    }

    pub fn forget_worker(&mut self, worker: &str) {
        self.frontiers.remove(worker);
        self.down.insert(worker.to_string());
        // Its leases are no longer its to give up: a crashed process holds nothing, a stopped
        // one releases what it can.
        for (key, (owner, _)) in &self.takes {
            if owner == worker && !self.given_up.contains_key(key) {
                self.left_behind.insert(key.clone());
            }
        }
    }

    /// Leases taken as expired whose owner, still running, never gave them up: it went on
    /// holding a lease another worker held.
    pub fn never_given_up(&self) -> Vec<String> {
        self.expired
            .keys()
            .filter(|key| {
                self.acquired.contains(*key)
                    && !self.given_up.contains_key(*key)
                    && !self.left_behind.contains(*key)
            })
            .filter_map(|key| {
                let (owner, _) = self.takes.get(key)?;
                // (The world's thief holds nothing: it only writes the row.)
                (owner != "thief")
                    .then(|| format!("{owner} never gave up {} epoch {}", key.0, key.1))
            })
            .collect()
    }

    /// `worker` gave up the lease of `shard` it held under `epoch`: no later than another worker
    /// took that lease as expired (it judged the owner silent), or the two held it at once.
    pub fn gave_up(&mut self, at_ms: u64, worker: &str, shard: &str, epoch: u64) {
        self.event(at_ms, format!("{worker} gave up {shard} epoch {epoch}"));
        let key = (shard.to_string(), epoch);
        self.given_up.entry(key.clone()).or_insert(at_ms);
        // Not owed: by a crashed process's manager, which may still finish a call it had under
        // way when the world dropped it (it holds nothing by then); nor for a lease whose take
        // was answered after its hold ran out (never held: given up as it was taken).
        if let Some(taken) = self.expired.get(&key).copied()
            && self.acquired.contains(&key)
            && !self.left_behind.contains(&key)
            && at_ms > taken
        {
            self.violation(
                at_ms,
                format!(
                    "{worker} gave up {shard} epoch {epoch} {} ms after another worker took it as expired",
                    at_ms - taken
                ),
            );
        }
    }

    // -----------------------------------------------------------------------------------------
    // Skips

    /// Records that must still be handled (each with the time after which it must be), given the
    /// starts, seeks and retention seen so far.
    pub fn owed(&self) -> Vec<(String, Position, u64)> {
        let mut owed = Vec::new();
        for r in &self.records {
            let shard = &r.shard_id;
            let position = Position::new(r.record.sequence, 0);
            let arrived = r.record.arrived_at.unwrap_or(SystemTime::UNIX_EPOCH);
            let Some(after_ms) = self.owing(shard, &position, arrived) else {
                continue;
            };
            if self.filtered && filtered_out(&r.record.data) {
                continue;
            }
            let done = self
                .handled
                .get(&(shard.clone(), position))
                .is_some_and(|times| times.iter().any(|t| *t >= after_ms));
            // A delivery dropped past the handler timeout (or left in a batch that timed out) is
            // dealt with once its copy or dead letter is written: the copy is owed in its turn.
            if !done && !self.copy_written(&r.record.data, None, after_ms) {
                owed.push((shard.clone(), position, after_ms));
            }
        }
        owed
    }

    /// Whether a copy or dead letter of the record `data` (its id at its attempt) was written at
    /// or after `after_ms`, by `worker` when one is named.
    fn copy_written(&self, data: &bytes::Bytes, worker: Option<&str>, after_ms: u64) -> bool {
        let decoded = shardwise::envelope::decode(data.clone());
        let (id, attempt) = (id_of(&decoded.payload), decoded.headers.attempt());
        self.copies.iter().any(|((w, i, a), times)| {
            *i == id
                // In place the record on the stream stays attempt 1 while its attempts go up:
                // its dead letter is of any attempt.
                && (*a == attempt || self.in_place)
                && worker.is_none_or(|worker| worker == w)
                && times.iter().any(|t| *t >= after_ms)
        })
    }

    /// A seek to latest is being asked for at `at_ms` (`None`: no longer).
    pub fn seeking_latest(&mut self, at_ms: Option<u64>) {
        self.latest_seek = at_ms;
    }

    /// Records owed a durable outcome (not excused by a start, a seek or retention) that the
    /// final checkpoints do not cover: after every worker stopped gracefully there must be none.
    pub fn uncovered(&mut self) -> Vec<String> {
        self.refresh();
        let owed_positions: Vec<(String, Position)> = self
            .records
            .iter()
            .filter(|r| !self.aged_out.contains(&r.shard_id))
            .map(|r| (r.shard_id.clone(), Position::new(r.record.sequence, 0)))
            .filter(|(shard, position)| !self.excused(shard, position))
            .collect();
        owed_positions
            .into_iter()
            .filter(|(shard, position)| {
                !self
                    .rows
                    .get(shard)
                    .is_some_and(|row| covered_by(&row.checkpoint, position))
                    && self.rows.contains_key(shard)
            })
            .map(|(shard, position)| format!("{shard} {position}"))
            .collect()
    }

    /// Whether the starts, seeks and retention seen excuse a record from being handled.
    fn excused(&self, shard: &str, position: &Position) -> bool {
        let Some(r) = self
            .records
            .iter()
            .find(|r| r.shard_id == shard && Position::new(r.record.sequence, 0) == *position)
        else {
            return true;
        };
        let arrived = r.record.arrived_at.unwrap_or(SystemTime::UNIX_EPOCH);
        self.owing(shard, position, arrived).is_none()
    }

    /// When a record must have been handled after (`None`: it need not be).
    fn owing(&self, shard: &str, position: &Position, arrived: SystemTime) -> Option<u64> {
        if self.aged_out.contains(shard) {
            return None;
        }
        let arrived_ms = self.ms_of(arrived);
        let mut after_ms = 0;
        let mut excused = match self.starts.get(shard) {
            Some(Checkpoint::Latest) => self
                .first_take
                .get(shard)
                .is_none_or(|first| arrived_ms < *first),
            Some(Checkpoint::AtTimestamp(t)) => arrived < *t,
            _ => false,
        };
        for reset in &self.resets {
            if !reset.shards.contains(shard) || arrived_ms > reset.at_ms {
                continue;
            }
            let excuses = match &reset.excuse {
                Excuse::Nothing => false,
                Excuse::ArrivedBefore(t) => arrived < *t,
                Excuse::Before(s, p) => s == shard && position < p,
                Excuse::All => true,
            };
            if excuses {
                excused = true;
            } else {
                excused = false;
                after_ms = after_ms.max(reset.at_ms);
            }
        }
        (!excused).then_some(after_ms)
    }

    /// The simulation's time base, set by the world: wall time at 0 ms.
    pub fn ms_of(&self, t: SystemTime) -> u64 {
        t.duration_since(crate::world::base())
            .map_or(0, |d| d.as_millis() as u64)
    }
}

fn describe(row: &Lease) -> String {
    format!(
        "owner={} epoch={} seek={} cp={}",
        row.owner.as_deref().unwrap_or("-"),
        row.owner_epoch,
        row.seek_epoch,
        row.checkpoint
    )
}
