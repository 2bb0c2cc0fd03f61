//! The rate-limit headers: `RateLimit-Policy` / `RateLimit` (IETF httpapi ratelimit-headers
//! draft, RFC 9651 structured fields), legacy `X-RateLimit-*`, and `Retry-After`
//! (RFC 9110 §10.2.3).

use std::fmt::Write as _;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use smallvec::SmallVec;

use crate::decision::Decision;
use crate::quota::{Algorithm, Policy, Tier};

/// Which rate-limit headers responses carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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

/// Whole seconds, rounded up.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
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

/// A header value from text built of printable ASCII (cannot fail; an empty value is the
/// documented fallback rather than a panic). The string's buffer becomes the value: no copy.
fn value(s: String) -> HeaderValue {
    HeaderValue::from_maybe_shared(Bytes::from(s)).unwrap_or_else(|_| HeaderValue::from_static(""))
}

// Header names as constants: `HeaderName::from_static` validates its argument, which in a
// `const` happens once, at compile time, instead of on every response.
pub(crate) const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub(crate) const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
const X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
const X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
const X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// The rate-limit headers of one response, computed when it was decided and inserted when the
/// response is ready (inline for the two IETF headers).
pub(crate) type Prepared = SmallVec<[(HeaderName, HeaderValue); 2]>;

/// The window `w` of a tier in whole seconds (at least 1): the time to refill its capacity from
/// empty, `capacity x period / count`; a window algorithm's period.
fn window_secs(policy: &Policy, tier: &Tier) -> u64 {
    let q = tier.quota();
    let nanos = match policy.algorithm() {
        Algorithm::FixedWindow | Algorithm::SlidingLog | Algorithm::SlidingCounter => {
            u128::from(tier.rate.period)
        }
        _ => (u128::from(tier.capacity()) * u128::from(tier.rate.period))
            .div_ceil(u128::from(q.count())),
    };
    u64::try_from(nanos.div_ceil(1_000_000_000)).unwrap_or(u64::MAX).max(1)
}

/// The rate-limit headers of one policy, rendered once when the policy is bound: what does not
/// change between responses is rendered here.
#[derive(Debug, Clone)]
pub(crate) struct Headers {
    /// The `RateLimit-Policy` value (constant for the policy).
    policy: HeaderValue,
    /// Per tier, the start of its `RateLimit` item: `"name";r=`.
    items: Box<[String]>,
    /// Per tier, its capacity (`q`, and the legacy `X-RateLimit-Limit`).
    capacities: Box<[u64]>,
}

impl Headers {
    pub(crate) fn new(policy: &Policy) -> Self {
        let mut rendered = String::new();
        let mut items = Vec::with_capacity(policy.tiers().len());
        for (i, t) in policy.tiers().iter().enumerate() {
            if i > 0 {
                rendered.push_str(", ");
            }
            sf_string(&mut rendered, t.name());
            let _ = write!(rendered, ";q={};w={}", t.capacity(), window_secs(policy, t));
            let mut item = String::new();
            sf_string(&mut item, t.name());
            item.push_str(";r=");
            items.push(item);
        }
        let capacities = policy.tiers().iter().map(Tier::capacity).collect();
        Self { policy: value(rendered), items: items.into(), capacities }
    }

    /// The headers of `style` for `decision`.
    pub(crate) fn prepare(&self, style: HeaderStyle, decision: &Decision) -> Prepared {
        let mut out = Prepared::new();
        if decision.tiers.is_empty() {
            return out;
        }
        if matches!(style, HeaderStyle::Ietf | HeaderStyle::Both) {
            out.push((RATELIMIT_POLICY, self.policy.clone()));
            out.push((RATELIMIT, self.state(decision)));
        }
        if matches!(style, HeaderStyle::Legacy | HeaderStyle::Both) {
            let tiers = decision.tiers.iter().zip(self.capacities.iter());
            if let Some((t, capacity)) = tiers.min_by_key(|(t, _)| t.remaining) {
                out.push((X_RATELIMIT_LIMIT, (*capacity).into()));
                out.push((X_RATELIMIT_REMAINING, t.remaining.into()));
                out.push((X_RATELIMIT_RESET, ceil_secs(t.reset_after()).into()));
            }
        }
        out
    }

    /// The `RateLimit` value for `decision`: `"name";r=R;t=T` per tier.
    fn state(&self, decision: &Decision) -> HeaderValue {
        // The numbers first, so the value is allocated at exactly its length: a `Bytes` made
        // from a `String` with spare capacity would allocate a second time.
        let mut buffers: SmallVec<[(itoa::Buffer, itoa::Buffer); 2]> = SmallVec::new();
        buffers.resize_with(decision.tiers.len(), || (itoa::Buffer::new(), itoa::Buffer::new()));
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
        value(state)
    }

    /// Writes the headers of `style` for `decision`.
    pub(crate) fn write(&self, style: HeaderStyle, headers: &mut HeaderMap, decision: &Decision) {
        insert(headers, self.prepare(style, decision));
    }
}

/// Inserts prepared headers.
pub(crate) fn insert(headers: &mut HeaderMap, prepared: Prepared) {
    for (name, value) in prepared {
        headers.insert(name, value);
    }
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
        let headers = Headers::new(&policy);
        let mut map = HeaderMap::new();
        headers.write(HeaderStyle::Both, &mut map, &decision);
        assert_eq!(map["ratelimit-policy"], r#""burst";q=10;w=1, "daily \"q\"";q=12345;w=86400"#);
        assert_eq!(map["ratelimit"], r#""burst";r=7;t=1, "daily \"q\"";r=12342;t=21"#);
        assert_eq!(map["x-ratelimit-limit"], "10");
        assert_eq!(map["x-ratelimit-remaining"], "7");
        assert_eq!(map["x-ratelimit-reset"], "1");
        let state = map["ratelimit"].as_bytes();
        assert_eq!(state.len(), r#""burst";r=7;t=1, "daily \"q\"";r=12342;t=21"#.len());
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
        let windows = Policy::builder("p")
            .algorithm(Algorithm::FixedWindow)
            .tier("m", Quota::per_minute(100))
            .build()
            .unwrap();
        assert_eq!(Headers::new(&windows).policy, r#""m";q=100;w=60"#);
    }
}
