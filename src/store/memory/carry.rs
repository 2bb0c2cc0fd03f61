//! Reloads: a binding replaced by another carries its keys' state over (unchanged tiers
//! handed over, changed ones charged their used fraction), and requests still decided through
//! the replaced binding decide on the state it handed over.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use smallvec::SmallVec;

use super::compact::Compact;
use super::table::{Core, Generals, KeyState, Next, general_mut, lock};
use super::{Inner, MemoryPolicy, MemoryStore, MemoryTicket, decide_core};
use crate::algorithm::{GcraStep, Mode, TierState, decide_kinds, fresh_boxes};
use crate::policy::Policy;
use crate::quota::{Priority, TierKind};
use crate::store::{Carry, Check, Verdict};

impl MemoryStore {
    /// Binds `policy` in place of `old` (see [`Store::rebind`](crate::store::Store::rebind)): each key's state of the rate
    /// and calendar tiers that did not change (same name and definition, under the same
    /// algorithm and time unit) is carried into the new binding as it is (between the compact
    /// one-tier GCRA form and general tables too); changed tiers start as `carry` says,
    /// concurrency tiers with no slot held. Keys are carried while the store has room for them
    /// beside `old`'s (`max_keys`).
    ///
    /// When `policy` is bound to this store already, the new binding shares that state and
    /// nothing is carried (one policy, one budget).
    ///
    /// **No charge is lost to the reload.** When `old` is its policy's only binding, its
    /// unchanged tiers are handed over rather than copied: from the moment a shard's keys are
    /// carried, requests still decided through `old` (begun before the reload) decide and
    /// charge those tiers on the new binding's state, under the same lock as the new binding's
    /// own requests, so a tier that did not change admits exactly its quota across any number
    /// of reloads. `old` keeps deciding its other tiers on its own state. (When other bindings
    /// share `old`'s policy, it stays theirs: `old`'s later charges stay in it and are not
    /// seen by the new binding.) Rebinding a binding that was replaced already rebinds its
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
        let (before, after) = (&from_core.policy, &new.core.policy);
        let same_time = before.algorithm() == after.algorithm() && before.unit() == after.unit();
        // For each old tier, the new tier that keeps its state.
        let kept: Box<[Option<usize>]> = before
            .tiers()
            .iter()
            .map(|o| {
                if !same_time || o.kind() == TierKind::Concurrency {
                    return None;
                }
                after.tiers().iter().position(|t| t.name() == o.name() && t == o)
            })
            .collect();
        let hand_over = kept.iter().any(Option::is_some) && inner.supersede(from, before, new.id);
        if hand_over {
            let next = Next { id: new.id, core: Arc::clone(&new.core), tiers: kept };
            // `supersede` admits a slot once: nothing was set.
            let _ = from_core.next.set(next);
        }
        let now = inner.clock.now();
        for (i, shard) in inner.shards.iter().enumerate() {
            let mut generals = lock(&shard.general);
            let mut compact = shard.compact.lock();
            if !existed {
                self.carry_shard(from, &from_core, &new, carry, &mut generals, &mut compact, now);
            }
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
        new
    }

    /// Starts each key of one shard's `from` slot in `new`: tiers unchanged as they are, the
    /// other tiers matched by name charged their used fraction at the reload instant when
    /// `carry` says so ([`Carry::UsedFraction`]). Keys `new` holds already are left alone.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn carry_shard(
        &self,
        from: usize,
        from_core: &Core,
        new: &MemoryPolicy,
        carry: Carry,
        generals: &mut Generals,
        compact: &mut Compact,
        now: u64,
    ) {
        let (before, after) = (&from_core.policy, &new.core.policy);
        let same_time = before.algorithm() == after.algorithm() && before.unit() == after.unit();
        let changed_too = carry == Carry::UsedFraction;
        let rated = |t: &crate::policy::Tier| t.kind() != TierKind::Concurrency;
        // For each new tier: the old tier of its name, and whether it is unchanged.
        let matched: Vec<Option<(usize, bool)>> = after
            .tiers()
            .iter()
            .map(|t| {
                let j = before.tiers().iter().position(|o| o.name() == t.name())?;
                let o = &before.tiers()[j];
                let unchanged = same_time && o == t;
                (rated(t) && rated(o) && (changed_too || unchanged)).then_some((j, unchanged))
            })
            .collect();
        if matched.iter().all(Option::is_none) {
            return;
        }
        let inner = &self.inner;
        // Each old key: its state, or its TAT in the compact form.
        let keys: Vec<(u64, Was)> = if from_core.whole.is_some() {
            compact.entries(from).into_iter().map(|(fp, t)| (fp, Was::Tat(t))).collect()
        } else {
            let Some(Some(table)) = generals.get(from) else { return };
            table.map.iter().map(|(fp, s)| (*fp, Was::States(s.clone()))).collect()
        };
        let zeros = vec![0; before.tiers().len()];
        let count = |j: usize| before.tiers()[j].rate.count;
        for (fp, state) in keys {
            let held = match &new.core.whole {
                Some(_) => compact.tat_mut(new.id, fp).is_some(),
                None => generals
                    .get(new.id)
                    .and_then(Option::as_ref)
                    .is_some_and(|g| g.map.contains_key(&fp)),
            };
            if held {
                continue;
            }
            // What remains of each old tier now, in whole units.
            let remaining: Vec<u64> = match (&state, &from_core.whole) {
                (Was::Tat(tat), Some(w)) => vec![w.status(*tat, now).0],
                (Was::States(states), _) => {
                    // What the tiers hold, not what a block says (nothing left).
                    let tiers = before.tiers().len();
                    let boxes = fresh_boxes(before);
                    let mut states: Box<[TierState]> =
                        states.iter().take(tiers).cloned().chain(boxes).collect();
                    let (d, _) = decide_kinds(
                        before,
                        &mut states,
                        now,
                        &zeros,
                        Mode::Police,
                        Priority::Critical,
                    );
                    d.tiers().iter().map(crate::TierDecision::remaining).collect()
                }
                (Was::Tat(_), None) => continue,
            };
            let used = |i: usize, j: usize| {
                let (from, to) = (before.tiers()[j].capacity(), after.tiers()[i].capacity());
                let used = from.saturating_sub(remaining.get(j).copied().unwrap_or(from));
                let scaled = (u128::from(used) * u128::from(to)).div_ceil(u128::from(from));
                u64::try_from(scaled).unwrap_or(u64::MAX).min(to)
            };
            if let Some(w) = &new.core.whole {
                let Some(Some((j, unchanged))) = matched.first().copied() else { continue };
                let exact = match (&state, unchanged) {
                    (Was::Tat(tat), true) => Some(*tat),
                    (Was::States(states), true) => whole_tat(&states[j], count(j)),
                    _ => None,
                };
                let tat = exact.or_else(|| match w.decide(0, now, used(0, j), 0) {
                    GcraStep::Admit { tat, .. } => Some(tat),
                    _ => None,
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
            let mut states = new.core.fresh();
            let mut costs = vec![0; after.tiers().len()];
            if let Was::States(old) = &state {
                states.guard = old.guard;
            }
            // An unchanged tier keeps its penalty box too: (new slot, old slot).
            let mut boxes: SmallVec<[(usize, usize); 2]> = SmallVec::new();
            for (i, m) in matched.iter().enumerate() {
                let Some((j, unchanged)) = *m else { continue };
                match (&state, unchanged) {
                    (Was::States(old_states), true) => {
                        states[i] = old_states[j].clone();
                        if after.tiers()[i].penalty.is_some() {
                            boxes.push((after.penalty_slot(i), before.penalty_slot(j)));
                        }
                    }
                    (Was::Tat(tat), true) => states[i] = scaled_tat(*tat, count(j)),
                    _ => costs[i] = used(i, j),
                }
            }
            // Each changed tier charged on its own: every one fits a fresh tier (and the boxes,
            // which would refuse a blocked key, are carried after).
            for (i, units) in costs.iter().enumerate().filter(|(_, u)| **u > 0) {
                let mut one = vec![0; costs.len()];
                one[i] = *units;
                let _ =
                    decide_kinds(after, &mut states, now, &one, Mode::Police, Priority::Critical);
            }
            if let Was::States(old_states) = &state {
                for (to, from) in boxes {
                    if let (Some(to), Some(from)) = (states.get_mut(to), old_states.get(from)) {
                        *to = from.clone();
                    }
                }
            }
            if new.core.is_idle(&states, now) {
                continue;
            }
            if inner.len.load(Ordering::Relaxed) >= inner.max_keys {
                return;
            }
            general_mut(generals, new.id, &new.core).map.insert(fp, states);
            inner.len.fetch_add(1, Ordering::Relaxed);
        }
    }
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

/// Where a tier of a key of a replaced binding lives now.
pub(super) enum Place {
    /// In the binding's own table (a tier the reload changed).
    Own,
    /// In a compact table, whose one tier's rate counts `count`.
    Compact { id: usize, count: u64 },
    /// Tier `tier` of a general table.
    General { id: usize, core: Arc<Core>, tier: usize },
}

/// Where each tier of `core`'s keys in shard `shard` lives: a tier handed over to the binding
/// that replaced it lives where that one keeps it, through any number of reloads.
pub(super) fn places(core: &Arc<Core>, shard: usize) -> SmallVec<[Place; 4]> {
    (0..core.policy.tiers().len())
        .map(|j| {
            let (mut at, mut id, mut tier) = (core, None, j);
            while at.moved(shard) {
                let Some(next) = at.next.get() else { break };
                let Some(k) = next.tiers.get(tier).copied().flatten() else { break };
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

/// A key's state as binding `id` of `core` decides it, each tier read from its place, and
/// whether each place held the key.
pub(super) fn gather(
    (core, id): (&Arc<Core>, usize),
    places: &[Place],
    generals: &Generals,
    compact: &mut Compact,
    fp: u64,
) -> (KeyState, SmallVec<[bool; 4]>) {
    let own = match core.whole {
        None => generals.get(id).and_then(Option::as_ref).and_then(|g| g.map.get(&fp)).cloned(),
        Some(_) => None,
    };
    let own_held = own.is_some();
    let mut states = own.unwrap_or_else(|| core.fresh());
    let policy = &core.policy;
    let fresh = |j: usize| TierState::fresh_for(policy.algorithm(), &policy.tiers()[j], 0);
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
    // Penalty boxes, after the tiers, always live in the binding's own table.
    let boxes = states.len() > places.len();
    if core.whole.is_none() && (boxes || places.iter().any(|p| matches!(p, Place::Own))) {
        let table = general_mut(generals, id, core);
        match table.map.get_mut(&fp) {
            Some(mine) => {
                for (j, place) in places.iter().enumerate() {
                    if matches!(place, Place::Own) {
                        mine[j] = states[j].clone();
                    }
                }
                for j in places.len()..states.len() {
                    mine[j] = states[j].clone();
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
