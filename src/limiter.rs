//! [`Limiter`]: a policy and a store, usable without the layer — e.g. to check a frequency cap
//! while choosing candidates and count only what is actually served (SPEC §4, seed 002).

use std::fmt;
use std::time::Duration;

use crate::decision::Decision;
use crate::error::StoreError;
use crate::key::Key;
use crate::quota::Policy;
use crate::store::{Check, MemoryStore, Store, Ticket};

/// A policy bound to a store.
///
/// ```
/// use tollgate::{Limiter, Policy, Quota, key::Key};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let limiter = Limiter::new(Policy::single("ad-cap", Quota::per_day(3)).unwrap());
/// let user = Key::text("user:42");
/// // Reserve while choosing; only the impression actually served is kept.
/// let shown = limiter.reserve(&user, 1).await.unwrap();
/// assert!(shown.decision().is_allowed());
/// shown.commit();
/// let skipped = limiter.reserve(&user, 1).await.unwrap();
/// skipped.cancel().await.unwrap();
/// assert_eq!(limiter.check(&user, 0).await.unwrap().tiers()[0].remaining(), 2);
/// # }
/// ```
#[derive(Clone)]
pub struct Limiter<St = MemoryStore> {
    policy: Policy,
    store: St,
}

impl<St> fmt::Debug for Limiter<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limiter").field("policy", &self.policy.name()).finish_non_exhaustive()
    }
}

impl Limiter {
    /// A limiter over a new [`MemoryStore`].
    #[must_use]
    pub fn new(policy: Policy) -> Self {
        Self { policy, store: MemoryStore::new() }
    }
}

impl<St: Store> Limiter<St> {
    /// A limiter over `store`.
    #[must_use]
    pub fn with_store(policy: Policy, store: St) -> Self {
        Self { policy, store }
    }

    /// The policy.
    #[must_use]
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Decides `cost` units for `key` now, charging every tier when admitted.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot decide.
    pub async fn check(&self, key: &Key, cost: u64) -> Result<Decision, StoreError> {
        Ok(self.store.check(self.request(key, cost, None, false)).await?.decision)
    }

    /// Like [`check`](Self::check), but keeps the charge revocable: the returned
    /// [`Reservation`] is committed with [`Reservation::commit`] (or by dropping it) and given
    /// back with [`Reservation::cancel`].
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot decide.
    pub async fn reserve(&self, key: &Key, cost: u64) -> Result<Reservation<St>, StoreError> {
        self.reservation(key, cost, None).await
    }

    /// Reserves the earliest slot within `max_delay` (shaping): the decision's
    /// [`delay`](Decision::delay) says how long to wait before acting.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot decide.
    pub async fn reserve_within(
        &self,
        key: &Key,
        cost: u64,
        max_delay: Duration,
    ) -> Result<Reservation<St>, StoreError> {
        self.reservation(key, cost, Some(max_delay)).await
    }

    async fn reservation(
        &self,
        key: &Key,
        cost: u64,
        max_delay: Option<Duration>,
    ) -> Result<Reservation<St>, StoreError> {
        let verdict = self.store.check(self.request(key, cost, max_delay, true)).await?;
        Ok(Reservation {
            decision: verdict.decision,
            ticket: verdict.ticket,
            store: self.store.clone(),
            cancel_on_drop: false,
        })
    }

    fn request<'a>(
        &'a self,
        key: &'a Key,
        cost: u64,
        max_delay: Option<Duration>,
        reserve: bool,
    ) -> Check<'a> {
        Check { policy: &self.policy, key, cost, max_delay, reserve }
    }
}

/// A decided request whose charge can still be given back (SPEC §4).
///
/// Dropped without [`commit`](Self::commit) or [`cancel`](Self::cancel) it is committed,
/// unless [`cancel_on_drop`](Self::cancel_on_drop) was set; then the charge is given back on
/// a spawned task (so this needs a tokio runtime; without one the charge is kept).
#[must_use = "a reservation is committed when dropped; call cancel() to give it back"]
pub struct Reservation<St: Store> {
    decision: Decision,
    ticket: Option<Ticket>,
    store: St,
    cancel_on_drop: bool,
}

impl<St: Store> fmt::Debug for Reservation<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reservation").field("decision", &self.decision).finish_non_exhaustive()
    }
}

impl<St: Store> Reservation<St> {
    /// The decision. Nothing was charged when it is not allowed.
    #[must_use]
    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// Gives the charge back if this reservation is dropped uncommitted.
    pub fn cancel_on_drop(mut self) -> Self {
        self.cancel_on_drop = true;
        self
    }

    /// Keeps the charge.
    pub fn commit(mut self) {
        self.ticket = None;
    }

    /// Gives the charge back to every tier.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot be reached.
    pub async fn cancel(self) -> Result<(), StoreError> {
        self.settle(0).await
    }

    /// Settles at `cost` units instead of what was reserved (see [`Store::settle`]).
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot be reached.
    pub async fn settle(mut self, cost: u64) -> Result<(), StoreError> {
        match self.ticket.take() {
            Some(ticket) => self.store.settle(ticket, cost).await,
            None => Ok(()),
        }
    }
}

impl<St: Store> Drop for Reservation<St> {
    fn drop(&mut self) {
        if !self.cancel_on_drop {
            return;
        }
        if let (Some(ticket), Ok(handle)) =
            (self.ticket.take(), tokio::runtime::Handle::try_current())
        {
            handle.spawn(self.store.settle(ticket, 0));
        }
    }
}
