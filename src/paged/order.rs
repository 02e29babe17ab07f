//! Order validation of fetched pages (pure): what each event of a page is, given the durable
//! applied prefix and what this attempt has already handed out, or why the page stops the attempt.
//!
//! | event's position | verdict |
//! |---|---|
//! | at or below the durable applied prefix | `Replay` (its outcome is durable); with a backfilling source `Backfill` (a receipt decides) |
//! | at or below the last one handed out, same identity as handed out there | `Overlap` (skip it) |
//! | at or below the last one handed out, another identity there | `Conflict` error |
//! | at or below the last one handed out, nothing handed out there | `Regression` error; with a backfilling source `New` |
//! | above the last one handed out | `New`; with dense positions anything but the next number is a `Gap` error |
//!
//! A page is judged whole before anything of it is handed out: an error leaves the state as it was.
//!
//! A source whose events form groups ([`Contract::groups`]) is judged by group: the applied prefix
//! counts only groups wholly below the applied position's (the order keeps it cut to the group's
//! prefix), and an event below the last one handed out but in the same group, not handed out
//! there, is `New` (a group's events come in the source's own order, and some may be gone).

use std::collections::VecDeque;

use super::{Contract, PagePosition, PagedEvent};

/// What to do with one event of a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Hand it to the handler.
    New,
    /// At or below the durable applied prefix: its outcome is durable already. Settled without
    /// the handler.
    Replay,
    /// Handed out already by this attempt (an overlapping or repeated page): skipped.
    Overlap,
    /// At or below the applied prefix of a source that backfills: a terminal receipt makes it a
    /// replay; otherwise it is handled (never skipped).
    Backfill,
}

/// Why a page stops its partition's attempt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OrderError {
    /// An event came back at or below one already read, where nothing had been read.
    #[error(
        "position {position} comes at or below {last}, already read, in a source that does not backfill: a regression"
    )]
    Regression {
        /// The event's position.
        position: PagePosition,
        /// The greatest position read before it.
        last: PagePosition,
    },
    /// Two identities at one position.
    #[error(
        "position {position} holds `{got}`, but `{seen}` was read there: conflicting identities"
    )]
    Conflict {
        /// The position.
        position: PagePosition,
        /// The identity read there first.
        seen: String,
        /// The identity read there now.
        got: String,
    },
    /// Dense positions skipped a number.
    #[error("position {got} follows {after}: a gap the source's contract forbids")]
    Gap {
        /// The position before.
        after: PagePosition,
        /// The position that came next.
        got: PagePosition,
    },
}

/// What one attempt of a partition has read.
#[derive(Debug)]
pub(crate) struct Order {
    contract: Contract,
    /// The durable applied prefix.
    applied: Option<PagePosition>,
    /// The greatest position handed out.
    last: Option<PagePosition>,
    /// Identities handed out above the applied prefix, in position order: new events come in
    /// order and are pushed at the back, the applied prefix moves from the front.
    seen: Window,
}

/// The identities handed out above the applied prefix, a page at a time: a chunk holds one page's
/// new events (their positions in order, their identities in one string), so a page costs two
/// allocations rather than one per event, and a burst grows the window without copying what it
/// holds. Every position of a chunk is below every position of the next.
#[derive(Debug, Default)]
struct Window {
    chunks: VecDeque<Chunk>,
}

#[derive(Debug, Default)]
struct Chunk {
    /// In position order: a position and where its identity lies in `ids`.
    entries: Vec<(PagePosition, std::ops::Range<usize>)>,
    /// The identities, one after another, in the order they came (a backfilled one is appended).
    ids: String,
}

impl Chunk {
    fn with_capacity(events: usize, bytes: usize) -> Self {
        Self {
            entries: Vec::with_capacity(events),
            ids: String::with_capacity(bytes),
        }
    }

    fn last(&self) -> Option<&PagePosition> {
        self.entries.last().map(|(p, _)| p)
    }

    fn insert(&mut self, at: usize, position: PagePosition, id: &str) {
        let start = self.ids.len();
        self.ids.push_str(id);
        self.entries.insert(at, (position, start..self.ids.len()));
    }
}

impl Window {
    /// The identity handed out at `position`, if any.
    fn get(&self, position: &PagePosition) -> Option<&str> {
        let chunk = &self.chunks[self.chunk_of(position)?];
        let at = chunk
            .entries
            .binary_search_by(|(p, _)| p.cmp(position))
            .ok()?;
        Some(&chunk.ids[chunk.entries[at].1.clone()])
    }

    /// The first chunk whose last position is at or above `position`.
    fn chunk_of(&self, position: &PagePosition) -> Option<usize> {
        let at = self
            .chunks
            .partition_point(|c| c.last().is_some_and(|l| l < position));
        (at < self.chunks.len()).then_some(at)
    }

    /// Adds one page's new events (`events`, in the page's order, no position twice): those above
    /// everything held go to a new chunk at the back, a backfilled one to its place.
    fn add<'a>(&mut self, events: impl Iterator<Item = &'a PagedEvent> + Clone) {
        let (count, bytes) = events
            .clone()
            .fold((0, 0), |(n, b), e| (n + 1, b + e.id.len()));
        let mut fresh = Chunk::with_capacity(count, bytes);
        for event in events {
            let position = &event.position;
            let top = fresh.last().or_else(|| self.chunks.back()?.last());
            if top.is_none_or(|top| position > top) {
                let at = fresh.entries.len();
                fresh.insert(at, position.clone(), &event.id);
                continue;
            }
            // Below what is held: backfilled. Its place is in the new chunk if it lies above that
            // chunk's first, else in the first chunk held that reaches it, else (between the
            // chunks held and the new one) at the new chunk's front.
            let held = self.chunk_of(position);
            let chunk = match (fresh.entries.first(), held) {
                (Some((first, _)), _) if position > first => &mut fresh,
                (_, Some(index)) => &mut self.chunks[index],
                (_, None) => &mut fresh,
            };
            let at = chunk.entries.partition_point(|(p, _)| p < position);
            chunk.insert(at, position.clone(), &event.id);
        }
        if !fresh.entries.is_empty() {
            self.chunks.push_back(fresh);
        }
    }

    /// Forgets every identity at or below `through`.
    fn forget_through(&mut self, through: &PagePosition) {
        while let Some(front) = self.chunks.front_mut() {
            if front.last().is_none_or(|l| l <= through) {
                self.chunks.pop_front();
                continue;
            }
            let done = front.entries.partition_point(|(p, _)| p <= through);
            front.entries.drain(..done);
            break;
        }
    }
}

impl Order {
    pub(crate) fn new(contract: Contract, applied: Option<PagePosition>) -> Self {
        Self {
            applied: applied.map(|a| group_of(&contract, &a)),
            contract,
            last: None,
            seen: Window::default(),
        }
    }

    /// What a settled prefix ending at `position` lets the applied position claim: the position
    /// itself, or for a source of groups only the groups before its group (their prefix, which
    /// sorts below every member of it).
    pub(crate) fn claim(&self, position: &PagePosition) -> PagePosition {
        group_of(&self.contract, position)
    }

    /// Judges a page, all or nothing.
    pub(crate) fn classify(&mut self, events: &[PagedEvent]) -> Result<Vec<Verdict>, OrderError> {
        let mut last = self.last.clone();
        // This page's new events (their indices), in page order.
        let mut added: Vec<usize> = Vec::new();
        let mut verdicts = Vec::with_capacity(events.len());
        for (index, event) in events.iter().enumerate() {
            let position = &event.position;
            let verdict = if self.applied.as_ref().is_some_and(|a| position <= a) {
                if self.contract.backfill {
                    Verdict::Backfill
                } else {
                    Verdict::Replay
                }
            } else if let Some(l) = last.as_ref().filter(|l| position <= *l) {
                // Everything handed out lies at or below `last`: only here can it have been.
                let seen = added
                    .iter()
                    .rev()
                    .map(|&i| &events[i])
                    .find(|e| e.position == *position)
                    .map(|e| e.id.as_str())
                    .or_else(|| self.seen.get(position));
                if let Some(seen) = seen {
                    if seen != event.id {
                        return Err(OrderError::Conflict {
                            position: position.clone(),
                            seen: seen.to_string(),
                            got: event.id.clone(),
                        });
                    }
                    Verdict::Overlap
                } else if self
                    .contract
                    .groups
                    .is_some_and(|len| position.prefix(len) == l.prefix(len))
                {
                    // In the group last read, not handed out: the group's own order, or a member
                    // read after one that is gone.
                    added.push(index);
                    Verdict::New
                } else if !self.contract.backfill {
                    return Err(OrderError::Regression {
                        position: position.clone(),
                        last: l.clone(),
                    });
                } else {
                    added.push(index);
                    Verdict::New
                }
            } else {
                if self.contract.dense
                    && let Some(after) = last.as_ref().or(self.applied.as_ref())
                {
                    let next = after.as_u64().and_then(|n| n.checked_add(1));
                    if position.as_u64().is_none() || position.as_u64() != next {
                        return Err(OrderError::Gap {
                            after: after.clone(),
                            got: position.clone(),
                        });
                    }
                }
                added.push(index);
                last = Some(position.clone());
                Verdict::New
            };
            verdicts.push(verdict);
        }
        self.seen.add(added.iter().map(|&index| &events[index]));
        self.last = last;
        Ok(verdicts)
    }

    /// The prefix is durable through `through`: what is at or below it needs no identity kept.
    pub(crate) fn applied(&mut self, through: &PagePosition) {
        let through = group_of(&self.contract, through);
        if self.applied.as_ref().is_some_and(|a| *a >= through) {
            return;
        }
        self.seen.forget_through(&through);
        self.applied = Some(through);
    }
}

/// `position`, or for a source of groups its group's prefix.
fn group_of(contract: &Contract, position: &PagePosition) -> PagePosition {
    match contract.groups {
        Some(len) => position.prefix(len),
        None => position.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::Verdict::*;
    use super::*;

    fn event(position: u64, id: &str) -> PagedEvent {
        PagedEvent {
            id: id.into(),
            position: PagePosition::from_u64(position),
            payload: bytes::Bytes::new(),
            timestamp: None,
            key: None,
        }
    }

    fn page(events: &[(u64, &str)]) -> Vec<PagedEvent> {
        events.iter().map(|(p, id)| event(*p, id)).collect()
    }

    fn p(n: u64) -> PagePosition {
        PagePosition::from_u64(n)
    }

    /// Seed 003's walkthrough: applied 105, the page at C7 holds 104, 106, 107.
    #[test]
    fn an_overlap_below_the_applied_prefix_is_a_replay() {
        let mut order = Order::new(Contract::default().dense(true), Some(p(105)));
        let verdicts = order
            .classify(&page(&[(104, "e104"), (106, "e106"), (107, "e107")]))
            .unwrap();
        assert_eq!(verdicts, [Replay, New, New]);
        // The same page again (a retry of a lost answer): everything was handed out already.
        let again = order
            .classify(&page(&[(104, "e104"), (106, "e106"), (107, "e107")]))
            .unwrap();
        assert_eq!(again, [Replay, Overlap, Overlap]);
        // Once 106 is durable, it is a replay too.
        order.applied(&p(106));
        let later = order.classify(&page(&[(106, "e106"), (107, "e107"), (108, "e108")]));
        assert_eq!(later.unwrap(), [Replay, Overlap, New]);
    }

    /// CloudWatch Logs' case: the events of one timestamp and ingestion time come in the
    /// service's order, named by their messages, and retention may delete some of them first.
    #[test]
    fn a_source_of_groups_claims_and_replays_whole_groups_only() {
        let at = |group: u64, name: u64| PagePosition::from_parts(&[group, name]);
        let event = |group, name, id: &str| PagedEvent {
            id: id.into(),
            position: at(group, name),
            payload: bytes::Bytes::new(),
            timestamp: None,
            key: None,
        };
        let contract = Contract::default().groups(8);
        // The applied position lies inside group 5 (written before groups, or by hand): only
        // groups 1 to 4 count as done.
        let mut order = Order::new(contract, Some(at(5, 9)));
        let page = [
            event(4, 1, "4a"),
            event(5, 9, "5i"),
            event(5, 3, "5c"),
            event(5, 7, "5g"),
            event(6, 2, "6b"),
        ];
        assert_eq!(order.classify(&page).unwrap(), [Replay, New, New, New, New]);
        // Read again (a recovered token): what this attempt handed out is an overlap.
        assert_eq!(
            order.classify(&page).unwrap(),
            [Replay, Overlap, Overlap, Overlap, Overlap]
        );
        // A member of group 6 not handed out yet comes after one that was: the group's order.
        assert_eq!(order.classify(&[event(6, 1, "6a")]).unwrap(), [New]);
        // One of group 5 now, after group 6 was read: a regression as before.
        assert_eq!(
            order.classify(&[event(5, 1, "5a")]).unwrap_err(),
            OrderError::Regression {
                position: at(5, 1),
                last: at(6, 2),
            }
        );
        // A settled prefix ending inside group 6 claims groups before it, not the group.
        let claim = order.claim(&at(6, 2));
        assert!(claim > at(5, u64::MAX) && claim < at(6, 0));
        order.applied(&claim);
        // Group 5 is a replay now; group 6's identities are still known.
        let again = [event(5, 3, "5c"), event(6, 1, "6a"), event(6, 2, "6b")];
        assert_eq!(order.classify(&again).unwrap(), [Replay, Overlap, Overlap]);
        // An event that changed name at a place handed out is still a conflict.
        assert!(matches!(
            order.classify(&[event(6, 2, "other")]),
            Err(OrderError::Conflict { .. })
        ));
    }

    #[test]
    fn table_of_pages_that_stop_the_attempt() {
        type Case = (
            &'static str,
            Contract,
            Option<u64>,
            &'static [&'static [(u64, &'static str)]],
            OrderError,
        );
        let cases: &[Case] = &[
            (
                "a position below one read, nothing read there",
                Contract::default(),
                None,
                &[&[(10, "a"), (12, "c")], &[(11, "b")]],
                OrderError::Regression {
                    position: p(11),
                    last: p(12),
                },
            ),
            (
                "a page going backwards inside itself",
                Contract::default(),
                None,
                &[&[(10, "a"), (9, "z")]],
                OrderError::Regression {
                    position: p(9),
                    last: p(10),
                },
            ),
            (
                "two identities at one position, across pages",
                Contract::default(),
                None,
                &[&[(10, "a")], &[(10, "b")]],
                OrderError::Conflict {
                    position: p(10),
                    seen: "a".into(),
                    got: "b".into(),
                },
            ),
            (
                "two identities at one position, in one page",
                Contract::default(),
                None,
                &[&[(10, "a"), (10, "b")]],
                OrderError::Conflict {
                    position: p(10),
                    seen: "a".into(),
                    got: "b".into(),
                },
            ),
            (
                "a gap in dense positions",
                Contract::default().dense(true),
                Some(5),
                &[&[(6, "f"), (8, "h")]],
                OrderError::Gap {
                    after: p(6),
                    got: p(8),
                },
            ),
            (
                "a gap after the applied prefix",
                Contract::default().dense(true),
                Some(5),
                &[&[(7, "g")]],
                OrderError::Gap {
                    after: p(5),
                    got: p(7),
                },
            ),
        ];
        for (what, contract, applied, pages, expected) in cases {
            let mut order = Order::new(*contract, applied.map(p));
            let mut result = Ok(Vec::new());
            for events in pages.iter() {
                result = order.classify(&page(events));
                if result.is_err() {
                    break;
                }
            }
            assert_eq!(result.unwrap_err(), *expected, "{what}");
        }
    }

    /// The order check as first written (identities in a `BTreeMap`, a page's new ones in
    /// another): the model the chunked version must answer exactly like.
    struct Model {
        contract: Contract,
        applied: Option<PagePosition>,
        last: Option<PagePosition>,
        seen: std::collections::BTreeMap<PagePosition, String>,
    }

    impl Model {
        fn classify(&mut self, events: &[PagedEvent]) -> Result<Vec<Verdict>, OrderError> {
            let mut last = self.last.clone();
            let mut added = std::collections::BTreeMap::new();
            let mut verdicts = Vec::new();
            for event in events {
                let position = &event.position;
                let seen = added
                    .get(position)
                    .cloned()
                    .or_else(|| self.seen.get(position).cloned());
                let verdict = if self.applied.as_ref().is_some_and(|a| position <= a) {
                    if self.contract.backfill {
                        Backfill
                    } else {
                        Replay
                    }
                } else if let Some(seen) = seen {
                    if seen != event.id {
                        return Err(OrderError::Conflict {
                            position: position.clone(),
                            seen,
                            got: event.id.clone(),
                        });
                    }
                    Overlap
                } else if let Some(l) = last.as_ref().filter(|l| position <= *l) {
                    if !self.contract.backfill {
                        return Err(OrderError::Regression {
                            position: position.clone(),
                            last: l.clone(),
                        });
                    }
                    added.insert(position.clone(), event.id.clone());
                    New
                } else {
                    if self.contract.dense
                        && let Some(after) = last.as_ref().or(self.applied.as_ref())
                    {
                        let next = after.as_u64().and_then(|n| n.checked_add(1));
                        if position.as_u64().is_none() || position.as_u64() != next {
                            return Err(OrderError::Gap {
                                after: after.clone(),
                                got: position.clone(),
                            });
                        }
                    }
                    added.insert(position.clone(), event.id.clone());
                    last = Some(position.clone());
                    New
                };
                verdicts.push(verdict);
            }
            self.seen.extend(added);
            self.last = last;
            Ok(verdicts)
        }

        fn applied(&mut self, through: &PagePosition) {
            if self.applied.as_ref().is_some_and(|a| a >= through) {
                return;
            }
            self.applied = Some(through.clone());
            self.seen = self.seen.split_off(through);
            self.seen.remove(through);
        }
    }

    proptest::proptest! {
        /// Pages of positions 0-40 (ids mostly the position's, sometimes another), with the
        /// applied prefix moving between them, for every contract: the same verdicts and errors
        /// as the model, page after page.
        #[test]
        fn answers_exactly_as_the_model_does(
            backfill in proptest::bool::ANY,
            dense in proptest::bool::ANY,
            applied in proptest::option::of(0u64..10),
            steps in proptest::collection::vec(
                (
                    proptest::collection::vec((0u64..40, 0u8..20), 0..12),
                    proptest::option::of(0u64..40),
                ),
                1..12,
            ),
        ) {
            let contract = Contract::default().backfill(backfill).dense(dense);
            let mut order = Order::new(contract, applied.map(p));
            let mut model = Model {
                contract,
                applied: applied.map(p),
                last: None,
                seen: Default::default(),
            };
            for (events, through) in steps {
                let events: Vec<PagedEvent> = events
                    .iter()
                    .map(|&(n, other)| {
                        // One id in twenty differs from the position's own: a conflict.
                        let id = if other == 0 { format!("x{n}") } else { format!("e{n}") };
                        event(n, &id)
                    })
                    .collect();
                proptest::prop_assert_eq!(order.classify(&events), model.classify(&events));
                if let Some(through) = through {
                    order.applied(&p(through));
                    model.applied(&p(through));
                }
            }
        }
    }

    #[test]
    fn a_refused_page_changes_nothing() {
        let mut order = Order::new(Contract::default(), None);
        order.classify(&page(&[(1, "a"), (2, "b")])).unwrap();
        assert!(order.classify(&page(&[(3, "c"), (2, "x")])).is_err());
        // 3 was not taken from the refused page: it is new now.
        assert_eq!(order.classify(&page(&[(3, "c")])).unwrap(), [New]);
    }

    #[test]
    fn a_backfilling_source_takes_late_events_and_leaves_old_ones_to_receipts() {
        let mut order = Order::new(Contract::default().backfill(true), Some(p(100)));
        let verdicts = order
            .classify(&page(&[(90, "late-old"), (110, "a"), (120, "b")]))
            .unwrap();
        assert_eq!(verdicts, [Backfill, New, New]);
        // 115 arrived late, between events already read: new, not a regression.
        let verdicts = order
            .classify(&page(&[(115, "late"), (120, "b"), (130, "c")]))
            .unwrap();
        assert_eq!(verdicts, [New, Overlap, New]);
    }

    #[test]
    fn positions_that_are_not_numbers_are_gaps_in_a_dense_source() {
        let mut order = Order::new(Contract::default().dense(true), Some(p(1)));
        let odd = PagedEvent {
            position: PagePosition::from_bytes(&b"x"[..]),
            ..event(0, "x")
        };
        assert!(matches!(
            order.classify(&[odd]),
            Err(OrderError::Gap { .. })
        ));
    }
}
