//! The `shardwise` command-line tool: consume a stream, write test records, inspect lease tables,
//! and create, reshard, describe and delete streams.
//!
//! Endpoints, region and credentials come only from the standard AWS environment
//! (`AWS_REGION`, `AWS_ENDPOINT_URL_KINESIS`, `AWS_PROFILE`, ...). Logs go to stderr (filter with
//! `RUST_LOG`, default `warn`); command output goes to stdout. A failure prints `error: ...` with
//! its causes to stderr and exits with status 1.
//!
//! Adding a subcommand: one variant in [`Command`], one module with
//! `pub(crate) async fn run(args, &Ctx) -> common::Result<()>`, one arm in [`dispatch`].

mod common;
mod consume;
mod exec;
mod flag_error;
mod frontier;
mod import_kcl;
mod leases;
mod observe;
mod put;
mod receipts;
mod seek;
mod stream;
mod table_flags;
mod target;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::common::{Ctx, ENVIRONMENT_HELP};

/// Kinesis consumer framework tooling: write records, inspect leases, manage streams.
#[derive(Debug, Parser)]
#[command(
    name = "shardwise",
    version,
    propagate_version = true,
    after_help = ENVIRONMENT_HELP
)]
struct Cli {
    /// How log lines on stderr are written: `text` for people, `json` (one JSON object per line,
    /// with its fields and spans) for CloudWatch Logs, Fluent Bit or Loki.
    #[arg(
        long,
        global = true,
        env = "SHARDWISE_LOG_FORMAT",
        value_name = "text|json",
        default_value = "text"
    )]
    log_format: common::LogFormat,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Consume a stream with leases and checkpoints, printing one JSON line per handled delivery.
    #[command(after_help = ENVIRONMENT_HELP)]
    Consume(Box<consume::Args>),
    /// Write numbered JSON records `{"id": N}` to a stream, in order per partition key.
    Put(put::Args),
    /// Show the lease table of an application (named after the application unless
    /// --lease-table names it).
    Leases(leases::Args),
    /// Show an application's receipt ledger, or release or quarantine a held event.
    Receipts(receipts::Args),
    /// Move an application's checkpoints of a stream (backwards too), running or not.
    Seek(seek::Args),
    /// How far the whole stream is complete: the scalar frontier, its epoch, the per-shard vector.
    Frontier(frontier::Args),
    /// Import a KCL 2.x/3.x application's lease table: each shard of the stream gets a shardwise
    /// row at KCL's committed checkpoint, with its lineage (the KCL table is only read).
    ImportKcl(import_kcl::Args),
    /// Create, reshard, describe or delete a stream.
    #[command(subcommand)]
    Stream(stream::Command),
}

async fn dispatch(command: Command, ctx: &Ctx) -> common::Result<()> {
    match command {
        Command::Consume(args) => consume::run(*args, ctx).await,
        Command::Put(args) => put::run(args, ctx).await,
        Command::Seek(args) => seek::run(args, ctx).await,
        Command::Frontier(args) => frontier::run(args, ctx).await,
        Command::Leases(args) => leases::run(args, ctx).await,
        Command::Receipts(args) => receipts::run(args, ctx).await,
        Command::ImportKcl(args) => import_kcl::run(args, ctx).await,
        Command::Stream(command) => stream::run(command, ctx).await,
    }
}

/// A consumer's deliveries are made by one task and dropped by another, on whichever of the
/// runtime's threads each runs: glibc's malloc then spends much of its time on the locks of its
/// per-thread arenas, mimalloc does not. The paged part of the consumer bench (every part of the
/// process on one allocator, its in-process event server included): 1,040 ns of CPU an event on
/// mimalloc, 1,920 ns on the system allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    common::init_logging(cli.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => return common::report(&err.into()),
    };
    let result = runtime.block_on(async {
        let ctx = Ctx::load().await?;
        dispatch(cli.command, &ctx).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => common::report(&err),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }
}
