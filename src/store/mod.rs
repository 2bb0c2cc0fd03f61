//! Stores: where the per-key state lives.
//!
//! [`MemoryStore`] is the default and keeps state in the process; [`RedisStore`] (cargo feature
//! `redis`) shares it across a fleet through Redis, Redis Cluster or Valkey. The [`Store`] trait
//! is public so that other backends can be added.
//!
//! A store first **binds** a [`Policy`] ([`Store::bind`]): it validates it and prepares
//! everything a decision needs (tables, key prefixes, script arguments) once, when a
//! [`Limiter`](crate::Limiter) or [`RateLimitLayer`](crate::RateLimitLayer) is built. Each
//! request then passes the bound policy and a [`Check`] (key, cost, shaping budget).
//!
//! ```
//! use tollgate::key::Key;
//! use tollgate::store::{Check, MemoryStore, Store};
//! use tollgate::{Policy, Quota};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = MemoryStore::new();
//! let bound = store.bind(&Policy::single("api", Quota::per_minute(2))?)?;
//! let alice = Key::text("alice");
//! for expected in [true, true, false] {
//!     let verdict = store.check(&bound, Check::new(&alice, 1)).await?;
//!     assert_eq!(verdict.decision.is_allowed(), expected);
//! }
//! # Ok(()) }
//! ```

pub(crate) mod memory;
#[cfg(feature = "redis")]
mod redis;

use std::future::Future;
use std::time::Duration;

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use self::redis::{
    BreakerState, RedisPolicy, RedisStore, RedisStoreBuilder, RedisTicket, ServerInfo, ServerKind,
};
pub use memory::{MemoryPolicy, MemoryStore, MemoryStoreBuilder, MemoryTicket};

use crate::decision::Decision;
use crate::error::{ConfigError, StoreError};
use crate::key::Key;
use crate::quota::Policy;

/// One request to decide: which key, what it costs, how long it may wait, and whether the
/// charge may be given back later.
///
/// ```
/// use std::time::Duration;
/// use tollgate::key::Key;
/// use tollgate::store::Check;
///
/// let key = Key::text("alice");
/// let check = Check::new(&key, 3).shape(Duration::from_millis(250)).with_ticket();
/// assert_eq!((check.cost, check.max_delay, check.ticket), (3, Some(Duration::from_millis(250)), true));
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Check<'a> {
    /// The key being limited.
    pub key: &'a Key,
    /// Units this request consumes (0 consumes nothing and is always admitted: a query).
    pub cost: u64,
    /// `None` to police (admit now or reject); `Some(d)` to shape: reserve the earliest
    /// conforming slot if it is at most `d` away.
    pub max_delay: Option<Duration>,
    /// Whether the caller may settle or cancel this request later: only then does an admitted
    /// request come with a ticket. Plain checks skip building one.
    pub ticket: bool,
}

impl<'a> Check<'a> {
    /// Polices `cost` units for `key`, without a ticket.
    #[must_use]
    pub const fn new(key: &'a Key, cost: u64) -> Self {
        Self { key, cost, max_delay: None, ticket: false }
    }

    /// Shapes instead: reserves the earliest conforming slot within `max_delay`.
    #[must_use]
    pub const fn shape(mut self, max_delay: Duration) -> Self {
        self.max_delay = Some(max_delay);
        self
    }

    /// Asks for a ticket, so that the charge can be settled or cancelled later.
    #[must_use]
    pub const fn with_ticket(mut self) -> Self {
        self.ticket = true;
        self
    }
}

/// A store's answer: the decision and, for an admitted request that asked for one
/// ([`Check::ticket`]) and cost more than 0, a ticket to settle or cancel it.
#[derive(Debug)]
#[non_exhaustive]
pub struct Verdict<T> {
    /// The decision.
    pub decision: Decision,
    /// What was charged, for [`Store::settle`].
    pub ticket: Option<T>,
}

impl<T> Verdict<T> {
    /// A verdict (for stores outside this crate).
    #[must_use]
    pub const fn new(decision: Decision, ticket: Option<T>) -> Self {
        Self { decision, ticket }
    }
}

/// A backend that decides requests atomically over all tiers of a policy.
///
/// Implementations must decide all tiers of one check atomically: a rejected request charges no
/// tier, and concurrent checks on one key never both take the last unit.
///
/// A store wrapping another one (to count calls, say) delegates each method:
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use tollgate::store::{Check, MemoryStore, Store, Verdict};
/// use tollgate::{ConfigError, Limiter, Policy, Quota, StoreError};
/// use tollgate::key::Key;
///
/// #[derive(Clone, Default)]
/// struct Counted {
///     inner: MemoryStore,
///     checks: Arc<AtomicU64>,
/// }
///
/// impl Store for Counted {
///     type Bound = <MemoryStore as Store>::Bound;
///     type Ticket = <MemoryStore as Store>::Ticket;
///
///     fn bind(&self, policy: &Policy) -> Result<Self::Bound, ConfigError> {
///         self.inner.bind(policy)
///     }
///
///     async fn check(&self, bound: &Self::Bound, check: Check<'_>)
///         -> Result<Verdict<Self::Ticket>, StoreError> {
///         self.checks.fetch_add(1, Ordering::Relaxed);
///         self.inner.check(bound, check).await
///     }
///
///     async fn settle(&self, bound: &Self::Bound, ticket: Self::Ticket, cost: u64)
///         -> Result<(), StoreError> {
///         self.inner.settle(bound, ticket, cost).await
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = Counted::default();
/// let limiter = Limiter::with_store(Policy::single("api", Quota::per_second(5))?, store.clone())?;
/// limiter.check(&Key::Global, 1).await?;
/// assert_eq!(store.checks.load(Ordering::Relaxed), 1);
/// # Ok(()) }
/// ```
pub trait Store: Clone + Send + Sync + 'static {
    /// A policy bound to this store: validated, with whatever the store needs per request
    /// prepared ([`MemoryPolicy`], [`RedisPolicy`]).
    type Bound: Send + Sync + 'static;

    /// What an admitted request was charged, so that [`settle`](Self::settle) can give it back
    /// or charge more. Dropping a ticket keeps the charge.
    type Ticket: Send + Sync + 'static;

    /// Validates `policy` for this store and prepares it. Called once, when a
    /// [`Limiter`](crate::Limiter) or layer is built, so that a policy the store cannot run is
    /// refused at start-up rather than on the first request.
    ///
    /// Each call binds anew: state is kept per bound policy, never shared with another binding
    /// because of a name (two layers with one store and one policy name keep apart).
    ///
    /// # Errors
    /// [`ConfigError::UnsupportedByStore`] saying which tier and why.
    fn bind(&self, policy: &Policy) -> Result<Self::Bound, ConfigError>;

    /// Decides at once when the store can do so without waiting on I/O, as [`MemoryStore`]
    /// always can; `None` otherwise (the default), and callers then await
    /// [`check`](Self::check). Lets the layer skip the asynchronous machinery in the common
    /// case.
    fn check_sync(
        &self,
        bound: &Self::Bound,
        check: Check<'_>,
    ) -> Option<Result<Verdict<Self::Ticket>, StoreError>> {
        let _ = (bound, check);
        None
    }

    /// Decides one request, charging every tier when it is admitted.
    ///
    /// # Errors
    /// [`StoreError`] when the backend cannot decide (unreachable, timed out).
    fn check(
        &self,
        bound: &Self::Bound,
        check: Check<'_>,
    ) -> impl Future<Output = Result<Verdict<Self::Ticket>, StoreError>> + Send;

    /// Settles an admitted request at `cost` units instead of what it was charged: 0 cancels it
    /// (gives every tier its charge back), less refunds the difference, more charges the extra
    /// (unconditionally: it was already served).
    ///
    /// # Errors
    /// [`StoreError`] when the backend cannot be reached.
    fn settle(
        &self,
        bound: &Self::Bound,
        ticket: Self::Ticket,
        cost: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}
