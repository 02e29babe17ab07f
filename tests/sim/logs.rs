//! CloudWatch Logs as the simulation's world serves it: one account's log group in memory, behind
//! the real SDK client (an HTTP connector that answers the SDK's JSON requests), on the
//! simulation's clock. The real sources (`paged::CloudWatchLogs`, `paged::CloudWatchLogsFilter`)
//! read it as they read the service.
//!
//! What it models, each from the CloudWatch Logs API reference (one line each, to check):
//! - GetLogEvents: "nextForwardToken ... The token expires after 24 hours. If you have reached the
//!   end of the stream, it returns the same token you passed in." An expired token is refused with
//!   `InvalidParameterException`.
//! - GetLogEvents: "returns as many log events as can fit in a response size of 1 MB (up to 10,000
//!   log events)"; an event's size is its UTF-8 message plus 26 bytes (PutLogEvents).
//! - GetLogEvents returns a stream's events in timestamp order; a token marks a place in that
//!   order, so an event put later with an earlier timestamp is behind every token issued past it.
//! - FilterLogEvents: "nextToken ... The token expires after 24 hours"; events of every stream of
//!   the group between startTime and endTime, in timestamp order.
//! - PutLogEvents: "None of the log events in the batch can be more than 14 days in the past" or
//!   "more than 2 hours in the future" (the world never puts such events; `put` refuses them).
//! - Events are searchable (FilterLogEvents) after an ingestion delay; GetLogEvents sees a stream's
//!   events in the order they were ingested, each batch once readable (`set_readability_delay`;
//!   AWS states no bound on the delay): a token issued past a later event never returns one that
//!   became readable after it.
//! - Quotas (Service Quotas, per account and Region): GetLogEvents 25 requests/s, FilterLogEvents
//!   5 requests/s, DescribeLogStreams 5 requests/s; past them `ThrottlingException`.
//! - DeleteLogStream removes a stream and its events: reads of it answer
//!   `ResourceNotFoundException`; a stream created again under its name is a new stream (its
//!   `creationTime` in DescribeLogStreams), and a token of the one deleted is refused with
//!   `InvalidParameterException` (the API reference does not say; the case the consumer must
//!   survive).
//! - Every answer carries the service's time in its `Date` header, in whole seconds (HTTP's
//!   date format), as every AWS API's does.
//! - DescribeLogStreams: "The maximum number of items returned. If you don't specify a value, the
//!   default is up to 50 items": pages of 50 streams and a `nextToken`.
//! - PutRetentionPolicy: a group keeps events `retentionInDays` (none: never expire);
//!   "CloudWatch Logs doesn't immediately delete log events when they reach their retention
//!   setting. It typically takes up to 72 hours after that": each event is deleted at its own
//!   time within 72 hours after its timestamp plus the retention. DescribeLogGroups reports
//!   `retentionInDays`. PutLogEvents: no event "older than the retention period of the log
//!   group" (refused whole, as the world's batches are).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_cloudwatchlogs::Client;
use aws_smithy_runtime_api::client::http::{
    HttpClient, HttpConnector, HttpConnectorFuture, HttpConnectorSettings, SharedHttpClient,
    SharedHttpConnector,
};
use aws_smithy_runtime_api::client::orchestrator::{HttpRequest, HttpResponse};
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_types::body::SdkBody;
use serde_json::{Value, json};
use tokio::time::Instant;

/// How long a token is good for.
pub const TOKEN_LIFETIME: Duration = Duration::from_secs(24 * 3600);
/// How old an event PutLogEvents accepts.
pub const MAX_AGE: Duration = Duration::from_secs(14 * 24 * 3600);
/// A page's size at most, and its events at most.
const PAGE_BYTES: usize = 1_048_576;
const PAGE_EVENTS: usize = 10_000;
/// An event's size over its message.
const EVENT_OVERHEAD: usize = 26;
/// How long after its retention an event may still be served.
pub const DELETION_DELAY_MS: i64 = 72 * 3600 * 1000;

/// Requests per second per account, by operation.
fn quota(operation: &str) -> Option<usize> {
    match operation {
        "GetLogEvents" => Some(25),
        "FilterLogEvents" | "DescribeLogStreams" | "DescribeLogGroups" => Some(5),
        _ => None,
    }
}

/// One stored event.
#[derive(Debug, Clone)]
pub struct LogEvent {
    /// The name the GetLogEvents source gives it: `timestamp-ingestion-k`.
    pub id: String,
    pub stream: String,
    pub timestamp: i64,
    pub ingestion: i64,
    /// Its occurrence among the stream's events with the same timestamp and ingestion time: the
    /// service's order.
    pub k: u64,
    /// Its occurrence among those with the same message too (how the GetLogEvents source tells
    /// exact repeats apart). Read by `tests/cloudwatch_memory.rs`, not by the simulation.
    #[allow(dead_code)]
    pub occurrence: u64,
    /// The position the GetLogEvents source gives it (kept: it costs a digest of the message).
    pub position: shardwise::paged::PagePosition,
    /// When FilterLogEvents finds it.
    pub searchable: i64,
    /// When GetLogEvents returns it.
    pub readable: i64,
    /// The service's `eventId` (what the FilterLogEvents source names it by).
    pub event_id: String,
    pub message: String,
}

impl LogEvent {
    fn key(&self) -> (i64, i64, u64) {
        (self.timestamp, self.ingestion, self.k)
    }
    fn size(&self) -> usize {
        self.message.len() + EVENT_OVERHEAD
    }
}

#[derive(Debug)]
enum Token {
    /// GetLogEvents: the events of `stream` after `after` (and at or after `start`), the stream
    /// created at `created`: one deleted and created again under its name refuses it.
    Forward {
        stream: String,
        created: i64,
        start: Option<i64>,
        after: Option<(i64, i64, u64)>,
        issued: i64,
    },
    /// FilterLogEvents: the query's events after `after` (timestamp, stream, k).
    Filter {
        streams: Option<Vec<String>>,
        start: Option<i64>,
        end: Option<i64>,
        after: (i64, String, i64, u64),
        issued: i64,
    },
}

/// An event to delete for the retention: when, its stream, its key, its name.
type Deletion = (i64, String, (i64, i64, u64), String);

#[derive(Debug, Default)]
struct State {
    group: String,
    /// Stream name -> its events in timestamp order (timestamp, ingestion, k).
    streams: BTreeMap<String, Vec<LogEvent>>,
    created: BTreeMap<String, i64>,
    /// Stream name -> the ingestion time of each batch put (ascending), for `lastIngestionTime`.
    ingested: BTreeMap<String, Vec<i64>>,
    /// How long after an ingestion DescribeLogStreams' `lastIngestionTime` shows it (AWS:
    /// "typically in less than an hour").
    activity_lag_ms: i64,
    /// How long after its ingestion a batch put now becomes readable by GetLogEvents (AWS states
    /// no bound), and when each stream's newest batch becomes readable: a stream's batches
    /// become readable in the order they were ingested.
    readable_delay_ms: i64,
    readable: BTreeMap<String, i64>,
    /// A lag of the group's search index (FilterLogEvents): with one, a batch put becomes
    /// searchable `lag` after its ingestion and not before the batches ingested before it, in
    /// any stream; the delay each put names is then ignored.
    search_lag_ms: Option<i64>,
    searchable_from: i64,
    tokens: HashMap<String, Token>,
    minted: u64,
    events_put: u64,
    /// Request times of the last second, by operation.
    recent: BTreeMap<String, VecDeque<i64>>,
    /// Until when every read is throttled (a lasting throttle of the account).
    throttled_until: i64,
    counts: Counts,
    /// The group's retention in days (`None`: never expire).
    retention_days: Option<i64>,
    /// Events to delete for the retention: (when, stream, key, name).
    deletions: BTreeSet<Deletion>,
    /// Names (`stream/id`, and the `eventId`) of the events deleted for the retention.
    deleted: Arc<Mutex<BTreeSet<String>>>,
}

/// What the service answered, counted.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Counts {
    pub requests: u64,
    pub throttled: u64,
    pub expired_tokens: u64,
    pub not_found: u64,
    /// Events returned by GetLogEvents and FilterLogEvents (a read again counts again).
    pub events: u64,
    /// DescribeLogStreams requests (listings and look-ups of one stream).
    pub describe_log_streams: u64,
    /// GetLogEvents requests, by stream.
    pub get_log_events: BTreeMap<String, u64>,
    /// Bytes of the events put (each its message and 26 bytes, as PutLogEvents counts them).
    pub bytes_put: u64,
    /// Bytes of the events GetLogEvents and FilterLogEvents returned, counted the same way.
    pub bytes_read: u64,
}

/// The service. Clones share it.
#[derive(Debug, Clone)]
pub struct LogsService {
    state: Arc<Mutex<State>>,
    base_ms: i64,
    start: Instant,
}

/// An answer: a status and a JSON body.
type Answer = (u16, Value);

fn error(kind: &str, message: &str) -> Answer {
    (400, json!({ "__type": kind, "message": message }))
}

impl LogsService {
    /// A service whose clock reads `base_ms` now, with an empty log group `group`.
    pub fn new(group: &str, base_ms: i64) -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                group: group.to_string(),
                ..State::default()
            })),
            base_ms,
            start: Instant::now(),
        }
    }

    /// The service's clock (ms since the epoch): the simulation's.
    pub fn now(&self) -> i64 {
        self.base_ms + (Instant::now() - self.start).as_millis() as i64
    }

    /// A client of the real SDK that reaches this service.
    pub fn client(&self) -> Client {
        use aws_sdk_cloudwatchlogs::config::{
            BehaviorVersion, Region, StalledStreamProtectionConfig,
        };
        // Unsigned (no credentials, no SigV4): the service in memory checks no signature, and
        // signing took a twelfth of a long logs seed's time.
        let config = aws_sdk_cloudwatchlogs::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new("us-east-1"))
            .allow_no_auth()
            .endpoint_url("http://logs.sim")
            .http_client(SharedHttpClient::new(Connector(self.clone())))
            .retry_config(aws_sdk_cloudwatchlogs::config::retry::RetryConfig::disabled())
            .stalled_stream_protection(StalledStreamProtectionConfig::disabled())
            .build();
        Client::from_conf(config)
    }

    /// [`client`](Self::client) with the SDK's retries as an application's client has them by
    /// default (standard mode, 3 attempts): what the sources must not leave to the SDK.
    #[allow(dead_code)]
    pub fn client_with_sdk_retries(&self) -> Client {
        let config = self
            .client()
            .config()
            .to_builder()
            .retry_config(aws_sdk_cloudwatchlogs::config::retry::RetryConfig::standard())
            .build();
        Client::from_conf(config)
    }

    pub fn create_stream(&self, stream: &str) {
        let now = self.now();
        let mut state = self.state.lock().unwrap();
        state.streams.entry(stream.to_string()).or_default();
        state.created.entry(stream.to_string()).or_insert(now);
    }

    /// Gives the group a retention of `days` (PutRetentionPolicy).
    pub fn set_retention(&self, days: i64) {
        self.state.lock().unwrap().retention_days = Some(days);
    }

    /// The names (`stream/id`) of the events deleted for the retention so far, shared: it grows.
    pub fn deleted(&self) -> Arc<Mutex<BTreeSet<String>>> {
        self.state.lock().unwrap().deleted.clone()
    }

    /// Deletes the events whose time has come (every request does this first).
    pub fn sweep(&self) {
        let now = self.now();
        self.state.lock().unwrap().sweep(now);
    }

    /// Deletes a stream and its events; returns the events it held.
    /// Deletes the stream's first event with this message now, as the group's retention deletes
    /// each event at its own time.
    #[allow(dead_code)]
    pub fn delete_event(&self, stream: &str, message: &str) -> Option<LogEvent> {
        let mut state = self.state.lock().unwrap();
        let events = state.streams.get_mut(stream)?;
        let at = events.iter().position(|e| e.message == message)?;
        let event = events.remove(at);
        let mut deleted = state.deleted.lock().unwrap();
        deleted.insert(format!("{stream}/{}", event.id));
        deleted.insert(event.event_id.clone());
        drop(deleted);
        Some(event)
    }

    /// The `n` streams created last (fewer when there are fewer), newest first.
    #[allow(dead_code)]
    pub fn newest_streams(&self, n: usize) -> Vec<String> {
        let state = self.state.lock().unwrap();
        let mut by_creation: Vec<(&i64, &String)> =
            state.created.iter().map(|(name, at)| (at, name)).collect();
        by_creation.sort_unstable_by(|a, b| b.cmp(a));
        by_creation
            .into_iter()
            .take(n)
            .map(|(_, name)| name.clone())
            .collect()
    }

    /// DescribeLogStreams' `lastIngestionTime` shows an ingestion only `lag` after it.
    #[allow(dead_code)]
    pub fn set_activity_lag(&self, lag: Duration) {
        self.state.lock().unwrap().activity_lag_ms = lag.as_millis() as i64;
    }

    /// GetLogEvents returns a batch put from now on only `delay` after its ingestion (and after
    /// the stream's batches ingested before it).
    #[allow(dead_code)]
    pub fn set_readability_delay(&self, delay: Duration) {
        self.state.lock().unwrap().readable_delay_ms = delay.as_millis() as i64;
    }

    /// FilterLogEvents finds a batch put from now on only `lag` after its ingestion, and after
    /// the group's batches ingested before it (an index that lags, in order).
    #[allow(dead_code)]
    pub fn set_search_lag(&self, lag: Duration) {
        self.state.lock().unwrap().search_lag_ms = Some(lag.as_millis() as i64);
    }

    pub fn delete_stream(&self, stream: &str) -> Vec<LogEvent> {
        let mut state = self.state.lock().unwrap();
        state.readable.remove(stream);
        state.created.remove(stream);
        state.ingested.remove(stream);
        state.streams.remove(stream).unwrap_or_default()
    }

    /// PutLogEvents of one batch: `(timestamp, message)` each, ingested now, searchable after
    /// `delay`. Refuses (returns `None`) what the service refuses: a missing stream, an event more
    /// than 14 days old or 2 hours ahead.
    pub fn put(
        &self,
        stream: &str,
        batch: &[(i64, String)],
        delay: Duration,
    ) -> Option<Vec<LogEvent>> {
        let now = self.now();
        let mut state = self.state.lock().unwrap();
        let kept = state
            .retention_days
            .map_or(MAX_AGE.as_millis() as i64, |d| d * 86_400_000);
        if batch.iter().any(|(t, _)| {
            *t < now - (MAX_AGE.as_millis() as i64).min(kept) || *t > now + 2 * 3600 * 1000
        }) {
            return None;
        }
        if !batch.is_empty() && state.streams.contains_key(stream) {
            state
                .ingested
                .entry(stream.to_string())
                .or_default()
                .push(now);
        }
        // Readable after the delay, and not before the stream's batches ingested before it.
        let readable = match state.readable.get(stream) {
            Some(before) => (*before).max(now + state.readable_delay_ms),
            None => now + state.readable_delay_ms,
        };
        if !batch.is_empty() && state.streams.contains_key(stream) {
            state.readable.insert(stream.to_string(), readable);
        }
        let searchable = match state.search_lag_ms {
            Some(lag) => {
                let at = (now + lag).max(state.searchable_from);
                state.searchable_from = at;
                at
            }
            None => now + delay.as_millis() as i64,
        };
        let mut stored = Vec::new();
        for (timestamp, message) in batch {
            state.events_put += 1;
            state.counts.bytes_put += (message.len() + EVENT_OVERHEAD) as u64;
            let event_id = format!("{:020}", state.events_put);
            let events = state.streams.get_mut(stream)?;
            // The stream is in key order: those with this timestamp and ingestion time are a run.
            let group = events.partition_point(|e| (e.timestamp, e.ingestion) < (*timestamp, now))
                ..events.partition_point(|e| (e.timestamp, e.ingestion) <= (*timestamp, now));
            let k = group.len() as u64;
            let occurrence = events[group]
                .iter()
                .filter(|e| e.message == *message)
                .count() as u64;
            // The name and the place the GetLogEvents source gives it.
            let (id, position) =
                shardwise::paged::log_event_identity(*timestamp, now, message, occurrence);
            let event = LogEvent {
                id,
                position,
                stream: stream.to_string(),
                timestamp: *timestamp,
                ingestion: now,
                k,
                occurrence,
                searchable,
                readable,
                event_id,
                message: message.clone(),
            };
            let at = events.partition_point(|e| e.key() <= event.key());
            events.insert(at, event.clone());
            if let Some(days) = state.retention_days {
                // Its own time within the deletion delay, drawn from its eventId.
                let mut hasher = std::collections::hash_map::DefaultHasher::new();
                std::hash::Hash::hash(&event.event_id, &mut hasher);
                let lag = (std::hash::Hasher::finish(&hasher) % DELETION_DELAY_MS as u64) as i64;
                let when = event.timestamp + days * 86_400_000 + lag;
                let name = format!("{stream}/{}", event.id);
                state
                    .deletions
                    .insert((when, stream.to_string(), event.key(), name));
            }
            stored.push(event);
        }
        Some(stored)
    }

    /// Forgets what a long run will not read again: the events stamped and ingested before
    /// `before` (ms), and the tokens issued before it. A day's events fill gigabytes; a benchmark
    /// that reads only the last hour or two keeps the service's memory flat with this.
    #[allow(dead_code)]
    pub fn forget_before(&self, before: i64) {
        let mut state = self.state.lock().unwrap();
        for events in state.streams.values_mut() {
            events.retain(|e| e.timestamp >= before || e.ingestion >= before);
            events.shrink_to(events.len() * 5 / 4);
        }
        state.tokens.retain(|_, token| match token {
            Token::Forward { issued, .. } | Token::Filter { issued, .. } => *issued >= before,
        });
        let tokens = state.tokens.len();
        state.tokens.shrink_to(tokens * 5 / 4);
    }

    /// The bytes the service holds on the heap (events and tokens), counted from the capacities
    /// of what it keeps: a benchmark subtracts it to measure the consumer beside it.
    #[allow(dead_code)]
    pub fn held_bytes(&self) -> usize {
        let state = self.state.lock().unwrap();
        let events: usize = state
            .streams
            .iter()
            .map(|(name, events)| {
                name.capacity()
                    + events.capacity() * std::mem::size_of::<LogEvent>()
                    + events
                        .iter()
                        .map(|e| {
                            e.id.capacity()
                                + e.stream.capacity()
                                + e.event_id.capacity()
                                + e.message.capacity()
                        })
                        .sum::<usize>()
            })
            .sum();
        let tokens: usize = state.tokens.capacity()
            * (std::mem::size_of::<String>() + std::mem::size_of::<Token>() + 1)
            + state
                .tokens
                .iter()
                .map(|(name, token)| {
                    name.capacity()
                        + match token {
                            Token::Forward { stream, .. } => stream.capacity(),
                            Token::Filter { streams, after, .. } => {
                                after.1.capacity()
                                    + streams
                                        .as_ref()
                                        .map_or(0, |s| s.iter().map(|n| n.capacity() + 24).sum())
                            }
                        }
                })
                .sum::<usize>();
        events + tokens
    }

    /// Every read is throttled until `until` (ms).
    pub fn throttle_until(&self, until: i64) {
        self.state.lock().unwrap().throttled_until = until;
    }

    pub fn streams(&self) -> Vec<String> {
        self.state.lock().unwrap().streams.keys().cloned().collect()
    }

    /// The events of `stream`, in the service's order (tests/cloudwatch_memory.rs reads them).
    #[allow(dead_code)]
    pub fn events(&self, stream: &str) -> Vec<LogEvent> {
        self.state
            .lock()
            .unwrap()
            .streams
            .get(stream)
            .cloned()
            .unwrap_or_default()
    }

    pub fn counts(&self) -> Counts {
        self.state.lock().unwrap().counts.clone()
    }

    fn answer(&self, operation: &str, request: &Value) -> Answer {
        let now = self.now();
        let mut state = self.state.lock().unwrap();
        state.sweep(now);
        state.counts.requests += 1;
        if operation == "DescribeLogStreams" {
            state.counts.describe_log_streams += 1;
        }
        if operation == "GetLogEvents" {
            let stream = request["logStreamName"].as_str().unwrap_or_default();
            *state
                .counts
                .get_log_events
                .entry(stream.to_string())
                .or_default() += 1;
        }
        if let Some(limit) = quota(operation) {
            let throttled = now < state.throttled_until;
            let recent = state.recent.entry(operation.to_string()).or_default();
            while recent.front().is_some_and(|t| *t <= now - 1_000) {
                recent.pop_front();
            }
            if recent.len() >= limit || throttled {
                state.counts.throttled += 1;
                return error("ThrottlingException", "Rate exceeded");
            }
            recent.push_back(now);
        }
        if operation == "DescribeLogGroups" {
            // The group, when the prefix names it (the filter source looks for its group).
            let prefix = request["logGroupNamePrefix"].as_str().unwrap_or_default();
            let groups: Vec<Value> = Some(state.group.as_str())
                .filter(|g| g.starts_with(prefix))
                .map(|g| match state.retention_days {
                    Some(days) => json!({ "logGroupName": g, "retentionInDays": days }),
                    None => json!({ "logGroupName": g }),
                })
                .into_iter()
                .collect();
            return (200, json!({ "logGroups": groups }));
        }
        if request["logGroupName"].as_str() != Some(state.group.as_str()) {
            state.counts.not_found += 1;
            return error(
                "ResourceNotFoundException",
                "The specified log group does not exist.",
            );
        }
        let answer = match operation {
            "GetLogEvents" => state.get_log_events(request, now),
            "FilterLogEvents" => state.filter_log_events(request, now),
            "DescribeLogStreams" => state.describe_log_streams(request, now),
            other => error(
                "InvalidAction",
                &format!("the simulated service does not serve {other}"),
            ),
        };
        if let Some(events) = answer.1["events"].as_array() {
            state.counts.events += events.len() as u64;
            state.counts.bytes_read += events
                .iter()
                .map(|e| e["message"].as_str().map_or(0, str::len) + EVENT_OVERHEAD)
                .sum::<usize>() as u64;
        }
        answer
    }
}

impl State {
    /// Deletes the events whose retention and deletion delay have passed.
    fn sweep(&mut self, now: i64) {
        while let Some((when, ..)) = self.deletions.first()
            && *when <= now
        {
            let (_, stream, key, name) = self.deletions.pop_first().expect("first");
            if let Some(events) = self.streams.get_mut(&stream)
                && let Ok(at) = events.binary_search_by(|e| e.key().cmp(&key))
            {
                let event = events.remove(at);
                let mut deleted = self.deleted.lock().unwrap();
                deleted.insert(name);
                // By the name the FilterLogEvents source gives it too.
                deleted.insert(event.event_id);
            }
        }
    }

    fn mint(&mut self, token: Token, prefix: &str) -> String {
        self.minted += 1;
        let name = format!("{prefix}/{:056}", self.minted);
        self.tokens.insert(name.clone(), token);
        name
    }

    fn expired(&mut self) -> Answer {
        self.counts.expired_tokens += 1;
        error(
            "InvalidParameterException",
            "The specified nextToken has expired.",
        )
    }

    fn get_log_events(&mut self, request: &Value, now: i64) -> Answer {
        let Some(stream) = request["logStreamName"].as_str().map(str::to_string) else {
            return error("InvalidParameterException", "logStreamName is required");
        };
        if request["startFromHead"].as_bool() != Some(true) {
            return error(
                "InvalidParameterException",
                "the simulated service reads forward only (startFromHead)",
            );
        }
        let limit = request["limit"]
            .as_u64()
            .map_or(PAGE_EVENTS, |l| (l as usize).min(PAGE_EVENTS));
        let given = request["nextToken"].as_str().map(str::to_string);
        let (start, after) = match &given {
            None => (request["startTime"].as_i64(), None),
            Some(name) => match self.tokens.get(name) {
                Some(Token::Forward {
                    stream: s,
                    created,
                    start,
                    after,
                    issued,
                }) if *s == stream && self.created.get(&stream) == Some(created) => {
                    if now - issued >= TOKEN_LIFETIME.as_millis() as i64 {
                        return self.expired();
                    }
                    (*start, *after)
                }
                _ => {
                    return error(
                        "InvalidParameterException",
                        "The specified nextToken is invalid.",
                    );
                }
            },
        };
        let Some(events) = self.streams.get(&stream) else {
            self.counts.not_found += 1;
            return error(
                "ResourceNotFoundException",
                "The specified log stream does not exist.",
            );
        };
        // endTime: "Events with a timestamp equal to or later than this time are not included."
        let end = request["endTime"].as_i64();
        let mut page = Vec::new();
        let mut bytes = 0;
        // The first event past the token and at or after the start (the stream is in key order).
        let from = after
            .map_or(0, |a| events.partition_point(|e| e.key() <= a))
            .max(start.map_or(0, |s| events.partition_point(|e| e.timestamp < s)));
        for event in &events[from..] {
            if end.is_some_and(|end| event.timestamp >= end) {
                break;
            }
            // Not readable yet: a token issued past a later event never returns it.
            if event.readable > now {
                continue;
            }
            if page.len() == limit || bytes + event.size() > PAGE_BYTES {
                break;
            }
            bytes += event.size();
            page.push(event.clone());
        }
        let forward = match (page.last(), given) {
            // The end of the stream: the token passed in comes back (it keeps its age).
            (None, Some(given)) => given,
            (last, _) => self.mint(
                Token::Forward {
                    created: self.created.get(&stream).copied().unwrap_or_default(),
                    stream,
                    start,
                    after: last.map(LogEvent::key).or(after),
                    issued: now,
                },
                "f",
            ),
        };
        let events: Vec<Value> = page
            .iter()
            .map(|e| {
                json!({ "timestamp": e.timestamp, "message": e.message, "ingestionTime": e.ingestion })
            })
            .collect();
        (
            200,
            json!({ "events": events, "nextForwardToken": forward, "nextBackwardToken": "b/0" }),
        )
    }

    fn filter_log_events(&mut self, request: &Value, now: i64) -> Answer {
        let limit = request["limit"]
            .as_u64()
            .map_or(PAGE_EVENTS, |l| (l as usize).min(PAGE_EVENTS));
        let (streams, start, end, after) = match request["nextToken"].as_str() {
            None => (
                request["logStreamNames"].as_array().map(|names| {
                    names
                        .iter()
                        .filter_map(|n| n.as_str().map(str::to_string))
                        .collect::<Vec<_>>()
                }),
                request["startTime"].as_i64(),
                request["endTime"].as_i64(),
                None,
            ),
            Some(name) => match self.tokens.get(name) {
                Some(Token::Filter {
                    streams,
                    start,
                    end,
                    after,
                    issued,
                }) => {
                    if now - issued >= TOKEN_LIFETIME.as_millis() as i64 {
                        return self.expired();
                    }
                    (streams.clone(), *start, *end, Some(after.clone()))
                }
                _ => {
                    return error(
                        "InvalidParameterException",
                        "The specified nextToken is invalid.",
                    );
                }
            },
        };
        // The answer's order is (timestamp, stream, ingestion, k); each stream is in the order
        // (timestamp, ingestion, k), so the page is a merge of the streams, each from its first
        // event past the token and at or after the start.
        let order = |e: &LogEvent| (e.timestamp, e.stream.clone(), e.ingestion, e.k);
        let mut runs: Vec<Run<'_>> = self
            .streams
            .iter()
            .filter(|(name, _)| streams.as_ref().is_none_or(|s| s.contains(name)))
            .map(|(name, events)| {
                let past_token = after.as_ref().map_or(0, |(t, s, i, k)| {
                    events.partition_point(|e| match name.cmp(s) {
                        std::cmp::Ordering::Less => e.timestamp <= *t,
                        std::cmp::Ordering::Greater => e.timestamp < *t,
                        std::cmp::Ordering::Equal => e.key() <= (*t, *i, *k),
                    })
                });
                let from = past_token
                    .max(start.map_or(0, |s| events.partition_point(|e| e.timestamp < s)));
                events[from..].iter().peekable()
            })
            .collect();
        // Each run's next event that is searchable and not past the end, in a heap by order.
        type Run<'a> = std::iter::Peekable<std::slice::Iter<'a, LogEvent>>;
        fn head<'a>(
            run: &mut Run<'a>,
            now: i64,
            end: Option<i64>,
        ) -> Option<(i64, &'a str, i64, u64)> {
            while run.peek().is_some_and(|e| e.searchable > now) {
                run.next();
            }
            run.peek()
                .copied()
                .filter(|e| end.is_none_or(|t| e.timestamp <= t))
                .map(|e| (e.timestamp, e.stream.as_str(), e.ingestion, e.k))
        }
        let mut heads = std::collections::BinaryHeap::new();
        for (i, run) in runs.iter_mut().enumerate() {
            if let Some(h) = head(run, now, end) {
                heads.push(std::cmp::Reverse((h, i)));
            }
        }
        let mut found = Vec::new();
        let mut more = false;
        while let Some(std::cmp::Reverse((_, i))) = heads.pop() {
            if found.len() == limit {
                more = true;
                break;
            }
            found.push(runs[i].next().expect("a head"));
            if let Some(h) = head(&mut runs[i], now, end) {
                heads.push(std::cmp::Reverse((h, i)));
            }
        }
        let mut page = Vec::new();
        let mut bytes = 0;
        for event in &found {
            if bytes + event.size() > PAGE_BYTES {
                more = true;
                break;
            }
            bytes += event.size();
            page.push((*event).clone());
        }
        let next = more.then(|| {
            let last = page.last().expect("a page before the rest");
            self.mint(
                Token::Filter {
                    streams,
                    start,
                    end,
                    after: order(last),
                    issued: now,
                },
                "n",
            )
        });
        let events: Vec<Value> = page
            .iter()
            .map(|e| {
                json!({
                    "logStreamName": e.stream,
                    "timestamp": e.timestamp,
                    "message": e.message,
                    "ingestionTime": e.ingestion,
                    "eventId": e.event_id,
                })
            })
            .collect();
        let mut body = json!({ "events": events, "searchedLogStreams": [] });
        if let Some(next) = next {
            body["nextToken"] = json!(next);
        }
        (200, body)
    }

    /// Pages of at most `limit` streams (default and most: 50), in name order; the token names
    /// the last stream of the page before.
    fn describe_log_streams(&mut self, request: &Value, now: i64) -> Answer {
        let limit = request["limit"].as_u64().map_or(50, |l| l.min(50)) as usize;
        let after = request["nextToken"]
            .as_str()
            .map(|t| t.trim_start_matches("d/"));
        let prefix = request["logStreamNamePrefix"].as_str().unwrap_or_default();
        let names: Vec<&String> = self
            .streams
            .keys()
            .filter(|name| after.is_none_or(|a| name.as_str() > a))
            .filter(|name| name.starts_with(prefix))
            .collect();
        let page = &names[..limit.min(names.len())];
        let streams: Vec<Value> = page
            .iter()
            .map(|name| {
                let mut stream = json!({
                    "logStreamName": name,
                    "creationTime": self.created.get(*name).copied().unwrap_or_default(),
                });
                // The newest ingestion the lag lets show.
                let shown = now - self.activity_lag_ms;
                if let Some(times) = self.ingested.get(*name) {
                    let before = times.partition_point(|t| *t <= shown);
                    if before > 0 {
                        stream["lastIngestionTime"] = json!(times[before - 1]);
                    }
                }
                stream
            })
            .collect();
        let mut answer = json!({ "logStreams": streams });
        if names.len() > page.len() {
            answer["nextToken"] = json!(format!("d/{}", page.last().expect("a full page")));
        }
        (200, answer)
    }
}

/// The SDK's HTTP client, answered by the service in memory.
#[derive(Debug, Clone)]
struct Connector(LogsService);

impl HttpConnector for Connector {
    fn call(&self, request: HttpRequest) -> HttpConnectorFuture {
        let operation = request
            .headers()
            .get("x-amz-target")
            .and_then(|t| t.strip_prefix("Logs_20140328."))
            .unwrap_or_default()
            .to_string();
        let body: Value = request
            .body()
            .bytes()
            .and_then(|b| serde_json::from_slice(b).ok())
            .unwrap_or(Value::Null);
        let (status, answer) = self.0.answer(&operation, &body);
        let mut response = HttpResponse::new(
            status.try_into().expect("a status"),
            SdkBody::from(answer.to_string()),
        );
        response
            .headers_mut()
            .insert("content-type", "application/x-amz-json-1.1");
        // The service's clock, in whole seconds, as every AWS answer carries it.
        let date = aws_smithy_types::DateTime::from_millis(self.0.now())
            .fmt(aws_smithy_types::date_time::Format::HttpDate)
            .expect("an HTTP date");
        response.headers_mut().insert("date", date);
        HttpConnectorFuture::ready(Ok(response))
    }
}

impl HttpClient for Connector {
    fn http_connector(
        &self,
        _: &HttpConnectorSettings,
        _: &RuntimeComponents,
    ) -> SharedHttpConnector {
        SharedHttpConnector::new(self.clone())
    }
}
