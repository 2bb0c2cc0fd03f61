//! Error types.

use std::fmt;
use std::time::Duration;

/// A policy or layer configuration that cannot work, refused when it is built.
///
/// Every variant says which tier (or setting) is wrong and why. Its `Debug` form is its
/// `Display` form, so an error returned from `main` prints the same line:
///
/// ```
/// use tollgate::{Policy, Quota};
///
/// let err = Policy::single("api", Quota::per_second(0)).unwrap_err();
/// assert_eq!(format!("{err:?}"), "tier `api`: count must be at least 1");
/// ```
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A quota's `count` is zero: nothing could ever be admitted.
    #[error("tier `{tier}`: count must be at least 1")]
    ZeroCount {
        /// The tier's name.
        tier: String,
    },
    /// A quota's `period` is zero (or below one nanosecond).
    #[error("tier `{tier}`: period must be at least 1 ns")]
    ZeroPeriod {
        /// The tier's name.
        tier: String,
    },
    /// A quota's `burst` is zero: no request could ever fit.
    #[error("tier `{tier}`: burst must be at least 1")]
    ZeroBurst {
        /// The tier's name.
        tier: String,
    },
    /// `count` or `burst` exceeds [`MAX_COUNT`](crate::Quota::MAX_COUNT).
    #[error("tier `{tier}`: {what} {value} exceeds the maximum {max}")]
    TooLarge {
        /// The tier's name.
        tier: String,
        /// `"count"` or `"burst"`.
        what: &'static str,
        /// The value given.
        value: u64,
        /// The largest accepted value.
        max: u64,
    },
    /// A tier's span (its period, or `burst x period / count`) exceeds
    /// [`MAX_SPAN`](crate::Quota::MAX_SPAN).
    #[error("tier `{tier}`: its period or burst spans more than the longest supported, {max:?}")]
    SpanTooLong {
        /// The tier's name.
        tier: String,
        /// The longest span.
        max: Duration,
    },
    /// A window algorithm was given a `burst` different from `count`; windows admit exactly
    /// `count` per window and have no separate burst.
    #[error(
        "tier `{tier}`: the {algorithm} algorithm admits `count` per window; burst {burst} != count {count}"
    )]
    BurstNotSupported {
        /// The tier's name.
        tier: String,
        /// The algorithm's name.
        algorithm: &'static str,
        /// The burst given.
        burst: u64,
        /// The count given.
        count: u64,
    },
    /// A sliding-window-log limit above [`MAX_SLIDING_LOG`](crate::Quota::MAX_SLIDING_LOG):
    /// the log keeps one entry per admitted request, so memory per key grows with the limit.
    #[error(
        "tier `{tier}`: sliding log limit {count} exceeds {max}; use the sliding window counter for large limits"
    )]
    SlidingLogTooLarge {
        /// The tier's name.
        tier: String,
        /// The count given.
        count: u64,
        /// The ceiling.
        max: u64,
    },
    /// A concurrency tier's time to live ([`Concurrency::with_ttl`](crate::Concurrency::with_ttl))
    /// is shorter than 1 ms or longer than [`MAX_SPAN`](crate::Quota::MAX_SPAN).
    #[error("tier `{tier}`: lease {lease:?} must be between {min:?} and {max:?}")]
    LeaseOutOfRange {
        /// The tier's name.
        tier: String,
        /// The time to live given.
        lease: Duration,
        /// The shortest time to live.
        min: Duration,
        /// The longest time to live.
        max: Duration,
    },
    /// A calendar tier names a time zone the IANA time zone database does not have (or no
    /// database was found: see the `tzdb-bundled` cargo feature).
    #[error("tier `{tier}`: unknown time zone {zone:?}: {reason}")]
    UnknownTimeZone {
        /// The tier's name.
        tier: String,
        /// The zone's name, as given.
        zone: String,
        /// Why it was not found.
        reason: String,
    },
    /// A [`Penalty`](crate::Penalty) that names no tier of the policy, a concurrency tier, or
    /// a tier that has one already, or whose block, refusals or window is out of range.
    #[error("tier `{tier}`: penalty: {reason}")]
    Penalty {
        /// The tier's name, as the penalty gave it.
        tier: String,
        /// Why it is refused.
        reason: String,
    },
    /// A [`Reserve`](crate::Reserve) that names no tier of the policy, a tier that is not a
    /// rate or has one already, a policy that does not run GCRA, or reserves as large as the
    /// tier's capacity.
    #[error("tier `{tier}`: reserve: {reason}")]
    Reserve {
        /// The tier's name, as the reserve gave it.
        tier: String,
        /// Why it is refused.
        reason: String,
    },
    /// Two tiers of one policy share a name.
    #[error("duplicate tier name `{0}`")]
    DuplicateTier(String),
    /// A policy without tiers.
    #[error("policy `{0}` has no tiers")]
    NoTiers(String),
    /// A name (policy or tier) that is empty or cannot be written as an RFC 9651 String
    /// (printable ASCII only).
    #[error("name {0:?} must be non-empty printable ASCII")]
    BadName(String),
    /// A setting of a builder is out of range or inconsistent with another.
    #[error("{setting}: {reason}")]
    Invalid {
        /// The setting, as the builder method that sets it is named (`"max_waiters"`,
        /// `"timeout"`, `"prefix"`, ...).
        setting: &'static str,
        /// Why it is refused.
        reason: String,
    },
    /// A fixed cost above a tier's capacity: every request would be refused.
    #[error("cost: {cost} units exceed the capacity of tier `{tier}` ({capacity} units)")]
    CostExceedsCapacity {
        /// The cost given, in units.
        cost: u64,
        /// The tier's name.
        tier: String,
        /// The tier's capacity, in units ([`Tier::capacity`](crate::Tier::capacity)).
        capacity: u64,
    },
    /// A lean layer ([`RateLimitLayer::lean`](crate::RateLimitLayer::lean)) asked for a policy
    /// with a tier that must observe a request while it runs: a concurrency tier (its slots
    /// are held until the response ends) or a tier counting bytes, messages or reported units
    /// (counted as the bodies stream). Only the full layer can serve such a policy.
    #[error(
        "policy `{policy}`, tier `{tier}`: {reason}; a lean layer observes no body, use the layer itself"
    )]
    ObservesBody {
        /// The policy's name.
        policy: String,
        /// The tier's name.
        tier: String,
        /// What the tier observes (`"holds concurrency slots until the response ends"`,
        /// `"counts request_bytes"`, ...).
        reason: String,
    },
    /// The store cannot run this tier (for example a span beyond what it represents).
    #[error("{store} cannot run tier `{tier}`: {reason}")]
    UnsupportedByStore {
        /// The store (`"RedisStore"`).
        store: &'static str,
        /// The tier's name.
        tier: String,
        /// Why.
        reason: String,
    },
}

impl fmt::Debug for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A boxed error from a store's backend (the `redis` crate's `RedisError`, say).
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A store failed to decide (unreachable, timed out, returned nonsense).
///
/// ```
/// use std::error::Error;
/// use tollgate::StoreError;
///
/// // What a store outside this crate returns when its backend fails.
/// let err = StoreError::backend("connection refused");
/// assert_eq!(err.to_string(), "store backend error: connection refused");
/// assert_eq!(err.source().unwrap().to_string(), "connection refused");
/// ```
///
/// The layer turns this into the configured failure outcome (fail open, fail closed), never into
/// the inner service's error. [`source`](std::error::Error::source) gives the backend's own
/// error, so operators can tell a refused connection from a script error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store did not answer within its timeout.
    #[error("store timed out after {0:?}")]
    Timeout(Duration),
    /// The circuit breaker is open: recent calls failed, so this one was not attempted.
    #[error("circuit breaker open")]
    CircuitOpen,
    /// The backend failed; the source is its error.
    #[error("store backend error: {0}")]
    Backend(#[source] BoxError),
}

impl StoreError {
    /// A backend error from anything that converts into a boxed error (a message, an error).
    pub fn backend(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self::Backend(error.into())
    }
}
