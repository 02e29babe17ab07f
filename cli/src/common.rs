//! What every subcommand shares: the AWS configuration, errors and their report, and output.

use std::error::Error as StdError;
use std::fmt;
use std::io::{self, Write};
use std::process::ExitCode;
use std::time::Duration;

use aws_config::BehaviorVersion;
use aws_sdk_kinesis::error::{ProvideErrorMetadata, SdkError};
use serde_json::Value;

/// Any error a command can fail with.
pub(crate) type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// The result of a command.
pub(crate) type Result<T, E = BoxError> = std::result::Result<T, E>;

/// The AWS configuration, from the standard environment only.
#[derive(Debug)]
pub(crate) struct Ctx {
    config: aws_config::SdkConfig,
}

impl Ctx {
    /// Loads the configuration the way every AWS SDK does (env, profile, IMDS, ...).
    pub(crate) async fn load() -> Self {
        let config = aws_config::defaults(BehaviorVersion::latest()).load().await;
        Self { config }
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

/// Logs to stderr, filtered by `RUST_LOG` (default `warn`).
pub(crate) fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(io::stderr)
        .init();
}

/// An error with a message of its own and, optionally, the error that caused it.
#[derive(Debug)]
pub(crate) struct Failure {
    message: String,
    source: Option<BoxError>,
}

impl Failure {
    /// An error that is its own cause.
    pub(crate) fn msg(message: impl Into<String>) -> BoxError {
        Box::new(Self {
            message: message.into(),
            source: None,
        })
    }

    /// An error explaining `source`.
    pub(crate) fn caused_by(message: impl Into<String>, source: impl Into<BoxError>) -> BoxError {
        Box::new(Self {
            message: message.into(),
            source: Some(source.into()),
        })
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl StdError for Failure {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}

/// Prints `error: <message>` and every cause to stderr; the exit status for a failure.
///
/// A closed stdout (`shardwise ... | head`) is not a failure: the reader has what it wanted.
pub(crate) fn report(err: &BoxError) -> ExitCode {
    if chain(err.as_ref()).any(|e| {
        e.downcast_ref::<io::Error>()
            .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
    }) {
        return ExitCode::SUCCESS;
    }
    let _ = io::stderr()
        .lock()
        .write_all(render_report(err.as_ref()).as_bytes());
    ExitCode::FAILURE
}

/// `error: <message>`, then one `  caused by: <message>` line per cause.
fn render_report(err: &(dyn StdError + 'static)) -> String {
    let mut text = format!("error: {err}\n");
    let mut last = err.to_string();
    for cause in chain(err).skip(1) {
        let line = cause.to_string();
        // Some layers repeat their source's message; print each distinct message once.
        if line != last && !last.ends_with(&line) {
            text.push_str(&format!("  caused by: {line}\n"));
        }
        last = line;
    }
    text
}

fn chain<'a>(
    err: &'a (dyn StdError + 'static),
) -> impl Iterator<Item = &'a (dyn StdError + 'static)> {
    std::iter::successors(Some(err), |e: &&'a (dyn StdError + 'static)| (*e).source())
}

/// Maps a failed Kinesis call to shardwise's error: a missing stream is
/// [`shardwise::Error::StreamNotFound`], anything else [`shardwise::Error::Kinesis`].
pub(crate) fn kinesis_error<E, R>(
    operation: &'static str,
    stream: &str,
    shard: Option<&str>,
    err: SdkError<E, R>,
) -> BoxError
where
    E: ProvideErrorMetadata + StdError + Send + Sync + 'static,
    R: fmt::Debug + Send + Sync + 'static,
{
    if is_not_found(&err) {
        return Box::new(shardwise::Error::StreamNotFound {
            stream: stream.to_owned(),
        });
    }
    Box::new(shardwise::Error::Kinesis {
        operation,
        stream: stream.to_owned(),
        shard: shard.map(str::to_owned),
        source: Box::new(err),
    })
}

/// Whether a Kinesis call failed with `ResourceNotFoundException`.
pub(crate) fn is_not_found<E: ProvideErrorMetadata, R>(err: &SdkError<E, R>) -> bool {
    err.as_service_error()
        .and_then(ProvideErrorMetadata::code)
        .is_some_and(|code| code == "ResourceNotFoundException")
}

/// Reads an RFC 3339 time such as `2026-11-29T21:37:00Z`.
pub(crate) fn parse_rfc3339(text: &str) -> std::result::Result<std::time::SystemTime, String> {
    use aws_sdk_kinesis::primitives::{DateTime, DateTimeFormat};
    let t = DateTime::from_str(text, DateTimeFormat::DateTime)
        .map_err(|e| format!("`{text}` is not an RFC 3339 time: {e}"))?;
    std::time::SystemTime::try_from(t).map_err(|e| format!("`{text}`: {e}"))
}

/// A JSON object with its fields in the order given (serde_json's map would sort them).
pub(crate) fn json_object(fields: &[(&str, Value)]) -> String {
    let body = fields
        .iter()
        .map(|(name, value)| format!("{}:{value}", Value::from(*name)))
        .collect::<Vec<_>>()
        .join(",");
    format!("{{{body}}}")
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

/// Polling delays: start short, double, cap.
#[derive(Debug)]
pub(crate) struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    pub(crate) fn new(first: Duration, max: Duration) -> Self {
        Self { next: first, max }
    }

    /// Sleeps for the current delay and doubles it (up to the cap).
    pub(crate) async fn wait(&mut self) {
        tokio::time::sleep(self.next).await;
        self.next = (self.next * 2).min(self.max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_objects_keep_field_order() {
        let line = json_object(&[("b", json!(1)), ("a", json!("x\"y")), ("c", json!([1, 2]))]);
        assert_eq!(line, r#"{"b":1,"a":"x\"y","c":[1,2]}"#);
        let parsed: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(parsed["a"], "x\"y");
    }

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
        let err = Failure::caused_by(
            "outer",
            Failure::caused_by("middle: inner", Failure::msg("inner")),
        );
        assert_eq!(
            render_report(err.as_ref()),
            "error: outer\n  caused by: middle: inner\n"
        );
    }
}
