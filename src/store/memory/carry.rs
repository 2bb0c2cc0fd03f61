//! Reloads: a binding replaced by another carries its keys' state over, and requests still
//! decided through the replaced binding decide on the state it handed over.
//!
//! What a reload keeps, state slot by state slot (a key's tiers, then its penalty boxes), for
//! each tier of the new policy matched by name in the old one:
//! - a rate or calendar tier whose definition did not change (its penalty box aside), under
//!   the same time unit and, for a rate tier, algorithm: its state as it is; another one
//!   starts as the [`Carry`] says;
//! - a concurrency tier (whatever its `max` or time to live): the slots held, which their holders
//!   give back to the new binding;
//! - a penalty box (a rate or calendar tier that has one in both): the block and the breaches
//!   counted, as instants (so a block ends when it was going to, whatever the new length).
//!
//! When the replaced binding is its policy's only one, these slots are **handed over** rather
//! than copied: from the moment a shard's keys are carried, the replaced binding decides and
//! charges them on the new binding's state (through [`places`]), so nothing it charges,
//! releases or blocks afterwards is lost.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use smallvec::SmallVec;

use super::compact::Compact;
use super::table::{Core, Generals, KeyState, Next, general_mut, lock};
use super::{Inner, MemoryPolicy, MemoryStore, MemoryTicket, decide_core};
use crate::algorithm::{GcraStep, Mode, Strikes, TierState, decide_kinds, fresh_boxes};
use crate::policy::{Policy, Tier};
use crate::quota::{Priority, TierKind};
use crate::store::{Carry, Check, Verdict};

impl MemoryStore {
    /// Binds `policy` in place of `old` (see [`Store::rebind`](crate::store::Store::rebind)),
    /// carrying each key's state over, tier by tier, matched by name. A rate or calendar tier
    /// whose state cannot be kept starts as `carry` says.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::key::Key;
    /// use tollgate::store::{Carry, Check, MemoryStore};
    /// use tollgate::{Penalty, Policy, Quota};
    ///
    /// let guard = |block: u64| {
    ///     Policy::builder("login")
    ///         .tier("minute", Quota::per_minute(2))
    ///         .penalty("minute", Penalty::new(Duration::from_secs(block * 60)))
    ///         .build()
    ///         .unwrap()
    /// };
    /// let store = MemoryStore::new();
    /// let old = store.bind_policy(&guard(15));
    /// let key = Key::text("mallory");
    /// let verdicts: Vec<bool> =
    ///     (0..3).map(|_| store.check_now(&old, Check::new(&key, 1)).decision.is_allowed()).collect();
    /// assert_eq!(verdicts, [true, true, false]); // the breach blocks for 15 minutes
    /// let new = store.rebind_policy(&old, &guard(30), Carry::StartFull);
    /// let d = store.check_now(&new, Check::new(&key, 1)).decision;
    /// assert!(d.retry_after().unwrap() > Duration::from_secs(14 * 60)); // still blocked
    /// ```
    ///
    /// # How it works
    ///
    /// What each tier of `policy` keeps:
    /// - a rate or calendar tier whose definition did not change (its penalty box aside), under
    ///   the same time unit and, for a rate tier, algorithm, keeps its state as it is (between
    ///   the compact one-tier GCRA form and general tables too); another one starts as `carry`
    ///   says;
    /// - a concurrency tier keeps the slots held (whatever its new `max`: a key holding more
    ///   is refused until enough are released), when `old` is its policy's only binding;
    /// - a tier with a penalty box in both keeps its block and its breaches: a key blocked
    ///   stays blocked until its block ends, whatever the new box says; the new length and
    ///   count apply from the next breach. A tier that loses its box frees its blocked keys.
    ///
    /// Keys are carried while the store has room for them beside `old`'s (`max_keys`), and
    /// those holding slots or a penalty box whatever the room. When
    /// `policy` is bound to this store already, the new binding shares that state: only the
    /// penalty blocks and breaches, and the slots held, are added to it.
    ///
    /// **No charge is lost to the reload.** When `old` is its policy's only binding, what it
    /// keeps is handed over rather than copied: from the moment a shard's keys are carried,
    /// requests still decided through `old` (begun before the reload) decide and charge the
    /// kept tiers, slots and boxes on the new binding's state, under the same lock as the new
    /// binding's own requests, so a tier that did not change admits exactly its quota across
    /// any number of reloads, a slot taken through `old` is released to the new binding, and
    /// a block started through `old` holds there. `old` keeps deciding its other tiers on its
    /// own state. (When other bindings share `old`'s policy, it stays theirs: `old`'s later
    /// charges stay in it and are not seen by the new binding, which then counts no slot
    /// held through them.) Rebinding a binding that was replaced already rebinds its
    /// replacement, which holds the newest state.
    #[must_use]
    pub fn rebind_policy(&self, old: &MemoryPolicy, policy: &Policy, carry: Carry) -> MemoryPolicy {
        let inner = &self.inner;
        let _one = lock(&inner.rebinding);
        let (mut from, mut from_core) = (old.id, Arc::clone(&old.core));
        while from_core.moved.load(Ordering::Acquire) >= inner.shards.len() {
            let Some(next) = from_core.next.get() else { break };
            let next = (next.id, Arc::clone(&next.core));
            (from, from_core) = next;
        }
        let (id, core, existed) = inner.slot_for(policy);
        let new = MemoryPolicy { id, core, inner: Arc::clone(inner) };
        if new.id == from {
            return new;
        }
        let slots = slot_map(&from_core.policy, &new.core.policy);
        let hand_over =
            slots.iter().any(Option::is_some) && inner.supersede(from, &from_core.policy, new.id);
        if hand_over {
            let next = Next { id: new.id, core: Arc::clone(&new.core), slots: slots.clone() };
            // `supersede` admits a slot once: nothing was set.
            let _ = from_core.next.set(next);
        }
        let carrying = Carrying {
            from,
            from_core: &from_core,
            new: &new,
            carry,
            slots: &slots,
            existed,
            hand_over,
            now: inner.clock.now(),
        };
        for (i, shard) in inner.shards.iter().enumerate() {
            let mut generals = lock(&shard.general);
            let mut compact = shard.compact.lock();
            carrying.shard(&mut generals, &mut compact);
            if hand_over {
                // Its keys now live in the new binding; a request through `old` finds none and
                // decides on the new binding's state (`check_moved`).
                if from_core.whole.is_some() {
                    let dropped = compact.drop_table(from);
                    inner.len.fetch_sub(dropped, Ordering::Relaxed);
                }
                from_core.moved.store(i + 1, Ordering::Release);
            }
        }
        if hand_over {
            // Requests waiting through `old` for a slot now wait for the new binding's
            // releases (see `Store::released`): they look again.
            for w in &from_core.wakers {
                w.epoch.fetch_add(1, Ordering::AcqRel);
                w.notify.notify_waiters();
            }
        }
        new
    }
}

/// For each state slot of `before` (each tier's state, then each penalty box), the slot of
/// `after` that keeps it across a reload (see [`MemoryStore::rebind_policy`]): a rate or
/// calendar tier's when [`unchanged`]; a concurrency tier's by a concurrency tier; a penalty
/// box's by the box of the tier of its name, under the same time unit.
fn slot_map(before: &Policy, after: &Policy) -> Box<[Option<usize>]> {
    let named = |o: &Tier| after.tiers().iter().position(|t| t.name() == o.name());
    let tiers = before.tiers().iter().map(|o| {
        let i = named(o)?;
        let t = &after.tiers()[i];
        match o.kind() {
            TierKind::Concurrency => (t.kind() == TierKind::Concurrency).then_some(i),
            _ => unchanged(before, o, after, t).then_some(i),
        }
    });
    let boxes = before.tiers().iter().filter(|o| o.penalty.is_some()).map(|o| {
        let i = named(o)?;
        let boxed = after.tiers()[i].penalty.is_some() && before.unit() == after.unit();
        boxed.then(|| after.penalty_slot(i))
    });
    tiers.chain(boxes).collect()
}

/// Whether rate or calendar tier `t` of `after` keeps the state of tier `o` of `before`: the
/// same definition ([`same_rate`]) under the same time unit, and for a rate tier the same
/// algorithm (a calendar tier's windows mean the same under any).
fn unchanged(before: &Policy, o: &Tier, after: &Policy, t: &Tier) -> bool {
    let same_algorithm = before.algorithm() == after.algorithm() || o.kind() == TierKind::Calendar;
    same_algorithm && before.unit() == after.unit() && same_rate(o, t)
}

/// Whether rate or calendar tier `t` keeps the state of tier `o`: the same definition, the
/// penalty box aside (a box is state of its own, carried by [`slot_map`]).
fn same_rate(o: &Tier, t: &Tier) -> bool {
    if o.kind() == TierKind::Concurrency || t.kind() == TierKind::Concurrency {
        return false;
    }
    if o.penalty == t.penalty {
        return o == t;
    }
    let mut t = t.clone();
    t.penalty = o.penalty;
    t == *o
}

/// One reload's carry, shard by shard ([`Carrying::shard`]).
struct Carrying<'a> {
    from: usize,
    from_core: &'a Core,
    new: &'a MemoryPolicy,
    carry: Carry,
    /// The two policies' [`slot_map`].
    slots: &'a [Option<usize>],
    /// Whether `new`'s policy was bound already: its keys' state stays, and only the penalty
    /// boxes (and, handed over, the slots held) of `from`'s keys are added to it.
    existed: bool,
    /// Whether `from` hands its kept slots over to `new` (see [`places`]).
    hand_over: bool,
    /// The reload's instant, nanoseconds.
    now: u64,
}

impl Carrying<'_> {
    /// Starts each key of one shard's `from` slot in `new`: rate and calendar tiers unchanged
    /// as they are, the others matched by name charged their used fraction at the reload
    /// instant when `carry` says so ([`Carry::UsedFraction`]); then each penalty box's block
    /// and breaches, and, handed over, the slots held, added to what `new` holds. The rate and
    /// calendar tiers of keys `new` holds already are left alone.
    fn shard(&self, generals: &mut Generals, compact: &mut Compact) {
        let (before, after) = (&self.from_core.policy, &self.new.core.policy);
        let changed_too = self.carry == Carry::UsedFraction;
        let rated = |t: &Tier| t.kind() != TierKind::Concurrency;
        // For each new tier: the old tier of its name, and whether its rate is unchanged.
        let matched: Vec<Option<(usize, bool)>> = after
            .tiers()
            .iter()
            .map(|t| {
                let j = before.tiers().iter().position(|o| o.name() == t.name())?;
                let o = &before.tiers()[j];
                let same = unchanged(before, o, after, t);
                let carried = rated(t) && rated(o) && (changed_too || same);
                (carried && !self.existed).then_some((j, same))
            })
            .collect();
        // Penalty boxes (new slot, old slot), of each tier with one in both.
        let boxes: SmallVec<[(usize, usize); 2]> = after
            .tiers()
            .iter()
            .enumerate()
            .filter(|(_, t)| t.penalty.is_some())
            .filter_map(|(i, t)| {
                let j = before.tiers().iter().position(|o| {
                    o.name() == t.name() && o.penalty.is_some() && rated(o) && rated(t)
                })?;
                Some((after.penalty_slot(i), before.penalty_slot(j)))
            })
            .collect();
        // Concurrency tiers handed over (new tier, old tier): their holders release there.
        let held: SmallVec<[(usize, usize); 2]> = before
            .tiers()
            .iter()
            .enumerate()
            .filter(|(_, o)| self.hand_over && o.kind() == TierKind::Concurrency)
            .filter_map(|(j, _)| Some((self.slots[j]?, j)))
            .collect();
        if matched.iter().all(Option::is_none) && boxes.is_empty() && held.is_empty() {
            return;
        }
        let (from, new, now) = (self.from, self.new, self.now);
        let inner = &new.inner;
        // Each old key: its state, or its TAT in the compact form.
        let keys: Vec<(u64, Was)> = if self.from_core.whole.is_some() {
            compact.entries(from).into_iter().map(|(fp, t)| (fp, Was::Tat(t))).collect()
        } else {
            let Some(Some(table)) = generals.get(from) else { return };
            table.map.iter().map(|(fp, s)| (*fp, Was::States(s.clone()))).collect()
        };
        let count = |j: usize| before.tiers()[j].rate.count;
        for (fp, state) in keys {
            if let Some(w) = &new.core.whole {
                // One GCRA tier, no box, no slot: its state alone.
                let Some(Some((j, unchanged))) = matched.first().copied() else { continue };
                if compact.tat_mut(new.id, fp).is_some() {
                    continue;
                }
                let exact = match (&state, unchanged) {
                    (Was::Tat(tat), true) => Some(*tat),
                    (Was::States(states), true) => whole_tat(&states[j], count(j)),
                    _ => None,
                };
                let tat = exact.or_else(|| {
                    let used = self.scaled_use(&self.remaining(&state)?, 0, j);
                    match w.decide(0, now, used, 0) {
                        GcraStep::Admit { tat, .. } => Some(tat),
                        _ => None,
                    }
                });
                // A TAT not after now decides like a fresh key.
                let Some(tat) = tat.filter(|t| *t > now) else { continue };
                if inner.len.load(Ordering::Relaxed) >= inner.max_keys {
                    return;
                }
                compact.insert(new.id, fp, tat);
                inner.len.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let holds = generals
                .get(new.id)
                .and_then(Option::as_ref)
                .is_some_and(|g| g.map.contains_key(&fp));
            let mut fresh = match holds {
                true => None,
                false => Some(self.rates(&state, &matched)),
            };
            let Was::States(old) = &state else {
                // A compact key: one GCRA tier, no box, no slot.
                if let Some(states) = fresh.filter(|s| !new.core.is_idle(s, now)) {
                    if inner.len.load(Ordering::Relaxed) >= inner.max_keys {
                        return;
                    }
                    general_mut(generals, new.id, &new.core).map.insert(fp, states);
                    inner.len.fetch_add(1, Ordering::Relaxed);
                }
                continue;
            };
            let units = (before.unit(), after.unit());
            let add = |states: &mut KeyState| {
                for &(to, from) in &boxes {
                    if let (Some(TierState::Penalty(to)), Some(TierState::Penalty(from))) =
                        (states.get_mut(to), old.get(from))
                    {
                        merge_strikes(to, from, units);
                    }
                }
                for &(to, from) in &held {
                    if let (Some(TierState::Slots(to)), Some(TierState::Slots(from))) =
                        (states.get_mut(to), old.get(from))
                    {
                        *to = to.saturating_add(*from);
                    }
                }
            };
            match &mut fresh {
                Some(states) => add(states),
                None => {
                    if let Some(states) = general_mut(generals, new.id, &new.core).map.get_mut(&fp)
                    {
                        add(states);
                    }
                }
            }
            if self.hand_over {
                // What was handed over is decided on `new` from now on: the copy left here
                // (slots held never idle) would keep the key from ever being swept.
                if let Some(mine) = generals.get_mut(from).and_then(Option::as_mut) {
                    if let Some(states) = mine.map.get_mut(&fp) {
                        for (j, _) in self.slots.iter().enumerate().filter(|(_, m)| m.is_some()) {
                            match states.get_mut(j) {
                                Some(TierState::Slots(h)) => *h = 0,
                                Some(TierState::Penalty(s)) => **s = Strikes::default(),
                                _ => {}
                            }
                        }
                    }
                }
            }
            let Some(states) = fresh else { continue };
            if new.core.is_idle(&states, now) {
                continue;
            }
            // Slots held and blocks are carried whatever the room: their holders give the
            // slots back to `new`, and a reload frees no blocked key.
            let unit_now = now / after.unit();
            let keep = states.iter().any(|s| match s {
                TierState::Slots(held) => *held > 0,
                TierState::Penalty(b) => b.until > unit_now || !b.at.is_empty(),
                _ => false,
            });
            if inner.len.load(Ordering::Relaxed) >= inner.max_keys && !keep {
                continue;
            }
            general_mut(generals, new.id, &new.core).map.insert(fp, states);
            inner.len.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// What remains of each old tier of a key at the reload, in whole units (what the tiers
    /// hold, not what a block says).
    fn remaining(&self, state: &Was) -> Option<Vec<u64>> {
        let before = &self.from_core.policy;
        Some(match (state, &self.from_core.whole) {
            (Was::Tat(tat), Some(w)) => vec![w.status(*tat, self.now).0],
            (Was::States(states), _) => {
                let tiers = before.tiers().len();
                let mut states: Box<[TierState]> =
                    states.iter().take(tiers).cloned().chain(fresh_boxes(before)).collect();
                let zeros = vec![0; tiers];
                let (d, _) = decide_kinds(
                    before,
                    &mut states,
                    self.now,
                    &zeros,
                    Mode::Police,
                    Priority::Critical,
                );
                d.tiers().iter().map(crate::TierDecision::remaining).collect()
            }
            (Was::Tat(_), None) => return None,
        })
    }

    /// The units of new tier `i` a key is charged at the reload for what it had used of old
    /// tier `j` ([`Carry::UsedFraction`]), `left` being what remained of each old tier:
    /// `ceil(used * capacity' / capacity)`, at most the new capacity.
    fn scaled_use(&self, left: &[u64], i: usize, j: usize) -> u64 {
        let (before, after) = (&self.from_core.policy, &self.new.core.policy);
        let (from, to) = (before.tiers()[j].capacity(), after.tiers()[i].capacity());
        let used = from.saturating_sub(left.get(j).copied().unwrap_or(from));
        let scaled = (u128::from(used) * u128::from(to)).div_ceil(u128::from(from));
        u64::try_from(scaled).unwrap_or(u64::MAX).min(to)
    }

    /// A key's state in `new` (general tables) from its old `state`: each new tier `matched`
    /// to an old one, unchanged as it was, changed charged its used fraction; the rest fresh.
    fn rates(&self, state: &Was, matched: &[Option<(usize, bool)>]) -> KeyState {
        let (before, after) = (&self.from_core.policy, &self.new.core.policy);
        let count = |j: usize| before.tiers()[j].rate.count;
        let mut states = self.new.core.fresh();
        let mut costs = vec![0; after.tiers().len()];
        if let (Was::States(old), false) = (state, self.existed) {
            states.guard = old.guard;
        }
        let mut left: Option<Option<Vec<u64>>> = None;
        for (i, m) in matched.iter().enumerate() {
            let Some((j, unchanged)) = *m else { continue };
            match (state, unchanged) {
                (Was::States(old), true) => states[i] = old[j].clone(),
                (Was::Tat(tat), true) => states[i] = scaled_tat(*tat, count(j)),
                _ => {
                    let left = left.get_or_insert_with(|| self.remaining(state));
                    if let Some(left) = left {
                        costs[i] = self.scaled_use(left, i, j);
                    }
                }
            }
        }
        // Each changed tier charged on its own: every one fits a fresh tier (the boxes, which
        // would refuse a blocked key, are fresh until they are carried after).
        for (i, units) in costs.iter().enumerate().filter(|(_, u)| **u > 0) {
            let mut one = vec![0; costs.len()];
            one[i] = *units;
            let now = self.now;
            let _ = decide_kinds(after, &mut states, now, &one, Mode::Police, Priority::Critical);
        }
        states
    }
}

/// The newest of the bindings that replaced `core` in reloads (`core` itself if none did): a
/// request waiting through `core` for a slot waits for its releases, which hold the slots
/// handed over (a release wakes its binding and every later one, see `Inner::settle`).
pub(super) fn newest(core: &Arc<Core>) -> &Arc<Core> {
    let mut core = core;
    while let Some(next) = core.next.get() {
        core = &next.core;
    }
    core
}

/// Adds the block and breaches of `from` (instants in units of `units.0` nanoseconds) to `to`
/// (units of `units.1`): the later block, every breach. A block's end is rounded up, a
/// breach's instant down, so that a change of unit never shortens a block.
fn merge_strikes(to: &mut Strikes, from: &Strikes, (was, is): (u64, u64)) {
    let convert = |t: u64, up: bool| {
        let ns = u128::from(t) * u128::from(was);
        let v = if up { ns.div_ceil(u128::from(is)) } else { ns / u128::from(is) };
        u64::try_from(v).unwrap_or(u64::MAX)
    };
    to.until = to.until.max(convert(from.until, true));
    to.at.extend(from.at.iter().map(|t| convert(*t, false)));
    to.at.sort_unstable();
}
impl Inner {
    /// Decides for a binding replaced in a reload, in a shard whose keys were handed over: each
    /// tier on the state of the binding that now keeps it, its own tiers on its own, under the
    /// shard's locks (so with the new binding's requests, atomically).
    #[cold]
    #[inline(never)]
    pub(super) fn check_moved(
        self: &Arc<Self>,
        bound: &MemoryPolicy,
        check: &Check<'_>,
        fp: u64,
        now: u64,
    ) -> Verdict<MemoryTicket> {
        let core = &bound.core;
        let shard = self.shard(fp);
        let mut generals = lock(&shard.general);
        let mut compact = shard.compact.lock();
        let places = places(core, self.shard_index(fp));
        let (mut states, held) = gather((core, bound.id), &places, &generals, &mut compact, fp);
        let (decision, charges) = decide_core(core, &mut states, now, check);
        let mut inserted = 0;
        let missing = held.iter().filter(|h| !**h).count();
        let room = missing == 0 || self.len.load(Ordering::Relaxed) + missing <= self.max_keys;
        if charges.is_some() {
            if !room {
                drop((compact, generals));
                return self.check_overflow(bound, check, fp, now);
            }
            let at = (fp, now, true);
            inserted = scatter((core, bound.id), &places, &states, &mut generals, &mut compact, at);
        } else if core.policy.has_penalty() {
            // A refusal may have counted a breach or started a block: kept where there is room.
            let at = (fp, now, room);
            inserted = scatter((core, bound.id), &places, &states, &mut generals, &mut compact, at);
        }
        drop((compact, generals));
        if inserted > 0 {
            self.len.fetch_add(inserted, Ordering::Relaxed);
            self.start_sweeper();
        }
        let ticket = charges.and_then(|c| self.ticket_for(bound, check, fp, c, false));
        Verdict { decision, ticket }
    }
}

/// A key's state under the binding a reload replaces.
pub(super) enum Was {
    /// Every tier's state (general tables).
    States(KeyState),
    /// The TAT of the compact form's one GCRA tier, nanoseconds.
    Tat(u64),
}

/// The whole-nanosecond TAT of a GCRA tier's scaled state (`count` its rate's count): exact,
/// since a tier whose emission interval is whole keeps its scaled TAT a multiple of `count`.
pub(super) fn whole_tat(state: &TierState, count: u64) -> Option<u64> {
    match state {
        TierState::Gcra(scaled) => u64::try_from(scaled.div_ceil(u128::from(count))).ok(),
        _ => None,
    }
}

/// The scaled state of a GCRA tier whose whole-nanosecond TAT is `tat`.
pub(super) fn scaled_tat(tat: u64, count: u64) -> TierState {
    TierState::Gcra(u128::from(tat) * u128::from(count))
}

/// Where a state slot (a tier's state, or a penalty box) of a key of a replaced binding lives
/// now.
pub(super) enum Place {
    /// In the binding's own table (what the reload did not keep).
    Own,
    /// In a compact table, whose one tier's rate counts `count`.
    Compact { id: usize, count: u64 },
    /// Slot `tier` of a general table.
    General { id: usize, core: Arc<Core>, tier: usize },
}

/// The state slots of a key of `policy`: its tiers', then its penalty boxes.
fn state_len(policy: &Policy) -> usize {
    policy.tiers().len() + policy.tiers().iter().filter(|t| t.penalty.is_some()).count()
}

/// Where each state slot of `core`'s keys in shard `shard` lives: one handed over to the
/// binding that replaced it lives where that one keeps it, through any number of reloads.
pub(super) fn places(core: &Arc<Core>, shard: usize) -> SmallVec<[Place; 4]> {
    (0..state_len(&core.policy))
        .map(|j| {
            let (mut at, mut id, mut tier) = (core, None, j);
            while at.moved(shard) {
                let Some(next) = at.next.get() else { break };
                let Some(k) = next.slots.get(tier).copied().flatten() else { break };
                (at, id, tier) = (&next.core, Some(next.id), k);
            }
            match id {
                None => Place::Own,
                Some(id) if at.whole.is_some() => {
                    Place::Compact { id, count: at.policy.tiers()[tier].rate.count }
                }
                Some(id) => Place::General { id, core: Arc::clone(at), tier },
            }
        })
        .collect()
}

/// A key's state as binding `id` of `core` decides it, each slot read from its place, and
/// whether each place held the key.
pub(super) fn gather(
    (core, id): (&Arc<Core>, usize),
    places: &[Place],
    generals: &Generals,
    compact: &mut Compact,
    fp: u64,
) -> (KeyState, SmallVec<[bool; 4]>) {
    let own = match core.whole {
        None => own(generals, id, core).and_then(|g| g.map.get(&fp)).cloned(),
        Some(_) => None,
    };
    let own_held = own.is_some();
    let mut states = own.unwrap_or_else(|| core.fresh());
    let policy = &core.policy;
    let fresh = |j: usize| match policy.tiers().get(j) {
        Some(tier) => TierState::fresh_for(policy.algorithm(), tier, 0),
        None => TierState::Penalty(Box::default()),
    };
    let held = places
        .iter()
        .enumerate()
        .map(|(j, place)| match place {
            Place::Own => own_held,
            Place::Compact { id, count } => match compact.tat_mut(*id, fp) {
                Some(tat) => {
                    states[j] = scaled_tat(*tat, *count);
                    true
                }
                None => {
                    states[j] = fresh(j);
                    false
                }
            },
            Place::General { id, tier, .. } => {
                match generals.get(*id).and_then(Option::as_ref).and_then(|g| g.map.get(&fp)) {
                    Some(there) => {
                        states[j] = there[*tier].clone();
                        states.guard = states.guard.max(there.guard);
                        true
                    }
                    None => {
                        states[j] = fresh(j);
                        false
                    }
                }
            }
        })
        .collect();
    (states, held)
}

/// Writes back what [`gather`] read, each tier to its place; with `insert`, a place that did
/// not hold the key gets it (unless it would decide like a fresh one). Returns the keys
/// inserted.
pub(super) fn scatter(
    (core, id): (&Arc<Core>, usize),
    places: &[Place],
    states: &KeyState,
    generals: &mut Generals,
    compact: &mut Compact,
    (fp, now, insert): (u64, u64, bool),
) -> usize {
    let mut inserted = 0;
    // The binding's own table, unless its slot was given up since and holds another policy's.
    let mine = own(generals, id, core).is_some() || generals.get(id).is_none_or(Option::is_none);
    if core.whole.is_none() && mine && places.iter().any(|p| matches!(p, Place::Own)) {
        let table = general_mut(generals, id, core);
        match table.map.get_mut(&fp) {
            Some(mine) => {
                for (j, place) in places.iter().enumerate() {
                    if matches!(place, Place::Own) {
                        mine[j] = states[j].clone();
                    }
                }
                mine.guard = states.guard;
            }
            None if insert && !core.is_idle(states, now) => {
                table.map.insert(fp, states.clone());
                inserted += 1;
            }
            None => {}
        }
    }
    for (j, place) in places.iter().enumerate() {
        match place {
            Place::Own => {}
            Place::Compact { id, count } => {
                let Some(tat) = whole_tat(&states[j], *count) else { continue };
                match compact.tat_mut(*id, fp) {
                    Some(there) => *there = tat,
                    None if insert && tat > now => {
                        compact.insert(*id, fp, tat);
                        inserted += 1;
                    }
                    None => {}
                }
            }
            Place::General { id, core: home, tier } => {
                let table = general_mut(generals, *id, home);
                match table.map.get_mut(&fp) {
                    Some(there) => {
                        there[*tier] = states[j].clone();
                        there.guard = there.guard.max(states.guard);
                    }
                    None if insert => {
                        let mut there = home.fresh();
                        there[*tier] = states[j].clone();
                        there.guard = states.guard;
                        if !home.is_idle(&there, now) {
                            table.map.insert(fp, there);
                            inserted += 1;
                        }
                    }
                    None => {}
                }
            }
        }
    }
    inserted
}

/// Binding `id`'s own general table, if it is still `core`'s (a binding dropped since may have
/// given its slot up to another policy's).
fn own<'a>(
    generals: &'a Generals,
    id: usize,
    core: &Arc<Core>,
) -> Option<&'a super::table::General> {
    generals.get(id).and_then(Option::as_ref).filter(|g| Arc::ptr_eq(&g.core, core))
}
