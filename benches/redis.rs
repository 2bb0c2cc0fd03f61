#![allow(missing_docs)] // criterion_group! generates undocumented items.
//! `RedisStore` throughput against a throw-away local `redis-server` (BENCHMARKS.md): 64 tasks
//! keep checks in flight on one multiplexed connection, over 100,000 keys (quota: 10,000 per hour
//! with a large burst, so that keys keep their state between visits). Beside it, on the
//! same server and connection setup: plain `INCR` (the yardstick) and a plain Lua GCRA script
//! (one `EVALSHA` per check: `GET` the TAT, decide, `SET` it with a TTL, as most Redis rate
//! limiters do). Time per check; criterion also reports checks/s. After the timed runs, the
//! Redis server's CPU per check (`INFO cpu`) is measured for each case and written to
//! `$CRITERION_HOME/redis/cpu-<baseline>.json` (else `target/criterion/redis/cpu-latest.json`),
//! with the client's CPU per check (this process) and the checks per script call.
//!
//! Also the cost of naming a key's state (`redis_key_names`: hashed, the default, and raw),
//! and a flood of checks of one key far over its limit (`redis_refused`), with the store's
//! local refusals on (the default) and off: checks/s, then script calls per second and the
//! server's CPU per check, printed.
//!
//! `cargo bench --bench redis --features redis` (needs `redis-server` on `PATH`).

#[path = "../tests/support/redis.rs"]
#[allow(dead_code, unreachable_pub)]
mod redis_server;

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tollgate::key::Key;
use tollgate::store::{RedisStore, Store};
use tollgate::{Limiter, Policy, Quota};

const TASKS: u64 = 64;
const KEYS: u64 = 100_000;

/// The plain Lua GCRA: microsecond TAT in a string, server time.
const LUA_GCRA: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local T, tau = tonumber(ARGV[1]), tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1])) or now
if tat < now then tat = now end
local new = tat + T
if new - tau > now then return 0 end
redis.call('SET', KEYS[1], new, 'PX', math.ceil((new - now) / 1000))
return 1
";

/// One check of key `i` (modulo the key count).
type Op = Arc<
    dyn Fn(u64) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> + Send + Sync,
>;

/// Runs `iters` calls of `op(i)` from `TASKS` tasks; returns the wall time.
fn concurrently(rt: &tokio::runtime::Runtime, iters: u64, op: &Op) -> Duration {
    let per = iters.div_ceil(TASKS);
    rt.block_on(async {
        let start = Instant::now();
        let tasks: Vec<_> = (0..TASKS)
            .map(|t| {
                let op = Arc::clone(op);
                tokio::spawn(async move {
                    for i in 0..per {
                        op(t * 7_919 + i * 64).await;
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

/// 10,000 per hour with a burst no run exhausts (the admitting path): every key keeps live
/// state between its visits (a TTL of hours), as the keys of active clients do, rather than
/// expiring in between and being created again.
fn policy(tiers: usize) -> Policy {
    let mut b = Policy::builder(format!("bench{tiers}"));
    b = b.tier("hour", Quota::per_hour(10_000).with_burst(1_000_000));
    if tiers > 1 {
        b = b.tier("day", Quota::per_day(240_000).with_burst(24_000_000));
    }
    b.build().expect("valid")
}

/// The plain Lua GCRA's parameters for the same quota: T and tau in microseconds.
const LUA_T: u64 = 360_000;
const LUA_TAU: u64 = 360_000 * 1_000_000;

/// Script calls the server has run (`calls` of `EVALSHA` in `INFO commandstats`).
fn script_calls(conn: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(conn).expect("INFO");
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|v| v.split(',').next()?.parse::<u64>().ok())
        .unwrap_or(0)
}

/// CPU time (user + system, seconds) of this process, the benchmark's client side: from
/// `/proc/self/stat` (in clock ticks of 10 ms), NaN where there is none.
fn client_cpu() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return f64::NAN };
    // The fields after the command name (which ends with the last ')'): utime, stime are the
    // 12th and 13th of them.
    let Some((_, rest)) = stat.rsplit_once(')') else { return f64::NAN };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(f64::NAN);
    (ticks(11) + ticks(12)) / 100.0
}

/// `used_cpu_user + used_cpu_sys` of the server, in seconds.
fn server_cpu(conn: &mut redis::Connection) -> f64 {
    let info: String = redis::cmd("INFO").arg("cpu").query(conn).expect("INFO cpu");
    ["used_cpu_user:", "used_cpu_sys:"]
        .iter()
        .map(|f| {
            info.lines().find_map(|l| l.strip_prefix(f)).and_then(|v| v.trim().parse::<f64>().ok())
        })
        .map(Option::unwrap_or_default)
        .sum()
}

fn bench(c: &mut Criterion) {
    let Some(server) = redis_server::Server::start("redis-server") else { return };
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let keys: Arc<Vec<Key>> = Arc::new((0..KEYS).map(|i| Key::text(format!("user-{i}"))).collect());
    let names: Arc<Vec<String>> = Arc::new((0..KEYS).map(|i| format!("k:{i}")).collect());
    let conn = rt.block_on(async {
        let client = redis::Client::open(server.url()).unwrap();
        let config = ConnectionManagerConfig::new().set_number_of_retries(0);
        ConnectionManager::new_with_config(client, config).await.unwrap()
    });
    let script = Arc::new(redis::Script::new(LUA_GCRA));

    let mut cases: Vec<(String, Op)> = Vec::new();
    {
        let (conn, names) = (conn.clone(), Arc::clone(&names));
        cases.push((
            "incr".into(),
            Arc::new(move |i| {
                let (mut conn, names) = (conn.clone(), Arc::clone(&names));
                Box::pin(async move {
                    let _: i64 = redis::cmd("INCR")
                        .arg(&names[(i % KEYS) as usize])
                        .query_async(&mut conn)
                        .await
                        .unwrap();
                })
            }),
        ));
    }
    {
        let (conn, names, script) = (conn.clone(), Arc::clone(&names), Arc::clone(&script));
        cases.push((
            "lua_gcra".into(),
            Arc::new(move |i| {
                let (mut conn, names, script) =
                    (conn.clone(), Arc::clone(&names), Arc::clone(&script));
                Box::pin(async move {
                    let admitted: i64 = script
                        .key(&names[(i % KEYS) as usize])
                        .arg(LUA_T)
                        .arg(LUA_TAU)
                        .invoke_async(&mut conn)
                        .await
                        .unwrap();
                    assert_eq!(admitted, 1);
                })
            }),
        ));
    }
    let store = RedisStore::builder(server.url()).timeout(Duration::from_secs(10)).build().unwrap();
    rt.block_on(store.connect()).unwrap();
    for (id, tiers) in [("tollgate_1_tier", 1), ("tollgate_2_tiers", 2)] {
        let limiter = Limiter::with_store(policy(tiers), store.clone()).unwrap();
        let keys = Arc::clone(&keys);
        cases.push((
            id.into(),
            Arc::new(move |i| {
                let (limiter, keys) = (limiter.clone(), Arc::clone(&keys));
                Box::pin(async move {
                    let d = limiter.check(&keys[(i % KEYS) as usize], 1).await.unwrap();
                    assert!(d.is_allowed());
                    assert_eq!(d.source(), tollgate::Source::Store);
                })
            }),
        ));
    }

    let mut g = c.benchmark_group("redis");
    g.throughput(Throughput::Elements(1));
    g.sample_size(20).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    for (id, op) in &cases {
        g.bench_function(BenchmarkId::from_parameter(id), |b| {
            b.iter_custom(|iters| concurrently(&rt, iters, op));
        });
    }
    g.finish();

    // The server's CPU per check, per case; beside it the client's (this process: the
    // runtime, the redis client, tollgate) and the checks per script call (tollgate's batches).
    let mut inspect = server.conn();
    let mut cpu = Vec::new();
    for (id, op) in &cases {
        const N: u64 = 200_000;
        let (before, calls, client) =
            (server_cpu(&mut inspect), script_calls(&mut inspect), client_cpu());
        let wall = concurrently(&rt, N, op);
        let per = (server_cpu(&mut inspect) - before) / N as f64 * 1e6;
        let client = (client_cpu() - client) / N as f64 * 1e6;
        let scripts = script_calls(&mut inspect) - calls;
        let batch = if scripts == 0 { f64::NAN } else { N as f64 / scripts as f64 };
        let rate = N as f64 / wall.as_secs_f64();
        println!(
            "redis/{id:<18} server CPU {per:6.2} µs, client CPU {client:6.2} µs per check; \
             {batch:5.1} checks per script call; {rate:7.0} checks/s"
        );
        cpu.push(format!(
            "\"{id}\":{per:.3},\"{id}_client\":{client:.3},\"{id}_batch\":{batch:.2}"
        ));
    }
    let home = std::env::var_os("CRITERION_HOME").map_or_else(
        || std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/criterion"),
        std::path::PathBuf::from,
    );
    let dir = home.join("redis");
    std::fs::create_dir_all(&dir).expect("results directory");
    let run = std::env::args()
        .skip_while(|a| a != "--save-baseline")
        .nth(1)
        .unwrap_or_else(|| "latest".into());
    std::fs::write(dir.join(format!("cpu-{run}.json")), format!("{{{}}}", cpu.join(",")))
        .expect("write");
    drop(server);
}

/// The name of a key's state: by default a keyed 128-bit hash of the key (SipHash-2-4), with
/// `raw_keys()` the key itself. Computed once per check (and per settlement); no server needed.
fn key_names(c: &mut Criterion) {
    let policy = policy(2);
    let key = Key::text("sk_live_51HqLyjWDarjtT1zdp7dcXwzB"); // an API key's length: 32 bytes
    let mut g = c.benchmark_group("redis_key_names");
    g.sample_size(50).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_secs(1));
    for (id, builder) in [
        ("hashed", RedisStore::builder("redis://127.0.0.1:1/")),
        ("raw", RedisStore::builder("redis://127.0.0.1:1/").raw_keys()),
    ] {
        let bound = builder.build().unwrap().bind(&policy).unwrap();
        g.bench_function(id, |b| b.iter(|| bound.state_key(std::hint::black_box(&key))));
    }
    g.finish();
}

/// One hot key far over its limit (1 per second), checked by 64 tasks: with local refusals
/// each instance asks Redis about once per refusal period, without them once per check.
fn refused(c: &mut Criterion) {
    let Some(server) = redis_server::Server::start("redis-server") else { return };
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let policy = Policy::single("flood", Quota::per_second(1)).expect("valid");
    let key = Arc::new(Key::text("under-attack"));
    let mut cases: Vec<(&str, Op)> = Vec::new();
    for (id, capacity) in [("local_refusals", 4096), ("no_local_refusals", 0)] {
        let store = RedisStore::builder(server.url())
            .prefix(format!("{id}:"))
            .timeout(Duration::from_secs(10))
            .local_refusals(capacity)
            .build()
            .unwrap();
        rt.block_on(store.connect()).unwrap();
        let limiter = Limiter::with_store(policy.clone(), store).unwrap();
        let key = Arc::clone(&key);
        cases.push((
            id,
            Arc::new(move |_| {
                let (limiter, key) = (limiter.clone(), Arc::clone(&key));
                Box::pin(async move {
                    let d = limiter.check(&key, 1).await.unwrap();
                    assert_eq!(d.source(), tollgate::Source::Store);
                })
            }),
        ));
    }
    let mut g = c.benchmark_group("redis_refused");
    g.throughput(Throughput::Elements(1));
    g.sample_size(10).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    for (id, op) in &cases {
        g.bench_function(*id, |b| b.iter_custom(|iters| concurrently(&rt, iters, op)));
    }
    g.finish();
    let mut inspect = server.conn();
    // At least 3 s each, so that refusal periods (1 s) end and start over.
    for (id, op) in &cases {
        const N: u64 = 100_000;
        let (before, calls) = (server_cpu(&mut inspect), script_calls(&mut inspect));
        let (mut checks, mut wall) = (0, Duration::ZERO);
        while wall < Duration::from_secs(3) {
            wall += concurrently(&rt, N, op);
            checks += N;
        }
        let per = (server_cpu(&mut inspect) - before) / checks as f64 * 1e6;
        let scripts = script_calls(&mut inspect) - calls;
        let secs = wall.as_secs_f64();
        println!(
            "redis_refused/{id:<18} {:9.0} checks/s, {:6.1} script calls/s, server CPU {per:6.3} µs per check",
            checks as f64 / secs,
            scripts as f64 / secs,
        );
    }
    drop(server);
}

criterion_group!(benches, key_names, bench, refused);
criterion_main!(benches);
