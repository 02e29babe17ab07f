//! Shard sync: which lease rows to create for shards that have none. Pure.

use std::collections::HashSet;

use super::row::{Checkpoint, InitialPosition, Lease, NewLease};
use crate::shard::discovery::ShardInfo;

/// Rows to create, parents before children.
///
/// - A shard descending from a shard that already had a row (a split or merge while consuming,
///   however many times the stream resharded since) starts at the trim horizon, so nothing written
///   to it before its parents ended is missed: the lineage is followed through the rows created in
///   the same pass.
/// - Otherwise the lineage is new to this application and the initial position applies to it, with
///   one refinement: at `Latest`, a closed shard has nothing left at its tip and starts ended.
pub(crate) fn new_leases(
    stream: &str,
    shards: &[ShardInfo],
    existing: &HashSet<String>,
    initial: InitialPosition,
) -> Vec<NewLease> {
    let mut out = Vec::new();
    let mut placed: HashSet<&str> = HashSet::new();
    let listed: HashSet<&str> = shards.iter().map(|s| s.shard_id.as_str()).collect();
    // Parents first: place a shard once each listed parent is placed (or has a row).
    let mut ordered: Vec<&ShardInfo> = Vec::with_capacity(shards.len());
    let mut pending: Vec<&ShardInfo> = shards.iter().collect();
    while !pending.is_empty() {
        let before = pending.len();
        pending.retain(|shard| {
            let ready = shard.parents.iter().all(|p| {
                placed.contains(p.as_str()) || existing.contains(p) || !listed.contains(p.as_str())
            });
            if ready {
                placed.insert(shard.shard_id.as_str());
                ordered.push(shard);
            }
            !ready
        });
        if pending.len() == before {
            // A lineage cycle cannot happen in Kinesis; place the rest as they are.
            ordered.append(&mut pending);
        }
    }
    // Shards whose lineage this application already consumes: those with rows, and their
    // descendants as they are placed.
    let mut consumed: HashSet<&str> = existing.iter().map(String::as_str).collect();
    for shard in ordered {
        if existing.contains(&shard.shard_id) {
            continue;
        }
        let known_lineage = shard.parents.iter().any(|p| consumed.contains(p.as_str()));
        if known_lineage {
            consumed.insert(shard.shard_id.as_str());
        }
        out.push(NewLease {
            stream: stream.to_string(),
            shard_id: shard.shard_id.clone(),
            checkpoint: start_of(shard, known_lineage, initial),
            parents: shard.parents.clone(),
        });
    }
    out
}

/// Rows to create (as [`new_leases`] orders them, parents first) in generations: a row goes in
/// the first generation after every generation holding one of its parents, so the rows of one
/// generation can be created at once and each parent's row exists before its children's.
pub(crate) fn generations(new: Vec<NewLease>) -> Vec<Vec<NewLease>> {
    let mut depth_of: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut out: Vec<Vec<NewLease>> = Vec::new();
    for lease in new {
        let depth = lease
            .parents
            .iter()
            .filter_map(|p| depth_of.get(p).map(|d| d + 1))
            .max()
            .unwrap_or(0);
        depth_of.insert(lease.shard_id.clone(), depth);
        if out.len() <= depth {
            out.resize_with(depth + 1, Vec::new);
        }
        out[depth].push(lease);
    }
    out
}

/// Rows that can go: at SHARD_END, held by nobody, no longer listed by the stream (aged out of
/// retention), and with every recorded child already started (its checkpoint past a start
/// sentinel), so no child waits on them and no frontier member needs them.
pub(crate) fn aged_out<'a>(rows: &'a [Lease], listed: &HashSet<&str>) -> Vec<&'a Lease> {
    let started: HashSet<&str> = rows
        .iter()
        .filter(|r| {
            matches!(
                r.checkpoint,
                Checkpoint::At(_) | Checkpoint::Before(_) | Checkpoint::ShardEnd
            )
        })
        .map(|r| r.shard_id.as_str())
        .collect();
    rows.iter()
        .filter(|r| {
            r.checkpoint == Checkpoint::ShardEnd
                && r.owner.is_none()
                && !listed.contains(r.shard_id.as_str())
                && !r.children.is_empty()
                && r.children.iter().all(|c| started.contains(c.as_str()))
        })
        .collect()
}

fn start_of(shard: &ShardInfo, known_lineage: bool, initial: InitialPosition) -> Checkpoint {
    if known_lineage {
        return Checkpoint::TrimHorizon;
    }
    match initial {
        InitialPosition::Latest if shard.closed => Checkpoint::ShardEnd,
        other => other.checkpoint(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_created_in_generations_each_after_its_parents() {
        let shards = [
            shard("a", &[], true),
            shard("b", &[], false),
            shard("c", &["a"], true),
            shard("d", &["a"], false),
            shard("e", &["c", "b"], false),
            shard("f", &["z"], false),
        ];
        let existing: HashSet<String> = ["z".to_string()].into();
        let new = new_leases("s", &shards, &existing, InitialPosition::TrimHorizon);
        let generations = generations(new);
        let ids: Vec<Vec<&str>> = generations
            .iter()
            .map(|g| g.iter().map(|l| l.shard_id.as_str()).collect())
            .collect();
        // `f`'s parent has a row already: it needs no generation before its own.
        assert_eq!(ids, [vec!["a", "b", "f"], vec!["c", "d"], vec!["e"]]);
        assert!(super::generations(Vec::new()).is_empty());
    }

    fn shard(id: &str, parents: &[&str], closed: bool) -> ShardInfo {
        ShardInfo {
            shard_id: id.into(),
            parents: parents.iter().map(|p| p.to_string()).collect(),
            closed,
        }
    }

    fn plan(
        shards: &[ShardInfo],
        existing: &[&str],
        initial: InitialPosition,
    ) -> Vec<(String, Checkpoint)> {
        let existing = existing.iter().map(|s| s.to_string()).collect();
        new_leases("s", shards, &existing, initial)
            .into_iter()
            .map(|l| (l.shard_id, l.checkpoint))
            .collect()
    }

    #[test]
    fn a_new_stream_starts_every_shard_at_the_initial_position() {
        let shards = [shard("0", &[], false), shard("1", &[], false)];
        assert_eq!(
            plan(&shards, &[], InitialPosition::Latest),
            vec![
                ("0".into(), Checkpoint::Latest),
                ("1".into(), Checkpoint::Latest)
            ]
        );
    }

    #[test]
    fn children_of_a_consumed_parent_start_at_the_trim_horizon() {
        // Split of 0 into 1 and 2 while consuming at LATEST: the children must not skip records.
        let shards = [
            shard("0", &[], true),
            shard("1", &["0"], false),
            shard("2", &["0"], false),
        ];
        assert_eq!(
            plan(&shards, &["0"], InitialPosition::Latest),
            vec![
                ("1".into(), Checkpoint::TrimHorizon),
                ("2".into(), Checkpoint::TrimHorizon)
            ]
        );
    }

    #[test]
    fn descendants_of_a_consumed_shard_start_at_the_trim_horizon_however_many_reshards_ago() {
        // Nobody ran while 0 split into 1 and 2, 1 split into 3 and 4, and 3 merged with 2 into 5:
        // only 0 has a row. Every descendant, closed or open, must be read from its start
        // (found by the simulation, seed 491: 3 started ended and 5 at LATEST, skipping records).
        let shards = [
            shard("0", &[], true),
            shard("1", &["0"], true),
            shard("2", &["0"], true),
            shard("3", &["1"], true),
            shard("4", &["1"], false),
            shard("5", &["3", "2"], false),
            shard("9", &[], false),
        ];
        for initial in [
            InitialPosition::Latest,
            InitialPosition::AtTimestamp(std::time::SystemTime::UNIX_EPOCH),
        ] {
            let planned = plan(&shards, &["0"], initial);
            for (id, checkpoint) in &planned {
                if id == "9" {
                    assert_eq!(
                        *checkpoint,
                        initial.checkpoint(),
                        "an unrelated shard is new"
                    );
                } else {
                    assert_eq!(
                        *checkpoint,
                        Checkpoint::TrimHorizon,
                        "{id} under {initial:?}"
                    );
                }
            }
            assert_eq!(planned.len(), 6);
        }
    }

    #[test]
    fn parents_are_created_before_children_whatever_the_listing_order() {
        let shards = [
            shard("m", &["a", "b"], false),
            shard("b", &[], true),
            shard("a", &[], true),
        ];
        let order: Vec<String> = plan(&shards, &[], InitialPosition::TrimHorizon)
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        assert_eq!(order.last().map(String::as_str), Some("m"));
    }

    #[test]
    fn at_latest_a_closed_shard_new_to_us_starts_ended() {
        let shards = [shard("0", &[], true), shard("1", &["0"], false)];
        assert_eq!(
            plan(&shards, &[], InitialPosition::Latest),
            vec![
                ("0".into(), Checkpoint::ShardEnd),
                ("1".into(), Checkpoint::Latest)
            ]
        );
    }

    #[test]
    fn at_trim_horizon_closed_parents_are_read_first() {
        let shards = [shard("0", &[], true), shard("1", &["0"], false)];
        assert_eq!(
            plan(&shards, &[], InitialPosition::TrimHorizon),
            vec![
                ("0".into(), Checkpoint::TrimHorizon),
                ("1".into(), Checkpoint::TrimHorizon)
            ]
        );
    }

    #[test]
    fn shards_with_rows_are_left_alone() {
        let shards = [shard("0", &[], false)];
        assert!(plan(&shards, &["0"], InitialPosition::TrimHorizon).is_empty());
    }

    fn ended(id: &str, children: &[&str]) -> Lease {
        Lease {
            stream: "s".into(),
            shard_id: id.into(),
            owner: None,
            counter: 3,
            owner_epoch: 1,
            checkpoint: Checkpoint::ShardEnd,
            parents: vec![],
            children: children.iter().map(|c| c.to_string()).collect(),
            complete_through: Some(1),
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

    #[test]
    fn only_ended_aged_out_parents_of_started_children_are_deleted() {
        let mut child_started = ended("c1", &[]);
        child_started.checkpoint = Checkpoint::At(crate::Position::new(
            crate::SequenceNumber::parse("5").unwrap(),
            0,
        ));
        let mut child_new = ended("c2", &[]);
        child_new.checkpoint = Checkpoint::TrimHorizon;
        let mut owned = ended("p-owned", &["c1"]);
        owned.owner = Some("w".into());
        let rows = vec![
            ended("p-gone", &["c1"]),          // aged out, child started: deleted
            ended("p-listed", &["c1"]),        // still in the stream: kept
            ended("p-waiting", &["c1", "c2"]), // a child has not started: kept
            ended("p-no-lineage", &[]),        // children unknown: kept
            owned,                             // someone holds it: kept
            child_started,
            child_new,
        ];
        let listed: HashSet<&str> = ["p-listed", "c1", "c2"].into_iter().collect();
        let gone: Vec<&str> = aged_out(&rows, &listed)
            .iter()
            .map(|r| r.shard_id.as_str())
            .collect();
        assert_eq!(gone, ["p-gone"]);
    }
}
