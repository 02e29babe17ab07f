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

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
pub(crate) use tokio::time::Instant;
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
    /// Events an audit returned: what may be late (some were handed out by this attempt, or, at
    /// or below the applied position it started from, by an earlier one).
    Late(Vec<PagedEvent>),
    /// An audit begins whose events of a range were vouched for by the attempt that stopped at
    /// its cursor: they are held until the audit ends, and passed over when they are exactly
    /// those.
    Vouched(super::Vouched),
    /// An audit read to its end: reading goes on from `next`, the cursor marked as audited, and
    /// what was handed out before `forget_before` cannot come back in a later audit. `last`:
    /// the audit of a graceful stop, after which the reader ends.
    Audited {
        next: Cursor,
        forget_before: Option<Instant>,
        last: bool,
    },
    /// The partition cannot be read on.
    Failed(FetchError),
}

pub(crate) struct PageReader {
    pub(crate) source: Arc<dyn PagedSource>,
    pub(crate) partition: String,
    /// Where the next fetch starts.
    pub(crate) cursor: Option<Cursor>,
    /// The durable applied position the attempt starts from: the resume cursor (promoted at page
    /// barriers) may lie behind it. An audit covers what is behind the cursor it is given, and
    /// its mark then vouches for everything ingested before it; so the first audit waits until
    /// the forward read has passed this position (or reached the partition's end), else a late
    /// event between the cursor and this position, which the forward read takes for a replay,
    /// would be vouched for and never handed out.
    pub(crate) applied: Option<super::PagePosition>,
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

/// What an attempt of an auditing source handed out, and when, for as long as an audit can
/// return it again: events come back in an audit only if they arrived after the previous audit
/// began (less the source's allowance), so what was handed out well before that is forgotten.
/// With each identity, its ingestion time when the source tells it (for what a graceful stop
/// vouches for).
#[derive(Debug, Default)]
pub(crate) struct HandedOut {
    order: VecDeque<(Instant, String)>,
    ids: HashMap<String, Option<i64>>,
}

impl HandedOut {
    /// Remembers `id`, ingested at `ingested`; `false` when it was handed out before.
    pub(crate) fn insert(&mut self, id: &str, now: Instant, ingested: Option<i64>) -> bool {
        if self.ids.contains_key(id) {
            return false;
        }
        self.ids.insert(id.to_string(), ingested);
        self.order.push_back((now, id.to_string()));
        true
    }

    /// Whether `id` was handed out (and is still remembered).
    pub(crate) fn contains(&self, id: &str) -> bool {
        self.ids.contains_key(id)
    }

    /// What was handed out of the events ingested in `(after, through]`.
    pub(crate) fn vouch(&self, after: i64, through: i64) -> super::Vouched {
        let mut vouched = super::Vouched::new(after, through);
        for (id, ingested) in &self.ids {
            if ingested.is_some_and(|at| vouched.covers(at)) {
                vouched.add(id);
            }
        }
        vouched
    }

    /// Forgets what was handed out before `before`.
    pub(crate) fn forget_before(&mut self, before: Instant) {
        while let Some((at, _)) = self.order.front()
            && *at < before
        {
            let (_, id) = self.order.pop_front().expect("a front");
            self.ids.remove(&id);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }
}

/// When an auditing reader audits next, and what it remembers for it.
#[derive(Debug)]
struct Audits {
    every: Duration,
    next: Instant,
    /// Once a stream that brought events is quiet this long, it is audited (at most once a
    /// quiet spell): the audit's mark then passes what was read, so a restart after it has
    /// nothing to check again. The source's `remember` (its allowance, twice).
    quiet_after: Duration,
    /// When the quiet spell's audit is due, if events came since the last audit began.
    quiet: Option<Instant>,
}

impl Audits {
    fn due(&self, now: Instant) -> bool {
        now >= self.next || self.quiet.is_some_and(|q| now >= q)
    }
}

/// How far behind the provider's present a partition is read, reported as a Kinesis shard's lag
/// is: `shardwise_millis_behind_latest` (labels `stream`, the source, and `shard`, the
/// partition): the age of the oldest event of the last page read, 0 once a read finds nothing
/// new, and 0 again when the reader stops. Past the age at which the provider may delete events
/// ([`PagedSource::deletes_after`]) events may be lost unread, which no read can see: each such
/// page counts in `shardwise_paged_behind_retention_total`, and a warning says it (at most hourly
/// per partition).
struct Behind {
    labels: [(&'static str, String); 2],
    warned: Option<Instant>,
}

impl Behind {
    fn new(source: &dyn PagedSource, partition: &str) -> Self {
        Self {
            labels: [
                ("stream", source.name().to_string()),
                ("shard", partition.to_string()),
            ],
            warned: None,
        }
    }

    /// Nothing new: read at the present.
    fn at_head(&self) {
        metrics::gauge!("shardwise_millis_behind_latest", &self.labels).set(0.0);
    }

    /// A page read whose oldest event is dated `oldest_ms`.
    fn read(&mut self, source: &dyn PagedSource, oldest_ms: i64) {
        let now = crate::time::millis(source.service_time().unwrap_or_else(crate::time::now));
        let behind = now.saturating_sub(oldest_ms).max(0);
        metrics::gauge!("shardwise_millis_behind_latest", &self.labels).set(behind as f64);
        let Some(keeps) = source.deletes_after() else {
            return;
        };
        let keeps_ms = i64::try_from(keeps.as_millis()).unwrap_or(i64::MAX);
        if behind < keeps_ms {
            return;
        }
        metrics::counter!("shardwise_paged_behind_retention_total", "source" => source.name().to_string()).increment(1);
        if self
            .warned
            .is_none_or(|at| at.elapsed() >= Duration::from_secs(3600))
        {
            self.warned = Some(Instant::now());
            warn!(source = source.name(), partition = %self.labels[1].1, behind_ms = behind, retention_ms = keeps_ms, "the partition is read further behind than the provider keeps events: events older than its retention may have been deleted unread (catch up faster: more workers, a larger request budget)");
        }
    }
}

impl Drop for Behind {
    fn drop(&mut self) {
        self.at_head();
    }
}

/// An event's timestamp, in ms since the Unix epoch.
fn dated_ms(event: &PagedEvent) -> Option<i64> {
    event.timestamp.map(crate::time::millis)
}

impl PageReader {
    /// Fetches until the partition ends, fails, or `cancel` fires. When `finish` fires first (a
    /// graceful stop: `finish` is a child of `cancel`), forward reading stops and a source that
    /// audits for late events is audited once more before the reader ends: the audited cursor,
    /// promoted once what the audit found settled, is the final progress, and the next owner's
    /// first audit then hands out again only what was ingested in the source's allowance before
    /// this one began, not everything since the last periodic audit (up to its interval more).
    pub(crate) async fn run(
        mut self,
        pages: mpsc::Sender<PageMessage>,
        cancel: CancellationToken,
        finish: CancellationToken,
    ) {
        if let Some(mut audits) = self.forward(&pages, &finish).await
            && !cancel.is_cancelled()
            && let Some(cursor) = self.cursor.clone()
        {
            // Only once the forward read passed where the attempt started (else the audit's mark
            // would vouch for what lies between the cursor and the applied position).
            if self.applied.is_none() {
                metrics::counter!("shardwise_paged_final_audits_total", "source" => self.source.name().to_string()).increment(1);
                let _ = self
                    .audit(&cursor, &mut audits, &pages, &cancel, true)
                    .await;
            }
        }
    }

    /// Reads forward until the partition ends or fails (`None`), or `stop` fires: then the
    /// audits' state, if the source audits (`Some`).
    async fn forward(
        &mut self,
        pages: &mpsc::Sender<PageMessage>,
        stop: &CancellationToken,
    ) -> Option<Audits> {
        let labels = [("source", self.source.name().to_string())];
        let contract = self.source.contract();
        let mut failures = Backoff::new(self.max_backoff);
        let mut idle = Idle::new(self.poll_interval, self.idle_poll_max);
        let mut watermark_sent: Option<i64> = None;
        let mut behind = Behind::new(self.source.as_ref(), &self.partition);
        // An auditing source is audited as the attempt starts (late events that arrived while
        // nobody read, or that an earlier attempt found and did not settle), then every interval.
        let mut audits = self.source.audit_interval().map(|every| Audits {
            every,
            next: Instant::now(),
            quiet_after: Duration::from_secs(60),
            quiet: None,
        });
        loop {
            if let Some(due) = audits.as_mut()
                && self.applied.is_none()
                && due.due(Instant::now())
            {
                match self.cursor.clone() {
                    Some(cursor) => match self.audit(&cursor, due, pages, stop, false).await {
                        Audited::Done => {}
                        Audited::Stop => return audits,
                    },
                    // Nothing read yet: nothing to audit behind, and no wait cut short for it.
                    None => due.next = Instant::now() + due.every,
                }
            }
            let fetched = tokio::select! {
                biased;
                _ = stop.cancelled() => return audits,
                r = self.source.fetch(&self.partition, self.cursor.as_ref()) => r,
            };
            let page = match fetched {
                Ok(page) => page,
                Err(FetchError::Gone) => {
                    let _ = pages.send(PageMessage::Gone).await;
                    return None;
                }
                Err(FetchError::NotFound) => {
                    let listed = tokio::select! {
                        biased;
                        _ = stop.cancelled() => return audits,
                        r = self.source.listed(&self.partition) => r,
                    };
                    if let Ok(false) = listed {
                        let _ = pages.send(PageMessage::Gone).await;
                        return None;
                    }
                    let wait = failures.next();
                    let why = match &listed {
                        Ok(_) => "the source still lists it".to_string(),
                        Err(e) => format!("listing the partitions failed: {e}"),
                    };
                    warn!(source = self.source.name(), partition = %self.partition, ?wait, "the partition was not found, but {why}; fetching the same cursor again");
                    if sleep(wait, stop).await {
                        return audits;
                    }
                    continue;
                }
                Err(error @ FetchError::InvalidCursor(_)) => {
                    let _ = pages.send(PageMessage::Failed(error)).await;
                    return None;
                }
                Err(error) => {
                    if matches!(error, FetchError::Throttled) {
                        metrics::counter!("shardwise_paged_throttled_total", &labels).increment(1);
                    }
                    let wait = failures.next();
                    warn!(source = self.source.name(), partition = %self.partition, error = &error as &dyn std::error::Error, ?wait, "fetch failed; fetching the same cursor again");
                    if sleep(wait, stop).await {
                        return audits;
                    }
                    continue;
                }
            };
            failures.reset();
            metrics::counter!("shardwise_paged_pages_total", &labels).increment(1);
            // Past the applied position the attempt started from (an event beyond it), or at the
            // partition's end (a page with nothing new): audits may begin.
            if let Some(applied) = &self.applied {
                let past = page.events.iter().any(|e| e.position > *applied);
                if past || page.events.is_empty() {
                    self.applied = None;
                }
            }
            let Some(next) = page.next else {
                let _ = pages
                    .send(PageMessage::Page {
                        events: page.events,
                        next: None,
                        watermark: page.watermark,
                    })
                    .await;
                return None;
            };
            let unchanged = self.cursor.as_ref() == Some(&next);
            let empty = page.events.is_empty();
            match page.events.iter().filter_map(dated_ms).min() {
                Some(oldest) => behind.read(self.source.as_ref(), oldest),
                None if unchanged => behind.at_head(),
                None => {}
            }
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
                    return None;
                }
                if sleep(until_audit(&audits, idle.wait()), stop).await {
                    return audits;
                }
                continue;
            }
            if empty && (unchanged || contract.empty_pages == EmptyPages::Refetch) {
                metrics::counter!("shardwise_paged_unchanged_cursor_total", &labels).increment(1);
                let wait = until_audit(&audits, idle.wait());
                debug!(source = self.source.name(), partition = %self.partition, cursor = %next, ?wait, "nothing new: fetching the same cursor after a wait");
                if sleep(wait, stop).await {
                    return audits;
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
            if let Some(audits) = audits.as_mut() {
                let now = Instant::now();
                if !page.events.is_empty() {
                    audits.quiet = Some(now + audits.quiet_after);
                }
            }
            let sent = pages
                .send(PageMessage::Page {
                    events: page.events,
                    next: Some(next.clone()),
                    watermark: page.watermark,
                })
                .await;
            if sent.is_err() {
                return None;
            }
            if unchanged {
                // Events, but a cursor that does not move: the same page is fetched again after
                // the poll interval (its events are then overlaps), never in a tight loop.
                metrics::counter!("shardwise_paged_unchanged_cursor_total", &labels).increment(1);
            }
            // The page was handed over: a stop during the wait audits behind its cursor.
            self.cursor = Some(next.clone());
            if let Some(wait) = pause.map(|wait| until_audit(&audits, wait)) {
                debug!(source = self.source.name(), partition = %self.partition, cursor = %next, ?wait, "fetching the next page after a wait");
                if sleep(wait, stop).await {
                    return audits;
                }
            }
        }
    }
}

/// `wait`, or less when an audit falls due sooner: a reader waiting out a quiet spell wakes for
/// it.
fn until_audit(audits: &Option<Audits>, wait: Duration) -> Duration {
    let Some(audits) = audits else {
        return wait;
    };
    let due = audits.quiet.map_or(audits.next, |q| q.min(audits.next));
    wait.min(due.saturating_duration_since(Instant::now()))
}

/// How an audit ended.
enum Audited {
    /// Read to its end (or given up until the next one): reading forward goes on.
    Done,
    /// Cancelled, or nobody takes what the reader hands over: the reader ends.
    Stop,
}

impl PageReader {
    /// Reads an audit behind `cursor` to its end, hands over what this attempt did not hand out
    /// before, then reads on from the audited cursor. A failed fetch is tried again with
    /// back-off; a refused audit cursor, or a partition not found, gives the audit up until the
    /// next interval (reading forward finds out what became of the partition).
    async fn audit(
        &mut self,
        cursor: &Cursor,
        audits: &mut Audits,
        pages: &mpsc::Sender<PageMessage>,
        cancel: &CancellationToken,
        last: bool,
    ) -> Audited {
        let labels = [("source", self.source.name().to_string())];
        let began = Instant::now();
        audits.next = began + audits.every;
        audits.quiet = None;
        let Some(audit) = self.source.audit(&self.partition, cursor) else {
            return Audited::Done;
        };
        metrics::counter!("shardwise_paged_audits_total", &labels).increment(1);
        if let Some(vouched) = audit.vouched
            && pages.send(PageMessage::Vouched(vouched)).await.is_err()
        {
            return Audited::Stop;
        }
        let mut failures = Backoff::new(self.max_backoff);
        let mut at = audit.pages.clone();
        let mut read = 0usize;
        loop {
            let fetched = tokio::select! {
                biased;
                _ = cancel.cancelled() => return Audited::Stop,
                r = self.source.fetch(&self.partition, Some(&at)) => r,
            };
            let page = match fetched {
                Ok(page) => page,
                Err(
                    error
                    @ (FetchError::NotFound | FetchError::Gone | FetchError::InvalidCursor(_)),
                ) => {
                    warn!(source = self.source.name(), partition = %self.partition, error = &error as &dyn std::error::Error, "the audit for late events cannot go on; it is given up until the next one");
                    return Audited::Done;
                }
                Err(error) => {
                    if matches!(error, FetchError::Throttled) {
                        metrics::counter!("shardwise_paged_throttled_total", &labels).increment(1);
                    }
                    let wait = failures.next();
                    debug!(source = self.source.name(), partition = %self.partition, error = &error as &dyn std::error::Error, ?wait, "an audit's fetch failed; fetching the same page again");
                    if sleep(wait, cancel).await {
                        return Audited::Stop;
                    }
                    continue;
                }
            };
            failures.reset();
            metrics::counter!("shardwise_paged_pages_total", &labels).increment(1);
            read += page.events.len();
            if !page.events.is_empty() && pages.send(PageMessage::Late(page.events)).await.is_err()
            {
                return Audited::Stop;
            }
            match page.next {
                None => break,
                Some(next) => at = next,
            }
        }
        // What the audit found is handed over before the audited cursor, so the cursor is
        // promoted only once every late event settled. The next audit returns only events that
        // arrived after this one began (less the source's allowance): what was handed out
        // before that is not among them.
        let sent = pages
            .send(PageMessage::Audited {
                next: audit.then.clone(),
                forget_before: began.checked_sub(audit.remember),
                last,
            })
            .await;
        if sent.is_err() {
            return Audited::Stop;
        }
        self.cursor = Some(audit.then);
        audits.quiet_after = audit.quiet;
        debug!(source = self.source.name(), partition = %self.partition, read, "audit for late events read");
        Audited::Done
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
        /// For a step of a catch-up, the bound of the events it read (exclusive): it proves
        /// nothing at or after it.
        before: Option<i64>,
        /// For an audit, the timestamp it read from (every event after it that could be read
        /// when the poll began).
        audited_from: Option<i64>,
    },
    /// The partition cannot be read on.
    Failed(FetchError),
}

/// Polls a source read by timestamp: each poll starts from [`PagedSource::poll_after`] the
/// partition's current `closed_through`, or what the attempt's complete polls proved final when
/// that is later (`Groups::query_after`), and follows the continuation to its end; then the poll
/// interval, and the next poll. A continuation that comes back unchanged and empty ends the poll
/// without evidence (it was not traversed to its end).
pub(crate) struct PollReader {
    pub(crate) source: Arc<dyn PagedSource>,
    pub(crate) partition: String,
    /// Where the next poll starts: the partition's `closed_through`, or past it what the
    /// attempt's complete polls proved (`Groups::query_after`), as the loop last set it.
    pub(crate) after: tokio::sync::watch::Receiver<Option<i64>>,
    pub(crate) poll_interval: Duration,
    pub(crate) max_backoff: Duration,
    /// When a poll is an audit that starts this many ms before that point, to find late
    /// events behind it. An audit's traversal is evidence like any other (it reads a superset).
    pub(crate) audit: Option<(AuditEvery, i64)>,
}

/// How often a poll reader audits.
#[derive(Debug, Clone, Copy)]
pub(crate) enum AuditEvery {
    /// Every `n`th poll.
    Polls(u32),
    /// The first poll, and then the first poll once this long has passed since the last audit.
    Interval(Duration),
}

impl PollReader {
    /// Polls until the partition fails or `cancel` fires.
    pub(crate) async fn run(self, polls: mpsc::Sender<PollMessage>, cancel: CancellationToken) {
        let labels = [("source", self.source.name().to_string())];
        let mut failures = Backoff::new(self.max_backoff);
        let mut polls_done: u32 = 0;
        let mut next_audit = Instant::now();
        let mut moved = self.after.clone();
        let mut behind = Behind::new(self.source.as_ref(), &self.partition);
        let step_ms = self
            .source
            .poll_step()
            .map(|step| i64::try_from(step.as_millis()).unwrap_or(i64::MAX));
        loop {
            let mut after = *moved.borrow_and_update();
            polls_done = polls_done.wrapping_add(1);
            // Taken before the poll's first cursor is made: a source that bounds its polls by
            // time (`endTime`) bounds them at or after this, so what the poll proves does not
            // reach past what it read. The provider's time where it says (a host clock minutes
            // ahead would otherwise prove what the provider has not yet ingested).
            let started_ms =
                crate::time::millis(self.source.service_time().unwrap_or_else(crate::time::now));
            // More than a step behind the present: this poll is a step of a catch-up, bounded,
            // and no audit (an audit reads to the present; it waits until the reader is back).
            let before = match (after, step_ms) {
                (Some(a), Some(step)) => {
                    let bound = a.saturating_add(1).saturating_add(step);
                    (bound < started_ms.saturating_sub(step)).then_some(bound)
                }
                _ => None,
            };
            let due = match self.audit {
                Some((AuditEvery::Polls(every), lookback)) => {
                    polls_done.is_multiple_of(every.max(1)).then_some(lookback)
                }
                Some((AuditEvery::Interval(every), lookback)) if Instant::now() >= next_audit => {
                    next_audit = Instant::now() + every;
                    Some(lookback)
                }
                _ => None,
            };
            // An audit due during a catch-up reads only behind the start, bounded there: the late
            // events behind `closed_through` (put while nobody read, or found by no audit before
            // a crash), which no step reads, and which an audit back at the present would no
            // longer reach (it starts the lateness window behind a start days later).
            let (audit, before) = match (due, before, after) {
                (Some(lookback), Some(_), Some(start)) => {
                    (Some(lookback), Some(start.saturating_add(1)))
                }
                (Some(_), Some(_), None) => (None, before),
                (due, before, _) => (due, before),
            };
            let mut audited_from = None;
            if let Some(lookback) = audit {
                after = after.map(|a| a.saturating_sub(lookback));
                audited_from = Some(after.map_or(i64::MIN, |a| a.saturating_add(1)));
                metrics::counter!("shardwise_paged_audits_total", &labels).increment(1);
            } else if before.is_some() {
                polls_done = polls_done.wrapping_sub(1);
                metrics::counter!("shardwise_paged_catch_up_polls_total", &labels).increment(1);
            }
            let Some(mut cursor) = self.source.poll_before(&self.partition, after, before) else {
                let refused = FetchError::InvalidCursor(
                    "the source declares timestamps but cannot start a poll after one".into(),
                );
                let _ = polls.send(PollMessage::Failed(refused)).await;
                return;
            };
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
                    Err(
                        error @ (FetchError::NotFound
                        | FetchError::Gone
                        | FetchError::InvalidCursor(_)),
                    ) => {
                        let _ = polls.send(PollMessage::Failed(error)).await;
                        return;
                    }
                    Err(error) => {
                        if matches!(error, FetchError::Throttled) {
                            metrics::counter!("shardwise_paged_throttled_total", &labels)
                                .increment(1);
                        }
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
                // Behind: a step of a catch-up (a poll to the present reads what is a poll
                // interval and the close horizon old, by design; an audit reads behind).
                if before.is_some()
                    && let Some(oldest) = page.events.iter().filter_map(dated_ms).min()
                {
                    behind.read(self.source.as_ref(), oldest);
                }
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
                        before,
                        audited_from,
                    })
                    .await
                    .is_err()
            {
                return;
            }
            metrics::counter!("shardwise_paged_polls_total", &labels).increment(1);
            if complete && before.is_none() {
                behind.at_head();
            }
            if complete && before.is_some() {
                // A step of a catch-up: the next one starts as soon as the partition's loop
                // moved the start past this one's (its close written), or after the poll
                // interval if it cannot (a group held open by a failing event). Not at the
                // first word from the loop, which may repeat the old start: the step would be
                // read again (20 times over, in a test of three days' backlog).
                let deadline = Instant::now() + self.poll_interval;
                loop {
                    tokio::select! {
                        biased;
                        _ = cancel.cancelled() => return,
                        changed = moved.changed() => {
                            if changed.is_err() || *moved.borrow() != after {
                                break;
                            }
                        }
                        _ = tokio::time::sleep_until(deadline) => break,
                    }
                }
                continue;
            }
            if sleep(self.poll_interval, &cancel).await {
                return;
            }
        }
    }
}
