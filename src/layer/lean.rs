//! The layer for policies that observe no body ([`Lean`] bodies): handing on the request's own
//! body and answering with the inner service's own response body.

use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use tower_service::Service;

use super::RateLimitLayer;
use super::decide::decide;
use super::future::ResponseFuture;
use super::meter::Needs;
use super::service::{Lean, Metered, RateLimit};
use crate::error::ConfigError;
use crate::key::KeyExtractor;
use crate::store::Store;
use crate::{TierKind, Unit};

impl<K, St: Store> RateLimitLayer<K, St, Metered> {
    /// This layer, lean: its service hands the inner service the request with its own body and
    /// answers with the inner service's own response body, sparing a body wrapper each way. It
    /// serves only policies that observe no body while a request runs
    /// ([`ConfigError::ObservesBody`] otherwise), and inner services whose response body is
    /// `From<Bytes>`, as axum's `Body` is.
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
    ///
    /// # How it works
    ///
    /// The lean service hands on the request's own body type (not
    /// [`RequestBody`](crate::RequestBody)) and answers with the inner service's own response
    /// body type (not [`ResponseBody`](crate::layer::ResponseBody)), building its refusals from
    /// their bytes (`ResB: From<Bytes>`, as axum's `Body` and `http_body_util::Full<Bytes>`
    /// are). tonic's `tonic::body::Body`, hyper's `Incoming` and boxed or compressed bodies are
    /// not `From<Bytes>`: put the lean layer where the inner service answers with axum's `Body`
    /// (any axum `Router::layer` or `route_layer`), and use the layer itself for a tonic server.
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
    pub fn lean(&self) -> Result<RateLimitLayer<K, St, Lean>, ConfigError> {
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
        Ok(RateLimitLayer { config: Arc::clone(config), bodies: PhantomData })
    }
}

/// The layer of [`RateLimitLayer::lean`] (deprecated name).
#[deprecated(note = "use RateLimitLayer<K, St, Lean>, which RateLimitLayer::lean returns")]
pub type LeanLayer<K, St> = RateLimitLayer<K, St, Lean>;

/// The service of a lean layer (deprecated name).
#[deprecated(note = "use RateLimit<S, K, St, Lean>")]
pub type LeanRateLimit<S, K, St> = RateLimit<S, K, St, Lean>;

/// The response future of a lean layer's service (deprecated name).
#[deprecated(note = "use ResponseFuture<F, B, E, Lean>")]
pub type LeanFuture<F, B, E> = ResponseFuture<F, B, E, Lean>;

/// The lean service: decides as with [`Metered`] bodies (in `call`, never in `poll_ready`),
/// handing the request on with its own body and answering with the inner service's response
/// body; a refusal's body is made with `ResB::from(bytes)`.
impl<S, K, St, ReqB, ResB> Service<Request<ReqB>> for RateLimit<S, K, St, Lean>
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
    type Future = ResponseFuture<S::Future, ResB, S::Error, Lean>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner_mut().poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        // Nothing metered: `lean` refused every policy that would need it.
        let (inner, config) = self.parts();
        decide::<Lean, _, _, _, _, _>(inner, config, false, None, req).into()
    }
}
