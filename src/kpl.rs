//! KPL (Kinesis Producer Library) aggregated records: reading them apart, and writing them.
//!
//! The KPL packs many user records into one Kinesis record:
//!
//! ```text
//! F3 89 9A C2 | protobuf AggregatedRecord | MD5 of the protobuf bytes (16 bytes)
//!
//! message AggregatedRecord {
//!   repeated string partition_key_table = 1;
//!   repeated string explicit_hash_key_table = 2;
//!   repeated Record records = 3;
//! }
//! message Record {
//!   required uint64 partition_key_index = 1;
//!   optional uint64 explicit_hash_key_index = 2;
//!   required bytes data = 3;
//!   repeated Tag tags = 4;
//! }
//! message Tag { required string key = 1; optional string value = 2; }
//! ```
//!
//! [`deaggregate`] never fails and never loses data: a blob without the magic is a plain record,
//! and a blob with the magic that does not check out (digest, protobuf, key indices, no records) is
//! also delivered as one plain record, the whole blob untouched; [`Deaggregated::Corrupt`] says
//! what was wrong so the caller can count it and warn. This module logs nothing.
//!
//! Sub-record `i` of an aggregate has sub-sequence `i`; a plain record has sub-sequence 0.
//!
//! Decoding is zero-copy: every sub-record's `data` is a slice of the blob's buffer.
//!
//! Tags are parsed (so a malformed tag makes the aggregate corrupt, as in the KCL) and otherwise
//! ignored. Missing `required` fields read as their defaults (index 0, empty data), as proto3
//! encoders that omit default values expect; the indices are still checked against the tables.

use std::collections::HashMap;

use bytes::{BufMut, Bytes, BytesMut};
use md5::{Digest, Md5};
use prost::Message;

/// The four bytes every KPL aggregate starts with.
pub const KPL_MAGIC: [u8; 4] = [0xF3, 0x89, 0x9A, 0xC2];

/// Length of the MD5 digest that ends every KPL aggregate.
pub const DIGEST_LEN: usize = 16;

/// The protobuf `AggregatedRecord`.
#[derive(Clone, PartialEq, Message)]
struct AggregatedRecord {
    #[prost(string, repeated, tag = "1")]
    partition_key_table: Vec<String>,
    #[prost(string, repeated, tag = "2")]
    explicit_hash_key_table: Vec<String>,
    #[prost(message, repeated, tag = "3")]
    records: Vec<Record>,
}

/// The protobuf `Record`: one user record inside an aggregate.
#[derive(Clone, PartialEq, Message)]
struct Record {
    #[prost(uint64, required, tag = "1")]
    partition_key_index: u64,
    #[prost(uint64, optional, tag = "2")]
    explicit_hash_key_index: Option<u64>,
    #[prost(bytes = "bytes", required, tag = "3")]
    data: Bytes,
    #[prost(message, repeated, tag = "4")]
    tags: Vec<Tag>,
}

/// The protobuf `Tag` (the KPL writes none; parsed and ignored).
#[derive(Clone, PartialEq, Message)]
struct Tag {
    #[prost(string, required, tag = "1")]
    key: String,
    #[prost(string, optional, tag = "2")]
    value: Option<String>,
}

/// One user record unpacked from a KPL aggregate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubRecord {
    /// The user record's partition key (from the aggregate's partition key table).
    pub partition_key: String,
    /// The explicit hash key the producer set, if any.
    pub explicit_hash_key: Option<String>,
    /// The user record's data: a slice of the aggregate's buffer.
    pub data: Bytes,
    /// Index inside the aggregate, from 0.
    pub sub_sequence: u64,
}

/// What a Kinesis record's data blob holds.
///
/// For [`Plain`](Deaggregated::Plain) and [`Corrupt`](Deaggregated::Corrupt) the caller delivers
/// the whole blob, untouched, as one record with the Kinesis record's partition key and
/// sub-sequence 0: bad input never loses data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Deaggregated {
    /// No KPL magic: an ordinary record.
    Plain,
    /// The KPL magic, but the aggregate does not check out; the caller should count and warn.
    /// The reason is short, stable text, fit for a log field or a metric label.
    Corrupt(&'static str),
    /// A valid aggregate: its sub-records in order (at least one), sub-record `i` with
    /// sub-sequence `i`.
    Aggregate(Vec<SubRecord>),
}

impl Deaggregated {
    /// Why the blob is a corrupt aggregate, if it is one.
    pub fn corruption(&self) -> Option<&'static str> {
        match self {
            Deaggregated::Corrupt(reason) => Some(reason),
            _ => None,
        }
    }

    /// Whether the blob was a valid aggregate.
    pub fn is_aggregate(&self) -> bool {
        matches!(self, Deaggregated::Aggregate(_))
    }
}

/// The reasons a [`Deaggregated::Corrupt`] gives: public for tests that check them.
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
mod reasons {
    /// [`Deaggregated::Corrupt`](super::Deaggregated::Corrupt) reason: shorter than the magic and the 16-byte digest.
    pub const CORRUPT_TRUNCATED: &str = "shorter than magic and digest";
    /// [`Deaggregated::Corrupt`](super::Deaggregated::Corrupt) reason: the MD5 digest does not match the protobuf bytes.
    pub const CORRUPT_DIGEST: &str = "md5 digest mismatch";
    /// [`Deaggregated::Corrupt`](super::Deaggregated::Corrupt) reason: the protobuf bytes do not parse as an `AggregatedRecord`.
    pub const CORRUPT_PROTOBUF: &str = "protobuf does not parse";
    /// [`Deaggregated::Corrupt`](super::Deaggregated::Corrupt) reason: a partition key index is outside the partition key table.
    pub const CORRUPT_PARTITION_KEY_INDEX: &str = "partition key index out of range";
    /// [`Deaggregated::Corrupt`](super::Deaggregated::Corrupt) reason: an explicit hash key index is outside its table.
    pub const CORRUPT_EXPLICIT_HASH_KEY_INDEX: &str = "explicit hash key index out of range";
    /// [`Deaggregated::Corrupt`](super::Deaggregated::Corrupt) reason: the aggregate holds no records.
    pub const CORRUPT_EMPTY: &str = "no records";
}
#[cfg(feature = "testing")]
pub use reasons::*;
#[cfg(not(feature = "testing"))]
use reasons::*;

/// Whether `blob` starts with [`KPL_MAGIC`] (it may still be a corrupt aggregate).
pub fn has_magic(blob: &[u8]) -> bool {
    blob.starts_with(&KPL_MAGIC)
}

/// Reads a Kinesis record's data blob: the sub-records of a KPL aggregate, or a verdict that the
/// blob is to be delivered whole.
///
/// Never fails: a blob without the magic is [`Deaggregated::Plain`]; a blob with the magic that
/// is too short, fails its MD5 check, does not parse, points outside its key tables or holds no
/// records is [`Deaggregated::Corrupt`]. In both cases the caller delivers the whole blob.
/// Sub-record data shares the blob's buffer (no copy).
///
/// ```
/// use bytes::Bytes;
/// use shardwise::kpl::{aggregate, deaggregate, Deaggregated};
///
/// let blob = aggregate(&[
///     ("user-1".to_owned(), None, Bytes::from_static(b"a")),
///     ("user-2".to_owned(), Some("42".to_owned()), Bytes::from_static(b"b")),
/// ]);
/// let Deaggregated::Aggregate(records) = deaggregate(&blob) else { panic!() };
/// assert_eq!(records[1].partition_key, "user-2");
/// assert_eq!(records[1].explicit_hash_key.as_deref(), Some("42"));
/// assert_eq!(records[1].sub_sequence, 1);
///
/// assert_eq!(deaggregate(&Bytes::from_static(b"hello")), Deaggregated::Plain);
/// assert!(deaggregate(&blob.slice(..blob.len() - 1)).corruption().is_some());
/// ```
pub fn deaggregate(blob: &Bytes) -> Deaggregated {
    if !has_magic(blob) {
        return Deaggregated::Plain;
    }
    match parse(blob) {
        Ok(records) => Deaggregated::Aggregate(records),
        Err(reason) => Deaggregated::Corrupt(reason),
    }
}

/// Parses a blob known to start with the magic.
fn parse(blob: &Bytes) -> Result<Vec<SubRecord>, &'static str> {
    if blob.len() < KPL_MAGIC.len() + DIGEST_LEN {
        return Err(CORRUPT_TRUNCATED);
    }
    let body_end = blob.len() - DIGEST_LEN;
    let body = blob.slice(KPL_MAGIC.len()..body_end);
    if Md5::digest(&body).as_slice() != &blob[body_end..] {
        return Err(CORRUPT_DIGEST);
    }
    // Decoding from `Bytes` makes each `data` field a slice of the same buffer.
    let aggregate = AggregatedRecord::decode(body).map_err(|_| CORRUPT_PROTOBUF)?;
    if aggregate.records.is_empty() {
        return Err(CORRUPT_EMPTY);
    }
    let lookup = |table: &[String], index: u64| {
        usize::try_from(index)
            .ok()
            .and_then(|i| table.get(i))
            .cloned()
    };
    aggregate
        .records
        .into_iter()
        .enumerate()
        .map(|(i, record)| {
            let partition_key = lookup(&aggregate.partition_key_table, record.partition_key_index)
                .ok_or(CORRUPT_PARTITION_KEY_INDEX)?;
            let explicit_hash_key = match record.explicit_hash_key_index {
                None => None,
                Some(index) => Some(
                    lookup(&aggregate.explicit_hash_key_table, index)
                        .ok_or(CORRUPT_EXPLICIT_HASH_KEY_INDEX)?,
                ),
            };
            Ok(SubRecord {
                partition_key,
                explicit_hash_key,
                data: record.data,
                sub_sequence: i as u64,
            })
        })
        .collect()
}

/// Builds a KPL aggregate from `(partition key, explicit hash key, data)` records, byte for byte
/// as the KPL writes it: keys are deduplicated into the tables in order of first use, and the
/// protobuf is followed by its MD5 digest.
///
/// For tests, and for producers that want KPL-compatible batching (any KCL-style consumer, this
/// one included, reads the result apart). Kinesis limits a record to 1 MiB: keeping the batch
/// under it is the caller's job. An empty `records` gives an aggregate with no records, which
/// [`deaggregate`] reports as [`Deaggregated::Corrupt`].
pub fn aggregate(records: &[(String, Option<String>, Bytes)]) -> Bytes {
    let mut partition_key_table: Vec<String> = Vec::new();
    let mut explicit_hash_key_table: Vec<String> = Vec::new();
    let mut pk_index: HashMap<&str, u64> = HashMap::new();
    let mut ehk_index: HashMap<&str, u64> = HashMap::new();
    let protobuf_records: Vec<Record> = records
        .iter()
        .map(|(partition_key, explicit_hash_key, data)| {
            let partition_key_index = *pk_index.entry(partition_key).or_insert_with(|| {
                partition_key_table.push(partition_key.clone());
                (partition_key_table.len() - 1) as u64
            });
            let explicit_hash_key_index = explicit_hash_key.as_deref().map(|key| {
                *ehk_index.entry(key).or_insert_with(|| {
                    explicit_hash_key_table.push(key.to_owned());
                    (explicit_hash_key_table.len() - 1) as u64
                })
            });
            Record {
                partition_key_index,
                explicit_hash_key_index,
                data: data.clone(),
                tags: Vec::new(),
            }
        })
        .collect();
    let body = AggregatedRecord {
        partition_key_table,
        explicit_hash_key_table,
        records: protobuf_records,
    }
    .encode_to_vec();
    let mut out = BytesMut::with_capacity(KPL_MAGIC.len() + body.len() + DIGEST_LEN);
    out.put_slice(&KPL_MAGIC);
    out.put_slice(&body);
    out.put_slice(Md5::digest(&body).as_slice());
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Magic, `body`, MD5 of `body`.
    fn wrap(body: &[u8]) -> Bytes {
        let mut out = KPL_MAGIC.to_vec();
        out.extend_from_slice(body);
        out.extend_from_slice(Md5::digest(body).as_slice());
        Bytes::from(out)
    }

    fn record(partition_key_index: u64, explicit_hash_key_index: Option<u64>) -> Record {
        Record {
            partition_key_index,
            explicit_hash_key_index,
            data: Bytes::from_static(b"d"),
            tags: Vec::new(),
        }
    }

    fn encoded(partition_keys: &[&str], hash_keys: &[&str], records: Vec<Record>) -> Bytes {
        wrap(
            &AggregatedRecord {
                partition_key_table: partition_keys.iter().map(|k| k.to_string()).collect(),
                explicit_hash_key_table: hash_keys.iter().map(|k| k.to_string()).collect(),
                records,
            }
            .encode_to_vec(),
        )
    }

    #[test]
    fn sub_record_data_shares_the_blob_buffer() {
        let blob = aggregate(&[
            ("a".into(), None, Bytes::from_static(b"first payload")),
            ("b".into(), None, Bytes::from_static(b"second payload")),
        ]);
        let Deaggregated::Aggregate(records) = deaggregate(&blob) else {
            panic!("not an aggregate")
        };
        let range = blob.as_ptr_range();
        for r in &records {
            assert!(range.contains(&r.data.as_ptr()), "data was copied");
            assert!(r.data.as_ptr_range().end <= range.end);
        }
        assert_eq!(records[0].data, &b"first payload"[..]);
    }

    #[test]
    fn tags_are_parsed_and_ignored() {
        let mut tagged = record(0, None);
        tagged.tags = vec![
            Tag {
                key: "k".into(),
                value: Some("v".into()),
            },
            Tag {
                key: "only-key".into(),
                value: None,
            },
        ];
        let blob = encoded(&["pk"], &[], vec![tagged]);
        let Deaggregated::Aggregate(records) = deaggregate(&blob) else {
            panic!("not an aggregate")
        };
        assert_eq!(records.len(), 1);
        assert_eq!(records[0].data, &b"d"[..]);
    }

    #[test]
    fn a_tag_with_invalid_utf8_makes_the_aggregate_corrupt() {
        // pk table ["p"], record { pk 0, data "", tag { key = FF } }
        let body = [
            0x0A, 0x01, b'p', 0x1A, 0x09, 0x08, 0x00, 0x1A, 0x00, 0x22, 0x03, 0x0A, 0x01, 0xFF,
        ];
        assert_eq!(
            deaggregate(&wrap(&body)),
            Deaggregated::Corrupt(CORRUPT_PROTOBUF)
        );
    }

    #[test]
    fn missing_required_fields_read_as_defaults() {
        // A proto3-style encoder omits index 0 and empty data: record 3 is `1A 00`.
        let body = [0x0A, 0x01, b'p', 0x1A, 0x00];
        let Deaggregated::Aggregate(records) = deaggregate(&wrap(&body)) else {
            panic!("not an aggregate")
        };
        assert_eq!(
            records,
            vec![SubRecord {
                partition_key: "p".into(),
                explicit_hash_key: None,
                data: Bytes::new(),
                sub_sequence: 0,
            }]
        );
    }

    #[test]
    fn indices_outside_the_tables_make_the_aggregate_corrupt() {
        let cases = [
            (
                encoded(&["a"], &[], vec![record(1, None)]),
                CORRUPT_PARTITION_KEY_INDEX,
            ),
            (
                encoded(&[], &[], vec![record(0, None)]),
                CORRUPT_PARTITION_KEY_INDEX,
            ),
            (
                encoded(&["a"], &[], vec![record(0, None), record(u64::MAX, None)]),
                CORRUPT_PARTITION_KEY_INDEX,
            ),
            (
                encoded(&["a"], &[], vec![record(0, Some(0))]),
                CORRUPT_EXPLICIT_HASH_KEY_INDEX,
            ),
            (
                encoded(&["a"], &["1"], vec![record(0, Some(1))]),
                CORRUPT_EXPLICIT_HASH_KEY_INDEX,
            ),
            (
                encoded(
                    &["a"],
                    &["1"],
                    vec![record(0, Some(0)), record(0, Some(u64::MAX))],
                ),
                CORRUPT_EXPLICIT_HASH_KEY_INDEX,
            ),
        ];
        for (blob, reason) in cases {
            assert_eq!(deaggregate(&blob), Deaggregated::Corrupt(reason));
        }
        assert!(deaggregate(&encoded(&["a"], &["1"], vec![record(0, Some(0))])).is_aggregate());
    }

    #[test]
    fn reasons_and_accessors() {
        assert_eq!(deaggregate(&Bytes::new()), Deaggregated::Plain);
        assert_eq!(deaggregate(&Bytes::new()).corruption(), None);
        let magic_only = Bytes::from_static(&KPL_MAGIC);
        assert_eq!(
            deaggregate(&magic_only).corruption(),
            Some(CORRUPT_TRUNCATED)
        );
        assert!(!deaggregate(&magic_only).is_aggregate());
        assert_eq!(
            deaggregate(&wrap(&[])),
            Deaggregated::Corrupt(CORRUPT_EMPTY)
        );
        assert_eq!(
            deaggregate(&aggregate(&[])),
            Deaggregated::Corrupt(CORRUPT_EMPTY)
        );
    }
}
