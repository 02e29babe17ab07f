//! What a running consumer can say about its own health: leases and their renewals, and per shard
//! the last read and the last checkpoint write, with how long settled progress has waited to be
//! written. [`Running::health`](super::Running::health) reads it; `shardwise consume
//! --metrics-addr` serves it as `/healthz` and `/readyz`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

/// A snapshot of a consumer's health.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Health {
    /// Leases held now.
    pub leases_held: usize,
    /// Since the oldest held lease was last renewed (`None` when nothing is held). Above the
    /// lease duration, other workers may already see the lease expired.
    pub since_renewal: Option<Duration>,
    /// Since this worker's last beat that landed (beats go out every renew interval whether
    /// leases are held or not). Above the lease duration the lease table has not answered this
    /// worker for that long: it holds only leases it can still renew, and takes none.
    pub since_beat: Duration,
    /// The lease duration the renewals are measured against.
    pub lease_duration: Duration,
    /// Each shard being read here.
    pub shards: Vec<ShardHealth>,
    /// Retry copies and dead letters whose writes fail for good now (see
    /// [`Running::stuck_writes`](super::Running::stuck_writes)).
    pub stuck_writes: usize,
    /// A graceful stop was asked for.
    pub stopping: bool,
    /// Another process started earlier runs under this worker id: this one gave way and holds
    /// and takes no lease (see [`Error::WorkerIdInUse`](crate::Error::WorkerIdInUse)).
    pub worker_id_in_use: bool,
}

/// One shard's health.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardHealth {
    /// The shard (or partition).
    pub shard: String,
    /// Since the shard was taken here.
    pub since_taken: Duration,
    /// Since the last successful read (`None`: none yet).
    pub since_read: Option<Duration>,
    /// Since the last checkpoint write that reached the store (`None`: none yet).
    pub since_checkpoint: Option<Duration>,
    /// How long settled progress has waited for a checkpoint write to reach the store (`None`:
    /// everything settled is written).
    pub unwritten_for: Option<Duration>,
    /// Events of a paged partition that failed and run again in place (each holds the page
    /// barrier until it settles): how many there are now.
    pub retrying: usize,
    /// The one of them that has been failing longest, if any.
    pub oldest_retry: Option<RetryingEvent>,
}

/// A paged event, or a Kinesis record retried in place, that failed and runs again in place.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetryingEvent {
    /// The event's identity (`paged/SOURCE/PARTITION/ID`; a Kinesis record's
    /// `kinesis/STREAM/SHARD/SEQUENCE[/SUB]`).
    pub event: String,
    /// Its partition key, whose later records wait behind it (a keyless paged event's is its
    /// identity's last part).
    pub key: String,
    /// Attempts so far (the first delivery counts).
    pub attempts: u32,
    /// Since its first failure.
    pub failing_for: Duration,
}

/// When [`Health::problems`] calls a consumer unhealthy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct HealthLimits {
    /// Settled progress not written for longer than this is a stalled checkpoint. Default 60 s.
    pub checkpoint_stall: Duration,
}

impl Default for HealthLimits {
    fn default() -> Self {
        Self {
            checkpoint_stall: Duration::from_secs(60),
        }
    }
}

impl Health {
    /// What is wrong, each as a sentence; empty when healthy. Renewals are stalled when the oldest
    /// held lease was last renewed longer ago than the lease duration; a checkpoint is stalled
    /// when settled progress has waited longer than `limits.checkpoint_stall` to be written.
    /// Stuck retry writes and paged events retrying in place ([`ShardHealth::oldest_retry`]) are
    /// reported, not counted as a problem here: restarting the worker mends neither a missing
    /// dead-letter stream nor a failing downstream, and both hold their checkpoint visibly.
    pub fn problems(&self, limits: HealthLimits) -> Vec<String> {
        let mut problems = Vec::new();
        if self.worker_id_in_use {
            problems.push(
                "worker id in use by another process started earlier: this one holds and takes no lease"
                    .to_string(),
            );
        }
        if let Some(since) = self.since_renewal
            && since > self.lease_duration
        {
            problems.push(format!(
                "lease renewals stalled: the oldest held lease was renewed {:.1} s ago (lease duration {:.1} s)",
                since.as_secs_f64(),
                self.lease_duration.as_secs_f64()
            ));
        }
        if self.since_beat > self.lease_duration && !self.stopping {
            problems.push(format!(
                "lease table not answering: this worker's last beat landed {:.1} s ago (lease duration {:.1} s); it takes no lease until one lands",
                self.since_beat.as_secs_f64(),
                self.lease_duration.as_secs_f64()
            ));
        }
        for shard in &self.shards {
            if let Some(waiting) = shard.unwritten_for
                && waiting > limits.checkpoint_stall
            {
                problems.push(format!(
                    "checkpoint of {} stalled: settled progress unwritten for {:.1} s (limit {:.1} s)",
                    shard.shard,
                    waiting.as_secs_f64(),
                    limits.checkpoint_stall.as_secs_f64()
                ));
            }
        }
        problems
    }
}

#[derive(Debug)]
struct Slot {
    taken: Instant,
    read: Option<Instant>,
    written: Option<Instant>,
    unwritten_since: Option<Instant>,
    /// Events running again in place: attempts so far, and since their first failure.
    /// Events running again in place: identity -> (partition key, attempts, first failure).
    retrying: BTreeMap<String, (String, u32, Instant)>,
}

/// Every shard's slot, shared by the shard loops and the consumer's handle.
#[derive(Debug, Clone, Default)]
pub(crate) struct Board(Arc<Mutex<BTreeMap<String, Slot>>>);

impl Board {
    fn slots(&self) -> MutexGuard<'_, BTreeMap<String, Slot>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot for `shard`, removed again when the entry is dropped (the shard left).
    pub(crate) fn enter(&self, shard: &str) -> Entry {
        self.slots().insert(
            shard.to_string(),
            Slot {
                taken: Instant::now(),
                read: None,
                written: None,
                unwritten_since: None,
                retrying: BTreeMap::new(),
            },
        );
        Entry {
            board: self.clone(),
            shard: shard.to_string(),
        }
    }

    pub(crate) fn shards(&self) -> Vec<ShardHealth> {
        let now = Instant::now();
        self.slots()
            .iter()
            .map(|(shard, slot)| ShardHealth {
                shard: shard.clone(),
                since_taken: now - slot.taken,
                since_read: slot.read.map(|t| now - t),
                since_checkpoint: slot.written.map(|t| now - t),
                unwritten_for: slot.unwritten_since.map(|t| now - t),
                retrying: slot.retrying.len(),
                oldest_retry: slot
                    .retrying
                    .iter()
                    .min_by_key(|(_, (_, _, since))| *since)
                    .map(|(event, (key, attempts, since))| RetryingEvent {
                        event: event.clone(),
                        key: key.clone(),
                        attempts: *attempts,
                        failing_for: now - *since,
                    }),
            })
            .collect()
    }

    /// `event` of `shard` failed at attempt `attempts` and runs again in place. Returns how many
    /// events of the shard do now.
    pub(crate) fn retrying(&self, shard: &str, event: &str, key: &str, attempts: u32) -> usize {
        let mut slots = self.slots();
        let Some(slot) = slots.get_mut(shard) else {
            return 0;
        };
        slot.retrying
            .entry(event.to_string())
            .and_modify(|(_, n, _)| *n = attempts)
            .or_insert((key.to_string(), attempts, Instant::now()));
        slot.retrying.len()
    }

    /// `event` of `shard` settled: it no longer runs again. Returns how many events of the shard
    /// still do, or `None` when it was not among them.
    pub(crate) fn settled(&self, shard: &str, event: &str) -> Option<usize> {
        let mut slots = self.slots();
        let slot = slots.get_mut(shard)?;
        slot.retrying.remove(event)?;
        Some(slot.retrying.len())
    }
}

/// One shard's slot on the board.
#[derive(Debug)]
pub(crate) struct Entry {
    board: Board,
    shard: String,
}

impl Entry {
    fn update(&self, f: impl FnOnce(&mut Slot)) {
        if let Some(slot) = self.board.slots().get_mut(&self.shard) {
            f(slot);
        }
    }

    /// A read succeeded.
    pub(crate) fn read(&self) {
        self.update(|s| s.read = Some(Instant::now()));
    }

    /// Progress settled that is not written yet.
    pub(crate) fn pending(&self) {
        self.update(|s| {
            s.unwritten_since.get_or_insert_with(Instant::now);
        });
    }

    /// A checkpoint write reached the store; `more` when progress settled since waits for the
    /// next one.
    pub(crate) fn written(&self, more: bool) {
        self.update(|s| {
            let now = Instant::now();
            s.written = Some(now);
            s.unwritten_since = more.then_some(now);
        });
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.board.slots().remove(&self.shard);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_checkpoint_waiting_past_the_limit_is_a_problem_and_a_write_clears_it() {
        let board = Board::default();
        let entry = board.enter("shard-1");
        entry.read();
        entry.pending();
        tokio::time::sleep(Duration::from_secs(61)).await;
        let health = |board: &Board| Health {
            leases_held: 1,
            since_renewal: Some(Duration::from_secs(2)),
            since_beat: Duration::from_secs(2),
            lease_duration: Duration::from_secs(10),
            shards: board.shards(),
            stuck_writes: 0,
            stopping: false,
            worker_id_in_use: false,
        };
        let problems = health(&board).problems(HealthLimits::default());
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("checkpoint of shard-1 stalled"));
        entry.written(false);
        assert!(health(&board).problems(HealthLimits::default()).is_empty());
        let shard = &health(&board).shards[0];
        assert_eq!(shard.since_read, Some(Duration::from_secs(61)));
        assert_eq!(shard.since_checkpoint, Some(Duration::ZERO));
        drop(entry);
        assert!(board.shards().is_empty(), "the slot goes with the shard");
    }

    #[tokio::test(start_paused = true)]
    async fn events_retrying_in_place_are_named_with_their_attempts_until_they_settle() {
        let board = Board::default();
        let _entry = board.enter("p");
        assert_eq!(board.retrying("p", "paged/s/p/7", "k", 2), 1);
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(board.retrying("p", "paged/s/p/9", "k", 2), 2);
        assert_eq!(
            board.retrying("p", "paged/s/p/7", "k", 3),
            2,
            "the same event again"
        );
        let shard = &board.shards()[0];
        assert_eq!(shard.retrying, 2);
        assert_eq!(
            shard.oldest_retry,
            Some(RetryingEvent {
                event: "paged/s/p/7".into(),
                key: "k".into(),
                attempts: 3,
                failing_for: Duration::from_secs(3),
            })
        );
        assert_eq!(board.settled("p", "paged/s/p/7"), Some(1));
        assert_eq!(board.settled("p", "paged/s/p/7"), None, "settled once");
        assert_eq!(
            board.retrying("q", "paged/s/q/1", "k", 2),
            0,
            "no slot, no entry"
        );
    }

    #[test]
    fn renewals_older_than_the_lease_duration_are_a_problem() {
        let health = Health {
            leases_held: 3,
            since_renewal: Some(Duration::from_secs(11)),
            since_beat: Duration::from_secs(1),
            lease_duration: Duration::from_secs(10),
            shards: vec![],
            stuck_writes: 2,
            stopping: false,
            worker_id_in_use: false,
        };
        let problems = health.problems(HealthLimits::default());
        assert_eq!(problems.len(), 1);
        assert!(
            problems[0].starts_with("lease renewals stalled"),
            "{problems:?}"
        );
    }

    #[test]
    fn a_lease_table_silent_for_longer_than_the_lease_duration_is_a_problem_until_stopping() {
        let mut health = Health {
            leases_held: 0,
            since_renewal: None,
            since_beat: Duration::from_secs(11),
            lease_duration: Duration::from_secs(10),
            shards: vec![],
            stuck_writes: 0,
            stopping: false,
            worker_id_in_use: false,
        };
        let problems = health.problems(HealthLimits::default());
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].starts_with(
                "lease table not answering: this worker's last beat landed 11.0 s ago"
            ),
            "{problems:?}"
        );
        health.since_beat = Duration::from_secs(10);
        assert!(health.problems(HealthLimits::default()).is_empty());
        // A stopped worker beats no more: that is not a fault.
        health.since_beat = Duration::from_secs(60);
        health.stopping = true;
        assert!(health.problems(HealthLimits::default()).is_empty());
    }
}
