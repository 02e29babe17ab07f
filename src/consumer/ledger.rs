//! A shard's receipts: effects committed with their receipts (the effects of several deliveries
//! in one transaction where their items are distinct, one commit in flight at a time, in delivery
//! order), quarantine and hold receipts recorded, and held deliveries polled until someone makes
//! their receipt terminal (they settle) or releases it (they are handled again).
//!
//! A delivery settles only once its receipt is durable. A commit that fails (the store is
//! unreachable, or its answer is lost) is committed again; if the first one did go through, the
//! second finds the receipt and the delivery settles as a replay, with nothing written twice.

use std::collections::{BTreeMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{error, info, warn};

use super::copies::WriteEvent;
use super::hooks::Settled;
use crate::backoff::Backoff;
use crate::error::Error;
use crate::handler::Delivery;
use crate::receipts::{Apply, Committed, Disposition, Effects, Receipt, ReceiptStore, Recorded};
use crate::track::DeliveryId;

/// Deliveries committed in one call at most (the store packs them into as few transactions as
/// DynamoDB's limits allow).
const MAX_BATCH: usize = 100;
/// Longest wait before a failed commit or record is tried again.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

type Queued = (DeliveryId, Delivery, Effects);

/// What the ledger tells the shard.
#[derive(Debug)]
pub(crate) enum LedgerEvent {
    /// The delivery's outcome is durable.
    Settle(DeliveryId, Delivery, Settled),
    /// An effect's condition did not hold: it goes the retry way (a counted copy), as the condition
    /// may hold later.
    Retry(Delivery),
    /// Its effects can never be committed (over a limit, a missing table): its attempts are spent,
    /// it goes to the dead-letter stream with the reason (or is dropped without one).
    Spent(Delivery, String),
    /// Its hold was released: handle it again.
    Redeliver(Delivery),
}

/// The store's answers to a commit, one per delivery of the batch in flight.
type CommitDone = Result<Vec<Committed>, Error>;
/// Each held delivery and its receipt as read.
type PollDone = Vec<(DeliveryId, Result<Option<Receipt>, Error>)>;
type Commit = JoinHandle<CommitDone>;
type Poll = JoinHandle<PollDone>;
type Joined<T> = Result<T, tokio::task::JoinError>;

pub(crate) struct Ledger {
    store: Arc<dyn ReceiptStore>,
    worker: Arc<str>,
    queue: VecDeque<Queued>,
    /// The deliveries of the commit in flight: kept here, not in its task, so that a task that
    /// panics or is cancelled leaves them to be committed again rather than lost.
    in_flight: Vec<Queued>,
    commit: Option<Commit>,
    retry_at: Option<Instant>,
    failures: Backoff,
    held: BTreeMap<DeliveryId, Delivery>,
    poll: Option<Poll>,
    poll_every: Duration,
    polled_at: Instant,
    /// The `shardwise_held` gauge's labels (stream and shard), from the first held delivery.
    labels: Option<[(&'static str, String); 2]>,
}

impl Ledger {
    pub(crate) fn new(
        store: Arc<dyn ReceiptStore>,
        worker: Arc<str>,
        poll_every: Duration,
    ) -> Self {
        Self {
            store,
            worker,
            queue: VecDeque::new(),
            in_flight: Vec::new(),
            commit: None,
            retry_at: None,
            failures: Backoff::new(MAX_BACKOFF),
            held: BTreeMap::new(),
            poll: None,
            poll_every,
            polled_at: Instant::now(),
            labels: None,
        }
    }

    /// Sets `shardwise_held` (per stream and shard) to the deliveries waiting now. Set, not
    /// counted up and down, so an exporter that drops idle series never makes it wrong.
    fn held_gauge(&self) {
        if let Some(labels) = &self.labels {
            metrics::gauge!("shardwise_held", labels).set(self.held.len() as f64);
        }
    }

    /// Queues a delivery's effects; they are committed in order.
    pub(crate) fn apply(&mut self, id: DeliveryId, delivery: Delivery, effects: Effects) {
        self.queue.push_back((id, delivery, effects));
        self.start_commit();
    }

    /// Starts committing what is queued, unless a commit is in flight or backing off.
    pub(crate) fn start_commit(&mut self) {
        if self.commit.is_some()
            || self.queue.is_empty()
            || self.retry_at.is_some_and(|t| Instant::now() < t)
        {
            return;
        }
        let n = self.queue.len().min(MAX_BATCH);
        self.in_flight = self.queue.drain(..n).collect();
        let applies: Vec<Apply> = self
            .in_flight
            .iter()
            .map(|(_, d, effects)| Apply {
                event: d.event_id(),
                effects: effects.clone(),
            })
            .collect();
        let store = self.store.clone();
        let worker = self.worker.clone();
        self.commit = Some(tokio::spawn(crate::time::carry(async move {
            store.commit(&applies, &worker).await
        })));
    }

    /// Whether a commit or a poll is in flight.
    pub(crate) fn busy(&self) -> bool {
        self.commit.is_some() || self.poll.is_some()
    }

    /// Waits for the commit or the poll in flight, whichever ends first (call only while
    /// [`busy`](Self::busy)), and says what became of their deliveries.
    pub(crate) async fn next(&mut self) -> Vec<LedgerEvent> {
        enum Done {
            Commit(Joined<CommitDone>),
            Poll(Joined<PollDone>),
        }
        let (commit, poll) = (&mut self.commit, &mut self.poll);
        let done = tokio::select! {
            biased;
            r = async { commit.as_mut().expect("guarded").await }, if commit.is_some() => Done::Commit(r),
            r = async { poll.as_mut().expect("guarded").await }, if poll.is_some() => Done::Poll(r),
            else => return Vec::new(),
        };
        match done {
            Done::Commit(joined) => {
                self.commit = None;
                self.committed(joined)
            }
            Done::Poll(joined) => {
                self.poll = None;
                self.polled(joined)
            }
        }
    }

    fn committed(&mut self, joined: Joined<CommitDone>) -> Vec<LedgerEvent> {
        let batch = std::mem::take(&mut self.in_flight);
        let result = match joined {
            Ok(result) => result,
            Err(e) => {
                // Nothing is known of what reached the store: commit again (a commit that did
                // go through is found by its receipts, and settles as replays).
                let wait = self.failures.next();
                let what = if e.is_panic() {
                    "panicked"
                } else {
                    "was cancelled"
                };
                error!(
                    ?wait,
                    deliveries = batch.len(),
                    "the commit task {what}; its deliveries are committed again"
                );
                self.requeue(batch, wait);
                return Vec::new();
            }
        };
        let answers = match result {
            Ok(answers) if answers.len() != batch.len() => {
                let wait = self.failures.next();
                error!(
                    ?wait,
                    deliveries = batch.len(),
                    answers = answers.len(),
                    "the receipt store answered a commit with the wrong number of answers; its deliveries are committed again"
                );
                self.requeue(batch, wait);
                return Vec::new();
            }
            Ok(answers) => answers,
            Err(e) => {
                let wait = self.failures.next();
                let permanent = e.is_permanent();
                if permanent {
                    error!(
                        error = &e as &dyn std::error::Error,
                        ?wait,
                        deliveries = batch.len(),
                        "committing effects fails; the deliveries wait and hold the checkpoint"
                    );
                } else {
                    warn!(
                        error = &e as &dyn std::error::Error,
                        ?wait,
                        deliveries = batch.len(),
                        "committing effects failed; trying again"
                    );
                }
                self.requeue(batch, wait);
                return Vec::new();
            }
        };
        self.failures.reset();
        self.retry_at = None;
        let mut events = Vec::with_capacity(batch.len());
        for ((id, d, effects), answer) in batch.into_iter().zip(answers) {
            let stream = d.stream().to_string();
            match answer {
                // No effects: the receipt of an ack (a source that can hand it out again).
                Committed::Applied if effects.is_empty() => {
                    events.push(LedgerEvent::Settle(id, d, Settled::Acked));
                }
                Committed::Applied => {
                    metrics::counter!("shardwise_effects_applied_total", "stream" => stream)
                        .increment(1);
                    metrics::counter!("shardwise_effect_writes_total", "stream" => d.stream().to_string())
                        .increment(effects.len() as u64);
                    events.push(LedgerEvent::Settle(id, d, Settled::Applied));
                }
                Committed::Replay => {
                    metrics::counter!("shardwise_replays_total", "stream" => stream).increment(1);
                    info!(stream = d.stream(), shard = d.shard(), seq = %d.locator(), event = %d.event_id(), "replay: the event's receipt exists; nothing written again");
                    events.push(LedgerEvent::Settle(id, d, Settled::Replayed));
                }
                Committed::Refused(why) => {
                    metrics::counter!("shardwise_effects_refused_total", "stream" => stream)
                        .increment(1);
                    warn!(stream = d.stream(), shard = d.shard(), seq = %d.locator(), event = %d.event_id(), reason = %why, "an effect's condition did not hold (nothing was written): the delivery goes the retry way");
                    events.push(LedgerEvent::Retry(d));
                }
                Committed::Invalid(why) => {
                    metrics::counter!("shardwise_effects_invalid_total", "stream" => stream)
                        .increment(1);
                    error!(stream = d.stream(), shard = d.shard(), seq = %d.locator(), event = %d.event_id(), reason = %why, "effects that can never be committed (nothing was written): the delivery is spent");
                    events.push(LedgerEvent::Spent(d, why));
                }
            }
        }
        self.start_commit();
        events
    }

    /// Puts a batch back at the head of the queue, to be committed again after `wait`.
    fn requeue(&mut self, batch: Vec<Queued>, wait: Duration) {
        self.retry_at = Some(Instant::now() + wait);
        for queued in batch.into_iter().rev() {
            self.queue.push_front(queued);
        }
    }

    /// A delivery whose held receipt is recorded: it waits, and is polled.
    pub(crate) fn hold(&mut self, id: DeliveryId, delivery: Delivery) {
        self.labels.get_or_insert_with(|| {
            [
                ("stream", delivery.stream().to_string()),
                ("shard", delivery.shard().to_string()),
            ]
        });
        self.held.insert(id, delivery);
        self.held_gauge();
    }

    /// Deliveries waiting for their held receipt.
    pub(crate) fn held(&self) -> usize {
        self.held.len()
    }

    /// Starts reading the receipts of held deliveries, at most once per poll interval.
    pub(crate) fn start_poll(&mut self) {
        self.held_gauge();
        if self.poll.is_some() || self.held.is_empty() || self.polled_at.elapsed() < self.poll_every
        {
            return;
        }
        self.polled_at = Instant::now();
        let store = self.store.clone();
        let held: Vec<(DeliveryId, Delivery)> =
            self.held.iter().map(|(id, d)| (*id, d.clone())).collect();
        self.poll = Some(tokio::spawn(crate::time::carry(async move {
            let mut out = Vec::with_capacity(held.len());
            for (id, d) in held {
                out.push((id, store.get(&d.event_id()).await));
            }
            out
        })));
    }

    fn polled(&mut self, joined: Joined<PollDone>) -> Vec<LedgerEvent> {
        let Ok(results) = joined else {
            return Vec::new();
        };
        let mut events = Vec::new();
        for (id, result) in results {
            let done = match result {
                Ok(Some(receipt)) if receipt.disposition.is_terminal() => Some(
                    LedgerEvent::Settle(id, self.held[&id].clone(), Settled::Resolved),
                ),
                Ok(Some(_)) => None,
                Ok(None) => Some(LedgerEvent::Redeliver(self.held[&id].clone())),
                Err(e) => {
                    warn!(
                        error = &e as &dyn std::error::Error,
                        "reading a held receipt failed; polling again"
                    );
                    None
                }
            };
            if let Some(event) = done {
                self.held.remove(&id);
                events.push(event);
            }
        }
        self.held_gauge();
        events
    }

    /// Stops what is in flight (the shard is over: what did not settle is read again).
    pub(crate) fn abort(&mut self) {
        if let Some(commit) = self.commit.take() {
            commit.abort();
        }
        if let Some(poll) = self.poll.take() {
            poll.abort();
        }
        self.held.clear();
        self.held_gauge();
    }
}

/// Reads `event`'s receipt until the store answers: a failed read, and a store that panics, are
/// read again with backoff (the delivery waiting on it must be handed out or settled, not left by
/// a dead task). `why` says what the read is for, in the log.
pub(crate) async fn read_receipt(
    store: &dyn ReceiptStore,
    event: &crate::receipts::EventId,
    why: &str,
) -> Option<Receipt> {
    let mut failures = Backoff::new(Duration::from_secs(5));
    loop {
        match AssertUnwindSafe(store.get(event)).catch_unwind().await {
            Ok(Ok(receipt)) => return receipt,
            Ok(Err(e)) => {
                let wait = failures.next();
                warn!(%event, error = &e as &dyn std::error::Error, ?wait, "reading a receipt {why} failed; reading it again");
                tokio::time::sleep(wait).await;
            }
            Err(_) => {
                let wait = failures.next();
                error!(%event, ?wait, "the receipt store panicked while reading a receipt {why}; reading it again");
                tokio::time::sleep(wait).await;
            }
        }
    }
}

/// Records a quarantine or hold receipt for a delivery, until it is durable (backing off between
/// failures), and reports it: a quarantine (or an existing terminal receipt) settles it, a hold
/// makes it wait.
pub(crate) async fn record(
    store: Arc<dyn ReceiptStore>,
    worker: Arc<str>,
    id: DeliveryId,
    delivery: Delivery,
    disposition: Disposition,
    events: mpsc::UnboundedSender<WriteEvent>,
) {
    let event = delivery.event_id();
    let mut failures = Backoff::new(MAX_BACKOFF);
    loop {
        // A store that panics is a failed write, tried again: the delivery must not be left
        // unsettled for good by a task that died.
        let recorded = AssertUnwindSafe(store.record(&event, &disposition, &worker))
            .catch_unwind()
            .await;
        let Ok(recorded) = recorded else {
            let wait = failures.next();
            error!(%event, ?wait, "the receipt store panicked while recording; the record stays unsettled and is recorded again");
            tokio::time::sleep(wait).await;
            continue;
        };
        match recorded {
            Ok(Recorded::Recorded) => {
                let stream = delivery.stream().to_string();
                let report = match &disposition {
                    Disposition::Held(reason) => {
                        info!(stream, shard = delivery.shard(), seq = %delivery.locator(), %event, reason, "held: the record waits (and holds the checkpoint) until its receipt is made terminal or released");
                        WriteEvent::Held(id, delivery)
                    }
                    other => {
                        metrics::counter!("shardwise_quarantined_total", "stream" => stream)
                            .increment(1);
                        warn!(shard = delivery.shard(), seq = %delivery.locator(), %event, reason = other.reason().unwrap_or_default(), "quarantined");
                        WriteEvent::Durable(id, delivery, Settled::Quarantined)
                    }
                };
                let _ = events.send(report);
                return;
            }
            Ok(Recorded::Exists(_)) => {
                metrics::counter!("shardwise_replays_total", "stream" => delivery.stream().to_string())
                    .increment(1);
                let _ = events.send(WriteEvent::Durable(id, delivery, Settled::Replayed));
                return;
            }
            Err(e) => {
                let wait = failures.next();
                warn!(%event, error = &e as &dyn std::error::Error, ?wait, "recording a receipt failed; the record stays unsettled");
                tokio::time::sleep(wait).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use futures::future::BoxFuture;

    use super::*;
    use crate::receipts::{Effect, EventId, MemoryReceipts, key};
    use crate::track::Tracker;
    use crate::{Position, SequenceNumber};

    /// The memory ledger, whose first `panics` commits panic in the middle of the call.
    #[derive(Debug)]
    struct Panicking {
        inner: MemoryReceipts,
        panics: AtomicU32,
    }

    impl ReceiptStore for Panicking {
        fn prepare(&self) -> BoxFuture<'_, Result<(), Error>> {
            self.inner.prepare()
        }
        fn get<'a>(&'a self, event: &'a EventId) -> BoxFuture<'a, Result<Option<Receipt>, Error>> {
            self.inner.get(event)
        }
        fn record<'a>(
            &'a self,
            event: &'a EventId,
            disposition: &'a Disposition,
            by: &'a str,
        ) -> BoxFuture<'a, Result<Recorded, Error>> {
            Box::pin(async move {
                let left = self.panics.load(Ordering::SeqCst);
                if left > 0 {
                    self.panics.store(left - 1, Ordering::SeqCst);
                    panic!("a receipt store that panics mid-record");
                }
                self.inner.record(event, disposition, by).await
            })
        }
        fn release<'a>(&'a self, event: &'a EventId) -> BoxFuture<'a, Result<bool, Error>> {
            self.inner.release(event)
        }
        fn commit<'a>(
            &'a self,
            applies: &'a [Apply],
            by: &'a str,
        ) -> BoxFuture<'a, Result<Vec<Committed>, Error>> {
            Box::pin(async move {
                let left = self.panics.load(Ordering::SeqCst);
                if left > 0 {
                    self.panics.store(left - 1, Ordering::SeqCst);
                    panic!("a receipt store that panics mid-commit");
                }
                self.inner.commit(applies, by).await
            })
        }
        fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Receipt>, Error>> {
            self.inner.list(limit)
        }
    }

    /// A commit task that panics leaves its batch to be committed again: every delivery settles,
    /// and each effect is applied once.
    #[tokio::test(start_paused = true)]
    async fn a_commit_task_that_panics_commits_its_batch_again() {
        let inner = MemoryReceipts::new().table("counts", &["id"]);
        let store = Arc::new(Panicking {
            inner: inner.clone(),
            panics: AtomicU32::new(2),
        });
        let mut ledger = Ledger::new(store, Arc::from("w"), Duration::from_secs(1));
        let mut tracker: Tracker<u64> = Tracker::new(1);
        for n in 1..=3u64 {
            let id = tracker.track(n);
            let d = Delivery::builder(
                "s",
                "shard",
                Position::new(SequenceNumber::parse(&n.to_string()).unwrap(), 0),
            )
            .build();
            let effects = Effect::update("counts", key("id", n.to_string()))
                .add("count", 1)
                .into();
            ledger.apply(id, d, effects);
        }
        let mut settled = 0;
        while settled < 3 {
            assert!(
                ledger.busy() || !ledger.queue.is_empty(),
                "a batch was lost"
            );
            if !ledger.busy() {
                tokio::time::sleep(Duration::from_millis(100)).await;
                ledger.start_commit();
                continue;
            }
            for event in ledger.next().await {
                match event {
                    LedgerEvent::Settle(_, _, Settled::Applied) => settled += 1,
                    other => panic!("{other:?}"),
                }
            }
        }
        for n in 1..=3 {
            let item = inner
                .item("counts", &key("id", n.to_string()))
                .expect("the effect applied");
            assert_eq!(
                item.get("count"),
                Some(&aws_sdk_dynamodb::types::AttributeValue::N("1".into())),
                "{n}: applied once"
            );
        }
    }

    /// Recording a quarantine whose store panics is tried again: the delivery settles as
    /// quarantined instead of waiting for good.
    #[tokio::test(start_paused = true)]
    async fn a_receipt_record_that_panics_is_tried_again() {
        let inner = MemoryReceipts::new();
        let store = Arc::new(Panicking {
            inner: inner.clone(),
            panics: AtomicU32::new(2),
        });
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut tracker: Tracker<u64> = Tracker::new(1);
        let id = tracker.track(1);
        let d = Delivery::builder(
            "s",
            "shard",
            Position::new(SequenceNumber::parse("1").unwrap(), 0),
        )
        .build();
        let event = d.event_id();
        let task = tokio::spawn(crate::time::carry(record(
            store,
            Arc::from("w"),
            id,
            d,
            Disposition::Quarantined("poison".into()),
            tx,
        )));
        task.await.expect("the task ends, not by a panic");
        assert!(matches!(
            rx.recv().await,
            Some(WriteEvent::Durable(_, _, Settled::Quarantined))
        ));
        let receipt = inner.get(&event).await.unwrap().expect("recorded");
        assert_eq!(
            receipt.disposition,
            Disposition::Quarantined("poison".into())
        );
    }
}
