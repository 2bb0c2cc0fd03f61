//! Two app instances, one limit: both serve the same axum app on their own loopback port, each
//! with its own `RedisStore` connected to one Redis, and are driven alternately with real HTTP
//! requests. The fleet admits the policy's quota once, not once per instance. Then Redis is
//! killed: the instances fall back to local limits and the circuit breaker opens.
//!
//! Run: `cargo run --example redis --features redis`
//!
//! With `REDIS_URL` set (e.g. `redis://127.0.0.1:6380/`) it uses that server and skips the
//! outage part; otherwise it starts a throw-away `redis-server` (which must be on `PATH`) on a
//! free 127.0.0.1 port with `--save ""` and kills it at the end.

#[path = "common/redis_server.rs"]
mod redis_server;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::{Router, routing::get};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate::key::GlobalKey;
use tollgate::store::{MemoryStore, RedisStore};
use tollgate::{Policy, Quota, RateLimitLayer};

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// One app instance: its own store (own connection, breaker and fallback), same policy.
async fn instance(
    url: &str,
    policy: &Policy,
) -> Result<(SocketAddr, RedisStore), Box<dyn std::error::Error>> {
    let store = RedisStore::builder(url)
        .timeout(Duration::from_millis(100))
        .circuit_breaker(3, Duration::from_millis(500))
        .fallback(MemoryStore::new())
        .build()?;
    store.connect().await?;
    let layer =
        RateLimitLayer::builder(policy.clone()).key(GlobalKey).store(store.clone()).build()?;
    let app = Router::new().route("/", get(|| async { "hello" })).layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((addr, store))
}

async fn get_status(client: &HttpClient, addr: SocketAddr) -> (http::StatusCode, String) {
    let req = http::Request::get(format!("http://{addr}/")).body(Full::new(Bytes::new()));
    match client.request(req.expect("request")).await {
        Ok(res) => {
            let rl = res.headers().get("ratelimit").and_then(|v| v.to_str().ok());
            (res.status(), rl.unwrap_or("-").to_owned())
        }
        Err(e) => (http::StatusCode::BAD_GATEWAY, e.to_string()),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut server, url) = match std::env::var("REDIS_URL") {
        Ok(url) => (None, url),
        Err(_) => {
            // Without `REDIS_URL`, a throw-away server (`redis-server` on `PATH`).
            let (server, url) = redis_server::start_redis()?;
            (Some(server), url)
        }
    };
    println!("redis: {url}");
    // One limit for the whole fleet: 20 requests per minute, all clients together.
    let policy = Policy::single("fleet", Quota::per_minute(20))?;
    let (a, store_a) = instance(&url, &policy).await?;
    let (b, _store_b) = instance(&url, &policy).await?;
    println!("instance A on http://{a}/, instance B on http://{b}/, both limited by {url}");

    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let mut allowed = [0usize; 2];
    let mut limited = [0usize; 2];
    for i in 0..60 {
        let which = i % 2;
        let (status, ratelimit) = get_status(&client, [a, b][which]).await;
        if status.is_success() {
            allowed[which] += 1;
        } else {
            limited[which] += 1;
        }
        if i < 2 || (18..=21).contains(&i) {
            println!("  request {i:>2} to {}: {status}  RateLimit: {ratelimit}", ["A", "B"][which]);
        }
    }
    println!("== 60 requests alternating over two instances, quota 20 per minute for the fleet");
    println!("   instance A: allowed {:>2}  limited {:>2}", allowed[0], limited[0]);
    println!("   instance B: allowed {:>2}  limited {:>2}", allowed[1], limited[1]);
    println!(
        "   fleet:      allowed {:>2}  (with a MemoryStore each it would be 40)",
        allowed[0] + allowed[1]
    );

    if let Some(redis) = server.take() {
        drop(redis); // kills it
        println!("== redis killed: instance A decides locally, and its breaker opens");
        for i in 0..6 {
            let started = Instant::now();
            let (status, ratelimit) = get_status(&client, a).await;
            println!(
                "  request {i} to A: {status} in {:>6.1?}  RateLimit: {ratelimit}  breaker: {:?}",
                started.elapsed(),
                store_a.breaker_state()
            );
        }
    }
    Ok(())
}
