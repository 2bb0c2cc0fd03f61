//! [`ResponseFuture`], the future of [`RateLimit`](crate::RateLimit).

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use axum::body::Body;
use bytes::Bytes;
use http::Response;
use pin_project_lite::pin_project;

use crate::response::{Prepared, insert};

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A boxed response future, for the paths that wait (store I/O, shaping, tarpit, settlement).
pub(crate) type Slow<E> = Pin<Box<dyn Future<Output = Result<Response<Body>, E>> + Send>>;

pin_project! {
    /// The response future of [`RateLimit`](crate::RateLimit): `F` is the inner service's future,
    /// `B` its response body, `E` its error.
    ///
    /// A request the store decides at once and admits is the inner future plus its prepared
    /// headers (no allocation); a rejection decided at once is a ready response; everything that
    /// waits (a remote store, shaping, a tarpit, a settlement) runs on a boxed future.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        state: State<F, E>,
        _body: PhantomData<fn() -> B>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, E> {
        Inner { #[pin] future: F, headers: Prepared },
        Ready { response: Option<Response<Body>> },
        Slow { future: Slow<E> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    /// The inner service's response, with `headers` added.
    pub(crate) fn inner(future: F, headers: Prepared) -> Self {
        Self { state: State::Inner { future, headers }, _body: PhantomData }
    }

    /// A response made without the inner service.
    pub(crate) fn ready(response: Response<Body>) -> Self {
        Self { state: State::Ready { response: Some(response) }, _body: PhantomData }
    }

    /// The general path.
    pub(crate) fn slow(future: Slow<E>) -> Self {
        Self { state: State::Slow { future }, _body: PhantomData }
    }
}

impl<F, B, E> fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            State::Inner { .. } => "inner",
            State::Ready { .. } => "ready",
            State::Slow { .. } => "slow",
        };
        f.debug_struct("ResponseFuture").field("state", &state).finish()
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Output = Result<Response<Body>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Inner { future, headers } => {
                let (mut head, body) = ready!(future.poll(cx))?.into_parts();
                insert(&mut head.headers, std::mem::take(headers));
                Poll::Ready(Ok(Response::from_parts(head, Body::new(body))))
            }
            // Polled again after completing (a contract breach): an empty response rather than
            // a panic.
            StateProj::Ready { response } => {
                Poll::Ready(Ok(response.take().unwrap_or_else(|| Response::new(Body::empty()))))
            }
            StateProj::Slow { future } => future.as_mut().poll(cx),
        }
    }
}
