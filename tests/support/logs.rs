//! CloudWatch Logs on the emulator: a client, and events put in batches.

#![allow(dead_code, unreachable_pub)]

/// A CloudWatch Logs client for the emulator (`AWS_ENDPOINT_URL_CLOUDWATCH_LOGS`, which
/// `scripts/emulators` exports with moto's address).
pub async fn logs_client() -> aws_sdk_cloudwatchlogs::Client {
    let required = std::env::var("SHARDWISE_LIVE").is_ok_and(|v| v == "require");
    if std::env::var("AWS_ENDPOINT_URL_CLOUDWATCH_LOGS").is_err() {
        assert!(
            !required,
            "AWS_ENDPOINT_URL_CLOUDWATCH_LOGS is not set: start the emulators with scripts/emulators"
        );
    }
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .load()
        .await;
    aws_sdk_cloudwatchlogs::Client::new(&config)
}

/// Puts `n` events in one batch, three per millisecond from `base` (ties share a timestamp and an
/// ingestion time), with messages `{prefix}{i}`.
pub async fn put_logs(
    logs: &aws_sdk_cloudwatchlogs::Client,
    group: &str,
    stream: &str,
    base: i64,
    prefix: &str,
    range: std::ops::Range<i64>,
) {
    use aws_sdk_cloudwatchlogs::types::InputLogEvent;
    let events: Vec<InputLogEvent> = range
        .map(|i| {
            InputLogEvent::builder()
                .timestamp(base + i / 3)
                .message(format!("{prefix}{i}"))
                .build()
                .unwrap()
        })
        .collect();
    let put = logs
        .put_log_events()
        .log_group_name(group)
        .log_stream_name(stream)
        .set_log_events(Some(events))
        .send()
        .await
        .unwrap();
    assert!(put.rejected_log_events_info.is_none(), "{put:?}");
}

/// Kinesis on moto (the CloudWatch Logs endpoint: one server for every service), where moto's
/// subscription filters deliver.
pub async fn moto_kinesis() -> aws_sdk_kinesis::Client {
    let moto = std::env::var("AWS_ENDPOINT_URL_CLOUDWATCH_LOGS")
        .expect("AWS_ENDPOINT_URL_CLOUDWATCH_LOGS (moto) is set with the other endpoints");
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .load()
        .await;
    aws_sdk_kinesis::Client::from_conf(
        aws_sdk_kinesis::config::Builder::from(&config)
            .endpoint_url(moto)
            .build(),
    )
}

/// Creates Kinesis `stream` (one shard) on moto and log group `group` with a subscription
/// filter (every event) writing to it.
pub async fn subscribed_stream(
    logs: &aws_sdk_cloudwatchlogs::Client,
    kinesis: &aws_sdk_kinesis::Client,
    group: &str,
    stream: &str,
) {
    kinesis
        .create_stream()
        .stream_name(stream)
        .shard_count(1)
        .send()
        .await
        .unwrap();
    let arn = kinesis
        .describe_stream_summary()
        .stream_name(stream)
        .send()
        .await
        .unwrap()
        .stream_description_summary
        .unwrap()
        .stream_arn;
    logs.create_log_group()
        .log_group_name(group)
        .send()
        .await
        .unwrap();
    logs.put_subscription_filter()
        .log_group_name(group)
        .filter_name("to-kinesis")
        .filter_pattern("")
        .destination_arn(&arn)
        .role_arn("arn:aws:iam::123456789012:role/cwl-to-kinesis")
        .send()
        .await
        .unwrap();
}
