//! `shardwise frontier`: how far the whole stream (or paged source) is complete, read from the
//! lease table by any process: the scalar (or why there is none), the membership epoch (an
//! ordered counter, printed as 16 hex digits so that text order is number order), and the vector
//! of members (a paged partition's with its checkpoint version and applied position), and the
//! ranges forward seeks skipped (`skipped_by_seek`), which the scalar does not certify.

use anyhow::Context;
use aws_sdk_kinesis::primitives::{DateTime, DateTimeFormat};
use serde::Serialize;
use std::collections::BTreeMap;

use shardwise::frontier::{Frontier, Member, SeekCoordinate, SkippedBySeek, from_rows};
use shardwise::lease::{DynamoDbLeaseStore, Lease, LeaseStore};
use shardwise::paged::PagedProgress;

use crate::common::{Ctx, Result, print_json_lines, print_lines};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The application.
    #[arg(long, value_name = "APP")]
    app: String,

    /// The application's DynamoDB lease table (default: the application's name).
    #[arg(long, value_name = "NAME")]
    lease_table: Option<String>,

    /// The stream, or a paged source's name in the lease table (e.g. `logs:GROUP`).
    #[arg(long, value_name = "STREAM", required_unless_present = "log_group")]
    stream: Option<String>,

    /// Instead of --stream: the CloudWatch Logs log group a `consume --log-group` application
    /// reads (its source `logs:GROUP`, or `logs-by-time:GROUP` with --by-timestamp).
    #[arg(long, value_name = "GROUP", conflicts_with = "stream")]
    log_group: Option<String>,

    /// With --log-group: the application reads it by timestamp.
    #[arg(long, requires = "log_group")]
    by_timestamp: bool,

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
    skipped_by_seek: Vec<SkippedJson<'a>>,
}

/// A range a forward seek skipped on one shard or partition: the records after `from` and before
/// `to`, which the frontier does not say were handled.
#[derive(Debug, Serialize)]
struct SkippedJson<'a> {
    shard: &'a str,
    from: CoordinateJson<'a>,
    to: CoordinateJson<'a>,
    seek_epoch: u64,
}

/// A place in a shard: `"start"`, `{"time_ms": N}`, `{"checkpoint": "SEQ"}`, `"end"`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "snake_case")]
enum CoordinateJson<'a> {
    Start,
    TimeMs(i64),
    Checkpoint(&'a str),
    End,
}

impl<'a> CoordinateJson<'a> {
    fn of(c: &'a SeekCoordinate) -> Self {
        match c {
            SeekCoordinate::Start => Self::Start,
            SeekCoordinate::Time(ms) => Self::TimeMs(*ms),
            SeekCoordinate::Checkpoint(label) => Self::Checkpoint(label),
            SeekCoordinate::End => Self::End,
        }
    }
}

impl<'a> SkippedJson<'a> {
    fn of(s: &'a SkippedBySeek) -> Self {
        Self {
            shard: &s.shard_id,
            from: CoordinateJson::of(&s.range.from),
            to: CoordinateJson::of(&s.range.to),
            seek_epoch: s.range.seek_epoch,
        }
    }
}

/// One shard of the `--json` object; its fields in the (alphabetical) order they always had. A
/// paged partition adds its checkpoint: `applied_position` and `checkpoint_version`.
#[derive(Debug, Serialize)]
struct MemberJson<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    applied_position: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    checkpoint_version: Option<u64>,
    complete_through_ms: Option<i64>,
    ended: bool,
    shard: &'a str,
}

impl<'a> FrontierJson<'a> {
    fn of(
        stream: &'a str,
        f: &'a Frontier,
        why_none: Option<&'a str>,
        progress: &BTreeMap<String, PagedProgress>,
    ) -> Self {
        Self {
            stream,
            epoch: format!("{:016x}", f.epoch),
            frontier_ms: f.scalar,
            frontier: f.scalar.map(rfc3339),
            why_none,
            members: f
                .members
                .iter()
                .map(|m| MemberJson::of(m, progress.get(&m.shard_id)))
                .collect(),
            skipped_by_seek: f.skipped_by_seek.iter().map(SkippedJson::of).collect(),
        }
    }
}

impl<'a> MemberJson<'a> {
    fn of(m: &'a Member, progress: Option<&PagedProgress>) -> Self {
        Self {
            applied_position: progress
                .and_then(|p| p.applied_position.as_ref())
                .map(ToString::to_string),
            checkpoint_version: progress.map(|p| p.checkpoint_version),
            complete_through_ms: m.complete_through,
            ended: m.ended,
            shard: &m.shard_id,
        }
    }
}

/// Why there is no scalar, if there is none.
fn why_none(rows: &[Lease], f: &Frontier) -> Option<String> {
    if rows.is_empty() {
        Some("no lease rows for this stream".to_string())
    } else if !f.unproven.is_empty() {
        Some(format!(
            "membership change not proven: {}",
            f.unproven.join("; ")
        ))
    } else if !f.missing.is_empty() {
        Some(format!("no coordinate yet for {}", f.missing.join(", ")))
    } else {
        f.publish.as_ref().map(|next| {
            format!(
                "membership epoch {:016x} is not published yet (no worker has scanned since it changed)",
                next.epoch
            )
        })
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
    let stream = match (&args.stream, &args.log_group) {
        (Some(stream), _) => stream.clone(),
        (None, Some(group)) if args.by_timestamp => format!("logs-by-time:{group}"),
        (None, Some(group)) => format!("logs:{group}"),
        (None, None) => unreachable!("clap requires --stream or --log-group"),
    };
    let context = || format!("cannot read the frontier of `{stream}` for `{}`", args.app);
    store.prepare().await.with_context(context)?;
    let rows = store.list(&stream).await.with_context(context)?;
    let published = store.membership(&stream).await.with_context(context)?;
    // The lease table alone: the source is not listed here, so a partition it gained that has
    // no row yet is not seen (a worker's own frontier withholds the scalar for it).
    let mut f = from_rows(&rows, published.as_ref());
    let why = why_none(&rows, &f);
    if f.publish.is_some() {
        // The scalar holds only once a worker has published the membership it stands on.
        f.scalar = None;
    }
    let progress: BTreeMap<String, PagedProgress> = rows
        .iter()
        .filter_map(|r| Some((r.shard_id.clone(), r.progress.clone()?)))
        .collect();
    if args.json {
        return print_json_lines([FrontierJson::of(&stream, &f, why.as_deref(), &progress)]);
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
    for skipped in &f.skipped_by_seek {
        let place = |c: &SeekCoordinate| match c {
            SeekCoordinate::Time(ms) => rfc3339(*ms),
            other => other.to_string(),
        };
        lines.push(format!(
            "skipped by seek (epoch {}): {} after {} and before {}",
            skipped.range.seek_epoch,
            skipped.shard_id,
            place(&skipped.range.from),
            place(&skipped.range.to)
        ));
    }
    print_lines(lines)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardwise::frontier::SkippedRange;

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
            skipped_by_seek: vec![
                SkippedBySeek {
                    shard_id: "shardId-000000000000".into(),
                    range: SkippedRange {
                        from: SeekCoordinate::Time(1_764_452_100_000),
                        to: SeekCoordinate::Time(1_764_452_200_000),
                        seek_epoch: 2,
                    },
                },
                SkippedBySeek {
                    shard_id: "shardId-000000000001".into(),
                    range: SkippedRange {
                        from: SeekCoordinate::Checkpoint("4959".into()),
                        to: SeekCoordinate::End,
                        seek_epoch: 1,
                    },
                },
            ],
            ..Frontier::default()
        };
        assert_eq!(
            serde_json::to_string(&FrontierJson::of("s", &f, None, &BTreeMap::new())).unwrap(),
            r#"{"stream":"s","epoch":"000000000000abcd","frontier_ms":1764452220123,"frontier":"2025-11-29T21:37:00.123Z","why_none":null,"members":[{"complete_through_ms":1764452220123,"ended":false,"shard":"shardId-000000000000"},{"complete_through_ms":null,"ended":true,"shard":"shardId-000000000001"}],"skipped_by_seek":[{"shard":"shardId-000000000000","from":{"time_ms":1764452100000},"to":{"time_ms":1764452200000},"seek_epoch":2},{"shard":"shardId-000000000001","from":{"checkpoint":"4959"},"to":"end","seek_epoch":1}]}"#
        );
        let none = Frontier::default();
        assert_eq!(
            serde_json::to_string(&FrontierJson::of(
                "s",
                &none,
                Some("no lease rows for this stream"),
                &BTreeMap::new()
            ))
            .unwrap(),
            r#"{"stream":"s","epoch":"0000000000000000","frontier_ms":null,"frontier":null,"why_none":"no lease rows for this stream","members":[],"skipped_by_seek":[]}"#
        );
    }
}
