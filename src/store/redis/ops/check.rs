//! Checks decided by Redis (a plain policy is the case of one cost on every tier).

use super::*;

impl RedisStore {
    /// [`Store::check`]: answered here from a local refusal or a leased block when it can be,
    /// else by Redis (or the fallback when Redis cannot decide).
    pub(super) async fn check_on_redis(
        &self,
        bound: &RedisPolicy,
        check: Check<'_>,
    ) -> Result<Verdict<RedisTicket>, StoreError> {
        let inner = &*self.inner;
        if !inner.lease_names_checked.load(std::sync::atomic::Ordering::Relaxed) {
            inner.check_lease_names();
        }
        // Answered here without waiting on anything: a unit of the task's cooperative budget
        // is spent, so that a task looping on checks answered locally yields now and then
        // instead of starving the others on its worker (as a check sent to Redis would).
        if let Some(verdict) = bound.local_refusal(inner, &check) {
            tokio::task::coop::consume_budget().await;
            return Ok(verdict);
        }
        if let Some(leases) = bound.leases.as_ref().filter(|_| leases_check(&check)) {
            let now = inner.settings.clock.as_ref().map(AnyClock::now);
            if let Some((decision, granted)) = leases.spend_key(check.key, check.cost, now) {
                tokio::task::coop::consume_budget().await;
                let ticket = granted.and_then(|g| bound.lease_ticket(&check, g));
                return Ok(Verdict { decision, ticket });
            }
            if let Some(slot) = leases.slot(check.key) {
                return self.check_leased(bound, leases, &slot, check).await;
            }
        }
        self.check_remote(bound, check).await
    }

    /// A check Redis decides: a cost per tier (a plain policy's are all the check's cost),
    /// and the slots of its concurrency tiers under a lease id of their own.
    async fn check_remote(
        &self,
        bound: &RedisPolicy,
        check: Check<'_>,
    ) -> Result<Verdict<RedisTicket>, StoreError> {
        let inner = &*self.inner;
        let prepared = &bound.prepared;
        let policy = &bound.policy;
        let tiers = policy.tiers();
        let costs: SmallVec<[u64; 4]> =
            (0..tiers.len()).map(|i| policy.tier_cost(i, check.cost, check.costs)).collect();
        let takes_slots =
            tiers.iter().zip(&costs).any(|(t, c)| matches!(t.kind, Kind::Concurrency(_)) && *c > 0);
        // A holder id unique enough among the slots of one key (52 random bits: exact as a
        // double in the script).
        let holder = if takes_slots { fastrand::u64(1..1 << 52) } else { 0 };
        let state_key = bound.state_key(check.key);
        // A ticket when the request takes slots, or wants one and costs something.
        let wanted = takes_slots || (check.ticket && costs.iter().any(|c| *c > 0));
        let ticket_key = wanted.then(|| state_key.clone());
        let keys = prepared.keys(state_key);
        let record = prepared.check(
            &costs,
            check.max_delay,
            holder,
            check.priority,
            inner.bounds_now(prepared),
        );
        let epoch = bound.refusal_epoch(check.key);
        let sent = inner.settings.clock.is_none().then(Instant::now);
        let answered = inner.submit(prepared, keys, record, prepared.check_reply_len()).await;
        let decided = answered.and_then(|(reply, at)| {
            script::decode_costs(policy, &|i| costs[i], holder, check.priority, at, &reply)
                .map(|d| (d, at))
        });
        let ((mut decision, charges), at) = match decided {
            Ok(decided) => decided,
            Err(error) => return inner.fall_back(error, bound, check),
        };
        bound.learn(&check, &decision, at, sent, epoch);
        if policy.has_concurrency() {
            slots::fill(policy, &bound.holds, &mut decision);
        }
        let ticket = charges.zip(ticket_key).map(|(charges, state_key)| {
            let slots = takes_slots.then(|| HeldSlots {
                id: holder,
                store: Arc::clone(&self.inner),
                prepared: Arc::clone(prepared),
                policy: policy.clone(),
                holds: Arc::clone(&bound.holds),
            });
            RedisTicket(Charged::Remote(Box::new(Remote {
                state_key,
                refusal: bound.refusal_hash(check.key),
                charges,
                slots,
            })))
        });
        Ok(Verdict { decision, ticket })
    }
}
