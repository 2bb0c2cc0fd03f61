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
//!
//! # How pacing works
//!
//! What [`PacingLayer`] does with the responses it reads.
//!
//! ## What it reads
//!
//! From every response: the IETF `RateLimit-Policy` / `RateLimit` fields
//! (draft-ietf-httpapi-ratelimit-headers-10, RFC 9651 structured fields: for each quota policy, `q`
//! units per `w` seconds, `r` units remaining, full again in `t` seconds), else the common
//! `X-RateLimit-Limit` / `-Remaining` / `-Reset` (`Reset` in seconds from now, or, above 10^9, a
//! Unix timestamp taken relative to the response's `Date` header, else the system clock), and a
//! 429's `Retry-After` (RFC 9110 §10.2.3: delay-seconds, or an HTTP-date relative to the response's
//! `Date`). Fields that do not parse are ignored.
//!
//! ## What it keeps
//!
//! Per partition (a [`KeyExtractor`](crate::key::KeyExtractor) over the request; default
//! [`AuthorityKey`], one partition per server): for each quota, the units believed left, when it is
//! full again, the refill rate learned so far, and the reports read while requests are in flight;
//! until when a 429 asked to wait; the requests in flight, numbered in the order they were sent.
//!
//! ## Before the first response
//!
//! Before the first response of a partition, its requests go one at a time: the first answer says
//! how many may follow (a server that sends no rate-limit fields then limits nothing). A first
//! request that fails or is dropped lets the next one go, alone.
//!
//! ## How it paces
//!
//! A request waits while a 429's `Retry-After` runs, and while any quota of its partition has no
//! unit left, until the quota has one again: at its reset (`t`, when `q` is believed left, less the
//! requests still in flight), or sooner by the refill rate it has learned. A request that goes
//! reserves one unit of every quota before it is sent, so concurrent requests never send more than
//! the server last allowed. While others are in flight, a request goes only if a unit would be left
//! after it: a server can decide a request at an instant before one it decided earlier (it read its
//! clock, then waited for a lock, as tollgate's memory store can under contention), which costs
//! that request the refill of the delay; the unit kept covers a delay of up to one emission
//! interval (`1 / rate`). A request with nothing in flight may take the last unit. Every response
//! replaces the count, and no order is assumed: requests on separate connections overtake one
//! another on the way to the server and back. The count is the least `r` among this response and
//! those read while its request was in flight, less every request still in flight. Whichever of
//! those responses the server decided last, the requests decided after it are all still in flight
//! (the ones answered before this request was sent were decided before it), and its `r` is that
//! least `r` or above (a refill can only raise a later `r`): the count is never more than the
//! server has once the requests in flight are decided. A request in flight that was decided earlier
//! is subtracted although `r` counted it, until its own answer arrives: once every request is
//! answered the count is the server's last `r` exactly. After the layer refilled a quota at its
//! reset, answers to requests sent before describe the window before and do not set the count. A
//! quota reported without a reset time (`t`) and with nothing left is forgotten when no request is
//! in flight to tell more.
//!
//! ## How the rate is learned
//!
//! The headers give whole seconds (`w`, `t`), which hide a refill faster than a window (tollgate
//! renders 50 per second with a burst of 10 as `q=10;w=1`). The learning starts at a response read
//! with no other request in flight and none answered while it was (its anchor: `r_a` units left;
//! its request sent at instant `a`), usually the first. At a later response arriving at `b` with
//! `r_b` left, the server has spent at least `n` units since the anchor (the admitted requests
//! answered before this one was sent, and this one: all decided between the two), so it refilled
//! more than `r_b + n - r_a - 1` units in `b - a` seconds (`r` is the whole part of what is left; a
//! quota that was full meanwhile refilled less, and a request decided between the two but answered
//! later is not in `n`, so this stays a lower bound). The span runs from the anchor's sending to
//! the later answer's arrival, so it holds the time between the two decisions whatever the
//! latencies: the bound never exceeds the true rate. The learned rate is the largest such bound, in
//! units per second, over spans of at least one second. A quota with no unit left then has one `1 /
//! rate` seconds after the last response (up to `q` less the requests in flight, which may not be
//! decided yet), instead of at its reset; as the refill is underestimated, the server holds more
//! than the layer believes, reports it in `r`, and the layer sends it: the rate the server allows
//! is reached even while the estimate is low. Units are requests and seconds throughout.
//!
//! ## Quotas that refill all at once
//!
//! Quotas that refill all at once (a fixed window, a sliding log) look, across their reset, like a
//! bucket that refilled: the rate learned from them can let one request go too early. The server
//! refuses it (429), and from then on the layer learns no rate for that quota and waits for its
//! resets. The same happens when other clients spend the same quota, and when a request that ended
//! without an answer (an error, a dropped future) is decided after a later answer was read. Against
//! a bucket (tollgate's GCRA, token and leaky buckets) that this layer alone spends, no request is
//! refused, in whatever order the requests reach the server and their answers come back.

mod pacing;
mod retry;

pub use pacing::{AuthorityKey, Pacing, PacingLayer, ResponseFuture};
pub use retry::{
    FullJitter, GrpcStatus, Jitter, NoErrors, RetryErrors, RetryPolicy, RetryPolicyBuilder,
};
