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
pub fn ok_service() -> impl tower::Service<
    http::Request<tollgate::RequestBody<axum::body::Body>>,
    Response = http::Response<axum::body::Body>,
    Error = std::convert::Infallible,
    Future: Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(|_req| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::from("ok")))
    })
}

/// A limiter of `policy` on a memory store of its own, on `clock`.
pub fn memory_limiter(
    clock: &tollgate::clock::FakeClock,
    policy: tollgate::Policy,
) -> tollgate::Limiter {
    let store = tollgate::store::MemoryStore::builder().clock(clock.clone()).build().unwrap();
    tollgate::Limiter::with_store(policy, store).unwrap()
}
