#![allow(missing_docs)] // criterion_group! generates undocumented items.
//! The cost of a concurrency tier and of a calendar tier next to a GCRA tier, per check:
//!
//! - `kinds/memory/*`: `MemoryStore`, 10,000 keys, one check at a time on a fake clock moving
//!   1 ms per check (the admitting path). A concurrency slot is taken and released per check.
//! - `kinds/redis/*` (with the `redis` feature and `redis-server` on `PATH`): `RedisStore`
//!   against a throw-away local server, 64 tasks keeping checks in flight on one connection,
//!   over 10,000 keys. A concurrency slot costs two calls: taken, then released.
//!
//! Cases: `gcra` (one GCRA tier: the compact path in memory, `gcra.lua` on Redis),
//! `gcra+rate` (a second, hourly rate tier: the yardstick of what another tier costs; its
//! state expires about a millisecond after each check, so it is never read back), `gcra+day`
//! (a second rate tier of 10,000 a day, whose state lives 8.64 s per unit spent and is read
//! back by every later check, as a calendar tier's is), `gcra+concurrency`, `gcra+calendar` (a
//! daily quota in Europe/Berlin), `gcra+penalty` (the GCRA tier with a penalty box, never
//! breached: the cost of keeping one), `concurrency`, `calendar`.
//!
//! After the timed Redis runs, the server's CPU per check is measured for each case (200,000
//! checks over 100,000 keys, after one pass over them that creates their state): the growth
//! of `used_cpu_user + used_cpu_sys` (`INFO cpu`, the whole server: scripts, commands and
//! networking) and of the scripts' own time (`usec` of `EVALSHA` in `INFO commandstats`), per
//! check, a concurrency check counting its release, printed as `kinds/cpu/...` lines with the
//! ratio to the first case measured. A filter matching no timed bench (`-- kinds/cpu`) runs
//! only this part, and one naming cases (`-- kinds/cpu/gcra+`) only those.
//!
//! `cargo bench --bench kinds [--features redis]`

#[cfg(feature = "redis")]
#[path = "../tests/support/redis.rs"]
#[allow(dead_code, unreachable_pub)]
mod redis_server;

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use tollgate::clock::FakeClock;
use tollgate::key::Key;
use tollgate::store::{Check, MemoryStore};
use tollgate::{Calendar, Concurrency, Penalty, Policy, Quota};

const KEYS: u64 = 10_000;

/// The policies compared, by name: each admits every check of the runs.
fn policies() -> Vec<(&'static str, Policy)> {
    let gcra = || Quota::per_second(1_000_000).with_burst(1_000_000);
    let slots = || Concurrency::new(1_000);
    let daily = || Calendar::per_day(4_000_000_000).in_time_zone("Europe/Berlin");
    let hourly = || Quota::per_hour(4_000_000_000).with_burst(4_000_000_000);
    let build = |b: tollgate::PolicyBuilder| b.build().expect("valid policy");
    vec![
        ("gcra", build(Policy::builder("g").tier("rate", gcra()))),
        ("gcra+rate", build(Policy::builder("gr").tier("rate", gcra()).tier("hour", hourly()))),
        (
            "gcra+day",
            build(Policy::builder("gy").tier("rate", gcra()).tier("day", Quota::per_day(10_000))),
        ),
        (
            "gcra+concurrency",
            build(Policy::builder("gc").tier("rate", gcra()).concurrency("slots", slots())),
        ),
        (
            "gcra+calendar",
            build(Policy::builder("gd").tier("rate", gcra()).calendar("day", daily())),
        ),
        (
            "gcra+penalty",
            build(
                Policy::builder("gp")
                    .tier("rate", gcra())
                    .penalty("rate", Penalty::new(Duration::from_secs(900))),
            ),
        ),
        ("concurrency", build(Policy::builder("c").concurrency("slots", slots()))),
        ("calendar", build(Policy::builder("d").calendar("day", daily()))),
    ]
}

fn keys() -> Vec<Key> {
    (0..KEYS).map(|i| Key::text(format!("user-{i}"))).collect()
}

fn memory(c: &mut Criterion) {
    let ids = keys();
    let mut g = c.benchmark_group("kinds/memory");
    for (name, policy) in policies() {
        let clock = FakeClock::new();
        clock.set(1_750_000_000_000_000_000);
        let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let bound = store.bind_policy(&policy);
        let mut n = 0usize;
        g.bench_function(name, |b| {
            b.iter(|| {
                clock.advance(Duration::from_millis(1));
                n = (n + 1) % ids.len();
                let verdict = store.check_now(&bound, Check::new(&ids[n], 1));
                assert!(verdict.decision.is_allowed());
                // A slot's ticket releases it when dropped: taken and given back.
                black_box(verdict)
            });
        });
    }
    g.finish();
}

#[cfg(feature = "redis")]
fn redis(c: &mut Criterion) {
    use std::sync::Arc;
    use std::time::Instant;

    use tollgate::Limiter;
    use tollgate::store::RedisStore;

    const TASKS: u64 = 64;
    /// Keys of the server CPU measurement (as `benches/redis.rs`).
    const CPU_KEYS: u64 = 100_000;
    let Some(server) = redis_server::Server::start("redis-server") else { return };
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let ids = Arc::new(keys());
    let store = RedisStore::builder(server.url()).timeout(Duration::from_secs(10)).build().unwrap();
    rt.block_on(store.connect()).unwrap();
    let mut g = c.benchmark_group("kinds/redis");
    g.sample_size(20).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    for (name, policy) in policies() {
        let limiter = Limiter::with_store(policy, store.clone()).unwrap();
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let per = iters.div_ceil(TASKS);
                rt.block_on(async {
                    let start = Instant::now();
                    let tasks: Vec<_> = (0..TASKS)
                        .map(|t| {
                            let (limiter, ids) = (limiter.clone(), Arc::clone(&ids));
                            tokio::spawn(async move {
                                for i in 0..per {
                                    let key = &ids[((t * 7_919 + i * 64) % KEYS) as usize];
                                    // Takes a slot and gives it back before returning.
                                    let d = limiter.check(key, 1).await.unwrap();
                                    assert_eq!(d.source(), tollgate::Source::Store);
                                    assert!(d.is_allowed());
                                }
                            })
                        })
                        .collect();
                    for t in tasks {
                        t.await.expect("task");
                    }
                    start.elapsed().mul_f64(iters as f64 / (per * TASKS) as f64)
                })
            });
        });
    }
    g.finish();

    // The server's CPU per check, per case.
    let ids: Arc<Vec<Key>> =
        Arc::new((0..CPU_KEYS).map(|i| Key::text(format!("cpu-{i}"))).collect());
    let run = |limiter: &Limiter<RedisStore>, n: u64| {
        let per = n.div_ceil(TASKS);
        rt.block_on(async {
            let tasks: Vec<_> = (0..TASKS)
                .map(|t| {
                    let (limiter, ids) = (limiter.clone(), Arc::clone(&ids));
                    tokio::spawn(async move {
                        for i in 0..per {
                            let key = &ids[((t * 7_919 + i * 64) % CPU_KEYS) as usize];
                            let d = limiter.check(key, 1).await.unwrap();
                            assert_eq!(d.source(), tollgate::Source::Store);
                            assert!(d.is_allowed());
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.expect("task");
            }
        });
        per * TASKS
    };
    let mut inspect = server.conn();
    let mut base = None;
    // A filter naming some `kinds/cpu/...` cases measures only them.
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    for (name, policy) in policies() {
        if filter.as_ref().is_some_and(|f| !format!("kinds/cpu/{name}").contains(f.as_str())) {
            continue;
        }
        let limiter = Limiter::with_store(policy, store.clone()).unwrap();
        run(&limiter, CPU_KEYS);
        let (cpu, (calls, usec)) = (server_cpu(&mut inspect), evalsha(&mut inspect));
        let start = Instant::now();
        let n = run(&limiter, 200_000);
        let wall = start.elapsed().as_secs_f64();
        let cpu = (server_cpu(&mut inspect) - cpu) * 1e6 / n as f64;
        let (calls2, usec2) = evalsha(&mut inspect);
        let script = (usec2 - usec) as f64 / n as f64;
        let batch = n as f64 / (calls2 - calls).max(1) as f64;
        let (b_cpu, b_script) = *base.get_or_insert((cpu, script));
        println!(
            "kinds/cpu/{name:<17} server CPU {cpu:6.2} µs ({:4.2}x), scripts {script:6.2} µs \
             ({:4.2}x) per check; {batch:5.1} checks per script call; {:7.0} checks/s",
            cpu / b_cpu,
            script / b_script,
            n as f64 / wall,
        );
    }
    drop(server);
}

/// `used_cpu_user + used_cpu_sys` of the server, in seconds.
#[cfg(feature = "redis")]
fn server_cpu(conn: &mut redis::Connection) -> f64 {
    let info: String = redis::cmd("INFO").arg("cpu").query(conn).expect("INFO cpu");
    ["used_cpu_user:", "used_cpu_sys:"]
        .iter()
        .filter_map(|f| info.lines().find_map(|l| l.strip_prefix(f))?.trim().parse::<f64>().ok())
        .sum()
}

/// Script calls and their time (µs) so far: `calls` and `usec` of `EVALSHA` in
/// `INFO commandstats`.
#[cfg(feature = "redis")]
fn evalsha(conn: &mut redis::Connection) -> (u64, u64) {
    let info: String = redis::cmd("INFO").arg("commandstats").query(conn).expect("INFO");
    let Some(line) = info.lines().find_map(|l| l.strip_prefix("cmdstat_evalsha:")) else {
        return (0, 0);
    };
    let field = |name: &str| {
        line.split(',').find_map(|f| f.strip_prefix(name)?.parse::<u64>().ok()).unwrap_or(0)
    };
    (field("calls="), field("usec="))
}

#[cfg(not(feature = "redis"))]
fn redis(_: &mut Criterion) {}

criterion_group!(benches, memory, redis);
criterion_main!(benches);
