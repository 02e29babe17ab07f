//! A lease store in front of another, for tests that count, delay, gate or hide what the store
//! behind does: [`Layered`] forwards every call through one hook, [`Layer::around`], which sees
//! the call ([`Call`]: the method and its arguments) and decides how the forwarded call runs.
//! A test writes the one or two things it changes, not the eighteen methods of [`LeaseStore`].
//!
//! ```
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use futures::future::BoxFuture;
//! use shardwise::lease::{LeaseStore, MemoryLeaseStore};
//! use shardwise::testing::{Call, Layer, Layered};
//!
//! /// Counts the lease table scans.
//! #[derive(Debug, Default)]
//! struct Scans(AtomicU64);
//!
//! impl Layer for Scans {
//!     fn around<'a, T: Send + 'static>(
//!         &'a self,
//!         call: Call<'a>,
//!         forward: BoxFuture<'a, Result<T, shardwise::Error>>,
//!     ) -> BoxFuture<'a, Result<T, shardwise::Error>> {
//!         if matches!(call, Call::List { .. }) {
//!             self.0.fetch_add(1, Ordering::Relaxed);
//!         }
//!         forward
//!     }
//! }
//!
//! # futures::executor::block_on(async {
//! let store = Layered::new(Arc::new(MemoryLeaseStore::new()), Scans::default());
//! store.list("orders").await.unwrap();
//! assert_eq!(store.layer().0.load(Ordering::Relaxed), 1);
//! # });
//! ```

use std::fmt;
use std::sync::Arc;

use futures::future::BoxFuture;

use crate::error::Error;
use crate::frontier::Membership;
use crate::lease::{
    Checkpoint, CheckpointWrite, Lease, LeaseStore, NewLease, Ownership, Renewal, Roster, SeekMove,
};
use crate::paged::PagedProgress;

/// One call of a [`LeaseStore`] method, with its arguments, as [`Layer::around`] sees it.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
#[allow(missing_docs)] // Each variant is the method of its name, with that method's arguments.
pub enum Call<'a> {
    Prepare,
    List {
        stream: &'a str,
    },
    Get {
        stream: &'a str,
        shard_id: &'a str,
    },
    Create(&'a NewLease),
    Take {
        seen: &'a Lease,
        owner: &'a str,
    },
    Renew(&'a Ownership),
    Checkpoint {
        held: &'a Ownership,
        to: &'a Checkpoint,
        complete_through: Option<i64>,
    },
    PagedCheckpoint {
        held: &'a Ownership,
        expected: &'a PagedProgress,
        to: &'a PagedProgress,
    },
    Release(&'a Ownership),
    Retire {
        held: &'a Ownership,
        at: i64,
    },
    Seek(&'a [SeekMove]),
    AdvanceFrontier {
        held: &'a Ownership,
        complete_through: i64,
    },
    Delete(&'a Lease),
    SetChildren {
        stream: &'a str,
        shard_id: &'a str,
        children: &'a [String],
    },
    Request {
        seen: &'a Lease,
        taker: &'a str,
    },
    Pass {
        held: &'a Ownership,
        taker: &'a str,
    },
    Beat {
        stream: &'a str,
        section: u32,
        worker: &'a str,
        announce: bool,
    },
    Forget {
        stream: &'a str,
        section: u32,
        worker: &'a str,
        seen: Option<u64>,
    },
    Acknowledge {
        held: &'a Ownership,
        taker: &'a str,
    },
    ReadRoster {
        stream: &'a str,
        sections: &'a [u32],
    },
    SplitRoster {
        stream: &'a str,
        from: u32,
        to: u32,
    },
    Membership {
        stream: &'a str,
    },
    PublishMembership {
        stream: &'a str,
        expected: Option<u64>,
        next: &'a Membership,
    },
}

impl Call<'_> {
    /// The method's name, as `LeaseStore` spells it (`"checkpoint"`, `"paged_checkpoint"`).
    pub fn method(&self) -> &'static str {
        match self {
            Call::Prepare => "prepare",
            Call::List { .. } => "list",
            Call::Get { .. } => "get",
            Call::Create(_) => "create",
            Call::Take { .. } => "take",
            Call::Renew(_) => "renew",
            Call::Checkpoint { .. } => "checkpoint",
            Call::PagedCheckpoint { .. } => "paged_checkpoint",
            Call::Release(_) => "release",
            Call::Retire { .. } => "retire",
            Call::Seek(_) => "seek",
            Call::AdvanceFrontier { .. } => "advance_frontier",
            Call::Delete(_) => "delete",
            Call::SetChildren { .. } => "set_children",
            Call::Request { .. } => "request",
            Call::Pass { .. } => "pass",
            Call::Beat { .. } => "beat",
            Call::Forget { .. } => "forget",
            Call::ReadRoster { .. } => "read_roster",
            Call::Acknowledge { .. } => "acknowledge",
            Call::SplitRoster { .. } => "split_roster",
            Call::Membership { .. } => "membership",
            Call::PublishMembership { .. } => "publish_membership",
        }
    }
}

/// What a [`Layered`] store does around the store behind it. Both methods default to changing
/// nothing.
pub trait Layer: Send + Sync + fmt::Debug + 'static {
    /// Runs `forward` (the same call on the store behind) for `call`: as it is by default; a
    /// layer may wait first, count, never finish, fail instead, or look at the answer (`T` is the
    /// method's answer type: downcast it through `&dyn Any` to read it).
    fn around<'a, T: Send + 'static>(
        &'a self,
        call: Call<'a>,
        forward: BoxFuture<'a, Result<T, Error>>,
    ) -> BoxFuture<'a, Result<T, Error>> {
        let _ = call;
        forward
    }

    /// A row as `list` and `get` show it: `None` hides it. By default as stored.
    fn view(&self, row: Lease) -> Option<Lease> {
        Some(row)
    }
}

/// A lease store that forwards every call to `inner` through its [`Layer`].
#[derive(Debug)]
pub struct Layered<L> {
    inner: Arc<dyn LeaseStore>,
    layer: L,
}

impl<L: Layer> Layered<L> {
    /// `inner` behind `layer`.
    pub fn new(inner: Arc<dyn LeaseStore>, layer: L) -> Self {
        Self { inner, layer }
    }

    /// The layer, to read what it recorded or change what it does.
    pub fn layer(&self) -> &L {
        &self.layer
    }

    /// The store behind.
    pub fn inner(&self) -> &Arc<dyn LeaseStore> {
        &self.inner
    }
}

impl<L: Layer> LeaseStore for Layered<L> {
    fn prepare(&self) -> BoxFuture<'_, Result<(), Error>> {
        self.layer.around(Call::Prepare, self.inner.prepare())
    }

    fn list<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<Vec<Lease>, Error>> {
        let forward = Box::pin(async move {
            let rows = self.inner.list(stream).await?;
            Ok(rows
                .into_iter()
                .filter_map(|r| self.layer.view(r))
                .collect())
        });
        self.layer.around(Call::List { stream }, forward)
    }

    fn get<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Lease>, Error>> {
        let forward = Box::pin(async move {
            let row = self.inner.get(stream, shard_id).await?;
            Ok(row.and_then(|r| self.layer.view(r)))
        });
        self.layer.around(Call::Get { stream, shard_id }, forward)
    }

    fn create<'a>(&'a self, lease: &'a NewLease) -> BoxFuture<'a, Result<bool, Error>> {
        self.layer
            .around(Call::Create(lease), self.inner.create(lease))
    }

    fn take<'a>(
        &'a self,
        seen: &'a Lease,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Option<Lease>, Error>> {
        self.layer
            .around(Call::Take { seen, owner }, self.inner.take(seen, owner))
    }

    fn renew<'a>(&'a self, held: &'a Ownership) -> BoxFuture<'a, Result<Renewal, Error>> {
        self.layer.around(Call::Renew(held), self.inner.renew(held))
    }

    fn checkpoint<'a>(
        &'a self,
        held: &'a Ownership,
        to: &'a Checkpoint,
        complete_through: Option<i64>,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        let call = Call::Checkpoint {
            held,
            to,
            complete_through,
        };
        self.layer
            .around(call, self.inner.checkpoint(held, to, complete_through))
    }

    fn checkpoint_window<'a>(
        &'a self,
        held: &'a Ownership,
        to: &'a Checkpoint,
        complete_through: Option<i64>,
        window: Option<&'a crate::window::WindowState>,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        let call = Call::Checkpoint {
            held,
            to,
            complete_through,
        };
        self.layer.around(
            call,
            self.inner
                .checkpoint_window(held, to, complete_through, window),
        )
    }

    fn paged_checkpoint<'a>(
        &'a self,
        held: &'a Ownership,
        expected: &'a PagedProgress,
        to: &'a PagedProgress,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        let call = Call::PagedCheckpoint { held, expected, to };
        self.layer
            .around(call, self.inner.paged_checkpoint(held, expected, to))
    }

    fn release<'a>(&'a self, held: &'a Ownership) -> BoxFuture<'a, Result<bool, Error>> {
        self.layer
            .around(Call::Release(held), self.inner.release(held))
    }

    fn retire<'a>(&'a self, held: &'a Ownership, at: i64) -> BoxFuture<'a, Result<bool, Error>> {
        self.layer
            .around(Call::Retire { held, at }, self.inner.retire(held, at))
    }

    fn seek<'a>(&'a self, moves: &'a [SeekMove]) -> BoxFuture<'a, Result<bool, Error>> {
        self.layer.around(Call::Seek(moves), self.inner.seek(moves))
    }

    fn advance_frontier<'a>(
        &'a self,
        held: &'a Ownership,
        complete_through: i64,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        let call = Call::AdvanceFrontier {
            held,
            complete_through,
        };
        self.layer
            .around(call, self.inner.advance_frontier(held, complete_through))
    }

    fn delete<'a>(&'a self, seen: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        self.layer
            .around(Call::Delete(seen), self.inner.delete(seen))
    }

    fn set_children<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
        children: &'a [String],
    ) -> BoxFuture<'a, Result<(), Error>> {
        let call = Call::SetChildren {
            stream,
            shard_id,
            children,
        };
        self.layer
            .around(call, self.inner.set_children(stream, shard_id, children))
    }

    fn request<'a>(
        &'a self,
        seen: &'a Lease,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.layer.around(
            Call::Request { seen, taker },
            self.inner.request(seen, taker),
        )
    }

    fn pass<'a>(
        &'a self,
        held: &'a Ownership,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.layer
            .around(Call::Pass { held, taker }, self.inner.pass(held, taker))
    }

    fn beat<'a>(
        &'a self,
        stream: &'a str,
        section: u32,
        worker: &'a str,
        beat: u64,
        announce: bool,
    ) -> BoxFuture<'a, Result<Roster, Error>> {
        let call = Call::Beat {
            stream,
            section,
            worker,
            announce,
        };
        self.layer.around(
            call,
            self.inner.beat(stream, section, worker, beat, announce),
        )
    }

    fn forget<'a>(
        &'a self,
        stream: &'a str,
        section: u32,
        worker: &'a str,
        seen: Option<u64>,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        let call = Call::Forget {
            stream,
            section,
            worker,
            seen,
        };
        self.layer
            .around(call, self.inner.forget(stream, section, worker, seen))
    }

    fn acknowledge<'a>(
        &'a self,
        held: &'a Ownership,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.layer.around(
            Call::Acknowledge { held, taker },
            self.inner.acknowledge(held, taker),
        )
    }

    fn read_roster<'a>(
        &'a self,
        stream: &'a str,
        sections: &'a [u32],
    ) -> BoxFuture<'a, Result<Vec<Roster>, Error>> {
        self.layer.around(
            Call::ReadRoster { stream, sections },
            self.inner.read_roster(stream, sections),
        )
    }

    fn split_roster<'a>(
        &'a self,
        stream: &'a str,
        from: u32,
        to: u32,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        self.layer.around(
            Call::SplitRoster { stream, from, to },
            self.inner.split_roster(stream, from, to),
        )
    }

    fn membership<'a>(
        &'a self,
        stream: &'a str,
    ) -> BoxFuture<'a, Result<Option<Membership>, Error>> {
        self.layer
            .around(Call::Membership { stream }, self.inner.membership(stream))
    }

    fn publish_membership<'a>(
        &'a self,
        stream: &'a str,
        expected: Option<u64>,
        next: &'a Membership,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        let call = Call::PublishMembership {
            stream,
            expected,
            next,
        };
        self.layer
            .around(call, self.inner.publish_membership(stream, expected, next))
    }
}
