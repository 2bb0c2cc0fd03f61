//! The HTTP surface (SPEC §6): `RateLimit-Policy` / `RateLimit` (IETF httpapi draft-10,
//! RFC 9651 structured fields), legacy `X-RateLimit-*`, `Retry-After` (RFC 9110 §10.2.3) and
//! the `application/problem+json` body (RFC 9457).

use std::fmt::Write as _;
use std::time::Duration;

use axum::body::Body;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, header};

use smallvec::SmallVec;

use crate::decision::{Decision, Outcome};
use crate::quota::Policy;

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

/// The rate-limit headers of one policy, prepared when the layer is built: what does not change
/// between responses is rendered once.
#[derive(Debug, Clone)]
pub(crate) struct Headers {
    style: HeaderStyle,
    /// The `RateLimit-Policy` value (constant for the policy).
    policy: String,
    /// Per tier, the start of its `RateLimit` item: `"name";r=`.
    items: Box<[String]>,
    /// Per tier, its quota's count (the legacy `X-RateLimit-Limit`).
    counts: Box<[u64]>,
}

impl Headers {
    pub(crate) fn new(policy: &Policy, style: HeaderStyle) -> Self {
        let mut rendered = String::new();
        let mut items = Vec::with_capacity(policy.tiers().len());
        for (i, t) in policy.tiers().iter().enumerate() {
            if i > 0 {
                rendered.push_str(", ");
            }
            sf_string(&mut rendered, t.name());
            let q = t.quota();
            let _ = write!(rendered, ";q={};w={}", q.count(), ceil_secs(q.period()).max(1));
            let mut item = String::new();
            sf_string(&mut item, t.name());
            item.push_str(";r=");
            items.push(item);
        }
        let counts = policy.tiers().iter().map(|t| t.quota().count()).collect();
        Self { style, policy: rendered, items: items.into(), counts }
    }

    /// Writes the configured rate-limit headers for `decision`.
    pub(crate) fn write(&self, headers: &mut HeaderMap, decision: &Decision) {
        if decision.tiers.is_empty() {
            return;
        }
        if matches!(self.style, HeaderStyle::Ietf | HeaderStyle::Both) {
            let mut state = String::with_capacity(self.items.iter().map(|i| i.len() + 28).sum());
            let mut n = itoa::Buffer::new();
            for (i, (t, item)) in decision.tiers.iter().zip(self.items.iter()).enumerate() {
                if i > 0 {
                    state.push_str(", ");
                }
                state.push_str(item);
                state.push_str(n.format(t.remaining));
                state.push_str(";t=");
                state.push_str(n.format(ceil_secs(t.reset_after())));
            }
            headers.insert(HeaderName::from_static("ratelimit-policy"), value(&self.policy));
            headers.insert(HeaderName::from_static("ratelimit"), value(&state));
        }
        if matches!(self.style, HeaderStyle::Legacy | HeaderStyle::Both) {
            let tiers = decision.tiers.iter().zip(self.counts.iter());
            if let Some((t, count)) = tiers.min_by_key(|(t, _)| t.remaining) {
                headers.insert(HeaderName::from_static("x-ratelimit-limit"), (*count).into());
                headers
                    .insert(HeaderName::from_static("x-ratelimit-remaining"), t.remaining.into());
                headers.insert(
                    HeaderName::from_static("x-ratelimit-reset"),
                    ceil_secs(t.reset_after()).into(),
                );
            }
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
/// the cost exceeds a tier's capacity), not cacheable, problem+json naming the violated tiers of
/// `policy` (the policy that decided).
#[must_use]
pub fn too_many_requests(policy: &Policy, decision: &Decision) -> Response<Body> {
    let violated: SmallVec<[&str; 2]> = decision.violated_names(policy).collect();
    let detail = match decision.outcome {
        Outcome::CostExceedsCapacity => {
            "the request costs more than the policy's capacity; it can never be admitted".to_owned()
        }
        _ => match decision.retry_after() {
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
    if let (Outcome::Limited, Some(d)) = (decision.outcome, decision.retry_after()) {
        res.headers_mut().insert(header::RETRY_AFTER, ceil_secs(d).max(1).into());
    }
    res
}
