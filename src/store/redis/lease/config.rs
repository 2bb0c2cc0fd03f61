//! [`Lease`]: lease mode's settings, and the bound they state.

use super::*;

/// Lease mode for hot keys on a [`RedisStore`](crate::store::redis::RedisStore), opted into per policy with
/// [`RedisStoreBuilder::lease_policy`](crate::store::redis::RedisStoreBuilder::lease_policy) (or for every
/// policy that can lease with [`RedisStoreBuilder::lease`](crate::store::redis::RedisStoreBuilder::lease)).
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
/// | lease asked for a sliding window (counter or log), or a policy with concurrency, penalty or reserve tiers or tiers counting other units than requests | lease mode is refused when the policy is bound ([`lease_policy`](crate::store::redis::RedisStoreBuilder::lease_policy)), or the policy stays exact ([`lease`](crate::store::redis::RedisStoreBuilder::lease)) | — |
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
/// [local refusals](crate::store::redis::RedisStoreBuilder::local_refusals); for GCRA and the buckets its
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
    pub(super) max_block: u64,
    pub(super) lifetime: Duration,
    pub(super) prefetch: bool,
    pub(super) schedule: bool,
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
    /// least 1, checked by [`build`](crate::store::redis::RedisStoreBuilder::build)). It bounds what an
    /// instance can strand and, for the rate algorithms, the extra admissions per instance.
    ///
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
    /// by [`build`](crate::store::redis::RedisStoreBuilder::build)). A fixed window's block also ends with
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
