//! [`RedisPolicy`]: a policy bound to a [`RedisStore`], its local refusals and leases.

use super::*;

/// A policy bound to a [`RedisStore`] ([`Store::bind`]): validated for the scripts, with its key
/// prefix and its part of every script call rendered, and bound to the local fallback store.
pub struct RedisPolicy {
    pub(super) policy: Policy,
    /// The state key's parts around the key: `{prefix}{{policy}|` and `}:{fingerprint}`.
    pub(super) key_parts: (String, String),
    pub(super) key_names: KeyNames,
    pub(super) prepared: Arc<Prepared>,
    /// The typical hold of each concurrency tier, learnt from this binding's releases.
    pub(super) holds: Arc<Holds>,
    pub(super) local: Option<MemoryPolicy>,
    /// Refusals answered without asking Redis (see [`RedisStoreBuilder::local_refusals`]);
    /// shared with the leases' give-backs (see [`lease::Back`]).
    pub(super) refusals: Option<Arc<Refusals>>,
    /// Blocks of hot keys held by this process (see [`Lease`]).
    pub(super) leases: Option<Arc<Leases>>,
}

impl fmt::Debug for RedisPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisPolicy")
            .field("policy", &self.policy.name())
            .field("key_prefix", &self.key_parts.0)
            .finish_non_exhaustive()
    }
}

impl RedisPolicy {
    /// The policy.
    #[must_use]
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The Redis key of the state of `key` (for inspection: `TTL`, `EXISTS`): by default
    /// `{prefix}{{policy}|#{hash}}:{fingerprint}`, with the keyed hash of `key` (see
    /// [`RedisStoreBuilder::key_secret`]), or with the key itself under
    /// [`raw_keys`](RedisStoreBuilder::raw_keys). Sliding-log policies also use `{this}:z1`,
    /// `{this}:z2`, ... per rate tier; a concurrency tier keeps its slots, and a penalty box
    /// its block, under the same name less `:{fingerprint}`, plus `:c:{tier}` or `:p:{tier}`.
    ///
    /// ```
    /// use tollgate::key::Key;
    /// use tollgate::store::{RedisStore, Store};
    /// use tollgate::{Policy, Quota};
    ///
    /// # fn main() -> Result<(), tollgate::ConfigError> {
    /// let policy = Policy::single("api", Quota::per_second(10))?;
    /// let store = RedisStore::builder("redis://127.0.0.1:6380/").key_secret("s3cr3t").build()?;
    /// let name = store.bind(&policy)?.state_key(&Key::text("sk_live_SECRET"));
    /// // `tollgate:{api|#` 32 hexadecimal digits `}:` the policy's fingerprint (8 digits).
    /// assert!(name.starts_with("tollgate:{api|#") && !name.contains("SECRET"));
    /// assert_eq!(name.len(), "tollgate:{api|#}:".len() + 32 + 8);
    ///
    /// let debug = RedisStore::builder("redis://127.0.0.1:6380/").raw_keys().build()?;
    /// let name = debug.bind(&policy)?.state_key(&Key::text("alice"));
    /// assert!(name.starts_with("tollgate:{api|s5:alice}:"));
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn state_key(&self, key: &Key) -> String {
        script::state_key(&self.key_parts, &self.key_names, key)
    }

    /// Checks of this binding answered by this process without asking Redis, as refusals
    /// Redis made earlier that still hold (see [`RedisStoreBuilder::local_refusals`]). A
    /// count since the binding was made.
    #[must_use]
    pub fn refused_locally(&self) -> u64 {
        self.refusals.as_deref().map_or(0, Refusals::answered)
    }

    /// Refusals this binding holds now, at most the capacity given to
    /// [`RedisStoreBuilder::local_refusals`] (ended ones count until they are looked up or
    /// evicted).
    #[must_use]
    pub fn local_refusals(&self) -> usize {
        self.refusals.as_deref().map_or(0, Refusals::len)
    }

    /// The lease mode this binding runs in, if any (see [`Lease`]).
    #[must_use]
    pub fn lease(&self) -> Option<Lease> {
        self.leases.as_ref().map(|l| l.config())
    }

    /// What this binding's leases have done since it was made (all zeros without lease mode).
    #[must_use]
    pub fn lease_stats(&self) -> LeaseStats {
        self.leases.as_ref().map(|l| l.stats()).unwrap_or_default()
    }

    /// Keys this binding holds a lease slot for now (a block, or the history that sizes the
    /// next one; at most 4,096, beyond which keys are checked exactly).
    #[must_use]
    pub fn leased_keys(&self) -> usize {
        self.leases.as_ref().map_or(0, |l| l.len())
    }

    /// Gives back to Redis now the unspent units of every block that ended (the sweeper does
    /// so every lease lifetime by itself).
    pub async fn return_ended_leases(&self) {
        if let Some(l) = &self.leases {
            l.sweep().await;
        }
    }

    /// For a check that asked for one, the ticket of `check.cost` units taken from a block
    /// Redis granted at `granted` (nanoseconds): settled in Redis like an exact charge made
    /// then, since that is when Redis charged them.
    pub(super) fn lease_ticket(&self, check: &Check<'_>, granted: u64) -> Option<RedisTicket> {
        if !check.ticket {
            return None;
        }
        let at = granted / self.policy.unit();
        let charges =
            self.policy.tiers().iter().map(|_| Charge { at, cost: check.cost, id: 0 }).collect();
        Some(RedisTicket(Charged::Remote(Box::new(Remote {
            state_key: self.state_key(check.key),
            refusal: self.refusal_hash(check.key),
            charges,
            slots: None,
        }))))
    }

    /// The hash a ticket keeps to forget its key's refusal when it gives charges back.
    pub(super) fn refusal_hash(&self, key: &Key) -> u64 {
        self.refusals.as_ref().map_or(0, |r| r.hash(key))
    }

    /// Forgets the refusal of the key of `hash` now and again when the guard is dropped: a
    /// settlement or release through this process, made while the guard lives, may give
    /// units back (or, settling up, move the key's clock guard: see [`Refusals::forget`]).
    pub(super) fn forgetting<'a>(&'a self, inner: &'a Inner, hash: u64) -> Forgetting<'a> {
        forgetting(self.refusals.as_deref(), inner, hash)
    }

    /// Read before a check is sent, for [`learn`](Self::learn).
    pub(super) fn refusal_epoch(&self, key: &Key) -> u64 {
        self.refusals.as_ref().map_or(0, |r| r.epoch(key))
    }

    /// The refusal this process holds for `check`, counted down to now.
    pub(super) fn local_refusal(
        &self,
        inner: &Inner,
        check: &Check<'_>,
    ) -> Option<Verdict<RedisTicket>> {
        let refusals = self.refusals.as_ref()?;
        let now = inner.settings.clock.as_ref().map(AnyClock::now);
        let decision = refusals.answer(&self.policy, check, now)?;
        Some(Verdict { decision, ticket: None })
    }

    /// Keeps (or drops) `check`'s refusal after Redis decided it at `at`; `epoch` is
    /// [`refusal_epoch`](Self::refusal_epoch) read before it was sent.
    pub(super) fn learn(
        &self,
        check: &Check<'_>,
        decision: &Decision,
        at: u64,
        sent: Option<Instant>,
        epoch: u64,
    ) {
        if let Some(r) = &self.refusals {
            r.learn(&self.policy, check, decision, at, sent, epoch);
        }
    }
}

/// Forgets the refusal of the key of `hash` in `refusals` now and again when the guard is
/// dropped ([`RedisPolicy::forgetting`]; the leases' give-backs call it too, see
/// [`lease::Back`]).
pub(super) fn forgetting<'a>(
    refusals: Option<&'a Refusals>,
    inner: &'a Inner,
    hash: u64,
) -> Forgetting<'a> {
    let clock = inner.settings.clock.as_ref();
    if let Some(r) = refusals {
        r.forget(hash, clock.map(AnyClock::now));
    }
    Forgetting { refusals, clock, hash }
}

/// Forgets a key's local refusal again when dropped ([`RedisPolicy::forgetting`]).
pub(super) struct Forgetting<'a> {
    pub(super) refusals: Option<&'a Refusals>,
    /// The injected clock, if any.
    pub(super) clock: Option<&'a AnyClock>,
    pub(super) hash: u64,
}

impl Drop for Forgetting<'_> {
    fn drop(&mut self) {
        if let Some(r) = self.refusals {
            r.forget(self.hash, self.clock.map(AnyClock::now));
        }
    }
}

impl RedisStore {
    /// The leases of `policy` as the builder configured them: `None` without lease mode, or
    /// for a policy that cannot lease under [`RedisStoreBuilder::lease`] (it stays exact).
    ///
    /// # Errors
    /// [`ConfigError::UnsupportedByStore`] for a policy named by
    /// [`RedisStoreBuilder::lease_policy`] that cannot lease.
    pub(super) fn leases_for(
        &self,
        policy: &Policy,
        key_parts: &(String, String),
        prepared: &Arc<Prepared>,
        refusals: Option<&Arc<Refusals>>,
    ) -> Result<Option<Arc<Leases>>, ConfigError> {
        let inner = &self.inner;
        let (config, named) = match inner.lease_policies.get(policy.name()) {
            Some(l) => (*l, true),
            None => match inner.lease {
                Some(l) => (l, false),
                None => return Ok(None),
            },
        };
        if let Some((tier, reason)) = lease::unleasable(policy) {
            if named {
                return Err(ConfigError::UnsupportedByStore { store: "RedisStore", tier, reason });
            }
            tracing::info!(policy = policy.name(), %tier, %reason, "tollgate: this policy is checked exactly");
            return Ok(None);
        }
        let mut leases = Leases::new(policy, config);
        leases.back = Some(lease::Back {
            inner: Arc::clone(inner),
            prepared: Arc::clone(prepared),
            key_parts: key_parts.clone(),
            key_names: inner.key_names,
            refusals: refusals.cloned(),
        });
        Ok(Some(Arc::new(leases)))
    }
}
