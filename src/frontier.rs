//! The stream-wide frontier: one statement of how far the whole stream is complete.
//!
//! Each shard's lease row carries `completeThrough`: an arrival-time coordinate T (ms since the
//! Unix epoch) such that every record of the shard that arrived at or before T has a durable
//! terminal outcome. A paged partition's coordinate is its `closedThrough`: the source-certified
//! complete-through watermark (a closed timestamp group, or a watermark its pages reported),
//! promoted only by the partition's own compare-and-swap once everything before it is durable.
//!
//! The frontier is the minimum over the membership: every shard or partition that is not at
//! SHARD_END, and an ended shard until each of its children carries a coordinate. A fast member
//! never carries the frontier past a slow one. If any member lacks a coordinate there is no
//! scalar, only the vector.
//!
//! The membership is published in the lease table with an epoch that counts up by one on every
//! change ([`Membership`]), so readers can order two frontiers and see a topology change. The
//! frontier claims only what it has seen: the partitions of the source's last listing
//! ([`Listing`]) that have lease rows, and nothing a seek skipped without saying so.
//!
//! # States, and what each publication is conditioned on
//!
//! The computation sees the lease rows, the published membership and the last listing, and is in
//! exactly one of these states (checked in this order):
//!
//! | state | when | scalar | membership published |
//! |---|---|---|---|
//! | listed ahead | the last listing found a partition that has no lease row yet (`listed_without_row`) | withheld | none: a membership that lacks a partition the source has is never published |
//! | first | nothing published yet | the minimum, if every member has a coordinate | epoch 1, the members and their seek epochs |
//! | steady | the members are the published ones, and no row's seek epoch rose since | the minimum, if every member has a coordinate | none |
//! | proven change | the members differ, or a seek moved rows: every added member is read from its own start (never sought, or a child shard), sealed (at SHARD_END), or moved by a seek since the publication; every removed one is sealed (at SHARD_END, or its row gone while the listing no longer names it, or gone when there is no listing) or moved by a seek since | the minimum, once the next membership is stored (`publish`) | the next epoch |
//! | unproven change | an added or removed member has none of those proofs (`unproven`) | withheld | none: the epoch stays |
//!
//! "Moved by a seek since the publication" is exact: the membership records each row's seek
//! epoch, and only the rows whose seek epoch rose, with their descendants (a seek of a shard
//! resets its children with it), may join or leave on the seek's word; anything else that joins
//! or leaves in the same scan still needs its own proof. A membership stored by an older version
//! records only the sum of the seek epochs: then every row with a seek epoch counts as moved when
//! the sum changed, as before.
//!
//! A seek that moves a row forward skips the records between where the row stood and where the
//! seek put it: the seek records that range on the row ([`SkippedRange`]), and every frontier
//! lists it (`skipped_by_seek`, and `shardwise frontier --json`), so a scalar past it never
//! certifies those records silently. The record stays until a later seek reads the range again.
//!
//! The last listing is the source's partitions as this worker last listed them: a partition the
//! source gained after it is outside every claim until a listing finds it (`listed_at` says how
//! old the listing is), and from that listing on the scalar is withheld until the partition's
//! row exists, however far the other members got.
//!
//! All of this is pure: [`complete_through`] for one shard, `compute` over the lease rows ([`from_rows`] for a reader of the lease table alone), the
//! published membership and the last listing.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::time::{Duration, SystemTime};

/// What one shard knows about its own progress, for [`complete_through`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShardProgress {
    /// Arrival (ms) of the oldest delivery that has not settled.
    pub oldest_unsettled: Option<i64>,
    /// Arrival (ms) of the newest delivery the checkpoint has passed.
    pub last_settled: Option<i64>,
    /// Local time (ms) of the last read that came back empty with MillisBehindLatest = 0, if
    /// nothing has been read since.
    pub caught_up_at: Option<i64>,
    /// The coordinate already stored for the shard: never go below it.
    pub floor: Option<i64>,
}

/// The shard's coordinate:
/// - below the oldest unsettled delivery: `oldest_unsettled - 1`;
/// - all read deliveries settled and the last read was empty at the tip: `caught_up_at - skew`, but
///   only when a clock-skew allowance is configured (records may arrive with a service timestamp
///   behind the local clock by up to the skew);
/// - all read deliveries settled otherwise: `last_settled - 1` (an unread record may share the
///   last settled one's millisecond);
/// - never below `floor`.
///
/// ```
/// use shardwise::frontier::{complete_through, ShardProgress};
/// let p = ShardProgress { oldest_unsettled: Some(1_000), last_settled: Some(900), ..Default::default() };
/// assert_eq!(complete_through(&p, None), Some(999));
/// ```
pub fn complete_through(p: &ShardProgress, caught_up_skew: Option<Duration>) -> Option<i64> {
    let own = match (p.oldest_unsettled, p.caught_up_at, caught_up_skew) {
        (Some(oldest), _, _) => Some(oldest - 1),
        (None, Some(now), Some(skew)) => {
            Some((now - skew.as_millis() as i64).max(p.last_settled.unwrap_or(i64::MIN)))
        }
        (None, _, _) => p.last_settled.map(|l| l - 1),
    };
    match (own, p.floor) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// One member of the frontier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// The shard.
    pub shard_id: String,
    /// Its coordinate, if it has one.
    pub complete_through: Option<i64>,
    /// Whether it is at SHARD_END (a member until its children carry coordinates).
    pub ended: bool,
}

/// A published membership: the members of the frontier and its epoch, stored in the lease table
/// and changed only by compare-and-swap on the epoch.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Membership {
    /// 1 for the first membership, +1 on every change.
    pub epoch: u64,
    /// The member ids, sorted.
    pub members: Vec<String>,
    /// The sum of the rows' seek epochs when it was published (what older versions compare).
    pub seeks: u64,
    /// Each row's seek epoch when it was published (rows at 0 left out): a row whose seek epoch
    /// rose since was moved by a seek, which may change its membership. Empty in a membership
    /// stored by an older version (see the module doc).
    pub seek_epochs: BTreeMap<String, u64>,
}

impl Membership {
    /// Whether it records each row's seek epoch (an older version stored only their sum).
    fn records_seek_epochs(&self) -> bool {
        self.seek_epochs.values().sum::<u64>() == self.seeks
    }
}

/// The partitions (or shards) a listing of the source found, and when.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Listing {
    /// The ids listed.
    pub ids: BTreeSet<String>,
    /// When the listing was taken (ms since the Unix epoch, local clock).
    pub at: i64,
}

/// A place in a shard or partition, as a seek's skipped range names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SeekCoordinate {
    /// The oldest record.
    Start,
    /// An arrival time or event timestamp (ms since the Unix epoch).
    Time(i64),
    /// A checkpoint as the lease row stores it (`checkpoint`: a sequence number, `AT:` and a
    /// sequence number for a seek target, or a start sentinel).
    Checkpoint(String),
    /// The end of a closed shard.
    End,
}

impl SeekCoordinate {
    /// The stored form: `start`, `time:<ms>`, `checkpoint:<label>`, `end`.
    pub fn encode(&self) -> String {
        match self {
            SeekCoordinate::Start => "start".into(),
            SeekCoordinate::Time(ms) => format!("time:{ms}"),
            SeekCoordinate::Checkpoint(label) => format!("checkpoint:{label}"),
            SeekCoordinate::End => "end".into(),
        }
    }

    /// Reads the stored form back; `None` when it is not one.
    pub fn decode(stored: &str) -> Option<Self> {
        match stored {
            "start" => Some(SeekCoordinate::Start),
            "end" => Some(SeekCoordinate::End),
            other => match other.split_once(':')? {
                ("time", ms) => ms.parse().ok().map(SeekCoordinate::Time),
                ("checkpoint", label) if !label.is_empty() => {
                    Some(SeekCoordinate::Checkpoint(label.to_string()))
                }
                _ => None,
            },
        }
    }
}

impl fmt::Display for SeekCoordinate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.encode())
    }
}

/// Records a forward seek skipped on one row: those after `from` and before `to` (both
/// exclusive; `Start` and `End` inclusive). Written by the seek on the row it moved; kept until a
/// later seek reads the range again (a later forward seek widens it to its own target).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedRange {
    /// Where the row stood before the seek (its coordinate, or its checkpoint).
    pub from: SeekCoordinate,
    /// Where the seek moved it.
    pub to: SeekCoordinate,
    /// The row's seek epoch after the seek that skipped (the latest one, once widened).
    pub seek_epoch: u64,
}

/// A range skipped by a seek on one shard or partition, as the frontier reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedBySeek {
    /// The shard or partition.
    pub shard_id: String,
    /// What was skipped.
    pub range: SkippedRange,
}

/// The stream frontier at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Frontier {
    /// The membership epoch: an ordered counter, +1 on every published membership change (0: no
    /// membership published yet).
    pub epoch: u64,
    /// The members, by shard id.
    pub members: Vec<Member>,
    /// Every record of the stream that arrived at or before this time (ms) has a durable outcome,
    /// except the ranges in `skipped_by_seek`. `None` when a member has no coordinate yet (see
    /// `missing`), a membership change is unproven (`unproven`), the last listing found a
    /// partition without a row (`listed_without_row`), or there are no members.
    pub scalar: Option<i64>,
    /// Members without a coordinate: why there is no scalar.
    pub missing: Vec<String>,
    /// A membership change that cannot be proven safe (an added member not read from its start
    /// and not moved by a seek since the publication, a removed one not sealed): why there is no
    /// scalar.
    pub unproven: Vec<String>,
    /// Partitions the source's last listing found that have no lease row yet: why there is no
    /// scalar (they are outside the membership, which therefore is not published either).
    pub listed_without_row: Vec<String>,
    /// When the listing the frontier was computed with was taken (ms, local clock): partitions
    /// the source gained after it are outside the claim. `None`: computed without one (a reader
    /// of the lease table alone).
    pub listed_at: Option<i64>,
    /// Ranges forward seeks skipped: the scalar does not say they were handled.
    pub skipped_by_seek: Vec<SkippedBySeek>,
    /// The membership to publish (a first one, or a proven change): the scalar and epoch above
    /// hold only once it is stored.
    pub publish: Option<Membership>,
}

impl Frontier {
    /// The scalar as a time.
    pub fn as_time(&self) -> Option<SystemTime> {
        self.scalar.map(crate::time::from_millis)
    }
}

/// One shard as the frontier needs it: read from its lease row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ShardCoordinate<'a> {
    /// The shard.
    pub(crate) shard_id: &'a str,
    /// Its stored `completeThrough`, if any.
    pub(crate) complete_through: Option<i64>,
    /// Whether it is at SHARD_END.
    pub(crate) ended: bool,
    /// Its children, once known.
    pub(crate) children: &'a [String],
    /// Its parents (a split child has one, a merge child two).
    pub(crate) parents: &'a [String],
    /// A paged partition (it has no children: at SHARD_END it is sealed and leaves).
    pub(crate) paged: bool,
    /// It was read from its own start (never moved by a seek), or it is a child shard (read from
    /// its start after its parents): it covers every time before any earlier frontier.
    pub(crate) from_start: bool,
    /// Its seek epoch (+1 on every seek).
    pub(crate) seek_epoch: u64,
    /// What seeks skipped on it, if anything.
    pub(crate) skipped: Option<&'a SkippedRange>,
}

/// The frontier as a reader of the lease table alone sees it: from the stream's lease `rows` and
/// the membership `published` in the table (`None`: none yet). The source is not listed, so a
/// shard or partition it gained that has no row yet is not seen (a worker's own frontier, from
/// [`Running::frontier`](crate::Running::frontier), withholds the scalar for it).
pub fn from_rows(rows: &[crate::lease::Lease], published: Option<&Membership>) -> Frontier {
    let coordinates: Vec<ShardCoordinate<'_>> =
        rows.iter().map(crate::lease::Lease::coordinate).collect();
    compute(&coordinates, published, None)
}

/// The frontier of the stream whose shards are `rows` (one per lease row), under the membership
/// `published` in the lease table (`None`: none yet), with the source's last `listing` (`None`:
/// none known; a reader of the lease table alone). See the module doc for the states.
pub(crate) fn compute(
    rows: &[ShardCoordinate<'_>],
    published: Option<&Membership>,
    listing: Option<&Listing>,
) -> Frontier {
    let by_shard: HashMap<&str, &ShardCoordinate<'_>> =
        rows.iter().map(|r| (r.shard_id, r)).collect();
    // A child covers its part of the parent once it carries a coordinate. A child without a row
    // was deleted: rows go only at SHARD_END, once their own children started (and a child's row
    // is created before it is recorded on its parent), so it is covered too.
    let covered = |child: &String| {
        by_shard
            .get(child.as_str())
            .is_none_or(|c| c.complete_through.is_some())
    };
    let members: BTreeMap<&str, Member> = rows
        .iter()
        .filter(|r| {
            !r.ended || (!r.paged && (r.children.is_empty() || !r.children.iter().all(covered)))
        })
        .map(|r| {
            (
                r.shard_id,
                Member {
                    shard_id: r.shard_id.to_string(),
                    complete_through: r.complete_through,
                    ended: r.ended,
                },
            )
        })
        .collect();
    let members: Vec<Member> = members.into_values().collect();
    let ids: Vec<String> = members.iter().map(|m| m.shard_id.clone()).collect();
    let missing: Vec<String> = members
        .iter()
        .filter(|m| m.complete_through.is_none())
        .map(|m| m.shard_id.clone())
        .collect();
    let listed = |id: &str| listing.is_some_and(|l| l.ids.contains(id));
    let listed_without_row: Vec<String> = listing
        .map(|l| {
            l.ids
                .iter()
                .filter(|id| !by_shard.contains_key(id.as_str()))
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    let mut skipped_by_seek: Vec<SkippedBySeek> = rows
        .iter()
        .filter_map(|r| {
            Some(SkippedBySeek {
                shard_id: r.shard_id.to_string(),
                range: r.skipped?.clone(),
            })
        })
        .collect();
    skipped_by_seek.sort_by(|a, b| a.shard_id.cmp(&b.shard_id));
    let next = |epoch: u64| Membership {
        epoch,
        members: ids.clone(),
        seeks: rows.iter().map(|r| r.seek_epoch).sum(),
        seek_epochs: rows
            .iter()
            .filter(|r| r.seek_epoch > 0)
            .map(|r| (r.shard_id.to_string(), r.seek_epoch))
            .collect(),
    };
    let (epoch, unproven, publish) = match published {
        // A membership that lacks a partition the source has is not published, first or not.
        None if !listed_without_row.is_empty() => (0, Vec::new(), None),
        None => (1, Vec::new(), Some(next(1))),
        Some(p) => {
            let moved = moved_by_seeks(rows, p);
            if p.members == ids && moved.is_empty() {
                (p.epoch, Vec::new(), None)
            } else {
                let before: BTreeSet<&String> = p.members.iter().collect();
                let now: BTreeSet<&String> = ids.iter().collect();
                let mut unproven = Vec::new();
                for added in now.difference(&before) {
                    let proven = by_shard
                        .get(added.as_str())
                        .is_some_and(|r| r.from_start || r.ended || moved.contains(added.as_str()));
                    if !proven {
                        unproven.push(format!(
                            "{added} joined without coverage from its start (moved by a seek before the membership of epoch {}, and not since)",
                            p.epoch
                        ));
                    }
                }
                for removed in before.difference(&now) {
                    let sealed = match by_shard.get(removed.as_str()) {
                        Some(r) => r.ended || moved.contains(removed.as_str()),
                        // Rows are deleted only at SHARD_END, once the source no longer lists the
                        // shard (aged out): a row gone while the source still lists it was not.
                        None => !listed(removed),
                    };
                    if !sealed {
                        unproven.push(match by_shard.contains_key(removed.as_str()) {
                            true => format!("{removed} left without being sealed"),
                            false => format!(
                                "{removed} left without being sealed: its row is gone while the source still lists it"
                            ),
                        });
                    }
                }
                if unproven.is_empty() && listed_without_row.is_empty() {
                    (p.epoch + 1, unproven, Some(next(p.epoch + 1)))
                } else {
                    (p.epoch, unproven, None)
                }
            }
        }
    };
    let scalar = if missing.is_empty() && unproven.is_empty() && listed_without_row.is_empty() {
        members.iter().filter_map(|m| m.complete_through).min()
    } else {
        None
    };
    Frontier {
        epoch,
        members,
        scalar,
        missing,
        unproven,
        listed_without_row,
        listed_at: listing.map(|l| l.at),
        skipped_by_seek,
        publish,
    }
}

/// The rows a seek moved since `published`: those whose seek epoch rose, and their descendants.
/// Under a membership stored by an older version (the sum of the seek epochs only), every row
/// with a seek epoch once the sum changed.
fn moved_by_seeks<'a>(rows: &[ShardCoordinate<'a>], published: &Membership) -> BTreeSet<&'a str> {
    let sought: Vec<&'a str> = if published.records_seek_epochs() {
        rows.iter()
            .filter(|r| r.seek_epoch > published.seek_epochs.get(r.shard_id).copied().unwrap_or(0))
            .map(|r| r.shard_id)
            .collect()
    } else if rows.iter().map(|r| r.seek_epoch).sum::<u64>() != published.seeks {
        rows.iter()
            .filter(|r| r.seek_epoch > 0)
            .map(|r| r.shard_id)
            .collect()
    } else {
        Vec::new()
    };
    // Children by parent, from both sides of the lineage (a row keeps its parents after they age
    // out; a parent learns its children from the listing).
    let mut children: HashMap<&str, BTreeSet<&'a str>> = HashMap::new();
    for r in rows {
        for child in r.children {
            children
                .entry(r.shard_id)
                .or_default()
                .insert(child.as_str());
        }
        for parent in r.parents {
            children
                .entry(parent.as_str())
                .or_default()
                .insert(r.shard_id);
        }
    }
    let mut moved: BTreeSet<&'a str> = BTreeSet::new();
    let mut pending = sought;
    while let Some(shard) = pending.pop() {
        if moved.insert(shard) {
            pending.extend(children.get(shard).into_iter().flatten().copied());
        }
    }
    moved
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Debug)]
    struct Row {
        shard: String,
        ct: Option<i64>,
        ended: bool,
        children: Vec<String>,
    }

    fn row(shard: &str, ct: Option<i64>, ended: bool, children: &[&str]) -> Row {
        Row {
            shard: shard.into(),
            ct,
            ended,
            children: children.iter().map(|c| c.to_string()).collect(),
        }
    }

    fn coordinates(rows: &[Row]) -> Vec<ShardCoordinate<'_>> {
        rows.iter()
            .map(|r| ShardCoordinate {
                shard_id: &r.shard,
                complete_through: r.ct,
                ended: r.ended,
                children: &r.children,
                parents: &[],
                paged: false,
                from_start: true,
                seek_epoch: 0,
                skipped: None,
            })
            .collect()
    }

    /// The frontier of `rows` under the membership published by the frontier before it (the
    /// lease table's, as a worker would have stored it).
    fn frontier(rows: &[Row]) -> Frontier {
        compute(&coordinates(rows), None, None)
    }

    fn after(before: &Frontier, rows: &[Row]) -> Frontier {
        let published = before.publish.clone().unwrap_or(Membership {
            epoch: before.epoch,
            members: before.members.iter().map(|m| m.shard_id.clone()).collect(),
            ..Membership::default()
        });
        compute(&coordinates(rows), Some(&published), None)
    }

    #[test]
    fn a_fast_shard_cannot_carry_the_frontier_past_a_slow_one() {
        let f = frontier(&[
            row("a", Some(120), false, &[]),
            row("b", Some(90), false, &[]),
        ]);
        assert_eq!(f.scalar, Some(90));
        let f = frontier(&[
            row("a", Some(120), false, &[]),
            row("b", Some(110), false, &[]),
        ]);
        assert_eq!(f.scalar, Some(110), "b catching up moves it");
    }

    #[test]
    fn a_member_without_a_coordinate_withholds_the_scalar() {
        let f = frontier(&[
            row("a", Some(120), false, &[]),
            row("new", None, false, &[]),
        ]);
        assert_eq!(f.scalar, None);
        assert_eq!(f.missing, ["new"]);
        assert_eq!(f.members.len(), 2, "the vector is still published");
    }

    #[test]
    fn an_ended_parent_stays_until_its_children_carry_coordinates() {
        // Split of p into c1, c2: c2 has no coordinate yet, so p stays and the scalar is withheld.
        let rows = [
            row("p", Some(50), true, &["c1", "c2"]),
            row("c1", Some(70), false, &[]),
            row("c2", None, false, &[]),
        ];
        let before = frontier(&rows);
        assert!(before.members.iter().any(|m| m.shard_id == "p"));
        assert_eq!(before.scalar, None);
        // Both children covered: the parent leaves, the epoch changes, the minimum rule holds.
        let rows = [
            row("p", Some(50), true, &["c1", "c2"]),
            row("c1", Some(70), false, &[]),
            row("c2", Some(65), false, &[]),
        ];
        let after = after(&before, &rows);
        assert!(!after.members.iter().any(|m| m.shard_id == "p"));
        assert_eq!(after.scalar, Some(65));
        assert_eq!(
            (before.epoch, after.epoch),
            (1, 2),
            "a membership change is the next epoch"
        );
    }

    #[test]
    fn a_merge_changes_the_epoch_and_keeps_the_minimum() {
        let before = frontier(&[
            row("a", Some(10), false, &[]),
            row("b", Some(20), false, &[]),
        ]);
        let merged = after(
            &before,
            &[
                row("a", Some(30), true, &["m"]),
                row("b", Some(25), true, &["m"]),
                row("m", Some(40), false, &[]),
            ],
        );
        assert_eq!(merged.scalar, Some(40));
        assert!(merged.epoch > before.epoch, "epochs order");
        let same = after(
            &before,
            &[
                row("a", Some(11), false, &[]),
                row("b", Some(21), false, &[]),
            ],
        );
        assert_eq!(before.epoch, same.epoch, "same membership, same epoch");
        assert_eq!(same.publish, None, "nothing to publish");
    }

    /// Seed 001's reasoned example over paged partitions: A complete through 120, B through 90:
    /// the frontier is 90 (the maximum, 120, would claim B's unproven interval). A stale retry of
    /// an older A page loses its compare-and-swap and changes nothing; B proving 110 moves it to
    /// 110. The membership is unchanged throughout: one epoch.
    #[test]
    fn the_reasoned_example_a_120_b_90_then_110() {
        let paged = |rows: &[Row]| -> Vec<Row> { rows.to_vec() };
        let rows = paged(&[
            row("A", Some(120), false, &[]),
            row("B", Some(90), false, &[]),
        ]);
        let first = compute(&partitions(&rows), None, None);
        assert_eq!(first.scalar, Some(90));
        let published = first
            .publish
            .clone()
            .expect("the first membership is published");
        assert_eq!(published.epoch, 1);
        // The stale A retry lost: A's row still says 120.
        let same = compute(&partitions(&rows), Some(&published), None);
        assert_eq!((same.scalar, same.epoch), (Some(90), 1));
        let rows = paged(&[
            row("A", Some(120), false, &[]),
            row("B", Some(110), false, &[]),
        ]);
        let later = compute(&partitions(&rows), Some(&published), None);
        assert_eq!((later.scalar, later.epoch), (Some(110), 1));
    }

    fn partitions(rows: &[Row]) -> Vec<ShardCoordinate<'_>> {
        coordinates(rows)
            .into_iter()
            .map(|c| ShardCoordinate { paged: true, ..c })
            .collect()
    }

    /// A stalled partition (no coordinate moves) holds the frontier however far the others go; an
    /// empty page advances nothing by itself (the coordinate moves only by a certified close).
    #[test]
    fn a_stalled_partition_holds_the_frontier() {
        let rows = [
            row("fast", Some(10_000), false, &[]),
            row("stalled", Some(42), false, &[]),
        ];
        assert_eq!(compute(&partitions(&rows), None, None).scalar, Some(42));
    }

    /// Membership changes of paged partitions: a partition discovered later joins (read from its
    /// first page) and withholds the scalar until it carries a coordinate; one moved by a seek
    /// that is not the seek of this change cannot prove coverage, so the change is not published
    /// and the scalar is withheld; a sealed
    /// partition (at SHARD_END) leaves with the next epoch; one that vanished unsealed withholds
    /// the scalar.
    #[test]
    fn membership_changes_need_coverage_and_sealing_proofs() {
        let two = [
            row("a", Some(100), false, &[]),
            row("b", Some(90), false, &[]),
        ];
        let base = compute(&partitions(&two), None, None).publish.unwrap();

        let joined = [
            row("a", Some(100), false, &[]),
            row("b", Some(90), false, &[]),
            row("c", None, false, &[]),
        ];
        let f = compute(&partitions(&joined), Some(&base), None);
        assert_eq!((f.epoch, f.scalar), (2, None), "c has no coordinate yet");
        assert_eq!(f.missing, ["c"]);
        let grown = f.publish.unwrap();
        let covered = [
            row("a", Some(100), false, &[]),
            row("b", Some(90), false, &[]),
            row("c", Some(95), false, &[]),
        ];
        let f = compute(&partitions(&covered), Some(&grown), None);
        assert_eq!((f.epoch, f.scalar), (2, Some(90)));

        let mut seeked = partitions(&joined);
        seeked[2].from_start = false;
        seeked[2].complete_through = Some(95);
        let f = compute(&seeked, Some(&base), None);
        assert_eq!((f.epoch, f.scalar, f.publish.as_ref()), (1, None, None));
        assert_eq!(f.unproven.len(), 1, "{:?}", f.unproven);
        assert_eq!(f.members.len(), 3, "the vector is still there");

        // A seek of every partition, c with them: each moved on the seek's word, the next epoch.
        for row in &mut seeked {
            row.seek_epoch = 1;
            row.from_start = false;
        }
        let f = compute(&seeked, Some(&base), None);
        assert_eq!((f.epoch, f.scalar), (2, Some(90)), "{f:?}");
        assert_eq!(f.publish.map(|m| m.seeks), Some(3));

        let sealed = [
            row("a", Some(100), false, &[]),
            row("b", Some(90), true, &[]),
        ];
        let f = compute(&partitions(&sealed), Some(&base), None);
        assert_eq!((f.epoch, f.scalar), (2, Some(100)), "b sealed and left");

        let f = compute(
            &partitions(&[row("a", Some(100), false, &[])]),
            Some(&base),
            None,
        );
        assert_eq!(
            (f.epoch, f.scalar),
            (2, Some(100)),
            "a deleted row was ended"
        );

        // An ended parent whose child's row was deleted (the child ended and aged out) does not
        // come back.
        let gone = [
            row("p", Some(100), true, &["c"]),
            row("a", Some(120), false, &[]),
        ];
        let f = compute(&coordinates(&gone), None, None);
        assert_eq!(f.members.len(), 1, "{f:?}");

        // A published member whose row is there and not ended cannot leave: here it never does
        // (every unended row is a member), and a Kinesis parent leaves only once its children
        // carry coordinates.
        let split = [
            row("a", Some(100), true, &["a1"]),
            row("a1", None, false, &[]),
            row("b", Some(90), false, &[]),
        ];
        let f = compute(&coordinates(&split), Some(&base), None);
        assert!(f.members.iter().any(|m| m.shard_id == "a"), "a stays");
        assert_eq!(f.scalar, None);
    }

    fn listing(ids: &[&str]) -> Listing {
        Listing {
            ids: ids.iter().map(|id| id.to_string()).collect(),
            at: 1_000,
        }
    }

    /// The issue's live observation, in one scan: A and B complete through 130 and 140 under
    /// epoch 1, and the source's last listing found C (with an event at 50) before C's row was
    /// created. The scalar is withheld naming C, and no membership without C is published; once
    /// C's row exists (read from its first page) it joins under epoch 2 and withholds the scalar
    /// as a member without a coordinate until it has one.
    #[test]
    fn a_partition_listed_without_a_row_withholds_the_scalar() {
        let two = [
            row("A", Some(130), false, &[]),
            row("B", Some(140), false, &[]),
        ];
        let base = compute(&partitions(&two), None, Some(&listing(&["A", "B"])))
            .publish
            .unwrap();
        let unseen = compute(&partitions(&two), Some(&base), None);
        assert_eq!(unseen.scalar, Some(130), "without the listing: the gap");

        let f = compute(
            &partitions(&two),
            Some(&base),
            Some(&listing(&["A", "B", "C"])),
        );
        assert_eq!((f.epoch, f.scalar, f.publish.as_ref()), (1, None, None));
        assert_eq!(f.listed_without_row, ["C"]);
        assert_eq!(f.listed_at, Some(1_000));
        assert_eq!(f.members.len(), 2, "the vector is still there");

        let first = compute(&partitions(&two), None, Some(&listing(&["A", "B", "C"])));
        assert_eq!(
            (first.epoch, first.scalar, first.publish),
            (0, None, None),
            "not even a first membership without C"
        );

        let three = [
            row("A", Some(130), false, &[]),
            row("B", Some(140), false, &[]),
            row("C", None, false, &[]),
        ];
        let f = compute(
            &partitions(&three),
            Some(&base),
            Some(&listing(&["A", "B", "C"])),
        );
        assert_eq!((f.epoch, f.scalar), (2, None));
        assert_eq!(f.missing, ["C"]);
        assert!(f.listed_without_row.is_empty());
        assert_eq!(
            f.publish.map(|m| m.members),
            Some(vec!["A".into(), "B".into(), "C".into()])
        );
    }

    /// A member whose row is gone while the source still lists it was not sealed (rows are
    /// deleted only at SHARD_END, once the source no longer lists them): the scalar is withheld.
    /// Gone and no longer listed, it aged out: sealed.
    #[test]
    fn a_row_gone_while_the_source_lists_it_left_unsealed() {
        let two = [
            row("a", Some(100), false, &[]),
            row("b", Some(90), false, &[]),
        ];
        let base = compute(&partitions(&two), None, None).publish.unwrap();
        let one = [row("a", Some(100), false, &[])];
        let f = compute(&partitions(&one), Some(&base), Some(&listing(&["a", "b"])));
        assert_eq!((f.epoch, f.scalar, f.publish.as_ref()), (1, None, None));
        assert_eq!(f.unproven.len(), 1, "{:?}", f.unproven);
        assert!(
            f.unproven[0].contains("b left without being sealed"),
            "{:?}",
            f.unproven
        );
        let f = compute(&partitions(&one), Some(&base), Some(&listing(&["a"])));
        assert_eq!((f.epoch, f.scalar), (2, Some(100)), "aged out: sealed");
    }

    /// A seek moves the membership only as far as its own proof goes: the rows whose seek epoch
    /// rose since the publication (and their descendants). Here a seek of `a` lands in the same
    /// scan as `z` joining: `z` was moved by an earlier seek (recorded in the membership), so it
    /// proves no coverage, and the change is not published. A seek of `z` itself would be its
    /// proof.
    #[test]
    fn a_seek_epoch_change_does_not_carry_an_unrelated_unproven_member_in() {
        let base = Membership {
            epoch: 3,
            members: vec!["a".into(), "b".into()],
            seeks: 1,
            seek_epochs: BTreeMap::from([("z".to_string(), 1)]),
        };
        let rows = [
            row("a", Some(100), false, &[]),
            row("b", Some(90), false, &[]),
            row("z", Some(500), false, &[]),
        ];
        let mut now = partitions(&rows);
        now[0].seek_epoch = 1;
        now[0].from_start = false;
        now[2].seek_epoch = 1;
        now[2].from_start = false;
        let f = compute(&now, Some(&base), None);
        assert_eq!(
            (f.epoch, f.scalar, f.publish.as_ref()),
            (3, None, None),
            "{f:?}"
        );
        assert_eq!(f.unproven.len(), 1, "{:?}", f.unproven);
        assert!(f.unproven[0].starts_with("z joined"), "{:?}", f.unproven);

        // Without z, the seek of a alone is published: the next epoch, with a's new seek epoch.
        let f = compute(&now[..2], Some(&base), None);
        assert_eq!((f.epoch, f.scalar), (4, Some(90)), "{f:?}");
        let next = f.publish.unwrap();
        assert_eq!(next.seek_epochs, BTreeMap::from([("a".to_string(), 1)]));
        assert_eq!(next.seeks, 1);

        // A seek of z too (its epoch rose past the recorded one): z joins on its word.
        now[2].seek_epoch = 2;
        let f = compute(&now, Some(&base), None);
        assert_eq!((f.epoch, f.scalar), (4, Some(90)), "{f:?}");

        // A membership stored by an older version (the sum of seek epochs only): any row with a
        // seek epoch counts as moved once the sum changed, as before.
        let legacy = Membership {
            epoch: 3,
            members: vec!["a".into(), "b".into()],
            seeks: 1,
            seek_epochs: BTreeMap::new(),
        };
        let f = compute(&now, Some(&legacy), None);
        assert_eq!(f.epoch, 4, "{f:?}");
        now[2].seek_epoch = 0;
        now[0].seek_epoch = 1;
        let f = compute(&now[..2], Some(&legacy), None);
        assert_eq!(
            (f.epoch, f.publish),
            (3, None),
            "the same sum: no seek since"
        );
    }

    /// The descendants of a sought shard move with it: an ended parent sought back to a record
    /// rejoins, and so may its children (reset to their start by the same seek).
    #[test]
    fn a_seek_moves_a_parent_and_its_descendants() {
        let rows = [
            row("p", Some(100), true, &["c"]),
            row("c", Some(120), false, &[]),
        ];
        let base = compute(&coordinates(&rows), None, None).publish.unwrap();
        assert_eq!(base.members, ["c"]);
        let rows = [
            row("p", Some(100), false, &["c"]),
            row("c", Some(120), false, &[]),
        ];
        let parents = vec!["p".to_string()];
        let mut now = coordinates(&rows);
        now[0].seek_epoch = 1;
        now[0].from_start = false;
        now[1].parents = &parents;
        let f = compute(&now, Some(&base), None);
        assert_eq!((f.epoch, f.scalar), (2, Some(100)), "{f:?}");
        assert_eq!(moved_by_seeks(&now, &base), BTreeSet::from(["c", "p"]));
    }

    /// A forward seek's skipped range is on the row, and every frontier reports it beside the
    /// scalar: the scalar does not certify those records.
    #[test]
    fn a_forward_seek_is_reported_as_skipped_by_seek() {
        let skipped = SkippedRange {
            from: SeekCoordinate::Time(100),
            to: SeekCoordinate::Time(5_000),
            seek_epoch: 1,
        };
        let rows = [
            row("a", Some(5_100), false, &[]),
            row("b", Some(6_000), false, &[]),
        ];
        let mut now = partitions(&rows);
        now[0].seek_epoch = 1;
        now[0].from_start = false;
        now[0].skipped = Some(&skipped);
        let f = compute(&now, None, None);
        assert_eq!(f.scalar, Some(5_100));
        assert_eq!(
            f.skipped_by_seek,
            [SkippedBySeek {
                shard_id: "a".into(),
                range: skipped.clone()
            }]
        );
        for c in [
            SeekCoordinate::Start,
            SeekCoordinate::Time(-5),
            SeekCoordinate::Checkpoint("AT:4959".into()),
            SeekCoordinate::End,
        ] {
            assert_eq!(SeekCoordinate::decode(&c.encode()), Some(c));
        }
        assert_eq!(SeekCoordinate::decode("time:x"), None);
    }

    #[test]
    fn an_idle_shard_holds_the_frontier_until_the_caught_up_rule_allows() {
        let idle = ShardProgress {
            last_settled: Some(1_000),
            caught_up_at: Some(60_000),
            floor: Some(999),
            ..Default::default()
        };
        assert_eq!(
            complete_through(&idle, None),
            Some(999),
            "no skew allowance: held"
        );
        assert_eq!(
            complete_through(&idle, Some(Duration::from_secs(5))),
            Some(55_000),
            "caught up: now - skew"
        );
        let reading = ShardProgress {
            oldest_unsettled: Some(2_000),
            caught_up_at: Some(60_000),
            ..idle
        };
        assert_eq!(
            complete_through(&reading, Some(Duration::from_secs(5))),
            Some(1_999),
            "an unsettled delivery holds it"
        );
    }

    #[test]
    fn the_coordinate_never_goes_below_what_is_stored() {
        // A new owner's first view (records re-read from an older checkpoint) cannot lower it.
        let p = ShardProgress {
            oldest_unsettled: Some(500),
            floor: Some(900),
            ..Default::default()
        };
        assert_eq!(complete_through(&p, None), Some(900));
        assert_eq!(complete_through(&ShardProgress::default(), None), None);
    }

    /// Two writers of shard a's coordinate: the owner that lost the lease (a zombie, whose
    /// coordinate 150 was computed from deliveries it no longer owns) and the new owner, which
    /// stored 120. The store refuses the zombie's write, and a stale lower write of the current
    /// owner too, so the frontier over the stored rows never combines them: it stays at
    /// min(120, b's 80) and moves only with b.
    #[tokio::test]
    async fn a_stale_write_that_lost_leaves_the_frontier_unchanged() {
        use crate::lease::{Checkpoint, CheckpointWrite, LeaseStore, MemoryLeaseStore, NewLease};
        let store = MemoryLeaseStore::new();
        let mut owners = Vec::new();
        for (shard, owner) in [("a", "w1"), ("b", "w1")] {
            let new = NewLease {
                stream: "orders".into(),
                shard_id: shard.into(),
                checkpoint: Checkpoint::TrimHorizon,
                parents: vec![],
            };
            assert!(store.create(&new).await.unwrap());
            let seen = store.get("orders", shard).await.unwrap().unwrap();
            let taken = store.take(&seen, owner).await.unwrap().unwrap();
            owners.push(taken.ownership().unwrap());
        }
        let (zombie, b) = (owners[0].clone(), owners[1].clone());
        assert_eq!(
            store.advance_frontier(&zombie, 100).await.unwrap(),
            CheckpointWrite::Written
        );
        assert_eq!(
            store.advance_frontier(&b, 80).await.unwrap(),
            CheckpointWrite::Written
        );
        // w2 steals a and stores 120.
        let seen = store.get("orders", "a").await.unwrap().unwrap();
        let stolen = store.take(&seen, "w2").await.unwrap().unwrap();
        let owner = stolen.ownership().unwrap();
        assert_eq!(
            store.advance_frontier(&owner, 120).await.unwrap(),
            CheckpointWrite::Written
        );
        let stored = || async {
            let rows = store.list("orders").await.unwrap();
            let coordinates: Vec<_> = rows.iter().map(|r| r.coordinate()).collect();
            compute(&coordinates, None, None)
        };
        let before = stored().await;
        assert_eq!(before.scalar, Some(80));
        // The zombie's write loses, and so does the new owner's own stale retry of 110.
        assert_eq!(
            store.advance_frontier(&zombie, 150).await.unwrap(),
            CheckpointWrite::Lost
        );
        assert_eq!(
            store.advance_frontier(&owner, 110).await.unwrap(),
            CheckpointWrite::NotNewer
        );
        let after = stored().await;
        assert_eq!(after, before, "the lost writes changed nothing");
        let a = after.members.iter().find(|m| m.shard_id == "a").unwrap();
        assert_eq!(a.complete_through, Some(120), "neither 150 nor 110");
        // b moving past a: the frontier follows the slower member, a at 120.
        assert_eq!(
            store.advance_frontier(&b, 130).await.unwrap(),
            CheckpointWrite::Written
        );
        assert_eq!(stored().await.scalar, Some(120));
    }
}
