//! A paged source's partitions as the lease manager lists shards: one row per partition, no
//! lineage, never closed (a partition ends when it is gone, or when a page says so).

use std::fmt;
use std::sync::Arc;

use futures::future::BoxFuture;

use super::PagedSource;
use crate::error::Error;
use crate::shard::discovery::{ShardInfo, ShardLister};

/// Lists the partitions of a paged source for the lease manager.
pub(crate) struct PartitionLister(pub(crate) Arc<dyn PagedSource>);

impl fmt::Debug for PartitionLister {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("PartitionLister")
            .field(&self.0.name())
            .finish()
    }
}

impl ShardLister for PartitionLister {
    fn list_shards<'a>(&'a self, _stream: &'a str) -> BoxFuture<'a, Result<Vec<ShardInfo>, Error>> {
        Box::pin(async move {
            Ok(self
                .0
                .partitions()
                .await?
                .into_iter()
                .map(|shard_id| ShardInfo {
                    shard_id,
                    parents: Vec::new(),
                    closed: false,
                })
                .collect())
        })
    }

    fn names_reused(&self) -> bool {
        self.0.contract().names_reused
    }

    fn last_activity(&self, shard_id: &str) -> Option<i64> {
        self.0.last_activity(shard_id)
    }
}
