//! The settlement tracker: where a shard's checkpoint may stand.
//!
//! Deliveries are numbered by arrival, never by parsing sequence numbers. Settlements arrive in any
//! order (lanes run in parallel); the checkpoint is the last delivery of the contiguous settled run
//! that starts at the oldest delivery, so it never passes one that is still running.
//!
//! ```text
//! arrival:  0        1        2        3        4        5
//! state:    settled  settled  running  settled  settled  running
//!                    ^ checkpoint
//! settle(2) -> Advanced { through: 4 }   (5 still runs)
//! ```
//!
//! Each delivery carries the tracker's epoch. A new epoch (lease taken again, seek) starts the
//! window afresh; settling a delivery of an older epoch, or settling one twice, changes nothing.
//!
//! Cost: settled flags are kept in a ring of 64-bit words, so a settlement touches one bit (1 million
//! deliveries in flight take 128 KiB of flags) and the advance over a settled run skips up to 64
//! deliveries per step. Positions are kept in a ring beside the flags and dropped as the checkpoint
//! passes them. Memory is proportional to the deliveries between the checkpoint and the newest one.

use std::collections::VecDeque;

/// Identifies one delivery to its shard's tracker: the epoch it was read under and its arrival index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeliveryId {
    epoch: u64,
    index: u64,
}

impl DeliveryId {
    /// The tracker epoch the delivery was read under.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The delivery's arrival index in its shard (counted across epochs).
    pub fn index(&self) -> u64 {
        self.index
    }
}

/// What a settlement did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settlement<P> {
    /// Nothing: the delivery was already settled, belongs to an older epoch, or was never tracked.
    Ignored,
    /// Recorded; the checkpoint stays because an earlier delivery is still unsettled.
    Held,
    /// Recorded, and the checkpoint moved to the delivery at `index`, at `position`.
    Advanced {
        /// Arrival index of the new checkpoint delivery.
        index: u64,
        /// That delivery's position.
        position: P,
    },
}

impl<P> Settlement<P> {
    /// Whether the settlement was taken (false for a duplicate or stale one).
    pub fn accepted(&self) -> bool {
        !matches!(self, Settlement::Ignored)
    }

    /// The new checkpoint position, if the checkpoint moved.
    pub fn advanced_to(&self) -> Option<&P> {
        match self {
            Settlement::Advanced { position, .. } => Some(position),
            _ => None,
        }
    }
}

/// Tracks one shard's deliveries between its checkpoint and the newest read, for one epoch at a time.
///
/// `P` is what the checkpoint is written as (a [`Position`](crate::Position) in the runtime).
#[derive(Debug)]
pub struct Tracker<P> {
    epoch: u64,
    /// Arrival index of the oldest unsettled delivery (`positions[0]`); everything before is settled.
    base: u64,
    positions: VecDeque<P>,
    /// Settled flags; bit `i` of `words[w]` is delivery `origin + 64 * w + i`.
    words: VecDeque<u64>,
    origin: u64,
    unsettled: usize,
}

impl<P> Tracker<P> {
    /// An empty tracker at `epoch`.
    pub fn new(epoch: u64) -> Self {
        Self {
            epoch,
            base: 0,
            positions: VecDeque::new(),
            words: VecDeque::new(),
            origin: 0,
            unsettled: 0,
        }
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Registers the next delivery in arrival order and returns the id it settles with.
    pub fn track(&mut self, position: P) -> DeliveryId {
        let index = self.base + self.positions.len() as u64;
        if index - self.origin >= 64 * self.words.len() as u64 {
            self.words.push_back(0);
        }
        self.positions.push_back(position);
        self.unsettled += 1;
        DeliveryId {
            epoch: self.epoch,
            index,
        }
    }

    /// Marks a delivery settled. Returns [`Settlement::Ignored`] for a stale epoch, a duplicate or an
    /// unknown id, and otherwise whether the checkpoint moved.
    pub fn settle(&mut self, id: DeliveryId) -> Settlement<P> {
        if id.epoch != self.epoch || id.index < self.base {
            return Settlement::Ignored;
        }
        let offset = id.index - self.base;
        if offset >= self.positions.len() as u64 {
            return Settlement::Ignored;
        }
        let (word, bit) = self.locate(id.index);
        if self.words[word] & bit != 0 {
            return Settlement::Ignored;
        }
        self.words[word] |= bit;
        self.unsettled -= 1;
        if offset != 0 {
            return Settlement::Held;
        }
        self.advance()
    }

    /// Starts a new epoch: forgets every tracked delivery (they settle as stale from now on) and
    /// returns the new epoch. Arrival indexes continue where they were.
    pub fn next_epoch(&mut self) -> u64 {
        self.epoch += 1;
        self.base += self.positions.len() as u64;
        self.positions.clear();
        self.words.clear();
        self.origin = self.base - self.base % 64;
        self.unsettled = 0;
        self.epoch
    }

    /// The arrival index the next tracked delivery gets: every delivery below it was tracked.
    pub fn next_index(&self) -> u64 {
        self.base + self.positions.len() as u64
    }

    /// Deliveries tracked and not yet settled.
    pub fn unsettled(&self) -> usize {
        self.unsettled
    }

    /// Deliveries held in memory: from the oldest unsettled to the newest, settled or not.
    pub fn window(&self) -> usize {
        self.positions.len()
    }

    /// Whether every tracked delivery has settled.
    pub fn is_drained(&self) -> bool {
        self.positions.is_empty()
    }

    /// The oldest unsettled delivery's position: what holds the checkpoint.
    pub fn oldest_unsettled(&self) -> Option<&P> {
        self.positions.front()
    }

    fn locate(&self, index: u64) -> (usize, u64) {
        let rel = index - self.origin;
        ((rel / 64) as usize, 1u64 << (rel % 64))
    }

    /// Moves `base` over the settled run that starts at it, drops what it passed, and reports the
    /// last delivery passed.
    fn advance(&mut self) -> Settlement<P> {
        let start = self.base;
        let end = start + self.positions.len() as u64;
        let mut base = start;
        while base < end {
            let rel = base - self.origin;
            let shift = rel % 64;
            let run = (self.words[(rel / 64) as usize] >> shift).trailing_ones() as u64;
            base += run.min(64 - shift);
            if run < 64 - shift {
                break;
            }
        }
        let base = base.min(end);
        let passed = (base - start) as usize;
        let position = self
            .positions
            .drain(..passed)
            .last()
            .expect("advance is called when the oldest delivery settled");
        self.base = base;
        while self.base - self.origin >= 64 {
            self.words.pop_front();
            self.origin += 64;
        }
        Settlement::Advanced {
            index: base - 1,
            position,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Each row: arrivals, then settlement order (by arrival index), then the checkpoint index
    /// expected after each settlement (None = held or ignored).
    #[test]
    fn table_of_settlement_orders() {
        /// (name, arrivals, settlement order, checkpoint after each settlement)
        type Row<'a> = (&'a str, usize, &'a [u64], &'a [Option<u64>]);
        let rows: &[Row<'_>] = &[
            (
                "in order, each moves it",
                3,
                &[0, 1, 2],
                &[Some(0), Some(1), Some(2)],
            ),
            (
                "reverse order: held until the oldest settles",
                3,
                &[2, 1, 0],
                &[None, None, Some(2)],
            ),
            (
                "the seed's example: 3 runs, 6 runs",
                6,
                &[0, 1, 3, 4, 2],
                &[Some(0), Some(1), None, None, Some(4)],
            ),
            (
                "a duplicate changes nothing",
                2,
                &[1, 1, 0],
                &[None, None, Some(1)],
            ),
            (
                "settling before the first arrival is ignored",
                2,
                &[0, 0],
                &[Some(0), None],
            ),
        ];
        for (name, arrivals, order, expected) in rows {
            let mut t = Tracker::new(0);
            let ids: Vec<_> = (0..*arrivals).map(|i| t.track(i as u64)).collect();
            for (step, (&i, want)) in order.iter().zip(expected.iter()).enumerate() {
                let got = t.settle(ids[i as usize]).advanced_to().copied();
                assert_eq!(got, *want, "{name}: step {step} settling {i}");
            }
        }
    }

    #[test]
    fn runs_longer_than_a_word_advance_in_one_step() {
        let mut t = Tracker::new(0);
        let ids: Vec<_> = (0..1000u64).map(|i| t.track(i)).collect();
        for id in &ids[1..] {
            assert_eq!(t.settle(*id), Settlement::Held);
        }
        assert_eq!(t.window(), 1000);
        assert_eq!(t.settle(ids[0]).advanced_to(), Some(&999));
        assert!(t.is_drained());
        assert!(
            t.words.len() <= 1,
            "flag words are released as the checkpoint passes them"
        );
    }

    #[test]
    fn a_new_epoch_makes_earlier_deliveries_stale() {
        let mut t = Tracker::new(7);
        let old = t.track("a");
        let _ = t.track("b");
        assert_eq!(t.next_epoch(), 8);
        assert_eq!(t.settle(old), Settlement::Ignored);
        let new = t.track("c");
        assert_eq!(new.epoch(), 8);
        assert!(new.index() > old.index());
        assert_eq!(t.settle(new).advanced_to(), Some(&"c"));
    }

    #[test]
    fn oldest_unsettled_is_what_holds_the_checkpoint() {
        let mut t = Tracker::new(0);
        let a = t.track('a');
        let b = t.track('b');
        t.settle(b);
        assert_eq!(t.oldest_unsettled(), Some(&'a'));
        assert_eq!(t.unsettled(), 1);
        t.settle(a);
        assert_eq!(t.oldest_unsettled(), None);
    }

    #[derive(Debug, Clone)]
    enum Step {
        Arrive,
        /// Settle the delivery at this (scaled) arrival index.
        Settle(prop::sample::Index),
        /// A settlement from the previous epoch (read before a reset).
        SettleStale(prop::sample::Index),
        /// Lease retaken or seek: a new epoch.
        NewEpoch,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            6 => Just(Step::Arrive),
            8 => any::<prop::sample::Index>().prop_map(Step::Settle),
            1 => any::<prop::sample::Index>().prop_map(Step::SettleStale),
            1 => Just(Step::NewEpoch),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(10_000))]

        /// For any interleaving of arrivals, settlements (duplicates included), stale settlements and
        /// epoch changes, the checkpoint is the end of the longest settled prefix of the current
        /// epoch, never decreases within an epoch, never passes an unsettled delivery, and stale
        /// settlements change nothing.
        #[test]
        fn checkpoint_is_the_end_of_the_settled_prefix(steps in proptest::collection::vec(step(), 1..300)) {
            let mut t = Tracker::new(1);
            // Model for the current epoch: ids and settled flags by arrival; previous epoch's ids.
            let mut ids: Vec<DeliveryId> = Vec::new();
            let mut settled: Vec<bool> = Vec::new();
            let mut stale: Vec<DeliveryId> = Vec::new();
            let mut checkpoint: Option<u64> = None;
            for s in steps {
                match s {
                    Step::Arrive => {
                        let pos = ids.len() as u64;
                        ids.push(t.track(pos));
                        settled.push(false);
                    }
                    Step::Settle(i) if !ids.is_empty() => {
                        let k = i.index(ids.len());
                        let was = settled[k];
                        let result = t.settle(ids[k]);
                        prop_assert_eq!(result.accepted(), !was, "a second settlement is ignored");
                        settled[k] = true;
                        let prefix = settled.iter().take_while(|s| **s).count();
                        let expect = (prefix > 0).then(|| prefix as u64 - 1);
                        if let Some(&to) = result.advanced_to() {
                            prop_assert!(checkpoint.is_none_or(|c| to > c), "checkpoint went backwards");
                            checkpoint = Some(to);
                        }
                        prop_assert_eq!(checkpoint, expect, "checkpoint is the end of the settled prefix");
                        if let Some(c) = checkpoint {
                            prop_assert!(settled[..=c as usize].iter().all(|s| *s), "passed an unsettled delivery");
                        }
                        prop_assert_eq!(t.unsettled(), settled.iter().filter(|s| !**s).count());
                        prop_assert_eq!(t.window(), settled.len() - prefix);
                    }
                    Step::SettleStale(i) if !stale.is_empty() => {
                        let before = (t.window(), t.unsettled());
                        prop_assert_eq!(t.settle(stale[i.index(stale.len())]), Settlement::Ignored);
                        prop_assert_eq!(before, (t.window(), t.unsettled()));
                    }
                    Step::NewEpoch => {
                        t.next_epoch();
                        stale.append(&mut ids);
                        settled.clear();
                        checkpoint = None;
                        prop_assert!(t.is_drained());
                    }
                    _ => {}
                }
            }
        }
    }
}
