//! Crashes at an exact point of a worker's life: wrap the lease store and the receipt ledger a
//! worker writes through, name the write to die at (the nth effect commit, quarantine receipt,
//! hold, page barrier or progress write; before it reaches the store or after), and from that
//! moment every call of that worker hangs and writes nothing, as if the process had been killed.
//! Abort the worker ([`Running::abort`](crate::Running::abort)) and start another on the unwrapped
//! stores: it finds exactly what the dead one left.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! use std::sync::Arc;
//! use shardwise::lease::{LeaseStore, MemoryLeaseStore};
//! use shardwise::testing::{Crash, CrashPoint, When};
//! let store = MemoryLeaseStore::new();
//! // Die just after the second page barrier is stored, before its answer arrives.
//! let crash = Crash::at(CrashPoint::Barrier, 2, When::After);
//! let leases: Arc<dyn LeaseStore> = crash.leases(Arc::new(store.clone()));
//! assert!(!crash.crashed());
//! # let _ = leases;
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use futures::future::BoxFuture;
use tokio::sync::Notify;

use super::layer::{Call, Layer, Layered};
use crate::error::Error;
use crate::lease::LeaseStore;
use crate::paged::PagePosition;
use crate::receipts::{Apply, Committed, Disposition, EventId, Receipt, ReceiptStore, Recorded};

/// The kind of write a crash waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CrashPoint {
    /// A commit of effects with their receipts ([`ReceiptStore::commit`]).
    Commit,
    /// A terminal quarantine receipt ([`ReceiptStore::record`] of a quarantine).
    Quarantine,
    /// A held (reversible) receipt.
    Hold,
    /// A page barrier: a paged progress write that replaces the resume cursor.
    Barrier,
    /// A paged progress write that only raises the applied position.
    Progress,
    /// A Kinesis checkpoint write.
    Checkpoint,
}

/// Before the write reaches the store, or after it is stored (its answer never arrives); or not a
/// crash at all, only the write's answer lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum When {
    /// Nothing is written.
    Before,
    /// The write is stored; the worker dies before it learns so.
    After,
    /// The write is stored and its answer lost: the worker sees an error for a write that happened,
    /// and lives on ([`Crash::crashed`] stays `false`).
    LoseAnswer,
}

struct State {
    point: CrashPoint,
    /// Only writes of this event count.
    event: Option<EventId>,
    /// Only paged progress writes whose applied position reaches this count.
    position: Option<PagePosition>,
    nth: u32,
    when: When,
    seen: u32,
}

/// One worker's crash, shared by the stores it wraps.
#[derive(Clone)]
pub struct Crash {
    state: Arc<Mutex<State>>,
    crashed: Arc<AtomicBool>,
    notify: Arc<Notify>,
}

impl fmt::Debug for Crash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("Crash")
            .field("point", &state.point)
            .field("nth", &state.nth)
            .field("when", &state.when)
            .field("crashed", &self.crashed())
            .finish()
    }
}

impl Crash {
    /// Dies at the `nth` (from 1) write of kind `point`, `when` before or after it is stored.
    pub fn at(point: CrashPoint, nth: u32, when: When) -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                point,
                event: None,
                position: None,
                nth: nth.max(1),
                when,
                seen: 0,
            })),
            crashed: Arc::new(AtomicBool::new(false)),
            notify: Arc::new(Notify::new()),
        }
    }

    /// Dies at the write of kind `point` that carries `event` (the commit of its effects, its
    /// quarantine or hold receipt), `when` before or after it is stored. Commits of several events
    /// at once (settled together) count for each.
    pub fn on_event(point: CrashPoint, event: EventId, when: When) -> Self {
        let crash = Self::at(point, 1, when);
        crash
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .event = Some(event);
        crash
    }

    /// Dies at the first paged progress write of kind `point` ([`Barrier`](CrashPoint::Barrier)
    /// or [`Progress`](CrashPoint::Progress)) whose applied position reaches `position`, `when`
    /// before or after it is stored.
    pub fn on_position(point: CrashPoint, position: PagePosition, when: When) -> Self {
        let crash = Self::at(point, 1, when);
        crash
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .position = Some(position);
        crash
    }

    /// Whether the worker has died.
    pub fn crashed(&self) -> bool {
        self.crashed.load(Ordering::SeqCst)
    }

    /// How many writes of its kind the worker has made (or begun, for the one it died at).
    pub fn writes(&self) -> u32 {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .seen
    }

    /// Waits until the worker has died.
    pub async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            if self.crashed() {
                return;
            }
            notified.await;
        }
    }

    /// The lease store, through this crash.
    pub fn leases(&self, store: Arc<dyn LeaseStore>) -> Arc<dyn LeaseStore> {
        Arc::new(Layered::new(store, CrashingLeases(self.clone())))
    }

    /// The receipt ledger, through this crash.
    pub fn receipts(&self, store: Arc<dyn ReceiptStore>) -> Arc<dyn ReceiptStore> {
        Arc::new(CrashingReceipts {
            store,
            crash: self.clone(),
        })
    }

    fn die(&self) {
        self.crashed.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    /// Runs `call` unless the worker is dead or dies at it (then never returns), or loses its
    /// answer.
    async fn gate<T>(
        &self,
        kind: Option<CrashPoint>,
        call: impl Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        self.gate_events(kind, &[], None, call).await
    }

    /// [`gate`](Self::gate) for a write of these events.
    async fn gate_events<T>(
        &self,
        kind: Option<CrashPoint>,
        events: &[&EventId],
        applied: Option<&PagePosition>,
        call: impl Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        if self.crashed() {
            return std::future::pending().await;
        }
        let when = kind.and_then(|kind| {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if state.point != kind {
                return None;
            }
            if let Some(event) = &state.event
                && !events.contains(&event)
            {
                return None;
            }
            if let Some(position) = &state.position
                && applied.is_none_or(|a| a < position)
            {
                return None;
            }
            state.seen += 1;
            (state.seen == state.nth).then_some(state.when)
        });
        match when {
            None => call.await,
            Some(When::Before) => {
                self.die();
                std::future::pending().await
            }
            Some(When::After) => {
                let _stored = call.await;
                self.die();
                std::future::pending().await
            }
            Some(When::LoseAnswer) => {
                let _stored = call.await;
                Err(Error::DynamoDb {
                    operation: "injected",
                    table: "crash".into(),
                    source: "injected fault: the answer was lost after the write was stored".into(),
                })
            }
        }
    }
}

/// The lease store through a crash: every call passes the crash's gate, and the writes of a
/// checkpoint and of paged progress are its crash points.
#[derive(Debug)]
struct CrashingLeases(Crash);

impl Layer for CrashingLeases {
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: Call<'a>,
        forward: BoxFuture<'a, Result<T, Error>>,
    ) -> BoxFuture<'a, Result<T, Error>> {
        match call {
            Call::Checkpoint { .. } => Box::pin(self.0.gate(Some(CrashPoint::Checkpoint), forward)),
            Call::PagedCheckpoint { expected, to, .. } => {
                let kind = if to.checkpoint_version == expected.checkpoint_version {
                    CrashPoint::Progress
                } else {
                    CrashPoint::Barrier
                };
                Box::pin(
                    self.0
                        .gate_events(Some(kind), &[], to.applied_position.as_ref(), forward),
                )
            }
            _ => Box::pin(self.0.gate(None, forward)),
        }
    }
}

#[derive(Debug)]
struct CrashingReceipts {
    store: Arc<dyn ReceiptStore>,
    crash: Crash,
}

impl ReceiptStore for CrashingReceipts {
    fn prepare(&self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(self.crash.gate(None, self.store.prepare()))
    }

    fn get<'a>(&'a self, event: &'a EventId) -> BoxFuture<'a, Result<Option<Receipt>, Error>> {
        Box::pin(self.crash.gate(None, self.store.get(event)))
    }

    fn record<'a>(
        &'a self,
        event: &'a EventId,
        disposition: &'a Disposition,
        by: &'a str,
    ) -> BoxFuture<'a, Result<Recorded, Error>> {
        let kind = match disposition {
            Disposition::Quarantined(_) => Some(CrashPoint::Quarantine),
            Disposition::Held(_) => Some(CrashPoint::Hold),
            _ => None,
        };
        Box::pin(async move {
            self.crash
                .gate_events(
                    kind,
                    &[event],
                    None,
                    self.store.record(event, disposition, by),
                )
                .await
        })
    }

    fn release<'a>(&'a self, event: &'a EventId) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(self.crash.gate(None, self.store.release(event)))
    }

    fn commit<'a>(
        &'a self,
        applies: &'a [Apply],
        by: &'a str,
    ) -> BoxFuture<'a, Result<Vec<Committed>, Error>> {
        Box::pin(async move {
            let events: Vec<&EventId> = applies.iter().map(|a| &a.event).collect();
            self.crash
                .gate_events(
                    Some(CrashPoint::Commit),
                    &events,
                    None,
                    self.store.commit(applies, by),
                )
                .await
        })
    }

    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Receipt>, Error>> {
        Box::pin(self.crash.gate(None, self.store.list(limit)))
    }

    fn retention(&self) -> Option<std::time::Duration> {
        self.store.retention()
    }
}
