//! `shardwise frontier`: how far the whole stream is complete, read from the lease table by any
//! process: the scalar (or why there is none), the membership epoch, and the per-shard vector.

use aws_sdk_kinesis::primitives::{DateTime, DateTimeFormat};
use serde_json::{Value, json};
use shardwise::frontier::compute;
use shardwise::lease::{DynamoDbLeaseStore, Lease, LeaseStore};

use crate::common::{Ctx, Failure, Result, json_object, print_lines};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The application; its lease table has the same name.
    #[arg(long, value_name = "APP")]
    app: String,

    /// The stream.
    #[arg(long, value_name = "STREAM")]
    stream: String,

    /// One JSON object.
    #[arg(long)]
    json: bool,
}

fn rfc3339(ms: i64) -> String {
    DateTime::from_millis(ms)
        .fmt(DateTimeFormat::DateTime)
        .unwrap_or_else(|_| ms.to_string())
}

pub(crate) async fn run(args: Args, ctx: &Ctx) -> Result<()> {
    let store = DynamoDbLeaseStore::new(ctx.dynamodb(), &args.app).create_if_missing(false);
    let context = || {
        format!(
            "cannot read the frontier of `{}` for `{}`",
            args.stream, args.app
        )
    };
    store
        .prepare()
        .await
        .map_err(|e| Failure::caused_by(context(), e))?;
    let rows = store
        .list(&args.stream)
        .await
        .map_err(|e| Failure::caused_by(context(), e))?;
    let f = compute(&rows.iter().map(Lease::coordinate).collect::<Vec<_>>());
    let why = if rows.is_empty() {
        Some("no lease rows for this stream".to_string())
    } else if !f.missing.is_empty() {
        Some(format!("no coordinate yet for {}", f.missing.join(", ")))
    } else {
        None
    };
    if args.json {
        let members: Vec<Value> = f
            .members
            .iter()
            .map(|m| json!({"shard": m.shard_id, "complete_through_ms": m.complete_through, "ended": m.ended}))
            .collect();
        print_lines([json_object(&[
            ("stream", json!(args.stream)),
            ("epoch", json!(format!("{:016x}", f.epoch))),
            ("frontier_ms", json!(f.scalar)),
            ("frontier", json!(f.scalar.map(rfc3339))),
            ("why_none", json!(why)),
            ("members", Value::Array(members)),
        ])])?;
        return Ok(());
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
