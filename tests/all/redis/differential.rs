//! Differential traces: the same random requests through `MemoryStore` and `RedisStore`
//! (standalone, Valkey, Cluster) give identical decisions.

use super::*;

#[test]
fn standalone_decides_exactly_like_memory_store() {
    differential_on("redis-server", 256);
}

/// Clock steps back (NTP, a failover to a server whose clock is behind) between checks,
/// settlements and releases: a key decides at the later of now and its last charge (or
/// settlement of units) on both stores, so they answer alike.
#[test]
fn a_clock_stepping_back_decides_exactly_like_memory_store() {
    let Some(server) = Server::start("redis-server") else { return };
    differential_of(trace(true), 256, stores_on(&server, ""));
}

/// A trace the test above once drew (about 1 in 40 runs), kept: a sliding log of one request
/// per 2,028,818 ns settled up to 2 a nanosecond after its charge, the clock stepped back that
/// nanosecond, three shaped checks queued behind the entries, then policed checks.
#[test]
fn a_settled_up_log_after_the_clock_steps_back_decides_exactly_like_memory_store() {
    let w = 2_028_818;
    let check = |shape: Option<u64>| Step::Check { key: 2, cost: 1, costs: vec![1; 5], shape };
    let steps = vec![
        check(None),
        Step::Advance(1),
        Step::Settle { which: 0, cost: 2 },
        Step::Back(1),
        check(Some(w)),
        check(Some(2 * w)),
        check(Some(3 * w)),
        check(None),
        Step::Advance(1),
        check(None),
    ];
    replay_kept([Trace::new(Algorithm::SlidingLog, (vec![(1, w, 1)], vec![], 0, steps))]);
}

/// A trace the clock-step test drew (about 1 in 10 runs), kept: two GCRA tiers, a check
/// shaped behind the first, the first check's second tier settled up, its first refunded (the
/// key idle: Redis deletes it), the whole check settled to its charge (Redis writes the key
/// afresh), then the clock stepped back: a fresh tier's TAT is in the past on both stores.
#[test]
fn a_settlement_per_tier_then_a_step_back_decides_exactly_like_memory_store() {
    let check = |shape: Option<u64>| Step::Check { key: 0, cost: 1, costs: vec![1; 5], shape };
    let steps = vec![
        check(None),
        check(Some(1_000_000)),
        Step::SettleTier { which: 0, tier: 1, cost: 2 },
        Step::Advance(1_200_000),
        Step::SettleTier { which: 0, tier: 0, cost: 0 },
        Step::Settle { which: 0, cost: 1 },
        Step::Back(100_001),
    ];
    let tiers = vec![(1, 1_000_000, 1), (10, 1_000_000, 1)];
    replay_kept([Trace::new(Algorithm::Gcra, (tiers, vec![], 0, steps))]);
}

/// Another trace the clock-step test drew, kept: a fractional emission interval (9 per
/// millisecond) beside a whole one, a refund that leaves the key idle, one tier settled up.
#[test]
fn a_fresh_tier_beside_a_settled_one_decides_exactly_like_memory_store() {
    let check = |cost: u64| Step::Check { key: 0, cost, costs: vec![1; 5], shape: None };
    let steps = vec![
        check(1),
        check(1),
        check(6),
        Step::Advance(888_889),
        check(1),
        check(1),
        Step::Settle { which: 2, cost: 0 },
        Step::SettleTier { which: 0, tier: 0, cost: 2 },
        Step::Back(1),
    ];
    let tiers = vec![(9, 1_000_000, 9), (10, 1_000_000, 9)];
    replay_kept([Trace::new(Algorithm::Gcra, (tiers, vec![], 0, steps))]);
}

/// A trace the clock-step test drew (about 1 in 20 runs), kept, and its leaky-bucket twin: a
/// tier refunded to idle (Redis deletes the key), then settled up again (Redis writes the other
/// tier fresh), then the clock stepped back a nanosecond: a fresh bucket is full (empty) far in
/// the past on both stores, never as of now, which would project backwards.
#[test]
fn a_fresh_bucket_beside_a_settled_one_decides_exactly_like_memory_store() {
    let check = Step::Check { key: 0, cost: 1, costs: vec![1; 5], shape: None };
    let steps = vec![
        check,
        Step::Advance(10_000_000),
        Step::SettleTier { which: 0, tier: 0, cost: 0 },
        Step::SettleTier { which: 0, tier: 0, cost: 1 },
        Step::Back(1),
    ];
    let tiers = vec![(1, 10_000_000, 2), (3, 10_000_000, 1)];
    replay_kept(
        [Algorithm::LeakyBucket, Algorithm::TokenBucket]
            .map(|algorithm| Trace::new(algorithm, (tiers.clone(), vec![], 0, steps.clone()))),
    );
}

/// A calendar key charged, then the clock stepped back two hours (past the 60 s the calendar
/// windows sent reach either side of now): a shaped check, settlements up and down and policed
/// checks are decided at the key's last charge on both stores, the Redis calls sent again with
/// windows reaching it (they once failed: "the calendar windows sent do not cover").
#[test]
fn a_calendar_key_two_hours_ahead_of_the_clock_decides_exactly_like_memory_store() {
    let check = |shape: Option<u64>| Step::Check { key: 0, cost: 1, costs: vec![1; 5], shape };
    let hour = 3_600_000_000_000;
    let steps = vec![
        check(None),
        Step::Advance(hour / 2),
        check(None),
        Step::Back(2 * hour),
        check(Some(hour)),
        Step::SettleTier { which: 0, tier: 1, cost: 3 },
        check(None),
        Step::Settle { which: 1, cost: 0 },
        check(None),
        Step::Advance(hour),
        check(None),
    ];
    let start = instant("2025-10-26T00:00:00Z") + 3 * hour;
    replay_kept([(0, 0), (1, 1), (2, 2)].map(|(period, zone)| {
        let extra = vec![Extra::Calendar(3, period, zone)];
        Trace::new(Algorithm::Gcra, (vec![(10, 1_000_000_000, 10)], extra, start, steps.clone()))
    }));
}

#[test]
fn valkey_decides_exactly_like_memory_store() {
    differential_on("valkey-server", 64);
}

#[test]
fn cluster_decides_exactly_like_memory_store() {
    let Some(cluster) = Cluster::start() else { return };
    let urls = cluster.urls();
    differential(64, |clock, prefix| {
        fake_clock_store(RedisStore::cluster_builder(urls.clone()), clock, prefix)
    });
}

/// Every algorithm on its own, so a regression names the algorithm, on stores `store` makes
/// for a fake clock.
fn every_algorithm_admits_then_limits<St: Store>(store: impl Fn(FakeClock) -> St) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    for algorithm in Algorithm::ALL {
        let clock = FakeClock::new();
        let store = store(clock.clone());
        let policy = Policy::builder(algorithm.name())
            .algorithm(algorithm)
            .tier("fast", Quota::per_second(3))
            .tier("slow", Quota::per_minute(5))
            .build()
            .unwrap();
        let decide = |cost| {
            let limiter = Limiter::with_store(policy.clone(), store.clone()).expect("binds");
            async move { limiter.check(&Key::Global, cost).await.expect("the store answers") }
        };
        rt.block_on(async {
            let d: Decision = decide(3).await;
            assert!(d.is_allowed(), "{algorithm:?}");
            assert_eq!(d.tiers()[0].remaining(), 0, "{algorithm:?}");
            assert_eq!(d.tiers()[1].remaining(), 2, "{algorithm:?}");
            let d = decide(1).await;
            assert!(!d.is_allowed(), "{algorithm:?}");
            assert_eq!(d.violated_names(&policy).collect::<Vec<_>>(), ["fast"], "{algorithm:?}");
            // Two seconds: the sliding counter still weighs the whole previous window at 1 s.
            clock.advance(Duration::from_secs(2));
            assert!(decide(2).await.is_allowed(), "{algorithm:?}");
            let d = decide(1).await;
            assert_eq!(d.violated_names(&policy).collect::<Vec<_>>(), ["slow"], "{algorithm:?}");
        });
    }
}

/// [`every_algorithm_admits_then_limits`] on a `bin` server the test starts (skipped without it).
fn every_algorithm_admits_then_limits_on_a(bin: &str) {
    let Some(server) = Server::start(bin) else { return };
    let stores = stores_on(&server, "a:");
    every_algorithm_admits_then_limits(|clock| stores(clock, String::new()));
}

#[test]
fn every_algorithm_admits_then_limits_on_redis() {
    every_algorithm_admits_then_limits_on_a("redis-server");
}

#[test]
fn every_algorithm_admits_then_limits_in_memory() {
    every_algorithm_admits_then_limits(|clock| {
        MemoryStore::builder().clock(clock).build().unwrap()
    });
}

#[test]
fn every_algorithm_admits_then_limits_on_valkey() {
    every_algorithm_admits_then_limits_on_a("valkey-server");
}

#[test]
fn every_algorithm_admits_then_limits_on_a_cluster() {
    let Some(cluster) = Cluster::start() else { return };
    every_algorithm_admits_then_limits(|clock| {
        fake_clock_store(RedisStore::cluster_builder(cluster.urls()), clock, "a:".into())
    });
}
