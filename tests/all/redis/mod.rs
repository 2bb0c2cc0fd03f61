//! `RedisStore` against real servers the tests start themselves: standalone Redis, a
//! three-master Redis Cluster, and Valkey. Differential traces against `MemoryStore`,
//! concurrency, TTLs, script reloads, restarts and the failure policy.
#![cfg(feature = "redis")]

mod calendar;
mod clocks;
mod concurrency;
mod differential;
mod failures;
mod fleet;
mod keys;
mod penalty;
mod priority;
mod refusals;
mod slots;
mod trace;

use crate::support;
use crate::support::penalty as scenarios;
use crate::support::priority as priorities;

use std::time::Duration;

use keys::*;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use refusals::*;
use support::redis::{Cluster, Server};
use tollgate::clock::FakeClock;
use tollgate::key::{GlobalKey, Key};
use tollgate::store::{
    BreakerState, Check, MemoryStore, MemoryTicket, RedisStore, RedisStoreBuilder, RedisTicket,
    Store,
};
use tollgate::{
    Algorithm, Calendar, CalendarPeriod, Concurrency, Decision, Limiter, OnStoreError, Penalty,
    Policy, Priority, Quota, RateLimitLayer, Reservation, Reserve, Source, StoreError, Unit,
};
use trace::*;

/// One check of `cost` units for `key` under `policy`, through `store`.
async fn decide(store: &RedisStore, policy: &Policy, key: &Key, cost: u64) -> Decision {
    let limiter = Limiter::with_store(policy.clone(), store.clone()).expect("binds");
    limiter.check(key, cost).await.expect("redis answers")
}

/// The Redis key of `key`'s state under `policy`.
fn state_key(store: &RedisStore, policy: &Policy, key: &Key) -> String {
    store.bind(policy).expect("binds").state_key(key)
}

/// The lease set of concurrency tier `tier` of the key whose state key is `state`: the state
/// key less its `:{fingerprint}` (8 hexadecimal digits), then `:c:{tier}`.
fn lease_set(state: &str, tier: &str) -> String {
    format!("{}:c:{tier}", &state[..state.len() - 9])
}

/// A fake clock set to `at` nanoseconds since the epoch.
fn clock_at(at: u64) -> FakeClock {
    let clock = FakeClock::new();
    clock.set(at);
    clock
}

/// A fake clock set to `at` and the store `builder` makes on it, its keys under `prefix` (see
/// [`fake_clock_store`]).
fn clocked(builder: RedisStoreBuilder, at: u64, prefix: &str) -> (FakeClock, RedisStore) {
    let clock = clock_at(at);
    let store = fake_clock_store(builder, clock.clone(), prefix.into());
    (clock, store)
}

/// The store `builder` makes, with a timeout of `secs` seconds.
fn timed(builder: RedisStoreBuilder, secs: u64) -> RedisStore {
    builder.timeout(Duration::from_secs(secs)).build().unwrap()
}

/// What a shared scenario (`support::penalty`, `support::priority`) calls for a limiter: each
/// policy on a store on `server` reading `clock`, its keys under `prefix`.
fn limiters_on(
    server: &Server,
    clock: &FakeClock,
    prefix: &str,
) -> impl Fn(Policy) -> std::future::Ready<Limiter<RedisStore>> {
    let (stores, clock) = (stores_on(server, prefix), clock.clone());
    move |policy| {
        let store = stores(clock.clone(), String::new());
        std::future::ready(Limiter::with_store(policy, store).unwrap())
    }
}
