//! `--exec-format lambda`: a batch written as Lambda's Kinesis event, and the program's answer read
//! as Lambda's Kinesis trigger reads a function's (with `ReportBatchItemFailures`).
//!
//! A request is one line, an envelope around the event, with the protocol's id so the answer
//! can be matched:
//!
//! ```text
//! {"id": 7, "event": {"Records": [record, ...]}, "records": [{"idempotency_key": ..., "origin": {...}, "attempt": 1}, ...]}
//! ```
//!
//! `event` is what Lambda passes a function, field for field; `records` goes with `Records` one
//! for one and carries what the event has no field for. The answer is `{"id": 7, "response": R}`
//! (what the function returned) or `{"id": 7, "error": E}` (it raised), read by [`read_answer`].

use std::time::SystemTime;

use base64::Engine;
use serde_json::{Value, json};
use shardwise::window::WindowCall;
use shardwise::{Delivery, Outcome};

/// What every record of the event says about where it comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EventSource {
    /// `eventSourceARN`: the stream's ARN.
    stream_arn: String,
    /// `awsRegion`: the stream's region.
    region: String,
    /// `invokeIdentityArn`: the role a function of this name would run as (the worker runs with
    /// its own credentials; Lambda would name the function's execution role).
    identity_arn: String,
    /// The function's ARN, for the runner's `invoked_function_arn`.
    function_arn: String,
}

impl EventSource {
    /// The source of a stream whose ARN is `stream_arn` (`arn:PARTITION:kinesis:REGION:ACCOUNT:stream/NAME`),
    /// read by a function called `function`.
    pub(crate) fn new(stream_arn: &str, function: &str) -> Self {
        let parts: Vec<&str> = stream_arn.split(':').collect();
        let part = |i: usize, default: &'static str| {
            parts
                .get(i)
                .copied()
                .filter(|p| !p.is_empty())
                .unwrap_or(default)
        };
        let (partition, region, account) = (part(1, "aws"), part(3, ""), part(4, "000000000000"));
        Self {
            stream_arn: stream_arn.to_string(),
            region: region.to_string(),
            identity_arn: format!("arn:{partition}:iam::{account}:role/{function}"),
            function_arn: format!("arn:{partition}:lambda:{region}:{account}:function:{function}"),
        }
    }

    /// The function's ARN (`arn:PARTITION:lambda:REGION:ACCOUNT:function:NAME`).
    pub(crate) fn function_arn(&self) -> &str {
        &self.function_arn
    }
}

/// The request line for `batch` (one lane of one shard, in order) as request `id`, and the
/// sequence numbers of its records in order, which the answer's item identifiers name.
pub(crate) fn request_line(
    id: u64,
    batch: &[Delivery],
    source: &EventSource,
) -> (String, Vec<String>) {
    let sequences: Vec<String> = batch
        .iter()
        .map(|d| d.sequence_number().to_string())
        .collect();
    let records: Vec<Value> = batch
        .iter()
        .zip(&sequences)
        .map(|(d, sequence)| record(d, sequence, source))
        .collect();
    let extra: Vec<Value> = batch
        .iter()
        .map(|d| {
            let mut fields = super::identity(d);
            fields.insert("attempt".into(), json!(d.attempt()));
            fields.insert("subsequence".into(), json!(d.sub_sequence()));
            Value::Object(fields)
        })
        .collect();
    let line = json!({ "id": id, "event": { "Records": records }, "records": extra });
    (line.to_string(), sequences)
}

/// The request line of a tumbling window's call as request `id`, and the sequence numbers of its
/// records: Lambda's `KinesisTimeWindowEvent`, its `Records` as [`request_line`] writes them and
/// beside them `window` (`start`, `end`, ISO 8601 in UTC), `state` (what the function returned
/// last for this shard and window; `{}` at the window's first call), `shardId`,
/// `eventSourceARN`, `isFinalInvokeForWindow` and `isWindowTerminatedEarly`.
pub(crate) fn window_request_line(
    id: u64,
    call: &WindowCall,
    source: &EventSource,
) -> (String, Vec<String>) {
    let (line, sequences) = request_line(id, &call.records, source);
    let mut request: Value = serde_json::from_str(&line).expect("a request line is JSON");
    let iso = |at: SystemTime| humantime::format_rfc3339_seconds(at).to_string();
    let state = call
        .state
        .as_ref()
        .and_then(|s| serde_json::from_slice::<Value>(s).ok())
        .unwrap_or_else(|| json!({}));
    let event = request["event"].as_object_mut().expect("an event");
    event.insert(
        "window".into(),
        json!({ "start": iso(call.window.start()), "end": iso(call.window.end()) }),
    );
    event.insert("state".into(), state);
    event.insert("shardId".into(), json!(call.shard_id));
    event.insert("eventSourceARN".into(), json!(source.stream_arn));
    event.insert("isFinalInvokeForWindow".into(), json!(call.is_final));
    event.insert(
        "isWindowTerminatedEarly".into(),
        json!(call.terminated_early),
    );
    (request.to_string(), sequences)
}

/// Reads a function's answer to a tumbling window's call as Lambda does: [`read_answer`]'s rules
/// for its records, and the `state` the response must carry (as JSON text). A response without
/// `state` (or an error) is a failed call: `None`, every record retried.
pub(crate) fn read_window_answer(
    error: Option<&Value>,
    response: Option<&Value>,
    sequences: &[String],
) -> (Read, Option<Vec<u8>>) {
    let state = match (error, response.and_then(|r| r.get("state"))) {
        (None, Some(state)) => state,
        (Some(_), _) => return (read_answer(error, response, sequences), None),
        (None, None) => {
            return (
                Read {
                    outcomes: vec![Outcome::Retry; sequences.len()],
                    batch_failed: Some(
                        "the response has no `state`: with a tumbling window, Lambda counts the call failed"
                            .into(),
                    ),
                },
                None,
            );
        }
    };
    let read = read_answer(None, response, sequences);
    if read.batch_failed.is_some() {
        return (read, None);
    }
    (read, Some(state.to_string().into_bytes()))
}

/// One record as Lambda's Kinesis event has it.
fn record(d: &Delivery, sequence: &str, source: &EventSource) -> Value {
    let mut kinesis = json!({
        "kinesisSchemaVersion": "1.0",
        "partitionKey": d.partition_key(),
        "sequenceNumber": sequence,
        "data": base64::engine::general_purpose::STANDARD.encode(d.payload()),
    });
    // Seconds since the epoch, with milliseconds (Kinesis gives every record one; a delivery
    // built by hand may have none).
    if let Some(at) = d
        .arrived_at()
        .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
    {
        kinesis["approximateArrivalTimestamp"] = json!(at.as_millis() as f64 / 1000.0);
    }
    json!({
        "kinesis": kinesis,
        "eventSource": "aws:kinesis",
        "eventVersion": "1.0",
        "eventID": format!("{}:{sequence}", d.shard()),
        "eventName": "aws:kinesis:record",
        "invokeIdentityArn": source.identity_arn,
        "awsRegion": source.region,
        "eventSourceARN": source.stream_arn,
    })
}

/// What an answer means for the records of its batch.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Read {
    /// One outcome per record, in the batch's order: `Ack`, or `Retry` for a failed one.
    pub(crate) outcomes: Vec<Outcome>,
    /// Why the whole batch failed, when it did.
    pub(crate) batch_failed: Option<String>,
}

/// Reads a function's answer as Lambda's Kinesis trigger does with `ReportBatchItemFailures`:
///
/// | the answer | the batch |
/// |---|---|
/// | `error` (the function raised) | every record failed |
/// | no `response`, `null`, a response that is not an object, no `batchItemFailures`, `null` or `[]` | every record succeeded |
/// | `batchItemFailures` naming records by `itemIdentifier` (their sequence number) | the first record named failed, and every later one of the batch (Lambda retries from the lowest sequence number named); the earlier ones succeeded |
/// | an `itemIdentifier` that is null, empty, not a string or names no record of the batch; `batchItemFailures` that is not a list | every record failed |
///
/// Records of one KPL aggregate share their sequence number: an identifier names the first of
/// them.
pub(crate) fn read_answer(
    error: Option<&Value>,
    response: Option<&Value>,
    sequences: &[String],
) -> Read {
    let all = |outcome: Outcome, why: Option<String>| Read {
        outcomes: vec![outcome; sequences.len()],
        batch_failed: why,
    };
    if let Some(error) = error {
        return all(
            Outcome::Retry,
            Some(format!("the function failed: {}", error_text(error))),
        );
    }
    let failures = match response.and_then(|r| r.get("batchItemFailures")) {
        None | Some(Value::Null) => return all(Outcome::Ack, None),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return all(
                Outcome::Retry,
                Some(format!("batchItemFailures is not a list: {other}")),
            );
        }
    };
    let mut first = None;
    for item in failures {
        let named = item.get("itemIdentifier");
        let at = match named {
            Some(Value::String(s)) if !s.is_empty() => sequences.iter().position(|q| q == s),
            _ => None,
        };
        let Some(at) = at else {
            let named = named.map_or("nothing".to_string(), Value::to_string);
            return all(
                Outcome::Retry,
                Some(format!(
                    "batchItemFailures names {named}, which is no record of the batch"
                )),
            );
        };
        first = Some(first.map_or(at, |f: usize| f.min(at)));
    }
    let first = first.unwrap_or(sequences.len());
    Read {
        outcomes: (0..sequences.len())
            .map(|i| {
                if i < first {
                    Outcome::Ack
                } else {
                    Outcome::Retry
                }
            })
            .collect(),
        batch_failed: None,
    }
}

/// An error answer in a few words: Lambda's `errorType: errorMessage`, or the value itself.
fn error_text(error: &Value) -> String {
    let field = |name: &str| error.get(name).and_then(Value::as_str);
    match (field("errorType"), field("errorMessage")) {
        (Some(kind), Some(message)) => format!("{kind}: {message}"),
        (None, Some(message)) => message.to_string(),
        _ => error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use shardwise::envelope::Headers;
    use shardwise::{Position, SequenceNumber};

    use super::*;

    fn sequences() -> Vec<String> {
        ["101", "102", "103", "104"].map(String::from).to_vec()
    }

    #[test]
    fn answers_read_as_lambdas_kinesis_trigger_reads_them() {
        use Outcome::{Ack as A, Retry as R};
        let failed = true;
        // (what the program wrote, the outcomes, whether the whole batch failed), each a case
        // of Lambda's partial batch response documentation or what it implies.
        let cases: Vec<(Value, [Outcome; 4], bool)> = vec![
            // Nothing returned (a handler without a return), or null: all succeeded.
            (json!({}), [A, A, A, A], !failed),
            (json!({"response": null}), [A, A, A, A], !failed),
            // A response that says nothing of items (a string, an object without the field).
            (
                json!({"response": "Successfully processed 4 records."}),
                [A, A, A, A],
                !failed,
            ),
            (
                json!({"response": {"statusCode": 200}}),
                [A, A, A, A],
                !failed,
            ),
            // An empty or null list of failures.
            (
                json!({"response": {"batchItemFailures": []}}),
                [A, A, A, A],
                !failed,
            ),
            (
                json!({"response": {"batchItemFailures": null}}),
                [A, A, A, A],
                !failed,
            ),
            // One failure: it and every later record are retried, the earlier ones are done.
            (
                json!({"response": {"batchItemFailures": [{"itemIdentifier": "102"}]}}),
                [A, R, R, R],
                !failed,
            ),
            // Several, in any order: from the lowest on.
            (
                json!({"response": {"batchItemFailures": [{"itemIdentifier": "104"}, {"itemIdentifier": "103"}]}}),
                [A, A, R, R],
                !failed,
            ),
            // The last record alone.
            (
                json!({"response": {"batchItemFailures": [{"itemIdentifier": "104", "note": "x"}]}}),
                [A, A, A, R],
                !failed,
            ),
            // The function raised: the whole batch.
            (
                json!({"error": {"errorType": "ValueError", "errorMessage": "bad"}}),
                [R, R, R, R],
                failed,
            ),
            (
                json!({"error": "boom", "response": null}),
                [R, R, R, R],
                failed,
            ),
            // An identifier that is empty, null, missing, not a string, or of another batch.
            (
                json!({"response": {"batchItemFailures": [{"itemIdentifier": ""}]}}),
                [R, R, R, R],
                failed,
            ),
            (
                json!({"response": {"batchItemFailures": [{"itemIdentifier": null}]}}),
                [R, R, R, R],
                failed,
            ),
            (
                json!({"response": {"batchItemFailures": [{}]}}),
                [R, R, R, R],
                failed,
            ),
            (
                json!({"response": {"batchItemFailures": [{"itemIdentifier": 103}]}}),
                [R, R, R, R],
                failed,
            ),
            (
                json!({"response": {"batchItemFailures": [{"itemIdentifier": "103"}, {"itemIdentifier": "999"}]}}),
                [R, R, R, R],
                failed,
            ),
            // A list that is not one.
            (
                json!({"response": {"batchItemFailures": "102"}}),
                [R, R, R, R],
                failed,
            ),
        ];
        for (answer, outcomes, whole) in cases {
            let read = read_answer(answer.get("error"), answer.get("response"), &sequences());
            assert_eq!(read.outcomes, outcomes, "{answer}");
            assert_eq!(read.batch_failed.is_some(), whole, "{answer}: {read:?}");
        }
    }

    /// The time-window event of Lambda's documentation (`KinesisTimeWindowEvent`), field for
    /// field beside the records, and `{}` as the state of a window's first call.
    #[test]
    fn a_window_call_becomes_lambdas_time_window_event() {
        let source = EventSource::new(
            "arn:aws:kinesis:us-east-1:123456789012:stream/lambda-stream",
            "fn",
        );
        let sequence =
            SequenceNumber::parse("49590338271490256608559692538361571095921575989136588898")
                .unwrap();
        let record = Delivery::builder(
            "lambda-stream",
            "shardId-000000000006",
            Position::new(sequence, 0),
        )
        .partition_key("1")
        .payload("Hello, this is a test.")
        .arrived_at(SystemTime::UNIX_EPOCH + Duration::from_secs(1_607_497_475))
        .build();
        let window = shardwise::window::Window::of(1_607_497_475_000, Duration::from_secs(120));
        let mut call = WindowCall {
            window,
            state: Some(br#"{"1": 282, "2": 715}"#.to_vec().into()),
            records: vec![record],
            stream: "lambda-stream".into(),
            shard_id: "shardId-000000000006".into(),
            is_final: false,
            terminated_early: false,
        };
        let (line, sequences) = window_request_line(3, &call, &source);
        assert_eq!(sequences.len(), 1);
        let event = &serde_json::from_str::<Value>(&line).unwrap()["event"];
        assert_eq!(
            event["window"],
            json!({"start": "2020-12-09T07:04:00Z", "end": "2020-12-09T07:06:00Z"})
        );
        assert_eq!(event["state"], json!({"1": 282, "2": 715}));
        assert_eq!(event["shardId"], "shardId-000000000006");
        assert_eq!(
            event["eventSourceARN"],
            "arn:aws:kinesis:us-east-1:123456789012:stream/lambda-stream"
        );
        assert_eq!(event["isFinalInvokeForWindow"], false);
        assert_eq!(event["isWindowTerminatedEarly"], false);
        assert_eq!(event["Records"][0]["kinesis"]["partitionKey"], "1");
        // A window's first call: `{}`; its final call: no records.
        call.state = None;
        call.records.clear();
        call.is_final = true;
        let (line, _) = window_request_line(4, &call, &source);
        let event = &serde_json::from_str::<Value>(&line).unwrap()["event"];
        assert_eq!(event["state"], json!({}));
        assert_eq!(event["Records"], json!([]));
        assert_eq!(event["isFinalInvokeForWindow"], true);
    }

    /// A window's answer must carry `state` (Lambda: "if the response does not contain a state
    /// property, Lambda considers this a failed invocation"); its `batchItemFailures` read as
    /// always.
    #[test]
    fn a_window_answer_without_state_fails_the_call() {
        let cases: Vec<(Value, Option<&str>, bool)> = vec![
            (
                json!({"response": {"state": {"a": 1}}}),
                Some(r#"{"a":1}"#),
                false,
            ),
            (
                json!({"response": {"state": {}, "batchItemFailures": []}}),
                Some("{}"),
                false,
            ),
            (json!({"response": {"batchItemFailures": []}}), None, true),
            (json!({"response": null}), None, true),
            (json!({}), None, true),
            (json!({"error": {"errorMessage": "boom"}}), None, true),
        ];
        for (answer, state, failed) in cases {
            let (read, got) =
                read_window_answer(answer.get("error"), answer.get("response"), &sequences());
            assert_eq!(got.as_deref(), state.map(str::as_bytes), "{answer}");
            assert_eq!(read.batch_failed.is_some(), failed, "{answer}");
        }
        // A partial failure keeps the state (of the records before it).
        let answer = json!({"response": {"state": {"n": 1}, "batchItemFailures": [{"itemIdentifier": "102"}]}});
        let (read, state) = read_window_answer(None, answer.get("response"), &sequences());
        assert_eq!(state.as_deref(), Some(&br#"{"n":1}"#[..]));
        assert_eq!(
            read.outcomes,
            [Outcome::Ack, Outcome::Retry, Outcome::Retry, Outcome::Retry]
        );
    }

    #[test]
    fn a_batch_becomes_lambdas_kinesis_event_field_for_field() {
        let source = EventSource::new(
            "arn:aws:kinesis:eu-west-1:123456789012:stream/orders",
            "billing",
        );
        assert_eq!(
            source.function_arn(),
            "arn:aws:lambda:eu-west-1:123456789012:function:billing"
        );
        let sequence =
            SequenceNumber::parse("49590338271490256608559692538361571095921575989136588898")
                .unwrap();
        let first = Delivery::builder("orders", "shardId-000000000006", Position::new(sequence, 0))
            .partition_key("1")
            .payload("Hello, this is a test.")
            .arrived_at(SystemTime::UNIX_EPOCH + Duration::from_millis(1_545_084_650_987))
            .build();
        // A retry copy: its own position, its origin's identity.
        let mut headers = Headers::new();
        headers.insert("x-ruststream-retry-count", "1");
        headers.insert("x-shardwise-origin-stream", "orders");
        headers.insert("x-shardwise-origin-shard", "shardId-000000000002");
        headers.insert("x-shardwise-origin-sequence", "4959");
        headers.insert("x-shardwise-origin-subsequence", "3");
        let copy = Delivery::builder(
            "orders",
            "shardId-000000000006",
            Position::new(
                SequenceNumber::parse("49590338271490256608559692538361571095921575989136588899")
                    .unwrap(),
                0,
            ),
        )
        .partition_key("2")
        .payload(vec![0xffu8, 0])
        .headers(headers)
        .arrived_at(SystemTime::UNIX_EPOCH + Duration::from_millis(1_545_084_651_000))
        .build();
        let (line, sequences) = request_line(7, &[first, copy], &source);
        assert_eq!(
            sequences,
            [
                "49590338271490256608559692538361571095921575989136588898",
                "49590338271490256608559692538361571095921575989136588899"
            ]
        );
        let line: Value = serde_json::from_str(&line).unwrap();
        // The record of AWS's documented example event, with this source's ARNs.
        assert_eq!(
            line["event"]["Records"][0],
            json!({
                "kinesis": {
                    "kinesisSchemaVersion": "1.0",
                    "partitionKey": "1",
                    "sequenceNumber": "49590338271490256608559692538361571095921575989136588898",
                    "data": "SGVsbG8sIHRoaXMgaXMgYSB0ZXN0Lg==",
                    "approximateArrivalTimestamp": 1545084650.987
                },
                "eventSource": "aws:kinesis",
                "eventVersion": "1.0",
                "eventID": "shardId-000000000006:49590338271490256608559692538361571095921575989136588898",
                "eventName": "aws:kinesis:record",
                "invokeIdentityArn": "arn:aws:iam::123456789012:role/billing",
                "awsRegion": "eu-west-1",
                "eventSourceARN": "arn:aws:kinesis:eu-west-1:123456789012:stream/orders"
            })
        );
        assert_eq!(line["event"]["Records"][1]["kinesis"]["data"], "/wA=");
        assert_eq!(
            line["event"]["Records"][1]["kinesis"]["approximateArrivalTimestamp"],
            json!(1545084651.0)
        );
        assert_eq!(line["id"], 7);
        assert_eq!(
            line["records"],
            json!([
                {
                    "idempotency_key": "kinesis/orders/shardId-000000000006/49590338271490256608559692538361571095921575989136588898.0",
                    "origin": {"stream": "orders", "shard": "shardId-000000000006", "sequence": "49590338271490256608559692538361571095921575989136588898", "subsequence": 0},
                    "attempt": 1,
                    "subsequence": 0
                },
                {
                    "idempotency_key": "kinesis/orders/shardId-000000000002/4959.3",
                    "origin": {"stream": "orders", "shard": "shardId-000000000002", "sequence": "4959", "subsequence": 3},
                    "attempt": 2,
                    "subsequence": 0
                }
            ])
        );
    }
}
