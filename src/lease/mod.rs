//! Shard leases: who reads which shard, and the fenced checkpoint each lease carries.
//!
//! See `docs/leases.md` for the states and the condition on every write. In short: every write is
//! one conditional request, a failed condition is a typed answer (someone else holds the lease, or
//! the checkpoint is not newer), and a checkpoint moves only while the writer still owns the lease
//! under the same ownership epoch and only forward.

mod dynamodb;
mod manager;
mod memory;
pub mod planner;
mod roster;
mod row;
mod store;
mod sync;
pub(crate) use sync::new_leases;

pub use crate::dynamo::{Billing, TableOptions};
pub use dynamodb::DynamoDbLeaseStore;
pub use manager::{HeldLease, LeaseEvent, LeaseHooks, LeaseManager, LeaseProbe, LeaseSettings};
pub use memory::MemoryLeaseStore;
#[cfg(any(test, feature = "testing"))]
pub use memory::{Change, Observer};
pub use row::{Checkpoint, InitialPosition, Lease, NewLease, Ownership};
pub use store::{CheckpointWrite, LeaseStore, MAX_SEEK_MOVES, Renewal, Roster, SeekMove};
