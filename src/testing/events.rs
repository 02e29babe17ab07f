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
            timestamp: Some(crate::time::now()),
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

    /// Fetches served so far (lost answers and throttled ones included).
    pub fn fetches(&self) -> u64 {
        self.state().fetches
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
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

    fn partitions(&self) -> BoxFuture<'_, Result<Vec<String>, Error>> {
        Box::pin(async move { Ok(self.state().partitions.keys().cloned().collect()) })
    }

    fn fetch<'a>(
        &'a self,
        partition: &'a str,
        cursor: Option<&'a Cursor>,
    ) -> BoxFuture<'a, Result<Page, FetchError>> {
        Box::pin(async move {
            let token = cursor.map(|c| String::from_utf8_lossy(c.as_bytes()).into_owned());
            self.serve_fetch(partition, token.as_deref())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
