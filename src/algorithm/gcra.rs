//! GCRA (generic cell rate algorithm), redis-cell's algorithm.
//!
//! State: the theoretical arrival time (TAT). Emission interval `T = period / count`,
//! tolerance `tau = T * burst`; a request of `cost` is admitted at `t` iff
//! `max(TAT, t) + T * cost - tau <= t`, and then `TAT = max(TAT, t) + T * cost`.
//!
//! To keep `T` exact when `period` is not a multiple of `count`, every instant here is scaled
//! by `count`: `now_s = now * count`, so `T` becomes `period` (an integer) and `tau` becomes
//! `period * burst`. With `count`, `burst` < 2^32 and instants < 2^64 nothing overflows u128.

use crate::quota::Rate;

/// Scaled TAT (`nanoseconds * count`).
pub(crate) type Tat = u128;

fn scaled(r: Rate, t: u64) -> u128 {
    u128::from(t) * u128::from(r.count)
}

fn unscale_ceil(r: Rate, s: u128) -> u64 {
    u64::try_from(s.div_ceil(u128::from(r.count))).unwrap_or(u64::MAX)
}

pub(crate) fn earliest(r: Rate, tat: Tat, from: u64, cost: u64) -> u64 {
    let from_s = scaled(r, from);
    let new = tat.max(from_s) + u128::from(cost) * u128::from(r.period);
    let allow = new.saturating_sub(u128::from(r.burst) * u128::from(r.period));
    if allow <= from_s { from } else { unscale_ceil(r, allow) }
}

pub(crate) fn charge(r: Rate, tat: &mut Tat, at: u64, cost: u64) {
    *tat = (*tat).max(scaled(r, at)) + u128::from(cost) * u128::from(r.period);
}

pub(crate) fn refund(r: Rate, tat: &mut Tat, cost: u64) {
    *tat = tat.saturating_sub(u128::from(cost) * u128::from(r.period));
}

/// `(remaining, reset_after)` at `now`.
pub(crate) fn status(r: Rate, tat: Tat, now: u64) -> (u64, u64) {
    let now_s = scaled(r, now);
    let tat = tat.max(now_s);
    let room = (now_s + u128::from(r.burst) * u128::from(r.period)).saturating_sub(tat);
    let remaining = u64::try_from(room / u128::from(r.period)).unwrap_or(u64::MAX);
    (remaining, unscale_ceil(r, tat - now_s))
}
