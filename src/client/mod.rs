//! The client side: calling a rate-limited service without being refused, and retrying when
//! refused anyway.
//!
//! - [`PacingLayer`] reads what each response says about the server's limits (the IETF
//!   `RateLimit` / `RateLimit-Policy` fields of draft-ietf-httpapi-ratelimit-headers-10, the
//!   common `X-RateLimit-*` fields, a 429's `Retry-After`) and holds the next request until the
//!   server would accept it, per partition (by default, per server).
//! - [`RetryPolicy`] is a [`tower::retry::Policy`] that retries 429, 503 and gRPC
//!   `RESOURCE_EXHAUSTED` / `UNAVAILABLE` with capped exponential backoff and full jitter,
//!   never sooner than the server's `Retry-After` (RFC 9110 §10.2.3) or
//!   `grpc-retry-pushback-ms` (gRFC A6), within a number of attempts and a time budget, and
//!   only for idempotent methods (RFC 9110 §9.2.2) and bodies it can clone. A tonic request's
//!   body cannot be cloned, so around a tonic `Channel` it retries nothing: retry tonic calls
//!   with [`RetryPolicy::call`], which re-issues the call itself by the same rules.
//!
//! Put the retry outside the pacing, so that every attempt is paced and every refusal teaches
//! the pacing layer:
//!
//! ```
//! use std::convert::Infallible;
//! use std::time::Duration;
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use tollgate::client::{PacingLayer, RetryPolicy};
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
//! // A server that refuses the first request with `Retry-After: 2`, then answers.
//! let refused = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
//! let server = service_fn(move |_req: Request<Full<Bytes>>| {
//!     let first = !refused.swap(true, std::sync::atomic::Ordering::SeqCst);
//!     async move {
//!         let res = match first {
//!             true => Response::builder().status(429).header("retry-after", "2"),
//!             false => Response::builder().status(200),
//!         };
//!         Ok::<_, Infallible>(res.body(Full::<Bytes>::default()).unwrap())
//!     }
//! });
//! let client = ServiceBuilder::new()
//!     .retry(RetryPolicy::builder().max_attempts(3).build().unwrap())
//!     .layer(PacingLayer::new())
//!     .service(server);
//!
//! let start = tokio::time::Instant::now();
//! let req = Request::get("http://api.example/items").body(Full::default()).unwrap();
//! let res = client.oneshot(req).await.unwrap();
//! assert_eq!(res.status(), StatusCode::OK);
//! assert_eq!(start.elapsed(), Duration::from_secs(2));
//! # }
//! ```

mod pacing;
mod retry;

pub use pacing::{AuthorityKey, Pacing, PacingLayer, ResponseFuture};
pub use retry::{
    FullJitter, GrpcStatus, Jitter, NoErrors, RetryErrors, RetryPolicy, RetryPolicyBuilder,
};
