//! The failure policy: a server killed mid-run and restarted, with and without a fallback.

use super::*;

// ---------------------------------------------------------------------------------------------
// Failure policy: the server killed mid-run and restarted.

/// A store builder for `server` with a 300 ms timeout, its breaker opening after `failures`
/// failed calls for `open_for`.
fn breaking(server: &Server, failures: u32, open_for: Duration) -> RedisStoreBuilder {
    RedisStore::builder(server.url())
        .timeout(Duration::from_millis(300))
        .circuit_breaker(failures, open_for)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_falls_back_locally_opens_the_breaker_and_recovers() {
    let Some(mut server) = Server::start("redis-server") else { return };
    let builder = breaking(&server, 2, Duration::from_millis(200));
    let store = builder.fallback(MemoryStore::new()).build().unwrap();
    let policy = Policy::single("restart", Quota::per_hour(5)).unwrap();
    let limiter = Limiter::with_store(policy, store.clone()).unwrap();
    let key = Key::text("k");
    let decide = |cost| {
        let limiter = limiter.clone();
        let key = key.clone();
        async move {
            let d = limiter.check(&key, cost).await.expect("a fallback never errors");
            (d.source(), d.is_allowed(), d.tiers()[0].remaining())
        }
    };
    assert_eq!(decide(1).await, (Source::Store, true, 4));
    assert_eq!(decide(1).await, (Source::Store, true, 3));

    server.kill();
    // Redis is gone: the local fallback decides, from its own state.
    assert_eq!(decide(1).await, (Source::Fallback, true, 4));
    assert_eq!(decide(1).await, (Source::Fallback, true, 3));
    assert_eq!(store.breaker_state(), BreakerState::Open, "two failures open it");
    for remaining in [2, 1, 0] {
        assert_eq!(decide(1).await, (Source::Fallback, true, remaining));
    }
    assert_eq!(decide(1).await, (Source::Fallback, false, 0), "the fallback limits too");

    server.restart(); // returns once the server answers PING
    // Limiting by Redis resumes within 1 s: as soon as the breaker is half-open, the next call
    // is the probe, and one probe suffices (a refused reconnect is retried within the call).
    let restarted = std::time::Instant::now();
    while store.breaker_state() != BreakerState::HalfOpen {
        assert!(restarted.elapsed() < Duration::from_secs(1), "breaker never half-opened");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Cost 0 queries without charging.
    let (source, _, remaining) = decide(0).await;
    assert_eq!(source, Source::Store, "the first probe after the restart reaches Redis");
    assert_eq!(remaining, 5, "the restarted server is empty (--save \"\")");
    assert!(restarted.elapsed() < Duration::from_secs(1));
    assert_eq!(store.breaker_state(), BreakerState::Closed);
    for remaining in [4, 3, 2, 1, 0] {
        assert_eq!(decide(1).await, (Source::Store, true, remaining));
    }
    assert_eq!(decide(1).await, (Source::Store, false, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_fallback_the_layer_fails_closed_or_open_as_configured() {
    use tower::{Layer as _, ServiceExt as _};
    let Some(mut server) = Server::start("redis-server") else { return };
    let store = breaking(&server, 1, Duration::from_secs(600)).no_fallback().build().unwrap();
    let policy = Policy::single("outage", Quota::per_hour(5)).unwrap();
    let layer = |on_error| {
        RateLimitLayer::builder(policy.clone())
            .key(GlobalKey)
            .store(store.clone())
            .on_store_error(on_error)
            .build()
            .unwrap()
    };
    let closed = layer(OnStoreError::FailClosed).layer(support::ok_service());
    let open = layer(OnStoreError::FailOpen).layer(support::ok_service());
    let request = || http::Request::new(axum::body::Body::empty());

    let res = closed.clone().oneshot(request()).await.unwrap();
    assert_eq!(res.status(), http::StatusCode::OK);
    assert_eq!(res.headers()["ratelimit"], "\"outage\";r=4;t=720");

    server.kill();
    let res = closed.clone().oneshot(request()).await.unwrap();
    assert_eq!(res.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");
    assert_eq!(store.breaker_state(), BreakerState::Open);
    // Open: the store is not called at all, so nothing waits for the timeout.
    let limiter = Limiter::with_store(policy.clone(), store.clone()).unwrap();
    let err = limiter.check(&Key::Global, 1).await.unwrap_err();
    assert!(matches!(err, StoreError::CircuitOpen), "{err}");
    let res = closed.clone().oneshot(request()).await.unwrap();
    assert_eq!(res.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    // Failing open passes the request on, without rate-limit headers (nothing was decided).
    let res = open.oneshot(request()).await.unwrap();
    assert_eq!(res.status(), http::StatusCode::OK);
    assert!(res.headers().get("ratelimit").is_none());
}
