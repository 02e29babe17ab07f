//! Interop tests of shardwise against other implementations of its wire formats; see `tests/`.
