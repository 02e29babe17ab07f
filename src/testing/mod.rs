//! For users' own tests and for deterministic simulations: an in-memory Kinesis stream
//! ([`MemoryStream`]) to pair with [`MemoryLeaseStore`](crate::lease::MemoryLeaseStore), so handlers
//! run through the real dispatcher, lanes and tracker; a scripted paged event API ([`EventApi`])
//! for paged sources; injected faults ([`Faults`]); and a way to make a thread's wall clock and
//! retry jitter deterministic ([`simulate`]).
//!
//! ```
//! use std::sync::Arc;
//! use shardwise::testing::MemoryStream;
//! let stream = MemoryStream::new("orders", 2);
//! stream.put("customer-1", "hello");
//! assert_eq!(stream.records().len(), 1);
//! ```

mod crash;
mod event_server;
mod events;
pub(crate) mod faults;
mod layer;
mod stream;
mod subscriptions;

pub use crate::time::{HostClock, on_host};
pub use crash::{Crash, CrashPoint, When};
pub use event_server::{EventServer, HttpEvents};
pub use events::{EventApi, Script, ScriptedEvent, Ties};
pub use faults::{Fault, Faults};
pub use layer::{Call, Layer, Layered};
pub use stream::{MemoryStream, MemoryStreams, StoredRecord};
pub use subscriptions::Subscriptions;

/// Makes shardwise deterministic on this thread, for tests on paused Tokio time
/// (`#[tokio::test(start_paused = true)]`, a current-thread runtime) and for simulations: wall time
/// (arrival times, LATEST pins, frontier coordinates) follows Tokio's clock from `base`, and the
/// jitter of every retry backoff is drawn from generators seeded from `seed`. Dropping the guard
/// returns this thread to the system clock and entropy.
///
/// ```
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// use std::time::{Duration, UNIX_EPOCH};
/// let base = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
/// let _deterministic = shardwise::testing::simulate(base, 42);
/// let stream = shardwise::testing::MemoryStream::new("orders", 1);
/// stream.put("k", "first");
/// tokio::time::sleep(Duration::from_secs(60)).await; // simulated: returns at once
/// stream.put("k", "a minute later");
/// let arrived: Vec<_> = stream.records().iter().map(|r| r.record.arrived_at.unwrap()).collect();
/// assert_eq!(arrived, [base, base + Duration::from_secs(60)]);
/// # }
/// ```
pub fn simulate(base: std::time::SystemTime, seed: u64) -> Simulated {
    crate::time::simulate_wall_clock(Some(base));
    crate::backoff::simulate_jitter(Some(seed));
    Simulated {
        _not_send: std::marker::PhantomData,
    }
}

/// Keeps this thread deterministic until dropped; see [`simulate`].
#[derive(Debug)]
#[must_use = "the thread returns to the system clock when this is dropped"]
pub struct Simulated {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for Simulated {
    fn drop(&mut self) {
        crate::time::simulate_wall_clock(None);
        crate::backoff::simulate_jitter(None);
    }
}
