//! The layer with tier kinds beyond request rates: concurrency slots held until the response
//! body ends (released on a body drop, a handler panic, a client disconnect), bytes counted in
//! and out, units a handler reports, and grants refreshed on Redis while a request runs.
#[cfg(any(feature = "axum", feature = "redis"))]
use crate::support;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

#[cfg(feature = "axum")]
use crate::support::bodies::{Chunks, Endless};
use crate::support::bodies::{End, InFlight, Repeat};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Empty, Full};
use tollgate::RequestBody;
use tollgate::clock::{Clock, TokioClock};
use tollgate::key::{GlobalKey, Key};
use tollgate::store::{MemoryStore, Store};
use tollgate::{
    Algorithm, Calendar, Concurrency, Limiter, Policy, Quota, RateLimitLayer, StreamMode, Unit,
    Usage,
};
use tower::{Layer, Service, ServiceExt, service_fn};

fn paused_store() -> MemoryStore {
    MemoryStore::builder().clock(TokioClock::new()).build().unwrap()
}

/// A layer enforcing `policy` on one key for every request, on tokio's clock.
fn on_paused(policy: Policy) -> RateLimitLayer<GlobalKey> {
    RateLimitLayer::builder(policy).store(paused_store()).key(GlobalKey).build().unwrap()
}

/// What each tier of `layer`'s policy has left on the global key.
async fn remaining(layer: &RateLimitLayer<GlobalKey>) -> Vec<u64> {
    let decision = layer.limiter().check(&Key::Global, 0).await.unwrap();
    decision.tiers().iter().map(|t| t.remaining()).collect()
}

/// The free slots of the policy's concurrency tier `tier` for the global key, by a query.
async fn free_slots<St: Store>(limiter: &Limiter<St>, tier: usize) -> u64 {
    limiter.check(&Key::Global, 0).await.unwrap().tiers()[tier].remaining()
}

#[tokio::test(start_paused = true)]
async fn a_thousand_shaped_requests_never_exceed_four_in_flight_until_their_bodies_end() {
    let policy =
        Policy::builder("reports").concurrency("slots", Concurrency::new(4)).build().unwrap();
    let layer = RateLimitLayer::builder(policy)
        .store(paused_store())
        .key(GlobalKey)
        .shape(Duration::from_secs(3600))
        .max_waiters(2_000)
        .build()
        .unwrap();
    let in_flight = Arc::new(InFlight::default());
    let tracker = Arc::clone(&in_flight);
    let svc = layer.layer(service_fn(move |_req: Request<RequestBody<Empty<Bytes>>>| {
        let tracker = Arc::clone(&tracker);
        async move {
            // The handler works 100 ms; its body is in flight until the caller drops it.
            let body = tracker.enter(10);
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok::<_, Infallible>(Response::new(body))
        }
    }));
    let tasks: Vec<_> = (0..1_000)
        .map(|_| {
            let svc = svc.clone();
            tokio::spawn(async move {
                let res = svc.oneshot(Request::new(Empty::new())).await.unwrap();
                let status = res.status();
                // Reading the body takes another 50 ms: the slot is held until it ends.
                let mut body = res.into_body();
                tokio::time::sleep(Duration::from_millis(50)).await;
                while body.frame().await.is_some() {}
                drop(body);
                status
            })
        })
        .collect();
    let start = tokio::time::Instant::now();
    for task in tasks {
        assert_eq!(task.await.unwrap(), StatusCode::OK);
    }
    assert_eq!(in_flight.max.load(Ordering::SeqCst), 4);
    assert_eq!(in_flight.now.load(Ordering::SeqCst), 0);
    // 250 rounds of four, each 150 ms: no slot idles while a request waits for one.
    assert_eq!(start.elapsed(), Duration::from_millis(250 * 150));
    assert_eq!(free_slots(layer.limiter(), 0).await, 4);
}

/// Ten requests at second :58 through a layer shaping within 120 s, under a leaky bucket of
/// 1 a second (burst 20) and 3 a minute: the handler runs twice in that minute and three
/// times in each of the next two; the last two are refused, to retry in 2 s.
#[tokio::test(start_paused = true)]
async fn shaped_requests_fill_no_calendar_minute_past_its_limit() {
    const MINUTE: u64 = 60_000_000_000;
    let policy = Policy::builder("paced")
        .algorithm(Algorithm::LeakyBucket)
        .tier("rate", Quota::per_second(1).with_burst(20))
        .calendar("minute", Calendar::per_minute(3))
        .build()
        .unwrap();
    let clock = TokioClock::new();
    let store = MemoryStore::builder().clock(clock).build().unwrap();
    let layer = RateLimitLayer::builder(policy)
        .store(store)
        .key(GlobalKey)
        .shape(Duration::from_secs(120))
        .build()
        .unwrap();
    let ran = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = Arc::clone(&ran);
    let svc = layer.layer(service_fn(move |_req: Request<RequestBody<Empty<Bytes>>>| {
        log.lock().unwrap().push(clock.now());
        async { Ok::<_, Infallible>(Response::new(Full::new(Bytes::new()))) }
    }));
    // To second :58 of the clock's minute (tokio's timer may add a millisecond).
    let to_58 = (58_000_000_000 + MINUTE - clock.now() % MINUTE) % MINUTE;
    tokio::time::sleep(Duration::from_nanos(to_58)).await;
    let first = clock.now() / MINUTE;
    assert_eq!(clock.now() % MINUTE / 1_000_000_000, 58);
    let tasks: Vec<_> =
        (0..10).map(|_| tokio::spawn(svc.clone().oneshot(Request::new(Empty::new())))).collect();
    let mut refused = Vec::new();
    for task in tasks {
        let res = task.await.unwrap().unwrap();
        if res.status() == StatusCode::TOO_MANY_REQUESTS {
            refused.push(res.headers()["retry-after"].to_str().unwrap().to_owned());
        } else {
            assert_eq!(res.status(), StatusCode::OK);
        }
    }
    assert_eq!(refused, ["2", "2"]);
    let mut per_minute = std::collections::BTreeMap::<u64, u64>::new();
    for t in ran.lock().unwrap().iter() {
        *per_minute.entry(t / MINUTE - first).or_default() += 1;
    }
    assert_eq!(per_minute.into_iter().collect::<Vec<_>>(), [(0, 2), (1, 3), (2, 3)]);
}

#[tokio::test(start_paused = true)]
async fn policing_refuses_beyond_the_slots_and_a_dropped_body_gives_its_slot_back() {
    let policy = Policy::builder("reports")
        .concurrency("slots", Concurrency::new(2).with_typical_hold(Duration::from_secs(3)))
        .build()
        .unwrap();
    let layer = on_paused(policy);
    let in_flight = Arc::new(InFlight::default());
    let tracker = Arc::clone(&in_flight);
    let mut svc = layer.layer(service_fn(move |_req: Request<RequestBody<Empty<Bytes>>>| {
        let body = tracker.enter(1);
        async move { Ok::<_, Infallible>(Response::new(body)) }
    }));
    let first = svc.ready().await.unwrap().call(Request::new(Empty::new())).await.unwrap();
    let second = svc.ready().await.unwrap().call(Request::new(Empty::new())).await.unwrap();
    assert_eq!(first.headers()["ratelimit"], "\"slots\";r=1;t=3");
    assert_eq!(second.headers()["ratelimit"], "\"slots\";r=0;t=3");
    assert_eq!(second.headers()["ratelimit-policy"], "\"slots\";q=2;qu=\"concurrent-requests\"");
    let third = svc.ready().await.unwrap().call(Request::new(Empty::new())).await.unwrap();
    assert_eq!(third.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(third.headers()["retry-after"], "3", "the typical hold");
    assert_eq!(free_slots(layer.limiter(), 0).await, 0);
    // A body dropped unread (a client gone) releases its slot; a body read to its end too.
    drop(first);
    assert_eq!(free_slots(layer.limiter(), 0).await, 1);
    second.into_body().collect().await.unwrap();
    assert_eq!(free_slots(layer.limiter(), 0).await, 2);
    assert_eq!(in_flight.now.load(Ordering::SeqCst), 0);
}

/// A layer of one concurrency slot, `slots`, on tokio's clock.
fn one_slot() -> RateLimitLayer<GlobalKey> {
    on_paused(Policy::builder("p").concurrency("slots", Concurrency::new(1)).build().unwrap())
}

#[tokio::test(start_paused = true)]
async fn the_slot_is_free_when_the_last_frame_is_handed_on() {
    let layer = one_slot();
    let svc = layer.layer(service_fn(|_req: Request<RequestBody<Empty<Bytes>>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
    }));
    let mut body = svc.oneshot(Request::new(Empty::new())).await.unwrap().into_body();
    assert_eq!(free_slots(layer.limiter(), 0).await, 0);
    // A server writes the last frame without polling the body again: the slot is back by then.
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), "done");
    assert!(body.is_end_stream());
    assert_eq!(free_slots(layer.limiter(), 0).await, 1);
}

#[tokio::test(start_paused = true)]
async fn a_handler_that_panics_or_fails_releases_its_slot() {
    let layer = one_slot();
    let panicking = layer.layer(service_fn(|_req: Request<RequestBody<Empty<Bytes>>>| async {
        if true {
            panic!("handler bug");
        }
        Ok::<_, Infallible>(Response::new(Full::<Bytes>::default()))
    }));
    let joined = tokio::spawn(panicking.oneshot(Request::new(Empty::new()))).await;
    assert!(joined.unwrap_err().is_panic());
    assert_eq!(free_slots(layer.limiter(), 0).await, 1);

    let failing = layer.layer(service_fn(|_req: Request<RequestBody<Empty<Bytes>>>| async {
        Err::<Response<Full<Bytes>>, _>("inner error")
    }));
    assert_eq!(failing.oneshot(Request::new(Empty::new())).await.unwrap_err(), "inner error");
    assert_eq!(free_slots(layer.limiter(), 0).await, 1);
}

#[tokio::test(start_paused = true)]
async fn response_bytes_and_reported_units_are_settled_when_the_body_ends() {
    let layer = on_paused(crate::kinds::llm_policy("egress"));
    let svc = layer.layer(service_fn(|req: Request<RequestBody<Empty<Bytes>>>| async move {
        req.extensions().get::<Usage>().expect("a Usage for a reported tier").report(1_200);
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(vec![b'x'; 3_000]))))
    }));
    let res = svc.clone().oneshot(Request::new(Empty::new())).await.unwrap();
    // At admission: one request, one byte and one token, estimated.
    assert_eq!(
        res.headers()["ratelimit"],
        "\"requests\";r=99;t=36, \"egress\";r=9999;t=1, \"tokens\";r=4999;t=1"
    );
    assert_eq!(
        res.headers()["ratelimit-policy"],
        "\"requests\";q=100;w=3600, \"egress\";q=10000;w=3600;qu=\"content-bytes\", \
         \"tokens\";q=5000;w=3600;qu=\"reported\""
    );
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.len(), 3_000);
    assert_eq!(remaining(&layer).await, [99, 7_000, 3_800]);
}

#[tokio::test(start_paused = true)]
async fn a_refunded_response_gives_back_every_unit_it_counts() {
    let policy = Policy::builder("p")
        .tier("requests", Quota::per_hour(10))
        .tier("egress", Quota::per_hour(10_000).counting(Unit::ResponseBytes))
        .concurrency("slots", Concurrency::new(1))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(policy)
        .store(paused_store())
        .key(GlobalKey)
        .refund_if(|status| status == StatusCode::NOT_FOUND)
        .build()
        .unwrap();
    let svc = layer.layer(service_fn(|_req: Request<RequestBody<Empty<Bytes>>>| async {
        let mut res = Response::new(Full::new(Bytes::from_static(b"no such thing")));
        *res.status_mut() = StatusCode::NOT_FOUND;
        Ok::<_, Infallible>(res)
    }));
    let res = svc.oneshot(Request::new(Empty::new())).await.unwrap();
    res.into_body().collect().await.unwrap();
    assert_eq!(remaining(&layer).await, [10, 10_000, 1]);
}

#[tokio::test(start_paused = true)]
async fn a_request_over_its_byte_tier_is_refused_and_charges_nothing() {
    let layer = on_paused(
        Policy::builder("upload")
            .tier("requests", Quota::per_hour(10))
            .tier("bytes", Quota::per_second(1_000).counting(Unit::RequestBytes))
            .build()
            .unwrap(),
    );
    let svc = layer.layer(service_fn(|_req: Request<RequestBody<String>>| async {
        Ok::<_, Infallible>(Response::new(Full::<Bytes>::default()))
    }));
    let upload = |len: usize| {
        Request::post("/").header("content-length", len).body("x".repeat(len)).unwrap()
    };
    let ok = svc.clone().oneshot(upload(800)).await.unwrap();
    assert_eq!(ok.headers()["ratelimit"], "\"requests\";r=9;t=360, \"bytes\";r=200;t=1");
    // 400 bytes do not fit the 200 left: refused, and the request tier is not charged.
    let refused = svc.clone().oneshot(upload(400)).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["ratelimit"], "\"requests\";r=9;t=360, \"bytes\";r=200;t=1");
    let body = refused.into_body().collect().await.unwrap().to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["violated-policies"], serde_json::json!(["bytes"]));
}

/// Request bodies of unknown length (chunked) are counted as they stream, over real HTTP.
#[cfg(feature = "axum")]
#[tokio::test]
async fn streamed_uploads_are_counted_as_their_bytes_arrive() {
    use axum::Router;
    use axum::routing::post;

    let policy = Policy::builder("upload")
        .tier("bytes", Quota::per_hour(100_000).counting(Unit::RequestBytes))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(policy).key(GlobalKey).build().unwrap();
    let limiter = layer.limiter().clone();
    let app = Router::new()
        .route("/", post(|body: Bytes| async move { body.len().to_string() }))
        .layer(layer);
    let server = support::serve(app).await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Chunks>();
    let req = Request::post(server.url("/")).body(Chunks::new(5, 1_000)).unwrap();
    assert!(req.headers().get("content-length").is_none());
    let res = client.request(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    // At admission one unit was charged; at the end of the response, the 5,000 bytes read.
    assert_eq!(res.headers()["ratelimit"], "\"bytes\";r=99999;t=1");
    let echoed = res.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&echoed[..], b"5000");
    let remaining = limiter.check(&Key::Global, 0).await.unwrap().tiers()[0].remaining();
    assert_eq!(remaining, 95_000);
}

/// Polls `free_slots` until it is `want`, at most 5 s (bounded; a real server frees the slot
/// when hyper drops the abandoned body).
#[cfg(any(feature = "axum", feature = "redis"))]
async fn until_free<St: Store>(limiter: &Limiter<St>, tier: usize, want: u64) -> u64 {
    let mut free = free_slots(limiter, tier).await;
    for _ in 0..500 {
        if free == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        free = free_slots(limiter, tier).await;
    }
    free
}

#[cfg(feature = "axum")]
#[tokio::test]
async fn a_client_that_disconnects_mid_response_gives_its_slot_back() {
    use axum::Router;
    use axum::routing::get;

    let policy =
        Policy::builder("stream").concurrency("slots", Concurrency::new(1)).build().unwrap();
    let layer = RateLimitLayer::builder(policy).key(GlobalKey).build().unwrap();
    let limiter = layer.limiter().clone();
    let app = Router::new()
        .route("/", get(|| async { axum::body::Body::new(Endless(false)) }))
        .layer(layer);
    let server = support::serve(app).await;
    let client = support::client();
    let req = Request::get(server.url("/")).body(Full::default()).unwrap();
    let mut res = client.request(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let first = res.body_mut().frame().await.unwrap().unwrap();
    assert_eq!(first.data_ref().unwrap(), &Bytes::from_static(b"first chunk"));
    // While the response streams, the slot is taken: another request is refused.
    let second = support::get(&client, &server.url("/"), &[]).await;
    assert_eq!(second.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(free_slots(&limiter, 0).await, 0);
    // The client goes away mid-response: the server drops the body, and the slot comes back.
    drop(res);
    drop(client);
    assert_eq!(until_free(&limiter, 0, 1).await, 1);
}

/// On Redis a slot is a grant: refreshed while its request runs, so a request longer than the
/// grant keeps its slot; released when the response ends.
#[cfg(feature = "redis")]
#[tokio::test]
async fn on_redis_a_long_request_keeps_its_slot_by_refreshing_its_lease() {
    use tollgate::store::RedisStore;

    let Some(server) = support::redis::Server::start("redis-server") else { return };
    let store = RedisStore::builder(server.url()).prefix("grant:").no_fallback().build().unwrap();
    let policy = Policy::builder("slow")
        .concurrency("slots", Concurrency::new(1).with_ttl(Duration::from_millis(900)))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(policy).store(store).key(GlobalKey).build().unwrap();
    let svc = layer.layer(service_fn(|_req: Request<RequestBody<Empty<Bytes>>>| async {
        // Longer than the grant: it is refreshed every 300 ms meanwhile (a grant of 900 ms
        // leaves a busy machine 600 ms of slack for each refresh).
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"report"))))
    }));
    let slow = tokio::spawn(svc.clone().oneshot(Request::new(Empty::new())));
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    // Past the grant, the slot is still held.
    let refused = svc.clone().oneshot(Request::new(Empty::new())).await.unwrap();
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let res = slow.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    res.into_body().collect().await.unwrap();
    assert_eq!(until_free(layer.limiter(), 0, 1).await, 1);
}

/// 1,000 concurrent requests on Redis against 4 slots: exactly 4 admitted, never more in
/// flight; the others refused at once; the slots back when the 4 responses end.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis_a_thousand_concurrent_requests_get_exactly_four_slots() {
    use tollgate::store::RedisStore;

    let Some(server) = support::redis::Server::start("redis-server") else { return };
    let store =
        RedisStore::builder(server.url()).prefix("thousand:").no_fallback().build().unwrap();
    let policy =
        Policy::builder("reports").concurrency("slots", Concurrency::new(4)).build().unwrap();
    let layer = RateLimitLayer::builder(policy).store(store).key(GlobalKey).build().unwrap();
    let in_flight = Arc::new(InFlight::default());
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (tracker, open) = (Arc::clone(&in_flight), Arc::clone(&gate));
    let svc = layer.layer(service_fn(move |_req: Request<RequestBody<Empty<Bytes>>>| {
        let (tracker, open) = (Arc::clone(&tracker), Arc::clone(&open));
        async move {
            let body = tracker.enter(1);
            // Held until the test has seen every refusal.
            open.acquire().await.unwrap().forget();
            Ok::<_, Infallible>(Response::new(body))
        }
    }));
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    for _ in 0..1_000 {
        let (svc, done) = (svc.clone(), done_tx.clone());
        tokio::spawn(async move {
            let res = svc.oneshot(Request::new(Empty::new())).await.unwrap();
            let status = res.status();
            res.into_body().collect().await.unwrap();
            let _ = done.send(status);
        });
    }
    let mut statuses = Vec::new();
    for _ in 0..996 {
        statuses.push(done_rx.recv().await.unwrap());
    }
    let other: Vec<_> = statuses.iter().filter(|s| **s != StatusCode::TOO_MANY_REQUESTS).collect();
    assert!(other.is_empty(), "{} of 996 not refused with 429: {other:?}", other.len());
    assert_eq!(in_flight.now.load(Ordering::SeqCst), 4);
    gate.add_permits(4);
    for _ in 0..4 {
        assert_eq!(done_rx.recv().await.unwrap(), StatusCode::OK);
    }
    assert_eq!(in_flight.max.load(Ordering::SeqCst), 4);
    assert_eq!(until_free(layer.limiter(), 0, 4).await, 4);
}

/// A byte tier counts a chunked upload whatever the request body's type: the layer hands the
/// handler its own `RequestBody`, so no body type escapes the count.
#[cfg(feature = "axum")]
mod every_body_type {
    use std::net::SocketAddr;

    use axum::Router;
    use axum::routing::post;
    use hyper::body::Incoming;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use hyper_util::service::TowerToHyperService;
    use tower_http::limit::RequestBodyLimitLayer;

    use super::*;

    /// 64 chunks of 16 KiB: 1 MiB, sent without a `Content-Length`.
    const CHUNKS: usize = 64;
    const CHUNK: usize = 16 * 1024;
    const UPLOAD: u64 = (CHUNKS * CHUNK) as u64;
    const CAPACITY: u64 = 100 * 1024 * 1024;

    fn layer() -> RateLimitLayer<GlobalKey> {
        let policy = Policy::builder("upload")
            .tier("bytes", Quota::per_hour(CAPACITY).counting(Unit::RequestBytes))
            .build()
            .unwrap();
        // A clock that stands still: the tier refills nothing while the test runs.
        let store =
            MemoryStore::builder().clock(tollgate::clock::FakeClock::new()).build().unwrap();
        RateLimitLayer::builder(policy).key(GlobalKey).store(store).build().unwrap()
    }

    /// Sends one chunked upload of `CHUNKS` x `CHUNK` bytes; the status and the body.
    async fn upload(addr: SocketAddr, chunks: usize) -> (StatusCode, Bytes) {
        let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .build_http::<Chunks>();
        let req =
            Request::post(format!("http://{addr}/")).body(Chunks::new(chunks, CHUNK)).unwrap();
        assert!(req.headers().get("content-length").is_none());
        let res = client.request(req).await.unwrap();
        let status = res.status();
        (status, res.into_body().collect().await.unwrap().to_bytes())
    }

    /// The bytes charged to the tier once the last response's settlement (at the end of its
    /// body) has replaced its one-unit estimate: polled, at most 5 s.
    async fn charged(limiter: &Limiter, before: u64) -> u64 {
        let mut left = free_slots(limiter, 0).await;
        for _ in 0..500 {
            if left != CAPACITY - before - 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            left = free_slots(limiter, 0).await;
        }
        CAPACITY - left
    }

    async fn echo_len(body: Bytes) -> String {
        body.len().to_string()
    }

    #[tokio::test]
    async fn through_plain_hyper() {
        let layer = layer();
        let limiter = layer.limiter().clone();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { return };
                let handler = service_fn(|req: Request<RequestBody<Incoming>>| async move {
                    let body = req.into_body().collect().await?.to_bytes();
                    Ok::<_, hyper::Error>(Response::new(Full::new(Bytes::from(
                        body.len().to_string(),
                    ))))
                });
                let svc = TowerToHyperService::new(layer.layer(handler));
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        let (status, body) = upload(addr, CHUNKS).await;
        assert_eq!((status, &body[..]), (StatusCode::OK, UPLOAD.to_string().as_bytes()));
        assert_eq!(charged(&limiter, 0).await, UPLOAD);
        server.abort();
    }

    #[tokio::test]
    async fn through_axum() {
        let layer = layer();
        let limiter = layer.limiter().clone();
        let app = Router::new().route("/", post(echo_len)).layer(layer);
        let server = support::serve(app).await;
        let (status, body) = upload(server.addr, CHUNKS).await;
        assert_eq!((status, &body[..]), (StatusCode::OK, UPLOAD.to_string().as_bytes()));
        assert_eq!(charged(&limiter, 0).await, UPLOAD);
    }

    /// tower-http's body limit outside the rate limit, in one `ServiceBuilder`: the body the
    /// layer sees is `http_body_util::Limited<_>`. Counted all the same, and an upload over the
    /// body limit still gets the body limit's 413 (its error reaches axum unchanged), charging
    /// no more than the bytes read before the limit.
    #[tokio::test]
    async fn through_axum_inside_a_body_limit() {
        let layer = layer();
        let limiter = layer.limiter().clone();
        let limit = RequestBodyLimitLayer::new(3 * UPLOAD as usize / 2);
        let app = Router::new()
            .route("/", post(echo_len))
            .layer(tower::ServiceBuilder::new().layer(limit).layer(layer));
        let server = support::serve(app).await;
        let (status, body) = upload(server.addr, CHUNKS).await;
        assert_eq!((status, &body[..]), (StatusCode::OK, UPLOAD.to_string().as_bytes()));
        assert_eq!(charged(&limiter, 0).await, UPLOAD);

        let (status, body) = upload(server.addr, 3 * CHUNKS).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body:?}");
        let over = charged(&limiter, UPLOAD).await - UPLOAD;
        assert!(over <= 3 * UPLOAD / 2, "charged {over} bytes for a refused upload");
    }

    /// axum's own limit (`DefaultBodyLimit`), applied as the handler reads: 413 too, and only
    /// the bytes read are charged: the limit and the frame that crossed it.
    #[tokio::test]
    async fn through_axum_with_its_default_body_limit() {
        let layer = layer();
        let limiter = layer.limiter().clone();
        let app = Router::new()
            .route("/", post(echo_len))
            .layer(layer)
            .layer(axum::extract::DefaultBodyLimit::max(3 * UPLOAD as usize / 2));
        let server = support::serve(app).await;
        let (status, body) = upload(server.addr, 3 * CHUNKS).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{body:?}");
        let charged = charged(&limiter, 0).await;
        assert_eq!(charged, 3 * UPLOAD / 2 + CHUNK as u64, "charged for a refused upload");
    }

    /// Sends one upload of `len` bytes with its `Content-Length`; the status.
    async fn upload_sized(addr: SocketAddr, len: usize) -> StatusCode {
        let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http();
        let req = Request::post(format!("http://{addr}/"))
            .body(Full::new(Bytes::from(vec![b'x'; len])))
            .unwrap();
        let res = client.request(req).await.unwrap();
        let status = res.status();
        res.into_body().collect().await.unwrap();
        status
    }

    /// The bytes charged to the tier once they are `want` (settlements finish after the
    /// response ends): polled, at most 5 s.
    async fn charged_when(limiter: &Limiter, want: u64) -> u64 {
        let mut charged = CAPACITY - free_slots(limiter, 0).await;
        for _ in 0..500 {
            if charged == want {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            charged = CAPACITY - free_slots(limiter, 0).await;
        }
        charged
    }

    /// The README's recipe: the body limit outside the rate limit (listed first in a
    /// `ServiceBuilder`) refuses an upload whose `Content-Length` is over it before the layer
    /// charges it; in the other order the layer charges the declared bytes first, and every
    /// refused upload drains the byte tier.
    #[tokio::test]
    async fn a_body_limit_outside_the_layer_refuses_oversized_uploads_before_they_are_charged() {
        const LIMIT: usize = UPLOAD as usize;
        for limit_outside in [true, false] {
            let layer = layer();
            let limiter = layer.limiter().clone();
            let limit = RequestBodyLimitLayer::new(LIMIT);
            let app = Router::new().route("/", post(echo_len));
            let app = if limit_outside {
                app.layer(tower::ServiceBuilder::new().layer(limit).layer(layer))
            } else {
                app.layer(tower::ServiceBuilder::new().layer(layer).layer(limit))
            };
            let server = support::serve(app).await;
            for _ in 0..3 {
                assert_eq!(
                    upload_sized(server.addr, 4 * LIMIT).await,
                    StatusCode::PAYLOAD_TOO_LARGE
                );
            }
            assert_eq!(upload_sized(server.addr, LIMIT).await, StatusCode::OK);
            let refused = if limit_outside { 0 } else { 3 * 4 * UPLOAD };
            let want = refused + UPLOAD;
            assert_eq!(charged_when(&limiter, want).await, want, "limit outside: {limit_outside}");
        }
    }
}

/// A layer over one concurrency slot and 10,000 bytes an hour of `unit`, on tokio's clock,
/// metering streams as `mode` says (`None`: the default, policing as it streams).
fn slot_and_bytes(unit: Unit, mode: Option<StreamMode>) -> RateLimitLayer<GlobalKey> {
    let policy = Policy::builder("p")
        .concurrency("slot", Concurrency::new(1))
        .tier("bytes", Quota::per_hour(10_000).counting(unit))
        .build()
        .unwrap();
    let builder = RateLimitLayer::builder(policy).store(paused_store()).key(GlobalKey);
    match mode {
        Some(mode) => builder.on_stream(mode).build().unwrap(),
        None => builder.build().unwrap(),
    }
}

/// The two ways a body's bytes are metered: settled when it ends (what it used is read
/// between), and the default, granted as it streams (only the end is checked).
const METERINGS: [Option<StreamMode>; 2] = [Some(StreamMode::Settle), None];

/// The free slots and bytes left of [`slot_and_bytes`]'s policy.
async fn slot_and_bytes_left(layer: &RateLimitLayer<GlobalKey>) -> [u64; 2] {
    let decision = layer.limiter().check(&Key::Global, 0).await.unwrap();
    [decision.tiers()[0].remaining(), decision.tiers()[1].remaining()]
}

/// A request through [`slot_and_bytes`] counting response bytes under `mode`, answered with
/// `frames` frames of 700 bytes, then `end`: the layer and the response body it hands on.
async fn respond_with(
    mode: Option<StreamMode>,
    frames: usize,
    end: End,
) -> (RateLimitLayer<GlobalKey>, tollgate::layer::ResponseBody<Repeat>) {
    let layer = slot_and_bytes(Unit::ResponseBytes, mode);
    let svc = layer.clone().layer(service_fn(
        move |_req: Request<RequestBody<Empty<Bytes>>>| async move {
            Ok::<_, Infallible>(Response::new(Repeat::bytes(frames, 700, end)))
        },
    ));
    let res = svc.oneshot(Request::new(Empty::new())).await.unwrap();
    (layer, res.into_body())
}

/// A response body that fails has finished: its slot is free and its byte tier is charged
/// the bytes it handed on before the error, exactly.
#[tokio::test(start_paused = true)]
async fn a_response_body_that_fails_is_settled_at_the_bytes_it_sent() {
    for mode in METERINGS {
        let (layer, mut body) = respond_with(mode, 2, End::Fail).await;
        let settled = mode == Some(StreamMode::Settle);
        if settled {
            // At admission: the slot, and one byte estimated.
            assert_eq!(slot_and_bytes_left(&layer).await, [0, 9_999]);
        }
        for _ in 0..2 {
            assert_eq!(body.frame().await.unwrap().unwrap().into_data().unwrap().len(), 700);
        }
        if settled {
            assert_eq!(slot_and_bytes_left(&layer).await, [0, 9_999]);
        }
        assert_eq!(body.frame().await.unwrap().unwrap_err(), "reset");
        assert_eq!(slot_and_bytes_left(&layer).await, [1, 8_600], "{mode:?}");
        drop(body);
        assert_eq!(slot_and_bytes_left(&layer).await, [1, 8_600], "{mode:?}: settled once");
    }
}

/// A response body dropped before its end (a client gone) is abandoned: its slot is free and
/// its byte tier charged the bytes it handed on until then, exactly.
#[tokio::test(start_paused = true)]
async fn a_response_body_dropped_unfinished_is_settled_at_the_bytes_it_sent() {
    for mode in METERINGS {
        let (layer, mut body) = respond_with(mode, 1, End::Hang).await;
        assert_eq!(body.frame().await.unwrap().unwrap().into_data().unwrap().len(), 700);
        if mode == Some(StreamMode::Settle) {
            assert_eq!(slot_and_bytes_left(&layer).await, [0, 9_999]);
        }
        drop(body);
        assert_eq!(slot_and_bytes_left(&layer).await, [1, 9_300], "{mode:?}");
    }
}

/// A request body its handler stops reading (answering before the upload's end) is charged the
/// bytes that reached the handler, exactly, when the response ends.
#[tokio::test(start_paused = true)]
async fn a_request_body_read_in_part_is_charged_the_bytes_read() {
    for mode in METERINGS {
        let layer = slot_and_bytes(Unit::RequestBytes, mode);
        let svc = layer.layer(service_fn(|req: Request<RequestBody<Repeat>>| async move {
            let mut body = req.into_body();
            let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
            // The rest of the upload is never read.
            drop(body);
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(first.len().to_string()))))
        }));
        let upload = Repeat::bytes(3, 400, End::Done);
        let res = svc.oneshot(Request::new(upload)).await.unwrap();
        if mode == Some(StreamMode::Settle) {
            assert_eq!(slot_and_bytes_left(&layer).await, [0, 9_999]);
        }
        assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "400");
        assert_eq!(slot_and_bytes_left(&layer).await, [1, 9_600], "{mode:?}");
    }
}

// One rule ends every body the layer observes, request or response: finished (its end),
// abandoned (an error from the inner body) or dropped unfinished, the body is settled at what
// it handed on, exactly, and the request's slot is free. Below, each kind of observed body
// (counted whole and settled at its end, metered by grants as it streams with no length
// known, gRPC messages) meets each end, on the side it is observed on.

/// Two frames of what `unit` counts: 700 bytes each, or one gRPC message each (a 5-byte
/// prefix and 8 bytes of payload).
fn two_frames(unit: Unit, end: End) -> Repeat {
    let frame = match unit {
        Unit::RequestMessages | Unit::ResponseMessages => {
            Bytes::from_static(&[0, 0, 0, 0, 8, 1, 2, 3, 4, 5, 6, 7, 8])
        }
        _ => Bytes::from(vec![b'z'; 700]),
    };
    Repeat { frame, frames: 2, end }
}

/// Reads a body's two frames, then its end, or its error; a body that hangs is left there.
async fn read_two<B>(body: &mut B, end: End)
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Debug,
{
    for _ in 0..2 {
        body.frame().await.unwrap().unwrap();
    }
    match end {
        End::Done => assert!(body.frame().await.is_none()),
        End::Fail => assert!(body.frame().await.unwrap().is_err()),
        End::Hang => {}
    }
}

/// A layer over one concurrency slot and 1,000,000 an hour of `unit`, metering bodies by
/// `mode`, on tokio's clock (standing still: nothing refills).
fn slot_and_units(unit: Unit, mode: tollgate::StreamMode) -> RateLimitLayer<GlobalKey> {
    let policy = Policy::builder("p")
        .concurrency("slot", Concurrency::new(1))
        .tier("units", Quota::per_hour(1_000_000).counting(unit))
        .build()
        .unwrap();
    RateLimitLayer::builder(policy)
        .store(paused_store())
        .key(GlobalKey)
        .on_stream(mode)
        .build()
        .unwrap()
}

/// A request observed on `unit`'s side under `mode`, its body of two frames ending as `end`
/// says, read through and dropped: the free slots and the units left once the response body
/// is dropped. A gRPC call when `unit` counts messages.
async fn observed(unit: Unit, mode: tollgate::StreamMode, end: End) -> [u64; 2] {
    let layer = slot_and_units(unit, mode);
    let request_side = matches!(unit, Unit::RequestBytes | Unit::RequestMessages);
    let svc =
        layer.clone().layer(service_fn(move |req: Request<RequestBody<Repeat>>| async move {
            let response = if request_side {
                let mut body = req.into_body();
                read_two(&mut body, end).await;
                // A body that hangs is dropped unfinished here.
                drop(body);
                Repeat { frame: Bytes::new(), frames: 0, end: End::Done }
            } else {
                two_frames(unit, end)
            };
            Ok::<_, Infallible>(Response::new(response))
        }));
    let mut req = Request::post("/pkg.Service/Method");
    if matches!(unit, Unit::RequestMessages | Unit::ResponseMessages) {
        req = req.header("content-type", "application/grpc");
    }
    let upload = match request_side {
        true => two_frames(unit, end),
        false => Repeat { frame: Bytes::new(), frames: 0, end: End::Done },
    };
    let mut body = svc.oneshot(req.body(upload).unwrap()).await.unwrap().into_body();
    if request_side {
        assert!(body.frame().await.is_none());
    } else {
        read_two(&mut body, end).await;
    }
    drop(body);
    slot_and_bytes_left(&layer).await
}

/// Both sides' bytes, settled at the end of the response (the request's counted as the
/// handler read them): 2 x 700 bytes each way, whatever ended the body.
async fn counted_whole(end: End) {
    let settle = tollgate::StreamMode::Settle;
    assert_eq!(observed(Unit::RequestBytes, settle, end).await, [1, 998_600]);
    assert_eq!(observed(Unit::ResponseBytes, settle, end).await, [1, 998_600]);
}

/// Both sides' bytes, metered by grants as they stream (no length known): the grants settle
/// at the 2 x 700 bytes that passed, and the unit charged at admission is given back.
async fn leased_bytes(end: End) {
    let police = tollgate::StreamMode::Police;
    assert_eq!(observed(Unit::RequestBytes, police, end).await, [1, 998_600]);
    let shape = tollgate::StreamMode::Shape;
    assert_eq!(observed(Unit::ResponseBytes, shape, end).await, [1, 998_600]);
}

/// A gRPC call's messages, each way, counted and settled at the end (`Settle`) or granted as
/// they stream (`Police`, which charges the first message at admission): 2 messages.
async fn grpc_messages(end: End) {
    for mode in [tollgate::StreamMode::Settle, tollgate::StreamMode::Police] {
        assert_eq!(observed(Unit::RequestMessages, mode, end).await, [1, 999_998], "{mode:?}");
        assert_eq!(observed(Unit::ResponseMessages, mode, end).await, [1, 999_998], "{mode:?}");
    }
}

/// One paused-clock test a row, running a scenario above with the way the body ends.
macro_rules! body_end_tests {
    ($($name:ident: $scenario:ident($end:expr),)*) => {$(
        #[tokio::test(start_paused = true)]
        async fn $name() {
            $scenario($end).await;
        }
    )*};
}

body_end_tests! {
    bodies_counted_whole_and_finished_are_settled_at_their_bytes: counted_whole(End::Done),
    bodies_counted_whole_and_abandoned_are_settled_at_their_bytes: counted_whole(End::Fail),
    bodies_counted_whole_and_dropped_are_settled_at_their_bytes: counted_whole(End::Hang),
    streamed_bodies_finished_are_charged_their_bytes: leased_bytes(End::Done),
    streamed_bodies_abandoned_are_charged_their_bytes: leased_bytes(End::Fail),
    streamed_bodies_dropped_are_charged_their_bytes: leased_bytes(End::Hang),
    grpc_bodies_finished_are_charged_their_messages: grpc_messages(End::Done),
    grpc_bodies_abandoned_are_charged_their_messages: grpc_messages(End::Fail),
    grpc_bodies_dropped_are_charged_their_messages: grpc_messages(End::Hang),
}

/// A streamed response's slot is free when it finishes, and its last grant is settled then
/// at the 1,400 bytes it used (the body dropped later changes nothing).
#[tokio::test(start_paused = true)]
async fn a_finished_streamed_response_frees_its_slot_and_settles_its_lease_at_its_end() {
    let layer = slot_and_units(Unit::ResponseBytes, tollgate::StreamMode::Shape);
    let svc = layer.layer(service_fn(|_req: Request<RequestBody<Empty<Bytes>>>| async {
        Ok::<_, Infallible>(Response::new(two_frames(Unit::ResponseBytes, End::Done)))
    }));
    let mut body = svc.oneshot(Request::new(Empty::new())).await.unwrap().into_body();
    read_two(&mut body, End::Done).await;
    assert_eq!(slot_and_bytes_left(&layer).await, [1, 998_600]);
    drop(body);
    assert_eq!(slot_and_bytes_left(&layer).await, [1, 998_600]);
}
