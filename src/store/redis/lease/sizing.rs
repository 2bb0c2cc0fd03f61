//! Block sizes: the quarter rule, the useful block a key refills, how long an instance
//! waits for one, the horizon of a lease of the key's schedule, and which policies lease.

use super::*;

/// The most one lease call takes of what a key has left, in units: a quarter of `left` (the
/// least over the key's tiers), so that a key near its limit is leased a unit at a time and
/// the instances sharing it each find some. A lease call takes at least its check's cost and
/// up to the useful block regardless (see [`Lease`], "Block size").
///
/// The Lua scripts apply the same rule where Redis decides (`lua/gcra.lua`, `lua/kinds.lua`).
pub(crate) const fn lease_share(left: u64) -> u64 {
    left / 4
}

/// How long a useful block takes to build up at a key's rate at least (see [`useful_block`];
/// longer when an instance's lease calls take longer, see [`Leases::useful_now`]).
pub(super) const USEFUL_SPAN: Duration = Duration::from_millis(2);

/// The block an instance waits for on a GCRA or bucket key, in units: what every rate tier
/// refills in [`USEFUL_SPAN`], a quarter of its burst at most, and at most `max_block`, but at
/// least 1 (then it waits for the next unit, exactly as a refusal would). 0 for fixed windows,
/// which keep the quarter rule alone: a window's units come back only when it ends.
pub(crate) fn useful_block(policy: &Policy, max_block: u64) -> u64 {
    useful_over(policy, max_block, duration_to_nanos(USEFUL_SPAN))
}

/// [`useful_block`] for what the tiers refill in `span` nanoseconds.
pub(super) fn useful_over(policy: &Policy, max_block: u64, span: u64) -> u64 {
    if policy.algorithm() == Algorithm::FixedWindow {
        return 0;
    }
    let span = u128::from(span / policy.unit());
    rates(policy)
        .map(|r| {
            let refilled = u128::from(r.count) * span / u128::from(r.period.max(1));
            u64::try_from(refilled).unwrap_or(u64::MAX).min(lease_share(r.burst))
        })
        .fold(max_block, u64::min)
        .max(1)
}

/// The rate tiers' quotas, in the policy's unit.
pub(super) fn rates(policy: &Policy) -> impl Iterator<Item = &Rate> {
    policy.tiers().iter().filter(|t| matches!(t.kind, Kind::Rate)).map(|t| &t.rate)
}

/// The longest an instance waits for a useful block when other instances take from the key
/// too, in nanoseconds: the time the fastest-filling rate tier refills half its burst. An
/// instance waits only when the key has less than a useful block (a quarter of the burst at
/// most) left, so a key that instances want is at most three quarters full when their waits
/// end, and no refill is lost to the burst's cap.
pub(super) fn longest_wait(policy: &Policy) -> u64 {
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
pub(super) fn horizon(policy: &Policy, config: Lease) -> u64 {
    if !config.schedule
        || crate::store::redis::script::family(policy) != crate::store::redis::script::Family::Gcra
    {
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

impl Leases {
    /// Until when this instance waits after a call at `at` that got `took` units where it
    /// asked for a useful block of `useful`, Redis saying a useful block is back at `hold`.
    /// Other instances take from the key too: one that got a share of what built up waits in
    /// proportion (`useful / took` times the wait), so that each call finds about a useful
    /// block, but never longer than [`longest_wait`] (or the wait Redis said, if longer).
    pub(super) fn wait_until(&self, at: u64, hold: u64, took: u64, useful: u64) -> u64 {
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
    pub(super) fn useful_now(&self) -> u64 {
        let span = self.round_trip.load(Ordering::Relaxed).saturating_mul(2);
        if self.useful == 0 || span <= duration_to_nanos(USEFUL_SPAN) {
            return self.useful;
        }
        useful_over(&self.policy, self.config.max_block, span)
    }

    /// The earliest end of the window an instant falls in, over the fixed window and
    /// calendar tiers; `u64::MAX` without any.
    pub(super) fn window_end(&self, at: u64) -> u64 {
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
}
