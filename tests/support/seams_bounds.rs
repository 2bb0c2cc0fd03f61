//! The promises the seam matrix holds every trace to, from the decisions alone (not the
//! model): what each feature's docs bound.
//!
//! - **Rate tiers** (GCRA; `Quota`): in every interval `[t1, t2]` ending at an admission, the
//!   units admitted (at their departure instants), plus what settlements charged, less what
//!   they gave back (at the later of the charge's instant and the settlement's), as far as they
//!   were decided by that admission, are at most `burst + ⌊(t2 - t1) · count / period⌋`.
//! - **Windows** (fixed windows and calendar tiers): when a request is admitted, its window has
//!   counted at most `count` with it (settlements charge the window of the later of the charge
//!   and now, and give back to the charge's window while it lasts).
//! - **Concurrency**: when a request is admitted, at most `max` slots are held with it.
//! - **Reserves** (`Reserve`): a critical request of cost `k <= r_c` is admitted at once
//!   (police, or shaped with no delay) when its key is not blocked, its other tiers have room,
//!   and the reserve is unused: "a critical request is never refused while the critical
//!   reserve is unused, whatever the other classes send". Unused means, from the docs, with
//!   `T` the emission interval and `S` the last departure booked on the tier when an event
//!   came:
//!   - no critical request admitted with nothing booked ahead left within `k` intervals
//!     before (policing);
//!   - none admitted while requests were booked ahead (or waiting behind them) within `r_c`
//!     intervals after the later of its departure and `S` ("Shaping": the reserve comes back
//!     when the requests booked while it was used have left, and one interval per unit used
//!     after that), and none of the first kind within `r_c + 1` intervals before a schedule
//!     of the lower classes began (its units past the standard line count as used then, a
//!     part interval rounded up);
//!   - no settlement above its charge (a debt, any class: charged into the reserve if it
//!     must, as the units were used, the tier's limit first) has failed to drain by `k`
//!     intervals: each runs its `extra` intervals from the later of its charge's instant, the
//!     settlement's and the debts before it (and, with requests booked ahead, from `S`, `r_c`
//!     intervals more).
//!
//! Traces whose clock steps back are held to the model and to memory ≡ Redis only: intervals
//! and windows assume a clock that only moves forward.
#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;

use tollgate::{Decision, Policy, Priority, TierKind};

use super::seams::{Config, TierChoice};
use super::seams_model::Model;

/// What happened to the tiers of a key, in the order it was decided.
#[derive(Debug, Clone)]
pub enum Event {
    /// A check admitted at `at` (its departure), costing `costs` per tier.
    Admitted { key: u8, at: u64, costs: Vec<u64> },
    /// Tier `tier` of a charge made at `at` settled at `now` from `was` units to `to`.
    Settled { key: u8, tier: usize, at: u64, now: u64, was: u64, to: u64 },
    /// Slots given back.
    Released { key: u8, costs: Vec<u64> },
}

/// What a key's reserve tier saw (see the module docs): instants in ns.
#[derive(Debug, Clone, Copy, Default)]
struct Reserved {
    /// The last departure booked on the tier.
    booked: u64,
    /// The last departure of a critical request admitted with nothing booked ahead.
    free: Option<u64>,
    /// When the reserve is back from critical requests admitted with requests booked ahead.
    line: u64,
    /// When the debts have drained.
    debt: u64,
}

/// How a tier is bounded.
#[derive(Debug, Clone, Copy)]
enum Bound {
    Rate { count: u64, period: u64, burst: u64 },
    Window { count: u64, len: u64 },
    Slots { max: u64 },
}

/// The decisions of one trace, checked against the promises as they come.
pub struct Log {
    bounds: Vec<Bound>,
    /// Extra units every rate tier may admit beyond its bound (lease mode: `N · B`).
    slack: u64,
    reserve: Option<(usize, u64, u64)>,
    events: Vec<Event>,
    /// Per key, what the reserve tier saw (see the module docs).
    reserved: HashMap<u8, Reserved>,
    /// Whether the next decision must admit at once (the reserve's promise), and why.
    promised: Option<String>,
    back: bool,
}

impl Log {
    pub fn new(config: &Config, policy: &Policy) -> Self {
        let bounds = policy
            .tiers()
            .iter()
            .zip(&config.tiers)
            .map(|(t, c)| {
                let q = t.quota();
                let period = u64::try_from(q.period().as_nanos()).unwrap();
                match (t.kind(), c) {
                    (TierKind::Concurrency, _) => Bound::Slots { max: t.capacity() },
                    (TierKind::Calendar, TierChoice::Calendar { hour, .. }) => Bound::Window {
                        count: t.capacity(),
                        len: if *hour { 3_600 } else { 60 } * super::seams::S,
                    },
                    (_, _) if config.window => Bound::Window { count: q.count(), len: period },
                    _ => Bound::Rate { count: q.count(), period, burst: q.burst() },
                }
            })
            .collect();
        Self {
            bounds,
            slack: 0,
            reserve: config.reserve,
            events: Vec::new(),
            reserved: HashMap::new(),
            promised: None,
            back: false,
        }
    }

    /// Lets every rate tier admit `units` beyond its bound (lease mode's `N · B`).
    pub fn with_slack(mut self, units: u64) -> Self {
        self.slack = units;
        self
    }

    pub fn push(&mut self, e: Event) {
        self.events.push(e);
    }

    /// The reserve tier's emission interval and critical reserve, if the seam has a reserve.
    fn reserve_tier(&self, tier: usize) -> Option<(u64, u64)> {
        let (r, critical, _) = self.reserve.filter(|(r, ..)| *r == tier)?;
        let Bound::Rate { count, period, .. } = self.bounds[r] else { return None };
        Some((period.div_ceil(count), critical))
    }

    /// A request of `key` (any class) charged at `at` was settled at `now` above its charge by
    /// `extra` units on tier `tier`: a debt the key pays, into the reserve if it must
    /// (`Reserve`), so the reserve's promise waits until it drained.
    pub fn debt(&mut self, key: u8, tier: usize, at: u64, now: u64, extra: u64) {
        let Some((interval, critical)) = self.reserve_tier(tier) else { return };
        let r = self.reserved.entry(key).or_default();
        let mut from = at.max(now).max(r.debt);
        let mut units = extra;
        if r.booked > now {
            from = from.max(r.booked);
            units += critical;
        }
        r.debt = from.saturating_add(units.saturating_mul(interval));
    }

    /// The clock stepped back: from now on only the model and the other store judge.
    pub fn stepped_back(&mut self) {
        self.back = true;
    }

    /// Before a check: what the reserve promises it.
    pub fn before(
        &mut self,
        model: &mut Model,
        key: u8,
        now: u64,
        costs: &[u64],
        class: Priority,
        budget: Option<u64>,
    ) -> Result<(), String> {
        self.promised = None;
        let Some((r, critical, _)) = self.reserve else { return Ok(()) };
        let k = costs[r];
        if self.back || class != Priority::Critical || k == 0 || k > critical {
            return Ok(());
        }
        let Bound::Rate { count, period, .. } = self.bounds[r] else { return Ok(()) };
        let interval = period.div_ceil(count);
        let seen = self.reserved.get(&key).copied().unwrap_or_default();
        let unused = seen.free.is_none_or(|t| t.saturating_add(k * interval) <= now)
            && seen.line <= now
            && seen.debt.saturating_add(k * interval) <= now;
        let others =
            (0..costs.len()).filter(|&i| i != r).all(|i| model.room(key, now, i, costs[i], class));
        if unused && others && !model.blocked(key, now) {
            self.promised = Some(format!(
                "reserve: a critical request of {k} (reserve {critical}) must be admitted at once \
                 ({}; the reserve unused: {seen:?}; the other tiers have room, the key is not \
                 blocked)",
                if budget.is_some() { "shaped" } else { "policed" },
            ));
        }
        Ok(())
    }

    /// After a check: the reserve's promise, and the admission's bounds.
    pub fn after(
        &mut self,
        key: u8,
        now: u64,
        costs: &[u64],
        class: Priority,
        _budget: Option<u64>,
        d: &Decision,
    ) -> Result<(), String> {
        if let Some(promise) = self.promised.take() {
            if !d.is_allowed() || !d.delay().is_zero() {
                return Err(format!("{promise}; got {d:?}"));
            }
        }
        if !d.is_allowed() || costs.iter().all(|c| *c == 0) {
            return Ok(());
        }
        let at = now + u64::try_from(d.delay().as_nanos()).unwrap();
        if let Some((r, ..)) = self.reserve.filter(|(r, ..)| costs[*r] > 0) {
            let (interval, critical) = self.reserve_tier(r).unwrap_or((0, 0));
            let s = self.reserved.entry(key).or_default();
            let pending = s.booked > now;
            s.booked = s.booked.max(at);
            match class {
                Priority::Critical if pending || at > now => {
                    let back = at.max(s.booked) + critical * interval;
                    s.line = s.line.max(back);
                }
                Priority::Critical => s.free = Some(s.free.map_or(at, |f| f.max(at))),
                _ if at > now && !pending => {
                    // A schedule begins: the critical units past the standard line count as
                    // used until they leave.
                    if let Some(f) = s.free {
                        s.line = s.line.max(f + (critical + 1) * interval);
                    }
                }
                _ => {}
            }
        }
        self.events.push(Event::Admitted { key, at, costs: costs.to_vec() });
        if self.back {
            return Ok(());
        }
        self.admission(self.events.len() - 1)
    }

    /// Every bound at admission `j` (an index into the events).
    fn admission(&self, j: usize) -> Result<(), String> {
        let Event::Admitted { key, at: t2, costs } = &self.events[j] else { return Ok(()) };
        let decided = &self.events[..=j];
        for (i, bound) in self.bounds.iter().enumerate() {
            if costs[i] == 0 {
                continue;
            }
            match *bound {
                Bound::Rate { count, period, burst } => {
                    // (instant, units) of this key and tier, by instant.
                    let mut units: Vec<(u64, i128)> = decided
                        .iter()
                        .filter_map(|e| match e {
                            Event::Admitted { key: k, at, costs } if k == key && costs[i] > 0 => {
                                Some((*at, i128::from(costs[i])))
                            }
                            Event::Settled { key: k, tier, at, now, was, to }
                                if k == key && *tier == i =>
                            {
                                Some(((*at).max(*now), i128::from(*to) - i128::from(*was)))
                            }
                            _ => None,
                        })
                        .filter(|(t, _)| t <= t2)
                        .collect();
                    units.sort_by_key(|(t, _)| std::cmp::Reverse(*t));
                    let mut sum = 0i128;
                    for (n, &(t1, u)) in units.iter().enumerate() {
                        sum += u;
                        // Every unit at `t1` counted before the interval is judged.
                        if units.get(n + 1).is_some_and(|(next, _)| *next == t1) {
                            continue;
                        }
                        let allowed = u128::from(burst)
                            + u128::from(t2 - t1) * u128::from(count) / u128::from(period)
                            + u128::from(self.slack);
                        if sum > 0 && u128::try_from(sum).unwrap() > allowed {
                            return Err(format!(
                                "bound: tier t{i} of key k{key} admitted {sum} units in \
                                 [{t1}, {t2}] ns ({} ns), more than burst {burst} + rate {count} \
                                 per {period} ns{}: {allowed}",
                                t2 - t1,
                                if self.slack > 0 {
                                    format!(" + {} leased", self.slack)
                                } else {
                                    String::new()
                                },
                            ));
                        }
                    }
                }
                Bound::Window { count, len } => {
                    let w = t2 / len;
                    let mut used = 0i128;
                    for e in decided {
                        match e {
                            Event::Admitted { key: k, at, costs } if k == key && at / len == w => {
                                used += i128::from(costs[i]);
                            }
                            Event::Settled { key: k, tier, at, now, was, to }
                                if k == key && *tier == i =>
                            {
                                if to > was && (*at).max(*now) / len == w {
                                    used += i128::from(to - was);
                                } else if to < was && at / len == w && *now < (w + 1) * len {
                                    used -= i128::from(was - to);
                                }
                            }
                            _ => {}
                        }
                    }
                    if used > i128::from(count) {
                        return Err(format!(
                            "bound: window {w} of tier t{i} (key k{key}, {len} ns long) counts \
                             {used} with the admission at {t2} ns, more than its {count}"
                        ));
                    }
                }
                Bound::Slots { max } => {
                    let mut held = 0i128;
                    for e in decided {
                        match e {
                            Event::Admitted { key: k, costs, .. } if k == key => {
                                held += i128::from(costs[i])
                            }
                            Event::Released { key: k, costs } if k == key => {
                                held -= i128::from(costs[i])
                            }
                            _ => {}
                        }
                    }
                    if held > i128::from(max) {
                        return Err(format!(
                            "bound: tier t{i} (key k{key}) holds {held} slots, more than its {max}"
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// At the end of a trace: nothing left to check (each admission was checked as it came).
    pub fn bounds(&self) -> Result<(), String> {
        Ok(())
    }
}
