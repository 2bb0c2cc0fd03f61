//! tollgate-server: a rate limit service for Envoy (RLS v3, `ShouldRateLimit` over gRPC) on
//! tollgate's engine, that runs envoyproxy/ratelimit's configuration files and deployments.
//!
//! The binary is the product (see the README); this library is what it is made of, public so
//! that the tests and the load generator can start a server in their own process.
//!
//! ```no_run
//! use tollgate_server::settings::Settings;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let args = ["--config", "limits.yaml", "--listen", "127.0.0.1:8081"].map(String::from);
//! let settings = Settings::parse(args, |name| std::env::var(name).ok())?;
//! let running = tollgate_server::server::start(settings, None).await?;
//! running.wait().await;
//! # Ok(()) }
//! ```

#![warn(missing_docs)]

pub(crate) mod compat;
pub mod config;
pub mod engine;
pub(crate) mod once;
pub mod server;
pub mod service;
pub mod settings;
pub(crate) mod stats;
pub(crate) mod threads;

/// The Envoy protos this service speaks (re-exported from `envoy-types`).
pub use envoy_types::pb;
