//! The key extractor a rule names: one of the built-in extractors, or a tuple of them.

use std::sync::Arc;

use ipnet::IpNet;

use super::schema::KeyPart;
#[cfg(feature = "axum")]
use crate::key::RouteKey;
use crate::key::{
    ClientIp, ForwardedHeader, GlobalKey, GrpcMethod, HeaderKey, Key, KeyExtractor, KeyMissing,
    MethodKey, PeerIp, RequestHead,
};

/// What a rule says about its key, checked.
#[derive(Debug, Clone)]
pub(super) struct KeySpec {
    pub(super) parts: Vec<KeyPart>,
    pub(super) trusted: Vec<IpNet>,
    pub(super) forwarded: ForwardedHeader,
    pub(super) ipv6_prefix: Option<u8>,
}

impl Default for KeySpec {
    /// The builder's default: the peer address.
    fn default() -> Self {
        Self {
            parts: vec![KeyPart::PeerIp],
            trusted: Vec::new(),
            forwarded: ForwardedHeader::default(),
            ipv6_prefix: None,
        }
    }
}

impl KeySpec {
    /// The extractor.
    pub(super) fn extractor(&self) -> ConfKey {
        let one = |part: &KeyPart| match part {
            KeyPart::PeerIp => {
                let mut peer = PeerIp::new();
                if let Some(bits) = self.ipv6_prefix {
                    peer = peer.ipv6_prefix(bits);
                }
                Part::Peer(peer)
            }
            KeyPart::ClientIp => {
                let mut client = ClientIp::new(self.trusted.iter().copied()).header(self.forwarded);
                if let Some(bits) = self.ipv6_prefix {
                    client = client.ipv6_prefix(bits);
                }
                Part::Client(client)
            }
            KeyPart::Header(name) => Part::Header(HeaderKey::new(name.clone())),
            #[cfg(feature = "axum")]
            KeyPart::Route => Part::Route(RouteKey),
            KeyPart::Method => Part::Method(MethodKey),
            KeyPart::Global => Part::Global,
            KeyPart::GrpcMethod => Part::Grpc(GrpcMethod::new()),
            KeyPart::GrpcService => Part::Grpc(GrpcMethod::service()),
        };
        match &self.parts[..] {
            [part] => ConfKey::One(one(part)),
            parts => ConfKey::Tuple(parts.iter().map(one).collect()),
        }
    }
}

/// One built-in extractor.
#[derive(Debug, Clone)]
pub(super) enum Part {
    Peer(PeerIp),
    Client(ClientIp),
    Header(HeaderKey),
    #[cfg(feature = "axum")]
    Route(RouteKey),
    Method(MethodKey),
    Global,
    Grpc(GrpcMethod),
}

impl Part {
    #[inline]
    fn extract(&self, head: &RequestHead<'_>) -> Option<Key> {
        match self {
            Self::Peer(e) => e.extract(head),
            Self::Client(e) => e.extract(head),
            Self::Header(e) => e.extract(head),
            #[cfg(feature = "axum")]
            Self::Route(e) => e.extract(head),
            Self::Method(e) => e.extract(head),
            Self::Global => Some(Key::Global),
            Self::Grpc(e) => e.extract(head),
        }
    }

    fn explain_missing(&self, head: &RequestHead<'_>) -> KeyMissing {
        match self {
            Self::Peer(e) => e.explain_missing(head),
            Self::Client(e) => e.explain_missing(head),
            Self::Header(e) => e.explain_missing(head),
            #[cfg(feature = "axum")]
            Self::Route(e) => e.explain_missing(head),
            Self::Method(e) => e.explain_missing(head),
            Self::Global => GlobalKey.explain_missing(head),
            Self::Grpc(e) => e.explain_missing(head),
        }
    }
}

/// The extractor of a configured rule: one part, or a tuple whose key is missing when a part's
/// is (as for the tuple extractors of [`KeyExtractor`]).
#[derive(Debug, Clone)]
pub(super) enum ConfKey {
    One(Part),
    Tuple(Box<[Part]>),
}

impl KeyExtractor for ConfKey {
    fn extract(&self, head: &RequestHead<'_>) -> Option<Key> {
        match self {
            Self::One(part) => part.extract(head),
            Self::Tuple(parts) => {
                let keys = parts.iter().map(|p| p.extract(head)).collect::<Option<Vec<_>>>()?;
                Some(Key::Tuple(Arc::from(keys)))
            }
        }
    }

    /// The first part without a key explains.
    fn explain_missing(&self, head: &RequestHead<'_>) -> KeyMissing {
        let parts = match self {
            Self::One(part) => std::slice::from_ref(part),
            Self::Tuple(parts) => &parts[..],
        };
        match parts.iter().find(|p| p.extract(head).is_none()).or(parts.first()) {
            Some(part) => part.explain_missing(head),
            None => KeyMissing::new("a configured key", "a key", "configure at least one key"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;

    #[test]
    fn tuples_match_the_built_in_tuple_extractor() {
        let spec = KeySpec {
            parts: vec![
                KeyPart::ClientIp,
                KeyPart::Header(http::HeaderName::from_static("x-api-key")),
            ],
            trusted: vec!["10.0.0.0/8".parse().unwrap()],
            ..KeySpec::default()
        };
        let mut req = http::Request::get("/")
            .header("x-forwarded-for", "203.0.113.7")
            .header("x-api-key", "k1")
            .body(())
            .unwrap();
        req.extensions_mut().insert("10.0.0.1:5000".parse::<SocketAddr>().unwrap());
        let head = RequestHead::from(&req);
        let builtin = (
            ClientIp::from_cidrs(["10.0.0.0/8"]).unwrap(),
            HeaderKey::new(http::HeaderName::from_static("x-api-key")),
        );
        assert_eq!(spec.extractor().extract(&head), builtin.extract(&head));
        assert!(matches!(spec.extractor().extract(&head), Some(Key::Tuple(ref k)) if k.len() == 2));
        // A missing part: no key.
        let req = http::Request::get("/").header("x-api-key", "k1").body(()).unwrap();
        assert_eq!(spec.extractor().extract(&RequestHead::from(&req)), None);
    }

    #[test]
    fn ipv6_prefix_applies_to_addresses() {
        let spec = KeySpec { ipv6_prefix: Some(48), ..KeySpec::default() };
        let mut req = http::Request::get("/").body(()).unwrap();
        req.extensions_mut().insert("[2001:db8:1:2::9]:1".parse::<SocketAddr>().unwrap());
        assert_eq!(
            spec.extractor().extract(&RequestHead::from(&req)),
            Some(Key::Ip("2001:db8:1::".parse().unwrap()))
        );
    }
}
