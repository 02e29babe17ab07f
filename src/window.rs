//! Lambda's tumbling windows (`TumblingWindowInSeconds`): a shard's records are cut into windows
//! of fixed width by their arrival time, and the handler carries a state from one call to the
//! next within a window; when the window closes it is called once more, without records, with
//! `is_final` set, to act on the state. The state is kept in the shard's lease row with the
//! checkpoint, so it survives a failover.
//!
//! ## How it runs
//!
//! - **Windows** are `[k * width, (k + 1) * width)` of the records' arrival time (ms since the
//!   epoch; Lambda: "boundaries based on the time when records were inserted into the stream").
//!   A record arriving before the open window's start (arrival times are approximate) joins the
//!   open window.
//! - **Calls**: a [`Windowed`] handler runs one lane per shard (Lambda requires a
//!   `ParallelizationFactor` of 1), so a shard's batches come in order, one at a time. A batch is
//!   cut where its records' window changes; each part is one call with the window's state.
//!   Before the first call of a later window, the open window gets its final call.
//! - **Answers**: a call answers a state and an outcome per record. No state (`None`) is a failed
//!   call: every record of it is retried, as Lambda treats a response without `state`. Outcomes
//!   settle the records up to the first one that does not (`Ack` and `Drop` settle); that record
//!   and every later one of the call are retried (Lambda retries from the lowest failure), and the
//!   state answered is the state after the settled ones. A call that settled nothing leaves the
//!   state as it was. The records of a later window in the same batch wait for the failed ones
//!   without spending an attempt ([`Outcome::NotAttempted`]): Lambda invokes each window apart.
//! - **The final call** comes when a record of a later window arrives, when the shard ends
//!   (Lambda: "when the shard ends, Lambda considers the window closed"), and when the shard is
//!   caught up with nothing in flight and the service's time is past the window's end. A final
//!   call that fails is made again after a back-off that doubles from 100 ms to 5 s, and the
//!   shard's later records wait for it without spending their attempts; after `max_attempts`
//!   failed final calls (unbounded by default, as Lambda retries until it succeeds) the window's
//!   state is dropped, with an error logged and `shardwise_windows_dropped_total` counted, and
//!   the shard goes on.
//! - **A state over [`MAX_STATE_BYTES`]** ends the window early: a final call with
//!   `terminated_early` set and that state; the window's later records start from no state.
//!   Lambda's bound is 1 MB; this one is what fits in a lease row (DynamoDB's items hold 400 KB).
//!
//! ## What the lease row keeps
//!
//! Every checkpoint write of a windowed shard carries the state as it stood after the last
//! record it covers (`windowStart`, `windowEnd`, `windowState`), in the same fenced write: the
//! row's state is always the state of the records through its checkpoint, never of later ones.
//! A window's final call, once it succeeded, removes the state with the next write (one at the
//! same checkpoint when nothing more settled). The next owner starts with the row's state. A
//! final call that succeeded but whose write was lost is made again by the next owner (at least
//! once, as Lambda says of its own).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use crate::handler::{Batching, Delivery, Handler, Outcome};
use crate::position::Position;

/// The widest window Lambda takes: 900 seconds.
pub const MAX_WIDTH: Duration = Duration::from_secs(900);

/// The largest state kept (bytes): what fits in a lease row beside its other attributes. A
/// larger state ends its window early (Lambda's bound is 1 MB).
pub const MAX_STATE_BYTES: usize = 350 * 1024;

/// One tumbling window: `[start, end)` in ms since the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Window {
    /// Its start (inclusive), ms since the epoch.
    pub start_ms: i64,
    /// Its end (exclusive), ms since the epoch.
    pub end_ms: i64,
}

impl Window {
    /// The window of `width` that holds `at_ms`.
    pub fn of(at_ms: i64, width: Duration) -> Self {
        let width = i64::try_from(width.as_millis()).unwrap_or(i64::MAX).max(1);
        let start_ms = at_ms.div_euclid(width) * width;
        Self {
            start_ms,
            end_ms: start_ms.saturating_add(width),
        }
    }

    /// Its start.
    pub fn start(&self) -> SystemTime {
        at(self.start_ms)
    }

    /// Its end.
    pub fn end(&self) -> SystemTime {
        at(self.end_ms)
    }
}

fn at(ms: i64) -> SystemTime {
    if ms >= 0 {
        UNIX_EPOCH + Duration::from_millis(ms as u64)
    } else {
        UNIX_EPOCH - Duration::from_millis(ms.unsigned_abs())
    }
}

/// A window's state as the lease row keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowState {
    /// The window.
    pub window: Window,
    /// What the handler answered last for it.
    pub state: Bytes,
}

/// One call of a [`WindowHandler`].
#[derive(Debug, Clone)]
pub struct WindowCall {
    /// The window the records belong to.
    pub window: Window,
    /// What the handler answered last for this shard and window; `None` at a window's first call.
    pub state: Option<Bytes>,
    /// The records, in shard order (empty for the final call).
    pub records: Vec<Delivery>,
    /// The stream.
    pub stream: String,
    /// The shard.
    pub shard_id: String,
    /// The window is over: the call to act on its state (`isFinalInvokeForWindow`).
    pub is_final: bool,
    /// The window ended early, its state grown past [`MAX_STATE_BYTES`]
    /// (`isWindowTerminatedEarly`).
    pub terminated_early: bool,
}

/// What a [`WindowHandler`] answers.
#[derive(Debug, Clone, PartialEq)]
pub struct WindowAnswer {
    /// The state after the records that settled; `None`: the call failed (every record is
    /// retried, and the state stays as it was).
    pub state: Option<Bytes>,
    /// One outcome per record, in order; missing ones are retries.
    pub outcomes: Vec<Outcome>,
}

impl WindowAnswer {
    /// A state and the records' outcomes.
    pub fn new(state: impl Into<Bytes>, outcomes: Vec<Outcome>) -> Self {
        Self {
            state: Some(state.into()),
            outcomes,
        }
    }

    /// Every record acknowledged, with `state` (for a final call, whatever it says).
    pub fn acked(state: impl Into<Bytes>, records: usize) -> Self {
        Self::new(state, vec![Outcome::Ack; records])
    }

    /// The call failed: its records are retried and the state stays.
    pub fn failed() -> Self {
        Self {
            state: None,
            outcomes: Vec::new(),
        }
    }
}

/// Application code run on tumbling windows (see the [module](self)).
///
/// Any `Fn(WindowCall) -> impl Future<Output = WindowAnswer>` closure is a window handler.
pub trait WindowHandler: Send + Sync + 'static {
    /// Handles one call; see [`WindowCall`] and [`WindowAnswer`].
    fn handle_window(&self, call: WindowCall) -> impl Future<Output = WindowAnswer> + Send;
}

impl<F, Fut> WindowHandler for F
where
    F: Fn(WindowCall) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = WindowAnswer> + Send,
{
    fn handle_window(&self, call: WindowCall) -> impl Future<Output = WindowAnswer> + Send {
        self(call)
    }
}

/// What a shard's window stands at: the open window and the last record it took in, held by
/// the call that runs.
#[derive(Debug, Default)]
struct Slot {
    open: Option<WindowState>,
    last: Option<Position>,
    /// Final calls of the open window that failed in a row.
    failed_finals: u32,
    /// When an idle shard may try the open window's failed final call again.
    retry_final_at: Option<tokio::time::Instant>,
}

/// The wait before the next final call after `failed` failed ones: from 100 ms, doubling, at
/// most 5 s.
fn final_backoff(failed: u32) -> Duration {
    Duration::from_millis(100u64 << failed.saturating_sub(1).min(6)).min(Duration::from_secs(5))
}

/// The states to write with a shard's checkpoints, by the position through which each holds:
/// read by the shard loop while a call runs.
#[derive(Debug, Default)]
struct Journal {
    /// States in the order they came, each with the last record it covers; `None`: no window
    /// open (a final call succeeded).
    entries: Vec<(Position, Option<WindowState>)>,
    /// A change at or before the last written position waits for a write of its own.
    unwritten: bool,
}

/// One shard's slot and journal.
#[derive(Debug, Default)]
struct ShardSlot {
    calls: tokio::sync::Mutex<Slot>,
    journal: Mutex<Journal>,
}

impl ShardSlot {
    fn journal(&self) -> std::sync::MutexGuard<'_, Journal> {
        self.journal
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The state after the records through `last`.
    fn record(&self, last: Position, state: Option<WindowState>) {
        self.journal().entries.push((last, state));
    }
}

/// The window slots of one [`Windowed`] handler, by stream and shard: shared with the shard
/// loops, which restore a slot from the lease row and write its states with the checkpoints.
#[derive(Debug, Default)]
pub struct WindowSlots {
    width: Duration,
    slots: Mutex<HashMap<(String, String), Arc<ShardSlot>>>,
    /// How many times a window's final call is made before its state is dropped (the
    /// consumer's `max_attempts`; unset: until it succeeds).
    final_attempts: std::sync::OnceLock<std::num::NonZeroU32>,
}

impl WindowSlots {
    fn slot(&self, stream: &str, shard: &str) -> Arc<ShardSlot> {
        self.slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry((stream.to_string(), shard.to_string()))
            .or_default()
            .clone()
    }

    /// The windows' width.
    pub fn width(&self) -> Duration {
        self.width
    }

    /// A window's final call is made at most `attempts` times (the consumer's `max_attempts`).
    pub(crate) fn bound_final_calls(&self, attempts: std::num::NonZeroU32) {
        let _ = self.final_attempts.set(attempts);
    }

    /// A shard taken: its slot starts from the row's state, the row's checkpoint at `at`.
    pub(crate) async fn restore(
        &self,
        stream: &str,
        shard: &str,
        state: Option<WindowState>,
        at: Option<Position>,
    ) {
        let shard_slot = self.slot(stream, shard);
        let mut slot = shard_slot.calls.lock().await;
        // A window whose final calls failed before (an attempt that gave up at the shard's end,
        // the same worker taking the lease again) keeps its count, so `max_attempts` bounds
        // them across attempts.
        let failed_finals =
            if slot.open.as_ref().map(|o| o.window) == state.as_ref().map(|s| s.window) {
                slot.failed_finals
            } else {
                0
            };
        *slot = Slot {
            open: state,
            last: at,
            failed_finals,
            retry_final_at: None,
        };
        *shard_slot.journal() = Journal::default();
    }

    /// The state to write with a checkpoint through `to`: `Some(state)` (`Some(None)`: remove
    /// it) when a call changed it at or before `to`, `None` when none did (the row keeps its
    /// own). Entries before the one returned are dropped.
    pub(crate) fn state_through(
        &self,
        stream: &str,
        shard: &str,
        to: &Position,
    ) -> Option<Option<WindowState>> {
        let slot = self.slot(stream, shard);
        let mut journal = slot.journal();
        let i = journal.entries.iter().rposition(|(at, _)| at <= to)?;
        let state = journal.entries[i].1.clone();
        journal.entries.drain(..=i);
        journal.unwritten = false;
        Some(state)
    }

    /// A change of state waits for a write at a position already written (a window closed while
    /// the shard was idle).
    pub(crate) fn unwritten(&self, stream: &str, shard: &str) -> bool {
        self.slot(stream, shard).journal().unwritten
    }

    /// The open window, if any, when no call runs.
    pub(crate) fn open(&self, stream: &str, shard: &str) -> Option<Window> {
        let slot = self.slot(stream, shard);
        slot.calls.try_lock().ok()?.open.as_ref().map(|o| o.window)
    }
}

/// A [`WindowHandler`] run as a [`Handler`] on tumbling windows of one width (see the
/// [module](self)), given to [`Consumer::builder`](crate::Consumer::builder) as the handler.
pub struct Windowed<W> {
    handler: W,
    batching: Batching,
    slots: Arc<WindowSlots>,
}

impl<W: Clone> Clone for Windowed<W> {
    fn clone(&self) -> Self {
        Self {
            handler: self.handler.clone(),
            batching: self.batching,
            slots: self.slots.clone(),
        }
    }
}

impl<W> std::fmt::Debug for Windowed<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Windowed")
            .field("width", &self.slots.width)
            .field("batching", &self.batching)
            .finish_non_exhaustive()
    }
}

impl<W: WindowHandler> Windowed<W> {
    /// Runs `handler` on windows of `width` (at most [`MAX_WIDTH`]; 1 ms at least), in batches
    /// made as `batching` says.
    pub fn new(handler: W, width: Duration, batching: Batching) -> Self {
        Self {
            handler,
            batching: Batching {
                max_size: batching.max_size.max(1),
                ..batching
            },
            slots: Arc::new(WindowSlots {
                width: width.max(Duration::from_millis(1)),
                ..WindowSlots::default()
            }),
        }
    }

    /// The open window's final call; `false` if it failed (the window stays open). The
    /// `max_attempts`-th failure drops the window's state instead (`true`).
    async fn close(
        &self,
        shard_slot: &ShardSlot,
        slot: &mut Slot,
        stream: &str,
        shard: &str,
        early: bool,
    ) -> bool {
        let Some(open) = slot.open.clone() else {
            return true;
        };
        let call = WindowCall {
            window: open.window,
            state: Some(open.state),
            records: Vec::new(),
            stream: stream.to_string(),
            shard_id: shard.to_string(),
            is_final: true,
            terminated_early: early,
        };
        if self.handler.handle_window(call).await.state.is_none() {
            slot.failed_finals += 1;
            let bound = self.slots.final_attempts.get().map(|n| n.get());
            if bound.is_none_or(|n| slot.failed_finals < n) {
                tracing::warn!(
                    stream,
                    shard,
                    window_start = open.window.start_ms,
                    failed = slot.failed_finals,
                    "a window's final call failed: it is made again, and the shard's later records wait"
                );
                slot.retry_final_at =
                    Some(tokio::time::Instant::now() + final_backoff(slot.failed_finals));
                return false;
            }
            tracing::error!(
                stream,
                shard,
                window_start = open.window.start_ms,
                failed = slot.failed_finals,
                "a window's final call failed max_attempts times: the window's state is dropped and the shard goes on"
            );
            metrics::counter!("shardwise_windows_dropped_total", "stream" => stream.to_string())
                .increment(1);
        }
        slot.open = None;
        slot.failed_finals = 0;
        slot.retry_final_at = None;
        if let Some(last) = slot.last {
            shard_slot.record(last, None);
        }
        true
    }

    /// The open window's final call, made again after each failure's back-off until it
    /// succeeds or its state is dropped.
    async fn close_now(&self, shard_slot: &ShardSlot, slot: &mut Slot, stream: &str, shard: &str) {
        while !self.close(shard_slot, slot, stream, shard, false).await {
            tokio::time::sleep(final_backoff(slot.failed_finals)).await;
        }
    }

    /// The final call of `stream`/`shard`'s open window if it is over by `now_ms` and no call
    /// runs; `false` if it failed, or waits for the back-off of one that failed.
    pub(crate) async fn close_if_over(&self, stream: &str, shard: &str, now_ms: i64) -> bool {
        let shard_slot = self.slots.slot(stream, shard);
        let Ok(mut slot) = shard_slot.calls.try_lock() else {
            return true;
        };
        if slot.open.as_ref().is_none_or(|o| o.window.end_ms > now_ms) {
            return true;
        }
        if slot
            .retry_final_at
            .is_some_and(|at| tokio::time::Instant::now() < at)
        {
            return false;
        }
        let closed = self
            .close(&shard_slot, &mut slot, stream, shard, false)
            .await;
        if closed {
            shard_slot.journal().unwritten = true;
        }
        closed
    }

    async fn run(&self, batch: Vec<Delivery>) -> Vec<Outcome> {
        let Some(first) = batch.first() else {
            return Vec::new();
        };
        let (stream, shard) = (first.stream().to_string(), first.shard().to_string());
        let shard_slot = self.slots.slot(&stream, &shard);
        let mut slot = shard_slot.calls.lock().await;
        let width = self.slots.width;
        let mut outcomes = Vec::with_capacity(batch.len());
        let mut failed = false;
        for (window, records) in runs(batch, width, slot.open.as_ref().map(|o| o.window)) {
            let n = records.len();
            if failed {
                // A later window's records: the handler did not get them.
                outcomes.extend(std::iter::repeat_n(Outcome::NotAttempted, n));
                continue;
            }
            if slot
                .open
                .as_ref()
                .is_some_and(|o| window.start_ms > o.window.start_ms)
            {
                self.close_now(&shard_slot, &mut slot, &stream, &shard)
                    .await;
            }
            let window = slot.open.as_ref().map_or(window, |o| o.window);
            let positions: Vec<Position> = records.iter().map(|d| *d.position()).collect();
            let call = WindowCall {
                window,
                state: slot.open.as_ref().map(|o| o.state.clone()),
                records,
                stream: stream.clone(),
                shard_id: shard.clone(),
                is_final: false,
                terminated_early: false,
            };
            let answer = self.handler.handle_window(call).await;
            let Some(state) = answer.state else {
                failed = true;
                outcomes.extend(std::iter::repeat_n(Outcome::Retry, n));
                continue;
            };
            let mut answered = answer.outcomes;
            answered.resize(n, Outcome::Retry);
            let settled = answered
                .iter()
                .take_while(|o| matches!(o, Outcome::Ack | Outcome::Drop))
                .count();
            // Lambda retries from the first failure: every later record of the call too.
            for outcome in &mut answered[settled..] {
                *outcome = Outcome::Retry;
            }
            if settled < n {
                failed = true;
            }
            if settled == 0 {
                outcomes.extend(answered);
                continue;
            }
            let last = positions[settled - 1];
            let before = (slot.open.take(), slot.last.replace(last));
            let too_large = state.len() > MAX_STATE_BYTES;
            slot.open = Some(WindowState { window, state });
            if too_large {
                tracing::warn!(
                    stream,
                    shard,
                    window_start = window.start_ms,
                    limit = MAX_STATE_BYTES,
                    "a window's state grew past its limit: the window ends early"
                );
                if !self
                    .close(&shard_slot, &mut slot, &stream, &shard, true)
                    .await
                {
                    // The state cannot be kept and the window did not end: the call is undone,
                    // its records handed out again.
                    (slot.open, slot.last) = before;
                    outcomes.extend(std::iter::repeat_n(Outcome::Retry, n));
                    failed = true;
                    continue;
                }
            } else {
                shard_slot.record(last, slot.open.clone());
            }
            outcomes.extend(answered);
        }
        outcomes
    }
}

/// `batch` cut into runs of one window each, in order; a record arriving before `open`'s start
/// (or with no arrival time) joins the run before it, or `open`.
fn runs(
    batch: Vec<Delivery>,
    width: Duration,
    open: Option<Window>,
) -> Vec<(Window, Vec<Delivery>)> {
    let mut runs: Vec<(Window, Vec<Delivery>)> = Vec::new();
    let mut current = open;
    for delivery in batch {
        let arrived = delivery
            .arrived_at()
            .map(crate::time::millis)
            .map(|ms| Window::of(ms, width));
        let window = match (arrived, current) {
            (Some(w), Some(c)) if w.start_ms <= c.start_ms => c,
            (Some(w), _) => w,
            (None, Some(c)) => c,
            (None, None) => Window::of(crate::time::millis(crate::time::now()), width),
        };
        current = Some(window);
        match runs.last_mut() {
            Some((w, records)) if *w == window => records.push(delivery),
            _ => runs.push((window, vec![delivery])),
        }
    }
    runs
}

impl<W: WindowHandler> Handler for Windowed<W> {
    async fn handle(&self, delivery: Delivery) -> Outcome {
        self.run(vec![delivery])
            .await
            .into_iter()
            .next()
            .unwrap_or(Outcome::Retry)
    }

    fn batching(&self) -> Option<Batching> {
        Some(self.batching)
    }

    fn handle_batch(&self, batch: Vec<Delivery>) -> impl Future<Output = Vec<Outcome>> + Send {
        self.run(batch)
    }

    fn window_slots(&self) -> Option<&Arc<WindowSlots>> {
        Some(&self.slots)
    }

    fn close_window_if_over(
        &self,
        stream: &str,
        shard: &str,
        now_ms: i64,
    ) -> impl Future<Output = bool> + Send {
        self.close_if_over(stream, shard, now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(sequence: u64, arrived_ms: Option<i64>) -> Delivery {
        let position = Position::new(
            crate::position::SequenceNumber::parse(&sequence.to_string()).unwrap(),
            0,
        );
        let mut builder = Delivery::builder("s", "shard-0", position).partition_key("k");
        if let Some(ms) = arrived_ms {
            builder = builder.arrived_at(at(ms));
        }
        builder.build()
    }

    #[test]
    fn windows_are_aligned_to_their_width() {
        let minute = Duration::from_secs(60);
        assert_eq!(
            Window::of(120_000, minute),
            Window {
                start_ms: 120_000,
                end_ms: 180_000
            }
        );
        assert_eq!(Window::of(179_999, minute).start_ms, 120_000);
        assert_eq!(Window::of(-1, minute).start_ms, -60_000);
        assert_eq!(
            Window::of(120_000, minute).end(),
            UNIX_EPOCH + Duration::from_secs(180)
        );
    }

    #[test]
    fn a_batch_is_cut_where_its_window_changes_and_late_arrivals_join_the_open_window() {
        let minute = Duration::from_secs(60);
        let batch = vec![
            delivery(1, Some(10_000)),
            delivery(2, Some(59_999)),
            delivery(3, Some(60_000)),
            // Arrived (approximately) before the window before it: joins that one.
            delivery(4, Some(59_000)),
            delivery(5, None),
            delivery(6, Some(130_000)),
        ];
        let runs = runs(batch, minute, None);
        let cut: Vec<(i64, Vec<u64>)> = runs
            .iter()
            .map(|(w, ds)| {
                (
                    w.start_ms,
                    ds.iter()
                        .map(|d| d.sequence_number().to_string().parse().unwrap())
                        .collect(),
                )
            })
            .collect();
        assert_eq!(
            cut,
            vec![(0, vec![1, 2]), (60_000, vec![3, 4, 5]), (120_000, vec![6])]
        );
        // The open window takes what arrived before its start.
        let open = Window::of(60_000, minute);
        let runs = super::runs(vec![delivery(7, Some(1_000))], minute, Some(open));
        assert_eq!(runs[0].0, open);
    }
}
