//! Token bucket and leaky bucket, refilled (drained) lazily on each request, never by a timer.
//!
//! Both keep a level in fixed point, `units * period`, that changes by `count` per nanosecond,
//! so refill is exact integer arithmetic with no drift however long the run. `last` is the
//! instant the level refers to; a shaped reservation may move it into the future, and a query
//! before `last` projects the level backwards (which can only under-estimate what is free).

use crate::algorithm::compiled::Rate;

/// `(level, last)`: the level in `units * period` at instant `last` (nanoseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Level {
    pub(crate) level: i128,
    pub(crate) last: u64,
}

fn capacity(r: Rate) -> i128 {
    i128::from(r.burst) * i128::from(r.period)
}

fn need(r: Rate, cost: u64) -> i128 {
    i128::from(cost) * i128::from(r.period)
}

fn drift(r: Rate, from: u64, to: u64) -> i128 {
    i128::from(to.abs_diff(from)) * i128::from(r.count)
}

fn ceil_nanos(r: Rate, amount: i128) -> u64 {
    if amount <= 0 {
        return 0;
    }
    let c = i128::from(r.count);
    u64::try_from((amount + c - 1) / c).unwrap_or(u64::MAX)
}

/// Token bucket: the level is tokens; it rises to `burst` and a request takes `cost`.
pub(crate) mod token {
    use super::*;

    pub(crate) fn fresh(r: Rate, now: u64) -> Level {
        Level { level: capacity(r), last: now }
    }

    pub(crate) fn at(r: Rate, s: Level, t: u64) -> i128 {
        if t >= s.last {
            (s.level + drift(r, s.last, t)).min(capacity(r))
        } else {
            s.level - drift(r, t, s.last)
        }
    }

    pub(crate) fn earliest(r: Rate, s: Level, from: u64, cost: u64) -> u64 {
        let short = need(r, cost) - at(r, s, from);
        from.saturating_add(ceil_nanos(r, short))
    }

    pub(crate) fn charge(r: Rate, s: &mut Level, at_: u64, cost: u64) {
        if at_ >= s.last {
            s.level = at(r, *s, at_);
            s.last = at_;
        }
        s.level -= need(r, cost);
    }

    pub(crate) fn refund(r: Rate, s: &mut Level, cost: u64) {
        s.level = (s.level + need(r, cost)).min(capacity(r));
    }

    pub(crate) fn status(r: Rate, s: Level, now: u64) -> (u64, u64) {
        let level = at(r, s, now).max(0);
        let remaining = u64::try_from(level / i128::from(r.period)).unwrap_or(u64::MAX);
        let full = s.last.saturating_add(ceil_nanos(r, capacity(r) - s.level));
        (remaining, full.saturating_sub(now))
    }
}

/// Leaky bucket: the level is water; it drains to 0 and a request pours in `cost`.
pub(crate) mod leaky {
    use super::*;

    pub(crate) fn fresh(now: u64) -> Level {
        Level { level: 0, last: now }
    }

    pub(crate) fn at(r: Rate, s: Level, t: u64) -> i128 {
        if t >= s.last {
            (s.level - drift(r, s.last, t)).max(0)
        } else {
            s.level + drift(r, t, s.last)
        }
    }

    pub(crate) fn earliest(r: Rate, s: Level, from: u64, cost: u64) -> u64 {
        let over = at(r, s, from) + need(r, cost) - capacity(r);
        from.saturating_add(ceil_nanos(r, over))
    }

    /// When shaping, how long the water already in the bucket at `t` takes to drain: the
    /// request leaves after it, so output is smooth at the leak rate.
    pub(crate) fn queue_wait(r: Rate, s: Level, t: u64) -> u64 {
        ceil_nanos(r, at(r, s, t))
    }

    pub(crate) fn charge(r: Rate, s: &mut Level, at_: u64, cost: u64) {
        if at_ >= s.last {
            s.level = at(r, *s, at_);
            s.last = at_;
        }
        s.level += need(r, cost);
    }

    pub(crate) fn refund(r: Rate, s: &mut Level, cost: u64) {
        s.level = (s.level - need(r, cost)).max(0);
    }

    pub(crate) fn status(r: Rate, s: Level, now: u64) -> (u64, u64) {
        let room = (capacity(r) - at(r, s, now)).max(0);
        let remaining = u64::try_from(room / i128::from(r.period)).unwrap_or(u64::MAX);
        let empty = s.last.saturating_add(ceil_nanos(r, s.level));
        (remaining, empty.saturating_sub(now))
    }
}
