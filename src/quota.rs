//! Quotas, tiers and policies: what is limited, how much, and by which algorithm.

use std::sync::Arc;
use std::time::Duration;

use crate::clock::duration_to_nanos;
use crate::error::ConfigError;

/// The largest accepted `count` or `burst`, 2^32 - 1: with nanosecond instants every product
/// the algorithms form then fits in 128 bits, so their arithmetic is exact.
pub const MAX_COUNT: u64 = u32::MAX as u64;

/// The largest accepted sliding-window-log limit (requests per window).
///
/// The log keeps one entry per admitted request (a weighted entry for a cost above 1), so its
/// memory per key is O(limit): a limit of 1,000,000 per minute would cost megabytes per key.
pub const MAX_SLIDING_LOG: u64 = 10_000;

/// The longest span a tier may cover: its period, and the time its burst takes to refill
/// (`burst x period / count`): 2^50 microseconds, about 35.7 years.
pub const MAX_SPAN: Duration = Duration::from_micros(1 << 50);

/// Spans up to 2^50 ns (about 13 days) are decided to the nanosecond; a policy with a longer
/// span is decided in microseconds (so that every store represents it exactly).
const NANOSECOND_SPAN: u128 = 1 << 50;

/// A quota: `count` units per `period`, with a `burst` capacity.
///
/// `count / period` is the sustained rate; `burst` is how many units may be spent at once after
/// an idle spell (default: `count`). Units are requests unless the layer sets a cost.
///
/// ```
/// use std::time::Duration;
/// use tollgate::Quota;
///
/// let q = Quota::per_second(10).with_burst(20);
/// assert_eq!((q.count(), q.period(), q.burst()), (10, Duration::from_secs(1), 20));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Quota {
    count: u64,
    period: Duration,
    burst: u64,
}

impl Quota {
    /// `count` units per `period`, burst `count`. Validated when the policy is built.
    #[must_use]
    pub const fn new(count: u64, period: Duration) -> Self {
        Self { count, period, burst: count }
    }

    /// `count` per second.
    #[must_use]
    pub const fn per_second(count: u64) -> Self {
        Self::new(count, Duration::from_secs(1))
    }

    /// `count` per minute.
    #[must_use]
    pub const fn per_minute(count: u64) -> Self {
        Self::new(count, Duration::from_secs(60))
    }

    /// `count` per hour.
    #[must_use]
    pub const fn per_hour(count: u64) -> Self {
        Self::new(count, Duration::from_secs(3600))
    }

    /// `count` per day (86,400 s).
    #[must_use]
    pub const fn per_day(count: u64) -> Self {
        Self::new(count, Duration::from_secs(86_400))
    }

    /// The same rate with another burst capacity (units that may be spent at once).
    #[must_use]
    pub const fn with_burst(mut self, burst: u64) -> Self {
        self.burst = burst;
        self
    }

    /// redis-cell's meaning: `CL.THROTTLE key max_burst count period` admits `count` per
    /// `period` with a capacity of **`max_burst + 1`**. Use with [`Algorithm::Gcra`] to get the
    /// same `limit`, `remaining`, `retry_after` and `reset_after` as redis-cell.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::Quota;
    ///
    /// // CL.THROTTLE user123 15 30 60
    /// let q = Quota::redis_cell(15, 30, Duration::from_secs(60));
    /// assert_eq!(q.burst(), 16);
    /// ```
    #[must_use]
    pub const fn redis_cell(max_burst: u64, count: u64, period: Duration) -> Self {
        Self { count, period, burst: max_burst.saturating_add(1) }
    }

    /// Units per period.
    #[must_use]
    pub const fn count(&self) -> u64 {
        self.count
    }

    /// The period.
    #[must_use]
    pub const fn period(&self) -> Duration {
        self.period
    }

    /// Burst capacity, in units.
    #[must_use]
    pub const fn burst(&self) -> u64 {
        self.burst
    }
}

/// The algorithm a policy runs, the same in every store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Algorithm {
    /// Generic cell rate algorithm (default): one instant (the TAT) per key, smooth, exact;
    /// redis-cell's algorithm.
    #[default]
    Gcra,
    /// Token bucket refilled lazily at `count / period`, holding at most `burst` tokens.
    TokenBucket,
    /// Leaky bucket ("funnel") draining at `count / period`, holding at most `burst`. When
    /// shaping, requests leave at the leak rate: a smooth output without bursts.
    LeakyBucket,
    /// Fixed window counter: `count` per window aligned to the Unix epoch. Cheapest; admits
    /// up to **2 x count** across a window boundary.
    FixedWindow,
    /// Sliding window log: exact over any window of `period`, one entry per admitted request,
    /// O(count) memory per key; `count` is capped at [`MAX_SLIDING_LOG`].
    SlidingLog,
    /// Sliding window counter: the previous window's count weighted by its overlap plus the
    /// current one. O(1), approximately exact.
    SlidingCounter,
}

impl Algorithm {
    /// Every algorithm: GCRA, token bucket, leaky bucket, fixed window, sliding log, sliding
    /// counter.
    ///
    /// ```
    /// use tollgate::Algorithm;
    ///
    /// let names: Vec<_> = Algorithm::ALL.iter().map(|a| a.name()).collect();
    /// assert_eq!(names[0], "gcra");
    /// assert_eq!(names.len(), 6);
    /// ```
    pub const ALL: [Self; 6] = [
        Self::Gcra,
        Self::TokenBucket,
        Self::LeakyBucket,
        Self::FixedWindow,
        Self::SlidingLog,
        Self::SlidingCounter,
    ];

    /// The algorithm's name as used in errors and docs (`"gcra"`, `"token_bucket"`, ...).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Gcra => "gcra",
            Self::TokenBucket => "token_bucket",
            Self::LeakyBucket => "leaky_bucket",
            Self::FixedWindow => "fixed_window",
            Self::SlidingLog => "sliding_log",
            Self::SlidingCounter => "sliding_counter",
        }
    }

    /// Whether the algorithm counts per window (and so has no burst of its own).
    const fn is_window(self) -> bool {
        matches!(self, Self::FixedWindow | Self::SlidingLog | Self::SlidingCounter)
    }
}

/// One validated limit of a policy: a name and a quota, with the quota in nanoseconds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tier {
    name: Arc<str>,
    quota: Quota,
    pub(crate) rate: Rate,
}

/// A quota in the algorithms' units: counts, and time in the policy's unit (nanoseconds, or
/// microseconds for a policy with a long span; see [`Policy::unit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Rate {
    /// Units per period.
    pub(crate) count: u64,
    /// Period in time units (>= 1).
    pub(crate) period: u64,
    /// Capacity in units.
    pub(crate) burst: u64,
}

impl Tier {
    /// The tier's name, as shown in the `RateLimit` headers.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tier's quota.
    #[must_use]
    pub fn quota(&self) -> Quota {
        self.quota
    }

    /// The most units one request can ever consume on this tier: `burst` for the buckets and
    /// GCRA, `count` for the window algorithms.
    #[must_use]
    pub fn capacity(&self) -> u64 {
        self.rate.burst
    }
}

/// A validated policy: a name, an algorithm and one or more tiers on the same key.
///
/// A request is admitted only if every tier admits it; then every tier is charged, and a
/// rejected request charges no tier.
///
/// ```
/// use tollgate::{Algorithm, Policy, Quota};
///
/// let policy = Policy::builder("api")
///     .tier("burst", Quota::per_second(5))
///     .tier("hourly", Quota::per_hour(1000))
///     .algorithm(Algorithm::Gcra)
///     .build()
///     .unwrap();
/// assert_eq!(policy.tiers().len(), 2);
///
/// let err = Policy::builder("api").tier("x", Quota::per_second(0)).build().unwrap_err();
/// assert_eq!(err.to_string(), "tier `x`: count must be at least 1");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Policy {
    name: Arc<str>,
    algorithm: Algorithm,
    tiers: Arc<[Tier]>,
    /// Nanoseconds per time unit of the tiers' rates: 1, or 1,000 for a long span.
    unit: u64,
}

impl Policy {
    /// Starts a policy named `name` (printable ASCII; shown in headers and problem bodies, and
    /// part of every store key).
    pub fn builder(name: impl Into<String>) -> PolicyBuilder {
        PolicyBuilder { name: name.into(), algorithm: Algorithm::default(), tiers: Vec::new() }
    }

    /// A one-tier GCRA policy whose tier is named like the policy.
    ///
    /// # Errors
    /// As [`PolicyBuilder::build`].
    pub fn single(name: impl Into<String>, quota: Quota) -> Result<Self, ConfigError> {
        let name = name.into();
        Self::builder(name.clone()).tier(name, quota).build()
    }

    /// The policy's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The algorithm all tiers run.
    #[must_use]
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The tiers, in the order they were added.
    #[must_use]
    pub fn tiers(&self) -> &[Tier] {
        &self.tiers
    }

    /// The precision of every decision under this policy: 1 ns, or 1 µs when a tier's span (its
    /// period, or the time its burst takes to refill) exceeds 2^50 ns (about 13 days), so that
    /// monthly and yearly quotas are represented exactly in every store. Periods of such
    /// policies are rounded up to whole microseconds.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Policy, Quota};
    ///
    /// let daily = Policy::single("daily", Quota::per_day(1000)).unwrap();
    /// assert_eq!(daily.precision(), Duration::from_nanos(1));
    /// let yearly = Policy::single("yearly", Quota::new(10_000_000, Duration::from_secs(365 * 86_400))).unwrap();
    /// assert_eq!(yearly.precision(), Duration::from_micros(1));
    /// ```
    #[must_use]
    pub fn precision(&self) -> Duration {
        Duration::from_nanos(self.unit)
    }

    /// Nanoseconds per time unit of the rates.
    pub(crate) fn unit(&self) -> u64 {
        self.unit
    }
}

/// Builds a [`Policy`]; see [`Policy::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct PolicyBuilder {
    name: String,
    algorithm: Algorithm,
    tiers: Vec<(String, Quota)>,
}

impl PolicyBuilder {
    /// Adds a tier named `name` (printable ASCII, unique within the policy).
    pub fn tier(mut self, name: impl Into<String>, quota: Quota) -> Self {
        self.tiers.push((name.into(), quota));
        self
    }

    /// Sets the algorithm (default [`Algorithm::Gcra`]).
    pub fn algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// Validates and builds the policy.
    ///
    /// # Errors
    /// [`ConfigError`] naming the tier when a count, period or burst is zero or too large, when
    /// a span exceeds [`MAX_SPAN`], when a window algorithm gets a burst other than its count,
    /// when a sliding log exceeds [`MAX_SLIDING_LOG`], when tier names repeat, when there are no
    /// tiers, or when a name is empty or not printable ASCII.
    pub fn build(self) -> Result<Policy, ConfigError> {
        check_name(&self.name)?;
        if self.tiers.is_empty() {
            return Err(ConfigError::NoTiers(self.name));
        }
        let mut tiers = Vec::with_capacity(self.tiers.len());
        for (name, quota) in self.tiers {
            check_name(&name)?;
            if tiers.iter().any(|t: &Tier| *t.name == *name) {
                return Err(ConfigError::DuplicateTier(name));
            }
            let rate = validate(&name, quota, self.algorithm)?;
            tiers.push(Tier { name: name.into(), quota, rate });
        }
        let unit = if tiers.iter().all(|t| span(t.rate) <= NANOSECOND_SPAN) { 1 } else { 1000 };
        for t in &mut tiers {
            t.rate.period = t.rate.period.div_ceil(unit);
            if span(t.rate) > NANOSECOND_SPAN {
                return Err(ConfigError::SpanTooLong { tier: t.name.to_string(), max: MAX_SPAN });
            }
        }
        Ok(Policy { name: self.name.into(), algorithm: self.algorithm, tiers: tiers.into(), unit })
    }
}

/// A rate's longest span in its time unit: the period, or the time its burst takes to refill.
fn span(r: Rate) -> u128 {
    let refill = (u128::from(r.burst) * u128::from(r.period)).div_ceil(u128::from(r.count));
    refill.max(u128::from(r.period))
}

fn check_name(name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || !name.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(ConfigError::BadName(name.to_owned()));
    }
    Ok(())
}

fn validate(tier: &str, q: Quota, algorithm: Algorithm) -> Result<Rate, ConfigError> {
    let tier_s = || tier.to_owned();
    if q.count == 0 {
        return Err(ConfigError::ZeroCount { tier: tier_s() });
    }
    let period = duration_to_nanos(q.period);
    if period == 0 {
        return Err(ConfigError::ZeroPeriod { tier: tier_s() });
    }
    if q.burst == 0 {
        return Err(ConfigError::ZeroBurst { tier: tier_s() });
    }
    for (what, value) in [("count", q.count), ("burst", q.burst)] {
        if value > MAX_COUNT {
            return Err(ConfigError::TooLarge { tier: tier_s(), what, value, max: MAX_COUNT });
        }
    }
    if algorithm.is_window() && q.burst != q.count {
        return Err(ConfigError::BurstNotSupported {
            tier: tier_s(),
            algorithm: algorithm.name(),
            burst: q.burst,
            count: q.count,
        });
    }
    if algorithm == Algorithm::SlidingLog && q.count > MAX_SLIDING_LOG {
        return Err(ConfigError::SlidingLogTooLarge {
            tier: tier_s(),
            count: q.count,
            max: MAX_SLIDING_LOG,
        });
    }
    Ok(Rate { count: q.count, period, burst: q.burst })
}
