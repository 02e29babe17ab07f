//! Enhanced fan-out against the live emulators (kinesis-mock implements RegisterStreamConsumer,
//! SubscribeToShard and the consumer's tags): every record read in order from the checkpoint,
//! KPL aggregates resumed mid-aggregate, a split followed parent before children, and a consumer
//! name that belongs to another application reported, not used.

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::wait::wait_for;

use aws_sdk_kinesis::primitives::Blob;
use bytes::Bytes;
use shardwise::lease::LeaseSettings;
use shardwise::shard::fanout::{APPLICATION_TAG, FanOut};
use shardwise::{Consumer, ConsumerBuilder, Delivery, Error, Outcome, kpl};
use support::Live;

/// (payload, partition key, shard, sequence, sub-sequence)
type Seen = Arc<Mutex<Vec<(String, String, String, String, u64)>>>;

fn builder<F, Fut>(stream: &str, app: &str, handler: F) -> ConsumerBuilder<F>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Outcome> + Send,
{
    Consumer::builder(stream, app, handler)
        .worker_id("efo-w1")
        .checkpoint_interval(Duration::from_millis(100))
        .lease_settings(
            LeaseSettings::default()
                .lease_duration(Duration::from_millis(3000))
                .scan_interval(Duration::from_millis(200)),
        )
        .enhanced_fan_out(FanOut::new().end_check_interval(Duration::from_secs(2)))
}

fn recorder(
    seen: &Seen,
    refuse: Option<&'static str>,
) -> impl Fn(Delivery) -> std::future::Ready<Outcome> + Clone + use<> {
    let seen = seen.clone();
    move |d: Delivery| {
        let text = String::from_utf8_lossy(d.payload()).to_string();
        let refused = refuse == Some(text.as_str());
        seen.lock().unwrap().push((
            text,
            d.partition_key().to_string(),
            d.shard().to_string(),
            d.sequence_number().to_string(),
            d.sub_sequence(),
        ));
        std::future::ready(if refused {
            Outcome::Retry
        } else {
            Outcome::Ack
        })
    }
}

async fn put(live: &Live, stream: &str, key: &str, data: impl Into<Bytes>) -> String {
    live.kinesis
        .put_record()
        .stream_name(stream)
        .partition_key(key)
        .data(Blob::new(data.into()))
        .send()
        .await
        .expect("PutRecord")
        .sequence_number
}

fn payloads(seen: &Seen) -> Vec<String> {
    seen.lock().unwrap().iter().map(|r| r.0.clone()).collect()
}

/// A fan-out consumer reads a KPL aggregate and plain records pushed by SubscribeToShard, stops
/// with its checkpoint inside the aggregate, and the next run resumes at the sub-record after it;
/// then a split while consuming: the parent's records before either child's, every record once,
/// per-key order kept. The consumer it registered carries the application's tag.
#[tokio::test]
async fn fan_out_resumes_mid_aggregate_and_follows_a_split_parent_first() {
    let live = live_or_skip!();
    let stream = support::unique_name("efo");
    let app = support::unique_name("efo-app");
    live.create_stream(&stream, 1).await;
    let subs: Vec<(String, Option<String>, Bytes)> = (0..10)
        .map(|i| {
            (
                format!("user-{}", i % 3),
                None,
                Bytes::from(format!("sub-{i}")),
            )
        })
        .collect();
    let aggregate = put(&live, &stream, "agg", kpl::aggregate(&subs)).await;
    for i in 0..20 {
        put(
            &live,
            &stream,
            &format!("k{}", i % 4),
            format!("before-{i}"),
        )
        .await;
    }

    // First run: sub-6 is refused (no dead-letter stream: it holds), so the checkpoint stops
    // inside the aggregate at sub-record 5.
    let seen: Seen = Arc::default();
    let running = builder(&stream, &app, recorder(&seen, Some("sub-6")))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("30 deliveries", Duration::from_secs(30), || {
        seen.lock().unwrap().len() >= 30
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.shutdown(Duration::from_secs(3)).await;
    let first = payloads(&seen);
    let mut expected: Vec<String> = (0..10).map(|i| format!("sub-{i}")).collect();
    expected.extend((0..20).map(|i| format!("before-{i}")));
    assert_eq!(first[..30], expected[..], "pushed in shard order");
    let subs_seen: Vec<(String, u64)> = seen.lock().unwrap()[..10]
        .iter()
        .map(|r| (r.3.clone(), r.4))
        .collect();
    assert!(
        subs_seen
            .iter()
            .enumerate()
            .all(|(i, (s, sub))| *s == aggregate && *sub == i as u64)
    );

    // The consumer is registered under the application's name, tagged with it.
    let stream_arn = live
        .kinesis
        .describe_stream_summary()
        .stream_name(&stream)
        .send()
        .await
        .unwrap()
        .stream_description_summary
        .unwrap()
        .stream_arn;
    let consumer = live
        .kinesis
        .describe_stream_consumer()
        .stream_arn(&stream_arn)
        .consumer_name(&app)
        .send()
        .await
        .expect("registered under the application's name")
        .consumer_description
        .unwrap();
    let tags = live
        .kinesis
        .list_tags_for_resource()
        .resource_arn(&consumer.consumer_arn)
        .send()
        .await
        .unwrap()
        .tags
        .unwrap_or_default();
    assert!(
        tags.iter()
            .any(|t| t.key == APPLICATION_TAG && t.value.as_deref() == Some(app.as_str())),
        "{tags:?}"
    );

    // Second run: resumes at sub-6, then splits the shard while consuming.
    let again: Seen = Arc::default();
    let running = builder(&stream, &app, recorder(&again, None))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("the rest of the parent", Duration::from_secs(30), || {
        again.lock().unwrap().len() >= 24
    })
    .await;
    let parent = "shardId-000000000000";
    live.kinesis
        .split_shard()
        .stream_name(&stream)
        .shard_to_split(parent)
        .new_starting_hash_key((u128::MAX / 2).to_string())
        .send()
        .await
        .expect("SplitShard");
    live.wait_stream_active(&stream).await;
    for i in 0..40 {
        put(&live, &stream, &format!("k{}", i % 4), format!("after-{i}")).await;
    }
    wait_for("the children's records", Duration::from_secs(60), || {
        again.lock().unwrap().len() >= 64
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.shutdown(Duration::from_secs(3)).await;

    let again = again.lock().unwrap().clone();
    let texts: Vec<&str> = again.iter().map(|r| r.0.as_str()).collect();
    assert_eq!(
        texts[..4],
        ["sub-6", "sub-7", "sub-8", "sub-9"],
        "resumed at sub-record 6"
    );
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for t in &texts {
        *counts.entry(t).or_default() += 1;
    }
    let twice: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "handled twice: {twice:?}");
    for i in 0..40 {
        assert!(
            counts.contains_key(format!("after-{i}").as_str()),
            "after-{i} missing"
        );
    }
    let last_parent = again.iter().rposition(|r| r.2 == parent).unwrap();
    let first_child = again.iter().position(|r| r.2 != parent).unwrap();
    assert!(last_parent < first_child, "parent before children");
    for key in ["k0", "k1", "k2", "k3"] {
        let order: Vec<usize> = again
            .iter()
            .filter(|r| r.1 == key && r.0.starts_with("after-"))
            .map(|r| r.0["after-".len()..].parse().unwrap())
            .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{key}: {order:?}");
    }
    live.delete_stream(&stream).await;
}

/// A consumer name that another application registered (its tag names it), or that shardwise
/// did not register (no tag), is reported at run and not used.
#[tokio::test]
async fn a_consumer_name_of_another_application_is_reported_not_used() {
    let live = live_or_skip!();
    let stream = support::unique_name("efo-taken");
    let app = support::unique_name("efo-app");
    live.create_stream(&stream, 1).await;
    let stream_arn = live
        .kinesis
        .describe_stream_summary()
        .stream_name(&stream)
        .send()
        .await
        .unwrap()
        .stream_description_summary
        .unwrap()
        .stream_arn;
    let theirs = live
        .kinesis
        .register_stream_consumer()
        .stream_arn(&stream_arn)
        .consumer_name("shared")
        .send()
        .await
        .unwrap()
        .consumer
        .unwrap()
        .consumer_arn;
    live.kinesis
        .register_stream_consumer()
        .stream_arn(&stream_arn)
        .consumer_name("untagged")
        .send()
        .await
        .unwrap();
    live.kinesis
        .tag_resource()
        .resource_arn(&theirs)
        .tags(APPLICATION_TAG, "billing")
        .send()
        .await
        .unwrap();
    for (name, holder) in [("shared", Some("billing")), ("untagged", None)] {
        let err = builder(&stream, &app, |_d: Delivery| async { Outcome::Ack })
            .enhanced_fan_out(FanOut::new().consumer_name(name))
            .build()
            .unwrap()
            .run()
            .await
            .expect_err("a consumer of another application");
        match &err {
            Error::ConsumerInUse {
                consumer,
                holder: h,
                ..
            } => {
                assert_eq!(consumer, name);
                assert_eq!(h.as_deref(), holder);
            }
            other => panic!("{other:?}"),
        }
        assert!(err.is_permanent());
        eprintln!("{err}");
    }
    live.delete_stream(&stream).await;
}
