//! shardwise and ruststream-kinesis 0.7.1 read each other's retry copies and dead letters, live on
//! the emulators: the RSK2 envelope, the meaning of `x-ruststream-retry-count` (a count of retries:
//! the first copy carries `1` and is attempt 2), and every header a dead letter carries.

#[path = "../../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_kinesis::primitives::Blob;
use bytes::Bytes;
use ruststream::runtime::RETRY_COUNT_HEADER;
use ruststream_kinesis::prelude::*;
use shardwise::envelope::{self, Headers};
use shardwise::lease::LeaseSettings;
use shardwise::retry::{
    ATTEMPTS_HEADER, DEAD_LETTER_REASON_HEADER, ORIGIN_SEQUENCE_HEADER, ORIGIN_SHARD_HEADER,
};
use shardwise::{Consumer, Delivery, Outcome};

/// Headers ruststream-kinesis's reader sets on every delivery from the record itself (not from the
/// envelope).
const READER_HEADERS: [&str; 3] = [
    "partition-key",
    "kinesis-sequence-number",
    "kinesis-shard-id",
];

/// One delivery as a ruststream-kinesis handler saw it.
#[derive(Debug, Clone)]
struct RsSeen {
    attempt: u64,
    headers: BTreeMap<String, String>,
    payload: Vec<u8>,
}

/// The record's bytes as they arrived, envelope stripped: no codec.
#[derive(Deserialized)]
struct Frame<'a>(&'a [u8]);

/// Records every delivery; answers `retry` to attempts below `retry_below`, ack otherwise.
#[derive(Clone)]
struct Collect {
    seen: Arc<Mutex<Vec<RsSeen>>>,
    retry_below: u64,
}

impl<'p> Handle<Frame<'p>, (), (), KinesisContext> for Collect {
    async fn handle(
        &self,
        frame: &Frame<'p>,
        _outs: &(),
        ctx: &mut Context<'_, KinesisContext>,
    ) -> Result<(), HandlerOutcome> {
        let headers = ctx.headers();
        // ruststream-runtime's own `attempt_of`: the count + 1, absent or malformed = 0.
        let attempt = headers
            .get_str(RETRY_COUNT_HEADER)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            + 1;
        self.seen.lock().unwrap().push(RsSeen {
            attempt,
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_owned(), String::from_utf8_lossy(v).into_owned()))
                .collect(),
            payload: frame.0.to_vec(),
        });
        if attempt < self.retry_below {
            Err(HandlerOutcome::retry())
        } else {
            Ok(())
        }
    }
}

/// A ruststream-kinesis service reading `stream` from its trim horizon; with `retries`, a cap of
/// that many attempts and a dead-letter stream.
fn ruststream(stream: &str, collect: Collect, retries: Option<(u32, &str)>) -> RustStream {
    let stream = stream.to_owned();
    let retries = retries.map(|(n, dlq)| (n, dlq.to_owned()));
    RustStream::new(AppInfo::new("shardwise-interop", "0.1.0")).with_broker(
        KinesisBroker::new(),
        move |b| {
            let registration = b.include(
                subscriber(
                    KinesisStream::new(stream).poll_interval(Duration::from_millis(200)),
                    collect,
                )
                .build()
                .start_at(KinesisPosition::horizon()),
            );
            if let Some((n, dlq)) = retries {
                registration
                    .max_attempts(NonZeroU32::new(n).expect("at least one attempt"))
                    .dead_letter(dlq);
            }
        },
    )
}

/// Runs a ruststream-kinesis service until `done` holds for what it saw (30 s at most).
async fn run_ruststream(
    stream: &str,
    retry_below: u64,
    retries: Option<(u32, &str)>,
    done: impl Fn(&[RsSeen]) -> bool,
) -> Vec<RsSeen> {
    let seen: Arc<Mutex<Vec<RsSeen>>> = Arc::default();
    let collect = Collect {
        seen: seen.clone(),
        retry_below,
    };
    let running = ruststream(stream, collect, retries)
        .start()
        .await
        .expect("ruststream starts");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done(&seen.lock().unwrap()) {
        assert!(
            Instant::now() < deadline,
            "ruststream never saw enough: {:#?}",
            seen.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await; // let copies it publishes leave
    running.shutdown().await.expect("ruststream stops");
    seen.lock().unwrap().clone()
}

/// One delivery as a shardwise handler saw it.
#[derive(Debug, Clone)]
struct SwSeen {
    attempt: u32,
    headers: Headers,
    payload: Bytes,
}

/// Runs a shardwise consumer of `stream` until it saw `n` deliveries; its handler retries attempts
/// below `retry_below`.
async fn run_shardwise(
    live: &support::Live,
    stream: &str,
    n: usize,
    retry_below: u32,
    retries: Option<(u32, &str)>,
) -> Vec<SwSeen> {
    let app = support::unique_name("interop-app");
    let seen: Arc<Mutex<Vec<SwSeen>>> = Arc::default();
    let s = seen.clone();
    let mut builder = Consumer::builder(stream, &app, move |d: Delivery| {
        s.lock().unwrap().push(SwSeen {
            attempt: d.attempt(),
            headers: d.headers().clone(),
            payload: d.payload().clone(),
        });
        let retry = d.attempt() < retry_below;
        async move { if retry { Outcome::Retry } else { Outcome::Ack } }
    })
    .worker_id("interop")
    .poll_interval(Duration::from_millis(200))
    .checkpoint_interval(Duration::from_millis(100))
    .lease_settings(
        LeaseSettings::default()
            .lease_duration(Duration::from_secs(3))
            .scan_interval(Duration::from_millis(200)),
    );
    if let Some((max, dlq)) = retries {
        // Counted copies on the stream, as ruststream writes them.
        builder = builder
            .retries(shardwise::consumer::RetryMode::Copy)
            .max_attempts(NonZeroU32::new(max).unwrap())
            .dead_letter(dlq);
    }
    let running = builder
        .build()
        .unwrap()
        .run()
        .await
        .expect("shardwise starts");
    let deadline = Instant::now() + Duration::from_secs(30);
    while seen.lock().unwrap().len() < n {
        assert!(
            Instant::now() < deadline,
            "shardwise never saw {n}: {:#?}",
            seen.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    running.shutdown(Duration::from_secs(5)).await;
    live.delete_table(&app).await;
    seen.lock().unwrap().clone()
}

async fn put(live: &support::Live, stream: &str, key: &str, headers: &Headers, payload: &[u8]) {
    live.kinesis
        .put_record()
        .stream_name(stream)
        .partition_key(key)
        .data(Blob::new(envelope::encode(headers, payload)))
        .send()
        .await
        .expect("PutRecord");
}

/// Every record of a stream, decoded by shardwise (the raw wire view).
async fn records(live: &support::Live, stream: &str) -> Vec<envelope::Decoded> {
    live.read_records(stream)
        .await
        .iter()
        .map(|r| envelope::decode(Bytes::copy_from_slice(r.data().as_ref())))
        .collect()
}

fn tenant() -> Headers {
    let mut h = Headers::new();
    h.insert("x-tenant", "acme");
    h
}

fn as_map(headers: &Headers) -> BTreeMap<String, String> {
    headers
        .iter()
        .map(|(k, v)| (k.to_owned(), String::from_utf8_lossy(v).into_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ruststream_reads_the_first_retry_copy_shardwise_wrote_as_attempt_2() {
    let live = live_or_skip!();
    let stream = support::unique_name("interop-sw-copy");
    let dlq = format!("{stream}-dlq");
    live.create_stream(&stream, 1).await;
    live.create_stream(&dlq, 1).await;
    put(&live, &stream, "k", &tenant(), b"{\"id\":1}").await;
    // shardwise retries attempt 1 once: the original and its first copy.
    let seen = run_shardwise(&live, &stream, 2, 2, Some((3, &dlq))).await;
    assert_eq!(
        seen.iter().map(|s| s.attempt).collect::<Vec<_>>(),
        [1, 2],
        "shardwise reads its own copy as attempt 2"
    );
    let wire = records(&live, &stream).await;
    assert_eq!(wire.len(), 2);
    assert_eq!(
        wire[1].headers.get_str(RETRY_COUNT_HEADER),
        Some("1"),
        "one retry before it"
    );

    let rs = run_ruststream(&stream, 0, None, |s| s.len() >= 2).await;
    assert_eq!(rs[0].attempt, 1);
    assert_eq!(rs[1].attempt, 2, "ruststream counts the copy as attempt 2");
    assert_eq!(rs[1].payload, b"{\"id\":1}");
    assert_eq!(
        rs[1].headers.get("x-tenant").map(String::as_str),
        Some("acme")
    );
    live.delete_stream(&stream).await;
    live.delete_stream(&dlq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shardwise_reads_the_first_retry_copy_ruststream_wrote_as_attempt_2() {
    let live = live_or_skip!();
    let stream = support::unique_name("interop-rs-copy");
    let dlq = format!("{stream}-dlq");
    live.create_stream(&stream, 1).await;
    live.create_stream(&dlq, 1).await;
    put(&live, &stream, "k", &tenant(), b"{\"id\":2}").await;
    // ruststream retries attempt 1 once, with a cap of 3: the original and its first copy.
    let rs = run_ruststream(&stream, 2, Some((3, &dlq)), |s| s.len() >= 2).await;
    assert_eq!(rs.iter().map(|s| s.attempt).collect::<Vec<_>>(), [1, 2]);
    let wire = records(&live, &stream).await;
    assert_eq!(wire.len(), 2, "one copy written");
    assert_eq!(wire[1].headers.get_str(RETRY_COUNT_HEADER), Some("1"));

    let sw = run_shardwise(&live, &stream, 2, 0, None).await;
    assert_eq!(sw[0].attempt, 1);
    assert_eq!(
        sw[1].attempt, 2,
        "shardwise counts ruststream's copy as attempt 2"
    );
    assert_eq!(sw[1].payload.as_ref(), b"{\"id\":2}");
    assert_eq!(sw[1].headers.get_str("x-tenant"), Some("acme"));
    live.delete_stream(&stream).await;
    live.delete_stream(&dlq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shardwise_dead_letter_decodes_in_ruststream_with_the_same_payload_and_headers() {
    let live = live_or_skip!();
    let stream = support::unique_name("interop-sw-dl");
    let dlq = format!("{stream}-dlq");
    live.create_stream(&stream, 1).await;
    live.create_stream(&dlq, 1).await;
    put(&live, &stream, "k", &tenant(), b"{\"id\":3}").await;
    // One attempt allowed: the first retry is the dead letter.
    run_shardwise(&live, &stream, 1, 2, Some((1, &dlq))).await;
    let wire = records(&live, &dlq).await;
    assert_eq!(wire.len(), 1, "one dead letter");
    let letter = &wire[0];
    assert_eq!(
        letter.headers.get_str(RETRY_COUNT_HEADER),
        Some("1"),
        "of attempt 1"
    );
    assert_eq!(letter.headers.get_str(ATTEMPTS_HEADER), Some("1"));
    assert!(letter.headers.get_str(DEAD_LETTER_REASON_HEADER).is_some());
    assert!(letter.headers.get_str(ORIGIN_SEQUENCE_HEADER).is_some());
    assert!(letter.headers.get_str(ORIGIN_SHARD_HEADER).is_some());

    let rs = run_ruststream(&dlq, 0, None, |s| !s.is_empty()).await;
    assert_eq!(rs[0].payload, b"{\"id\":3}", "the payload byte for byte");
    let mut theirs = rs[0].headers.clone();
    for injected in READER_HEADERS {
        theirs.remove(injected);
    }
    assert_eq!(
        theirs,
        as_map(&letter.headers),
        "every header shardwise wrote"
    );
    assert_eq!(
        rs[0].attempt, 2,
        "as a delivery, the dead letter of attempt 1 is attempt 2"
    );
    live.delete_stream(&stream).await;
    live.delete_stream(&dlq).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ruststream_dead_letter_decodes_in_shardwise_with_the_same_payload_and_headers() {
    let live = live_or_skip!();
    let stream = support::unique_name("interop-rs-dl");
    let dlq = format!("{stream}-dlq");
    live.create_stream(&stream, 1).await;
    live.create_stream(&dlq, 1).await;
    put(&live, &stream, "k", &tenant(), b"{\"id\":4}").await;
    // Two attempts allowed: the original, its copy, then the dead letter of attempt 2.
    let rs = run_ruststream(&stream, 3, Some((2, &dlq)), |s| s.len() >= 2).await;
    assert_eq!(rs.iter().map(|s| s.attempt).collect::<Vec<_>>(), [1, 2]);
    let wire = records(&live, &dlq).await;
    assert_eq!(wire.len(), 1, "one dead letter");
    assert_eq!(
        wire[0].headers.get_str(RETRY_COUNT_HEADER),
        Some("2"),
        "of attempt 2"
    );

    let sw = run_shardwise(&live, &dlq, 1, 0, None).await;
    assert_eq!(
        sw[0].payload.as_ref(),
        b"{\"id\":4}",
        "the payload byte for byte"
    );
    assert_eq!(
        as_map(&sw[0].headers),
        as_map(&wire[0].headers),
        "every header ruststream wrote"
    );
    assert_eq!(sw[0].headers.get_str("x-tenant"), Some("acme"));
    assert_eq!(
        sw[0].attempt, 3,
        "as a delivery, the dead letter of attempt 2 is attempt 3"
    );
    live.delete_stream(&stream).await;
    live.delete_stream(&dlq).await;
}
