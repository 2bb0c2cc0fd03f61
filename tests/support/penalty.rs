//! Penalty-box scenarios, run on the in-memory store (tests/all/penalty.rs) and on Redis
//! (tests/all/redis.rs) alike: each takes a limiter of the policy it is given over a store on the
//! fake clock `clock`, and asserts exact outcomes.
#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::time::Duration;

use tollgate::clock::{Clock, FakeClock};
use tollgate::key::Key;
use tollgate::store::Store;
use tollgate::{Calendar, Decision, Limiter, Outcome, Penalty, Policy, Quota};

pub const MINUTE: Duration = Duration::from_secs(60);
pub const NANO: Duration = Duration::from_nanos(1);

/// 10 a minute (and 1,000 a calendar day, which counts every admission exactly); the first
/// refusal blocks the key for 15 minutes.
pub fn fifteen_minute_policy(name: &str) -> Policy {
    Policy::builder(name)
        .tier("minute", Quota::per_minute(10))
        .calendar("day", Calendar::per_day(1000))
        .penalty("minute", Penalty::new(15 * MINUTE))
        .build()
        .unwrap()
}

/// 10 a minute; the third refusal within a minute blocks the key for 15 minutes.
pub fn third_refusal_policy(name: &str) -> Policy {
    Policy::builder(name)
        .tier("minute", Quota::per_minute(10))
        .penalty("minute", Penalty::new(15 * MINUTE).after(3, MINUTE))
        .build()
        .unwrap()
}

async fn check<St: Store>(limiter: &Limiter<St>, key: &Key) -> Decision {
    limiter.check(key, 1).await.expect("the store answers")
}

/// Admits `n` requests of `key` in a row, at the clock's instant.
async fn admit<St: Store>(limiter: &Limiter<St>, key: &Key, n: usize) {
    for i in 0..n {
        let d = check(limiter, key).await;
        assert!(d.is_allowed(), "{key}: request {i} of {n}: {d:?}");
    }
}

/// Admits the first `n` requests of the key named `name`, at the clock's instant: the key, and
/// the instant (ns) a time after that one.
async fn begin<St: Store>(
    clock: &FakeClock,
    limiter: &Limiter<St>,
    name: &str,
    n: usize,
) -> (Key, impl Fn(Duration) -> u64 + use<St>) {
    let key = Key::text(name);
    let start = clock.now();
    admit(limiter, &key, n).await;
    (key, move |d: Duration| start + u64::try_from(d.as_nanos()).unwrap())
}

/// Asserts that `d` is the refusal of a key blocked for `left` more by tier 0.
fn assert_blocked(d: &Decision, left: Duration, what: &str) {
    assert_eq!(d.outcome(), Outcome::Limited, "{what}: {d:?}");
    assert_eq!(d.retry_after(), Some(left), "{what}: {d:?}");
    let tier = &d.tiers()[0];
    assert!(tier.is_violated(), "{what}: {d:?}");
    assert_eq!((tier.remaining(), tier.retry_after()), (0, Some(left)), "{what}: {d:?}");
    assert!(tier.reset_after() >= left, "{what}: {d:?}");
}

/// A key that breaches its 10-a-minute tier is refused for exactly 15 minutes: at the breach
/// (retry after 15 minutes, not the 6 s the tier alone would say), all through the block
/// (retry after the time left, to the nanosecond, though the tier itself has refilled), and
/// admitted again 15 minutes on, with its whole burst: the blocked requests charged nothing.
/// Another key is untouched all along. Starts within the first half of a UTC day.
pub async fn a_breach_blocks_for_exactly_fifteen_minutes<St: Store>(
    clock: &FakeClock,
    limiter: Limiter<St>,
) {
    let (alice, bob) = (Key::text("alice"), Key::text("bob"));
    let start = clock.now();
    admit(&limiter, &alice, 10).await;
    let breach = check(&limiter, &alice).await;
    assert_blocked(&breach, 15 * MINUTE, "the breach");
    assert_eq!(breach.tiers()[0].reset_after(), 15 * MINUTE);
    assert!(!breach.tiers()[1].is_violated(), "the day tier had room: {breach:?}");
    assert_eq!(breach.tiers()[1].remaining(), 990);
    // Bob is not alice.
    admit(&limiter, &bob, 10).await;
    assert_eq!(check(&limiter, &bob).await.retry_after(), Some(15 * MINUTE), "bob's own breach");
    let carol = Key::text("carol");
    for (after, left) in [
        (NANO, 15 * MINUTE - NANO),
        (MINUTE, 14 * MINUTE),
        (7 * MINUTE + Duration::from_millis(1), 8 * MINUTE - Duration::from_millis(1)),
        (15 * MINUTE - NANO, NANO),
    ] {
        clock.set(start + u64::try_from(after.as_nanos()).unwrap());
        let d = check(&limiter, &alice).await;
        assert_blocked(&d, left, &format!("{after:?} into the block"));
        // Nothing is charged while blocked: the day still counts 10 of alice's.
        assert_eq!(d.tiers()[1].remaining(), 990, "{after:?}");
        // Another key that never breached is admitted all along.
        assert!(check(&limiter, &carol).await.is_allowed(), "carol at {after:?}");
    }
    clock.set(start + u64::try_from((15 * MINUTE).as_nanos()).unwrap());
    admit(&limiter, &alice, 10).await;
    let again = check(&limiter, &alice).await;
    assert_blocked(&again, 15 * MINUTE, "the next breach");
    assert_eq!(again.tiers()[1].remaining(), 980, "20 of alice's admitted in all");
}

/// With `after(3, 1 min)`: two refusals within a minute block nothing (their retry is the
/// tier's own); refusals that left the minute are forgotten; the third within a minute blocks
/// for 15 minutes. A blocked request counts as no refusal: refused all through the block, the
/// key then needs three new refusals to be blocked again.
pub async fn the_third_refusal_within_a_minute_blocks<St: Store>(
    clock: &FakeClock,
    limiter: Limiter<St>,
) {
    let (key, at) = begin(clock, &limiter, "dave", 10).await;
    // Two refusals at 0 s and 1 s: the tier's own retry (one request every 6 s).
    let d = check(&limiter, &key).await;
    assert_eq!(d.retry_after(), Some(Duration::from_secs(6)), "{d:?}");
    clock.set(at(Duration::from_secs(1)));
    let d = check(&limiter, &key).await;
    assert_eq!(d.retry_after(), Some(Duration::from_secs(5)), "{d:?}");
    // At 60 s the first refusal has left the minute (only the one at 1 s counts), and the tier
    // has refilled: 10 admitted, then a refusal at 60 s is the second in the minute.
    clock.set(at(MINUTE));
    admit(&limiter, &key, 10).await;
    let d = check(&limiter, &key).await;
    assert_eq!(d.retry_after(), Some(Duration::from_secs(6)), "the second: {d:?}");
    // The third, at 61 s - 1 ns (the one at 1 s still counts until 61 s): blocked.
    clock.set(at(MINUTE + Duration::from_secs(1) - NANO));
    let d = check(&limiter, &key).await;
    assert_blocked(&d, 15 * MINUTE, "the third refusal");
    let end = at(MINUTE + Duration::from_secs(1) - NANO + 15 * MINUTE);
    // Refused until the end, however often it asks; not counted as refusals.
    for before in [10 * MINUTE, MINUTE, NANO] {
        clock.set(end - u64::try_from(before.as_nanos()).unwrap());
        for _ in 0..5 {
            assert_blocked(&check(&limiter, &key).await, before, "during the block");
        }
    }
    // After: a whole burst, then two refusals that block nothing, the third that blocks.
    clock.set(end);
    admit(&limiter, &key, 10).await;
    for n in 1..=2 {
        let d = check(&limiter, &key).await;
        assert_eq!(d.retry_after(), Some(Duration::from_secs(6)), "refusal {n} after: {d:?}");
    }
    assert_blocked(&check(&limiter, &key).await, 15 * MINUTE, "the third after the block");
}

/// 2 an hour with a 1-minute block: the block is shorter than the tier's own wait, so every
/// refusal says when the tier admits again (a client that honours it is never blocked again);
/// during the block the tier names the longer wait; a request after the block but before the
/// tier admits is a new breach.
pub async fn a_short_block_on_a_slow_tier_says_when_the_tier_admits<St: Store>(
    clock: &FakeClock,
    limiter: Limiter<St>,
) {
    let (key, at) = begin(clock, &limiter, "frank", 2).await;
    let breach = check(&limiter, &key).await;
    assert_blocked(&breach, 30 * MINUTE, "the breach");
    clock.set(at(MINUTE / 2));
    assert_blocked(&check(&limiter, &key).await, 29 * MINUTE + MINUTE / 2, "during the block");
    // After the block: refused by the tier, a new breach, blocked again.
    clock.set(at(MINUTE));
    assert_blocked(&check(&limiter, &key).await, 29 * MINUTE, "the next breach");
    clock.set(at(2 * MINUTE - NANO));
    assert_blocked(&check(&limiter, &key).await, 28 * MINUTE + NANO, "the next block");
    clock.set(at(30 * MINUTE));
    admit(&limiter, &key, 1).await;
}

/// Runs the scenarios on limiters `make` builds for a policy, on `clock`.
pub async fn every_scenario<St, F, Fut>(clock: &FakeClock, make: F)
where
    St: Store,
    F: Fn(Policy) -> Fut,
    Fut: Future<Output = Limiter<St>>,
{
    let base = clock.now();
    a_breach_blocks_for_exactly_fifteen_minutes(
        clock,
        make(fifteen_minute_policy("fifteen")).await,
    )
    .await;
    clock.set(base);
    the_third_refusal_within_a_minute_blocks(clock, make(third_refusal_policy("third")).await)
        .await;
    clock.set(base);
    let slow = Policy::builder("slow")
        .tier("hour", Quota::per_hour(2))
        .penalty("hour", Penalty::new(MINUTE))
        .build()
        .unwrap();
    a_short_block_on_a_slow_tier_says_when_the_tier_admits(clock, make(slow).await).await;
}

/// [`every_scenario`] on the in-memory store, on a fake clock from [`super::HOUR`].
pub async fn every_scenario_in_memory() {
    let clock = super::clock_at_hour();
    every_scenario(&clock, super::memory_limiters(&clock)).await;
}
