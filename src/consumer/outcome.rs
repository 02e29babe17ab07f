//! What a handler's outcome becomes for its delivery: terminal outcomes settle at once; retries
//! follow the retry policy (a copy or dead letter to write first, a refusal that holds the
//! checkpoint, or a drop once attempts are spent). Pure, apart from logs and metrics.

use std::collections::HashSet;

use tracing::warn;

use super::config::Settings;
use super::copies::PendingWrite;
use super::lanes::Finished;
use crate::error::AckError;
use crate::handler::Outcome;
use crate::retry::{RetryPlan, RetryPolicy};
use crate::track::DeliveryId;

/// What a finished delivery needs next.
pub(crate) enum Resolved {
    /// Terminal: settle it now.
    Settle(DeliveryId),
    /// Refused retry: leave it unsettled.
    Hold,
    /// A copy or dead letter to write first; it settles once written.
    Write(PendingWrite),
}

/// Applies a handler's outcome: terminal outcomes settle; retries follow the retry policy.
pub(crate) fn resolve(
    done: Finished,
    policy: &RetryPolicy,
    refused: &mut HashSet<DeliveryId>,
    settings: &Settings,
) -> Resolved {
    let Some(id) = done.delivery.id() else {
        return Resolved::Hold;
    };
    let outcome_label = match done.outcome {
        Outcome::Ack => "ack",
        Outcome::Drop => "drop",
        Outcome::Retry => "retry",
        Outcome::RetryAfter(_) => "retry_after",
    };
    metrics::counter!("shardwise_records_total", "stream" => settings.stream.clone(), "outcome" => outcome_label).increment(1);
    let d = done.delivery;
    match policy.plan(done.outcome, &d) {
        None => Resolved::Settle(id),
        Some(RetryPlan::Refuse) => {
            let err = AckError::Unsupported {
                reason: "declare max_attempts or a dead-letter stream to retry on Kinesis",
            };
            if refused.insert(id) {
                metrics::counter!("shardwise_retries_refused_total", "stream" => settings.stream.clone()).increment(1);
                warn!(
                    stream = d.stream(),
                    shard = d.shard(),
                    seq = %d.position(),
                    partition_key = d.partition_key(),
                    error = %err,
                    "retry refused: the record stays unsettled and holds the checkpoint; the next owner rereads it"
                );
            }
            Resolved::Hold
        }
        Some(RetryPlan::Drop { attempts }) => {
            warn!(
                stream = d.stream(),
                shard = d.shard(),
                seq = %d.position(),
                partition_key = d.partition_key(),
                attempts,
                "attempts spent and no dead-letter stream: settled as a drop"
            );
            Resolved::Settle(id)
        }
        Some(plan @ (RetryPlan::Copy { .. } | RetryPlan::DeadLetter { .. })) => {
            match PendingWrite::new(id, d, plan) {
                Some(write) => Resolved::Write(write),
                None => Resolved::Hold,
            }
        }
    }
}
