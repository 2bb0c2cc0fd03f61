//! A login guard: only failed logins count, five failures within 15 minutes block the client
//! for 15 minutes, and no rate-limit header tells an attacker how many guesses are left.
//!
//! ```sh
//! cargo run --example login_guard
//! ```
//!
//! It serves `POST /login` on an ephemeral 127.0.0.1 port, logs in from one client as a user
//! and as an attacker would, and prints each answer (and exits non-zero if one is not what the
//! guard promises).

use std::error::Error;
use std::net::SocketAddr;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use axum::{Router, routing::post};
use tollgate::{HeaderStyle, Penalty, Policy, Quota, RateLimitLayer};

/// The one account this demo knows.
const PASSWORD: &str = "correct horse battery staple";

async fn login(headers: HeaderMap) -> StatusCode {
    match headers.get("x-password").and_then(|v| v.to_str().ok()) {
        Some(PASSWORD) => StatusCode::OK,
        _ => StatusCode::UNAUTHORIZED,
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let fifteen_minutes = Duration::from_secs(15 * 60);
    // Five failures per client address within 15 minutes; the sixth blocks it for 15 minutes
    // (a penalty box: refused whatever it sends, the right password included).
    let policy = Policy::builder("login")
        .tier("failures", Quota::new(5, fifteen_minutes))
        .penalty("failures", Penalty::new(fifteen_minutes))
        .build()?;
    let guard = RateLimitLayer::builder(policy)
        // Only failures count: a successful login gives its charge back.
        .refund_if(|status| status.is_success())
        // No `RateLimit` fields: an attacker is not told how many guesses are left. A 429
        // still says `Retry-After`, for the user locked out.
        .headers(HeaderStyle::None)
        .build()?;
    let app = Router::new().route("/login", post(login)).route_layer(guard);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await
    });

    let client = http_client::Client::new(addr);
    println!("login guard on http://{addr}/login: 5 failures per 15 min, then blocked 15 min");
    for n in 1..=3 {
        let res = client.login(PASSWORD).await?;
        println!("login {n} with the right password: {} (not counted)", res.status);
        check(res.status == StatusCode::OK, "a successful login is let through")?;
    }
    for n in 1..=5 {
        let res = client.login("guess").await?;
        println!("guess {n}: {}", res.status);
        check(res.status == StatusCode::UNAUTHORIZED, "five failures are answered")?;
        check(!res.rate_limit_headers, "no rate-limit header tells what is left")?;
    }
    let res = client.login("guess").await?;
    println!("guess 6: {} (Retry-After: {} s)", res.status, res.retry_after.unwrap_or(0));
    check(res.status == StatusCode::TOO_MANY_REQUESTS, "the sixth failure is refused")?;
    check(res.retry_after == Some(900), "and the client is blocked for 15 minutes")?;
    let res = client.login(PASSWORD).await?;
    println!("the right password while blocked: {}", res.status);
    check(res.status == StatusCode::TOO_MANY_REQUESTS, "a blocked client is refused")?;
    check(!res.rate_limit_headers, "its refusal tells nothing of the quota")?;
    Ok(())
}

fn check(ok: bool, what: &str) -> Result<(), Box<dyn Error>> {
    if ok { Ok(()) } else { Err(format!("not as promised: {what}").into()) }
}

/// A small HTTP client over hyper for the demo.
mod http_client {
    use std::error::Error;
    use std::net::SocketAddr;

    use axum::http::StatusCode;
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use hyper_util::client::legacy::Client as Hyper;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;

    pub(crate) struct Client {
        addr: SocketAddr,
        hyper: Hyper<HttpConnector, Full<Bytes>>,
    }

    /// What the demo reads of an answer.
    pub(crate) struct Answer {
        pub(crate) status: StatusCode,
        pub(crate) retry_after: Option<u64>,
        pub(crate) rate_limit_headers: bool,
    }

    impl Client {
        pub(crate) fn new(addr: SocketAddr) -> Self {
            Self { addr, hyper: Hyper::builder(TokioExecutor::new()).build_http() }
        }

        pub(crate) async fn login(&self, password: &str) -> Result<Answer, Box<dyn Error>> {
            let req = http::Request::post(format!("http://{}/login", self.addr))
                .header("x-password", password)
                .body(Full::default())?;
            let res = self.hyper.request(req).await?;
            let headers = res.headers();
            let retry_after = headers
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok());
            let rate_limit_headers = headers.keys().any(|name| name.as_str().contains("ratelimit"));
            let status = res.status();
            res.into_body().collect().await?;
            Ok(Answer { status, retry_after, rate_limit_headers })
        }
    }
}
