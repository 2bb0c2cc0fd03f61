//! Rejections as values: [`RateLimited`] (429) and [`Rejection`] (every refusal the layer or
//! [`Limiter::enforce`](crate::Limiter::enforce) makes), with their HTTP responses: status,
//! `Retry-After` (RFC 9110 §10.2.3), the rate-limit headers and an `application/problem+json`
//! body (RFC 9457) that is rendered once per policy; and their gRPC responses (trailers-only,
//! `grpc-status`, `grpc-retry-pushback-ms` of gRFC A6), see [`crate::grpc`].

use std::fmt::{self, Write as _};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, header};
use http_body_util::Full;

use crate::decision::{Decision, Outcome};
use crate::error::StoreError;
use crate::grpc::{self, code};
use crate::headers::{Fields, HeaderFormat, HeaderStyle, Headers, ceil_secs};
use crate::key::KeyMissing;
use crate::policy::{Policy, Tier};
use crate::quota::Unit;

/// The problem type of a 429 (IANA HTTP problem types registry, from the IETF httpapi
/// ratelimit-headers draft).
pub(crate) const QUOTA_EXCEEDED_TYPE: &str =
    "https://iana.org/assignments/http-problem-types#quota-exceeded";

const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");
const NO_STORE: HeaderValue = HeaderValue::from_static("no-store");

/// What a bound policy shows over HTTP, rendered once: its headers and its problem bodies.
#[derive(Debug)]
pub(crate) struct Surface {
    pub(crate) policy: Policy,
    pub(crate) headers: Headers,
    /// The 429 bodies by outcome and violated tiers, for policies of up to [`RENDERED_TIERS`]
    /// tiers, each with its `Content-Length` value: index `2^n * kind + mask`, `kind` 0 for
    /// limited and 1 for a cost above capacity, bit `i` of `mask` for tier `i`.
    bodies: Box<[(Bytes, HeaderValue)]>,
    /// The `grpc-message` of a refusal: `[limited, cost above capacity]`.
    grpc_messages: [HeaderValue; 2],
    /// The header fields of the default 429 with `Retry-After` and the current draft's
    /// `RateLimit` fields, in the order they are written, made on the first such refusal:
    /// each refusal clones it and sets its three values in place (see [`LIMITED_FIELDS`]).
    limited: OnceLock<HeaderMap>,
}

/// The fields of [`Surface::limited`] in order; the values of `Content-Length`, `Retry-After`
/// and `RateLimit` (positions 2, 3 and 5) change from one refusal to the next.
const LIMITED_FIELDS: [HeaderName; 6] = [
    header::CONTENT_TYPE,
    header::CACHE_CONTROL,
    header::CONTENT_LENGTH,
    header::RETRY_AFTER,
    crate::headers::RATELIMIT_POLICY,
    crate::headers::RATELIMIT,
];

/// Policies with more tiers render their 429 bodies per response.
const RENDERED_TIERS: usize = 4;

impl Surface {
    pub(crate) fn new(policy: &Policy) -> Self {
        let n = policy.tiers().len();
        let bodies = if n <= RENDERED_TIERS {
            (0..2usize << n)
                .map(|i| with_length(problem_body(policy, i >> n == 1, |t| i >> t & 1 == 1)))
                .collect()
        } else {
            Box::default()
        };
        let name = policy.name();
        let grpc_messages = [
            grpc::message(&format!("rate limited by policy `{name}`: quota exceeded")),
            grpc::message(&format!(
                "rate limited by policy `{name}`: the request costs more than the capacity of the violated policies; it can never be admitted"
            )),
        ];
        Self {
            policy: policy.clone(),
            headers: Headers::new(policy),
            bodies,
            grpc_messages,
            limited: OnceLock::new(),
        }
    }

    /// The header fields of the default 429 for `decision` under `fields`, when they are the
    /// common ones ([`LIMITED_FIELDS`]: a refusal that can be retried, with the current draft's
    /// fields), with `length` as its `Content-Length`: a clone of [`limited`](Self::limited)
    /// with its three values set by position, which spares hashing and inserting six names. The
    /// same fields, in the same order, as [`respond`] and [`add_headers`] write.
    fn limited_headers(
        &self,
        decision: &Decision,
        fields: Fields,
        length: &HeaderValue,
    ) -> Option<HeaderMap> {
        let current = Fields { style: HeaderStyle::Ietf, format: HeaderFormat::Draft10 };
        if fields != current || decision.tiers.is_empty() {
            return None;
        }
        let retry_after = retry_after_value(retry_after_secs(decision)?);
        let template = self.limited.get_or_init(|| {
            let mut headers = HeaderMap::with_capacity(LIMITED_FIELDS.len());
            let values = [
                PROBLEM_JSON,
                NO_STORE,
                HeaderValue::from_static("0"),
                HeaderValue::from_static("1"),
                self.headers.policy_value().clone(),
                HeaderValue::from_static(""),
            ];
            for (name, value) in LIMITED_FIELDS.into_iter().zip(values) {
                headers.insert(name, value);
            }
            headers
        });
        let mut headers = template.clone();
        let mut values = headers.values_mut();
        *values.nth(2)? = length.clone();
        *values.next()? = retry_after;
        *values.nth(1)? = self.headers.state(decision);
        Some(headers)
    }

    /// The status of a refusal: `413 Content Too Large` when the request's body is larger than
    /// a tier counting request bytes can ever hold at once (it can never be admitted), else
    /// `429 Too Many Requests`.
    pub(crate) fn status(&self, decision: &Decision) -> StatusCode {
        if decision.outcome() == Outcome::CostExceedsCapacity
            && decision
                .violated()
                .any(|i| self.policy.tiers().get(i).is_some_and(|t| t.unit() == Unit::RequestBytes))
        {
            return StatusCode::PAYLOAD_TOO_LARGE;
        }
        StatusCode::TOO_MANY_REQUESTS
    }

    /// The 413 body for `decision`: the tiers counting request bytes whose capacity the body
    /// exceeds, and their capacity.
    fn too_large_body(&self, decision: &Decision) -> Bytes {
        let tiers: Vec<&Tier> = decision
            .violated()
            .filter_map(|i| self.policy.tiers().get(i))
            .filter(|t| t.unit() == Unit::RequestBytes)
            .collect();
        let held: Vec<String> =
            tiers.iter().map(|t| format!("`{}` holds {} bytes", t.name(), t.capacity())).collect();
        let detail = format!(
            "the request body is larger than policy `{}` can ever admit at once ({}); send it \
             in smaller requests",
            self.policy.name(),
            held.join(", ")
        );
        let names: Vec<&str> = tiers.iter().map(|t| t.name()).collect();
        problem(StatusCode::PAYLOAD_TOO_LARGE, "about:blank", "Content Too Large", &detail, &names)
    }

    /// The 429 body for `decision`, with its `Content-Length` value.
    #[inline]
    fn body_with_length(&self, decision: &Decision) -> (Bytes, HeaderValue) {
        match self.rendered(decision) {
            Some((body, length)) => (body.clone(), length.clone()),
            None => with_length(self.render(decision)),
        }
    }

    /// The 429 body for `decision`.
    fn body(&self, decision: &Decision) -> Bytes {
        match self.rendered(decision) {
            Some((body, _)) => body.clone(),
            None => self.render(decision),
        }
    }

    /// The 429 body for `decision` and its length, when they were rendered at bind time.
    #[inline]
    fn rendered(&self, decision: &Decision) -> Option<&(Bytes, HeaderValue)> {
        let over = decision.outcome() == Outcome::CostExceedsCapacity;
        let n = decision.tiers().len();
        if n > RENDERED_TIERS {
            return None;
        }
        let mask: usize = decision.violated().map(|i| 1 << i).sum();
        self.bodies.get((usize::from(over) << n) + mask)
    }

    /// The 429 body for `decision`, rendered now.
    fn render(&self, decision: &Decision) -> Bytes {
        let over = decision.outcome() == Outcome::CostExceedsCapacity;
        problem_body(&self.policy, over, |i| {
            decision.tiers().get(i).is_some_and(|t| t.is_violated())
        })
    }
}

/// `body` with its `Content-Length` value.
fn with_length(body: Bytes) -> (Bytes, HeaderValue) {
    let length = HeaderValue::from(body.len());
    (body, length)
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
fn respond(status: StatusCode, body: Bytes) -> Response<Bytes> {
    let (body, length) = with_length(body);
    respond_with_length(status, body, length)
}

/// [`respond`], the body's `Content-Length` value given. The refusal says its length itself
/// (as axum's router would add it): with it in the map the router adds nothing, where its
/// insertion would grow a map cloned to the size of its fields.
fn respond_with_length(status: StatusCode, body: Bytes, length: HeaderValue) -> Response<Bytes> {
    let mut res = Response::new(body);
    *res.status_mut() = status;
    // Room for these three, `Retry-After` and the rate-limit headers, without growing.
    let mut headers = HeaderMap::with_capacity(9);
    headers.insert(header::CONTENT_TYPE, PROBLEM_JSON);
    headers.insert(header::CACHE_CONTROL, NO_STORE);
    headers.insert(header::CONTENT_LENGTH, length);
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
    style: Fields,
) -> Response<Bytes> {
    if decision.outcome() == Outcome::CostExceedsCapacity {
        let status = surface.status(decision);
        if status == StatusCode::PAYLOAD_TOO_LARGE {
            let mut res = respond(status, surface.too_large_body(decision));
            add_headers(surface, decision, style, &mut res);
            return res;
        }
    }
    let (body, length) = surface.body_with_length(decision);
    if let Some(headers) = surface.limited_headers(decision, style, &length) {
        let mut res = Response::new(body);
        *res.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        *res.headers_mut() = headers;
        return res;
    }
    let mut res = respond_with_length(StatusCode::TOO_MANY_REQUESTS, body, length);
    add_headers(surface, decision, style, &mut res);
    res
}

/// Adds `Retry-After` (when the request would fit later) and the rate-limit headers of `style`.
fn add_headers<B>(surface: &Surface, decision: &Decision, style: Fields, res: &mut Response<B>) {
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

/// The `grpc-retry-pushback-ms` of a refusal, in whole milliseconds rounded up and at least 1.
fn retry_after_ms(decision: &Decision) -> Option<u64> {
    match decision.outcome() {
        Outcome::Limited => decision
            .retry_after()
            .map(|d| u64::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX).max(1)),
        _ => None,
    }
}

/// A gRPC trailers-only response: HTTP 200, `content-type: application/grpc`, `grpc-status`
/// and `grpc-message`, and an empty body (so the server ends the stream with the headers).
fn grpc_respond(code: u8, message: HeaderValue) -> Response<Bytes> {
    let mut res = Response::new(Bytes::new());
    // Room for these three, the pushback and the rate-limit headers, without growing.
    let mut headers = HeaderMap::with_capacity(8);
    headers.insert(header::CONTENT_TYPE, grpc::APPLICATION_GRPC);
    headers.insert(grpc::GRPC_STATUS, grpc::status_value(code));
    headers.insert(grpc::GRPC_MESSAGE, message);
    *res.headers_mut() = headers;
    res
}

/// The gRPC refusal for `decision` under `surface`'s policy: `RESOURCE_EXHAUSTED`, the
/// message rendered when the policy was bound, `grpc-retry-pushback-ms` (when the request
/// would fit later) and the rate-limit headers of `style`.
pub(crate) fn grpc_resource_exhausted(
    surface: &Surface,
    decision: &Decision,
    style: Fields,
) -> Response<Bytes> {
    let over = usize::from(decision.outcome() == Outcome::CostExceedsCapacity);
    let message = surface.grpc_messages[over].clone();
    let mut res = grpc_respond(code::RESOURCE_EXHAUSTED, message);
    let headers = res.headers_mut();
    if let Some(ms) = retry_after_ms(decision) {
        headers.insert(grpc::GRPC_RETRY_PUSHBACK_MS, HeaderValue::from(ms));
    }
    surface.headers.write(style, headers, decision);
    res
}

/// The gRPC status for a refusal the operator gave the HTTP status of: 401 is
/// `UNAUTHENTICATED`, 403 `PERMISSION_DENIED`, anything else `INVALID_ARGUMENT` (the request
/// lacks what the limiter needs; retrying it unchanged cannot help).
fn grpc_code_for(status: StatusCode) -> u8 {
    match status {
        StatusCode::UNAUTHORIZED => code::UNAUTHENTICATED,
        StatusCode::FORBIDDEN => code::PERMISSION_DENIED,
        _ => code::INVALID_ARGUMENT,
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
    /// The problem type of a 429 (IANA HTTP problem types registry, from the IETF httpapi
    /// ratelimit-headers draft).
    pub const PROBLEM_TYPE: &'static str = QUOTA_EXCEEDED_TYPE;

    pub(crate) fn new(decision: Decision, surface: Arc<Surface>, budget: Option<Duration>) -> Self {
        Self { decision, surface, budget }
    }

    /// `429 Too Many Requests`; `413 Content Too Large` when the request's body is larger
    /// than a tier counting request bytes can ever hold (it can never be admitted).
    #[must_use]
    pub fn status(&self) -> StatusCode {
        self.surface.status(&self.decision)
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

    /// The `grpc-retry-pushback-ms` value sent to gRPC clients (gRFC A6):
    /// [`retry_after`](Self::retry_after) in whole milliseconds, rounded up and at least 1;
    /// `None` when the cost can never fit (then the header is absent).
    #[must_use]
    pub fn retry_after_ms(&self) -> Option<u64> {
        retry_after_ms(&self.decision)
    }

    /// For a request the layer shaped: the wait budget it would have exceeded
    /// ([`shape`](crate::RateLimitLayerBuilder::shape)); `None` when policing.
    #[must_use]
    pub fn shaping_budget(&self) -> Option<Duration> {
        self.budget
    }

    /// The problem+json body (RFC 9457): type
    /// `https://iana.org/assignments/http-problem-types#quota-exceeded` (a 413's: `about:blank`),
    /// status, title, detail, and the violated tiers as `violated-policies`.
    #[must_use]
    pub fn body(&self) -> Bytes {
        match self.status() {
            StatusCode::PAYLOAD_TOO_LARGE => self.surface.too_large_body(&self.decision),
            _ => self.surface.body(&self.decision),
        }
    }

    /// The default response: 429, `Retry-After`, `Cache-Control: no-store`, the IETF
    /// `RateLimit-Policy` / `RateLimit` headers and the problem+json [`body`](Self::body) with
    /// its `Content-Length` (bytes). A service that replaces the body must replace or remove
    /// that field too, as with any response whose length is declared.
    #[must_use]
    pub fn to_response(&self) -> Response<Full<Bytes>> {
        self.response(Fields::default()).map(Full::new)
    }

    /// The default response with the headers of `style`.
    pub(crate) fn response(&self, style: Fields) -> Response<Bytes> {
        too_many_requests(&self.surface, &self.decision, style)
    }

    /// The trailers-only response to a gRPC call ([`crate::grpc`]), HTTP 200 with
    /// `grpc-status: 8` (`RESOURCE_EXHAUSTED`) and an empty body. It carries no `Retry-After`,
    /// since gRPC clients read `grpc-retry-pushback-ms` instead.
    ///
    /// ```
    /// use tollgate::{Limiter, Policy, Quota, Rejection};
    /// use tollgate::key::Key;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let limiter = Limiter::new(Policy::single("calls", Quota::per_minute(1)).unwrap());
    /// limiter.enforce(&Key::Global, 1).await.unwrap();
    /// let Err(Rejection::Limited(limited)) = limiter.enforce(&Key::Global, 1).await else {
    ///     panic!("expected a refusal");
    /// };
    /// let res = limited.to_grpc_response();
    /// assert_eq!(res.status(), 200);
    /// assert_eq!(res.headers()["content-type"], "application/grpc");
    /// assert_eq!(res.headers()["grpc-status"], "8");
    /// assert_eq!(res.headers()["grpc-message"], "rate limited by policy `calls`: quota exceeded");
    /// assert_eq!(res.headers()["grpc-retry-pushback-ms"], "60000");
    /// # }
    /// ```
    ///
    /// Its fields: `content-type: application/grpc`, `grpc-status: 8`, a `grpc-message`
    /// naming the policy (percent-encoded, as the gRPC over HTTP/2 protocol requires),
    /// `grpc-retry-pushback-ms` with [`retry_after_ms`](Self::retry_after_ms) (gRFC A6; absent
    /// when the cost can never fit), and the IETF `RateLimit-Policy` / `RateLimit` headers.
    #[must_use]
    pub fn to_grpc_response(&self) -> Response<Full<Bytes>> {
        self.grpc_response(Fields::default()).map(Full::new)
    }

    /// The gRPC response with the headers of `style`.
    pub(crate) fn grpc_response(&self, style: Fields) -> Response<Bytes> {
        grpc_resource_exhausted(&self.surface, &self.decision, style)
    }

    /// Adds `Retry-After` and the rate-limit headers of `style` to `res`.
    pub(crate) fn add_headers<B>(&self, style: Fields, res: &mut Response<B>) {
        add_headers(&self.surface, &self.decision, style, res);
    }
}

impl From<RateLimited> for Response<Full<Bytes>> {
    fn from(limited: RateLimited) -> Self {
        limited.to_response()
    }
}

/// Every refusal, as a value: what [`Limiter::enforce`](crate::Limiter::enforce) returns and
/// what the layer answers with when it does not pass a request on. Each gives its HTTP and
/// gRPC status and response.
///
/// ```
/// use tollgate::{Rejection, StoreError};
///
/// let refusal = Rejection::Unavailable(StoreError::backend("connection refused"));
/// assert_eq!(refusal.status(), 503);
/// assert_eq!(refusal.grpc_status(), 14); // UNAVAILABLE
/// assert_eq!(refusal.to_response().headers()["retry-after"], "1");
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum Rejection {
    /// The request does not fit its policy: 429.
    Limited(RateLimited),
    /// The store could not decide and the policy fails closed: 503 with `Retry-After: 1`.
    Unavailable(StoreError),
    /// No key could be read from the request (the layer's
    /// [`MissingKey::Reject`](crate::MissingKey::Reject)): 400 by default.
    MissingKey {
        /// The configured status.
        status: StatusCode,
        /// Why, when the layer explains missing keys in responses
        /// ([`explain_missing_key`](crate::RateLimitLayerBuilder::explain_missing_key)): the
        /// response's `detail` (gRPC: `grpc-message`) then names the extractor, what it
        /// looked for, and the usual fix.
        explained: Option<KeyMissing>,
    },
    /// The layer's selector chose no policy for the request and such requests are refused
    /// ([`Unselected::Reject`](crate::layer::Unselected::Reject)).
    Unselected(StatusCode),
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Limited(l) => l.fmt(f),
            Self::Unavailable(e) => write!(f, "the rate limiter cannot decide: {e}"),
            Self::MissingKey { explained: None, .. } => f.write_str(MISSING_KEY),
            Self::MissingKey { explained: Some(why), .. } => write!(f, "{MISSING_KEY}: {why}"),
            Self::Unselected(_) => f.write_str(UNSELECTED),
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
    /// The status of the response: 429 (413 for a body no tier can ever hold), 503, or the
    /// configured missing-key or unselected status.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Limited(l) => l.status(),
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::MissingKey { status, .. } | Self::Unselected(status) => *status,
        }
    }

    /// The `grpc-status` of the gRPC response ([`to_grpc_response`](Self::to_grpc_response)),
    /// 8 (`RESOURCE_EXHAUSTED`) when limited and 14 (`UNAVAILABLE`) when the store cannot
    /// decide. A missing key or an unselected request maps its configured HTTP status, 401 to
    /// 16 (`UNAUTHENTICATED`), 403 to 7 (`PERMISSION_DENIED`) and any other (the default 400
    /// included) to 3 (`INVALID_ARGUMENT`), since the call lacks what the limiter needs and
    /// retrying it unchanged cannot help.
    #[must_use]
    pub fn grpc_status(&self) -> u8 {
        match self {
            Self::Limited(_) => code::RESOURCE_EXHAUSTED,
            Self::Unavailable(_) => code::UNAVAILABLE,
            Self::MissingKey { status, .. } | Self::Unselected(status) => grpc_code_for(*status),
        }
    }

    /// The default response (see [`RateLimited::to_response`]); a 503 carries
    /// `Retry-After: 1`.
    #[must_use]
    pub fn to_response(&self) -> Response<Full<Bytes>> {
        self.response(Fields::default()).map(Full::new)
    }

    pub(crate) fn response(&self, style: Fields) -> Response<Bytes> {
        match self {
            Self::Limited(l) => l.response(style),
            Self::Unavailable(_) => {
                let mut res = respond(StatusCode::SERVICE_UNAVAILABLE, unavailable_body());
                res.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                res
            }
            Self::MissingKey { status, explained: None } => {
                respond(*status, refusal_body(*status, MISSING_KEY))
            }
            Self::MissingKey { status, explained: Some(_) } => {
                respond(*status, refusal_body(*status, &self.to_string()))
            }
            Self::Unselected(status) => respond(*status, refusal_body(*status, UNSELECTED)),
        }
    }

    /// The trailers-only response to a gRPC call ([`crate::grpc`]), HTTP 200 with
    /// `content-type: application/grpc`, the `grpc-status` of [`grpc_status`](Self::grpc_status),
    /// a percent-encoded `grpc-message` and an empty body. A limited call's carries what
    /// [`RateLimited::to_grpc_response`] lists, and a store failure's (`UNAVAILABLE`)
    /// `grpc-retry-pushback-ms: 1000`, as the HTTP 503 carries `Retry-After: 1`.
    #[must_use]
    pub fn to_grpc_response(&self) -> Response<Full<Bytes>> {
        self.grpc_response(Fields::default()).map(Full::new)
    }

    pub(crate) fn grpc_response(&self, style: Fields) -> Response<Bytes> {
        let code = self.grpc_status();
        match self {
            Self::Limited(l) => l.grpc_response(style),
            Self::Unavailable(_) => {
                let mut res = grpc_respond(code, HeaderValue::from_static(UNAVAILABLE));
                res.headers_mut()
                    .insert(grpc::GRPC_RETRY_PUSHBACK_MS, HeaderValue::from_static("1000"));
                res
            }
            Self::MissingKey { explained: None, .. } => {
                grpc_respond(code, HeaderValue::from_static(MISSING_KEY))
            }
            Self::MissingKey { explained: Some(_), .. } => {
                grpc_respond(code, grpc::message(&self.to_string()))
            }
            Self::Unselected(_) => grpc_respond(code, HeaderValue::from_static(UNSELECTED)),
        }
    }
}

// Messages of the refusals other than a 429, in plain printable ASCII without `%`: valid
// `grpc-message` values as they are.
const UNAVAILABLE: &str = "the rate limiter cannot decide right now";
const MISSING_KEY: &str = "no rate-limit key could be read from the request";
const UNSELECTED: &str = "no rate-limit policy applies to the request";

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
            UNAVAILABLE,
            &[],
        )
    });
    BODY.clone()
}

fn refusal_body(status: StatusCode, detail: &str) -> Bytes {
    problem(status, "about:blank", status.canonical_reason().unwrap_or("Bad Request"), detail, &[])
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
        let body: serde_json::Value = serde_json::from_slice(&surface.bodies[0b11].0).unwrap();
        assert_eq!(body["violated-policies"], serde_json::json!(["a", "b"]));
        assert_eq!(body["status"], 429);
        assert_eq!(body["type"], QUOTA_EXCEEDED_TYPE);
        let over: serde_json::Value = serde_json::from_slice(&surface.bodies[4 + 0b10].0).unwrap();
        assert_eq!(over["violated-policies"], serde_json::json!(["b"]));
        assert!(over["detail"].as_str().unwrap().contains("never"));
    }

    /// A decision of `outcome` on two tiers: (remaining, nanoseconds until full, nanoseconds
    /// until it would admit).
    fn decided(outcome: Outcome, tiers: [(u64, u64, Option<u64>); 2]) -> Decision {
        let retry = tiers.iter().filter_map(|t| t.2).max();
        let tiers = tiers
            .iter()
            .map(|&(r, reset, retry)| {
                crate::decision::TierDecision::new(10, r, reset, retry, retry.is_some())
            })
            .collect();
        Decision::new(outcome, 0, retry, tiers)
    }

    #[tokio::test]
    async fn a_429_from_the_kept_fields_is_the_429_written_field_by_field() {
        use http_body_util::BodyExt;
        let policy = Policy::builder("api")
            .tier("a", Quota::per_second(10))
            .tier("b", Quota::per_hour(10))
            .build()
            .unwrap();
        let surface = Surface::new(&policy);
        let secs = 1_000_000_000;
        let limited = [
            decided(Outcome::Limited, [(0, secs / 2, Some(secs / 10)), (4, 7 * secs, None)]),
            decided(Outcome::Limited, [(3, 2, None), (0, 3_599 * secs + 1, Some(3_500 * secs))]),
            decided(Outcome::Limited, [(0, 9_000 * secs, Some(7_200 * secs)), (1, 1, None)]),
        ];
        let other = decided(Outcome::CostExceedsCapacity, [(10, 0, None), (10, 0, None)]);
        for style in [HeaderStyle::Ietf, HeaderStyle::Both, HeaderStyle::Legacy, HeaderStyle::None]
        {
            for format in [HeaderFormat::Draft10, HeaderFormat::Draft7, HeaderFormat::Draft6] {
                let fields = Fields { style, format };
                for decision in limited.iter().chain([&other]) {
                    // Twice: the first refusal makes the kept fields, the second clones them.
                    for _ in 0..2 {
                        let res = too_many_requests(&surface, decision, fields);
                        let body = surface.body(decision);
                        let mut expected = respond(StatusCode::TOO_MANY_REQUESTS, body);
                        add_headers(&surface, decision, fields, &mut expected);
                        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
                        let got: Vec<_> = res.headers().iter().collect();
                        let want: Vec<_> = expected.headers().iter().collect();
                        assert_eq!(got, want, "{fields:?} {decision:?}");
                        let length = res.headers()[header::CONTENT_LENGTH].to_str().unwrap();
                        let length: usize = length.parse().unwrap();
                        let body = Full::new(res.into_body()).collect().await.unwrap().to_bytes();
                        assert_eq!(body.len(), length);
                        assert_eq!(body, surface.body(decision));
                    }
                }
            }
        }
        // Only the current draft's fields of a refusal that can be retried were kept.
        let kept = surface.limited.get().unwrap();
        assert_eq!(kept.keys().collect::<Vec<_>>(), LIMITED_FIELDS.iter().collect::<Vec<_>>());
    }

    /// Every problem-body refusal says its body's length, once: a 429 of a policy whose bodies
    /// were rendered at bind time and of one with more tiers (rendered per refusal), each
    /// header style, and the 503 and 400s.
    #[test]
    fn every_refusal_says_its_length_once() {
        let five = (0..5).fold(Policy::builder("five"), |b, i| {
            b.tier(format!("t{i}"), Quota::per_second(10 + i))
        });
        let secs = 1_000_000_000;
        let mut responses = Vec::new();
        for policy in [Policy::single("one", Quota::per_second(1)).unwrap(), five.build().unwrap()]
        {
            let surface = Surface::new(&policy);
            let n = policy.tiers().len();
            let tiers = (0..n).map(|i| {
                let wait = (i == n - 1).then_some(secs / 2);
                crate::decision::TierDecision::new(10, 0, secs, wait, wait.is_some())
            });
            let decision = Decision::new(Outcome::Limited, 0, Some(secs / 2), tiers.collect());
            for style in [HeaderStyle::Ietf, HeaderStyle::Both, HeaderStyle::None] {
                let fields = Fields { style, format: HeaderFormat::Draft10 };
                responses.push(too_many_requests(&surface, &decision, fields));
            }
        }
        let error = crate::StoreError::backend("down");
        for rejection in [
            Rejection::Unavailable(error),
            Rejection::MissingKey { status: StatusCode::BAD_REQUEST, explained: None },
            Rejection::Unselected(StatusCode::FORBIDDEN),
        ] {
            responses.push(rejection.response(Fields::default()));
        }
        for res in responses {
            let lengths: Vec<_> = res.headers().get_all(header::CONTENT_LENGTH).iter().collect();
            assert_eq!(lengths.len(), 1, "{res:?}");
            assert_eq!(lengths[0].to_str().unwrap(), res.body().len().to_string(), "{res:?}");
        }
    }

    #[tokio::test]
    async fn grpc_refusals_are_trailers_only() {
        let limiter =
            crate::Limiter::new(Policy::single("100% api", Quota::per_second(4)).unwrap());
        let key = crate::key::Key::Global;
        for _ in 0..4 {
            limiter.enforce(&key, 1).await.unwrap();
        }
        let Err(Rejection::Limited(limited)) = limiter.enforce(&key, 1).await else {
            panic!("expected a refusal")
        };
        assert_eq!(limited.retry_after_ms(), Some(250));
        let res = Rejection::Limited(limited).to_grpc_response();
        assert_eq!(res.status(), StatusCode::OK);
        let h = res.headers();
        assert_eq!(h["content-type"], "application/grpc");
        assert_eq!(h["grpc-status"], "8");
        assert_eq!(h["grpc-message"], "rate limited by policy `100%25 api`: quota exceeded");
        assert_eq!(h["grpc-retry-pushback-ms"], "250");
        assert_eq!(h["ratelimit"], r#""100% api";r=0;t=1"#);
        assert!(!h.contains_key("retry-after"));
        assert!(http_body::Body::is_end_stream(res.body()), "the headers end the stream");

        let over = limiter.check(&key, 5).await.unwrap();
        let res = limiter.rate_limited(over, None).to_grpc_response();
        assert_eq!(res.headers()["grpc-status"], "8");
        assert!(!res.headers().contains_key("grpc-retry-pushback-ms"));
    }

    #[test]
    fn grpc_status_of_every_refusal() {
        let unavailable = Rejection::Unavailable(StoreError::backend("down"));
        let res = unavailable.to_grpc_response();
        assert_eq!(unavailable.grpc_status(), 14);
        assert_eq!(res.headers()["grpc-status"], "14");
        assert_eq!(res.headers()["grpc-retry-pushback-ms"], "1000");
        assert_eq!(res.headers()["grpc-message"], "the rate limiter cannot decide right now");
        for (status, code) in [
            (StatusCode::BAD_REQUEST, "3"),
            (StatusCode::UNAUTHORIZED, "16"),
            (StatusCode::FORBIDDEN, "7"),
            (StatusCode::UNPROCESSABLE_ENTITY, "3"),
        ] {
            let missing = Rejection::MissingKey { status, explained: None };
            for rejection in [missing, Rejection::Unselected(status)] {
                let res = rejection.to_grpc_response();
                assert_eq!(res.status(), StatusCode::OK);
                assert_eq!(res.headers()["grpc-status"], code, "{status}");
                assert_eq!(rejection.grpc_status().to_string(), code);
                assert!(!res.headers().contains_key("grpc-retry-pushback-ms"));
            }
        }
        let res = Rejection::Unselected(StatusCode::FORBIDDEN).to_response();
        assert_eq!(res.status(), StatusCode::FORBIDDEN);
    }
}
