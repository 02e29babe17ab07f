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

/// The wall clock shardwise reads (arrival coordinates, LATEST pins, stuck-since times). A
/// deterministic simulation replaces it on its own thread with [`simulate_wall_clock`], so that
/// wall time follows Tokio's paused clock.
pub(crate) fn now() -> SystemTime {
    #[cfg(any(test, feature = "testing"))]
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
