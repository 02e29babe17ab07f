//! A worker's request budget for one API of a source: requests spaced evenly at a rate, on
//! tokio's clock (so paused-time tests and the simulation drive it). CloudWatch Logs' quotas are
//! per account and Region and shared by every worker; each worker keeping to its own budget keeps
//! a handful of workers inside them, and throttling that still comes is backed off by the reader.
//!
//! Written here rather than taken from `governor`: its waits run on `futures-timer`'s real clock,
//! which paused time cannot move.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// How long a request for a partition with nothing recent lets requests for busy ones go first:
/// hundreds of silent streams polled while a few take every event would otherwise delay the busy
/// streams' reads and audits by the whole queue.
pub(crate) const IDLE_DEFERRAL: Duration = Duration::from_secs(60);

/// Whose request it is: when requests wait for their turn, a busy partition's goes before an
/// idle one's that came up to [`IDLE_DEFERRAL`] earlier (so an idle one waits that much longer at
/// most, never for good).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Priority {
    /// A partition that brought events lately, or one not read yet.
    Busy,
    /// A partition with nothing recent.
    Idle,
}

/// Requests at most `rate` a second, each one `1 / rate` after the one before, served earliest
/// deadline first (a request's deadline is when it came, and [`IDLE_DEFERRAL`] later for an idle
/// partition's).
#[derive(Debug)]
pub(crate) struct Budget {
    spacing: Duration,
    state: Mutex<State>,
    /// A request came, was served or gave up: the waiting ones look again.
    changed: Notify,
}

#[derive(Debug, Default)]
struct State {
    /// When the next request may start.
    next: Option<Instant>,
    /// The waiting requests: (deadline, ticket).
    waiting: BTreeSet<(Instant, u64)>,
    tickets: u64,
}

/// A waiting request: leaves the queue when its wait is cancelled (served, it has left it).
struct Waiting<'a> {
    budget: &'a Budget,
    key: (Instant, u64),
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let removed = self.budget.lock().waiting.remove(&self.key);
        if removed {
            self.budget.changed.notify_waiters();
        }
    }
}

impl Budget {
    /// `rate` requests a second (at least one an hour).
    pub(crate) fn per_second(rate: f64) -> Self {
        let rate = if rate.is_finite() { rate } else { 1.0 };
        Self {
            spacing: Duration::from_secs_f64(1.0 / rate.max(1.0 / 3600.0)),
            state: Mutex::default(),
            changed: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for this request's turn, as a busy partition's.
    pub(crate) async fn acquire(&self) {
        self.acquire_as(Priority::Busy).await;
    }

    /// Waits for this request's turn. Cancelling the wait gives nothing back: a turn not taken
    /// passes to the next request in line.
    pub(crate) async fn acquire_as(&self, priority: Priority) {
        let came = Instant::now();
        let deadline = match priority {
            Priority::Busy => came,
            Priority::Idle => came + IDLE_DEFERRAL,
        };
        let waiting = {
            let mut state = self.lock();
            state.tickets += 1;
            let key = (deadline, state.tickets);
            state.waiting.insert(key);
            Waiting { budget: self, key }
        };
        self.changed.notify_waiters();
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let turn = {
                let mut state = self.lock();
                if state.waiting.first() == Some(&waiting.key) {
                    let now = Instant::now();
                    let at = state.next.map_or(now, |n| n.max(now));
                    if at <= now {
                        state.waiting.remove(&waiting.key);
                        state.next = Some(now + self.spacing);
                        drop(state);
                        self.changed.notify_waiters();
                        return;
                    }
                    Some(at)
                } else {
                    None
                }
            };
            match turn {
                Some(at) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(at) => {}
                        _ = &mut changed => {}
                    }
                }
                None => changed.await,
            }
        }
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

    /// 20 idle partitions' polls queued, then a busy partition's read: it goes next, not 20th;
    /// an idle request waits [`IDLE_DEFERRAL`] longer at most; a cancelled wait gives its turn on.
    #[tokio::test(start_paused = true)]
    async fn a_busy_partitions_request_goes_before_idle_ones_waiting_less_than_the_deferral() {
        use std::sync::Arc;
        let budget = Arc::new(Budget::per_second(1.0));
        let start = Instant::now();
        budget.acquire_as(Priority::Idle).await;
        let served = Arc::new(Mutex::new(Vec::new()));
        let mut idle = Vec::new();
        for i in 0..20 {
            let (budget, served) = (budget.clone(), served.clone());
            idle.push(tokio::spawn(async move {
                budget.acquire_as(Priority::Idle).await;
                served
                    .lock()
                    .unwrap()
                    .push((format!("idle {i}"), start.elapsed()));
            }));
        }
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        // A request that gives up: its place passes on.
        let gave_up = tokio::time::timeout(Duration::from_millis(100), budget.acquire()).await;
        assert!(gave_up.is_err());
        budget.acquire().await;
        served
            .lock()
            .unwrap()
            .push(("busy".to_string(), start.elapsed()));
        for task in idle {
            task.await.unwrap();
        }
        let served = served.lock().unwrap().clone();
        assert_eq!(served[0], ("busy".to_string(), Duration::from_secs(1)));
        assert_eq!(served[1].0, "idle 0");
        assert_eq!(served.len(), 21);
        // One a second throughout: the budget's rate is kept.
        assert_eq!(served[20].1, Duration::from_secs(21));

        // Idle requests that came more than the deferral before a busy one go first.
        let budget = Budget::per_second(1.0);
        budget.acquire().await;
        let old = budget.acquire_as(Priority::Idle);
        tokio::pin!(old);
        assert!(futures::poll!(old.as_mut()).is_pending());
        tokio::time::sleep(IDLE_DEFERRAL + Duration::from_secs(1)).await;
        let busy = budget.acquire();
        tokio::pin!(busy);
        assert!(futures::poll!(busy.as_mut()).is_pending());
        assert!(futures::poll!(old.as_mut()).is_ready());
    }
}
