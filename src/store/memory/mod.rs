//! The in-memory store: sharded tables behind read-write locks, bounded in keys, with idle keys
//! evicted by a background sweeper that stops when the store is dropped.

mod carry;
mod compact;
mod registry;
mod settle;
mod sweeper;
mod table;

use std::fmt;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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

/// A policy bound to a [`MemoryStore`] ([`Store::bind`]): its table in every shard, the
/// compact GCRA form when it applies, and its overflow bucket, shared by every binding of the
/// same policy (name, algorithm and tiers) to the same store. The state outlives them: the next
/// binding of the policy finds it, until its keys are idle and swept.
///
/// It always decides in the store that bound it.
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

/// Configures a [`MemoryStore`]; see [`MemoryStore::builder`].
#[derive(Clone, Debug)]
#[must_use]
pub struct MemoryStoreBuilder {
    clock: AnyClock,
    max_keys: usize,
    sweep_interval: Duration,
    shards: usize,
}

impl MemoryStoreBuilder {
    /// The clock (default [`MonotonicClock`](crate::clock::MonotonicClock)). Tests inject a
    /// [`FakeClock`](crate::clock::FakeClock), or a [`TokioClock`](crate::clock::TokioClock)
    /// to follow `tokio::time::pause()`.
    ///
    /// A clock that can step back (a wall clock, a fake one) is handled as on the Redis store:
    /// each key of a policy with window, log or calendar tiers (or tiers of several kinds)
    /// remembers the instant of its last charge and decides at the later of now and that
    /// instant, so a step back never reopens a window; a refused check never moves it; a key
    /// whose state has become idle is forgotten with it. GCRA and the buckets only grow
    /// stricter when time goes back and decide at now. After any step back between checks
    /// both stores answer alike.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = AnyClock::new(clock);
        self
    }

    /// The clock, already recognised.
    #[cfg(feature = "redis")]
    pub(crate) fn any_clock(mut self, clock: AnyClock) -> Self {
        self.clock = clock;
        self
    }

    /// The store of the default settings and this builder's clock (never invalid).
    #[cfg(any(feature = "redis", feature = "testing"))]
    pub(crate) fn assembled(self) -> MemoryStore {
        self.assemble()
    }

    /// Hard cap on keys held (default 1,000,000); at least 1.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// How often the sweeper removes idle keys (default 10 s); at least 1 ms.
    pub fn sweep_interval(mut self, every: Duration) -> Self {
        self.sweep_interval = every;
        self
    }

    /// Number of shards, rounded up to a power of two (default: 4 per available core); 1 to
    /// 65,536.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards;
        self
    }

    /// Builds the store.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming `max_keys` (0), `sweep_interval` (under 1 ms) or
    /// `shards` (0 or more than 65,536).
    pub fn build(self) -> Result<MemoryStore, ConfigError> {
        let invalid = |setting, reason: &str| {
            Err(ConfigError::Invalid { setting, reason: reason.to_owned() })
        };
        if self.max_keys == 0 {
            return invalid("max_keys", "must be at least 1");
        }
        if self.sweep_interval < Duration::from_millis(1) {
            return invalid("sweep_interval", "must be at least 1 ms");
        }
        if !(1..=1 << 16).contains(&self.shards) {
            return invalid("shards", "must be between 1 and 65,536");
        }
        Ok(self.assemble())
    }

    /// The store these settings describe (already validated).
    fn assemble(self) -> MemoryStore {
        let shards = self.shards.clamp(1, 1 << 16).next_power_of_two();
        MemoryStore {
            inner: Arc::new(Inner {
                shards: (0..shards).map(|_| Shard::default()).collect(),
                hasher: random_hasher(),
                clock: self.clock,
                len: AtomicUsize::new(0),
                max_keys: self.max_keys.max(1),
                sweep_interval: self.sweep_interval,
                sweeper: AtomicBool::new(false),
                registry: Mutex::new(Registry::default()),
                rebinding: Mutex::new(()),
            }),
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
    /// GCRA tier decided in whole nanoseconds (the compact form; see [`Store::refund_sync`]):
    /// as settling its ticket at 0 would. A fixed-window policy (rate tiers only) is given the
    /// units back in each tier's current window, never below 0. Any other policy is left
    /// unchanged. A key whose check went to the overflow bucket of a full store has nothing of
    /// its own to give back.
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

/// Decides `check` on `key` under `core`'s policy at `now` (nanoseconds), or at the key's
/// clock guard when that is later (see [`KeyState::guard`]; an admission moves it), tier by
/// tier (a plain policy's tiers all take the check's cost).
#[inline]
fn decide_core(
    core: &Core,
    key: &mut KeyState,
    now: u64,
    check: &Check<'_>,
) -> (Decision, Option<Charges>) {
    let policy = &core.policy;
    let mode = mode(check.max_delay);
    let at = core.guarded(key.guard, now);
    let entries = core.guarded && key.iter().any(TierState::has_entries);
    let cost = |i: usize| policy.tier_cost(i, check.cost, check.costs);
    let (mut decision, mut charges) = decide_with(policy, key, at, cost, mode, check.priority);
    if !core.wakers.is_empty() {
        slots::fill(policy, &core.holds, &mut decision);
    }
    let units = |charges: &Charges| {
        let tiers = policy.tiers();
        charges.iter().zip(tiers).any(|(c, t)| c.cost > 0 && t.kind() != TierKind::Concurrency)
    };
    if let Some(charges) = charges.as_mut().filter(|_| at != now) {
        // A ticket's charges are stamped on the caller's clock, its delay after `now`, as the
        // Redis store stamps them (its guard lives in the server's script): slots taken alone
        // too, whose hold is measured from then.
        let shift = in_units(policy, at) - in_units(policy, now);
        for c in charges.iter_mut() {
            c.at = c.at.saturating_sub(shift);
        }
    }
    if charges.as_ref().is_some_and(|c| core.guarded && units(c)) {
        // Units charged to a rate or calendar tier move the guard; slots taken alone do not.
        key.guard = at;
    } else if entries {
        // Windows or entries that ended, pruned to nothing: the key is forgotten with its
        // guard, as the Redis store deletes a key whose pruned state is idle.
        core.forget_if_idle(key, now);
    }
    (decision, charges)
}

#[inline]
fn mode(max_delay: Option<Duration>) -> Mode {
    max_delay.map_or(Mode::Police, |d| Mode::Shape(duration_to_nanos(d)))
}

/// A ticket, when the caller asked to be able to settle.
#[inline]
fn ticket(
    check: &Check<'_>,
    fp: u64,
    charges: impl FnOnce() -> Charges,
    overflow: bool,
) -> Option<MemoryTicket> {
    (check.ticket && check.cost > 0).then(|| {
        MemoryTicket(Box::new(Charged {
            fp,
            cost: check.cost,
            charges: charges(),
            overflow,
            holding: None,
        }))
    })
}

/// Whether `charges` took concurrency slots under `policy`.
fn takes_slots(policy: &Policy, charges: &Charges) -> bool {
    policy
        .tiers()
        .iter()
        .zip(charges)
        .any(|(t, c)| matches!(t.kind, Kind::Concurrency(_)) && c.cost > 0)
}

/// The one charge of a single-tier request.
fn one(at: u64, cost: u64) -> impl FnOnce() -> Charges {
    move || Charges::from_elem(Charge { at, cost, id: 0 }, 1)
}

impl Inner {
    #[inline]
    fn fingerprint(&self, key: &Key) -> u64 {
        let mut h = self.hasher.build_hasher();
        key.feed(&mut h);
        h.finish()
    }

    /// The shard of a fingerprint: bits 40..56, apart from the low bits that index buckets
    /// inside a table and the top seven that tag them.
    #[inline]
    fn shard(&self, fp: u64) -> &Shard {
        &self.shards[self.shard_index(fp)]
    }

    #[inline]
    fn shard_index(&self, fp: u64) -> usize {
        usize::try_from(fp >> 40).unwrap_or(0) & (self.shards.len() - 1)
    }

    /// Whether there is room for one more key: below the cap, or (at most every
    /// [`FULL_RESCAN_NANOS`] per shard, and only when `may_scan`) after evicting the idle keys of
    /// `shard`. Takes the shard's locks itself: call it holding none.
    fn room(&self, shard: &Shard, now: u64, may_scan: bool) -> bool {
        if self.len.load(Ordering::Relaxed) < self.max_keys {
            return true;
        }
        if !may_scan || now < shard.next_scan.load(Ordering::Relaxed) {
            return false;
        }
        shard.next_scan.store(now.saturating_add(FULL_RESCAN_NANOS), Ordering::Relaxed);
        let removed = shard.evict_idle(now);
        self.len.fetch_sub(removed, Ordering::Relaxed);
        removed > 0
    }

    /// Decides on a compact (whole-nanosecond GCRA) table. Under the spin lock only the GCRA
    /// step and the TAT's update; the decision is built after.
    #[inline]
    fn check_compact(
        self: &Arc<Self>,
        bound: &MemoryPolicy,
        w: &WholeGcra,
        check: &Check<'_>,
        fp: u64,
        now: u64,
        may_scan: bool,
    ) -> Verdict<MemoryTicket> {
        let budget = budget(mode(check.max_delay));
        let shard = self.shard(fp);
        let mut tables = shard.compact.lock();
        let (before, step) = match tables.tat_mut(bound.id, fp) {
            Some(tat) => {
                let before = *tat;
                let step = w.decide(before, now, check.cost, budget);
                if let GcraStep::Admit { tat: new, .. } = step {
                    *tat = new;
                }
                (before, step)
            }
            // A binding replaced in a reload holds no key: it decides where its keys went.
            None if bound.core.moved(self.shard_index(fp)) => {
                drop(tables);
                return self.check_moved(bound, check, fp, now);
            }
            None => {
                let step = w.decide(0, now, check.cost, budget);
                // Only an admitted request stores a new key; a rejected one leaves no state.
                if let GcraStep::Admit { tat: new, .. } = step {
                    if self.len.load(Ordering::Relaxed) < self.max_keys {
                        tables.insert(bound.id, fp, new);
                        drop(tables);
                        self.len.fetch_add(1, Ordering::Relaxed);
                        self.start_sweeper();
                    } else {
                        drop(tables);
                        return if self.room(shard, now, may_scan) {
                            self.check_compact(bound, w, check, fp, now, false)
                        } else {
                            self.check_overflow(bound, check, fp, now)
                        };
                    }
                }
                (0, step)
            }
        };
        let decision = whole_decision(w, before, now, step, budget);
        let ticket = match step {
            GcraStep::Admit { at, .. } => ticket(check, fp, one(at, check.cost), false),
            _ => None,
        };
        Verdict { decision, ticket }
    }

    /// Decides on a general table, under the shard's mutex.
    #[inline(never)]
    fn check_general(
        self: &Arc<Self>,
        bound: &MemoryPolicy,
        check: &Check<'_>,
        fp: u64,
        now: u64,
        may_scan: bool,
    ) -> Verdict<MemoryTicket> {
        let core = &bound.core;
        let shard = self.shard(fp);
        let mut tables = lock(&shard.general);
        if core.moved(self.shard_index(fp)) {
            drop(tables);
            return self.check_moved(bound, check, fp, now);
        }
        let table = general_mut(&mut tables, bound.id, core);
        let (decision, charges) = match table.map.get_mut(&fp) {
            Some(states) => decide_core(core, states, now, check),
            None => {
                let mut states = core.fresh();
                let out = decide_core(core, &mut states, now, check);
                // Only an admitted request stores a new key; a rejected one leaves no state.
                if out.1.is_some() {
                    if self.len.load(Ordering::Relaxed) < self.max_keys {
                        table.map.insert(fp, states);
                        drop(tables);
                        self.len.fetch_add(1, Ordering::Relaxed);
                        self.start_sweeper();
                    } else {
                        drop(tables);
                        return if self.room(shard, now, may_scan) {
                            self.check_general(bound, check, fp, now, false)
                        } else {
                            self.check_overflow(bound, check, fp, now)
                        };
                    }
                }
                out
            }
        };
        let ticket = charges.and_then(|c| self.ticket_for(bound, check, fp, c, false));
        Verdict { decision, ticket }
    }

    /// The ticket of an admitted request of a general table: as [`ticket`] for a plain policy;
    /// otherwise when asked for and something was charged, and always when slots were taken.
    #[inline]
    fn ticket_for(
        self: &Arc<Self>,
        bound: &MemoryPolicy,
        check: &Check<'_>,
        fp: u64,
        charges: Charges,
        overflow: bool,
    ) -> Option<MemoryTicket> {
        let policy = &bound.core.policy;
        if policy.is_plain() {
            return ticket(check, fp, || charges, overflow);
        }
        let slots = takes_slots(policy, &charges);
        let wanted = check.ticket && charges.iter().any(|c| c.cost > 0);
        if !(slots || wanted) {
            return None;
        }
        let holding = slots.then(|| Home {
            inner: Arc::clone(self),
            core: Arc::clone(&bound.core),
            id: bound.id,
        });
        Some(MemoryTicket(Box::new(Charged { fp, cost: check.cost, charges, overflow, holding })))
    }

    #[cold]
    fn check_overflow(
        self: &Arc<Self>,
        bound: &MemoryPolicy,
        check: &Check<'_>,
        fp: u64,
        now: u64,
    ) -> Verdict<MemoryTicket> {
        let core = &bound.core;
        tracing::debug!(
            policy = core.policy.name(),
            "tollgate: key cap reached, using the overflow bucket"
        );
        let (decision, charges) = {
            let mut overflow = lock(&core.overflow);
            let states = overflow.get_or_insert_with(|| core.fresh());
            decide_core(core, states, now, check)
        };
        let ticket = charges.and_then(|c| self.ticket_for(bound, check, fp, c, true));
        Verdict { decision, ticket }
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

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::*;
    use crate::clock::FakeClock;
    use crate::decision::Outcome;
    use crate::quota::{Algorithm, Quota};

    fn ip(i: u32) -> Key {
        Key::Ip(IpAddr::V4(Ipv4Addr::from(i)))
    }

    fn store(clock: &FakeClock, max_keys: usize, shards: usize) -> MemoryStore {
        MemoryStore::builder()
            .clock(clock.clone())
            .max_keys(max_keys)
            .shards(shards)
            .build()
            .unwrap()
    }

    fn allowed(store: &MemoryStore, bound: &MemoryPolicy, key: &Key) -> bool {
        store.check_now(bound, Check::new(key, 1)).decision.is_allowed()
    }

    /// What remains of each tier of `bound` for `key`, by a query.
    fn remaining(store: &MemoryStore, bound: &MemoryPolicy, key: &Key) -> Vec<u64> {
        let d = store.check_now(bound, Check::new(key, 0)).decision;
        d.tiers().iter().map(crate::TierDecision::remaining).collect()
    }

    fn two_tiers(alg: Algorithm, hourly: u64) -> Policy {
        Policy::builder("p")
            .algorithm(alg)
            .tier("minute", Quota::per_minute(1_000))
            .tier("hour", Quota::per_hour(hourly))
            .build()
            .unwrap()
    }

    #[test]
    fn a_reload_carries_the_used_fraction_of_changed_tiers_for_every_algorithm() {
        for alg in Algorithm::ALL {
            let clock = FakeClock::new();
            clock.set(7_200_000_000_000); // on a window boundary: windows start with the test
            let store = store(&clock, 100, 2);
            let key = Key::text("k");
            let v1 = store.bind_policy(&two_tiers(alg, 100));
            assert!(store.check_now(&v1, Check::new(&key, 30)).decision.is_allowed(), "{alg:?}");
            assert_eq!(remaining(&store, &v1, &key), [970, 70], "{alg:?}");
            // Doubled: 30 of 100 used is 60 of 200; the unchanged tier keeps its state.
            let carried = store.rebind_policy(&v1, &two_tiers(alg, 200), Carry::UsedFraction);
            assert_eq!(remaining(&store, &carried, &key), [970, 140], "{alg:?}");
            // Lowered: 30% of 15 is 4.5, counted as 5 used.
            let lowered = store.rebind_policy(&v1, &two_tiers(alg, 15), Carry::UsedFraction);
            assert_eq!(remaining(&store, &lowered, &key), [970, 10], "{alg:?}");
            // The default starts the changed tier full.
            let full = store.rebind_policy(&v1, &two_tiers(alg, 200), Carry::StartFull);
            assert_eq!(remaining(&store, &full, &key), [970, 200], "{alg:?}");
            // Another key, never seen: full everywhere; and the old binding is untouched.
            assert_eq!(remaining(&store, &carried, &Key::text("new")), [1_000, 200], "{alg:?}");
            assert_eq!(remaining(&store, &v1, &key), [970, 70], "{alg:?}");
        }
    }

    #[test]
    fn a_carried_gcra_tier_refills_at_its_new_rate() {
        let clock = FakeClock::new();
        let store = store(&clock, 100, 2);
        let key = Key::text("k");
        // One GCRA tier: the compact form, on both sides.
        let v1 = store.bind_policy(&Policy::single("p", Quota::per_hour(100)).unwrap());
        assert!(store.check_now(&v1, Check::new(&key, 30)).decision.is_allowed());
        let v2 = Policy::single("p", Quota::per_hour(200)).unwrap();
        let carried = store.rebind_policy(&v1, &v2, Carry::UsedFraction);
        assert_eq!(remaining(&store, &carried, &key), [140]);
        // One unit comes back every 18 s (3,600 s / 200), not every 36 s.
        clock.advance(Duration::from_secs(18));
        assert_eq!(remaining(&store, &carried, &key), [141]);
        // Bound again while `carried` holds it, the same policy shares its state: one policy on
        // one store is one budget, and nothing is carried.
        let again = store.rebind_policy(&v1, &v2, Carry::StartFull);
        assert_eq!(remaining(&store, &again, &key), [141]);
        drop(again);
        // The same tier in a renamed policy keeps its TATs as they are.
        let renamed = Policy::builder("renamed").tier("p", Quota::per_hour(100)).build().unwrap();
        let kept = store.rebind_policy(&v1, &renamed, Carry::StartFull);
        assert_eq!(remaining(&store, &kept, &key), [70]);
        // From the compact form to general tables and back, matched by tier name.
        let wider = Policy::builder("p")
            .tier("p", Quota::per_hour(100))
            .tier("day", Quota::per_day(1_000))
            .build()
            .unwrap();
        let general = store.rebind_policy(&carried, &wider, Carry::UsedFraction);
        // 59 of 200 used: 29.5 of 100, counted as 30.
        assert_eq!(remaining(&store, &general, &key), [70, 1_000]);
        // (Another policy than `carried`'s, whose state the store keeps for it.)
        let doubled = Policy::builder("q").tier("p", Quota::per_hour(200)).build().unwrap();
        let back = store.rebind_policy(&general, &doubled, Carry::UsedFraction);
        assert_eq!(remaining(&store, &back, &key), [140]);
        // By default a changed tier starts full.
        let fresh = Policy::builder("r").tier("p", Quota::per_hour(200)).build().unwrap();
        let fresh = store.rebind_policy(&v1, &fresh, Carry::StartFull);
        assert_eq!(remaining(&store, &fresh, &key), [200]);
    }

    #[test]
    fn an_unchanged_tier_keeps_its_count_between_the_compact_form_and_general_tables() {
        let clock = FakeClock::new();
        let store = store(&clock, 100, 2);
        let key = Key::text("k");
        let hour = Policy::builder("p").tier("hour", Quota::per_hour(100)).build().unwrap();
        let both = Policy::builder("p")
            .tier("sec", Quota::per_second(1_000))
            .tier("hour", Quota::per_hour(100))
            .build()
            .unwrap();
        let v1 = store.bind_policy(&hour);
        assert!(store.check_now(&v1, Check::new(&key, 90)).decision.is_allowed());
        let added = store.rebind_policy(&v1, &both, Carry::StartFull);
        assert_eq!(remaining(&store, &added, &key), [1_000, 10]);
        let removed = store.rebind_policy(&added, &hour, Carry::StartFull);
        assert_eq!(remaining(&store, &removed, &key), [10]);
    }

    #[test]
    fn calendar_tiers_carry_their_used_fraction_and_concurrency_tiers_keep_their_slots() {
        let clock = FakeClock::new();
        let store = store(&clock, 100, 2);
        let key = Key::text("k");
        let policy = |max: u64, daily: u64| {
            Policy::builder("p")
                .concurrency("slots", crate::Concurrency::new(max))
                .calendar("daily", crate::Calendar::per_day(daily))
                .build()
                .unwrap()
        };
        let v1 = store.bind_policy(&policy(4, 100));
        let held = store.check_now(&v1, Check::new(&key, 1).with_costs(&[1, 30]).with_ticket());
        assert!(held.decision.is_allowed());
        assert_eq!(remaining(&store, &v1, &key), [3, 70]);
        let v2 = store.rebind_policy(&v1, &policy(8, 1_000), Carry::UsedFraction);
        // The slot held through v1 counts on v2, whatever its new max.
        assert_eq!(remaining(&store, &v2, &key), [7, 700]);
        // Its release frees v2's slot (which v1 decides on now too).
        drop(held);
        assert_eq!(remaining(&store, &v2, &key), [8, 700]);
        assert_eq!(remaining(&store, &v1, &key), [4, 70]);
    }

    #[test]
    fn full_store_keeps_established_keys_and_shares_one_overflow_bucket() {
        let clock = FakeClock::new();
        let store = store(&clock, 10, 4);
        let bound = store.bind_policy(&Policy::single("p", Quota::per_hour(2)).unwrap());
        for i in 0..10 {
            assert!(allowed(&store, &bound, &ip(i)));
        }
        assert_eq!(store.len(), 10);
        // 100 new keys: none is held; together they get the overflow bucket's 2 units.
        let admitted = (100..200).filter(|i| allowed(&store, &bound, &ip(*i))).count();
        assert_eq!(admitted, 2);
        assert_eq!(store.len(), 10);
        // Established keys keep their own state: one unit left each.
        assert!(allowed(&store, &bound, &ip(3)));
        assert!(!allowed(&store, &bound, &ip(3)));
    }

    #[test]
    fn a_full_shard_is_scanned_for_room_at_most_every_100_ms() {
        let clock = FakeClock::new();
        let store = store(&clock, 10, 1);
        let bound = store
            .bind_policy(&Policy::single("p", Quota::new(1, Duration::from_millis(20))).unwrap());
        for i in 0..10 {
            assert!(allowed(&store, &bound, &ip(i)));
        }
        // Full and nothing idle: scanned, then key 100 goes to the overflow bucket.
        assert!(allowed(&store, &bound, &ip(100)));
        assert_eq!(store.len(), 10);
        // 50 ms later every key is idle, but the shard was scanned 50 ms ago: overflow again
        // (the overflow bucket is idle too, so key 101 is admitted there, not stored).
        clock.advance(Duration::from_millis(50));
        assert!(allowed(&store, &bound, &ip(101)));
        assert_eq!(store.len(), 10);
        // 100 ms after the last scan, the next new key scans, evicts the ten idle keys and is
        // stored.
        clock.advance(Duration::from_millis(50));
        assert!(allowed(&store, &bound, &ip(102)));
        assert_eq!(store.len(), 1);
    }

    #[test]
    fn sweep_removes_only_idle_keys() {
        let clock = FakeClock::new();
        let store = store(&clock, 100, 4);
        let fast = store.bind_policy(&Policy::single("fast", Quota::per_second(1)).unwrap());
        let slow = store.bind_policy(&Policy::single("slow", Quota::per_hour(1)).unwrap());
        assert!(allowed(&store, &fast, &ip(1)));
        assert!(allowed(&store, &slow, &ip(1)));
        assert_eq!(store.sweep(), 0);
        clock.advance(Duration::from_secs(1));
        assert_eq!(store.sweep(), 1, "the 1/s key is back to full, the 1/h key is not");
        assert_eq!(store.len(), 1);
        assert!(!allowed(&store, &slow, &ip(1)));
    }

    #[test]
    fn bindings_keep_apart_whatever_their_names() {
        // Two layers on one store with the same policy name and other quotas: each keeps its
        // own state, exactly (the old per-name table made them wipe each other).
        let store = MemoryStore::builder().clock(FakeClock::new()).build().unwrap();
        let a = store.bind_policy(&Policy::single("api", Quota::per_hour(3)).unwrap());
        let b = store.bind_policy(&Policy::single("api", Quota::per_hour(5)).unwrap());
        let mut admitted = (0, 0);
        for _ in 0..10 {
            admitted.0 += usize::from(allowed(&store, &a, &Key::Global));
            admitted.1 += usize::from(allowed(&store, &b, &Key::Global));
        }
        assert_eq!(admitted, (3, 5));
    }

    #[test]
    fn a_dropped_bindings_keys_stay_for_its_policy_until_idle_then_its_slot_is_freed() {
        let clock = FakeClock::new();
        let store = store(&clock, 100, 4);
        let policy = Policy::single("p", Quota::per_hour(1)).unwrap();
        let first = store.bind_policy(&policy);
        for i in 0..5 {
            assert!(allowed(&store, &first, &ip(i)));
        }
        assert_eq!(store.len(), 5);
        drop(first);
        // The state is the store's: the next binding of the policy finds it.
        let second = store.bind_policy(&policy);
        assert_eq!(second.id, 0);
        assert_eq!(store.len(), 5);
        assert!(!allowed(&store, &second, &ip(0)));
        drop(second);
        // Idle an hour later: swept, and the slot is given up.
        clock.advance(Duration::from_secs(3_600));
        assert_eq!(store.sweep(), 5);
        // Another policy reuses it, after clearing it: its keys start fresh.
        let other = store.bind_policy(&Policy::single("q", Quota::per_hour(1)).unwrap());
        assert_eq!(other.id, 0);
        assert_eq!(store.len(), 0);
        assert!(allowed(&store, &other, &ip(0)));
    }

    #[test]
    fn one_policy_on_one_store_is_one_budget_however_often_it_is_bound() {
        let store = store(&FakeClock::new(), 100, 4);
        // A binding per request, each dropped after its request: 5 of 100.
        let hourly = Policy::single("api", Quota::per_hour(5)).unwrap();
        let admitted =
            (0..100).filter(|_| allowed(&store, &store.bind_policy(&hourly), &Key::Global)).count();
        assert_eq!(admitted, 5);
        // Two bindings alive at once, in general tables: one budget.
        let two = Policy::builder("api")
            .tier("minute", Quota::per_minute(1_000))
            .tier("hour", Quota::per_hour(5))
            .build()
            .unwrap();
        let (a, b) = (store.bind_policy(&two), store.bind_policy(&two));
        let admitted =
            (0..100).filter(|i| allowed(&store, if i % 2 == 0 { &a } else { &b }, &Key::Global));
        assert_eq!(admitted.count(), 5);
        // The same name with other tiers is another policy: its own budget.
        let other = store.bind_policy(&Policy::single("api", Quota::per_hour(3)).unwrap());
        assert_eq!((0..10).filter(|_| allowed(&store, &other, &Key::Global)).count(), 3);
    }

    #[test]
    fn a_replaced_binding_charges_its_unchanged_tiers_where_they_now_live() {
        let clock = FakeClock::new();
        let store = store(&clock, 100, 4);
        let key = Key::text("k");
        // The compact form, then general tables, then the compact form again.
        let daily = Policy::builder("p").tier("day", Quota::per_day(10)).build().unwrap();
        let both = Policy::builder("p")
            .tier("minute", Quota::per_minute(2))
            .tier("day", Quota::per_day(10))
            .build()
            .unwrap();
        let v1 = store.bind_policy(&daily);
        assert!(store.check_now(&v1, Check::new(&key, 2)).decision.is_allowed());
        let v2 = store.rebind_policy(&v1, &both, Carry::StartFull);
        // A request still going through v1 charges the daily tier that v2 decides on, and
        // sees v2's charges.
        assert!(store.check_now(&v1, Check::new(&key, 1)).decision.is_allowed());
        assert_eq!(remaining(&store, &v2, &key), [2, 7]);
        assert!(allowed(&store, &v2, &key));
        assert_eq!(remaining(&store, &v1, &key), [6]);
        // Through a second reload, both old bindings charge the newest; v2 keeps its own
        // per-minute tier (both units used now).
        let v3 = store.rebind_policy(&v2, &daily, Carry::StartFull);
        assert_ne!(v3.id, v1.id, "a replaced binding's state is no longer its policy's");
        assert!(allowed(&store, &v1, &key));
        assert!(allowed(&store, &v2, &key));
        assert_eq!(remaining(&store, &v3, &key), [4]);
        assert!(!allowed(&store, &v2, &key), "v2's own per-minute tier is spent");
        assert_eq!(remaining(&store, &v3, &key), [4], "a refused request charges nothing");
        // A key first seen through an old binding lands in the newest too.
        let other = Key::text("other");
        assert!(store.check_now(&v1, Check::new(&other, 4)).decision.is_allowed());
        assert_eq!(remaining(&store, &v3, &other), [6]);
        // A charge taken through v1 and cancelled is given back where it was taken.
        let ticket = store.check_now(&v1, Check::new(&key, 2).with_ticket()).ticket.unwrap();
        assert_eq!(remaining(&store, &v3, &key), [2]);
        store.settle_now(&v1, ticket, 0);
        assert_eq!(remaining(&store, &v3, &key), [4]);
        // Once the old bindings are dropped, the newest alone holds the policy's state.
        drop((v1, v2));
        assert_eq!(remaining(&store, &v3, &key), [4]);
        assert_eq!(remaining(&store, &store.bind_policy(&daily), &key), [4]);
    }

    #[test]
    fn a_policy_other_bindings_share_stays_theirs_when_one_of_them_is_rebound() {
        let store = store(&FakeClock::new(), 100, 4);
        let key = Key::Global;
        let daily = Policy::builder("p").tier("day", Quota::per_day(10)).build().unwrap();
        let both = Policy::builder("p")
            .tier("minute", Quota::per_minute(100))
            .tier("day", Quota::per_day(10))
            .build()
            .unwrap();
        let (a, b) = (store.bind_policy(&daily), store.bind_policy(&daily));
        assert!(store.check_now(&a, Check::new(&key, 2)).decision.is_allowed());
        let reloaded = store.rebind_policy(&a, &both, Carry::StartFull);
        assert_eq!(remaining(&store, &reloaded, &key), [100, 8]);
        // `a` and `b` keep sharing the daily policy's budget, apart from the new one's.
        assert!(store.check_now(&a, Check::new(&key, 1)).decision.is_allowed());
        assert_eq!(remaining(&store, &b, &key), [7]);
        assert_eq!(remaining(&store, &reloaded, &key), [100, 8]);
    }

    #[test]
    fn reloads_lose_no_charge_of_requests_still_deciding_through_the_old_binding() {
        // 1,000 requests on four threads, each through whichever binding is current when it
        // starts, while another thread reloads 200 times, adding and removing a per-minute
        // tier beside a daily tier of 500 that never changes: exactly 500 admitted.
        let daily = Policy::builder("api").tier("day", Quota::per_day(500)).build().unwrap();
        let both = Policy::builder("api")
            .tier("minute", Quota::per_minute(100_000))
            .tier("day", Quota::per_day(500))
            .build()
            .unwrap();
        let store = store(&FakeClock::new(), 1_000, 4);
        let current = Mutex::new(Arc::new(store.bind_policy(&daily)));
        let admitted = AtomicUsize::new(0);
        let load = || Arc::clone(&*lock(&current));
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..250 {
                        let bound = load();
                        std::thread::yield_now();
                        if allowed(&store, &bound, &Key::Global) {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
            s.spawn(|| {
                for i in 0..200 {
                    let next = if i % 2 == 0 { &both } else { &daily };
                    let new = Arc::new(store.rebind_policy(&load(), next, Carry::StartFull));
                    *lock(&current) = new;
                    std::thread::yield_now();
                }
            });
        });
        assert_eq!(admitted.load(Ordering::Relaxed), 500);
    }

    #[tokio::test(start_paused = true)]
    async fn sweeper_runs_on_its_interval_and_stops_with_the_store() {
        let store = MemoryStore::builder()
            .clock(crate::clock::TokioClock::new())
            .sweep_interval(Duration::from_secs(5))
            .build()
            .unwrap();
        let bound = store.bind_policy(&Policy::single("p", Quota::per_second(1)).unwrap());
        assert!(allowed(&store, &bound, &ip(1)));
        assert_eq!(store.len(), 1);
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert_eq!(store.len(), 0);
        let weak = Arc::downgrade(&store.inner);
        drop((store, bound));
        tokio::time::sleep(Duration::from_secs(11)).await;
        assert!(weak.upgrade().is_none(), "the sweeper holds no strong reference");
    }

    #[test]
    fn threads_never_over_admit() {
        let store = MemoryStore::new();
        let bound = store.bind_policy(&Policy::single("p", Quota::per_hour(1000)).unwrap());
        let admitted = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        if allowed(&store, &bound, &Key::Global) {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(admitted.load(Ordering::Relaxed), 1000);
    }

    #[test]
    fn settle_refunds_and_charges_extra() {
        let store = store(&FakeClock::new(), 100, 4);
        let bound = store.bind_policy(&Policy::single("p", Quota::per_hour(10)).unwrap());
        let key = ip(7);
        let c = Check::new(&key, 4).with_ticket();
        let ticket = store.check_now(&bound, c).ticket.unwrap();
        store.settle_now(&bound, ticket, 9);
        let d = store.check_now(&bound, Check::new(&key, 1)).decision;
        assert_eq!(d.tiers()[0].remaining(), 0);
        let query = store.check_now(&bound, Check::new(&key, 0).with_ticket());
        assert!(query.ticket.is_none(), "cost 0 charges nothing");
        let d = store.check_now(&bound, Check::new(&key, 1)).decision;
        assert_eq!(d.outcome(), Outcome::Limited);
    }

    #[test]
    fn a_stale_ticket_cannot_cancel_an_entry_of_the_keys_next_life() {
        // Sliding-log entry ids restart when an idle key is evicted; a ticket from before must
        // not give back the entry that reuses its id.
        let clock = FakeClock::new();
        let store = store(&clock, 100, 4);
        let policy = Policy::builder("log")
            .algorithm(Algorithm::SlidingLog)
            .tier("t", Quota::per_second(1))
            .build()
            .unwrap();
        let bound = store.bind_policy(&policy);
        let key = Key::Global;
        let reserve = Check::new(&key, 1).with_ticket();
        let stale = store.check_now(&bound, reserve).ticket.unwrap();
        clock.advance(Duration::from_secs(1));
        assert_eq!(store.sweep(), 1, "idle: evicted, ids start over");
        assert!(store.check_now(&bound, reserve).decision.is_allowed());
        store.settle_now(&bound, stale, 0);
        assert!(!store.check_now(&bound, reserve).decision.is_allowed(), "the new entry counts");
    }

    #[test]
    fn cost_above_capacity_on_a_new_key_leaves_no_state() {
        let store = MemoryStore::new();
        let bound = store.bind_policy(&Policy::single("p", Quota::per_second(2)).unwrap());
        let v = store.check_now(&bound, Check::new(&Key::Global, 3));
        assert_eq!(v.decision.outcome(), Outcome::CostExceedsCapacity);
        assert!(store.is_empty());
    }

    #[test]
    fn builder_refuses_out_of_range_settings_by_name() {
        let err = |b: MemoryStoreBuilder| match b.build() {
            Err(ConfigError::Invalid { setting, .. }) => setting,
            other => panic!("expected an error, got {other:?}"),
        };
        assert_eq!(err(MemoryStore::builder().max_keys(0)), "max_keys");
        assert_eq!(err(MemoryStore::builder().sweep_interval(Duration::ZERO)), "sweep_interval");
        assert_eq!(err(MemoryStore::builder().shards(0)), "shards");
        assert_eq!(err(MemoryStore::builder().shards((1 << 16) + 1)), "shards");
    }
}
