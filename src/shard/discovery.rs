//! Which shards a stream has, and their lineage.

use std::fmt;

use futures::future::BoxFuture;

use crate::error::Error;

/// One shard as ListShards reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardInfo {
    /// The shard id.
    pub shard_id: String,
    /// Its parent (split) or parents (merge).
    pub parents: Vec<String>,
    /// Whether the shard is closed (has an ending sequence number): no new records will arrive.
    pub closed: bool,
}

/// Lists a stream's shards. Kinesis in production; an in-memory stream in tests.
pub trait ShardLister: Send + Sync + fmt::Debug + 'static {
    /// Every shard the stream retains, parents before children, following pagination.
    fn list_shards<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<Vec<ShardInfo>, Error>>;

    /// Whether a partition's name may come back as a new partition once the old one is gone, its
    /// partitions ending only then ([`Contract::names_reused`](crate::paged::Contract)): scans
    /// delete every row at SHARD_END that nobody holds, and the sync creates a row anew for a
    /// name listed again. `false` (Kinesis): an ended shard's row stays until it ages out.
    fn names_reused(&self) -> bool {
        false
    }

    /// When the source last took something into `shard_id` (ms, the provider's clock), as its
    /// newest listing said: a retired row ([`Lease::retired_at`](crate::lease::Lease)) is woken
    /// once this is after its retirement. `None` (the default): not known; a retired row then
    /// stays retired while the listing names it.
    fn last_activity(&self, shard_id: &str) -> Option<i64> {
        let _ = shard_id;
        None
    }

    /// A time the service's clock has certainly reached, as its answers tell it; `None` before
    /// any answer did, or when the service does not say. `seek --to latest` moves to it rather
    /// than to this host's clock.
    fn service_time(&self) -> Option<std::time::SystemTime> {
        None
    }

    /// How long the stream keeps a record (its retention period): a consumer with a receipt
    /// ledger keeps receipts at least that long. The default does not say.
    fn retention<'a>(
        &'a self,
        stream: &'a str,
    ) -> BoxFuture<'a, Result<crate::receipts::SourceRetention, Error>> {
        let _ = stream;
        Box::pin(std::future::ready(Ok(
            crate::receipts::SourceRetention::Unknown,
        )))
    }
}

/// [`ShardLister`] on the Kinesis API.
#[derive(Debug, Clone)]
pub struct KinesisShards {
    client: aws_sdk_kinesis::Client,
    clock: std::sync::Arc<crate::time::ServiceClock>,
}

impl KinesisShards {
    /// Lists shards with this client (a copy of it that also reads each answer's date).
    pub fn new(client: aws_sdk_kinesis::Client) -> Self {
        let (client, clock) = crate::shard::source::dated(&client);
        Self { client, clock }
    }
}

impl ShardLister for KinesisShards {
    fn service_time(&self) -> Option<std::time::SystemTime> {
        self.clock.reached()
    }

    /// The stream's `RetentionPeriodHours` (DescribeStreamSummary): a record is readable, and so
    /// can be read again, until it is that old, and its receipt was written after it arrived.
    fn retention<'a>(
        &'a self,
        stream: &'a str,
    ) -> BoxFuture<'a, Result<crate::receipts::SourceRetention, Error>> {
        Box::pin(async move {
            let summary = self
                .client
                .describe_stream_summary()
                .stream_name(stream)
                .send()
                .await
                .map_err(|e| Error::kinesis("DescribeStreamSummary", stream, e))?;
            let hours = summary
                .stream_description_summary()
                .map(|d| d.retention_period_hours())
                .unwrap_or(24);
            Ok(crate::receipts::SourceRetention::For(
                std::time::Duration::from_secs(u64::try_from(hours).unwrap_or(24) * 3600),
            ))
        })
    }

    fn list_shards<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<Vec<ShardInfo>, Error>> {
        Box::pin(async move {
            let mut shards = Vec::new();
            let mut token: Option<String> = None;
            loop {
                let request = match &token {
                    Some(t) => self.client.list_shards().next_token(t),
                    None => self.client.list_shards().stream_name(stream),
                };
                let page = request
                    .send()
                    .await
                    .map_err(|e| Error::kinesis("ListShards", stream, e))?;
                shards.extend(page.shards().iter().map(|s| {
                    ShardInfo {
                        shard_id: s.shard_id().to_string(),
                        parents: s
                            .parent_shard_id()
                            .into_iter()
                            .chain(s.adjacent_parent_shard_id())
                            .map(str::to_string)
                            .collect(),
                        closed: s
                            .sequence_number_range()
                            .and_then(|r| r.ending_sequence_number())
                            .is_some(),
                    }
                }));
                match page.next_token() {
                    Some(t) => token = Some(t.to_string()),
                    None => return Ok(shards),
                }
            }
        })
    }
}
