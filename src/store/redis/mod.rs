//! [`RedisStore`]: limits shared by a fleet through Redis, Redis Cluster or Valkey (SPEC §8).

mod breaker;
mod call;

use std::fmt;
use std::future::Future;
use std::sync::{Arc, LazyLock, PoisonError, RwLock};
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Script, Value};

pub use breaker::BreakerState;
use breaker::{Admit, Breaker};
use call::{Call, Now};

use super::{Check, MemoryStore, Store, Ticket, Verdict};
use crate::clock::{Clock, duration_to_nanos};
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

/// Default prefix of every key the store writes: `"tollgate:"`.
pub const DEFAULT_PREFIX: &str = "tollgate:";

/// Default per-call timeout: 100 ms. A call that takes longer counts as failed.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_millis(100);

/// Default number of consecutive failed calls that opens the circuit breaker: 5.
pub const DEFAULT_FAILURE_THRESHOLD: u32 = 5;

/// Default time the circuit breaker stays open before it probes Redis again: 500 ms.
pub const DEFAULT_OPEN_FOR: Duration = Duration::from_millis(500);

/// The longest span a tier may cover on Redis: 2^50 ns, about 13 days. This bounds the
/// period, `burst x period / count` (the GCRA tolerance), and the shaping delay (longer delays
/// are clamped to it). The script computes in Lua's doubles, exact below 2^53, so the store
/// refuses (with [`ConfigError::UnsupportedByStore`]) tiers it could not decide exactly.
pub const MAX_HORIZON: Duration = Duration::from_nanos(call::MAX_HORIZON_NANOS);

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
/// use tollgate::{MemoryStore, Policy, Quota, RateLimitLayer, RedisStore};
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
    clock: Option<Arc<dyn Clock>>,
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
            Ok(result) => result.map_err(|e| StoreError::Backend(e.to_string())),
            Err(_) => Err(StoreError::Timeout(inner.timeout)),
        }
    }

    /// The circuit breaker's state now.
    #[must_use]
    pub fn breaker_state(&self) -> BreakerState {
        self.inner.breaker.state()
    }

    /// The Redis key of the hash holding `key`'s state under `policy` (for inspection: `TTL`,
    /// `HGETALL`). Sliding-log policies also use `{this}:z1`, `{this}:z2`, ... per tier.
    #[must_use]
    pub fn state_key(&self, policy: &Policy, key: &Key) -> String {
        call::state_key(&self.inner.prefix, policy, key)
    }
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
    async fn eval(&self, call: &Call) -> Result<Vec<i64>, StoreError> {
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
            Ok(Err(e)) => Err(StoreError::Backend(e.to_string())),
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
    fn fall_back(&self, error: StoreError, check: Check<'_>) -> Result<Verdict, StoreError> {
        let Some(local) = &self.fallback else { return Err(error) };
        tracing::debug!(%error, policy = check.policy.name(), "tollgate: redis unavailable; decided by the local fallback");
        let mut verdict = local.check_now(check)?;
        verdict.decision.source = Source::Fallback;
        if let Some(ticket) = &mut verdict.ticket {
            ticket.inner.fallback = true;
        }
        Ok(verdict)
    }
}

impl Store for RedisStore {
    fn validate(&self, policy: &Policy) -> Result<(), ConfigError> {
        call::validate(policy)
    }

    fn check(
        &self,
        check: Check<'_>,
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send + 'static {
        let inner = Arc::clone(&self.inner);
        let Check { policy, key, cost, max_delay, reserve } = check;
        let call = call::validate(policy).map(|()| {
            let state_key = call::state_key(&inner.prefix, policy, key);
            Call::check(state_key, policy, inner.now(), inner.grace_ms, cost, max_delay)
        });
        let (policy, key) = (policy.clone(), key.clone());
        async move {
            let call = call?;
            let decided =
                inner.eval(&call).await.and_then(|reply| call::decode(&policy, cost, &reply));
            match decided {
                Ok((decision, charges)) => {
                    let ticket = charges
                        .filter(|_| cost > 0 && reserve)
                        .map(|charges| Ticket::charged(policy, key, cost, charges, false));
                    Ok(Verdict { decision, ticket })
                }
                Err(error) => inner.fall_back(
                    error,
                    Check { policy: &policy, key: &key, cost, max_delay, reserve },
                ),
            }
        }
    }

    fn settle(
        &self,
        ticket: Ticket,
        cost: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'static {
        let inner = Arc::clone(&self.inner);
        async move {
            if cost == ticket.inner.cost {
                return Ok(());
            }
            if ticket.inner.fallback {
                if let Some(local) = &inner.fallback {
                    local.settle_now(&ticket, cost);
                }
                return Ok(());
            }
            let state_key = call::state_key(&inner.prefix, &ticket.inner.policy, &ticket.inner.key);
            let call = Call::settle(state_key, &ticket, inner.now(), inner.grace_ms, cost);
            inner.eval(&call).await.map(drop)
        }
    }
}

/// Configures a [`RedisStore`]; see [`RedisStore::builder`] and [`RedisStore::cluster_builder`].
#[must_use]
pub struct RedisStoreBuilder {
    nodes: Vec<String>,
    cluster: bool,
    prefix: String,
    clock: Option<Arc<dyn Clock>>,
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

    /// Prefix of every key (default [`DEFAULT_PREFIX`]). Must not contain `{` or `}` (they
    /// would break the hash tag).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Decide at this clock's instants instead of the Redis server's `TIME` (default). Every
    /// instance must then share one time base: meant for deterministic tests with a
    /// [`FakeClock`](crate::clock::FakeClock). Keys still expire on Redis's clock, so give a
    /// [`ttl_grace`](Self::ttl_grace) that covers the drift between the two.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// Per-call timeout, including connecting (default [`DEFAULT_TIMEOUT`]). At least 1 ms.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Extra time keys live past the instant their state is back to full (default 0: server
    /// time and key expiry share Redis's clock). Rounded up to milliseconds.
    pub fn ttl_grace(mut self, grace: Duration) -> Self {
        self.ttl_grace = grace;
        self
    }

    /// Opens the circuit breaker after `failure_threshold` consecutive failed calls (at least
    /// 1; default [`DEFAULT_FAILURE_THRESHOLD`]) and keeps it open for `open_for` (default
    /// [`DEFAULT_OPEN_FOR`]) before probing Redis with one call.
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
    /// [`ConfigError::Invalid`] for a URL the `redis` crate cannot parse, no URL, or a prefix
    /// with `{` or `}`.
    pub fn build(self) -> Result<RedisStore, ConfigError> {
        if self.prefix.contains(['{', '}']) {
            return Err(ConfigError::Invalid(format!(
                "redis key prefix {:?} must not contain `{{` or `}}`",
                self.prefix
            )));
        }
        let bad = |e: redis::RedisError| ConfigError::Invalid(format!("redis url: {e}"));
        let target = match (self.cluster, self.nodes.as_slice()) {
            (_, []) => return Err(ConfigError::Invalid("no redis url given".into())),
            (false, [url]) => Target::Single(redis::Client::open(url.as_str()).map_err(bad)?),
            (false, _) => {
                return Err(ConfigError::Invalid("one url for a standalone redis".into()));
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
