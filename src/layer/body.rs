//! [`ResponseBody`]: the inner service's body, or the bytes of a response the layer made.

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project_lite::pin_project;

use super::meter::Meter;

pin_project! {
    /// The response body of [`RateLimit`](crate::RateLimit): the inner service's body `B`
    /// unchanged, or the bytes of a response the layer made itself (a 429, a 503, a 400).
    /// No boxing either way.
    ///
    /// Under a policy with concurrency tiers or tiers counting bytes or reported units, the
    /// body also ends the request's hold: when it ends, or is dropped unfinished (a client
    /// disconnect), the request's slots are released and its counted units settled.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
        meter: Option<Box<Meter>>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Own { #[pin] body: Full<Bytes> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self { kind: Kind::Inner { body }, meter: None }
    }

    pub(crate) fn own(body: Full<Bytes>) -> Self {
        Self { kind: Kind::Own { body }, meter: None }
    }

    /// The inner service's body, measured by `meter`.
    pub(crate) fn metered(body: B, meter: Meter) -> Self {
        Self { kind: Kind::Inner { body }, meter: Some(Box::new(meter)) }
    }
}

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.kind {
            Kind::Inner { .. } => "ResponseBody::Inner",
            Kind::Own { .. } => "ResponseBody::Own",
        })
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        match this.kind.project() {
            KindProj::Inner { mut body } => {
                let frame = body.as_mut().poll_frame(cx);
                if let Some(meter) = this.meter {
                    match &frame {
                        Poll::Ready(Some(Ok(frame))) => {
                            if let Some(data) = frame.data_ref() {
                                meter.sent(data.len());
                            }
                            // The last frame: the response is complete before the frame is
                            // handed on, so a client that saw it end finds the slot free.
                            if body.is_end_stream() {
                                meter.done();
                            }
                        }
                        Poll::Ready(_) => meter.done(),
                        Poll::Pending => {}
                    }
                }
                frame
            }
            KindProj::Own { body } => body.poll_frame(cx).map_err(|never| match never {}),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Own { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner { body } => body.size_hint(),
            Kind::Own { body } => body.size_hint(),
        }
    }
}
