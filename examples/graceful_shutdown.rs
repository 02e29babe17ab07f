//! Graceful shutdown: on SIGTERM or ctrl-c, stop reading, let running handlers finish, write the
//! final checkpoints and release the leases, then print the [`ShutdownReport`].
//!
//! `shutdown(deadline)` waits at most `deadline` for running handlers. Those that finish settle
//! and are checkpointed; those still running when it passes are dropped, stay unsettled and are
//! read again by the next owner (`deadline_passed: true`): a repeat, never a loss. Released
//! leases are taken by other workers at their next scan, without waiting for the lease to expire.
//!
//! Against the local emulators (the second argument is the deadline in seconds, default 10; each
//! record takes 2 s here, so a deadline of 1 shows `deadline_passed: true`):
//!
//! ```sh
//! envs=$(scripts/emulators start) && eval "$envs"
//! cargo run -p shardwise-cli -- stream create graceful --shards 2 && cargo run -p shardwise-cli -- put --stream graceful --count 50
//! cargo run --example graceful_shutdown -- graceful 10    # then ctrl-c, or kill -TERM <pid>
//! ```
use std::time::Duration;

use shardwise::{Consumer, Delivery, Outcome, ShutdownReport};

/// Waits for SIGTERM (what `kill`, systemd and Kubernetes send) or ctrl-c.
async fn stop_requested() -> std::io::Result<&'static str> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        tokio::select! {
            _ = term.recv() => Ok("SIGTERM"),
            r = tokio::signal::ctrl_c() => r.map(|()| "ctrl-c"),
        }
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await.map(|()| "ctrl-c")
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let stream = args
        .next()
        .ok_or("usage: graceful_shutdown STREAM [DEADLINE_SECONDS]")?;
    let deadline = Duration::from_secs(args.next().map(|s| s.parse()).transpose()?.unwrap_or(10));

    let handler = |d: Delivery| async move {
        tokio::time::sleep(Duration::from_secs(2)).await; // slow work, to have some in flight
        println!("handled {}", String::from_utf8_lossy(d.payload()));
        Outcome::Ack
    };
    let running = Consumer::builder(stream, "graceful-shutdown", handler)
        .lanes(4)
        .build()?
        .run()
        .await?;

    let signal = stop_requested().await?;
    let shards = running.shards().len();
    eprintln!("{signal}: stopping {shards} shards, waiting up to {deadline:?} for handlers");
    let report: ShutdownReport = running.shutdown(deadline).await;
    eprintln!(
        "shards stopped with a final checkpoint: {}",
        report.shards_stopped
    );
    eprintln!(
        "leases released:                      {}",
        report.leases_released
    );
    eprintln!(
        "deadline passed:                      {}",
        report.deadline_passed
    );
    if report.deadline_passed {
        eprintln!("(the unfinished records stay unsettled: the next owner reads them again)");
    }
    Ok(())
}
