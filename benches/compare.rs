#![allow(missing_docs)] // criterion_group! generates undocumented items.
//! tollgate beside the crates users would pick instead, in one run (BENCHMARKS.md):
//!
//! - `store/<peer>/<keys>/<threads>`: one allowed check of an in-memory keyed limiter —
//!   tollgate's `MemoryStore` and governor's keyed `RateLimiter` (DashMap) — for 1 hot key,
//!   10,000 and 1,000,000 IPv4 keys, on 1 and 2 threads. Time per check (wall time of all
//!   threads / checks).
//! - `layer_overhead/<stack>/<case>`: the time one request through an axum `Router` with a
//!   trivial handler takes beyond the same request through the bare router, driven in-process
//!   with `tower::ServiceExt::oneshot` on one thread, the two alternating every 32 requests so
//!   that drift falls on both: tollgate's layer and tower_governor's; the allowed path with
//!   rate-limit headers (`allowed`) and without (`allowed_no_headers`), and the 429 path with
//!   headers (`limited`). Routers are made ready with `with_state(())`, as `axum::serve` does,
//!   so that no request pays for turning handlers into routes.
//!
//! `cargo bench --bench compare`; `bash benches/compare.sh` runs it and prints the ratios.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use governor::{Quota as GQuota, RateLimiter};
use http::{Request, StatusCode};
use tollgate::key::Key;
use tollgate::store::MemoryStore;
use tollgate::{HeaderStyle, Limiter, Policy, Quota, RateLimitLayer};
use tower::ServiceExt;
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;

const KEY_COUNTS: [u32; 3] = [1, 10_000, 1_000_000];

/// Requests per second on the allowed path: more than any benchmark sends.
const RATE: u32 = 1_000_000_000;

fn ip(i: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i))
}

/// Runs `iters` calls of `f(i)` split over `threads` threads; returns the wall time.
fn on_threads(threads: usize, iters: u64, f: &(dyn Fn(u64) + Sync)) -> Duration {
    let per = iters / threads as u64 + 1;
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads as u64 {
            s.spawn(move || {
                for i in 0..per {
                    f(t * 7919 + i);
                }
            });
        }
    });
    start.elapsed().mul_f64(iters as f64 / (per * threads as u64) as f64)
}

fn store(c: &mut Criterion) {
    let mut g = c.benchmark_group("store");
    for keys in KEY_COUNTS {
        let tollgate_keys: Vec<Key> = (0..keys).map(|i| Key::Ip(ip(i))).collect();
        let governor_keys: Vec<IpAddr> = (0..keys).map(ip).collect();
        // Allowed path: 10^9 per second (T = 1 ns) is a rate no benchmark can exhaust, the same
        // for both.
        let policy = Policy::single("bench", Quota::per_second(RATE.into())).unwrap();
        let store = MemoryStore::builder().max_keys(2_000_000).build().unwrap();
        let ours = Limiter::with_store(policy, store).unwrap();
        let theirs = RateLimiter::keyed(GQuota::per_second(NonZeroU32::new(RATE).unwrap()));
        for k in &tollgate_keys {
            assert!(ours.check_now(k, 1).is_allowed());
        }
        for k in &governor_keys {
            let _ = theirs.check_key(k);
        }
        let n = keys as u64;
        for threads in [1usize, 2] {
            let id = format!("{keys}/{threads}");
            g.bench_function(BenchmarkId::new("tollgate", &id), |b| {
                b.iter_custom(|iters| {
                    on_threads(threads, iters, &|i| {
                        let key = &tollgate_keys[(i % n) as usize];
                        // Consumed like governor's: the outcome. The full decision (remaining,
                        // reset per tier, for the headers) is computed all the same.
                        black_box(ours.check_now(key, 1).is_allowed());
                    })
                });
            });
            g.bench_function(BenchmarkId::new("governor", &id), |b| {
                b.iter_custom(|iters| {
                    on_threads(threads, iters, &|i| {
                        black_box(theirs.check_key(&governor_keys[(i % n) as usize]).is_ok());
                    })
                });
            });
        }
    }
    g.finish();
}

fn request() -> Request<Body> {
    let mut req = Request::get("/").body(Body::empty()).unwrap();
    req.extensions_mut().insert(ConnectInfo(SocketAddr::from(([192, 0, 2, 1], 4711))));
    req
}

/// Sends `n` requests through `app`; asserts every status is `expect`; returns the time taken.
async fn send(app: &Router, n: u64, expect: StatusCode) -> Duration {
    let start = Instant::now();
    for _ in 0..n {
        let res = app.clone().oneshot(request()).await.unwrap();
        assert_eq!(res.status(), expect);
        black_box(res);
    }
    start.elapsed()
}

/// Requests per chunk: `stack` and `bare` alternate every `CHUNK` requests, so that the machine's
/// drift (a shared VM's neighbours) falls on both alike.
const CHUNK: u64 = 32;

/// The time `iters` requests through `stack` take beyond the same number through `bare`,
/// measured in alternating chunks on one thread. Floored at 1 ns per request: criterion
/// needs a positive time, and a stack faster than bare is noise.
fn overhead(
    rt: &tokio::runtime::Runtime,
    stack: &Router,
    bare: &Router,
    iters: u64,
    expect: StatusCode,
) -> Duration {
    rt.block_on(async {
        let (mut on, mut off) = (Duration::ZERO, Duration::ZERO);
        let mut left = iters;
        while left > 0 {
            let n = left.min(CHUNK);
            off += send(bare, n, StatusCode::OK).await;
            on += send(stack, n, expect).await;
            left -= n;
        }
        on.saturating_sub(off).max(Duration::from_nanos(iters))
    })
}

fn layer(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let route = || Router::new().route("/", get(|| async { "ok" }));
    // As `axum::serve` runs a router: its handlers turned into routes once, not per request.
    let ready = |app: Router| app.with_state::<()>(());
    let bare = ready(route());
    let mut g = c.benchmark_group("layer_overhead");
    // (case, allowed?, headers on?, expected status)
    let cases = [
        ("allowed", true, true, StatusCode::OK),
        ("allowed_no_headers", true, false, StatusCode::OK),
        ("limited", false, true, StatusCode::TOO_MANY_REQUESTS),
    ];
    for (case, allowed, headers, status) in cases {
        let quota = if allowed { Quota::per_second(u64::from(RATE)) } else { Quota::per_hour(1) };
        let style = if headers { HeaderStyle::Ietf } else { HeaderStyle::None };
        let ours = ready(
            route().layer(
                RateLimitLayer::builder(Policy::single("bench", quota).unwrap())
                    .headers(style)
                    .build()
                    .unwrap(),
            ),
        );
        let mut config = GovernorConfigBuilder::default();
        if allowed {
            config.per_nanosecond(1).burst_size(u32::MAX);
        } else {
            config.per_second(3600).burst_size(1);
        }
        let theirs = if headers {
            ready(
                route().layer(GovernorLayer::new(Arc::new(config.use_headers().finish().unwrap()))),
            )
        } else {
            ready(route().layer(GovernorLayer::new(Arc::new(config.finish().unwrap()))))
        };
        if !allowed {
            // Spend the single unit of each.
            rt.block_on(send(&ours, 1, StatusCode::OK));
            rt.block_on(send(&theirs, 1, StatusCode::OK));
        }
        g.bench_function(BenchmarkId::new("tollgate", case), |b| {
            b.iter_custom(|iters| overhead(&rt, &ours, &bare, iters, status));
        });
        g.bench_function(BenchmarkId::new("tower_governor", case), |b| {
            b.iter_custom(|iters| overhead(&rt, &theirs, &bare, iters, status));
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(30);
    targets = store, layer
}
criterion_main!(benches);
