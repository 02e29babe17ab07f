//! On-failure destinations on the emulators: spent records retried in place go to an SQS queue
//! (moto) after `max_attempts`, or to an S3 bucket (moto) once older than `max_record_age`, each
//! with its payload byte for byte and where it came from, before they settle; a missing queue or
//! bucket fails the start naming it. The same through an SNS topic (moto), its message Lambda's
//! failure record with the record beside it, read from an SQS queue subscribed to the topic.

mod support;

use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::wait::wait_for;

use aws_sdk_kinesis::primitives::Blob;
use base64::Engine;
use shardwise::aws_sdk_s3;
use shardwise::aws_sdk_sns;
use shardwise::aws_sdk_sqs;
use shardwise::consumer::RetryMode;
use shardwise::destination::{Destination, S3Destination, SnsDestination, SqsDestination};
use shardwise::lease::LeaseSettings;
use shardwise::{Consumer, ConsumerBuilder, Delivery, Error, Outcome};
use support::Live;

/// (payload, attempt), in the order handlers were called.
type Seen = Arc<Mutex<Vec<(Vec<u8>, u32)>>>;

async fn config() -> aws_config::SdkConfig {
    aws_config::defaults(aws_config::BehaviorVersion::latest())
        .load()
        .await
}

async fn sqs() -> aws_sdk_sqs::Client {
    aws_sdk_sqs::Client::new(&config().await)
}

/// An S3 client for the emulator: path-style addresses (moto serves every bucket on one host).
async fn s3() -> aws_sdk_s3::Client {
    let config = aws_sdk_s3::config::Builder::from(&config().await)
        .force_path_style(true)
        .build();
    aws_sdk_s3::Client::from_conf(config)
}

/// A consumer with retries in place whose handler always fails the records of key `poison`.
fn consumer(stream: &str, app: &str, seen: &Seen) -> ConsumerBuilder<impl shardwise::Handler> {
    let seen = seen.clone();
    Consumer::builder(stream, app, move |d: Delivery| {
        seen.lock()
            .unwrap()
            .push((d.payload().to_vec(), d.attempt()));
        let fails = d.partition_key() == "poison";
        async move { if fails { Outcome::Retry } else { Outcome::Ack } }
    })
    .worker_id("live-w1")
    .poll_interval(Duration::from_millis(200))
    .checkpoint_interval(Duration::from_millis(100))
    .lease_settings(
        LeaseSettings::default()
            .lease_duration(Duration::from_millis(3000))
            .scan_interval(Duration::from_millis(200)),
    )
    .retries(RetryMode::InPlace)
}

async fn put(live: &Live, stream: &str, key: &str, data: &[u8]) -> String {
    live.kinesis
        .put_record()
        .stream_name(stream)
        .partition_key(key)
        .data(Blob::new(data.to_vec()))
        .send()
        .await
        .expect("PutRecord")
        .sequence_number
}

fn calls(seen: &Seen, payload: &[u8]) -> Vec<u32> {
    seen.lock()
        .unwrap()
        .iter()
        .filter(|(p, _)| p == payload)
        .map(|(_, a)| *a)
        .collect()
}

/// Lambda's SNS on-failure destination: the spent record published to a topic as Lambda's
/// failure record (`KinesisBatchInfo` for a batch of one, `requestContext.condition`), with the
/// record's payload beside it; read from an SQS queue subscribed to the topic (raw delivery).
#[tokio::test]
async fn a_record_that_keeps_failing_is_published_to_the_sns_topic_as_lambdas_failure_record() {
    let live = live_or_skip!();
    let stream = support::unique_name("dest-sns");
    let app = support::unique_name("dest-sns-app");
    live.create_stream(&stream, 1).await;
    let config = config().await;
    let sns = aws_sdk_sns::Client::new(&config);
    let sqs = sqs().await;
    let topic = sns
        .create_topic()
        .name(support::unique_name("spent"))
        .send()
        .await
        .expect("CreateTopic")
        .topic_arn
        .expect("a topic ARN");
    let queue = sqs
        .create_queue()
        .queue_name(support::unique_name("spent-sub"))
        .send()
        .await
        .expect("CreateQueue")
        .queue_url
        .expect("a queue URL");
    let queue_arn = sqs
        .get_queue_attributes()
        .queue_url(&queue)
        .attribute_names(aws_sdk_sqs::types::QueueAttributeName::QueueArn)
        .send()
        .await
        .expect("GetQueueAttributes")
        .attributes
        .and_then(|a| {
            a.get(&aws_sdk_sqs::types::QueueAttributeName::QueueArn)
                .cloned()
        })
        .expect("the queue's ARN");
    sns.subscribe()
        .topic_arn(&topic)
        .protocol("sqs")
        .endpoint(&queue_arn)
        .attributes("RawMessageDelivery", "true")
        .send()
        .await
        .expect("Subscribe");
    let poison = b"\x00poison\xff".to_vec();
    let sequence = put(&live, &stream, "poison", &poison).await;
    put(&live, &stream, "fine", b"after").await;
    let seen: Seen = Arc::default();
    let stream_arn = format!("arn:aws:kinesis:us-east-1:123456789012:stream/{stream}");
    let running = consumer(&stream, &app, &seen)
        .max_attempts(NonZeroU32::new(2).unwrap())
        .on_failure(Arc::new(
            SnsDestination::new(sns.clone(), topic.clone()).stream_arn(&stream_arn),
        ))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let mut messages = Vec::new();
    for _ in 0..50 {
        let out = sqs
            .receive_message()
            .queue_url(&queue)
            .max_number_of_messages(10)
            .send()
            .await
            .expect("ReceiveMessage");
        messages.extend(out.messages.unwrap_or_default());
        if !messages.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(calls(&seen, &poison), [1, 2], "two attempts in place");
    assert_eq!(calls(&seen, b"after"), [1]);
    assert_eq!(messages.len(), 1, "{messages:?}");
    let record: serde_json::Value =
        serde_json::from_str(messages[0].body().expect("a body")).expect("JSON");
    assert_eq!(record["version"], "1.0", "{record}");
    assert_eq!(
        record["requestContext"]["condition"],
        "RetryAttemptsExhausted"
    );
    assert_eq!(record["requestContext"]["approximateInvokeCount"], 2);
    let batch = &record["KinesisBatchInfo"];
    assert_eq!(batch["shardId"], "shardId-000000000000");
    assert_eq!(batch["startSequenceNumber"], sequence.as_str());
    assert_eq!(batch["endSequenceNumber"], sequence.as_str());
    assert_eq!(batch["batchSize"], 1);
    assert_eq!(batch["streamArn"], stream_arn.as_str());
    let data = base64::engine::general_purpose::STANDARD
        .decode(record["data"].as_str().unwrap())
        .unwrap();
    assert_eq!(data, poison, "the payload byte for byte");

    // A topic that does not exist fails the start, naming it.
    let missing = format!("{topic}-missing");
    let refused = consumer(&stream, &support::unique_name("dest-sns-missing"), &seen)
        .max_attempts(NonZeroU32::new(2).unwrap())
        .on_failure(Arc::new(SnsDestination::new(sns, missing.clone())))
        .build()
        .unwrap()
        .run()
        .await;
    let Err(error) = refused else {
        panic!("a missing topic must fail the start")
    };
    let error = error.to_string();
    assert!(error.contains(&missing), "{error}");
}

#[tokio::test]
async fn a_record_that_keeps_failing_goes_to_the_sqs_queue_after_max_attempts() {
    let live = live_or_skip!();
    let stream = support::unique_name("dest-sqs");
    let app = support::unique_name("dest-sqs-app");
    live.create_stream(&stream, 1).await;
    let sqs = sqs().await;
    let queue = sqs
        .create_queue()
        .queue_name(support::unique_name("spent"))
        .send()
        .await
        .expect("CreateQueue")
        .queue_url
        .expect("a queue URL");
    let poison = b"\x00poison\xff".to_vec();
    let sequence = put(&live, &stream, "poison", &poison).await;
    put(&live, &stream, "fine", b"after").await;
    let seen: Seen = Arc::default();
    let running = consumer(&stream, &app, &seen)
        .max_attempts(NonZeroU32::new(3).unwrap())
        .on_failure(Arc::new(SqsDestination::new(sqs.clone(), queue.clone())))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let mut messages = Vec::new();
    for _ in 0..50 {
        let out = sqs
            .receive_message()
            .queue_url(&queue)
            .max_number_of_messages(10)
            .send()
            .await
            .expect("ReceiveMessage");
        messages.extend(out.messages.unwrap_or_default());
        if !messages.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    running.shutdown(Duration::from_secs(5)).await;
    assert_eq!(calls(&seen, &poison), [1, 2, 3], "three attempts in place");
    assert_eq!(calls(&seen, b"after"), [1]);
    assert_eq!(messages.len(), 1, "{messages:?}");
    let doc: serde_json::Value =
        serde_json::from_str(messages[0].body().expect("a body")).expect("JSON");
    let data = base64::engine::general_purpose::STANDARD
        .decode(doc["data"].as_str().unwrap())
        .unwrap();
    assert_eq!(data, poison, "the payload byte for byte");
    assert_eq!(doc["stream"], stream.as_str());
    assert_eq!(doc["shard"], "shardId-000000000000");
    assert_eq!(doc["sequenceNumber"], sequence.as_str());
    assert_eq!(doc["partitionKey"], "poison");
    assert_eq!(doc["attempts"], 3);
    assert!(
        doc["approximateArrivalTimestamp"].as_u64().is_some(),
        "{doc}"
    );
    assert!(
        doc["reason"].as_str().unwrap().contains("attempts spent"),
        "{doc}"
    );
    live.delete_stream(&stream).await;
}

#[tokio::test]
async fn a_record_older_than_max_record_age_goes_to_the_s3_bucket() {
    let live = live_or_skip!();
    let stream = support::unique_name("dest-s3");
    let app = support::unique_name("dest-s3-app");
    live.create_stream(&stream, 1).await;
    let s3 = s3().await;
    let bucket = support::unique_name("spent").to_lowercase();
    s3.create_bucket()
        .bucket(&bucket)
        .send()
        .await
        .expect("CreateBucket");
    let poison = vec![0xffu8; 300 * 1024];
    let sequence = put(&live, &stream, "poison", &poison).await;
    put(&live, &stream, "fine", b"after").await;
    let seen: Seen = Arc::default();
    let destination = S3Destination::new(s3.clone(), bucket.clone(), "failed/");
    let running = consumer(&stream, &app, &seen)
        .max_record_age(Duration::from_secs(2))
        .on_failure(Arc::new(destination))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    let key = format!("failed/{stream}/shardId-000000000000/{sequence}-0.json");
    let mut body = None;
    for _ in 0..75 {
        if let Ok(object) = s3.get_object().bucket(&bucket).key(&key).send().await {
            body = Some(object.body.collect().await.unwrap().into_bytes());
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    wait_for("the later record", Duration::from_secs(10), || {
        !calls(&seen, b"after").is_empty()
    })
    .await;
    running.shutdown(Duration::from_secs(5)).await;
    let body = body.unwrap_or_else(|| panic!("no object at {key}"));
    let doc: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    let data = base64::engine::general_purpose::STANDARD
        .decode(doc["data"].as_str().unwrap())
        .unwrap();
    assert_eq!(
        data, poison,
        "the payload byte for byte (300 KiB: over SQS's limit)"
    );
    assert!(
        doc["reason"].as_str().unwrap().contains("too old"),
        "{}",
        doc["reason"]
    );
    let attempts = calls(&seen, &poison);
    assert!(
        attempts.len() >= 2,
        "it ran again until too old: {attempts:?}"
    );
    assert_eq!(doc["attempts"], *attempts.last().unwrap());
    live.delete_stream(&stream).await;
}

#[tokio::test]
async fn a_missing_queue_or_bucket_fails_the_start_naming_it() {
    let live = live_or_skip!();
    let stream = support::unique_name("dest-missing");
    live.create_stream(&stream, 1).await;
    let seen: Seen = Arc::default();
    let queue = format!(
        "{}/000000000000/{}",
        std::env::var("AWS_ENDPOINT_URL_SQS").unwrap_or_default(),
        support::unique_name("no-such-queue")
    );
    let destinations: [Arc<dyn Destination>; 2] = [
        Arc::new(SqsDestination::new(sqs().await, queue)),
        Arc::new(S3Destination::new(
            s3().await,
            support::unique_name("no-such-bucket").to_lowercase(),
            "",
        )),
    ];
    for destination in destinations {
        let name = destination.name().to_string();
        let err = consumer(&stream, &support::unique_name("dest-missing-app"), &seen)
            .on_failure(destination)
            .build()
            .unwrap()
            .run()
            .await
            .expect_err("a missing destination fails the start");
        assert!(
            matches!(
                &err,
                Error::Destination {
                    permanent: true,
                    ..
                }
            ),
            "{name}: {err:?}"
        );
        assert!(err.to_string().contains(&name), "{err}");
    }
    live.delete_stream(&stream).await;
}
