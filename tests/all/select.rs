//! Choosing what is limited, per request, over real HTTP on loopback: filters and method
//! filters, allow-lists by key and by network, a selector choosing one of several policies,
//! refunds of what the router refuses (404/405), and the build errors of these settings.
#![cfg(feature = "axum")]

use crate::support;

use std::net::{IpAddr, Ipv4Addr};

use axum::Router;
use axum::body::Body;
use axum::routing::get as route_get;
use bytes::Bytes;
use http::{HeaderName, Method, Request, StatusCode};
use http_body_util::Full;
use support::{HttpClient, Reply, client, get, send, serve};
use tollgate::key::{HeaderKey, Key, MethodKey, PeerIp};
use tollgate::layer::Unselected;
use tollgate::{ConfigError, Policy, Quota, RateLimitLayer};
use tower::util::MapRequestLayer;

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

fn api_key() -> HeaderKey {
    HeaderKey::new(HeaderName::from_static("x-api-key"))
}

/// A request with `method` to `url` and these headers.
async fn call(c: &HttpClient, method: Method, url: &str, headers: &[(&str, &str)]) -> Reply {
    let mut req = Request::builder().method(method).uri(url);
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    send(c, req.body(Full::new(Bytes::new())).unwrap()).await
}

/// The `r` of the first `RateLimit` item, and the name of that item.
fn remaining(reply: &Reply) -> Option<(String, u64)> {
    let value = reply.header("ratelimit")?;
    let (name, rest) = value.split_once(";r=")?;
    let r = rest.split(';').next()?.parse().ok()?;
    Some((name.trim_matches('"').to_owned(), r))
}

#[tokio::test]
async fn a_filter_limits_only_matching_requests_and_never_charges_the_others() {
    let policy = Policy::single("api", Quota::per_hour(2)).unwrap();
    let layer = RateLimitLayer::builder(policy)
        .filter(|head| head.uri.path().starts_with("/api/"))
        .build()
        .unwrap();
    let limiter = layer.limiter().clone();
    let app = Router::new()
        .route("/api/items", route_get(|| async { "items" }))
        .route("/static/app.js", route_get(|| async { "js" }))
        .layer(layer);
    let server = serve(app).await;
    let c = client();

    for _ in 0..5 {
        let r = get(&c, &server.url("/static/app.js"), &[]).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.header("ratelimit"), None, "a filtered-out request carries no headers");
        assert_eq!(r.header("ratelimit-policy"), None);
    }
    // Nothing was charged for them.
    let now = limiter.check(&Key::Ip(LOOPBACK), 0).await.unwrap();
    assert_eq!(now.tiers()[0].remaining(), 2);

    let statuses = [
        get(&c, &server.url("/api/items"), &[]).await,
        get(&c, &server.url("/api/items"), &[]).await,
        get(&c, &server.url("/api/items"), &[]).await,
    ];
    assert_eq!(remaining(&statuses[0]), Some(("api".into(), 1)));
    assert_eq!(remaining(&statuses[1]), Some(("api".into(), 0)));
    assert_eq!(statuses.iter().map(|r| r.status.as_u16()).collect::<Vec<_>>(), [200, 200, 429]);
    // Still untouched once the budget is spent.
    assert_eq!(get(&c, &server.url("/static/app.js"), &[]).await.status, StatusCode::OK);
}

fn every_method() -> axum::routing::MethodRouter {
    route_get(|| async { "get" })
        .post(|| async { "post" })
        .options(|| async { "preflight" })
        .delete(|| async { "delete" })
}

#[tokio::test]
async fn skip_methods_lets_preflights_through_untouched() {
    let policy = Policy::single("api", Quota::per_hour(1)).unwrap();
    let layer = RateLimitLayer::builder(policy).skip_methods([Method::OPTIONS]).build().unwrap();
    let server = serve(Router::new().route("/", every_method()).layer(layer)).await;
    let c = client();
    let url = server.url("/");
    for _ in 0..4 {
        let r = call(&c, Method::OPTIONS, &url, &[]).await;
        assert_eq!((r.status, r.header("ratelimit")), (StatusCode::OK, None));
    }
    let first = call(&c, Method::GET, &url, &[]).await;
    assert_eq!((first.status, remaining(&first)), (StatusCode::OK, Some(("api".into(), 0))));
    assert_eq!(call(&c, Method::POST, &url, &[]).await.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(call(&c, Method::OPTIONS, &url, &[]).await.status, StatusCode::OK);
}

#[tokio::test]
async fn only_methods_and_a_filter_combine() {
    let policy = Policy::single("writes", Quota::per_hour(1)).unwrap();
    // Writes are limited, except for the `x-internal` ones.
    let layer = RateLimitLayer::builder(policy)
        .only_methods([Method::POST, Method::DELETE])
        .filter(|head| !head.headers.contains_key("x-internal"))
        .build()
        .unwrap();
    let server = serve(Router::new().route("/", every_method()).layer(layer)).await;
    let c = client();
    let url = server.url("/");
    let mut statuses = Vec::new();
    for (method, headers) in [
        (Method::GET, &[][..]),
        (Method::GET, &[][..]),
        (Method::POST, &[][..]),
        (Method::POST, &[("x-internal", "1")][..]),
        (Method::DELETE, &[][..]),
        (Method::GET, &[][..]),
        (Method::OPTIONS, &[][..]),
    ] {
        let r = call(&c, method.clone(), &url, headers).await;
        let limited = r.header("ratelimit").is_some();
        statuses.push((method, r.status.as_u16(), limited));
    }
    assert_eq!(
        statuses,
        [
            (Method::GET, 200, false),
            (Method::GET, 200, false),
            (Method::POST, 200, true),
            (Method::POST, 200, false),
            (Method::DELETE, 429, true),
            (Method::GET, 200, false),
            (Method::OPTIONS, 200, false),
        ]
    );
}

#[tokio::test]
async fn allow_listed_keys_are_never_limited() {
    let policy = Policy::single("api", Quota::per_hour(1)).unwrap();
    let layer = RateLimitLayer::builder(policy)
        .key(api_key())
        .allow_keys(["internal-batch"])
        .build()
        .unwrap();
    let limiter = layer.limiter().clone();
    let server = serve(Router::new().route("/", route_get(|| async { "ok" })).layer(layer)).await;
    let c = client();
    let url = server.url("/");
    for _ in 0..5 {
        let r = get(&c, &url, &[("x-api-key", "internal-batch")]).await;
        assert_eq!((r.status, r.header("ratelimit")), (StatusCode::OK, None));
    }
    let internal = limiter.check(&Key::text("internal-batch"), 0).await.unwrap();
    assert_eq!(internal.tiers()[0].remaining(), 1, "allow-listed requests charge nothing");
    assert_eq!(get(&c, &url, &[("x-api-key", "partner")]).await.status, StatusCode::OK);
    assert_eq!(
        get(&c, &url, &[("x-api-key", "partner")]).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );
}

#[tokio::test]
async fn allow_listed_networks_are_never_limited_alone_or_in_a_composite_key() {
    let app = |layer: RateLimitLayer<_>| Router::new().route("/", every_method()).layer(layer);
    let policy = Policy::single("ip", Quota::per_hour(1)).unwrap();
    let c = client();

    // The test client connects from 127.0.0.1.
    let inside = RateLimitLayer::builder(policy.clone())
        .allow_cidrs(["10.0.0.0/8", "127.0.0.0/8"])
        .build()
        .unwrap();
    let server = serve(app(inside)).await;
    for _ in 0..4 {
        let r = get(&c, &server.url("/"), &[]).await;
        assert_eq!((r.status, r.header("ratelimit")), (StatusCode::OK, None));
    }

    let composite = RateLimitLayer::builder(policy.clone())
        .key((PeerIp::new(), MethodKey))
        .allow_cidrs(["127.0.0.1"])
        .build()
        .unwrap();
    let server = serve(Router::new().route("/", every_method()).layer(composite)).await;
    for _ in 0..4 {
        let r = call(&c, Method::POST, &server.url("/"), &[]).await;
        assert_eq!((r.status, r.header("ratelimit")), (StatusCode::OK, None));
    }

    let outside = RateLimitLayer::builder(policy).allow_cidrs(["10.0.0.0/8"]).build().unwrap();
    let server = serve(app(outside)).await;
    let statuses = [
        get(&c, &server.url("/"), &[]).await.status.as_u16(),
        get(&c, &server.url("/"), &[]).await.status.as_u16(),
    ];
    assert_eq!(statuses, [200, 429]);
}

/// free: 2 per hour, pro: 5 per hour, chosen by the `x-plan` header.
fn plans() -> tollgate::RateLimitLayerBuilder<HeaderKey> {
    RateLimitLayer::builder(Policy::single("free", Quota::per_hour(2)).unwrap())
        .policy(Policy::single("pro", Quota::per_hour(5)).unwrap())
        .key(api_key())
        .select(|head| head.headers.get("x-plan").and_then(|v| v.to_str().ok()))
}

#[tokio::test]
async fn the_selector_chooses_a_policy_per_request_each_with_its_own_state() {
    let layer = plans().build().unwrap();
    let (free, pro) = (layer.limiter_for("free").unwrap(), layer.limiter_for("pro").unwrap());
    assert_eq!((free.policy().name(), pro.policy().name()), ("free", "pro"));
    assert!(layer.limiter_for("gold").is_none());
    let server = serve(Router::new().route("/", route_get(|| async { "ok" })).layer(layer)).await;
    let c = client();
    let url = server.url("/");
    let as_plan = |plan: &'static str| [("x-api-key", "acme"), ("x-plan", plan)];

    let mut seen = Vec::new();
    for plan in ["free", "free", "free", "pro", "pro", "pro", "pro", "pro", "pro", "free"] {
        let r = get(&c, &url, &as_plan(plan)).await;
        seen.push((r.status.as_u16(), remaining(&r)));
    }
    let item = |name: &str, r| Some((name.to_owned(), r));
    assert_eq!(
        seen,
        [
            (200, item("free", 1)),
            (200, item("free", 0)),
            (429, item("free", 0)),
            // The same key on another plan spends that plan's budget, from full.
            (200, item("pro", 4)),
            (200, item("pro", 3)),
            (200, item("pro", 2)),
            (200, item("pro", 1)),
            (200, item("pro", 0)),
            (429, item("pro", 0)),
            (429, item("free", 0)),
        ]
    );
    let r = get(&c, &url, &as_plan("pro")).await;
    assert_eq!(r.header("ratelimit-policy"), Some(r#""pro";q=5;w=3600"#));

    // A plan no policy has, or none at all, passes untouched by default.
    for headers in [&as_plan("gold")[..], &[("x-api-key", "acme")][..]] {
        let r = get(&c, &url, headers).await;
        assert_eq!((r.status, r.header("ratelimit")), (StatusCode::OK, None));
    }
}

#[tokio::test]
async fn unselected_requests_can_be_refused() {
    let layer = plans().unselected(Unselected::Reject(StatusCode::FORBIDDEN)).build().unwrap();
    let server = serve(Router::new().route("/", route_get(|| async { "ok" })).layer(layer)).await;
    let c = client();
    let r = get(&c, &server.url("/"), &[("x-api-key", "acme"), ("x-plan", "gold")]).await;
    assert_eq!(r.status, StatusCode::FORBIDDEN);
    assert_eq!(r.header("content-type"), Some("application/problem+json"));
    assert_eq!(r.json()["detail"], "no rate-limit policy applies to the request");
    assert_eq!(r.json()["status"], 403);
    let r = get(&c, &server.url("/"), &[("x-api-key", "acme"), ("x-plan", "pro")]).await;
    assert_eq!((r.status, remaining(&r)), (StatusCode::OK, Some(("pro".into(), 4))));
}

/// What an authentication layer puts in the request extensions.
#[derive(Clone, Copy)]
struct Plan(&'static str);

#[tokio::test]
async fn the_selector_reads_an_extension_an_auth_layer_set() {
    let layer = RateLimitLayer::builder(Policy::single("free", Quota::per_hour(1)).unwrap())
        .policy(Policy::single("pro", Quota::per_hour(3)).unwrap())
        .key(api_key())
        .select(|head| head.extensions.get::<Plan>().map(|plan| plan.0))
        .build()
        .unwrap();
    // Stands for authentication: looks the key up and records the caller's plan.
    let auth = MapRequestLayer::new(|mut req: Request<Body>| {
        let plan = match req.headers().get("x-api-key").map(|v| v.as_bytes()) {
            Some(b"paying") => Some(Plan("pro")),
            Some(_) => Some(Plan("free")),
            None => None,
        };
        if let Some(plan) = plan {
            req.extensions_mut().insert(plan);
        }
        req
    });
    // The last layer added runs first: authentication, then the limit.
    let app = Router::new().route("/", route_get(|| async { "ok" })).layer(layer).layer(auth);
    let server = serve(app).await;
    let c = client();
    let mut seen = Vec::new();
    for key in ["paying", "trial", "paying", "trial", "paying", "paying"] {
        let r = get(&c, &server.url("/"), &[("x-api-key", key)]).await;
        seen.push(r.status.as_u16());
    }
    assert_eq!(seen, [200, 200, 200, 429, 200, 429]);
}

#[tokio::test]
async fn what_the_router_refuses_is_refunded_by_rule() {
    let policy = Policy::single("api", Quota::per_hour(2)).unwrap();
    let layer = RateLimitLayer::builder(policy)
        .refund_if(|s| s == StatusCode::NOT_FOUND || s == StatusCode::METHOD_NOT_ALLOWED)
        .build()
        .unwrap();
    let limiter = layer.limiter().clone();
    let server = serve(Router::new().route("/", route_get(|| async { "ok" })).layer(layer)).await;
    let c = client();
    for _ in 0..5 {
        assert_eq!(get(&c, &server.url("/nowhere"), &[]).await.status, StatusCode::NOT_FOUND);
        let r = call(&c, Method::DELETE, &server.url("/"), &[]).await;
        assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    }
    let now = limiter.check(&Key::Ip(LOOPBACK), 0).await.unwrap();
    assert_eq!(now.tiers()[0].remaining(), 2, "every 404 and 405 was given back");
    let statuses = [
        get(&c, &server.url("/"), &[]).await.status.as_u16(),
        get(&c, &server.url("/"), &[]).await.status.as_u16(),
        get(&c, &server.url("/"), &[]).await.status.as_u16(),
    ];
    assert_eq!(statuses, [200, 200, 429]);
}

#[test]
fn bad_selection_settings_are_refused_by_name() {
    let one = || Policy::single("free", Quota::per_second(10)).unwrap();
    let setting = |result: Result<RateLimitLayer, ConfigError>| match result {
        Err(ConfigError::Invalid { setting, .. }) => setting,
        Err(other) => panic!("unexpected error {other}"),
        Ok(_) => panic!("built"),
    };
    let pro = || Policy::single("pro", Quota::per_second(100)).unwrap();
    assert_eq!(setting(RateLimitLayer::builder(one()).policy(pro()).build()), "policy");
    assert_eq!(
        setting(RateLimitLayer::builder(one()).unselected(Unselected::Pass).build()),
        "unselected"
    );
    let twice = RateLimitLayer::builder(one()).policy(one()).select(|_| Some("free")).build();
    match twice {
        Err(ConfigError::Invalid { setting: "policy", reason }) => {
            assert_eq!(reason, "two policies are named `free`; the selector chooses them by name");
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
    assert_eq!(setting(RateLimitLayer::builder(one()).only_methods([]).build()), "only_methods");
    let err = RateLimitLayer::builder(one()).allow_cidrs(["10.0.0.0/8", "not-a-net"]).build();
    assert_eq!(
        err.map(|_| ()).unwrap_err().to_string(),
        r#"allow_cidrs: "not-a-net" is not a CIDR or an address"#
    );
    // A fixed cost is checked against every policy the selector may choose.
    let err = RateLimitLayer::builder(pro())
        .policy(one())
        .select(|_| None)
        .cost(50)
        .build()
        .map(|_| ())
        .unwrap_err();
    assert_eq!(err.to_string(), "cost: 50 units exceed the capacity of tier `free` (10 units)");
}
