//! One Redis server (a standalone server, or a Redis Cluster master): its connection, its
//! circuit breaker, and the queue through which concurrent checks are coalesced.
//!
//! Checks waiting for the node are taken together, grouped by script family (plain policies
//! apart: see [`Item::plain`]) and Cluster slot, and each group is sent as one script call that
//! decides its checks in order (so the script's fixed cost is paid once per group). A few
//! groups are in flight at once; what arrives
//! meanwhile forms the next batch, so batches grow with the load, up to a size the server
//! answers in a quarter of the timeout at the time per check its calls have shown
//! ([`batch_cap`]).
//!
//! Each check has its own deadline: the instant it was submitted plus the store's timeout. A
//! late call fails only the checks whose deadline passed, and only when the server is behind
//! ([`Health`] holds the rule and its bound: past its deadline a check gives up once a call has
//! waited a whole timeout for a reply, and always at ten timeouts); a check late only
//! because this machine is busy keeps waiting while the server answers. A check that has given
//! up by the time its batch is formed is not sent (so Redis does not charge it). A check that
//! gave up while its call was on the wire may still be charged by that call: it was answered
//! "timeout" once (and decided by the fallback or the failure policy), and the call's late
//! answer to it is dropped, never delivered twice.
//!
//! The node's calls run on the store's own thread ([`io`](super::io)), so that a reply is read
//! when it arrives, not after the application's queued tasks.
//!
//! The breaker, too, is fed by the server's answers, not by how long checks waited on this
//! process: it counts a call as failed only when no reply came within
//! [`Settings::call_timeout`] (twice the timeout) of the call being sent, and a call that
//! returns counts as a success even when some of its checks gave up meanwhile.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock, Weak};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::time::Instant;

use super::breaker::{Admit, Breaker, BreakerState};
use super::health::Health;
use super::io::Io;
use super::script::{self, Family, Now, PolicyArgs};
use crate::clock::{AnyClock, duration_to_nanos};
use crate::error::StoreError;
use crate::metrics::NodeMetrics;

/// Checks in one script call, at most.
const MAX_BATCH: usize = 256;

/// The time one check of a family is taken to add to a call before any call of it is measured:
/// about what the costliest scripts take of Redis's time (the sliding log, several tier kinds:
/// 27–118 µs a check), ten times the cheap ones. Smaller first batches were tried (400 µs):
/// under load the extra round trips left more checks late than the large first calls did.
const FIRST_GUESS: Duration = Duration::from_micros(100);

/// Checks in one script call when each adds `per_check` to the call's time: as many as fit in
/// a quarter of `timeout`, between 1 and [`MAX_BATCH`] (at 100 µs a check: 250 at the default
/// 100 ms, 125 at 50 ms, 25 at 10 ms).
pub(crate) fn batch_cap(timeout: Duration, per_check: Duration) -> usize {
    let fits = timeout.as_nanos() / 4 / per_check.as_nanos().max(1);
    usize::try_from(fits).unwrap_or(MAX_BATCH).clamp(1, MAX_BATCH)
}

/// Where the time per check of calls of `family`'s script, of plain policies or not, is kept in
/// [`Node`]'s measures.
fn lane(family: Family, plain: bool) -> usize {
    2 * family as usize + usize::from(plain)
}

/// Calls smaller than this (or than the cap, if smaller) say little of the time per check (the
/// round trip dominates) and are not measured.
const MEASURED_FROM: usize = 16;

/// Numbers of the checks in one script call, at most: the script unpacks them at once, and Lua
/// returns at most a few thousand values from one call.
const MAX_NUMBERS: usize = 4000;

/// Script calls in flight on one node at once.
const IN_FLIGHT: usize = 2;

/// A batch's answer to one check: its numbers of the reply, and the instant decided at
/// (nanoseconds).
pub(crate) type Answer = Result<(Vec<i64>, u64), StoreError>;

/// One check (or settlement) waiting to be sent.
pub(crate) struct Item {
    pub(crate) family: Family,
    /// Whether its policy is plain. Plain policies and the others of a family run one script,
    /// but are sent in calls of their own: a call holding only policies of whole-unit GCRA
    /// rate tiers (none of them plain: those run `gcra.lua`) takes the flat path (`kinds_flat.lua`),
    /// which one plain bucket's check in it would forgo.
    pub(crate) plain: bool,
    /// The Cluster slot of its keys (0 on a standalone server).
    pub(crate) slot: u16,
    /// The state key first, then any sliding-log sets.
    pub(crate) keys: Vec<String>,
    pub(crate) policy: Arc<PolicyArgs>,
    /// The check (`script::Prepared::check` / `settle`).
    pub(crate) record: Vec<f64>,
    /// How many numbers it adds to the reply.
    pub(crate) reply_len: usize,
    /// When its waiting side gives up: submitted + the store's timeout.
    pub(crate) deadline: Instant,
    /// The injected clock's reading when it was submitted (nanoseconds; `None` with the
    /// server's `TIME`). Read on the caller's side: the store's own thread runs another tokio
    /// runtime, whose clock a clock following tokio's time (paused, advanced) does not see.
    pub(crate) at: Option<u64>,
    pub(crate) answer: oneshot::Sender<Answer>,
}

/// What every node shares with its store.
pub(crate) struct Settings {
    /// How long a check waits for a silent server, time queued included ([`Health`]).
    pub(crate) timeout: Duration,
    pub(crate) clock: Option<AnyClock>,
    pub(crate) threshold: u32,
    pub(crate) open_for: Duration,
    /// Whether checks Redis cannot decide go to a local fallback (for the breaker's log).
    pub(crate) fallback: bool,
    /// The thread the nodes' calls and connections run on.
    pub(crate) io: Io,
}

impl Settings {
    /// How long a script call may take from being sent to its reply before the breaker counts
    /// it as failed: twice the timeout, so that a reply slowed by a busy machine still counts
    /// as an answer. The call's checks still waiting then get [`StoreError::Timeout`] of this.
    pub(crate) fn call_timeout(&self) -> Duration {
        self.timeout.saturating_mul(2)
    }
}

pub(crate) struct Node {
    pub(crate) addr: Arc<str>,
    client: redis::Client,
    /// The connection, opened on first use. A failed breaker probe empties it, so that the
    /// next probe starts from a new connection. Read (and cloned) by every call; written only
    /// to replace it.
    conn: RwLock<Option<ConnectionManager>>,
    /// Held while opening a connection, so concurrent calls wait for one attempt.
    connecting: tokio::sync::Mutex<()>,
    pub(crate) breaker: Breaker,
    /// Whether the server keeps up, from its replies: when late checks give up.
    health: Health,
    /// Per script family ([`Family::ALL`] order) and per [`Item::plain`] (see [`lane`]), the
    /// time a check adds to a call, in nanoseconds: a moving average over the calls measured
    /// (sent to replied, divided by their checks), which sizes the batches. Apart, as the
    /// scripts' costs differ tenfold: one script decides a family's plain policies and its
    /// policies with calendars, slots or penalty boxes, at costs per check far apart.
    per_check: [AtomicU64; 2 * Family::ALL.len()],
    settings: Arc<Settings>,
    /// The queue's sending end, once its dispatcher runs.
    queue: RwLock<Option<mpsc::UnboundedSender<Item>>>,
    /// What the server said of itself when the connection opened.
    info: RwLock<Option<ServerInfo>>,
    metrics: NodeMetrics,
}

/// What a Redis server said of itself (`INFO server`) when a connection to it opened.
///
/// ```no_run
/// use tollgate::store::{RedisStore, ServerKind};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::builder("redis://127.0.0.1:6380/").build()?;
/// store.connect().await?;
/// for server in store.servers() {
///     let name = if server.kind == ServerKind::Valkey { "Valkey" } else { "Redis" };
///     println!("{}: {name} {}", server.addr, server.version);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerInfo {
    /// `host:port`.
    pub addr: String,
    /// Redis or Valkey.
    pub kind: ServerKind,
    /// Its version, as it reports it (`7.0.15`, `8.0.1`).
    pub version: String,
}

/// The kind of server a [`RedisStore`](super::RedisStore) talks to.
///
/// ```no_run
/// use tollgate::store::{RedisStore, ServerKind};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::builder("redis://127.0.0.1:6380/").build()?;
/// store.connect().await?;
/// for server in store.servers() {
///     let name = if server.kind == ServerKind::Valkey { "Valkey" } else { "Redis" };
///     println!("{}: {name} {}", server.addr, server.version);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ServerKind {
    /// Redis (6.2 and later are supported).
    Redis,
    /// Valkey (7.2 and later are supported).
    Valkey,
}

impl ServerInfo {
    /// Reads an `INFO server` reply.
    fn parse(addr: &str, info: &str) -> Option<Self> {
        let field = |name: &str| {
            info.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_owned())
        };
        let (kind, version) = match field("valkey_version:") {
            Some(v) => (ServerKind::Valkey, v),
            None => (ServerKind::Redis, field("redis_version:")?),
        };
        Some(Self { addr: addr.to_owned(), kind, version })
    }

    /// Whether the version is one the scripts are tested against or newer.
    fn supported(&self) -> bool {
        let mut parts = self.version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        let version = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
        version
            >= match self.kind {
                ServerKind::Redis => (6, 2),
                ServerKind::Valkey => (7, 2),
            }
    }
}

impl Node {
    pub(crate) fn new(addr: Arc<str>, client: redis::Client, settings: Arc<Settings>) -> Self {
        let breaker = Breaker::new(Arc::clone(&addr), settings.threshold, settings.open_for)
            .with_fallback(settings.fallback);
        let metrics = NodeMetrics::new(&addr);
        let health = Health::new(settings.timeout);
        Self {
            addr,
            client,
            conn: RwLock::new(None),
            connecting: tokio::sync::Mutex::new(()),
            breaker,
            health,
            per_check: std::array::from_fn(|_| AtomicU64::new(duration_to_nanos(FIRST_GUESS))),
            settings,
            queue: RwLock::new(None),
            info: RwLock::new(None),
            metrics,
        }
    }

    /// What the server said of itself, once a connection opened.
    pub(crate) fn info(&self) -> Option<ServerInfo> {
        self.info.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub(crate) fn breaker_state(&self) -> BreakerState {
        self.breaker.state()
    }

    /// Queues `item`; its answer arrives on its channel. Starts the dispatcher on the store's
    /// thread when none runs (the first use, or its runtime ended). While the breaker is
    /// open the answer is [`StoreError::CircuitOpen`] at once, without waiting behind calls in
    /// flight.
    pub(crate) fn submit(self: &Arc<Self>, item: Item) {
        if self.breaker.state() == BreakerState::Open {
            let _ = item.answer.send(Err(StoreError::CircuitOpen));
            return;
        }
        let queued = {
            let queue = self.queue.read().unwrap_or_else(PoisonError::into_inner);
            match queue.as_ref() {
                Some(tx) => tx.send(item).map_err(|e| e.0),
                None => Err(item),
            }
        };
        let Err(item) = queued else { return };
        let mut queue = self.queue.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(tx) = queue.as_ref() {
            if let Err(e) = tx.send(item) {
                // The dispatcher's runtime is gone: start a new one below.
                *queue = None;
                return self.start(&mut queue, e.0);
            }
            return;
        }
        self.start(&mut queue, item);
    }

    /// Waits for the answer to a check submitted with `deadline`: until the deadline, then for
    /// as long as the server keeps up ([`Health::gives_up`]).
    ///
    /// # Errors
    /// [`StoreError::Timeout`] (the store's timeout) when the check gives up; the call's error.
    pub(crate) async fn wait(
        &self,
        deadline: Instant,
        answer: oneshot::Receiver<Answer>,
    ) -> Answer {
        let mut answer = answer;
        let mut until = deadline;
        loop {
            // An answer sent before `until` wins even when this task is polled after it (a busy
            // process): `timeout_at` polls the answer first.
            match tokio::time::timeout_at(until, &mut answer).await {
                Ok(answered) => {
                    return answered
                        .unwrap_or_else(|_| Err(StoreError::backend("redis call abandoned")));
                }
                Err(_) => match self.health.gives_up(deadline, Instant::now()) {
                    Some(next) => until = next,
                    None => return Err(StoreError::Timeout(self.settings.timeout)),
                },
            }
        }
    }

    fn start(self: &Arc<Self>, queue: &mut Option<mpsc::UnboundedSender<Item>>, item: Item) {
        let handle = match self.settings.io.handle() {
            Ok(handle) => handle,
            Err(error) => {
                let _ = item.answer.send(Err(error));
                return;
            }
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let _ = tx.send(item);
        *queue = Some(tx);
        handle.spawn(Self::dispatch(Arc::downgrade(self), rx));
    }

    /// Runs `task` on the store's thread ([`io`](super::io)), where the node's connection
    /// lives, and returns its output.
    ///
    /// # Errors
    /// [`StoreError::Backend`] when the thread is not running.
    pub(crate) async fn on_io<F, Fut>(self: &Arc<Self>, task: F) -> Result<Fut::Output, StoreError>
    where
        F: FnOnce(Arc<Self>) -> Fut,
        Fut: Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        let handle = self.settings.io.handle()?;
        handle.spawn(task(Arc::clone(self))).await.map_err(StoreError::backend)
    }

    /// The time a check of `family` (of plain policies or not) adds to a call, as measured so
    /// far (nanoseconds).
    fn per_check(&self, family: Family, plain: bool) -> u64 {
        self.per_check[lane(family, plain)].load(Ordering::Relaxed).max(1)
    }

    /// Checks of `family` in one call: as many as the server answers in a quarter of the
    /// timeout, at the time per check measured so far.
    fn batch_cap(&self, family: Family, plain: bool) -> usize {
        batch_cap(self.settings.timeout, Duration::from_nanos(self.per_check(family, plain)))
    }

    /// A call of `checks` checks of `family` was answered `took` after its sending: the time
    /// per check moves half the way to what this call shows when it is longer, a quarter when
    /// shorter. Under load, Redis takes longer per check (its cores are shared), and batches
    /// shrink at once so that replies keep coming within the timeout; they grow back as the
    /// server speeds up.
    fn measured(&self, family: Family, plain: bool, took: Duration, checks: usize) {
        if checks == 0 || checks < MEASURED_FROM.min(self.batch_cap(family, plain)) {
            return;
        }
        let sample = duration_to_nanos(took) / checks as u64;
        let old = self.per_check(family, plain);
        let new = if sample > old { old / 2 + sample / 2 } else { old - old / 4 + sample / 4 };
        self.per_check[lane(family, plain)].store(new.max(1), Ordering::Relaxed);
    }

    /// Takes what waits, as many checks as the server is expected to answer in a quarter of the
    /// timeout (each counted at its family's measured time, [`Node::per_check`]; at most
    /// [`MAX_BATCH`]), groups them, sends each group as one call; at most [`IN_FLIGHT`] rounds
    /// of calls at once. Holds the node only while forming a
    /// batch, so that the store's last clone dropped ends it (its queue closes).
    async fn dispatch(node: Weak<Self>, mut rx: mpsc::UnboundedReceiver<Item>) {
        let in_flight = Arc::new(Semaphore::new(IN_FLIGHT));
        loop {
            let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else { return };
            let mut items = Vec::new();
            let mut numbers = 0;
            let mut batch_of = None;
            while items.is_empty() {
                let Some(first) = rx.recv().await else { return };
                let Some(this) = node.upgrade() else { return };
                let budget = duration_to_nanos(this.settings.timeout) / 4;
                let mut spent = 0u64;
                let now = Instant::now();
                this.take(first, now, &mut items, &mut numbers, &mut spent);
                while items.len() < MAX_BATCH && numbers < MAX_NUMBERS && spent < budget {
                    match rx.try_recv() {
                        Ok(item) => this.take(item, now, &mut items, &mut numbers, &mut spent),
                        Err(_) => break,
                    }
                }
                batch_of = Some(this);
            }
            let Some(node) = batch_of else { return };
            let mut groups: BTreeMap<(Family, bool, u16), Vec<Item>> = BTreeMap::new();
            for item in items {
                groups.entry((item.family, item.plain, item.slot)).or_default().push(item);
            }
            tokio::spawn(async move {
                let calls: Vec<_> = groups
                    .into_iter()
                    .map(|((family, plain, _), group)| {
                        let node = Arc::clone(&node);
                        tokio::spawn(async move { node.call(family, plain, group).await })
                    })
                    .collect();
                for call in calls {
                    let _ = call.await;
                }
                drop(permit);
            });
        }
    }

    /// Adds `item` to the batch being formed, unless its waiting side gave up (or gives up now,
    /// [`Health::gives_up`]): it is then answered [`StoreError::Timeout`] and not sent, so
    /// Redis does not charge it.
    fn take(
        &self,
        item: Item,
        now: Instant,
        items: &mut Vec<Item>,
        numbers: &mut usize,
        spent: &mut u64,
    ) {
        if item.answer.is_closed() || self.health.gives_up(item.deadline, now).is_none() {
            let _ = item.answer.send(Err(StoreError::Timeout(self.settings.timeout)));
            return;
        }
        *numbers += item.record.len();
        *spent += self.per_check(item.family, item.plain);
        items.push(item);
    }

    /// Sends `items` (one family, plain or not, one slot) as one script call and answers each.
    async fn call(&self, family: Family, plain: bool, mut items: Vec<Item>) {
        let mut keys = Vec::new();
        let mut first_keys = Vec::with_capacity(items.len());
        for item in &mut items {
            first_keys.push(keys.len() + 1);
            keys.append(&mut item.keys);
        }
        let (policies, records) = script::batch(
            items.iter().zip(&first_keys).map(|(i, k)| (*k, &*i.policy, i.record.as_slice())),
        );
        // The batch decides at the latest instant its checks were made at (time never goes
        // back within a batch).
        let now = items.iter().filter_map(|i| i.at).max().map_or(Now::Server, Now::At);
        let args = [script::header(now), policies, records];
        let result = self.eval(family, plain, &keys, &args, items.len()).await;
        let at = result.and_then(|reply| Ok((script::decided_at(&reply)?, reply)));
        let (at, reply) = match at {
            Ok(ok) => ok,
            Err(error) => {
                let shared = Shared::from(error);
                for item in items {
                    let _ = item.answer.send(Err(shared.to_error()));
                }
                return;
            }
        };
        let body = &reply[..reply.len() - 2];
        if body.len() != items.iter().map(|i| i.reply_len).sum::<usize>() {
            for item in items {
                let _ = item.answer.send(Err(StoreError::backend("unexpected reply length")));
            }
            return;
        }
        let mut from = 0;
        let mut late = 0usize;
        for item in items {
            let part = body[from..from + item.reply_len].to_vec();
            from += item.reply_len;
            // A check whose waiting side gave up at its deadline was answered "timeout" (and
            // decided by the fallback or the failure policy); the charge made here stays.
            late += usize::from(item.answer.send(Ok((part, at))).is_err());
        }
        if late > 0 {
            tracing::debug!(node = %self.addr, late, "tollgate: a redis call answered after some of its checks had given up; they stay charged in redis");
        }
    }

    fn current(&self) -> Option<ConnectionManager> {
        self.conn.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub(crate) async fn connection(&self) -> redis::RedisResult<ConnectionManager> {
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(conn) = self.current() {
            return Ok(conn);
        }
        // No retries inside the manager: each failed attempt returns at once and the next call
        // (or breaker probe) starts a new one, so recovery is not held back by the manager's
        // own backoff (seconds to minutes).
        let config = ConnectionManagerConfig::new()
            .set_number_of_retries(0)
            .set_connection_timeout(self.settings.timeout);
        let mut conn = ConnectionManager::new_with_config(self.client.clone(), config).await?;
        if self.info().is_none() {
            let reply: String = redis::cmd("INFO").arg("server").query_async(&mut conn).await?;
            if let Some(info) = ServerInfo::parse(&self.addr, &reply) {
                if info.supported() {
                    tracing::info!(node = %self.addr, kind = ?info.kind, version = %info.version, "tollgate: connected to redis");
                } else {
                    tracing::warn!(node = %self.addr, kind = ?info.kind, version = %info.version, "tollgate: connected to a server older than Redis 6.2 / Valkey 7.2, which tollgate does not test");
                }
                *self.info.write().unwrap_or_else(PoisonError::into_inner) = Some(info);
            }
        }
        *self.conn.write().unwrap_or_else(PoisonError::into_inner) = Some(conn.clone());
        Ok(conn)
    }

    /// Forgets the connection: the next call opens a new one.
    fn discard_connection(&self) {
        self.conn.write().unwrap_or_else(PoisonError::into_inner).take();
    }

    /// One script call through the breaker, within [`Settings::call_timeout`].
    async fn eval(
        &self,
        family: Family,
        plain: bool,
        keys: &[String],
        args: &[Vec<u8>],
        checks: usize,
    ) -> Result<Vec<i64>, StoreError> {
        let probe = match self.breaker.admit() {
            Admit::Call => None,
            Admit::Probe(probe) => Some(probe),
            Admit::Reject => return Err(StoreError::CircuitOpen),
        };
        let invocation = || {
            let mut inv = family.script().prepare_invoke();
            for k in keys {
                inv.key(k.as_str());
            }
            for a in args {
                inv.arg(a.as_slice());
            }
            inv
        };
        let attempt = async {
            let mut conn = self.connection().await?;
            match invocation().invoke_async::<Vec<u8>>(&mut conn).await {
                // The connection's last (re)connect was refused, so nothing was sent; that
                // refusal has started a new attempt: wait for it rather than fail, so that one
                // probe suffices once Redis is back. Only refusals: a call that may have
                // reached the server is never sent twice.
                Err(e) if e.is_connection_refusal() => {
                    invocation().invoke_async::<Vec<u8>>(&mut conn).await
                }
                result => result,
            }
        };
        // Measured from here, when the call is sent (or its connection opened), not from when
        // its checks were submitted: time they queued on this process says nothing of Redis.
        let call_timeout = self.settings.call_timeout();
        let started = std::time::Instant::now();
        let pending = self.health.sending();
        let result = match tokio::time::timeout(call_timeout, attempt).await {
            Ok(Ok(reply)) => {
                pending.answered();
                self.measured(family, plain, started.elapsed(), checks);
                script::numbers(&reply)
            }
            Ok(Err(e)) => {
                let unheard = e.is_io_error()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal()
                    || e.is_timeout();
                if !unheard {
                    // The server's own error (a script error, a redirection): it answered.
                    pending.answered();
                }
                Err(StoreError::backend(e))
            }
            Err(_) => {
                pending.unanswered();
                Err(StoreError::Timeout(call_timeout))
            }
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
        self.metrics.call(started.elapsed());
        self.metrics.breaker(match self.breaker.state() {
            BreakerState::Closed => 0,
            BreakerState::HalfOpen => 1,
            BreakerState::Open => 2,
        });
        result
    }
}

/// A call's error, given to every check of the call: each gets a [`StoreError`] of the same
/// kind, whose source is the one backend error.
enum Shared {
    Timeout(Duration),
    CircuitOpen,
    Backend(Arc<dyn std::error::Error + Send + Sync>),
}

impl From<StoreError> for Shared {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::Timeout(d) => Self::Timeout(d),
            StoreError::CircuitOpen => Self::CircuitOpen,
            StoreError::Backend(source) => Self::Backend(Arc::from(source)),
        }
    }
}

impl Shared {
    fn to_error(&self) -> StoreError {
        match self {
            Self::Timeout(d) => StoreError::Timeout(*d),
            Self::CircuitOpen => StoreError::CircuitOpen,
            Self::Backend(source) => {
                StoreError::Backend(Box::new(SharedSource(Arc::clone(source))))
            }
        }
    }
}

/// One backend error shared by several [`StoreError`]s.
#[derive(Debug)]
struct SharedSource(Arc<dyn std::error::Error + Send + Sync>);

impl std::fmt::Display for SharedSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for SharedSource {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_fits_a_quarter_of_the_timeout() {
        let ms = Duration::from_millis;
        let us = Duration::from_micros;
        assert_eq!(batch_cap(ms(100), us(100)), 250);
        assert_eq!(batch_cap(ms(50), us(100)), 125);
        assert_eq!(batch_cap(ms(10), us(100)), 25);
        assert_eq!(batch_cap(ms(1), us(100)), 2);
        assert_eq!(batch_cap(ms(100), us(1)), MAX_BATCH);
        assert_eq!(batch_cap(ms(1), ms(1)), 1, "at least one");
        assert_eq!(batch_cap(ms(100), Duration::ZERO), MAX_BATCH);
    }

    #[test]
    fn batches_shrink_while_the_server_is_slow_and_grow_back() {
        let settings = Arc::new(Settings {
            timeout: Duration::from_millis(100),
            clock: None,
            threshold: 5,
            open_for: Duration::from_millis(500),
            fallback: true,
            io: Io::new(),
        });
        let client = redis::Client::open("redis://127.0.0.1:1/").unwrap();
        let node = Node::new("127.0.0.1:1".into(), client, settings);
        let log = Family::Log;
        assert_eq!(node.batch_cap(log, true), 250, "25 ms / 100 µs before any call");
        // A loaded server: 800 µs a check.
        for _ in 0..10 {
            let cap = node.batch_cap(log, true);
            node.measured(log, true, Duration::from_micros(800) * u32::try_from(cap).unwrap(), cap);
        }
        assert_eq!(node.batch_cap(log, true), 31, "25 ms / 800 µs");
        assert_eq!(node.batch_cap(Family::Gcra, true), 250, "each family is measured apart");
        assert_eq!(
            node.batch_cap(log, false),
            250,
            "a family's plain policies and its others (one script) are measured apart"
        );
        // Small calls say nothing.
        node.measured(log, true, Duration::from_millis(50), 3);
        assert_eq!(node.batch_cap(log, true), 31);
        // Back to 10 µs a check.
        for _ in 0..40 {
            let cap = node.batch_cap(log, true);
            node.measured(log, true, Duration::from_micros(10) * u32::try_from(cap).unwrap(), cap);
        }
        assert_eq!(node.batch_cap(log, true), MAX_BATCH);
    }

    #[test]
    fn the_server_kind_and_version_come_from_info() {
        let redis = "# Server\r\nredis_version:7.0.15\r\nredis_mode:standalone\r\n";
        let info = ServerInfo::parse("h:1", redis).unwrap();
        assert_eq!(
            (info.kind, info.version.as_str(), info.supported()),
            (ServerKind::Redis, "7.0.15", true)
        );
        let valkey =
            "# Server\r\nredis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:8.0.1\r\n";
        let info = ServerInfo::parse("h:1", valkey).unwrap();
        assert_eq!((info.kind, info.version.as_str()), (ServerKind::Valkey, "8.0.1"));
        let old = ServerInfo::parse("h:1", "redis_version:6.0.9\r\n").unwrap();
        assert!(!old.supported());
        assert!(ServerInfo::parse("h:1", "nothing").is_none());
    }
}
