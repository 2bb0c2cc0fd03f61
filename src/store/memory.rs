//! The in-memory store: sharded tables behind read-write locks, bounded in keys, with idle keys
//! evicted by a background sweeper that stops when the store is dropped.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, Weak};
use std::time::Duration;

use super::{Check, Store, Ticket, Verdict};
use crate::algorithm::{
    Charge, Charges, Mode, TierState, Whole, WholeVerdict, budget, decide, decide_whole,
    whole_decision,
};
use crate::clock::{Clock, MonotonicClock, duration_to_nanos};
use crate::decision::Decision;
use crate::error::StoreError;
use crate::key::Key;
use crate::quota::{Algorithm, Policy};

/// Default hard cap on keys held: 1,000,000.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// Default interval of the idle-key sweeper: 10 s.
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(10);

/// How often a full shard may be scanned for idle keys to make room for a new key, in
/// nanoseconds of the store's clock (100 ms). Between scans, new keys of a full shard go to the
/// overflow bucket at once: scanning on every new key would let a flood of new keys make every
/// request cost a walk over the whole shard.
const FULL_RESCAN_NANOS: u64 = 100_000_000;

/// The default store: all state in this process.
///
/// - Safe for any number of tasks and threads: keys are spread over shards, each behind a
///   `std::sync::RwLock` held only for one decision (never across an `.await`).
/// - Keys are held as 64-bit fingerprints (aHash, designed against hash flooding, with random
///   keys per store): a key's size does not matter, and a client cannot choose collisions. Two
///   keys share a bucket only if their fingerprints collide (about one chance in 2^25 that any
///   pair does among a million keys).
/// - The common case — one GCRA tier whose emission interval (`period / count`) is a whole
///   number of nanoseconds — keeps **8 bytes of state per key** (the TAT) and decides without
///   taking the shard's write lock, by compare-and-swap, like governor. Every other policy keeps
///   each tier's state and decides under the shard's write lock. Either way all tiers of a
///   request are decided together: all-or-nothing.
/// - Idle keys (whose state equals a fresh one) are removed by a sweeper task that runs every
///   [`MemoryStoreBuilder::sweep_interval`] on the tokio runtime of the first check, holds only
///   a weak reference, and ends when the last clone of the store is dropped. Eviction is
///   lossless: only keys that would decide exactly like new ones are removed.
/// - At most [`MemoryStoreBuilder::max_keys`] keys are held. When full, a new key first makes
///   room by evicting idle keys of its shard (a shard is scanned at most every 100 ms, so a
///   flood of new keys cannot make every request walk it); if none are idle it is decided by
///   **one overflow bucket per policy**, shared by all keys that did not fit. Established keys
///   keep their own state, and an IP flood cannot grow memory nor obtain a fresh bucket per
///   request.
///
/// Policy names are namespaces: two different policies must not share a name in one store (a
/// policy rebuilt with other quotas under the same name starts its keys afresh).
///
/// Clones share the same state.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("keys", &self.len())
            .field("max_keys", &self.inner.max_keys)
            .finish_non_exhaustive()
    }
}

/// Hashes a fingerprint (already uniformly random) by using it as is.
#[derive(Default)]
struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `u64` fingerprints are hashed; fold anything else rather than panic.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type ByFingerprint<V> = HashMap<u64, V, BuildHasherDefault<Identity>>;

/// The keys of one policy in one shard.
struct Table {
    policy: Policy,
    states: States,
}

enum States {
    /// One GCRA tier with a whole-nanosecond interval: the TAT, updated by compare-and-swap
    /// under the shard's read lock.
    Whole(Whole, ByFingerprint<AtomicU64>),
    /// Anything else: every tier's state, updated under the shard's write lock.
    General(ByFingerprint<Box<[TierState]>>),
}

impl Table {
    fn new(policy: &Policy) -> Self {
        let whole = match policy.tiers() {
            [tier] if policy.algorithm() == Algorithm::Gcra => Whole::of(tier.rate),
            _ => None,
        };
        let states = match whole {
            Some(w) => States::Whole(w, ByFingerprint::default()),
            None => States::General(ByFingerprint::default()),
        };
        Self { policy: policy.clone(), states }
    }

    fn len(&self) -> usize {
        match &self.states {
            States::Whole(_, m) => m.len(),
            States::General(m) => m.len(),
        }
    }

    fn contains(&self, fp: u64) -> bool {
        match &self.states {
            States::Whole(_, m) => m.contains_key(&fp),
            States::General(m) => m.contains_key(&fp),
        }
    }

    /// Removes the idle keys; returns how many.
    fn evict_idle(&mut self, now: u64) -> usize {
        let before = self.len();
        match &mut self.states {
            States::Whole(_, m) => m.retain(|_, tat| *tat.get_mut() > now),
            States::General(m) => {
                let policy = &self.policy;
                m.retain(|_, states| !is_idle(policy, states, now));
            }
        }
        before - self.len()
    }
}

fn fresh(policy: &Policy, now: u64) -> Box<[TierState]> {
    policy.tiers().iter().map(|t| TierState::fresh(policy.algorithm(), t.rate, now)).collect()
}

fn is_idle(policy: &Policy, states: &[TierState], now: u64) -> bool {
    let alg = policy.algorithm();
    states.iter().zip(policy.tiers()).all(|(s, t)| s.is_idle(alg, t.rate, now))
}

/// One shard: a table per policy, and when it may next be scanned for room.
#[derive(Default)]
struct Shard {
    tables: Vec<Table>,
    next_scan: u64,
}

impl Shard {
    fn table(&self, policy: &Policy) -> Option<&Table> {
        self.tables.iter().find(|t| t.policy.same(policy))
    }

    /// The table of `policy`, created — or, for a policy reconfigured under the same name,
    /// started afresh — when needed. Returns it and how many keys were dropped.
    fn table_mut(&mut self, policy: &Policy) -> (&mut Table, usize) {
        let mut dropped = 0;
        let i = match self.tables.iter().position(|t| t.policy.same(policy)) {
            Some(i) => i,
            None => match self.tables.iter().position(|t| t.policy.name() == policy.name()) {
                Some(i) => {
                    dropped = self.tables[i].len();
                    self.tables[i] = Table::new(policy);
                    i
                }
                None => {
                    self.tables.push(Table::new(policy));
                    self.tables.len() - 1
                }
            },
        };
        (&mut self.tables[i], dropped)
    }
}

/// A policy's shared state for keys that arrived while the store was full.
struct Overflow {
    policy: Policy,
    states: Box<[TierState]>,
}

struct Inner {
    shards: Box<[RwLock<Shard>]>,
    /// Fingerprints keys (aHash with random keys).
    hasher: ahash::RandomState,
    clock: Arc<dyn Clock>,
    len: AtomicUsize,
    max_keys: usize,
    sweep_interval: Duration,
    sweeper: AtomicBool,
    overflow: Mutex<Vec<Overflow>>,
}

/// Configures a [`MemoryStore`].
#[derive(Clone)]
#[must_use]
pub struct MemoryStoreBuilder {
    clock: Arc<dyn Clock>,
    max_keys: usize,
    sweep_interval: Duration,
    shards: usize,
}

impl std::fmt::Debug for MemoryStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStoreBuilder")
            .field("max_keys", &self.max_keys)
            .field("sweep_interval", &self.sweep_interval)
            .field("shards", &self.shards)
            .finish_non_exhaustive()
    }
}

impl MemoryStoreBuilder {
    /// The clock (default [`MonotonicClock`]). Tests inject a
    /// [`FakeClock`](crate::clock::FakeClock), or a [`TokioClock`](crate::clock::TokioClock) to
    /// follow `tokio::time::pause()`.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Hard cap on keys held (default [`DEFAULT_MAX_KEYS`]); at least 1.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys.max(1);
        self
    }

    /// How often the sweeper removes idle keys (default [`DEFAULT_SWEEP_INTERVAL`]).
    pub fn sweep_interval(mut self, every: Duration) -> Self {
        self.sweep_interval = every.max(Duration::from_millis(1));
        self
    }

    /// Number of shards (default: 4 per available core, rounded up to a power of two; at most
    /// 65,536).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards.clamp(1, 1 << 16);
        self
    }

    /// Builds the store.
    #[must_use]
    pub fn build(self) -> MemoryStore {
        let shards = self.shards.next_power_of_two();
        MemoryStore {
            inner: Arc::new(Inner {
                shards: (0..shards).map(|_| RwLock::new(Shard::default())).collect(),
                hasher: random_hasher(),
                clock: self.clock,
                len: AtomicUsize::new(0),
                max_keys: self.max_keys,
                sweep_interval: self.sweep_interval,
                sweeper: AtomicBool::new(false),
                overflow: Mutex::new(Vec::new()),
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

/// Locks, recovering from poisoning: a panicking thread cannot leave the maps half-written (each
/// update is a single assignment or compare-and-swap after the decision).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl MemoryStore {
    /// A store with the default clock and limits.
    #[must_use]
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Starts configuring a store.
    pub fn builder() -> MemoryStoreBuilder {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        MemoryStoreBuilder {
            clock: Arc::new(MonotonicClock::new()),
            max_keys: DEFAULT_MAX_KEYS,
            sweep_interval: DEFAULT_SWEEP_INTERVAL,
            shards: cores * 4,
        }
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

    /// Removes every idle key now; returns how many were removed. The sweeper calls this.
    pub fn sweep(&self) -> usize {
        self.inner.sweep()
    }

    /// Decides synchronously (the [`Store::check`] future is this, already complete).
    ///
    /// # Errors
    /// Never fails today; the `Result` matches [`Store::check`].
    pub fn check_now(&self, check: Check<'_>) -> Result<Verdict, StoreError> {
        let inner = &*self.inner;
        let fp = inner.fingerprint(check.key);
        let now = inner.clock.now();
        // The common case, kept small enough to inline: a known key of a whole-nanosecond GCRA
        // policy, decided under the shard's read lock.
        {
            let shard = inner.shard(fp).read().unwrap_or_else(PoisonError::into_inner);
            if let Some(Table { states: States::Whole(w, map), .. }) = shard.table(check.policy) {
                if let Some(tat) = map.get(&fp) {
                    return Ok(check_whole(w, tat, &check, now));
                }
            }
        }
        Ok(self.check_slow(&check, fp, now))
    }

    /// Everything but the common case, under the shard's write lock.
    #[inline(never)]
    fn check_slow(&self, check: &Check<'_>, fp: u64, now: u64) -> Verdict {
        let mut stored = false;
        let verdict = self.inner.check(check, fp, now, &mut stored);
        if stored {
            Self::start_sweeper(&self.inner);
        }
        verdict
    }

    /// Settles synchronously; see [`Store::settle`].
    pub fn settle_now(&self, ticket: &Ticket, cost: u64) {
        self.inner.settle(ticket, cost);
    }

    /// Starts the sweeper on the current tokio runtime, once. Called when a key is stored: with
    /// no keys there is nothing to sweep, and the check's fast path stays free of it.
    fn start_sweeper(inner: &Arc<Inner>) {
        if inner.sweeper.load(Ordering::Relaxed) {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
        if inner.sweeper.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak: Weak<Inner> = Arc::downgrade(inner);
        let every = inner.sweep_interval;
        handle.spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { break };
                let removed = inner.sweep();
                tracing::trace!(removed, "tollgate: swept idle keys");
            }
        });
    }
}

fn mode(max_delay: Option<Duration>) -> Mode {
    max_delay.map_or(Mode::Police, |d| Mode::Shape(duration_to_nanos(d)))
}

/// A ticket, when the caller asked to be able to settle.
#[inline]
fn ticket(check: &Check<'_>, charges: impl FnOnce() -> Charges, overflow: bool) -> Option<Ticket> {
    (check.reserve && check.cost > 0).then(|| {
        Ticket::charged(check.policy.clone(), check.key.clone(), check.cost, charges(), overflow)
    })
}

/// The one charge of a single-tier request.
fn one(at: u64, cost: u64) -> impl FnOnce() -> Charges {
    move || Charges::from_elem(Charge { at, cost, id: 0 }, 1)
}

/// Decides on a whole-nanosecond GCRA TAT by compare-and-swap. The loop does only the GCRA
/// comparison, so that a retry under contention is short; the decision is built after it.
#[inline(always)]
fn check_whole(w: &Whole, tat: &AtomicU64, check: &Check<'_>, now: u64) -> Verdict {
    let budget = budget(mode(check.max_delay));
    let mut current = tat.load(Ordering::Acquire);
    let verdict = loop {
        let verdict = w.decide(current, now, check.cost, budget);
        let WholeVerdict::Admit { tat: new, .. } = verdict else { break verdict };
        match tat.compare_exchange_weak(current, new, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => break verdict,
            Err(actual) => current = actual,
        }
    };
    let decision = whole_decision(w, current, now, verdict, budget);
    let ticket = match verdict {
        WholeVerdict::Admit { at, .. } => ticket(check, one(at, check.cost), false),
        _ => None,
    };
    Verdict { decision, ticket }
}

/// Applies `f` to a TAT by compare-and-swap.
fn update(tat: &AtomicU64, f: impl Fn(u64) -> u64) {
    let _ = tat.fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| Some(f(t)));
}

impl Inner {
    fn fingerprint(&self, key: &Key) -> u64 {
        let mut h = self.hasher.build_hasher();
        key.feed(&mut h);
        h.finish()
    }

    /// The shard of a fingerprint: bits 40..56, apart from the low bits that index buckets
    /// inside a table and the top seven that tag them.
    fn shard(&self, fp: u64) -> &RwLock<Shard> {
        let i = usize::try_from(fp >> 40).unwrap_or(0) & (self.shards.len() - 1);
        &self.shards[i]
    }

    /// Decides under the shard's write lock; sets `stored` when a new key was stored.
    fn check(&self, check: &Check<'_>, fp: u64, now: u64, stored: &mut bool) -> Verdict {
        let mut shard = self.shard(fp).write().unwrap_or_else(PoisonError::into_inner);
        // Room is only needed for a new key (and checked before the table is borrowed).
        let known = shard.table(check.policy).is_some_and(|t| t.contains(fp));
        let room = known
            || self.len.load(Ordering::Relaxed) < self.max_keys
            || self.make_room(&mut shard, now);
        let (table, dropped) = shard.table_mut(check.policy);
        self.len.fetch_sub(dropped, Ordering::Relaxed);
        match &mut table.states {
            States::Whole(w, map) => {
                if let Some(tat) = map.get(&fp) {
                    return check_whole(w, tat, check, now);
                }
                let (decision, verdict) =
                    decide_whole(w, 0, now, check.cost, mode(check.max_delay));
                let WholeVerdict::Admit { tat, at, .. } = verdict else {
                    // A rejected request on a new key leaves no state.
                    return Verdict { decision, ticket: None };
                };
                if !room {
                    drop(shard);
                    return self.check_overflow(check, now);
                }
                map.insert(fp, AtomicU64::new(tat));
                self.len.fetch_add(1, Ordering::Relaxed);
                *stored = true;
                Verdict { decision, ticket: ticket(check, one(at, check.cost), false) }
            }
            States::General(map) => {
                let (decision, charges) = match map.get_mut(&fp) {
                    Some(states) => self.decide(check, states, now),
                    None => {
                        let mut states = fresh(check.policy, now);
                        let out = self.decide(check, &mut states, now);
                        if out.1.is_some() {
                            if !room {
                                drop(shard);
                                return self.check_overflow(check, now);
                            }
                            map.insert(fp, states);
                            self.len.fetch_add(1, Ordering::Relaxed);
                            *stored = true;
                        }
                        out
                    }
                };
                let ticket = charges.and_then(|c| ticket(check, || c, false));
                Verdict { decision, ticket }
            }
        }
    }

    fn decide(
        &self,
        check: &Check<'_>,
        states: &mut [TierState],
        now: u64,
    ) -> (Decision, Option<Charges>) {
        decide(check.policy, states, now, check.cost, mode(check.max_delay))
    }

    /// Whether a full shard could make room for a new key, evicting its idle keys (at most once
    /// per [`FULL_RESCAN_NANOS`]).
    fn make_room(&self, shard: &mut Shard, now: u64) -> bool {
        if now < shard.next_scan {
            return false;
        }
        shard.next_scan = now.saturating_add(FULL_RESCAN_NANOS);
        let removed: usize = shard.tables.iter_mut().map(|t| t.evict_idle(now)).sum();
        self.len.fetch_sub(removed, Ordering::Relaxed);
        removed > 0
    }

    fn check_overflow(&self, check: &Check<'_>, now: u64) -> Verdict {
        tracing::debug!(
            policy = check.policy.name(),
            "tollgate: key cap reached, using overflow bucket"
        );
        let mut overflow = lock(&self.overflow);
        let i = match overflow.iter().position(|o| o.policy.name() == check.policy.name()) {
            Some(i) => i,
            None => {
                overflow.push(Overflow {
                    policy: check.policy.clone(),
                    states: fresh(check.policy, now),
                });
                overflow.len() - 1
            }
        };
        let entry = &mut overflow[i];
        if !entry.policy.same(check.policy) {
            *entry = Overflow { policy: check.policy.clone(), states: fresh(check.policy, now) };
        }
        let (decision, charges) = self.decide(check, &mut entry.states, now);
        let ticket = charges.and_then(|c| ticket(check, || c, true));
        Verdict { decision, ticket }
    }

    fn settle(&self, ticket: &Ticket, cost: u64) {
        if cost == ticket.inner.cost {
            return;
        }
        let now = self.clock.now();
        let policy = &ticket.inner.policy;
        let apply = |states: &mut [TierState]| {
            let alg = policy.algorithm();
            for ((state, tier), charge) in
                states.iter_mut().zip(policy.tiers()).zip(&ticket.inner.charges)
            {
                if cost < ticket.inner.cost {
                    state.refund(alg, tier.rate, *charge, ticket.inner.cost - cost);
                } else {
                    state.charge(alg, tier.rate, now, charge.at.max(now), cost - ticket.inner.cost);
                }
            }
        };
        if ticket.inner.overflow {
            let mut overflow = lock(&self.overflow);
            if let Some(o) = overflow.iter_mut().find(|o| o.policy.same(policy)) {
                apply(&mut o.states);
            }
            return;
        }
        let fp = self.fingerprint(&ticket.inner.key);
        let shard = self.shard(fp);
        let whole = |w: &Whole, tat: &AtomicU64| {
            let at = ticket.inner.charges.first().map_or(now, |c| c.at).max(now);
            if cost < ticket.inner.cost {
                update(tat, |t| w.refund(t, ticket.inner.cost - cost));
            } else {
                update(tat, |t| w.charge(t, at, cost - ticket.inner.cost));
            }
        };
        {
            let shard = shard.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(Table { states: States::Whole(w, map), .. }) = shard.table(policy) {
                if let Some(tat) = map.get(&fp) {
                    whole(w, tat);
                    return;
                }
            }
        }
        let mut shard = shard.write().unwrap_or_else(PoisonError::into_inner);
        let Some(i) = shard.tables.iter().position(|t| t.policy.same(policy)) else { return };
        let extra = cost > ticket.inner.cost;
        let inserted = match &mut shard.tables[i].states {
            States::Whole(w, map) => match map.get(&fp) {
                Some(tat) => {
                    whole(w, tat);
                    false
                }
                // Evicted since: the extra is charged to a fresh state; a refund has nothing
                // left to give back.
                None if extra => {
                    let at = ticket.inner.charges.first().map_or(now, |c| c.at).max(now);
                    map.insert(fp, AtomicU64::new(w.charge(0, at, cost - ticket.inner.cost)));
                    true
                }
                None => false,
            },
            States::General(map) => match map.get_mut(&fp) {
                Some(states) => {
                    apply(states);
                    false
                }
                None if extra => {
                    let mut states = fresh(policy, now);
                    apply(&mut states);
                    map.insert(fp, states);
                    true
                }
                None => false,
            },
        };
        if inserted {
            self.len.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn sweep(&self) -> usize {
        let now = self.clock.now();
        let mut removed = 0;
        for shard in &self.shards {
            let mut shard = shard.write().unwrap_or_else(PoisonError::into_inner);
            removed += shard.tables.iter_mut().map(|t| t.evict_idle(now)).sum::<usize>();
        }
        self.len.fetch_sub(removed, Ordering::Relaxed);
        removed
    }
}

impl Store for MemoryStore {
    fn check_sync(&self, check: Check<'_>) -> Option<Result<Verdict, StoreError>> {
        Some(self.check_now(check))
    }

    fn check(
        &self,
        check: Check<'_>,
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send + 'static {
        std::future::ready(self.check_now(check))
    }

    fn settle(
        &self,
        ticket: Ticket,
        cost: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'static {
        self.settle_now(&ticket, cost);
        std::future::ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::*;
    use crate::clock::FakeClock;
    use crate::decision::Outcome;
    use crate::quota::Quota;

    fn ip(i: u32) -> Key {
        Key::Ip(IpAddr::V4(Ipv4Addr::from(i)))
    }

    fn check<'a>(policy: &'a Policy, key: &'a Key) -> Check<'a> {
        Check { policy, key, cost: 1, max_delay: None, reserve: false }
    }

    #[test]
    fn full_store_keeps_established_keys_and_shares_one_overflow_bucket() {
        let clock = FakeClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).max_keys(10).shards(4).build();
        let policy = Policy::single("p", Quota::per_hour(2)).unwrap();
        for i in 0..10 {
            assert!(store.check_now(check(&policy, &ip(i))).unwrap().decision.is_allowed());
        }
        assert_eq!(store.len(), 10);
        // 100 new keys: none is held; together they get the overflow bucket's 2 units.
        let admitted = (100..200)
            .filter(|i| store.check_now(check(&policy, &ip(*i))).unwrap().decision.is_allowed())
            .count();
        assert_eq!(admitted, 2);
        assert_eq!(store.len(), 10);
        // Established keys keep their own state: one unit left each.
        assert!(store.check_now(check(&policy, &ip(3))).unwrap().decision.is_allowed());
        assert!(!store.check_now(check(&policy, &ip(3))).unwrap().decision.is_allowed());
    }

    #[test]
    fn a_full_shard_is_scanned_for_room_at_most_every_100_ms() {
        let clock = FakeClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).max_keys(10).shards(1).build();
        let policy = Policy::single("p", Quota::new(1, Duration::from_millis(20))).unwrap();
        let allowed = |i| store.check_now(check(&policy, &ip(i))).unwrap().decision.is_allowed();
        for i in 0..10 {
            assert!(allowed(i));
        }
        // Full and nothing idle: scanned, then key 100 goes to the overflow bucket.
        assert!(allowed(100));
        assert_eq!(store.len(), 10);
        // 50 ms later every key is idle, but the shard was scanned 50 ms ago: overflow again
        // (the overflow bucket is idle too, so key 101 is admitted there, not stored).
        clock.advance(Duration::from_millis(50));
        assert!(allowed(101));
        assert_eq!(store.len(), 10);
        // 100 ms after the last scan, the next new key scans, evicts the ten idle keys and is
        // stored.
        clock.advance(Duration::from_millis(50));
        assert!(allowed(102));
        assert_eq!(store.len(), 1);
    }

    #[test]
    fn sweep_removes_only_idle_keys() {
        let clock = FakeClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let fast = Policy::single("fast", Quota::per_second(1)).unwrap();
        let slow = Policy::single("slow", Quota::per_hour(1)).unwrap();
        store.check_now(check(&fast, &ip(1))).unwrap();
        store.check_now(check(&slow, &ip(1))).unwrap();
        assert_eq!(store.sweep(), 0);
        clock.advance(Duration::from_secs(1));
        assert_eq!(store.sweep(), 1, "the 1/s key is back to full, the 1/h key is not");
        assert_eq!(store.len(), 1);
        assert!(!store.check_now(check(&slow, &ip(1))).unwrap().decision.is_allowed());
    }

    #[tokio::test(start_paused = true)]
    async fn sweeper_runs_on_its_interval_and_stops_with_the_store() {
        let store = MemoryStore::builder()
            .clock(crate::clock::TokioClock::new())
            .sweep_interval(Duration::from_secs(5))
            .build();
        let policy = Policy::single("p", Quota::per_second(1)).unwrap();
        store.check_now(check(&policy, &ip(1))).unwrap();
        assert_eq!(store.len(), 1);
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert_eq!(store.len(), 0);
        let weak = Arc::downgrade(&store.inner);
        drop(store);
        tokio::time::sleep(Duration::from_secs(11)).await;
        assert!(weak.upgrade().is_none(), "the sweeper holds no strong reference");
    }

    #[test]
    fn threads_never_over_admit() {
        let store = MemoryStore::new();
        let policy = Policy::single("p", Quota::per_hour(1000)).unwrap();
        let admitted = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        if store
                            .check_now(check(&policy, &Key::Global))
                            .unwrap()
                            .decision
                            .is_allowed()
                        {
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
        let clock = FakeClock::new();
        let store = MemoryStore::builder().clock(clock).build();
        let policy = Policy::single("p", Quota::per_hour(10)).unwrap();
        let key = ip(7);
        let c = Check { policy: &policy, key: &key, cost: 4, max_delay: None, reserve: true };
        let ticket = store.check_now(c).unwrap().ticket.unwrap();
        store.settle_now(&ticket, 9);
        let d = store.check_now(check(&policy, &key)).unwrap().decision;
        assert_eq!(d.tiers()[0].remaining(), 0);
        let ticket = store.check_now(Check { cost: 0, ..c }).unwrap();
        assert!(ticket.ticket.is_none(), "cost 0 charges nothing");
        let d = store.check_now(check(&policy, &key)).unwrap().decision;
        assert_eq!(d.outcome(), Outcome::Limited);
    }

    #[test]
    fn a_stale_ticket_cannot_cancel_an_entry_of_the_keys_next_life() {
        // Sliding-log entry ids restart when an idle key is evicted; a ticket from before must
        // not give back the entry that reuses its id.
        let clock = FakeClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let policy = Policy::builder("log")
            .algorithm(crate::quota::Algorithm::SlidingLog)
            .tier("t", Quota::per_second(1))
            .build()
            .unwrap();
        let key = Key::Global;
        let reserve = Check { policy: &policy, key: &key, cost: 1, max_delay: None, reserve: true };
        let stale = store.check_now(reserve).unwrap().ticket.unwrap();
        clock.advance(Duration::from_secs(1));
        assert_eq!(store.sweep(), 1, "idle: evicted, ids start over");
        assert!(store.check_now(reserve).unwrap().decision.is_allowed());
        store.settle_now(&stale, 0);
        assert!(!store.check_now(reserve).unwrap().decision.is_allowed(), "the new entry counts");
    }

    #[test]
    fn cost_above_capacity_on_a_new_key_leaves_no_state() {
        let store = MemoryStore::new();
        let policy = Policy::single("p", Quota::per_second(2)).unwrap();
        let c =
            Check { policy: &policy, key: &Key::Global, cost: 3, max_delay: None, reserve: false };
        let v = store.check_now(c).unwrap();
        assert_eq!(v.decision.outcome(), Outcome::CostExceedsCapacity);
        assert!(store.is_empty());
    }
}
