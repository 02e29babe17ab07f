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
//! - **Two horizons** (`docs/paged.md`, "FilterLogEvents over months"). A poll begun at `S`
//!   reads only what is new: `startTime` = `closed_through` + 1 ms, `endTime` = `S - C`, the
//!   *close horizon* `C` ([`FILTER_CLOSE_HORIZON`], 5 minutes: the delay before an ingested
//!   event can be searched, and clock skew). A complete poll closes every settled group through
//!   `S - C` ([`Finality::Lateness`]`(C)`), so the open groups hold about one poll's events,
//!   whatever the lateness. Events that arrive later than that, up to the *lateness*
//!   ([`FILTER_LATENESS`], 1 hour; [`CLOUDWATCH_LATENESS`], the service's 14 days, remains
//!   available) behind `closed_through`, are found by the audit: every [`FILTER_AUDIT_INTERVAL`]
//!   (5 minutes) one poll starts the lateness window earlier, and an event it finds at or before
//!   `closed_through` that the attempt did not hand out (it remembers the window's identities,
//!   16 bytes each) is handed out unless its receipt shows it done, and counted in
//!   `shardwise_paged_late_events_total`. After a restart the identities are gone; the audit's
//!   durable mark (written with a close once the audit's events settled: every event from the
//!   audit's start, ingested by the audit's start less `C`, but not after the newest event the
//!   audit read nor, with nothing that recent, before the start less
//!   [`readable_within`](CloudWatchLogsFilter::readable_within), was handed out) tells the next
//!   attempt's first audit what it need not hand out again, from the events' `ingestionTime`
//!   ([`PagedSource::ingested`]); what arrived since the mark is handed out unless receipts
//!   recognise it. The memory is reported as `shardwise_paged_open_events` and
//!   `shardwise_paged_remembered_events`.
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
//! The cursor, which only this module reads: `f3|` and a JSON object (serde; `s` the poll's
//! `startTime` ms, `e` its `endTime` ms, `t` the service's `nextToken`, each absent when none).
//! Cursors written before are still read: `f2|<startTime>|<endTime>|<nextToken>` (fields split
//! by hand, empty when none) and `f1`, without `endTime`.

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
use super::cloudwatch::{group_retention, throttled};
use super::{
    Contract, Cursor, FetchError, Finality, Page, PagePosition, PagedEvent, PagedSource,
    Timestamps, Traversal,
};
use crate::error::Error;

/// How late CloudWatch Logs accepts an event: 14 days.
pub const CLOUDWATCH_LATENESS: Duration = Duration::from_secs(14 * 24 * 3600);

/// How far behind the present a poll stops by default: 5 minutes.
pub const FILTER_CLOSE_HORIZON: Duration = Duration::from_secs(300);

/// How late behind the close horizon an event is still handed out by default: 1 hour.
pub const FILTER_LATENESS: Duration = Duration::from_secs(3600);

/// How often the lateness window is audited by default: every 5 minutes.
pub const FILTER_AUDIT_INTERVAL: Duration = Duration::from_secs(300);

/// How much event time one poll covers at most while the group is read behind the present (a
/// catch-up after a pause) by default: 10 minutes.
pub const FILTER_CATCH_UP_STEP: Duration = Duration::from_secs(600);

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
    /// The service's time, from the `Date` of its answers: polls end and close by it.
    clock: Arc<crate::time::ServiceClock>,
    group: Arc<str>,
    name: Arc<str>,
    limit: i32,
    close_horizon: Duration,
    lateness: Duration,
    audit_interval: Duration,
    catch_up_step: Duration,
    readable_within: Duration,
    reads: Arc<Budget>,
    /// The group's retention, described with every listing.
    kept: super::cloudwatch::Kept,
}

impl fmt::Debug for CloudWatchLogsFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CloudWatchLogsFilter")
            .field("group", &self.group)
            .field("limit", &self.limit)
            .field("close_horizon", &self.close_horizon)
            .field("lateness", &self.lateness)
            .field("audit_interval", &self.audit_interval)
            .field("catch_up_step", &self.catch_up_step)
            .field("readable_within", &self.readable_within)
            .finish_non_exhaustive()
    }
}

impl CloudWatchLogsFilter {
    /// Reads the log group `group` by timestamp; the source is named `logs-by-time:<group>` in
    /// the lease table, its one partition `<group>`.
    pub fn new(client: Client, group: impl Into<String>) -> Self {
        let group: String = group.into();
        let (client, clock) = super::cloudwatch::dated(&client);
        Self {
            client,
            clock,
            name: format!("logs-by-time:{group}").into(),
            group: group.into(),
            limit: 10_000,
            close_horizon: FILTER_CLOSE_HORIZON,
            lateness: FILTER_LATENESS,
            audit_interval: FILTER_AUDIT_INTERVAL,
            catch_up_step: FILTER_CATCH_UP_STEP,
            readable_within: super::cloudwatch::READABLE_WITHIN,
            reads: Arc::new(Budget::per_second(FILTER_LOG_EVENTS_PER_SECOND)),
            kept: super::cloudwatch::Kept::default(),
        }
    }

    /// How far behind the present a poll stops (default [`FILTER_CLOSE_HORIZON`], 5 minutes): a poll
    /// begun at `S` reads events up to `S - C` (`endTime`) and closes them once they settled.
    /// It covers the delay before an ingested event can be searched, and clock skew; it is also
    /// how long an event waits before it is handed out.
    pub fn close_horizon(mut self, horizon: Duration) -> Self {
        self.close_horizon = horizon;
        self
    }

    /// How often the audit reads the lateness window behind `closedThrough` again (default
    /// [`FILTER_AUDIT_INTERVAL`], 5 minutes).
    pub fn audit_interval(mut self, every: Duration) -> Self {
        self.audit_interval = every.max(Duration::from_secs(1));
        self
    }

    /// How much event time one poll covers at most while the group is read behind the present
    /// (default [`FILTER_CATCH_UP_STEP`], 10 minutes; at least 1 s). After a pause of days the
    /// backlog is read in polls of this span, one after the other, each closing what it read:
    /// memory holds one step's events (at 100 events a second, 60,000), and no poll runs long
    /// enough for its `nextToken` to expire (24 hours). Audits for late events wait until the
    /// reader is back within a step of the present.
    pub fn catch_up_step(mut self, step: Duration) -> Self {
        self.catch_up_step = step.max(Duration::from_secs(1));
        self
    }

    /// This worker's FilterLogEvents requests a second, at most (default
    /// [`FILTER_LOG_EVENTS_PER_SECOND`]; the account's quota is 5).
    pub fn filter_log_events_per_second(mut self, rate: f64) -> Self {
        self.reads = Arc::new(Budget::per_second(rate));
        self
    }

    /// At most this many events per page (1 to 10,000; default 10,000, the service's most: a
    /// page is also at most 1 MB). Fewer events a page cost more requests of the account's 5 a
    /// second: an audit of an hour at 100 events a second reads 36 pages of 10,000, or 360 of
    /// 1,000, which at the default budget of 2 requests a second holds the forward polls for 3
    /// minutes.
    pub fn page_limit(mut self, limit: u32) -> Self {
        self.limit = limit.clamp(1, 10_000) as i32;
        self
    }

    /// How late (behind the close horizon) an event may arrive and still be handed out (default
    /// [`FILTER_LATENESS`], 1 hour; [`CLOUDWATCH_LATENESS`], 14 days, is the service's own bound). The
    /// audit reads this window behind `closedThrough` again every audit interval, and the
    /// attempt remembers the identities of the events in it (16 bytes each): the window costs
    /// reads and memory in proportion. An event later than it is not looked for.
    pub fn lateness(mut self, lateness: Duration) -> Self {
        self.lateness = lateness;
        self
    }

    /// How long after its ingestion an event may take to become searchable (default
    /// [`READABLE_WITHIN`](super::READABLE_WITHIN), 15 minutes; AWS states no bound). The
    /// group's events are taken to become searchable in the order they were ingested: an audit
    /// begun at `S` vouches (in its durable mark) for the events ingested by `S` less the close
    /// horizon, but not after the newest one it read, nor, when it read nothing that recent,
    /// for the last `within`. An event searchable later than that, and later than the close
    /// horizon, may be taken for a replay by a later audit.
    pub fn readable_within(mut self, within: Duration) -> Self {
        self.readable_within = within;
        self
    }

    /// The log group.
    pub fn group(&self) -> &str {
        &self.group
    }
}

/// A poll's place: its `startTime` and `endTime`, and the service's token within it.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FilterCursor {
    #[serde(rename = "s", default, skip_serializing_if = "Option::is_none")]
    start: Option<i64>,
    #[serde(rename = "e", default, skip_serializing_if = "Option::is_none")]
    end: Option<i64>,
    #[serde(rename = "t", default, skip_serializing_if = "Option::is_none")]
    token: Option<String>,
}

impl FilterCursor {
    fn encode(&self) -> Cursor {
        Cursor::new(format!(
            "f3|{}",
            serde_json::to_string(self).expect("a cursor is plain data")
        ))
    }

    /// A cursor of any version written so far: 3 (JSON), or 1 and 2 (fields split by hand, read
    /// as they were written).
    fn decode(cursor: &Cursor) -> Result<Self, String> {
        let text = std::str::from_utf8(cursor.as_bytes())
            .map_err(|_| "a cursor of CloudWatch Logs is text".to_string())?;
        if let Some(json) = text.strip_prefix("f3|") {
            return serde_json::from_str(json)
                .map_err(|e| format!("`{text}` is not a cursor of FilterLogEvents: {e}"));
        }
        let number = |s: &str| -> Result<Option<i64>, String> {
            match s {
                "" => Ok(None),
                s => s
                    .parse()
                    .map(Some)
                    .map_err(|_| format!("`{s}` in cursor `{text}` is not a number")),
            }
        };
        // The token comes last: whatever it holds, it cannot shift the fields before it. Version
        // 1 (before the close horizon) has no `endTime`.
        let refused = || format!("`{text}` is not a cursor of FilterLogEvents (f3|JSON)");
        let (start, end, token) = if let Some(rest) = text.strip_prefix("f2|") {
            let fields: Vec<&str> = rest.splitn(3, '|').collect();
            let [start, end, token] = fields[..] else {
                return Err(refused());
            };
            (start, end, token)
        } else if let Some(rest) = text.strip_prefix("f1|") {
            let fields: Vec<&str> = rest.splitn(2, '|').collect();
            let [start, token] = fields[..] else {
                return Err(refused());
            };
            (start, "", token)
        } else {
            return Err(refused());
        };
        Ok(Self {
            start: number(start)?,
            end: number(end)?,
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
            .set_end_time(at.end)
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

    fn service_time(&self) -> Option<std::time::SystemTime> {
        self.clock.reached()
    }

    fn contract(&self) -> Contract {
        Contract::default().timestamps(
            Timestamps::new(Traversal::Complete, Finality::Lateness(self.close_horizon))
                .audit_window(self.lateness)
                .readable_within(self.readable_within),
        )
    }

    fn audit_interval(&self) -> Option<Duration> {
        Some(self.audit_interval)
    }

    /// What a replay needs is bounded by `closedThrough` (the consumer reads it from the row).
    fn bounds_replays(&self) -> bool {
        true
    }

    /// The event's `ingestionTime`, the second part of its position.
    fn ingested(&self, event: &PagedEvent) -> Option<i64> {
        let bytes: [u8; 8] = event.position.as_bytes().get(8..16)?.try_into().ok()?;
        i64::try_from(u64::from_be_bytes(bytes)).ok()
    }

    /// The group itself, once it is found (a missing group is an error naming it).
    fn partitions(&self) -> BoxFuture<'_, Result<Vec<String>, Error>> {
        Box::pin(async move {
            group_retention(&self.client, &self.group, &self.name, &self.kept).await?;
            Ok(vec![self.group.to_string()])
        })
    }

    /// The log group's retention ([`DELETION_DELAY`](super::DELETION_DELAY) and 2
    /// hours added); "never expire" keeps events for good. A poll after an outage reads again
    /// every event after `closedThrough`, however long ago it was handled.
    fn retention(&self) -> BoxFuture<'_, Result<crate::receipts::SourceRetention, Error>> {
        Box::pin(group_retention(
            &self.client,
            &self.group,
            &self.name,
            &self.kept,
        ))
    }

    /// The group's `retentionInDays`, as its last listing described it.
    fn deletes_after(&self) -> Option<Duration> {
        self.kept.deletes_after()
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
            if let (Some(start), Some(end)) = (at.start, at.end)
                && end <= start
            {
                // A poll whose window is empty: the close horizon has not passed its start yet.
                return Ok(Page::default());
            }
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
                        token: Some(token),
                        ..at
                    }
                    .encode()
                }),
                watermark: None,
            })
        })
    }

    /// A poll of what is new: strictly after `after`, up to the close horizon behind the present
    /// (`endTime` is exclusive). A poll whose window is empty (the horizon has not passed
    /// `after` yet) reads nothing, without asking, and proves nothing new.
    fn poll_after(&self, partition: &str, after: Option<i64>) -> Option<Cursor> {
        self.poll_before(partition, after, None)
    }

    /// [`catch_up_step`](CloudWatchLogsFilter::catch_up_step).
    fn poll_step(&self) -> Option<Duration> {
        Some(self.catch_up_step)
    }

    /// A poll that ends at the close horizon, or at `before` when that is earlier (a step of a
    /// catch-up).
    fn poll_before(
        &self,
        _partition: &str,
        after: Option<i64>,
        before: Option<i64>,
    ) -> Option<Cursor> {
        let horizon = i64::try_from(self.close_horizon.as_millis()).unwrap_or(i64::MAX);
        // The service's time (the listing that found the group carried its first date).
        let now = self.service_time().unwrap_or_else(crate::time::now);
        let end = crate::time::millis(now)
            .saturating_sub(horizon)
            .saturating_add(1);
        let end = before.map_or(end, |before| end.min(before));
        let start = after.map(|a| a.saturating_add(1));
        Some(
            FilterCursor {
                start,
                end: Some(end),
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
                end: Some(1_796_119_560_001),
                token: Some("/group@stream|odd@42".into()),
            },
        ] {
            assert_eq!(FilterCursor::decode(&cursor.encode()).unwrap(), cursor);
        }
        assert!(
            FilterCursor {
                start: Some(5),
                ..FilterCursor::default()
            }
            .encode()
            .to_string()
            .starts_with(r#"f3|{"s":5}"#)
        );
        // Version 2, split by hand.
        assert_eq!(
            FilterCursor::decode(&Cursor::new("f2|5|9|/g@s|odd@1")).unwrap(),
            FilterCursor {
                start: Some(5),
                end: Some(9),
                token: Some("/g@s|odd@1".into()),
            }
        );
        // Version 1, before the close horizon.
        assert_eq!(
            FilterCursor::decode(&Cursor::new("f1|5|/g@s|odd@1")).unwrap(),
            FilterCursor {
                start: Some(5),
                end: None,
                token: Some("/g@s|odd@1".into()),
            }
        );
        for bad in [
            "",
            "f3|||",
            "f3|{\"s\":\"x\"}",
            "f3|{\"z\":1}",
            "f2||",
            "f1|x|",
            "f2||x|",
            "v1||||||",
        ] {
            assert!(FilterCursor::decode(&Cursor::new(bad)).is_err(), "{bad}");
        }
    }
}
