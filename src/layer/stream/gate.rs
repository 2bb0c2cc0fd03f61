//! What a metered body asks of its meter ([`Gate`]), the tally that only counts, and how a
//! stream stopped by policing tells the layer ([`Signal`]).

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use smallvec::SmallVec;

use crate::decision::Decision;
use crate::error::StoreError;

/// Why a stream was stopped.
#[derive(Debug, Clone)]
pub(crate) enum Stopped {
    /// The tier had no room for the next grant: the refusal.
    Limited(Decision),
    /// The store could not decide, and the layer fails closed.
    Unavailable(Arc<StoreError>),
}

/// Where a request body stopped by policing tells the layer (to answer in its place, if the
/// handler has not answered yet) and the response body (to end a gRPC response).
#[derive(Debug, Default)]
pub(crate) struct Signal {
    inner: Mutex<SignalState>,
}

#[derive(Debug, Default)]
struct SignalState {
    stopped: Option<Stopped>,
    wakers: SmallVec<[Waker; 2]>,
    /// After the stop, the rest of the body is read off and dropped (an HTTP/1 upload the
    /// layer answered before its end: see `layer::linger`).
    linger: bool,
    /// The body read off to its end (or its error).
    drained: bool,
}

impl Signal {
    /// The stream was stopped: wake whoever waits for it.
    pub(crate) fn stop(&self, why: Stopped) {
        let wakers = {
            let mut state = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if state.stopped.is_none() {
                state.stopped = Some(why);
            }
            std::mem::take(&mut state.wakers)
        };
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Asks the stopped body to read the rest of itself off (see [`SignalState::linger`]).
    pub(crate) fn linger(&self) {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner).linger = true;
    }

    /// Whether the stopped body reads the rest of itself off.
    pub(crate) fn lingers(&self) -> bool {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner).linger
    }

    /// The body was read off to its end: wake whoever waits for it.
    pub(crate) fn drained(&self) {
        let wakers = {
            let mut state = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            state.drained = true;
            std::mem::take(&mut state.wakers)
        };
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Ready once the body was read off to its end.
    pub(crate) fn poll_drained(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut state = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if state.drained {
            return Poll::Ready(());
        }
        if !state.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            state.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }

    /// Why the stream was stopped, once it was; otherwise `cx` is woken when it is.
    pub(crate) fn poll_stopped(&self, cx: &mut Context<'_>) -> Poll<Stopped> {
        let mut state = self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(why) = &state.stopped {
            return Poll::Ready(why.clone());
        }
        if !state.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            state.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

/// The bytes of one body, charged to the store in grants as they pass.
pub(crate) trait Gate: Send {
    /// Waits until the body may let bytes through: `Ok(n)` with the `n` bytes (at least 1)
    /// its grant still covers, once the bytes it let through past its grants are paid; the
    /// refusal when policing stops the stream. `remaining` is the exact number of bytes the
    /// body has left, when it knows (a grant is no larger); `want` what the body has in hand
    /// to let through (a response's frame; 1 when it does not know yet).
    fn poll_room(
        &mut self,
        cx: &mut Context<'_>,
        remaining: Option<u64>,
        want: u64,
    ) -> Poll<Result<u64, Stopped>>;

    /// `len` bytes passed (beyond the room, they are owed to the next grants).
    fn spend(&mut self, len: u64);

    /// The room the current grant has now, when nothing needs polling (no store call under
    /// way, no wait, nothing owed): what [`poll_room`](Self::poll_room) would answer at once.
    /// 0 when it must be polled. Lets a frame within its grant pass without the body's size
    /// hint or a poll.
    fn ready(&self) -> u64;

    /// Ends the stream's grants now (the unused part of the last one given back): the units
    /// its admission charged that they kept (see `Grants::credited`), which then stay charged
    /// rather than being given back.
    fn end(&mut self) -> u64 {
        0
    }
}

/// A [`Gate`] that only counts: the messages of a gRPC call under
/// [`StreamMode::Settle`], settled when the call ends. It never waits nor stops.
pub(crate) struct Tally(pub(crate) Arc<std::sync::atomic::AtomicU64>);

impl Gate for Tally {
    fn poll_room(
        &mut self,
        _: &mut Context<'_>,
        _: Option<u64>,
        _: u64,
    ) -> Poll<Result<u64, Stopped>> {
        Poll::Ready(Ok(u64::MAX))
    }

    fn spend(&mut self, len: u64) {
        self.0.fetch_add(len, std::sync::atomic::Ordering::Relaxed);
    }

    fn ready(&self) -> u64 {
        u64::MAX
    }
}
