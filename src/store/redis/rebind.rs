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

use std::sync::{Arc, PoisonError};

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
        if !inner.lease_policies.is_empty() {
            let mut names = inner.bound_names.lock().unwrap_or_else(PoisonError::into_inner);
            names.insert(policy.name().to_owned());
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

#[cfg(test)]
mod tests {
    use super::script::{
        DEFAULT_KEY_SECRET, KeyNames, Prepared, derive_secret, hash_tag, key_parts, state_key,
    };
    use crate::key::Key;
    use crate::policy::Policy;
    use crate::quota::{Concurrency, Quota};

    #[test]
    fn concurrency_tiers_keep_their_sets_and_the_state_key_by_name() {
        let policy = |max: u64, name: &str| {
            Policy::builder("api")
                .tier("a", Quota::per_minute(10))
                .concurrency(name, Concurrency::new(max))
                .build()
                .unwrap()
        };
        let parts = |p: &Policy| key_parts("", p);
        let keys = |p: &Policy| Prepared::new(p, 0).keys("p{api|k}:0123abcd".into());
        // Another max keeps the state key and the set of slots; another name another set.
        assert_eq!(parts(&policy(4, "c")), parts(&policy(8, "c")));
        assert_eq!(keys(&policy(4, "c")), ["p{api|k}:0123abcd", "p{api|k}:c:c"]);
        assert_eq!(keys(&policy(8, "c")), keys(&policy(4, "c")));
        assert_eq!(keys(&policy(4, "in{flight}"))[1], "p{api|k}:c:in%7Bflight%7D");
        // The rate tiers' quotas name the state key.
        let faster = Policy::builder("api")
            .tier("a", Quota::per_minute(20))
            .concurrency("c", Concurrency::new(4))
            .build()
            .unwrap();
        assert_ne!(parts(&faster), parts(&policy(4, "c")));
        // The names beside a state key with a hashed key, as `state_key` makes it.
        let names = KeyNames::Hashed(derive_secret(DEFAULT_KEY_SECRET));
        let state = state_key(&key_parts("t:", &faster), &names, &Key::Global);
        let set = &Prepared::new(&faster, 0).keys(state.clone())[1];
        assert_eq!(set, &format!("{}:c:c", &state[..state.len() - 9]));
        assert!(set.ends_with("}:c:c") && hash_tag(set) == hash_tag(&state));
    }
}
