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
