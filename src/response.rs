//! The HTTP surface (SPEC §6): `RateLimit-Policy` / `RateLimit` (IETF httpapi draft-10,
//! RFC 9651 structured fields), legacy `X-RateLimit-*`, `Retry-After` (RFC 9110 §10.2.3) and
//! the `application/problem+json` body (RFC 9457).

use std::fmt::Write as _;
use std::time::Duration;

use axum::body::Body;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, header};

use crate::decision::{Decision, Outcome};

/// The problem type of a 429 (IANA HTTP problem types registry).
pub const QUOTA_EXCEEDED_TYPE: &str =
    "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// Which rate-limit headers responses carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum HeaderStyle {
    /// `RateLimit-Policy` and `RateLimit`, IETF httpapi ratelimit-headers draft-10: one item per
    /// tier, `q` units per `w` seconds; `r` remaining, `t` seconds until full (rounded up).
    #[default]
    Ietf,
    /// `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset` (seconds, rounded up)
    /// of the most constrained tier, as GitHub and express-rate-limit send them.
    Legacy,
    /// Both sets.
    Both,
    /// No rate-limit headers (a 429 still carries `Retry-After`).
    None,
}

/// Whole seconds, rounded up.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

fn sf_string(out: &mut String, s: &str) {
    // Names are validated printable ASCII; escape the two characters RFC 9651 requires.
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
}

fn value(s: &str) -> HeaderValue {
    // Built only from printable ASCII above, so this cannot fail; an empty value is the
    // documented fallback rather than a panic.
    HeaderValue::from_str(s).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// Writes the configured rate-limit headers for `decision`.
pub(crate) fn write_headers(headers: &mut HeaderMap, decision: &Decision, style: HeaderStyle) {
    if decision.tiers.is_empty() {
        return;
    }
    if matches!(style, HeaderStyle::Ietf | HeaderStyle::Both) {
        let mut policy = String::with_capacity(32 * decision.tiers.len());
        let mut state = String::with_capacity(32 * decision.tiers.len());
        for (i, t) in decision.tiers.iter().enumerate() {
            if i > 0 {
                policy.push_str(", ");
                state.push_str(", ");
            }
            sf_string(&mut policy, &t.name);
            let _ =
                write!(policy, ";q={};w={}", t.quota.count(), ceil_secs(t.quota.period()).max(1));
            sf_string(&mut state, &t.name);
            let _ = write!(state, ";r={};t={}", t.remaining, ceil_secs(t.reset_after));
        }
        headers.insert(HeaderName::from_static("ratelimit-policy"), value(&policy));
        headers.insert(HeaderName::from_static("ratelimit"), value(&state));
    }
    if matches!(style, HeaderStyle::Legacy | HeaderStyle::Both) {
        if let Some(t) = decision.tiers.iter().min_by_key(|t| t.remaining) {
            headers.insert(HeaderName::from_static("x-ratelimit-limit"), t.quota.count().into());
            headers.insert(HeaderName::from_static("x-ratelimit-remaining"), t.remaining.into());
            headers.insert(
                HeaderName::from_static("x-ratelimit-reset"),
                ceil_secs(t.reset_after).into(),
            );
        }
    }
}

fn json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A problem+json response (RFC 9457).
pub(crate) fn problem(
    status: StatusCode,
    type_: &str,
    title: &str,
    detail: &str,
    violated: &[&str],
) -> Response<Body> {
    let mut body = String::with_capacity(256);
    body.push_str("{\"type\":");
    json_string(&mut body, type_);
    body.push_str(",\"title\":");
    json_string(&mut body, title);
    let _ = write!(body, ",\"status\":{}", status.as_u16());
    body.push_str(",\"detail\":");
    json_string(&mut body, detail);
    if !violated.is_empty() {
        body.push_str(",\"violated-policies\":[");
        for (i, name) in violated.iter().enumerate() {
            if i > 0 {
                body.push(',');
            }
            json_string(&mut body, name);
        }
        body.push(']');
    }
    body.push('}');
    let mut res = Response::new(Body::from(body));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
    res.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    res
}

/// The default rejection: 429, `Retry-After` (delay-seconds rounded up, at least 1; absent when
/// the cost exceeds a tier's capacity), not cacheable, problem+json naming the violated tiers.
#[must_use]
pub fn too_many_requests(decision: &Decision) -> Response<Body> {
    let violated: Vec<&str> = decision.violated().collect();
    let detail = match decision.outcome {
        Outcome::CostExceedsCapacity => {
            "the request costs more than the policy's capacity; it can never be admitted".to_owned()
        }
        _ => match decision.retry_after {
            Some(d) => format!("quota exceeded; retry in {} s", ceil_secs(d).max(1)),
            None => "quota exceeded".to_owned(),
        },
    };
    let mut res = problem(
        StatusCode::TOO_MANY_REQUESTS,
        QUOTA_EXCEEDED_TYPE,
        "Too Many Requests",
        &detail,
        &violated,
    );
    if let (Outcome::Limited, Some(d)) = (decision.outcome, decision.retry_after) {
        res.headers_mut().insert(header::RETRY_AFTER, ceil_secs(d).max(1).into());
    }
    res
}
