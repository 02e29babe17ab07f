//! Injected faults for the in-memory stream and lease store: what a remote service does to its
//! callers, drawn call by call from a seeded generator so a run can be replayed.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// How often each kind of fault happens, as a probability per call (0 turns it off).
///
/// ```
/// use std::time::Duration;
/// use shardwise::lease::MemoryLeaseStore;
/// use shardwise::testing::Faults;
/// let store = MemoryLeaseStore::new();
/// // One call in twenty fails, one in fifty is applied but its answer is lost.
/// store.inject(7, Faults::default().error(0.05).lost_answer(0.02));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Faults {
    /// The call fails at once without effect (a 5xx, a reset connection).
    pub error: f64,
    /// The call is throttled: it fails without effect as the service's throughput error.
    pub throttle: f64,
    /// The call hangs for [`timeout_after`](Self::timeout_after), then fails without effect (a
    /// client timeout on a request that never arrived).
    pub timeout: f64,
    /// A write is applied, then its answer is lost: the caller sees an error (after
    /// [`timeout_after`](Self::timeout_after)) for a write that happened.
    pub lost_answer: f64,
    /// A read of a stream fails as an expired iterator.
    pub expired_iterator: f64,
    /// The call is applied and its answer arrives [`timeout_after`](Self::timeout_after) late,
    /// but arrives (a slow network, a long garbage-collection pause at the service).
    pub slow_answer: f64,
    /// How long a timed-out call hangs.
    pub timeout_after: Duration,
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            error: 0.0,
            throttle: 0.0,
            timeout: 0.0,
            lost_answer: 0.0,
            expired_iterator: 0.0,
            slow_answer: 0.0,
            timeout_after: Duration::from_secs(1),
        }
    }
}

impl Faults {
    /// No faults.
    pub fn none() -> Self {
        Self::default()
    }

    /// Sets the probability of an error.
    pub fn error(mut self, p: f64) -> Self {
        self.error = p;
        self
    }

    /// Sets the probability of throttling.
    pub fn throttle(mut self, p: f64) -> Self {
        self.throttle = p;
        self
    }

    /// Sets the probability of a timeout, and how long it hangs.
    pub fn timeout(mut self, p: f64, after: Duration) -> Self {
        self.timeout = p;
        self.timeout_after = after;
        self
    }

    /// Sets the probability that a write is applied and its answer lost.
    pub fn lost_answer(mut self, p: f64) -> Self {
        self.lost_answer = p;
        self
    }

    /// Sets the probability that a stream read finds its iterator expired.
    pub fn expired_iterator(mut self, p: f64) -> Self {
        self.expired_iterator = p;
        self
    }

    /// Sets the probability that a call is applied and answered late (after
    /// [`timeout_after`](Self::timeout_after)), but answered.
    pub fn slow_answer(mut self, p: f64) -> Self {
        self.slow_answer = p;
        self
    }
}

/// What happens to one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// It fails without effect.
    Error,
    /// It is throttled, without effect.
    Throttle,
    /// It hangs, then fails without effect.
    Timeout(Duration),
    /// (Writes) it is applied, then fails after the delay.
    LostAnswer(Duration),
    /// (Stream reads) the iterator expired.
    ExpiredIterator,
    /// It is applied, and answered after the delay.
    SlowAnswer(Duration),
}

/// The faults of one store or stream and the generator they are drawn from. Cloning shares both.
#[derive(Debug, Clone, Default)]
pub(crate) struct Injector {
    state: Arc<Mutex<Option<(Faults, StdRng)>>>,
}

impl Injector {
    pub(crate) fn set(&self, seed: u64, faults: Faults) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((faults, StdRng::seed_from_u64(seed)));
    }

    pub(crate) fn clear(&self) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// What happens to the next call; `write` says whether it has an effect that can be applied
    /// with its answer lost, `read` whether its iterator can expire.
    pub(crate) fn draw(&self, write: bool, read: bool) -> Option<Fault> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (faults, rng) = state.as_mut()?;
        let roll: f64 = rng.random();
        let mut edge = 0.0;
        let mut hit = |p: f64| {
            edge += p;
            roll < edge
        };
        if hit(faults.error) {
            Some(Fault::Error)
        } else if hit(faults.throttle) {
            Some(Fault::Throttle)
        } else if hit(faults.timeout) {
            Some(Fault::Timeout(faults.timeout_after))
        } else if write && hit(faults.lost_answer) {
            Some(Fault::LostAnswer(faults.timeout_after))
        } else if read && hit(faults.expired_iterator) {
            Some(Fault::ExpiredIterator)
        } else if hit(faults.slow_answer) {
            Some(Fault::SlowAnswer(faults.timeout_after))
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_draws_the_same_faults() {
        let draws = |seed| {
            let i = Injector::default();
            i.set(
                seed,
                Faults::default().error(0.2).throttle(0.2).lost_answer(0.2),
            );
            (0..200).map(|_| i.draw(true, false)).collect::<Vec<_>>()
        };
        assert_eq!(draws(1), draws(1));
        assert_ne!(draws(1), draws(2));
        let all = draws(3);
        for kind in [
            Fault::Error,
            Fault::Throttle,
            Fault::LostAnswer(Duration::from_secs(1)),
        ] {
            assert!(all.contains(&Some(kind)), "{kind:?} drawn");
        }
        assert!(all.contains(&None), "most calls go through");
    }

    #[test]
    fn reads_never_lose_an_answer_and_nothing_happens_without_faults() {
        let i = Injector::default();
        assert_eq!(i.draw(true, true), None);
        i.set(9, Faults::default().lost_answer(1.0));
        assert!((0..50).all(|_| i.draw(false, false).is_none()));
        i.clear();
        assert_eq!(i.draw(true, false), None);
    }
}
