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
    BreakerState, Check, MemoryStore, MemoryTicket, RedisStore, RedisTicket, Store,
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
