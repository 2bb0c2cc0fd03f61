//! The six algorithms as pure state transitions over an injected instant, and the
//! all-or-nothing decision over a policy's tiers.
//!
//! Every function here takes the instant as an argument (nanoseconds since the clock's epoch)
//! and touches nothing but the state it is given, so the same trace gives the same decisions in
//! every store and in tests.

mod bucket;
pub(crate) mod calendar;
pub(crate) mod compiled;
mod gcra;
mod line;
mod log;
mod penalty;
pub(crate) mod slots;
mod window;

use smallvec::SmallVec;

use crate::decision::{Decision, Outcome, TierDecision, Tiers};
use crate::policy::{Policy, Tier};
use crate::quota::{Algorithm, Priority};
use compiled::{Kind, Rate};

pub(crate) use bucket::Level;
pub(crate) use gcra::{Step as GcraStep, WholeGcra};

pub(crate) use line::Line;
pub(crate) use log::Log;
pub(crate) use penalty::Strikes;

/// One tier's state for one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TierState {
    /// GCRA: scaled TAT (see `gcra`).
    Gcra(u128),
    /// Token or leaky bucket level.
    Bucket(Level),
    /// Fixed window or sliding window counter.
    Windows(Vec<(u64, u64)>),
    /// Sliding window log.
    Log(Log),
    /// A concurrency tier: slots held.
    Slots(u64),
    /// A calendar tier: the windows counted in.
    Calendar(calendar::Counted),
    /// A tier's penalty box, kept after the tiers' own states (see [`Policy::penalty_slot`]).
    Penalty(Box<Strikes>),
    /// The line of a tier with a critical reserve, kept after the penalty boxes (see
    /// [`Policy::line_slot`] and [`line`]).
    Line(Line),
}

/// What each tier was charged, inline for up to two tiers.
pub(crate) type Charges = SmallVec<[Charge; 2]>;

/// What one tier was charged, so that it can be given back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Charge {
    /// The instant the charge took effect (later than the decision when shaping).
    pub(crate) at: u64,
    /// Units charged.
    pub(crate) cost: u64,
    /// The sliding log entry's id (0 for other algorithms).
    pub(crate) id: u64,
}

impl TierState {
    /// The state of a key never seen (or idle past its horizon).
    pub(crate) fn fresh(alg: Algorithm, r: Rate, now: u64) -> Self {
        match alg {
            Algorithm::Gcra => Self::Gcra(0),
            Algorithm::TokenBucket => Self::Bucket(bucket::token::fresh(r, now)),
            Algorithm::LeakyBucket => Self::Bucket(bucket::leaky::fresh(now)),
            Algorithm::FixedWindow | Algorithm::SlidingCounter => Self::Windows(Vec::new()),
            Algorithm::SlidingLog => Self::Log(Log::default()),
        }
    }

    /// The state of `tier` for a key never seen (or idle past its horizon), any kind.
    pub(crate) fn fresh_for(alg: Algorithm, tier: &Tier, now: u64) -> Self {
        match tier.kind {
            Kind::Rate => Self::fresh(alg, tier.rate, now),
            Kind::Concurrency(_) => Self::Slots(0),
            Kind::Calendar(_) => Self::Calendar(Vec::new()),
        }
    }

    /// Whether the state of `tier`, any kind, decides like a fresh one at `now` (units of
    /// `unit` nanoseconds).
    pub(crate) fn is_idle_for(&self, alg: Algorithm, tier: &Tier, unit: u64, now: u64) -> bool {
        match (&tier.kind, self) {
            (Kind::Rate, _) => self.is_idle(alg, tier.rate, now),
            (Kind::Concurrency(_), Self::Slots(held)) => *held == 0,
            (Kind::Calendar(_), Self::Calendar(c)) => {
                c.iter().all(|w| calendar::to_units(w.1, unit) <= now)
            }
            _ => true,
        }
    }

    /// Forgets what no longer matters at `now` (expired windows and log entries).
    fn prune(&mut self, alg: Algorithm, r: Rate, now: u64) {
        match (alg, self) {
            (Algorithm::FixedWindow, Self::Windows(w)) => window::fixed::prune(w, r, now),
            (Algorithm::SlidingCounter, Self::Windows(w)) => window::sliding::prune(w, r, now),
            (Algorithm::SlidingLog, Self::Log(l)) => log::prune(l, r, now),
            _ => {}
        }
    }

    /// Earliest instant >= `from` at which `cost` (<= capacity) fits this tier.
    fn earliest(&self, alg: Algorithm, r: Rate, from: u64, cost: u64) -> u64 {
        match (alg, self) {
            (Algorithm::Gcra, Self::Gcra(tat)) => gcra::earliest(r, *tat, from, cost),
            (Algorithm::TokenBucket, Self::Bucket(s)) => bucket::token::earliest(r, *s, from, cost),
            (Algorithm::LeakyBucket, Self::Bucket(s)) => bucket::leaky::earliest(r, *s, from, cost),
            (Algorithm::FixedWindow, Self::Windows(w)) => window::fixed::earliest(w, r, from, cost),
            (Algorithm::SlidingCounter, Self::Windows(w)) => {
                window::sliding::earliest(w, r, from, cost)
            }
            (Algorithm::SlidingLog, Self::Log(l)) => log::earliest(l, r, from, cost),
            // A state of another algorithm (the policy changed under a live key): start over
            // from a fresh state of the right kind, as `charge` does.
            (_, _) => Self::fresh(alg, r, from).earliest(alg, r, from, cost),
        }
    }

    /// Charges `cost` at instant `at` unconditionally.
    pub(crate) fn charge(
        &mut self,
        alg: Algorithm,
        r: Rate,
        now: u64,
        at: u64,
        cost: u64,
    ) -> Charge {
        let mut id = 0;
        match (alg, &mut *self) {
            (Algorithm::Gcra, Self::Gcra(tat)) => gcra::charge(r, tat, at, cost),
            (Algorithm::TokenBucket, Self::Bucket(s)) => bucket::token::charge(r, s, at, cost),
            (Algorithm::LeakyBucket, Self::Bucket(s)) => bucket::leaky::charge(r, s, at, cost),
            (Algorithm::FixedWindow | Algorithm::SlidingCounter, Self::Windows(w)) => {
                window::charge(w, r, at, cost);
            }
            (Algorithm::SlidingLog, Self::Log(l)) => id = log::charge(l, at, cost),
            (_, _) => {
                *self = Self::fresh(alg, r, now);
                return self.charge(alg, r, now, at, cost);
            }
        }
        Charge { at, cost, id }
    }

    /// Gives back `cost` of an earlier `charge` (at most what it charged).
    pub(crate) fn refund(&mut self, alg: Algorithm, r: Rate, charge: Charge, cost: u64) {
        match (alg, self) {
            (Algorithm::Gcra, Self::Gcra(tat)) => gcra::refund(r, tat, cost),
            (Algorithm::TokenBucket, Self::Bucket(s)) => bucket::token::refund(r, s, cost),
            (Algorithm::LeakyBucket, Self::Bucket(s)) => bucket::leaky::refund(r, s, cost),
            (Algorithm::FixedWindow | Algorithm::SlidingCounter, Self::Windows(w)) => {
                window::refund(w, r, charge.at, cost);
            }
            (Algorithm::SlidingLog, Self::Log(l)) => {
                log::refund(l, charge.id, charge.at, charge.cost, cost);
            }
            _ => {}
        }
    }

    /// `(remaining units, nanoseconds until back to full capacity)` at `now`.
    fn status(&self, alg: Algorithm, r: Rate, now: u64) -> (u64, u64) {
        match (alg, self) {
            (Algorithm::Gcra, Self::Gcra(tat)) => gcra::status(r, *tat, now),
            (Algorithm::TokenBucket, Self::Bucket(s)) => bucket::token::status(r, *s, now),
            (Algorithm::LeakyBucket, Self::Bucket(s)) => bucket::leaky::status(r, *s, now),
            (Algorithm::FixedWindow, Self::Windows(w)) => window::fixed::status(w, r, now),
            (Algorithm::SlidingCounter, Self::Windows(w)) => window::sliding::status(w, r, now),
            (Algorithm::SlidingLog, Self::Log(l)) => log::status(l, r, now),
            (_, _) => (r.burst, 0),
        }
    }

    /// Whether the state is indistinguishable from a fresh one at `now` (safe to evict).
    pub(crate) fn is_idle(&self, alg: Algorithm, r: Rate, now: u64) -> bool {
        let (remaining, reset_after) = self.status(alg, r, now);
        reset_after == 0 && remaining >= r.burst
    }

    /// When shaping with the leaky bucket: the drain time of the water ahead at `t`.
    fn queue_wait(&self, alg: Algorithm, r: Rate, t: u64) -> u64 {
        match (alg, self) {
            (Algorithm::LeakyBucket, Self::Bucket(s)) => bucket::leaky::queue_wait(r, *s, t),
            _ => 0,
        }
    }

    /// Earliest instant >= `from` at which `cost` may leave: [`earliest`](Self::earliest),
    /// and when `shaping` a leaky bucket holds the request until the water ahead of it has
    /// drained, so that output is smooth at the leak rate.
    fn departure(&self, alg: Algorithm, r: Rate, from: u64, cost: u64, shaping: bool) -> u64 {
        let e = self.earliest(alg, r, from, cost);
        if shaping { e.saturating_add(self.queue_wait(alg, r, e)) } else { e }
    }

    /// Whether the state holds windows, log entries, a line, or a penalty box's block or
    /// breaches, which a decision prunes once they end (and the Redis store then writes the
    /// key back, or deletes it when idle: the memory store forgets it then too).
    pub(crate) fn has_entries(&self) -> bool {
        match self {
            Self::Windows(w) => !w.is_empty(),
            Self::Calendar(c) => !c.is_empty(),
            Self::Log(l) => !l.is_empty(),
            // A line is forgotten when its tier is idle (see `prune_kinds`).
            Self::Line(l) => l.until > 0,
            Self::Penalty(s) => s.until > 0 || !s.at.is_empty(),
            _ => false,
        }
    }

    /// The windows this state counts in (window algorithms and calendar tiers; 0 for the
    /// others): what bounds the rounds of [`converge`].
    fn entries(&self) -> usize {
        match self {
            Self::Windows(w) => w.len(),
            Self::Calendar(c) => c.len(),
            // A critical request admitted on a line until it ends, then by the TAT: like a
            // window, it can move the candidate once out of it.
            Self::Line(l) => usize::from(l.until > 0),
            _ => 0,
        }
    }
}

/// The penalty boxes of a key never seen, one per tier that has one, then its lines, one per
/// tier with a critical reserve: what a key keeps after its tiers' states.
pub(crate) fn fresh_boxes(policy: &Policy) -> impl Iterator<Item = TierState> + '_ {
    let tiers = policy.tiers();
    let boxes =
        tiers.iter().filter(|t| t.penalty.is_some()).map(|_| TierState::Penalty(Box::default()));
    let lines = (0..tiers.len())
        .filter(|&i| policy.line_reserve(i).is_some())
        .map(|_| TierState::Line(Line::default()));
    boxes.chain(lines)
}

/// The line of tier `i` in `states` and the tier's critical reserve, if it keeps one.
fn line_of(policy: &Policy, states: &[TierState], i: usize) -> Option<(Line, u64)> {
    let reserve = policy.line_reserve(i)?;
    match states.get(policy.line_slot(i)) {
        Some(TierState::Line(l)) => Some((*l, reserve)),
        _ => None,
    }
}

/// Stores `line` as tier `i`'s.
fn set_line(policy: &Policy, states: &mut [TierState], i: usize, line: Line) {
    if let Some(s) = states.get_mut(policy.line_slot(i)) {
        *s = TierState::Line(line);
    }
}

/// The tolerance of tier `i` for standard requests (its burst less the critical reserve),
/// scaled as GCRA scales instants (by the count).
fn tau_std(tier: &Tier, reserve: u64) -> u128 {
    u128::from(tier.rate.burst.saturating_sub(reserve)) * u128::from(tier.rate.period)
}

/// The scaled TAT of a GCRA state (0 for any other).
fn tat_of(state: &TierState) -> u128 {
    match state {
        TierState::Gcra(tat) => *tat,
        _ => 0,
    }
}

/// The box of tier `i` in `states`, if the tier has one.
fn strikes<'s>(policy: &Policy, states: &'s [TierState], i: usize) -> Option<&'s Strikes> {
    policy.tiers()[i].penalty?;
    match states.get(policy.penalty_slot(i)) {
        Some(TierState::Penalty(s)) => Some(s),
        _ => None,
    }
}

/// [`strikes`], to change.
fn strikes_mut<'s>(
    policy: &Policy,
    states: &'s mut [TierState],
    i: usize,
) -> Option<&'s mut Strikes> {
    policy.tiers()[i].penalty?;
    match states.get_mut(policy.penalty_slot(i)) {
        Some(TierState::Penalty(s)) => Some(s),
        _ => None,
    }
}

/// Whether every penalty box in `states` decides like a fresh one at `now` (units).
pub(crate) fn boxes_idle(policy: &Policy, states: &[TierState], now: u64) -> bool {
    policy.tiers().iter().enumerate().all(|(i, t)| match (t.penalty, strikes(policy, states, i)) {
        (Some(b), Some(s)) => s.is_idle(&b, now),
        _ => true,
    })
}

/// The end of the block of tier `i` at `now` (units), if the key is blocked by it.
fn blocked(policy: &Policy, states: &[TierState], i: usize, now: u64) -> Option<u64> {
    strikes(policy, states, i).and_then(|s| s.blocked(now))
}

/// The least instant >= `from` at which every tier conforms: each round asks every tier for
/// its earliest instant from the candidate (`next` returns the latest of them) until no tier
/// moves it. `None` when `rounds` rounds do not settle it, which [`rounds`] rules out.
///
/// Each tier's answer is its least conforming instant >= the candidate, so the candidate never
/// passes an instant at which all tiers conform: what settles is the least such instant.
fn converge(from: u64, rounds: usize, mut next: impl FnMut(u64) -> u64) -> Option<u64> {
    let mut t = from;
    for _ in 0..rounds {
        let n = next(t);
        if n == t {
            return Some(t);
        }
        t = n;
    }
    None
}

/// Rounds enough for [`converge`] over `states`: `2 + 2 E`, `E` the windows they count in.
///
/// GCRA, the buckets (a leaky bucket's departure too) and the sliding log conform from some
/// instant on for good (their level only improves with time, and reservations are already in
/// it), so each answers `max(t, c)` for a constant `c` and none moves the candidate after the
/// first round. A fixed window or calendar tier moves it only out of a window it counts in
/// and that is full, to that window's end, never to come back; a sliding counter only within
/// or out of a window that it or its predecessor counts in, conforming for the rest of that
/// window after. So at most `1 + 2 E` rounds move the candidate, and one more sees it settle.
fn rounds(states: &[TierState]) -> usize {
    let windows: usize = states.iter().map(TierState::entries).sum();
    windows.saturating_mul(2).saturating_add(2)
}

/// The mode of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Admit only now.
    Police,
    /// Admit within this many nanoseconds, reserving the slot.
    Shape(u64),
}

/// The instant `now` (nanoseconds) in `policy`'s time unit (see [`Policy::precision`]): the unit
/// it falls in.
#[inline]
pub(crate) fn in_units(policy: &Policy, now: u64) -> u64 {
    now / policy.unit()
}

/// Decides one request of `cost` over all tiers of a plain policy (every tier a rate counting
/// requests, see [`Policy::is_plain`]) at `now` (nanoseconds): the all-rate, same-cost case of
/// [`decide_kinds`], which is the one engine every policy decides with.
#[cfg(test)]
pub(crate) fn decide(
    policy: &Policy,
    states: &mut [TierState],
    now: u64,
    cost: u64,
    mode: Mode,
) -> (Decision, Option<Charges>) {
    let costs: SmallVec<[u64; 4]> = smallvec::smallvec![cost; policy.tiers().len()];
    decide_kinds(policy, states, now, &costs, mode, Priority::Standard)
}

/// Decides one request over every tier of a policy of any kinds (rates, concurrency, calendar)
/// at `now` (nanoseconds), with `costs` per tier: all tiers are charged when admitted (a rate
/// or calendar tier its cost, a concurrency tier its slots), none otherwise. A tier of cost 0
/// neither constrains nor is charged. Concurrency tiers only admit at once (a full one refuses
/// whatever the shaping budget); their `retry_after` and `reset_after` are left for
/// [`slots::fill`], which knows the typical holds.
///
/// Every policy decides here: a plain one (rates counting requests) is the case of every tier a
/// rate with the same cost, and decides as the GCRA, bucket and window literature says (the
/// memory store's compact path for a single whole-nanosecond GCRA tier, [`WholeGcra`], is the
/// one specialisation, and decides the same). Tiers with a penalty box (see
/// [`Penalty`](crate::Penalty)) keep it in `states` after the tiers' own states
/// ([`Policy::penalty_slot`]): a blocked key is refused, and a breach of such a tier counts.
///
/// A rate tier with a [`Reserve`](crate::Reserve) decides and reports as the request's
/// `class` sees it: on the same state, with the burst less what the reserve withholds from
/// the class (see [`Tier::rate_for`]); it is charged as any tier.
pub(crate) fn decide_kinds(
    policy: &Policy,
    states: &mut [TierState],
    now: u64,
    costs: &[u64],
    mode: Mode,
    class: Priority,
) -> (Decision, Option<Charges>) {
    decide_with(policy, states, now, |i| costs.get(i).copied().unwrap_or(0), mode, class)
}

/// [`decide_kinds`] with the cost of tier `i` given by `cost(i)` (a store computes it from the
/// check without collecting the costs first).
#[inline]
pub(crate) fn decide_with(
    policy: &Policy,
    states: &mut [TierState],
    now: u64,
    cost: impl Fn(usize) -> u64 + Copy,
    mode: Mode,
    class: Priority,
) -> (Decision, Option<Charges>) {
    let unit = policy.unit();
    if unit == 1 {
        return decide_kinds_in_units(policy, states, now, cost, mode, class);
    }
    let at = now / unit;
    let mode = match mode {
        Mode::Police => Mode::Police,
        Mode::Shape(budget) => Mode::Shape(budget / unit),
    };
    let (mut decision, charges) = decide_kinds_in_units(policy, states, at, cost, mode, class);
    decision.rescale(at, unit, now);
    (decision, charges)
}

/// One tier's earliest instant >= `from` (units) at which `cost` may leave (see
/// [`TierState::departure`]; a concurrency tier does not wait).
fn departure_kind(
    policy: &Policy,
    tier: &Tier,
    class: Priority,
    state: &TierState,
    from: u64,
    cost: u64,
    shaping: bool,
) -> u64 {
    match (&tier.kind, state) {
        (Kind::Calendar(_), TierState::Calendar(c)) => {
            calendar::earliest(c, tier.capacity(), policy.unit(), from, cost)
        }
        (Kind::Rate, s) => {
            s.departure(policy.algorithm(), tier.rate_for(class), from, cost, shaping)
        }
        // Pruning gave every tier a state of its kind; a fresh calendar tier has room.
        _ => from,
    }
}

/// Forgets what no longer matters at `now` (in the policy's unit) in a key's `states`: windows
/// and log entries that ended, penalty blocks and breaches that expired; gives each tier a
/// state of its kind. The Redis scripts prune the same whenever they read a key.
#[inline]
pub(crate) fn prune_kinds(policy: &Policy, states: &mut [TierState], now: u64) {
    let alg = policy.algorithm();
    let unit = policy.unit();
    let tiers = policy.tiers();
    for (s, t) in states.iter_mut().zip(tiers) {
        match (&t.kind, &mut *s) {
            (Kind::Rate, s) => s.prune(alg, t.rate, now),
            (Kind::Calendar(_), TierState::Calendar(c)) => calendar::prune(c, unit, now),
            (Kind::Calendar(_), s) => *s = TierState::Calendar(Vec::new()),
            (Kind::Concurrency(_), TierState::Slots(_)) => {}
            (Kind::Concurrency(_), s) => *s = TierState::Slots(0),
        }
    }
    if policy.has_penalty() {
        for (i, t) in tiers.iter().enumerate() {
            if let (Some(b), Some(s)) = (t.penalty, strikes_mut(policy, states, i)) {
                s.prune(&b, now);
            }
        }
    }
    for i in 0..tiers.len() {
        if let Some((mut line, _)) = line_of(policy, states, i) {
            let r = tiers[i].rate;
            line.prune(r, now);
            // A tier whose TAT is not after now schedules nothing ahead (as `lua/line.lua`).
            if tat_of(&states[i]) <= u128::from(now) * u128::from(r.count) {
                line = Line::default();
            }
            set_line(policy, states, i, line);
        }
    }
}

/// [`decide_kinds`] with `now` and the mode's budget in the policy's unit.
fn decide_kinds_in_units(
    policy: &Policy,
    states: &mut [TierState],
    now: u64,
    cost: impl Fn(usize) -> u64 + Copy,
    mode: Mode,
    class: Priority,
) -> (Decision, Option<Charges>) {
    let alg = policy.algorithm();
    let unit = policy.unit();
    let tiers = policy.tiers();
    prune_kinds(policy, states, now);
    let boxes = policy.has_penalty();
    if (0..tiers.len()).all(|i| cost(i) == 0) {
        let decision =
            report_kinds(policy, class, states, now, Outcome::Allowed, 0, None, |_| (false, None));
        return (decision, None);
    }
    if tiers.iter().enumerate().any(|(i, t)| cost(i) > t.capacity_for(class)) {
        let over = |i: usize| (cost(i) > tiers[i].capacity_for(class), None);
        let decision =
            report_kinds(policy, class, states, now, Outcome::CostExceedsCapacity, 0, None, over);
        return (decision, None);
    }

    // The instant the request leaves: the earliest at which every rate and calendar tier
    // admits it together. Every tier is charged there, so a window a shaped request is
    // reserved in is one that had room for it.
    let shaping = matches!(mode, Mode::Shape(_));
    let departure = converge(now, rounds(states), |t| {
        (0..tiers.len())
            .filter(|&i| cost(i) > 0)
            .map(|i| match on_line(policy, states, i, class, now, cost(i)) {
                // On the line, a critical request leaves at once or not at all.
                Some((back, _)) if t == now && back == now => now,
                _ => departure_kind(policy, &tiers[i], class, &states[i], t, cost(i), shaping),
            })
            .fold(t, u64::max)
    });
    let full = |i: usize| match (&tiers[i].kind, &states[i]) {
        (Kind::Concurrency(slots), TierState::Slots(held)) => {
            cost(i) > 0 && held.saturating_add(cost(i)) > slots.max
        }
        _ => false,
    };
    let budget = budget(mode);
    // A plain policy (rates counting requests) has no slots, calendars, boxes nor reserves.
    let plain = policy.is_plain();
    let any_full = !plain && (0..tiers.len()).any(full);
    // Past the budget, the earliest retry is when the departure is within it.
    let (at, mut retry) = match departure {
        Some(t) => (t, (t - now > budget).then(|| t - now - budget)),
        // Unsettled (ruled out by `rounds`): refused, never charged where a tier is full.
        None => (now, Some(1)),
    };
    // A critical request refused may be admitted sooner on a line, decided then.
    if let (Some(r), Priority::Critical) = (retry, class) {
        let lined = |i: usize| on_line(policy, states, i, class, now, cost(i));
        if (0..tiers.len()).any(|i| cost(i) > 0 && lined(i).is_some()) {
            let decided = converge(now, rounds(states), |t| {
                (0..tiers.len())
                    .filter(|&i| cost(i) > 0)
                    .map(|i| match lined(i) {
                        Some((back, until)) if t.max(back) < until => t.max(back),
                        _ => {
                            departure_kind(policy, &tiers[i], class, &states[i], t, cost(i), false)
                        }
                    })
                    .fold(t, u64::max)
            });
            if let Some(t) = decided.filter(|t| *t > now) {
                retry = Some(r.min(t - now));
            }
        }
    }
    // A departure after a calendar tier's lookahead is refused too (Redis holds the bounds of
    // no later window): not before the lookahead moves on, when the current window ends.
    for (i, tier) in tiers.iter().enumerate().filter(|_| !plain) {
        if let (Kind::Calendar(spec), true) = (&tier.kind, cost(i) > 0) {
            if let Some(current) = calendar::beyond(spec, unit, now, at) {
                retry = Some(retry.unwrap_or(0).max(current - now));
            }
        }
    }
    // A blocked key is refused whatever its tiers say, until the latest of its blocks ends.
    let until = if boxes {
        (0..tiers.len()).filter_map(|i| blocked(policy, states, i, now)).max()
    } else {
        None
    };
    if retry.is_some() || any_full || until.is_some() {
        let per_tier = |i: usize| {
            if full(i) {
                return (true, None);
            }
            if cost(i) == 0 || matches!(tiers[i].kind, Kind::Concurrency(_)) {
                return (false, None);
            }
            let own = match (&tiers[i].kind, &states[i]) {
                (Kind::Calendar(_), TierState::Calendar(c)) => {
                    calendar::earliest(c, tiers[i].capacity(), unit, now, cost(i))
                }
                (_, s) => {
                    let e = s.earliest(alg, tiers[i].rate_for(class), now, cost(i));
                    on_line(policy, states, i, class, now, cost(i)).map_or(e, |(b, _)| b.min(e))
                }
            } - now;
            (own > 0, (own > 0).then_some(own))
        };
        if !boxes {
            let decision =
                report_kinds(policy, class, states, now, Outcome::Limited, 0, retry, per_tier);
            return (decision, None);
        }
        let mut per: SmallVec<[(bool, Option<u64>); 4]> = (0..tiers.len()).map(per_tier).collect();
        let later = |r: Option<u64>, left: u64| Some(r.map_or(left, |r| r.max(left)));
        if let Some(until) = until {
            // Blocked: refused, charging nothing and counting as no breach, not before the
            // block ends, nor before the tiers admit the request.
            for (i, p) in per.iter_mut().enumerate() {
                if let Some(u) = blocked(policy, states, i, now) {
                    *p = (true, later(p.1, u - now));
                }
            }
            retry = later(retry, until - now);
        } else {
            // A breach of a tier with a penalty box counts, and may start a block: the request
            // is then refused until it ends, or until its tiers admit it if that is later.
            for (i, t) in tiers.iter().enumerate() {
                let (Some(b), true) = (t.penalty, per[i].0) else { continue };
                let Some(s) = strikes_mut(policy, states, i) else { continue };
                if let Some(until) = s.breach(&b, now) {
                    per[i].1 = later(per[i].1, until - now);
                    retry = later(retry, until - now);
                }
            }
        }
        let decision =
            report_kinds(policy, class, states, now, Outcome::Limited, 0, retry, |i| per[i]);
        return (decision, None);
    }
    let wait = at - now;
    // The lines of tiers with a critical reserve follow the charges (see `line`).
    let lines: SmallVec<[(usize, u128, bool); 2]> = (0..tiers.len())
        .filter(|&i| cost(i) > 0 && policy.line_reserve(i).is_some())
        .map(|i| {
            let full = states[i].earliest(alg, tiers[i].rate, at, cost(i)) <= at;
            (i, tat_of(&states[i]), full)
        })
        .collect();
    let mut charges = Charges::new();
    for (i, (s, tier)) in states.iter_mut().zip(tiers).enumerate() {
        let c = cost(i);
        charges.push(match (&tier.kind, &mut *s) {
            _ if c == 0 => Charge { at, cost: 0, id: 0 },
            (Kind::Rate, s) => s.charge(alg, tier.rate, now, at, c),
            (Kind::Calendar(spec), TierState::Calendar(counted)) => {
                calendar::charge(counted, spec, unit, at, c);
                Charge { at, cost: c, id: 0 }
            }
            (Kind::Concurrency(_), TierState::Slots(held)) => {
                *held += c;
                // Held from the decision on (through any shaping delay).
                Charge { at: now, cost: c, id: 0 }
            }
            // Pruning gave every tier a state of its kind.
            _ => Charge { at, cost: 0, id: 0 },
        });
    }
    for (i, before, full) in lines {
        let Some((mut line, reserve)) = line_of(policy, states, i) else { continue };
        let (r, tau) = (tiers[i].rate, tau_std(&tiers[i], reserve));
        match class {
            Priority::Critical => {
                let after = tat_of(&states[i]);
                line.critical(r, reserve, tau, now, at, cost(i), !full, after);
            }
            Priority::Standard | Priority::Sheddable => line.lower(r, tau, now, at, before),
        }
        set_line(policy, states, i, line);
    }
    let decision =
        report_kinds(policy, class, states, now, Outcome::Allowed, wait, None, |_| (false, None));
    (decision, Some(charges))
}

/// For a critical request of `cost` on tier `i` with a line, decided at `now` or later: the
/// earliest instant at which the line admits it ahead of the schedule ([`Line::back`]), and
/// when the schedule ends (see [`line`]).
fn on_line(
    policy: &Policy,
    states: &[TierState],
    i: usize,
    class: Priority,
    now: u64,
    cost: u64,
) -> Option<(u64, u64)> {
    if class != Priority::Critical {
        return None;
    }
    let (line, reserve) = line_of(policy, states, i)?;
    line.back(policy.tiers()[i].rate, reserve, now, cost).map(|b| (b, line.until))
}

/// Gives back (or, with `extra`, charges more of) `cost` on tier `i`, of any kind, for the
/// charge `charge`; `now` in units. Concurrency tiers are only released ([`release`]).
pub(crate) fn settle_tier(
    policy: &Policy,
    i: usize,
    states: &mut [TierState],
    charge: Charge,
    now: u64,
    cost: u64,
    extra: bool,
) {
    let tier = &policy.tiers()[i];
    let alg = policy.algorithm();
    let Some(state) = states.get_mut(i) else { return };
    match (&tier.kind, &mut *state) {
        (Kind::Rate, s) if extra => {
            s.charge(alg, tier.rate, now, charge.at.max(now), cost);
            // Charged now, ahead of any schedule: a line counts it (see `line`).
            let after = tat_of(s);
            if let Some((mut line, reserve)) = line_of(policy, states, i) {
                line.taken(tier.rate, tau_std(tier, reserve), now, cost, after);
                set_line(policy, states, i, line);
            }
        }
        (Kind::Rate, s) => s.refund(alg, tier.rate, charge, cost),
        (Kind::Calendar(spec), TierState::Calendar(c)) if extra => {
            calendar::charge(c, spec, policy.unit(), charge.at.max(now), cost);
        }
        (Kind::Calendar(_), TierState::Calendar(c)) => {
            calendar::refund(c, policy.unit(), charge.at, cost);
        }
        _ => {}
    }
}

/// Releases the slots `charge` took on concurrency tier `i`.
pub(crate) fn release(state: &mut TierState, charge: Charge) {
    if let TierState::Slots(held) = state {
        *held = held.saturating_sub(charge.cost);
    }
}

/// Builds the decision of a policy of any kinds from the states after any charge (durations
/// in units; a concurrency tier's reset is left at 0 for [`slots::fill`]), as a request of
/// `class` sees each tier (its limit and remaining less what a reserve withholds from it).
#[allow(clippy::too_many_arguments)]
fn report_kinds(
    policy: &Policy,
    class: Priority,
    states: &[TierState],
    now: u64,
    outcome: Outcome,
    delay: u64,
    retry_after: Option<u64>,
    per_tier: impl Fn(usize) -> (bool, Option<u64>),
) -> Decision {
    let alg = policy.algorithm();
    let unit = policy.unit();
    let boxes = policy.has_penalty();
    let mut tiers = Tiers::new();
    for (i, (tier, s)) in policy.tiers().iter().zip(states).enumerate() {
        let (remaining, reset) = match (&tier.kind, s) {
            (Kind::Rate, s) => s.status(alg, tier.rate_for(class), now),
            (Kind::Calendar(_), TierState::Calendar(c)) => {
                calendar::status(c, tier.capacity(), unit, now)
            }
            (Kind::Concurrency(_), TierState::Slots(held)) => {
                (tier.capacity().saturating_sub(*held), 0)
            }
            _ => (tier.capacity(), 0),
        };
        // A critical request may also take what the line holds of its reserve.
        let remaining = match (class, line_of(policy, states, i)) {
            (Priority::Critical, Some((line, reserve))) => {
                remaining.max(line.room(tier.rate, reserve, now))
            }
            _ => remaining,
        };
        // A blocked tier has nothing left until the block ends.
        let block = if boxes { blocked(policy, states, i, now) } else { None };
        let (remaining, reset) = match block {
            Some(until) => (0, reset.max(until - now)),
            None => (remaining, reset),
        };
        let (violated, retry_after) = per_tier(i);
        tiers.push(TierDecision::new(
            tier.capacity_for(class),
            remaining,
            reset,
            retry_after,
            violated,
        ));
    }
    Decision::new(outcome, delay, retry_after, tiers)
}

/// The shaping budget of a mode, in nanoseconds (0 polices).
#[inline]
pub(crate) fn budget(mode: Mode) -> u64 {
    match mode {
        Mode::Police => 0,
        Mode::Shape(max) => max,
    }
}

/// Decides one request on the state of a single-tier GCRA policy whose emission interval is a
/// whole number of nanoseconds (see [`WholeGcra`]): the same decision [`decide`] makes, and what to
/// store.
#[inline]
#[cfg(test)]
pub(crate) fn decide_whole(
    w: &WholeGcra,
    tat: u64,
    now: u64,
    cost: u64,
    mode: Mode,
) -> (Decision, GcraStep) {
    let step = w.decide(tat, now, cost, budget(mode));
    (whole_decision(w, tat, now, step, budget(mode)), step)
}

/// The decision for `step`, reached on `tat` (the state before any charge).
#[inline]
pub(crate) fn whole_decision(
    w: &WholeGcra,
    tat: u64,
    now: u64,
    step: GcraStep,
    budget: u64,
) -> Decision {
    let tier = |tat: u64, violated: bool, retry: Option<u64>| {
        let (remaining, reset) = w.status(tat, now);
        let mut tiers = Tiers::new();
        tiers.push(TierDecision::new(w.burst(), remaining, reset, retry, violated));
        tiers
    };
    match step {
        GcraStep::Admit { wait, tat: new, .. } => {
            Decision::new(Outcome::Allowed, wait, None, tier(new, false, None))
        }
        GcraStep::Query => Decision::new(Outcome::Allowed, 0, None, tier(tat, false, None)),
        GcraStep::Limit { retry } => {
            let own = retry + budget;
            Decision::new(Outcome::Limited, 0, Some(retry), tier(tat, true, Some(own)))
        }
        GcraStep::TooBig => {
            Decision::new(Outcome::CostExceedsCapacity, 0, None, tier(tat, true, None))
        }
    }
}

#[cfg(test)]
mod model;
#[cfg(test)]
mod tests;
