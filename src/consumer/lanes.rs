//! Lanes: the tasks that run the handler. Each lane runs its deliveries one at a time, in the order
//! it received them; with per-key ordering a key always maps to the same lane.

use std::hash::BuildHasher;
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
}

/// The same in every process of one build, so a key keeps its lane across restarts.
fn key_hash(key: &str) -> u64 {
    std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default()
        .hash_one(key)
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
            senders,
            ordering,
            tasks,
        }
    }

    /// The lane a partition key runs on (with per-key ordering).
    pub(crate) fn lane_of(&self, partition_key: &str) -> usize {
        match self.ordering {
            Ordering::PerKey => (key_hash(partition_key) % self.senders.len() as u64) as usize,
            Ordering::None => 0,
        }
    }

    /// Queues a delivery on its lane (see [`Lanes::lane_of`]).
    pub(crate) fn dispatch(&self, delivery: Delivery) {
        let lane = match self.ordering {
            Ordering::PerKey => delivery.lane(),
            Ordering::None => 0,
        };
        // A closed lane means the shard is being torn down; the delivery stays unsettled.
        let _ = self.senders[lane].send(delivery);
    }

    /// Stops accepting work; lanes finish what they have queued and then end.
    pub(crate) fn close(&mut self) {
        self.senders.clear();
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
            seq = %delivery.position(),
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
                    seq = %delivery.position(),
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
