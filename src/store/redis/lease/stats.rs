//! [`LeaseStats`]: what a binding's leases have done, and the counters behind them.

use super::*;

/// What a binding's leases have done, since it was made ([`RedisPolicy::lease_stats`]).
///
/// ```
/// use tollgate::store::{Lease, LeaseStats, RedisStore, Store};
/// use tollgate::{Policy, Quota};
///
/// # fn main() -> Result<(), tollgate::ConfigError> {
/// let store = RedisStore::builder("redis://127.0.0.1:6380/").lease(Lease::new()).build()?;
/// let bound = store.bind(&Policy::single("api", Quota::per_second(1_000))?)?;
/// let stats: LeaseStats = bound.lease_stats();
/// assert_eq!(stats, LeaseStats::default()); // no check yet
/// // The checks Redis never saw, of all the leasing checks:
/// let local = stats.decided_locally + stats.refused_locally;
/// assert_eq!(local + stats.decided_on_redis, 0);
/// # Ok(()) }
/// ```
///
/// [`RedisPolicy::lease_stats`]: crate::store::redis::RedisPolicy::lease_stats
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseStats {
    /// Blocks granted by Redis.
    pub grants: u64,
    /// Units granted in them.
    pub units_granted: u64,
    /// Unspent units given back to Redis (a fixed window's units given back after their
    /// window ended count here too; Redis drops them).
    pub units_returned: u64,
    /// Checks decided here, from a block, with no call.
    pub decided_locally: u64,
    /// Leasing checks that called Redis (granted a block, or refused).
    pub decided_on_redis: u64,
    /// Checks refused here, with no call, while this instance waited for a useful block of a
    /// GCRA or bucket key to build up again (see [`Lease`], "Block size"), or, leasing the
    /// key's schedule ([`Lease::schedule`]), for the units it holds to conform. Not counted in
    /// [`decided_locally`](Self::decided_locally).
    pub refused_locally: u64,
    /// Calls that asked for a key's next block ahead of need ([`Lease::prefetch`]), granted
    /// or refused (counted from when the check that starts one returns). Not counted in [`decided_on_redis`](Self::decided_on_redis); their grants
    /// are counted in [`grants`](Self::grants).
    pub prefetched: u64,
    /// The round trip of this binding's lease calls, sent to answered (a moving average
    /// weighting the latest call a quarter; zero before the first answer, and with an
    /// injected clock that does not move during calls). It times prefetches and sizes the
    /// useful block (see [`Lease`], "Block size").
    pub round_trip: Duration,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) grants: AtomicU64,
    pub(super) units_granted: AtomicU64,
    pub(super) units_returned: AtomicU64,
    pub(super) local: AtomicU64,
    pub(super) remote: AtomicU64,
    pub(super) held: AtomicU64,
    pub(super) prefetched: AtomicU64,
}

impl Leases {
    /// A leasing check called Redis.
    pub(crate) fn called(&self) {
        self.counters.remote.fetch_add(1, Ordering::Relaxed);
        self.metrics.remote();
    }

    /// `units` were given back to Redis.
    pub(crate) fn returned(&self, units: u64) {
        self.counters.units_returned.fetch_add(units, Ordering::Relaxed);
        self.metrics.returned(units);
    }

    pub(crate) fn stats(&self) -> LeaseStats {
        let c = &self.counters;
        LeaseStats {
            grants: c.grants.load(Ordering::Relaxed),
            units_granted: c.units_granted.load(Ordering::Relaxed),
            units_returned: c.units_returned.load(Ordering::Relaxed),
            decided_locally: c.local.load(Ordering::Relaxed),
            decided_on_redis: c.remote.load(Ordering::Relaxed),
            refused_locally: c.held.load(Ordering::Relaxed),
            prefetched: c.prefetched.load(Ordering::Relaxed),
            round_trip: Duration::from_nanos(self.round_trip.load(Ordering::Relaxed)),
        }
    }
}
