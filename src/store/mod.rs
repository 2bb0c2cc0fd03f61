//! Stores: where the per-key state lives (SPEC §8).
//!
//! [`MemoryStore`] is the default; `RedisStore` (feature `redis`) shares limits across a fleet.
//! The [`Store`] trait is public so users can add their own backend.

mod memory;
#[cfg(feature = "redis")]
mod redis;

use std::future::Future;
use std::time::Duration;

pub use memory::{DEFAULT_MAX_KEYS, DEFAULT_SWEEP_INTERVAL, MemoryStore, MemoryStoreBuilder};
#[cfg(feature = "redis")]
pub use redis::{
    BreakerState, DEFAULT_FAILURE_THRESHOLD, DEFAULT_OPEN_FOR, DEFAULT_PREFIX, DEFAULT_TIMEOUT,
    MAX_HORIZON, RedisStore, RedisStoreBuilder,
};

use crate::algorithm::Charges;
use crate::decision::Decision;
use crate::error::{ConfigError, StoreError};
use crate::key::Key;
use crate::quota::Policy;

/// One request to decide: which policy, which key, what it costs, and how long it may wait.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    /// The policy (its name namespaces the key in the store).
    pub policy: &'a Policy,
    /// The key being limited.
    pub key: &'a Key,
    /// Units this request consumes (0 consumes nothing and is always admitted).
    pub cost: u64,
    /// `None` to police (admit now or reject); `Some(d)` to shape: reserve the earliest
    /// conforming slot if it is at most `d` away.
    pub max_delay: Option<Duration>,
    /// Whether the caller may settle or cancel this request later (SPEC §4): only then does
    /// an admitted request come with a [`Ticket`]. Plain checks skip building one.
    pub reserve: bool,
}

/// A store's answer: the decision, and for an admitted request a [`Ticket`] that can give the
/// charge back or settle it at another cost (SPEC §4).
#[derive(Debug)]
pub struct Verdict {
    /// The decision.
    pub decision: Decision,
    /// Present when the request was admitted with a cost above 0 and [`Check::reserve`] was set.
    pub ticket: Option<Ticket>,
}

/// What an admitted request was charged, so that it can be cancelled or settled later.
///
/// Dropping a ticket keeps the charge (commits it). One pointer wide: deciding moves
/// [`Verdict`]s around, and most carry no ticket.
#[derive(Debug, Clone)]
pub struct Ticket {
    pub(crate) inner: Box<Charged>,
}

/// The contents of a [`Ticket`].
#[derive(Debug, Clone)]
pub(crate) struct Charged {
    pub(crate) policy: Policy,
    pub(crate) key: Key,
    pub(crate) cost: u64,
    pub(crate) charges: Charges,
    /// Charged to the overflow bucket of a full `MemoryStore`.
    pub(crate) overflow: bool,
    /// Charged to the local fallback of a remote store that was failing.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fallback: bool,
}

impl Ticket {
    /// A ticket for a custom store: `cost` units charged to `key` under `policy`.
    #[must_use]
    pub fn new(policy: Policy, key: Key, cost: u64) -> Self {
        Self::charged(policy, key, cost, Charges::new(), false)
    }

    pub(crate) fn charged(
        policy: Policy,
        key: Key,
        cost: u64,
        charges: Charges,
        overflow: bool,
    ) -> Self {
        Self { inner: Box::new(Charged { policy, key, cost, charges, overflow, fallback: false }) }
    }

    /// The policy charged.
    #[must_use]
    pub fn policy(&self) -> &Policy {
        &self.inner.policy
    }

    /// The key charged.
    #[must_use]
    pub fn key(&self) -> &Key {
        &self.inner.key
    }

    /// Units charged.
    #[must_use]
    pub fn cost(&self) -> u64 {
        self.inner.cost
    }
}

/// A backend that decides requests atomically over all tiers of a policy.
///
/// Implementations must decide all tiers of one check atomically: a rejected request charges no
/// tier, and concurrent checks on one key never both take the last unit. Futures are `'static`
/// so the layer can spawn settlements; keep shared state behind an `Arc`.
pub trait Store: Clone + Send + Sync + 'static {
    /// Whether this store can run `policy`; called when a layer is built, so a policy the store
    /// cannot represent is refused at start-up rather than on the first request.
    ///
    /// The default accepts every policy.
    ///
    /// # Errors
    /// [`ConfigError::UnsupportedByStore`] saying which tier and why.
    fn validate(&self, policy: &Policy) -> Result<(), ConfigError> {
        let _ = policy;
        Ok(())
    }

    /// Decides one request at once when the store can do so without waiting on I/O, as
    /// [`MemoryStore`] always can; `None` otherwise (the default), and the layer then awaits
    /// [`check`](Self::check). Lets the layer skip the asynchronous machinery for the common
    /// case.
    fn check_sync(&self, check: Check<'_>) -> Option<Result<Verdict, StoreError>> {
        let _ = check;
        None
    }

    /// Decides one request, charging every tier when it is admitted.
    ///
    /// # Errors
    /// [`StoreError`] when the backend cannot decide (unreachable, timed out, invalid policy).
    fn check(
        &self,
        check: Check<'_>,
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send + 'static;

    /// Settles an admitted request at `cost` units instead of what it was charged: 0 cancels it
    /// (gives every tier its charge back), less refunds the difference, more charges the extra
    /// (unconditionally: it was already served).
    ///
    /// # Errors
    /// [`StoreError`] when the backend cannot be reached.
    fn settle(
        &self,
        ticket: Ticket,
        cost: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'static;
}
