//! The critical reserve kept out of the schedule (see [`Reserve`](crate::Reserve)).
//!
//! A shaped request is charged when it is decided and leaves later, at the instant it
//! conforms: requests of the lower classes that wait at their line (the burst less what their
//! class may not use) push a GCRA tier's TAT past it, and a critical request decided on that
//! TAT would find its reserve taken by requests that have not left yet. What the limit needs
//! is that the requests conform in the order they *leave*: each lower-class request waiting
//! leaves with at least the critical reserve `r_c` of room (it conformed to its own line), so
//! critical requests may leave ahead of it, `r_c` units of them in all, and every instant still
//! conforms to the tier's tolerance. The tier keeps, beside its TAT, a **line** per key:
//!
//! - `until`: the last instant a request scheduled ahead leaves (a lower-class request that
//!   waits, or a critical one that waits behind the schedule);
//! - `used`: the critical units admitted ahead of that schedule, beyond what the TAT alone
//!   admits (and, when the schedule starts, the units the key was already past the standard
//!   line by: critical units too, as no lower class passes its line), and `used_until`, when
//!   they stop mattering: every request scheduled before the last of them left by
//!   `used_until`, and the units past the line leave with time, so `used` is back to 0
//!   `used × T` after it.
//!
//! A critical request decided at `t` is admitted when the TAT admits it, or at once (never
//! booked later: `used` is kept for the instants decided, in order) while the schedule is
//! pending (`t < until`) when `used + cost <= r_c`. Invariant (departure order, `D` the TAT of
//! the requests that left): at every instant `t` of a pending schedule, `D(t) <= t + τ_std +
//! used × T` (`τ_std = τ - r_c T`), and every request still waiting has room for `r_c - used`
//! more units ahead of it; a critical request admitted on the line keeps both (it adds `cost`
//! to `D` and to `used`), so what leaves never exceeds the tier's limit. `used` counts only
//! units the critical class took (ahead of the schedule, or past the standard line), so a
//! critical request is never refused while the reserve is unused. What it gives up: once
//! used, the reserve comes back only as the schedule that saw it leaves (at `used_until`, plus
//! `used` emission intervals), where an exact account per waiting request could give part of
//! it back sooner.

use super::compiled::Rate;

/// A reserve tier's line for one key (see the module docs); instants in the policy's units.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Line {
    /// When the last request scheduled ahead leaves; 0: no schedule.
    pub(crate) until: u64,
    /// When `used` stops mattering (see [`Line::used_at`]).
    pub(crate) used_until: u64,
    /// Critical units admitted ahead of the schedule, or past the standard line.
    pub(crate) used: u64,
}

impl Line {
    /// `used` at `t`: 0 from `used_until + used × T` on.
    pub(crate) fn used_at(&self, r: Rate, t: u64) -> u64 {
        if self.used == 0 || self.reset_scaled(r) <= scaled(r, t) { 0 } else { self.used }
    }

    /// `used_until + used × T`, scaled by the tier's count.
    fn reset_scaled(&self, r: Rate) -> u128 {
        scaled(r, self.used_until) + u128::from(self.used) * u128::from(r.period)
    }

    /// Forgets what no longer matters at `now`: a schedule that left, units of the reserve
    /// that came back.
    pub(crate) fn prune(&mut self, r: Rate, now: u64) {
        if now >= self.until {
            *self = Self::default();
        } else if self.used_at(r, now) == 0 {
            self.used = 0;
        }
    }

    /// Whether a critical request of `cost` may leave at `t` ahead of the schedule, with the
    /// critical reserve `reserve`.
    pub(crate) fn admits(&self, r: Rate, reserve: u64, t: u64, cost: u64) -> bool {
        t < self.until && self.used_at(r, t).saturating_add(cost) <= reserve
    }

    /// The earliest instant `>= now` at which a critical request of `cost` decided then would
    /// be admitted on the line (as time passes and nothing else changes), if any: now, or when
    /// the reserve comes back, if the schedule is still pending then.
    pub(crate) fn back(&self, r: Rate, reserve: u64, now: u64, cost: u64) -> Option<u64> {
        if self.admits(r, reserve, now, cost) {
            return Some(now);
        }
        let back = unscale_ceil(r, self.reset_scaled(r));
        (self.used > 0 && cost <= reserve && back < self.until).then(|| back.max(now))
    }

    /// The units of the reserve a critical request may take now on the line (0 with no
    /// schedule pending).
    pub(crate) fn room(&self, r: Rate, reserve: u64, now: u64) -> u64 {
        if now < self.until { reserve.saturating_sub(self.used_at(r, now)) } else { 0 }
    }

    /// A request of a lower class was admitted to leave at `at` (decided at `now`), on a TAT of
    /// `tat` before its charge: one that waits joins the schedule (or starts it, counting the
    /// units the key is past the standard line `tau_std` by as used).
    pub(crate) fn lower(&mut self, r: Rate, tau_std: u128, now: u64, at: u64, tat: u128) {
        if at <= now {
            return;
        }
        if self.until == 0 {
            let past = tat.saturating_sub(scaled(r, now) + tau_std);
            self.used = units_ceil(r, past);
            self.used_until = now;
        }
        self.until = self.until.max(at);
    }

    /// A critical request of `cost` was admitted to leave at `at` (decided at `now`):
    /// `on_line` when the TAT alone would not have admitted it then. `tat` is the TAT after
    /// its charge.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn critical(
        &mut self,
        r: Rate,
        reserve: u64,
        tau_std: u128,
        now: u64,
        at: u64,
        cost: u64,
        on_line: bool,
        tat: u128,
    ) {
        if on_line {
            self.used = self.used_at(r, at).saturating_add(cost);
            self.used_until = self.until;
        } else if at > now {
            // It waits behind the schedule with no room ahead of it: none for the line until
            // it leaves.
            self.until = self.until.max(at);
            self.used = reserve;
            self.used_until = self.until;
        } else if now < self.until {
            self.taken(r, tau_std, now, cost, tat);
        }
    }

    /// `cost` units charged now, ahead of the schedule, outside the line's own admissions (a
    /// critical request the TAT admitted, a settlement charging more): `tat` is the TAT after.
    pub(crate) fn taken(&mut self, r: Rate, tau_std: u128, now: u64, cost: u64, tat: u128) {
        if now >= self.until {
            return;
        }
        let used = self.used_at(r, now);
        let past = units_ceil(r, tat.saturating_sub(scaled(r, now) + tau_std));
        let new = used.saturating_add(cost).min(used.max(past));
        if new != used {
            self.used = new;
            self.used_until = self.until;
        }
    }
}

fn scaled(r: Rate, t: u64) -> u128 {
    u128::from(t) * u128::from(r.count)
}

fn unscale_ceil(r: Rate, s: u128) -> u64 {
    u64::try_from(s.div_ceil(u128::from(r.count))).unwrap_or(u64::MAX)
}

/// A scaled span in whole emission intervals, rounded up.
fn units_ceil(r: Rate, s: u128) -> u64 {
    u64::try_from(s.div_ceil(u128::from(r.period.max(1)))).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 10 a second in milliseconds: T = 100, burst 10; reserve 3, so the standard line is 7.
    const R: Rate = Rate { count: 10, period: 1_000, burst: 10 };
    const TAU_STD: u128 = 7 * 1_000;

    #[test]
    fn a_schedule_keeps_the_reserve_until_it_leaves() {
        let mut line = Line::default();
        // At 0 the key is at its standard line (TAT 700); a standard request waits until 100.
        line.lower(R, TAU_STD, 0, 100, 700 * 10);
        assert_eq!(line, Line { until: 100, used_until: 0, used: 0 });
        line.lower(R, TAU_STD, 0, 2_000, 2_600 * 10);
        assert!(line.admits(R, 3, 0, 3) && !line.admits(R, 3, 0, 4));
        line.critical(R, 3, TAU_STD, 0, 0, 2, true, 0);
        assert_eq!(line, Line { until: 2_000, used_until: 2_000, used: 2 });
        assert_eq!(line.room(R, 3, 0), 1);
        assert!(!line.admits(R, 3, 0, 2));
        // Back once the schedule that saw them left, 2 intervals after it... but the schedule
        // ends then: nothing on the line from 2,000 on.
        assert_eq!(line.back(R, 3, 0, 2), None);
        let mut pruned = line;
        pruned.prune(R, 2_000);
        assert_eq!(pruned, Line::default());
    }

    #[test]
    fn units_past_the_line_when_the_schedule_starts_count_as_used_and_come_back() {
        let mut line = Line::default();
        // TAT 900 at 0: 2 critical units past the standard line (700).
        line.lower(R, TAU_STD, 0, 300, 900 * 10);
        assert_eq!(line, Line { until: 300, used_until: 0, used: 2 });
        assert!(line.admits(R, 3, 0, 1) && !line.admits(R, 3, 0, 2));
        // They leave with time: 2 intervals on, the reserve is whole again.
        assert_eq!(line.back(R, 3, 0, 2), Some(200));
        assert!(line.admits(R, 3, 200, 3));
    }

    #[test]
    fn a_critical_request_waiting_behind_the_schedule_closes_the_line_until_it_leaves() {
        let mut line = Line::default();
        line.critical(R, 3, TAU_STD, 0, 500, 1, false, 0);
        assert_eq!(line, Line { until: 500, used_until: 500, used: 3 });
        assert!(!line.admits(R, 3, 499, 1));
        assert_eq!(line.back(R, 3, 0, 1), None);
    }

    #[test]
    fn units_taken_now_count_only_past_the_line() {
        let mut line = Line { until: 1_000, used_until: 0, used: 1 };
        // TAT 650 after the charge: below the line, nothing more used.
        line.taken(R, TAU_STD, 0, 2, 650 * 10);
        assert_eq!(line.used, 1);
        // TAT 950: 3 units past it, but at most the 2 charged more.
        line.taken(R, TAU_STD, 0, 2, 950 * 10);
        assert_eq!(line, Line { until: 1_000, used_until: 1_000, used: 3 });
    }
}
