//! `shardwise frontier`: how far the whole stream is complete, read from the lease table by any
//! process: the scalar (or why there is none), the membership epoch, and the per-shard vector.

use anyhow::Context;
use aws_sdk_kinesis::primitives::{DateTime, DateTimeFormat};
use serde::Serialize;
use shardwise::frontier::{Frontier, Member, compute};
use shardwise::lease::{DynamoDbLeaseStore, Lease, LeaseStore};

use crate::common::{Ctx, Result, print_json_lines, print_lines};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The application.
    #[arg(long, value_name = "APP")]
    app: String,

    /// The application's DynamoDB lease table (default: the application's name).
    #[arg(long, value_name = "NAME")]
    lease_table: Option<String>,

    /// The stream.
    #[arg(long, value_name = "STREAM")]
    stream: String,

    /// One JSON object.
    #[arg(long)]
    json: bool,
}

/// The `--json` object.
#[derive(Debug, Serialize)]
struct FrontierJson<'a> {
    stream: &'a str,
    epoch: String,
    frontier_ms: Option<i64>,
    frontier: Option<String>,
    why_none: Option<&'a str>,
    members: Vec<MemberJson<'a>>,
}

/// One shard of the `--json` object; its fields in the (alphabetical) order they always had.
#[derive(Debug, Serialize)]
struct MemberJson<'a> {
    complete_through_ms: Option<i64>,
    ended: bool,
    shard: &'a str,
}

impl<'a> FrontierJson<'a> {
    fn of(stream: &'a str, f: &'a Frontier, why_none: Option<&'a str>) -> Self {
        Self {
            stream,
            epoch: format!("{:016x}", f.epoch),
            frontier_ms: f.scalar,
            frontier: f.scalar.map(rfc3339),
            why_none,
            members: f.members.iter().map(MemberJson::of).collect(),
        }
    }
}

impl<'a> MemberJson<'a> {
    fn of(m: &'a Member) -> Self {
        Self {
            complete_through_ms: m.complete_through,
            ended: m.ended,
            shard: &m.shard_id,
        }
    }
}

fn rfc3339(ms: i64) -> String {
    DateTime::from_millis(ms)
        .fmt(DateTimeFormat::DateTime)
        .unwrap_or_else(|_| ms.to_string())
}

pub(crate) async fn run(args: Args, ctx: &Ctx) -> Result<()> {
    let table = args.lease_table.as_deref().unwrap_or(&args.app);
    let store = DynamoDbLeaseStore::new(ctx.dynamodb(), table).create_if_missing(false);
    let context = || {
        format!(
            "cannot read the frontier of `{}` for `{}`",
            args.stream, args.app
        )
    };
    store.prepare().await.with_context(context)?;
    let rows = store.list(&args.stream).await.with_context(context)?;
    let f = compute(&rows.iter().map(Lease::coordinate).collect::<Vec<_>>());
    let why = if rows.is_empty() {
        Some("no lease rows for this stream".to_string())
    } else if !f.missing.is_empty() {
        Some(format!("no coordinate yet for {}", f.missing.join(", ")))
    } else {
        None
    };
    if args.json {
        return print_json_lines([FrontierJson::of(&args.stream, &f, why.as_deref())]);
    }
    let mut lines = vec![match (f.scalar, &why) {
        (Some(ms), _) => format!("frontier: {} ({ms} ms)", rfc3339(ms)),
        (None, Some(why)) => format!("frontier: none ({why})"),
        (None, None) => "frontier: none".to_string(),
    }];
    lines.push(format!("epoch: {:016x}", f.epoch));
    for m in &f.members {
        lines.push(format!(
            "  {}  {}{}",
            m.shard_id,
            m.complete_through
                .map(rfc3339)
                .unwrap_or_else(|| "-".into()),
            if m.ended { "  (ended)" } else { "" }
        ));
    }
    print_lines(lines)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_json_keeps_its_fields_and_order() {
        let member = |shard: &str, complete_through, ended| Member {
            shard_id: shard.into(),
            complete_through,
            ended,
        };
        let f = Frontier {
            epoch: 0xabcd,
            members: vec![
                member("shardId-000000000000", Some(1_764_452_220_123), false),
                member("shardId-000000000001", None, true),
            ],
            scalar: Some(1_764_452_220_123),
            missing: vec![],
        };
        assert_eq!(
            serde_json::to_string(&FrontierJson::of("s", &f, None)).unwrap(),
            r#"{"stream":"s","epoch":"000000000000abcd","frontier_ms":1764452220123,"frontier":"2025-11-29T21:37:00.123Z","why_none":null,"members":[{"complete_through_ms":1764452220123,"ended":false,"shard":"shardId-000000000000"},{"complete_through_ms":null,"ended":true,"shard":"shardId-000000000001"}]}"#
        );
        let none = Frontier::default();
        assert_eq!(
            serde_json::to_string(&FrontierJson::of(
                "s",
                &none,
                Some("no lease rows for this stream")
            ))
            .unwrap(),
            r#"{"stream":"s","epoch":"0000000000000000","frontier_ms":null,"frontier":null,"why_none":"no lease rows for this stream","members":[]}"#
        );
    }
}
