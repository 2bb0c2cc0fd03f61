//! Penalty boxes ([`Penalty`]) on the in-memory store, on an injected clock: a key that breaches
//! its tier is refused for exactly the block, other keys are untouched, the K-refusals variant,
//! the box's state swept once it no longer matters, and a blocked client over HTTP.

use crate::support;
use crate::support::penalty as scenarios;

use std::time::Duration;

use tollgate::clock::Clock;
use tollgate::key::Key;
use tollgate::{Limiter, Penalty, Policy, Quota};

use scenarios::MINUTE;
use support::memory_limiter;

#[tokio::test]
async fn a_breach_blocks_the_key_for_exactly_the_block_in_memory() {
    scenarios::every_scenario_in_memory().await;
}

/// The box's state is swept once the block is over, and not before: a blocked key (whose tiers
/// are idle again) stays until its block ends; a key with a counted refusal stays until the
/// refusal leaves the window.
#[tokio::test]
async fn a_box_is_swept_only_once_its_block_and_refusals_no_longer_matter() {
    let clock = support::clock_at_hour();
    let store = support::memory_store(&clock);
    let policy = Policy::builder("sweep")
        .tier("second", Quota::per_second(1))
        .penalty("second", Penalty::new(Duration::from_secs(60)).after(2, Duration::from_secs(10)))
        .build()
        .unwrap();
    let limiter = Limiter::with_store(policy, store.clone()).unwrap();
    let key = Key::text("k");
    assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    assert!(!limiter.check(&key, 1).await.unwrap().is_allowed(), "one refusal, counted");
    // A second on, the tier is idle; the refusal counts until 10 s after it.
    clock.advance(Duration::from_secs(1));
    assert_eq!((store.sweep(), store.len()), (0, 1));
    clock.advance(Duration::from_secs(9) - Duration::from_nanos(1));
    assert_eq!((store.sweep(), store.len()), (0, 1));
    clock.advance(Duration::from_nanos(1));
    assert_eq!((store.sweep(), store.len()), (1, 0), "the refusal left the window");
    // Two refusals: blocked for a minute, kept that long.
    assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    let first = limiter.check(&key, 1).await.unwrap();
    assert_eq!(first.retry_after(), Some(Duration::from_secs(1)), "the tier's own retry");
    clock.advance(Duration::from_millis(500));
    let second = limiter.check(&key, 1).await.unwrap();
    assert_eq!(second.retry_after(), Some(Duration::from_secs(60)), "{second:?}");
    let end = clock.now() + 60_000_000_000;
    clock.set(end - 1);
    assert_eq!((store.sweep(), store.len()), (0, 1));
    assert_eq!(limiter.check(&key, 1).await.unwrap().retry_after(), Some(Duration::from_nanos(1)));
    clock.set(end);
    assert_eq!((store.sweep(), store.len()), (1, 0), "the block ended");
    assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
}

#[test]
fn penalties_that_cannot_work_are_refused_by_tier() {
    let base = || Policy::builder("p").tier("t", Quota::per_second(1));
    let err = |b: tollgate::PolicyBuilder| b.build().unwrap_err().to_string();
    let ms = Duration::from_millis(1);
    assert_eq!(
        err(base().penalty("t", Penalty::new(Duration::ZERO))),
        format!(
            "tier `t`: penalty: block 0ns must be between 1 ns and {:?}",
            tollgate::Quota::MAX_SPAN
        )
    );
    assert_eq!(
        err(base().penalty("t", Penalty::new(ms).after(0, ms))),
        "tier `t`: penalty: refusals 0 must be between 1 and 1000"
    );
    assert_eq!(
        err(base().penalty("t", Penalty::new(ms).after(2, Duration::ZERO))),
        format!(
            "tier `t`: penalty: window 0ns must be between 1 ns and {:?}",
            tollgate::Quota::MAX_SPAN
        )
    );
    assert_eq!(
        err(base().penalty("t", Penalty::new(ms)).penalty("t", Penalty::new(ms))),
        "tier `t`: penalty: the tier has one already"
    );
    assert_eq!(
        err(base().concurrency("c", tollgate::Concurrency::new(1)).penalty("c", Penalty::new(ms))),
        "tier `c`: penalty: a concurrency tier cannot have one"
    );
    // One refusal needs no window; a calendar tier may have a box.
    let p = base()
        .calendar("d", tollgate::Calendar::per_day(5))
        .penalty("d", Penalty::new(ms).after(1, Duration::ZERO))
        .build()
        .unwrap();
    assert_eq!(p.tiers()[1].penalty(), Some(Penalty::new(ms)));
    assert_eq!(p.tiers()[0].penalty(), None);
}

/// Over HTTP through the layer: the breaching request and every one during the block get a 429
/// whose `Retry-After` is the time left in the block (in whole seconds, rounded up) and whose
/// `RateLimit` header says nothing remains until then; another client is served.
/// (With axum's `ConnectInfo`: the peer's address is the key.)
#[cfg(feature = "axum")]
#[tokio::test]
async fn a_blocked_client_gets_429_with_the_time_left_over_http() {
    use axum::Router;
    use axum::routing::get;
    use scenarios::fifteen_minute_policy;
    use tollgate::RateLimitLayer;

    let clock = support::clock_at_hour();
    let store = support::memory_store(&clock);
    let layer =
        RateLimitLayer::builder(fifteen_minute_policy("http")).store(store).build().unwrap();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(layer);
    let server = support::serve(app).await;
    let client = support::client();
    let url = server.url("/");
    for _ in 0..10 {
        assert_eq!(support::get(&client, &url, &[]).await.status, 200);
    }
    let breach = support::get(&client, &url, &[]).await;
    assert_eq!(breach.status, 429);
    assert_eq!(breach.header("retry-after"), Some("900"));
    clock.advance(7 * MINUTE + Duration::from_millis(30_500));
    let during = support::get(&client, &url, &[]).await;
    assert_eq!(during.status, 429);
    // 7 min 29.5 s left, rounded up to whole seconds.
    assert_eq!(during.header("retry-after"), Some("450"));
    let ratelimit = during.header("ratelimit").expect("a RateLimit header");
    assert!(ratelimit.contains("\"minute\";r=0;t=450"), "{ratelimit}");
    clock.advance(7 * MINUTE + Duration::from_millis(29_499));
    assert_eq!(support::get(&client, &url, &[]).await.header("retry-after"), Some("1"));
    clock.advance(Duration::from_millis(1));
    assert_eq!(support::get(&client, &url, &[]).await.status, 200, "the block is over");
}

/// A policy decided in microseconds (a yearly tier): the block is rounded up to whole
/// microseconds, and the refusal's `retry_after` is exact at that precision: a retry then is
/// admitted, one a nanosecond earlier is not.
#[tokio::test]
async fn a_block_of_a_policy_decided_in_microseconds_ends_when_its_retry_says() {
    let clock = support::clock_at_hour();
    clock.advance(Duration::from_nanos(123));
    let policy = Policy::builder("yearly")
        .tier("second", Quota::per_second(1))
        .tier("year", Quota::new(1_000_000, Duration::from_secs(365 * 86_400)))
        .penalty("second", Penalty::new(Duration::from_nanos(1_500_000_001)))
        .build()
        .unwrap();
    assert_eq!(policy.precision(), Duration::from_micros(1));
    let limiter = memory_limiter(&clock, policy);
    let key = Key::text("k");
    assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    let breach = limiter.check(&key, 1).await.unwrap();
    let retry = breach.retry_after().expect("refused");
    // From the microsecond `now` falls in (123 ns in), 1,500,001 µs: to its start.
    assert_eq!(retry, Duration::from_nanos(1_500_001_000 - 123));
    clock.advance(retry - Duration::from_nanos(1));
    let d = limiter.check(&key, 1).await.unwrap();
    assert_eq!(d.retry_after(), Some(Duration::from_nanos(1)), "{d:?}");
    clock.advance(Duration::from_nanos(1));
    assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
}

/// A reload keeps every key's penalty box: a blocked key stays blocked until its block ends
/// (and a tier the reload changed carries its used fraction, the block notwithstanding),
/// whatever the reload did to the box. A changed block applies from the next breach: the
/// current block is neither cut short nor lengthened. A tier that loses its box frees its
/// blocked keys. (Before boxes were carried, the reload to the shorter block admitted the
/// blocked key at once.)
#[test]
fn a_reload_keeps_every_block_and_a_changed_block_applies_from_the_next_breach() {
    use tollgate::store::{Carry, Check};

    let clock = support::clock_at_hour();
    let store = support::memory_store(&clock);
    let minute = Quota::per_minute(10);
    let policy = |hourly: u64, block: Option<Duration>| {
        let b =
            Policy::builder("reload").tier("minute", minute).tier("hour", Quota::per_hour(hourly));
        match block {
            Some(block) => b.penalty("minute", Penalty::new(block)),
            None => b,
        }
        .build()
        .unwrap()
    };
    let old = store.bind_policy(&policy(100, Some(15 * MINUTE)));
    let key = Key::text("k");
    for _ in 0..10 {
        assert!(store.check_now(&old, Check::new(&key, 1)).decision.is_allowed());
    }
    assert!(!store.check_now(&old, Check::new(&key, 1)).decision.is_allowed());
    clock.advance(MINUTE);
    // The hour tier changes (200 an hour): a minute after 10 were used, 9 of 100 are (one
    // comes back every 36 s), 18 of 200 carried.
    let new = store.rebind_policy(&old, &policy(200, Some(15 * MINUTE)), Carry::UsedFraction);
    let d = store.check_now(&new, Check::new(&key, 1)).decision;
    assert_eq!(d.retry_after(), Some(14 * MINUTE), "still blocked: {d:?}");
    assert_eq!(d.tiers()[1].remaining(), 182, "{d:?}");
    // A shorter block: the key stays blocked until its block ends, and the tier keeps its
    // state (only its box changed; it refilled in the minute).
    let shorter = store.rebind_policy(&new, &policy(200, Some(MINUTE)), Carry::StartFull);
    let d = store.check_now(&shorter, Check::new(&key, 1)).decision;
    assert_eq!(d.retry_after(), Some(14 * MINUTE), "still blocked: {d:?}");
    assert_eq!(d.tiers()[1].remaining(), 182, "the hour tier is unchanged: {d:?}");
    // Once the block ends, the next breach blocks for the new length.
    clock.advance(14 * MINUTE);
    for _ in 0..10 {
        assert!(store.check_now(&shorter, Check::new(&key, 1)).decision.is_allowed());
    }
    let d = store.check_now(&shorter, Check::new(&key, 1)).decision;
    assert_eq!(d.retry_after(), Some(MINUTE), "the new block: {d:?}");
    // A tier that loses its box frees its blocked keys: refused only as the tier itself says.
    let unboxed = store.rebind_policy(&shorter, &policy(200, None), Carry::StartFull);
    let d = store.check_now(&unboxed, Check::new(&key, 1)).decision;
    assert_eq!(d.retry_after(), Some(MINUTE / 10), "{d:?}");
}
