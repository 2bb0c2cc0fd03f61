//! Settlement: a ticket's charges corrected to what the request used, tier by tier.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use smallvec::SmallVec;

use super::carry::{gather, places, scatter};
use super::table::{Core, KeyState, general_mut, lock};
use super::{Charged, Inner, takes_slots};
use crate::algorithm::compiled::Kind;
use crate::algorithm::{TierState, in_units, prune_kinds, release as release_slots, settle_tier};

impl Inner {
    /// Settles `ticket` under binding `id` of `core`: each rate or calendar tier `i` for which
    /// `target(i)` gives a new cost is settled at it (a refund when less, an extra charge when
    /// more), and with `release` the concurrency slots are given back (and their holds
    /// observed, and the waiters woken).
    pub(super) fn settle(
        &self,
        core: &Arc<Core>,
        id: usize,
        ticket: &mut Charged,
        target: &dyn Fn(usize) -> Option<u64>,
        release: bool,
    ) {
        let policy = &core.policy;
        let tiers = policy.tiers();
        // (tier, units, extra) per tier whose cost changes.
        let changes: SmallVec<[(usize, u64, bool); 4]> = tiers
            .iter()
            .zip(&ticket.charges)
            .enumerate()
            .filter(|(_, (t, _))| !matches!(t.kind, Kind::Concurrency(_)))
            .filter_map(|(i, (_, c))| {
                let new = target(i)?;
                (new != c.cost).then(|| (i, new.abs_diff(c.cost), new > c.cost))
            })
            .collect();
        let slots = release && takes_slots(policy, &ticket.charges);
        if changes.is_empty() && !slots {
            return;
        }
        let now = self.clock.now();
        // A settlement of units moves the key's clock guard, as a charge does.
        let apply = |states: &mut KeyState| {
            let at = core.guarded(states.guard, now);
            let now_units = in_units(policy, at);
            // What ended is forgotten first, as the Redis scripts do on reading the key.
            if core.guarded {
                prune_kinds(policy, states, now_units);
            }
            for &(i, units, extra) in &changes {
                settle_tier(policy, i, states, ticket.charges[i], now_units, units, extra);
            }
            if core.guarded && !changes.is_empty() {
                states.guard = at;
            }
            if slots {
                for (i, t) in tiers.iter().enumerate() {
                    if matches!(t.kind, Kind::Concurrency(_)) {
                        release_slots(&mut states[i], ticket.charges[i]);
                    }
                }
            }
        };
        let extra = changes.iter().any(|c| c.2);
        let fp = ticket.fp;
        let mut inserted = 0;
        if ticket.overflow {
            if let Some(states) = lock(&core.overflow).as_mut() {
                apply(states);
            }
        } else if (!changes.is_empty() || slots) && core.moved(self.shard_index(fp)) {
            // Replaced in a reload: the tiers and slots handed over are settled and released
            // where they live now.
            let shard = self.shard(fp);
            let mut generals = lock(&shard.general);
            let mut compact = shard.compact.lock();
            let places = places(core, self.shard_index(fp));
            let (mut states, _) = gather((core, id), &places, &generals, &mut compact, fp);
            apply(&mut states);
            let at = (fp, now, extra);
            inserted = scatter((core, id), &places, &states, &mut generals, &mut compact, at);
        } else if let (Some(w), [(_, units, more)]) = (&core.whole, changes.as_slice()) {
            let at = ticket.charges.first().map_or(now, |c| c.at).max(now);
            let mut tables = self.shard(fp).compact.lock();
            match tables.tat_mut(id, fp) {
                Some(tat) => {
                    let new =
                        if *more { w.charge(*tat, at, *units) } else { w.refund(*tat, *units) };
                    // Given back to idle: the key is forgotten (0 is a fresh key), as the Redis
                    // store deletes it, so that a clock stepping back finds it fresh on both.
                    *tat = if new > now { new } else { 0 };
                }
                // Evicted since: the extra is charged to a fresh state; a refund has nothing
                // left to give back.
                None if *more => {
                    tables.insert(id, fp, w.charge(0, at, *units));
                    inserted = 1;
                }
                None => {}
            }
        } else if core.whole.is_none() {
            let mut tables = lock(&self.shard(fp).general);
            let table = general_mut(&mut tables, id, core);
            // A binding dropped since, whose slot another binding took: nothing of it is left.
            if Arc::ptr_eq(&table.core, core) {
                match table.map.get_mut(&fp) {
                    Some(states) => {
                        let entries = core.guarded && states.iter().any(TierState::has_entries);
                        apply(states);
                        // Idle once settled (or once its windows ended, slots released):
                        // forgotten, as on the Redis store, whose script writes a key back
                        // when units were settled or when it pruned windows or entries that
                        // ended, and deletes it when nothing is left (see above).
                        if !changes.is_empty() || entries {
                            core.forget_if_idle(states, now);
                        }
                    }
                    None if extra => {
                        let mut states = core.fresh();
                        apply(&mut states);
                        table.map.insert(fp, states);
                        inserted = 1;
                    }
                    None => {}
                }
            }
        }
        if inserted > 0 {
            self.len.fetch_add(inserted, Ordering::Relaxed);
        }
        for &(i, _, _) in &changes {
            if let Some(new) = target(i) {
                ticket.charges[i].cost = new;
            }
        }
        if let Some(new) = target(0).filter(|_| changes.len() == tiers.len()) {
            ticket.cost = new;
        }
        if slots {
            let unit = policy.unit();
            for (i, (t, c)) in tiers.iter().zip(ticket.charges.iter_mut()).enumerate() {
                if matches!(t.kind, Kind::Concurrency(_)) && c.cost > 0 {
                    core.holds.observe(i, now.saturating_sub(c.at.saturating_mul(unit)));
                    c.cost = 0;
                }
            }
            // Slots handed over in a reload are those of the bindings that replaced this one:
            // their waiters are woken too.
            let mut at = Some(core);
            while let Some(c) = at {
                c.wake(fp);
                at = c.next.get().map(|n| &n.core);
            }
        }
    }
}
