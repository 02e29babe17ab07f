//! Fetches one partition's pages in order, each from the previous page's next cursor, and hands
//! them over a channel of one (so a partition whose window is full is simply not fetched).
//!
//! A cursor that comes back unchanged with nothing new, and an empty page of a source whose empty
//! pages prove nothing, are not followed: the same cursor is fetched again after a wait (no
//! spinning), and `shardwise_paged_unchanged_cursor_total` counts it. An empty page with a new
//! cursor is followed after the same wait. The wait is the poll interval, doubled with every
//! empty page in a row up to the idle bound (`ReaderSettings::idle_poll_max`, 30 s by default),
//! and back to the poll interval with the first event: a group of hundreds of quiet streams does
//! not spend the account's request quota. Throttling and transient failures back off with jitter
//! and fetch the same cursor again (`shardwise_paged_throttled_total` counts throttling). A
//! refused cursor ends the reader with the error. A partition the source answers is not found is
//! gone only once the source's listing no longer names it: then the reader says so
//! ([`PageMessage::Gone`]) and ends; while it is still listed (or the listing fails) the fetch is
//! tried again with back-off.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{Cursor, EmptyPages, FetchError, PagedEvent, PagedSource};
use crate::backoff::Backoff;

/// What the reader hands over.
#[derive(Debug)]
pub(crate) enum PageMessage {
    /// A page: its events, and its next cursor (`None`: the partition ended with it).
    Page {
        events: Vec<PagedEvent>,
        next: Option<Cursor>,
        /// The complete-through watermark the source certified with it.
        watermark: Option<i64>,
    },
    /// The partition is gone: the source answered that it is not found, and its listing no longer
    /// names it. Nothing more will be read.
    Gone,
    /// The partition cannot be read on.
    Failed(FetchError),
}

pub(crate) struct PageReader {
    pub(crate) source: Arc<dyn PagedSource>,
    pub(crate) partition: String,
    /// Where the next fetch starts.
    pub(crate) cursor: Option<Cursor>,
    /// Wait before fetching an unchanged cursor again.
    pub(crate) poll_interval: Duration,
    /// Longest wait between fetches of a partition that stays idle.
    pub(crate) idle_poll_max: Duration,
    /// Longest wait after a failure.
    pub(crate) max_backoff: Duration,
}

/// The wait after a page that brought nothing: the poll interval, doubled with each such page in a
/// row up to the idle bound.
#[derive(Debug)]
struct Idle {
    poll_interval: Duration,
    max: Duration,
    next: Duration,
}

impl Idle {
    fn new(poll_interval: Duration, max: Duration) -> Self {
        Self {
            poll_interval,
            max: max.max(poll_interval),
            next: poll_interval,
        }
    }

    /// The wait after one more page that brought nothing.
    fn wait(&mut self) -> Duration {
        let wait = self.next;
        self.next = (self.next * 2).min(self.max);
        wait
    }

    /// Events came: the next quiet page waits the poll interval again.
    fn reset(&mut self) {
        self.next = self.poll_interval;
    }
}

impl PageReader {
    /// Fetches until the partition ends, fails, or `cancel` fires.
    pub(crate) async fn run(mut self, pages: mpsc::Sender<PageMessage>, cancel: CancellationToken) {
        let labels = [("source", self.source.name().to_string())];
        let contract = self.source.contract();
        let mut failures = Backoff::new(self.max_backoff);
        let mut idle = Idle::new(self.poll_interval, self.idle_poll_max);
        let mut watermark_sent: Option<i64> = None;
        loop {
            let fetched = tokio::select! {
                biased;
                _ = cancel.cancelled() => return,
                r = self.source.fetch(&self.partition, self.cursor.as_ref()) => r,
            };
            let page = match fetched {
                Ok(page) => page,
                Err(FetchError::NotFound) => {
                    let listed = tokio::select! {
                        biased;
                        _ = cancel.cancelled() => return,
                        r = self.source.partitions() => r,
                    };
                    let listed = listed.map(|all| all.contains(&self.partition));
                    if let Ok(false) = listed {
                        let _ = pages.send(PageMessage::Gone).await;
                        return;
                    }
                    let wait = failures.next();
                    let why = match &listed {
                        Ok(_) => "the source still lists it".to_string(),
                        Err(e) => format!("listing the partitions failed: {e}"),
                    };
                    warn!(source = self.source.name(), partition = %self.partition, ?wait, "the partition was not found, but {why}; fetching the same cursor again");
                    if sleep(wait, &cancel).await {
                        return;
                    }
                    continue;
                }
                Err(error @ FetchError::InvalidCursor(_)) => {
                    let _ = pages.send(PageMessage::Failed(error)).await;
                    return;
                }
                Err(error) => {
                    if matches!(error, FetchError::Throttled) {
                        metrics::counter!("shardwise_paged_throttled_total", &labels).increment(1);
                    }
                    let wait = failures.next();
                    warn!(source = self.source.name(), partition = %self.partition, error = &error as &dyn std::error::Error, ?wait, "fetch failed; fetching the same cursor again");
                    if sleep(wait, &cancel).await {
                        return;
                    }
                    continue;
                }
            };
            failures.reset();
            metrics::counter!("shardwise_paged_pages_total", &labels).increment(1);
            let Some(next) = page.next else {
                let _ = pages
                    .send(PageMessage::Page {
                        events: page.events,
                        next: None,
                        watermark: page.watermark,
                    })
                    .await;
                return;
            };
            let unchanged = self.cursor.as_ref() == Some(&next);
            let empty = page.events.is_empty();
            // A quiet page that only raises the certified watermark is handed over (so a quiet
            // partition's watermark can move), with the cursor it was fetched with.
            let raised = page.watermark > watermark_sent;
            if empty && unchanged && raised {
                watermark_sent = page.watermark;
                if pages
                    .send(PageMessage::Page {
                        events: Vec::new(),
                        next: Some(next),
                        watermark: page.watermark,
                    })
                    .await
                    .is_err()
                {
                    return;
                }
                if sleep(idle.wait(), &cancel).await {
                    return;
                }
                continue;
            }
            if empty && (unchanged || contract.empty_pages == EmptyPages::Refetch) {
                metrics::counter!("shardwise_paged_unchanged_cursor_total", &labels).increment(1);
                let wait = idle.wait();
                debug!(source = self.source.name(), partition = %self.partition, cursor = %next, ?wait, "nothing new: fetching the same cursor after a wait");
                if sleep(wait, &cancel).await {
                    return;
                }
                continue;
            }
            // A new cursor and no events: followed, after a wait (a source may hand out fresh
            // cursors for ever while nothing happens).
            let pause = if empty {
                Some(idle.wait())
            } else {
                idle.reset();
                unchanged.then_some(self.poll_interval)
            };
            watermark_sent = watermark_sent.max(page.watermark);
            let sent = pages
                .send(PageMessage::Page {
                    events: page.events,
                    next: Some(next.clone()),
                    watermark: page.watermark,
                })
                .await;
            if sent.is_err() {
                return;
            }
            if unchanged {
                // Events, but a cursor that does not move: the same page is fetched again after
                // the poll interval (its events are then overlaps), never in a tight loop.
                metrics::counter!("shardwise_paged_unchanged_cursor_total", &labels).increment(1);
            }
            if let Some(wait) = pause {
                debug!(source = self.source.name(), partition = %self.partition, cursor = %next, ?wait, "fetching the next page after a wait");
                if sleep(wait, &cancel).await {
                    return;
                }
            }
            self.cursor = Some(next);
        }
    }
}

/// Sleeps `wait`; `true` when cancelled first.
async fn sleep(wait: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        biased;
        _ = cancel.cancelled() => true,
        _ = tokio::time::sleep(wait) => false,
    }
}

/// What the poll reader of a source read by timestamp hands over.
#[derive(Debug)]
pub(crate) enum PollMessage {
    /// A page's events.
    Events(Vec<PagedEvent>),
    /// A poll's pages were traversed to their end. `started_ms` is the wall time before its first
    /// fetch (a lateness bound counts from it); `watermark` the lowest the provider reported in it.
    Traversed {
        started_ms: i64,
        watermark: Option<i64>,
    },
    /// The partition cannot be read on.
    Failed(FetchError),
}

/// Polls a source read by timestamp: each poll starts from [`PagedSource::poll_after`] the
/// partition's current `closed_through` and follows the continuation to its end; then the poll
/// interval, and the next poll. A continuation that comes back unchanged and empty ends the poll
/// without evidence (it was not traversed to its end).
pub(crate) struct PollReader {
    pub(crate) source: Arc<dyn PagedSource>,
    pub(crate) partition: String,
    /// The partition's `closed_through`, as the loop last wrote it.
    pub(crate) after: tokio::sync::watch::Receiver<Option<i64>>,
    pub(crate) poll_interval: Duration,
    pub(crate) max_backoff: Duration,
    /// Every `n`th poll is an audit that starts this many ms before `closed_through`, to find
    /// late events behind it. An audit's traversal is evidence like any other (it reads a
    /// superset).
    pub(crate) audit: Option<(u32, i64)>,
}

impl PollReader {
    /// Polls until the partition fails or `cancel` fires.
    pub(crate) async fn run(self, polls: mpsc::Sender<PollMessage>, cancel: CancellationToken) {
        let labels = [("source", self.source.name().to_string())];
        let mut failures = Backoff::new(self.max_backoff);
        let mut polls_done: u32 = 0;
        loop {
            let mut after = *self.after.borrow();
            polls_done = polls_done.wrapping_add(1);
            if let Some((every, lookback)) = self.audit
                && polls_done.is_multiple_of(every.max(1))
            {
                after = after.map(|a| a.saturating_sub(lookback));
                metrics::counter!("shardwise_paged_audits_total", &labels).increment(1);
            }
            let Some(mut cursor) = self.source.poll_after(&self.partition, after) else {
                let refused = FetchError::InvalidCursor(
                    "the source declares timestamps but cannot start a poll after one".into(),
                );
                let _ = polls.send(PollMessage::Failed(refused)).await;
                return;
            };
            let started_ms = crate::time::millis(crate::time::now());
            let mut watermark: Option<i64> = None;
            let mut first = true;
            let complete = loop {
                let fetched = tokio::select! {
                    biased;
                    _ = cancel.cancelled() => return,
                    r = self.source.fetch(&self.partition, Some(&cursor)) => r,
                };
                let page = match fetched {
                    Ok(page) => page,
                    Err(error @ (FetchError::NotFound | FetchError::InvalidCursor(_))) => {
                        let _ = polls.send(PollMessage::Failed(error)).await;
                        return;
                    }
                    Err(error) => {
                        let wait = failures.next();
                        warn!(source = self.source.name(), partition = %self.partition, error = &error as &dyn std::error::Error, ?wait, "fetch failed; fetching the same page again");
                        if sleep(wait, &cancel).await {
                            return;
                        }
                        continue;
                    }
                };
                failures.reset();
                metrics::counter!("shardwise_paged_pages_total", &labels).increment(1);
                // The lowest watermark of the poll: one reported late in a traversal may cover
                // events that arrived behind pages already read.
                watermark = match (first, watermark, page.watermark) {
                    (true, _, w) => w,
                    (false, Some(a), Some(b)) => Some(a.min(b)),
                    (false, _, _) => None,
                };
                first = false;
                let empty = page.events.is_empty();
                if !empty && polls.send(PollMessage::Events(page.events)).await.is_err() {
                    return;
                }
                match page.next {
                    None => break true,
                    Some(next) if empty && next == cursor => {
                        metrics::counter!("shardwise_paged_unchanged_cursor_total", &labels)
                            .increment(1);
                        debug!(source = self.source.name(), partition = %self.partition, "the continuation did not move: the poll ends without evidence");
                        break false;
                    }
                    Some(next) => cursor = next,
                }
            };
            if complete
                && polls
                    .send(PollMessage::Traversed {
                        started_ms,
                        watermark,
                    })
                    .await
                    .is_err()
            {
                return;
            }
            metrics::counter!("shardwise_paged_polls_total", &labels).increment(1);
            if sleep(self.poll_interval, &cancel).await {
                return;
            }
        }
    }
}
