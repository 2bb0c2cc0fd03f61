//! The seam matrix in lease mode (issue 33): `RedisStore` instances leasing blocks of one
//! budget beside an exact instance, on one fake clock, over random seams of what lease mode
//! takes (rate tiers of any algorithm it leases, calendar tiers; policed, shaped and refunded
//! checks; reloads; blocks of 4 or 16, with or without prefetching and leasing the schedule),
//! each admission held to the bound `Lease` states: `burst + ⌊R·L⌋ + N·B` for GCRA in every
//! interval, the exact limit for windows and calendar tiers (tests/support/seams_bounds.rs).
//! An instance rebound by a reload counts as one more instance while its old binding may
//! still hold a block.
#![cfg(feature = "redis")]

use crate::support;

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{
    Config as RunnerConfig, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner,
};
use support::seams::{Config, LeaseHeaders, Mix, Space, Step, TierChoice, case, run_leased};
use tollgate::Priority;
use tollgate::clock::FakeClock;
use tollgate::store::{Lease, RedisStore};

/// How a run leases: instances, the largest block, prefetching, leasing the schedule.
#[derive(Debug, Clone, Copy)]
struct Leasing {
    instances: usize,
    block: u64,
    prefetch: bool,
    schedule: bool,
}

fn leasing() -> impl Strategy<Value = Leasing> {
    (1usize..=3, prop::sample::select(vec![4u64, 16]), any::<bool>(), any::<bool>()).prop_map(
        |(instances, block, prefetch, schedule)| Leasing { instances, block, prefetch, schedule },
    )
}

fn store(
    server: &support::redis::Server,
    clock: &FakeClock,
    prefix: &str,
    lease: Option<Lease>,
) -> RedisStore {
    let mut b = RedisStore::builder(server.url())
        .prefix(prefix)
        .clock(clock.clone())
        .ttl_grace(Duration::from_secs(3600))
        .timeout(Duration::from_secs(5))
        .no_fallback();
    if let Some(lease) = lease {
        b = b.lease_policy("seam", lease);
    }
    b.build().unwrap()
}

async fn one(
    server: &support::redis::Server,
    (config, trace): &(Config, Vec<Step>),
    how: Leasing,
    headers: LeaseHeaders,
) -> Result<(), String> {
    static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let prefix = format!("seamslease{n}:");
    let clock = FakeClock::new();
    let lease = Lease::new().max_block(how.block).prefetch(how.prefetch).schedule(how.schedule);
    let leasing = (0..how.instances).map(|_| store(server, &clock, &prefix, Some(lease))).collect();
    let exact = store(server, &clock, &prefix, None);
    // Every binding a reload replaces may still hold a block while tickets it issued live.
    let reloads = trace.iter().filter(|s| matches!(s, Step::Reload)).count() as u64;
    let slack = lease.bound(how.instances as u64 + reloads);
    run_leased(config, trace, leasing, exact, slack, &clock, headers).await
}

fn cases() -> u32 {
    let long = std::env::var("TOLLGATE_LONG_TESTS").is_ok_and(|v| v == "1");
    if long { 600 } else { 60 }
}

fn matrix(cases: u32) {
    let Some(server) = support::redis::Server::start("redis-server") else { return };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    for seed in [0x1e_u8, 0x5a] {
        let config = RunnerConfig {
            cases,
            failure_persistence: None,
            max_shrink_iters: 2_000,
            max_shrink_time: 60_000,
            ..RunnerConfig::default()
        };
        let mut runner =
            TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]));
        let strategy = (case(Space::Lease, &[], |c| c, 8..80), leasing());
        let result = runner.run(&strategy, |(c, how)| {
            rt.block_on(one(&server, &c, how, LeaseHeaders::Unchecked)).map_err(TestCaseError::fail)
        });
        if let Err(e) = result {
            match e {
                TestError::Fail(why, ((config, trace), how)) => panic!(
                    "lease seam {:?} (seed {seed:#x}), {how:?}, {} steps:\n  {config:?}\n  \
                     {trace:?}\n  {why}",
                    config.labels(),
                    trace.len()
                ),
                TestError::Abort(why) => panic!("aborted (seed {seed:#x}): {why}"),
            }
        }
    }
}

#[test]
fn leasing_instances_keep_each_tier_s_bound() {
    matrix(cases());
}

/// Issue 32 ("headers that say there is room"): an admitted check decided from a block says
/// how much of the block this instance holds (`r=0` while the key has about 95 left), not
/// what the key has. One leasing instance beside an exact one, 100 a second (burst 100), 40
/// checks at one instant: each admitted check from a block must report within a block (16)
/// of what an exact query says right after it.
#[test]
#[ignore = "issue 32: lease-mode headers, fixed by redis-truth"]
fn a_leased_decision_reports_what_the_key_has_left_within_a_block() {
    let Some(server) = support::redis::Server::start("redis-server") else { return };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let tier = TierChoice::Requests { count: 100, period_ms: 1_000, burst_x: 2 };
    let config = Config {
        window: false,
        tiers: vec![tier],
        penalty: None,
        reserve: None,
        mix: Mix::default(),
    };
    let call = Step::Call {
        key: 0,
        class: Priority::Standard,
        requests: 1,
        bytes: 0,
        shape: None,
        hold: false,
    };
    let trace = vec![call; 40];
    let how = Leasing { instances: 1, block: 16, prefetch: false, schedule: false };
    if let Err(e) = rt.block_on(one(&server, &(config, trace), how, LeaseHeaders::WithinABlock)) {
        panic!("{e}");
    }
}
