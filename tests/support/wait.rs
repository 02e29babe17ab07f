//! Waiting in tests: poll a condition until it holds, or fail naming what was waited for. One
//! definition for every test binary (memory ones include this file alone; live ones reach it as
//! `support::wait`). On tokio's clock, so a test under paused time waits in simulated time.

#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

/// Polls `done` every 10 ms until it holds, and returns when it did; panics naming `what` once
/// `limit` has passed.
pub async fn wait_for(what: &str, limit: Duration, mut done: impl FnMut() -> bool) -> Instant {
    let deadline = Instant::now() + limit;
    loop {
        if done() {
            return Instant::now();
        }
        assert!(
            Instant::now() < deadline,
            "timed out ({limit:?}) waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// [`wait_for`] with a condition that awaits (reading a table): polled every 25 ms.
pub async fn wait_for_async<F: Future<Output = bool>>(
    what: &str,
    limit: Duration,
    mut done: impl FnMut() -> F,
) -> Instant {
    let deadline = Instant::now() + limit;
    loop {
        if done().await {
            return Instant::now();
        }
        assert!(
            Instant::now() < deadline,
            "timed out ({limit:?}) waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
