//! Writing records: plain payloads, or payloads with headers in the RSK2 envelope. Retry copies and
//! dead letters are written through it, and applications can use it too.

use std::fmt;
use std::sync::Arc;

use aws_sdk_kinesis::primitives::Blob;
use bytes::Bytes;
use futures::future::BoxFuture;

use crate::envelope::{self, Headers};
use crate::error::Error;
use crate::position::SequenceNumber;

/// The most a Kinesis record may hold: its data blob (with the header envelope) and its partition
/// key together, in bytes (1 MiB).
pub const MAX_RECORD_BYTES: usize = 1024 * 1024;

/// Where a record landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The shard its partition key picked.
    pub shard_id: String,
    /// Its sequence number.
    pub sequence: SequenceNumber,
}

/// Puts one record. Kinesis in production; in-memory streams in tests.
pub trait RecordSink: Send + Sync + fmt::Debug + 'static {
    /// Writes `data` to `stream` under `partition_key`. Not cancellation safe in the sense that a
    /// dropped call may still have written the record (a duplicate, never a loss).
    fn put<'a>(
        &'a self,
        stream: &'a str,
        partition_key: &'a str,
        data: Bytes,
    ) -> BoxFuture<'a, Result<Written, Error>>;

    /// Checks that `stream` exists and can be written: [`Error::StreamNotFound`] or
    /// [`Error::AccessDenied`] otherwise. Called once at start for the dead-letter stream, so a
    /// misspelled name fails at once instead of holding checkpoints later.
    fn check<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<(), Error>>;
}

/// A sink for a consumer that never writes to a stream (a paged source without a dead-letter
/// stream): every write fails, naming why.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unavailable;

impl RecordSink for Unavailable {
    fn put<'a>(
        &'a self,
        stream: &'a str,
        _partition_key: &'a str,
        _data: Bytes,
    ) -> BoxFuture<'a, Result<Written, Error>> {
        Box::pin(async move { Err(no_sink(stream)) })
    }

    fn check<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move { Err(no_sink(stream)) })
    }
}

fn no_sink(stream: &str) -> Error {
    Error::Config(crate::error::ConfigError::new(
        "record_sink",
        stream,
        "this consumer has no stream to write to (no AWS configuration and no record_sink)",
    ))
}

/// [`RecordSink`] on the Kinesis PutRecord API.
#[derive(Debug, Clone)]
pub struct KinesisSink {
    client: aws_sdk_kinesis::Client,
}

impl KinesisSink {
    /// Writes with this client.
    pub fn new(client: aws_sdk_kinesis::Client) -> Self {
        Self { client }
    }
}

impl RecordSink for KinesisSink {
    fn put<'a>(
        &'a self,
        stream: &'a str,
        partition_key: &'a str,
        data: Bytes,
    ) -> BoxFuture<'a, Result<Written, Error>> {
        Box::pin(async move {
            let out = self
                .client
                .put_record()
                .stream_name(stream)
                .partition_key(partition_key)
                .data(Blob::new(data))
                .send()
                .await
                .map_err(|e| Error::kinesis("PutRecord", stream, e))?;
            let sequence =
                SequenceNumber::parse(out.sequence_number()).map_err(|e| Error::Corrupt {
                    what: "PutRecord sequence number",
                    detail: e.to_string(),
                })?;
            Ok(Written {
                shard_id: out.shard_id().to_string(),
                sequence,
            })
        })
    }

    fn check<'a>(&'a self, stream: &'a str) -> BoxFuture<'a, Result<(), Error>> {
        Box::pin(async move {
            self.client
                .describe_stream_summary()
                .stream_name(stream)
                .send()
                .await
                .map_err(|e| Error::kinesis("DescribeStreamSummary", stream, e))?;
            Ok(())
        })
    }
}

/// Writes records with headers.
///
/// ```no_run
/// use shardwise::envelope::Headers;
/// use shardwise::producer::Producer;
/// # async fn run(client: aws_sdk_kinesis::Client) -> Result<(), shardwise::Error> {
/// let producer = Producer::kinesis(client);
/// let mut headers = Headers::new();
/// headers.insert("tenant", "acme");
/// producer.put("orders", "customer-7", &headers, b"{\"id\":1}").await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Producer {
    sink: Arc<dyn RecordSink>,
}

impl Producer {
    /// A producer writing through `sink`.
    pub fn new(sink: Arc<dyn RecordSink>) -> Self {
        Self { sink }
    }

    /// A producer writing to Kinesis.
    pub fn kinesis(client: aws_sdk_kinesis::Client) -> Self {
        Self::new(Arc::new(KinesisSink::new(client)))
    }

    /// Writes `payload` with `headers` (in the RSK2 envelope; a plain payload when there are none).
    /// A record over [`MAX_RECORD_BYTES`] fails with [`Error::RecordTooLarge`] without a call.
    pub async fn put(
        &self,
        stream: &str,
        partition_key: &str,
        headers: &Headers,
        payload: &[u8],
    ) -> Result<Written, Error> {
        let data = envelope::encode(headers, payload);
        let size = data.len() + partition_key.len();
        if size > MAX_RECORD_BYTES {
            return Err(Error::RecordTooLarge {
                stream: stream.to_string(),
                size,
                limit: MAX_RECORD_BYTES,
            });
        }
        self.sink.put(stream, partition_key, data).await
    }

    /// Checks that `stream` exists and can be written (see [`RecordSink::check`]).
    pub async fn check(&self, stream: &str) -> Result<(), Error> {
        self.sink.check(stream).await
    }
}
