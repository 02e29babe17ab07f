//! CloudWatch Logs read by timestamp: one partition, the whole log group, polled with
//! `FilterLogEvents` from `startTime` = `closed_through` + 1 ms, following `nextToken` to the end of
//! each poll.
//!
//! - **Identity**: the service's `eventId`, stable for an event whatever page returns it.
//! - **Ties**: many events share a millisecond, across streams and pages; the timestamp-group
//!   discipline (seed 000) never closes a millisecond on a page boundary.
//! - **Traversal**: `nextToken` is the service's continuation of one query: a poll followed to its
//!   last page enumerates every event ingested before the poll began (declared
//!   [`Traversal::Complete`]).
//! - **Finality**: CloudWatch accepts events up to 14 days old (`PutLogEvents` refuses older
//!   ones), so a timestamp is final once a complete poll began 14 days after it
//!   ([`Finality::Lateness`]). Until then its group stays open and every poll reads it again
//!   (receipts make that harmless). A shorter bound ([`lateness`](CloudWatchLogsFilter::lateness))
//!   is the user's promise about their producers, not the service's.
//! - **Order across lanes**: events are keyed by their log stream, so one stream's events are
//!   handled in the order the service returns them.
//!
//! - **Tokens expire** after 24 hours, as `GetLogEvents`' do: a poll held up that long (throttling
//!   that lasts, a poll of a very long window) holds a refused token. The query is then asked
//!   again from the poll's `startTime` with no token: the events of the poll already handed out
//!   are known to the attempt's open groups, and the poll's evidence dates from its first start
//!   (a query begun later enumerates a superset). Logged, and counted in
//!   `shardwise_paged_cursor_recoveries_total`.
//!
//! The cursor, which only this module reads: `f1|<startTime ms, or empty>|<nextToken, or empty>`.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use aws_sdk_cloudwatchlogs::Client;
use aws_sdk_cloudwatchlogs::error::{DisplayErrorContext, SdkError};
use aws_sdk_cloudwatchlogs::operation::filter_log_events::{
    FilterLogEventsError, FilterLogEventsOutput,
};
use bytes::Bytes;
use futures::future::BoxFuture;
use tracing::warn;

use super::budget::Budget;
use super::cloudwatch::throttled;
use super::{
    Contract, Cursor, FetchError, Finality, Page, PagePosition, PagedEvent, PagedSource,
    Timestamps, Traversal,
};
use crate::error::Error;

/// How late CloudWatch Logs accepts an event: 14 days.
pub const CLOUDWATCH_LATENESS: Duration = Duration::from_secs(14 * 24 * 3600);

/// A worker's FilterLogEvents requests a second by default (the account's quota is 5; a group
/// is one partition, read by one worker at a time).
pub const FILTER_LOG_EVENTS_PER_SECOND: f64 = 2.0;

/// A log group read by timestamp with `FilterLogEvents`: one partition, named after the group.
///
/// Each worker keeps to a budget of [`FILTER_LOG_EVENTS_PER_SECOND`] requests (clones share it);
/// throttling that comes anyway is backed off with jitter.
#[derive(Clone)]
pub struct CloudWatchLogsFilter {
    client: Client,
    group: Arc<str>,
    name: Arc<str>,
    limit: i32,
    lateness: Duration,
    reads: Arc<Budget>,
}

impl fmt::Debug for CloudWatchLogsFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CloudWatchLogsFilter")
            .field("group", &self.group)
            .field("limit", &self.limit)
            .field("lateness", &self.lateness)
            .finish_non_exhaustive()
    }
}

impl CloudWatchLogsFilter {
    /// Reads the log group `group` by timestamp; the source is named `logs-by-time:<group>` in
    /// the lease table, its one partition `<group>`.
    pub fn new(client: Client, group: impl Into<String>) -> Self {
        let group: String = group.into();
        Self {
            client,
            name: format!("logs-by-time:{group}").into(),
            group: group.into(),
            limit: 1_000,
            lateness: CLOUDWATCH_LATENESS,
            reads: Arc::new(Budget::per_second(FILTER_LOG_EVENTS_PER_SECOND)),
        }
    }

    /// This worker's FilterLogEvents requests a second, at most (default
    /// [`FILTER_LOG_EVENTS_PER_SECOND`]; the account's quota is 5).
    pub fn filter_log_events_per_second(mut self, rate: f64) -> Self {
        self.reads = Arc::new(Budget::per_second(rate));
        self
    }

    /// At most this many events per page (1 to 10,000; default 1,000).
    pub fn page_limit(mut self, limit: u32) -> Self {
        self.limit = limit.clamp(1, 10_000) as i32;
        self
    }

    /// How late an event may arrive (default [`CLOUDWATCH_LATENESS`], the service's own bound).
    /// A shorter bound closes groups sooner and makes each poll read less again, and is a
    /// promise about the producers: an event later than it is found only by the late-event
    /// audit.
    pub fn lateness(mut self, lateness: Duration) -> Self {
        self.lateness = lateness;
        self
    }

    /// The log group.
    pub fn group(&self) -> &str {
        &self.group
    }
}

/// A poll's place: its `startTime`, and the service's token within it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct FilterCursor {
    start: Option<i64>,
    token: Option<String>,
}

impl FilterCursor {
    fn encode(&self) -> Cursor {
        Cursor::new(format!(
            "f1|{}|{}",
            self.start.map(|s| s.to_string()).unwrap_or_default(),
            self.token.as_deref().unwrap_or_default()
        ))
    }

    fn decode(cursor: &Cursor) -> Result<Self, String> {
        let text = std::str::from_utf8(cursor.as_bytes())
            .map_err(|_| "a cursor of CloudWatch Logs is text".to_string())?;
        let fields: Vec<&str> = text.splitn(3, '|').collect();
        let ["f1", start, token] = fields[..] else {
            return Err(format!(
                "`{text}` is not a cursor of FilterLogEvents (f1|start|token)"
            ));
        };
        let start = match start {
            "" => None,
            s => Some(
                s.parse()
                    .map_err(|_| format!("`{s}` in cursor `{text}` is not a number"))?,
            ),
        };
        Ok(Self {
            start,
            token: (!token.is_empty()).then(|| token.to_string()),
        })
    }
}

/// Whether the service refused the request's parameters (an expired token is one).
fn refused(e: &SdkError<FilterLogEventsError>) -> bool {
    matches!(
        e.as_service_error(),
        Some(FilterLogEventsError::InvalidParameterException(_))
    )
}

impl CloudWatchLogsFilter {
    async fn filter_log_events(
        &self,
        at: &FilterCursor,
    ) -> Result<FilterLogEventsOutput, SdkError<FilterLogEventsError>> {
        self.reads.acquire().await;
        self.client
            .filter_log_events()
            .log_group_name(self.group.as_ref())
            .limit(self.limit)
            .set_start_time(at.start)
            .set_next_token(at.token.clone())
            .send()
            .await
    }
}

fn fetch_error(e: SdkError<FilterLogEventsError>) -> FetchError {
    match e.as_service_error() {
        Some(FilterLogEventsError::ResourceNotFoundException(_)) => FetchError::NotFound,
        Some(FilterLogEventsError::InvalidParameterException(_)) => {
            FetchError::InvalidCursor(Box::new(e))
        }
        Some(_) if throttled(&e) => FetchError::Throttled,
        _ => FetchError::Other(Box::new(e)),
    }
}

impl PagedSource for CloudWatchLogsFilter {
    fn name(&self) -> &str {
        &self.name
    }

    fn contract(&self) -> Contract {
        Contract::default().timestamps(Timestamps::new(
            Traversal::Complete,
            Finality::Lateness(self.lateness),
        ))
    }

    /// The group itself, once it is found (a missing group is an error naming it).
    fn partitions(&self) -> BoxFuture<'_, Result<Vec<String>, Error>> {
        Box::pin(async move {
            let groups = self
                .client
                .describe_log_groups()
                .log_group_name_prefix(self.group.as_ref())
                .send()
                .await
                .map_err(|e| Error::Paged {
                    source_name: self.name.to_string(),
                    partition: String::new(),
                    what: "describing the log group failed",
                    source: Box::new(e),
                })?;
            let found = groups
                .log_groups()
                .iter()
                .any(|g| g.log_group_name() == Some(self.group.as_ref()));
            if !found {
                return Err(Error::Paged {
                    source_name: self.name.to_string(),
                    partition: self.group.to_string(),
                    what: "log group not found",
                    source: format!("there is no log group `{}`", self.group).into(),
                });
            }
            Ok(vec![self.group.to_string()])
        })
    }

    fn fetch<'a>(
        &'a self,
        _partition: &'a str,
        cursor: Option<&'a Cursor>,
    ) -> BoxFuture<'a, Result<Page, FetchError>> {
        Box::pin(async move {
            let mut at = match cursor {
                Some(c) => {
                    FilterCursor::decode(c).map_err(|e| FetchError::InvalidCursor(e.into()))?
                }
                None => FilterCursor::default(),
            };
            let output = match self.filter_log_events(&at).await {
                Err(e) if at.token.is_some() && refused(&e) => {
                    // An expired (or otherwise refused) token within a poll: the query is asked
                    // again from the poll's start; what this attempt handed out already is known
                    // to its open groups, and the poll's evidence still dates from its start.
                    warn!(source = %self.name, start = at.start, error = %DisplayErrorContext(&e), "the service refused the poll's token; reading the poll again from its start");
                    metrics::counter!("shardwise_paged_cursor_recoveries_total", "source" => self.name.to_string()).increment(1);
                    at.token = None;
                    self.filter_log_events(&at).await
                }
                answer => answer,
            }
            .map_err(fetch_error)?;
            let number = |n: i64| u64::try_from(n).unwrap_or_default();
            let mut events = Vec::with_capacity(output.events().len());
            for event in output.events() {
                let Some(id) = event.event_id() else {
                    return Err(FetchError::Other(
                        "FilterLogEvents returned an event without an eventId".into(),
                    ));
                };
                let ts = event.timestamp.unwrap_or_default();
                events.push(PagedEvent {
                    id: id.to_string(),
                    position: PagePosition::from_parts(&[
                        number(ts),
                        number(event.ingestion_time.unwrap_or_default()),
                    ]),
                    payload: Bytes::from(event.message.clone().unwrap_or_default()),
                    timestamp: Some(UNIX_EPOCH + Duration::from_millis(number(ts))),
                    key: event.log_stream_name.clone(),
                });
            }
            Ok(Page {
                events,
                next: output.next_token.map(|token| {
                    FilterCursor {
                        start: at.start,
                        token: Some(token),
                    }
                    .encode()
                }),
                watermark: None,
            })
        })
    }

    fn poll_after(&self, _partition: &str, after: Option<i64>) -> Option<Cursor> {
        Some(
            FilterCursor {
                start: after.map(|a| a.saturating_add(1)),
                token: None,
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
        for cursor in [
            FilterCursor::default(),
            FilterCursor {
                start: Some(1_796_119_260_001),
                token: Some("/group@stream|odd@42".into()),
            },
        ] {
            assert_eq!(FilterCursor::decode(&cursor.encode()).unwrap(), cursor);
        }
        for bad in ["", "f2||", "f1|x|", "v1||||||"] {
            assert!(FilterCursor::decode(&Cursor::new(bad)).is_err(), "{bad}");
        }
    }
}
