//! `shardwise seek`: move an application's checkpoints of a stream, backwards too, whether its
//! consumers run or not. Running readers of the moved shards lose their leases at once on their
//! next write (or at their next renewal) and the next owner reads from the new place.

use anyhow::Context;
use serde::Serialize;
use shardwise::lease::DynamoDbLeaseStore;
use shardwise::seek::{SeekTarget, seek};
use shardwise::shard::discovery::KinesisShards;

use crate::common::{Ctx, Result, print_json_lines};
use crate::target::{SEEK_VALUES, parse_seek_target, time_help};

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

    #[arg(
        long,
        value_name = SEEK_VALUES,
        value_parser = parse_seek_target,
        help = concat!(
            "Where to: every shard to the trim horizon, the tip, or a time; or one shard to a \
             record (inclusive; `SEQ.SUB` for a record inside a KPL aggregate). ",
            time_help!()
        ),
    )]
    to: SeekTarget,
}

/// The line printed for a seek.
#[derive(Debug, Serialize)]
struct SeekLine<'a> {
    stream: &'a str,
    app: &'a str,
    moved: &'a [String],
}

pub(crate) async fn run(args: Args, ctx: &Ctx) -> Result<()> {
    let table = args.lease_table.as_deref().unwrap_or(&args.app);
    let store = DynamoDbLeaseStore::new(ctx.dynamodb(), table);
    let lister = KinesisShards::new(ctx.kinesis());
    let report = seek(&store, &lister, &args.stream, &args.to)
        .await
        .with_context(|| format!("cannot seek `{}` for `{}`", args.stream, args.app))?;
    print_json_lines([SeekLine {
        stream: &args.stream,
        app: &args.app,
        moved: &report.moved,
    }])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_keeps_its_fields_and_order() {
        let moved = [
            "shardId-000000000000".to_owned(),
            "shardId-000000000001".to_owned(),
        ];
        let line = |moved| SeekLine {
            stream: "orders",
            app: "billing",
            moved,
        };
        assert_eq!(
            serde_json::to_string(&line(&moved)).unwrap(),
            r#"{"stream":"orders","app":"billing","moved":["shardId-000000000000","shardId-000000000001"]}"#
        );
        assert_eq!(
            serde_json::to_string(&line(&[])).unwrap(),
            r#"{"stream":"orders","app":"billing","moved":[]}"#
        );
    }
}
