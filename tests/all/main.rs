//! The integration tests, one module per concern, linked into one test binary: each test
//! binary links the whole crate with its dependencies, which on a 2-core machine cost more
//! than compiling the tests themselves. `cargo test --all-features --test all <filter>` runs a
//! part of them (a module's tests by its name: `-- redis::`).
//!
//! What one process shares, and how the tests share it:
//! - `tracing`: one global subscriber that writes each event to the capture of the thread that
//!   emitted it ([`support::logs`]).
//! - `metrics`: one global Prometheus recorder ([`support::prometheus`]); a test that reads
//!   metrics reads only the series of policy names no other test uses.
//! - No test sets environment variables or the working directory; Redis servers each get a
//!   free loopback port and a directory of their own ([`support::redis`]).
//!
//! Tests that load the machine or measure the process run in the second binary,
//! `tests/alone`, one at a time.

#[path = "../support/mod.rs"]
mod support;

mod client;
mod config;
mod config_errors;
mod config_file;
mod config_kinds;
mod defaults;
mod grpc;
mod headers;
mod http;
mod hyper;
mod kinds;
mod layer_kinds;
mod lean;
mod lease;
mod lease_config;
mod lease_headers;
mod lease_reload;
mod limiter;
mod messages;
mod missing_key;
mod observe;
mod pacing_http;
mod penalty;
mod priority;
mod redis;
mod reserve_shape;
mod seams;
mod seams_http;
mod seams_lease;
mod select;
mod service;
mod settle_tiers;
mod spoofing;
mod streams;
mod testing;
mod truth;
mod websocket;
mod ws_config;
