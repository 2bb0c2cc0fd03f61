//! Recipes: the usual setups, each complete and compiled with the crate's tests.
//!
//! - [Per-route limits in axum](#per-route-limits-in-axum)
//! - [A hyper server without axum](#a-hyper-server-without-axum)
//! - [tonic](#tonic)
//! - [Behind a load balancer](#behind-a-load-balancer)
//! - [Per-plan limits](#per-plan-limits)
//! - [Limits in code, not HTTP](#limits-in-code-not-http)
//! - [Testing your own app with a fake clock](#testing-your-own-app-with-a-fake-clock)
//! - [Calling a rate-limited API](#calling-a-rate-limited-api)
//! - [Redis and Redis Cluster](#redis-and-redis-cluster)
//! - [Seeing what the limiter does](#seeing-what-the-limiter-does)
//!
//! # Per-route limits in axum
//!
//! `route_layer` limits the routes above it only, after routing (so `key::RouteKey` sees the
//! matched route and unknown paths get a plain 404 without spending quota; a method the route
//! does not serve gets axum's 405, whose charge is given back). Layers that share a
//! [`MemoryStore`] share its memory, and each policy keeps its own state in it: two routes
//! limited by one policy share its budget, so give each route whose budget is its own a policy
//! of its own name (or put `key::RouteKey` in the key).
//!
//! ```
//! use std::net::SocketAddr;
//! use std::time::Duration;
//! use axum::{Router, routing::{get, post}};
//! use tollgate::store::MemoryStore;
//! use tollgate::{Policy, Quota, RateLimitLayer};
//!
//! # fn main() -> Result<(), tollgate::ConfigError> {
//! let store = MemoryStore::new();
//! let reads = Policy::single("reads", Quota::per_second(50).with_burst(100))?;
//! let writes = Policy::builder("writes")
//!     .tier("second", Quota::per_second(5))
//!     .tier("day", Quota::per_day(10_000))
//!     .build()?;
//! let app: Router = Router::new()
//!     .route("/items", get(|| async { "items" }))
//!     .route_layer(RateLimitLayer::builder(reads).store(store.clone()).build()?)
//!     .merge(
//!         Router::new()
//!             .route("/items", post(|| async { "stored" }))
//!             // Shaped instead of refused: held up to 250 ms for a free slot.
//!             .route_layer(
//!                 RateLimitLayer::builder(writes)
//!                     .store(store)
//!                     .shape(Duration::from_millis(250))
//!                     .build()?,
//!             ),
//!     );
//! // Serve with the peer address, which the default key (`PeerIp`) reads:
//! // axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
//! # let _ = app.into_make_service_with_connect_info::<SocketAddr>();
//! # Ok(()) }
//! ```
//!
//! # A hyper server without axum
//!
//! Without the `axum` feature the crate depends on `http` and Tower only. Hand each request
//! its peer address as a `SocketAddr` extension:
//!
//! ```no_run
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use hyper::body::Incoming;
//! use hyper_util::rt::TokioIo;
//! use hyper_util::service::TowerToHyperService;
//! use tollgate::{Policy, Quota, RateLimitLayer, RequestBody};
//! use tower::{Layer, ServiceBuilder, service_fn};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let limit = RateLimitLayer::builder(Policy::single("api", Quota::per_second(10))?).build()?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! loop {
//!     let (stream, peer) = listener.accept().await?;
//!     // The handler receives the layer's `RequestBody` around hyper's `Incoming`.
//!     let handler = service_fn(|_req: Request<RequestBody<Incoming>>| async {
//!         Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"hello"))))
//!     });
//!     let svc = ServiceBuilder::new()
//!         .map_request(move |mut req: Request<Incoming>| {
//!             req.extensions_mut().insert(peer);
//!             req
//!         })
//!         .service(limit.layer(handler));
//!     tokio::spawn(async move {
//!         let io = TokioIo::new(stream);
//!         let _ = hyper::server::conn::http1::Builder::new()
//!             .serve_connection(io, TowerToHyperService::new(svc))
//!             .await;
//!     });
//! }
//! # }
//! ```
//!
//! # tonic
//!
//! `Server::builder().layer(..)` takes the layer as it is. gRPC calls are refused in gRPC form
//! (trailers-only, `RESOURCE_EXHAUSTED` with `grpc-retry-pushback-ms`), so clients see a
//! retryable status, not a protocol error. With the `tonic` feature, [`PeerIp`] and
//! [`ClientIp`] read tonic's `TcpConnectInfo`. Keys from metadata use [`HeaderKey`]; one
//! budget per method uses [`GrpcMethod`]; a different *policy* per method uses
//! [`select`](crate::RateLimitLayerBuilder::select) on the path:
//!
//! ```
//! use http::HeaderName;
//! use tollgate::key::{GrpcMethod, HeaderKey};
//! use tollgate::{Policy, Quota, RateLimitLayer};
//!
//! # fn main() -> Result<(), tollgate::ConfigError> {
//! let reads = Policy::single("reads", Quota::per_second(100))?;
//! let writes = Policy::single("writes", Quota::per_second(10))?;
//! let layer = RateLimitLayer::builder(reads)
//!     .policy(writes)
//!     // One budget per API key and method.
//!     .key((HeaderKey::new(HeaderName::from_static("x-api-key")), GrpcMethod::new()))
//!     .select(|head| match GrpcMethod::split(head.uri.path()) {
//!         Some((_, "Get" | "List")) => Some("reads"),
//!         Some(_) => Some("writes"),
//!         None => None, // not gRPC: passed on unlimited
//!     })
//!     .build()?;
//! // tonic::transport::Server::builder().layer(layer).add_service(..)
//! # let _ = layer;
//! # Ok(()) }
//! ```
//!
//! # Behind a load balancer
//!
//! Behind a proxy every client shares the proxy's address. [`ClientIp`] reads the client from
//! `X-Forwarded-For` (or `Forwarded`, or `X-Real-IP`), walking from the right past the proxies
//! you trust; a header from anyone else is ignored, since clients can write it:
//!
//! ```
//! use tollgate::key::{ClientIp, ForwardedHeader};
//! use tollgate::{Policy, Quota, RateLimitLayer};
//!
//! # fn main() -> Result<(), tollgate::ConfigError> {
//! let layer = RateLimitLayer::builder(Policy::single("per-client", Quota::per_second(10))?)
//!     .key(ClientIp::from_cidrs(["10.0.0.0/8", "fd00::/8"])?.header(ForwardedHeader::Forwarded))
//!     .build()?;
//! # let _ = layer;
//! # Ok(()) }
//! ```
//!
//! # Per-plan limits
//!
//! The caller's plan (from a header, or from an extension your authentication layer set)
//! chooses one of several policies, each with its own state; internal callers and health
//! checks are never limited; preflight `OPTIONS` requests spend nothing; a request that fails
//! on the server's side (5xx) is refunded. (A `405 Method Not Allowed` is refunded by default,
//! see [`charge_method_not_allowed`](crate::RateLimitLayerBuilder::charge_method_not_allowed);
//! do not refund 404s: a client trying ids one by one would then spend nothing.)
//!
//! ```
//! use http::{HeaderName, Method, StatusCode};
//! use tollgate::key::HeaderKey;
//! use tollgate::{Policy, Quota, RateLimitLayer, Unselected};
//!
//! # fn main() -> Result<(), tollgate::ConfigError> {
//! let free = Policy::single("free", Quota::per_second(10))?;
//! let pro = Policy::single("pro", Quota::per_second(100).with_burst(200))?;
//! let layer = RateLimitLayer::builder(free)
//!     .policy(pro)
//!     .key(HeaderKey::new(HeaderName::from_static("x-api-key")))
//!     .select(|head| head.headers.get("x-plan")?.to_str().ok())
//!     .unselected(Unselected::Reject(StatusCode::FORBIDDEN))
//!     .allow_cidrs(["10.0.0.0/8"])
//!     .skip_methods([Method::OPTIONS])
//!     .refund_if(|status| status.is_server_error())
//!     .build()?;
//! # let _ = layer;
//! # Ok(()) }
//! ```
//!
//! # Limits in code, not HTTP
//!
//! A [`Limiter`] decides for any key: a background job, an outgoing call, a queue consumer.
//! `until_ready` waits for room (with a deadline) instead of failing:
//!
//! ```
//! use std::time::Duration;
//! use tollgate::key::Key;
//! use tollgate::{Limiter, Policy, Quota};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let limiter = Limiter::new(Policy::single("mailer", Quota::per_second(20))?);
//! for user in ["ann", "bob"] {
//!     limiter.until_ready(&Key::text(user), 1, Duration::from_secs(5)).await?;
//!     // send the mail
//! }
//! # Ok(()) }
//! ```
//!
//! # Testing your own app with a fake clock
//!
//! Give the store a [`FakeClock`] and move time by hand; give requests a peer with axum's
//! `MockConnectInfo`, added **after** (outside) the rate-limit layer so that it runs first.
//! (With `#[tokio::test(start_paused = true)]`, [`TokioClock`] follows tokio's paused time
//! instead.)
//!
//! The `testing` feature goes further (module `testing`): a `VirtualClock` that starts at an
//! instant the test chooses (calendar windows see the same dates on every run) and follows
//! tokio's paused time, so that `tokio::time::advance` moves the store and the layer's shaping
//! waits together; the rate-limit headers as typed values; and one-line assertions such as
//! `assert_limited_until(&res, clock.until("2026-04-01T00:00:00+02:00")?)`.
//!
//! ```
//! # #[cfg(feature = "axum")] // `PeerIp` reads `MockConnectInfo` with the `axum` feature
//! # mod test {
//! use std::net::SocketAddr;
//! use std::time::Duration;
//! use axum::{Router, body::Body, extract::connect_info::MockConnectInfo, routing::get};
//! use http::{Request, StatusCode};
//! use tollgate::clock::FakeClock;
//! use tollgate::store::MemoryStore;
//! use tollgate::{Policy, Quota, RateLimitLayer};
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # pub async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let clock = FakeClock::new();
//! let store = MemoryStore::builder().clock(clock.clone()).build()?;
//! let limit = RateLimitLayer::builder(Policy::single("api", Quota::per_minute(2))?)
//!     .store(store)
//!     .build()?;
//! let peer: SocketAddr = "192.0.2.1:4000".parse()?;
//! let app = Router::new().route("/", get(|| async { "ok" })).layer(limit).layer(MockConnectInfo(peer));
//! let status = |app: Router| async move {
//!     app.oneshot(Request::get("/").body(Body::empty()).unwrap()).await.unwrap().status()
//! };
//! assert_eq!(status(app.clone()).await, StatusCode::OK);
//! assert_eq!(status(app.clone()).await, StatusCode::OK);
//! assert_eq!(status(app.clone()).await, StatusCode::TOO_MANY_REQUESTS);
//! clock.advance(Duration::from_secs(30)); // one request's worth of a 2-per-minute quota
//! assert_eq!(status(app).await, StatusCode::OK);
//! # Ok(()) }
//! # }
//! # #[cfg(feature = "axum")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> { test::main() }
//! # #[cfg(not(feature = "axum"))]
//! # fn main() {}
//! ```
//!
//! # Calling a rate-limited API
//!
//! With the `client` feature, `client::PacingLayer` holds each request
//! until the server would accept it (it reads the `RateLimit` headers this crate writes, and
//! `X-RateLimit-*`), and `client::RetryPolicy` retries what is refused
//! anyway, with backoff and jitter, never sooner than `Retry-After`. Retry outside, pacing
//! inside, so that every attempt is paced:
//!
//! ```
//! # #[cfg(feature = "client")]
//! # fn main() -> Result<(), tollgate::ConfigError> {
//! use std::time::Duration;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use hyper_util::client::legacy::Client;
//! use hyper_util::rt::TokioExecutor;
//! use tollgate::client::{PacingLayer, RetryPolicy};
//! use tower::ServiceBuilder;
//!
//! let http_client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
//! let client = ServiceBuilder::new()
//!     .retry(
//!         RetryPolicy::<Full<Bytes>>::builder()
//!             .max_attempts(4)
//!             .budget(Duration::from_secs(30))
//!             .build()?,
//!     )
//!     .layer(PacingLayer::new()) // one state per server (URI authority)
//!     .service(http_client);
//! # let _ = client;
//! # Ok(()) }
//! # #[cfg(not(feature = "client"))]
//! # fn main() {}
//! ```
//!
//! # Redis and Redis Cluster
//!
//! With the `redis` feature, one limit spans every instance of a service. Checks waiting on a
//! server are sent together, one script call per batch; while a server fails, checks are
//! decided on a local [`MemoryStore`] (each instance then limits on its own) and a circuit
//! breaker per server keeps calls from piling up. On Redis Cluster, give one or more nodes; the
//! masters are found with `CLUSTER SLOTS`, and losing one affects only the keys it serves.
//! (Building the store connects nothing: the first check, or `RedisStore::connect`, does.)
//!
//! ```
//! # #[cfg(feature = "redis")]
//! # fn main() -> Result<(), tollgate::ConfigError> {
//! use std::time::Duration;
//! use tollgate::store::RedisStore;
//! use tollgate::{Policy, Quota, RateLimitLayer};
//!
//! let store = RedisStore::cluster_builder(["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"])
//!     .timeout(Duration::from_millis(50))
//!     // The same on every instance, kept like a password (say, from the environment).
//!     .key_secret("a long random string")
//!     .build()?;
//! let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_minute(600))?)
//!     .store(store)
//!     .build()?;
//! # let _ = layer;
//! # Ok(()) }
//! # #[cfg(not(feature = "redis"))]
//! # fn main() {}
//! ```
//!
//! Each key's state is one Redis string, `<prefix>{<policy>|#<hash>}:<fingerprint>` (prefix
//! `tollgate:` by default; the braces make it one Cluster hash slot; the fingerprint changes
//! when the policy's tiers or algorithm do). `<hash>` is a keyed hash of the key (SipHash-2-4,
//! 128 bits, 32 hexadecimal digits) with the secret given to `RedisStoreBuilder::key_secret`,
//! so API keys and user ids are not readable with `SCAN`, `MONITOR` or from an RDB file. Every
//! instance of a fleet must use the same secret, or they stop sharing budgets; the default
//! secret is a fixed, documented value that hides keys from casual reading only, so set one.
//! `raw_keys()` names keys by the key itself (`<prefix>{<policy>|<key>}:<fingerprint>`, e.g.
//! `tollgate:{api|s5:alice}:...`) for debugging; `RedisPolicy::state_key` gives a key's name
//! either way. The state holds packed binary doubles: the instant of the last write and the
//! algorithm's per-tier state. A sliding-window log also keeps its entries in one sorted set per
//! tier beside it (`<state key>:z1`, `:z2`, ...), concurrency tiers their leases (`:c1`, ...);
//! members are entry and lease ids, never the key. Every key expires (`PX`) when its state would
//! be full again, so an idle key costs nothing.
//!
//! # Seeing what the limiter does
//!
//! Dry run decides and reports without refusing anything; a hook sees every decision; with a
//! `metrics` recorder installed (for example `metrics-exporter-prometheus`), decisions are
//! counted per policy, tier and outcome (see the `metrics` module); keys in log events
//! are redacted unless you ask for them:
//!
//! ```
//! use tollgate::{LogKeys, Observed, Policy, Quota, RateLimitLayer};
//!
//! # fn main() -> Result<(), tollgate::ConfigError> {
//! let layer = RateLimitLayer::builder(Policy::single("beta", Quota::per_second(3))?)
//!     .dry_run(true)
//!     .on_decision(|event| {
//!         if event.outcome == Observed::DryRunLimited {
//!             // audit: event.policy, event.key, event.head, event.decision
//!         }
//!     })
//!     .log_keys(LogKeys::Redacted)
//!     .build()?;
//! # let _ = layer;
//! # Ok(()) }
//! ```
//!
//! [`MemoryStore`]: crate::store::MemoryStore
//! [`PeerIp`]: crate::key::PeerIp
//! [`ClientIp`]: crate::key::ClientIp
//! [`HeaderKey`]: crate::key::HeaderKey
//! [`GrpcMethod`]: crate::key::GrpcMethod
//! [`Limiter`]: crate::Limiter
//! [`FakeClock`]: crate::clock::FakeClock
//! [`TokioClock`]: crate::clock::TokioClock
