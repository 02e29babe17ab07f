//! The one backoff every retried call uses: exponential from 100 ms, capped, with jitter.

use std::time::Duration;

use rand::Rng;

/// The wait before retry number `failures` (1 for the first): 100 ms doubled per failure, at most
/// `max`, then a random point in its upper half so that retrying workers spread out.
pub(crate) fn jittered(failures: u32, max: Duration) -> Duration {
    let ceiling = Duration::from_millis(100)
        .saturating_mul(1 << failures.min(10))
        .min(max);
    rand::rng().random_range(ceiling / 2..=ceiling)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_then_caps_within_the_upper_half() {
        let max = Duration::from_secs(5);
        for (failures, ceiling) in [(1, 200), (2, 400), (5, 3_200), (6, 5_000), (40, 5_000)] {
            let ceiling = Duration::from_millis(ceiling);
            let wait = jittered(failures, max);
            assert!(
                wait >= ceiling / 2 && wait <= ceiling,
                "{failures}: {wait:?}"
            );
        }
    }
}
