//! The smallest axum app with a per-IP limit, on 127.0.0.1:3000.
//!
//! Run: `cargo run --example quickstart`, then `curl -i http://127.0.0.1:3000/` a few times.

use std::net::SocketAddr;

use axum::{Router, routing::get};
use tollgate::{Policy, Quota, RateLimitLayer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // 5 requests per second per client IP, burst 5.
    let policy = Policy::single("per-ip", Quota::per_second(5))?;
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .layer(RateLimitLayer::builder(policy).build()?);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("listening on http://127.0.0.1:3000");
    axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
    Ok(())
}
