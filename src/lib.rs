//! # tollgate
//!
//! Rate limiting for [Tower](https://docs.rs/tower) services (axum, hyper, tonic).
//!
//! A [`RateLimitLayer`] takes a [key] from each request, asks a [store] whether the request
//! fits its [`Policy`], and then either **polices** (429 with `Retry-After`, the IETF
//! `RateLimit-Policy` / `RateLimit` headers and an `application/problem+json` body) or
//! **shapes** (holds the request until its reserved slot). A [`Limiter`] does the same for
//! code that is not an HTTP service.
//!
//! ```no_run
//! use std::net::SocketAddr;
//! use axum::{Router, routing::get};
//! use tollgate::{Policy, Quota, RateLimitLayer};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let policy = Policy::builder("per-ip")
//!     .tier("burst", Quota::per_second(10))
//!     .tier("hourly", Quota::per_hour(1000))
//!     .build()?;
//! let app = Router::new()
//!     .route("/", get(|| async { "hello" }))
//!     .layer(RateLimitLayer::builder(policy).build()?);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
//! # Ok(()) }
//! ```
//!
//! The [guide] has a page per task, each with a program CI runs: per-route limits, plans,
//! clients behind a proxy, hyper, tier kinds beyond requests per second, uploads, gRPC,
//! WebSocket, Redis and lease mode, a configuration file, testing, calling a rate-limited API,
//! observability, limits in code.
//!
//! Algorithms: GCRA (default), token bucket, leaky bucket, fixed window, sliding window log,
//! sliding window counter; see [`Algorithm`].
//!
//! Beyond request rates, a policy's tiers can limit requests in flight per key
//! ([`Concurrency`]), count calendar windows of a time zone ([`Calendar`]: "10,000 per month,
//! from the 1st at 00:00 in the customer's time zone"), and count other [units](Unit) than
//! requests (request or response bytes, tokens a handler reports): "5 requests/s **and**
//! 1 MB/s per client". A request is admitted by every tier of its policy, and charged on every
//! one, or refused and charged on none. A tier may also shut out a client that breaches it for
//! a while ([`Penalty`]: "refused 3 times within a minute, blocked for 15 minutes"), or keep
//! part of its capacity for the more important requests ([`Reserve`]: requests carry a
//! [`Priority`], critical, standard or sheddable, and as the one shared limit nears, sheddable
//! requests are refused first, while critical ones are never refused until their reserve is
//! used).
//!
//! Stores: [`MemoryStore`](store::MemoryStore) (default) keeps state in the process;
//! `RedisStore` (cargo feature `redis`) shares it across a fleet through Redis, Redis Cluster or
//! Valkey.
//!
//! Cargo features: `axum` (default) adds axum's `ConnectInfo` / `MatchedPath` to the key
//! extractors and `IntoResponse` to the rejections; without it the crate depends on `http` and
//! Tower only. `redis` adds `RedisStore`. `tonic` makes [`PeerIp`](key::PeerIp) and
//! [`ClientIp`](key::ClientIp) read tonic's `TcpConnectInfo`; gRPC calls are refused in gRPC
//! form with or without it ([`grpc`]). `metrics` (default) reports decisions through the
//! `metrics` facade (module `metrics`). `client` adds the client side (module `client`): a retry
//! policy (for HTTP requests, and for gRPC calls, implemented for `tonic::Status` with `tonic`)
//! and a layer that paces requests by the servers' rate-limit headers. `config` reads policies
//! and rules from a TOML file and reloads them while serving (module `config`). `testing` adds
//! a virtual clock, typed rate-limit headers and one-line assertions for testing an app's limits
//! (module `testing`). `ws` meters the messages of axum WebSockets against tiers counting
//! messages (module `ws`).
#![cfg_attr(docsrs, feature(doc_cfg))]

/// `get_ref`, `get_mut` and `into_inner` for a middleware service whose field `inner` is the
/// service it wraps, as tower-http's services have them.
macro_rules! inner_service_accessors {
    () => {
        /// The inner service.
        pub fn get_ref(&self) -> &S {
            &self.inner
        }

        /// The inner service, mutably.
        pub fn get_mut(&mut self) -> &mut S {
            &mut self.inner
        }

        /// Consumes this service, returning the inner service.
        pub fn into_inner(self) -> S {
            self.inner
        }
    };
}

// The Redis scripts' unit tests start their servers with the integration tests' helper
// (`tests/support/redis.rs`), which names this crate `tollgate`.
#[cfg(all(test, feature = "redis"))]
extern crate self as tollgate;

mod algorithm;
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
pub mod clock;
#[cfg(feature = "config")]
#[cfg_attr(docsrs, doc(cfg(feature = "config")))]
pub mod config;
mod decision;
mod error;
pub mod grpc;
pub mod guide;
mod headers;
#[cfg(any(feature = "client", feature = "testing"))]
#[cfg_attr(not(feature = "client"), allow(dead_code))]
mod hints;
pub mod key;
pub mod layer;
mod limiter;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
#[cfg(not(feature = "metrics"))]
mod metrics;
mod policy;
mod quota;
#[deprecated(note = "the recipes moved to `tollgate::guide`, one page per task")]
pub mod recipes;
mod rejection;
pub mod store;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;
#[cfg(feature = "ws")]
#[cfg_attr(docsrs, doc(cfg(feature = "ws")))]
pub mod ws;

pub use decision::{Decision, Outcome, Source, TierDecision};
pub use error::{ConfigError, StoreError};
pub use headers::{HeaderFormat, HeaderStyle};
pub use layer::{
    MissingKey, OnStoreError, RateLimitLayer, RateLimitLayerBuilder, RequestBody, StreamMode, Usage,
};
pub use limiter::{Held, Limiter, Reservation};
pub use policy::{Costs, Policy, PolicyBuilder, Tier};
pub use quota::{
    Algorithm, Calendar, CalendarPeriod, Concurrency, Penalty, Priority, Quota, Reserve, TierKind,
    Unit,
};
pub use rejection::{RateLimited, Rejection};

/// Names that moved from the crate's root: the layer's parts to [`layer`], the constants to
/// the types they describe. Kept until the first release, deprecated.
mod moved {
    #![allow(missing_docs)]
    use std::time::Duration;

    #[deprecated(note = "moved: tollgate::layer::DecisionEvent")]
    pub type DecisionEvent<'a> = crate::layer::DecisionEvent<'a>;
    #[deprecated(note = "use tollgate::layer::ResponseFuture<F, B, E, Lean>")]
    pub type LeanFuture<F, B, E> = crate::layer::ResponseFuture<F, B, E, crate::layer::Lean>;
    #[deprecated(note = "use RateLimitLayer<K, St, Lean>, which RateLimitLayer::lean returns")]
    pub type LeanLayer<K, St> = crate::RateLimitLayer<K, St, crate::layer::Lean>;
    #[deprecated(note = "use tollgate::layer::RateLimit<S, K, St, Lean>")]
    pub type LeanRateLimit<S, K, St> = crate::layer::RateLimit<S, K, St, crate::layer::Lean>;
    #[deprecated(note = "moved: tollgate::layer::LogKeys")]
    pub type LogKeys = crate::layer::LogKeys;
    #[deprecated(note = "moved: tollgate::layer::Observed")]
    pub type Observed = crate::layer::Observed;
    #[deprecated(note = "moved: tollgate::layer::RateLimit")]
    pub type RateLimit<S, K, St> = crate::layer::RateLimit<S, K, St>;
    #[deprecated(note = "moved: tollgate::layer::ResponseBody")]
    pub type ResponseBody<B> = crate::layer::ResponseBody<B>;
    #[deprecated(note = "moved: tollgate::layer::ResponseFuture")]
    pub type ResponseFuture<F, B, E> = crate::layer::ResponseFuture<F, B, E>;
    #[deprecated(note = "moved: tollgate::layer::Unselected")]
    pub type Unselected = crate::layer::Unselected;
    #[deprecated(note = "renamed: StreamMode::MESSAGE_GRANT")]
    pub const MESSAGE_LEASE: u64 = crate::StreamMode::MESSAGE_GRANT;
    #[deprecated(note = "renamed: StreamMode::STREAM_GRANT")]
    pub const STREAM_LEASE: u64 = crate::StreamMode::STREAM_GRANT;
    #[deprecated(note = "renamed: Concurrency::DEFAULT_TTL")]
    pub const DEFAULT_LEASE: Duration = crate::Concurrency::DEFAULT_TTL;
    #[deprecated(note = "moved: Concurrency::DEFAULT_TYPICAL_HOLD")]
    pub const DEFAULT_TYPICAL_HOLD: Duration = crate::Concurrency::DEFAULT_TYPICAL_HOLD;
    #[deprecated(note = "moved: Quota::MAX_COUNT")]
    pub const MAX_COUNT: u64 = crate::Quota::MAX_COUNT;
    #[deprecated(note = "moved: Penalty::MAX_REFUSALS")]
    pub const MAX_PENALTY_REFUSALS: u32 = crate::Penalty::MAX_REFUSALS;
    #[deprecated(note = "moved: Quota::MAX_SLIDING_LOG")]
    pub const MAX_SLIDING_LOG: u64 = crate::Quota::MAX_SLIDING_LOG;
    #[deprecated(note = "moved: Quota::MAX_SPAN")]
    pub const MAX_SPAN: Duration = crate::Quota::MAX_SPAN;
    #[deprecated(note = "moved: RateLimited::PROBLEM_TYPE")]
    pub const QUOTA_EXCEEDED_TYPE: &str = crate::RateLimited::PROBLEM_TYPE;
}
#[allow(deprecated)]
#[doc(hidden)]
pub use moved::*;

/// The README's Rust code blocks, compiled and run by `cargo test --doc` when every feature
/// they use is on (`cargo test --all-features`, as CI runs).
#[cfg(all(
    doctest,
    feature = "axum",
    feature = "redis",
    feature = "tonic",
    feature = "client",
    feature = "config",
    feature = "testing"
))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
