//! A tonic gRPC service with a per-method limit; a client that paces itself by the server's
//! `RateLimit` headers and is never refused, one that calls it until refused, and one that
//! retries the refused call after the server's pushback.
//!
//! The service is tonic-health's `grpc.health.v1.Health`; only its unary `Check` is limited
//! (5 per second per client address), its streaming `Watch` is not. Refused calls end with
//! `RESOURCE_EXHAUSTED` and the `grpc-retry-pushback-ms` of gRFC A6.
//!
//! ```sh
//! cargo run --example grpc --features tonic,client
//! ```

use std::error::Error;
use std::net::SocketAddr;

use std::time::Instant;

use tollgate::client::{PacingLayer, RetryPolicy};
use tollgate::key::GlobalKey;
use tollgate::{Policy, Quota, RateLimitLayer};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

const CHECK: &str = "/grpc.health.v1.Health/Check";

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    // Server: 5 `Check` calls per second per client address (tonic's `TcpConnectInfo`).
    let limit = RateLimitLayer::builder(Policy::single("health-check", Quota::per_second(5))?)
        .filter(|head| head.uri.path() == CHECK)
        .build()?;
    let (_reporter, health) = tonic_health::server::health_reporter();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        Server::builder().layer(limit).add_service(health).serve_with_incoming_shutdown(
            TcpIncoming::from(listener),
            async {
                let _ = stopped.await;
            },
        ),
    );
    println!("serving grpc.health.v1.Health on {addr}");

    // A paced client: the pacing layer reads each response's `RateLimit` header and holds the
    // next call until the server would accept it. One partition: this client has one server
    // (tonic's requests carry no authority above the channel).
    let paced = tower::ServiceBuilder::new()
        .layer(PacingLayer::with_partition(GlobalKey))
        .service(channel(addr).await?);
    let mut client = HealthClient::new(paced);
    let start = Instant::now();
    let mut refused = 0;
    for _ in 0..12 {
        if client.check(HealthCheckRequest { service: String::new() }).await.is_err() {
            refused += 1;
        }
    }
    println!(
        "paced client: 12 calls, {refused} refused, in {:.1?} (5/s, burst 5)",
        start.elapsed()
    );

    // An unpaced client: calls `Check` until it is refused.
    let mut client = HealthClient::new(channel(addr).await?);
    for call in 1.. {
        match client.check(HealthCheckRequest { service: String::new() }).await {
            Ok(res) => {
                let limit = res.metadata().get("ratelimit").map(|v| v.to_str()).transpose()?;
                println!(
                    "call {call}: {:?} (ratelimit: {})",
                    res.get_ref().status(),
                    limit.unwrap_or("-")
                );
            }
            Err(status) => {
                let pushback = status.metadata().get("grpc-retry-pushback-ms");
                let pushback = pushback.map(|v| v.to_str()).transpose()?.unwrap_or("none");
                println!(
                    "call {call}: refused: {:?} \"{}\"; retry in {pushback} ms",
                    status.code(),
                    status.message()
                );
                break;
            }
        }
    }

    // A retrying client: a tonic request's body cannot be cloned, so a retry layer around the
    // channel could not send it again; `RetryPolicy::call` makes the call again instead, after
    // the `grpc-retry-pushback-ms` of each `RESOURCE_EXHAUSTED`.
    // Right after the refusal above, on the same connection: the first call is refused too.
    let policy = RetryPolicy::<()>::builder().max_attempts(4).build()?;
    let start = Instant::now();
    let mut calls = 0;
    let reply = policy
        .call(|| {
            calls += 1;
            let mut client = client.clone();
            async move { client.check(HealthCheckRequest { service: String::new() }).await }
        })
        .await?;
    println!(
        "retrying client: {:?} after {calls} calls in {:.1?}",
        reply.get_ref().status(),
        start.elapsed()
    );

    let _ = stop.send(());
    server.await??;
    Ok(())
}

/// The channel the client calls through: client-side Tower layers wrap it here.
async fn channel(addr: SocketAddr) -> Result<Channel, tonic::transport::Error> {
    Endpoint::from_shared(format!("http://{addr}"))?.connect().await
}
