//! Many concurrent checks of one key, pipelined on one connection: exact admission counts.

use super::*;

// ---------------------------------------------------------------------------------------------
// Concurrency: many tasks, one key, pipelined on one multiplexed connection.

/// 12 days: long enough that no window boundary (aligned to the Unix epoch on server time) falls
/// inside the test, short enough for the store's horizon.
const LONG: Duration = Duration::from_secs(12 * 86_400);

/// Sends `n` checks of one key at once, each from its own task, released together by a
/// barrier; returns how many were admitted.
async fn admitted_concurrently(store: &RedisStore, policy: &Policy, n: usize) -> usize {
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (store, policy, barrier) = (store.clone(), policy.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                decide(&store, &policy, &Key::Global, 1).await.is_allowed()
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += usize::from(t.await.unwrap());
    }
    admitted
}

fn long_policy(algorithm: Algorithm) -> Policy {
    Policy::builder(format!("conc-{}", algorithm.name()))
        .algorithm(algorithm)
        .tier("t", Quota::new(100, LONG))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_admits_exactly_100_of_1000_concurrent_on_one_connection() {
    let Some(server) = Server::start("redis-server") else { return };
    let store = timed(RedisStore::builder(server.url()), 10);
    for algorithm in Algorithm::ALL {
        let admitted = admitted_concurrently(&store, &long_policy(algorithm), 1000).await;
        assert_eq!(admitted, 100, "{algorithm:?}");
    }
    // Six thousand requests, one multiplexed connection (plus this inspecting one).
    let info: String = redis::cmd("INFO").arg("clients").query(&mut server.conn()).unwrap();
    assert!(info.contains("connected_clients:2\r\n"), "{info}");
}

/// Policies of the other kinds: a yearly calendar quota (a year boundary falls inside the
/// test only on New Year's Eve at midnight), a rate counting bytes, both with a concurrency tier
/// that never fills up, and a concurrency tier of 100 slots nobody releases.
fn kinds_policies() -> Vec<Policy> {
    let slots = |max| Concurrency::new(max).with_ttl(Duration::from_secs(600));
    let calendar = Policy::builder("conc-calendar").calendar("year", Calendar::per_year(100));
    let bytes = Quota::new(100, LONG).counting(Unit::RequestBytes);
    let bytes = Policy::builder("conc-bytes").tier("bytes", bytes);
    let held = Policy::builder("conc-held");
    [(calendar, 1000), (bytes, 1000), (held, 100)]
        .map(|(builder, max)| builder.concurrency("slots", slots(max)).build().unwrap())
        .into()
}

/// Sends `n` reservations of one key at once and keeps the admitted ones; returns how many.
async fn held_concurrently(store: &RedisStore, policy: &Policy, n: usize) -> usize {
    let limiter = Limiter::with_store(policy.clone(), store.clone()).unwrap();
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (limiter, barrier) = (limiter.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let r = limiter.reserve(&Key::Global, 1).await.expect("redis answers");
                assert_eq!(r.decision().source(), Source::Store);
                r.decision().is_allowed().then_some(r)
            })
        })
        .collect();
    let mut held = Vec::new();
    for t in tasks {
        held.extend(t.await.unwrap());
    }
    held.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_admits_exactly_100_of_1000_concurrent_on_redis() {
    let Some(server) = Server::start("redis-server") else { return };
    let store = timed(RedisStore::builder(server.url()), 10);
    for policy in kinds_policies() {
        assert_eq!(held_concurrently(&store, &policy, 1000).await, 100, "{}", policy.name());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_admits_exactly_100_of_1000_concurrent() {
    let Some(cluster) = Cluster::start() else { return };
    let store = timed(RedisStore::cluster_builder(cluster.urls()), 10);
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog, Algorithm::SlidingCounter] {
        let admitted = admitted_concurrently(&store, &long_policy(algorithm), 1000).await;
        assert_eq!(admitted, 100, "{algorithm:?}");
    }
    for policy in kinds_policies() {
        assert_eq!(held_concurrently(&store, &policy, 1000).await, 100, "{}", policy.name());
    }
}
