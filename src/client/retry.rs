//! [`RetryPolicy`]: which responses are retried, and after how long.

use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use http::{Method, Request, Response, StatusCode};
use tokio::time::{Instant, Sleep};
use tower::retry::Policy;

use crate::error::ConfigError;
use crate::hints::{self, Pushback};

/// The longest wait a retry is scheduled for (a year: later instants could overflow
/// [`Instant`]; the budget ends any wait this long first).
const MAX_WAIT: Duration = Duration::from_secs(365 * 86_400);

/// gRPC status `RESOURCE_EXHAUSTED`.
const GRPC_RESOURCE_EXHAUSTED: u64 = 8;
/// gRPC status `UNAVAILABLE`.
const GRPC_UNAVAILABLE: u64 = 14;

/// A source of random delays for the backoff: given a ceiling, a delay between zero and it.
///
/// [`FullJitter`] is the default; implement this (or pass a closure
/// `Fn(Duration) -> Duration`) to make delays predictable in tests. A result above the ceiling
/// is cut to the ceiling.
///
/// ```
/// use std::time::Duration;
/// use tollgate::client::Jitter;
///
/// // Always half the ceiling.
/// let half = |ceiling: Duration| ceiling / 2;
/// assert_eq!(half.sample(Duration::from_millis(400)), Duration::from_millis(200));
/// ```
pub trait Jitter: Send + Sync + 'static {
    /// A delay in `[0, ceiling]`.
    fn sample(&self, ceiling: Duration) -> Duration;
}

impl<F> Jitter for F
where
    F: Fn(Duration) -> Duration + Send + Sync + 'static,
{
    fn sample(&self, ceiling: Duration) -> Duration {
        self(ceiling)
    }
}

/// "Full jitter" (AWS Architecture Blog, "Exponential Backoff And Jitter"): a delay drawn
/// uniformly from `[0, ceiling]` in whole milliseconds (the resolution of tokio's timer, so
/// every delay drawn is the delay slept), from a [`fastrand::Rng`] shared by every clone of the
/// policy (so concurrent requests draw different delays).
///
/// [`with_seed`](Self::with_seed) makes the sequence reproducible: the `n`-th delay is the
/// `n`-th `rng.u64(0..=ceiling_ms)` of `fastrand::Rng::with_seed(seed)`, in milliseconds, where
/// `ceiling_ms` is the ceiling in whole milliseconds (rounded down, saturating at `u64::MAX`).
///
/// ```
/// use std::time::Duration;
/// use tollgate::client::{FullJitter, Jitter};
///
/// let jitter = FullJitter::with_seed(7);
/// let mut rng = fastrand::Rng::with_seed(7);
/// let delay = jitter.sample(Duration::from_millis(100));
/// assert_eq!(delay, Duration::from_millis(rng.u64(0..=100)));
/// ```
pub struct FullJitter {
    rng: Mutex<fastrand::Rng>,
}

impl FullJitter {
    /// Seeded from fastrand's thread-local generator (itself seeded from the OS).
    #[must_use]
    pub fn new() -> Self {
        Self { rng: Mutex::new(fastrand::Rng::new()) }
    }

    /// Seeded with `seed`: the same sequence of delays every run.
    #[must_use]
    pub fn with_seed(seed: u64) -> Self {
        Self { rng: Mutex::new(fastrand::Rng::with_seed(seed)) }
    }
}

impl Default for FullJitter {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for FullJitter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FullJitter").finish_non_exhaustive()
    }
}

impl Jitter for FullJitter {
    fn sample(&self, ceiling: Duration) -> Duration {
        let millis = u64::try_from(ceiling.as_millis()).unwrap_or(u64::MAX);
        let mut rng = self.rng.lock().unwrap_or_else(PoisonError::into_inner);
        Duration::from_millis(rng.u64(0..=millis))
    }
}

/// A failed gRPC call's status, as [`RetryPolicy::call`] reads it: implemented for
/// `tonic::Status` (with the `tonic` feature); implement it for another gRPC library's status.
///
/// ```
/// use tollgate::client::{GrpcStatus, RetryPolicy};
///
/// /// Another gRPC library's status.
/// struct Status {
///     code: i32,
/// }
///
/// impl GrpcStatus for Status {
///     fn grpc_code(&self) -> i32 {
///         self.code
///     }
///     fn retry_pushback(&self) -> Option<&[u8]> {
///         None
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let policy = RetryPolicy::<()>::builder().max_attempts(3).build().unwrap();
/// let mut calls = 0;
/// let result: Result<(), Status> = policy
///     .call(|| {
///         calls += 1;
///         async { Err(Status { code: 8 }) } // RESOURCE_EXHAUSTED
///     })
///     .await;
/// assert_eq!(calls, 3);
/// assert_eq!(result.err().map(|s| s.code), Some(8));
/// # }
/// ```
pub trait GrpcStatus {
    /// The status code, numbered as gRPC does (8 `RESOURCE_EXHAUSTED`, 14 `UNAVAILABLE`).
    fn grpc_code(&self) -> i32;

    /// The value of the status's `grpc-retry-pushback-ms` trailer (gRFC A6), as sent; `None`
    /// when it has none.
    fn retry_pushback(&self) -> Option<&[u8]>;
}

#[cfg(feature = "tonic")]
impl GrpcStatus for tonic::Status {
    fn grpc_code(&self) -> i32 {
        self.code() as i32
    }

    fn retry_pushback(&self) -> Option<&[u8]> {
        let value = self.metadata().get("grpc-retry-pushback-ms")?;
        Some(value.as_encoded_bytes())
    }
}

/// The wait a retryable gRPC status asks for (zero when it gives none); `None` when it is not
/// retried.
fn grpc_hint(status: &impl GrpcStatus) -> Option<Duration> {
    let code = u64::try_from(status.grpc_code()).ok()?;
    if !matches!(code, GRPC_RESOURCE_EXHAUSTED | GRPC_UNAVAILABLE) {
        return None;
    }
    match hints::pushback(status.retry_pushback()) {
        Pushback::Absent => Some(Duration::ZERO),
        Pushback::After(pushback) => Some(pushback),
        Pushback::Stop => None,
    }
}

/// Decides whether an error of the inner service (no response at all) is worth retrying.
///
/// ```
/// use tollgate::client::RetryPolicy;
///
/// #[derive(Debug)]
/// enum ClientError {
///     Connect, // never sent: safe to send again
///     Reset,   // sent, and perhaps processed
/// }
///
/// let policy = RetryPolicy::<String>::builder()
///     .retry_errors_if(|e: &ClientError| matches!(e, ClientError::Connect))
///     .build()
///     .unwrap();
/// # let _ = (policy, ClientError::Reset);
/// ```
///
/// The default, [`NoErrors`], retries none: whether a request that failed in transport reached
/// the server is unknown, and the errors of HTTP clients differ by crate. Pass a closure
/// `Fn(&E) -> bool` to [`RetryPolicyBuilder::retry_errors_if`] to retry the transient ones (for
/// hyper-util's client, `|e: &Error| e.is_connect()`: the connection was never made, so the
/// request was never sent).
pub trait RetryErrors<E>: Send + Sync + 'static {
    /// Whether `error` is transient: the request may be sent again.
    fn is_transient(&self, error: &E) -> bool;
}

/// Retries no error (the default of [`RetryPolicy`]); see [`RetryErrors`], whose example
/// chooses errors to retry instead.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoErrors;

impl<E> RetryErrors<E> for NoErrors {
    fn is_transient(&self, _: &E) -> bool {
        false
    }
}

impl<E, F> RetryErrors<E> for F
where
    F: Fn(&E) -> bool + Send + Sync + 'static,
{
    fn is_transient(&self, error: &E) -> bool {
        self(error)
    }
}

type CloneBody<B> = Box<dyn Fn(&B) -> Option<B> + Send + Sync>;

/// The settings of a policy, shared by all its clones.
struct Config<B, C> {
    /// The latest instant a retry of any clone was scheduled at: retries of one policy are
    /// spread out (see [`Config::schedule`]).
    last: Mutex<Option<Instant>>,
    max_attempts: u32,
    base: Duration,
    cap: Duration,
    budget: Duration,
    methods: Vec<Method>,
    clone_body: CloneBody<B>,
    jitter: Box<dyn Jitter>,
    errors: C,
}

impl<B, C> Config<B, C> {
    /// The instant a retry wanted at `own` is sent, for a refusal whose hint was `hint`: no
    /// sooner than `own`, nor than the policy's latest scheduled retry plus a spacing (the
    /// hint, at most `base`): concurrent calls refused together do not all come back at the
    /// instant the server frees one unit, but one spacing apart, in the order they were
    /// refused.
    /// `None` when that instant is not `within` the budget (nothing is scheduled then).
    fn schedule(
        &self,
        own: Instant,
        hint: Duration,
        within: impl Fn(Instant) -> bool,
    ) -> Option<Instant> {
        let spacing = hint.min(self.base);
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        let at = match *last {
            Some(prev) if !spacing.is_zero() => own.max(prev + spacing),
            _ => own,
        };
        if !within(at) {
            return None;
        }
        *last = Some(last.map_or(at, |prev| prev.max(at)));
        Some(at)
    }

    /// The ceiling of the `retry`-th backoff (from 0): `min(cap, base x 2^retry)`.
    fn ceiling(&self, retry: u32) -> Duration {
        match 1u32.checked_shl(retry) {
            Some(factor) => self.base.saturating_mul(factor).min(self.cap),
            None => self.cap,
        }
    }

    /// The server's hint for a retryable response (zero when it gave none); `None` when the
    /// response is not retried.
    fn hint<T>(&self, res: &Response<T>) -> Option<Duration> {
        let headers = res.headers();
        let retryable = match res.status() {
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => true,
            StatusCode::OK => {
                matches!(
                    hints::grpc_status(headers),
                    Some(GRPC_RESOURCE_EXHAUSTED | GRPC_UNAVAILABLE)
                )
            }
            _ => false,
        };
        if !retryable {
            return None;
        }
        let after = hints::retry_after(headers).unwrap_or(Duration::ZERO);
        match hints::grpc_pushback(headers) {
            Pushback::Absent => Some(after),
            Pushback::After(pushback) => Some(after.max(pushback)),
            Pushback::Stop => None,
        }
    }
}

/// A [`tower::retry::Policy`] for clients of rate-limited HTTP services, and a retry loop for
/// gRPC calls ([`call`](Self::call)). It retries 429, 503 and gRPC `RESOURCE_EXHAUSTED` /
/// `UNAVAILABLE` with capped exponential backoff and full jitter, never sooner than the
/// server's `Retry-After` or pushback, within a number of attempts and a time budget.
///
/// ```
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http::{Request, Response, StatusCode};
/// use http_body_util::Full;
/// use tollgate::client::RetryPolicy;
/// use tower::{ServiceBuilder, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let policy = RetryPolicy::<Full<Bytes>>::builder()
///     .max_attempts(4)
///     .base(Duration::from_millis(50))
///     .cap(Duration::from_secs(2))
///     .budget(Duration::from_secs(10))
///     .build()
///     .unwrap();
/// let calls = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
/// let seen = calls.clone();
/// let svc = ServiceBuilder::new().retry(policy).service(service_fn(move |_req: Request<Full<Bytes>>| {
///     let n = seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
///     async move {
///         let status = if n == 0 { StatusCode::TOO_MANY_REQUESTS } else { StatusCode::OK };
///         let res = Response::builder().status(status).header("retry-after", "1");
///         Ok::<_, std::convert::Infallible>(res.body(()).unwrap())
///     }
/// }));
/// let start = tokio::time::Instant::now();
/// let res = svc.oneshot(Request::get("http://api.example/").body(Full::default()).unwrap()).await.unwrap();
/// assert_eq!(res.status(), StatusCode::OK);
/// assert_eq!(start.elapsed(), Duration::from_secs(1)); // the server's Retry-After
/// # }
/// ```
///
/// # What is retried
///
/// Responses with status 429 Too Many Requests or 503 Service Unavailable, and gRPC
/// trailers-only responses (HTTP 200 with `grpc-status` in the headers) whose status is 8
/// `RESOURCE_EXHAUSTED` or 14 `UNAVAILABLE`; errors of the inner service only when [`retry_errors_if`](RetryPolicyBuilder::retry_errors_if) says so (none by default).
/// Only requests whose method is idempotent (RFC 9110 §9.2.2: GET, HEAD, OPTIONS, TRACE, PUT,
/// DELETE; see [`methods`](RetryPolicyBuilder::methods)) and whose body can be cloned are
/// retried; any other request is sent once and its response returned as it is.
///
/// As a Tower layer around a tonic `Channel` the policy retries nothing: every gRPC call is a
/// POST whose body is a stream of messages that cannot be cloned. Retry tonic calls at the
/// message level instead, with [`call`](Self::call), which re-issues the call (a
/// closure) on `RESOURCE_EXHAUSTED` and `UNAVAILABLE` by the same rules, with the same attempts,
/// budget and backoff.
///
/// # When
///
/// The `n`-th retry (from 0) waits `max(jitter, hint)`, where `jitter` is drawn from
/// `[0, min(cap, base x 2^n)]` (capped exponential backoff with full jitter, AWS Architecture
/// Blog, "Exponential Backoff And Jitter") and `hint` is the longest of the response's
/// `Retry-After` (delay-seconds, or an HTTP-date relative to the response's `Date` header, else
/// to the system clock; RFC 9110 §10.2.3) and `grpc-retry-pushback-ms` (gRFC A6). A negative or
/// malformed pushback means "do not retry"; a malformed `Retry-After` is ignored. Retries of
/// one policy and its clones are spread out: each goes no sooner than a spacing (its hint, at
/// most `base`) after the latest one scheduled, so that calls refused together do not all
/// come back at the instant the server frees one unit (a retry storm).
///
/// # Until
///
/// At most [`max_attempts`](RetryPolicyBuilder::max_attempts) attempts in all, and no wait
/// that would end after the [`budget`](RetryPolicyBuilder::budget) (measured from when the
/// first attempt was sent): then the last response is returned.
///
/// # Bodies
///
/// [`RetryPolicy::builder`] clones bodies with `B: Clone` (`Full<Bytes>`, `String`, ...);
/// [`RetryPolicy::builder_with_clone`] takes a function `Fn(&B) -> Option<B>` for body
/// types that can be cloned only sometimes (a buffered body, not a stream): `None` sends the
/// request once. Headers, URI, version and extensions are cloned with it.
///
/// Time is tokio's ([`tokio::time::Instant`], [`tokio::time::sleep`]), so a test under
/// `tokio::time::pause()` sees exact delays. Clones share their settings and their jitter
/// source; each request keeps its own attempt count.
pub struct RetryPolicy<B, C = NoErrors> {
    config: Arc<Config<B, C>>,
    /// Retries scheduled so far for this request (0 in the policy a service holds).
    retries: u32,
    /// When this request's first attempt was sent: the budget runs from here.
    started: Option<Instant>,
}

impl<B, C> Clone for RetryPolicy<B, C> {
    fn clone(&self) -> Self {
        Self { config: Arc::clone(&self.config), retries: self.retries, started: self.started }
    }
}

impl<B, C> fmt::Debug for RetryPolicy<B, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        f.debug_struct("RetryPolicy")
            .field("max_attempts", &c.max_attempts)
            .field("base", &c.base)
            .field("cap", &c.cap)
            .field("budget", &c.budget)
            .field("methods", &c.methods)
            .field("retries", &self.retries)
            .finish_non_exhaustive()
    }
}

impl<B: Clone + 'static> RetryPolicy<B> {
    /// Starts a policy for requests with a `Clone` body (cloned for every attempt but the
    /// last). Defaults: 3 attempts, base 100 ms, cap 20 s, budget 60 s, the idempotent methods,
    /// [`FullJitter`], no error retried.
    pub fn builder() -> RetryPolicyBuilder<B> {
        RetryPolicyBuilder::new(Box::new(|b: &B| Some(b.clone())))
    }
}

impl<B> RetryPolicy<B> {
    /// Starts a policy whose bodies are cloned by `clone_body`; a request for which it returns
    /// `None` (a streaming body, say) is sent once and never retried. Defaults as
    /// [`builder`](Self::builder).
    ///
    /// ```
    /// use tollgate::client::RetryPolicy;
    ///
    /// /// A body that is either in memory or a stream that can be read once.
    /// enum Body {
    ///     Buffered(bytes::Bytes),
    ///     Stream(tokio::sync::mpsc::Receiver<bytes::Bytes>),
    /// }
    ///
    /// let policy = RetryPolicy::builder_with_clone(|body: &Body| match body {
    ///     Body::Buffered(bytes) => Some(Body::Buffered(bytes.clone())),
    ///     Body::Stream(_) => None,
    /// })
    /// .build()
    /// .unwrap();
    /// ```
    pub fn builder_with_clone(
        clone_body: impl Fn(&B) -> Option<B> + Send + Sync + 'static,
    ) -> RetryPolicyBuilder<B> {
        RetryPolicyBuilder::new(Box::new(clone_body))
    }
}

impl<B, C> RetryPolicy<B, C> {
    /// Makes a call, and makes it again while it fails with `RESOURCE_EXHAUSTED` (8) or
    /// `UNAVAILABLE` (14), waiting as the policy says. `attempt` starts one call (a closure
    /// returning its future, as a tonic client method does), whose error is a [`GrpcStatus`]
    /// (`tonic::Status` with the `tonic` feature). It returns the first success or status not
    /// retried, or the last status once the attempts or the budget are spent.
    ///
    /// ```
    /// use std::sync::atomic::{AtomicU32, Ordering};
    /// use std::time::Duration;
    /// use tollgate::client::{GrpcStatus, RetryPolicy};
    ///
    /// /// A stand-in for `tonic::Status`: a code and the pushback trailer.
    /// struct Status(i32, Option<&'static str>);
    ///
    /// impl GrpcStatus for Status {
    ///     fn grpc_code(&self) -> i32 {
    ///         self.0
    ///     }
    ///     fn retry_pushback(&self) -> Option<&[u8]> {
    ///         self.1.map(str::as_bytes)
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let policy = RetryPolicy::<()>::builder().max_attempts(3).build().unwrap();
    /// let calls = AtomicU32::new(0);
    /// let start = tokio::time::Instant::now();
    /// let reply = policy
    ///     .call(|| async {
    ///         match calls.fetch_add(1, Ordering::SeqCst) {
    ///             0 => Err(Status(8, Some("1500"))), // RESOURCE_EXHAUSTED, back in 1.5 s
    ///             _ => Ok("served"),
    ///         }
    ///     })
    ///     .await;
    /// assert!(matches!(reply, Ok("served")));
    /// assert_eq!(start.elapsed(), Duration::from_millis(1500));
    /// # }
    /// ```
    ///
    /// With tonic (`client` a generated client over a `Channel`, `req` a message):
    ///
    /// ```no_run
    /// # #[cfg(feature = "tonic")]
    /// # async fn example(
    /// #     policy: tollgate::client::RetryPolicy<()>,
    /// #     client: tonic_health::pb::health_client::HealthClient<tonic::transport::Channel>,
    /// #     req: tonic_health::pb::HealthCheckRequest,
    /// # ) -> Result<(), tonic::Status> {
    /// let reply = policy
    ///     .call(|| {
    ///         let mut client = client.clone();
    ///         let req = req.clone();
    ///         async move { client.check(req).await }
    ///     })
    ///     .await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # How it works
    ///
    /// The `n`-th retry (from 0) waits `max(jitter, pushback)`, the jitter drawn from
    /// `[0, min(cap, base x 2^n)]` and the pushback the status's `grpc-retry-pushback-ms`
    /// (gRFC A6; milliseconds). A negative or malformed pushback means "do not retry": that
    /// status is returned. At most [`max_attempts`](RetryPolicyBuilder::max_attempts) calls,
    /// and no wait that would end after the [`budget`](RetryPolicyBuilder::budget) (from the
    /// first call): then the last status is returned. Any other status, and success, is
    /// returned at once. The policy's HTTP methods do not apply: `RESOURCE_EXHAUSTED` from a
    /// rate limiter means the call was not processed, but retry `UNAVAILABLE` only for calls
    /// that are safe to repeat.
    ///
    /// Time is tokio's, so a test under `tokio::time::pause()` sees exact delays.
    pub async fn call<T, S, F, Fut>(&self, mut attempt: F) -> Result<T, S>
    where
        S: GrpcStatus,
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, S>>,
    {
        let mut this =
            Self { config: Arc::clone(&self.config), retries: 0, started: Some(Instant::now()) };
        loop {
            let result = attempt().await;
            let Err(status) = &result else { return result };
            let Some(hint) = grpc_hint(status) else { return result };
            let Some(wait) = this.next_wait(hint) else { return result };
            // Not held while waiting: a status can carry large details.
            drop(result);
            tracing::debug!(retry = this.retries, ?wait, "tollgate: retrying a gRPC call");
            tokio::time::sleep(wait).await;
        }
    }

    /// The ceiling of the backoff before the `retry`-th retry (from 0), before jitter:
    /// `min(cap, base x 2^retry)`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::client::RetryPolicy;
    ///
    /// let policy = RetryPolicy::<String>::builder()
    ///     .base(Duration::from_millis(100))
    ///     .cap(Duration::from_millis(500))
    ///     .build()
    ///     .unwrap();
    /// let ceilings: Vec<u128> = (0..5).map(|n| policy.backoff_ceiling(n).as_millis()).collect();
    /// assert_eq!(ceilings, [100, 200, 400, 500, 500]);
    /// ```
    #[must_use]
    pub fn backoff_ceiling(&self, retry: u32) -> Duration {
        self.config.ceiling(retry)
    }

    /// The wait before the next retry for a retryable response whose hint is `hint`, or `None`
    /// when the attempts or the budget are spent. Counts the retry.
    fn next_wait(&mut self, hint: Duration) -> Option<Duration> {
        let c = &self.config;
        if self.retries.saturating_add(1) >= c.max_attempts {
            return None;
        }
        let ceiling = c.ceiling(self.retries);
        let now = Instant::now();
        let own = now + c.jitter.sample(ceiling).min(ceiling).max(hint).min(MAX_WAIT);
        let elapsed = self.started.map_or(Duration::ZERO, |s| s.elapsed());
        let within = |at: Instant| elapsed.saturating_add(at - now) <= c.budget;
        let wait = c.schedule(own, hint, within)? - now;
        self.retries += 1;
        Some(wait)
    }
}

impl<B, C, ResB, E> Policy<Request<B>, Response<ResB>, E> for RetryPolicy<B, C>
where
    C: RetryErrors<E>,
{
    type Future = Sleep;

    fn retry(
        &mut self,
        _req: &mut Request<B>,
        result: &mut Result<Response<ResB>, E>,
    ) -> Option<Self::Future> {
        let hint = match result {
            Ok(res) => self.config.hint(res)?,
            Err(error) if self.config.errors.is_transient(error) => Duration::ZERO,
            Err(_) => return None,
        };
        let wait = self.next_wait(hint)?;
        tracing::debug!(retry = self.retries, ?wait, "tollgate: retrying");
        Some(tokio::time::sleep(wait))
    }

    fn clone_request(&mut self, req: &Request<B>) -> Option<Request<B>> {
        if self.retries == 0 {
            // The first attempt of a request: its budget starts now.
            self.started = Some(Instant::now());
        }
        if !self.config.methods.contains(req.method()) {
            return None;
        }
        let body = (self.config.clone_body)(req.body())?;
        let mut clone = Request::new(body);
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.version_mut() = req.version();
        *clone.headers_mut() = req.headers().clone();
        *clone.extensions_mut() = req.extensions().clone();
        Some(clone)
    }
}

/// Builds a [`RetryPolicy`], started by [`RetryPolicy::builder`]. Setters only collect values,
/// and [`build`](Self::build) checks them all, failing with [`ConfigError::Invalid`] naming the
/// setting.
///
/// ```
/// use std::time::Duration;
/// use tollgate::client::RetryPolicy;
/// use tollgate::ConfigError;
///
/// let policy = RetryPolicy::<String>::builder()
///     .max_attempts(4)
///     .base(Duration::from_millis(50))
///     .build()
///     .unwrap();
/// assert_eq!(policy.backoff_ceiling(2), Duration::from_millis(200));
///
/// let err = RetryPolicy::<String>::builder().max_attempts(0).build().unwrap_err();
/// assert!(matches!(err, ConfigError::Invalid { setting: "max_attempts", .. }));
/// ```
#[must_use]
pub struct RetryPolicyBuilder<B, C = NoErrors> {
    max_attempts: u32,
    base: Duration,
    cap: Duration,
    budget: Duration,
    methods: Vec<Method>,
    clone_body: CloneBody<B>,
    jitter: Box<dyn Jitter>,
    errors: C,
}

impl<B, C> fmt::Debug for RetryPolicyBuilder<B, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryPolicyBuilder")
            .field("max_attempts", &self.max_attempts)
            .field("base", &self.base)
            .field("cap", &self.cap)
            .field("budget", &self.budget)
            .field("methods", &self.methods)
            .finish_non_exhaustive()
    }
}

impl<B> RetryPolicyBuilder<B> {
    fn new(clone_body: CloneBody<B>) -> Self {
        Self {
            max_attempts: 3,
            base: Duration::from_millis(100),
            cap: Duration::from_secs(20),
            budget: Duration::from_secs(60),
            methods: vec![
                Method::GET,
                Method::HEAD,
                Method::OPTIONS,
                Method::TRACE,
                Method::PUT,
                Method::DELETE,
            ],
            clone_body,
            jitter: Box::new(FullJitter::new()),
            errors: NoErrors,
        }
    }
}

impl<B, C> RetryPolicyBuilder<B, C> {
    /// At most `n` attempts in all, the first included (default 3; at least 1, which never
    /// retries).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }

    /// The backoff's base: the ceiling of the first retry's jitter (default 100 ms; more than
    /// zero).
    pub fn base(mut self, base: Duration) -> Self {
        self.base = base;
        self
    }

    /// The backoff's cap, above which no jitter ceiling goes (default 20 s; at least
    /// [`base`](Self::base)). A server's hint may be longer.
    pub fn cap(mut self, cap: Duration) -> Self {
        self.cap = cap;
        self
    }

    /// The time budget of a request, from its first attempt (default 60 s; more than zero): a
    /// wait that would end after it is not taken and the last response is returned.
    pub fn budget(mut self, budget: Duration) -> Self {
        self.budget = budget;
        self
    }

    /// The methods that are retried (default: the idempotent methods of RFC 9110 §9.2.2, GET,
    /// HEAD, OPTIONS, TRACE, PUT, DELETE). Add POST only for endpoints that are idempotent
    /// (an idempotency key, say).
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// The random source of the backoff (default [`FullJitter::new`]).
    pub fn jitter(mut self, jitter: impl Jitter) -> Self {
        self.jitter = Box::new(jitter);
        self
    }

    /// Retries the errors of the inner service for which `f` is true (after the backoff, with
    /// no server hint), e.g. `|e: &hyper_util::client::legacy::Error| e.is_connect()`. Errors
    /// are not retried by default; see [`RetryErrors`].
    pub fn retry_errors_if<E, F>(self, f: F) -> RetryPolicyBuilder<B, F>
    where
        F: Fn(&E) -> bool + Send + Sync + 'static,
    {
        RetryPolicyBuilder {
            max_attempts: self.max_attempts,
            base: self.base,
            cap: self.cap,
            budget: self.budget,
            methods: self.methods,
            clone_body: self.clone_body,
            jitter: self.jitter,
            errors: f,
        }
    }

    /// Checks the settings and builds the policy.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the setting: `max_attempts` of 0, a zero `base` or
    /// `budget`, a `cap` below `base`, empty `methods`.
    pub fn build(self) -> Result<RetryPolicy<B, C>, ConfigError> {
        let invalid = |setting, reason: &str| {
            Err(ConfigError::Invalid { setting, reason: reason.to_owned() })
        };
        if self.max_attempts == 0 {
            return invalid("max_attempts", "must be at least 1 (the first attempt)");
        }
        if self.base.is_zero() {
            return invalid("base", "must be more than zero");
        }
        if self.cap < self.base {
            return invalid("cap", "must be at least `base`");
        }
        if self.budget.is_zero() {
            return invalid("budget", "must be more than zero");
        }
        if self.methods.is_empty() {
            return invalid("methods", "no request would ever be retried");
        }
        Ok(RetryPolicy {
            config: Arc::new(Config {
                last: Mutex::new(None),
                max_attempts: self.max_attempts,
                base: self.base,
                cap: self.cap,
                budget: self.budget,
                methods: self.methods,
                clone_body: self.clone_body,
                jitter: self.jitter,
                errors: self.errors,
            }),
            retries: 0,
            started: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_named() {
        let setting = |b: RetryPolicyBuilder<String>| match b.build() {
            Err(ConfigError::Invalid { setting, .. }) => setting,
            other => panic!("expected an invalid setting, got {other:?}"),
        };
        assert_eq!(setting(RetryPolicy::builder().max_attempts(0)), "max_attempts");
        assert_eq!(setting(RetryPolicy::builder().base(Duration::ZERO)), "base");
        assert_eq!(
            setting(
                RetryPolicy::builder().base(Duration::from_secs(2)).cap(Duration::from_secs(1))
            ),
            "cap"
        );
        assert_eq!(setting(RetryPolicy::builder().budget(Duration::ZERO)), "budget");
        assert_eq!(setting(RetryPolicy::builder().methods([])), "methods");
        assert!(RetryPolicy::<String>::builder().max_attempts(1).build().is_ok());
    }

    #[test]
    fn ceilings_double_up_to_the_cap_without_overflow() {
        let policy = RetryPolicy::<String>::builder()
            .base(Duration::from_millis(100))
            .cap(Duration::from_secs(1))
            .build()
            .unwrap();
        let ceilings: Vec<Duration> = (0..6).map(|n| policy.backoff_ceiling(n)).collect();
        let ms = Duration::from_millis;
        assert_eq!(ceilings, [ms(100), ms(200), ms(400), ms(800), ms(1000), ms(1000)]);
        assert_eq!(policy.backoff_ceiling(31), Duration::from_secs(1));
        assert_eq!(policy.backoff_ceiling(32), Duration::from_secs(1));
        assert_eq!(policy.backoff_ceiling(u32::MAX), Duration::from_secs(1));
    }

    #[test]
    fn full_jitter_stays_within_the_ceiling_and_follows_its_seed() {
        let jitter = FullJitter::with_seed(1);
        let mut rng = fastrand::Rng::with_seed(1);
        for ms in [0, 1, 10, 100, 1000] {
            let ceiling = Duration::from_millis(ms);
            let d = jitter.sample(ceiling);
            assert!(d <= ceiling);
            assert_eq!(d, Duration::from_millis(rng.u64(0..=ms)));
        }
        assert_eq!(jitter.sample(Duration::ZERO), Duration::ZERO);
        assert_eq!(jitter.sample(Duration::from_micros(999)), Duration::ZERO);
        // The largest ceiling draws without panicking.
        assert!(jitter.sample(Duration::MAX) <= Duration::MAX);
    }

    #[test]
    fn responses_are_classified() {
        let policy = RetryPolicy::<String>::builder().build().unwrap();
        let res = |status: u16, headers: &[(&str, &str)]| {
            let mut b = Response::builder().status(status);
            for (k, v) in headers {
                b = b.header(*k, *v);
            }
            b.body(()).unwrap()
        };
        let hint = |r: Response<()>| policy.config.hint(&r);
        assert_eq!(hint(res(429, &[])), Some(Duration::ZERO));
        assert_eq!(hint(res(503, &[("retry-after", "3")])), Some(Duration::from_secs(3)));
        assert_eq!(hint(res(200, &[])), None);
        assert_eq!(hint(res(500, &[])), None);
        assert_eq!(hint(res(200, &[("grpc-status", "8")])), Some(Duration::ZERO));
        assert_eq!(hint(res(200, &[("grpc-status", "14")])), Some(Duration::ZERO));
        assert_eq!(hint(res(200, &[("grpc-status", "0")])), None);
        assert_eq!(hint(res(200, &[("grpc-status", "13")])), None);
        let pushed = res(200, &[("grpc-status", "8"), ("grpc-retry-pushback-ms", "1500")]);
        assert_eq!(hint(pushed), Some(Duration::from_millis(1500)));
        let both = res(429, &[("retry-after", "1"), ("grpc-retry-pushback-ms", "2500")]);
        assert_eq!(hint(both), Some(Duration::from_millis(2500)));
        assert_eq!(hint(res(200, &[("grpc-status", "8"), ("grpc-retry-pushback-ms", "-5")])), None);
    }

    /// A gRPC status: a code and a pushback trailer.
    struct Status(i32, Option<&'static str>);

    impl GrpcStatus for Status {
        fn grpc_code(&self) -> i32 {
            self.0
        }

        fn retry_pushback(&self) -> Option<&[u8]> {
            self.1.map(str::as_bytes)
        }
    }

    /// Calls with `policy` a service answering `script[n]` to its `n`-th call (the last one
    /// ever after); returns the outcome, the instants of the calls (ms from the start).
    async fn calls(
        policy: &RetryPolicy<()>,
        script: &[(i32, Option<&'static str>)],
    ) -> (Result<(), i32>, Vec<u128>) {
        let start = Instant::now();
        let log = Mutex::new(Vec::new());
        let result = policy
            .call(|| {
                let mut log = log.lock().unwrap();
                let (code, pushback) = script[log.len().min(script.len() - 1)];
                log.push(start.elapsed().as_millis());
                async move { if code == 0 { Ok(()) } else { Err(Status(code, pushback)) } }
            })
            .await;
        (result.map_err(|s| s.0), log.into_inner().unwrap())
    }

    fn policy(attempts: u32, budget: Duration) -> RetryPolicy<()> {
        RetryPolicy::<()>::builder()
            .max_attempts(attempts)
            .base(Duration::from_millis(100))
            .budget(budget)
            .jitter(|ceiling| ceiling)
            .build()
            .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn grpc_calls_are_retried_by_status_and_pushback() {
        let long = Duration::from_secs(60);
        // RESOURCE_EXHAUSTED waits for its pushback, UNAVAILABLE for the backoff alone.
        let (result, at) =
            calls(&policy(5, long), &[(8, Some("1500")), (14, None), (0, None)]).await;
        assert_eq!((result, at), (Ok(()), vec![0, 1500, 1700]));
        // Statuses that are not retried, a pushback that says "do not retry".
        for script in [(13, None), (3, Some("10")), (8, Some("-1")), (14, Some("soon"))] {
            let (result, at) = calls(&policy(5, long), &[script]).await;
            assert_eq!((result, at), (Err(script.0), vec![0]), "{script:?}");
        }
        // The attempts, then the budget, end the retries with the last status.
        let (result, at) = calls(&policy(3, long), &[(14, None)]).await;
        assert_eq!((result, at), (Err(14), vec![0, 100, 300]));
        let (result, at) =
            calls(&policy(5, Duration::from_millis(2500)), &[(8, Some("1000"))]).await;
        assert_eq!((result, at), (Err(8), vec![0, 1000, 2000]));
        // A negative code is no gRPC status: returned as it is.
        let (result, at) = calls(&policy(5, long), &[(-8, None)]).await;
        assert_eq!((result, at), (Err(-8), vec![0]));
    }
}
