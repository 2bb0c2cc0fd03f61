//! The testing kit on an axum app served in-process (`oneshot`, no sockets): a monthly quota
//! in Berlin across the change to summer time, a 23-hour day, shaping waits and a GCRA tier on
//! tokio's paused clock, the Redis store on the same virtual clock, and the assertions' own
//! failures.
#![cfg(feature = "testing")]

use crate::support;

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use http::{Request, Response, StatusCode};
use tollgate::clock::Clock;
use tollgate::key::GlobalKey;
use tollgate::store::Store;
use tollgate::testing::{RateLimitHeaders, VirtualClock, assert_admitted, assert_limited_until};
use tollgate::{Calendar, HeaderStyle, Policy, Quota, RateLimitLayer};
use tower::ServiceExt;

/// An app answering "ok" on `/`, limited by `policy` for everyone together on `store`.
fn app(policy: Policy, store: impl Store) -> Router {
    let layer = RateLimitLayer::builder(policy).key(GlobalKey).store(store);
    Router::new().route("/", get(|| async { "ok" })).layer(layer.build().unwrap())
}

/// A policy of one calendar tier, `tier` of `calendar` in Berlin's time zone.
fn in_berlin(name: &str, tier: &str, calendar: Calendar) -> Policy {
    Policy::builder(name).calendar(tier, calendar.in_time_zone("Europe/Berlin")).build().unwrap()
}

/// [`app`] on the memory store of `clock`, its headers in `style`.
fn app_styled(policy: Policy, clock: &VirtualClock, style: HeaderStyle) -> Router {
    let layer = RateLimitLayer::builder(policy).key(GlobalKey).store(clock.memory_store());
    Router::new().route("/", get(|| async { "ok" })).layer(layer.headers(style).build().unwrap())
}

async fn call(app: &Router) -> Response<Body> {
    app.clone().oneshot(Request::get("/").body(Body::empty()).unwrap()).await.unwrap()
}

/// The testing guide's recipe, word for word.
#[tokio::test(start_paused = true)]
async fn monthly_quota_resets_at_midnight_in_berlin() -> Result<(), Box<dyn std::error::Error>> {
    let clock = VirtualClock::starting_at("2026-03-28T12:00:00+01:00")?;
    let policy = Policy::builder("plan")
        .calendar("monthly", Calendar::per_month(3).in_time_zone("Europe/Berlin"))
        .build()?;
    let layer = RateLimitLayer::builder(policy).key(GlobalKey).store(clock.memory_store());
    let app = Router::new().route("/", get(|| async { "ok" })).layer(layer.build()?);
    let call = || app.clone().oneshot(Request::get("/").body(Body::empty()).unwrap());

    for _ in 0..3 {
        assert_admitted(&call().await?);
    }
    // Refused until midnight of the 1st in Berlin: 83 hours away, not 84.
    assert_limited_until(&call().await?, clock.until("2026-04-01T00:00:00+02:00")?);
    assert_limited_until(&call().await?, Duration::from_secs(83 * 3600));

    clock.advance_to("2026-03-31T23:59:59+02:00").await?;
    assert_limited_until(&call().await?, Duration::from_secs(1));
    clock.advance(Duration::from_secs(1)).await;
    let headers = assert_admitted(&call().await?);
    let monthly = headers.get("monthly").unwrap();
    assert_eq!(monthly.remaining, 2);
    assert_eq!(monthly.reset, Some(Duration::from_secs(30 * 24 * 3600))); // April: 30 days
    Ok(())
}

/// The testing guide's "A month in milliseconds" shows the body of the test above as it is
/// here.
#[test]
fn the_guide_recipe_is_the_test_above() {
    let guide = include_str!("../../src/guide/testing.md");
    let section = &guide[guide.find("## A month in milliseconds").expect("the section")..];
    let block = &section[section.find("```rust").expect("a rust block")..];
    let block = &block[block.find('\n').unwrap() + 1..];
    let block = &block[..block.find("```").expect("the block's end")];
    let body = &block[block.find("    let clock").expect("the body")..];
    let body = &body[..body.find("    Ok(())").expect("the body's end")];
    assert!(include_str!("testing.rs").contains(body), "guide recipe differs:\n{body}");
}

/// Every header of the refusals, exactly, and the instant of the reset to the nanosecond.
#[tokio::test(start_paused = true)]
async fn the_monthly_refusal_reports_every_field_exactly() {
    let clock = VirtualClock::starting_at("2026-03-28T12:00:00+01:00").unwrap();
    let policy = in_berlin("plan", "monthly", Calendar::per_month(3));
    let app = app_styled(policy, &clock, HeaderStyle::Both);
    for remaining in [2, 1, 0] {
        let headers = assert_admitted(&call(&app).await);
        assert_eq!(headers.get("monthly").unwrap().remaining, remaining);
    }
    let res = call(&app).await;
    let headers = assert_limited_until(&res, Duration::from_secs(298_800));
    assert_eq!(res.headers()["retry-after"], "298800");
    assert_eq!(headers.retry_after, Some(Duration::from_secs(298_800)));
    assert_eq!(
        headers.quotas,
        RateLimitHeaders::from_headers(res.headers()).quotas,
        "the assertion returns what the parser reads"
    );
    let monthly = headers.get("monthly").unwrap();
    assert_eq!(monthly.name.as_deref(), Some("monthly"));
    assert_eq!((monthly.remaining, monthly.quota), (0, Some(3)));
    assert_eq!(monthly.reset, Some(Duration::from_secs(298_800)));
    // `w` is the longest month: 31 days and the hour a change to winter time adds.
    assert_eq!(monthly.window, Some(Duration::from_secs(31 * 24 * 3600 + 3600)));
    assert_eq!(monthly.unit, None);
    assert_eq!(headers.quotas.len(), 1);

    // Tokio's clock moved the store's: one nanosecond before midnight the quota is still spent.
    let midnight = clock.until("2026-04-01T00:00:00+02:00").unwrap();
    clock.advance(midnight - Duration::from_nanos(1)).await;
    assert_eq!(clock.now(), 1_774_994_399_999_999_999);
    assert_limited_until(&call(&app).await, Duration::from_nanos(1));
    clock.advance(Duration::from_nanos(1)).await;
    assert_eq!(format!("{clock:?}"), "TokioClock(2026-03-31T22:00:00Z)");
    for remaining in [2, 1, 0] {
        assert_eq!(assert_admitted(&call(&app).await).get("monthly").unwrap().remaining, remaining);
    }
    // May 1st, 00:00 in Berlin (still summer time): 30 days.
    assert_limited_until(&call(&app).await, Duration::from_secs(30 * 86_400));
}

/// Sunday 29 March 2026 has 23 hours in Berlin: a daily quota spent at its first instant is
/// refused for exactly 82,800 s.
#[tokio::test(start_paused = true)]
async fn a_daily_quota_on_the_23_hour_day_is_refused_for_23_hours() {
    let clock = VirtualClock::starting_at("2026-03-29T00:00:00+01:00").unwrap();
    let policy = in_berlin("daily", "day", Calendar::per_day(1));
    let app = app(policy, clock.memory_store());
    assert_admitted(&call(&app).await);
    let headers = assert_limited_until(&call(&app).await, Duration::from_secs(23 * 3600));
    assert_eq!(headers.get("day").unwrap().reset, Some(Duration::from_secs(82_800)));
    // 01:59:59 CET, then 03:00:00 CEST one second later.
    clock.advance_to("2026-03-29T01:59:59+01:00").await.unwrap();
    assert_limited_until(&call(&app).await, Duration::from_secs(21 * 3600 + 1));
    clock.advance(Duration::from_secs(1)).await;
    assert_eq!(clock.until("2026-03-29T03:00:00+02:00").unwrap(), Duration::ZERO);
    assert_limited_until(&call(&app).await, Duration::from_secs(21 * 3600));
    clock.advance_to("2026-03-29T23:59:59+02:00").await.unwrap();
    assert_limited_until(&call(&app).await, Duration::from_secs(1));
    clock.advance(Duration::from_secs(1)).await;
    assert_admitted(&call(&app).await);
    // Monday has 24 hours again.
    assert_limited_until(&call(&app).await, Duration::from_secs(24 * 3600));
}

/// A shaped request is held for its slot, and `advance` releases it at that instant and not a
/// nanosecond before.
#[tokio::test(start_paused = true)]
async fn shaping_waits_follow_advance() {
    let clock = VirtualClock::starting_at("2026-03-28T12:00:00+01:00").unwrap();
    let policy = Policy::single("paced", Quota::per_second(1)).unwrap();
    let layer = RateLimitLayer::builder(policy)
        .key(GlobalKey)
        .store(clock.memory_store())
        .shape(Duration::from_secs(10));
    let app = Router::new().route("/", get(|| async { "ok" })).layer(layer.build().unwrap());
    assert_admitted(&call(&app).await);

    let start = tokio::time::Instant::now();
    let held = tokio::spawn({
        let app = app.clone();
        async move { call(&app).await }
    });
    tokio::task::yield_now().await; // the request reserves its slot and sleeps
    clock.advance(Duration::from_secs(1) - Duration::from_nanos(1)).await;
    tokio::task::yield_now().await;
    assert!(!held.is_finished(), "released before its slot");
    clock.advance(Duration::from_nanos(1)).await;
    let res = held.await.unwrap();
    assert_admitted(&res);
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    assert_eq!(clock.until("2026-03-28T12:00:01+01:00").unwrap(), Duration::ZERO);
    // The next slot is one more second away; beyond `max_delay` a request is refused instead.
    let third = tokio::spawn({
        let app = app.clone();
        async move { call(&app).await }
    });
    tokio::task::yield_now().await;
    clock.advance(Duration::from_secs(1)).await;
    assert_admitted(&third.await.unwrap());
    assert_eq!(start.elapsed(), Duration::from_secs(2));
}

/// `tokio::time::advance` alone leaves the default store refusing, since it reads the system's
/// clock; the store on the virtual clock admits again.
#[tokio::test(start_paused = true)]
async fn advance_moves_the_virtual_clocks_store_and_not_the_default_one() {
    let policy = Policy::single("api", Quota::per_minute(1)).unwrap();
    let layer = RateLimitLayer::builder(policy.clone()).key(GlobalKey).build().unwrap();
    let default = Router::new().route("/", get(|| async { "ok" })).layer(layer);
    let clock = VirtualClock::starting_at("2026-03-28T12:00:00+01:00").unwrap();
    let virtual_ = app(policy, clock.memory_store());
    for app in [&default, &virtual_] {
        assert_admitted(&call(app).await);
        assert_eq!(call(app).await.status(), StatusCode::TOO_MANY_REQUESTS);
    }
    tokio::time::advance(Duration::from_secs(60)).await;
    assert_eq!(call(&default).await.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_admitted(&call(&virtual_).await);
}

/// A GCRA tier of 2 a minute: the third request waits 30 s for one unit to drip back.
#[tokio::test(start_paused = true)]
async fn a_gcra_tier_refills_with_advance() {
    let clock = VirtualClock::starting_at("2026-03-28T12:00:00+01:00").unwrap();
    let policy = Policy::single("api", Quota::per_minute(2)).unwrap();
    let app = app(policy, clock.memory_store());
    assert_eq!(assert_admitted(&call(&app).await).get("api").unwrap().remaining, 1);
    assert_eq!(assert_admitted(&call(&app).await).get("api").unwrap().remaining, 0);
    let headers = assert_limited_until(&call(&app).await, Duration::from_secs(30));
    let api = headers.get("api").unwrap();
    assert_eq!((api.quota, api.window), (Some(2), Some(Duration::from_secs(60))));
    assert_eq!(api.reset, Some(Duration::from_secs(60)));
    clock.advance(Duration::from_millis(29_999)).await;
    assert_limited_until(&call(&app).await, Duration::from_millis(1));
    clock.advance(Duration::from_millis(1)).await;
    assert_eq!(assert_admitted(&call(&app).await).get("api").unwrap().remaining, 0);
    assert_limited_until(&call(&app).await, Duration::from_secs(30));
    clock.advance(Duration::from_secs(60)).await;
    assert_eq!(assert_admitted(&call(&app).await).get("api").unwrap().remaining, 1);
}

/// The same app on a Redis store given the virtual clock: the scripts decide at its instants,
/// calendar windows included. The test runs on tokio's real clock and jumps (a paused runtime
/// waiting on the network would move its clock to its next timer).
#[cfg(feature = "redis")]
#[tokio::test]
async fn a_redis_store_decides_on_the_virtual_clock() {
    use support::redis::Server;
    use tollgate::store::RedisStore;

    let Some(server) = Server::start("redis-server") else { return };
    let clock = VirtualClock::starting_at("2026-03-28T12:00:00+01:00").unwrap();
    let store = RedisStore::builder(server.url())
        .clock(clock)
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let policy = in_berlin("plan", "monthly", Calendar::per_month(3));
    let app = app(policy, store);
    for remaining in [2, 1, 0] {
        assert_eq!(assert_admitted(&call(&app).await).get("monthly").unwrap().remaining, remaining);
    }
    // Real time passes (well under a second here), and `Retry-After` rounds up.
    assert_limited_until(&call(&app).await, Duration::from_secs(83 * 3600));
    clock.jump(Duration::from_secs(83 * 3600 - 1)).await;
    assert_limited_until(&call(&app).await, Duration::from_secs(1));
    clock.jump(clock.until("2026-04-01T00:00:00+02:00").unwrap()).await;
    let headers = assert_admitted(&call(&app).await);
    let monthly = headers.get("monthly").unwrap();
    assert_eq!(monthly.remaining, 2);
    // Until May: 30 days, less the real time since the jump, rounded up.
    assert_eq!(monthly.reset, Some(Duration::from_secs(30 * 86_400)));
}

#[test]
#[should_panic(expected = "expected the request to be admitted, got HTTP/1.1 429 Too Many \
                           Requests\n  retry-after: 7\n  ratelimit: \"a\";r=0;t=7")]
fn assert_admitted_shows_the_refusal() {
    let res = Response::builder()
        .status(429)
        .header("retry-after", "7")
        .header("ratelimit", r#""a";r=0;t=7"#)
        .body(())
        .unwrap();
    assert_admitted(&res);
}

#[test]
#[should_panic(expected = "expected the request to be admitted, got HTTP/1.1 503")]
fn assert_admitted_refuses_a_store_failure() {
    assert_admitted(&Response::builder().status(503).body(()).unwrap());
}

#[test]
#[should_panic(expected = "expected the request to be admitted, got HTTP/1.1 200 OK\n  \
                           grpc-status: 8")]
fn assert_admitted_refuses_a_grpc_refusal() {
    assert_admitted(&Response::builder().header("grpc-status", "8").body(()).unwrap());
}

#[test]
#[should_panic(expected = "expected a refusal with Retry-After: 60 (60s), got HTTP/1.1 200 OK")]
fn assert_limited_until_refuses_an_admission() {
    assert_limited_until(&Response::builder().body(()).unwrap(), Duration::from_secs(60));
}

#[test]
#[should_panic(expected = "expected a refusal with Retry-After: 1 (1ns), got HTTP/1.1 429 Too \
                           Many Requests\n  retry-after: 2")]
fn assert_limited_until_compares_whole_seconds_rounded_up() {
    let res = Response::builder().status(429).header("retry-after", "1").body(()).unwrap();
    assert_limited_until(&res, Duration::from_nanos(1));
    assert_limited_until(&res, Duration::from_secs(1));
    let res = Response::builder().status(429).header("retry-after", "2").body(()).unwrap();
    assert_limited_until(&res, Duration::from_nanos(1_000_000_001));
    assert_limited_until(&res, Duration::from_nanos(1));
}

#[test]
#[should_panic(expected = "expected a refusal with Retry-After: 5 (5s), got HTTP/1.1 429")]
fn assert_limited_until_needs_a_retry_after() {
    // A request costing more than the capacity is refused with no time to come back.
    assert_limited_until(
        &Response::builder().status(429).body(()).unwrap(),
        Duration::from_secs(5),
    );
}

#[test]
fn headers_are_read_from_the_ietf_fields_else_the_legacy_ones() {
    let res = Response::builder()
        .header("ratelimit-policy", r#""burst";q=10;w=1, "slots";q=4;qu="concurrent-requests""#)
        .header("ratelimit", r#""burst";r=7;t=1, "slots";r=3;t=0, "orphan";r=1"#)
        .header("x-ratelimit-remaining", "99")
        .body(())
        .unwrap();
    let headers = RateLimitHeaders::from_response(&res);
    let names: Vec<_> = headers.quotas.iter().map(|q| q.name.as_deref().unwrap()).collect();
    assert_eq!(names, ["burst", "slots", "orphan"]);
    let slots = headers.get("slots").unwrap();
    assert_eq!((slots.remaining, slots.quota, slots.window), (3, Some(4), None));
    assert_eq!(slots.unit.as_deref(), Some("concurrent-requests"));
    let orphan = headers.get("orphan").unwrap();
    assert_eq!((orphan.remaining, orphan.reset, orphan.quota), (1, None, None));
    assert_eq!(headers.retry_after, None);

    let legacy = Response::builder()
        .status(429)
        .header("retry-after", "42")
        .header("x-ratelimit-limit", "60")
        .header("x-ratelimit-remaining", "0")
        .header("x-ratelimit-reset", "42")
        .body(())
        .unwrap();
    let headers = RateLimitHeaders::from_response(&legacy);
    assert_eq!(headers.retry_after, Some(Duration::from_secs(42)));
    let only = &headers.quotas[..];
    assert_eq!(only.len(), 1);
    assert_eq!(only[0].name, None);
    assert_eq!((only[0].remaining, only[0].quota), (0, Some(60)));
    assert_eq!(only[0].reset, Some(Duration::from_secs(42)));
    assert_eq!(headers.get("anything"), None);
}

/// The legacy fields the layer writes read back as the tightest tier.
#[tokio::test(start_paused = true)]
async fn legacy_headers_of_the_layer_read_back() {
    let clock = VirtualClock::starting_at("2026-03-28T12:00:00+01:00").unwrap();
    let policy = Policy::builder("p")
        .tier("burst", Quota::per_second(5))
        .calendar("daily", Calendar::per_day(2).in_time_zone("Europe/Berlin"))
        .build()
        .unwrap();
    let app = app_styled(policy, &clock, HeaderStyle::Legacy);
    let headers = assert_admitted(&call(&app).await);
    assert_eq!(headers.quotas.len(), 1);
    let tightest = &headers.quotas[0];
    assert_eq!((tightest.name.as_deref(), tightest.remaining, tightest.quota), (None, 1, Some(2)));
    // Until 00:00 on Sunday (CET): 12 hours.
    assert_eq!(tightest.reset, Some(Duration::from_secs(12 * 3600)));
}
