//! What every subcommand shares: the AWS configuration, the failure report, polling waits, and
//! output.

use std::error::Error as StdError;
use std::fmt;
use std::io::{self, Write};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::bail;
use aws_config::BehaviorVersion;
use aws_sdk_kinesis::error::{ProvideErrorMetadata, SdkError};
use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use serde::Serialize;

/// The result of a command.
pub(crate) type Result<T, E = anyhow::Error> = std::result::Result<T, E>;

/// Environment variables the tool reads, for `--help`.
pub(crate) const ENVIRONMENT_HELP: &str = "\
Environment:
  AWS_REGION                 The region to call (AWS_DEFAULT_REGION is read too); required
  AWS_PROFILE                The profile of ~/.aws/config and ~/.aws/credentials to use
  AWS_ACCESS_KEY_ID          The access key id of static credentials
  AWS_SECRET_ACCESS_KEY      The secret access key of static credentials
  AWS_SESSION_TOKEN          The session token of temporary credentials
  AWS_ENDPOINT_URL           One endpoint for every service (an emulator, LocalStack)
  AWS_ENDPOINT_URL_KINESIS   The Kinesis endpoint, before AWS_ENDPOINT_URL
  AWS_ENDPOINT_URL_DYNAMODB  The DynamoDB endpoint (lease tables), before AWS_ENDPOINT_URL
  AWS_EC2_METADATA_DISABLED  `true`: skip the EC2 instance metadata service (region, credentials)
  RUST_LOG                   What is logged to stderr (default `warn`), e.g. `shardwise=info,warn`";

/// The AWS configuration, from the standard environment only.
#[derive(Debug)]
pub(crate) struct Ctx {
    config: aws_config::SdkConfig,
}

impl Ctx {
    /// Loads the configuration the way every AWS SDK does (env, profile, IMDS, ...). Fails when it
    /// names no region: every command calls AWS.
    pub(crate) async fn load() -> Result<Self> {
        let config = aws_config::defaults(BehaviorVersion::latest()).load().await;
        if config.region().is_none() {
            bail!("no AWS region is configured: set AWS_REGION (or the region of an AWS_PROFILE)");
        }
        Ok(Self { config })
    }

    /// The loaded configuration.
    pub(crate) fn config(&self) -> &aws_config::SdkConfig {
        &self.config
    }

    /// A Kinesis client.
    pub(crate) fn kinesis(&self) -> aws_sdk_kinesis::Client {
        aws_sdk_kinesis::Client::new(&self.config)
    }

    /// A DynamoDB client.
    pub(crate) fn dynamodb(&self) -> aws_sdk_dynamodb::Client {
        aws_sdk_dynamodb::Client::new(&self.config)
    }
}

/// What is logged without `RUST_LOG`.
pub(crate) const DEFAULT_LOG_FILTER: &str = "warn";

/// Logs to stderr, filtered by `RUST_LOG` (default [`DEFAULT_LOG_FILTER`]).
pub(crate) fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(io::stderr);
    match format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().with_current_span(true).init(),
    }
}

/// `--log-format`: how log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    /// For people (the default).
    Text,
    /// One JSON object per line: timestamp, level, target, fields, spans.
    Json,
}

/// Prints `error: <message>` and every cause to stderr; the exit status for a failure.
///
/// A closed stdout (`shardwise ... | head`) is not a failure: the reader has what it wanted.
pub(crate) fn report(err: &anyhow::Error) -> ExitCode {
    if err.chain().any(is_broken_pipe) {
        return ExitCode::SUCCESS;
    }
    let _ = io::stderr().lock().write_all(render_report(err).as_bytes());
    ExitCode::FAILURE
}

fn is_broken_pipe(err: &(dyn StdError + 'static)) -> bool {
    err.downcast_ref::<io::Error>()
        .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
}

/// `error: <message>`, then one `  caused by: <message>` line per cause.
fn render_report(err: &anyhow::Error) -> String {
    let mut text = format!("error: {err}\n");
    let mut last = err.to_string();
    for cause in err.chain().skip(1) {
        let line = cause.to_string();
        // Some layers repeat their source's message; print each distinct message once.
        if line != last && !last.ends_with(&line) {
            text.push_str(&format!("  caused by: {line}\n"));
        }
        last = line;
    }
    text
}

/// Maps a failed Kinesis call to shardwise's error: a missing stream is
/// [`shardwise::Error::StreamNotFound`], anything else [`shardwise::Error::Kinesis`].
pub(crate) fn kinesis_error<E, R>(
    operation: &'static str,
    stream: &str,
    shard: Option<&str>,
    err: SdkError<E, R>,
) -> shardwise::Error
where
    E: ProvideErrorMetadata + StdError + Send + Sync + 'static,
    R: fmt::Debug + Send + Sync + 'static,
{
    if is_not_found(&err) {
        return shardwise::Error::StreamNotFound {
            stream: stream.to_owned(),
        };
    }
    shardwise::Error::Kinesis {
        operation,
        stream: stream.to_owned(),
        shard: shard.map(str::to_owned),
        source: Box::new(err),
    }
}

/// Whether a Kinesis call failed with `ResourceNotFoundException`.
pub(crate) fn is_not_found<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> bool {
    err.as_service_error()
        .and_then(ProvideErrorMetadata::code)
        .is_some_and(|code| code == "ResourceNotFoundException")
}

/// Waits between polls and between attempts: from `first`, doubling, capped at `max`, never
/// ending.
pub(crate) fn backoff(first: Duration, max: Duration) -> ExponentialBackoff {
    ExponentialBuilder::new()
        .with_min_delay(first)
        .with_max_delay(max)
        .with_factor(2.0)
        .without_max_times()
        .build()
}

/// Sleeps for the next of `delays`.
pub(crate) async fn pause(delays: &mut ExponentialBackoff) {
    if let Some(delay) = delays.next() {
        tokio::time::sleep(delay).await;
    }
}

/// Writes lines to stdout.
pub(crate) fn print_lines<I, S>(lines: I) -> io::Result<()>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let mut out = io::stdout().lock();
    for line in lines {
        out.write_all(line.as_ref().as_bytes())?;
        out.write_all(b"\n")?;
    }
    out.flush()
}

/// Writes each value to stdout as one line of JSON (fields in their declared order).
pub(crate) fn print_json_lines<I, T>(values: I) -> Result<()>
where
    I: IntoIterator<Item = T>,
    T: Serialize,
{
    let lines = values
        .into_iter()
        .map(|value| serde_json::to_string(&value))
        .collect::<Result<Vec<_>, _>>()?;
    print_lines(lines)?;
    Ok(())
}

/// Renders rows under a header as left-aligned columns separated by two spaces.
pub(crate) fn table(header: &[&str], rows: &[Vec<String>]) -> Vec<String> {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let render = |cells: &mut dyn Iterator<Item = &str>| {
        let mut line = String::new();
        for (i, cell) in cells.enumerate() {
            if i > 0 {
                line.push_str("  ");
            }
            line.push_str(cell);
            let pad = widths[i].saturating_sub(cell.chars().count());
            line.extend(std::iter::repeat_n(' ', pad));
        }
        line.trim_end().to_owned()
    };
    let mut lines = vec![render(&mut header.iter().copied())];
    lines.extend(
        rows.iter()
            .map(|row| render(&mut row.iter().map(String::as_str))),
    );
    lines
}

/// A comma-separated list, or `-` when empty.
pub(crate) fn list_or_dash(items: &[String]) -> String {
    if items.is_empty() {
        "-".to_owned()
    } else {
        items.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn tables_align_columns() {
        let rows = vec![
            vec!["a".to_owned(), "long cell".to_owned(), "z".to_owned()],
            vec!["bbbb".to_owned(), "c".to_owned(), String::new()],
        ];
        let lines = table(&["H1", "H2", "H3"], &rows);
        assert_eq!(
            lines,
            vec!["H1    H2         H3", "a     long cell  z", "bbbb  c"]
        );
    }

    #[test]
    fn the_report_lists_causes_once() {
        let inner: Result<()> = Err(anyhow::anyhow!("inner"));
        let err = inner.context("middle: inner").context("outer").unwrap_err();
        assert_eq!(
            render_report(&err),
            "error: outer\n  caused by: middle: inner\n"
        );
        // A cause that repeats the message before it is printed once.
        let err = anyhow::anyhow!("same").context("same").context("top");
        assert_eq!(render_report(&err), "error: top\n  caused by: same\n");
        let err = anyhow::anyhow!("no such table");
        assert_eq!(render_report(&err), "error: no such table\n");
    }

    #[test]
    fn a_broken_pipe_anywhere_in_the_chain_is_found() {
        let pipe = anyhow::Error::from(io::Error::from(io::ErrorKind::BrokenPipe));
        assert!(pipe.chain().any(is_broken_pipe));
        let wrapped = pipe.context("printing the leases").context("leases");
        assert!(wrapped.chain().any(is_broken_pipe));
        let other = anyhow::Error::from(io::Error::from(io::ErrorKind::NotFound));
        assert!(!other.chain().any(is_broken_pipe));
    }

    #[test]
    fn waits_double_up_to_the_cap() {
        let waits: Vec<u64> = backoff(Duration::from_millis(25), Duration::from_secs(1))
            .take(8)
            .map(|d| d.as_millis() as u64)
            .collect();
        assert_eq!(waits, [25, 50, 100, 200, 400, 800, 1000, 1000]);
    }
}
