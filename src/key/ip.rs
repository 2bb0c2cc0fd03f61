//! Client addresses: the peer, and the client behind trusted proxies.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use ipnet::IpNet;

use super::{Key, KeyExtractor, KeyMissing, RequestHead};

/// Default IPv6 grouping: one bucket per /64, the smallest block a typical subscriber holds.
pub const DEFAULT_IPV6_PREFIX: u8 = 64;

/// Unwraps IPv4-mapped IPv6 (`::ffff:203.0.113.7` -> `203.0.113.7`) and masks IPv6 to its first
/// `v6_prefix` bits (clamped to 0..=128), so a client rotating through its /64 stays one key.
///
/// ```
/// use tollgate::key::group_ip;
///
/// assert_eq!(group_ip("2001:db8:1:2:aaaa::1".parse().unwrap(), 64).to_string(), "2001:db8:1:2::");
/// assert_eq!(group_ip("::ffff:10.1.2.3".parse().unwrap(), 64).to_string(), "10.1.2.3");
/// ```
#[must_use]
pub fn group_ip(ip: IpAddr, v6_prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let bits = u32::from(v6_prefix.min(128));
                let mask = u128::MAX.checked_shl(128 - bits).unwrap_or(0);
                IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask))
            }
        },
    }
}

/// The TCP peer's address from the request extensions: axum's `ConnectInfo<SocketAddr>` or
/// its test double `MockConnectInfo<SocketAddr>` (with the `axum` feature), tonic's
/// `TcpConnectInfo` (with the `tonic` feature), or a plain `SocketAddr` that a hyper server (or
/// any layer) inserted.
pub(crate) fn peer(parts: &RequestHead<'_>) -> Option<IpAddr> {
    #[cfg(feature = "axum")]
    {
        use axum::extract::ConnectInfo;
        use axum::extract::connect_info::MockConnectInfo;
        if let Some(ConnectInfo(addr)) = parts.extensions.get::<ConnectInfo<SocketAddr>>() {
            return Some(addr.ip());
        }
        if let Some(MockConnectInfo(addr)) = parts.extensions.get::<MockConnectInfo<SocketAddr>>() {
            return Some(addr.ip());
        }
    }
    #[cfg(feature = "tonic")]
    {
        use tonic::transport::server::TcpConnectInfo;
        let info = parts.extensions.get::<TcpConnectInfo>();
        if let Some(addr) = info.and_then(TcpConnectInfo::remote_addr) {
            return Some(addr.ip());
        }
    }
    parts.extensions.get::<SocketAddr>().map(SocketAddr::ip)
}

/// The TCP peer's address, with IPv6 grouped by /64 (see [`ipv6_prefix`](Self::ipv6_prefix)),
/// and the layer's default key extractor. Use it when clients connect directly, since behind a proxy every
/// client would share the proxy's bucket ([`ClientIp`] reads the client behind it). A request
/// whose server recorded no peer address has no key.
///
/// ```
/// use std::net::SocketAddr;
/// use tollgate::key::{Key, KeyExtractor, PeerIp, RequestHead};
///
/// let mut req = http::Request::get("/").body(()).unwrap();
/// // What a hyper server's service inserts for each connection (axum: `ConnectInfo`).
/// req.extensions_mut().insert("[2001:db8::7]:4000".parse::<SocketAddr>().unwrap());
/// let key = PeerIp::new().extract(&RequestHead::from(&req));
/// assert_eq!(key, Some(Key::Ip("2001:db8::".parse().unwrap())));
/// ```
///
/// # Where the address comes from
///
/// From the request extensions:
///
/// - axum (feature `axum`): `ConnectInfo<SocketAddr>`, present when the app is served with
///   `into_make_service_with_connect_info::<SocketAddr>()`, or `MockConnectInfo<SocketAddr>`
///   in tests;
/// - tonic (feature `tonic`): `TcpConnectInfo`, which tonic's server inserts for plain TCP
///   connections (`Server::builder().layer(..)` sees it). Behind tonic's TLS it is wrapped in
///   `TlsConnectInfo<TcpConnectInfo>`: key those with a closure that reads it;
/// - hyper or any other server: a plain `SocketAddr` extension, inserted per connection
///   (`req.extensions_mut().insert(remote_addr)` in the service that hyper calls).
///
/// No key without one of them (the layer's missing-key setting then applies).
#[derive(Debug, Clone, Copy)]
pub struct PeerIp {
    v6_prefix: u8,
}

impl PeerIp {
    /// Peer address, IPv6 grouped by /64.
    #[must_use]
    pub const fn new() -> Self {
        Self { v6_prefix: DEFAULT_IPV6_PREFIX }
    }

    /// Groups IPv6 addresses by this prefix length in bits (128 = no grouping).
    #[must_use]
    pub const fn ipv6_prefix(mut self, bits: u8) -> Self {
        self.v6_prefix = if bits > 128 { 128 } else { bits };
        self
    }
}

impl Default for PeerIp {
    fn default() -> Self {
        Self::new()
    }
}

impl KeyExtractor for PeerIp {
    fn extract(&self, parts: &RequestHead<'_>) -> Option<Key> {
        peer(parts).map(|ip| Key::Ip(group_ip(ip, self.v6_prefix)))
    }

    fn explain_missing(&self, _: &RequestHead<'_>) -> KeyMissing {
        no_peer("PeerIp")
    }
}

/// Why [`PeerIp`] and [`ClientIp`] found no peer address: the server did not record it.
fn no_peer(extractor: &'static str) -> KeyMissing {
    KeyMissing::new(
        extractor,
        "the peer's address in the request extensions (axum's `ConnectInfo<SocketAddr>` or \
         `MockConnectInfo<SocketAddr>`, tonic's `TcpConnectInfo`, or a `SocketAddr`), which the \
         server did not record",
        "axum: serve with `app.into_make_service_with_connect_info::<SocketAddr>()`; axum \
         tests: add `.layer(MockConnectInfo(addr))` after (outside) the rate-limit layer; hyper: \
         `req.extensions_mut().insert(remote_addr)` in the service you give hyper for each \
         connection; tonic: serve with `Server::builder()`, which records `TcpConnectInfo` \
         (enable tollgate's `tonic` feature)",
    )
}

/// Which header a trusted proxy writes the client address to (default `X-Forwarded-For`), as
/// [`ClientIp::header`] reads it.
///
/// ```
/// use std::net::SocketAddr;
/// use tollgate::key::{ClientIp, ForwardedHeader, Key, KeyExtractor, RequestHead};
///
/// let ex = ClientIp::from_cidrs(["10.0.0.0/8"]).unwrap().header(ForwardedHeader::Forwarded);
/// let mut req = http::Request::get("/").header("forwarded", "for=203.0.113.7").body(()).unwrap();
/// req.extensions_mut().insert("10.0.0.1:5000".parse::<SocketAddr>().unwrap());
/// assert_eq!(ex.extract(&RequestHead::from(&req)), Some(Key::Ip("203.0.113.7".parse().unwrap())));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "config", derive(serde::Deserialize), serde(rename_all = "kebab-case"))]
#[non_exhaustive]
pub enum ForwardedHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2` (the de-facto standard).
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=192.0.2.60;proto=http, for="[2001:db8::1]:4711"`.
    Forwarded,
    /// `X-Real-IP: 203.0.113.7`, one address set by the proxy (nginx `real_ip`). Only use it
    /// when every trusted proxy overwrites it.
    XRealIp,
}

/// The client address behind trusted proxies, read from the header they write
/// ([`ForwardedHeader`]). A peer that is not a trusted proxy is the key itself, whatever the
/// headers say; see [`from_cidrs`](Self::from_cidrs) for its error.
///
/// ```
/// use std::net::SocketAddr;
/// use tollgate::key::{ClientIp, Key, KeyExtractor, RequestHead};
///
/// let ex = ClientIp::new(["10.0.0.0/8".parse().unwrap()]);
/// let mut req = http::Request::get("/")
///     .header("x-forwarded-for", "6.6.6.6, 203.0.113.7, 10.0.0.2")
///     .body(()).unwrap();
/// req.extensions_mut().insert("10.0.0.1:5000".parse::<SocketAddr>().unwrap());
/// assert_eq!(ex.extract(&RequestHead::from(&req)), Some(Key::Ip("203.0.113.7".parse().unwrap())));
/// ```
///
/// # How it works
///
/// The TCP peer is read as [`PeerIp`] reads it: axum's `ConnectInfo`, tonic's
/// `TcpConnectInfo` (feature `tonic`), or a `SocketAddr` extension.
///
/// When the TCP peer is **not** in the trusted list, the key is the peer itself, whatever the
/// request's headers say (they are client-written, hence spoofable). When it is trusted, the
/// chosen header is walked from the **right**: trusted hops are skipped and the first untrusted
/// address is the client. A hop that is not an address (`unknown`, an obfuscated `_id`, garbage,
/// bytes that are not UTF-8) ends the walk and the key is the trusted proxy that wrote it: the
/// client cannot choose its own key by writing junk. If every hop is trusted, the left-most one
/// is used. Never the left-most value of an untrusted chain.
#[derive(Debug, Clone)]
pub struct ClientIp {
    trusted: Vec<IpNet>,
    header: ForwardedHeader,
    v6_prefix: u8,
}

impl ClientIp {
    /// Trusts the proxies in these networks; reads `X-Forwarded-For`.
    pub fn new(trusted: impl IntoIterator<Item = IpNet>) -> Self {
        Self {
            trusted: trusted.into_iter().map(|n| n.trunc()).collect(),
            header: ForwardedHeader::default(),
            v6_prefix: DEFAULT_IPV6_PREFIX,
        }
    }

    /// Trusts proxies given as CIDR strings (`"10.0.0.0/8"`, `"::1/128"`) or single addresses.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`](crate::ConfigError::Invalid) naming the entry that is neither.
    pub fn from_cidrs<'a>(
        cidrs: impl IntoIterator<Item = &'a str>,
    ) -> Result<Self, crate::ConfigError> {
        let nets = cidrs
            .into_iter()
            .map(|s| {
                s.parse::<IpNet>().or_else(|_| s.parse::<IpAddr>().map(IpNet::from)).map_err(|_| {
                    crate::ConfigError::Invalid {
                        setting: "trusted proxies",
                        reason: format!("{s:?} is not a CIDR or an address"),
                    }
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self::new(nets))
    }

    /// Reads this header instead of `X-Forwarded-For`.
    #[must_use]
    pub fn header(mut self, header: ForwardedHeader) -> Self {
        self.header = header;
        self
    }

    /// Groups IPv6 addresses by this prefix length in bits (default 64; 128 = no grouping).
    #[must_use]
    pub fn ipv6_prefix(mut self, bits: u8) -> Self {
        self.v6_prefix = bits.min(128);
        self
    }

    fn is_trusted(&self, ip: IpAddr) -> bool {
        let ip = group_ip(ip, 128);
        self.trusted.iter().any(|n| n.contains(&ip))
    }

    /// The client address for a request from `peer`.
    fn client(&self, parts: &RequestHead<'_>, peer: IpAddr) -> IpAddr {
        if !self.is_trusted(peer) {
            return peer;
        }
        let lines = match self.header {
            ForwardedHeader::XForwardedFor => parts.headers.get_all("x-forwarded-for"),
            ForwardedHeader::Forwarded => parts.headers.get_all(http::header::FORWARDED),
            ForwardedHeader::XRealIp => {
                let mut values = parts.headers.get_all("x-real-ip").iter();
                return match (values.next(), values.next()) {
                    (Some(v), None) => std::str::from_utf8(v.as_bytes())
                        .ok()
                        .and_then(|s| parse_node(s.trim()))
                        .unwrap_or(peer),
                    _ => peer,
                };
            }
        };
        // Split byte-wise from the right, so nothing the client wrote to the left (unbalanced
        // quotes, bytes that are not UTF-8) can swallow an entry a trusted proxy appended.
        let hops = lines.iter().rev().flat_map(|line| line.as_bytes().rsplit(|b| *b == b','));
        let mut last_trusted = peer;
        for hop in hops {
            let node = std::str::from_utf8(hop).ok().and_then(|s| match self.header {
                ForwardedHeader::Forwarded => forwarded_for(s).and_then(parse_node),
                _ => parse_node(s.trim()),
            });
            match node {
                Some(ip) if self.is_trusted(ip) => last_trusted = ip,
                Some(ip) => return ip,
                None => return last_trusted,
            }
        }
        last_trusted
    }
}

impl KeyExtractor for ClientIp {
    fn extract(&self, parts: &RequestHead<'_>) -> Option<Key> {
        let peer = peer(parts)?;
        Some(Key::Ip(group_ip(self.client(parts, peer), self.v6_prefix)))
    }

    fn explain_missing(&self, _: &RequestHead<'_>) -> KeyMissing {
        no_peer("ClientIp")
    }
}

/// The `for=` value of one RFC 7239 forwarded-element (`for=...;proto=...;by=...`), unquoted.
fn forwarded_for(element: &str) -> Option<&str> {
    element.split(';').find_map(|pair| {
        let (name, value) = pair.trim().split_once('=')?;
        if !name.trim().eq_ignore_ascii_case("for") {
            return None;
        }
        let value = value.trim();
        match value.strip_prefix('"') {
            Some(quoted) => quoted.strip_suffix('"'),
            None => Some(value),
        }
    })
}

/// An address from a node: `203.0.113.7`, `203.0.113.7:80`, `2001:db8::1`, `[2001:db8::1]`,
/// `[2001:db8::1]:4711`. `None` for `unknown`, obfuscated identifiers and anything else.
fn parse_node(s: &str) -> Option<IpAddr> {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Some(rest) = s.strip_prefix('[') {
        let (addr, after) = rest.split_once(']')?;
        let port_ok = after.is_empty() || after.strip_prefix(':').is_some_and(valid_port);
        return if port_ok { addr.parse::<Ipv6Addr>().ok().map(IpAddr::V6) } else { None };
    }
    let (addr, port) = s.rsplit_once(':')?;
    if !valid_port(port) {
        return None;
    }
    addr.parse::<std::net::Ipv4Addr>().ok().map(IpAddr::V4)
}

/// RFC 7239 node ports: a number, or an obfuscated `_port`.
fn valid_port(p: &str) -> bool {
    p.parse::<u16>().is_ok()
        || (p.starts_with('_')
            && p.len() > 1
            && p[1..]
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(peer: &str, headers: &[(&str, &[u8])]) -> http::request::Parts {
        let mut b = http::Request::get("/");
        for (n, v) in headers {
            b = b.header(*n, http::HeaderValue::from_bytes(v).unwrap());
        }
        let mut req = b.body(()).unwrap();
        req.extensions_mut().insert(peer.parse::<SocketAddr>().unwrap());
        req.into_parts().0
    }

    fn key(ex: &ClientIp, p: &http::request::Parts) -> String {
        match ex.extract(&RequestHead::from(p)) {
            Some(Key::Ip(ip)) => ip.to_string(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn untrusted_peer_ignores_every_header() {
        for header in
            [ForwardedHeader::XForwardedFor, ForwardedHeader::Forwarded, ForwardedHeader::XRealIp]
        {
            let ex = ClientIp::new(["10.0.0.0/8".parse().unwrap()]).header(header);
            let p = parts(
                "198.51.100.9:1",
                &[
                    ("x-forwarded-for", b"1.1.1.1"),
                    ("forwarded", b"for=1.1.1.1"),
                    ("x-real-ip", b"1.1.1.1"),
                ],
            );
            assert_eq!(key(&ex, &p), "198.51.100.9");
        }
    }

    #[test]
    fn walks_from_the_right_skipping_trusted_hops() {
        let ex = ClientIp::from_cidrs(["10.0.0.0/8", "2001:db8:ffff::/48"]).unwrap();
        let p = parts(
            "10.0.0.1:1",
            &[
                ("x-forwarded-for", b"6.6.6.6, 7.7.7.7"),
                ("x-forwarded-for", b"203.0.113.7 , 10.9.9.9"),
            ],
        );
        assert_eq!(key(&ex, &p), "203.0.113.7");
        // Garbage (or an unbalanced quote, or invalid UTF-8) left of the proxy's entry is ignored.
        let p = parts("10.0.0.1:1", &[("x-forwarded-for", b"\"\xff, junk\", 203.0.113.8")]);
        assert_eq!(key(&ex, &p), "203.0.113.8");
        // Garbage written by the proxy itself ends the walk at the proxy.
        let p = parts("10.0.0.1:1", &[("x-forwarded-for", b"203.0.113.7, unknown, 10.2.2.2")]);
        assert_eq!(key(&ex, &p), "10.2.2.2");
        // All hops trusted: the left-most.
        let p = parts("10.0.0.1:1", &[("x-forwarded-for", b"10.3.3.3, 10.2.2.2")]);
        assert_eq!(key(&ex, &p), "10.3.3.3");
        // No header: the peer.
        assert_eq!(key(&ex, &parts("10.0.0.1:1", &[])), "10.0.0.1");
    }

    #[test]
    fn forwarded_rfc7239_nodes() {
        let ex = ClientIp::new(["10.0.0.0/8".parse().unwrap()]).header(ForwardedHeader::Forwarded);
        let p = parts(
            "10.0.0.1:1",
            &[(
                "forwarded",
                b"for=6.6.6.6, for=\"[2001:db8:cafe:1:2::9]:4711\";proto=https, For=10.0.0.5:80",
            )],
        );
        assert_eq!(key(&ex, &p), "2001:db8:cafe:1::");
        let p = parts("10.0.0.1:1", &[("forwarded", b"for=_hidden, for=10.0.0.7")]);
        assert_eq!(key(&ex, &p), "10.0.0.7");
        let p = parts("10.0.0.1:1", &[("forwarded", b"for=\"198.51.100.1:_p1\"")]);
        assert_eq!(key(&ex, &p), "198.51.100.1");
    }

    #[test]
    fn x_real_ip_only_when_configured_and_single() {
        let ex = ClientIp::new(["10.0.0.0/8".parse().unwrap()]);
        let p = parts("10.0.0.1:1", &[("x-real-ip", b"203.0.113.7")]);
        assert_eq!(key(&ex, &p), "10.0.0.1");
        let ex = ex.header(ForwardedHeader::XRealIp);
        assert_eq!(key(&ex, &p), "203.0.113.7");
        let p = parts("10.0.0.1:1", &[("x-real-ip", b"203.0.113.7"), ("x-real-ip", b"1.1.1.1")]);
        assert_eq!(key(&ex, &p), "10.0.0.1");
    }

    #[test]
    fn ipv4_mapped_and_prefix_grouping() {
        let ex = PeerIp::new();
        let p = parts("[::ffff:192.0.2.1]:1", &[]);
        assert_eq!(ex.extract(&RequestHead::from(&p)), Some(Key::Ip("192.0.2.1".parse().unwrap())));
        let p = parts("[2001:db8:1:2:3:4:5:6]:1", &[]);
        assert_eq!(
            PeerIp::new().ipv6_prefix(48).extract(&RequestHead::from(&p)),
            Some(Key::Ip("2001:db8:1::".parse().unwrap()))
        );
        assert_eq!(
            PeerIp::new().ipv6_prefix(200).extract(&RequestHead::from(&p)),
            Some(Key::Ip("2001:db8:1:2:3:4:5:6".parse().unwrap()))
        );
    }
}
