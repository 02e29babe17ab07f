//! Benchmarks of shardwise; see `benches/`.
