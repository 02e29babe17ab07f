//! A shard's checkpoint writes: coalesced (at most one in flight, at most one started per
//! checkpoint interval, none for an idle shard) and fenced by the store (owner, ownership epoch,
//! and a position greater than the stored one). It also raises the frontier coordinate of an idle,
//! caught-up shard when a clock-skew allowance is configured.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::time::Instant;
use tracing::warn;

use super::owned::{Answer, Lost};
use crate::checkpoint::Checkpoint;
use crate::frontier::{self, ShardProgress};
use crate::lease::{CheckpointWrite, LeaseStore, Ownership};
use crate::position::Position;
use crate::time::millis;
use crate::track::Tracker;
use crate::window::WindowState;

/// A tracked delivery: its position and arrival time (ms).
pub(crate) type Entry = (Position, Option<i64>);

pub(crate) struct Checkpointer {
    store: Arc<dyn LeaseStore>,
    ownership: Ownership,
    /// Settled through here but not yet written.
    pending: Option<Position>,
    /// The position the row's checkpoint stands at, as far as this attempt knows.
    written: Option<Position>,
    /// Frontier inputs besides the tracker (see `frontier::complete_through`).
    last_settled: Option<i64>,
    caught_up_at: Option<i64>,
    /// The stored `completeThrough`: what this shard's coordinate never goes below.
    floor: Option<i64>,
    caught_up_skew: Option<Duration>,
    frontier_interval: Duration,
    frontier_written_at: Option<Instant>,
}

/// A checkpoint write: the position, and the frontier coordinate written with it.
#[derive(Debug, Clone)]
pub(crate) struct Write {
    pub(crate) to: Position,
    pub(crate) complete_through: Option<i64>,
    /// For a shard on tumbling windows: the window state through `to` (`Some(None)`: none open),
    /// written in the same write; `None`: the row's stays.
    pub(crate) window: Option<Option<WindowState>>,
}

impl Checkpointer {
    /// The checkpoints of `ownership`'s shard, whose stored `completeThrough` is `floor`.
    pub(crate) fn new(
        store: Arc<dyn LeaseStore>,
        ownership: Ownership,
        start: &Checkpoint,
        floor: Option<i64>,
        caught_up_skew: Option<Duration>,
        frontier_interval: Duration,
    ) -> Self {
        Self {
            store,
            ownership,
            pending: None,
            written: match start {
                Checkpoint::At(p) => Some(*p),
                _ => None,
            },
            last_settled: None,
            caught_up_at: None,
            floor,
            caught_up_skew,
            frontier_interval,
            frontier_written_at: None,
        }
    }

    fn complete_through(&self, tracker: &Tracker<Entry>) -> Option<i64> {
        frontier::complete_through(
            &ShardProgress {
                oldest_unsettled: tracker.oldest_unsettled().and_then(|e| e.1),
                last_settled: self.last_settled,
                caught_up_at: self.caught_up_at,
                floor: self.floor,
            },
            self.caught_up_skew,
        )
    }

    /// The settled prefix moved through `to`, the last settled delivery having arrived at
    /// `arrived`.
    pub(crate) fn settled(&mut self, (to, arrived): Entry) {
        self.pending = Some(to);
        if arrived.is_some() {
            self.last_settled = arrived;
        }
    }

    /// A read came back: caught up (nothing read, nothing behind) or not.
    pub(crate) fn read(&mut self, caught_up: bool) {
        self.caught_up_at = caught_up.then(|| millis(crate::time::now()));
    }

    /// Whether settled progress waits for a write.
    pub(crate) fn unwritten(&self) -> bool {
        self.pending.is_some()
    }

    /// The write of the pending position, if any: taken (it is given back if the write fails).
    pub(crate) fn propose(&mut self, tracker: &Tracker<Entry>) -> Option<Write> {
        let to = self.pending.take()?;
        Some(Write {
            to,
            complete_through: self.complete_through(tracker),
            window: None,
        })
    }

    /// A write at the position already written, to carry a window state alone; `None` before
    /// any position was written.
    pub(crate) fn propose_again(&self) -> Option<Write> {
        Some(Write {
            to: self.written?,
            complete_through: None,
            window: None,
        })
    }

    /// Makes `write`, fenced by the lease.
    pub(crate) fn write(&self, write: Write) -> BoxFuture<'static, Answer<Write>> {
        let store = self.store.clone();
        let ownership = self.ownership.clone();
        Box::pin(async move {
            let to = Checkpoint::At(write.to);
            let result = match &write.window {
                None => {
                    store
                        .checkpoint(&ownership, &to, write.complete_through)
                        .await
                }
                Some(window) => {
                    store
                        .checkpoint_window(&ownership, &to, write.complete_through, window.as_ref())
                        .await
                }
            };
            Answer::of(write, result)
        })
    }

    /// `write` is stored.
    pub(crate) fn stored(&mut self, write: Write) {
        self.written = self.written.max(Some(write.to));
        if write.complete_through.is_some() {
            self.floor = self.floor.max(write.complete_through);
        }
    }

    /// `write` failed: its position is written again unless a newer one waits.
    pub(crate) fn failed(&mut self, write: Write) {
        if self.pending.is_none_or(|p| p < write.to) {
            self.pending = Some(write.to);
        }
    }

    /// For an idle, caught-up shard: raises `completeThrough` alone, at most once per frontier
    /// interval, and only with a clock-skew allowance configured. `Err(Lost)`: the lease is lost.
    pub(crate) async fn maybe_advance_frontier(
        &mut self,
        tracker: &Tracker<Entry>,
        writing: bool,
    ) -> Result<(), Lost> {
        if self.caught_up_skew.is_none()
            || self.pending.is_some()
            || writing
            || !tracker.is_drained()
            || self
                .frontier_written_at
                .is_some_and(|t| t.elapsed() < self.frontier_interval)
        {
            return Ok(());
        }
        let Some(ct) = self.complete_through(tracker) else {
            return Ok(());
        };
        if self.floor.is_some_and(|f| f >= ct) {
            return Ok(());
        }
        self.frontier_written_at = Some(Instant::now());
        match self.store.advance_frontier(&self.ownership, ct).await {
            Ok(CheckpointWrite::Written) => {
                self.floor = Some(ct);
                Ok(())
            }
            Ok(CheckpointWrite::NotNewer) => Ok(()),
            Ok(CheckpointWrite::Lost) => Err(Lost),
            Err(e) => {
                warn!(shard = %self.ownership.shard_id, error = &e as &dyn std::error::Error, "frontier write failed; will retry");
                Ok(())
            }
        }
    }
}
