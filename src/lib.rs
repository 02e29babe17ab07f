//! shardwise consumes Kinesis streams with crash-safe checkpoints.
//!
//! **Delivery guarantee: at least once, never a skip.** A shard's checkpoint moves only over the
//! contiguous run of records that have a durable outcome (ack, drop, a written retry copy or dead
//! letter), and every checkpoint write is fenced by the lease table, so a crash, a lost lease or a
//! late acknowledgement can repeat records but never lose one.
//!
//! The pieces, bottom up (every public module):
//! - [`envelope`]: the header envelope records carry on the wire.
//! - [`kpl`]: KPL aggregates, read (sub-records, with their sub-sequence numbers) and written.
//! - [`position`] ([`Position`], [`SequenceNumber`]): positions in a shard and their sortable
//!   checkpoint key.
//! - [`Delivery`], [`Outcome`], [`Handler`]: what application code sees and returns.
//! - [`lease`]: the lease table ([`lease::Checkpoint`] is where a shard's reading stands, as the
//!   table stores it), its stores ([`DynamoDbLeaseStore`], [`MemoryLeaseStore`]) and settings.
//! - [`shard`]: reading a Kinesis shard (record sources, shard listings, reader settings).
//! - [`paged`]: paged event APIs as sources (CloudWatch Logs among them), and their contracts.
//! - [`producer`]: writing records (retry copies, dead letters, `shardwise put`).
//! - [`retry`]: what a retry writes, and the policy that decides it.
//! - [`receipts`]: the receipt ledger, for effects applied exactly once.
//! - [`seek`]: moving checkpoints, to a time or a place.
//! - [`frontier`]: how far the whole stream is complete.
//! - [`consumer`]: the [`Consumer`] that runs all of the above, its settings and its health.
//! - `observe` (feature `observability`): metrics to Prometheus and CloudWatch (EMF), and
//!   `/metrics`, `/healthz`, `/readyz` over HTTP. Without a [`metrics`] recorder installed (that
//!   feature's `observe::Metrics`, or any other) the library's metrics are dropped:
//!   `shardwise::observe::Metrics::builder().prometheus().install()?` is the one line.
//! - `filter` (feature `filter`): Lambda's event filtering (`FilterCriteria`), for
//!   `ConsumerBuilder::filter`.
//! - `testing` (feature `testing`): in-memory streams and stores with faults, the scripted event
//!   API, and the pieces the consumer runs inside (the tracker, `track`; the lease manager) for
//!   tests that drive them alone.

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
mod checkpoint;
pub mod consumer;
pub mod destination;
mod dynamo;
pub mod envelope;
mod error;
#[cfg(feature = "filter")]
pub mod filter;
pub mod frontier;
mod handler;
pub mod kpl;
pub mod lease;
#[cfg(feature = "observability")]
pub mod observe;
pub mod paged;
pub mod position;
pub mod producer;
pub mod receipts;
pub mod retry;
pub mod seek;
pub mod shard;
#[cfg(feature = "cloudwatch-logs")]
pub mod subscription;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
mod time;
/// The tracker runs inside every shard; it is public for tests and benchmarks that drive it.
#[cfg(feature = "testing")]
pub mod track;
#[cfg(not(feature = "testing"))]
#[allow(unreachable_pub, dead_code)]
mod track;
pub mod window;

/// The README's Rust examples, compiled with the doctests so they cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExamples;

pub use aws_config;
#[cfg(feature = "cloudwatch-logs")]
pub use aws_sdk_cloudwatchlogs;
pub use aws_sdk_dynamodb;
pub use aws_sdk_kinesis;
#[cfg(feature = "s3")]
pub use aws_sdk_s3;
#[cfg(feature = "sns")]
pub use aws_sdk_sns;
#[cfg(feature = "sqs")]
pub use aws_sdk_sqs;
pub use consumer::{Consumer, ConsumerBuilder, DeliveryOrder, Running, ShutdownReport, Unproven};
pub use error::{AckError, BoxError, ConfigError, Error};
pub use handler::{BatchHandler, Batched, Batching, Delivery, DeliveryBuilder, Handler, Outcome};
pub use lease::{
    CheckpointWrite, DynamoDbLeaseStore, InitialPosition, Lease, LeaseStore, MemoryLeaseStore,
    NewLease, Ownership,
};
pub use position::{InvalidSequenceNumber, Position, SequenceNumber};
pub use track::DeliveryId;
