//! The page barrier (pure): which progress write a partition makes next, from the pages fetched and
//! how far the tracker's settled prefix has come.
//!
//! ```text
//! durable: cursor C7, applied 105, version 4
//! fetched: [C7 -> C8: deliveries 0..2] [C8 -> C9: no deliveries] [C9 -> C10: deliveries 2..5]
//! settled below 1 (delivery 0 at 106) -> Applied { cursor C7, applied 106, version 4 }
//! settled below 2 (delivery 1 at 107) -> Promote { cursor C9, applied 107, version 5 }   (the empty page passes too)
//! settled below 5                      -> Promote { cursor C10, ..., version 6 }
//! ```
//!
//! A page's next cursor is promoted only once every delivery of that page, and of every page before
//! it, has settled (seed 003, invariant 1): a delivery that failed, waits for a retry, or is held
//! blocks it even when later ones settled. Between promotions the applied position rises with the
//! settled prefix (invariant 2), under the same version. Every write is a compare-and-swap from the
//! durable progress (invariant 3): the store refuses it if the cursor or version moved.

use std::collections::VecDeque;

use super::{Cursor, PagePosition, PagedProgress};

/// A page fetched and not yet promoted.
#[derive(Debug, Clone)]
struct Mark {
    /// Its next cursor; `None` when the partition ended with it.
    next: Option<Cursor>,
    /// The arrival index after its last tracked delivery (deliveries before it are this page's or
    /// earlier pages').
    end: u64,
    /// The complete-through watermark the source certified with the page: promoted with it.
    watermark: Option<i64>,
    /// When it was read (the provider's time, ms): every event after its next cursor was handed
    /// out later.
    at: i64,
}

/// The write to make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BarrierWrite {
    /// Raise the applied position, same cursor and version.
    Applied(PagedProgress),
    /// Promote the next cursor of the `pages`-th page pending (and the applied position),
    /// version + 1.
    Promote {
        /// The progress to store.
        to: PagedProgress,
        /// How many pending pages it promotes.
        pages: usize,
    },
    /// Every page of an ended partition passed: the partition is done.
    End,
}

impl BarrierWrite {
    /// The progress the write stores; `None` for the end (a checkpoint write).
    pub(crate) fn progress(&self) -> Option<&PagedProgress> {
        match self {
            BarrierWrite::Applied(to) | BarrierWrite::Promote { to, .. } => Some(to),
            BarrierWrite::End => None,
        }
    }
}

#[derive(Debug)]
pub(crate) struct Barrier {
    durable: PagedProgress,
    pages: VecDeque<Mark>,
    /// Every delivery below this arrival index has settled.
    settled_below: u64,
    /// The greatest position the settled prefix has reached.
    settled_through: Option<PagePosition>,
    /// When the attempt read its first page: what it handed out after the durable cursor, it
    /// handed out since.
    first_at: Option<i64>,
}

impl Barrier {
    /// Starts from the progress as stored; `next_index` is the tracker's next arrival index.
    pub(crate) fn new(durable: PagedProgress, next_index: u64) -> Self {
        Self {
            durable,
            pages: VecDeque::new(),
            settled_below: next_index,
            settled_through: None,
            first_at: None,
        }
    }

    /// The progress as stored.
    pub(crate) fn durable(&self) -> &PagedProgress {
        &self.durable
    }

    /// Where the next fetch continues: the last fetched page's next cursor, else the durable one.
    /// `None` inside `Some`: the partition ended.
    pub(crate) fn fetch_cursor(&self) -> Option<Option<&Cursor>> {
        match self.pages.back() {
            Some(mark) => mark.next.as_ref().map(Some),
            None => Some(self.durable.resume_cursor.as_ref()),
        }
    }

    /// Pages fetched and not yet promoted.
    #[cfg(test)]
    fn pending_pages(&self) -> usize {
        self.pages.len()
    }

    /// A page was fetched (read at `at`, the provider's time in ms): its deliveries end before
    /// arrival index `end`; the source certified it complete through `watermark`, if it did.
    pub(crate) fn fetched(
        &mut self,
        next: Option<Cursor>,
        end: u64,
        watermark: Option<i64>,
        at: i64,
    ) {
        self.first_at.get_or_insert(at);
        self.pages.push_back(Mark {
            next,
            end,
            watermark,
            at,
        });
    }

    /// The highest watermark fetched (promoted or not), for telling a page that only raises it.
    pub(crate) fn fetched_watermark(&self) -> Option<i64> {
        self.pages
            .iter()
            .filter_map(|m| m.watermark)
            .chain(self.durable.closed_through)
            .max()
    }

    /// The settled prefix reached arrival index `below` (every delivery before it settled), the
    /// last of them at `through`.
    pub(crate) fn settled(&mut self, below: u64, through: Option<&PagePosition>) {
        self.settled_below = self.settled_below.max(below);
        if let Some(through) = through
            && self.settled_through.as_ref().is_none_or(|t| through > t)
        {
            self.settled_through = Some(through.clone());
        }
    }

    /// The applied position a write would carry: never below the durable one.
    fn applied(&self) -> Option<PagePosition> {
        match (&self.durable.applied_position, &self.settled_through) {
            (Some(d), Some(s)) => Some(d.max(s).clone()),
            (d, s) => d.clone().or_else(|| s.clone()),
        }
    }

    /// The write to make now, if any.
    pub(crate) fn next_write(&self) -> Option<BarrierWrite> {
        let passed = self
            .pages
            .iter()
            .take_while(|m| m.end <= self.settled_below)
            .count();
        let applied = self.applied();
        if passed > 0 {
            let mark = &self.pages[passed - 1];
            // The watermark never goes down: the highest of the durable one and the pages passed.
            let closed_through = self
                .pages
                .iter()
                .take(passed)
                .filter_map(|m| m.watermark)
                .chain(self.durable.closed_through)
                .max();
            return Some(match &mark.next {
                None => BarrierWrite::End,
                Some(next) => BarrierWrite::Promote {
                    to: PagedProgress {
                        resume_cursor: Some(next.clone()),
                        applied_position: applied,
                        checkpoint_version: self.durable.checkpoint_version + 1,
                        closed_through,
                        receipts_since: Some(mark.at),
                    },
                    pages: passed,
                },
            });
        }
        (applied != self.durable.applied_position).then(|| {
            BarrierWrite::Applied(PagedProgress {
                applied_position: applied,
                // The cursor stays: what was handed out after it, since it was read or since
                // this attempt began.
                receipts_since: self.durable.receipts_since.or(self.first_at),
                ..self.durable.clone()
            })
        })
    }

    /// A write was stored: its progress is the durable one now, and the pages it promoted are
    /// done.
    pub(crate) fn written(&mut self, write: &BarrierWrite) {
        match write {
            BarrierWrite::Applied(to) => self.durable = to.clone(),
            BarrierWrite::Promote { to, pages } => {
                self.pages.drain(..*pages);
                self.durable = to.clone();
            }
            BarrierWrite::End => self.pages.clear(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(name: &str) -> Cursor {
        Cursor::new(name.to_string())
    }

    fn p(n: u64) -> PagePosition {
        PagePosition::from_u64(n)
    }

    fn progress(cursor: &str, applied: u64, version: u64) -> PagedProgress {
        PagedProgress {
            resume_cursor: Some(c(cursor)),
            applied_position: Some(p(applied)),
            checkpoint_version: version,
            closed_through: None,
            // (Every page of these tests is read at 0.)
            receipts_since: Some(0),
        }
    }

    /// What a replay from the written progress needs: the receipts of what was handed out
    /// after its cursor. A promotion: since the page that brought the cursor was read. An
    /// applied-only write: since the durable cursor's page was read (as stored), or, when the
    /// row does not say, since the attempt read its first page.
    #[test]
    fn receipts_since_is_when_the_promoted_page_was_read_or_the_attempt_began() {
        let unknown = PagedProgress {
            receipts_since: None,
            ..progress("C1", 10, 1)
        };
        let mut barrier = Barrier::new(unknown, 0);
        barrier.fetched(Some(c("C2")), 2, None, 1_000);
        barrier.fetched(Some(c("C3")), 4, None, 2_000);
        barrier.settled(1, Some(&p(11)));
        let write = barrier.next_write().unwrap();
        assert_eq!(write.progress().unwrap().receipts_since, Some(1_000));
        barrier.written(&write);
        barrier.settled(2, Some(&p(12)));
        let write = barrier.next_write().unwrap();
        assert!(matches!(write, BarrierWrite::Promote { .. }));
        assert_eq!(write.progress().unwrap().receipts_since, Some(1_000));
        barrier.written(&write);
        barrier.settled(3, Some(&p(13)));
        let write = barrier.next_write().unwrap();
        assert_eq!(
            write.progress().unwrap().receipts_since,
            Some(1_000),
            "the stored one: C2's page was read at 1,000"
        );
        barrier.written(&write);
        barrier.settled(4, Some(&p(14)));
        let write = barrier.next_write().unwrap();
        assert_eq!(write.progress().unwrap().resume_cursor, Some(c("C3")));
        assert_eq!(write.progress().unwrap().receipts_since, Some(2_000));
    }

    /// Seed 003's walkthrough: durable C7 / 105; the page at C7 holds 104 (a replay, not tracked),
    /// 106 and 107 (deliveries 0 and 1), next cursor C8. 106 settles: applied 106, cursor still C7.
    /// Only once 107 settles is C8 promoted.
    #[test]
    fn the_cursor_is_promoted_only_when_the_whole_page_settled() {
        let mut barrier = Barrier::new(progress("C7", 105, 4), 0);
        barrier.fetched(Some(c("C8")), 2, None, 0);
        assert_eq!(barrier.next_write(), None, "nothing settled");
        barrier.settled(1, Some(&p(106)));
        let write = barrier.next_write().unwrap();
        assert_eq!(write, BarrierWrite::Applied(progress("C7", 106, 4)));
        barrier.written(&write);
        assert_eq!(barrier.next_write(), None);
        barrier.settled(2, Some(&p(107)));
        assert_eq!(
            barrier.next_write(),
            Some(BarrierWrite::Promote {
                to: progress("C8", 107, 5),
                pages: 1
            })
        );
    }

    /// The quarantine boundary: 210 and 212 settled, 211 not (only decided in memory): the applied
    /// position stays at 210 and the cursor stays pending until 211 has a durable outcome.
    #[test]
    fn a_later_settled_event_does_not_pass_an_unsettled_one() {
        let mut barrier = Barrier::new(progress("C20", 209, 1), 0);
        barrier.fetched(Some(c("C21")), 3, None, 0); // 210, 211, 212 are deliveries 0, 1, 2
        // 210 and 212 settled; the tracker's prefix stops at 211.
        barrier.settled(1, Some(&p(210)));
        assert_eq!(
            barrier.next_write(),
            Some(BarrierWrite::Applied(progress("C20", 210, 1)))
        );
        // 211's quarantine receipt becomes durable: the prefix runs through 212.
        barrier.settled(3, Some(&p(212)));
        assert_eq!(
            barrier.next_write(),
            Some(BarrierWrite::Promote {
                to: progress("C21", 212, 2),
                pages: 1
            })
        );
    }

    #[test]
    fn empty_pages_pass_with_the_pages_before_them_and_promotions_coalesce() {
        let mut barrier = Barrier::new(progress("C1", 10, 0), 0);
        barrier.fetched(Some(c("C2")), 2, None, 0);
        barrier.fetched(Some(c("C3")), 2, None, 0); // an empty page: no deliveries
        barrier.fetched(Some(c("C4")), 4, None, 0);
        assert_eq!(barrier.fetch_cursor(), Some(Some(&c("C4"))));
        barrier.settled(2, Some(&p(12)));
        let write = barrier.next_write().unwrap();
        assert_eq!(
            write,
            BarrierWrite::Promote {
                to: progress("C3", 12, 1),
                pages: 2
            }
        );
        barrier.written(&write);
        assert_eq!(barrier.pending_pages(), 1);
        barrier.settled(4, Some(&p(14)));
        assert_eq!(
            barrier.next_write(),
            Some(BarrierWrite::Promote {
                to: progress("C4", 14, 2),
                pages: 1
            })
        );
    }

    #[test]
    fn a_page_of_replays_only_passes_at_once_and_never_lowers_the_applied_position() {
        // Durable applied 50; a page whose events were all at or below it tracks nothing.
        let mut barrier = Barrier::new(progress("C5", 50, 3), 7);
        barrier.fetched(Some(c("C6")), 7, None, 0);
        assert_eq!(
            barrier.next_write(),
            Some(BarrierWrite::Promote {
                to: progress("C6", 50, 4),
                pages: 1
            })
        );
        barrier.settled(7, Some(&p(40)));
        assert_eq!(barrier.applied(), Some(p(50)));
    }

    #[test]
    fn an_ended_partition_ends_once_its_last_page_passed() {
        let mut barrier = Barrier::new(PagedProgress::default(), 0);
        assert_eq!(barrier.fetch_cursor(), Some(None), "the first page");
        barrier.fetched(None, 1, None, 0);
        assert_eq!(barrier.fetch_cursor(), None, "nothing more to fetch");
        assert_eq!(barrier.next_write(), None);
        barrier.settled(1, Some(&p(1)));
        assert_eq!(barrier.next_write(), Some(BarrierWrite::End));
    }
}
