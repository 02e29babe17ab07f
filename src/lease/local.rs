//! What one worker knows of each lease besides its row: one explicit state per lease, changed
//! only by the transitions below (pure: time comes in as `now`, writes and events go out as
//! [`Effect`]s the manager carries out). The diagram, with the condition of every write each
//! state makes, is in `docs/leases.md` ("A lease's states on one worker").
//!
//! ```text
//!  owner side                                         taker side
//!
//!   (none) ──taken──► Held ──request seen──► HandingOff      (none) ──asked, or the row names
//!                      │    (renewal, scan)    │  stop reading,        me as its taker──► Awaiting
//!                      │                       │  acknowledge          │ acknowledgement seen:
//!                      ├──work ended──► Giving ◄┘ work ended            │ patience counts from it
//!                      │                 │ pass (to a live taker) or    ├─taken──► Held
//!                      │                 │ release; answered ──► (none) └─the row no longer names
//!                      │                                                  me as taker──► (none)
//!   Held | HandingOff ─┴─renewal refused, hold ran out, row names another owner──► Lost
//!   Lost ──work ended (its final fenced writes made or refused), or a lease duration──► (none)
//! ```
//!
//! A lease in `Giving` or `Lost` still names this worker on its row for a while (the write is
//! under way; the work may still write what settled): [`Leases::may_take`] keeps this worker from
//! taking it back meanwhile, as a row naming it that it does not hold would otherwise be.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::row::{Lease, Ownership};

/// A lease this worker holds: the proof its writes carry, the tokens its work watches, and the
/// send time of its last renewal that landed.
#[derive(Debug, Clone)]
pub(crate) struct Holding {
    pub(crate) ownership: Ownership,
    /// Cancelled when the lease is lost or given back: the work hands nothing more out.
    pub(crate) cancel: CancellationToken,
    /// Cancelled when another worker asked for the lease: the work stops reading and settles.
    pub(crate) handoff: CancellationToken,
    /// The send time of the last renewal that landed (the take's at first), watched by the
    /// work's [`Hold`](super::Hold).
    pub(crate) renewed: Arc<watch::Sender<Instant>>,
}

impl Holding {
    /// The send time of the last renewal that landed.
    pub(crate) fn last_renewed(&self) -> Instant {
        *self.renewed.borrow()
    }
}

/// One lease's state on this worker. A lease with none is one this worker neither holds nor
/// waits for.
#[derive(Debug, Clone)]
pub(crate) enum State {
    /// Taker side: this worker asked the owner to hand the lease over (or found its name on the
    /// row as the taker) at `asked`; `acked` is when a scan first saw the owner's acknowledgement.
    Awaiting {
        asked: Instant,
        acked: Option<Instant>,
    },
    /// Held and renewed; its work reads.
    Held(Holding),
    /// Held, and `to` asked for it (seen at `since`): its work stops reading and settles, then
    /// gives it back, which passes it to `to`.
    HandingOff {
        holding: Holding,
        to: String,
        since: Instant,
    },
    /// Its work ended and the pass ([`Give::to`]) or release write is under way; not renewed.
    Giving { ownership: Ownership },
    /// Lost or given up under `epoch`: its work may still write what settled (fenced), and this
    /// worker does not take the lease back before that work ended or `until`.
    Lost { epoch: u64, until: Instant },
}

/// What a transition asks the manager to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Effect {
    /// `to` asked for the lease and its work was told to stop reading: stamp the row with the
    /// acknowledgement (as [`Effect::Acknowledge`]).
    HandingOff { ownership: Ownership, to: String },
    /// Stamp the row with the acknowledgement of `to`'s request again (the row lacks it: a
    /// write failed), conditioned on owner, epoch and `wantedBy = to`.
    Acknowledge { ownership: Ownership, to: String },
    /// The lease was lost or given up: tell the consumer, the hooks and the other workers.
    Lost { ownership: Ownership },
}

/// A lease given back: to whom it is passed (`None`: released, unless the row names a taker a
/// scan had not seen yet), and since when the handoff was under way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Give {
    pub(crate) to: Option<String>,
    pub(crate) asked_since: Option<Instant>,
}

/// Why this worker leaves a lease alone for now (see [`Leases::may_take`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotNow {
    /// It holds it already.
    Holding,
    /// Its pass or release is under way.
    Giving,
    /// It lost or gave it up and the work may still be writing what settled.
    LettingGo,
}

/// How long a taker waits for the owner of a lease it asked for before it steals the lease
/// (issue 57, defect 6). An owner whose counter has not moved since the request (or since its
/// acknowledgement) does not answer: paused, cut off; it is waited for the short patience. One
/// whose counter moves renews: it sees the request with a renewal, acknowledges, drains and
/// passes, each write possibly seconds late, and holds the lease by design meanwhile; stolen
/// from, both would handle the same records. It is waited for as long as its writes may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Patience {
    /// From the request, for an acknowledgement, the owner's counter still since.
    pub(crate) unacked: Duration,
    /// From the request, for an acknowledgement, the counter moved since (a renewing owner,
    /// or an older version that never acknowledges).
    pub(crate) unacked_renewing: Duration,
    /// From the acknowledgement (as first seen), for the pass, the counter still since.
    pub(crate) after_ack: Duration,
    /// From the acknowledgement, for the pass, the counter moved since (draining).
    pub(crate) after_ack_renewing: Duration,
}

/// Every lease this worker knows of, by shard.
#[derive(Debug, Default)]
pub(crate) struct Leases(BTreeMap<String, State>);

impl Leases {
    /// The leases held (read, or handing off).
    pub(crate) fn holding(&self) -> impl Iterator<Item = &Holding> {
        self.0.values().filter_map(|s| match s {
            State::Held(h) | State::HandingOff { holding: h, .. } => Some(h),
            _ => None,
        })
    }

    /// The holding of `shard`, if held.
    pub(crate) fn held(&self, shard: &str) -> Option<&Holding> {
        match self.0.get(shard)? {
            State::Held(h) | State::HandingOff { holding: h, .. } => Some(h),
            _ => None,
        }
    }

    /// The state of `shard`.
    #[cfg(test)]
    pub(crate) fn state(&self, shard: &str) -> Option<&State> {
        self.0.get(shard)
    }

    fn holding_mut(&mut self, ownership: &Ownership) -> Option<&mut Holding> {
        match self.0.get_mut(&ownership.shard_id)? {
            State::Held(h) | State::HandingOff { holding: h, .. }
                if h.ownership.epoch == ownership.epoch =>
            {
                Some(h)
            }
            _ => None,
        }
    }

    /// Taken under `ownership` by a write sent at `sent` (its first renewal). The work of an
    /// older holding of the shard, if any, is cancelled. Returns the new holding.
    pub(crate) fn taken(&mut self, ownership: Ownership, sent: Instant) -> Holding {
        let holding = Holding {
            ownership,
            cancel: CancellationToken::new(),
            handoff: CancellationToken::new(),
            renewed: Arc::new(watch::Sender::new(sent)),
        };
        let previous = self.0.insert(
            holding.ownership.shard_id.clone(),
            State::Held(holding.clone()),
        );
        if let Some(State::Held(old) | State::HandingOff { holding: old, .. }) = previous {
            old.cancel.cancel();
        }
        holding
    }

    /// A renewal of `ownership` sent at `sent` landed; the row carried `wanted_by`'s request.
    /// A request that is news starts the handoff (and asks for its acknowledgement).
    pub(crate) fn renewed(
        &mut self,
        ownership: &Ownership,
        sent: Instant,
        wanted_by: Option<&str>,
        now: Instant,
    ) -> Option<Effect> {
        let h = self.holding_mut(ownership)?;
        super::hold::landed(&h.renewed, sent);
        self.asked_for(ownership, wanted_by?, true, now)
    }

    /// A scan (or a renewal) saw `to`'s request on the row of a lease held under `ownership`,
    /// acknowledged (`acked`) or not. Held: the handoff starts (the work stops reading) and is
    /// acknowledged. Handing off and not acknowledged on the row (a failed write): acknowledged
    /// again.
    pub(crate) fn asked_for(
        &mut self,
        ownership: &Ownership,
        to: &str,
        acked: bool,
        now: Instant,
    ) -> Option<Effect> {
        let state = self.0.get_mut(&ownership.shard_id)?;
        let (ownership, to) = (ownership.clone(), to.to_string());
        match state {
            State::Held(h) if h.ownership == ownership => {
                h.handoff.cancel();
                *state = State::HandingOff {
                    holding: h.clone(),
                    to: to.clone(),
                    since: now,
                };
                Some(Effect::HandingOff { ownership, to })
            }
            State::HandingOff { holding, .. } if holding.ownership == ownership && !acked => {
                Some(Effect::Acknowledge { ownership, to })
            }
            _ => None,
        }
    }

    /// `ownership` is lost or given up (renewal refused, its hold ran out, its row names another
    /// owner): its work is cancelled and this worker leaves the lease alone for `letting_go` or
    /// until [`Leases::work_ended`]. `None` when it was not held under that epoch.
    pub(crate) fn lose(
        &mut self,
        ownership: &Ownership,
        now: Instant,
        letting_go: Duration,
    ) -> Option<Effect> {
        let cancel = self.holding_mut(ownership)?.cancel.clone();
        cancel.cancel();
        self.0.insert(
            ownership.shard_id.clone(),
            State::Lost {
                epoch: ownership.epoch,
                until: now + letting_go,
            },
        );
        Some(Effect::Lost {
            ownership: ownership.clone(),
        })
    }

    /// The work of `ownership` ended and the lease goes back: `Giving`, to the worker that asked
    /// for it when one did and `may_pass`. `None` when the lease was not held under that epoch
    /// (lost already).
    pub(crate) fn give(&mut self, ownership: &Ownership, may_pass: bool) -> Option<Give> {
        let state = self.0.get_mut(&ownership.shard_id)?;
        let give = match state {
            State::Held(h) if h.ownership.epoch == ownership.epoch => {
                h.cancel.cancel();
                Give {
                    to: None,
                    asked_since: None,
                }
            }
            State::HandingOff {
                holding, to, since, ..
            } if holding.ownership.epoch == ownership.epoch => {
                holding.cancel.cancel();
                Give {
                    to: Some(to.clone()).filter(|_| may_pass),
                    asked_since: Some(*since),
                }
            }
            _ => return None,
        };
        *state = State::Giving {
            ownership: ownership.clone(),
        };
        Some(give)
    }

    /// The pass or release of `ownership` was answered (or failed): the lease is no longer this
    /// worker's to track. A row still naming it after a failed release is taken back by a scan.
    pub(crate) fn given(&mut self, ownership: &Ownership) {
        if let Some(State::Giving { ownership: o }) = self.0.get(&ownership.shard_id)
            && o.epoch == ownership.epoch
        {
            self.0.remove(&ownership.shard_id);
        }
    }

    /// The work of a lease lost under `ownership` ended (its final writes made or refused).
    /// `true` when the lease was waiting for it.
    pub(crate) fn work_ended(&mut self, ownership: &Ownership) -> bool {
        match self.0.get(&ownership.shard_id) {
            Some(State::Lost { epoch, .. }) if *epoch == ownership.epoch => {
                self.0.remove(&ownership.shard_id);
                true
            }
            _ => false,
        }
    }

    /// Whether this worker may take (or ask for) `shard` at `now`. A `Lost` state whose time
    /// ran out is forgotten here.
    pub(crate) fn may_take(&mut self, shard: &str, now: Instant) -> Result<(), NotNow> {
        match self.0.get(shard) {
            Some(State::Held(_) | State::HandingOff { .. }) => Err(NotNow::Holding),
            Some(State::Giving { .. }) => Err(NotNow::Giving),
            Some(State::Lost { until, .. }) if now < *until => Err(NotNow::LettingGo),
            Some(State::Lost { .. }) => {
                self.0.remove(shard);
                Ok(())
            }
            Some(State::Awaiting { .. }) | None => Ok(()),
        }
    }

    /// This worker wrote a request for `shard` at `now`: it awaits the pass.
    pub(crate) fn asked(&mut self, shard: &str, now: Instant) {
        if matches!(self.0.get(shard), None | Some(State::Awaiting { .. })) {
            self.0.insert(
                shard.to_string(),
                State::Awaiting {
                    asked: now,
                    acked: None,
                },
            );
        }
    }

    /// The owner side of a scan by `me`: each held lease whose row names another owner or epoch
    /// is lost; each request on a held lease's row starts its handoff or asks again for an
    /// acknowledgement the row lacks.
    pub(crate) fn observe_held(
        &mut self,
        rows: &[Lease],
        me: &str,
        now: Instant,
        letting_go: Duration,
    ) -> Vec<Effect> {
        let mut effects = Vec::new();
        for row in rows {
            let Some(held) = self.held(&row.shard_id).map(|h| h.ownership.clone()) else {
                continue;
            };
            let ours = row.owner.as_deref() == Some(me) && row.owner_epoch == held.epoch;
            if !ours {
                effects.extend(self.lose(&held, now, letting_go));
            } else if let Some(to) = &row.wanted_by {
                effects.extend(self.asked_for(&held, to, row.handoff_acked, now));
            }
        }
        effects
    }

    /// The taker side of a scan by `me`: a row that names `me` as the taker of a lease another
    /// worker owns is awaited (a request this process did not make or forgot: its wait starts
    /// now); the owner's acknowledgement is noted once; a request whose row no longer names `me`
    /// as taker is over. Returns the requests awaited and whether each wait is over
    /// ([`Patience`]): from the acknowledgement once seen, else from the request; longer once
    /// the owner's counter was seen to move since (`moved_since(shard, at)`).
    pub(crate) fn observe_awaited(
        &mut self,
        rows: &[Lease],
        me: &str,
        now: Instant,
        patience: Patience,
        moved_since: impl Fn(&str, Instant) -> bool,
    ) -> HashMap<String, bool> {
        let mine: HashMap<&str, &Lease> = rows
            .iter()
            .filter(|r| {
                r.wanted_by.as_deref() == Some(me)
                    && r.owner.is_some()
                    && r.owner.as_deref() != Some(me)
            })
            .map(|r| (r.shard_id.as_str(), r))
            .collect();
        self.0.retain(|shard, state| {
            !matches!(state, State::Awaiting { .. }) || mine.contains_key(shard.as_str())
        });
        let mut awaited = HashMap::new();
        for (shard, row) in mine {
            let state = self.0.entry(shard.to_string()).or_insert(State::Awaiting {
                asked: now,
                acked: None,
            });
            let State::Awaiting { asked, acked } = state else {
                continue;
            };
            if row.handoff_acked && acked.is_none() {
                *acked = Some(now);
            }
            let over = match acked {
                Some(at) if moved_since(shard, *at) => now - *at >= patience.after_ack_renewing,
                Some(at) => now - *at >= patience.after_ack,
                None if moved_since(shard, *asked) => now - *asked >= patience.unacked_renewing,
                None => now - *asked >= patience.unacked,
            };
            awaited.insert(shard.to_string(), over);
        }
        awaited
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::Checkpoint;

    fn ownership(shard: &str, epoch: u64) -> Ownership {
        Ownership {
            stream: "s".into(),
            shard_id: shard.into(),
            owner: "me".into(),
            epoch,
        }
    }

    fn row(shard: &str, owner: Option<&str>, epoch: u64) -> Lease {
        Lease {
            stream: "s".into(),
            shard_id: shard.into(),
            owner: owner.map(str::to_string),
            owner_epoch: epoch,
            counter: 1,
            checkpoint: Checkpoint::TrimHorizon,
            parents: vec![],
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

    fn asked_by(mut row: Lease, taker: &str, acked: bool) -> Lease {
        row.wanted_by = Some(taker.into());
        row.handoff_acked = acked;
        row
    }

    const GO: Duration = Duration::from_secs(10);

    fn name(state: Option<&State>) -> &'static str {
        match state {
            None => "none",
            Some(State::Awaiting { .. }) => "Awaiting",
            Some(State::Held(_)) => "Held",
            Some(State::HandingOff { .. }) => "HandingOff",
            Some(State::Giving { .. }) => "Giving",
            Some(State::Lost { .. }) => "Lost",
        }
    }

    /// Every transition of the owner side, as a table: the state before, what happened, the
    /// state after, and what the manager is asked to do.
    #[test]
    fn owner_side_transitions() {
        let now = Instant::now();
        let a = ownership("a", 3);
        type Step = fn(&mut Leases, &Ownership, Instant) -> Vec<Effect>;
        let ack = |o: &Ownership| Effect::HandingOff {
            ownership: o.clone(),
            to: "b".into(),
        };
        let again = |o: &Ownership| Effect::Acknowledge {
            ownership: o.clone(),
            to: "b".into(),
        };
        let lost = |o: &Ownership| Effect::Lost {
            ownership: o.clone(),
        };
        let cases: Vec<(&str, &[Step], &str, Vec<Effect>)> = vec![
            ("taken", &[], "Held", vec![]),
            (
                "a renewal carries a request",
                &[|l, o, now| l.renewed(o, now, Some("b"), now).into_iter().collect()],
                "HandingOff",
                vec![ack(&a)],
            ),
            (
                "a scan sees a request",
                &[|l, _, now| {
                    l.observe_held(
                        &[asked_by(row("a", Some("me"), 3), "b", false)],
                        "me",
                        now,
                        GO,
                    )
                }],
                "HandingOff",
                vec![ack(&a)],
            ),
            (
                "a later renewal carries the same request: no news",
                &[
                    |l, o, now| l.renewed(o, now, Some("b"), now).into_iter().collect(),
                    |l, o, now| l.renewed(o, now, Some("b"), now).into_iter().collect(),
                ],
                "HandingOff",
                vec![ack(&a)],
            ),
            (
                "a scan finds the acknowledgement missing: again",
                &[
                    |l, o, now| l.renewed(o, now, Some("b"), now).into_iter().collect(),
                    |l, _, now| {
                        l.observe_held(
                            &[asked_by(row("a", Some("me"), 3), "b", false)],
                            "me",
                            now,
                            GO,
                        )
                    },
                ],
                "HandingOff",
                vec![ack(&a), again(&a)],
            ),
            (
                "a scan finds it acknowledged",
                &[
                    |l, o, now| l.renewed(o, now, Some("b"), now).into_iter().collect(),
                    |l, _, now| {
                        l.observe_held(
                            &[asked_by(row("a", Some("me"), 3), "b", true)],
                            "me",
                            now,
                            GO,
                        )
                    },
                ],
                "HandingOff",
                vec![ack(&a)],
            ),
            (
                "a renewal is refused",
                &[|l, o, now| l.lose(o, now, GO).into_iter().collect()],
                "Lost",
                vec![lost(&a)],
            ),
            (
                "a scan finds another owner",
                &[|l, _, now| l.observe_held(&[row("a", Some("x"), 4)], "me", now, GO)],
                "Lost",
                vec![lost(&a)],
            ),
            (
                "a scan finds this worker under another epoch",
                &[|l, _, now| l.observe_held(&[row("a", Some("me"), 4)], "me", now, GO)],
                "Lost",
                vec![lost(&a)],
            ),
            (
                "a scan finds it unchanged",
                &[|l, _, now| l.observe_held(&[row("a", Some("me"), 3)], "me", now, GO)],
                "Held",
                vec![],
            ),
            (
                "the work ends",
                &[|l, o, _| {
                    assert_eq!(l.give(o, true).map(|g| g.to), Some(None));
                    vec![]
                }],
                "Giving",
                vec![],
            ),
            (
                "the work of a lease asked for ends",
                &[
                    |l, o, now| l.renewed(o, now, Some("b"), now).into_iter().collect(),
                    |l, o, _| {
                        assert_eq!(l.give(o, true).map(|g| g.to), Some(Some("b".into())));
                        vec![]
                    },
                ],
                "Giving",
                vec![ack(&a)],
            ),
            (
                "an ended shard asked for is released, not passed",
                &[
                    |l, o, now| l.renewed(o, now, Some("b"), now).into_iter().collect(),
                    |l, o, _| {
                        assert_eq!(l.give(o, false).map(|g| g.to), Some(None));
                        vec![]
                    },
                ],
                "Giving",
                vec![ack(&a)],
            ),
            (
                "the pass is answered",
                &[|l, o, _| {
                    l.give(o, true);
                    l.given(o);
                    vec![]
                }],
                "none",
                vec![],
            ),
            (
                "a lost lease's work ends",
                &[|l, o, now| {
                    let e = l.lose(o, now, GO).into_iter().collect();
                    assert!(l.work_ended(o));
                    e
                }],
                "none",
                vec![lost(&a)],
            ),
            (
                "a lost lease is given back late: nothing to give",
                &[|l, o, now| {
                    let e = l.lose(o, now, GO).into_iter().collect();
                    assert_eq!(l.give(o, true), None);
                    e
                }],
                "Lost",
                vec![lost(&a)],
            ),
            (
                "an older epoch's news changes nothing",
                &[|l, _, now| {
                    let old = ownership("a", 2);
                    let mut e: Vec<Effect> = l.lose(&old, now, GO).into_iter().collect();
                    e.extend(l.renewed(&old, now, Some("b"), now));
                    assert_eq!(l.give(&old, true), None);
                    assert!(!l.work_ended(&old));
                    e
                }],
                "Held",
                vec![],
            ),
        ];
        for (what, steps, after, effects) in cases {
            let mut leases = Leases::default();
            let held = leases.taken(a.clone(), now);
            let mut seen = Vec::new();
            for step in steps {
                seen.extend(step(&mut leases, &a, now));
            }
            assert_eq!(name(leases.state("a")), after, "{what}");
            assert_eq!(seen, effects, "{what}");
            let handing_off = matches!(after, "HandingOff" | "Giving") && !effects.is_empty();
            assert_eq!(
                held.handoff.is_cancelled(),
                handing_off,
                "{what}: stop reading"
            );
            let stopped = matches!(after, "Giving" | "Lost" | "none") && what != "taken";
            assert_eq!(
                held.cancel.is_cancelled(),
                stopped,
                "{what}: work cancelled"
            );
        }
    }

    /// A lease being given back or let go still names this worker on its row: it is not taken
    /// back meanwhile (a scan in the window of a slow pass took it back, issue 27). A lost
    /// lease is left alone until its work ended, or a lease duration at most.
    #[test]
    fn a_lease_is_not_taken_back_while_it_is_given_or_let_go() {
        let now = Instant::now();
        let a = ownership("a", 3);
        let mut leases = Leases::default();
        assert_eq!(leases.may_take("a", now), Ok(()));
        leases.taken(a.clone(), now);
        assert_eq!(leases.may_take("a", now), Err(NotNow::Holding));
        leases.give(&a, true);
        assert_eq!(leases.may_take("a", now), Err(NotNow::Giving));
        leases.given(&a);
        assert_eq!(leases.may_take("a", now), Ok(()));

        leases.taken(ownership("a", 4), now);
        leases.lose(&ownership("a", 4), now, GO);
        assert_eq!(leases.may_take("a", now + GO / 2), Err(NotNow::LettingGo));
        assert_eq!(leases.may_take("a", now + GO), Ok(()));
        assert_eq!(name(leases.state("a")), "none");

        leases.taken(ownership("a", 5), now);
        leases.lose(&ownership("a", 5), now, GO);
        assert!(leases.work_ended(&ownership("a", 5)));
        assert_eq!(leases.may_take("a", now), Ok(()));
    }

    /// An owner whose counter moved since the request (or since its acknowledgement) renews:
    /// it is waited for the longer patience (issue 57, defect 6).
    #[test]
    fn a_renewing_owner_is_waited_for_longer() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let patience = Patience {
            unacked: s(10),
            unacked_renewing: s(25),
            after_ack: s(10),
            after_ack_renewing: s(25),
        };
        let asked = |acked| asked_by(row("a", Some("x"), 1), "me", acked);
        for (moved, acked, over_at) in [
            (false, false, 10),
            (true, false, 25),
            (false, true, 10),
            (true, true, 25),
        ] {
            let mut leases = Leases::default();
            leases.asked("a", t0);
            let mut awaited = |at| {
                leases.observe_awaited(&[asked(acked)], "me", t0 + s(at), patience, |_, _| moved)
            };
            assert_eq!(awaited(0), [("a".into(), false)].into());
            assert_eq!(
                awaited(over_at - 1),
                [("a".into(), false)].into(),
                "moved {moved}, acked {acked}"
            );
            assert_eq!(
                awaited(over_at),
                [("a".into(), true)].into(),
                "moved {moved}, acked {acked}"
            );
        }
    }

    /// The taker side: a request is awaited while the row names this worker as its taker;
    /// patience counts from the acknowledgement once a scan saw it; a request found on a row
    /// (asked before a restart, or a failed steal) is awaited from when it was found; a take
    /// ends it.
    #[test]
    fn taker_side_transitions() {
        let t0 = Instant::now();
        let patience = Patience {
            unacked: Duration::from_secs(10),
            unacked_renewing: Duration::from_secs(25),
            after_ack: Duration::from_secs(10),
            after_ack_renewing: Duration::from_secs(25),
        };
        let asked = |acked| asked_by(row("a", Some("x"), 1), "me", acked);
        let mut leases = Leases::default();
        leases.asked("a", t0);
        let s = Duration::from_secs;
        let awaited = |l: &mut Leases, rows: &[Lease], at| {
            l.observe_awaited(rows, "me", at, patience, |_, _| false)
        };
        assert_eq!(
            awaited(&mut leases, &[asked(false)], t0 + s(9)),
            [("a".into(), false)].into()
        );
        // Acknowledged at 9 s: patience from there.
        assert_eq!(
            awaited(&mut leases, &[asked(true)], t0 + s(9)),
            [("a".into(), false)].into()
        );
        assert_eq!(
            awaited(&mut leases, &[asked(true)], t0 + s(18)),
            [("a".into(), false)].into()
        );
        assert_eq!(
            awaited(&mut leases, &[asked(true)], t0 + s(19)),
            [("a".into(), true)].into()
        );
        // The row no longer names me as taker (the owner passed it elsewhere, or released it).
        assert!(awaited(&mut leases, &[row("a", Some("x"), 2)], t0 + s(20)).is_empty());
        assert_eq!(name(leases.state("a")), "none");
        // Found on a row without this process asking: awaited from now.
        assert_eq!(
            awaited(&mut leases, &[asked(false)], t0 + s(30)),
            [("a".into(), false)].into()
        );
        assert_eq!(
            awaited(&mut leases, &[asked(false)], t0 + s(40)),
            [("a".into(), true)].into()
        );
        // Taken (the steal, or the pass taken up): held, no longer awaited.
        leases.taken(ownership("a", 2), t0 + s(40));
        assert_eq!(name(leases.state("a")), "Held");
        // A row naming this worker as owner is not a request of its own.
        assert!(
            awaited(
                &mut leases,
                &[asked_by(row("a", Some("me"), 2), "me", false)],
                t0
            )
            .is_empty()
        );
        assert_eq!(name(leases.state("a")), "Held");
        // Asking never overwrites a held or lost lease.
        leases.asked("a", t0);
        assert_eq!(name(leases.state("a")), "Held");
    }
}
