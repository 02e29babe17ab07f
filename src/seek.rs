//! Seek: move a stream's (or one shard's) checkpoints to a new place, backwards too.
//!
//! A seek is the only write that may move a checkpoint backwards. Each moved row is conditioned on
//! its seek epoch, and the write also bumps the ownership epoch and removes the owner: the worker
//! reading the shard loses its lease at its next renewal (or at once, on its next checkpoint
//! write, which the store now refuses), nothing it settles afterwards can write, and the next owner
//! reads from the new place with a fresh tracker. It works the same whether consumers run or not,
//! from any process.
//!
//! Parents are read before their children, so a seek never moves a parent alone while its
//! children are read: every shard moves together with its descendants, in one transaction
//! ([`LeaseStore::seek`]).
//! - A seek of one shard to a record resets every descendant to its trim horizon: once the parent
//!   has been read again from the record to its end, the children are read again from their start.
//! - A stream-wide seek moves each lineage (a shard with its ancestors and descendants) at once.
//!
//! So no worker ever finds a parent open while a child of it holds a newer checkpoint.

use std::collections::{BTreeMap, BTreeSet};
use std::time::SystemTime;

use crate::checkpoint::Checkpoint;
use crate::error::{ConfigError, Error};
use crate::frontier::{SeekCoordinate, SkippedRange};
use crate::lease::{InitialPosition, Lease, LeaseStore, MAX_SEEK_MOVES, NewLease, SeekMove};
use crate::paged::{PagedProgress, PagedSource};
use crate::position::Position;
use crate::shard::discovery::{ShardInfo, ShardLister};
use crate::time::millis;

/// Where to move to.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SeekTarget {
    /// Every shard to its oldest retained record.
    TrimHorizon,
    /// Every open shard to its tip as of the seek: pinned to the time of the seek less
    /// [`DEFAULT_LATEST_MARGIN`](crate::consumer::DEFAULT_LATEST_MARGIN), so every record written
    /// after the seek is delivered, whenever the shard is next read. Closed shards are marked
    /// ended.
    Latest,
    /// Every shard to the first record that arrived at or after this time.
    Timestamp(SystemTime),
    /// One shard to this record (inclusive): a captured delivery's
    /// [`position`](crate::Delivery::position). Its descendants are reset to their start.
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
    /// The shards whose checkpoint was rewritten, descendants of a shard sought to a record
    /// included.
    pub moved: Vec<String>,
}

/// Rows are sought with their seek epoch as seen; a concurrent seek makes us read and try again.
const ATTEMPTS: usize = 5;

/// Moves the checkpoints of `stream` in `store` to `target`. Lists the shards first and creates rows
/// for shards that have none, so a stream-wide seek covers every shard the stream has now.
///
/// Cancellation safe: each group of rows moves in one write; a dropped call leaves some groups
/// moved and others not.
pub async fn seek(
    store: &dyn LeaseStore,
    lister: &dyn ShardLister,
    stream: &str,
    target: &SeekTarget,
) -> Result<SeekReport, Error> {
    let shards = lister.list_shards(stream).await?;
    store.prepare().await?;
    let rows = store.list(stream).await?;
    let existing = rows.iter().map(|r| r.shard_id.clone()).collect();
    let initial = match target {
        SeekTarget::Latest => InitialPosition::Latest,
        SeekTarget::Timestamp(t) => InitialPosition::AtTimestamp(*t),
        _ => InitialPosition::TrimHorizon,
    };
    for new in crate::lease::new_leases(stream, &shards, &existing, initial) {
        store.create(&new).await?;
    }
    let rows = store.list(stream).await?;
    // The service's time, from the listing's answer: an operator's clock may run ahead.
    let latest = lister
        .service_time()
        .unwrap_or_else(crate::time::now)
        .checked_sub(crate::consumer::DEFAULT_LATEST_MARGIN)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let groups = plan(stream, target, &shards, &rows, latest)?;

    let mut report = SeekReport::default();
    for group in groups {
        let group: Vec<Move> = group
            .into_iter()
            .map(|(shard, to)| {
                let target = target_of(&to);
                (shard, to, None, target)
            })
            .collect();
        move_group(store, stream, &group).await?;
        for (shard_id, to, ..) in &group {
            tracing::info!(stream, shard = %shard_id, to = %to, "seek: checkpoint moved");
        }
        report
            .moved
            .extend(group.into_iter().map(|(shard, ..)| shard));
    }
    Ok(report)
}

/// Moves every partition of a paged source to `target`, each partition alone (partitions have no
/// lineage). [`SeekTarget::TrimHorizon`]: from the first page, nothing applied.
/// [`SeekTarget::Timestamp`]: from the cursor the source gives for that time
/// ([`PagedSource::cursor_at`]); a source that cannot start at a time refuses. A source read by
/// timestamp is closed through the millisecond before the time (nothing closed, at the trim
/// horizon), so its next poll reads every event at or after it. The version of each row is bumped,
/// so no page fetched (or close proposed) before the seek is written after it. Rows are created
/// for partitions without one.
pub async fn seek_paged(
    store: &dyn LeaseStore,
    source: &dyn PagedSource,
    target: &SeekTarget,
) -> Result<SeekReport, Error> {
    let stream = source.name();
    let partitions = source.partitions().await?;
    let mut moves: Vec<Move> = Vec::with_capacity(partitions.len());
    let by_time = source.contract().timestamps.is_some();
    for partition in &partitions {
        // A source read by timestamp resumes strictly after `closedThrough`: a seek to a time
        // closes through the millisecond before it.
        if by_time {
            let closed_through = match target {
                SeekTarget::TrimHorizon => None,
                SeekTarget::Timestamp(t) => Some(crate::time::millis(*t) - 1),
                _ => {
                    return Err(ConfigError::new(
                        "seek",
                        target,
                        "a paged source seeks to trim-horizon or to a time",
                    )
                    .into());
                }
            };
            let progress = PagedProgress {
                closed_through,
                ..PagedProgress::default()
            };
            moves.push((
                partition.clone(),
                Checkpoint::TrimHorizon,
                Some(progress),
                paged_target(target),
            ));
            continue;
        }
        let resume_cursor = match target {
            SeekTarget::TrimHorizon => None,
            SeekTarget::Timestamp(t) => Some(source.cursor_at(partition, *t).ok_or_else(|| {
                ConfigError::new(
                    "seek",
                    target,
                    format!("source `{stream}` cannot start at a time"),
                )
            })?),
            _ => {
                return Err(ConfigError::new(
                    "seek",
                    target,
                    "a paged source seeks to trim-horizon or to a time",
                )
                .into());
            }
        };
        let progress = PagedProgress {
            resume_cursor,
            ..PagedProgress::default()
        };
        moves.push((
            partition.clone(),
            Checkpoint::TrimHorizon,
            Some(progress),
            paged_target(target),
        ));
    }
    store.prepare().await?;
    let existing: BTreeSet<String> = store
        .list(stream)
        .await?
        .into_iter()
        .map(|r| r.shard_id)
        .collect();
    for partition in partitions.iter().filter(|p| !existing.contains(*p)) {
        store
            .create(&NewLease {
                stream: stream.to_string(),
                shard_id: partition.clone(),
                checkpoint: Checkpoint::TrimHorizon,
                parents: Vec::new(),
            })
            .await?;
    }
    let mut report = SeekReport::default();
    for m in moves {
        move_group(store, stream, std::slice::from_ref(&m)).await?;
        tracing::info!(source = stream, partition = %m.0, cursor = ?m.2.as_ref().and_then(|p| p.resume_cursor.as_ref()), closed_through = ?m.2.as_ref().and_then(|p| p.closed_through), "seek: partition moved");
        report.moved.push(m.0);
    }
    Ok(report)
}

/// One row of a group to move: the shard, its new checkpoint, a paged partition's new progress,
/// and where that is in the row's records (for the range a forward move skips).
type Move = (String, Checkpoint, Option<PagedProgress>, SeekCoordinate);

/// Moves one group of rows at once, reading them again when a concurrent seek got in between.
async fn move_group(store: &dyn LeaseStore, stream: &str, group: &[Move]) -> Result<(), Error> {
    for _ in 0..ATTEMPTS {
        let mut moves = Vec::with_capacity(group.len());
        for (shard_id, to, progress, target) in group {
            // A row that vanished meanwhile (cleaned up as aged out) has nothing left to move.
            if let Some(seen) = store.get(stream, shard_id).await? {
                let skipped = skipped_after(&seen, to, target);
                if let Some(range) = skipped.as_ref().filter(|r| r.seek_epoch > seen.seek_epoch) {
                    tracing::warn!(stream, shard = %shard_id, from = %range.from, to = %range.to, seek_epoch = range.seek_epoch, "seek: moved forward; the records between are skipped (reported by the frontier as skipped_by_seek)");
                }
                moves.push(SeekMove {
                    seen,
                    to: to.clone(),
                    progress: progress.clone(),
                    skipped,
                });
            }
        }
        if store.seek(&moves).await? {
            // The rows are free now: every worker scans at its next beat (an owner also learns
            // it at its next renewal, refused).
            if let Err(e) = store.announce(stream).await {
                tracing::warn!(
                    stream,
                    error = &e as &dyn std::error::Error,
                    "seek: announcing the moved rows failed; workers find them at their next scan"
                );
            }
            return Ok(());
        }
    }
    let shards: Vec<&str> = group.iter().map(|(s, ..)| s.as_str()).collect();
    Err(Error::Corrupt {
        what: "seek",
        detail: format!("shards {shards:?} kept changing seek epoch; another seek is running"),
    })
}

/// Where a Kinesis checkpoint written by a seek is, as a skipped range names it.
fn target_of(to: &Checkpoint) -> SeekCoordinate {
    match to {
        Checkpoint::TrimHorizon => SeekCoordinate::Start,
        Checkpoint::AtTimestamp(t) => SeekCoordinate::Time(millis(*t)),
        Checkpoint::ShardEnd => SeekCoordinate::End,
        other => SeekCoordinate::Checkpoint(other.label()),
    }
}

/// Where a seek of a paged partition to `target` puts it, in event time.
fn paged_target(target: &SeekTarget) -> SeekCoordinate {
    match target {
        SeekTarget::Timestamp(t) => SeekCoordinate::Time(millis(*t)),
        _ => SeekCoordinate::Start,
    }
}

/// What a row records as skipped by seeks once a seek moves it from `seen` to `to` (at `target`
/// in its records). Pure.
///
/// - A move forward skips the records after where the row stood (its coordinate:
///   `completeThrough`, or a paged partition's `closedThrough`; else its checkpoint) and before
///   the target: recorded under the row's next seek epoch. An earlier record this move does not
///   read again is widened to the new target, never dropped.
/// - A move that does not go forward keeps an earlier record, unless it reads it again: a move to
///   the start, or to a time at or before the record's `from`.
/// - Where the row stood cannot be compared with the target (a record's arrival time is not on
///   the row), the move counts as forward: a skip is reported rather than certified silently.
pub(crate) fn skipped_after(
    seen: &Lease,
    to: &Checkpoint,
    target: &SeekCoordinate,
) -> Option<SkippedRange> {
    let epoch = seen.seek_epoch + 1;
    let kept = seen
        .seek_skipped
        .clone()
        .filter(|old| !reads_again(target, &old.from));
    match (skipped_from(seen, to, target), kept) {
        (Some(_), Some(old)) => Some(SkippedRange {
            from: old.from,
            to: target.clone(),
            seek_epoch: epoch,
        }),
        (Some(from), None) => Some(SkippedRange {
            from,
            to: target.clone(),
            seek_epoch: epoch,
        }),
        (None, kept) => kept,
    }
}

/// Where the row stood, when a move of it to `to` (at `target`) goes forward.
fn skipped_from(seen: &Lease, to: &Checkpoint, target: &SeekCoordinate) -> Option<SeekCoordinate> {
    // Every record of an ended row has its outcome: no move of it skips any.
    if seen.checkpoint.is_shard_end() {
        return None;
    }
    let time = match &seen.progress {
        Some(progress) => progress.closed_through,
        None => seen.complete_through,
    };
    let stood = || match (&seen.progress, time, &seen.checkpoint) {
        (_, Some(ms), _) => SeekCoordinate::Time(ms),
        (Some(_), None, _) | (None, None, Checkpoint::TrimHorizon) => SeekCoordinate::Start,
        (None, None, Checkpoint::AtTimestamp(t)) => SeekCoordinate::Time(millis(*t) - 1),
        (None, None, other) => SeekCoordinate::Checkpoint(other.label()),
    };
    let forward = match target {
        SeekCoordinate::Start => false,
        SeekCoordinate::End => true,
        SeekCoordinate::Time(t) => match (time, &seen.checkpoint) {
            (Some(ms), _) => ms + 1 < *t,
            (None, Checkpoint::AtTimestamp(from)) => millis(*from) < *t,
            // Unread at the tip: nothing older than the target is owed.
            (None, Checkpoint::Latest) => false,
            (None, _) => true,
        },
        // A record of the shard (a seek to a position): compared on the checkpoint key.
        SeekCoordinate::Checkpoint(_) => match &seen.checkpoint {
            Checkpoint::Latest => false,
            stood => to.sort_key() > stood.sort_key(),
        },
    };
    forward.then(stood)
}

/// Whether a move to `target` reads again every record after `from`.
fn reads_again(target: &SeekCoordinate, from: &SeekCoordinate) -> bool {
    match (target, from) {
        (SeekCoordinate::Start, _) => true,
        (SeekCoordinate::Time(t), SeekCoordinate::Time(f)) => *t <= f + 1,
        _ => false,
    }
}

/// Which rows move where, in groups that must move at once. Pure.
///
/// `latest` is the time a LATEST target is pinned to.
fn plan(
    stream: &str,
    target: &SeekTarget,
    shards: &[ShardInfo],
    rows: &[Lease],
    latest: SystemTime,
) -> Result<Vec<Vec<(String, Checkpoint)>>, Error> {
    // Lineage from both the listing and the rows (a row keeps its parents after they aged out).
    let mut parents: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for s in shards {
        parents
            .entry(s.shard_id.as_str())
            .or_default()
            .extend(s.parents.iter().map(String::as_str));
    }
    for r in rows {
        parents
            .entry(r.shard_id.as_str())
            .or_default()
            .extend(r.parents.iter().map(String::as_str));
    }
    let mut children: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (child, ps) in &parents {
        for p in ps {
            children.entry(p).or_default().insert(child);
        }
    }
    let has_row: BTreeSet<&str> = rows.iter().map(|r| r.shard_id.as_str()).collect();

    let groups: Vec<Vec<(String, Checkpoint)>> = match target {
        SeekTarget::Position { shard_id, position } => {
            if !shards.iter().any(|s| &s.shard_id == shard_id) {
                return Err(Error::Corrupt {
                    what: "seek target",
                    detail: format!("stream `{stream}` has no shard `{shard_id}`"),
                });
            }
            let mut group = vec![(shard_id.clone(), Checkpoint::Before(*position))];
            let mut seen = BTreeSet::from([shard_id.as_str()]);
            let mut frontier = vec![shard_id.as_str()];
            while let Some(shard) = frontier.pop() {
                for child in children.get(shard).into_iter().flatten() {
                    if seen.insert(child) && has_row.contains(child) {
                        group.push((child.to_string(), Checkpoint::TrimHorizon));
                        frontier.push(child);
                    }
                }
            }
            vec![group]
        }
        stream_wide => {
            let to = |s: &ShardInfo| match stream_wide {
                SeekTarget::TrimHorizon => Checkpoint::TrimHorizon,
                SeekTarget::Latest if s.closed => Checkpoint::ShardEnd,
                SeekTarget::Latest => Checkpoint::AtTimestamp(latest),
                SeekTarget::Timestamp(t) => Checkpoint::AtTimestamp(*t),
                SeekTarget::Position { .. } => unreachable!("handled above"),
            };
            // Lineages: shards connected by parent links, among the listed shards.
            let listed: BTreeMap<&str, &ShardInfo> =
                shards.iter().map(|s| (s.shard_id.as_str(), s)).collect();
            let mut lineage_of: BTreeMap<&str, usize> = BTreeMap::new();
            let mut lineages: Vec<Vec<(String, Checkpoint)>> = Vec::new();
            for start in listed.keys() {
                if lineage_of.contains_key(start) {
                    continue;
                }
                let index = lineages.len();
                let mut lineage = Vec::new();
                let mut pending = vec![*start];
                while let Some(shard) = pending.pop() {
                    let Some(info) = listed.get(shard) else {
                        continue;
                    };
                    if lineage_of.insert(shard, index).is_some() {
                        continue;
                    }
                    lineage.push((shard.to_string(), to(info)));
                    pending.extend(parents.get(shard).into_iter().flatten());
                    pending.extend(children.get(shard).into_iter().flatten());
                }
                lineage.sort_by(|a, b| a.0.cmp(&b.0));
                lineages.push(lineage);
            }
            lineages
        }
    };
    if let Some(big) = groups.iter().find(|g| g.len() > MAX_SEEK_MOVES) {
        return Err(Error::Corrupt {
            what: "seek",
            detail: format!(
                "{} shards of one lineage must move together, more than one transaction takes ({MAX_SEEK_MOVES})",
                big.len()
            ),
        });
    }
    Ok(groups)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::position::SequenceNumber;
    use std::time::Duration;

    fn info(id: &str, parents: &[&str], closed: bool) -> ShardInfo {
        ShardInfo {
            shard_id: id.into(),
            parents: parents.iter().map(|p| p.to_string()).collect(),
            closed,
        }
    }

    fn row(id: &str, parents: &[&str]) -> Lease {
        Lease {
            stream: "s".into(),
            shard_id: id.into(),
            owner: Some("w".into()),
            counter: 1,
            owner_epoch: 1,
            checkpoint: Checkpoint::TrimHorizon,
            parents: parents.iter().map(|p| p.to_string()).collect(),
            children: vec![],
            complete_through: None,
            seek_epoch: 0,
            seek_skipped: None,
            sought_at: None,
            progress: None,
            wanted_by: None,
            handoff_acked: false,
            retired_at: None,
            window: None,
        }
    }

    fn at(seq: &str) -> Position {
        Position::new(SequenceNumber::parse(seq).unwrap(), 0)
    }

    /// A split of 0 into 1 and 2, then a merge of 2 with 3 into 4; 5 is unrelated.
    fn lineage() -> (Vec<ShardInfo>, Vec<Lease>) {
        let shards = vec![
            info("0", &[], true),
            info("1", &["0"], false),
            info("2", &["0"], true),
            info("3", &[], true),
            info("4", &["2", "3"], false),
            info("5", &[], false),
        ];
        let rows = shards
            .iter()
            .map(|s| {
                let parents: Vec<&str> = s.parents.iter().map(String::as_str).collect();
                row(&s.shard_id, &parents)
            })
            .collect();
        (shards, rows)
    }

    fn shards_of(group: &[(String, Checkpoint)]) -> Vec<&str> {
        let mut ids: Vec<&str> = group.iter().map(|(s, _)| s.as_str()).collect();
        ids.sort();
        ids
    }

    #[test]
    fn a_seek_of_a_parent_to_a_record_resets_every_descendant_in_the_same_group() {
        let (shards, rows) = lineage();
        let target = SeekTarget::Position {
            shard_id: "0".into(),
            position: at("7"),
        };
        let groups = plan("s", &target, &shards, &rows, SystemTime::UNIX_EPOCH).unwrap();
        assert_eq!(groups.len(), 1, "one transaction");
        assert_eq!(shards_of(&groups[0]), ["0", "1", "2", "4"]);
        for (shard, to) in &groups[0] {
            let expected = if shard == "0" {
                Checkpoint::Before(at("7"))
            } else {
                Checkpoint::TrimHorizon
            };
            assert_eq!(to, &expected, "{shard}");
        }
    }

    #[test]
    fn a_seek_of_an_open_shard_moves_it_alone() {
        let (shards, rows) = lineage();
        let target = SeekTarget::Position {
            shard_id: "5".into(),
            position: at("9"),
        };
        let groups = plan("s", &target, &shards, &rows, SystemTime::UNIX_EPOCH).unwrap();
        assert_eq!(groups.len(), 1);
        assert_eq!(shards_of(&groups[0]), ["5"]);
    }

    #[test]
    fn a_stream_wide_seek_moves_each_lineage_at_once() {
        let (shards, rows) = lineage();
        let groups = plan(
            "s",
            &SeekTarget::TrimHorizon,
            &shards,
            &rows,
            SystemTime::UNIX_EPOCH,
        )
        .unwrap();
        let mut lineages: Vec<Vec<&str>> = groups.iter().map(|g| shards_of(g)).collect();
        lineages.sort();
        assert_eq!(lineages, vec![vec!["0", "1", "2", "3", "4"], vec!["5"]]);
    }

    #[test]
    fn latest_pins_open_shards_to_the_seek_time_and_ends_closed_ones() {
        let (shards, rows) = lineage();
        let pinned = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let groups = plan("s", &SeekTarget::Latest, &shards, &rows, pinned).unwrap();
        let all: BTreeMap<String, Checkpoint> = groups.into_iter().flatten().collect();
        assert_eq!(all["0"], Checkpoint::ShardEnd);
        assert_eq!(all["1"], Checkpoint::AtTimestamp(pinned));
        assert_eq!(all["4"], Checkpoint::AtTimestamp(pinned));
    }

    fn at_ms(ms: u64) -> Checkpoint {
        Checkpoint::AtTimestamp(SystemTime::UNIX_EPOCH + Duration::from_millis(ms))
    }

    fn stood(complete_through: Option<i64>, checkpoint: Checkpoint) -> Lease {
        Lease {
            complete_through,
            checkpoint,
            ..row("a", &[])
        }
    }

    fn skipped(seen: &Lease, to: Checkpoint) -> Option<SkippedRange> {
        skipped_after(seen, &to, &target_of(&to))
    }

    fn range(from: SeekCoordinate, to: SeekCoordinate, seek_epoch: u64) -> Option<SkippedRange> {
        Some(SkippedRange {
            from,
            to,
            seek_epoch,
        })
    }

    /// A seek forward records the range between where the row stood and where it goes, under the
    /// row's next seek epoch; a seek back records nothing.
    #[test]
    fn a_forward_seek_records_what_it_skips() {
        use SeekCoordinate::{Checkpoint as Cp, End, Start, Time};
        let done_to_100 = stood(Some(100), Checkpoint::At(at("7")));
        assert_eq!(
            skipped(&done_to_100, at_ms(5_000)),
            range(Time(100), Time(5_000), 1),
            "to a later time"
        );
        assert_eq!(skipped(&done_to_100, at_ms(101)), None, "nothing between");
        assert_eq!(skipped(&done_to_100, at_ms(50)), None, "back in time");
        assert_eq!(skipped(&done_to_100, Checkpoint::TrimHorizon), None);
        assert_eq!(
            skipped(&done_to_100, Checkpoint::ShardEnd),
            range(Time(100), End, 1),
            "a closed shard ended by a seek to LATEST"
        );
        // To a record of the shard: compared on the checkpoint, not on time.
        let at_7 = stood(None, Checkpoint::At(at("7")));
        assert_eq!(
            skipped(&at_7, Checkpoint::Before(at("9"))),
            range(Cp("7".into()), Cp("AT:9".into()), 1)
        );
        assert_eq!(
            skipped(&at_7, Checkpoint::Before(at("7"))),
            None,
            "reread 7"
        );
        assert_eq!(skipped(&at_7, Checkpoint::Before(at("5"))), None);
        // Unread rows: from the start, from their start time, or not at all at the tip.
        assert_eq!(
            skipped(&stood(None, Checkpoint::TrimHorizon), at_ms(10)),
            range(Start, Time(10), 1)
        );
        assert_eq!(
            skipped(&stood(None, at_ms(10)), at_ms(20)),
            range(Time(9), Time(20), 1)
        );
        assert_eq!(skipped(&stood(None, Checkpoint::Latest), at_ms(20)), None);
        // A row with no coordinate and a checkpoint: where it stood in time is unknown, so the
        // move counts as forward.
        assert_eq!(
            skipped(&at_7, at_ms(20)),
            range(Cp("7".into()), Time(20), 1)
        );
        assert_eq!(
            skipped(&stood(Some(100), Checkpoint::ShardEnd), at_ms(5_000)),
            None,
            "every record of an ended shard has its outcome"
        );
    }

    /// A skipped range stays on the row until a seek reads it again; another forward seek widens
    /// it to its own target under its own epoch.
    #[test]
    fn a_skipped_range_stays_until_read_again() {
        use SeekCoordinate::Time;
        let first = range(Time(100), Time(5_000), 1);
        let after_first = Lease {
            seek_epoch: 1,
            seek_skipped: first.clone(),
            ..stood(Some(5_100), Checkpoint::At(at("9")))
        };
        assert_eq!(
            skipped(&after_first, at_ms(9_000)),
            range(Time(100), Time(9_000), 2),
            "widened"
        );
        assert_eq!(
            skipped(&after_first, at_ms(3_000)),
            first,
            "partly read again: kept"
        );
        assert_eq!(skipped(&after_first, at_ms(101)), None, "read again");
        assert_eq!(skipped(&after_first, Checkpoint::TrimHorizon), None);
    }

    /// A paged partition stands at its `closedThrough` (or at its start, if it never closed
    /// anything): a seek to a later time skips what is between.
    #[test]
    fn a_paged_partition_sought_forward_records_its_skip() {
        use SeekCoordinate::{Start, Time};
        let closed = Lease {
            progress: Some(PagedProgress {
                closed_through: Some(1_000),
                ..PagedProgress::default()
            }),
            ..stood(None, Checkpoint::TrimHorizon)
        };
        let to = |ms: u64| {
            paged_target(&SeekTarget::Timestamp(
                SystemTime::UNIX_EPOCH + Duration::from_millis(ms),
            ))
        };
        assert_eq!(
            skipped_after(&closed, &Checkpoint::TrimHorizon, &to(2_000)),
            range(Time(1_000), Time(2_000), 1)
        );
        assert_eq!(
            skipped_after(&closed, &Checkpoint::TrimHorizon, &to(500)),
            None
        );
        let fresh = Lease {
            progress: Some(PagedProgress::default()),
            ..stood(None, Checkpoint::TrimHorizon)
        };
        assert_eq!(
            skipped_after(&fresh, &Checkpoint::TrimHorizon, &to(2_000)),
            range(Start, Time(2_000), 1)
        );
        assert_eq!(
            skipped_after(
                &closed,
                &Checkpoint::TrimHorizon,
                &paged_target(&SeekTarget::TrimHorizon)
            ),
            None
        );
    }

    #[test]
    fn a_shard_the_stream_does_not_list_is_refused() {
        let (shards, rows) = lineage();
        let target = SeekTarget::Position {
            shard_id: "9".into(),
            position: at("1"),
        };
        let err = plan("s", &target, &shards, &rows, SystemTime::UNIX_EPOCH).unwrap_err();
        assert!(err.to_string().contains("no shard `9`"), "{err}");
    }
}
