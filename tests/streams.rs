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

mod support;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body as AxumBody;
use axum::extract::Request as AxumRequest;
use axum::routing::{get, post};
use bytes::Bytes;
use http::StatusCode;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::serve;
use tollgate::store::Store;
use tollgate::{Policy, Quota, RateLimitLayer, STREAM_LEASE, StreamMode, Unit};

const MB: u64 = 1_000_000;

/// A body of `left` bytes in frames of `frame` bytes, each ready at once; its length is in
/// its size hint only when `sized` (else hyper sends it chunked).
struct Frames {
    left: u64,
    frame: Bytes,
    sized: bool,
    /// Nothing is sent before this fires.
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Frames {
    fn new(len: u64, frame: usize, sized: bool) -> Self {
        Self { left: len, frame: Bytes::from(vec![b'x'; frame]), sized, wait: None }
    }

    /// The same body, sent only after `delay` (so that an answer given at admission comes
    /// first).
    fn after(mut self, delay: Duration) -> Self {
        self.wait = Some(Box::pin(tokio::time::sleep(delay)));
        self
    }
}

impl Body for Frames {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if let Some(wait) = self.wait.as_mut() {
            if wait.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.wait = None;
        }
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let len = (self.frame.len() as u64).min(self.left);
        self.left -= len;
        Poll::Ready(Some(Ok(Frame::data(self.frame.slice(..len as usize)))))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }

    fn size_hint(&self) -> SizeHint {
        if self.sized { SizeHint::with_exact(self.left) } else { SizeHint::default() }
    }
}

/// What the upload handler read: per frame, when (since the test began) and how much.
type Log = Arc<Mutex<Vec<(Duration, u64)>>>;

/// An app storing uploads on `/upload`, reading them frame by frame into `log`, behind a
/// 1 MB/s (burst 1 MB) request-bytes tier of each client IP metered in `mode`.
fn upload_app<St: Store>(store: St, mode: StreamMode, log: &Log, start: Instant) -> Router {
    let policy = Policy::builder("upload")
        .tier("bytes", Quota::per_second(MB).counting(Unit::RequestBytes))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(policy).store(store).on_stream(mode).build().unwrap();
    let log = Arc::clone(log);
    Router::new()
        .route(
            "/upload",
            post(move |req: AxumRequest| async move {
                let mut body = req.into_body();
                let mut read = 0;
                while let Some(frame) = body.frame().await {
                    let Ok(data) = frame.expect("upload frame").into_data() else { continue };
                    read += data.len();
                    log.lock().unwrap().push((start.elapsed(), data.len() as u64));
                }
                read.to_string()
            }),
        )
        .layer(layer)
}

/// Ten chunked uploads of 1 MB at once (frames of 16 KiB) to `url`: per upload, its status,
/// or `None` when the connection was cut before an answer.
async fn ten_chunked_uploads(url: &str) -> Vec<Option<StatusCode>> {
    let client: Client<_, Frames> = Client::builder(TokioExecutor::new()).build_http();
    let uploads: Vec<_> = (0..10)
        .map(|_| {
            let client = client.clone();
            let req = http::Request::post(url).body(Frames::new(MB, 16 * 1024, false)).unwrap();
            tokio::spawn(async move {
                let res = client.request(req).await.ok()?;
                let status = res.status();
                res.into_body().collect().await.ok()?;
                Some(status)
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for upload in uploads {
        statuses.push(upload.await.unwrap());
    }
    statuses
}

/// The bytes read by `until`, and whether at every read all reads so far were within
/// burst + rate x elapsed + one 64 KiB lease per stream (of ten).
fn read_by(log: &Log, until: Duration) -> u64 {
    let mut log = log.lock().unwrap().clone();
    log.sort_by_key(|(at, _)| *at);
    let mut read = 0;
    let mut by = 0;
    for (at, len) in log {
        read += len;
        let bound = MB + (MB as f64 * at.as_secs_f64()) as u64 + 10 * STREAM_LEASE;
        assert!(read <= bound, "{read} bytes read by {at:?}, beyond the bound {bound}");
        if at <= until {
            by = read;
        }
    }
    by
}

async fn shaping_paces_ten_chunked_uploads<St: Store>(store: St) {
    let log = Log::default();
    let start = Instant::now();
    let server = serve(upload_app(store, StreamMode::Shape, &log, start)).await;
    let statuses = ten_chunked_uploads(&server.url("/upload")).await;
    let elapsed = start.elapsed();
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
    let log = Log::default();
    let start = Instant::now();
    let server = serve(upload_app(store, StreamMode::Police, &log, start)).await;
    let statuses = ten_chunked_uploads(&server.url("/upload")).await;
    let elapsed = start.elapsed();
    // Each upload is stopped mid-way: the layer answers 429 in the handler's place (or the
    // client, still sending, sees the connection closed after it); none is stored.
    assert!(!statuses.contains(&Some(StatusCode::OK)), "{statuses:?}");
    assert!(statuses.contains(&Some(StatusCode::TOO_MANY_REQUESTS)), "{statuses:?}");
    let first_second = read_by(&log, Duration::from_secs(1));
    assert!(first_second <= 1_250_000, "{first_second} bytes read in the first second");
    assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policing_stops_ten_chunked_uploads_of_one_key() {
    policing_stops_ten_chunked_uploads(tollgate::store::MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policing_answers_429_with_retry_after_to_an_upload_past_the_tier() {
    let log = Log::default();
    let server = serve(upload_app(
        tollgate::store::MemoryStore::new(),
        StreamMode::Police,
        &log,
        Instant::now(),
    ))
    .await;
    let client: Client<_, Frames> = Client::builder(TokioExecutor::new()).build_http();
    // 2 MB chunked, in frames the server reads one lease at a time: refused after the 1 MB
    // burst, before the handler could answer.
    let req = http::Request::post(server.url("/upload"))
        .body(Frames::new(2 * MB, 16 * 1024, false))
        .unwrap();
    let res = client.request(req).await.expect("an answer before the upload ends");
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
/// charged exactly its bytes: its leases took 4 x 64 KiB, and the part of the last one it did
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
    let client: Client<_, Frames> = Client::builder(TokioExecutor::new()).build_http();
    let start = Instant::now();
    let req = http::Request::post(server.url("/upload"))
        .body(Frames::new(200_000, 16 * 1024, false))
        .unwrap();
    let res = client.request(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "200000");
    // The settlement of the last lease may still be on its way to a remote store.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let left = limiter.check(&tollgate::key::Key::Global, 0).await.unwrap().tiers()[0].remaining();
    // 2,778 bytes a second refill meanwhile.
    let refilled = (2_778.0 * start.elapsed().as_secs_f64()).ceil() as u64;
    assert!(
        (MB - 200_000..=MB - 200_000 + refilled).contains(&left),
        "{left} bytes left (4 leases kept whole would leave {})",
        MB - 4 * STREAM_LEASE
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_is_charged_exactly_its_bytes_in_memory() {
    an_upload_is_charged_exactly_its_bytes(tollgate::store::MemoryStore::new()).await;
}

/// A 100 MB download shaped to 10 MB/s (burst one lease) arrives in 10 s ± 5 %.
async fn shaped_download<St: Store>(store: St) {
    let policy = Policy::builder("download")
        .tier(
            "bytes",
            Quota::per_second(10 * MB).with_burst(STREAM_LEASE).counting(Unit::ResponseBytes),
        )
        .build()
        .unwrap();
    let layer =
        RateLimitLayer::builder(policy).store(store).on_stream(StreamMode::Shape).build().unwrap();
    let app = Router::new()
        .route("/file", get(|| async { AxumBody::new(Frames::new(100 * MB, 256 * 1024, true)) }))
        .layer(layer);
    let server = serve(app).await;
    let client: Client<_, AxumBody> = Client::builder(TokioExecutor::new()).build_http();
    let start = Instant::now();
    let res = client.get(server.url("/file").parse().unwrap()).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let mut body = res.into_body();
    let mut read = 0;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            read += data.len() as u64;
        }
    }
    let elapsed = start.elapsed();
    assert_eq!(read, 100 * MB);
    assert!(
        elapsed >= Duration::from_millis(9_500) && elapsed <= Duration::from_millis(10_500),
        "100 MB at 10 MB/s took {elapsed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100_mb_download_shaped_to_10_mb_per_second_takes_10_s() {
    shaped_download(tollgate::store::MemoryStore::new()).await;
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use tollgate::store::RedisStore;

    fn store(url: &str, prefix: &str) -> RedisStore {
        RedisStore::builder(url).prefix(prefix).timeout(Duration::from_secs(5)).build().unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shaping_paces_ten_chunked_uploads_of_one_key_on_redis() {
        let Some(server) = support::redis::Server::start("redis-server") else { return };
        shaping_paces_ten_chunked_uploads(store(&server.url(), "shape:")).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn policing_stops_ten_chunked_uploads_of_one_key_on_redis() {
        let Some(server) = support::redis::Server::start("redis-server") else { return };
        policing_stops_ten_chunked_uploads(store(&server.url(), "police:")).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_upload_is_charged_exactly_its_bytes_on_redis() {
        let Some(server) = support::redis::Server::start("redis-server") else { return };
        an_upload_is_charged_exactly_its_bytes(store(&server.url(), "exact:")).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_100_mb_download_shaped_to_10_mb_per_second_takes_10_s_on_redis() {
        let Some(server) = support::redis::Server::start("redis-server") else { return };
        shaped_download(store(&server.url(), "download:")).await;
    }
}
