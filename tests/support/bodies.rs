//! Bodies for tests of the layer's body metering: bodies that count themselves in flight, send
//! chunks of no known length, never end, or end as a test says (done, an error, or never).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;

use bytes::Bytes;
use http_body::Frame;

/// Implements `http_body::Body` (data `Bytes`, errors `$error`) for `$body`, its next frame
/// made by the block (`$this`: `&mut $body`, `$cx`: the task's `Context`), with any further
/// methods of the trait given in braces: a test body is then only how it makes its frames.
macro_rules! body_of_frames {
    ($body:ty, $error:ty, |$this:ident, $cx:tt| $next:block $(, { $($more:tt)* })?) => {
        impl http_body::Body for $body {
            type Data = bytes::Bytes;
            type Error = $error;

            fn poll_frame(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, $error>>> {
                let $this = &mut *self;
                let $cx = cx;
                $next
            }

            $($($more)*)?
        }
    };
}
#[allow(unused_imports)]
pub(crate) use body_of_frames;

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

body_of_frames!(Tracked, Infallible, |this, _| {
    Poll::Ready(this.data.take().map(|d| Ok(Frame::data(d))))
});

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

body_of_frames!(Chunks, Infallible, |this, _| {
    if this.left == 0 {
        return Poll::Ready(None);
    }
    this.left -= 1;
    Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![b'y'; this.len])))))
});

/// A response body that sends one chunk and then never ends.
pub struct Endless(pub bool);

body_of_frames!(Endless, Infallible, |this, _| {
    if std::mem::replace(&mut this.0, true) {
        Poll::Pending
    } else {
        Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"first chunk")))))
    }
});

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

body_of_frames!(Repeat, &'static str, |this, _| {
    if this.frames > 0 {
        this.frames -= 1;
        return Poll::Ready(Some(Ok(Frame::data(this.frame.clone()))));
    }
    match this.end {
        End::Done => Poll::Ready(None),
        End::Fail => Poll::Ready(Some(Err("reset"))),
        End::Hang => Poll::Pending,
    }
});
