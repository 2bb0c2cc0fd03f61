//! [`Store`] for [`RedisStore`]: binding, and the checks answered here; each operation that
//! calls Redis lives in its own file (`check`, `leased`, `settle`, `release`).

mod check;
mod leased;
mod release;
mod settle;

use super::*;

impl Store for RedisStore {
    type Bound = RedisPolicy;
    type Ticket = RedisTicket;

    fn bind(&self, policy: &Policy) -> Result<RedisPolicy, ConfigError> {
        self.bind_replacing(None, policy, Carry::StartFull)
    }

    /// Binds `policy` in place of `old`: see [`Store::rebind`], and the `rebind` module for
    /// what each kind of state keeps.
    fn rebind(
        &self,
        old: &RedisPolicy,
        policy: &Policy,
        carry: Carry,
    ) -> Result<RedisPolicy, ConfigError> {
        self.bind_replacing(Some(old), policy, carry)
    }

    /// Answers at once the checks this process holds a refusal for (see
    /// [`RedisStoreBuilder::local_refusals`]), and in lease mode those its block of the key
    /// covers (see [`Lease`]); `None` for the others, which ask Redis.
    fn check_sync(
        &self,
        bound: &RedisPolicy,
        check: Check<'_>,
    ) -> Option<Result<Verdict<RedisTicket>, StoreError>> {
        if let Some(verdict) = bound.local_refusal(&self.inner, &check) {
            return Some(Ok(verdict));
        }
        let leases = bound.leases.as_ref().filter(|_| leases_check(&check))?;
        let now = self.inner.settings.clock.as_ref().map(AnyClock::now);
        let (decision, granted) = leases.spend_key(check.key, check.cost, now)?;
        Some(Ok(Verdict { decision, ticket: granted.and_then(|g| bound.lease_ticket(&check, g)) }))
    }

    async fn check(
        &self,
        bound: &RedisPolicy,
        check: Check<'_>,
    ) -> Result<Verdict<RedisTicket>, StoreError> {
        self.check_on_redis(bound, check).await
    }

    async fn settle(
        &self,
        bound: &RedisPolicy,
        ticket: RedisTicket,
        cost: u64,
    ) -> Result<(), StoreError> {
        self.settle_on_redis(bound, ticket, cost).await
    }

    /// Settles single tiers, as [`MemoryStore`] does, whatever the policy's tiers (see
    /// `settle_tiers_on_redis`).
    async fn settle_tiers(
        &self,
        bound: &RedisPolicy,
        ticket: &mut RedisTicket,
        costs: &[(usize, u64)],
    ) -> Result<(), StoreError> {
        self.settle_tiers_on_redis(bound, ticket, costs).await
    }

    async fn release(&self, bound: &RedisPolicy, ticket: RedisTicket) -> Result<(), StoreError> {
        self.release_on_redis(bound, ticket).await
    }

    async fn refresh(&self, bound: &RedisPolicy, ticket: &RedisTicket) -> Result<bool, StoreError> {
        self.refresh_on_redis(bound, ticket).await
    }

    fn refresh_every(&self, bound: &RedisPolicy) -> Option<Duration> {
        bound.policy.tiers().iter().filter_map(|t| t.concurrency()).map(|c| c.refresh_every()).min()
    }
}

/// Whether a check on a leasing binding takes units from a block: a policing check of a cost
/// above 0 on every tier.
pub(super) fn leases_check(check: &Check<'_>) -> bool {
    check.cost > 0 && check.max_delay.is_none() && check.costs.iter().all(|c| *c == check.cost)
}
