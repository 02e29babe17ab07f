//! The one backoff every retried call uses: backon's exponential backoff from 100 ms, doubling,
//! capped, with jitter so that retrying workers spread out. Under a deterministic simulation the
//! jitter comes from the simulation's seed instead of the system's entropy.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};

/// The shortest wait, after a first failure.
const FIRST: Duration = Duration::from_millis(100);

/// Waits between attempts of one call: [`next`](Self::next) after each failure,
/// [`reset`](Self::reset) after a success.
#[derive(Debug)]
pub(crate) struct Backoff {
    max: Duration,
    waits: Option<ExponentialBackoff>,
}

impl Backoff {
    /// Waits that double from 100 ms up to `max`, each plus a random part of itself.
    pub(crate) fn new(max: Duration) -> Self {
        Self { max, waits: None }
    }

    /// The wait before the next attempt.
    pub(crate) fn next(&mut self) -> Duration {
        let max = self.max;
        self.waits
            .get_or_insert_with(|| {
                let builder = ExponentialBuilder::new()
                    .with_min_delay(FIRST.min(max))
                    .with_max_delay(max)
                    .with_factor(2.0)
                    .with_jitter()
                    .without_max_times();
                match simulated_seed() {
                    Some(seed) => builder.with_jitter_seed(seed).build(),
                    None => builder.build(),
                }
            })
            .next()
            .unwrap_or(max)
    }

    /// The call succeeded: the next failure starts again from the shortest wait.
    pub(crate) fn reset(&mut self) {
        self.waits = None;
    }
}

/// A number drawn uniformly from [0, 1): from the simulation's seed when one seeded this thread.
pub(crate) fn fraction() -> f64 {
    match simulated_seed() {
        Some(seed) => (seed >> 11) as f64 / (1u64 << 53) as f64,
        None => rand::random::<f64>(),
    }
}

#[cfg(any(test, feature = "testing"))]
thread_local! {
    /// A splitmix64 state, when a simulation seeded this thread.
    static SEEDS: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// From now on, on this thread, jitter is drawn from generators seeded from `seed` (`None`: from
/// the system's entropy again).
#[cfg(any(test, feature = "testing"))]
pub(crate) fn simulate_jitter(seed: Option<u64>) {
    SEEDS.set(seed);
}

#[cfg(any(test, feature = "testing"))]
fn simulated_seed() -> Option<u64> {
    SEEDS.with(|state| {
        let s = state.get()?.wrapping_add(0x9E37_79B9_7F4A_7C15);
        state.set(Some(s));
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Some(z ^ (z >> 31))
    })
}

#[cfg(not(any(test, feature = "testing")))]
fn simulated_seed() -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_100_ms_up_to_the_cap_with_at_most_as_much_again_in_jitter() {
        let max = Duration::from_secs(5);
        let mut backoff = Backoff::new(max);
        let mut base = FIRST;
        for _ in 0..10 {
            let wait = backoff.next();
            assert!(wait >= base && wait <= base * 2, "{wait:?} for {base:?}");
            base = (base * 2).min(max);
        }
        backoff.reset();
        assert!(backoff.next() <= FIRST * 2, "a success starts over");
    }

    #[test]
    fn a_simulated_seed_makes_the_waits_repeat() {
        let waits = |seed| {
            simulate_jitter(Some(seed));
            let mut backoff = Backoff::new(Duration::from_secs(5));
            let w: Vec<Duration> = (0..6).map(|_| backoff.next()).collect();
            simulate_jitter(None);
            w
        };
        assert_eq!(waits(7), waits(7));
        assert_ne!(waits(7), waits(8));
    }
}
