//! Bodies for tests of the layer's body metering: bodies that count themselves in flight, send
//! chunks of no known length, never end, or end as a test says (done, an error, or never).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame};

/// A response body of `len` bytes that counts itself in flight until it is dropped.
pub struct Tracked {
    data: Option<Bytes>,
    in_flight: Arc<InFlight>,
}

#[derive(Default)]
pub struct InFlight {
    pub now: AtomicUsize,
    pub max: AtomicUsize,
}

impl InFlight {
    pub fn enter(self: &Arc<Self>, len: usize) -> Tracked {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(now, Ordering::SeqCst);
        Tracked { data: Some(Bytes::from(vec![b'x'; len])), in_flight: Arc::clone(self) }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.in_flight.now.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.data.take().map(|d| Ok(Frame::data(d))))
    }
}

/// A body of `n` data frames of `len` bytes and no known length: sent chunked.
pub struct Chunks {
    left: usize,
    len: usize,
}

impl Chunks {
    pub fn new(n: usize, len: usize) -> Self {
        Self { left: n, len }
    }
}

impl Body for Chunks {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        self.left -= 1;
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b'y'; self.len])))))
    }
}

/// A response body that sends one chunk and then never ends.
pub struct Endless(pub bool);

impl Body for Endless {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if std::mem::replace(&mut self.0, true) {
            Poll::Pending
        } else {
            Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"first chunk")))))
        }
    }
}

/// How a test body ends after its frames: done, with an error, or never (it hangs).
#[derive(Clone, Copy)]
pub enum End {
    Done,
    Fail,
    Hang,
}

/// `frames` copies of `frame`, then the body's end as `end` says.
pub struct Repeat {
    pub frame: Bytes,
    pub frames: usize,
    pub end: End,
}

impl Repeat {
    /// `frames` data frames of `len` bytes each, then the body's end as `end` says.
    pub fn bytes(frames: usize, len: usize, end: End) -> Self {
        Self { frame: Bytes::from(vec![b'z'; len]), frames, end }
    }
}

impl Body for Repeat {
    type Data = Bytes;
    type Error = &'static str;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, &'static str>>> {
        if self.frames > 0 {
            self.frames -= 1;
            return Poll::Ready(Some(Ok(Frame::data(self.frame.clone()))));
        }
        match self.end {
            End::Done => Poll::Ready(None),
            End::Fail => Poll::Ready(Some(Err("reset"))),
            End::Hang => Poll::Pending,
        }
    }
}
