//! Recording handler calls: one recorder for every test binary (memory ones include this file
//! alone; live ones reach it as `support::calls`).

#![allow(dead_code, unreachable_pub)]

use std::sync::{Arc, Mutex};

use shardwise::Delivery;

/// A delivery's name in a test: a paged event's own id, else its payload as text.
pub fn id_of(d: &Delivery) -> String {
    d.paged_event_id().map_or_else(
        || String::from_utf8_lossy(d.payload()).into_owned(),
        str::to_string,
    )
}

/// Every handler call, in the order the calls began: (worker, [`id_of`] the delivery, attempt).
#[derive(Debug, Default, Clone)]
pub struct Calls(Arc<Mutex<Vec<(String, String, u32)>>>);

impl Calls {
    /// Records a call of `worker`'s handler (`""` when the test runs one worker).
    pub fn push(&self, worker: &str, d: &Delivery) {
        self.0
            .lock()
            .unwrap()
            .push((worker.to_string(), id_of(d), d.attempt()));
    }

    pub fn all(&self) -> Vec<(String, String, u32)> {
        self.0.lock().unwrap().clone()
    }

    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    /// The ids handled, one per call.
    pub fn ids(&self) -> Vec<String> {
        self.all().into_iter().map(|(_, id, _)| id).collect()
    }

    /// The ids `worker` handled, one per call.
    pub fn of(&self, worker: &str) -> Vec<String> {
        self.all()
            .into_iter()
            .filter(|(w, ..)| w == worker)
            .map(|(_, id, _)| id)
            .collect()
    }

    /// How many times `id` was handled.
    pub fn count(&self, id: &str) -> usize {
        self.0.lock().unwrap().iter().filter(|c| c.1 == id).count()
    }

    /// Where in [`all`](Self::all) the call of `id`'s `attempt` is (panics, listing every call,
    /// when there is none).
    pub fn at(&self, id: &str, attempt: u32) -> usize {
        let all = self.all();
        all.iter()
            .position(|(_, i, a)| i == id && *a == attempt)
            .unwrap_or_else(|| panic!("{id} attempt {attempt} in {all:?}"))
    }
}
