//! `shardwise stream ...`: create, split, merge, describe and delete streams.
//!
//! Every command that changes the stream waits for it to settle (DescribeStreamSummary until
//! `ACTIVE`, and for a split or merge until ListShards shows the children), so the next command
//! of a script sees the result.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use aws_sdk_kinesis::Client;
use aws_sdk_kinesis::types::{Shard, StreamStatus};
use backon::ExponentialBackoff;
use serde::Serialize;

use crate::common::{
    Ctx, Result, backoff, is_not_found, kinesis_error, list_or_dash, pause, print_json_lines,
    print_lines, table,
};

#[derive(Debug, clap::Subcommand)]
pub(crate) enum Command {
    /// Create a stream and wait until it is ACTIVE.
    Create {
        /// The stream's name.
        stream: String,
        /// How many shards it starts with.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(i32).range(1..))]
        shards: i32,
        #[command(flatten)]
        wait: Wait,
    },
    /// Split an open shard at the midpoint of its hash key range and wait for the two children.
    Split {
        /// The stream.
        stream: String,
        /// The shard to split (`shardId-000000000003`, or just `3`).
        shard: String,
        #[command(flatten)]
        wait: Wait,
    },
    /// Merge two open shards with adjacent hash key ranges and wait for the child.
    Merge {
        /// The stream.
        stream: String,
        /// One shard (`shardId-000000000003`, or just `3`).
        shard: String,
        /// The shard whose hash key range adjoins the first one's.
        adjacent: String,
        #[command(flatten)]
        wait: Wait,
    },
    /// Delete a stream and wait until it is gone.
    Delete {
        /// The stream.
        stream: String,
        /// Also delete the stream's registered enhanced fan-out consumers.
        #[arg(long)]
        enforce_consumer_deletion: bool,
        #[command(flatten)]
        wait: Wait,
    },
    /// Deregister an enhanced fan-out consumer (`consume --efo` registers one and never removes
    /// it) and wait until it is gone. Its subscriptions end; a consumer still running with
    /// --efo under that name fails its reads until it is stopped.
    DeregisterConsumer {
        /// The stream.
        stream: String,
        /// The consumer's name (`consume --efo` uses --consumer-name, or --app).
        #[arg(long, value_name = "NAME")]
        consumer_name: String,
        #[command(flatten)]
        wait: Wait,
    },
    /// Show a stream's shards: id, open or closed, parents, hash key range.
    Describe {
        /// The stream.
        stream: String,
        /// One JSON object per shard, one per line.
        #[arg(long)]
        json: bool,
    },
}

/// How long a command waits for the stream to settle.
#[derive(Debug, clap::Args)]
pub(crate) struct Wait {
    /// Give up waiting for the stream to become ACTIVE (or gone) after this many seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 300)]
    timeout: u64,
}

impl Wait {
    fn deadline(&self) -> Deadline {
        Deadline {
            at: Instant::now() + Duration::from_secs(self.timeout),
            seconds: self.timeout,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Deadline {
    at: Instant,
    seconds: u64,
}

impl Deadline {
    fn passed(&self) -> bool {
        Instant::now() >= self.at
    }
}

pub(crate) async fn run(command: Command, ctx: &Ctx) -> Result<()> {
    let client = ctx.kinesis();
    match command {
        Command::Create {
            stream,
            shards,
            wait,
        } => create(&client, &stream, shards, wait.deadline()).await,
        Command::Split {
            stream,
            shard,
            wait,
        } => split(&client, &stream, &shard_id(&shard), wait.deadline()).await,
        Command::Merge {
            stream,
            shard,
            adjacent,
            wait,
        } => {
            let (shard, adjacent) = (shard_id(&shard), shard_id(&adjacent));
            merge(&client, &stream, &shard, &adjacent, wait.deadline()).await
        }
        Command::Delete {
            stream,
            enforce_consumer_deletion,
            wait,
        } => delete(&client, &stream, enforce_consumer_deletion, wait.deadline()).await,
        Command::Describe { stream, json } => describe(&client, &stream, json).await,
        Command::DeregisterConsumer {
            stream,
            consumer_name,
            wait,
        } => deregister_consumer(&client, &stream, &consumer_name, wait.deadline()).await,
    }
}

async fn deregister_consumer(
    client: &Client,
    stream: &str,
    name: &str,
    deadline: Deadline,
) -> Result<()> {
    let stream_arn = client
        .describe_stream_summary()
        .stream_name(stream)
        .send()
        .await
        .map_err(|e| kinesis_error("DescribeStreamSummary", stream, None, e))?
        .stream_description_summary
        .map(|s| s.stream_arn)
        .context("DescribeStreamSummary answered without a description")?;
    client
        .deregister_stream_consumer()
        .stream_arn(&stream_arn)
        .consumer_name(name)
        .send()
        .await
        .map_err(|e| {
            if is_not_found(&e) {
                anyhow::anyhow!("stream `{stream}` has no consumer named `{name}`")
            } else {
                kinesis_error("DeregisterStreamConsumer", stream, None, e).into()
            }
        })?;
    let mut delays = poll_backoff();
    loop {
        match client
            .describe_stream_consumer()
            .stream_arn(&stream_arn)
            .consumer_name(name)
            .send()
            .await
        {
            Err(e) if is_not_found(&e) => break,
            Err(e) => return Err(kinesis_error("DescribeStreamConsumer", stream, None, e).into()),
            Ok(_) if deadline.passed() => bail!(
                "consumer `{name}` of stream `{stream}` is still there after {} s",
                deadline.seconds
            ),
            Ok(_) => pause(&mut delays).await,
        }
    }
    print_lines([format!("deregistered consumer {name} of stream {stream}")])?;
    Ok(())
}

async fn create(client: &Client, stream: &str, shards: i32, deadline: Deadline) -> Result<()> {
    client
        .create_stream()
        .stream_name(stream)
        .shard_count(shards)
        .send()
        .await
        .map_err(|e| kinesis_error("CreateStream", stream, None, e))?;
    // Right after CreateStream the stream may not be visible yet.
    wait_active(client, stream, deadline, true).await?;
    print_lines([format!(
        "created stream {stream} with {shards} shards (ACTIVE)"
    )])?;
    Ok(())
}

async fn split(client: &Client, stream: &str, shard: &str, deadline: Deadline) -> Result<()> {
    let shards = list_shards(client, stream).await?;
    let target = open_shard(&shards, stream, shard)?;
    let (start, end) = hash_range(target, stream)?;
    let Some(at) = split_point(start, end) else {
        bail!("shard `{shard}` of stream `{stream}` covers a single hash key and cannot be split");
    };
    client
        .split_shard()
        .stream_name(stream)
        .shard_to_split(shard)
        .new_starting_hash_key(at.to_string())
        .send()
        .await
        .map_err(|e| kinesis_error("SplitShard", stream, Some(shard), e))?;
    let children = wait_for_children(client, stream, deadline, 2, |s| {
        s.parent_shard_id() == Some(shard) && s.adjacent_parent_shard_id().is_none()
    })
    .await?;
    let names: Vec<String> = children.iter().map(|s| s.shard_id().to_owned()).collect();
    print_lines([format!(
        "split {shard} of stream {stream} at hash key {at} into {}",
        names.join(" and ")
    )])?;
    Ok(())
}

async fn merge(
    client: &Client,
    stream: &str,
    shard: &str,
    adjacent: &str,
    deadline: Deadline,
) -> Result<()> {
    let shards = list_shards(client, stream).await?;
    let (a, b) = (
        hash_range(open_shard(&shards, stream, shard)?, stream)?,
        hash_range(open_shard(&shards, stream, adjacent)?, stream)?,
    );
    if a.1.checked_add(1) != Some(b.0) && b.1.checked_add(1) != Some(a.0) {
        bail!(
            "shards `{shard}` ({}..{}) and `{adjacent}` ({}..{}) of stream `{stream}` are not \
             adjacent: their hash key ranges must adjoin",
            a.0,
            a.1,
            b.0,
            b.1
        );
    }
    client
        .merge_shards()
        .stream_name(stream)
        .shard_to_merge(shard)
        .adjacent_shard_to_merge(adjacent)
        .send()
        .await
        .map_err(|e| kinesis_error("MergeShards", stream, Some(shard), e))?;
    let children = wait_for_children(client, stream, deadline, 1, |s| {
        let parents = [s.parent_shard_id(), s.adjacent_parent_shard_id()];
        parents.contains(&Some(shard)) && parents.contains(&Some(adjacent))
    })
    .await?;
    print_lines([format!(
        "merged {shard} and {adjacent} of stream {stream} into {}",
        children[0].shard_id()
    )])?;
    Ok(())
}

async fn delete(
    client: &Client,
    stream: &str,
    enforce_consumer_deletion: bool,
    deadline: Deadline,
) -> Result<()> {
    client
        .delete_stream()
        .stream_name(stream)
        .enforce_consumer_deletion(enforce_consumer_deletion)
        .send()
        .await
        .map_err(|e| kinesis_error("DeleteStream", stream, None, e))?;
    let mut delays = poll_backoff();
    loop {
        match client
            .describe_stream_summary()
            .stream_name(stream)
            .send()
            .await
        {
            Err(err) if is_not_found(&err) => break,
            Err(err) => {
                return Err(kinesis_error("DescribeStreamSummary", stream, None, err).into());
            }
            Ok(_) if deadline.passed() => {
                bail!(
                    "stream `{stream}` was still there {} s after DeleteStream",
                    deadline.seconds
                );
            }
            Ok(_) => pause(&mut delays).await,
        }
    }
    print_lines([format!("deleted stream {stream}")])?;
    Ok(())
}

async fn describe(client: &Client, stream: &str, as_json: bool) -> Result<()> {
    let shards = list_shards(client, stream).await?;
    let mut described = Vec::with_capacity(shards.len());
    for shard in &shards {
        described.push(Described::of(shard, stream)?);
    }
    if as_json {
        print_json_lines(described.iter().map(|d| d.json(stream)))?;
    } else {
        let rows: Vec<Vec<String>> = described
            .iter()
            .map(|d| {
                vec![
                    d.id.clone(),
                    d.state().to_owned(),
                    list_or_dash(&d.parents),
                    d.hash.0.to_string(),
                    d.hash.1.to_string(),
                ]
            })
            .collect();
        print_lines(table(
            &["SHARD", "STATE", "PARENTS", "HASH_START", "HASH_END"],
            &rows,
        ))?;
    }
    Ok(())
}

/// One shard as `describe --json` prints it.
#[derive(Debug, Serialize)]
struct ShardJson<'a> {
    stream: &'a str,
    shard: &'a str,
    state: &'static str,
    parents: &'a [String],
    hash_start: String,
    hash_end: String,
    starting_sequence: Option<&'a str>,
    ending_sequence: Option<&'a str>,
}

/// One shard as `describe` shows it.
#[derive(Debug)]
struct Described {
    id: String,
    parents: Vec<String>,
    hash: (u128, u128),
    starting_sequence: Option<String>,
    ending_sequence: Option<String>,
}

impl Described {
    fn of(shard: &Shard, stream: &str) -> Result<Self> {
        Ok(Self {
            id: shard.shard_id().to_owned(),
            parents: parents(shard),
            hash: hash_range(shard, stream)?,
            starting_sequence: shard
                .sequence_number_range()
                .map(|r| r.starting_sequence_number().to_owned()),
            ending_sequence: ending_sequence(shard).map(str::to_owned),
        })
    }

    fn state(&self) -> &'static str {
        if self.ending_sequence.is_some() {
            "closed"
        } else {
            "open"
        }
    }

    fn json<'a>(&'a self, stream: &'a str) -> ShardJson<'a> {
        ShardJson {
            stream,
            shard: &self.id,
            state: self.state(),
            parents: &self.parents,
            hash_start: self.hash.0.to_string(),
            hash_end: self.hash.1.to_string(),
            starting_sequence: self.starting_sequence.as_deref(),
            ending_sequence: self.ending_sequence.as_deref(),
        }
    }
}

fn parents(shard: &Shard) -> Vec<String> {
    shard
        .parent_shard_id()
        .into_iter()
        .chain(shard.adjacent_parent_shard_id())
        .map(str::to_owned)
        .collect()
}

fn ending_sequence(shard: &Shard) -> Option<&str> {
    shard
        .sequence_number_range()
        .and_then(|r| r.ending_sequence_number())
}

/// `3` means `shardId-000000000003`; anything else is taken as given.
fn shard_id(arg: &str) -> String {
    match arg.parse::<u64>() {
        Ok(n) if !arg.is_empty() && arg.bytes().all(|b| b.is_ascii_digit()) => {
            format!("shardId-{n:012}")
        }
        _ => arg.to_owned(),
    }
}

/// Every shard of the stream (ListShards, following pagination).
pub(crate) async fn list_shards(client: &Client, stream: &str) -> Result<Vec<Shard>> {
    let mut shards = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let request = match &token {
            Some(t) => client.list_shards().next_token(t),
            None => client.list_shards().stream_name(stream),
        };
        let page = request
            .send()
            .await
            .map_err(|e| kinesis_error("ListShards", stream, None, e))?;
        shards.extend(page.shards().iter().cloned());
        match page.next_token() {
            Some(t) => token = Some(t.to_owned()),
            None => return Ok(shards),
        }
    }
}

/// The named shard, which must exist and be open.
fn open_shard<'a>(shards: &'a [Shard], stream: &str, id: &str) -> Result<&'a Shard> {
    let Some(shard) = shards.iter().find(|s| s.shard_id() == id) else {
        let known: Vec<String> = shards.iter().map(|s| s.shard_id().to_owned()).collect();
        bail!(
            "stream `{stream}` has no shard `{id}` (its shards: {})",
            list_or_dash(&known)
        );
    };
    if ending_sequence(shard).is_some() {
        bail!("shard `{id}` of stream `{stream}` is closed; only open shards can be resharded");
    }
    Ok(shard)
}

/// The shard's hash key range as numbers (Kinesis sends 128-bit decimal strings).
fn hash_range(shard: &Shard, stream: &str) -> Result<(u128, u128)> {
    let parse = |value: &str| {
        value.parse::<u128>().with_context(|| {
            format!(
                "shard `{}` of stream `{stream}` has the hash key `{value}`, which is not a \
                 128-bit number",
                shard.shard_id()
            )
        })
    };
    let Some(range) = shard.hash_key_range() else {
        bail!(
            "shard `{}` of stream `{stream}` has no hash key range",
            shard.shard_id()
        );
    };
    Ok((
        parse(range.starting_hash_key())?,
        parse(range.ending_hash_key())?,
    ))
}

/// The first hash key of the upper half of `start..=end`: the upper child covers `at..=end`
/// and the lower one `start..=at - 1`. `None` when the range holds a single key.
fn split_point(start: u128, end: u128) -> Option<u128> {
    // (end - start) / 2 + 1 never overflows, unlike (start + end + 1) / 2 on the full range.
    (end > start).then(|| start + (end - start) / 2 + 1)
}

/// Waits between DescribeStreamSummary and ListShards polls.
fn poll_backoff() -> ExponentialBackoff {
    backoff(Duration::from_millis(25), Duration::from_secs(1))
}

/// Polls DescribeStreamSummary until the stream is ACTIVE. With `missing_ok` a stream that is
/// not visible yet (just created) is waited for rather than an error.
async fn wait_active(
    client: &Client,
    stream: &str,
    deadline: Deadline,
    missing_ok: bool,
) -> Result<()> {
    let mut delays = poll_backoff();
    loop {
        let status = match client
            .describe_stream_summary()
            .stream_name(stream)
            .send()
            .await
        {
            Ok(out) => out
                .stream_description_summary()
                .map(|s| s.stream_status().clone()),
            Err(err) if missing_ok && is_not_found(&err) => None,
            Err(err) => {
                return Err(kinesis_error("DescribeStreamSummary", stream, None, err).into());
            }
        };
        match &status {
            Some(StreamStatus::Active) => return Ok(()),
            Some(StreamStatus::Deleting) => bail!("stream `{stream}` is being deleted"),
            _ => {}
        }
        if deadline.passed() {
            let seen = status.map_or("not visible".to_owned(), |s| s.as_str().to_owned());
            bail!(
                "stream `{stream}` did not become ACTIVE within {} s (last status: {seen})",
                deadline.seconds
            );
        }
        pause(&mut delays).await;
    }
}

/// Waits until the stream is ACTIVE and ListShards shows `expected` shards matching `is_child`.
async fn wait_for_children(
    client: &Client,
    stream: &str,
    deadline: Deadline,
    expected: usize,
    is_child: impl Fn(&Shard) -> bool,
) -> Result<Vec<Shard>> {
    let mut delays = poll_backoff();
    loop {
        wait_active(client, stream, deadline, false).await?;
        let children: Vec<Shard> = list_shards(client, stream)
            .await?
            .into_iter()
            .filter(|s| is_child(s))
            .collect();
        if children.len() >= expected {
            return Ok(children);
        }
        if deadline.passed() {
            bail!(
                "stream `{stream}` is ACTIVE but shows {} of the {expected} new shards after {} s",
                children.len(),
                deadline.seconds
            );
        }
        pause(&mut delays).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_split_point_halves_the_range() {
        assert_eq!(split_point(0, u128::MAX), Some(1 << 127));
        assert_eq!(split_point(0, 1), Some(1));
        assert_eq!(split_point(4, 5), Some(5));
        assert_eq!(split_point(0, 2), Some(2));
        assert_eq!(split_point(7, 7), None);
        let (start, end) = (1u128 << 126, u128::MAX);
        let at = split_point(start, end).unwrap();
        assert!(start < at && at <= end);
        // Halves differ in size by at most one key.
        assert!((at - start).abs_diff(end - at + 1) <= 1);
    }

    #[test]
    fn short_shard_ids_expand() {
        assert_eq!(shard_id("3"), "shardId-000000000003");
        assert_eq!(shard_id("shardId-000000000003"), "shardId-000000000003");
        assert_eq!(shard_id("+3"), "+3");
    }

    #[test]
    fn json_shards_keep_their_fields_and_order() {
        let described =
            |parents: &[&str], starting: Option<&str>, ending: Option<&str>| Described {
                id: "shardId-000000000002".into(),
                parents: parents.iter().map(|p| (*p).to_owned()).collect(),
                hash: (0, u128::MAX),
                starting_sequence: starting.map(str::to_owned),
                ending_sequence: ending.map(str::to_owned),
            };
        let json = |d: &Described| serde_json::to_string(&d.json("s")).unwrap();
        assert_eq!(
            json(&described(&["shardId-000000000000"], Some("4959"), None)),
            r#"{"stream":"s","shard":"shardId-000000000002","state":"open","parents":["shardId-000000000000"],"hash_start":"0","hash_end":"340282366920938463463374607431768211455","starting_sequence":"4959","ending_sequence":null}"#
        );
        assert_eq!(
            json(&described(&[], None, Some("5000"))),
            r#"{"stream":"s","shard":"shardId-000000000002","state":"closed","parents":[],"hash_start":"0","hash_end":"340282366920938463463374607431768211455","starting_sequence":null,"ending_sequence":"5000"}"#
        );
    }
}
