//! [`RedisStore`]: limits shared by a fleet through Redis, Redis Cluster or Valkey.

mod binding;
mod breaker;
mod builder;
mod cluster;
mod cover;
mod health;
mod inner;
mod io;
mod lease;
mod node;
mod ops;
mod rebind;
mod refusals;
mod release;
mod script;
mod sentinel;
mod ticket;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use redis::sentinel::SentinelNodeConnectionInfo;
use redis::{ConnectionAddr, ConnectionInfo, IntoConnectionInfo};
use tokio::sync::oneshot;

pub use binding::RedisPolicy;
use binding::forgetting;
pub use breaker::BreakerState;
pub use builder::RedisStoreBuilder;
use cluster::SlotMap;
use lease::Leases;
pub use lease::{Lease, LeaseStats};
use node::{Item, Node, Settings};
pub use node::{ServerInfo, ServerKind};
use refusals::Refusals;
use script::{KeyNames, Prepared};
pub use ticket::RedisTicket;
use ticket::{Charged, HeldSlots, Remote, settle_remote};

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
