//! Lanes: the tasks that run the handler. Each lane runs its deliveries one at a time, in the order
//! it received them.
//!
//! With per-key ordering, a key that has deliveries queued or running stays on the lane that has
//! them, so its deliveries run one at a time in shard order; a key with nothing in flight goes to
//! the lane with the fewest deliveries queued. Static hashing would leave lanes unevenly loaded
//! (64 keys over 8 lanes by hash gave 5.3 times one lane's throughput; by load, see
//! `benches/consumer.rs`).

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures::FutureExt;
use tokio::sync::{Mutex, mpsc};
use tokio::task::JoinSet;
use tracing::{Instrument, error, info_span};

use super::config::Ordering;
use crate::handler::{Delivery, Handler, Outcome};

/// A delivery the handler finished with, and what it decided.
#[derive(Debug)]
pub(crate) struct Finished {
    pub(crate) delivery: Delivery,
    pub(crate) outcome: Outcome,
}

/// The lanes of one shard. Dropping them aborts every running handler.
#[derive(Debug)]
pub(crate) struct Lanes {
    senders: Vec<mpsc::UnboundedSender<Delivery>>,
    ordering: Ordering,
    tasks: JoinSet<()>,
    /// Per-key ordering: the lane of each key with deliveries in flight, and how many.
    active: HashMap<String, (usize, usize)>,
    /// Deliveries queued or running per lane.
    load: Vec<usize>,
}

impl Lanes {
    pub(crate) fn start<H: Handler>(
        count: usize,
        ordering: Ordering,
        handler: Arc<H>,
        finished: mpsc::UnboundedSender<Finished>,
    ) -> Self {
        let mut tasks = JoinSet::new();
        let mut senders = Vec::new();
        match ordering {
            Ordering::PerKey => {
                for _ in 0..count {
                    let (tx, rx) = mpsc::unbounded_channel();
                    senders.push(tx);
                    tasks.spawn(run_lane(
                        Arc::new(Mutex::new(rx)),
                        handler.clone(),
                        finished.clone(),
                    ));
                }
            }
            Ordering::None => {
                let (tx, rx) = mpsc::unbounded_channel();
                senders.push(tx);
                let shared = Arc::new(Mutex::new(rx));
                for _ in 0..count {
                    tasks.spawn(run_lane(shared.clone(), handler.clone(), finished.clone()));
                }
            }
        }
        Self {
            load: vec![0; count],
            senders,
            ordering,
            tasks,
            active: HashMap::new(),
        }
    }

    /// Picks the lane for the next delivery of `partition_key` and counts it in flight there: the
    /// key's lane while it has deliveries in flight, otherwise the least loaded lane.
    pub(crate) fn assign(&mut self, partition_key: &str) -> usize {
        let lane = match self.ordering {
            Ordering::None => 0,
            Ordering::PerKey => match self.active.get_mut(partition_key) {
                Some((lane, n)) => {
                    *n += 1;
                    *lane
                }
                None => {
                    let lane = (0..self.load.len())
                        .min_by_key(|l| self.load[*l])
                        .unwrap_or(0);
                    self.active.insert(partition_key.to_string(), (lane, 1));
                    lane
                }
            },
        };
        if let Some(load) = self.load.get_mut(lane) {
            *load += 1;
        }
        lane
    }

    /// A delivery assigned by [`Lanes::assign`] finished on its lane.
    pub(crate) fn finished(&mut self, delivery: &Delivery) {
        if let Some(load) = self.load.get_mut(delivery.lane()) {
            *load = load.saturating_sub(1);
        }
        if let Some((_, n)) = self.active.get_mut(delivery.partition_key()) {
            *n -= 1;
            if *n == 0 {
                self.active.remove(delivery.partition_key());
            }
        }
    }

    /// Queues a delivery again (its hold was released): on the lane its key has deliveries on now,
    /// if any, so the key still runs one delivery at a time.
    pub(crate) fn redispatch(&mut self, delivery: Delivery) {
        let lane = self.assign(delivery.partition_key());
        self.dispatch(delivery.on_lane(lane));
    }

    /// Queues a delivery on the lane [`Lanes::assign`] gave it. Lanes take work until they are
    /// aborted, also once the shard reads no more: a held delivery released then runs again.
    pub(crate) fn dispatch(&self, delivery: Delivery) {
        let lane = match self.ordering {
            Ordering::PerKey => delivery.lane(),
            Ordering::None => 0,
        };
        // No lane means the shard is being torn down; the delivery stays unsettled.
        if let Some(sender) = self.senders.get(lane) {
            let _ = sender.send(delivery);
        }
    }

    /// Aborts every running handler (their deliveries stay unsettled).
    pub(crate) fn abort(&mut self) {
        self.senders.clear();
        self.tasks.abort_all();
    }
}

async fn run_lane<H: Handler>(
    queue: Arc<Mutex<mpsc::UnboundedReceiver<Delivery>>>,
    handler: Arc<H>,
    finished: mpsc::UnboundedSender<Finished>,
) {
    loop {
        let next = queue.lock().await.recv().await;
        let Some(delivery) = next else { return };
        let span = info_span!(
            "delivery",
            stream = delivery.stream(),
            shard = delivery.shard(),
            seq = %delivery.locator(),
            attempt = delivery.attempt(),
            lane = delivery.lane(),
        );
        let outcome = AssertUnwindSafe(handler.handle(delivery.clone()))
            .catch_unwind()
            .instrument(span)
            .await
            .unwrap_or_else(|panic| {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "non-string panic".into());
                error!(
                    stream = delivery.stream(),
                    shard = delivery.shard(),
                    seq = %delivery.locator(),
                    partition_key = delivery.partition_key(),
                    panic = %what,
                    "handler panicked: treated as retry"
                );
                Outcome::Retry
            });
        if finished.send(Finished { delivery, outcome }).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Position, SequenceNumber};

    fn delivery(key: &str, lane: usize) -> Delivery {
        Delivery::builder(
            "s",
            "shard",
            Position::new(SequenceNumber::parse("1").unwrap(), 0),
        )
        .partition_key(key)
        .lane(lane)
        .build()
    }

    #[tokio::test]
    async fn a_key_stays_on_its_lane_while_in_flight_and_new_keys_go_to_the_least_loaded() {
        let (tx, _rx) = mpsc::unbounded_channel();
        let handler = Arc::new(|_d: Delivery| async { Outcome::Ack });
        let mut lanes = Lanes::start(3, Ordering::PerKey, handler, tx);
        let a = lanes.assign("a");
        assert_eq!(lanes.assign("a"), a, "in flight: same lane");
        let b = lanes.assign("b");
        let c = lanes.assign("c");
        let mut used = vec![a, b, c];
        used.sort();
        assert_eq!(
            used,
            [0, 1, 2],
            "new keys spread over the least loaded lanes"
        );
        // "a" has two in flight on its lane: the next new key avoids it.
        lanes.finished(&delivery("b", b));
        assert_ne!(lanes.assign("d"), a);
        // Once all of "a" finished, it may move.
        lanes.finished(&delivery("a", a));
        lanes.finished(&delivery("a", a));
        assert!(!lanes.active.contains_key("a"));
        lanes.abort();
    }
}
