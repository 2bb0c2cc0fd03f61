//! Checks in lease mode that call Redis: the call that gives the previous block back and
//! takes the next (see [`Lease`]).

use super::*;

impl RedisStore {
    /// [`Store::check`] in lease mode: from this process's block of the key, or with a call
    /// that gives back the rest of the previous block and takes the next (see [`Lease`]).
    pub(super) async fn check_leased(
        &self,
        bound: &RedisPolicy,
        leases: &Arc<Leases>,
        slot: &Arc<lease::Slot>,
        check: Check<'_>,
    ) -> Result<Verdict<RedisTicket>, StoreError> {
        let inner = &*self.inner;
        let clock_now = || inner.settings.clock.as_ref().map(AnyClock::now);
        // One check at a time takes the key's next block (or a prefetch does); the others
        // wait for it.
        let _refill = slot.refill.lock().await;
        if let Some((decision, granted)) = leases.spend(slot, check.cost, clock_now()) {
            let ticket = granted.and_then(|g| bound.lease_ticket(&check, g));
            return Ok(Verdict { decision, ticket });
        }
        if leases.start_sweeper() {
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(lease::sweeper(Arc::downgrade(leases), leases.lifetime()));
            }
        }
        let begin = leases.begin(slot, check.cost, clock_now());
        if bound.prepared.is_kinds() {
            return self.check_leased_kinds(bound, leases, slot, check, begin).await;
        }
        let returned = begin.rest.as_ref().map(|r| r.granted - r.spent);
        // The rest of the previous block is given back by this call: a give-back, which
        // refusals held of the key must not outlast.
        let _forgetting =
            returned.map(|_| bound.forgetting(&self.inner, bound.refusal_hash(check.key)));
        let prepared = &bound.prepared;
        let record =
            leases.record(prepared, check.cost, begin.block, begin.useful, begin.rest.as_ref());
        let keys = prepared.keys(bound.state_key(check.key));
        let epoch = bound.refusal_epoch(check.key);
        leases.called();
        let (decided, sent) = leases.call(inner, prepared, keys, record).await;
        let lease::Reply { decision, charges, take, hold, at, paced } = match decided {
            Ok(decided) => decided,
            // The previous block's rest may or may not have been given back: it stays charged
            // at worst (see `Lease`, "Faults").
            Err(error) => return inner.fall_back(error, bound, check),
        };
        if let Some(units) = returned {
            leases.returned(units);
        }
        // A refusal this instance waits out (a useful block is further away than the
        // refusal's own wait) is answered by the wait, whose `retry_after` is the time this
        // instance refuses for: the local refusals, exact, would say less.
        if charges.is_some() || hold <= at {
            bound.learn(&check, &decision, at, sent, epoch);
        }
        let decision = match charges {
            Some(charges) => {
                let grant =
                    lease::Grant { take, charges, at, hold, useful: begin.useful, sent, paced };
                leases.granted(slot, check.cost, decision, grant)
            }
            None => {
                let decision = leases.refused(slot, decision, at, hold, begin.useful, sent, paced);
                return Ok(Verdict { decision, ticket: None });
            }
        };
        // A block of the key's schedule whose first units conform only later refuses the
        // check that took it.
        let ticket = decision.is_allowed().then(|| bound.lease_ticket(&check, at)).flatten();
        Ok(Verdict { decision, ticket })
    }

    /// [`check_leased`](Self::check_leased) for a policy with calendar tiers: the previous
    /// block's rest is given back by a call of its own, then the next block is taken by a
    /// check of its size on every tier (asked again smaller, down to the check's cost, when
    /// Redis refuses it).
    pub(super) async fn check_leased_kinds(
        &self,
        bound: &RedisPolicy,
        leases: &Leases,
        slot: &lease::Slot,
        check: Check<'_>,
        begin: lease::Begin,
    ) -> Result<Verdict<RedisTicket>, StoreError> {
        let inner = &*self.inner;
        let (prepared, policy) = (&bound.prepared, &bound.policy);
        let n = policy.tiers().len();
        let state_key = bound.state_key(check.key);
        if let Some(rest) = &begin.rest {
            let _forgetting = bound.forgetting(inner, bound.refusal_hash(check.key));
            let new: SmallVec<[u64; 4]> = (0..n).map(|_| rest.spent).collect();
            let key = state_key.clone();
            let holds = &bound.holds;
            match settle_remote(inner, prepared, policy, holds, key, &rest.charges, &new, false)
                .await
            {
                Ok(()) => leases.returned(rest.granted - rest.spent),
                // It stays charged, at worst (see `Lease`, "Faults").
                Err(error) => {
                    tracing::debug!(%error, "tollgate: could not give a leased block back")
                }
            }
        }
        let mut block = begin.block;
        if let Some(room) = begin.room {
            block = block.min(lease::lease_share(room).max(check.cost));
        }
        loop {
            let costs: SmallVec<[u64; 4]> = (0..n).map(|_| block).collect();
            let record = prepared.check(&costs, None, 0, check.priority, inner.app_now());
            let keys = prepared.keys(state_key.clone());
            let epoch = bound.refusal_epoch(check.key);
            let sent = inner.settings.clock.is_none().then(Instant::now);
            leases.called();
            let answered = inner.submit(prepared, keys, record, prepared.check_reply_len()).await;
            let decided = answered.and_then(|(reply, at)| {
                script::decode_costs(policy, &|_| block, 0, check.priority, at, &reply)
                    .map(|d| (d, at))
            });
            let ((decision, charges), at) = match decided {
                Ok(decided) => decided,
                Err(error) => return inner.fall_back(error, bound, check),
            };
            if let Some(charges) = charges {
                // An admission: refusals of the key held or in flight are dropped.
                bound.learn(&check, &decision, at, sent, epoch);
                let paced = lease::Paced::new();
                let grant =
                    lease::Grant { take: block, charges, at, hold: 0, useful: 0, sent, paced };
                let decision = leases.granted(slot, check.cost, decision, grant);
                return Ok(Verdict { decision, ticket: bound.lease_ticket(&check, at) });
            }
            if block <= check.cost {
                // The check's own cost refused: the decision exact mode gives.
                bound.learn(&check, &decision, at, sent, epoch);
                return Ok(Verdict { decision, ticket: None });
            }
            let room = decision.tiers.iter().map(|t| t.remaining).min().unwrap_or(0);
            block = lease::lease_share(room).max(check.cost).min(block - 1);
        }
    }
}
