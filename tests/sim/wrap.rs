//! One worker's view of the shared store and stream: every call passes a gate first, so the
//! simulation can cut a worker off (a partition, or a pause longer than a lease) and let it back;
//! copies and dead letters it writes, and its receipt commits, are reported to the model.

use shardwise::paged::PagedProgress;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::future::BoxFuture;
use shardwise::Error;
use shardwise::envelope;
use shardwise::lease::{
    Checkpoint, CheckpointWrite, Lease, LeaseStore, MemoryLeaseStore, NewLease, Ownership, SeekMove,
};
use shardwise::producer::{RecordSink, Written};
use shardwise::receipts::{
    Apply, Committed, Disposition, EventId, MemoryReceipts, Receipt, ReceiptStore, Recorded,
};
use shardwise::shard::discovery::{ShardInfo, ShardLister};
use shardwise::shard::source::{Page, ReadError, RecordSource, StartAt};
use shardwise::testing::{MemoryStream, MemoryStreams};
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::Notify;

use crate::model::Model;
use crate::world::now_ms;

/// Open or cut: calls wait while it is cut. (One `Notify`: tokio's `watch` wakes its waiters in
/// an order drawn from tokio's own unseeded generator, which would make runs differ.)
#[derive(Debug, Clone, Default)]
pub struct Gate {
    cut: Arc<(AtomicBool, Notify)>,
}

impl Gate {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn set_cut(&self, cut: bool) {
        self.cut.0.store(cut, Ordering::SeqCst);
        if !cut {
            self.cut.1.notify_waiters();
        }
    }

    async fn pass(&self) {
        loop {
            let opened = self.cut.1.notified();
            if !self.cut.0.load(Ordering::SeqCst) {
                return;
            }
            opened.await;
        }
    }
}

pub struct Store {
    pub inner: MemoryLeaseStore,
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

impl LeaseStore for Store {
    fn prepare(&self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("prepare");
            self.inner.prepare().await
        })
    }
    fn list<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<Vec<Lease>, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("list");
            self.inner.list(stream).await
        })
    }
    fn get<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Lease>, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("get");
            self.inner.get(stream, shard_id).await
        })
    }
    fn create<'a>(&'a self, lease: &'a NewLease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("create");
            self.inner.create(lease).await
        })
    }
    fn take<'a>(
        &'a self,
        seen: &'a Lease,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Option<Lease>, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("take");
            self.inner.take(seen, owner).await
        })
    }
    fn renew<'a>(
        &'a self,
        held: &'a Ownership,
    ) -> BoxFuture<'a, Result<shardwise::lease::Renewal, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("renew");
            self.inner.renew(held).await
        })
    }
    fn checkpoint<'a>(
        &'a self,
        held: &'a Ownership,
        to: &'a Checkpoint,
        complete_through: Option<i64>,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("checkpoint");
            self.inner.checkpoint(held, to, complete_through).await
        })
    }
    fn paged_checkpoint<'a>(
        &'a self,
        held: &'a Ownership,
        expected: &'a PagedProgress,
        to: &'a PagedProgress,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("paged_checkpoint");
            self.inner.paged_checkpoint(held, expected, to).await
        })
    }
    fn release<'a>(&'a self, held: &'a Ownership) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("release");
            self.inner.release(held).await
        })
    }
    fn seek<'a>(&'a self, moves: &'a [SeekMove]) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("seek");
            self.inner.seek(moves).await
        })
    }
    fn advance_frontier<'a>(
        &'a self,
        held: &'a Ownership,
        complete_through: i64,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("advance_frontier");
            self.inner.advance_frontier(held, complete_through).await
        })
    }
    fn delete<'a>(&'a self, seen: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("delete");
            self.inner.delete(seen).await
        })
    }
    fn set_children<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
        children: &'a [String],
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("set_children");
            self.inner.set_children(stream, shard_id, children).await
        })
    }

    fn request<'a>(
        &'a self,
        seen: &'a shardwise::lease::Lease,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("request");
            self.inner.request(seen, taker).await
        })
    }

    fn pass<'a>(
        &'a self,
        held: &'a shardwise::lease::Ownership,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("pass");
            self.inner.pass(held, taker).await
        })
    }

    fn membership<'a>(
        &'a self,
        stream: &'a str,
    ) -> BoxFuture<'a, Result<Option<shardwise::frontier::Membership>, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("membership");
            self.inner.membership(stream).await
        })
    }

    fn publish_membership<'a>(
        &'a self,
        stream: &'a str,
        expected: Option<u64>,
        next: &'a shardwise::frontier::Membership,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("publish_membership");
            self.inner.publish_membership(stream, expected, next).await
        })
    }

    fn beat<'a>(
        &'a self,
        stream: &'a str,
        worker: &'a str,
        announce: bool,
    ) -> BoxFuture<'a, Result<shardwise::lease::Roster, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("beat");
            self.inner.beat(stream, worker, announce).await
        })
    }

    fn forget<'a>(
        &'a self,
        stream: &'a str,
        worker: &'a str,
        seen: Option<u64>,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.calls("forget");
            self.inner.forget(stream, worker, seen).await
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
}

impl ShardLister for Stream {
    fn list_shards<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<Vec<ShardInfo>, Error>> {
        Box::pin(async move {
            self.gate.pass().await;
            self.inner.list_shards(stream).await
        })
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
}
