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

//!
//! ## The AWS SDK in the public API
//!
//! Four SDK types appear in shardwise's signatures, all to hand it clients you configured:
//! [`aws_config::SdkConfig`] ([`ConsumerBuilder::aws_config`]), [`aws_sdk_kinesis::Client`]
//! ([`producer::Producer::kinesis`], [`producer::KinesisSink`], [`shard::source::KinesisRecords`],
//! [`shard::discovery::KinesisShards`]) and [`aws_sdk_dynamodb::Client`]
//! ([`DynamoDbLeaseStore::new`]). No SDK error type appears: failures are [`Error`]. The three SDK
//! crates are re-exported here, so building clients from `shardwise::aws_sdk_kinesis` always gives
//! the versions shardwise was built with.

#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

mod backoff;
pub mod checkpoint;
pub mod consumer;
mod dynamo;
pub mod envelope;
mod error;
pub mod frontier;
mod handler;
pub mod kpl;
pub mod lease;
pub mod paged;
pub mod position;
pub mod producer;
pub mod receipts;
pub mod retry;
pub mod seek;
pub mod shard;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod time;
pub mod track;

/// The README's Rust examples, compiled with the doctests so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExamples;

pub use aws_config;
#[cfg(feature = "cloudwatch-logs")]
pub use aws_sdk_cloudwatchlogs;
pub use aws_sdk_dynamodb;
pub use aws_sdk_kinesis;
pub use consumer::{Consumer, ConsumerBuilder, Ordering, Running, ShutdownReport, Unproven};
pub use error::{AckError, BoxError, ConfigError, Error};
pub use handler::{BatchHandler, Batched, Batching, Delivery, DeliveryBuilder, Handler, Outcome};
pub use lease::{
    Checkpoint, CheckpointWrite, DynamoDbLeaseStore, InitialPosition, Lease, LeaseStore,
    MemoryLeaseStore, NewLease, Ownership,
};
pub use position::{InvalidSequenceNumber, Position, SequenceNumber};
pub use track::{DeliveryId, Settlement, Tracker};
