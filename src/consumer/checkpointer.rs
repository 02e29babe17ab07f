//! A shard's checkpoint writes: coalesced (at most one in flight, at most one started per
//! checkpoint interval, none for an idle shard) and fenced by the store (owner, ownership epoch,
//! and a position greater than the stored one). It also raises the frontier coordinate of an idle,
//! caught-up shard when a clock-skew allowance is configured.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::checkpoint::Checkpoint;
use crate::error::Error;
use crate::frontier::{self, ShardProgress};
use crate::lease::{CheckpointWrite, LeaseStore, Ownership};
use crate::position::Position;
use crate::track::Tracker;

/// A tracked delivery: its position and arrival time (ms).
pub(crate) type Entry = (Position, Option<i64>);

pub(crate) struct Checkpointer {
    pub(crate) store: Arc<dyn LeaseStore>,
    pub(crate) ownership: Ownership,
    /// Settled through here but not yet written.
    pub(crate) pending: Option<Position>,
    pub(crate) in_flight: Option<InFlight>,
    pub(crate) labels: [(&'static str, String); 2],
    /// Frontier inputs besides the tracker (see `frontier::complete_through`).
    pub(crate) last_settled: Option<i64>,
    pub(crate) caught_up_at: Option<i64>,
    /// The stored `completeThrough`: what this shard's coordinate never goes below.
    pub(crate) floor: Option<i64>,
    pub(crate) caught_up_skew: Option<Duration>,
    pub(crate) frontier_interval: Duration,
    pub(crate) frontier_written_at: Option<Instant>,
    /// This shard's slot on the health board.
    pub(crate) health: super::health::Entry,
}

pub(crate) struct InFlight {
    pub(crate) to: Position,
    pub(crate) complete_through: Option<i64>,
    pub(crate) handle: JoinHandle<Result<CheckpointWrite, Error>>,
}

impl Checkpointer {
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

    fn start(&mut self, to: Position, complete_through: Option<i64>) {
        let store = self.store.clone();
        let ownership = self.ownership.clone();
        self.in_flight = Some(InFlight {
            to,
            complete_through,
            handle: tokio::spawn(async move {
                store
                    .checkpoint(&ownership, &Checkpoint::At(to), complete_through)
                    .await
            }),
        });
    }

    /// Starts a write of the pending position if none is in flight.
    pub(crate) fn maybe_start(&mut self, tracker: &Tracker<Entry>) {
        if self.in_flight.is_none()
            && let Some(to) = self.pending.take()
        {
            let ct = self.complete_through(tracker);
            self.start(to, ct);
        }
    }

    /// For an idle, caught-up shard: raises `completeThrough` alone, at most once per frontier
    /// interval, and only with a clock-skew allowance configured. `Err(())`: the lease is lost.
    pub(crate) async fn maybe_advance_frontier(
        &mut self,
        tracker: &Tracker<Entry>,
    ) -> Result<(), ()> {
        if self.caught_up_skew.is_none()
            || self.pending.is_some()
            || self.in_flight.is_some()
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
            Ok(CheckpointWrite::Lost) => Err(()),
            Err(e) => {
                warn!(shard = %self.ownership.shard_id, error = &e as &dyn std::error::Error, "frontier write failed; will retry");
                Ok(())
            }
        }
    }

    /// Waits for the write in flight. `Err(())`: the lease is lost.
    async fn finish(&mut self) -> Result<(), ()> {
        let Some(write) = self.in_flight.take() else {
            return Ok(());
        };
        let result = write.handle.await.unwrap_or_else(|e| {
            Err(Error::Corrupt {
                what: "checkpoint task",
                detail: e.to_string(),
            })
        });
        self.record(write.to, write.complete_through, result)
    }

    pub(crate) fn record(
        &mut self,
        to: Position,
        complete_through: Option<i64>,
        result: Result<CheckpointWrite, Error>,
    ) -> Result<(), ()> {
        match result {
            Ok(CheckpointWrite::Written) => {
                self.health.written(self.pending.is_some());
                metrics::counter!("shardwise_checkpoint_writes_total", &self.labels).increment(1);
                debug!(shard = %self.ownership.shard_id, checkpoint = %to, ?complete_through, "checkpoint written");
                if complete_through.is_some() {
                    self.floor = self.floor.max(complete_through);
                }
                Ok(())
            }
            Ok(CheckpointWrite::NotNewer) => {
                self.health.written(self.pending.is_some());
                debug!(shard = %self.ownership.shard_id, checkpoint = %to, "checkpoint not newer than the stored one");
                Ok(())
            }
            Ok(CheckpointWrite::Lost) => Err(()),
            Err(e) => {
                warn!(shard = %self.ownership.shard_id, error = &e as &dyn std::error::Error, "checkpoint write failed; will retry");
                if self.pending.is_none_or(|p| p < to) {
                    self.pending = Some(to);
                }
                Ok(())
            }
        }
    }

    /// Writes everything settled, waiting for it. `Err(())`: the lease is lost.
    pub(crate) async fn flush(&mut self, tracker: &Tracker<Entry>) -> Result<(), ()> {
        self.finish().await?;
        for _ in 0..3 {
            let Some(to) = self.pending.take() else {
                return Ok(());
            };
            let ct = self.complete_through(tracker);
            let result = self
                .store
                .checkpoint(&self.ownership, &Checkpoint::At(to), ct)
                .await;
            self.record(to, ct, result)?;
        }
        Ok(())
    }
}
