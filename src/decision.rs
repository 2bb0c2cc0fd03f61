//! Decisions: what a store answers for one request. Owned values, no borrows, so they cross
//! `.await` points and threads freely — and no shared reference counts either, so that deciding
//! on many cores at once does not make them contend: a tier is named by its index in the policy.

use std::time::Duration;

use smallvec::SmallVec;

use crate::policy::Policy;

/// "No duration" in the nanosecond fields below.
pub(crate) const NONE: u64 = u64::MAX;

fn optional(nanos: u64) -> Option<Duration> {
    (nanos != NONE).then(|| Duration::from_nanos(nanos))
}

/// What happened to a request: admitted, or refused for now, or refused for good.
///
/// ```
/// use tollgate::{Limiter, Outcome, Policy, Quota, key::Key};
///
/// let limiter = Limiter::new(Policy::single("api", Quota::per_minute(5)).unwrap());
/// assert_eq!(limiter.check_now(&Key::Global, 6).outcome(), Outcome::CostExceedsCapacity);
/// assert_eq!(limiter.check_now(&Key::Global, 5).outcome(), Outcome::Allowed);
/// assert_eq!(limiter.check_now(&Key::Global, 1).outcome(), Outcome::Limited);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// Admitted now (or, when shaping, after [`Decision::delay`]); every tier was charged.
    Allowed,
    /// Rejected: some tier has no room for it now (and, when shaping, not within the wait
    /// budget). No tier was charged. [`Decision::retry_after`] says when it would fit.
    Limited,
    /// Rejected: the request's cost exceeds some tier's capacity, so it can never be admitted.
    /// There is no meaningful retry time.
    CostExceedsCapacity,
}

/// Which part of the system made the decision.
///
/// ```
/// use tollgate::{Limiter, Policy, Quota, Source, key::Key};
///
/// let limiter = Limiter::new(Policy::single("api", Quota::per_second(5)).unwrap());
/// // A memory store decides itself; a Redis store's local fallback answers `Source::Fallback`.
/// assert_eq!(limiter.check_now(&Key::text("alice"), 1).source(), Source::Store);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Source {
    /// The configured store.
    #[default]
    Store,
    /// The local in-memory fallback of a remote store that is failing.
    Fallback,
}

/// One tier's part of a decision, as reported in the `RateLimit` headers. The `i`-th entry of
/// [`Decision::tiers`] is about the `i`-th tier of the policy ([`Policy::tiers`]), which has
/// its name and quota.
///
/// ```
/// use std::time::Duration;
/// use tollgate::{Limiter, Policy, Quota, key::Key};
///
/// let limiter = Limiter::new(Policy::single("api", Quota::per_minute(10)).unwrap());
/// let key = Key::text("alice");
/// let tier = limiter.check_now(&key, 10).tiers()[0];
/// assert_eq!((tier.limit(), tier.remaining()), (10, 0));
/// assert!(!tier.is_violated() && tier.retry_after().is_none());
/// let refused = limiter.check_now(&key, 1).tiers()[0];
/// assert!(refused.is_violated());
/// assert!(refused.retry_after().unwrap() <= Duration::from_secs(6)); // one unit every 6 s
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierDecision {
    pub(crate) remaining: u64,
    /// Nanoseconds.
    pub(crate) reset_after: u64,
    /// Nanoseconds, or [`NONE`].
    pub(crate) retry_after: u64,
    /// At most [`MAX_COUNT`](crate::Quota::MAX_COUNT), so 32 bits (the struct stays 32 bytes).
    pub(crate) limit: u32,
    pub(crate) violated: bool,
}

impl TierDecision {
    /// A tier's part: capacity and remaining units, nanoseconds until full, and for a tier that
    /// rejected the request the nanoseconds until it alone would admit it.
    #[inline]
    pub(crate) fn new(
        limit: u64,
        remaining: u64,
        reset_after: u64,
        retry_after: Option<u64>,
        violated: bool,
    ) -> Self {
        let retry_after = retry_after.map_or(NONE, |r| r.min(NONE - 1));
        let limit = u32::try_from(limit).unwrap_or(u32::MAX);
        Self { remaining, reset_after, retry_after, limit, violated }
    }

    /// The tier's capacity in units (`burst` for GCRA and the buckets, `count` for windows).
    #[must_use]
    pub fn limit(&self) -> u64 {
        u64::from(self.limit)
    }

    /// Units that could be consumed right now after this decision (0 when exhausted).
    #[must_use]
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// Time until this tier's state is back to full capacity (nanosecond precision).
    #[must_use]
    pub fn reset_after(&self) -> Duration {
        Duration::from_nanos(self.reset_after)
    }

    /// For a tier that rejected the request: time until it alone would admit it.
    /// `None` for a tier that had room, and for a tier whose capacity is below the cost.
    #[must_use]
    pub fn retry_after(&self) -> Option<Duration> {
        optional(self.retry_after)
    }

    /// Whether this tier rejected the request (no room, or capacity below the cost).
    #[must_use]
    pub fn is_violated(&self) -> bool {
        self.violated
    }
}

/// Per-tier decisions, kept inline for up to two tiers (no allocation).
pub(crate) type Tiers = SmallVec<[TierDecision; 2]>;

/// A store's answer for one request: the outcome, the shaping delay, when to retry, and one
/// [`TierDecision`] per tier of the policy.
///
/// ```
/// use tollgate::{Limiter, Policy, Quota, key::Key};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let policy = Policy::builder("api")
///     .tier("second", Quota::per_second(2))
///     .tier("hour", Quota::per_hour(100))
///     .build()
///     .unwrap();
/// let limiter = Limiter::new(policy.clone());
/// let key = Key::text("alice");
/// limiter.check(&key, 2).await.unwrap();
/// let d = limiter.check(&key, 1).await.unwrap();
/// assert!(!d.is_allowed());
/// assert_eq!(d.violated_names(&policy).collect::<Vec<_>>(), ["second"]);
/// assert_eq!(d.tiers()[1].remaining(), 98);
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub(crate) outcome: Outcome,
    pub(crate) source: Source,
    /// Nanoseconds.
    pub(crate) delay: u64,
    /// Nanoseconds, or [`NONE`].
    pub(crate) retry_after: u64,
    pub(crate) tiers: Tiers,
}

/// A duration of `d` units from the unit `at`, as nanoseconds from the instant `now` (which falls
/// in unit `at`): to the start of the unit it ends in. `NONE` stays `NONE`, 0 stays 0.
fn rescaled(d: u64, at: u64, unit: u64, now: u64) -> u64 {
    if d == NONE || d == 0 {
        return d;
    }
    at.saturating_add(d).saturating_mul(unit).saturating_sub(now).min(NONE - 1)
}

impl Decision {
    /// Converts a decision made in units of `unit` nanoseconds at the unit `at` into one in
    /// nanoseconds from the instant `now`.
    pub(crate) fn rescale(&mut self, at: u64, unit: u64, now: u64) {
        self.delay = rescaled(self.delay, at, unit, now);
        self.retry_after = rescaled(self.retry_after, at, unit, now);
        for t in &mut self.tiers {
            t.reset_after = rescaled(t.reset_after, at, unit, now);
            t.retry_after = rescaled(t.retry_after, at, unit, now);
        }
    }

    #[inline]
    pub(crate) fn new(
        outcome: Outcome,
        delay: u64,
        retry_after: Option<u64>,
        tiers: Tiers,
    ) -> Self {
        let retry_after = retry_after.map_or(NONE, |r| r.min(NONE - 1));
        Self { outcome, source: Source::Store, delay, retry_after, tiers }
    }

    /// The outcome.
    #[must_use]
    pub fn outcome(&self) -> Outcome {
        self.outcome
    }

    /// Whether the request was admitted.
    #[must_use]
    pub fn is_allowed(&self) -> bool {
        self.outcome == Outcome::Allowed
    }

    /// When shaping: how long to hold the request before passing it on (its reserved slot).
    /// Zero when policing.
    #[must_use]
    pub fn delay(&self) -> Duration {
        Duration::from_nanos(self.delay)
    }

    /// For [`Outcome::Limited`]: the earliest time from now at which the same request would be
    /// admitted by every tier (exact to the nanosecond; a retry a nanosecond earlier is still
    /// rejected). `None` when allowed and for [`Outcome::CostExceedsCapacity`].
    #[must_use]
    pub fn retry_after(&self) -> Option<Duration> {
        optional(self.retry_after)
    }

    /// Per-tier details, in the policy's tier order.
    #[must_use]
    pub fn tiers(&self) -> &[TierDecision] {
        &self.tiers
    }

    /// Who decided.
    #[must_use]
    pub fn source(&self) -> Source {
        self.source
    }

    /// Indices (into [`Policy::tiers`]) of the tiers that rejected the request; none when
    /// allowed.
    pub fn violated(&self) -> impl Iterator<Item = usize> + '_ {
        self.tiers.iter().enumerate().filter(|(_, t)| t.violated).map(|(i, _)| i)
    }

    /// Names of the tiers of `policy` (the policy decided) that rejected the request.
    pub fn violated_names<'a>(&'a self, policy: &'a Policy) -> impl Iterator<Item = &'a str> {
        self.violated().filter_map(|i| policy.tiers().get(i).map(crate::policy::Tier::name))
    }
}
