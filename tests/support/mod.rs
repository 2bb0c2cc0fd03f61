//! Test harness: serve an axum app on an ephemeral loopback port and talk to it over real HTTP.
#![allow(dead_code, unreachable_pub)]

pub mod bodies;
pub mod config_files;
#[cfg(feature = "redis")]
pub mod lease;
pub mod logs;
pub mod penalty;
pub mod priority;
#[cfg(feature = "metrics")]
pub mod prometheus;
#[cfg(feature = "redis")]
pub mod redis;
pub mod seams;
pub mod seams_bounds;
pub mod seams_model;
pub mod stores;

use std::net::SocketAddr;

use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// A served app; the server task ends when this is dropped.
pub struct Server {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// Serves `app` on 127.0.0.1 with `ConnectInfo<SocketAddr>`.
pub async fn serve(app: Router) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let task = tokio::spawn(async move {
        axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
            .await
            .expect("serve");
    });
    Server { addr, task }
}

/// Serves `app` without `ConnectInfo` (so `PeerIp` finds no key).
pub async fn serve_without_connect_info(app: Router) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.expect("serve");
    });
    Server { addr, task }
}

/// Spawns the server `serve` makes of its shutdown signal: it serves until the sender returned
/// is dropped (or sent to); a server that fails fails its task with the error.
pub fn spawn_until_stopped<Fut, E>(
    serve: impl FnOnce(std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>) -> Fut,
) -> tokio::sync::oneshot::Sender<()>
where
    Fut: std::future::Future<Output = Result<(), E>> + Send + 'static,
    E: std::fmt::Debug,
{
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = serve(Box::pin(async {
        let _ = stopped.await;
    }));
    tokio::spawn(async move { serving.await.expect("serve") });
    stop
}

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A response read whole.
#[derive(Debug)]
pub struct Reply {
    pub status: http::StatusCode,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().expect("ascii header"))
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("json body")
    }
}

pub async fn send(client: &HttpClient, req: http::Request<Full<Bytes>>) -> Reply {
    let res = client.request(req).await.expect("request");
    let (head, body) = res.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    Reply { status: head.status, headers: head.headers, body }
}

pub async fn get(client: &HttpClient, url: &str, headers: &[(&str, &str)]) -> Reply {
    let mut req = http::Request::get(url);
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    send(client, req.body(Full::new(Bytes::new())).expect("request")).await
}

/// An inner service that answers `200 ok` to every request behind the layer.
#[derive(Clone, Copy, Debug)]
pub struct OkService;

impl tower::Service<http::Request<tollgate::RequestBody<axum::body::Body>>> for OkService {
    type Response = http::Response<axum::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Request<tollgate::RequestBody<axum::body::Body>>) -> Self::Future {
        std::future::ready(Ok(http::Response::new(axum::body::Body::from("ok"))))
    }
}

/// An [`OkService`].
pub fn ok_service() -> OkService {
    OkService
}

/// A limiter of `policy` on a memory store of its own, on `clock`.
pub fn memory_limiter(
    clock: &tollgate::clock::FakeClock,
    policy: tollgate::Policy,
) -> tollgate::Limiter {
    let store = tollgate::store::MemoryStore::builder().clock(clock.clone()).build().unwrap();
    tollgate::Limiter::with_store(policy, store).unwrap()
}

/// One hour past the fake clock's epoch (ns): where tests on a fake clock start.
pub const HOUR: u64 = 3_600_000_000_000;

/// A fake clock set to [`HOUR`].
pub fn clock_at_hour() -> tollgate::clock::FakeClock {
    let clock = tollgate::clock::FakeClock::new();
    clock.set(HOUR);
    clock
}

/// A memory store on `clock`.
pub fn memory_store(clock: &tollgate::clock::FakeClock) -> tollgate::store::MemoryStore {
    tollgate::store::MemoryStore::builder().clock(clock.clone()).build().unwrap()
}

/// [`memory_limiter`] for the scenarios written once over the store (`every_scenario`): a
/// limiter of each policy given, on `clock`.
pub fn memory_limiters(
    clock: &tollgate::clock::FakeClock,
) -> impl Fn(tollgate::Policy) -> std::future::Ready<tollgate::Limiter> {
    let clock = clock.clone();
    move |policy| std::future::ready(memory_limiter(&clock, policy))
}

/// Spawns `task(i)` for each `i` in `0..n` at once and waits for them all: their outputs, in
/// order (a task that panics fails the test).
pub async fn spawn_all<T, Fut>(n: usize, mut task: impl FnMut(usize) -> Fut) -> Vec<T>
where
    T: Send + 'static,
    Fut: std::future::Future<Output = T> + Send + 'static,
{
    let tasks: Vec<_> = (0..n).map(|i| tokio::spawn(task(i))).collect();
    let mut outputs = Vec::with_capacity(n);
    for t in tasks {
        outputs.push(t.await.expect("the task ends without a panic"));
    }
    outputs
}
