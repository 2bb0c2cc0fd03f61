//! The tables of one shard: per bound policy, the state of each key, by fingerprint.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use crate::algorithm::{TierState, WholeGcra};
use crate::quota::Policy;

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
/// its tables (which evict with it).
pub(super) struct Core {
    pub(super) policy: Policy,
    /// One GCRA tier whose emission interval is a whole number of nanoseconds: the compact
    /// representation applies.
    pub(super) whole: Option<WholeGcra>,
    /// The shared state of keys that arrived while the store was full.
    pub(super) overflow: Mutex<Option<Box<[TierState]>>>,
}

impl Core {
    pub(super) fn fresh(&self, now: u64) -> Box<[TierState]> {
        let alg = self.policy.algorithm();
        self.policy.tiers().iter().map(|t| TierState::fresh(alg, t.rate, now)).collect()
    }

    pub(super) fn is_idle(&self, states: &[TierState], now: u64) -> bool {
        let alg = self.policy.algorithm();
        states.iter().zip(self.policy.tiers()).all(|(s, t)| s.is_idle(alg, t.rate, now))
    }
}

/// The keys of one bound policy in one shard.
pub(super) enum Table {
    /// One GCRA tier with a whole-nanosecond interval: the TAT (0 for a fresh key), updated by
    /// compare-and-swap under the shard's read lock.
    Whole(ByFingerprint<AtomicU64>),
    /// Anything else: every tier's state, updated under the shard's write lock.
    General(Arc<Core>, ByFingerprint<Box<[TierState]>>),
}

impl Table {
    pub(super) fn new(core: &Arc<Core>) -> Self {
        match core.whole {
            Some(_) => Self::Whole(ByFingerprint::default()),
            None => Self::General(Arc::clone(core), ByFingerprint::default()),
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Self::Whole(m) => m.len(),
            Self::General(_, m) => m.len(),
        }
    }

    pub(super) fn contains(&self, fp: u64) -> bool {
        match self {
            Self::Whole(m) => m.contains_key(&fp),
            Self::General(_, m) => m.contains_key(&fp),
        }
    }

    /// Removes the idle keys (whose state decides exactly like a fresh one); returns how many.
    pub(super) fn evict_idle(&mut self, now: u64) -> usize {
        let before = self.len();
        match self {
            Self::Whole(m) => m.retain(|_, tat| *tat.get_mut() > now),
            Self::General(core, m) => m.retain(|_, states| !core.is_idle(states, now)),
        }
        before - self.len()
    }
}

/// One shard: a table per bound policy (indexed by the binding's id), and when the shard may
/// next be scanned for room.
#[derive(Default)]
pub(super) struct Shard {
    pub(super) tables: Vec<Option<Table>>,
    pub(super) next_scan: u64,
}

impl Shard {
    pub(super) fn table(&self, id: usize) -> Option<&Table> {
        self.tables.get(id).and_then(Option::as_ref)
    }

    /// The table of binding `id`, created when needed.
    pub(super) fn table_mut(&mut self, id: usize, core: &Arc<Core>) -> &mut Table {
        if self.tables.len() <= id {
            self.tables.resize_with(id + 1, || None);
        }
        self.tables[id].get_or_insert_with(|| Table::new(core))
    }

    /// Drops binding `id`'s table; returns how many keys it held.
    pub(super) fn drop_table(&mut self, id: usize) -> usize {
        self.tables.get_mut(id).and_then(Option::take).map_or(0, |t| t.len())
    }

    /// Evicts idle keys of every table; returns how many.
    pub(super) fn evict_idle(&mut self, now: u64) -> usize {
        self.tables.iter_mut().flatten().map(|t| t.evict_idle(now)).sum()
    }
}
