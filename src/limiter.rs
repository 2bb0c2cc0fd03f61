//! [`Limiter`]: a policy bound to a store, usable without the layer: to limit a code path, or to
//! check a frequency cap while choosing candidates and count only what is actually served.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::decision::Decision;
use crate::error::{ConfigError, StoreError};
use crate::key::Key;
use crate::quota::Policy;
use crate::rejection::{RateLimited, Rejection, Surface};
use crate::store::{Check, MemoryStore, Store, Verdict};

/// A policy bound to a store: the one place where requests are decided, by the layer and by
/// code that calls it directly.
///
/// Binding ([`Store::bind`]) happens once, when the limiter is made: an invalid policy for the
/// store is refused then, and each decision only does its own work. Clones share the binding
/// (and so the state).
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
pub struct Limiter<St: Store = MemoryStore> {
    inner: Arc<Shared<St>>,
}

struct Shared<St: Store> {
    store: St,
    bound: St::Bound,
    surface: Arc<Surface>,
}

impl<St: Store> Clone for Limiter<St> {
    fn clone(&self) -> Self {
        Self { inner: Arc::clone(&self.inner) }
    }
}

impl<St: Store> fmt::Debug for Limiter<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limiter").field("policy", &self.policy().name()).finish_non_exhaustive()
    }
}

impl Limiter {
    /// A limiter over a new [`MemoryStore`].
    #[must_use]
    pub fn new(policy: Policy) -> Self {
        let store = MemoryStore::new();
        let bound = store.bind_policy(&policy);
        Self::assemble(policy, store, bound)
    }
}

impl Limiter<MemoryStore> {
    /// Decides `cost` units for `key` at once (a [`MemoryStore`] never waits), charging every
    /// tier when admitted.
    #[inline]
    #[must_use]
    pub fn check_now(&self, key: &Key, cost: u64) -> Decision {
        self.inner.store.check_now(&self.inner.bound, Check::new(key, cost)).decision
    }
}

impl<St: Store> Limiter<St> {
    /// Binds `policy` to `store`.
    ///
    /// # Errors
    /// What [`Store::bind`] refuses, e.g. [`ConfigError::UnsupportedByStore`].
    pub fn with_store(policy: Policy, store: St) -> Result<Self, ConfigError> {
        let bound = store.bind(&policy)?;
        Ok(Self::assemble(policy, store, bound))
    }

    fn assemble(policy: Policy, store: St, bound: St::Bound) -> Self {
        let surface = Arc::new(Surface::new(&policy));
        Self { inner: Arc::new(Shared { store, bound, surface }) }
    }

    /// The policy.
    #[must_use]
    pub fn policy(&self) -> &Policy {
        &self.inner.surface.policy
    }

    /// The store.
    #[must_use]
    pub fn store(&self) -> &St {
        &self.inner.store
    }

    /// The policy as bound to the store, for calling the [`Store`] directly.
    #[must_use]
    pub fn bound(&self) -> &St::Bound {
        &self.inner.bound
    }

    /// Decides `cost` units for `key` now, charging every tier when admitted. The decision
    /// says whether it was ([`Decision::is_allowed`]).
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot decide.
    pub async fn check(&self, key: &Key, cost: u64) -> Result<Decision, StoreError> {
        Ok(self.decide(Check::new(key, cost)).await?.decision)
    }

    /// Like [`check`](Self::check), with a refusal as an error: `Ok` when admitted, else
    /// [`Rejection::Limited`] (or [`Rejection::Unavailable`] when the store cannot decide).
    /// With the `axum` feature a handler can return it as it is (`?`): it is a 429 response.
    ///
    /// # Errors
    /// The [`Rejection`].
    pub async fn enforce(&self, key: &Key, cost: u64) -> Result<Decision, Rejection> {
        let decision = self.check(key, cost).await.map_err(Rejection::Unavailable)?;
        if decision.is_allowed() {
            Ok(decision)
        } else {
            Err(Rejection::Limited(self.rate_limited(decision, None)))
        }
    }

    /// Like [`check`](Self::check), but keeps the charge revocable: the returned
    /// [`Reservation`] is committed with [`Reservation::commit`] (or by dropping it) and given
    /// back with [`Reservation::cancel`].
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot decide.
    pub async fn reserve(&self, key: &Key, cost: u64) -> Result<Reservation<St>, StoreError> {
        let verdict = self.decide(Check::new(key, cost).with_ticket()).await?;
        Ok(self.reservation(verdict))
    }

    /// Reserves the earliest slot within `max_delay` (shaping): the decision's
    /// [`delay`](Decision::delay) says how long to wait before acting, and
    /// [`Reservation::wait`] waits for it.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot decide.
    pub async fn reserve_within(
        &self,
        key: &Key,
        cost: u64,
        max_delay: Duration,
    ) -> Result<Reservation<St>, StoreError> {
        let verdict = self.decide(Check::new(key, cost).shape(max_delay).with_ticket()).await?;
        Ok(self.reservation(verdict))
    }

    /// Waits until `cost` units for `key` fit and takes them, like governor's
    /// `until_key_ready`: the earliest slot within `max_wait` is reserved at once (so concurrent
    /// waiters queue up rather than stampede) and slept through. Returns the decision when the
    /// slot comes; if the returned future is dropped before, the slot is given back.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::store::MemoryStore;
    /// use tollgate::{Limiter, Policy, Quota, clock::TokioClock, key::Key};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let store = MemoryStore::builder().clock(TokioClock::new()).build().unwrap();
    /// let limiter = Limiter::with_store(Policy::single("jobs", Quota::per_second(2)).unwrap(), store).unwrap();
    /// let start = tokio::time::Instant::now();
    /// for _ in 0..4 {
    ///     limiter.until_ready(&Key::Global, 1, Duration::from_secs(5)).await.unwrap();
    /// }
    /// // Two at once (the burst), then one every 500 ms.
    /// assert_eq!(start.elapsed(), Duration::from_secs(1));
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`Rejection::Limited`] when the units would not fit within `max_wait` (or never fit: a
    /// cost above a tier's capacity); [`Rejection::Unavailable`] when the store cannot decide.
    pub async fn until_ready(
        &self,
        key: &Key,
        cost: u64,
        max_wait: Duration,
    ) -> Result<Decision, Rejection> {
        self.until_ready_with_jitter(key, cost, max_wait, Duration::ZERO).await
    }

    /// [`until_ready`](Self::until_ready), then a further random wait of up to `jitter`
    /// (uniform), so that callers released together do not act in lockstep (governor's
    /// `Jitter`). The slot stays reserved (and is given back if the future is dropped) until the
    /// jittered instant.
    ///
    /// # Errors
    /// As [`until_ready`](Self::until_ready).
    pub async fn until_ready_with_jitter(
        &self,
        key: &Key,
        cost: u64,
        max_wait: Duration,
        jitter: Duration,
    ) -> Result<Decision, Rejection> {
        let reservation =
            self.reserve_within(key, cost, max_wait).await.map_err(Rejection::Unavailable)?;
        if !reservation.decision().is_allowed() {
            let decision = reservation.decision().clone();
            return Err(Rejection::Limited(self.rate_limited(decision, Some(max_wait))));
        }
        let mut reservation = reservation.cancel_on_drop().wait().await;
        if !jitter.is_zero() {
            let nanos = u64::try_from(jitter.as_nanos()).unwrap_or(u64::MAX);
            tokio::time::sleep(Duration::from_nanos(fastrand::u64(0..=nanos))).await;
        }
        reservation.cancel_on_drop = false;
        let decision = reservation.decision().clone();
        reservation.commit();
        Ok(decision)
    }

    /// Decides at once when the store can.
    #[inline]
    pub(crate) fn check_sync(
        &self,
        check: Check<'_>,
    ) -> Option<Result<Verdict<St::Ticket>, StoreError>> {
        self.inner.store.check_sync(&self.inner.bound, check)
    }

    /// Decides `check`.
    pub(crate) async fn decide(&self, check: Check<'_>) -> Result<Verdict<St::Ticket>, StoreError> {
        self.inner.store.check(&self.inner.bound, check).await
    }

    /// The reservation of a decided check.
    pub(crate) fn reservation(&self, verdict: Verdict<St::Ticket>) -> Reservation<St> {
        Reservation {
            limiter: self.clone(),
            decision: verdict.decision,
            ticket: verdict.ticket,
            cancel_on_drop: false,
        }
    }

    /// The refusal of `decision`; `budget` is the shaping budget it exceeded, if shaping.
    pub(crate) fn rate_limited(&self, decision: Decision, budget: Option<Duration>) -> RateLimited {
        RateLimited::new(decision, Arc::clone(&self.inner.surface), budget)
    }

    pub(crate) fn surface(&self) -> &Surface {
        &self.inner.surface
    }

    async fn settle(&self, ticket: St::Ticket, cost: u64) -> Result<(), StoreError> {
        self.inner.store.settle(&self.inner.bound, ticket, cost).await
    }
}

/// A decided request whose charge can still be given back or settled at another cost.
///
/// Dropped without [`commit`](Self::commit) or [`cancel`](Self::cancel) it is committed,
/// unless [`cancel_on_drop`](Self::cancel_on_drop) was set; then the charge is given back on
/// a spawned task (so this needs a tokio runtime; without one the charge is kept).
#[must_use = "a reservation is committed when dropped; call cancel() to give it back"]
pub struct Reservation<St: Store = MemoryStore> {
    limiter: Limiter<St>,
    decision: Decision,
    ticket: Option<St::Ticket>,
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

    /// Waits until the reserved slot ([`Decision::delay`], zero when policing). If the
    /// returned future is dropped before the slot, the charge is given back (a shaped request
    /// whose client went away frees its slot for the next one).
    pub async fn wait(mut self) -> Self {
        let delay = self.decision.delay();
        if delay.is_zero() {
            return self;
        }
        let keep = self.cancel_on_drop;
        self.cancel_on_drop = true;
        tokio::time::sleep(delay).await;
        self.cancel_on_drop = keep;
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

    /// Settles at `cost` units instead of what was reserved (see [`Store::settle`]): 0 gives
    /// everything back, less refunds the difference, more charges the extra.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot be reached.
    pub async fn settle(mut self, cost: u64) -> Result<(), StoreError> {
        match self.ticket.take() {
            Some(ticket) => self.limiter.settle(ticket, cost).await,
            None => Ok(()),
        }
    }
}

impl<St: Store> Drop for Reservation<St> {
    fn drop(&mut self) {
        if !self.cancel_on_drop {
            return;
        }
        let Some(ticket) = self.ticket.take() else { return };
        let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
        let limiter = self.limiter.clone();
        tracing::debug!(
            policy = limiter.policy().name(),
            "tollgate: reservation dropped; charge given back"
        );
        handle.spawn(async move {
            if let Err(error) = limiter.settle(ticket, 0).await {
                tracing::warn!(%error, "tollgate: could not give a dropped reservation back");
            }
        });
    }
}
