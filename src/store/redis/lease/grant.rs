//! Lease calls: what one asks Redis for, its reply decoded, and what a grant or a refusal
//! leaves in the slot.

use super::*;

/// What a check that takes a new block asks for.
pub(crate) struct Begin {
    /// The largest block to take.
    pub(crate) block: u64,
    /// Units Redis grants of what the key has, however little, and the size of the block
    /// this instance waits for when it got less (0: the quarter rule alone, for windows).
    pub(crate) useful: u64,
    /// The previous block's rest, given back by the same call.
    pub(crate) rest: Option<Rest>,
    /// What Redis had left of the key at the last grant.
    pub(crate) room: Option<u64>,
}

/// What Redis granted a lease call.
pub(crate) struct Grant {
    /// Units granted (the check's included).
    pub(crate) take: u64,
    /// What Redis charged for them.
    pub(crate) charges: Charges,
    /// The instant Redis granted them (nanoseconds, on the clock the scripts decide with).
    pub(crate) at: u64,
    /// When a useful block will be there again (same clock; 0 for now).
    pub(crate) hold: u64,
    /// The useful block the call asked for ([`Begin::useful`]).
    pub(crate) useful: u64,
    /// Without an injected clock: this process's instant the call was sent.
    pub(crate) sent: Option<Instant>,
    /// For a lease of the key's schedule: per tier, when the last unit granted conforms, and
    /// the emission interval (see `HeldBlock::paced`); empty otherwise.
    pub(crate) paced: Paced,
}

/// A lease call's reply, decoded.
pub(crate) struct Reply {
    /// The decision of a check of the units granted (or refused).
    pub(crate) decision: Decision,
    /// What Redis charged for them; `None` for a refusal.
    pub(crate) charges: Option<Charges>,
    /// Units granted.
    pub(crate) take: u64,
    /// When a useful block will be there again (nanoseconds, same clock as `at`; 0 for now).
    pub(crate) hold: u64,
    /// The instant Redis decided.
    pub(crate) at: u64,
    /// For a lease of the key's schedule, granted: see [`Grant::paced`].
    pub(crate) paced: Paced,
}

/// Decodes the reply of a lease call Redis decided at `at`.
pub(crate) fn decode(
    prepared: &crate::store::redis::Prepared,
    policy: &Policy,
    reply: &[i64],
    at: u64,
) -> Result<Reply, crate::StoreError> {
    use crate::StoreError;
    let [reply @ .., take, hold] = reply else {
        return Err(StoreError::backend("short lease reply"));
    };
    let take = u64::try_from(*take).map_err(|_| StoreError::backend("negative lease"))?;
    let hold = u64::try_from(*hold).map_err(|_| StoreError::backend("negative hold"))?;
    // From the unit the decision's instant falls in, as the script counts.
    let unit = prepared.unit();
    let hold = if hold == 0 { 0 } else { (at / unit).saturating_add(hold).saturating_mul(unit) };
    let (decision, charges) = crate::store::redis::script::decode(policy, take, at, reply)?;
    let mut paced = Paced::new();
    let refused = charges.is_none() && decision.outcome == Outcome::Limited;
    if prepared.family == crate::store::redis::script::Family::Gcra
        && (charges.is_some() || refused)
    {
        use crate::store::redis::script::{HEAD, PER_TIER};
        // Each tier's TAT after the grant (in units from the unit `at` falls in): its last
        // unit conforms one tolerance (the burst's emission intervals) earlier. For a
        // refusal, the TAT unchanged: a unit charged at it would conform a tolerance earlier.
        for (i, t) in policy.tiers().iter().enumerate() {
            let tat = reply.get(HEAD + PER_TIER * i + 1).copied().unwrap_or(0);
            let tat = u64::try_from(tat).map_err(|_| StoreError::backend("negative TAT"))?;
            let interval = t.rate.period / t.rate.count.max(1);
            let tat = (at / unit).saturating_add(tat).saturating_mul(unit);
            let tau = interval.saturating_mul(t.rate.burst).saturating_mul(unit);
            paced.push((tat.saturating_sub(tau), interval.saturating_mul(unit)));
        }
    }
    Ok(Reply { decision, charges, take, hold, at, paced })
}

impl Leases {
    /// One lease call to Redis (`record` on `keys`): its reply decoded, and the instant it was
    /// sent (without an injected clock). An answered call's round trip joins the average a
    /// prefetch is timed by; a failed one (a timeout) says nothing of it.
    pub(crate) async fn call(
        &self,
        inner: &crate::store::redis::Inner,
        prepared: &crate::store::redis::Prepared,
        keys: Vec<String>,
        record: Vec<f64>,
    ) -> (Result<Reply, crate::StoreError>, Option<Instant>) {
        let clock_now = || inner.settings.clock.as_ref().map(crate::clock::AnyClock::now);
        let (sent, before) = (inner.settings.clock.is_none().then(Instant::now), clock_now());
        let answered = inner.submit(prepared, keys, record, prepared.lease_reply_len()).await;
        if answered.is_ok() {
            self.observe(sent, before, clock_now());
        }
        let decoded = answered.and_then(|(reply, at)| decode(prepared, &self.policy, &reply, at));
        let decoded = decoded.map(|mut r| {
            if self.horizon == 0 {
                r.paced.clear();
            }
            r
        });
        (decoded, sent)
    }

    /// A lease call of this binding went to Redis at `before` (or `sent`, without an injected
    /// clock) and was answered at `after`: the round trip's moving average.
    pub(super) fn observe(&self, sent: Option<Instant>, before: Option<u64>, after: Option<u64>) {
        let took = match (sent, before, after) {
            (Some(sent), _, _) => duration_to_nanos(sent.elapsed()),
            (None, Some(before), Some(after)) => after.saturating_sub(before),
            _ => return,
        };
        let old = self.round_trip.load(Ordering::Relaxed);
        let new = if old == 0 { took } else { (old.saturating_mul(3).saturating_add(took)) / 4 };
        self.round_trip.store(new, Ordering::Relaxed);
    }

    /// Before a check of `cost` takes a new block (with the slot's refill lock held): the
    /// size to ask for, and the rest of the previous block, taken out so that nothing spends
    /// it while it is given back.
    pub(crate) fn begin(&self, slot: &Slot, cost: u64, clock_now: Option<u64>) -> Begin {
        let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
        let now = held.now(clock_now);
        let next = if held.granted == 0 {
            held.next.max(1)
        } else if held.left < cost || held.left == 0 {
            if held.live(now) {
                // Spent (or too little left for this check) within its lifetime: demand
                // outran the block. Doubles what was asked for: Redis may have granted less
                // (what the key had), which says nothing of the demand.
                held.next.max(held.granted).saturating_mul(2)
            } else {
                // Spent, and asked again only after its lifetime (a key checked now and then):
                // a larger block would only be given back by a call of its own.
                held.granted
            }
        } else if held.live(now) {
            held.granted
        } else {
            // Ended with units left: what this process spent of it in a lifetime.
            held.spent().max(1)
        };
        held.next = next.min(self.config.max_block);
        let rest = self.take_rest(&mut held);
        let block = held.next.max(cost);
        // A useful block covers the check asking (a weighted check waits for its own cost,
        // so a refusal's wait is never shorter than that check's); 0 stays 0 (windows).
        let useful = if self.useful == 0 { 0 } else { self.useful_now().max(cost).min(block) };
        Begin { block, useful, rest, room: held.room }
    }

    pub(super) fn take_rest(&self, held: &mut HeldBlock) -> Option<Rest> {
        let charges = held.charges.take()?;
        let rest = (held.left + held.expired > 0).then(|| Rest {
            granted: held.granted,
            spent: held.spent(),
            charges,
        });
        held.left = 0;
        held.granted = 0;
        held.older = 0;
        held.expired = 0;
        held.decision = None;
        held.paced.clear();
        held.older_paced.clear();
        rest
    }

    /// Redis granted a block for a check of `cost` (which takes its part now): keeps the
    /// rest as the slot's block and returns the check's decision.
    pub(crate) fn granted(
        &self,
        slot: &Slot,
        cost: u64,
        mut decision: Decision,
        grant: Grant,
    ) -> Decision {
        let Grant { take, charges, at, hold, useful, sent, paced } = grant;
        let hold = self.wait_until(at, hold, take, useful);
        let until = at.saturating_add(self.lifetime_ns).min(self.window_end(at));
        // A block of the key's schedule whose first units conform only later: the check
        // takes none of it, and is refused until its own conform.
        let ready = pace_at(&paced, take.saturating_sub(cost));
        let early = at < ready;
        let left = if early { take } else { take.saturating_sub(cost) };
        {
            let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
            let (next, key, fetching) = (held.next, held.key.take(), held.fetching);
            let room = decision.tiers.iter().map(|t| t.remaining).min();
            *held = HeldBlock {
                left,
                granted: take,
                // A block spent at once leaves nothing to give back: its slot may be dropped.
                charges: (left > 0).then_some(charges),
                decided: at,
                sent,
                until,
                hold,
                useful,
                decision: Some(decision.clone()),
                next,
                room,
                key,
                fetching,
                older: 0,
                older_until: 0,
                expired: 0,
                paced,
                older_paced: Paced::new(),
                waits: Paced::new(),
            };
            if early {
                let refused = Self::refusal(&held, at, ready);
                drop(held);
                self.counters.grants.fetch_add(1, Ordering::Relaxed);
                self.counters.units_granted.fetch_add(take, Ordering::Relaxed);
                self.metrics.granted(take);
                // Decided on Redis (the call that took the block), not refused locally.
                if let Some(refused) = refused {
                    return refused;
                }
                decision.outcome = Outcome::Limited;
                decision.retry_after = ready - at;
                return decision;
            }
            // What this instance can promise now: the units of the block that conform.
            let left = held.conforming(at);
            let waits = waits_on(&held, at);
            drop(held);
            self.counters.grants.fetch_add(1, Ordering::Relaxed);
            self.counters.units_granted.fetch_add(take, Ordering::Relaxed);
            self.metrics.granted(take);
            // What exact mode reports at this instant, what Redis has left plus the block's
            // rest, but on a tier this instance now waits on, the block's rest alone.
            for t in &mut decision.tiers {
                t.remaining = promised(t, left, waits(t.remaining));
            }
            decision
        }
    }

    /// Redis refused a lease call at `at` (its `decision`, exact): when a useful block is
    /// further away than the refusal's own wait (`hold`, same clock), this instance waits for
    /// it, refusing the key's checks itself until then, and the decision's `retry_after` says
    /// so (raised to the wait, on the violated tiers too).
    #[allow(clippy::too_many_arguments)] // the reply's parts, as `granted` takes them in a `Grant`
    pub(crate) fn refused(
        &self,
        slot: &Slot,
        mut decision: Decision,
        at: u64,
        hold: u64,
        useful: u64,
        sent: Option<Instant>,
        waits: Paced,
    ) -> Decision {
        if hold <= at || decision.outcome != Outcome::Limited {
            return decision;
        }
        // Never shorter than Redis's own wait for the check refused; but a lease of the
        // key's schedule waits only until a useful block fits its horizon again (exactly what
        // Redis said), when its units are leased, paced, and the check refused until its own
        // conform.
        let hold = match decision.retry_after {
            _ if self.horizon > 0 => hold,
            NONE => self.wait_until(at, hold, 0, useful),
            exact => self.wait_until(at, hold, 0, useful).max(at.saturating_add(exact)),
        };
        {
            let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
            // What a block held is given back by the call that was refused: none is left.
            debug_assert!(held.charges.is_none());
            held.decided = at;
            held.sent = sent;
            held.hold = hold;
            held.decision = Some(decision.clone());
            held.waits = if self.horizon > 0 { waits } else { Paced::new() };
        }
        let wait = hold - at;
        if decision.retry_after == NONE || decision.retry_after < wait {
            decision.retry_after = wait;
        }
        for t in decision.tiers.iter_mut().filter(|t| t.violated) {
            if t.retry_after == NONE || t.retry_after < wait {
                t.retry_after = wait;
            }
        }
        decision
    }
}
