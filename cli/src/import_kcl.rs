//! `shardwise import-kcl`: an application moving from the Kinesis Client Library (2.x, 3.x) keeps
//! its place. The KCL lease table is read (DescribeTable and consistent Scans only: nothing is
//! ever written to it), and each shard of the stream gets a shardwise lease row whose checkpoint is
//! exactly KCL's committed one, with its lineage.
//!
//! What maps to what (KCL's sources: `DynamoDBLeaseSerializer`, `ExtendedSequenceNumber`,
//! `ProcessTask::filterAndGetMaxExtendedSequenceNumber`, `IteratorBuilder`):
//!
//! | KCL row | shardwise row |
//! |---|---|
//! | `leaseKey` = the shard id, or `account:stream:creationEpoch:shardId` (multi-stream) | `stream#shardId`, for `--stream`'s rows only |
//! | `checkpoint` SEQ, `checkpointSubSequenceNumber` SUB | `Checkpoint::At(SEQ, SUB)`: KCL drops a record whose (sequence, sub-sequence) is at or below the checkpoint, plain records counting as sub-sequence 0; shardwise's reader drops every position at or before `At`'s, so the next record handled is the same one |
//! | `TRIM_HORIZON`, `LATEST` | the same start |
//! | `AT_TIMESTAMP` | `AT_TIMESTAMP` at `--at-timestamp`: KCL keeps the time in the application's configuration (`initialPositionInStream`), not in the table, so without the flag the import is refused |
//! | `SHARD_END` | `SHARD_END` (the shard's children may start) |
//! | `parentShardId`, `childShardIds` | parents, children |
//! | `pendingCheckpoint` (a prepared, uncommitted checkpoint) | not taken: the records after the committed checkpoint are handled again, and the output says so |
//!
//! Refusals (each named in the table's STATE column and in the error): a KCL lease still held (an
//! owner whose `leaseCounter` moved between two reads `--failover-time` apart), an existing
//! shardwise row of the stream that already has a checkpoint, a shard the stream does not list
//! (or a sequence number outside its range: the table of another stream); `--force` overrides
//! these three. An `AT_TIMESTAMP` row without `--at-timestamp`, or a checkpoint that is neither a
//! sequence number nor one of KCL's sentinels, is refused whatever the flags. A refusal writes
//! nothing.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};
use aws_sdk_dynamodb::types::{AttributeValue, KeyType, ScalarAttributeType, TableDescription};
use shardwise::lease::{Checkpoint, DynamoDbLeaseStore, Lease, LeaseStore, NewLease, SeekMove};
use shardwise::{Position, SequenceNumber};

use crate::common::{Ctx, Result, list_or_dash, print_lines, table};
use crate::flag_error::invalid_setting;
use crate::table_flags::TableFlags;
use crate::target::parse_time;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The KCL application's lease table (KCL names it after its application unless configured
    /// otherwise). Only read: DescribeTable and Scan.
    #[arg(long, value_name = "TABLE")]
    kcl_table: String,

    /// The stream whose leases to import (in a multi-stream KCL table, the rows of this stream
    /// only).
    #[arg(long, value_name = "STREAM")]
    stream: String,

    /// The shardwise application.
    #[arg(long, value_name = "APP")]
    app: String,

    /// The shardwise application's lease table (default: the application's name), created if
    /// missing as `consume` creates it (`--billing-mode`, `--tag`, `--point-in-time-recovery`).
    /// Must not be the KCL table.
    #[arg(long, value_name = "NAME")]
    lease_table: Option<String>,

    #[command(flatten)]
    table: TableFlags,

    /// Print what would be written, and any refusal, and write nothing.
    #[arg(long)]
    dry_run: bool,

    /// Import even while a KCL lease is still held, over shardwise rows that already have
    /// checkpoints, and shards the stream does not list.
    #[arg(long)]
    force: bool,

    /// KCL's failover time: the table is read twice this far apart, and a lease whose
    /// `leaseCounter` moved in between is still held by a running KCL worker.
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "10s",
        value_parser = humantime::parse_duration
    )]
    failover_time: Duration,

    #[arg(
        long,
        value_name = "TIME",
        value_parser = parse_time,
        help = "Where KCL's AT_TIMESTAMP rows start: the timestamp of the KCL application's \
                initialPositionInStream (KCL keeps it in its configuration, not in the table). \
                TIME is RFC 3339 with `Z` or an offset (`2026-11-29T21:37:00Z`, \
                `2026-11-29T21:37:00+02:00`) or a date alone (`2026-11-29`, midnight UTC)"
    )]
    at_timestamp: Option<SystemTime>,
}

// ---------------------------------------------------------------------------------------------
// KCL's rows

/// KCL's attribute names (`DynamoDBLeaseSerializer`, `DynamoDBMultiStreamLeaseSerializer`).
mod kcl {
    pub(super) const KEY: &str = "leaseKey";
    pub(super) const OWNER: &str = "leaseOwner";
    pub(super) const COUNTER: &str = "leaseCounter";
    pub(super) const CHECKPOINT: &str = "checkpoint";
    pub(super) const SUB: &str = "checkpointSubSequenceNumber";
    pub(super) const PENDING: &str = "pendingCheckpoint";
    pub(super) const PENDING_SUB: &str = "pendingCheckpointSubSequenceNumber";
    pub(super) const PARENTS: &str = "parentShardId";
    pub(super) const CHILDREN: &str = "childShardIds";
    /// KCL 3.x keeps other entities in the lease table too; a lease has none or `LEASE`.
    pub(super) const ENTITY_TYPE: &str = "entityType";
    pub(super) const LEASE_ENTITY: &str = "LEASE";
    /// Only on shardwise's own rows: a table that has it is not KCL's.
    pub(super) const SHARDWISE_EPOCH: &str = "ownerEpoch";
}

type Item = HashMap<String, AttributeValue>;

/// One KCL lease row, as far as the import reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct KclLease {
    key: String,
    /// `account:stream:creationEpoch` of a multi-stream table's row; `None` in a single-stream
    /// table, whose rows do not name their stream.
    stream_id: Option<String>,
    shard_id: String,
    owner: Option<String>,
    counter: u64,
    /// `checkpoint`: a sequence number or a sentinel.
    checkpoint: String,
    /// `checkpointSubSequenceNumber`.
    sub: u64,
    /// `pendingCheckpoint` and its sub-sequence: prepared, not committed.
    pending: Option<(String, u64)>,
    parents: Vec<String>,
    children: Vec<String>,
}

impl KclLease {
    /// The stream name of a multi-stream row.
    fn stream_name(&self) -> Option<&str> {
        self.stream_id
            .as_deref()
            .and_then(|id| id.split(':').nth(1))
    }
}

/// Reads one item of a KCL lease table: `Ok(None)` for KCL's other entities (KCL 3.x), an error
/// for an item that is not a KCL lease.
fn parse_item(item: &Item) -> Result<Option<KclLease>, String> {
    let text = |name: &str| match item.get(name) {
        Some(AttributeValue::S(s)) => Some(s.clone()),
        _ => None,
    };
    let number = |name: &str| -> Result<Option<u64>, String> {
        match item.get(name) {
            None => Ok(None),
            Some(AttributeValue::N(n)) => n
                .parse::<u64>()
                .map(Some)
                .map_err(|_| format!("`{name}` is `{n}`, not a whole number")),
            Some(other) => Err(format!("`{name}` is not a number ({other:?})")),
        }
    };
    let strings = |name: &str| -> Vec<String> {
        let mut out = match item.get(name) {
            Some(AttributeValue::Ss(v)) => v.clone(),
            Some(AttributeValue::L(v)) => v.iter().filter_map(|v| v.as_s().ok().cloned()).collect(),
            Some(AttributeValue::S(s)) => vec![s.clone()],
            _ => Vec::new(),
        };
        out.sort();
        out
    };
    if let Some(kind) = text(kcl::ENTITY_TYPE)
        && kind != kcl::LEASE_ENTITY
    {
        return Ok(None);
    }
    let Some(key) = text(kcl::KEY) else {
        return Err(format!("an item has no string `{}`", kcl::KEY));
    };
    if item.contains_key(kcl::SHARDWISE_EPOCH) || key.contains('#') {
        return Err(format!(
            "`{key}` is a shardwise lease row (`{}`), not a KCL lease",
            kcl::SHARDWISE_EPOCH
        ));
    }
    let within = |why: String| format!("lease `{key}`: {why}");
    let Some(checkpoint) = text(kcl::CHECKPOINT) else {
        return Err(within(format!(
            "no `{}`: not a KCL lease row",
            kcl::CHECKPOINT
        )));
    };
    let Some(counter) = number(kcl::COUNTER).map_err(within)? else {
        return Err(within(format!(
            "no `{}`: not a KCL lease row",
            kcl::COUNTER
        )));
    };
    let sub = number(kcl::SUB).map_err(within)?.unwrap_or(0);
    let pending = match text(kcl::PENDING).filter(|p| !p.is_empty()) {
        Some(p) => Some((p, number(kcl::PENDING_SUB).map_err(within)?.unwrap_or(0))),
        None => None,
    };
    let (stream_id, shard_id) = split_key(&key);
    Ok(Some(KclLease {
        stream_id,
        shard_id,
        owner: text(kcl::OWNER),
        counter,
        checkpoint,
        sub,
        pending,
        parents: strings(kcl::PARENTS),
        children: strings(kcl::CHILDREN),
        key,
    }))
}

/// A multi-stream lease key `account:stream:creationEpoch:shardId` into the stream identifier and
/// the shard; any other key is a single-stream table's shard id.
fn split_key(key: &str) -> (Option<String>, String) {
    let parts: Vec<&str> = key.split(':').collect();
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    match parts.as_slice() {
        [account, stream, epoch, shard]
            if digits(account) && !stream.is_empty() && digits(epoch) && !shard.is_empty() =>
        {
            (
                Some(format!("{account}:{stream}:{epoch}")),
                (*shard).to_owned(),
            )
        }
        _ => (None, key.to_owned()),
    }
}

/// The rows of `stream`: every row of a single-stream table (its rows name no stream), the rows
/// whose identifier names `stream` in a multi-stream one.
fn select(leases: Vec<KclLease>, stream: &str, table: &str) -> Result<Vec<KclLease>, String> {
    if leases.is_empty() {
        return Err(format!("the KCL table `{table}` has no leases"));
    }
    let (multi, single): (Vec<_>, Vec<_>) = leases.into_iter().partition(|l| l.stream_id.is_some());
    if !multi.is_empty() && !single.is_empty() {
        return Err(format!(
            "the KCL table `{table}` mixes multi-stream leases (`{}`) with single-stream ones \
             (`{}`); KCL writes one kind per table",
            multi[0].key, single[0].key
        ));
    }
    if multi.is_empty() {
        return Ok(single);
    }
    let streams: BTreeSet<String> = multi
        .iter()
        .filter_map(|l| l.stream_name().map(str::to_owned))
        .collect();
    let rows: Vec<KclLease> = multi
        .into_iter()
        .filter(|l| l.stream_name() == Some(stream))
        .collect();
    if rows.is_empty() {
        return Err(format!(
            "the KCL table `{table}` has no leases of stream `{stream}` (it is a multi-stream \
             table with leases of {})",
            streams
                .iter()
                .map(|s| format!("`{s}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let ids: BTreeSet<&str> = rows.iter().filter_map(|l| l.stream_id.as_deref()).collect();
    if ids.len() > 1 {
        return Err(format!(
            "the KCL table `{table}` has leases of {} streams named `{stream}` ({}: the stream was \
             deleted and created again); the import cannot tell which one `{stream}` is now",
            ids.len(),
            ids.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    Ok(rows)
}

/// The leases still held: an owner whose row changed (counter, owner or checkpoint) between the
/// two reads, or appeared in the second; by shard, with the owner.
fn held(first: &[KclLease], second: &[KclLease]) -> BTreeMap<String, String> {
    let before: HashMap<&str, &KclLease> = first.iter().map(|l| (l.key.as_str(), l)).collect();
    second
        .iter()
        .filter_map(|now| {
            let owner = now.owner.as_ref()?;
            let moved = before.get(now.key.as_str()).is_none_or(|was| {
                was.counter != now.counter
                    || was.owner != now.owner
                    || was.checkpoint != now.checkpoint
                    || was.sub != now.sub
            });
            moved.then(|| (now.shard_id.clone(), owner.clone()))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// What each row becomes

/// Why a row is not imported.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Problem {
    /// A KCL worker still holds the lease (`--force` overrides).
    Held { owner: String },
    /// KCL's row says AT_TIMESTAMP and the time is not in the table.
    NeedsTime,
    /// KCL's checkpoint is neither a sequence number nor a sentinel.
    Unreadable(String),
    /// The stream does not list the shard, or the sequence number is outside the shard's range
    /// (`--force` overrides).
    NotInStream(String),
    /// A shardwise row of the shard already has this checkpoint (`--force` overrides).
    HasCheckpoint(Checkpoint),
}

impl Problem {
    /// The STATE column.
    fn state(&self) -> &'static str {
        match self {
            Problem::Held { .. } => "held",
            Problem::NeedsTime => "needs-at-timestamp",
            Problem::Unreadable(_) => "unreadable",
            Problem::NotInStream(_) => "not-in-stream",
            Problem::HasCheckpoint(_) => "has-checkpoint",
        }
    }

    fn forced_away(&self, force: bool) -> bool {
        force
            && matches!(
                self,
                Problem::Held { .. } | Problem::NotInStream(_) | Problem::HasCheckpoint(_)
            )
    }

    fn explain(&self, shard: &str) -> String {
        match self {
            Problem::Held { owner } => format!(
                "{shard}: KCL worker `{owner}` still holds the lease (its leaseCounter moved); \
                 stop every KCL worker of the application first (or give --force)"
            ),
            Problem::NeedsTime => format!(
                "{shard}: KCL's checkpoint is AT_TIMESTAMP, whose time KCL keeps in the \
                 application's configuration (initialPositionInStream), not in the table; give \
                 it with --at-timestamp TIME"
            ),
            Problem::Unreadable(why) => format!("{shard}: {why}"),
            Problem::NotInStream(why) => format!("{shard}: {why} (or give --force)"),
            Problem::HasCheckpoint(at) => format!(
                "{shard}: the shardwise lease table already has a row with checkpoint {at}; \
                 give --force to overwrite it"
            ),
        }
    }
}

/// Where KCL's committed checkpoint puts a shardwise reader.
fn shardwise_checkpoint(
    lease: &KclLease,
    at_timestamp: Option<SystemTime>,
) -> Result<Checkpoint, Problem> {
    Ok(match lease.checkpoint.as_str() {
        "TRIM_HORIZON" => Checkpoint::TrimHorizon,
        "LATEST" => Checkpoint::Latest,
        "AT_TIMESTAMP" => Checkpoint::AtTimestamp(at_timestamp.ok_or(Problem::NeedsTime)?),
        "SHARD_END" => Checkpoint::ShardEnd,
        digits => {
            // KCL skips every record whose (sequence, sub-sequence) is at or below its checkpoint
            // (a plain record has sub-sequence 0); `At` means the same to shardwise's reader.
            let sequence = SequenceNumber::parse(digits).map_err(|_| {
                Problem::Unreadable(format!(
                    "KCL's checkpoint `{digits}` is neither a sequence number nor TRIM_HORIZON, \
                     LATEST, AT_TIMESTAMP or SHARD_END"
                ))
            })?;
            Checkpoint::At(Position::new(sequence, lease.sub))
        }
    })
}

/// A shard as the stream lists it: the first sequence number of its range. (Not the last: a closed
/// shard's ending sequence number is not always a record's, kinesis-mock gives 2^63 - 1.)
#[derive(Debug, Clone, PartialEq, Eq)]
struct Listed {
    first: SequenceNumber,
}

/// Whether `to` belongs to the listed shard: a shard the stream does not list, or a sequence
/// number before the shard's first, is the sign of another stream's table. An ended shard may
/// have aged out of the listing.
fn stream_problem(
    stream: &str,
    shard: &str,
    to: &Checkpoint,
    listed: &BTreeMap<String, Listed>,
) -> Option<Problem> {
    if to.is_shard_end() {
        return None;
    }
    let Some(range) = listed.get(shard) else {
        return Some(Problem::NotInStream(format!(
            "stream `{stream}` does not list this shard: is the KCL table another stream's, or \
             did the shard age out unread?"
        )));
    };
    let Checkpoint::At(p) = to else {
        return None;
    };
    let seq = p.sequence();
    (*seq < range.first).then(|| {
        Problem::NotInStream(format!(
            "sequence number {seq} is before the shard's first in stream `{stream}` ({}): is the \
             KCL table another stream's?",
            range.first
        ))
    })
}

/// One KCL row and what it becomes.
#[derive(Debug, Clone)]
struct Planned {
    lease: KclLease,
    /// The shardwise checkpoint, unless KCL's cannot be mapped.
    to: Option<Checkpoint>,
    /// The shardwise row of the shard, if there is one.
    existing: Option<Lease>,
    problems: Vec<Problem>,
}

impl Planned {
    /// The problems that stop the import (after `--force`).
    fn refusals(&self, force: bool) -> impl Iterator<Item = &Problem> {
        self.problems.iter().filter(move |p| !p.forced_away(force))
    }

    fn state(&self, force: bool) -> String {
        if let Some(problem) = self.refusals(force).next() {
            return problem.state().to_owned();
        }
        let overwrites = self
            .existing
            .as_ref()
            .is_some_and(|e| has_progress(&e.checkpoint));
        match (&self.to, overwrites) {
            (_, true) => "overwrite".to_owned(),
            (Some(Checkpoint::ShardEnd), _) => "ended".to_owned(),
            (Some(Checkpoint::At(_)), _) => "resume".to_owned(),
            _ => "start".to_owned(),
        }
    }
}

/// A shardwise checkpoint that records progress (not a start sentinel).
fn has_progress(checkpoint: &Checkpoint) -> bool {
    matches!(
        checkpoint,
        Checkpoint::At(_) | Checkpoint::Before(_) | Checkpoint::ShardEnd
    )
}

/// What each row of `leases` becomes, in write order (parents before children, then by shard).
fn plan(
    stream: &str,
    leases: Vec<KclLease>,
    held: &BTreeMap<String, String>,
    at_timestamp: Option<SystemTime>,
    listed: &BTreeMap<String, Listed>,
    existing: &[Lease],
) -> Vec<Planned> {
    let existing: HashMap<&str, &Lease> =
        existing.iter().map(|l| (l.shard_id.as_str(), l)).collect();
    let mut planned: Vec<Planned> = leases
        .into_iter()
        .map(|lease| {
            let mut problems = Vec::new();
            if let Some(owner) = held.get(&lease.shard_id) {
                problems.push(Problem::Held {
                    owner: owner.clone(),
                });
            }
            let to = match shardwise_checkpoint(&lease, at_timestamp) {
                Ok(to) => {
                    problems.extend(stream_problem(stream, &lease.shard_id, &to, listed));
                    Some(to)
                }
                Err(problem) => {
                    problems.push(problem);
                    None
                }
            };
            let row = existing.get(lease.shard_id.as_str()).map(|l| (*l).clone());
            if let Some(row) = row.as_ref().filter(|r| has_progress(&r.checkpoint)) {
                problems.push(Problem::HasCheckpoint(row.checkpoint.clone()));
            }
            Planned {
                lease,
                to,
                existing: row,
                problems,
            }
        })
        .collect();
    let generation = generations(&planned);
    planned.sort_by(|a, b| {
        (generation[&a.lease.shard_id], &a.lease.shard_id)
            .cmp(&(generation[&b.lease.shard_id], &b.lease.shard_id))
    });
    planned
}

/// Each shard's generation among the imported rows: 0 without an imported parent, else one more
/// than its highest parent's. Rows are written by generation, so no running worker sees a child
/// whose parent's row is not there yet.
fn generations(planned: &[Planned]) -> HashMap<String, usize> {
    let parents: HashMap<&str, &[String]> = planned
        .iter()
        .map(|p| (p.lease.shard_id.as_str(), p.lease.parents.as_slice()))
        .collect();
    let mut generation = HashMap::new();
    for shard in parents.keys() {
        let mut depth = 0;
        let mut level: Vec<&str> = vec![*shard];
        // Bounded by the number of rows, so a (corrupt) cycle cannot loop forever.
        while depth < parents.len() {
            let next: Vec<&str> = level
                .iter()
                .flat_map(|s| parents.get(s).copied().unwrap_or_default())
                .map(String::as_str)
                .filter(|p| parents.contains_key(p))
                .collect();
            if next.is_empty() {
                break;
            }
            depth += 1;
            level = next;
        }
        generation.insert((*shard).to_owned(), depth);
    }
    generation
}

// ---------------------------------------------------------------------------------------------
// Output

const HEADER: [&str; 7] = [
    "SHARD",
    "KCL CHECKPOINT",
    "SUB",
    "PENDING",
    "SHARDWISE CHECKPOINT",
    "PARENTS",
    "STATE",
];

/// A checkpoint as the table shows it (an AT_TIMESTAMP start with its time in RFC 3339).
fn render(checkpoint: &Checkpoint) -> String {
    match checkpoint {
        Checkpoint::AtTimestamp(t) => match jiff::Timestamp::try_from(*t) {
            Ok(t) => format!("AT_TIMESTAMP({t})"),
            Err(_) => checkpoint.to_string(),
        },
        other => other.to_string(),
    }
}

fn rows(planned: &[Planned], force: bool) -> Vec<Vec<String>> {
    planned
        .iter()
        .map(|p| {
            vec![
                p.lease.shard_id.clone(),
                p.lease.checkpoint.clone(),
                p.lease.sub.to_string(),
                p.lease
                    .pending
                    .as_ref()
                    .map_or_else(|| "-".to_owned(), |(seq, sub)| format!("{seq}.{sub}")),
                p.to.as_ref().map_or_else(|| "-".to_owned(), render),
                list_or_dash(&p.lease.parents),
                p.state(force),
            ]
        })
        .collect()
}

/// Lines under the table: what the mapping means, pending checkpoints left out, forced rows.
fn notes(planned: &[Planned], single_stream: bool, stream: &str, force: bool) -> Vec<String> {
    let mut notes = vec![
        "note: each shard's checkpoint is KCL's committed `checkpoint` (SEQ.SUB: every record up \
         to sub-record SUB of SEQ is done, as KCL counts it; the next record handled is the first \
         after it)"
            .to_owned(),
    ];
    if force {
        notes.push(
            "note: --force: the KCL table was read once; whether a KCL worker still holds a \
             lease was not checked"
                .to_owned(),
        );
    }
    if single_stream {
        notes.push(format!(
            "note: a single-stream KCL table does not name its stream: its rows are taken as \
             `{stream}`'s, each checked against the stream's shards"
        ));
    }
    for p in planned {
        if let Some((seq, sub)) = &p.lease.pending {
            notes.push(format!(
                "note: {}: KCL's pendingCheckpoint {seq}.{sub} was prepared but never committed, \
                 so it is not taken as done: the records after the committed checkpoint are \
                 handled again",
                p.lease.shard_id
            ));
        }
        if p.lease.checkpoint == "LATEST" {
            notes.push(format!(
                "note: {}: LATEST (KCL never checkpointed it): shardwise pins the tip when it \
                 first reads the shard",
                p.lease.shard_id
            ));
        }
        for problem in p.problems.iter().filter(|q| q.forced_away(force)) {
            notes.push(format!(
                "note: --force: {}",
                problem.explain(&p.lease.shard_id)
            ));
        }
    }
    notes
}

// ---------------------------------------------------------------------------------------------
// Calls

pub(crate) async fn run(args: Args, ctx: &Ctx) -> Result<()> {
    let lease_table = args.lease_table.clone().unwrap_or_else(|| args.app.clone());
    if lease_table == args.kcl_table {
        bail!(
            "the shardwise lease table would be the KCL table `{}` (both default to the \
             application's name); name another with --lease-table, or use another --app",
            args.kcl_table
        );
    }
    // Flags the library would refuse when creating the table: refused before anything is read.
    let options = args.table.options();
    options
        .validate()
        .map_err(|err| invalid_setting(&err, args.table.given(&err), TableFlags::source_of))?;
    let dynamodb = ctx.dynamodb();
    let context = || {
        format!(
            "cannot import KCL table `{}` for stream `{}`",
            args.kcl_table, args.stream
        )
    };
    check_kcl_table(&dynamodb, &args.kcl_table)
        .await
        .with_context(context)?;

    let first = read_kcl(&dynamodb, &args.kcl_table)
        .await
        .with_context(context)?;
    let first = select(first, &args.stream, &args.kcl_table).map_err(anyhow::Error::msg)?;
    let (leases, held) = if args.force {
        (first, BTreeMap::new())
    } else {
        eprintln!(
            "reading `{}` again in {} to see whether KCL still holds a lease (--failover-time)",
            args.kcl_table,
            humantime::format_duration(args.failover_time)
        );
        tokio::time::sleep(args.failover_time).await;
        let second = read_kcl(&dynamodb, &args.kcl_table)
            .await
            .with_context(context)?;
        let second = select(second, &args.stream, &args.kcl_table).map_err(anyhow::Error::msg)?;
        let held = held(&first, &second);
        (second, held)
    };
    let single_stream = leases.iter().all(|l| l.stream_id.is_none());

    let listed = list_shards(&ctx.kinesis(), &args.stream).await?;
    let store = DynamoDbLeaseStore::new(dynamodb.clone(), &lease_table);
    let existing = existing_rows(&dynamodb, &store, &lease_table, &args.stream)
        .await
        .with_context(context)?;
    let planned = plan(
        &args.stream,
        leases,
        &held,
        args.at_timestamp,
        &listed,
        &existing,
    );

    let mut out = table(&HEADER, &rows(&planned, args.force));
    out.extend(notes(&planned, single_stream, &args.stream, args.force));
    print_lines(out)?;

    let refusals: Vec<String> = planned
        .iter()
        .flat_map(|p| p.refusals(args.force).map(|r| r.explain(&p.lease.shard_id)))
        .collect();
    if !refusals.is_empty() {
        bail!(
            "import refused, nothing written:\n  {}",
            refusals.join("\n  ")
        );
    }
    if args.dry_run {
        print_lines([format!(
            "dry run: nothing written ({} rows of stream `{}` would go to lease table `{}`)",
            planned.len(),
            args.stream,
            lease_table
        )])?;
        return Ok(());
    }
    write(&store.table_options(options), &args.stream, &planned)
        .await
        .with_context(context)?;
    print_lines([format!(
        "imported {} rows of stream `{}` from KCL table `{}` into lease table `{}` (application \
         `{}`)",
        planned.len(),
        args.stream,
        args.kcl_table,
        lease_table,
        args.app
    )])?;
    Ok(())
}

fn dynamodb_error<E>(operation: &'static str, table: &str, err: E) -> shardwise::Error
where
    E: std::error::Error + Send + Sync + 'static,
{
    shardwise::Error::DynamoDb {
        operation,
        table: table.to_owned(),
        source: Box::new(err),
    }
}

/// DescribeTable; `None` when the table does not exist.
async fn describe(
    client: &aws_sdk_dynamodb::Client,
    table: &str,
) -> Result<Option<TableDescription>> {
    match client.describe_table().table_name(table).send().await {
        Ok(out) => Ok(out.table),
        Err(err)
            if err
                .as_service_error()
                .is_some_and(|e| e.is_resource_not_found_exception()) =>
        {
            Ok(None)
        }
        Err(err) => Err(dynamodb_error("DescribeTable", table, err).into()),
    }
}

/// The table exists with KCL's key: hash key `leaseKey` of type S, no sort key.
async fn check_kcl_table(client: &aws_sdk_dynamodb::Client, table: &str) -> Result<()> {
    let Some(desc) = describe(client, table).await? else {
        bail!("the KCL lease table `{table}` does not exist");
    };
    let keys: Vec<String> = desc
        .key_schema()
        .iter()
        .map(|k| format!("{} ({})", k.attribute_name(), k.key_type().as_str()))
        .collect();
    let hash_only = desc.key_schema().len() == 1
        && desc.key_schema()[0].key_type() == &KeyType::Hash
        && desc.key_schema()[0].attribute_name() == kcl::KEY;
    let string_key = desc
        .attribute_definitions()
        .iter()
        .any(|d| d.attribute_name() == kcl::KEY && d.attribute_type() == &ScalarAttributeType::S);
    if !hash_only || !string_key {
        bail!(
            "table `{table}` does not have KCL's lease schema (hash key `{}` of type S, no sort \
             key): its key is {}",
            kcl::KEY,
            keys.join(", ")
        );
    }
    Ok(())
}

/// Every KCL lease of the table, read consistently (KCL's other entities left out).
async fn read_kcl(client: &aws_sdk_dynamodb::Client, table: &str) -> Result<Vec<KclLease>> {
    let items = client
        .scan()
        .table_name(table)
        .consistent_read(true)
        .into_paginator()
        .items()
        .send()
        .try_collect()
        .await
        .map_err(|e| dynamodb_error("Scan", table, e))?;
    let mut leases = Vec::new();
    for item in &items {
        match parse_item(item) {
            Ok(Some(lease)) => leases.push(lease),
            Ok(None) => {}
            Err(why) => bail!("table `{table}` is not a KCL lease table: {why}"),
        }
    }
    leases.sort_by(|a, b| a.shard_id.cmp(&b.shard_id));
    Ok(leases)
}

/// The stream's shards with their sequence number ranges (ListShards, every page).
async fn list_shards(
    client: &aws_sdk_kinesis::Client,
    stream: &str,
) -> Result<BTreeMap<String, Listed>> {
    let mut listed = BTreeMap::new();
    for shard in crate::stream::list_shards(client, stream).await? {
        let Some(range) = shard.sequence_number_range() else {
            continue;
        };
        let first = SequenceNumber::parse(range.starting_sequence_number())
            .with_context(|| format!("ListShards of `{stream}`: shard {}", shard.shard_id()))?;
        listed.insert(shard.shard_id().to_owned(), Listed { first });
    }
    Ok(listed)
}

/// The shardwise rows of `stream`, without creating the table (none when it does not exist).
async fn existing_rows(
    client: &aws_sdk_dynamodb::Client,
    store: &DynamoDbLeaseStore,
    table: &str,
    stream: &str,
) -> Result<Vec<Lease>> {
    if describe(client, table).await?.is_none() {
        return Ok(Vec::new());
    }
    let reader = store.clone().create_if_missing(false);
    reader.prepare().await?;
    Ok(reader.list(stream).await?)
}

/// Creates the lease table if missing (as `consume` does, with `--billing-mode`, `--tag` and
/// `--point-in-time-recovery`, the last turned on for an existing table too) and writes every
/// row, parents first: a new row with its checkpoint and parents, an existing one moved by a seek
/// (the only write that sets the checkpoint of a row that exists); children as KCL recorded them.
async fn write(store: &DynamoDbLeaseStore, stream: &str, planned: &[Planned]) -> Result<()> {
    store.prepare().await?;
    for p in planned {
        let to =
            p.to.clone()
                .expect("a row without a checkpoint is refused before writing");
        let shard = &p.lease.shard_id;
        match &p.existing {
            None => {
                let created = store
                    .create(&NewLease {
                        stream: stream.to_owned(),
                        shard_id: shard.clone(),
                        checkpoint: to,
                        parents: p.lease.parents.clone(),
                    })
                    .await?;
                if !created {
                    bail!(
                        "{shard}: a shardwise row appeared while importing (a worker created \
                         it); run the import again"
                    );
                }
            }
            Some(seen) => {
                let moved = store
                    .seek(&[SeekMove {
                        seen: seen.clone(),
                        to,
                        progress: None,
                        skipped: seen.seek_skipped.clone(),
                    }])
                    .await?;
                if !moved {
                    bail!(
                        "{shard}: the shardwise row changed while importing (a seek ran); run \
                         the import again"
                    );
                }
            }
        }
        if !p.lease.children.is_empty() {
            store.set_children(stream, shard, &p.lease.children).await?;
        }
    }
    // Running workers of the application scan at their next beat.
    if let Err(e) = store.announce(stream).await {
        tracing::warn!(
            error = &e as &dyn std::error::Error,
            "announcing the imported rows failed; workers find them at their next scan"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use super::*;

    const SEQ: &str = "49590338271490256608559692538361571095921575989136588898";

    fn s(v: &str) -> AttributeValue {
        AttributeValue::S(v.to_owned())
    }

    fn n(v: u64) -> AttributeValue {
        AttributeValue::N(v.to_string())
    }

    fn item(pairs: &[(&str, AttributeValue)]) -> Item {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect()
    }

    fn lease(shard: &str, checkpoint: &str, sub: u64) -> KclLease {
        KclLease {
            key: shard.to_owned(),
            stream_id: None,
            shard_id: shard.to_owned(),
            owner: None,
            counter: 1,
            checkpoint: checkpoint.to_owned(),
            sub,
            pending: None,
            parents: Vec::new(),
            children: Vec::new(),
        }
    }

    fn at(seq: &str, sub: u64) -> Checkpoint {
        Checkpoint::At(Position::new(SequenceNumber::parse(seq).unwrap(), sub))
    }

    #[test]
    fn kcl_rows_are_read_with_their_pending_checkpoint_and_lineage() {
        let single = item(&[
            ("leaseKey", s("shardId-000000000002")),
            ("leaseOwner", s("worker-1")),
            ("leaseCounter", n(7)),
            ("checkpoint", s(SEQ)),
            ("checkpointSubSequenceNumber", n(3)),
            (
                "pendingCheckpoint",
                s("49590338271490256608559692538361571095921575989136588999"),
            ),
            ("pendingCheckpointSubSequenceNumber", n(1)),
            (
                "parentShardId",
                AttributeValue::Ss(vec!["shardId-000000000000".into()]),
            ),
            ("ownerSwitchesSinceCheckpoint", n(0)),
            ("entityType", s("LEASE")),
        ]);
        let read = parse_item(&single).unwrap().unwrap();
        assert_eq!(read.shard_id, "shardId-000000000002");
        assert_eq!(read.stream_id, None);
        assert_eq!(read.owner.as_deref(), Some("worker-1"));
        assert_eq!((read.counter, read.sub), (7, 3));
        assert_eq!(
            read.pending,
            Some((
                "49590338271490256608559692538361571095921575989136588999".into(),
                1
            ))
        );
        assert_eq!(read.parents, ["shardId-000000000000"]);

        // Multi-stream: the key names the stream; KCL 2.x rows have no entityType.
        let multi = item(&[
            (
                "leaseKey",
                s("123456789012:orders:1700000000:shardId-000000000001"),
            ),
            ("leaseCounter", n(0)),
            ("checkpoint", s("TRIM_HORIZON")),
            ("checkpointSubSequenceNumber", n(0)),
            ("streamName", s("123456789012:orders:1700000000")),
            ("shardId", s("shardId-000000000001")),
        ]);
        let read = parse_item(&multi).unwrap().unwrap();
        assert_eq!(
            read.stream_id.as_deref(),
            Some("123456789012:orders:1700000000")
        );
        assert_eq!(read.stream_name(), Some("orders"));
        assert_eq!(read.shard_id, "shardId-000000000001");
    }

    #[test]
    fn other_entities_are_skipped_and_foreign_rows_refused() {
        // KCL 3.x keeps coordinator state in the lease table under other entity types.
        let leader = item(&[("leaseKey", s("Leader")), ("entityType", s("LEADER"))]);
        assert_eq!(parse_item(&leader), Ok(None));
        // A shardwise table given as the KCL table.
        let ours = item(&[
            ("leaseKey", s("orders#shardId-000000000000")),
            ("leaseCounter", n(1)),
            ("ownerEpoch", n(1)),
            ("checkpoint", s("TRIM_HORIZON")),
        ]);
        assert!(
            parse_item(&ours)
                .unwrap_err()
                .contains("shardwise lease row")
        );
        // Some other table keyed by leaseKey.
        let other = item(&[("leaseKey", s("x")), ("leaseCounter", n(1))]);
        assert!(parse_item(&other).unwrap_err().contains("no `checkpoint`"));
        let bad = item(&[
            ("leaseKey", s("x")),
            ("leaseCounter", s("one")),
            ("checkpoint", s("LATEST")),
        ]);
        assert!(parse_item(&bad).unwrap_err().contains("not a number"));
    }

    #[test]
    fn keys_split_only_in_the_multi_stream_form() {
        let cases = [
            // (key, stream id, shard)
            ("shardId-000000000000", None, "shardId-000000000000"),
            (
                "123:orders:17:shardId-000000000003",
                Some("123:orders:17"),
                "shardId-000000000003",
            ),
            // Not digits where the account and epoch go: a single-stream key.
            ("abc:orders:17:shardId-1", None, "abc:orders:17:shardId-1"),
            ("1:orders:shardId-1", None, "1:orders:shardId-1"),
        ];
        for (key, id, shard) in cases {
            let (got_id, got_shard) = split_key(key);
            assert_eq!(
                (got_id.as_deref(), got_shard.as_str()),
                (id, shard),
                "{key}"
            );
        }
    }

    #[test]
    fn a_multi_stream_table_gives_the_rows_of_the_stream_asked_for() {
        let mut a = lease("shardId-000000000000", "TRIM_HORIZON", 0);
        a.key = "1:orders:17:shardId-000000000000".into();
        a.stream_id = Some("1:orders:17".into());
        let mut b = a.clone();
        b.key = "1:events:18:shardId-000000000000".into();
        b.stream_id = Some("1:events:18".into());
        let rows = select(vec![a.clone(), b.clone()], "orders", "t").unwrap();
        assert_eq!(rows, [a.clone()]);
        let none = select(vec![a.clone(), b.clone()], "payments", "t").unwrap_err();
        assert!(none.contains("no leases of stream `payments`"), "{none}");
        assert!(none.contains("`events`, `orders`"), "{none}");
        // The stream deleted and created again: two identifiers of one name.
        let mut again = a.clone();
        again.key = "1:orders:99:shardId-000000000000".into();
        again.stream_id = Some("1:orders:99".into());
        let err = select(vec![a.clone(), again], "orders", "t").unwrap_err();
        assert!(err.contains("2 streams named `orders`"), "{err}");
        // A single-stream table: every row, whatever the stream.
        let single = lease("shardId-000000000000", "LATEST", 0);
        assert_eq!(
            select(vec![single.clone()], "anything", "t").unwrap(),
            std::slice::from_ref(&single)
        );
        assert!(
            select(vec![a, single], "orders", "t")
                .unwrap_err()
                .contains("mixes")
        );
        assert!(
            select(Vec::new(), "orders", "t")
                .unwrap_err()
                .contains("has no leases")
        );
    }

    /// What a KCL checkpoint maps to.
    type Mapped = Result<Checkpoint, Problem>;

    #[test]
    fn checkpoints_map_to_the_same_next_record() {
        let t = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let cases: [(&str, u64, Option<SystemTime>, Mapped); 8] = [
            // Inside an aggregate: sub-records 0..=3 of SEQ are done, 4 is next, as for KCL.
            (SEQ, 3, None, Ok(at(SEQ, 3))),
            // A plain record (KCL writes sub-sequence 0): the next record after it.
            (SEQ, 0, None, Ok(at(SEQ, 0))),
            ("TRIM_HORIZON", 0, None, Ok(Checkpoint::TrimHorizon)),
            ("LATEST", 0, None, Ok(Checkpoint::Latest)),
            ("SHARD_END", 0, None, Ok(Checkpoint::ShardEnd)),
            // KCL's AT_TIMESTAMP time is in its configuration: the flag gives it.
            ("AT_TIMESTAMP", 0, Some(t), Ok(Checkpoint::AtTimestamp(t))),
            ("AT_TIMESTAMP", 0, None, Err(Problem::NeedsTime)),
            ("12x", 0, None, Err(Problem::Unreadable(String::new()))),
        ];
        for (checkpoint, sub, time, want) in cases {
            let got = shardwise_checkpoint(&lease("s", checkpoint, sub), time);
            match (&got, &want) {
                (Err(Problem::Unreadable(why)), Err(Problem::Unreadable(_))) => {
                    assert!(why.contains("`12x`"), "{why}");
                }
                _ => assert_eq!(got, want, "{checkpoint} {sub}"),
            }
        }
        // The sub-sequence orders inside one record, as KCL's ExtendedSequenceNumber does.
        assert!(at(SEQ, 3).sort_key() < at(SEQ, 4).sort_key());
    }

    #[test]
    fn a_lease_is_held_when_its_owner_moved_it_between_the_reads() {
        let owned = |shard: &str, owner: Option<&str>, counter: u64| KclLease {
            owner: owner.map(str::to_owned),
            counter,
            ..lease(shard, SEQ, 0)
        };
        let first = [
            owned("a", Some("w1"), 5),
            owned("b", Some("w1"), 9),
            owned("c", None, 2),
            owned("d", Some("w2"), 4),
        ];
        let second = [
            // Renewed: held.
            owned("a", Some("w1"), 6),
            // Still: the worker stopped (or died) and nobody took it.
            owned("b", Some("w1"), 9),
            // Taken in between: held by the taker.
            owned("c", Some("w3"), 3),
            // Released (no owner now): free.
            owned("d", None, 5),
            // New since the first read, already owned.
            owned("e", Some("w1"), 1),
        ];
        let got = held(&first, &second);
        let want: BTreeMap<String, String> = [("a", "w1"), ("c", "w3"), ("e", "w1")]
            .into_iter()
            .map(|(s, o)| (s.to_owned(), o.to_owned()))
            .collect();
        assert_eq!(got, want);
    }

    fn listed(first: &str) -> Listed {
        Listed {
            first: SequenceNumber::parse(first).unwrap(),
        }
    }

    #[test]
    fn rows_of_another_stream_are_told_apart() {
        let shards: BTreeMap<String, Listed> = [
            ("open".to_owned(), listed("100")),
            ("closed".to_owned(), listed("100")),
        ]
        .into_iter()
        .collect();
        let cases = [
            // (shard, checkpoint, refused)
            ("open", at("150", 2), false),
            ("open", at("99", 0), true),
            ("open", at("100", 0), false),
            ("closed", at("200", 0), false),
            ("open", Checkpoint::TrimHorizon, false),
            // Not listed: another stream's shard, or aged out unread.
            ("gone", Checkpoint::TrimHorizon, true),
            // An ended shard may have aged out of the listing.
            ("gone", Checkpoint::ShardEnd, false),
        ];
        for (shard, to, refused) in cases {
            let got = stream_problem("orders", shard, &to, &shards);
            assert_eq!(got.is_some(), refused, "{shard} {to}: {got:?}");
        }
    }

    fn existing(shard: &str, checkpoint: Checkpoint) -> Lease {
        Lease {
            stream: "orders".into(),
            shard_id: shard.into(),
            owner: None,
            counter: 0,
            owner_epoch: 0,
            checkpoint,
            parents: Vec::new(),
            children: Vec::new(),
            complete_through: None,
            seek_epoch: 0,
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
    fn the_plan_writes_parents_first_and_names_every_refusal() {
        let shards: BTreeMap<String, Listed> = ["p", "c1", "c2", "g", "other"]
            .into_iter()
            .map(|s| (s.to_owned(), listed("1")))
            .collect();
        let child = |shard: &str, parents: &[&str]| KclLease {
            parents: parents.iter().map(|p| (*p).to_owned()).collect(),
            ..lease(shard, "TRIM_HORIZON", 0)
        };
        let leases = vec![
            child("g", &["c1"]),
            child("c2", &["p"]),
            child("c1", &["p"]),
            lease("p", "50", 2),
            KclLease {
                pending: Some(("60".into(), 0)),
                ..lease("other", "40", 0)
            },
        ];
        let none = BTreeMap::new();
        let planned = plan("orders", leases.clone(), &none, None, &shards, &[]);
        let order: Vec<&str> = planned.iter().map(|p| p.lease.shard_id.as_str()).collect();
        assert_eq!(order, ["other", "p", "c1", "c2", "g"]);
        let states: Vec<String> = planned.iter().map(|p| p.state(false)).collect();
        assert_eq!(states, ["resume", "resume", "start", "start", "start"]);
        assert!(planned.iter().all(|p| p.refusals(false).next().is_none()));
        // The pending checkpoint is said to be left out.
        let lines = notes(&planned, true, "orders", false);
        assert!(
            lines
                .iter()
                .any(|l| l.contains("other: KCL's pendingCheckpoint 60.0")
                    && l.contains("not taken as done")),
            "{lines:?}"
        );

        // A held lease, a row with a checkpoint already, and a row at a start sentinel.
        let held: BTreeMap<String, String> = [("p".to_owned(), "w1".to_owned())].into();
        let rows = [
            existing("other", at("10", 0)),
            existing("c1", Checkpoint::TrimHorizon),
        ];
        let planned = plan("orders", leases, &held, None, &shards, &rows);
        let state = |shard: &str, force: bool| {
            planned
                .iter()
                .find(|p| p.lease.shard_id == shard)
                .unwrap()
                .state(force)
        };
        assert_eq!(state("p", false), "held");
        assert_eq!(state("other", false), "has-checkpoint");
        // A start sentinel is replaced without --force.
        assert_eq!(state("c1", false), "start");
        assert_eq!(state("p", true), "resume");
        assert_eq!(state("other", true), "overwrite");
        let refusals: Vec<String> = planned
            .iter()
            .flat_map(|p| p.refusals(false).map(|r| r.explain(&p.lease.shard_id)))
            .collect();
        assert_eq!(refusals.len(), 2, "{refusals:?}");
        assert!(
            refusals.iter().all(|r| r.contains("--force")),
            "{refusals:?}"
        );
        assert!(planned.iter().all(|p| p.refusals(true).next().is_none()));
    }

    #[test]
    fn an_at_timestamp_row_without_the_flag_is_refused_even_with_force() {
        let shards: BTreeMap<String, Listed> =
            [("s".to_owned(), listed("1"))].into_iter().collect();
        let rows = vec![lease("s", "AT_TIMESTAMP", 0)];
        let planned = plan("orders", rows.clone(), &BTreeMap::new(), None, &shards, &[]);
        assert_eq!(planned[0].state(true), "needs-at-timestamp");
        let why = planned[0].refusals(true).next().unwrap().explain("s");
        assert!(why.contains("--at-timestamp"), "{why}");
        let t = UNIX_EPOCH + Duration::from_millis(1_700_000_000_250);
        let planned = plan("orders", rows, &BTreeMap::new(), Some(t), &shards, &[]);
        assert_eq!(planned[0].state(false), "start");
        assert_eq!(
            rows_of(&planned)[0][4],
            "AT_TIMESTAMP(2023-11-14T22:13:20.25Z)"
        );
    }

    fn rows_of(planned: &[Planned]) -> Vec<Vec<String>> {
        rows(planned, false)
    }

    #[test]
    fn the_table_shows_kcls_values_beside_shardwises() {
        let shards: BTreeMap<String, Listed> =
            [("s".to_owned(), listed("1"))].into_iter().collect();
        let kcl = KclLease {
            pending: Some(("70".into(), 1)),
            parents: vec!["p".into()],
            ..lease("s", "50", 2)
        };
        let planned = plan("orders", vec![kcl], &BTreeMap::new(), None, &shards, &[]);
        let lines = table(&HEADER, &rows_of(&planned));
        assert_eq!(
            lines,
            [
                "SHARD  KCL CHECKPOINT  SUB  PENDING  SHARDWISE CHECKPOINT  PARENTS  STATE",
                "s      50              2    70.1     50.2                  p        resume",
            ]
        );
    }
}
