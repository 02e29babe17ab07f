//! Timestamp groups (pure): the cursor discipline of seed 000, for sources that can resume only by
//! timestamp (CloudWatch Logs' `FilterLogEvents`, an API with `since=`).
//!
//! The durable cursor is `closed_through`, the latest timestamp whose whole group has durable
//! terminal outcomes, with a generation for compare-and-swap. Queries run strictly after it. The
//! events of every later timestamp form open groups, kept out of the durable cursor while any of
//! their events is pending, failed or known only in memory. A group closes only when two things
//! hold:
//! - **completeness evidence**, which means only what the source's contracts say:
//!   - [`Traversal`]: can a poll enumerate every event of a timestamp, even across pages?
//!   - [`Finality`]: what proves that no earlier event can still arrive?
//! - **every one of its events has settled**.
//!
//! A page boundary is never evidence. Without a proven traversal nothing ever closes: the open
//! groups are read again on every poll (receipts make that harmless).
//!
//! This module decides; the timestamp partition loop (`consumer/timestamps.rs`) does the I/O and
//! the compare-and-swap.

use std::collections::{BTreeMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Duration;

/// Whether one poll can enumerate every event of a timestamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Traversal {
    /// Each poll reads a stable snapshot, or a continuation the provider documents as complete:
    /// a poll's pages hold every event of every timestamp they reach.
    Complete,
    /// Nothing guarantees it: offset pages over a set that may reorder ties (seed 000's A, B, C,
    /// D at 10:01/10:02 skips C). No group is ever claimed complete.
    Unproven,
}

/// What proves that no event can still arrive at or before a timestamp.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Finality {
    /// A strictly later timestamp, seen in a complete traversal, proves every earlier group
    /// final (the source never backfills).
    LaterTimestamp,
    /// The provider reports a watermark: nothing at or before it can still arrive.
    Watermark,
    /// Events arrive at most this late (CloudWatch Logs: 14 days): a timestamp is final once a
    /// complete traversal ran that long after it.
    Lateness(Duration),
    /// No proof: groups never close.
    Unproven,
}

/// What an event seen by a poll is to the groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Seen {
    /// In an open group, for the first time in this attempt.
    New,
    /// In an open group, seen before in this attempt (a replayed page, or a later poll).
    Again,
    /// At or before `closed_through`, and not an event of a group this attempt closed: late
    /// against the contract that closed its group, or done by an earlier attempt. A receipt
    /// tells which: handled unless it shows the event done, never dropped.
    Late,
}

/// The open groups of one attempt of one partition.
#[derive(Debug)]
pub(crate) struct Groups {
    traversal: Traversal,
    finality: Finality,
    closed_through: Option<i64>,
    generation: u64,
    /// Open groups: timestamp -> identity -> settled.
    open: BTreeMap<i64, BTreeMap<String, bool>>,
    /// Every group strictly before this timestamp is complete and final (this attempt's
    /// evidence).
    complete_before: Option<i64>,
    /// Identities of the groups this attempt closed, and of late events it handed out, kept for
    /// `remember_ms` behind `closed_through`: an audit that reads them again sees them as known.
    /// Kept as 128-bit digests (an audit window of an hour at 100 events a second is 360,000 of
    /// them): two identities share one with odds of about 1 in 10^28.
    closed_ids: BTreeMap<i64, HashSet<u128>>,
    remember_ms: i64,
}

impl Groups {
    /// An attempt from the durable `closed_through` and its generation.
    pub(crate) fn new(
        traversal: Traversal,
        finality: Finality,
        closed_through: Option<i64>,
        generation: u64,
    ) -> Self {
        Self {
            traversal,
            finality,
            closed_through,
            generation,
            open: BTreeMap::new(),
            complete_before: None,
            closed_ids: BTreeMap::new(),
            remember_ms: 0,
        }
    }

    /// Keeps the identities of closed groups this far behind `closed_through` (the reach of the
    /// late-event audit).
    pub(crate) fn remember(mut self, ms: i64) -> Self {
        self.remember_ms = ms;
        self
    }

    /// Whether the contracts can ever close a group; when not, the consumer says so at start and
    /// replays the open groups on every poll (or refuses to run, as configured).
    pub(crate) fn can_close(&self) -> bool {
        self.traversal == Traversal::Complete && self.finality != Finality::Unproven
    }

    /// Where the next poll starts: strictly after this timestamp (`None`: from the beginning).
    /// After `closed_through` (seed 000), unless a proven group is held open (an event of it
    /// failing, for hours perhaps): then after what this attempt's complete polls proved final.
    /// The hold keeps `closed_through` behind, and the events after it that a complete poll
    /// enumerated are in the open groups already; reading them again on every poll would cost
    /// each poll more the longer the hold lasts. What comes late behind that point is the
    /// audit's to find (its window starts behind this point). A group not proven (the newest,
    /// under a later-timestamp contract) is read again either way.
    pub(crate) fn query_after(&self) -> Option<i64> {
        let Some(complete_before) = self.complete_before else {
            return self.closed_through;
        };
        let held = self
            .open
            .range(..complete_before)
            .any(|(_, group)| group.values().any(|settled| !*settled));
        let proven = complete_before.saturating_sub(1);
        match self.closed_through {
            Some(closed) if held => Some(closed.max(proven)),
            None if held => Some(proven),
            closed => closed,
        }
    }

    /// The generation the next compare-and-swap is conditioned on.
    #[cfg(test)]
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// An event a poll returned.
    pub(crate) fn saw(&mut self, timestamp: i64, id: &str) -> Seen {
        if self
            .closed_through
            .is_some_and(|closed| timestamp <= closed)
        {
            // Known from now on: handed out once by this attempt.
            let fresh = self
                .closed_ids
                .entry(timestamp)
                .or_default()
                .insert(digest(id));
            return if fresh { Seen::Late } else { Seen::Again };
        }
        let group = self.open.entry(timestamp).or_default();
        if group.contains_key(id) {
            return Seen::Again;
        }
        group.insert(id.to_string(), false);
        Seen::New
    }

    /// The event has a durable terminal outcome (its receipt, an ack).
    pub(crate) fn settled(&mut self, timestamp: i64, id: &str) {
        if let Some(settled) = self
            .open
            .get_mut(&timestamp)
            .and_then(|group| group.get_mut(id))
        {
            *settled = true;
        }
    }

    /// A poll traversed its pages to the end at wall time `now_ms`; `watermark` is the
    /// provider's, when it reports one; `before` bounds the events a step of a catch-up read.
    /// Evidence is taken only as the contracts give it meaning.
    pub(crate) fn traversed(&mut self, now_ms: i64, watermark: Option<i64>, before: Option<i64>) {
        if self.traversal != Traversal::Complete {
            return;
        }
        let evidence = match self.finality {
            // Groups strictly before the latest timestamp this complete traversal reached.
            Finality::LaterTimestamp => self.open.keys().next_back().copied(),
            Finality::Watermark => watermark.map(|w| w.saturating_add(1)),
            Finality::Lateness(bound) => {
                let bound = i64::try_from(bound.as_millis()).unwrap_or(i64::MAX);
                Some(now_ms.saturating_sub(bound).saturating_add(1))
            }
            Finality::Unproven => None,
        };
        // A step of a catch-up read only the events before its bound: it proves nothing later.
        let evidence = match before {
            Some(before) => evidence.map(|e| e.min(before)),
            None => evidence,
        };
        if let Some(evidence) = evidence {
            self.complete_before = Some(self.complete_before.map_or(evidence, |c| c.max(evidence)));
        }
    }

    /// The timestamp to close through now, if any: the greatest open timestamp strictly before
    /// the evidence whose group, and every group before it, has settled. With a watermark or a
    /// lateness bound, timestamps without events close too (up to the evidence).
    pub(crate) fn proposal(&self) -> Option<i64> {
        if !self.can_close() {
            return None;
        }
        let complete_before = self.complete_before?;
        let mut through = None;
        for (&timestamp, group) in self.open.range(..complete_before) {
            if !group.values().all(|settled| *settled) {
                return through;
            }
            through = Some(timestamp);
        }
        // Every open group before the evidence has settled. A watermark or a lateness bound also
        // covers the quiet time after them; a later timestamp covers only the groups it follows.
        let quiet = match self.finality {
            Finality::Watermark | Finality::Lateness(_) => Some(complete_before - 1),
            _ => through,
        };
        quiet.filter(|t| self.closed_through.is_none_or(|closed| *t > closed))
    }

    /// What the attempt holds in memory: events of open groups, and identities remembered
    /// behind `closed_through` for the audit.
    pub(crate) fn entries(&self) -> (usize, usize) {
        (
            self.open.values().map(BTreeMap::len).sum(),
            self.closed_ids.values().map(HashSet::len).sum(),
        )
    }

    /// The compare-and-swap of `through` (from [`proposal`](Self::proposal)) succeeded with
    /// `generation`: the closed groups leave memory.
    pub(crate) fn closed(&mut self, through: i64, generation: u64) {
        self.closed_through = Some(through);
        self.generation = generation;
        let open = self.open.split_off(&(through + 1));
        for (timestamp, group) in std::mem::replace(&mut self.open, open) {
            self.closed_ids
                .entry(timestamp)
                .or_default()
                .extend(group.into_keys().map(|id| digest(&id)));
        }
        self.closed_ids = self
            .closed_ids
            .split_off(&through.saturating_sub(self.remember_ms));
    }
}

/// An identity's 128-bit digest: two SipHash-1-3 sums under different prefixes.
fn digest(id: &str) -> u128 {
    let half = |prefix: u8| {
        let mut hasher = DefaultHasher::new();
        prefix.hash(&mut hasher);
        id.hash(&mut hasher);
        hasher.finish()
    };
    (u128::from(half(1)) << 64) | u128::from(half(2))
}

#[cfg(test)]
mod tests {
    use super::*;

    const T10_00: i64 = 36_000_000;
    const T10_01: i64 = 36_060_000;
    const T10_02: i64 = 36_120_000;

    fn groups(finality: Finality) -> Groups {
        Groups::new(Traversal::Complete, finality, Some(T10_00), 4)
    }

    /// Seed 000's retry example, executed: closed through 10:00; A and B at 10:01 on one page, C
    /// at 10:01 and D at 10:02 on the next. A first attempt handles A and B, then crashes: nothing
    /// closed. The retry queries after 10:00, finds A and B done (receipts), handles C; seeing D
    /// proves 10:01 complete, and once C is durable the worker closes through 10:01. The next
    /// query, after 10:01, still includes D.
    #[test]
    fn the_retry_example_closes_10_01_only_after_c() {
        let mut first = groups(Finality::LaterTimestamp);
        assert_eq!(first.query_after(), Some(T10_00));
        for id in ["A", "B"] {
            assert_eq!(first.saw(T10_01, id), Seen::New);
            first.settled(T10_01, id);
        }
        // A page boundary is no evidence: nothing to close before the crash.
        assert_eq!(first.proposal(), None);

        let mut retry = groups(Finality::LaterTimestamp);
        for (t, id) in [(T10_01, "A"), (T10_01, "B"), (T10_01, "C"), (T10_02, "D")] {
            assert_eq!(retry.saw(t, id), Seen::New);
        }
        retry.settled(T10_01, "A"); // receipts: done before the crash
        retry.settled(T10_01, "B");
        retry.traversed(T10_02 + 1_000, None, None);
        assert_eq!(retry.proposal(), None, "C is not durable yet");
        retry.settled(T10_01, "C");
        assert_eq!(retry.proposal(), Some(T10_01));
        retry.closed(T10_01, 5);
        assert_eq!(
            retry.query_after(),
            Some(T10_01),
            "D comes in the next query"
        );
        assert_eq!(retry.generation(), 5);
        assert_eq!(
            retry.proposal(),
            None,
            "10:02 is open: nothing later was seen"
        );
    }

    /// An event failing for hours holds its group open and `closed_through` behind it; the next
    /// poll starts after what the complete polls proved, not at the held group (before, every
    /// poll read again every event since the failing one: hours of them after hours). Once the
    /// event settles, everything proven closes. A source proven by later timestamps reads its
    /// newest group again; one without a complete traversal reads from `closed_through`.
    #[test]
    fn a_held_group_does_not_make_every_poll_read_again_what_was_proven() {
        let minute = 60_000;
        let mut g = groups(Finality::Lateness(std::time::Duration::from_secs(300)));
        g.saw(T10_01, "A"); // failing
        for (i, t) in (2..60).map(|m| T10_00 + m * minute).enumerate() {
            let id = format!("e{i}");
            g.saw(t, &id);
            g.settled(t, &id);
            g.traversed(t + 5 * minute, None, None);
        }
        let proven = T10_00 + 59 * minute;
        assert_eq!(g.proposal(), None, "A holds 10:01 and everything after it");
        assert_eq!(
            g.query_after(),
            Some(proven),
            "the next poll starts after the proof"
        );
        assert_eq!(g.saw(T10_02, "e0"), Seen::Again, "what it read is known");
        g.settled(T10_01, "A");
        assert_eq!(
            g.query_after(),
            Some(T10_00),
            "nothing held: after closed_through"
        );
        assert_eq!(g.proposal(), Some(proven));
        g.closed(proven, 5);
        assert_eq!(g.query_after(), Some(proven));

        let mut later = groups(Finality::LaterTimestamp);
        later.saw(T10_01, "A");
        later.saw(T10_02, "B");
        later.settled(T10_02, "B");
        later.traversed(T10_02 + minute, None, None);
        assert_eq!(later.proposal(), None);
        assert_eq!(later.query_after(), Some(T10_02 - 1), "10:02 is read again");

        let mut unproven = Groups::new(
            Traversal::Unproven,
            Finality::Lateness(std::time::Duration::from_secs(300)),
            Some(T10_00),
            0,
        );
        unproven.saw(T10_02, "B");
        unproven.traversed(T10_02 + 10 * minute, None, None);
        assert_eq!(unproven.query_after(), Some(T10_00));
    }

    /// A tie group larger than a page: every page boundary inside it is no evidence.
    #[test]
    fn a_tie_group_across_pages_closes_only_when_a_later_timestamp_follows_it() {
        let mut g = groups(Finality::LaterTimestamp);
        for page in [["a", "b"], ["c", "d"], ["e", "f"]] {
            for id in page {
                g.saw(T10_01, id);
                g.settled(T10_01, id);
            }
            g.traversed(T10_01 + 60_000, None, None);
            assert_eq!(g.proposal(), None, "only 10:01 seen so far");
        }
        g.saw(T10_02, "g");
        g.traversed(T10_02, None, None);
        assert_eq!(g.proposal(), Some(T10_01));
    }

    /// Seed 000's counterexample: offset pages over a set whose tie order changes (A, B, C at
    /// 10:01, D at 10:02; the second request sees C, A, B, D and offset two returns B and D). C
    /// never comes; D comes. A source without a complete traversal contract never closes 10:01,
    /// however much it sees: the group is read again on every poll.
    #[test]
    fn without_a_complete_traversal_nothing_closes_even_after_a_later_timestamp() {
        let mut g = Groups::new(
            Traversal::Unproven,
            Finality::LaterTimestamp,
            Some(T10_00),
            0,
        );
        assert!(!g.can_close());
        for (t, id) in [(T10_01, "A"), (T10_01, "B"), (T10_01, "B"), (T10_02, "D")] {
            g.saw(t, id);
            g.settled(t, id);
        }
        g.traversed(T10_02 + 1, None, None);
        assert_eq!(
            g.proposal(),
            None,
            "C was skipped by the source: 10:01 stays open"
        );
        assert_eq!(g.query_after(), Some(T10_00));
    }

    /// A late event at the proposed closed timestamp keeps the group open until it settles; one
    /// that arrives after the group closed is counted as late.
    #[test]
    fn a_late_event_at_the_proposed_timestamp_keeps_it_open() {
        let mut g = groups(Finality::LaterTimestamp);
        for (t, id) in [(T10_01, "A"), (T10_02, "D")] {
            g.saw(t, id);
            g.settled(t, id);
        }
        g.traversed(T10_02, None, None);
        assert_eq!(g.proposal(), Some(T10_01));
        // Before the close is written, the next poll returns E at 10:01.
        assert_eq!(g.saw(T10_01, "E"), Seen::New);
        assert_eq!(g.saw(T10_01, "A"), Seen::Again);
        assert_eq!(g.proposal(), None, "E is pending");
        g.settled(T10_01, "E");
        assert_eq!(g.proposal(), Some(T10_01));
        g.closed(T10_01, 5);
        // After the close, an event at 10:01 breaks the source's finality contract; one this
        // attempt closed is known.
        assert_eq!(g.saw(T10_01, "F"), Seen::Late);
        assert_eq!(g.saw(T10_01, "E"), Seen::Again);
        assert_eq!(
            g.saw(T10_01, "F"),
            Seen::Again,
            "a late event is handed out once"
        );
    }

    /// A quiet stream: the newest group has no later timestamp, so it stays open (and is read
    /// again by every poll) unless the provider's watermark passes it.
    #[test]
    fn a_quiet_newest_group_stays_open_until_a_watermark_passes_it() {
        let mut later = groups(Finality::LaterTimestamp);
        later.saw(T10_01, "A");
        later.settled(T10_01, "A");
        later.traversed(T10_02 * 10, None, None);
        assert_eq!(later.proposal(), None);

        let mut watermark = groups(Finality::Watermark);
        watermark.saw(T10_01, "A");
        watermark.settled(T10_01, "A");
        watermark.traversed(T10_02, None, None);
        assert_eq!(watermark.proposal(), None, "no watermark reported");
        watermark.traversed(T10_02, Some(T10_01 + 30_000), None);
        assert_eq!(
            watermark.proposal(),
            Some(T10_01 + 30_000),
            "the watermark covers the quiet time too"
        );
    }

    /// Within a lateness bound ("up to 10 minutes late"), a group closes only once a complete
    /// traversal ran 10 minutes after it.
    #[test]
    fn a_lateness_bound_holds_a_group_open_until_it_has_passed() {
        let ten_minutes = 600_000;
        let bound = Finality::Lateness(Duration::from_secs(600));
        let mut g = groups(bound);
        g.saw(T10_01, "A");
        g.settled(T10_01, "A");
        g.traversed(T10_01 + ten_minutes - 1, None, None);
        // The quiet time before 10:01 is final; 10:01 itself may still receive events.
        assert_eq!(g.proposal(), Some(T10_01 - 1));
        g.traversed(T10_01 + ten_minutes, None, None);
        assert_eq!(g.proposal(), Some(T10_01));
        // A pending event holds every later group.
        let mut held = groups(bound);
        held.saw(T10_01, "A");
        held.saw(T10_02, "B");
        held.settled(T10_02, "B");
        held.traversed(T10_02 + ten_minutes * 2, None, None);
        assert_eq!(
            held.proposal(),
            None,
            "A holds 10:01 and everything after it"
        );
    }

    /// No finality at all: nothing ever closes.
    #[test]
    fn without_a_finality_contract_nothing_closes() {
        let mut g = groups(Finality::Unproven);
        assert!(!g.can_close());
        g.saw(T10_01, "A");
        g.settled(T10_01, "A");
        g.saw(T10_02, "B");
        g.traversed(i64::MAX / 2, Some(T10_02), None);
        assert_eq!(g.proposal(), None);
    }
}
