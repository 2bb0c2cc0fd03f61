//! The lean layer (`RateLimitLayer::lean`): the same request trace through the layer itself
//! and through its lean form, each on a store of its own on one fake clock, answers alike
//! (status, headers, body) under every setting a lean layer keeps; policies that observe a
//! body are refused when the lean layer is asked for.

use std::convert::Infallible;
use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use tollgate::clock::FakeClock;
use tollgate::key::HeaderKey;
use tollgate::store::{MemoryStore, Store};
use tollgate::{
    Concurrency, HeaderFormat, HeaderStyle, MissingKey, Policy, Quota, RateLimitLayer, Unit,
};
use tower::{Layer, Service, ServiceExt};

/// What a layer's decision hook saw.
type Events = Arc<Mutex<Vec<String>>>;

/// Every setting the trace runs under.
const VARIANTS: [&str; 9] =
    ["plain", "headers_off", "legacy", "draft7", "dry_run", "custom", "scoped", "shaped", "tarpit"];

/// The settings that wait (shaping, the tarpit) on tokio's timer: with the memory store only,
/// whose tests run on paused time.
#[cfg(feature = "redis")]
const WAITING: [&str; 2] = ["shaped", "tarpit"];

/// "api": 3 a minute, GCRA (a burst of 3, one back each 20 s); "pro": 10 a minute, chosen by
/// `x-plan: pro` under "scoped".
/// The decision hook writes each decision's policy and outcome to `events`.
fn layer<St: Store>(variant: &str, store: St, events: &Events) -> RateLimitLayer<HeaderKey, St> {
    let api = Policy::single("api", Quota::per_minute(3)).unwrap();
    let events = Arc::clone(events);
    let builder = RateLimitLayer::builder(api)
        .key(HeaderKey::new(HeaderName::from_static("x-key")))
        .store(store)
        .on_decision(move |event| {
            let seen = format!("{} {:?}", event.policy.name(), event.outcome);
            events.lock().unwrap().push(seen);
        });
    let builder = match variant {
        "plain" => builder,
        "headers_off" => builder.headers(HeaderStyle::None).missing_key(MissingKey::Allow),
        "legacy" => builder.headers(HeaderStyle::Legacy),
        "draft7" => builder.header_format(HeaderFormat::Draft7),
        "dry_run" => builder.dry_run(true),
        "custom" => builder.rejection(|limited| {
            let body = format!("slow down, {}", limited.policy().name());
            Response::builder().status(StatusCode::IM_A_TEAPOT).body(body).unwrap()
        }),
        "scoped" => builder
            .allow_keys(["vip"])
            .policy(Policy::single("pro", Quota::per_minute(10)).unwrap())
            .select(|head| match head.headers.get("x-plan") {
                Some(plan) if plan == "pro" => Some("pro"),
                _ => Some("api"),
            }),
        "shaped" => builder.shape(Duration::from_secs(30)),
        "tarpit" => builder.tarpit(Duration::from_secs(1)),
        other => panic!("unknown variant {other}"),
    };
    builder.build().unwrap()
}

/// The handler, for any request body type: `405 Method Not Allowed` to a POST (a charge the
/// layer gives back), 404 to `x-answer: missing`, `x-cost: 2` to `x-answer: double`, "ok"
/// otherwise.
fn handler<B: Send + 'static>()
-> impl Service<Request<B>, Response = Response<Body>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static {
    tower::service_fn(|req: Request<B>| async move {
        let mut res = Response::new(Body::from("ok"));
        if req.method() == Method::POST {
            *res.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
        }
        match req.headers().get("x-answer").map(|v| v.as_bytes()) {
            Some(b"missing") => *res.status_mut() = StatusCode::NOT_FOUND,
            Some(b"double") => {
                res.headers_mut().insert("x-cost", http::HeaderValue::from_static("2"));
            }
            _ => {}
        }
        Ok::<_, Infallible>(res)
    })
}

/// One request of the trace: seconds the clock moves first, the method, the key, whether it is
/// a gRPC call, and `x-plan`.
struct Step {
    advance: u64,
    method: Method,
    key: Option<&'static str>,
    grpc: bool,
    plan: Option<&'static str>,
}

const fn step(advance: u64, method: Method, key: Option<&'static str>) -> Step {
    Step { advance, method, key, grpc: false, plan: None }
}

/// Refunds by 405 (two POSTs leave the whole burst), a refusal, a gRPC refusal, a unit back
/// after 20 s, a request without a key, another key, an allow-listed key, another policy.
fn trace() -> Vec<Step> {
    vec![
        step(0, Method::POST, Some("b")),
        step(0, Method::POST, Some("b")),
        step(0, Method::GET, Some("b")),
        step(0, Method::GET, Some("b")),
        step(0, Method::GET, Some("b")),
        step(0, Method::GET, Some("b")),
        Step { grpc: true, ..step(0, Method::GET, Some("b")) },
        step(20, Method::GET, Some("b")),
        step(0, Method::GET, None),
        step(0, Method::GET, Some("a")),
        step(0, Method::GET, Some("vip")),
        Step { plan: Some("pro"), ..step(1, Method::GET, Some("b")) },
    ]
}

fn request(step: &Step) -> Request<Body> {
    let mut req = Request::builder().method(step.method.clone()).uri("/");
    if let Some(key) = step.key {
        req = req.header("x-key", key);
    }
    if step.grpc {
        req = req.header("content-type", "application/grpc");
    }
    if let Some(plan) = step.plan {
        req = req.header("x-plan", plan);
    }
    req.body(Body::empty()).unwrap()
}

async fn parts<B>(res: Response<B>) -> (StatusCode, HeaderMap, Bytes)
where
    B: http_body::Body,
    B::Error: Debug,
{
    let (head, body) = res.into_parts();
    (head.status, head.headers, body.collect().await.unwrap().to_bytes())
}

/// The statuses of the trace under `variant` (`grpc-status` for a gRPC call), asserting
/// that both services answered each request alike.
async fn differential<F, L, FB, LB>(
    variant: &str,
    clock: &FakeClock,
    mut full: F,
    mut lean: L,
) -> Vec<String>
where
    F: Service<Request<Body>, Response = Response<FB>, Error = Infallible>,
    L: Service<Request<Body>, Response = Response<LB>, Error = Infallible>,
    FB: http_body::Body,
    FB::Error: Debug,
    LB: http_body::Body,
    LB::Error: Debug,
{
    let mut statuses = Vec::new();
    for (i, step) in trace().iter().enumerate() {
        clock.advance(Duration::from_secs(step.advance));
        let want = parts(full.ready().await.unwrap().call(request(step)).await.unwrap()).await;
        let got = parts(lean.ready().await.unwrap().call(request(step)).await.unwrap()).await;
        assert_eq!(got, want, "{variant}: request {i}");
        statuses.push(match want.1.get("grpc-status") {
            Some(code) => format!("grpc {}", code.to_str().unwrap()),
            None => want.0.as_u16().to_string(),
        });
    }
    statuses
}

/// What the trace gives under `variant`, request by request.
fn expected(variant: &str) -> Vec<&'static str> {
    let limited = match variant {
        "custom" => "418",
        // Nothing refused.
        "dry_run" => "200",
        _ => "429",
    };
    let grpc_limited = if variant == "dry_run" { "200" } else { "grpc 8" };
    // The two 405s are given back: the burst of 3 is whole for the GETs. The last request
    // comes 1 s after the unit that came back was spent: refused, unless another policy
    // decides it.
    let mut want = vec![
        "405",
        "405",
        "200",
        "200",
        "200",
        limited,
        grpc_limited,
        "200",
        "400",
        "200",
        "200",
        limited,
    ];
    match variant {
        "headers_off" => want[8] = "200",
        "scoped" => want[11] = "200",
        // Shaped: the 4th GET waits its 20 s; the gRPC call would wait 40 s, over the budget,
        // the GET 20 s later waits 20 s more, within it, and the last would wait 39 s.
        "shaped" => want[5] = "200",
        _ => {}
    }
    want
}

/// Asserts that both layers' decision hooks saw the same decisions, and under "plain" which.
fn same_decisions(variant: &str, full: &Events, lean: &Events) {
    let seen = lean.lock().unwrap().clone();
    assert_eq!(seen, *full.lock().unwrap(), "{variant}");
    if variant == "plain" {
        // Every request with a key decided (the one without is refused before).
        let mut want = vec!["api Admitted"; 11];
        (want[5], want[6], want[10]) = ("api Limited", "api Limited", "api Limited");
        assert_eq!(seen, want);
    }
}

#[tokio::test(start_paused = true)]
async fn the_lean_layer_answers_as_the_layer_on_the_memory_store() {
    for variant in VARIANTS {
        let clock = FakeClock::new();
        let store = || MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let (seen_full, seen_lean) = (Events::default(), Events::default());
        let full = layer(variant, store(), &seen_full).layer(handler());
        let lean = layer(variant, store(), &seen_lean).lean().unwrap().layer(handler());
        let statuses = differential(variant, &clock, full, lean).await;
        assert_eq!(statuses, expected(variant), "{variant}");
        same_decisions(variant, &seen_full, &seen_lean);
    }
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn the_lean_layer_answers_as_the_layer_on_redis() {
    let Some(server) = crate::support::redis::Server::start("redis-server") else { return };
    for variant in VARIANTS.into_iter().filter(|v| !WAITING.contains(v)) {
        let clock = FakeClock::new();
        let store = |side: &str| {
            tollgate::store::RedisStore::builder(server.url())
                .clock(clock.clone())
                .prefix(format!("lean-{variant}-{side}"))
                .ttl_grace(Duration::from_secs(3600))
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap()
        };
        let (seen_full, seen_lean) = (Events::default(), Events::default());
        let full = layer(variant, store("full"), &seen_full).layer(handler());
        let lean = layer(variant, store("lean"), &seen_lean).lean().unwrap().layer(handler());
        let statuses = differential(variant, &clock, full, lean).await;
        assert_eq!(statuses, expected(variant), "{variant}");
        same_decisions(variant, &seen_full, &seen_lean);
    }
}

#[test]
fn a_policy_that_observes_a_body_has_no_lean_layer() {
    let slots = Policy::builder("uploads")
        .tier("rate", Quota::per_second(10))
        .concurrency("in-flight", Concurrency::new(4))
        .build()
        .unwrap();
    let err = RateLimitLayer::builder(slots).build().unwrap().lean().unwrap_err();
    assert_eq!(
        err.to_string(),
        "policy `uploads`, tier `in-flight`: holds concurrency slots until the response ends; \
         a lean layer observes no body, use the layer itself"
    );

    // A selector's policy counts too.
    let bytes = Policy::builder("pro")
        .tier("rate", Quota::per_second(10))
        .tier("upload", Quota::per_second(1_000_000).counting(Unit::RequestBytes))
        .build()
        .unwrap();
    let api = Policy::single("api", Quota::per_second(10)).unwrap();
    let layer = RateLimitLayer::builder(api).policy(bytes).select(|_| Some("api")).build();
    let err = layer.unwrap().lean().unwrap_err();
    assert_eq!(
        err.to_string(),
        "policy `pro`, tier `upload`: counts request_bytes; a lean layer observes no body, use \
         the layer itself"
    );
    assert!(matches!(err, tollgate::ConfigError::ObservesBody { .. }));

    // Requests at a rate and in calendar windows observe nothing.
    let plain = Policy::builder("api")
        .tier("second", Quota::per_second(10))
        .tier("hour", Quota::per_hour(1000))
        .build()
        .unwrap();
    assert!(RateLimitLayer::builder(plain).build().unwrap().lean().is_ok());
}

/// A store that cannot decide: failing closed (503, or `UNAVAILABLE` to a gRPC call) and
/// failing open (the request passed on, no headers) answer alike.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lean_layer_fails_closed_or_open_as_the_layer() {
    use tollgate::OnStoreError;
    let Some(mut server) = crate::support::redis::Server::start("redis-server") else { return };
    let store = tollgate::store::RedisStore::builder(server.url())
        .timeout(Duration::from_millis(300))
        .circuit_breaker(1, Duration::from_secs(600))
        .no_fallback()
        .build()
        .unwrap();
    let layer = |on_error| {
        RateLimitLayer::builder(Policy::single("outage", Quota::per_hour(5)).unwrap())
            .key(HeaderKey::new(HeaderName::from_static("x-key")))
            .store(store.clone())
            .on_store_error(on_error)
            .build()
            .unwrap()
    };
    server.kill();
    let clock = FakeClock::new();
    let mut statuses = Vec::new();
    for on_error in [OnStoreError::FailClosed, OnStoreError::FailOpen] {
        let full = layer(on_error).layer(handler());
        let lean = layer(on_error).lean().unwrap().layer(handler());
        statuses.extend(differential("outage", &clock, full, lean).await);
    }
    // Failing closed: 503 (`UNAVAILABLE`, 14, to the gRPC call), the 405s included, and 400
    // without a key (decided before the store is asked); failing open: the handler's answers.
    let closed = ["503", "503", "503", "503", "503", "503", "grpc 14", "503", "400", "503"];
    let open = ["405", "405", "200", "200", "200", "200", "200", "200", "400", "200"];
    let want = [&closed[..], &["503", "503"], &open, &["200", "200"]].concat();
    assert_eq!(statuses, want);
}

/// Every unit but requests, on a rate and on a calendar tier, observes a body: `lean` refuses
/// each, naming the tier and the unit; requests on both pass.
#[test]
fn every_unit_that_observes_a_body_has_no_lean_layer() {
    use tollgate::Calendar;
    let units = [
        Unit::RequestBytes,
        Unit::ResponseBytes,
        Unit::Reported,
        Unit::RequestMessages,
        Unit::ResponseMessages,
    ];
    // Policy `p`: 10 requests a second, and tier `u`, a rate or a calendar tier.
    let with_rate = |u: Quota| Policy::builder("p").tier("r", Quota::per_second(10)).tier("u", u);
    let with_calendar =
        |u: Calendar| Policy::builder("p").tier("r", Quota::per_second(10)).calendar("u", u);
    for unit in units {
        let rate = with_rate(Quota::per_second(1000).counting(unit)).build().unwrap();
        let calendar = with_calendar(Calendar::per_day(1000).counting(unit)).build().unwrap();
        for policy in [rate, calendar] {
            let err = RateLimitLayer::builder(policy).build().unwrap().lean().unwrap_err();
            assert_eq!(
                err,
                tollgate::ConfigError::ObservesBody {
                    policy: "p".into(),
                    tier: "u".into(),
                    reason: format!("counts {}", unit.name()),
                }
            );
        }
    }
    let calendar = with_calendar(Calendar::per_day(1000)).build().unwrap();
    assert!(RateLimitLayer::builder(calendar).build().unwrap().lean().is_ok());
}

/// A refusal of a request whose body the server will not read off (declared above 8 KiB, or
/// chunked) closes the HTTP/1.1 connection under both layers; a small declared body and an
/// HTTP/2 stream do not. `settle_cost` (a response saying it cost 2) and `refund_if` (a 404
/// given back) settle alike: the burst of 3 is spent by the third request.
#[tokio::test(start_paused = true)]
async fn the_lean_layer_closes_and_settles_as_the_layer() {
    let make = |clock: &FakeClock| {
        let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        RateLimitLayer::builder(Policy::single("api", Quota::per_minute(3)).unwrap())
            .key(HeaderKey::new(HeaderName::from_static("x-key")))
            .store(store)
            .refund_if(|status| status == StatusCode::NOT_FOUND)
            .settle_cost(|head| head.headers.get("x-cost")?.to_str().ok()?.parse().ok())
            .build()
            .unwrap()
    };
    let clock = FakeClock::new();
    let mut full = make(&clock).layer(handler());
    let mut lean = make(&clock).lean().unwrap().layer(handler());
    let req = |answer: Option<&'static str>, length: Option<&str>, chunked: bool, h2: bool| {
        let mut req = Request::builder().uri("/").header("x-key", "k");
        if let Some(answer) = answer {
            req = req.header("x-answer", answer);
        }
        if let Some(length) = length {
            req = req.header("content-length", length);
        }
        if chunked {
            req = req.header("transfer-encoding", "chunked");
        }
        if h2 {
            req = req.version(http::Version::HTTP_2);
        }
        req.body(Body::empty()).unwrap()
    };
    let cases = [
        (Some("double"), None, false, false),
        (Some("missing"), None, false, false),
        (None, None, false, false),
        (None, Some("8192"), false, false),
        (None, Some("8193"), false, false),
        (None, Some("nope"), false, false),
        (None, None, true, false),
        (None, Some("100000"), false, true),
    ];
    let mut seen = Vec::new();
    for (i, (answer, length, chunked, h2)) in cases.into_iter().enumerate() {
        let want = full.ready().await.unwrap().call(req(answer, length, chunked, h2)).await;
        let want = parts(want.unwrap()).await;
        let got = lean.ready().await.unwrap().call(req(answer, length, chunked, h2)).await;
        let got = parts(got.unwrap()).await;
        assert_eq!(got, want, "request {i}");
        seen.push((want.0.as_u16(), want.1.get("connection").is_some()));
    }
    let admitted = [(200, false), (404, false), (200, false)];
    let limited = [false, true, true, true, false].map(|closes| (429, closes));
    assert_eq!(seen, [&admitted[..], &limited].concat());
}

/// An inner service whose future answers `Err` each time it is polled.
#[derive(Clone)]
struct Failing;

impl<B> Service<Request<B>> for Failing {
    type Response = Response<Body>;
    type Error = &'static str;
    type Future = FailingFuture;
    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn call(&mut self, _: Request<B>) -> Self::Future {
        FailingFuture
    }
}

struct FailingFuture;

impl std::future::Future for FailingFuture {
    type Output = Result<Response<Body>, &'static str>;
    fn poll(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::task::Poll::Ready(Err("inner failed"))
    }
}

/// A layer on 3 requests a minute per `x-key`.
fn failing_layer() -> RateLimitLayer<HeaderKey, MemoryStore> {
    RateLimitLayer::builder(Policy::single("api", Quota::per_minute(3)).unwrap())
        .key(HeaderKey::new(HeaderName::from_static("x-key")))
        .build()
        .unwrap()
}

/// Polls `svc`'s future for an admitted request until it answers the inner service's error,
/// then polls it once more, which must panic as its docs say.
fn poll_again_after_an_inner_error<Svc>(mut svc: Svc)
where
    Svc: Service<Request<Body>, Error = &'static str>,
{
    use std::future::Future as _;
    let req = Request::builder().header("x-key", "k").body(Body::empty()).unwrap();
    let mut future = std::pin::pin!(svc.call(req));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let first = future.as_mut().poll(&mut cx);
    assert!(matches!(first, std::task::Poll::Ready(Err("inner failed"))));
    let _ = future.as_mut().poll(&mut cx);
}

/// `LeanFuture` documents a panic when polled after it completed: so it must after the inner
/// service's error too, not poll the inner future once more.
#[test]
#[should_panic(expected = "polled after completion")]
fn a_lean_future_polled_after_an_inner_error_panics() {
    poll_again_after_an_inner_error(failing_layer().lean().unwrap().layer(Failing));
}

/// As [`a_lean_future_polled_after_an_inner_error_panics`], for the layer itself.
#[test]
#[should_panic(expected = "polled after completion")]
fn a_response_future_polled_after_an_inner_error_panics() {
    poll_again_after_an_inner_error(failing_layer().layer(Failing));
}
