//! Shards: positions inside one shard.

pub mod position;
