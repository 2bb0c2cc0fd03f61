//! Keys: who or what is limited.
//!
//! A [`KeyExtractor`] reads a [`Key`] from the request head. Built-ins cover the peer address
//! ([`PeerIp`]), the client address behind trusted proxies ([`ClientIp`]), a header or API key
//! ([`HeaderKey`], also gRPC metadata), an authenticated user in the request extensions
//! ([`ExtensionKey`]), the route (`RouteKey`, with the `axum` feature), the method
//! ([`MethodKey`]), the gRPC method or service ([`GrpcMethod`]), one global bucket
//! ([`GlobalKey`]), tuples of these, and any closure `Fn(&RequestHead) -> Option<Key>`.
//!
//! ```
//! use std::net::SocketAddr;
//! use http::HeaderName;
//! use tollgate::key::{HeaderKey, Key, KeyExtractor, PeerIp, RequestHead};
//!
//! // One budget per client address and API key.
//! let key = (PeerIp::new(), HeaderKey::new(HeaderName::from_static("x-api-key")));
//! let mut req = http::Request::get("/").header("x-api-key", "k1").body(()).unwrap();
//! req.extensions_mut().insert("203.0.113.7:4000".parse::<SocketAddr>().unwrap());
//! let found = key.extract(&RequestHead::from(&req)).unwrap();
//! assert_eq!(found.to_string(), "t2(ip:203.0.113.7,s2:k1)");
//! ```
//!
//! A request without a key is handled as the layer's
//! [`missing_key`](crate::RateLimitLayerBuilder::missing_key) says; each extractor
//! [explains](KeyExtractor::explain_missing) what it looked for.

mod ip;

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;
use std::net::IpAddr;
use std::sync::Arc;

use http::request::Parts;
use http::{Extensions, HeaderMap, Method, Request, Uri, Version};

pub use ip::{ClientIp, DEFAULT_IPV6_PREFIX, ForwardedHeader, PeerIp, group_ip};

/// Longest header value used as a key, in bytes. Longer values count as a missing key, so an
/// attacker cannot make the store hold megabyte-sized keys.
pub const MAX_KEY_BYTES: usize = 256;

/// The identity being limited, read from each request by a [`KeyExtractor`]. Cheap to clone
/// (addresses inline, text behind an `Arc`). Its `Display` form is an unambiguous encoding
/// (used in Redis keys), `m` for the shared missing-key bucket.
///
/// ```
/// use std::net::IpAddr;
/// use tollgate::key::Key;
///
/// let ip = Key::from("203.0.113.7".parse::<IpAddr>().unwrap());
/// let user = Key::text("alice");
/// assert_eq!((Key::Global.to_string(), ip.to_string()), ("g".into(), "ip:203.0.113.7".into()));
/// assert_eq!(user.to_string(), "s5:alice"); // a tuple key: t2(ip:203.0.113.7,s5:alice)
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Key {
    /// One bucket for everything.
    Global,
    /// A client address ([`PeerIp`] and [`ClientIp`] group IPv6 by prefix, see [`group_ip`]).
    Ip(IpAddr),
    /// Text: a header value, user id, route, method.
    Text(Arc<str>),
    /// A composite key.
    Tuple(Arc<[Key]>),
    /// The shared bucket for requests without a key (see the layer's missing-key setting).
    Missing,
}

impl Key {
    /// A text key.
    pub fn text(s: impl Into<Arc<str>>) -> Self {
        Self::Text(s.into())
    }
}

impl Key {
    /// Feeds a compact, injective encoding of the key to `h` (a store's fingerprint): one write
    /// for an address, where the derived `Hash` makes several. Every variant starts with its own
    /// tag and is self-delimiting, so distinct keys feed distinct byte streams.
    #[inline]
    pub(crate) fn feed(&self, h: &mut impl std::hash::Hasher) {
        match self {
            Self::Global => h.write_u8(0),
            Self::Missing => h.write_u8(1),
            Self::Ip(IpAddr::V4(v4)) => h.write_u64((2 << 56) | u64::from(u32::from(*v4))),
            Self::Ip(IpAddr::V6(v6)) => {
                h.write_u8(3);
                h.write_u128(u128::from(*v6));
            }
            Self::Text(s) => {
                h.write_u8(4);
                h.write_usize(s.len());
                h.write(s.as_bytes());
            }
            Self::Tuple(items) => {
                h.write_u8(5);
                h.write_usize(items.len());
                for k in items.iter() {
                    k.feed(h);
                }
            }
        }
    }
}

impl From<IpAddr> for Key {
    fn from(ip: IpAddr) -> Self {
        Self::Ip(ip)
    }
}

impl From<&str> for Key {
    fn from(s: &str) -> Self {
        Self::Text(s.into())
    }
}

impl From<String> for Key {
    fn from(s: String) -> Self {
        Self::Text(s.into())
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Global => f.write_str("g"),
            Self::Ip(ip) => write!(f, "ip:{ip}"),
            // The length prefix makes the encoding unambiguous whatever the text holds.
            Self::Text(s) => write!(f, "s{}:{s}", s.len()),
            Self::Tuple(items) => {
                write!(f, "t{}(", items.len())?;
                for (i, k) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{k}")?;
                }
                f.write_str(")")
            }
            Self::Missing => f.write_str("m"),
        }
    }
}

/// A key as logs should show it: a keyed hash of it (64 bits, hexadecimal, behind `#`), the
/// same for the same key within this process and unrelated across processes, so that log
/// lines can be correlated without API keys and user ids landing in log files.
///
/// ```
/// use tollgate::key::{Key, Redacted};
///
/// let key = Key::text("sk_live_secret");
/// let shown = Redacted(&key).to_string();
/// assert!(shown.starts_with('#') && !shown.contains("secret"));
/// assert_eq!(shown, Redacted(&Key::text("sk_live_secret")).to_string());
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Redacted<'a>(pub &'a Key);

impl fmt::Display for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use std::hash::{BuildHasher, Hasher};
        static SECRET: std::sync::LazyLock<std::collections::hash_map::RandomState> =
            std::sync::LazyLock::new(std::collections::hash_map::RandomState::new);
        let mut h = SECRET.build_hasher();
        self.0.feed(&mut h);
        write!(f, "#{:016x}", h.finish())
    }
}

/// A request's head, borrowed, which key extractors and cost functions read. It is made from a
/// `&Request<B>` (without touching the body or copying anything) or from `&Parts`, and its
/// fields are named like [`Parts`]'s.
///
/// ```
/// use tollgate::key::RequestHead;
///
/// let req = http::Request::get("/acme/items").header("x-api-key", "k1").body(()).unwrap();
/// let head = RequestHead::from(&req);
/// assert_eq!(head.uri.path(), "/acme/items");
/// assert_eq!(head.headers["x-api-key"], "k1");
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct RequestHead<'a> {
    /// The method.
    pub method: &'a Method,
    /// The URI.
    pub uri: &'a Uri,
    /// The HTTP version.
    pub version: Version,
    /// The headers.
    pub headers: &'a HeaderMap,
    /// The extensions (the peer address, an authenticated user, axum's matched path ...).
    pub extensions: &'a Extensions,
}

impl<'a, B> From<&'a Request<B>> for RequestHead<'a> {
    #[inline]
    fn from(req: &'a Request<B>) -> Self {
        Self {
            method: req.method(),
            uri: req.uri(),
            version: req.version(),
            headers: req.headers(),
            extensions: req.extensions(),
        }
    }
}

impl<'a> From<&'a Parts> for RequestHead<'a> {
    #[inline]
    fn from(parts: &'a Parts) -> Self {
        Self {
            method: &parts.method,
            uri: &parts.uri,
            version: parts.version,
            headers: &parts.headers,
            extensions: &parts.extensions,
        }
    }
}

/// Reads the key of a request from its head. `None` means the request has no key; the layer
/// then applies its missing-key setting.
///
/// Implemented for closures `Fn(&RequestHead) -> Option<Key>` and for tuples of extractors
/// (whose key is the tuple of their keys, missing if any part is missing).
///
/// ```
/// use tollgate::key::{Key, KeyExtractor, RequestHead};
///
/// let by_tenant = |head: &RequestHead<'_>| {
///     head.uri.path().split('/').nth(1).map(|t| Key::text(t))
/// };
/// let req = http::Request::get("/acme/items").body(()).unwrap();
/// assert_eq!(by_tenant.extract(&RequestHead::from(&req)), Some(Key::text("acme")));
/// ```
pub trait KeyExtractor: Send + Sync + 'static {
    /// The key of this request, or `None`.
    fn extract(&self, head: &RequestHead<'_>) -> Option<Key>;

    /// Why [`extract`](Self::extract) found no key in `head`: which extractor, what it looked
    /// for, and the usual fix. Called only for requests without a key, to explain the refusal
    /// in the log and, when the layer is asked to, in the response
    /// ([`RateLimitLayerBuilder::explain_missing_key`](crate::RateLimitLayerBuilder::explain_missing_key)).
    /// The built-in extractors say precisely what was missing; the default names the type.
    fn explain_missing(&self, head: &RequestHead<'_>) -> KeyMissing {
        let _ = head;
        KeyMissing::new(
            std::any::type_name::<Self>(),
            "a key",
            "make requests carry what this extractor reads, or choose another `MissingKey`",
        )
    }
}

impl<F> KeyExtractor for F
where
    F: Fn(&RequestHead<'_>) -> Option<Key> + Send + Sync + 'static,
{
    fn extract(&self, head: &RequestHead<'_>) -> Option<Key> {
        self(head)
    }
}

/// Why a [`KeyExtractor`] found no key: which extractor, what it looked for, and the usual
/// fix. Its `Display` form is one sentence for logs and responses:
///
/// ```
/// use tollgate::key::{HeaderKey, KeyExtractor, RequestHead};
///
/// let req = http::Request::get("/").body(()).unwrap();
/// let why = HeaderKey::new(http::HeaderName::from_static("x-api-key"))
///     .explain_missing(&RequestHead::from(&req));
/// assert_eq!(why.looked_for(), "the `x-api-key` header, which the request does not have");
/// assert!(why.to_string().starts_with("HeaderKey found no key: it looked for the `x-api-key` header"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyMissing {
    extractor: Cow<'static, str>,
    looked_for: Cow<'static, str>,
    fix: Cow<'static, str>,
}

impl KeyMissing {
    /// `extractor` (its name) looked for `looked_for`; `fix` says what usually helps.
    pub fn new(
        extractor: impl Into<Cow<'static, str>>,
        looked_for: impl Into<Cow<'static, str>>,
        fix: impl Into<Cow<'static, str>>,
    ) -> Self {
        Self { extractor: extractor.into(), looked_for: looked_for.into(), fix: fix.into() }
    }

    /// The extractor's name, e.g. `PeerIp`.
    #[must_use]
    pub fn extractor(&self) -> &str {
        &self.extractor
    }

    /// What it looked for and did not find.
    #[must_use]
    pub fn looked_for(&self) -> &str {
        &self.looked_for
    }

    /// The usual fix.
    #[must_use]
    pub fn fix(&self) -> &str {
        &self.fix
    }
}

impl fmt::Display for KeyMissing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} found no key: it looked for {}. Fix: {}",
            self.extractor, self.looked_for, self.fix
        )
    }
}

macro_rules! tuple_extractor {
    ($($name:ident)+) => {
        impl<$($name: KeyExtractor),+> KeyExtractor for ($($name,)+) {
            #[allow(non_snake_case)]
            fn extract(&self, parts: &RequestHead<'_>) -> Option<Key> {
                let ($($name,)+) = self;
                Some(Key::Tuple(Arc::new([$($name.extract(parts)?),+])))
            }

            /// The first part without a key explains.
            #[allow(non_snake_case)]
            fn explain_missing(&self, parts: &RequestHead<'_>) -> KeyMissing {
                let ($($name,)+) = self;
                $(
                    if $name.extract(parts).is_none() {
                        return $name.explain_missing(parts);
                    }
                )+
                KeyMissing::new(std::any::type_name::<Self>(), "a key in each part", "none")
            }
        }
    };
}
tuple_extractor!(A B);
tuple_extractor!(A B C);
tuple_extractor!(A B C D);

/// One bucket shared by every request: a limit for the whole service.
///
/// ```
/// use tollgate::key::{GlobalKey, Key, KeyExtractor, RequestHead};
///
/// let req = http::Request::get("/anything").body(()).unwrap();
/// assert_eq!(GlobalKey.extract(&RequestHead::from(&req)), Some(Key::Global));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct GlobalKey;

impl KeyExtractor for GlobalKey {
    fn extract(&self, _: &RequestHead<'_>) -> Option<Key> {
        Some(Key::Global)
    }
}

/// The value of a request header, e.g. an API key, or of gRPC metadata. A value that is
/// missing, empty or longer than [`MAX_KEY_BYTES`] counts as no key, and bytes that are not
/// UTF-8 are kept (replaced by U+FFFD). When the header repeats, the first line is used.
///
/// ```
/// use http::HeaderName;
/// use tollgate::key::{HeaderKey, Key, KeyExtractor, RequestHead};
///
/// let req = http::Request::post("/shop.Cart/Add")
///     .header("content-type", "application/grpc")
///     .header("x-api-key", "k1")
///     .body(())
///     .unwrap();
/// let key = HeaderKey::new(HeaderName::from_static("x-api-key"));
/// assert_eq!(key.extract(&RequestHead::from(&req)), Some(Key::text("k1")));
/// ```
///
/// # gRPC metadata
///
/// ASCII metadata travel as HTTP/2 headers of the same (lowercase) name, so
/// `HeaderKey::new(HeaderName::from_static("x-api-key"))` keys a tonic service by the
/// `x-api-key` metadata a client set with `request.metadata_mut().insert("x-api-key", ..)`.
/// Binary metadata (names ending in `-bin`) travel base64-encoded, and the key is that text:
/// still one key per value.
#[derive(Debug, Clone)]
pub struct HeaderKey {
    name: http::HeaderName,
}

impl HeaderKey {
    /// Keys by header `name`.
    #[must_use]
    pub fn new(name: http::HeaderName) -> Self {
        Self { name }
    }
}

impl KeyExtractor for HeaderKey {
    fn extract(&self, parts: &RequestHead<'_>) -> Option<Key> {
        let v = parts.headers.get(&self.name)?.as_bytes();
        if v.is_empty() || v.len() > MAX_KEY_BYTES {
            return None;
        }
        Some(Key::Text(String::from_utf8_lossy(v).into()))
    }

    fn explain_missing(&self, parts: &RequestHead<'_>) -> KeyMissing {
        let name = &self.name;
        let what = match parts.headers.get(name).map(|v| v.len()) {
            None => "which the request does not have",
            Some(0) => "which the request sent empty",
            Some(_) => "whose value is longer than MAX_KEY_BYTES (256 bytes)",
        };
        KeyMissing::new(
            "HeaderKey",
            format!("the `{name}` header, {what}"),
            format!(
                "send `{name}` (gRPC: as metadata); to limit requests without it, choose \
                 `MissingKey::Shared` (one shared budget) or `MissingKey::Allow`, or exempt them \
                 with the layer's `filter`"
            ),
        )
    }
}

/// A value that an earlier layer (authentication) put in the request extensions, e.g. a
/// `UserId`, keyed by its `Display` form. No key when the request has none.
///
/// ```
/// use tollgate::key::{ExtensionKey, Key, KeyExtractor, RequestHead};
///
/// #[derive(Clone)]
/// struct UserId(u64);
///
/// impl std::fmt::Display for UserId {
///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
///         write!(f, "user:{}", self.0)
///     }
/// }
///
/// let mut req = http::Request::get("/").body(()).unwrap();
/// req.extensions_mut().insert(UserId(42)); // as an authentication layer would
/// let key = ExtensionKey::<UserId>::new();
/// assert_eq!(key.extract(&RequestHead::from(&req)), Some(Key::text("user:42")));
/// ```
pub struct ExtensionKey<T> {
    _t: PhantomData<fn() -> T>,
}

impl<T> ExtensionKey<T> {
    /// Keys by the extension of type `T`.
    #[must_use]
    pub fn new() -> Self {
        Self { _t: PhantomData }
    }
}

impl<T> Default for ExtensionKey<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Clone for ExtensionKey<T> {
    fn clone(&self) -> Self {
        Self::new()
    }
}

impl<T> fmt::Debug for ExtensionKey<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExtensionKey").field("type", &std::any::type_name::<T>()).finish()
    }
}

impl<T: fmt::Display + Send + Sync + 'static> KeyExtractor for ExtensionKey<T> {
    fn extract(&self, parts: &RequestHead<'_>) -> Option<Key> {
        parts.extensions.get::<T>().map(|v| Key::Text(v.to_string().into()))
    }

    fn explain_missing(&self, _: &RequestHead<'_>) -> KeyMissing {
        let ty = std::any::type_name::<T>();
        KeyMissing::new(
            format!("ExtensionKey<{ty}>"),
            format!("a `{ty}` in the request extensions"),
            "the layer that inserts it (authentication) must run before the rate limit: in \
             axum, add it with a later `.layer()` call (later calls wrap earlier ones); in a \
             `ServiceBuilder`, put it first",
        )
    }
}

/// The route template axum matched (`/users/{id}`, from `MatchedPath`): one bucket per route,
/// whatever the path parameters. No key when the router matched nothing, so add the layer with
/// `Router::route_layer` (or `Router::layer`), which run after routing.
///
/// ```
/// use axum::{Router, routing::get};
/// use tollgate::key::{PeerIp, RouteKey};
/// use tollgate::{Policy, Quota, RateLimitLayer};
///
/// // One budget per client and route: /users/1 and /users/2 share one.
/// let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_second(5)).unwrap())
///     .key((PeerIp::new(), RouteKey))
///     .build()
///     .unwrap();
/// let app: Router = Router::new().route("/users/{id}", get(|| async { "user" })).route_layer(layer);
/// ```
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteKey;

#[cfg(feature = "axum")]
impl KeyExtractor for RouteKey {
    fn extract(&self, parts: &RequestHead<'_>) -> Option<Key> {
        parts.extensions.get::<axum::extract::MatchedPath>().map(|p| Key::text(p.as_str()))
    }

    fn explain_missing(&self, _: &RequestHead<'_>) -> KeyMissing {
        KeyMissing::new(
            "RouteKey",
            "axum's `MatchedPath`, which axum sets once a route matched",
            "add the layer with `Router::route_layer` (or `Router::layer`), which run after \
             routing; a layer around the whole app (around `into_make_service`, or on a \
             fallback) runs before any route matched",
        )
    }
}

/// The request method: one bucket per method, or per client and method as part of a tuple.
///
/// ```
/// use tollgate::key::{Key, KeyExtractor, MethodKey, RequestHead};
///
/// let req = http::Request::post("/orders").body(()).unwrap();
/// assert_eq!(MethodKey.extract(&RequestHead::from(&req)), Some(Key::text("POST")));
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct MethodKey;

impl KeyExtractor for MethodKey {
    fn extract(&self, parts: &RequestHead<'_>) -> Option<Key> {
        Some(Key::text(parts.method.as_str()))
    }
}

/// The gRPC method of a call, from its path `/{package.Service}/{Method}` (gRPC over HTTP/2
/// protocol, "Path"): one bucket per method with [`GrpcMethod::new`], per service with
/// [`GrpcMethod::service`]. A path of another shape, or longer than [`MAX_KEY_BYTES`], has no
/// key.
///
/// ```
/// use tollgate::key::{GrpcMethod, Key, KeyExtractor, RequestHead};
///
/// let req = http::Request::post("/grpc.health.v1.Health/Check").body(()).unwrap();
/// let head = RequestHead::from(&req);
/// assert_eq!(GrpcMethod::new().extract(&head), Some(Key::text("/grpc.health.v1.Health/Check")));
/// assert_eq!(GrpcMethod::service().extract(&head), Some(Key::text("grpc.health.v1.Health")));
/// let req = http::Request::get("/index.html").body(()).unwrap();
/// assert_eq!(GrpcMethod::new().extract(&RequestHead::from(&req)), None);
/// ```
///
/// It reads the path only, so gRPC-Web calls (same paths) are keyed alike. Combine it with a
/// client key for a budget per client and method, `(PeerIp::new(), GrpcMethod::new())`; to give
/// methods different *policies*, choose the policy from the path with the layer's
/// [`select`](crate::RateLimitLayerBuilder::select) (or build one layer per method with a
/// [`filter`](crate::RateLimitLayerBuilder::filter)).
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcMethod {
    service_only: bool,
}

impl GrpcMethod {
    /// Keys by the whole method path, `/package.Service/Method`.
    #[must_use]
    pub const fn new() -> Self {
        Self { service_only: false }
    }

    /// Keys by the service, `package.Service`: all its methods share a bucket.
    #[must_use]
    pub const fn service() -> Self {
        Self { service_only: true }
    }

    /// The service and method of a gRPC path, `None` for any other shape.
    #[must_use]
    pub fn split(path: &str) -> Option<(&str, &str)> {
        let (service, method) = path.strip_prefix('/')?.split_once('/')?;
        let valid = !service.is_empty() && !method.is_empty() && !method.contains('/');
        valid.then_some((service, method))
    }
}

impl KeyExtractor for GrpcMethod {
    fn extract(&self, parts: &RequestHead<'_>) -> Option<Key> {
        let path = parts.uri.path();
        if path.len() > MAX_KEY_BYTES {
            return None;
        }
        let (service, _) = Self::split(path)?;
        Some(Key::text(if self.service_only { service } else { path }))
    }

    fn explain_missing(&self, parts: &RequestHead<'_>) -> KeyMissing {
        let path = parts.uri.path();
        let what = if path.len() > MAX_KEY_BYTES {
            "a path of at most MAX_KEY_BYTES (256 bytes)".to_owned()
        } else {
            format!("a gRPC path `/package.Service/Method`, and the request's is `{path}`")
        };
        KeyMissing::new(
            "GrpcMethod",
            what,
            "limit only gRPC calls with this extractor: exempt other requests with the \
             layer's `filter` (e.g. `tollgate::grpc::is_grpc`)",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_method_needs_service_and_method() {
        let key = |ex: GrpcMethod, path: &str| {
            let req = http::Request::post(path).body(()).unwrap();
            ex.extract(&RequestHead::from(&req))
        };
        assert_eq!(key(GrpcMethod::new(), "/a.B/C"), Some(Key::text("/a.B/C")));
        assert_eq!(key(GrpcMethod::service(), "/a.B/C"), Some(Key::text("a.B")));
        for path in ["/", "/a.B", "/a.B/", "//C", "/a.B/C/D"] {
            assert_eq!(key(GrpcMethod::new(), path), None, "{path}");
        }
        let long = format!("/a.B/{}", "m".repeat(MAX_KEY_BYTES));
        assert_eq!(key(GrpcMethod::new(), &long), None);
    }

    #[test]
    fn display_is_unambiguous() {
        let a = Key::Tuple(Arc::new([Key::text("a,s1:b"), Key::text("c")]));
        let b = Key::Tuple(Arc::new([Key::text("a"), Key::text("b,s1:c")]));
        assert_ne!(a.to_string(), b.to_string());
        assert_eq!(a.to_string(), "t2(s6:a,s1:b,s1:c)");
        assert_eq!(Key::Ip("2001:db8::".parse().unwrap()).to_string(), "ip:2001:db8::");
    }

    #[test]
    fn header_key_rejects_oversized_and_empty() {
        let ex = HeaderKey::new(http::HeaderName::from_static("x-api-key"));
        let parts = |v: &[u8]| {
            http::Request::get("/")
                .header("x-api-key", http::HeaderValue::from_bytes(v).unwrap())
                .body(())
                .unwrap()
                .into_parts()
                .0
        };
        assert_eq!(ex.extract(&RequestHead::from(&parts(b"k1"))), Some(Key::text("k1")));
        assert_eq!(ex.extract(&RequestHead::from(&parts(b""))), None);
        assert_eq!(ex.extract(&RequestHead::from(&parts(&[b'a'; 257]))), None);
        assert_eq!(
            ex.extract(&RequestHead::from(&parts(&[0xff, b'a']))),
            Some(Key::text("\u{fffd}a"))
        );
    }
}
