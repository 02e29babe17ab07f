//! The receipt ledger in memory, with the tables its effects write: the same conditions and
//! answers as [`DynamoDbReceipts`](super::DynamoDbReceipts), for tests and simulations.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use aws_sdk_dynamodb::types::AttributeValue;
use futures::future::BoxFuture;

use super::effect::{Change, Effect, Expect, Item};
use super::{
    Apply, Committed, Disposition, EventId, MAX_ITEM_BYTES, Receipt, ReceiptStore, Recorded,
    check_limits, item_size,
};
use crate::error::Error;
use crate::testing::Faults;
use crate::testing::faults::{Fault, Injector};

/// How long after its `expiresAt` DynamoDB's TTL may delete an item: "typically within 48
/// hours" (the Developer Guide, "Time to Live"); the memory ledger deletes within this bound.
pub const TTL_DELETION_DELAY: Duration = Duration::from_secs(48 * 3600);

#[derive(Debug, Default)]
struct State {
    receipts: BTreeMap<EventId, Receipt>,
    /// How long an applied receipt is kept (`None`: for good).
    retention: Option<Duration>,
    /// Applied receipts by the time TTL deletes them: their `expiresAt` plus a delay drawn
    /// from the event's identity and this salt, within [`TTL_DELETION_DELAY`].
    expiring: BTreeSet<(SystemTime, EventId)>,
    salt: u64,
    /// Receipts deleted by TTL so far.
    expired: u64,
    /// Table -> (key attribute names, items by rendered key).
    tables: BTreeMap<String, (Vec<String>, BTreeMap<String, Item>)>,
    /// Effect writes applied, for counting (every put, update and delete).
    writes: u64,
}

/// Receipts and effect tables in memory. Clones share them.
///
/// ```
/// use shardwise::receipts::{key, Apply, Committed, Effect, EventId, MemoryReceipts, ReceiptStore};
/// # futures::executor::block_on(async {
/// let receipts = MemoryReceipts::new().table("counts", &["id"]);
/// let apply = Apply { event: EventId::new("e1"), effects: Effect::update("counts", key("id", "a")).add("count", 1).into() };
/// assert_eq!(receipts.commit(&[apply.clone()], "w").await.unwrap(), vec![Committed::Applied]);
/// assert_eq!(receipts.commit(&[apply], "w").await.unwrap(), vec![Committed::Replay], "a replay");
/// assert_eq!(receipts.number("counts", &key("id", "a"), "count"), Some(1));
/// # });
/// ```
#[derive(Clone, Default)]
pub struct MemoryReceipts {
    state: Arc<Mutex<State>>,
    faults: Injector,
}

impl fmt::Debug for MemoryReceipts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.state();
        f.debug_struct("MemoryReceipts")
            .field("receipts", &state.receipts.len())
            .field("tables", &state.tables.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl MemoryReceipts {
    /// An empty ledger with no effect tables.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keeps applied receipts for `kept`, as [`DynamoDbReceipts`](super::DynamoDbReceipts) does
    /// with TTL: each expires `kept` after its commit by the clock of the host that committed it
    /// (`expiresAt` is written from the worker's clock: a host 10 s behind expires its receipts
    /// 10 s early), and is deleted at a time drawn (from its event and `seed`) within
    /// [`TTL_DELETION_DELAY`] after that, by the services' clock (the simulation's). Held and
    /// quarantined receipts stay. Without this, receipts are kept for good.
    pub fn retention(self, kept: Duration, seed: u64) -> Self {
        {
            let mut state = self.state();
            state.retention = Some(kept);
            state.salt = seed;
        }
        self
    }

    /// Applied receipts TTL has deleted so far.
    pub fn expired(&self) -> u64 {
        let mut state = self.state();
        state.sweep(crate::time::service_now());
        state.expired
    }

    /// Declares a table effects may write, with its key attribute names.
    pub fn table(self, name: &str, key: &[&str]) -> Self {
        self.state().tables.insert(
            name.to_string(),
            (key.iter().map(|k| k.to_string()).collect(), BTreeMap::new()),
        );
        self
    }

    /// Injects `faults` into every later call (see [`Faults`]); a commit whose answer is lost was
    /// applied.
    pub fn inject(&self, seed: u64, faults: Faults) {
        self.faults.set(seed, faults);
    }

    /// Stops injecting faults.
    pub fn heal(&self) {
        self.faults.clear();
    }

    /// Every receipt, by event.
    pub fn receipts(&self) -> Vec<Receipt> {
        self.state().receipts.values().cloned().collect()
    }

    /// The item with `key` in `table`.
    pub fn item(&self, table: &str, key: &Item) -> Option<Item> {
        let state = self.state();
        let (_, items) = state.tables.get(table)?;
        items.get(&render(key)).cloned()
    }

    /// Every item of `table`.
    pub fn items(&self, table: &str) -> Vec<Item> {
        self.state()
            .tables
            .get(table)
            .map(|(_, items)| items.values().cloned().collect())
            .unwrap_or_default()
    }

    /// The number attribute of the item with `key` in `table`.
    pub fn number(&self, table: &str, key: &Item, attribute: &str) -> Option<i64> {
        match self.item(table, key)?.get(attribute)? {
            AttributeValue::N(n) => n.parse().ok(),
            _ => None,
        }
    }

    /// Effect writes applied so far.
    pub fn writes(&self) -> u64 {
        self.state().writes
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// `op` under the lock; with faults, the call fails before it or after it.
    fn call<'a, T: Send + 'a>(
        &'a self,
        operation: &'static str,
        write: bool,
        op: impl FnOnce(&mut State) -> T + Send + 'a,
    ) -> BoxFuture<'a, Result<T, Error>> {
        Box::pin(async move {
            let injected = |what: &str| Error::DynamoDb {
                operation,
                table: "memory-receipts".into(),
                source: format!("injected fault: {what}").into(),
            };
            self.state().sweep(crate::time::service_now());
            match self.faults.draw(write, false) {
                None | Some(Fault::ExpiredIterator) => Ok(op(&mut self.state())),
                Some(Fault::Error) => Err(injected("error")),
                Some(Fault::Throttle) => Err(injected("throttled")),
                Some(Fault::Timeout(after)) => {
                    tokio::time::sleep(after).await;
                    Err(injected("timed out"))
                }
                Some(Fault::LostAnswer(after)) => {
                    let _ = op(&mut self.state());
                    tokio::time::sleep(after).await;
                    Err(injected("timed out after the write was applied"))
                }
                Some(Fault::SlowAnswer(after)) => {
                    let answer = op(&mut self.state());
                    tokio::time::sleep(after).await;
                    Ok(answer)
                }
            }
        })
    }
}

fn render(key: &Item) -> String {
    key.iter()
        .map(|(n, v)| format!("{n}={v:?}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn receipt(event: &EventId, disposition: &Disposition, by: &str) -> Receipt {
    Receipt {
        event: event.clone(),
        disposition: disposition.clone(),
        recorded_at: crate::time::now(),
        by: by.to_string(),
    }
}

impl State {
    /// Deletes the applied receipts whose TTL deletion time has come.
    fn sweep(&mut self, now: SystemTime) {
        while let Some((at, _)) = self.expiring.first()
            && *at <= now
        {
            let (_, event) = self.expiring.pop_first().expect("first");
            self.receipts.remove(&event);
            self.expired += 1;
        }
    }

    /// Records an applied receipt, and when TTL will delete it.
    fn applied(&mut self, event: &EventId, by: &str) {
        let receipt = receipt(event, &Disposition::Applied, by);
        if let Some(kept) = self.retention {
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            (self.salt, event).hash(&mut hasher);
            let delay = TTL_DELETION_DELAY.mul_f64(hasher.finish() as f64 / u64::MAX as f64);
            // `expiresAt` as the committing worker writes it: from its own clock.
            let expires = crate::time::now() + kept;
            self.expiring.insert((expires + delay, event.clone()));
        }
        self.receipts.insert(event.clone(), receipt);
    }

    fn terminal(&self, event: &EventId) -> bool {
        self.receipts
            .get(event)
            .is_some_and(|r| r.disposition.is_terminal())
    }

    /// The rendered key an effect writes, given the table's key names.
    fn key_of(&self, effect: &Effect) -> Option<String> {
        let (names, _) = self.tables.get(effect.table())?;
        Some(match effect {
            Effect::Put { item, .. } => render(
                &names
                    .iter()
                    .filter_map(|n| item.get(n).map(|v| (n.clone(), v.clone())))
                    .collect(),
            ),
            Effect::Update { key, .. } | Effect::Delete { key, .. } | Effect::Check { key, .. } => {
                render(key)
            }
        })
    }

    /// The size an update would leave its item at, when that passes DynamoDB's item limit (which
    /// the store answers with a ValidationException).
    fn oversized(&self, effect: &Effect) -> Option<usize> {
        let Effect::Update {
            key: k, changes, ..
        } = effect
        else {
            return None;
        };
        let current = self
            .key_of(effect)
            .and_then(|key| self.tables.get(effect.table())?.1.get(&key));
        let mut item = current.cloned().unwrap_or_else(|| k.clone());
        change(&mut item, changes);
        let size = item_size(&item);
        (size > MAX_ITEM_BYTES).then_some(size)
    }

    fn holds(&self, effect: &Effect) -> bool {
        let expect = match effect {
            Effect::Put { expect, .. }
            | Effect::Update { expect, .. }
            | Effect::Delete { expect, .. } => expect.as_ref(),
            Effect::Check { expect, .. } => Some(expect),
        };
        let Some(expect) = expect else { return true };
        let current = self
            .key_of(effect)
            .and_then(|k| self.tables.get(effect.table())?.1.get(&k));
        match expect {
            Expect::Exists => current.is_some(),
            Expect::NotExists => current.is_none(),
            Expect::Equals(attribute, value) => {
                current.and_then(|i| i.get(attribute)) == Some(value)
            }
        }
    }

    fn apply(&mut self, effect: &Effect) {
        let Some(key) = self.key_of(effect) else {
            return;
        };
        let Some((_, items)) = self.tables.get_mut(effect.table()) else {
            return;
        };
        match effect {
            Effect::Put { item, .. } => {
                items.insert(key, item.clone());
            }
            Effect::Update {
                key: k, changes, ..
            } => {
                change(items.entry(key).or_insert_with(|| k.clone()), changes);
            }
            Effect::Delete { .. } => {
                items.remove(&key);
            }
            Effect::Check { .. } => return,
        }
        self.writes += 1;
    }
}

impl ReceiptStore for MemoryReceipts {
    fn prepare(&self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(async { Ok(()) })
    }

    fn get<'a>(&'a self, event: &'a EventId) -> BoxFuture<'a, Result<Option<Receipt>, Error>> {
        self.call("GetItem", false, move |state| {
            state.receipts.get(event).cloned()
        })
    }

    fn record<'a>(
        &'a self,
        event: &'a EventId,
        disposition: &'a Disposition,
        by: &'a str,
    ) -> BoxFuture<'a, Result<Recorded, Error>> {
        self.call("PutItem", true, move |state| {
            if state.terminal(event) {
                return Recorded::Exists(state.receipts[event].clone());
            }
            if *disposition == Disposition::Applied {
                state.applied(event, by);
            } else {
                state
                    .receipts
                    .insert(event.clone(), receipt(event, disposition, by));
            }
            Recorded::Recorded
        })
    }

    fn release<'a>(&'a self, event: &'a EventId) -> BoxFuture<'a, Result<bool, Error>> {
        self.call("DeleteItem", true, move |state| {
            let held = state
                .receipts
                .get(event)
                .is_some_and(|r| !r.disposition.is_terminal());
            if held {
                state.receipts.remove(event);
            }
            held
        })
    }

    fn commit<'a>(
        &'a self,
        applies: &'a [Apply],
        by: &'a str,
    ) -> BoxFuture<'a, Result<Vec<Committed>, Error>> {
        self.call("TransactWriteItems", true, move |state| {
            applies
                .iter()
                .map(|apply| {
                    let key_of = |t: &str| state.tables.get(t).map(|(k, _)| k.clone());
                    if let Some(missing) =
                        apply.effects.iter().find(|e| key_of(e.table()).is_none())
                    {
                        return Committed::Invalid(format!(
                            "the effect table `{}` does not exist",
                            missing.table()
                        ));
                    }
                    if let Err(e) = check_limits(&apply.effects, 0, &key_of) {
                        return Committed::Invalid(e);
                    }
                    if state.terminal(&apply.event) {
                        return Committed::Replay;
                    }
                    if let Some(refused) = apply.effects.iter().position(|e| !state.holds(e)) {
                        return Committed::Refused(format!(
                            "the condition of effect {refused} did not hold"
                        ));
                    }
                    if let Some((i, size)) = apply
                        .effects
                        .iter()
                        .enumerate()
                        .find_map(|(i, e)| Some((i, state.oversized(e)?)))
                    {
                        return Committed::Invalid(format!(
                            "effect {i} would leave its item at {size} bytes, over the item size limit ({MAX_ITEM_BYTES} bytes)"
                        ));
                    }
                    for effect in apply.effects.iter() {
                        state.apply(effect);
                    }
                    state.applied(&apply.event, by);
                    Committed::Applied
                })
                .collect()
        })
    }

    fn retention(&self) -> Option<Duration> {
        self.state().retention
    }

    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Receipt>, Error>> {
        self.call("Scan", false, move |state| {
            state.receipts.values().take(limit).cloned().collect()
        })
    }
}

/// Applies an update's changes to its item (numbers add up; any other `Add` sets).
fn change(item: &mut Item, changes: &[Change]) {
    for change in changes {
        match change {
            Change::Set(a, v) => {
                item.insert(a.clone(), v.clone());
            }
            Change::Add(a, AttributeValue::N(by)) => {
                let old = match item.get(a) {
                    Some(AttributeValue::N(n)) => n.parse::<i64>().unwrap_or(0),
                    _ => 0,
                };
                let by: i64 = by.parse().unwrap_or(0);
                item.insert(a.clone(), AttributeValue::N((old + by).to_string()));
            }
            Change::Add(a, v) => {
                item.insert(a.clone(), v.clone());
            }
            Change::Remove(a) => {
                item.remove(a);
            }
        }
    }
}
