//! Key floods (SECURITY.md, "key floods"): a flood of distinct client addresses through the
//! layer cannot grow memory past the store's key cap, cannot reset established clients, and an
//! IPv6 client rotating through its /64 stays one bucket.
//!
//! Its tests run in the `alone` test binary, one at a time, so that the resident memory it
//! measures is its own. The always-on run sends 200,000 distinct IPv4 clients;
//! `TOLLGATE_LONG_TESTS=1` sends 1,000,000 (about a minute in a debug build).
use crate::ONE_AT_A_TIME;
use crate::support;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use axum::body::Body;
use http::{Request, StatusCode};
use tollgate::store::MemoryStore;
use tollgate::{Policy, Quota, RateLimitLayer};
use tower::{Layer, ServiceExt};

/// Resident memory of this process, in bytes (`/proc/self/statm`).
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("linux /proc");
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

fn flood_size() -> u32 {
    if std::env::var("TOLLGATE_LONG_TESTS").is_ok_and(|v| v == "1") { 1_000_000 } else { 200_000 }
}

/// A small deterministic generator (xorshift64*), so a failure is reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

fn from(ip: IpAddr) -> Request<Body> {
    let mut req = Request::new(Body::empty());
    req.extensions_mut().insert(SocketAddr::new(ip, 40_000));
    req
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv4_flood_stays_under_the_key_cap_and_established_clients_keep_their_state() {
    let _one = ONE_AT_A_TIME.lock().await;
    const CAP: usize = 20_000;
    const ESTABLISHED: u32 = 100;
    let store = MemoryStore::builder().max_keys(CAP).build().unwrap();
    let policy = Policy::single("flood", Quota::per_hour(5)).unwrap();
    let layer = RateLimitLayer::builder(policy).store(store.clone()).build().unwrap();
    let svc = layer.layer(support::ok_service());
    let status = |ip: IpAddr| {
        let svc = svc.clone();
        async move { svc.oneshot(from(ip)).await.unwrap().status() }
    };

    // Established clients (10.0.0.0/24): two requests each, three left.
    let established = |i: u32| IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i));
    for i in 0..ESTABLISHED {
        for _ in 0..2 {
            assert_eq!(status(established(i)).await, StatusCode::OK);
        }
    }

    let before = resident_bytes();
    let n = flood_size();
    let mut admitted = 0usize;
    for i in 0..n {
        // Distinct for distinct i (multiplying by an odd constant is a bijection of u32), spread
        // over the whole space; the established clients' 10.0.0.0/24 is skipped.
        let ip = Ipv4Addr::from(i.wrapping_mul(0x9e37_79b1) ^ 0x5bd1_e995);
        if ip.octets()[..3] == [10, 0, 0] {
            continue;
        }
        admitted += usize::from(status(IpAddr::V4(ip)).await == StatusCode::OK);
    }
    let grown = resident_bytes().saturating_sub(before);
    eprintln!("flood: {n} distinct clients, {admitted} admitted, resident memory +{grown} bytes");

    // The store holds exactly the cap: the established clients and the first flood keys. Every
    // later key shared the one overflow bucket, which admitted its 5.
    assert_eq!(store.len(), CAP);
    assert_eq!(admitted, CAP - ESTABLISHED as usize + 5);
    // Memory: the cap bounds it. 512 bytes per key held is more than twice what one costs; an
    // unbounded store would have grown by about 200 bytes for each of the n keys (40 MB and
    // more, over the bound).
    let bound = CAP as u64 * 512 + 8 * 1024 * 1024;
    assert!(grown <= bound, "resident memory grew by {grown} bytes (bound {bound}) for {n} keys");

    // Established clients kept their state: three more requests each, then limited.
    for i in 0..ESTABLISHED {
        for _ in 0..3 {
            assert_eq!(status(established(i)).await, StatusCode::OK, "client {i}");
        }
        assert_eq!(status(established(i)).await, StatusCode::TOO_MANY_REQUESTS, "client {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv6_client_rotating_through_its_slash_64_is_one_bucket() {
    let _one = ONE_AT_A_TIME.lock().await;
    let store = MemoryStore::new();
    let policy = Policy::single("v6", Quota::per_hour(5)).unwrap();
    let layer = RateLimitLayer::builder(policy).store(store.clone()).build().unwrap();
    let svc = layer.layer(support::ok_service());
    let mut rng = Rng(42);
    let prefix: u128 = 0x2001_0db8_0001_0002 << 64;
    let mut admitted = 0;
    for _ in 0..100_000 {
        let ip = Ipv6Addr::from(prefix | u128::from(rng.next()));
        let res = svc.clone().oneshot(from(IpAddr::V6(ip))).await.unwrap();
        admitted += usize::from(res.status() == StatusCode::OK);
    }
    assert_eq!(admitted, 5, "100,000 addresses of one /64 share one budget");
    assert_eq!(store.len(), 1, "and one key");
    // The neighbouring /64 is someone else.
    let other = Ipv6Addr::from((prefix + (1 << 64)) | 7);
    let res = svc.oneshot(from(IpAddr::V6(other))).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(store.len(), 2);
}
