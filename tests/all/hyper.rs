//! A hyper server without axum: the layer over plain hyper, built with or without the `axum`
//! feature (`cargo test --no-default-features` runs it too). The peer address reaches
//! `PeerIp` as a `SocketAddr` request extension.
use crate::support;

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tollgate::{Policy, Quota, RateLimitLayer, RequestBody};
use tower::{Layer, ServiceBuilder, service_fn};

/// Serves `layer` over hyper on 127.0.0.1, handing each request its peer as a `SocketAddr`.
async fn serve(layer: RateLimitLayer) -> SocketAddr {
    serve_with(layer, true).await
}

/// Serves `layer` over hyper on 127.0.0.1; `with_peer`: hand each request its peer.
async fn serve_with(layer: RateLimitLayer, with_peer: bool) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, peer)) = listener.accept().await else { return };
            let handler = service_fn(|_req: Request<RequestBody<Incoming>>| async {
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"hello"))))
            });
            let svc = ServiceBuilder::new()
                .map_request(move |mut req: Request<Incoming>| {
                    if with_peer {
                        req.extensions_mut().insert(peer);
                    }
                    req
                })
                .service(layer.layer(handler));
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), TowerToHyperService::new(svc))
                    .await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_hyper_server_is_limited_per_peer_without_axum() {
    let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_minute(2)).unwrap())
        .build()
        .unwrap();
    let addr = serve(layer).await;
    let client = support::client();
    let url = format!("http://{addr}/");
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let reply = support::get(&client, &url, &[]).await;
        statuses.push(reply.status);
        if reply.status == StatusCode::OK {
            assert_eq!(&reply.body[..], b"hello");
        } else {
            assert_eq!(reply.header("retry-after"), Some("30"));
            assert_eq!(reply.header("content-type"), Some("application/problem+json"));
            assert_eq!(reply.json()["violated-policies"], serde_json::json!(["api"]));
        }
    }
    assert_eq!(statuses, [StatusCode::OK, StatusCode::OK, StatusCode::TOO_MANY_REQUESTS]);
}

#[tokio::test]
async fn a_hyper_server_that_forgets_the_peer_is_told_how_to_hand_it_over() {
    let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_minute(2)).unwrap())
        .explain_missing_key(true)
        .build()
        .unwrap();
    let addr = serve_with(layer, false).await;
    let reply = support::get(&support::client(), &format!("http://{addr}/"), &[]).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let detail = reply.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.contains("PeerIp found no key"), "{detail}");
    assert!(
        detail.contains(
            "hyper: `req.extensions_mut().insert(remote_addr)` in the service you give hyper \
             for each connection"
        ),
        "{detail}"
    );
}
