//! Nanoseconds per settlement with 1,000 / 100,000 / 1,000,000 deliveries in flight, settled in
//! arrival order and in random order. Criterion reports time per element (one settlement).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use shardwise::track::Tracker;
use shardwise::{DeliveryId, Position, SequenceNumber};

/// A tracker holding `n` unsettled deliveries with realistic 56-digit positions.
fn filled(n: usize, rng: &mut SmallRng) -> (Tracker<Position>, Vec<DeliveryId>) {
    let prefix: u128 = rng.random_range(10u128.pow(30)..10u128.pow(31));
    let mut tracker = Tracker::new(1);
    let ids = (0..n)
        .map(|i| {
            let seq = SequenceNumber::parse(&format!("{prefix}{:025}", i)).expect("digits");
            tracker.track(Position::new(seq, 0))
        })
        .collect();
    (tracker, ids)
}

fn settle_all(c: &mut Criterion) {
    let mut group = c.benchmark_group("settle");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(5));
    for n in [1_000usize, 100_000, 1_000_000] {
        group.throughput(Throughput::Elements(n as u64));
        for order in ["in_order", "random"] {
            group.bench_with_input(BenchmarkId::new(order, n), &n, |b, &n| {
                let mut rng = SmallRng::seed_from_u64(42);
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let (mut tracker, mut ids) = filled(n, &mut rng);
                        if order == "random" {
                            ids.shuffle(&mut rng);
                        }
                        let start = Instant::now();
                        for id in ids {
                            black_box(tracker.settle(id));
                        }
                        total += start.elapsed();
                        assert!(tracker.is_drained());
                    }
                    total
                });
            });
        }
    }
    group.finish();
}

criterion_group!(benches, settle_all);
criterion_main!(benches);
