//! What a response says about when to come back, read from its headers: `Retry-After`
//! (RFC 9110 §10.2.3), `grpc-status` and `grpc-retry-pushback-ms` (gRFC A6), `RateLimit` /
//! `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers-10, RFC 9651 structured fields) and
//! `X-RateLimit-Limit` / `-Remaining` / `-Reset`.
//!
//! Every reader is total: a value that does not parse is treated as absent (or, for the gRPC
//! pushback, as gRFC A6 says: as "do not retry"), never as an error or a panic.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, header};

const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
const GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// `X-RateLimit-Reset` values above this many seconds are Unix timestamps (GitHub's form), not
/// delays: 10^9 s is September 2001 as a timestamp and 31 years as a delay.
const EPOCH_THRESHOLD_SECS: u64 = 1_000_000_000;

/// At most this many quotas are read from one response, so a hostile server cannot make a
/// client hold unbounded state.
pub(crate) const MAX_QUOTAS: usize = 16;

/// A header's first value as trimmed ASCII text.
fn text<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Option<&'a str> {
    headers.get(name)?.to_str().ok().map(str::trim)
}

/// A non-negative decimal integer (`1*DIGIT`), saturating at `u64::MAX`.
fn digits(s: &str) -> Option<u64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(s.parse().unwrap_or(u64::MAX))
}

/// The instant an HTTP-date is relative to: the response's `Date` header (RFC 9110 §6.6.1)
/// when it is present and valid, else the system clock.
fn reference_time(headers: &HeaderMap) -> SystemTime {
    text(headers, &header::DATE)
        .and_then(|d| httpdate::parse_http_date(d).ok())
        .unwrap_or_else(SystemTime::now)
}

/// The delay of `Retry-After` (RFC 9110 §10.2.3): `delay-seconds`, or an `HTTP-date` taken
/// relative to the response's `Date` header when present, else to the system clock (a date in
/// the past is a zero delay). `None` when absent or malformed.
pub(crate) fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = text(headers, &header::RETRY_AFTER)?;
    if let Some(secs) = digits(value) {
        return Some(Duration::from_secs(secs));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(reference_time(headers)).unwrap_or(Duration::ZERO))
}

/// What `grpc-retry-pushback-ms` says (gRFC A6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pushback {
    /// No such header.
    Absent,
    /// Retry no sooner than this.
    After(Duration),
    /// A negative or malformed value: the server asks the client not to retry.
    Stop,
}

/// Reads `grpc-retry-pushback-ms` (gRFC A6: milliseconds; "if the value for pushback is
/// negative or unparseable, then it will be seen as the server asking the client not to retry
/// at all").
pub(crate) fn grpc_pushback(headers: &HeaderMap) -> Pushback {
    pushback(headers.get(GRPC_RETRY_PUSHBACK_MS).map(http::HeaderValue::as_bytes))
}

/// Reads a `grpc-retry-pushback-ms` value, as [`grpc_pushback`] does; `None` is an absent one.
pub(crate) fn pushback(value: Option<&[u8]>) -> Pushback {
    let Some(value) = value else { return Pushback::Absent };
    match std::str::from_utf8(value).ok().map(str::trim).and_then(digits) {
        Some(ms) => Pushback::After(Duration::from_millis(ms)),
        None => Pushback::Stop,
    }
}

/// The `grpc-status` code in the headers (a trailers-only gRPC response), if any.
pub(crate) fn grpc_status(headers: &HeaderMap) -> Option<u64> {
    text(headers, &GRPC_STATUS).and_then(digits)
}

/// One quota a response reported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reported {
    /// The quota policy's name; `None` for the legacy `X-RateLimit-*` headers.
    pub(crate) name: Option<Box<str>>,
    /// Units per window (`q` of `RateLimit-Policy`, `X-RateLimit-Limit`), when reported.
    pub(crate) limit: Option<u64>,
    /// Units left (`r`, `X-RateLimit-Remaining`).
    pub(crate) remaining: u64,
    /// When the quota is full again (`t`, `X-RateLimit-Reset`), when reported.
    pub(crate) reset: Option<Duration>,
}

/// All lines of a header joined with `", "`, as RFC 9110 §5.3 combines them.
fn joined(headers: &HeaderMap, name: &HeaderName) -> Option<String> {
    let mut out = String::new();
    for (i, value) in headers.get_all(name).iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(value.to_str().ok()?);
    }
    (!out.is_empty()).then_some(out)
}

/// A structured-field List (RFC 9651 §3.1) of items named by a String or a Token, as
/// `(name, parameters)`. `None` when the field does not parse.
fn sf_items(value: &str) -> Option<Vec<(Box<str>, sfv::Parameters)>> {
    let list: sfv::List = sfv::Parser::new(value).parse().ok()?;
    Some(
        list.into_iter()
            .filter_map(|entry| match entry {
                sfv::ListEntry::Item(item) => {
                    let name = match &item.bare_item {
                        sfv::BareItem::String(s) => s.as_str(),
                        sfv::BareItem::Token(t) => t.as_str(),
                        _ => return None,
                    };
                    Some((name.into(), item.params))
                }
                sfv::ListEntry::InnerList(_) => None,
            })
            .take(MAX_QUOTAS)
            .collect(),
    )
}

/// A non-negative Integer parameter.
fn sf_uint(params: &sfv::Parameters, key: &str) -> Option<u64> {
    let n = i64::from(params.get(key)?.as_integer()?);
    u64::try_from(n).ok()
}

/// One item of the IETF `RateLimit` field, with what the `RateLimit-Policy` item of the same
/// name says about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IetfItem {
    /// The quota policy's name.
    pub(crate) name: Box<str>,
    /// Units left (`r`).
    pub(crate) remaining: u64,
    /// Seconds until the quota is full again (`t`), when reported.
    pub(crate) reset: Option<Duration>,
    /// Units per window (`q` of `RateLimit-Policy`), when reported.
    pub(crate) quota: Option<u64>,
    /// The window (`w` of `RateLimit-Policy`, seconds), when reported.
    pub(crate) window: Option<Duration>,
    /// The quota unit (`qu` of `RateLimit-Policy`), when reported; absent means requests.
    pub(crate) unit: Option<Box<str>>,
}

/// The items of the IETF `RateLimit` field (draft-ietf-httpapi-ratelimit-headers-10), each
/// with `q`, `w` and `qu` from the `RateLimit-Policy` item of the same name. `None` when the
/// field is absent or does not parse; items without a valid `r` are skipped, at most
/// [`MAX_QUOTAS`] are read.
pub(crate) fn ietf_items(headers: &HeaderMap) -> Option<Vec<IetfItem>> {
    let items = joined(headers, &RATELIMIT).as_deref().and_then(sf_items)?;
    let policies =
        joined(headers, &RATELIMIT_POLICY).as_deref().and_then(sf_items).unwrap_or_default();
    Some(
        items
            .into_iter()
            .filter_map(|(name, params)| {
                let remaining = sf_uint(&params, "r")?;
                let reset = sf_uint(&params, "t").map(Duration::from_secs);
                let policy = policies.iter().find(|(policy, _)| *policy == name).map(|(_, p)| p);
                let quota = policy.and_then(|p| sf_uint(p, "q"));
                let window = policy.and_then(|p| sf_uint(p, "w")).map(Duration::from_secs);
                let unit = policy
                    .and_then(|p| p.get("qu"))
                    .and_then(|v| v.as_string())
                    .map(|u| u.as_str().into());
                Some(IetfItem { name, remaining, reset, quota, window, unit })
            })
            .collect(),
    )
}

/// The legacy `X-RateLimit-Remaining`, with `-Limit` and `-Reset`: `-Reset` is seconds from
/// now, or, above 10^9, a Unix timestamp taken relative to the response's `Date` header (else
/// the system clock). `None` without a valid `X-RateLimit-Remaining`.
pub(crate) fn legacy(headers: &HeaderMap) -> Option<Reported> {
    let remaining = text(headers, &X_RATELIMIT_REMAINING).and_then(digits)?;
    let limit = text(headers, &X_RATELIMIT_LIMIT).and_then(digits);
    let reset = text(headers, &X_RATELIMIT_RESET).and_then(digits).map(|secs| {
        if secs > EPOCH_THRESHOLD_SECS {
            let at = UNIX_EPOCH + Duration::from_secs(secs);
            at.duration_since(reference_time(headers)).unwrap_or(Duration::ZERO)
        } else {
            Duration::from_secs(secs)
        }
    });
    Some(Reported { name: None, limit, remaining, reset })
}

/// The quotas a response reports: the IETF `RateLimit` field (each item's `r` and `t`, with
/// `q` from the `RateLimit-Policy` item of the same name) when present and valid, otherwise
/// the legacy `X-RateLimit-Remaining` with `-Limit` and `-Reset` (see [`legacy`]). Items
/// without a valid `r` are skipped; a field that does not parse counts as absent.
pub(crate) fn reported(headers: &HeaderMap) -> Vec<Reported> {
    if let Some(items) = ietf_items(headers) {
        return items
            .into_iter()
            // A quota of bytes or of concurrent requests (`qu`) does not count requests per
            // window: pacing requests by it would be wrong.
            .filter(|item| item.unit.as_deref().is_none_or(|u| u == "requests"))
            .map(|item| Reported {
                name: Some(item.name),
                limit: item.quota,
                remaining: item.remaining,
                reset: item.reset,
            })
            .collect();
    }
    legacy(headers).into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (k, v) in pairs {
            headers.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                http::HeaderValue::from_str(v).unwrap(),
            );
        }
        headers
    }

    #[test]
    fn quotas_of_bytes_or_concurrency_are_not_paced_by_requests() {
        let headers = map(&[
            (
                "ratelimit-policy",
                r#""rps";q=10;w=1, "bytes";q=1000;w=1;qu="content-bytes", "slots";q=4;qu="concurrent-requests""#,
            ),
            ("ratelimit", r#""rps";r=7;t=1, "bytes";r=0;t=1, "slots";r=0;t=1"#),
        ]);
        let names: Vec<_> = reported(&headers).into_iter().map(|r| r.name).collect();
        assert_eq!(names, [Some("rps".into())]);
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        assert_eq!(retry_after(&map(&[("retry-after", "120")])), Some(Duration::from_secs(120)));
        assert_eq!(retry_after(&map(&[("retry-after", " 7 ")])), Some(Duration::from_secs(7)));
        let dated = map(&[
            ("date", "Wed, 21 Oct 2015 07:28:00 GMT"),
            ("retry-after", "Wed, 21 Oct 2015 07:29:30 GMT"),
        ]);
        assert_eq!(retry_after(&dated), Some(Duration::from_secs(90)));
        let past = map(&[
            ("date", "Wed, 21 Oct 2015 07:28:00 GMT"),
            ("retry-after", "Wed, 21 Oct 2015 07:27:00 GMT"),
        ]);
        assert_eq!(retry_after(&past), Some(Duration::ZERO));
        // Saturates instead of overflowing.
        let huge = map(&[("retry-after", "99999999999999999999999")]);
        assert_eq!(retry_after(&huge), Some(Duration::from_secs(u64::MAX)));
        for bad in ["-1", "1.5", "soon", "", "0x10"] {
            assert_eq!(retry_after(&map(&[("retry-after", bad)])), None, "{bad:?}");
        }
        assert_eq!(retry_after(&HeaderMap::new()), None);
    }

    #[test]
    fn pushback_follows_grfc_a6() {
        let p = |v: &str| grpc_pushback(&map(&[("grpc-retry-pushback-ms", v)]));
        assert_eq!(p("250"), Pushback::After(Duration::from_millis(250)));
        assert_eq!(p("0"), Pushback::After(Duration::ZERO));
        assert_eq!(p("-1"), Pushback::Stop);
        assert_eq!(p("abc"), Pushback::Stop);
        assert_eq!(p(""), Pushback::Stop);
        assert_eq!(grpc_pushback(&HeaderMap::new()), Pushback::Absent);
        assert_eq!(grpc_status(&map(&[("grpc-status", "14")])), Some(14));
        assert_eq!(grpc_status(&map(&[("grpc-status", "x")])), None);
    }

    #[test]
    fn ietf_fields_are_read_per_quota() {
        let headers = map(&[
            ("ratelimit-policy", r#""burst";q=10;w=1, "daily";q=1000;w=86400"#),
            ("ratelimit", r#""burst";r=7;t=1, "daily";r=940;t=2700"#),
        ]);
        assert_eq!(
            reported(&headers),
            vec![
                Reported {
                    name: Some("burst".into()),
                    limit: Some(10),
                    remaining: 7,
                    reset: Some(Duration::from_secs(1)),
                },
                Reported {
                    name: Some("daily".into()),
                    limit: Some(1000),
                    remaining: 940,
                    reset: Some(Duration::from_secs(2700)),
                },
            ]
        );
        // Split over two lines, a token name, no policy, no `t`, an item without `r`.
        let headers = map(&[("ratelimit", r#"a;r=1"#), ("ratelimit", r#""b";t=3, "c";r=0"#)]);
        assert_eq!(
            reported(&headers),
            vec![
                Reported { name: Some("a".into()), limit: None, remaining: 1, reset: None },
                Reported { name: Some("c".into()), limit: None, remaining: 0, reset: None },
            ]
        );
    }

    #[test]
    fn legacy_fields_take_delays_and_timestamps() {
        let headers = map(&[
            ("x-ratelimit-limit", "60"),
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "42"),
        ]);
        let expected = Reported {
            name: None,
            limit: Some(60),
            remaining: 0,
            reset: Some(Duration::from_secs(42)),
        };
        assert_eq!(reported(&headers), vec![expected.clone()]);
        // GitHub's form: a Unix timestamp, relative to the response's `Date`.
        let headers = map(&[
            ("date", "Wed, 21 Oct 2015 07:28:00 GMT"),
            ("x-ratelimit-limit", "60"),
            ("x-ratelimit-remaining", "0"),
            ("x-ratelimit-reset", "1445412522"),
        ]);
        assert_eq!(reported(&headers), vec![expected]);
    }

    #[test]
    fn malformed_fields_count_as_absent() {
        assert_eq!(reported(&map(&[("ratelimit", "\"burst\";r=")])), vec![]);
        assert_eq!(reported(&map(&[("ratelimit", r#""burst";r=-1"#)])), vec![]);
        assert_eq!(reported(&map(&[("x-ratelimit-remaining", "many")])), vec![]);
        assert_eq!(reported(&HeaderMap::new()), vec![]);
        // An invalid `RateLimit` falls back to the legacy fields.
        let headers = map(&[("ratelimit", "(("), ("x-ratelimit-remaining", "3")]);
        assert_eq!(
            reported(&headers),
            vec![Reported { name: None, limit: None, remaining: 3, reset: None }]
        );
        // At most `MAX_QUOTAS` items.
        let many: Vec<String> = (0..40).map(|i| format!("q{i};r=1")).collect();
        assert_eq!(reported(&map(&[("ratelimit", &many.join(", "))])).len(), MAX_QUOTAS);
    }
}
