//! The reference model of the seam matrix (tests/all/seams.rs): what each feature's docs say a
//! store decides, written from the docs, one feature at a time, and combined as the docs
//! combine them. It knows:
//!
//! - GCRA rate tiers, as the continuous-state leaky bucket in units of `1/count` ns that
//!   `src/algorithm/model.rs` uses for its reference (the `Quota` docs; a request of cost `k`
//!   fits at `t` iff `max(TAT, t) + k·T - τ <= t`, in scaled units exactly);
//! - fixed windows (`Algorithm::FixedWindow`: `count` per window aligned to the epoch) and
//!   calendar tiers of UTC minutes and hours (`Calendar`: a window counts at most `count`; a
//!   shaped request is charged to the window holding its departure, at most 7 windows ahead);
//! - concurrency tiers (`Concurrency`: `max` held at once; a full tier refuses whatever the
//!   shaping budget);
//! - a penalty box (`Penalty`: a breach is a refusal the tier itself could not admit at that
//!   instant; the `k`-th breach within `within` blocks the key for `block`; blocked checks are
//!   refused, charge nothing and are no breach; a cost above capacity is no breach);
//! - reserved capacity (`Reserve`: a class decides with the burst less what is withheld from
//!   it, on the tier's one state; shaping, the critical reserve is kept out of the schedule of
//!   the lower classes by a line per key, as `Reserve`'s "Shaping" and `algorithm::line` say:
//!   [`Line`]);
//! - settlements (`Store::settle`, `settle_tiers`: less gives back, more charges the extra
//!   unconditionally at the later of the charge's instant and now; a window's refund reaches
//!   it only while it is counted) and releases of slots.
//!
//! The model decides in nanoseconds: the seam policies keep every span under 2^50 ns, where
//! the crate decides to the nanosecond (`Policy::precision`).
#![allow(dead_code, unreachable_pub)]

use std::collections::{BTreeMap, HashMap};

use tollgate::{Algorithm, CalendarPeriod, Outcome, Policy, Priority, TierKind};

/// Windows a shaped request may be charged in on a calendar tier: the current one and the next
/// seven (`Calendar` docs).
const LOOKAHEAD: u64 = 8;

/// One tier as the model sees it.
#[derive(Debug, Clone)]
enum Kind {
    Gcra {
        count: u64,
        period: u64,
        burst: u64,
    },
    /// A fixed window (`len` ns, aligned to the epoch) or a calendar window of UTC minutes or
    /// hours (the same arithmetic; a calendar tier looks ahead [`LOOKAHEAD`] windows at most).
    Window {
        count: u64,
        len: u64,
        calendar: bool,
    },
    Slots {
        max: u64,
    },
}

#[derive(Debug, Clone)]
struct Tier {
    kind: Kind,
    /// `(block, refusals, within)` in ns.
    penalty: Option<(u64, u64, u64)>,
    /// Units withheld from standard and from sheddable requests.
    withheld: [u64; 2],
    /// The critical reserve of a GCRA tier that keeps one (0: none, and no line).
    reserve: u64,
}

impl Tier {
    /// `(count, period, critical reserve)` of a GCRA tier that keeps a line.
    fn lined(&self) -> Option<(u64, u64, u64)> {
        match self.kind {
            Kind::Gcra { count, period, .. } if self.reserve > 0 => {
                Some((count, period, self.reserve))
            }
            _ => None,
        }
    }

    /// The standard line: the burst less the critical reserve, in scaled units.
    fn tau_std(&self) -> u128 {
        match self.kind {
            Kind::Gcra { period, burst, .. } => {
                u128::from(burst - self.reserve) * u128::from(period)
            }
            _ => 0,
        }
    }

    /// For a critical request of `cost` decided at `now` on a tier with a line: the earliest
    /// instant the line lets it leave ahead of the schedule, and the schedule's end.
    fn on_line(&self, s: &State, class: Priority, now: u64, cost: u64) -> Option<(u64, u64)> {
        let (count, period, reserve) = self.lined()?;
        if class != Priority::Critical || cost == 0 {
            return None;
        }
        s.line.back(count, period, reserve, now, cost).map(|b| (b, s.line.until))
    }

    fn capacity(&self, class: Priority) -> u64 {
        let withheld = match class {
            Priority::Critical => 0,
            Priority::Standard => self.withheld[0],
            Priority::Sheddable => self.withheld[1],
        };
        match self.kind {
            Kind::Gcra { burst, .. } => burst - withheld,
            Kind::Window { count, .. } => count,
            Kind::Slots { max } => max,
        }
    }
}

/// A key's state of one tier.
#[derive(Debug, Clone, Default)]
struct State {
    /// GCRA: the TAT in units of `1/count` ns.
    tat: u128,
    /// Windows: units counted per window index.
    windows: BTreeMap<u64, u64>,
    /// Concurrency: slots held.
    held: u64,
    /// Penalty box: breaches counted, and the end of the block (0: none).
    breaches: Vec<u64>,
    until: u64,
    /// A reserve tier's line.
    line: Line,
}

/// The critical reserve kept out of the schedule (`Reserve`, "Shaping"): `until`, when the
/// last request scheduled ahead leaves; `used`, the critical units admitted ahead of it (or
/// past the standard line when it began), which come back `used` intervals after `used_until`
/// (the schedule that saw them left). Instants in ns; TATs scaled by the count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Line {
    until: u64,
    used_until: u64,
    used: u64,
}

impl Line {
    fn reset(&self, count: u64, period: u64) -> u128 {
        u128::from(self.used_until) * u128::from(count) + u128::from(self.used) * u128::from(period)
    }

    fn used_at(&self, count: u64, period: u64, t: u64) -> u64 {
        let gone = self.reset(count, period) <= u128::from(t) * u128::from(count);
        if self.used == 0 || gone { 0 } else { self.used }
    }

    fn prune(&mut self, count: u64, period: u64, now: u64) {
        if now >= self.until {
            *self = Self::default();
        } else if self.used_at(count, period, now) == 0 {
            self.used = 0;
        }
    }

    fn admits(&self, count: u64, period: u64, reserve: u64, t: u64, cost: u64) -> bool {
        t < self.until && self.used_at(count, period, t) + cost <= reserve
    }

    /// The earliest instant `>= now` a critical request of `cost` decided then leaves on the
    /// line, if any.
    fn back(&self, count: u64, period: u64, reserve: u64, now: u64, cost: u64) -> Option<u64> {
        if self.admits(count, period, reserve, now, cost) {
            return Some(now);
        }
        let back = u64::try_from(self.reset(count, period).div_ceil(u128::from(count))).unwrap();
        (self.used > 0 && cost <= reserve && back < self.until).then(|| back.max(now))
    }

    /// Units past the standard line `tau_std` a TAT of `tat` is at `now`, rounded up.
    fn past(count: u64, period: u64, tau_std: u128, now: u64, tat: u128) -> u64 {
        let s = tat.saturating_sub(u128::from(now) * u128::from(count) + tau_std);
        u64::try_from(s.div_ceil(u128::from(period))).unwrap()
    }

    /// A lower-class request leaving at `at`, decided at `now` on a TAT of `tat` before its
    /// charge.
    fn lower(&mut self, count: u64, period: u64, tau_std: u128, now: u64, at: u64, tat: u128) {
        if at <= now {
            return;
        }
        if self.until == 0 {
            self.used = Self::past(count, period, tau_std, now, tat);
            self.used_until = now;
        }
        self.until = self.until.max(at);
    }

    /// Units charged now ahead of the schedule, outside the line's own admissions (`tat`
    /// after the charge).
    fn taken(&mut self, count: u64, period: u64, tau_std: u128, now: u64, cost: u64, tat: u128) {
        if now >= self.until {
            return;
        }
        let used = self.used_at(count, period, now);
        let past = Self::past(count, period, tau_std, now, tat);
        let new = (used + cost).min(used.max(past));
        if new != used {
            self.used = new;
            self.used_until = self.until;
        }
    }
}

/// What the model says of one check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expect {
    pub outcome: Outcome,
    /// The shaping delay of an admitted check, ns.
    pub delay: u64,
    /// The `retry_after` of a refusal, ns, where the docs make it exact (`None` for a
    /// concurrency tier's typical hold, a shaped refusal, or an admission).
    pub retry: Option<u64>,
    /// Whether the key was blocked by a penalty box when the check came.
    pub blocked: bool,
}

/// What an admitted check charged, to settle it later.
#[derive(Debug, Clone)]
pub struct Charged {
    pub key: u8,
    /// The charge's instant (the departure when shaped).
    pub at: u64,
    /// Per tier: units charged (slots for a concurrency tier).
    pub costs: Vec<u64>,
}

/// The model of one policy over several keys.
#[derive(Debug, Clone)]
pub struct Model {
    tiers: Vec<Tier>,
    keys: HashMap<u8, Vec<State>>,
}

impl Model {
    /// The model of `policy`: GCRA or fixed-window rates, UTC calendar minutes and hours,
    /// concurrency tiers, penalties and reserves.
    ///
    /// # Panics
    /// On a policy the model does not know (another algorithm, a calendar period or zone the
    /// seam policies do not use).
    pub fn new(policy: &Policy) -> Self {
        assert_eq!(policy.precision(), std::time::Duration::from_nanos(1), "ns policies only");
        let tiers = policy
            .tiers()
            .iter()
            .map(|t| {
                let kind = match t.kind() {
                    TierKind::Rate => {
                        let q = t.quota();
                        let period = nanos(q.period());
                        match policy.algorithm() {
                            Algorithm::Gcra => {
                                Kind::Gcra { count: q.count(), period, burst: q.burst() }
                            }
                            Algorithm::FixedWindow => {
                                Kind::Window { count: q.count(), len: period, calendar: false }
                            }
                            other => panic!("the model has no {}", other.name()),
                        }
                    }
                    TierKind::Calendar => {
                        let c = t.calendar().unwrap();
                        assert_eq!(c.time_zone(), "UTC");
                        let len = match c.period() {
                            CalendarPeriod::Minute => 60_000_000_000,
                            CalendarPeriod::Hour => 3_600_000_000_000,
                            other => panic!("the model has no calendar {}", other.name()),
                        };
                        Kind::Window { count: c.count(), len, calendar: true }
                    }
                    TierKind::Concurrency => Kind::Slots { max: t.concurrency().unwrap().max() },
                    _ => panic!("unknown tier kind"),
                };
                let penalty = t.penalty().map(|p| {
                    let within = if p.refusals() == 1 { 0 } else { nanos(p.within()) };
                    (nanos(p.block()), u64::from(p.refusals()), within)
                });
                let r = t.reserve().unwrap_or_default();
                let withheld =
                    [r.withheld_from(Priority::Standard), r.withheld_from(Priority::Sheddable)];
                let reserve = match kind {
                    Kind::Gcra { .. } => r.critical_units(),
                    _ => 0,
                };
                Tier { kind, penalty, withheld, reserve }
            })
            .collect();
        Self { tiers, keys: HashMap::new() }
    }

    fn states(&mut self, key: u8) -> &mut Vec<State> {
        let n = self.tiers.len();
        self.keys.entry(key).or_insert_with(|| vec![State::default(); n])
    }

    /// Decides a check of `key` at `now` costing `costs` per tier (0: the tier is neither
    /// checked nor charged), of class `class`, shaped within `budget` ns or policed (`None`);
    /// charges the model when admitted.
    pub fn decide(
        &mut self,
        key: u8,
        now: u64,
        costs: &[u64],
        class: Priority,
        budget: Option<u64>,
    ) -> (Expect, Option<Charged>) {
        let tiers = self.tiers.clone();
        let states = self.states(key);
        prune(&tiers, states, now);
        let refused =
            |retry, blocked| (Expect { outcome: Outcome::Limited, delay: 0, retry, blocked }, None);
        if costs.iter().all(|c| *c == 0) {
            let e = Expect { outcome: Outcome::Allowed, delay: 0, retry: None, blocked: false };
            return (e, None);
        }
        if tiers.iter().zip(costs).any(|(t, c)| *c > t.capacity(class)) {
            let e = Expect {
                outcome: Outcome::CostExceedsCapacity,
                delay: 0,
                retry: None,
                blocked: false,
            };
            return (e, None);
        }
        // Each tier's own earliest instant from `now`, and whether a concurrency tier is full.
        let own = |states: &[State], i: usize| {
            let e = earliest(&tiers[i], &states[i], now, costs[i], class);
            tiers[i].on_line(&states[i], class, now, costs[i]).map_or(e, |(b, _)| b.min(e))
        };
        let full = |states: &[State], i: usize| match tiers[i].kind {
            Kind::Slots { max } => costs[i] > 0 && states[i].held + costs[i] > max,
            _ => false,
        };
        let any_full = (0..tiers.len()).any(|i| full(states, i));
        let until = states.iter().map(|s| s.until).max().unwrap_or(0);
        let budget = budget.unwrap_or(0);
        let (departure, beyond) = depart(&tiers, states, now, costs, class);
        // Past the budget, the retry is when the departure is within it; past a calendar
        // tier's lookahead, not before the current window ends.
        let mut retry = (departure - now > budget).then(|| departure - now - budget);
        // A critical request refused may be admitted sooner on a line, decided then.
        let lined = |i: usize| tiers[i].on_line(&states[i], class, now, costs[i]);
        if let Some(r) = retry.filter(|_| (0..tiers.len()).any(|i| lined(i).is_some())) {
            let mut t = now;
            loop {
                let next = (0..tiers.len())
                    .map(|i| match lined(i) {
                        Some((back, until)) if t.max(back) < until => t.max(back),
                        _ => earliest(&tiers[i], &states[i], t, costs[i], class),
                    })
                    .fold(t, u64::max);
                if next == t {
                    break;
                }
                t = next;
            }
            if t > now {
                retry = Some(r.min(t - now));
            }
        }
        if let Some(end) = beyond {
            retry = Some(retry.unwrap_or(0).max(end - now));
        }
        let later = |r: Option<u64>, left: u64| Some(r.map_or(left, |r| r.max(left)));
        if until > now {
            // Blocked: refused, charging nothing, no breach.
            let retry = (!any_full).then(|| later(retry, until - now)).flatten();
            return refused(retry, true);
        }
        if retry.is_some() || any_full {
            // A breach of each penalized tier that could not admit the check now.
            for i in 0..tiers.len() {
                let Some((block, refusals, within)) = tiers[i].penalty else { continue };
                if costs[i] == 0 || own(states, i) == now {
                    continue;
                }
                let s = &mut states[i];
                s.breaches.retain(|t| t.saturating_add(within) > now);
                s.breaches.push(now);
                if s.breaches.len() as u64 >= refusals {
                    s.breaches.clear();
                    s.until = now.saturating_add(block);
                    retry = later(retry, s.until - now);
                }
            }
            // A full concurrency tier's retry is its typical hold, which the model does not
            // know.
            return refused(if any_full { None } else { retry }, false);
        }
        let at = departure;
        // Whether the TAT alone (the whole burst) admits it at its departure, and the TAT
        // before, of each tier keeping a line.
        let before: Vec<(bool, u128)> = (0..tiers.len())
            .map(|i| {
                let full = earliest(&tiers[i], &states[i], at, costs[i], Priority::Critical);
                (full <= at, states[i].tat)
            })
            .collect();
        for (i, t) in tiers.iter().enumerate() {
            charge(t, &mut states[i], at, costs[i]);
        }
        for (i, t) in tiers.iter().enumerate() {
            let Some((count, period, reserve)) = t.lined() else { continue };
            if costs[i] == 0 {
                continue;
            }
            let (tau, (full, was), s) = (t.tau_std(), before[i], &mut states[i]);
            if class != Priority::Critical {
                s.line.lower(count, period, tau, now, at, was);
                continue;
            }
            let line = &mut s.line;
            if !full {
                // Admitted on the line, ahead of the schedule.
                line.used = line.used_at(count, period, at) + costs[i];
                line.used_until = line.until;
            } else if at > now {
                // Waiting behind the schedule: no room ahead of it until it leaves.
                line.until = line.until.max(at);
                line.used = reserve;
                line.used_until = line.until;
            } else {
                line.taken(count, period, tau, now, costs[i], s.tat);
            }
        }
        let e = Expect { outcome: Outcome::Allowed, delay: at - now, retry: None, blocked: false };
        (e, Some(Charged { key, at, costs: costs.to_vec() }))
    }

    /// Settles tier `i` of `charged` at `cost` at `now` (`Store::settle_tiers`): less gives back
    /// the difference, more charges it unconditionally.
    pub fn settle_tier(&mut self, charged: &mut Charged, i: usize, cost: u64, now: u64) {
        let tiers = self.tiers.clone();
        let t = &tiers[i];
        let was = charged.costs[i];
        let states = self.states(charged.key);
        // A settlement first forgets what no longer matters, as a check does.
        prune(&tiers, states, now);
        let s = &mut states[i];
        match t.kind {
            Kind::Slots { .. } => return,
            Kind::Gcra { period, count, .. } => {
                if cost > was {
                    let at = u128::from(charged.at.max(now)) * u128::from(count);
                    s.tat = s.tat.max(at) + u128::from(cost - was) * u128::from(period);
                    // Charged now, ahead of any schedule: the line counts it.
                    if t.lined().is_some() {
                        let tat = s.tat;
                        s.line.taken(count, period, t.tau_std(), now, cost - was, tat);
                    }
                } else {
                    s.tat = s.tat.saturating_sub(u128::from(was - cost) * u128::from(period));
                }
            }
            Kind::Window { len, .. } => {
                if cost > was {
                    *s.windows.entry(charged.at.max(now) / len).or_default() += cost - was;
                } else {
                    let k = charged.at / len;
                    if let Some(used) = s.windows.get_mut(&k) {
                        *used = used.saturating_sub(was - cost);
                        if *used == 0 {
                            s.windows.remove(&k);
                        }
                    }
                }
            }
        }
        charged.costs[i] = cost;
    }

    /// Settles every rate and calendar tier of `charged` at `cost` and releases its slots
    /// (`Store::settle`; 0 cancels).
    pub fn settle(&mut self, mut charged: Charged, cost: u64, now: u64) {
        for i in 0..self.tiers.len() {
            if !matches!(self.tiers[i].kind, Kind::Slots { .. }) {
                self.settle_tier(&mut charged, i, cost, now);
            }
        }
        self.release(&charged);
    }

    /// Releases the slots `charged` holds.
    pub fn release(&mut self, charged: &Charged) {
        let tiers = self.tiers.clone();
        let states = self.states(charged.key);
        for (i, t) in tiers.iter().enumerate() {
            if matches!(t.kind, Kind::Slots { .. }) {
                states[i].held = states[i].held.saturating_sub(charged.costs[i]);
            }
        }
    }

    /// Whether tier `i` has room for `cost` units of `class` for `key` at `now` (a concurrency
    /// tier: a slot free; cost 0: always).
    pub fn room(&mut self, key: u8, now: u64, i: usize, cost: u64, class: Priority) -> bool {
        let tiers = self.tiers.clone();
        let states = self.states(key);
        prune(&tiers, states, now);
        let t = &tiers[i];
        cost == 0
            || (cost <= t.capacity(class)
                && match t.kind {
                    Kind::Slots { max } => states[i].held + cost <= max,
                    _ => earliest(t, &states[i], now, cost, class) == now,
                })
    }

    /// Whether `key` is blocked by a penalty box at `now`.
    pub fn blocked(&mut self, key: u8, now: u64) -> bool {
        self.states(key).iter().any(|s| s.until > now)
    }
}

fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap()
}

/// What a decision forgets first (the stores' `prune`): ended windows, ended blocks, breaches
/// out of their window.
fn prune(tiers: &[Tier], states: &mut [State], now: u64) {
    for (t, s) in tiers.iter().zip(states) {
        if let Kind::Window { len, .. } = t.kind {
            let k = now / len;
            s.windows.retain(|w, _| *w >= k);
        }
        if let Some((count, period, _)) = t.lined() {
            s.line.prune(count, period, now);
            // A tier whose TAT is not after now schedules nothing ahead.
            if s.tat <= u128::from(now) * u128::from(count) {
                s.line = Line::default();
            }
        }
        if let Some((_, _, within)) = t.penalty {
            if s.until <= now {
                s.until = 0;
            }
            s.breaches.retain(|b| b.saturating_add(within) > now);
        }
    }
}

/// The earliest instant `>= from` at which tier `t` in state `s` has room for `cost` (`from`
/// for a concurrency tier, which does not wait).
fn earliest(t: &Tier, s: &State, from: u64, cost: u64, class: Priority) -> u64 {
    if cost == 0 {
        return from;
    }
    match t.kind {
        Kind::Gcra { count, period, .. } => {
            let (c, p) = (u128::from(count), u128::from(period));
            let from_s = u128::from(from) * c;
            let new = s.tat.max(from_s) + u128::from(cost) * p;
            let allow = new.saturating_sub(u128::from(t.capacity(class)) * p);
            if allow <= from_s { from } else { u64::try_from(allow.div_ceil(c)).unwrap() }
        }
        Kind::Window { count, len, .. } => {
            let mut k = from / len;
            loop {
                if s.windows.get(&k).copied().unwrap_or(0) + cost <= count {
                    return from.max(k * len);
                }
                k += 1;
            }
        }
        Kind::Slots { .. } => from,
    }
}

/// The instant a check leaves: the earliest at which every tier has room for it together;
/// and, when that is past a calendar tier's lookahead (the window holding `now` and the next
/// seven), the end of the current window of that tier.
fn depart(
    tiers: &[Tier],
    states: &[State],
    now: u64,
    costs: &[u64],
    class: Priority,
) -> (u64, Option<u64>) {
    let mut t = now;
    loop {
        let next = (0..tiers.len())
            .map(|i| match tiers[i].on_line(&states[i], class, now, costs[i]) {
                // On the line, a critical request leaves at once or not at all.
                Some((back, _)) if t == now && back == now => now,
                _ => earliest(&tiers[i], &states[i], t, costs[i], class),
            })
            .fold(t, u64::max);
        if next == t {
            break;
        }
        t = next;
    }
    let beyond = tiers
        .iter()
        .zip(costs)
        .filter_map(|(tier, cost)| match tier.kind {
            Kind::Window { len, calendar: true, .. }
                if *cost > 0 && t / len >= now / len + LOOKAHEAD =>
            {
                Some((now / len + 1) * len)
            }
            _ => None,
        })
        .max();
    (t, beyond)
}

/// Charges `cost` to tier `t` in state `s` at instant `at`.
fn charge(t: &Tier, s: &mut State, at: u64, cost: u64) {
    if cost == 0 {
        return;
    }
    match t.kind {
        Kind::Gcra { count, period, .. } => {
            let at = u128::from(at) * u128::from(count);
            s.tat = s.tat.max(at) + u128::from(cost) * u128::from(period);
        }
        Kind::Window { len, .. } => *s.windows.entry(at / len).or_default() += cost,
        Kind::Slots { .. } => s.held += cost,
    }
}
