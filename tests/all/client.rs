//! The client side on a paused tokio clock: the retry policy's exact delays, and the pacing
//! layer against a tollgate server and against a server that only sends `Retry-After`.
#![cfg(feature = "client")]

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use tokio::time::Instant;
use tollgate::client::{FullJitter, PacingLayer, RetryPolicy};
use tollgate::key::{GlobalKey, RequestHead};
use tollgate::store::MemoryStore;
use tollgate::{Policy, Quota, RateLimitLayer};
use tower::{Layer, Service, ServiceBuilder, ServiceExt, service_fn};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// When each request reached a server, from the start of the test.
#[derive(Clone)]
struct Log {
    start: Instant,
    arrivals: Arc<Mutex<Vec<Duration>>>,
}

impl Log {
    fn new() -> Self {
        Self { start: Instant::now(), arrivals: Arc::default() }
    }

    /// Records an arrival now; returns its index.
    fn arrive(&self) -> usize {
        let mut arrivals = self.arrivals.lock().unwrap();
        arrivals.push(self.start.elapsed());
        arrivals.len() - 1
    }

    fn arrivals(&self) -> Vec<Duration> {
        self.arrivals.lock().unwrap().clone()
    }
}

fn response(status: u16, headers: &[(&str, &str)]) -> Response<String> {
    let mut res = Response::builder().status(status);
    for (k, v) in headers {
        res = res.header(*k, *v);
    }
    res.body(String::new()).unwrap()
}

/// A server whose `n`-th answer (from 0) is `script(n)`, logging every arrival.
fn scripted<B: Send + 'static>(
    log: &Log,
    script: impl Fn(usize) -> Response<String> + Clone + Send + 'static,
) -> impl Service<Request<B>, Response = Response<String>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static {
    let log = log.clone();
    service_fn(move |_req: Request<B>| {
        let res = script(log.arrive());
        async move { Ok::<_, Infallible>(res) }
    })
}

fn get() -> Request<String> {
    Request::get("http://api.test/items").body(String::new()).unwrap()
}

/// A policy with the largest jitter every time (`sample(ceiling) = ceiling`): the backoff alone.
fn max_jitter() -> tollgate::client::RetryPolicyBuilder<String> {
    RetryPolicy::<String>::builder().base(ms(100)).cap(secs(20)).jitter(|ceiling| ceiling)
}

// ---------------------------------------------------------------------------------------------
// Retry policy
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn backoff_with_full_jitter_draws_every_delay_from_the_seeded_rng() {
    let log = Log::new();
    let server = scripted(&log, |n| response(if n < 4 { 503 } else { 200 }, &[]));
    let policy = RetryPolicy::<String>::builder()
        .max_attempts(5)
        .base(ms(100))
        .cap(ms(500))
        .jitter(FullJitter::with_seed(42))
        .build()
        .unwrap();
    let res = ServiceBuilder::new().retry(policy).service(server).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);

    // sleep = random_between(0, min(cap, base * 2^attempt)), the same draws as the policy.
    let mut rng = fastrand::Rng::with_seed(42);
    let mut at = Duration::ZERO;
    let mut expected = vec![at];
    for ceiling_ms in [100, 200, 400, 500] {
        at += ms(rng.u64(0..=ceiling_ms));
        expected.push(at);
    }
    assert_eq!(log.arrivals(), expected);
    // Jittered: not the bare ceilings.
    assert_ne!(log.arrivals(), [ms(0), ms(100), ms(300), ms(700), ms(1200)]);
}

#[tokio::test(start_paused = true)]
async fn backoff_doubles_from_base_up_to_the_cap() {
    let log = Log::new();
    let server = scripted(&log, |n| response(if n < 5 { 429 } else { 200 }, &[]));
    let policy = max_jitter().max_attempts(6).cap(ms(500)).build().unwrap();
    let res = ServiceBuilder::new().retry(policy).service(server).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // Waits 100, 200, 400, 500 (capped), 500 ms.
    assert_eq!(log.arrivals(), [ms(0), ms(100), ms(300), ms(700), ms(1200), ms(1700)]);
}

#[tokio::test(start_paused = true)]
async fn retry_after_seconds_is_a_floor_under_the_jitter() {
    let log = Log::new();
    let server = scripted(&log, |n| match n {
        0 => response(429, &[("retry-after", "2")]),
        1 => response(503, &[("retry-after", "0")]),
        _ => response(200, &[]),
    });
    let policy = max_jitter().max_attempts(3).build().unwrap();
    let res = ServiceBuilder::new().retry(policy).service(server).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // max(100 ms jitter, 2 s hint) = 2 s; then max(200 ms jitter, 0 s hint) = 200 ms.
    assert_eq!(log.arrivals(), [ms(0), secs(2), ms(2200)]);
}

#[tokio::test(start_paused = true)]
async fn retry_after_http_date_is_taken_relative_to_the_date_header() {
    let log = Log::new();
    // Dates in 2015: relative to the system clock they would be long past (no wait at all).
    let server = scripted(&log, |n| match n {
        0 => response(
            503,
            &[
                ("date", "Wed, 21 Oct 2015 07:28:00 GMT"),
                ("retry-after", "Wed, 21 Oct 2015 07:28:03 GMT"),
            ],
        ),
        _ => response(200, &[]),
    });
    let policy = max_jitter().build().unwrap();
    let res = ServiceBuilder::new().retry(policy).service(server).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(log.arrivals(), [ms(0), secs(3)]);
}

#[tokio::test(start_paused = true)]
async fn grpc_statuses_are_retried_no_sooner_than_the_pushback() {
    let log = Log::new();
    let server = scripted(&log, |n| match n {
        0 => response(200, &[("grpc-status", "8"), ("grpc-retry-pushback-ms", "1500")]),
        1 => response(200, &[("grpc-status", "14")]),
        _ => response(200, &[("grpc-status", "0")]),
    });
    let policy = max_jitter().max_attempts(5).build().unwrap();
    let res = ServiceBuilder::new().retry(policy).service(server).oneshot(get()).await.unwrap();
    assert_eq!(res.headers()["grpc-status"], "0");
    // max(100 ms, 1500 ms pushback); then the 200 ms jitter alone.
    assert_eq!(log.arrivals(), [ms(0), ms(1500), ms(1700)]);
}

#[tokio::test(start_paused = true)]
async fn a_negative_or_malformed_pushback_means_do_not_retry() {
    for pushback in ["-1", "soon"] {
        let log = Log::new();
        let server = scripted(&log, move |_| {
            response(200, &[("grpc-status", "14"), ("grpc-retry-pushback-ms", pushback)])
        });
        let policy = max_jitter().max_attempts(5).build().unwrap();
        let res = ServiceBuilder::new().retry(policy).service(server).oneshot(get()).await.unwrap();
        assert_eq!(res.headers()["grpc-status"], "14");
        assert_eq!(log.arrivals(), [ms(0)], "pushback {pushback}");
    }
}

#[tokio::test(start_paused = true)]
async fn the_attempt_cap_returns_the_last_response() {
    let log = Log::new();
    let server = scripted(&log, |n| response(503, &[("x-attempt", &n.to_string())]));
    let policy = max_jitter().max_attempts(3).build().unwrap();
    let res = ServiceBuilder::new().retry(policy).service(server).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["x-attempt"], "2");
    assert_eq!(log.arrivals(), [ms(0), ms(100), ms(300)]);
}

#[tokio::test(start_paused = true)]
async fn a_wait_beyond_the_budget_ends_the_retries() {
    for (budget, expected) in [
        (ms(2500), vec![secs(0), secs(1), secs(2)]),
        // A wait that ends exactly at the budget is taken.
        (secs(3), vec![secs(0), secs(1), secs(2), secs(3)]),
    ] {
        let log = Log::new();
        let server = scripted(&log, |n| {
            response(429, &[("retry-after", "1"), ("x-attempt", &n.to_string())])
        });
        let policy = max_jitter().max_attempts(10).budget(budget).build().unwrap();
        let start = Instant::now();
        let res = ServiceBuilder::new().retry(policy).service(server).oneshot(get()).await.unwrap();
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(res.headers()["x-attempt"], (expected.len() - 1).to_string().as_str());
        assert_eq!(start.elapsed(), *expected.last().unwrap());
        assert_eq!(log.arrivals(), expected, "budget {budget:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn non_idempotent_methods_are_sent_once_unless_configured() {
    let post = || Request::post("http://api.test/items").body("{}".to_owned()).unwrap();

    let log = Log::new();
    let server = scripted(&log, |_| response(503, &[]));
    let policy = max_jitter().build().unwrap();
    let res = ServiceBuilder::new().retry(policy).service(server).oneshot(post()).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(log.arrivals(), [ms(0)]);

    let log = Log::new();
    let server = scripted(&log, |_| response(503, &[]));
    let policy = max_jitter().build().unwrap();
    let put = Request::put("http://api.test/items/1").body("{}".to_owned()).unwrap();
    ServiceBuilder::new().retry(policy).service(server).oneshot(put).await.unwrap();
    assert_eq!(log.arrivals(), [ms(0), ms(100), ms(300)], "PUT is idempotent");

    let log = Log::new();
    let server = scripted(&log, |_| response(503, &[]));
    let policy = max_jitter().methods([Method::POST]).build().unwrap();
    ServiceBuilder::new().retry(policy).service(server).oneshot(post()).await.unwrap();
    assert_eq!(log.arrivals(), [ms(0), ms(100), ms(300)], "POST when configured");
}

/// A body that can be cloned only while it is in memory.
#[derive(Debug)]
enum Body {
    Buffered(String),
    Stream,
}

#[tokio::test(start_paused = true)]
async fn a_body_that_cannot_be_cloned_is_sent_once() {
    let policy = || {
        RetryPolicy::builder_with_clone(|b: &Body| match b {
            Body::Buffered(s) => Some(Body::Buffered(s.clone())),
            Body::Stream => None,
        })
        .base(ms(100))
        .jitter(|ceiling| ceiling)
        .build()
        .unwrap()
    };
    let req = |body| Request::put("http://api.test/items/1").body(body).unwrap();

    let log = Log::new();
    let server = scripted::<Body>(&log, |_| response(429, &[]));
    let svc = ServiceBuilder::new().retry(policy()).service(server);
    let res = svc.oneshot(req(Body::Stream)).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(log.arrivals(), [ms(0)]);

    let log = Log::new();
    let server = scripted::<Body>(&log, |_| response(429, &[]));
    let svc = ServiceBuilder::new().retry(policy()).service(server);
    svc.oneshot(req(Body::Buffered("x".into()))).await.unwrap();
    assert_eq!(log.arrivals(), [ms(0), ms(100), ms(300)]);
}

#[tokio::test(start_paused = true)]
async fn successes_and_other_errors_are_not_retried() {
    for status in [200, 204, 400, 404, 500, 502] {
        let log = Log::new();
        let server = scripted(&log, move |_| response(status, &[("retry-after", "5")]));
        let policy = max_jitter().build().unwrap();
        let start = Instant::now();
        let res = ServiceBuilder::new().retry(policy).service(server).oneshot(get()).await.unwrap();
        assert_eq!(res.status().as_u16(), status);
        assert_eq!(log.arrivals(), [ms(0)], "status {status}");
        assert_eq!(start.elapsed(), Duration::ZERO);
    }
}

#[derive(Debug, PartialEq)]
struct TransportError(&'static str);

#[tokio::test(start_paused = true)]
async fn errors_are_retried_only_when_the_predicate_says_so() {
    let failing = |log: &Log| {
        let log = log.clone();
        service_fn(move |_req: Request<String>| {
            let n = log.arrive();
            async move {
                match n {
                    0 => Err(TransportError("connect")),
                    1 => Err(TransportError("reset")),
                    _ => Ok(response(200, &[])),
                }
            }
        })
    };

    let log = Log::new();
    let policy = max_jitter().build().unwrap();
    let err = ServiceBuilder::new().retry(policy).service(failing(&log)).oneshot(get()).await;
    assert_eq!(err.unwrap_err(), TransportError("connect"));
    assert_eq!(log.arrivals(), [ms(0)], "errors are not retried by default");

    let log = Log::new();
    let policy = max_jitter()
        .max_attempts(5)
        .retry_errors_if(|e: &TransportError| e.0 == "connect")
        .build()
        .unwrap();
    let err = ServiceBuilder::new().retry(policy).service(failing(&log)).oneshot(get()).await;
    assert_eq!(err.unwrap_err(), TransportError("reset"));
    assert_eq!(log.arrivals(), [ms(0), ms(100)]);
}

#[tokio::test(start_paused = true)]
async fn each_request_has_its_own_attempts_and_budget() {
    let log = Log::new();
    // Odd calls fail, even calls succeed: every request needs exactly one retry.
    let server = scripted(&log, |n| response(if n % 2 == 0 { 503 } else { 200 }, &[]));
    let policy = max_jitter().max_attempts(2).budget(ms(150)).build().unwrap();
    let svc = ServiceBuilder::new().retry(policy).service(server);
    for _ in 0..3 {
        let res = svc.clone().oneshot(get()).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
    let expected = [ms(0), ms(100), ms(100), ms(200), ms(200), ms(300)];
    assert_eq!(log.arrivals(), expected);
}

// ---------------------------------------------------------------------------------------------
// Pacing against a tollgate server
// ---------------------------------------------------------------------------------------------

/// What the tests send requests to: a service of `Request<String>` answering `Response<B>`
/// that never fails, its futures `Send`, shared between tasks.
trait Http<B>:
    Service<Request<String>, Response = Response<B>, Error = Infallible, Future: Send>
    + Clone
    + Send
    + 'static
{
}

impl<S, B> Http<B> for S where
    S: Service<Request<String>, Response = Response<B>, Error = Infallible, Future: Send>
        + Clone
        + Send
        + 'static
{
}

/// tokio's clock counted from the Unix epoch at the moment it is made, so that windows start
/// with the test (tollgate's `TokioClock` starts at the system time: windows aligned to it
/// would move from run to run).
struct TestClock(Instant);

impl tollgate::clock::Clock for TestClock {
    fn now(&self) -> u64 {
        u64::try_from(self.0.elapsed().as_nanos()).unwrap()
    }
}

/// tollgate's layer enforcing `policy` on every request together, on the paused clock.
fn tollgate_layer_of(policy: Policy) -> RateLimitLayer<GlobalKey, MemoryStore> {
    let store = MemoryStore::builder().clock(TestClock(Instant::now())).build().unwrap();
    RateLimitLayer::builder(policy).key(GlobalKey).store(store).build().unwrap()
}

/// A tollgate server enforcing `quota` on the paused clock, and the log of when its handler
/// served each request.
fn tollgate_server_with(quota: Quota) -> (impl Http<tollgate::layer::ResponseBody<String>>, Log) {
    tollgate_server_of(Policy::single("api", quota).unwrap())
}

/// A tollgate server enforcing `policy` on the paused clock, and the log of when its handler
/// served each request.
fn tollgate_server_of(policy: Policy) -> (impl Http<tollgate::layer::ResponseBody<String>>, Log) {
    let log = Log::new();
    let served = log.clone();
    let handler = service_fn(move |_req: Request<tollgate::RequestBody<String>>| {
        served.arrive();
        async { Ok::<_, Infallible>(Response::new("ok".to_owned())) }
    });
    (tollgate_layer_of(policy).layer(handler), log)
}

/// `inner` behind a network that takes `one_way` each way.
fn over_a_network<B: Send + 'static>(inner: impl Http<B>, one_way: Duration) -> impl Http<B> {
    service_fn(move |req: Request<String>| {
        let inner = inner.clone();
        async move {
            tokio::time::sleep(one_way).await;
            let res = inner.oneshot(req).await;
            tokio::time::sleep(one_way).await;
            res
        }
    })
}

/// Sends `n` requests one after another; returns how many were refused with 429.
async fn send_sequentially<S, B>(svc: S, n: usize) -> usize
where
    S: Service<Request<String>, Response = Response<B>, Error = Infallible> + Clone,
{
    let mut refused = 0;
    for _ in 0..n {
        let res = svc.clone().oneshot(get()).await.unwrap();
        refused += usize::from(res.status() == StatusCode::TOO_MANY_REQUESTS);
    }
    refused
}

/// Sends `tasks x per_task` requests from `tasks` concurrent tasks; returns the 429 count.
async fn send_concurrently<B: Send + 'static>(
    svc: impl Http<B>,
    tasks: usize,
    per_task: usize,
) -> usize {
    let handles: Vec<_> =
        (0..tasks).map(|_| tokio::spawn(send_sequentially(svc.clone(), per_task))).collect();
    let mut refused = 0;
    for handle in handles {
        refused += handle.await.unwrap();
    }
    refused
}

#[tokio::test(start_paused = true)]
async fn without_pacing_the_same_client_is_refused() {
    // The control for the two tests below: 100 requests at once, 10 admitted, 90 refused.
    let (server, served) = tollgate_server_with(Quota::per_second(10));
    let start = Instant::now();
    assert_eq!(send_sequentially(server, 100).await, 90);
    assert_eq!(served.arrivals().len(), 10);
    assert_eq!(start.elapsed(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn pacing_sends_100_sequential_requests_to_a_10_per_second_server_without_a_429() {
    let (server, served) = tollgate_server_with(Quota::per_second(10));
    let client = PacingLayer::new().layer(server);
    let start = Instant::now();
    assert_eq!(send_sequentially(client, 100).await, 0);
    assert_eq!(served.arrivals().len(), 100);
    // The server can serve no more than 10 + 10 per second: 100 by 9 s at the earliest. Ten at
    // 0 s, ten at the reset at 1 s, then one per learned interval (9/s, rising towards 10/s).
    let elapsed = start.elapsed();
    assert_eq!(elapsed, ms(9040));
    assert!((secs(9)..=secs(11)).contains(&elapsed));
}

#[tokio::test(start_paused = true)]
async fn pacing_sends_100_concurrent_requests_to_a_10_per_second_server_without_a_429() {
    let (server, served) = tollgate_server_with(Quota::per_second(10));
    let client = PacingLayer::new().layer(server);
    let start = Instant::now();
    assert_eq!(send_concurrently(client, 10, 10).await, 0);
    assert_eq!(served.arrivals().len(), 100);
    let elapsed = start.elapsed();
    assert_eq!(elapsed, ms(9040));
    assert!((secs(9)..=secs(11)).contains(&elapsed));
}

/// `workers` tasks each sending one request after another until `duration` has passed since
/// the start; returns when each 429 arrived, from the start.
async fn work_for<B: Send + 'static>(
    svc: impl Http<B>,
    workers: usize,
    duration: Duration,
) -> Vec<Duration> {
    let start = Instant::now();
    let refusals = Arc::new(Mutex::new(Vec::new()));
    let handles: Vec<_> = (0..workers)
        .map(|_| {
            let (svc, refusals) = (svc.clone(), Arc::clone(&refusals));
            tokio::spawn(async move {
                while start.elapsed() < duration {
                    let res = svc.clone().oneshot(get()).await.unwrap();
                    if res.status() == StatusCode::TOO_MANY_REQUESTS {
                        refusals.lock().unwrap().push(start.elapsed());
                    }
                }
            })
        })
        .collect();
    for handle in handles {
        handle.await.unwrap();
    }
    std::mem::take(&mut *refusals.lock().unwrap())
}

/// Eight paced workers against a tollgate server enforcing `policy`, over a network taking
/// `one_way` each way, for 21 s: when each 429 arrived, and how many requests the server
/// served from 1 s to 21 s.
async fn paced_for_21_s(policy: Policy, one_way: u64) -> (Vec<Duration>, usize) {
    let (server, log) = tollgate_server_of(policy);
    let client = PacingLayer::new().layer(over_a_network(server, ms(one_way)));
    let refusals = work_for(client, 8, secs(21)).await;
    (refusals, served_between(&log, secs(1), secs(21)))
}

/// How many of `log`'s arrivals fall in `[from, to)`.
fn served_between(log: &Log, from: Duration, to: Duration) -> usize {
    log.arrivals().iter().filter(|at| (from..to).contains(*at)).count()
}

#[tokio::test(start_paused = true)]
async fn eight_workers_reach_the_rate_a_tollgate_bucket_allows() {
    use tollgate::Algorithm::{Gcra, LeakyBucket, TokenBucket};
    // (rate per second, network one way in ms, requests the server served from 1 s to 21 s).
    // The most it can serve then is the 10 units it holds at 1 s plus 20 s of refill.
    let cases =
        [(10, 0, 209), (20, 0, 409), (50, 0, 1008), (10, 20, 208), (20, 20, 402), (50, 20, 1000)];
    for algorithm in [Gcra, TokenBucket, LeakyBucket] {
        for (rate, one_way, expected) in cases {
            let policy = Policy::builder("api")
                .algorithm(algorithm)
                .tier("api", Quota::per_second(rate).with_burst(10))
                .build()
                .unwrap();
            let (refusals, served) = paced_for_21_s(policy, one_way).await;
            let case = format!("{algorithm:?}, {rate}/s over {one_way} ms each way");
            assert_eq!(refusals, [], "{case}: never refused, not even in the first second");
            assert_eq!(served, expected, "{case}");
            let share = served as f64 / (rate * 20) as f64;
            let floor = if rate == 10 { 0.95 } else { 0.90 };
            assert!(share >= floor, "{case}: {share:.3} of the rate");
        }
    }
}

#[tokio::test(start_paused = true)]
async fn windows_that_refill_at_once_are_refused_once_then_paced_by_their_resets() {
    // A window's units come back all at once, which reads like a bucket that refilled: the
    // rate learned from it lets one request through too early. After that refusal the layer
    // no longer extrapolates and waits for the resets, as it does before it learns a rate.
    use tollgate::Algorithm::{FixedWindow, SlidingCounter, SlidingLog};
    let cases = [
        (FixedWindow, 0, 200, vec![ms(1112)]),
        (FixedWindow, 20, 188, vec![ms(1409)]),
        (SlidingLog, 0, 200, vec![ms(1112)]),
        (SlidingLog, 20, 180, vec![ms(1409)]),
        (SlidingCounter, 0, 100, vec![ms(2223)]),
        (SlidingCounter, 20, 90, vec![ms(2520)]),
    ];
    for (algorithm, one_way, expected, refused) in cases {
        let policy = Policy::builder("api")
            .algorithm(algorithm)
            .tier("api", Quota::per_second(10))
            .build()
            .unwrap();
        let (refusals, served) = paced_for_21_s(policy, one_way).await;
        let case = format!("{algorithm:?} over {one_way} ms each way");
        assert_eq!(refusals, refused, "{case}");
        assert_eq!(served, expected, "{case}");
    }
}

#[tokio::test(start_paused = true)]
async fn cold_concurrent_calls_wait_for_the_first_answer() {
    // Without the wait, all the calls went at once: 40 and 190 of them refused.
    for (calls, elapsed) in [(50, ms(4230)), (200, ms(19_223))] {
        let (server, log) = tollgate_server_with(Quota::per_second(10));
        let client = PacingLayer::new().layer(over_a_network(server, ms(20)));
        let start = Instant::now();
        let handles: Vec<_> =
            (0..calls).map(|_| tokio::spawn(client.clone().oneshot(get()))).collect();
        let mut refused = 0;
        for handle in handles {
            let res = handle.await.unwrap().unwrap();
            refused += usize::from(res.status() == StatusCode::TOO_MANY_REQUESTS);
        }
        assert_eq!(refused, 0, "{calls} calls");
        assert_eq!(log.arrivals().len(), calls);
        // At least (calls - 10) / 10 s of refill, plus one round trip.
        assert_eq!(start.elapsed(), elapsed, "{calls} calls");
    }
}

// ---------------------------------------------------------------------------------------------
// Pacing and retries against a server that only sends `Retry-After`
// ---------------------------------------------------------------------------------------------

/// A server admitting 10 requests per one-second window (aligned to the start of the test)
/// and answering the others 429 with `Retry-After` (the seconds to the next window, rounded
/// up), without rate-limit headers. Returns it, the count of 200s and the count of 429s.
fn retry_after_server() -> (impl Http<String>, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let start = Instant::now();
    let window = Arc::new(Mutex::new((0u64, 0u64)));
    let (ok, refused) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (ok2, refused2) = (Arc::clone(&ok), Arc::clone(&refused));
    let svc = service_fn(move |_req: Request<String>| {
        let elapsed = start.elapsed();
        let index = elapsed.as_secs();
        let mut w = window.lock().unwrap();
        if w.0 != index {
            *w = (index, 0);
        }
        let res = if w.1 < 10 {
            w.1 += 1;
            ok2.fetch_add(1, Ordering::SeqCst);
            response(200, &[])
        } else {
            refused2.fetch_add(1, Ordering::SeqCst);
            let left = secs(index + 1) - elapsed;
            let wait = left.as_secs() + u64::from(left.subsec_nanos() > 0);
            response(429, &[("retry-after", &wait.to_string())])
        };
        async move { Ok::<_, Infallible>(res) }
    });
    (svc, ok, refused)
}

/// [`retry_after_server`] behind the retry policy below and the pacing layer, with its counts.
fn paced_retrying_client() -> (impl Http<String>, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let (server, ok, refused) = retry_after_server();
    let client =
        ServiceBuilder::new().retry(retrying_policy()).layer(PacingLayer::new()).service(server);
    (client, ok, refused)
}

fn retrying_policy() -> RetryPolicy<String> {
    RetryPolicy::builder()
        .max_attempts(4)
        .base(ms(100))
        .jitter(FullJitter::with_seed(7))
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn pacing_with_retries_succeeds_sequentially_against_retry_after_only() {
    let (client, ok, refused) = paced_retrying_client();
    let start = Instant::now();
    assert_eq!(send_sequentially(client, 100).await, 0, "every request succeeds");
    assert_eq!(ok.load(Ordering::SeqCst), 100);
    // One 429 per full window (the 11th request of windows 0..=8), each followed by a wait of
    // exactly its Retry-After.
    assert_eq!(refused.load(Ordering::SeqCst), 9);
    assert_eq!(start.elapsed(), secs(9));
}

#[tokio::test(start_paused = true)]
async fn pacing_with_retries_succeeds_concurrently_against_retry_after_only() {
    let (client, ok, refused) = paced_retrying_client();
    let start = Instant::now();
    assert_eq!(send_concurrently(client, 10, 10).await, 0, "every request succeeds");
    assert_eq!(ok.load(Ordering::SeqCst), 100);
    // The first 429 of a window holds every other task until the next one: at most one 429
    // per window.
    let refusals = refused.load(Ordering::SeqCst);
    assert!(refusals <= 10, "{refusals} refusals");
    assert_eq!(refusals, 9);
    assert_eq!(start.elapsed(), secs(9));
}

#[tokio::test(start_paused = true)]
async fn retries_without_pacing_are_refused_by_every_task() {
    // The control for the test above: without the shared pacing state each task learns of the
    // window only from its own 429, so many more requests are refused.
    let (server, ok, refused) = retry_after_server();
    let client = ServiceBuilder::new().retry(retrying_policy()).service(server);
    let failed = send_concurrently(client, 10, 10).await;
    // Deterministic on the paused single-threaded runtime: 53 refusals, and 8 requests whose
    // four attempts were all refused, against 9 and 0 with pacing.
    assert_eq!(refused.load(Ordering::SeqCst), 53);
    assert_eq!(failed, 8);
    assert_eq!(ok.load(Ordering::SeqCst), 92);
}

// ---------------------------------------------------------------------------------------------
// Pacing in detail
// ---------------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn partitions_are_paced_apart_and_unknown_ones_go_at_once() {
    let log = Log::new();
    let server = service_fn({
        let log = log.clone();
        move |req: Request<String>| {
            log.arrive();
            let exhausted = req.uri().host() == Some("a.test");
            async move {
                let res = match exhausted {
                    true => response(
                        200,
                        &[("ratelimit-policy", r#""q";q=1;w=5"#), ("ratelimit", r#""q";r=0;t=5"#)],
                    ),
                    false => response(200, &[]),
                };
                Ok::<_, Infallible>(res)
            }
        }
    });
    let layer = PacingLayer::new();
    let client = layer.layer(server);
    let to = |host: &str| Request::get(format!("http://{host}/")).body(String::new()).unwrap();
    client.clone().oneshot(to("a.test")).await.unwrap(); // 0 s: a is now exhausted until 5 s
    client.clone().oneshot(to("b.test")).await.unwrap(); // 0 s: b is another server
    assert_eq!(layer.delay(&RequestHead::from(&to("a.test"))), Some(secs(5)));
    assert_eq!(layer.delay(&RequestHead::from(&to("b.test"))), Some(Duration::ZERO));
    client.clone().oneshot(to("a.test")).await.unwrap(); // 5 s
    client.clone().oneshot(to("b.test")).await.unwrap(); // 5 s, not held further
    assert_eq!(log.arrivals(), [ms(0), ms(0), secs(5), secs(5)]);
}

#[tokio::test(start_paused = true)]
async fn concurrent_requests_reserve_before_sending_and_do_not_over_send() {
    // A server that answers after 1 s and admits 3 requests per 10-second window, saying so.
    let log = Log::new();
    let window = Arc::new(Mutex::new((0u64, 0u64)));
    let refused = Arc::new(AtomicUsize::new(0));
    let server = service_fn({
        let (log, refused) = (log.clone(), Arc::clone(&refused));
        move |_req: Request<String>| {
            log.arrive();
            let elapsed = log.start.elapsed();
            let index = elapsed.as_secs() / 10;
            let mut w = window.lock().unwrap();
            if w.0 != index {
                *w = (index, 0);
            }
            let admitted = w.1 < 3;
            w.1 += u64::from(admitted);
            let left = 3 - w.1;
            let t = (secs((index + 1) * 10) - elapsed).as_secs();
            refused.fetch_add(usize::from(!admitted), Ordering::SeqCst);
            let status = if admitted { 200 } else { 429 };
            let res = response(
                status,
                &[
                    ("ratelimit-policy", r#""w";q=3;w=10"#),
                    ("ratelimit", &format!(r#""w";r={left};t={t}"#)),
                ],
            );
            async move {
                tokio::time::sleep(secs(1)).await;
                Ok::<_, Infallible>(res)
            }
        }
    });
    let client = PacingLayer::new().layer(server);
    client.clone().oneshot(get()).await.unwrap(); // sent at 0 s, answered at 1 s: r=2, t=10
    // Five at once at 1 s: one goes now, the next when its answer came (with a request in
    // flight the last unit waits), three when the quota is full again, the third of them once
    // the other two were answered.
    let handles: Vec<_> = (0..5).map(|_| tokio::spawn(client.clone().oneshot(get()))).collect();
    for h in handles {
        assert_eq!(h.await.unwrap().unwrap().status(), StatusCode::OK);
    }
    assert_eq!(refused.load(Ordering::SeqCst), 0);
    // The first answer said "full again in 10 s" at 1 s.
    assert_eq!(log.arrivals(), [secs(0), secs(1), secs(2), secs(11), secs(11), secs(12)]);
}

#[tokio::test(start_paused = true)]
async fn legacy_headers_pace_too() {
    let log = Log::new();
    let server = scripted(&log, |n| {
        // 2 per 4 s, counted from 0 s: "remaining" after the n-th request.
        let remaining = if n % 2 == 0 { "1" } else { "0" };
        response(
            200,
            &[
                ("x-ratelimit-limit", "2"),
                ("x-ratelimit-remaining", remaining),
                ("x-ratelimit-reset", "4"),
            ],
        )
    });
    let client = PacingLayer::new().layer(server);
    assert_eq!(send_sequentially(client, 5).await, 0);
    assert_eq!(log.arrivals(), [secs(0), secs(0), secs(4), secs(4), secs(8)]);
}

#[tokio::test(start_paused = true)]
async fn a_429_retry_after_holds_the_partition() {
    let log = Log::new();
    let server = scripted(&log, |n| match n {
        0 => response(429, &[("retry-after", "3")]),
        _ => response(200, &[("retry-after", "60")]), // ignored: not a 429
    });
    let client = PacingLayer::new().layer(server);
    let res = client.clone().oneshot(get()).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    client.clone().oneshot(get()).await.unwrap();
    client.clone().oneshot(get()).await.unwrap();
    assert_eq!(log.arrivals(), [secs(0), secs(3), secs(3)]);
}

#[tokio::test(start_paused = true)]
async fn a_waiting_request_dropped_takes_nothing() {
    let log = Log::new();
    let server = scripted(&log, |_| {
        response(200, &[("ratelimit-policy", r#""q";q=1;w=2"#), ("ratelimit", r#""q";r=0;t=2"#)])
    });
    let client = PacingLayer::new().layer(server);
    client.clone().oneshot(get()).await.unwrap();
    // Waits for 2 s; dropped after 1 s.
    let timed_out = tokio::time::timeout(secs(1), client.clone().oneshot(get())).await;
    assert!(timed_out.is_err());
    client.clone().oneshot(get()).await.unwrap();
    assert_eq!(log.arrivals(), [secs(0), secs(2)]);
}
