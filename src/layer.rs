//! [`RateLimitLayer`] and its builder.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::request::Parts;
use http::{Response, StatusCode};
use tokio::sync::Semaphore;
use tower_layer::Layer;

use crate::decision::Decision;
use crate::error::ConfigError;
use crate::key::{KeyExtractor, PeerIp};
use crate::quota::Policy;
use crate::response::{HeaderStyle, Headers};
use crate::service::RateLimit;
use crate::store::{MemoryStore, Store};

/// Default bound on requests waiting at once while shaping: 1,024.
pub const DEFAULT_MAX_WAITERS: usize = 1024;

/// What to do with a request whose key cannot be read (SPEC §7).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKey {
    /// Answer with this status and a problem+json body (default: 400 Bad Request).
    Reject(StatusCode),
    /// Pass it on unlimited.
    Allow,
    /// Limit all such requests together in one shared bucket.
    Shared,
}

impl Default for MissingKey {
    fn default() -> Self {
        Self::Reject(StatusCode::BAD_REQUEST)
    }
}

/// What to do when the store cannot decide (SPEC §8). A store with a local fallback (Redis)
/// falls back before this applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnStoreError {
    /// Pass the request on unlimited (default: availability over strictness).
    #[default]
    FailOpen,
    /// Answer 503 Service Unavailable with `Retry-After: 1` and a problem+json body.
    FailClosed,
}

type CostFn = Arc<dyn Fn(&Parts) -> u64 + Send + Sync>;
type RefundFn = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;
type SettleFn = Arc<dyn Fn(&http::response::Parts) -> Option<u64> + Send + Sync>;
type RejectFn = Arc<dyn Fn(&Decision) -> Response<Body> + Send + Sync>;

/// Settings shared by every clone of the layer and its services.
pub(crate) struct Config<K, St> {
    pub(crate) policy: Policy,
    pub(crate) key: K,
    pub(crate) store: St,
    pub(crate) waiters: Option<Arc<Semaphore>>,
    /// The policy's rate-limit headers, prepared once.
    pub(crate) headers: Headers,
    pub(crate) settings: Settings,
}

/// The settings that do not change the layer's type.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) cost: Option<CostFn>,
    pub(crate) max_delay: Option<Duration>,
    pub(crate) max_waiters: usize,
    pub(crate) headers: HeaderStyle,
    pub(crate) missing_key: MissingKey,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) tarpit: Option<Duration>,
    pub(crate) refund_if: Option<RefundFn>,
    pub(crate) settle_cost: Option<SettleFn>,
    pub(crate) rejection: Option<RejectFn>,
    pub(crate) dry_run: bool,
}

/// A Tower layer that rate-limits requests by key under one [`Policy`].
///
/// Police (default) answers 429 at once; [`shape`](RateLimitLayerBuilder::shape) holds a
/// request until its reserved slot. Clones share state: add the same layer to several routes
/// and they share one budget; build separate layers for separate budgets.
///
/// ```
/// use axum::{Router, routing::get};
/// use tollgate::{Policy, Quota, RateLimitLayer};
///
/// let policy = Policy::single("per-ip", Quota::per_second(10)).unwrap();
/// let app: Router = Router::new()
///     .route("/", get(|| async { "hi" }))
///     .layer(RateLimitLayer::builder(policy).build().unwrap());
/// ```
pub struct RateLimitLayer<K = PeerIp, St = MemoryStore> {
    config: Arc<Config<K, St>>,
}

impl<K, St> Clone for RateLimitLayer<K, St> {
    fn clone(&self) -> Self {
        Self { config: Arc::clone(&self.config) }
    }
}

impl<K, St> fmt::Debug for RateLimitLayer<K, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("policy", &self.config.policy.name())
            .field("max_delay", &self.config.settings.max_delay)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// Starts a layer for `policy`, keyed by [`PeerIp`], in a new [`MemoryStore`].
    pub fn builder(policy: Policy) -> RateLimitLayerBuilder {
        RateLimitLayerBuilder {
            policy,
            key: PeerIp::new(),
            store: MemoryStore::new(),
            settings: Settings {
                cost: None,
                max_delay: None,
                max_waiters: DEFAULT_MAX_WAITERS,
                headers: HeaderStyle::default(),
                missing_key: MissingKey::default(),
                on_store_error: OnStoreError::default(),
                tarpit: None,
                refund_if: None,
                settle_cost: None,
                rejection: None,
                dry_run: false,
            },
        }
    }
}

impl<K, St> RateLimitLayer<K, St> {
    /// The policy this layer enforces.
    #[must_use]
    pub fn policy(&self) -> &Policy {
        &self.config.policy
    }

    /// The store.
    #[must_use]
    pub fn store(&self) -> &St {
        &self.config.store
    }
}

impl<S, K, St> Layer<S> for RateLimitLayer<K, St> {
    type Service = RateLimit<S, K, St>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, Arc::clone(&self.config))
    }
}

/// Builds a [`RateLimitLayer`]; see [`RateLimitLayer::builder`].
#[must_use]
pub struct RateLimitLayerBuilder<K = PeerIp, St = MemoryStore> {
    policy: Policy,
    key: K,
    store: St,
    settings: Settings,
}

impl<K, St> fmt::Debug for RateLimitLayerBuilder<K, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayerBuilder")
            .field("policy", &self.policy.name())
            .finish_non_exhaustive()
    }
}

impl<K, St> RateLimitLayerBuilder<K, St> {
    /// Sets the key extractor (default [`PeerIp`]).
    pub fn key<K2: KeyExtractor>(self, key: K2) -> RateLimitLayerBuilder<K2, St> {
        RateLimitLayerBuilder {
            policy: self.policy,
            key,
            store: self.store,
            settings: self.settings,
        }
    }

    /// Sets the store (default: a new [`MemoryStore`]). Pass a clone of one store to several
    /// layers to keep their states in one place; policy names must then differ.
    pub fn store<St2: Store>(self, store: St2) -> RateLimitLayerBuilder<K, St2> {
        RateLimitLayerBuilder { policy: self.policy, key: self.key, store, settings: self.settings }
    }

    /// Every request costs `units` (default 1).
    pub fn cost(mut self, units: u64) -> Self {
        self.settings.cost = Some(Arc::new(move |_| units));
        self
    }

    /// Computes each request's cost in units from its head, e.g. from `Content-Length`.
    pub fn cost_fn(mut self, f: impl Fn(&Parts) -> u64 + Send + Sync + 'static) -> Self {
        self.settings.cost = Some(Arc::new(f));
        self
    }

    /// Shapes instead of policing: a request that would conform within `max_delay` reserves
    /// its slot and waits for it; one that would wait longer is rejected as when policing
    /// (nginx `limit_req burst=N delay=M`). A request dropped while waiting gives its slot back.
    pub fn shape(mut self, max_delay: Duration) -> Self {
        self.settings.max_delay = Some(max_delay);
        self
    }

    /// Bounds how many requests may wait at once, for their shaped slot or in the
    /// [`tarpit`](Self::tarpit) (default [`DEFAULT_MAX_WAITERS`]). When all places are taken,
    /// further requests are policed, and rejections are answered without the tarpit delay: a
    /// flood cannot pile up sleeping requests.
    pub fn max_waiters(mut self, n: usize) -> Self {
        self.settings.max_waiters = n;
        self
    }

    /// Which rate-limit headers responses carry (default [`HeaderStyle::Ietf`]).
    pub fn headers(mut self, style: HeaderStyle) -> Self {
        self.settings.headers = style;
        self
    }

    /// What to do with requests without a key (default: 400).
    pub fn missing_key(mut self, missing: MissingKey) -> Self {
        self.settings.missing_key = missing;
        self
    }

    /// What to do when the store fails (default [`OnStoreError::FailOpen`]).
    pub fn on_store_error(mut self, on_error: OnStoreError) -> Self {
        self.settings.on_store_error = on_error;
        self
    }

    /// Delays every rejection by `delay` before answering, to slow clients that retry in a
    /// tight loop (seed 002's tarpit). Each delayed rejection holds a place of the waiting room
    /// ([`max_waiters`](Self::max_waiters)); when it is full, rejections are answered at once.
    pub fn tarpit(mut self, delay: Duration) -> Self {
        self.settings.tarpit = Some(delay);
        self
    }

    /// Gives the charge back when the inner service answers with a status for which `f` is
    /// true, e.g. `|s| s.is_server_error()`.
    pub fn refund_if(mut self, f: impl Fn(StatusCode) -> bool + Send + Sync + 'static) -> Self {
        self.settings.refund_if = Some(Arc::new(f));
        self
    }

    /// Settles the cost from the response head: `Some(units)` replaces what was charged (more
    /// is charged unconditionally, less is refunded), `None` keeps it. For LLM-style token
    /// counts reported by the handler in a header or extension.
    pub fn settle_cost(
        mut self,
        f: impl Fn(&http::response::Parts) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.settings.settle_cost = Some(Arc::new(f));
        self
    }

    /// Replaces the 429 response. Rate-limit headers are still added (per
    /// [`headers`](Self::headers)); `Retry-After` is the callback's to set.
    pub fn rejection(
        mut self,
        f: impl Fn(&Decision) -> Response<Body> + Send + Sync + 'static,
    ) -> Self {
        self.settings.rejection = Some(Arc::new(f));
        self
    }

    /// Dry run (shadow mode): decide, charge and report headers, but never reject or delay.
    pub fn dry_run(mut self, on: bool) -> Self {
        self.settings.dry_run = on;
        self
    }

    /// Builds the layer.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] when `max_waiters` is 0 while shaping or with a tarpit;
    /// [`ConfigError::UnsupportedByStore`] when the store cannot run the policy (see
    /// [`Store::validate`]).
    pub fn build(self) -> Result<RateLimitLayer<K, St>, ConfigError>
    where
        St: Store,
    {
        self.store.validate(&self.policy)?;
        let settings = self.settings;
        let waits = settings.max_delay.is_some() || settings.tarpit.is_some();
        if waits && settings.max_waiters == 0 {
            return Err(ConfigError::Invalid(
                "max_waiters must be at least 1 when shaping or with a tarpit".into(),
            ));
        }
        let waiters = waits.then(|| Arc::new(Semaphore::new(settings.max_waiters)));
        let headers = Headers::new(&self.policy, settings.headers);
        Ok(RateLimitLayer {
            config: Arc::new(Config {
                policy: self.policy,
                key: self.key,
                store: self.store,
                waiters,
                headers,
                settings,
            }),
        })
    }
}
