#![allow(missing_docs)] // criterion_group! generates undocumented items.
//! `RedisStore` throughput against a throw-away local `redis-server` (BENCHMARKS.md): 64 tasks
//! keep requests in flight on one multiplexed connection, over 1,000 keys. Beside it, on the same
//! server and connection setup: plain `INCR` (the target's yardstick), a trivial `EVALSHA` (the
//! ceiling of any script) and a script that only `GET`s and `SET`s one key (the ceiling of any
//! script that keeps state). Time per request; criterion also reports requests/s.
//!
//! `cargo bench --bench redis --features redis` (needs `redis-server` on `PATH`).

#[path = "../tests/support/redis.rs"]
#[allow(dead_code, unreachable_pub)]
mod redis_server;

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tollgate::clock::MonotonicClock;
use tollgate::key::Key;
use tollgate::store::RedisStore;
use tollgate::{Limiter, Policy, Quota};

const TASKS: u64 = 64;
const KEYS: u64 = 1_000;

/// Runs `iters` calls of `op(i)` from `TASKS` tasks; returns the wall time.
fn concurrently<F, Fut>(rt: &tokio::runtime::Runtime, iters: u64, op: F) -> Duration
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let per = iters.div_ceil(TASKS);
    rt.block_on(async {
        let start = Instant::now();
        let tasks: Vec<_> = (0..TASKS)
            .map(|t| {
                let op = Arc::clone(&op);
                tokio::spawn(async move {
                    for i in 0..per {
                        op(t * 7_919 + i).await;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("task");
        }
        start.elapsed().mul_f64(iters as f64 / (per * TASKS) as f64)
    })
}

fn policy(tiers: usize) -> Policy {
    let mut b = Policy::builder(format!("bench{tiers}"));
    // Rates no benchmark exhausts: the allowed path, as in the memory benchmarks.
    b = b.tier("second", Quota::per_second(1_000_000_000));
    if tiers > 1 {
        b = b.tier("hour", Quota::per_hour(4_000_000_000));
    }
    b.build().expect("valid")
}

fn bench(c: &mut Criterion) {
    let Some(server) = redis_server::Server::start("redis-server") else { return };
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let keys: Arc<Vec<Key>> = Arc::new((0..KEYS).map(|i| Key::text(format!("user-{i}"))).collect());
    let mut g = c.benchmark_group("redis");
    g.throughput(Throughput::Elements(1));
    g.sample_size(20).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));

    // The yardsticks, on a connection set up like RedisStore's.
    let conn = rt.block_on(async {
        let client = redis::Client::open(server.url()).unwrap();
        let config = ConnectionManagerConfig::new().set_number_of_retries(0);
        ConnectionManager::new_with_config(client, config).await.unwrap()
    });
    g.bench_function("incr", |b| {
        b.iter_custom(|iters| {
            let conn = conn.clone();
            concurrently(&rt, iters, move |i| {
                let mut conn = conn.clone();
                async move {
                    let _: i64 = redis::cmd("INCR")
                        .arg(format!("incr:{}", i % KEYS))
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                }
            })
        });
    });
    let trivial = Arc::new(redis::Script::new("return 1"));
    g.bench_function("evalsha_trivial", |b| {
        b.iter_custom(|iters| {
            let (conn, script) = (conn.clone(), Arc::clone(&trivial));
            concurrently(&rt, iters, move |i| {
                let (mut conn, script) = (conn.clone(), Arc::clone(&script));
                async move {
                    let _: i64 = script
                        .key(format!("trivial:{}", i % KEYS))
                        .invoke_async(&mut conn)
                        .await
                        .unwrap();
                }
            })
        });
    });

    // The ceiling of any script that reads and writes a key: GET, then SET with a TTL.
    let getset = Arc::new(redis::Script::new(
        "redis.call('GET', KEYS[1]); redis.call('SET', KEYS[1], '1:2', 'PX', 1000); return 1",
    ));
    g.bench_function("evalsha_get_set", |b| {
        b.iter_custom(|iters| {
            let (conn, script) = (conn.clone(), Arc::clone(&getset));
            concurrently(&rt, iters, move |i| {
                let (mut conn, script) = (conn.clone(), Arc::clone(&script));
                async move {
                    let _: i64 = script
                        .key(format!("getset:{}", i % KEYS))
                        .invoke_async(&mut conn)
                        .await
                        .unwrap();
                }
            })
        });
    });

    for (name, clock) in [("server_time", false), ("client_clock", true)] {
        let mut builder = RedisStore::builder(server.url()).timeout(Duration::from_secs(10));
        if clock {
            builder = builder.clock(MonotonicClock::new());
        }
        let store = builder.build().unwrap();
        rt.block_on(store.connect()).unwrap();
        for tiers in [1, 2] {
            let limiter = Limiter::with_store(policy(tiers), store.clone()).unwrap();
            g.bench_function(BenchmarkId::new(format!("gcra_{tiers}_tier"), name), |b| {
                b.iter_custom(|iters| {
                    let (limiter, keys) = (limiter.clone(), Arc::clone(&keys));
                    concurrently(&rt, iters, move |i| {
                        let (limiter, keys) = (limiter.clone(), Arc::clone(&keys));
                        async move {
                            let key = &keys[(i % KEYS) as usize];
                            assert!(limiter.check(key, 1).await.unwrap().is_allowed());
                        }
                    })
                });
            });
        }
    }
    g.finish();
    drop(server);
}

criterion_group!(benches, bench);
criterion_main!(benches);
