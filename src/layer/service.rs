//! [`RateLimit`], the service, and how it carries bodies ([`Carry`]): it hands each request to
//! [`decide`](super::decide::decide).

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use tower_service::Service;

use super::Config;
use super::body::{RequestBody, ResponseBody};
use super::decide::decide;
use super::future::{ResponseFuture, Slow};
use super::metered::serve_metered;
use super::plan::Demand;
use crate::headers::PreparedHeaders;
use crate::key::{Key, KeyExtractor};
use crate::limiter::Reservation;
use crate::store::Store;

/// The rate-limiting service made by [`RateLimitLayer`](crate::RateLimitLayer).
///
/// Decides in `call`, never in `poll_ready` (which is delegated to the inner service), so no
/// capacity is taken for a request that never comes. Limits become responses; the inner
/// service's error passes through unchanged.
pub struct RateLimit<S, K, St: Store, B = Metered> {
    inner: S,
    config: Arc<Config<K, St>>,
    /// One of several layers limiting each request (the rules of a configuration file that
    /// apply together): the rate-limit headers are handed on in the response's extensions,
    /// for the outermost to write them once.
    collect: bool,
    bodies: PhantomData<fn() -> B>,
}

impl<S: Clone, K, St: Store, B> Clone for RateLimit<S, K, St, B> {
    fn clone(&self) -> Self {
        let (inner, config) = (self.inner.clone(), Arc::clone(&self.config));
        Self { inner, config, collect: self.collect, bodies: PhantomData }
    }
}

impl<S: fmt::Debug, K, St: Store, B> fmt::Debug for RateLimit<S, K, St, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("policy", &self.config.limiter.policy().name())
            .finish_non_exhaustive()
    }
}

impl<S, K, St: Store, B> RateLimit<S, K, St, B> {
    pub(crate) fn new(inner: S, config: Arc<Config<K, St>>) -> Self {
        Self { inner, config, collect: false, bodies: PhantomData }
    }

    /// This service, handing its rate-limit headers on as values
    /// ([`Collected`](crate::headers::Collected)) instead of writing them.
    #[cfg(feature = "config")]
    pub(crate) fn collecting(mut self) -> Self {
        self.collect = true;
        self
    }

    inner_service_accessors!();

    /// The inner service, mutably, and the layer's config: what `call` decides with.
    pub(super) fn parts(&mut self) -> (&mut S, &Arc<Config<K, St>>) {
        (&mut self.inner, &self.config)
    }

    /// The inner service, mutably (for `poll_ready`).
    pub(super) fn inner_mut(&mut self) -> &mut S {
        &mut self.inner
    }
}

impl<S, K, St, ReqB, ResB> Service<Request<ReqB>> for RateLimit<S, K, St, Metered>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    K: KeyExtractor,
    St: Store,
    ReqB: http_body::Body + Send + 'static,
    ResB: Send + 'static,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let metered = Some(metered::<S, K, St, ReqB, ResB> as _);
        decide::<Metered, _, _, _, _, _>(&mut self.inner, &self.config, self.collect, metered, req)
            .into()
    }
}

/// How a layer's service hands bodies on and back, a sealed type parameter of
/// [`RateLimitLayer`](crate::RateLimitLayer). [`Metered`] (the default) wraps them in the
/// layer's own [`RequestBody`] and [`ResponseBody`] to meter them, and [`Lean`] hands on the
/// request's own body and answers with the inner service's own response body, for policies
/// that observe no body ([`RateLimitLayer::lean`](crate::RateLimitLayer::lean)).
///
/// ```
/// use tollgate::layer::{Lean, Metered, RateLimitLayer};
/// use tollgate::{Policy, Quota};
///
/// let layer: RateLimitLayer = RateLimitLayer::builder(Policy::single("api", Quota::per_second(5)).unwrap())
///     .build()
///     .unwrap();
/// let lean: RateLimitLayer<_, _, Lean> = layer.lean().unwrap();
/// # let _: RateLimitLayer<_, _, Metered> = layer;
/// # let _ = lean;
/// ```
pub trait Bodies: sealed::Sealed + Send + Sync + 'static {
    /// The body the service answers with, the inner service answering with `B`.
    type Response<B>;

    /// The inner service's response body as the service answers with it.
    fn response<B>(body: B) -> Self::Response<B>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Metered {}
    impl Sealed for super::Lean {}
}

/// The bodies of the layer's service wrapped to be metered (the default): the handler gets
/// [`RequestBody`], the service answers with [`ResponseBody`]. See [`Bodies`].
#[derive(Debug)]
pub enum Metered {}

impl Bodies for Metered {
    type Response<B> = ResponseBody<B>;

    #[inline]
    fn response<B>(body: B) -> ResponseBody<B> {
        ResponseBody::inner(body)
    }
}

/// The bodies of the layer's service handed on as they are, for policies that observe no
/// body ([`RateLimitLayer::lean`](crate::RateLimitLayer::lean)). See [`Bodies`].
#[derive(Debug)]
pub enum Lean {}

impl Bodies for Lean {
    type Response<B> = B;

    #[inline]
    fn response<B>(body: B) -> B {
        body
    }
}

/// How a service of the layer hands bodies on and back. [`Metered`] wraps both in the
/// layer's own bodies ([`RequestBody`], [`ResponseBody`]) so that it can meter them; [`Lean`]
/// hands on the request's own body and answers with the inner service's own response body,
/// for policies that observe no body. The decision steps are written once, over this.
pub(super) trait Carry<ReqB, ResB>: 'static {
    /// The request body the inner service receives.
    type Req: http_body::Body + Send + 'static;
    /// The response body the service answers with.
    type Res: Send + 'static;
    /// The request as the inner service receives it.
    fn request(req: Request<ReqB>) -> Request<Self::Req>;
    /// The inner service's response body as the service answers with it.
    fn response(body: ResB) -> Self::Res;
    /// The body of a response the layer made (a refusal).
    fn refusal(body: Bytes) -> Self::Res;
}

impl<ReqB: http_body::Body + Send + 'static, ResB: Send + 'static> Carry<ReqB, ResB> for Metered {
    type Req = RequestBody<ReqB>;
    type Res = ResponseBody<ResB>;

    #[inline]
    fn request(req: Request<ReqB>) -> Request<Self::Req> {
        req.map(RequestBody::new)
    }

    #[inline]
    fn response(body: ResB) -> Self::Res {
        ResponseBody::inner(body)
    }

    #[inline]
    fn refusal(body: Bytes) -> Self::Res {
        ResponseBody::own(Full::new(body))
    }
}

impl<ReqB: http_body::Body + Send + 'static, ResB: From<Bytes> + Send + 'static> Carry<ReqB, ResB>
    for Lean
{
    type Req = ReqB;
    type Res = ResB;

    // The request itself, not taken apart and put together again.
    #[inline]
    fn request(req: Request<ReqB>) -> Request<Self::Req> {
        req
    }

    #[inline]
    fn response(body: ResB) -> Self::Res {
        body
    }

    #[inline]
    fn refusal(body: Bytes) -> Self::Res {
        ResB::from(body)
    }
}

/// How a service serves an admitted request whose policy meters something while it runs
/// ([`RateLimit`]'s: [`serve_metered`]). A function pointer handed to the shared steps rather
/// than a method of [`Carry`]: the inner service's bounds, written over `Carry`'s associated
/// body types, do not carry over to a generic method's implementations.
pub(super) type ServeMetered<S, K, St, Q, R, E> = fn(
    Arc<Config<K, St>>,
    (usize, bool),
    S,
    Request<Q>,
    (Key, Demand),
    Reservation<St>,
    PreparedHeaders,
) -> Slow<R, E>;

/// The [`ServeMetered`] of a service carrying bodies as `C` does; `None` for one that meters nothing.
pub(super) type MeteredBy<C, S, K, St, ReqB, ResB> = Option<
    ServeMetered<
        S,
        K,
        St,
        <C as Carry<ReqB, ResB>>::Req,
        <C as Carry<ReqB, ResB>>::Res,
        <S as Service<Request<<C as Carry<ReqB, ResB>>::Req>>>::Error,
    >,
>;

/// [`serve_metered`], boxed: [`RateLimit`]'s [`ServeMetered`].
fn metered<S, K, St, ReqB, ResB>(
    config: Arc<Config<K, St>>,
    policy: (usize, bool),
    inner: S,
    req: Request<RequestBody<ReqB>>,
    demand: (Key, Demand),
    reservation: Reservation<St>,
    headers: PreparedHeaders,
) -> Slow<ResponseBody<ResB>, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    K: KeyExtractor,
    St: Store,
    ReqB: http_body::Body + Send + 'static,
    ResB: Send + 'static,
{
    Box::pin(serve_metered(config, policy, inner, req, demand, reservation, headers))
}
