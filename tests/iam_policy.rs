//! The least-privilege IAM policies in the README name exactly the Kinesis, DynamoDB, CloudWatch
//! Logs, SQS, SNS and S3 actions the code calls: every SDK operation called in `src/` is in the library's policy,
//! every one called in `cli/src/` is in the library's or the command's, and neither policy names
//! one nobody calls. A transaction counts as the item actions its parts are authorized as; an
//! operation two SDKs share (`tag_resource`) counts for the SDK whose crate the file uses.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Every operation of aws-sdk-kinesis, as its fluent client method is called.
const KINESIS: &[&str] = &[
    "add_tags_to_stream",
    "create_stream",
    "decrease_stream_retention_period",
    "delete_stream",
    "deregister_stream_consumer",
    "describe_limits",
    "describe_stream",
    "describe_stream_consumer",
    "describe_stream_summary",
    "disable_enhanced_monitoring",
    "enable_enhanced_monitoring",
    "get_records",
    "get_resource_policy",
    "get_shard_iterator",
    "increase_stream_retention_period",
    "list_shards",
    "list_stream_consumers",
    "list_streams",
    "list_tags_for_resource",
    "list_tags_for_stream",
    "merge_shards",
    "put_record",
    "put_records",
    "put_resource_policy",
    "register_stream_consumer",
    "remove_tags_from_stream",
    "split_shard",
    "start_stream_encryption",
    "stop_stream_encryption",
    "subscribe_to_shard",
    "tag_resource",
    "untag_resource",
    "update_shard_count",
    "update_stream_mode",
    "delete_resource_policy",
];

/// Every operation of aws-sdk-dynamodb, as its fluent client method is called.
const DYNAMODB: &[&str] = &[
    "batch_execute_statement",
    "batch_get_item",
    "batch_write_item",
    "create_backup",
    "create_global_table",
    "create_table",
    "delete_backup",
    "delete_item",
    "delete_resource_policy",
    "delete_table",
    "describe_backup",
    "describe_continuous_backups",
    "describe_contributor_insights",
    "describe_endpoints",
    "describe_export",
    "describe_global_table",
    "describe_global_table_settings",
    "describe_import",
    "describe_kinesis_streaming_destination",
    "describe_limits",
    "describe_table",
    "describe_table_replica_auto_scaling",
    "describe_time_to_live",
    "disable_kinesis_streaming_destination",
    "enable_kinesis_streaming_destination",
    "execute_statement",
    "execute_transaction",
    "export_table_to_point_in_time",
    "get_item",
    "get_resource_policy",
    "import_table",
    "list_backups",
    "list_contributor_insights",
    "list_exports",
    "list_global_tables",
    "list_imports",
    "list_tables",
    "list_tags_of_resource",
    "put_item",
    "put_resource_policy",
    "query",
    "restore_table_from_backup",
    "restore_table_to_point_in_time",
    "scan",
    "tag_resource",
    "transact_get_items",
    "transact_write_items",
    "untag_resource",
    "update_continuous_backups",
    "update_contributor_insights",
    "update_global_table",
    "update_global_table_settings",
    "update_item",
    "update_kinesis_streaming_destination",
    "update_table",
    "update_table_replica_auto_scaling",
    "update_time_to_live",
];

/// Operations of aws-sdk-cloudwatchlogs a paged source or a tool might call, as fluent methods.
const LOGS: &[&str] = &[
    "create_log_group",
    "create_log_stream",
    "delete_log_group",
    "delete_log_stream",
    "describe_log_groups",
    "describe_log_streams",
    "filter_log_events",
    "get_log_events",
    "put_log_events",
    "start_live_tail",
    "start_query",
    "get_query_results",
];

/// Operations of aws-sdk-sqs an on-failure destination or a tool might call, as fluent methods.
const SQS: &[&str] = &[
    "create_queue",
    "delete_message",
    "delete_queue",
    "get_queue_attributes",
    "get_queue_url",
    "list_queues",
    "purge_queue",
    "receive_message",
    "send_message",
    "send_message_batch",
    "set_queue_attributes",
];

/// Operations of aws-sdk-sns an on-failure destination or a tool might call, as fluent methods
/// (`subscribe` left out: tokio's channels have a `.subscribe()` too).
const SNS: &[&str] = &[
    "create_topic",
    "delete_topic",
    "get_topic_attributes",
    "list_subscriptions_by_topic",
    "list_topics",
    "publish",
    "publish_batch",
    "unsubscribe",
];

/// Operations of aws-sdk-s3 an on-failure destination or a tool might call, as fluent methods.
const S3: &[&str] = &[
    "create_bucket",
    "delete_bucket",
    "delete_object",
    "get_bucket_location",
    "get_object",
    "head_bucket",
    "head_object",
    "list_buckets",
    "list_objects_v2",
    "put_object",
];

/// Actions IAM requires for a call besides the call's own: creating a table with tags needs
/// `TagResource` too.
const IMPLIED: &[(&str, &str)] = &[("dynamodb:CreateTable", "dynamodb:TagResource")];

/// Operations that are not IAM actions themselves, and the actions that authorize them: each
/// action of a `TransactWriteItems` is authorized as the item operation it is (DynamoDB developer
/// guide, "Using IAM with DynamoDB transactions"); there is no `dynamodb:TransactWriteItems`.
/// S3's reads of a bucket are authorized as `s3:ListBucket` and of an object's head as
/// `s3:GetObject` (S3 user guide, "Actions, resources, and condition keys for Amazon S3").
const AUTHORIZED_AS: &[(&str, &[&str])] = &[
    (
        "dynamodb:TransactWriteItems",
        &[
            "dynamodb:ConditionCheckItem",
            "dynamodb:PutItem",
            "dynamodb:UpdateItem",
            "dynamodb:DeleteItem",
        ],
    ),
    ("s3:HeadBucket", &["s3:ListBucket"]),
    ("s3:ListObjectsV2", &["s3:ListBucket"]),
    ("s3:HeadObject", &["s3:GetObject"]),
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `put_record` -> `PutRecord`.
fn action_name(operation: &str) -> String {
    operation
        .split('_')
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_uppercase().chain(c).collect::<String>())
                .unwrap_or_default()
        })
        .collect()
}

/// The IAM actions of every SDK call (`.operation()`, a fluent builder) in the Rust files under `dir`.
fn called(dir: &Path) -> BTreeSet<String> {
    let mut files = Vec::new();
    rust_files(dir, &mut files);
    let mut actions = BTreeSet::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let services = [
            ("kinesis", KINESIS),
            ("dynamodb", DYNAMODB),
            ("logs", LOGS),
            ("sqs", SQS),
            ("sns", SNS),
            ("s3", S3),
        ];
        for (service, operations) in services {
            for op in operations.iter().copied() {
                if !text.contains(&format!(".{op}()")) {
                    continue;
                }
                // An operation of two SDKs (`tag_resource`) is the one of the SDK the file
                // uses, when it uses one of them only.
                let crate_of = |service: &str| format!("aws_sdk_{service}");
                let others: Vec<&str> = services
                    .iter()
                    .filter(|(other, ops)| *other != service && ops.contains(&op))
                    .map(|(other, _)| *other)
                    .collect();
                if !others.is_empty() {
                    let uses = |service: &str| text.contains(&crate_of(service));
                    let others_used = others.iter().any(|o| uses(o));
                    assert!(
                        uses(service) != others_used,
                        "{}: `.{op}()` is an operation of {service} and {others:?}, and the file uses the crates of both or neither; this test cannot tell which",
                        file.display()
                    );
                    if !uses(service) {
                        continue;
                    }
                }
                actions.insert(format!("{service}:{}", action_name(op)));
            }
        }
    }
    for (call, implied) in IMPLIED {
        if actions.contains(*call) {
            actions.insert((*implied).to_string());
        }
    }
    for (operation, authorized_as) in AUTHORIZED_AS {
        if actions.remove(*operation) {
            actions.extend(authorized_as.iter().map(|a| a.to_string()));
        }
    }
    actions
}

/// The actions of the JSON policy that follows the `<!-- iam-policy: NAME -->` marker in the README.
fn policy(name: &str) -> BTreeSet<String> {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let marker = format!("<!-- iam-policy: {name} -->");
    let after = readme
        .split_once(&marker)
        .unwrap_or_else(|| panic!("the README has no {marker}"))
        .1;
    let json = after
        .split_once("```json")
        .and_then(|(_, rest)| rest.split_once("```"))
        .map(|(json, _)| json)
        .unwrap_or_else(|| panic!("no JSON block after {marker}"));
    let mut actions = BTreeSet::new();
    for statement in json.split("\"Action\"").skip(1) {
        let list = statement.split_once(':').unwrap().1;
        let list = list.split_once(']').map_or(list, |(l, _)| l);
        let list = list.split_once("\"Resource\"").map_or(list, |(l, _)| l);
        for quoted in list.split('"').skip(1).step_by(2) {
            actions.insert(quoted.to_string());
        }
    }
    assert!(!actions.is_empty(), "{marker}: no actions read");
    actions
}

#[test]
fn the_library_policy_names_exactly_the_calls_of_the_library() {
    let code = called(&root().join("src"));
    let readme = policy("library");
    let missing: Vec<_> = code.difference(&readme).collect();
    let extra: Vec<_> = readme.difference(&code).collect();
    assert!(
        missing.is_empty(),
        "the library calls actions its policy lacks: {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "the library policy names actions nothing calls: {extra:?}"
    );
}

#[test]
fn the_command_policy_adds_exactly_the_calls_of_the_command() {
    let library = called(&root().join("src"));
    let cli = called(&root().join("cli/src"));
    let readme = policy("cli");
    let beyond_library: BTreeSet<_> = cli.difference(&library).cloned().collect();
    let missing: Vec<_> = beyond_library.difference(&readme).collect();
    let extra: Vec<_> = readme.difference(&cli).collect();
    assert!(
        missing.is_empty(),
        "the command calls actions no policy has: {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "the command policy names actions it does not call: {extra:?}"
    );
}

#[test]
fn the_policies_are_read_as_written() {
    assert!(policy("library").contains("kinesis:GetRecords"));
    assert!(policy("cli").contains("kinesis:CreateStream"));
    assert_eq!(
        action_name("describe_stream_summary"),
        "DescribeStreamSummary"
    );
}
