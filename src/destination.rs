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
#[cfg(any(feature = "sqs", feature = "s3"))]
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

/// Headers that are shardwise's or ruststream's retry bookkeeping, told by the document's own
/// fields instead.
#[cfg(any(feature = "sqs", feature = "s3"))]
fn bookkeeping(name: &str) -> bool {
    name.starts_with("x-shardwise-") || name.starts_with("x-ruststream-")
}

/// A destination's error: permanent ones (a missing queue or bucket, a refused permission, a
/// message too large) hold the record loudly until fixed; the rest are tried again.
#[cfg(any(feature = "sqs", feature = "s3"))]
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
            if body.len() > SQS_MAX_MESSAGE_BYTES {
                return Err(failure(
                    &self.name,
                    "SendMessage",
                    true,
                    format!(
                        "the record's message is {} bytes, over SQS's {SQS_MAX_MESSAGE_BYTES}: use an S3 bucket for records this large",
                        body.len()
                    ),
                ));
            }
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
