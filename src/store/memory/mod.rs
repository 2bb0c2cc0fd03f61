//! The in-memory store: sharded tables behind read-write locks, bounded in keys, with idle keys
//! evicted by a background sweeper that stops when the store is dropped.

mod builder;
mod carry;
mod check;
mod compact;
mod registry;
mod settle;
mod sweeper;
mod table;
#[cfg(test)]
mod tests;

use std::fmt;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use builder::MemoryStoreBuilder;
use check::{decide_core, takes_slots};
use registry::Registry;
use table::{Core, KeyState, Shard, general_mut, lock};

use super::{Carry, Check, Store, Verdict};
use crate::algorithm::compiled::Kind;
use crate::algorithm::slots;
use crate::algorithm::{
    Charge, Charges, GcraStep, Mode, TierState, WholeGcra, budget, decide_with, in_units,
    whole_decision,
};
use crate::clock::{AnyClock, Clock, duration_to_nanos};
use crate::decision::Decision;
use crate::error::{ConfigError, StoreError};
use crate::key::Key;
use crate::policy::Policy;
use crate::quota::{Algorithm, TierKind};

/// How often a full shard may be scanned for idle keys to make room for a new key, in
/// nanoseconds of the store's clock (100 ms). Between scans, new keys of a full shard go to the
/// overflow bucket at once: scanning on every new key would let a flood of new keys make every
/// request cost a walk over the whole shard.
const FULL_RESCAN_NANOS: u64 = 100_000_000;

/// The default store: all state in this process.
///
/// - Safe for any number of tasks and threads: keys are spread over shards, each behind a
///   lock held only for one decision (never across an `.await`).
/// - Keys are held as 64-bit fingerprints (aHash, designed against hash flooding, with random
///   keys per store): a key's size does not matter, and a client cannot choose collisions. Two
///   keys share a bucket only if their fingerprints collide (about one chance in 2^25 that any
///   pair does among a million keys).
/// - State is kept by **policy** (name, algorithm, tiers) and key: every binding of one policy
///   ([`Store::bind`]) shares it, and it outlives them until its keys are idle (see
///   [one policy, one budget](super#one-policy-on-one-store-is-one-budget)).
/// - The common case, one GCRA tier whose emission interval (`period / count`) is a whole
///   number of nanoseconds, keeps **8 bytes of state per key** (the TAT) and decides without
///   taking the shard's write lock, by compare-and-swap, as governor does. Every other policy
///   keeps each tier's state and decides under the shard's write lock. Either way all tiers of a
///   request are decided together: all-or-nothing.
/// - Concurrency tiers count the slots each key holds; a slot is given back when its ticket is
///   released or dropped (so it never outlives its holder, and never expires), and a request
///   waiting for one ([`Limiter::reserve_within`](crate::Limiter::reserve_within)) is woken by
///   the release. Calendar tiers compute their windows with jiff, caching the current one.
/// - Idle keys (whose state equals a fresh one) are removed by a sweeper task that runs every
///   [`MemoryStoreBuilder::sweep_interval`] on the tokio runtime of the first check that stores
///   a key, holds only a weak reference, and ends when the store and its bound policies are
///   dropped. Eviction is lossless: only keys that would decide exactly like new ones go.
/// - At most [`MemoryStoreBuilder::max_keys`] keys are held. When full, a new key first makes
///   room by evicting idle keys of its shard (a shard is scanned at most every 100 ms, so a
///   flood of new keys cannot make every request walk it); if none are idle it is decided by
///   **one overflow bucket per policy**, shared by all keys that did not fit. Established
///   keys keep their own state, and an IP flood can neither grow memory nor obtain a fresh
///   bucket per request.
///
/// Clones share the same state.
///
/// ```
/// use tollgate::key::Key;
/// use tollgate::store::{Check, MemoryStore};
/// use tollgate::{Policy, Quota};
///
/// let store = MemoryStore::new();
/// let bound = store.bind_policy(&Policy::single("api", Quota::per_second(1)).unwrap());
/// assert!(store.check_now(&bound, Check::new(&Key::Global, 1)).decision.is_allowed());
/// assert!(!store.check_now(&bound, Check::new(&Key::Global, 1)).decision.is_allowed());
/// assert_eq!(store.len(), 1);
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("keys", &self.len())
            .field("max_keys", &self.inner.max_keys)
            .field("clock", &self.inner.clock)
            .finish_non_exhaustive()
    }
}

struct Inner {
    shards: Box<[Shard]>,
    /// Fingerprints keys (aHash with random keys).
    hasher: ahash::RandomState,
    clock: AnyClock,
    len: AtomicUsize,
    max_keys: usize,
    sweep_interval: Duration,
    sweeper: AtomicBool,
    registry: Mutex<Registry>,
    /// One reload at a time: each hands keys over shard by shard.
    rebinding: Mutex<()>,
}

/// A policy bound to a [`MemoryStore`] ([`Store::bind`]), which always decides in the store
/// that bound it. Every binding of the same policy (name, algorithm and tiers) to the same store
/// shares one state, which outlives them until its keys are idle and swept.
///
/// That state is the policy's table in every shard, the compact GCRA form when it applies, and
/// its overflow bucket: the next binding of the policy finds it.
///
/// ```
/// use tollgate::clock::FakeClock;
/// use tollgate::key::Key;
/// use tollgate::store::{Check, MemoryStore};
/// use tollgate::{Policy, Quota};
///
/// let store = MemoryStore::builder().clock(FakeClock::new()).build().unwrap();
/// let policy = Policy::single("api", Quota::per_minute(10)).unwrap();
/// let first = store.bind_policy(&policy);
/// store.check_now(&first, Check::new(&Key::text("alice"), 4));
/// // A second binding of the same policy shares its state.
/// let second = store.bind_policy(&policy);
/// assert_eq!(second.policy().name(), "api");
/// let d = store.check_now(&second, Check::new(&Key::text("alice"), 0)).decision;
/// assert_eq!(d.tiers()[0].remaining(), 6);
/// ```
pub struct MemoryPolicy {
    id: usize,
    core: Arc<Core>,
    inner: Arc<Inner>,
}

impl fmt::Debug for MemoryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryPolicy")
            .field("policy", &self.core.policy.name())
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Drop for MemoryPolicy {
    fn drop(&mut self) {
        self.inner.unbind(self.id);
    }
}

impl MemoryPolicy {
    /// The policy.
    #[must_use]
    pub fn policy(&self) -> &Policy {
        &self.core.policy
    }
}

/// What an admitted request was charged in a [`MemoryStore`] (see [`Store::Ticket`]).
///
/// A ticket that holds concurrency slots gives them back when it is dropped.
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
pub struct MemoryTicket(Box<Charged>);

#[derive(Debug)]
struct Charged {
    /// The key's fingerprint.
    fp: u64,
    cost: u64,
    /// Per tier: the instant, the units (slots for a concurrency tier), the log entry.
    charges: Charges,
    /// Charged to the overflow bucket of a full store.
    overflow: bool,
    /// Where the concurrency slots it still holds are, to give them back when dropped.
    holding: Option<Home>,
}

/// The binding a ticket's slots were taken under.
struct Home {
    inner: Arc<Inner>,
    core: Arc<Core>,
    id: usize,
}

impl fmt::Debug for Home {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Home").field("id", &self.id).finish_non_exhaustive()
    }
}

impl MemoryTicket {
    /// Units charged (of the check's `cost`; per tier, the last settled cost of each).
    #[must_use]
    pub fn cost(&self) -> u64 {
        self.0.cost
    }

    /// Whether it still holds concurrency slots.
    #[must_use]
    pub fn holds_slots(&self) -> bool {
        self.0.holding.is_some()
    }
}

impl Drop for MemoryTicket {
    fn drop(&mut self) {
        if let Some(home) = self.0.holding.take() {
            home.inner.settle(&home.core, home.id, &mut self.0, &|_| None, true);
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

/// aHash keyed with four random words from the standard library's per-process randomness (the
/// keys of its `HashMap`s), so no other source of randomness is needed.
fn random_hasher() -> ahash::RandomState {
    let std = RandomState::new();
    let [k0, k1, k2, k3] = [0u8, 1, 2, 3].map(|i| std.hash_one(i));
    ahash::RandomState::with_seeds(k0, k1, k2, k3)
}

impl MemoryStore {
    /// A store with the default clock and limits.
    #[must_use]
    pub fn new() -> Self {
        // The defaults are valid.
        Self::builder().assemble()
    }

    /// Starts configuring a store.
    pub fn builder() -> MemoryStoreBuilder {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        MemoryStoreBuilder {
            clock: AnyClock::default(),
            max_keys: 1_000_000,
            sweep_interval: Duration::from_secs(10),
            shards: (cores * 4).min(1 << 16),
        }
    }

    /// Binds `policy` to this store (the [`Store::bind`] of a store that never refuses one).
    ///
    /// A policy already bound to this store (same name, algorithm and tiers) shares that
    /// binding's state: one policy on one store is one budget, however many layers or limiters
    /// bind it. A policy of the same name with other tiers keeps its own.
    #[must_use]
    pub fn bind_policy(&self, policy: &Policy) -> MemoryPolicy {
        let (id, core, _) = self.inner.slot_for(policy);
        MemoryPolicy { id, core, inner: Arc::clone(&self.inner) }
    }

    /// Keys currently held (not counting the overflow buckets).
    #[must_use]
    pub fn len(&self) -> usize {
        self.inner.len.load(Ordering::Relaxed)
    }

    /// Whether no key is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes every idle key now, and the keys of dropped bindings; returns how many keys
    /// were removed. The sweeper calls this.
    pub fn sweep(&self) -> usize {
        self.inner.sweep()
    }

    /// Starts the idle-key sweeper on the current tokio runtime now, instead of on the
    /// runtime of the first check that stores a key; nothing outside a runtime, or when it
    /// runs already. For servers whose checks run on runtimes of their own.
    ///
    /// ```
    /// use tollgate::store::MemoryStore;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let store = MemoryStore::new();
    /// store.start_sweeping(); // here, not on whichever runtime checks first
    /// # }
    /// ```
    pub fn start_sweeping(&self) {
        self.inner.spawn_sweeper();
    }

    /// Decides at once: what [`Store::check`] answers, without a future. `bound` decides in the
    /// store that bound it.
    #[inline]
    #[must_use]
    pub fn check_now(&self, bound: &MemoryPolicy, check: Check<'_>) -> Verdict<MemoryTicket> {
        let inner = &bound.inner;
        let fp = inner.fingerprint(check.key);
        let now = inner.clock.now();
        match &bound.core.whole {
            Some(w) => inner.check_compact(bound, w, &check, fp, now, true),
            None => inner.check_general(bound, &check, fp, now, true),
        }
    }

    /// Gives back at once `cost` units charged to `key` by an admitted check of a policy of one
    /// GCRA tier decided in whole nanoseconds (the compact form; see [`Store::refund_sync`]),
    /// as settling its ticket at 0 would. A fixed-window policy (rate tiers only) is given the
    /// units back in each tier's current window, never below 0, and any other policy is left
    /// unchanged.
    ///
    /// A key whose check went to the overflow bucket of a full store has nothing of its own to
    /// give back.
    ///
    /// ```
    /// use tollgate::store::MemoryStore;
    /// use tollgate::{Algorithm, Limiter, Policy, Quota, key::Key};
    ///
    /// let policy = Policy::builder("w").algorithm(Algorithm::FixedWindow).tier("m", Quota::per_minute(5)).build().unwrap();
    /// let limiter = Limiter::new(policy);
    /// let k = Key::text("k");
    /// assert_eq!(limiter.check_now(&k, 5).tiers()[0].remaining(), 0);
    /// limiter.store().refund_now(limiter.bound(), &k, 2);
    /// assert_eq!(limiter.check_now(&k, 0).tiers()[0].remaining(), 2);
    /// ```
    pub fn refund_now(&self, bound: &MemoryPolicy, key: &Key, cost: u64) {
        if cost == 0 {
            return;
        }
        let policy = bound.policy();
        let charges = if bound.core.whole.is_some() {
            // A GCRA refund needs no instant: the TAT moves back by the cost.
            std::iter::once(Charge { at: 0, cost, id: 0 }).collect()
        } else if policy.algorithm() == Algorithm::FixedWindow
            && policy.tiers().iter().all(|t| t.kind() == TierKind::Rate)
        {
            // Given back to the window holding the instant the charge is dated.
            let now = bound.inner.clock.now();
            policy.tiers().iter().map(|_| Charge { at: now, cost, id: 0 }).collect()
        } else {
            return;
        };
        let fp = bound.inner.fingerprint(key);
        let mut ticket = Charged { fp, cost, charges, overflow: false, holding: None };
        bound.inner.settle(&bound.core, bound.id, &mut ticket, &|_| Some(0), false);
    }

    /// Settles at once; see [`Store::settle`].
    pub fn settle_now(&self, bound: &MemoryPolicy, mut ticket: MemoryTicket, cost: u64) {
        let home = ticket.0.holding.take();
        bound.inner.settle(&bound.core, bound.id, &mut ticket.0, &|_| Some(cost), home.is_some());
    }

    /// Settles single tiers at once; see [`Store::settle_tiers`].
    pub fn settle_tiers_now(
        &self,
        bound: &MemoryPolicy,
        ticket: &mut MemoryTicket,
        costs: &[(usize, u64)],
    ) {
        let target = |i: usize| costs.iter().rev().find(|(t, _)| *t == i).map(|(_, c)| *c);
        bound.inner.settle(&bound.core, bound.id, &mut ticket.0, &target, false);
    }
}

impl Store for MemoryStore {
    type Bound = MemoryPolicy;
    type Ticket = MemoryTicket;

    fn bind(&self, policy: &Policy) -> Result<MemoryPolicy, ConfigError> {
        Ok(self.bind_policy(policy))
    }

    fn rebind(
        &self,
        old: &MemoryPolicy,
        policy: &Policy,
        carry: Carry,
    ) -> Result<MemoryPolicy, ConfigError> {
        Ok(self.rebind_policy(old, policy, carry))
    }

    #[inline]
    fn check_sync(
        &self,
        bound: &MemoryPolicy,
        check: Check<'_>,
    ) -> Option<Result<Verdict<MemoryTicket>, StoreError>> {
        Some(Ok(self.check_now(bound, check)))
    }

    fn check(
        &self,
        bound: &MemoryPolicy,
        check: Check<'_>,
    ) -> impl Future<Output = Result<Verdict<MemoryTicket>, StoreError>> + Send {
        std::future::ready(Ok(self.check_now(bound, check)))
    }

    fn refunds_sync(&self, bound: &MemoryPolicy) -> bool {
        bound.core.whole.is_some()
    }

    fn refund_sync(&self, bound: &MemoryPolicy, key: &Key, cost: u64) {
        self.refund_now(bound, key, cost);
    }

    fn settle(
        &self,
        bound: &MemoryPolicy,
        ticket: MemoryTicket,
        cost: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.settle_now(bound, ticket, cost);
        std::future::ready(Ok(()))
    }

    fn settle_tiers(
        &self,
        bound: &MemoryPolicy,
        ticket: &mut MemoryTicket,
        costs: &[(usize, u64)],
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        self.settle_tiers_now(bound, ticket, costs);
        std::future::ready(Ok(()))
    }

    fn released(
        &self,
        bound: &MemoryPolicy,
        key: &Key,
    ) -> impl Future<Output = ()> + Send + 'static {
        let core = Arc::clone(carry::newest(&bound.core));
        let fp = bound.inner.fingerprint(key);
        // The epoch is read now, before the caller decides: a release between this call and
        // the first poll is not missed.
        let seen = core.waker(fp).map(|w| w.epoch.load(Ordering::Acquire));
        async move {
            let (Some(waker), Some(seen)) = (core.waker(fp), seen) else {
                return std::future::pending().await;
            };
            loop {
                let notified = waker.notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if waker.epoch.load(Ordering::Acquire) != seen {
                    return;
                }
                notified.await;
            }
        }
    }
}
