//! The tables of one shard: per policy (table slot), the state of each key, by fingerprint.
//!
//! Two kinds, each behind its own lock:
//! - **compact** tables ([`Compact`]), for one GCRA tier whose emission interval is a whole
//!   number of nanoseconds: 8 bytes of state per key (the TAT), under a spin lock held for a
//!   handful of instructions. Taking it is the decision's only atomic read-modify-write: the unlock is a
//!   plain store and the TAT is read and written under the lock, where a read-write lock plus a
//!   compare-and-swap (governor's keyed state) costs three.
//! - **general** tables, for everything else: every tier's state, under a mutex.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use spinning_top::Spinlock;
use spinning_top::guard::SpinlockGuard;

use super::compact::Compact;
use crate::algorithm::slots::Holds;
use crate::algorithm::{TierState, WholeGcra, boxes_idle, fresh_boxes, in_units};
use crate::policy::Policy;

/// Hashes a fingerprint (already uniformly random) by using it as is.
#[derive(Default)]
pub(super) struct Identity(u64);

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

pub(super) type ByFingerprint<V> = HashMap<u64, V, BuildHasherDefault<Identity>>;

/// What a bound policy needs to decide, shared by its [`MemoryPolicy`](super::MemoryPolicy) and
/// its general tables (which evict with it).
pub(super) struct Core {
    pub(super) policy: Policy,
    /// One GCRA tier whose emission interval is a whole number of nanoseconds: the compact
    /// representation applies.
    pub(super) whole: Option<WholeGcra>,
    /// Whether a key keeps a clock guard ([`KeyState::guard`]): every policy but a plain one
    /// of GCRA or buckets, which only grow stricter when the clock steps back. As the Redis
    /// store decides.
    pub(super) guarded: bool,
    /// The shared state of keys that arrived while the store was full.
    pub(super) overflow: Mutex<Option<KeyState>>,
    /// The typical hold of each concurrency tier.
    pub(super) holds: Holds,
    /// Wakes requests waiting for a concurrency slot, by fingerprint (empty for a policy
    /// without concurrency tiers).
    pub(super) wakers: Box<[Waker]>,
    /// How many shards (the first ones, in order) have handed their keys' unchanged tiers over
    /// to [`next`](Self::next): in those shards this binding decides those tiers on its
    /// successor's state. Read under the shard's locks, which the hand-over holds.
    pub(super) moved: AtomicUsize,
    /// The binding that replaced this one in a reload, and which of its tiers keep this one's.
    pub(super) next: OnceLock<Next>,
}

/// The binding that replaced another one ([`Core::next`]).
pub(super) struct Next {
    /// Its table slot.
    pub(super) id: usize,
    pub(super) core: Arc<Core>,
    /// For each state slot of the replaced policy (its tiers, then its penalty boxes), the slot
    /// of the new one that keeps it, if any (see `carry::slot_map`).
    pub(super) slots: Box<[Option<usize>]>,
}

/// Wakes the requests waiting for a slot of the keys whose fingerprints share it: a release
/// bumps the epoch and notifies every waiter, each of which then tries again.
#[derive(Default)]
pub(super) struct Waker {
    pub(super) epoch: AtomicU64,
    pub(super) notify: tokio::sync::Notify,
}

/// Wakers per binding with concurrency tiers: releases of different keys rarely wake each
/// other's waiters.
pub(super) const WAKERS: usize = 64;

impl Core {
    /// What deciding `policy` needs, with no key yet.
    pub(super) fn new(policy: &Policy) -> Self {
        let whole = match policy.tiers() {
            [tier]
                if policy.algorithm() == crate::quota::Algorithm::Gcra
                    && policy.unit() == 1
                    && policy.is_plain() =>
            {
                WholeGcra::of(tier.rate)
            }
            _ => None,
        };
        let wakers = if policy.has_concurrency() {
            (0..WAKERS).map(|_| Waker::default()).collect()
        } else {
            Box::default()
        };
        let guarded = !policy.is_plain() || policy.algorithm().is_window();
        Self {
            policy: policy.clone(),
            whole,
            guarded,
            overflow: Mutex::new(None),
            holds: Holds::new(policy),
            wakers,
            moved: AtomicUsize::new(0),
            next: OnceLock::new(),
        }
    }

    /// Whether shard `shard` handed this binding's unchanged tiers over to its successor. Call
    /// it holding one of that shard's locks.
    #[inline]
    pub(super) fn moved(&self, shard: usize) -> bool {
        self.moved.load(Ordering::Relaxed) > shard
    }

    /// The state of a key never seen: each tier's, then the penalty boxes; as of the epoch, so
    /// that it decides alike at any instant (a bucket full, or empty, whichever instant the
    /// clock reads, even one before the last read), as a key without state does on the Redis
    /// store.
    pub(super) fn fresh(&self) -> KeyState {
        let alg = self.policy.algorithm();
        let tiers = self.policy.tiers().iter().map(|t| TierState::fresh_for(alg, t, 0));
        KeyState { tiers: tiers.chain(fresh_boxes(&self.policy)).collect(), guard: 0 }
    }

    /// The instant (nanoseconds) at which a key whose guard is `guard` decides at `now`: when
    /// the guard lies in a later unit of the policy's time, that unit (with `now`'s fraction of
    /// a unit, as the Redis store, whose guard is kept in whole units, reports waits), else
    /// `now`.
    #[inline]
    pub(super) fn guarded(&self, guard: u64, now: u64) -> u64 {
        let unit = self.policy.unit();
        if self.guarded && guard / unit > now / unit {
            (guard / unit) * unit + now % unit
        } else {
            now
        }
    }

    /// Whether `key` decides like a fresh key's at `now` (nanoseconds), or at its guard when
    /// that is later.
    pub(super) fn is_idle(&self, key: &KeyState, now: u64) -> bool {
        let alg = self.policy.algorithm();
        let unit = self.policy.unit();
        let now = in_units(&self.policy, self.guarded(key.guard, now));
        key.iter().zip(self.policy.tiers()).all(|(s, t)| s.is_idle_for(alg, t, unit, now))
            && boxes_idle(&self.policy, key, now)
    }

    /// Forgets `key`'s rate and calendar tiers and its guard when they (and its penalty boxes)
    /// decide like a fresh key's at `now` (or at its guard, when later), keeping the slots its
    /// concurrency tiers hold: as the Redis store deletes a key whose state it writes idle (its slots live
    /// apart). Returns whether it did.
    pub(super) fn forget_if_idle(&self, key: &mut KeyState, now: u64) -> bool {
        let alg = self.policy.algorithm();
        let unit = self.policy.unit();
        let at = in_units(&self.policy, self.guarded(key.guard, now));
        let tiers = self.policy.tiers();
        let slots = |t: &crate::policy::Tier| t.kind() == crate::quota::TierKind::Concurrency;
        let idle = key.iter().zip(tiers).all(|(s, t)| slots(t) || s.is_idle_for(alg, t, unit, at))
            && boxes_idle(&self.policy, key, at);
        if idle {
            for (s, t) in key.tiers.iter_mut().zip(tiers).filter(|(_, t)| !slots(t)) {
                *s = TierState::fresh_for(alg, t, 0);
            }
            key.guard = 0;
        }
        idle
    }

    /// The waker of fingerprint `fp`, if the policy has concurrency tiers.
    pub(super) fn waker(&self, fp: u64) -> Option<&Waker> {
        #[allow(clippy::cast_possible_truncation)] // modulo the number of wakers
        let i = (fp % WAKERS as u64) as usize;
        self.wakers.get(i)
    }

    /// Wakes the requests waiting for a slot of `fp`.
    pub(super) fn wake(&self, fp: u64) {
        if let Some(w) = self.waker(fp) {
            w.epoch.fetch_add(1, Ordering::AcqRel);
            w.notify.notify_waiters();
        }
    }
}

/// A key's state in a general table: every tier's, and the key's clock guard.
#[derive(Debug, Clone)]
pub(super) struct KeyState {
    /// Each tier's state, in the policy's order.
    pub(super) tiers: Box<[TierState]>,
    /// The instant (nanoseconds) of the key's last charge or settlement. Time never goes back
    /// for a key of a guarded policy ([`Core::guarded`]): a clock that steps back (a user's
    /// clock, a fake one in tests) would otherwise find a window it left as if empty. The key
    /// decides at the later of now and its guard, as it does on the Redis store, where the
    /// server's clock can step back. A refused check never moves it.
    pub(super) guard: u64,
}

impl Deref for KeyState {
    type Target = [TierState];

    fn deref(&self) -> &[TierState] {
        &self.tiers
    }
}

impl DerefMut for KeyState {
    fn deref_mut(&mut self) -> &mut [TierState] {
        &mut self.tiers
    }
}

/// A general table: every tier's state per key.
pub(super) struct General {
    pub(super) core: Arc<Core>,
    pub(super) map: ByFingerprint<KeyState>,
}

/// The general tables of a shard, by binding id.
pub(super) type Generals = Vec<Option<General>>;

/// A spin lock for critical sections of a few instructions: test-and-test-and-set, and after
/// a bounded spin a yield to the scheduler, so that a holder preempted mid-section does not
/// leave the others burning their time slices.
pub(super) struct SpinLock<T>(Spinlock<T>);

/// Spins before yielding: a few hundred nanoseconds, far more than a decision holds the lock.
const SPINS: u32 = 128;

impl<T> SpinLock<T> {
    fn new(value: T) -> Self {
        Self(Spinlock::new(value))
    }

    #[inline]
    pub(super) fn lock(&self) -> SpinlockGuard<'_, T> {
        if let Some(guard) = self.0.try_lock() {
            return guard;
        }
        self.lock_contended()
    }

    #[cold]
    fn lock_contended(&self) -> SpinlockGuard<'_, T> {
        let mut spins = 0;
        loop {
            while self.0.is_locked() {
                if spins < SPINS {
                    spins += 1;
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            if let Some(guard) = self.0.try_lock() {
                return guard;
            }
        }
    }
}

/// Locks, recovering from poisoning: a panicking thread cannot leave the maps half-written (each
/// update is a single assignment after the decision).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One shard: its compact and general tables, and when it may next be scanned for room. Aligned
/// to two cache lines, so that threads working on neighbouring shards do not share a line.
#[repr(C, align(128))]
pub(super) struct Shard {
    pub(super) compact: SpinLock<Compact>,
    pub(super) general: Mutex<Generals>,
    /// When the shard may next be scanned for idle keys to make room (nanoseconds).
    pub(super) next_scan: AtomicU64,
}

impl Default for Shard {
    fn default() -> Self {
        Self {
            compact: SpinLock::new(Compact::default()),
            general: Mutex::new(Vec::new()),
            next_scan: AtomicU64::new(0),
        }
    }
}

/// Binding `id`'s general table, created when needed.
pub(super) fn general_mut<'a>(
    tables: &'a mut Generals,
    id: usize,
    core: &Arc<Core>,
) -> &'a mut General {
    if tables.len() <= id {
        tables.resize_with(id + 1, || None);
    }
    tables[id]
        .get_or_insert_with(|| General { core: Arc::clone(core), map: ByFingerprint::default() })
}

impl Shard {
    /// Drops binding `id`'s tables; returns how many keys they held.
    pub(super) fn drop_tables(&self, id: usize) -> usize {
        let compact = self.compact.lock().drop_table(id);
        let general =
            lock(&self.general).get_mut(id).and_then(Option::take).map_or(0, |g| g.map.len());
        compact + general
    }

    /// How many keys binding `id` holds in this shard.
    pub(super) fn keys_of(&self, id: usize) -> usize {
        let compact = self.compact.lock().len_of(id);
        let general =
            lock(&self.general).get(id).and_then(Option::as_ref).map_or(0, |g| g.map.len());
        compact + general
    }

    /// Evicts the idle keys (whose state decides exactly like a fresh one) of every table;
    /// returns how many.
    pub(super) fn evict_idle(&self, now: u64) -> usize {
        let mut removed = self.compact.lock().evict_idle(now);
        for table in lock(&self.general).iter_mut().flatten() {
            let before = table.map.len();
            let core = &table.core;
            table.map.retain(|_, states| !core.is_idle(states, now));
            removed += before - table.map.len();
        }
        removed
    }
}
