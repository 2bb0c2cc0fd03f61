//! Policies: a name, an algorithm and validated tiers, built with [`PolicyBuilder`].

use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;

use crate::algorithm::calendar::{CalendarSpec, WindowCache};
use crate::algorithm::compiled::{Block, Kind, Rate, Slots};
use crate::clock::duration_to_nanos;
use crate::error::ConfigError;
use crate::quota::{
    Algorithm, Calendar, Concurrency, MAX_COUNT, MAX_PENALTY_REFUSALS, MAX_SLIDING_LOG, MAX_SPAN,
    MIN_HOLD, NANOSECOND_SPAN, Penalty, Priority, Quota, Reserve, TierKind, Unit,
};

/// One validated limit of a policy: a name and a quota, with the quota in nanoseconds. Read
/// them from [`Policy::tiers`], in the order they were added.
///
/// ```
/// use tollgate::{Concurrency, Policy, Quota, TierKind};
///
/// let policy = Policy::builder("api")
///     .tier("second", Quota::per_second(10).with_burst(20))
///     .concurrency("in-flight", Concurrency::new(4))
///     .build()
///     .unwrap();
/// let [rate, slots] = policy.tiers() else { unreachable!() };
/// assert_eq!((rate.name(), rate.kind(), rate.capacity()), ("second", TierKind::Rate, 20));
/// assert_eq!((slots.kind(), slots.capacity()), (TierKind::Concurrency, 4));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Tier {
    name: Arc<str>,
    quota: Quota,
    pub(crate) rate: Rate,
    pub(crate) kind: Kind,
    /// The tier's penalty box, if any.
    pub(crate) penalty: Option<Block>,
    /// The capacity the tier reserves for higher classes, if any.
    pub(crate) reserve: Option<Reserve>,
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
    /// GCRA, `count` for the window algorithms and calendar tiers, the slots of a concurrency
    /// tier.
    #[must_use]
    pub fn capacity(&self) -> u64 {
        self.rate.burst
    }

    /// What kind of limit the tier is. For a concurrency tier, [`quota`](Self::quota) is
    /// `max` per time to live; for a calendar tier, `count` per the longest window
    /// ([`CalendarPeriod::longest`](crate::CalendarPeriod::longest)).
    #[must_use]
    pub fn kind(&self) -> TierKind {
        match self.kind {
            Kind::Rate => TierKind::Rate,
            Kind::Concurrency(_) => TierKind::Concurrency,
            Kind::Calendar(_) => TierKind::Calendar,
        }
    }

    /// The concurrency limit, for a concurrency tier.
    #[must_use]
    pub fn concurrency(&self) -> Option<Concurrency> {
        match &self.kind {
            Kind::Concurrency(s) => Some(s.spec),
            _ => None,
        }
    }

    /// The tier's penalty box, if it has one ([`PolicyBuilder::penalty`]).
    #[must_use]
    pub fn penalty(&self) -> Option<Penalty> {
        self.penalty.map(|b| b.spec)
    }

    /// The capacity the tier reserves for higher classes, if any ([`PolicyBuilder::reserve`]).
    #[must_use]
    pub fn reserve(&self) -> Option<Reserve> {
        self.reserve
    }

    /// The most units a request of class `class` can ever consume on this tier:
    /// [`capacity`](Self::capacity) less what the tier's [`Reserve`] withholds from the class.
    #[must_use]
    pub fn capacity_for(&self, class: Priority) -> u64 {
        let withheld = self.reserve.map_or(0, |r| r.withheld_from(class));
        self.rate.burst.saturating_sub(withheld)
    }

    /// The tier's rate as a request of class `class` sees it: the burst less what the reserve
    /// withholds from the class.
    #[inline]
    pub(crate) fn rate_for(&self, class: Priority) -> Rate {
        match self.reserve {
            None => self.rate,
            Some(_) => Rate { burst: self.capacity_for(class), ..self.rate },
        }
    }

    /// The calendar quota, for a calendar tier.
    #[must_use]
    pub fn calendar(&self) -> Option<&Calendar> {
        match &self.kind {
            Kind::Calendar(c) => Some(&c.calendar),
            _ => None,
        }
    }

    /// What the tier counts ([`Unit::Requests`] for a concurrency tier: requests in flight).
    #[must_use]
    pub fn unit(&self) -> Unit {
        self.quota.unit
    }

    /// The cost of this tier for a check of `cost` that gives no per-tier costs: `cost` for a
    /// tier counting requests; one unit (none for a query, `cost` 0) for a concurrency tier
    /// (one slot) and for a tier counting anything else (a first unit, settled later).
    #[must_use]
    pub fn default_cost(&self, cost: u64) -> u64 {
        match (&self.kind, self.quota.unit) {
            (Kind::Concurrency(_), _) => cost.min(1),
            (_, Unit::Requests) => cost,
            _ => cost.min(1),
        }
    }
}

/// The cost of each tier of a policy for one request, in the policy's tier order: what
/// [`Check::costs`](crate::store::Check::costs) takes. See [`Policy::costs`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Costs(SmallVec<[u64; 4]>);

impl Costs {
    /// Costs given tier by tier.
    #[must_use]
    pub fn from_slice(costs: &[u64]) -> Self {
        Self(SmallVec::from_slice(costs))
    }
}

impl Costs {
    /// Charges nothing at admission to the tiers whose bytes are charged as the body streams:
    /// those counting response bytes, and those counting request bytes when the length is not
    /// known (`length_known` false), and, for a gRPC call (`grpc`), those counting messages.
    pub(crate) fn unstream(&mut self, policy: &Policy, length_known: bool, grpc: bool) {
        for (cost, tier) in self.0.iter_mut().zip(policy.tiers()) {
            let streamed = match tier.unit() {
                Unit::ResponseBytes => true,
                Unit::RequestBytes => !length_known,
                Unit::RequestMessages | Unit::ResponseMessages => grpc,
                _ => false,
            };
            if streamed && tier.kind() != TierKind::Concurrency {
                *cost = 0;
            }
        }
    }
}

impl Deref for Costs {
    type Target = [u64];

    fn deref(&self) -> &[u64] {
        &self.0
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
    /// Every tier a rate counting requests: the policies decided as before there were other
    /// kinds, on the same paths (compact GCRA tables in memory, the rate scripts on Redis).
    plain: bool,
    /// Some tier has a penalty box.
    penalized: bool,
}

/// The critical reserve of `tier` when it keeps a line for it (see [`Policy::line_reserve`]).
fn lined(tier: &Tier) -> Option<u64> {
    let critical = tier.reserve.map_or(0, |r| r.critical);
    (matches!(tier.kind, Kind::Rate) && critical > 0).then_some(critical)
}

impl Policy {
    /// Starts a policy named `name` (printable ASCII; shown in headers and problem bodies, and
    /// part of every store key).
    pub fn builder(name: impl Into<String>) -> PolicyBuilder {
        PolicyBuilder {
            name: name.into(),
            algorithm: Algorithm::default(),
            tiers: Vec::new(),
            penalties: Vec::new(),
            reserves: Vec::new(),
        }
    }

    /// The cost of each tier for one request costing `requests` units (0 for a query, which
    /// charges nothing) whose body is `request_bytes` long, if known (its `Content-Length`):
    ///
    /// - tiers counting [`Unit::Requests`]: `requests`;
    /// - [`Unit::RequestBytes`]: `request_bytes`, or one unit when unknown (settled later);
    /// - [`Unit::ResponseBytes`], [`Unit::Reported`]: one unit, settled later;
    /// - [`Unit::RequestMessages`], [`Unit::ResponseMessages`]: one message;
    /// - concurrency tiers: one slot.
    ///
    /// ```
    /// use tollgate::{Concurrency, Policy, Quota, Unit};
    ///
    /// let policy = Policy::builder("llm")
    ///     .tier("requests", Quota::per_minute(60))
    ///     .tier("upload", Quota::per_second(1_000_000).counting(Unit::RequestBytes))
    ///     .tier("tokens", Quota::per_minute(100_000).counting(Unit::Reported))
    ///     .concurrency("in-flight", Concurrency::new(4))
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(&*policy.costs(1, Some(2_048)), [1, 2_048, 1, 1]);
    /// assert_eq!(&*policy.costs(1, None), [1, 1, 1, 1]);
    /// assert_eq!(&*policy.costs(0, Some(2_048)), [0, 0, 0, 0]);
    /// ```
    #[must_use]
    pub fn costs(&self, requests: u64, request_bytes: Option<u64>) -> Costs {
        Costs(
            self.tiers
                .iter()
                .map(|t| match (t.unit(), request_bytes) {
                    (Unit::RequestBytes, Some(bytes)) if requests > 0 => bytes,
                    _ => t.default_cost(requests),
                })
                .collect(),
        )
    }

    /// Whether every tier is a rate counting requests.
    pub(crate) fn is_plain(&self) -> bool {
        self.plain
    }

    /// The cost of tier `i` for a check of `cost` with per-tier `costs`: a plain policy's tiers
    /// all take `cost`; otherwise `costs[i]`, or the tier's default cost where `costs` is short.
    #[inline]
    pub(crate) fn tier_cost(&self, i: usize, cost: u64, costs: &[u64]) -> u64 {
        if self.plain {
            return cost;
        }
        match costs.get(i) {
            Some(c) => *c,
            None => self.tiers[i].default_cost(cost),
        }
    }

    /// Whether some tier has a penalty box.
    pub(crate) fn has_penalty(&self) -> bool {
        self.penalized
    }

    /// Where the penalty box of tier `i` (which has one) is kept in a key's states: after the
    /// tiers' own states, one per tier with a box, in tier order.
    pub(crate) fn penalty_slot(&self, i: usize) -> usize {
        self.tiers.len() + self.tiers[..i].iter().filter(|t| t.penalty.is_some()).count()
    }

    /// The critical reserve of tier `i` when the tier keeps a line for it (a rate tier that
    /// reserves units for critical requests: see `algorithm::line`), in units.
    pub(crate) fn line_reserve(&self, i: usize) -> Option<u64> {
        lined(&self.tiers[i])
    }

    /// Where the line of tier `i` (which keeps one) is kept in a key's states: after the
    /// penalty boxes, one per tier with a line, in tier order.
    pub(crate) fn line_slot(&self, i: usize) -> usize {
        let boxes = self.tiers.iter().filter(|t| t.penalty.is_some()).count();
        self.tiers.len() + boxes + self.tiers[..i].iter().filter(|t| lined(t).is_some()).count()
    }

    /// Whether some tier is a concurrency tier.
    pub(crate) fn has_concurrency(&self) -> bool {
        self.tiers.iter().any(|t| matches!(t.kind, Kind::Concurrency(_)))
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

/// Builds a [`Policy`]: start with [`Policy::builder`], add tiers of any kind, then
/// [`build`](Self::build), which checks them all and names the tier it refuses.
///
/// ```
/// use tollgate::{Calendar, Concurrency, Policy, Quota};
///
/// let policy = Policy::builder("llm")
///     .tier("second", Quota::per_second(10))
///     .concurrency("in-flight", Concurrency::new(4))
///     .calendar("monthly", Calendar::per_month(100_000).in_time_zone("Europe/Berlin"))
///     .build()
///     .unwrap();
/// assert_eq!(policy.tiers().len(), 3);
///
/// let twice = Policy::builder("llm").tier("a", Quota::per_second(1)).tier("a", Quota::per_hour(9));
/// assert_eq!(twice.build().unwrap_err().to_string(), "duplicate tier name `a`");
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct PolicyBuilder {
    name: String,
    algorithm: Algorithm,
    tiers: Vec<(String, Spec)>,
    penalties: Vec<(String, Penalty)>,
    reserves: Vec<(String, Reserve)>,
}

/// A tier as given to the builder.
#[derive(Debug, Clone)]
enum Spec {
    Rate(Quota),
    Concurrency(Concurrency),
    Calendar(Calendar),
}

impl PolicyBuilder {
    /// Adds a rate tier named `name` (printable ASCII, unique within the policy), run by the
    /// policy's [`algorithm`](Self::algorithm).
    pub fn tier(mut self, name: impl Into<String>, quota: Quota) -> Self {
        self.tiers.push((name.into(), Spec::Rate(quota)));
        self
    }

    /// Adds a concurrency tier: at most [`Concurrency::max`] requests of a key in flight.
    pub fn concurrency(mut self, name: impl Into<String>, limit: Concurrency) -> Self {
        self.tiers.push((name.into(), Spec::Concurrency(limit)));
        self
    }

    /// Adds a calendar tier: [`Calendar::count`] units per calendar window.
    pub fn calendar(mut self, name: impl Into<String>, quota: Calendar) -> Self {
        self.tiers.push((name.into(), Spec::Calendar(quota)));
        self
    }

    /// Gives the rate or calendar tier named `tier` a penalty box (see [`Penalty`]): once it
    /// refuses a key, every request of that key is refused for the block duration. The tier
    /// may be added before or after this call.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::{Penalty, Policy, Quota};
    ///
    /// let policy = Policy::builder("login")
    ///     .tier("minute", Quota::per_minute(10))
    ///     .penalty("minute", Penalty::new(Duration::from_secs(900)))
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(policy.tiers()[0].penalty(), Some(Penalty::new(Duration::from_secs(900))));
    ///
    /// let err = Policy::builder("login")
    ///     .tier("minute", Quota::per_minute(10))
    ///     .penalty("hour", Penalty::new(Duration::from_secs(900)))
    ///     .build()
    ///     .unwrap_err();
    /// assert_eq!(err.to_string(), "tier `hour`: penalty: the policy has no tier of this name");
    /// ```
    pub fn penalty(mut self, tier: impl Into<String>, penalty: Penalty) -> Self {
        self.penalties.push((tier.into(), penalty));
        self
    }

    /// Reserves part of the capacity of the rate tier named `tier` for the higher
    /// [`Priority`] classes (see [`Reserve`] for exactly what each class is admitted). The tier
    /// may be added before or after this call.
    ///
    /// ```
    /// use tollgate::{Algorithm, Policy, Quota, Reserve};
    ///
    /// let policy = Policy::builder("api")
    ///     .tier("second", Quota::per_second(100))
    ///     .reserve("second", Reserve::new().critical(20))
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(policy.tiers()[0].reserve(), Some(Reserve::new().critical(20)));
    ///
    /// let err = Policy::builder("api")
    ///     .tier("second", Quota::per_second(100))
    ///     .reserve("second", Reserve::new().critical(60).standard(40))
    ///     .build()
    ///     .unwrap_err();
    /// assert_eq!(
    ///     err.to_string(),
    ///     "tier `second`: reserve: critical 60 + standard 40 must be less than the capacity 100"
    /// );
    /// ```
    pub fn reserve(mut self, tier: impl Into<String>, reserve: Reserve) -> Self {
        self.reserves.push((tier.into(), reserve));
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
    /// a span exceeds [`MAX_SPAN`](crate::Quota::MAX_SPAN), when a window algorithm gets a burst
    /// other than its count, when a sliding log exceeds
    /// [`MAX_SLIDING_LOG`](crate::Quota::MAX_SLIDING_LOG), when a concurrency tier's time to
    /// live is out of range, when a calendar tier's time zone is unknown, when tier names
    /// repeat, when there are no tiers, when a name is empty or not printable ASCII, or when a [`Penalty`] names
    /// no tier, a concurrency tier, or a tier that has one already, or is out of range
    /// ([`ConfigError::Penalty`]), or when a [`Reserve`] names no tier, a tier that is not a
    /// rate, a tier that has one already, a policy whose algorithm is not GCRA, or reserves
    /// as large as the tier's capacity ([`ConfigError::Reserve`]).
    pub fn build(self) -> Result<Policy, ConfigError> {
        check_name(&self.name)?;
        if self.tiers.is_empty() {
            return Err(ConfigError::NoTiers(self.name));
        }
        let mut tiers = Vec::with_capacity(self.tiers.len());
        for (name, spec) in self.tiers {
            check_name(&name)?;
            if tiers.iter().any(|t: &Tier| *t.name == *name) {
                return Err(ConfigError::DuplicateTier(name));
            }
            let (quota, rate, kind) = match spec {
                Spec::Rate(quota) => (quota, validate(&name, quota, self.algorithm)?, Kind::Rate),
                Spec::Concurrency(c) => concurrency(&name, c)?,
                Spec::Calendar(c) => calendar(&name, c)?,
            };
            tiers.push(Tier { name: name.into(), quota, rate, kind, penalty: None, reserve: None });
        }
        // Only rates set the policy's precision: concurrency and calendar tiers count whole
        // slots and windows that start on whole seconds, exact in either unit.
        let rates = || tiers.iter().filter(|t| t.kind == Kind::Rate);
        let unit = if rates().all(|t| span(t.rate) <= NANOSECOND_SPAN) { 1 } else { 1000 };
        for t in &mut tiers {
            t.rate.period = t.rate.period.div_ceil(unit);
            if t.kind == Kind::Rate && span(t.rate) > NANOSECOND_SPAN {
                return Err(ConfigError::SpanTooLong { tier: t.name.to_string(), max: MAX_SPAN });
            }
        }
        for (name, p) in self.penalties {
            let Some(t) = tiers.iter_mut().find(|t| *t.name == *name) else {
                return Err(penalty_error(name, "the policy has no tier of this name"));
            };
            if matches!(t.kind, Kind::Concurrency(_)) {
                return Err(penalty_error(name, "a concurrency tier cannot have one"));
            }
            if t.penalty.is_some() {
                return Err(penalty_error(name, "the tier has one already"));
            }
            t.penalty = Some(block(&name, p, unit)?);
        }
        for (name, r) in self.reserves {
            let err = |reason: String| Err(reserve_error(name.clone(), reason));
            let Some(t) = tiers.iter_mut().find(|t| *t.name == *name) else {
                return err("the policy has no tier of this name".into());
            };
            if t.kind != Kind::Rate {
                return err("only a rate tier can reserve capacity".into());
            }
            if self.algorithm != Algorithm::Gcra {
                return err(format!(
                    "reserved capacity runs on gcra only, not {}",
                    self.algorithm.name()
                ));
            }
            if t.reserve.is_some() {
                return err("the tier has one already".into());
            }
            let (c, s, cap) = (r.critical, r.standard, t.capacity());
            if c.checked_add(s).is_none_or(|sum| sum >= cap) {
                return err(format!(
                    "critical {c} + standard {s} must be less than the capacity {cap}"
                ));
            }
            t.reserve = Some(r);
        }
        // A penalty box is decided with the other kinds (its state is a key's too), and so
        // is a reserve (its decision depends on the request's class).
        let penalized = tiers.iter().any(|t| t.penalty.is_some());
        let reserved = tiers.iter().any(|t| t.reserve.is_some());
        let plain = !penalized
            && !reserved
            && tiers.iter().all(|t| t.kind == Kind::Rate && t.quota.unit == Unit::Requests);
        Ok(Policy {
            name: self.name.into(),
            algorithm: self.algorithm,
            tiers: tiers.into(),
            unit,
            plain,
            penalized,
        })
    }
}

fn reserve_error(tier: String, reason: String) -> ConfigError {
    ConfigError::Reserve { tier, reason }
}

fn penalty_error(tier: String, reason: impl Into<String>) -> ConfigError {
    ConfigError::Penalty { tier, reason: reason.into() }
}

/// Validates a penalty box of tier `tier` of a policy whose time unit is `unit` nanoseconds.
fn block(tier: &str, p: Penalty, unit: u64) -> Result<Block, ConfigError> {
    let err = |reason: String| Err(penalty_error(tier.to_owned(), reason));
    if p.block.is_zero() || p.block > MAX_SPAN {
        return err(format!("block {:?} must be between 1 ns and {MAX_SPAN:?}", p.block));
    }
    if p.refusals == 0 || p.refusals > MAX_PENALTY_REFUSALS {
        return err(format!(
            "refusals {} must be between 1 and {MAX_PENALTY_REFUSALS}",
            p.refusals
        ));
    }
    let within = if p.refusals == 1 {
        0
    } else if p.within.is_zero() || p.within > MAX_SPAN {
        return err(format!("window {:?} must be between 1 ns and {MAX_SPAN:?}", p.within));
    } else {
        duration_to_nanos(p.within).div_ceil(unit)
    };
    Ok(Block {
        spec: p,
        block: duration_to_nanos(p.block).div_ceil(unit),
        refusals: u64::from(p.refusals),
        within,
    })
}

/// Validates a concurrency tier: its quota (`max` per lease), rate and kind.
fn concurrency(tier: &str, c: Concurrency) -> Result<(Quota, Rate, Kind), ConfigError> {
    let tier_s = || tier.to_owned();
    if c.max == 0 {
        return Err(ConfigError::ZeroCount { tier: tier_s() });
    }
    if c.max > MAX_COUNT {
        return Err(ConfigError::TooLarge {
            tier: tier_s(),
            what: "max",
            value: c.max,
            max: MAX_COUNT,
        });
    }
    if c.ttl < MIN_HOLD || c.ttl > MAX_SPAN {
        return Err(ConfigError::LeaseOutOfRange {
            tier: tier_s(),
            lease: c.ttl,
            min: MIN_HOLD,
            max: MAX_SPAN,
        });
    }
    let ttl_ms = duration_to_nanos(c.ttl).div_ceil(1_000_000);
    let initial_hold = duration_to_nanos(c.typical_hold.max(MIN_HOLD));
    let quota = Quota::new(c.max, c.ttl);
    let rate = Rate { count: c.max, period: ttl_ms * 1_000_000, burst: c.max };
    let slots = Slots { spec: c, max: c.max, ttl_ms, initial_hold };
    Ok((quota, rate, Kind::Concurrency(slots)))
}

/// Validates a calendar tier and looks its time zone up.
fn calendar(tier: &str, c: Calendar) -> Result<(Quota, Rate, Kind), ConfigError> {
    let tier_s = || tier.to_owned();
    if c.count == 0 {
        return Err(ConfigError::ZeroCount { tier: tier_s() });
    }
    if c.count > MAX_COUNT {
        return Err(ConfigError::TooLarge {
            tier: tier_s(),
            what: "count",
            value: c.count,
            max: MAX_COUNT,
        });
    }
    let zone = match &c.zone {
        None => jiff::tz::TimeZone::UTC,
        Some(name) => jiff::tz::TimeZone::get(name).map_err(|e| ConfigError::UnknownTimeZone {
            tier: tier_s(),
            zone: name.to_string(),
            reason: e.to_string(),
        })?,
    };
    let longest = c.period.longest();
    let quota = Quota::new(c.count, longest).counting(c.unit);
    let rate = Rate { count: c.count, period: duration_to_nanos(longest), burst: c.count };
    let spec = CalendarSpec { calendar: c, zone, cache: WindowCache::default() };
    Ok((quota, rate, Kind::Calendar(Arc::new(spec))))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_are_validated_by_tier_name() {
        let err = |b: PolicyBuilder| b.build().unwrap_err();
        let p = || Policy::builder("p");
        assert_eq!(
            err(p().concurrency("c", Concurrency::new(0))),
            ConfigError::ZeroCount { tier: "c".into() }
        );
        assert!(matches!(
            err(p().concurrency("c", Concurrency::new(2).with_ttl(Duration::ZERO))),
            ConfigError::LeaseOutOfRange { tier, .. } if tier == "c"
        ));
        assert_eq!(
            err(p().calendar("m", Calendar::per_month(0))),
            ConfigError::ZeroCount { tier: "m".into() }
        );
        assert!(matches!(
            err(p().calendar("m", Calendar::per_month(5).in_time_zone("Nowhere/Atlantis"))),
            ConfigError::UnknownTimeZone { tier, zone, .. } if tier == "m" && zone == "Nowhere/Atlantis"
        ));
    }

    #[test]
    fn only_rates_count_requests_on_the_plain_paths() {
        let plain = Policy::builder("p").tier("a", Quota::per_second(1)).build().unwrap();
        assert!(plain.is_plain());
        let bytes = Policy::builder("p")
            .tier("a", Quota::per_second(1).counting(Unit::ResponseBytes))
            .build()
            .unwrap();
        assert!(!bytes.is_plain());
        // A yearly calendar tier does not move the rates to microseconds.
        let mixed = Policy::builder("p")
            .tier("a", Quota::per_second(10))
            .calendar("y", Calendar::per_year(1000))
            .concurrency("c", Concurrency::new(3).with_ttl(Duration::from_secs(86_400 * 365)))
            .build()
            .unwrap();
        assert_eq!(mixed.precision(), Duration::from_nanos(1));
        assert_eq!(mixed.tiers()[2].capacity(), 3);
        assert_eq!(mixed.tier_cost(0, 7, &[]), 7);
        assert_eq!(mixed.tier_cost(2, 7, &[]), 1);
        assert_eq!(mixed.tier_cost(1, 7, &[7, 2]), 2);
        assert_eq!(plain.tier_cost(0, 7, &[1]), 7, "a plain policy takes `cost` on every tier");
    }
}
