//! A paged partition's progress for the owned loop ([`owned`](super::owned)): reader -> order
//! validation -> lanes -> tracker -> page barrier -> compare-and-swap progress writes
//! (`docs/paged.md`).
//!
//! ```text
//! TAKEN ──► READING ──stop──► DRAINING ──drained, or only held deliveries left, or deadline──► FINAL WRITES ──► Stopped
//!              │
//!              ├──page without a next cursor, every delivery settled──► SHARD_END ──► Ended
//!              └──order violation, partition gone, cursor refused, a stale attempt──► Failed (lease released)
//! any state ──lease given up (its token)──► FINAL WRITES of what settled (fenced: refused if the row moved) ──► Lost
//! any state ──a write refused as Lost──► Lost (nothing more written)
//! ```
//!
//! A write refused as not newer is not retried blindly: the row is read back. If it holds what
//! the write meant to store, an earlier try of the same write went through and its answer was
//! lost; if it holds one of the writes whose answers were errors since the last one known stored
//! (`Uncertain`), that one went through. Anything else means this attempt is stale, and it
//! stops.

use std::collections::HashSet;
use std::sync::Arc;

use futures::future::BoxFuture;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::owned::{Answer, Exit, Leased, OwnedContext, Prepared, Progress, Read};
use super::pipeline::{Advance, Pipeline, Retries};
use crate::error::Error;
use crate::handler::{Delivery, Handler, Replayable};
use crate::lease::{CheckpointWrite, HeldLease, LeaseStore, Ownership};
use crate::paged::reader::{HandedOut, Instant, PageMessage, PageReader};
use crate::paged::{
    Barrier, BarrierWrite, LATE_EVENTS, Order, PagePosition, PagedEvent, PagedProgress,
    PagedSource, Verdict, Vouched,
};
use crate::track::Tracker;

/// One owned partition's progress.
pub(crate) struct Pages {
    lease: Leased,
    /// Whether an event at or below the applied prefix may come again (a backfilling source).
    replayable: Replayable,
    order: Order,
    barrier: Barrier,
    /// The writes whose answers were errors since the last one known stored: any one of them may
    /// have been stored. A write refused as not newer checks the row against each before calling
    /// this attempt stale.
    uncertain: Uncertain<BarrierWrite>,
    /// The source said the partition is gone: its row is deleted once it ended.
    gone: bool,
    /// The applied position this attempt started from: a late event an audit finds at or below
    /// it may have been handed out by an earlier attempt.
    started_at: Option<PagePosition>,
    /// For a source that audits for late events: what this attempt handed out, for as long as
    /// an audit can return it.
    handed_out: Option<HandedOut>,
    /// The source, for what an attempt vouches for at a graceful stop and the ingestion times of
    /// what it hands out.
    source: Arc<dyn PagedSource>,
    /// During an audit whose range an earlier attempt vouched for: that, and the events of the
    /// range the audit returned that this attempt did not hand out (held until the audit ends).
    vouched: Option<(Vouched, Vec<PagedEvent>, HashSet<String>)>,
    /// When this attempt last read something new (started, a page or an audit with events): a
    /// partition with nothing new for its source's [`retire_after`](PagedSource::retire_after)
    /// retires.
    news: tokio::time::Instant,
    /// At a graceful stop: how many events this attempt handed out that its final audit's mark
    /// does not cover (ingested after it). A partition retires only when none were.
    after_final_mark: Option<u64>,
}

impl Progress for Pages {
    type Source = Arc<dyn PagedSource>;
    type Message = PageMessage;
    type Entry = PagePosition;
    type Write = BarrierWrite;

    const RETRIES: Retries = Retries::InPlace;

    async fn prepare<H: Handler>(
        source: &Arc<dyn PagedSource>,
        ctx: &OwnedContext<H>,
        held: &HeldLease,
        reader: CancellationToken,
    ) -> Result<Prepared<Self>, Exit> {
        let settings = &ctx.pipeline.settings;
        let ownership = held.ownership.clone();
        let durable = held.lease.progress.clone().unwrap_or_default();
        info!(
            source = %ownership.stream,
            partition = %ownership.shard_id,
            epoch = ownership.epoch,
            cursor = %durable.resume_cursor.as_ref().map_or("(first page)".to_string(), ToString::to_string),
            applied = %durable.applied_position.as_ref().map_or("-".to_string(), ToString::to_string),
            version = durable.checkpoint_version,
            "partition started"
        );
        let now_ms = crate::time::millis(source.service_time().unwrap_or_else(crate::time::now));
        // What a replay needs: the receipts since the durable cursor's page was read, or since
        // what the source says (a mark behind which an audit finds events again), if earlier.
        // A retired partition woken: its progress was written with nothing handed out after
        // its last audit's mark, and reading on from it hands nothing out again (see
        // `Pages::retired_at`): no receipt is needed, however old.
        if source.bounds_replays() && held.woken_from.is_none() {
            let since = match (
                durable.receipts_since,
                source.receipts_needed_since(&durable),
            ) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            if let Some(refused) =
                super::owned::refuse_past_expired_receipts(ctx, &ownership, since, now_ms)
            {
                return Err(Exit::Failed(ownership, refused));
            }
        }
        let contract = source.contract();
        // A source that audits for late events audits once more at a graceful stop (see
        // `PageReader::run`): the reader is told to finish, not cancelled.
        let finish = source.audit_interval().map(|_| reader.child_token());
        let messages = (!held.lease.checkpoint.is_shard_end()).then(|| {
            let (pages_tx, pages_rx) = mpsc::channel(1);
            let page_reader = PageReader {
                source: source.clone(),
                partition: ownership.shard_id.clone(),
                cursor: durable.resume_cursor.clone(),
                applied: durable.applied_position.clone(),
                poll_interval: settings.reader.poll_interval,
                idle_poll_max: settings.reader.idle_poll_max,
                max_backoff: settings.reader.max_backoff,
            };
            let finish = finish.clone().unwrap_or_else(|| reader.clone());
            tokio::spawn(crate::time::carry(
                page_reader.run(pages_tx, reader, finish),
            ));
            pages_rx
        });
        Ok(Prepared {
            progress: Pages {
                lease: Leased::new(&ownership, &ctx.store),
                // A backfilling source hands out events at or below its applied prefix again,
                // and so does an audit for late events after a restart: with a ledger, every
                // outcome leaves a receipt, which is what tells such an event is done (see
                // `Verdict`).
                replayable: if contract.backfill || source.audit_interval().is_some() {
                    Replayable::Recorded
                } else {
                    Replayable::No
                },
                order: Order::new(contract, durable.applied_position.clone()),
                // The tracker starts at arrival index 0.
                barrier: Barrier::new(durable.clone(), 0),
                uncertain: Uncertain::default(),
                gone: false,
                started_at: durable.applied_position,
                handed_out: source.audit_interval().map(|_| HandedOut::default()),
                source: source.clone(),
                vouched: None,
                news: tokio::time::Instant::now(),
                after_final_mark: None,
            },
            reader: messages,
            finish,
        })
    }

    async fn read<H: Handler>(
        &mut self,
        message: PageMessage,
        pipeline: &mut Pipeline<H, PagePosition>,
    ) -> Read {
        match message {
            PageMessage::Page {
                events,
                next,
                watermark,
            } => self.page(pipeline, events, next, watermark),
            PageMessage::Gone => {
                metrics::counter!("shardwise_paged_partitions_gone_total", &self.lease.labels)
                    .increment(1);
                warn!(source = %self.lease.stream, partition = %self.lease.shard, "the partition is gone (not found, and no longer listed): it ends once every delivery settled, and its lease row is deleted");
                self.gone = true;
                self.page(pipeline, Vec::new(), None, None)
            }
            PageMessage::Late(events) => self.late(pipeline, &events),
            PageMessage::Vouched(vouched) => {
                // (Events held for an audit given up before its end come again in the next.)
                self.vouched = Some((vouched, Vec::new(), HashSet::new()));
                Read::Note
            }
            PageMessage::Audited {
                next,
                forget_before,
                last,
            } => {
                self.settle_vouched(pipeline);
                // At a graceful stop: vouch for what the next attempt's first audit returns
                // though this one handed it out (before forgetting any of it).
                let next = match (&self.handed_out, last) {
                    (Some(handed_out), true) => self
                        .source
                        .vouch_range(&next)
                        .and_then(|(after, through)| {
                            let vouched = handed_out.vouch(after, through);
                            self.after_final_mark = Some(vouched.count);
                            debug!(source = %self.lease.stream, partition = %self.lease.shard, count = vouched.count, "vouched for what the next owner's first audit returns");
                            self.source.vouch(&next, &vouched)
                        })
                        .unwrap_or(next),
                    _ => next,
                };
                if let (Some(handed_out), Some(before)) = (self.handed_out.as_mut(), forget_before)
                {
                    handed_out.forget_before(before);
                    debug!(source = %self.lease.stream, partition = %self.lease.shard, remembered = handed_out.len(), "audit for late events done");
                }
                self.page(pipeline, Vec::new(), Some(next), None)
            }
            PageMessage::Failed(error) => {
                Read::Failed(Error::paged(&self.lease.ownership, "fetch failed", error))
            }
        }
    }

    fn gone(&self) -> bool {
        self.gone
    }

    fn advanced(&mut self, advance: Advance<PagePosition>) {
        // For a source of groups the applied position claims only the groups before this one.
        let claim = self.order.claim(&advance.entry);
        self.barrier.settled(advance.index + 1, Some(&claim));
    }

    fn propose(&mut self, _tracker: &Tracker<PagePosition>) -> Option<BarrierWrite> {
        self.barrier
            .next_write()
            .filter(|w| *w != BarrierWrite::End)
    }

    fn write(&self, write: &BarrierWrite) -> BoxFuture<'static, Answer<BarrierWrite>> {
        let to = write
            .progress()
            .expect("the end is a checkpoint write")
            .clone();
        let earlier = self
            .uncertain
            .iter()
            .filter_map(|w| Some((w.clone(), w.progress()?.clone())))
            .collect();
        compare_and_swap(
            self.lease.store.clone(),
            self.lease.ownership.clone(),
            self.barrier.durable().clone(),
            (write.clone(), to),
            earlier,
        )
    }

    fn stored(&mut self, write: BarrierWrite) {
        self.uncertain.clear();
        if let Some(applied) = write.progress().and_then(|t| t.applied_position.as_ref()) {
            self.order.applied(applied);
        }
        self.barrier.written(&write);
    }

    fn failed(&mut self, write: BarrierWrite) {
        self.uncertain.push(write);
    }

    fn ends(&self) -> bool {
        self.barrier.next_write() == Some(BarrierWrite::End)
    }

    /// Nothing new for the source's retirement time, and nothing left to write.
    fn idle(&self) -> bool {
        !self.gone
            && self.barrier.next_write().is_none()
            && self
                .source
                .retire_after()
                .is_some_and(|after| self.news.elapsed() >= after)
    }

    /// The stored cursor's [`read_through`](PagedSource::read_through), when this attempt
    /// handed out nothing its final audit's mark does not cover: then reading on from the cursor
    /// hands nothing out again, and a woken partition needs no receipt. Otherwise (an event
    /// arrived in the last moments) the partition is released, not retired.
    fn retired_at(&self) -> Option<i64> {
        if self.after_final_mark != Some(0) {
            debug!(source = %self.lease.stream, partition = %self.lease.shard, after_final_mark = self.after_final_mark, "not retired: events were handed out after the final audit's mark");
            return None;
        }
        let cursor = self.barrier.durable().resume_cursor.as_ref()?;
        self.source.read_through(cursor)
    }
}

impl Pages {
    /// A page: its events are checked against the source's order, and the new ones handed out.
    fn page<H: Handler>(
        &mut self,
        pipeline: &mut Pipeline<H, PagePosition>,
        events: Vec<crate::paged::PagedEvent>,
        next: Option<crate::paged::Cursor>,
        watermark: Option<i64>,
    ) -> Read {
        let (source_name, partition) = (&self.lease.stream, &self.lease.shard);
        // Every event after this page's cursor is handed out after now (for what a replay needs).
        let now_ms =
            crate::time::millis(self.source.service_time().unwrap_or_else(crate::time::now));
        let verdicts = match self.order.classify(&events) {
            Ok(verdicts) => verdicts,
            Err(violation) => {
                metrics::counter!("shardwise_paged_order_violations_total", &self.lease.labels)
                    .increment(1);
                warn!(source = %source_name, partition = %partition, error = &violation as &dyn std::error::Error, "the page breaks the source's order: the partition's attempt stops (the lease is released; the next owner reads again from the durable cursor)");
                return Read::Failed(Error::paged(
                    &self.lease.ownership,
                    "order violation",
                    violation,
                ));
            }
        };
        if !events.is_empty() {
            self.news = tokio::time::Instant::now();
        }
        let before = pipeline.tracker().next_index();
        for (event, verdict) in events.into_iter().zip(verdicts) {
            match verdict {
                Verdict::New => {
                    if let Some(handed_out) = self.handed_out.as_mut() {
                        handed_out.insert(&event.id, Instant::now(), self.source.ingested(&event));
                    }
                    let (id, lane) = pipeline.track(event.position.clone(), event.key.as_deref());
                    let delivery =
                        Delivery::from_paged(source_name.clone(), partition.clone(), event)
                            .set_id(id)
                            .set_lane(lane)
                            .replayable(self.replayable)
                            .build();
                    pipeline.dispatch(delivery);
                }
                Verdict::Backfill => {
                    let id = pipeline.track_only(event.position.clone());
                    let delivery =
                        Delivery::from_paged(source_name.clone(), partition.clone(), event)
                            .set_id(id)
                            .replayable(self.replayable)
                            .build();
                    pipeline.dispatch_unless_done(delivery, None);
                }
                Verdict::Replay => {
                    metrics::counter!("shardwise_paged_replays_total", &self.lease.labels)
                        .increment(1);
                    debug!(source = %source_name, partition = %partition, position = %event.position, id = %event.id, "replay: at or below the applied prefix; not handed to the handler");
                }
                Verdict::Overlap => {
                    debug!(source = %source_name, partition = %partition, position = %event.position, id = %event.id, "overlap: already handed out");
                }
            }
        }
        let tracked = pipeline.tracker().next_index() != before;
        let ended = next.is_none();
        // A page that brings nothing new and leaves the cursor where it is changes nothing (a
        // cursor that did not move, read again).
        let raised = watermark > self.barrier.fetched_watermark();
        if tracked || ended || raised || self.barrier.fetch_cursor() != Some(next.as_ref()) {
            self.barrier
                .fetched(next, pipeline.tracker().next_index(), watermark, now_ms);
        }
        if ended {
            info!(source = %source_name, partition = %partition, "the partition ended: SHARD_END once every delivery settled");
            Read::LastPage
        } else {
            Read::Page
        }
    }
}

impl Pages {
    /// Events an audit returned behind the forward cursor. Those this attempt handed out
    /// (remembered) are passed over. Above the applied position the attempt started from, this
    /// attempt read forward over the rest: they arrived late, and are handed out. At or below
    /// it an earlier attempt may have handled them: a terminal receipt settles one as a replay,
    /// anything else hands it out (never skipped). Events of a range the previous owner vouched
    /// for ([`Vouched`]) wait for the audit's end ([`Self::settle_vouched`]).
    /// Either way the deliveries hold the page barrier until they settle, so the audited cursor
    /// the reader sends after them is promoted only then.
    fn late<H: Handler>(
        &mut self,
        pipeline: &mut Pipeline<H, PagePosition>,
        events: &[crate::paged::PagedEvent],
    ) -> Read {
        if !events.is_empty() {
            self.news = tokio::time::Instant::now();
        }
        for event in events {
            let ingested = self.source.ingested(event);
            if let Some(handed_out) = &self.handed_out
                && handed_out.contains(&event.id)
            {
                // Handed out by this attempt (read forward, or found by an earlier audit).
                continue;
            }
            if let Some((vouched, held, ids)) = self.vouched.as_mut()
                && ingested.is_some_and(|at| vouched.covers(at))
            {
                if ids.insert(event.id.clone()) {
                    held.push(event.clone());
                }
                continue;
            }
            self.late_one(pipeline, event, ingested);
        }
        Read::Page
    }

    /// The events of a vouched range the audit that just ended returned: passed over when they
    /// are exactly those the attempt before vouched for (it handed them out), all handed out
    /// otherwise.
    fn settle_vouched<H: Handler>(&mut self, pipeline: &mut Pipeline<H, PagePosition>) {
        let Some((vouched, held, _)) = self.vouched.take() else {
            return;
        };
        let mut returned = Vouched::new(vouched.after, vouched.through);
        for event in &held {
            returned.add(&event.id);
        }
        if returned == vouched {
            metrics::counter!("shardwise_paged_replays_total", &self.lease.labels)
                .increment(held.len() as u64);
            debug!(source = %self.lease.stream, partition = %self.lease.shard, count = held.len(), "the audit returned exactly what the previous owner vouched for: not handed out again");
            if let Some(handed_out) = self.handed_out.as_mut() {
                for event in &held {
                    handed_out.insert(&event.id, Instant::now(), self.source.ingested(event));
                }
            }
            return;
        }
        debug!(source = %self.lease.stream, partition = %self.lease.shard, vouched = vouched.count, returned = returned.count, "the audit returned other events than the previous owner vouched for: every one of them is handed out");
        for event in &held {
            let ingested = self.source.ingested(event);
            self.late_one(pipeline, event, ingested);
        }
    }

    /// An event an audit returned that this attempt did not hand out.
    fn late_one<H: Handler>(
        &mut self,
        pipeline: &mut Pipeline<H, PagePosition>,
        event: &PagedEvent,
        ingested: Option<i64>,
    ) {
        let (source_name, partition) = (&self.lease.stream, &self.lease.shard);
        if let Some(handed_out) = self.handed_out.as_mut()
            && !handed_out.insert(&event.id, Instant::now(), ingested)
        {
            // Returned twice by one audit.
            return;
        }
        let timestamp = event.timestamp.map(crate::time::millis);
        // (For a source of groups: in the group of that position or before it, which that
        // position claims only in part.)
        if self
            .started_at
            .as_ref()
            .is_some_and(|a| self.order.claim(&event.position) <= *a)
        {
            debug!(source = %source_name, partition = %partition, id = %event.id, timestamp, "an audit found an event at or below the applied position this attempt started from: handled unless its receipt shows it done");
            pipeline.dispatch_late(source_name, partition, event);
            return;
        }
        metrics::counter!(LATE_EVENTS, &self.lease.labels).increment(1);
        warn!(source = %source_name, partition = %partition, id = %event.id, timestamp, "a late event: put behind what was read already, found by an audit; handed out now");
        let (id, lane) = pipeline.track(event.position.clone(), event.key.as_deref());
        let delivery = Delivery::paged(source_name.clone(), partition.clone(), event)
            .set_id(id)
            .set_lane(lane)
            .replayable(Replayable::Recorded)
            .build();
        pipeline.dispatch(delivery);
    }
}

/// The writes of an attempt whose answers were errors, since the last write known stored: each
/// was made from the same stored progress, so at most one of them is stored, and the next write
/// refused as not newer tells which. Every one is kept (a failed write followed by another failed
/// write must not hide the first, which may be the one stored); equal ones once.
#[derive(Debug)]
pub(crate) struct Uncertain<W>(Vec<W>);

impl<W> Default for Uncertain<W> {
    fn default() -> Self {
        Self(Vec::new())
    }
}

impl<W: PartialEq> Uncertain<W> {
    pub(crate) fn push(&mut self, write: W) {
        if !self.0.contains(&write) {
            self.0.push(write);
        }
    }

    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &W> {
        self.0.iter()
    }
}

/// The compare-and-swap of a partition's progress from `expected` to `to` (`write`'s progress),
/// fenced by the lease. Under our epoch only we write, so one refused as not newer means one of:
/// this write is stored (an earlier try of it went through and its answer was lost), one of
/// `earlier` is (writes of this attempt whose answers were errors), or the attempt is stale. The
/// row tells.
pub(crate) fn compare_and_swap<W: Send + 'static>(
    store: Arc<dyn LeaseStore>,
    ownership: Ownership,
    expected: PagedProgress,
    (write, to): (W, PagedProgress),
    earlier: Vec<(W, PagedProgress)>,
) -> BoxFuture<'static, Answer<W>> {
    Box::pin(async move {
        match store.paged_checkpoint(&ownership, &expected, &to).await {
            Ok(CheckpointWrite::NotNewer) => {}
            other => return Answer::of(write, other),
        }
        let row = match store.get(&ownership.stream, &ownership.shard_id).await {
            Ok(Some(row)) if row.ownership().as_ref() == Some(&ownership) => row,
            Ok(_) => return Answer::Lost,
            Err(e) => return Answer::Unread(e),
        };
        if row.progress.as_ref() == Some(&to) {
            return Answer::Stored(write);
        }
        if let Some((earlier, _)) = earlier
            .into_iter()
            .find(|(_, progress)| row.progress.as_ref() == Some(progress))
        {
            debug!(source = %ownership.stream, partition = %ownership.shard_id, "an earlier progress write whose answer was lost is stored");
            return Answer::Stored(earlier);
        }
        warn!(source = %ownership.stream, partition = %ownership.shard_id, stored = ?row.progress, meant = ?to, "the stored progress moved under this attempt: it is stale and stops (the lease is given back; the partition is read again from what is stored)");
        Answer::Stale(Error::paged(
            &ownership,
            "stale attempt",
            format!(
                "stored progress {:?} is not what this attempt wrote ({to:?})",
                row.progress
            ),
        ))
    })
}
