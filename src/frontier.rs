//! The stream-wide frontier: one statement of how far the whole stream is complete.
//!
//! Each shard's lease row carries `completeThrough`: an arrival-time coordinate T (ms since the
//! Unix epoch) such that every record of the shard that arrived at or before T has a durable
//! terminal outcome. The stream frontier is the minimum over the membership: every shard that is
//! not at SHARD_END, and an ended shard until each of its children carries a coordinate. A fast
//! shard never carries the frontier past a slow one. If any member lacks a coordinate there is no
//! scalar, only the per-shard vector. The membership epoch changes whenever the membership does.
//!
//! All of this is pure: [`complete_through`] for one shard, [`compute`] over the lease rows.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime};

use md5::Digest;

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

/// The stream frontier at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Frontier {
    /// Changes whenever the membership changes (a hash of the member shard ids).
    pub epoch: u64,
    /// The members, by shard id.
    pub members: Vec<Member>,
    /// Every record of the stream that arrived at or before this time (ms) has a durable outcome.
    /// `None` when a member has no coordinate yet (see `missing`) or there are no members.
    pub scalar: Option<i64>,
    /// Members without a coordinate: why there is no scalar.
    pub missing: Vec<String>,
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
}

/// The frontier of the stream whose shards are `rows` (one per lease row).
pub fn compute(rows: &[ShardCoordinate<'_>]) -> Frontier {
    let by_shard: HashMap<&str, &ShardCoordinate<'_>> =
        rows.iter().map(|r| (r.shard_id, r)).collect();
    let covered = |child: &String| {
        by_shard
            .get(child.as_str())
            .is_some_and(|c| c.complete_through.is_some())
    };
    let members: BTreeMap<&str, Member> = rows
        .iter()
        .filter(|r| !r.ended || r.children.is_empty() || !r.children.iter().all(covered))
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
    let mut hasher = md5::Md5::new();
    for m in &members {
        hasher.update(m.shard_id.as_bytes());
        hasher.update(b"\n");
    }
    let digest = hasher.finalize();
    let epoch = u64::from_be_bytes(digest[..8].try_into().expect("8 bytes"));
    let missing: Vec<String> = members
        .iter()
        .filter(|m| m.complete_through.is_none())
        .map(|m| m.shard_id.clone())
        .collect();
    let scalar = if missing.is_empty() {
        members.iter().filter_map(|m| m.complete_through).min()
    } else {
        None
    };
    Frontier {
        epoch,
        members,
        scalar,
        missing,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone)]
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

    fn frontier(rows: &[Row]) -> Frontier {
        let coordinates: Vec<ShardCoordinate<'_>> = rows
            .iter()
            .map(|r| ShardCoordinate {
                shard_id: &r.shard,
                complete_through: r.ct,
                ended: r.ended,
                children: &r.children,
            })
            .collect();
        compute(&coordinates)
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
        let after = frontier(&rows);
        assert!(!after.members.iter().any(|m| m.shard_id == "p"));
        assert_eq!(after.scalar, Some(65));
        assert_ne!(
            before.epoch, after.epoch,
            "a membership change is a new epoch"
        );
    }

    #[test]
    fn a_merge_changes_the_epoch_and_keeps_the_minimum() {
        let before = frontier(&[
            row("a", Some(10), false, &[]),
            row("b", Some(20), false, &[]),
        ]);
        let after = frontier(&[
            row("a", Some(30), true, &["m"]),
            row("b", Some(25), true, &["m"]),
            row("m", Some(40), false, &[]),
        ]);
        assert_eq!(after.scalar, Some(40));
        assert_ne!(before.epoch, after.epoch);
        let same = frontier(&[
            row("a", Some(11), false, &[]),
            row("b", Some(21), false, &[]),
        ]);
        assert_eq!(before.epoch, same.epoch, "same membership, same epoch");
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
            compute(&coordinates)
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
