//! Leases: blocks of a key's budget taken from Redis in one script call and spent by this
//! process, so that a hot key costs Redis one call per block instead of one per check.
//!
//! Per key, this process holds at most one block at a time (with prefetching, a block the next
//! one joins, at most `max_block` units in all). A block is charged in Redis when
//! it is granted (to every tier, at the grant's instant, as a check of its size would be);
//! checks then take units from it here until it is spent or its lifetime ends. Whatever is
//! left when it ends is given back to Redis: by the call that takes the next block (the same
//! script call settles the old block first), by a sweeper that runs every lifetime, or when
//! the binding is dropped. Taking the next block waits for that give-back, so a key never has
//! two blocks of this process outstanding; a prefetch gives nothing back (its units join the
//! block held) and asks only for what keeps the units held within `max_block`.

mod config;
mod give_back;
mod grant;
mod ledger;
mod prefetch;
mod sizing;
mod spend;
mod stats;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};

use std::time::{Duration, Instant};

use super::script::{Rest, state_key};
use crate::algorithm::Charges;
use crate::algorithm::calendar;
use crate::algorithm::compiled::{Kind, Rate};
use crate::clock::duration_to_nanos;
use crate::decision::{Decision, NONE, Outcome};
use crate::error::ConfigError;
use crate::key::Key;
use crate::policy::Policy;
use crate::quota::{Algorithm, Unit};

pub use config::Lease;
pub(crate) use give_back::{Back, sweeper};
pub(crate) use grant::{Begin, Grant, Reply};
use ledger::{HeldBlock, pace_at, promised, waits_on};
pub(crate) use ledger::{Paced, Slot};
use sizing::{horizon, longest_wait};
pub(crate) use sizing::{lease_share, unleasable, useful_block};
use stats::Counters;
pub use stats::LeaseStats;

/// Shards of a binding's map of leased keys.
const SHARDS: usize = 16;

/// Keys a binding holds leases for at most (a key past it is checked exactly).
const CAPACITY: usize = 4096;

/// Leased keys by key.
type Shard = Mutex<HashMap<Key, Arc<Slot>>>;

/// A binding's leases.
pub(crate) struct Leases {
    config: Lease,
    lifetime_ns: u64,
    /// The useful block of the policy's rate tiers (see [`useful_block`]); 0 for windows.
    useful: u64,
    /// The longest wait for a useful block, in nanoseconds (see [`longest_wait`]).
    longest_wait: u64,
    policy: Policy,
    shards: Box<[Shard]>,
    per_shard: usize,
    hasher: ahash::RandomState,
    counters: Counters,
    metrics: crate::metrics::LeaseMetrics,
    /// Whether blocks are asked for ahead of need (see [`Lease::prefetch`]): asked for, and
    /// a policy of GCRA or bucket tiers alone.
    prefetching: bool,
    /// The round trip of this binding's lease calls, on the clock the scripts decide with
    /// (nanoseconds; a moving average): a prefetch starts half of it before a wait ends.
    round_trip: AtomicU64,
    /// For a lease of the key's schedule ([`Lease::schedule`]): how far ahead of now the
    /// last unit of a block may conform, in the policy's units; 0 when not leasing so.
    horizon: u64,
    /// Whether the sweeper runs.
    sweeping: AtomicBool,
    /// How blocks are given back (by the sweeper, and when the binding is dropped).
    pub(crate) back: Option<Back>,
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leases").field("config", &self.config).finish_non_exhaustive()
    }
}

impl Leases {
    pub(crate) fn new(policy: &Policy, config: Lease) -> Self {
        Self {
            config,
            lifetime_ns: duration_to_nanos(config.lifetime),
            useful: useful_block(policy, config.max_block),
            longest_wait: longest_wait(policy),
            policy: policy.clone(),
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            per_shard: CAPACITY.div_ceil(SHARDS),
            hasher: ahash::RandomState::new(),
            counters: Counters::default(),
            metrics: crate::metrics::LeaseMetrics::new(policy.name()),
            prefetching: config.prefetch
                && policy.is_plain()
                && policy.algorithm() != Algorithm::FixedWindow,
            round_trip: AtomicU64::new(0),
            horizon: horizon(policy, config),
            sweeping: AtomicBool::new(false),
            back: None,
        }
    }

    /// The record of a lease call: of the key's schedule when this binding leases so (see
    /// [`Lease::schedule`]).
    pub(crate) fn record(
        &self,
        prepared: &super::Prepared,
        cost: u64,
        block: u64,
        useful: u64,
        rest: Option<&Rest>,
    ) -> Vec<f64> {
        if self.horizon > 0 && useful > 0 {
            prepared.lease_ahead(cost, block, useful, rest, self.horizon)
        } else {
            prepared.lease(cost, block, useful, rest)
        }
    }

    pub(crate) fn config(&self) -> Lease {
        self.config
    }

    pub(crate) fn lifetime(&self) -> Duration {
        self.config.lifetime
    }
}
