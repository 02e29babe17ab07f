//! `shardwise leases`: the rows of an application's lease table.

use std::collections::BTreeSet;
use std::time::UNIX_EPOCH;

use anyhow::Context;
use aws_sdk_dynamodb::types::AttributeValue;
use serde::Serialize;
use shardwise::lease::{Checkpoint, DynamoDbLeaseStore, Lease, LeaseStore};

use crate::common::{Ctx, Result, list_or_dash, print_json_lines, print_lines, table};

/// The attribute of a lease row naming its stream (see `docs/leases.md`).
const STREAM_ATTRIBUTE: &str = "streamName";

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The application.
    #[arg(long, value_name = "APP")]
    app: String,

    /// The application's DynamoDB lease table (default: the application's name).
    #[arg(long, value_name = "NAME")]
    lease_table: Option<String>,

    /// Only the leases of this stream (default: every stream in the table).
    #[arg(long, value_name = "STREAM")]
    stream: Option<String>,

    /// One JSON object per lease, one per line.
    #[arg(long)]
    json: bool,
}

pub(crate) async fn run(args: Args, ctx: &Ctx) -> Result<()> {
    let client = ctx.dynamodb();
    let table_name = args.lease_table.as_deref().unwrap_or(&args.app);
    let store = DynamoDbLeaseStore::new(client.clone(), table_name).create_if_missing(false);
    let context = || format!("cannot read the leases of application `{}`", args.app);
    // Checks that the table exists with the lease key schema; never creates it.
    store.prepare().await.with_context(context)?;
    let streams = match &args.stream {
        Some(stream) => vec![stream.clone()],
        None => stream_names(&client, table_name)
            .await
            .with_context(context)?,
    };
    let mut leases = Vec::new();
    for stream in &streams {
        leases.extend(store.list(stream).await.with_context(context)?);
    }
    if args.json {
        print_json_lines(leases.iter().map(LeaseJson::of))?;
    } else {
        let rows: Vec<Vec<String>> = leases.iter().map(lease_row).collect();
        print_lines(table(
            &[
                "STREAM",
                "SHARD",
                "OWNER",
                "COUNTER",
                "EPOCH",
                "CHECKPOINT",
                "STATE",
                "PARENTS",
            ],
            &rows,
        ))?;
    }
    Ok(())
}

/// Every stream that has a row in the table (one consistent Scan of the stream attribute).
async fn stream_names(client: &aws_sdk_dynamodb::Client, table: &str) -> Result<Vec<String>> {
    let items = client
        .scan()
        .table_name(table)
        .consistent_read(true)
        .projection_expression("#stream")
        .expression_attribute_names("#stream", STREAM_ATTRIBUTE)
        .into_paginator()
        .items()
        .send()
        .try_collect()
        .await
        .map_err(|e| shardwise::Error::DynamoDb {
            operation: "Scan",
            table: table.to_owned(),
            source: Box::new(e),
        })?;
    let names: BTreeSet<String> = items
        .iter()
        .filter_map(|item| match item.get(STREAM_ATTRIBUTE) {
            Some(AttributeValue::S(name)) => Some(name.clone()),
            _ => None,
        })
        .collect();
    Ok(names.into_iter().collect())
}

/// `ended` once the shard is fully handled, `owned` while a worker holds it, `retired` for an
/// idle paged partition nobody reads until its source shows activity after its `retiredAt`, else
/// `free`.
fn state(lease: &Lease) -> &'static str {
    if lease.checkpoint.is_shard_end() {
        "ended"
    } else if lease.owner.is_some() {
        "owned"
    } else if lease.retired_at.is_some() {
        "retired"
    } else {
        "free"
    }
}

fn lease_row(lease: &Lease) -> Vec<String> {
    vec![
        lease.stream.clone(),
        lease.shard_id.clone(),
        lease.owner.clone().unwrap_or_else(|| "-".to_owned()),
        lease.counter.to_string(),
        lease.owner_epoch.to_string(),
        lease.checkpoint.to_string(),
        state(lease).to_owned(),
        list_or_dash(&lease.parents),
    ]
}

/// One lease as `--json` prints it.
#[derive(Debug, Serialize)]
struct LeaseJson<'a> {
    stream: &'a str,
    shard: &'a str,
    owner: Option<&'a str>,
    counter: u64,
    epoch: u64,
    checkpoint: String,
    sub_sequence: u64,
    starting_timestamp_ms: Option<i64>,
    state: &'static str,
    parents: &'a [String],
    children: &'a [String],
    complete_through: Option<i64>,
    seek_epoch: u64,
    /// A paged partition's progress (`docs/paged.md`): absent on Kinesis rows.
    #[serde(skip_serializing_if = "Option::is_none")]
    resume_cursor: Option<Option<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    applied_position: Option<Option<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    checkpoint_version: Option<u64>,
    /// A source read by timestamp: the latest timestamp (ms) whose group is closed.
    #[serde(skip_serializing_if = "Option::is_none")]
    closed_through: Option<Option<i64>>,
    /// Since when (ms) the receipts a replay from the progress can need were recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    receipts_since_ms: Option<Option<i64>>,
    /// A retired paged partition: the source's ingestion time (ms) through which it was read;
    /// activity after it wakes it. Absent on rows never retired.
    #[serde(skip_serializing_if = "Option::is_none")]
    retired_at_ms: Option<i64>,
}

impl<'a> LeaseJson<'a> {
    fn of(lease: &'a Lease) -> Self {
        let starting_timestamp_ms = match lease.checkpoint {
            Checkpoint::AtTimestamp(t) => Some(match t.duration_since(UNIX_EPOCH) {
                Ok(d) => d.as_millis() as i64,
                Err(e) => -(e.duration().as_millis() as i64),
            }),
            _ => None,
        };
        Self {
            stream: &lease.stream,
            shard: &lease.shard_id,
            owner: lease.owner.as_deref(),
            counter: lease.counter,
            epoch: lease.owner_epoch,
            checkpoint: lease.checkpoint.label(),
            sub_sequence: lease.checkpoint.sub_sequence(),
            starting_timestamp_ms,
            state: state(lease),
            parents: &lease.parents,
            children: &lease.children,
            complete_through: lease.complete_through,
            seek_epoch: lease.seek_epoch,
            resume_cursor: lease
                .progress
                .as_ref()
                .map(|p| p.resume_cursor.as_ref().map(ToString::to_string)),
            applied_position: lease
                .progress
                .as_ref()
                .map(|p| p.applied_position.as_ref().map(ToString::to_string)),
            checkpoint_version: lease.progress.as_ref().map(|p| p.checkpoint_version),
            closed_through: lease.progress.as_ref().map(|p| p.closed_through),
            receipts_since_ms: lease.progress.as_ref().map(|p| p.receipts_since),
            retired_at_ms: lease.retired_at,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};
    use shardwise::{Position, SequenceNumber};

    fn lease(owner: Option<&str>, checkpoint: Checkpoint) -> Lease {
        Lease {
            stream: "orders".into(),
            shard_id: "shardId-000000000002".into(),
            owner: owner.map(str::to_owned),
            counter: 7,
            owner_epoch: 3,
            checkpoint,
            parents: vec!["shardId-000000000000".into(), "shardId-000000000001".into()],
            children: vec![],
            complete_through: Some(12),
            seek_epoch: 1,
            seek_skipped: None,
            sought_at: None,
            progress: None,
            wanted_by: None,
            handoff_acked: false,
            retired_at: None,
            window: None,
        }
    }

    #[test]
    fn rows_show_the_state() {
        let at = Checkpoint::At(Position::new(SequenceNumber::parse("4959").unwrap(), 2));
        let row = lease_row(&lease(Some("w1"), at.clone()));
        assert_eq!(
            row,
            [
                "orders",
                "shardId-000000000002",
                "w1",
                "7",
                "3",
                "4959.2",
                "owned",
                "shardId-000000000000,shardId-000000000001"
            ]
        );
        assert_eq!(lease_row(&lease(None, at))[6], "free");
        assert_eq!(
            lease_row(&lease(Some("w1"), Checkpoint::ShardEnd))[6],
            "ended"
        );
        let mut retired = lease(None, Checkpoint::TrimHorizon);
        retired.retired_at = Some(1_764_000_000_000);
        assert_eq!(lease_row(&retired)[6], "retired");
        let json = serde_json::to_value(LeaseJson::of(&retired)).unwrap();
        assert_eq!(json["state"], "retired");
        assert_eq!(json["retired_at_ms"], 1_764_000_000_000_i64);
    }

    #[test]
    fn json_rows_carry_every_field() {
        let at = Checkpoint::At(Position::new(SequenceNumber::parse("4959").unwrap(), 2));
        let line = serde_json::to_string(&LeaseJson::of(&lease(None, at))).unwrap();
        let value: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(value["checkpoint"], "4959");
        assert_eq!(value["sub_sequence"], 2);
        assert_eq!(value["owner"], Value::Null);
        assert_eq!(value["state"], "free");
        assert_eq!(value["parents"].as_array().unwrap().len(), 2);
        assert_eq!(value["children"], json!([]));
    }

    #[test]
    fn json_rows_keep_their_fields_and_order() {
        let json = |lease: &Lease| serde_json::to_string(&LeaseJson::of(lease)).unwrap();
        let mut owned = lease(
            Some("w1"),
            Checkpoint::At(Position::new(SequenceNumber::parse("4959").unwrap(), 2)),
        );
        owned.children = vec!["shardId-000000000005".into()];
        assert_eq!(
            json(&owned),
            r#"{"stream":"orders","shard":"shardId-000000000002","owner":"w1","counter":7,"epoch":3,"checkpoint":"4959","sub_sequence":2,"starting_timestamp_ms":null,"state":"owned","parents":["shardId-000000000000","shardId-000000000001"],"children":["shardId-000000000005"],"complete_through":12,"seek_epoch":1}"#
        );
        let at = |ms| Checkpoint::AtTimestamp(UNIX_EPOCH + std::time::Duration::from_millis(ms));
        let mut timed = lease(None, at(1_764_452_220_123));
        timed.complete_through = None;
        assert_eq!(
            json(&timed),
            r#"{"stream":"orders","shard":"shardId-000000000002","owner":null,"counter":7,"epoch":3,"checkpoint":"AT_TIMESTAMP","sub_sequence":0,"starting_timestamp_ms":1764452220123,"state":"free","parents":["shardId-000000000000","shardId-000000000001"],"children":[],"complete_through":null,"seek_epoch":1}"#
        );
        timed.checkpoint =
            Checkpoint::AtTimestamp(UNIX_EPOCH - std::time::Duration::from_millis(5));
        assert!(json(&timed).contains(r#""starting_timestamp_ms":-5,"#));
    }

    #[test]
    fn paged_rows_show_their_progress() {
        use shardwise::paged::{Cursor, PagePosition, PagedProgress};
        let mut paged = lease(Some("w1"), Checkpoint::TrimHorizon);
        paged.progress = Some(PagedProgress {
            resume_cursor: Some(Cursor::new("f/0009")),
            applied_position: Some(PagePosition::from_parts(&[
                1_764_000_000_000,
                1_764_000_000_020,
                0,
            ])),
            checkpoint_version: 4,
            closed_through: None,
            receipts_since: Some(1_764_000_000_500),
        });
        let line = serde_json::to_string(&LeaseJson::of(&paged)).unwrap();
        assert!(
            line.ends_with(r#""resume_cursor":"f/0009","applied_position":"1764000000000.1764000000020.0","checkpoint_version":4,"closed_through":null,"receipts_since_ms":1764000000500}"#),
            "{line}"
        );
        paged.progress = Some(PagedProgress::default());
        let line = serde_json::to_string(&LeaseJson::of(&paged)).unwrap();
        assert!(
            line.ends_with(
                r#""resume_cursor":null,"applied_position":null,"checkpoint_version":0,"closed_through":null,"receipts_since_ms":null}"#
            ),
            "{line}"
        );
    }
}
