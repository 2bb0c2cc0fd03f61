//! [`LeanLayer`], [`LeanRateLimit`] and [`LeanFuture`]: the layer for policies that observe no
//! body, handing on the request's own body and answering with the inner service's own
//! response body.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use super::decide::decide;
use super::future::State;
use super::meter::Needs;
use super::service::Lean;
use super::{Config, RateLimitLayer};
use crate::error::ConfigError;
use crate::key::KeyExtractor;
use crate::store::Store;
use crate::{TierKind, Unit};

impl<K, St: Store> RateLimitLayer<K, St> {
    /// This layer, lean: its service hands the inner service the request as it came (its own
    /// body type, not [`RequestBody`](crate::RequestBody)) and answers with the inner
    /// service's own response body type (not [`ResponseBody`](crate::layer::ResponseBody)), building
    /// its refusals from their bytes (`ResB: From<Bytes>`, as axum's `Body` and
    /// `http_body_util::Full<Bytes>` are). tonic's `tonic::body::Body`, hyper's `Incoming` and
    /// boxed or compressed bodies are not `From<Bytes>`: put the lean layer where the inner
    /// service answers with axum's `Body` (any axum `Router::layer` or `route_layer`), and use
    /// the layer itself for a tonic server.
    ///
    /// Same decisions, headers and refusals as the layer itself, sharing its state (its
    /// store, keys, scope, observer, settings): a router that takes any body type boxes a
    /// foreign body into its own once more on the way in and once more on the way out (axum's
    /// `Route` does), which a policy that observes no body need not pay for.
    ///
    /// Only for policies that observe no body while a request runs: every tier a rate or a
    /// calendar window counting requests (at a fixed or computed cost, settled or refunded
    /// from the response head as usual). A layer whose policies (its own and those added
    /// with [`policy`](crate::RateLimitLayerBuilder::policy) for a selector) all qualify
    /// can be made lean. A lean layer never collects headers for an outer one (the rules of a
    /// configuration file use the layer itself).
    ///
    /// # Errors
    /// [`ConfigError::ObservesBody`], naming the policy and the tier, when a policy has a
    /// concurrency tier (its slots are held until the response ends) or a tier counting
    /// request or response bytes, messages, or reported units.
    ///
    /// # Example
    /// ```
    /// use axum::{Router, body::Body, routing::get};
    /// use http::{Request, StatusCode};
    /// use tollgate::key::GlobalKey;
    /// use tollgate::{Policy, Quota, RateLimitLayer};
    /// use tower::ServiceExt;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_minute(1)).unwrap())
    ///     .key(GlobalKey)
    ///     .build()
    ///     .unwrap();
    /// let app: Router = Router::new().route("/", get(|| async { "hi" })).layer(layer.lean().unwrap());
    /// let first = app.clone().oneshot(Request::new(Body::empty())).await.unwrap();
    /// assert_eq!(first.status(), StatusCode::OK);
    /// assert_eq!(first.headers()["ratelimit"], r#""api";r=0;t=60"#);
    /// let second = app.oneshot(Request::new(Body::empty())).await.unwrap();
    /// assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    /// # }
    /// ```
    pub fn lean(&self) -> Result<LeanLayer<K, St>, ConfigError> {
        let config = &self.config;
        let others = config.scope.iter().flat_map(|scope| scope.others.iter());
        for limiter in std::iter::once(&config.limiter).chain(others) {
            let policy = limiter.policy();
            if !Needs::of(policy).any() {
                continue;
            }
            for tier in policy.tiers() {
                let reason = match (tier.kind(), tier.unit()) {
                    (TierKind::Concurrency, _) => {
                        "holds concurrency slots until the response ends".to_owned()
                    }
                    (_, Unit::Requests) => continue,
                    (_, unit) => format!("counts {}", unit.name()),
                };
                return Err(ConfigError::ObservesBody {
                    policy: policy.name().to_owned(),
                    tier: tier.name().to_owned(),
                    reason,
                });
            }
        }
        Ok(LeanLayer { config: Arc::clone(config) })
    }
}

/// A [`RateLimitLayer`] for policies that observe no body, made by
/// [`RateLimitLayer::lean`]: its service, [`LeanRateLimit`], passes bodies through as they
/// are.
pub struct LeanLayer<K, St: Store> {
    config: Arc<Config<K, St>>,
}

impl<K, St: Store> Clone for LeanLayer<K, St> {
    fn clone(&self) -> Self {
        Self { config: Arc::clone(&self.config) }
    }
}

impl<K, St: Store> fmt::Debug for LeanLayer<K, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeanLayer")
            .field("policy", &self.config.limiter.policy().name())
            .finish_non_exhaustive()
    }
}

impl<S, K, St: Store> Layer<S> for LeanLayer<K, St> {
    type Service = LeanRateLimit<S, K, St>;

    fn layer(&self, inner: S) -> Self::Service {
        LeanRateLimit { inner, config: Arc::clone(&self.config) }
    }
}

/// The service made by [`LeanLayer`]: decides as [`RateLimit`](crate::layer::RateLimit) does (in
/// `call`, never in `poll_ready`), handing the request on with its own body and answering
/// with the inner service's response body; a refusal's body is made with `ResB::from(bytes)`.
pub struct LeanRateLimit<S, K, St: Store> {
    inner: S,
    config: Arc<Config<K, St>>,
}

impl<S: Clone, K, St: Store> Clone for LeanRateLimit<S, K, St> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone(), config: Arc::clone(&self.config) }
    }
}

impl<S: fmt::Debug, K, St: Store> fmt::Debug for LeanRateLimit<S, K, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeanRateLimit")
            .field("inner", &self.inner)
            .field("policy", &self.config.limiter.policy().name())
            .finish_non_exhaustive()
    }
}

impl<S, K, St: Store> LeanRateLimit<S, K, St> {
    inner_service_accessors!();
}

impl<S, K, St, ReqB, ResB> Service<Request<ReqB>> for LeanRateLimit<S, K, St>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    K: KeyExtractor,
    St: Store,
    ReqB: http_body::Body + Send + 'static,
    ResB: From<Bytes> + Send + 'static,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = LeanFuture<S::Future, ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        // Nothing metered: `lean` refused every policy that would need it.
        let state = decide::<Lean, _, _, _, _, _>(&mut self.inner, &self.config, false, None, req);
        LeanFuture { state }
    }
}

pin_project! {
    /// The response future of [`LeanRateLimit`]: `F` is the inner service's future, `B` its
    /// response body, `E` its error. The same states as
    /// [`ResponseFuture`](crate::layer::ResponseFuture): the inner future with its prepared headers
    /// (and a charge a `405` or `refund_if` gives back), a ready refusal, or a boxed future for
    /// whatever waits.
    ///
    /// # Panics
    /// When polled again after it completed (the `Future` contract).
    pub struct LeanFuture<F, B, E> {
        #[pin]
        state: State<F, B, E>,
    }
}

impl<F, B, E> fmt::Debug for LeanFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeanFuture").field("state", &self.state.name()).finish()
    }
}

impl<F, B, E> Future for LeanFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().state.poll_with(cx, std::convert::identity)
    }
}
