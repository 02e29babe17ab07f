//! Live-test support: reaching the emulators (or LocalStack, or AWS), unique names, and stream and
//! table helpers. Reads only the standard AWS variables plus `SHARDWISE_LIVE`.
//!
//! `SHARDWISE_LIVE=require` (set by `scripts/test`) turns an unreachable endpoint into a failure.
//! Without it, a live test that finds no endpoint prints a notice and returns early.

#![allow(dead_code, unreachable_pub)]

pub mod calls;
pub mod proxy;
pub mod wait;

use std::net::ToSocketAddrs;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use aws_config::BehaviorVersion;
use aws_config::retry::RetryConfig;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, PointInTimeRecoveryStatus,
    ScalarAttributeType, TableStatus,
};
use aws_sdk_kinesis::types::StreamStatus;

/// A table as [`Live::table_settings`] reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableSettings {
    pub active: bool,
    pub billing: Option<BillingMode>,
    /// Provisioned read and write capacity units.
    pub capacity: Option<(i64, i64)>,
    /// Key and value, sorted.
    pub tags: std::collections::BTreeSet<(String, String)>,
    pub point_in_time_recovery: bool,
}

/// Clients for the live endpoints.
#[derive(Clone, Debug)]
pub struct Live {
    pub kinesis: aws_sdk_kinesis::Client,
    pub dynamodb: aws_sdk_dynamodb::Client,
}

/// Returns the live clients, or `None` (after printing why) when live tests should be skipped.
/// Panics when `SHARDWISE_LIVE=require` and an endpoint is missing or does not answer.
pub async fn live(test: &str) -> Option<Live> {
    let required = std::env::var("SHARDWISE_LIVE").is_ok_and(|v| v == "require");
    let mut problems = Vec::new();
    for var in ["AWS_ENDPOINT_URL_KINESIS", "AWS_ENDPOINT_URL_DYNAMODB"] {
        match std::env::var(var) {
            Ok(url) => {
                if let Err(why) = reachable(&url) {
                    problems.push(format!("{var}={url} does not answer: {why}"));
                }
            }
            Err(_) => problems.push(format!("{var} is not set")),
        }
    }
    if !problems.is_empty() {
        let msg = problems.join("; ");
        if required {
            panic!(
                "live test `{test}` needs the emulators (SHARDWISE_LIVE=require): {msg}. \
                 Start them with `eval \"$(scripts/emulators start)\"` or run `scripts/test`."
            );
        }
        eprintln!("skipping live test `{test}`: {msg} (run scripts/test to start the emulators)");
        return None;
    }
    let config = aws_config::defaults(BehaviorVersion::latest())
        .retry_config(RetryConfig::standard().with_max_attempts(3))
        .load()
        .await;
    Some(Live {
        kinesis: aws_sdk_kinesis::Client::new(&config),
        dynamodb: aws_sdk_dynamodb::Client::new(&config),
    })
}

/// Skips (returns from) the calling test when there is no live endpoint and it is not required.
#[macro_export]
macro_rules! live_or_skip {
    () => {
        match $crate::support::live(module_path!()).await {
            Some(live) => live,
            None => return,
        }
    };
}

fn reachable(url: &str) -> Result<(), String> {
    let rest = url.split_once("://").map(|(_, r)| r).ok_or("not a URL")?;
    let authority = rest.split('/').next().unwrap_or(rest);
    let addr = if authority.contains(':') {
        authority.to_string()
    } else if url.starts_with("https") {
        format!("{authority}:443")
    } else {
        format!("{authority}:80")
    };
    let addrs = addr.to_socket_addrs().map_err(|e| e.to_string())?;
    let mut last = String::from("no address");
    for a in addrs {
        match std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)) {
            Ok(_) => return Ok(()),
            Err(e) => last = e.to_string(),
        }
    }
    Err(last)
}

/// A name no other test (or earlier run against the same endpoint) uses.
pub fn unique_name(prefix: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .subsec_nanos();
    format!(
        "{prefix}-{}-{}-{nanos}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

impl Live {
    /// Creates a stream with `shards` shards and waits until it is active.
    pub async fn create_stream(&self, name: &str, shards: i32) {
        self.kinesis
            .create_stream()
            .stream_name(name)
            .shard_count(shards)
            .send()
            .await
            .unwrap_or_else(|e| panic!("CreateStream {name}: {e:?}"));
        self.wait_stream_active(name).await;
    }

    /// Waits until the stream is ACTIVE (after create, split, merge).
    pub async fn wait_stream_active(&self, name: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = self
                .kinesis
                .describe_stream_summary()
                .stream_name(name)
                .send()
                .await;
            if let Ok(out) = out
                && out
                    .stream_description_summary()
                    .is_some_and(|s| *s.stream_status() == StreamStatus::Active)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "stream {name} never became ACTIVE"
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// The stream's ARN (what stream consumers are registered under).
    pub async fn stream_arn(&self, name: &str) -> String {
        self.kinesis
            .describe_stream_summary()
            .stream_name(name)
            .send()
            .await
            .unwrap_or_else(|e| panic!("DescribeStreamSummary {name}: {e:?}"))
            .stream_description_summary
            .expect("a stream description")
            .stream_arn
    }

    /// Deletes a stream; a stream already gone is fine.
    pub async fn delete_stream(&self, name: &str) {
        let _ = self
            .kinesis
            .delete_stream()
            .stream_name(name)
            .enforce_consumer_deletion(true)
            .send()
            .await;
    }

    /// Creates a table keyed by the string attribute `key` (on-demand) and waits until it is active.
    pub async fn create_table(&self, name: &str, key: &str) {
        self.dynamodb
            .create_table()
            .table_name(name)
            .billing_mode(BillingMode::PayPerRequest)
            .attribute_definitions(
                AttributeDefinition::builder()
                    .attribute_name(key)
                    .attribute_type(ScalarAttributeType::S)
                    .build()
                    .expect("attribute definition"),
            )
            .key_schema(
                KeySchemaElement::builder()
                    .attribute_name(key)
                    .key_type(KeyType::Hash)
                    .build()
                    .expect("key schema"),
            )
            .send()
            .await
            .unwrap_or_else(|e| panic!("CreateTable {name}: {e:?}"));
    }

    /// Deletes a table; a table already gone is fine.
    pub async fn delete_table(&self, name: &str) {
        let _ = self.dynamodb.delete_table().table_name(name).send().await;
    }

    /// How a table was made: its billing, tags and point-in-time recovery, as DynamoDB describes
    /// them.
    pub async fn table_settings(&self, name: &str) -> TableSettings {
        let described = self
            .dynamodb
            .describe_table()
            .table_name(name)
            .send()
            .await
            .unwrap_or_else(|e| panic!("DescribeTable {name}: {e:?}"))
            .table
            .expect("a table description");
        let throughput = described.provisioned_throughput();
        let tags = self
            .dynamodb
            .list_tags_of_resource()
            .resource_arn(described.table_arn().expect("a table ARN"))
            .send()
            .await
            .unwrap_or_else(|e| panic!("ListTagsOfResource {name}: {e:?}"));
        let recovery = self
            .dynamodb
            .describe_continuous_backups()
            .table_name(name)
            .send()
            .await
            .unwrap_or_else(|e| panic!("DescribeContinuousBackups {name}: {e:?}"))
            .continuous_backups_description
            .and_then(|b| b.point_in_time_recovery_description)
            .and_then(|p| p.point_in_time_recovery_status);
        TableSettings {
            active: described.table_status() == Some(&TableStatus::Active),
            billing: described
                .billing_mode_summary()
                .and_then(|summary| summary.billing_mode())
                .cloned(),
            capacity: throughput
                .and_then(|t| Some((t.read_capacity_units()?, t.write_capacity_units()?))),
            tags: tags
                .tags()
                .iter()
                .map(|t| (t.key().to_owned(), t.value().to_owned()))
                .collect(),
            point_in_time_recovery: recovery == Some(PointInTimeRecoveryStatus::Enabled),
        }
    }

    /// Every record of every shard of the stream, shard by shard, in shard order (reads each
    /// shard from the trim horizon until an empty page).
    pub async fn read_records(&self, stream: &str) -> Vec<aws_sdk_kinesis::types::Record> {
        let mut out = Vec::new();
        for shard in self.shard_ids(stream).await {
            let mut it = self
                .kinesis
                .get_shard_iterator()
                .stream_name(stream)
                .shard_id(&shard)
                .shard_iterator_type(aws_sdk_kinesis::types::ShardIteratorType::TrimHorizon)
                .send()
                .await
                .expect("GetShardIterator")
                .shard_iterator
                .expect("an iterator");
            loop {
                let page = self
                    .kinesis
                    .get_records()
                    .shard_iterator(&it)
                    .send()
                    .await
                    .expect("GetRecords");
                if page.records().is_empty() {
                    break;
                }
                out.extend(page.records().iter().cloned());
                match page.next_shard_iterator {
                    Some(next) => it = next,
                    None => break,
                }
            }
        }
        out
    }

    /// The ids of the stream's shards, in ListShards order (follows pagination).
    pub async fn shard_ids(&self, stream: &str) -> Vec<String> {
        let mut ids = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let req = match &token {
                Some(t) => self.kinesis.list_shards().next_token(t),
                None => self.kinesis.list_shards().stream_name(stream),
            };
            let out = req.send().await.expect("ListShards");
            ids.extend(out.shards().iter().map(|s| s.shard_id().to_string()));
            match out.next_token() {
                Some(t) => token = Some(t.to_string()),
                None => return ids,
            }
        }
    }
}
