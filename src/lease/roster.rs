//! Who is alive, from the roster's beats: pure, and driven by the caller's clock.
//!
//! Each worker changes its own beat in the stream's roster item every beat interval and reads the
//! whole roster back with the write. A worker whose beat keeps changing is alive; one whose beat
//! has not changed for the silence (a lease duration and one beat interval) on this observer's
//! clock is dead (the same rule as a lease counter, so no clocks are compared). A large fleet's
//! roster is split into sections ([`Sections`]): each worker beats in its own and reads the others
//! every few beats. See `docs/leases.md`, "Scale".

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::time::Instant;

use super::store::Roster;

/// Bits of a beat that count; the bits above them are the writing process's tag.
const COUNT_BITS: u32 = 24;
/// Bits of a process tag that hold its start time (seconds, modulo 2^20: about 12 days).
const START_BITS: u32 = 20;
/// Bits of a process tag drawn at random.
const RANDOM_BITS: u32 = 19;

/// A process's tag: its start time in seconds (the low 20 bits) above 19 random bits, so two
/// processes under one worker id tell each other apart.
pub(crate) fn process_tag(start_secs: u64, random: u64) -> u64 {
    ((start_secs & ((1 << START_BITS) - 1)) << RANDOM_BITS) | (random & ((1 << RANDOM_BITS) - 1))
}

/// Who wrote a beat: the process's tag, and whether its first beat found another process's
/// beat in the entry (it started while another ran under the id, or after one that crashed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Writer {
    pub(crate) tag: u64,
    pub(crate) late: bool,
}

impl Writer {
    /// The beat this writer writes as its `count`th: its tag and flag above the count (modulo
    /// 2^24: a wrap is still a change). One number in one attribute, so the roster item grows by
    /// a few bytes a worker, not by a second attribute.
    pub(crate) fn beat(self, count: u64) -> u64 {
        (((self.tag << 1) | u64::from(self.late)) << COUNT_BITS) | (count & ((1 << COUNT_BITS) - 1))
    }

    /// The count of `beat`: 1 for a process's first beat, which cannot carry the `late` flag yet.
    pub(crate) fn count(beat: u64) -> u64 {
        beat & ((1 << COUNT_BITS) - 1)
    }

    /// Who wrote `beat`.
    pub(crate) fn of(beat: u64) -> Self {
        let stamp = beat >> COUNT_BITS;
        Self {
            tag: stamp >> 1,
            late: stamp & 1 == 1,
        }
    }

    /// Whether `other`, beating under the same id as this writer, came after it: known when
    /// only one of them found the other's (or a crashed predecessor's) beat at its first beat
    /// (the other found nothing: it came first); otherwise by start time (the nearer way round
    /// the 2^20 s circle), then by the random bits. The two processes reach opposite answers, so
    /// exactly one of them gives way. (A first beat cannot carry the flag yet: judge a writer by
    /// a later one.)
    pub(crate) fn came_before(self, other: Self) -> bool {
        if self.late != other.late {
            return other.late;
        }
        let mask = (1 << START_BITS) - 1;
        let ahead = ((other.tag >> RANDOM_BITS).wrapping_sub(self.tag >> RANDOM_BITS)) & mask;
        if ahead == 0 {
            other.tag > self.tag
        } else {
            ahead < 1 << (START_BITS - 1)
        }
    }
}

/// A section holding more workers than this splits the roster in two more: at about 40 bytes an
/// entry a section stays near one write unit a beat (a few with 256-character ids), so each item
/// takes tens of write units a second, not a thousand.
pub(crate) const SECTION_WORKERS: usize = 32;

/// The most sections a roster is split into (2,048 workers at 32 a section).
pub(crate) const MAX_SECTIONS: u32 = 64;

/// How many beats apart a worker reads the sections it does not beat in.
pub(crate) const READ_EVERY_BEATS: u64 = 2;

/// How long a worker gone from the roster is remembered as gone: long past the time any row
/// naming it is expired and taken (a lease duration and a few scans).
pub(crate) const GONE_KEPT: Duration = Duration::from_secs(600);

/// The section `worker` beats in when the roster has `sections`: a digest of its id, so every
/// process and every version agrees (a split by two moves a worker to `k` or `k + sections`).
pub(crate) fn section_of(worker: &str, sections: u32) -> u32 {
    use md5::{Digest, Md5};
    if sections <= 1 {
        // One section holds every worker: no digest (asked for every worker at every beat).
        return 0;
    }
    let digest = Md5::digest(worker.as_bytes());
    let mut high = [0u8; 8];
    high.copy_from_slice(&digest[..8]);
    (u64::from_be_bytes(high) % u64::from(sections)) as u32
}

/// This worker's view of the roster's sections: how many there are (from section 0), each
/// section as last read (its own from its beats' answers, the others from reads), and where its
/// own beat is.
#[derive(Debug)]
pub(crate) struct Sections {
    me: String,
    count: u32,
    read: BTreeMap<u32, Roster>,
    /// The section this worker's beats last landed in, and the last beat written there.
    written: Option<(u32, u64)>,
    /// A section this worker moved out of, and its beat left there, until removed.
    left: Option<(u32, u64)>,
}

impl Sections {
    pub(crate) fn new(me: impl Into<String>) -> Self {
        Self {
            me: me.into(),
            count: 1,
            read: BTreeMap::new(),
            written: None,
            left: None,
        }
    }

    /// How many sections the roster has, as last read.
    pub(crate) fn count(&self) -> u32 {
        self.count
    }

    /// The section this worker beats in now.
    pub(crate) fn mine(&self) -> u32 {
        section_of(&self.me, self.count)
    }

    /// The sections this worker reads rather than beats in.
    pub(crate) fn others(&self) -> Vec<u32> {
        let mine = self.mine();
        (0..self.count).filter(|k| *k != mine).collect()
    }

    /// Records `section` as read or as written by a beat; section 0 tells the count.
    pub(crate) fn record(&mut self, section: u32, roster: Roster) {
        if let Some(count) = roster.sections {
            // Sections only ever grow: an older read cannot shrink them.
            self.count = self.count.max(count.clamp(1, MAX_SECTIONS));
        }
        self.read.insert(section, roster);
    }

    /// This worker's `beat` landed in `section`. When it moved there from another section, its
    /// entry there is to be removed (still holding the beat returned).
    pub(crate) fn landed(&mut self, section: u32, beat: u64) {
        if let Some((before, last)) = self.written
            && before != section
        {
            self.left = Some((before, last));
        }
        self.written = Some((section, beat));
    }

    /// This worker split the roster into `to` sections.
    pub(crate) fn split_to(&mut self, to: u32) {
        self.count = self.count.max(to.clamp(1, MAX_SECTIONS));
    }

    /// The entry this worker left in a section it moved out of, until [`removed`](Self::removed).
    pub(crate) fn left(&self) -> Option<(u32, u64)> {
        self.left
    }

    /// The entry left behind is gone (removed, or replaced by another process's beat).
    pub(crate) fn removed(&mut self) {
        self.left = None;
    }

    /// The count of sections to split into, when this worker's own section holds too many
    /// workers that belong in it (not counting those a split moved out, whose entries stay until
    /// their next beat: counting them split the roster again and again, to 32 sections for 200
    /// workers).
    pub(crate) fn split(&self) -> Option<u32> {
        let mine = self.mine();
        let full = self.read.get(&mine).is_some_and(|r| {
            r.beats
                .keys()
                .filter(|w| section_of(w, self.count) == mine)
                .count()
                > SECTION_WORKERS
        });
        (full && self.count < MAX_SECTIONS).then(|| (self.count * 2).min(MAX_SECTIONS))
    }

    /// The whole roster from the sections as last read: each worker's beat from the section it
    /// belongs in by the count when it is there (a worker that just moved may be in two), else
    /// from the lowest section holding it; `changes` summed over the sections (each only grows);
    /// section 0's founder; `beat_before` this worker's beat's. With where each worker was found.
    pub(crate) fn merged(&self, beat_before: Option<u64>) -> (Roster, BTreeMap<String, u32>) {
        let mut roster = Roster {
            beat_before,
            sections: Some(self.count),
            ..Roster::default()
        };
        let mut found: BTreeMap<String, u32> = BTreeMap::new();
        for (&section, part) in &self.read {
            roster.changes += part.changes;
            for (worker, &beat) in &part.beats {
                let home = section_of(worker, self.count) == section;
                if home || !found.contains_key(worker) {
                    found.insert(worker.clone(), section);
                    roster.beats.insert(worker.clone(), beat);
                }
            }
        }
        roster.founder = self
            .read
            .get(&0)
            .and_then(|r| r.founder.clone())
            .or_else(|| self.read.values().find_map(|r| r.founder.clone()));
        (roster, found)
    }
}

/// What this worker has observed of the roster.
#[derive(Debug)]
pub(crate) struct RosterView {
    me: String,
    /// How long a beat may stay unchanged before its worker is dead.
    silence: Duration,
    /// Each worker's beat as last seen, and since when it has had that value.
    beats: BTreeMap<String, (u64, Instant)>,
    /// Workers seen in the roster and gone from it since (left at shutdown, or forgotten as
    /// dead), each with when its beat last changed: judged as a worker whose beat stopped then.
    /// Kept for [`GONE_KEPT`].
    gone: BTreeMap<String, Instant>,
    changes: u64,
    founder: Option<String>,
    /// The live set and `changes` as of the last time the caller asked what changed.
    reported: Option<(BTreeSet<String>, u64)>,
}

/// What one observation found.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Observed {
    /// The live workers or the change counter differ from the last observation's: rebalance.
    pub changed: bool,
    /// Workers dead long enough to be removed from the roster (each with the beat seen), so that
    /// everyone stops counting them.
    pub forget: Vec<(String, u64)>,
}

impl RosterView {
    pub(crate) fn new(me: impl Into<String>, silence: Duration) -> Self {
        Self {
            me: me.into(),
            silence,
            beats: BTreeMap::new(),
            gone: BTreeMap::new(),
            changes: 0,
            founder: None,
            reported: None,
        }
    }

    /// Records a roster as read at `now`.
    pub(crate) fn observe(&mut self, roster: &Roster, now: Instant) -> Observed {
        let gone: Vec<String> = self
            .beats
            .keys()
            .filter(|w| !roster.beats.contains_key(*w))
            .cloned()
            .collect();
        for worker in gone {
            if let Some((_, since)) = self.beats.remove(&worker) {
                self.gone.insert(worker, since);
            }
        }
        self.gone
            .retain(|w, since| !roster.beats.contains_key(w) && now - *since < GONE_KEPT);
        for (worker, &beat) in &roster.beats {
            match self.beats.get_mut(worker) {
                Some((seen, since)) if *seen != beat => {
                    *seen = beat;
                    *since = now;
                }
                Some(_) => {}
                None => {
                    self.beats.insert(worker.clone(), (beat, now));
                }
            }
        }
        self.changes = roster.changes;
        self.founder.clone_from(&roster.founder);
        let live = self.live(now);
        let changed = self.reported.as_ref() != Some(&(live.clone(), self.changes));
        self.reported = Some((live, self.changes));
        let forget = self
            .beats
            .iter()
            .filter(|(w, (_, since))| **w != self.me && now - *since >= self.silence * 2)
            .map(|(w, (beat, _))| (w.clone(), *beat))
            .collect();
        Observed { changed, forget }
    }

    /// Judges the workers again at `now` without a new read (a worker's silence may just have
    /// run out): whether the live set changed since the last report.
    pub(crate) fn recheck(&mut self, now: Instant) -> bool {
        let live = self.live(now);
        let changed = self
            .reported
            .as_ref()
            .is_some_and(|(reported, _)| *reported != live);
        if let Some(reported) = self.reported.as_mut() {
            reported.0 = live;
        }
        changed
    }

    /// When the next worker seen alive runs out of silence, if any does.
    pub(crate) fn next_death(&self, now: Instant) -> Option<Instant> {
        self.beats
            .iter()
            .filter(|(w, _)| **w != self.me)
            .map(|(_, (_, since))| since)
            .chain(self.gone.values())
            .map(|since| *since + self.silence)
            .filter(|at| *at > now)
            .min()
    }

    /// The workers alive at `now` (this one always).
    pub(crate) fn live(&self, now: Instant) -> BTreeSet<String> {
        let mut live: BTreeSet<String> = self
            .beats
            .iter()
            .filter(|(_, (_, since))| now - *since < self.silence)
            .map(|(w, _)| w.clone())
            .collect();
        live.insert(self.me.clone());
        live
    }

    /// Whether `worker` is dead by the roster at `now`: seen, and its beat unchanged for the
    /// silence, or gone from the roster and its last beat that old (a worker that left counts
    /// as one whose beat stopped when it left). A worker never seen (not yet in the roster, or
    /// an older version that does not beat) is not judged here.
    pub(crate) fn dead(&self, worker: &str, now: Instant) -> bool {
        worker != self.me
            && self
                .beats
                .get(worker)
                .map(|(_, since)| since)
                .or_else(|| self.gone.get(worker))
                .is_some_and(|since| now - *since >= self.silence)
    }

    /// Whether `worker` was seen in the roster and is gone from it (it left, or was forgotten
    /// as dead): a row still naming it waits only for its counter to be seen still.
    pub(crate) fn departed(&self, worker: &str) -> bool {
        worker != self.me && self.gone.contains_key(worker)
    }

    /// Whether this worker should run the periodic shard sync: it is the live worker with the
    /// lowest id.
    pub(crate) fn syncs(&self, now: Instant) -> bool {
        self.live(now).first() == Some(&self.me)
    }

    /// Whether this worker creates the rows at start at once: it is alone in the roster, or the
    /// roster's founder (on a stream's first start, the one worker whose beat came first). The
    /// others sync a scan interval later, when the rows they find missing are at most those of
    /// shards that appeared while no worker ran.
    pub(crate) fn syncs_at_start(&self) -> bool {
        self.founder.as_deref() == Some(self.me.as_str())
            || !self.beats.keys().any(|w| *w != self.me)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roster(beats: &[(&str, u64)], changes: u64) -> Roster {
        Roster {
            beats: beats.iter().map(|(w, b)| (w.to_string(), *b)).collect(),
            changes,
            founder: beats.first().map(|(w, _)| w.to_string()),
            beat_before: None,
            sections: None,
        }
    }

    #[test]
    fn a_workers_section_is_stable_and_a_split_keeps_it_or_moves_it_by_the_old_count() {
        let ids: Vec<String> = (0..1_000)
            .map(|i| format!("host-{i}-{}", i * 7_919))
            .collect();
        for id in &ids {
            assert_eq!(section_of(id, 1), 0);
            for count in [2, 4, 8, 16, 32] {
                let before = section_of(id, count / 2);
                let after = section_of(id, count);
                assert!(
                    after == before || after == before + count / 2,
                    "{id} {count}"
                );
            }
        }
        // Spread: 1,000 ids over 8 sections, none far from 125.
        let mut sizes = [0usize; 8];
        for id in &ids {
            sizes[section_of(id, 8) as usize] += 1;
        }
        assert!(sizes.iter().all(|n| (90..160).contains(n)), "{sizes:?}");
        // The same digest whatever process or version computes it: the first 8 bytes of
        // md5("worker-a"), big-endian, modulo the count (as Python's hashlib gives them).
        assert_eq!(
            [64, 8, 2].map(|count| section_of("worker-a", count)),
            [26, 2, 0]
        );
    }

    #[test]
    fn sections_grow_from_section_zero_and_merge_each_worker_once() {
        let mut view = Sections::new("me");
        assert_eq!((view.count(), view.mine(), view.others()), (1, 0, vec![]));
        assert_eq!(view.split(), None);
        // Section 0 fills past its limit: split into two.
        let many: Vec<(String, u64)> = (0..=SECTION_WORKERS)
            .map(|i| (format!("w{i}"), i as u64))
            .collect();
        let full = Roster {
            beats: many.iter().cloned().collect(),
            sections: Some(1),
            ..Roster::default()
        };
        view.record(0, full);
        assert_eq!(view.split(), Some(2));
        // Section 0 now says 2: the worker beats where its digest says, reads the other.
        view.record(
            0,
            Roster {
                beats: [("me".to_string(), 5), ("x".to_string(), 1)].into(),
                changes: 3,
                founder: Some("x".into()),
                sections: Some(2),
                ..Roster::default()
            },
        );
        assert_eq!(view.count(), 2);
        let mine = view.mine();
        assert_eq!(view.others(), vec![1 - mine]);
        // Entries of workers the split moved out stay in a section until their next beat: they
        // do not make it full.
        view.record(
            mine,
            Roster {
                beats: many.iter().cloned().collect(),
                sections: (mine == 0).then_some(2),
                ..Roster::default()
            },
        );
        let belong = many
            .iter()
            .filter(|(w, _)| section_of(w, 2) == mine)
            .count();
        assert!(belong <= SECTION_WORKERS, "{belong} of {}", many.len());
        assert_eq!(view.split(), None);
        // An older answer of section 0 cannot shrink the count.
        view.record(
            0,
            Roster {
                sections: Some(1),
                ..view.read[&0].clone()
            },
        );
        assert_eq!(view.count(), 2);
        // It moved: its beat in the new section lands, the old entry is to be removed.
        view.landed(0, 5);
        view.record(
            1,
            Roster {
                beats: [("me".to_string(), 6), ("y".to_string(), 9)].into(),
                changes: 2,
                ..Roster::default()
            },
        );
        view.landed(1, 6);
        assert_eq!(view.left(), Some((0, 5)));
        let (merged, found) = view.merged(None);
        assert_eq!(merged.changes, 5, "summed over the sections");
        assert_eq!(merged.founder.as_deref(), Some("x"), "section 0's");
        assert_eq!(merged.beats.len(), 3, "me, x, y once each");
        let home = section_of("me", 2);
        assert_eq!(found["me"], home, "from the section it belongs in");
        assert_eq!(merged.beats["me"], if home == 1 { 6 } else { 5 });
        view.removed();
        assert_eq!(view.left(), None);
    }

    const SILENCE: Duration = Duration::from_secs(10);

    #[test]
    fn a_beat_tells_its_writer_and_of_two_writers_exactly_one_came_before() {
        let writer = |secs, random, late| Writer {
            tag: process_tag(secs, random),
            late,
        };
        let early = writer(1_767_225_600, 0x4BCDE, false);
        for count in [1, 2, (1 << 24) + 5] {
            assert_eq!(Writer::of(early.beat(count)), early, "count {count}");
        }
        assert_ne!(early.beat(1), early.beat(2), "every beat changes");
        assert_eq!(Writer::count(early.beat(1)), 1);
        let late_flag = Writer {
            late: true,
            ..early
        };
        assert_eq!(Writer::of(late_flag.beat(9)), late_flag);
        let pairs = [
            // By start time.
            (early, writer(1_767_225_601, 1, false)),
            // The same second: the random bits.
            (early, writer(1_767_225_600, 0x4BCDF, false)),
            // The one whose first beat found another's came after, whatever the clocks say.
            (
                writer(1_767_225_700, 5, false),
                writer(1_767_225_600, 5, true),
            ),
            // Across the 2^20 s wrap the nearer way round.
            (writer((1 << 20) - 1, 7, true), writer(1 << 20, 7, true)),
        ];
        for (first, second) in pairs {
            assert!(first.came_before(second), "{first:?} before {second:?}");
            assert!(
                !second.came_before(first),
                "{second:?} not before {first:?}"
            );
        }
    }

    #[test]
    fn a_worker_whose_beat_stops_is_dead_after_the_silence_and_forgotten_after_two() {
        let t0 = Instant::now();
        let mut view = RosterView::new("a", SILENCE);
        let first = view.observe(&roster(&[("a", 1), ("b", 7)], 0), t0);
        assert!(first.changed, "the first observation is a change");
        assert_eq!(view.live(t0).len(), 2);

        // b keeps beating: alive; nothing changed.
        let at = t0 + Duration::from_secs(3);
        assert_eq!(
            view.observe(&roster(&[("a", 2), ("b", 8)], 0), at),
            Observed::default()
        );
        // b stops at 8.
        let at = t0 + Duration::from_secs(12);
        assert!(!view.dead("b", at), "unchanged for 9 s only");
        let o = view.observe(&roster(&[("a", 5), ("b", 8)], 0), at);
        assert!(!o.changed);
        let at = t0 + Duration::from_secs(13);
        let o = view.observe(&roster(&[("a", 6), ("b", 8)], 0), at);
        assert!(o.changed, "b died: the live set shrank");
        assert!(view.dead("b", at));
        assert!(o.forget.is_empty(), "not yet two lease durations");
        let at = t0 + Duration::from_secs(23);
        let o = view.observe(&roster(&[("a", 9), ("b", 8)], 0), at);
        assert_eq!(o.forget, vec![("b".to_string(), 8)]);
        // b comes back (a zombie, or restarted under the same id): alive again.
        // (Below: judged again without a read, at the moment its silence runs out.)
        let at = t0 + Duration::from_secs(24);
        let o = view.observe(&roster(&[("a", 10), ("b", 9)], 0), at);
        assert!(o.changed && !view.dead("b", at));
    }

    /// A worker gone from the roster (it left at shutdown, or was forgotten) is judged as one
    /// whose beat stopped when it was last seen to change: dead a silence after that, and
    /// departed at once (issue 57, defect 1: a row naming it is watched, not left to a quiet
    /// scan). Coming back makes it a live worker again.
    #[test]
    fn a_worker_gone_from_the_roster_is_dead_a_silence_after_its_last_beat() {
        let t0 = Instant::now();
        let mut view = RosterView::new("a", SILENCE);
        view.observe(&roster(&[("a", 1), ("b", 1)], 0), t0);
        let at = t0 + Duration::from_secs(2);
        view.observe(&roster(&[("a", 2), ("b", 2)], 0), at);
        let left = t0 + Duration::from_secs(3);
        let o = view.observe(&roster(&[("a", 3)], 1), left);
        assert!(o.changed, "b left: the live set shrank");
        assert!(view.departed("b") && !view.departed("a") && !view.departed("c"));
        assert!(!view.dead("b", left), "its last beat is 1 s old");
        assert_eq!(view.next_death(left), Some(at + SILENCE));
        assert!(view.dead("b", at + SILENCE));
        assert!(!view.live(at + SILENCE).contains("b"));
        // Back under the same id: alive, not departed.
        let back = at + SILENCE + Duration::from_secs(1);
        view.observe(&roster(&[("a", 9), ("b", 1)], 1), back);
        assert!(!view.departed("b") && !view.dead("b", back));
        // Forgotten for good after GONE_KEPT.
        view.observe(&roster(&[("a", 10)], 1), back);
        let later = back + GONE_KEPT;
        view.observe(&roster(&[("a", 11)], 1), later);
        assert!(!view.departed("b") && !view.dead("b", later));
    }

    #[test]
    fn a_silence_running_out_is_seen_at_that_moment_without_a_read() {
        let t0 = Instant::now();
        let mut view = RosterView::new("a", SILENCE);
        view.observe(&roster(&[("a", 1), ("b", 1)], 0), t0);
        assert_eq!(view.next_death(t0), Some(t0 + SILENCE));
        assert!(!view.recheck(t0 + SILENCE - Duration::from_millis(1)));
        assert!(view.recheck(t0 + SILENCE), "b's silence ran out");
        assert!(!view.recheck(t0 + SILENCE), "reported once");
        assert_eq!(view.next_death(t0 + SILENCE), None);
    }

    #[test]
    fn joining_leaving_and_announcements_are_changes() {
        let t0 = Instant::now();
        let mut view = RosterView::new("b", SILENCE);
        view.observe(&roster(&[("b", 1)], 0), t0);
        assert!(view.syncs_at_start(), "alone");
        assert!(view.syncs(t0), "alone: it syncs");
        let o = view.observe(&roster(&[("a", 1), ("b", 2)], 0), t0);
        assert!(o.changed, "a joined");
        assert!(!view.syncs_at_start(), "a founded the roster");
        assert!(!view.syncs(t0), "a has the lower id");
        assert!(
            view.observe(&roster(&[("a", 2), ("b", 3)], 1), t0).changed,
            "announced"
        );
        assert!(view.observe(&roster(&[("b", 4)], 1), t0).changed, "a left");
        assert!(view.syncs(t0));
        assert!(!view.dead("never-seen", t0 + SILENCE * 5));
        assert!(!view.dead("b", t0 + SILENCE * 5), "never judges itself");
    }
}
