//! The Tower layer and its parts: [`RateLimitLayer`] and its builder, the service it makes
//! ([`RateLimit`]), its response future and bodies, and the types its settings and hooks use.
//! The layer, its builder and the settings most apps touch are also at the crate's root.
//!
//! ```
//! use tollgate::layer::{DecisionEvent, Observed, RateLimitLayer};
//! use tollgate::{Policy, Quota};
//!
//! let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_second(5)).unwrap())
//!     .on_decision(|event: &DecisionEvent<'_>| {
//!         if event.outcome == Observed::Limited {
//!             // count it, log it...
//!         }
//!     })
//!     .build()
//!     .unwrap();
//! # let _ = layer;
//! ```

mod body;
mod decide;
mod future;
mod lean;
mod linger;
mod messages;
mod meter;
mod metered;
mod observe;
mod plan;
mod refuse;
mod run;
mod scope;
mod serve;
mod service;
mod shared;
mod stream;
#[cfg(feature = "ws")]
pub(crate) mod websocket;

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Response, StatusCode};
use tokio::sync::Semaphore;
use tower_layer::Layer;

pub use body::{RequestBody, ResponseBody};
pub use future::ResponseFuture;
#[allow(deprecated)]
pub use lean::{LeanFuture, LeanLayer, LeanRateLimit};
pub use meter::Usage;
pub use observe::{DecisionEvent, LogKeys, Observed};
pub use scope::Unselected;
pub use service::{Bodies, Lean, Metered, RateLimit};
pub use stream::{MESSAGE_GRANT, STREAM_GRANT, StreamMode};

use observe::{Failing, HookFn, MissingKeys, Observer};
use scope::{Added, Condition, Scope, ScopeBuilder};

use crate::error::ConfigError;
use crate::headers::{Fields, HeaderFormat, HeaderStyle};
use crate::key::{Key, KeyExtractor, PeerIp, RequestHead};
use crate::limiter::Limiter;
use crate::policy::Policy;
use crate::quota::Priority;
use crate::rejection::RateLimited;
use crate::store::{MemoryStore, Store};

/// What to do with a request whose key cannot be read.
///
/// ```
/// use http::{HeaderName, Request, Response, StatusCode};
/// use tollgate::{MissingKey, Policy, Quota, RateLimitLayer, key::HeaderKey};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_second(10)).unwrap())
///     .key(HeaderKey::new(HeaderName::from_static("x-api-key")))
///     .missing_key(MissingKey::Reject(StatusCode::UNAUTHORIZED)) // the default answers 400
///     .build()
///     .unwrap();
/// let svc = layer.layer(service_fn(|_req| async { Ok::<_, String>(Response::new(String::new())) }));
/// let res = svc.oneshot(Request::new(String::new())).await.unwrap(); // no `x-api-key` header
/// assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MissingKey {
    /// Answer with this status and a problem+json body (default: 400 Bad Request).
    Reject(StatusCode),
    /// Pass it on unlimited.
    Allow,
    /// Limit all such requests together, under one shared key.
    Shared,
}

impl Default for MissingKey {
    fn default() -> Self {
        Self::Reject(StatusCode::BAD_REQUEST)
    }
}

/// What to do when the store cannot decide. A store with a local fallback
/// (`RedisStore`, by default) falls back before this applies. Either
/// way the failure is logged once when it starts and once when it ends, and counted
/// (`tollgate_store_failures_total`, feature `metrics`).
///
/// ```
/// use tollgate::{OnStoreError, Policy, Quota, RateLimitLayer};
///
/// let policy = Policy::single("api", Quota::per_second(10)).unwrap();
/// // Availability over strictness, by explicit choice (the default is `FailClosed`):
/// let layer = RateLimitLayer::builder(policy).on_store_error(OnStoreError::FailOpen).build();
/// assert!(layer.is_ok());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "config", derive(serde::Deserialize), serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum OnStoreError {
    /// Answer 503 Service Unavailable with `Retry-After: 1` and a problem+json body (a gRPC
    /// call: `UNAVAILABLE`). The default: a limiter that cannot decide does not silently stop
    /// limiting.
    #[default]
    FailClosed,
    /// Pass the request on unlimited: availability over strictness, by explicit choice.
    FailOpen,
}

type CostFn = Arc<dyn Fn(&RequestHead<'_>) -> u64 + Send + Sync>;
type PriorityFn = Arc<dyn Fn(&RequestHead<'_>) -> Priority + Send + Sync>;
type RefundFn = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;
type SettleFn = Arc<dyn Fn(&http::response::Parts) -> Option<u64> + Send + Sync>;
type RejectFn = Arc<dyn Fn(&RateLimited) -> Response<Bytes> + Send + Sync>;

/// What a request costs.
#[derive(Clone)]
enum Cost {
    Fixed(u64),
    PerRequest(CostFn),
}

/// Everything a service needs, shared by every clone of the layer and its services.
pub(crate) struct Config<K, St: Store> {
    /// The first policy: the only one without a selector.
    limiter: Limiter<St>,
    key: K,
    waiters: Option<Arc<Semaphore>>,
    settings: Settings,
    /// Filters, allow-lists and the selector with its other policies; `None` when none is
    /// set, so that a layer without them checks one pointer per request and nothing else.
    scope: Option<Box<Scope<St>>>,
    /// Metrics, the decision hook, the log's key format.
    observer: Observer,
    /// Whether the store is failing (logged once per change).
    failing: Failing,
    /// Whether a request without a key was refused yet (the first is logged as a warning).
    missing: MissingKeys,
    /// Whether an upgrade whose handler does not meter its socket was refused yet.
    #[cfg(feature = "ws")]
    unmetered: observe::Unmetered,
    /// Per policy, in [`limiter_at`](Config::limiter_at)'s order: what its requests need,
    /// decided once here instead of on every request.
    plans: Box<[plan::Plan]>,
}

/// The settings that do not change the layer's type.
#[derive(Clone)]
struct Settings {
    cost: Cost,
    /// The request's class, when picked per request (else every request is standard).
    priority: Option<PriorityFn>,
    max_delay: Option<Duration>,
    max_waiters: usize,
    headers: Fields,
    missing_key: MissingKey,
    on_store_error: OnStoreError,
    tarpit: Option<Duration>,
    refund_if: Option<RefundFn>,
    charge_method_not_allowed: bool,
    settle_cost: Option<SettleFn>,
    rejection: Option<RejectFn>,
    dry_run: bool,
    hook: Option<HookFn>,
    log_keys: LogKeys,
    explain_missing: bool,
    /// How bodies are metered, when [`on_stream`](RateLimitLayerBuilder::on_stream) chose:
    /// otherwise as the layer decides requests ([`Settings::stream`]).
    stream: Option<StreamMode>,
    /// The options set by a builder call, to tell at build time those their combination
    /// ignores ([`Settings::ignored`]).
    chosen: Vec<&'static str>,
}

impl Settings {
    /// Notes that the builder call `option` was made.
    fn chose(&mut self, option: &'static str) {
        if !self.chosen.contains(&option) {
            self.chosen.push(option);
        }
    }

    /// The options set that the layer ignores with the other settings and `policies`, and
    /// why.
    fn ignored<'a>(
        &self,
        policies: impl Iterator<Item = &'a Policy> + Clone,
    ) -> Vec<(&'static str, &'static str)> {
        use crate::quota::{TierKind, Unit};
        let tiers = || policies.clone().flat_map(|p| p.tiers().iter());
        let metered = |t: &crate::policy::Tier| {
            t.kind() != TierKind::Concurrency
                && matches!(
                    t.unit(),
                    Unit::RequestBytes
                        | Unit::ResponseBytes
                        | Unit::RequestMessages
                        | Unit::ResponseMessages
                )
        };
        let counts_requests = |t: &crate::policy::Tier| {
            t.kind() != TierKind::Concurrency && t.unit() == Unit::Requests
        };
        let reserved = |t: &crate::policy::Tier| t.reserve().is_some();
        let waits = self.max_delay.is_some() || self.tarpit.is_some();
        let ietf = matches!(self.headers.style, HeaderStyle::Ietf | HeaderStyle::Both);
        let rejects = matches!(self.missing_key, MissingKey::Reject(_));
        let checks: [(&'static str, bool, &'static str); 8] = [
            ("max_waiters", !waits, "nothing waits: the layer neither shapes nor has a tarpit"),
            (
                "on_stream",
                !tiers().any(metered),
                "no tier of its policies counts bytes or messages",
            ),
            ("tarpit", self.dry_run, "a dry run refuses nothing"),
            ("shape", self.dry_run, "a dry run delays nothing"),
            ("priority", !tiers().any(reserved), "no tier of its policies has a reserve"),
            (
                "settle_cost",
                !tiers().any(counts_requests),
                "no tier of its policies counts requests, whose charge a settled cost replaces",
            ),
            ("header_format", !ietf, "the layer writes no IETF RateLimit fields"),
            (
                "explain_missing_key",
                !rejects,
                "requests without a key are not refused (missing_key is not Reject)",
            ),
        ];
        checks
            .into_iter()
            .filter(|(option, ignored, _)| *ignored && self.chosen.contains(option))
            .map(|(option, _, why)| (option, why))
            .collect()
    }

    /// How tiers counting bytes or messages meter a stream: as chosen, or else as the layer
    /// decides requests (shaped when it shapes, policed when it polices).
    pub(crate) fn stream(&self) -> StreamMode {
        match (self.stream, self.max_delay) {
            (Some(mode), _) => mode,
            (None, Some(_)) => StreamMode::Shape,
            (None, None) => StreamMode::Police,
        }
    }
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            cost: Cost::Fixed(1),
            priority: None,
            max_delay: None,
            max_waiters: 1024,
            headers: Fields::default(),
            missing_key: MissingKey::default(),
            on_store_error: OnStoreError::default(),
            tarpit: None,
            refund_if: None,
            charge_method_not_allowed: false,
            settle_cost: None,
            rejection: None,
            dry_run: false,
            hook: None,
            log_keys: LogKeys::default(),
            explain_missing: cfg!(debug_assertions),
            stream: None,
            chosen: Vec::new(),
        }
    }
}

/// A Tower layer that rate-limits requests by key under one [`Policy`] (or one of several,
/// chosen per request by a [selector](RateLimitLayerBuilder::select)). A request over the
/// limit gets a 429 with `Retry-After` and the rate-limit headers (policing, the default), or
/// waits for its slot when the layer [shapes](RateLimitLayerBuilder::shape). Made by
/// [`builder`](Self::builder) (or [`with_limiter`](Self::with_limiter)), whose
/// [`build`](RateLimitLayerBuilder::build) refuses a configuration that cannot work
/// ([`ConfigError`]).
///
/// ```
/// use http::{Request, StatusCode};
/// use http_body_util::Full;
/// use bytes::Bytes;
/// use tollgate::{Policy, Quota, RateLimitLayer, RequestBody, key::GlobalKey};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_minute(1)).unwrap())
///     .key(GlobalKey)
///     .build()
///     .unwrap();
/// let svc = layer.layer(service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from("hi"))))
/// }));
/// let first = svc.clone().oneshot(Request::new(Full::default())).await.unwrap();
/// assert_eq!(first.status(), StatusCode::OK);
/// assert_eq!(first.headers()["ratelimit"], r#""api";r=0;t=60"#);
/// let second = svc.oneshot(Request::new(Full::default())).await.unwrap();
/// assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
/// assert_eq!(second.headers()["retry-after"], "60");
/// # }
/// ```
///
/// # How it works
///
/// Clones share state: add the same layer to several routes and they share one budget. So do layers built separately with one policy on one store:
/// for a budget per route, give each route a policy of its own name, or put the route in the
/// key (see [one policy, one budget](crate::store#one-policy-on-one-store-is-one-budget)).
///
/// gRPC calls (`content-type: application/grpc...`, see [`crate::grpc`]) are refused in gRPC
/// form: `grpc-status: 8` (`RESOURCE_EXHAUSTED`) with `grpc-retry-pushback-ms`, instead of a
/// 429 their clients could not read.
pub struct RateLimitLayer<K = PeerIp, St: Store = MemoryStore, B = Metered> {
    config: Arc<Config<K, St>>,
    /// How its service carries bodies: [`Metered`], or [`Lean`] (see [`Bodies`]).
    bodies: PhantomData<fn() -> B>,
}

impl<K, St: Store, B> Clone for RateLimitLayer<K, St, B> {
    fn clone(&self) -> Self {
        Self { config: Arc::clone(&self.config), bodies: PhantomData }
    }
}

impl<K, St: Store, B> fmt::Debug for RateLimitLayer<K, St, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("policy", &self.config.limiter.policy().name())
            .field("max_delay", &self.config.settings.max_delay)
            .finish_non_exhaustive()
    }
}

impl RateLimitLayer {
    /// Starts a layer for `policy`, keyed by [`PeerIp`], in a new [`MemoryStore`].
    pub fn builder(policy: Policy) -> RateLimitLayerBuilder {
        RateLimitLayerBuilder {
            source: Source::Policy(policy, MemoryStore::new()),
            key: PeerIp::new(),
            settings: Settings::default(),
            scope: ScopeBuilder::default(),
        }
    }
}

impl<St: Store> RateLimitLayer<PeerIp, St> {
    /// Starts a layer that decides through `limiter` (sharing its policy, store and state with
    /// code that calls it directly), keyed by [`PeerIp`].
    pub fn with_limiter(limiter: Limiter<St>) -> RateLimitLayerBuilder<PeerIp, St> {
        RateLimitLayerBuilder {
            source: Source::Limiter(limiter),
            key: PeerIp::new(),
            settings: Settings::default(),
            scope: ScopeBuilder::default(),
        }
    }
}

impl<K, St: Store, B> RateLimitLayer<K, St, B> {
    /// The limiter the layer decides through: that of the policy the builder started with.
    #[must_use]
    pub fn limiter(&self) -> &Limiter<St> {
        &self.config.limiter
    }

    /// The limiter of the policy named `name`: the first policy or one added with
    /// [`policy`](RateLimitLayerBuilder::policy); `None` when no policy has that name.
    #[must_use]
    pub fn limiter_for(&self, name: &str) -> Option<&Limiter<St>> {
        self.config.position(name).map(|i| self.config.limiter_at(i))
    }
}

impl<S, K, St: Store, B> Layer<S> for RateLimitLayer<K, St, B> {
    type Service = RateLimit<S, K, St, B>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit::new(inner, Arc::clone(&self.config))
    }
}

enum Source<St: Store> {
    Policy(Policy, St),
    Limiter(Limiter<St>),
}

/// Builds a [`RateLimitLayer`], started by [`RateLimitLayer::builder`] or
/// [`RateLimitLayer::with_limiter`]. Setters only collect values, and
/// [`build`](Self::build) checks them all, naming the setting it refuses.
///
/// ```
/// use tollgate::{HeaderStyle, MissingKey, OnStoreError, Policy, Quota, RateLimitLayer};
///
/// let policy = Policy::single("api", Quota::per_second(10)).unwrap();
/// let layer = RateLimitLayer::builder(policy.clone())
///     .missing_key(MissingKey::Shared)
///     .headers(HeaderStyle::Both)
///     .on_store_error(OnStoreError::FailOpen)
///     .refund_if(|status| status.is_server_error())
///     .build()
///     .unwrap();
/// // A setting that cannot work is refused, naming it.
/// let err = RateLimitLayer::builder(policy).cost(11).build().unwrap_err();
/// assert_eq!(err.to_string(), "cost: 11 units exceed the capacity of tier `api` (10 units)");
/// ```
#[must_use]
pub struct RateLimitLayerBuilder<K = PeerIp, St: Store = MemoryStore> {
    source: Source<St>,
    key: K,
    settings: Settings,
    scope: ScopeBuilder<St>,
}

impl<K, St: Store> fmt::Debug for RateLimitLayerBuilder<K, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let policy = match &self.source {
            Source::Policy(p, _) => p.name(),
            Source::Limiter(l) => l.policy().name(),
        };
        f.debug_struct("RateLimitLayerBuilder").field("policy", &policy).finish_non_exhaustive()
    }
}

impl<K, St: Store> RateLimitLayerBuilder<K, St> {
    /// Sets the key extractor (default [`PeerIp`]).
    pub fn key<K2: KeyExtractor>(self, key: K2) -> RateLimitLayerBuilder<K2, St> {
        RateLimitLayerBuilder {
            source: self.source,
            key,
            settings: self.settings,
            scope: self.scope,
        }
    }

    /// Sets the store: by default a new [`MemoryStore`], or the limiter's own for a builder
    /// made [`with_limiter`](RateLimitLayer::with_limiter) (this call replaces that limiter with
    /// its policy bound afresh to `store`). Layers given clones of one store keep their states
    /// in one place, apart by policy, and layers of one policy share its budget
    /// ([one policy, one budget](crate::store#one-policy-on-one-store-is-one-budget)).
    ///
    /// The default store reads the system's monotonic clock, which `tokio::time::pause()` and
    /// `tokio::time::advance` do not move: a test on tokio's paused clock gives the layer a
    /// store on a clock that follows it, such as the `testing` feature's
    /// `VirtualClock::memory_store()`.
    pub fn store<St2: Store>(self, store: St2) -> RateLimitLayerBuilder<K, St2> {
        let source = match self.source {
            Source::Policy(policy, _) => Source::Policy(policy, store),
            Source::Limiter(limiter) => Source::Policy(limiter.policy().clone(), store),
        };
        let scope = self.scope.restore();
        RateLimitLayerBuilder { source, key: self.key, settings: self.settings, scope }
    }

    /// Every request costs `units` (default 1). [`build`](Self::build) refuses a cost above a
    /// tier's capacity, which no request could ever pay.
    pub fn cost(mut self, units: u64) -> Self {
        self.settings.cost = Cost::Fixed(units);
        self
    }

    /// Computes each request's cost in units from its head, e.g. from `Content-Length`.
    pub fn cost_fn(mut self, f: impl Fn(&RequestHead<'_>) -> u64 + Send + Sync + 'static) -> Self {
        self.settings.cost = Cost::PerRequest(Arc::new(f));
        self
    }

    /// Picks each request's class ([`Priority`]) from its head, e.g. from a header, the route
    /// or an authenticated user (default: every request is [`Priority::Standard`]). Only tiers
    /// with a [`Reserve`](crate::Reserve) tell the classes apart, each class getting what the
    /// tier reserves for it.
    ///
    /// ```
    /// use tollgate::{Policy, Priority, Quota, RateLimitLayer, Reserve};
    ///
    /// let policy = Policy::builder("api")
    ///     .tier("second", Quota::per_second(100))
    ///     .reserve("second", Reserve::new().critical(20).standard(30))
    ///     .build()
    ///     .unwrap();
    /// let layer = RateLimitLayer::builder(policy)
    ///     .priority(|head| match head.uri.path() {
    ///         "/checkout" => Priority::Critical,
    ///         p if p.starts_with("/recommendations") => Priority::Sheddable,
    ///         _ => Priority::Standard,
    ///     })
    ///     .build()
    ///     .unwrap();
    /// ```
    pub fn priority(
        mut self,
        f: impl Fn(&RequestHead<'_>) -> Priority + Send + Sync + 'static,
    ) -> Self {
        self.settings.chose("priority");
        self.settings.priority = Some(Arc::new(f));
        self
    }

    /// Reads each request's class from the header `name` (`critical`, `standard` or
    /// `sheddable`, as [`Priority::from_name`] reads them), a shorthand for
    /// [`priority`](Self::priority). A missing or unknown value is standard, so a client cannot
    /// claim more than standard by sending garbage. Strip the header at your edge if clients
    /// may not choose `critical`.
    pub fn priority_header(self, name: http::HeaderName) -> Self {
        self.priority(move |head| {
            head.headers
                .get(&name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| Priority::from_name(v.trim()))
                .unwrap_or_default()
        })
    }

    /// Shapes instead of policing (nginx `limit_req burst=N delay=M`), holding a request that
    /// would conform within `max_delay` until its reserved slot. One that would wait longer is
    /// refused as when policing, its `Retry-After` the wait until its slot is within
    /// `max_delay`. A request dropped while waiting gives its slot back.
    ///
    /// ```
    /// use std::time::Duration;
    /// use http::{Request, Response};
    /// use http_body_util::Full;
    /// use tollgate::{Policy, Quota, RateLimitLayer, clock::TokioClock, key::GlobalKey};
    /// use tower::{Layer, ServiceExt, service_fn};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// // A store on tokio's clock, which the paused test controls.
    /// let store = tollgate::store::MemoryStore::builder().clock(TokioClock::new()).build().unwrap();
    /// let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_second(2)).unwrap())
    ///     .key(GlobalKey).store(store).shape(Duration::from_secs(1)).build().unwrap();
    /// let ok = || async { Ok::<_, std::convert::Infallible>(Response::new(Full::<bytes::Bytes>::default())) };
    /// let svc = layer.layer(service_fn(move |_req| ok()));
    /// let start = tokio::time::Instant::now();
    /// for _ in 0..3 {
    ///     svc.clone().oneshot(Request::new(Full::<bytes::Bytes>::default())).await.unwrap();
    /// }
    /// // Two at once (the burst); the third held until its slot, 500 ms later.
    /// assert_eq!(start.elapsed(), Duration::from_millis(500));
    /// # }
    /// ```
    ///
    /// The slot is the earliest instant at which every tier has room, and every tier is
    /// charged there (a calendar tier in the window holding it).
    pub fn shape(mut self, max_delay: Duration) -> Self {
        self.settings.chose("shape");
        self.settings.max_delay = Some(max_delay);
        self
    }

    /// How tiers counting bytes or messages meter streams (default: as the layer decides
    /// requests, [`StreamMode::Police`] or, when [shaping](Self::shape), [`StreamMode::Shape`]).
    /// Choose [`StreamMode::Settle`] for tiers that bill a body when it ends.
    ///
    /// ```
    /// use tollgate::{Policy, Quota, RateLimitLayer, StreamMode, Unit};
    ///
    /// # fn main() -> Result<(), tollgate::ConfigError> {
    /// // Bytes downloaded per key, billed when each response ends (never slowed nor stopped).
    /// let policy = Policy::builder("download")
    ///     .tier("bytes", Quota::per_day(1_000_000_000).counting(Unit::ResponseBytes))
    ///     .build()?;
    /// let layer = RateLimitLayer::builder(policy).on_stream(StreamMode::Settle).build()?;
    /// # let _ = layer;
    /// # Ok(()) }
    /// ```
    pub fn on_stream(mut self, mode: StreamMode) -> Self {
        self.settings.chose("on_stream");
        self.settings.stream = Some(mode);
        self
    }

    /// Bounds how many requests may wait at once, for their shaped slot or in the
    /// [`tarpit`](Self::tarpit) (default 1,024; at least 1 when either is on). When all places
    /// are taken, further requests are policed, and rejections are answered without the tarpit
    /// delay: a flood cannot pile up sleeping requests.
    pub fn max_waiters(mut self, n: usize) -> Self {
        self.settings.chose("max_waiters");
        self.settings.max_waiters = n;
        self
    }

    /// Which rate-limit headers responses carry (default [`HeaderStyle::Ietf`]).
    pub fn headers(mut self, style: HeaderStyle) -> Self {
        self.settings.headers.style = style;
        self
    }

    /// Which revision of the IETF draft the `RateLimit*` fields follow (default
    /// [`HeaderFormat::Draft10`], the current one), for clients written against an older one.
    pub fn header_format(mut self, format: HeaderFormat) -> Self {
        self.settings.chose("header_format");
        self.settings.headers.format = format;
        self
    }

    /// What to do with requests without a key (default: refuse with 400): refuse with a
    /// status, pass them on unlimited, or limit them all under one shared key. See also
    /// [`explain_missing_key`](Self::explain_missing_key).
    pub fn missing_key(mut self, missing: MissingKey) -> Self {
        self.settings.missing_key = missing;
        self
    }

    /// Whether a refusal for a missing key explains itself in the response (default: on in
    /// debug builds, `debug_assertions`, and off in release builds). Its problem+json `detail`
    /// (gRPC: `grpc-message`) then names the key extractor, what it looked for and the usual
    /// fix ([`KeyExtractor::explain_missing`]); otherwise it says only that no key could be read.
    ///
    /// For example: "PeerIp found no key: it looked for the peer's address in the request
    /// extensions ... Fix: axum: serve with
    /// `app.into_make_service_with_connect_info::<SocketAddr>()` ...". The log explains either
    /// way: the first such refusal of a layer is a `warn` event with the explanation, later
    /// ones are `debug` events.
    pub fn explain_missing_key(mut self, on: bool) -> Self {
        self.settings.chose("explain_missing_key");
        self.settings.explain_missing = on;
        self
    }

    /// What to do when the store fails (default [`OnStoreError::FailClosed`]).
    pub fn on_store_error(mut self, on_error: OnStoreError) -> Self {
        self.settings.on_store_error = on_error;
        self
    }

    /// Delays every rejection by `delay` before answering, to slow down clients that retry in a
    /// tight loop. Each delayed rejection holds a place of the waiting room
    /// ([`max_waiters`](Self::max_waiters)); when it is full, rejections are answered at once.
    pub fn tarpit(mut self, delay: Duration) -> Self {
        self.settings.chose("tarpit");
        self.settings.tarpit = Some(delay);
        self
    }

    /// Gives the charge back when the inner service answers with a status for which `f` is
    /// true, e.g. `|s| s.is_server_error()`.
    pub fn refund_if(mut self, f: impl Fn(StatusCode) -> bool + Send + Sync + 'static) -> Self {
        self.settings.refund_if = Some(Arc::new(f));
        self
    }

    /// Whether a request answered `405 Method Not Allowed` keeps its charge (default `false`:
    /// the charge is given back, exactly, on every tier and in every store, when the response
    /// head arrives).
    ///
    /// ```
    /// use tollgate::{Policy, Quota, RateLimitLayer};
    ///
    /// let policy = Policy::single("login", Quota::per_hour(3)).unwrap();
    /// // Handlers here answer 405 after doing work: keep its charge.
    /// let layer = RateLimitLayer::builder(policy).charge_method_not_allowed(true).build().unwrap();
    /// # let _ = layer;
    /// ```
    ///
    /// # How it works
    ///
    /// A 405 says that the resource does not serve the request's method (RFC 9110 §15.5.6):
    /// in axum it is the router's answer, and axum's `Router::route_layer` puts the layer
    /// around that answer too (each route's method router, including its method-not-allowed
    /// fallback, is wrapped), so without this three `GET /login` would spend the budget of
    /// `POST /login`. The layer sees the request before the router decides, so the 405 is
    /// charged while it is answered and given back after: a request refused for the limit
    /// gets 429, and a check made at that moment sees the unit spent. A handler that answers
    /// 405 itself is not charged either; turn this on if yours answer 405 after doing work.
    ///
    /// A `404 Not Found` is charged: a handler's own 404 (a client trying ids) must spend
    /// the budget, and the layer cannot tell the router's 404 from a handler's. Under
    /// `route_layer` the router's 404s never reach the layer (only matched routes are
    /// wrapped); under `Router::layer` they are charged.
    pub fn charge_method_not_allowed(mut self, charge: bool) -> Self {
        self.settings.charge_method_not_allowed = charge;
        self
    }

    /// Settles the cost from the response head: `Some(units)` replaces what was charged (more
    /// is charged unconditionally, less is refunded), `None` keeps it. For LLM-style token
    /// counts reported by the handler in a header or extension.
    pub fn settle_cost(
        mut self,
        f: impl Fn(&http::response::Parts) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.settings.chose("settle_cost");
        self.settings.settle_cost = Some(Arc::new(f));
        self
    }

    /// Replaces the 429 response: `f` gets the [`RateLimited`] refusal and returns the
    /// response to send. The layer adds `Retry-After` (unless `f` set one) and the rate-limit
    /// headers of [`headers`](Self::headers).
    ///
    /// Only for HTTP requests: a gRPC call ([`crate::grpc::is_grpc`]) is always refused with
    /// [`RateLimited::to_grpc_response`] (with the headers of [`headers`](Self::headers)),
    /// because a gRPC client reads nothing but `grpc-status` and length-prefixed messages;
    /// an HTML page or JSON made for browsers would reach it as a protocol error.
    ///
    /// ```
    /// use http::Response;
    /// use tollgate::{Policy, Quota, RateLimitLayer};
    ///
    /// let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_second(5)).unwrap())
    ///     .rejection(|limited| {
    ///         let wait = limited.retry_after_secs().unwrap_or(60);
    ///         Response::builder()
    ///             .status(limited.status())
    ///             .body(format!("slow down: try again in {wait} s"))
    ///             .unwrap()
    ///     })
    ///     .build()
    ///     .unwrap();
    /// ```
    pub fn rejection<T: Into<Bytes>>(
        mut self,
        f: impl Fn(&RateLimited) -> Response<T> + Send + Sync + 'static,
    ) -> Self {
        self.settings.rejection = Some(Arc::new(move |l| f(l).map(Into::into)));
        self
    }

    /// Dry run (shadow mode) decides and charges admitted requests, but never refuses or
    /// delays one (default off). A request that would have been refused passes uncharged, and
    /// is reported. Admitted responses carry the true remaining quota.
    ///
    /// The report is a tracing event (`info`, "tollgate: dry run: would have limited", with
    /// the policy, the redacted key and the violated tiers), the `dry_run_limited` outcome of
    /// the `tollgate_decisions_total` metric (feature `metrics`) and of the
    /// [decision hook](Self::on_decision). The response is the handler's, without rate-limit
    /// headers: an `r=0` would tell clients that pace themselves to stop while nothing is
    /// enforced.
    pub fn dry_run(mut self, on: bool) -> Self {
        self.settings.dry_run = on;
        self
    }

    /// Calls `f` with every decision the layer makes (admitted, shaped, limited, dry-run
    /// limited, store failures), for audit logs and custom telemetry. It runs on the request's
    /// task: keep it short.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use tollgate::layer::Observed;
    /// use tollgate::{Policy, Quota, RateLimitLayer};
    ///
    /// let refused = Arc::new(AtomicUsize::new(0));
    /// let counter = Arc::clone(&refused);
    /// let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_second(5)).unwrap())
    ///     .on_decision(move |event| {
    ///         if event.outcome == Observed::Limited {
    ///             counter.fetch_add(1, Ordering::Relaxed);
    ///         }
    ///     })
    ///     .build()
    ///     .unwrap();
    /// ```
    pub fn on_decision(
        mut self,
        f: impl for<'a> Fn(&DecisionEvent<'a>) + Send + Sync + 'static,
    ) -> Self {
        self.settings.hook = Some(Arc::new(f));
        self
    }

    /// How keys appear in the layer's log events (default [`LogKeys::Redacted`]).
    pub fn log_keys(mut self, keys: LogKeys) -> Self {
        self.settings.log_keys = keys;
        self
    }

    /// Limits only the requests for which `f` is true, passing the others through untouched
    /// (no key read, nothing charged, no rate-limit header added). Several filters (and
    /// [`only_methods`](Self::only_methods) / [`skip_methods`](Self::skip_methods)) combine, a
    /// request being limited only when every one of them says so.
    ///
    /// ```
    /// use tollgate::{Policy, Quota, RateLimitLayer};
    ///
    /// // Only the API is limited; static assets are not.
    /// let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_second(5)).unwrap())
    ///     .filter(|head| head.uri.path().starts_with("/api/"))
    ///     .build()
    ///     .unwrap();
    /// ```
    pub fn filter(mut self, f: impl Fn(&RequestHead<'_>) -> bool + Send + Sync + 'static) -> Self {
        self.scope.conditions.push(Condition::Predicate(Box::new(f)));
        self
    }

    /// Limits only requests with one of these methods (e.g. `POST` and `PUT`); others pass
    /// through untouched, as with [`filter`](Self::filter).
    ///
    /// [`build`](Self::build) refuses an empty list ([`ConfigError::Invalid`] naming
    /// `only_methods`), which would limit nothing.
    pub fn only_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.scope.conditions.push(Condition::Only(methods.into_iter().collect()));
        self
    }

    /// Never limits requests with these methods (e.g. `OPTIONS`, the CORS preflight a
    /// browser sends before the real request): they pass through untouched, as with
    /// [`filter`](Self::filter).
    pub fn skip_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.scope.conditions.push(Condition::Skip(methods.into_iter().collect()));
        self
    }

    /// Never limits these keys (e.g. an internal service's API key), whose requests pass
    /// through untouched; adds to earlier calls. A composite key (a tuple extractor) is allowed
    /// when it equals one of these or one of its parts does.
    pub fn allow_keys(mut self, keys: impl IntoIterator<Item = impl Into<Key>>) -> Self {
        self.scope.allow_keys.extend(keys.into_iter().map(Into::into));
        self
    }

    /// Never limits address keys ([`Key::Ip`], alone or as a part of a composite key) in these
    /// networks, given as CIDR (`"10.0.0.0/8"`, `"2001:db8::/48"`) or single addresses
    /// (`"192.0.2.7"`): e.g. your office or your health checkers. Adds to earlier calls.
    ///
    /// Address keys hold IPv6 addresses grouped by prefix ([`PeerIp::ipv6_prefix`], /64 by
    /// default), so list IPv6 networks of that prefix or shorter: `2001:db8::1/128` cannot
    /// match a key that is the /64 `2001:db8::`.
    ///
    /// [`build`](Self::build) refuses an entry that is neither ([`ConfigError::Invalid`]
    /// naming `allow_cidrs`).
    pub fn allow_cidrs(mut self, cidrs: impl IntoIterator<Item = impl AsRef<str>>) -> Self {
        self.scope.allow_cidrs.extend(cidrs.into_iter().map(|c| c.as_ref().to_owned()));
        self
    }

    /// Adds a policy that the [selector](Self::select) may choose (the policy the builder
    /// started with is one too). Each is bound to the layer's store once, when the layer is
    /// built, and keeps its own state: a key spends the budget of the policy chosen for
    /// each request.
    ///
    /// [`build`](Self::build) refuses two policies with one name, and added policies without
    /// a selector ([`ConfigError::Invalid`] naming `policy`).
    pub fn policy(mut self, policy: Policy) -> Self {
        self.scope.policies.push(Added::Policy(policy));
        self
    }

    /// Like [`policy`](Self::policy), for a policy already bound: the selector may choose
    /// `limiter`'s policy, and the layer decides it through `limiter`, sharing its state with
    /// every clone of it (another layer, code that calls it directly). What
    /// [`with_limiter`](RateLimitLayer::with_limiter) is to the builder's own policy.
    ///
    /// A later [`store`](Self::store) replaces it with its policy, bound afresh to that store.
    /// [`build`](Self::build) refuses it as it refuses [`policy`](Self::policy).
    ///
    /// ```
    /// use tollgate::{Limiter, Policy, Quota, RateLimitLayer};
    ///
    /// let pro = Limiter::new(Policy::single("pro", Quota::per_second(100)).unwrap());
    /// let layer = RateLimitLayer::builder(Policy::single("free", Quota::per_second(10)).unwrap())
    ///     .store(pro.store().clone())
    ///     .policy_limiter(pro.clone())
    ///     .select(|head| head.headers.get("x-plan").and_then(|v| v.to_str().ok()))
    ///     .build()
    ///     .unwrap();
    /// // One budget: the layer's "pro" is the limiter's.
    /// assert_eq!(layer.limiter_for("pro").unwrap().policy(), pro.policy());
    /// ```
    pub fn policy_limiter(mut self, limiter: Limiter<St>) -> Self {
        self.scope.policies.push(Added::Limiter(limiter));
        self
    }

    /// Chooses the policy of each request by [name](Policy::name) from its head, e.g. the
    /// caller's plan in a header, or in an extension that an authentication layer set. The
    /// candidates are the builder's policy and those added with [`policy`](Self::policy). A
    /// request for which `f` returns `None`, or a name no policy has, is handled as
    /// [`unselected`](Self::unselected) says (default: passed on unlimited).
    ///
    /// ```
    /// use tollgate::layer::Unselected;
    /// use tollgate::{Policy, Quota, RateLimitLayer};
    /// use tollgate::key::HeaderKey;
    ///
    /// let free = Policy::single("free", Quota::per_second(10)).unwrap();
    /// let pro = Policy::single("pro", Quota::per_second(100)).unwrap();
    /// let layer = RateLimitLayer::builder(free)
    ///     .policy(pro)
    ///     .key(HeaderKey::new(http::HeaderName::from_static("x-api-key")))
    ///     .select(|head| head.headers.get("x-plan").and_then(|v| v.to_str().ok()))
    ///     .unselected(Unselected::Reject(http::StatusCode::FORBIDDEN))
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(layer.limiter_for("pro").unwrap().policy().name(), "pro");
    /// ```
    pub fn select(
        mut self,
        f: impl for<'a> Fn(&RequestHead<'a>) -> Option<&'a str> + Send + Sync + 'static,
    ) -> Self {
        self.scope.select = Some(Box::new(f));
        self
    }

    /// What to do with a request the [selector](Self::select) chose no policy for (default
    /// [`Unselected::Pass`]).
    ///
    /// [`build`](Self::build) refuses it without a selector ([`ConfigError::Invalid`] naming
    /// `unselected`).
    pub fn unselected(mut self, unselected: Unselected) -> Self {
        self.scope.unselected = Some(unselected);
        self
    }

    /// Binds the policies to the store and builds the layer.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming `max_waiters` when it is 0 while shaping or with a
    /// tarpit, and naming the setting for the refusals of [`only_methods`](Self::only_methods),
    /// [`allow_cidrs`](Self::allow_cidrs), [`policy`](Self::policy) and
    /// [`unselected`](Self::unselected); [`ConfigError::CostExceedsCapacity`] when a fixed
    /// [`cost`](Self::cost) exceeds a tier's capacity in any policy; what the store refuses
    /// when binding ([`Store::bind`]).
    pub fn build(self) -> Result<RateLimitLayer<K, St>, ConfigError> {
        let settings = self.settings;
        let waits = settings.max_delay.is_some() || settings.tarpit.is_some();
        if waits && settings.max_waiters == 0 {
            return Err(ConfigError::Invalid {
                setting: "max_waiters",
                reason: "must be at least 1 when shaping or with a tarpit".into(),
            });
        }
        let policy = match &self.source {
            Source::Policy(p, _) => p,
            Source::Limiter(l) => l.policy(),
        };
        self.scope.validate(policy)?;
        if let Cost::Fixed(cost) = settings.cost {
            let added = self.scope.policies.iter().map(Added::policy);
            let mut tiers = std::iter::once(policy).chain(added).flat_map(|p| p.tiers().iter());
            if let Some(tier) = tiers.find(|t| cost > t.capacity()) {
                return Err(ConfigError::CostExceedsCapacity {
                    cost,
                    tier: tier.name().to_owned(),
                    capacity: tier.capacity(),
                });
            }
        }
        let limiter = match self.source {
            Source::Policy(policy, store) => Limiter::with_store(policy, store)?,
            Source::Limiter(limiter) => limiter,
        };
        let scope = self.scope.build(limiter.store())?;
        let waiters = waits.then(|| Arc::new(Semaphore::new(settings.max_waiters)));
        let others = scope.as_ref().map_or(&[][..], |s| &s.others[..]);
        let policies = std::iter::once(limiter.policy()).chain(others.iter().map(Limiter::policy));
        for (option, why) in settings.ignored(policies.clone()) {
            let policy = limiter.policy().name();
            crate::metrics::config_warning(policy, option);
            tracing::warn!(policy, option, "tollgate: `{option}` is ignored: {why}");
        }
        let observer = Observer::new(policies, settings.hook.clone(), settings.log_keys);
        let limiters = std::iter::once(&limiter).chain(others);
        let plans = limiters.map(|l| plan::Plan::new(&settings, l)).collect();
        Ok(RateLimitLayer {
            bodies: PhantomData,
            config: Arc::new(Config {
                limiter,
                key: self.key,
                waiters,
                settings,
                scope,
                observer,
                failing: Failing::default(),
                missing: MissingKeys::default(),
                #[cfg(feature = "ws")]
                unmetered: observe::Unmetered::default(),
                plans,
            }),
        })
    }
}
