//! What a retry becomes. Pure.
//!
//! With [`RetryMode::Copy`](crate::consumer::RetryMode::Copy) on Kinesis, which cannot hand one
//! record back and counts no deliveries: a counted copy on the stream, a dead letter, a drop, or
//! a refusal.
//!
//! | outcome | policy | attempt | becomes |
//! |---|---|---|---|
//! | `Retry` | neither `max_attempts` nor a dead-letter stream | any | refused: holds the checkpoint (copy mode is refused at build so) |
//! | `Retry` / `RetryAfter(d)` | below the cap | n | copy with count n+1 (after d), to the retry stream when there is one |
//! | `Retry` / `RetryAfter(d)` | at the cap, dead-letter stream | n | dead letter |
//! | `Retry` / `RetryAfter(d)` | at the cap, no dead-letter stream | n | settles as drop (warn) |
//!
//! Without `max_attempts` the cap is [`DEFAULT_MAX_ATTEMPTS`], so a poison record answered with
//! `RetryAfter` is not copied forever.
//!
//! A paged source retries in place (it cannot hand an event back either, but it can run it
//! again before its page's cursor moves), and a spent event never settles without a durable
//! terminal outcome (seed 003, rule 1):
//!
//! | outcome | policy | attempt | becomes |
//! |---|---|---|---|
//! | `Retry` / `RetryAfter(d)` | no `max_attempts` | any | run again (after d, or a backoff capped at 5 s): holds the barrier |
//! | `Retry` / `RetryAfter(d)` | below the cap | n | run again |
//! | `Retry` / `RetryAfter(d)` | at the cap, dead-letter stream | n | dead letter |
//! | `Retry` / `RetryAfter(d)` | at the cap, receipt ledger | n | `quarantined` receipt with the reason |
//! | `Retry` / `RetryAfter(d)` | at the cap, neither | n | refused at build (`ConfigError`) |
//!
//! A Kinesis consumer with [`RetryMode::InPlace`](crate::consumer::RetryMode::InPlace) (the
//! default) retries as a paged source does (a "copy" is then the next attempt on the lane, never a
//! record written), except that a spent record with no dead-letter stream is dropped where the application said so
//! (`on_spent(OnSpent::Drop)`), else quarantined by receipt with a ledger, and a bound with none
//! of these is refused at build.

use std::num::NonZeroU32;
use std::time::Duration;

pub use crate::envelope::LEGACY_ORIGIN_SEQUENCE_HEADER;
use crate::envelope::{Headers, RETRY_COUNT_HEADER};
use crate::handler::{Delivery, Outcome};

/// The cap on attempts (the first delivery counts) when `max_attempts` is not declared: for a
/// dead-letter stream alone, and for `RetryAfter`.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;

/// Names the stream the event was first read from (kept across copies).
pub const ORIGIN_STREAM_HEADER: &str = "x-shardwise-origin-stream";
/// Names the shard the event was first read from.
pub const ORIGIN_SHARD_HEADER: &str = "x-shardwise-origin-shard";
/// Names the sequence number the event first had.
pub const ORIGIN_SEQUENCE_HEADER: &str = "x-shardwise-origin-sequence";
/// Names the KPL sub-sequence the event first had.
pub const ORIGIN_SUB_SEQUENCE_HEADER: &str = "x-shardwise-origin-subsequence";

/// The origin headers as shardwise builds before 0.1.0 named them (with their attempt-counting
/// rule; see [`LEGACY_ORIGIN_SEQUENCE_HEADER`]): read, and renamed on the next copy.
pub const LEGACY_ORIGIN_HEADERS: [(&str, &str); 4] = [
    ("x-ruststream-origin-stream", ORIGIN_STREAM_HEADER),
    ("x-ruststream-origin-shard", ORIGIN_SHARD_HEADER),
    (LEGACY_ORIGIN_SEQUENCE_HEADER, ORIGIN_SEQUENCE_HEADER),
    (
        "x-ruststream-origin-subsequence",
        ORIGIN_SUB_SEQUENCE_HEADER,
    ),
];
/// Why a record was dead-lettered.
pub const DEAD_LETTER_REASON_HEADER: &str = "x-ruststream-dead-letter-reason";
/// How many attempts a dead-lettered record had.
pub const ATTEMPTS_HEADER: &str = "x-ruststream-attempts";

/// Names the paged event's identity (`paged/SOURCE/PARTITION/ID`) on a dead letter.
pub const EVENT_ID_HEADER: &str = "x-shardwise-event-id";
/// The paged event's timestamp (ms since the epoch) on a dead letter.
pub const EVENT_TIMESTAMP_HEADER: &str = "x-shardwise-event-timestamp";
/// The paged event's position in its partition (hex of its bytes) on a dead letter.
pub const PAGE_POSITION_HEADER: &str = "x-shardwise-page-position";

/// The retry policy of a consumer.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct RetryPolicy {
    pub(crate) max_attempts: Option<NonZeroU32>,
    pub(crate) dead_letter: Option<String>,
    /// Where copies go instead of the stream the delivery was read from.
    pub(crate) retry_stream: Option<String>,
    /// Where a spent event goes when there is no dead-letter stream.
    pub(crate) spent: Spent,
    /// Whether retries run the delivery again where it is (a paged source, or a Kinesis
    /// consumer with [`RetryMode::InPlace`](crate::consumer::RetryMode::InPlace)).
    pub(crate) in_place: bool,
}

/// What becomes of a delivery whose attempts are spent when there is no dead-letter stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Spent {
    /// Kinesis: settles as a drop (warned), as retry copies have always done, or, in place, where
    /// the application said so (`on_spent(OnSpent::Drop)`).
    #[default]
    Drop,
    /// A paged source with a receipt ledger: a `quarantined` receipt, then it settles. Retries
    /// run again in place, without a cap unless one is declared.
    Quarantine,
    /// A paged source with neither a ledger nor a dead-letter stream, or a Kinesis record retried
    /// in place with no dead-letter stream and no `on_spent`: nothing may record or drop it, so it
    /// never settles (the build refuses a bound here; this is the last guard). Retries run again
    /// in place, without a cap unless one is declared.
    Hold,
}

/// What to do with a delivery whose handler asked for a retry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RetryPlan {
    /// Refuse: the delivery stays unsettled and holds the checkpoint.
    Refuse,
    /// Write a copy to `stream` after `delay`; settle once it is written.
    Copy {
        stream: String,
        delay: Duration,
        headers: Headers,
        /// The attempt counts toward the cap (`false`: in place, an attempt not made).
        counted: bool,
    },
    /// Write to the dead-letter stream; settle once it is written.
    DeadLetter { stream: String, headers: Headers },
    /// Attempts spent and no dead-letter stream: settle as a drop (Kinesis only).
    Drop { attempts: u32 },
    /// Attempts spent, paged, no dead-letter stream: record a `quarantined` receipt carrying
    /// `reason`; settle once it is durable.
    Quarantine { reason: String },
}

impl RetryPolicy {
    fn cap(&self) -> u32 {
        self.max_attempts
            .map_or(DEFAULT_MAX_ATTEMPTS, NonZeroU32::get)
    }

    /// Whether retries run the delivery again where it is.
    fn in_place(&self) -> bool {
        self.in_place
    }

    /// Decides what a retry outcome becomes. `None` for outcomes that are not retries.
    pub(crate) fn plan(&self, outcome: &Outcome, delivery: &Delivery) -> Option<RetryPlan> {
        let delay = match outcome {
            Outcome::Retry | Outcome::NotAttempted => Duration::ZERO,
            Outcome::RetryAfter(d) => *d,
            _ => return None,
        };
        let declared = self.max_attempts.is_some() || self.dead_letter.is_some();
        if matches!(outcome, Outcome::Retry | Outcome::NotAttempted)
            && !declared
            && !self.in_place()
        {
            return Some(RetryPlan::Refuse);
        }
        // In place, an attempt not made runs again as the same attempt, whatever the cap.
        let counted = !(self.in_place() && matches!(outcome, Outcome::NotAttempted));
        let attempt = delivery.attempt();
        let mut headers = delivery.headers().clone();
        stamp_origin(&mut headers, delivery);
        // In place, only a declared cap is spent: with none, a failing event runs again until it
        // succeeds (and holds its page meanwhile).
        let below_cap = !counted
            || match (self.in_place(), self.max_attempts) {
                (true, None) => true,
                _ => attempt < self.cap(),
            };
        if below_cap {
            // The copy is attempt + 1: it counts `attempt` retries before it.
            headers.insert(RETRY_COUNT_HEADER, attempt.to_string());
            return Some(RetryPlan::Copy {
                stream: self
                    .retry_stream
                    .clone()
                    .unwrap_or_else(|| delivery.stream().to_string()),
                delay,
                headers,
                counted,
            });
        }
        Some(self.spent(
            delivery,
            format!("attempts spent: {attempt} of {}", self.cap()),
        ))
    }

    /// What a delivery whose retries are over becomes: a dead letter carrying `reason`; without a
    /// dead-letter stream, a drop (Kinesis), a `quarantined` receipt (paged, with a ledger) or a
    /// refusal that holds it (paged, with neither).
    pub(crate) fn spent(&self, delivery: &Delivery, reason: String) -> RetryPlan {
        self.spent_after(delivery, delivery.attempt(), reason)
    }

    /// [`spent`](Self::spent), for a delivery that got `attempt` attempts (a record too old for
    /// its next attempt got one fewer than its count).
    pub(crate) fn spent_after(
        &self,
        delivery: &Delivery,
        attempt: u32,
        reason: String,
    ) -> RetryPlan {
        match &self.dead_letter {
            None if self.spent == Spent::Quarantine => RetryPlan::Quarantine {
                reason: format!("{reason} (attempts: {attempt})"),
            },
            None if self.spent == Spent::Hold => RetryPlan::Refuse,
            Some(stream) => {
                let mut headers = delivery.headers().clone();
                stamp_origin(&mut headers, delivery);
                // Published like any copy, as ruststream does: the dead letter of attempt n
                // carries the count n.
                headers.insert(RETRY_COUNT_HEADER, attempt.to_string());
                headers.insert(DEAD_LETTER_REASON_HEADER, reason);
                headers.insert(ATTEMPTS_HEADER, attempt.to_string());
                RetryPlan::DeadLetter {
                    stream: stream.clone(),
                    headers,
                }
            }
            None => RetryPlan::Drop { attempts: attempt },
        }
    }
}

/// Names the first read of the event, so it keeps one identity across copies. A copy from an older
/// shardwise build keeps its origin, under the current names (so its copy follows the current
/// counting rule).
fn stamp_origin(headers: &mut Headers, d: &Delivery) {
    if headers.get(ORIGIN_SEQUENCE_HEADER).is_some() {
        return;
    }
    if headers.get(LEGACY_ORIGIN_SEQUENCE_HEADER).is_some() {
        for (old, new) in LEGACY_ORIGIN_HEADERS {
            if let Some(value) = headers.get(old).map(bytes::Bytes::copy_from_slice) {
                headers.remove(old);
                headers.insert(new, value);
            }
        }
        return;
    }
    headers.insert(ORIGIN_STREAM_HEADER, d.stream().to_string());
    headers.insert(ORIGIN_SHARD_HEADER, d.shard().to_string());
    headers.insert(ORIGIN_SEQUENCE_HEADER, d.sequence_number().to_string());
    headers.insert(ORIGIN_SUB_SEQUENCE_HEADER, d.sub_sequence().to_string());
    // A paged event: its identity, timestamp and position in its partition (the shard header
    // names the partition).
    if let Some(position) = d.page_position() {
        headers.insert(EVENT_ID_HEADER, d.event_id().to_string());
        headers.insert(PAGE_POSITION_HEADER, hex(position.as_bytes()));
        if let Some(ms) = d
            .arrived_at()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        {
            headers.insert(EVENT_TIMESTAMP_HEADER, ms.as_millis().to_string());
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Position, SequenceNumber};

    fn delivery(attempt: u32) -> Delivery {
        Delivery::builder(
            "orders",
            "shardId-000000000001",
            Position::new(SequenceNumber::parse("42").unwrap(), 0),
        )
        .partition_key("k")
        .payload("p")
        .attempt(attempt)
        .build()
    }

    fn policy(max: Option<u32>, dl: Option<&str>) -> RetryPolicy {
        RetryPolicy {
            max_attempts: max.and_then(NonZeroU32::new),
            dead_letter: dl.map(str::to_string),
            retry_stream: None,
            spent: Spent::Drop,
            in_place: false,
        }
    }

    fn kind(plan: &Option<RetryPlan>) -> &'static str {
        match plan {
            None => "terminal",
            Some(RetryPlan::Refuse) => "refuse",
            Some(RetryPlan::Copy { .. }) => "copy",
            Some(RetryPlan::DeadLetter { .. }) => "dead-letter",
            Some(RetryPlan::Drop { .. }) => "drop",
            Some(RetryPlan::Quarantine { .. }) => "quarantine",
        }
    }

    #[test]
    fn table_of_outcomes_policies_and_attempts() {
        let ms = Duration::from_millis(5);
        /// (what, outcome, max_attempts, dead letter, attempt, expected plan)
        type Row<'a> = (&'a str, Outcome, Option<u32>, Option<&'a str>, u32, &'a str);
        let rows: &[Row<'_>] = &[
            ("ack is terminal", Outcome::Ack, None, None, 1, "terminal"),
            (
                "plain retry without a declaration is refused",
                Outcome::Retry,
                None,
                None,
                1,
                "refuse",
            ),
            (
                "retry_after needs no declaration",
                Outcome::RetryAfter(ms),
                None,
                None,
                1,
                "copy",
            ),
            (
                "retry_after without a declaration is capped too: a poison record is not copied forever",
                Outcome::RetryAfter(ms),
                None,
                None,
                DEFAULT_MAX_ATTEMPTS,
                "drop",
            ),
            (
                "below the cap: a copy",
                Outcome::Retry,
                Some(3),
                None,
                2,
                "copy",
            ),
            (
                "at the cap without a dead letter: drop",
                Outcome::Retry,
                Some(3),
                None,
                3,
                "drop",
            ),
            (
                "at the cap with a dead letter",
                Outcome::Retry,
                Some(3),
                Some("dlq"),
                3,
                "dead-letter",
            ),
            (
                "past the cap (a copy from an older setting)",
                Outcome::Retry,
                Some(2),
                Some("dlq"),
                5,
                "dead-letter",
            ),
            (
                "a dead letter alone caps at the default",
                Outcome::Retry,
                None,
                Some("dlq"),
                DEFAULT_MAX_ATTEMPTS,
                "dead-letter",
            ),
            (
                "max_attempts 1: the first failure is spent",
                Outcome::RetryAfter(ms),
                Some(1),
                Some("dlq"),
                1,
                "dead-letter",
            ),
        ];
        for (what, outcome, max, dl, attempt, want) in rows {
            let plan = policy(*max, *dl).plan(outcome, &delivery(*attempt));
            assert_eq!(kind(&plan), *want, "{what}");
        }
    }

    #[test]
    fn in_place_a_retry_is_spent_only_at_a_declared_cap_and_never_dropped() {
        let ms = Duration::from_millis(5);
        let paged = |max: Option<u32>, dl: Option<&str>, spent: Spent| RetryPolicy {
            max_attempts: max.and_then(NonZeroU32::new),
            dead_letter: dl.map(str::to_string),
            retry_stream: None,
            spent,
            in_place: true,
        };
        /// (what, outcome, max_attempts, dead letter, spent, attempt, expected plan)
        type Row<'a> = (
            &'a str,
            Outcome,
            Option<u32>,
            Option<&'a str>,
            Spent,
            u32,
            &'a str,
        );
        let rows: &[Row<'_>] = &[
            (
                "no cap: a plain retry runs again, however often it failed",
                Outcome::Retry,
                None,
                None,
                Spent::Hold,
                1_000,
                "copy",
            ),
            (
                "no cap: retry_after too (no default cap in place)",
                Outcome::RetryAfter(ms),
                None,
                None,
                Spent::Quarantine,
                DEFAULT_MAX_ATTEMPTS,
                "copy",
            ),
            (
                "no cap, a dead-letter stream: still runs again (the stream alone caps nothing in place)",
                Outcome::Retry,
                None,
                Some("dlq"),
                Spent::Hold,
                DEFAULT_MAX_ATTEMPTS,
                "copy",
            ),
            (
                "below a declared cap: runs again",
                Outcome::Retry,
                Some(3),
                None,
                Spent::Quarantine,
                2,
                "copy",
            ),
            (
                "at the cap with a ledger: a quarantined receipt, never a drop",
                Outcome::Retry,
                Some(3),
                None,
                Spent::Quarantine,
                3,
                "quarantine",
            ),
            (
                "at the cap with a dead-letter stream: the dead letter",
                Outcome::Retry,
                Some(3),
                Some("dlq"),
                Spent::Quarantine,
                3,
                "dead-letter",
            ),
            (
                "at the cap with neither (refused at build): held, never dropped",
                Outcome::Retry,
                Some(3),
                None,
                Spent::Hold,
                3,
                "refuse",
            ),
            (
                "Kinesis in place, at the cap, on_spent(Drop): dropped, as the application said",
                Outcome::Retry,
                Some(3),
                None,
                Spent::Drop,
                3,
                "drop",
            ),
            (
                "Kinesis in place, no cap, on_spent(Drop): runs again (nothing is spent)",
                Outcome::RetryAfter(ms),
                None,
                None,
                Spent::Drop,
                DEFAULT_MAX_ATTEMPTS,
                "copy",
            ),
        ];
        for (what, outcome, max, dl, spent, attempt, want) in rows {
            let plan = paged(*max, *dl, *spent).plan(outcome, &delivery(*attempt));
            assert_eq!(kind(&plan), *want, "{what}");
        }
        let Some(RetryPlan::Quarantine { reason }) =
            paged(Some(2), None, Spent::Quarantine).plan(&Outcome::Retry, &delivery(2))
        else {
            panic!("a quarantine");
        };
        assert_eq!(reason, "attempts spent: 2 of 2 (attempts: 2)");
    }

    /// In place, an attempt not made (`NotAttempted`) runs again uncounted, even at the cap;
    /// where retries are copies it is a `Retry`: counted, and spent at the cap.
    #[test]
    fn an_attempt_not_made_is_not_counted_in_place_and_is_a_retry_with_copies() {
        let in_place = RetryPolicy {
            max_attempts: NonZeroU32::new(2),
            dead_letter: None,
            retry_stream: None,
            spent: Spent::Drop,
            in_place: true,
        };
        for attempt in [1, 2, 3] {
            assert!(
                matches!(
                    in_place.plan(&Outcome::NotAttempted, &delivery(attempt)),
                    Some(RetryPlan::Copy { counted: false, .. })
                ),
                "attempt {attempt} runs again uncounted"
            );
        }
        assert!(matches!(
            in_place.plan(&Outcome::Retry, &delivery(1)),
            Some(RetryPlan::Copy { counted: true, .. })
        ));
        assert_eq!(
            in_place.plan(&Outcome::Retry, &delivery(2)),
            Some(RetryPlan::Drop { attempts: 2 })
        );
        let copies = policy(Some(2), None);
        assert_eq!(
            copies.plan(&Outcome::NotAttempted, &delivery(1)),
            copies.plan(&Outcome::Retry, &delivery(1))
        );
        assert_eq!(
            copies.plan(&Outcome::NotAttempted, &delivery(2)),
            Some(RetryPlan::Drop { attempts: 2 })
        );
    }

    #[test]
    fn a_copy_counts_the_next_attempt_and_keeps_the_first_origin() {
        let Some(RetryPlan::Copy {
            stream,
            delay,
            headers,
            ..
        }) = policy(Some(5), None).plan(&Outcome::RetryAfter(Duration::from_secs(2)), &delivery(2))
        else {
            panic!("a copy");
        };
        assert_eq!((stream.as_str(), delay), ("orders", Duration::from_secs(2)));
        assert_eq!(headers.attempt(), 3);
        assert_eq!(headers.get_str(ORIGIN_SEQUENCE_HEADER), Some("42"));
        assert_eq!(
            headers.get_str(ORIGIN_SHARD_HEADER),
            Some("shardId-000000000001")
        );

        assert_eq!(
            headers.get_str(RETRY_COUNT_HEADER),
            Some("2"),
            "two retries before it"
        );

        // A copy of the copy keeps the first origin, not the copy's own position.
        let mut h = headers.clone();
        h.insert(RETRY_COUNT_HEADER, "2");
        let copy = Delivery::builder(
            "orders",
            "shardId-000000000009",
            Position::new(SequenceNumber::parse("99").unwrap(), 0),
        )
        .headers(h)
        .build();
        let Some(RetryPlan::Copy { headers, .. }) =
            policy(Some(5), None).plan(&Outcome::Retry, &copy)
        else {
            panic!("a copy");
        };
        assert_eq!(headers.attempt(), 4);
        assert_eq!(headers.get_str(ORIGIN_SEQUENCE_HEADER), Some("42"));
    }

    #[test]
    fn the_first_copy_carries_one_retry_as_ruststream_counts() {
        let Some(RetryPlan::Copy { headers, .. }) =
            policy(Some(3), None).plan(&Outcome::Retry, &delivery(1))
        else {
            panic!("a copy");
        };
        assert_eq!(headers.get_str(RETRY_COUNT_HEADER), Some("1"));
        assert_eq!(headers.attempt(), 2);
    }

    #[test]
    fn a_copy_of_an_older_builds_copy_counts_on_and_renames_its_origin() {
        // An older build's first copy: "2" meant attempt 2; origin under the ruststream prefix.
        let mut old = Headers::new();
        old.insert(RETRY_COUNT_HEADER, "2");
        for (legacy, _) in LEGACY_ORIGIN_HEADERS {
            old.insert(legacy, "first");
        }
        old.insert(LEGACY_ORIGIN_SEQUENCE_HEADER, "42");
        let copy = Delivery::builder(
            "orders",
            "shardId-000000000003",
            Position::new(SequenceNumber::parse("77").unwrap(), 0),
        )
        .headers(old)
        .build();
        assert_eq!(copy.attempt(), 2);
        let Some(RetryPlan::Copy { headers, .. }) =
            policy(Some(5), None).plan(&Outcome::Retry, &copy)
        else {
            panic!("a copy");
        };
        assert_eq!(
            headers.attempt(),
            3,
            "the next attempt, by the current rule"
        );
        assert_eq!(headers.get_str(RETRY_COUNT_HEADER), Some("2"));
        assert_eq!(
            headers.get_str(ORIGIN_SEQUENCE_HEADER),
            Some("42"),
            "the first origin kept"
        );
        for (legacy, _) in LEGACY_ORIGIN_HEADERS {
            assert!(headers.get(legacy).is_none(), "{legacy} renamed");
        }
    }

    #[test]
    fn a_dead_letter_carries_reason_attempts_and_every_header() {
        let mut d = delivery(3);
        let mut h = d.headers().clone();
        h.insert("tenant", "acme");
        d = Delivery::builder("orders", "s", *d.position())
            .headers(h)
            .payload("p")
            .build();
        let Some(RetryPlan::DeadLetter { stream, headers }) =
            policy(Some(3), Some("dlq")).plan(&Outcome::Retry, &d)
        else {
            panic!("dead letter");
        };
        assert_eq!(stream, "dlq");
        assert_eq!(headers.get_str("tenant"), Some("acme"));
        assert_eq!(headers.get_str(ATTEMPTS_HEADER), Some("3"));
        assert!(headers.get_str(DEAD_LETTER_REASON_HEADER).is_some());
        assert_eq!(
            headers.get_str(RETRY_COUNT_HEADER),
            Some("3"),
            "published like a copy: the dead letter of attempt 3 carries 3"
        );
    }
}
