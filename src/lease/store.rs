//! The lease store: the conditional writes every lease operation is made of.

use std::collections::BTreeMap;
use std::fmt;

use futures::future::BoxFuture;

use super::row::{Checkpoint, Lease, NewLease, Ownership};
use crate::error::Error;
use crate::frontier::{Membership, SkippedRange};
use crate::paged::PagedProgress;

/// What a fenced checkpoint write did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CheckpointWrite {
    /// Stored.
    Written,
    /// Refused: the lease is still ours but the stored checkpoint is at or past this one (a
    /// duplicate or a late write). Nothing changed.
    NotNewer,
    /// Refused: the lease is no longer held by this owner under this epoch. Nothing changed; the
    /// shard's work must stop.
    Lost,
}

/// What a renewal found.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Renewal {
    /// The heartbeat moved; the lease is still ours. `wanted_by` is the row's handoff request as
    /// written (the store returns the row with the write, so noticing a request costs no read).
    Renewed {
        /// A worker that asked for the lease, if any.
        wanted_by: Option<String>,
    },
    /// Refused: another owner or epoch holds the lease.
    Lost,
}

impl Renewal {
    /// Whether the lease is still ours.
    pub fn is_renewed(&self) -> bool {
        matches!(self, Renewal::Renewed { .. })
    }
}

/// The workers of one stream, or of one section of them, as their beats tell (the items
/// `~workers#<stream>` and, once the roster is split, `~workers#<stream>#<section>`; see
/// `docs/leases.md`): each worker's beat, and a counter raised when rows were added.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Roster {
    /// Beat by worker id: a value its worker changes at every beat (the lease manager's counter,
    /// tagged with its process; see `docs/leases.md`).
    pub beats: BTreeMap<String, u64>,
    /// Raised by a worker announcing something every worker should scan for (rows created, a
    /// lease released or lost).
    pub changes: u64,
    /// The first worker that ever beat in this roster: on the stream's first start, the one
    /// worker that creates the rows at once.
    pub founder: Option<String>,
    /// The beat the beating worker's entry held before this beat (`None`: no entry). The lease
    /// manager reads from it which process wrote it: another process than itself, after its
    /// first beat, means a second process beats under the same worker id.
    pub beat_before: Option<u64>,
    /// In section 0 only: how many sections the roster is split into (1 until it is split).
    /// `None` in the other sections.
    pub sections: Option<u32>,
}

/// One row of a seek: the row as seen and where its checkpoint goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeekMove {
    /// The row as read before the seek; its seek epoch conditions the write.
    pub seen: Lease,
    /// The new checkpoint.
    pub to: Checkpoint,
    /// For a paged partition, its new cursor and applied position; the store sets the version to
    /// the stored one + 1 (whatever this says), so a page fetched before the seek cannot pass its
    /// barrier.
    pub progress: Option<PagedProgress>,
    /// What the row records as skipped by seeks once this one is written (`seekSkipped`): the
    /// range this seek skips when it moves the row forward (widened over an earlier one it does
    /// not read again), the earlier one when it does not move forward, `None` once nothing
    /// skipped is left unread. [`seek`](crate::seek) decides it; the store writes it as given.
    pub skipped: Option<SkippedRange>,
}

/// Whether a paged progress write holds on a row whose stored progress is `stored`: the stored
/// cursor and version are `expected`'s (the compare-and-swap on the page attempt), and the applied
/// position does not go down. An applied-only write (same version) must raise it; a barrier (the
/// next version) may leave it. Any other version is refused.
pub(crate) fn paged_write_holds(
    stored: Option<&PagedProgress>,
    expected: &PagedProgress,
    to: &PagedProgress,
) -> bool {
    let default = PagedProgress::default();
    let stored = stored.unwrap_or(&default);
    let attempt = stored.checkpoint_version == expected.checkpoint_version
        && stored.resume_cursor == expected.resume_cursor
        && stored.closed_through == expected.closed_through;
    let applied = match (&stored.applied_position, &to.applied_position) {
        (None, _) => true,
        (Some(_), None) => false,
        (Some(old), Some(new)) if to.checkpoint_version == expected.checkpoint_version => new > old,
        (Some(old), Some(new)) => new >= old,
    };
    attempt && applied && paged_write_is_of_the_attempt(expected, to)
}

/// Whether `to` is a write of the attempt `expected` at all: the same cursor and closed timestamp
/// with a higher applied position, or a barrier (version + 1) whose closed timestamp does not go
/// back. Both stores refuse anything else as not newer without asking the row.
pub(crate) fn paged_write_is_of_the_attempt(expected: &PagedProgress, to: &PagedProgress) -> bool {
    if to.checkpoint_version == expected.checkpoint_version {
        to.resume_cursor == expected.resume_cursor && to.closed_through == expected.closed_through
    } else {
        to.checkpoint_version == expected.checkpoint_version + 1
            && to.closed_through >= expected.closed_through
    }
}

/// The most rows one seek moves at once (DynamoDB's limit on items in one transaction): a shard
/// and its descendants, or one lineage of a stream.
pub const MAX_SEEK_MOVES: usize = 100;

/// Where leases live: DynamoDB in production, memory for tests and simulation.
///
/// Every method is one conditional request (see `docs/leases.md`); a failed condition is a typed
/// answer, never an error. Errors are for the store being unreachable or the table being unusable.
/// Cancelling a returned future is safe: the request either reached the store or did not, and every
/// write is conditioned so that repeating it cannot do harm.
pub trait LeaseStore: Send + Sync + fmt::Debug + 'static {
    /// Makes sure the table exists with the right key schema (creating it when the store was
    /// configured to), or fails naming the table and what is wrong.
    fn prepare(&self) -> BoxFuture<'_, Result<(), Error>>;

    /// Every lease row of `stream`, read consistently.
    fn list<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<Vec<Lease>, Error>>;

    /// One lease row, read consistently.
    fn get<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Lease>, Error>>;

    /// Creates a row if none exists for the shard. `false` when one already did.
    fn create<'a>(&'a self, lease: &'a NewLease) -> BoxFuture<'a, Result<bool, Error>>;

    /// Takes a lease for `owner`, conditioned on the counter and owner observed in `seen`: an
    /// unowned lease, an expired one, or a steal from a live owner. Returns the new row, or `None`
    /// when the lease changed since it was observed (someone else renewed or took it).
    fn take<'a>(
        &'a self,
        seen: &'a Lease,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Option<Lease>, Error>>;

    /// Bumps the heartbeat of a held lease, returning the handoff request the row carries.
    fn renew<'a>(&'a self, held: &'a Ownership) -> BoxFuture<'a, Result<Renewal, Error>>;

    /// Moves the checkpoint forward, fenced by owner and epoch and by the stored `checkpointKey`
    /// being lower than the new one. `complete_through` (ms) is written with it when given.
    fn checkpoint<'a>(
        &'a self,
        held: &'a Ownership,
        to: &'a Checkpoint,
        complete_through: Option<i64>,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>>;

    /// [`checkpoint`](Self::checkpoint) for a shard read on tumbling windows: also sets the row's
    /// window state to `window` (removes it for `None`), in the same write. Fenced as
    /// `checkpoint` is, but a position equal to the stored one is written too (a window that
    /// closed with nothing more settled). The default refuses: a store must keep the state to
    /// serve windows.
    fn checkpoint_window<'a>(
        &'a self,
        held: &'a Ownership,
        to: &'a Checkpoint,
        complete_through: Option<i64>,
        window: Option<&'a crate::window::WindowState>,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        let _ = (to, complete_through, window);
        Box::pin(async move {
            Err(Error::Config(crate::error::ConfigError::new(
                "tumbling_window",
                held.key(),
                "this lease store keeps no tumbling-window state",
            )))
        })
    }

    /// Writes a paged partition's progress, fenced by owner and epoch and conditioned on the page
    /// attempt: the stored `resumeCursor` and `checkpointVersion` are `expected`'s. Either `to` keeps
    /// the cursor and version and raises `appliedPosition` (the settled prefix grew), or it is a
    /// page barrier: a new cursor, version + 1, the applied position not lower. `NotNewer`: the
    /// lease is ours but the attempt is stale (the cursor or version moved, the applied position is
    /// not newer); the caller rereads the row rather than overwrite newer progress.
    fn paged_checkpoint<'a>(
        &'a self,
        held: &'a Ownership,
        expected: &'a PagedProgress,
        to: &'a PagedProgress,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>>;

    /// Gives a held lease up so another worker can take it at once. `false`: it was already lost.
    fn release<'a>(&'a self, held: &'a Ownership) -> BoxFuture<'a, Result<bool, Error>>;

    /// Retires a held paged partition that went idle: `retiredAt` = `at` (the ingestion time
    /// through which the partition was read), owner removed, counter + 1, any handoff request
    /// removed; fenced by owner and epoch, and refused on a row at SHARD_END. Call it after the
    /// final progress write. Nobody takes a retired row until its source lists activity after
    /// `at` (or stops listing it); a take or a seek removes `retiredAt`. `false`: the lease was
    /// lost (nothing changed).
    fn retire<'a>(&'a self, held: &'a Ownership, at: i64) -> BoxFuture<'a, Result<bool, Error>>;

    /// Moves checkpoints, backwards too: the only write that may. Every move is applied or none
    /// is (one transaction), each conditioned on the seek epoch of the row as seen. Each moved row
    /// gets its seek epoch and ownership epoch bumped and its owner removed, so the worker reading
    /// the shard loses the lease (and no settlement read before the seek can write), and the next
    /// owner reads from the new place. Each moved row's `seekSkipped` becomes its move's
    /// `skipped` (removed when `None`). `false`: a row changed seek epoch since it was seen, and
    /// nothing was written.
    fn seek<'a>(&'a self, moves: &'a [SeekMove]) -> BoxFuture<'a, Result<bool, Error>>;

    /// Raises `completeThrough` (ms) without moving the checkpoint: for a caught-up, idle shard.
    /// Fenced by owner and epoch, and only upwards (`NotNewer` when the stored value is as high).
    fn advance_frontier<'a>(
        &'a self,
        held: &'a Ownership,
        complete_through: i64,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>>;

    /// Deletes the row of a shard that reached SHARD_END, conditioned on it still being at
    /// SHARD_END with the counter seen in `seen` (nobody touched it since). `false` otherwise.
    fn delete<'a>(&'a self, seen: &'a Lease) -> BoxFuture<'a, Result<bool, Error>>;

    /// Records the children of a closed shard (lineage only; not fenced).
    fn set_children<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
        children: &'a [String],
    ) -> BoxFuture<'a, Result<(), Error>>;

    /// Asks the owner of `seen` to hand the lease to `taker` (cooperative handoff): sets
    /// `wantedBy`, conditioned on the owner and epoch seen and on no request being pending. The
    /// owner keeps the lease (its renewals and checkpoints are unaffected). `false` when the
    /// condition failed.
    fn request<'a>(&'a self, seen: &'a Lease, taker: &'a str)
    -> BoxFuture<'a, Result<bool, Error>>;

    /// Hands a held lease to the worker that asked for it: owner = `taker`, epoch + 1, counter + 1,
    /// `wantedBy` removed; conditioned on the owner, the epoch and `wantedBy = taker`. Call it
    /// after the final checkpoint. `false` when the condition failed (the lease was lost, or the
    /// request is gone).
    fn pass<'a>(
        &'a self,
        held: &'a Ownership,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>>;

    /// Acknowledges the handoff request of `taker` on a held lease: `handoffAck` set, conditioned
    /// on the owner, the epoch and `wantedBy = taker`. The taker counts its patience from when
    /// it sees the acknowledgement, not from its request. `false` when the condition failed.
    fn acknowledge<'a>(
        &'a self,
        held: &'a Ownership,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>>;

    /// Sets `worker`'s beat in `section` of the roster of `stream` to `beat` (creating the
    /// section's item or the entry when missing; the caller writes a new value each time), raises
    /// the section's `changes` by one when `announce`, and records `worker` as the section's
    /// founder when it has none; unconditional. Returns the section as written, with the beat the
    /// entry held before ([`Roster::beat_before`]), so reading it costs no read.
    fn beat<'a>(
        &'a self,
        stream: &'a str,
        section: u32,
        worker: &'a str,
        beat: u64,
        announce: bool,
    ) -> BoxFuture<'a, Result<Roster, Error>>;

    /// Removes `worker` from `section` of the roster of `stream`: when `seen` is given only if its
    /// beat is still that value (a dead worker, forgotten by another; a worker's entry in the
    /// section it moved from), else unconditionally, raising the section's `changes` too (a worker
    /// leaving: every worker scans, even one that sees it back before it saw it gone). `false`
    /// when the condition failed.
    fn forget<'a>(
        &'a self,
        stream: &'a str,
        section: u32,
        worker: &'a str,
        seen: Option<u64>,
    ) -> BoxFuture<'a, Result<bool, Error>>;

    /// Reads `sections` of the roster of `stream` (strongly consistent), in that order; a
    /// section with no item reads as an empty roster.
    fn read_roster<'a>(
        &'a self,
        stream: &'a str,
        sections: &'a [u32],
    ) -> BoxFuture<'a, Result<Vec<Roster>, Error>>;

    /// Splits the roster of `stream` from `from` sections into `to`: section 0's `sections` is
    /// set to `to`, conditioned on it being `from` (absent counting as 1). `false` when another
    /// worker changed it first.
    fn split_roster<'a>(
        &'a self,
        stream: &'a str,
        from: u32,
        to: u32,
    ) -> BoxFuture<'a, Result<bool, Error>>;

    /// Raises the roster's `changes` of `stream` by one (in section 0), so that every worker
    /// scans at its next beat (a seek announces the rows it moved). By default through
    /// [`forget`](Self::forget) of a worker id no worker has (`~announce`).
    fn announce<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            self.forget(stream, 0, "~announce", None).await?;
            Ok(())
        })
    }

    /// The frontier membership published for `stream`, if any (read consistently).
    fn membership<'a>(
        &'a self,
        stream: &'a str,
    ) -> BoxFuture<'a, Result<Option<Membership>, Error>>;

    /// Publishes `next` as the frontier membership of `stream` if the stored one still has the
    /// epoch `expected` (`None`: none is stored). `false` when another writer published first.
    fn publish_membership<'a>(
        &'a self,
        stream: &'a str,
        expected: Option<u64>,
        next: &'a Membership,
    ) -> BoxFuture<'a, Result<bool, Error>>;
}

#[allow(dead_code)]
fn _object_safe(_: &dyn LeaseStore) {}
