//! Clocks: app servers whose clocks disagree, and clocks stepping back.

use super::*;

// ---------------------------------------------------------------------------------------------
// Clocks (SECURITY.md, "clock skew"): app servers whose clocks disagree, and a server clock
// that steps back.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skewed_app_clocks_loosen_a_limit_unless_time_comes_from_redis() {
    let Some(server) = Server::start("redis-server") else { return };
    let policy = Policy::single("skew", Quota::per_hour(10)).unwrap();
    let admitted = |a: RedisStore, b: RedisStore| {
        let policy = policy.clone();
        async move {
            let mut n = 0;
            for store in [a, b] {
                for _ in 0..10 {
                    n += usize::from(decide(&store, &policy, &Key::Global, 1).await.is_allowed());
                }
            }
            n
        }
    };
    // Two instances whose clocks are an hour apart, deciding on their own clocks: the one
    // ahead sees the other's charges as refilled, and the pair admits twice the limit.
    let (slow, fast) = (FakeClock::new(), FakeClock::new());
    slow.set(10_000_000_000_000);
    fast.set(10_000_000_000_000 + 3_600_000_000_000);
    let on = |clock: FakeClock| {
        fake_clock_store(RedisStore::builder(server.url()), clock, "skew1:".into())
    };
    assert_eq!(admitted(on(slow), on(fast)).await, 20);
    // The default, Redis's TIME: whatever the app servers' clocks say, the limit holds.
    let server_time = || RedisStore::builder(server.url()).prefix("skew2:").build().unwrap();
    assert_eq!(admitted(server_time(), server_time()).await, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_stepping_back_does_not_reopen_a_window() {
    let Some(server) = Server::start("redis-server") else { return };
    for algorithm in Algorithm::ALL {
        let clock = FakeClock::new();
        clock.set(10_500_000_000); // 10.5 s: the middle of window 10 of one second
        let store =
            fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "back:".into());
        let policy = Policy::builder(format!("back-{}", algorithm.name()))
            .algorithm(algorithm)
            .tier("t", Quota::per_second(3))
            .build()
            .unwrap();
        let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        assert!(decide(&store, &policy, &Key::Global, 3).await.is_allowed(), "{algorithm:?}");
        let memory = Limiter::with_store(policy.clone(), memory).unwrap();
        assert!(memory.check(&Key::Global, 3).await.unwrap().is_allowed(), "{algorithm:?}");
        // The clock steps back 0.6 s, into window 9, forgotten long ago.
        clock.set(9_900_000_000);
        let d = decide(&store, &policy, &Key::Global, 1).await;
        assert!(!d.is_allowed(), "{algorithm:?}: a step back reopened the limit");
        assert_eq!(d.tiers()[0].remaining(), 0, "{algorithm:?}");
        // The in-memory store decides alike.
        assert_eq!(memory.check(&Key::Global, 1).await.unwrap(), d, "{algorithm:?}");
    }
}

/// One step of a clock-step scenario.
#[derive(Debug, Clone, Copy)]
enum Tick {
    /// A check of `cost` this many nanoseconds after the scenario's start.
    At(u64, u64),
    /// A check of `cost` this many nanoseconds after the last admitted check (a step back when
    /// a later check was refused).
    Since(u64, u64),
}

const WEEK: u64 = 604_800_000_000_000;

/// Runs `ticks` through memory and Redis on one fake clock (starting on a window boundary of a
/// week), never back before the last admission; every decision must be the same in both.
/// Returns the decisions.
async fn both_stores(
    server: &Server,
    policy: &Policy,
    prefix: &str,
    ticks: &[Tick],
) -> Vec<Decision> {
    let start = 2811 * WEEK; // 2023-11-16T00:00:00Z, a Thursday: weeks count from the epoch
    let clock = FakeClock::new();
    let redis = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), prefix.into());
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let redis = Limiter::with_store(policy.clone(), redis).unwrap();
    let memory = Limiter::with_store(policy.clone(), memory).unwrap();
    let (mut admitted, mut out) = (start, Vec::new());
    for (i, tick) in ticks.iter().enumerate() {
        let (at, cost) = match *tick {
            Tick::At(after, cost) => (start + after, cost),
            Tick::Since(after, cost) => (admitted + after, cost),
        };
        clock.set(at);
        let m = memory.check(&Key::Global, cost).await.unwrap();
        let r = redis.check(&Key::Global, cost).await.expect("redis answers");
        assert_eq!(m, r, "{}: step {i} ({tick:?}): memory, then redis", policy.name());
        if m.is_allowed() && cost > 0 {
            admitted = at;
        }
        out.push(m);
    }
    out
}

/// A refused check (limited, or over the capacity) never moves a key's clock guard, even when
/// it rewrites the key's state (pruning, or rebasing a sliding log's scores): after the clock
/// steps back to the last admission, Redis decides as memory does, for every algorithm, with
/// and without a calendar tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_check_does_not_move_the_clock_guard() {
    let Some(server) = Server::start("redis-server") else { return };
    let week = Duration::from_nanos(WEEK);
    for algorithm in Algorithm::ALL {
        for calendar in [false, true] {
            let policy = |count: u64| {
                let mut b =
                    Policy::builder(format!("guard-{}-{count}-{calendar}", algorithm.name()))
                        .algorithm(algorithm)
                        .tier("week", Quota::new(count, week));
                if calendar {
                    b = b.calendar("month", Calendar::new(100, CalendarPeriod::Month));
                }
                b.build().unwrap()
            };
            let name = format!("{algorithm:?}, calendar {calendar}");
            // One a week, spent; refused a nanosecond before the week is over (a sliding log
            // decided in nanoseconds rebases its scores then); back at the start, a whole week
            // (two for the sliding counter, which weighs the previous window in full at its
            // end) to wait.
            let p = policy(1);
            let ticks =
                [Tick::At(0, 1), Tick::At(WEEK - 1, 1), Tick::Since(0, 1), Tick::At(WEEK, 1)];
            let d = both_stores(&server, &p, &format!("{}:", p.name()), &ticks).await;
            assert!(!d[1].is_allowed() && !d[2].is_allowed(), "{name}");
            let whole = if algorithm == Algorithm::SlidingCounter { 2 * WEEK } else { WEEK };
            assert_eq!(d[2].retry_after(), Some(Duration::from_nanos(whole)), "{name}");
            // Two a week, spent at 0 and half a week; two more a week on (the log refuses them,
            // pruning the first; the others admit), then a cost above the capacity two weeks on (every
            // window pruned); back at the last admission, what is left decides alike.
            let p = policy(2);
            let ticks = [
                Tick::At(0, 1),
                Tick::At(WEEK / 2, 1),
                Tick::At(WEEK + 1, 2),
                Tick::Since(0, 1),
                Tick::At(2 * WEEK, 3),
                Tick::Since(0, 2),
                Tick::Since(0, 1),
                Tick::Since(WEEK / 4, 1),
                Tick::Since(WEEK + 1, 2),
            ];
            let d = both_stores(&server, &p, &format!("{}:", p.name()), &ticks).await;
            assert_eq!(d[4].outcome(), tollgate::Outcome::CostExceedsCapacity, "{name}");
        }
    }
}

/// A refusal that counts a breach rewrites the key's state (its penalty box) but does not move
/// its clock guard: back at the last admission, Redis decides as memory does, and the block
/// the second breach starts there ends two weeks after that instant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counted_breach_does_not_move_the_clock_guard() {
    let Some(server) = Server::start("redis-server") else { return };
    let week = Duration::from_nanos(WEEK);
    for algorithm in Algorithm::ALL {
        let policy = Policy::builder(format!("guard-box-{}", algorithm.name()))
            .algorithm(algorithm)
            .tier("week", Quota::new(1, week))
            .penalty("week", Penalty::new(2 * week).after(2, 4 * week))
            .build()
            .unwrap();
        let ticks = [
            Tick::At(0, 1),
            Tick::At(WEEK / 2, 1),
            Tick::Since(0, 1),
            Tick::Since(2 * WEEK - 1, 1),
            Tick::Since(2 * WEEK, 1),
        ];
        let d = both_stores(&server, &policy, &format!("{}:", policy.name()), &ticks).await;
        let name = format!("{algorithm:?}");
        // The sliding counter weighs the first week in full at its end: two weeks to wait.
        let whole = if algorithm == Algorithm::SlidingCounter { 2 * WEEK } else { WEEK };
        let own = Some(Duration::from_nanos(whole - WEEK / 2));
        assert_eq!(d[1].retry_after(), own, "{name}: {:?}", d[1]);
        assert_eq!(d[2].retry_after(), Some(2 * week), "{name}: {:?}", d[2]);
        assert_eq!(d[3].retry_after(), Some(Duration::from_nanos(1)), "{name}: {:?}", d[3]);
        assert!(d[4].is_allowed(), "{name}: {:?}", d[4]);
    }
}
