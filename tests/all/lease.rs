//! `RedisStore` lease mode against a real redis-server: four leasing instances (each its own
//! store and connection) on one hot key, on one fake clock. Fixed windows admit at most their
//! limit in every window; GCRA admits at most `burst + ⌊L / T⌋ + N·B` in every interval of
//! length `L`; unspent units come back when a block ends or its binding is dropped; a block is
//! never spent after its lifetime; an outage is decided per check as in exact mode.
#![cfg(feature = "redis")]

use crate::support;

use std::time::Duration;

use support::lease::{
    N, asked_on_cluster, check, duration_ns, fixed_window, fleet, fleet_of, futures_join, hammer,
    left, on_cluster, started,
};
use support::redis::{Cluster, Server};
use tollgate::clock::{Clock, FakeClock};
use tollgate::key::Key;
use tollgate::store::{Check, Lease, RedisPolicy, RedisStore, Store};
use tollgate::{Algorithm, ConfigError, Decision, Outcome, Policy, Quota, Source};

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

/// A leasing instance, or the exact one: its store and its binding.
type Node = (RedisStore, RedisPolicy);

/// [`started`], and on it a [`fleet`] of `policy` leasing with `lease`: the server (redis-server
/// stops when it is dropped), the clock, the leasing instances, the exact one and the key they
/// share, named as the policy; `None` without redis-server.
fn leasing(policy: &Policy, lease: Lease) -> Option<(Server, FakeClock, Vec<Node>, Node, Key)> {
    let (server, clock) = started()?;
    let (nodes, exact) = fleet(&server.url(), &clock, policy, lease);
    Some((server, clock, nodes, exact, Key::text(policy.name())))
}

/// GCRA at 100,000 a second (T = 10 µs) with a burst of 1,000, on one tier of policy `hot`.
fn hot() -> Policy {
    Policy::single("hot", Quota::per_second(100_000).with_burst(1_000)).unwrap()
}

/// Policy `w`: `count` a minute in a fixed window.
fn window(count: u64) -> Policy {
    fixed_window("w", "minute", Quota::per_minute(count))
}

/// Checks one unit at a time on `node` until one is refused: the admitted decisions, and the
/// refusal.
async fn until_refused(node: &Node, key: &Key) -> (Vec<Decision>, Decision) {
    let mut admitted = Vec::new();
    loop {
        let d = check(node, key, 1).await;
        if !d.is_allowed() {
            return (admitted, d);
        }
        admitted.push(d);
    }
}

/// Whether node `i` asks for a unit at step `step` (1 ms each): every node asks often but not
/// always, and node 3 pauses for 40 ms of every 250, so blocks end unspent and come back.
/// For 380 ms of every 500 the fleet is quiet (node 0 asks every 3 ms), so that buckets
/// refill while it holds a block, and then all ask at once.
fn demands(i: usize, step: u64) -> bool {
    let every = [1, 2, 3, 1][i];
    if (100..480).contains(&(step % 500)) {
        return i == 0 && step % 3 == 0;
    }
    step % every == 0 && !(i == 3 && step % 250 < 40)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_leasing_instances_admit_at_most_the_limit_in_every_fixed_window() {
    let policy = fixed_window("hot", "second", Quota::per_second(1_000));
    let lease = Lease::new().max_block(32).lifetime(Duration::from_millis(100));
    let Some((_server, clock, nodes, _exact, key)) = leasing(&policy, lease) else { return };
    // Even windows: quiet until their last 40 ms, when every node asks every millisecond (so
    // blocks grow, and are held when the window ends); odd windows: every node asks every
    // millisecond, 4,000 units for a limit of 1,000.
    let demands = |_: usize, step: u64| (step / 1_000) % 2 == 1 || step % 1_000 >= 960;
    let admitted = hammer(&nodes, &clock, &key, 6_000, demands).await;
    let mut per_window = std::collections::BTreeMap::new();
    for t in &admitted {
        *per_window.entry((t / S) % 1_000).or_insert(0u64) += 1;
    }
    assert_eq!(per_window.len(), 6, "{per_window:?}");
    for (window, n) in &per_window {
        assert!(*n <= 1_000, "window {window}: {n} admitted, limit 1,000");
        if window % 2 == 1 {
            // Demand exceeds the limit: what blocks strand at the window's end is under 3 %.
            assert!(*n >= 970, "window {window}: {n} admitted, utilization under 97 %");
        } else {
            assert_eq!(*n, 160, "window {window}: every ask of the last 40 ms admitted");
        }
    }
    let stats: Vec<_> = nodes.iter().map(|n| n.1.lease_stats()).collect();
    let local: u64 = stats.iter().map(|s| s.decided_locally).sum();
    assert!(local > admitted.len() as u64 / 2, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_leasing_instances_keep_gcra_within_the_stated_bound() {
    four_gcra_instances_within_the_bound(Lease::new()).await;
}

/// The same with the next block asked for ahead of need: the bound is the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_prefetching_instances_keep_gcra_within_the_same_bound() {
    four_gcra_instances_within_the_bound(Lease::new().prefetch(true)).await;
}

/// The same with blocks leased from the key's schedule (with and without prefetching): the
/// bound is the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_instances_leasing_the_schedule_keep_gcra_within_the_same_bound() {
    four_gcra_instances_within_the_bound(Lease::new().schedule(true)).await;
    four_gcra_instances_within_the_bound(Lease::new().schedule(true).prefetch(true)).await;
}

async fn four_gcra_instances_within_the_bound(lease: Lease) {
    let prefetch = lease.prefetches();
    // T = 2 ms, burst 50.
    let policy = Policy::single("hot", Quota::per_second(500).with_burst(50)).unwrap();
    let lease = lease.max_block(8).lifetime(Duration::from_millis(30));
    let Some((_server, clock, nodes, _exact, key)) = leasing(&policy, lease) else { return };
    let admitted = hammer(&nodes, &clock, &key, 3_000, demands).await;
    let (burst, t) = (50u64, 2 * MS);
    let bound = lease.bound(N as u64);
    assert_eq!(bound, 32);
    let worst_extra = each_tier_within(&admitted, &[(burst, t)], bound, "")[0];
    let run = burst + 2_999 * MS / t;
    assert!(admitted.len() as u64 <= run + bound, "{} admitted", admitted.len());
    let stats: Vec<_> = nodes.iter().map(|n| n.1.lease_stats()).collect();
    assert!(stats.iter().map(|s| s.decided_locally).sum::<u64>() > 0);
    let prefetched: u64 = stats.iter().map(|s| s.prefetched).sum();
    assert_eq!(prefetched > 0, prefetch, "{stats:?}");
    eprintln!(
        "gcra (prefetch {prefetch}, schedule {}): {} admitted, worst extra over any interval \
         {worst_extra} (bound {bound}), {prefetched} prefetches",
        lease.schedules(),
        admitted.len()
    );
}

/// Waits (in real time, 5 s at most) until `node` has been granted `grants` blocks: a
/// prefetch runs in the background.
async fn granted(node: &(RedisStore, RedisPolicy), grants: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while node.1.lease_stats().grants < grants {
        assert!(std::time::Instant::now() < deadline, "{:?}", node.1.lease_stats());
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// With prefetching, an instance asks for a key's next block when half of the block it asks
/// for is spent (once its blocks have grown to 16 units), topping what it holds up to
/// twice that block and at most the largest (64): its checks never call Redis themselves,
/// and it never holds more than 64 units.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefetching_instance_asks_for_the_next_block_when_half_is_spent() {
    let lease = Lease::new().max_block(64).lifetime(Duration::from_millis(100)).prefetch(true);
    let Some((_server, _clock, nodes, exact, key)) = leasing(&hot(), lease) else { return };
    let node = &nodes[0];
    let mut started = Vec::new();
    for check_no in 1..=200u64 {
        let before = node.1.lease_stats();
        assert!(check(node, &key, 1).await.is_allowed(), "check {check_no}");
        let after = node.1.lease_stats();
        if after.prefetched > before.prefetched {
            started.push(check_no);
            granted(node, before.grants + 1).await;
        } else {
            assert_eq!(
                after.grants,
                before.grants + u64::from(check_no <= 16 && check_no.is_power_of_two())
            );
        }
        let stats = node.1.lease_stats();
        // What this instance holds: granted, not admitted (the clock stands still).
        assert!(stats.units_granted - check_no <= 64, "check {check_no}: {stats:?}");
        assert_eq!(left(&exact, &key).await, 1_000 - stats.units_granted);
    }
    // Blocks of 1, 2, 4, 8, then 16 (checks 16 to 31) called for by the checks; from then on
    // prefetches: when 8 of 16 are left (24 asked: 32 held), 16 of 32 (48: 64 held), then
    // 32 of 64 (32: 64 held), every 32 checks.
    assert_eq!(started, [23, 39, 71, 103, 135, 167, 199]);
    let stats = node.1.lease_stats();
    assert_eq!((stats.decided_on_redis, stats.prefetched, stats.grants), (5, 7, 12));
    assert_eq!(stats.units_granted, 31 + 24 + 48 + 5 * 32);
}

/// One instance at a key's rate (100,000 a second, T = 10 µs, a burst of 1,000; a useful
/// block is 64 units, 640 µs of refill): it takes what the key has, then refuses by itself
/// until a useful block is back, with that wait as `retry_after`, and calls Redis once per
/// block. GCRA (whole units) and the buckets (the general script) alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_keys_rate_an_instance_waits_for_a_useful_block_without_calling() {
    let Some(server) = Server::start("redis-server") else { return };
    for algorithm in [Algorithm::Gcra, Algorithm::TokenBucket, Algorithm::LeakyBucket] {
        let clock = FakeClock::new();
        clock.set(1_000 * S);
        let policy = Policy::builder("hot")
            .algorithm(algorithm)
            .tier("second", Quota::per_second(100_000).with_burst(1_000))
            .build()
            .unwrap();
        let lease = Lease::new().max_block(64).lifetime(Duration::from_millis(100));
        let (nodes, exact) = fleet(&server.url(), &clock, &policy, lease);
        let node = &nodes[0];
        let key = Key::text("hot");
        // Blocks of 1, 2, ... 32, then 64 while the key has 64 (14 of them): 959 units, 20
        // calls. The last leaves 41 in Redis, a useful block 23 units (230 µs) away.
        let (admitted, refused) = until_refused(node, &key).await;
        assert_eq!(admitted.len(), 959, "{algorithm:?}");
        let stats = node.1.lease_stats();
        assert_eq!((stats.grants, stats.decided_on_redis, stats.refused_locally), (20, 20, 1));
        assert_eq!(refused.outcome(), Outcome::Limited);
        assert_eq!(refused.retry_after(), Some(Duration::from_micros(230)), "{algorithm:?}");
        assert_eq!(refused.tiers()[0].remaining(), 0);
        assert!(refused.tiers()[0].is_violated());
        assert_eq!(refused.source(), Source::Store);
        // Nothing is lost: the 41 units wait in Redis.
        assert_eq!(left(&exact, &key).await, 41);
        // 100 µs on, the same refusal, 100 µs shorter, still with no call.
        clock.advance(Duration::from_micros(100));
        let d = check(node, &key, 1).await;
        assert_eq!(d.retry_after(), Some(Duration::from_micros(130)));
        assert_eq!(node.1.lease_stats().decided_on_redis, 20);
        // At the instant, one call takes the useful block: 64 units, then a wait of 640 µs.
        clock.advance(Duration::from_micros(130));
        for round in 0..5 {
            for i in 0..64 {
                assert!(check(node, &key, 1).await.is_allowed(), "round {round}, check {i}");
            }
            let d = check(node, &key, 1).await;
            assert_eq!(d.retry_after(), Some(Duration::from_micros(640)), "round {round}");
            assert_eq!(left(&exact, &key).await, 0);
            clock.advance(Duration::from_micros(640));
        }
        let stats = node.1.lease_stats();
        assert_eq!((stats.decided_on_redis, stats.refused_locally), (25, 7), "{algorithm:?}");
        assert_eq!(stats.units_granted, 959 + 5 * 64);
    }
}

/// An instance whose lease call Redis refuses (another took everything) while it asks for
/// blocks of 64 waits for its share: `useful / 0` times the wait for a useful block (640 µs),
/// at most half the burst's refill (5 ms), and says so in `retry_after`, then and after,
/// with no call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_lease_call_is_waited_out_with_that_retry() {
    let lease = Lease::new().max_block(64).lifetime(Duration::from_millis(100));
    let Some((_server, clock, nodes, exact, key)) = leasing(&hot(), lease) else { return };
    // Blocks of 1 to 64, all spent: 127 units.
    for _ in 0..127 {
        assert!(check(&nodes[0], &key, 1).await.is_allowed());
    }
    // Another instance takes the rest.
    let mut taken = 0;
    while check(&exact, &key, 1).await.is_allowed() {
        taken += 1;
    }
    assert_eq!(taken, 1_000 - 127);
    let d = check(&nodes[0], &key, 1).await;
    assert_eq!(d.outcome(), Outcome::Limited);
    assert_eq!(d.retry_after(), Some(Duration::from_millis(5)));
    assert_eq!(d.tiers()[0].retry_after(), Some(Duration::from_millis(5)));
    let calls = nodes[0].1.lease_stats().decided_on_redis;
    // At once: the wait answers, not the exact refusal (the next unit in 10 µs).
    let d = check(&nodes[0], &key, 1).await;
    assert_eq!(d.retry_after(), Some(Duration::from_millis(5)));
    clock.advance(Duration::from_millis(1));
    let d = check(&nodes[0], &key, 1).await;
    assert_eq!(d.retry_after(), Some(Duration::from_millis(4)));
    clock.advance(Duration::from_millis(4));
    assert!(check(&nodes[0], &key, 1).await.is_allowed());
    let stats = nodes[0].1.lease_stats();
    assert_eq!((stats.decided_on_redis, stats.refused_locally), (calls + 1, 2));
}

/// Asserts that over every interval of the admission instants `admitted` (ascending, ns), each
/// GCRA tier `(burst, T in ns)` admitted at most what exact GCRA allows plus `bound`; the most
/// each tier admitted over exact GCRA. `what` prefixes a failure's message.
fn each_tier_within(admitted: &[u64], tiers: &[(u64, u64)], bound: u64, what: &str) -> Vec<i64> {
    let mut worst = vec![0i64; tiers.len()];
    for (k, &(burst, t)) in tiers.iter().enumerate() {
        for i in 0..admitted.len() {
            for j in i..admitted.len() {
                let count = (j - i + 1) as u64;
                let exact = burst + (admitted[j] - admitted[i]) / t;
                worst[k] = worst[k].max(count as i64 - exact as i64);
                assert!(
                    count <= exact + bound,
                    "{what}tier {k}: {count} admitted in [{}, {}] ns: GCRA allows {exact}, the \
                     bound {bound} more",
                    admitted[i],
                    admitted[j]
                );
            }
        }
    }
    worst
}

/// Two GCRA tiers whose conformance instants differ (T = 2 ms with a burst of 20, and
/// T = 4 ms with a burst of 50: the first binds in bursts, the second at length), four
/// instances leasing the schedule with prefetching: each tier keeps its own bound over every
/// interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_instances_leasing_the_schedule_keep_each_of_two_gcra_tiers_within_the_bound() {
    let policy = Policy::builder("two")
        .tier("fast", Quota::per_second(500).with_burst(20))
        .tier("slow", Quota::per_second(250).with_burst(50))
        .build()
        .unwrap();
    let lease =
        Lease::new().max_block(8).lifetime(Duration::from_millis(30)).schedule(true).prefetch(true);
    let Some((_server, clock, nodes, _exact, key)) = leasing(&policy, lease) else { return };
    let admitted = hammer(&nodes, &clock, &key, 3_000, demands).await;
    let bound = lease.bound(N as u64);
    let worst = each_tier_within(&admitted, &[(20, 2 * MS), (50, 4 * MS)], bound, "");
    let stats: Vec<_> = nodes.iter().map(|n| n.1.lease_stats()).collect();
    assert!(stats.iter().map(|s| s.decided_locally).sum::<u64>() > 0, "{stats:?}");
    eprintln!("two tiers: {} admitted, worst extra {worst:?} (bound {bound})", admitted.len());
}

/// Two GCRA tiers whose faster one fills its burst (40 units at 8,000 a second: 5 ms) in less
/// than the horizon (half the lifetime, 15 ms), beside a slower one (4,000 a second, a burst
/// of 400) that the units the instances hold ahead span further (4 × 8 units of 250 µs: 8 ms,
/// past the 5 ms the horizon once was): four instances leasing the schedule, with and without
/// prefetching, at about ten times the slow tier's rate with pauses (blocks end unspent and
/// come back, the buckets refill); each tier keeps its own bound over every interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_horizon_past_the_fast_tiers_fill_keeps_each_tier_within_the_bound() {
    let Some(server) = Server::start("redis-server") else { return };
    let policy = Policy::builder("two")
        .tier("fast", Quota::per_second(8_000).with_burst(40))
        .tier("slow", Quota::per_second(4_000).with_burst(400))
        .build()
        .unwrap();
    for prefetch in [false, true] {
        let clock = FakeClock::new();
        clock.set(1_000 * S);
        let lease = Lease::new()
            .max_block(8)
            .lifetime(Duration::from_millis(30))
            .schedule(true)
            .prefetch(prefetch);
        let (nodes, exact) = fleet(&server.url(), &clock, &policy, lease);
        let key = Key::text("two");
        // Steps of 100 µs: every node asks (node 2 every other step), but node 3 pauses for
        // 40 ms of every 100, and for 80 ms of every 250 node 0 alone asks, every 3 ms.
        let (mut admitted, mut slow_wait) = (Vec::new(), 0u64);
        for step in 0..3_000u64 {
            let now = clock.now();
            let asks = (0..N).filter(|&i| {
                if (1_500..2_300).contains(&(step % 2_500)) {
                    return i == 0 && step % 30 == 0;
                }
                !(i == 2 && step % 2 == 1 || i == 3 && step % 1_000 < 400)
            });
            let decided = futures_join(asks.map(|i| check(&nodes[i], &key, 1))).await;
            admitted.extend(decided.iter().filter(|d| d.is_allowed()).map(|_| now));
            // How long an exact check of a unit waits on the slow tier (see
            // `instances_at_the_keys_rate`).
            let reset = duration_ns(check(&exact, &key, 0).await.tiers()[1].reset_after());
            slow_wait = slow_wait.max((reset + 250_000).saturating_sub(400 * 250_000));
            clock.advance(Duration::from_micros(100));
        }
        // The instances leased the slow tier's schedule past the 5 ms the horizon once was, by
        // what they hold (32 units: 8 ms) at most.
        assert!((5_250_001..=8_250_000).contains(&slow_wait), "{slow_wait} ns");
        let bound = lease.bound(N as u64);
        let tiers = [(40, 125_000), (400, 250_000)];
        let worst = each_tier_within(&admitted, &tiers, bound, &format!("prefetch {prefetch}, "));
        let stats: Vec<_> = nodes.iter().map(|n| n.1.lease_stats()).collect();
        assert!(stats.iter().map(|s| s.decided_locally).sum::<u64>() > 0, "{stats:?}");
        eprintln!(
            "two tiers, horizon past the fast fill (prefetch {prefetch}): {} admitted, worst \
             extra {worst:?} (bound {bound}), exact checks told to wait {slow_wait} ns at most \
             on the slow tier: {stats:?}",
            admitted.len()
        );
    }
}

/// A weighted check refused while the instance waits for a useful block smaller than its
/// cost: the instance's own refusals never say less than Redis's exact wait for that cost.
#[tokio::test]
async fn a_weighted_check_is_never_told_to_retry_before_redis_would_admit_it() {
    // 100 a second: a useful block (1 ms of refill) is one unit.
    let policy = Policy::single("weighted", Quota::per_second(100)).unwrap();
    let lease = Lease::new().max_block(64).lifetime(Duration::from_millis(100));
    let Some((_server, clock, nodes, exact, key)) = leasing(&policy, lease) else { return };
    while check(&exact, &key, 1).await.is_allowed() {}
    for step in [0, 2, 7, 20] {
        clock.set(1_000 * S + step * 1_000_000);
        let leased = check(&nodes[0], &key, 5).await;
        let told = check(&exact, &key, 5).await;
        assert_eq!(leased.outcome(), Outcome::Limited, "at {step} ms");
        assert_eq!(told.outcome(), Outcome::Limited);
        // Redis admits 5 units 50 ms after the key was emptied.
        assert_eq!(told.retry_after(), Some(Duration::from_millis(50 - step)));
        assert!(leased.retry_after() >= told.retry_after(), "at {step} ms: {leased:?}");
    }
}

/// The same leasing the key's schedule: Redis refuses a block of 6 units (60 ms) that does
/// not fit the horizon (50 ms), and says a useful block fits again in 10 ms; the checks this
/// instance refuses meanwhile are told when their own units conform, as an exact check is,
/// not when the instance asks Redis again.
#[tokio::test]
async fn a_weighted_check_leasing_the_schedule_is_never_told_to_retry_before_it_conforms() {
    // T = 10 ms, a burst of 100; the horizon is half the lifetime, 50 ms.
    let policy = Policy::single("weighted", Quota::per_second(100)).unwrap();
    let lease = Lease::new().max_block(64).lifetime(Duration::from_millis(100)).schedule(true);
    let Some((_server, clock, nodes, exact, key)) = leasing(&policy, lease) else { return };
    while check(&exact, &key, 1).await.is_allowed() {}
    for step in [0, 2, 7] {
        clock.set(1_000 * S + step * 1_000_000);
        let leased = check(&nodes[0], &key, 6).await;
        let told = check(&exact, &key, 6).await;
        assert_eq!(leased.outcome(), Outcome::Limited, "at {step} ms");
        assert_eq!(told.retry_after(), Some(Duration::from_millis(60 - step)));
        assert_eq!(leased.retry_after(), told.retry_after(), "at {step} ms: {leased:?}");
    }
    let stats = nodes[0].1.lease_stats();
    assert_eq!((stats.decided_on_redis, stats.refused_locally), (1, 2));
    // 10 ms on, 6 units fit the horizon: the instance leases them and refuses the check
    // until the last conforms, 50 ms on.
    clock.set(1_000 * S + 10_000_000);
    let leased = check(&nodes[0], &key, 6).await;
    assert_eq!(leased.retry_after(), Some(Duration::from_millis(50)), "{leased:?}");
    // That check called Redis: it is not one refused locally.
    let stats = nodes[0].1.lease_stats();
    assert_eq!((stats.grants, stats.decided_on_redis, stats.refused_locally), (1, 2, 2));
}

/// Four instances at ten times a key's rate (100,000 a second, a burst of 1,000; useful
/// blocks of 64): the bound holds over every interval, the key's rate is used (≥ 97 %), and
/// Redis sees about one call per instance per useful block's refill, not one per check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_instances_at_the_keys_rate_use_it_within_the_bound_with_few_calls() {
    let Some(run) = instances_at_the_keys_rate(N, Lease::new(), 1_000).await else { return };
    let calls = run.calls;
    // About one call per useful block (64 units: 328 blocks in the run), where one call per
    // check would be 50,000: at most twice that, and 7 calls per instance while its blocks
    // double to 64. (Without waiting longer for a share, each instance calls once per useful
    // block's refill: about 4 × 313.)
    assert!(calls <= 2 * 328 + 7 * N as u64, "{calls} calls");
}

/// The same, leasing from the key's schedule: each call takes a whole useful block (the
/// units that come next, also those that conform later), so Redis sees one call per useful
/// block, and a few more while the blocks grow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_instances_leasing_the_schedule_call_once_per_useful_block() {
    let Some(run) = instances_at_the_keys_rate(N, Lease::new().schedule(true), 1_000).await else {
        return;
    };
    let calls = run.calls;
    assert!(calls <= 328 + 7 * N as u64 + 8, "{calls} calls");
    // An exact check of the key waits for the units the instances hold ahead (4 × 64
    // intervals of 10 µs at most) and its own.
    assert!(run.exact_wait <= (4 * 64 + 1) * 10_000, "{} ns", run.exact_wait);
}

/// Eight instances leasing the schedule of a key whose burst (256 units) fills in 2.56 ms,
/// less than their useful blocks span together (8 × 64 units): the horizon is half the
/// lifetime (50 ms), not the burst's fill time, so each call takes a whole useful block, and
/// the instances do not find the horizon full and call again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_instances_leasing_the_schedule_of_a_small_burst_call_once_per_useful_block() {
    let Some(run) = instances_at_the_keys_rate(8, Lease::new().schedule(true), 256).await else {
        return;
    };
    let calls = run.calls;
    // 256 + 1,999 × 10 units admitted at most: 317 blocks of 64.
    assert!(calls <= 317 + 7 * 8 + 8, "{calls} calls");
    // What that costs exact checks of the key (another instance in exact mode, or these
    // instances' shaping checks): the key's TAT runs past "full" by the units the instances
    // hold ahead, so an exact check of one unit waits for them (8 × 64 intervals of 10 µs at
    // most, within the horizon of 50 ms) and its own interval, longer than the burst takes
    // to fill (2.56 ms), where with every instance exact it would wait one interval.
    let most = (8 * 64 + 1) * 10_000;
    assert!((2_560_000..=most).contains(&run.exact_wait), "{} ns", run.exact_wait);
}

/// What a run of [`instances_at_the_keys_rate`] saw.
struct Run {
    /// Calls the instances made to Redis.
    calls: u64,
    /// The longest an exact check of one unit, made after a step's checks, was told to wait
    /// (ns, from the key's TAT as an exact query of it reports).
    exact_wait: u64,
}

/// `n` instances at ten times the key's rate (`10 / n` times it each), a burst of `burst`: the
/// bound holds over every interval and the key's rate is used (≥ 97 %); the calls the
/// instances made to Redis, and how long exact checks of the key were told to wait (`None`
/// without a redis-server).
async fn instances_at_the_keys_rate(n: usize, lease: Lease, burst: u64) -> Option<Run> {
    let server = Server::start("redis-server")?;
    let clock = FakeClock::new();
    clock.set(1_000 * S);
    let policy = Policy::single("hot", Quota::per_second(100_000).with_burst(burst)).unwrap();
    let lease = lease.max_block(64).lifetime(Duration::from_millis(100));
    let (nodes, exact) = fleet_of(n, &server.url(), &clock, &policy, lease);
    let key = Key::text("hot");
    let t = 10_000u64;
    // Steps of 100 µs (10 units of refill); the instances ask 100 times a step in all.
    let (step, steps, asks) = (100_000u64, 2_000u64, 100 / n);
    let (mut per_step, mut exact_wait) = (Vec::new(), 0u64);
    for _ in 0..steps {
        let all = (0..n).flat_map(|i| (0..asks).map(move |_| i)).map(|i| check(&nodes[i], &key, 1));
        let decided = futures_join(all).await;
        per_step.push(decided.iter().filter(|d| d.is_allowed()).count() as u64);
        // A query (it charges nothing): GCRA's TAT is now + `reset_after`, and a unit
        // conforms once TAT + T - burst × T is past.
        let reset = duration_ns(check(&exact, &key, 0).await.tiers()[0].reset_after());
        exact_wait = exact_wait.max((reset + t).saturating_sub(burst * t));
        clock.advance(Duration::from_nanos(step));
    }
    let bound = lease.bound(n as u64);
    // Every interval of whole steps [i, j]: at most burst + ⌊L / T⌋ + N·B.
    let mut prefix = vec![0u64];
    for a in &per_step {
        prefix.push(prefix.last().unwrap() + a);
    }
    for i in 0..per_step.len() {
        for j in i..per_step.len() {
            let count = prefix[j + 1] - prefix[i];
            let exact = burst + (j - i) as u64 * step / t;
            assert!(count <= exact + bound, "steps {i}..={j}: {count} admitted, {exact} + {bound}");
        }
    }
    let admitted = prefix[per_step.len()];
    // What exact GCRA admits over the run: the burst and the refill up to the last step.
    let allowed = burst + (steps - 1) * step / t;
    assert!(admitted * 100 >= allowed * 97, "{admitted} admitted of {allowed}: under 97 %");
    let stats: Vec<_> = nodes.iter().map(|n| n.1.lease_stats()).collect();
    let calls: u64 = stats.iter().map(|s| s.decided_on_redis).sum();
    let held: u64 = stats.iter().map(|s| s.refused_locally).sum();
    assert!(held > admitted, "{stats:?}");
    eprintln!(
        "schedule {}: {admitted} admitted of {allowed}, {calls} calls, {held} refused while \
         waiting, exact checks told to wait {exact_wait} ns at most: {stats:?}",
        lease.schedules()
    );
    Some(Run { calls, exact_wait })
}

/// One instance leasing a key's schedule (100,000 a second, T = 10 µs, a burst of 1,000;
/// useful blocks of 64): when the key has less than a useful block, a call takes one anyway,
/// and each unit is admitted at the instant it conforms, exactly, with the wait for the next
/// as `retry_after` and `remaining` the units that conform now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_leasing_the_schedule_admits_each_unit_when_it_conforms() {
    let lease = Lease::new().max_block(64).lifetime(Duration::from_millis(100)).schedule(true);
    let Some((_server, clock, nodes, exact, key)) = leasing(&hot(), lease) else { return };
    let node = &nodes[0];
    // Blocks of 1, 2, ... 32, then 64 while the key has 64 (959 units, 20 calls); the 21st
    // call finds 41 and takes 64: 41 that conform now, then one every 10 µs.
    let (admitted, refused) = until_refused(node, &key).await;
    assert_eq!(admitted.len(), 1_000);
    assert_eq!(admitted[999].tiers()[0].remaining(), 0, "the last of the 41");
    let stats = node.1.lease_stats();
    assert_eq!((stats.grants, stats.decided_on_redis, stats.refused_locally), (21, 21, 1));
    assert_eq!(stats.units_granted, 959 + 64);
    assert_eq!(refused.outcome(), Outcome::Limited);
    assert_eq!(refused.retry_after(), Some(Duration::from_micros(10)));
    assert_eq!(refused.tiers()[0].remaining(), 0);
    assert!(refused.tiers()[0].is_violated());
    // The key's schedule is taken 230 µs past its burst: an exact check has nothing.
    assert_eq!(left(&exact, &key).await, 0);
    let d = check(&exact, &key, 1).await;
    assert_eq!(d.retry_after(), Some(Duration::from_micros(240)));
    // 45 µs on, 4 units conform: admitted, counting down, then the wait for the 5th.
    clock.advance(Duration::from_micros(45));
    for remaining in (0..4).rev() {
        let d = check(node, &key, 1).await;
        assert!(d.is_allowed());
        assert_eq!(d.tiers()[0].remaining(), remaining);
    }
    let d = check(node, &key, 1).await;
    assert_eq!(d.retry_after(), Some(Duration::from_micros(5)));
    // The other 19, one every 10 µs, each refused 1 ns before its instant.
    clock.advance(Duration::from_micros(5));
    for i in 0..19 {
        assert!(check(node, &key, 1).await.is_allowed(), "unit {i}");
        clock.advance(Duration::from_nanos(10_000 - 1));
        let d = check(node, &key, 1).await;
        assert_eq!(d.retry_after(), Some(Duration::from_nanos(1)), "unit {i}");
        clock.advance(Duration::from_nanos(1));
    }
    // The block is spent, and it is 240 µs: the next check takes the next 64 units of the
    // schedule, of which the first conforms now (its own), the second in 10 µs.
    let d = check(node, &key, 1).await;
    assert!(d.is_allowed());
    assert_eq!(d.tiers()[0].remaining(), 0);
    let d = check(node, &key, 1).await;
    assert_eq!(d.retry_after(), Some(Duration::from_micros(10)));
    let stats = node.1.lease_stats();
    assert_eq!((stats.grants, stats.decided_on_redis), (22, 22));
    assert_eq!(stats.units_granted, 959 + 2 * 64);
    // Admitted in 240 µs: the burst and 24 units of refill, as exact GCRA.
    assert_eq!(admitted.len() + 4 + 19 + 1, 1_000 + 24);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_grow_with_demand_and_come_back_when_dropped() {
    let lease = Lease::new().max_block(16).lifetime(Duration::from_secs(10));
    let Some((_server, _clock, mut nodes, exact, key)) = leasing(&window(100), lease) else {
        return;
    };
    // Blocks of 1, 2, 4 and 8 units for 8 checks: 15 charged, 8 spent, 7 held.
    let mut remaining = Vec::new();
    for _ in 0..8 {
        let d = check(&nodes[0], &key, 1).await;
        assert!(d.is_allowed());
        remaining.push(d.tiers()[0].remaining());
    }
    // Every check reports what exact mode would: Redis's rest at the last lease call plus
    // what this instance still holds of its block (never the block alone: the key had 85 to
    // 99 left throughout).
    assert_eq!(remaining, [99, 98, 97, 96, 95, 94, 93, 92]);
    let stats = nodes[0].1.lease_stats();
    assert_eq!((stats.grants, stats.units_granted, stats.decided_locally), (4, 15, 4));
    assert_eq!(left(&exact, &key).await, 85);
    // Dropping the binding gives the 7 unspent units back.
    let (store, bound) = nodes.remove(0);
    drop(bound);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while left(&exact, &key).await != 92 {
        assert!(std::time::Instant::now() < deadline, "the block was not given back");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(store);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_is_never_spent_after_its_lifetime_and_its_rest_comes_back() {
    let lease = Lease::new().max_block(4).lifetime(Duration::from_millis(50));
    let Some((_server, clock, nodes, exact, key)) = leasing(&window(100), lease) else { return };
    for _ in 0..4 {
        assert!(check(&nodes[0], &key, 1).await.is_allowed());
    }
    // Blocks of 1, 2, then 4 (one spent): 3 held.
    assert_eq!(left(&exact, &key).await, 93);
    let before = nodes[0].1.lease_stats();
    // Within the lifetime, from the block; at its end, not.
    clock.advance(Duration::from_millis(49));
    assert!(check(&nodes[0], &key, 1).await.is_allowed());
    assert_eq!(nodes[0].1.lease_stats().decided_locally, before.decided_locally + 1);
    clock.advance(Duration::from_millis(1));
    let now = clock.now();
    assert_eq!(
        nodes[0].0.check_sync(&nodes[0].1, Check::new(&key, 1)).map(|v| v.unwrap().decision),
        None,
        "a block is not spent at the end of its lifetime ({now} ns)"
    );
    // The sweeper's work, done now: the 2 units left come back.
    nodes[0].1.return_ended_leases().await;
    assert_eq!(left(&exact, &key).await, 95);
    assert_eq!(nodes[0].1.lease_stats().units_returned, 2);
    // The next block is sized to what was spent of the last (2 of 4).
    assert!(check(&nodes[0], &key, 1).await.is_allowed());
    assert_eq!(left(&exact, &key).await, 93);
}

/// The rest of a block given back by the sweeper (here `return_ended_leases`, its work done
/// now) is given back by this instance: a refusal of the key held here is forgotten, as when
/// the next block gives the rest back, and the next check asking the same is decided by
/// Redis, which has the units again (a shaping check, which is exact in lease mode).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_given_back_by_the_sweeper_forgets_the_keys_refusal() {
    let lease = Lease::new().max_block(4).lifetime(Duration::from_millis(50));
    let Some((_server, clock, nodes, exact, key)) = leasing(&window(100), lease) else { return };
    let node = &nodes[0];
    for _ in 0..4 {
        assert!(check(node, &key, 1).await.is_allowed());
    }
    // Blocks of 1, 2, then 4 (one spent): 3 held; the exact instance takes the other 93.
    let mut taken = 0;
    while check(&exact, &key, 1).await.is_allowed() {
        taken += 1;
    }
    assert_eq!(taken, 93);
    let shaped = Check::new(&key, 1).shape(Duration::from_millis(1));
    let d = node.0.check(&node.1, shaped).await.unwrap().decision;
    assert_eq!(d.outcome(), Outcome::Limited);
    assert_eq!(node.1.local_refusals(), 1);
    clock.advance(Duration::from_millis(50));
    node.1.return_ended_leases().await;
    assert_eq!(node.1.lease_stats().units_returned, 3);
    assert_eq!(left(&exact, &key).await, 3);
    assert_eq!(node.1.local_refusals(), 0);
    let d = node.0.check(&node.1, shaped).await.unwrap().decision;
    assert!(d.is_allowed(), "{d:?}");
    assert_eq!(d.tiers()[0].remaining(), 2);
    assert_eq!(node.1.refused_locally(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_block_gives_back_the_rest_of_the_last_in_the_same_call() {
    let policy = Policy::single("g", Quota::per_minute(60)).unwrap();
    let lease = Lease::new().max_block(8).lifetime(Duration::from_millis(10));
    let Some((_server, clock, nodes, exact, key)) = leasing(&policy, lease) else { return };
    for _ in 0..4 {
        assert!(check(&nodes[0], &key, 1).await.is_allowed());
    }
    assert_eq!(left(&exact, &key).await, 53, "blocks of 1, 2 and 4: 3 held");
    clock.advance(Duration::from_millis(10));
    // The block ended with 3 units left: given back, and a block of 1 (what was spent of the
    // last) taken, in one call. GCRA: 60 a minute refills a unit a second, none in 10 ms.
    let d = check(&nodes[0], &key, 1).await;
    assert!(d.is_allowed());
    assert_eq!(left(&exact, &key).await, 55);
    assert_eq!(d.tiers()[0].remaining(), 55);
    let stats = nodes[0].1.lease_stats();
    assert_eq!((stats.grants, stats.units_returned), (4, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn near_the_limit_blocks_shrink_to_one_unit_and_refusals_are_exact() {
    let lease = Lease::new().max_block(64).lifetime(Duration::from_secs(30));
    let Some((_server, _clock, nodes, exact, key)) = leasing(&window(10), lease) else { return };
    // A quarter of 10 at most: blocks of 1, 2, 1, 1, ... as the key runs down.
    for i in 0..10 {
        let node = &nodes[i % 2];
        assert!(check(node, &key, 1).await.is_allowed(), "check {i}");
    }
    assert_eq!(left(&exact, &key).await, 0);
    let d = check(&nodes[2], &key, 1).await;
    assert_eq!(d.outcome(), Outcome::Limited);
    let reference = check(&exact, &key, 1).await;
    assert_eq!(d.retry_after(), reference.retry_after());
    assert_eq!(d.tiers()[0].remaining(), 0);
    let granted: u64 = nodes.iter().map(|n| n.1.lease_stats().units_granted).sum();
    assert_eq!(granted, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_is_decided_per_check_as_in_exact_mode() {
    let Some((mut server, clock)) = started() else { return };
    let policy = Policy::single("g", Quota::per_minute(600)).unwrap();
    let lease = Lease::new().max_block(4).lifetime(Duration::from_secs(30));
    let s = RedisStore::builder(server.url())
        .lease_policy("g", lease)
        .clock(clock.clone())
        .ttl_grace(Duration::from_secs(3600))
        .timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let b = s.bind(&policy).unwrap();
    let key = Key::text("k");
    for _ in 0..4 {
        assert!(s.check(&b, Check::new(&key, 1)).await.unwrap().decision.is_allowed());
    }
    // Blocks of 1, 2 and 4: 3 units held when Redis dies. They were charged: still spent.
    server.kill();
    for _ in 0..3 {
        let d = s.check(&b, Check::new(&key, 1)).await.unwrap().decision;
        assert_eq!((d.is_allowed(), d.source()), (true, Source::Store));
    }
    // The next block cannot be taken: the fallback decides, as in exact mode.
    let d = s.check(&b, Check::new(&key, 1)).await.unwrap().decision;
    assert_eq!((d.is_allowed(), d.source()), (true, Source::Fallback));
}

#[test]
fn policies_that_cannot_lease_are_refused_or_stay_exact() {
    let log = Policy::builder("log")
        .algorithm(Algorithm::SlidingLog)
        .tier("minute", Quota::per_minute(10))
        .build()
        .unwrap();
    let named = RedisStore::builder("redis://127.0.0.1:1/")
        .lease_policy("log", Lease::new())
        .build()
        .unwrap();
    assert!(matches!(named.bind(&log), Err(ConfigError::UnsupportedByStore { .. })));
    let every = RedisStore::builder("redis://127.0.0.1:1/").lease(Lease::new()).build().unwrap();
    assert_eq!(every.bind(&log).unwrap().lease(), None);
    let gcra = Policy::single("g", Quota::per_second(5)).unwrap();
    assert_eq!(every.bind(&gcra).unwrap().lease(), Some(Lease::new()));
    for bad in [Lease::new().max_block(0), Lease::new().lifetime(Duration::from_micros(10))] {
        let built = RedisStore::builder("redis://127.0.0.1:1/").lease(bad).build();
        assert!(matches!(built, Err(ConfigError::Invalid { setting: "lease", .. })));
    }
    // A policy with a lease on a `MemoryStore`: the memory store is local already.
    let memory = tollgate::store::MemoryStore::new();
    assert!(memory.bind(&gcra).is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticket_from_a_block_settles_in_redis() {
    let lease = Lease::new().max_block(8).lifetime(Duration::from_secs(10));
    let Some((_server, _clock, nodes, exact, key)) = leasing(&window(100), lease) else { return };
    let (s, b) = &nodes[0];
    let mut tickets = Vec::new();
    for _ in 0..5 {
        let v = s.check(b, Check::new(&key, 1).with_ticket()).await.unwrap();
        assert!(v.decision.is_allowed());
        tickets.push(v.ticket.expect("a ticket"));
    }
    // Blocks of 1, 2 and 4 (two spent): 7 charged, 5 admitted, checks 3 and 5 from blocks.
    assert_eq!(b.lease_stats().decided_locally, 2);
    assert_eq!(left(&exact, &key).await, 93);
    // Cancelling one decided from a block, and one that took a block, refunds in Redis.
    let fifth = tickets.pop().unwrap();
    s.settle(b, fifth, 0).await.unwrap();
    assert_eq!(left(&exact, &key).await, 94);
    let fourth = tickets.pop().unwrap();
    s.settle(b, fourth, 3).await.unwrap();
    assert_eq!(left(&exact, &key).await, 92, "settled at 3: 2 more charged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_leasing_instances_keep_a_calendar_day_across_midnight() {
    let Some(server) = Server::start("redis-server") else { return };
    let clock = FakeClock::new();
    let midnight = 20_000 * 86_400 * S;
    clock.set(midnight - 40 * MS);
    // A GCRA tier that never binds, so that only the day ends blocks.
    let policy = Policy::builder("daily")
        .tier("second", Quota::per_second(10_000))
        .calendar("day", tollgate::Calendar::per_day(300))
        .build()
        .unwrap();
    let lease = Lease::new().max_block(32).lifetime(Duration::from_secs(1));
    let (nodes, exact) = fleet(&server.url(), &clock, &policy, lease);
    let key = Key::text("hot");
    // Every node asks every millisecond: 160 units in the day's last 40 ms (blocks grow, and
    // are held at midnight), then 4,000 in the next day's first second for its 300.
    let admitted = hammer(&nodes, &clock, &key, 1_040, |_, _| true).await;
    let before = admitted.iter().filter(|t| **t < midnight).count();
    let after = admitted.len() - before;
    assert_eq!(before, 160);
    assert!(after <= 300, "{after} admitted in a day of 300");
    assert!(after >= 291, "{after} admitted: utilization under 97 %");
    let day = check(&exact, &key, 0).await.tiers()[1].remaining();
    assert_eq!(day as usize, 300 - after);
    let local: u64 = nodes.iter().map(|n| n.1.lease_stats().decided_locally).sum();
    assert!(local > admitted.len() as u64 / 2, "{local} of {} decided locally", admitted.len());
}

/// Two app instances behind the layer (which checks with a ticket), leasing one key: the fleet
/// admits the quota once, most checks are decided from blocks, and the metrics say so.
#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_leasing_app_instances_enforce_one_limit_over_http_and_count_their_leases() {
    let Some(server) = Server::start("redis-server") else { return };
    let prometheus = support::prometheus::handle();
    let policy = Policy::single("fleet-lease", Quota::per_hour(30)).unwrap();
    let lease = Lease::new().max_block(8).lifetime(Duration::from_secs(30));
    let mut apps = Vec::new();
    for _ in 0..2 {
        let store = RedisStore::builder(server.url())
            .lease_policy("fleet-lease", lease)
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        let layer = tollgate::RateLimitLayer::builder(policy.clone()).store(store).build().unwrap();
        let app =
            axum::Router::new().route("/", axum::routing::get(|| async { "ok" })).layer(layer);
        apps.push(support::serve(app).await);
    }
    let client = support::client();
    let (mut ok, mut limited) = (0, 0);
    // One at a time, alternately: each instance keeps asking, so what it holds is spent.
    for i in 0..100 {
        let reply = support::get(&client, &apps[i % 2].url("/"), &[]).await;
        match reply.status {
            http::StatusCode::OK => ok += 1,
            http::StatusCode::TOO_MANY_REQUESTS => limited += 1,
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!((ok, limited), (30, 70));
    let text = prometheus.render();
    let value = |series: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
    };
    let grants = value(r#"tollgate_lease_grants_total{policy="fleet-lease"}"#);
    let local = value(r#"tollgate_lease_checks_total{policy="fleet-lease",decided="local"}"#);
    // Every admission took a block (its call) or units of one (no call).
    assert_eq!(grants + local, 30);
    assert!(local > 0 && grants < 30, "grants {grants}, local {local}");
    assert!(text.contains(r#"tollgate_lease_block_units_count{policy="fleet-lease"}"#), "{text}");
}

/// On Redis Cluster: the lease script names only the key's state, in its slot; two leasing
/// instances admit each key's limit once, across the three masters, with concurrent checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leasing_instances_on_a_cluster_admit_each_keys_limit_once() {
    let Some(cluster) = Cluster::start() else { return };
    let policy = fixed_window("c", "minute", Quota::per_minute(50));
    let lease = Lease::new().max_block(16).lifetime(Duration::from_secs(30));
    let nodes = on_cluster(&cluster, &policy, lease);
    assert_eq!(asked_on_cluster(&nodes, 40).await, vec![50; 6]);
    let local: u64 = nodes.iter().map(|n| n.1.lease_stats().decided_locally).sum();
    assert!(local > 0);
}

/// The same on a GCRA key whose time stands still (nothing refills) with prefetching: the
/// blocks taken ahead, in the background, go to the key's own node too, and each key admits
/// its burst once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetching_instances_on_a_cluster_admit_each_keys_burst_once() {
    let Some(cluster) = Cluster::start() else { return };
    let policy = Policy::single("c", Quota::per_hour(400)).unwrap();
    let lease = Lease::new().max_block(64).lifetime(Duration::from_secs(30)).prefetch(true);
    let nodes = on_cluster(&cluster, &policy, lease);
    assert_eq!(asked_on_cluster(&nodes, 300).await, vec![400; 6]);
    let prefetched: u64 = nodes.iter().map(|n| n.1.lease_stats().prefetched).sum();
    assert!(prefetched > 0);
}
