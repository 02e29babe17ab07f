//! What a handler's outcome becomes for its delivery: terminal outcomes settle at once; retries
//! follow the retry policy (a copy or dead letter to write first, a refusal that holds the
//! checkpoint, or a drop once attempts are spent); receipt outcomes go to the ledger. Pure, apart
//! from logs and metrics.

use std::collections::HashSet;

use tracing::{error, warn};

use super::config::Settings;
use super::copies::PendingWrite;
use super::hooks::Settled;
use crate::error::AckError;
use crate::handler::{Delivery, Outcome};
use crate::receipts::{Disposition, Effects};
use crate::retry::{RetryPlan, RetryPolicy};
use crate::track::DeliveryId;

/// What a finished delivery needs next.
pub(crate) enum Resolved {
    /// Terminal: settle it now.
    Settle(DeliveryId, Delivery, Settled),
    /// Refused: leave it unsettled (it holds the checkpoint; the next owner rereads it).
    Hold,
    /// A copy or dead letter to write first; it settles once written.
    Write(PendingWrite),
    /// Effects to commit with the event's receipt; it settles once committed.
    Apply(DeliveryId, Delivery, Effects),
    /// A receipt to record (quarantine: it settles once recorded; hold: it stays unsettled).
    Record(DeliveryId, Delivery, Disposition),
}

/// Applies a handler's outcome. `receipts`: whether a receipt ledger is configured.
pub(crate) fn resolve(
    delivery: Delivery,
    outcome: Outcome,
    policy: &RetryPolicy,
    refused: &mut HashSet<DeliveryId>,
    settings: &Settings,
    receipts: bool,
) -> Resolved {
    let Some(id) = delivery.id() else {
        return Resolved::Hold;
    };
    let d = delivery;
    match outcome {
        // A source that can hand the event out again after a restart: with a ledger, an ack or a
        // drop leaves a receipt too (no effects), so a later attempt knows it without the handler.
        Outcome::Ack | Outcome::Drop
            if receipts && d.replayable() != crate::handler::Replayable::No =>
        {
            return Resolved::Apply(id, d, crate::receipts::Effects::new());
        }
        Outcome::Ack => return Resolved::Settle(id, d, Settled::Acked),
        Outcome::Drop => return Resolved::Settle(id, d, Settled::Dropped),
        Outcome::Apply(_) | Outcome::Quarantine(_) | Outcome::Hold(_) if !receipts => {
            if refused.insert(id) {
                error!(
                    stream = d.stream(),
                    shard = d.shard(),
                    seq = %d.locator(),
                    outcome = outcome.label(),
                    "the handler answered with a receipt outcome but the consumer has no receipt ledger (ConsumerBuilder::receipts): the record stays unsettled and holds the checkpoint"
                );
            }
            return Resolved::Hold;
        }
        Outcome::Apply(effects) => return Resolved::Apply(id, d, effects),
        Outcome::Quarantine(reason) => {
            return Resolved::Record(id, d, Disposition::Quarantined(reason));
        }
        Outcome::Hold(reason) => return Resolved::Record(id, d, Disposition::Held(reason)),
        _ => {}
    }
    match policy.plan(&outcome, &d) {
        None => Resolved::Settle(id, d, Settled::Acked),
        Some(RetryPlan::Refuse) => {
            let err = AckError::Unsupported {
                reason: "declare max_attempts or a dead-letter stream to retry on Kinesis",
            };
            if refused.insert(id) {
                metrics::counter!("shardwise_retries_refused_total", "stream" => settings.stream.clone()).increment(1);
                warn!(
                    stream = d.stream(),
                    shard = d.shard(),
                    seq = %d.locator(),
                    partition_key = d.partition_key(),
                    error = &err as &dyn std::error::Error,
                    "retry refused: the record stays unsettled and holds the checkpoint; the next owner rereads it"
                );
            }
            Resolved::Hold
        }
        Some(RetryPlan::Quarantine { reason }) => {
            Resolved::Record(id, d, Disposition::Quarantined(reason))
        }
        Some(RetryPlan::Drop { attempts }) => {
            warn!(
                stream = d.stream(),
                shard = d.shard(),
                seq = %d.locator(),
                partition_key = d.partition_key(),
                attempts,
                "attempts spent and no dead-letter stream: settled as a drop"
            );
            Resolved::Settle(id, d, Settled::Spent)
        }
        Some(plan @ (RetryPlan::Copy { .. } | RetryPlan::DeadLetter { .. })) => {
            match PendingWrite::new(id, d, plan) {
                Some(write) => Resolved::Write(write),
                None => Resolved::Hold,
            }
        }
    }
}
