//! The live harness end to end: a 4-shard stream takes 1,000 records and gives them all back, and a
//! conditional DynamoDB write with a stale expectation is refused by the store.

mod support;

use std::collections::BTreeSet;

use aws_sdk_dynamodb::types::AttributeValue;
use aws_sdk_kinesis::primitives::Blob;
use aws_sdk_kinesis::types::{PutRecordsRequestEntry, ShardIteratorType};

#[tokio::test]
async fn kinesis_round_trips_a_thousand_records_over_four_shards() {
    let live = live_or_skip!();
    let stream = support::unique_name("harness");
    live.create_stream(&stream, 4).await;

    for batch in (0..1000).collect::<Vec<u32>>().chunks(500) {
        let entries = batch
            .iter()
            .map(|id| {
                PutRecordsRequestEntry::builder()
                    .partition_key(format!("key-{id}"))
                    .data(Blob::new(format!("{{\"id\":{id}}}")))
                    .build()
                    .expect("entry")
            })
            .collect::<Vec<_>>();
        let out = live
            .kinesis
            .put_records()
            .stream_name(&stream)
            .set_records(Some(entries))
            .send()
            .await
            .expect("PutRecords");
        assert_eq!(out.failed_record_count(), Some(0));
    }

    let shards = live.shard_ids(&stream).await;
    assert_eq!(shards.len(), 4);
    let mut seen = BTreeSet::new();
    let mut shards_with_records = 0;
    for shard in &shards {
        let mut iterator = live
            .kinesis
            .get_shard_iterator()
            .stream_name(&stream)
            .shard_id(shard)
            .shard_iterator_type(ShardIteratorType::TrimHorizon)
            .send()
            .await
            .expect("GetShardIterator")
            .shard_iterator
            .expect("an iterator");
        let mut from_shard = 0;
        loop {
            let page = live
                .kinesis
                .get_records()
                .shard_iterator(&iterator)
                .limit(1000)
                .send()
                .await
                .expect("GetRecords");
            for r in page.records() {
                let text = std::str::from_utf8(r.data().as_ref()).expect("utf-8");
                let id: u32 = text
                    .trim_start_matches("{\"id\":")
                    .trim_end_matches('}')
                    .parse()
                    .expect("id");
                assert!(seen.insert(id), "record {id} read twice");
                assert!(r.sequence_number().len() > 20, "real sequence numbers");
                from_shard += 1;
            }
            if page.records().is_empty() && page.millis_behind_latest() == Some(0) {
                break;
            }
            iterator = page
                .next_shard_iterator
                .expect("open shard has a next iterator");
        }
        if from_shard > 0 {
            shards_with_records += 1;
        }
    }
    assert_eq!(seen.len(), 1000);
    assert_eq!(seen, (0..1000).collect());
    assert_eq!(
        shards_with_records, 4,
        "1,000 keys spread over all 4 shards"
    );
    live.delete_stream(&stream).await;
}

#[tokio::test]
async fn dynamodb_refuses_a_conditional_write_with_a_stale_expectation() {
    let live = live_or_skip!();
    let table = support::unique_name("harness");
    live.create_table(&table, "leaseKey").await;
    let key = AttributeValue::S("stream#shardId-000000000000".into());

    live.dynamodb
        .put_item()
        .table_name(&table)
        .item("leaseKey", key.clone())
        .item("leaseCounter", AttributeValue::N("1".into()))
        .condition_expression("attribute_not_exists(leaseKey)")
        .send()
        .await
        .expect("first put");

    let stale = live
        .dynamodb
        .update_item()
        .table_name(&table)
        .key("leaseKey", key.clone())
        .update_expression("SET leaseCounter = :next")
        .condition_expression("leaseCounter = :seen")
        .expression_attribute_values(":seen", AttributeValue::N("0".into()))
        .expression_attribute_values(":next", AttributeValue::N("1".into()))
        .send()
        .await
        .expect_err("a stale expectation must be refused");
    assert!(
        stale
            .into_service_error()
            .is_conditional_check_failed_exception(),
        "refused as ConditionalCheckFailed"
    );

    let row = live
        .dynamodb
        .get_item()
        .table_name(&table)
        .key("leaseKey", key)
        .consistent_read(true)
        .send()
        .await
        .expect("get");
    assert_eq!(
        row.item().and_then(|i| i.get("leaseCounter")),
        Some(&AttributeValue::N("1".into())),
        "the refused write changed nothing"
    );
    live.delete_table(&table).await;
}
