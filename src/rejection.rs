//! Rejections as values: [`RateLimited`] (429) and [`Rejection`] (every refusal the layer or
//! [`Limiter::enforce`](crate::Limiter::enforce) makes), with their HTTP responses: status,
//! `Retry-After` (RFC 9110 §10.2.3), the rate-limit headers and an `application/problem+json`
//! body (RFC 9457) that is rendered once per policy.

use std::fmt::{self, Write as _};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Response, StatusCode, header};
use http_body_util::Full;

use crate::decision::{Decision, Outcome};
use crate::error::StoreError;
use crate::headers::{HeaderStyle, Headers, ceil_secs};
use crate::quota::{Policy, Tier};

/// The problem type of a 429 (IANA HTTP problem types registry, from the IETF httpapi
/// ratelimit-headers draft).
pub const QUOTA_EXCEEDED_TYPE: &str =
    "https://iana.org/assignments/http-problem-types#quota-exceeded";

const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");
const NO_STORE: HeaderValue = HeaderValue::from_static("no-store");

/// What a bound policy shows over HTTP, rendered once: its headers and its problem bodies.
#[derive(Debug)]
pub(crate) struct Surface {
    pub(crate) policy: Policy,
    pub(crate) headers: Headers,
    /// The 429 bodies by outcome and violated tiers, for policies of up to [`RENDERED_TIERS`]
    /// tiers: index `2^n * kind + mask`, `kind` 0 for limited and 1 for a cost above capacity,
    /// bit `i` of `mask` for tier `i`.
    bodies: Box<[Bytes]>,
}

/// Policies with more tiers render their 429 bodies per response.
const RENDERED_TIERS: usize = 4;

impl Surface {
    pub(crate) fn new(policy: &Policy) -> Self {
        let n = policy.tiers().len();
        let bodies = if n <= RENDERED_TIERS {
            (0..2usize << n)
                .map(|i| problem_body(policy, i >> n == 1, |t| i >> t & 1 == 1))
                .collect()
        } else {
            Box::default()
        };
        Self { policy: policy.clone(), headers: Headers::new(policy), bodies }
    }

    /// The 429 body for `decision`.
    #[inline]
    fn body(&self, decision: &Decision) -> Bytes {
        let over = decision.outcome() == Outcome::CostExceedsCapacity;
        let n = decision.tiers().len();
        if n <= RENDERED_TIERS {
            let mask: usize = decision.violated().map(|i| 1 << i).sum();
            if let Some(body) = self.bodies.get((usize::from(over) << n) + mask) {
                return body.clone();
            }
        }
        problem_body(&self.policy, over, |i| {
            decision.tiers().get(i).is_some_and(|t| t.is_violated())
        })
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

/// A problem+json document (RFC 9457).
fn problem(status: StatusCode, type_: &str, title: &str, detail: &str, violated: &[&str]) -> Bytes {
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
    Bytes::from(body)
}

/// The 429 body naming the tiers for which `violated` is true.
fn problem_body(policy: &Policy, over: bool, violated: impl Fn(usize) -> bool) -> Bytes {
    let names: Vec<&str> = policy
        .tiers()
        .iter()
        .enumerate()
        .filter(|(i, _)| violated(*i))
        .map(|(_, t)| t.name())
        .collect();
    let detail = if over {
        "the request costs more than the capacity of the violated policies; it can never be admitted"
    } else {
        "quota exceeded; retry after the number of seconds in the Retry-After header"
    };
    problem(StatusCode::TOO_MANY_REQUESTS, QUOTA_EXCEEDED_TYPE, "Too Many Requests", detail, &names)
}

/// A response with a problem body and the headers every refusal carries.
fn respond(status: StatusCode, body: Bytes) -> Response<Full<Bytes>> {
    let mut res = Response::new(Full::new(body));
    *res.status_mut() = status;
    // Room for these two, `Retry-After` and the rate-limit headers, without growing.
    let mut headers = HeaderMap::with_capacity(8);
    headers.insert(header::CONTENT_TYPE, PROBLEM_JSON);
    headers.insert(header::CACHE_CONTROL, NO_STORE);
    *res.headers_mut() = headers;
    res
}

/// `Retry-After` values up to this many seconds are rendered once.
const RENDERED_RETRY_AFTER: u64 = 3600;

/// A `Retry-After` value of `secs` seconds: for the first hour a value rendered once (copying
/// it allocates nothing), beyond that one rendered now.
fn retry_after_value(secs: u64) -> HeaderValue {
    static VALUES: std::sync::LazyLock<Box<[HeaderValue]>> = std::sync::LazyLock::new(|| {
        (0..=RENDERED_RETRY_AFTER)
            .map(|n| {
                let text: &'static str = Box::leak(n.to_string().into_boxed_str());
                HeaderValue::from_static(text)
            })
            .collect()
    });
    usize::try_from(secs).ok().and_then(|i| VALUES.get(i)).cloned().unwrap_or_else(|| secs.into())
}

/// The default 429 for `decision` under `surface`'s policy: the problem body rendered when the
/// policy was bound, `Retry-After`, and the rate-limit headers of `style`.
pub(crate) fn too_many_requests(
    surface: &Surface,
    decision: &Decision,
    style: HeaderStyle,
) -> Response<Full<Bytes>> {
    let mut res = respond(StatusCode::TOO_MANY_REQUESTS, surface.body(decision));
    add_headers(surface, decision, style, &mut res);
    res
}

/// Adds `Retry-After` (when the request would fit later) and the rate-limit headers of `style`.
fn add_headers<B>(
    surface: &Surface,
    decision: &Decision,
    style: HeaderStyle,
    res: &mut Response<B>,
) {
    let headers = res.headers_mut();
    if let Some(secs) = retry_after_secs(decision) {
        headers.insert(header::RETRY_AFTER, retry_after_value(secs));
    }
    surface.headers.write(style, headers, decision);
}

/// The `Retry-After` of a refusal, in whole seconds rounded up and at least 1.
fn retry_after_secs(decision: &Decision) -> Option<u64> {
    match decision.outcome() {
        Outcome::Limited => decision.retry_after().map(|d| ceil_secs(d).max(1)),
        _ => None,
    }
}

/// A request refused because it does not fit its policy: HTTP 429.
///
/// A value, not a response: match on it, read why, and turn it into the default response
/// ([`to_response`](Self::to_response), `IntoResponse` with the `axum` feature) or your own.
///
/// ```
/// use tollgate::{Limiter, Policy, Quota, Rejection};
/// use tollgate::key::Key;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let limiter = Limiter::new(Policy::single("search", Quota::per_minute(1)).unwrap());
/// limiter.enforce(&Key::Global, 1).await.unwrap();
/// match limiter.enforce(&Key::Global, 1).await {
///     Err(Rejection::Limited(limited)) => {
///         assert_eq!(limited.status(), 429);
///         assert_eq!(limited.retry_after_secs(), Some(60));
///         assert_eq!(limited.violated_tiers().map(|t| t.name()).collect::<Vec<_>>(), ["search"]);
///         let res = limited.to_response();
///         assert_eq!(res.headers()["retry-after"], "60");
///     }
///     other => panic!("expected a rejection, got {other:?}"),
/// }
/// # }
/// ```
#[derive(Clone)]
pub struct RateLimited {
    decision: Decision,
    surface: Arc<Surface>,
    budget: Option<Duration>,
}

impl fmt::Debug for RateLimited {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimited")
            .field("policy", &self.surface.policy.name())
            .field("decision", &self.decision)
            .field("shaping_budget", &self.budget)
            .finish()
    }
}

impl fmt::Display for RateLimited {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rate limited by policy `{}`", self.surface.policy.name())?;
        match self.retry_after() {
            Some(d) => write!(f, "; retry after {d:?}"),
            None => f.write_str("; the cost exceeds the capacity"),
        }
    }
}

impl std::error::Error for RateLimited {}

impl RateLimited {
    pub(crate) fn new(decision: Decision, surface: Arc<Surface>, budget: Option<Duration>) -> Self {
        Self { decision, surface, budget }
    }

    /// `429 Too Many Requests`.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        StatusCode::TOO_MANY_REQUESTS
    }

    /// The decision ([`Outcome::Limited`] or [`Outcome::CostExceedsCapacity`]).
    #[must_use]
    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// The policy that refused the request.
    #[must_use]
    pub fn policy(&self) -> &Policy {
        &self.surface.policy
    }

    /// The tiers that refused it.
    pub fn violated_tiers(&self) -> impl Iterator<Item = &Tier> {
        let tiers = self.surface.policy.tiers();
        self.decision.violated().filter_map(move |i| tiers.get(i))
    }

    /// When the same request would be admitted, exactly (nanoseconds); `None` when its cost
    /// exceeds a tier's capacity, so that it never will be.
    #[must_use]
    pub fn retry_after(&self) -> Option<Duration> {
        self.decision.retry_after()
    }

    /// The `Retry-After` value sent: [`retry_after`](Self::retry_after) in whole seconds,
    /// rounded up and at least 1 (a `Retry-After: 0` would invite an immediate retry that is
    /// refused again).
    #[must_use]
    pub fn retry_after_secs(&self) -> Option<u64> {
        retry_after_secs(&self.decision)
    }

    /// For a request the layer shaped: the wait budget it would have exceeded
    /// ([`shape`](crate::RateLimitLayerBuilder::shape)); `None` when policing.
    #[must_use]
    pub fn shaping_budget(&self) -> Option<Duration> {
        self.budget
    }

    /// The problem+json body (RFC 9457): type
    /// `https://iana.org/assignments/http-problem-types#quota-exceeded`, status, title, detail,
    /// and the violated tiers as `violated-policies`. Rendered when the policy was bound.
    #[must_use]
    pub fn body(&self) -> Bytes {
        self.surface.body(&self.decision)
    }

    /// The default response: 429, `Retry-After`, `Cache-Control: no-store`, the IETF
    /// `RateLimit-Policy` / `RateLimit` headers and the problem+json [`body`](Self::body).
    #[must_use]
    pub fn to_response(&self) -> Response<Full<Bytes>> {
        self.response(HeaderStyle::Ietf)
    }

    /// The default response with the headers of `style`.
    pub(crate) fn response(&self, style: HeaderStyle) -> Response<Full<Bytes>> {
        too_many_requests(&self.surface, &self.decision, style)
    }

    /// Adds `Retry-After` and the rate-limit headers of `style` to `res`.
    pub(crate) fn add_headers<B>(&self, style: HeaderStyle, res: &mut Response<B>) {
        add_headers(&self.surface, &self.decision, style, res);
    }
}

impl From<RateLimited> for Response<Full<Bytes>> {
    fn from(limited: RateLimited) -> Self {
        limited.to_response()
    }
}

/// Every refusal, as a value: what [`Limiter::enforce`](crate::Limiter::enforce) returns and
/// what the layer answers with when it does not pass a request on.
#[derive(Debug)]
#[non_exhaustive]
pub enum Rejection {
    /// The request does not fit its policy: 429.
    Limited(RateLimited),
    /// The store could not decide and the policy fails closed: 503 with `Retry-After: 1`.
    Unavailable(StoreError),
    /// No key could be read from the request (the layer's
    /// [`MissingKey::Reject`](crate::MissingKey::Reject)): 400 by default.
    MissingKey(StatusCode),
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Limited(l) => l.fmt(f),
            Self::Unavailable(e) => write!(f, "the rate limiter cannot decide: {e}"),
            Self::MissingKey(_) => f.write_str("no rate-limit key could be read from the request"),
        }
    }
}

impl std::error::Error for Rejection {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Unavailable(e) => Some(e),
            _ => None,
        }
    }
}

impl Rejection {
    /// The status of the response: 429, 503, or the missing-key status.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Limited(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::MissingKey(status) => *status,
        }
    }

    /// The default response (see [`RateLimited::to_response`]); a 503 carries
    /// `Retry-After: 1`.
    #[must_use]
    pub fn to_response(&self) -> Response<Full<Bytes>> {
        self.response(HeaderStyle::Ietf)
    }

    pub(crate) fn response(&self, style: HeaderStyle) -> Response<Full<Bytes>> {
        match self {
            Self::Limited(l) => l.response(style),
            Self::Unavailable(_) => {
                let mut res = respond(StatusCode::SERVICE_UNAVAILABLE, unavailable_body());
                res.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                res
            }
            Self::MissingKey(status) => respond(*status, missing_key_body(*status)),
        }
    }
}

impl From<Rejection> for Response<Full<Bytes>> {
    fn from(rejection: Rejection) -> Self {
        rejection.to_response()
    }
}

fn unavailable_body() -> Bytes {
    static BODY: std::sync::LazyLock<Bytes> = std::sync::LazyLock::new(|| {
        problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "about:blank",
            "Service Unavailable",
            "the rate limiter cannot decide right now",
            &[],
        )
    });
    BODY.clone()
}

fn missing_key_body(status: StatusCode) -> Bytes {
    problem(
        status,
        "about:blank",
        status.canonical_reason().unwrap_or("Bad Request"),
        "no rate-limit key could be read from the request",
        &[],
    )
}

#[cfg(feature = "axum")]
mod axum_impls {
    use axum::response::{IntoResponse, Response};

    use super::{RateLimited, Rejection};

    impl IntoResponse for RateLimited {
        fn into_response(self) -> Response {
            self.to_response().map(axum::body::Body::new)
        }
    }

    impl IntoResponse for Rejection {
        fn into_response(self) -> Response {
            self.to_response().map(axum::body::Body::new)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::Quota;

    #[test]
    fn bodies_are_rendered_per_violated_set() {
        let policy = Policy::builder("api")
            .tier("a", Quota::per_second(1))
            .tier("b", Quota::per_hour(5))
            .build()
            .unwrap();
        let surface = Surface::new(&policy);
        assert_eq!(surface.bodies.len(), 8);
        let body: serde_json::Value = serde_json::from_slice(&surface.bodies[0b11]).unwrap();
        assert_eq!(body["violated-policies"], serde_json::json!(["a", "b"]));
        assert_eq!(body["status"], 429);
        assert_eq!(body["type"], QUOTA_EXCEEDED_TYPE);
        let over: serde_json::Value = serde_json::from_slice(&surface.bodies[4 + 0b10]).unwrap();
        assert_eq!(over["violated-policies"], serde_json::json!(["b"]));
        assert!(over["detail"].as_str().unwrap().contains("never"));
    }
}
