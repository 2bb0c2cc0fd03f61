//! [`RedisStoreBuilder`]: a [`RedisStore`]'s settings, checked by `build`.

use super::*;

/// Configures a [`RedisStore`], made by [`RedisStore::builder`], [`RedisStore::cluster_builder`]
/// or [`RedisStore::sentinel_builder`]. Setters only collect values, and [`build`](Self::build)
/// checks them, failing with [`ConfigError::Invalid`] naming the setting.
///
/// ```
/// use std::time::Duration;
/// use tollgate::store::RedisStore;
/// use tollgate::ConfigError;
///
/// // Building connects nothing: the store connects on its first check.
/// let store = RedisStore::builder("redis://127.0.0.1:6380/")
///     .prefix("myapp:")
///     .timeout(Duration::from_millis(50))
///     .build();
/// assert!(store.is_ok());
///
/// let err = RedisStore::builder("redis://127.0.0.1:6380/").prefix("{bad}").build().unwrap_err();
/// assert!(matches!(err, ConfigError::Invalid { setting: "prefix", .. }));
/// ```
#[must_use]
pub struct RedisStoreBuilder {
    /// The server's URL, the Cluster's seeds, or the sentinels.
    pub(super) nodes: Vec<String>,
    pub(super) cluster: bool,
    /// The master's name, through Redis Sentinel.
    pub(super) sentinel: Option<String>,
    /// How to connect to the servers the sentinels name.
    pub(super) master_url: Option<String>,
    pub(super) prefix: String,
    /// The secret state keys are hashed with; `None` names them by the raw key.
    pub(super) key_secret: Option<Vec<u8>>,
    pub(super) clock: Option<AnyClock>,
    pub(super) timeout: Duration,
    pub(super) ttl_grace: Duration,
    pub(super) threshold: u32,
    pub(super) open_for: Duration,
    pub(super) fallback: Option<MemoryStore>,
    pub(super) local_refusals: usize,
    pub(super) lease: Option<Lease>,
    pub(super) lease_policies: HashMap<String, Lease>,
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("cluster", &self.cluster)
            .field("sentinel", &self.sentinel)
            .field("prefix", &self.prefix)
            .field("raw_keys", &self.key_secret.is_none())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl RedisStoreBuilder {
    pub(super) fn new(nodes: Vec<String>, cluster: bool) -> Self {
        Self {
            nodes,
            cluster,
            sentinel: None,
            master_url: None,
            prefix: "tollgate:".to_owned(),
            key_secret: Some(script::DEFAULT_KEY_SECRET.to_vec()),
            clock: None,
            timeout: Duration::from_millis(100),
            ttl_grace: Duration::ZERO,
            threshold: 5,
            open_for: Duration::from_millis(500),
            fallback: Some(MemoryStore::new()),
            local_refusals: DEFAULT_LOCAL_REFUSALS,
            lease: None,
            lease_policies: HashMap::new(),
        }
    }

    /// The scheme (`redis`, or `rediss` for TLS), user, password and database number with which
    /// to connect to the servers Redis Sentinel names ([`RedisStore::sentinel_builder`]), as a
    /// URL (`redis://user:password@master/2`; its host and port are not used, the sentinels
    /// give them). By default, plain TCP, no password, database 0. [`build`](Self::build) fails
    /// with [`ConfigError::Invalid`] on `master_url` when the `redis` crate cannot parse `url`,
    /// or when the store is not built with [`RedisStore::sentinel_builder`].
    pub fn master_url(mut self, url: impl Into<String>) -> Self {
        self.master_url = Some(url.into());
        self
    }

    /// Prefix of every key (default `"tollgate:"`). Must not contain `{` or `}` (they would
    /// end the hash tag).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The secret that Redis key names hash keys with (any length; give at least 16 random
    /// bytes). State keys carry `#` and a keyed hash of the key (SipHash-2-4, 128 bits, 32
    /// hexadecimal digits) instead of the key, so whoever can `SCAN` or `MONITOR` Redis, or read
    /// its RDB or AOF files, does not read API keys and user ids.
    ///
    /// **Every node of a fleet must use the same secret**: nodes with different secrets name a
    /// key differently, so they stop sharing its budget (each secret then admits the limit on
    /// its own). Changing it, like changing a policy, starts every key afresh.
    ///
    /// The default is a fixed, documented value (the 16 ASCII bytes `tollgate:default`), so a
    /// fleet that sets none still shares budgets. It hides keys from casual reading but not from
    /// someone who knows the default and guesses keys (short user ids, addresses): set a secret
    /// of your own, kept like a password. Overrides [`raw_keys`](Self::raw_keys).
    ///
    /// ```
    /// use tollgate::store::RedisStore;
    ///
    /// # fn main() -> Result<(), tollgate::ConfigError> {
    /// let secret = std::env::var("TOLLGATE_KEY_SECRET").unwrap_or_else(|_| "dev-only".into());
    /// let store = RedisStore::builder("redis://127.0.0.1:6380/").key_secret(secret).build()?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn key_secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.key_secret = Some(secret.as_ref().to_vec());
        self
    }

    /// Names Redis keys by the key itself, `{prefix}{{policy}|{key}}:{fingerprint}` with the
    /// key's `Display` form (`s5:alice`, `ip:203.0.113.7`), instead of its keyed hash, for
    /// debugging on a Redis nobody else reads. Overrides [`key_secret`](Self::key_secret).
    ///
    /// The keys then appear in `SCAN`, `MONITOR` and RDB files. Nodes with raw keys and nodes
    /// with hashed keys do not share budgets.
    pub fn raw_keys(mut self) -> Self {
        self.key_secret = None;
        self
    }

    /// Decides at this clock's instants instead of the Redis server's `TIME` (the default), for
    /// deterministic tests with a [`FakeClock`](crate::clock::FakeClock). Every instance must
    /// then share one time base.
    ///
    /// Keys still expire on Redis's clock, so give a [`ttl_grace`](Self::ttl_grace) that covers
    /// the drift between the two. The default fallback store decides on this clock too.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        let clock = AnyClock::new(clock);
        if self.fallback.is_some() {
            self.fallback = Some(MemoryStore::builder().any_clock(clock.clone()).assembled());
        }
        self.clock = Some(clock);
        self
    }

    /// How long a check waits for a server that does not answer, counted from the moment it is
    /// made, time queued behind other checks and connecting included (default 100 ms; at least
    /// 1 ms). A check then returns [`StoreError::Timeout`] (and is decided by the fallback, if
    /// any).
    ///
    /// # How it works
    ///
    /// While the server keeps answering, a check late only because this machine is busy waits
    /// for its turn, up to ten times this (see [`RedisStore`], "Timeouts, per check"). The
    /// circuit breaker counts a script call as failed when the server has not replied within
    /// twice this of its sending. [`RedisStore::connect`], reading a Cluster's slots and, on
    /// first use, asking Redis Sentinel for the master each take at most this (a check made
    /// before the sentinels answered waits for them within its own timeout); later, each
    /// sentinel is given twice this to answer.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Extra time keys live past the instant their state is back to full (default 0: server
    /// time and key expiry share Redis's clock). Rounded up to milliseconds.
    pub fn ttl_grace(mut self, grace: Duration) -> Self {
        self.ttl_grace = grace;
        self
    }

    /// Opens a server's circuit breaker after `failure_threshold` consecutive failed calls
    /// (default 5; at least 1) and keeps it open for `open_for` (default 500 ms; at least 1 ms)
    /// before probing the server with one call.
    pub fn circuit_breaker(mut self, failure_threshold: u32, open_for: Duration) -> Self {
        self.threshold = failure_threshold;
        self.open_for = open_for;
        self
    }

    /// Decides on this local store while a server fails or its breaker is open (the default is
    /// a new [`MemoryStore`]). Each instance then enforces the policy on its own, so a fleet of
    /// `n` admits up to `n` times the limit until Redis answers again. Charges made locally are
    /// settled locally.
    pub fn fallback(mut self, local: MemoryStore) -> Self {
        self.fallback = Some(local);
        self
    }

    /// No local fallback: a check Redis cannot decide returns a [`StoreError`], which the
    /// layer turns into 503 or, by explicit choice, lets through
    /// ([`OnStoreError`](crate::OnStoreError)).
    pub fn no_fallback(mut self) -> Self {
        self.fallback = None;
        self
    }

    /// How many refusals each policy bound to the store keeps in this process (default
    /// 4,096; 0 turns them off). A key Redis refused until an instant is then refused here,
    /// with no call to Redis, until that instant: a key under attack costs Redis one call per
    /// refusal period per instance, not one per request.
    ///
    /// **Exact.** The answer is the decision Redis gave, every duration counted down from the
    /// instant Redis made it, which is the decision Redis makes at each instant until then as
    /// long as only time passes: a refusal is kept only until the first instant any part of
    /// it could change (a refused tier's own `retry_after`, the end of a fixed or calendar
    /// window, the instant a GCRA tier's `remaining` grows), and only for checks asking the
    /// same (cost, costs per tier, shaping budget, priority class). Policies with tiers whose
    /// `remaining` grows at instants a decision does not tell (token and leaky buckets, sliding
    /// windows and logs, when they are neither full nor refusing a cost of 1) keep no such
    /// refusal. With Redis
    /// time (the default), now is the server's instant of the decision plus the time since the
    /// check was sent, never earlier than the server's clock, so a refusal ends here at its
    /// instant or a round trip early, never late. With an injected [`clock`](Self::clock), a
    /// decision made at an instant before one already seen (a check's, or a settlement's or
    /// give-back's through this binding: the clock stepped back) is not kept: Redis may then
    /// decide at the key's last charge, later than now (a charge through another instance
    /// is not seen here: as below, the refusal then counts down where Redis's stands still
    /// until the clock gets back to that charge). If the server's
    /// clock steps back behind a key's last charge (a failover to a replica whose clock is
    /// behind), a kept refusal still ends no later than Redis's, but its durations count down
    /// where Redis's stand still until the clock catches up.
    ///
    /// **Other instances.** They can only spend more of a key, which keeps a refusal true (a
    /// client retrying after `retry_after` may then be refused by Redis again, as after any
    /// refusal). What this instance gives back (a settlement, a refund, a released ticket, the
    /// unspent rest of a [lease](Lease) block) forgets the key's refusal; what another
    /// instance gives back cannot be seen here, so a refusal may outlast a refund made
    /// elsewhere by at most its `retry_after`. Reloading a policy binds it anew, with no
    /// refusal kept.
    ///
    /// **Not kept** for policies with a concurrency tier (a slot released on another instance
    /// frees the key before `retry_after`) or a penalty box (a refusal outside a block counts
    /// as a breach in Redis, which a local answer would not count), for decisions of the local
    /// fallback, and for rejections of a cost above capacity (not refusals until an instant).
    ///
    /// **Memory.** At most `capacity` entries per binding, each about 250 bytes plus the key's
    /// text (the default holds about 1 MB per policy at most), in 16 shards of `capacity / 16`
    /// (rounded up): a full shard evicts an ended entry, or else a random one, so a flood of
    /// distinct refused keys replaces entries and never grows memory. Checks of a binding
    /// with no refusal held cost one atomic load. [`RedisPolicy::refused_locally`] counts the
    /// checks answered here.
    pub fn local_refusals(mut self, capacity: usize) -> Self {
        self.local_refusals = capacity;
        self
    }

    /// Lease mode for the policy named `policy` (see [`Lease`]), overriding
    /// [`lease`](Self::lease) for that policy. Binding the policy fails with
    /// [`ConfigError::UnsupportedByStore`], naming the tier, when a tier cannot lease.
    ///
    /// This instance takes blocks of a key's budget from Redis in one call and spends them
    /// locally. Instances in lease mode and in exact mode share one budget.
    ///
    /// Rate tiers of GCRA, the token and leaky buckets and the fixed window lease, beside
    /// calendar tiers. A tier cannot lease when it is a sliding window or log, a concurrency
    /// tier, a penalty box or a reserve, or a tier counting other units than requests.
    ///
    /// A name that no policy bound to the store uses by the store's first check (a misspelling:
    /// `"serch"` for a policy named `"search"`) leases nothing: it is logged once at `warn`,
    /// naming it and the policies bound, and counted once in
    /// `tollgate_config_warnings_total{policy="serch",setting="lease_policy"}` (feature
    /// `metrics`). It cannot be an error: the store does not know at build time which policies
    /// will be bound to it, nor at one binding whether another will follow. Bind every policy
    /// (build every layer) before the first check.
    pub fn lease_policy(mut self, policy: impl Into<String>, lease: Lease) -> Self {
        self.lease_policies.insert(policy.into(), lease);
        self
    }

    /// Lease mode for every policy bound to the store that can lease (see [`Lease`]); the
    /// others stay exact (logged at `info` when bound).
    pub fn lease(mut self, lease: Lease) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Builds the store. Connects nothing yet.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the setting: `url` (none, several for a standalone
    /// server, or one the `redis` crate cannot parse), `master_name` (empty), `master_url` (one
    /// the `redis` crate cannot parse, or given without Sentinel), `prefix` (with `{` or `}`),
    /// `timeout` (under 1 ms), `circuit_breaker` (a threshold of 0 or an open period under
    /// 1 ms), `key_secret` (empty), `lease` (a block of 0 units or a lifetime under 1 ms).
    pub fn build(self) -> Result<RedisStore, ConfigError> {
        let key_names = self.validate()?;
        let infos = self
            .nodes
            .iter()
            .map(|url| {
                url.as_str().into_connection_info().map_err(|e| invalid("url", e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let servers = self.sentinel_servers()?;
        let settings = Arc::new(Settings {
            timeout: self.timeout,
            clock: self.clock,
            threshold: self.threshold,
            open_for: self.open_for,
            fallback: self.fallback.is_some(),
            io: io::Io::new(),
        });
        let topology = topology(self.cluster, self.sentinel.as_deref(), infos, servers, &settings)?;
        Ok(RedisStore {
            inner: Arc::new(Inner {
                topology,
                settings,
                prefix: self.prefix.into(),
                key_names,
                grace_ms: duration_to_nanos(self.ttl_grace).div_ceil(1_000_000),
                fallback: self.fallback,
                refusals: self.local_refusals,
                lease: self.lease,
                lease_policies: self.lease_policies,
                bound_names: std::sync::Mutex::default(),
                lease_names_checked: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }

    /// Checks the settings that need no server address (leases, prefix, key secret, timeout,
    /// circuit breaker), in that order: how keys are named.
    fn validate(&self) -> Result<KeyNames, ConfigError> {
        for lease in self.lease.iter().chain(self.lease_policies.values()) {
            lease.validate()?;
        }
        if self.prefix.contains(['{', '}']) {
            return Err(invalid(
                "prefix",
                format!("{:?} must not contain `{{` or `}}` (they end the hash tag)", self.prefix),
            ));
        }
        let key_names = match &self.key_secret {
            Some(secret) if secret.is_empty() => {
                return Err(invalid("key_secret", "must not be empty".into()));
            }
            Some(secret) => KeyNames::Hashed(script::derive_secret(secret)),
            None => KeyNames::Raw,
        };
        if self.timeout < Duration::from_millis(1) {
            return Err(invalid("timeout", "must be at least 1 ms".into()));
        }
        if self.threshold == 0 || self.open_for < Duration::from_millis(1) {
            return Err(invalid(
                "circuit_breaker",
                "the threshold must be at least 1 and the open period at least 1 ms".into(),
            ));
        }
        Ok(key_names)
    }

    /// The master's connection settings for a Sentinel store (from `master_url`), checking the
    /// master's name and that `master_url` is given to a Sentinel store only.
    fn sentinel_servers(&self) -> Result<SentinelNodeConnectionInfo, ConfigError> {
        match (&self.sentinel, &self.master_url) {
            (Some(name), _) if name.is_empty() => {
                Err(invalid("master_name", "must not be empty".into()))
            }
            (None, Some(_)) => Err(invalid(
                "master_url",
                "is for a store built with RedisStore::sentinel_builder".into(),
            )),
            (_, Some(url)) => {
                let info = url
                    .as_str()
                    .into_connection_info()
                    .map_err(|e| invalid("master_url", e.to_string()))?;
                Ok(sentinel::servers(info))
            }
            (_, None) => Ok(SentinelNodeConnectionInfo::default()),
        }
    }
}

/// A [`ConfigError::Invalid`] of `setting`.
fn invalid(setting: &'static str, reason: String) -> ConfigError {
    ConfigError::Invalid { setting, reason }
}

/// Where the store sends its calls: a Cluster from its seeds `infos`, a master found through
/// the sentinels `infos` (named `sentinel`), or the one server of `infos`.
fn topology(
    cluster: bool,
    sentinel: Option<&str>,
    infos: Vec<ConnectionInfo>,
    servers: SentinelNodeConnectionInfo,
    settings: &Arc<Settings>,
) -> Result<Topology, ConfigError> {
    Ok(match (cluster, infos.as_slice()) {
        (_, []) => return Err(invalid("url", "no redis url given".into())),
        (false, _) if sentinel.is_some() => {
            let name = sentinel.unwrap_or_default();
            let watched = sentinel::Watched::new(name, infos, servers, Arc::clone(settings))
                .map_err(|e| invalid("url", e.to_string()))?;
            Topology::Sentinel(Arc::new(watched))
        }
        (false, [info]) => {
            let client =
                redis::Client::open(info.clone()).map_err(|e| invalid("url", e.to_string()))?;
            Topology::Single(Arc::new(Node::new(
                addr_of(info).into(),
                client,
                Arc::clone(settings),
            )))
        }
        (false, _) => return Err(invalid("url", "a standalone redis takes one url".into())),
        (true, _) => Topology::Cluster(Cluster {
            seeds: infos,
            map: RwLock::new(None),
            nodes: RwLock::new(HashMap::new()),
            refreshing: tokio::sync::Mutex::new(()),
        }),
    })
}
