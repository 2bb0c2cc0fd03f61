//! Byte tiers metered as the body streams (`StreamMode::Shape`, `StreamMode::Police`), over
//! real HTTP/1.1 on loopback and in real time: chunked uploads of one key paced or stopped,
//! a download paced, an upload with a `Content-Length` charged at admission.
//!
//! These tests take real seconds (about 10 s each for the paced ones, run in parallel): the
//! rates are those of the use case (1 MB/s uploads, a 100 MB download at 10 MB/s).
//!
//! The apps are axum routers keyed by the peer address that axum's `ConnectInfo` gives: with
//! the `axum` feature only.
#![cfg(feature = "axum")]

use crate::support;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body as AxumBody;
use axum::extract::Request as AxumRequest;
use axum::routing::{get, post};
use bytes::Bytes;
use http::StatusCode;
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::serve;
use support::stores::in_memory;
use tollgate::store::Store;
use tollgate::{Policy, Quota, RateLimitLayer, StreamMode, Unit};

pub(crate) const MB: u64 = 1_000_000;

/// A body of `left` bytes in frames of `frame` bytes, each ready at once; its length is in
/// its size hint only when `sized` (else hyper sends it chunked).
pub(crate) struct Frames {
    left: u64,
    frame: Bytes,
    sized: bool,
    /// Nothing is sent before this fires.
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Frames {
    pub(crate) fn new(len: u64, frame: usize, sized: bool) -> Self {
        Self { left: len, frame: Bytes::from(vec![b'x'; frame]), sized, wait: None }
    }

    /// The same body, sent only after `delay` (so that an answer given at admission comes
    /// first).
    fn after(mut self, delay: Duration) -> Self {
        self.wait = Some(Box::pin(tokio::time::sleep(delay)));
        self
    }
}

support::bodies::body_of_frames!(
    Frames,
    Infallible,
    |this, cx| {
        if let Some(wait) = this.wait.as_mut() {
            if wait.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            this.wait = None;
        }
        if this.left == 0 {
            return Poll::Ready(None);
        }
        let len = (this.frame.len() as u64).min(this.left);
        this.left -= len;
        Poll::Ready(Some(Ok(Frame::data(this.frame.slice(..len as usize)))))
    },
    {
        fn is_end_stream(&self) -> bool {
            self.left == 0
        }

        fn size_hint(&self) -> SizeHint {
            if self.sized { SizeHint::with_exact(self.left) } else { SizeHint::default() }
        }
    }
);

/// What the upload handler read: per frame, when (since the test began) and how much.
pub(crate) type Log = Arc<Mutex<Vec<(Duration, u64)>>>;

/// An app storing uploads on `/upload`, reading them frame by frame into `log`, behind a
/// 1 MB/s (burst 1 MB) request-bytes tier of each client IP metered in `mode`.
fn upload_app<St: Store>(store: St, mode: StreamMode, log: &Log, start: Instant) -> Router {
    let policy = Policy::builder("upload")
        .tier("bytes", Quota::per_second(MB).counting(Unit::RequestBytes))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(policy).store(store).on_stream(mode).build().unwrap();
    uploads_behind(layer, log, start)
}

/// The app of [`upload_app`] behind `layer`.
pub(crate) fn uploads_behind<K, St>(
    layer: RateLimitLayer<K, St>,
    log: &Log,
    start: Instant,
) -> Router
where
    K: tollgate::key::KeyExtractor,
    St: Store,
{
    let log = Arc::clone(log);
    Router::new()
        .route(
            "/upload",
            post(move |req: AxumRequest| async move {
                let each = |len| log.lock().unwrap().push((start.elapsed(), len));
                let (read, whole) = read_frames(req, each).await;
                assert!(whole, "upload frame");
                read.to_string()
            }),
        )
        .layer(layer)
}

/// `POST url` of `len` bytes in frames of 16 KiB, its length in its size hint only when
/// `sized` (else sent chunked).
pub(crate) fn upload(url: &str, len: u64, sized: bool) -> http::Request<Frames> {
    http::Request::post(url).body(Frames::new(len, 16 * 1024, sized)).unwrap()
}

/// Sends `req` on a client of its own and asserts that the handler read it whole: `200`, and
/// the bytes it read as the answer.
pub(crate) async fn uploaded_whole(req: http::Request<Frames>) {
    let len = req.body().left;
    let client: Client<_, Frames> = Client::builder(TokioExecutor::new()).build_http();
    let res = client.request(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), len.to_string());
}

/// Reads the body of `req` frame by frame, telling `each` the length of every data frame,
/// until it ends or fails: the bytes read, and whether it ended without an error.
async fn read_frames(req: AxumRequest, mut each: impl FnMut(u64)) -> (u64, bool) {
    let mut body = req.into_body();
    let mut read = 0;
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else { return (read, false) };
        if let Ok(data) = frame.into_data() {
            read += data.len() as u64;
            each(data.len() as u64);
        }
    }
    (read, true)
}

/// Ten chunked uploads of 1 MB at once (frames of 16 KiB) to `url`: per upload, its status,
/// or `None` when the connection was cut before an answer. A refusal that stops an upload
/// mid-stream leaves the rest unread, so it must say `Connection: close`.
async fn ten_chunked_uploads(url: &str) -> Vec<Option<StatusCode>> {
    let client: Client<_, Frames> = Client::builder(TokioExecutor::new()).build_http();
    support::spawn_all(10, |_| {
        let client = client.clone();
        let req = upload(url, MB, false);
        async move {
            let res = client.request(req).await.ok()?;
            let status = res.status();
            if status == StatusCode::TOO_MANY_REQUESTS {
                let connection = res.headers().get(http::header::CONNECTION);
                assert_eq!(connection.map(|v| v.as_bytes()), Some(&b"close"[..]));
            }
            res.into_body().collect().await.ok()?;
            Some(status)
        }
    })
    .await
}

/// The bytes read by `until`, and whether at every read all reads so far were within
/// burst + rate x elapsed + one 64 KiB grant per stream (of ten).
fn read_by(log: &Log, until: Duration) -> u64 {
    let mut log = log.lock().unwrap().clone();
    log.sort_by_key(|(at, _)| *at);
    let mut read = 0;
    let mut by = 0;
    for (at, len) in log {
        read += len;
        let bound = MB + (MB as f64 * at.as_secs_f64()) as u64 + 10 * StreamMode::STREAM_GRANT;
        assert!(read <= bound, "{read} bytes read by {at:?}, beyond the bound {bound}");
        if at <= until {
            by = read;
        }
    }
    by
}

/// [`ten_chunked_uploads`] to [`upload_app`] on `store` metered in `mode`: what the handler
/// read, the statuses, and how long the uploads took.
async fn ten_chunked_uploads_on<St: Store>(
    store: St,
    mode: StreamMode,
) -> (Log, Vec<Option<StatusCode>>, Duration) {
    let log = Log::default();
    let start = Instant::now();
    let server = serve(upload_app(store, mode, &log, start)).await;
    let statuses = ten_chunked_uploads(&server.url("/upload")).await;
    (log, statuses, start.elapsed())
}

async fn shaping_paces_ten_chunked_uploads<St: Store>(store: St) {
    let (log, statuses, elapsed) = ten_chunked_uploads_on(store, StreamMode::Shape).await;
    assert_eq!(statuses, vec![Some(StatusCode::OK); 10]);
    assert_eq!(read_by(&log, elapsed), 10 * MB);
    // 10 MB against 1 MB/s with a burst of 1 MB: at least 9 s.
    assert!(elapsed >= Duration::from_millis(8_500), "ten uploads took {elapsed:?}");
    assert!(elapsed <= Duration::from_secs(12), "ten uploads took {elapsed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shaping_paces_ten_chunked_uploads_of_one_key() {
    shaping_paces_ten_chunked_uploads(tollgate::store::MemoryStore::new()).await;
}

async fn policing_stops_ten_chunked_uploads<St: Store>(store: St) {
    let (log, statuses, elapsed) = ten_chunked_uploads_on(store, StreamMode::Police).await;
    // The uploads are stopped mid-way: the layer answers 429 in the handler's place (or the
    // client, still sending, sees the connection closed after it). One is stored whole only
    // if the tier refilled enough meanwhile (a machine so loaded that the uploads took
    // seconds): never past the bound (which `read_by` checks at every read).
    assert!(statuses.contains(&Some(StatusCode::TOO_MANY_REQUESTS)), "{statuses:?}");
    let stored = statuses.iter().filter(|s| **s == Some(StatusCode::OK)).count() as u64;
    let bound = MB + (MB as f64 * elapsed.as_secs_f64()) as u64 + 10 * 16 * 1024;
    assert!(stored * MB <= bound, "{stored} stored in {elapsed:?}: {statuses:?}");
    read_by(&log, elapsed);
    assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policing_stops_ten_chunked_uploads_of_one_key() {
    policing_stops_ten_chunked_uploads(tollgate::store::MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policing_answers_429_with_retry_after_to_an_upload_past_the_tier() {
    let log = Log::default();
    let app =
        upload_app(tollgate::store::MemoryStore::new(), StreamMode::Police, &log, Instant::now());
    // Over HTTP/2: on HTTP/1.1 the server answers and closes the connection while the client
    // still sends, and the client may see the connection reset before it reads the answer.
    let (addr, _server) = serve_h2(app).await;
    let (mut send, _driver) = h2_connection(addr).await;
    // 2 MB chunked, in frames the server reads one grant at a time: refused after the 1 MB
    // burst, before the handler could answer.
    let req = upload(&format!("http://{addr}/upload"), 2 * MB, false);
    let res = send.send_request(req).await.expect("an answer before the upload ends");
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(res.headers().contains_key("retry-after"));
    // Within the bound (what refilled while it streamed, and less than a frame past it).
    read_by(&log, Duration::MAX);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_with_a_content_length_is_charged_at_admission() {
    let log = Log::default();
    let server = serve(upload_app(
        tollgate::store::MemoryStore::new(),
        StreamMode::Police,
        &log,
        Instant::now(),
    ))
    .await;
    let client: Client<_, Frames> = Client::builder(TokioExecutor::new()).build_http();
    let upload = |delay| {
        http::Request::post(server.url("/upload"))
            .header("content-length", 600_000)
            .body(Frames::new(600_000, 16 * 1024, true).after(delay))
            .unwrap()
    };
    let first = client.request(upload(Duration::ZERO)).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(first.into_body().collect().await.unwrap().to_bytes(), "600000");
    // 600,000 of the 1 MB burst were charged at admission: the next 600,000 are refused
    // before a byte is read, as without streaming.
    let second = client.request(upload(Duration::from_secs(5))).await.unwrap();
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    let read: u64 = log.lock().unwrap().iter().map(|(_, len)| len).sum();
    assert_eq!(read, 600_000);
}

/// A chunked upload of 200,000 bytes against a slow tier (burst 1 MB, 10 MB an hour) is
/// charged exactly its bytes: its grants took 4 x 64 KiB, and the part of the last one it did
/// not use came back when the body ended.
async fn an_upload_is_charged_exactly_its_bytes<St: Store>(store: St) {
    let policy = Policy::builder("slow-upload")
        .tier("bytes", Quota::per_hour(10 * MB).with_burst(MB).counting(Unit::RequestBytes))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(policy)
        .key(tollgate::key::GlobalKey)
        .store(store)
        .on_stream(StreamMode::Police)
        .build()
        .unwrap();
    let limiter = layer.limiter().clone();
    let app = Router::new()
        .route("/upload", post(|body: Bytes| async move { body.len().to_string() }))
        .layer(layer);
    let server = serve(app).await;
    let start = Instant::now();
    uploaded_whole(upload(&server.url("/upload"), 200_000, false)).await;
    // The settlement of the last grant may still be on its way to a remote store.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let left = limiter.check(&tollgate::key::Key::Global, 0).await.unwrap().tiers()[0].remaining();
    // 2,778 bytes a second refill meanwhile.
    let refilled = (2_778.0 * start.elapsed().as_secs_f64()).ceil() as u64;
    assert!(
        (MB - 200_000..=MB - 200_000 + refilled).contains(&left),
        "{left} bytes left (4 grants kept whole would leave {})",
        MB - 4 * StreamMode::STREAM_GRANT
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_is_charged_exactly_its_bytes_in_memory() {
    an_upload_is_charged_exactly_its_bytes(tollgate::store::MemoryStore::new()).await;
}

/// A 100 MB download shaped to 10 MB/s (burst one grant) takes at least 9.5 s: never faster
/// than the rate. And not grossly slower: at most 15 s plus the time the same download takes
/// unlimited on this machine now (charging each grant twice would take 20 s). The slack is
/// lateness the burst cannot make up for: with a burst of one grant, each of the 1,600 grants
/// that starts late (a timer's millisecond, a store round trip on a loaded machine) loses
/// that time, which a loaded 2-core machine puts at up to 1.5 s.
async fn shaped_download<St: Store>(store: St) {
    let policy = Policy::builder("download")
        .tier(
            "bytes",
            Quota::per_second(10 * MB)
                .with_burst(StreamMode::STREAM_GRANT)
                .counting(Unit::ResponseBytes),
        )
        .build()
        .unwrap();
    let layer =
        RateLimitLayer::builder(policy).store(store).on_stream(StreamMode::Shape).build().unwrap();
    let route = Router::new()
        .route("/file", get(|| async { AxumBody::new(Frames::new(100 * MB, 256 * 1024, true)) }));
    let unlimited = serve(route.clone()).await;
    let (read, transfer) = download(&unlimited.url("/file")).await;
    assert_eq!(read, 100 * MB);
    let server = serve(route.layer(layer)).await;
    let (read, elapsed) = download(&server.url("/file")).await;
    assert_eq!(read, 100 * MB);
    assert!(
        elapsed >= Duration::from_millis(9_500) && elapsed <= Duration::from_secs(15) + transfer,
        "100 MB at 10 MB/s took {elapsed:?} (unlimited: {transfer:?})"
    );
}

/// Downloads `url`: the bytes read and the time it took.
async fn download(url: &str) -> (u64, Duration) {
    let client: Client<_, AxumBody> = Client::builder(TokioExecutor::new()).build_http();
    let start = Instant::now();
    let res = client.get(url.parse().unwrap()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let mut body = res.into_body();
    let mut read = 0;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            read += data.len() as u64;
        }
    }
    (read, start.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mb_download_shaped_to_10_mb_per_second_takes_10_s() {
    shaped_download(tollgate::store::MemoryStore::new()).await;
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use crate::support::stores::redis::server;

    support::stores::store_tests! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        shaping_paces_ten_chunked_uploads_of_one_key_on_redis: shaping_paces_ten_chunked_uploads(server("redis-server", "shape:"));
        policing_stops_ten_chunked_uploads_of_one_key_on_redis: policing_stops_ten_chunked_uploads(server("redis-server", "police:"));
        an_upload_is_charged_exactly_its_bytes_on_redis: an_upload_is_charged_exactly_its_bytes(server("redis-server", "exact:"));
        a_100_mb_download_shaped_to_10_mb_per_second_takes_10_s_on_redis: shaped_download(server("redis-server", "download:"));
    }
}

// Concurrency while streams are paused or stopped: one request in flight (a concurrency tier
// of 1) beside a byte tier, on a store whose clock stands still, so that the bytes charged
// can be read back exactly.

/// The byte tier's burst: three grants and 20,000 bytes, so that a shaped stream pauses after
/// three grants (the fourth does not fit), with room for the part of a frame past them.
const BURST: u64 = 3 * StreamMode::STREAM_GRANT + 20_000;

/// One request in flight of the one key, and a byte tier of `unit`: a burst of [`BURST`]
/// bytes, refilled at 1,000 bytes a second (on a frozen clock: never).
fn one_in_flight(unit: Unit) -> Policy {
    Policy::builder("one-stream")
        .concurrency("in-flight", tollgate::Concurrency::new(1))
        .tier("bytes", Quota::per_second(1_000).with_burst(BURST).counting(unit))
        .build()
        .unwrap()
}

/// The free slots of the concurrency tier, and the bytes the byte tier has charged: from
/// what it has left, or, past its burst, from the wait for one more byte (1 ms a byte).
async fn slots_and_charged<St: Store>(limiter: &tollgate::Limiter<St>) -> (u64, u64) {
    let key = tollgate::key::Key::Global;
    let peek = limiter.check(&key, 0).await.unwrap();
    let (slots, left) = (peek.tiers()[0].remaining(), peek.tiers()[1].remaining());
    if left > 0 || slots == 0 {
        return (slots, BURST - left);
    }
    // One byte (and a slot, given back at once) asked for: refused by the byte tier alone.
    let one = limiter.check(&key, 1).await.unwrap();
    let wait = one.tiers()[1].retry_after().expect("the byte tier refuses");
    assert_eq!(wait.subsec_nanos() % 1_000_000, 0, "{wait:?}");
    (slots, BURST + wait.as_millis() as u64 - 1)
}

/// Waits until `done` says so, or 10 s (the assertions that follow then say what is
/// missing).
async fn until<F: Future<Output = bool>>(what: &str, mut done: impl FnMut() -> F) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done().await {
        if Instant::now() > deadline {
            eprintln!("gave up waiting for {what}");
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// An app with `/upload` (reads the body, adding what it read to `read`), `/file` (a 1 MB
/// response in frames of 16 KiB) and `/ping`, behind `layer`.
fn paused_app<St: Store>(
    layer: RateLimitLayer<tollgate::key::GlobalKey, St>,
    read: &Arc<std::sync::atomic::AtomicU64>,
) -> Router {
    let read = Arc::clone(read);
    Router::new()
        .route(
            "/upload",
            post(move |req: AxumRequest| async move {
                // A client that went away ends the body with an error: the handler stops.
                let each = |len| {
                    read.fetch_add(len, std::sync::atomic::Ordering::SeqCst);
                };
                read_frames(req, each).await;
                "stored"
            }),
        )
        .route("/file", get(|| async { AxumBody::new(Frames::new(MB, 16 * 1024, false)) }))
        .route("/ping", get(|| async { "pong" }))
        .layer(layer)
}

fn paused_layer<St: Store>(
    unit: Unit,
    mode: StreamMode,
    store: St,
) -> RateLimitLayer<tollgate::key::GlobalKey, St> {
    RateLimitLayer::builder(one_in_flight(unit))
        .key(tollgate::key::GlobalKey)
        .store(store)
        .on_stream(mode)
        .build()
        .unwrap()
}

/// The status of a `GET /ping` of the same key.
async fn ping(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Frames>,
    server: &support::Server,
) -> StatusCode {
    let req = http::Request::get(server.url("/ping")).body(Frames::new(0, 1, true)).unwrap();
    client.request(req).await.unwrap().status()
}

/// A task serving connections, aborted when this is dropped.
struct Serving(tokio::task::JoinHandle<()>);

impl Drop for Serving {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves `app` over HTTP/2 (prior knowledge) on 127.0.0.1: the address, and the task
/// accepting connections (aborted when the test ends).
async fn serve_h2(app: Router) -> (std::net::SocketAddr, Serving) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let task = tokio::spawn(async move {
        loop {
            let (stream, peer) = listener.accept().await.expect("accept");
            // The peer's address, as `into_make_service_with_connect_info` records it.
            let app = app.clone().layer(axum::extract::connect_info::MockConnectInfo(peer));
            let service = hyper_util::service::TowerToHyperService::new(app);
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service),
            );
        }
    });
    (addr, Serving(task))
}

/// A chunked upload of 10 MB over HTTP/2 to `addr`, on a connection of its own: the client
/// goes away (its connection closed) when the task is aborted.
fn h2_upload(addr: std::net::SocketAddr) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let (mut send, driver) = h2_connection(addr).await;
        let req = upload(&format!("http://{addr}/upload"), 10 * MB, false);
        // Paused: no answer comes before the task is aborted.
        let _ = send.send_request(req).await;
        driver.abort();
    })
}

/// An HTTP/2 connection (prior knowledge) to `addr`: its sender, and the task driving it.
async fn h2_connection(
    addr: std::net::SocketAddr,
) -> (
    hyper::client::conn::http2::SendRequest<Frames>,
    tokio::task::JoinHandle<Result<(), hyper::Error>>,
) {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .expect("handshake");
    (send, tokio::spawn(conn))
}

/// A chunked upload paused by shaping (its grants took the burst; the clock is frozen)
/// holds its slot: the key's next request is refused. The client goes away (its HTTP/2 connection closed): the
/// slot comes back, and the tier is charged exactly the bytes the handler read.
async fn a_paused_upload_holds_its_slot_until_the_client_goes<St: Store>(store: St) {
    let layer = paused_layer(Unit::RequestBytes, StreamMode::Shape, store);
    let limiter = layer.limiter().clone();
    let read = Arc::default();
    let app = paused_app(layer, &read);
    let (addr, _server) = serve_h2(app.clone()).await;
    let server = serve(app).await;
    let client: Client<_, Frames> = Client::builder(TokioExecutor::new()).build_http();
    let upload = h2_upload(addr);
    let read_now = || read.load(std::sync::atomic::Ordering::SeqCst);
    until("three grants read", || async { read_now() >= 3 * StreamMode::STREAM_GRANT }).await;
    // Paused, in flight: the one slot is taken.
    assert_eq!(ping(&client, &server).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(slots_and_charged(&limiter).await.0, 0);
    upload.abort();
    assert!(upload.await.unwrap_err().is_cancelled());
    until("the slot back", || async { slots_and_charged(&limiter).await == (1, read_now()) }).await;
    assert_eq!(slots_and_charged(&limiter).await, (1, read_now()));
    // The burst, and less than a frame past it.
    assert!((BURST..BURST + 16 * 1024).contains(&read_now()), "{}", read_now());
    assert_eq!(ping(&client, &server).await, StatusCode::OK);
}

/// A download paused by shaping (cut where its grants took the burst) holds its slot; the
/// client drops the body: the slot comes back, and the tier is charged exactly the burst.
async fn a_paused_download_holds_its_slot_until_the_client_goes<St: Store>(store: St) {
    let layer = paused_layer(Unit::ResponseBytes, StreamMode::Shape, store);
    let limiter = layer.limiter().clone();
    let server = serve(paused_app(layer, &Arc::default())).await;
    let client: Client<_, Frames> = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::get(server.url("/file")).body(Frames::new(0, 1, true)).unwrap();
    let res = client.request(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let mut body = res.into_body();
    let mut came = 0;
    while came < BURST {
        came += body.frame().await.unwrap().unwrap().into_data().unwrap().len() as u64;
    }
    assert_eq!(came, BURST);
    assert_eq!(ping(&client, &server).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(slots_and_charged(&limiter).await, (0, BURST));
    drop(body);
    until("the slot back", || async { slots_and_charged(&limiter).await.0 == 1 }).await;
    assert_eq!(slots_and_charged(&limiter).await, (1, BURST));
    assert_eq!(ping(&client, &server).await, StatusCode::OK);
}

/// A chunked upload stopped by policing (the layer answers 429 in its handler's place) gives
/// its slot back, and the tier is charged exactly the bytes the handler read (the part of the
/// last frame past the burst is owed).
async fn a_policed_upload_gives_its_slot_back_when_stopped<St: Store>(store: St) {
    let layer = paused_layer(Unit::RequestBytes, StreamMode::Police, store);
    let limiter = layer.limiter().clone();
    let read = Arc::default();
    let server = serve(paused_app(layer, &read)).await;
    let client: Client<_, Frames> = Client::builder(TokioExecutor::new()).build_http();
    let req = upload(&server.url("/upload"), MB, false);
    // The layer answers 429 and closes the connection; the client, still sending, may see
    // the connection closed before it reads the answer.
    if let Ok(res) = client.request(req).await {
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    }
    let read = read.load(std::sync::atomic::Ordering::SeqCst);
    until("the grant settled", || async { slots_and_charged(&limiter).await == (1, read) }).await;
    assert_eq!(slots_and_charged(&limiter).await, (1, read));
    // The burst whole, and less than a frame past it.
    assert!((BURST..BURST + 16 * 1024).contains(&read), "{read}");
}

/// Over HTTP/1.1 a paused upload is not read, so the server cannot see its client go away; a
/// request timeout outside the layer ends it: the slot comes back, and the tier is charged
/// exactly the bytes the handler read.
async fn a_timeout_ends_a_paused_http1_upload<St: Store>(store: St) {
    use axum::response::IntoResponse;
    let layer = paused_layer(Unit::RequestBytes, StreamMode::Shape, store);
    let limiter = layer.limiter().clone();
    let read = Arc::default();
    let timeout = tower::util::MapFutureLayer::new(
        |call: axum::routing::future::RouteFuture<Infallible>| async move {
            let timed = tokio::time::timeout(Duration::from_secs(2), call).await;
            timed.unwrap_or_else(|_| Ok(StatusCode::REQUEST_TIMEOUT.into_response()))
        },
    );
    let server = serve(paused_app(layer, &read).layer(timeout)).await;
    let client: Client<_, Frames> = Client::builder(TokioExecutor::new()).build_http();
    let req = upload(&server.url("/upload"), 10 * MB, false);
    let res = client.request(req).await.expect("the timeout answers");
    assert_eq!(res.status(), StatusCode::REQUEST_TIMEOUT);
    let read = read.load(std::sync::atomic::Ordering::SeqCst);
    until("the slot back", || async { slots_and_charged(&limiter).await == (1, read) }).await;
    assert_eq!(slots_and_charged(&limiter).await, (1, read));
    // The burst, and less than a frame past it.
    assert!((BURST..BURST + 16 * 1024).contains(&read), "{read}");
}

support::stores::store_tests! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    a_paused_upload_holds_its_slot_until_the_client_goes_in_memory: a_paused_upload_holds_its_slot_until_the_client_goes(in_memory());
    a_paused_download_holds_its_slot_until_the_client_goes_in_memory: a_paused_download_holds_its_slot_until_the_client_goes(in_memory());
    a_timeout_ends_a_paused_http1_upload_in_memory: a_timeout_ends_a_paused_http1_upload(in_memory());
    a_policed_upload_gives_its_slot_back_when_stopped_in_memory: a_policed_upload_gives_its_slot_back_when_stopped(in_memory());
}

#[cfg(feature = "redis")]
mod paused_on_redis {
    use super::*;

    support::stores::store_tests! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        a_paused_upload_holds_its_slot_until_the_client_goes("up:"): a_paused_upload_holds_its_slot_until_the_client_goes_on_redis, a_paused_upload_holds_its_slot_until_the_client_goes_on_valkey;
        a_paused_download_holds_its_slot_until_the_client_goes("down:"): a_paused_download_holds_its_slot_until_the_client_goes_on_redis, a_paused_download_holds_its_slot_until_the_client_goes_on_valkey;
        a_timeout_ends_a_paused_http1_upload("timeout:"): a_timeout_ends_a_paused_http1_upload_on_redis, a_timeout_ends_a_paused_http1_upload_on_valkey;
        a_policed_upload_gives_its_slot_back_when_stopped("police:"): a_policed_upload_gives_its_slot_back_when_stopped_on_redis, a_policed_upload_gives_its_slot_back_when_stopped_on_valkey;
    }

    support::stores::store_tests! {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        paused_and_stopped_streams_hold_and_give_back_their_slots_on_a_cluster: on_a_cluster[a_paused_upload_holds_its_slot_until_the_client_goes("up:"), a_paused_download_holds_its_slot_until_the_client_goes("down:"), a_timeout_ends_a_paused_http1_upload("timeout:"), a_policed_upload_gives_its_slot_back_when_stopped("police:")];
    }
}
