//! Settlements: a ticket's cost changed after the response, on every tier or on some.

use super::*;

impl RedisStore {
    pub(super) async fn settle_on_redis(
        &self,
        bound: &RedisPolicy,
        ticket: RedisTicket,
        cost: u64,
    ) -> Result<(), StoreError> {
        let inner = &*self.inner;
        match ticket.0 {
            Charged::Local(ticket) => {
                if let (Some(local), Some(local_bound)) = (&inner.fallback, &bound.local) {
                    local.settle_now(local_bound, ticket, cost);
                }
                Ok(())
            }
            Charged::Remote(mut remote) => {
                let _forgetting = bound.forgetting(inner, remote.refusal);
                let slots = remote.slots.take();
                // Each tier from what it was charged (single tiers may have been settled).
                let new: SmallVec<[u64; 4]> = bound
                    .policy
                    .tiers()
                    .iter()
                    .zip(&remote.charges)
                    .map(|(t, c)| match t.kind {
                        Kind::Concurrency(_) => c.cost,
                        _ => cost,
                    })
                    .collect();
                let changed = remote.charges.iter().zip(&new).any(|(c, n)| c.cost != *n);
                if !changed && slots.is_none() {
                    return Ok(());
                }
                let state_key = std::mem::take(&mut remote.state_key);
                let kept = slots.as_ref().map(|_| state_key.clone());
                let settled = settle_remote(
                    inner,
                    &bound.prepared,
                    &bound.policy,
                    &bound.holds,
                    state_key,
                    &remote.charges,
                    &new,
                    slots.is_some(),
                )
                .await;
                // The slots, at least, are released later (see `release`); the units'
                // settlement is not sent twice.
                if let (Err(_), Some(slots), Some(state_key)) = (&settled, slots, kept) {
                    slots.release_later(state_key, remote.charges.clone());
                }
                settled
            }
        }
    }

    /// Settles single tiers, as [`MemoryStore`] does, whatever the policy's tiers (a policy of
    /// request rates is the case of every tier charged the same cost).
    pub(super) async fn settle_tiers_on_redis(
        &self,
        bound: &RedisPolicy,
        ticket: &mut RedisTicket,
        costs: &[(usize, u64)],
    ) -> Result<(), StoreError> {
        let inner = &*self.inner;
        let remote = match &mut ticket.0 {
            Charged::Local(ticket) => {
                if let (Some(local), Some(local_bound)) = (&inner.fallback, &bound.local) {
                    local.settle_tiers_now(local_bound, ticket, costs);
                }
                return Ok(());
            }
            Charged::Remote(remote) => remote,
        };
        let _forgetting = bound.forgetting(inner, remote.refusal);
        let tiers = bound.policy.tiers();
        let target = |i: usize| costs.iter().rev().find(|(t, _)| *t == i).map(|(_, c)| *c);
        let new: SmallVec<[u64; 4]> = tiers
            .iter()
            .zip(&remote.charges)
            .enumerate()
            .map(|(i, (t, c))| match t.kind {
                Kind::Concurrency(_) => c.cost,
                _ => target(i).unwrap_or(c.cost),
            })
            .collect();
        if remote.charges.iter().zip(&new).all(|(c, n)| c.cost == *n) {
            return Ok(());
        }
        let (state_key, charges) = (remote.state_key.clone(), &remote.charges);
        let (prepared, holds) = (&bound.prepared, &bound.holds);
        settle_remote(inner, prepared, &bound.policy, holds, state_key, charges, &new, false)
            .await?;
        for (c, n) in remote.charges.iter_mut().zip(&new) {
            c.cost = *n;
        }
        Ok(())
    }
}
