//! [`Limiter`]: a policy bound to a store, usable without the layer: to limit a code path, or to
//! check a frequency cap while choosing candidates and count only what is actually served.

use std::fmt;
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::decision::{Decision, Outcome};
use crate::error::{ConfigError, StoreError};
use crate::key::Key;
use crate::policy::Policy;
use crate::quota::{Priority, TierKind, Unit};
use crate::rejection::{RateLimited, Rejection, Surface};
use crate::store::{Carry, Check, MemoryStore, Store, Verdict};

/// The first wait between two tries of a request waiting for a concurrency slot on a store
/// that cannot say when one is released (it doubles up to [`MAX_POLL`]).
const FIRST_POLL: Duration = Duration::from_millis(2);

/// The longest wait between two such tries.
const MAX_POLL: Duration = Duration::from_millis(100);

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
/// drop(shown); // kept
/// let skipped = limiter.reserve(&user, 1).await.unwrap();
/// skipped.settle(0).await.unwrap(); // given back
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
    /// tier when admitted (concurrency slots are given back at once).
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

    /// Binds `policy` to this limiter's store in place of this limiter's policy, as a
    /// configuration reload does. Tiers that did not change keep each key's state where the
    /// store can ([`Store::rebind`]), and this limiter keeps working on the old policy.
    ///
    /// ```
    /// use tollgate::{Limiter, Policy, Quota, key::Key};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let v1 = Policy::builder("api")
    ///     .tier("second", Quota::per_second(10))
    ///     .tier("day", Quota::per_day(1_000))
    ///     .build()
    ///     .unwrap();
    /// let limiter = Limiter::new(v1);
    /// limiter.check(&Key::text("k"), 5).await.unwrap();
    /// // The daily quota is raised; the per-second tier is unchanged and keeps its state.
    /// let v2 = Policy::builder("api")
    ///     .tier("second", Quota::per_second(10))
    ///     .tier("day", Quota::per_day(5_000))
    ///     .build()
    ///     .unwrap();
    /// let reloaded = limiter.rebind(v2).unwrap();
    /// let d = reloaded.check(&Key::text("k"), 0).await.unwrap();
    /// assert_eq!((d.tiers()[0].remaining(), d.tiers()[1].remaining()), (5, 5_000));
    /// # }
    /// ```
    ///
    /// # Requests in flight
    ///
    /// On a [`MemoryStore`] the reload loses no charge: once the new limiter exists, what this
    /// one charges to a tier that did not change is charged where the new one counts it, so
    /// requests still in flight through this limiter and new ones through the new limiter
    /// share that tier's quota exactly (when this limiter is its policy's only binding in the
    /// store; see [`MemoryStore::rebind_policy`](crate::store::MemoryStore::rebind_policy)).
    ///
    /// # Errors
    /// What [`Store::rebind`] refuses.
    pub fn rebind(&self, policy: Policy) -> Result<Self, ConfigError> {
        self.rebind_with(policy, Carry::StartFull)
    }

    /// [`rebind`](Self::rebind), starting the tiers that changed as `carry` says: full
    /// ([`Carry::StartFull`]), or with each key's used fraction of the old tier
    /// ([`Carry::UsedFraction`], where the store can: a [`MemoryStore`]).
    ///
    /// # Errors
    /// What [`Store::rebind`] refuses.
    pub fn rebind_with(&self, policy: Policy, carry: Carry) -> Result<Self, ConfigError> {
        let store = self.inner.store.clone();
        let bound = store.rebind(&self.inner.bound, &policy, carry)?;
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

    /// Decides `cost` units for `key` now, charging every tier when admitted
    /// ([`Decision::is_allowed`] says whether it was). Concurrency slots it takes are given
    /// back at once (to hold them while the work runs, [`reserve`](Self::reserve)).
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot decide.
    pub async fn check(&self, key: &Key, cost: u64) -> Result<Decision, StoreError> {
        self.check_as(key, cost, Priority::Standard).await
    }

    /// Like [`check`](Self::check), for a request of class `priority`: tiers with a
    /// [`Reserve`](crate::Reserve) admit it only as far as they let its class (see there).
    ///
    /// ```
    /// use tollgate::{Limiter, Policy, Priority, Quota, Reserve, key::Key};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let policy = Policy::builder("api")
    ///     .tier("minute", Quota::per_minute(3))
    ///     .reserve("minute", Reserve::new().critical(1))
    ///     .build()
    ///     .unwrap();
    /// let limiter = Limiter::new(policy);
    /// let key = Key::text("k");
    /// for _ in 0..2 {
    ///     assert!(limiter.check_as(&key, 1, Priority::Standard).await.unwrap().is_allowed());
    /// }
    /// // The last unit is the critical reserve.
    /// assert!(!limiter.check_as(&key, 1, Priority::Standard).await.unwrap().is_allowed());
    /// assert!(limiter.check_as(&key, 1, Priority::Critical).await.unwrap().is_allowed());
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot decide.
    pub async fn check_as(
        &self,
        key: &Key,
        cost: u64,
        priority: Priority,
    ) -> Result<Decision, StoreError> {
        let verdict = self.decide(Check::new(key, cost).with_priority(priority)).await?;
        if let Some(ticket) = verdict.ticket {
            // Slots taken: given back before returning, so that the next check sees them free.
            let shared = &self.inner;
            if let Err(error) = shared.store.release(&shared.bound, ticket).await {
                tracing::warn!(%error, "tollgate: could not release concurrency slots");
            }
        }
        Ok(verdict.decision)
    }

    /// Like [`check`](Self::check), but a refusal is an error ([`Rejection::Limited`], or
    /// [`Rejection::Unavailable`] when the store cannot decide). With the `axum` feature a
    /// handler can return it as it is (`?`), as a 429 response.
    ///
    /// ```
    /// use axum::{Router, extract::State, routing::post};
    /// use tollgate::{Limiter, Policy, Quota, Rejection, key::Key};
    ///
    /// async fn send_sms(State(sms): State<Limiter>) -> Result<&'static str, Rejection> {
    ///     sms.enforce(&Key::Global, 1).await?; // refused: a 429 with Retry-After
    ///     Ok("sent")
    /// }
    ///
    /// let sms = Limiter::new(Policy::single("sms", Quota::per_minute(10)).unwrap());
    /// # #[cfg(feature = "axum")]
    /// let app: Router = Router::new().route("/sms", post(send_sms)).with_state(sms);
    /// ```
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
    /// [`Reservation`] keeps it when dropped and gives it back with
    /// [`settle(0)`](Reservation::settle).
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot decide.
    pub async fn reserve(&self, key: &Key, cost: u64) -> Result<Reservation<St>, StoreError> {
        self.reserve_with(Check::new(key, cost)).await
    }

    /// Reserves the earliest slot within `max_delay` (shaping): the decision's
    /// [`delay`](Decision::delay) says how long to wait before acting, and
    /// [`Reservation::wait`] waits for it. A full concurrency tier is waited for here, up to
    /// `max_delay` (see [`reserve_with`](Self::reserve_with)).
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot decide.
    pub async fn reserve_within(
        &self,
        key: &Key,
        cost: u64,
        max_delay: Duration,
    ) -> Result<Reservation<St>, StoreError> {
        self.reserve_with(Check::new(key, cost).shape(max_delay)).await
    }

    /// Decides `check` (its costs per tier, its shaping budget) and keeps the charge revocable,
    /// as the layer does for each request. The reservation always has a ticket when something
    /// was charged.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::store::{Check, MemoryStore};
    /// use tollgate::{Concurrency, Limiter, Policy, clock::TokioClock, key::Key};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let policy = Policy::builder("reports").concurrency("slots", Concurrency::new(1)).build().unwrap();
    /// let store = MemoryStore::builder().clock(TokioClock::new()).build().unwrap();
    /// let limiter = Limiter::with_store(policy, store).unwrap();
    /// let first = limiter.reserve(&Key::Global, 1).await.unwrap();
    /// let second = limiter.clone();
    /// let waiter = tokio::spawn(async move {
    ///     let check = Check::new(&Key::Global, 1).shape(Duration::from_secs(5));
    ///     let r = second.reserve_with(check).await.unwrap();
    ///     (r.decision().is_allowed(), tokio::time::Instant::now())
    /// });
    /// tokio::time::sleep(Duration::from_millis(300)).await;
    /// let released = tokio::time::Instant::now();
    /// first.release().await.unwrap();
    /// assert_eq!(waiter.await.unwrap(), (true, released));
    /// # }
    /// ```
    ///
    /// # Waiting for a concurrency slot
    ///
    /// When shaping (`check.max_delay` is set) and the policy has concurrency tiers, a request
    /// refused only because a concurrency tier is full (its rate and calendar tiers would admit
    /// it within what is left of the budget) waits for a slot and tries again, until the budget
    /// runs out: woken by the release on a [`MemoryStore`], polling every 2 ms to 100 ms
    /// (doubling) on a store that cannot tell ([`Store::released`]). The budget counts from the
    /// call, on tokio's clock; a reservation that then comes with a shaping delay has that
    /// much of the budget left at most. Without a slot by then, the last refusal is returned.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot decide.
    pub async fn reserve_with(&self, check: Check<'_>) -> Result<Reservation<St>, StoreError> {
        let check = check.with_ticket();
        let (Some(max), true) = (check.max_delay, self.policy().has_concurrency()) else {
            let verdict = self.decide(check).await?;
            return Ok(self.reservation(verdict));
        };
        let start = tokio::time::Instant::now();
        let mut poll = FIRST_POLL;
        loop {
            // Before deciding: a release between the decision and the wait is not missed.
            let released = self.inner.store.released(&self.inner.bound, check.key);
            let left = max.saturating_sub(start.elapsed());
            let verdict = self.decide(Check { max_delay: Some(left), ..check }).await?;
            if left.is_zero() || !self.waits_for_a_slot(&verdict.decision, left) {
                return Ok(self.reservation(verdict));
            }
            let nap = poll.min(left);
            first_of(released, tokio::time::sleep(nap)).await;
            poll = (poll * 2).min(MAX_POLL);
        }
    }

    /// Whether `decision` refused a request only for want of a concurrency slot: every other
    /// tier it violated would admit it within `left`.
    fn waits_for_a_slot(&self, decision: &Decision, left: Duration) -> bool {
        if decision.outcome() != Outcome::Limited {
            return false;
        }
        let tiers = self.policy().tiers();
        let mut slot = false;
        for i in decision.violated() {
            if tiers[i].kind() == TierKind::Concurrency {
                slot = true;
            } else if decision.tiers()[i].retry_after().is_none_or(|r| r > left) {
                return false;
            }
        }
        slot
    }

    /// Waits until `cost` units for `key` fit within `max_wait` and takes them, like
    /// [`until_ready`](Self::until_ready), but keeps the [`Reservation`]: for a policy with
    /// concurrency tiers, the slot is held until the reservation is released (or dropped).
    ///
    /// # Errors
    /// As [`until_ready`](Self::until_ready).
    pub async fn acquire(
        &self,
        key: &Key,
        cost: u64,
        max_wait: Duration,
    ) -> Result<Reservation<St>, Rejection> {
        let reservation =
            self.reserve_within(key, cost, max_wait).await.map_err(Rejection::Unavailable)?;
        if !reservation.decision().is_allowed() {
            let decision = reservation.decision().clone();
            return Err(Rejection::Limited(self.rate_limited(decision, Some(max_wait))));
        }
        let keep = reservation.cancel_on_drop;
        let mut reservation = reservation.cancel_on_drop().wait().await;
        reservation.cancel_on_drop = keep;
        Ok(reservation)
    }

    /// Waits until `cost` units for `key` fit, at most `max_wait`, and takes them (governor's
    /// `until_key_ready`). The earliest slot is reserved at once, so concurrent waiters queue up
    /// rather than stampede, and given back if the returned future is dropped before it comes.
    /// A full concurrency tier is waited for too, and its slot given back when this returns
    /// ([`acquire`](Self::acquire) holds it).
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
        Ok(reservation.decision().clone())
    }

    /// Decides at once when the store can.
    #[inline]
    pub(crate) fn check_sync(
        &self,
        check: Check<'_>,
    ) -> Option<Result<Verdict<St::Ticket>, StoreError>> {
        self.inner.store.check_sync(&self.inner.bound, check)
    }

    /// Whether [`refund_sync`](Self::refund_sync) gives back this policy's charges.
    #[inline]
    pub(crate) fn refunds_sync(&self) -> bool {
        self.inner.store.refunds_sync(&self.inner.bound)
    }

    /// Gives back at once `cost` units charged to `key` without a ticket (see
    /// [`Store::refund_sync`]).
    pub(crate) fn refund_sync(&self, key: &Key, cost: u64) {
        self.inner.store.refund_sync(&self.inner.bound, key, cost);
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

    /// The indices of the tiers counting `unit` (concurrency tiers count no unit).
    fn tiers_counting(&self, unit: Unit) -> impl Iterator<Item = usize> + '_ {
        self.policy()
            .tiers()
            .iter()
            .enumerate()
            .filter(move |(_, t)| t.unit() == unit && t.kind() != TierKind::Concurrency)
            .map(|(i, _)| i)
    }

    /// The refusal of `decision`; `budget` is the shaping budget it exceeded, if shaping.
    pub(crate) fn rate_limited(&self, decision: Decision, budget: Option<Duration>) -> RateLimited {
        RateLimited::new(decision, Arc::clone(&self.inner.surface), budget)
    }

    pub(crate) fn surface(&self) -> &Surface {
        &self.inner.surface
    }

    /// Settles a ticket of this limiter's store at `cost` ([`Store::settle`]).
    pub(crate) async fn settle(&self, ticket: St::Ticket, cost: u64) -> Result<(), StoreError> {
        self.inner.store.settle(&self.inner.bound, ticket, cost).await
    }
}

/// A decided request whose charge can still be given back or settled at another cost, and
/// which holds the concurrency slots it took until it is released. Made by
/// [`Limiter::reserve`] and its variants; dropped, it keeps its charge (see
/// [Dropping](#dropping)).
///
/// ```
/// use tollgate::clock::FakeClock;
/// use tollgate::store::{Check, MemoryStore};
/// use tollgate::{Concurrency, Limiter, Policy, Quota, Unit, key::Key};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let policy = Policy::builder("llm")
///     .tier("requests", Quota::per_minute(60))
///     .tier("tokens", Quota::per_minute(10_000).counting(Unit::Reported))
///     .concurrency("in-flight", Concurrency::new(2))
///     .build()
///     .unwrap();
/// // A clock that stands still, so nothing refills between the lines below.
/// let store = MemoryStore::builder().clock(FakeClock::new()).build().unwrap();
/// let limiter = Limiter::with_store(policy.clone(), store).unwrap();
/// let key = Key::text("alice");
/// let costs = policy.costs(1, None);
/// let r = limiter.reserve_with(Check::new(&key, 1).with_costs(&costs)).await.unwrap();
/// assert!(r.decision().is_allowed());
/// assert_eq!(r.decision().tiers()[2].remaining(), 1, "one slot taken");
/// // The handler reports 1,500 tokens; the response ends.
/// r.hold().finish(&[(Unit::Reported, 1_500)]);
/// let d = limiter.check(&key, 0).await.unwrap();
/// assert_eq!(d.tiers()[1].remaining(), 8_500);
/// assert_eq!(d.tiers()[2].remaining(), 2, "the slot is back");
/// # }
/// ```
///
/// # The life of a request
///
/// What the layer does for each request, as the example above:
///
/// 1. [`Limiter::reserve_with`] with the request's [costs](Policy::costs): a reservation
///    (it waits for a concurrency slot when shaping);
/// 2. [`wait`](Self::wait) for its shaping delay, then [`hold`](Self::hold) it while the
///    response is produced and streamed: a [`Held`] keeps the slots of a shared store
///    refreshed;
/// 3. when the response body ends, is dropped, or the handler panics:
///    [`Held::finish`] with what was counted (request and response bytes, reported tokens),
///    or just drop the [`Held`]: the slots are released and the estimates kept.
///
/// # Dropping
///
/// A reservation ends in one of three ways: dropped, it keeps its charge and releases its
/// slots (in memory at once, on Redis from a spawned task); [`release`](Self::release) does
/// the same and waits for the store; [`settle`](Self::settle) changes the charge (0 gives it
/// back) and releases. With [`cancel_on_drop`](Self::cancel_on_drop) set, dropping gives the
/// charge back instead, on a spawned task (so this needs a tokio runtime; without one the
/// charge is kept).
#[must_use = "a reservation keeps its charge when dropped; settle(0) gives it back"]
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

    /// Gives the charge back if this reservation is dropped (rather than released or settled).
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

    /// Keeps the charge, and releases the concurrency slots (in memory at once; on Redis from a
    /// spawned task, or when their time to live runs out without a runtime).
    #[deprecated(note = "drop the reservation (it keeps its charge), or await `release()`")]
    pub fn commit(self) {
        self.keep();
    }

    /// Keeps the charge and releases the slots, whatever `cancel_on_drop` says.
    pub(crate) fn keep(mut self) {
        self.ticket = None;
    }

    /// Whether this reservation may hold concurrency slots (admitted, with a ticket, under a
    /// policy with concurrency tiers).
    #[must_use]
    pub fn holds_slots(&self) -> bool {
        self.ticket.is_some() && self.limiter.policy().has_concurrency()
    }

    /// Releases the concurrency slots and keeps every other charge, waiting for the store;
    /// the hold is recorded for the tiers' typical hold.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot be reached (on Redis the release is then retried
    /// in the background until it lands or the slots' time to live runs out).
    pub async fn release(mut self) -> Result<(), StoreError> {
        match self.ticket.take() {
            Some(ticket) => {
                let shared = &self.limiter.inner;
                shared.store.release(&shared.bound, ticket).await
            }
            None => Ok(()),
        }
    }

    /// Settles single rate or calendar tiers and keeps holding the reservation. Each
    /// `(tier index, cost)` settles that tier at `cost` (see [`Store::settle_tiers`]), leaving
    /// the other tiers and the concurrency slots as they are. Settling again counts from the
    /// last settled cost.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot be reached (nothing is settled then).
    pub async fn settle_tiers(&mut self, costs: &[(usize, u64)]) -> Result<(), StoreError> {
        match self.ticket.as_mut() {
            Some(ticket) => {
                let shared = &self.limiter.inner;
                shared.store.settle_tiers(&shared.bound, ticket, costs).await
            }
            None => Ok(()),
        }
    }

    /// Settles every tier counting `unit` at `cost`: the bytes a body turned out to have, the
    /// tokens a handler reports. Nothing happens when no tier counts `unit`.
    ///
    /// # Errors
    /// As [`settle_tiers`](Self::settle_tiers).
    pub async fn settle_unit(&mut self, unit: Unit, cost: u64) -> Result<(), StoreError> {
        let costs: Vec<(usize, u64)> =
            self.limiter.tiers_counting(unit).map(|i| (i, cost)).collect();
        if costs.is_empty() {
            return Ok(());
        }
        self.settle_tiers(&costs).await
    }

    /// Extends the time to live of the concurrency slots (on a store whose slots expire:
    /// Redis); `Ok(false)` when a slot had expired already. Call it every
    /// [`refresh_every`](Self::refresh_every), or let [`hold`](Self::hold) do it.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot be reached.
    pub async fn refresh(&self) -> Result<bool, StoreError> {
        match self.ticket.as_ref() {
            Some(ticket) if self.holds_slots() => {
                let shared = &self.limiter.inner;
                shared.store.refresh(&shared.bound, ticket).await
            }
            _ => Ok(true),
        }
    }

    /// How often to [`refresh`](Self::refresh): a third of the shortest time to live, when this
    /// reservation holds slots on a store whose slots expire; `None` otherwise.
    #[must_use]
    pub fn refresh_every(&self) -> Option<Duration> {
        if !self.holds_slots() {
            return None;
        }
        let shared = &self.limiter.inner;
        shared.store.refresh_every(&shared.bound)
    }

    /// Holds the reservation while the work runs, for code that cannot await (a response
    /// body's `poll_frame`): the returned [`Held`] refreshes the slots every
    /// [`refresh_every`](Self::refresh_every) on a spawned task (only when there are slots
    /// to refresh), and settles and releases when finished or dropped.
    pub fn hold(self) -> Held<St> {
        let (Some(every), Ok(handle)) =
            (self.refresh_every(), tokio::runtime::Handle::try_current())
        else {
            return Held { state: HeldState::Here(Some(self)) };
        };
        let (tx, rx) = oneshot::channel::<Vec<(Unit, u64)>>();
        handle.spawn(keep(self, every, rx));
        Held { state: HeldState::Task(Some(tx)) }
    }

    /// Gives the charge back to every tier, and releases the concurrency slots.
    ///
    /// # Errors
    /// [`StoreError`] when the store cannot be reached.
    #[deprecated(note = "use `settle(0)`, which is the same")]
    pub async fn cancel(self) -> Result<(), StoreError> {
        self.settle(0).await
    }

    /// Settles at `cost` units instead of what was reserved (see [`Store::settle`]): 0 gives
    /// everything back, less refunds the difference, more charges the extra. Every rate and
    /// calendar tier is settled at `cost` (see [`settle_tiers`](Self::settle_tiers) for one
    /// tier at a time), and the concurrency slots are released.
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

/// A [`Reservation`] held while its request runs (see [`Reservation::hold`]): every method is
/// synchronous, so a response body can drive it from `poll_frame` and `Drop`.
///
/// Dropped, it releases the concurrency slots and keeps every charge as it stands (the
/// estimates of the tiers settled later).
///
/// ```
/// use tollgate::clock::FakeClock;
/// use tollgate::store::MemoryStore;
/// use tollgate::{Concurrency, Limiter, Policy, Quota, key::Key};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let policy = Policy::builder("jobs")
///     .tier("minute", Quota::per_minute(10))
///     .concurrency("in-flight", Concurrency::new(1))
///     .build()
///     .unwrap();
/// let store = MemoryStore::builder().clock(FakeClock::new()).build().unwrap();
/// let limiter = Limiter::with_store(policy, store).unwrap();
/// let key = Key::text("alice");
/// let held = limiter.reserve(&key, 1).await.unwrap().hold();
/// assert_eq!(limiter.check(&key, 0).await.unwrap().tiers()[1].remaining(), 0, "slot taken");
/// drop(held); // the client went away
/// let d = limiter.check(&key, 0).await.unwrap();
/// assert_eq!(d.tiers()[1].remaining(), 1, "the slot is back");
/// assert_eq!(d.tiers()[0].remaining(), 9, "the charge stays");
/// # }
/// ```
#[must_use = "dropping a Held releases its slots at once"]
pub struct Held<St: Store = MemoryStore> {
    state: HeldState<St>,
}

enum HeldState<St: Store> {
    /// No slots to refresh: the reservation itself.
    Here(Option<Reservation<St>>),
    /// A task holds it, refreshing its slots, until told to finish (or until this is dropped).
    Task(Option<oneshot::Sender<Vec<(Unit, u64)>>>),
}

impl<St: Store> fmt::Debug for Held<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let refreshing = matches!(self.state, HeldState::Task(_));
        f.debug_struct("Held").field("refreshing", &refreshing).finish_non_exhaustive()
    }
}

impl<St: Store> Held<St> {
    /// Settles each tier counting one of the units at the cost given with it (request bytes
    /// counted while the body streamed, response bytes sent, tokens the handler reported), then
    /// releases the concurrency slots. With a store that answers at once ([`MemoryStore`]) this
    /// happens before it returns; otherwise on a spawned task (without a tokio runtime, the
    /// settlement is skipped and the slots come back when their time to live runs out).
    pub fn finish(mut self, settled: &[(Unit, u64)]) {
        match &mut self.state {
            HeldState::Here(reservation) => {
                let Some(mut reservation) = reservation.take() else { return };
                let settled = settled.to_vec();
                run_or_spawn(async move {
                    settle_units(&mut reservation, &settled).await;
                    if let Err(error) = reservation.release().await {
                        tracing::warn!(%error, "tollgate: could not release concurrency slots");
                    }
                });
            }
            HeldState::Task(tx) => {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(settled.to_vec());
                }
            }
        }
    }
}

impl<St: Store> Drop for Held<St> {
    fn drop(&mut self) {
        if let HeldState::Here(Some(reservation)) = &mut self.state {
            reservation.cancel_on_drop = false;
        }
        // The reservation (or the task's channel) goes: the slots are released.
    }
}

/// Settles `reservation` at what was counted, logging failures.
async fn settle_units<St: Store>(reservation: &mut Reservation<St>, settled: &[(Unit, u64)]) {
    for &(unit, cost) in settled {
        if let Err(error) = reservation.settle_unit(unit, cost).await {
            tracing::warn!(%error, unit = unit.name(), "tollgate: could not settle a charge");
        }
    }
}

/// Holds `reservation`, refreshing its slots every `every`, until `finish` says what to settle
/// (or its sender is dropped); then releases.
async fn keep<St: Store>(
    mut reservation: Reservation<St>,
    every: Duration,
    mut finish: oneshot::Receiver<Vec<(Unit, u64)>>,
) {
    loop {
        match tokio::time::timeout(every, &mut finish).await {
            Err(_) => match reservation.refresh().await {
                Ok(true) => {}
                Ok(false) => tracing::warn!(
                    policy = reservation.limiter.policy().name(),
                    "tollgate: a concurrency lease expired before it was refreshed"
                ),
                Err(error) => tracing::warn!(%error, "tollgate: could not refresh a lease"),
            },
            Ok(settled) => {
                if let Ok(settled) = settled {
                    settle_units(&mut reservation, &settled).await;
                }
                if let Err(error) = reservation.release().await {
                    tracing::warn!(%error, "tollgate: could not release concurrency slots");
                }
                return;
            }
        }
    }
}

/// Runs `work` to completion now if it needs no waiting (a [`MemoryStore`]'s work), else on a
/// spawned task; dropped without a runtime.
pub(crate) fn run_or_spawn(work: impl Future<Output = ()> + Send + 'static) {
    let mut work = Box::pin(work);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    if work.as_mut().poll(&mut cx).is_ready() {
        return;
    }
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        handle.spawn(work);
    }
}

/// Waits for whichever of `a` and `b` finishes first.
async fn first_of(a: impl Future<Output = ()>, b: impl Future<Output = ()>) {
    let (mut a, mut b) = (pin!(a), pin!(b));
    std::future::poll_fn(|cx| {
        if a.as_mut().poll(cx).is_ready() || b.as_mut().poll(cx).is_ready() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
}
