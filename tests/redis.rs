//! `RedisStore` against real servers the tests start themselves: standalone Redis, a
//! three-master Redis Cluster, and Valkey. Differential traces against `MemoryStore`,
//! concurrency, TTLs, script reloads, restarts and the failure policy.
#![cfg(feature = "redis")]

mod support;

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use support::redis::{Cluster, Server};
use tollgate::clock::FakeClock;
use tollgate::key::Key;
use tollgate::store::{Check, Store, Ticket};
use tollgate::{Algorithm, Decision, MemoryStore, Policy, Quota, RedisStore};

const ALGORITHMS: [Algorithm; 6] = [
    Algorithm::Gcra,
    Algorithm::TokenBucket,
    Algorithm::LeakyBucket,
    Algorithm::FixedWindow,
    Algorithm::SlidingLog,
    Algorithm::SlidingCounter,
];

// ---------------------------------------------------------------------------------------------
// Differential traces: the same random requests through MemoryStore and RedisStore on one
// fake clock must give identical decisions.

#[derive(Debug, Clone)]
enum Step {
    /// Moves the clock forward by this many nanoseconds.
    Advance(u64),
    /// A request of `cost` on key `key`; `shape` is the shaping budget in nanoseconds.
    Check { key: u8, cost: u64, shape: Option<u64> },
    /// Settles the `which`-th ticket still held (modulo their number) at `cost`.
    Settle { which: usize, cost: u64 },
}

#[derive(Debug, Clone)]
struct Trace {
    algorithm: Algorithm,
    /// `(count, period in ns, burst)` per tier.
    tiers: Vec<(u64, u64, u64)>,
    /// The clock's first instant, in nanoseconds.
    start: u64,
    steps: Vec<Step>,
}

impl Trace {
    fn policy(&self) -> Policy {
        let mut b = Policy::builder("diff").algorithm(self.algorithm);
        for (i, (count, period, burst)) in self.tiers.iter().enumerate() {
            b = b.tier(
                format!("t{i}"),
                Quota::new(*count, Duration::from_nanos(*period)).with_burst(*burst),
            );
        }
        b.build().expect("generated policies are valid")
    }
}

fn tier(algorithm: Algorithm, grid: bool) -> impl Strategy<Value = (u64, u64, u64)> {
    let max_count: u64 = if algorithm == Algorithm::SlidingLog { 12 } else { 30 };
    // Periods from 1 ms to 5 s: most not a multiple of the count (inexact T), some round
    // (multiples of 10 ms) so that instants land exactly on window and expiry edges.
    let round = (1u64..=100).prop_map(|k| k * 10_000_000);
    let period =
        if grid { round.boxed() } else { prop_oneof![1_000_000u64..=5_000_000_000, round].boxed() };
    (1u64..=max_count, period, 0u64..=40).prop_map(move |(c, p, extra)| {
        let window = matches!(
            algorithm,
            Algorithm::FixedWindow | Algorithm::SlidingLog | Algorithm::SlidingCounter
        );
        let burst = if window { c } else { 1 + extra % (2 * c + 2) };
        (c, p, burst)
    })
}

/// `grid`: every advance a multiple of 10 ms, like the periods, so that instants land exactly
/// on window and expiry edges.
fn step(grid: bool) -> impl Strategy<Value = Step> {
    let round = (0u64..=100).prop_map(|k| k * 10_000_000);
    let advance = if grid {
        round.boxed()
    } else {
        prop_oneof![
            2 => 0u64..=1_000,
            3 => 0u64..=50_000_000,
            2 => 0u64..=300_000_000,
            1 => 0u64..=6_000_000_000,
            2 => round,
        ]
        .boxed()
    };
    prop_oneof![
        2 => advance.prop_map(Step::Advance),
        7 => (
            0u8..3,
            prop_oneof![6 => Just(1u64), 3 => 0u64..=4, 1 => 0u64..=12],
            proptest::option::weighted(0.4, 0u64..=3_000_000_000),
        )
            .prop_map(|(key, cost, shape)| Step::Check { key, cost, shape }),
        1 => (0usize..64, 0u64..=8).prop_map(|(which, cost)| Step::Settle { which, cost }),
    ]
}

fn trace() -> impl Strategy<Value = Trace> {
    let grid = proptest::bool::weighted(0.35);
    (proptest::sample::select(ALGORITHMS.to_vec()), grid).prop_flat_map(|(algorithm, grid)| {
        (
            proptest::collection::vec(tier(algorithm, grid), 1..=3),
            0u64..=1_000_000_000_000,
            proptest::collection::vec(step(grid), 1..=60),
        )
            .prop_map(move |(tiers, start, steps)| Trace {
                algorithm,
                tiers,
                start,
                steps,
            })
    })
}

fn keys() -> [Key; 3] {
    [Key::text("alice"), Key::Ip("203.0.113.7".parse().unwrap()), Key::Global]
}

/// Replays `trace` through both stores; the first difference is the error.
async fn replay(store: RedisStore, clock: FakeClock, trace: &Trace) -> Result<(), String> {
    let memory = MemoryStore::builder().clock(clock.clone()).build();
    let policy = trace.policy();
    let keys = keys();
    let mut tickets: Vec<(Ticket, Ticket)> = Vec::new();
    for (i, step) in trace.steps.iter().enumerate() {
        match *step {
            Step::Advance(by) => clock.advance(Duration::from_nanos(by)),
            Step::Check { key, cost, shape } => {
                let check = Check {
                    policy: &policy,
                    key: &keys[usize::from(key)],
                    cost,
                    max_delay: shape.map(Duration::from_nanos),
                };
                let m = memory.check(check).await.map_err(|e| e.to_string())?;
                let r = store.check(check).await.map_err(|e| format!("step {i}: {e}"))?;
                if m.decision != r.decision {
                    return Err(format!(
                        "step {i} ({step:?}) at {} ns differs:\nmemory: {:?}\nredis:  {:?}",
                        clock_now(&clock),
                        m.decision,
                        r.decision
                    ));
                }
                if let (Some(a), Some(b)) = (m.ticket, r.ticket) {
                    tickets.push((a, b));
                }
            }
            Step::Settle { which, cost } => {
                if tickets.is_empty() {
                    continue;
                }
                let (a, b) = tickets.remove(which % tickets.len());
                memory.settle(a, cost).await.map_err(|e| e.to_string())?;
                store.settle(b, cost).await.map_err(|e| format!("step {i}: {e}"))?;
            }
        }
    }
    Ok(())
}

fn clock_now(clock: &FakeClock) -> u64 {
    use tollgate::clock::Clock;
    clock.now()
}

/// Runs `cases` random traces against the store that `connect` builds for a clock and a
/// per-case key prefix.
fn differential(cases: u32, connect: impl Fn(FakeClock, String) -> RedisStore) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut runner =
        TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let case = std::sync::atomic::AtomicU64::new(0);
    let result = runner.run(&trace(), |trace| {
        let n = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let clock = FakeClock::new();
        clock.set(trace.start);
        let store = connect(clock.clone(), format!("diff{n}:"));
        rt.block_on(replay(store, clock, &trace)).map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

fn fake_clock_store(
    builder: tollgate::store::RedisStoreBuilder,
    clock: FakeClock,
    prefix: String,
) -> RedisStore {
    builder
        .clock(clock)
        .prefix(prefix)
        // The fake clock stands still in real time: keep keys for the whole test.
        .ttl_grace(Duration::from_secs(3600))
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

#[test]
fn standalone_decides_exactly_like_memory_store() {
    let Some(server) = Server::start("redis-server") else { return };
    let url = server.url();
    differential(256, |clock, prefix| fake_clock_store(RedisStore::builder(&url), clock, prefix));
}

#[test]
fn valkey_decides_exactly_like_memory_store() {
    let Some(server) = Server::start("valkey-server") else { return };
    let url = server.url();
    differential(64, |clock, prefix| fake_clock_store(RedisStore::builder(&url), clock, prefix));
}

#[test]
fn cluster_decides_exactly_like_memory_store() {
    let Some(cluster) = Cluster::start() else { return };
    let urls = cluster.urls();
    differential(64, |clock, prefix| {
        fake_clock_store(RedisStore::cluster_builder(urls.clone()), clock, prefix)
    });
}

/// Every algorithm on its own, so a regression names the algorithm.
#[test]
fn every_algorithm_admits_then_limits_on_redis() {
    let Some(server) = Server::start("redis-server") else { return };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    for algorithm in ALGORITHMS {
        let clock = FakeClock::new();
        let store = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "a:".into());
        let policy = Policy::builder(algorithm.name())
            .algorithm(algorithm)
            .tier("fast", Quota::per_second(3))
            .tier("slow", Quota::per_minute(5))
            .build()
            .unwrap();
        let decide = |cost| {
            let store = store.clone();
            let policy = policy.clone();
            async move {
                let c = Check { policy: &policy, key: &Key::Global, cost, max_delay: None };
                store.check(c).await.unwrap().decision
            }
        };
        rt.block_on(async {
            let d: Decision = decide(3).await;
            assert!(d.is_allowed(), "{algorithm:?}");
            assert_eq!(d.tiers()[0].remaining(), 0, "{algorithm:?}");
            assert_eq!(d.tiers()[1].remaining(), 2, "{algorithm:?}");
            let d = decide(1).await;
            assert!(!d.is_allowed(), "{algorithm:?}");
            assert_eq!(d.violated().collect::<Vec<_>>(), ["fast"], "{algorithm:?}");
            // Two seconds: the sliding counter still weighs the whole previous window at 1 s.
            clock.advance(Duration::from_secs(2));
            assert!(decide(2).await.is_allowed(), "{algorithm:?}");
            let d = decide(1).await;
            assert_eq!(d.violated().collect::<Vec<_>>(), ["slow"], "{algorithm:?}");
        });
    }
}
