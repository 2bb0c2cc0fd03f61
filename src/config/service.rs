//! [`Limits`], the service of a [`LimitsLayer`](super::LimitsLayer): it finds the rules that
//! match a request in the running configuration and passes the request through their
//! rate-limit layers, answering with their future and body.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use smallvec::SmallVec;
use tower_layer::Layer;
use tower_service::Service;

use super::state::{Shared, Snapshot};
use crate::headers::{Collected, PreparedHeaders};
use crate::layer::{RequestBody, ResponseBody, ResponseFuture};
use crate::store::{MemoryStore, Store};

/// The service made by [`LimitsLayer`](super::LimitsLayer).
///
/// Reads the running configuration once per request (without locking), then: no rule matches,
/// the inner service's future as it is; one rule, that rule's
/// [`RateLimit`](crate::layer::RateLimit) around the inner service; several, their `RateLimit`s
/// nested in file order (one boxed future per rule). Whichever, the response future is
/// [`RateLimit`'s](crate::layer::ResponseFuture) and the body [`ResponseBody`]: the rules' bodies
/// are one body, metered by each rule in turn, and their rate-limit headers are written once,
/// from the decisions each rule hands on, the first rule's items first (see
/// [several rules](super#several-rules-one-policy)).
/// `poll_ready` is the inner service's; nothing is decided before `call`.
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

    inner_service_accessors!();
}

/// The future of several rules' layers around the inner service.
type Boxed<B, E> = Pin<Box<dyn Future<Output = Result<Response<ResponseBody<B>>, E>> + Send>>;

impl<S, St, ReqB, ResB> Service<Request<ReqB>> for Limits<S, St>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
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
            return ResponseFuture::inner(future, PreparedHeaders::default());
        }
        // The service that was polled ready goes into the rules' layers; a clone stays for the
        // next request.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        match matched[..] {
            [one] => snapshot.rules[one].layer.layer(inner).call(req),
            _ => {
                let chain = Chain {
                    snapshot: arc_swap::Guard::into_inner(snapshot),
                    matched: matched.into_iter().collect(),
                    next: 0,
                    inner,
                };
                let req = req.map(|body| RequestBody::new(RequestBody::new(body)));
                ResponseFuture::slow(start(chain, req))
            }
        }
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

/// The response of every rule's layer, with the rate-limit headers they handed on written
/// once.
fn start<S, St, ReqB, ResB>(
    mut chain: Chain<S, St>,
    req: Request<RequestBody<RequestBody<ReqB>>>,
) -> Boxed<ResB, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    St: Store,
    ReqB: http_body::Body + Send + 'static,
    ResB: Send + 'static,
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
    ReqB: http_body::Body + Send + 'static,
    ResB: Send + 'static,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = Boxed<ResB, S::Error>;

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
            return Box::pin(async move { Ok(future.await?.map(ResponseBody::inner)) });
        };
        let below = Chain {
            snapshot: Arc::clone(&self.snapshot),
            matched: Arc::clone(&self.matched),
            next: self.next + 1,
            inner,
        };
        // Each rule hands its headers on, for `start` to write those of all at once.
        let future = self.snapshot.rules[rule].layer.layer(below).collecting().call(req);
        Box::pin(async move { Ok(future.await?.map(ResponseBody::flatten)) })
    }
}

/// The response future of [`Limits`]: that of [`RateLimit`](crate::layer::RateLimit), whatever the
/// number of rules that apply (`F` is the inner service's future, `B` its response body, `E`
/// its error).
pub type LimitsFuture<F, B, E> = ResponseFuture<F, B, E>;

/// The response body of [`Limits`]: that of [`RateLimit`](crate::layer::RateLimit), whatever the
/// number of rules that apply (`B` is the inner service's response body).
pub type LimitsBody<B> = ResponseBody<B>;
