//! Fixed window counter and sliding window counter.
//!
//! Windows are `period` long and aligned to the clock's epoch (the Unix epoch for the built-in
//! clocks, as on Redis): window `k` is
//! `[k * period, (k + 1) * period)`. The state is a short ascending list of `(k, used)`, which
//! usually holds one or two windows; shaping may reserve units in later windows too.

use crate::algorithm::compiled::Rate;

/// `(window index, units used)`, ascending by index.
pub(crate) type Windows = Vec<(u64, u64)>;

fn index(r: Rate, t: u64) -> u64 {
    t / r.period
}

fn start(r: Rate, k: u64) -> u64 {
    k.saturating_mul(r.period)
}

fn used(w: &Windows, k: u64) -> u64 {
    w.iter().find(|(i, _)| *i == k).map_or(0, |(_, u)| *u)
}

fn add(w: &mut Windows, k: u64, cost: u64) {
    match w.binary_search_by_key(&k, |(i, _)| *i) {
        Ok(p) => w[p].1 = w[p].1.saturating_add(cost),
        Err(p) => w.insert(p, (k, cost)),
    }
}

/// Gives `cost` back to window `k` (if it is still kept), dropping it when it empties.
pub(crate) fn refund(w: &mut Windows, r: Rate, at: u64, cost: u64) {
    let k = index(r, at);
    if let Ok(p) = w.binary_search_by_key(&k, |(i, _)| *i) {
        w[p].1 = w[p].1.saturating_sub(cost);
        if w[p].1 == 0 {
            w.remove(p);
        }
    }
}

/// Charges `cost` to the window holding instant `at`.
pub(crate) fn charge(w: &mut Windows, r: Rate, at: u64, cost: u64) {
    add(w, index(r, at), cost);
}

/// The instant (nanoseconds) by which the newest counted window stops mattering, given how many
/// windows after it still count (0 for fixed, 1 for sliding).
fn reset(w: &Windows, r: Rate, now: u64, lookback: u64) -> u64 {
    w.last().map_or(0, |(k, _)| start(r, k + 1 + lookback).saturating_sub(now))
}

pub(crate) mod fixed {
    use super::*;

    pub(crate) fn prune(w: &mut Windows, r: Rate, now: u64) {
        let k = index(r, now);
        w.retain(|(i, _)| *i >= k);
    }

    /// Earliest instant >= `from` whose window has room for `cost` (`cost <= count`).
    pub(crate) fn earliest(w: &Windows, r: Rate, from: u64, cost: u64) -> u64 {
        let mut k = index(r, from);
        loop {
            if used(w, k).saturating_add(cost) <= r.count {
                return from.max(start(r, k));
            }
            k += 1;
        }
    }

    pub(crate) fn status(w: &Windows, r: Rate, now: u64) -> (u64, u64) {
        (r.count.saturating_sub(used(w, index(r, now))), reset(w, r, now, 0))
    }
}

pub(crate) mod sliding {
    use super::*;

    pub(crate) fn prune(w: &mut Windows, r: Rate, now: u64) {
        let k = index(r, now);
        w.retain(|(i, _)| i + 1 >= k);
    }

    /// Earliest instant >= `from` at which
    /// `prev * (period - elapsed) / period + cur + cost <= count`, solved exactly per window.
    pub(crate) fn earliest(w: &Windows, r: Rate, from: u64, cost: u64) -> u64 {
        let p = u128::from(r.period);
        let mut k = index(r, from);
        loop {
            let prev = u128::from(k.checked_sub(1).map_or(0, |j| used(w, j)));
            let cur = used(w, k);
            if let Some(room) = r.count.checked_sub(cur.saturating_add(cost)) {
                // Need prev * (p - e) <= room * p, i.e. e >= p - floor(room * p / prev).
                let e_min = (u128::from(room) * p)
                    .checked_div(prev)
                    .map_or(0, |free| p.saturating_sub(free));
                if e_min < p {
                    let e_min = u64::try_from(e_min).unwrap_or(u64::MAX);
                    return from.max(start(r, k).saturating_add(e_min));
                }
            }
            k += 1;
        }
    }

    pub(crate) fn status(w: &Windows, r: Rate, now: u64) -> (u64, u64) {
        let p = u128::from(r.period);
        let k = index(r, now);
        let e = u128::from(now - start(r, k));
        let prev = u128::from(k.checked_sub(1).map_or(0, |j| used(w, j)));
        let estimate = prev * (p - e) + u128::from(used(w, k)) * p;
        let room = (u128::from(r.count) * p).saturating_sub(estimate) / p;
        (u64::try_from(room).unwrap_or(u64::MAX), reset(w, r, now, 1))
    }
}
