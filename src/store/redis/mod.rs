//! [`RedisStore`]: limits shared by a fleet through Redis, Redis Cluster or Valkey (SPEC §8).

mod breaker;
mod call;

use std::fmt;
use std::sync::{Arc, LazyLock, PoisonError, RwLock};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Script, Value};

pub use breaker::BreakerState;
use breaker::{Admit, Breaker};
use call::{Call, Now, Prepared};

use super::memory::{MemoryPolicy, MemoryTicket};
use super::{Check, MemoryStore, Store, Verdict};
use crate::algorithm::Charges;
use crate::clock::{AnyClock, Clock, duration_to_nanos};
use crate::decision::Source;
use crate::error::{ConfigError, StoreError};
use crate::key::Key;
use crate::quota::Policy;

/// The script: every algorithm, all tiers of one request, one atomic call. Sent with `EVALSHA`;
/// `redis::Script` loads it (`SCRIPT LOAD`) and retries when the server answers `NOSCRIPT`.
static SCRIPT: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("limit.lua")));

/// The fast path for the common case — GCRA tiers with whole-nanosecond emission intervals —
/// keeping every tier's TAT in one string: one `GET`, one `SET`.
static FAST: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("gcra.lua")));

const DEFAULT_PREFIX: &str = "tollgate:";
const DEFAULT_TIMEOUT: Duration = Duration::from_millis(100);
const DEFAULT_FAILURE_THRESHOLD: u32 = 5;
const DEFAULT_OPEN_FOR: Duration = Duration::from_millis(500);

/// A [`Store`] in Redis: every instance of a service that uses the same Redis shares one limit.
///
/// - **One round trip, atomic.** Each request runs one Lua script (`EVALSHA`) that decides
///   every tier of the policy, with any of the six algorithms, and charges them all or none.
///   It makes the same decisions as [`MemoryStore`] (a differential test replays random traces
///   through both), including shaping reservations and [`settle`](Store::settle) /
///   cancel.
/// - **Server time.** By default the script reads the Redis server's `TIME`, so clock skew
///   between app servers cannot loosen a limit. [`RedisStoreBuilder::clock`] uses an injected
///   [`Clock`] instead (deterministic tests).
/// - **Keys.** `{prefix}{{policy}|{key}}:{fingerprint}` — a hash holding every tier's state
///   (plus one sorted set per tier for the sliding log, `...:z1`, `...:z2`). Everything that
///   identifies the limit is inside the hash tag, so one key's tiers share a Redis Cluster
///   slot; `{`, `}`, `|` and `%` in names are percent-escaped. The fingerprint changes when the
///   policy's algorithm or quotas change, so reconfigured policies start afresh. Every key gets
///   a TTL equal to the time until its state is back to full (plus
///   [`ttl_grace`](RedisStoreBuilder::ttl_grace)), so idle keys vanish by themselves.
/// - **Connections.** One multiplexed connection (redis-rs `ConnectionManager`, reconnecting on
///   its own) or the async Redis Cluster client; concurrent requests are pipelined on it, with
///   no connection per request and no lock. The connection is opened on first use, so a
///   service starts even while Redis is down ([`connect`](Self::connect) opens it eagerly).
/// - **Failures** (SPEC §8). Each call has a [`timeout`](RedisStoreBuilder::timeout). A failed
///   call either falls back to a local [`MemoryStore`]
///   ([`fallback`](RedisStoreBuilder::fallback); the decision's [`source`] is then
///   [`Source::Fallback`]) or returns a [`StoreError`], which the layer turns into fail-open or
///   fail-closed ([`OnStoreError`](crate::OnStoreError)). After
///   [`failure_threshold`](RedisStoreBuilder::circuit_breaker) consecutive failures a circuit
///   breaker stops calling Redis for `open_for` (requests no longer pay the timeout), then
///   probes it with one call and closes again when it answers. Transitions are logged with
///   `tracing`; [`breaker_state`](Self::breaker_state) reports the current one.
///
/// Works with Redis 6.2+, Valkey 7.2+ and Redis Cluster; the tests run against redis-server
/// 7.0, a three-master Redis Cluster and valkey-server 8.0.
///
/// Clones share the connection, the breaker and the fallback.
///
/// ```no_run
/// use std::time::Duration;
/// use tollgate::store::{MemoryStore, RedisStore};
/// use tollgate::{Policy, Quota, RateLimitLayer};
///
/// # fn main() -> Result<(), tollgate::ConfigError> {
/// let store = RedisStore::builder("redis://127.0.0.1:6380/")
///     .timeout(Duration::from_millis(50))
///     .fallback(MemoryStore::new()) // decide locally while Redis is unreachable
///     .build()?;
/// let policy = Policy::builder("api")
///     .tier("burst", Quota::per_second(10))
///     .tier("daily", Quota::per_day(10_000))
///     .build()?;
/// let layer = RateLimitLayer::builder(policy).store(store).build()?;
/// # let _ = layer; Ok(()) }
/// ```
///
/// [`source`]: crate::Decision::source
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    target: Target,
    /// The connection, opened on first use. A failed attempt leaves it empty so that the next
    /// call tries again, and a failed breaker probe empties it, so that the next probe starts
    /// from a new client rather than one stuck recovering (redis-rs's cluster client can stay
    /// broken after a node restart under load; a new one works at once).
    /// Read (and the handle cloned) by every call, so readers never wait for each other; written
    /// only to replace the connection.
    conn: RwLock<Option<Connection>>,
    /// Held while opening a connection, so concurrent calls wait for one attempt.
    connecting: tokio::sync::Mutex<()>,
    prefix: Box<str>,
    /// `None`: the server's `TIME`.
    clock: Option<AnyClock>,
    timeout: Duration,
    grace_ms: u64,
    breaker: Breaker,
    fallback: Option<MemoryStore>,
}

enum Target {
    Single(redis::Client),
    Cluster(ClusterClient),
}

/// A standalone (or Valkey) connection or a cluster connection; both multiplexed and cheap to
/// clone.
#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(cmd, offset, count),
            Self::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.inner;
        f.debug_struct("RedisStore")
            .field("cluster", &matches!(i.target, Target::Cluster(_)))
            .field("prefix", &i.prefix)
            .field("server_time", &i.clock.is_none())
            .field("timeout", &i.timeout)
            .field("breaker", &i.breaker.state())
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
    /// rest of the cluster is discovered from them).
    pub fn cluster_builder<I>(nodes: I) -> RedisStoreBuilder
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        RedisStoreBuilder::new(nodes.into_iter().map(Into::into).collect(), true)
    }

    /// Opens the connection now (and loads the script), instead of on the first request.
    ///
    /// # Errors
    /// [`StoreError::Backend`] when Redis refuses, [`StoreError::Timeout`] when it does not
    /// answer within the store's timeout.
    pub async fn connect(&self) -> Result<(), StoreError> {
        let inner = &self.inner;
        let attempt = async {
            let mut conn = inner.connection().await?;
            SCRIPT.load_async(&mut conn).await?;
            FAST.load_async(&mut conn).await.map(drop)
        };
        match tokio::time::timeout(inner.timeout, attempt).await {
            Ok(result) => result.map_err(StoreError::backend),
            Err(_) => Err(StoreError::Timeout(inner.timeout)),
        }
    }

    /// The circuit breaker's state now.
    #[must_use]
    pub fn breaker_state(&self) -> BreakerState {
        self.inner.breaker.state()
    }
}

/// A policy bound to a [`RedisStore`] ([`Store::bind`]): validated for the scripts, with its key
/// prefix and its part of every script call rendered, and bound to the local fallback store.
pub struct RedisPolicy {
    policy: Policy,
    /// The state key's parts around the key: `{prefix}{{policy}|` and `}:{fingerprint}`.
    key_parts: (String, String),
    prepared: Prepared,
    local: Option<MemoryPolicy>,
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

    /// The Redis key of the state of `key` (for inspection: `TTL`, `GET`, `HGETALL`).
    /// Sliding-log policies also use `{this}:z1`, `{this}:z2`, ... per tier.
    #[must_use]
    pub fn state_key(&self, key: &Key) -> String {
        call::state_key(&self.key_parts, key)
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
    cost: u64,
    charges: Charges,
}

impl Inner {
    fn now(&self) -> Now {
        self.clock.as_ref().map_or(Now::Server, |c| Now::At(c.now()))
    }

    fn current(&self) -> Option<Connection> {
        self.conn.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    async fn connection(&self) -> RedisResult<Connection> {
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let conn = match &self.target {
            Target::Single(client) => {
                // No retries inside the manager: each failed attempt returns at once and the
                // next call (or breaker probe) starts a new one, so recovery is not held back
                // by the manager's own backoff (seconds to minutes).
                let config = ConnectionManagerConfig::new()
                    .set_number_of_retries(0)
                    .set_connection_timeout(self.timeout);
                Connection::Single(
                    ConnectionManager::new_with_config(client.clone(), config).await?,
                )
            }
            Target::Cluster(client) => Connection::Cluster(client.get_async_connection().await?),
        };
        *self.conn.write().unwrap_or_else(PoisonError::into_inner) = Some(conn.clone());
        Ok(conn)
    }

    /// Forgets the connection: the next call opens a new one.
    fn discard_connection(&self) {
        self.conn.write().unwrap_or_else(PoisonError::into_inner).take();
    }

    /// Runs one script call through the circuit breaker, within the timeout.
    async fn eval(&self, call: &Call<'_>) -> Result<Vec<i64>, StoreError> {
        let probe = match self.breaker.admit() {
            Admit::Call => None,
            Admit::Probe(probe) => Some(probe),
            Admit::Reject => return Err(StoreError::CircuitOpen),
        };
        let attempt = async {
            let mut conn = self.connection().await?;
            match call.invocation().invoke_async::<Vec<i64>>(&mut conn).await {
                // The connection's last (re)connect was refused, so nothing was sent; that
                // refusal has started a new attempt: wait for it rather than fail, so that one
                // probe suffices once Redis is back. Only refusals: a call that may have
                // reached the server is never sent twice.
                Err(e) if e.is_connection_refusal() => {
                    call.invocation().invoke_async::<Vec<i64>>(&mut conn).await
                }
                result => result,
            }
        };
        let result = match tokio::time::timeout(self.timeout, attempt).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => Err(StoreError::backend(e)),
            Err(_) => Err(StoreError::Timeout(self.timeout)),
        };
        match (probe, result.is_ok()) {
            (Some(probe), true) => probe.success(),
            (Some(probe), false) => {
                self.discard_connection();
                probe.failure();
            }
            (None, true) => self.breaker.success(),
            (None, false) => self.breaker.failure(),
        }
        result
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

impl Store for RedisStore {
    type Bound = RedisPolicy;
    type Ticket = RedisTicket;

    fn bind(&self, policy: &Policy) -> Result<RedisPolicy, ConfigError> {
        call::validate(policy)?;
        let inner = &self.inner;
        Ok(RedisPolicy {
            policy: policy.clone(),
            key_parts: call::key_parts(&inner.prefix, policy),
            prepared: Prepared::new(policy, inner.grace_ms),
            local: inner.fallback.as_ref().map(|local| local.bind_policy(policy)),
        })
    }

    async fn check(
        &self,
        bound: &RedisPolicy,
        check: Check<'_>,
    ) -> Result<Verdict<RedisTicket>, StoreError> {
        let inner = &*self.inner;
        let state_key = bound.state_key(check.key);
        let call =
            Call::check(state_key, &bound.prepared, inner.now(), check.cost, check.max_delay);
        let decided = inner
            .eval(&call)
            .await
            .and_then(|reply| call::decode(&bound.policy, check.cost, &reply));
        match decided {
            Ok((decision, charges)) => {
                let ticket = charges.filter(|_| check.cost > 0 && check.ticket).map(|charges| {
                    let state_key = call.keys.into_iter().next().unwrap_or_default();
                    RedisTicket(Charged::Remote(Box::new(Remote {
                        state_key,
                        cost: check.cost,
                        charges,
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
                    local.settle_now(local_bound, &ticket, cost);
                }
                Ok(())
            }
            Charged::Remote(remote) => {
                if cost == remote.cost {
                    return Ok(());
                }
                let call = Call::settle(
                    remote.state_key,
                    &bound.prepared,
                    inner.now(),
                    remote.cost,
                    &remote.charges,
                    cost,
                );
                inner.eval(&call).await.map(drop)
            }
        }
    }
}

/// Configures a [`RedisStore`]; see [`RedisStore::builder`] and [`RedisStore::cluster_builder`].
#[must_use]
pub struct RedisStoreBuilder {
    nodes: Vec<String>,
    cluster: bool,
    prefix: String,
    clock: Option<AnyClock>,
    timeout: Duration,
    ttl_grace: Duration,
    threshold: u32,
    open_for: Duration,
    fallback: Option<MemoryStore>,
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("cluster", &self.cluster)
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl RedisStoreBuilder {
    fn new(nodes: Vec<String>, cluster: bool) -> Self {
        Self {
            nodes,
            cluster,
            prefix: DEFAULT_PREFIX.to_owned(),
            clock: None,
            timeout: DEFAULT_TIMEOUT,
            ttl_grace: Duration::ZERO,
            threshold: DEFAULT_FAILURE_THRESHOLD,
            open_for: DEFAULT_OPEN_FOR,
            fallback: None,
        }
    }

    /// Prefix of every key (default `"tollgate:"`). Must not contain `{` or `}` (they would
    /// break the hash tag).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Decide at this clock's instants instead of the Redis server's `TIME` (default). Every
    /// instance must then share one time base: meant for deterministic tests with a
    /// [`FakeClock`](crate::clock::FakeClock). Keys still expire on Redis's clock, so give a
    /// [`ttl_grace`](Self::ttl_grace) that covers the drift between the two.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(AnyClock::new(clock));
        self
    }

    /// Per-call timeout, including connecting (default 100 ms); at least 1 ms.
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

    /// Opens the circuit breaker after `failure_threshold` consecutive failed calls (default 5;
    /// at least 1) and keeps it open for `open_for` (default 500 ms; at least 1 ms) before
    /// probing Redis with one call.
    pub fn circuit_breaker(mut self, failure_threshold: u32, open_for: Duration) -> Self {
        self.threshold = failure_threshold;
        self.open_for = open_for;
        self
    }

    /// Decides on this local store while Redis fails or the breaker is open, instead of
    /// returning an error. Each instance then enforces the policy on its own: a fleet of `n`
    /// admits up to `n` times the limit until Redis answers again. Charges made locally are
    /// settled locally.
    pub fn fallback(mut self, local: MemoryStore) -> Self {
        self.fallback = Some(local);
        self
    }

    /// Builds the store. Connects nothing yet.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the setting: `url` (none, several for a standalone
    /// server, or one the `redis` crate cannot parse), `prefix` (with `{` or `}`), `timeout`
    /// (under 1 ms), `circuit_breaker` (a threshold of 0 or an open period under 1 ms).
    pub fn build(self) -> Result<RedisStore, ConfigError> {
        let invalid = |setting, reason: String| ConfigError::Invalid { setting, reason };
        if self.prefix.contains(['{', '}']) {
            return Err(invalid(
                "prefix",
                format!("{:?} must not contain `{{` or `}}` (they end the hash tag)", self.prefix),
            ));
        }
        if self.timeout < Duration::from_millis(1) {
            return Err(invalid("timeout", "must be at least 1 ms".into()));
        }
        if self.threshold == 0 || self.open_for < Duration::from_millis(1) {
            return Err(invalid(
                "circuit_breaker",
                "the threshold must be at least 1 and the open period at least 1 ms".into(),
            ));
        }
        let bad = |e: redis::RedisError| invalid("url", e.to_string());
        let target = match (self.cluster, self.nodes.as_slice()) {
            (_, []) => return Err(invalid("url", "no redis url given".into())),
            (false, [url]) => Target::Single(redis::Client::open(url.as_str()).map_err(bad)?),
            (false, _) => {
                return Err(invalid("url", "a standalone redis takes one url".into()));
            }
            // The client's own retries (MOVED/ASK redirects, TRYAGAIN, reconnects) must fit in
            // one call: its defaults (16 retries, each after at least 1.28 s) keep requests that
            // callers gave up on retrying for minutes, and each failure sends the connection
            // back to refreshing slots, during which it serves nothing.
            (true, nodes) => Target::Cluster(
                ClusterClient::builder(nodes.iter().map(String::as_str))
                    .connection_timeout(self.timeout)
                    .response_timeout(self.timeout)
                    .retries(2)
                    .min_retry_wait(1)
                    .max_retry_wait(
                        u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX).max(2),
                    )
                    .retry_wait_formula(5, 2)
                    .build()
                    .map_err(bad)?,
            ),
        };
        let grace_ms = duration_to_nanos(self.ttl_grace).div_ceil(1_000_000);
        Ok(RedisStore {
            inner: Arc::new(Inner {
                target,
                conn: RwLock::new(None),
                connecting: tokio::sync::Mutex::new(()),
                prefix: self.prefix.into(),
                clock: self.clock,
                timeout: self.timeout,
                grace_ms,
                breaker: Breaker::new(self.threshold, self.open_for),
                fallback: self.fallback,
            }),
        })
    }
}
