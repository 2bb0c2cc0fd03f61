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

use crate::outage::{Configured, Layered, MARGIN, by_header, request};
use axum::body::Body;
use http::{Response, StatusCode};
use support::redis::{Cluster, Server};
use tollgate::key::Key;
use tollgate::store::{BreakerState, RedisStore, Store};
use tollgate::{Policy, Quota, RateLimitLayer};
use tower::{Layer, ServiceExt};

/// The store's per-call timeout in these tests.
const TIMEOUT: Duration = Duration::from_millis(150);
/// Concurrent requests kept in flight.
const IN_FLIGHT: usize = 200;
/// Requests each of them sends at most (so a run is bounded even if time is not).
const PER_WORKER: usize = 1000;
/// Pause between one worker's requests: traffic arrives over time, as from a network, rather
/// than from tasks that never yield (answers from an open breaker are immediate).
const PACE: Duration = Duration::from_millis(10);

use crate::ONE_AT_A_TIME;

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
    configured.build(builder.timeout(TIMEOUT).circuit_breaker(3, Duration::from_millis(300)))
}

/// Drives `svc` from `IN_FLIGHT` workers until `stop` is set (or each sent `PER_WORKER`), and
/// samples the breaker every 5 ms: the monitor's and the workers' tasks.
type Monitor = tokio::task::JoinHandle<Vec<(Instant, BreakerState)>>;
type Workers = Vec<tokio::task::JoinHandle<Vec<Sample>>>;

fn drive(svc: impl Layered, store: RedisStore, stop: Arc<AtomicBool>) -> (Monitor, Workers) {
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
                    let req = request(&format!("k{}", (w * 7 + i) % 1000));
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
    let policy = Policy::single("faults", Quota::per_hour(50)).unwrap();
    let layer = RateLimitLayer::builder(policy.clone())
        .key(by_header)
        .store(store.clone())
        .on_store_error(configured.on_store_error())
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
    let mut allowed = 0;
    for _ in 0..60 {
        let res = svc.clone().oneshot(request("fresh")).await.unwrap();
        allowed += usize::from(res.status() == StatusCode::OK);
    }
    assert_eq!(allowed, 50, "{name}");
    let state = store.bind(&policy).unwrap().state_key(&Key::text("fresh"));
    let exists: i64 = redis::cmd("EXISTS").arg(&state).query(&mut target.conn_for(&state)).unwrap();
    assert_eq!(exists, 1, "{name}: decided by Redis, not the fallback");
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

/// Where a scenario's fault happens: a standalone redis-server, or the master of this index in a
/// Redis Cluster.
enum Deployment {
    Standalone,
    ClusterMaster(usize),
}

/// Starts the deployment (the tests skip without its servers) and runs the scenario on it, one
/// scenario at a time.
async fn run(deployment: Deployment, configured: Configured, fault: Fault) {
    let _one = ONE_AT_A_TIME.lock().await;
    let target = match deployment {
        Deployment::Standalone => {
            let Some(server) = Server::start("redis-server") else { return };
            Target::Standalone(server)
        }
        Deployment::ClusterMaster(i) => {
            let Some(cluster) = Cluster::start() else { return };
            Target::Cluster(cluster, i)
        }
    };
    scenario(target, configured, fault).await;
}

/// One test per scenario: `name: deployment, configured outcome, fault;`.
macro_rules! scenarios {
    ($($name:ident: $deployment:expr, $configured:ident, $fault:ident;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            run($deployment, Configured::$configured, Fault::$fault).await;
        }
    )*};
}

scenarios! {
    killed_under_load_with_fallback: Deployment::Standalone, Fallback, Kill;
    killed_under_load_failing_closed: Deployment::Standalone, FailClosed, Kill;
    killed_under_load_failing_open: Deployment::Standalone, FailOpen, Kill;
    frozen_under_load_with_fallback: Deployment::Standalone, Fallback, Freeze;
    frozen_under_load_failing_closed: Deployment::Standalone, FailClosed, Freeze;
    frozen_under_load_failing_open: Deployment::Standalone, FailOpen, Freeze;
    a_cluster_master_killed_under_load_with_fallback: Deployment::ClusterMaster(1), Fallback, Kill;
    a_cluster_master_frozen_under_load_failing_closed:
        Deployment::ClusterMaster(2), FailClosed, Freeze;
}
