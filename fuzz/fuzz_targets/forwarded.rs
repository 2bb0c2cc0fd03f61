//! Client-address extraction from arbitrary forwarding headers (SECURITY.md, "hostile header
//! values"). Input: header lines separated by `\n`; the first byte of each line picks the header
//! (`X-Forwarded-For`, `Forwarded`, `X-Real-IP`), the rest is its value.
//!
//! Checked: no panic; from an untrusted peer the key is the peer whatever the headers say; from a
//! trusted proxy the key is an address, the same on every call.
#![no_main]

use std::net::SocketAddr;

use libfuzzer_sys::fuzz_target;
use tollgate::key::{ClientIp, ForwardedHeader, Key, KeyExtractor};

const NAMES: [&str; 3] = ["x-forwarded-for", "forwarded", "x-real-ip"];

fuzz_target!(|data: &[u8]| {
    let mut req = http::Request::get("/");
    for line in data.split(|b| *b == b'\n') {
        let Some((which, value)) = line.split_first() else { continue };
        // Values the http crate refuses never reach a service.
        if let Ok(v) = http::HeaderValue::from_bytes(value) {
            req = req.header(NAMES[usize::from(*which) % 3], v);
        }
    }
    let Ok(req) = req.body(()) else { return };
    let (mut parts, ()) = req.into_parts();
    for (peer, trusted) in [("10.1.2.3:1", true), ("[2001:db8::5]:1", false), ("198.51.100.2:1", false)] {
        let peer: SocketAddr = peer.parse().unwrap();
        parts.extensions.insert(peer);
        for header in [ForwardedHeader::XForwardedFor, ForwardedHeader::Forwarded, ForwardedHeader::XRealIp] {
            let ex = ClientIp::from_cidrs(["10.0.0.0/8", "fd00::/8"]).unwrap().header(header).ipv6_prefix(128);
            let key = ex.extract(&parts);
            if trusted {
                assert!(matches!(key, Some(Key::Ip(_))), "{key:?}");
                assert_eq!(key, ex.extract(&parts));
            } else {
                assert_eq!(key, Some(Key::Ip(peer.ip())));
            }
        }
    }
});
