//! A Kinesis shard's progress for the owned loop ([`owned`](super::owned)): reader -> lanes ->
//! tracker -> coalesced, fenced checkpoints.
//!
//! States and what each write is conditioned on:
//!
//! ```text
//! TAKEN ──checkpoint LATEST──► PIN (fenced write of AT_TIMESTAMP(now - margin)) ──┐
//!   └──any other checkpoint─────────────────────────────────────────────────────┤
//!                                                                                ▼
//! READING ──stop──► DRAINING ──drained, or only held deliveries left, or deadline──► FINAL CHECKPOINT ──► Stopped
//!    │
//!    ├──reader at the end of a closed shard──► ENDING ──every delivery settled──► SHARD_END ──► Ended
//!    └──shard aged out of retention (not listed)──► ENDING (warning, metric) ──────────────────► Ended
//! any state ──lease lost (token) or a write refused as Lost──► Lost (no further writes)
//! ```
//!
//! Every checkpoint write is the store's fenced write: owner and ownership epoch of this lease, and
//! a position greater than the stored one ([`Checkpointer`]).
//!
//! A LATEST checkpoint is pinned before anything is dispatched: otherwise a worker killed before its
//! first checkpoint would leave LATEST behind, and the next owner would open a new LATEST iterator
//! and skip every record written in between.

use std::sync::Arc;
use std::time::SystemTime;

use futures::future::BoxFuture;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::checkpointer::{Checkpointer, Entry, Write};
use super::ending::Reading;
use super::owned::{Answer, Exit, Leased, Lost, OwnedContext, Prepared, Progress, Read};
use super::pipeline::{Advance, Pipeline, Retries};
use crate::backoff::Backoff;
use crate::checkpoint::Checkpoint;
use crate::error::Error;
use crate::handler::{Delivery, Handler};
use crate::lease::{CheckpointWrite, HeldLease, Ownership};
use crate::position::Position;
use crate::shard::discovery::ShardLister;
use crate::shard::reader::{ReaderMessage, ShardReader};
use crate::shard::source::{ReadError, RecordSource, StartAt};
use crate::time::millis;
use crate::track::Tracker;
use crate::window::{WindowSlots, WindowState};

/// What every shard of a stream is read from.
#[derive(Clone)]
pub(crate) struct Shards {
    pub(crate) source: Arc<dyn RecordSource>,
    /// Tells a shard that aged out of retention from a stream that is gone.
    pub(crate) lister: Arc<dyn ShardLister>,
}

/// The lag gauges of a shard: refreshed every checkpoint interval while the shard is held here
/// (so an exporter that drops idle series keeps them), and zeroed when the shard stops here, so a
/// shard that moved to another worker does not keep reporting its last lag from this one.
struct Lag {
    labels: [(&'static str, String); 2],
    /// The last `MillisBehindLatest` read.
    behind: i64,
}

impl Lag {
    fn millis_behind(&mut self, ms: i64) {
        self.behind = ms;
        metrics::gauge!("shardwise_millis_behind_latest", &self.labels).set(ms as f64);
    }

    /// Sets every gauge again: the last lag read, and the end-to-end age (now minus the arrival of
    /// the oldest unsettled delivery; 0 with none).
    fn refresh(&mut self, oldest_arrival_ms: Option<i64>) {
        self.millis_behind(self.behind);
        let age = oldest_arrival_ms.map_or(0, |ms| (millis(crate::time::now()) - ms).max(0));
        self.record_age(age as f64 / 1000.0);
    }

    fn record_age(&self, seconds: f64) {
        metrics::gauge!("shardwise_record_age_seconds", &self.labels).set(seconds);
    }
}

impl Drop for Lag {
    fn drop(&mut self) {
        self.millis_behind(0);
        self.record_age(0.0);
    }
}

/// A shard read on tumbling windows: the handler's slots, and its final call for the shard's
/// open window when it is over by a time (ms; `i64::MAX`: whatever the time).
struct Windows {
    slots: Arc<WindowSlots>,
    close: Box<dyn Fn(i64) -> BoxFuture<'static, bool> + Send + Sync>,
    /// The service's time (ms) of the last read that found the shard caught up.
    caught_up_ms: Option<i64>,
    /// A window state whose write failed: written with the next write unless a newer one comes.
    retry: Option<Option<WindowState>>,
}

/// One owned shard's progress.
pub(crate) struct Shard {
    lease: Leased,
    lister: Arc<dyn ShardLister>,
    /// Asked why a shard the stream lists is not found (enhanced fan-out: a consumer gone).
    source: Arc<dyn RecordSource>,
    checkpointer: Checkpointer,
    lag: Lag,
    /// Where reading started, and the last record read: what an aged-out shard was read through.
    start: Checkpoint,
    last_read: Option<Position>,
    windows: Option<Windows>,
}

impl Progress for Shard {
    type Source = Shards;
    type Message = ReaderMessage;
    type Entry = Entry;
    type Write = Write;

    const RETRIES: Retries = Retries::Copies;

    async fn prepare<H: Handler>(
        source: &Shards,
        ctx: &OwnedContext<H>,
        held: &HeldLease,
        reader: CancellationToken,
    ) -> Result<Prepared<Self>, Exit> {
        let settings = &ctx.pipeline.settings;
        let ownership = held.ownership.clone();
        info!(stream = %ownership.stream, shard = %ownership.shard_id, epoch = ownership.epoch, checkpoint = %held.lease.checkpoint, "shard started");
        let start = pin_start(ctx, source.source.as_ref(), held).await?;
        let windows = match ctx.pipeline.handler.window_slots() {
            Some(slots) => {
                let at = match &held.lease.checkpoint {
                    Checkpoint::At(p) => Some(*p),
                    _ => None,
                };
                slots
                    .restore(
                        &ownership.stream,
                        &ownership.shard_id,
                        held.lease.window.clone(),
                        at,
                    )
                    .await;
                let handler = ctx.pipeline.handler.clone();
                let (stream, shard) = (ownership.stream.clone(), ownership.shard_id.clone());
                Some(Windows {
                    slots: slots.clone(),
                    close: Box::new(move |now_ms| {
                        let (handler, stream, shard) =
                            (handler.clone(), stream.clone(), shard.clone());
                        Box::pin(async move {
                            handler.close_window_if_over(&stream, &shard, now_ms).await
                        })
                    }),
                    caught_up_ms: None,
                    retry: None,
                })
            }
            None => None,
        };
        let checkpointer = Checkpointer::new(
            ctx.store.clone(),
            ownership.clone(),
            &held.lease.checkpoint,
            held.lease.complete_through,
            settings.caught_up_skew,
            settings.frontier_interval,
        );
        let (reader_tx, reader_rx) = mpsc::channel(1);
        let messages = ShardReader::new(
            source.source.clone(),
            &ownership.stream,
            &ownership.shard_id,
            &start,
            settings.reader,
        )
        .map(|shard_reader| {
            tokio::spawn(crate::time::carry(shard_reader.run(reader_tx, reader)));
            reader_rx
        }); // None: already at SHARD_END
        let lease = Leased::new(&ownership, &ctx.store);
        Ok(Prepared {
            progress: Shard {
                lag: Lag {
                    labels: lease.labels.clone(),
                    behind: 0,
                },
                lease,
                lister: source.lister.clone(),
                source: source.source.clone(),
                checkpointer,
                start,
                last_read: None,
                windows,
            },
            reader: messages,
            finish: None,
        })
    }

    async fn read<H: Handler>(
        &mut self,
        message: ReaderMessage,
        pipeline: &mut Pipeline<H, Entry>,
    ) -> Read {
        match message {
            ReaderMessage::Records {
                records,
                millis_behind_latest,
            } => {
                if let Some(ms) = millis_behind_latest {
                    self.lag.millis_behind(ms);
                }
                let caught_up = records.is_empty() && millis_behind_latest == Some(0);
                self.checkpointer.read(caught_up);
                if let Some(windows) = &mut self.windows {
                    // A service that does not say how far behind an empty read is: caught up.
                    let caught_up =
                        records.is_empty() && millis_behind_latest.is_none_or(|ms| ms == 0);
                    windows.caught_up_ms = caught_up.then(|| {
                        millis(self.source.service_time().unwrap_or_else(crate::time::now))
                    });
                }
                for r in records {
                    self.last_read = Some(r.position);
                    let (id, lane) = pipeline.track(
                        (r.position, r.arrived_at.map(millis)),
                        Some(&r.partition_key),
                    );
                    let mut delivery = Delivery::from_blob(
                        self.lease.stream.clone(),
                        self.lease.shard.clone(),
                        r.position,
                        r.partition_key,
                        r.data,
                    )
                    .set_arrived_at(r.arrived_at)
                    .set_explicit_hash_key(r.explicit_hash_key)
                    .set_id(id)
                    .set_lane(lane);
                    if let Some(headers) = r.headers {
                        delivery = delivery.headers(headers);
                    }
                    let delivery = delivery.build();
                    pipeline.dispatch(delivery);
                }
                Read::Page
            }
            ReaderMessage::End => Read::Over(Reading::Closed),
            ReaderMessage::Gone => self.gone().await,
        }
    }

    fn advanced(&mut self, advance: Advance<Entry>) {
        self.checkpointer.settled(advance.entry);
    }

    fn propose(&mut self, tracker: &Tracker<Entry>) -> Option<Write> {
        let Some(windows) = &mut self.windows else {
            return self.checkpointer.propose(tracker);
        };
        let (stream, shard) = (&self.lease.ownership.stream, &self.lease.ownership.shard_id);
        let mut write = self.checkpointer.propose(tracker);
        if write.is_none() && (windows.retry.is_some() || windows.slots.unwritten(stream, shard)) {
            write = self.checkpointer.propose_again();
        }
        if let Some(write) = &mut write {
            write.window = windows
                .slots
                .state_through(stream, shard, &write.to)
                .or_else(|| windows.retry.take());
            windows.retry = None;
        }
        write
    }

    fn write(&self, write: &Write) -> BoxFuture<'static, Answer<Write>> {
        self.checkpointer.write(write.clone())
    }

    fn stored(&mut self, write: Write) {
        self.checkpointer.stored(write);
    }

    fn failed(&mut self, write: Write) {
        if let Some(windows) = &mut self.windows
            && write.window.is_some()
        {
            windows.retry = write.window.clone();
        }
        self.checkpointer.failed(write);
    }

    fn unwritten(&self) -> bool {
        self.checkpointer.unwritten()
            || self.windows.as_ref().is_some_and(|w| {
                w.retry.is_some()
                    || w.slots
                        .unwritten(&self.lease.ownership.stream, &self.lease.ownership.shard_id)
            })
    }

    async fn tick(&mut self, tracker: &Tracker<Entry>, writing: bool) -> Result<(), Lost> {
        self.lag
            .refresh(tracker.oldest_unsettled().and_then(|e| e.1));
        // A window over while the shard is caught up and nothing is in flight: its final call.
        if let Some(windows) = &self.windows
            && let Some(caught_up) = windows.caught_up_ms
            && tracker.is_drained()
            && windows
                .slots
                .open(&self.lease.ownership.stream, &self.lease.ownership.shard_id)
                .is_some_and(|w| w.end_ms <= caught_up)
        {
            (windows.close)(caught_up).await;
        }
        self.checkpointer
            .maybe_advance_frontier(tracker, writing)
            .await
    }

    async fn before_end(&mut self) -> Result<(), Error> {
        let Some(windows) = &self.windows else {
            return Ok(());
        };
        // The shard ended: its open window is over (Lambda's "when the shard ends, Lambda
        // considers the window closed"); SHARD_END removes the state.
        let mut backoff = Backoff::new(std::time::Duration::from_secs(10));
        for _ in 0..5 {
            if (windows.close)(i64::MAX).await {
                return Ok(());
            }
            tokio::time::sleep(backoff.next()).await;
        }
        Err(Error::Config(crate::error::ConfigError::new(
            "tumbling_window",
            &self.lease.ownership.shard_id,
            "the final call of the shard's last window keeps failing: SHARD_END waits for it",
        )))
    }

    fn ends(&self) -> bool {
        true
    }
}

impl Shard {
    /// The reader cannot find the shard: it aged out of retention (the stream no longer lists
    /// it), or the stream is gone.
    async fn gone(&self) -> Read {
        let listed = match self.lister.list_shards(&self.lease.ownership.stream).await {
            Ok(shards) => shards
                .iter()
                .any(|s| s.shard_id == self.lease.ownership.shard_id),
            Err(e) => return Read::Failed(e),
        };
        if listed {
            let (stream, shard) = (&self.lease.ownership.stream, &self.lease.ownership.shard_id);
            if let Some(e) = self.source.explain_not_found(stream, shard).await {
                return Read::Failed(e);
            }
            return Read::Failed(Error::Kinesis {
                operation: if self.source.pushes() {
                    "SubscribeToShard"
                } else {
                    "GetRecords"
                },
                stream: self.lease.ownership.stream.clone(),
                shard: Some(self.lease.ownership.shard_id.clone()),
                source: Box::new(ReadError::NotFound),
            });
        }
        let read_through = self
            .last_read
            .map_or_else(|| self.start.to_string(), |p| p.to_string());
        warn!(
            stream = %self.lease.stream,
            shard = %self.lease.shard,
            read_through = %read_through,
            "shard aged out of the stream's retention before it was read to its end: \
             its records after {read_through} were trimmed unread; ending it (SHARD_END \
             once what was read settles) so its children start"
        );
        metrics::counter!("shardwise_shards_aged_out_total", &self.lease.labels).increment(1);
        Read::Over(Reading::AgedOut)
    }
}

/// Replaces a LATEST checkpoint with a fixed start before anything is read: AT_TIMESTAMP of the
/// service's time now (from its answers: [`service_now`]) minus the configured margin, written
/// fenced by this lease. Every later owner starts at the same place, so a worker that dies before
/// its first checkpoint makes the next one repeat records, never skip them. Any other checkpoint
/// is returned as it is.
async fn pin_start<H>(
    ctx: &OwnedContext<H>,
    source: &dyn RecordSource,
    held: &HeldLease,
) -> Result<Checkpoint, Exit> {
    if held.lease.checkpoint != Checkpoint::Latest {
        return Ok(held.lease.checkpoint.clone());
    }
    let ownership = &held.ownership;
    let now = tokio::select! {
        biased;
        _ = held.cancel.cancelled() => return Err(Exit::Lost(ownership.clone())),
        _ = ctx.stop.cancelled() => return Err(Exit::Stopped(ownership.clone())),
        now = service_now(source, ownership) => now,
    };
    let to = Checkpoint::AtTimestamp(
        now.checked_sub(ctx.pipeline.settings.latest_margin)
            .unwrap_or(now),
    );
    let mut backoff = Backoff::new(ctx.pipeline.settings.reader.max_backoff);
    loop {
        let result = tokio::select! {
            biased;
            _ = held.cancel.cancelled() => return Err(Exit::Lost(ownership.clone())),
            _ = ctx.stop.cancelled() => return Err(Exit::Stopped(ownership.clone())),
            r = ctx.store.checkpoint(ownership, &to, None) => r,
        };
        let error = match result {
            Ok(CheckpointWrite::Written) => {
                info!(stream = %ownership.stream, shard = %ownership.shard_id, start = %to, "LATEST start pinned before reading");
                return Ok(to);
            }
            Ok(CheckpointWrite::Lost) => return Err(Exit::Lost(ownership.clone())),
            // Under our epoch only we write: an earlier attempt of ours was applied but its
            // answer lost. Read back what it stored.
            Ok(CheckpointWrite::NotNewer) => {
                match ctx.store.get(&ownership.stream, &ownership.shard_id).await {
                    Ok(Some(row)) if row.ownership().as_ref() == Some(ownership) => {
                        return Ok(row.checkpoint);
                    }
                    Ok(_) => return Err(Exit::Lost(ownership.clone())),
                    Err(e) => e,
                }
            }
            Err(e) => e,
        };
        let wait = backoff.next();
        warn!(stream = %ownership.stream, shard = %ownership.shard_id, error = &error as &dyn std::error::Error, ?wait, "pinning the LATEST start failed; retrying before reading");
        tokio::select! {
            biased;
            _ = held.cancel.cancelled() => return Err(Exit::Lost(ownership.clone())),
            _ = ctx.stop.cancelled() => return Err(Exit::Stopped(ownership.clone())),
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// A time the stream's service has certainly reached: from its answers' dates, so that a host
/// whose clock runs ahead cannot pin a LATEST start after records that arrive later (an
/// AT_TIMESTAMP in the future returns only what arrives after it). When no answer has told it
/// yet, a LATEST iterator is opened (no effect) to hear one; a service that never says is taken
/// at this host's clock.
async fn service_now(source: &dyn RecordSource, ownership: &Ownership) -> SystemTime {
    if let Some(at) = source.service_time() {
        return at;
    }
    let heard = source
        .shard_iterator(&ownership.stream, &ownership.shard_id, &StartAt::Latest)
        .await;
    source.service_time().unwrap_or_else(|| {
        warn!(
            stream = %ownership.stream,
            shard = %ownership.shard_id,
            answered = heard.is_ok(),
            "the stream's answers carry no date: pinning the LATEST start by this host's clock"
        );
        crate::time::now()
    })
}
