//! [`RateLimit`], the service, and how it carries bodies ([`Carry`]): it hands each request to
//! [`decide`](super::decide::decide).

use std::fmt;
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
use crate::headers::Prepared;
use crate::key::{Key, KeyExtractor};
use crate::limiter::Reservation;
use crate::store::Store;

/// The rate-limiting service made by [`RateLimitLayer`](crate::RateLimitLayer).
///
/// Decides in `call`, never in `poll_ready` (which is delegated to the inner service), so no
/// capacity is taken for a request that never comes. Limits become responses; the inner
/// service's error passes through unchanged.
pub struct RateLimit<S, K, St: Store> {
    inner: S,
    config: Arc<Config<K, St>>,
    /// One of several layers limiting each request (the rules of a configuration file that
    /// apply together): the rate-limit headers are handed on in the response's extensions,
    /// for the outermost to write them once.
    collect: bool,
}

impl<S: Clone, K, St: Store> Clone for RateLimit<S, K, St> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone(), config: Arc::clone(&self.config), collect: self.collect }
    }
}

impl<S: fmt::Debug, K, St: Store> fmt::Debug for RateLimit<S, K, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("policy", &self.config.limiter.policy().name())
            .finish_non_exhaustive()
    }
}

impl<S, K, St: Store> RateLimit<S, K, St> {
    pub(crate) fn new(inner: S, config: Arc<Config<K, St>>) -> Self {
        Self { inner, config, collect: false }
    }

    /// This service, handing its rate-limit headers on as values
    /// ([`Collected`](crate::headers::Collected)) instead of writing them.
    #[cfg(feature = "config")]
    pub(crate) fn collecting(mut self) -> Self {
        self.collect = true;
        self
    }

    inner_service_accessors!();
}

impl<S, K, St, ReqB, ResB> Service<Request<ReqB>> for RateLimit<S, K, St>
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
        decide::<Observing, _, _, _, _, _>(
            &mut self.inner,
            &self.config,
            self.collect,
            metered,
            req,
        )
        .into()
    }
}

/// How a service of the layer hands bodies on and back. [`Observing`] wraps both in the
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

/// [`RateLimit`]'s bodies: both wrapped, to be metered.
pub(super) enum Observing {}

impl<ReqB: http_body::Body + Send + 'static, ResB: Send + 'static> Carry<ReqB, ResB> for Observing {
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

/// The lean service's bodies: handed on and back as they are; a refusal's made from its bytes.
pub(super) enum Lean {}

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
pub(super) type Metered<S, K, St, Q, R, E> = fn(
    Arc<Config<K, St>>,
    (usize, bool),
    S,
    Request<Q>,
    (Key, Demand),
    Reservation<St>,
    Prepared,
) -> Slow<R, E>;

/// The [`Metered`] of a service carrying bodies as `C` does; `None` for one that meters nothing.
pub(super) type MeteredBy<C, S, K, St, ReqB, ResB> = Option<
    Metered<
        S,
        K,
        St,
        <C as Carry<ReqB, ResB>>::Req,
        <C as Carry<ReqB, ResB>>::Res,
        <S as Service<Request<<C as Carry<ReqB, ResB>>::Req>>>::Error,
    >,
>;

/// [`serve_metered`], boxed: [`RateLimit`]'s [`Metered`].
fn metered<S, K, St, ReqB, ResB>(
    config: Arc<Config<K, St>>,
    policy: (usize, bool),
    inner: S,
    req: Request<RequestBody<ReqB>>,
    demand: (Key, Demand),
    reservation: Reservation<St>,
    headers: Prepared,
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
