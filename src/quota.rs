//! What users write: quotas, units, tier kinds and algorithms. [`Policy`](crate::Policy)
//! validates them into the compiled forms the algorithms run (`crate::algorithm::compiled`).

use std::sync::Arc;
use std::time::Duration;

/// [`Quota::MAX_COUNT`].
pub(crate) const MAX_COUNT: u64 = u32::MAX as u64;

/// [`Quota::MAX_SLIDING_LOG`].
pub(crate) const MAX_SLIDING_LOG: u64 = 10_000;

/// [`Quota::MAX_SPAN`] (`burst x period / count` is the time a burst takes to refill).
pub(crate) const MAX_SPAN: Duration = Duration::from_micros(1 << 50);

/// Spans up to 2^50 ns (about 13 days) are decided to the nanosecond; a policy with a longer
/// span is decided in microseconds (so that every store represents it exactly).
pub(crate) const NANOSECOND_SPAN: u128 = 1 << 50;

/// A rate quota of `count` units per `period` (the sustained rate), of which `burst` may be
/// spent at once after an idle spell (default `count`). Units are requests unless the layer
/// sets a cost or the quota [counts](Self::counting) something else (bytes, tokens). It is
/// checked when its policy is built ([`ConfigError`](crate::ConfigError) naming the tier).
///
/// ```
/// use std::time::Duration;
/// use tollgate::Quota;
///
/// let q = Quota::per_second(10).with_burst(20);
/// assert_eq!((q.count(), q.period(), q.burst()), (10, Duration::from_secs(1), 20));
/// ```
///
/// # How many requests a quota admits
///
/// A bucket (GCRA, the default, and the token and leaky buckets) starts full: a client may
/// spend the whole burst at once and then one unit every `period / count` as it refills. So
/// **in its first period a quota admits `burst + count - 1`**, and `count` per period after
/// that. For `Quota::per_minute(5)` under steady traffic (a request every 100 ms; the example
/// of [`at_most`](Self::at_most) checks the first two rows):
///
/// | algorithm | first minute | each later minute |
/// |---|---|---|
/// | GCRA, token bucket, leaky bucket: `per_minute(5)` (burst 5) | 9 | 5 |
/// | the same with [`Quota::at_most(5, 1 min)`](Self::at_most) (burst 1) | 5 | 5 |
/// | fixed window | 5 per clock-aligned minute, but up to 10 in a minute that spans two windows | 5 |
/// | sliding log | 5 in any 60 s | 5 |
/// | sliding counter | about 5 (an estimate: 5, then 4 under this traffic) | about 5 |
///
/// `per_second(10)` admits 19 in its first second, `per_hour(100)` 199 in its first hour.
/// When the first period must not admit more than `count`, use [`at_most`](Self::at_most)
/// (no burst: requests spaced `period / count` apart) or the sliding-log algorithm (any
/// pattern, at most `count` in every window of `period`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Quota {
    pub(crate) count: u64,
    pub(crate) period: Duration,
    pub(crate) burst: u64,
    pub(crate) unit: Unit,
}

impl Quota {
    /// The largest accepted `count` or `burst`, 2^32 - 1: with nanosecond instants every
    /// product the algorithms form then fits in 128 bits, so their arithmetic is exact.
    pub const MAX_COUNT: u64 = MAX_COUNT;

    /// The largest accepted sliding-window-log limit (requests per window). The log keeps one
    /// entry per admitted request (a weighted entry for a cost above 1), so its memory per key
    /// is O(limit): a limit of 1,000,000 per minute would cost megabytes per key.
    pub const MAX_SLIDING_LOG: u64 = MAX_SLIDING_LOG;

    /// The longest span a tier may cover (its period, and the time its burst takes to
    /// refill): 2^50 microseconds, about 35.7 years.
    pub const MAX_SPAN: Duration = MAX_SPAN;

    /// `count` units per `period`, burst `count`. Validated when the policy is built.
    #[must_use]
    pub const fn new(count: u64, period: Duration) -> Self {
        Self { count, period, burst: count, unit: Unit::Requests }
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

    /// At most `count` units in any window of `period`, the first one included. It is the rate
    /// of [`new`](Self::new) with a burst of 1, so units are admitted at least `period / count`
    /// apart and never two at once.
    ///
    /// `Quota::per_minute(5)` admits 9 requests in its first minute (its burst of 5, then one
    /// every 12 s); `at_most(5, 1 min)` admits 5, one every 12 s:
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::FakeClock;
    /// use tollgate::{Limiter, Policy, Quota, key::Key, store::MemoryStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let minute = Duration::from_secs(60);
    /// for (quota, first_minute) in [(Quota::per_minute(5), 9), (Quota::at_most(5, minute), 5)] {
    ///     let clock = FakeClock::new();
    ///     let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    ///     let limiter = Limiter::with_store(Policy::single("p", quota).unwrap(), store).unwrap();
    ///     let mut admitted = 0;
    ///     for _ in 0..600 {
    ///         // A request every 100 ms for a minute.
    ///         admitted += u32::from(limiter.check(&Key::Global, 1).await.unwrap().is_allowed());
    ///         clock.advance(Duration::from_millis(100));
    ///     }
    ///     assert_eq!(admitted, first_minute);
    /// }
    /// # }
    /// ```
    #[must_use]
    pub const fn at_most(count: u64, period: Duration) -> Self {
        Self::new(count, period).with_burst(1)
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
        Self { count, period, burst: max_burst.saturating_add(1), unit: Unit::Requests }
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

    /// The same quota counting `unit` instead of requests: `5 per second` of
    /// [`Unit::Requests`] next to `1,000,000 per second` of [`Unit::RequestBytes`] limits a
    /// client to 5 requests/s **and** 1 MB/s, as the example of [`Unit`] shows. See [`Unit`]
    /// for how each unit is charged.
    #[must_use]
    pub const fn counting(mut self, unit: Unit) -> Self {
        self.unit = unit;
        self
    }

    /// What the quota counts (default [`Unit::Requests`]).
    #[must_use]
    pub const fn unit(&self) -> Unit {
        self.unit
    }
}

/// What a tier counts, and so what a request costs on it (default [`Unit::Requests`]). Set with
/// [`Quota::counting`] or [`Calendar::counting`].
///
/// ```
/// use tollgate::{Policy, Quota, Unit};
///
/// // 5 requests and 1 MB of uploads a second per client.
/// let policy = Policy::builder("upload")
///     .tier("requests", Quota::per_second(5))
///     .tier("bytes", Quota::per_second(1_000_000).counting(Unit::RequestBytes))
///     .build()
///     .unwrap();
/// // A request with a 2,048-byte body costs 1 request and 2,048 bytes.
/// assert_eq!(&*policy.costs(1, Some(2_048)), [1, 2_048]);
/// ```
///
/// # How it works
///
/// A check says what each tier costs ([`Check::costs`](crate::store::Check::costs), built with
/// [`Policy::costs`](crate::Policy::costs)); a tier whose cost is only known later is charged
/// an estimate when the request is admitted (one unit: the request needs at least one unit
/// free) and **settled** at the real amount afterwards
/// ([`Reservation::settle_unit`](crate::Reservation::settle_unit)). A settlement charges the
/// difference unconditionally (the work was done), so a tier can run into debt, which later
/// requests then wait out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Unit {
    /// Requests (default): a request costs the check's `cost`, usually 1.
    #[default]
    Requests,
    /// Bytes of the request body: its `Content-Length` when the request has one; otherwise one
    /// unit at admission, settled at the bytes counted while the body streams (or, with a
    /// layer's [`StreamMode::Shape`](crate::StreamMode::Shape) or
    /// [`Police`](crate::StreamMode::Police), charged in grants as the body streams, the
    /// stream paused or stopped when the tier runs out).
    RequestBytes,
    /// Bytes of the response body: one unit at admission, settled at the bytes sent (or
    /// charged in grants as they are sent, as for [`RequestBytes`](Self::RequestBytes)).
    ResponseBytes,
    /// A cost the handler reports (for example the tokens an LLM call used): one unit at
    /// admission, settled at what the handler reports.
    Reported,
    /// Messages the client sends: a request counts as one message, charged at admission (so
    /// a unary gRPC call, or a plain HTTP request, costs one and shares the budget with the
    /// streams of its key). With a layer's [`StreamMode::Shape`](crate::StreamMode::Shape) or
    /// [`Police`](crate::StreamMode::Police), the messages of a gRPC call's request body are
    /// counted as they stream (each length-prefixed message of gRPC over HTTP/2, read from its
    /// 5-byte prefix, the payload never decoded) and charged in grants of at most
    /// [`MESSAGE_GRANT`](crate::StreamMode::MESSAGE_GRANT) messages, the stream paused or
    /// stopped when the tier runs out (the default: as the layer decides requests). Under
    /// [`StreamMode::Settle`](crate::StreamMode::Settle) a gRPC call is charged one message
    /// at admission and settled at the messages counted when its response ends. The Text and
    /// Binary messages a WebSocket receives are counted alike by the socket its handler wraps
    /// (cargo feature `ws`, module `tollgate::ws`).
    RequestMessages,
    /// Messages the server sends: as [`RequestMessages`](Self::RequestMessages), for the
    /// response body (and the messages a WebSocket sends).
    ResponseMessages,
}

impl Unit {
    /// The unit's name (`"requests"`, `"request_bytes"`, `"response_bytes"`, `"reported"`,
    /// `"request_messages"`, `"response_messages"`).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Requests => "requests",
            Self::RequestBytes => "request_bytes",
            Self::ResponseBytes => "response_bytes",
            Self::Reported => "reported",
            Self::RequestMessages => "request_messages",
            Self::ResponseMessages => "response_messages",
        }
    }
}

/// [`Concurrency::DEFAULT_TTL`].
pub(crate) const DEFAULT_TTL: Duration = Duration::from_secs(30);

/// [`Concurrency::DEFAULT_TYPICAL_HOLD`].
pub(crate) const DEFAULT_TYPICAL_HOLD: Duration = Duration::from_secs(1);

/// The shortest time to live and typical hold: 1 ms.
pub(crate) const MIN_HOLD: Duration = Duration::from_millis(1);

/// A concurrency limit of at most `max` requests in flight per key, one slot each. A slot is
/// held until the request's [`Reservation`](crate::Reservation) is released (the layer
/// releases it when the response body ends), and a refusal's `Retry-After` is the tier's
/// typical hold.
///
/// ```
/// use std::time::Duration;
/// use tollgate::{Concurrency, Policy, Quota};
///
/// let policy = Policy::builder("reports")
///     .concurrency("in-flight", Concurrency::new(4).with_ttl(Duration::from_secs(60)))
///     .tier("hourly", Quota::per_hour(100))
///     .build()
///     .unwrap();
/// let slots = policy.tiers()[0].concurrency().unwrap();
/// assert_eq!((slots.max(), slots.refresh_every()), (4, Duration::from_secs(20)));
/// ```
///
/// # How it works
///
/// A slot is taken when a request is admitted (together with every other tier of the policy:
/// all or nothing) and given back when the holder releases it
/// ([`Reservation::release`](crate::Reservation::release), or by dropping the reservation).
///
/// On a shared store (Redis) a slot has a **time to live**: it expires [`ttl`](Self::ttl) after
/// it was taken or last refreshed, so that slots held by an app server that crashed come back
/// by themselves. Holders refresh every third of it
/// ([`Reservation::refresh`](crate::Reservation::refresh), or
/// [`Reservation::hold`](crate::Reservation::hold), which does it for them). In memory a slot
/// lives exactly as long as its holder (the process cannot crash without it).
///
/// A refusal's `Retry-After` is the **typical hold**: the average time the tier's slots were
/// held (an exponentially weighted average, weight 1/8, of the holds the binding observed),
/// [`typical_hold`](Self::typical_hold) until the first release; never below 1 ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Concurrency {
    pub(crate) max: u64,
    pub(crate) ttl: Duration,
    pub(crate) typical_hold: Duration,
}

impl Concurrency {
    /// The default time to live of a slot on a shared store: 30 s (see
    /// [`with_ttl`](Self::with_ttl)).
    pub const DEFAULT_TTL: Duration = DEFAULT_TTL;

    /// The default typical hold of a slot before any was observed: 1 s (see
    /// [`with_typical_hold`](Self::with_typical_hold)).
    pub const DEFAULT_TYPICAL_HOLD: Duration = DEFAULT_TYPICAL_HOLD;

    /// At most `max` requests in flight per key (a request takes one slot), with the default
    /// time to live ([`DEFAULT_TTL`](Self::DEFAULT_TTL)) and typical hold
    /// ([`DEFAULT_TYPICAL_HOLD`](Self::DEFAULT_TYPICAL_HOLD)).
    #[must_use]
    pub const fn new(max: u64) -> Self {
        Self { max, ttl: DEFAULT_TTL, typical_hold: DEFAULT_TYPICAL_HOLD }
    }

    /// How long a slot on a shared store lasts without a refresh (its time to live, default
    /// 30 s). Holders refresh every third of it, so choose it well above the time a refresh
    /// takes to arrive. It is rounded up to milliseconds, and a time to live under 1 ms or
    /// over [`MAX_SPAN`](crate::Quota::MAX_SPAN) is refused when the policy is built
    /// ([`ConfigError::LeaseOutOfRange`](crate::ConfigError::LeaseOutOfRange)).
    #[must_use]
    pub const fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The former name of [`with_ttl`](Self::with_ttl).
    #[deprecated(note = "renamed: Concurrency::with_ttl (a lease is a block of a key's budget)")]
    #[must_use]
    pub const fn with_lease(self, lease: Duration) -> Self {
        self.with_ttl(lease)
    }

    /// The hold reported as `Retry-After` until a slot of the tier has been released (then the
    /// observed average takes over). At least 1 ms (a shorter one counts as 1 ms).
    #[must_use]
    pub const fn with_typical_hold(mut self, hold: Duration) -> Self {
        self.typical_hold = hold;
        self
    }

    /// Slots per key.
    #[must_use]
    pub const fn max(&self) -> u64 {
        self.max
    }

    /// The time to live of a slot on a shared store.
    #[must_use]
    pub const fn ttl(&self) -> Duration {
        self.ttl
    }

    /// The former name of [`ttl`](Self::ttl).
    #[deprecated(note = "renamed: Concurrency::ttl")]
    #[must_use]
    pub const fn lease(&self) -> Duration {
        self.ttl
    }

    /// The initial typical hold.
    #[must_use]
    pub const fn typical_hold(&self) -> Duration {
        self.typical_hold
    }

    /// How often a holder refreshes its slot: a third of its time to live.
    #[must_use]
    pub const fn refresh_every(&self) -> Duration {
        Duration::from_nanos((self.ttl.as_nanos() / 3) as u64)
    }
}

/// The calendar unit of a [`Calendar`] tier's windows, in the tier's time zone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CalendarPeriod {
    /// From second 0 of each minute of the zone's clock.
    Minute,
    /// From minute 0 of each hour of the zone's clock (a zone's offset change starts a new
    /// window: the repeated hour of a change back from daylight-saving time is a window of its
    /// own).
    Hour,
    /// From 00:00 of each day (a day is 23 or 25 hours long across a daylight-saving change;
    /// where midnight is skipped, the day starts at the first instant after it).
    Day,
    /// From 00:00 on Monday (ISO 8601 weeks).
    Week,
    /// From 00:00 on the 1st.
    Month,
    /// From 00:00 on January 1st.
    Year,
}

impl CalendarPeriod {
    /// Every period, shortest first.
    pub const ALL: [Self; 6] =
        [Self::Minute, Self::Hour, Self::Day, Self::Week, Self::Month, Self::Year];

    /// The period's name (`"minute"`, ..., `"year"`).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Minute => "minute",
            Self::Hour => "hour",
            Self::Day => "day",
            Self::Week => "week",
            Self::Month => "month",
            Self::Year => "year",
        }
    }

    /// The longest a window of this period lasts (a day of 25 hours, a month of 31 days, a
    /// year of 366 days), used where one length has to stand for all (the `w` parameter of
    /// `RateLimit-Policy`).
    #[must_use]
    pub const fn longest(self) -> Duration {
        const H: u64 = 3600;
        Duration::from_secs(match self {
            Self::Minute => 60,
            Self::Hour => H,
            Self::Day => 25 * H,
            Self::Week => 7 * 24 * H + H,
            Self::Month => 31 * 24 * H + H,
            Self::Year => 366 * 24 * H + H,
        })
    }
}

/// A calendar quota of `count` units per calendar window (minute, hour, day, ISO week, month,
/// year) of UTC or of a named IANA time zone, e.g. "10,000 per month, resetting on the 1st at
/// 00:00 in the customer's time zone". A refused request's `Retry-After`, and the tier's
/// `reset_after`, point to the start of the next window. An unknown time zone is refused when
/// the policy is built ([`ConfigError::UnknownTimeZone`](crate::ConfigError::UnknownTimeZone)).
///
/// ```
/// use tollgate::{Calendar, Policy};
///
/// let policy = Policy::builder("plan")
///     .calendar("monthly", Calendar::per_month(10_000).in_time_zone("America/New_York"))
///     .build()
///     .unwrap();
/// assert_eq!(policy.tiers()[0].calendar().unwrap().time_zone(), "America/New_York");
///
/// let err = Policy::builder("plan")
///     .calendar("monthly", Calendar::per_month(10).in_time_zone("Mars/Olympus_Mons"))
///     .build()
///     .unwrap_err();
/// assert!(err.to_string().starts_with("tier `monthly`: unknown time zone \"Mars/Olympus_Mons\""));
/// ```
///
/// # How it works
///
/// Windows follow the zone's clock, daylight-saving changes included (the time zone
/// arithmetic is [jiff](https://docs.rs/jiff)'s, over the IANA time zone database). Instants of
/// the store's clock are taken as nanoseconds since the Unix epoch, UTC (as the built-in
/// clocks count).
///
/// # Shaping
///
/// When shaping, a request leaves at the earliest instant at which every tier of its policy
/// has room for it, and is charged to the window holding that instant (a full window has room
/// again only when the next one starts), so that no window ever counts more than `count`. That
/// window may be the current one or one of the next seven (8 windows in all: eight minutes for
/// a per-minute tier), the windows the Redis store is told of. A request that would leave
/// later is refused whatever the budget, with `retry_after` the end of the current window (when
/// the eight windows move on) or, if later, the wait until its departure is within the budget:
/// not an earlier retry succeeds, and a retry then may find the departure still too far.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Calendar {
    pub(crate) count: u64,
    pub(crate) period: CalendarPeriod,
    /// `None`: UTC.
    pub(crate) zone: Option<Arc<str>>,
    pub(crate) unit: Unit,
}

impl Calendar {
    /// `count` units per `period`, in UTC.
    #[must_use]
    pub const fn new(count: u64, period: CalendarPeriod) -> Self {
        Self { count, period, zone: None, unit: Unit::Requests }
    }

    /// `count` per minute of the clock.
    #[must_use]
    pub const fn per_minute(count: u64) -> Self {
        Self::new(count, CalendarPeriod::Minute)
    }

    /// `count` per hour of the clock.
    #[must_use]
    pub const fn per_hour(count: u64) -> Self {
        Self::new(count, CalendarPeriod::Hour)
    }

    /// `count` per calendar day.
    #[must_use]
    pub const fn per_day(count: u64) -> Self {
        Self::new(count, CalendarPeriod::Day)
    }

    /// `count` per ISO week (from Monday 00:00).
    #[must_use]
    pub const fn per_week(count: u64) -> Self {
        Self::new(count, CalendarPeriod::Week)
    }

    /// `count` per calendar month.
    #[must_use]
    pub const fn per_month(count: u64) -> Self {
        Self::new(count, CalendarPeriod::Month)
    }

    /// `count` per calendar year.
    #[must_use]
    pub const fn per_year(count: u64) -> Self {
        Self::new(count, CalendarPeriod::Year)
    }

    /// Windows of the named IANA time zone (`"Europe/Berlin"`, `"America/New_York"`,
    /// `"UTC"`). The name is looked up when the policy is built: an unknown one is a
    /// [`ConfigError::UnknownTimeZone`](crate::ConfigError::UnknownTimeZone).
    #[must_use]
    pub fn in_time_zone(mut self, zone: impl Into<String>) -> Self {
        self.zone = Some(zone.into().into());
        self
    }

    /// The same quota counting `unit` instead of requests (see [`Quota::counting`]).
    #[must_use]
    pub const fn counting(mut self, unit: Unit) -> Self {
        self.unit = unit;
        self
    }

    /// Units per window.
    #[must_use]
    pub const fn count(&self) -> u64 {
        self.count
    }

    /// The calendar unit of the windows.
    #[must_use]
    pub const fn period(&self) -> CalendarPeriod {
        self.period
    }

    /// The time zone's name (`"UTC"` unless one was given).
    #[must_use]
    pub fn time_zone(&self) -> &str {
        self.zone.as_deref().unwrap_or("UTC")
    }

    /// What the tier counts.
    #[must_use]
    pub const fn unit(&self) -> Unit {
        self.unit
    }
}

/// The most refusals a [`Penalty`] may count before it blocks: 1,000.
pub(crate) const MAX_PENALTY_REFUSALS: u32 = 1_000;

/// A penalty box on a tier (rate-limiter-flexible's `blockDuration`), which refuses **every**
/// request of a key under the policy for the block duration once the tier refused the key (or
/// refused it `refusals` times within a window). Set it with
/// [`PolicyBuilder::penalty`](crate::PolicyBuilder::penalty), and a block or window out of
/// range is refused when the policy is built ([`ConfigError::Penalty`](crate::ConfigError::Penalty)).
///
/// ```
/// use std::time::Duration;
/// use tollgate::{Penalty, Policy, Quota};
///
/// let minute = Duration::from_secs(60);
/// // 10 a minute; a client refused 3 times within a minute is shut out for 15 minutes.
/// let policy = Policy::builder("login")
///     .tier("minute", Quota::per_minute(10))
///     .penalty("minute", Penalty::new(15 * minute).after(3, minute))
///     .build()
///     .unwrap();
/// let penalty = policy.tiers()[0].penalty().unwrap();
/// assert_eq!((penalty.block(), penalty.refusals(), penalty.within()), (15 * minute, 3, minute));
/// ```
///
/// # How it works
///
/// - **A breach** is a refused check (outcome [`Limited`](crate::Outcome::Limited)) that the
///   tier itself could not admit at that instant: one of the tiers the decision names as
///   violated. A request whose cost exceeds the tier's capacity
///   ([`CostExceedsCapacity`](crate::Outcome::CostExceedsCapacity)) is no breach (it could never
///   be admitted, and retrying it changes nothing), and neither is a query (cost 0).
/// - With [`after(k, within)`](Self::after), the breach that blocks is the `k`-th of breaches
///   of which the first came less than `within` before it (breaches older than that are
///   forgotten); by default the first breach blocks. Counted breaches are cleared when a block
///   starts.
/// - **The block** starts at the breaching check and lasts [`block`](Self::block) (rounded up
///   to the policy's [precision](crate::Policy::precision)). The breaching request is refused with
///   `retry_after` the longer of the block and the wait the tiers themselves give.
/// - **During the block** every check of the key that costs something is refused and charges
///   nothing, on no tier (nothing is consumed while blocked, as in rate-limiter-flexible), and
///   it counts as no breach: refused requests neither extend the block nor count towards the
///   next one. A check whose cost exceeds a tier's capacity still gets
///   `CostExceedsCapacity`; a query is still answered.
/// - **What a client is told during the block:** `retry_after` is exactly the time left in
///   the block, or the wait the tiers themselves give if that is longer (a block shorter than
///   a tier's refill), so that a retry then is refused neither by the block nor by the tiers;
///   `Retry-After` rounds it up to whole seconds like every other refusal. The blocking tier
///   reports `remaining` 0 and a `reset_after` of at least the time left (the `RateLimit`
///   header's `r=0` and `t`), and is named violated with that retry. Other tiers report their
///   own state.
/// - After the block the tiers decide on their own state, which the blocked requests did not
///   touch: if a tier is still exhausted then (a block shorter than its refill), a request
///   that comes before the retry it was given is refused by it, a new breach.
/// - Another key, and the same key under another policy, are not affected. (Keys a full
///   [`MemoryStore`](crate::store::MemoryStore) decides in its one overflow bucket share its
///   box, as they share its tiers.)
/// - The box's state lives with the tier's state in every store: in memory, a key whose block
///   has ended and whose counted breaches have left the window is idle and swept like any other;
///   on Redis it is part of the key's one state string, decided atomically with the check in
///   the same script, and its TTL covers the block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Penalty {
    pub(crate) block: Duration,
    pub(crate) refusals: u32,
    pub(crate) within: Duration,
}

impl Penalty {
    /// The most refusals a penalty box may count before it blocks: 1,000.
    pub const MAX_REFUSALS: u32 = MAX_PENALTY_REFUSALS;

    /// Blocks a key for `block` from its first breach of the tier. `block` is 1 ns to
    /// [`MAX_SPAN`](crate::Quota::MAX_SPAN) (checked when the policy is built).
    #[must_use]
    pub const fn new(block: Duration) -> Self {
        Self { block, refusals: 1, within: Duration::ZERO }
    }

    /// Blocks only at the `refusals`-th breach of which the first came less than `within`
    /// before it. `refusals` is 1 to [`MAX_REFUSALS`](Self::MAX_REFUSALS) and, above 1,
    /// `within` is 1 ns to [`MAX_SPAN`](crate::Quota::MAX_SPAN) (checked when the policy is
    /// built).
    ///
    /// Refusals in the window are kept as instants, at most `refusals - 1` per key.
    #[must_use]
    pub const fn after(mut self, refusals: u32, within: Duration) -> Self {
        self.refusals = refusals;
        self.within = within;
        self
    }

    /// How long a key stays blocked.
    #[must_use]
    pub const fn block(&self) -> Duration {
        self.block
    }

    /// The breaches that start a block (1 unless [`after`](Self::after) says otherwise).
    #[must_use]
    pub const fn refusals(&self) -> u32 {
        self.refusals
    }

    /// The window the breaches are counted in (zero unless [`after`](Self::after) set it).
    #[must_use]
    pub const fn within(&self) -> Duration {
        self.within
    }
}

/// The class of a request, for tiers that reserve part of their capacity ([`Reserve`]), which
/// refuse sheddable requests first as their limit nears, then standard ones. Each check
/// carries one ([`Check::priority`](crate::store::Check::priority), standard by default), and
/// the layer picks it per request
/// ([`RateLimitLayerBuilder::priority`](crate::RateLimitLayerBuilder::priority)). On a tier
/// without a reserve every class decides alike.
///
/// ```
/// use tollgate::Priority;
///
/// assert_eq!(Priority::default(), Priority::Standard);
/// assert!(Priority::Critical < Priority::Standard && Priority::Standard < Priority::Sheddable);
/// ```
///
/// [`Limiter::check_as`](crate::Limiter::check_as) shows a reserve at work. The three classes are Envoy's and Armeria's request priorities, and the "critical /
/// standard / sheddable" classes of load-shedding literature (Google SRE book, "Handling
/// Overload": criticality).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Priority {
    /// May use the whole capacity, the reserves included.
    Critical,
    /// May use the capacity but the critical reserve (the default).
    #[default]
    Standard,
    /// May use the capacity but both reserves: refused first.
    Sheddable,
}

impl Priority {
    /// The class named `name`: `critical`, `standard` or `sheddable` (ASCII case ignored), as
    /// a header or a configuration file spells it; `None` for anything else.
    ///
    /// ```
    /// use tollgate::Priority;
    ///
    /// assert_eq!(Priority::from_name("Sheddable"), Some(Priority::Sheddable));
    /// assert_eq!(Priority::from_name("urgent"), None);
    /// ```
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Critical, Self::Standard, Self::Sheddable]
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(name))
    }

    /// The class's name: `critical`, `standard` or `sheddable`.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Critical => "critical",
            Self::Standard => "standard",
            Self::Sheddable => "sheddable",
        }
    }

    /// The class's number in the Redis script's arguments (0 critical, 1 standard, 2
    /// sheddable).
    #[cfg(feature = "redis")]
    pub(crate) const fn index(self) -> u64 {
        match self {
            Self::Critical => 0,
            Self::Standard => 1,
            Self::Sheddable => 2,
        }
    }
}

/// Capacity of a tier reserved for the higher [`Priority`] classes, in the tier's units
/// (Envoy's and Armeria's "reserved capacity"). Set it with
/// [`PolicyBuilder::reserve`](crate::PolicyBuilder::reserve), on a GCRA rate tier, leaving
/// room for every class ([`ConfigError::Reserve`](crate::ConfigError::Reserve) otherwise).
///
/// ```
/// use tollgate::{Policy, Priority, Quota, Reserve};
///
/// // 100 a second shared; 20 kept for critical requests, 30 more for standard ones.
/// let policy = Policy::builder("api")
///     .tier("second", Quota::per_second(100))
///     .reserve("second", Reserve::new().critical(20).standard(30))
///     .build()
///     .unwrap();
/// let tier = &policy.tiers()[0];
/// assert_eq!(tier.capacity_for(Priority::Critical), 100);
/// assert_eq!(tier.capacity_for(Priority::Standard), 80);
/// assert_eq!(tier.capacity_for(Priority::Sheddable), 50);
/// ```
///
/// # How it works
///
/// Exactly, on a tier of capacity `C` (its burst) with reserves `r_c` (critical) and `r_s`
/// (standard), all classes share the tier's one state and one limit, and a request of cost
/// `n` is admitted only if, once charged, the tier keeps at least
///
/// - `0` units of room for a [`Critical`](Priority::Critical) request,
/// - `r_c` units for a [`Standard`](Priority::Standard) request,
/// - `r_c + r_s` units for a [`Sheddable`](Priority::Sheddable) request.
///
/// So each class decides as GCRA would on the same theoretical arrival time with a burst of
/// its own, `C`, `C - r_c` and `C - r_c - r_s` (the tolerance `tau` reduced by the reserve
/// withheld from it; the sustained rate is the tier's for every class):
///
/// - what all classes together are admitted never exceeds the tier's limit (one state, charged
///   by every admitted request whatever its class);
/// - sheddable requests are refused first as the limit nears, then standard ones;
/// - a critical request is refused only once less than its cost is left, which lower classes
///   cannot bring about: they stop `r_c` units short (also when shaping: see below). So a
///   critical request is never refused while the critical reserve is unused, and, policing,
///   critical traffic within `r_c` units of burst above its share of the rate is never
///   refused, whatever the other classes send (shaping, the lower classes may book the rate
///   ahead, up to the shaping budget: critical requests then get `r_c` units at once each time
///   that schedule turns over, and wait behind it beyond);
/// - each class's `retry_after` is exact for that class (when a request of its class would be
///   admitted), and its `remaining` and `limit` (the `RateLimit` headers) are what that class
///   sees: `C - r_c` is a standard request's limit. A request whose cost exceeds its class's
///   capacity is [`CostExceedsCapacity`](crate::Outcome::CostExceedsCapacity).
/// - a reserve is kept, not lent: while no critical request comes, the lower classes leave
///   `r_c` units unused however much they ask. So over a span `s` in which the lower classes
///   saturate the tier, all classes together are admitted between `C + rate * s - r_c` and
///   `C + rate * s` (the tier's limit), as the crate's tests hold on both stores.
/// - a settlement above the charge ([`Store::settle`](crate::store::Store::settle)) is a debt
///   the key pays, into the critical reserve if it must (the tier's limit comes first): a
///   critical request is refused, with the exact `retry_after`, until the debt has drained by
///   its cost. The promise above is about what lower classes are admitted, not what they report.
///
/// **Shaping.** A shaped request that waits for its slot is charged when it is decided and
/// leaves later, so requests of the lower classes booked ahead would hold the tier past their
/// line, into the critical reserve, until they leave. The critical reserve is kept out of that
/// schedule: a critical request is admitted at once, ahead of the requests booked and waiting,
/// while the critical units admitted so (and those the key held past the standard line when the
/// schedule began) stay within `r_c`. Each request waiting conformed to its class's line, so
/// it leaves with room for `r_c` units ahead of it, and what leaves, in the order it leaves,
/// never exceeds the tier's limit. Once used, the reserve comes back when the requests booked
/// while it was used have left, and one emission interval per unit used after that: at most the
/// shaping budget and `r_c` intervals after the last critical request admitted ahead. A critical
/// request the reserve cannot serve then waits behind the whole schedule (within its own
/// shaping budget), or is refused with the exact `retry_after` (the instant the reserve comes
/// back, when that is sooner). The standard reserve `r_s` is kept in the order requests are
/// decided: a standard request waits behind the sheddable ones booked ahead of it. The crate's
/// tests hold this over HTTP and over random traces of classes and shaping, on both stores.
///
/// On a tier that also has a [`Penalty`], a request its class may not admit is a breach like
/// any other refusal of the tier (a sheddable client refused at its threshold can be blocked).
///
/// Reserves run on GCRA rate tiers (the default algorithm); `r_c + r_s` must be less than the
/// tier's capacity, so that every class can be admitted. A policy with a reserve is decided
/// on the stores' general path (with the other tier kinds), atomically with the check (in the
/// same Redis script).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Reserve {
    pub(crate) critical: u64,
    pub(crate) standard: u64,
}

impl Reserve {
    /// Reserves nothing.
    #[must_use]
    pub const fn new() -> Self {
        Self { critical: 0, standard: 0 }
    }

    /// Reserves `units` of the tier's capacity for critical requests.
    #[must_use]
    pub const fn critical(mut self, units: u64) -> Self {
        self.critical = units;
        self
    }

    /// Reserves `units` more for standard (and critical) requests: sheddable requests stop
    /// `critical + standard` units short of the capacity.
    #[must_use]
    pub const fn standard(mut self, units: u64) -> Self {
        self.standard = units;
        self
    }

    /// Units reserved for critical requests.
    #[must_use]
    pub const fn critical_units(&self) -> u64 {
        self.critical
    }

    /// Units reserved for standard and critical requests, beyond the critical reserve.
    #[must_use]
    pub const fn standard_units(&self) -> u64 {
        self.standard
    }

    /// The units of capacity a request of class `class` may not use.
    ///
    /// ```
    /// use tollgate::{Priority, Reserve};
    ///
    /// let r = Reserve::new().critical(20).standard(30);
    /// assert_eq!(r.withheld_from(Priority::Critical), 0);
    /// assert_eq!(r.withheld_from(Priority::Standard), 20);
    /// assert_eq!(r.withheld_from(Priority::Sheddable), 50);
    /// ```
    #[must_use]
    pub const fn withheld_from(&self, class: Priority) -> u64 {
        match class {
            Priority::Critical => 0,
            Priority::Standard => self.critical,
            Priority::Sheddable => self.critical.saturating_add(self.standard),
        }
    }
}

/// What kind of limit a [`Tier`](crate::Tier) is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TierKind {
    /// A rate: a [`Quota`] run by the policy's [`Algorithm`].
    Rate,
    /// A [`Concurrency`] limit: requests in flight.
    Concurrency,
    /// A [`Calendar`] quota.
    Calendar,
}

/// The algorithm a policy runs, the same in every store. Set it with
/// [`PolicyBuilder::algorithm`](crate::PolicyBuilder::algorithm) (default [`Gcra`](Self::Gcra)).
///
/// ```
/// use tollgate::{Algorithm, Policy, Quota};
///
/// let policy = Policy::builder("api")
///     .tier("minute", Quota::per_minute(100))
///     .algorithm(Algorithm::SlidingLog)
///     .build()
///     .unwrap();
/// assert_eq!(policy.algorithm().name(), "sliding_log");
/// // The window algorithms admit `count` per window: they have no burst of their own.
/// let err = Policy::builder("api")
///     .tier("minute", Quota::per_minute(100).with_burst(200))
///     .algorithm(Algorithm::FixedWindow)
///     .build()
///     .unwrap_err();
/// assert!(err.to_string().ends_with("burst 200 != count 100"));
/// ```
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
    /// O(count) memory per key; `count` is capped at [`MAX_SLIDING_LOG`](crate::Quota::MAX_SLIDING_LOG). A check, admitted or
    /// refused, costs O(log n) amortised for a log of n entries, in memory (running totals by
    /// binary search) and on Redis (a sorted set read only at the entries that must expire); no
    /// check scans the whole log.
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
    pub(crate) const fn is_window(self) -> bool {
        matches!(self, Self::FixedWindow | Self::SlidingLog | Self::SlidingCounter)
    }
}
