//! Reserved-capacity scenarios ([`Reserve`], [`Priority`]), run on the in-memory store
//! (tests/all/priority.rs) and on Redis (tests/all/redis.rs) alike: each takes a limiter of
//! the policy it is given over a store on the fake clock `clock`, and asserts exact outcomes.
#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::time::Duration;

use tollgate::clock::FakeClock;
use tollgate::key::Key;
use tollgate::store::Store;
use tollgate::{Decision, Limiter, Outcome, Penalty, Policy, Priority, Quota, Reserve};

use Priority::{Critical, Sheddable, Standard};

const SECOND: Duration = Duration::from_secs(1);

/// 10 a minute (one unit every 6 s); 2 kept for critical requests, 3 more for standard ones:
/// a sheddable request may use 5, a standard one 8, a critical one all 10.
pub fn minute_policy(name: &str) -> Policy {
    Policy::builder(name)
        .tier("minute", Quota::per_minute(10))
        .reserve("minute", Reserve::new().critical(2).standard(3))
        .build()
        .unwrap()
}

async fn check<St: Store>(limiter: &Limiter<St>, key: &Key, class: Priority) -> Decision {
    limiter.check_as(key, 1, class).await.expect("the store answers")
}

/// Admits `n` requests of `class` in a row, at the clock's instant.
async fn admit<St: Store>(limiter: &Limiter<St>, key: &Key, class: Priority, n: usize) {
    for i in 0..n {
        let d = check(limiter, key, class).await;
        assert!(d.is_allowed(), "{class:?}: request {i} of {n}: {d:?}");
    }
}

/// Asserts that `d` refused a request of a class whose limit is `limit`, retry after `retry`.
fn assert_refused(d: &Decision, limit: u64, retry: Duration, what: &str) {
    assert_eq!(d.outcome(), Outcome::Limited, "{what}: {d:?}");
    assert_eq!(d.retry_after(), Some(retry), "{what}: {d:?}");
    let tier = &d.tiers()[0];
    assert!(tier.is_violated(), "{what}: {d:?}");
    assert_eq!((tier.limit(), tier.remaining()), (limit, 0), "{what}: {d:?}");
    assert_eq!(tier.retry_after(), Some(retry), "{what}: {d:?}");
}

/// What a query (cost 0) of `class` sees: `(limit, remaining)`.
async fn seen<St: Store>(limiter: &Limiter<St>, key: &Key, class: Priority) -> (u64, u64) {
    let d = limiter.check_as(key, 0, class).await.expect("the store answers");
    (d.tiers()[0].limit(), d.tiers()[0].remaining())
}

/// Each class is refused exactly at its own threshold on the one shared state, with the
/// `retry_after` of its own class, and sees its own limit and remaining.
pub async fn each_class_stops_at_its_threshold<St: Store>(
    clock: &FakeClock,
    limiter: &Limiter<St>,
) {
    let key = Key::text("thresholds");
    assert_eq!(seen(limiter, &key, Critical).await, (10, 10));
    assert_eq!(seen(limiter, &key, Standard).await, (8, 8));
    assert_eq!(seen(limiter, &key, Sheddable).await, (5, 5));
    // Sheddable: 5 of the 10, then refused until the room is back above both reserves: one
    // unit comes back every 6 s.
    admit(limiter, &key, Sheddable, 5).await;
    let d = check(limiter, &key, Sheddable).await;
    assert_refused(&d, 5, 6 * SECOND, "the 6th sheddable");
    assert_eq!(seen(limiter, &key, Standard).await, (8, 3));
    // Standard: 3 more, down to the critical reserve.
    admit(limiter, &key, Standard, 3).await;
    let d = check(limiter, &key, Standard).await;
    assert_refused(&d, 8, 6 * SECOND, "the 4th standard");
    // The sheddable retry is now 4 units away: 24 s.
    let d = check(limiter, &key, Sheddable).await;
    assert_refused(&d, 5, 24 * SECOND, "a sheddable below the standard reserve");
    // Critical: the reserve is untouched, so it is admitted, twice; then the tier is full.
    admit(limiter, &key, Critical, 2).await;
    let d = check(limiter, &key, Critical).await;
    assert_refused(&d, 10, 6 * SECOND, "a critical on a full tier");
    // Each retry is exact: a nanosecond before it the class is still refused, then admitted.
    clock.advance(6 * SECOND - Duration::from_nanos(1));
    let d = check(limiter, &key, Critical).await;
    assert_refused(&d, 10, Duration::from_nanos(1), "a critical a nanosecond early");
    clock.advance(Duration::from_nanos(1));
    // One unit back: a standard request still finds only the critical reserve ...
    let d = check(limiter, &key, Standard).await;
    assert_refused(&d, 8, 12 * SECOND, "a standard with one unit back");
    // ... a critical one takes it.
    admit(limiter, &key, Critical, 1).await;
    // From here, the tier is full: a sheddable request needs 6 units back (36 s).
    let d = check(limiter, &key, Sheddable).await;
    assert_refused(&d, 5, 36 * SECOND, "a sheddable on a full tier");
    clock.advance(36 * SECOND);
    admit(limiter, &key, Sheddable, 1).await;
    let d = check(limiter, &key, Sheddable).await;
    assert_refused(&d, 5, 6 * SECOND, "the next sheddable");
    // Another key is untouched.
    assert_eq!(seen(limiter, &Key::text("other"), Sheddable).await, (5, 5));
}

/// However much the lower classes ask for, they leave the critical reserve: critical requests
/// are never refused while it is unused, and a request whose cost exceeds its class's capacity
/// is `CostExceedsCapacity`.
pub async fn lower_classes_never_take_the_critical_reserve<St: Store>(
    clock: &FakeClock,
    limiter: &Limiter<St>,
) {
    let key = Key::text("flood");
    for round in 0..30 {
        // 20 standard and 20 sheddable every 6 s (one unit comes back): they take what they
        // may, and 2 critical requests still pass every time.
        for _ in 0..20 {
            let _ = check(limiter, &key, Sheddable).await;
            let _ = check(limiter, &key, Standard).await;
        }
        let (limit, remaining) = seen(limiter, &key, Critical).await;
        assert_eq!((limit, remaining), (10, 2), "round {round}");
        admit(limiter, &key, Critical, 2).await;
        clock.advance(12 * SECOND);
    }
    let d = limiter.check_as(&key, 6, Sheddable).await.unwrap();
    assert_eq!(d.outcome(), Outcome::CostExceedsCapacity, "{d:?}");
    assert!(limiter.check_as(&Key::text("big"), 6, Standard).await.unwrap().is_allowed());
}

/// 10 a minute with the reserves of [`minute_policy`], and a 15-minute penalty box.
pub fn boxed_policy(name: &str) -> Policy {
    Policy::builder(name)
        .tier("minute", Quota::per_minute(10))
        .reserve("minute", Reserve::new().critical(2).standard(3))
        .penalty("minute", Penalty::new(15 * 60 * SECOND))
        .build()
        .unwrap()
}

/// With a penalty box on the tier, a request refused at its class's threshold is a breach:
/// the key is blocked, for every class, with the box's retry.
pub async fn a_refusal_at_a_class_threshold_is_a_breach<St: Store>(
    clock: &FakeClock,
    limiter: &Limiter<St>,
) {
    let key = Key::text("boxed");
    admit(limiter, &key, Sheddable, 5).await;
    let d = check(limiter, &key, Sheddable).await;
    assert_refused(&d, 5, 15 * 60 * SECOND, "the breach");
    clock.advance(60 * SECOND);
    let d = check(limiter, &key, Critical).await;
    assert_eq!(d.retry_after(), Some(14 * 60 * SECOND), "{d:?}");
    clock.advance(14 * 60 * SECOND);
    admit(limiter, &key, Critical, 1).await;
}

/// Every scenario, each on a fresh limiter of its own policy from `limiter_of`.
pub async fn every_scenario<St, F, Fut>(clock: &FakeClock, limiter_of: F)
where
    St: Store,
    F: Fn(Policy) -> Fut,
    Fut: Future<Output = Limiter<St>>,
{
    each_class_stops_at_its_threshold(clock, &limiter_of(minute_policy("thresholds")).await).await;
    lower_classes_never_take_the_critical_reserve(clock, &limiter_of(minute_policy("flood")).await)
        .await;
    a_refusal_at_a_class_threshold_is_a_breach(clock, &limiter_of(boxed_policy("boxed")).await)
        .await;
}

/// What [`overload`] counted.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    /// What the limit allows by the last request: the burst, and one unit per millisecond
    /// from the first request to the last.
    pub limit: u64,
    /// Requests admitted, all classes.
    pub admitted: u64,
    /// Critical requests refused.
    pub critical_refused: u64,
    /// Standard and sheddable requests refused.
    pub standard_refused: u64,
    pub sheddable_refused: u64,
}

/// The rate of [`overload_policy`], a second.
pub const RATE: u64 = 100;

/// 100 a second (burst 100); 20 kept for critical requests, 30 more for standard ones.
pub fn overload_policy(name: &str) -> Policy {
    Policy::builder(name)
        .tier("second", Quota::per_second(RATE))
        .reserve("second", Reserve::new().critical(20).standard(30))
        .build()
        .unwrap()
}

/// 3x overload for `seconds` on one key: 300 requests a second, evenly spaced, each of a class
/// drawn from a fixed-seed generator: 1 in 10 critical (30 a second, below the limit's rate,
/// its bursts far below the reserve), 3 in 10 standard, 6 in 10 sheddable.
pub async fn overload<St: Store>(clock: &FakeClock, limiter: &Limiter<St>, seconds: u64) -> Counts {
    let key = Key::text("overload");
    let mut counts = Counts::default();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let gap = 1_000_000_000 / (3 * RATE);
    let n = seconds * 3 * RATE;
    for i in 0..n {
        // xorshift64: the same trace on every run and store.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let class = match x % 10 {
            0 => Critical,
            1..=3 => Standard,
            _ => Sheddable,
        };
        let d = check(limiter, &key, class).await;
        match (d.is_allowed(), class) {
            (true, _) => counts.admitted += 1,
            (false, Critical) => counts.critical_refused += 1,
            (false, Standard) => counts.standard_refused += 1,
            (false, Sheddable) => counts.sheddable_refused += 1,
        }
        if i + 1 < n {
            clock.advance(Duration::from_nanos(gap));
        }
    }
    counts.limit = RATE + (n - 1) * gap / (1_000_000_000 / RATE);
    counts
}

/// [`overload`] for 30 s, held to what the limit promises: no critical request refused, and
/// the total admitted never above the limit and within 1 % of it. What is not admitted is the
/// critical reserve that critical requests left unused at the end (at most its 20 units, and
/// the fraction of a unit the last refill had not completed): a reserve is kept, not lent.
pub async fn three_times_overload<St: Store>(clock: &FakeClock, limiter: &Limiter<St>) -> Counts {
    let counts = overload(clock, limiter, 30).await;
    assert_eq!(counts.critical_refused, 0, "{counts:?}");
    assert!(counts.admitted <= counts.limit, "{counts:?}");
    assert!(counts.limit - counts.admitted <= 20 + 1, "{counts:?}");
    assert!(counts.admitted >= counts.limit - counts.limit / 100, "{counts:?}");
    // Sheddable requests are refused first: a larger share of them than of standard ones.
    assert!(counts.standard_refused * 2 < counts.sheddable_refused, "{counts:?}");
    counts
}

/// [`every_scenario`] on the in-memory store, on a fake clock from [`super::HOUR`].
pub async fn every_scenario_in_memory() {
    let clock = super::clock_at_hour();
    every_scenario(&clock, super::memory_limiters(&clock)).await;
}
