//! Shard leases: who reads which shard, and the fenced checkpoint each lease carries.
//!
//! See `docs/leases.md` for the states and the condition on every write. In short: every write is
//! one conditional request, a failed condition is a typed answer (someone else holds the lease, or
//! the checkpoint is not newer), and a checkpoint moves only while the writer still owns the lease
//! under the same ownership epoch and only forward.

mod dynamodb;
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub, dead_code))]
mod hold;
mod liveness;
mod local;
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub, dead_code))]
mod manager;
mod memory;
mod planner;
mod roster;
mod row;
mod store;
mod sync;
pub(crate) use sync::new_leases;

pub use crate::dynamo::{ATTEMPT_TIMEOUT, Billing, CALL_TIMEOUT, TableOptions};
pub use dynamodb::DynamoDbLeaseStore;
#[cfg(feature = "testing")]
pub use hold::Hold;
#[cfg(not(feature = "testing"))]
pub(crate) use hold::Hold;
pub use manager::{FAILED_LEASE_MAX_WAIT, LeaseHooks, LeaseSettings};
/// The lease manager runs inside every consumer; it is public for tests that drive it alone.
#[cfg(feature = "testing")]
pub use manager::{HeldLease, LeaseEvent, LeaseManager, LeaseProbe};
#[cfg(not(feature = "testing"))]
pub(crate) use manager::{HeldLease, LeaseEvent, LeaseManager, LeaseProbe};
pub use memory::MemoryLeaseStore;
#[cfg(any(test, feature = "testing"))]
pub use memory::{Change, ITEM_WRITES_PER_SECOND, Observer};
pub use planner::PlanLimits;
pub use row::{Checkpoint, InitialPosition, Lease, NewLease, Ownership};
pub use store::{CheckpointWrite, LeaseStore, MAX_SEEK_MOVES, Renewal, Roster, SeekMove};
