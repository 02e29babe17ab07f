//! Wall-clock time as shardwise uses it: milliseconds since the Unix epoch, as the lease table and
//! Kinesis arrival timestamps express it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch (negative before it).
pub(crate) fn millis(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_millis() as i64,
        Err(e) => -(e.duration().as_millis() as i64),
    }
}

/// The time `ms` milliseconds after the Unix epoch (before it when negative).
pub(crate) fn from_millis(ms: i64) -> SystemTime {
    if ms >= 0 {
        UNIX_EPOCH + Duration::from_millis(ms as u64)
    } else {
        UNIX_EPOCH - Duration::from_millis(ms.unsigned_abs())
    }
}

/// The wall clock shardwise reads (arrival coordinates, LATEST pins, stuck-since times): this
/// host's. A deterministic simulation replaces it on its own thread with [`simulate_wall_clock`],
/// so that wall time follows Tokio's paused clock, and may give each simulated host its own error
/// ([`HostClock`], carried by every task a consumer spawns: [`carry`]).
pub(crate) fn now() -> SystemTime {
    #[cfg(any(test, feature = "testing"))]
    {
        let true_now = service_now();
        HOST.try_with(|host| host.read(true_now))
            .unwrap_or(true_now)
    }
    #[cfg(not(any(test, feature = "testing")))]
    {
        SystemTime::now()
    }
}

/// What a service's answers say of its clock: from the newest answer's `Date` header, how far
/// the service's clock is at least ahead of this host's (behind when negative). An answer's date is
/// the service's time when it sent it, truncated to the second, and this host received it after
/// that: so `date - received` never exceeds the true difference, and this host's clock plus it is a
/// time the service's clock has certainly reached (within the drift since that answer).
#[derive(Debug, Default)]
pub(crate) struct ServiceClock {
    /// `Some(date - received)` in ms, once an answer carried a date.
    ahead_ms: std::sync::Mutex<Option<i64>>,
}

impl ServiceClock {
    /// An answer dated `date` arrived at `received` by this host's clock.
    pub(crate) fn observe(&self, date: SystemTime, received: SystemTime) {
        let ahead = millis(date) - millis(received);
        *self
            .ahead_ms
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(ahead);
    }

    /// A time the service's clock has certainly reached, by this host's clock now and the newest
    /// answer; `None` before any answer carried a date.
    pub(crate) fn reached(&self) -> Option<SystemTime> {
        let ahead = (*self
            .ahead_ms
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner))?;
        Some(from_millis(millis(now()) + ahead))
    }
}

/// The time as the services keep it (the in-memory stream's arrival times and trim horizon, the
/// memory stores, the scripted event API): the simulated wall clock, or the system's, without the
/// error of the simulated host whose task calls.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn service_now() -> SystemTime {
    if let Some((base, at)) = SIMULATED.get() {
        return base + (tokio::time::Instant::now() - at);
    }
    SystemTime::now()
}

#[cfg(any(test, feature = "testing"))]
thread_local! {
    static SIMULATED: std::cell::Cell<Option<(SystemTime, tokio::time::Instant)>> =
        const { std::cell::Cell::new(None) };
}

/// From now on, on this thread, [`now`] is `base` plus the Tokio time elapsed since this call (with
/// paused time: simulated time). `None` returns to the system clock.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn simulate_wall_clock(base: Option<SystemTime>) {
    SIMULATED.set(base.map(|b| (b, tokio::time::Instant::now())));
}

/// The error of one simulated host's wall clock, for tests of clock skew: `offset_ms` ahead of
/// the services' time (behind when negative) when made, drifting `drift_ppm` microseconds a second
/// from there. Run a consumer on it with [`on_host`](crate::testing::on_host).
#[cfg(any(test, feature = "testing"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostClock {
    pub(crate) offset_ms: i64,
    pub(crate) drift_ppm: i64,
    pub(crate) since: SystemTime,
}

#[cfg(any(test, feature = "testing"))]
impl HostClock {
    /// A clock `offset_ms` ahead of the services' time from now on (behind when negative),
    /// drifting `drift_ppm` microseconds a second (slower when negative).
    pub fn new(offset_ms: i64, drift_ppm: i64) -> Self {
        Self {
            offset_ms,
            drift_ppm,
            since: service_now(),
        }
    }

    /// This host's reading when the true time is `true_now`.
    pub(crate) fn read(&self, true_now: SystemTime) -> SystemTime {
        let elapsed_ms = millis(true_now) - millis(self.since);
        let error_ms = self.offset_ms + elapsed_ms * self.drift_ppm / 1_000_000;
        from_millis(millis(true_now) + error_ms)
    }
}

#[cfg(any(test, feature = "testing"))]
tokio::task_local! {
    static HOST: HostClock;
}

/// Runs `fut` on a simulated host whose wall clock is `clock`: in it, and in every task a consumer
/// started in it spawns, shardwise reads that clock; the in-memory services keep the true time.
#[cfg(any(test, feature = "testing"))]
pub async fn on_host<F: std::future::Future>(clock: HostClock, fut: F) -> F::Output {
    HOST.scope(clock, fut).await
}

/// `fut`, to be spawned, keeping the simulated host clock of the task that spawns it.
#[cfg(any(test, feature = "testing"))]
pub(crate) fn carry<F: std::future::Future>(
    fut: F,
) -> impl std::future::Future<Output = F::Output> {
    let host = HOST.try_with(|host| *host).ok();
    async move {
        match host {
            Some(host) => HOST.scope(host, fut).await,
            None => fut.await,
        }
    }
}

/// `fut` as it is: without the `testing` feature there are no simulated hosts.
#[cfg(not(any(test, feature = "testing")))]
pub(crate) fn carry<F: std::future::Future>(fut: F) -> F {
    fut
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_service_clock_is_a_lower_bound_from_the_newest_answer() {
        let clock = ServiceClock::default();
        assert_eq!(clock.reached(), None);
        // This host is 10 s ahead: an answer sent at 12:00:00.900 (dated 12:00:00) arrives 100 ms
        // later, at 12:00:11.000 here.
        let noon = from_millis(1_700_000_000_000);
        clock.observe(noon, noon + Duration::from_millis(11_000));
        // `now()` is read twice (the system clock): the two readings may differ by a tick.
        let behind = |clock: &ServiceClock| {
            let reached = clock.reached().unwrap();
            millis(now()) - millis(reached)
        };
        assert!((11_000..11_050).contains(&behind(&clock)));
        // A newer answer replaces it (the host's clock was stepped back 10 s).
        clock.observe(noon, noon + Duration::from_millis(1_000));
        assert!((1_000..1_050).contains(&behind(&clock)));
    }

    #[test]
    fn a_host_clock_is_off_by_its_offset_and_drifts_from_it() {
        let since = from_millis(1_700_000_000_000);
        let host = HostClock {
            offset_ms: 10_000,
            drift_ppm: 100,
            since,
        };
        assert_eq!(host.read(since), since + Duration::from_secs(10));
        // A day at 100 ppm: 8.64 s more.
        let day = since + Duration::from_secs(86_400);
        assert_eq!(host.read(day), day + Duration::from_millis(18_640));
        let behind = HostClock {
            offset_ms: -10_000,
            ..host
        };
        assert_eq!(behind.read(since), since - Duration::from_secs(10));
    }

    #[tokio::test(start_paused = true)]
    async fn a_host_clock_reaches_the_tasks_spawned_through_carry() {
        simulate_wall_clock(Some(from_millis(1_700_000_000_000)));
        let host = HostClock {
            offset_ms: -7_000,
            drift_ppm: 0,
            since: from_millis(1_700_000_000_000),
        };
        let (carried, bare) = on_host(host, async {
            let carried = tokio::spawn(carry(async { millis(now()) }));
            let bare = tokio::spawn(async { millis(now()) });
            (carried.await.unwrap(), bare.await.unwrap())
        })
        .await;
        assert_eq!(carried, 1_700_000_000_000 - 7_000);
        assert_eq!(bare, 1_700_000_000_000);
        assert_eq!(millis(service_now()), 1_700_000_000_000);
        simulate_wall_clock(None);
    }
}
