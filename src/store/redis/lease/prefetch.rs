//! Prefetch: the call that takes a key's next block ahead of need (see [`Lease::prefetch`]).

use super::*;

/// The block size from which an instance asks for a key's next block ahead of need (or the
/// largest block, when smaller; see [`Lease::prefetch`]): the key's blocks doubled four times,
/// each spent within its lifetime. A key checked now and then never gets there, so it costs
/// no call ahead of need and strands no block it will not spend.
pub(super) const PREFETCH_FROM: u64 = 16;

/// What a prefetch asks for.
pub(crate) struct Ahead {
    /// The largest block to take: what tops the units held up to the block asked for.
    pub(crate) block: u64,
    /// The useful block, as for [`Begin::useful`].
    pub(crate) useful: u64,
}

impl Leases {
    /// Whether a check at `now` starts the key's prefetch (and marks it as fetching): when
    /// prefetching, none is in flight, the key's blocks have grown (to [`PREFETCH_FROM`]), half of
    /// the block this instance asks for is spent, and a useful block is at most a round trip
    /// away (half a round trip: the call reaches Redis about then, so it finds the useful
    /// block there, and this instance's checks wait for the rest of the round trip at most).
    pub(super) fn wants_prefetch(&self, held: &mut HeldBlock, now: u64) -> bool {
        let due = self.prefetching
            && !held.fetching
            && held.next >= PREFETCH_FROM.min(self.config.max_block).max(2)
            && held.decision.is_some()
            && held.left.saturating_mul(self.ahead_part()) <= held.next
            && (held.left == 0 || held.live(now))
            // Units of an earlier block still held keep their own lifetime, which a second
            // merge could not: the next prefetch waits until they are spent or expired.
            && held.older == 0
            && now >= held.hold.saturating_sub(self.round_trip.load(Ordering::Relaxed) / 2);
        if due {
            held.fetching = true;
        }
        due
    }

    /// A prefetch starts when `1 / ahead_part()` of the block asked for is left: half, or an
    /// eighth when leasing from the key's schedule, whose blocks are paced (its units
    /// conform one after the other, so what is left lasts), and whose prefetch, topping up
    /// what is held, is then most of a block instead of half of one.
    pub(super) fn ahead_part(&self) -> u64 {
        if self.horizon > 0 { 8 } else { 2 }
    }

    /// Spawns the call that takes the key's next block ahead of need (the slot is marked as
    /// fetching; without a runtime, or a way to call Redis, the mark is dropped).
    pub(super) fn start_prefetch(self: &Arc<Self>, slot: &Arc<Slot>) {
        let handle = tokio::runtime::Handle::try_current().ok().filter(|_| self.back.is_some());
        let Some(handle) = handle else {
            slot.held.lock().unwrap_or_else(PoisonError::into_inner).fetching = false;
            return;
        };
        // Counted when started, so that the check that starts it sees it in the stats.
        self.counters.prefetched.fetch_add(1, Ordering::Relaxed);
        handle.spawn(Arc::clone(self).prefetch(Arc::clone(slot)));
    }

    /// The prefetch: with the slot's refill lock held (so that it is the key's only call of
    /// this instance in flight), takes what tops the units held up to the block asked for,
    /// and adds it to the block.
    pub(super) async fn prefetch(self: Arc<Self>, slot: Arc<Slot>) {
        /// Clears the slot's mark however the prefetch ends.
        struct Fetching<'a>(&'a Slot);
        impl Drop for Fetching<'_> {
            fn drop(&mut self) {
                self.0.held.lock().unwrap_or_else(PoisonError::into_inner).fetching = false;
            }
        }
        let Some(back) = &self.back else { return };
        let _fetching = Fetching(&slot);
        let _refill = slot.refill.lock().await;
        let clock_now = || back.inner.settings.clock.as_ref().map(crate::clock::AnyClock::now);
        let Some((ahead, key)) = self.ahead(&slot, clock_now()) else {
            // No longer due: no call made.
            self.counters.prefetched.fetch_sub(1, Ordering::Relaxed);
            return;
        };
        let record = self.record(&back.prepared, 1, ahead.block, ahead.useful, None);
        let keys = back.prepared.keys(state_key(&back.key_parts, &back.key_names, &key));
        let (answered, sent) = self.call(&back.inner, &back.prepared, keys, record).await;
        match answered {
            Ok(Reply { decision, charges: Some(charges), take, hold, at, paced }) => {
                let grant = Grant { take, charges, at, hold, useful: ahead.useful, sent, paced };
                self.prefetched(&slot, decision, grant);
            }
            Ok(Reply { decision, charges: None, hold, at, paced, .. }) => {
                self.prefetch_refused(&slot, &decision, at, hold, ahead.useful, paced);
            }
            Err(error) => {
                tracing::debug!(%error, "tollgate: a lease prefetch failed; the next block is taken when needed");
            }
        }
    }

    /// What a prefetch asks for, with the key: `None` when it is no longer due (a check took
    /// a new block meanwhile, or the block cannot grow).
    pub(super) fn ahead(&self, slot: &Slot, clock_now: Option<u64>) -> Option<(Ahead, Key)> {
        let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
        let now = held.now(clock_now);
        held.expire_older(now);
        if held.left.saturating_mul(self.ahead_part()) > held.next
            || (held.left > 0 && !held.live(now))
            || held.older > 0
        {
            return None;
        }
        let size = held.next.saturating_mul(2).min(self.config.max_block);
        let block = size.checked_sub(held.left).filter(|b| *b > 0)?;
        let useful = self.useful_now().min(block);
        Some((Ahead { block, useful }, held.key.clone()?))
    }

    /// A prefetch was granted: its units join the block (those held are spent first, and
    /// keep their lifetime), and the block asked for next doubles.
    pub(super) fn prefetched(&self, slot: &Slot, decision: Decision, grant: Grant) {
        let Grant { take, charges, at, hold, useful, sent, paced } = grant;
        let hold = self.wait_until(at, hold, take, useful);
        let until = at.saturating_add(self.lifetime_ns);
        {
            let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
            let room = decision.tiers.iter().map(|t| t.remaining).min();
            match &mut held.charges {
                Some(old) => {
                    // Refunds do not depend on the instant of the charge: one settlement
                    // gives back what is left of both.
                    for (o, c) in old.iter_mut().zip(&charges) {
                        o.cost = o.cost.saturating_add(c.cost);
                    }
                    held.older_until = if held.older > 0 { held.older_until } else { held.until };
                    // The units held are spent first, each at its own grant's pace (a
                    // prefetch starts only once no `older` units are held).
                    held.older_paced = std::mem::replace(&mut held.paced, paced);
                    held.waits.clear();
                    held.older = held.left;
                    held.granted += take;
                    held.left += take;
                }
                None => {
                    held.charges = Some(charges);
                    held.granted = take;
                    held.left = take;
                    held.older = 0;
                    held.expired = 0;
                    held.paced = paced;
                    held.older_paced.clear();
                    held.waits.clear();
                }
            }
            held.decided = at;
            held.sent = sent;
            held.until = until;
            held.hold = hold;
            held.useful = useful;
            held.decision = Some(decision);
            held.room = room;
            held.next = held.next.saturating_mul(2).min(self.config.max_block);
        }
        self.counters.grants.fetch_add(1, Ordering::Relaxed);
        self.counters.units_granted.fetch_add(take, Ordering::Relaxed);
        self.metrics.granted(take);
    }

    /// Redis refused a prefetch at `at` (the key has nothing left): the block held is spent
    /// as it is, and then this instance waits as after a refused lease call (`waits`: see
    /// `HeldBlock::waits`).
    pub(super) fn prefetch_refused(
        &self,
        slot: &Slot,
        decision: &Decision,
        at: u64,
        hold: u64,
        useful: u64,
        waits: Paced,
    ) {
        if decision.outcome != Outcome::Limited {
            return;
        }
        let until = if self.horizon > 0 {
            // Leasing the schedule: until a useful block fits the horizon again, as Redis
            // said (as for a refused lease call, see `refused`).
            hold
        } else {
            let until = self.wait_until(at, hold, 0, useful);
            match decision.retry_after {
                NONE => until,
                exact => until.max(at.saturating_add(exact)),
            }
        };
        let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
        held.hold = held.hold.max(until);
        if self.horizon > 0 {
            held.waits = waits;
        }
    }
}
