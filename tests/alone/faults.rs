//! Redis faults under load (SECURITY.md, "Redis outage or slowness"): the test's redis-server is
//! killed, or frozen with SIGSTOP, while 200 requests are in flight through the layer and new
//! ones keep arriving; then it comes back. Also one master of a Redis Cluster going down.
//!
//! Asserted for every configured outcome (local fallback, fail closed, fail open): no panic; no
//! request waits longer than the store's timeout plus a margin; every response is a decision or
//! the configured failure outcome; the circuit breaker opens, and closes again within 1 s of
//! Redis answering; limiting by Redis is exact afterwards.
//!
//! The scenarios run one at a time (they measure latency on a 2-core machine).
#![cfg(feature = "redis")]
use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::body::Body;
use http::{Request, Response, StatusCode};
use support::redis::{Cluster, Server};
use tollgate::key::Key;
use tollgate::store::{BreakerState, MemoryStore, RedisStore, Store};
use tollgate::{OnStoreError, Policy, Quota, RateLimitLayer};
use tower::{Layer, Service, ServiceExt};

/// The store's per-call timeout in these tests.
const TIMEOUT: Duration = Duration::from_millis(150);
/// What a request may take beyond the timeout: the fallback decision and scheduling on a busy
/// 2-core machine.
const MARGIN: Duration = Duration::from_millis(250);
/// Concurrent requests kept in flight.
const IN_FLIGHT: usize = 200;
/// Requests each of them sends at most (so a run is bounded even if time is not).
const PER_WORKER: usize = 1000;
/// Pause between one worker's requests: traffic arrives over time, as from a network, rather
/// than from tasks that never yield (answers from an open breaker are immediate).
const PACE: Duration = Duration::from_millis(10);

use crate::ONE_AT_A_TIME;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Configured {
    Fallback,
    FailClosed,
    FailOpen,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Kill,
    Freeze,
}

/// What one response was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// 200 or 429 with a `RateLimit` header: a decision (by Redis or the fallback).
    Decided,
    /// 503 with `Retry-After: 1`: failed closed.
    Closed,
    /// 200 without rate-limit headers: failed open.
    Open,
}

struct Sample {
    took: Duration,
    seen: Seen,
}

fn by_header(parts: &tollgate::key::RequestHead<'_>) -> Option<Key> {
    parts.headers.get("x-key").and_then(|v| v.to_str().ok()).map(Key::text)
}

fn classify(res: &Response<tollgate::layer::ResponseBody<Body>>) -> Seen {
    let headers = res.headers();
    match res.status() {
        StatusCode::OK | StatusCode::TOO_MANY_REQUESTS if headers.contains_key("ratelimit") => {
            Seen::Decided
        }
        StatusCode::SERVICE_UNAVAILABLE if headers["retry-after"] == "1" => Seen::Closed,
        StatusCode::OK => Seen::Open,
        other => panic!("unexpected response {other} {headers:?}"),
    }
}

fn store(builder: tollgate::store::RedisStoreBuilder, configured: Configured) -> RedisStore {
    let builder = builder.timeout(TIMEOUT).circuit_breaker(3, Duration::from_millis(300));
    match configured {
        Configured::Fallback => builder.fallback(MemoryStore::new()),
        _ => builder.no_fallback(),
    }
    .build()
    .unwrap()
}

/// Drives `svc` from `IN_FLIGHT` workers until `stop` is set (or each sent `PER_WORKER`), and
/// samples the breaker every 5 ms: the monitor's and the workers' tasks.
type Monitor = tokio::task::JoinHandle<Vec<(Instant, BreakerState)>>;
type Workers = Vec<tokio::task::JoinHandle<Vec<Sample>>>;

fn drive<S>(svc: S, store: RedisStore, stop: Arc<AtomicBool>) -> (Monitor, Workers)
where
    S: Service<
            Request<Body>,
            Response = Response<tollgate::layer::ResponseBody<Body>>,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    let monitor = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut states = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                states.push((Instant::now(), store.breaker_state()));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            states
        })
    };
    let workers = (0..IN_FLIGHT)
        .map(|w| {
            let (svc, stop) = (svc.clone(), stop.clone());
            tokio::spawn(async move {
                let mut samples = Vec::new();
                for i in 0..PER_WORKER {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let req = Request::get("/")
                        .header("x-key", format!("k{}", (w * 7 + i) % 1000))
                        .body(Body::empty())
                        .unwrap();
                    let started = Instant::now();
                    let res = svc.clone().oneshot(req).await.unwrap();
                    samples.push(Sample { took: started.elapsed(), seen: classify(&res) });
                    tokio::time::sleep(PACE).await;
                }
                samples
            })
        })
        .collect();
    (monitor, workers)
}

/// Where the fault happens.
enum Target {
    Standalone(Server),
    /// A cluster and the index of the master to take down.
    Cluster(Cluster, usize),
}

impl Target {
    fn store(&self, configured: Configured) -> RedisStore {
        match self {
            Self::Standalone(s) => store(RedisStore::builder(s.url()), configured),
            Self::Cluster(c, _) => store(RedisStore::cluster_builder(c.urls()), configured),
        }
    }

    fn victim(&mut self) -> &mut Server {
        match self {
            Self::Standalone(s) => s,
            Self::Cluster(c, i) => &mut c.nodes[*i],
        }
    }

    /// Brings the victim back; returns when the whole deployment answers again.
    fn recover(&mut self, fault: Fault) {
        match fault {
            Fault::Kill => self.victim().restart(), // returns once it answers PING
            Fault::Freeze => self.victim().resume(),
        }
        if let Self::Cluster(c, _) = self {
            c.wait_ok();
        }
    }

    /// A connection to the server holding `key`.
    fn conn_for(&self, key: &str) -> redis::Connection {
        match self {
            Self::Standalone(s) => s.conn(),
            Self::Cluster(c, _) => c.node_of(key).conn(),
        }
    }
}

/// One scenario: load, fault, recovery, checks.
async fn scenario(mut target: Target, configured: Configured, fault: Fault) {
    let store = target.store(configured);
    store.connect().await.unwrap();
    let on_error = match configured {
        Configured::FailOpen => OnStoreError::FailOpen,
        _ => OnStoreError::FailClosed,
    };
    let policy = Policy::single("faults", Quota::per_hour(50)).unwrap();
    let layer = RateLimitLayer::builder(policy.clone())
        .key(by_header)
        .store(store.clone())
        .on_store_error(on_error)
        .build()
        .unwrap();
    let svc = layer.layer(support::ok_service());

    let stop = Arc::new(AtomicBool::new(false));
    let (monitor, workers) = drive(svc.clone(), store.clone(), stop.clone());
    tokio::time::sleep(Duration::from_millis(400)).await;
    match fault {
        Fault::Kill => target.victim().kill(),
        Fault::Freeze => target.victim().pause(),
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    target.recover(fault);
    let back = Instant::now();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, Ordering::Relaxed);

    let mut samples = Vec::new();
    for w in workers {
        samples.extend(w.await.expect("no worker panicked"));
    }
    let states = monitor.await.unwrap();
    let name = format!("{configured:?} {fault:?}");
    check(&name, configured, &samples, &states, back);

    // Limiting by Redis is exact again: a fresh key gets its 50, no more, decided by Redis.
    let fresh = || Request::get("/").header("x-key", "fresh").body(Body::empty()).unwrap();
    let mut allowed = 0;
    for _ in 0..60 {
        let res = svc.clone().oneshot(fresh()).await.unwrap();
        allowed += usize::from(res.status() == StatusCode::OK);
    }
    assert_eq!(allowed, 50, "{name}");
    let state = store.bind(&policy).unwrap().state_key(&Key::text("fresh"));
    let exists: i64 = redis::cmd("EXISTS").arg(&state).query(&mut target.conn_for(&state)).unwrap();
    assert_eq!(exists, 1, "{name}: decided by Redis, not the fallback");
}

async fn standalone(configured: Configured, fault: Fault) {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(server) = Server::start("redis-server") else { return };
    scenario(Target::Standalone(server), configured, fault).await;
}

fn check(
    name: &str,
    configured: Configured,
    samples: &[Sample],
    states: &[(Instant, BreakerState)],
    back: Instant,
) {
    assert!(samples.len() > 2 * IN_FLIGHT, "{name}: only {} requests", samples.len());
    let slowest = samples.iter().map(|s| s.took).max().unwrap();
    assert!(slowest <= TIMEOUT + MARGIN, "{name}: a request took {slowest:?}");
    let count = |seen| samples.iter().filter(|s| s.seen == seen).count();
    let (decided, closed, open) = (count(Seen::Decided), count(Seen::Closed), count(Seen::Open));
    match configured {
        Configured::Fallback => assert_eq!((closed, open), (0, 0), "{name}: always decided"),
        Configured::FailClosed => {
            assert_eq!(open, 0, "{name}");
            assert!(closed > 0, "{name}: the outage failed some requests closed");
        }
        Configured::FailOpen => {
            assert_eq!(closed, 0, "{name}");
            assert!(open > 0, "{name}: the outage passed some requests open");
        }
    }
    assert!(decided > 0, "{name}");
    let timeline = timeline(states, back);
    assert!(
        states.iter().any(|(_, s)| *s == BreakerState::Open),
        "{name}: breaker never opened\n{timeline}"
    );
    let (at, _) = states.iter().rev().find(|(_, s)| *s != BreakerState::Closed).unwrap();
    assert!(
        at.saturating_duration_since(back) < Duration::from_secs(1),
        "{name}: breaker not closed within 1 s of Redis answering\n{timeline}"
    );
    assert_eq!(states.last().unwrap().1, BreakerState::Closed, "{name}\n{timeline}");
}

/// The breaker's transitions, for failure messages.
fn timeline(states: &[(Instant, BreakerState)], back: Instant) -> String {
    let t0 = states[0].0;
    let mut out = format!("Redis answered again at {:?}; breaker:", back.duration_since(t0));
    let mut last = None;
    for (t, s) in states {
        if last != Some(*s) {
            out += &format!(" {:.0?} {s:?};", t.duration_since(t0));
            last = Some(*s);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_under_load_with_fallback() {
    standalone(Configured::Fallback, Fault::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_under_load_failing_closed() {
    standalone(Configured::FailClosed, Fault::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_under_load_failing_open() {
    standalone(Configured::FailOpen, Fault::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_under_load_with_fallback() {
    standalone(Configured::Fallback, Fault::Freeze).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_under_load_failing_closed() {
    standalone(Configured::FailClosed, Fault::Freeze).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_under_load_failing_open() {
    standalone(Configured::FailOpen, Fault::Freeze).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_master_killed_under_load_with_fallback() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(cluster) = Cluster::start() else { return };
    scenario(Target::Cluster(cluster, 1), Configured::Fallback, Fault::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_master_frozen_under_load_failing_closed() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(cluster) = Cluster::start() else { return };
    scenario(Target::Cluster(cluster, 2), Configured::FailClosed, Fault::Freeze).await;
}
