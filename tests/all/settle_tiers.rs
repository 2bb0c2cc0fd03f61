//! `Store::settle_tiers` decides alike on the memory store and on Redis, whatever the policy:
//! a policy of request rates is the case of every tier charged the same cost, and its tiers
//! settle one by one as any policy's do (on every script: `gcra.lua` and `kinds.lua`).
#![cfg(feature = "redis")]

use crate::support;

use std::time::Duration;

use support::redis::Server;
use tollgate::clock::FakeClock;
use tollgate::key::Key;
use tollgate::store::{Check, MemoryStore, RedisStore, Store};
use tollgate::{Algorithm, Decision, Policy, Quota};

/// Two request-rate tiers (10 a second, 100 an hour) of `algorithm`, or of GCRA with an
/// emission interval that is not whole nanoseconds (`fractional`: 3 a second).
fn policy(algorithm: Algorithm, fractional: bool) -> Policy {
    let name = format!("settle-{}-{fractional}", algorithm.name());
    let second = if fractional { Quota::per_second(3) } else { Quota::per_second(10) };
    Policy::builder(name)
        .algorithm(algorithm)
        .tier("second", second)
        .tier("hour", Quota::per_hour(100))
        .build()
        .unwrap()
}

/// The same trace on both stores: a check of 3 with a ticket, tier 0 settled at 1, tier 1 at
/// 5, then the whole ticket at 0; after each step both stores answer a query alike. Returns
/// what the queries said of each tier's `remaining`.
async fn trace(memory: &MemoryStore, redis: &RedisStore, policy: &Policy) -> Vec<Vec<u64>> {
    let (m, r) = (memory.bind(policy).unwrap(), redis.bind(policy).unwrap());
    let key = Key::text("k");
    let query = async || {
        let a = memory.check(&m, Check::new(&key, 0)).await.unwrap().decision;
        let b = redis.check(&r, Check::new(&key, 0)).await.unwrap().decision;
        assert_eq!(a, b, "{}", policy.name());
        remaining(&a)
    };
    let check = Check::new(&key, 3).with_ticket();
    let mut mt = memory.check(&m, check).await.unwrap().ticket.expect("admitted");
    let mut rt = redis.check(&r, check).await.unwrap().ticket.expect("admitted");
    let mut seen = vec![query().await];
    for costs in [[(0, 1)], [(1, 5)]] {
        memory.settle_tiers(&m, &mut mt, &costs).await.unwrap();
        redis.settle_tiers(&r, &mut rt, &costs).await.unwrap();
        seen.push(query().await);
    }
    memory.settle(&m, mt, 0).await.unwrap();
    redis.settle(&r, rt, 0).await.unwrap();
    seen.push(query().await);
    seen
}

fn remaining(d: &Decision) -> Vec<u64> {
    d.tiers().iter().map(|t| t.remaining()).collect()
}

#[tokio::test]
async fn settling_single_tiers_of_a_request_rate_policy_decides_alike_on_both_stores() {
    let Some(server) = Server::start("redis-server") else { return };
    let clock = FakeClock::new();
    clock.set(3_600_000_000_000);
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let redis = RedisStore::builder(server.url())
        .clock(clock.clone())
        .prefix("settle-tiers:")
        .ttl_grace(Duration::from_secs(3600))
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let cases = [
        (Algorithm::Gcra, false),
        (Algorithm::Gcra, true),
        (Algorithm::TokenBucket, false),
        (Algorithm::LeakyBucket, false),
        (Algorithm::FixedWindow, false),
        (Algorithm::SlidingCounter, false),
        (Algorithm::SlidingLog, false),
    ];
    for (algorithm, fractional) in cases {
        let p = policy(algorithm, fractional);
        let cap = p.tiers()[0].capacity();
        let seen = trace(&memory, &redis, &p).await;
        // Charged 3, tier 0 settled at 1, tier 1 at 5, then both given back. (A sliding log
        // keeps the 2 charged more as an entry of their own, which settling the ticket does not
        // reach, on both stores alike: its last row is not compared here.)
        let expected = [[cap - 3, 97], [cap - 1, 97], [cap - 1, 95], [cap, 100]];
        let rows = if algorithm == Algorithm::SlidingLog { 3 } else { 4 };
        assert_eq!(seen[..rows], expected[..rows], "{}", p.name());
    }
}
