//! Eight lanes per shard with per-key ordering: parallel handlers, and each partition key's
//! records still handled one at a time, in order.
//!
//! What order is kept:
//! - **Per partition key, inside a shard:** the key's hash picks one of the shard's lanes and each
//!   lane runs its deliveries one at a time, in shard order. So the records of one key are handled
//!   sequentially, oldest first: the next starts only after the handler returned for the previous.
//! - **Across resharding:** a child shard is read only after its parents were handled to their
//!   end, so a key's order survives splits and merges.
//!
//! What is not kept: order between different keys (up to 8 of them run at once per shard), and
//! order between shards (each is read on its own). The checkpoint is independent of lane
//! progress: it only ever covers the contiguous run of settled records, so a fast lane never moves
//! it past a record a slow lane is still handling.
//!
//! `shardwise put` writes `{"id":N}` with key `key-{N % KEYS}`, ids increasing per key, so this
//! example checks the order it sees. Against the local emulators:
//!
//! ```sh
//! envs=$(scripts/emulators start) && eval "$envs"
//! cargo run -p shardwise-cli -- stream create ordered --shards 2 && cargo run -p shardwise-cli -- put --stream ordered --count 2000
//! cargo run --example ordered_lanes -- ordered
//! ```
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shardwise::{Consumer, Delivery, DeliveryOrder, Outcome};

/// `N` from a `{"id":N}` payload.
fn id(payload: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(payload).ok()?;
    let rest = text.split_once("\"id\":")?.1.trim_start();
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let stream = std::env::args()
        .nth(1)
        .ok_or("usage: ordered_lanes STREAM")?;
    // The last id handled per key; shared by every lane of every shard.
    let last: Arc<Mutex<HashMap<String, u64>>> = Arc::default();

    let seen = last.clone();
    let handler = move |d: Delivery| {
        let seen = seen.clone();
        async move {
            let Some(id) = id(d.payload()) else {
                return Outcome::Drop; // not ours: let the checkpoint pass it
            };
            // Uneven work, so lanes overtake each other; a key's records still never do.
            tokio::time::sleep(Duration::from_millis(id % 7)).await;
            let previous = seen.lock().unwrap().insert(d.partition_key().into(), id);
            let order = match previous {
                Some(p) if p > id => "OUT OF ORDER",
                _ => "in order",
            };
            println!(
                "{} lane {} {} id {id} {order}",
                d.shard(),
                d.lane(),
                d.partition_key()
            );
            Outcome::Ack
        }
    };

    let running = Consumer::builder(stream, "ordered-lanes", handler)
        .lanes(8)
        .ordering(DeliveryOrder::PerKey) // the default, spelled out; DeliveryOrder::None: any idle lane
        .build()?
        .run()
        .await?;
    tokio::signal::ctrl_c().await?;
    running.shutdown(Duration::from_secs(10)).await;
    eprintln!("{} keys seen", last.lock().unwrap().len());
    Ok(())
}
