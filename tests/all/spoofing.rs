//! Spoofed and hostile headers (SECURITY.md, "spoofed client addresses" and "hostile header
//! values"). Property tests over arbitrary header bytes — random bytes mixed with the tokens the
//! parsers care about, repeated lines, empty and oversized values, bytes that are not UTF-8 —
//! and counts through the layer showing that no request gets a fresh bucket.
use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};

use axum::body::Body;
use http::{HeaderValue, Request, Response, StatusCode};
use proptest::prelude::*;
use tollgate::RequestBody;
use tollgate::key::{
    ClientIp, ForwardedHeader, HeaderKey, Key, KeyExtractor, RequestHead, group_ip,
};
use tollgate::{MissingKey, Policy, Quota, RateLimitLayer};
use tower::{Layer, Service, ServiceExt, service_fn};

const HEADERS: [ForwardedHeader; 3] =
    [ForwardedHeader::XForwardedFor, ForwardedHeader::Forwarded, ForwardedHeader::XRealIp];

fn trusted() -> ClientIp {
    ClientIp::from_cidrs(["10.0.0.0/8", "fd00::/8"]).unwrap()
}

/// Bytes a header value may hold (visible ASCII, space, tab, and 0x80..=0xFF).
fn header_byte() -> impl Strategy<Value = u8> {
    prop_oneof![0x20u8..=0x7e, 0x80u8..=0xff, Just(b'\t')]
}

/// A piece of a hostile value: random bytes, or a token the parsers react to.
fn piece() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(header_byte(), 0..12),
        prop::sample::select(vec![
            ",",
            ", ",
            ";",
            "=",
            "\"",
            "[",
            "]",
            ":",
            "for=",
            "For=",
            "by=",
            "proto=https",
            "unknown",
            "_hidden",
            "_p1",
            "1.2.3.4",
            "10.1.2.3",
            "203.0.113.9",
            "::1",
            "2001:db8::1",
            "[2001:db8::2]:443",
            "::ffff:10.0.0.1",
            "fd00::7",
            "\"[",
            "]\"",
            "999.1.1.1",
            "1.2.3.4:99999",
            "\u{ff}",
        ])
        .prop_map(|s: &str| s.as_bytes().to_vec()),
    ]
}

/// A whole hostile value, now and then oversized.
fn value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        9 => proptest::collection::vec(piece(), 0..16).prop_map(|p| p.concat()),
        // 4 KiB to 9 KiB: a short random run repeated (cheap to generate, still hostile).
        1 => (proptest::collection::vec(header_byte(), 1..64), 4096usize..=9000)
            .prop_map(|(run, len)| run.iter().copied().cycle().take(len).collect()),
    ]
}

/// Up to three lines of each of the three headers.
fn lines() -> impl Strategy<Value = Vec<(&'static str, Vec<u8>)>> {
    let name = prop::sample::select(vec!["x-forwarded-for", "forwarded", "x-real-ip"]);
    proptest::collection::vec((name, value()), 0..9)
}

fn any_ip() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        any::<u32>().prop_map(|v| IpAddr::from(v.to_be_bytes())),
        any::<u128>().prop_map(|v| IpAddr::from(v.to_be_bytes())),
    ]
}

fn parts(peer: IpAddr, lines: &[(&str, Vec<u8>)]) -> http::request::Parts {
    let mut req = Request::get("/");
    for (name, v) in lines {
        req = req.header(*name, HeaderValue::from_bytes(v).expect("valid header bytes"));
    }
    let mut req = req.body(()).unwrap();
    req.extensions_mut().insert(SocketAddr::new(peer, 4711));
    req.into_parts().0
}

fn is_trusted(ip: IpAddr) -> bool {
    let ip = group_ip(ip, 128);
    ["10.0.0.0/8", "fd00::/8"].iter().any(|n| n.parse::<ipnet::IpNet>().unwrap().contains(&ip))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    /// From an untrusted peer no header changes the key.
    #[test]
    fn untrusted_peers_are_keyed_by_themselves_whatever_they_send(
        peer in any_ip().prop_filter("untrusted", |ip| !is_trusted(*ip)),
        lines in lines(),
    ) {
        let p = parts(peer, &lines);
        for header in HEADERS {
            let key = trusted().header(header).extract(&RequestHead::from(&p));
            prop_assert_eq!(key, Some(Key::Ip(group_ip(peer, 64))));
        }
    }

    /// Behind a trusted proxy, whatever the client wrote to the left (even on earlier lines),
    /// the key is the right-most untrusted address the proxies appended.
    #[test]
    fn the_right_most_untrusted_hop_wins_over_anything_the_client_wrote(
        client in any_ip().prop_filter("untrusted", |ip| !is_trusted(*ip)),
        forged in value(),
        forged_line in proptest::option::of(value()),
        hops in proptest::collection::vec(0u8..=255, 0..3),
    ) {
        let peer: IpAddr = "10.0.0.1".parse().unwrap();
        let hops: Vec<String> = hops.iter().map(|h| format!("10.9.9.{h}")).collect();
        for header in [ForwardedHeader::XForwardedFor, ForwardedHeader::Forwarded] {
            let node = |ip: &str| match header {
                ForwardedHeader::Forwarded => format!("for=\"{ip}\""),
                _ => ip.to_owned(),
            };
            let client_node = match (header, client) {
                (ForwardedHeader::Forwarded, IpAddr::V6(v6)) => format!("for=\"[{v6}]:443\""),
                _ => node(&client.to_string()),
            };
            let mut appended = client_node;
            for h in &hops {
                appended = format!("{appended}, {}", node(h));
            }
            let name = match header {
                ForwardedHeader::Forwarded => "forwarded",
                _ => "x-forwarded-for",
            };
            let mut line = forged.clone();
            line.extend_from_slice(b", ");
            line.extend_from_slice(appended.as_bytes());
            let mut lines = Vec::new();
            if let Some(f) = &forged_line {
                lines.push((name, f.clone()));
            }
            lines.push((name, line));
            let key = trusted().header(header).extract(&RequestHead::from(&parts(peer, &lines)));
            prop_assert_eq!(key, Some(Key::Ip(group_ip(client, 64))), "{:?}", header);
        }
    }

    /// Any bytes from a trusted proxy: no panic, the same key every time, and when the last
    /// element (the one the proxy wrote) is not an address, the key is the proxy itself.
    #[test]
    fn garbage_from_a_trusted_proxy_ends_the_walk_at_the_proxy(lines in lines()) {
        let peer: IpAddr = "10.0.0.1".parse().unwrap();
        let p = parts(peer, &lines);
        for header in HEADERS {
            let ex = trusted().header(header);
            let key = ex.extract(&RequestHead::from(&p));
            prop_assert_eq!(&key, &ex.extract(&RequestHead::from(&p)), "deterministic");
            let Some(Key::Ip(_)) = key else { panic!("an address key: {key:?}") };
            let name = match header {
                ForwardedHeader::XForwardedFor => "x-forwarded-for",
                ForwardedHeader::Forwarded => "forwarded",
                _ => "x-real-ip",
            };
            let last = lines.iter().rev().find(|(n, _)| *n == name);
            let last_element = last.map(|(_, v)| v.rsplit(|b| *b == b',').next().unwrap_or(&[]));
            let written_by_proxy_is_junk = last_element.is_some_and(|e| {
                let s = String::from_utf8_lossy(e);
                let s = s.trim().trim_start_matches("for=").trim_matches('"');
                s.parse::<IpAddr>().is_err()
                    && s.trim_start_matches('[').split(']').next().unwrap_or("").parse::<IpAddr>().is_err()
                    && s.rsplit_once(':').is_none_or(|(a, _)| a.parse::<IpAddr>().is_err())
            });
            if written_by_proxy_is_junk && header != ForwardedHeader::Forwarded {
                prop_assert_eq!(key, Some(Key::Ip(peer)), "{:?}", header);
            }
        }
    }
}

fn ok()
-> impl Service<Request<RequestBody<Body>>, Response = Response<Body>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static {
    service_fn(|_req| async { Ok::<_, Infallible>(Response::new(Body::empty())) })
}

fn request(peer: &str, headers: &[(&str, Vec<u8>)]) -> Request<Body> {
    let mut req = Request::get("/");
    for (n, v) in headers {
        req = req.header(*n, HeaderValue::from_bytes(v).unwrap());
    }
    let mut req = req.body(Body::empty()).unwrap();
    req.extensions_mut().insert(peer.parse::<SocketAddr>().unwrap());
    req
}

/// Sends `n` requests made by `make(i)` through a 5-per-hour layer; returns how many passed.
async fn admitted<K: KeyExtractor + Clone>(
    key: K,
    missing: MissingKey,
    n: usize,
    make: impl Fn(usize) -> Request<Body>,
) -> usize {
    let layer = RateLimitLayer::builder(Policy::single("spoof", Quota::per_hour(5)).unwrap())
        .key(key)
        .missing_key(missing)
        .build()
        .unwrap();
    let svc = layer.layer(ok());
    let mut ok = 0;
    for i in 0..n {
        ok += usize::from(svc.clone().oneshot(make(i)).await.unwrap().status() == StatusCode::OK);
    }
    ok
}

#[tokio::test]
async fn ten_thousand_forged_addresses_from_one_untrusted_peer_share_one_bucket() {
    for header in HEADERS {
        let n = admitted(trusted().header(header), MissingKey::default(), 10_000, |i| {
            let forged = format!("{}.{}.{}.{}", i >> 24, (i >> 16) & 255, (i >> 8) & 255, i & 255);
            request(
                "198.51.100.7:1000",
                &[
                    ("x-forwarded-for", forged.clone().into_bytes()),
                    ("forwarded", format!("for={forged}").into_bytes()),
                    ("x-real-ip", forged.into_bytes()),
                ],
            )
        })
        .await;
        assert_eq!(n, 5, "{header:?}");
    }
}

#[tokio::test]
async fn junk_written_behind_a_trusted_proxy_shares_the_proxys_bucket() {
    let n = admitted(trusted(), MissingKey::default(), 5_000, |i| {
        // Different garbage every time, in the element the proxy appended.
        let junk = format!("1.2.3.4, _hidden{i}, \u{fffd}{i}");
        request("10.0.0.1:1000", &[("x-forwarded-for", junk.into_bytes())])
    })
    .await;
    assert_eq!(n, 5);
}

#[tokio::test]
async fn oversized_or_empty_api_keys_share_the_missing_key_bucket() {
    let key = HeaderKey::new(http::HeaderName::from_static("x-api-key"));
    let n = admitted(key, MissingKey::Shared, 2_000, |i| {
        let value = if i % 2 == 0 { vec![b'k'; 257 + i] } else { Vec::new() };
        request("198.51.100.7:1000", &[("x-api-key", value)])
    })
    .await;
    assert_eq!(n, 5);
}
