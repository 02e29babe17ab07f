//! Benchmarks of shardwise; see `benches/`. What every bench shares.

/// With `RUST_LOG` set, prints the library's log to stderr (`RUST_LOG=shardwise=debug`).
pub fn log_from_env() {
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
}
