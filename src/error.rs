//! Errors: one crate [`Error`] for the runtime, [`ConfigError`] for invalid settings, and [`AckError`]
//! for an outcome the runtime refused.

use std::fmt;

/// A boxed error from a lower layer (the AWS SDK, I/O). Kept behind [`Error`] so no SDK type appears in
/// shardwise's public signatures.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can stop shardwise from doing what was asked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A setting failed validation; nothing was started.
    #[error(transparent)]
    Config(#[from] ConfigError),

    /// The stream does not exist (or is not visible with these credentials).
    #[error("stream `{stream}` does not exist")]
    StreamNotFound {
        /// The stream that was asked for.
        stream: String,
    },

    /// The credentials are not allowed to make this call (an IAM policy is missing an action).
    #[error("access denied: {operation} on `{resource}`")]
    AccessDenied {
        /// The API operation, e.g. `PutRecord`.
        operation: &'static str,
        /// The stream or table it addressed.
        resource: String,
        /// What the SDK reported.
        #[source]
        source: BoxError,
    },

    /// A record is over the Kinesis limit: its data and partition key together may hold at most
    /// [`MAX_RECORD_BYTES`](crate::producer::MAX_RECORD_BYTES).
    #[error(
        "a record of {size} bytes (data and partition key) for stream `{stream}` is over the limit of {limit} bytes"
    )]
    RecordTooLarge {
        /// The stream it was for.
        stream: String,
        /// Its size: data blob (with the header envelope) plus partition key.
        size: usize,
        /// The limit.
        limit: usize,
    },

    /// Another process runs under this worker id on the stream: its beats replace this
    /// process's nonce in the lease table's roster. Two processes with one id would each take the
    /// other's leases as their own; the one started later refuses to run.
    #[error(
        "worker id `{worker}` is in use by another running process on stream `{stream}` (its beats keep replacing this process's in the lease table's roster): give each process its own worker id, or leave the default (host name, process id and a random part)"
    )]
    WorkerIdInUse {
        /// The stream.
        stream: String,
        /// The worker id both use.
        worker: String,
    },

    /// The lease table exists but cannot be used as one.
    #[error("lease table `{table}` cannot be used: {reason}")]
    LeaseTableSchema {
        /// The DynamoDB table.
        table: String,
        /// What is wrong with it (names the attribute).
        reason: String,
    },

    /// A DynamoDB table other than the lease table (a receipt ledger, a table effects write)
    /// cannot be used.
    #[error("table `{table}` {reason}")]
    Table {
        /// The DynamoDB table.
        table: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A Kinesis call failed after the SDK's own retries.
    #[error("kinesis {operation} on stream `{stream}`{} failed", shard_suffix(.shard))]
    Kinesis {
        /// The API operation, e.g. `GetRecords`.
        operation: &'static str,
        /// The stream it addressed.
        stream: String,
        /// The shard, where the call named one.
        shard: Option<String>,
        /// What the SDK reported.
        #[source]
        source: BoxError,
    },

    /// A DynamoDB call on the lease table failed after the SDK's own retries.
    #[error("dynamodb {operation} on table `{table}` failed")]
    DynamoDb {
        /// The API operation, e.g. `UpdateItem`.
        operation: &'static str,
        /// The lease table.
        table: String,
        /// What the SDK reported.
        #[source]
        source: BoxError,
    },

    /// A paged source's partition cannot go on: its pages break the source's order (a
    /// regression, two identities at one position, a gap the contract forbids), or it cannot be
    /// fetched (gone, a refused cursor). Its attempt stops; the lease is released and the
    /// partition is read again from its durable cursor by the next owner.
    #[error("paged source `{source_name}`, partition `{partition}`: {what}")]
    Paged {
        /// The source's name.
        source_name: String,
        /// The partition.
        partition: String,
        /// What went wrong, e.g. `order violation`.
        what: &'static str,
        /// The violation or the fetch error.
        #[source]
        source: BoxError,
    },

    /// A task of shardwise's stopped before it answered: it panicked (a bug in shardwise, or in a
    /// store or source it called), or the runtime is shutting down. What it was doing may or may
    /// not have happened; the caller treats it as a failure and tries again.
    #[error("{what} did not finish: {detail}")]
    Interrupted {
        /// What the task was doing, e.g. `checkpoint write`.
        what: &'static str,
        /// How it stopped (a panic's message).
        detail: String,
    },

    /// An on-failure destination (an SQS queue, an S3 bucket) could not be written or checked.
    #[error("on-failure destination `{destination}`: {operation} failed")]
    Destination {
        /// The destination's name (`sqs:URL`, `s3://BUCKET/PREFIX`).
        destination: String,
        /// The API operation, e.g. `SendMessage`.
        operation: &'static str,
        /// Whether repeating it cannot help until someone changes something (a missing queue or
        /// bucket, a refused permission, a message too large).
        permanent: bool,
        /// What the SDK (or the size check) reported.
        #[source]
        source: BoxError,
    },

    /// The enhanced fan-out consumer name is taken on the stream by another application (its
    /// `shardwise:application` tag names it), or by a consumer shardwise did not register (no
    /// tag). It is not used: two applications on one consumer take each other's subscriptions.
    #[error(
        "enhanced fan-out consumer `{consumer}` of stream `{stream}` is {}: choose another consumer name (--consumer-name), or, if it is this application's, tag it {}={application}",
        match .holder { Some(h) => format!("registered for application `{h}`"), None => "not registered by shardwise (it has no shardwise:application tag)".to_string() },
        crate::shard::fanout::APPLICATION_TAG
    )]
    ConsumerInUse {
        /// The stream.
        stream: String,
        /// The consumer name.
        consumer: String,
        /// This application.
        application: String,
        /// The application its tag names, if any.
        holder: Option<String>,
    },

    /// The enhanced fan-out consumer this application reads with was deregistered while it ran
    /// (`shardwise stream deregister-consumer`, or another tool): every shard would fail the same
    /// way, so the consumer stops. Starting it again registers the consumer anew, from the
    /// checkpoints (nothing is skipped).
    #[error(
        "enhanced fan-out consumer `{consumer}` of stream `{stream}` is gone (deregistered while this application ran): start the application again to register it, or run without enhanced fan-out"
    )]
    ConsumerGone {
        /// The stream.
        stream: String,
        /// The consumer name.
        consumer: String,
    },

    /// A value read from the store or the stream breaks shardwise's expectations.
    #[error("corrupt {what}: {detail}")]
    Corrupt {
        /// The kind of value, e.g. `lease row`.
        what: &'static str,
        /// What was wrong with it.
        detail: String,
    },
}

impl Error {
    /// Whether repeating the call cannot help until someone changes something: a missing stream,
    /// missing permissions, a record over the size limit, an unusable table or setting.
    pub fn is_permanent(&self) -> bool {
        matches!(
            self,
            Error::Config(_)
                | Error::StreamNotFound { .. }
                | Error::AccessDenied { .. }
                | Error::RecordTooLarge { .. }
                | Error::LeaseTableSchema { .. }
                | Error::Table { .. }
                | Error::ConsumerInUse { .. }
                | Error::ConsumerGone { .. }
                | Error::Destination {
                    permanent: true,
                    ..
                }
        )
    }

    /// A paged source's partition, owned as `ownership`, cannot go on: `what` happened.
    pub(crate) fn paged(
        ownership: &crate::lease::Ownership,
        what: &'static str,
        source: impl Into<BoxError>,
    ) -> Self {
        Error::Paged {
            source_name: ownership.stream.clone(),
            partition: ownership.shard_id.clone(),
            what,
            source: source.into(),
        }
    }

    /// A failed Kinesis call on `stream`: a missing stream reads as [`Error::StreamNotFound`].
    pub(crate) fn kinesis<E, R>(
        operation: &'static str,
        stream: &str,
        err: aws_sdk_kinesis::error::SdkError<E, R>,
    ) -> Self
    where
        E: aws_sdk_kinesis::error::ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
        R: fmt::Debug + Send + Sync + 'static,
    {
        match err.as_service_error().and_then(|e| e.code()) {
            Some("ResourceNotFoundException") => Error::StreamNotFound {
                stream: stream.to_string(),
            },
            Some(
                "AccessDeniedException"
                | "KMSAccessDeniedException"
                | "KMSDisabledException"
                | "KMSNotFoundException",
            ) => Error::AccessDenied {
                operation,
                resource: stream.to_string(),
                source: Box::new(err),
            },
            _ => Error::Kinesis {
                operation,
                stream: stream.to_string(),
                shard: None,
                source: Box::new(err),
            },
        }
    }
}

fn shard_suffix(shard: &Option<String>) -> String {
    shard
        .as_deref()
        .map(|s| format!(" shard `{s}`"))
        .unwrap_or_default()
}

/// A setting that failed validation, naming the field and the value that was given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid `{field}` = {value}: {reason}")]
pub struct ConfigError {
    field: &'static str,
    value: String,
    reason: String,
}

impl ConfigError {
    /// Creates an error for `field`, holding the rejected `value` rendered with `Debug`.
    pub fn new(field: &'static str, value: impl fmt::Debug, reason: impl Into<String>) -> Self {
        Self {
            field,
            value: format!("{value:?}"),
            reason: reason.into(),
        }
    }

    /// The name of the setting that was rejected.
    pub fn field(&self) -> &'static str {
        self.field
    }

    /// The rejected value, as given.
    pub fn value(&self) -> &str {
        &self.value
    }

    /// Why the value was rejected (what the setting accepts).
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

/// Why the runtime would not carry out an outcome the handler returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AckError {
    /// Kinesis cannot hand a single record back: a plain `retry()` needs `max_attempts` or a
    /// dead-letter stream. The record stays unsettled and holds the checkpoint.
    #[error("retry is unsupported here: {reason}")]
    Unsupported {
        /// What would make it supported.
        reason: &'static str,
    },
}
