//! The lease row and the values it carries.

pub use crate::checkpoint::{Checkpoint, InitialPosition};
use crate::frontier::SkippedRange;
use crate::paged::PagedProgress;

/// One lease row as read from the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The stream.
    pub stream: String,
    /// The shard.
    pub shard_id: String,
    /// The worker holding the lease, if any.
    pub owner: Option<String>,
    /// The heartbeat: +1 on every take, renew and release.
    pub counter: u64,
    /// The fencing token: +1 on every change of owner and every seek.
    pub owner_epoch: u64,
    /// Where reading stands.
    pub checkpoint: Checkpoint,
    /// Parent shards (one for a split child, two for a merge child).
    pub parents: Vec<String>,
    /// Child shards, once known.
    pub children: Vec<String>,
    /// Arrival time (ms) through which every record of the shard has a durable outcome.
    pub complete_through: Option<i64>,
    /// +1 on every seek.
    pub seek_epoch: u64,
    /// What forward seeks skipped on this row, once one did (`seekSkipped`; absent on rows no
    /// seek moved forward, and on rows written before it existed).
    pub seek_skipped: Option<SkippedRange>,
    /// When the last seek moved the row (ms since the epoch, by the seeking host's clock;
    /// `soughtAt`): a terminal receipt recorded before it is of an event the seek asked to read
    /// again, so it does not stop the event from being handled.
    pub sought_at: Option<i64>,
    /// A paged partition's progress (`None` for a Kinesis shard, and for a partition that has
    /// written none yet: it reads from its first page).
    pub progress: Option<PagedProgress>,
    /// A worker that asked the owner to hand the lease over (cooperative handoff); cleared by
    /// every take, release and pass.
    pub wanted_by: Option<String>,
    /// The owner acknowledged the request of `wanted_by` (`handoffAck`): it is draining the
    /// lease, and the taker counts its patience from when it saw this. Cleared with the request.
    pub handoff_acked: bool,
    /// A paged partition retired while idle (`retiredAt`: the provider's ingestion time, ms,
    /// through which everything of the partition was read, audits included): nobody holds it,
    /// renews it or reads it until the source lists activity after this time (see
    /// [`LeaseStore::retire`](super::LeaseStore::retire)). Every take and seek removes it.
    pub retired_at: Option<i64>,
    /// A shard read on tumbling windows: the open window and its state after the records through
    /// the checkpoint (`windowStart`, `windowEnd`, `windowState`; see [`crate::window`]).
    /// Written with the checkpoints; removed by a window's final call, SHARD_END and a seek.
    pub window: Option<crate::window::WindowState>,
}

impl Lease {
    /// The row key: `stream#shardId`.
    pub fn key(&self) -> String {
        lease_key(&self.stream, &self.shard_id)
    }

    /// The shard as the stream frontier sees it.
    pub(crate) fn coordinate(&self) -> crate::frontier::ShardCoordinate<'_> {
        crate::frontier::ShardCoordinate {
            shard_id: &self.shard_id,
            complete_through: match &self.progress {
                Some(progress) => progress.closed_through,
                None => self.complete_through,
            },
            ended: self.checkpoint.is_shard_end(),
            children: &self.children,
            parents: &self.parents,
            paged: self.progress.is_some(),
            from_start: self.seek_epoch == 0 || !self.parents.is_empty(),
            seek_epoch: self.seek_epoch,
            skipped: self.seek_skipped.as_ref(),
        }
    }

    /// The ownership this row grants, if `owner` holds it.
    pub fn ownership(&self) -> Option<Ownership> {
        self.owner.as_ref().map(|owner| Ownership {
            stream: self.stream.clone(),
            shard_id: self.shard_id.clone(),
            owner: owner.clone(),
            epoch: self.owner_epoch,
        })
    }
}

/// The row key for a shard of a stream.
pub(crate) fn lease_key(stream: &str, shard_id: &str) -> String {
    format!("{stream}#{shard_id}")
}

/// A row to create for a shard that has none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewLease {
    /// The stream.
    pub stream: String,
    /// The shard.
    pub shard_id: String,
    /// Where reading starts.
    pub checkpoint: Checkpoint,
    /// Parent shards.
    pub parents: Vec<String>,
}

/// Proof of holding a lease: every fenced write names the owner and the epoch it was taken under.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Ownership {
    /// The stream.
    pub stream: String,
    /// The shard.
    pub shard_id: String,
    /// The worker that holds it.
    pub owner: String,
    /// The ownership epoch it was taken under.
    pub epoch: u64,
}

impl Ownership {
    /// The row key.
    pub fn key(&self) -> String {
        lease_key(&self.stream, &self.shard_id)
    }
}
