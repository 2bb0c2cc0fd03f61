//! The document as written: serde types that keep the spans of the values checked after
//! parsing, and the small string grammars (`header:x-api-key`, `reject:401`, `/api/*`) that
//! are checked while parsing, so that their errors carry the value's place.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::net::IpAddr;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};
use ipnet::IpNet;
use serde::Deserialize;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use toml::Spanned;

use crate::quota::{Algorithm, CalendarPeriod, Unit};

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawFile {
    /// Whether this file may replace every running policy, or run with none (off by default:
    /// a file caught mid-rewrite is often empty).
    #[serde(default)]
    pub(super) replace_all: bool,
    #[serde(default)]
    pub(super) policies: BTreeMap<String, Spanned<RawPolicy>>,
    #[serde(default)]
    pub(super) rules: Vec<Spanned<RawRule>>,
}

/// `[policies.NAME]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPolicy {
    #[serde(default)]
    pub(super) algorithm: Option<AlgorithmName>,
    pub(super) tiers: Spanned<Vec<RawTier>>,
    #[serde(default)]
    pub(super) changed_tiers: Option<crate::store::Carry>,
}

/// `[[policies.NAME.tiers]]`: every field a tier of any kind may have. Which fields a kind
/// takes, and which it needs, is checked after parsing (`build::tier`), where the kind is
/// known; `period` is a duration for a rate tier and a calendar unit for a calendar tier, so
/// it is read as text and parsed there, at its own span.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawTier {
    pub(super) name: Spanned<String>,
    #[serde(default)]
    pub(super) kind: Option<Spanned<TierKindName>>,
    #[serde(default)]
    pub(super) count: Option<Spanned<u64>>,
    #[serde(default)]
    pub(super) period: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) burst: Option<Spanned<u64>>,
    #[serde(default)]
    pub(super) unit: Option<Spanned<UnitName>>,
    #[serde(default)]
    pub(super) time_zone: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) max: Option<Spanned<u64>>,
    #[serde(default)]
    pub(super) lease: Option<Spanned<HumanDuration>>,
    #[serde(default)]
    pub(super) typical_hold: Option<Spanned<HumanDuration>>,
    /// Penalty box: how long a key that breaches the tier is blocked.
    #[serde(default)]
    pub(super) block: Option<Spanned<HumanDuration>>,
    /// Penalty box: the breaches that start a block (default 1).
    #[serde(default)]
    pub(super) block_after: Option<Spanned<u32>>,
    /// Penalty box: the window those breaches are counted in.
    #[serde(default)]
    pub(super) block_window: Option<Spanned<HumanDuration>>,
    /// Reserved capacity: units only critical requests may use.
    #[serde(default)]
    pub(super) reserve_critical: Option<Spanned<u64>>,
    /// Reserved capacity: units more that sheddable requests may not use.
    #[serde(default)]
    pub(super) reserve_standard: Option<Spanned<u64>>,
}

/// A tier's `kind`: `rate` (default), `concurrency`, `calendar`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum TierKindName {
    Rate,
    Concurrency,
    Calendar,
}

impl TierKindName {
    pub(super) const fn name(self) -> &'static str {
        match self {
            Self::Rate => "rate",
            Self::Concurrency => "concurrency",
            Self::Calendar => "calendar",
        }
    }
}

/// [`Unit`] by its [name](Unit::name).
#[derive(Debug, Clone, Copy)]
pub(super) struct UnitName(pub(super) Unit);

/// Every unit a tier may count, in the order the messages list them.
const UNITS: [Unit; 6] = [
    Unit::Requests,
    Unit::RequestBytes,
    Unit::ResponseBytes,
    Unit::Reported,
    Unit::RequestMessages,
    Unit::ResponseMessages,
];

impl TryFrom<String> for UnitName {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        match UNITS.iter().find(|u| u.name() == s) {
            Some(u) => Ok(Self(*u)),
            None => {
                let names: Vec<_> = UNITS.iter().map(|u| u.name()).collect();
                Err(format!("unknown unit {s:?}; expected one of {}", names.join(", ")))
            }
        }
    }
}

/// A calendar tier's `period`: a [`CalendarPeriod`] by its [name](CalendarPeriod::name).
pub(super) fn calendar_period(s: &str) -> Result<CalendarPeriod, String> {
    CalendarPeriod::ALL.iter().find(|p| p.name() == s).copied().ok_or_else(|| {
        let names: Vec<_> = CalendarPeriod::ALL.iter().map(|p| p.name()).collect();
        format!("{s:?} is not a calendar period; expected one of {}", names.join(", "))
    })
}

/// A rate tier's `period`: a duration, with a hint when it names a calendar unit.
pub(super) fn rate_period(s: &str) -> Result<Duration, String> {
    HumanDuration::try_from(s.to_owned()).map(|d| d.0).map_err(|e| {
        if calendar_period(s).is_ok() {
            format!("{e}; for windows of the calendar (from the start of each {s}), write kind = \"calendar\"")
        } else {
            e
        }
    })
}

/// `[[rules]]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRule {
    pub(super) name: Spanned<String>,
    #[serde(default)]
    pub(super) paths: Option<Spanned<Vec<PathPattern>>>,
    #[serde(default)]
    pub(super) skip_paths: Vec<PathPattern>,
    #[serde(default)]
    pub(super) methods: Option<Spanned<Vec<MethodName>>>,
    #[serde(default)]
    pub(super) skip_methods: Vec<MethodName>,
    #[serde(default)]
    pub(super) key: Option<Spanned<KeyField>>,
    #[serde(default)]
    pub(super) trusted_proxies: Option<Spanned<Vec<Cidr>>>,
    #[serde(default)]
    pub(super) forwarded_header: Option<Spanned<crate::key::ForwardedHeader>>,
    #[serde(default)]
    pub(super) ipv6_prefix: Option<Spanned<u8>>,
    #[serde(default)]
    pub(super) missing_key: Option<MissingKeyName>,
    #[serde(default)]
    pub(super) policy: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) plan: Option<Spanned<RawPlan>>,
    #[serde(default)]
    pub(super) cost: Option<Spanned<u64>>,
    #[serde(default)]
    pub(super) allow_keys: Vec<String>,
    #[serde(default)]
    pub(super) allow_cidrs: Option<Spanned<Vec<Cidr>>>,
    #[serde(default)]
    pub(super) dry_run: bool,
    #[serde(default)]
    pub(super) max_delay: Option<HumanDuration>,
    #[serde(default)]
    pub(super) max_waiters: Option<Spanned<usize>>,
    #[serde(default)]
    pub(super) tarpit: Option<HumanDuration>,
    #[serde(default)]
    pub(super) headers: Option<crate::HeaderStyle>,
    #[serde(default)]
    pub(super) on_store_error: Option<crate::OnStoreError>,
    #[serde(default)]
    pub(super) on_stream: Option<crate::StreamMode>,
    #[serde(default)]
    pub(super) log_keys: Option<crate::layer::LogKeys>,
    #[serde(default)]
    pub(super) header_format: Option<crate::HeaderFormat>,
    #[serde(default)]
    pub(super) explain_missing_key: Option<bool>,
    #[serde(default)]
    pub(super) refund_on: Option<Spanned<Vec<StatusMatch>>>,
    #[serde(default)]
    pub(super) priority_header: Option<HeaderNameValue>,
}

/// `plan = { header = "x-plan", policies = ["free", "pro"], otherwise = "policy:free" }`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPlan {
    pub(super) header: HeaderNameValue,
    pub(super) policies: Spanned<Vec<Spanned<String>>>,
    pub(super) otherwise: Spanned<Otherwise>,
}

/// Implements `Deserialize` for a type read from a string by a `TryFrom<String>` whose error
/// is the message. The string is converted in the visitor, inside the value's deserialization,
/// so that the error gets the value's span (an array element's own, not the array's).
macro_rules! from_string {
    ($($t:ty),+ $(,)?) => {$(
        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct Text;
                impl<'de> Visitor<'de> for Text {
                    type Value = $t;

                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str("a string")
                    }

                    fn visit_str<E: de::Error>(self, v: &str) -> Result<$t, E> {
                        <$t>::try_from(v.to_owned()).map_err(E::custom)
                    }
                }
                d.deserialize_str(Text)
            }
        }
    )+};
}

from_string!(
    HumanDuration,
    AlgorithmName,
    KeyPart,
    PathPattern,
    MethodName,
    Cidr,
    HeaderNameValue,
    Otherwise,
    MissingKeyName,
    UnitName,
    StatusMatch
);

/// A duration in humantime's form: `"500ms"`, `"1m"`, `"1h 30m"`, `"2days"`.
#[derive(Debug, Clone, Copy)]
pub(super) struct HumanDuration(pub(super) Duration);

impl TryFrom<String> for HumanDuration {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        humantime::parse_duration(&s).map(Self).map_err(|e| format!("invalid duration {s:?}: {e}"))
    }
}

/// An [`Algorithm`] by its [name](Algorithm::name).
#[derive(Debug, Clone, Copy)]
pub(super) struct AlgorithmName(pub(super) Algorithm);

impl TryFrom<String> for AlgorithmName {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        match Algorithm::ALL.iter().find(|a| a.name() == s) {
            Some(a) => Ok(Self(*a)),
            None => {
                let names: Vec<_> = Algorithm::ALL.iter().map(|a| a.name()).collect();
                Err(format!("unknown algorithm {s:?}; expected one of {}", names.join(", ")))
            }
        }
    }
}

/// One key extractor by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum KeyPart {
    PeerIp,
    ClientIp,
    Header(HeaderName),
    #[cfg(feature = "axum")]
    Route,
    Method,
    Global,
    GrpcMethod,
    GrpcService,
}

/// The names of the key extractors, for messages.
pub(super) const KEY_NAMES: &str =
    "peer_ip, client_ip, header:<name>, route, method, global, grpc_method, grpc_service";

impl TryFrom<String> for KeyPart {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        Ok(match s.as_str() {
            "peer_ip" => Self::PeerIp,
            "client_ip" => Self::ClientIp,
            #[cfg(feature = "axum")]
            "route" => Self::Route,
            #[cfg(not(feature = "axum"))]
            "route" => return Err("the `route` key needs tollgate's `axum` feature".into()),
            "method" => Self::Method,
            "global" => Self::Global,
            "grpc_method" => Self::GrpcMethod,
            "grpc_service" => Self::GrpcService,
            _ => match s.strip_prefix("header:") {
                Some(name) => Self::Header(
                    HeaderName::from_bytes(name.trim().as_bytes())
                        .map_err(|_| format!("{name:?} is not a header name"))?,
                ),
                None => return Err(format!("unknown key extractor {s:?}; expected {KEY_NAMES}")),
            },
        })
    }
}

/// `key = "peer_ip"` or `key = ["client_ip", "method"]` (a composite key).
#[derive(Debug)]
pub(super) struct KeyField(pub(super) Vec<Spanned<KeyPart>>);

impl<'de> Deserialize<'de> for KeyField {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct OneOrMany(PhantomData<KeyField>);
        impl<'de> Visitor<'de> for OneOrMany {
            type Value = KeyField;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a key extractor's name or a list of them")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<KeyField, E> {
                // The span is the field's, kept by the caller's `Spanned<KeyField>`.
                Ok(KeyField(vec![Spanned::new(
                    0..0,
                    KeyPart::try_from(v.to_owned()).map_err(E::custom)?,
                )]))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<KeyField, A::Error> {
                let mut parts = Vec::new();
                while let Some(part) = seq.next_element::<Spanned<KeyPart>>()? {
                    parts.push(part);
                }
                Ok(KeyField(parts))
            }
        }
        d.deserialize_any(OneOrMany(PhantomData))
    }
}

/// Which request paths a rule applies to: `"/login"` exactly, `"/api/*"` everything under
/// `/api/`, `"*"` everything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum PathPattern {
    Exact(Box<str>),
    Prefix(Box<str>),
}

impl PathPattern {
    #[inline]
    pub(super) fn matches(&self, path: &str) -> bool {
        match self {
            Self::Exact(p) => path == &**p,
            Self::Prefix(p) => path.starts_with(&**p),
        }
    }
}

impl TryFrom<String> for PathPattern {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        let (body, prefix) = match s.strip_suffix('*') {
            Some(body) => (body, true),
            None => (s.as_str(), false),
        };
        let shaped = (body.starts_with('/') || (prefix && body.is_empty())) && !body.contains('*');
        if !shaped {
            return Err(format!(
                "{s:?} is not a path pattern: \"/exact\", \"/prefix/*\" or \"*\" (a `*` only at the end)"
            ));
        }
        Ok(if prefix { Self::Prefix(body.into()) } else { Self::Exact(body.into()) })
    }
}

/// An HTTP method, case-sensitive (RFC 9110 §9.1).
#[derive(Debug, Clone)]
pub(super) struct MethodName(pub(super) Method);

impl TryFrom<String> for MethodName {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        let method =
            Method::from_bytes(s.as_bytes()).map_err(|_| format!("{s:?} is not a method"))?;
        let upper = s.to_ascii_uppercase();
        let standard =
            ["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"];
        if upper != s && standard.contains(&upper.as_str()) {
            return Err(format!(
                "methods are case-sensitive (RFC 9110 §9.1): {s:?} is not {upper:?}"
            ));
        }
        Ok(Self(method))
    }
}

/// A network: a CIDR (`10.0.0.0/8`, `2001:db8::/32`) or a single address.
#[derive(Debug, Clone)]
pub(super) struct Cidr {
    pub(super) net: IpNet,
    pub(super) text: String,
}

impl TryFrom<String> for Cidr {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        let t = s.trim();
        let net = t
            .parse::<IpNet>()
            .or_else(|_| t.parse::<IpAddr>().map(IpNet::from))
            .map_err(|_| format!("{s:?} is not a CIDR (\"10.0.0.0/8\") or an address"))?;
        Ok(Self { net: net.trunc(), text: t.to_owned() })
    }
}

/// A header name (lowercased).
#[derive(Debug, Clone)]
pub(super) struct HeaderNameValue(pub(super) HeaderName);

impl TryFrom<String> for HeaderNameValue {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        HeaderName::from_bytes(s.trim().as_bytes())
            .map(Self)
            .map_err(|_| format!("{s:?} is not a header name"))
    }
}

/// `reject`, `reject:<status>` (400 to 599).
fn reject_status(s: &str, default: StatusCode) -> Option<Result<StatusCode, String>> {
    if s == "reject" {
        return Some(Ok(default));
    }
    let code = s.strip_prefix("reject:")?;
    Some(
        code.trim()
            .parse::<u16>()
            .ok()
            .and_then(|c| StatusCode::from_u16(c).ok())
            .filter(|c| c.is_client_error() || c.is_server_error())
            .ok_or_else(|| format!("{code:?} is not a status from 400 to 599")),
    )
}

/// What a plan does with a request whose header names none of its policies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Otherwise {
    /// `policy:<name>`: that policy.
    Policy(String),
    /// `pass`: unlimited.
    Pass,
    /// `reject` (403) or `reject:<status>`.
    Reject(StatusCode),
}

impl TryFrom<String> for Otherwise {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        if s == "pass" {
            return Ok(Self::Pass);
        }
        if let Some(status) = reject_status(&s, StatusCode::FORBIDDEN) {
            return status.map(Self::Reject);
        }
        match s.strip_prefix("policy:") {
            Some(name) if !name.is_empty() => Ok(Self::Policy(name.to_owned())),
            _ => Err(format!(
                "{s:?} is not \"policy:<name>\", \"pass\", \"reject\" or \"reject:<status>\""
            )),
        }
    }
}

/// `missing_key`: `reject` (400), `reject:<status>`, `allow`, `shared`.
#[derive(Debug, Clone, Copy)]
pub(super) struct MissingKeyName(pub(super) crate::MissingKey);

impl TryFrom<String> for MissingKeyName {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        use crate::MissingKey;
        match s.as_str() {
            "allow" => Ok(Self(MissingKey::Allow)),
            "shared" => Ok(Self(MissingKey::Shared)),
            _ => match reject_status(&s, StatusCode::BAD_REQUEST) {
                Some(status) => status.map(|s| Self(MissingKey::Reject(s))),
                None => Err(format!(
                    "{s:?} is not \"reject\", \"reject:<status>\", \"allow\" or \"shared\""
                )),
            },
        }
    }
}

/// A response status a rule's `refund_on` lists: `"503"`, or a class, `"5xx"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StatusMatch {
    Exact(StatusCode),
    /// The first digit of the class: 1 to 5.
    Class(u16),
}

impl StatusMatch {
    pub(super) fn matches(self, status: StatusCode) -> bool {
        match self {
            Self::Exact(s) => s == status,
            Self::Class(c) => status.as_u16() / 100 == c,
        }
    }
}

impl TryFrom<String> for StatusMatch {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        let t = s.trim();
        let bad = || format!("{s:?} is not a status (\"503\") or a class of them (\"5xx\")");
        if let Some(class) = t.strip_suffix("xx") {
            return match class.parse::<u16>() {
                Ok(c @ 1..=5) if class.len() == 1 => Ok(Self::Class(c)),
                _ => Err(bad()),
            };
        }
        t.parse::<u16>()
            .ok()
            .filter(|c| (100..600).contains(c))
            .and_then(|c| StatusCode::from_u16(c).ok())
            .map(Self::Exact)
            .ok_or_else(bad)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The settings a file names, read into the public types by the names the docs give.
    #[test]
    fn settings_read_by_their_names() {
        use crate::key::ForwardedHeader as F;
        use crate::layer::LogKeys;
        use crate::store::Carry;
        use crate::{HeaderFormat, HeaderStyle, OnStoreError, StreamMode};
        #[derive(Deserialize)]
        struct Value<T> {
            v: T,
        }
        fn read<T: for<'de> Deserialize<'de>>(name: &str) -> Result<T, String> {
            let doc = format!("v = \"{name}\"");
            toml::from_str::<Value<T>>(&doc).map(|w| w.v).map_err(|e| e.message().to_owned())
        }
        let styles = [
            ("ietf", HeaderStyle::Ietf),
            ("legacy", HeaderStyle::Legacy),
            ("both", HeaderStyle::Both),
            ("none", HeaderStyle::None),
        ];
        for (name, style) in styles {
            assert_eq!(read(name), Ok(style));
        }
        let formats = [
            ("draft10", HeaderFormat::Draft10),
            ("draft7", HeaderFormat::Draft7),
            ("draft6", HeaderFormat::Draft6),
        ];
        for (name, format) in formats {
            assert_eq!(read(name), Ok(format));
        }
        assert_eq!(read("fail_open"), Ok(OnStoreError::FailOpen));
        assert_eq!(read("fail_closed"), Ok(OnStoreError::FailClosed));
        assert_eq!(read("settle"), Ok(StreamMode::Settle));
        assert_eq!(read("shape"), Ok(StreamMode::Shape));
        assert_eq!(read("police"), Ok(StreamMode::Police));
        assert_eq!(read("start_full"), Ok(Carry::StartFull));
        assert_eq!(read("carry_used_fraction"), Ok(Carry::UsedFraction));
        assert_eq!(read("redacted"), Ok(LogKeys::Redacted));
        assert_eq!(read("raw"), Ok(LogKeys::Raw));
        assert_eq!(read("x-forwarded-for"), Ok(F::XForwardedFor));
        assert_eq!(read("forwarded"), Ok(F::Forwarded));
        assert_eq!(read("x-real-ip"), Ok(F::XRealIp));
        assert_eq!(
            read::<HeaderStyle>("Ietf"),
            Err("unknown variant `Ietf`, expected one of `ietf`, `legacy`, `both`, `none`".into())
        );
        assert!(read::<Carry>("used_fraction").is_err());
    }

    fn path(s: &str) -> Result<PathPattern, String> {
        PathPattern::try_from(s.to_owned())
    }

    #[test]
    fn path_patterns_are_exact_or_prefixes() {
        assert_eq!(path("/login"), Ok(PathPattern::Exact("/login".into())));
        assert_eq!(path("/api/*"), Ok(PathPattern::Prefix("/api/".into())));
        assert_eq!(path("*"), Ok(PathPattern::Prefix("".into())));
        assert!(path("/api/*").unwrap().matches("/api/items"));
        assert!(!path("/api/*").unwrap().matches("/api"));
        assert!(!path("/login").unwrap().matches("/login/x"));
        for bad in ["api/*", "", "/a*/b", "/a/**"] {
            assert!(path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn small_grammars() {
        let part = |s: &str| KeyPart::try_from(s.to_owned());
        assert_eq!(
            part("header:X-Api-Key"),
            Ok(KeyPart::Header(HeaderName::from_static("x-api-key")))
        );
        assert_eq!(part("grpc_service"), Ok(KeyPart::GrpcService));
        assert_eq!(
            part("ip").unwrap_err(),
            format!("unknown key extractor \"ip\"; expected {KEY_NAMES}")
        );
        assert_eq!(part("header:a b").unwrap_err(), "\"a b\" is not a header name");

        let otherwise = |s: &str| Otherwise::try_from(s.to_owned());
        assert_eq!(otherwise("pass"), Ok(Otherwise::Pass));
        assert_eq!(otherwise("reject"), Ok(Otherwise::Reject(StatusCode::FORBIDDEN)));
        assert_eq!(otherwise("reject:429"), Ok(Otherwise::Reject(StatusCode::TOO_MANY_REQUESTS)));
        assert_eq!(otherwise("policy:free"), Ok(Otherwise::Policy("free".into())));
        assert_eq!(otherwise("reject:200").unwrap_err(), "\"200\" is not a status from 400 to 599");
        assert!(otherwise("free").is_err());

        let missing = |s: &str| MissingKeyName::try_from(s.to_owned()).map(|m| m.0);
        assert_eq!(missing("reject"), Ok(crate::MissingKey::Reject(StatusCode::BAD_REQUEST)));
        assert_eq!(missing("reject:401"), Ok(crate::MissingKey::Reject(StatusCode::UNAUTHORIZED)));
        assert_eq!(missing("shared"), Ok(crate::MissingKey::Shared));
        assert!(missing("deny").is_err());

        let method = |s: &str| MethodName::try_from(s.to_owned()).map(|m| m.0);
        assert_eq!(method("POST"), Ok(Method::POST));
        assert_eq!(method("PURGE"), Ok(Method::from_bytes(b"PURGE").unwrap()));
        assert!(method("post").unwrap_err().contains("case-sensitive"));

        let cidr = |s: &str| Cidr::try_from(s.to_owned()).map(|c| c.net.to_string());
        assert_eq!(cidr("10.1.2.3/8"), Ok("10.0.0.0/8".into()));
        assert_eq!(cidr("192.0.2.7"), Ok("192.0.2.7/32".into()));
        assert!(cidr("10.0.0.0/33").is_err());

        let status = |s: &str| StatusMatch::try_from(s.to_owned());
        assert_eq!(status("503"), Ok(StatusMatch::Exact(StatusCode::SERVICE_UNAVAILABLE)));
        assert_eq!(status("5xx"), Ok(StatusMatch::Class(5)));
        assert!(status("5xx").unwrap().matches(StatusCode::BAD_GATEWAY));
        assert!(!status("5xx").unwrap().matches(StatusCode::TOO_MANY_REQUESTS));
        assert!(!status("503").unwrap().matches(StatusCode::BAD_GATEWAY));
        for bad in ["6xx", "0xx", "50x", "55xx", "99", "600", "x", ""] {
            assert!(status(bad).is_err(), "{bad}");
        }

        assert_eq!(calendar_period("week"), Ok(CalendarPeriod::Week));
        assert!(calendar_period("weekly").is_err());
        assert_eq!(rate_period("90s"), Ok(Duration::from_secs(90)));
        assert!(!rate_period("1 fortnight").unwrap_err().contains("calendar"));
        assert!(rate_period("day").unwrap_err().contains("kind = \"calendar\""));
        assert_eq!(UnitName::try_from("response_bytes".to_owned()).unwrap().0, Unit::ResponseBytes);
        assert_eq!(
            UnitName::try_from("request_messages".to_owned()).unwrap().0,
            Unit::RequestMessages
        );
        assert_eq!(
            UnitName::try_from("response_messages".to_owned()).unwrap().0,
            Unit::ResponseMessages
        );

        assert_eq!(
            HumanDuration::try_from("1h 30m".to_owned()).unwrap().0,
            Duration::from_secs(5400)
        );
        assert!(
            HumanDuration::try_from("1 fortnight".to_owned())
                .unwrap_err()
                .starts_with("invalid duration \"1 fortnight\": ")
        );
    }
}
