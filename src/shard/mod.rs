//! Shards: positions inside one shard, the stream's shard list, and reading records.

pub mod discovery;
pub mod fanout;
pub mod reader;
pub mod source;
