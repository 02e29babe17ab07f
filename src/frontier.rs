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
//! change ([`Membership`]), so readers can order two frontiers and see a topology change. A
//! change is published only with proof (seed 001): every added member was read from its own
//! start (so it covers everything before the previous frontier), and every removed member is
//! sealed (at SHARD_END, or its row deleted, which happens only to ended rows). Without the proof
//! the scalar is withheld and the epoch stays.
//!
//! All of this is pure: [`complete_through`] for one shard, [`compute`] over the lease rows and
//! the published membership.

use std::collections::{BTreeMap, BTreeSet, HashMap};
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
    /// The seeks the rows had seen when it was published (the sum of their seek epochs): a seek
    /// rewinds the claims of what it moved, so it starts a new epoch too.
    pub seeks: u64,
}

/// The stream frontier at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Frontier {
    /// The membership epoch: an ordered counter, +1 on every published membership change (0: no
    /// membership published yet).
    pub epoch: u64,
    /// The members, by shard id.
    pub members: Vec<Member>,
    /// Every record of the stream that arrived at or before this time (ms) has a durable outcome.
    /// `None` when a member has no coordinate yet (see `missing`) or there are no members.
    pub scalar: Option<i64>,
    /// Members without a coordinate: why there is no scalar.
    pub missing: Vec<String>,
    /// A membership change that cannot be proven safe (an added member not read from its start, a
    /// removed one not sealed): why there is no scalar.
    pub unproven: Vec<String>,
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
pub struct ShardCoordinate<'a> {
    /// The shard.
    pub shard_id: &'a str,
    /// Its stored `completeThrough`, if any.
    pub complete_through: Option<i64>,
    /// Whether it is at SHARD_END.
    pub ended: bool,
    /// Its children, once known.
    pub children: &'a [String],
    /// A paged partition (it has no children: at SHARD_END it is sealed and leaves).
    pub paged: bool,
    /// It was read from its own start (never moved by a seek), or it is a child shard (read from
    /// its start after its parents): it covers every time before any earlier frontier.
    pub from_start: bool,
    /// Its seek epoch (+1 on every seek).
    pub seek_epoch: u64,
}

/// The frontier of the stream whose shards are `rows` (one per lease row), under the membership
/// `published` in the lease table (`None`: none yet).
pub fn compute(rows: &[ShardCoordinate<'_>], published: Option<&Membership>) -> Frontier {
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
    let seeks: u64 = rows.iter().map(|r| r.seek_epoch).sum();
    let (epoch, unproven, publish) = match published {
        None => (
            1,
            Vec::new(),
            Some(Membership {
                epoch: 1,
                members: ids,
                seeks,
            }),
        ),
        Some(p) if p.members == ids && p.seeks == seeks => (p.epoch, Vec::new(), None),
        // A seek rewound members: their claims start again, under the next epoch (they were
        // moved to the seek target, and are read from there).
        Some(p) if p.seeks != seeks => {
            let next = Membership {
                epoch: p.epoch + 1,
                members: ids,
                seeks,
            };
            (next.epoch, Vec::new(), Some(next))
        }
        Some(p) => {
            let before: BTreeSet<&String> = p.members.iter().collect();
            let now: BTreeSet<&String> = ids.iter().collect();
            let mut unproven = Vec::new();
            for added in now.difference(&before) {
                if !by_shard.get(added.as_str()).is_some_and(|r| r.from_start) {
                    unproven.push(format!(
                        "{added} joined without coverage from its start (moved by a seek)"
                    ));
                }
            }
            for removed in before.difference(&now) {
                // A row is deleted only at SHARD_END: absent is sealed.
                if by_shard.get(removed.as_str()).is_some_and(|r| !r.ended) {
                    unproven.push(format!("{removed} left without being sealed"));
                }
            }
            if unproven.is_empty() {
                let next = Membership {
                    epoch: p.epoch + 1,
                    members: ids,
                    seeks,
                };
                (next.epoch, unproven, Some(next))
            } else {
                (p.epoch, unproven, None)
            }
        }
    };
    let scalar = if missing.is_empty() && unproven.is_empty() {
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
        publish,
    }
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
                paged: false,
                from_start: true,
                seek_epoch: 0,
            })
            .collect()
    }

    /// The frontier of `rows` under the membership published by the frontier before it (the
    /// lease table's, as a worker would have stored it).
    fn frontier(rows: &[Row]) -> Frontier {
        compute(&coordinates(rows), None)
    }

    fn after(before: &Frontier, rows: &[Row]) -> Frontier {
        let published = before.publish.clone().unwrap_or(Membership {
            epoch: before.epoch,
            members: before.members.iter().map(|m| m.shard_id.clone()).collect(),
            seeks: 0,
        });
        compute(&coordinates(rows), Some(&published))
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
        let first = compute(&partitions(&rows), None);
        assert_eq!(first.scalar, Some(90));
        let published = first
            .publish
            .clone()
            .expect("the first membership is published");
        assert_eq!(published.epoch, 1);
        // The stale A retry lost: A's row still says 120.
        let same = compute(&partitions(&rows), Some(&published));
        assert_eq!((same.scalar, same.epoch), (Some(90), 1));
        let rows = paged(&[
            row("A", Some(120), false, &[]),
            row("B", Some(110), false, &[]),
        ]);
        let later = compute(&partitions(&rows), Some(&published));
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
        assert_eq!(compute(&partitions(&rows), None).scalar, Some(42));
    }

    /// Membership changes of paged partitions: a partition discovered later joins (read from its
    /// first page) and withholds the scalar until it carries a coordinate; one moved by a seek
    /// cannot prove coverage, so the change is not published and the scalar is withheld; a sealed
    /// partition (at SHARD_END) leaves with the next epoch; one that vanished unsealed withholds
    /// the scalar.
    #[test]
    fn membership_changes_need_coverage_and_sealing_proofs() {
        let two = [
            row("a", Some(100), false, &[]),
            row("b", Some(90), false, &[]),
        ];
        let base = compute(&partitions(&two), None).publish.unwrap();

        let joined = [
            row("a", Some(100), false, &[]),
            row("b", Some(90), false, &[]),
            row("c", None, false, &[]),
        ];
        let f = compute(&partitions(&joined), Some(&base));
        assert_eq!((f.epoch, f.scalar), (2, None), "c has no coordinate yet");
        assert_eq!(f.missing, ["c"]);
        let grown = f.publish.unwrap();
        let covered = [
            row("a", Some(100), false, &[]),
            row("b", Some(90), false, &[]),
            row("c", Some(95), false, &[]),
        ];
        let f = compute(&partitions(&covered), Some(&grown));
        assert_eq!((f.epoch, f.scalar), (2, Some(90)));

        let mut seeked = partitions(&joined);
        seeked[2].from_start = false;
        seeked[2].complete_through = Some(95);
        let f = compute(&seeked, Some(&base));
        assert_eq!((f.epoch, f.scalar, f.publish.as_ref()), (1, None, None));
        assert_eq!(f.unproven.len(), 1, "{:?}", f.unproven);
        assert_eq!(f.members.len(), 3, "the vector is still there");

        // A seek rewinds the claims of what it moved: the next epoch, whatever joined.
        for row in &mut seeked {
            row.seek_epoch = 1;
            row.from_start = false;
        }
        let f = compute(&seeked, Some(&base));
        assert_eq!((f.epoch, f.scalar), (2, Some(90)), "{f:?}");
        assert_eq!(f.publish.map(|m| m.seeks), Some(3));

        let sealed = [
            row("a", Some(100), false, &[]),
            row("b", Some(90), true, &[]),
        ];
        let f = compute(&partitions(&sealed), Some(&base));
        assert_eq!((f.epoch, f.scalar), (2, Some(100)), "b sealed and left");

        let f = compute(&partitions(&[row("a", Some(100), false, &[])]), Some(&base));
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
        let f = compute(&coordinates(&gone), None);
        assert_eq!(f.members.len(), 1, "{f:?}");

        // A published member whose row is there and not ended cannot leave: here it never does
        // (every unended row is a member), and a Kinesis parent leaves only once its children
        // carry coordinates.
        let split = [
            row("a", Some(100), true, &["a1"]),
            row("a1", None, false, &[]),
            row("b", Some(90), false, &[]),
        ];
        let f = compute(&coordinates(&split), Some(&base));
        assert!(f.members.iter().any(|m| m.shard_id == "a"), "a stays");
        assert_eq!(f.scalar, None);
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
            compute(&coordinates, None)
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
