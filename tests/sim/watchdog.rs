//! The lease store as a long seed's workers reach it: every call is counted, and past 2,000 calls
//! in one simulated second (a loop that writes the table as fast as it answers, which paused time
//! would never leave) the seed fails and every further call waits a second, so the run goes on.

use std::sync::Mutex;
use std::time::Duration;

use futures::future::BoxFuture;
use shardwise::Error;
use shardwise::testing::{Call, Layer};
use tokio::time::Instant;

/// Calls in one simulated second past which the workers are looping.
const LOOPING: u32 = 2_000;

type Report = Box<dyn Fn(Instant, String) + Send + Sync>;

pub struct Watchdog {
    start: Instant,
    report: Report,
    /// (the simulated second, calls in it, tripped)
    calls: Mutex<(u64, u32, bool)>,
}

impl Watchdog {
    /// Reports a livelock through `report` (when, what).
    pub fn new(start: Instant, report: impl Fn(Instant, String) + Send + Sync + 'static) -> Self {
        Self {
            start,
            report: Box::new(report),
            calls: Mutex::new((0, 0, false)),
        }
    }
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog").finish_non_exhaustive()
    }
}

impl Layer for Watchdog {
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: Call<'a>,
        forward: BoxFuture<'a, Result<T, Error>>,
    ) -> BoxFuture<'a, Result<T, Error>> {
        Box::pin(async move {
            let now = Instant::now();
            let second = (now - self.start).as_secs();
            let (tripped, first) = {
                let mut calls = self.calls.lock().unwrap();
                if calls.0 != second {
                    *calls = (second, 0, calls.2);
                }
                calls.1 += 1;
                let first = calls.1 > LOOPING && !calls.2;
                calls.2 |= first;
                (calls.2, first)
            };
            if first {
                (self.report)(
                    now,
                    format!(
                        "livelock: over {LOOPING} lease store calls in one simulated second (the last {})",
                        call.method()
                    ),
                );
            }
            if tripped {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            forward.await
        })
    }
}
