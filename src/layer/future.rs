//! [`ResponseFuture`], the future of [`RateLimit`](crate::layer::RateLimit), and the state machine it
//! shares for either kind of bodies ([`Bodies`]).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::{Response, StatusCode};
use pin_project_lite::pin_project;

#[cfg(feature = "config")]
use super::body::ResponseBody;
use super::service::{Bodies, Metered};
use crate::headers::PreparedHeaders;
use crate::key::Key;

/// A boxed response future answering with body `R`, for the paths that wait (store I/O,
/// shaping, tarpit, settlement).
pub(crate) type Slow<R, E> = Pin<Box<dyn Future<Output = Result<Response<R>, E>> + Send>>;

/// Gives back, at once, the charge of a request admitted without a ticket when its response's
/// status says so (a `405`, a status of `refund_if`): the layer's settings and the store's
/// [`refund_sync`](crate::store::Store::refund_sync), behind one shared pointer.
pub(crate) trait RefundByStatus: Send + Sync {
    /// Gives back `cost` units of `key` under policy `policy` if `status` says so: then the
    /// rate-limit headers of the state after the refund (`collect` as the layer hands them
    /// on), when the store tells it at once.
    fn refund_by_status(
        &self,
        status: StatusCode,
        policy: usize,
        key: &Key,
        cost: (u64, crate::Priority),
        collect: bool,
    ) -> Option<PreparedHeaders>;
}

/// What a request admitted without a ticket needs to give its charge back: no allocation.
pub(crate) struct Untracked {
    pub(crate) hook: Arc<dyn RefundByStatus>,
    pub(crate) policy: usize,
    pub(crate) key: Key,
    pub(crate) cost: u64,
    /// Whether a status other than `405 Method Not Allowed` may give the charge back (a
    /// `refund_if` is set): without one, any other status keeps it without asking `hook`.
    pub(crate) any_status: bool,
    /// Whether the layer hands its headers on rather than writing them.
    pub(crate) collect: bool,
    /// The request's class, to tell what is left after a refund as the request sees it.
    pub(crate) priority: crate::Priority,
}

/// What an admitted request's response status does to its charge: `None` once it is kept,
/// or the settlement that gives it back, to finish before the response is handed on, with
/// the rate-limit headers of the state after it.
pub(crate) type Refund = Box<dyn FnOnce(StatusCode) -> Option<Settle> + Send>;

/// A settlement under way, and the headers of the state it leaves.
pub(crate) type Settle = Pin<Box<dyn Future<Output = PreparedHeaders> + Send>>;

pin_project! {
    /// The response future of [`RateLimit`](crate::layer::RateLimit): `F` is the inner service's future,
    /// `B` its response body, `E` its error.
    ///
    /// A request the store decides at once and admits is the inner future plus its prepared
    /// headers, and the charge to give back if its response says so (a `405 Method Not
    /// Allowed`, a status of `refund_if`); a refusal decided at once is a ready response;
    /// everything that waits (a remote store, shaping, a tarpit, a settlement from the
    /// response head) runs on a boxed future.
    ///
    /// # Panics
    /// When polled again after it completed (the `Future` contract).
    pub struct ResponseFuture<F, B, E, M: Bodies = Metered> {
        #[pin]
        state: State<F, M::Response<B>, E>,
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    /// The inner service's response, with `headers` added.
    #[cfg(feature = "config")]
    pub(crate) fn inner(future: F, headers: PreparedHeaders) -> Self {
        Self { state: State::Inner { future, headers, charge: None } }
    }

    /// The general path.
    #[cfg(feature = "config")]
    pub(crate) fn slow(future: Slow<ResponseBody<B>, E>) -> Self {
        Self { state: State::Slow { future } }
    }
}

impl<F, B, E, M: Bodies> From<State<F, M::Response<B>, E>> for ResponseFuture<F, B, E, M> {
    fn from(state: State<F, M::Response<B>, E>) -> Self {
        Self { state }
    }
}

impl<F, B, E, M: Bodies> fmt::Debug for ResponseFuture<F, B, E, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").field("state", &self.state.name()).finish()
    }
}

impl<F, B, E, M: Bodies> Future for ResponseFuture<F, B, E, M>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<M::Response<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().state.poll_with(cx, M::response)
    }
}

pin_project! {
    /// Where a response future of the layer is: `F` the inner service's future, `R` the body
    /// it answers with (the inner body mapped, or a refusal's), `E` the inner error. One state
    /// machine for [`ResponseFuture`] of either kind of bodies ([`Bodies`]), which differ in
    /// the body only.
    #[project = StateProj]
    pub(crate) enum State<F, R, E> {
        // One state for an admission with or without a charge to give back by status: the
        // admitted path's future, moved whole into axum's box, carries no second variant
        // of the same size.
        Inner { #[pin] future: F, headers: PreparedHeaders, charge: Option<Untracked> },
        Refundable { #[pin] future: F, headers: PreparedHeaders, refund: Option<Refund> },
        Settling {
            settle: Settle,
            response: Option<Response<R>>,
        },
        Ready { response: Option<Response<R>> },
        Slow { future: Slow<R, E> },
        Done,
    }
}

impl<F, R, E> State<F, R, E> {
    /// The inner service's response, with `headers` added, after its status has had the chance
    /// to give `charge` back (when there is one).
    #[inline]
    pub(crate) fn inner(future: F, headers: PreparedHeaders, charge: Option<Untracked>) -> Self {
        State::Inner { future, headers, charge }
    }

    /// The inner service's response, with `headers` added, after `refund` has seen its status
    /// (and, when it gives the charge back, finished doing so).
    pub(crate) fn refundable(future: F, headers: PreparedHeaders, refund: Refund) -> Self {
        State::Refundable { future, headers, refund: Some(refund) }
    }

    /// A response made without the inner service.
    pub(crate) fn ready(response: Response<R>) -> Self {
        State::Ready { response: Some(response) }
    }

    /// The general path.
    pub(crate) fn slow(future: Slow<R, E>) -> Self {
        State::Slow { future }
    }

    pub(crate) fn name(&self) -> &'static str {
        match self {
            State::Inner { .. } => "inner",
            State::Refundable { .. } => "refundable",
            State::Settling { .. } => "settling",
            State::Ready { .. } => "ready",
            State::Slow { .. } => "slow",
            State::Done => "done",
        }
    }

    /// Polls towards the response, the inner service's body turned into `R` by `body`.
    #[inline]
    pub(crate) fn poll_with<B>(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        body: impl FnOnce(B) -> R,
    ) -> Poll<Result<Response<R>, E>>
    where
        F: Future<Output = Result<Response<B>, E>>,
    {
        let output = match self.as_mut().project() {
            StateProj::Inner { future, headers, charge } => {
                let mut res = match ready!(future.poll(cx)) {
                    Ok(res) => res,
                    // Done, as on success: polled again, it panics rather than poll `future`.
                    Err(error) => {
                        self.set(State::Done);
                        return Poll::Ready(Err(error));
                    }
                };
                // Read in place, not taken: the state is dropped whole below. A refund
                // comes first: the headers say what is left after it.
                let mut refunded = None;
                if let Some(c) = charge {
                    let status = res.status();
                    if c.any_status || status == StatusCode::METHOD_NOT_ALLOWED {
                        let cost = (c.cost, c.priority);
                        refunded =
                            c.hook.refund_by_status(status, c.policy, &c.key, cost, c.collect);
                    }
                }
                match refunded {
                    Some(after) => after.apply(&mut res),
                    None if !headers.is_empty() => std::mem::take(headers).apply(&mut res),
                    None => {}
                }
                // Returned from here, the response is moved once less than through `output`.
                self.set(State::Done);
                return Poll::Ready(Ok(res.map(body)));
            }
            StateProj::Refundable { future, headers, refund } => {
                let res = match ready!(future.poll(cx)) {
                    Ok(res) => res,
                    // Done, as on success: polled again, it panics rather than poll `future`.
                    Err(error) => {
                        self.set(State::Done);
                        return Poll::Ready(Err(error));
                    }
                };
                let settle = refund.take().and_then(|refund| refund(res.status()));
                match refunded(res.map(body), std::mem::take(headers), settle, cx) {
                    Refunded::Ready(res) => Ok(res),
                    Refunded::Settling(settle, res) => {
                        self.set(State::Settling { settle, response: Some(res) });
                        return Poll::Pending;
                    }
                }
            }
            StateProj::Settling { settle, response } => {
                let after = ready!(settle.as_mut().poll(cx));
                match response.take() {
                    Some(mut response) => {
                        after.apply(&mut response);
                        Ok(response)
                    }
                    None => panic!("ResponseFuture polled after completion"),
                }
            }
            StateProj::Ready { response } => match response.take() {
                Some(response) => Ok(response),
                None => panic!("ResponseFuture polled after completion"),
            },
            StateProj::Slow { future } => ready!(future.as_mut().poll(cx)),
            StateProj::Done => panic!("ResponseFuture polled after completion"),
        };
        self.set(State::Done);
        Poll::Ready(output)
    }
}

/// A refundable response once its status is known: ready, or waiting for its refund.
enum Refunded<R> {
    Ready(Response<R>),
    Settling(Settle, Response<R>),
}

/// A refundable response once its status is known: with its admission's `headers` when the
/// charge is kept (no `settle`), else with the headers of the state after the refund, once
/// it finished.
fn refunded<R>(
    mut res: Response<R>,
    headers: PreparedHeaders,
    settle: Option<Settle>,
    cx: &mut Context<'_>,
) -> Refunded<R> {
    let Some(mut settle) = settle else {
        if !headers.is_empty() {
            headers.apply(&mut res);
        }
        return Refunded::Ready(res);
    };
    match settle.as_mut().poll(cx) {
        Poll::Pending => Refunded::Settling(settle, res),
        Poll::Ready(after) => {
            after.apply(&mut res);
            Refunded::Ready(res)
        }
    }
}
