//! Quickstart: a handler and a consumer. Prints every payload of a stream; ctrl-c stops it.
//!
//! Endpoints, region and credentials come from the standard AWS environment (`AWS_REGION`,
//! `AWS_ENDPOINT_URL_KINESIS`, ...). Against the local emulators:
//!
//! ```sh
//! envs=$(scripts/emulators start) && eval "$envs"
//! cargo run -p shardwise-cli -- stream create orders --shards 2 && cargo run -p shardwise-cli -- put --stream orders --count 100
//! cargo run --example quickstart -- orders
//! ```
use std::time::Duration;

use shardwise::{Consumer, Delivery, Outcome};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let stream = std::env::args().nth(1).ok_or("usage: quickstart STREAM")?;

    // The application name ("quickstart") names the lease table, created on first run.
    let consumer = Consumer::builder(stream, "quickstart", |d: Delivery| async move {
        let payload = String::from_utf8_lossy(d.payload());
        println!("{} {} {payload}", d.shard(), d.partition_key());
        Outcome::Ack // settled: the checkpoint may move past it
    })
    .build()?;

    let running = consumer.run().await?;
    tokio::signal::ctrl_c().await?;
    let report = running.shutdown(Duration::from_secs(10)).await;
    eprintln!("{report:?}");
    Ok(())
}
