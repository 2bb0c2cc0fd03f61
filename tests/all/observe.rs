//! What the layer reports: the decision hook, dry-run events, redacted keys in logs, store
//! failures logged once per change, and the metrics scraped over HTTP from a Prometheus
//! exporter.
use crate::support;

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use http::{HeaderName, Request, Response, StatusCode};
use tollgate::RequestBody;
use tollgate::clock::TokioClock;
use tollgate::key::{HeaderKey, Key, Redacted};
use tollgate::layer::{LogKeys, Observed};
use tollgate::store::{Check, MemoryStore, Store, Verdict};
use tollgate::{ConfigError, Policy, Quota, RateLimitLayer, StoreError};
use tower::{Layer, ServiceExt, service_fn};

use support::logs::Captured;

fn request(api_key: &str) -> Request<Body> {
    Request::get("/").header("x-api-key", api_key).body(Body::empty()).unwrap()
}

fn ok(
    _req: Request<RequestBody<Body>>,
) -> impl Future<Output = Result<Response<Body>, Infallible>> {
    std::future::ready(Ok(Response::new(Body::from("ok"))))
}

fn api_key() -> HeaderKey {
    HeaderKey::new(HeaderName::from_static("x-api-key"))
}

/// What the hook saw: outcome, raw key, violated tiers.
type Seen = Arc<Mutex<Vec<(Observed, String, Vec<String>)>>>;

fn recording_layer(
    builder: tollgate::RateLimitLayerBuilder<HeaderKey, MemoryStore>,
) -> (RateLimitLayer<HeaderKey, MemoryStore>, Seen) {
    let seen: Seen = Arc::default();
    let sink = Arc::clone(&seen);
    let layer = builder
        .on_decision(move |event| {
            let violated = event.decision.map_or_else(Vec::new, |d| {
                d.violated_names(event.policy).map(str::to_owned).collect()
            });
            sink.lock().unwrap().push((event.outcome, event.key.to_string(), violated));
        })
        .build()
        .unwrap();
    (layer, seen)
}

#[tokio::test]
async fn the_hook_sees_every_decision_with_its_raw_key_and_violated_tiers() {
    let policy = Policy::builder("api")
        .tier("minute", Quota::per_minute(100))
        .tier("hour", Quota::per_hour(2))
        .build()
        .unwrap();
    let (layer, seen) = recording_layer(RateLimitLayer::builder(policy).key(api_key()));
    let svc = layer.layer(service_fn(ok));
    let statuses: Vec<_> = [
        ("alice", StatusCode::OK),
        ("alice", StatusCode::OK),
        ("alice", StatusCode::TOO_MANY_REQUESTS),
        ("bob", StatusCode::OK),
    ]
    .into_iter()
    .map(|(k, want)| (svc.clone(), k, want))
    .collect();
    for (svc, k, want) in statuses {
        assert_eq!(svc.oneshot(request(k)).await.unwrap().status(), want);
    }
    let seen = seen.lock().unwrap().clone();
    let hour = vec!["hour".to_owned()];
    assert_eq!(
        seen,
        vec![
            (Observed::Admitted, "s5:alice".to_owned(), vec![]),
            (Observed::Admitted, "s5:alice".to_owned(), vec![]),
            (Observed::Limited, "s5:alice".to_owned(), hour),
            (Observed::Admitted, "s3:bob".to_owned(), vec![]),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn the_hook_sees_how_long_shaped_requests_were_held() {
    let store = MemoryStore::builder().clock(TokioClock::new()).build().unwrap();
    let policy = Policy::single("s", Quota::per_second(10).with_burst(1)).unwrap();
    let builder =
        RateLimitLayer::builder(policy).key(api_key()).store(store).shape(Duration::from_secs(1));
    let (layer, seen) = recording_layer(builder);
    let svc = layer.layer(service_fn(ok));
    // Three at once: the first passes, the others are held for the next free slots.
    let calls: Vec<_> = (0..3).map(|_| tokio::spawn(svc.clone().oneshot(request("k")))).collect();
    for call in calls {
        assert_eq!(call.await.unwrap().unwrap().status(), StatusCode::OK);
    }
    let mut outcomes: Vec<_> = seen.lock().unwrap().iter().map(|s| s.0).collect();
    outcomes.sort_by_key(|o| match o {
        Observed::Shaped(d) => *d,
        _ => Duration::ZERO,
    });
    assert_eq!(
        outcomes,
        [
            Observed::Admitted,
            Observed::Shaped(Duration::from_millis(100)),
            Observed::Shaped(Duration::from_millis(200))
        ]
    );
}

#[tokio::test]
async fn dry_run_reports_each_would_be_refusal_with_a_redacted_key() {
    let logs = Captured::start(tracing::Level::INFO);
    let policy = Policy::single("plan", Quota::per_hour(1)).unwrap();
    let (layer, seen) =
        recording_layer(RateLimitLayer::builder(policy.clone()).key(api_key()).dry_run(true));
    let svc = layer.layer(service_fn(ok));
    for _ in 0..3 {
        let res = svc.clone().oneshot(request("sk_live_secret")).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
    let outcomes: Vec<_> = seen.lock().unwrap().iter().map(|s| s.0).collect();
    assert_eq!(outcomes, [Observed::Admitted, Observed::DryRunLimited, Observed::DryRunLimited]);

    let text = logs.text();
    let redacted = Redacted(&Key::text("sk_live_secret")).to_string();
    let events: Vec<_> = text.lines().filter(|l| l.contains("would have limited")).collect();
    assert_eq!(events.len(), 2, "{text}");
    for line in &events {
        assert!(line.contains(" INFO "), "{line}");
        assert!(line.contains("policy=\"plan\""), "{line}");
        assert!(line.contains(&format!("key={redacted}")), "{line}");
        assert!(line.contains("violated=plan"), "{line}");
    }
    assert!(!text.contains("secret"), "{text}");

    // Raw keys only on request.
    let raw = Captured::start(tracing::Level::INFO);
    let layer = RateLimitLayer::builder(policy)
        .key(api_key())
        .dry_run(true)
        .log_keys(LogKeys::Raw)
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(ok));
    for _ in 0..2 {
        svc.clone().oneshot(request("sk_live_secret")).await.unwrap();
    }
    assert!(raw.text().contains("key=s14:sk_live_secret"), "{}", raw.text());
}

#[tokio::test]
async fn refusals_are_logged_at_debug_with_a_redacted_key() {
    let logs = Captured::start(tracing::Level::DEBUG);
    let policy = Policy::single("p", Quota::per_hour(1)).unwrap();
    let svc = RateLimitLayer::builder(policy).key(api_key()).build().unwrap().layer(service_fn(ok));
    for _ in 0..2 {
        svc.clone().oneshot(request("user-42")).await.unwrap();
    }
    let text = logs.text();
    let limited: Vec<_> = text.lines().filter(|l| l.contains("tollgate: limited")).collect();
    assert_eq!(limited.len(), 1, "{text}");
    let redacted = Redacted(&Key::text("user-42")).to_string();
    assert!(limited[0].contains(&format!("key={redacted}")), "{text}");
    assert!(!text.contains("user-42"), "{text}");
}

/// A memory store that can be switched off.
#[derive(Clone)]
struct Switch {
    inner: MemoryStore,
    down: Arc<AtomicBool>,
}

impl Store for Switch {
    type Bound = <MemoryStore as Store>::Bound;
    type Ticket = <MemoryStore as Store>::Ticket;

    fn bind(&self, policy: &Policy) -> Result<Self::Bound, ConfigError> {
        self.inner.bind(policy)
    }

    fn check(
        &self,
        bound: &Self::Bound,
        check: Check<'_>,
    ) -> impl Future<Output = Result<Verdict<Self::Ticket>, StoreError>> + Send {
        let result = if self.down.load(Ordering::SeqCst) {
            Err(StoreError::backend("down"))
        } else {
            match self.inner.check_sync(bound, check) {
                Some(result) => result,
                None => Err(StoreError::backend("the memory store decides at once")),
            }
        };
        std::future::ready(result)
    }

    fn settle(
        &self,
        bound: &Self::Bound,
        ticket: Self::Ticket,
        cost: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.inner.settle(bound, ticket, cost)
    }
}

#[tokio::test]
async fn a_failing_store_is_logged_when_it_starts_and_when_it_ends_not_per_request() {
    let logs = Captured::start(tracing::Level::INFO);
    let store = Switch { inner: MemoryStore::new(), down: Arc::new(AtomicBool::new(true)) };
    let policy = Policy::single("p", Quota::per_hour(100)).unwrap();
    let seen: Seen = Arc::default();
    let sink = Arc::clone(&seen);
    let svc = RateLimitLayer::builder(policy)
        .key(api_key())
        .store(store.clone())
        .on_decision(move |e| sink.lock().unwrap().push((e.outcome, e.key.to_string(), vec![])))
        .build()
        .unwrap()
        .layer(service_fn(ok));
    let mut statuses = Vec::new();
    for i in 0..6 {
        if i == 4 {
            store.down.store(false, Ordering::SeqCst);
        }
        statuses.push(svc.clone().oneshot(request("k")).await.unwrap().status());
    }
    let unavailable = StatusCode::SERVICE_UNAVAILABLE;
    assert_eq!(
        statuses,
        [unavailable, unavailable, unavailable, unavailable, StatusCode::OK, StatusCode::OK]
    );
    let outcomes: Vec<_> = seen.lock().unwrap().iter().map(|s| s.0).collect();
    assert_eq!(outcomes[..4], [Observed::FailedClosed; 4]);
    assert_eq!(outcomes[4..], [Observed::Admitted; 2]);

    let text = logs.text();
    let failing: Vec<_> = text.lines().filter(|l| l.contains("store failed")).collect();
    assert_eq!(failing.len(), 1, "{text}");
    assert!(
        failing[0].contains(" WARN ") && failing[0].contains("failing closed until it answers")
    );
    assert_eq!(text.lines().filter(|l| l.contains("store answers again")).count(), 1, "{text}");
}

/// Metrics through a real Prometheus exporter, scraped over HTTP.
#[cfg(feature = "metrics")]
mod scraped {
    use super::*;
    use axum::Router;
    use axum::routing::get;
    use support::prometheus::handle as prometheus;
    use support::{client, get as http_get, serve};

    #[tokio::test]
    async fn metrics_count_decisions_by_policy_tier_and_outcome_and_scrape_over_http() {
        scrape_decisions("metered", "shadow", false).await;
    }

    /// The lean layer records the same series as the layer it was made from.
    #[tokio::test]
    async fn the_lean_layer_counts_decisions_as_the_layer() {
        scrape_decisions("metered_lean", "shadow_lean", true).await;
    }

    /// Five requests to a two-tier policy (3 an hour) and five to a dry-run one (2 an hour),
    /// through the layer or its lean form; the scraped counters per policy, tier and outcome.
    async fn scrape_decisions(metered: &str, shadow: &str, lean: bool) {
        let handle = prometheus().clone();
        let tiers = Policy::builder(metered)
            .tier("second", Quota::per_second(1000))
            .tier("hour", Quota::per_hour(3))
            .build()
            .unwrap();
        let shadow_policy = Policy::single(shadow, Quota::per_hour(2)).unwrap();
        let metered_layer = RateLimitLayer::builder(tiers).build().unwrap();
        let shadow_layer = RateLimitLayer::builder(shadow_policy).dry_run(true).build().unwrap();
        let (metered_routes, shadow_routes) = if lean {
            (
                Router::new()
                    .route("/metered", get(|| async { "ok" }))
                    .route_layer(metered_layer.lean().unwrap()),
                Router::new()
                    .route("/shadow", get(|| async { "ok" }))
                    .route_layer(shadow_layer.lean().unwrap()),
            )
        } else {
            (
                Router::new().route("/metered", get(|| async { "ok" })).route_layer(metered_layer),
                Router::new().route("/shadow", get(|| async { "ok" })).route_layer(shadow_layer),
            )
        };
        let app = metered_routes
            .merge(shadow_routes)
            .route("/metrics", get(move || std::future::ready(handle.render())));
        let server = serve(app).await;
        let c = client();
        for _ in 0..5 {
            http_get(&c, &server.url("/metered"), &[]).await;
            http_get(&c, &server.url("/shadow"), &[]).await;
        }
        let scraped = http_get(&c, &server.url("/metrics"), &[]).await;
        assert_eq!(scraped.status, StatusCode::OK);
        let text = String::from_utf8(scraped.body.to_vec()).unwrap();
        let value = |policy: &str, tier: &str, outcome: &str| {
            let series = format!(
                "tollgate_decisions_total{{policy=\"{policy}\",tier=\"{tier}\",outcome=\"{outcome}\"}} "
            );
            text.lines()
                .find_map(|l| l.strip_prefix(&series))
                .unwrap_or_else(|| panic!("{series} missing from\n{text}"))
                .parse::<u64>()
                .unwrap()
        };
        // Admissions count on every tier; a refusal only on the tier that refused.
        assert_eq!(value(metered, "second", "admitted"), 3);
        assert_eq!(value(metered, "hour", "admitted"), 3);
        assert_eq!(value(metered, "hour", "limited"), 2);
        assert_eq!(value(metered, "second", "limited"), 0);
        assert_eq!(value(shadow, shadow, "admitted"), 2);
        assert_eq!(value(shadow, shadow, "dry_run_limited"), 3);
        assert_eq!(value(shadow, shadow, "limited"), 0);
        // Keys never become labels. The one label that holds an address is `node`, the Redis
        // servers of the stores other tests of this binary built while the recorder was
        // installed.
        let series = text.lines().filter(|l| !l.contains("{node=\"127.0.0.1:"));
        assert!(series.clone().all(|l| !l.contains("127.0.0.1")), "{text}");
        let label = format!("policy=\"{metered}\"");
        assert!(series.clone().any(|l| l.contains(&label)), "{text}");
    }
}
