//! The receipt ledger on a DynamoDB table, and the transactions that commit effects with receipts.
//!
//! One item per (application, event): key `receiptKey` = `APPLICATION|EVENT`, with `application`,
//! `eventId`, `disposition` (`applied`, `quarantined`, `held`), `reason`, `recordedAt` (ms),
//! `recordedBy`, and on `applied` receipts `expiresAt` (epoch seconds, the table's TTL attribute:
//! held and quarantined receipts never expire by themselves). Every write of a
//! receipt is conditioned on `attribute_not_exists(receiptKey) OR disposition = held`: a terminal
//! receipt is never overwritten.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::ProvideErrorMetadata;
use aws_sdk_dynamodb::types::{
    AttributeValue, ConditionCheck, Delete, KeyType, Put, ReturnValuesOnConditionCheckFailure,
    TimeToLiveSpecification, TimeToLiveStatus, TransactWriteItem, Update,
};
use futures::future::BoxFuture;

use super::effect::{Change, Effect, Expect, Item};
use super::{
    Apply, Committed, DEFAULT_RETENTION, Disposition, EventId, Receipt, ReceiptStore, Recorded,
    check_limits, item_size,
};
use crate::dynamo::{Table, TableOptions, failed, is_condition_failed, n, s};
use crate::error::Error;
use crate::time::{from_millis, millis};

mod attr {
    pub(super) const KEY: &str = "receiptKey";
    pub(super) const APPLICATION: &str = "application";
    pub(super) const EVENT: &str = "eventId";
    pub(super) const DISPOSITION: &str = "disposition";
    pub(super) const REASON: &str = "reason";
    pub(super) const RECORDED_AT: &str = "recordedAt";
    pub(super) const RECORDED_BY: &str = "recordedBy";
    pub(super) const EXPIRES_AT: &str = "expiresAt";
}
use attr::*;

/// Attempts of one transaction that keeps meeting concurrent transactions on its items.
const CONFLICT_ATTEMPTS: usize = 5;

/// Receipts of one application in a DynamoDB table (several applications can share a table).
///
/// ```no_run
/// # async fn demo() -> Result<(), shardwise::Error> {
/// use std::time::Duration;
/// use shardwise::receipts::{DynamoDbReceipts, ReceiptStore};
/// let config = aws_config::load_from_env().await;
/// let receipts = DynamoDbReceipts::new(aws_sdk_dynamodb::Client::new(&config), "billing-receipts", "billing")
///     .retention(Duration::from_secs(14 * 24 * 3600));
/// receipts.prepare().await?; // creates the table, with TTL on `expiresAt`
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct DynamoDbReceipts {
    client: Client,
    table: String,
    application: String,
    retention: Option<Duration>,
    create_if_missing: bool,
    options: TableOptions,
    /// Key attribute names of the tables effects write, as DescribeTable gave them.
    keys: Arc<Mutex<HashMap<String, Vec<String>>>>,
}

impl fmt::Debug for DynamoDbReceipts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DynamoDbReceipts")
            .field("table", &self.table)
            .field("application", &self.application)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

impl DynamoDbReceipts {
    /// The receipts of `application` in `table`, reached through `client`.
    pub fn new(client: Client, table: impl Into<String>, application: impl Into<String>) -> Self {
        Self {
            client: crate::dynamo::bounded(client),
            table: table.into(),
            application: application.into(),
            retention: Some(DEFAULT_RETENTION),
            create_if_missing: true,
            options: TableOptions::default(),
            keys: Arc::default(),
        }
    }

    /// How long a receipt is kept (default [`DEFAULT_RETENTION`], 7 days): DynamoDB's TTL deletes
    /// it after that. Keep it at least as long as the source keeps events (the stream's
    /// retention, the log group's): a consumer refuses to run on a ledger kept shorter.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = Some(retention);
        self
    }

    /// Keeps `applied` receipts for good (no `expiresAt`): for a source that never deletes
    /// events (a log group that never expires them), where a replay can come after any outage.
    pub fn keep_forever(mut self) -> Self {
        self.retention = None;
        self
    }

    /// Whether [`prepare`](ReceiptStore::prepare) creates a missing table (default `true`).
    pub fn create_if_missing(mut self, create: bool) -> Self {
        self.create_if_missing = create;
        self
    }

    /// How a missing table is created (billing mode, tags, point-in-time recovery).
    pub fn table_options(mut self, options: TableOptions) -> Self {
        self.options = options;
        self
    }

    /// The table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// Creates a table for effects to write, keyed by the string attribute `key` (on-demand), if it
    /// does not exist, and waits until it is ACTIVE; an existing table must have that key. A
    /// convenience for demonstrations and tests: production tables are usually made elsewhere.
    pub async fn ensure_effect_table(&self, table: &str, key: &str) -> Result<(), Error> {
        Table::new(&self.client, table, |table, reason| Error::Table {
            table,
            reason,
        })
        .prepare(key, true, &TableOptions::default())
        .await
        .map(|_| ())
    }

    fn shared(&self) -> Table<'_> {
        Table::new(&self.client, &self.table, |table, reason| Error::Table {
            table,
            reason: format!("cannot hold receipts: {reason}"),
        })
    }

    fn key_of(&self, event: &EventId) -> String {
        format!("{}|{}", self.application, event.as_str())
    }

    fn item(
        &self,
        event: &EventId,
        disposition: &Disposition,
        by: &str,
    ) -> HashMap<String, AttributeValue> {
        let now = crate::time::now();
        let mut item = HashMap::from([
            (KEY.to_string(), s(self.key_of(event))),
            (APPLICATION.to_string(), s(&self.application)),
            (EVENT.to_string(), s(event.as_str())),
            (DISPOSITION.to_string(), s(disposition.label())),
            (RECORDED_AT.to_string(), n(millis(now))),
            (RECORDED_BY.to_string(), s(by)),
        ]);
        // Only an applied receipt expires. A held one deleted by TTL would turn a hold into a
        // release unseen, and a quarantined one would let a replay handle the event again: both
        // stay until an operator acts on them.
        if *disposition == Disposition::Applied
            && let Some(retention) = self.retention
        {
            let expires = millis(now + retention) / 1000;
            item.insert(EXPIRES_AT.to_string(), n(expires));
        }
        if let Some(reason) = disposition.reason() {
            item.insert(REASON.to_string(), s(reason));
        }
        item
    }

    /// The condition every receipt write carries: no receipt yet, or a held one.
    const UNLESS_TERMINAL: &'static str = "attribute_not_exists(#key) OR #disposition = :held";

    async fn prepare_table(&self) -> Result<(), Error> {
        self.shared()
            .prepare(KEY, self.create_if_missing, &self.options)
            .await?;
        let ttl = self
            .client
            .describe_time_to_live()
            .table_name(&self.table)
            .send()
            .await
            .map_err(|e| failed(&self.table, "DescribeTimeToLive", e))?;
        let on = ttl.time_to_live_description().is_some_and(|d| {
            matches!(
                d.time_to_live_status(),
                Some(TimeToLiveStatus::Enabled | TimeToLiveStatus::Enabling)
            )
        });
        if !on {
            self.client
                .update_time_to_live()
                .table_name(&self.table)
                .time_to_live_specification(
                    TimeToLiveSpecification::builder()
                        .attribute_name(EXPIRES_AT)
                        .enabled(true)
                        .build()
                        .map_err(|e| failed(&self.table, "UpdateTimeToLive", e))?,
                )
                .send()
                .await
                .map_err(|e| failed(&self.table, "UpdateTimeToLive", e))?;
        }
        Ok(())
    }

    async fn get_receipt(&self, event: &EventId) -> Result<Option<Receipt>, Error> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(KEY, s(self.key_of(event)))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| failed(&self.table, "GetItem", e))?;
        out.item.as_ref().map(|i| parse(&self.table, i)).transpose()
    }

    async fn record_receipt(
        &self,
        event: &EventId,
        disposition: &Disposition,
        by: &str,
    ) -> Result<Recorded, Error> {
        let result = self
            .client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(self.item(event, disposition, by)))
            .condition_expression(Self::UNLESS_TERMINAL)
            .expression_attribute_names("#key", KEY)
            .expression_attribute_names("#disposition", DISPOSITION)
            .expression_attribute_values(":held", s("held"))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match result {
            Ok(_) => Ok(Recorded::Recorded),
            Err(err) if is_condition_failed(&err) => {
                let existing = match self.get_receipt(event).await? {
                    Some(receipt) => receipt,
                    None => {
                        return Err(Error::Corrupt {
                            what: "receipt",
                            detail: format!("`{event}`: refused as existing, then not found"),
                        });
                    }
                };
                Ok(Recorded::Exists(existing))
            }
            Err(err) => Err(failed(&self.table, "PutItem", err)),
        }
    }

    async fn release_receipt(&self, event: &EventId) -> Result<bool, Error> {
        let result = self
            .client
            .delete_item()
            .table_name(&self.table)
            .key(KEY, s(self.key_of(event)))
            .condition_expression("#disposition = :held")
            .expression_attribute_names("#disposition", DISPOSITION)
            .expression_attribute_values(":held", s("held"))
            .send()
            .await;
        match result {
            Ok(_) => Ok(true),
            Err(err) if is_condition_failed(&err) => Ok(false),
            Err(err) => Err(failed(&self.table, "DeleteItem", err)),
        }
    }

    /// Starts the retention of a quarantined receipt: an operator is done with the event, and
    /// the receipt is deleted (DynamoDB TTL) once the retention has passed from now. Until then a
    /// quarantined receipt carries no `expiresAt` and stays. `false` when the event has no
    /// quarantined receipt (unknown, applied or held: left as it is), and on a ledger that
    /// [keeps receipts for good](Self::keep_forever) (nothing changes).
    ///
    /// Start it only once no replay of the event can come any more (the source no longer keeps
    /// the event, see [`SourceRetention`](super::SourceRetention)): a replay after the receipt
    /// is gone hands the event out again.
    pub async fn start_retention(&self, event: &EventId) -> Result<bool, Error> {
        let Some(retention) = self.retention else {
            return Ok(false);
        };
        let expires = millis(crate::time::now() + retention) / 1000;
        let result = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(KEY, s(self.key_of(event)))
            .update_expression("SET #expires = :expires")
            .condition_expression("#disposition = :quarantined")
            .expression_attribute_names("#expires", EXPIRES_AT)
            .expression_attribute_names("#disposition", DISPOSITION)
            .expression_attribute_values(":expires", n(expires))
            .expression_attribute_values(":quarantined", s("quarantined"))
            .send()
            .await;
        match result {
            Ok(_) => Ok(true),
            Err(err) if is_condition_failed(&err) => Ok(false),
            Err(err) => Err(failed(&self.table, "UpdateItem", err)),
        }
    }

    async fn list_receipts(&self, limit: usize) -> Result<Vec<Receipt>, Error> {
        let mut out = Vec::new();
        let mut pages = self
            .client
            .scan()
            .table_name(&self.table)
            .filter_expression("#app = :app")
            .expression_attribute_names("#app", APPLICATION)
            .expression_attribute_values(":app", s(&self.application))
            .into_paginator()
            .send();
        // Page by page, no further once `limit` are read.
        while out.len() < limit
            && let Some(page) = pages.next().await
        {
            let page = page.map_err(|e| failed(&self.table, "Scan", e))?;
            for item in page.items() {
                out.push(parse(&self.table, item)?);
            }
        }
        out.sort_by(|a, b| a.event.cmp(&b.event));
        out.truncate(limit);
        Ok(out)
    }

    /// The key attribute names of an effect's table (DescribeTable, once per table): an error
    /// naming the table when it does not exist.
    async fn learn_keys(&self, table: &str) -> Result<(), String> {
        if self
            .keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(table)
        {
            return Ok(());
        }
        let described = Table::new(&self.client, table, |table, reason| Error::Table {
            table,
            reason,
        })
        .describe()
        .await
        .map_err(|e| format!("the effect table `{table}` cannot be described: {e}"))?;
        let Some(desc) = described else {
            return Err(format!("the effect table `{table}` does not exist"));
        };
        let mut names: Vec<(bool, String)> = desc
            .key_schema()
            .iter()
            .map(|k| {
                (
                    *k.key_type() != KeyType::Hash,
                    k.attribute_name().to_string(),
                )
            })
            .collect();
        names.sort();
        self.keys.lock().unwrap_or_else(|e| e.into_inner()).insert(
            table.to_string(),
            names.into_iter().map(|(_, n)| n).collect(),
        );
        Ok(())
    }

    async fn commit_all(&self, applies: &[Apply], by: &str) -> Result<Vec<Committed>, Error> {
        let mut answers: Vec<Option<Committed>> = vec![None; applies.len()];
        // Check each apply on its own first: tables, keys, limits.
        let mut items_of: Vec<BTreeSet<(String, String)>> = vec![BTreeSet::new(); applies.len()];
        let mut sizes = vec![0usize; applies.len()];
        for (i, apply) in applies.iter().enumerate() {
            let mut problem = None;
            for effect in apply.effects.iter() {
                if let Err(e) = self.learn_keys(effect.table()).await {
                    problem = Some(e);
                    break;
                }
            }
            let receipt = self.item(&apply.event, &Disposition::Applied, by);
            let receipt_bytes = receipt.iter().map(|(k, v)| k.len() + value_len(v)).sum();
            if problem.is_none() {
                let keys = self.keys.lock().unwrap_or_else(|e| e.into_inner()).clone();
                match check_limits(&apply.effects, receipt_bytes, &|t| keys.get(t).cloned()) {
                    Ok(items) => items_of[i] = items,
                    Err(e) => problem = Some(e),
                }
            }
            sizes[i] = receipt_bytes + apply.effects.iter().map(Effect::size).sum::<usize>();
            if let Some(p) = problem {
                answers[i] = Some(Committed::Invalid(p));
            }
        }
        // Then commit the rest in as few transactions as the limits allow; an apply whose
        // transaction was cancelled by another's refusal goes again.
        let mut pending: Vec<usize> = (0..applies.len())
            .filter(|i| answers[*i].is_none())
            .collect();
        let mut conflicts = 0;
        // Applies that go in a transaction of their own: those of a transaction the store refused
        // as a whole, so the one it refused for is found and the others commit.
        let mut alone = BTreeSet::new();
        while !pending.is_empty() {
            let group = pack(&pending, applies, &items_of, &sizes, &alone);
            match self.transact(&group, applies, by).await? {
                Transacted::Done => {
                    for i in &group {
                        answers[*i] = Some(Committed::Applied);
                    }
                }
                Transacted::Cancelled(outcomes) => {
                    for (i, outcome) in group.iter().zip(outcomes) {
                        if let Some(answer) = outcome {
                            answers[*i] = Some(answer);
                        }
                    }
                }
                Transacted::Rejected(why) if group.len() == 1 => {
                    answers[group[0]] = Some(Committed::Invalid(why));
                }
                Transacted::Rejected(why) => {
                    tracing::warn!(table = %self.table, applies = group.len(), reason = %why, "a transaction was refused as a whole; its applies are committed one by one");
                    alone.extend(group.iter().copied());
                }
                Transacted::Conflict => {
                    conflicts += 1;
                    if conflicts >= CONFLICT_ATTEMPTS {
                        return Err(Error::Corrupt {
                            what: "effects transaction",
                            detail: format!(
                                "{CONFLICT_ATTEMPTS} attempts met concurrent transactions on the same items"
                            ),
                        });
                    }
                }
            }
            pending.retain(|i| answers[*i].is_none());
        }
        Ok(answers
            .into_iter()
            .map(|a| a.expect("every apply answered"))
            .collect())
    }

    /// One TransactWriteItems of the applies `group`: each one's effects, then its receipt.
    async fn transact(
        &self,
        group: &[usize],
        applies: &[Apply],
        by: &str,
    ) -> Result<Transacted, Error> {
        let mut items = Vec::new();
        // Which apply each transaction item belongs to, and whether it is the receipt.
        let mut owners: Vec<(usize, bool)> = Vec::new();
        for (slot, i) in group.iter().enumerate() {
            let apply = &applies[*i];
            for effect in apply.effects.iter() {
                items.push(self.write_of(effect)?);
                owners.push((slot, false));
            }
            let receipt = Put::builder()
                .table_name(&self.table)
                .set_item(Some(self.item(&apply.event, &Disposition::Applied, by)))
                .condition_expression(Self::UNLESS_TERMINAL)
                .expression_attribute_names("#key", KEY)
                .expression_attribute_names("#disposition", DISPOSITION)
                .expression_attribute_values(":held", s("held"))
                .build()
                .map_err(|e| failed(&self.table, "TransactWriteItems", e))?;
            items.push(TransactWriteItem::builder().put(receipt).build());
            owners.push((slot, true));
        }
        let began = std::time::Instant::now();
        let result = self
            .client
            .transact_write_items()
            .set_transact_items(Some(items))
            .send()
            .await;
        // What effects cost: one transaction per call, however it ended (a cancelled or failed
        // one took the store's time too).
        metrics::counter!("shardwise_receipt_transactions_total", "table" => self.table.clone())
            .increment(1);
        metrics::histogram!("shardwise_receipt_transaction_seconds", "table" => self.table.clone())
            .record(began.elapsed());
        let err = match result {
            Ok(_) => return Ok(Transacted::Done),
            Err(err) => err,
        };
        let Some(cancelled) = err
            .as_service_error()
            .and_then(|e| match e {
                aws_sdk_dynamodb::operation::transact_write_items::TransactWriteItemsError::TransactionCanceledException(c) => Some(c),
                _ => None,
            })
        else {
            // A request the store refuses as a whole (DynamoDB's ValidationException: an update
            // that would grow its item past 400 KB, two operations on one item) fails the same
            // way every time: the caller isolates the apply it is for.
            if let Some(e) = err.as_service_error()
                && e.code() == Some("ValidationException")
            {
                return Ok(Transacted::Rejected(format!(
                    "ValidationException: {}",
                    e.message().unwrap_or("the request was refused")
                )));
            }
            return Err(failed(&self.table, "TransactWriteItems", err));
        };
        let reasons = cancelled.cancellation_reasons();
        let mut outcomes: Vec<Option<Committed>> = vec![None; group.len()];
        let mut conflict = false;
        for (reason, (slot, receipt)) in reasons.iter().zip(&owners) {
            match reason.code() {
                Some("ConditionalCheckFailed") if *receipt => {
                    outcomes[*slot] = Some(Committed::Replay)
                }
                Some("ConditionalCheckFailed") => {
                    if outcomes[*slot].is_none() {
                        outcomes[*slot] = Some(Committed::Refused(
                            reason
                                .message()
                                .unwrap_or("an effect's condition did not hold")
                                .to_string(),
                        ));
                    }
                }
                Some("TransactionConflict") => conflict = true,
                Some("None") | None => {}
                Some(other) => {
                    outcomes[*slot] = Some(Committed::Invalid(format!(
                        "{other}: {}",
                        reason.message().unwrap_or("refused")
                    )))
                }
            }
        }
        if outcomes.iter().all(Option::is_none) {
            return Ok(if conflict || reasons.is_empty() {
                Transacted::Conflict
            } else {
                Transacted::Cancelled(outcomes)
            });
        }
        Ok(Transacted::Cancelled(outcomes))
    }

    /// The transaction item of one effect.
    fn write_of(&self, effect: &Effect) -> Result<TransactWriteItem, Error> {
        let fail = |e| failed(&self.table, "TransactWriteItems", e);
        let key_names = |table: &str| {
            self.keys
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(table)
                .cloned()
                .unwrap_or_default()
        };
        Ok(match effect {
            Effect::Put {
                table,
                item,
                expect,
            } => {
                let mut put = Put::builder()
                    .table_name(table)
                    .set_item(Some(to_map(item)));
                if let Some(expect) = expect {
                    let first = key_names(table).into_iter().next().unwrap_or_default();
                    let (condition, names, values) = condition_of(expect, &first);
                    put = put
                        .condition_expression(condition)
                        .set_expression_attribute_names(Some(names))
                        .set_expression_attribute_values(non_empty(values));
                }
                TransactWriteItem::builder()
                    .put(put.build().map_err(fail)?)
                    .build()
            }
            Effect::Update {
                table,
                key,
                changes,
                expect,
            } => {
                let (expression, mut names, mut values) = update_of(changes);
                let mut update = Update::builder()
                    .table_name(table)
                    .set_key(Some(to_map(key)))
                    .update_expression(expression);
                if let Some(expect) = expect {
                    let first = key.keys().next().cloned().unwrap_or_default();
                    let (condition, n2, v2) = condition_of(expect, &first);
                    names.extend(n2);
                    values.extend(v2);
                    update = update.condition_expression(condition);
                }
                update = update
                    .set_expression_attribute_names(Some(names))
                    .set_expression_attribute_values(non_empty(values));
                TransactWriteItem::builder()
                    .update(update.build().map_err(fail)?)
                    .build()
            }
            Effect::Delete { table, key, expect } => {
                let mut delete = Delete::builder()
                    .table_name(table)
                    .set_key(Some(to_map(key)));
                if let Some(expect) = expect {
                    let first = key.keys().next().cloned().unwrap_or_default();
                    let (condition, names, values) = condition_of(expect, &first);
                    delete = delete
                        .condition_expression(condition)
                        .set_expression_attribute_names(Some(names))
                        .set_expression_attribute_values(non_empty(values));
                }
                TransactWriteItem::builder()
                    .delete(delete.build().map_err(fail)?)
                    .build()
            }
            Effect::Check { table, key, expect } => {
                let first = key.keys().next().cloned().unwrap_or_default();
                let (condition, names, values) = condition_of(expect, &first);
                let check = ConditionCheck::builder()
                    .table_name(table)
                    .set_key(Some(to_map(key)))
                    .condition_expression(condition)
                    .set_expression_attribute_names(Some(names))
                    .set_expression_attribute_values(non_empty(values))
                    .build()
                    .map_err(fail)?;
                TransactWriteItem::builder().condition_check(check).build()
            }
        })
    }
}

enum Transacted {
    Done,
    /// Per apply of the group: its answer when it caused the cancellation, `None` when it was
    /// cancelled by another's.
    Cancelled(Vec<Option<Committed>>),
    /// Cancelled by a concurrent transaction: try again.
    Conflict,
    /// The request was refused as a whole, whatever the items' conditions: the same request
    /// fails again (the reason).
    Rejected(String),
}

/// The next group to commit at once, in order: within DynamoDB's item and byte limits, on
/// distinct items.
fn pack(
    pending: &[usize],
    applies: &[Apply],
    items_of: &[BTreeSet<(String, String)>],
    sizes: &[usize],
    alone: &BTreeSet<usize>,
) -> Vec<usize> {
    let mut group = Vec::new();
    let mut items = 0;
    let mut bytes = 0;
    let mut written: BTreeSet<&(String, String)> = BTreeSet::new();
    for i in pending.iter().copied() {
        if alone.contains(&i) {
            if group.is_empty() {
                return vec![i];
            }
            continue;
        }
        let count = applies[i].effects.len() + 1;
        let clashes = items_of[i].iter().any(|item| written.contains(item));
        let fits = group.is_empty()
            || (!clashes
                && items + count <= super::MAX_TRANSACTION_ITEMS
                && bytes + sizes[i] <= super::MAX_TRANSACTION_BYTES);
        if fits {
            group.push(i);
            items += count;
            bytes += sizes[i];
            written.extend(items_of[i].iter());
        }
    }
    group
}

fn to_map(item: &Item) -> HashMap<String, AttributeValue> {
    item.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn non_empty(values: HashMap<String, AttributeValue>) -> Option<HashMap<String, AttributeValue>> {
    (!values.is_empty()).then_some(values)
}

/// An update expression (`SET #a0 = :v0 ADD #a1 :v1 REMOVE #a2`) with its names and values.
fn update_of(
    changes: &[Change],
) -> (
    String,
    HashMap<String, String>,
    HashMap<String, AttributeValue>,
) {
    let mut names = HashMap::new();
    let mut values = HashMap::new();
    let (mut set, mut add, mut remove) = (Vec::new(), Vec::new(), Vec::new());
    for (i, change) in changes.iter().enumerate() {
        let name = format!("#a{i}");
        let value = format!(":v{i}");
        match change {
            Change::Set(attr, v) => {
                names.insert(name.clone(), attr.clone());
                values.insert(value.clone(), v.clone());
                set.push(format!("{name} = {value}"));
            }
            Change::Add(attr, v) => {
                names.insert(name.clone(), attr.clone());
                values.insert(value.clone(), v.clone());
                add.push(format!("{name} {value}"));
            }
            Change::Remove(attr) => {
                names.insert(name.clone(), attr.clone());
                remove.push(name);
            }
        }
    }
    let mut parts = Vec::new();
    if !set.is_empty() {
        parts.push(format!("SET {}", set.join(", ")));
    }
    if !add.is_empty() {
        parts.push(format!("ADD {}", add.join(", ")));
    }
    if !remove.is_empty() {
        parts.push(format!("REMOVE {}", remove.join(", ")));
    }
    (parts.join(" "), names, values)
}

/// A condition expression for `expect`, with its names and values; `key` is an attribute of the
/// item's key (for existence).
fn condition_of(
    expect: &Expect,
    key: &str,
) -> (
    String,
    HashMap<String, String>,
    HashMap<String, AttributeValue>,
) {
    match expect {
        Expect::Exists => (
            "attribute_exists(#c0)".into(),
            HashMap::from([("#c0".to_string(), key.to_string())]),
            HashMap::new(),
        ),
        Expect::NotExists => (
            "attribute_not_exists(#c0)".into(),
            HashMap::from([("#c0".to_string(), key.to_string())]),
            HashMap::new(),
        ),
        Expect::Equals(attribute, value) => (
            "#c0 = :c0".into(),
            HashMap::from([("#c0".to_string(), attribute.clone())]),
            HashMap::from([(":c0".to_string(), value.clone())]),
        ),
    }
}

fn value_len(v: &AttributeValue) -> usize {
    item_size(&BTreeMap::from([(String::new(), v.clone())]))
}

/// Reads a receipt item; anything unreadable names the table and the attribute.
fn parse(table: &str, item: &HashMap<String, AttributeValue>) -> Result<Receipt, Error> {
    let string = |name: &str| match item.get(name) {
        Some(AttributeValue::S(v)) => Ok(Some(v.clone())),
        None => Ok(None),
        Some(_) => Err(Error::Corrupt {
            what: "receipt",
            detail: format!("table `{table}`: attribute `{name}` is not a string"),
        }),
    };
    let event = string(EVENT)?.ok_or_else(|| Error::Corrupt {
        what: "receipt",
        detail: format!("table `{table}`: an item has no `{EVENT}`"),
    })?;
    let label = string(DISPOSITION)?.unwrap_or_default();
    let disposition =
        Disposition::from_stored(&label, string(REASON)?).ok_or_else(|| Error::Corrupt {
            what: "receipt",
            detail: format!("table `{table}`: receipt `{event}` has the disposition `{label}`"),
        })?;
    let recorded_at = match item.get(RECORDED_AT) {
        Some(AttributeValue::N(ms)) => ms.parse().map(from_millis).ok(),
        _ => None,
    }
    .unwrap_or(std::time::UNIX_EPOCH);
    Ok(Receipt {
        event: EventId::new(event),
        disposition,
        recorded_at,
        by: string(RECORDED_BY)?.unwrap_or_default(),
    })
}

impl ReceiptStore for DynamoDbReceipts {
    fn prepare(&self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(self.prepare_table())
    }

    fn get<'a>(&'a self, event: &'a EventId) -> BoxFuture<'a, Result<Option<Receipt>, Error>> {
        Box::pin(self.get_receipt(event))
    }

    fn record<'a>(
        &'a self,
        event: &'a EventId,
        disposition: &'a Disposition,
        by: &'a str,
    ) -> BoxFuture<'a, Result<Recorded, Error>> {
        Box::pin(self.record_receipt(event, disposition, by))
    }

    fn release<'a>(&'a self, event: &'a EventId) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(self.release_receipt(event))
    }

    fn commit<'a>(
        &'a self,
        applies: &'a [Apply],
        by: &'a str,
    ) -> BoxFuture<'a, Result<Vec<Committed>, Error>> {
        Box::pin(self.commit_all(applies, by))
    }

    fn list(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Receipt>, Error>> {
        Box::pin(self.list_receipts(limit))
    }

    fn retention(&self) -> Option<Duration> {
        self.retention
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::receipts::{Effects, key};

    fn apply(id: &str, keys: &[&str]) -> Apply {
        Apply {
            event: EventId::new(id),
            effects: keys
                .iter()
                .map(|k| Effect::update("t", key("id", *k)).add("n", 1))
                .collect::<Effects>(),
        }
    }

    #[test]
    fn packing_keeps_items_distinct_and_within_limits_in_order() {
        let applies = vec![
            apply("a", &["1"]),
            apply("b", &["1"]),
            apply("c", &["2"]),
            apply("d", &["3"]),
        ];
        let items_of: Vec<BTreeSet<(String, String)>> = applies
            .iter()
            .map(|a| check_limits(&a.effects, 10, &|_| Some(vec!["id".into()])).unwrap())
            .collect();
        let sizes = vec![10; 4];
        // b writes the same item as a: it waits for the next transaction; c and d go with a.
        assert_eq!(
            pack(&[0, 1, 2, 3], &applies, &items_of, &sizes, &BTreeSet::new()),
            vec![0, 2, 3]
        );
        assert_eq!(
            pack(&[1], &applies, &items_of, &sizes, &BTreeSet::new()),
            vec![1]
        );
        // Applies of two items each (an effect and the receipt): 50 fit in 100 items.
        let many: Vec<Apply> = (0..60)
            .map(|i| apply(&i.to_string(), &[&format!("k{i}")]))
            .collect();
        let items_of: Vec<_> = many
            .iter()
            .map(|a| check_limits(&a.effects, 10, &|_| Some(vec!["id".into()])).unwrap())
            .collect();
        let pending: Vec<usize> = (0..60).collect();
        assert_eq!(
            pack(&pending, &many, &items_of, &vec![10; 60], &BTreeSet::new()).len(),
            50
        );
        // Applies of a refused transaction go one by one, each in its turn.
        let alone = BTreeSet::from([0, 1]);
        assert_eq!(
            pack(&pending, &many, &items_of, &vec![10; 60], &alone),
            vec![0]
        );
        assert_eq!(
            pack(&pending[1..], &many, &items_of, &vec![10; 60], &alone),
            vec![1]
        );
        assert_eq!(
            pack(&pending[2..], &many, &items_of, &vec![10; 60], &alone).len(),
            50
        );
    }

    #[test]
    fn expressions_name_every_attribute() {
        let (expression, names, values) = update_of(&[
            Change::Set("status".into(), s("done")),
            Change::Add("count".into(), n(1)),
            Change::Remove("old".into()),
        ]);
        assert_eq!(expression, "SET #a0 = :v0 ADD #a1 :v1 REMOVE #a2");
        assert_eq!(names.len(), 3);
        assert_eq!(values.len(), 2);
        let (condition, names, values) = condition_of(&Expect::NotExists, "id");
        assert_eq!(condition, "attribute_not_exists(#c0)");
        assert_eq!(names["#c0"], "id");
        assert!(values.is_empty());
    }
}
