//! The DynamoDB writes a delivery causes, committed together with its receipt: typed, so that
//! shardwise can check DynamoDB's transaction limits before the call and the in-memory ledger can
//! apply them too.

use std::collections::{BTreeMap, BTreeSet};

use aws_sdk_dynamodb::types::AttributeValue;

/// Attributes by name: an item, or the key of one.
pub type Item = BTreeMap<String, AttributeValue>;

/// The most items one DynamoDB transaction takes.
pub const MAX_TRANSACTION_ITEMS: usize = 100;
/// The most bytes one DynamoDB item may hold.
pub const MAX_ITEM_BYTES: usize = 400 * 1024;
/// The most bytes one DynamoDB transaction may hold.
pub const MAX_TRANSACTION_BYTES: usize = 4 * 1024 * 1024;

/// What an effect requires of the item it writes (a condition, checked by DynamoDB in the
/// transaction: when it does not hold, none of the transaction's writes happen).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Expect {
    /// The item exists.
    Exists,
    /// The item does not exist.
    NotExists,
    /// The item's attribute equals the value.
    Equals(String, AttributeValue),
}

/// One change of an [`Effect::Update`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Change {
    /// Sets the attribute.
    Set(String, AttributeValue),
    /// Adds a number to the attribute (0 when absent), or elements to a set.
    Add(String, AttributeValue),
    /// Removes the attribute.
    Remove(String),
}

/// One DynamoDB write.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Effect {
    /// Writes the item whole (its key attributes included).
    Put {
        /// The table.
        table: String,
        /// The item.
        item: Item,
        /// A condition on the item as it is.
        expect: Option<Expect>,
    },
    /// Changes attributes of the item with `key` (creating it if needed).
    Update {
        /// The table.
        table: String,
        /// The item's key.
        key: Item,
        /// The changes, in order.
        changes: Vec<Change>,
        /// A condition on the item as it is.
        expect: Option<Expect>,
    },
    /// Deletes the item with `key`.
    Delete {
        /// The table.
        table: String,
        /// The item's key.
        key: Item,
        /// A condition on the item as it is.
        expect: Option<Expect>,
    },
    /// Writes nothing; the transaction happens only if the condition holds.
    Check {
        /// The table.
        table: String,
        /// The item's key.
        key: Item,
        /// The condition.
        expect: Expect,
    },
}

impl Effect {
    /// Puts `item` into `table`.
    pub fn put(table: impl Into<String>, item: Item) -> Self {
        Effect::Put {
            table: table.into(),
            item,
            expect: None,
        }
    }

    /// Updates the item with `key` in `table`; add changes with [`set`](Self::set),
    /// [`add`](Self::add) and [`remove`](Self::remove).
    ///
    /// ```
    /// use shardwise::receipts::{Effect, key};
    /// let count = Effect::update("counts", key("id", "order-7")).add("count", 1);
    /// ```
    pub fn update(table: impl Into<String>, key: Item) -> Self {
        Effect::Update {
            table: table.into(),
            key,
            changes: Vec::new(),
            expect: None,
        }
    }

    /// Deletes the item with `key` from `table`.
    pub fn delete(table: impl Into<String>, key: Item) -> Self {
        Effect::Delete {
            table: table.into(),
            key,
            expect: None,
        }
    }

    /// A condition on the item with `key` in `table`, written nowhere.
    pub fn check(table: impl Into<String>, key: Item, expect: Expect) -> Self {
        Effect::Check {
            table: table.into(),
            key,
            expect,
        }
    }

    /// (Update) sets `attribute` to `value`.
    pub fn set(self, attribute: impl Into<String>, value: impl Into<Value>) -> Self {
        self.change(Change::Set(attribute.into(), value.into().0))
    }

    /// (Update) adds `n` to the number `attribute` (0 when absent).
    pub fn add(self, attribute: impl Into<String>, n: i64) -> Self {
        self.change(Change::Add(
            attribute.into(),
            AttributeValue::N(n.to_string()),
        ))
    }

    /// (Update) removes `attribute`.
    pub fn remove(self, attribute: impl Into<String>) -> Self {
        self.change(Change::Remove(attribute.into()))
    }

    /// Requires `expect` of the item as it is (replacing an earlier condition).
    pub fn only_if(mut self, condition: Expect) -> Self {
        match &mut self {
            Effect::Put { expect, .. }
            | Effect::Update { expect, .. }
            | Effect::Delete { expect, .. } => *expect = Some(condition),
            Effect::Check { expect, .. } => *expect = condition,
        }
        self
    }

    fn change(mut self, change: Change) -> Self {
        if let Effect::Update { changes, .. } = &mut self {
            changes.push(change);
        }
        self
    }

    /// The table written.
    pub fn table(&self) -> &str {
        match self {
            Effect::Put { table, .. }
            | Effect::Update { table, .. }
            | Effect::Delete { table, .. }
            | Effect::Check { table, .. } => table,
        }
    }

    /// DynamoDB's size of the item a put writes, or of the key otherwise, in bytes.
    pub fn size(&self) -> usize {
        match self {
            Effect::Put { item, .. } => item_size(item),
            Effect::Update { key, changes, .. } => {
                item_size(key)
                    + changes
                        .iter()
                        .map(|c| match c {
                            Change::Set(n, v) | Change::Add(n, v) => n.len() + value_size(v),
                            Change::Remove(n) => n.len(),
                        })
                        .sum::<usize>()
            }
            Effect::Delete { key, .. } | Effect::Check { key, .. } => item_size(key),
        }
    }
}

/// A value an effect writes: strings, integers, booleans, or any [`AttributeValue`].
#[derive(Debug, Clone, PartialEq)]
pub struct Value(pub AttributeValue);

impl From<AttributeValue> for Value {
    fn from(v: AttributeValue) -> Self {
        Value(v)
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value(AttributeValue::S(v.to_string()))
    }
}
impl From<String> for Value {
    fn from(v: String) -> Self {
        Value(AttributeValue::S(v))
    }
}
impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value(AttributeValue::N(v.to_string()))
    }
}
impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value(AttributeValue::Bool(v))
    }
}

/// A key of one string attribute, the common case: `key("id", "order-7")`.
pub fn key(attribute: impl Into<String>, value: impl Into<String>) -> Item {
    Item::from([(attribute.into(), AttributeValue::S(value.into()))])
}

/// The DynamoDB writes one delivery causes, committed with its receipt: at most 99 (the receipt
/// is the hundredth item of the transaction), on distinct items.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Effects {
    writes: Vec<Effect>,
}

impl Effects {
    /// No writes: the receipt alone.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a write.
    pub fn with(mut self, effect: Effect) -> Self {
        self.writes.push(effect);
        self
    }

    /// Adds a write.
    pub fn push(&mut self, effect: Effect) {
        self.writes.push(effect);
    }

    /// The writes, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Effect> {
        self.writes.iter()
    }

    /// How many writes.
    pub fn len(&self) -> usize {
        self.writes.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }
}

impl From<Effect> for Effects {
    fn from(e: Effect) -> Self {
        Effects { writes: vec![e] }
    }
}

impl FromIterator<Effect> for Effects {
    fn from_iter<I: IntoIterator<Item = Effect>>(iter: I) -> Self {
        Effects {
            writes: iter.into_iter().collect(),
        }
    }
}

/// The identity of the item an effect writes: table and key (for a put, the key attributes of the
/// item, named by `key_of`).
pub(crate) fn item_identity(
    effect: &Effect,
    key_of: &dyn Fn(&str) -> Option<Vec<String>>,
) -> Result<(String, String), String> {
    let render = |table: &str, key: &Item| {
        let parts: Vec<String> = key
            .iter()
            .map(|(n, v)| format!("{n}={}", render_value(v)))
            .collect();
        (table.to_string(), parts.join(","))
    };
    match effect {
        Effect::Put { table, item, .. } => {
            let Some(names) = key_of(table) else {
                return Err(format!("table `{table}`: its key schema is unknown"));
            };
            let mut key = Item::new();
            for name in names {
                let Some(v) = item.get(&name) else {
                    return Err(format!(
                        "a put into `{table}` lacks the key attribute `{name}`"
                    ));
                };
                key.insert(name, v.clone());
            }
            Ok(render(table, &key))
        }
        Effect::Update { table, key, .. }
        | Effect::Delete { table, key, .. }
        | Effect::Check { table, key, .. } => Ok(render(table, key)),
    }
}

fn render_value(v: &AttributeValue) -> String {
    match v {
        AttributeValue::S(s) => format!("{s:?}"),
        AttributeValue::N(n) => n.clone(),
        other => format!("{other:?}"),
    }
}

/// Checks one delivery's effects against DynamoDB's limits before anything is sent: the number of
/// items (with the receipt), each item's size, the transaction's size, and one write per item.
/// The error says which limit and which effect.
pub(crate) fn check_limits(
    effects: &Effects,
    receipt_bytes: usize,
    key_of: &dyn Fn(&str) -> Option<Vec<String>>,
) -> Result<BTreeSet<(String, String)>, String> {
    if effects.len() + 1 > MAX_TRANSACTION_ITEMS {
        return Err(format!(
            "{} effects and the receipt make {} items; a DynamoDB transaction takes at most {MAX_TRANSACTION_ITEMS}",
            effects.len(),
            effects.len() + 1
        ));
    }
    let mut total = receipt_bytes;
    let mut items = BTreeSet::new();
    for (i, effect) in effects.iter().enumerate() {
        let size = effect.size();
        if size > MAX_ITEM_BYTES {
            return Err(format!(
                "effect {i} on `{}` writes {size} bytes; a DynamoDB item holds at most {MAX_ITEM_BYTES}",
                effect.table()
            ));
        }
        total += size;
        let identity = item_identity(effect, key_of)?;
        if !items.insert(identity.clone()) {
            return Err(format!(
                "two effects write the item {} of `{}`; a DynamoDB transaction writes each item once",
                identity.1, identity.0
            ));
        }
    }
    if total > MAX_TRANSACTION_BYTES {
        return Err(format!(
            "the effects and the receipt hold {total} bytes; a DynamoDB transaction holds at most {MAX_TRANSACTION_BYTES}"
        ));
    }
    Ok(items)
}

/// DynamoDB's size of an item: attribute names plus values.
pub(crate) fn item_size(item: &Item) -> usize {
    item.iter().map(|(n, v)| n.len() + value_size(v)).sum()
}

/// DynamoDB's size of a value (numbers: about one byte per two digits, plus one).
fn value_size(v: &AttributeValue) -> usize {
    match v {
        AttributeValue::S(s) => s.len(),
        AttributeValue::N(n) => n.trim_start_matches('-').len().div_ceil(2) + 1,
        AttributeValue::B(b) => b.as_ref().len(),
        AttributeValue::Bool(_) | AttributeValue::Null(_) => 1,
        AttributeValue::Ss(v) => v.iter().map(String::len).sum(),
        AttributeValue::Ns(v) => v.iter().map(|n| n.len().div_ceil(2) + 1).sum(),
        AttributeValue::Bs(v) => v.iter().map(|b| b.as_ref().len()).sum(),
        AttributeValue::L(v) => 3 + v.iter().map(|x| 1 + value_size(x)).sum::<usize>(),
        AttributeValue::M(m) => {
            3 + m
                .iter()
                .map(|(n, x)| 1 + n.len() + value_size(x))
                .sum::<usize>()
        }
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keyed(table: &str) -> Option<Vec<String>> {
        (table != "unknown").then(|| vec!["id".to_string()])
    }

    #[test]
    fn table_of_limit_cases() {
        let big = AttributeValue::S("x".repeat(MAX_ITEM_BYTES));
        let many: Effects = (0..99)
            .map(|i| Effect::update("t", key("id", i.to_string())).add("n", 1))
            .collect();
        let too_many: Effects = (0..100)
            .map(|i| Effect::update("t", key("id", i.to_string())).add("n", 1))
            .collect();
        let mut near = Item::new();
        near.insert("id".into(), AttributeValue::S("a".into()));
        near.insert("blob".into(), AttributeValue::S("x".repeat(300 * 1024)));
        let heavy: Effects = (0..14)
            .map(|i| {
                let mut item = near.clone();
                item.insert("id".into(), AttributeValue::S(i.to_string()));
                Effect::put("t", item)
            })
            .collect();
        // (why, effects, the error names this, or None when within the limits)
        let cases: Vec<(&str, Effects, Option<&str>)> = vec![
            (
                "one counter",
                Effect::update("t", key("id", "a")).add("n", 1).into(),
                None,
            ),
            ("99 effects and the receipt make 100", many, None),
            (
                "100 effects and the receipt are too many",
                too_many,
                Some("at most 100"),
            ),
            (
                "an item over 400 KB",
                Effect::put(
                    "t",
                    Item::from([
                        ("id".into(), AttributeValue::S("a".into())),
                        ("blob".into(), big),
                    ]),
                )
                .into(),
                Some("at most 409600"),
            ),
            ("a transaction over 4 MB", heavy, Some("at most 4194304")),
            (
                "two writes of one item",
                Effects::new()
                    .with(Effect::update("t", key("id", "a")).add("n", 1))
                    .with(Effect::delete("t", key("id", "a"))),
                Some("writes each item once"),
            ),
            (
                "a put and a check of one item (the key comes from the put's item)",
                Effects::new()
                    .with(Effect::put("t", key("id", "a")))
                    .with(Effect::check("t", key("id", "a"), Expect::Exists)),
                Some("writes each item once"),
            ),
            (
                "the same key in two tables is two items",
                Effects::new()
                    .with(Effect::update("t", key("id", "a")).add("n", 1))
                    .with(Effect::update("u", key("id", "a")).add("n", 1)),
                None,
            ),
            (
                "a put without its key attribute",
                Effect::put("t", key("other", "a")).into(),
                Some("lacks the key attribute `id`"),
            ),
        ];
        for (why, effects, expected) in cases {
            let result = check_limits(&effects, 100, &keyed);
            match expected {
                None => assert!(result.is_ok(), "{why}: {result:?}"),
                Some(text) => {
                    let err = result.expect_err(why);
                    assert!(err.contains(text), "{why}: {err}");
                }
            }
        }
    }

    #[test]
    fn sizes_follow_dynamodb_rules() {
        assert_eq!(item_size(&key("id", "abc")), 2 + 3);
        let n = Item::from([("n".into(), AttributeValue::N("12345".into()))]);
        assert_eq!(item_size(&n), 1 + 4);
        let builder = Effect::update("t", key("id", "a"))
            .add("count", 1)
            .set("at", "now")
            .remove("old");
        assert_eq!(builder.size(), (2 + 1) + (5 + 2) + (2 + 3) + 3);
        assert_eq!(builder.table(), "t");
    }
}
