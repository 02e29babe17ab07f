//! On-failure destinations: where a record whose attempts are spent goes instead of a
//! dead-letter stream, as Lambda's event source mappings send failed batches to an SQS queue or
//! an S3 bucket. Unlike Lambda's, which carry only the batch's metadata, these carry the record.
//!
//! The record is written before it settles: a write that fails is tried again and holds the
//! checkpoint (a permanent failure, a missing queue or bucket or a refused permission, is an
//! error log naming the record, `shardwise_copy_write_failures_total{permanent="true"}` and an
//! entry in `Running::stuck_writes()`, as for a dead-letter stream). Each destination is checked
//! when the consumer starts.
//!
//! Both store the same JSON document for a record ([`document`]):
//!
//! ```json
//! {
//!   "stream": "orders", "shard": "shardId-000000000001",
//!   "sequenceNumber": "49654...", "subSequenceNumber": 0,
//!   "partitionKey": "customer-7", "approximateArrivalTimestamp": 1764547200123,
//!   "attempts": 3, "reason": "attempts spent: 3 of 3", "eventId": "kinesis/orders/...",
//!   "headers": {"tenant": "acme"}, "data": "aGVsbG8="
//! }
//! ```
//!
//! `data` is the record's payload (the header envelope removed), base64; `headers` are its own
//! headers (shardwise's and ruststream's retry bookkeeping left out: `attempts` and `reason` say
//! it). For a paged event `stream` is the source, `shard` the partition and `sequenceNumber` its
//! position. `approximateArrivalTimestamp` is milliseconds since the epoch, or null.
//!
//! - [`SqsDestination`] (feature `sqs`): one message a record, the document as its body. SQS
//!   takes messages up to 256 KiB (an account may have raised it): a larger document is refused
//!   for good (the record is stuck, loudly, holding its shard's checkpoint): for records of more
//!   than about 190 KiB, use an S3 bucket.
//! - [`S3Destination`] (feature `s3`): one object a record, the document as its body (JSON), at
//!   `PREFIX` `STREAM/SHARD/SEQUENCE-SUBSEQUENCE.json` (a paged event: `SOURCE/PARTITION/POSITION.json`),
//!   so writing one twice (a crash after the write, before the checkpoint) replaces it.
//! - [`SnsDestination`] (feature `sns`): one message a record published to a topic, its body
//!   Lambda's failure record ([`lambda_failure_record`]: `requestContext`, `responseContext`,
//!   `version`, `timestamp` and, for a Kinesis record, `KinesisBatchInfo` of a batch of one)
//!   with the document's fields beside them, so a subscriber written for Lambda's SNS
//!   destination reads it unchanged and finds the record in it too. SNS takes messages up to
//!   256 KiB. A FIFO topic (`.fifo`) gets the shard as the message group and the event's id
//!   (hashed) as the deduplication id.

use std::fmt;

use futures::future::BoxFuture;

use crate::envelope::Headers;
use crate::error::Error;
use crate::handler::Delivery;

/// Where a spent record goes instead of a dead-letter stream (see the [module docs](self)).
pub trait Destination: Send + Sync + fmt::Debug + 'static {
    /// Its name in logs, `Settled::DeadLettered` and `Running::stuck_writes()`: `sqs:URL`,
    /// `s3://BUCKET/PREFIX`.
    fn name(&self) -> &str;

    /// Writes `delivery`, whose attempts are spent, with `headers` (its own, and the reason and
    /// attempt count). Durable once it returns `Ok`.
    fn send<'a>(
        &'a self,
        delivery: &'a Delivery,
        headers: &'a Headers,
    ) -> BoxFuture<'a, Result<(), Error>>;

    /// Checks that it exists and can be written, once, when the consumer starts.
    fn check(&self) -> BoxFuture<'_, Result<(), Error>>;
}

/// The JSON document a destination stores for a spent record (see the [module docs](self)).
#[cfg(any(feature = "sqs", feature = "s3", feature = "sns"))]
pub fn document(delivery: &Delivery, headers: &Headers) -> serde_json::Value {
    use base64::Engine;
    use serde_json::json;
    let own: serde_json::Map<String, serde_json::Value> = headers
        .iter()
        .filter(|(name, _)| !bookkeeping(name))
        .map(|(name, value)| {
            (
                name.to_string(),
                String::from_utf8_lossy(value).into_owned().into(),
            )
        })
        .collect();
    let arrived = delivery.arrived_at().and_then(|t| {
        t.duration_since(std::time::UNIX_EPOCH)
            .ok()
            .map(|d| d.as_millis() as u64)
    });
    // A paged event's place is its position; a record's, its sequence number.
    let sequence = match delivery.page_position() {
        Some(_) => delivery.locator().to_string(),
        None => delivery.sequence_number().to_string(),
    };
    json!({
        "stream": delivery.stream(),
        "shard": delivery.shard(),
        "sequenceNumber": sequence,
        "subSequenceNumber": delivery.sub_sequence(),
        "partitionKey": delivery.partition_key(),
        "approximateArrivalTimestamp": arrived,
        "attempts": headers
            .get_str(crate::retry::ATTEMPTS_HEADER)
            .and_then(|a| a.parse::<u32>().ok())
            .unwrap_or_else(|| delivery.attempt()),
        "reason": headers.get_str(crate::retry::DEAD_LETTER_REASON_HEADER).unwrap_or_default(),
        "eventId": delivery.event_id().as_str(),
        "headers": own,
        "data": base64::engine::general_purpose::STANDARD.encode(delivery.payload()),
    })
}

/// Lambda's failure record for a spent record (what an event source mapping sends its SNS or
/// SQS on-failure destination), merged with the record's [`document`]: `requestContext`
/// (`condition` `RetryAttemptsExhausted`, or `RecordAgeExceeded` for a record too old;
/// `approximateInvokeCount` its attempts; `requestId` its event id), `responseContext`
/// (`functionError` `Unhandled`), `version` `1.0`, `timestamp` (now, ISO 8601) and, for a Kinesis
/// record, `KinesisBatchInfo` for a batch of one (`shardId`, `startSequenceNumber` and
/// `endSequenceNumber` its sequence number, `approximateArrivalOfFirstRecord` and `...LastRecord`,
/// `batchSize` 1, `streamArn` as given, else null). Lambda's record carries no data: the
/// document's fields (`data`, `partitionKey`, ...) stand beside it.
#[cfg(feature = "sns")]
pub fn lambda_failure_record(
    delivery: &Delivery,
    headers: &Headers,
    stream_arn: Option<&str>,
) -> serde_json::Value {
    use serde_json::json;
    let iso = |t: std::time::SystemTime| {
        aws_sdk_sns::primitives::DateTime::from(t)
            .fmt(aws_sdk_sns::primitives::DateTimeFormat::DateTime)
            .ok()
    };
    let mut record = document(delivery, headers);
    let reason = record["reason"].as_str().unwrap_or_default();
    let condition = if reason.starts_with("record too old") {
        "RecordAgeExceeded"
    } else {
        "RetryAttemptsExhausted"
    };
    let fields = record.as_object_mut().expect("the document is an object");
    fields.insert(
        "requestContext".into(),
        json!({
            "requestId": delivery.event_id().as_str(),
            "functionArn": null,
            "condition": condition,
            "approximateInvokeCount": fields["attempts"].clone(),
        }),
    );
    fields.insert(
        "responseContext".into(),
        json!({ "statusCode": 200, "executedVersion": "$LATEST", "functionError": "Unhandled" }),
    );
    fields.insert("version".into(), json!("1.0"));
    fields.insert("timestamp".into(), json!(iso(crate::time::now())));
    if delivery.page_position().is_none() {
        let sequence = delivery.sequence_number().to_string();
        let arrived = delivery.arrived_at().and_then(iso);
        fields.insert(
            "KinesisBatchInfo".into(),
            json!({
                "shardId": delivery.shard(),
                "startSequenceNumber": sequence,
                "endSequenceNumber": sequence,
                "approximateArrivalOfFirstRecord": arrived,
                "approximateArrivalOfLastRecord": arrived,
                "batchSize": 1,
                "streamArn": stream_arn,
            }),
        );
    }
    record
}

/// Headers that are shardwise's or ruststream's retry bookkeeping, told by the document's own
/// fields instead.
#[cfg(any(feature = "sqs", feature = "s3", feature = "sns"))]
fn bookkeeping(name: &str) -> bool {
    name.starts_with("x-shardwise-") || name.starts_with("x-ruststream-")
}

/// A destination's error: permanent ones (a missing queue or bucket, a refused permission, a
/// message too large) hold the record loudly until fixed; the rest are tried again.
#[cfg(any(feature = "sqs", feature = "s3", feature = "sns"))]
fn failure(
    destination: &str,
    operation: &'static str,
    permanent: bool,
    source: impl Into<crate::error::BoxError>,
) -> Error {
    Error::Destination {
        destination: destination.to_string(),
        operation,
        permanent,
        source: source.into(),
    }
}

/// A message body larger than `service` takes (`max` bytes): refused for good, naming both.
#[cfg(any(feature = "sqs", feature = "sns"))]
fn too_large(
    destination: &str,
    operation: &'static str,
    service: &str,
    body: &str,
    max: usize,
) -> Result<(), Error> {
    if body.len() <= max {
        return Ok(());
    }
    Err(failure(
        destination,
        operation,
        true,
        format!(
            "the record's message is {} bytes, over {service}'s {max}: use an S3 bucket for records this large",
            body.len()
        ),
    ))
}

/// An SQS queue as the on-failure destination (feature `sqs`): one message a record, the
/// [`document`] as its body.
#[cfg(feature = "sqs")]
#[derive(Debug, Clone)]
pub struct SqsDestination {
    client: aws_sdk_sqs::Client,
    queue_url: String,
    name: String,
}

/// The largest message SQS takes by default (256 KiB).
#[cfg(feature = "sqs")]
pub const SQS_MAX_MESSAGE_BYTES: usize = 256 * 1024;

#[cfg(feature = "sqs")]
impl SqsDestination {
    /// The queue at `queue_url`, written with `client`.
    pub fn new(client: aws_sdk_sqs::Client, queue_url: impl Into<String>) -> Self {
        let queue_url = queue_url.into();
        Self {
            client,
            name: format!("sqs:{queue_url}"),
            queue_url,
        }
    }
}

#[cfg(feature = "sqs")]
fn sqs_permanent(code: Option<&str>) -> bool {
    matches!(
        code,
        Some(
            "AWS.SimpleQueueService.NonExistentQueue"
                | "QueueDoesNotExist"
                | "AccessDenied"
                | "AccessDeniedException"
                | "InvalidMessageContents"
                | "InvalidParameterValue"
                | "KmsAccessDenied"
                | "KmsDisabled"
                | "KmsNotFound"
        )
    )
}

#[cfg(feature = "sqs")]
impl Destination for SqsDestination {
    fn name(&self) -> &str {
        &self.name
    }

    fn send<'a>(
        &'a self,
        delivery: &'a Delivery,
        headers: &'a Headers,
    ) -> BoxFuture<'a, Result<(), Error>> {
        use aws_sdk_sqs::error::ProvideErrorMetadata;
        Box::pin(async move {
            let body = document(delivery, headers).to_string();
            too_large(
                &self.name,
                "SendMessage",
                "SQS",
                &body,
                SQS_MAX_MESSAGE_BYTES,
            )?;
            match self
                .client
                .send_message()
                .queue_url(&self.queue_url)
                .message_body(body)
                .send()
                .await
            {
                Ok(_) => Ok(()),
                Err(e) => {
                    let permanent = sqs_permanent(e.code());
                    Err(failure(&self.name, "SendMessage", permanent, e))
                }
            }
        })
    }

    fn check(&self) -> BoxFuture<'_, Result<(), Error>> {
        use aws_sdk_sqs::error::ProvideErrorMetadata;
        Box::pin(async move {
            self.client
                .get_queue_attributes()
                .queue_url(&self.queue_url)
                .attribute_names(aws_sdk_sqs::types::QueueAttributeName::QueueArn)
                .send()
                .await
                .map(|_| ())
                .map_err(|e| {
                    let permanent = sqs_permanent(e.code());
                    failure(&self.name, "GetQueueAttributes", permanent, e)
                })
        })
    }
}

/// An S3 bucket as the on-failure destination (feature `s3`): one object a record, the
/// [`document`] as its body, at `PREFIX` `STREAM/SHARD/SEQUENCE-SUBSEQUENCE.json`.
#[cfg(feature = "s3")]
#[derive(Debug, Clone)]
pub struct S3Destination {
    client: aws_sdk_s3::Client,
    bucket: String,
    prefix: String,
    name: String,
}

#[cfg(feature = "s3")]
impl S3Destination {
    /// The bucket `bucket`, objects under `prefix` (e.g. `failed/`; may be empty), written with
    /// `client`.
    pub fn new(
        client: aws_sdk_s3::Client,
        bucket: impl Into<String>,
        prefix: impl Into<String>,
    ) -> Self {
        let (bucket, prefix) = (bucket.into(), prefix.into());
        Self {
            client,
            name: format!("s3://{bucket}/{prefix}"),
            bucket,
            prefix,
        }
    }

    /// The object key of `delivery`'s document.
    pub fn key(&self, delivery: &Delivery) -> String {
        let last = match delivery.page_position() {
            Some(_) => delivery.locator().to_string(),
            None => format!("{}-{}", delivery.sequence_number(), delivery.sub_sequence()),
        };
        format!(
            "{}{}/{}/{last}.json",
            self.prefix,
            delivery.stream(),
            delivery.shard()
        )
    }
}

#[cfg(feature = "s3")]
fn s3_permanent(code: Option<&str>) -> bool {
    matches!(
        code,
        Some(
            "NoSuchBucket"
                | "AccessDenied"
                | "AllAccessDisabled"
                | "InvalidBucketName"
                | "InvalidAccessKeyId"
                | "KMS.DisabledException"
                | "NotFound"
                | "Forbidden"
        )
    )
}

#[cfg(feature = "s3")]
impl Destination for S3Destination {
    fn name(&self) -> &str {
        &self.name
    }

    fn send<'a>(
        &'a self,
        delivery: &'a Delivery,
        headers: &'a Headers,
    ) -> BoxFuture<'a, Result<(), Error>> {
        use aws_sdk_s3::error::ProvideErrorMetadata;
        Box::pin(async move {
            let body = document(delivery, headers).to_string();
            match self
                .client
                .put_object()
                .bucket(&self.bucket)
                .key(self.key(delivery))
                .content_type("application/json")
                .body(body.into_bytes().into())
                .send()
                .await
            {
                Ok(_) => Ok(()),
                Err(e) => {
                    let permanent = s3_permanent(e.code());
                    Err(failure(&self.name, "PutObject", permanent, e))
                }
            }
        })
    }

    fn check(&self) -> BoxFuture<'_, Result<(), Error>> {
        use aws_sdk_s3::error::ProvideErrorMetadata;
        Box::pin(async move {
            self.client
                .head_bucket()
                .bucket(&self.bucket)
                .send()
                .await
                .map(|_| ())
                .map_err(|e| {
                    // HeadBucket answers without a body: a missing bucket is a 404, a refused one
                    // a 403.
                    let status = e.raw_response().map(|r| r.status().as_u16());
                    let permanent = s3_permanent(e.code()) || matches!(status, Some(403 | 404));
                    failure(&self.name, "HeadBucket", permanent, e)
                })
        })
    }
}

/// An SNS topic as the on-failure destination (feature `sns`): one message a record, its body
/// [`lambda_failure_record`].
#[cfg(feature = "sns")]
#[derive(Debug, Clone)]
pub struct SnsDestination {
    client: aws_sdk_sns::Client,
    topic_arn: String,
    stream_arn: Option<String>,
    name: String,
}

/// The largest message SNS takes (256 KiB).
#[cfg(feature = "sns")]
pub const SNS_MAX_MESSAGE_BYTES: usize = 256 * 1024;

#[cfg(feature = "sns")]
impl SnsDestination {
    /// The topic `topic_arn`, published to with `client`.
    pub fn new(client: aws_sdk_sns::Client, topic_arn: impl Into<String>) -> Self {
        let topic_arn = topic_arn.into();
        Self {
            client,
            name: format!("sns:{topic_arn}"),
            topic_arn,
            stream_arn: None,
        }
    }

    /// The consumed stream's ARN, for `KinesisBatchInfo.streamArn` (null otherwise).
    pub fn stream_arn(mut self, arn: impl Into<String>) -> Self {
        self.stream_arn = Some(arn.into());
        self
    }
}

#[cfg(feature = "sns")]
fn sns_permanent(code: Option<&str>) -> bool {
    matches!(
        code,
        Some(
            "NotFound"
                | "NotFoundException"
                | "AuthorizationError"
                | "AccessDenied"
                | "AccessDeniedException"
                | "InvalidParameter"
                | "InvalidParameterValue"
                | "KMSAccessDenied"
                | "KMSDisabled"
                | "KMSNotFound"
                | "KMSInvalidState"
        )
    )
}

#[cfg(feature = "sns")]
impl Destination for SnsDestination {
    fn name(&self) -> &str {
        &self.name
    }

    fn send<'a>(
        &'a self,
        delivery: &'a Delivery,
        headers: &'a Headers,
    ) -> BoxFuture<'a, Result<(), Error>> {
        use aws_sdk_sns::error::ProvideErrorMetadata;
        Box::pin(async move {
            let body =
                lambda_failure_record(delivery, headers, self.stream_arn.as_deref()).to_string();
            too_large(&self.name, "Publish", "SNS", &body, SNS_MAX_MESSAGE_BYTES)?;
            let mut publish = self
                .client
                .publish()
                .topic_arn(&self.topic_arn)
                .message(body);
            if self.topic_arn.ends_with(".fifo") {
                use md5::Digest;
                let id = md5::Md5::digest(delivery.event_id().as_str().as_bytes());
                let dedup: String = id.iter().map(|b| format!("{b:02x}")).collect();
                publish = publish
                    .message_group_id(delivery.shard())
                    .message_deduplication_id(dedup);
            }
            match publish.send().await {
                Ok(_) => Ok(()),
                Err(e) => {
                    let permanent = sns_permanent(e.code());
                    Err(failure(&self.name, "Publish", permanent, e))
                }
            }
        })
    }

    fn check(&self) -> BoxFuture<'_, Result<(), Error>> {
        use aws_sdk_sns::error::ProvideErrorMetadata;
        Box::pin(async move {
            self.client
                .get_topic_attributes()
                .topic_arn(&self.topic_arn)
                .send()
                .await
                .map(|_| ())
                .map_err(|e| {
                    let permanent = sns_permanent(e.code());
                    failure(&self.name, "GetTopicAttributes", permanent, e)
                })
        })
    }
}

#[cfg(all(test, feature = "sqs", feature = "s3"))]
mod tests {
    use super::*;
    use crate::{Position, SequenceNumber};

    #[test]
    fn the_document_carries_the_record_and_where_it_came_from() {
        let mut headers = Headers::new();
        headers.insert("tenant", "acme");
        headers.insert(crate::retry::ATTEMPTS_HEADER, "3");
        headers.insert(
            crate::retry::DEAD_LETTER_REASON_HEADER,
            "attempts spent: 3 of 3",
        );
        headers.insert(crate::envelope::RETRY_COUNT_HEADER, "3");
        let d = Delivery::builder(
            "orders",
            "shardId-000000000001",
            Position::new(SequenceNumber::parse("4965").unwrap(), 2),
        )
        .partition_key("customer-7")
        .payload(&b"\x00hello\xff"[..])
        .arrived_at(std::time::UNIX_EPOCH + std::time::Duration::from_millis(1_764_547_200_123))
        .build();
        let doc = document(&d, &headers);
        assert_eq!(doc["stream"], "orders");
        assert_eq!(doc["shard"], "shardId-000000000001");
        assert_eq!(doc["sequenceNumber"], "4965");
        assert_eq!(doc["subSequenceNumber"], 2);
        assert_eq!(doc["partitionKey"], "customer-7");
        assert_eq!(doc["approximateArrivalTimestamp"], 1_764_547_200_123u64);
        assert_eq!(doc["attempts"], 3);
        assert_eq!(doc["reason"], "attempts spent: 3 of 3");
        assert_eq!(doc["headers"], serde_json::json!({"tenant": "acme"}));
        assert_eq!(doc["data"], "AGhlbGxv/w==");
    }
}

#[cfg(all(test, feature = "sns"))]
mod sns_tests {
    use super::*;
    use crate::{Position, SequenceNumber};

    /// Lambda's failure record (the fields an SNS destination's subscriber written for Lambda
    /// reads), with the record beside it.
    #[test]
    fn the_sns_message_is_lambdas_failure_record_with_the_record_beside_it() {
        let mut headers = Headers::new();
        headers.insert(crate::retry::ATTEMPTS_HEADER, "3");
        headers.insert(
            crate::retry::DEAD_LETTER_REASON_HEADER,
            "attempts spent: 3 of 3",
        );
        let d = Delivery::builder(
            "orders",
            "shardId-000000000001",
            Position::new(SequenceNumber::parse("4965").unwrap(), 0),
        )
        .partition_key("customer-7")
        .payload(&b"hello"[..])
        .arrived_at(std::time::UNIX_EPOCH + std::time::Duration::from_millis(1_764_547_200_123))
        .build();
        let arn = "arn:aws:kinesis:eu-west-1:123456789012:stream/orders";
        let record = lambda_failure_record(&d, &headers, Some(arn));
        assert_eq!(record["version"], "1.0");
        assert_eq!(
            record["requestContext"]["condition"],
            "RetryAttemptsExhausted"
        );
        assert_eq!(record["requestContext"]["approximateInvokeCount"], 3);
        assert_eq!(record["responseContext"]["functionError"], "Unhandled");
        assert!(record["timestamp"].as_str().unwrap().ends_with('Z'));
        let batch = &record["KinesisBatchInfo"];
        assert_eq!(batch["shardId"], "shardId-000000000001");
        assert_eq!(batch["startSequenceNumber"], "4965");
        assert_eq!(batch["endSequenceNumber"], "4965");
        assert_eq!(batch["batchSize"], 1);
        assert_eq!(batch["streamArn"], arn);
        assert_eq!(
            batch["approximateArrivalOfFirstRecord"],
            "2025-12-01T00:00:00.123Z"
        );
        // The record itself, as the SQS and S3 destinations carry it.
        assert_eq!(record["data"], "aGVsbG8=");
        assert_eq!(record["partitionKey"], "customer-7");

        headers.insert(
            crate::retry::DEAD_LETTER_REASON_HEADER,
            "record too old: arrived 90.000 s ago, max_record_age 60.000 s",
        );
        let old = lambda_failure_record(&d, &headers, None);
        assert_eq!(old["requestContext"]["condition"], "RecordAgeExceeded");
        assert_eq!(
            old["KinesisBatchInfo"]["streamArn"],
            serde_json::Value::Null
        );
    }
}
