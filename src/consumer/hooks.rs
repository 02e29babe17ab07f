//! Delivery hooks: told how each delivery settled, on the shard's task (keep them quick).

use crate::handler::Delivery;

/// How a delivery settled: what made its outcome durable.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settled {
    /// Acknowledged.
    Acked,
    /// Dropped (a poison record passes).
    Dropped,
    /// A retry copy was written to this stream.
    Copied(String),
    /// A dead letter was written to this stream.
    DeadLettered(String),
    /// Its attempts were spent and there is no dead-letter stream: dropped.
    Spent,
    /// Its effects were committed with its receipt.
    Applied,
    /// A terminal receipt already existed: nothing was written again (a replay).
    Replayed,
    /// A terminal quarantine receipt was recorded.
    Quarantined,
    /// Its held receipt was made terminal by someone else (an operator).
    Resolved,
}

/// Called as deliveries settle; every method has a no-op default.
///
/// Any `Fn(&Delivery, &Settled)` closure is a hook:
///
/// ```
/// use shardwise::consumer::{DeliveryHooks, Settled};
/// use shardwise::Delivery;
/// fn assert_hooks<H: DeliveryHooks>(_: H) {}
/// assert_hooks(|d: &Delivery, how: &Settled| {
///     if *how == Settled::Replayed {
///         println!("{} was a replay", d.event_id());
///     }
/// });
/// ```
pub trait DeliveryHooks: Send + Sync + 'static {
    /// A delivery settled: the checkpoint may pass it.
    fn settled(&self, _delivery: &Delivery, _how: &Settled) {}
}

impl DeliveryHooks for () {}

impl<F> DeliveryHooks for F
where
    F: Fn(&Delivery, &Settled) + Send + Sync + 'static,
{
    fn settled(&self, delivery: &Delivery, how: &Settled) {
        self(delivery, how)
    }
}
