//! GCRA (generic cell rate algorithm), redis-cell's algorithm.
//!
//! State: the theoretical arrival time (TAT). Emission interval `T = period / count`,
//! tolerance `tau = T * burst`; a request of `cost` is admitted at `t` iff
//! `max(TAT, t) + T * cost - tau <= t`, and then `TAT = max(TAT, t) + T * cost`.
//!
//! To keep `T` exact when `period` is not a multiple of `count`, every instant here is scaled
//! by `count`: `now_s = now * count`, so `T` becomes `period` (an integer) and `tau` becomes
//! `period * burst`. With `count`, `burst` < 2^32 and instants < 2^64 nothing overflows u128.

use strength_reduce::StrengthReducedU64;

use crate::algorithm::compiled::Rate;

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

/// GCRA for a tier whose emission interval `T = period / count` is a whole number of
/// nanoseconds: the TAT is then plain nanoseconds, a `u64` that the in-memory store keeps in one
/// atomic per key (0 is a fresh key). Exactly the decisions of the scaled version above.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WholeGcra {
    /// Emission interval, nanoseconds.
    t: u64,
    /// Division by `t` as a multiplication (a 64-bit division costs tens of cycles, and every
    /// decision divides once to report the remaining units).
    per_t: StrengthReducedU64,
    /// Capacity, units.
    burst: u64,
    /// Tolerance `T * burst`, nanoseconds.
    tau: u64,
}

/// What [`WholeGcra::decide`] concluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Admitted after `wait` ns: store `tat`; the charge took effect at `at`.
    Admit { wait: u64, tat: u64, at: u64 },
    /// Rejected: retry after `retry` ns (beyond the shaping budget).
    Limit { retry: u64 },
    /// Rejected: the cost is above the capacity.
    TooBig,
    /// Cost 0: a query.
    Query,
}

impl WholeGcra {
    /// The whole-nanosecond form of `r`, when its interval is whole and its tolerance fits.
    pub(crate) fn of(r: Rate) -> Option<Self> {
        if r.period % r.count != 0 {
            return None;
        }
        let t = r.period / r.count;
        if t == 0 {
            return None;
        }
        Some(Self {
            t,
            per_t: StrengthReducedU64::new(t),
            burst: r.burst,
            tau: t.checked_mul(r.burst)?,
        })
    }

    /// Decides `cost` at `now` on `tat`; `budget` is the shaping budget in ns (0 polices).
    #[inline]
    pub(crate) fn decide(&self, tat: u64, now: u64, cost: u64, budget: u64) -> Step {
        if cost == 0 {
            return Step::Query;
        }
        if cost > self.burst {
            return Step::TooBig;
        }
        // cost <= burst, so cost * t <= tau: no overflow.
        let new = tat.max(now).saturating_add(cost * self.t);
        let wait = new.saturating_sub(self.tau).saturating_sub(now);
        if wait > budget {
            return Step::Limit { retry: wait - budget };
        }
        // Charged at now + wait <= max(tat, now): the TAT moves from max(tat, now).
        Step::Admit { wait, tat: new, at: now + wait }
    }

    /// `(remaining, reset_after)` at `now`.
    #[inline]
    pub(crate) fn status(&self, tat: u64, now: u64) -> (u64, u64) {
        let backlog = tat.saturating_sub(now);
        (self.tau.saturating_sub(backlog) / self.per_t, backlog)
    }

    /// Gives back `cost` units.
    pub(crate) fn refund(&self, tat: u64, cost: u64) -> u64 {
        tat.saturating_sub(cost.saturating_mul(self.t))
    }

    /// Charges `cost` units at `at` unconditionally.
    pub(crate) fn charge(&self, tat: u64, at: u64, cost: u64) -> u64 {
        tat.max(at).saturating_add(cost.saturating_mul(self.t))
    }

    /// Capacity, units.
    #[inline]
    pub(crate) fn burst(&self) -> u64 {
        self.burst
    }
}
