#![allow(missing_docs)] // criterion_group! generates undocumented items.
//! Benchmarks: per-check cost of each algorithm through `MemoryStore`, for one hot key and for 10,000 keys.
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

criterion_group! {
    name = benches;
    config = Criterion::default();
    targets = bench
}
criterion_main!(benches);
