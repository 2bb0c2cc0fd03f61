//! Long horizons and calendar windows on Redis, next to memory, policed and shaped.

use super::*;

// ---------------------------------------------------------------------------------------------
// Long horizons: monthly and yearly quotas, at microsecond precision, as in memory.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn yearly_and_monthly_quotas_decide_exactly_like_memory() {
    let Some(server) = Server::start("redis-server") else { return };
    const DAY: u64 = 86_400_000_000_000;
    for algorithm in Algorithm::ALL {
        let (year, month) = if algorithm == Algorithm::SlidingLog {
            (10_000, 1_000)
        } else {
            (10_000_000, 1_000_000)
        };
        let policy = Policy::builder(format!("plan-{}", algorithm.name()))
            .algorithm(algorithm)
            .tier("year", Quota::new(year, Duration::from_secs(365 * 86_400)))
            .tier("month", Quota::new(month, Duration::from_secs(30 * 86_400)))
            .build()
            .unwrap();
        assert_eq!(policy.precision(), Duration::from_micros(1));
        let clock = FakeClock::new();
        clock.set(1_700_000_000_123_456_789);
        let redis =
            fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "long:".into());
        let redis = Limiter::with_store(policy.clone(), redis).unwrap();
        let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let memory = Limiter::with_store(policy, memory).unwrap();
        // Spend most of the month at once (one unit at a time for the log), then probe past the
        // month's end and across the year.
        let big = if algorithm == Algorithm::SlidingLog { 1 } else { month - 3 };
        let steps: &[(u64, u64)] =
            &[(0, big), (0, 2), (0, 5), (DAY, 1), (29 * DAY, 3), (2 * DAY, 4), (200 * DAY, 7)];
        for (i, &(advance, cost)) in steps.iter().enumerate() {
            clock.advance(Duration::from_nanos(advance));
            let m = memory.check(&Key::Global, cost).await.unwrap();
            let r = redis.check(&Key::Global, cost).await.unwrap();
            assert_eq!(m, r, "{algorithm:?} step {i}");
            assert_eq!(r.source(), Source::Store);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Calendar windows and costs per tier on Redis, next to memory.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calendar_windows_across_daylight_saving_and_month_ends_decide_like_memory() {
    let Some(server) = Server::start("redis-server") else { return };
    let policy = Policy::builder("cal")
        .calendar("day", Calendar::per_day(3).in_time_zone("Europe/Berlin"))
        .calendar("month", Calendar::per_month(5).in_time_zone("America/New_York"))
        .tier("burst", Quota::per_second(10))
        .build()
        .unwrap();
    let clock = FakeClock::new();
    let redis = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "cal:".into());
    let redis = Limiter::with_store(policy.clone(), redis).unwrap();
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let memory = Limiter::with_store(policy, memory).unwrap();
    let mut retries = Vec::new();
    for (when, cost) in [
        ("2025-03-29T22:59:59Z", 3), // the last second of Saturday in Berlin
        ("2025-03-29T22:59:59.5Z", 1),
        ("2025-03-29T23:00:00Z", 2), // Sunday (23 hours long); March's 5 are used up
        ("2025-04-01T03:59:00Z", 1), // March 31st, 23:59 in New York
        ("2025-04-01T04:00:00Z", 1), // April
        ("2025-10-25T22:00:00Z", 3), // Sunday October 26th, 00:00 CEST
        ("2025-10-26T22:59:00Z", 1), // 23:59 CET, 25 hours later: still Sunday
        ("2025-10-26T23:00:00Z", 1),
    ] {
        clock.set(instant(when));
        let m = memory.check(&Key::Global, cost).await.unwrap();
        let r = redis.check(&Key::Global, cost).await.unwrap();
        assert_eq!(m, r, "at {when}");
        retries.push(r.retry_after().map(|d| d.as_millis()));
    }
    assert_eq!(
        retries,
        [None, Some(500), None, Some(60_000), None, None, Some(60_000), None],
        "refused until the next window: Sunday in Berlin, April in New York"
    );
}

/// Policed checks and releases of a GCRA rate tier (a whole-unit interval) beside a calendar
/// and a concurrency tier, the case the Redis script decides on its flat path, decide like
/// memory through each kind of refusal: the slots full (the typical hold), the rate, the day
/// spent (until midnight in Berlin) and a cost above capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcra_beside_a_calendar_and_slots_refuses_like_memory() {
    let Some(server) = Server::start("redis-server") else { return };
    let policy = Policy::builder("flat")
        .tier("rate", Quota::per_second(2).with_burst(3))
        .calendar("day", Calendar::per_day(5).in_time_zone("Europe/Berlin"))
        .concurrency("slots", Concurrency::new(2).with_typical_hold(Duration::from_millis(250)))
        .build()
        .unwrap();
    let clock = FakeClock::new();
    clock.set(instant("2025-03-29T22:59:58Z")); // 23:59:58 on Saturday in Berlin
    let redis = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "flat:".into());
    let redis = Limiter::with_store(policy.clone(), redis).unwrap();
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let memory = Limiter::with_store(policy, memory).unwrap();
    let mut held = Vec::new();
    let mut seen = Vec::new();
    // (milliseconds to advance, cost to reserve; 0 releases the oldest reservation held)
    let steps = [
        (0, 1),
        (0, 1),
        (0, 1), // both slots held
        (0, 0),
        (0, 1),
        (0, 0),
        (0, 0),
        (0, 1), // the rate: 3 in 0 s with a burst of 3
        (500, 1),
        (0, 0),
        (1_000, 1), // the day's fifth
        (0, 0),
        (400, 1), // the day spent, 100 ms before midnight in Berlin
        (100, 1), // Sunday
        (0, 4),   // above the burst and the slots
    ];
    for (advance, cost) in steps {
        clock.advance(Duration::from_millis(advance));
        if cost == 0 {
            let (m, r): (Reservation<MemoryStore>, Reservation<RedisStore>) = held.remove(0);
            m.release().await.unwrap();
            r.release().await.unwrap();
            continue;
        }
        let m = memory.reserve(&Key::Global, cost).await.unwrap();
        let r = redis.reserve(&Key::Global, cost).await.unwrap();
        assert_eq!(m.decision(), r.decision(), "check {}", seen.len());
        let d = r.decision();
        seen.push((d.is_allowed(), d.retry_after().map(|d| d.as_millis())));
        if d.is_allowed() {
            held.push((m, r));
        }
    }
    assert_eq!(
        seen,
        [
            (true, None),
            (true, None),
            (false, Some(250)),
            (true, None),
            (false, Some(500)),
            (true, None),
            (true, None),
            (false, Some(100)),
            (true, None),
            (false, None),
        ]
    );
}

// ---------------------------------------------------------------------------------------------
// Shaping with calendar tiers: a request is charged in the window it leaves in, on Redis as in
// memory, and a departure Redis could not charge is refused by both.

/// Ten requests at second :58 through a leaky bucket of 1 a second (burst 20) and 3 a minute,
/// shaped within 120 s: on Redis as in memory, two leave in that minute and three in each of
/// the next two; the last two are refused for the 2 s until their departure is in the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shaping_never_fills_a_calendar_minute_past_its_limit_on_redis() {
    let Some(server) = Server::start("redis-server") else { return };
    let rate = Quota::per_second(1).with_burst(20);
    let policy = Policy::builder("paced")
        .algorithm(Algorithm::LeakyBucket)
        .tier("rate", rate)
        .calendar("minute", Calendar::per_minute(3))
        .build()
        .unwrap();
    let clock = FakeClock::new();
    let start = instant("2025-06-02T10:00:58Z");
    clock.set(start);
    let redis = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "paced:".into());
    let redis = Limiter::with_store(policy.clone(), redis).unwrap();
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let memory = Limiter::with_store(policy, memory).unwrap();
    let budget = Duration::from_secs(120);
    let mut per_minute = std::collections::BTreeMap::<u64, u64>::new();
    let mut refused = Vec::new();
    for _ in 0..10 {
        let m = memory.reserve_within(&Key::Global, 1, budget).await.unwrap();
        let r = redis.reserve_within(&Key::Global, 1, budget).await.unwrap();
        assert_eq!(m.decision(), r.decision());
        let d = r.decision();
        if d.is_allowed() {
            *per_minute
                .entry((start / 1_000_000_000 + d.delay().as_secs()) / 60 % 60)
                .or_default() += 1;
        } else {
            refused.push(d.retry_after());
        }
        drop(m);
        drop(r);
    }
    assert_eq!(per_minute.into_iter().collect::<Vec<_>>(), [(0, 2), (1, 3), (2, 3)]);
    assert_eq!(refused, [Some(Duration::from_secs(2)); 2]);
    clock.advance(Duration::from_secs(2));
    let m = memory.reserve_within(&Key::Global, 1, budget).await.unwrap();
    let r = redis.reserve_within(&Key::Global, 1, budget).await.unwrap();
    assert_eq!(m.decision(), r.decision());
    assert_eq!(r.decision().delay(), Duration::from_secs(120));
}

/// Shaped traces over every algorithm, with long rate tiers (seconds to hours) and calendar
/// tiers (minutes, hours, days; UTC, Berlin, New York), budgets up to three hours so that
/// departures reach later windows and past the calendar lookahead; from a fixed seed.
fn shaping_trace(algorithm: Algorithm) -> impl Strategy<Value = Trace> {
    let window = matches!(
        algorithm,
        Algorithm::FixedWindow | Algorithm::SlidingLog | Algorithm::SlidingCounter
    );
    let max_count: u64 = if algorithm == Algorithm::SlidingLog { 8 } else { 12 };
    let sec = 1_000_000_000u64;
    let period = prop_oneof![
        3 => (1u64..=120).prop_map(move |s| s * sec),
        2 => (1u64..=7_200).prop_map(move |s| s * sec),
        1 => (1u64..=5_000).prop_map(|ms| ms * 1_000_000),
    ];
    let tier = (1u64..=max_count, period, 0u64..=24).prop_map(move |(c, p, extra)| {
        let burst = if window { c } else { 1 + extra % (2 * c + 2) };
        (c, p, burst)
    });
    let calendar =
        (1u64..=6, prop_oneof![4 => Just(0usize), 2 => Just(1), 1 => Just(2)], 0usize..3)
            .prop_map(|(c, p, z)| Extra::Calendar(c, p, z));
    let extra = prop_oneof![
        6 => calendar.clone(),
        1 => (1u64..=4).prop_map(Extra::Slots),
    ];
    let advance = prop_oneof![
        3 => 0u64..=2 * sec,
        3 => 0u64..=90 * sec,
        1 => 0u64..=2 * 3_600 * sec,
    ];
    let budget = prop_oneof![
        1 => Just(None),
        2 => (0u64..=180 * sec).prop_map(Some),
        2 => (0u64..=3 * 3_600 * sec).prop_map(Some),
    ];
    let cost = || prop_oneof![8 => Just(1u64), 2 => 0u64..=3];
    let step = prop_oneof![
        2 => advance.prop_map(Step::Advance),
        8 => (0u8..2, cost(), proptest::collection::vec(cost(), 5), budget)
            .prop_map(|(key, cost, costs, shape)| Step::Check { key, cost, costs, shape }),
        1 => (0usize..64, 0u64..=3).prop_map(|(which, cost)| Step::Settle { which, cost }),
        1 => (0usize..64).prop_map(|which| Step::Release { which }),
    ];
    // Two seconds before a minute ends, or near daylight-saving changes in Berlin and New York.
    let start = prop_oneof![
        2 => (0u64..=1_000_000).prop_map(move |m| (m * 60 + 58) * sec),
        1 => (0u64..=7_200 * sec).prop_map(|d| instant("2025-03-30T00:00:00Z") + d),
        1 => (0u64..=7_200 * sec).prop_map(|d| instant("2025-11-02T05:00:00Z") + d),
    ];
    (
        proptest::collection::vec(tier, 1..=2),
        prop_oneof![
            3 => proptest::collection::vec(calendar, 1..=2),
            1 => proptest::collection::vec(extra, 1..=2),
        ],
        start,
        proptest::collection::vec(step, 20..=80),
    )
        .prop_map(move |parts| Trace::new(algorithm, parts))
}

#[test]
fn shaping_with_long_and_calendar_tiers_decides_exactly_like_memory_for_every_algorithm() {
    let Some(server) = Server::start("redis-server") else { return };
    let url = server.url();
    for (a, algorithm) in Algorithm::ALL.into_iter().enumerate() {
        let seed = u8::try_from(a).unwrap() + 1;
        seeded_differential(shaping_trace(algorithm), seed, 64, |clock, prefix| {
            fake_clock_store(RedisStore::builder(&url), clock, format!("shape{a}-{prefix}"))
        });
    }
}
