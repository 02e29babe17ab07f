//! The `observability` feature from a library user's side: the `metrics_and_health` example (a
//! consumer with `Metrics` and `Endpoints`, as the README shows) runs against the emulators,
//! its lease table reached through a proxy the test can block. `/metrics` counts what was
//! handled, `/healthz` and `/readyz` answer 200, then 503 naming the lease table while it does
//! not answer, then 200 again; the EMF lines it wrote carry the documented names, units and
//! dimensions.

mod support;

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_kinesis::primitives::Blob;
use serde_json::Value;
use support::proxy::Proxy;
use support::wait::wait_for_async;
use tokio::io::{AsyncBufReadExt, BufReader};

/// The example's executable, built beside this test by `cargo test --all-targets` (as
/// scripts/test does), else built here.
fn example(name: &str) -> std::path::PathBuf {
    let deps = std::env::current_exe().unwrap();
    let exe = deps
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name);
    if !exe.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = std::process::Command::new(cargo)
            .args(["build", "--features", "observability", "--example", name])
            .status()
            .expect("cargo");
        assert!(status.success(), "building the example {name}");
    }
    exe
}

/// Status and body of `GET path` (0 and empty when nothing answers).
async fn get(port: u16, path: &str) -> (u16, String) {
    match reqwest::get(format!("http://127.0.0.1:{port}{path}")).await {
        Ok(response) => {
            let status = response.status().as_u16();
            (status, response.text().await.unwrap_or_default())
        }
        Err(_) => (0, String::new()),
    }
}

/// The sum of the Prometheus samples of `name` whose labels include `label`.
fn sum(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(label))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_library_consumer_serves_metrics_and_health_and_is_unhealthy_while_its_lease_table_is_unreachable()
 {
    let live = live_or_skip!();
    let stream = support::unique_name("observe");
    let app = support::unique_name("observe-app");
    live.create_stream(&stream, 2).await;
    let n = 120u64;
    for i in 0..n {
        live.kinesis
            .put_record()
            .stream_name(&stream)
            .partition_key(format!("k{}", i % 8))
            .data(Blob::new(format!("{{\"id\":{i}}}")))
            .send()
            .await
            .expect("put");
    }
    let dynamodb = std::env::var("AWS_ENDPOINT_URL_DYNAMODB").unwrap();
    let proxy = Proxy::start(&dynamodb).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = tokio::process::Command::new(example("metrics_and_health"))
        .args([&stream, &format!("127.0.0.1:{port}"), &app])
        .env("AWS_ENDPOINT_URL_DYNAMODB", &proxy.url)
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the example starts");
    let lines: Arc<Mutex<Vec<String>>> = Arc::default();
    let (stderr, kept) = (child.stderr.take().unwrap(), lines.clone());
    tokio::spawn(async move {
        let mut reader = BufReader::new(stderr).lines();
        while let Ok(Some(line)) = reader.next_line().await {
            kept.lock().unwrap().push(line);
        }
    });

    // Every record handled, as /metrics counts.
    let metrics = Arc::new(Mutex::new(String::new()));
    let seen = metrics.clone();
    wait_for_async(
        "every record counted on /metrics",
        Duration::from_secs(90),
        || {
            let seen = seen.clone();
            async move {
                let (_, text) = get(port, "/metrics").await;
                let done = sum(&text, "shardwise_records_total", "outcome=\"ack\"") as u64 == n;
                *seen.lock().unwrap() = text;
                done
            }
        },
    )
    .await;
    let text = metrics.lock().unwrap().clone();
    assert!(text.contains("shardwise_leases_held"), "{text}");
    assert!(
        text.contains("shardwise_handler_duration_seconds_bucket"),
        "{text}"
    );
    let (status, body) = get(port, "/healthz").await;
    assert_eq!(status, 200, "{body}");
    let health: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(health["ok"], true, "{body}");
    assert_eq!(health["leases_held"], 2, "{body}");
    assert_eq!(get(port, "/readyz").await.0, 200);

    // The lease table stops answering: past the lease duration (10 s), both endpoints say so.
    proxy.block();
    let unhealthy = Arc::new(Mutex::new(String::new()));
    let said = unhealthy.clone();
    wait_for_async("/healthz answers 503", Duration::from_secs(40), || {
        let said = said.clone();
        async move {
            let (status, body) = get(port, "/healthz").await;
            *said.lock().unwrap() = body;
            status == 503
        }
    })
    .await;
    let body = unhealthy.lock().unwrap().clone();
    let health: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(health["ok"], false);
    assert!(
        health["problems"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p.as_str().unwrap().starts_with("lease table not answering")),
        "{body}"
    );
    assert_eq!(get(port, "/readyz").await.0, 503);

    // Reachable again: healthy again.
    proxy.unblock();
    wait_for_async(
        "/healthz answers 200 again",
        Duration::from_secs(40),
        || async move { get(port, "/healthz").await.0 == 200 },
    )
    .await;

    // A graceful stop writes the last interval's EMF documents.
    let pid = child.id().unwrap().to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("stops within 30 s")
        .unwrap();
    assert!(status.success(), "{status}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let documents: Vec<Value> = lines
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains("\"_aws\""))
        .map(|l| serde_json::from_str(l).expect("an EMF line is one JSON document"))
        .collect();
    assert!(
        !documents.is_empty(),
        "no EMF lines: {:?}",
        lines.lock().unwrap()
    );
    let mut processed = 0u64;
    let mut units = std::collections::BTreeMap::new();
    for document in &documents {
        let directive = &document["_aws"]["CloudWatchMetrics"][0];
        assert_eq!(directive["Namespace"], "shardwise");
        assert!(document["_aws"]["Timestamp"].as_u64().unwrap() > 1_700_000_000_000);
        let dimensions = directive["Dimensions"][0].as_array().unwrap();
        assert_eq!(dimensions[0], "application", "{document}");
        assert_eq!(document["application"], app.as_str());
        for dimension in dimensions {
            assert!(
                document[dimension.as_str().unwrap()].is_string(),
                "{document}"
            );
        }
        for metric in directive["Metrics"].as_array().unwrap() {
            let name = metric["Name"].as_str().unwrap().to_string();
            assert!(!document[&name].is_null(), "{name} has a value: {document}");
            units.insert(name, metric["Unit"].as_str().unwrap().to_string());
        }
        if document["outcome"] == "ack" {
            processed += document["RecordsProcessed"].as_u64().unwrap_or(0);
        }
    }
    assert_eq!(
        processed, n,
        "RecordsProcessed{{outcome=ack}} over the documents"
    );
    for (name, unit) in [
        ("RecordsProcessed", "Count"),
        ("MillisBehindLatest", "Milliseconds"),
        ("CurrentLeases", "Count"),
        ("shardwise_handler_duration_seconds", "Seconds"),
    ] {
        assert_eq!(
            units.get(name).map(String::as_str),
            Some(unit),
            "{name}: {units:?}"
        );
    }
    live.delete_stream(&stream).await;
}
