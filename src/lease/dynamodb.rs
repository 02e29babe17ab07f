//! The lease store on a DynamoDB table: one row per shard, every write one conditional request.
//!
//! The attributes and the condition on every write are those of `docs/leases.md`. Every attribute
//! is named through an expression attribute name (`#owner`, `#cp`, ...), so DynamoDB's reserved
//! words never collide with them.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::config::http::HttpResponse;
use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder;
use aws_sdk_dynamodb::operation::update_item::{UpdateItemError, UpdateItemOutput};
use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::{
    AttributeValue, ReturnValue, ReturnValuesOnConditionCheckFailure, TransactWriteItem, Update,
};
use futures::future::BoxFuture;

use super::row::{Lease, NewLease, Ownership, lease_key};
use super::store::{
    CheckpointWrite, LeaseStore, MAX_SEEK_MOVES, Renewal, Roster, SeekMove,
    paged_write_is_of_the_attempt,
};
use crate::checkpoint::{AT_TIMESTAMP, Checkpoint};
use crate::dynamo::{Table, TableOptions, is_condition_failed, n, s};
use crate::error::Error;
use crate::frontier::{Membership, SeekCoordinate, SkippedRange};
use crate::paged::{Cursor, PagePosition, PagedProgress};
use crate::time::millis;
use crate::window::{Window, WindowState};

/// Attribute names of a lease row (see `docs/leases.md`).
mod attr {
    pub(super) const KEY: &str = "leaseKey";
    pub(super) const STREAM: &str = "streamName";
    pub(super) const SHARD: &str = "shardId";
    pub(super) const OWNER: &str = "leaseOwner";
    pub(super) const COUNTER: &str = "leaseCounter";
    pub(super) const EPOCH: &str = "ownerEpoch";
    pub(super) const CHECKPOINT: &str = "checkpoint";
    pub(super) const SUB: &str = "checkpointSub";
    pub(super) const CHECKPOINT_KEY: &str = "checkpointKey";
    pub(super) const STARTING_TIMESTAMP: &str = "startingTimestamp";
    pub(super) const PARENTS: &str = "parentShardIds";
    pub(super) const CHILDREN: &str = "childShardIds";
    pub(super) const COMPLETE_THROUGH: &str = "completeThrough";
    pub(super) const SEEK_EPOCH: &str = "seekEpoch";
    pub(super) const RESUME_CURSOR: &str = "resumeCursor";
    pub(super) const APPLIED_POSITION: &str = "appliedPosition";
    pub(super) const CHECKPOINT_VERSION: &str = "checkpointVersion";
    pub(super) const CLOSED_THROUGH: &str = "closedThrough";
    pub(super) const RECEIPTS_SINCE: &str = "receiptsSince";
    pub(super) const WANTED_BY: &str = "wantedBy";
    pub(super) const HANDOFF_ACK: &str = "handoffAck";
    pub(super) const MEMBERSHIP_EPOCH: &str = "membershipEpoch";
    pub(super) const MEMBERS: &str = "members";
    pub(super) const MEMBERSHIP_SEEKS: &str = "membershipSeeks";
    pub(super) const MEMBERSHIP_SEEK_EPOCHS: &str = "membershipSeekEpochs";
    pub(super) const SEEK_SKIPPED: &str = "seekSkipped";
    pub(super) const SOUGHT_AT: &str = "soughtAt";
    pub(super) const RETIRED_AT: &str = "retiredAt";
    pub(super) const WINDOW_START: &str = "windowStart";
    pub(super) const WINDOW_END: &str = "windowEnd";
    pub(super) const WINDOW_STATE: &str = "windowState";
    /// Prefix of a worker's beat in a roster item.
    pub(super) const BEAT: &str = "beat:";
    pub(super) const CHANGES: &str = "changes";
    pub(super) const FOUNDER: &str = "founder";
    pub(super) const SECTIONS: &str = "sections";
}
use attr::*;

type Item = HashMap<String, AttributeValue>;

/// Leases in a DynamoDB table keyed by the string `leaseKey` (`stream#shardId`).
///
/// ```no_run
/// # async fn demo() -> Result<(), shardwise::Error> {
/// use shardwise::lease::{DynamoDbLeaseStore, LeaseStore};
/// let config = aws_config::load_from_env().await;
/// let store = DynamoDbLeaseStore::new(aws_sdk_dynamodb::Client::new(&config), "my-app-leases");
/// store.prepare().await?; // creates the table (on demand) unless told not to
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct DynamoDbLeaseStore {
    client: Client,
    table: String,
    create_if_missing: bool,
    options: TableOptions,
}

impl fmt::Debug for DynamoDbLeaseStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DynamoDbLeaseStore")
            .field("table", &self.table)
            .field("create_if_missing", &self.create_if_missing)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl DynamoDbLeaseStore {
    /// A store on `table`, reached through `client`. Nothing is sent until
    /// [`prepare`](LeaseStore::prepare) or another call. Every call is bounded: timeouts the
    /// client's config leaves unset are filled in ([`ATTEMPT_TIMEOUT`](crate::lease::ATTEMPT_TIMEOUT)
    /// per attempt, [`CALL_TIMEOUT`](crate::lease::CALL_TIMEOUT) with retries), so a connection
    /// that stops answering fails a call instead of wedging it.
    pub fn new(client: Client, table: impl Into<String>) -> Self {
        Self {
            client: crate::dynamo::bounded(client),
            table: table.into(),
            create_if_missing: true,
            options: TableOptions::default(),
        }
    }

    /// How a missing table is created (billing mode, tags, point-in-time recovery).
    pub fn table_options(mut self, options: TableOptions) -> Self {
        self.options = options;
        self
    }

    /// Whether [`prepare`](LeaseStore::prepare) creates a missing table (on demand capacity, hash
    /// key `leaseKey` of type S). Default `true`; with `false` a missing table is an error.
    pub fn create_if_missing(mut self, create: bool) -> Self {
        self.create_if_missing = create;
        self
    }

    /// The lease table's name.
    pub fn table(&self) -> &str {
        &self.table
    }

    fn failed<E>(&self, operation: &'static str, err: E) -> Error
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        crate::dynamo::failed(&self.table, operation, err)
    }

    /// The key of a stream's membership item: it has no `streamName`, so no scan of the stream's
    /// lease rows sees it.
    fn membership_key(stream: &str) -> String {
        format!("~membership#{stream}")
    }

    async fn get_membership(&self, stream: &str) -> Result<Option<Membership>, Error> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(KEY, s(Self::membership_key(stream)))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| self.failed("GetItem", e))?;
        let Some(item) = out.item else {
            return Ok(None);
        };
        let corrupt = |detail: String| Error::Corrupt {
            what: "membership item",
            detail,
        };
        let epoch = item
            .get(MEMBERSHIP_EPOCH)
            .and_then(|v| v.as_n().ok())
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| corrupt(format!("no number `{MEMBERSHIP_EPOCH}` in {item:?}")))?;
        let members = match item.get(MEMBERS) {
            Some(AttributeValue::L(list)) => list
                .iter()
                .map(|v| {
                    v.as_s()
                        .cloned()
                        .map_err(|_| corrupt(format!("{v:?} in `{MEMBERS}`")))
                })
                .collect::<Result<Vec<String>, Error>>()?,
            other => return Err(corrupt(format!("`{MEMBERS}` is {other:?}"))),
        };
        let seeks = item
            .get(MEMBERSHIP_SEEKS)
            .and_then(|v| v.as_n().ok())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        // Absent in an item an older version stored: `compute` falls back to the sum.
        let seek_epochs = match item.get(MEMBERSHIP_SEEK_EPOCHS) {
            None => BTreeMap::new(),
            Some(AttributeValue::M(epochs)) => epochs
                .iter()
                .map(|(shard, v)| {
                    v.as_n()
                        .ok()
                        .and_then(|n| n.parse().ok())
                        .map(|n| (shard.clone(), n))
                        .ok_or_else(|| {
                            corrupt(format!("{v:?} for `{shard}` in `{MEMBERSHIP_SEEK_EPOCHS}`"))
                        })
                })
                .collect::<Result<_, Error>>()?,
            Some(other) => return Err(corrupt(format!("`{MEMBERSHIP_SEEK_EPOCHS}` is {other:?}"))),
        };
        Ok(Some(Membership {
            epoch,
            members,
            seeks,
            seek_epochs,
        }))
    }

    async fn put_membership(
        &self,
        stream: &str,
        expected: Option<u64>,
        next: &Membership,
    ) -> Result<bool, Error> {
        let request = self
            .client
            .put_item()
            .table_name(&self.table)
            .item(KEY, s(Self::membership_key(stream)))
            .item(MEMBERSHIP_EPOCH, n(next.epoch))
            .item(MEMBERSHIP_SEEKS, n(next.seeks))
            .item(
                MEMBERSHIP_SEEK_EPOCHS,
                AttributeValue::M(
                    next.seek_epochs
                        .iter()
                        .map(|(shard, epoch)| (shard.clone(), n(*epoch)))
                        .collect(),
                ),
            )
            .item(
                MEMBERS,
                AttributeValue::L(next.members.iter().map(|m| s(m.clone())).collect()),
            );
        let request = match expected {
            None => request
                .condition_expression("attribute_not_exists(#key)")
                .expression_attribute_names("#key", KEY),
            Some(epoch) => request
                .condition_expression("#epoch = :epoch")
                .expression_attribute_names("#epoch", MEMBERSHIP_EPOCH)
                .expression_attribute_values(":epoch", n(epoch)),
        };
        match request.send().await {
            Ok(_) => Ok(true),
            Err(err) if is_condition_failed(&err) => Ok(false),
            Err(err) => Err(self.failed("PutItem", err)),
        }
    }

    async fn get_row(&self, key: String) -> Result<Option<Lease>, Error> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(KEY, AttributeValue::S(key))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| self.failed("GetItem", e))?;
        out.item.as_ref().map(parse_row).transpose()
    }

    async fn list_rows(&self, stream: &str) -> Result<Vec<Lease>, Error> {
        let items = self
            .client
            .scan()
            .table_name(&self.table)
            .consistent_read(true)
            .filter_expression("#stream = :stream")
            .expression_attribute_names("#stream", STREAM)
            .expression_attribute_values(":stream", AttributeValue::S(stream.to_owned()))
            .into_paginator()
            .items()
            .send()
            .try_collect()
            .await
            .map_err(|e| self.failed("Scan", e))?;
        let mut rows = items.iter().map(parse_row).collect::<Result<Vec<_>, _>>()?;
        rows.sort_by(|a, b| a.shard_id.cmp(&b.shard_id));
        Ok(rows)
    }

    async fn create_row(&self, lease: &NewLease) -> Result<bool, Error> {
        let mut item = Item::new();
        item.insert(KEY.into(), s(lease_key(&lease.stream, &lease.shard_id)));
        item.insert(STREAM.into(), s(&lease.stream));
        item.insert(SHARD.into(), s(&lease.shard_id));
        item.insert(COUNTER.into(), n(0u64));
        item.insert(EPOCH.into(), n(0u64));
        item.insert(SEEK_EPOCH.into(), n(0u64));
        item.insert(CHECKPOINT.into(), s(lease.checkpoint.label()));
        item.insert(SUB.into(), n(lease.checkpoint.sub_sequence()));
        item.insert(CHECKPOINT_KEY.into(), s(lease.checkpoint.sort_key()));
        if let Checkpoint::AtTimestamp(t) = lease.checkpoint {
            item.insert(STARTING_TIMESTAMP.into(), n(millis(t)));
        }
        if !lease.parents.is_empty() {
            item.insert(PARENTS.into(), list(&lease.parents));
        }
        let result = self
            .client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(item))
            .condition_expression("attribute_not_exists(#key)")
            .expression_attribute_names("#key", KEY)
            .send()
            .await;
        match result {
            Ok(_) => Ok(true),
            Err(err) if is_condition_failed(&err) => Ok(false),
            Err(err) => Err(self.failed("PutItem", err)),
        }
    }

    async fn take_row(&self, seen: &Lease, owner: &str) -> Result<Option<Lease>, Error> {
        let mut request = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(KEY, s(seen.key()))
            .update_expression(
                "SET #owner = :owner, \
                 #counter = if_not_exists(#counter, :zero) + :one, \
                 #epoch = if_not_exists(#epoch, :zero) + :one \
                 REMOVE #wanted, #ack, #retired",
            )
            .expression_attribute_names("#retired", RETIRED_AT)
            .expression_attribute_names("#wanted", WANTED_BY)
            .expression_attribute_names("#ack", HANDOFF_ACK)
            .expression_attribute_names("#key", KEY)
            .expression_attribute_names("#owner", OWNER)
            .expression_attribute_names("#counter", COUNTER)
            .expression_attribute_names("#epoch", EPOCH)
            .expression_attribute_values(":owner", s(owner))
            .expression_attribute_values(":zero", n(0u64))
            .expression_attribute_values(":one", n(1u64))
            .expression_attribute_values(":seenCounter", n(seen.counter))
            .return_values(ReturnValue::AllNew);
        // A counter that was never written reads as 0.
        let counter = if seen.counter == 0 {
            "(attribute_not_exists(#counter) OR #counter = :seenCounter)"
        } else {
            "#counter = :seenCounter"
        };
        let condition = match &seen.owner {
            None => {
                format!("attribute_exists(#key) AND {counter} AND attribute_not_exists(#owner)")
            }
            Some(previous) => {
                request = request.expression_attribute_values(":seenOwner", s(previous));
                format!("attribute_exists(#key) AND {counter} AND #owner = :seenOwner")
            }
        };
        match request.condition_expression(condition).send().await {
            Ok(out) => match out.attributes {
                Some(item) if !item.is_empty() => parse_row(&item).map(Some),
                // Not every emulator returns the new row; read it back.
                _ => self.get_row(seen.key()).await,
            },
            Err(err) if is_condition_failed(&err) => Ok(None),
            Err(err) => Err(self.failed("UpdateItem", err)),
        }
    }

    /// An UpdateItem of `held`'s row conditioned on its owner and epoch (`#owner = :owner AND
    /// #epoch = :epoch`, then `AND also` when given). The caller adds its update expression and the
    /// other names and values it uses (DynamoDB refuses unused ones).
    fn fenced(&self, held: &Ownership, also: Option<&str>) -> UpdateItemFluentBuilder {
        let fence = "#owner = :owner AND #epoch = :epoch";
        self.client
            .update_item()
            .table_name(&self.table)
            .key(KEY, s(held.key()))
            .condition_expression(match also {
                Some(also) => format!("{fence} AND {also}"),
                None => fence.to_string(),
            })
            .expression_attribute_names("#owner", OWNER)
            .expression_attribute_names("#epoch", EPOCH)
            .expression_attribute_values(":owner", s(&held.owner))
            .expression_attribute_values(":epoch", n(held.epoch))
    }

    /// A conditional write's answer: `true` stored, `false` refused by its condition.
    fn stored(
        &self,
        result: Result<UpdateItemOutput, SdkError<UpdateItemError, HttpResponse>>,
    ) -> Result<bool, Error> {
        match result {
            Ok(_) => Ok(true),
            Err(err) if is_condition_failed(&err) => Ok(false),
            Err(err) => Err(self.failed("UpdateItem", err)),
        }
    }

    /// `renew`: counter + 1; the row comes back with the write, carrying any handoff request.
    async fn renew_row(&self, held: &Ownership) -> Result<Renewal, Error> {
        let result = self
            .fenced(held, None)
            .update_expression("SET #counter = #counter + :one")
            .expression_attribute_names("#counter", COUNTER)
            .expression_attribute_values(":one", n(1u64))
            .return_values(ReturnValue::AllNew)
            .send()
            .await;
        match result {
            Ok(out) => Ok(Renewal::Renewed {
                wanted_by: out
                    .attributes()
                    .and_then(|row| row.get(WANTED_BY))
                    .and_then(|v| v.as_s().ok())
                    .cloned(),
            }),
            Err(err) if is_condition_failed(&err) => Ok(Renewal::Lost),
            Err(err) => Err(self.failed("UpdateItem", err)),
        }
    }

    /// The key of a section of a stream's roster (no `streamName`: no scan of the rows sees it).
    fn roster_key(stream: &str, section: u32) -> String {
        match section {
            0 => format!("~workers#{stream}"),
            k => format!("~workers#{stream}#{k}"),
        }
    }

    /// A roster section from its item's attributes (`beat_before` not set).
    fn roster_of<'i>(
        section: u32,
        attributes: impl IntoIterator<Item = (&'i String, &'i AttributeValue)>,
    ) -> Roster {
        let number = |v: &AttributeValue| v.as_n().ok().and_then(|n| n.parse::<u64>().ok());
        let mut roster = Roster::default();
        for (name, value) in attributes {
            if let Some(worker) = name.strip_prefix(BEAT) {
                if let Some(beat) = number(value) {
                    roster.beats.insert(worker.to_string(), beat);
                }
            } else if name == CHANGES {
                roster.changes = number(value).unwrap_or(0);
            } else if name == FOUNDER {
                roster.founder = value.as_s().ok().cloned();
            } else if name == SECTIONS && section == 0 {
                roster.sections = number(value).and_then(|n| u32::try_from(n).ok());
            }
        }
        if section == 0 {
            roster.sections = Some(roster.sections.unwrap_or(1).max(1));
        }
        roster
    }

    /// `beat`: `beat:<worker>` + 1 (and `changes` + 1), the section returned as written.
    async fn beat_roster(
        &self,
        stream: &str,
        section: u32,
        worker: &str,
        beat: u64,
        announce: bool,
    ) -> Result<Roster, Error> {
        let mut request = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(KEY, s(Self::roster_key(stream, section)))
            .expression_attribute_names("#beat", format!("{BEAT}{worker}"))
            .expression_attribute_names("#founder", FOUNDER)
            .expression_attribute_values(":me", s(worker))
            .expression_attribute_values(":beat", n(beat))
            // The item before the write: it alone tells which process wrote the entry's beat.
            // The roster as written follows from it.
            .return_values(ReturnValue::AllOld);
        let set = "SET #founder = if_not_exists(#founder, :me), #beat = :beat";
        request = if announce {
            request
                .update_expression(format!("{set} ADD #changes :one"))
                .expression_attribute_names("#changes", CHANGES)
                .expression_attribute_values(":one", n(1u64))
        } else {
            request.update_expression(set)
        };
        let out = request
            .send()
            .await
            .map_err(|e| self.failed("UpdateItem", e))?;
        let mut roster = Self::roster_of(section, out.attributes().into_iter().flatten());
        roster.beat_before = roster.beats.insert(worker.to_string(), beat);
        roster.changes += u64::from(announce);
        roster.founder.get_or_insert_with(|| worker.to_string());
        Ok(roster)
    }

    /// `forget`: `beat:<worker>` removed, when `seen` is given only if it is still that value.
    async fn forget_worker(
        &self,
        stream: &str,
        section: u32,
        worker: &str,
        seen: Option<u64>,
    ) -> Result<bool, Error> {
        let mut request = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(KEY, s(Self::roster_key(stream, section)))
            .expression_attribute_names("#beat", format!("{BEAT}{worker}"));
        request = match seen {
            Some(seen) => request
                .update_expression("REMOVE #beat")
                .condition_expression("#beat = :seen")
                .expression_attribute_values(":seen", n(seen)),
            None => request
                .update_expression("REMOVE #beat ADD #changes :one")
                .expression_attribute_names("#changes", CHANGES)
                .expression_attribute_values(":one", n(1u64)),
        };
        self.stored(request.send().await)
    }

    /// `read_roster`: the sections' items by BatchGetItem (strongly consistent; at most 100 keys a
    /// request, keys left unprocessed asked again after a short wait).
    async fn read_sections(&self, stream: &str, sections: &[u32]) -> Result<Vec<Roster>, Error> {
        use aws_sdk_dynamodb::types::KeysAndAttributes;
        let mut found: HashMap<String, Item> = HashMap::new();
        for chunk in sections.chunks(100) {
            let mut keys: Vec<Item> = chunk
                .iter()
                .map(|&k| HashMap::from([(KEY.to_string(), s(Self::roster_key(stream, k)))]))
                .collect();
            let mut wait = std::time::Duration::from_millis(50);
            while !keys.is_empty() {
                let request = KeysAndAttributes::builder()
                    .set_keys(Some(std::mem::take(&mut keys)))
                    .consistent_read(true)
                    .build()
                    .map_err(|e| self.failed("BatchGetItem", e))?;
                let out = self
                    .client
                    .batch_get_item()
                    .request_items(&self.table, request)
                    .send()
                    .await
                    .map_err(|e| self.failed("BatchGetItem", e))?;
                for item in out
                    .responses()
                    .and_then(|r| r.get(&self.table))
                    .into_iter()
                    .flatten()
                {
                    if let Some(key) = item.get(KEY).and_then(|k| k.as_s().ok()) {
                        found.insert(key.clone(), item.clone());
                    }
                }
                keys = out
                    .unprocessed_keys()
                    .and_then(|u| u.get(&self.table))
                    .map(|k| k.keys().to_vec())
                    .unwrap_or_default();
                if !keys.is_empty() {
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(std::time::Duration::from_secs(1));
                }
            }
        }
        Ok(sections
            .iter()
            .map(|&k| match found.get(&Self::roster_key(stream, k)) {
                Some(item) => Self::roster_of(k, item),
                None => Self::roster_of(k, std::iter::empty()),
            })
            .collect())
    }

    /// `split_roster`: section 0's `sections` = `to`, if it is `from` (absent counting as 1).
    async fn split_sections(&self, stream: &str, from: u32, to: u32) -> Result<bool, Error> {
        let condition = if from == 1 {
            "attribute_not_exists(#sections) OR #sections = :from"
        } else {
            "#sections = :from"
        };
        let result = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(KEY, s(Self::roster_key(stream, 0)))
            .update_expression("SET #sections = :to")
            .condition_expression(condition)
            .expression_attribute_names("#sections", SECTIONS)
            .expression_attribute_values(":from", n(u64::from(from)))
            .expression_attribute_values(":to", n(u64::from(to)))
            .send()
            .await;
        self.stored(result)
    }

    /// `release`: owner removed, counter + 1, any handoff request removed.
    async fn release_row(&self, held: &Ownership) -> Result<bool, Error> {
        let result = self
            .fenced(held, None)
            .update_expression("REMOVE #owner, #wanted, #ack SET #counter = #counter + :one")
            .expression_attribute_names("#counter", COUNTER)
            .expression_attribute_names("#wanted", WANTED_BY)
            .expression_attribute_names("#ack", HANDOFF_ACK)
            .expression_attribute_values(":one", n(1u64))
            .send()
            .await;
        self.stored(result)
    }

    /// `retire`: `retiredAt` set, the owner and any request removed, counter + 1, under the
    /// owner and epoch, on a row not at SHARD_END.
    async fn retire_row(&self, held: &Ownership, at: i64) -> Result<bool, Error> {
        let result = self
            .fenced(held, Some("#cp <> :end"))
            .update_expression(
                "REMOVE #owner, #wanted, #ack SET #counter = #counter + :one, #retired = :at",
            )
            .expression_attribute_names("#counter", COUNTER)
            .expression_attribute_names("#wanted", WANTED_BY)
            .expression_attribute_names("#ack", HANDOFF_ACK)
            .expression_attribute_names("#cp", CHECKPOINT)
            .expression_attribute_names("#retired", RETIRED_AT)
            .expression_attribute_values(":one", n(1u64))
            .expression_attribute_values(":end", s(crate::checkpoint::SHARD_END))
            .expression_attribute_values(":at", n(at))
            .send()
            .await;
        self.stored(result)
    }

    /// `request`: `wantedBy` = the taker, under the owner and epoch seen, when none is pending.
    async fn request_row(&self, seen: &Lease, taker: &str) -> Result<bool, Error> {
        let Some(owned) = seen.ownership() else {
            return Ok(false);
        };
        let result = self
            .fenced(&owned, Some("attribute_not_exists(#wanted)"))
            .update_expression("SET #wanted = :taker")
            .expression_attribute_names("#wanted", WANTED_BY)
            .expression_attribute_values(":taker", s(taker))
            .send()
            .await;
        self.stored(result)
    }

    /// `pass`: owner = the taker that asked, epoch + 1, counter + 1, the request removed.
    async fn pass_row(&self, held: &Ownership, taker: &str) -> Result<bool, Error> {
        let result = self
            .fenced(held, Some("#wanted = :taker"))
            .update_expression(
                "SET #owner = :taker, #epoch = #epoch + :one, #counter = #counter + :one \
                 REMOVE #wanted, #ack",
            )
            .expression_attribute_names("#counter", COUNTER)
            .expression_attribute_names("#wanted", WANTED_BY)
            .expression_attribute_names("#ack", HANDOFF_ACK)
            .expression_attribute_values(":taker", s(taker))
            .expression_attribute_values(":one", n(1u64))
            .send()
            .await;
        self.stored(result)
    }

    /// `acknowledge`: `handoffAck` = the taker, under the owner, the epoch and its request.
    async fn acknowledge_row(&self, held: &Ownership, taker: &str) -> Result<bool, Error> {
        let result = self
            .fenced(held, Some("#wanted = :taker"))
            .update_expression("SET #ack = :taker")
            .expression_attribute_names("#wanted", WANTED_BY)
            .expression_attribute_names("#ack", HANDOFF_ACK)
            .expression_attribute_values(":taker", s(taker))
            .send()
            .await;
        self.stored(result)
    }

    async fn checkpoint_row(
        &self,
        held: &Ownership,
        to: &Checkpoint,
        complete_through: Option<i64>,
        window: Option<Option<&WindowState>>,
    ) -> Result<CheckpointWrite, Error> {
        let first = self
            .checkpoint_request(held, to, complete_through, window)
            .await;
        // `completeThrough` only rises: a write whose coordinate is below the stored one (after an
        // earlier write that timed out but was applied) is refused as a whole. The checkpoint
        // itself may still be newer: then write it alone.
        if let Some(ct) = complete_through
            && let Err(err) = &first
            && is_condition_failed(err)
        {
            let newer_checkpoint = match refused_item(err) {
                Some(item) => {
                    holds(item, held)
                        && matches!(item.get(CHECKPOINT_KEY), Some(AttributeValue::S(k)) if *k < to.sort_key())
                }
                None => self.get_row(held.key()).await?.is_some_and(|row| {
                    row.ownership().as_ref() == Some(held)
                        && row.checkpoint.sort_key() < to.sort_key()
                        && row.complete_through.is_some_and(|stored| stored > ct)
                }),
            };
            if newer_checkpoint {
                let second = self.checkpoint_request(held, to, None, window).await;
                return self.fenced_write_result(held, second).await;
            }
        }
        self.fenced_write_result(held, first).await
    }

    /// The checkpoint write; `window`: `None` leaves the window state (and the position must
    /// rise), `Some` sets it (`Some(None)` removes it) and the position may stay. SHARD_END
    /// removes it always.
    async fn checkpoint_request(
        &self,
        held: &Ownership,
        to: &Checkpoint,
        complete_through: Option<i64>,
        window: Option<Option<&WindowState>>,
    ) -> Result<UpdateItemOutput, SdkError<UpdateItemError, HttpResponse>> {
        let mut set = String::from("SET #cp = :cp, #sub = :sub, #cpKey = :cpKey");
        let mut remove = String::new();
        let mut condition = format!(
            "#owner = :owner AND #epoch = :epoch \
             AND (attribute_not_exists(#cpKey) OR #cpKey {} :cpKey)",
            if window.is_some() { "<=" } else { "<" }
        );
        let mut request = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(KEY, s(held.key()))
            .expression_attribute_names("#owner", OWNER)
            .expression_attribute_names("#epoch", EPOCH)
            .expression_attribute_names("#cp", CHECKPOINT)
            .expression_attribute_names("#sub", SUB)
            .expression_attribute_names("#cpKey", CHECKPOINT_KEY)
            .expression_attribute_values(":owner", s(&held.owner))
            .expression_attribute_values(":epoch", n(held.epoch))
            .expression_attribute_values(":cp", s(to.label()))
            .expression_attribute_values(":sub", n(to.sub_sequence()))
            .expression_attribute_values(":cpKey", s(to.sort_key()))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        if let Some(ms) = complete_through {
            set.push_str(", #ct = :ct");
            condition.push_str(" AND (attribute_not_exists(#ct) OR #ct <= :ct)");
            request = request
                .expression_attribute_names("#ct", COMPLETE_THROUGH)
                .expression_attribute_values(":ct", n(ms));
        }
        if let Checkpoint::AtTimestamp(t) = to {
            set.push_str(", #ts = :ts");
            request = request
                .expression_attribute_names("#ts", STARTING_TIMESTAMP)
                .expression_attribute_values(":ts", n(millis(*t)));
        }
        let window = if to.is_shard_end() {
            Some(None)
        } else {
            window
        };
        if let Some(window) = window {
            request = request
                .expression_attribute_names("#winStart", WINDOW_START)
                .expression_attribute_names("#winEnd", WINDOW_END)
                .expression_attribute_names("#winState", WINDOW_STATE);
            match window {
                Some(w) => {
                    set.push_str(
                        ", #winStart = :winStart, #winEnd = :winEnd, #winState = :winState",
                    );
                    request = request
                        .expression_attribute_values(":winStart", n(w.window.start_ms))
                        .expression_attribute_values(":winEnd", n(w.window.end_ms))
                        .expression_attribute_values(":winState", blob(&w.state));
                }
                None => remove.push_str(" REMOVE #winStart, #winEnd, #winState"),
            }
        }
        request
            .update_expression(set + &remove)
            .condition_expression(condition)
            .send()
            .await
    }

    /// The paged progress write of `docs/paged.md`: owner, epoch, the attempt's cursor and
    /// version, and an applied position that does not go down.
    async fn paged_checkpoint_row(
        &self,
        held: &Ownership,
        expected: &PagedProgress,
        to: &PagedProgress,
    ) -> Result<CheckpointWrite, Error> {
        let same_attempt = to.checkpoint_version == expected.checkpoint_version;
        if !paged_write_is_of_the_attempt(expected, to) {
            // Not a write of this attempt, as the memory store refuses it too.
            return Ok(CheckpointWrite::NotNewer);
        }
        let mut condition = String::from("#owner = :owner AND #epoch = :epoch");
        let mut set = vec!["#version = :version"];
        let mut remove = Vec::new();
        let mut request = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(KEY, s(held.key()))
            .expression_attribute_names("#owner", OWNER)
            .expression_attribute_names("#epoch", EPOCH)
            .expression_attribute_names("#version", CHECKPOINT_VERSION)
            .expression_attribute_names("#cursor", RESUME_CURSOR)
            .expression_attribute_names("#applied", APPLIED_POSITION)
            .expression_attribute_names("#closed", CLOSED_THROUGH)
            .expression_attribute_values(":owner", s(&held.owner))
            .expression_attribute_values(":epoch", n(held.epoch))
            .expression_attribute_values(":seenVersion", n(expected.checkpoint_version))
            .expression_attribute_values(":version", n(to.checkpoint_version))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        // A version never written reads as 0.
        condition.push_str(if expected.checkpoint_version == 0 {
            " AND (attribute_not_exists(#version) OR #version = :seenVersion)"
        } else {
            " AND #version = :seenVersion"
        });
        match &expected.resume_cursor {
            Some(cursor) => {
                condition.push_str(" AND #cursor = :seenCursor");
                request =
                    request.expression_attribute_values(":seenCursor", blob(cursor.as_bytes()));
            }
            None => condition.push_str(" AND attribute_not_exists(#cursor)"),
        }
        match expected.closed_through {
            Some(closed) => {
                condition.push_str(" AND #closed = :seenClosed");
                request = request.expression_attribute_values(":seenClosed", n(closed));
            }
            None => condition.push_str(" AND attribute_not_exists(#closed)"),
        }
        match to.closed_through {
            Some(closed) => {
                set.push("#closed = :closed");
                request = request.expression_attribute_values(":closed", n(closed));
            }
            None => remove.push("#closed"),
        }
        match &to.resume_cursor {
            Some(cursor) => {
                set.push("#cursor = :cursor");
                request = request.expression_attribute_values(":cursor", blob(cursor.as_bytes()));
            }
            None => remove.push("#cursor"),
        }
        request = request.expression_attribute_names("#receiptsSince", RECEIPTS_SINCE);
        match to.receipts_since {
            Some(since) => {
                set.push("#receiptsSince = :receiptsSince");
                request = request.expression_attribute_values(":receiptsSince", n(since));
            }
            None => remove.push("#receiptsSince"),
        }
        match &to.applied_position {
            Some(applied) => {
                set.push("#applied = :applied");
                condition.push_str(if same_attempt {
                    " AND (attribute_not_exists(#applied) OR #applied < :applied)"
                } else {
                    " AND (attribute_not_exists(#applied) OR #applied <= :applied)"
                });
                request = request.expression_attribute_values(":applied", blob(applied.as_bytes()));
            }
            None => condition.push_str(" AND attribute_not_exists(#applied)"),
        }
        let mut update = format!("SET {}", set.join(", "));
        if !remove.is_empty() {
            update.push_str(&format!(" REMOVE {}", remove.join(", ")));
        }
        let result = request
            .update_expression(update)
            .condition_expression(condition)
            .send()
            .await;
        self.fenced_write_result(held, result).await
    }

    /// Reads the answer to a write conditioned on ownership and on the new value being greater:
    /// a refused condition is `NotNewer` while the lease is still ours, `Lost` otherwise, told
    /// apart by the row the store refused (or, if it sent none, by reading the row).
    async fn fenced_write_result<O>(
        &self,
        held: &Ownership,
        result: Result<O, SdkError<UpdateItemError, HttpResponse>>,
    ) -> Result<CheckpointWrite, Error> {
        let err = match result {
            Ok(_) => return Ok(CheckpointWrite::Written),
            Err(err) if is_condition_failed(&err) => err,
            Err(err) => return Err(self.failed("UpdateItem", err)),
        };
        let still_ours = match refused_item(&err) {
            Some(item) => holds(item, held),
            None => self.get_row(held.key()).await?.is_some_and(|row| {
                row.owner.as_deref() == Some(&held.owner) && row.owner_epoch == held.epoch
            }),
        };
        Ok(if still_ours {
            CheckpointWrite::NotNewer
        } else {
            CheckpointWrite::Lost
        })
    }

    /// The update of one seek move: its expression, names and values.
    fn seek_update(m: &SeekMove) -> (String, HashMap<String, String>, Item) {
        let mut set = String::from(
            "REMOVE #owner, #wanted, #ack, #retired, #winStart, #winEnd, #winState \
             SET #cp = :cp, #sub = :sub, #cpKey = :cpKey, \
             #seek = #seek + :one, #epoch = #epoch + :one, #counter = #counter + :one, \
             #soughtAt = :soughtAt",
        );
        let mut names: HashMap<String, String> = [
            ("#owner", OWNER),
            ("#wanted", WANTED_BY),
            ("#ack", HANDOFF_ACK),
            ("#epoch", EPOCH),
            ("#counter", COUNTER),
            ("#seek", SEEK_EPOCH),
            ("#cp", CHECKPOINT),
            ("#sub", SUB),
            ("#cpKey", CHECKPOINT_KEY),
            ("#soughtAt", SOUGHT_AT),
            ("#retired", RETIRED_AT),
            ("#winStart", WINDOW_START),
            ("#winEnd", WINDOW_END),
            ("#winState", WINDOW_STATE),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let mut values: Item = [
            (":soughtAt", n(millis(crate::time::now()))),
            (":seenSeek", n(m.seen.seek_epoch)),
            (":one", n(1u64)),
            (":cp", s(m.to.label())),
            (":sub", n(m.to.sub_sequence())),
            (":cpKey", s(m.to.sort_key())),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        names.insert("#skipped".into(), SEEK_SKIPPED.into());
        match &m.skipped {
            Some(skipped) => {
                set.push_str(", #skipped = :skipped");
                values.insert(":skipped".into(), skipped_value(skipped));
            }
            None => set = set.replacen("REMOVE #owner", "REMOVE #owner, #skipped", 1),
        }
        if let Checkpoint::AtTimestamp(t) = &m.to {
            set.push_str(", #ts = :ts");
            names.insert("#ts".into(), STARTING_TIMESTAMP.into());
            values.insert(":ts".into(), n(millis(*t)));
        }
        if let Some(progress) = &m.progress {
            set.push_str(", #version = if_not_exists(#version, :zero) + :one");
            names.insert("#version".into(), CHECKPOINT_VERSION.into());
            values.insert(":zero".into(), n(0u64));
            let mut remove = Vec::new();
            match &progress.resume_cursor {
                Some(cursor) => {
                    set.push_str(", #cursor = :cursor");
                    values.insert(":cursor".into(), blob(cursor.as_bytes()));
                }
                None => remove.push("#cursor"),
            }
            match &progress.applied_position {
                Some(applied) => {
                    set.push_str(", #applied = :applied");
                    values.insert(":applied".into(), blob(applied.as_bytes()));
                }
                None => remove.push("#applied"),
            }
            match progress.closed_through {
                Some(closed) => {
                    set.push_str(", #closed = :closed");
                    values.insert(":closed".into(), n(closed));
                }
                None => remove.push("#closed"),
            }
            match progress.receipts_since {
                Some(since) => {
                    set.push_str(", #receiptsSince = :receiptsSince");
                    values.insert(":receiptsSince".into(), n(since));
                }
                None => remove.push("#receiptsSince"),
            }
            names.insert("#cursor".into(), RESUME_CURSOR.into());
            names.insert("#applied".into(), APPLIED_POSITION.into());
            names.insert("#closed".into(), CLOSED_THROUGH.into());
            names.insert("#receiptsSince".into(), RECEIPTS_SINCE.into());
            if !remove.is_empty() {
                // `REMOVE #owner` opens the expression: the paged attributes join that clause.
                set = set.replacen(
                    "REMOVE #owner",
                    &format!("REMOVE #owner, {}", remove.join(", ")),
                    1,
                );
            }
        }
        (set, names, values)
    }

    async fn seek_rows(&self, moves: &[SeekMove]) -> Result<bool, Error> {
        const CONDITION: &str = "#seek = :seenSeek";
        match moves {
            [] => Ok(true),
            [m] => {
                let (update, names, values) = Self::seek_update(m);
                let result = self
                    .client
                    .update_item()
                    .table_name(&self.table)
                    .key(KEY, s(m.seen.key()))
                    .update_expression(update)
                    .condition_expression(CONDITION)
                    .set_expression_attribute_names(Some(names))
                    .set_expression_attribute_values(Some(values))
                    .send()
                    .await;
                match result {
                    Ok(_) => Ok(true),
                    Err(err) if is_condition_failed(&err) => Ok(false),
                    Err(err) => Err(self.failed("UpdateItem", err)),
                }
            }
            many => {
                if many.len() > MAX_SEEK_MOVES {
                    return Err(Error::Corrupt {
                        what: "seek",
                        detail: format!(
                            "{} rows must move together, more than one transaction takes ({MAX_SEEK_MOVES})",
                            many.len()
                        ),
                    });
                }
                let mut items = Vec::with_capacity(many.len());
                for m in many {
                    let (update, names, values) = Self::seek_update(m);
                    let update = Update::builder()
                        .table_name(&self.table)
                        .key(KEY, s(m.seen.key()))
                        .update_expression(update)
                        .condition_expression(CONDITION)
                        .set_expression_attribute_names(Some(names))
                        .set_expression_attribute_values(Some(values))
                        .build()
                        .map_err(|e| self.failed("TransactWriteItems", e))?;
                    items.push(TransactWriteItem::builder().update(update).build());
                }
                let result = self
                    .client
                    .transact_write_items()
                    .set_transact_items(Some(items))
                    .send()
                    .await;
                match result {
                    Ok(_) => Ok(true),
                    // A condition failed (a concurrent seek), or another transaction touched a
                    // row at the same time: nothing was written; the caller reads and retries.
                    Err(err)
                        if err
                            .as_service_error()
                            .is_some_and(|e| e.is_transaction_canceled_exception()) =>
                    {
                        Ok(false)
                    }
                    Err(err) => Err(self.failed("TransactWriteItems", err)),
                }
            }
        }
    }

    async fn delete_row(&self, seen: &Lease) -> Result<bool, Error> {
        let result = self
            .client
            .delete_item()
            .table_name(&self.table)
            .key(KEY, s(seen.key()))
            .condition_expression("#cp = :end AND #counter = :seen")
            .expression_attribute_names("#cp", CHECKPOINT)
            .expression_attribute_names("#counter", COUNTER)
            .expression_attribute_values(":end", s(Checkpoint::ShardEnd.label()))
            .expression_attribute_values(":seen", n(seen.counter))
            .send()
            .await;
        match result {
            Ok(_) => Ok(true),
            Err(err) if is_condition_failed(&err) => Ok(false),
            Err(err) => Err(self.failed("DeleteItem", err)),
        }
    }

    async fn advance_frontier_row(
        &self,
        held: &Ownership,
        complete_through: i64,
    ) -> Result<CheckpointWrite, Error> {
        let result = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(KEY, s(held.key()))
            .update_expression("SET #ct = :ct")
            .condition_expression(
                "#owner = :owner AND #epoch = :epoch AND (attribute_not_exists(#ct) OR #ct < :ct)",
            )
            .expression_attribute_names("#owner", OWNER)
            .expression_attribute_names("#epoch", EPOCH)
            .expression_attribute_names("#ct", COMPLETE_THROUGH)
            .expression_attribute_values(":owner", s(&held.owner))
            .expression_attribute_values(":epoch", n(held.epoch))
            .expression_attribute_values(":ct", n(complete_through))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        self.fenced_write_result(held, result).await
    }

    async fn set_children_row(
        &self,
        stream: &str,
        shard_id: &str,
        children: &[String],
    ) -> Result<(), Error> {
        let result = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(KEY, s(lease_key(stream, shard_id)))
            .update_expression("SET #children = :children")
            .condition_expression("attribute_exists(#key)")
            .expression_attribute_names("#key", KEY)
            .expression_attribute_names("#children", CHILDREN)
            .expression_attribute_values(":children", list(children))
            .send()
            .await;
        match result {
            Ok(_) => Ok(()),
            // No row for the shard (it was never created, or was cleaned up): nothing to record.
            Err(err) if is_condition_failed(&err) => {
                tracing::debug!(table = %self.table, stream, shard_id, "no lease row to record children on");
                Ok(())
            }
            Err(err) => Err(self.failed("UpdateItem", err)),
        }
    }

    async fn prepare_table(&self) -> Result<(), Error> {
        self.shared()
            .prepare(KEY, self.create_if_missing, &self.options)
            .await
            .map(|_| ())
    }

    fn shared(&self) -> Table<'_> {
        Table::new(&self.client, &self.table, |table, reason| {
            Error::LeaseTableSchema { table, reason }
        })
    }
}

impl LeaseStore for DynamoDbLeaseStore {
    fn prepare(&self) -> BoxFuture<'_, Result<(), Error>> {
        Box::pin(self.prepare_table())
    }

    fn list<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<Vec<Lease>, Error>> {
        Box::pin(self.list_rows(stream))
    }

    fn get<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Lease>, Error>> {
        Box::pin(self.get_row(lease_key(stream, shard_id)))
    }

    fn create<'a>(&'a self, lease: &'a NewLease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(self.create_row(lease))
    }

    fn take<'a>(
        &'a self,
        seen: &'a Lease,
        owner: &'a str,
    ) -> BoxFuture<'a, Result<Option<Lease>, Error>> {
        Box::pin(self.take_row(seen, owner))
    }

    fn renew<'a>(&'a self, held: &'a Ownership) -> BoxFuture<'a, Result<Renewal, Error>> {
        Box::pin(self.renew_row(held))
    }

    fn checkpoint<'a>(
        &'a self,
        held: &'a Ownership,
        to: &'a Checkpoint,
        complete_through: Option<i64>,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        Box::pin(self.checkpoint_row(held, to, complete_through, None))
    }

    fn checkpoint_window<'a>(
        &'a self,
        held: &'a Ownership,
        to: &'a Checkpoint,
        complete_through: Option<i64>,
        window: Option<&'a WindowState>,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        Box::pin(self.checkpoint_row(held, to, complete_through, Some(window)))
    }

    fn paged_checkpoint<'a>(
        &'a self,
        held: &'a Ownership,
        expected: &'a PagedProgress,
        to: &'a PagedProgress,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        Box::pin(self.paged_checkpoint_row(held, expected, to))
    }

    fn release<'a>(&'a self, held: &'a Ownership) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(self.release_row(held))
    }

    fn retire<'a>(&'a self, held: &'a Ownership, at: i64) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(self.retire_row(held, at))
    }

    fn seek<'a>(&'a self, moves: &'a [SeekMove]) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(self.seek_rows(moves))
    }

    fn advance_frontier<'a>(
        &'a self,
        held: &'a Ownership,
        complete_through: i64,
    ) -> BoxFuture<'a, Result<CheckpointWrite, Error>> {
        Box::pin(self.advance_frontier_row(held, complete_through))
    }

    fn delete<'a>(&'a self, seen: &'a Lease) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(self.delete_row(seen))
    }

    fn set_children<'a>(
        &'a self,
        stream: &'a str,
        shard_id: &'a str,
        children: &'a [String],
    ) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(self.set_children_row(stream, shard_id, children))
    }

    fn request<'a>(
        &'a self,
        seen: &'a Lease,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(self.request_row(seen, taker))
    }

    fn pass<'a>(
        &'a self,
        held: &'a Ownership,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(self.pass_row(held, taker))
    }

    fn membership<'a>(
        &'a self,
        stream: &'a str,
    ) -> BoxFuture<'a, Result<Option<Membership>, Error>> {
        Box::pin(self.get_membership(stream))
    }

    fn publish_membership<'a>(
        &'a self,
        stream: &'a str,
        expected: Option<u64>,
        next: &'a Membership,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(self.put_membership(stream, expected, next))
    }

    fn beat<'a>(
        &'a self,
        stream: &'a str,
        section: u32,
        worker: &'a str,
        beat: u64,
        announce: bool,
    ) -> BoxFuture<'a, Result<Roster, Error>> {
        Box::pin(self.beat_roster(stream, section, worker, beat, announce))
    }

    fn forget<'a>(
        &'a self,
        stream: &'a str,
        section: u32,
        worker: &'a str,
        seen: Option<u64>,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(self.forget_worker(stream, section, worker, seen))
    }

    fn read_roster<'a>(
        &'a self,
        stream: &'a str,
        sections: &'a [u32],
    ) -> BoxFuture<'a, Result<Vec<Roster>, Error>> {
        Box::pin(self.read_sections(stream, sections))
    }

    fn split_roster<'a>(
        &'a self,
        stream: &'a str,
        from: u32,
        to: u32,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(self.split_sections(stream, from, to))
    }

    fn acknowledge<'a>(
        &'a self,
        held: &'a Ownership,
        taker: &'a str,
    ) -> BoxFuture<'a, Result<bool, Error>> {
        Box::pin(self.acknowledge_row(held, taker))
    }

    fn announce<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            self.client
                .update_item()
                .table_name(&self.table)
                .key(KEY, s(Self::roster_key(stream, 0)))
                .update_expression("ADD #changes :one")
                .expression_attribute_names("#changes", CHANGES)
                .expression_attribute_values(":one", n(1u64))
                .send()
                .await
                .map_err(|e| self.failed("UpdateItem", e))?;
            Ok(())
        })
    }
}

/// The row a conditional update refused, when the store sent it back (`ALL_OLD`).
fn refused_item(err: &SdkError<UpdateItemError, HttpResponse>) -> Option<&Item> {
    match err {
        SdkError::ServiceError(service) => match service.err() {
            UpdateItemError::ConditionalCheckFailedException(e) => {
                e.item().filter(|item| !item.is_empty())
            }
            _ => None,
        },
        _ => None,
    }
}

/// Whether a refused row is still held by `held`'s owner under `held`'s epoch.
fn holds(item: &Item, held: &Ownership) -> bool {
    let owner = matches!(item.get(OWNER), Some(AttributeValue::S(o)) if *o == held.owner);
    let epoch =
        matches!(item.get(EPOCH), Some(AttributeValue::N(e)) if e.parse::<u64>() == Ok(held.epoch));
    owner && epoch
}

fn blob(bytes: &[u8]) -> AttributeValue {
    AttributeValue::B(Blob::new(bytes.to_vec()))
}

fn list(values: &[String]) -> AttributeValue {
    AttributeValue::L(values.iter().map(|v| s(v.as_str())).collect())
}

/// Reads one lease row; anything unreadable is [`Error::Corrupt`] naming the row and attribute.
fn parse_row(item: &Item) -> Result<Lease, Error> {
    let key = match item.get(KEY) {
        Some(AttributeValue::S(key)) => key.as_str(),
        other => {
            return Err(Error::Corrupt {
                what: "lease row",
                detail: format!(
                    "a row has no string `{KEY}` (found {})",
                    other.map_or("nothing".to_owned(), kind)
                ),
            });
        }
    };
    let row = Row { key, item };
    let stream = row.string(STREAM)?;
    let shard_id = row.string(SHARD)?;
    if lease_key(&stream, &shard_id) != key {
        return Err(row.corrupt(
            KEY,
            format!("does not match `{STREAM}#{SHARD}` ({stream}#{shard_id})"),
        ));
    }
    let label = row.string(CHECKPOINT)?;
    let sub = row.number::<u64>(SUB)?.unwrap_or(0);
    let starting = row.number::<i64>(STARTING_TIMESTAMP)?;
    if label == AT_TIMESTAMP && starting.is_none() {
        return Err(row.corrupt(
            STARTING_TIMESTAMP,
            "is missing for an AT_TIMESTAMP checkpoint",
        ));
    }
    let checkpoint = Checkpoint::from_stored(&label, sub, starting).ok_or_else(|| {
        row.corrupt(
            CHECKPOINT,
            format!("`{label}` is neither a sequence number nor a known sentinel"),
        )
    })?;
    Ok(Lease {
        owner: row.optional_string(OWNER)?,
        counter: row.number(COUNTER)?.unwrap_or(0),
        owner_epoch: row.number(EPOCH)?.unwrap_or(0),
        checkpoint,
        parents: row.strings(PARENTS)?,
        children: row.strings(CHILDREN)?,
        complete_through: row.number(COMPLETE_THROUGH)?,
        seek_epoch: row.number(SEEK_EPOCH)?.unwrap_or(0),
        seek_skipped: row.skipped()?,
        sought_at: row.number(SOUGHT_AT)?,
        progress: row.progress()?,
        wanted_by: row.optional_string(WANTED_BY)?,
        handoff_acked: row.optional_string(HANDOFF_ACK)?.is_some(),
        retired_at: row.number(RETIRED_AT)?,
        window: row.window()?,
        stream,
        shard_id,
    })
}

struct Row<'a> {
    key: &'a str,
    item: &'a Item,
}

impl Row<'_> {
    fn corrupt(&self, attribute: &str, problem: impl fmt::Display) -> Error {
        Error::Corrupt {
            what: "lease row",
            detail: format!("row `{}`: attribute `{attribute}` {problem}", self.key),
        }
    }

    fn optional_string(&self, attribute: &str) -> Result<Option<String>, Error> {
        match self.item.get(attribute) {
            None | Some(AttributeValue::Null(_)) => Ok(None),
            Some(AttributeValue::S(v)) => Ok(Some(v.clone())),
            Some(other) => Err(self.corrupt(attribute, format!("is {}, expected S", kind(other)))),
        }
    }

    fn string(&self, attribute: &str) -> Result<String, Error> {
        self.optional_string(attribute)?
            .ok_or_else(|| self.corrupt(attribute, "is missing"))
    }

    fn number<T: std::str::FromStr>(&self, attribute: &str) -> Result<Option<T>, Error> {
        match self.item.get(attribute) {
            None | Some(AttributeValue::Null(_)) => Ok(None),
            Some(AttributeValue::N(v)) => v.parse().map(Some).map_err(|_| {
                self.corrupt(attribute, format!("`{v}` is not a whole number in range"))
            }),
            Some(other) => Err(self.corrupt(attribute, format!("is {}, expected N", kind(other)))),
        }
    }

    fn binary(&self, attribute: &str) -> Result<Option<Vec<u8>>, Error> {
        match self.item.get(attribute) {
            None | Some(AttributeValue::Null(_)) => Ok(None),
            Some(AttributeValue::B(v)) => Ok(Some(v.as_ref().to_vec())),
            Some(other) => Err(self.corrupt(attribute, format!("is {}, expected B", kind(other)))),
        }
    }

    /// A paged partition's progress; `None` when the row has none of its attributes.
    fn progress(&self) -> Result<Option<PagedProgress>, Error> {
        let cursor = self.binary(RESUME_CURSOR)?;
        let applied = self.binary(APPLIED_POSITION)?;
        let version = self.number::<u64>(CHECKPOINT_VERSION)?;
        let closed = self.number::<i64>(CLOSED_THROUGH)?;
        if cursor.is_none() && applied.is_none() && version.is_none() && closed.is_none() {
            return Ok(None);
        }
        Ok(Some(PagedProgress {
            resume_cursor: cursor.map(Cursor::new),
            applied_position: applied.map(PagePosition::from_bytes),
            checkpoint_version: version.unwrap_or(0),
            closed_through: closed,
            receipts_since: self.number::<i64>(RECEIPTS_SINCE)?,
        }))
    }

    /// A tumbling window's state (`windowStart`, `windowEnd`, `windowState`): all three or none.
    fn window(&self) -> Result<Option<WindowState>, Error> {
        let start = self.number::<i64>(WINDOW_START)?;
        let end = self.number::<i64>(WINDOW_END)?;
        let state = self.binary(WINDOW_STATE)?;
        match (start, end, state) {
            (None, None, None) => Ok(None),
            (Some(start_ms), Some(end_ms), Some(state)) => Ok(Some(WindowState {
                window: Window { start_ms, end_ms },
                state: state.into(),
            })),
            _ => Err(self.corrupt(
                WINDOW_STATE,
                format!("comes without `{WINDOW_START}` and `{WINDOW_END}` (all three or none)"),
            )),
        }
    }

    /// What seeks skipped on the row (`seekSkipped`: a map of `from`, `to`, `seekEpoch`); absent
    /// on rows no seek moved forward.
    fn skipped(&self) -> Result<Option<SkippedRange>, Error> {
        let map = match self.item.get(SEEK_SKIPPED) {
            None | Some(AttributeValue::Null(_)) => return Ok(None),
            Some(AttributeValue::M(map)) => map,
            Some(other) => {
                return Err(self.corrupt(SEEK_SKIPPED, format!("is {}, expected M", kind(other))));
            }
        };
        let coordinate = |field: &str| {
            map.get(field)
                .and_then(|v| v.as_s().ok())
                .and_then(|v| SeekCoordinate::decode(v))
                .ok_or_else(|| {
                    self.corrupt(
                        SEEK_SKIPPED,
                        format!("has no readable `{field}` coordinate"),
                    )
                })
        };
        let seek_epoch = map
            .get("seekEpoch")
            .and_then(|v| v.as_n().ok())
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| self.corrupt(SEEK_SKIPPED, "has no number `seekEpoch`"))?;
        Ok(Some(SkippedRange {
            from: coordinate("from")?,
            to: coordinate("to")?,
            seek_epoch,
        }))
    }

    /// A list of strings (L of S, or SS); absent reads as empty.
    fn strings(&self, attribute: &str) -> Result<Vec<String>, Error> {
        match self.item.get(attribute) {
            None | Some(AttributeValue::Null(_)) => Ok(Vec::new()),
            Some(AttributeValue::Ss(v)) => Ok(v.clone()),
            Some(AttributeValue::L(values)) => values
                .iter()
                .map(|v| match v {
                    AttributeValue::S(v) => Ok(v.clone()),
                    other => Err(self.corrupt(
                        attribute,
                        format!("holds {}, expected a list of S", kind(other)),
                    )),
                })
                .collect(),
            Some(other) => Err(self.corrupt(
                attribute,
                format!("is {}, expected a list of S", kind(other)),
            )),
        }
    }
}

/// The stored `seekSkipped` of a row.
fn skipped_value(skipped: &SkippedRange) -> AttributeValue {
    AttributeValue::M(
        [
            ("from", s(skipped.from.encode())),
            ("to", s(skipped.to.encode())),
            ("seekEpoch", n(skipped.seek_epoch)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect(),
    )
}

/// The DynamoDB type letter of a value, for messages.
fn kind(value: &AttributeValue) -> String {
    match value {
        AttributeValue::B(_) => "B",
        AttributeValue::Bool(_) => "BOOL",
        AttributeValue::Bs(_) => "BS",
        AttributeValue::L(_) => "L",
        AttributeValue::M(_) => "M",
        AttributeValue::N(_) => "N",
        AttributeValue::Ns(_) => "NS",
        AttributeValue::Null(_) => "NULL",
        AttributeValue::S(_) => "S",
        AttributeValue::Ss(_) => "SS",
        _ => "an unknown type",
    }
    .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(pairs: &[(&str, AttributeValue)]) -> Item {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect()
    }

    fn minimal() -> Item {
        row(&[
            (KEY, s("orders#shardId-000000000001")),
            (STREAM, s("orders")),
            (SHARD, s("shardId-000000000001")),
            (CHECKPOINT, s("TRIM_HORIZON")),
        ])
    }

    #[test]
    fn a_minimal_row_reads_with_defaults() {
        let lease = parse_row(&minimal()).unwrap();
        assert_eq!(lease.owner, None);
        assert_eq!(
            (lease.counter, lease.owner_epoch, lease.seek_epoch),
            (0, 0, 0)
        );
        assert_eq!(lease.checkpoint, Checkpoint::TrimHorizon);
        assert!(lease.parents.is_empty() && lease.children.is_empty());
        assert_eq!(lease.complete_through, None);
    }

    #[test]
    fn unreadable_attributes_name_the_row_and_the_attribute() {
        let cases = [
            (COUNTER, s("1")),
            (COUNTER, n("-1")),
            (CHECKPOINT, s("12x")),
            (PARENTS, AttributeValue::L(vec![n(1u64)])),
            (OWNER, n(3u64)),
            (STREAM, s("other")),
        ];
        for (attribute, value) in cases {
            let mut item = minimal();
            item.insert(attribute.to_owned(), value);
            let err = parse_row(&item).unwrap_err().to_string();
            assert!(err.contains("orders#shardId-000000000001"), "{err}");
            let named = if attribute == STREAM { KEY } else { attribute };
            assert!(err.contains(&format!("`{named}`")), "{err}");
        }
        let mut item = minimal();
        item.insert(CHECKPOINT.into(), s(AT_TIMESTAMP));
        let err = parse_row(&item).unwrap_err().to_string();
        assert!(err.contains(STARTING_TIMESTAMP), "{err}");
    }

    #[test]
    fn a_refused_row_is_ours_only_under_the_same_owner_and_epoch() {
        let held = Ownership {
            stream: "orders".into(),
            shard_id: "shardId-000000000001".into(),
            owner: "a".into(),
            epoch: 2,
        };
        let mut item = minimal();
        item.insert(OWNER.into(), s("a"));
        item.insert(EPOCH.into(), n(2u64));
        assert!(holds(&item, &held));
        item.insert(EPOCH.into(), n(3u64));
        assert!(!holds(&item, &held));
        item.insert(EPOCH.into(), n(2u64));
        item.remove(OWNER);
        assert!(!holds(&item, &held));
    }
}
