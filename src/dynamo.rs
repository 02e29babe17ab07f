//! What shardwise's DynamoDB tables share: making sure a table exists with the right key (creating
//! it with the options given), and the small helpers every request uses.

use std::time::{Duration, Instant};

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
    PointInTimeRecoverySpecification, PointInTimeRecoveryStatus, ProvisionedThroughput,
    ScalarAttributeType, TableDescription, TableStatus, Tag,
};

use crate::backoff::Backoff;
use crate::error::Error;

/// How long a table may take to become `ACTIVE`.
const ACTIVE_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest wait between two DescribeTable calls while the table becomes ACTIVE.
const POLL_MAX: Duration = Duration::from_millis(200);

/// How long one attempt of a call to a shardwise table may take before the SDK gives it up
/// (and retries it, as its retry config says): 10 s. Filled into the client's timeout config
/// when the client sets none; a value the caller set is kept. Longer than the lease manager's
/// own limit on a renewal at the default lease duration (8.3 s), so a renewal answered late but
/// in time to prove the lease held is not cut by the SDK first; with a lease duration above
/// 11 s, renewals answered more than 10 s late are cut here (set the client's timeout to keep
/// them).
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a call to a shardwise table may take with its retries: 30 s (see
/// [`ATTEMPT_TIMEOUT`]).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How long opening a connection may take: the SDK's own default since behavior version 2024-03-28.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(3_100);

/// `client` with every call bounded: the SDK sets no read or operation timeout by default, so a
/// half-open connection would wedge a call (the take loop, the shard sync, a lease handing off)
/// for as long as the socket lives. Timeouts the client's config sets, or disables, are kept;
/// only those left unset are filled in ([`ATTEMPT_TIMEOUT`], [`CALL_TIMEOUT`], a 3.1 s connect).
pub(crate) fn bounded(client: Client) -> Client {
    use aws_sdk_dynamodb::config::timeout::TimeoutConfig;
    let config = client.config();
    let mut timeouts = config
        .timeout_config()
        .cloned()
        .unwrap_or_else(|| TimeoutConfig::builder().build());
    timeouts.take_defaults_from(
        &TimeoutConfig::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .operation_attempt_timeout(ATTEMPT_TIMEOUT)
            .operation_timeout(CALL_TIMEOUT)
            .build(),
    );
    Client::from_conf(config.to_builder().timeout_config(timeouts).build())
}

/// How a missing table (a lease table, a receipt ledger) is created: billing mode, tags,
/// point-in-time recovery. An existing table is used as it is (only its key schema is checked),
/// except that point-in-time recovery is turned on when asked for and off.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TableOptions {
    /// On-demand (the default) or provisioned capacity.
    pub billing: Billing,
    /// Tags set on the table when it is created.
    pub tags: Vec<(String, String)>,
    /// Continuous backups with point-in-time recovery.
    pub point_in_time_recovery: bool,
}

impl TableOptions {
    /// Sets the billing mode.
    pub fn billing(mut self, billing: Billing) -> Self {
        self.billing = billing;
        self
    }

    /// Adds a tag.
    pub fn tag(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.tags.push((key.into(), value.into()));
        self
    }

    /// Turns point-in-time recovery on or off.
    pub fn point_in_time_recovery(mut self, on: bool) -> Self {
        self.point_in_time_recovery = on;
        self
    }

    /// Checks the options, naming the first bad one (DynamoDB's limits on tags and capacity).
    pub fn validate(&self) -> Result<(), crate::ConfigError> {
        use crate::ConfigError;
        if let Billing::Provisioned { read, write } = self.billing
            && (read == 0 || write == 0)
        {
            return Err(ConfigError::new(
                "billing",
                self.billing,
                "provisioned read and write capacity must each be at least 1",
            ));
        }
        if self.tags.len() > 50 {
            return Err(ConfigError::new(
                "tags",
                self.tags.len(),
                "a table takes at most 50 tags",
            ));
        }
        for (key, value) in &self.tags {
            if key.is_empty() || key.chars().count() > 128 || key.starts_with("aws:") {
                return Err(ConfigError::new(
                    "tags",
                    key,
                    "a tag key is 1 to 128 characters and does not start with `aws:`",
                ));
            }
            if value.chars().count() > 256 {
                return Err(ConfigError::new(
                    "tags",
                    value,
                    "a tag value is at most 256 characters",
                ));
            }
        }
        Ok(())
    }
}

/// The capacity mode of a lease table.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Billing {
    /// Pay per request (no capacity planning).
    #[default]
    OnDemand,
    /// Provisioned read and write capacity units.
    Provisioned {
        /// Read capacity units.
        read: u64,
        /// Write capacity units.
        write: u64,
    },
}

/// One table, and how to say what is wrong with it.
pub(crate) struct Table<'a> {
    client: &'a Client,
    name: &'a str,
    schema_error: fn(String, String) -> Error,
}

impl<'a> Table<'a> {
    /// `schema_error(table, reason)` is the error for a table that cannot be used.
    pub(crate) fn new(
        client: &'a Client,
        name: &'a str,
        schema_error: fn(String, String) -> Error,
    ) -> Self {
        Self {
            client,
            name,
            schema_error,
        }
    }

    fn schema(&self, reason: impl Into<String>) -> Error {
        (self.schema_error)(self.name.to_string(), reason.into())
    }

    fn failed<E: std::error::Error + Send + Sync + 'static>(
        &self,
        operation: &'static str,
        err: E,
    ) -> Error {
        failed(self.name, operation, err)
    }

    /// Makes sure the table exists (creating it when allowed), is ACTIVE, and has exactly the hash
    /// key `key` of type S; turns point-in-time recovery on when asked for.
    pub(crate) async fn prepare(
        &self,
        key: &str,
        create_if_missing: bool,
        options: &TableOptions,
    ) -> Result<TableDescription, Error> {
        if self.describe().await?.is_none() {
            if !create_if_missing {
                return Err(self.schema(format!(
                    "the table does not exist (and creating it is turned off); create it with \
                     the hash key `{key}` (S), or allow the store to create it"
                )));
            }
            self.create(key, options).await?;
        }
        let desc = self.wait_active().await?;
        self.check_key(&desc, key)?;
        if options.point_in_time_recovery {
            self.enable_point_in_time_recovery().await?;
        }
        Ok(desc)
    }

    /// DescribeTable; `None` when the table does not exist.
    pub(crate) async fn describe(&self) -> Result<Option<TableDescription>, Error> {
        match self
            .client
            .describe_table()
            .table_name(self.name)
            .send()
            .await
        {
            Ok(out) => Ok(out.table),
            Err(err)
                if err
                    .as_service_error()
                    .is_some_and(|e| e.is_resource_not_found_exception()) =>
            {
                Ok(None)
            }
            Err(err) => Err(self.failed("DescribeTable", err)),
        }
    }

    async fn create(&self, key: &str, options: &TableOptions) -> Result<(), Error> {
        let definition = AttributeDefinition::builder()
            .attribute_name(key)
            .attribute_type(ScalarAttributeType::S)
            .build()
            .map_err(|e| self.failed("CreateTable", e))?;
        let key_schema = KeySchemaElement::builder()
            .attribute_name(key)
            .key_type(KeyType::Hash)
            .build()
            .map_err(|e| self.failed("CreateTable", e))?;
        let mut request = self
            .client
            .create_table()
            .table_name(self.name)
            .attribute_definitions(definition)
            .key_schema(key_schema);
        request = match options.billing {
            Billing::OnDemand => request.billing_mode(BillingMode::PayPerRequest),
            Billing::Provisioned { read, write } => request
                .billing_mode(BillingMode::Provisioned)
                .provisioned_throughput(
                    ProvisionedThroughput::builder()
                        .read_capacity_units(read as i64)
                        .write_capacity_units(write as i64)
                        .build()
                        .map_err(|e| self.failed("CreateTable", e))?,
                ),
        };
        for (key, value) in &options.tags {
            request = request.tags(
                Tag::builder()
                    .key(key)
                    .value(value)
                    .build()
                    .map_err(|e| self.failed("CreateTable", e))?,
            );
        }
        match request.send().await {
            Ok(_) => {
                tracing::info!(table = %self.name, "created the table");
                Ok(())
            }
            // Another worker created it at the same time.
            Err(err)
                if err
                    .as_service_error()
                    .is_some_and(|e| e.is_resource_in_use_exception()) =>
            {
                Ok(())
            }
            Err(err) => Err(self.failed("CreateTable", err)),
        }
    }

    /// Polls DescribeTable until the table can be read and written.
    async fn wait_active(&self) -> Result<TableDescription, Error> {
        let deadline = Instant::now() + ACTIVE_TIMEOUT;
        let mut polls = Backoff::new(POLL_MAX);
        loop {
            let status = match self.describe().await? {
                // Right after CreateTable the table may not be visible yet.
                None => None,
                Some(desc) => match desc.table_status() {
                    None | Some(TableStatus::Active | TableStatus::Updating) => return Ok(desc),
                    Some(TableStatus::Creating) => Some(TableStatus::Creating),
                    Some(other) => {
                        return Err(self.schema(format!(
                            "table status is {}; expected ACTIVE",
                            other.as_str()
                        )));
                    }
                },
            };
            if Instant::now() >= deadline {
                let seen = status.map_or("not visible".to_owned(), |s| s.as_str().to_owned());
                return Err(self.schema(format!(
                    "table did not become ACTIVE within {} s (last seen: {seen})",
                    ACTIVE_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(polls.next()).await;
        }
    }

    /// Checks the key schema: exactly one key, the hash key `key` of type S.
    fn check_key(&self, desc: &TableDescription, key: &str) -> Result<(), Error> {
        let type_of = |name: &str| {
            desc.attribute_definitions()
                .iter()
                .find(|d| d.attribute_name() == name)
                .map_or("type unknown", |d| d.attribute_type().as_str())
        };
        let keys = desc.key_schema();
        let Some(hash) = keys.iter().find(|k| *k.key_type() == KeyType::Hash) else {
            return Err(self.schema(format!("has no hash key; expected `{key}` (S)")));
        };
        let hash_name = hash.attribute_name();
        if hash_name != key {
            return Err(self.schema(format!(
                "hash key is `{hash_name}` ({}); expected `{key}` (S)",
                type_of(hash_name)
            )));
        }
        let hash_type = type_of(key);
        if hash_type != ScalarAttributeType::S.as_str() {
            return Err(self.schema(format!(
                "hash key `{key}` is of type {hash_type}; expected `{key}` (S)"
            )));
        }
        if let Some(range) = keys.iter().find(|k| *k.key_type() != KeyType::Hash) {
            let name = range.attribute_name();
            return Err(self.schema(format!(
                "has a range key `{name}` ({}); expected only the hash key `{key}` (S)",
                type_of(name)
            )));
        }
        Ok(())
    }

    /// Turns on continuous backups with point-in-time recovery (a no-op when they are on).
    async fn enable_point_in_time_recovery(&self) -> Result<(), Error> {
        let enabled = self
            .client
            .describe_continuous_backups()
            .table_name(self.name)
            .send()
            .await
            .map_err(|e| self.failed("DescribeContinuousBackups", e))?
            .continuous_backups_description
            .and_then(|d| d.point_in_time_recovery_description)
            .and_then(|p| p.point_in_time_recovery_status)
            .is_some_and(|status| status == PointInTimeRecoveryStatus::Enabled);
        if enabled {
            return Ok(());
        }
        self.client
            .update_continuous_backups()
            .table_name(self.name)
            .point_in_time_recovery_specification(
                PointInTimeRecoverySpecification::builder()
                    .point_in_time_recovery_enabled(true)
                    .build()
                    .map_err(|e| self.failed("UpdateContinuousBackups", e))?,
            )
            .send()
            .await
            .map_err(|e| self.failed("UpdateContinuousBackups", e))?;
        tracing::info!(table = %self.name, "point-in-time recovery turned on");
        Ok(())
    }
}

/// A failed DynamoDB call on `table`.
pub(crate) fn failed<E>(table: &str, operation: &'static str, err: E) -> Error
where
    E: std::error::Error + Send + Sync + 'static,
{
    Error::DynamoDb {
        operation,
        table: table.to_string(),
        source: Box::new(err),
    }
}

/// Whether a conditional request was refused by its condition.
pub(crate) fn is_condition_failed<E, R>(err: &SdkError<E, R>) -> bool
where
    E: aws_sdk_dynamodb::error::ProvideErrorMetadata,
{
    err.as_service_error()
        .is_some_and(|e| e.code() == Some("ConditionalCheckFailedException"))
}

/// A string value.
pub(crate) fn s(value: impl Into<String>) -> AttributeValue {
    AttributeValue::S(value.into())
}

/// A number value.
pub(crate) fn n(value: impl ToString) -> AttributeValue {
    AttributeValue::N(value.to_string())
}
