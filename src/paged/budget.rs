//! A worker's request budget for one API of a source: requests spaced evenly at a rate, on
//! tokio's clock (so paused-time tests and the simulation drive it). CloudWatch Logs' quotas are
//! per account and Region and shared by every worker; each worker keeping to its own budget keeps
//! a handful of workers inside them, and throttling that still comes is backed off by the reader.
//!
//! Written here rather than taken from `governor`: its waits run on `futures-timer`'s real clock,
//! which paused time cannot move.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Requests at most `rate` a second, each one `1 / rate` after the one before.
#[derive(Debug)]
pub(crate) struct Budget {
    spacing: Duration,
    /// When the next request may start.
    next: Mutex<Option<Instant>>,
}

impl Budget {
    /// `rate` requests a second (at least one an hour).
    pub(crate) fn per_second(rate: f64) -> Self {
        let rate = if rate.is_finite() { rate } else { 1.0 };
        Self {
            spacing: Duration::from_secs_f64(1.0 / rate.max(1.0 / 3600.0)),
            next: Mutex::new(None),
        }
    }

    /// Waits for this request's turn. Cancelling the wait gives nothing back: the turn passes
    /// unused, which only spaces later requests more.
    pub(crate) async fn acquire(&self) {
        let at = {
            let mut next = self.next.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            let at = next.map_or(now, |n| n.max(now));
            *next = Some(at + self.spacing);
            at
        };
        tokio::time::sleep_until(at).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn requests_are_spaced_at_the_rate_and_a_pause_is_not_made_up_for() {
        let budget = Budget::per_second(5.0);
        let start = Instant::now();
        for _ in 0..11 {
            budget.acquire().await;
        }
        // The first at once, then one every 200 ms.
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        tokio::time::sleep(Duration::from_secs(10)).await;
        let quiet = Instant::now();
        budget.acquire().await;
        budget.acquire().await;
        // After a quiet spell: one at once, the next 200 ms later (no burst saved up).
        assert_eq!(quiet.elapsed(), Duration::from_millis(200));
    }
}
