#![allow(missing_docs)] // criterion_group! generates undocumented items.
//! Benchmarks: per-check cost of each algorithm through `MemoryStore`, for one hot key and for 10,000 keys;
//! and a rejected sliding-log check on a full log of 100 and of 10,000 entries (the larger may cost
//! at most 3x the smaller: the log is searched, never scanned).
//!
//! `cargo bench --bench algorithms`

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use tollgate::clock::FakeClock;
use tollgate::key::Key;
use tollgate::store::{Check, MemoryStore};
use tollgate::{Algorithm, Policy, Quota};

fn bench(c: &mut Criterion) {
    for alg in Algorithm::ALL {
        let policy = Policy::builder("p")
            .tier("t", Quota::per_second(1000))
            .algorithm(alg)
            .build()
            .expect("valid policy");
        for keys in [1u32, 10_000] {
            let clock = FakeClock::new();
            let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
            let bound = store.bind_policy(&policy);
            let ids: Vec<Key> =
                (0..keys).map(|i| Key::Ip(IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i)))).collect();
            let mut n = 0usize;
            c.bench_function(&format!("check/{}/{keys}_keys", alg.name()), |b| {
                b.iter(|| {
                    // 1 ms per check: below the rate, so the allowed path is measured.
                    clock.advance(Duration::from_millis(1));
                    n = (n + 1) % ids.len();
                    black_box(store.check_now(&bound, Check::new(&ids[n], 1)))
                });
            });
        }
    }
}

/// A hot key refused over and over on a full sliding log of `limit` entries per hour: one
/// entry per second-or-less over its first half hour, checked at 40 minutes (nothing expires
/// during the run: the clock moves 1 ns per check).
fn log_rejection(c: &mut Criterion) {
    let mut group = c.benchmark_group("sliding_log_rejection");
    for limit in [100u64, 10_000] {
        let hour = Duration::from_secs(3600);
        let policy = Policy::builder("log")
            .algorithm(Algorithm::SlidingLog)
            .tier("t", Quota::new(limit, hour))
            .build()
            .expect("valid policy");
        let clock = FakeClock::new();
        clock.set(1_700_000_000_000_000_000);
        let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let bound = store.bind_policy(&policy);
        let key = Key::text("hot");
        let spacing = Duration::from_secs(1800) / u32::try_from(limit).unwrap();
        for _ in 0..limit {
            assert!(store.check_now(&bound, Check::new(&key, 1)).decision.is_allowed());
            clock.advance(spacing);
        }
        clock.advance(Duration::from_secs(600));
        assert!(!store.check_now(&bound, Check::new(&key, 1)).decision.is_allowed());
        group.bench_function(format!("limit_{limit}"), |b| {
            b.iter(|| {
                clock.advance(Duration::from_nanos(1));
                let v = store.check_now(&bound, Check::new(&key, 1));
                debug_assert!(!v.decision.is_allowed());
                black_box(v)
            });
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default();
    targets = bench, log_rejection
}
criterion_main!(benches);
