//! Lambda's event filtering for records (`FilterCriteria`), as an event source mapping of a
//! Kinesis stream applies it: up to [`MAX_FILTERS`] patterns, OR-ed; a record that no pattern
//! matches is not sent to the function. For Kinesis, Lambda filters on the record's `data` only,
//! and only when it is valid JSON: a pattern names the `data` key, and a record whose data is not
//! JSON matches no pattern (Lambda drops it).
//!
//! The rule syntax (Lambda's "Filter rule syntax", a subset of EventBridge's event patterns): a
//! pattern is a JSON object whose keys name fields of the event; a key holds either an object
//! (a nested pattern) or an array of conditions, any of which may match (OR); keys are AND-ed;
//! `"$or": [pattern, ...]` matches when one of its patterns does. Conditions:
//!
//! | condition | syntax | matches |
//! |---|---|---|
//! | equals | `"City": ["Seattle"]`, `[100]`, `[true]` | the value (numbers compared as numbers) |
//! | null, empty | `[null]`, `[""]` | a JSON `null`; an empty string |
//! | equals, ignoring case | `[{"equals-ignore-case": "seattle"}]` | a string equal but for case |
//! | begins with, ends with | `[{"prefix": "us-"}]`, `[{"suffix": ".png"}]` | a string |
//! | not | `[{"anything-but": ["stopped", "overloaded"]}]`, `[{"anything-but": {"prefix": "us-"}}]` | a value present and none of these |
//! | numeric | `[{"numeric": ["=", 100]}]`, `[{"numeric": [">", 0, "<=", 5]}]` | a number in the range |
//! | exists | `[{"exists": true}]`, `[{"exists": false}]` | the field is there (any value), or is not |
//!
//! An array in the event matches a condition when one of its elements does (`anything-but`: when
//! none of them is excluded). A field missing from the event matches only `{"exists": false}`.

use std::fmt;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::{Batching, Delivery, Handler, Outcome};

/// Lambda's quota of filters per event source mapping.
pub const MAX_FILTERS: usize = 5;

/// The longest pattern Lambda takes (characters).
pub const MAX_PATTERN_LEN: usize = 4096;

/// A filter criteria that could not be read: what is wrong, and where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FilterError {
    /// Where: `Filters[1].Pattern`, then the path in the pattern (`data.order.type[0]`); a JSON
    /// syntax error's message ends with its line and column.
    pub at: String,
    /// What is wrong.
    pub what: String,
}

impl fmt::Display for FilterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.at, self.what)
    }
}

impl std::error::Error for FilterError {}

/// Lambda's `FilterCriteria`: records that match one of its patterns reach the handler.
#[derive(Debug, Clone, PartialEq)]
pub struct FilterCriteria {
    patterns: Vec<Pattern>,
}

/// `FilterCriteria` as the AWS CLI and the Lambda API take it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Criteria {
    #[serde(rename = "Filters")]
    filters: Vec<Filter>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Filter {
    #[serde(rename = "Pattern")]
    pattern: String,
}

impl FilterCriteria {
    /// Reads a `FilterCriteria` as the AWS CLI takes it:
    /// `{"Filters":[{"Pattern":"{\"data\":{\"kind\":[\"order\"]}}"}]}`, each pattern a JSON
    /// string. A malformed one is refused with where it is wrong.
    pub fn parse(text: &str) -> Result<Self, FilterError> {
        // serde_json's message ends with the line and column.
        let criteria: Criteria =
            serde_json::from_str(text).map_err(|e| refused("FilterCriteria", e.to_string()))?;
        if criteria.filters.is_empty() || criteria.filters.len() > MAX_FILTERS {
            return Err(FilterError {
                at: "Filters".into(),
                what: format!(
                    "{} filters: Lambda takes 1 to {MAX_FILTERS}",
                    criteria.filters.len()
                ),
            });
        }
        let patterns = criteria
            .filters
            .iter()
            .enumerate()
            .map(|(i, filter)| {
                Pattern::parse_text(&filter.pattern, &format!("Filters[{i}].Pattern"))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { patterns })
    }

    /// Whether a record whose data is `data` matches one of the patterns. Data that is not JSON
    /// matches none.
    pub fn matches_data(&self, data: &[u8]) -> bool {
        let Ok(data) = serde_json::from_slice::<Value>(data) else {
            return false;
        };
        let mut event = Map::new();
        event.insert("data".into(), data);
        self.patterns.iter().any(|p| p.matches(Some(&event)))
    }
}

/// A handler behind a [`FilterCriteria`] ([`ConsumerBuilder::filter`](crate::ConsumerBuilder::filter)):
/// a delivery whose payload no pattern matches is acknowledged without reaching the handler (it
/// settles, so the checkpoint moves past it, as Lambda's iterator does) and counted in
/// `shardwise_records_filtered_total` (labels `stream`, `shard`); the rest reach it as before,
/// in batches too (a batch holds only the deliveries that match). Without criteria every delivery
/// reaches the handler.
#[derive(Debug, Clone)]
pub struct Filtered<H> {
    inner: H,
    criteria: Option<Arc<FilterCriteria>>,
}

impl<H: Handler> Filtered<H> {
    /// `inner` behind `criteria` (`None`: every delivery reaches it).
    pub fn new(inner: H, criteria: Option<FilterCriteria>) -> Self {
        Self {
            inner,
            criteria: criteria.map(Arc::new),
        }
    }

    /// Whether `delivery` reaches the handler; counted when it does not.
    fn passes(&self, delivery: &Delivery) -> bool {
        let Some(criteria) = &self.criteria else {
            return true;
        };
        if criteria.matches_data(delivery.payload()) {
            return true;
        }
        metrics::counter!("shardwise_records_filtered_total", "stream" => delivery.stream().to_string(), "shard" => delivery.shard().to_string()).increment(1);
        false
    }
}

impl<H: Handler> Handler for Filtered<H> {
    async fn handle(&self, delivery: Delivery) -> Outcome {
        if self.passes(&delivery) {
            self.inner.handle(delivery).await
        } else {
            Outcome::Ack
        }
    }

    fn batching(&self) -> Option<Batching> {
        self.inner.batching()
    }

    /// The handler gets the batch's deliveries that match; the others are acknowledged in their
    /// places. Where the handler's answer stops short (or is none: the batch failed), the
    /// answer stops too, so those deliveries and every one after them are retried, as the
    /// handler's own short answer says.
    async fn handle_batch(&self, batch: Vec<Delivery>) -> Vec<Outcome> {
        let passes: Vec<bool> = batch.iter().map(|d| self.passes(d)).collect();
        let matching: Vec<Delivery> = batch
            .into_iter()
            .zip(&passes)
            .filter_map(|(d, pass)| pass.then_some(d))
            .collect();
        if matching.is_empty() {
            return vec![Outcome::Ack; passes.len()];
        }
        let answered = self.inner.handle_batch(matching).await;
        if answered.is_empty() {
            return answered;
        }
        let mut answers = answered.into_iter();
        let mut outcomes = Vec::with_capacity(passes.len());
        for pass in passes {
            if !pass {
                outcomes.push(Outcome::Ack);
                continue;
            }
            match answers.next() {
                Some(outcome) => outcomes.push(outcome),
                None => break,
            }
        }
        outcomes
    }

    fn window_slots(&self) -> Option<&std::sync::Arc<crate::window::WindowSlots>> {
        self.inner.window_slots()
    }

    fn close_window_if_over(
        &self,
        stream: &str,
        shard: &str,
        now_ms: i64,
    ) -> impl std::future::Future<Output = bool> + Send {
        self.inner.close_window_if_over(stream, shard, now_ms)
    }
}

/// A pattern: every field's matcher, and every `$or` group's alternatives.
#[derive(Debug, Clone, PartialEq)]
struct Pattern {
    fields: Vec<(String, Matcher)>,
    any_of: Vec<Vec<Pattern>>,
}

#[derive(Debug, Clone, PartialEq)]
enum Matcher {
    Nested(Pattern),
    AnyOf(Vec<Condition>),
}

#[derive(Debug, Clone, PartialEq)]
enum Condition {
    Equals(Value),
    EqualsIgnoreCase(String),
    Prefix(String),
    Suffix(String),
    AnythingBut(Excluded),
    Numeric(Vec<(Comparison, f64)>),
    Exists(bool),
}

#[derive(Debug, Clone, PartialEq)]
enum Excluded {
    Values(Vec<Value>),
    Prefix(String),
    Suffix(String),
    IgnoringCase(Vec<String>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Comparison {
    Eq,
    Lt,
    Le,
    Gt,
    Ge,
}

fn refused(at: &str, what: impl Into<String>) -> FilterError {
    FilterError {
        at: at.to_string(),
        what: what.into(),
    }
}

impl Pattern {
    /// A pattern's text: JSON naming only `data` (and `$or` over such patterns).
    fn parse_text(text: &str, at: &str) -> Result<Self, FilterError> {
        if text.chars().count() > MAX_PATTERN_LEN {
            return Err(refused(
                at,
                format!("longer than Lambda's {MAX_PATTERN_LEN} characters"),
            ));
        }
        let value: Value = serde_json::from_str(text).map_err(|e| refused(at, e.to_string()))?;
        let pattern = Self::parse(&value, at)?;
        pattern.only_data(at)?;
        Ok(pattern)
    }

    /// Kinesis event source mappings filter on `data` only.
    fn only_data(&self, at: &str) -> Result<(), FilterError> {
        for (key, _) in &self.fields {
            if key != "data" {
                return Err(refused(
                    &format!("{at}: {key}"),
                    "a Kinesis record is filtered on its data only (Lambda's rule): name the key \"data\"",
                ));
            }
        }
        for (i, group) in self.any_of.iter().enumerate() {
            for (j, alternative) in group.iter().enumerate() {
                alternative.only_data(&format!("{at}: $or[{i}][{j}]"))?;
            }
        }
        Ok(())
    }

    fn parse(value: &Value, at: &str) -> Result<Self, FilterError> {
        let Value::Object(object) = value else {
            return Err(refused(at, "a pattern is a JSON object"));
        };
        let mut pattern = Self {
            fields: Vec::new(),
            any_of: Vec::new(),
        };
        for (key, value) in object {
            let here = if at.ends_with("Pattern") {
                format!("{at}: {key}")
            } else {
                format!("{at}.{key}")
            };
            if key == "$or" {
                let Value::Array(alternatives) = value else {
                    return Err(refused(&here, "$or holds an array of patterns"));
                };
                if alternatives.len() < 2 {
                    return Err(refused(&here, "$or needs two patterns or more"));
                }
                let group = alternatives
                    .iter()
                    .enumerate()
                    .map(|(i, p)| Self::parse(p, &format!("{here}[{i}]")))
                    .collect::<Result<_, _>>()?;
                pattern.any_of.push(group);
                continue;
            }
            let matcher = match value {
                Value::Object(_) => Matcher::Nested(Self::parse(value, &here)?),
                Value::Array(conditions) if !conditions.is_empty() => Matcher::AnyOf(
                    conditions
                        .iter()
                        .enumerate()
                        .map(|(i, c)| Condition::parse(c, &format!("{here}[{i}]")))
                        .collect::<Result<_, _>>()?,
                ),
                _ => {
                    return Err(refused(
                        &here,
                        "a field holds a nested pattern (an object) or a non-empty array of conditions",
                    ));
                }
            };
            pattern.fields.push((key.clone(), matcher));
        }
        if pattern.fields.is_empty() && pattern.any_of.is_empty() {
            return Err(refused(at, "an empty pattern"));
        }
        Ok(pattern)
    }

    /// Whether the event's object `event` (missing: `None`) matches.
    fn matches(&self, event: Option<&Map<String, Value>>) -> bool {
        self.fields.iter().all(|(key, matcher)| {
            let value = event.and_then(|e| e.get(key));
            match matcher {
                Matcher::Nested(pattern) => pattern.matches(value.and_then(Value::as_object)),
                Matcher::AnyOf(conditions) => conditions.iter().any(|c| c.matches(value)),
            }
        }) && self
            .any_of
            .iter()
            .all(|group| group.iter().any(|p| p.matches(event)))
    }
}

impl Condition {
    fn parse(value: &Value, at: &str) -> Result<Self, FilterError> {
        let Value::Object(object) = value else {
            return match value {
                Value::Array(_) => Err(refused(at, "a condition is a value or an object")),
                other => Ok(Self::Equals(other.clone())),
            };
        };
        let mut entries = object.iter();
        let (Some((operator, operand)), None) = (entries.next(), entries.next()) else {
            return Err(refused(at, "a condition object holds one operator"));
        };
        let at = &format!("{at}.{operator}");
        let string = |what: &str| {
            operand
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| refused(at, format!("{what} takes a string")))
        };
        Ok(match operator.as_str() {
            "equals-ignore-case" => Self::EqualsIgnoreCase(string("equals-ignore-case")?),
            "prefix" => Self::Prefix(string("prefix")?),
            "suffix" => Self::Suffix(string("suffix")?),
            "exists" => Self::Exists(
                operand
                    .as_bool()
                    .ok_or_else(|| refused(at, "exists takes true or false"))?,
            ),
            "numeric" => Self::Numeric(numeric(operand, at)?),
            "anything-but" => Self::AnythingBut(excluded(operand, at)?),
            other => {
                return Err(refused(
                    at,
                    format!(
                        "unknown operator {other:?} (Lambda's: equals-ignore-case, prefix, suffix, anything-but, numeric, exists)"
                    ),
                ));
            }
        })
    }

    /// Whether the field's value (missing: `None`) matches.
    fn matches(&self, value: Option<&Value>) -> bool {
        match (self, value) {
            (Self::Exists(wanted), value) => value.is_some() == *wanted,
            (_, None) => false,
            (Self::AnythingBut(excluded), Some(Value::Array(values))) => {
                values.iter().all(|v| !excluded.excludes(v))
            }
            (Self::AnythingBut(excluded), Some(value)) => !excluded.excludes(value),
            (_, Some(Value::Array(values))) => values.iter().any(|v| self.matches_one(v)),
            (_, Some(value)) => self.matches_one(value),
        }
    }

    fn matches_one(&self, value: &Value) -> bool {
        match self {
            Self::Equals(wanted) => same(wanted, value),
            Self::EqualsIgnoreCase(wanted) => value
                .as_str()
                .is_some_and(|s| s.to_lowercase() == wanted.to_lowercase()),
            Self::Prefix(prefix) => value
                .as_str()
                .is_some_and(|s| s.starts_with(prefix.as_str())),
            Self::Suffix(suffix) => value.as_str().is_some_and(|s| s.ends_with(suffix.as_str())),
            Self::Numeric(range) => value.as_f64().is_some_and(|n| {
                range.iter().all(|(comparison, bound)| match comparison {
                    Comparison::Eq => n == *bound,
                    Comparison::Lt => n < *bound,
                    Comparison::Le => n <= *bound,
                    Comparison::Gt => n > *bound,
                    Comparison::Ge => n >= *bound,
                })
            }),
            Self::AnythingBut(excluded) => !excluded.excludes(value),
            Self::Exists(wanted) => *wanted,
        }
    }
}

impl Excluded {
    fn excludes(&self, value: &Value) -> bool {
        match self {
            Self::Values(values) => values.iter().any(|v| same(v, value)),
            Self::Prefix(prefix) => value
                .as_str()
                .is_some_and(|s| s.starts_with(prefix.as_str())),
            Self::Suffix(suffix) => value.as_str().is_some_and(|s| s.ends_with(suffix.as_str())),
            Self::IgnoringCase(values) => value.as_str().is_some_and(|s| {
                let s = s.to_lowercase();
                values.iter().any(|v| v.to_lowercase() == s)
            }),
        }
    }
}

/// Equal as JSON values, numbers as numbers (`100` and `100.0`).
fn same(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) if a.is_number() && b.is_number() => x == y,
        _ => a == b,
    }
}

fn numeric(operand: &Value, at: &str) -> Result<Vec<(Comparison, f64)>, FilterError> {
    let Some(items) = operand.as_array() else {
        return Err(refused(at, "numeric takes an array: [\">\", 0, \"<=\", 5]"));
    };
    if items.is_empty() || items.len() % 2 != 0 || items.len() > 4 {
        return Err(refused(
            at,
            "numeric takes one or two comparisons, each an operator and a number",
        ));
    }
    let mut range = Vec::new();
    for (i, pair) in items.chunks(2).enumerate() {
        let comparison = match pair[0].as_str() {
            Some("=") => Comparison::Eq,
            Some("<") => Comparison::Lt,
            Some("<=") => Comparison::Le,
            Some(">") => Comparison::Gt,
            Some(">=") => Comparison::Ge,
            _ => {
                return Err(refused(
                    &format!("{at}[{}]", 2 * i),
                    format!("{} is not one of =, <, <=, >, >=", pair[0]),
                ));
            }
        };
        let Some(bound) = pair[1].as_f64().filter(|_| pair[1].is_number()) else {
            return Err(refused(
                &format!("{at}[{}]", 2 * i + 1),
                format!("{} is not a number", pair[1]),
            ));
        };
        range.push((comparison, bound));
    }
    let equals = range.iter().any(|(c, _)| *c == Comparison::Eq);
    let lower = range
        .iter()
        .filter(|(c, _)| matches!(c, Comparison::Gt | Comparison::Ge))
        .count();
    let upper = range.len() - lower - usize::from(equals);
    if (equals && range.len() > 1) || lower > 1 || upper > 1 {
        return Err(refused(
            at,
            "numeric takes = alone, or a lower bound and an upper bound",
        ));
    }
    Ok(range)
}

fn excluded(operand: &Value, at: &str) -> Result<Excluded, FilterError> {
    let scalar = |v: &Value| !(v.is_object() || v.is_array());
    match operand {
        Value::Array(values) if !values.is_empty() && values.iter().all(scalar) => {
            Ok(Excluded::Values(values.clone()))
        }
        Value::Object(object) => {
            let mut entries = object.iter();
            let (Some((operator, value)), None) = (entries.next(), entries.next()) else {
                return Err(refused(at, "anything-but's object holds one operator"));
            };
            match (operator.as_str(), value) {
                ("prefix", Value::String(s)) => Ok(Excluded::Prefix(s.clone())),
                ("suffix", Value::String(s)) => Ok(Excluded::Suffix(s.clone())),
                ("equals-ignore-case", Value::String(s)) => {
                    Ok(Excluded::IgnoringCase(vec![s.clone()]))
                }
                ("equals-ignore-case", Value::Array(values))
                    if !values.is_empty() && values.iter().all(Value::is_string) =>
                {
                    Ok(Excluded::IgnoringCase(
                        values
                            .iter()
                            .filter_map(|v| v.as_str().map(str::to_string))
                            .collect(),
                    ))
                }
                _ => Err(refused(
                    &format!("{at}.{operator}"),
                    "anything-but takes a value, a list of values, or {\"prefix\"|\"suffix\"|\"equals-ignore-case\": string}",
                )),
            }
        }
        value if scalar(value) => Ok(Excluded::Values(vec![value.clone()])),
        _ => Err(refused(
            at,
            "anything-but takes a value, a list of values, or {\"prefix\"|\"suffix\"|\"equals-ignore-case\": string}",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The criteria holding one pattern, written as JSON.
    fn criteria(pattern: Value) -> FilterCriteria {
        let text = json!({ "Filters": [{ "Pattern": pattern.to_string() }] }).to_string();
        FilterCriteria::parse(&text).unwrap_or_else(|e| panic!("{pattern}: {e}"))
    }

    /// Lambda's documented examples ("Filter rule syntax", and the Kinesis page's order example),
    /// each pattern on `data` against records that match and records that do not.
    #[test]
    fn lambdas_documented_patterns_match_as_documented() {
        let order =
            json!({"record": 12345, "order": {"type": "buy", "stock": "ANYCO", "quantity": 1000}});
        let cases: Vec<(&str, Value, Vec<Value>, Vec<Value>)> = vec![
            (
                "the Kinesis page: orders of type buy",
                json!({"data": {"order": {"type": ["buy"]}}}),
                vec![order.clone()],
                vec![
                    json!({"record": 1, "order": {"type": "sell"}}),
                    json!({"record": 1}),
                ],
            ),
            (
                "null",
                json!({"data": {"UserID": [null]}}),
                vec![json!({"UserID": null})],
                vec![json!({"UserID": ""}), json!({})],
            ),
            (
                "empty",
                json!({"data": {"LastName": [""]}}),
                vec![json!({"LastName": ""})],
                vec![json!({"LastName": null}), json!({"LastName": "Doe"})],
            ),
            (
                "equals",
                json!({"data": {"Name": ["Alice"]}}),
                vec![json!({"Name": "Alice"}), json!({"Name": ["Bob", "Alice"]})],
                vec![json!({"Name": "alice"}), json!({"Name": "Alice "})],
            ),
            (
                "equals, ignoring case",
                json!({"data": {"Name": [{"equals-ignore-case": "alice"}]}}),
                vec![json!({"Name": "ALICE"}), json!({"Name": "Alice"})],
                vec![json!({"Name": "Alicia"}), json!({"Name": 1})],
            ),
            (
                "and",
                json!({"data": {"Location": ["New York"], "Day": ["Monday"]}}),
                vec![json!({"Location": "New York", "Day": "Monday"})],
                vec![
                    json!({"Location": "New York", "Day": "Tuesday"}),
                    json!({"Day": "Monday"}),
                ],
            ),
            (
                "or",
                json!({"data": {"PaymentType": ["Credit", "Debit"]}}),
                vec![
                    json!({"PaymentType": "Credit"}),
                    json!({"PaymentType": "Debit"}),
                ],
                vec![json!({"PaymentType": "Cash"})],
            ),
            (
                "or across fields",
                json!({"data": {"$or": [{"Location": ["New York"]}, {"Day": ["Monday"]}]}}),
                vec![
                    json!({"Location": "New York"}),
                    json!({"Day": "Monday", "Location": "Boston"}),
                ],
                vec![json!({"Location": "Boston", "Day": "Friday"})],
            ),
            (
                "not",
                json!({"data": {"Weather": [{"anything-but": ["Raining"]}]}}),
                vec![json!({"Weather": "Sunny"}), json!({"Weather": null})],
                vec![json!({"Weather": "Raining"}), json!({})],
            ),
            (
                "not, by prefix",
                json!({"data": {"Region": [{"anything-but": {"prefix": "us-"}}]}}),
                vec![json!({"Region": "eu-west-1"})],
                vec![json!({"Region": "us-east-1"})],
            ),
            (
                "numeric, equals",
                json!({"data": {"Price": [{"numeric": ["=", 100]}]}}),
                vec![json!({"Price": 100}), json!({"Price": 100.0})],
                vec![json!({"Price": 101}), json!({"Price": "100"})],
            ),
            (
                "numeric, a range",
                json!({"data": {"Price": [{"numeric": [">", 10, "<=", 20]}]}}),
                vec![json!({"Price": 20}), json!({"Price": 10.5})],
                vec![json!({"Price": 10}), json!({"Price": 20.01})],
            ),
            (
                "exists",
                json!({"data": {"ProductName": [{"exists": true}]}}),
                vec![json!({"ProductName": "shoe"}), json!({"ProductName": null})],
                vec![json!({"Product": "shoe"})],
            ),
            (
                "does not exist",
                json!({"data": {"ProductName": [{"exists": false}]}}),
                vec![json!({"Product": "shoe"}), json!({})],
                vec![json!({"ProductName": "shoe"})],
            ),
            (
                "begins with",
                json!({"data": {"Region": [{"prefix": "us-"}]}}),
                vec![json!({"Region": "us-east-1"})],
                vec![json!({"Region": "eu-west-1"}), json!({"Region": 1})],
            ),
            (
                "ends with",
                json!({"data": {"FileName": [{"suffix": ".png"}]}}),
                vec![json!({"FileName": "cat.png"})],
                vec![json!({"FileName": "cat.jpg"})],
            ),
        ];
        for (name, pattern, matching, other) in cases {
            let filter = criteria(pattern);
            for data in matching {
                assert!(
                    filter.matches_data(data.to_string().as_bytes()),
                    "{name}: {data}"
                );
            }
            for data in other {
                assert!(
                    !filter.matches_data(data.to_string().as_bytes()),
                    "{name}: {data} matched"
                );
            }
        }
    }

    /// Filters are OR-ed; data that is not JSON matches none (Lambda drops the record).
    #[test]
    fn filters_are_ored_and_data_that_is_not_json_matches_none() {
        let text = json!({"Filters": [
            {"Pattern": json!({"data": {"kind": ["order"]}}).to_string()},
            {"Pattern": json!({"data": {"kind": ["refund"]}}).to_string()},
        ]})
        .to_string();
        let filter = FilterCriteria::parse(&text).unwrap();
        assert!(filter.matches_data(br#"{"kind":"order"}"#));
        assert!(filter.matches_data(br#"{"kind":"refund"}"#));
        assert!(!filter.matches_data(br#"{"kind":"quote"}"#));
        assert!(!filter.matches_data(b"kind=order"));
        assert!(!filter.matches_data(b""));
    }

    /// A malformed criteria is refused with where it is wrong.
    #[test]
    fn a_malformed_criteria_is_refused_with_where_it_is_wrong() {
        let refusal = |text: &str| FilterCriteria::parse(text).unwrap_err().to_string();
        let one = |pattern: &str| refusal(&json!({"Filters": [{"Pattern": pattern}]}).to_string());
        assert_eq!(
            refusal("{\"Filters\": ["),
            "FilterCriteria: EOF while parsing a list at line 1 column 13"
        );
        assert!(refusal(r#"{"Filter": []}"#).contains("unknown field `Filter`"));
        assert!(refusal(r#"{"Filters": []}"#).starts_with("Filters: 0 filters"));
        let six = json!({"Filters": vec![json!({"Pattern": "{\"data\":{\"a\":[1]}}"}); 6]});
        assert!(refusal(&six.to_string()).starts_with("Filters: 6 filters"));
        assert_eq!(
            one("{\"data\": {\"kind\": [\"order\"]}"),
            "Filters[0].Pattern: EOF while parsing an object at line 1 column 28"
        );
        assert_eq!(
            one(r#"{"data": {"order": {"type": [{"prefx": "b"}]}}}"#),
            "Filters[0].Pattern: data.order.type[0].prefx: unknown operator \"prefx\" (Lambda's: equals-ignore-case, prefix, suffix, anything-but, numeric, exists)"
        );
        assert_eq!(
            one(r#"{"data": {"price": [{"numeric": [">", "ten"]}]}}"#),
            "Filters[0].Pattern: data.price[0].numeric[1]: \"ten\" is not a number"
        );
        assert_eq!(
            one(r#"{"data": {"price": [{"numeric": [">", 1, ">", 2]}]}}"#),
            "Filters[0].Pattern: data.price[0].numeric: numeric takes = alone, or a lower bound and an upper bound"
        );
        assert_eq!(
            one(r#"{"partitionKey": ["1"]}"#),
            "Filters[0].Pattern: partitionKey: a Kinesis record is filtered on its data only (Lambda's rule): name the key \"data\""
        );
        assert_eq!(
            one(r#"{"data": {"kind": []}}"#),
            "Filters[0].Pattern: data.kind: a field holds a nested pattern (an object) or a non-empty array of conditions"
        );
        assert!(
            one(&format!(
                "{{\"data\": {{\"k\": [\"{}\"]}}}}",
                "x".repeat(4100)
            ))
            .contains("longer than Lambda's 4096 characters")
        );
    }
}
