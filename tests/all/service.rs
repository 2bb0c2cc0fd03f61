//! The layer as a plain Tower service on a paused tokio clock: exact shaping delays, cancelled
//! waiters, the waiter bound, tarpit, settlement, store failures, error pass-through.
use crate::support;
use crate::support::{OkService, ok_service};

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response, StatusCode};
use tokio::time::Instant;
use tollgate::RequestBody;
use tollgate::clock::TokioClock;
use tollgate::key::{GlobalKey, KeyExtractor};
use tollgate::layer::RateLimit;
use tollgate::store::{Check, MemoryStore, Store, Verdict};
use tollgate::{
    ConfigError, OnStoreError, Policy, Quota, RateLimitLayer, RateLimitLayerBuilder, StoreError,
};
use tower::{Layer, Service, ServiceExt, service_fn};

/// A store on tokio's clock, which these paused-clock tests drive.
fn paused_store() -> MemoryStore {
    MemoryStore::builder().clock(TokioClock::new()).build().unwrap()
}

/// A layer of `policy` on a [`paused_store`], its builder finished by `set`.
fn on_paused_store<K: KeyExtractor>(
    policy: Policy,
    set: impl FnOnce(RateLimitLayerBuilder) -> RateLimitLayerBuilder<K>,
) -> RateLimitLayer<K> {
    set(RateLimitLayer::builder(policy).store(paused_store())).build().unwrap()
}

/// [`OkService`] behind [`on_paused_store`].
fn paused_ok<K: KeyExtractor>(
    policy: Policy,
    set: impl FnOnce(RateLimitLayerBuilder) -> RateLimitLayerBuilder<K>,
) -> RateLimit<OkService, K, MemoryStore> {
    on_paused_store(policy, set).layer(OkService)
}

/// [`paused_ok`] on one key for every request, with room for `waiters` requests to wait.
fn in_a_waiting_room(
    policy: Policy,
    waiters: usize,
    set: impl FnOnce(RateLimitLayerBuilder<GlobalKey>) -> RateLimitLayerBuilder<GlobalKey>,
) -> RateLimit<OkService, GlobalKey, MemoryStore> {
    paused_ok(policy, move |b| set(b.key(GlobalKey)).max_waiters(waiters))
}

/// 10 a second, burst 1: a slot every 100 ms.
fn ten_a_second() -> Policy {
    Policy::single("s", Quota::per_second(10).with_burst(1)).unwrap()
}

/// One an hour.
fn one_an_hour() -> Policy {
    Policy::single("p", Quota::per_hour(1)).unwrap()
}

/// Sends a request through `svc`: the status it was answered, and after how long (on the
/// paused clock).
async fn timed<S, B>(svc: &S) -> (StatusCode, Duration)
where
    S: Service<Request<Body>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
{
    let start = Instant::now();
    let res = svc.clone().oneshot(request()).await.unwrap();
    (res.status(), start.elapsed())
}

/// `n` requests sent through `svc` at once, each a task of the set: the status each was
/// answered, and when.
fn flood<S, B>(svc: &S, n: usize) -> tokio::task::JoinSet<(StatusCode, Instant)>
where
    S: Service<Request<Body>, Response = Response<B>> + Clone + Send + 'static,
    S::Error: std::fmt::Debug,
    S::Future: Send,
{
    let mut flood = tokio::task::JoinSet::new();
    for _ in 0..n {
        let svc = svc.clone();
        flood.spawn(async move {
            let status = svc.oneshot(request()).await.unwrap().status();
            (status, Instant::now())
        });
    }
    flood
}

fn request() -> Request<Body> {
    let mut req = Request::new(Body::empty());
    req.extensions_mut().insert("192.0.2.1:1234".parse::<SocketAddr>().unwrap());
    req
}

#[tokio::test(start_paused = true)]
async fn shaping_delays_are_exact_on_a_paused_clock() {
    let svc = paused_ok(ten_a_second(), |b| b.shape(Duration::from_millis(250)));
    let start = Instant::now();
    let mut out = support::spawn_all(5, |_| {
        let svc = svc.clone();
        async move {
            let res = svc.oneshot(request()).await.unwrap();
            (res.status(), start.elapsed())
        }
    })
    .await;
    out.sort_by_key(|(s, d)| (s.as_u16(), *d));
    assert_eq!(
        out,
        [
            (StatusCode::OK, Duration::ZERO),
            (StatusCode::OK, Duration::from_millis(100)),
            (StatusCode::OK, Duration::from_millis(200)),
            (StatusCode::TOO_MANY_REQUESTS, Duration::ZERO),
            (StatusCode::TOO_MANY_REQUESTS, Duration::ZERO),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn a_waiter_dropped_while_waiting_gives_its_slot_back() {
    let svc = paused_ok(ten_a_second(), |b| b.shape(Duration::from_secs(1)));
    assert_eq!(svc.clone().oneshot(request()).await.unwrap().status(), StatusCode::OK);
    // Reserves the 100 ms slot, then gives up after 50 ms.
    let waiting =
        tokio::time::timeout(Duration::from_millis(50), svc.clone().oneshot(request())).await;
    assert!(waiting.is_err());
    tokio::task::yield_now().await;
    // The next request gets the returned 100 ms slot: it waits 50 ms more, not 150.
    assert_eq!(timed(&svc).await, (StatusCode::OK, Duration::from_millis(50)));
}

#[tokio::test(start_paused = true)]
async fn the_number_of_waiters_is_bounded() {
    let svc = in_a_waiting_room(ten_a_second(), 3, |b| b.shape(Duration::from_secs(10)));
    let statuses = support::spawn_all(10, |_| {
        let svc = svc.clone();
        async move { svc.oneshot(request()).await.unwrap().status() }
    })
    .await;
    let ok = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    let limited = statuses.len() - ok;
    // One admitted without waiting (the permit is given back at once), three waited, and the
    // other six were policed: no waiting room left, no slot free now.
    assert_eq!((ok, limited), (4, 6));
}

#[tokio::test(start_paused = true)]
async fn tarpit_delays_rejections() {
    let svc = paused_ok(one_an_hour(), |b| b.tarpit(Duration::from_secs(2)));
    let start = Instant::now();
    assert_eq!(svc.clone().oneshot(request()).await.unwrap().status(), StatusCode::OK);
    assert_eq!(start.elapsed(), Duration::ZERO);
    let res = svc.clone().oneshot(request()).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(start.elapsed(), Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn cost_settled_from_the_response() {
    let policy = Policy::single("tokens", Quota::per_hour(100)).unwrap();
    let layer = on_paused_store(policy, |b| {
        b.settle_cost(|head| head.headers.get("x-tokens")?.to_str().ok()?.parse().ok())
    });
    let svc = layer.layer(service_fn(|_req: Request<RequestBody<Body>>| async {
        Ok::<_, Infallible>(
            Response::builder().header("x-tokens", "60").body(Body::empty()).unwrap(),
        )
    }));
    let first = svc.clone().oneshot(request()).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    // Charged 1 at admission, settled to 60 after; the second, settled to 60 too, leaves
    // nothing (the TAT 120 emission intervals of 36 s ahead): its headers say so, after the
    // settlement.
    let second = svc.clone().oneshot(request()).await.unwrap();
    assert_eq!(second.headers()["ratelimit"], "\"tokens\";r=0;t=4320");
    let third = svc.clone().oneshot(request()).await.unwrap();
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
}

/// A store that always fails, counting its calls.
#[derive(Clone, Default)]
struct Broken(Arc<AtomicUsize>);

impl Store for Broken {
    type Bound = ();
    type Ticket = ();

    fn bind(&self, _: &Policy) -> Result<(), ConfigError> {
        Ok(())
    }

    fn check(
        &self,
        (): &(),
        _: Check<'_>,
    ) -> impl Future<Output = Result<Verdict<()>, StoreError>> + Send {
        self.0.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Err(StoreError::backend("down")))
    }

    fn settle(
        &self,
        (): &(),
        (): (),
        _: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        std::future::ready(Ok(()))
    }
}

#[tokio::test]
async fn store_failure_fails_open_or_closed_as_configured() {
    let policy = Policy::single("p", Quota::per_second(1)).unwrap();
    let store = Broken::default();
    let open = RateLimitLayer::builder(policy.clone())
        .store(store.clone())
        .on_store_error(OnStoreError::FailOpen)
        .build()
        .unwrap();
    let res = open.layer(ok_service()).oneshot(request()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(res.headers().get("ratelimit").is_none());

    // Failing closed is the default: a limiter that cannot decide does not stop limiting.
    let closed = RateLimitLayer::builder(policy).store(store.clone()).build().unwrap();
    let res = closed.layer(ok_service()).oneshot(request()).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");
    assert_eq!(store.0.load(Ordering::SeqCst), 2);
}

#[derive(Debug, PartialEq)]
struct MyError(&'static str);

#[tokio::test]
async fn the_inner_error_type_passes_through_and_poll_ready_takes_nothing() {
    let policy = one_an_hour();
    let store = MemoryStore::new();
    let layer = RateLimitLayer::builder(policy).store(store.clone()).build().unwrap();
    let mut svc = layer.layer(service_fn(|_req: Request<RequestBody<Body>>| async {
        Err::<Response<Body>, _>(MyError("inner failed"))
    }));
    for _ in 0..5 {
        std::future::poll_fn(|cx: &mut Context<'_>| match svc.poll_ready(cx) {
            Poll::Ready(r) => Poll::Ready(r),
            Poll::Pending => Poll::Pending,
        })
        .await
        .unwrap();
    }
    assert_eq!(store.len(), 0, "poll_ready decided nothing");
    let err = svc.ready().await.unwrap().call(request()).await.unwrap_err();
    assert_eq!(err, MyError("inner failed"));
    // The rate limit itself is a response, not an error.
    let res = svc.ready().await.unwrap().call(request()).await;
    assert_eq!(res.unwrap().status(), StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn clones_share_state() {
    let layer = on_paused_store(Policy::single("p", Quota::per_hour(2)).unwrap(), |b| b);
    let a = layer.layer(ok_service());
    let b = layer.clone().layer(ok_service());
    assert_eq!(a.clone().oneshot(request()).await.unwrap().status(), StatusCode::OK);
    assert_eq!(b.clone().oneshot(request()).await.unwrap().status(), StatusCode::OK);
    assert_eq!(a.clone().oneshot(request()).await.unwrap().status(), StatusCode::TOO_MANY_REQUESTS);
}

/// A slowloris-style flood (SECURITY.md, "shaping-queue exhaustion"): 20,000 requests that would
/// all wait arrive at once. Only `max_waiters` of them are held; every other one is answered at
/// once, so the flood cannot pile up tasks or memory. Cancelling the held ones gives every
/// reserved slot back.
#[tokio::test(start_paused = true)]
async fn a_flood_of_would_be_waiters_is_held_to_the_bound_and_cancelling_returns_slots() {
    const WAITERS: usize = 64;
    let svc = in_a_waiting_room(ten_a_second(), WAITERS, |b| b.shape(Duration::from_secs(60)));
    let start = Instant::now();
    let mut flood = flood(&svc, 20_000);
    // Let every request run until it either finishes or sleeps for its slot (no time passes).
    let mut answered = Vec::new();
    while flood.len() > WAITERS {
        answered.push(flood.join_next().await.unwrap().unwrap().0);
    }
    tokio::task::yield_now().await;
    assert_eq!(flood.len(), WAITERS, "only the waiting room is held");
    assert_eq!(answered.iter().filter(|s| **s == StatusCode::OK).count(), 1, "one free slot");
    // Had more than the bound waited, reaching this point would have taken (paused) time.
    assert_eq!(start.elapsed(), Duration::ZERO, "the rest answered without waiting");

    // The held ones have reserved the slots at 100 ms, 200 ms, ... 6.4 s. Cancel them all.
    flood.abort_all();
    while flood.join_next().await.is_some() {}
    tokio::task::yield_now().await;
    // Every slot came back: the next request waits 100 ms (the first slot after the one used
    // at 0), not 6.5 s.
    assert_eq!(timed(&svc).await, (StatusCode::OK, Duration::from_millis(100)));
}

#[tokio::test(start_paused = true)]
async fn the_tarpit_holds_at_most_the_waiting_room() {
    let svc = in_a_waiting_room(one_an_hour(), 8, |b| b.tarpit(Duration::from_secs(2)));
    assert_eq!(timed(&svc).await, (StatusCode::OK, Duration::ZERO));
    let start = Instant::now();
    let mut flood = flood(&svc, 5_000);
    let mut at_once = 0;
    let mut delayed = 0;
    while let Some(done) = flood.join_next().await {
        let (status, at) = done.unwrap();
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        match at - start {
            d if d == Duration::ZERO => at_once += 1,
            d if d == Duration::from_secs(2) => delayed += 1,
            d => panic!("answered after {d:?}"),
        }
    }
    assert_eq!((delayed, at_once), (8, 4_992));
}

#[tokio::test]
#[should_panic(expected = "ResponseFuture polled after completion")]
async fn a_response_future_polled_after_completion_panics() {
    let layer = RateLimitLayer::builder(one_an_hour()).key(GlobalKey).build().unwrap();
    let mut svc = layer.layer(ok_service());
    for expected in [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS] {
        let mut future = std::pin::pin!(svc.ready().await.unwrap().call(request()));
        let res = std::future::poll_fn(|cx| future.as_mut().poll(cx)).await.unwrap();
        assert_eq!(res.status(), expected);
        if expected == StatusCode::TOO_MANY_REQUESTS {
            // The contract says never; a future that answered a made-up 200 would hide the bug.
            let _ = std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await;
        }
    }
}

/// A request of `version` with `headers`, from a client address when `keyed`.
fn with(version: http::Version, headers: &[(&'static str, &str)], keyed: bool) -> Request<Body> {
    let mut req = if keyed { request() } else { Request::new(Body::empty()) };
    *req.version_mut() = version;
    for (name, value) in headers {
        req.headers_mut().insert(*name, value.parse().unwrap());
    }
    req
}

/// A refusal (429, or the 400 of a request without a key) of an HTTP/1.x request whose body
/// the server will not read off (declared above 8 KiB, or chunked) says `Connection: close`. Not
/// for a request without a body or with a small one (hyper reads it off and keeps the
/// connection), nor for HTTP/2, whose streams end on their own.
#[tokio::test]
async fn refusals_of_http1_requests_with_a_body_close_the_connection() {
    let svc = paused_ok(one_an_hour(), |b| b);
    let first = svc.clone().oneshot(with(http::Version::HTTP_11, &[], true)).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    use http::Version as V;
    const LIMITED: StatusCode = StatusCode::TOO_MANY_REQUESTS;
    // The version, the headers, whether the request has a key, the status, `Connection`.
    type Case =
        (V, &'static [(&'static str, &'static str)], bool, StatusCode, Option<&'static str>);
    let cases: [Case; 12] = [
        (V::HTTP_11, &[("content-length", "8193")], true, LIMITED, Some("close")),
        (V::HTTP_11, &[("content-length", "1048576")], true, LIMITED, Some("close")),
        (V::HTTP_11, &[("transfer-encoding", "chunked")], true, LIMITED, Some("close")),
        (V::HTTP_10, &[("content-length", "9000")], true, LIMITED, Some("close")),
        (V::HTTP_11, &[("content-length", "8192")], true, LIMITED, None),
        (V::HTTP_11, &[("content-length", "5")], true, LIMITED, None),
        (V::HTTP_11, &[("content-length", "0")], true, LIMITED, None),
        (V::HTTP_11, &[], true, LIMITED, None),
        (V::HTTP_2, &[("content-length", "9000")], true, LIMITED, None),
        (V::HTTP_11, &[("content-length", "9000")], false, StatusCode::BAD_REQUEST, Some("close")),
        (V::HTTP_11, &[("content-length", "5")], false, StatusCode::BAD_REQUEST, None),
        (V::HTTP_11, &[], false, StatusCode::BAD_REQUEST, None),
    ];
    for (i, (version, headers, keyed, status, connection)) in cases.into_iter().enumerate() {
        let res = svc.clone().oneshot(with(version, headers, keyed)).await.unwrap();
        assert_eq!(res.status(), status, "case {i}");
        let got = res.headers().get(http::header::CONNECTION).map(|v| v.to_str().unwrap());
        assert_eq!(got, connection, "case {i}");
    }
}

/// The other refusals of an HTTP/1.x request with a body the server will not read off (9,000
/// bytes declared; the slow path's 429 after a tarpit,
/// the 503 of a store failing closed, the refusal of a request no policy is selected for) say
/// `Connection: close` too; over HTTP/2 none of them does.
#[tokio::test(start_paused = true)]
async fn slow_store_and_scope_refusals_of_uploads_close_the_connection() {
    use http::Version as V;
    let upload = |version| with(version, &[("content-length", "9000"), ("x-plan", "gold")], true);
    let connection = |res: &Response<_>| {
        res.headers().get(http::header::CONNECTION).map(|v| v.as_bytes().to_vec())
    };
    let policy = one_an_hour();
    let tarpit = paused_ok(policy.clone(), |b| b.tarpit(Duration::from_secs(2)));
    assert_eq!(tarpit.clone().oneshot(request()).await.unwrap().status(), StatusCode::OK);
    let closed = RateLimitLayer::builder(policy.clone())
        .store(Broken::default())
        .build()
        .unwrap()
        .layer(ok_service());
    let scoped = on_paused_store(policy, |b| {
        b.select(|head| head.headers.get("x-plan").and_then(|v| v.to_str().ok()))
            .unselected(tollgate::layer::Unselected::Reject(StatusCode::FORBIDDEN))
    })
    .layer(ok_service());
    for (version, close) in [(V::HTTP_11, Some(b"close".to_vec())), (V::HTTP_2, None)] {
        let res = tarpit.clone().oneshot(upload(version)).await.unwrap();
        assert_eq!(
            (res.status(), connection(&res)),
            (StatusCode::TOO_MANY_REQUESTS, close.clone())
        );
        let res = closed.clone().oneshot(upload(version)).await.unwrap();
        assert_eq!(
            (res.status(), connection(&res)),
            (StatusCode::SERVICE_UNAVAILABLE, close.clone())
        );
        let res = scoped.clone().oneshot(upload(version)).await.unwrap();
        assert_eq!((res.status(), connection(&res)), (StatusCode::FORBIDDEN, close));
    }
}

/// A memory store that never answers at once (as a remote store): every request takes the
/// path that waits after `call` tried to decide it.
#[derive(Clone, Default)]
struct Remote(tollgate::store::MemoryStore);

impl Store for Remote {
    type Bound = <tollgate::store::MemoryStore as Store>::Bound;
    type Ticket = <tollgate::store::MemoryStore as Store>::Ticket;

    fn bind(&self, policy: &Policy) -> Result<Self::Bound, tollgate::ConfigError> {
        self.0.bind(policy)
    }

    async fn check(
        &self,
        bound: &Self::Bound,
        check: tollgate::store::Check<'_>,
    ) -> Result<tollgate::store::Verdict<Self::Ticket>, tollgate::StoreError> {
        self.0.check(bound, check).await
    }

    async fn settle(
        &self,
        bound: &Self::Bound,
        ticket: Self::Ticket,
        cost: u64,
    ) -> Result<(), tollgate::StoreError> {
        self.0.settle(bound, ticket, cost).await
    }
}

/// How many times the layer's cost and priority closures ran for five requests through a
/// layer on `store`.
async fn closure_calls<St: Store>(store: St) -> (u32, u32) {
    use std::sync::atomic::AtomicU32;
    let (costs, classes) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let (c, p) = (Arc::clone(&costs), Arc::clone(&classes));
    let policy = Policy::single("once", Quota::per_second(100)).unwrap();
    let layer = RateLimitLayer::builder(policy)
        .store(store)
        .cost_fn(move |_| {
            c.fetch_add(1, Ordering::SeqCst);
            1
        })
        .priority(move |_| {
            p.fetch_add(1, Ordering::SeqCst);
            tollgate::Priority::Standard
        })
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(|_req: Request<RequestBody<Body>>| async {
        Ok::<_, Infallible>(Response::new(Body::empty()))
    }));
    for _ in 0..5 {
        assert_eq!(svc.clone().oneshot(request()).await.unwrap().status(), StatusCode::OK);
    }
    (costs.load(Ordering::SeqCst), classes.load(Ordering::SeqCst))
}

/// The layer's cost and priority closures run once per request, on the path decided at once
/// and on the one that waits for the store alike (before, a request the store could not
/// decide at once ran them twice).
#[tokio::test]
async fn the_cost_and_priority_closures_run_once_per_request() {
    assert_eq!(closure_calls(MemoryStore::new()).await, (5, 5));
    assert_eq!(closure_calls(Remote::default()).await, (5, 5));
}
