//! A scripted paged event API: partitions of events over a stable total order, read page by page
//! with opaque tokens, and scripts for every misbehaviour a paged consumer must survive (seed 003):
//! - a page replayed;
//! - pages that overlap;
//! - empty pages with advancing tokens;
//! - a token that does not advance;
//! - a response lost after it was served;
//! - throttling;
//! - events added while a traversal runs.
//!
//! It also serves partitions by timestamp (seed 000), with offset pages over the events strictly
//! after a timestamp: [`Ties`] says whether tied events keep their order between requests, and
//! [`EventApi::snapshots`] makes each poll's pages read one snapshot.
//!
//! In memory it is a [`PagedSource`] itself. [`EventApi::serve`] puts it behind a real HTTP server,
//! and [`HttpEvents`](super::HttpEvents) reads that server.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

use bytes::Bytes;
use futures::future::BoxFuture;

use crate::error::Error;
use crate::paged::{Contract, Cursor, FetchError, Page, PagePosition, PagedEvent, PagedSource};

/// A one-shot misbehaviour, taken by the next fetch of its partition.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Script {
    /// The page served before is served again: its events and the token it returned then (when it
    /// starts at or before the requested place; otherwise the page is served as asked).
    ReplayPrevious,
    /// The page starts this many events before the requested place (an overlap).
    Overlap(usize),
    /// No events and a new token for the same place.
    EmptyAdvancing,
    /// No events and the request's token again.
    Unchanged,
    /// The page is made (a token allocated) but the answer is lost: the fetch fails.
    LoseResponse,
    /// The fetch is throttled.
    Throttle,
}

/// How events that share a timestamp are ordered in offset pages by timestamp.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Ties {
    /// By identity, the same on every request.
    #[default]
    Stable,
    /// Each request rotates every tie group by one more place (seed 000: A, B, C, then C, A, B):
    /// an unchanged set whose offset pages can skip an event.
    Rotate,
}

/// One request of an offset page by timestamp, as the source's cursor carries it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AfterQuery {
    /// Events strictly after this timestamp (ms); `None`: all.
    pub(crate) after: Option<i64>,
    /// The page starts at this offset into them.
    pub(crate) offset: usize,
    /// The snapshot a poll reads, once its first page made one.
    pub(crate) snapshot: Option<u64>,
}

impl AfterQuery {
    /// The cursor: `after=T;offset=N;snapshot=S` (`-` for none).
    pub(crate) fn cursor(&self) -> Cursor {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        Cursor::new(format!(
            "after={};offset={};snapshot={}",
            opt(self.after.map(|a| a.to_string())),
            self.offset,
            opt(self.snapshot.map(|s| s.to_string()))
        ))
    }

    /// The query of a cursor made by [`cursor`](Self::cursor).
    pub(crate) fn parse(cursor: &Cursor) -> Option<Self> {
        let text = std::str::from_utf8(cursor.as_bytes()).ok()?;
        let mut parts = text.split(';');
        let mut field = |name: &str| {
            parts
                .next()?
                .strip_prefix(name)?
                .strip_prefix('=')
                .map(str::to_string)
        };
        let after = field("after")?;
        let offset = field("offset")?.parse().ok()?;
        let snapshot = field("snapshot")?;
        let opt =
            |v: String| -> Option<Option<String>> { Some(if v == "-" { None } else { Some(v) }) };
        Some(Self {
            after: match opt(after)? {
                None => None,
                Some(a) => Some(a.parse().ok()?),
            },
            offset,
            snapshot: match opt(snapshot)? {
                None => None,
                Some(s) => Some(s.parse().ok()?),
            },
        })
    }
}

/// One offset page by timestamp.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AfterPage {
    pub(crate) events: Vec<PagedEvent>,
    /// Where the next page starts; `None`: the poll's last page.
    pub(crate) next_offset: Option<usize>,
    /// The snapshot the next pages read.
    pub(crate) snapshot: Option<u64>,
    /// The partition's finality watermark, when one is set.
    pub(crate) watermark: Option<i64>,
}

impl AfterPage {
    pub(crate) fn page(self, query: &AfterQuery) -> Page {
        Page {
            events: self.events,
            next: self.next_offset.map(|offset| {
                AfterQuery {
                    after: query.after,
                    offset,
                    snapshot: self.snapshot,
                }
                .cursor()
            }),
            watermark: self.watermark,
        }
    }
}

/// One event as the API stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScriptedEvent {
    /// Its identity.
    pub id: String,
    /// Its position (a number).
    pub position: u64,
    /// Its payload.
    pub payload: Bytes,
    /// Its timestamp.
    pub timestamp: Option<SystemTime>,
    /// Its ordering key.
    pub key: Option<String>,
}

impl ScriptedEvent {
    fn paged(&self) -> PagedEvent {
        PagedEvent {
            id: self.id.clone(),
            position: PagePosition::from_u64(self.position),
            payload: self.payload.clone(),
            timestamp: self.timestamp,
            key: self.key.clone(),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    partitions: BTreeMap<String, Vec<ScriptedEvent>>,
    page_size: usize,
    /// Token -> (partition, index of the first event it reads).
    tokens: HashMap<String, (String, usize)>,
    minted: u64,
    salt: u64,
    scripts: BTreeMap<String, VecDeque<Script>>,
    /// The last page served per partition: (first index, end index, the token it returned).
    last: BTreeMap<String, (usize, usize, String)>,
    fetches: u64,
    ties: Ties,
    snapshots_enabled: bool,
    /// Snapshot id -> the events strictly after a poll's timestamp, in the order served.
    snapshots: HashMap<u64, Vec<ScriptedEvent>>,
    watermarks: BTreeMap<String, i64>,
    /// The timestamp each poll by timestamp started after, per partition.
    polls: BTreeMap<String, Vec<Option<i64>>>,
}

impl State {
    /// A fresh opaque token for `index` of `partition`.
    fn mint(&mut self, partition: &str, index: usize) -> String {
        self.minted += 1;
        // SplitMix64 of the counter: tokens are unguessable-looking and never in order.
        let mut z = self.salt ^ self.minted.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        let token = format!("{:016x}{:04x}", z ^ (z >> 31), self.minted & 0xffff);
        self.tokens
            .insert(token.clone(), (partition.to_string(), index));
        token
    }
}

/// A scripted paged event API in memory. Clones share the same partitions.
///
/// ```
/// use shardwise::paged::PagedSource;
/// use shardwise::testing::{EventApi, Script};
/// # futures::executor::block_on(async {
/// let api = EventApi::new("events").page_size(2);
/// for n in 0..3 {
///     api.push("tenant-1", format!("event {n}"));
/// }
/// let first = api.fetch("tenant-1", None).await.unwrap();
/// assert_eq!(first.events.len(), 2);
/// api.script("tenant-1", Script::Overlap(1));
/// let second = api.fetch("tenant-1", first.next.as_ref()).await.unwrap();
/// assert_eq!(second.events[0].id, first.events[1].id, "the overlap repeats one event");
/// # });
/// ```
#[derive(Clone)]
pub struct EventApi {
    name: Arc<str>,
    contract: Contract,
    retention: crate::receipts::SourceRetention,
    state: Arc<Mutex<State>>,
}

impl fmt::Debug for EventApi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventApi")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl EventApi {
    /// An API named `name` (the source name lease rows carry), with no partitions, pages of 100
    /// events, and dense positions (every position the next number).
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        Self {
            name: name.into(),
            contract: Contract::default().dense(true),
            retention: crate::receipts::SourceRetention::Unknown,
            state: Arc::new(Mutex::new(State {
                page_size: 100,
                salt: 0x5eed_0003,
                ..State::default()
            })),
        }
    }

    /// The contract the API declares.
    pub fn contract(mut self, contract: Contract) -> Self {
        self.contract = contract;
        self
    }

    /// How long the API says it keeps events (default: it does not say). It deletes none.
    pub fn keeps(mut self, retention: crate::receipts::SourceRetention) -> Self {
        self.retention = retention;
        self
    }

    /// Events per page at most.
    pub fn page_size(self, n: usize) -> Self {
        self.state().page_size = n.max(1);
        self
    }

    /// Adds an empty partition (a partition also appears with its first event).
    pub fn partition(&self, partition: &str) {
        self.state()
            .partitions
            .entry(partition.to_string())
            .or_default();
    }

    /// Appends an event at the next position (1 for the first), with the identity
    /// `PARTITION-POSITION`; returns its position.
    pub fn push(&self, partition: &str, payload: impl Into<Bytes>) -> u64 {
        let mut state = self.state();
        let events = state.partitions.entry(partition.to_string()).or_default();
        let position = events.last().map_or(1, |e| e.position + 1);
        events.push(ScriptedEvent {
            id: format!("{partition}-{position}"),
            position,
            payload: payload.into(),
            timestamp: Some(crate::time::service_now()),
            key: None,
        });
        position
    }

    /// Appends an event as it is (any position, any identity: gaps, conflicts and regressions
    /// are made this way).
    pub fn append(&self, partition: &str, event: ScriptedEvent) {
        self.state()
            .partitions
            .entry(partition.to_string())
            .or_default()
            .push(event);
    }

    /// Queues a one-shot misbehaviour for the next fetch of `partition`.
    pub fn script(&self, partition: &str, script: Script) {
        self.state()
            .scripts
            .entry(partition.to_string())
            .or_default()
            .push_back(script);
    }

    /// Drops every queued misbehaviour of every partition: the next fetches are served as asked.
    pub fn clear_scripts(&self) {
        self.state().scripts.clear();
    }

    /// The events of `partition`, in order.
    pub fn events(&self, partition: &str) -> Vec<ScriptedEvent> {
        self.state()
            .partitions
            .get(partition)
            .cloned()
            .unwrap_or_default()
    }

    /// A token that reads `partition` from its `index`-th event (0-based): for tests that start
    /// a partition somewhere (a stored cursor), and for seeks.
    pub fn cursor(&self, partition: &str, index: usize) -> Cursor {
        Cursor::new(self.state().mint(partition, index))
    }

    /// How tied events are ordered in offset pages by timestamp (default [`Ties::Stable`]).
    pub fn ties(self, ties: Ties) -> Self {
        self.state().ties = ties;
        self
    }

    /// Each poll by timestamp reads one snapshot, taken by its first page, whatever is added or
    /// reordered while it pages (a stable-snapshot traversal).
    pub fn snapshots(self, on: bool) -> Self {
        self.state().snapshots_enabled = on;
        self
    }

    /// Sets the watermark (ms) every page of `partition` reports from now on: by timestamp, a
    /// finality watermark; by token, a certified complete-through watermark (every event at or
    /// before it is in that page or an earlier one).
    pub fn watermark(&self, partition: &str, watermark_ms: i64) {
        self.state()
            .watermarks
            .insert(partition.to_string(), watermark_ms);
    }

    /// Appends an event of `partition` at the next position with this timestamp (ms) and identity.
    pub fn push_at(&self, partition: &str, id: &str, timestamp_ms: i64, payload: impl Into<Bytes>) {
        let mut state = self.state();
        let events = state.partitions.entry(partition.to_string()).or_default();
        let position = events.last().map_or(1, |e| e.position + 1);
        events.push(ScriptedEvent {
            id: id.to_string(),
            position,
            payload: payload.into(),
            timestamp: Some(crate::time::from_millis(timestamp_ms)),
            key: None,
        });
    }

    /// Where each poll by timestamp of `partition` started: the `after` of every first page
    /// requested, in order.
    pub fn polls(&self, partition: &str) -> Vec<Option<i64>> {
        self.state()
            .polls
            .get(partition)
            .cloned()
            .unwrap_or_default()
    }

    /// Fetches served so far (lost answers and throttled ones included).
    pub fn fetches(&self) -> u64 {
        self.state().fetches
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One offset page by timestamp, as the HTTP server serves it too.
    pub(crate) fn serve_after(
        &self,
        partition: &str,
        query: &AfterQuery,
    ) -> Result<AfterPage, FetchError> {
        let mut state = self.state();
        state.fetches += 1;
        let request = state.fetches;
        if !state.partitions.contains_key(partition) {
            return Err(FetchError::NotFound);
        }
        let script = state
            .scripts
            .get_mut(partition)
            .and_then(VecDeque::pop_front);
        match script {
            Some(Script::Throttle) => return Err(FetchError::Throttled),
            Some(Script::LoseResponse) => {
                return Err(FetchError::Other(
                    "the answer was lost after it was served".into(),
                ));
            }
            _ => {}
        }
        if query.offset == 0 && query.snapshot.is_none() {
            state
                .polls
                .entry(partition.to_string())
                .or_default()
                .push(query.after);
        }
        let ms = |e: &ScriptedEvent| e.timestamp.map_or(i64::MIN, crate::time::millis);
        let snapshot = match query.snapshot {
            Some(id) => match state.snapshots.get(&id) {
                Some(events) => Some((id, events.clone())),
                None => {
                    return Err(FetchError::InvalidCursor(
                        format!("no snapshot {id}").into(),
                    ));
                }
            },
            None => None,
        };
        let (snapshot, events) = match snapshot {
            Some((id, events)) => (Some(id), events),
            None => {
                let mut events: Vec<ScriptedEvent> = state.partitions[partition]
                    .iter()
                    .filter(|e| query.after.is_none_or(|after| ms(e) > after))
                    .cloned()
                    .collect();
                events.sort_by(|a, b| (ms(a), &a.id).cmp(&(ms(b), &b.id)));
                if state.ties == Ties::Rotate {
                    let shift = (request - 1) as usize;
                    for group in events.chunk_by_mut(|a, b| ms(a) == ms(b)) {
                        let len = group.len();
                        group.rotate_right(shift % len);
                    }
                }
                if state.snapshots_enabled {
                    let id = request;
                    state.snapshots.insert(id, events.clone());
                    // Polls in progress read the newest snapshots; older ones go.
                    if state.snapshots.len() > 64 {
                        let oldest = state.snapshots.keys().min().copied();
                        if let Some(oldest) = oldest {
                            state.snapshots.remove(&oldest);
                        }
                    }
                    (Some(id), events)
                } else {
                    (None, events)
                }
            }
        };
        let start = query.offset.min(events.len());
        let end = (start + state.page_size).min(events.len());
        Ok(AfterPage {
            events: events[start..end]
                .iter()
                .map(ScriptedEvent::paged)
                .collect(),
            next_offset: (end < events.len()).then_some(end),
            snapshot,
            watermark: state.watermarks.get(partition).copied(),
        })
    }

    /// One fetch, as the HTTP server serves it too.
    pub(crate) fn serve_fetch(
        &self,
        partition: &str,
        cursor: Option<&str>,
    ) -> Result<Page, FetchError> {
        let mut state = self.state();
        state.fetches += 1;
        let Some(len) = state.partitions.get(partition).map(Vec::len) else {
            return Err(FetchError::NotFound);
        };
        let index = match cursor {
            None => 0,
            Some(token) => match state.tokens.get(token) {
                Some((p, index)) if p == partition => *index,
                _ => {
                    return Err(FetchError::InvalidCursor(
                        format!("token `{token}` is not one of partition `{partition}`").into(),
                    ));
                }
            },
        };
        let script = state
            .scripts
            .get_mut(partition)
            .and_then(VecDeque::pop_front);
        let mut lose = false;
        let (start, end, token) = match script {
            Some(Script::Throttle) => return Err(FetchError::Throttled),
            Some(Script::EmptyAdvancing) => {
                let token = state.mint(partition, index);
                return Ok(Page {
                    events: Vec::new(),
                    next: Some(Cursor::new(token)),
                    watermark: state.watermarks.get(partition).copied(),
                });
            }
            Some(Script::Unchanged) => {
                let token = match cursor {
                    Some(token) => token.to_string(),
                    None => state.mint(partition, index),
                };
                return Ok(Page {
                    events: Vec::new(),
                    next: Some(Cursor::new(token)),
                    watermark: state.watermarks.get(partition).copied(),
                });
            }
            // A replay is stale: it never serves a page from beyond the requested place (that
            // would be a source skipping events, which no contract allows).
            Some(Script::ReplayPrevious)
                if state
                    .last
                    .get(partition)
                    .is_some_and(|(start, ..)| *start <= index) =>
            {
                state.last[partition].clone()
            }
            other => {
                let start = match other {
                    Some(Script::Overlap(n)) => index.saturating_sub(n),
                    _ => index,
                };
                lose = other == Some(Script::LoseResponse);
                let end = (start + state.page_size).min(len).max(index);
                if start >= len && cursor.is_some() {
                    if lose {
                        return Err(FetchError::Other(
                            "the answer was lost after it was served".into(),
                        ));
                    }
                    // Caught up: the request's token comes back (nothing new yet).
                    return Ok(Page {
                        events: Vec::new(),
                        next: cursor.map(|t| Cursor::new(t.to_string())),
                        watermark: state.watermarks.get(partition).copied(),
                    });
                }
                let token = state.mint(partition, end);
                (start, end, token)
            }
        };
        state
            .last
            .insert(partition.to_string(), (start, end, token.clone()));
        if lose {
            return Err(FetchError::Other(
                "the answer was lost after it was served".into(),
            ));
        }
        let events = state.partitions[partition][start..end]
            .iter()
            .map(ScriptedEvent::paged)
            .collect();
        Ok(Page {
            events,
            next: Some(Cursor::new(token)),
            watermark: state.watermarks.get(partition).copied(),
        })
    }
}

impl PagedSource for EventApi {
    fn name(&self) -> &str {
        &self.name
    }

    fn contract(&self) -> Contract {
        self.contract
    }

    fn retention(&self) -> BoxFuture<'_, Result<crate::receipts::SourceRetention, Error>> {
        Box::pin(std::future::ready(Ok(self.retention)))
    }

    fn partitions(&self) -> BoxFuture<'_, Result<Vec<String>, Error>> {
        Box::pin(async move { Ok(self.state().partitions.keys().cloned().collect()) })
    }

    fn fetch<'a>(
        &'a self,
        partition: &'a str,
        cursor: Option<&'a Cursor>,
    ) -> BoxFuture<'a, Result<Page, FetchError>> {
        Box::pin(async move {
            if let Some(query) = cursor.and_then(AfterQuery::parse) {
                return Ok(self.serve_after(partition, &query)?.page(&query));
            }
            let token = cursor.map(|c| String::from_utf8_lossy(c.as_bytes()).into_owned());
            self.serve_fetch(partition, token.as_deref())
        })
    }

    fn poll_after(&self, _partition: &str, after: Option<i64>) -> Option<Cursor> {
        Some(
            AfterQuery {
                after,
                offset: 0,
                snapshot: None,
            }
            .cursor(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(page: &Page) -> Vec<&str> {
        page.events.iter().map(|e| e.id.as_str()).collect()
    }

    /// Seed 000's counterexample, served: A, B, C at 10:01 and D at 10:02, pages of two. With
    /// rotating ties, the second request sees C, A, B, D and offset two returns B and D: C is never
    /// served. A snapshot per poll serves every event.
    #[tokio::test]
    async fn rotating_ties_skip_an_event_unless_the_poll_reads_a_snapshot() {
        let (t1, t2) = (36_060_000, 36_120_000);
        let fill = |api: &EventApi| {
            for (id, t) in [("A", t1), ("B", t1), ("C", t1), ("D", t2)] {
                api.push_at("p", id, t, id);
            }
        };
        let poll = |api: &EventApi| {
            let api = api.clone();
            async move {
                let mut cursor = api.poll_after("p", Some(36_000_000)).unwrap();
                let mut seen = Vec::new();
                loop {
                    let page = api.fetch("p", Some(&cursor)).await.unwrap();
                    seen.extend(names(&page).into_iter().map(str::to_string));
                    match page.next {
                        Some(next) => cursor = next,
                        None => return seen,
                    }
                }
            }
        };
        let rotating = EventApi::new("e").page_size(2).ties(Ties::Rotate);
        fill(&rotating);
        assert_eq!(poll(&rotating).await, ["A", "B", "B", "D"], "C is skipped");
        let snapshot = EventApi::new("e")
            .page_size(2)
            .ties(Ties::Rotate)
            .snapshots(true);
        fill(&snapshot);
        assert_eq!(poll(&snapshot).await, ["A", "B", "C", "D"]);
        let stable = EventApi::new("e").page_size(2);
        fill(&stable);
        assert_eq!(poll(&stable).await, ["A", "B", "C", "D"]);
        let after_10_01 = stable.poll_after("p", Some(t1)).unwrap();
        let page = stable.fetch("p", Some(&after_10_01)).await.unwrap();
        assert_eq!(
            (names(&page), &page.next),
            (vec!["D"], &None),
            "strictly after"
        );
        assert_eq!(
            AfterQuery::parse(&after_10_01).unwrap().after,
            Some(t1),
            "the cursor carries its query"
        );
    }

    fn ids(page: &Page) -> Vec<u64> {
        page.events
            .iter()
            .map(|e| e.position.as_u64().unwrap())
            .collect()
    }

    #[tokio::test]
    async fn pages_follow_tokens_and_each_script_misbehaves_once() {
        let api = EventApi::new("events").page_size(3);
        for n in 0..7 {
            api.push("p", format!("{n}"));
        }
        let p1 = api.fetch("p", None).await.unwrap();
        assert_eq!(ids(&p1), [1, 2, 3]);
        api.script("p", Script::Overlap(2));
        let p2 = api.fetch("p", p1.next.as_ref()).await.unwrap();
        assert_eq!(
            ids(&p2),
            [2, 3, 4],
            "two events before 4, then a page's worth"
        );
        api.script("p", Script::ReplayPrevious);
        let again = api.fetch("p", p2.next.as_ref()).await.unwrap();
        assert_eq!((ids(&again), &again.next), (ids(&p2), &p2.next));
        api.script("p", Script::EmptyAdvancing);
        let empty = api.fetch("p", p2.next.as_ref()).await.unwrap();
        assert!(empty.events.is_empty());
        assert_ne!(empty.next, p2.next, "a new token");
        let p3 = api.fetch("p", empty.next.as_ref()).await.unwrap();
        assert_eq!(
            ids(&p3),
            [5, 6, 7],
            "the new token reads from the same place"
        );
        api.script("p", Script::Unchanged);
        let stuck = api.fetch("p", p3.next.as_ref()).await.unwrap();
        assert_eq!((stuck.events.len(), &stuck.next), (0, &p3.next));
        // Caught up: the same token comes back until an event is added.
        let caught_up = api.fetch("p", p3.next.as_ref()).await.unwrap();
        assert_eq!(caught_up.next, p3.next);
        api.push("p", "8");
        let p4 = api.fetch("p", p3.next.as_ref()).await.unwrap();
        assert_eq!(ids(&p4), [8]);
        api.script("p", Script::LoseResponse);
        assert!(matches!(
            api.fetch("p", p4.next.as_ref()).await,
            Err(FetchError::Other(_))
        ));
        api.script("p", Script::Throttle);
        assert!(matches!(
            api.fetch("p", p4.next.as_ref()).await,
            Err(FetchError::Throttled)
        ));
        assert!(matches!(
            api.fetch("q", None).await,
            Err(FetchError::NotFound)
        ));
        let foreign = Cursor::new("not-a-token");
        assert!(matches!(
            api.fetch("p", Some(&foreign)).await,
            Err(FetchError::InvalidCursor(_))
        ));
    }
}
