//! # tollgate
//!
//! Rate limiting for [Tower](https://docs.rs/tower) services (axum, hyper, tonic).
//!
//! A [`RateLimitLayer`] takes a [key] from each request, asks a [store] whether the
//! request fits its [`Policy`], and then either **polices** (429 with `Retry-After`, the IETF
//! `RateLimit-Policy` / `RateLimit` headers and an `application/problem+json` body) or
//! **shapes** (holds the request until its reserved slot).
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
//! Algorithms (SPEC §2): GCRA (default), token bucket, leaky bucket, fixed window, sliding
//! window log, sliding window counter — see [`Algorithm`].
//!
//! Stores: [`MemoryStore`] (default) keeps state in the process; `RedisStore` (cargo feature
//! `redis`) shares it across a fleet through Redis, Redis Cluster or Valkey.
#![forbid(unsafe_code)]

pub mod algorithm;
pub mod clock;
pub mod decision;
pub mod error;
mod future;
pub mod key;
pub mod layer;
pub mod limiter;
pub mod quota;
pub mod response;
pub mod service;
pub mod store;

pub use decision::{Decision, Outcome, Source, TierDecision};
pub use error::{ConfigError, StoreError};
pub use future::ResponseFuture;
pub use layer::{MissingKey, OnStoreError, RateLimitLayer, RateLimitLayerBuilder};
pub use limiter::{Limiter, Reservation};
pub use quota::{Algorithm, Policy, PolicyBuilder, Quota, Tier};
pub use response::HeaderStyle;
pub use service::RateLimit;
#[cfg(feature = "redis")]
pub use store::{BreakerState, RedisStore};
pub use store::{MemoryStore, Store};
