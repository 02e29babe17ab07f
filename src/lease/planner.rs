//! Which leases to take, ask for and steal: pure, synchronous, and tested from a table of
//! scenarios.
//!
//! Inputs are the rows of one consistent scan plus what the manager observed locally (which held
//! leases are expired, which leases this worker holds, which handoffs it asked for and how long
//! ago); the output is a list of conditional takes and handoff requests. A live lease moves by a
//! request first (cooperative handoff, `docs/leases.md`), and by a steal only once the request
//! went unanswered for the taker's patience.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};

use super::row::Lease;

/// Balancing settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanLimits {
    /// Steal only when the most loaded worker holds at least this many more leases than this one.
    pub imbalance: usize,
    /// Leases stolen per scan at most.
    pub max_steals_per_scan: usize,
    /// Leases this worker holds at most.
    pub max_leases: usize,
}

impl Default for PlanLimits {
    fn default() -> Self {
        Self {
            imbalance: 2,
            max_steals_per_scan: 1,
            max_leases: usize::MAX,
        }
    }
}

/// One lease as the planner sees it.
#[derive(Debug, Clone, Copy)]
pub struct Seen<'a> {
    /// The row from the scan.
    pub lease: &'a Lease,
    /// Its owner has not renewed it for a lease duration (local clock).
    pub expired: bool,
}

/// A conditional take the manager should attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Take {
    /// An unowned or expired lease, or one recorded as ours that this process does not hold.
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
pub struct Plan {
    /// What to take, in order.
    pub takes: Vec<Take>,
    /// Leases that may be read now (not ended, parents ended).
    pub active: usize,
    /// Workers with live leases, this one included.
    pub workers: usize,
    /// ceil(active / workers), capped by `max_leases`.
    pub target: usize,
}

/// Whether every parent of `lease` is at SHARD_END (a parent with no row has aged out of the stream).
pub fn parents_ended(lease: &Lease, by_shard: &HashMap<&str, &Lease>) -> bool {
    lease.parents.iter().all(|p| {
        by_shard
            .get(p.as_str())
            .is_none_or(|parent| parent.checkpoint.is_shard_end())
    })
}

/// Decides what `me` should take this scan. `held` names the shards this process holds now;
/// `requests` the handoffs it asked for and still waits for (`true`: the wait is over, the owner
/// did not hand over in time).
pub fn plan(
    me: &str,
    seen: &[Seen<'_>],
    held: &HashSet<String>,
    requests: &HashMap<String, bool>,
    limits: PlanLimits,
) -> Plan {
    let by_shard: HashMap<&str, &Lease> = seen
        .iter()
        .map(|s| (s.lease.shard_id.as_str(), s.lease))
        .collect();
    let active: Vec<&Seen<'_>> = seen
        .iter()
        .filter(|s| !s.lease.checkpoint.is_shard_end() && parents_ended(s.lease, &by_shard))
        .collect();

    // Live holdings per worker: unexpired owned leases (this worker: what it really holds).
    let mut load: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    load.insert(me, Vec::new());
    let mut free: Vec<&str> = Vec::new();
    for s in &active {
        let shard = s.lease.shard_id.as_str();
        match s.lease.owner.as_deref() {
            Some(owner) if owner == me => {
                if held.contains(shard) {
                    load.entry(me).or_default().push(shard);
                } else {
                    free.push(shard);
                }
            }
            Some(owner) if !s.expired => load.entry(owner).or_default().push(shard),
            _ => free.push(shard),
        }
    }

    let workers = load.len();
    let target = active.len().div_ceil(workers).min(limits.max_leases);
    let mine = load[me].len();
    let mut need = target.saturating_sub(mine);
    let mut takes = Vec::new();

    // Spread workers that race for the same free leases over different ones.
    free.sort_by_key(|shard| spread(me, shard));
    for shard in free.iter().take(need) {
        takes.push(Take::Free((*shard).to_string()));
    }
    need -= takes.len();

    // Handoffs asked for and still awaited count as coming.
    let awaited = requests
        .iter()
        .filter(|(shard, over)| {
            !**over
                && by_shard
                    .get(shard.as_str())
                    .is_some_and(|l| l.wanted_by.as_deref() == Some(me))
        })
        .count();
    need = need.saturating_sub(awaited);

    if need > 0 && free.is_empty() {
        let victim = load
            .iter()
            .filter(|(w, _)| **w != me)
            .max_by(|a, b| a.1.len().cmp(&b.1.len()).then_with(|| b.0.cmp(a.0)));
        if let Some((from, shards)) = victim
            && shards.len() >= mine + awaited + limits.imbalance
        {
            // Not a lease another worker asked for; the ones whose handoff is overdue first.
            let mut candidates: Vec<&str> = shards
                .iter()
                .copied()
                .filter(|shard| {
                    by_shard
                        .get(shard)
                        .and_then(|l| l.wanted_by.as_deref())
                        .is_none_or(|w| w == me)
                })
                .filter(|shard| requests.get(*shard) != Some(&false))
                .collect();
            candidates
                .sort_by_key(|shard| (requests.get(*shard) != Some(&true), spread(me, shard)));
            for shard in candidates
                .into_iter()
                .take(need.min(limits.max_steals_per_scan))
            {
                let (shard_id, from) = (shard.to_string(), (*from).to_string());
                takes.push(if requests.get(shard) == Some(&true) {
                    Take::Steal { shard_id, from }
                } else {
                    Take::Request { shard_id, from }
                });
            }
        }
    }

    Plan {
        takes,
        active: active.len(),
        workers,
        target,
    }
}

fn spread(me: &str, shard: &str) -> u64 {
    let mut h = DefaultHasher::new();
    (me, shard).hash(&mut h);
    h.finish()
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
            progress: None,
            wanted_by: None,
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
            what: "a new worker joins a worker holding 4: it steals one per scan, not two",
            me: "b",
            held: &[],
            rows: &[
                ("0", Some("a"), false, false, &[]),
                ("1", Some("a"), false, false, &[]),
                ("2", Some("a"), false, false, &[]),
                ("3", Some("a"), false, false, &[]),
            ],
            free: 0,
            steals: 1,
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
                })
                .collect();
            let held = case.held.iter().map(|s| s.to_string()).collect();
            let plan = plan(
                case.me,
                &seen,
                &held,
                &HashMap::new(),
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
            })
            .collect();
        let limits = PlanLimits {
            max_leases: 1,
            ..PlanLimits::default()
        };
        assert_eq!(
            plan("a", &seen, &HashSet::new(), &HashMap::new(), limits)
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
                })
                .collect();
            plan("a", &seen, &HashSet::new(), requests, PlanLimits::default()).takes
        };
        let first = scan(&leases, &HashMap::new());
        let [Take::Request { shard_id, from }] = &first[..] else {
            panic!("{first:?}");
        };
        assert_eq!(from, "b");
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
                        })
                        .collect();
                    let held = (0..shards)
                        .filter(|s| owner[*s].as_deref() == Some(me))
                        .map(|s| s.to_string())
                        .collect();
                    // A request is handed over at once here (the owner passes the lease).
                    for take in plan(me, &seen, &held, &HashMap::new(), PlanLimits::default()).takes
                    {
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
}
