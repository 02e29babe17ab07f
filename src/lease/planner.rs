//! Which leases to take, ask for and steal: pure, synchronous, and tested from a table of
//! scenarios.
//!
//! Inputs are the rows of one consistent scan plus what the manager observed locally (which held
//! leases are expired, which leases this worker holds, which handoffs it asked for and how long
//! ago); the output is a list of conditional takes and handoff requests. A live lease moves by a
//! request first (cooperative handoff, `docs/leases.md`), and by a steal only once the request
//! went unanswered for the taker's patience.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::row::Lease;

/// Balancing settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanLimits {
    /// Ask for leases only while the most loaded worker holds at least this many more than this
    /// one.
    pub imbalance: usize,
    /// Leases stolen per scan at most (after their handoff requests went unanswered). Requests
    /// themselves are not capped: a worker below its share asks for all it lacks in one pass.
    pub max_steals_per_scan: usize,
    /// Leases this worker holds at most.
    pub max_leases: usize,
}

impl Default for PlanLimits {
    fn default() -> Self {
        Self {
            imbalance: 2,
            max_steals_per_scan: 10,
            max_leases: usize::MAX,
        }
    }
}

/// One lease as the planner sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Seen<'a> {
    /// The row from the scan.
    pub(crate) lease: &'a Lease,
    /// An owned lease: its owner has not renewed it for a lease duration, or is dead by the
    /// roster (local clock). An unowned one: no worker took it for a lease duration.
    pub(crate) expired: bool,
    /// Left untaken: unowned and expired, or owned and still for two lease durations (its owner
    /// is gone and the worker it fell to did not take it). Anyone below `max_leases` takes it.
    pub(crate) neglected: bool,
}

/// A conditional take the manager should attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Take {
    /// An unowned or expired lease that falls to this worker, or one recorded as ours that this
    /// process does not hold.
    Free(String),
    /// A live lease of an overloaded worker whose owner did not hand it over in time after a
    /// request (or never will: it is stuck or paused).
    Steal {
        /// The shard.
        shard_id: String,
        /// Its current owner.
        from: String,
    },
    /// A live lease of an overloaded worker: ask its owner to hand it over (cooperative handoff).
    Request {
        /// The shard.
        shard_id: String,
        /// Its current owner.
        from: String,
    },
}

/// The summary the plan was made from, for logs and metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// What to take, in order.
    pub(crate) takes: Vec<Take>,
    /// Leases that may be read now (not ended, parents ended).
    pub(crate) active: usize,
    /// Live workers, this one included.
    pub(crate) workers: usize,
    /// ceil(active / workers), capped by `max_leases`.
    pub(crate) target: usize,
    /// Something is moving: this plan takes or asks for leases, or free leases fell to other
    /// workers that have yet to take them. Keep scanning often until a plan finds nothing to do.
    pub(crate) settling: bool,
    /// A lease waits for a parent that the last listing names and that has no row yet: a row
    /// still being created, or a listing older than the row's deletion (list again).
    pub(crate) waiting_for_rows: bool,
}

/// Whether every parent of `lease` is at SHARD_END. A parent with no row counts as ended only
/// when the source's last listing (`listed`, if there is one) lacks it too: it aged out of the
/// stream. A listed parent without a row is one whose row is still being created (a sync that
/// creates rows one by one, racing this scan): its child waits, or it would be read before its
/// parent and per-key order across the split would be lost.
pub(crate) fn parents_ended(
    lease: &Lease,
    by_shard: &HashMap<&str, &Lease>,
    listed: Option<&BTreeSet<String>>,
) -> bool {
    lease
        .parents
        .iter()
        .all(|p| match by_shard.get(p.as_str()) {
            Some(parent) => parent.checkpoint.is_shard_end(),
            None => listed.is_none_or(|listed| !listed.contains(p)),
        })
}

/// Whether `lease` waits for a parent that the last listing names and that has no row yet.
fn waits_for_a_row(
    lease: &Lease,
    by_shard: &HashMap<&str, &Lease>,
    listed: Option<&BTreeSet<String>>,
) -> bool {
    listed.is_some_and(|listed| {
        lease
            .parents
            .iter()
            .any(|p| !by_shard.contains_key(p.as_str()) && listed.contains(p))
    })
}

/// Decides what `me` should take this scan. `held` names the shards this process holds now;
/// `requests` the handoffs it asked for and still waits for (`true`: the wait is over, the owner
/// did not hand over in time); `roster` the workers alive by their beats (they count toward the
/// share even while they hold nothing).
#[cfg(test)]
pub(crate) fn plan(
    me: &str,
    seen: &[Seen<'_>],
    held: &HashSet<String>,
    requests: &HashMap<String, bool>,
    roster: &[String],
    limits: PlanLimits,
) -> Plan {
    plan_listed(me, seen, held, requests, roster, limits, None)
}

/// [`plan`], knowing the source's last listing (`listed`): a parent it names without a row is
/// not taken for ended.
pub(crate) fn plan_listed(
    me: &str,
    seen: &[Seen<'_>],
    held: &HashSet<String>,
    requests: &HashMap<String, bool>,
    roster: &[String],
    limits: PlanLimits,
    listed: Option<&BTreeSet<String>>,
) -> Plan {
    let by_shard: HashMap<&str, &Lease> = seen
        .iter()
        .map(|s| (s.lease.shard_id.as_str(), s.lease))
        .collect();
    let active: Vec<&Seen<'_>> = seen
        .iter()
        .filter(|s| !s.lease.checkpoint.is_shard_end() && parents_ended(s.lease, &by_shard, listed))
        .collect();
    let waiting_for_rows = seen
        .iter()
        .any(|s| !s.lease.checkpoint.is_shard_end() && waits_for_a_row(s.lease, &by_shard, listed));

    // Live workers: alive by the roster, owners of unexpired active leases, and me.
    let mut load: BTreeMap<&str, usize> = roster.iter().map(|w| (w.as_str(), 0)).collect();
    load.insert(me, 0);
    for s in &active {
        if let Some(owner) = s.lease.owner.as_deref()
            && !s.expired
        {
            load.insert(owner, 0);
        }
    }

    // Live holdings per worker (this worker: what it really holds). A lease asked for by a live
    // worker counts for that taker, not its owner: it is on its way.
    let mut owned: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    let mut retake: Vec<&str> = Vec::new();
    // Free leases, and whether each was left untaken for a lease duration (`neglected`).
    let mut free: Vec<(&str, bool)> = Vec::new();
    for s in &active {
        let shard = s.lease.shard_id.as_str();
        match s.lease.owner.as_deref() {
            Some(owner) if owner == me && !held.contains(shard) => retake.push(shard),
            Some(owner) if owner == me || !s.expired => {
                owned.entry(owner).or_default().push(shard);
                let counts_for = match s.lease.wanted_by.as_deref() {
                    Some(taker) if taker != owner && load.contains_key(taker) => taker,
                    _ => owner,
                };
                *load.entry(counts_for).or_default() += 1;
            }
            _ => free.push((shard, s.neglected)),
        }
    }
    *load.entry(me).or_default() += retake.len();

    let workers = load.len();
    let target = active.len().div_ceil(workers).min(limits.max_leases);
    // A row naming me that this process does not hold is mine alone: take it back.
    let mut takes: Vec<Take> = retake
        .iter()
        .map(|shard| Take::Free((*shard).to_string()))
        .collect();

    // Free leases: in shard order, each to the live worker with room that ranks highest for it.
    // Every worker computes the same sharing from the same scan and takes only its own part, so
    // workers do not race for the same rows. A lease left free for a lease duration (the worker
    // it fell to did not take it: stuck, or misbehaving) is taken by anyone below `max_leases`,
    // above its target if need be: a lease must be read; balancing moves it later.
    let mut room: BTreeMap<&str, (usize, u64)> = load
        .iter()
        .map(|(w, n)| (*w, (target.saturating_sub(*n), worker_prefix(w))))
        .collect();
    free.sort_unstable();
    let mut left_to_others = 0;
    for (shard, neglected) in &free {
        let winner = if *neglected && load[me] < limits.max_leases {
            Some(me)
        } else {
            room.iter()
                .filter(|(_, (r, _))| *r > 0)
                .max_by_key(|(w, (_, prefix))| (rank_after(*prefix, shard), std::cmp::Reverse(**w)))
                .map(|(w, _)| *w)
        };
        let Some(winner) = winner else { continue };
        let (left, _) = room.get_mut(winner).expect("a live worker");
        *left = left.saturating_sub(1);
        if winner == me {
            takes.push(Take::Free((*shard).to_string()));
            *load.get_mut(me).expect("me") += 1;
        } else {
            left_to_others += 1;
        }
    }

    // Handoffs asked for whose wait is over: steal them (the owner is stuck or paused).
    let mut moves = 0;
    let mut overdue: Vec<&String> = requests
        .iter()
        .filter(|(_, over)| **over)
        .map(|(shard, _)| shard)
        .collect();
    overdue.sort_unstable();
    for shard in overdue {
        let Some(lease) = by_shard.get(shard.as_str()) else {
            continue;
        };
        let owner = lease.owner.as_deref().unwrap_or_default();
        if moves < limits.max_steals_per_scan
            && lease.wanted_by.as_deref() == Some(me)
            && owner != me
            && owned
                .get(owner)
                .is_some_and(|o| o.contains(&shard.as_str()))
        {
            takes.push(Take::Steal {
                shard_id: shard.clone(),
                from: owner.to_string(),
            });
            moves += 1;
        }
    }

    // With every free lease shared out: ask the most loaded workers for leases, one at a time,
    // while one holds at least `imbalance` more than me: all that is lacking in one pass (a
    // request moves nothing by itself, and each owner hands over at its own pace).
    if free.is_empty() {
        let mut asked: HashSet<&str> = HashSet::new();
        let my_prefix = worker_prefix(me);
        // The lease of `victim` to ask for: not one anyone asked for already, and the one that
        // ranks highest for me, so two takers asking at once mostly ask for different leases.
        let askable = |victim: &str, asked: &HashSet<&str>| -> Option<&str> {
            owned
                .get(victim)
                .into_iter()
                .flatten()
                .copied()
                .filter(|shard| {
                    !asked.contains(shard)
                        && by_shard.get(shard).is_some_and(|l| l.wanted_by.is_none())
                })
                .max_by_key(|shard| (rank_after(my_prefix, shard), std::cmp::Reverse(*shard)))
        };
        while load[me] < target {
            let mine = load[me];
            let Some((victim, victim_load, shard)) = load
                .iter()
                .filter(|(w, _)| **w != me)
                .filter_map(|(w, n)| askable(w, &asked).map(|shard| (*w, *n, shard)))
                .max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(a.0)))
            else {
                break;
            };
            if victim_load < mine + limits.imbalance {
                break;
            }
            asked.insert(shard);
            takes.push(Take::Request {
                shard_id: shard.to_string(),
                from: victim.to_string(),
            });
            *load.get_mut(victim).expect("victim") -= 1;
            *load.get_mut(me).expect("me") += 1;
        }
    }

    Plan {
        settling: !takes.is_empty() || left_to_others > 0,
        takes,
        active: active.len(),
        workers,
        target,
        waiting_for_rows,
    }
}

/// For a source whose partition names come back once gone (`Contract::names_reused`, whose
/// partitions end only when gone): the rows of gone partitions left at SHARD_END, to delete
/// (conditioned on SHARD_END and the counter seen). Such a row blocks a name listed again: no
/// worker takes an ended row. Left by an owner that stopped, or whose release or deletion failed,
/// after ending it: held by nobody, by `me` without this process holding it, or by another worker
/// that let it expire. A row its owner still holds is its owner's to delete; a row with lineage is
/// never one of these.
pub(crate) fn left_by_gone<'a>(
    me: &str,
    seen: &[Seen<'a>],
    held: &HashSet<String>,
) -> Vec<&'a Lease> {
    seen.iter()
        .filter(|s| {
            let row = s.lease;
            row.checkpoint.is_shard_end()
                && row.parents.is_empty()
                && row.children.is_empty()
                && match row.owner.as_deref() {
                    None => true,
                    Some(owner) if owner == me => !held.contains(&row.shard_id),
                    Some(_) => s.expired,
                }
        })
        .map(|s| s.lease)
        .collect()
}

/// Whether `row` is a retired partition to leave alone ([`Lease::retired_at`]): nobody holds it,
/// and the source's last listing (`listed`) names it without activity after its retirement
/// (`last_activity`, the provider's time, ms). A retired row is woken (taken like any free one)
/// once the listing shows activity after it, or no longer names it (the partition's reader then
/// finds it gone and its row is deleted). Before any listing, it stays retired.
pub(crate) fn dormant(
    row: &Lease,
    listed: Option<&BTreeSet<String>>,
    last_activity: impl Fn(&str) -> Option<i64>,
) -> bool {
    let (Some(retired), None, Some(listed)) = (row.retired_at, &row.owner, listed) else {
        return row.retired_at.is_some() && row.owner.is_none() && listed.is_none();
    };
    listed.contains(&row.shard_id) && last_activity(&row.shard_id).is_none_or(|t| t <= retired)
}

/// The hash state after `worker` and its separator: what every rank for `worker` starts from, so
/// sharing out many leases hashes each worker's id once.
fn worker_prefix(worker: &str) -> u64 {
    // FNV-1a: fixed across processes and versions, unlike the standard library's hasher.
    fnv(fnv(0xcbf2_9ce4_8422_2325, worker.as_bytes()), &[0xff])
}

/// How high `shard` ranks for the worker of `prefix` (rendezvous hashing): the same on every
/// worker, and in every version (workers of two versions share a table during a deploy).
fn rank_after(prefix: u64, shard: &str) -> u64 {
    let mut h = fnv(prefix, shard.as_bytes());
    // Mix the low bits up, since FNV's high bits move little for short keys.
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^ (h >> 33)
}

/// FNV-1a over `bytes` from the state `h`. A plain loop: the planner ranks every free lease for
/// every worker with room (400,000 ranks for 2,000 leases and 200 workers), and an iterator chain
/// here made it most of a debug build's time.
fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::Checkpoint;

    /// A scan row: shard, owner, expired, ended, parents.
    type Row = (
        &'static str,
        Option<&'static str>,
        bool,
        bool,
        &'static [&'static str],
    );

    #[test]
    fn ranks_are_the_same_in_every_version() {
        let rank = |worker: &str, shard: &str| rank_after(worker_prefix(worker), shard);
        assert_eq!(
            rank("worker-a", "shardId-000000000000"),
            0xe487_bfec_31bd_fdfe
        );
        assert_eq!(
            rank(
                "ip-10-0-001-002.eu-west-1.compute.internal-000031",
                "shardId-000000001999"
            ),
            0x62ef_ac47_fba1_a1d3
        );
    }

    fn lease(row: &Row) -> Lease {
        let (shard, owner, _, ended, parents) = *row;
        Lease {
            stream: "s".into(),
            shard_id: shard.into(),
            owner: owner.map(str::to_string),
            counter: 1,
            owner_epoch: 1,
            checkpoint: if ended {
                Checkpoint::ShardEnd
            } else {
                Checkpoint::TrimHorizon
            },
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

    struct Case {
        /// Why this scenario matters.
        what: &'static str,
        me: &'static str,
        held: &'static [&'static str],
        rows: &'static [Row],
        /// Number of free takes and steals expected, and the victim of any steal.
        free: usize,
        steals: usize,
        victim: Option<&'static str>,
        target: usize,
    }

    const CASES: &[Case] = &[
        Case {
            what: "a lone worker on a new stream takes every shard",
            me: "a",
            held: &[],
            rows: &[
                ("0", None, false, false, &[]),
                ("1", None, false, false, &[]),
                ("2", None, false, false, &[]),
            ],
            free: 3,
            steals: 0,
            victim: None,
            target: 3,
        },
        Case {
            what: "a new worker joins a worker holding 4: it asks for its whole share in one pass",
            me: "b",
            held: &[],
            rows: &[
                ("0", Some("a"), false, false, &[]),
                ("1", Some("a"), false, false, &[]),
                ("2", Some("a"), false, false, &[]),
                ("3", Some("a"), false, false, &[]),
            ],
            free: 0,
            steals: 2,
            victim: Some("a"),
            target: 2,
        },
        Case {
            what: "a worker died: its expired leases are free and taken up to the target",
            me: "a",
            held: &["0", "1"],
            rows: &[
                ("0", Some("a"), false, false, &[]),
                ("1", Some("a"), false, false, &[]),
                ("2", Some("dead"), true, false, &[]),
                ("3", Some("dead"), true, false, &[]),
            ],
            free: 2,
            steals: 0,
            victim: None,
            target: 4,
        },
        Case {
            what: "uneven by one (3,3,2 of 8) is balanced: no steal, no churn",
            me: "c",
            held: &["6", "7"],
            rows: &[
                ("0", Some("a"), false, false, &[]),
                ("1", Some("a"), false, false, &[]),
                ("2", Some("a"), false, false, &[]),
                ("3", Some("b"), false, false, &[]),
                ("4", Some("b"), false, false, &[]),
                ("5", Some("b"), false, false, &[]),
                ("6", Some("c"), false, false, &[]),
                ("7", Some("c"), false, false, &[]),
            ],
            free: 0,
            steals: 0,
            victim: None,
            target: 3,
        },
        Case {
            what: "uneven by two (4,2,2 of 8) steals one from the most loaded",
            me: "c",
            held: &["6", "7"],
            rows: &[
                ("0", Some("a"), false, false, &[]),
                ("1", Some("a"), false, false, &[]),
                ("2", Some("a"), false, false, &[]),
                ("3", Some("a"), false, false, &[]),
                ("4", Some("b"), false, false, &[]),
                ("5", Some("b"), false, false, &[]),
                ("6", Some("c"), false, false, &[]),
                ("7", Some("c"), false, false, &[]),
            ],
            free: 0,
            steals: 1,
            victim: Some("a"),
            target: 3,
        },
        Case {
            what: "free leases are taken before anything is stolen",
            me: "b",
            held: &[],
            rows: &[
                ("0", Some("a"), false, false, &[]),
                ("1", Some("a"), false, false, &[]),
                ("2", Some("a"), false, false, &[]),
                ("3", None, false, false, &[]),
            ],
            free: 1,
            steals: 0,
            victim: None,
            target: 2,
        },
        Case {
            what: "resharded: children wait while a parent is open; ended parents count for nobody",
            me: "a",
            held: &[],
            rows: &[
                ("p", None, false, false, &[]),
                ("c1", None, false, false, &["p"]),
                ("c2", None, false, false, &["p"]),
                ("old", None, false, true, &[]),
            ],
            free: 1,
            steals: 0,
            victim: None,
            target: 1,
        },
        Case {
            what: "resharded: a merge child is eligible once both parents are at SHARD_END",
            me: "a",
            held: &[],
            rows: &[
                ("p1", None, false, true, &[]),
                ("p2", None, false, true, &[]),
                ("m", None, false, false, &["p1", "p2"]),
            ],
            free: 1,
            steals: 0,
            victim: None,
            target: 1,
        },
        Case {
            what: "resharded: a merge child waits while one parent is still open",
            me: "a",
            held: &["p2"],
            rows: &[
                ("p1", None, false, true, &[]),
                ("p2", Some("a"), false, false, &[]),
                ("m", None, false, false, &["p1", "p2"]),
            ],
            free: 0,
            steals: 0,
            victim: None,
            target: 1,
        },
        Case {
            what: "a parent that aged out of the stream (no row) does not block its child",
            me: "a",
            held: &[],
            rows: &[("c", None, false, false, &["gone"])],
            free: 1,
            steals: 0,
            victim: None,
            target: 1,
        },
        Case {
            what: "a row naming me that this process does not hold (restart, same id) is retaken",
            me: "a",
            held: &[],
            rows: &[("0", Some("a"), false, false, &[])],
            free: 1,
            steals: 0,
            victim: None,
            target: 1,
        },
    ];

    /// A child whose parent has no row waits while the last listing names the parent (its row
    /// is being created: a sync racing the scan), and is read once the listing no longer does
    /// (the parent aged out of the stream). Before, a missing row counted as ended at once, and
    /// the child could be read from TRIM_HORIZON before its parent.
    #[test]
    fn a_parent_without_a_row_blocks_its_child_only_while_the_listing_names_it() {
        let rows = [lease(&("c", None, false, false, &["p"]))];
        let seen: Vec<Seen<'_>> = rows
            .iter()
            .map(|lease| Seen {
                lease,
                expired: false,
                neglected: false,
            })
            .collect();
        let listing =
            |ids: &[&str]| -> BTreeSet<String> { ids.iter().map(|s| s.to_string()).collect() };
        let scan = |listed: Option<&BTreeSet<String>>| {
            plan_listed(
                "a",
                &seen,
                &HashSet::new(),
                &HashMap::new(),
                &[],
                PlanLimits::default(),
                listed,
            )
        };
        let racing = scan(Some(&listing(&["p", "c"])));
        assert_eq!(
            (racing.active, racing.takes.len()),
            (0, 0),
            "the child waits"
        );
        assert!(racing.waiting_for_rows);
        let aged_out = scan(Some(&listing(&["c"])));
        assert_eq!(
            (aged_out.active, aged_out.takes.len()),
            (1, 1),
            "the child is read"
        );
        assert!(!aged_out.waiting_for_rows);
    }

    #[test]
    fn table_of_scenarios() {
        for case in CASES {
            let leases: Vec<Lease> = case.rows.iter().map(lease).collect();
            let seen: Vec<Seen<'_>> = leases
                .iter()
                .zip(case.rows)
                .map(|(lease, row)| Seen {
                    lease,
                    expired: row.2,
                    neglected: row.2 && lease.owner.is_none(),
                })
                .collect();
            let held = case.held.iter().map(|s| s.to_string()).collect();
            let plan = plan(
                case.me,
                &seen,
                &held,
                &HashMap::new(),
                &[],
                PlanLimits::default(),
            );
            let free = plan
                .takes
                .iter()
                .filter(|t| matches!(t, Take::Free(_)))
                .count();
            let steals: Vec<&str> = plan
                .takes
                .iter()
                .filter_map(|t| match t {
                    // Without an earlier request, a move from a live owner starts as a request.
                    Take::Request { from, .. } => Some(from.as_str()),
                    _ => None,
                })
                .collect();
            assert_eq!(free, case.free, "{}: free takes", case.what);
            assert_eq!(steals.len(), case.steals, "{}: steals", case.what);
            assert_eq!(
                steals.first().copied(),
                case.victim,
                "{}: victim",
                case.what
            );
            assert_eq!(plan.target, case.target, "{}: target", case.what);
        }
    }

    #[test]
    fn max_leases_caps_the_target() {
        let rows: Vec<Row> = vec![
            ("0", None, false, false, &[]),
            ("1", None, false, false, &[]),
        ];
        let leases: Vec<Lease> = rows.iter().map(lease).collect();
        let seen: Vec<_> = leases
            .iter()
            .map(|lease| Seen {
                lease,
                expired: false,
                neglected: false,
            })
            .collect();
        let limits = PlanLimits {
            max_leases: 1,
            ..PlanLimits::default()
        };
        assert_eq!(
            plan("a", &seen, &HashSet::new(), &HashMap::new(), &[], limits)
                .takes
                .len(),
            1
        );
    }

    /// A handoff asked for is awaited (nothing more is asked while it counts toward the share),
    /// then stolen once the wait is over; a lease another worker asked for is left to it.
    #[test]
    fn a_requested_handoff_is_awaited_then_stolen_when_overdue() {
        // b holds 4, a holds 0: a asks for one.
        let mut leases: Vec<Lease> = ["0", "1", "2", "3"]
            .iter()
            .map(|s| {
                let mut l = lease(&("x", Some("b"), false, false, &[]));
                l.shard_id = s.to_string();
                l
            })
            .collect();
        let seen = |leases: &[Lease]| -> Vec<Lease> { leases.to_vec() };
        let scan = |leases: &[Lease], requests: &HashMap<String, bool>| -> Vec<Take> {
            let rows = seen(leases);
            let seen: Vec<Seen<'_>> = rows
                .iter()
                .map(|lease| Seen {
                    lease,
                    expired: false,
                    neglected: false,
                })
                .collect();
            plan(
                "a",
                &seen,
                &HashSet::new(),
                requests,
                &[],
                PlanLimits::default(),
            )
            .takes
        };
        let first = scan(&leases, &HashMap::new());
        let [
            Take::Request { shard_id, from },
            Take::Request {
                from: also_from, ..
            },
        ] = &first[..]
        else {
            panic!("{first:?}");
        };
        assert_eq!((from.as_str(), also_from.as_str()), ("b", "b"));
        let asked = shard_id.clone();
        leases
            .iter_mut()
            .find(|l| l.shard_id == asked)
            .unwrap()
            .wanted_by = Some("a".into());
        // Awaited: target 2, one coming, one more asked for (another shard).
        let waiting = HashMap::from([(asked.clone(), false)]);
        let second = scan(&leases, &waiting);
        assert!(
            second
                .iter()
                .all(|t| matches!(t, Take::Request { shard_id, .. } if *shard_id != asked)),
            "{second:?}"
        );
        // Overdue: stolen.
        let overdue = HashMap::from([(asked.clone(), true)]);
        let third = scan(&leases, &overdue);
        assert!(
            matches!(&third[0], Take::Steal { shard_id, .. } if *shard_id == asked),
            "{third:?}"
        );
        // Another worker's request is left alone.
        let other = scan(
            &leases
                .iter()
                .cloned()
                .map(|mut l| {
                    l.wanted_by = Some("c".into());
                    l
                })
                .collect::<Vec<_>>(),
            &HashMap::new(),
        );
        assert!(other.is_empty(), "{other:?}");
    }

    /// Workers that run the planner in turns, each applying its takes, converge to a balanced
    /// assignment (max - min <= 1 with imbalance 2) and then stop taking.
    #[test]
    fn repeated_scans_converge_and_then_stay() {
        for (shards, workers) in [(8usize, 3usize), (4, 3), (16, 5), (3, 4)] {
            let names: Vec<String> = (0..workers).map(|w| format!("w{w}")).collect();
            let mut owner: Vec<Option<String>> = vec![None; shards];
            let mut quiet_rounds = 0;
            for _round in 0..200 {
                let mut changed = false;
                for me in &names {
                    let leases: Vec<Lease> = (0..shards)
                        .map(|s| {
                            let mut l = lease(&("x", None, false, false, &[]));
                            l.shard_id = s.to_string();
                            l.owner = owner[s].clone();
                            l
                        })
                        .collect();
                    let seen: Vec<_> = leases
                        .iter()
                        .map(|lease| Seen {
                            lease,
                            expired: false,
                            neglected: false,
                        })
                        .collect();
                    let held = (0..shards)
                        .filter(|s| owner[*s].as_deref() == Some(me))
                        .map(|s| s.to_string())
                        .collect();
                    // A request is handed over at once here (the owner passes the lease).
                    let plan = plan(
                        me,
                        &seen,
                        &held,
                        &HashMap::new(),
                        &names,
                        PlanLimits::default(),
                    );
                    for take in plan.takes {
                        let shard = match take {
                            Take::Free(s)
                            | Take::Steal { shard_id: s, .. }
                            | Take::Request { shard_id: s, .. } => s,
                        };
                        owner[shard.parse::<usize>().unwrap()] = Some(me.clone());
                        changed = true;
                    }
                }
                quiet_rounds = if changed { 0 } else { quiet_rounds + 1 };
            }
            assert!(
                quiet_rounds >= 100,
                "{shards} shards / {workers} workers keep churning"
            );
            let counts: Vec<usize> = names
                .iter()
                .map(|n| owner.iter().filter(|o| o.as_deref() == Some(n)).count())
                .collect();
            assert!(owner.iter().all(Option::is_some), "every shard is owned");
            let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
            assert!(max - min <= 1, "{shards}/{workers}: {counts:?}");
        }
    }

    fn free_rows(shards: usize) -> Vec<Lease> {
        (0..shards)
            .map(|s| {
                let mut l = lease(&("x", None, false, false, &[]));
                l.shard_id = format!("shardId-{s:012}");
                l
            })
            .collect()
    }

    /// Workers starting together (all in the roster) that plan from the same scan take disjoint
    /// sets that cover every shard, each its share: no write of one is refused by another's.
    #[test]
    fn workers_starting_together_share_free_leases_without_racing() {
        for (shards, workers) in [(200usize, 4usize), (7, 3), (1000, 20), (3, 5)] {
            let names: Vec<String> = (0..workers).map(|w| format!("worker-{w}")).collect();
            let leases = free_rows(shards);
            let seen = seen_all(&leases, |_| false);
            let mut taken: HashMap<String, &str> = HashMap::new();
            for me in &names {
                let plan = plan(
                    me,
                    &seen,
                    &HashSet::new(),
                    &HashMap::new(),
                    &names,
                    PlanLimits::default(),
                );
                assert_eq!(plan.target, shards.div_ceil(workers));
                assert!(plan.takes.len() <= plan.target);
                for take in plan.takes {
                    let Take::Free(shard) = take else {
                        panic!("{take:?}")
                    };
                    assert!(
                        taken.insert(shard, me).is_none(),
                        "two workers take one lease"
                    );
                }
            }
            assert_eq!(
                taken.len(),
                shards,
                "{shards}/{workers}: every lease falls to someone"
            );
        }
    }

    /// A worker in the roster that holds nothing yet counts toward the share, so a worker alone
    /// with the rows does not take them all.
    #[test]
    fn an_idle_worker_in_the_roster_counts_toward_the_share() {
        let leases = free_rows(10);
        let seen = seen_all(&leases, |_| false);
        let roster = vec!["a".to_string(), "b".to_string()];
        let plan = plan(
            "a",
            &seen,
            &HashSet::new(),
            &HashMap::new(),
            &roster,
            PlanLimits::default(),
        );
        assert_eq!((plan.workers, plan.target, plan.takes.len()), (2, 5, 5));
    }

    /// A fourth worker joining three balanced ones on 200 leases asks for its whole share in one
    /// pass, from all three, never twice for one lease, and counts what it asked for on the next
    /// pass (asking nothing more).
    #[test]
    fn a_joining_worker_asks_the_most_loaded_for_its_share() {
        let names: Vec<String> = ["a", "b", "c", "d"].iter().map(|s| s.to_string()).collect();
        let mut leases = free_rows(200);
        for (i, l) in leases.iter_mut().enumerate() {
            l.owner = Some(names[i % 3].clone());
        }
        let mut asked = HashSet::new();
        for _pass in 0..10 {
            let seen = seen_all(&leases, |_| false);
            let plan = plan(
                "d",
                &seen,
                &HashSet::new(),
                &HashMap::new(),
                &names,
                PlanLimits::default(),
            );
            assert_eq!(
                plan.takes.len(),
                if asked.is_empty() { 50 } else { 0 },
                "all at once, then nothing more"
            );
            let takes = plan.takes.clone();
            for take in takes {
                let Take::Request { shard_id, .. } = take else {
                    panic!("{take:?}")
                };
                assert!(asked.insert(shard_id.clone()), "asked twice for {shard_id}");
                leases
                    .iter_mut()
                    .find(|l| l.shard_id == shard_id)
                    .unwrap()
                    .wanted_by = Some("d".into());
            }
        }
        assert_eq!(asked.len(), 50, "d asks for exactly its share");
        let from: BTreeMap<&str, usize> =
            leases
                .iter()
                .filter(|l| l.wanted_by.is_some())
                .fold(BTreeMap::new(), |mut m, l| {
                    *m.entry(l.owner.as_deref().unwrap()).or_default() += 1;
                    m
                });
        // 67, 67, 66 down to 50 each: 17 + 17 + 16.
        assert_eq!(from.values().copied().collect::<Vec<_>>(), vec![17, 17, 16]);
    }

    /// A retired, unowned row is left out of the plan while the last listing names it with no
    /// activity after its retirement (or says nothing of its activity); activity after it, or a
    /// listing without it, wakes it. Held rows and rows never retired are never hidden.
    #[test]
    fn retired_rows_sleep_until_the_listing_shows_activity_after_them_or_drops_them() {
        let mut row = lease(&("p", None, false, false, &[]));
        row.retired_at = Some(1_000);
        let listed: BTreeSet<String> = ["p".to_string()].into();
        let quiet = |_: &str| Some(1_000);
        let woken = |_: &str| Some(1_001);
        let unknown = |_: &str| None;
        assert!(dormant(&row, Some(&listed), quiet), "no activity after it");
        assert!(dormant(&row, Some(&listed), unknown), "activity unknown");
        assert!(
            !dormant(&row, Some(&listed), woken),
            "activity after it wakes it"
        );
        assert!(
            dormant(&row, None, woken),
            "no listing yet: it stays retired"
        );
        assert!(
            !dormant(&row, Some(&BTreeSet::new()), quiet),
            "no longer listed: woken, so a reader finds it gone"
        );
        row.owner = Some("w".into());
        assert!(
            !dormant(&row, Some(&listed), quiet),
            "held: not for the planner to hide"
        );
        row.owner = None;
        row.retired_at = None;
        assert!(!dormant(&row, Some(&listed), quiet), "never retired");
        assert!(!dormant(&row, None, quiet), "never retired, no listing");
    }

    /// Of a source whose names come back, a gone partition's ended row goes once nobody holds it:
    /// unowned, named by this worker without this process holding it (its release failed), or
    /// another worker's gone still. A row still held (its owner is deleting it), an open row and
    /// a row with lineage stay.
    #[test]
    fn ended_rows_of_gone_partitions_are_deleted_once_nobody_holds_them() {
        let rows: &[Row] = &[
            ("unowned", None, false, true, &[]),
            ("mine-forgotten", Some("a"), false, true, &[]),
            ("mine-held", Some("a"), false, true, &[]),
            ("theirs-expired", Some("b"), true, true, &[]),
            ("theirs-live", Some("b"), false, true, &[]),
            ("open", None, true, false, &[]),
            ("child", None, true, true, &["parent"]),
        ];
        let leases: Vec<Lease> = rows.iter().map(lease).collect();
        let seen: Vec<Seen<'_>> = leases
            .iter()
            .zip(rows)
            .map(|(lease, row)| Seen {
                lease,
                expired: row.2,
                neglected: false,
            })
            .collect();
        let held: HashSet<String> = ["mine-held".to_string()].into();
        let ids: Vec<&str> = left_by_gone("a", &seen, &held)
            .iter()
            .map(|l| l.shard_id.as_str())
            .collect();
        assert_eq!(ids, ["unowned", "mine-forgotten", "theirs-expired"]);
    }

    fn seen_all(leases: &[Lease], expired: impl Fn(&Lease) -> bool) -> Vec<Seen<'_>> {
        leases
            .iter()
            .map(|lease| Seen {
                lease,
                expired: expired(lease),
                neglected: expired(lease) && lease.owner.is_none(),
            })
            .collect()
    }

    /// Free leases that fall to another live worker are left to it, and the plan says it is still
    /// settling (so this worker scans again soon); once they have been left for a lease duration,
    /// this worker takes them even above its target.
    #[test]
    fn free_leases_of_another_worker_are_left_to_it_until_neglected() {
        let leases = free_rows(8);
        let roster = vec!["a".to_string(), "b".to_string()];
        let fresh = plan(
            "a",
            &seen_all(&leases, |_| false),
            &HashSet::new(),
            &HashMap::new(),
            &roster,
            PlanLimits::default(),
        );
        assert_eq!((fresh.target, fresh.takes.len()), (4, 4));
        assert!(fresh.settling, "four leases fell to b, not taken yet");

        // a took its four; b's four were left free for a lease duration.
        let mut later = leases.clone();
        let mine: HashSet<String> = fresh
            .takes
            .iter()
            .map(|t| match t {
                Take::Free(s) => s.clone(),
                other => panic!("{other:?}"),
            })
            .collect();
        for l in &mut later {
            if mine.contains(&l.shard_id) {
                l.owner = Some("a".into());
            }
        }
        let neglected = plan(
            "a",
            &seen_all(&later, |l| l.owner.is_none()),
            &mine,
            &HashMap::new(),
            &roster,
            PlanLimits::default(),
        );
        assert_eq!(neglected.takes.len(), 4, "{neglected:?}");
        let capped = plan(
            "a",
            &seen_all(&later, |l| l.owner.is_none()),
            &mine,
            &HashMap::new(),
            &roster,
            PlanLimits {
                max_leases: 5,
                ..PlanLimits::default()
            },
        );
        assert_eq!(capped.takes.len(), 1, "max_leases still caps");
    }

    /// A balanced worker with nothing to take or ask for is not settling (it may scan rarely),
    /// even when the shards do not divide evenly and it is one below the target.
    #[test]
    fn a_worker_one_below_an_uneven_target_is_quiet() {
        let mut leases = free_rows(5);
        for (i, l) in leases.iter_mut().enumerate() {
            l.owner = Some(if i < 3 { "a" } else { "b" }.into());
        }
        let held: HashSet<String> = leases[3..].iter().map(|l| l.shard_id.clone()).collect();
        let p = plan(
            "b",
            &seen_all(&leases, |_| false),
            &held,
            &HashMap::new(),
            &["a".to_string(), "b".to_string()],
            PlanLimits::default(),
        );
        assert_eq!((p.target, p.takes.len(), p.settling), (3, 0, false));
    }

    /// A lease asked for by a worker that is not alive counts for its owner: a dead taker does not
    /// inflate the number of workers, nor shrink the owner's load.
    #[test]
    fn a_request_by_a_dead_taker_counts_for_the_owner() {
        let mut leases = free_rows(4);
        for l in &mut leases {
            l.owner = Some("a".into());
        }
        leases[0].wanted_by = Some("gone".into());
        let held: HashSet<String> = leases.iter().map(|l| l.shard_id.clone()).collect();
        let p = plan(
            "a",
            &seen_all(&leases, |_| false),
            &held,
            &HashMap::new(),
            &["a".to_string()],
            PlanLimits::default(),
        );
        assert_eq!((p.workers, p.target, p.takes.len()), (1, 4, 0));
    }
}
