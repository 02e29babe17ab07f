//! The lease manager: renews what it holds on its own task and timer, takes and steals as the
//! planner decides, keeps lease rows in step with the stream's shards, and hands leases back on
//! shutdown. See `docs/leases.md` for the states and the condition on every write.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::StreamExt;
use futures::future::join_all;
use futures::stream::FuturesUnordered;
use tokio::sync::{Notify, mpsc, oneshot, watch};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::hold::Hold;
use super::liveness::{Liveness, Twin};
use super::local::{Effect, Leases, NotNow, Patience};
use super::planner::{self, PlanLimits, Seen, Take};
use super::row::{InitialPosition, Lease, Ownership};
use super::store::{LeaseStore, Renewal};
use super::sync;
use crate::backoff::Backoff;
use crate::error::{ConfigError, Error};
use crate::frontier::{self, Frontier};
use crate::shard::discovery::{ShardInfo, ShardLister};

/// Lease timing and balancing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseSettings {
    /// A lease whose counter has not moved for this long (local clock) is expired. Default 10 s.
    pub lease_duration: Duration,
    /// How often held leases are renewed. Default `lease_duration / 3`.
    pub renew_interval: Duration,
    /// How often this worker beats in the stream's roster (one small write that reads the roster
    /// back). Default `lease_duration / 10` (1 s). A worker is dead once its beat has been silent
    /// for `lease_duration` + this.
    pub beat_interval: Duration,
    /// How often the table is scanned while this worker is settling: below its share, awaiting a
    /// handoff, after a change of the roster or a lost lease, and at start. Default 2 s.
    pub scan_interval: Duration,
    /// How often a balanced worker scans the table when nothing moves. `None` (the default):
    /// `lease_duration` x the live workers, so the table as a whole is read about once per lease
    /// duration whatever the number of workers. The stream frontier is recomputed on every scan.
    pub idle_scan_interval: Option<Duration>,
    /// How often the stream's shards are listed to create rows for new ones. Default 60 s (and
    /// whenever a shard ends). From a listing that found a shard (or partition) without a row,
    /// the frontier withholds its scalar until the row exists.
    pub shard_sync_interval: Duration,
    /// Balancing limits.
    pub limits: PlanLimits,
    /// Where shards new to the application start.
    pub initial_position: InitialPosition,
    /// Cooperative handoff: how long an owner asked to hand a lease over lets its in-flight
    /// deliveries settle before it aborts them, writes its final checkpoint and passes the lease.
    /// A taker that asked steals the lease once this, one scan and one renewal have passed without
    /// the handoff. Default 5 s.
    pub handoff_timeout: Duration,
}

impl Default for LeaseSettings {
    fn default() -> Self {
        let lease_duration = Duration::from_secs(10);
        Self {
            lease_duration,
            renew_interval: lease_duration / 3,
            beat_interval: lease_duration / 10,
            scan_interval: Duration::from_secs(2),
            idle_scan_interval: None,
            shard_sync_interval: Duration::from_secs(60),
            limits: PlanLimits::default(),
            initial_position: InitialPosition::TrimHorizon,
            handoff_timeout: Duration::from_secs(5),
        }
    }
}

impl LeaseSettings {
    /// Sets the lease duration and, with it, the renew interval to a third of it and the beat
    /// interval to a tenth.
    pub fn lease_duration(mut self, d: Duration) -> Self {
        self.lease_duration = d;
        self.renew_interval = d / 3;
        self.beat_interval = d / 10;
        self
    }

    /// Sets the beat interval.
    pub fn beat_interval(mut self, d: Duration) -> Self {
        self.beat_interval = d;
        self
    }

    /// Sets the renew interval.
    pub fn renew_interval(mut self, d: Duration) -> Self {
        self.renew_interval = d;
        self
    }

    /// Sets the scan interval.
    pub fn scan_interval(mut self, d: Duration) -> Self {
        self.scan_interval = d;
        self
    }

    /// Sets how often a balanced worker scans when nothing moves (see the field).
    pub fn idle_scan_interval(mut self, d: Duration) -> Self {
        self.idle_scan_interval = Some(d);
        self
    }

    /// Sets the shard sync interval.
    pub fn shard_sync_interval(mut self, d: Duration) -> Self {
        self.shard_sync_interval = d;
        self
    }

    /// Sets the balancing limits.
    pub fn limits(mut self, limits: PlanLimits) -> Self {
        self.limits = limits;
        self
    }

    /// Sets where new shards start.
    pub fn initial_position(mut self, p: InitialPosition) -> Self {
        self.initial_position = p;
        self
    }

    /// Sets the handoff timeout.
    pub fn handoff_timeout(mut self, d: Duration) -> Self {
        self.handoff_timeout = d;
        self
    }

    /// How long the counter of a lease whose owner is dead by the roster must be seen still
    /// before the lease counts as expired: two renewal rounds and a quarter. Its owner, whose
    /// beats are not landing, lets the lease go before (see [`Self::hold_until`]).
    fn dead_owner_stillness(&self) -> Duration {
        self.renew_interval * 2 + self.renew_interval / 4
    }

    /// A worker is dead once its beat has not changed for a lease duration and one beat
    /// interval: its last renewal came at most one beat interval after its last beat, so a lease
    /// is never taken earlier than a lease duration after its last renewal.
    pub(super) fn silence(&self) -> Duration {
        self.lease_duration + self.beat_interval
    }

    /// How long after the send of its last beat that landed a worker stops taking leases: its
    /// view of the roster may be that old, and with it the deaths it would take leases for (the
    /// others judge a worker dead after [`Self::silence`], far later). `lease_duration` less one
    /// and a half renewal intervals, and at least one and a half.
    pub(crate) fn give_up_after(&self) -> Duration {
        let round_and_a_half = self.renew_interval * 3 / 2;
        self.lease_duration
            .saturating_sub(round_and_a_half)
            .max(round_and_a_half)
    }

    /// Until when this worker may hold a lease whose last renewal that landed was sent at
    /// `renewed`, while the last of its own beats that landed was sent at `beat` (both on this
    /// worker's clock, stamped at the send: the others see either move no earlier than it was
    /// applied, which is after it was sent). Another worker takes the lease once it has seen its
    /// counter still for a lease duration, or, once it judges the owner dead (its beat unchanged
    /// for [`Self::silence`]), still for [`Self::dead_owner_stillness`]: the earliest it can is
    /// the earlier of the two. The owner lets go half a renewal interval before that (the margin
    /// the round-by-round check of before kept at the defaults: 1.7 s).
    ///
    /// A renewal or beat answered late is not a lost one: its answer, when it comes, counts from
    /// its send, and a lease is given up only when this instant passes without a later one
    /// (issue 27, "a slow answer is not a lost one").
    pub(crate) fn hold_until(&self, renewed: Instant, beat: Instant) -> Instant {
        let by_counter = renewed + self.lease_duration;
        let as_dead = (beat + self.silence()).max(renewed + self.dead_owner_stillness());
        // Less the timer's resolution (a millisecond, rounded up), so that a lease given up by
        // the timer keeps the whole margin.
        by_counter.min(as_dead) - self.renew_interval / 2 - Duration::from_millis(1)
    }

    /// How long a renewal or a beat is waited for: past this its answer can no longer keep a
    /// lease (see [`Self::hold_until`]), so a request that may still be under way is let go.
    pub(super) fn attempt_limit(&self) -> Duration {
        self.lease_duration - self.renew_interval / 2
    }

    /// How long before a worker's silence runs out the table is scanned, so that the counters of
    /// its leases are known still for [`Self::dead_owner_stillness`] when it does, plus a beat
    /// interval for the scan itself; at most the silence less two beat intervals (a worker
    /// whose beats merely came late is not read for). `None` when nothing is left of it.
    fn suspicion_lead(&self) -> Option<Duration> {
        let lead = (self.dead_owner_stillness() + self.beat_interval)
            .min(self.silence().saturating_sub(self.beat_interval * 2));
        (!lead.is_zero()).then_some(lead)
    }

    /// How long a taker waits for a handoff the owner acknowledged (from when it saw the
    /// acknowledgement on the row) before it steals the lease: the owner's drain (the handoff
    /// timeout), its final checkpoint and pass (a renewal interval), and a scan.
    fn handoff_patience(&self) -> Duration {
        self.handoff_timeout + self.scan_interval + self.renew_interval
    }

    /// How long a taker waits for the owner to acknowledge its request (from the request)
    /// before it steals the lease: as long as it waited for the whole handoff before there were
    /// acknowledgements (an owner that renews sees the request with its next renewal and
    /// acknowledges at once; on a loaded host its answers may be seconds late). An owner that
    /// does not answer (paused, cut off) or never acknowledges (an older version) is waited for
    /// this long, then stolen from, as before.
    fn handoff_ack_patience(&self) -> Duration {
        self.handoff_patience()
    }

    /// How long a taker waits before it steals ([`Patience`]): the patiences above for an owner
    /// whose counter has not moved since (it does not answer); for one whose counter moves, as
    /// long as its writes may take too: it sees the request with a renewal sent within a renew
    /// interval and answered within the renewal attempt limit, and its acknowledgement lands
    /// within another (22 s at the defaults); after the acknowledgement, its drain (the handoff
    /// timeout), then its final checkpoint and pass within twice the attempt limit (23.7 s).
    /// A scan interval more for the taker to see it.
    pub(crate) fn patience(&self) -> Patience {
        let late = self.attempt_limit() * 2 + self.scan_interval;
        Patience {
            unacked: self.handoff_ack_patience(),
            unacked_renewing: self.renew_interval + late,
            after_ack: self.handoff_patience(),
            after_ack_renewing: self.handoff_timeout + late,
        }
    }

    /// Checks the settings, naming the first bad field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.lease_duration < Duration::from_millis(100) {
            return Err(ConfigError::new(
                "lease_duration",
                self.lease_duration,
                "must be at least 100ms",
            ));
        }
        if self.renew_interval.is_zero() || self.renew_interval * 2 > self.lease_duration {
            return Err(ConfigError::new(
                "renew_interval",
                self.renew_interval,
                format!(
                    "must be above zero and at most half of lease_duration ({:?}) so a lease is renewed at least twice before it can expire",
                    self.lease_duration
                ),
            ));
        }
        if self.beat_interval.is_zero() || self.beat_interval * 2 > self.lease_duration {
            return Err(ConfigError::new(
                "beat_interval",
                self.beat_interval,
                format!(
                    "must be above zero and at most half of lease_duration ({:?})",
                    self.lease_duration
                ),
            ));
        }
        if self.scan_interval.is_zero() {
            return Err(ConfigError::new(
                "scan_interval",
                self.scan_interval,
                "must be above zero",
            ));
        }
        if self.idle_scan_interval.is_some_and(|d| d.is_zero()) {
            return Err(ConfigError::new(
                "idle_scan_interval",
                self.idle_scan_interval.unwrap_or_default(),
                "must be above zero",
            ));
        }
        if self.shard_sync_interval.is_zero() {
            return Err(ConfigError::new(
                "shard_sync_interval",
                self.shard_sync_interval,
                "must be above zero",
            ));
        }
        if self.limits.imbalance < 2 {
            return Err(ConfigError::new(
                "imbalance",
                self.limits.imbalance,
                "must be at least 2, or workers would steal back and forth",
            ));
        }
        if self.limits.max_leases == 0 {
            return Err(ConfigError::new("max_leases", 0, "must be at least 1"));
        }
        Ok(())
    }
}

/// Lifecycle hooks, each with a no-op default. Called on the manager's tasks: keep them quick.
pub trait LeaseHooks: Send + Sync + 'static {
    /// This worker took a lease (free, expired or stolen).
    fn lease_taken(&self, _lease: &Lease) {}
    /// This worker lost a lease it held: its shard's work has been cancelled.
    fn lease_lost(&self, _ownership: &Ownership) {}
    /// A shard this worker held reached its end and was released.
    fn shard_ended(&self, _ownership: &Ownership) {}
}

impl LeaseHooks for () {}

/// A lease this worker now holds.
#[derive(Debug, Clone)]
pub struct HeldLease {
    /// The proof every fenced write carries.
    pub ownership: Ownership,
    /// The row as taken (checkpoint, lineage).
    pub lease: Lease,
    /// The `retiredAt` of the row as seen before the take, when the take woke a retired
    /// partition ([`LeaseStore::retire`]): its progress was written with every delivery settled
    /// and nothing handed out after the last audit's mark, so reading on from it hands nothing
    /// out again.
    pub woken_from: Option<i64>,
    /// Cancelled the moment the lease is lost or given up: the shard's work must stop handing
    /// anything out. It may still write what settled, once, with the fenced writes (refused if
    /// the row moved), then report with [`LeaseManager::work_ended`].
    pub cancel: CancellationToken,
    /// Cancelled when another worker asked for the lease (cooperative handoff): stop reading,
    /// let in-flight deliveries settle within the handoff timeout, write the final checkpoint and
    /// end the shard's work as stopped; the release then passes the lease to the taker.
    pub handoff: CancellationToken,
    /// How long the lease is held, asked before each call of the handler: on a starved or
    /// frozen process `cancel` comes late, the hold does not ([`Hold::held`]).
    pub hold: Hold,
}

/// What the manager tells the consumer.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum LeaseEvent {
    /// Start reading this shard from its checkpoint.
    Acquired(Box<HeldLease>),
    /// Stop reading this shard: its token is already cancelled. What settled before may be
    /// written once (fenced: refused if the row moved); this worker takes the lease again only
    /// after [`LeaseManager::work_ended`] (or a lease duration).
    Lost(Ownership),
    /// Stop the consumer: this manager holds and takes no lease any more, for this reason
    /// ([`Error::WorkerIdInUse`]: another process under this worker id came first).
    Stop(Arc<Error>),
}

/// What the lease task is asked to do besides renewing: every write to a row this worker holds
/// (renew, acknowledge, pass, release) is made by that one task.
enum Command {
    /// Give a held lease back, its work having ended: pass it to the worker that asked for it
    /// when `may_pass` (and the row is not at SHARD_END), else release it. The answer: `false`
    /// when the lease was lost already.
    GiveBack {
        ownership: Ownership,
        may_pass: bool,
        /// Retire the row instead (`retiredAt` = this time): an idle paged partition.
        retire: Option<i64>,
        reply: oneshot::Sender<Result<bool, Error>>,
    },
    /// Stamp the row of a held lease with the acknowledgement of `to`'s request.
    Acknowledge { ownership: Ownership, to: String },
}

/// The most renewals of one lease under way at once: a second covers a request lost on the way,
/// while a slow store is not sent more than twice the writes it was.
const RENEWALS_UNDER_WAY: usize = 2;

/// The most leases a scan takes at once.
const TAKES_AT_ONCE: usize = 16;

/// The most lease rows a shard sync creates at once.
const CREATES_AT_ONCE: usize = 16;

/// The longest a worker waits before taking again a lease whose work keeps failing here.
pub const FAILED_LEASE_MAX_WAIT: Duration = Duration::from_secs(300);

/// A lease whose work failed on this worker: the waits between its attempts, and when the
/// current one is over.
struct Failing {
    waits: Backoff,
    until: Instant,
}

struct Observation {
    counter: u64,
    owner: Option<String>,
    since: Instant,
}

/// What a scan observed ([`Inner::observe`]).
struct Observed {
    /// Each row, in order: (expired, neglected), as the planner's [`Seen`] takes them.
    judged: Vec<(bool, bool)>,
    /// A lease of a worker dead by the roster whose counter has not been seen still long enough
    /// yet: scan again soon, to see whether it moves.
    judging: bool,
    /// A lease this worker held was found taken.
    lost_some: bool,
}

struct Inner {
    store: Arc<dyn LeaseStore>,
    shards: Arc<dyn ShardLister>,
    stream: String,
    worker: String,
    settings: LeaseSettings,
    hooks: Arc<dyn LeaseHooks>,
    /// Every lease this worker holds, gives back, lost or waits for, in one explicit state each
    /// (`local`): changed only by that module's transitions.
    leases: Mutex<Leases>,
    /// To the lease task (`lease_loop`).
    commands: mpsc::UnboundedSender<Command>,
    observed: Mutex<BTreeMap<String, Observation>>,
    events: mpsc::UnboundedSender<LeaseEvent>,
    sync_now: Notify,
    taking: CancellationToken,
    frontier: watch::Sender<Frontier>,
    /// The frontier membership as last read or published (see `publish_frontier`).
    membership: Mutex<Option<frontier::Membership>>,
    /// The source's last listing (its shards, or a paged source's partitions), and when it was
    /// taken: the frontier withholds its scalar while a listed id has no row.
    listing: Mutex<Option<(frontier::Listing, Instant)>>,
    membership_scans: AtomicU64,
    /// Leases whose work failed here, by shard: not taken again by this worker until `until`.
    failing: Mutex<HashMap<String, Failing>>,
    /// This worker's beat and its view of the roster.
    liveness: Liveness,
    /// Wakes the taker for a scan now (a lease lost, a shard ended, rows created).
    scan_now: Notify,
    /// Wakes the lease task to look at the holds again: a lease was taken.
    held_changed: Notify,
    /// The rows of the last scan, which the shard sync compares the stream against.
    last_rows: Mutex<Option<Vec<Lease>>>,
}

/// Runs the lease protocol for one worker on one stream. Background tasks stop on
/// [`shutdown`](Self::shutdown) or when the manager is dropped.
#[must_use = "the manager stops when dropped"]
pub struct LeaseManager {
    inner: Arc<Inner>,
    renewing: CancellationToken,
    tasks: TaskTracker,
}

impl fmt::Debug for LeaseManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseManager")
            .field("stream", &self.inner.stream)
            .field("worker", &self.inner.worker)
            .field("held", &self.inner.leases().holding().count())
            .finish()
    }
}

impl Drop for LeaseManager {
    fn drop(&mut self) {
        self.inner.taking.cancel();
        self.renewing.cancel();
    }
}

impl LeaseManager {
    /// Prepares the lease table, syncs the shard list once, and starts renewing, scanning and
    /// syncing. Fails at once if the table has the wrong schema or the stream does not exist.
    pub async fn start(
        store: Arc<dyn LeaseStore>,
        shards: Arc<dyn ShardLister>,
        stream: impl Into<String>,
        worker: impl Into<String>,
        settings: LeaseSettings,
        hooks: Arc<dyn LeaseHooks>,
    ) -> Result<(Self, mpsc::UnboundedReceiver<LeaseEvent>), Error> {
        settings.validate()?;
        let (events, rx) = mpsc::unbounded_channel();
        let (commands, commands_rx) = mpsc::unbounded_channel();
        let worker: String = worker.into();
        let stream: String = stream.into();
        let liveness = Liveness::new(
            Arc::clone(&store),
            stream.clone(),
            worker.clone(),
            settings.clone(),
        );
        let inner = Arc::new(Inner {
            store,
            shards,
            stream,
            worker,
            settings,
            hooks,
            leases: Mutex::new(Leases::default()),
            commands,
            observed: Mutex::new(BTreeMap::new()),
            events,
            sync_now: Notify::new(),
            taking: CancellationToken::new(),
            frontier: watch::Sender::new(Frontier::default()),
            membership: Mutex::new(None),
            listing: Mutex::new(None),
            membership_scans: AtomicU64::new(0),
            failing: Mutex::new(HashMap::new()),
            liveness,
            scan_now: Notify::new(),
            held_changed: Notify::new(),
            last_rows: Mutex::new(None),
        });
        // The stream first: a missing stream must not leave a new lease table behind.
        let listed = inner.shards.list_shards(&inner.stream).await?;
        inner.listed(&listed);
        inner.store.prepare().await?;
        // How many sections the roster has, so that the first beat goes to this worker's own
        // (and finds there what a process under this id wrote before). Unread, it is 1: the
        // first beat goes to section 0 and the worker moves at the next.
        match tokio::time::timeout(
            inner.settings.attempt_limit(),
            inner.store.read_roster(&inner.stream, &[0]),
        )
        .await
        {
            Ok(Ok(read)) => {
                if let Some(first) = read.into_iter().next() {
                    inner.liveness.sections().record(0, first);
                }
            }
            Ok(Err(e)) => {
                debug!(stream = %inner.stream, error = &e as &dyn std::error::Error, "reading the roster's section 0 at start failed")
            }
            Err(_) => {
                debug!(stream = %inner.stream, "reading the roster's section 0 at start timed out")
            }
        }
        // Beat first, so workers starting together see each other before they plan. A worker
        // alone, or the roster's founder, syncs the shard list now; one that found others lets
        // them create the rows and syncs what is still missing one scan interval later.
        inner.beat().await;
        if let Twin::Before { tag: other, .. } = inner.liveness.twin() {
            // The entry holds another process's beat: this id ran before (a restart), or runs
            // now in a second process. A beat interval later, a running one has beaten again.
            info!(stream = %inner.stream, worker = %inner.worker, other, "this worker id's roster entry holds another process's beat (a restart, or a second process under this id): beating once more before taking any lease");
            tokio::time::sleep(inner.settings.beat_interval).await;
            inner.beat().await;
        }
        if let Twin::Running { newer: false, .. } = inner.liveness.twin() {
            return Err(Error::WorkerIdInUse {
                stream: inner.stream.clone(),
                worker: inner.worker.clone(),
            });
        }
        let alone = inner.liveness.roster().syncs_at_start();
        if alone {
            inner.sync_shards(true).await?;
        }

        let renewing = CancellationToken::new();
        let tasks = TaskTracker::new();
        tasks.spawn(crate::time::carry(
            Arc::clone(&inner).lease_loop(renewing.clone(), commands_rx),
        ));
        tasks.spawn(crate::time::carry(
            Arc::clone(&inner).beat_loop(renewing.clone()),
        ));
        tasks.spawn(crate::time::carry(Arc::clone(&inner).take_loop()));
        tasks.spawn(crate::time::carry(Arc::clone(&inner).sync_loop(!alone)));
        tasks.close();
        info!(stream = %inner.stream, worker = %inner.worker, "lease manager started");
        Ok((
            Self {
                inner,
                renewing,
                tasks,
            },
            rx,
        ))
    }

    /// This worker's id.
    pub fn worker(&self) -> &str {
        &self.inner.worker
    }

    /// A view of the held leases and their renewals, for health checks.
    pub fn probe(&self) -> LeaseProbe {
        LeaseProbe(Arc::clone(&self.inner))
    }

    /// The leases held now.
    pub fn held(&self) -> Vec<Ownership> {
        self.inner.held()
    }

    /// The stream frontier, recomputed from the lease table on every scan. While any receiver
    /// it returned is alive, the manager scans every `scan_interval`, so that the frontier stays
    /// fresh; with none, a balanced worker scans only every idle scan interval.
    pub fn frontier(&self) -> watch::Receiver<Frontier> {
        self.inner.frontier.subscribe()
    }

    /// Lists the stream's shards and creates rows for new ones soon (after a shard ended).
    pub fn sync_soon(&self) {
        self.inner.sync_now.notify_one();
    }

    /// Stops taking new leases (held ones keep being renewed). Used first in a graceful shutdown,
    /// while lanes drain and final checkpoints are written.
    pub fn stop_taking(&self) {
        self.inner.taking.cancel();
    }

    /// Gives one held lease back (after its shard ended, or on shutdown). `false` if it had been
    /// lost already. Cancellation safe: if dropped before the release reached the store, the lease
    /// simply expires.
    pub async fn release(&self, ownership: &Ownership) -> Result<bool, Error> {
        self.inner.release(ownership).await
    }

    /// Gives back a lease whose work failed (a refused cursor, a partition that is gone, a bug),
    /// and keeps this worker from taking it again for a while: 100 ms after a first failure,
    /// doubling with jitter up to [`FAILED_LEASE_MAX_WAIT`] while its work keeps failing. Another
    /// worker may take it meanwhile. Without the wait a failure that repeats (a cursor refused
    /// for good) would be a loop of take, fail and release with no pause, writing the lease
    /// table and calling the source as fast as they answer.
    pub async fn release_failed(&self, ownership: &Ownership) -> Result<bool, Error> {
        let now = Instant::now();
        let wait = {
            let mut failing = self.inner.failing();
            let entry = failing
                .entry(ownership.shard_id.clone())
                .or_insert_with(|| Failing {
                    waits: Backoff::new(FAILED_LEASE_MAX_WAIT),
                    until: now,
                });
            // A lease that worked for a while since its last failure starts again from the shortest wait.
            if now >= entry.until + FAILED_LEASE_MAX_WAIT {
                entry.waits.reset();
            }
            let wait = entry.waits.next();
            entry.until = now + wait;
            wait
        };
        metrics::counter!("shardwise_lease_failures_total", &self.inner.labels()).increment(1);
        warn!(stream = %self.inner.stream, shard = %ownership.shard_id, ?wait, "work on the lease failed; releasing it and not taking it again before the wait is over");
        self.inner.release(ownership).await
    }

    /// The work of a lease this worker lost or gave up ([`LeaseEvent::Lost`]) has ended: its
    /// final writes are made or refused, so this worker may take the lease again (a row still
    /// naming it, after renewals answered too late, is taken back at the next scan, from the
    /// checkpoint those writes left). Without this call the lease is left alone for a lease
    /// duration after it was given up.
    pub fn work_ended(&self, ownership: &Ownership) {
        let ended = self.inner.leases().work_ended(ownership);
        if ended {
            self.inner.scan_now.notify_one();
        }
    }

    /// Records that a held shard reached SHARD_END: releases the lease, runs the hook and syncs
    /// the shard list so its children get rows (announced to every worker by the next beat).
    pub async fn shard_ended(&self, ownership: &Ownership) -> Result<(), Error> {
        self.inner.give_back(ownership, false).await?;
        self.inner.hooks.shard_ended(ownership);
        self.inner.sync_now.notify_one();
        self.inner.changed_here();
        Ok(())
    }

    /// Records that a held partition ended because it is gone from its source (a deleted log
    /// stream): releases the lease at SHARD_END, then deletes its row, conditioned on it being
    /// unchanged since (at SHARD_END, the counter read). A partition created again under the same
    /// name then gets a new row at the next sync and is read from its start. A row left behind
    /// (this worker stopped between the two writes, or one failed) is deleted by a later scan
    /// ([`Contract::names_reused`](crate::paged::Contract)).
    pub async fn partition_gone(&self, ownership: &Ownership) -> Result<(), Error> {
        // Not `shard_ended`: a gone partition has no children to find, so no sync is asked for
        // at once (deleting a thousand streams would list the group a thousand times); a name
        // listed again gets its row at the next periodic sync.
        self.inner.unlisted(&ownership.shard_id);
        self.inner.give_back(ownership, false).await?;
        self.inner.hooks.shard_ended(ownership);
        self.inner.changed_here();
        self.inner.failing().remove(&ownership.shard_id);
        let Some(row) = self
            .inner
            .store
            .get(&ownership.stream, &ownership.shard_id)
            .await?
        else {
            return Ok(());
        };
        if row.owner.is_none() && self.inner.store.delete(&row).await? {
            info!(stream = %self.inner.stream, shard = %ownership.shard_id, "lease row of a partition that is gone deleted");
            self.inner.changed_here();
        }
        Ok(())
    }

    /// Retires a held paged partition that went idle, its final progress written: nobody renews
    /// or reads it until the source lists activity after `at` (its ingestion time through which
    /// everything was read), when a scan finds it woken and a worker takes it
    /// ([`LeaseStore::retire`]). `false` if the lease had been lost already.
    pub async fn retire(&self, ownership: &Ownership, at: i64) -> Result<bool, Error> {
        self.inner.give_back_as(ownership, false, Some(at)).await
    }

    /// Stops taking, releases every held lease (call after final checkpoints), leaves the roster
    /// so the other workers rebalance at once, then stops renewing. Returns how many leases were
    /// handed back.
    pub async fn shutdown(self) -> usize {
        self.inner.taking.cancel();
        let held = self.held();
        let released = join_all(held.iter().map(|o| self.inner.release(o))).await;
        if matches!(
            self.inner.liveness.twin(),
            Twin::Running { newer: false, .. }
        ) {
            // Gave way to a process under the same id: the rows and the roster entry that name
            // the id are that process's.
            self.renewing.cancel();
            self.tasks.wait().await;
            return 0;
        }
        // Rows that name this worker without its holding them (passed to it, not taken yet): no
        // one else would take them before their counters went still for a lease duration.
        match self.inner.store.list(&self.inner.stream).await {
            Ok(rows) => {
                let named: Vec<Ownership> = rows
                    .iter()
                    .filter(|r| r.owner.as_deref() == Some(self.inner.worker.as_str()))
                    .filter_map(Lease::ownership)
                    .collect();
                for ownership in &named {
                    match self.inner.store.release(ownership).await {
                        Ok(true) => {
                            info!(stream = %self.inner.stream, shard = %ownership.shard_id, "a lease passed to this worker and not taken is released at shutdown")
                        }
                        Ok(false) => {}
                        Err(e) => {
                            warn!(stream = %self.inner.stream, shard = %ownership.shard_id, error = &e as &dyn std::error::Error, "releasing a lease passed to this worker failed; it will expire")
                        }
                    }
                }
            }
            Err(e) => {
                warn!(stream = %self.inner.stream, error = &e as &dyn std::error::Error, "reading the lease table at shutdown failed; leases passed to this worker and not taken will expire")
            }
        }
        self.renewing.cancel();
        self.tasks.wait().await;
        // Last, once no beat can follow: leaving is a change of the roster, so the others scan
        // at their next beat and share out the released leases.
        let (section, left) = {
            let s = self.inner.liveness.sections();
            (s.mine(), s.left())
        };
        if let Some((old, beat)) = left {
            let _ = self
                .inner
                .store
                .forget(&self.inner.stream, old, &self.inner.worker, Some(beat))
                .await;
        }
        if let Err(e) = self
            .inner
            .store
            .forget(&self.inner.stream, section, &self.inner.worker, None)
            .await
        {
            warn!(stream = %self.inner.stream, error = &e as &dyn std::error::Error, "leaving the roster failed; the others judge this worker gone once its beat stops");
        }
        released
            .into_iter()
            .filter(|r| matches!(r, Ok(true)))
            .count()
    }
}

/// A view of a lease manager's state, for health checks and the frontier. Holding it keeps no
/// task running: the manager's tasks stop with the manager.
#[derive(Clone)]
pub struct LeaseProbe(Arc<Inner>);

impl fmt::Debug for LeaseProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseProbe")
            .field("worker", &self.0.worker)
            .finish_non_exhaustive()
    }
}

impl LeaseProbe {
    /// Leases held now.
    pub fn held(&self) -> usize {
        self.0.leases().holding().count()
    }

    /// The stream frontier (see [`LeaseManager::frontier`]).
    pub fn frontier(&self) -> watch::Receiver<Frontier> {
        self.0.frontier.subscribe()
    }

    /// Whether this process gave way to another that beats under the same worker id and came
    /// before it: it holds and takes no lease (see [`Error::WorkerIdInUse`]).
    pub fn gave_way(&self) -> bool {
        matches!(self.0.liveness.twin(), Twin::Running { newer: false, .. })
    }

    /// Since this worker's last beat that landed was sent: how long the lease table has not
    /// answered this worker (beats go out every renew interval, held leases or not).
    pub fn since_beat(&self) -> Duration {
        self.0.liveness.last_beat().elapsed()
    }

    /// Since the held lease renewed longest ago was last renewed (`None`: none held).
    pub fn oldest_renewal(&self) -> Option<Duration> {
        self.0
            .leases()
            .holding()
            .map(|h| h.last_renewed().elapsed())
            .max()
    }
}

impl Inner {
    fn leases(&self) -> MutexGuard<'_, Leases> {
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The leases held now.
    fn held(&self) -> Vec<Ownership> {
        self.leases()
            .holding()
            .map(|h| h.ownership.clone())
            .collect()
    }

    fn failing(&self) -> MutexGuard<'_, HashMap<String, Failing>> {
        self.failing.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether this worker waits before taking `shard` again (its work failed here).
    fn cooling(&self, shard: &str, now: Instant) -> bool {
        self.failing().get(shard).is_some_and(|f| now < f.until)
    }

    /// The last listing of the source and when it was taken.
    fn listing(&self) -> Option<(frontier::Listing, Instant)> {
        self.listing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records a listing of the source, taken just now.
    fn listed(&self, shards: &[ShardInfo]) {
        let listing = frontier::Listing {
            ids: shards.iter().map(|s| s.shard_id.clone()).collect(),
            at: crate::time::millis(crate::time::now()),
        };
        *self.listing.lock().unwrap_or_else(|e| e.into_inner()) = Some((listing, Instant::now()));
    }

    /// The source no longer lists `shard_id` (a partition found gone): the last listing would
    /// otherwise count it among those listed without a row, and ask for a sync.
    fn unlisted(&self, shard_id: &str) {
        if let Some((listing, _)) = self
            .listing
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            listing.ids.remove(shard_id);
        }
    }

    /// Something every worker should scan for happened here (rows created, a lease freed or
    /// lost): the next beat, sent now, announces it, and this worker scans too.
    fn changed_here(&self) {
        self.liveness.announce();
        self.scan_now.notify_one();
    }

    /// How long a balanced worker waits between scans when nothing moves: the idle scan
    /// interval, 20 % either way at random, so workers that scanned together after a change
    /// spread out again.
    fn idle_scan_interval(&self) -> Duration {
        let base = self.settings.idle_scan_interval.unwrap_or_else(|| {
            let workers = self.liveness.roster().live(Instant::now()).len();
            self.settings.lease_duration * u32::try_from(workers).unwrap_or(u32::MAX)
        });
        base.mul_f64(0.8 + 0.4 * crate::backoff::fraction())
    }

    /// Beats ([`Liveness::beat`]); `true` when the roster changed. A process that finds it
    /// came after another under its worker id gives way: it gives up every lease (without a
    /// write: the rows name the id both share), takes none, and tells the consumer to stop.
    async fn beat(&self) -> bool {
        let beat = self.liveness.beat().await;
        if beat.gave_way {
            self.taking.cancel();
            for ownership in self.held() {
                self.lose(&ownership, "a second process beats under this worker id");
            }
            let _ = self
                .events
                .send(LeaseEvent::Stop(Arc::new(Error::WorkerIdInUse {
                    stream: self.stream.clone(),
                    worker: self.worker.clone(),
                })));
        }
        beat.changed
    }

    async fn beat_loop(self: Arc<Self>, stop: CancellationToken) {
        let mut tick = tokio::time::interval(self.settings.beat_interval);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        // The first beat was written at start.
        tick.tick().await;
        let lead = self.settings.suspicion_lead();
        loop {
            // A worker's silence running out is acted on at that moment, not at the next beat.
            // A lead before it the table is scanned, so that its counters are known by then: its
            // leases count as expired once they have also been seen still long enough.
            let now = Instant::now();
            let (death, suspicion) = {
                let roster = self.liveness.roster();
                let suspicion = lead.and_then(|lead| Some(roster.next_death(now + lead)? - lead));
                (roster.next_death(now), suspicion)
            };
            tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
                _ = self.liveness.beat_now.notified() => {}
                _ = async { tokio::time::sleep_until(death.expect("a death")).await }, if death.is_some() => {
                    if self.liveness.roster().recheck(Instant::now()) {
                        self.scan_now.notify_one();
                    }
                    continue;
                }
                _ = async { tokio::time::sleep_until(suspicion.expect("a suspicion")).await }, if suspicion.is_some() => {
                    debug!(stream = %self.stream, "a worker's beat has not moved for a while: reading the lease counters before its silence runs out");
                    self.scan_now.notify_one();
                    continue;
                }
            }
            // A stopped manager's beat under way is dropped, not left to land later: after a
            // restart it would read as a second process under this id.
            let changed = tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                changed = self.beat() => changed,
            };
            if changed {
                self.scan_now.notify_one();
            }
            if let Twin::Running { newer: false, .. } = self.liveness.twin() {
                // This process gave way to one that came before it under the same id: its beats
                // would only keep reporting the clash there.
                return;
            }
        }
    }

    /// Sets `shardwise_leases_held` to the leases held now (set, not counted up and down, so an
    /// exporter that drops idle series never makes it wrong; the renewer sets it every round).
    fn held_gauge(&self) {
        let held = self.leases().holding().count();
        metrics::gauge!("shardwise_leases_held", &self.labels()).set(held as f64);
    }

    fn labels(&self) -> [(&'static str, String); 2] {
        [
            ("stream", self.stream.clone()),
            ("worker", self.worker.clone()),
        ]
    }

    /// The lease task: the one task that writes the rows this worker holds. It renews every held
    /// lease each `renew_interval`, and gives each up the moment its
    /// [`LeaseSettings::hold_until`] passes without a renewal that landed; it acknowledges
    /// handoff requests and makes the pass or release of every lease given back ([`Command`]),
    /// each off the loop so that one slow write holds up no renewal. A renewal is stamped with
    /// when it was sent, not answered (the others see its counter move no earlier than it was
    /// applied, which is after it was sent: issue 27, defect 6), and waited for as long as its
    /// answer can still count ([`LeaseSettings::attempt_limit`]): a slow store costs attempts
    /// that last longer, not leases. At most [`RENEWALS_UNDER_WAY`] renewals of one lease are
    /// under way at once; a round skips a lease that has that many.
    async fn lease_loop(
        self: Arc<Self>,
        stop: CancellationToken,
        mut commands: mpsc::UnboundedReceiver<Command>,
    ) {
        let mut tick = tokio::time::interval(self.settings.renew_interval);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let attempt = self.settings.attempt_limit();
        let mut pending = FuturesUnordered::new();
        let mut writes: FuturesUnordered<futures::future::BoxFuture<'static, ()>> =
            FuturesUnordered::new();
        let mut under_way: BTreeMap<(String, u64), usize> = BTreeMap::new();
        loop {
            let deadline = self.next_hold_deadline();
            tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                Some((ownership, sent, result)) = pending.next() => {
                    let ownership: Ownership = ownership;
                    let key = (ownership.shard_id.clone(), ownership.epoch);
                    if let Some(n) = under_way.get_mut(&key) {
                        *n -= 1;
                        if *n == 0 {
                            under_way.remove(&key);
                        }
                    }
                    self.renewed(&ownership, sent, result);
                }
                Some(command) = commands.recv() => match command {
                    Command::GiveBack { ownership, may_pass, retire, reply } => {
                        let may_pass = may_pass && retire.is_none();
                        let Some(give) = self.leases().give(&ownership, may_pass) else {
                            let _ = reply.send(Ok(false));
                            continue;
                        };
                        self.held_gauge();
                        let inner = Arc::clone(&self);
                        writes.push(Box::pin(crate::time::carry(async move {
                            let answer = match retire {
                                Some(at) => inner.retire_row(&ownership, at).await,
                                None => inner.hand_back(&ownership, give, may_pass).await,
                            };
                            inner.leases().given(&ownership);
                            let _ = reply.send(answer);
                        })));
                    }
                    Command::Acknowledge { ownership, to } => {
                        let inner = Arc::clone(&self);
                        writes.push(Box::pin(crate::time::carry(async move {
                            inner.acknowledge(&ownership, &to).await;
                        })));
                    }
                },
                Some(()) = writes.next() => {}
                _ = async { tokio::time::sleep_until(deadline.expect("a deadline")).await }, if deadline.is_some() => {
                    self.give_up_overdue();
                }
                _ = self.held_changed.notified() => {}
                _ = tick.tick() => {
                    self.give_up_overdue();
                    self.held_gauge();
                    for ownership in self.held() {
                        let n = under_way
                            .entry((ownership.shard_id.clone(), ownership.epoch))
                            .or_default();
                        if *n >= RENEWALS_UNDER_WAY {
                            continue;
                        }
                        *n += 1;
                        let this = Arc::clone(&self);
                        let sent = Instant::now();
                        pending.push(async move {
                            let result = tokio::time::timeout(attempt, this.store.renew(&ownership)).await;
                            (ownership, sent, result)
                        });
                    }
                }
            }
        }
    }

    /// The earliest instant a held lease must be given up at, unless a renewal lands first.
    fn next_hold_deadline(&self) -> Option<Instant> {
        let beat = self.liveness.last_beat();
        self.leases()
            .holding()
            .map(|h| self.settings.hold_until(h.last_renewed(), beat))
            .min()
    }

    /// Gives up every held lease whose [`LeaseSettings::hold_until`] has passed, saying how old
    /// the last renewal and the last beat that landed were.
    fn give_up_overdue(&self) {
        let now = Instant::now();
        let beat = self.liveness.last_beat();
        let overdue: Vec<(Ownership, Instant)> = self
            .leases()
            .holding()
            .filter(|h| self.settings.hold_until(h.last_renewed(), beat) <= now)
            .map(|h| (h.ownership.clone(), h.last_renewed()))
            .collect();
        for (ownership, renewed) in &overdue {
            self.lose(
                ownership,
                &format!(
                    "not renewed in time (the last renewal that landed was sent {:?} ago, the last beat {:?} ago): others may soon see it expired",
                    now - *renewed,
                    now - beat
                ),
            );
        }
    }

    /// A renewal of `ownership` sent at `sent` was answered (or waited for as long as it could
    /// count). A request it carried that this worker had not seen starts the handoff.
    fn renewed(
        &self,
        ownership: &Ownership,
        sent: Instant,
        result: Result<Result<Renewal, Error>, tokio::time::error::Elapsed>,
    ) {
        match result {
            Ok(Ok(Renewal::Renewed { wanted_by })) => {
                let effect =
                    self.leases()
                        .renewed(ownership, sent, wanted_by.as_deref(), Instant::now());
                self.carry_out(effect, "");
            }
            Ok(Ok(Renewal::Lost)) => {
                self.lose(ownership, "renewal refused: another worker holds it")
            }
            // Not lost by itself: the next round tries again, and the lease is given up only
            // when its hold runs out.
            Ok(Err(e)) => {
                warn!(stream = %self.stream, shard = %ownership.shard_id, error = &e as &dyn std::error::Error, "lease renewal failed")
            }
            Err(_) => {
                warn!(stream = %self.stream, shard = %ownership.shard_id, waited = ?self.settings.attempt_limit(), "lease renewal not answered in time")
            }
        }
    }

    /// Carries out what a transition of [`Leases`] asked for; `why` a lease was lost.
    fn carry_out(&self, effects: impl IntoIterator<Item = Effect>, why: &str) {
        for effect in effects {
            match effect {
                Effect::HandingOff { ownership, to } => {
                    info!(stream = %self.stream, shard = %ownership.shard_id, to = %to, "handoff asked for: the shard stops reading, settles and hands over");
                    let _ = self.commands.send(Command::Acknowledge { ownership, to });
                }
                Effect::Acknowledge { ownership, to } => {
                    let _ = self.commands.send(Command::Acknowledge { ownership, to });
                }
                Effect::Lost { ownership } => {
                    warn!(stream = %self.stream, shard = %ownership.shard_id, epoch = ownership.epoch, "lease lost: {why}");
                    metrics::counter!("shardwise_leases_lost_total", &self.labels()).increment(1);
                    self.held_gauge();
                    self.hooks.lease_lost(&ownership);
                    let _ = self.events.send(LeaseEvent::Lost(ownership));
                    // The row may be free now (a seek) or still name this worker (given up
                    // locally).
                    self.changed_here();
                }
            }
        }
    }

    /// Stamps the row of a held lease with the acknowledgement of `taker`'s request, so the
    /// taker counts its patience from now (issue 27, defect 5). A failed write is tried again by
    /// the next scan that sees the request unacknowledged.
    async fn acknowledge(&self, ownership: &Ownership, taker: &str) {
        match self.store.acknowledge(ownership, taker).await {
            Ok(true) => {
                debug!(shard = %ownership.shard_id, to = %taker, "handoff request acknowledged")
            }
            Ok(false) => {
                debug!(shard = %ownership.shard_id, to = %taker, "the handoff request changed before it was acknowledged")
            }
            Err(e) => {
                debug!(shard = %ownership.shard_id, error = &e as &dyn std::error::Error, "acknowledging a handoff request failed")
            }
        }
    }

    /// Gives up a lease this worker held under `ownership` (no-op for another epoch) and cancels
    /// its work. Its work may write what settled before it stops (fenced); the lease is not
    /// taken back here before it has (see [`LeaseManager::work_ended`]).
    fn lose(&self, ownership: &Ownership, why: &str) {
        let effect = self
            .leases()
            .lose(ownership, Instant::now(), self.settings.lease_duration);
        self.carry_out(effect, why);
    }

    /// Gives a held lease back: to the worker that asked for it when one did (a pass), else
    /// into the table (a release).
    async fn release(&self, ownership: &Ownership) -> Result<bool, Error> {
        self.give_back(ownership, true).await
    }

    /// Gives a held lease back through the lease task; passes it to a worker that asked for it
    /// only when `may_pass` and the row is not at SHARD_END. `false` when it was lost already,
    /// or the manager stopped (the lease then expires).
    async fn give_back(&self, ownership: &Ownership, may_pass: bool) -> Result<bool, Error> {
        self.give_back_as(ownership, may_pass, None).await
    }

    /// [`give_back`](Self::give_back), retiring the row when `retire` says when.
    async fn give_back_as(
        &self,
        ownership: &Ownership,
        may_pass: bool,
        retire: Option<i64>,
    ) -> Result<bool, Error> {
        let (reply, answer) = oneshot::channel();
        let command = Command::GiveBack {
            ownership: ownership.clone(),
            may_pass,
            retire,
            reply,
        };
        if self.commands.send(command).is_err() {
            return Ok(false);
        }
        answer.await.unwrap_or(Ok(false))
    }

    /// The retirement of a lease given back (its state is `Giving`): nobody takes the row until
    /// the source lists activity after `at`.
    async fn retire_row(&self, ownership: &Ownership, at: i64) -> Result<bool, Error> {
        let retired = self.store.retire(ownership, at).await?;
        if retired {
            info!(stream = %self.stream, shard = %ownership.shard_id, retired_at = at, "idle partition retired: nobody renews or reads it until its source lists activity after this time");
            metrics::counter!("shardwise_paged_partitions_retired_total", &self.labels())
                .increment(1);
        } else {
            debug!(stream = %self.stream, shard = %ownership.shard_id, "retiring the lease was refused: it was lost");
        }
        Ok(retired)
    }

    /// The pass or release of a lease given back (its state is `Giving`): an ended row is never
    /// passed (a taker never takes an ended row, and one left owned is never cleaned up).
    async fn hand_back(
        &self,
        ownership: &Ownership,
        give: super::local::Give,
        may_pass: bool,
    ) -> Result<bool, Error> {
        // A request may have come since the last scan: the row tells.
        let wanted = match give.to {
            _ if !may_pass => None,
            Some(taker) => Some(taker),
            None => self
                .store
                .get(&ownership.stream, &ownership.shard_id)
                .await
                .ok()
                .flatten()
                .filter(|row| {
                    row.ownership().as_ref() == Some(ownership) && !row.checkpoint.is_shard_end()
                })
                .and_then(|row| row.wanted_by),
        };
        if let Some(taker) = wanted {
            // Passed only to a taker alive by the roster: a row passed to a worker that is gone
            // (scaled in, killed) would wait for the others to judge it by its counter alone.
            if !self.liveness.roster().live(Instant::now()).contains(&taker) {
                info!(stream = %self.stream, shard = %ownership.shard_id, to = %taker, "the worker that asked for the lease is not alive by the roster: releasing it instead of handing it over");
            } else if self.store.pass(ownership, &taker).await? {
                let after = give.asked_since.map(|since| since.elapsed());
                info!(stream = %self.stream, shard = %ownership.shard_id, to = %taker, ?after, "lease handed over");
                metrics::counter!("shardwise_handoffs_total", &self.labels()).increment(1);
                if !self.taking.is_cancelled() {
                    // Announced: the taker scans now, and so does every worker, which sees
                    // the row move. (At shutdown, leaving the roster says so.)
                    self.changed_here();
                }
                return Ok(true);
            } else {
                debug!(shard = %ownership.shard_id, to = %taker, "the handoff request is gone; releasing");
            }
        }
        let released = self.store.release(ownership).await?;
        debug!(shard = %ownership.shard_id, released, "lease released");
        if released && !self.taking.is_cancelled() {
            // A free lease: every worker scans to share it out. (At shutdown, leaving the roster
            // says so.)
            self.changed_here();
        }
        Ok(released)
    }

    /// Scans every `scan_interval` while something moves, else every idle scan interval, and
    /// at once when a beat saw the roster change or something happened here.
    async fn take_loop(self: Arc<Self>) {
        // The roster as of now, not as of start: workers that started since count.
        self.beat().await;
        loop {
            let settling = match self.scan_table().await {
                Ok(settling) => settling,
                Err(e) => {
                    warn!(stream = %self.stream, error = &e as &dyn std::error::Error, "lease scan failed");
                    true
                }
            };
            // Someone watches the frontier: keep it as fresh as the scan interval.
            let watched = self.frontier.receiver_count() > 0;
            let pause = if settling || watched {
                self.settings.scan_interval
            } else {
                self.idle_scan_interval()
            };
            tokio::select! {
                biased;
                _ = self.taking.cancelled() => return,
                _ = tokio::time::sleep(pause) => {}
                _ = self.scan_now.notified() => {}
            }
        }
    }

    /// The frontier over `rows` under the published membership and the last listing of the
    /// source, publishing a first membership or a proven change (compare-and-swap on its epoch).
    /// When another worker publishes first, the membership is read again; if it still differs, the
    /// scalar is withheld until a later scan.
    ///
    /// The membership read is cached: the store is read again only when the computed members
    /// differ from the cached ones, and every 30th scan (another worker may have published
    /// changes that came back to the same members), so a steady table costs no extra request.
    async fn publish_frontier(&self, rows: &[Lease]) -> Result<Frontier, Error> {
        let coordinates: Vec<_> = rows.iter().map(Lease::coordinate).collect();
        let listing = self.listing().map(|(listing, _)| listing);
        let listing = listing.as_ref();
        let scans = self
            .membership_scans
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let cached = self
            .membership
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(cached) = cached.filter(|_| !scans.is_multiple_of(30)) {
            let latest = frontier::compute(&coordinates, Some(&cached), listing);
            if latest.publish.is_none() && latest.unproven.is_empty() {
                return Ok(latest);
            }
        }
        for _ in 0..2 {
            let published = self.store.membership(&self.stream).await?;
            *self.membership.lock().unwrap_or_else(|e| e.into_inner()) = published.clone();
            let mut latest = frontier::compute(&coordinates, published.as_ref(), listing);
            let Some(next) = latest.publish.take() else {
                return Ok(latest);
            };
            let expected = published.as_ref().map(|m| m.epoch);
            if self
                .store
                .publish_membership(&self.stream, expected, &next)
                .await?
            {
                info!(stream = %self.stream, epoch = next.epoch, members = next.members.len(), "frontier membership published");
                *self.membership.lock().unwrap_or_else(|e| e.into_inner()) = Some(next);
                return Ok(latest);
            }
        }
        let published = self.store.membership(&self.stream).await?;
        let mut latest = frontier::compute(&coordinates, published.as_ref(), listing);
        latest.publish = None;
        latest.scalar = None;
        latest
            .unproven
            .push("a membership change is being published by another worker".into());
        Ok(latest)
    }

    /// One scan: read the table, observe (the frontier, counters, the owner's side of each
    /// lease), plan (pure), and execute the plan's takes and requests. `true` while something
    /// moves (see [`planner::Plan::settling`], handoffs this worker awaits, leases lost or being
    /// judged, takes put off): scan again soon.
    async fn scan_table(&self) -> Result<bool, Error> {
        let rows = self.store.list(&self.stream).await?;
        let now = Instant::now();
        self.update_frontier(&rows, now).await;
        let observed = self.observe(&rows, now);
        *self.last_rows.lock().unwrap_or_else(|e| e.into_inner()) = Some(rows.clone());
        if self.taking.is_cancelled() {
            return Ok(false);
        }
        if self.liveness.starting() {
            // Scanned again soon: the takes wait only for a beat of this process to land.
            return Ok(true);
        }
        if self.liveness.silent() {
            return Ok(false);
        }
        if self.shards.names_reused() {
            self.delete_left_by_gone(&rows, &observed.judged).await;
        }
        let (plan, awaited) = self.plan(&rows, &observed.judged, now);
        let settling = plan.settling || awaited > 0 || observed.lost_some || observed.judging;
        let put_off = self.execute(plan.takes, &rows, now).await;
        Ok(settling || put_off)
    }

    /// The shards this process holds now.
    fn held_shards(&self) -> HashSet<String> {
        self.leases()
            .holding()
            .map(|h| h.ownership.shard_id.clone())
            .collect()
    }

    /// Deletes the rows of gone partitions left at SHARD_END ([`planner::left_by_gone`]): a name
    /// the source lists again gets a new row at the next sync and is read from its start.
    async fn delete_left_by_gone(&self, rows: &[Lease], judged: &[(bool, bool)]) {
        let held = self.held_shards();
        let seen = seen(rows, judged);
        let mut deleted = 0;
        for row in planner::left_by_gone(&self.worker, &seen, &held) {
            match self.store.delete(row).await {
                Ok(true) => {
                    info!(stream = %self.stream, shard = %row.shard_id, owner = row.owner.as_deref(), "lease row of a gone partition, left at SHARD_END, deleted");
                    deleted += 1;
                }
                Ok(false) => {}
                Err(e) => {
                    warn!(stream = %self.stream, shard = %row.shard_id, error = &e as &dyn std::error::Error, "deleting the row of a gone partition left at SHARD_END failed; the next scan tries again");
                }
            }
        }
        if deleted > 0 {
            self.changed_here();
        }
    }

    /// Publishes the frontier over `rows` (and syncs now when listed partitions still have no
    /// rows a scan interval after the listing).
    async fn update_frontier(&self, rows: &[Lease], now: Instant) {
        match self.publish_frontier(rows).await {
            Ok(latest) => {
                // Rows read a scan interval after a listing still lack some it found (their
                // creation failed, or was left to a worker that has not done it): list and create
                // them now rather than at the next periodic sync.
                let listed_at = self.listing().map(|(_, at)| at);
                if !latest.listed_without_row.is_empty()
                    && listed_at.is_some_and(|at| now >= at + self.settings.scan_interval)
                {
                    debug!(stream = %self.stream, missing = ?latest.listed_without_row, "listed partitions still have no rows: syncing now");
                    self.sync_now.notify_one();
                }
                self.frontier.send_if_modified(|f| {
                    let changed = *f != latest;
                    *f = latest;
                    changed
                });
            }
            Err(e) => {
                warn!(stream = %self.stream, error = &e as &dyn std::error::Error, "reading or publishing the frontier membership failed; the frontier is not updated this scan");
            }
        }
    }

    /// What a scan's `rows` show at `now`: each row's counter judged (expired, neglected) on
    /// this worker's clock, and the owner's side of each lease this worker holds (lost, or
    /// asked for).
    fn observe(&self, rows: &[Lease], now: Instant) -> Observed {
        let judged: Vec<(bool, bool)> = {
            let mut observed = self.observed.lock().unwrap_or_else(|e| e.into_inner());
            let roster = self.liveness.roster();
            rows.iter()
                .map(|row| {
                    let o = observed.entry(row.shard_id.clone()).or_insert(Observation {
                        counter: row.counter,
                        owner: row.owner.clone(),
                        since: now,
                    });
                    if o.counter != row.counter || o.owner != row.owner {
                        *o = Observation {
                            counter: row.counter,
                            owner: row.owner.clone(),
                            since: now,
                        };
                    }
                    // Unchanged for a lease duration: an owned lease expired, a free one neglected.
                    // A lease of a worker dead by the roster is expired once its counter has not
                    // moved for two renewal rounds as well: a worker whose beat fails while its
                    // renewals land keeps its leases (it gives up each whose renewal fails).
                    let still = now - o.since;
                    let expired = still >= self.settings.lease_duration
                        || (still >= self.settings.dead_owner_stillness()
                            && row.owner.as_deref().is_some_and(|w| roster.dead(w, now)));
                    // Left untaken: free for a lease duration, or naming an owner and still for
                    // two (an owner that is gone, and the worker it fell to did not take it).
                    let neglected = if row.owner.is_some() {
                        still >= self.settings.lease_duration * 2
                    } else {
                        expired
                    };
                    (expired, neglected)
                })
                .collect()
        };
        let expired: Vec<bool> = judged.iter().map(|(expired, _)| *expired).collect();
        // A lease of a worker dead by the roster, or gone from it, whose counter has not been
        // seen still for long enough yet: scan again soon, to see whether it moves. (A worker
        // that left at shutdown, or whose release failed then, leaves no silent beat behind: a
        // row naming it would wait for a quiet scan, minutes apart in a large fleet.)
        let judging = {
            let roster = self.liveness.roster();
            rows.iter().zip(&expired).any(|(row, &expired)| {
                !expired
                    && row
                        .owner
                        .as_deref()
                        .is_some_and(|w| roster.dead(w, now) || roster.departed(w))
            })
        };

        // The owner side: a held lease whose row names another owner or epoch was taken from us;
        // a request on a held lease's row stops its shard gracefully (the give-back then passes
        // it), and is acknowledged when news, and again while the row lacks it (a failed write).
        let effects =
            self.leases()
                .observe_held(rows, &self.worker, now, self.settings.lease_duration);
        let lost_some = effects.iter().any(|e| matches!(e, Effect::Lost { .. }));
        self.carry_out(effects, "the lease row names another owner");
        Observed {
            judged,
            judging,
            lost_some,
        }
    }

    /// The plan for a scan's `rows` (`judged` by [`Inner::observe`]), and how many handoffs
    /// this worker awaits.
    fn plan(
        &self,
        rows: &[Lease],
        judged: &[(bool, bool)],
        now: Instant,
    ) -> (planner::Plan, usize) {
        // The taker side: our requests still awaited (the row still names us as the taker, even
        // one this process does not remember: asked before a restart, or a steal that failed),
        // and whether each wait is over (patience counts from the owner's acknowledgement, once
        // seen).
        let requests = {
            let observed = self.observed.lock().unwrap_or_else(|e| e.into_inner());
            self.leases().observe_awaited(
                rows,
                &self.worker,
                now,
                self.settings.patience(),
                |shard, at| observed.get(shard).is_some_and(|o| o.since > at),
            )
        };
        let held = self.held_shards();
        let listing = self.listing();
        // Retired partitions the listing shows no activity in since are left out: nobody takes
        // them, and they count for no worker's share.
        let listed = listing.as_ref().map(|(listing, _)| &listing.ids);
        let seen: Vec<Seen<'_>> = seen(rows, judged)
            .into_iter()
            .filter(|s| !planner::dormant(s.lease, listed, |id| self.shards.last_activity(id)))
            .collect();
        let roster: Vec<String> = self.liveness.roster().live(now).into_iter().collect();
        let plan = planner::plan_listed(
            &self.worker,
            &seen,
            &held,
            &requests,
            &roster,
            self.settings.limits,
            listing.as_ref().map(|(listing, _)| &listing.ids),
        );
        if plan.waiting_for_rows
            && listing.is_some_and(|(_, at)| now - at >= self.settings.scan_interval)
        {
            // A child waits for a parent the listing names without a row. Rows being created
            // appear within a scan; a listing older than that may predate the parent's deletion
            // (it aged out of the stream): list again.
            debug!(stream = %self.stream, "a child waits for a listed parent without a row: listing the shards again");
            self.sync_now.notify_one();
        }
        if !plan.takes.is_empty() {
            debug!(stream = %self.stream, active = plan.active, workers = plan.workers, target = plan.target, takes = plan.takes.len(), "lease plan");
        }
        (plan, requests.len())
    }

    /// Carries out a plan's `takes` against the `rows` it was made from: asks for handoffs,
    /// and takes and steals `TAKES_AT_ONCE` at a time, each conditioned on the row as read.
    /// `true` when a take was put off (a lease whose work failed here a moment ago, or one this
    /// worker is giving back or letting go): scan again soon.
    async fn execute(&self, takes: Vec<Take>, rows: &[Lease], now: Instant) -> bool {
        let mut cooling = false;
        let by_shard: HashMap<&str, &Lease> =
            rows.iter().map(|r| (r.shard_id.as_str(), r)).collect();
        let mut to_take: Vec<(&Lease, bool)> = Vec::new();
        let mut to_ask: Vec<(&Lease, &str)> = Vec::new();
        for take in &takes {
            let planned = match take {
                Take::Free(s) => s,
                Take::Steal { shard_id, .. } | Take::Request { shard_id, .. } => shard_id,
            };
            if self.cooling(planned, now) {
                debug!(shard = %planned, "work on this lease failed here a moment ago: not taking it yet");
                cooling = true;
                continue;
            }
            let may_take = self.leases().may_take(planned, now);
            if let Err(not_now) = may_take {
                match not_now {
                    NotNow::Giving => {
                        debug!(shard = %planned, "this worker is giving the lease back: not taking it back")
                    }
                    NotNow::LettingGo => {
                        debug!(shard = %planned, "this worker let the lease go a moment ago and its work is still writing what settled: not taking it yet")
                    }
                    NotNow::Holding => debug!(shard = %planned, "held already"),
                }
                cooling = true;
                continue;
            }
            let (shard, stolen) = match take {
                Take::Free(s) => (s.as_str(), false),
                Take::Steal { shard_id, .. } => (shard_id.as_str(), true),
                Take::Request { shard_id, from } => {
                    if let Some(seen) = by_shard.get(shard_id.as_str()) {
                        to_ask.push((*seen, from.as_str()));
                    }
                    continue;
                }
            };
            if stolen {
                warn!(stream = %self.stream, shard, "the owner did not hand the lease over in time: stealing it");
            }
            let Some(seen) = by_shard.get(shard) else {
                continue;
            };
            if seen.retired_at.is_some() {
                info!(stream = %self.stream, shard, retired_at = seen.retired_at, "a retired partition shows activity since (or is no longer listed): waking it");
                metrics::counter!("shardwise_paged_partitions_woken_total", &self.labels())
                    .increment(1);
            }
            to_take.push((*seen, stolen));
        }
        // The takes of a scan `TAKES_AT_ONCE` at a time (one by one, 50 takes at 40-50 ms a
        // request held a joining worker's last leases 2.5 s).
        for batch in to_take.chunks(TAKES_AT_ONCE) {
            let sent = Instant::now();
            let answers = join_all(
                batch
                    .iter()
                    .map(|(seen, _)| self.store.take(seen, &self.worker)),
            )
            .await;
            for (&(seen, stolen), answer) in batch.iter().zip(answers) {
                let shard = seen.shard_id.as_str();
                match answer {
                    // Taking stopped (a shutdown began) while this take was in flight: the
                    // shutdown's release has already looked at what is held, so give it back now.
                    Ok(Some(lease)) if self.taking.is_cancelled() => {
                        if let Some(o) = lease.ownership() {
                            debug!(shard, "taken as taking stopped: releasing it at once");
                            if let Err(e) = self.store.release(&o).await {
                                warn!(
                                    shard,
                                    error = &e as &dyn std::error::Error,
                                    "releasing a lease taken as taking stopped failed; it will expire"
                                );
                            }
                        }
                    }
                    // The request is over only once the lease is ours (`acquired` forgets it);
                    // a steal that failed is tried again at the next scan.
                    Ok(Some(lease)) => self.acquired(lease, stolen, sent, seen.retired_at),
                    Ok(None) => debug!(shard, "lease changed before it could be taken"),
                    Err(e) => warn!(
                        shard,
                        error = &e as &dyn std::error::Error,
                        "taking a lease failed"
                    ),
                }
            }
        }
        // The requests `TAKES_AT_ONCE` at a time, after the takes: one by one, a joining
        // worker's 50 took 1.7-9 s through 20-50 ms of latency while the owners' passes
        // loaded the store, and the rows passed to it waited for the next scan meanwhile.
        for batch in to_ask.chunks(TAKES_AT_ONCE) {
            let answers = join_all(
                batch
                    .iter()
                    .map(|(seen, _)| self.store.request(seen, &self.worker)),
            )
            .await;
            for (&(seen, from), answer) in batch.iter().zip(answers) {
                let shard = seen.shard_id.as_str();
                match answer {
                    Ok(true) => {
                        info!(stream = %self.stream, shard, from, "asked the owner to hand the lease over");
                        metrics::counter!("shardwise_handoffs_requested_total", &self.labels())
                            .increment(1);
                        self.leases().asked(shard, now);
                    }
                    Ok(false) => {
                        debug!(shard, "lease changed before a handoff could be asked for")
                    }
                    Err(e) => {
                        warn!(
                            shard,
                            error = &e as &dyn std::error::Error,
                            "asking for a handoff failed"
                        )
                    }
                }
            }
        }
        // A lease skipped while its wait runs is taken at a scan soon after.
        cooling
    }

    /// A lease taken by a write sent at `sent` (its renewal stamp: see `lease_loop`).
    fn acquired(&self, lease: Lease, stolen: bool, sent: Instant, woken_from: Option<i64>) {
        let Some(ownership) = lease.ownership() else {
            return;
        };
        if self.settings.hold_until(sent, self.liveness.last_beat()) <= Instant::now() {
            // Its answer came after the hold it gave ran out: the others may see the lease
            // expired already. Not started; the row names this worker, so a scan takes it again.
            warn!(stream = %self.stream, shard = %lease.shard_id, epoch = ownership.epoch, "lease taken, but the answer came too late to hold it: given up at once");
            metrics::counter!("shardwise_leases_lost_total", &self.labels()).increment(1);
            self.hooks.lease_lost(&ownership);
            self.changed_here();
            return;
        }
        // A take ends a request of ours; an older holding's work is cancelled.
        let holding = self.leases().taken(ownership.clone(), sent);
        self.held_changed.notify_one();
        self.held_gauge();
        info!(stream = %self.stream, shard = %lease.shard_id, epoch = ownership.epoch, stolen, checkpoint = %lease.checkpoint, "lease taken");
        metrics::counter!("shardwise_leases_taken_total", &self.labels()).increment(1);
        if stolen {
            metrics::counter!("shardwise_leases_stolen_total", &self.labels()).increment(1);
        }
        self.hooks.lease_taken(&lease);
        let _ = self.events.send(LeaseEvent::Acquired(Box::new(HeldLease {
            ownership,
            lease,
            woken_from,
            hold: Hold::new(
                holding.renewed.subscribe(),
                self.liveness.beats(),
                self.settings.clone(),
                holding.cancel.clone(),
            ),
            cancel: holding.cancel,
            handoff: holding.handoff,
        })));
    }

    /// Syncs when a shard of this worker ended, every `shard_sync_interval` on one worker (the
    /// live worker with the lowest id), and once a scan interval after start when the start sync
    /// was left to a worker that started earlier (`owed`).
    async fn sync_loop(self: Arc<Self>, mut owed: bool) {
        loop {
            let wait = if owed {
                self.settings.scan_interval
            } else {
                self.settings.shard_sync_interval
            };
            let asked = tokio::select! {
                biased;
                _ = self.taking.cancelled() => return,
                _ = tokio::time::sleep(wait) => false,
                _ = self.sync_now.notified() => true,
            };
            let start_sync = std::mem::take(&mut owed);
            let fresh = asked || start_sync;
            if !(fresh || self.liveness.roster().syncs(Instant::now())) {
                continue;
            }
            if let Err(e) = self.sync_shards(fresh).await {
                warn!(stream = %self.stream, error = &e as &dyn std::error::Error, "shard sync failed");
            }
        }
    }

    /// Lists the stream's shards and creates rows for those without one, parents first; records
    /// children on their parents' rows. Unless `fresh`, compares against the last scan's rows (the
    /// periodic sync: a row created since makes a create that is refused, never a wrong row).
    async fn sync_shards(&self, fresh: bool) -> Result<(), Error> {
        let shards = self.shards.list_shards(&self.stream).await?;
        // Before any row is created: from now on the frontier names what this listing found
        // without a row, until the row exists.
        self.listed(&shards);
        let cached = match fresh {
            true => None,
            false => self
                .last_rows
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        };
        let rows = match cached {
            Some(rows) => rows,
            None => self.store.list(&self.stream).await?,
        };
        let existing: HashSet<String> = rows.iter().map(|r| r.shard_id.clone()).collect();
        let mut created = 0;
        // A generation's rows `CREATES_AT_ONCE` at a time, parents' generations first (200 rows
        // one by one took 7 s at 35 ms a request).
        for generation in sync::generations(sync::new_leases(
            &self.stream,
            &shards,
            &existing,
            self.settings.initial_position,
        )) {
            let mut failed = None;
            for batch in generation.chunks(CREATES_AT_ONCE) {
                let answers = join_all(batch.iter().map(|new| self.store.create(new))).await;
                for (new, answer) in batch.iter().zip(answers) {
                    match answer {
                        Ok(true) => {
                            created += 1;
                            debug!(stream = %self.stream, shard = %new.shard_id, checkpoint = %new.checkpoint, "lease row created");
                        }
                        Ok(false) => {}
                        Err(e) => failed = failed.or(Some(e)),
                    }
                }
            }
            if let Some(e) = failed {
                if created > 0 {
                    self.changed_here();
                }
                return Err(e);
            }
        }
        if created > 0 {
            self.changed_here();
        }
        let listed: HashSet<&str> = shards.iter().map(|s| s.shard_id.as_str()).collect();
        for row in sync::aged_out(&rows, &listed) {
            if self.store.delete(row).await? {
                info!(stream = %self.stream, shard = %row.shard_id, "lease row of an aged-out, ended shard deleted");
            }
        }
        let mut children: HashMap<&str, Vec<String>> = HashMap::new();
        for shard in &shards {
            for parent in &shard.parents {
                children
                    .entry(parent.as_str())
                    .or_default()
                    .push(shard.shard_id.clone());
            }
        }
        for row in &rows {
            if let Some(kids) = children.get(row.shard_id.as_str())
                && row.children.len() != kids.len()
            {
                self.store
                    .set_children(&self.stream, &row.shard_id, kids)
                    .await?;
            }
        }
        Ok(())
    }
}

/// A scan's `rows` as the planner sees them, each with its judgement (expired, neglected) from
/// [`Inner::observe`].
fn seen<'a>(rows: &'a [Lease], judged: &[(bool, bool)]) -> Vec<Seen<'a>> {
    rows.iter()
        .zip(judged)
        .map(|(lease, &(expired, neglected))| Seen {
            lease,
            expired,
            neglected,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The owner lets a lease go half a renewal interval before any other worker could take it:
    /// by its counter a lease duration after the renewal's send, or, with the owner's beat silent
    /// long enough for the others to judge it dead, once its counter was still for two renewal
    /// rounds and a quarter.
    #[test]
    fn a_lease_is_held_until_half_a_renewal_interval_before_anyone_can_take_it() {
        let settings = LeaseSettings::default(); // 10 s lease, 3.33 s rounds, 1 s beats
        // Ahead of now, so that an hour before it is an instant on any machine's clock.
        let renewed = Instant::now() + Duration::from_secs(7_200);
        let ms = |d: Duration| d.as_millis();
        let held = |beat_before_renewal: Duration| {
            ms(settings.hold_until(renewed, renewed - beat_before_renewal) - renewed)
        };
        // Beats land: the counter decides, 10 s less 1.67 s (and the timer's millisecond).
        assert_eq!(held(Duration::ZERO), 8_332);
        assert_eq!(held(Duration::from_secs(1)), 8_332);
        // The last beat 3 s before: dead to the others at 8 s (its 11 s silence from the beat).
        assert_eq!(held(Duration::from_secs(3)), 6_332);
        // Beats silent long before: 7.5 s of a still counter, less the margin.
        assert_eq!(held(Duration::from_secs(60)), 5_832);
        // At least one round and a half in every case: one failed round is survived.
        assert!(held(Duration::from_secs(3_600)) > ms(settings.renew_interval * 3 / 2));
    }
}
