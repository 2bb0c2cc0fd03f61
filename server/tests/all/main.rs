//! tollgate-server's tests, in one binary: each starts a server on a loopback port and calls
//! it with a real gRPC client (tonic's, generated from the Envoy protos).
#![allow(unreachable_pub, dead_code)]

mod config;
mod decisions;
mod model;
mod redis;
/// The library's throw-away Redis servers (standalone, Cluster, Sentinel).
#[path = "../../../tests/support/redis.rs"]
mod redis_support;
mod serving;
mod support;
