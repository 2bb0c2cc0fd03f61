//! The HTTP surface (SPEC §6): `RateLimit-Policy` / `RateLimit` (IETF httpapi draft-10,
//! RFC 9651 structured fields), legacy `X-RateLimit-*`, `Retry-After` (RFC 9110 §10.2.3) and
//! the `application/problem+json` body (RFC 9457).

use std::fmt::Write as _;
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
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

fn value(s: String) -> HeaderValue {
    // Built only from printable ASCII above, so this cannot fail; an empty value is the
    // documented fallback rather than a panic. The string's buffer becomes the value: no copy.
    HeaderValue::from_maybe_shared(Bytes::from(s)).unwrap_or_else(|_| HeaderValue::from_static(""))
}

// Header names as constants: `HeaderName::from_static` validates its argument, which in a
// `const` happens once, at compile time, instead of on every response.
const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// The rate-limit headers of one response, computed when it was decided and inserted when the
/// response is ready (inline for the two IETF headers).
pub(crate) type Prepared = SmallVec<[(HeaderName, HeaderValue); 2]>;

/// The rate-limit headers of one policy, prepared when the layer is built: what does not change
/// between responses is rendered once.
#[derive(Debug, Clone)]
pub(crate) struct Headers {
    style: HeaderStyle,
    /// The `RateLimit-Policy` value (constant for the policy).
    policy: HeaderValue,
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
        Self { style, policy: value(rendered), items: items.into(), counts }
    }

    /// The configured rate-limit headers for `decision`.
    pub(crate) fn prepare(&self, decision: &Decision) -> Prepared {
        let mut out = Prepared::new();
        if decision.tiers.is_empty() {
            return out;
        }
        if matches!(self.style, HeaderStyle::Ietf | HeaderStyle::Both) {
            // The numbers first, so the value is allocated at exactly its length: a `Bytes`
            // made from a `String` with spare capacity would allocate a second time.
            let mut buffers: SmallVec<[(itoa::Buffer, itoa::Buffer); 2]> = SmallVec::new();
            buffers
                .resize_with(decision.tiers.len(), || (itoa::Buffer::new(), itoa::Buffer::new()));
            let numbers: SmallVec<[(&str, &str); 2]> = buffers
                .iter_mut()
                .zip(decision.tiers.iter())
                .map(|((r, t), d)| (r.format(d.remaining), t.format(ceil_secs(d.reset_after()))))
                .collect();
            let len: usize = self
                .items
                .iter()
                .zip(&numbers)
                .map(|(item, (r, t))| item.len() + r.len() + 3 + t.len())
                .sum::<usize>()
                + 2 * numbers.len().saturating_sub(1);
            let mut state = String::with_capacity(len);
            for (i, (item, (r, t))) in self.items.iter().zip(&numbers).enumerate() {
                if i > 0 {
                    state.push_str(", ");
                }
                state.push_str(item);
                state.push_str(r);
                state.push_str(";t=");
                state.push_str(t);
            }
            out.push((RATELIMIT_POLICY, self.policy.clone()));
            out.push((RATELIMIT, value(state)));
        }
        if matches!(self.style, HeaderStyle::Legacy | HeaderStyle::Both) {
            let tiers = decision.tiers.iter().zip(self.counts.iter());
            if let Some((t, count)) = tiers.min_by_key(|(t, _)| t.remaining) {
                out.push((X_RATELIMIT_LIMIT, (*count).into()));
                out.push((X_RATELIMIT_REMAINING, t.remaining.into()));
                let reset = ceil_secs(t.reset_after());
                out.push((X_RATELIMIT_RESET, reset.into()));
            }
        }
        out
    }

    /// Writes the configured rate-limit headers for `decision`.
    pub(crate) fn write(&self, headers: &mut HeaderMap, decision: &Decision) {
        insert(headers, self.prepare(decision));
    }
}

/// Inserts prepared headers.
pub(crate) fn insert(headers: &mut HeaderMap, prepared: Prepared) {
    for (name, value) in prepared {
        headers.insert(name, value);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Limiter;
    use crate::key::Key;
    use crate::quota::Quota;

    #[tokio::test]
    async fn headers_render_every_tier_exactly() {
        let policy = Policy::builder("api")
            .tier("burst", Quota::per_second(10))
            .tier("daily \"q\"", Quota::per_day(12_345))
            .build()
            .unwrap();
        let limiter = Limiter::new(policy.clone());
        let decision = limiter.check(&Key::Global, 3).await.unwrap();
        let headers = Headers::new(&policy, HeaderStyle::Both);
        let mut map = HeaderMap::new();
        headers.write(&mut map, &decision);
        assert_eq!(map["ratelimit-policy"], r#""burst";q=10;w=1, "daily \"q\"";q=12345;w=86400"#);
        assert_eq!(map["ratelimit"], r#""burst";r=7;t=1, "daily \"q\"";r=12342;t=21"#);
        assert_eq!(map["x-ratelimit-limit"], "10");
        assert_eq!(map["x-ratelimit-remaining"], "7");
        assert_eq!(map["x-ratelimit-reset"], "1");
        let state = map["ratelimit"].as_bytes();
        assert_eq!(state.len(), r#""burst";r=7;t=1, "daily \"q\"";r=12342;t=21"#.len());
    }
}
