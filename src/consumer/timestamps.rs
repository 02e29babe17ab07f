//! The progress of a partition read by timestamp (seed 000), for the owned loop
//! ([`owned`](super::owned)): polls strictly after the durable
//! `closed_through` (or after what this attempt's complete polls proved, when a held group keeps
//! it behind) -> timestamp groups -> lanes -> tracker -> a compare-and-swap of
//! `closed_through` and the version once a group is proven complete and every one of its events
//! has a durable terminal outcome (`docs/paged.md`).
//!
//! ```text
//! TAKEN ──► POLLING ──stop──► DRAINING ──drained, or only held deliveries left, or deadline──► FINAL CLOSE ──► Stopped
//!              └──partition gone, poll refused, an event without a timestamp, a stale attempt──► Failed (lease released)
//! any state ──lease given up (its token)──► FINAL CLOSE of what settled (fenced: refused if the row moved) ──► Lost
//! any state ──a close refused as Lost──► Lost (nothing more written)
//! ```
//!
//! Every write is `closed_through: c -> c'` (c' > c) with `checkpoint_version: g -> g + 1`,
//! conditioned on the owner, the epoch, and the row still holding `c` and `g`. A write refused as
//! not newer reads the row back: if it holds what this attempt wrote (now, or by an earlier write
//! whose answer was lost) the attempt goes on from it; anything else means the attempt is stale,
//! and it stops.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::owned::{Answer, Exit, Leased, OwnedContext, Prepared, Progress, Read};
use super::partition::{Uncertain, compare_and_swap};
use super::pipeline::{Advance, Pipeline, Retries};
use crate::error::Error;
use crate::handler::{Delivery, Handler, Replayable};
use crate::lease::HeldLease;
use crate::paged::reader::{AuditEvery, PollMessage, PollReader};
use crate::paged::{
    Finality, Groups, PagePosition, PagedEvent, PagedProgress, PagedSource, Seen, Timestamps,
};
use crate::track::Tracker;

/// How far ahead of the local clock a source may date an event (CloudWatch Logs takes events up
/// to two hours ahead): an event dated later than the attempt's start by more cannot have been
/// handed out by an earlier attempt.
const AHEAD_MS: i64 = 2 * 60 * 60 * 1000;

/// Unless the source says how often, every this many polls one reads again the audit window
/// behind `closed_through`, to find late events.
const AUDIT_EVERY: u32 = 10;

/// What every partition of a source read by timestamp is read from.
#[derive(Clone)]
pub(crate) struct Timestamped {
    pub(crate) source: Arc<dyn PagedSource>,
    pub(crate) contracts: Timestamps,
}

/// One owned partition's progress: the groups, the durable progress, and the writes whose answers
/// were lost.
pub(crate) struct Attempt {
    lease: Leased,
    groups: Groups,
    durable: PagedProgress,
    /// Closes whose answers were errors since the last one known stored.
    uncertain: Uncertain<PagedProgress>,
    /// Tells the poll reader where the next poll starts.
    after: watch::Sender<Option<i64>>,
    /// Tracked deliveries of open groups, by tracker index: settled as the settled prefix passes.
    pending: BTreeMap<u64, (i64, String)>,
    /// Events dated up to here may have been handled by an earlier attempt (the open groups after
    /// `closed_through` are read again): with a ledger, their receipts are read before the handler.
    earlier_attempts_through: i64,
    /// When the partition was last sought: receipts recorded before it do not stop the handler.
    sought_at: Option<i64>,
    /// The source (for the ingestion times its events carry).
    source: Arc<dyn PagedSource>,
    /// How long after its ingestion an event can be read, by the contract (the lateness bound
    /// that closes groups): an audit begun at `S` read every event ingested by `S` less this.
    /// `None`: the source keeps no audit mark.
    readable_after: Option<Duration>,
    /// The source's bound on how long an event takes to become readable, when it makes events
    /// readable in the order they were ingested ([`Timestamps::readable_within`]).
    readable_within: Option<Duration>,
    /// The newest ingestion time among the events of the poll under way: an audit vouches for
    /// nothing ingested after it ([`crate::paged::vouched_through`]).
    poll_newest_ingested: Option<i64>,
    /// The durable audit mark (in the row's `resumeCursor`): an event it covers that an audit
    /// finds was handed out by an earlier attempt.
    mark: Option<AuditMark>,
    /// The mark of the last complete audit, and the tracker index every delivery before which
    /// must settle before it may be written.
    pending_mark: Option<(AuditMark, u64)>,
    /// A mark ready to be written with the next close.
    ready_mark: Option<AuditMark>,
}

/// What an audit of a source that tells ingestion times proved: every event with a timestamp at
/// or after `from`, at or before `closed_through`, ingested at or before `through`, was handed out
/// and has a durable terminal outcome (or settled as known). Kept in the row's `resumeCursor`
/// (unused by sources read by timestamp) as `audited|<through>|<from>`, written with a close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct AuditMark {
    through: i64,
    from: i64,
}

impl AuditMark {
    fn encode(self) -> crate::paged::Cursor {
        crate::paged::Cursor::new(format!("audited|{}|{}", self.through, self.from))
    }

    fn decode(cursor: &crate::paged::Cursor) -> Option<Self> {
        let text = std::str::from_utf8(cursor.as_bytes()).ok()?;
        let mut parts = text.strip_prefix("audited|")?.split('|');
        let through = parts.next()?.parse().ok()?;
        let from = parts.next()?.parse().ok()?;
        Some(Self { through, from })
    }

    /// Whether the mark shows an event handed out.
    fn covers(self, timestamp: i64, ingested: i64) -> bool {
        timestamp >= self.from && ingested <= self.through
    }
}

impl Progress for Attempt {
    type Source = Timestamped;
    type Message = PollMessage;
    type Entry = PagePosition;
    type Write = PagedProgress;

    const RETRIES: Retries = Retries::InPlace;

    async fn prepare<H: Handler>(
        source: &Timestamped,
        ctx: &OwnedContext<H>,
        held: &HeldLease,
        reader: CancellationToken,
    ) -> Result<Prepared<Self>, Exit> {
        let settings = &ctx.pipeline.settings;
        let contracts = source.contracts;
        let ownership = held.ownership.clone();
        let durable = held.lease.progress.clone().unwrap_or_default();
        info!(
            source = %ownership.stream,
            partition = %ownership.shard_id,
            epoch = ownership.epoch,
            closed_through = ?durable.closed_through,
            version = durable.checkpoint_version,
            traversal = ?contracts.traversal,
            finality = ?contracts.finality,
            "partition started: polling strictly after closed_through"
        );
        if !contracts.can_close() {
            warn!(source = %ownership.stream, partition = %ownership.shard_id, traversal = ?contracts.traversal, finality = ?contracts.finality, "the source's contracts cannot prove a timestamp group complete: nothing will ever be closed, and every poll reads the open groups again (receipts make the replays harmless; shardwise_paged_replays_total counts them)");
        }
        let audit_ms = i64::try_from(contracts.audit_window.as_millis()).unwrap_or(i64::MAX);
        // An event polled again after `closed_through`, or found again by the audit behind it,
        // was first handed out at or after its ingestion, at most `AHEAD_MS` before its
        // timestamp, which is at least `closed_through` less the audit window.
        if source.source.bounds_replays() {
            let since = durable
                .closed_through
                .map(|through| through.saturating_sub(audit_ms).saturating_sub(AHEAD_MS));
            let now_ms = crate::time::millis(
                source
                    .source
                    .service_time()
                    .unwrap_or_else(crate::time::now),
            );
            if let Some(refused) =
                super::owned::refuse_past_expired_receipts(ctx, &ownership, since, now_ms)
            {
                return Err(Exit::Failed(ownership, refused));
            }
        }
        let mark = durable.resume_cursor.as_ref().and_then(AuditMark::decode);
        let (after_tx, after_rx) = watch::channel(durable.closed_through);
        let (polls_tx, polls_rx) = mpsc::channel(1);
        let poll_reader = PollReader {
            source: source.source.clone(),
            partition: ownership.shard_id.clone(),
            after: after_rx,
            poll_interval: settings.reader.poll_interval,
            max_backoff: settings.reader.max_backoff,
            audit: Some((
                source
                    .source
                    .audit_interval()
                    .map_or(AuditEvery::Polls(AUDIT_EVERY), AuditEvery::Interval),
                audit_ms,
            )),
        };
        tokio::spawn(crate::time::carry(poll_reader.run(polls_tx, reader)));
        Ok(Prepared {
            progress: Attempt {
                lease: Leased::new(&ownership, &ctx.store),
                groups: Groups::new(
                    contracts.traversal,
                    contracts.finality,
                    durable.closed_through,
                    durable.checkpoint_version,
                )
                .remember(audit_ms),
                durable,
                uncertain: Uncertain::default(),
                after: after_tx,
                pending: BTreeMap::new(),
                earlier_attempts_through: crate::time::millis(crate::time::now()) + AHEAD_MS,
                sought_at: held.lease.sought_at,
                source: source.source.clone(),
                readable_after: match contracts.finality {
                    Finality::Lateness(bound) => Some(bound),
                    _ => None,
                },
                readable_within: contracts.readable_within,
                poll_newest_ingested: None,
                mark,
                pending_mark: None,
                ready_mark: None,
            },
            reader: Some(polls_rx),
            finish: None,
        })
    }

    async fn read<H: Handler>(
        &mut self,
        message: PollMessage,
        pipeline: &mut Pipeline<H, PagePosition>,
    ) -> Read {
        match message {
            PollMessage::Events(events) => {
                let read = self.events(pipeline, &events);
                self.count_entries();
                read
            }
            PollMessage::Traversed {
                started_ms,
                watermark,
                before,
                audited_from,
            } => {
                self.groups.traversed(started_ms, watermark, before);
                // The next poll starts after what this one proved, when that is past
                // `closed_through` (a group held open by a failing event).
                self.after.send_replace(self.groups.query_after());
                let newest = self.poll_newest_ingested.take();
                if let (Some(from), Some(after)) = (audited_from, self.readable_after) {
                    // Everything the audit read is handed out, or known: once every delivery
                    // tracked so far settles, the mark may be written. It vouches for what was
                    // readable when the audit began.
                    let mark = AuditMark {
                        through: crate::paged::vouched_through(
                            started_ms,
                            after,
                            newest,
                            self.readable_within,
                        ),
                        from,
                    };
                    if pipeline.unsettled() == 0 {
                        self.ready_mark = Some(mark);
                    } else {
                        self.pending_mark = Some((mark, pipeline.tracker().next_index()));
                    }
                }
                Read::Note
            }
            PollMessage::Failed(error) => {
                Read::Failed(Error::paged(&self.lease.ownership, "fetch failed", error))
            }
        }
    }

    fn advanced(&mut self, advance: Advance<PagePosition>) {
        let rest = self.pending.split_off(&(advance.index + 1));
        for (timestamp, id) in std::mem::replace(&mut self.pending, rest).into_values() {
            self.groups.settled(timestamp, &id);
        }
        if let Some((mark, below)) = self.pending_mark
            && advance.index + 1 >= below
        {
            self.ready_mark = Some(mark);
            self.pending_mark = None;
        }
    }

    /// The next close, if the groups propose one, with the audit's mark when a newer one is
    /// ready.
    fn propose(&mut self, _tracker: &Tracker<PagePosition>) -> Option<PagedProgress> {
        let through = self.groups.proposal()?;
        let resume_cursor = match self.ready_mark {
            Some(mark) if self.mark.is_none_or(|m| mark.through > m.through) => Some(mark.encode()),
            _ => self.durable.resume_cursor.clone(),
        };
        Some(PagedProgress {
            closed_through: Some(through),
            checkpoint_version: self.durable.checkpoint_version + 1,
            resume_cursor,
            ..self.durable.clone()
        })
    }

    fn write(&self, to: &PagedProgress) -> BoxFuture<'static, Answer<PagedProgress>> {
        compare_and_swap(
            self.lease.store.clone(),
            self.lease.ownership.clone(),
            self.durable.clone(),
            (to.clone(), to.clone()),
            self.uncertain
                .iter()
                .map(|u| (u.clone(), u.clone()))
                .collect(),
        )
    }

    fn stored(&mut self, to: PagedProgress) {
        let through = to.closed_through.expect("a close");
        debug!(source = %self.lease.stream, partition = %self.lease.shard, closed_through = through, version = to.checkpoint_version, "closed");
        self.groups.closed(through, to.checkpoint_version);
        self.count_entries();
        if let Some(mark) = to.resume_cursor.as_ref().and_then(AuditMark::decode) {
            self.mark = Some(mark);
        }
        self.durable = to;
        self.uncertain.clear();
        self.after.send_replace(self.groups.query_after());
    }

    fn failed(&mut self, to: PagedProgress) {
        self.uncertain.push(to);
    }

    /// A source read by timestamp never ends a partition.
    fn ends(&self) -> bool {
        false
    }
}

impl Attempt {
    /// The memory the attempt holds, as gauges: `shardwise_paged_open_events` (events of open
    /// groups) and `shardwise_paged_remembered_events` (identities kept for the audit).
    fn count_entries(&self) {
        let (open, remembered) = self.groups.entries();
        metrics::gauge!("shardwise_paged_open_events", &self.lease.labels).set(open as f64);
        metrics::gauge!("shardwise_paged_remembered_events", &self.lease.labels)
            .set(remembered as f64);
    }

    /// A page's events: new ones handed out, late ones checked against their receipts.
    fn events<H: Handler>(
        &mut self,
        pipeline: &mut Pipeline<H, PagePosition>,
        events: &[PagedEvent],
    ) -> Read {
        let (source_name, partition) = (&self.lease.stream, &self.lease.shard);
        for event in events {
            if let Some(ingested) = self.source.ingested(event) {
                self.poll_newest_ingested = self.poll_newest_ingested.max(Some(ingested));
            }
            let Some(timestamp) = event.timestamp.map(crate::time::millis) else {
                warn!(source = %source_name, partition = %partition, id = %event.id, "an event without a timestamp from a source read by timestamp: the partition's attempt stops");
                return Read::Failed(Error::paged(
                    &self.lease.ownership,
                    "event without a timestamp",
                    format!(
                        "event `{}` has no timestamp, and the source is read by timestamp",
                        event.id
                    ),
                ));
            };
            match self.groups.saw(timestamp, &event.id) {
                Seen::New => {
                    let (id, lane) = pipeline.track(event.position.clone(), event.key.as_deref());
                    self.pending
                        .insert(id.index(), (timestamp, event.id.clone()));
                    let replayable = if timestamp <= self.earlier_attempts_through {
                        Replayable::Checked(self.sought_at)
                    } else {
                        Replayable::Recorded
                    };
                    let delivery = Delivery::paged(source_name.clone(), partition.clone(), event)
                        .set_id(id)
                        .set_lane(lane)
                        .replayable(replayable)
                        .build();
                    pipeline.dispatch(delivery);
                }
                Seen::Again => {
                    metrics::counter!("shardwise_paged_replays_total", &self.lease.labels)
                        .increment(1);
                }
                Seen::Late
                    if self.mark.is_some_and(|mark| {
                        self.source
                            .ingested(event)
                            .is_some_and(|ingested| mark.covers(timestamp, ingested))
                    }) =>
                {
                    // The durable audit mark shows it handed out by an earlier attempt.
                    metrics::counter!("shardwise_paged_replays_total", &self.lease.labels)
                        .increment(1);
                }
                Seen::Late => {
                    // Done by an earlier attempt (its receipt says so), or late: the receipt check
                    // counts it as late only when it is handed out.
                    debug!(source = %source_name, partition = %partition, id = %event.id, timestamp, closed_through = ?self.durable.closed_through, "an event at or before closed_through: handled unless its receipt shows it done");
                    pipeline.dispatch_late(source_name, partition, event);
                }
            }
        }
        Read::Page
    }
}
