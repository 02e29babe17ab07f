//! One live test's DynamoDB tables on the emulator: the lease table, the receipt ledger, and a
//! table of effect counters.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use aws_sdk_dynamodb::types::AttributeValue;
use shardwise::lease::{DynamoDbLeaseStore, LeaseStore};
use shardwise::paged::PagedProgress;
use shardwise::receipts::{DynamoDbReceipts, ReceiptStore};

use crate::support::{self, Live};

/// One live test's tables: leases, receipts, effects.
pub struct Tables {
    pub live: Live,
    pub leases: Arc<DynamoDbLeaseStore>,
    pub receipts: Arc<DynamoDbReceipts>,
    pub counts: String,
    pub names: Vec<String>,
}

impl Tables {
    pub async fn new(live: Live, app: &str) -> Self {
        let lease_table = support::unique_name("paged-leases");
        let receipt_table = support::unique_name("paged-receipts");
        let counts = support::unique_name("paged-counts");
        live.create_table(&counts, "id").await;
        let leases = Arc::new(
            DynamoDbLeaseStore::new(live.dynamodb.clone(), &lease_table).create_if_missing(true),
        );
        leases.prepare().await.unwrap();
        let receipts = Arc::new(
            DynamoDbReceipts::new(live.dynamodb.clone(), &receipt_table, app)
                .create_if_missing(true),
        );
        receipts.prepare().await.unwrap();
        Self {
            live,
            leases,
            receipts,
            names: vec![lease_table, receipt_table, counts.clone()],
            counts,
        }
    }

    pub async fn drop_all(self) {
        for name in &self.names {
            self.live.delete_table(name).await;
        }
    }

    pub async fn progress(&self, source: &str, partition: &str) -> PagedProgress {
        self.leases
            .get(source, partition)
            .await
            .unwrap()
            .and_then(|row| row.progress)
            .unwrap_or_default()
    }

    pub async fn count(&self, id: &str) -> Option<i64> {
        let item = self
            .live
            .dynamodb
            .get_item()
            .table_name(&self.counts)
            .key("id", AttributeValue::S(id.into()))
            .consistent_read(true)
            .send()
            .await
            .unwrap()
            .item?;
        item.get("count")?.as_n().ok()?.parse().ok()
    }
}
