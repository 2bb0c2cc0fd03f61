//! Checks decided from a block held here, with no call: admitted, or refused while this
//! instance waits for a useful block.

use super::*;

/// What a check that took units from a block, or was refused while its instance waits, got.
pub(crate) struct Taken {
    /// The check's decision.
    pub(crate) decision: Decision,
    /// The instant Redis granted the units (when they were charged); `None` for a refusal.
    pub(crate) granted: Option<u64>,
    /// Whether this check starts the key's prefetch (see [`Lease::prefetch`]).
    pub(crate) prefetch: bool,
}

impl Leases {
    /// Takes `cost` units of `key`'s block, if this process holds one that is live and has
    /// them: the check's decision, made here, and the instant Redis granted the block (when
    /// the units were charged). Or, when the block cannot serve the check and this process
    /// waits for a useful block, the refusal, with no instant. Starts the key's prefetch
    /// when it is due (see [`Lease::prefetch`]).
    pub(crate) fn spend_key(
        self: &Arc<Self>,
        key: &Key,
        cost: u64,
        clock_now: Option<u64>,
    ) -> Option<(Decision, Option<u64>)> {
        let slot = {
            let map = self.shard(key).lock().unwrap_or_else(PoisonError::into_inner);
            Arc::clone(map.get(key)?)
        };
        self.spend(&slot, cost, clock_now)
    }

    /// [`spend_key`](Self::spend_key) on a slot at hand.
    pub(crate) fn spend(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        cost: u64,
        clock_now: Option<u64>,
    ) -> Option<(Decision, Option<u64>)> {
        let taken = self.take(slot, cost, clock_now)?;
        if taken.prefetch {
            self.start_prefetch(slot);
        }
        Some((taken.decision, taken.granted))
    }

    /// [`spend`](Self::spend) without starting the prefetch it may call for (`prefetch`
    /// says whether it does; the slot is then marked as fetching).
    pub(crate) fn take(&self, slot: &Slot, cost: u64, clock_now: Option<u64>) -> Option<Taken> {
        let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
        if cost == 0 {
            return None;
        }
        let now = held.now(clock_now);
        held.expire_older(now);
        if held.left < cost {
            let refused = self.held_refusal(&held, now, cost)?;
            let prefetch = self.wants_prefetch(&mut held, now);
            drop(held);
            self.counters.held.fetch_add(1, Ordering::Relaxed);
            self.metrics.held();
            return Some(Taken { decision: refused, granted: None, prefetch });
        }
        if !held.live(now) {
            return None;
        }
        let ready = held.ready(cost);
        if now < ready {
            // Units leased from the key's schedule that do not conform yet: refused until
            // the last of the check's conforms, exactly.
            let refused = Self::refusal(&held, now, ready)?;
            let prefetch = self.wants_prefetch(&mut held, now);
            drop(held);
            self.counters.held.fetch_add(1, Ordering::Relaxed);
            self.metrics.held();
            return Some(Taken { decision: refused, granted: None, prefetch });
        }
        held.left -= cost;
        held.older = held.older.saturating_sub(cost);
        let prefetch = self.wants_prefetch(&mut held, now);
        let mut d = held.decision.clone()?;
        let (decided, left) = (held.decided, held.conforming(now));
        let waits = waits_on(&held, now);
        let elapsed = now - decided;
        drop(held);
        d.outcome = Outcome::Allowed;
        d.delay = 0;
        d.retry_after = NONE;
        for t in &mut d.tiers {
            // Redis's rest at the last lease call (the decision kept is Redis's) less what
            // this instance spent since: see `Lease`, "Headers".
            t.remaining = promised(t, left, waits(t.remaining));
            t.reset_after = t.reset_after.saturating_sub(elapsed);
            t.retry_after = NONE;
            t.violated = false;
        }
        self.counters.local.fetch_add(1, Ordering::Relaxed);
        self.metrics.local();
        Some(Taken { decision: d, granted: Some(decided), prefetch })
    }

    /// The refusal of a check the block cannot serve while this instance waits for a useful
    /// block (until `held.hold`): limited, `retry_after` the rest of the wait (when this
    /// instance asks Redis again), `remaining` 0 on every tier (what it can promise), the
    /// tiers that had the least left at the grant violated; `None` when it does not wait.
    pub(super) fn held_refusal(&self, held: &HeldBlock, now: u64, cost: u64) -> Option<Decision> {
        if now >= held.hold || now < held.decided {
            return None;
        }
        // Leasing the schedule, the wait for a useful block can end before this check's
        // units conform: it is then told when they do, as an exact check would be (after a
        // refusal, `cost` units past the key's schedule; holding fewer than `cost` units,
        // the rest past the last held, which the next call gives back and takes again).
        let after = cost.saturating_sub(held.left);
        let conforms = held
            .waits
            .iter()
            .map(|(base, t)| base.saturating_add(cost.saturating_mul(*t)))
            .chain(held.paced.iter().map(|(end, t)| end.saturating_add(after.saturating_mul(*t))))
            .max()
            .unwrap_or(0);
        Self::refusal(held, now, held.hold.max(conforms))
    }

    /// The refusal, at `now`, of a check this instance refuses until `until`: see
    /// [`held_refusal`](Self::held_refusal).
    pub(super) fn refusal(held: &HeldBlock, now: u64, until: u64) -> Option<Decision> {
        let mut d = held.decision.clone()?;
        let (elapsed, retry) = (now.saturating_sub(held.decided), until - now);
        let least = d.tiers.iter().map(|t| t.remaining).min().unwrap_or(0);
        d.outcome = Outcome::Limited;
        d.delay = 0;
        d.retry_after = retry;
        for t in &mut d.tiers {
            let binding = t.remaining == least;
            t.remaining = 0;
            t.reset_after = t.reset_after.saturating_sub(elapsed);
            t.retry_after = if binding { retry } else { NONE };
            t.violated = binding;
        }
        Some(d)
    }
}
