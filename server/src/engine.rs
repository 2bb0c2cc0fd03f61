//! The engines that decide a limit: tollgate's [`Limiter`] over the memory store or Redis, and
//! the reference's fixed windows on Redis (the private `compat` module).
//!
//! A limit of envoyproxy/ratelimit's files is a fixed window of `requests_per_unit` per unit,
//! aligned to the Unix epoch as the reference aligns it: a [`Limiter`] of one
//! [`Algorithm::FixedWindow`] tier on the memory store (tollgate's windows start at multiples
//! of their period from the epoch), or the reference's own counters on Redis. A limit with an
//! extension runs the extension's policy on the memory store or on tollgate's
//! [`RedisStore`].
//!
//! Every limit is named by its descriptor's full key (`domain.key_value.key2`), and counts
//! per the request's values (`domain_key_value_key2_value2_`, the reference's key without its
//! window): one limit on one store is one budget, kept across reloads while the limit is
//! unchanged.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tollgate::clock::{Clock, FakeClock, MonotonicClock};
use tollgate::key::Key;
use tollgate::store::{Lease, MemoryStore, RedisStore, Store};
use tollgate::{Algorithm, Decision, Limiter, Policy, Quota, Reservation, StoreError};

use crate::compat;
use crate::config::{Extension, Report, Unit};
use crate::settings::{RedisKind, RedisTarget};

/// The stores a configuration is bound to, shared by every configuration loaded, and the
/// clock of their windows: [`memory`](Self::memory), or [`redis`](Self::redis) (which also
/// keeps a memory store, for `failure_mode: local`). See [`Config::build`](crate::config::Config::build)
/// for an example.
#[derive(Debug)]
pub struct Backends {
    memory: MemoryStore,
    redis: Option<RedisBackend>,
    clock: Clocks,
}

/// The clock windows are counted by: the system's, or a fake one for tests.
#[derive(Debug, Clone)]
enum Clocks {
    System(MonotonicClock),
    Fake(FakeClock),
}

impl Clocks {
    fn memory(&self) -> MemoryStore {
        let b = MemoryStore::builder();
        let b = match self {
            Self::System(c) => b.clock(c.clone()),
            Self::Fake(c) => b.clock(c.clone()),
        };
        let store = b.build().unwrap_or_default();
        // Swept on the runtime the engine is built on (the main one), not inline on the
        // serving thread of whichever call stores a key first.
        store.start_sweeping();
        store
    }

    fn now(&self) -> u64 {
        match self {
            Self::System(c) => c.now(),
            Self::Fake(c) => c.now(),
        }
    }
}

/// A Redis store and the lease policies it was built with.
type LeasedStore = (Vec<(String, Lease)>, RedisStore);

#[derive(Debug)]
struct RedisBackend {
    target: RedisTarget,
    timeout: Duration,
    compat: Arc<compat::Client>,
    /// tollgate's store for extension policies, and the lease policies it was built with: a
    /// configuration whose leases differ gets a new one.
    store: Mutex<Option<LeasedStore>>,
    clock: Option<FakeClock>,
}

impl Backends {
    /// The memory store alone.
    #[must_use]
    pub fn memory() -> Self {
        let clock = Clocks::System(MonotonicClock::new());
        Self { memory: clock.memory(), redis: None, clock }
    }

    /// The memory store alone, its windows counted by `clock` (nanoseconds since the Unix
    /// epoch): for tests.
    #[must_use]
    pub fn memory_with_clock(clock: FakeClock) -> Self {
        let clock = Clocks::Fake(clock);
        Self { memory: clock.memory(), redis: None, clock }
    }

    /// Redis at `target` (and the memory store for `failure_mode: local`). With `clock`,
    /// windows and tollgate's policies are counted by it (for tests); otherwise the reference's
    /// windows by this machine's clock, as the reference counts them, and tollgate's policies
    /// by the Redis server's.
    ///
    /// # Errors
    /// [`StoreError`] when Redis cannot be reached.
    pub async fn redis(
        target: RedisTarget,
        timeout: Duration,
        prefix: &str,
        jitter_max: u64,
        clock: Option<FakeClock>,
    ) -> Result<Self, StoreError> {
        let compat = Arc::new(compat::Client::connect(&target, timeout, prefix, jitter_max).await?);
        let fake = clock.clone();
        let clock = clock.map_or_else(|| Clocks::System(MonotonicClock::new()), Clocks::Fake);
        Ok(Self {
            memory: clock.memory(),
            redis: Some(RedisBackend {
                target,
                timeout,
                compat,
                store: Mutex::new(None),
                clock: fake,
            }),
            clock,
        })
    }

    /// The Unix time in seconds, by the windows' clock.
    #[must_use]
    pub fn now_secs(&self) -> u64 {
        self.clock.now() / 1_000_000_000
    }

    /// Whether limits are kept in Redis.
    #[must_use]
    pub fn is_redis(&self) -> bool {
        self.redis.is_some()
    }

    /// A binder for one configuration whose extensions lease `leases`.
    pub(crate) fn binder(&self, leases: Vec<(String, Lease)>) -> Result<Binder, String> {
        let redis = match &self.redis {
            None => {
                if let Some((name, _)) = leases.first() {
                    crate::once::warn(
                        "lease-memory",
                        &format!(
                            "tollgate-server: `lease` of {name} (and any other) is for Redis; the memory store decides every check exactly"
                        ),
                    );
                }
                None
            }
            Some(r) => {
                let mut held = r.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let store = match &*held {
                    Some((l, store)) if *l == leases => store.clone(),
                    _ => {
                        let store = r.build_store(&leases).map_err(|e| e.to_string())?;
                        *held = Some((leases, store.clone()));
                        store
                    }
                };
                Some((store, r.compat.clone()))
            }
        };
        Ok(Binder { memory: self.memory.clone(), redis })
    }
}

impl RedisBackend {
    fn build_store(&self, leases: &[(String, Lease)]) -> Result<RedisStore, tollgate::ConfigError> {
        let t = &self.target;
        let mut b = match &t.kind {
            RedisKind::Single => RedisStore::builder(t.nodes[0].clone()),
            RedisKind::Cluster => RedisStore::cluster_builder(t.nodes.clone()),
            RedisKind::Sentinel { master, node } => {
                let b = RedisStore::sentinel_builder(t.nodes.clone(), master.clone());
                match node {
                    Some(url) => b.master_url(url.clone()),
                    None => b,
                }
            }
        };
        // The domain's failure_mode decides what a failed check does.
        b = b.timeout(self.timeout).no_fallback();
        if let Some(c) = &self.clock {
            b = b.clock(c.clone());
        }
        for (name, lease) in leases {
            b = b.lease_policy(name.clone(), *lease);
        }
        b.build()
    }
}

/// Binds the limits of one configuration.
#[derive(Debug)]
pub(crate) struct Binder {
    memory: MemoryStore,
    redis: Option<(RedisStore, Arc<compat::Client>)>,
}

impl Binder {
    /// The engine of the limit `full_key`: `limit` per unit, or the extension's policy.
    pub(crate) fn engine(
        &self,
        full_key: &str,
        limit: Option<(u32, Unit)>,
        ext: Option<&Extension>,
    ) -> Result<Engine, String> {
        if let Some(ext) = ext {
            let local = Limiter::with_store(ext.policy.clone(), self.memory.clone())
                .map_err(|e| e.to_string())?;
            let reports: Arc<[Report]> = ext.reports.clone().into();
            return Ok(match &self.redis {
                None => Engine { kind: Kind::Memory { limiter: local, reports }, local: None },
                Some((store, _)) => {
                    let limiter = Limiter::with_store(ext.policy.clone(), store.clone())
                        .map_err(|e| e.to_string())?;
                    Engine {
                        kind: Kind::Redis { limiter, reports: reports.clone() },
                        local: Some(Kind::Memory { limiter: local, reports }),
                    }
                }
            });
        }
        let Some((count, unit)) = limit else {
            return Ok(Engine { kind: Kind::Unlimited, local: None });
        };
        let memory = || -> Result<Kind, String> {
            if count == 0 {
                return Ok(Kind::Never { unit });
            }
            let policy = Policy::builder(full_key)
                .algorithm(Algorithm::FixedWindow)
                .tier(
                    unit.name(),
                    Quota::new(u64::from(count), Duration::from_secs(unit.seconds())),
                )
                .build()
                .map_err(|e| e.to_string())?;
            let limiter =
                Limiter::with_store(policy, self.memory.clone()).map_err(|e| e.to_string())?;
            Ok(Kind::Window { limiter, count, unit })
        };
        Ok(match &self.redis {
            None => Engine { kind: memory()?, local: None },
            Some((_, client)) => Engine {
                kind: Kind::Compat { client: client.clone(), count, unit },
                local: Some(memory()?),
            },
        })
    }
}

/// How one limit is decided.
#[derive(Debug)]
pub(crate) struct Engine {
    kind: Kind,
    /// What decides when the store fails and the domain's `failure_mode` is `local`.
    local: Option<Kind>,
}

#[derive(Debug)]
enum Kind {
    Unlimited,
    /// `requests_per_unit: 0`: nothing is ever admitted.
    Never {
        unit: Unit,
    },
    Window {
        limiter: Limiter<MemoryStore>,
        count: u32,
        unit: Unit,
    },
    Compat {
        client: Arc<compat::Client>,
        count: u32,
        unit: Unit,
    },
    Memory {
        limiter: Limiter<MemoryStore>,
        reports: Arc<[Report]>,
    },
    Redis {
        limiter: Limiter<RedisStore>,
        reports: Arc<[Report]>,
    },
}

/// A charge that can still be given back (when another descriptor of the request is refused).
pub(crate) enum Charge {
    None,
    Memory(Reservation<MemoryStore>),
    Redis(Reservation<RedisStore>),
    Compat { client: Arc<compat::Client>, key: String, hits: u64 },
}

impl Charge {
    /// Keeps the charge.
    pub(crate) fn keep(self) {
        match self {
            Self::Memory(r) => drop(r),
            Self::Redis(r) => drop(r),
            Self::None | Self::Compat { .. } => {}
        }
    }

    /// Gives the charge back.
    pub(crate) async fn give_back(self) {
        let result = match self {
            Self::None => Ok(()),
            Self::Memory(r) => r.settle(0).await,
            Self::Redis(r) => r.settle(0).await,
            Self::Compat { client, key, hits } => client.refund(&key, hits).await.map(drop),
        };
        if let Err(error) = result {
            tracing::warn!(%error, "tollgate-server: could not give a refused request's charge back");
        }
    }
}

/// One descriptor's decision.
pub(crate) struct Verdict {
    pub(crate) admitted: bool,
    /// The limit reported (`current_limit`): units per unit, and its name.
    pub(crate) count: u32,
    pub(crate) unit: Unit,
    pub(crate) name: Option<Arc<str>>,
    pub(crate) remaining: u64,
    /// The units the counts below are out of (the tier's capacity: `burst` for GCRA).
    pub(crate) capacity: u64,
    /// Seconds until the reported limit is whole again.
    pub(crate) reset: u64,
    /// The count before and after this request's hits, as the reference counts them for its
    /// near_limit and over_limit stats.
    pub(crate) before: u64,
    pub(crate) after: u64,
    pub(crate) charge: Charge,
}

impl Verdict {
    fn window(
        admitted: bool,
        count: u32,
        unit: Unit,
        used: u64,
        hits: u64,
        now: u64,
        charge: Charge,
    ) -> Self {
        let limit = u64::from(count);
        let (before, after) = if admitted {
            (used.saturating_sub(hits), used)
        } else {
            (used, used.saturating_add(hits))
        };
        Self {
            admitted,
            count,
            unit,
            name: None,
            remaining: if admitted { limit.saturating_sub(used) } else { 0 },
            capacity: limit,
            reset: unit.seconds() - now % unit.seconds(),
            before,
            after,
            charge,
        }
    }

    fn from_decision(decision: &Decision, reports: &[Report], hits: u64, charge: Charge) -> Self {
        let tiers = decision.tiers();
        // The refusing tier, or the one closest to its limit.
        let i = decision
            .violated()
            .next()
            .or_else(|| (0..tiers.len()).min_by_key(|&i| tiers[i].remaining()))
            .unwrap_or(0);
        let (t, r) = (&tiers[i], &reports[i]);
        let admitted = decision.is_allowed();
        let cap = t.limit();
        let used = cap.saturating_sub(t.remaining());
        let (before, after) = if admitted {
            (used.saturating_sub(hits), used)
        } else {
            (used, used.saturating_add(hits))
        };
        Self {
            admitted,
            count: r.count,
            unit: r.unit,
            name: Some(r.name.clone()),
            remaining: if admitted { t.remaining() } else { 0 },
            capacity: cap,
            reset: t.reset_after().as_secs() + u64::from(t.reset_after().subsec_nanos() > 0),
            before,
            after,
            charge,
        }
    }
}

impl Engine {
    /// Whether this limit never refuses.
    pub(crate) fn is_unlimited(&self) -> bool {
        matches!(self.kind, Kind::Unlimited)
    }

    /// Whether a failure of the store can be decided locally.
    pub(crate) fn has_local(&self) -> bool {
        self.local.is_some()
    }

    /// Decides `hits` for the counter `base` at Unix second `now`, keeping the charge
    /// revocable when `revocable`.
    pub(crate) async fn decide(
        &self,
        base: &str,
        hits: u64,
        revocable: bool,
        now: u64,
    ) -> Result<Verdict, StoreError> {
        decide(&self.kind, base, hits, revocable, now).await
    }

    /// As [`decide`](Self::decide), on this process's memory (`failure_mode: local`).
    pub(crate) async fn decide_local(
        &self,
        base: &str,
        hits: u64,
        revocable: bool,
        now: u64,
    ) -> Result<Verdict, StoreError> {
        match &self.local {
            Some(kind) => decide(kind, base, hits, revocable, now).await,
            None => decide(&self.kind, base, hits, revocable, now).await,
        }
    }

    /// Gives `hits` back to the counter `base` (a descriptor with `is_negative_hits`), then
    /// reports it. A policy that cannot take units back without the charge's ticket (any but a
    /// fixed window or a one-tier GCRA) is only reported, and says so once in the log.
    pub(crate) async fn refund(
        &self,
        base: &str,
        hits: u64,
        now: u64,
    ) -> Result<Verdict, StoreError> {
        match &self.kind {
            Kind::Compat { client, count, unit } => {
                let key = client.key(base, now, unit.seconds());
                let used = client.refund(&key, hits).await?;
                Ok(Verdict::window(true, *count, *unit, used, 0, now, Charge::None))
            }
            Kind::Memory { limiter, .. } => {
                let key = Key::text(base);
                limiter.store().refund_now(limiter.bound(), &key, hits);
                let policy = limiter.policy();
                let window = policy.algorithm() == Algorithm::FixedWindow;
                if !window && !limiter.store().refunds_sync(limiter.bound()) {
                    crate::once::warn(
                        "refund",
                        "tollgate-server: is_negative_hits gives units back to fixed windows and one-tier GCRA policies only",
                    );
                }
                decide(&self.kind, base, 0, false, now).await
            }
            Kind::Window { limiter, .. } => {
                refund_window(limiter, base, hits);
                decide(&self.kind, base, 0, false, now).await
            }
            Kind::Redis { .. } => {
                crate::once::warn(
                    "refund-redis",
                    "tollgate-server: is_negative_hits gives units back to fixed windows and one-tier GCRA policies only",
                );
                decide(&self.kind, base, 0, false, now).await
            }
            Kind::Unlimited | Kind::Never { .. } => decide(&self.kind, base, 0, false, now).await,
        }
    }
}

/// Gives `hits` back to the current window of `base`.
fn refund_window(limiter: &Limiter<MemoryStore>, base: &str, hits: u64) {
    limiter.store().refund_now(limiter.bound(), &Key::text(base), hits);
}

async fn decide(
    kind: &Kind,
    base: &str,
    hits: u64,
    revocable: bool,
    now: u64,
) -> Result<Verdict, StoreError> {
    match kind {
        Kind::Unlimited => Ok(Verdict {
            admitted: true,
            count: 0,
            unit: Unit::Second,
            name: None,
            remaining: u64::from(u32::MAX),
            capacity: 0,
            reset: 0,
            before: 0,
            after: 0,
            charge: Charge::None,
        }),
        Kind::Never { unit } => {
            Ok(Verdict::window(hits == 0, 0, *unit, 0, hits, now, Charge::None))
        }
        Kind::Window { limiter, count, unit } => {
            let key = Key::text(base);
            let (decision, charge) = if revocable && hits > 0 {
                let r = limiter.reserve(&key, hits).await?;
                let d = r.decision().clone();
                (d, if r.decision().is_allowed() { Charge::Memory(r) } else { Charge::None })
            } else {
                (limiter.check_now(&key, hits), Charge::None)
            };
            let t = &decision.tiers()[0];
            let used = t.limit().saturating_sub(t.remaining());
            Ok(Verdict::window(decision.is_allowed(), *count, *unit, used, hits, now, charge))
        }
        Kind::Compat { client, count, unit } => {
            let key = client.key(base, now, unit.seconds());
            let (admitted, used) =
                client.charge(&key, hits, u64::from(*count), unit.seconds()).await?;
            let charge = if admitted && revocable && hits > 0 {
                Charge::Compat { client: client.clone(), key, hits }
            } else {
                Charge::None
            };
            Ok(Verdict::window(admitted, *count, *unit, used, hits, now, charge))
        }
        Kind::Memory { limiter, reports } => {
            let key = Key::text(base);
            if revocable && hits > 0 {
                let r = limiter.reserve(&key, hits).await?;
                let d = r.decision().clone();
                let charge = if d.is_allowed() { Charge::Memory(r) } else { Charge::None };
                Ok(Verdict::from_decision(&d, reports, hits, charge))
            } else {
                Ok(Verdict::from_decision(
                    &limiter.check_now(&key, hits),
                    reports,
                    hits,
                    Charge::None,
                ))
            }
        }
        Kind::Redis { limiter, reports } => {
            let key = Key::text(base);
            if revocable && hits > 0 {
                let r = limiter.reserve(&key, hits).await?;
                let d = r.decision().clone();
                let charge = if d.is_allowed() { Charge::Redis(r) } else { Charge::None };
                Ok(Verdict::from_decision(&d, reports, hits, charge))
            } else {
                Ok(Verdict::from_decision(
                    &limiter.check(&key, hits).await?,
                    reports,
                    hits,
                    Charge::None,
                ))
            }
        }
    }
}
