//! Exact decisions at exact instants, per algorithm.

use std::time::Duration;

use super::{Mode, TierState, decide};
use crate::decision::Outcome;
use crate::policy::Policy;
use crate::quota::{Algorithm, Quota};

const MS: u64 = 1_000_000;
const S: u64 = 1_000_000_000;

/// A single-tier policy and its state, driven at explicit instants.
struct Run {
    policy: Policy,
    states: Vec<TierState>,
}

impl Run {
    fn new(alg: Algorithm, tiers: &[(&str, Quota)]) -> Self {
        let mut b = Policy::builder("p").algorithm(alg);
        for (n, q) in tiers {
            b = b.tier(*n, *q);
        }
        let policy = b.build().unwrap();
        let states = policy.tiers().iter().map(|t| TierState::fresh(alg, t.rate, 0)).collect();
        Self { policy, states }
    }

    fn one(alg: Algorithm, q: Quota) -> Self {
        Self::new(alg, &[("t", q)])
    }

    fn at(&mut self, now: u64, cost: u64) -> crate::Decision {
        decide(&self.policy, &mut self.states, now, cost, Mode::Police).0
    }

    fn shape(&mut self, now: u64, cost: u64, max: u64) -> crate::Decision {
        decide(&self.policy, &mut self.states, now, cost, Mode::Shape(max)).0
    }
}

fn retry(d: &crate::Decision) -> u64 {
    u64::try_from(d.retry_after().expect("limited").as_nanos()).unwrap()
}

fn allowed(d: &crate::Decision) -> bool {
    d.outcome() == Outcome::Allowed
}

#[test]
fn gcra_burst_then_refill() {
    // 10 per second, burst 3: T = 100 ms, tau = 300 ms.
    let mut r = Run::one(Algorithm::Gcra, Quota::per_second(10).with_burst(3));
    for (i, rem) in [2, 1, 0].into_iter().enumerate() {
        let d = r.at(0, 1);
        assert!(allowed(&d), "request {i}");
        assert_eq!(d.tiers()[0].remaining(), rem);
    }
    let d = r.at(0, 1);
    assert_eq!(d.outcome(), Outcome::Limited);
    assert_eq!(retry(&d), 100 * MS);
    assert_eq!(d.tiers()[0].reset_after(), Duration::from_millis(300));
    assert!(!allowed(&r.at(100 * MS - 1, 1)));
    let d = r.at(100 * MS, 1);
    assert!(allowed(&d));
    assert_eq!(d.tiers()[0].remaining(), 0);
    // After a full idle spell the whole burst is back.
    assert_eq!(r.at(10 * S, 3).tiers()[0].remaining(), 0);
}

#[test]
fn gcra_cost_and_capacity() {
    let mut r = Run::one(Algorithm::Gcra, Quota::per_second(10).with_burst(5));
    let d = r.at(0, 4);
    assert!(allowed(&d));
    assert_eq!(d.tiers()[0].remaining(), 1);
    let d = r.at(0, 2);
    assert_eq!(d.outcome(), Outcome::Limited);
    assert_eq!(retry(&d), 100 * MS);
    let d = r.at(0, 6);
    assert_eq!(d.outcome(), Outcome::CostExceedsCapacity);
    assert_eq!(d.retry_after(), None);
    assert_eq!(d.violated_names(&r.policy).collect::<Vec<_>>(), ["t"]);
}

#[test]
fn gcra_period_not_a_multiple_of_count_is_exact() {
    // 3 per second: T = 333,333,333.33 ns. A truncated integer T would refill 3 units in
    // 999,999,999 ns; the scaled arithmetic needs exactly one second, for 1,000 seconds.
    let mut r = Run::one(Algorithm::Gcra, Quota::per_second(3));
    assert!(allowed(&r.at(0, 3)));
    for k in 1..=1000u64 {
        assert_eq!(r.at(k * S - 1, 3).outcome(), Outcome::Limited, "second {k}");
        assert!(allowed(&r.at(k * S, 3)), "second {k}");
    }
    let mut r = Run::one(Algorithm::Gcra, Quota::per_second(3));
    assert!(allowed(&r.at(0, 3)));
    assert!(allowed(&r.at(S - 1, 2)));
}

#[test]
fn redis_cell_numbers() {
    // CL.THROTTLE user123 15 30 60 -> limit 16, remaining 15, retry -1, reset 2 s.
    let q = Quota::redis_cell(15, 30, Duration::from_secs(60));
    let mut r = Run::one(Algorithm::Gcra, q);
    let d = r.at(0, 1);
    let t = &d.tiers()[0];
    assert_eq!((t.limit(), t.remaining(), t.reset_after()), (16, 15, Duration::from_secs(2)));
    assert_eq!(d.retry_after(), None);
    for _ in 0..15 {
        assert!(allowed(&r.at(0, 1)));
    }
    let d = r.at(0, 1);
    assert_eq!(retry(&d), 2 * S);
    assert_eq!(d.tiers()[0].reset_after(), Duration::from_secs(32));
}

#[test]
fn token_bucket_refills_lazily_and_exactly() {
    let mut r = Run::one(Algorithm::TokenBucket, Quota::per_second(2).with_burst(4));
    assert!(allowed(&r.at(0, 4)));
    let d = r.at(0, 1);
    assert_eq!(retry(&d), 500 * MS);
    assert!(!allowed(&r.at(500 * MS - 1, 1)));
    assert!(allowed(&r.at(500 * MS, 1)));
    // 1.75 s later: 3.5 tokens -> 3 whole ones remain visible.
    let d = r.at(2250 * MS, 0);
    assert_eq!(d.tiers()[0].remaining(), 3);
    assert_eq!(d.tiers()[0].reset_after(), Duration::from_millis(250));
    assert_eq!(r.at(0, 5).outcome(), Outcome::CostExceedsCapacity);
}

#[test]
fn leaky_bucket_police_and_shape() {
    let mut r = Run::one(Algorithm::LeakyBucket, Quota::per_second(10).with_burst(2));
    assert!(allowed(&r.at(0, 1)));
    assert!(allowed(&r.at(0, 1)));
    let d = r.at(0, 1);
    assert_eq!(retry(&d), 100 * MS);

    // Shaping: requests leave at the leak rate, 100 ms apart, while the queue has room.
    let mut r = Run::one(Algorithm::LeakyBucket, Quota::per_second(10).with_burst(3));
    let delays: Vec<u64> =
        (0..4).map(|_| u64::try_from(r.shape(0, 1, S).delay().as_nanos()).unwrap()).collect();
    // The fourth enters the queue at 100 ms, when there is room, and leaves after the three.
    assert_eq!(delays, [0, 100 * MS, 200 * MS, 300 * MS]);
    // The fifth would enter at 200 ms and leave at 400 ms: over a 350 ms budget by 50 ms.
    let d = r.shape(0, 1, 350 * MS);
    assert_eq!(d.outcome(), Outcome::Limited);
    assert_eq!(retry(&d), 50 * MS);
}

#[test]
fn fixed_window_boundary_double_burst() {
    let mut r = Run::one(Algorithm::FixedWindow, Quota::per_second(3));
    for _ in 0..3 {
        assert!(allowed(&r.at(999 * MS, 1)));
    }
    let d = r.at(999 * MS, 1);
    assert_eq!(retry(&d), MS);
    assert_eq!(d.tiers()[0].reset_after(), Duration::from_millis(1));
    // Documented: the next window admits another full count 1 ms later (6 in 2 ms).
    for _ in 0..3 {
        assert!(allowed(&r.at(S, 1)));
    }
    assert!(!allowed(&r.at(S, 1)));
}

#[test]
fn sliding_log_records_only_admitted_and_same_instant_requests() {
    let mut r = Run::one(Algorithm::SlidingLog, Quota::per_second(3));
    // Three requests in the same nanosecond are three entries, not one.
    for _ in 0..3 {
        assert!(allowed(&r.at(0, 1)));
    }
    assert!(!allowed(&r.at(0, 1)));
    // Rejected requests are not recorded: hammering does not extend the ban.
    for t in 1..100 {
        assert!(!allowed(&r.at(t * MS, 1)));
    }
    let d = r.at(999 * MS, 1);
    assert_eq!(retry(&d), MS);
    assert!(allowed(&r.at(S, 3)));
    assert_eq!(r.at(S, 4).outcome(), Outcome::CostExceedsCapacity);
}

#[test]
fn sliding_log_weighted_entries_leave_in_order() {
    let mut r = Run::one(Algorithm::SlidingLog, Quota::per_second(5));
    assert!(allowed(&r.at(0, 2)));
    assert!(allowed(&r.at(300 * MS, 3)));
    let d = r.at(400 * MS, 3);
    // Needs both entries gone: the second leaves at 1.3 s.
    assert_eq!(retry(&d), 900 * MS);
    let d = r.at(400 * MS, 2);
    assert_eq!(retry(&d), 600 * MS);
}

#[test]
fn sliding_counter_weights_previous_window() {
    let mut r = Run::one(Algorithm::SlidingCounter, Quota::per_second(10));
    assert!(allowed(&r.at(0, 10)));
    // At 1.5 s the estimate is 10 * 0.5 = 5: room for exactly 5.
    let d = r.at(1500 * MS, 5);
    assert!(allowed(&d));
    assert_eq!(d.tiers()[0].remaining(), 0);
    let d = r.at(1500 * MS, 1);
    // prev 10, cur 5: need 10 * (1 - e) <= 4 -> e >= 0.6 s -> at 1.6 s.
    assert_eq!(retry(&d), 100 * MS);
    assert!(!allowed(&r.at(1600 * MS - 1, 1)));
    assert!(allowed(&r.at(1600 * MS, 1)));
}

#[test]
fn stacked_tiers_are_all_or_nothing() {
    let mut r = Run::new(
        Algorithm::Gcra,
        &[("second", Quota::per_second(10)), ("minute", Quota::per_minute(12))],
    );
    assert!(allowed(&r.at(0, 10)));
    let d = r.at(0, 5);
    // The second tier is full; the minute tier has 2 left but is not charged.
    assert_eq!(d.outcome(), Outcome::Limited);
    assert_eq!(d.tiers()[1].remaining(), 2);
    assert_eq!(d.violated_names(&r.policy).collect::<Vec<_>>(), ["second", "minute"]);
    let d = r.at(S, 2);
    assert!(allowed(&d));
    assert_eq!(d.tiers()[1].remaining(), 0);
    let d = r.at(S, 1);
    assert_eq!(d.violated_names(&r.policy).collect::<Vec<_>>(), ["minute"]);
    // The minute tier (T = 5 s, TAT now 60 s) has room again at 5 s.
    assert_eq!(retry(&d), 4 * S);
}

#[test]
fn shaping_reserves_consecutive_slots() {
    let mut r = Run::one(Algorithm::Gcra, Quota::per_second(10).with_burst(1));
    let delays: Vec<Duration> = (0..4).map(|_| r.shape(0, 1, 250 * MS).delay()).collect();
    assert_eq!(
        delays[..3],
        [Duration::ZERO, Duration::from_millis(100), Duration::from_millis(200)]
    );
    assert_eq!(delays[3], Duration::ZERO);
    let d = r.shape(0, 1, 250 * MS);
    assert_eq!(d.outcome(), Outcome::Limited);
    assert_eq!(retry(&d), 50 * MS);
}

#[test]
fn refund_gives_the_slot_back_for_every_algorithm() {
    for alg in Algorithm::ALL {
        let mut r = Run::one(alg, Quota::per_second(2));
        let (d, charges) = decide(&r.policy, &mut r.states, 0, 2, Mode::Police);
        assert!(allowed(&d), "{alg:?}");
        assert!(!allowed(&r.at(0, 1)), "{alg:?}");
        let c = charges.unwrap()[0];
        r.states[0].refund(alg, r.policy.tiers()[0].rate, c, 1);
        assert!(allowed(&r.at(0, 1)), "{alg:?} after refund");
        assert!(!allowed(&r.at(0, 1)), "{alg:?} refund gave back only 1");
    }
}

#[test]
fn cost_zero_is_a_query_that_charges_nothing() {
    for alg in Algorithm::ALL {
        let mut r = Run::one(alg, Quota::per_second(2));
        let d = r.at(0, 0);
        assert!(allowed(&d), "{alg:?}");
        let t = &d.tiers()[0];
        assert_eq!((t.remaining(), t.reset_after()), (2, Duration::ZERO), "{alg:?}");
        assert!(allowed(&r.at(0, 2)), "{alg:?}");
        // Exhausted, and even with shaping reservations ahead: a query is still admitted.
        assert!(allowed(&r.shape(0, 0, 0)), "{alg:?}");
        assert_eq!(r.at(0, 0).tiers()[0].remaining(), 0, "{alg:?}");
    }
}

#[test]
fn stacked_leaky_shaping_keeps_every_tier_smooth() {
    // Found by `admissions_never_exceed_the_promise`: tier `a` (1 per 30 ms) and tier `b` (2 per
    // 50.7 ms). The second request fits `a` at 30 ms but leaves at 50.7 ms, held by `b`'s
    // queue; charged at 30 ms, `a` would have let the third through at 60 ms, 9.3 ms after it.
    let mut r = Run::new(
        Algorithm::LeakyBucket,
        &[
            ("a", Quota::new(5, Duration::from_millis(150)).with_burst(1)),
            ("b", Quota::new(3, Duration::from_nanos(152_245_822)).with_burst(2)),
        ],
    );
    assert!(allowed(&r.at(0, 1)));
    let d = r.shape(0, 1, 50_748_608);
    assert_eq!(d.delay(), Duration::from_nanos(50_748_608));
    // Charged when it leaves, the next request fits `a` only 30 ms after that.
    let d = r.at(60 * MS, 1);
    assert_eq!(d.outcome(), Outcome::Limited);
    assert_eq!(d.violated_names(&r.policy).collect::<Vec<_>>(), ["a"]);
    assert_eq!(retry(&d), 50_748_608 + 30 * MS - 60 * MS);
}

#[test]
fn an_unlimited_shaping_budget_behind_a_huge_queue_does_not_overflow() {
    // Found by tests/all/config.rs: units queued in a bucket that drains one unit per 20 years, then
    // a request willing to wait forever, ten years before the clock's last instant. The
    // departure instant saturates instead of wrapping.
    const YEAR: u64 = 365 * 86_400 * S;
    let q = Quota::new(1, Duration::from_secs(20 * 365 * 86_400)).with_burst(1);
    let mut r = Run::one(Algorithm::LeakyBucket, q);
    let now = u64::MAX - 10 * YEAR;
    assert!(allowed(&r.at(now, 1)));
    let d = r.shape(now, 1, u64::MAX);
    assert!(allowed(&d));
    // It leaves after the unit ahead of it drains, 20 years on: past u64::MAX nanoseconds.
    assert_eq!(d.delay(), Duration::from_nanos(u64::MAX - now));
}

#[test]
fn long_policies_decide_in_microseconds_and_retries_stay_exact() {
    const DAY: u64 = 86_400 * S;
    for alg in Algorithm::ALL {
        let mut r = Run::one(alg, Quota::new(3, Duration::from_secs(30 * 86_400)));
        assert_eq!(r.policy.precision(), Duration::from_micros(1), "{alg:?}");
        // Not on a microsecond boundary.
        let t0 = 5 * DAY + 123_456_789;
        for _ in 0..3 {
            assert!(allowed(&r.at(t0, 1)), "{alg:?}");
        }
        let d = r.at(t0, 1);
        assert_eq!(d.outcome(), Outcome::Limited, "{alg:?}");
        let wait = retry(&d);
        assert!(!allowed(&r.at(t0 + wait - 1, 1)), "{alg:?}: a nanosecond early");
        assert!(allowed(&r.at(t0 + wait, 1)), "{alg:?}: at the retry instant");
        // Every reported instant ends on a microsecond boundary.
        assert_eq!((t0 + wait) % 1000, 0, "{alg:?}");
    }
}

#[test]
fn yearly_and_monthly_tiers_stack() {
    let policy = Policy::builder("plan")
        .tier("year", Quota::new(10_000_000, Duration::from_secs(365 * 86_400)))
        .tier("month", Quota::new(1_000_000, Duration::from_secs(30 * 86_400)))
        .build()
        .unwrap();
    let mut states: Vec<TierState> =
        policy.tiers().iter().map(|t| TierState::fresh(policy.algorithm(), t.rate, 0)).collect();
    let (d, _) = decide(&policy, &mut states, 7 * S, 999_999, Mode::Police);
    assert!(allowed(&d));
    assert_eq!((d.tiers()[0].remaining(), d.tiers()[1].remaining()), (9_000_001, 1));
    let (d, _) = decide(&policy, &mut states, 7 * S, 2, Mode::Police);
    assert_eq!(d.outcome(), Outcome::Limited);
    // The month refills one unit every 2.592 s: two units need 2 x 2.592 s after the first one
    // left at 0 s ... measured from 7 s, as the model computes it.
    let wait = retry(&d);
    let (d, _) = decide(&policy, &mut states, 7 * S + wait, 2, Mode::Police);
    assert!(allowed(&d), "{wait}");
}

// ---------------------------------------------------------------------------------------------
// Shaping with window and calendar tiers: where a request leaves, every tier has room.

mod shaping {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::super::{Mode, TierState, decide_kinds};
    use super::S;
    use crate::algorithm::compiled::Kind;
    use crate::decision::Outcome;
    use crate::policy::Policy;
    use crate::quota::{Algorithm, Calendar, Priority, Quota};

    const MINUTE: u64 = 60 * S;

    /// Rate tiers of `alg` (`(count, period in s)`) and per-minute calendar tiers (counts).
    fn policy(alg: Algorithm, rates: &[(u64, u64)], minutes: &[u64]) -> Policy {
        let mut b = Policy::builder("p").algorithm(alg);
        for (i, (count, secs)) in rates.iter().enumerate() {
            b = b.tier(format!("r{i}"), Quota::new(*count, std::time::Duration::from_secs(*secs)));
        }
        for (i, count) in minutes.iter().enumerate() {
            b = b.calendar(format!("c{i}"), Calendar::per_minute(*count));
        }
        b.build().unwrap()
    }

    fn fresh(policy: &Policy, now: u64) -> Vec<TierState> {
        policy.tiers().iter().map(|t| TierState::fresh_for(policy.algorithm(), t, now)).collect()
    }

    fn decide(policy: &Policy, states: &mut [TierState], now: u64, max: u64) -> crate::Decision {
        let costs = vec![1; policy.tiers().len()];
        decide_kinds(policy, states, now, &costs, Mode::Shape(max), Priority::Standard).0
    }

    #[test]
    fn a_full_window_moves_the_departure_and_the_rates_follow() {
        // Two per 10 s (fixed windows) and one a minute: at :55 the minute has room but only
        // until :59; the next request leaves at the next minute, where the window has room.
        let policy = policy(Algorithm::FixedWindow, &[(2, 10)], &[1]);
        let now = 1_000 * MINUTE + 55 * S;
        let mut states = fresh(&policy, now);
        assert_eq!(decide(&policy, &mut states, now, 0).delay().as_secs(), 0);
        let d = decide(&policy, &mut states, now, 120 * S);
        assert_eq!(d.delay().as_secs(), 5);
        // The third: the minute after is taken too, so two minutes on; not within 64 s.
        let d = decide(&policy, &mut states, now, 64 * S);
        assert_eq!(d.outcome(), Outcome::Limited);
        assert_eq!(d.retry_after().map(|r| r.as_secs()), Some(1));
        assert_eq!(decide(&policy, &mut states, now + S, 64 * S).delay().as_secs(), 64);
    }

    #[test]
    fn interleaved_full_windows_settle_within_the_bound() {
        // Windows of 10 s and 15 s, each filled every other window ahead by earlier shaped
        // requests: the departure walks past them one tier after the other.
        let policy = policy(Algorithm::FixedWindow, &[(1, 10), (1, 15)], &[]);
        let mut states = fresh(&policy, 0);
        let mut delays = Vec::new();
        for _ in 0..6 {
            let d = decide(&policy, &mut states, 0, 3_600 * S);
            delays.push(d.delay().as_secs());
        }
        assert_eq!(delays, [0, 15, 30, 45, 60, 75]);
    }

    /// Per tier, the units charged in each window (fixed windows by index, calendar minutes
    /// by start), from the departures.
    fn fills(policy: &Policy, departures: &[u64]) -> Vec<BTreeMap<u64, u64>> {
        policy
            .tiers()
            .iter()
            .map(|t| {
                let mut m = BTreeMap::new();
                for d in departures {
                    let k = match t.kind {
                        Kind::Calendar(_) => d / MINUTE,
                        _ => d / t.rate.period,
                    };
                    *m.entry(k).or_default() += 1;
                }
                m
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

        /// Every shaped request leaves where each tier has room: no fixed window and no
        /// calendar minute holds more than its count. A refused one is refused a nanosecond
        /// before its Retry-After, and (with budgets that keep departures within the calendar
        /// lookahead) admitted exactly then.
        #[test]
        fn shaping_fills_no_window_past_its_limit_and_retries_exactly(
            alg in prop::sample::select(Algorithm::ALL.to_vec()),
            rates in proptest::collection::vec((1u64..=4, 1u64..=90), 1..=2),
            minutes in proptest::collection::vec(1u64..=4, 1..=2),
            start in 0u64..=10_000,
            steps in proptest::collection::vec((0u64..=40 * S, 0u64..=420 * S), 1..=40),
        ) {
            let policy = policy(alg, &rates, &minutes);
            let mut now = 1_000 * MINUTE + start * S / 100;
            let mut states = fresh(&policy, now);
            let mut departures = Vec::new();
            for (advance, max) in steps {
                now += advance;
                let before = states.clone();
                let d = decide(&policy, &mut states, now, max);
                match d.outcome() {
                    Outcome::Allowed => departures.push(now + u64::try_from(d.delay().as_nanos()).unwrap()),
                    _ => {
                        let retry = u64::try_from(d.retry_after().unwrap().as_nanos()).unwrap();
                        let early = decide(&policy, &mut before.clone(), now + retry - 1, max);
                        prop_assert_eq!(early.outcome(), Outcome::Limited);
                        let on_time = decide(&policy, &mut before.clone(), now + retry, max);
                        prop_assert_eq!(on_time.outcome(), Outcome::Allowed, "retry {}", retry);
                    }
                }
            }
            for (t, fill) in policy.tiers().iter().zip(fills(&policy, &departures)) {
                let exact = matches!(t.kind, Kind::Calendar(_)) || alg == Algorithm::FixedWindow;
                if exact {
                    prop_assert!(fill.values().all(|n| *n <= t.capacity()), "{:?}: {:?}", t.name(), fill);
                }
            }
            // The calendar tiers' own records agree.
            for (t, s) in policy.tiers().iter().zip(&states) {
                if let TierState::Calendar(c) = s {
                    prop_assert!(c.iter().all(|w| w.2 <= t.capacity()));
                }
            }
        }
    }
}
