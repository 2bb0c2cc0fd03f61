//! Setup mistakes that leave requests without a key explain themselves: the response (in debug
//! builds, or when asked) and the log name the extractor, what it looked for, and the fix.

#![cfg(feature = "axum")]

use crate::support;

use std::net::SocketAddr;

use axum::Router;
use axum::body::Body;
use axum::extract::connect_info::MockConnectInfo;
use axum::routing::get;
use http::{HeaderName, Request, StatusCode};
use http_body_util::BodyExt;
use tollgate::key::{HeaderKey, PeerIp};
use tollgate::{MissingKey, Policy, Quota, RateLimitLayer};
use tower::ServiceExt;

use support::logs::Captured;
use support::{client, get as http_get, serve, serve_without_connect_info};

fn policy() -> Policy {
    Policy::single("api", Quota::per_minute(10)).unwrap()
}

fn detail(body: &[u8]) -> String {
    let json: serde_json::Value = serde_json::from_slice(body).unwrap();
    json["detail"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn served_without_connect_info_the_refusal_says_how_to_serve() {
    let logs = Captured::start(tracing::Level::INFO);
    let app = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(RateLimitLayer::builder(policy()).build().unwrap());
    let server = serve_without_connect_info(app).await;
    let c = client();
    for _ in 0..3 {
        let r = http_get(&c, &server.url("/"), &[]).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST);
        let detail = detail(&r.body);
        assert!(
            detail.starts_with(
                "no rate-limit key could be read from the request: PeerIp found no key: it \
                 looked for the peer's address in the request extensions"
            ),
            "{detail}"
        );
        assert!(
            detail.contains("serve with `app.into_make_service_with_connect_info::<SocketAddr>()`"),
            "{detail}"
        );
    }
    // Logged once as a warning with the same explanation, not once per request.
    let text = logs.text();
    let warnings: Vec<_> = text.lines().filter(|l| l.contains(" WARN ")).collect();
    assert_eq!(warnings.len(), 1, "{text}");
    assert!(warnings[0].contains("refused a request without a key"), "{text}");
    assert!(warnings[0].contains("into_make_service_with_connect_info"), "{text}");
}

#[tokio::test]
async fn mock_connect_info_inside_the_limit_is_explained_and_outside_works() {
    let peer: SocketAddr = "192.0.2.1:1234".parse().unwrap();
    let limit = RateLimitLayer::builder(policy()).build().unwrap();
    // Wrong: `MockConnectInfo` added first is inside the limit, which runs before it.
    let wrong = Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(MockConnectInfo(peer))
        .layer(limit.clone());
    let res = wrong.oneshot(Request::get("/").body(Body::empty()).unwrap()).await.unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    let detail = detail(&body);
    assert!(
        detail.contains("axum tests: add `.layer(MockConnectInfo(addr))` after (outside) the"),
        "{detail}"
    );
    // Right: added after, it wraps the limit.
    let right =
        Router::new().route("/", get(|| async { "ok" })).layer(limit).layer(MockConnectInfo(peer));
    let res = right.oneshot(Request::get("/").body(Body::empty()).unwrap()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.headers()["ratelimit"], "\"api\";r=9;t=6");
}

#[tokio::test]
async fn a_header_key_without_its_header_names_the_header() {
    let layer = RateLimitLayer::builder(policy())
        .key(HeaderKey::new(HeaderName::from_static("x-api-key")))
        .build()
        .unwrap();
    let server = serve(Router::new().route("/", get(|| async { "ok" })).layer(layer)).await;
    let c = client();
    let r = http_get(&c, &server.url("/"), &[]).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        detail(&r.body),
        "no rate-limit key could be read from the request: HeaderKey found no key: it looked \
         for the `x-api-key` header, which the request does not have. Fix: send `x-api-key` \
         (gRPC: as metadata); to limit requests without it, choose `MissingKey::Shared` (one \
         shared budget) or `MissingKey::Allow`, or exempt them with the layer's `filter`"
    );
    let r = http_get(&c, &server.url("/"), &[("x-api-key", "")]).await;
    assert!(detail(&r.body).contains("the `x-api-key` header, which the request sent empty"));
    let r = http_get(&c, &server.url("/"), &[("x-api-key", "k1")]).await;
    assert_eq!(r.status, StatusCode::OK);
}

#[tokio::test]
async fn release_builds_answer_briefly_unless_asked_and_other_choices_apply() {
    let app = |layer| Router::new().route("/", get(|| async { "ok" })).layer(layer);
    let request = || Request::get("/").body(Body::empty()).unwrap();
    let brief = RateLimitLayer::builder(policy()).explain_missing_key(false).build().unwrap();
    let res = app(brief).oneshot(request()).await.unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(detail(&body), "no rate-limit key could be read from the request");

    // A configured status; gRPC calls get the explanation in `grpc-message`.
    let layer = RateLimitLayer::builder(policy())
        .key(PeerIp::new())
        .missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED))
        .explain_missing_key(true)
        .build()
        .unwrap();
    let grpc = Request::post("/pkg.Svc/Call")
        .header("content-type", "application/grpc")
        .body(Body::empty())
        .unwrap();
    let res = app(layer.clone()).oneshot(grpc).await.unwrap();
    assert_eq!(res.headers()["grpc-status"], "16");
    let message = res.headers()["grpc-message"].to_str().unwrap();
    assert!(message.starts_with("no rate-limit key could be read from the request: PeerIp"));
    assert_eq!(app(layer).oneshot(request()).await.unwrap().status(), StatusCode::UNAUTHORIZED);

    // Shared: every keyless request spends one budget (2 per hour here); Allow: none is limited.
    let shared = RateLimitLayer::builder(Policy::single("api", Quota::per_hour(2)).unwrap())
        .missing_key(MissingKey::Shared)
        .build()
        .unwrap();
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(app(shared.clone()).oneshot(request()).await.unwrap().status());
    }
    assert_eq!(statuses, [StatusCode::OK, StatusCode::OK, StatusCode::TOO_MANY_REQUESTS]);
    let allow = RateLimitLayer::builder(Policy::single("api", Quota::per_hour(2)).unwrap())
        .missing_key(MissingKey::Allow)
        .build()
        .unwrap();
    for _ in 0..3 {
        assert_eq!(app(allow.clone()).oneshot(request()).await.unwrap().status(), StatusCode::OK);
    }
}
