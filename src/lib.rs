//! shardwise consumes Kinesis streams with crash-safe checkpoints.
//!
//! **Delivery guarantee: at least once, never a skip.** A shard's checkpoint moves only over the
//! contiguous run of records that have a durable outcome (ack, drop, a written retry copy or dead
//! letter), and every checkpoint write is fenced by the lease table, so a crash, a lost lease or a
//! late acknowledgement can repeat records but never lose one.
//!
//! The pieces, bottom up:
//! - [`envelope`]: the header envelope records carry on the wire.
//! - [`Delivery`], [`Outcome`], [`Handler`]: what application code sees and returns.
//! - [`track::Tracker`]: where a shard's checkpoint may stand, given settlements in any order.
//! - [`Position`], [`SequenceNumber`]: positions in a shard and their sortable checkpoint key.
//! - [`Checkpoint`]: where a shard's reading stands, as the lease table stores it.

#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod backoff;
pub mod checkpoint;
pub mod consumer;
pub mod envelope;
mod error;
pub mod frontier;
mod handler;
pub mod kpl;
pub mod lease;
pub mod position;
pub mod producer;
pub mod retry;
pub mod seek;
pub mod shard;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod time;
pub mod track;

pub use consumer::{Consumer, ConsumerBuilder, Ordering, Running, ShutdownReport};
pub use error::{AckError, BoxError, ConfigError, Error};
pub use handler::{Delivery, DeliveryBuilder, Handler, Outcome};
pub use lease::{
    Checkpoint, CheckpointWrite, DynamoDbLeaseStore, InitialPosition, Lease, LeaseStore,
    MemoryLeaseStore, NewLease, Ownership,
};
pub use position::{InvalidSequenceNumber, Position, SequenceNumber};
pub use track::{DeliveryId, Settlement, Tracker};
