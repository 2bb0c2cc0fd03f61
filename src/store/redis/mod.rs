//! [`RedisStore`]: limits shared by a fleet through Redis, Redis Cluster or Valkey.

mod breaker;
mod cluster;
mod cover;
mod health;
mod io;
mod lease;
mod node;
mod rebind;
mod refusals;
mod release;
mod script;
mod sentinel;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use redis::sentinel::SentinelNodeConnectionInfo;
use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo};
use tokio::sync::oneshot;

pub use breaker::BreakerState;
use cluster::SlotMap;
use lease::Leases;
pub use lease::{Lease, LeaseStats};
use node::{Item, Node, Settings};
pub use node::{ServerInfo, ServerKind};
use refusals::Refusals;
use script::{KeyNames, Prepared};

use smallvec::SmallVec;

use super::memory::{MemoryPolicy, MemoryTicket};
use super::{Carry, Check, MemoryStore, Store, Verdict};
use crate::algorithm::compiled::Kind;
use crate::algorithm::slots::{self, Holds};
use crate::algorithm::{Charge, Charges};
use crate::clock::{AnyClock, Clock, duration_to_nanos};
use crate::decision::{Decision, Source};
use crate::error::{ConfigError, StoreError};
use crate::key::Key;
use crate::policy::Policy;

/// Refusals kept per binding by default ([`RedisStoreBuilder::local_refusals`]).
const DEFAULT_LOCAL_REFUSALS: usize = 4096;

/// A [`Store`] in Redis: every instance of a service that uses the same Redis shares one limit.
///
/// - **Atomic, batched.** Checks are decided by Lua scripts (one per algorithm family, sent
///   with `EVALSHA` and reloaded on `NOSCRIPT`) that decide every tier of a request together
///   and charge all or none. Concurrent checks waiting on one connection are sent as one script
///   call that decides them in order (per Redis Cluster slot), so the script's fixed cost is
///   paid once per batch; each key's state is read and written once per call. Decisions are
///   those of [`MemoryStore`]: a differential test replays random traces through both.
/// - **Bounded cost.** Every check costs Redis a bounded amount of work whatever the quota:
///   GCRA and the buckets O(1), windows O(1), the sliding log O(log n) in the log's size (plus,
///   for an admitted request of cost c, O(c)); no script reads a whole log.
/// - **Tiers of several kinds.** Policies with concurrency or calendar tiers, or tiers counting
///   other units than requests, run on their own scripts (`lua/kinds.lua` over the rate
///   algorithm's): still one call, all tiers or none. A concurrency slot is a **lease**, one
///   member of a sorted set per slot (`...}:c:{tier}` per tier) scored by its expiry; expired
///   leases are dropped before counting, so slots of an app server that crashed come back
///   after their [lease](crate::Concurrency::with_ttl) (default 30 s). Holders refresh them
///   every third of the lease ([`Reservation::hold`](crate::Reservation::hold) does). A request
///   waiting for a slot polls, every 2 ms to 100 ms. Calendar windows are computed here (Lua has
///   no time zone data) and sent with each check: those from 60 s before this process's clock
///   to the one holding 60 s past it, and for a shaped check or a settlement the seven after
///   that (a settlement adds the window each calendar tier's charge fell in). A server clock
///   further behind fails the call (and the local fallback decides). A server clock further
///   ahead, or a key whose clock guard does (the clock stepped back), is decided there: the
///   script names the instant and the call is sent again with windows reaching it (within
///   10,000 windows).
/// - **Long horizons.** State is packed binary, instants as (seconds, units), so periods up to
///   [`MAX_SPAN`](crate::Quota::MAX_SPAN) work (yearly quotas), at the policy's
///   [`precision`](Policy::precision).
/// - **Server time.** By default the scripts read the Redis server's `TIME`, so clock skew
///   between app servers cannot loosen a limit. [`RedisStoreBuilder::clock`] uses an injected
///   [`Clock`] instead (deterministic tests). Each key remembers the instant of its last
///   charge: when the clock steps back (NTP, a failover to a replica whose clock is behind),
///   window and log tiers decide at that instant rather than reopen a window. A refused check
///   never moves it, and the in-memory store keeps the same guard, so after a step back a
///   key decides as in [`MemoryStore`].
/// - **Keys.** `{prefix}{{policy}|#{hash}}:{fingerprint}`: a string holding the state of every
///   rate and calendar tier, packed (plus one sorted set per tier for the sliding log,
///   `...:z1`, `...:z2`); a concurrency tier's slots and a penalty box live beside it under
///   the tier's name (`{prefix}{{policy}|#{hash}}:c:{tier}`, `...:p:{tier}`).
///   `{hash}` is a keyed hash of the key (SipHash-2-4, 128 bits, 32 hexadecimal digits) with
///   the deployment's [`key_secret`](RedisStoreBuilder::key_secret), so API keys and user ids
///   never appear in Redis: not in key names (`SCAN`, `MONITOR`, RDB and AOF files, slow logs)
///   nor in values, whose sorted-set members are entry and lease ids.
///   [`raw_keys`](RedisStoreBuilder::raw_keys) puts the key itself there instead, for
///   debugging. Everything that identifies the limit is inside the hash tag, so one key's tiers
///   share a Redis Cluster slot; `{`, `}`, `|` and `%` in names are percent-escaped. The
///   fingerprint changes when the policy's algorithm, unit or rate and calendar tiers change,
///   so their state starts afresh; the slots held and the penalty boxes, named by tier, are
///   kept by a reload, on every instance of a fleet whenever each reloads (see
///   [`Store::rebind`]). Every key gets a TTL equal to the time until its state is back to
///   full (plus [`ttl_grace`](RedisStoreBuilder::ttl_grace)), so idle keys vanish by
///   themselves.
/// - **Connections.** One multiplexed connection per server (per master on Redis Cluster, whose
///   slots are read with `CLUSTER SLOTS`), opened on first use; no connection per request. The
///   calls, their connections and their timers run on a thread of the store's own (started on
///   first use, ended when the store is dropped), so a reply is read when it arrives, not after
///   the application's queued tasks: a burst, or cores busy with other work, does not make a
///   healthy server look slow.
/// - **Timeouts, per check.** A check made while the server is silent waits the
///   [`timeout`](RedisStoreBuilder::timeout), counted from the moment it is made (queued time
///   included); a slow call fails only the checks whose own deadline passed. Past its
///   deadline, a check gives up as soon as the server owes a reply and has sent none for a
///   whole timeout (so one already waiting when the server stops answering gives up a timeout
///   after its last reply). While the server keeps answering, a check that is late only because
///   the machine is slower than the server (a burst larger than it turns round within the
///   timeout, other work on its cores) waits for its turn instead, up to ten times the timeout:
///   a busy machine is not an outage. Calls are sized so that the server answers each within a
///   quarter of the timeout, at the time per check its recent calls of the same script took
///   (100 µs before any is measured; at most 256 checks a call), so that under load replies
///   keep coming. A check
///   that gave up is answered [`StoreError::Timeout`] once; if its call still reaches Redis,
///   Redis has charged it (the fallback or the layer's failure policy decided the request; the
///   charge is not undone, and the request is not decided twice). A check that gave up before
///   its call was sent is not sent.
/// - **Refusals stay local.** A key Redis refused until an instant (a rate or calendar tier
///   with its exact `retry_after`) is refused by this process until then, with the decision
///   Redis would give and no call: a key under attack costs Redis about one call per refusal
///   period per instance. Exact, bounded in memory, forgotten when this process gives units
///   back; see [`RedisStoreBuilder::local_refusals`] for what is kept and for how long.
/// - **Lease mode for hot keys (opt-in, per policy).** With
///   [`lease_policy`](RedisStoreBuilder::lease_policy), an instance takes a block of a key's
///   budget from Redis in one script call and spends it locally: a hot key costs Redis one
///   call per block. Fixed windows still admit at most their limit in every window; GCRA and
///   the buckets at most `N × max_block` beyond theirs over any interval (`N` instances);
///   calendar tiers lease like windows; sliding windows and logs, and policies with a
///   concurrency tier, a penalty box, a reserve or a tier counting other units than requests
///   stay exact. See [`Lease`] for the bounds, block sizing, faults and headers.
/// - **Failures, per node.** Each server (each Cluster master) has its own circuit breaker: after
///   [`failure_threshold`](RedisStoreBuilder::circuit_breaker) consecutive failed calls it stops
///   calling that server for `open_for`, then probes it with one call. A call fails when the
///   server does not reply within twice the timeout of its sending (or the connection fails);
///   time checks spent queued in this process does not count, and a call the server answers
///   counts as a success even when some of its checks gave up. While the breaker is open,
///   checks are answered at once. A rejection is a decision, never a failure. While a server
///   fails, its keys are decided by the **local fallback** (a [`MemoryStore`] in this process,
///   on by default; decisions then report [`Source::Fallback`]); keys on other masters stay on
///   Redis. Without a fallback ([`RedisStoreBuilder::no_fallback`]) the check returns a
///   [`StoreError`], and the layer fails closed or, by explicit choice, open
///   ([`OnStoreError`](crate::OnStoreError)).
///
/// - **Redis Sentinel.** [`RedisStore::sentinel_builder`] finds the master through Redis
///   Sentinel (with the `redis` crate's sentinel support). The sentinels are asked which server
///   is the master on first use, again as soon as a check on it fails (no reply, a refused
///   connection, its breaker open, `READONLY` from a master demoted to a replica; at most every
///   100 ms), and every second otherwise (so that a master demoted while this process could
///   still reach it is left within about a second). They are asked one at a time, the one that
///   answered last first, each within twice the timeout. The `redis` crate checks that the
///   server named answers `ROLE` as a master (on a connection of its own, opened for that).
///   Each server named gets its own connection and circuit breaker: once the sentinels have
///   promoted a replica, checks go to it, whose breaker starts closed, while the failed
///   master's breaker stays open. No restart is needed. Until the promotion (the sentinels'
///   `down-after-milliseconds`, then their election and the promotion: about a second with
///   500 ms), checks are decided as in any outage, by the local fallback or the layer's
///   failure policy; after it, by Redis again within about 100 ms plus a connection (the tests
///   hold every check to it from 1 s after the sentinels named the new master).
///
///   **Limits across a failover.** Redis replicates asynchronously: charges the old master had
///   acknowledged but not yet sent to its replica are lost when the replica is promoted, and
///   the keys they were made on admit those requests again. That over-admission is bounded by
///   what the old master admitted in its last replication lag: under a millisecond of traffic
///   on a healthy link (the tests kill the master under load on loopback and hold the loss to
///   what it admitted in its last 10 ms), but everything since the link broke on a broken
///   one, unless the master is set to refuse writes then (`min-replicas-to-write 1` with
///   `min-replicas-max-lag` of n seconds caps it at about n seconds of traffic; refused writes
///   are failures, and the fallback or failure policy decides). Concurrency slots taken in
///   that lag are lost the same way (more requests in flight), and so are releases the old
///   master acknowledged in it (those slots come back when their time to live runs out). A
///   release that fails (the master down, the failover under way) is retried in the
///   background, after 100 ms, 200 ms, 400 ms and then every 500 ms, until it lands or the
///   slots' time to live runs out: the slots come back within about half a second of the store
///   reaching the promoted master, not when their time to live runs out (the tests hold them
///   to 2 s after the sentinels name it; they measure 0.1 s to 0.4 s). On top of that comes
///   what the local fallback admits during the outage (each instance on its own, see
///   [`fallback`](RedisStoreBuilder::fallback)).
///   The store does not wait for replication (`WAIT`), which would add a round trip to the
///   replica to every check.
///
/// Works with Redis 6.2+, Valkey 7.2+, Redis Cluster and Redis Sentinel; the server's kind and
/// version are logged when a connection opens. The tests run against redis-server 7.0, a
/// three-master Redis Cluster, valkey-server 8.0, and a master with one replica watched by
/// three sentinels (redis-server 7.0 `--sentinel`).
///
/// Clones share the connections, the breakers and the fallback.
///
/// ```no_run
/// use std::time::Duration;
/// use tollgate::store::RedisStore;
/// use tollgate::{Policy, Quota, RateLimitLayer};
///
/// # fn main() -> Result<(), tollgate::ConfigError> {
/// let store = RedisStore::builder("redis://127.0.0.1:6380/")
///     .timeout(Duration::from_millis(50))
///     .build()?;
/// let policy = Policy::builder("api")
///     .tier("burst", Quota::per_second(10))
///     .tier("monthly", Quota::new(1_000_000, Duration::from_secs(30 * 86_400)))
///     .build()?;
/// let layer = RateLimitLayer::builder(policy).store(store).build()?;
/// # let _ = layer; Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    topology: Topology,
    settings: Arc<Settings>,
    prefix: Box<str>,
    key_names: KeyNames,
    grace_ms: u64,
    fallback: Option<MemoryStore>,
    /// Entries of each binding's local refusals (0: none).
    refusals: usize,
    /// Lease mode for every policy that can lease.
    lease: Option<Lease>,
    /// Lease mode by policy name.
    lease_policies: HashMap<String, Lease>,
    /// The names of the policies bound to the store, and whether the names given to
    /// [`RedisStoreBuilder::lease_policy`] were compared with them (at the first check).
    bound_names: std::sync::Mutex<std::collections::BTreeSet<String>>,
    lease_names_checked: std::sync::atomic::AtomicBool,
}

enum Topology {
    Single(Arc<Node>),
    Cluster(Cluster),
    /// A master found through Redis Sentinel.
    Sentinel(Arc<sentinel::Watched>),
}

/// A Redis Cluster's masters, found from its seed nodes.
struct Cluster {
    seeds: Vec<ConnectionInfo>,
    /// The slot map, read on first use and again after a redirection.
    map: RwLock<Option<Arc<SlotMap>>>,
    nodes: RwLock<HashMap<String, Arc<Node>>>,
    refreshing: tokio::sync::Mutex<()>,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.inner;
        f.debug_struct("RedisStore")
            .field("cluster", &matches!(i.topology, Topology::Cluster(_)))
            .field("sentinel", &matches!(i.topology, Topology::Sentinel(_)))
            .field("prefix", &i.prefix)
            .field("key_names", &i.key_names)
            .field("server_time", &i.settings.clock.is_none())
            .field("timeout", &i.settings.timeout)
            .field("fallback", &i.fallback.is_some())
            .finish_non_exhaustive()
    }
}

/// A policy bound to a [`RedisStore`] ([`Store::bind`]): validated for the scripts, with its key
/// prefix and its part of every script call rendered, and bound to the local fallback store.
pub struct RedisPolicy {
    policy: Policy,
    /// The state key's parts around the key: `{prefix}{{policy}|` and `}:{fingerprint}`.
    key_parts: (String, String),
    key_names: KeyNames,
    prepared: Arc<Prepared>,
    /// The typical hold of each concurrency tier, learnt from this binding's releases.
    holds: Arc<Holds>,
    local: Option<MemoryPolicy>,
    /// Refusals answered without asking Redis (see [`RedisStoreBuilder::local_refusals`]);
    /// shared with the leases' give-backs (see [`lease::Back`]).
    refusals: Option<Arc<Refusals>>,
    /// Blocks of hot keys held by this process (see [`Lease`]).
    leases: Option<Arc<Leases>>,
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
    fn lease_ticket(&self, check: &Check<'_>, granted: u64) -> Option<RedisTicket> {
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
            lease: None,
        }))))
    }

    /// The hash a ticket keeps to forget its key's refusal when it gives charges back.
    fn refusal_hash(&self, key: &Key) -> u64 {
        self.refusals.as_ref().map_or(0, |r| r.hash(key))
    }

    /// Forgets the refusal of the key of `hash` now and again when the guard is dropped: a
    /// settlement or release through this process, made while the guard lives, may give
    /// units back (or, settling up, move the key's clock guard: see [`Refusals::forget`]).
    fn forgetting<'a>(&'a self, inner: &'a Inner, hash: u64) -> Forgetting<'a> {
        forgetting(self.refusals.as_deref(), inner, hash)
    }

    /// Read before a check is sent, for [`learn`](Self::learn).
    fn refusal_epoch(&self, key: &Key) -> u64 {
        self.refusals.as_ref().map_or(0, |r| r.epoch(key))
    }

    /// The refusal this process holds for `check`, counted down to now.
    fn local_refusal(&self, inner: &Inner, check: &Check<'_>) -> Option<Verdict<RedisTicket>> {
        let refusals = self.refusals.as_ref()?;
        let now = inner.settings.clock.as_ref().map(AnyClock::now);
        let decision = refusals.answer(&self.policy, check, now)?;
        Some(Verdict { decision, ticket: None })
    }

    /// Keeps (or drops) `check`'s refusal after Redis decided it at `at`; `epoch` is
    /// [`refusal_epoch`](Self::refusal_epoch) read before it was sent.
    fn learn(
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
fn forgetting<'a>(refusals: Option<&'a Refusals>, inner: &'a Inner, hash: u64) -> Forgetting<'a> {
    let clock = inner.settings.clock.as_ref();
    if let Some(r) = refusals {
        r.forget(hash, clock.map(AnyClock::now));
    }
    Forgetting { refusals, clock, hash }
}

/// Forgets a key's local refusal again when dropped ([`RedisPolicy::forgetting`]).
struct Forgetting<'a> {
    refusals: Option<&'a Refusals>,
    /// The injected clock, if any.
    clock: Option<&'a AnyClock>,
    hash: u64,
}

impl Drop for Forgetting<'_> {
    fn drop(&mut self) {
        if let Some(r) = self.refusals {
            r.forget(self.hash, self.clock.map(AnyClock::now));
        }
    }
}

/// What an admitted request was charged through a [`RedisStore`] (see [`Store::Ticket`]): in
/// Redis, or in the local fallback when Redis could not decide.
#[derive(Debug)]
pub struct RedisTicket(Charged);

#[derive(Debug)]
enum Charged {
    Remote(Box<Remote>),
    Local(MemoryTicket),
}

#[derive(Debug)]
struct Remote {
    state_key: String,
    /// The key's hash in the binding's local refusals, forgotten when charges come back.
    refusal: u64,
    /// What each tier was charged (a tier's cost follows its settlements).
    charges: Charges,
    /// The concurrency slots it holds: released when it is dropped.
    lease: Option<Slots>,
}

/// Leased concurrency slots, and what releasing them needs.
struct Slots {
    id: u64,
    store: Arc<Inner>,
    prepared: Arc<Prepared>,
    policy: Policy,
    holds: Arc<Holds>,
}

impl fmt::Debug for Slots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Slots").field("id", &self.id).finish_non_exhaustive()
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else { return };
        let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
        let (state_key, charges) = (std::mem::take(&mut self.state_key), self.charges.clone());
        handle.spawn(async move {
            let new: Vec<u64> = charges.iter().map(|c| c.cost).collect();
            if let Err(error) = lease.settle(state_key.clone(), &charges, &new, true).await {
                tracing::debug!(%error, "tollgate: could not release concurrency slots; retrying");
                lease.release_later(state_key, charges);
            }
        });
    }
}

impl Slots {
    /// Settles `charges` at `new` (per tier) in Redis, releasing the slots with `release`
    /// (and recording their holds).
    async fn settle(
        &self,
        state_key: String,
        charges: &Charges,
        new: &[u64],
        release: bool,
    ) -> Result<(), StoreError> {
        settle_remote(
            &self.store,
            &self.prepared,
            &self.policy,
            &self.holds,
            state_key,
            charges,
            new,
            release,
        )
        .await
    }
}

/// Settles `charges` of `state_key` at `new` per tier on a policy of several kinds, releasing
/// its slots with `release` and recording how long they were held.
#[allow(clippy::too_many_arguments)]
async fn settle_remote(
    inner: &Inner,
    prepared: &Prepared,
    policy: &Policy,
    holds: &Holds,
    state_key: String,
    charges: &Charges,
    new: &[u64],
    release: bool,
) -> Result<(), StoreError> {
    let record = prepared.settle_kinds(charges, new, release, inner.app_now());
    let keys = prepared.keys(state_key);
    let (_, at) = inner.submit(prepared, keys, record, 0).await?;
    if release {
        let unit = policy.unit();
        for (i, (t, c)) in policy.tiers().iter().zip(charges).enumerate() {
            if matches!(t.kind, Kind::Concurrency(_)) && c.cost > 0 {
                holds.observe(i, at.saturating_sub(c.at.saturating_mul(unit)));
            }
        }
    }
    Ok(())
}

impl RedisStore {
    /// Starts configuring a store on one Redis (or Valkey) server, e.g.
    /// `"redis://127.0.0.1:6380/"` or `"rediss://user:pass@host/0"` (the URL forms of the
    /// `redis` crate). Nothing is connected until the first call or [`connect`](Self::connect).
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder::new(vec![url.into()], false)
    }

    /// Starts configuring a store on a Redis Cluster, given one or more of its nodes' URLs (the
    /// masters are discovered from them with `CLUSTER SLOTS`).
    pub fn cluster_builder<I>(nodes: I) -> RedisStoreBuilder
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        RedisStoreBuilder::new(nodes.into_iter().map(Into::into).collect(), true)
    }

    /// Starts configuring a store on the master that Redis Sentinel knows as `master_name`,
    /// given the URLs of one or more sentinels (`"redis://127.0.0.1:26379/"`; a user and
    /// password in a URL are that sentinel's). The store asks them which server is the master
    /// on first use, and again when checks on it fail, so it follows a failover without a
    /// restart (see [`RedisStore`], "Redis Sentinel"). How to connect to the servers they name
    /// (TLS, user, password, database) is given by
    /// [`master_url`](RedisStoreBuilder::master_url).
    ///
    /// [`build`](RedisStoreBuilder::build) fails with [`ConfigError::Invalid`] on `url` when
    /// no sentinel is given or one cannot be parsed, and on `master_name` when it is empty.
    ///
    /// ```no_run
    /// use tollgate::store::RedisStore;
    ///
    /// # fn main() -> Result<(), tollgate::ConfigError> {
    /// let store = RedisStore::sentinel_builder(
    ///     ["redis://10.0.0.1:26379/", "redis://10.0.0.2:26379/", "redis://10.0.0.3:26379/"],
    ///     "limits",
    /// )
    /// .master_url("redis://:s3cr3t@master/0")
    /// .build()?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn sentinel_builder<I>(sentinels: I, master_name: impl Into<String>) -> RedisStoreBuilder
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        let mut builder =
            RedisStoreBuilder::new(sentinels.into_iter().map(Into::into).collect(), false);
        builder.sentinel = Some(master_name.into());
        builder
    }

    /// Opens the connections now (and loads the scripts), instead of on the first request, and
    /// logs each server's kind and version. Through Redis Sentinel, asks the sentinels for the
    /// master first, and connects to it.
    ///
    /// Call it at startup to fail fast. Without it an unreachable server shows only when
    /// traffic arrives: its checks are then decided by the local fallback, so each instance
    /// enforces the limits on its own (N instances admit up to N times each limit), and after
    /// a few failures the circuit breaker opens with a warning that says so.
    ///
    /// # Errors
    /// [`StoreError::Backend`] when a server refuses (or no sentinel names the master),
    /// [`StoreError::Timeout`] when one does not answer within the store's timeout.
    pub async fn connect(&self) -> Result<(), StoreError> {
        let inner = &self.inner;
        let nodes = match &inner.topology {
            Topology::Single(node) => vec![Arc::clone(node)],
            Topology::Sentinel(watched) => {
                let deadline = health::later(tokio::time::Instant::now(), inner.settings.timeout);
                vec![watched.master(deadline).await?]
            }
            Topology::Cluster(cluster) => {
                let map = inner.slot_map(cluster).await?;
                map.nodes()
                    .map(|addr| inner.cluster_node(cluster, addr))
                    .collect::<Result<_, _>>()?
            }
        };
        for node in nodes {
            // On the store's thread, where calls will use the connection.
            let attempt = node.on_io(|node| async move {
                let mut conn = node.connection().await?;
                for family in script::Family::ALL {
                    family.script().load_async(&mut conn).await?;
                }
                Ok::<_, redis::RedisError>(())
            });
            match tokio::time::timeout(inner.settings.timeout, attempt).await {
                Ok(result) => result?.map_err(StoreError::backend)?,
                Err(_) => return Err(StoreError::Timeout(inner.settings.timeout)),
            }
        }
        Ok(())
    }

    /// The circuit breaker's state now: of the server, on Redis Cluster the most open of the
    /// masters' breakers (see [`breaker_states`](Self::breaker_states)), through Redis Sentinel
    /// that of the master the sentinels named last (`Closed` before they named one).
    #[must_use]
    pub fn breaker_state(&self) -> BreakerState {
        if let Topology::Sentinel(watched) = &self.inner.topology {
            return watched.current().map_or(BreakerState::Closed, |n| n.breaker_state());
        }
        let states = self.breaker_states();
        if states.iter().any(|(_, s)| *s == BreakerState::Open) {
            BreakerState::Open
        } else if states.iter().any(|(_, s)| *s == BreakerState::HalfOpen) {
            BreakerState::HalfOpen
        } else {
            BreakerState::Closed
        }
    }

    /// What each server said of itself (kind and version) when its connection opened; the
    /// servers not connected to yet are missing.
    #[must_use]
    pub fn servers(&self) -> Vec<ServerInfo> {
        let mut out: Vec<ServerInfo> = match &self.inner.topology {
            Topology::Single(node) => node.info().into_iter().collect(),
            Topology::Cluster(cluster) => cluster
                .nodes
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .values()
                .filter_map(|n| n.info())
                .collect(),
            Topology::Sentinel(watched) => {
                watched.nodes().iter().filter_map(|n| n.info()).collect()
            }
        };
        out.sort_by(|a, b| a.addr.cmp(&b.addr));
        out
    }

    /// Each server's circuit breaker (`host:port`, state): one for a standalone server, one per
    /// master known so far on Redis Cluster, one per server the sentinels have named as master
    /// so far through Redis Sentinel (a failed master's breaker stays open, or half-open, as
    /// checks have left it).
    #[must_use]
    pub fn breaker_states(&self) -> Vec<(String, BreakerState)> {
        match &self.inner.topology {
            Topology::Single(node) => vec![(node.addr.to_string(), node.breaker_state())],
            Topology::Sentinel(watched) => {
                let mut states: Vec<_> = watched
                    .nodes()
                    .iter()
                    .map(|n| (n.addr.to_string(), n.breaker_state()))
                    .collect();
                states.sort_by(|a, b| a.0.cmp(&b.0));
                states
            }
            Topology::Cluster(cluster) => {
                let nodes = cluster.nodes.read().unwrap_or_else(PoisonError::into_inner);
                let mut states: Vec<_> =
                    nodes.values().map(|n| (n.addr.to_string(), n.breaker_state())).collect();
                states.sort_by(|a, b| a.0.cmp(&b.0));
                states
            }
        }
    }
}

/// `host:port` of a connection's address.
fn addr_of(info: &ConnectionInfo) -> String {
    match &info.addr {
        ConnectionAddr::Tcp(host, port) | ConnectionAddr::TcpTls { host, port, .. } => {
            format!("{host}:{port}")
        }
        other => other.to_string(),
    }
}

impl Inner {
    /// Once, at the first check: logs (and counts) each name given to
    /// [`RedisStoreBuilder::lease_policy`] that no policy bound to the store by then uses.
    #[cold]
    fn check_lease_names(&self) {
        use std::sync::atomic::Ordering;
        if self.lease_names_checked.swap(true, Ordering::AcqRel) {
            return;
        }
        let bound = self.bound_names.lock().unwrap_or_else(PoisonError::into_inner);
        let mut unknown: Vec<&String> =
            self.lease_policies.keys().filter(|n| !bound.contains(*n)).collect();
        unknown.sort();
        for name in unknown {
            tracing::warn!(
                setting = "lease_policy",
                policy = %name,
                bound = ?*bound,
                "tollgate: lease_policy names a policy that no policy bound to this store uses: \
                 nothing leases under that name"
            );
            crate::metrics::config_warning(name, "lease_policy");
        }
    }

    /// This process's idea of now: the injected clock's, or the system's (nanoseconds since
    /// the Unix epoch). Only calendar tiers need it, for the windows a check sends.
    fn app_now(&self) -> u64 {
        let system = || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, duration_to_nanos)
        };
        self.settings.clock.as_ref().map_or_else(system, AnyClock::now)
    }

    /// The cluster's slot map, read with `CLUSTER SLOTS` from the first node that answers.
    async fn slot_map(&self, cluster: &Cluster) -> Result<Arc<SlotMap>, StoreError> {
        if let Some(map) = cluster.map.read().unwrap_or_else(PoisonError::into_inner).clone() {
            return Ok(map);
        }
        let _refreshing = cluster.refreshing.lock().await;
        if let Some(map) = cluster.map.read().unwrap_or_else(PoisonError::into_inner).clone() {
            return Ok(map);
        }
        let known: Vec<Arc<Node>> = cluster
            .nodes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .filter(|n| n.breaker_state() == BreakerState::Closed)
            .cloned()
            .collect();
        let mut last = StoreError::backend("no Redis Cluster node answered CLUSTER SLOTS");
        let seeds = cluster.seeds.iter().map(|info| self.node_for(info.clone()));
        for node in known.into_iter().chain(seeds) {
            let ask = node.on_io(|node| async move {
                let mut conn = node.connection().await?;
                redis::cmd("CLUSTER").arg("SLOTS").query_async::<redis::Value>(&mut conn).await
            });
            match tokio::time::timeout(self.settings.timeout, ask).await {
                Ok(Err(e)) => last = e,
                Ok(Ok(Err(e))) => last = StoreError::backend(e),
                Ok(Ok(Ok(reply))) => {
                    if let Some(map) = SlotMap::parse(&reply) {
                        let map = Arc::new(map);
                        *cluster.map.write().unwrap_or_else(PoisonError::into_inner) =
                            Some(Arc::clone(&map));
                        return Ok(map);
                    }
                    last = StoreError::backend("unexpected CLUSTER SLOTS reply");
                }
                Err(_) => last = StoreError::Timeout(self.settings.timeout),
            }
        }
        Err(last)
    }

    /// A node for a connection (not registered).
    fn node_for(&self, info: ConnectionInfo) -> Arc<Node> {
        let addr: Arc<str> = addr_of(&info).into();
        let client = redis::Client::open(info).unwrap_or_else(|_| unreachable_client());
        Arc::new(Node::new(addr, client, Arc::clone(&self.settings)))
    }

    /// The registered node of master `addr` (`host:port`), made from the first seed's settings.
    fn cluster_node(&self, cluster: &Cluster, addr: &str) -> Result<Arc<Node>, StoreError> {
        if let Some(node) = cluster.nodes.read().unwrap_or_else(PoisonError::into_inner).get(addr) {
            return Ok(Arc::clone(node));
        }
        let mut nodes = cluster.nodes.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(node) = nodes.get(addr) {
            return Ok(Arc::clone(node));
        }
        let (host, port) = addr
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.to_owned(), p.parse::<u16>().ok()?)))
            .ok_or_else(|| StoreError::backend(format!("bad node address {addr:?}")))?;
        let mut info =
            cluster.seeds.first().cloned().ok_or_else(|| StoreError::backend("no seed"))?;
        info.addr = match info.addr {
            ConnectionAddr::TcpTls { insecure, tls_params, .. } => {
                ConnectionAddr::TcpTls { host, port, insecure, tls_params }
            }
            _ => ConnectionAddr::Tcp(host, port),
        };
        let node = self.node_for(info);
        nodes.insert(addr.to_owned(), Arc::clone(&node));
        Ok(node)
    }

    /// Sends `blob` (a check or settlement on `keys`) to the node of its key and awaits its
    /// part of the reply and the instant decided at. Its deadline is now plus the store's
    /// timeout: finding the node must fit in it; past it, the check waits only as long as the
    /// server keeps up, and at most ten timeouts (`health.rs`).
    ///
    /// # Errors
    /// [`StoreError::Timeout`] when the check gives up (a call answered later may still have
    /// charged it in Redis); the call's error otherwise.
    async fn submit_once(
        &self,
        prepared: &Prepared,
        keys: Vec<String>,
        record: Vec<f64>,
        reply_len: usize,
    ) -> Result<(Vec<i64>, u64), StoreError> {
        let timeout = self.settings.timeout;
        let deadline = health::later(tokio::time::Instant::now(), timeout);
        let (node, slot) = match &self.topology {
            Topology::Single(node) => (Arc::clone(node), 0),
            Topology::Sentinel(watched) => (watched.master(deadline).await?, 0),
            Topology::Cluster(cluster) => {
                let slot = cluster::slot(&keys[0]);
                let map = tokio::time::timeout_at(deadline, self.slot_map(cluster))
                    .await
                    .unwrap_or(Err(StoreError::Timeout(timeout)))?;
                let addr = map
                    .node_of(slot)
                    .ok_or_else(|| StoreError::backend(format!("slot {slot} is not served")))?;
                (self.cluster_node(cluster, addr)?, slot)
            }
        };
        let (tx, rx) = oneshot::channel();
        let policy = Arc::clone(&prepared.policy);
        node.submit(Item {
            family: prepared.family,
            plain: !prepared.is_kinds(),
            slot,
            keys,
            policy,
            record,
            reply_len,
            deadline,
            at: self.settings.clock.as_ref().map(AnyClock::now),
            answer: tx,
        });
        let answer = node.wait(deadline, rx).await;
        if let (Err(_), Topology::Sentinel(watched)) = (&answer, &self.topology) {
            // The master may have failed, or been demoted (`READONLY`): ask the sentinels.
            watched.suspect();
        }
        if let (Err(StoreError::Backend(e)), Topology::Cluster(cluster)) = (&answer, &self.topology)
        {
            // A redirection: the slots moved. Read them again for the next call.
            let text = e.to_string();
            if text.contains("MOVED") || text.contains("ASK") || text.contains("CLUSTERDOWN") {
                cluster.map.write().unwrap_or_else(PoisonError::into_inner).take();
            }
        }
        answer
    }

    /// Decides on the local fallback after `error`, or returns `error` without one.
    fn fall_back(
        &self,
        error: StoreError,
        bound: &RedisPolicy,
        check: Check<'_>,
    ) -> Result<Verdict<RedisTicket>, StoreError> {
        let (Some(local), Some(local_bound)) = (&self.fallback, &bound.local) else {
            return Err(error);
        };
        tracing::debug!(%error, policy = bound.policy.name(), "tollgate: redis unavailable; decided by the local fallback");
        let verdict = local.check_now(local_bound, check);
        let mut decision = verdict.decision;
        decision.source = Source::Fallback;
        Ok(Verdict { decision, ticket: verdict.ticket.map(|t| RedisTicket(Charged::Local(t))) })
    }
}

/// `redis::Client::open` cannot fail for a `ConnectionInfo` (it only parses URLs); this
/// client, on a closed port of loopback, is never made.
#[cold]
fn unreachable_client() -> redis::Client {
    redis::Client::open(("127.0.0.1", 1)).unwrap_or_else(|_| unreachable_client())
}

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
        let prepared = &bound.prepared;
        if prepared.is_kinds() {
            return self.check_kinds(bound, check).await;
        }
        let state_key = bound.state_key(check.key);
        let ticket_key = (check.ticket && check.cost > 0).then(|| state_key.clone());
        let keys = prepared.keys(state_key);
        let record = prepared.check(check.cost, check.max_delay);
        let epoch = bound.refusal_epoch(check.key);
        let sent = inner.settings.clock.is_none().then(Instant::now);
        let answered = inner.submit(prepared, keys, record, prepared.check_reply_len()).await;
        let decided = answered.and_then(|(reply, at)| {
            script::decode(&bound.policy, check.cost, at, &reply).map(|d| (d, at))
        });
        match decided {
            Ok(((decision, charges), at)) => {
                bound.learn(&check, &decision, at, sent, epoch);
                let ticket = charges.zip(ticket_key).map(|(charges, state_key)| {
                    RedisTicket(Charged::Remote(Box::new(Remote {
                        state_key,
                        refusal: bound.refusal_hash(check.key),
                        charges,
                        lease: None,
                    })))
                });
                Ok(Verdict { decision, ticket })
            }
            Err(error) => inner.fall_back(error, bound, check),
        }
    }

    async fn settle(
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
                let prepared = &bound.prepared;
                if prepared.is_kinds() {
                    let lease = remote.lease.take();
                    let new: Vec<u64> = bound
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
                    if !changed && lease.is_none() {
                        return Ok(());
                    }
                    let state_key = std::mem::take(&mut remote.state_key);
                    let settled = settle_remote(
                        inner,
                        prepared,
                        &bound.policy,
                        &bound.holds,
                        state_key.clone(),
                        &remote.charges,
                        &new,
                        lease.is_some(),
                    )
                    .await;
                    // The slots, at least, are released later (see `release`); the units'
                    // settlement is not sent twice.
                    if let (Err(_), Some(lease)) = (&settled, lease) {
                        lease.release_later(state_key, remote.charges.clone());
                    }
                    return settled;
                }
                // Each tier from what it was charged (single tiers may have been settled).
                if remote.charges.iter().all(|c| c.cost == cost) {
                    return Ok(());
                }
                let charges = &remote.charges;
                let record = prepared.settle(charges, |i| charges[i].cost, |_| cost);
                let keys = prepared.keys(std::mem::take(&mut remote.state_key));
                inner.submit(prepared, keys, record, 0).await.map(drop)
            }
        }
    }

    /// Settles single tiers, as [`MemoryStore`] does, whatever the policy's tiers (a policy of
    /// request rates is the case of every tier charged the same cost).
    async fn settle_tiers(
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
        let new: Vec<u64> = tiers
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
        let prepared = &bound.prepared;
        if prepared.is_kinds() {
            let (state_key, charges) = (remote.state_key.clone(), &remote.charges);
            settle_remote(
                inner,
                prepared,
                &bound.policy,
                &bound.holds,
                state_key,
                charges,
                &new,
                false,
            )
            .await?;
        } else {
            let charges = &remote.charges;
            let record = prepared.settle(charges, |i| charges[i].cost, |i| new[i]);
            let keys = prepared.keys(remote.state_key.clone());
            inner.submit(prepared, keys, record, 0).await?;
        }
        for (c, n) in remote.charges.iter_mut().zip(&new) {
            c.cost = *n;
        }
        Ok(())
    }

    async fn release(&self, bound: &RedisPolicy, ticket: RedisTicket) -> Result<(), StoreError> {
        let Charged::Remote(mut remote) = ticket.0 else { return Ok(()) };
        let Some(lease) = remote.lease.take() else { return Ok(()) };
        let _forgetting = bound.forgetting(&self.inner, remote.refusal);
        let new: Vec<u64> = remote.charges.iter().map(|c| c.cost).collect();
        let state_key = std::mem::take(&mut remote.state_key);
        let prepared = &bound.prepared;
        let released = settle_remote(
            &self.inner,
            prepared,
            &bound.policy,
            &bound.holds,
            state_key.clone(),
            &remote.charges,
            &new,
            true,
        )
        .await;
        if released.is_err() {
            // Retried in the background until it lands or the slots' time to live runs out.
            lease.release_later(state_key, remote.charges.clone());
        }
        released
    }

    async fn refresh(&self, bound: &RedisPolicy, ticket: &RedisTicket) -> Result<bool, StoreError> {
        let Charged::Remote(remote) = &ticket.0 else { return Ok(true) };
        let Some(lease) = &remote.lease else { return Ok(true) };
        let prepared = &bound.prepared;
        let record = prepared.refresh(&remote.charges, lease.id);
        let keys = prepared.keys(remote.state_key.clone());
        let (reply, _) =
            self.inner.submit(prepared, keys, record, prepared.refresh_reply_len()).await?;
        Ok(reply.iter().all(|held| *held == 1))
    }

    fn refresh_every(&self, bound: &RedisPolicy) -> Option<Duration> {
        bound.policy.tiers().iter().filter_map(|t| t.concurrency()).map(|c| c.refresh_every()).min()
    }
}

/// Whether a check on a leasing binding takes units from a block: a policing check of a cost
/// above 0 on every tier.
fn leases_check(check: &Check<'_>) -> bool {
    check.cost > 0 && check.max_delay.is_none() && check.costs.iter().all(|c| *c == check.cost)
}

impl RedisStore {
    /// The leases of `policy` as the builder configured them: `None` without lease mode, or
    /// for a policy that cannot lease under [`RedisStoreBuilder::lease`] (it stays exact).
    ///
    /// # Errors
    /// [`ConfigError::UnsupportedByStore`] for a policy named by
    /// [`RedisStoreBuilder::lease_policy`] that cannot lease.
    fn leases_for(
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

    /// [`Store::check`] in lease mode: from this process's block of the key, or with a call
    /// that gives back the rest of the previous block and takes the next (see [`Lease`]).
    async fn check_leased(
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
    async fn check_leased_kinds(
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
            block = block.min((room / 4).max(check.cost));
        }
        loop {
            let costs: SmallVec<[u64; 4]> = (0..n).map(|_| block).collect();
            let record = prepared.check_kinds(&costs, None, 0, check.priority, inner.app_now());
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
            block = (room / 4).max(check.cost).min(block - 1);
        }
    }

    /// [`Store::check`] for a policy of several kinds.
    async fn check_kinds(
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
        // A lease id unique enough among the slots of one key (52 random bits: exact as a
        // double in the script).
        let lease = if takes_slots { fastrand::u64(1..1 << 52) } else { 0 };
        let state_key = bound.state_key(check.key);
        let keys = prepared.keys(state_key.clone());
        let record =
            prepared.check_kinds(&costs, check.max_delay, lease, check.priority, inner.app_now());
        let epoch = bound.refusal_epoch(check.key);
        let sent = inner.settings.clock.is_none().then(Instant::now);
        let answered = inner.submit(prepared, keys, record, prepared.check_reply_len()).await;
        let decided = answered.and_then(|(reply, at)| {
            script::decode_costs(policy, &|i| costs[i], lease, check.priority, at, &reply)
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
        let ticket = charges.and_then(|charges| {
            let slots = takes_slots.then(|| Slots {
                id: lease,
                store: Arc::clone(&self.inner),
                prepared: Arc::clone(prepared),
                policy: policy.clone(),
                holds: Arc::clone(&bound.holds),
            });
            let wanted = check.ticket && charges.iter().any(|c| c.cost > 0);
            (slots.is_some() || wanted).then(|| {
                RedisTicket(Charged::Remote(Box::new(Remote {
                    state_key,
                    refusal: bound.refusal_hash(check.key),
                    charges,
                    lease: slots,
                })))
            })
        });
        Ok(Verdict { decision, ticket })
    }
}

/// Configures a [`RedisStore`]; see [`RedisStore::builder`], [`RedisStore::cluster_builder`]
/// and [`RedisStore::sentinel_builder`]. Setters only collect values; [`build`](Self::build)
/// checks them.
#[must_use]
pub struct RedisStoreBuilder {
    /// The server's URL, the Cluster's seeds, or the sentinels.
    nodes: Vec<String>,
    cluster: bool,
    /// The master's name, through Redis Sentinel.
    sentinel: Option<String>,
    /// How to connect to the servers the sentinels name.
    master_url: Option<String>,
    prefix: String,
    /// The secret state keys are hashed with; `None` names them by the raw key.
    key_secret: Option<Vec<u8>>,
    clock: Option<AnyClock>,
    timeout: Duration,
    ttl_grace: Duration,
    threshold: u32,
    open_for: Duration,
    fallback: Option<MemoryStore>,
    local_refusals: usize,
    lease: Option<Lease>,
    lease_policies: HashMap<String, Lease>,
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
    fn new(nodes: Vec<String>, cluster: bool) -> Self {
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

    /// Through Redis Sentinel ([`RedisStore::sentinel_builder`]), how to connect to the servers
    /// the sentinels name: the scheme of `url` (`redis`, or `rediss` for TLS), its user,
    /// password and database number (`redis://user:password@master/2`). Its host and port are
    /// not used (the sentinels give them). By default, plain TCP, no password, database 0.
    ///
    /// [`build`](Self::build) fails with [`ConfigError::Invalid`] on `master_url` when the
    /// `redis` crate cannot parse `url`, or when the store is not built with
    /// [`RedisStore::sentinel_builder`].
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
    /// key's `Display` form (`s5:alice`, `ip:203.0.113.7`), instead of its keyed hash: for
    /// debugging, on a Redis nobody else reads. The keys then appear in `SCAN`, `MONITOR` and
    /// RDB files. Nodes with raw keys and nodes with hashed keys do not share budgets.
    /// Overrides [`key_secret`](Self::key_secret).
    pub fn raw_keys(mut self) -> Self {
        self.key_secret = None;
        self
    }

    /// Decide at this clock's instants instead of the Redis server's `TIME` (default). Every
    /// instance must then share one time base: meant for deterministic tests with a
    /// [`FakeClock`](crate::clock::FakeClock). Keys still expire on Redis's clock, so give a
    /// [`ttl_grace`](Self::ttl_grace) that covers the drift between the two. The default
    /// fallback store decides on this clock too.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        let clock = AnyClock::new(clock);
        if self.fallback.is_some() {
            self.fallback = Some(MemoryStore::builder().any_clock(clock.clone()).assembled());
        }
        self.clock = Some(clock);
        self
    }

    /// How long a check waits for a server that does not answer, from the moment it is made:
    /// time queued behind other checks and connecting included (default 100 ms; at least 1 ms).
    /// A check then returns [`StoreError::Timeout`] (and is decided by the fallback, if any).
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
    /// a new [`MemoryStore`]). Each instance then enforces the policy on its own: a fleet of `n`
    /// admits up to `n` times the limit until Redis answers again. Charges made locally are
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

    /// Lease mode for the policy named `policy` (see [`Lease`]): this instance takes blocks of
    /// a key's budget from Redis in one call and spends them locally. Overrides
    /// [`lease`](Self::lease) for that policy. Instances in lease mode and in exact mode share
    /// one budget.
    ///
    /// Rate tiers of GCRA, the token and leaky buckets and the fixed window lease, beside
    /// calendar tiers. Binding the policy fails with [`ConfigError::UnsupportedByStore`],
    /// naming the tier, when it cannot lease: a sliding window or log, a concurrency tier, a
    /// penalty box or a reserve, or a tier counting other units than requests.
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
        let invalid = |setting, reason: String| ConfigError::Invalid { setting, reason };
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
        let infos = self
            .nodes
            .iter()
            .map(|url| {
                url.as_str().into_connection_info().map_err(|e| invalid("url", e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let settings = Arc::new(Settings {
            timeout: self.timeout,
            clock: self.clock,
            threshold: self.threshold,
            open_for: self.open_for,
            fallback: self.fallback.is_some(),
            io: io::Io::new(),
        });
        let servers = match (&self.sentinel, &self.master_url) {
            (Some(name), _) if name.is_empty() => {
                return Err(invalid("master_name", "must not be empty".into()));
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "master_url",
                    "is for a store built with RedisStore::sentinel_builder".into(),
                ));
            }
            (_, Some(url)) => {
                let info = url
                    .as_str()
                    .into_connection_info()
                    .map_err(|e| invalid("master_url", e.to_string()))?;
                sentinel::servers(info)
            }
            (_, None) => SentinelNodeConnectionInfo::default(),
        };
        let topology = match (self.cluster, infos.as_slice()) {
            (_, []) => return Err(invalid("url", "no redis url given".into())),
            (false, _) if self.sentinel.is_some() => {
                let name = self.sentinel.as_deref().unwrap_or_default();
                let watched = sentinel::Watched::new(name, infos, servers, Arc::clone(&settings))
                    .map_err(|e| invalid("url", e.to_string()))?;
                Topology::Sentinel(Arc::new(watched))
            }
            (false, [info]) => {
                let client =
                    redis::Client::open(info.clone()).map_err(|e| invalid("url", e.to_string()))?;
                Topology::Single(Arc::new(Node::new(
                    addr_of(info).into(),
                    client,
                    Arc::clone(&settings),
                )))
            }
            (false, _) => return Err(invalid("url", "a standalone redis takes one url".into())),
            (true, _) => Topology::Cluster(Cluster {
                seeds: infos,
                map: RwLock::new(None),
                nodes: RwLock::new(HashMap::new()),
                refreshing: tokio::sync::Mutex::new(()),
            }),
        };
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
}
