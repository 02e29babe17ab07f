//! Enhanced fan-out against the live emulators (kinesis-mock implements RegisterStreamConsumer,
//! SubscribeToShard and the consumer's tags): every record read in order from the checkpoint,
//! KPL aggregates resumed mid-aggregate, a split followed parent before children, a consumer
//! name that belongs to another application reported, not used, and subscriptions cut or
//! stalled mid-stream (through a TCP proxy the test controls) made again without a loss or a
//! repeat.

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
use support::proxy::Proxy;

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

    // First run: sub-6 keeps failing (retried in place, the default: it holds, and sub-9 of its
    // key waits behind it), so the checkpoint stops inside the aggregate at sub-record 5.
    let seen: Seen = Arc::default();
    let running = builder(&stream, &app, recorder(&seen, Some("sub-6")))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    // Each record as first handed out (sub-6's attempts after its first are not).
    let firsts = || {
        let mut known = std::collections::HashSet::new();
        let seen = seen.lock().unwrap();
        seen.iter()
            .filter(|r| known.insert(r.0.clone()))
            .cloned()
            .collect::<Vec<_>>()
    };
    wait_for("29 deliveries", Duration::from_secs(30), || {
        firsts().len() >= 29
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.shutdown(Duration::from_secs(3)).await;
    let first: Vec<String> = firsts().into_iter().map(|r| r.0).collect();
    let mut expected: Vec<String> = (0..9).map(|i| format!("sub-{i}")).collect();
    expected.extend((0..20).map(|i| format!("before-{i}")));
    assert_eq!(
        first, expected,
        "pushed in shard order, sub-9 waiting behind sub-6"
    );
    assert!(
        payloads(&seen).iter().filter(|p| *p == "sub-6").count() >= 2,
        "sub-6 ran again in place"
    );
    let subs_seen: Vec<(String, u64)> = firsts()[..9].iter().map(|r| (r.3.clone(), r.4)).collect();
    assert!(
        subs_seen
            .iter()
            .enumerate()
            .all(|(i, (s, sub))| *s == aggregate && *sub == i as u64)
    );

    // The consumer is registered under the application's name, tagged with it.
    let stream_arn = live.stream_arn(&stream).await;
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
    let stream_arn = live.stream_arn(&stream).await;
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

/// Subscriptions cut mid-stream (their connections closed) and one that stalls (open, but no
/// event and no heartbeat) while records keep arriving: each is made again from the last
/// position the reader took, and every record is handled exactly once, in order per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_cut_or_stalled_mid_stream_lose_and_repeat_nothing() {
    let live = live_or_skip!();
    let stream = support::unique_name("efo-cut");
    let app = support::unique_name("efo-cut-app");
    live.create_stream(&stream, 2).await;
    let proxy = Proxy::start(&std::env::var("AWS_ENDPOINT_URL_KINESIS").unwrap()).await;
    let through_proxy = proxy.client().await;
    let fan_out = FanOut::new()
        .stall_timeout(Duration::from_secs(2))
        .end_check_interval(Duration::from_secs(3600));
    let records = shardwise::shard::fanout::FanOutRecords::new(through_proxy, fan_out);
    records.register(&stream, &app).await.expect("registered");

    let keys = 8;
    let mut next = 0u32;
    for _ in 0..80 {
        put(
            &live,
            &stream,
            &format!("k{}", next % keys),
            format!("r-{next}"),
        )
        .await;
        next += 1;
    }
    let seen: Seen = Arc::default();
    let running = Consumer::builder(&stream, &app, recorder(&seen, None))
        .worker_id("efo-w1")
        .checkpoint_interval(Duration::from_millis(100))
        .record_source(Arc::new(records))
        .build()
        .unwrap()
        .run()
        .await
        .unwrap();
    wait_for("the first records", Duration::from_secs(30), || {
        seen.lock().unwrap().len() >= 80
    })
    .await;
    let before = proxy.accepted();
    for round in 0..9 {
        for _ in 0..20 {
            put(
                &live,
                &stream,
                &format!("k{}", next % keys),
                format!("r-{next}"),
            )
            .await;
            next += 1;
        }
        match round {
            2 | 5 => proxy.cut(),
            7 => proxy.freeze(),
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(700)).await;
    }
    let total = next as usize;
    wait_for("every record", Duration::from_secs(60), || {
        seen.lock().unwrap().len() >= total
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    running.shutdown(Duration::from_secs(3)).await;
    let reconnected = proxy.accepted() - before;
    eprintln!("{total} records, {reconnected} connections made after the first records");
    assert!(
        reconnected >= 4,
        "two cuts and a stall of two subscriptions: {reconnected} new connections"
    );

    let seen = seen.lock().unwrap().clone();
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for r in &seen {
        *counts.entry(r.0.as_str()).or_default() += 1;
    }
    let twice: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "handled twice: {twice:?}");
    assert_eq!(counts.len(), total, "every record handled");
    for key in 0..keys {
        let order: Vec<u32> = seen
            .iter()
            .filter(|r| r.1 == format!("k{key}"))
            .map(|r| r.0["r-".len()..].parse().unwrap())
            .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "k{key}: {order:?}");
    }
    live.delete_stream(&stream).await;
}

/// Two workers of one application starting together on a stream with no consumer yet: one
/// registers it (and, on kinesis-mock, which drops a registration's tags, tags it right after),
/// the other finds it untagged for that moment; both start and share it. (Found by CI: the
/// second worker took the consumer for another's and refused to start.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_starting_together_share_the_consumer_one_of_them_registers() {
    let live = live_or_skip!();
    let stream = support::unique_name("efo-together");
    let app = support::unique_name("efo-together-app");
    live.create_stream(&stream, 2).await;
    for round in 0..3 {
        let start = |id: &'static str| {
            builder(&stream, &app, |_d: Delivery| async { Outcome::Ack })
                .worker_id(id)
                .enhanced_fan_out(FanOut::new().consumer_name(format!("together-{round}")))
                .build()
                .unwrap()
                .run()
        };
        let (a, b) = tokio::join!(start("w1"), start("w2"));
        let (a, b) = (a.expect("w1 starts"), b.expect("w2 starts"));
        a.shutdown(Duration::from_secs(3)).await;
        b.shutdown(Duration::from_secs(3)).await;
    }
    live.delete_stream(&stream).await;
}

/// The consumer deregistered while the application reads with it (an operator's
/// `shardwise stream deregister-consumer`): the consumer stops on its own with
/// `Error::ConsumerGone` naming it (not a shard "not found" by GetRecords), its leases given
/// back; started again, it registers the consumer anew and goes on from its checkpoints: every
/// record handled, none twice. (kinesis-mock keeps a subscription open after its consumer is
/// deregistered, for up to its 5 minutes; the test cuts the connections, as a service would end
/// them, and the next subscription is refused.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_deregistered_under_a_running_application_stops_it_naming_the_consumer() {
    let live = live_or_skip!();
    let stream = support::unique_name("efo-gone");
    let app = support::unique_name("efo-app");
    live.create_stream(&stream, 2).await;
    for i in 0..20 {
        put(&live, &stream, &format!("k{}", i % 4), format!("first-{i}")).await;
    }
    let proxy = Proxy::start(&std::env::var("AWS_ENDPOINT_URL_KINESIS").unwrap()).await;
    let through_proxy = proxy.client().await;
    let start = |client: aws_sdk_kinesis::Client, seen: Seen| {
        let (stream, app) = (stream.clone(), app.clone());
        async move {
            let records = shardwise::shard::fanout::FanOutRecords::new(client, FanOut::new());
            records.register(&stream, &app).await.expect("registered");
            Consumer::builder(&stream, &app, recorder(&seen, None))
                .worker_id("efo-w1")
                .checkpoint_interval(Duration::from_millis(100))
                .record_source(Arc::new(records))
                .build()
                .unwrap()
                .run()
                .await
                .unwrap()
        }
    };
    let seen: Seen = Arc::default();
    let running = start(through_proxy, seen.clone()).await;
    wait_for("20 deliveries", Duration::from_secs(30), || {
        seen.lock().unwrap().len() >= 20
    })
    .await;
    // Let the checkpoints land before the consumer goes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stream_arn = live.stream_arn(&stream).await;
    live.kinesis
        .deregister_stream_consumer()
        .stream_arn(&stream_arn)
        .consumer_name(&app)
        .send()
        .await
        .expect("DeregisterStreamConsumer");
    for i in 0..20 {
        put(
            &live,
            &stream,
            &format!("k{}", i % 4),
            format!("second-{i}"),
        )
        .await;
    }
    proxy.cut();
    let mut fatal = running.fatal();
    tokio::time::timeout(Duration::from_secs(60), fatal.wait_for(Option::is_some))
        .await
        .expect("the consumer stops on its own within a minute")
        .unwrap();
    let error = fatal.borrow().clone().unwrap();
    match &*error {
        Error::ConsumerGone {
            stream: s,
            consumer,
        } => {
            assert_eq!(s, &stream);
            assert_eq!(consumer, &app);
        }
        other => panic!("{other:?}"),
    }
    assert!(error.is_permanent());
    eprintln!("{error}");
    wait_for("every shard stopped", Duration::from_secs(10), || {
        running.shards().is_empty()
    })
    .await;
    running.shutdown(Duration::from_secs(3)).await;

    // Started again: registered anew, on from the checkpoints.
    let running = start(live.kinesis.clone(), seen.clone()).await;
    wait_for("40 deliveries", Duration::from_secs(60), || {
        seen.lock().unwrap().len() >= 40
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.shutdown(Duration::from_secs(3)).await;
    let mut texts = payloads(&seen);
    texts.sort();
    let mut expected: Vec<String> = (0..20)
        .flat_map(|i| [format!("first-{i}"), format!("second-{i}")])
        .collect();
    expected.sort();
    assert_eq!(texts, expected, "every record once");
    live.delete_stream(&stream).await;
}
