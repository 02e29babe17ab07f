//! What a retry becomes on Kinesis, which cannot hand one record back and counts no deliveries:
//! a counted copy on the stream, a dead letter, a drop, or a refusal. Pure.
//!
//! | outcome | policy | attempt | becomes |
//! |---|---|---|---|
//! | `Retry` | neither `max_attempts` nor a dead-letter stream | any | refused: holds the checkpoint |
//! | `Retry` / `RetryAfter(d)` | below the cap | n | copy with count n+1 (after d) |
//! | `Retry` / `RetryAfter(d)` | at the cap, dead-letter stream | n | dead letter |
//! | `Retry` / `RetryAfter(d)` | at the cap, no dead-letter stream | n | settles as drop (warn) |
//!
//! Without `max_attempts` the cap is [`DEFAULT_MAX_ATTEMPTS`], so a poison record answered with
//! `RetryAfter` is not copied forever.

use std::num::NonZeroU32;
use std::time::Duration;

use crate::envelope::{Headers, RETRY_COUNT_HEADER};
use crate::handler::{Delivery, Outcome};

/// The cap on attempts (the first delivery counts) when `max_attempts` is not declared: for a
/// dead-letter stream alone, and for `RetryAfter`.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;

/// Names the stream the event was first read from (kept across copies).
pub const ORIGIN_STREAM_HEADER: &str = "x-ruststream-origin-stream";
/// Names the shard the event was first read from.
pub const ORIGIN_SHARD_HEADER: &str = "x-ruststream-origin-shard";
/// Names the sequence number the event first had.
pub const ORIGIN_SEQUENCE_HEADER: &str = "x-ruststream-origin-sequence";
/// Names the KPL sub-sequence the event first had.
pub const ORIGIN_SUB_SEQUENCE_HEADER: &str = "x-ruststream-origin-subsequence";
/// Why a record was dead-lettered.
pub const DEAD_LETTER_REASON_HEADER: &str = "x-ruststream-dead-letter-reason";
/// How many attempts a dead-lettered record had.
pub const ATTEMPTS_HEADER: &str = "x-ruststream-attempts";

/// The retry policy of a consumer.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct RetryPolicy {
    pub(crate) max_attempts: Option<NonZeroU32>,
    pub(crate) dead_letter: Option<String>,
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
    },
    /// Write to the dead-letter stream; settle once it is written.
    DeadLetter { stream: String, headers: Headers },
    /// Attempts spent and no dead-letter stream: settle as a drop.
    Drop { attempts: u32 },
}

impl RetryPolicy {
    fn cap(&self) -> u32 {
        self.max_attempts
            .map_or(DEFAULT_MAX_ATTEMPTS, NonZeroU32::get)
    }

    /// Decides what a retry outcome becomes. `None` for terminal outcomes.
    pub(crate) fn plan(&self, outcome: Outcome, delivery: &Delivery) -> Option<RetryPlan> {
        let delay = match outcome {
            Outcome::Ack | Outcome::Drop => return None,
            Outcome::Retry => Duration::ZERO,
            Outcome::RetryAfter(d) => d,
        };
        let declared = self.max_attempts.is_some() || self.dead_letter.is_some();
        if matches!(outcome, Outcome::Retry) && !declared {
            return Some(RetryPlan::Refuse);
        }
        let attempt = delivery.attempt();
        let mut headers = delivery.headers().clone();
        stamp_origin(&mut headers, delivery);
        if attempt < self.cap() {
            headers.insert(RETRY_COUNT_HEADER, (attempt.saturating_add(1)).to_string());
            return Some(RetryPlan::Copy {
                stream: delivery.stream().to_string(),
                delay,
                headers,
            });
        }
        Some(self.spent(
            delivery,
            format!("attempts spent: {attempt} of {}", self.cap()),
        ))
    }

    /// What a delivery whose retries are over becomes: a dead letter carrying `reason`, or a drop
    /// without a dead-letter stream.
    pub(crate) fn spent(&self, delivery: &Delivery, reason: String) -> RetryPlan {
        let attempt = delivery.attempt();
        match &self.dead_letter {
            Some(stream) => {
                let mut headers = delivery.headers().clone();
                stamp_origin(&mut headers, delivery);
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

/// Names the first read of the event, so it keeps one identity across copies.
fn stamp_origin(headers: &mut Headers, d: &Delivery) {
    if headers.get(ORIGIN_SEQUENCE_HEADER).is_some() {
        return;
    }
    headers.insert(ORIGIN_STREAM_HEADER, d.stream().to_string());
    headers.insert(ORIGIN_SHARD_HEADER, d.shard().to_string());
    headers.insert(ORIGIN_SEQUENCE_HEADER, d.sequence_number().to_string());
    headers.insert(ORIGIN_SUB_SEQUENCE_HEADER, d.sub_sequence().to_string());
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
        }
    }

    fn kind(plan: &Option<RetryPlan>) -> &'static str {
        match plan {
            None => "terminal",
            Some(RetryPlan::Refuse) => "refuse",
            Some(RetryPlan::Copy { .. }) => "copy",
            Some(RetryPlan::DeadLetter { .. }) => "dead-letter",
            Some(RetryPlan::Drop { .. }) => "drop",
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
            let plan = policy(*max, *dl).plan(*outcome, &delivery(*attempt));
            assert_eq!(kind(&plan), *want, "{what}");
        }
    }

    #[test]
    fn a_copy_counts_the_next_attempt_and_keeps_the_first_origin() {
        let Some(RetryPlan::Copy {
            stream,
            delay,
            headers,
        }) = policy(Some(5), None).plan(Outcome::RetryAfter(Duration::from_secs(2)), &delivery(2))
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

        // A copy of the copy keeps the first origin, not the copy's own position.
        let mut h = headers.clone();
        h.insert(RETRY_COUNT_HEADER, "3");
        let copy = Delivery::builder(
            "orders",
            "shardId-000000000009",
            Position::new(SequenceNumber::parse("99").unwrap(), 0),
        )
        .headers(h)
        .build();
        let Some(RetryPlan::Copy { headers, .. }) =
            policy(Some(5), None).plan(Outcome::Retry, &copy)
        else {
            panic!("a copy");
        };
        assert_eq!(headers.attempt(), 4);
        assert_eq!(headers.get_str(ORIGIN_SEQUENCE_HEADER), Some("42"));
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
            policy(Some(3), Some("dlq")).plan(Outcome::Retry, &d)
        else {
            panic!("dead letter");
        };
        assert_eq!(stream, "dlq");
        assert_eq!(headers.get_str("tenant"), Some("acme"));
        assert_eq!(headers.get_str(ATTEMPTS_HEADER), Some("3"));
        assert!(headers.get_str(DEAD_LETTER_REASON_HEADER).is_some());
        assert_eq!(
            headers.attempt(),
            3,
            "the count is the attempt that was spent"
        );
    }
}
