//! Metrics and health for a consumer (feature `observability`): Prometheus text on `/metrics`,
//! `/healthz` and `/readyz` on one address, and CloudWatch Embedded Metric Format lines on
//! stderr every 60 s (and at the end), which the CloudWatch agent or Fluent Bit turn into
//! metrics. SIGTERM or ctrl-c stops it gracefully.
//!
//! ```sh
//! envs=$(scripts/emulators start) && eval "$envs"
//! cargo run -p shardwise-cli -- stream create orders --shards 2
//! cargo run -p shardwise-cli -- put --stream orders --count 100
//! cargo run --features observability --example metrics_and_health -- orders 127.0.0.1:9100
//! curl -s localhost:9100/metrics | grep shardwise_records_total
//! curl -s localhost:9100/healthz
//! ```
use std::net::SocketAddr;
use std::time::Duration;

use shardwise::observe::{Emf, Endpoints, Metrics};
use shardwise::{Consumer, Delivery, Outcome};
use tokio::signal::unix::{SignalKind, signal};

const USAGE: &str = "usage: metrics_and_health STREAM [ADDR (default 0.0.0.0:9100)] [APP]";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let stream = args.next().ok_or(USAGE)?;
    let addr: SocketAddr = args.next().as_deref().unwrap_or("0.0.0.0:9100").parse()?;
    let app = args.next().unwrap_or_else(|| "metrics-example".into());

    // The recorder first, so that every metric from the start is recorded: without one, the
    // library's metrics are dropped.
    let metrics = Metrics::builder()
        .prometheus()
        .emf(Emf::new("shardwise").dimension("application", &app))
        .install()?;
    let endpoints = Endpoints::new(&metrics);
    let bound = endpoints.serve(addr).await?;
    eprintln!("serving http://{bound}/metrics, /healthz and /readyz");

    let consumer = Consumer::builder(stream, app, |_: Delivery| async { Outcome::Ack }).build()?;
    let running = consumer.run().await?;
    endpoints.watch(&running);

    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    running.shutdown(Duration::from_secs(10)).await;
    metrics.flush_emf()?; // the last interval's documents
    Ok(())
}
