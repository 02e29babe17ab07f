//! Seek: move a stream's (or one shard's) checkpoints to a new place, backwards too.
//!
//! A seek is the only write that may move a checkpoint backwards. Each moved row is written with
//! one conditional update on its seek epoch that also bumps the ownership epoch and removes the
//! owner: the worker reading the shard loses its lease at its next renewal (or at once, on its
//! next checkpoint write, which the store now refuses), nothing it settles afterwards can write,
//! and the next owner reads from the new place with a fresh tracker. It works the same whether
//! consumers run or not, from any process.

use std::collections::HashSet;
use std::time::SystemTime;

use crate::error::Error;
use crate::lease::{Checkpoint, InitialPosition, LeaseStore};
use crate::position::Position;
use crate::shard::discovery::ShardLister;

/// Where to move to.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SeekTarget {
    /// Every shard to its oldest retained record.
    TrimHorizon,
    /// Every open shard to its tip (closed shards are marked ended).
    Latest,
    /// Every shard to the first record that arrived at or after this time.
    Timestamp(SystemTime),
    /// One shard to this record (inclusive): a captured delivery's
    /// [`position`](crate::Delivery::position).
    Position {
        /// The shard.
        shard_id: String,
        /// The record to read first.
        position: Position,
    },
}

/// What a seek moved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SeekReport {
    /// The shards whose checkpoint was rewritten.
    pub moved: Vec<String>,
}

/// Rows are sought with their seek epoch as seen; a concurrent seek makes us read and try again.
const ATTEMPTS: usize = 5;

/// Moves the checkpoints of `stream` in `store` to `target`. Lists the shards first and creates rows
/// for shards that have none, so a stream-wide seek covers every shard the stream has now.
pub async fn seek(
    store: &dyn LeaseStore,
    lister: &dyn ShardLister,
    stream: &str,
    target: &SeekTarget,
) -> Result<SeekReport, Error> {
    let shards = lister.list_shards(stream).await?;
    store.prepare().await?;
    let rows = store.list(stream).await?;
    let existing: HashSet<String> = rows.iter().map(|r| r.shard_id.clone()).collect();
    let initial = match target {
        SeekTarget::Latest => InitialPosition::Latest,
        SeekTarget::Timestamp(t) => InitialPosition::AtTimestamp(*t),
        _ => InitialPosition::TrimHorizon,
    };
    for new in crate::lease::new_leases(stream, &shards, &existing, initial) {
        store.create(&new).await?;
    }
    let closed: HashSet<&str> = shards
        .iter()
        .filter(|s| s.closed)
        .map(|s| s.shard_id.as_str())
        .collect();

    let targets: Vec<(String, Checkpoint)> = match target {
        SeekTarget::Position { shard_id, position } => {
            if !shards.iter().any(|s| &s.shard_id == shard_id) {
                return Err(Error::Corrupt {
                    what: "seek target",
                    detail: format!("stream `{stream}` has no shard `{shard_id}`"),
                });
            }
            vec![(shard_id.clone(), Checkpoint::Before(*position))]
        }
        stream_wide => shards
            .iter()
            .map(|s| {
                let to = match stream_wide {
                    SeekTarget::TrimHorizon => Checkpoint::TrimHorizon,
                    SeekTarget::Latest if closed.contains(s.shard_id.as_str()) => {
                        Checkpoint::ShardEnd
                    }
                    SeekTarget::Latest => Checkpoint::Latest,
                    SeekTarget::Timestamp(t) => Checkpoint::AtTimestamp(*t),
                    SeekTarget::Position { .. } => unreachable!("handled above"),
                };
                (s.shard_id.clone(), to)
            })
            .collect(),
    };

    let mut report = SeekReport::default();
    for (shard_id, to) in targets {
        for attempt in 1..=ATTEMPTS {
            let Some(row) = store.get(stream, &shard_id).await? else {
                break;
            };
            if store.seek(&row, &to).await? {
                tracing::info!(stream, shard = %shard_id, to = %to, "seek: checkpoint moved");
                report.moved.push(shard_id.clone());
                break;
            }
            if attempt == ATTEMPTS {
                return Err(Error::Corrupt {
                    what: "seek",
                    detail: format!(
                        "shard `{shard_id}` kept changing seek epoch; another seek is running"
                    ),
                });
            }
        }
    }
    Ok(report)
}
