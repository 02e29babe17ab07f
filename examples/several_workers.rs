//! Several workers of one application share a stream through the lease table: each shard is held
//! by one worker at a time, and a worker that stops hands its shards to the others.
//!
//! This example runs two consumers (`worker-1`, `worker-2`) in one process and prints the lease
//! table as it changes: both workers take leases (one steals from the other until they hold about
//! as many each), then `worker-1` shuts down gracefully, releases its leases, and `worker-2` takes
//! them at its next scan. Against the local emulators:
//!
//! ```sh
//! envs=$(scripts/emulators start) && eval "$envs"
//! cargo run -p shardwise-cli -- stream create shared --shards 4 && cargo run -p shardwise-cli -- put --stream shared --count 1000
//! cargo run --example several_workers -- shared
//! ```
//!
//! Separate processes behave the same: run `cargo run -p shardwise-cli -- consume --stream shared --app APP
//! --worker-id w1` in one terminal and `... --worker-id w2` in another, and watch
//! `cargo run -p shardwise-cli -- leases --app APP`. With `kill -9` instead of a graceful stop, the other worker
//! takes the shards only once their leases expire (10 s by default); `scripts/demo` shows that.
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use aws_config::BehaviorVersion;
use shardwise::lease::{DynamoDbLeaseStore, LeaseStore};
use shardwise::{Consumer, Delivery, Outcome, Running};

const APP: &str = "several-workers";

async fn worker(
    stream: &str,
    id: &str,
    handled: Arc<AtomicU64>,
) -> Result<Running, shardwise::Error> {
    let handler = move |_d: Delivery| {
        let handled = handled.clone();
        async move {
            handled.fetch_add(1, Ordering::Relaxed);
            Outcome::Ack
        }
    };
    // Same application (so same lease table), distinct worker ids.
    let consumer = Consumer::builder(stream, APP, handler)
        .worker_id(id)
        .lanes(2)
        .build()?;
    consumer.run().await
}

async fn print_leases(
    store: &DynamoDbLeaseStore,
    stream: &str,
    when: &str,
) -> Result<(), shardwise::Error> {
    println!("-- {when}");
    for lease in store.list(stream).await? {
        let owner = lease.owner.as_deref().unwrap_or("-");
        println!(
            "   {}  owner {owner:<9} epoch {}  checkpoint {}",
            lease.shard_id, lease.owner_epoch, lease.checkpoint
        );
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let stream = std::env::args()
        .nth(1)
        .ok_or("usage: several_workers STREAM")?;
    let (n1, n2) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let w1 = worker(&stream, "worker-1", n1.clone()).await?;
    let w2 = worker(&stream, "worker-2", n2.clone()).await?;

    // The lease table is the DynamoDB table named after the application.
    let sdk = aws_config::defaults(BehaviorVersion::latest()).load().await;
    let store = DynamoDbLeaseStore::new(aws_sdk_dynamodb::Client::new(&sdk), APP);

    tokio::time::sleep(Duration::from_secs(2)).await;
    print_leases(&store, &stream, "after 2 s").await?;
    tokio::time::sleep(Duration::from_secs(6)).await;
    print_leases(&store, &stream, "after 8 s: balanced by steals").await?;
    let report = w1.shutdown(Duration::from_secs(10)).await;
    println!(
        "worker-1 stopped: released {} leases",
        report.leases_released
    );
    print_leases(&store, &stream, "right after worker-1 stopped").await?;
    tokio::time::sleep(Duration::from_secs(4)).await;
    print_leases(&store, &stream, "4 s later: worker-2 took them").await?;

    w2.shutdown(Duration::from_secs(10)).await;
    let (n1, n2) = (n1.load(Ordering::Relaxed), n2.load(Ordering::Relaxed));
    println!("handled: worker-1 {n1}, worker-2 {n2}");
    Ok(())
}
