//! Reserved capacity by priority ([`Reserve`], [`Priority`]) on the in-memory store, on an
//! injected clock: each class is refused exactly at its threshold with its own retry, lower
//! classes never take the critical reserve, 3x overload admits no more than the limit and
//! refuses no critical request, reserves that cannot work are refused at their field, and over
//! HTTP the class comes from a header.

use crate::support;
use crate::support::priority as scenarios;

use axum::Router;
use axum::routing::get;
use tollgate::{Algorithm, Policy, Quota, RateLimitLayer, Reserve};

use support::memory_limiter;

#[tokio::test]
async fn three_times_overload_refuses_no_critical_request_in_memory() {
    let clock = support::clock_at_hour();
    let limiter = memory_limiter(&clock, scenarios::overload_policy("overload"));
    let counts = scenarios::three_times_overload(&clock, &limiter).await;
    // Without the reserve the same trace refuses critical requests like any other: what the
    // test above holds is the reserve's doing.
    let clock = support::clock_at_hour();
    let single = Policy::single("overload", Quota::per_second(scenarios::RATE)).unwrap();
    let plain = memory_limiter(&clock, single);
    let without = scenarios::overload(&clock, &plain, 30).await;
    assert!(without.critical_refused > 100, "{without:?}");
    // One limit either way; without a reserve none of it is kept back.
    assert_eq!(without.limit, counts.limit);
    assert_eq!(without.admitted, without.limit, "{without:?}");
}

#[test]
fn reserves_that_cannot_work_are_refused_at_their_field() {
    let base = || Policy::builder("p").tier("t", Quota::per_second(10));
    let err = |b: tollgate::PolicyBuilder| b.build().unwrap_err().to_string();
    assert_eq!(
        err(base().reserve("u", Reserve::new().critical(1))),
        "tier `u`: reserve: the policy has no tier of this name"
    );
    assert_eq!(
        err(base().reserve("t", Reserve::new().critical(4).standard(6))),
        "tier `t`: reserve: critical 4 + standard 6 must be less than the capacity 10"
    );
    assert_eq!(
        err(base().reserve("t", Reserve::new().critical(u64::MAX).standard(1))),
        format!(
            "tier `t`: reserve: critical {} + standard 1 must be less than the capacity 10",
            u64::MAX
        )
    );
    assert_eq!(
        err(base().reserve("t", Reserve::new()).reserve("t", Reserve::new())),
        "tier `t`: reserve: the tier has one already"
    );
    assert_eq!(
        err(base().concurrency("c", tollgate::Concurrency::new(4)).reserve("c", Reserve::new())),
        "tier `c`: reserve: only a rate tier can reserve capacity"
    );
    assert_eq!(
        err(base().calendar("d", tollgate::Calendar::per_day(5)).reserve("d", Reserve::new())),
        "tier `d`: reserve: only a rate tier can reserve capacity"
    );
    for alg in [
        Algorithm::TokenBucket,
        Algorithm::LeakyBucket,
        Algorithm::FixedWindow,
        Algorithm::SlidingCounter,
        Algorithm::SlidingLog,
    ] {
        let e = base().algorithm(alg).reserve("t", Reserve::new().critical(1)).build().unwrap_err();
        assert!(matches!(&e, tollgate::ConfigError::Reserve { tier, .. } if tier == "t"), "{e}");
        assert_eq!(
            e.to_string(),
            format!("tier `t`: reserve: reserved capacity runs on gcra only, not {}", alg.name())
        );
    }
    // The tier may come after the reserve; 9 of 10 reserved leaves sheddable requests one.
    let p = Policy::builder("p")
        .reserve("t", Reserve::new().critical(5).standard(4))
        .tier("t", Quota::per_second(10))
        .build()
        .unwrap();
    assert_eq!(p.tiers()[0].capacity_for(tollgate::Priority::Sheddable), 1);
}

/// Over HTTP through the layer, the class read from a header: once sheddable requests have
/// used their share they get 429 with the `Retry-After` of their class and a `RateLimit` header
/// saying what their class has left, while critical requests are still served.
#[tokio::test]
async fn the_class_comes_from_a_header_over_http() {
    let clock = support::clock_at_hour();
    let store = support::memory_store(&clock);
    let layer = RateLimitLayer::builder(scenarios::minute_policy("http"))
        .key(tollgate::key::GlobalKey)
        .store(store)
        .priority_header(http::HeaderName::from_static("x-priority"))
        .build()
        .unwrap();
    let app = Router::new().route("/", get(|| async { "ok" })).layer(layer);
    let server = support::serve(app).await;
    let client = support::client();
    let url = server.url("/");
    let shed = [("x-priority", "sheddable")];
    for _ in 0..5 {
        assert_eq!(support::get(&client, &url, &shed).await.status, 200);
    }
    let refused = support::get(&client, &url, &shed).await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("retry-after"), Some("6"));
    let ratelimit = refused.header("ratelimit").expect("a RateLimit header");
    assert!(ratelimit.contains("\"minute\";r=0;t="), "{ratelimit}");
    // A missing or unknown class is standard: 3 more; then only critical requests pass.
    assert_eq!(support::get(&client, &url, &[]).await.status, 200);
    assert_eq!(support::get(&client, &url, &[("x-priority", "urgent")]).await.status, 200);
    assert_eq!(support::get(&client, &url, &[("x-priority", "Standard")]).await.status, 200);
    assert_eq!(support::get(&client, &url, &[]).await.status, 429);
    let critical = support::get(&client, &url, &[("x-priority", "critical")]).await;
    assert_eq!(critical.status, 200);
    let ratelimit = critical.header("ratelimit").expect("a RateLimit header");
    assert!(ratelimit.contains("\"minute\";r=1;"), "{ratelimit}");
}

#[tokio::test]
async fn each_class_decides_exactly_at_its_threshold_in_memory() {
    scenarios::every_scenario_in_memory().await;
}
