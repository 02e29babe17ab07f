//! One worker's view of the shared store and stream: every call passes a gate first, so the
//! simulation can cut a worker off (a partition, or a pause longer than a lease) and let it back;
//! copies and dead letters it writes, and its receipt commits, are reported to the model.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use shardwise::Error;
use shardwise::envelope;

use shardwise::producer::{RecordSink, Written};
use shardwise::receipts::{
    Apply, Committed, Disposition, EventId, MemoryReceipts, Receipt, ReceiptStore, Recorded,
};
use shardwise::shard::discovery::{ShardInfo, ShardLister};
use shardwise::shard::source::{Page, ReadError, RecordSource, StartAt};
use shardwise::testing::{Call, Layer, MemoryStream, MemoryStreams};
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::Notify;

use crate::model::Model;
use crate::world::now_ms;

/// A cut of the lease table armed for a worker's next call of a method: (the method, how late
/// its answer comes, how long the cut lasts).
type Armed = (&'static str, Duration, Duration);

/// Open or cut: calls wait while it is cut. (One `Notify`: tokio's `watch` wakes its waiters in
/// an order drawn from tokio's own unseeded generator, which would make runs differ.)
#[derive(Debug, Clone, Default)]
pub struct Gate {
    cut: Arc<(AtomicBool, Notify)>,
    /// The lease table alone cut off (the stream still reachable).
    table: Arc<(AtomicBool, Notify)>,
    /// A cut of the lease table to begin once the next lease-store call of a method is applied
    /// and answered after a delay.
    armed: Arc<Mutex<Option<Armed>>>,
    /// This worker's beats refused as throttled (its renewals and everything else pass): the
    /// roster item throttled for its writes.
    beats_refused: Arc<AtomicBool>,
}

impl Gate {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn set_cut(&self, cut: bool) {
        set(&self.cut, cut);
    }

    /// Answers the worker's next lease-store call of `method` `slow` after it was applied, and
    /// cuts the worker off from the lease table (not from the stream) for `d` right after: a
    /// slow path to DynamoDB that then breaks, while records are still read and handled.
    pub fn arm(&self, method: &'static str, slow: Duration, d: Duration) {
        *self.armed.lock().unwrap() = Some((method, slow, d));
    }

    /// Refuses (or, `false`, lets through again) the worker's beats.
    pub fn refuse_beats(&self, refused: bool) {
        self.beats_refused.store(refused, Ordering::SeqCst);
    }

    /// Cuts the worker off from the lease table alone (the stream still reachable), or lets it
    /// back.
    pub fn set_table_cut(&self, cut: bool) {
        set(&self.table, cut);
    }

    async fn pass(&self) {
        pass(&self.cut).await;
    }

    /// The lease table's gate: the worker's and the table's own.
    async fn pass_table(&self) {
        pass(&self.cut).await;
        pass(&self.table).await;
    }
}

fn set(gate: &(AtomicBool, Notify), cut: bool) {
    gate.0.store(cut, Ordering::SeqCst);
    if !cut {
        gate.1.notify_waiters();
    }
}

async fn pass(gate: &(AtomicBool, Notify)) {
    loop {
        let opened = gate.1.notified();
        if !gate.0.load(Ordering::SeqCst) {
            return;
        }
        opened.await;
    }
}

/// The lease store as one worker reaches it (behind `Layered`): every call waits at the gate, and
/// so does its answer.
pub struct Store {
    pub gate: Gate,
    pub worker: String,
    pub model: Arc<Mutex<Model>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("worker", &self.worker)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// With `SHARDWISE_SIM_CALLS` set, every call a worker makes is an event (for debugging).
    fn calls(&self, what: &str) {
        if std::env::var_os("SHARDWISE_SIM_CALLS").is_some() {
            self.model
                .lock()
                .unwrap()
                .event(now_ms(), format!("call {} {what}", self.worker));
        }
    }
}

impl Layer for Store {
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: Call<'a>,
        forward: BoxFuture<'a, Result<T, Error>>,
    ) -> BoxFuture<'a, Result<T, Error>> {
        Box::pin(async move {
            self.gate.pass_table().await;
            self.calls(call.method());
            if call.method() == "beat" && self.gate.beats_refused.load(Ordering::SeqCst) {
                return Err(Error::DynamoDb {
                    operation: "UpdateItem",
                    table: "memory".into(),
                    source: "the roster item is throttled (ProvisionedThroughputExceeded)".into(),
                });
            }
            let answer = forward.await;
            let armed = {
                let mut armed = self.gate.armed.lock().unwrap();
                match *armed {
                    Some((method, slow, d)) if method == call.method() => {
                        *armed = None;
                        Some((slow, d))
                    }
                    _ => None,
                }
            };
            if let Some((slow, d)) = armed {
                tokio::time::sleep(slow).await;
                self.model.lock().unwrap().event(
                    now_ms(),
                    format!(
                        "worker {} cut off from the lease table after {} was answered {} ms late, for {} ms",
                        self.worker,
                        call.method(),
                        slow.as_millis(),
                        d.as_millis()
                    ),
                );
                set(&self.gate.table, true);
                let (gate, model, worker) =
                    (self.gate.clone(), self.model.clone(), self.worker.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(d).await;
                    set(&gate.table, false);
                    model.lock().unwrap().event(
                        now_ms(),
                        format!("worker {worker} reaches the lease table again"),
                    );
                });
                return answer;
            }
            // A cut that began while the call was in flight holds its answer too: applied, and
            // answered only once the worker is reachable again (a slow answer, not a lost one).
            self.gate.pass_table().await;
            answer
        })
    }
}

/// The stream as one worker reaches it: reads, listings, and writes of copies and dead letters.
pub struct Stream {
    pub inner: MemoryStream,
    pub sink: MemoryStreams,
    pub gate: Gate,
    pub worker: String,
    pub model: Arc<Mutex<Model>>,
}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("worker", &self.worker)
            .finish_non_exhaustive()
    }
}

impl RecordSource for Stream {
    fn shard_iterator<'a>(
        &'a self,
        stream: &'a str,
        shard: &'a str,
        start: &'a StartAt,
    ) -> BoxFuture<'a, Result<String, ReadError>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.inner.shard_iterator(stream, shard, start).await
        })
    }
    fn get_records<'a>(
        &'a self,
        iterator: &'a str,
        limit: i32,
    ) -> BoxFuture<'a, Result<Page, ReadError>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.inner.get_records(iterator, limit).await
        })
    }
    fn service_time(&self) -> Option<std::time::SystemTime> {
        RecordSource::service_time(&self.inner)
    }
}

impl ShardLister for Stream {
    fn list_shards<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<Vec<ShardInfo>, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.inner.list_shards(stream).await
        })
    }
    fn service_time(&self) -> Option<std::time::SystemTime> {
        ShardLister::service_time(&self.inner)
    }
    fn retention<'a>(
        &'a self,
        stream: &'a str,
    ) -> BoxFuture<'a, Result<shardwise::receipts::SourceRetention, Error>> {
        self.inner.retention(stream)
    }
}

impl RecordSink for Stream {
    fn put<'a>(
        &'a self,
        stream: &'a str,
        partition_key: &'a str,
        data: Bytes,
    ) -> BoxFuture<'a, Result<Written, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            let decoded = envelope::decode(data.clone());
            let result = self.sink.put(stream, partition_key, data).await;
            if result.is_ok() {
                // A copy of attempt n carries the retry count n (a dead letter too).
                let attempt = decoded.headers.retry_count();
                let id = crate::model::id_of(&decoded.payload);
                self.model
                    .lock()
                    .unwrap()
                    .copied(now_ms(), &self.worker, id, attempt, stream);
            }
            result
        })
    }

    fn check<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.sink.check(stream).await
        })
    }
}

/// The receipt ledger as one worker reaches it; after each commit the model checks that no
/// effect was applied twice and that every apply wrote all its effects or none.
pub struct Receipts {
    pub inner: MemoryReceipts,
    pub gate: Gate,
    pub worker: String,
    pub model: Arc<Mutex<Model>>,
}

impl std::fmt::Debug for Receipts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receipts")
            .field("worker", &self.worker)
            .finish_non_exhaustive()
    }
}

impl Receipts {
    fn calls(&self, what: &str) {
        if std::env::var_os("SHARDWISE_SIM_CALLS").is_some() {
            self.model
                .lock()
                .unwrap()
                .event(now_ms(), format!("call {} receipts {what}", self.worker));
        }
    }
}

impl ReceiptStore for Receipts {
    fn prepare(&self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.inner.prepare().await
        })
    }
    fn get<'a>(&'a self, event: &'a EventId) -> BoxFuture<'a, Result<Option<Receipt>, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("get");
            self.inner.get(event).await
        })
    }
    fn record<'a>(
        &'a self,
        event: &'a EventId,
        disposition: &'a Disposition,
        by: &'a str,
    ) -> BoxFuture<'a, Result<Recorded, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            let recorded = self.inner.record(event, disposition, by).await;
            self.model.lock().unwrap().event(
                now_ms(),
                format!(
                    "receipt {} {event} {}: {recorded:?}",
                    self.worker,
                    disposition.label()
                ),
            );
            recorded
        })
    }
    fn release<'a>(&'a self, event: &'a EventId) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.inner.release(event).await
        })
    }
    fn commit<'a>(
        &'a self,
        applies: &'a [Apply],
        by: &'a str,
    ) -> BoxFuture<'a, Result<Vec<Committed>, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            let committed = self.inner.commit(applies, by).await;
            let mut model = self.model.lock().unwrap();
            let events: Vec<&str> = applies.iter().map(|a| a.event.as_str()).collect();
            model.event(
                now_ms(),
                format!("commit {} {events:?}: {committed:?}", self.worker),
            );
            model.check_ledger(now_ms());
            committed
        })
    }
    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Receipt>, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.inner.list(limit).await
        })
    }
    fn retention(&self) -> Option<std::time::Duration> {
        ReceiptStore::retention(&self.inner)
    }
}

/// An on-failure destination (a queue, as SQS is) as one worker reaches it: behind the worker's
/// gate, failing at the world's `error` rate without effect, and at its `lost` rate writing the
/// message and losing the answer (the record is sent again: at least once). Each message written
/// is a copy of the record's last attempt for the model.
pub struct Queue {
    pub gate: Gate,
    pub worker: String,
    pub model: Arc<Mutex<Model>>,
    /// The world's draws for the queue's faults, and the rates (error, lost answer).
    pub faults: Arc<Mutex<(rand::rngs::StdRng, f64, f64)>>,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue")
            .field("worker", &self.worker)
            .finish_non_exhaustive()
    }
}

impl shardwise::destination::Destination for Queue {
    fn name(&self) -> &str {
        "sqs:sim"
    }

    fn send<'a>(
        &'a self,
        delivery: &'a shardwise::Delivery,
        headers: &'a envelope::Headers,
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            use rand::Rng;
            self.gate.pass().await;
            let (fails, loses) = {
                let mut faults = self.faults.lock().unwrap();
                let (error, lost) = (faults.1, faults.2);
                (faults.0.random_bool(error), faults.0.random_bool(lost))
            };
            let failure = |what: &str| Error::Destination {
                destination: self.name().to_string(),
                operation: "SendMessage",
                permanent: false,
                source: what.to_string().into(),
            };
            if fails {
                return Err(failure("simulated 500"));
            }
            // A dead letter of attempt n carries the retry count n.
            let id = crate::model::id_of(delivery.payload());
            self.model.lock().unwrap().copied(
                now_ms(),
                &self.worker,
                id,
                headers.retry_count(),
                self.name(),
            );
            if loses {
                return Err(failure("simulated lost answer"));
            }
            Ok(())
        })
    }

    fn check(&self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async { Ok(()) })
    }
}
