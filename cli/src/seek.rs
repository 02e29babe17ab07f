//! `shardwise seek`: move an application's checkpoints of a stream, backwards too, whether its
//! consumers run or not. Running readers of the moved shards lose their leases at once on their
//! next write (or at their next renewal) and the next owner reads from the new place.

use std::sync::Arc;

use serde_json::json;
use shardwise::lease::DynamoDbLeaseStore;
use shardwise::seek::{SeekTarget, seek};
use shardwise::shard::discovery::KinesisShards;
use shardwise::{Position, SequenceNumber};

use crate::common::{Ctx, Failure, Result, json_object, parse_rfc3339, print_lines};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The application; its lease table has the same name.
    #[arg(long, value_name = "APP")]
    app: String,

    /// The stream.
    #[arg(long, value_name = "STREAM")]
    stream: String,

    /// Where to: every shard to the trim horizon, the tip, or a time; or one shard to a record
    /// (inclusive; `SEQ.SUB` for a record inside a KPL aggregate).
    #[arg(long, value_name = "trim-horizon|latest|timestamp:RFC3339|sequence:SHARD:SEQ[.SUB]", value_parser = parse_target)]
    to: SeekTarget,
}

fn parse_target(s: &str) -> std::result::Result<SeekTarget, String> {
    match s {
        "trim-horizon" => return Ok(SeekTarget::TrimHorizon),
        "latest" => return Ok(SeekTarget::Latest),
        _ => {}
    }
    if let Some(ts) = s.strip_prefix("timestamp:") {
        return Ok(SeekTarget::Timestamp(parse_rfc3339(ts)?));
    }
    if let Some(rest) = s.strip_prefix("sequence:") {
        let (shard, seq) = rest
            .split_once(':')
            .ok_or_else(|| format!("`{s}`: expected sequence:SHARD:SEQ"))?;
        let (digits, sub) = match seq.split_once('.') {
            Some((d, sub)) => (
                d,
                sub.parse::<u64>()
                    .map_err(|_| format!("`{sub}` is not a sub-sequence number"))?,
            ),
            None => (seq, 0),
        };
        let sequence = SequenceNumber::parse(digits).map_err(|e| e.to_string())?;
        let shard_id = match shard.parse::<u64>() {
            Ok(n) => format!("shardId-{n:012}"),
            Err(_) => shard.to_string(),
        };
        return Ok(SeekTarget::Position {
            shard_id,
            position: Position::new(sequence, sub),
        });
    }
    Err(format!(
        "`{s}`: expected trim-horizon, latest, timestamp:RFC3339 or sequence:SHARD:SEQ"
    ))
}

pub(crate) async fn run(args: Args, ctx: &Ctx) -> Result<()> {
    let store = DynamoDbLeaseStore::new(ctx.dynamodb(), &args.app);
    let lister = Arc::new(KinesisShards::new(ctx.kinesis()));
    let report = seek(&store, lister.as_ref(), &args.stream, &args.to)
        .await
        .map_err(|e| {
            Failure::caused_by(
                format!("cannot seek `{}` for `{}`", args.stream, args.app),
                e,
            )
        })?;
    print_lines([json_object(&[
        ("stream", json!(args.stream)),
        ("app", json!(args.app)),
        ("moved", json!(report.moved)),
    ])])?;
    Ok(())
}
