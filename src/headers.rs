//! The rate-limit headers: `RateLimit-Policy` / `RateLimit` (IETF httpapi ratelimit-headers
//! draft, RFC 9651 structured fields), legacy `X-RateLimit-*`, and `Retry-After`
//! (RFC 9110 §10.2.3).

use std::fmt::Write as _;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
#[cfg(any(feature = "config", test))]
use smallvec::SmallVec;

use crate::decision::Decision;
use crate::policy::{Policy, Tier};
use crate::quota::{Algorithm, TierKind, Unit};

/// Which rate-limit headers responses carry (default [`Ietf`](Self::Ietf)). Set it with
/// [`RateLimitLayerBuilder::headers`](crate::RateLimitLayerBuilder::headers).
///
/// ```
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use tollgate::{HeaderStyle, Policy, Quota, RateLimitLayer, key::GlobalKey};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_minute(5)).unwrap())
///     .key(GlobalKey)
///     .headers(HeaderStyle::Both)
///     .build()
///     .unwrap();
/// let svc = layer.layer(service_fn(|_req| async {
///     Ok::<_, std::convert::Infallible>(Response::new(Full::<bytes::Bytes>::default()))
/// }));
/// let res = svc.oneshot(Request::new(Full::<bytes::Bytes>::default())).await.unwrap();
/// assert_eq!(res.headers()["ratelimit"], r#""api";r=4;t=12"#);
/// assert_eq!(res.headers()["x-ratelimit-remaining"], "4");
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "config", derive(serde::Deserialize), serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum HeaderStyle {
    /// `RateLimit-Policy` and `RateLimit` of the IETF httpapi ratelimit-headers draft
    /// (draft-ietf-httpapi-ratelimit-headers-10): one item per tier, named after it.
    /// `RateLimit-Policy: "burst";q=10;w=1` says the tier grants `q` units per `w` seconds
    /// (`q` is the tier's capacity, `w` the seconds it takes to refill it from empty, rounded
    /// up); `RateLimit: "burst";r=7;t=1` says `r` units remain now (never more than `q`) and the
    /// tier is full again in `t` seconds (rounded up).
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

/// Which revision of the IETF httpapi ratelimit-headers draft the `RateLimit*` fields follow
/// (default [`Draft10`](Self::Draft10), with [`HeaderStyle::Ietf`] or [`HeaderStyle::Both`]),
/// for clients written against an older revision. Set it with
/// [`RateLimitLayerBuilder::header_format`](crate::RateLimitLayerBuilder::header_format), as
/// express-rate-limit's `standardHeaders` offers the same choice.
///
/// ```
/// use tollgate::{HeaderFormat, Policy, Quota, RateLimitLayer};
///
/// let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_second(5)).unwrap())
///     .header_format(HeaderFormat::Draft7) // RateLimit: limit=5, remaining=4, reset=1
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
///
/// Every value is an RFC 9651 structured field:
///
/// | format | `RateLimit-Policy` | state |
/// |---|---|---|
/// | [`Draft10`](Self::Draft10) | `"burst";q=10;w=1, "daily";q=1000;w=86400` | `RateLimit: "burst";r=7;t=1, "daily";r=997;t=260` |
/// | [`Draft7`](Self::Draft7) | `10;w=1, 1000;w=86400` | `RateLimit: limit=10, remaining=7, reset=1` |
/// | [`Draft6`](Self::Draft6) | `10;w=1, 1000;w=86400` | `RateLimit-Limit: 10`, `RateLimit-Remaining: 7`, `RateLimit-Reset: 1` |
///
/// Draft 7 and draft 6 describe one limit in the state fields: the tier with the fewest units
/// remaining (the first of equals), as `X-RateLimit-*` do. In every format `q`/`limit` is the
/// tier's capacity, the remaining count never exceeds it, and `w`/`reset` are whole seconds
/// rounded up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "config", derive(serde::Deserialize), serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum HeaderFormat {
    /// draft-ietf-httpapi-ratelimit-headers-10 (the current revision, default): one named item
    /// per tier in `RateLimit-Policy` (`q`, `w`) and `RateLimit` (`r`, `t`).
    #[default]
    Draft10,
    /// draft-ietf-httpapi-ratelimit-headers-07: `RateLimit` is a dictionary (`limit`,
    /// `remaining`, `reset`); `RateLimit-Policy` lists each tier's capacity with `w`.
    Draft7,
    /// draft-ietf-httpapi-ratelimit-headers-06: `RateLimit-Limit`, `RateLimit-Remaining`,
    /// `RateLimit-Reset` as integers; `RateLimit-Policy` as in draft 7.
    Draft6,
}

/// Which header fields a layer writes: the families and the draft revision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Fields {
    pub(crate) style: HeaderStyle,
    pub(crate) format: HeaderFormat,
}

/// Whole seconds, rounded up.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// A tier's `t` (or `reset`): the seconds until it is full again, rounded up; at least 1 for
/// a tier that refused the request, whose client would otherwise read "retry now" (a cost
/// above the capacity of a full tier included).
#[inline]
fn reset_secs(d: &crate::decision::TierDecision) -> u64 {
    let secs = ceil_secs(d.reset_after());
    if d.is_violated() { secs.max(1) } else { secs }
}

/// Writes `s` as an RFC 9651 String. Names are validated printable ASCII; the two characters
/// the RFC requires are escaped.
fn sf_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
}

/// A header value that lives as long as the process: copying it (into every response) takes no
/// reference count, so threads answering at once do not contend on one. Equal values are
/// stored once, so rebuilding a policy does not grow memory.
fn interned(s: String) -> &'static HeaderValue {
    static VALUES: Mutex<Vec<&'static HeaderValue>> = Mutex::new(Vec::new());
    let mut values = VALUES.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(v) = values.iter().find(|v| v.as_bytes() == s.as_bytes()) {
        return v;
    }
    let text: &'static str = Box::leak(s.into_boxed_str());
    let value = HeaderValue::from_maybe_shared(Bytes::from_static(text.as_bytes()))
        .unwrap_or_else(|_| HeaderValue::from_static(""));
    let value: &'static HeaderValue = Box::leak(Box::new(value));
    values.push(value);
    value
}

// Header names as constants: `HeaderName::from_static` validates its argument, which in a
// `const` happens once, at compile time, instead of on every response.
pub(crate) const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub(crate) const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("ratelimit-limit");
const RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("ratelimit-remaining");
const RATELIMIT_RESET: HeaderName = HeaderName::from_static("ratelimit-reset");
const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// The rate-limit headers of one response, rendered when it was decided and inserted when the
/// response is ready. Small, because the response future carries it; the fields of draft 6 and
/// the legacy family, rarely asked for, are behind one pointer.
#[derive(Debug, Default, Clone)]
pub(crate) struct PreparedHeaders {
    /// `RateLimit-Policy`, and `RateLimit` (none in draft 6).
    ietf: Option<(&'static HeaderValue, Option<HeaderValue>)>,
    /// Draft 6's fields, the legacy family, and whether the layer hands them on.
    more: Option<Box<More>>,
}

/// The header fields of [`PreparedHeaders`] other than the current draft's, as numbers: each set is
/// the capacity, remaining units and seconds until full of one tier (the tightest), compared
/// by its remaining units when several layers limited the request.
#[derive(Debug, Default, Clone)]
struct More {
    /// Draft 6's `RateLimit-Limit`, `-Remaining`, `-Reset`.
    draft6: Option<[u64; 3]>,
    /// `X-RateLimit-Limit`, `-Remaining`, `-Reset`.
    legacy: Option<[u64; 3]>,
    /// Draft 7's `RateLimit` dictionary (`limit`, `remaining`, `reset`), kept as numbers so
    /// that several layers' are reduced to the tightest rather than listed (a dictionary with
    /// repeated keys keeps only the last, RFC 9651 §3.2).
    draft7: Option<[u64; 3]>,
    /// Handed on in the response's [`Collected`] rather than written: the layer is one of
    /// several that limit the request (the rules of a configuration file).
    collect: bool,
}

/// The rate-limit headers of the layers that limited one request, innermost first, carried in
/// the response's extensions while it passes out through them, and written once, by
/// [`Collected::write`], where the last of them is passed: the rules of a configuration file
/// that apply together hand their decisions on as values, never as header text to read back.
#[derive(Debug, Default, Clone)]
pub(crate) struct Collected(Vec<PreparedHeaders>);

impl PreparedHeaders {
    /// Whether there is nothing to insert (the layer writes no rate-limit headers).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        self.ietf.is_none() && self.more.is_none()
    }

    /// Inserts the headers into `res`, or adds them to its [`Collected`] when they were
    /// prepared to be handed on (see [`Headers::prepare`]).
    #[inline]
    pub(crate) fn apply<B>(self, res: &mut http::Response<B>) {
        if self.more.as_ref().is_some_and(|m| m.collect) {
            return self.hand_on(res.extensions_mut());
        }
        self.insert(res.headers_mut());
    }

    /// [`apply`](Self::apply) to a response's head.
    #[inline]
    pub(crate) fn apply_parts(self, head: &mut http::response::Parts) {
        if self.more.as_ref().is_some_and(|m| m.collect) {
            return self.hand_on(&mut head.extensions);
        }
        self.insert(&mut head.headers);
    }

    /// Adds the headers to the response's [`Collected`], after those of the layers inside.
    #[cold]
    fn hand_on(self, extensions: &mut http::Extensions) {
        match extensions.get_mut::<Collected>() {
            Some(collected) => collected.0.push(self),
            None => {
                extensions.insert(Collected(vec![self]));
            }
        }
    }

    /// Inserts the headers into `headers`.
    #[inline]
    pub(crate) fn insert(self, headers: &mut HeaderMap) {
        if let Some((policy, state)) = self.ietf {
            headers.insert(RATELIMIT_POLICY, policy.clone());
            if let Some(state) = state {
                headers.insert(RATELIMIT, state);
            }
        }
        if let Some(more) = self.more {
            more.insert(headers);
        }
    }
}

impl More {
    fn insert(&self, headers: &mut HeaderMap) {
        if let Some([limit, remaining, reset]) = self.draft6 {
            headers.insert(RATELIMIT_LIMIT, HeaderValue::from(limit));
            headers.insert(RATELIMIT_REMAINING, HeaderValue::from(remaining));
            headers.insert(RATELIMIT_RESET, HeaderValue::from(reset));
        }
        if let Some([limit, remaining, reset]) = self.legacy {
            headers.insert(X_RATELIMIT_LIMIT, HeaderValue::from(limit));
            headers.insert(X_RATELIMIT_REMAINING, HeaderValue::from(remaining));
            headers.insert(X_RATELIMIT_RESET, HeaderValue::from(reset));
        }
    }
}

impl Collected {
    /// Writes the headers of every layer that limited the request, rendered once:
    /// `RateLimit-Policy` and `RateLimit` list the items of each layer in turn, outermost
    /// first (RFC 9651 lists combine by joining them with `, `); draft 7's `RateLimit`, draft
    /// 6's fields and the legacy `X-RateLimit-*` are those of the tightest tier of them all,
    /// the one with the fewest units remaining (the outermost of equals), as they are within
    /// one policy.
    #[cfg(any(feature = "config", test))]
    pub(crate) fn write(self, headers: &mut HeaderMap) {
        let mut policies: SmallVec<[&HeaderValue; 4]> = SmallVec::new();
        let mut states: SmallVec<[HeaderValue; 4]> = SmallVec::new();
        let mut more = More::default();
        let tighter = |now: Option<[u64; 3]>, next: Option<[u64; 3]>| match (now, next) {
            (Some(now), Some(next)) if next[1] >= now[1] => Some(now),
            (now, None) => now,
            (_, next) => next,
        };
        // Innermost first, as the response came out: the outermost is the last.
        for prepared in self.0.into_iter().rev() {
            let dictionary = prepared.more.as_ref().is_some_and(|m| m.draft7.is_some());
            if let Some((policy, state)) = prepared.ietf {
                policies.push(policy);
                // A draft 7 dictionary is reduced with the others below, not listed.
                states.extend(state.filter(|_| !dictionary));
            }
            if let Some(m) = prepared.more {
                more.draft6 = tighter(more.draft6, m.draft6);
                more.legacy = tighter(more.legacy, m.legacy);
                more.draft7 = tighter(more.draft7, m.draft7);
            }
        }
        if let Some(policy) = joined(policies.iter().map(|v| v.as_bytes())) {
            headers.insert(RATELIMIT_POLICY, policy);
        }
        // Draft 7's dictionaries cannot be listed: the tightest of them all, unless rules of
        // the current draft applied too, whose list is then the field (rules that apply
        // together should share one format; see the configuration's `header_format`).
        let state = match (joined(states.iter().map(HeaderValue::as_bytes)), more.draft7) {
            (Some(list), _) => Some(list),
            (None, t) => t.map(draft7),
        };
        if let Some(state) = state {
            headers.insert(RATELIMIT, state);
        }
        more.insert(headers);
    }
}

/// Draft 7's `RateLimit` value for a tier's capacity, remaining units and seconds until full.
fn draft7([limit, remaining, reset]: [u64; 3]) -> HeaderValue {
    let text = format!("limit={limit}, remaining={remaining}, reset={reset}");
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// The values joined with `, `; `None` for no value.
#[cfg(any(feature = "config", test))]
fn joined<'a>(mut values: impl Iterator<Item = &'a [u8]>) -> Option<HeaderValue> {
    let first = values.next()?;
    let mut out = first.to_vec();
    for value in values {
        out.extend_from_slice(b", ");
        out.extend_from_slice(value);
    }
    // Visible ASCII joined with visible ASCII and `, `: valid.
    HeaderValue::from_maybe_shared(Bytes::from(out)).ok()
}

/// The window `w` of a tier in whole seconds (at least 1): the time to refill its capacity from
/// empty, `capacity x period / count`; a window algorithm's period.
fn window_secs(policy: &Policy, tier: &Tier) -> u64 {
    let q = tier.quota();
    let period = u128::from(tier.rate.period) * u128::from(policy.unit());
    let nanos = match policy.algorithm() {
        Algorithm::FixedWindow | Algorithm::SlidingLog | Algorithm::SlidingCounter => period,
        _ => (u128::from(tier.capacity()) * period).div_ceil(u128::from(q.count())),
    };
    u64::try_from(nanos.div_ceil(1_000_000_000)).unwrap_or(u64::MAX).max(1)
}

/// The draft's quota unit (`qu`) of a tier that does not count requests per window:
/// `content-bytes` for request or response bytes, `concurrent-requests` for a concurrency tier,
/// and (not registered by the draft) `reported` for units a handler reports and `messages` for
/// gRPC messages.
fn quota_unit(tier: &Tier) -> Option<&'static str> {
    if tier.kind() == TierKind::Concurrency {
        return Some("concurrent-requests");
    }
    match tier.unit() {
        Unit::Requests => None,
        Unit::RequestBytes | Unit::ResponseBytes => Some("content-bytes"),
        Unit::Reported => Some("reported"),
        Unit::RequestMessages | Unit::ResponseMessages => Some("messages"),
    }
}

/// How many rendered `RateLimit` values a bound policy keeps for reuse (about 4 KiB).
const RECENT: usize = 64;

/// A rendered `RateLimit` value and the state it shows: per tier, the remaining units and the
/// whole seconds until full.
#[derive(Debug, Clone)]
struct Recent {
    state: Box<[(u64, u64)]>,
    value: HeaderValue,
}

/// The rate-limit headers of one policy, rendered once when the policy is bound: what does not
/// change between responses is rendered here.
#[derive(Debug, Clone)]
pub(crate) struct Headers {
    /// The `RateLimit-Policy` value (constant for the policy).
    policy: &'static HeaderValue,
    /// The `RateLimit-Policy` value of drafts 7 and 6: `q;w=W` per tier.
    unnamed_policy: &'static HeaderValue,
    /// Per tier, the start of its `RateLimit` item: `"name";r=`.
    items: Box<[Box<str>]>,
    /// Per tier, its capacity (`q`, and the legacy `X-RateLimit-Limit`).
    capacities: Box<[u64]>,
    /// `RateLimit` values rendered before, by a hash of the state they show; each slot is
    /// filled once, by the first state that lands in it, and kept. Most responses show a state
    /// seen before (a client under its limit finds its bucket full, or nearly: the same few
    /// remaining counts and seconds), so they clone a validated value instead of rendering
    /// and validating one. A state whose slot holds another is rendered as before.
    recent: Box<[OnceLock<Recent>]>,
}

impl Headers {
    pub(crate) fn new(policy: &Policy) -> Self {
        let mut rendered = String::new();
        let mut unnamed = String::new();
        let mut items = Vec::with_capacity(policy.tiers().len());
        for (i, t) in policy.tiers().iter().enumerate() {
            if i > 0 {
                rendered.push_str(", ");
                unnamed.push_str(", ");
            }
            sf_string(&mut rendered, t.name());
            let _ = write!(rendered, ";q={}", t.capacity());
            let _ = write!(unnamed, "{}", t.capacity());
            // A concurrency tier has no window: `q` requests at once.
            if t.kind() != TierKind::Concurrency {
                let _ = write!(rendered, ";w={}", window_secs(policy, t));
                let _ = write!(unnamed, ";w={}", window_secs(policy, t));
            }
            if let Some(unit) = quota_unit(t) {
                let _ = write!(rendered, ";qu=\"{unit}\"");
                let _ = write!(unnamed, ";qu=\"{unit}\"");
            }
            let mut item = String::new();
            sf_string(&mut item, t.name());
            item.push_str(";r=");
            items.push(item.into_boxed_str());
        }
        let capacities = policy.tiers().iter().map(Tier::capacity).collect();
        Self {
            policy: interned(rendered),
            unnamed_policy: interned(unnamed),
            items: items.into(),
            capacities,
            recent: (0..RECENT).map(|_| OnceLock::new()).collect(),
        }
    }

    /// The `RateLimit-Policy` value of the current draft.
    pub(crate) fn policy_value(&self) -> &'static HeaderValue {
        self.policy
    }

    /// The header fields of `fields` for `decision`; with `collect`, handed on in the
    /// response's [`Collected`] instead of written (the layer is one of several rules that
    /// limit the request), with what combining them needs.
    #[inline]
    pub(crate) fn prepare(
        &self,
        fields: Fields,
        decision: &Decision,
        collect: bool,
    ) -> PreparedHeaders {
        if decision.tiers.is_empty() || fields.style == HeaderStyle::None {
            return PreparedHeaders::default();
        }
        // The default fields, written by this layer: built here, without the general case's
        // checks of every family and draft.
        if fields == Fields::default() && !collect {
            return PreparedHeaders {
                ietf: Some((self.policy, Some(self.state(decision)))),
                more: None,
            };
        }
        self.render(fields, decision, collect)
    }

    /// [`prepare`](Self::prepare) for a layer that writes headers.
    fn render(&self, fields: Fields, decision: &Decision, collect: bool) -> PreparedHeaders {
        let mut out = PreparedHeaders::default();
        if collect {
            out.more.get_or_insert_default().collect = true;
        }
        let style = fields.style;
        if matches!(style, HeaderStyle::Ietf | HeaderStyle::Both) {
            match fields.format {
                HeaderFormat::Draft10 => out.ietf = Some((self.policy, Some(self.state(decision)))),
                HeaderFormat::Draft7 => {
                    let tightest = self.tightest(decision);
                    out.ietf = Some((self.unnamed_policy, tightest.map(draft7)));
                    // Only several rules' dictionaries are reduced to one (the numbers).
                    if let (Some(t), true) = (tightest, collect) {
                        out.more.get_or_insert_default().draft7 = Some(t);
                    }
                }
                HeaderFormat::Draft6 => {
                    out.ietf = Some((self.unnamed_policy, None));
                    if let Some(t) = self.tightest(decision) {
                        out.more.get_or_insert_default().draft6 = Some(t);
                    }
                }
            }
        }
        if matches!(style, HeaderStyle::Legacy | HeaderStyle::Both) {
            if let Some(t) = self.tightest(decision) {
                out.more.get_or_insert_default().legacy = Some(t);
            }
        }
        out
    }

    /// The capacity, remaining units and seconds until full (rounded up) of the tier with the
    /// fewest units remaining (the first of equals).
    fn tightest(&self, decision: &Decision) -> Option<[u64; 3]> {
        let tiers = decision.tiers.iter().zip(self.capacities.iter());
        let (t, capacity) = tiers.min_by_key(|(t, _)| t.remaining)?;
        Some([*capacity, t.remaining, reset_secs(t)])
    }

    /// The `RateLimit` value for `decision`: `"name";r=R;t=T` per tier. A state rendered before
    /// is a clone of that value (a reference count) when it still holds its slot of
    /// [`recent`](Self::recent); any other is [`rendered`](Self::rendered).
    pub(crate) fn state(&self, decision: &Decision) -> HeaderValue {
        let shown = || {
            let tiers = decision.tiers.iter().take(self.items.len());
            tiers.map(|d| (d.remaining, reset_secs(d)))
        };
        let hash = shown().fold(0u64, |h, (r, t)| {
            h.wrapping_mul(31).wrapping_add(r.wrapping_mul(31).wrapping_add(t))
        });
        // The remainder is below `RECENT`, so the cast loses nothing.
        let slot = &self.recent[(hash % RECENT as u64) as usize];
        match slot.get() {
            Some(recent) if recent.state.iter().copied().eq(shown()) => recent.value.clone(),
            Some(_) => self.rendered(decision),
            None => {
                let value = self.rendered(decision);
                let state = shown().collect();
                slot.get_or_init(|| Recent { state, value: value.clone() });
                value
            }
        }
    }

    /// The `RateLimit` value for `decision`, rendered: written into a buffer on the stack and
    /// copied once into the value (on the heap only for very long names).
    fn rendered(&self, decision: &Decision) -> HeaderValue {
        let mut buf = [0u8; 160];
        let mut len = 0;
        let mut numbers = itoa::Buffer::new();
        let mut fits = true;
        let mut push = |buf: &mut [u8; 160], bytes: &[u8]| match buf.get_mut(len..len + bytes.len())
        {
            Some(dst) => {
                dst.copy_from_slice(bytes);
                len += bytes.len();
            }
            None => fits = false,
        };
        for (i, (item, d)) in self.items.iter().zip(decision.tiers.iter()).enumerate() {
            if i > 0 {
                push(&mut buf, b", ");
            }
            push(&mut buf, item.as_bytes());
            push(&mut buf, numbers.format(d.remaining).as_bytes());
            push(&mut buf, b";t=");
            push(&mut buf, numbers.format(reset_secs(d)).as_bytes());
        }
        let bytes =
            if fits { Bytes::copy_from_slice(&buf[..len]) } else { self.state_long(decision) };
        HeaderValue::from_maybe_shared(bytes).unwrap_or_else(|_| HeaderValue::from_static(""))
    }

    /// [`rendered`](Self::rendered) for values that do not fit the stack buffer.
    #[cold]
    fn state_long(&self, decision: &Decision) -> Bytes {
        let mut out = String::new();
        for (i, (item, d)) in self.items.iter().zip(decision.tiers.iter()).enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            let _ = write!(out, "{item}{};t={}", d.remaining, reset_secs(d));
        }
        Bytes::from(out)
    }

    /// Writes the header fields of `fields` for `decision`.
    pub(crate) fn write(&self, fields: Fields, headers: &mut HeaderMap, decision: &Decision) {
        self.prepare(fields, decision, false).insert(headers);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Limiter;
    use crate::clock::FakeClock;
    use crate::decision::{Outcome, TierDecision};
    use crate::key::Key;
    use crate::quota::Quota;
    use crate::store::MemoryStore;

    #[tokio::test]
    async fn headers_render_every_tier_exactly() {
        let policy = Policy::builder("api")
            .tier("burst", Quota::per_second(10))
            .tier("daily \"q\"", Quota::per_day(12_345))
            .build()
            .unwrap();
        let limiter = Limiter::new(policy.clone());
        let decision = limiter.check(&Key::Global, 3).await.unwrap();
        let headers = Headers::new(&policy);
        let mut map = HeaderMap::new();
        headers.write(
            Fields { style: HeaderStyle::Both, ..Fields::default() },
            &mut map,
            &decision,
        );
        assert_eq!(map["ratelimit-policy"], r#""burst";q=10;w=1, "daily \"q\"";q=12345;w=86400"#);
        assert_eq!(map["ratelimit"], r#""burst";r=7;t=1, "daily \"q\"";r=12342;t=21"#);
        assert_eq!(map["x-ratelimit-limit"], "10");
        assert_eq!(map["x-ratelimit-remaining"], "7");
        assert_eq!(map["x-ratelimit-reset"], "1");
        let state = map["ratelimit"].as_bytes();
        assert_eq!(state.len(), r#""burst";r=7;t=1, "daily \"q\"";r=12342;t=21"#.len());
    }

    #[tokio::test]
    async fn long_names_render_the_same_through_the_heap() {
        let long = "n".repeat(200);
        let policy = Policy::builder("p")
            .tier(long.clone(), Quota::per_second(3))
            .tier("b", Quota::per_hour(7))
            .build()
            .unwrap();
        let decision = Limiter::new(policy.clone()).check(&Key::Global, 1).await.unwrap();
        let value = Headers::new(&policy).state(&decision);
        assert_eq!(value, format!("\"{long}\";r=2;t=1, \"b\";r=6;t=515"));
    }

    /// A limiter of `policy` on a clock that does not move.
    fn frozen(policy: &Policy) -> Limiter {
        let store = MemoryStore::builder().clock(FakeClock::new()).build().unwrap();
        Limiter::with_store(policy.clone(), store).unwrap()
    }

    /// The headers of three nested layers, handed on and written once: the lists in order,
    /// outermost first, and the legacy set of the tightest tier of all (the outermost of
    /// equals).
    #[tokio::test]
    async fn collected_headers_are_written_once_outermost_first() {
        let both = Fields { style: HeaderStyle::Both, ..Fields::default() };
        let prepared = |name: &'static str, quota: Quota, cost: u64| async move {
            let policy = Policy::single(name, quota).unwrap();
            let decision = frozen(&policy).check(&Key::Global, cost).await.unwrap();
            Headers::new(&policy).prepare(both, &decision, true)
        };
        let outer = prepared("a", Quota::per_hour(3600), 1).await;
        let middle = prepared("b", Quota::per_hour(2), 1).await;
        let inner = prepared("c", Quota::per_hour(3), 3).await;
        // As the response comes out: the innermost layer first.
        let mut res = http::Response::new(());
        for p in [inner, middle, outer] {
            p.apply(&mut res);
        }
        assert!(res.headers().is_empty(), "handed on, not written: {:?}", res.headers());
        let collected = res.extensions_mut().remove::<Collected>().unwrap();
        collected.write(res.headers_mut());
        let h = res.headers();
        assert_eq!(h["ratelimit-policy"], r#""a";q=3600;w=3600, "b";q=2;w=3600, "c";q=3;w=3600"#);
        assert_eq!(h["ratelimit"], r#""a";r=3599;t=1, "b";r=1;t=1800, "c";r=0;t=3600"#);
        let legacy = ["x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset"];
        assert_eq!(legacy.map(|n| &h[n]), ["3", "0", "3600"]);
        assert_eq!(h.len(), 5);

        // Equals: the outermost's set. A layer without headers adds nothing.
        let mut res = http::Response::new(());
        prepared("d", Quota::per_hour(5), 4).await.apply(&mut res);
        PreparedHeaders::default().apply(&mut res);
        prepared("e", Quota::per_minute(1), 0).await.apply(&mut res);
        prepared("f", Quota::per_hour(7), 6).await.apply(&mut res);
        res.extensions_mut().remove::<Collected>().unwrap().write(res.headers_mut());
        let h = res.headers();
        assert_eq!(h["ratelimit"], r#""f";r=1;t=3086, "e";r=1;t=0, "d";r=1;t=2880"#);
        assert_eq!(legacy.map(|n| &h[n]), ["7", "1", "3086"]);
    }

    /// Draft 6 writes one tier's numbers, and each layer's `RateLimit-Policy`: handed on, the
    /// numbers are the tightest tier's of all layers, and the policies are listed.
    #[tokio::test]
    async fn collected_draft6_fields_are_the_tightest_tiers() {
        let draft6 = Fields { style: HeaderStyle::Ietf, format: HeaderFormat::Draft6 };
        let mut res = http::Response::new(());
        for (name, quota, cost) in
            [("in", Quota::per_minute(4), 1), ("out", Quota::per_minute(10), 9)]
        {
            let policy = Policy::single(name, quota).unwrap();
            let decision = frozen(&policy).check(&Key::Global, cost).await.unwrap();
            Headers::new(&policy).prepare(draft6, &decision, true).apply(&mut res);
        }
        res.extensions_mut().remove::<Collected>().unwrap().write(res.headers_mut());
        let h = res.headers();
        assert_eq!(h["ratelimit-policy"], "10;w=60, 4;w=60");
        assert!(h.get("ratelimit").is_none());
        let fields = ["ratelimit-limit", "ratelimit-remaining", "ratelimit-reset"];
        assert_eq!(fields.map(|n| &h[n]), ["10", "1", "54"]);
    }

    #[tokio::test]
    async fn collected_draft7_state_is_the_tightest_tiers_one_dictionary() {
        let draft7 = Fields { style: HeaderStyle::Ietf, format: HeaderFormat::Draft7 };
        let mut res = http::Response::new(());
        // The inner rule is tighter: its dictionary, not both (a parser keeps the last of
        // repeated keys, which would be the outer rule's here).
        for (name, quota, cost) in
            [("in", Quota::per_minute(10), 9), ("out", Quota::per_minute(4), 1)]
        {
            let policy = Policy::single(name, quota).unwrap();
            let decision = frozen(&policy).check(&Key::Global, cost).await.unwrap();
            Headers::new(&policy).prepare(draft7, &decision, true).apply(&mut res);
        }
        res.extensions_mut().remove::<Collected>().unwrap().write(res.headers_mut());
        let h = res.headers();
        assert_eq!(h["ratelimit-policy"], "4;w=60, 10;w=60");
        assert_eq!(h["ratelimit"], "limit=10, remaining=1, reset=54");
    }

    /// A decision admitting with `tiers` of (remaining units, nanoseconds until full).
    fn admitted(tiers: &[(u64, u64)]) -> Decision {
        let tiers = tiers.iter().map(|&(r, t)| TierDecision::new(1_000, r, t, None, false));
        Decision::new(Outcome::Allowed, 0, None, tiers.collect())
    }

    #[test]
    fn a_state_seen_before_reuses_its_rendered_value() {
        let policy = Policy::single("p", Quota::per_second(1_000_000_000)).unwrap();
        let headers = Headers::new(&policy);
        let first = headers.state(&admitted(&[(999_999_999, 1)]));
        let again = headers.state(&admitted(&[(999_999_999, 1)]));
        assert_eq!(first, r#""p";r=999999999;t=1"#);
        assert_eq!(again, r#""p";r=999999999;t=1"#);
        // The same bytes, not a second rendering of them.
        assert_eq!(first.as_bytes().as_ptr(), again.as_bytes().as_ptr());
        // Seconds until full are part of the state shown.
        let later = headers.state(&admitted(&[(999_999_999, 1_000_000_001)]));
        assert_eq!(later, r#""p";r=999999999;t=2"#);
    }

    #[test]
    fn states_beyond_the_kept_values_render_exactly() {
        let policy = Policy::builder("p")
            .tier("a", Quota::per_second(1_000))
            .tier("b", Quota::per_hour(1_000))
            .build()
            .unwrap();
        let headers = Headers::new(&policy);
        // Four times as many states as values kept, twice over: every slot is taken, most
        // states find theirs holding another, and each value is still exactly its own.
        for _ in 0..2 {
            for r in 0..4 * RECENT as u64 {
                let secs = r % 7 * 1_000_000_000 + 1;
                let value = headers.state(&admitted(&[(r, secs), (1_000 - r, 3_600_000_000_000)]));
                let t = r % 7 + 1;
                assert_eq!(value, format!(r#""a";r={r};t={t}, "b";r={};t=3600"#, 1_000 - r));
            }
        }
        assert!(headers.recent.iter().all(|slot| slot.get().is_some()));
    }

    /// The default fields (the current draft, written by this layer) are built without the
    /// general render, on the admitted path: they must be its fields exactly, whether the
    /// state is one kept from before or rendered anew, and with `collect` they are handed on
    /// as the general render hands them on.
    #[test]
    fn the_default_fields_are_the_general_renders() {
        let policy = Policy::builder("api")
            .tier("burst", Quota::per_second(10))
            .tier("daily", Quota::per_day(1_000))
            .build()
            .unwrap();
        let headers = Headers::new(&policy);
        let written = |prepared: PreparedHeaders| {
            let mut res = http::Response::new(());
            prepared.apply(&mut res);
            let collected = res.extensions_mut().remove::<Collected>();
            (res.headers().clone(), collected.map(|c| c.0.len()))
        };
        // Each state twice: rendered anew, then the value kept for it.
        for r in [10, 9, 0, 9, 0, 10] {
            let decision = admitted(&[(r, 1_500_000_000), (1_000 - r, 86_400_000_000_000)]);
            let fast = written(headers.prepare(Fields::default(), &decision, false));
            let general = written(headers.render(Fields::default(), &decision, false));
            assert_eq!(fast, general, "r={r}");
            let (h, collected) = fast;
            assert_eq!(collected, None);
            assert_eq!(h["ratelimit-policy"], r#""burst";q=10;w=1, "daily";q=1000;w=86400"#);
            let state = format!(r#""burst";r={r};t=2, "daily";r={};t=86400"#, 1_000 - r);
            assert_eq!(h["ratelimit"], state.as_str());
            assert_eq!(h.len(), 2);
            // Collected for an outer layer: handed on, nothing written.
            let fast = written(headers.prepare(Fields::default(), &decision, true));
            assert_eq!(fast, written(headers.render(Fields::default(), &decision, true)));
            assert_eq!(fast, (HeaderMap::new(), Some(1)));
        }
    }

    #[tokio::test]
    async fn collected_draft10_items_are_kept_beside_a_draft7_rule() {
        let draft7 = Fields { style: HeaderStyle::Ietf, format: HeaderFormat::Draft7 };
        let draft10 = Fields { style: HeaderStyle::Ietf, format: HeaderFormat::Draft10 };
        let mut res = http::Response::new(());
        for (name, quota, cost, fields) in
            [("in", Quota::per_minute(10), 9, draft7), ("out", Quota::per_minute(4), 1, draft10)]
        {
            let policy = Policy::single(name, quota).unwrap();
            let decision = frozen(&policy).check(&Key::Global, cost).await.unwrap();
            Headers::new(&policy).prepare(fields, &decision, true).apply(&mut res);
        }
        res.extensions_mut().remove::<Collected>().unwrap().write(res.headers_mut());
        assert_eq!(res.headers()["ratelimit"], r#""out";r=3;t=15"#);
    }

    #[test]
    fn q_is_the_capacity_and_w_the_time_to_refill_it() {
        // burst 20 at 10/s: 20 units, refilled from empty in 2 s. `r` (at most the burst) can
        // then never exceed `q`.
        let policy = Policy::builder("p")
            .tier("a", Quota::per_second(10).with_burst(20))
            .tier("b", Quota::new(3, Duration::from_millis(1500)).with_burst(1))
            .build()
            .unwrap();
        assert_eq!(Headers::new(&policy).policy, r#""a";q=20;w=2, "b";q=1;w=1"#);
        // Interned: another binding of the same policy shares the value.
        assert!(std::ptr::eq(Headers::new(&policy).policy, Headers::new(&policy).policy));
        let windows = Policy::builder("p")
            .algorithm(Algorithm::FixedWindow)
            .tier("m", Quota::per_minute(100))
            .build()
            .unwrap();
        assert_eq!(Headers::new(&windows).policy, r#""m";q=100;w=60"#);
    }
}
