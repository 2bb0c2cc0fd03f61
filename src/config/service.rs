//! [`Limits`], the service of a [`LimitsLayer`](super::LimitsLayer): it finds the rules that
//! match a request in the running configuration and passes the request through their
//! rate-limit layers; its future and body.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use pin_project_lite::pin_project;
use smallvec::SmallVec;
use tower_layer::Layer;
use tower_service::Service;

use super::state::{Shared, Snapshot};
use crate::headers::Collected;
use crate::layer::{RequestBody, ResponseBody, ResponseFuture};
use crate::store::{MemoryStore, Store};

/// The service made by [`LimitsLayer`](super::LimitsLayer).
///
/// Reads the running configuration once per request (without locking), then: no rule matches,
/// the inner service's future as it is; one rule, that rule's
/// [`RateLimit`](crate::RateLimit) around the inner service; several, their `RateLimit`s
/// nested in file order (boxed: one allocation for the future and one for the body per
/// rule). `poll_ready` is the inner service's; nothing is decided before `call`.
pub struct Limits<S, St: Store = MemoryStore> {
    inner: S,
    shared: Arc<Shared<St>>,
}

impl<S: Clone, St: Store> Clone for Limits<S, St> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone(), shared: Arc::clone(&self.shared) }
    }
}

impl<S: fmt::Debug, St: Store> fmt::Debug for Limits<S, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Limits").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl<S, St: Store> Limits<S, St> {
    pub(super) fn new(inner: S, shared: Arc<Shared<St>>) -> Self {
        Self { inner, shared }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the service, returning the inner one.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

type Boxed<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<UnsyncBoxBody<Bytes, B>>, E>> + Send>>;

impl<S, St, ReqB, ResB> Service<Request<ReqB>> for Limits<S, St>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    St: Store,
    ReqB: Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<LimitsBody<ResB>>;
    type Error = S::Error;
    type Future = LimitsFuture<S::Future, ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let snapshot = self.shared.current.load();
        let (method, path) = (req.method(), req.uri().path());
        let matched: SmallVec<[usize; 4]> = snapshot
            .rules
            .iter()
            .enumerate()
            .filter(|(_, r)| r.matcher.matches(method, path))
            .map(|(i, _)| i)
            .collect();
        if matched.is_empty() {
            let future = self.inner.call(req.map(RequestBody::new));
            return LimitsFuture { kind: FutureKind::Pass { future } };
        }
        // The service that was polled ready goes into the rules' layers; a clone stays for the
        // next request.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let kind = match matched[..] {
            [one] => FutureKind::One { future: snapshot.rules[one].layer.layer(inner).call(req) },
            _ => {
                let chain = Chain {
                    snapshot: arc_swap::Guard::into_inner(snapshot),
                    matched: matched.into_iter().collect(),
                    next: 0,
                    inner,
                };
                let req = req.map(|body| RequestBody::new(RequestBody::new(body)));
                FutureKind::Many { future: start(chain, req) }
            }
        };
        LimitsFuture { kind }
    }
}

/// The rules a request matched, from `next` on, around the inner service: the service that
/// rule `matched[next - 1]`'s `RateLimit` wraps.
struct Chain<S, St: Store> {
    snapshot: Arc<Snapshot<St>>,
    matched: Arc<[usize]>,
    next: usize,
    inner: S,
}

impl<S: Clone, St: Store> Clone for Chain<S, St> {
    fn clone(&self) -> Self {
        Self {
            snapshot: Arc::clone(&self.snapshot),
            matched: Arc::clone(&self.matched),
            next: self.next,
            inner: self.inner.clone(),
        }
    }
}

/// The outermost rule's response, with the rate-limit headers of the rules inside it.
fn start<S, St, ReqB, ResB>(
    mut chain: Chain<S, St>,
    req: Request<RequestBody<RequestBody<ReqB>>>,
) -> Boxed<ResB::Error, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    St: Store,
    ReqB: Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
{
    let future = chain.call(req);
    Box::pin(async move {
        let mut res = future.await?;
        if let Some(collected) = res.extensions_mut().remove::<Collected>() {
            collected.write(res.headers_mut());
        }
        Ok(res)
    })
}

/// Each rule's `RateLimit` hands the service inside it a [`RequestBody`] of what it received;
/// the chain flattens the two into one, so the inner service gets one `RequestBody` counted by
/// every rule, however many apply.
impl<S, St, ReqB, ResB> Service<Request<RequestBody<RequestBody<ReqB>>>> for Chain<S, St>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    St: Store,
    ReqB: Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
{
    type Response = Response<UnsyncBoxBody<Bytes, ResB::Error>>;
    type Error = S::Error;
    type Future = Boxed<ResB::Error, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<RequestBody<RequestBody<ReqB>>>) -> Self::Future {
        let req = req.map(RequestBody::flatten);
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let Some(&rule) = self.matched.get(self.next) else {
            // Inside the innermost rule: the inner service.
            let future = inner.call(req);
            return Box::pin(async move { Ok(future.await?.map(UnsyncBoxBody::new)) });
        };
        let below = Chain {
            snapshot: Arc::clone(&self.snapshot),
            matched: Arc::clone(&self.matched),
            next: self.next + 1,
            inner,
        };
        // Each rule hands its headers on, for `start` to write those of all at once.
        let future = self.snapshot.rules[rule].layer.layer(below).collecting().call(req);
        Box::pin(async move { Ok(future.await?.map(UnsyncBoxBody::new)) })
    }
}

pin_project! {
    /// The response future of [`Limits`]: `F` is the inner service's future, `B` its
    /// response body, `E` its error. No rule: `F` itself; one rule: that rule's
    /// [`ResponseFuture`]; several: boxed.
    pub struct LimitsFuture<F, B, E>
    where
        B: Body,
    {
        #[pin]
        kind: FutureKind<F, B, E>,
    }
}

pin_project! {
    #[project = FutureProj]
    enum FutureKind<F, B, E>
    where
        B: Body,
    {
        Pass { #[pin] future: F },
        One { #[pin] future: ResponseFuture<F, B, E> },
        Many { future: Boxed<B::Error, E> },
    }
}

impl<F, B: Body, E> fmt::Debug for LimitsFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let rules = match self.kind {
            FutureKind::Pass { .. } => "none",
            FutureKind::One { .. } => "one",
            FutureKind::Many { .. } => "several",
        };
        f.debug_struct("LimitsFuture").field("rules", &rules).finish()
    }
}

impl<F, B, E> Future for LimitsFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: Body<Data = Bytes>,
{
    type Output = Result<Response<LimitsBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let res = match self.project().kind.project() {
            FutureProj::Pass { future } => ready!(future.poll(cx))?.map(BodyKind::pass),
            FutureProj::One { future } => ready!(future.poll(cx))?.map(BodyKind::one),
            FutureProj::Many { future } => ready!(future.as_mut().poll(cx))?.map(BodyKind::many),
        };
        Poll::Ready(Ok(res))
    }
}

pin_project! {
    /// The response body of [`Limits`]: the inner service's body `B` when no rule applied,
    /// else the body of the rules' [`RateLimit`](crate::RateLimit) (the inner body, or the
    /// bytes of a refusal), boxed when several rules applied.
    pub struct LimitsBody<B>
    where
        B: Body,
    {
        #[pin]
        kind: BodyKind<B>,
    }
}

pin_project! {
    #[project = BodyProj]
    enum BodyKind<B>
    where
        B: Body,
    {
        Pass { #[pin] body: B },
        One { #[pin] body: ResponseBody<B> },
        Many { #[pin] body: UnsyncBoxBody<Bytes, B::Error> },
    }
}

impl<B: Body> BodyKind<B> {
    fn pass(body: B) -> LimitsBody<B> {
        LimitsBody { kind: Self::Pass { body } }
    }

    fn one(body: ResponseBody<B>) -> LimitsBody<B> {
        LimitsBody { kind: Self::One { body } }
    }

    fn many(body: UnsyncBoxBody<Bytes, B::Error>) -> LimitsBody<B> {
        LimitsBody { kind: Self::Many { body } }
    }
}

impl<B: Body> fmt::Debug for LimitsBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.kind {
            BodyKind::Pass { .. } => "LimitsBody::Pass",
            BodyKind::One { .. } => "LimitsBody::One",
            BodyKind::Many { .. } => "LimitsBody::Many",
        })
    }
}

impl<B> Body for LimitsBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            BodyProj::Pass { body } => body.poll_frame(cx),
            BodyProj::One { body } => body.poll_frame(cx),
            BodyProj::Many { body } => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            BodyKind::Pass { body } => body.is_end_stream(),
            BodyKind::One { body } => body.is_end_stream(),
            BodyKind::Many { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            BodyKind::Pass { body } => body.size_hint(),
            BodyKind::One { body } => body.size_hint(),
            BodyKind::Many { body } => body.size_hint(),
        }
    }
}
