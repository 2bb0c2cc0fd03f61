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

/// Shards of a binding's map of leased keys.
const SHARDS: usize = 16;

/// Keys a binding holds leases for at most (a key past it is checked exactly).
const CAPACITY: usize = 4096;

/// Lease mode for hot keys on a [`RedisStore`](super::RedisStore), opted into per policy with
/// [`RedisStoreBuilder::lease_policy`](super::RedisStoreBuilder::lease_policy) (or for every
/// policy that can lease with [`RedisStoreBuilder::lease`](super::RedisStoreBuilder::lease)).
/// Exact checks stay the default.
///
/// In lease mode an instance takes a **block** of units for a key from Redis in one script
/// call and spends it locally, so Redis sees one call per block instead of one per check.
/// The block is charged in Redis when it is granted; checks then take units from it in this
/// process, with no call, until it is spent or its [lifetime](Self::lifetime) ends. What is
/// left of it is then given back to Redis (settled like a refund): by the call that takes the
/// key's next block, which settles the old one first, by a sweeper that runs every lifetime,
/// or when the binding is dropped. An instance holds at most one block per key, and at most
/// [`max_block`](Self::max_block) units of it, also when it asks for the next block ahead of
/// need ([`prefetch`](Self::prefetch)).
///
/// **Block size.** A key's first block is one unit (a key seen once costs what it costs in
/// exact mode and leaves nothing behind). A block spent within its lifetime doubles the next
/// one (up to [`max_block`](Self::max_block)) when that is asked for within the lifetime too
/// (a key checked again only later keeps the size it had); a block that ends unspent sizes
/// the next one to what was spent of it. Redis grants at most a quarter of what the key has
/// left on every tier (and at least the check's cost, if the key has it): a key far from its
/// limit is leased in large blocks, and near its limit each instance leases one unit at a
/// time, which is exact.
///
/// **Waiting for a useful block (GCRA, token and leaky bucket).** A key taken at its rate
/// has little left at any instant, so a quarter of it is a few units and each instance would
/// call Redis every few checks, and for every refused check. For these algorithms Redis
/// grants instead, when it is more, up to a **useful block** of what the key has, however
/// little: what every tier refills in 2 ms, or in two of this instance's round trips to
/// Redis when that is longer ([`LeaseStats::round_trip`]: one instance takes one block per
/// round trip, so a smaller block could not keep up with the key's rate), a quarter of its
/// burst at most, and at most the block asked for (at least 1 unit). The same call returns the instant a useful block will
/// be there again (from the tiers' state after the grant, as GCRA's theoretical arrival time
/// gives it). Once this instance has spent what it got, it refuses the key's checks itself
/// until that instant, with no call, and with the rest of the wait as `retry_after`: the time
/// this instance will keep refusing (see [`LeaseStats::refused_locally`]). A call Redis
/// refuses (another instance took everything) waits the same way. When other instances take
/// from the key too, a call gets only a share of what built up: an instance that got `g`
/// units of a useful block of `u` waits `u / g` times as long (as if for its share), so that
/// each call finds about a useful block again, but never longer than the time the key takes
/// to refill half its burst (or the wait Redis gave, when that is longer). At the key's rate
/// Redis then sees about one call per useful block for up to as many instances as useful
/// blocks refill in half the burst's refill time, and beyond that one call per instance per
/// half the burst's refill (at 400,000 a second with a burst of 4,000 and blocks of at most
/// 512: useful blocks of 512 refill in 1.28 ms and half the burst in 5 ms, so about 780 calls
/// a second for up to 3 instances, then 200 per instance).
/// [`schedule`](Self::schedule) removes that growth with `N` for GCRA: a call then takes a
/// whole useful block of the key's schedule, whose units this instance admits each at the
/// instant it conforms, so Redis sees about one call per useful block whatever `N`.
///
/// The wait admits nothing, so the bound below is unchanged. What it costs is
/// under-admission, and that is bounded: right after a grant the wait for a useful block is
/// at most its refill (2 ms or two round trips at the key's rate, or one emission interval
/// for a key refilling less than a unit in that time, which is then the exact refusal's own
/// wait; a useful block being a quarter of the burst at most, that is a quarter of the time
/// the key takes to fill from empty at most), and every wait, shares included, is at most
/// half the time the key takes to fill from empty. An instance waits only when
/// the key has less than a useful block (a quarter of the burst at most) left, so the key is
/// at most three quarters full when the wait ends: the units that build up meanwhile stay in
/// Redis for the next call of any instance, and with demand above the limit no refill is
/// lost to the burst's cap. `examples/fleet.rs` measures the utilization this gives.
///
/// # Scaling past one Redis: what each mode guarantees
///
/// For `N` instances leasing one key, blocks of at most `B` units
/// ([`max_block`](Self::max_block)), a rate of `R` units per second and a burst (capacity)
/// of `b` units:
///
/// | mode, algorithm | admitted beyond the exact limit | an instance that dies |
/// |---|---|---|
/// | exact (the default), every algorithm | 0 | strands nothing |
/// | lease, fixed window, calendar tiers | **0**: every unit admitted was charged to the window it is admitted in | its unspent block (≤ `B`) is lost to that window only |
/// | lease, GCRA, token bucket, leaky bucket | in any interval of length `L`: at most `b + ⌊R·L⌋ + N·B` admitted, against `b + ⌊R·L⌋` for exact | its unspent block (≤ `B`) comes back as the key refills: within `B / R` |
/// | lease asked for a sliding window (counter or log), or a policy with concurrency, penalty or reserve tiers or tiers counting other units than requests | lease mode is refused when the policy is bound ([`lease_policy`](super::RedisStoreBuilder::lease_policy)), or the policy stays exact ([`lease`](super::RedisStoreBuilder::lease)) | — |
///
/// Why `N·B` for the rate algorithms: a unit is admitted at most one lifetime after Redis
/// charged it, so the units admitted in an interval are those Redis charged in it (at most
/// what exact mode admits in it, since given-back units are charged again before they are
/// admitted again) plus those held at its start, and each instance holds at most `B` units of
/// a key (a useful block is at most `B` too, waiting for one only refuses, and a prefetch asks
/// only for what tops the units held up to `B`). Leasing the key's schedule
/// ([`schedule`](Self::schedule)) keeps it: a unit is admitted no earlier than the instant it
/// conforms to the key's state as its grant left it (for one tier, as an exact check would
/// be; see there for several).
/// Windows lose nothing to this: a block is spent only in the window it
/// was charged to (its lifetime ends when the first of its windows ends, fixed or calendar).
/// A policy mixing rate and calendar tiers keeps each tier's own bound.
///
/// A policy with calendar tiers gives back the rest of a block with a call of its own, made
/// before the call that takes the next block; its blocks are sized from what Redis had left
/// at the last grant (a quarter of it at most), and a block Redis refuses is asked again at
/// that size, down to the check's own cost.
///
/// Measured with `cargo run --release --example fleet --features redis` (N = 1, 2, 4 and 8
/// instances in one process, 64 tasks, one hot key and 10,000 cold keys, exact and lease
/// mode, beside a plain `INCR` loop): it prints, per line, the checks per second, Redis CPU
/// per admitted check, the worst window against the limit, the over-admission and the bound.
///
/// **Faults.** A block is never spent after its lifetime (with Redis time, this process
/// counts the lifetime from the server's instant of the grant plus the time since the call
/// was sent, so it ends early by up to a round trip, never late). While Redis fails, units
/// already granted are still spent (Redis charged them), and every check that needs a new
/// block is decided as in exact mode: by the local fallback, or the layer's failure policy.
///
/// **Headers.** A check decided from a block reports, per tier, as `remaining` (the
/// `RateLimit` field's `r`) what Redis had left of the tier at this instance's last lease call
/// for the key, after charging the block, plus the units of the block this instance still
/// holds (with [`schedule`](Self::schedule), those that conform now), at most the tier's
/// limit: Redis's last report less what this instance spent since, never the block alone. Its
/// `reset_after` (`t`) is the reset Redis reported then, counted down. A check that took a new
/// block reports the same, which is what exact mode reports at that instant. While this
/// instance waits for a useful block (see "Waiting for a useful block"), a tier that had less
/// than one left in Redis reports only the units held: once they are spent, this instance
/// refuses until the wait ends, however little Redis has.
///
/// *How stale.* Let `E` be what an exact check of the key reports at the same instant (units
/// held by any instance count as spent there) and `h` the units this instance holds. Since
/// this instance's last lease call for the key (at most one [lifetime](Self::lifetime)
/// earlier: a block is spent only within it) other instances and exact checks may have taken
/// units from Redis, and the key may have refilled or been given units back. Per tier:
///
/// - `remaining ≤ E + h + taken`, `taken` being what the others took from Redis since that
///   call (their blocks, at most `max_block` each at a time, and their exact charges);
/// - `remaining ≥ E − refilled − given back − w`, the refill and the give-backs since that
///   call, and `w` the tier's rest in Redis when this instance waits on it (less than a useful
///   block, so at most `max_block`; 0 otherwise).
///
/// So a client that paces on `remaining` and `reset_after` alone (waiting for the reset when
/// `remaining` is below its cost, and for `retry_after` after a refusal) is refused by the
/// instance that answered it only when the others took, since that answer's lease call, more
/// than the answer promised beyond the check: for a tier, `taken > remaining − cost` (its
/// limit once its reset has passed). One instance alone (or one leasing a key the others do
/// not use) is never refused where its headers said it would be admitted. The crate's tests
/// hold both bounds and this over random lease traces of several instances.
///
/// A check refused while waiting for a useful block reports `remaining` 0 on every tier, the
/// reset counted down from the grant, and as violated the tiers that had the least left at the
/// grant, each with the wait's `retry_after`.
///
/// **Which checks lease.** Policing checks of a cost above 0; shaping checks and queries are
/// exact. A check whose block Redis refuses is refused exactly as in exact mode (the refusal
/// is for its own cost), and is then kept by the
/// [local refusals](super::RedisStoreBuilder::local_refusals); for GCRA and the buckets its
/// `retry_after` is the instance's wait for a useful block when that is longer (above). A
/// check that asks for a ticket
/// gets one for its units as Redis charged them (at the block's grant): settling it refunds
/// to, or charges, the key in Redis as it would an exact charge made at that instant (a fixed
/// window's refund reaches the window only while it lasts).
///
/// ```
/// use std::time::Duration;
/// use tollgate::store::{Lease, RedisStore};
///
/// # fn main() -> Result<(), tollgate::ConfigError> {
/// let lease = Lease::new().max_block(64).lifetime(Duration::from_millis(100));
/// assert_eq!(lease.bound(8), 512); // 8 instances: at most 512 units beyond GCRA's limit
/// let store = RedisStore::builder("redis://127.0.0.1:6380/").lease_policy("search", lease).build()?;
/// # let _ = store; Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    max_block: u64,
    lifetime: Duration,
    prefetch: bool,
    schedule: bool,
}

impl Default for Lease {
    fn default() -> Self {
        Self::new()
    }
}

impl Lease {
    /// Blocks of at most 64 units, each spent within 100 ms of its grant.
    #[must_use]
    pub const fn new() -> Self {
        Self {
            max_block: 64,
            lifetime: Duration::from_millis(100),
            prefetch: false,
            schedule: false,
        }
    }

    /// The largest block an instance takes for a key, in the policy's units (default 64; at
    /// least 1, checked by [`build`](super::RedisStoreBuilder::build)). It bounds what an
    /// instance can strand and, for the rate algorithms, the extra admissions per instance.
    /// An instance spends at most about one block per round trip to Redis on a key (its
    /// checks wait while the next block is taken, unless it was asked for ahead of need, see
    /// [`prefetch`](Self::prefetch)), so size it to what the key admits per instance in a
    /// round trip or two: 512 for a key admitting 400,000 a second.
    #[must_use]
    pub const fn max_block(mut self, units: u64) -> Self {
        self.max_block = units;
        self
    }

    /// How long after its grant a block may be spent (default 100 ms; at least 1 ms, checked
    /// by [`build`](super::RedisStoreBuilder::build)). A fixed window's block also ends with
    /// its window.
    #[must_use]
    pub const fn lifetime(mut self, lifetime: Duration) -> Self {
        self.lifetime = lifetime;
        self
    }

    /// Whether an instance asks for a key's next block before the one it holds runs out
    /// (default `false`), so that its checks do not wait on the round trip that takes it.
    /// GCRA and the buckets only, for policies of rate tiers alone (windows and policies with
    /// calendar tiers take their next block when the last is spent, as without it).
    ///
    /// A key is leased ahead once its blocks have grown to 16 units (or to `max_block`, when
    /// smaller), that is once its blocks doubled four times, each spent within its lifetime:
    /// a key checked now and then costs no call ahead of need. One call is in flight per key
    /// and instance at most, made in the background (on the Tokio runtime of the check that
    /// starts it), when half of the block this instance asks for is spent, or, while the
    /// instance waits for a useful block, half a round trip (as measured on this instance's
    /// lease calls) before the wait ends, so that Redis decides it about when the useful
    /// block is there. It asks for what tops the units the instance holds up to at most
    /// [`max_block`](Self::max_block) (twice the block it asks for now, while that is
    /// smaller): the units an instance holds never exceed the largest block, so
    /// [`bound`](Self::bound) is the same with prefetching and without. The units still held
    /// when the next block arrives are spent first and keep their own lifetime; those whose
    /// lifetime ends are given back with the rest of the block they joined (until then, at
    /// most one lifetime, they are neither in Redis nor spent: fewer admissions, never more).
    ///
    /// What it does not change: one instance still takes at most `max_block` units per round
    /// trip, so a key admitting more than that per instance and round trip needs a larger
    /// block (and with it a larger bound) or more instances.
    #[must_use]
    pub const fn prefetch(mut self, prefetch: bool) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// Whether a lease call on a key at its rate takes a useful block of the units that
    /// come next in the key's schedule, also those that conform only later (default
    /// `false`). GCRA policies whose tiers' emission intervals are whole units of the policy's
    /// time unit only (the common case: a rate dividing its period); other policies lease as
    /// without it.
    ///
    /// Without it, a key at its rate grants a call what built up since the last grant of
    /// any instance (up to a useful block, see [`Lease`], "Waiting for a useful block"), so
    /// with `N` instances each call finds about `1 / √N` of a useful block, and Redis sees
    /// more calls per admitted unit as `N` grows. With it, a call takes a whole useful block
    /// (at most [`max_block`](Self::max_block)): Redis advances the key's theoretical
    /// arrival time (GCRA's TAT) by the block, also past the instant the key is full, as long
    /// as the block's last unit conforms within the **horizon**, half the
    /// [lifetime](Self::lifetime) (so that the block's units conform while the block lives).
    /// This instance then admits unit `k` of the block only once it conforms, at the instant
    /// an exact check of it would first be admitted (`TAT_k - τ` on every tier; with several
    /// tiers, a tier that does not limit the key is charged the block from its own TAT,
    /// without exact GCRA's step up to the instant of admission, so it can end the block up
    /// to about one unit ahead of exact, within the bound), and refuses the key's checks
    /// itself until then, with that exact wait as `retry_after`. A call that finds the
    /// horizon full is refused, and this instance waits, with no call, until a useful block
    /// fits again (the wait Redis gives); the checks it refuses meanwhile are told when their
    /// own units conform (after the key's schedule as Redis last reported it), which can be
    /// later than that wait, never earlier.
    ///
    /// The bound is the same ([`bound`](Self::bound)): every unit admitted conforms at the
    /// instant it is admitted to the key's GCRA state as the grant left it, each instance
    /// still holds at most `max_block` units, and what is held but not yet spendable is
    /// under-admission, given back when the block ends unspent (its lifetime, or the
    /// instance's demand stopping), as without it. What it costs: a block held by an instance
    /// whose demand stops is not spendable by others until it is given back; and exact checks
    /// of the key (instances in exact mode, and the shaping checks and queries of leasing
    /// ones) find it full until its TAT comes back, so a check of `c` units waits for the
    /// units the instances hold ahead of it (at most `N × max_block` emission intervals, and
    /// within the horizon) and then for its own `c` intervals, where without leasing ahead it
    /// would wait for its own alone: at 100,000 a second with eight instances holding blocks
    /// of 64, up to 5.13 ms instead of 10 µs.
    #[must_use]
    pub const fn schedule(mut self, schedule: bool) -> Self {
        self.schedule = schedule;
        self
    }

    /// Whether blocks are leased from the key's schedule (see [`schedule`](Self::schedule)).
    #[must_use]
    pub const fn schedules(&self) -> bool {
        self.schedule
    }

    /// Whether the next block is asked for ahead of need (see [`prefetch`](Self::prefetch)).
    #[must_use]
    pub const fn prefetches(&self) -> bool {
        self.prefetch
    }

    /// The largest block, in units.
    #[must_use]
    pub const fn block(&self) -> u64 {
        self.max_block
    }

    /// The stated bound on admissions beyond the exact limit for GCRA and the buckets with
    /// `instances` instances leasing one key, in units: `instances × max_block` (saturating).
    /// Fixed windows admit nothing beyond their limit.
    #[must_use]
    pub const fn bound(&self, instances: u64) -> u64 {
        instances.saturating_mul(self.max_block)
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.max_block == 0 || self.lifetime < Duration::from_millis(1) {
            return Err(ConfigError::Invalid {
                setting: "lease",
                reason: "the block must be at least 1 unit and the lifetime at least 1 ms".into(),
            });
        }
        Ok(())
    }
}

/// The block size from which an instance asks for a key's next block ahead of need (or the
/// largest block, when smaller; see [`Lease::prefetch`]): the key's blocks doubled four times,
/// each spent within its lifetime. A key checked now and then never gets there, so it costs
/// no call ahead of need and strands no block it will not spend.
const PREFETCH_FROM: u64 = 16;

/// How long a useful block takes to build up at a key's rate at least (see [`useful_block`];
/// longer when an instance's lease calls take longer, see [`Leases::useful_now`]).
const USEFUL_SPAN: Duration = Duration::from_millis(2);

/// The block an instance waits for on a GCRA or bucket key, in units: what every rate tier
/// refills in [`USEFUL_SPAN`], a quarter of its burst at most, and at most `max_block`, but at
/// least 1 (then it waits for the next unit, exactly as a refusal would). 0 for fixed windows,
/// which keep the quarter rule alone: a window's units come back only when it ends.
pub(crate) fn useful_block(policy: &Policy, max_block: u64) -> u64 {
    useful_over(policy, max_block, duration_to_nanos(USEFUL_SPAN))
}

/// [`useful_block`] for what the tiers refill in `span` nanoseconds.
fn useful_over(policy: &Policy, max_block: u64, span: u64) -> u64 {
    if policy.algorithm() == Algorithm::FixedWindow {
        return 0;
    }
    let span = u128::from(span / policy.unit());
    rates(policy)
        .map(|r| {
            let refilled = u128::from(r.count) * span / u128::from(r.period.max(1));
            u64::try_from(refilled).unwrap_or(u64::MAX).min(r.burst / 4)
        })
        .fold(max_block, u64::min)
        .max(1)
}

/// The rate tiers' quotas, in the policy's unit.
fn rates(policy: &Policy) -> impl Iterator<Item = &Rate> {
    policy.tiers().iter().filter(|t| matches!(t.kind, Kind::Rate)).map(|t| &t.rate)
}

/// The longest an instance waits for a useful block when other instances take from the key
/// too, in nanoseconds: the time the fastest-filling rate tier refills half its burst. An
/// instance waits only when the key has less than a useful block (a quarter of the burst at
/// most) left, so a key that instances want is at most three quarters full when their waits
/// end, and no refill is lost to the burst's cap.
fn longest_wait(policy: &Policy) -> u64 {
    let unit = u128::from(policy.unit());
    rates(policy)
        .map(|r| {
            let fill =
                u128::from(r.burst) * u128::from(r.period) * unit / u128::from(r.count.max(1));
            u64::try_from(fill / 2).unwrap_or(u64::MAX)
        })
        .min()
        .unwrap_or(0)
}

/// How far ahead of now the last unit of a block leased from the key's schedule may conform,
/// in the policy's units (see [`Lease::schedule`]): half the lifetime; 0 when the binding does
/// not lease so (not asked for, or not a policy of `lua/gcra.lua`).
///
/// Not shorter: what the instances lease ahead together is bounded by the blocks they hold
/// (`max_block` each); a horizon shorter than their useful blocks span together (a burst that
/// fills faster, as 4,000 units at 400,000 a second do for eight blocks of 512) is found full,
/// the instances wait until a useful block fits again and then call at once, one granted and
/// the others refused again: several calls per block instead of one. What a longer horizon
/// costs is the wait of exact checks of the key, which find it full until its TAT comes back:
/// up to the horizon (and at most the units the instances hold ahead; see
/// [`Lease::schedule`]).
fn horizon(policy: &Policy, config: Lease) -> u64 {
    if !config.schedule || super::script::family(policy) != super::script::Family::Gcra {
        return 0;
    }
    (duration_to_nanos(config.lifetime) / 2 / policy.unit()).max(1)
}

/// Why `policy` cannot lease: the tier that keeps it exact and the reason; `None` when it can.
pub(crate) fn unleasable(policy: &Policy) -> Option<(String, String)> {
    let first = || policy.tiers().first().map(|t| t.name().to_owned()).unwrap_or_default();
    if let Some(t) = policy.tiers().iter().find(|t| matches!(t.kind, Kind::Concurrency(_))) {
        return Some((
            t.name().to_owned(),
            "lease mode does not cover concurrency tiers (their slots are not units a block can hold); it stays exact".into(),
        ));
    }
    if let Some(t) = policy.tiers().iter().find(|t| t.unit() != Unit::Requests) {
        return Some((
            t.name().to_owned(),
            "lease mode covers tiers counting requests only; it stays exact".into(),
        ));
    }
    if let Some(t) = policy.tiers().iter().find(|t| t.penalty.is_some() || t.reserve.is_some()) {
        return Some((
            t.name().to_owned(),
            "lease mode does not cover penalty boxes or priority reserves; they stay exact".into(),
        ));
    }
    match policy.algorithm() {
        Algorithm::SlidingCounter | Algorithm::SlidingLog => Some((
            first(),
            "sliding windows stay exact: a block charged ahead of its admissions has no stated bound there"
                .into(),
        )),
        Algorithm::Gcra | Algorithm::TokenBucket | Algorithm::LeakyBucket | Algorithm::FixedWindow => {
            None
        }
    }
}

/// What a binding's leases have done, since it was made ([`RedisPolicy::lease_stats`]).
///
/// [`RedisPolicy::lease_stats`]: super::RedisPolicy::lease_stats
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
struct Counters {
    grants: AtomicU64,
    units_granted: AtomicU64,
    units_returned: AtomicU64,
    local: AtomicU64,
    remote: AtomicU64,
    held: AtomicU64,
    prefetched: AtomicU64,
}

/// One key's block, and the lock that makes one check at a time take the next one.
#[derive(Default)]
pub(crate) struct Slot {
    held: Mutex<Held>,
    pub(crate) refill: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct Held {
    /// Units of the block not spent yet.
    left: u64,
    /// Units the block was granted with.
    granted: u64,
    /// What Redis charged for it (to give back the rest); `None` once given back.
    charges: Option<Charges>,
    /// The instant Redis granted it (nanoseconds, on the clock the scripts decide with).
    decided: u64,
    /// Without an injected clock: this process's instant the call was sent.
    sent: Option<Instant>,
    /// The end of its lifetime (same clock as `decided`).
    until: u64,
    /// Until when (same clock) this instance refuses the checks its block cannot serve,
    /// waiting for a useful block to build up in Redis; 0 for none.
    hold: u64,
    /// The useful block the last grant asked for (see [`Begin::useful`]): the tiers that had
    /// less than that left in Redis are those this instance waits on until `hold`.
    useful: u64,
    /// The grant's decision (limits and resets), for the checks decided from the block.
    decision: Option<Decision>,
    /// The size of the next block to ask for (0: a key not leased yet, which asks for 1).
    next: u64,
    /// What Redis had left of the key (the least over its tiers) at the last grant.
    room: Option<u64>,
    /// The key, for the sweeper.
    key: Option<Key>,
    /// Whether a call asking for the next block ahead of need is in flight (or about to be).
    fetching: bool,
    /// Units of `left` from an earlier grant, which a prefetched block joined: spent first,
    /// and no longer after `older_until`.
    older: u64,
    /// The end of the lifetime of the `older` units (same clock as `decided`).
    older_until: u64,
    /// Units of the block whose lifetime ended unspent (the `older` units, past
    /// `older_until`): no longer spendable, given back with the block's rest.
    expired: u64,
    /// For a block leased from the key's schedule ([`Lease::schedule`]), per tier: the
    /// instant the last unit held conforms, and the tier's emission interval (nanoseconds);
    /// the unit `p` places before the last conforms `p` intervals earlier. Empty: every unit
    /// held conforms now. With `older` units, those of the newest grant only.
    paced: Paced,
    /// The same for the `older` units (of the grant a prefetched block joined).
    older_paced: Paced,
    /// After Redis refused a lease of the key's schedule, per tier: the instant the key's
    /// TAT less the tolerance τ (when a unit charged then would conform), and the emission
    /// interval (nanoseconds). A check of `cost` is admitted no earlier than `cost`
    /// intervals after it on every tier, which the refusals while waiting say (the wait for
    /// a useful block alone can be shorter). Empty otherwise.
    waits: Paced,
}

/// Per tier, the instant a block's last unit conforms and the emission interval, in
/// nanoseconds (see `Held::paced`).
pub(crate) type Paced = smallvec::SmallVec<[(u64, u64); 2]>;

/// The instant the unit `after` places before the last of a paced block conforms on every
/// tier (0 for a block that is not paced).
fn pace_at(paced: &Paced, after: u64) -> u64 {
    paced.iter().map(|(end, t)| end.saturating_sub(after.saturating_mul(*t))).max().unwrap_or(0)
}

/// How many of the first of `n` units of a paced block (the last `n`) conform at `now`.
fn pace_count(paced: &Paced, n: u64, now: u64) -> u64 {
    paced
        .iter()
        .map(|(end, t)| n.saturating_sub(end.saturating_sub(now).div_ceil((*t).max(1))))
        .min()
        .unwrap_or(n)
}

impl Held {
    /// Now on the clock the block was granted on (see `Refusals::now`): never earlier than
    /// the server's clock, so a block ends early rather than late.
    fn now(&self, clock_now: Option<u64>) -> u64 {
        match (clock_now, self.sent) {
            (Some(now), _) => now,
            (None, Some(sent)) => self.decided.saturating_add(duration_to_nanos(sent.elapsed())),
            (None, None) => u64::MAX,
        }
    }

    fn live(&self, now: u64) -> bool {
        now < self.until && now >= self.decided
    }

    /// Units of the block spent (or given to checks), not to be given back.
    fn spent(&self) -> u64 {
        self.granted - self.left - self.expired
    }

    /// The instant the next `cost` units held all conform (the last of them, on every
    /// tier), 0 when they do now (a block not leased from the schedule). The `older` units
    /// are spent first, each no earlier than its own grant's pace.
    fn ready(&self, cost: u64) -> u64 {
        let older = self.older.min(self.left);
        let newer = self.left - older;
        let (from_older, from_newer) = (cost.min(older), cost.saturating_sub(older));
        let mut ready = 0;
        if from_older > 0 {
            ready = ready.max(pace_at(&self.older_paced, older - from_older));
        }
        if from_newer > 0 {
            ready = ready.max(pace_at(&self.paced, newer.saturating_sub(from_newer)));
        }
        ready
    }

    /// Units held that conform at `now`, in the order they are spent (those an instance can
    /// promise now).
    fn conforming(&self, now: u64) -> u64 {
        let older = self.older.min(self.left);
        let newer = self.left - older;
        let ready = pace_count(&self.older_paced, older, now);
        if ready < older { ready } else { older + pace_count(&self.paced, newer, now) }
    }

    /// The `older` units whose lifetime ended at `now` are no longer spendable.
    fn expire_older(&mut self, now: u64) {
        if self.older > 0 && now >= self.older_until {
            let gone = self.older.min(self.left);
            self.left -= gone;
            self.expired += gone;
            self.older = 0;
        }
    }
}

/// Whether, at `now`, this instance waits on a tier that had `rest` units left in Redis at
/// the last grant: it waits for a useful block (until `held.hold`), and the tier had less than
/// one. Such a tier's units in Redis are not this instance's to promise until the wait ends.
fn waits_on(held: &Held, now: u64) -> impl Fn(u64) -> bool + use<> {
    let (waiting, useful) = (now < held.hold, held.useful);
    move |rest| waiting && rest < useful
}

/// What a decision made from a block reports as a tier's `remaining`: the tier's rest in
/// Redis at the last lease call (`t.remaining` of the decision kept) plus `left`, the units
/// held that this instance can spend now, at most the tier's limit; `left` alone on a tier it
/// waits on (see [`waits_on`]).
fn promised(t: &crate::decision::TierDecision, left: u64, waits: bool) -> u64 {
    let rest = if waits { 0 } else { t.remaining };
    rest.saturating_add(left).min(t.limit())
}

/// What a check that took units from a block, or was refused while its instance waits, got.
pub(crate) struct Taken {
    /// The check's decision.
    pub(crate) decision: Decision,
    /// The instant Redis granted the units (when they were charged); `None` for a refusal.
    pub(crate) granted: Option<u64>,
    /// Whether this check starts the key's prefetch (see [`Lease::prefetch`]).
    pub(crate) prefetch: bool,
}

/// What a prefetch asks for.
pub(crate) struct Ahead {
    /// The largest block to take: what tops the units held up to the block asked for.
    pub(crate) block: u64,
    /// The useful block, as for [`Begin::useful`].
    pub(crate) useful: u64,
}

/// What a check that takes a new block asks for.
pub(crate) struct Begin {
    /// The largest block to take.
    pub(crate) block: u64,
    /// Units Redis grants of what the key has, however little, and the size of the block
    /// this instance waits for when it got less (0: the quarter rule alone, for windows).
    pub(crate) useful: u64,
    /// The previous block's rest, given back by the same call.
    pub(crate) rest: Option<Rest>,
    /// What Redis had left of the key at the last grant.
    pub(crate) room: Option<u64>,
}

/// What Redis granted a lease call.
pub(crate) struct Grant {
    /// Units granted (the check's included).
    pub(crate) take: u64,
    /// What Redis charged for them.
    pub(crate) charges: Charges,
    /// The instant Redis granted them (nanoseconds, on the clock the scripts decide with).
    pub(crate) at: u64,
    /// When a useful block will be there again (same clock; 0 for now).
    pub(crate) hold: u64,
    /// The useful block the call asked for ([`Begin::useful`]).
    pub(crate) useful: u64,
    /// Without an injected clock: this process's instant the call was sent.
    pub(crate) sent: Option<Instant>,
    /// For a lease of the key's schedule: per tier, when the last unit granted conforms, and
    /// the emission interval (see `Held::paced`); empty otherwise.
    pub(crate) paced: Paced,
}

/// A lease call's reply, decoded.
pub(crate) struct Reply {
    /// The decision of a check of the units granted (or refused).
    pub(crate) decision: Decision,
    /// What Redis charged for them; `None` for a refusal.
    pub(crate) charges: Option<Charges>,
    /// Units granted.
    pub(crate) take: u64,
    /// When a useful block will be there again (nanoseconds, same clock as `at`; 0 for now).
    pub(crate) hold: u64,
    /// The instant Redis decided.
    pub(crate) at: u64,
    /// For a lease of the key's schedule, granted: see [`Grant::paced`].
    pub(crate) paced: Paced,
}

/// Decodes the reply of a lease call Redis decided at `at`.
pub(crate) fn decode(
    prepared: &super::Prepared,
    policy: &Policy,
    reply: &[i64],
    at: u64,
) -> Result<Reply, crate::StoreError> {
    use crate::StoreError;
    let [reply @ .., take, hold] = reply else {
        return Err(StoreError::backend("short lease reply"));
    };
    let take = u64::try_from(*take).map_err(|_| StoreError::backend("negative lease"))?;
    let hold = u64::try_from(*hold).map_err(|_| StoreError::backend("negative hold"))?;
    // From the unit the decision's instant falls in, as the script counts.
    let unit = prepared.unit();
    let hold = if hold == 0 { 0 } else { (at / unit).saturating_add(hold).saturating_mul(unit) };
    let (decision, charges) = super::script::decode(policy, take, at, reply)?;
    let mut paced = Paced::new();
    let refused = charges.is_none() && decision.outcome == Outcome::Limited;
    if prepared.family == super::script::Family::Gcra && (charges.is_some() || refused) {
        use super::script::{HEAD, PER_TIER};
        // Each tier's TAT after the grant (in units from the unit `at` falls in): its last
        // unit conforms one tolerance (the burst's emission intervals) earlier. For a
        // refusal, the TAT unchanged: a unit charged at it would conform a tolerance earlier.
        for (i, t) in policy.tiers().iter().enumerate() {
            let tat = reply.get(HEAD + PER_TIER * i + 1).copied().unwrap_or(0);
            let tat = u64::try_from(tat).map_err(|_| StoreError::backend("negative TAT"))?;
            let interval = t.rate.period / t.rate.count.max(1);
            let tat = (at / unit).saturating_add(tat).saturating_mul(unit);
            let tau = interval.saturating_mul(t.rate.burst).saturating_mul(unit);
            paced.push((tat.saturating_sub(tau), interval.saturating_mul(unit)));
        }
    }
    Ok(Reply { decision, charges, take, hold, at, paced })
}

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

    fn shard(&self, key: &Key) -> &Shard {
        #[allow(clippy::cast_possible_truncation)]
        &self.shards[(self.hasher.hash_one(key) % SHARDS as u64) as usize]
    }

    /// The slot of `key`, made if needed; `None` when the binding holds as many keys as it
    /// may and none can be dropped (the check is then exact).
    pub(crate) fn slot(&self, key: &Key) -> Option<Arc<Slot>> {
        let mut map = self.shard(key).lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = map.get(key) {
            return Some(Arc::clone(slot));
        }
        if map.len() >= self.per_shard {
            // A slot nobody uses that holds nothing to give back.
            let idle = map
                .iter()
                .find(|(_, s)| {
                    Arc::strong_count(s) == 1
                        && s.held.lock().unwrap_or_else(PoisonError::into_inner).charges.is_none()
                })
                .map(|(k, _)| k.clone())?;
            map.remove(&idle);
        }
        let slot = Arc::new(Slot::default());
        slot.held.lock().unwrap_or_else(PoisonError::into_inner).key = Some(key.clone());
        map.insert(key.clone(), Arc::clone(&slot));
        Some(slot)
    }

    /// Takes `cost` units of `key`'s block, if this process holds one that is live and has
    /// them: the check's decision, made here, and the instant Redis granted the block (when
    /// the units were charged). Or, when the block cannot serve the check and this process
    /// waits for a useful block, the refusal, with no instant. Starts the key's prefetch
    /// when it is due (see [`Lease::prefetch`]).
    pub(crate) fn spend_key(
        self: &Arc<Self>,
        key: &Key,
        cost: u64,
        clock_now: Option<u64>,
    ) -> Option<(Decision, Option<u64>)> {
        let slot = {
            let map = self.shard(key).lock().unwrap_or_else(PoisonError::into_inner);
            Arc::clone(map.get(key)?)
        };
        self.spend(&slot, cost, clock_now)
    }

    /// [`spend_key`](Self::spend_key) on a slot at hand.
    pub(crate) fn spend(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        cost: u64,
        clock_now: Option<u64>,
    ) -> Option<(Decision, Option<u64>)> {
        let taken = self.take(slot, cost, clock_now)?;
        if taken.prefetch {
            self.start_prefetch(slot);
        }
        Some((taken.decision, taken.granted))
    }

    /// [`spend`](Self::spend) without starting the prefetch it may call for (`prefetch`
    /// says whether it does; the slot is then marked as fetching).
    pub(crate) fn take(&self, slot: &Slot, cost: u64, clock_now: Option<u64>) -> Option<Taken> {
        let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
        if cost == 0 {
            return None;
        }
        let now = held.now(clock_now);
        held.expire_older(now);
        if held.left < cost {
            let refused = self.held_refusal(&held, now, cost)?;
            let prefetch = self.wants_prefetch(&mut held, now);
            drop(held);
            self.counters.held.fetch_add(1, Ordering::Relaxed);
            self.metrics.held();
            return Some(Taken { decision: refused, granted: None, prefetch });
        }
        if !held.live(now) {
            return None;
        }
        let ready = held.ready(cost);
        if now < ready {
            // Units leased from the key's schedule that do not conform yet: refused until
            // the last of the check's conforms, exactly.
            let refused = Self::refusal(&held, now, ready)?;
            let prefetch = self.wants_prefetch(&mut held, now);
            drop(held);
            self.counters.held.fetch_add(1, Ordering::Relaxed);
            self.metrics.held();
            return Some(Taken { decision: refused, granted: None, prefetch });
        }
        held.left -= cost;
        held.older = held.older.saturating_sub(cost);
        let prefetch = self.wants_prefetch(&mut held, now);
        let mut d = held.decision.clone()?;
        let (decided, left) = (held.decided, held.conforming(now));
        let waits = waits_on(&held, now);
        let elapsed = now - decided;
        drop(held);
        d.outcome = Outcome::Allowed;
        d.delay = 0;
        d.retry_after = NONE;
        for t in &mut d.tiers {
            // Redis's rest at the last lease call (the decision kept is Redis's) less what
            // this instance spent since: see `Lease`, "Headers".
            t.remaining = promised(t, left, waits(t.remaining));
            t.reset_after = t.reset_after.saturating_sub(elapsed);
            t.retry_after = NONE;
            t.violated = false;
        }
        self.counters.local.fetch_add(1, Ordering::Relaxed);
        self.metrics.local();
        Some(Taken { decision: d, granted: Some(decided), prefetch })
    }

    /// Whether a check at `now` starts the key's prefetch (and marks it as fetching): when
    /// prefetching, none is in flight, the key's blocks have grown (to [`PREFETCH_FROM`]), half of
    /// the block this instance asks for is spent, and a useful block is at most a round trip
    /// away (half a round trip: the call reaches Redis about then, so it finds the useful
    /// block there, and this instance's checks wait for the rest of the round trip at most).
    fn wants_prefetch(&self, held: &mut Held, now: u64) -> bool {
        let due = self.prefetching
            && !held.fetching
            && held.next >= PREFETCH_FROM.min(self.config.max_block).max(2)
            && held.decision.is_some()
            && held.left.saturating_mul(self.ahead_part()) <= held.next
            && (held.left == 0 || held.live(now))
            // Units of an earlier block still held keep their own lifetime, which a second
            // merge could not: the next prefetch waits until they are spent or expired.
            && held.older == 0
            && now >= held.hold.saturating_sub(self.round_trip.load(Ordering::Relaxed) / 2);
        if due {
            held.fetching = true;
        }
        due
    }

    /// A prefetch starts when `1 / ahead_part()` of the block asked for is left: half, or an
    /// eighth when leasing from the key's schedule, whose blocks are paced (its units
    /// conform one after the other, so what is left lasts), and whose prefetch, topping up
    /// what is held, is then most of a block instead of half of one.
    fn ahead_part(&self) -> u64 {
        if self.horizon > 0 { 8 } else { 2 }
    }

    /// Spawns the call that takes the key's next block ahead of need (the slot is marked as
    /// fetching; without a runtime, or a way to call Redis, the mark is dropped).
    fn start_prefetch(self: &Arc<Self>, slot: &Arc<Slot>) {
        let handle = tokio::runtime::Handle::try_current().ok().filter(|_| self.back.is_some());
        let Some(handle) = handle else {
            slot.held.lock().unwrap_or_else(PoisonError::into_inner).fetching = false;
            return;
        };
        // Counted when started, so that the check that starts it sees it in the stats.
        self.counters.prefetched.fetch_add(1, Ordering::Relaxed);
        handle.spawn(Arc::clone(self).prefetch(Arc::clone(slot)));
    }

    /// The prefetch: with the slot's refill lock held (so that it is the key's only call of
    /// this instance in flight), takes what tops the units held up to the block asked for,
    /// and adds it to the block.
    async fn prefetch(self: Arc<Self>, slot: Arc<Slot>) {
        /// Clears the slot's mark however the prefetch ends.
        struct Fetching<'a>(&'a Slot);
        impl Drop for Fetching<'_> {
            fn drop(&mut self) {
                self.0.held.lock().unwrap_or_else(PoisonError::into_inner).fetching = false;
            }
        }
        let Some(back) = &self.back else { return };
        let _fetching = Fetching(&slot);
        let _refill = slot.refill.lock().await;
        let clock_now = || back.inner.settings.clock.as_ref().map(crate::clock::AnyClock::now);
        let Some((ahead, key)) = self.ahead(&slot, clock_now()) else {
            // No longer due: no call made.
            self.counters.prefetched.fetch_sub(1, Ordering::Relaxed);
            return;
        };
        let record = self.record(&back.prepared, 1, ahead.block, ahead.useful, None);
        let keys = back.prepared.keys(state_key(&back.key_parts, &back.key_names, &key));
        let (answered, sent) = self.call(&back.inner, &back.prepared, keys, record).await;
        match answered {
            Ok(Reply { decision, charges: Some(charges), take, hold, at, paced }) => {
                let grant = Grant { take, charges, at, hold, useful: ahead.useful, sent, paced };
                self.prefetched(&slot, decision, grant);
            }
            Ok(Reply { decision, charges: None, hold, at, paced, .. }) => {
                self.prefetch_refused(&slot, &decision, at, hold, ahead.useful, paced);
            }
            Err(error) => {
                tracing::debug!(%error, "tollgate: a lease prefetch failed; the next block is taken when needed");
            }
        }
    }

    /// What a prefetch asks for, with the key: `None` when it is no longer due (a check took
    /// a new block meanwhile, or the block cannot grow).
    fn ahead(&self, slot: &Slot, clock_now: Option<u64>) -> Option<(Ahead, Key)> {
        let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
        let now = held.now(clock_now);
        held.expire_older(now);
        if held.left.saturating_mul(self.ahead_part()) > held.next
            || (held.left > 0 && !held.live(now))
            || held.older > 0
        {
            return None;
        }
        let size = held.next.saturating_mul(2).min(self.config.max_block);
        let block = size.checked_sub(held.left).filter(|b| *b > 0)?;
        let useful = self.useful_now().min(block);
        Some((Ahead { block, useful }, held.key.clone()?))
    }

    /// A prefetch was granted: its units join the block (those held are spent first, and
    /// keep their lifetime), and the block asked for next doubles.
    fn prefetched(&self, slot: &Slot, decision: Decision, grant: Grant) {
        let Grant { take, charges, at, hold, useful, sent, paced } = grant;
        let hold = self.wait_until(at, hold, take, useful);
        let until = at.saturating_add(self.lifetime_ns);
        {
            let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
            let room = decision.tiers.iter().map(|t| t.remaining).min();
            match &mut held.charges {
                Some(old) => {
                    // Refunds do not depend on the instant of the charge: one settlement
                    // gives back what is left of both.
                    for (o, c) in old.iter_mut().zip(&charges) {
                        o.cost = o.cost.saturating_add(c.cost);
                    }
                    held.older_until = if held.older > 0 { held.older_until } else { held.until };
                    // The units held are spent first, each at its own grant's pace (a
                    // prefetch starts only once no `older` units are held).
                    held.older_paced = std::mem::replace(&mut held.paced, paced);
                    held.waits.clear();
                    held.older = held.left;
                    held.granted += take;
                    held.left += take;
                }
                None => {
                    held.charges = Some(charges);
                    held.granted = take;
                    held.left = take;
                    held.older = 0;
                    held.expired = 0;
                    held.paced = paced;
                    held.older_paced.clear();
                    held.waits.clear();
                }
            }
            held.decided = at;
            held.sent = sent;
            held.until = until;
            held.hold = hold;
            held.useful = useful;
            held.decision = Some(decision);
            held.room = room;
            held.next = held.next.saturating_mul(2).min(self.config.max_block);
        }
        self.counters.grants.fetch_add(1, Ordering::Relaxed);
        self.counters.units_granted.fetch_add(take, Ordering::Relaxed);
        self.metrics.granted(take);
    }

    /// Redis refused a prefetch at `at` (the key has nothing left): the block held is spent
    /// as it is, and then this instance waits as after a refused lease call (`waits`: see
    /// `Held::waits`).
    fn prefetch_refused(
        &self,
        slot: &Slot,
        decision: &Decision,
        at: u64,
        hold: u64,
        useful: u64,
        waits: Paced,
    ) {
        if decision.outcome != Outcome::Limited {
            return;
        }
        let until = if self.horizon > 0 {
            // Leasing the schedule: until a useful block fits the horizon again, as Redis
            // said (as for a refused lease call, see `refused`).
            hold
        } else {
            let until = self.wait_until(at, hold, 0, useful);
            match decision.retry_after {
                NONE => until,
                exact => until.max(at.saturating_add(exact)),
            }
        };
        let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.hold = held.hold.max(until);
        if self.horizon > 0 {
            held.waits = waits;
        }
    }

    /// One lease call to Redis (`record` on `keys`): its reply decoded, and the instant it was
    /// sent (without an injected clock). An answered call's round trip joins the average a
    /// prefetch is timed by; a failed one (a timeout) says nothing of it.
    pub(crate) async fn call(
        &self,
        inner: &super::Inner,
        prepared: &super::Prepared,
        keys: Vec<String>,
        record: Vec<f64>,
    ) -> (Result<Reply, crate::StoreError>, Option<Instant>) {
        let clock_now = || inner.settings.clock.as_ref().map(crate::clock::AnyClock::now);
        let (sent, before) = (inner.settings.clock.is_none().then(Instant::now), clock_now());
        let answered = inner.submit(prepared, keys, record, prepared.lease_reply_len()).await;
        if answered.is_ok() {
            self.observe(sent, before, clock_now());
        }
        let decoded = answered.and_then(|(reply, at)| decode(prepared, &self.policy, &reply, at));
        let decoded = decoded.map(|mut r| {
            if self.horizon == 0 {
                r.paced.clear();
            }
            r
        });
        (decoded, sent)
    }

    /// A lease call of this binding went to Redis at `before` (or `sent`, without an injected
    /// clock) and was answered at `after`: the round trip's moving average.
    fn observe(&self, sent: Option<Instant>, before: Option<u64>, after: Option<u64>) {
        let took = match (sent, before, after) {
            (Some(sent), _, _) => duration_to_nanos(sent.elapsed()),
            (None, Some(before), Some(after)) => after.saturating_sub(before),
            _ => return,
        };
        let old = self.round_trip.load(Ordering::Relaxed);
        let new = if old == 0 { took } else { (old.saturating_mul(3).saturating_add(took)) / 4 };
        self.round_trip.store(new, Ordering::Relaxed);
    }

    /// The refusal of a check the block cannot serve while this instance waits for a useful
    /// block (until `held.hold`): limited, `retry_after` the rest of the wait (when this
    /// instance asks Redis again), `remaining` 0 on every tier (what it can promise), the
    /// tiers that had the least left at the grant violated; `None` when it does not wait.
    fn held_refusal(&self, held: &Held, now: u64, cost: u64) -> Option<Decision> {
        if now >= held.hold || now < held.decided {
            return None;
        }
        // Leasing the schedule, the wait for a useful block can end before this check's
        // units conform: it is then told when they do, as an exact check would be (after a
        // refusal, `cost` units past the key's schedule; holding fewer than `cost` units,
        // the rest past the last held, which the next call gives back and takes again).
        let after = cost.saturating_sub(held.left);
        let conforms = held
            .waits
            .iter()
            .map(|(base, t)| base.saturating_add(cost.saturating_mul(*t)))
            .chain(held.paced.iter().map(|(end, t)| end.saturating_add(after.saturating_mul(*t))))
            .max()
            .unwrap_or(0);
        Self::refusal(held, now, held.hold.max(conforms))
    }

    /// The refusal, at `now`, of a check this instance refuses until `until`: see
    /// [`held_refusal`](Self::held_refusal).
    fn refusal(held: &Held, now: u64, until: u64) -> Option<Decision> {
        let mut d = held.decision.clone()?;
        let (elapsed, retry) = (now.saturating_sub(held.decided), until - now);
        let least = d.tiers.iter().map(|t| t.remaining).min().unwrap_or(0);
        d.outcome = Outcome::Limited;
        d.delay = 0;
        d.retry_after = retry;
        for t in &mut d.tiers {
            let binding = t.remaining == least;
            t.remaining = 0;
            t.reset_after = t.reset_after.saturating_sub(elapsed);
            t.retry_after = if binding { retry } else { NONE };
            t.violated = binding;
        }
        Some(d)
    }

    /// Before a check of `cost` takes a new block (with the slot's refill lock held): the
    /// size to ask for, and the rest of the previous block, taken out so that nothing spends
    /// it while it is given back.
    pub(crate) fn begin(&self, slot: &Slot, cost: u64, clock_now: Option<u64>) -> Begin {
        let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
        let now = held.now(clock_now);
        let next = if held.granted == 0 {
            held.next.max(1)
        } else if held.left < cost || held.left == 0 {
            if held.live(now) {
                // Spent (or too little left for this check) within its lifetime: demand
                // outran the block. Doubles what was asked for: Redis may have granted less
                // (what the key had), which says nothing of the demand.
                held.next.max(held.granted).saturating_mul(2)
            } else {
                // Spent, and asked again only after its lifetime (a key checked now and then):
                // a larger block would only be given back by a call of its own.
                held.granted
            }
        } else if held.live(now) {
            held.granted
        } else {
            // Ended with units left: what this process spent of it in a lifetime.
            held.spent().max(1)
        };
        held.next = next.min(self.config.max_block);
        let rest = self.take_rest(&mut held);
        let block = held.next.max(cost);
        // A useful block covers the check asking (a weighted check waits for its own cost,
        // so a refusal's wait is never shorter than that check's); 0 stays 0 (windows).
        let useful = if self.useful == 0 { 0 } else { self.useful_now().max(cost).min(block) };
        Begin { block, useful, rest, room: held.room }
    }

    fn take_rest(&self, held: &mut Held) -> Option<Rest> {
        let charges = held.charges.take()?;
        let rest = (held.left + held.expired > 0).then(|| Rest {
            granted: held.granted,
            spent: held.spent(),
            charges,
        });
        held.left = 0;
        held.granted = 0;
        held.older = 0;
        held.expired = 0;
        held.decision = None;
        held.paced.clear();
        held.older_paced.clear();
        rest
    }

    /// Redis granted a block for a check of `cost` (which takes its part now): keeps the
    /// rest as the slot's block and returns the check's decision.
    pub(crate) fn granted(
        &self,
        slot: &Slot,
        cost: u64,
        mut decision: Decision,
        grant: Grant,
    ) -> Decision {
        let Grant { take, charges, at, hold, useful, sent, paced } = grant;
        let hold = self.wait_until(at, hold, take, useful);
        let until = at.saturating_add(self.lifetime_ns).min(self.window_end(at));
        // A block of the key's schedule whose first units conform only later: the check
        // takes none of it, and is refused until its own conform.
        let ready = pace_at(&paced, take.saturating_sub(cost));
        let early = at < ready;
        let left = if early { take } else { take.saturating_sub(cost) };
        {
            let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
            let (next, key, fetching) = (held.next, held.key.take(), held.fetching);
            let room = decision.tiers.iter().map(|t| t.remaining).min();
            *held = Held {
                left,
                granted: take,
                // A block spent at once leaves nothing to give back: its slot may be dropped.
                charges: (left > 0).then_some(charges),
                decided: at,
                sent,
                until,
                hold,
                useful,
                decision: Some(decision.clone()),
                next,
                room,
                key,
                fetching,
                older: 0,
                older_until: 0,
                expired: 0,
                paced,
                older_paced: Paced::new(),
                waits: Paced::new(),
            };
            if early {
                let refused = Self::refusal(&held, at, ready);
                drop(held);
                self.counters.grants.fetch_add(1, Ordering::Relaxed);
                self.counters.units_granted.fetch_add(take, Ordering::Relaxed);
                self.metrics.granted(take);
                // Decided on Redis (the call that took the block), not refused locally.
                if let Some(refused) = refused {
                    return refused;
                }
                decision.outcome = Outcome::Limited;
                decision.retry_after = ready - at;
                return decision;
            }
            // What this instance can promise now: the units of the block that conform.
            let left = held.conforming(at);
            let waits = waits_on(&held, at);
            drop(held);
            self.counters.grants.fetch_add(1, Ordering::Relaxed);
            self.counters.units_granted.fetch_add(take, Ordering::Relaxed);
            self.metrics.granted(take);
            // What exact mode reports at this instant, what Redis has left plus the block's
            // rest, but on a tier this instance now waits on, the block's rest alone.
            for t in &mut decision.tiers {
                t.remaining = promised(t, left, waits(t.remaining));
            }
            decision
        }
    }

    /// Redis refused a lease call at `at` (its `decision`, exact): when a useful block is
    /// further away than the refusal's own wait (`hold`, same clock), this instance waits for
    /// it, refusing the key's checks itself until then, and the decision's `retry_after` says
    /// so (raised to the wait, on the violated tiers too).
    #[allow(clippy::too_many_arguments)] // the reply's parts, as `granted` takes them in a `Grant`
    pub(crate) fn refused(
        &self,
        slot: &Slot,
        mut decision: Decision,
        at: u64,
        hold: u64,
        useful: u64,
        sent: Option<Instant>,
        waits: Paced,
    ) -> Decision {
        if hold <= at || decision.outcome != Outcome::Limited {
            return decision;
        }
        // Never shorter than Redis's own wait for the check refused; but a lease of the
        // key's schedule waits only until a useful block fits its horizon again (exactly what
        // Redis said), when its units are leased, paced, and the check refused until its own
        // conform.
        let hold = match decision.retry_after {
            _ if self.horizon > 0 => hold,
            NONE => self.wait_until(at, hold, 0, useful),
            exact => self.wait_until(at, hold, 0, useful).max(at.saturating_add(exact)),
        };
        {
            let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
            // What a block held is given back by the call that was refused: none is left.
            debug_assert!(held.charges.is_none());
            held.decided = at;
            held.sent = sent;
            held.hold = hold;
            held.decision = Some(decision.clone());
            held.waits = if self.horizon > 0 { waits } else { Paced::new() };
        }
        let wait = hold - at;
        if decision.retry_after == NONE || decision.retry_after < wait {
            decision.retry_after = wait;
        }
        for t in decision.tiers.iter_mut().filter(|t| t.violated) {
            if t.retry_after == NONE || t.retry_after < wait {
                t.retry_after = wait;
            }
        }
        decision
    }

    /// Until when this instance waits after a call at `at` that got `took` units where it
    /// asked for a useful block of `useful`, Redis saying a useful block is back at `hold`.
    /// Other instances take from the key too: one that got a share of what built up waits in
    /// proportion (`useful / took` times the wait), so that each call finds about a useful
    /// block, but never longer than [`longest_wait`] (or the wait Redis said, if longer).
    fn wait_until(&self, at: u64, hold: u64, took: u64, useful: u64) -> u64 {
        if hold <= at || took >= useful {
            return hold;
        }
        let wait = hold - at;
        let longer = u128::from(wait) * u128::from(useful) / u128::from(took.max(1));
        let longer = u64::try_from(longer).unwrap_or(u64::MAX);
        at.saturating_add(longer.min(wait.max(self.longest_wait)))
    }

    /// The useful block a lease call asks for now (0 for windows): what every rate tier
    /// refills in [`USEFUL_SPAN`] or in two round trips of this binding's lease calls, whichever
    /// is longer (a quarter of the burst and `max_block` at most, as [`useful_block`]). An
    /// instance takes at most one block per round trip on a key, so a block smaller than what
    /// the key refills in a round trip cannot keep up with the key's rate, and one twice that
    /// leaves the instance a round trip to ask for the next; larger blocks are also fewer
    /// calls per unit.
    fn useful_now(&self) -> u64 {
        let span = self.round_trip.load(Ordering::Relaxed).saturating_mul(2);
        if self.useful == 0 || span <= duration_to_nanos(USEFUL_SPAN) {
            return self.useful;
        }
        useful_over(&self.policy, self.config.max_block, span)
    }

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

    /// The earliest end of the window an instant falls in, over the fixed window and
    /// calendar tiers; `u64::MAX` without any.
    fn window_end(&self, at: u64) -> u64 {
        let unit = self.policy.unit();
        let units = at / unit;
        let fixed = self.policy.algorithm() == Algorithm::FixedWindow;
        self.policy
            .tiers()
            .iter()
            .filter_map(|t| match &t.kind {
                Kind::Rate if fixed => {
                    let p = t.rate.period;
                    Some((units / p).saturating_add(1).saturating_mul(p).saturating_mul(unit))
                }
                Kind::Calendar(spec) => {
                    let end = u64::try_from(calendar::window_at(spec, at).1).unwrap_or(0);
                    Some(end.saturating_mul(1_000_000_000))
                }
                _ => None,
            })
            .min()
            .unwrap_or(u64::MAX)
    }

    /// The slots whose block ended (every slot holding a block, with `all`), and with `all`
    /// their rests taken out; idle slots holding nothing are dropped.
    fn ended(&self, clock_now: Option<u64>, all: bool) -> (Vec<Arc<Slot>>, Vec<(Key, Rest)>) {
        let (mut slots, mut rests) = (Vec::new(), Vec::new());
        for shard in &*self.shards {
            let mut map = shard.lock().unwrap_or_else(PoisonError::into_inner);
            map.retain(|key, slot| {
                let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
                let now = held.now(clock_now);
                if all {
                    if let Some(rest) = self.take_rest(&mut held) {
                        rests.push((key.clone(), rest));
                    }
                } else if held.charges.is_some() && !held.live(now) {
                    slots.push(Arc::clone(slot));
                }
                // Kept while in use, or while its block (or its history) may still matter.
                Arc::strong_count(slot) > 1 || held.charges.is_some() || held.live(now)
            });
        }
        (slots, rests)
    }

    /// Gives back the rests of the blocks that ended, each with its slot's refill lock held
    /// until Redis answers, so that the key's next block is taken after it.
    pub(crate) async fn sweep(&self) {
        let Some(back) = &self.back else { return };
        let clock_now = || back.inner.settings.clock.as_ref().map(crate::clock::AnyClock::now);
        let (slots, _) = self.ended(clock_now(), false);
        for slot in slots {
            let _refill = slot.refill.lock().await;
            let rest = {
                let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
                let now = held.now(clock_now());
                if held.live(now) {
                    None
                } else {
                    // The next block: what was spent of this one in its lifetime.
                    held.next = held.spent().clamp(1, self.config.max_block);
                    self.take_rest(&mut held).map(|r| (held.key.clone(), r))
                }
            };
            if let Some((Some(key), rest)) = rest {
                let units = rest.granted - rest.spent;
                if back.give(&key, &rest).await.is_ok() {
                    self.returned(units);
                }
            }
        }
    }

    /// Whether the sweeper must be started (once).
    pub(crate) fn start_sweeper(&self) -> bool {
        !self.sweeping.swap(true, Ordering::AcqRel)
    }

    pub(crate) fn lifetime(&self) -> Duration {
        self.config.lifetime
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

    /// Keys holding a slot now.
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len()).sum()
    }
}

impl Drop for Leases {
    fn drop(&mut self) {
        let Some(back) = self.back.take() else { return };
        let (_, rests) = self.ended(None, true);
        if rests.is_empty() {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
        handle.spawn(async move {
            for (key, rest) in rests {
                if let Err(error) = back.give(&key, &rest).await {
                    tracing::debug!(%error, "tollgate: could not give a leased block back; its units come back with the key's state");
                }
            }
        });
    }
}

/// What giving a block back needs.
pub(crate) struct Back {
    pub(crate) inner: Arc<super::Inner>,
    pub(crate) prepared: Arc<super::Prepared>,
    pub(crate) key_parts: (String, String),
    pub(crate) key_names: super::KeyNames,
    /// The binding's local refusals, which a give-back must not leave a refusal of its key
    /// in (see `RedisPolicy::forgetting`).
    pub(crate) refusals: Option<Arc<super::Refusals>>,
}

impl Back {
    /// Settles the block of `key` at what was spent of it (a give-back of this instance: a
    /// refusal of the key held here is forgotten, as when the next block gives the rest back).
    async fn give(&self, key: &Key, rest: &Rest) -> Result<(), crate::StoreError> {
        let hash = self.refusals.as_ref().map_or(0, |r| r.hash(key));
        let _forgetting = super::forgetting(self.refusals.as_deref(), &self.inner, hash);
        let record = self.prepared.settle(&rest.charges, |_| rest.granted, |_| rest.spent);
        let state_key = state_key(&self.key_parts, &self.key_names, key);
        let keys = self.prepared.keys(state_key);
        self.inner.submit(&self.prepared, keys, record, 0).await.map(drop)
    }
}

/// Gives back ended blocks every lifetime while the binding lives.
pub(crate) async fn sweeper(leases: Weak<Leases>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(leases) = leases.upgrade() else { return };
        leases.sweep().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Charge;
    use crate::decision::{TierDecision, Tiers};
    use crate::quota::{Calendar, Concurrency, Penalty, Quota};
    use smallvec::smallvec;

    const MS: u64 = 1_000_000;
    const S: u64 = 1_000 * MS;

    /// What Redis answers to a grant: admitted, with `remaining` left in Redis.
    fn grant(limit: u64, remaining: u64, reset: u64) -> Decision {
        let tiers: Tiers = smallvec![TierDecision::new(limit, remaining, reset, None, false)];
        Decision::new(Outcome::Allowed, 0, None, tiers)
    }

    /// What Redis answers to a grant at `_at` leaving `remaining` (the reset is immaterial).
    fn grant_at(remaining: u64, _at: u64) -> Decision {
        grant(4_000, remaining, 10 * MS)
    }

    fn charges(take: u64, at: u64) -> Charges {
        smallvec![Charge { at, cost: take, id: 0 }]
    }

    /// A grant of `take` units at `at` (charged as `charged` units), waiting until `hold`.
    fn block(take: u64, charged: u64, at: u64, hold: u64) -> Grant {
        Grant {
            take,
            charges: charges(charged, at),
            at,
            hold,
            useful: 1,
            sent: None,
            paced: Paced::new(),
        }
    }

    /// A block of the key's schedule: each unit is spent once it conforms (refused until
    /// then, with the exact wait), `remaining` counts the units that conform now, and a
    /// prefetched block joining it keeps each grant's own pace.
    #[test]
    fn units_of_the_schedule_are_spent_at_their_own_grants_pace() {
        let p = Policy::single("p", Quota::per_second(100_000).with_burst(1_000)).unwrap();
        let l = Arc::new(Leases::new(&p, Lease::new().max_block(64).schedule(true)));
        assert!(l.horizon > 0);
        let slot = l.slot(&Key::text("k")).unwrap();
        let t = 10_000; // T: 10 µs
        // 8 units granted at S: the check's own conforms now, the last at S + 70 µs.
        let mut g = block(8, 8, S, 0);
        g.paced = smallvec![(S + 7 * t, t)];
        let d = l.granted(&slot, 1, grant_at(0, S), g);
        assert_eq!((d.outcome, d.tiers[0].remaining), (Outcome::Allowed, 0));
        let (d, granted) = l.spend(&slot, 1, Some(S)).unwrap();
        assert_eq!((d.outcome, d.retry_after, granted), (Outcome::Limited, t, None));
        assert_eq!((d.tiers[0].remaining, d.tiers[0].retry_after), (0, t));
        // 5 ns after the second unit's instant: the first two conform.
        let (d, granted) = l.spend(&slot, 1, Some(S + 2 * t + 5)).unwrap();
        assert_eq!((d.outcome, d.tiers[0].remaining, granted), (Outcome::Allowed, 1, Some(S)));
        // Two more (the units of 20 and 30 µs) need the later one's instant.
        let (d, _) = l.spend(&slot, 2, Some(S + 2 * t + 5)).unwrap();
        assert_eq!((d.outcome, d.retry_after), (Outcome::Limited, t - 5));
        // A prefetch at 30 µs takes the next 4 units of the schedule, at 90 to 120 µs
        // (another instance took 80 µs): the 6 held keep their instants, 20 to 70 µs.
        let mut g = block(4, 4, S + 3 * t, 0);
        g.paced = smallvec![(S + 12 * t, t)];
        l.prefetched(&slot, grant_at(0, S + 3 * t), g);
        for remaining in (0..6).rev() {
            let (d, granted) = l.spend(&slot, 1, Some(S + 7 * t)).unwrap();
            assert_eq!((d.outcome, d.tiers[0].remaining), (Outcome::Allowed, remaining));
            assert_eq!(granted, Some(S + 3 * t), "the block's instant is the last grant's");
        }
        let (d, _) = l.spend(&slot, 1, Some(S + 7 * t)).unwrap();
        assert_eq!((d.outcome, d.retry_after), (Outcome::Limited, 2 * t));
        for remaining in [1, 0] {
            let (d, _) = l.spend(&slot, 1, Some(S + 10 * t)).unwrap();
            assert_eq!((d.outcome, d.tiers[0].remaining), (Outcome::Allowed, remaining));
        }
        let (d, _) = l.spend(&slot, 1, Some(S + 11 * t - 1)).unwrap();
        assert_eq!((d.outcome, d.retry_after), (Outcome::Limited, 1));
        let (d, _) = l.spend(&slot, 1, Some(S + 11 * t)).unwrap();
        assert_eq!((d.outcome, d.tiers[0].remaining), (Outcome::Allowed, 0));
        let (d, _) = l.spend(&slot, 1, Some(S + 11 * t)).unwrap();
        assert_eq!((d.outcome, d.retry_after), (Outcome::Limited, t));
        let (d, _) = l.spend(&slot, 1, Some(S + 12 * t)).unwrap();
        assert_eq!((d.outcome, d.tiers[0].remaining), (Outcome::Allowed, 0));
        // Spent, with no wait: the next check asks Redis.
        assert!(l.spend(&slot, 1, Some(S + 12 * t)).is_none());
        assert_eq!(l.stats().refused_locally, 5);
    }

    #[test]
    fn blocks_double_while_spent_and_shrink_to_what_a_lifetime_spent() {
        let p = Policy::single("p", Quota::per_second(100)).unwrap();
        let l = Arc::new(Leases::new(
            &p,
            Lease::new().max_block(16).lifetime(Duration::from_millis(10)),
        ));
        let key = Key::text("k");
        let slot = l.slot(&key).unwrap();
        let mut sizes = Vec::new();
        for _ in 0..6 {
            let b = l.begin(&slot, 1, Some(S));
            assert!(b.rest.is_none(), "every block was spent");
            sizes.push(b.block);
            let d = l.granted(&slot, 1, grant(100, 50, S), block(b.block, b.block, S, 0));
            // What exact mode reports at the grant: Redis's rest plus the block's.
            assert_eq!(d.tiers()[0].remaining(), (50 + b.block - 1).min(100));
            for left in (0..b.block - 1).rev() {
                let (d, granted_at) = l.spend(&slot, 1, Some(S + MS)).unwrap();
                assert_eq!(granted_at, Some(S));
                // Then Redis's rest at the grant plus what this instance still holds: never
                // the block alone (50 left in Redis), and the reset counted down.
                assert_eq!(d.tiers()[0].remaining(), 50 + left);
                assert_eq!(d.tiers()[0].reset_after(), Duration::from_nanos(S - MS));
            }
            assert!(l.spend(&slot, 1, Some(S + MS)).is_none());
        }
        assert_eq!(sizes, [1, 2, 4, 8, 16, 16]);
        // A block of 16 with 5 spent when its lifetime ends: the next is 5, and the 11 left
        // are given back by the call that takes it.
        let b = l.begin(&slot, 1, Some(S));
        l.granted(&slot, 1, grant(100, 50, S), block(b.block, 16, S, 0));
        for _ in 0..4 {
            assert!(l.spend(&slot, 1, Some(S + 9 * MS)).is_some());
        }
        assert!(l.spend(&slot, 1, Some(S + 10 * MS)).is_none(), "never after its lifetime");
        assert!(l.spend(&slot, 1, Some(S - 1)).is_none(), "nor before its grant");
        let b = l.begin(&slot, 1, Some(S + 10 * MS));
        assert_eq!(b.block, 5);
        let rest = b.rest.unwrap();
        assert_eq!((rest.granted, rest.spent), (16, 5));
        // A check costing more than the largest block asks for its cost.
        assert_eq!(l.begin(&slot, 40, Some(S + 10 * MS)).block, 40);
        let stats = l.stats();
        assert_eq!((stats.grants, stats.units_granted), (7, 1 + 2 + 4 + 8 + 16 + 16 + 16));
    }

    #[test]
    fn the_useful_block_is_two_milliseconds_of_refill_and_a_quarter_of_the_burst_at_most() {
        let gcra = |rate, burst| Policy::single("p", Quota::per_second(rate).with_burst(burst));
        assert_eq!(useful_block(&gcra(400_000, 4_000).unwrap(), 2_048), 800);
        assert_eq!(useful_block(&gcra(400_000, 4_000).unwrap(), 512), 512);
        assert_eq!(useful_block(&gcra(400_000, 4_000).unwrap(), 64), 64);
        assert_eq!(useful_block(&gcra(400_000, 800).unwrap(), 512), 200);
        // A slow key waits for its next unit: a refusal's own wait.
        assert_eq!(useful_block(&gcra(100, 100).unwrap(), 512), 1);
        let two = Policy::builder("p")
            .tier("second", Quota::per_second(400_000).with_burst(4_000))
            .tier("minute", Quota::per_minute(6_000_000).with_burst(1_200))
            .build()
            .unwrap();
        assert_eq!(useful_block(&two, 512), 200);
        let bucket = Policy::builder("b")
            .algorithm(Algorithm::TokenBucket)
            .tier("second", Quota::per_second(50_000).with_burst(10_000))
            .build()
            .unwrap();
        assert_eq!(useful_block(&bucket, 512), 100);
        let window = Policy::builder("w")
            .algorithm(Algorithm::FixedWindow)
            .tier("second", Quota::per_second(400_000))
            .build()
            .unwrap();
        assert_eq!(useful_block(&window, 512), 0);
    }

    #[test]
    fn the_useful_block_grows_to_two_round_trips_of_refill_when_calls_take_longer() {
        // 400,000 a second, a burst of 40,000, blocks of at most 4,096: 800 units refill in
        // 2 ms.
        let p = Policy::single("p", Quota::per_second(400_000).with_burst(40_000)).unwrap();
        let l = Arc::new(Leases::new(&p, Lease::new().max_block(4_096)));
        assert_eq!((l.useful_now(), l.stats().round_trip), (800, Duration::ZERO));
        // Round trips up to 1 ms: 2 ms of refill, as before any call.
        l.observe(None, Some(S), Some(S + MS));
        assert_eq!((l.useful_now(), l.stats().round_trip), (800, Duration::from_millis(1)));
        // 1.2 ms: 2.4 ms of refill, 960 units, which a check taking a new block asks for.
        l.round_trip.store(1_200_000, Ordering::Relaxed);
        assert_eq!(l.useful_now(), 960);
        let slot = l.slot(&Key::text("k")).unwrap();
        slot.held.lock().unwrap().next = 4_096;
        let b = l.begin(&slot, 1, Some(S));
        assert_eq!((b.block, b.useful), (4_096, 960));
        // 20 ms: 16,000 units refill; a quarter of the burst (10,000) and the largest block
        // (4,096) at most, so the bound stays N x max_block.
        l.round_trip.store(20 * MS, Ordering::Relaxed);
        assert_eq!(l.useful_now(), 4_096);
        let large = Leases::new(&p, Lease::new().max_block(20_000));
        large.round_trip.store(20 * MS, Ordering::Relaxed);
        assert_eq!(large.useful_now(), 10_000);
        // Windows wait for no useful block, however long the calls.
        let window = Policy::builder("w")
            .algorithm(Algorithm::FixedWindow)
            .tier("second", Quota::per_second(400_000))
            .build()
            .unwrap();
        let l = Leases::new(&window, Lease::new().max_block(512));
        l.round_trip.store(2 * MS, Ordering::Relaxed);
        assert_eq!(l.useful_now(), 0);
    }

    #[test]
    fn a_key_checked_again_only_after_the_lifetime_keeps_its_block_size() {
        let p = Policy::single("p", Quota::per_second(100)).unwrap();
        let l = Arc::new(Leases::new(
            &p,
            Lease::new().max_block(16).lifetime(Duration::from_millis(10)),
        ));
        let slot = l.slot(&Key::text("cold")).unwrap();
        for at in [S, 2 * S, 3 * S] {
            let b = l.begin(&slot, 1, Some(at));
            assert_eq!(b.block, 1, "nothing to give back later");
            l.granted(&slot, 1, grant(100, 99, S), block(1, 1, at, 0));
        }
        // Asked again within the lifetime of the spent block: it doubles.
        assert_eq!(l.begin(&slot, 1, Some(3 * S + 9 * MS)).block, 2);
    }

    #[test]
    fn a_spent_block_refuses_until_a_useful_block_is_back_with_that_retry() {
        let p = Policy::single("p", Quota::per_second(400_000).with_burst(4_000)).unwrap();
        let l = Arc::new(Leases::new(
            &p,
            Lease::new().max_block(512).lifetime(Duration::from_millis(100)),
        ));
        let slot = l.slot(&Key::text("k")).unwrap();
        let b = l.begin(&slot, 1, Some(S));
        assert_eq!((b.block, b.useful), (1, 1));
        // Redis had 3 units: all of them granted, and 400 there again 1 ms after the grant.
        let d = l.granted(&slot, 1, grant(4_000, 0, 10 * MS), block(3, 3, S, S + MS));
        assert_eq!((d.outcome(), d.tiers()[0].remaining()), (Outcome::Allowed, 2));
        for _ in 0..2 {
            let (d, granted_at) = l.spend(&slot, 1, Some(S + 100_000)).unwrap();
            assert_eq!((d.outcome(), granted_at), (Outcome::Allowed, Some(S)));
        }
        let (d, granted_at) = l.spend(&slot, 1, Some(S + 250_000)).unwrap();
        assert_eq!(granted_at, None, "a refusal holds no units");
        assert_eq!(d.outcome(), Outcome::Limited);
        assert_eq!(d.retry_after(), Some(Duration::from_nanos(750_000)));
        let t = d.tiers()[0];
        assert_eq!((t.remaining(), t.is_violated()), (0, true));
        assert_eq!(t.retry_after(), Some(Duration::from_nanos(750_000)));
        assert_eq!(t.reset_after(), Duration::from_nanos(10 * MS - 250_000));
        // A check costing more than is left is refused the same way.
        let (d, _) = l.spend(&slot, 2, Some(S + MS - 1)).unwrap();
        assert_eq!(d.retry_after(), Some(Duration::from_nanos(1)));
        // At the instant, Redis is asked again.
        assert!(l.spend(&slot, 1, Some(S + MS)).is_none());
        let stats = l.stats();
        assert_eq!((stats.decided_locally, stats.refused_locally), (2, 2));
        // The next block doubles: the last was spent.
        let b = l.begin(&slot, 1, Some(S + MS));
        assert_eq!((b.block, b.useful), (6, 6));
        assert!(b.rest.is_none());
        // A grant that needs no wait: a spent block asks Redis at once.
        l.granted(&slot, 1, grant(4_000, 3_000, 10 * MS), block(1, 1, S + MS, 0));
        assert!(l.spend(&slot, 1, Some(S + MS)).is_none());
    }

    #[test]
    fn an_instance_that_got_a_share_waits_in_proportion_up_to_half_the_bursts_refill() {
        // 400,000 a second, a burst of 4,000: half the burst refills in 5 ms.
        let p = Policy::single("p", Quota::per_second(400_000).with_burst(4_000)).unwrap();
        let l = Arc::new(Leases::new(&p, Lease::new().max_block(512)));
        assert_eq!(l.longest_wait, 5 * MS);
        // 200 of a useful 400, a useful block back in 1 ms: 2 ms.
        assert_eq!(l.wait_until(S, S + MS, 200, 400), S + 2 * MS);
        // 50 of 400: 8 ms, at most 5 ms; nothing (a refusal): the same.
        assert_eq!(l.wait_until(S, S + MS, 50, 400), S + 5 * MS);
        assert_eq!(l.wait_until(S, S + MS, 0, 400), S + 5 * MS);
        // A useful block taken, or none to wait for: as Redis said.
        assert_eq!(l.wait_until(S, S + MS, 400, 400), S + MS);
        assert_eq!(l.wait_until(S, 0, 10, 400), 0);
        // A longer wait (the key in debt) stays as it is.
        assert_eq!(l.wait_until(S, S + 6 * MS, 100, 400), S + 6 * MS);
    }

    #[test]
    fn a_refused_lease_call_waits_for_a_useful_block_and_says_so() {
        let p = Policy::single("p", Quota::per_second(400_000).with_burst(4_000)).unwrap();
        let l = Arc::new(Leases::new(&p, Lease::new().max_block(512)));
        let slot = l.slot(&Key::text("k")).unwrap();
        // Redis refused: the next unit in 2.5 µs, a useful block in 1 ms.
        let tiers: Tiers = smallvec![TierDecision::new(4_000, 0, 10 * MS, Some(2_500), true)];
        let refusal = Decision::new(Outcome::Limited, 0, Some(2_500), tiers);
        let d = l.refused(&slot, refusal.clone(), S, S + MS, 1, None, Paced::new());
        assert_eq!(d.retry_after(), Some(Duration::from_millis(1)));
        assert_eq!(d.tiers()[0].retry_after(), Some(Duration::from_millis(1)));
        let (d, granted) = l.spend(&slot, 1, Some(S + 400_000)).unwrap();
        assert_eq!((granted, d.retry_after()), (None, Some(Duration::from_nanos(600_000))));
        assert_eq!(d.tiers()[0].reset_after(), Duration::from_nanos(10 * MS - 400_000));
        assert!(l.spend(&slot, 1, Some(S + MS)).is_none());
        assert_eq!(l.stats().refused_locally, 1);
        // No wait beyond the refusal's own: the refusal as Redis made it.
        let other = l.slot(&Key::text("k2")).unwrap();
        assert_eq!(l.refused(&other, refusal.clone(), S, 0, 1, None, Paced::new()), refusal);
        assert!(l.spend(&other, 1, Some(S)).is_none());
    }

    /// Prefetching leases of GCRA at 400,000/s (burst 4,000; blocks of at most 512 lasting
    /// 100 ms), and the slot of key `k`, whose next block asked for is `next` units.
    fn prefetching(next: u64) -> (Arc<Leases>, Arc<Slot>) {
        let p = Policy::single("p", Quota::per_second(400_000).with_burst(4_000)).unwrap();
        let lease = Lease::new().max_block(512).lifetime(Duration::from_millis(100));
        let l = Arc::new(Leases::new(&p, lease.prefetch(true)));
        let slot = l.slot(&Key::text("k")).unwrap();
        slot.held.lock().unwrap().next = next;
        (l, slot)
    }

    /// What the block of `slot` holds: (left, granted, older, expired, next, fetching).
    fn holding(slot: &Slot) -> (u64, u64, u64, u64, u64, bool) {
        let h = slot.held.lock().unwrap();
        (h.left, h.granted, h.older, h.expired, h.next, h.fetching)
    }

    #[test]
    fn a_prefetch_is_due_when_half_the_block_is_spent_and_tops_it_up_to_the_largest() {
        let (l, slot) = prefetching(256);
        let b = l.begin(&slot, 1, Some(S));
        assert_eq!((b.block, b.useful), (256, 256));
        l.granted(&slot, 1, grant(4_000, 3_000, 10 * MS), block(256, 256, S, 0));
        // 255 held: due when 128 are left (half the block asked for), once.
        let due: Vec<bool> =
            (0..129).map(|_| l.take(&slot, 1, Some(S + MS)).unwrap().prefetch).collect();
        assert_eq!(due.iter().position(|d| *d), Some(126));
        assert_eq!(due.iter().filter(|d| **d).count(), 1, "one in flight at most");
        assert_eq!(holding(&slot), (126, 256, 0, 0, 256, true));
        // It asks for what tops the 126 held up to the largest block: 512 at most held.
        let (ahead, key) = l.ahead(&slot, Some(S + MS)).unwrap();
        assert_eq!((ahead.block, ahead.useful, key), (386, 386, Key::text("k")));
        // Two more spent while it is in flight; 386 granted at S + 2 ms.
        for _ in 0..2 {
            assert!(!l.take(&slot, 1, Some(S + 2 * MS)).unwrap().prefetch);
        }
        let grant = Grant { useful: 386, ..block(386, 386, S + 2 * MS, 0) };
        l.prefetched(&slot, grant_at(2_000, S + 2 * MS), grant);
        slot.held.lock().unwrap().fetching = false;
        assert_eq!(holding(&slot), (510, 642, 124, 0, 512, false));
        // The 124 held before are spent first, and end with their own lifetime (S + 100 ms):
        // 24 spent, then the other 100 are no longer spendable.
        for _ in 0..24 {
            assert!(!l.take(&slot, 1, Some(S + 50 * MS)).unwrap().prefetch);
        }
        assert_eq!(holding(&slot).2, 100);
        let t = l.take(&slot, 1, Some(S + 100 * MS)).unwrap();
        assert_eq!(t.granted, Some(S + 2 * MS));
        assert_eq!(holding(&slot), (385, 642, 0, 100, 512, false));
        // The new units last until S + 102 ms.
        assert!(l.take(&slot, 1, Some(S + 102 * MS)).is_none());
        // Given back together: what was not spent, the expired units included.
        let (_, rests) = l.ended(Some(S + 102 * MS), true);
        let r: Vec<_> = rests.iter().map(|(_, r)| (r.granted, r.spent)).collect();
        assert_eq!(r, [(642, 157)]);
        assert_eq!(l.stats().units_granted, 642);
    }

    #[test]
    fn no_second_prefetch_while_units_of_an_earlier_block_are_held() {
        let (l, slot) = prefetching(256);
        let b = l.begin(&slot, 1, Some(S));
        l.granted(&slot, 1, grant(4_000, 3_000, 10 * MS), block(b.block, b.block, S, 0));
        let due = (0..129).filter(|_| l.take(&slot, 1, Some(S + MS)).unwrap().prefetch).count();
        assert_eq!(due, 1);
        // Redis grants 10 of the 386 asked for: 136 held, 126 of them from the first block,
        // which keep its lifetime (S + 100 ms).
        let grant = Grant { useful: 386, ..block(10, 10, S + 2 * MS, 0) };
        l.prefetched(&slot, grant_at(2_000, S + 2 * MS), grant);
        slot.held.lock().unwrap().fetching = false;
        assert_eq!(holding(&slot).2, 126);
        // Fewer than half of the next block are held, but a second prefetch would merge the
        // first one's units into the older ones' lifetime: none until those are spent.
        let due: Vec<bool> =
            (0..127).map(|_| l.take(&slot, 1, Some(S + 50 * MS)).unwrap().prefetch).collect();
        assert_eq!(due.iter().position(|d| *d), Some(125), "{:?}", holding(&slot));
    }

    /// Leasing the schedule, a refused prefetch: once the units held are spent, the checks
    /// refused while this instance waits for a useful block to fit the horizon are told when
    /// their own units conform (others took the schedule up to 80 ms), not when it asks Redis
    /// again (40 ms).
    #[test]
    fn after_a_refused_prefetch_of_the_schedule_refusals_say_when_the_units_conform() {
        let p = Policy::single("p", Quota::per_second(100)).unwrap();
        let l = Arc::new(Leases::new(&p, Lease::new().max_block(64).schedule(true)));
        let slot = l.slot(&Key::text("k")).unwrap();
        let t = 10 * MS; // T
        let mut g = block(2, 2, S, 0);
        g.paced = smallvec![(S + t, t)];
        assert!(l.granted(&slot, 1, grant_at(0, S), g).is_allowed());
        let tiers: Tiers = smallvec![TierDecision::new(100, 0, 1_080 * MS, Some(80 * MS), true)];
        let refusal = Decision::new(Outcome::Limited, 0, Some(80 * MS), tiers);
        let waits = smallvec![(S + 70 * MS, t)];
        l.prefetch_refused(&slot, &refusal, S + MS, S + 40 * MS, 2, waits);
        let (d, _) = l.spend(&slot, 1, Some(S + t)).unwrap();
        assert!(d.is_allowed());
        let (d, _) = l.spend(&slot, 1, Some(S + 12 * MS)).unwrap();
        assert_eq!((d.outcome, d.retry_after), (Outcome::Limited, 68 * MS));
        let (d, _) = l.spend(&slot, 3, Some(S + 12 * MS)).unwrap();
        assert_eq!(d.retry_after, 88 * MS);
        // Redis said a useful block fits at 40 ms: the instance asks then.
        assert!(l.spend(&slot, 1, Some(S + 40 * MS)).is_none());
    }

    /// Leasing the schedule, a check of more units than are held, while this instance waits
    /// for a useful block (until 80 ms): told when its units conform (the 2 held at 60 and 70
    /// ms, 3 more at 80, 90 and 100 ms), not when the instance asks Redis again.
    #[test]
    fn a_check_of_more_than_the_units_held_of_the_schedule_is_told_when_they_conform() {
        let p = Policy::single("p", Quota::per_second(100)).unwrap();
        let l = Arc::new(Leases::new(&p, Lease::new().max_block(64).schedule(true)));
        let slot = l.slot(&Key::text("k")).unwrap();
        let t = 10 * MS; // T
        // 8 units at 0, 10, ... 70 ms.
        let mut g = block(8, 8, S, S + 80 * MS);
        g.paced = smallvec![(S + 7 * t, t)];
        assert!(l.granted(&slot, 1, grant_at(0, S), g).is_allowed());
        for _ in 0..5 {
            assert!(l.spend(&slot, 1, Some(S + 5 * t)).unwrap().0.is_allowed());
        }
        let (d, _) = l.spend(&slot, 5, Some(S + 5 * t)).unwrap();
        assert_eq!((d.outcome, d.retry_after), (Outcome::Limited, 50 * MS));
        // 2 units are held, conforming in 10 and 20 ms: a check of 2 waits for them alone.
        let (d, _) = l.spend(&slot, 2, Some(S + 5 * t)).unwrap();
        assert_eq!((d.outcome, d.retry_after), (Outcome::Limited, 20 * MS));
    }

    #[test]
    fn while_waiting_a_prefetch_starts_half_a_round_trip_before_a_useful_block_is_back() {
        let (l, slot) = prefetching(512);
        l.begin(&slot, 1, Some(S));
        // 400 granted, a useful block back at S + 1 ms.
        l.granted(&slot, 1, grant(4_000, 0, 10 * MS), block(400, 400, S, S + MS));
        for _ in 0..399 {
            assert!(!l.take(&slot, 1, Some(S + 100_000)).unwrap().prefetch);
        }
        // Lease calls take 600 µs: the prefetch starts half of that, 300 µs, before the wait
        // ends (Redis decides it about then).
        l.observe(None, Some(S), Some(S + 600_000));
        assert_eq!(l.round_trip.load(Ordering::Relaxed), 600_000);
        let t = l.take(&slot, 1, Some(S + 699_999)).unwrap();
        assert_eq!((t.decision.outcome, t.prefetch), (Outcome::Limited, false));
        let t = l.take(&slot, 1, Some(S + 700_000)).unwrap();
        assert_eq!((t.decision.outcome, t.prefetch), (Outcome::Limited, true));
        assert_eq!(t.decision.retry_after, 300_000);
        let (ahead, _) = l.ahead(&slot, Some(S + 700_000)).unwrap();
        assert_eq!((ahead.block, ahead.useful), (512, 512));
        // Redis refused it (others took what built up): refused until its share is back,
        // half the burst's refill at most, and still no call before.
        let tiers: Tiers = smallvec![TierDecision::new(4_000, 0, 10 * MS, Some(2_500), true)];
        let refusal = Decision::new(Outcome::Limited, 0, Some(2_500), tiers);
        l.prefetch_refused(&slot, &refusal, S + 850_000, S + 1_850_000, 512, Paced::new());
        slot.held.lock().unwrap().fetching = false;
        let t = l.take(&slot, 1, Some(S + MS)).unwrap();
        assert_eq!((t.decision.outcome, t.decision.retry_after), (Outcome::Limited, 4_850_000));
        // Half a round trip before that, the next prefetch.
        assert!(l.take(&slot, 1, Some(S + 5_550_000)).unwrap().prefetch);
        // Moving average of the round trips.
        l.observe(None, Some(S), Some(S + 1_000_000));
        assert_eq!(l.round_trip.load(Ordering::Relaxed), 700_000);
    }

    #[test]
    fn no_prefetch_for_keys_whose_blocks_are_small_windows_or_without_asking() {
        let gcra = Policy::single("p", Quota::per_second(400_000).with_burst(4_000)).unwrap();
        let window = Policy::builder("w")
            .algorithm(Algorithm::FixedWindow)
            .tier("second", Quota::per_second(400_000))
            .build()
            .unwrap();
        let on = Lease::new().max_block(512).prefetch(true);
        for (p, lease, next, due) in [
            (&gcra, on, 1, false),
            (&gcra, on, 8, false),
            (&gcra, on, 16, true),
            (&gcra, Lease::new().max_block(2).prefetch(true), 2, true),
            (&gcra, on.prefetch(false), 512, false),
            (&window, on, 512, false),
        ] {
            let l = Arc::new(Leases::new(p, lease));
            let slot = l.slot(&Key::text("k")).unwrap();
            slot.held.lock().unwrap().next = next;
            let b = l.begin(&slot, 1, Some(S));
            l.granted(&slot, 1, grant(4_000, 3_000, 10 * MS), block(b.block, b.block, S, 0));
            let mut any = false;
            while let Some(t) = l.take(&slot, 1, Some(S)) {
                any |= t.prefetch;
            }
            assert_eq!(any, due, "{lease:?}, blocks of {next}");
        }
        assert!(on.prefetches() && !Lease::new().prefetches());
    }

    #[test]
    fn a_fixed_window_block_ends_with_its_window() {
        let p = Policy::builder("w")
            .algorithm(Algorithm::FixedWindow)
            .tier("second", Quota::per_second(10))
            .tier("minute", Quota::per_minute(100))
            .build()
            .unwrap();
        let l =
            Arc::new(Leases::new(&p, Lease::new().max_block(8).lifetime(Duration::from_secs(10))));
        let slot = l.slot(&Key::text("k")).unwrap();
        let at = 61 * S + 900 * MS;
        l.granted(&slot, 1, grant(10, 2, 100 * MS), block(8, 8, at, 0));
        assert!(l.spend(&slot, 1, Some(62 * S - 1)).is_some());
        assert!(l.spend(&slot, 1, Some(62 * S)).is_none(), "the second's window ended");
        // The sweeper's part: the rest of an ended block, taken out once.
        let (ended, _) = l.ended(Some(62 * S), false);
        assert_eq!(ended.len(), 1);
        let (_, rests) = l.ended(Some(62 * S), true);
        assert_eq!(rests.iter().map(|(_, r)| (r.granted, r.spent)).collect::<Vec<_>>(), [(8, 2)]);
        assert!(l.ended(Some(62 * S), true).1.is_empty());
    }

    #[test]
    fn policies_lease_only_where_the_bound_is_stated() {
        let base = || Policy::builder("p").tier("s", Quota::per_second(10));
        for alg in [
            Algorithm::Gcra,
            Algorithm::TokenBucket,
            Algorithm::LeakyBucket,
            Algorithm::FixedWindow,
        ] {
            assert_eq!(unleasable(&base().algorithm(alg).build().unwrap()), None);
        }
        let exact = [
            base().algorithm(Algorithm::SlidingCounter).build().unwrap(),
            base().algorithm(Algorithm::SlidingLog).build().unwrap(),
            base().concurrency("c", Concurrency::new(2)).build().unwrap(),
            base()
                .tier("b", Quota::per_second(1_000).counting(Unit::RequestBytes))
                .build()
                .unwrap(),
            base().penalty("s", Penalty::new(Duration::from_secs(60))).build().unwrap(),
        ];
        for p in &exact {
            assert!(unleasable(p).is_some(), "{p:?}");
        }
        assert_eq!(unleasable(&exact[3]).unwrap().0, "b");
        let daily = base().algorithm(Algorithm::FixedWindow).calendar("d", Calendar::per_day(100));
        assert_eq!(unleasable(&daily.build().unwrap()), None);
        assert!(Lease::new().max_block(0).validate().is_err());
        assert!(Lease::new().lifetime(Duration::from_micros(999)).validate().is_err());
        assert_eq!(Lease::new().bound(4), 256);
    }

    #[test]
    fn a_full_map_drops_idle_slots_that_hold_nothing() {
        let p = Policy::single("p", Quota::per_second(100)).unwrap();
        let l = Arc::new(Leases::new(&p, Lease::new()));
        for i in 0..10_000 {
            let key = Key::text(format!("k{i}"));
            let slot = l.slot(&key).unwrap();
            // Blocks of one unit, spent at once: nothing to give back.
            l.granted(&slot, 1, grant(100, 99, 0), block(1, 1, 0, 0));
        }
        assert!(l.len() <= CAPACITY + SHARDS, "{}", l.len());
        // A slot holding units is kept: when every slot of a shard holds some, keys past it
        // are checked exactly.
        let l = Arc::new(Leases::new(&p, Lease::new()));
        let mut held = Vec::new();
        let mut refused = 0;
        for i in 0..10_000 {
            let key = Key::text(format!("k{i}"));
            match l.slot(&key) {
                Some(slot) => {
                    l.granted(&slot, 1, grant(100, 96, 0), block(4, 4, 0, 0));
                    held.push(slot);
                }
                None => refused += 1,
            }
        }
        assert_eq!(held.len() + refused, 10_000);
        assert!(held.len() <= CAPACITY + SHARDS && refused > 0);
    }
}
