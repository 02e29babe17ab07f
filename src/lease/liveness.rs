//! Liveness: this worker's beat in the stream's roster, its view of the other workers (alive,
//! dead, the roster's sections), and another process beating under its id. The lease task
//! judges holds by the last beat that landed; the scan plans with the roster's live workers.
//! See `docs/leases.md`, *Scale*.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tracing::{debug, error, info, warn};

use super::manager::LeaseSettings;
use super::roster::{READ_EVERY_BEATS, RosterView, Sections, Writer};
use super::store::LeaseStore;

/// What one beat found.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Beat {
    /// The roster changed (a worker joined, left or died, or rows were announced): time to scan.
    pub(super) changed: bool,
    /// A second process beats under this worker id and came first: this one gives way now.
    pub(super) gave_way: bool,
}

/// Another process under this worker's id, as the tags of the beats in its roster entry show it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) enum Twin {
    /// None seen.
    #[default]
    None,
    /// The first beat found another process's beat (its tag and count) in the entry: a process
    /// that ran under this id before (a restart), or one that still does. The next beat tells.
    Before { tag: u64, count: u64 },
    /// A later beat found another process's beat in the entry, once: a second process beating
    /// now, or the last beat of one that ended, delayed on its way (a request sent before a
    /// crash can land after the restart; a process has one beat under way at a time, so it
    /// can leave at most one). A second beat of that process, with another count, tells.
    Seen { tag: u64, count: u64 },
    /// A later beat found another tag: a second process beats under this id now. `newer` when
    /// that process came after this one (`roster::Writer::came_before`: it refuses to run, or
    /// gives everything up, when it sees this one).
    Running { tag: u64, newer: bool },
}

/// This worker's beat and its view of the roster.
pub(super) struct Liveness {
    store: Arc<dyn LeaseStore>,
    stream: String,
    worker: String,
    settings: LeaseSettings,
    /// The workers of the stream as their beats tell.
    roster: Mutex<RosterView>,
    /// The roster's sections as this worker last read them, and where it beats.
    sections: Mutex<Sections>,
    /// When the last beat of this worker that landed was sent (each held lease's
    /// [`Hold`](super::Hold) watches it).
    last_beat: watch::Sender<Instant>,
    /// When the last read of the sections this worker does not beat in that landed was sent, and
    /// how many sections there were (`None`: never read; a roster of one section needs none).
    last_read: Mutex<Option<(Instant, u32)>>,
    /// A failed beat found the beat silent ([`Liveness::silent`]) and said so; cleared, and said
    /// so, when a beat lands again.
    silent: AtomicBool,
    /// The next beat raises the roster's `changes`: rows were added or a lease became free, so
    /// every worker scans.
    announce: AtomicBool,
    /// Wakes the beat loop for a beat now (an announcement).
    pub(super) beat_now: Notify,
    /// This process's tag in its beats (`roster::process_tag`): two processes under one worker
    /// id tell each other apart by it.
    tag: u64,
    /// This process's first beat found another process's beat in its entry: it started while
    /// another ran under its id, or after one crashed. Written in its later beats.
    late: AtomicBool,
    /// Beats this process has tried to write (each writes the next count).
    beats_tried: AtomicU64,
    /// Beats this process has written.
    beats_written: AtomicU64,
    /// What this process's beats found of another process under the same worker id.
    twin: Mutex<Twin>,
}

impl Liveness {
    pub(super) fn new(
        store: Arc<dyn LeaseStore>,
        stream: String,
        worker: String,
        settings: LeaseSettings,
    ) -> Self {
        let silence = settings.silence();
        let never = Instant::now()
            .checked_sub(settings.give_up_after())
            .unwrap_or_else(Instant::now);
        Self {
            store,
            sections: Mutex::new(Sections::new(worker.clone())),
            roster: Mutex::new(RosterView::new(worker.clone(), silence)),
            stream,
            worker,
            settings,
            // None landed yet: silent until the first lands (no lease is taken before).
            last_beat: watch::Sender::new(never),
            last_read: Mutex::new(None),
            silent: AtomicBool::new(false),
            announce: AtomicBool::new(false),
            beat_now: Notify::new(),
            tag: super::roster::process_tag(
                (crate::time::millis(crate::time::now()).max(0) / 1_000) as u64,
                (crate::backoff::fraction() * f64::from(1u32 << 19)) as u64,
            ),
            late: AtomicBool::new(false),
            beats_tried: AtomicU64::new(0),
            beats_written: AtomicU64::new(0),
            twin: Mutex::new(Twin::None),
        }
    }

    pub(super) fn roster(&self) -> MutexGuard<'_, RosterView> {
        self.roster.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn sections(&self) -> MutexGuard<'_, Sections> {
        self.sections.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Something every worker should scan for happened here: the next beat, sent now,
    /// announces it.
    pub(super) fn announce(&self) {
        self.announce.store(true, Ordering::Relaxed);
        self.beat_now.notify_one();
    }

    /// Writes this worker's beat and reads the roster back with it, saying whether the roster
    /// changed and whether this process is to give way to another under its id ([`Beat`]). A slow
    /// answer is waited for as long as it can still count ([`LeaseSettings::attempt_limit`]):
    /// the next beat goes out after it, so a slow store gets fewer beats, not more. A worker
    /// whose beat has not landed for [`LeaseSettings::give_up_after`] (from the send of the last
    /// one that did) takes no lease ([`Liveness::silent`]); its leases are held as long as
    /// [`LeaseSettings::hold_until`] allows.
    pub(super) async fn beat(&self) -> Beat {
        let announce = self.announce.swap(false, Ordering::Relaxed);
        let attempt = self.settings.attempt_limit();
        let count = self.beats_tried.fetch_add(1, Ordering::Relaxed) + 1;
        let beat = self.writer().beat(count);
        let section = self.sections().mine();
        // Stamped with when it was sent (see `lease_loop`).
        let sent = Instant::now();
        let result = tokio::time::timeout(
            attempt,
            self.store
                .beat(&self.stream, section, &self.worker, beat, announce),
        )
        .await;
        let roster = match result {
            Ok(Ok(roster)) => roster,
            failed => {
                if announce {
                    self.announce.store(true, Ordering::Relaxed);
                }
                match failed {
                    Ok(Err(e)) => {
                        warn!(stream = %self.stream, error = &e as &dyn std::error::Error, "writing this worker's beat failed")
                    }
                    _ => warn!(stream = %self.stream, "writing this worker's beat timed out"),
                }
                // The others may judge this worker dead now, but they take a lease of a dead
                // worker only once its counter stops moving too: the leases whose renewals land
                // are kept (a failed beat alone drops nothing; `hold_until` says for how long).
                // No lease is taken while silent.
                if self.beats_written.load(Ordering::Relaxed) == 0 {
                    if !self.silent.swap(true, Ordering::Relaxed) {
                        warn!(stream = %self.stream, "this worker's first beat was not written: it takes no lease until one is (the roster may be throttled)");
                    }
                    return Beat::default();
                }
                if self.silent() && !self.silent.swap(true, Ordering::Relaxed) {
                    warn!(stream = %self.stream, silent = ?self.last_beat().elapsed(), "this worker's beat has not been written in time: others may judge it dead; its leases are kept while their renewals land, and none is taken");
                }
                return Beat::default();
            }
        };
        let gave_way = self.twin_seen(roster.beat_before);
        let beat_before = roster.beat_before;
        {
            let mut sections = self.sections();
            sections.record(section, roster);
            sections.landed(section, beat);
        }
        super::hold::landed(&self.last_beat, sent);
        self.read_sections(count).await;
        if self.silent.swap(false, Ordering::Relaxed) {
            info!(stream = %self.stream, "this worker's beat is written again: taking leases again");
        }
        self.leave_old_section().await;
        // Judged as of after the reads: a beat seen is never dated before it was written.
        let now = Instant::now();
        let (roster, found) = self.sections().merged(beat_before);
        let observed = self.roster().observe(&roster, now);
        for (worker, beat) in observed.forget {
            let section = found.get(&worker).copied().unwrap_or(0);
            match self
                .store
                .forget(&self.stream, section, &worker, Some(beat))
                .await
            {
                Ok(true) => {
                    info!(stream = %self.stream, worker = %worker, "a dead worker was removed from the roster")
                }
                Ok(false) => {}
                Err(e) => {
                    debug!(worker = %worker, error = &e as &dyn std::error::Error, "removing a dead worker from the roster failed")
                }
            }
        }
        self.split_if_full().await;
        Beat {
            changed: observed.changed,
            gave_way,
        }
    }

    /// Reads the sections of the roster this worker does not beat in, every
    /// [`READ_EVERY_BEATS`] beats (and at once when it never read them, or their number grew).
    /// A roster of one section needs no read: the beat's answer is the whole roster.
    async fn read_sections(&self, count: u64) {
        let (others, sections) = {
            let s = self.sections();
            (s.others(), s.count())
        };
        if others.is_empty() {
            return;
        }
        let last = *self.last_read.lock().unwrap_or_else(|e| e.into_inner());
        let due = match last {
            None => true,
            Some((_, read)) => read != sections || count.is_multiple_of(READ_EVERY_BEATS),
        };
        if !due {
            return;
        }
        let sent = Instant::now();
        let result = tokio::time::timeout(
            self.settings.attempt_limit(),
            self.store.read_roster(&self.stream, &others),
        )
        .await;
        match result {
            Ok(Ok(read)) => {
                let mut s = self.sections();
                for (section, roster) in others.into_iter().zip(read) {
                    s.record(section, roster);
                }
                drop(s);
                *self.last_read.lock().unwrap_or_else(|e| e.into_inner()) = Some((sent, sections));
            }
            Ok(Err(e)) => {
                warn!(stream = %self.stream, error = &e as &dyn std::error::Error, "reading the roster's other sections failed")
            }
            Err(_) => warn!(stream = %self.stream, "reading the roster's other sections timed out"),
        }
    }

    /// Removes this worker's entry from a section it moved out of (only while it still holds
    /// the beat this worker left there), so the others do not judge it dead there.
    async fn leave_old_section(&self) {
        let Some((section, beat)) = self.sections().left() else {
            return;
        };
        match self
            .store
            .forget(&self.stream, section, &self.worker, Some(beat))
            .await
        {
            Ok(_) => self.sections().removed(),
            Err(e) => {
                debug!(stream = %self.stream, section, error = &e as &dyn std::error::Error, "removing this worker's entry from the section it moved out of failed; tried again at the next beat")
            }
        }
    }

    /// Splits the roster in two more sections when this worker's own holds too many workers
    /// (conditioned on the count it read: of two workers splitting at once, one does).
    async fn split_if_full(&self) {
        let (from, to) = {
            let s = self.sections();
            (s.count(), s.split())
        };
        let Some(to) = to else {
            return;
        };
        match self.store.split_roster(&self.stream, from, to).await {
            Ok(true) => {
                info!(stream = %self.stream, from, to, "the roster is split into more sections: each worker beats in its own and reads the others");
                self.sections().split_to(to);
            }
            Ok(false) => {}
            Err(e) => {
                debug!(stream = %self.stream, error = &e as &dyn std::error::Error, "splitting the roster failed; tried again at the next beat")
            }
        }
    }

    /// Whether this process is still starting as far as the roster tells: no beat of its own has
    /// landed yet, or the first that landed found another process's beat in this worker's entry
    /// and a second has not landed to tell a restart from a second process under the same id
    /// (issue 57, defect 4). It takes no lease meanwhile: a row naming the id may be the other
    /// process's.
    pub(super) fn starting(&self) -> bool {
        match self.beats_written.load(Ordering::Relaxed) {
            0 => true,
            1 => matches!(self.twin(), Twin::Before { .. }),
            _ => false,
        }
    }

    /// When the last beat of this worker that landed was sent.
    pub(super) fn last_beat(&self) -> Instant {
        *self.last_beat.borrow()
    }

    /// The last beat that landed, as it changes.
    pub(super) fn beats(&self) -> watch::Receiver<Instant> {
        self.last_beat.subscribe()
    }

    /// Whether this worker's beat has not landed for [`LeaseSettings::give_up_after`]: its view
    /// of the roster may be that old, so it takes no lease. Judged by the clock, not by a failed
    /// beat: one still awaiting its answer counts as not landed.
    pub(super) fn silent(&self) -> bool {
        let limit = self.settings.give_up_after();
        if self.last_beat().elapsed() >= limit {
            return true;
        }
        // A split roster is known only as far as the other sections were read.
        self.sections().count() > 1
            && self
                .last_read
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_none_or(|(sent, _)| sent.elapsed() >= limit)
    }

    fn writer(&self) -> Writer {
        Writer {
            tag: self.tag,
            late: self.late.load(Ordering::Relaxed),
        }
    }

    pub(super) fn twin(&self) -> Twin {
        *self.twin.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Judges what a beat found in this worker's roster entry before writing its own. After
    /// this process's first beat, another process's tag there means a second process beats
    /// under this id: the one that came later gives up every lease (without a write: the rows name
    /// the id both share) and takes none, and reports it; the other reports it and goes on.
    /// `true` when this process is to give way now (the first time it finds it came later).
    fn twin_seen(&self, before: Option<u64>) -> bool {
        let written = self.beats_written.fetch_add(1, Ordering::Relaxed);
        let first = written == 0;
        let Some((other, count)) = before
            .map(|beat| (Writer::of(beat), Writer::count(beat)))
            .filter(|(w, _)| w.tag != self.tag)
        else {
            return false;
        };
        let mut twin = self.twin.lock().unwrap_or_else(|e| e.into_inner());
        if first {
            self.late.store(true, Ordering::Relaxed);
            *twin = Twin::Before {
                tag: other.tag,
                count,
            };
            return false;
        }
        if count == 1 {
            // The other's first beat: whether it found another's before it is not written yet,
            // so which of the two came first cannot be told. Its next beat says.
            return false;
        }
        // Two beats of the other process prove it beats now; one may be a dead one's last,
        // delayed. (What the first beat found counts for the start's second beat only.)
        let again = match *twin {
            Twin::Before { tag, count: seen } => written == 1 && tag == other.tag && seen != count,
            Twin::Seen { tag, count: seen } => tag == other.tag && seen != count,
            Twin::Running { tag, .. } => tag == other.tag,
            Twin::None => false,
        };
        if !again {
            // (A clash already judged stays judged.)
            if !matches!(*twin, Twin::Running { .. }) {
                *twin = Twin::Seen {
                    tag: other.tag,
                    count,
                };
            }
            return false;
        }
        let newer = self.writer().came_before(other);
        let seen_before = matches!(*twin, Twin::Running { .. });
        *twin = Twin::Running {
            tag: other.tag,
            newer,
        };
        drop(twin);
        metrics::counter!("shardwise_worker_id_clashes_total", "stream" => self.stream.clone(), "worker" => self.worker.clone()).increment(1);
        if seen_before {
            return false;
        }
        if newer {
            error!(stream = %self.stream, worker = %self.worker, "a second process beats under this worker id, which came after this one: it refuses to run, or gives up its leases and takes none; give each process its own worker id");
            return false;
        }
        error!(stream = %self.stream, worker = %self.worker, "a second process beats under this worker id, which came before this one: this one gives up every lease (without writing: the rows name the id both share), takes none and stops; give each process its own worker id");
        true
    }
}
