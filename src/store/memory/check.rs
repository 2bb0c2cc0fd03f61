//! The check path: a key's tiers decided in its shard (compact or general form, or the
//! shared overflow bucket when the store is full), and the ticket of an admission.

use super::*;

/// Decides `check` on `key` under `core`'s policy at `now` (nanoseconds), or at the key's
/// clock guard when that is later (see [`KeyState::guard`]; an admission moves it), tier by
/// tier (a plain policy's tiers all take the check's cost).
#[inline]
pub(super) fn decide_core(
    core: &Core,
    key: &mut KeyState,
    now: u64,
    check: &Check<'_>,
) -> (Decision, Option<Charges>) {
    let policy = &core.policy;
    let mode = mode(check.max_delay);
    let at = core.guarded(key.guard, now);
    let entries = core.guarded && key.iter().any(TierState::has_entries);
    let cost = |i: usize| policy.tier_cost(i, check.cost, check.costs);
    let (mut decision, mut charges) = decide_with(policy, key, at, cost, mode, check.priority);
    if !core.wakers.is_empty() {
        slots::fill(policy, &core.holds, &mut decision);
    }
    let units = |charges: &Charges| {
        let tiers = policy.tiers();
        charges.iter().zip(tiers).any(|(c, t)| c.cost > 0 && t.kind() != TierKind::Concurrency)
    };
    if let Some(charges) = charges.as_mut().filter(|_| at != now) {
        // A ticket's charges are stamped on the caller's clock, its delay after `now`, as the
        // Redis store stamps them (its guard lives in the server's script): slots taken alone
        // too, whose hold is measured from then.
        let shift = in_units(policy, at) - in_units(policy, now);
        for c in charges.iter_mut() {
            c.at = c.at.saturating_sub(shift);
        }
    }
    if charges.as_ref().is_some_and(|c| core.guarded && units(c)) {
        // Units charged to a rate or calendar tier move the guard; slots taken alone do not.
        key.guard = at;
    } else if entries {
        // Windows or entries that ended, pruned to nothing: the key is forgotten with its
        // guard, as the Redis store deletes a key whose pruned state is idle.
        core.forget_if_idle(key, now);
    }
    (decision, charges)
}

#[inline]
pub(super) fn mode(max_delay: Option<Duration>) -> Mode {
    max_delay.map_or(Mode::Police, |d| Mode::Shape(duration_to_nanos(d)))
}

/// A ticket, when the caller asked to be able to settle.
#[inline]
pub(super) fn ticket(
    check: &Check<'_>,
    fp: u64,
    charges: impl FnOnce() -> Charges,
    overflow: bool,
) -> Option<MemoryTicket> {
    (check.ticket && check.cost > 0).then(|| {
        MemoryTicket(Box::new(Charged {
            fp,
            cost: check.cost,
            charges: charges(),
            overflow,
            holding: None,
        }))
    })
}

/// Whether `charges` took concurrency slots under `policy`.
pub(super) fn takes_slots(policy: &Policy, charges: &Charges) -> bool {
    policy
        .tiers()
        .iter()
        .zip(charges)
        .any(|(t, c)| matches!(t.kind, Kind::Concurrency(_)) && c.cost > 0)
}

/// The one charge of a single-tier request.
pub(super) fn one(at: u64, cost: u64) -> impl FnOnce() -> Charges {
    move || Charges::from_elem(Charge { at, cost, id: 0 }, 1)
}

impl Inner {
    #[inline]
    pub(super) fn fingerprint(&self, key: &Key) -> u64 {
        let mut h = self.hasher.build_hasher();
        key.feed(&mut h);
        h.finish()
    }

    /// The shard of a fingerprint: bits 40..56, apart from the low bits that index buckets
    /// inside a table and the top seven that tag them.
    #[inline]
    pub(super) fn shard(&self, fp: u64) -> &Shard {
        &self.shards[self.shard_index(fp)]
    }

    #[inline]
    pub(super) fn shard_index(&self, fp: u64) -> usize {
        usize::try_from(fp >> 40).unwrap_or(0) & (self.shards.len() - 1)
    }

    /// Whether there is room for one more key: below the cap, or (at most every
    /// [`FULL_RESCAN_NANOS`] per shard, and only when `may_scan`) after evicting the idle keys of
    /// `shard`. Takes the shard's locks itself: call it holding none.
    pub(super) fn room(&self, shard: &Shard, now: u64, may_scan: bool) -> bool {
        if self.len.load(Ordering::Relaxed) < self.max_keys {
            return true;
        }
        if !may_scan || now < shard.next_scan.load(Ordering::Relaxed) {
            return false;
        }
        shard.next_scan.store(now.saturating_add(FULL_RESCAN_NANOS), Ordering::Relaxed);
        let removed = shard.evict_idle(now);
        self.len.fetch_sub(removed, Ordering::Relaxed);
        removed > 0
    }

    /// Decides on a compact (whole-nanosecond GCRA) table. Under the spin lock only the GCRA
    /// step and the TAT's update; the decision is built after.
    #[inline]
    pub(super) fn check_compact(
        self: &Arc<Self>,
        bound: &MemoryPolicy,
        w: &WholeGcra,
        check: &Check<'_>,
        fp: u64,
        now: u64,
        may_scan: bool,
    ) -> Verdict<MemoryTicket> {
        let budget = budget(mode(check.max_delay));
        let shard = self.shard(fp);
        let mut tables = shard.compact.lock();
        let (before, step) = match tables.tat_mut(bound.id, fp) {
            Some(tat) => {
                let before = *tat;
                let step = w.decide(before, now, check.cost, budget);
                if let GcraStep::Admit { tat: new, .. } = step {
                    *tat = new;
                }
                (before, step)
            }
            // A binding replaced in a reload holds no key: it decides where its keys went.
            None if bound.core.moved(self.shard_index(fp)) => {
                drop(tables);
                return self.check_moved(bound, check, fp, now);
            }
            None => {
                let step = w.decide(0, now, check.cost, budget);
                // Only an admitted request stores a new key; a rejected one leaves no state.
                if let GcraStep::Admit { tat: new, .. } = step {
                    if self.len.load(Ordering::Relaxed) < self.max_keys {
                        tables.insert(bound.id, fp, new);
                        drop(tables);
                        self.len.fetch_add(1, Ordering::Relaxed);
                        self.start_sweeper();
                    } else {
                        drop(tables);
                        return if self.room(shard, now, may_scan) {
                            self.check_compact(bound, w, check, fp, now, false)
                        } else {
                            self.check_overflow(bound, check, fp, now)
                        };
                    }
                }
                (0, step)
            }
        };
        let decision = whole_decision(w, before, now, step, budget);
        let ticket = match step {
            GcraStep::Admit { at, .. } => ticket(check, fp, one(at, check.cost), false),
            _ => None,
        };
        Verdict { decision, ticket }
    }

    /// Decides on a general table, under the shard's mutex.
    #[inline(never)]
    pub(super) fn check_general(
        self: &Arc<Self>,
        bound: &MemoryPolicy,
        check: &Check<'_>,
        fp: u64,
        now: u64,
        may_scan: bool,
    ) -> Verdict<MemoryTicket> {
        let core = &bound.core;
        let shard = self.shard(fp);
        let mut tables = lock(&shard.general);
        if core.moved(self.shard_index(fp)) {
            drop(tables);
            return self.check_moved(bound, check, fp, now);
        }
        let table = general_mut(&mut tables, bound.id, core);
        let (decision, charges) = match table.map.get_mut(&fp) {
            Some(states) => decide_core(core, states, now, check),
            None => {
                let mut states = core.fresh();
                let out = decide_core(core, &mut states, now, check);
                // Only an admitted request stores a new key; a rejected one leaves no state.
                if out.1.is_some() {
                    if self.len.load(Ordering::Relaxed) < self.max_keys {
                        table.map.insert(fp, states);
                        drop(tables);
                        self.len.fetch_add(1, Ordering::Relaxed);
                        self.start_sweeper();
                    } else {
                        drop(tables);
                        return if self.room(shard, now, may_scan) {
                            self.check_general(bound, check, fp, now, false)
                        } else {
                            self.check_overflow(bound, check, fp, now)
                        };
                    }
                }
                out
            }
        };
        let ticket = charges.and_then(|c| self.ticket_for(bound, check, fp, c, false));
        Verdict { decision, ticket }
    }

    /// The ticket of an admitted request of a general table: as [`ticket`] for a plain policy;
    /// otherwise when asked for and something was charged, and always when slots were taken.
    #[inline]
    pub(super) fn ticket_for(
        self: &Arc<Self>,
        bound: &MemoryPolicy,
        check: &Check<'_>,
        fp: u64,
        charges: Charges,
        overflow: bool,
    ) -> Option<MemoryTicket> {
        let policy = &bound.core.policy;
        if policy.is_plain() {
            return ticket(check, fp, || charges, overflow);
        }
        let slots = takes_slots(policy, &charges);
        let wanted = check.ticket && charges.iter().any(|c| c.cost > 0);
        if !(slots || wanted) {
            return None;
        }
        let holding = slots.then(|| Home {
            inner: Arc::clone(self),
            core: Arc::clone(&bound.core),
            id: bound.id,
        });
        Some(MemoryTicket(Box::new(Charged { fp, cost: check.cost, charges, overflow, holding })))
    }

    #[cold]
    pub(super) fn check_overflow(
        self: &Arc<Self>,
        bound: &MemoryPolicy,
        check: &Check<'_>,
        fp: u64,
        now: u64,
    ) -> Verdict<MemoryTicket> {
        let core = &bound.core;
        tracing::debug!(
            policy = core.policy.name(),
            "tollgate: key cap reached, using the overflow bucket"
        );
        let (decision, charges) = {
            let mut overflow = lock(&core.overflow);
            let states = overflow.get_or_insert_with(|| core.fresh());
            decide_core(core, states, now, check)
        };
        let ticket = charges.and_then(|c| self.ticket_for(bound, check, fp, c, true));
        Verdict { decision, ticket }
    }
}
