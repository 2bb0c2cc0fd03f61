//! Reloads on a [`RedisStore`]: a binding that replaces another ([`Store::rebind`]).
//!
//! What a key keeps is decided by where its state lives, which is the same for every instance
//! of a fleet, whenever each reloads:
//! - the rate and calendar tiers live in the state key, named by the policy's fingerprint
//!   (its algorithm and time unit, and each rate and calendar tier's count, period, burst,
//!   calendar and reserve, in order; not the tiers' names nor what they count; see
//!   `script::key_parts`): a reload that keeps them keeps every key's state, one that changes
//!   any of them starts them all afresh;
//! - the slots held of a concurrency tier, and the block and breaches of a penalty box, live
//!   in keys named by the policy, the key and the tier (`Prepared::keys`): any definition of a
//!   tier of that name finds them.

use std::sync::Arc;

use super::script::{self, Prepared};
use super::{Holds, RedisPolicy, RedisStore, Refusals};
use crate::error::ConfigError;
use crate::policy::Policy;
use crate::store::Carry;

impl RedisStore {
    /// Binds `policy`, in place of `old` when there is one (a reload). Besides what the keys'
    /// names keep (see the module docs), when the state keys and what the checks send are the
    /// old binding's (a tier renamed), so is what this process holds of them: the blocks it
    /// leases ([`Lease`](super::Lease); it then never holds more than one block of a key,
    /// across the reload too), the refusals it answers itself, and the typical holds it
    /// learnt. The local fallback's binding carries its state as a
    /// [`MemoryStore`](crate::store::MemoryStore) does.
    pub(super) fn bind_replacing(
        &self,
        old: Option<&RedisPolicy>,
        policy: &Policy,
        carry: Carry,
    ) -> Result<RedisPolicy, ConfigError> {
        script::validate(policy)?;
        let inner = &self.inner;
        let key_parts = script::key_parts(&inner.prefix, policy);
        let prepared = Arc::new(Prepared::new(policy, inner.grace_ms));
        let same_keys = old.filter(|old| {
            old.key_parts == key_parts && old.prepared.policy.args == prepared.policy.args
        });
        // The same keys, decided alike: what this process learnt of them is the new binding's
        // too. Checks of either binding spend the blocks held and take the next one alike, and
        // a refusal held of a key is forgotten when a block of it is given back.
        let (refusals, holds, leases) = match same_keys {
            Some(old) => (old.refusals.clone(), Arc::clone(&old.holds), old.leases.clone()),
            None => {
                let refusals = Refusals::new(policy, inner.refusals).map(Arc::new);
                let leases = self.leases_for(policy, &key_parts, &prepared, refusals.as_ref())?;
                (refusals, Arc::new(Holds::new(policy)), leases)
            }
        };
        if let (Some(old), None, Carry::UsedFraction) = (old, same_keys, carry) {
            tracing::warn!(
                policy = old.policy.name(),
                "tollgate: a RedisStore starts the rate and calendar tiers of a reloaded policy \
                 full when they change; it cannot carry the used fraction"
            );
        }
        let local = inner.fallback.as_ref().map(|local| match old.and_then(|o| o.local.as_ref()) {
            Some(was) => local.rebind_policy(was, policy, carry),
            None => local.bind_policy(policy),
        });
        Ok(RedisPolicy {
            policy: policy.clone(),
            key_parts,
            key_names: inner.key_names,
            prepared,
            holds,
            local,
            refusals,
            leases,
        })
    }
}
