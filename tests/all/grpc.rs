//! gRPC end to end: a tonic server (the `grpc.health.v1.Health` service of tonic-health, a
//! unary `Check` and a server-streaming `Watch`) behind the layer, called by tonic's client
//! over real HTTP/2 on 127.0.0.1. Refusals reach the client as `RESOURCE_EXHAUSTED` with the
//! gRFC A6 pushback; gRPC-Web and plain HTTP requests to the same server keep the HTTP 429.
#![cfg(feature = "tonic")]

use crate::support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Method, Request, StatusCode};
use http_body_util::Full;
use tokio::net::TcpListener;
use tollgate::clock::FakeClock;
use tollgate::key::{GrpcMethod, HeaderKey, Key, KeyExtractor, PeerIp};
use tollgate::layer::Unselected;
use tollgate::store::{Check, MemoryStore, Store, Verdict};
use tollgate::{ConfigError, OnStoreError, Policy, Quota, RateLimitLayer, StoreError};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tonic_health::ServingStatus;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus as Reported;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::server::HealthReporter;

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const CHECK: &str = "/grpc.health.v1.Health/Check";
const WATCH: &str = "/grpc.health.v1.Health/Watch";

/// A tonic server on a free loopback port, stopped when this is dropped.
struct GrpcServer {
    addr: SocketAddr,
    reporter: HealthReporter,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for GrpcServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl GrpcServer {
    async fn client(&self) -> HealthClient<Channel> {
        let channel = Channel::from_shared(format!("http://{}", self.addr))
            .expect("endpoint")
            .connect()
            .await
            .expect("connect");
        HealthClient::new(channel)
    }
}

/// Serves the health service behind `layer`, accepting HTTP/1.1 too (for the gRPC-Web and
/// plain HTTP requests).
async fn serve<K: KeyExtractor, St: Store>(layer: RateLimitLayer<K, St>) -> GrpcServer {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let (reporter, health) = tonic_health::server::health_reporter();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        Server::builder()
            .accept_http1(true)
            .layer(layer)
            .add_service(health)
            .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
                let _ = stopped.await;
            })
            .await
            .expect("serve");
    });
    GrpcServer { addr, reporter, stop: Some(stop) }
}

fn store(clock: &FakeClock) -> MemoryStore {
    MemoryStore::builder().clock(clock.clone()).build().unwrap()
}

/// A layer of one tier, `name`, enforcing `quota` per peer address on a memory store on `clock`.
fn per_peer(name: &str, quota: Quota, clock: &FakeClock) -> RateLimitLayer {
    RateLimitLayer::builder(Policy::single(name, quota).unwrap())
        .store(store(clock))
        .build()
        .unwrap()
}

/// A layer over a store that is [`Down`], failing closed.
fn failing_closed() -> RateLimitLayer<PeerIp, Down> {
    RateLimitLayer::builder(Policy::single("api", Quota::per_second(5)).unwrap())
        .store(Down)
        .on_store_error(OnStoreError::FailClosed)
        .build()
        .unwrap()
}

/// A layer allowing one call an hour per tenant, keyed by the `x-api-key` metadata.
fn per_tenant() -> RateLimitLayer<HeaderKey> {
    RateLimitLayer::builder(Policy::single("tenant", Quota::per_hour(1)).unwrap())
        .key(HeaderKey::new(HeaderName::from_static("x-api-key")))
        .build()
        .unwrap()
}

async fn check(client: &mut HealthClient<Channel>) -> Result<Reported, Status> {
    let res = client.check(HealthCheckRequest { service: String::new() }).await?;
    Ok(res.into_inner().status())
}

/// A metadata entry of a status, as text.
fn meta<'a>(status: &'a Status, name: &str) -> Option<&'a str> {
    status.metadata().get(name).map(|v| v.to_str().expect("ascii metadata"))
}

#[tokio::test]
async fn unary_calls_past_the_limit_get_resource_exhausted_with_the_exact_pushback() {
    let clock = FakeClock::new();
    let layer = per_peer("check", Quota::per_minute(2), &clock);
    let limiter = layer.limiter().clone();
    let server = serve(layer).await;
    let mut client = server.client().await;

    assert_eq!(check(&mut client).await.unwrap(), Reported::Serving);
    assert_eq!(check(&mut client).await.unwrap(), Reported::Serving);
    let refused = check(&mut client).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert_eq!(refused.message(), "rate limited by policy `check`: quota exceeded");
    // 2 per minute: the next unit is back 30 s after the first two.
    assert_eq!(meta(&refused, "grpc-retry-pushback-ms"), Some("30000"));
    assert_eq!(meta(&refused, "ratelimit-policy"), Some(r#""check";q=2;w=60"#));
    assert_eq!(meta(&refused, "ratelimit"), Some(r#""check";r=0;t=60"#));
    assert_eq!(meta(&refused, "retry-after"), None);
    // The key was the peer address, read from tonic's `TcpConnectInfo`.
    let state = limiter.check(&Key::Ip(LOOPBACK), 0).await.unwrap();
    assert_eq!(state.tiers()[0].remaining(), 0);

    // A millisecond short of the pushback it is still refused, and says so; then admitted.
    clock.advance(Duration::from_millis(29_999));
    let refused = check(&mut client).await.unwrap_err();
    assert_eq!(
        (refused.code(), meta(&refused, "grpc-retry-pushback-ms")),
        (Code::ResourceExhausted, Some("1"))
    );
    clock.advance(Duration::from_millis(1));
    assert_eq!(check(&mut client).await.unwrap(), Reported::Serving);
}

#[tokio::test]
async fn a_streaming_watch_is_limited_when_it_opens_and_then_streams_freely() {
    // A clock that stands still: nothing refills.
    let server = serve(per_peer("watch", Quota::per_minute(1), &FakeClock::new())).await;
    let mut client = server.client().await;
    let request = || HealthCheckRequest { service: String::new() };

    let mut stream = client.watch(request()).await.expect("the first watch opens").into_inner();
    let first = stream.message().await.unwrap().expect("a first status");
    assert_eq!(first.status(), Reported::Serving);

    let refused = client.watch(request()).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert_eq!(meta(&refused, "grpc-retry-pushback-ms"), Some("60000"));

    // The open stream is not charged per message: its updates keep coming.
    for status in [ServingStatus::NotServing, ServingStatus::Serving] {
        server.reporter.set_service_status("", status).await;
        let update = stream.message().await.unwrap().expect("an update");
        let expected =
            if status == ServingStatus::Serving { Reported::Serving } else { Reported::NotServing };
        assert_eq!(update.status(), expected);
    }
}

#[tokio::test]
async fn two_methods_with_different_policies_are_independent() {
    let clock = FakeClock::new();
    let layer = RateLimitLayer::builder(Policy::single("check", Quota::per_minute(2)).unwrap())
        .policy(Policy::single("watch", Quota::per_hour(1)).unwrap())
        .store(store(&clock))
        .select(|head| match GrpcMethod::split(head.uri.path())?.1 {
            "Check" => Some("check"),
            "Watch" => Some("watch"),
            _ => None,
        })
        .unselected(Unselected::Reject(StatusCode::FORBIDDEN))
        .build()
        .unwrap();
    let server = serve(layer).await;
    let mut client = server.client().await;
    let request = || HealthCheckRequest { service: String::new() };

    check(&mut client).await.unwrap();
    check(&mut client).await.unwrap();
    let refused = check(&mut client).await.unwrap_err();
    assert_eq!(meta(&refused, "grpc-retry-pushback-ms"), Some("30000"));

    // Check's budget is spent; Watch has its own.
    let watch = client.watch(request()).await.expect("watch has its own budget");
    assert_eq!(watch.metadata().get("ratelimit").unwrap(), r#""watch";r=0;t=3600"#);
    let refused = client.watch(request()).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert_eq!(refused.message(), "rate limited by policy `watch`: quota exceeded");
    assert_eq!(meta(&refused, "grpc-retry-pushback-ms"), Some("3600000"));

    // Check's state was not touched by Watch: it comes back on its own schedule.
    clock.advance(Duration::from_secs(30));
    assert_eq!(check(&mut client).await.unwrap(), Reported::Serving);
    assert_eq!(client.watch(request()).await.unwrap_err().code(), Code::ResourceExhausted);
}

#[tokio::test]
async fn a_method_key_gives_each_method_its_own_bucket_under_one_policy() {
    let layer = RateLimitLayer::builder(Policy::single("per-method", Quota::per_hour(1)).unwrap())
        .key((PeerIp::new(), GrpcMethod::new()))
        .build()
        .unwrap();
    let limiter = layer.limiter().clone();
    let server = serve(layer).await;
    let mut client = server.client().await;
    let request = || HealthCheckRequest { service: String::new() };

    check(&mut client).await.unwrap();
    let _watch = client.watch(request()).await.expect("another method, another bucket");
    assert_eq!(check(&mut client).await.unwrap_err().code(), Code::ResourceExhausted);
    assert_eq!(client.watch(request()).await.unwrap_err().code(), Code::ResourceExhausted);
    for method in [CHECK, WATCH] {
        let key = Key::Tuple([Key::Ip(LOOPBACK), Key::text(method)].into());
        assert_eq!(limiter.check(&key, 0).await.unwrap().tiers()[0].remaining(), 0);
    }
}

#[tokio::test]
async fn grpc_web_and_plain_http_on_the_same_server_keep_the_http_429() {
    let server = serve(per_peer("check", Quota::per_minute(2), &FakeClock::new())).await;
    let mut client = server.client().await;
    check(&mut client).await.unwrap();
    check(&mut client).await.unwrap();
    assert_eq!(check(&mut client).await.unwrap_err().code(), Code::ResourceExhausted);

    // The same peer over HTTP/1.1, to the same method path.
    let http = support::client();
    let url = format!("http://{}{CHECK}", server.addr);
    let post = |content_type: &str| {
        Request::builder()
            .method(Method::POST)
            .uri(&url)
            .header("content-type", content_type)
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    for content_type in
        ["application/grpc-web+proto", "application/grpc-web-text", "application/json"]
    {
        let reply = support::send(&http, post(content_type)).await;
        assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS, "{content_type}");
        assert_eq!(reply.header("content-type"), Some("application/problem+json"));
        assert_eq!(reply.header("retry-after"), Some("30"));
        assert_eq!(reply.header("grpc-status"), None);
        assert_eq!(reply.json()["status"], 429);
        assert_eq!(reply.json()["violated-policies"], serde_json::json!(["check"]));
    }
    // gRPC is told by its content type, whatever the HTTP version: a trailers-only answer.
    let reply = support::send(&http, post("application/grpc")).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.header("content-type"), Some("application/grpc"));
    assert_eq!(reply.header("grpc-status"), Some("8"));
    assert_eq!(
        reply.header("grpc-message"),
        Some("rate limited by policy `check`: quota exceeded")
    );
    assert_eq!(reply.header("grpc-retry-pushback-ms"), Some("30000"));
    assert_eq!(reply.header("ratelimit"), Some(r#""check";r=0;t=60"#));
    assert!(reply.body.is_empty());
}

#[tokio::test]
async fn a_cost_that_can_never_fit_has_no_pushback() {
    let layer = RateLimitLayer::builder(Policy::single("small", Quota::per_minute(2)).unwrap())
        .cost_fn(|_| 3)
        .build()
        .unwrap();
    let server = serve(layer).await;
    let refused = check(&mut server.client().await).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert_eq!(meta(&refused, "grpc-retry-pushback-ms"), None);
    assert_eq!(
        refused.message(),
        "rate limited by policy `small`: the request costs more than the capacity of the \
         violated policies; it can never be admitted"
    );
}

#[tokio::test]
async fn metadata_keys_and_a_missing_key() {
    let server = serve(per_tenant()).await;
    let mut client = server.client().await;
    let as_tenant = |key: &'static str| {
        let mut req = tonic::Request::new(HealthCheckRequest { service: String::new() });
        req.metadata_mut().insert("x-api-key", key.parse().unwrap());
        req
    };
    let mut codes = Vec::new();
    for key in ["acme", "acme", "globex"] {
        codes.push(client.check(as_tenant(key)).await.map(|_| ()).map_err(|s| s.code()));
    }
    assert_eq!(codes, [Ok(()), Err(Code::ResourceExhausted), Ok(())]);

    let missing = check(&mut client).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument);
    // Debug builds explain which extractor found nothing and how to fix it.
    assert!(missing.message().starts_with(
        "no rate-limit key could be read from the request: HeaderKey found no key: it looked \
         for the `x-api-key` header, which the request does not have."
    ));
}

#[cfg(feature = "client")]
#[tokio::test(start_paused = true)]
async fn a_status_that_is_not_retryable_is_returned_at_once() {
    // No `x-api-key` metadata: INVALID_ARGUMENT (as above), which no retry can fix.
    let server = serve(per_tenant()).await;
    let client = server.client().await;
    assert_eq!(retried(5, &client).await, (Code::InvalidArgument, 1, Duration::ZERO));
}

#[tokio::test]
async fn unselected_calls_get_the_status_of_the_configured_refusal() {
    let layer = RateLimitLayer::builder(Policy::single("check", Quota::per_hour(5)).unwrap())
        .select(|head| (head.uri.path() == CHECK).then_some("check"))
        .unselected(Unselected::Reject(StatusCode::FORBIDDEN))
        .build()
        .unwrap();
    let server = serve(layer).await;
    let mut client = server.client().await;
    assert_eq!(check(&mut client).await.unwrap(), Reported::Serving);
    let refused = client.watch(HealthCheckRequest { service: String::new() }).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied);
    assert_eq!(refused.message(), "no rate-limit policy applies to the request");
}

/// A store that always fails.
#[derive(Clone)]
struct Down;

impl Store for Down {
    type Bound = ();
    type Ticket = ();

    fn bind(&self, _: &Policy) -> Result<(), ConfigError> {
        Ok(())
    }

    async fn check(&self, _: &(), _: Check<'_>) -> Result<Verdict<()>, StoreError> {
        Err(StoreError::backend("connection refused"))
    }

    async fn settle(&self, _: &(), _: (), _: u64) -> Result<(), StoreError> {
        Ok(())
    }
}

#[tokio::test]
async fn a_store_failure_that_fails_closed_is_unavailable() {
    let server = serve(failing_closed()).await;
    let refused = check(&mut server.client().await).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable);
    assert_eq!(refused.message(), "the rate limiter cannot decide right now");
    assert_eq!(meta(&refused, "grpc-retry-pushback-ms"), Some("1000"));
}

#[tokio::test]
async fn shaping_holds_grpc_calls_then_refuses_over_budget() {
    // 10/s, burst 1, wait at most 250 ms, on a clock that stands still: the slots are 0, 100
    // and 200 ms away; a fourth call would wait 300 ms and is refused.
    let clock = FakeClock::new();
    let policy =
        Policy::builder("s").tier("s", Quota::per_second(10).with_burst(1)).build().unwrap();
    let layer = RateLimitLayer::builder(policy)
        .store(store(&clock))
        .shape(Duration::from_millis(250))
        .build()
        .unwrap();
    let server = serve(layer).await;
    let mut client = server.client().await;
    let mut took = Vec::new();
    for _ in 0..3 {
        let start = std::time::Instant::now();
        assert_eq!(check(&mut client).await.unwrap(), Reported::Serving);
        took.push(start.elapsed());
    }
    // Wall-clock lower bounds only: each call waited at least for its slot.
    assert!(took[1] >= Duration::from_millis(95), "{took:?}");
    assert!(took[2] >= Duration::from_millis(195), "{took:?}");
    let refused = check(&mut client).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    // On the frozen clock the fourth slot is 300 ms away: retried 50 ms from now, it would
    // fit the 250 ms budget.
    assert_eq!(meta(&refused, "grpc-retry-pushback-ms"), Some("50"));
}

/// A byte tier counts a gRPC request's body (its length-prefixed message, sent without a
/// `Content-Length`) as tonic reads it, over real HTTP/2.
#[tokio::test]
async fn a_grpc_request_body_is_counted_as_tonic_reads_it() {
    let clock = FakeClock::new();
    let capacity = 100 * 1024 * 1024;
    let policy = Policy::builder("bytes")
        .tier("bytes", Quota::per_hour(capacity).counting(tollgate::Unit::RequestBytes))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(policy)
        .key(tollgate::key::GlobalKey)
        .store(store(&clock))
        .build()
        .unwrap();
    let limiter = layer.limiter().clone();
    let server = serve(layer).await;
    let mut client = server.client().await;

    // A 1 MiB service name: the message is a tag byte, a 3-byte length and the name; the gRPC
    // frame adds a flag byte and a 4-byte length.
    let name = "s".repeat(1024 * 1024);
    let status = client.check(HealthCheckRequest { service: name }).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    let sent = 5 + 1 + 3 + 1024 * 1024;
    let mut left = 0;
    for _ in 0..500 {
        left = limiter.check(&Key::Global, 0).await.unwrap().tiers()[0].remaining();
        if left != capacity - 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(capacity - left, sent);
}

// ---------------------------------------------------------------------------------------------
// Retrying tonic calls with the client's retry policy
// ---------------------------------------------------------------------------------------------

/// tokio's clock counted from zero when it is made: under `start_paused` the server's limits
/// and the client's waits run on the same paused clock.
#[cfg(feature = "client")]
struct PausedClock(tokio::time::Instant);

#[cfg(feature = "client")]
impl tollgate::clock::Clock for PausedClock {
    fn now(&self) -> u64 {
        u64::try_from(self.0.elapsed().as_nanos()).unwrap()
    }
}

/// A policy of `attempts` attempts whose jitter is always zero: every wait is the server's
/// pushback alone.
#[cfg(feature = "client")]
fn no_jitter(attempts: u32) -> tollgate::client::RetryPolicy<()> {
    tollgate::client::RetryPolicy::<()>::builder()
        .max_attempts(attempts)
        .jitter(|_| Duration::ZERO)
        .build()
        .unwrap()
}

/// Calls `Check` through `policy`, counting the calls made; returns the outcome's code.
#[cfg(feature = "client")]
async fn check_with_retries(
    policy: &tollgate::client::RetryPolicy<()>,
    client: &HealthClient<Channel>,
    calls: &std::sync::atomic::AtomicU32,
) -> Code {
    let reply = policy
        .call(|| {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut client = client.clone();
            async move { client.check(HealthCheckRequest { service: String::new() }).await }
        })
        .await;
    match reply {
        Ok(_) => Code::Ok,
        Err(status) => status.code(),
    }
}

/// Calls `Check` through [`no_jitter`]`(attempts)`: the outcome's code, the calls made and the
/// time they took.
#[cfg(feature = "client")]
async fn retried(attempts: u32, client: &HealthClient<Channel>) -> (Code, u32, Duration) {
    let calls = std::sync::atomic::AtomicU32::new(0);
    let start = tokio::time::Instant::now();
    let code = check_with_retries(&no_jitter(attempts), client, &calls).await;
    (code, calls.into_inner(), start.elapsed())
}

#[cfg(feature = "client")]
#[tokio::test(start_paused = true)]
async fn a_refused_call_is_retried_after_exactly_the_pushback_and_succeeds() {
    let store = MemoryStore::builder().clock(PausedClock(tokio::time::Instant::now())).build();
    let layer = RateLimitLayer::builder(Policy::single("check", Quota::per_second(1)).unwrap())
        .store(store.unwrap())
        .build()
        .unwrap();
    let server = serve(layer).await;
    let mut client = server.client().await;
    check(&mut client).await.unwrap(); // the one unit of this second
    let refused = check(&mut client).await.unwrap_err();
    assert_eq!(meta(&refused, "grpc-retry-pushback-ms"), Some("1000"));

    // Refused, then retried once.
    assert_eq!(retried(3, &client).await, (Code::Ok, 2, Duration::from_millis(1000)));
}

#[cfg(feature = "client")]
#[tokio::test(start_paused = true)]
async fn unavailable_is_retried_until_the_attempts_are_spent() {
    // A store that fails closed: UNAVAILABLE with a pushback of 1 s, every time.
    let server = serve(failing_closed()).await;
    let client = server.client().await;
    assert_eq!(retried(3, &client).await, (Code::Unavailable, 3, Duration::from_millis(2000)));
}

/// Twenty concurrent calls against 10 a second (burst 10): ten are refused at once with the
/// same pushback. Retried through one `RetryPolicy` (default backoff, full jitter), the
/// retries are spread one pushback apart instead of all coming back at the instant one unit
/// frees: every call succeeds within 1.2 times the ideal second, in at most 30 attempts.
#[cfg(feature = "client")]
#[tokio::test(start_paused = true)]
async fn concurrent_refused_calls_retried_through_one_policy_do_not_storm() {
    let store = MemoryStore::builder().clock(PausedClock(tokio::time::Instant::now())).build();
    let layer = RateLimitLayer::builder(Policy::single("storm", Quota::per_second(10)).unwrap())
        .key(tollgate::key::GlobalKey)
        .store(store.unwrap())
        .build()
        .unwrap();
    let server = serve(layer).await;
    let client = server.client().await;
    let policy = tollgate::client::RetryPolicy::<()>::builder()
        .max_attempts(10)
        .jitter(tollgate::client::FullJitter::with_seed(7))
        .build()
        .unwrap();
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let start = tokio::time::Instant::now();
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let (policy, client, calls) = (policy.clone(), client.clone(), calls.clone());
            tokio::spawn(async move { check_with_retries(&policy, &client, &calls).await })
        })
        .collect();
    for task in tasks {
        assert_eq!(task.await.unwrap(), Code::Ok);
    }
    let elapsed = start.elapsed();
    let attempts = calls.load(std::sync::atomic::Ordering::SeqCst);
    // Ideal: the ten past the burst at 10 a second, the last at 1 s.
    assert!(elapsed <= Duration::from_millis(1_200), "{elapsed:?}");
    assert!(attempts <= 30, "{attempts} attempts");
}
