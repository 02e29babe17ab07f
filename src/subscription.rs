//! CloudWatch Logs subscription filter records on Kinesis: reading them apart.
//!
//! A subscription filter whose destination is a Kinesis stream writes the matching log events
//! of its group as Kinesis records whose data is a gzip-compressed JSON document
//! (`DATA_MESSAGE`), one record holding many events:
//!
//! ```text
//! {"messageType":"DATA_MESSAGE","owner":"123456789012","logGroup":"/aws/lambda/f",
//!  "logStream":"2026/12/07/[$LATEST]0f1e...","subscriptionFilters":["to-kinesis"],
//!  "logEvents":[{"id":"3719...","timestamp":1796601600000,"message":"START RequestId: ..."}]}
//! ```
//!
//! and, when the filter is created, a `CONTROL_MESSAGE` that checks the destination is reachable.
//! This is the way in for groups too busy to poll: the service pushes each event once, where
//! reading the group with GetLogEvents or FilterLogEvents rereads it (see `docs/paged.md`).
//!
//! With [`ConsumerBuilder::cloudwatch_subscription`](crate::ConsumerBuilder::cloudwatch_subscription)
//! (`consume --cloudwatch-subscription`) each log event is one delivery: sub-sequence `i` for the
//! record's `i`-th event, so checkpoints fall between events as within a KPL aggregate; the
//! payload is the message; the partition key is the log stream (a stream's events run in order,
//! other streams' beside them); the headers name the group, the stream, the event's id and
//! timestamp, the owner and the filters ([`LOG_GROUP_HEADER`] and the others). A control message
//! gives no delivery. A record that is not gzip, or whose document does not check out, is
//! delivered whole as one plain record, never lost: [`Unpacked::Corrupt`] says why, for the
//! caller to count and warn. This module logs nothing.

use std::io::Read;

use bytes::Bytes;
use serde::Deserialize;

use crate::envelope::Headers;

/// The log group an event came from.
pub const LOG_GROUP_HEADER: &str = "x-cloudwatch-log-group";
/// The log stream an event came from (also the delivery's partition key).
pub const LOG_STREAM_HEADER: &str = "x-cloudwatch-log-stream";
/// The event's id, as CloudWatch Logs gives it.
pub const EVENT_ID_HEADER: &str = "x-cloudwatch-event-id";
/// The event's timestamp, ms since the Unix epoch.
pub const TIMESTAMP_HEADER: &str = "x-cloudwatch-timestamp";
/// The account that owns the group.
pub const OWNER_HEADER: &str = "x-cloudwatch-owner";
/// The subscription filters that matched the event, comma-separated.
pub const FILTERS_HEADER: &str = "x-cloudwatch-subscription-filters";

/// The most a record's document may inflate to. Kinesis holds 1 MiB a record and CloudWatch Logs
/// writes at most 1 MiB of events into one; log lines compress 5-20x: 64 MiB is far above any
/// real document and bounds what a hostile record can make the reader allocate.
const MAX_DOCUMENT_BYTES: u64 = 64 * 1024 * 1024;

/// The gzip magic.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// The document a subscription filter writes.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Document {
    message_type: String,
    #[serde(default)]
    owner: String,
    #[serde(default)]
    log_group: String,
    #[serde(default)]
    log_stream: String,
    #[serde(default)]
    subscription_filters: Vec<String>,
    #[serde(default)]
    log_events: Vec<RawEvent>,
}

#[derive(Debug, Deserialize)]
struct RawEvent {
    /// A string of digits from the service; some emulators (moto) write a number.
    #[serde(deserialize_with = "id_text")]
    id: String,
    timestamp: i64,
    message: String,
}

/// An event id as text, whether written as a string or as a number.
fn id_text<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    match serde_json::Value::deserialize(d)? {
        serde_json::Value::String(s) => Ok(s),
        serde_json::Value::Number(n) => Ok(n.to_string()),
        other => Err(serde::de::Error::custom(format!(
            "an event id is a string, not {other}"
        ))),
    }
}

/// One log event unpacked from a subscription record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEvent {
    /// Its place among the record's events: the delivery's sub-sequence.
    pub sub_sequence: u64,
    /// The log group.
    pub log_group: String,
    /// The log stream.
    pub log_stream: String,
    /// The event's id.
    pub id: String,
    /// The event's timestamp, ms since the Unix epoch.
    pub timestamp_ms: i64,
    /// The account that owns the group.
    pub owner: String,
    /// The filters that matched, comma-separated.
    pub filters: String,
    /// The message.
    pub message: Bytes,
}

impl LogEvent {
    /// The headers its delivery carries.
    pub fn headers(&self) -> Headers {
        let mut headers = Headers::new();
        headers.insert(LOG_GROUP_HEADER, self.log_group.clone());
        headers.insert(LOG_STREAM_HEADER, self.log_stream.clone());
        headers.insert(EVENT_ID_HEADER, self.id.clone());
        headers.insert(TIMESTAMP_HEADER, self.timestamp_ms.to_string());
        headers.insert(OWNER_HEADER, self.owner.clone());
        headers.insert(FILTERS_HEADER, self.filters.clone());
        headers
    }
}

/// What a Kinesis record's data holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unpacked {
    /// A `DATA_MESSAGE`: its events, in order (at least one).
    Events(Vec<LogEvent>),
    /// A `CONTROL_MESSAGE`: nothing to deliver.
    Control,
    /// Not gzip: a plain record.
    Plain,
    /// Gzip that is not a subscription document (why): deliver it whole as a plain record.
    Corrupt(String),
}

/// Reads a record's data as a subscription filter's document.
pub fn unpack(data: &[u8]) -> Unpacked {
    if !data.starts_with(&GZIP_MAGIC) {
        return Unpacked::Plain;
    }
    let mut json = Vec::new();
    let read = flate2::read::MultiGzDecoder::new(data)
        .take(MAX_DOCUMENT_BYTES + 1)
        .read_to_end(&mut json);
    if let Err(e) = read {
        return Unpacked::Corrupt(format!("gzip that does not inflate: {e}"));
    }
    if json.len() as u64 > MAX_DOCUMENT_BYTES {
        return Unpacked::Corrupt(format!(
            "inflates past {MAX_DOCUMENT_BYTES} bytes: not a subscription document"
        ));
    }
    let document: Document = match serde_json::from_slice(&json) {
        Ok(d) => d,
        Err(e) => return Unpacked::Corrupt(format!("not a subscription document: {e}")),
    };
    match document.message_type.as_str() {
        "CONTROL_MESSAGE" => Unpacked::Control,
        "DATA_MESSAGE" if document.log_events.is_empty() => {
            Unpacked::Corrupt("a DATA_MESSAGE without log events".into())
        }
        "DATA_MESSAGE" => {
            let filters = document.subscription_filters.join(",");
            Unpacked::Events(
                document
                    .log_events
                    .into_iter()
                    .enumerate()
                    .map(|(i, e)| LogEvent {
                        sub_sequence: i as u64,
                        log_group: document.log_group.clone(),
                        log_stream: document.log_stream.clone(),
                        id: e.id,
                        timestamp_ms: e.timestamp,
                        owner: document.owner.clone(),
                        filters: filters.clone(),
                        message: Bytes::from(e.message),
                    })
                    .collect(),
            )
        }
        other => Unpacked::Corrupt(format!("messageType {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(bytes).unwrap();
        encoder.finish().unwrap()
    }

    /// The documented example of a subscription record's document (CloudWatch Logs User Guide,
    /// "Subscription filters with Amazon Kinesis Data Streams"), abridged to two events.
    const DATA: &str = r#"{"messageType":"DATA_MESSAGE","owner":"111111111111","logGroup":"CloudTrail/logs","logStream":"111111111111_CloudTrail/logs_us-east-1","subscriptionFilters":["Destination"],"logEvents":[{"id":"31953106606966983378809025079804211143289615424298221568","timestamp":1432826855000,"message":"{\"eventVersion\":\"1.03\"}"},{"id":"31953106606966983378809025079804211143289615424298221569","timestamp":1432826855000,"message":"{\"eventVersion\":\"1.03\",\"n\":2}"}]}"#;

    #[test]
    fn a_data_message_is_its_events_in_order_with_where_they_came_from() {
        let Unpacked::Events(events) = unpack(&gzip(DATA.as_bytes())) else {
            panic!("events");
        };
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].sub_sequence, 0);
        assert_eq!(events[1].sub_sequence, 1);
        assert_eq!(&events[1].message[..], br#"{"eventVersion":"1.03","n":2}"#);
        assert_eq!(events[0].log_group, "CloudTrail/logs");
        assert_eq!(
            events[0].log_stream,
            "111111111111_CloudTrail/logs_us-east-1"
        );
        assert_eq!(events[0].timestamp_ms, 1_432_826_855_000);
        let headers = events[0].headers();
        assert_eq!(
            headers.get_str(EVENT_ID_HEADER),
            Some("31953106606966983378809025079804211143289615424298221568")
        );
        assert_eq!(headers.get_str(TIMESTAMP_HEADER), Some("1432826855000"));
        assert_eq!(headers.get_str(OWNER_HEADER), Some("111111111111"));
        assert_eq!(headers.get_str(FILTERS_HEADER), Some("Destination"));
    }

    #[test]
    fn an_event_id_written_as_a_number_is_read_as_its_digits() {
        let doc = r#"{"messageType":"DATA_MESSAGE","logGroup":"g","logStream":"s","logEvents":[{"id":72,"timestamp":5,"message":"m"}]}"#;
        let Unpacked::Events(events) = unpack(&gzip(doc.as_bytes())) else {
            panic!("events");
        };
        assert_eq!(events[0].id, "72");
    }

    #[test]
    fn a_control_message_has_nothing_to_deliver() {
        let control = r#"{"messageType":"CONTROL_MESSAGE","owner":"CloudwatchLogs","logGroup":"","logStream":"","subscriptionFilters":[],"logEvents":[{"id":"","timestamp":1432826855000,"message":"CWL CONTROL MESSAGE: Checking health of destination Kinesis stream."}]}"#;
        assert_eq!(unpack(&gzip(control.as_bytes())), Unpacked::Control);
    }

    #[test]
    fn what_is_not_a_subscription_document_is_a_plain_record_or_corrupt() {
        assert_eq!(unpack(b"plain text"), Unpacked::Plain);
        assert_eq!(unpack(b""), Unpacked::Plain);
        for (what, data) in [
            (
                "gzip magic, then garbage",
                vec![0x1f, 0x8b, 0x00, 0x01, 0x02],
            ),
            ("gzip of text", gzip(b"hello")),
            ("gzip of other JSON", gzip(br#"{"a":1}"#)),
            (
                "no events",
                gzip(br#"{"messageType":"DATA_MESSAGE","logEvents":[]}"#),
            ),
            (
                "an unknown message type",
                gzip(br#"{"messageType":"OTHER","logEvents":[]}"#),
            ),
        ] {
            assert!(
                matches!(unpack(&data), Unpacked::Corrupt(_)),
                "{what}: {:?}",
                unpack(&data)
            );
        }
    }

    #[test]
    fn a_document_inflating_past_the_bound_is_corrupt_not_read_whole() {
        let bomb = gzip(&vec![b' '; MAX_DOCUMENT_BYTES as usize + 10]);
        assert!(bomb.len() < 1024 * 1024, "{} bytes", bomb.len());
        let Unpacked::Corrupt(why) = unpack(&bomb) else {
            panic!("corrupt");
        };
        assert!(why.contains("inflates past"), "{why}");
    }
}
