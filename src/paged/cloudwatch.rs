//! CloudWatch Logs as a paged source: one partition per log stream of a log group, read forward with
//! `GetLogEvents` and its `nextForwardToken`.
//!
//! `GetLogEvents` gives no event identity. An event is named by what the service stores with it:
//! its timestamp, its ingestion time, and its occurrence `k` among the events of the stream with the
//! same two (a batch of `PutLogEvents` may hold several). Its position orders by the same three
//! numbers. Counting `k` across a page boundary needs the last event before the boundary, so this
//! source's cursor carries it beside the service's token, in bytes of its own:
//!
//! ```text
//! v1|<start time ms, or empty>|<timestamp>|<ingestion time>|<k>|<forward token>
//! ```
//!
//! shardwise never looks inside (cursors are opaque to the consumer); this module alone makes and
//! reads them. At the end of a stream the service returns the request's token again: the cursor
//! comes back unchanged and the reader backs off.
//!
//! Tokens expire: "The token expires after 24 hours" (GetLogEvents), and the token handed back at
//! the end of a stream keeps its age, so a stream quiet for a day (or a fleet down for one) holds
//! an expired token. A token the service refuses (`InvalidParameterException`) is recovered from
//! the cursor's last event: the stream is read again from that event's timestamp, from the head,
//! with no token. What comes back at or before that event was handed out already and is
//! recognised as such (a replay below the applied prefix, or an overlap of this attempt); the rest
//! is new. Each recovery is logged and counted (`shardwise_paged_cursor_recoveries_total`).
//!
//! The contract: empty pages with a new token are zero-item pages; positions are not dense; and a
//! forward traversal never goes back (no backfill): `GetLogEvents` returns a stream's events in
//! order from the token's place, so an event at or below the applied prefix is one already read (a
//! replayed page), settled without the handler. Should the service ever return an event below one
//! already read, the partition stops with an order violation rather than guess.
//!
//! A limit of the API, not of shardwise: a forward token marks a place in the stream's order by
//! timestamp. An event put later with a timestamp before that place is not returned by later pages
//! (moto's tokens are indexes, so such an event also moves the events after it one place on, and the
//! next page repeats one, which is recognised as read). CloudWatch accepts events up to 14 days
//! old: for streams that receive late events, read by timestamp with `FilterLogEvents` and a
//! lateness bound.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_cloudwatchlogs::Client;
use aws_sdk_cloudwatchlogs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_cloudwatchlogs::operation::describe_log_streams::DescribeLogStreamsError;
use aws_sdk_cloudwatchlogs::operation::get_log_events::{GetLogEventsError, GetLogEventsOutput};
use bytes::Bytes;
use futures::future::BoxFuture;
use tracing::{debug, warn};

use super::budget::Budget;
use super::{Contract, Cursor, FetchError, Page, PagePosition, PagedEvent, PagedSource};
use crate::backoff::Backoff;
use crate::error::Error;

/// The events of one page at most (the API's own limit is 10,000).
const DEFAULT_PAGE_LIMIT: i32 = 1_000;

/// A worker's GetLogEvents requests a second by default: five workers stay inside the
/// account's quota of 25.
pub const GET_LOG_EVENTS_PER_SECOND: f64 = 5.0;

/// A worker's DescribeLogStreams requests a second by default (the account's quota is 5).
pub const DESCRIBE_LOG_STREAMS_PER_SECOND: f64 = 1.0;

/// The log streams of a log group, each a partition, read with `GetLogEvents`.
///
/// Each worker keeps to a request budget per API (clones share it): by default
/// [`GET_LOG_EVENTS_PER_SECOND`] and [`DESCRIBE_LOG_STREAMS_PER_SECOND`], so a handful of workers
/// stay inside the account's quotas (25 and 5 requests a second, shared by every reader of the
/// account and Region). Throttling that comes anyway is backed off with jitter and counted in
/// `shardwise_paged_throttled_total`.
#[derive(Clone)]
pub struct CloudWatchLogs {
    client: Client,
    group: Arc<str>,
    name: Arc<str>,
    limit: i32,
    reads: Arc<Budget>,
    listings: Arc<Budget>,
}

impl fmt::Debug for CloudWatchLogs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CloudWatchLogs")
            .field("group", &self.group)
            .field("limit", &self.limit)
            .field("reads", &self.reads)
            .field("listings", &self.listings)
            .finish_non_exhaustive()
    }
}

impl CloudWatchLogs {
    /// Reads the log group `group`; the source is named `logs:<group>` in the lease table.
    pub fn new(client: Client, group: impl Into<String>) -> Self {
        let group: String = group.into();
        Self {
            client,
            name: format!("logs:{group}").into(),
            group: group.into(),
            limit: DEFAULT_PAGE_LIMIT,
            reads: Arc::new(Budget::per_second(GET_LOG_EVENTS_PER_SECOND)),
            listings: Arc::new(Budget::per_second(DESCRIBE_LOG_STREAMS_PER_SECOND)),
        }
    }

    /// This worker's GetLogEvents requests a second, at most (default
    /// [`GET_LOG_EVENTS_PER_SECOND`]). Share the account's quota of 25 among the workers.
    pub fn get_log_events_per_second(mut self, rate: f64) -> Self {
        self.reads = Arc::new(Budget::per_second(rate));
        self
    }

    /// This worker's DescribeLogStreams requests a second, at most (default
    /// [`DESCRIBE_LOG_STREAMS_PER_SECOND`]; the account's quota is 5).
    pub fn describe_log_streams_per_second(mut self, rate: f64) -> Self {
        self.listings = Arc::new(Budget::per_second(rate));
        self
    }

    /// At most this many events per page (1 to 10,000; default 1,000).
    pub fn page_limit(mut self, limit: u32) -> Self {
        self.limit = limit.clamp(1, 10_000) as i32;
        self
    }

    /// The log group.
    pub fn group(&self) -> &str {
        &self.group
    }
}

/// What a cursor of this source holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct LogCursor {
    /// `startTime` of every request of this traversal (a seek to a time).
    start: Option<i64>,
    /// The service's forward token.
    token: Option<String>,
    /// The last event before this cursor: (timestamp, ingestion time, k).
    last: Option<(i64, i64, u64)>,
}

impl LogCursor {
    fn encode(&self) -> Cursor {
        let (ts, ingest, k) = self.last.map_or(
            (String::new(), String::new(), String::new()),
            |(t, i, k)| (t.to_string(), i.to_string(), k.to_string()),
        );
        Cursor::new(format!(
            "v1|{}|{ts}|{ingest}|{k}|{}",
            self.start.map(|s| s.to_string()).unwrap_or_default(),
            self.token.as_deref().unwrap_or_default(),
        ))
    }

    fn decode(cursor: &Cursor) -> Result<Self, String> {
        let text = std::str::from_utf8(cursor.as_bytes())
            .map_err(|_| "a cursor of CloudWatch Logs is text".to_string())?;
        // The token comes last: whatever it holds, it cannot shift the fields before it.
        let fields: Vec<&str> = text.splitn(6, '|').collect();
        let [version, start, ts, ingest, k, token] = fields[..] else {
            return Err(format!("`{text}` is not a cursor of CloudWatch Logs"));
        };
        if version != "v1" {
            return Err(format!("cursor version `{version}` is unknown"));
        }
        let number = |s: &str| -> Result<Option<i64>, String> {
            if s.is_empty() {
                return Ok(None);
            }
            s.parse()
                .map(Some)
                .map_err(|_| format!("`{s}` in cursor `{text}` is not a number"))
        };
        let last = match (number(ts)?, number(ingest)?, number(k)?) {
            (Some(t), Some(i), Some(k)) => Some((t, i, k as u64)),
            (None, None, None) => None,
            _ => return Err(format!("cursor `{text}` names half an event")),
        };
        Ok(Self {
            start: number(start)?,
            token: (!token.is_empty()).then(|| token.to_string()),
            last,
        })
    }
}

fn millis(time: SystemTime) -> i64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// How long a listing of the log streams goes on asking for a throttled page again.
const LISTING_PATIENCE: Duration = Duration::from_secs(120);

/// Whether the service asked to slow down (both CloudWatch Logs sources ask this).
pub(super) fn throttled<E: ProvideErrorMetadata>(e: &SdkError<E>) -> bool {
    e.as_service_error()
        .and_then(ProvideErrorMetadata::code)
        .is_some_and(|c| c.contains("Throttl"))
}

/// Whether the service refused the request's parameters (an expired token is one).
fn refused(e: &SdkError<GetLogEventsError>) -> bool {
    matches!(
        e.as_service_error(),
        Some(GetLogEventsError::InvalidParameterException(_))
    )
}

fn fetch_error(e: SdkError<GetLogEventsError>) -> FetchError {
    match e.as_service_error() {
        Some(GetLogEventsError::ResourceNotFoundException(_)) => FetchError::NotFound,
        Some(GetLogEventsError::InvalidParameterException(_)) => {
            FetchError::InvalidCursor(Box::new(e))
        }
        Some(_) if throttled(&e) => FetchError::Throttled,
        _ => FetchError::Other(Box::new(e)),
    }
}

impl CloudWatchLogs {
    async fn get_log_events(
        &self,
        partition: &str,
        at: &LogCursor,
    ) -> Result<GetLogEventsOutput, SdkError<GetLogEventsError>> {
        self.reads.acquire().await;
        self.client
            .get_log_events()
            .log_group_name(self.group.as_ref())
            .log_stream_name(partition)
            .start_from_head(true)
            .limit(self.limit)
            .set_start_time(at.start)
            .set_next_token(at.token.clone())
            .send()
            .await
    }
}

impl PagedSource for CloudWatchLogs {
    fn name(&self) -> &str {
        &self.name
    }

    fn contract(&self) -> Contract {
        Contract::default()
    }

    /// Every log stream of the group, page by page. A throttled page is asked again after a
    /// back-off (the pages read so far are kept) for up to 2 minutes: the
    /// account's DescribeLogStreams quota (5 requests a second) is shared by every worker, and a
    /// listing that gave up at the first throttled page would never finish for a group of many
    /// streams. A listing is complete or an error, never a part: a stream missing from it would
    /// read as a stream that is gone.
    fn partitions(&self) -> BoxFuture<'_, Result<Vec<String>, Error>> {
        Box::pin(async move {
            let failed = |e: SdkError<DescribeLogStreamsError>| Error::Paged {
                source_name: self.name.to_string(),
                partition: String::new(),
                what: "listing the log streams failed",
                source: Box::new(e),
            };
            let patience = tokio::time::Instant::now() + LISTING_PATIENCE;
            let mut waits = Backoff::new(Duration::from_secs(5));
            let mut names = Vec::new();
            let mut token: Option<String> = None;
            loop {
                self.listings.acquire().await;
                let page = match self
                    .client
                    .describe_log_streams()
                    .log_group_name(self.group.as_ref())
                    .set_next_token(token.clone())
                    .send()
                    .await
                {
                    Ok(page) => page,
                    Err(e) if throttled(&e) && tokio::time::Instant::now() < patience => {
                        metrics::counter!("shardwise_paged_throttled_total", "source" => self.name.to_string()).increment(1);
                        let wait = waits.next();
                        debug!(source = %self.name, streams = names.len(), ?wait, "listing the log streams was throttled; asking for the same page again");
                        tokio::time::sleep(wait).await;
                        continue;
                    }
                    Err(e) => return Err(failed(e)),
                };
                waits.reset();
                names.extend(
                    page.log_streams()
                        .iter()
                        .filter_map(|s| s.log_stream_name().map(str::to_string)),
                );
                match page.next_token {
                    // The same token again would be a loop: the listing ends there.
                    Some(next) if token.as_ref() != Some(&next) => token = Some(next),
                    _ => break,
                }
            }
            names.sort();
            names.dedup();
            Ok(names)
        })
    }

    fn fetch<'a>(
        &'a self,
        partition: &'a str,
        cursor: Option<&'a Cursor>,
    ) -> BoxFuture<'a, Result<Page, FetchError>> {
        Box::pin(async move {
            let mut at = match cursor {
                Some(c) => LogCursor::decode(c).map_err(|e| FetchError::InvalidCursor(e.into()))?,
                None => LogCursor::default(),
            };
            let output = match self.get_log_events(partition, &at).await {
                Err(e) if at.token.is_some() && refused(&e) => {
                    // An expired (or otherwise refused) token: read again from the last event's
                    // time, from the head; what was handed out already is recognised as such.
                    let from = at.last.map(|(timestamp, _, _)| timestamp).or(at.start);
                    warn!(source = %self.name, partition, from, error = %DisplayErrorContext(&e), "the service refused the cursor's token; reading the stream again from the last event's time");
                    metrics::counter!("shardwise_paged_cursor_recoveries_total", "source" => self.name.to_string()).increment(1);
                    at = LogCursor {
                        start: from,
                        token: None,
                        // Counting occurrences starts again with the first event read.
                        last: None,
                    };
                    self.get_log_events(partition, &at).await
                }
                answer => answer,
            }
            .map_err(fetch_error)?;
            let mut last = at.last;
            let mut events = Vec::with_capacity(output.events().len());
            for event in output.events() {
                let ts = event.timestamp.unwrap_or_default();
                let ingest = event.ingestion_time.unwrap_or_default();
                let k = match last {
                    Some((t, i, k)) if (t, i) == (ts, ingest) => k + 1,
                    _ => 0,
                };
                last = Some((ts, ingest, k));
                let number = |n: i64| u64::try_from(n).unwrap_or_default();
                events.push(PagedEvent {
                    id: format!("{ts}-{ingest}-{k}"),
                    position: PagePosition::from_parts(&[number(ts), number(ingest), k]),
                    payload: Bytes::from(event.message.clone().unwrap_or_default()),
                    timestamp: Some(UNIX_EPOCH + Duration::from_millis(number(ts))),
                    key: None,
                });
            }
            // A token missing from the answer keeps the request's: fetched again after a back-off.
            let token = output
                .next_forward_token
                .clone()
                .or_else(|| at.token.clone());
            let next = LogCursor {
                start: at.start,
                token,
                last,
            };
            Ok(Page {
                events,
                next: Some(next.encode()),
                watermark: None,
            })
        })
    }

    fn cursor_at(&self, _partition: &str, time: SystemTime) -> Option<Cursor> {
        Some(
            LogCursor {
                start: Some(millis(time)),
                ..LogCursor::default()
            }
            .encode(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_bad_ones_are_refused() {
        let cursors = [
            LogCursor::default(),
            LogCursor {
                start: Some(1_764_000_000_000),
                token: None,
                last: None,
            },
            LogCursor {
                start: None,
                token: Some(
                    "f/00000000000000000000000000000000000000000000000000000009|odd".into(),
                ),
                last: Some((1_764_000_000_123, 1_764_000_000_200, 2)),
            },
        ];
        for cursor in cursors {
            assert_eq!(LogCursor::decode(&cursor.encode()).unwrap(), cursor);
        }
        for bad in ["", "v2|||||", "v1|x||||", "v1||5|||f/1", "v1||f/1"] {
            assert!(LogCursor::decode(&Cursor::new(bad)).is_err(), "{bad}");
        }
    }
}
