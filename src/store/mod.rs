//! Stores: where the per-key state lives.
//!
//! [`MemoryStore`] is the default and keeps state in the process; `RedisStore` (cargo feature
//! `redis`) shares it across a fleet through Redis, Redis Cluster or Valkey. The [`Store`] trait
//! is public so that other backends can be added.
//!
//! A store first **binds** a [`Policy`] ([`Store::bind`]): it validates it and prepares
//! everything a decision needs (tables, key prefixes, script arguments) once, when a
//! [`Limiter`](crate::Limiter) or [`RateLimitLayer`](crate::RateLimitLayer) is built. Each
//! request then passes the bound policy and a [`Check`] (key, cost or costs per tier, shaping
//! budget).
//!
//! # One policy on one store is one budget
//!
//! A store keeps state by **policy and key**, a policy being its name, algorithm and tiers:
//! every [`Limiter`](crate::Limiter) and layer that binds one policy to one store decides on the
//! same state, however many there are and whether they are built once or for each request, in
//! a [`MemoryStore`] as in a `RedisStore` (whose keys are named by the policy). A policy of the
//! same name with other tiers or another algorithm is another policy, with a state of its own.
//! A `MemoryStore` keeps a policy's state when its last binding is dropped, for the next one,
//! until its keys are idle and swept (as Redis keeps keys until their TTL).
//!
//! So to give each route its own budget, give each route a policy of its own name, or put the
//! route in the key (a tuple extractor such as `(PeerIp, RouteKey)`); two layers with the same
//! policy on one store share it, as clones of one layer do.
//!
//! An admitted request that took concurrency slots always comes with a ticket: dropping it, or
//! [`Store::release`], gives the slots back; [`Store::settle`] and [`Store::settle_tiers`]
//! settle its costs.
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
    BreakerState, Lease, LeaseStats, RedisPolicy, RedisStore, RedisStoreBuilder, RedisTicket,
    ServerInfo, ServerKind,
};
pub use memory::{MemoryPolicy, MemoryStore, MemoryStoreBuilder, MemoryTicket};

use crate::decision::Decision;
use crate::error::{ConfigError, StoreError};
use crate::key::Key;
use crate::policy::Policy;
use crate::quota::Priority;

/// Where a reload starts a rate or calendar tier whose definition changed ([`Store::rebind`],
/// [`Limiter::rebind_with`](crate::Limiter::rebind_with)), key by key. Tiers are matched by
/// name; a tier whose definition did not change (its penalty box aside) keeps each key's state
/// whatever the rule, and so do the slots held and the penalty boxes (see [`Store::rebind`]).
///
/// ```
/// use tollgate::store::Carry;
/// use tollgate::{Limiter, Policy, Quota, key::Key};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let doubled = Policy::single("api", Quota::per_hour(200)).unwrap();
/// for (carry, remaining) in [(Carry::UsedFraction, 140), (Carry::StartFull, 200)] {
///     let limiter = Limiter::new(Policy::single("api", Quota::per_hour(100)).unwrap());
///     limiter.check(&Key::text("k"), 30).await.unwrap(); // 30% of the hour's quota used
///     let reloaded = limiter.rebind_with(doubled.clone(), carry).unwrap();
///     assert_eq!(reloaded.check(&Key::text("k"), 0).await.unwrap().tiers()[0].remaining(), remaining);
/// }
/// # }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "config", derive(serde::Deserialize), serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum Carry {
    /// The changed tier starts full for every key, as if no request had been made (the
    /// default).
    #[default]
    StartFull,
    /// Each key keeps the fraction of the tier it had used: a key that had used `u` of the old
    /// capacity `c` has used `ceil(u * c' / c)` of the new capacity `c'` (at most `c'`), charged
    /// at the reload instant and given back as the new tier refills (a window or calendar
    /// tier: when its current window ends; a sliding log: one period after the reload). `u` is
    /// counted in whole units, as `RateLimit` reports what remains, so a key never gains more
    /// than it had left. A rate tier under another algorithm, and any tier under another time
    /// unit, counts as changed.
    /// Limits: what a key owes beyond the old capacity (a reported cost settled into debt, a
    /// shaped backlog) is not carried (`u` is at most `c`); `u` is taken at the reload instant,
    /// so what requests still going through the old binding charge to a changed tier after it
    /// stays there (unchanged tiers lose nothing); and a `MemoryStore` carries keys only while
    /// it has room for them beside the old binding's (`max_keys`), so size it for twice the
    /// keys you keep if you reload.
    #[cfg_attr(feature = "config", serde(rename = "carry_used_fraction"))]
    UsedFraction,
}

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
/// let upload = Check::new(&key, 1).with_costs(&[1, 52_000]);
/// assert_eq!(upload.costs, [1, 52_000]);
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Check<'a> {
    /// The key being limited.
    pub key: &'a Key,
    /// Units this request consumes (0 consumes nothing and is always admitted: a query).
    pub cost: u64,
    /// What the request costs on each tier, in the policy's tier order
    /// ([`Policy::costs`](crate::Policy::costs) builds them): for policies whose tiers count
    /// other units than requests, or hold concurrency slots. Tiers past the end of the slice
    /// take their [default cost](crate::Tier::default_cost) for `cost`; a policy whose tiers are
    /// all rates counting requests takes `cost` on every tier and ignores this. A tier of cost
    /// 0 is neither checked nor charged; when every tier costs 0 the check is a query.
    pub costs: &'a [u64],
    /// `None` to police (admit now or reject); `Some(d)` to shape: reserve the earliest
    /// conforming slot if it is at most `d` away.
    pub max_delay: Option<Duration>,
    /// Whether the caller may settle or cancel this request later: only then does an admitted
    /// request come with a ticket. Plain checks skip building one. (An admitted request that
    /// took concurrency slots always comes with one: the slots are held until it is released
    /// or dropped.)
    pub ticket: bool,
    /// The request's class ([`Priority::Standard`] unless set): what part of the capacity of
    /// tiers with a [`Reserve`](crate::Reserve) it may use. Tiers without one ignore it.
    pub priority: Priority,
}

impl<'a> Check<'a> {
    /// Polices `cost` units for `key`, without a ticket.
    #[must_use]
    pub const fn new(key: &'a Key, cost: u64) -> Self {
        Self { key, cost, costs: &[], max_delay: None, ticket: false, priority: Priority::Standard }
    }

    /// Gives the request's class (see [`priority`](Self::priority)).
    ///
    /// ```
    /// use tollgate::key::Key;
    /// use tollgate::store::Check;
    /// use tollgate::Priority;
    ///
    /// let key = Key::text("alice");
    /// assert_eq!(Check::new(&key, 1).with_priority(Priority::Critical).priority, Priority::Critical);
    /// ```
    #[must_use]
    pub const fn with_priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }

    /// Gives the cost of each tier (see [`costs`](Self::costs)).
    #[must_use]
    pub const fn with_costs(mut self, costs: &'a [u64]) -> Self {
        self.costs = costs;
        self
    }

    /// Shapes instead: reserves the earliest instant within `max_delay` at which every tier
    /// has room, charging every tier there (see [`Calendar`](crate::Calendar) for how far a
    /// calendar tier looks ahead).
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
/// ([`Check::ticket`]) and cost more than 0, or that took concurrency slots, a ticket to settle,
/// cancel or release it.
///
/// ```
/// use tollgate::clock::FakeClock;
/// use tollgate::key::Key;
/// use tollgate::store::{Check, MemoryStore};
/// use tollgate::{Policy, Quota};
///
/// let store = MemoryStore::builder().clock(FakeClock::new()).build().unwrap();
/// let bound = store.bind_policy(&Policy::single("api", Quota::per_minute(10)).unwrap());
/// let key = Key::text("alice");
/// let verdict = store.check_now(&bound, Check::new(&key, 4).with_ticket());
/// assert!(verdict.decision.is_allowed());
/// // The request used 1 unit, not the 4 estimated: settling gives 3 back.
/// store.settle_now(&bound, verdict.ticket.unwrap(), 1);
/// assert_eq!(store.check_now(&bound, Check::new(&key, 0)).decision.tiers()[0].remaining(), 9);
/// ```
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
/// A store wrapping another one (to count calls, say) delegates each method (the provided ones
/// too, or it loses what the inner store does better than the defaults):
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
///
///     async fn settle_tiers(&self, bound: &Self::Bound, ticket: &mut Self::Ticket,
///         costs: &[(usize, u64)]) -> Result<(), StoreError> {
///         self.inner.settle_tiers(bound, ticket, costs).await
///     }
///
///     fn released(&self, bound: &Self::Bound, key: &Key)
///         -> impl std::future::Future<Output = ()> + Send + 'static {
///         self.inner.released(bound, key)
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
    /// prepared ([`MemoryPolicy`], `RedisPolicy`).
    type Bound: Send + Sync + 'static;

    /// What an admitted request was charged, so that [`settle`](Self::settle) can give it back
    /// or charge more. Dropping a ticket keeps the charge, and gives back the concurrency slots
    /// it holds (as soon as the store can: at once in memory; from a spawned task on Redis,
    /// retried while Redis does not answer, until the slots' time to live runs out).
    type Ticket: Send + Sync + 'static;

    /// Validates `policy` for this store and prepares it. Called once, when a
    /// [`Limiter`](crate::Limiter) or layer is built, so that a policy the store cannot run is
    /// refused at start-up rather than on the first request.
    ///
    /// Binding a policy that is bound already (same name, algorithm and tiers) shares its state:
    /// one policy on one store is one budget (see the [module docs](self)). A store outside this
    /// crate must keep to this too.
    ///
    /// # Errors
    /// [`ConfigError::UnsupportedByStore`] saying which tier and why.
    fn bind(&self, policy: &Policy) -> Result<Self::Bound, ConfigError>;

    /// Binds `policy` to replace `old` (a configuration reload), carrying over each key's
    /// state, tier by tier, matched by name:
    ///
    /// | state | [`MemoryStore`] | `RedisStore` |
    /// |---|---|---|
    /// | a rate tier (every algorithm) or calendar tier, whatever unit it counts (requests, bytes, messages, reported units) | kept if the tier is unchanged (quota, calendar, reserve; its penalty box aside) under the same time unit and, for a rate tier, algorithm; else started as `carry` says ([`Carry`]) | kept if the algorithm, the time unit and each rate and calendar tier's count, period, burst, calendar and reserve are unchanged, in order (the state key's fingerprint); else every one starts full |
    /// | slots held by a concurrency tier | kept, whatever its `max` or time to live, if `old` is its policy's only binding | kept |
    /// | a penalty box: the block and the breaches counted | kept if the tier of that name still has a box | kept, as in memory |
    /// | blocks leased by this process (lease mode, `Lease`) | — | kept if the state keys and every tier's parameters are unchanged (a tier renamed) |
    ///
    /// So requests in flight under `old` hold their slots against the new `max` (a key holding
    /// more is refused until enough are released), and their release frees the new binding's
    /// slot. A blocked key stays blocked until its block ends: a changed block length, count or
    /// window applies from the next breach, and never moves a current block (kept as the
    /// instant it ends, so instances that reload at different moments agree on it, and no
    /// reload frees a key early). A tier that
    /// loses its box frees its keys, and one that changes kind or name starts afresh. On Redis
    /// slots and boxes are named by the policy, the key and the tier, so every instance of a
    /// fleet finds them whenever it reloads; each decides by its own configuration until then.
    ///
    /// A `policy` bound to the store already keeps the state it has (one policy, one budget):
    /// a `MemoryStore` adds only the blocks, breaches and slots held to it. The default binds
    /// afresh (every tier starts full whatever `carry` says).
    ///
    /// `old` stays valid: requests that began on it finish on it, under its policy. On a
    /// `MemoryStore` they lose no charge to the reload: when `old` is its policy's only
    /// binding, what it keeps is handed over to the new binding, and requests still going
    /// through `old` decide, charge, release and block on the new binding's state, atomically
    /// with its own requests, so an unchanged tier admits exactly its quota across any number
    /// of reloads ([`MemoryStore::rebind_policy`] says more).
    ///
    /// # Errors
    /// As [`bind`](Self::bind).
    fn rebind(
        &self,
        old: &Self::Bound,
        policy: &Policy,
        carry: Carry,
    ) -> Result<Self::Bound, ConfigError> {
        let _ = old;
        if carry != Carry::StartFull {
            tracing::warn!(
                policy = policy.name(),
                "tollgate: this store starts a reloaded policy full in every tier; it cannot carry the used fraction"
            );
        }
        self.bind(policy)
    }

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

    /// Whether [`refund_sync`](Self::refund_sync) gives back the charges of `bound`'s policy
    /// (default `false`). The layer then checks without a ticket when only the response's
    /// status may give a charge back (a `405`, `refund_if`), so an admitted request costs no
    /// allocation for it.
    fn refunds_sync(&self, bound: &Self::Bound) -> bool {
        let _ = bound;
        false
    }

    /// Gives back at once `cost` units that an admitted check of `key` charged without a
    /// ticket, where [`refunds_sync`](Self::refunds_sync) says the store can do so exactly
    /// without one; does nothing otherwise (the default). A refund never gives back more than
    /// the key has used.
    fn refund_sync(&self, bound: &Self::Bound, key: &Key, cost: u64) {
        let _ = (bound, key, cost);
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
    /// (unconditionally: it was already served). Every tier is settled at `cost`, and the
    /// concurrency slots the ticket holds are released.
    ///
    /// # Errors
    /// [`StoreError`] when the backend cannot be reached.
    fn settle(
        &self,
        bound: &Self::Bound,
        ticket: Self::Ticket,
        cost: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Settles single tiers and keeps the ticket: for each `(tier index, cost)`, that rate or
    /// calendar tier is settled at `cost` as [`settle`](Self::settle) would (0 gives its charge
    /// back, more charges the extra unconditionally), and the ticket remembers the new cost, so
    /// that a later settlement counts from it. Other tiers, and the concurrency slots, are left
    /// alone; indices out of range and concurrency tiers are ignored.
    ///
    /// The default refuses: a store that supports policies of several units implements it.
    ///
    /// # Errors
    /// [`StoreError`] when the backend cannot be reached (the ticket is then unchanged).
    fn settle_tiers(
        &self,
        bound: &Self::Bound,
        ticket: &mut Self::Ticket,
        costs: &[(usize, u64)],
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = (bound, ticket, costs);
        std::future::ready(Err(StoreError::backend("this store does not settle single tiers")))
    }

    /// Releases the concurrency slots the ticket holds and keeps every other charge. Dropping
    /// the ticket does the same without waiting for it (the default).
    ///
    /// # Errors
    /// [`StoreError`] when the backend cannot be reached (on Redis the release is then retried
    /// in the background until it lands or the slots' time to live runs out).
    fn release(
        &self,
        bound: &Self::Bound,
        ticket: Self::Ticket,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = bound;
        drop(ticket);
        std::future::ready(Ok(()))
    }

    /// Extends the concurrency slots the ticket holds by their full time to live; `Ok(false)`
    /// when a slot had expired already (it may have been taken by another request since). Stores whose slots do not expire answer `Ok(true)` (the default).
    ///
    /// # Errors
    /// [`StoreError`] when the backend cannot be reached.
    fn refresh(
        &self,
        bound: &Self::Bound,
        ticket: &Self::Ticket,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        let _ = (bound, ticket);
        std::future::ready(Ok(true))
    }

    /// How often holders of concurrency slots under `bound` should [`refresh`](Self::refresh)
    /// them: a third of the shortest time to live, on stores whose slots expire; `None` (the
    /// default) when they do not.
    fn refresh_every(&self, bound: &Self::Bound) -> Option<Duration> {
        let _ = bound;
        None
    }

    /// Resolves when a concurrency slot of `key` may have been released since this was called,
    /// so that a request waiting for one can try again. Stores that cannot tell never resolve
    /// (the default): waiters then poll, with a bounded backoff.
    fn released(
        &self,
        bound: &Self::Bound,
        key: &Key,
    ) -> impl Future<Output = ()> + Send + 'static {
        let _ = (bound, key);
        std::future::pending()
    }
}
