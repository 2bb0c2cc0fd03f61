//! Byte tiers metered while a body streams ([`StreamMode::Shape`], [`StreamMode::Police`]):
//! leases of bytes taken from the store chunk by chunk, and what a body does when the tier
//! has no room for the next one.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use smallvec::SmallVec;

use crate::decision::Decision;
use crate::error::StoreError;
use crate::key::Key;
use crate::limiter::Limiter;
use crate::quota::{Priority, TierKind, Unit};
use crate::store::{Check, Store, Verdict};

/// The largest lease of bytes a streamed body takes from the store at once: 64 KiB.
///
/// A body metered with [`StreamMode::Shape`] or [`StreamMode::Police`] asks the store for
/// this many bytes (fewer when the tier's capacity, or the bytes the body has left, are
/// fewer) when it has spent its previous lease: one store call per lease, whatever the size
/// of its frames (two when the store refuses it first: policing, a tier with less than a
/// lease left, asked again for what it has; shaping, more than a second of leases reserved
/// ahead, asked again when it is within a second). When the body is dropped (a server drops a
/// body once it ended; or unfinished), one more settles the last lease at what it carried,
/// unless it carried exactly its size.
pub const STREAM_LEASE: u64 = 64 * 1024;

/// The largest lease of messages a gRPC stream takes from the store at once: 16.
///
/// A gRPC call (or a WebSocket metered through `tollgate::ws`, cargo feature `ws`) metered
/// with [`StreamMode::Shape`] or [`StreamMode::Police`] under a tier
/// counting [`Unit::RequestMessages`] or [`Unit::ResponseMessages`] asks the store for this
/// many messages (fewer when the tier's capacity is smaller, or, policing, when the tier has
/// fewer left) when it has spent its previous lease: one store call per lease, never one per
/// message. The part of the last lease the stream did not use is given back when it ends.
pub const MESSAGE_LEASE: u64 = 16;

/// How long a shaped lease may be reserved ahead: a lease that would have to wait longer is
/// not reserved, and asked for again when the store says it would fit.
const SHAPE_AHEAD: Duration = Duration::from_secs(1);

/// How tiers counting bytes or messages meter what streams: a request body whose length was
/// not charged at admission, every response body, and the messages of a gRPC call or a
/// WebSocket. Without [`on_stream`](crate::RateLimitLayerBuilder::on_stream) it follows the
/// layer: [`Police`](Self::Police) when the layer polices, [`Shape`](Self::Shape) when it
/// [shapes](crate::RateLimitLayerBuilder::shape); [`Settle`](Self::Settle) is the choice for
/// billing-style tiers that charge a body when it ends.
///
/// ```
/// use tollgate::{Policy, Quota, RateLimitLayer, StreamMode, Unit};
///
/// # fn main() -> Result<(), tollgate::ConfigError> {
/// // Uploads of one key together at 1 MB/s (burst 1 MB). The layer polices, so do its
/// // streams: an upload that runs out of room is stopped with a 429.
/// let policy = Policy::builder("upload")
///     .tier("bytes", Quota::per_second(1_000_000).counting(Unit::RequestBytes))
///     .build()?;
/// let policed = RateLimitLayer::builder(policy.clone()).build()?;
/// // Shaping: an upload past the rate waits, no longer read, until the tier has room.
/// let shaped = RateLimitLayer::builder(policy).shape(std::time::Duration::from_secs(5)).build()?;
/// # let _ = (policed, shaped);
/// # Ok(()) }
/// ```
///
/// # How it works
///
/// With [`Shape`](Self::Shape) or [`Police`](Self::Police) the body is charged as its frames
/// pass, in leases of at most [`STREAM_LEASE`] bytes (64 KiB) taken from the store when the
/// previous one is spent: one store call per lease, never one per frame. The unit the request
/// was charged at admission is given back when the body ends, and so is the part of the last
/// lease it did not use (a body dropped unfinished included).
///
/// # The bound
///
/// Over any span of time, the bytes that all the streams of one key let through are at most
/// what the tier admits (for GCRA and the buckets, `burst + rate x elapsed`), plus, per
/// stream, the part of one frame past the end of its lease: a response body is cut to its
/// lease, so it adds nothing; a request body is let through a frame at a time, so each adds
/// less than one frame (hyper's HTTP/2 frames are at most 16 KiB; on HTTP/1 a frame is at most
/// one chunk of a chunked upload and what one read of the connection returned). A request
/// with a valid `Content-Length` is charged it at admission, as in
/// [`Settle`](Self::Settle). A [dry run](crate::RateLimitLayerBuilder::dry_run) meters every
/// body as `Settle` does: it never slows nor stops a stream. A response whose status gives
/// the charge back (a `405`, [`refund_if`](crate::RateLimitLayerBuilder::refund_if)) gives
/// back what was charged at admission; the leases of bytes that did stream stay charged.
/// The store errors of a lease follow
/// [`on_store_error`](crate::RateLimitLayerBuilder::on_store_error): failing open lets the
/// lease through uncharged, failing closed stops the stream as policing does (a plain HTTP
/// response under way is let through).
///
/// # Concurrency, and streams that end early
///
/// A stream paused by shaping is still in flight: the concurrency slots its request took
/// (a [`Concurrency`](crate::Concurrency) tier) stay taken until it ends, so the key's next
/// request may be refused meanwhile. A stream that ends early (stopped by policing, or
/// cancelled: an HTTP/2 stream reset, a connection closed, a response body dropped, a request
/// timeout that drops the handler) gives its slots back at once, on either store, and its
/// tiers are charged exactly what streamed: the unused part of its last lease is given back,
/// and so is the unit a byte tier was charged at admission (a frame read by the layer but
/// never handed to the handler is charged to no tier; a message tier keeps the first message
/// policing charged at admission, as a unary call's). One limit: an HTTP/1.1 upload paused by shaping is not
/// read, so the server cannot see its client go away (TCP delivers the close only after the
/// bytes the connection still holds) until the upload resumes and reads to its end; over
/// HTTP/2, gRPC included, a reset or a closed connection is seen at once. A request timeout
/// outside the layer (for example tower-http's `TimeoutLayer`) bounds how long a vanished
/// HTTP/1.1 client holds its slot.
///
/// # Messages
///
/// Tiers counting [`Unit::RequestMessages`] or [`Unit::ResponseMessages`] meter the messages
/// of a gRPC call (and of a WebSocket, through the handler: `tollgate::ws::MessageBudget`,
/// cargo feature `ws`) the same way (a request that is not a gRPC call counts as one message,
/// charged at admission). Each length-prefixed message of the HTTP/2 body counts once, read
/// from its 5-byte prefix (the payload is never decoded, compressed or not; a message split
/// across frames counts once, several in one frame each count), in leases of at most
/// [`MESSAGE_LEASE`] (16) messages: one store call per lease, never one per message.
/// Policing charges the call's first message each way at admission, as a unary call's (so a
/// unary call costs one message each way, and is refused at once when its key has spent the
/// tier); shaping charges none there and lets the first lease wait. Shaping delays the next
/// message: a request frame is not read, a response frame not sent, until the tier has room.
/// Policing stops the stream at the first message past the tier (what the client sees: see
/// [`Police`](Self::Police)). The bound: a response is cut at the start of the first message
/// past its lease, so the messages sent are exactly what the tier admits; a request's frame
/// cannot be cut, and is read when the lease has room for at least one message, so each
/// stream adds at most the messages of one HTTP/2 DATA frame, less one (none when each
/// message comes in a frame of its own). The end of a stream is never refused: a lease
/// refused after the last message is only held against a next one. A dry run, and
/// [`Settle`](Self::Settle), charge a call one message each way at admission and settle it
/// at the messages counted when the call ends, never slowing nor stopping it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "config", derive(serde::Deserialize), serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum StreamMode {
    /// One unit at admission, settled at the bytes counted when the body ends: a stream is
    /// never slowed or stopped, and what it used past the tier is owed by the key's next
    /// requests (billing-style tiers). Only by choice: the bound below does not hold.
    Settle,
    /// Backpressure: when the tier has no room for the next lease, the body's next frame
    /// waits until it has (a request body is then no longer read from the connection, so
    /// the client's flow control slows it; a response body is no longer written, as nginx
    /// `limit_rate` does). A lease is reserved up to 1 s ahead, so concurrent streams of one
    /// key take turns in the order they asked.
    ///
    /// Only flow control stops an HTTP/2 client while its stream is not read, and hyper's
    /// HTTP/2 server ends a connection that holds too many small DATA frames unread (about
    /// half the connection window's worth of framing overhead): when shaping a stream of
    /// small messages sent one per frame, keep the stream window small (for tonic,
    /// `Server::builder().initial_stream_window_size(16 * 1024)`).
    Shape,
    /// The stream is stopped when the tier has no room for its next lease. What the client
    /// sees:
    ///
    /// - a request body that runs out before the handler answered: the handler's future is
    ///   dropped and the layer answers as for a refused request (`429 Too Many Requests` with
    ///   `Retry-After`, or the [rejection](crate::RateLimitLayerBuilder::rejection) set; a
    ///   gRPC call gets `RESOURCE_EXHAUSTED` with `grpc-retry-pushback-ms`); the server stops
    ///   reading the upload;
    /// - a gRPC call whose response has started (a request or response body that runs out):
    ///   the response ends at once with trailers `grpc-status: 8` (`RESOURCE_EXHAUSTED`) and
    ///   `grpc-retry-pushback-ms`;
    /// - a plain HTTP response that has started: its status cannot change any more, and its
    ///   body's error type is the handler's, so the layer cannot fail it; it is shaped
    ///   instead (as [`Shape`](Self::Shape)), and a request body that runs out stops being
    ///   read.
    ///
    /// The `grpc-retry-pushback-ms` of a stream stopped mid-way is the wait until the tier
    /// has room for the lease it refused (at most [`STREAM_LEASE`] bytes or
    /// [`MESSAGE_LEASE`] messages), not for one more byte or message.
    Police,
}

impl StreamMode {
    /// Whether bodies are metered as they stream.
    pub(crate) fn streams(self) -> bool {
        self != Self::Settle
    }
}

/// Why a stream was stopped.
#[derive(Debug, Clone)]
pub(crate) enum Stopped {
    /// The tier had no room for the next lease: the refusal.
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

/// The bytes of one body, charged to the store in leases as they pass.
pub(crate) trait Gate: Send {
    /// Waits until the body may let bytes through: `Ok(n)` with the `n` bytes (at least 1)
    /// its lease still covers, once the bytes it let through past its leases are paid; the
    /// refusal when policing stops the stream. `remaining` is the exact number of bytes the
    /// body has left, when it knows (a lease is no larger); `want` what the body has in hand
    /// to let through (a response's frame; 1 when it does not know yet).
    fn poll_room(
        &mut self,
        cx: &mut Context<'_>,
        remaining: Option<u64>,
        want: u64,
    ) -> Poll<Result<u64, Stopped>>;

    /// `len` bytes passed (beyond the room, they are owed to the next leases).
    fn spend(&mut self, len: u64);

    /// The room the current lease has now, when nothing needs polling (no store call under
    /// way, no wait, nothing owed): what [`poll_room`](Self::poll_room) would answer at once.
    /// 0 when it must be polled. Lets a frame within its lease pass without the body's size
    /// hint or a poll.
    fn ready(&self) -> u64;
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

type Asking<T> = Pin<Box<dyn Future<Output = Result<Verdict<T>, StoreError>> + Send>>;

enum State<T> {
    /// Nothing under way.
    Idle,
    /// A lease of `.1` bytes asked for, the store not having answered yet.
    Asking(Asking<T>, u64),
    /// Waiting for the instant a shaped lease was reserved at, or for a refused one to fit.
    Sleeping(Pin<Box<tokio::time::Sleep>>),
}

/// A [`Gate`] on a store: the leases of one body under one policy and key.
pub(crate) struct Leases<St: Store> {
    limiter: Limiter<St>,
    key: Key,
    priority: Priority,
    /// The tiers counting the body's unit, charged each lease.
    tiers: SmallVec<[usize; 2]>,
    /// Per tier of the policy, what the next lease costs: its size on `tiers`, 0 elsewhere
    /// (neither checked nor charged); built once, its sizes written per lease.
    costs: SmallVec<[u64; 4]>,
    /// The largest lease the tiers can ever admit.
    largest: u64,
    /// Some tier it charges has a penalty box: a lease asks only for what the stream really
    /// let through or has in hand, so that a refusal is a breach by the key.
    penalized: bool,
    /// What the stream let through so far: the next lease may be as large again (leases grow
    /// by doubling, from what the first frame needs up to `largest`).
    used: u64,
    /// What the tiers had left at the last decision, the least of them: a lease asks no more
    /// while that covers what the stream needs (it would be refused, or wait, for nothing).
    known_left: Option<u64>,
    police: bool,
    fail_open: bool,
    /// The ticket of the current lease, to give back what it did not use; `None` when it
    /// was given uncharged (failing open) or there is none.
    lease: Option<St::Ticket>,
    /// The size of the current lease.
    leased: u64,
    /// What the current lease still covers.
    left: u64,
    /// Bytes let through past the leases, paid from the next ones.
    owed: u64,
    state: State<St::Ticket>,
}

impl<St: Store> Leases<St> {
    /// The leases of a body counted in `unit` under `limiter`'s policy, for `key`.
    pub(crate) fn new(
        limiter: &Limiter<St>,
        key: Key,
        priority: Priority,
        unit: Unit,
        mode: StreamMode,
        fail_open: bool,
    ) -> Self {
        let policy = limiter.policy();
        let counting =
            |t: &&crate::policy::Tier| t.unit() == unit && t.kind() != TierKind::Concurrency;
        let tiers: SmallVec<[usize; 2]> = policy
            .tiers()
            .iter()
            .enumerate()
            .filter(|(_, t)| counting(t))
            .map(|(i, _)| i)
            .collect();
        let largest = policy
            .tiers()
            .iter()
            .filter(counting)
            .map(|t| t.capacity_for(priority))
            .min()
            .unwrap_or(STREAM_LEASE)
            .min(match unit {
                Unit::RequestMessages | Unit::ResponseMessages => MESSAGE_LEASE,
                _ => STREAM_LEASE,
            });
        let costs = SmallVec::from_elem(0, policy.tiers().len());
        let penalized = tiers.iter().any(|&i| policy.tiers()[i].penalty().is_some());
        Self {
            limiter: limiter.clone(),
            key,
            priority,
            tiers,
            costs,
            largest,
            penalized,
            used: 0,
            known_left: None,
            police: mode == StreamMode::Police,
            fail_open,
            lease: None,
            leased: 0,
            left: 0,
            owed: 0,
            state: State::Idle,
        }
    }

    /// The first `units` were charged at admission: they pass without a lease (a call's
    /// first message each way, charged as a unary call's).
    pub(crate) fn prepaid(mut self, units: u64) -> Self {
        self.left = units;
        self
    }

    /// The size of the next lease: what the stream owes and has in hand (`want`); and, once
    /// it used a quarter of the largest lease, and but under a penalty box, room ahead as
    /// large as what it used so far (leases grow by doubling). Never more than the body has
    /// left (`remaining`, when known), than the tiers had left at the last decision when that
    /// covers the need, nor than the largest lease. A short body is so charged what it sends,
    /// and holds nothing that other streams of the key could use.
    fn next_size(&self, remaining: Option<u64>, want: u64) -> u64 {
        let need = self.owed.saturating_add(want).clamp(1, self.largest);
        let ahead = match self.penalized || self.used < self.largest / 4 {
            true => 0,
            false => self.used,
        };
        let mut size = self.owed.saturating_add(want.max(ahead)).clamp(1, self.largest);
        if let Some(left) = remaining {
            size = size.min(self.owed.saturating_add(left).max(1));
        }
        if let Some(left) = self.known_left.filter(|&left| left >= need) {
            size = size.min(left);
        }
        size.clamp(1, self.largest)
    }

    /// Notes what the tiers have left after `decision`.
    fn note(&mut self, decision: &Decision) {
        let tiers = decision.tiers();
        self.known_left =
            self.tiers.iter().filter_map(|&i| tiers.get(i)).map(|t| t.remaining()).min();
    }

    /// Asks the store for a lease of `size` bytes: the answer if it came at once.
    fn ask(&mut self, size: u64) -> Option<Result<Verdict<St::Ticket>, StoreError>> {
        for &i in &self.tiers {
            self.costs[i] = size;
        }
        let mut check =
            Check::new(&self.key, 1).with_costs(&self.costs).with_priority(self.priority);
        check.ticket = true;
        if !self.police {
            check.max_delay = Some(SHAPE_AHEAD);
        }
        if let Some(answer) = self.limiter.check_sync(check) {
            return Some(answer);
        }
        let (limiter, key, priority, police, costs) = (
            self.limiter.clone(),
            self.key.clone(),
            self.priority,
            self.police,
            self.costs.clone(),
        );
        self.state = State::Asking(
            Box::pin(async move {
                let mut check = Check::new(&key, 1).with_costs(&costs).with_priority(priority);
                check.ticket = true;
                if !police {
                    check.max_delay = Some(SHAPE_AHEAD);
                }
                limiter.decide(check).await
            }),
            size,
        );
        None
    }

    /// Takes the store's answer to a lease of `size`: `Err` when the stream stops.
    fn answered(
        &mut self,
        size: u64,
        answer: Result<Verdict<St::Ticket>, StoreError>,
    ) -> Result<(), Stopped> {
        if let Ok(verdict) = &answer {
            self.note(&verdict.decision);
        }
        match answer {
            Ok(verdict) if verdict.decision.is_allowed() => {
                let delay = verdict.decision.delay();
                // The previous lease is spent: dropping its ticket keeps its charge.
                self.lease = verdict.ticket;
                self.grant(size);
                if !delay.is_zero() {
                    self.state = State::Sleeping(Box::pin(tokio::time::sleep(delay)));
                }
                Ok(())
            }
            Ok(verdict) => match verdict.decision.retry_after() {
                // Policing: what the stream let through is charged whatever the tiers say
                // (the handler has it: the bound allows it), and a smaller lease of what the
                // tier has left is asked for, when that lets a unit through (once per
                // refusal).
                _ if self.police => {
                    let paid = self.close_lease();
                    match self.smaller(size, &verdict.decision, paid) {
                        Some(smaller) => match self.ask(smaller) {
                            Some(answer) => self.answered(smaller, answer),
                            None => Ok(()),
                        },
                        None => Err(Stopped::Limited(verdict.decision)),
                    }
                }
                Some(wait) if !self.police => {
                    self.state = State::Sleeping(Box::pin(tokio::time::sleep(wait)));
                    Ok(())
                }
                // Policing, or a lease that can never fit (a reserve withholding the tier).
                _ => Err(Stopped::Limited(verdict.decision)),
            },
            Err(error) if self.fail_open => {
                tracing::warn!(%error, "tollgate: a stream's lease could not be decided; failing open");
                self.lease = None;
                self.grant(size);
                Ok(())
            }
            Err(error) => {
                tracing::warn!(%error, "tollgate: a stream's lease could not be decided; failing closed");
                Err(Stopped::Unavailable(Arc::new(error)))
            }
        }
    }

    /// What the tiers have left after refusing a lease of `size`, less `paid` (what the
    /// stream was charged since): when that is less than `size` and lets a unit through.
    fn smaller(&self, size: u64, refusal: &Decision, paid: u64) -> Option<u64> {
        let tiers = refusal.tiers();
        let left = self.tiers.iter().filter_map(|&i| tiers.get(i)).map(|t| t.remaining()).min()?;
        let left = left.saturating_sub(paid);
        (left < size && left > 0).then_some(left)
    }

    /// Ends the current lease at what the stream used of it, its debt included (charged
    /// whatever the tiers say: it passed): the unused part is given back, the debt paid.
    /// Returns the debt.
    fn close_lease(&mut self) -> u64 {
        let debt = std::mem::take(&mut self.owed);
        let used = (self.leased - self.left).saturating_add(debt);
        let leased = std::mem::take(&mut self.leased);
        self.left = 0;
        let Some(mut ticket) = self.lease.take() else { return debt };
        if used == leased {
            return debt;
        }
        let settled: SmallVec<[(usize, u64); 2]> = self.tiers.iter().map(|&i| (i, used)).collect();
        let limiter = self.limiter.clone();
        crate::limiter::run_or_spawn(async move {
            let settling = limiter.store().settle_tiers(limiter.bound(), &mut ticket, &settled);
            if let Err(error) = settling.await {
                tracing::warn!(%error, "tollgate: could not settle a stream's lease");
            }
        });
        debt
    }

    /// A lease of `size` bytes was granted: it pays what is owed first.
    fn grant(&mut self, size: u64) {
        let paid = size.min(self.owed);
        self.owed -= paid;
        self.leased = size;
        self.left = size - paid;
    }
}

impl<St: Store> Gate for Leases<St> {
    fn poll_room(
        &mut self,
        cx: &mut Context<'_>,
        remaining: Option<u64>,
        want: u64,
    ) -> Poll<Result<u64, Stopped>> {
        loop {
            match &mut self.state {
                State::Sleeping(sleep) => {
                    if sleep.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    self.state = State::Idle;
                }
                State::Asking(future, size) => {
                    let size = *size;
                    let Poll::Ready(answer) = future.as_mut().poll(cx) else {
                        return Poll::Pending;
                    };
                    self.state = State::Idle;
                    if let Err(stopped) = self.answered(size, answer) {
                        return Poll::Ready(Err(stopped));
                    }
                }
                State::Idle => {
                    if self.owed == 0 && self.left > 0 {
                        return Poll::Ready(Ok(self.left));
                    }
                    let size = self.next_size(remaining, want);
                    if let Some(answer) = self.ask(size) {
                        if let Err(stopped) = self.answered(size, answer) {
                            return Poll::Ready(Err(stopped));
                        }
                    }
                }
            }
        }
    }

    fn spend(&mut self, len: u64) {
        self.used = self.used.saturating_add(len);
        let covered = len.min(self.left);
        self.left -= covered;
        self.owed = self.owed.saturating_add(len - covered);
    }

    #[inline]
    fn ready(&self) -> u64 {
        match self.state {
            State::Idle if self.owed == 0 => self.left,
            _ => 0,
        }
    }
}

impl<St: Store> Drop for Leases<St> {
    /// Gives back the part of the last lease the body did not use (all of it when the body
    /// was dropped while waiting for its reserved instant), or charges what it let through
    /// past it.
    fn drop(&mut self) {
        self.close_lease();
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicU64, Ordering};

    use bytes::Bytes;
    use http::{Request, Response, StatusCode};
    use http_body::{Body, Frame, SizeHint};
    use http_body_util::{BodyExt, Full};
    use tokio::time::Instant;
    use tower::{Layer, ServiceExt, service_fn};

    use super::*;
    use crate::clock::TokioClock;
    use crate::error::ConfigError;
    use crate::key::GlobalKey;
    use crate::limiter::Limiter;
    use crate::policy::Policy;
    use crate::quota::Quota;
    use crate::store::{MemoryStore, MemoryTicket};
    use crate::{RateLimitLayer, RequestBody};

    /// A body of `left` bytes in frames of `frame` bytes, all ready at once; its length is
    /// told in its size hint when `sized`.
    struct Frames {
        left: usize,
        frame: usize,
        sized: bool,
    }

    /// A [`Frames`] that is pending once before each frame (waking itself), as a body read
    /// from a connection is, so that concurrent streams take turns.
    struct Turns {
        frames: Frames,
        ready: bool,
    }

    impl Body for Turns {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            if !std::mem::replace(&mut self.ready, false) {
                self.ready = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Pin::new(&mut self.frames).poll_frame(cx)
        }

        fn is_end_stream(&self) -> bool {
            self.frames.is_end_stream()
        }
    }

    impl Body for Frames {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            if self.left == 0 {
                return Poll::Ready(None);
            }
            let len = self.frame.min(self.left);
            self.left -= len;
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![7; len])))))
        }

        fn is_end_stream(&self) -> bool {
            self.left == 0
        }

        fn size_hint(&self) -> SizeHint {
            if self.sized { SizeHint::with_exact(self.left as u64) } else { SizeHint::default() }
        }
    }

    /// A memory store on tokio's clock, counting the checks it decides (leases included).
    #[derive(Clone)]
    pub(super) struct Counted {
        inner: MemoryStore,
        checks: Arc<AtomicU64>,
    }

    impl Counted {
        pub(super) fn new() -> Self {
            let inner = MemoryStore::builder().clock(TokioClock::new()).build().unwrap();
            Self { inner, checks: Arc::default() }
        }

        pub(super) fn checks(&self) -> u64 {
            self.checks.load(Ordering::Relaxed)
        }
    }

    impl Store for Counted {
        type Bound = <MemoryStore as Store>::Bound;
        type Ticket = MemoryTicket;

        fn bind(&self, policy: &Policy) -> Result<Self::Bound, ConfigError> {
            self.inner.bind(policy)
        }

        fn check_sync(
            &self,
            bound: &Self::Bound,
            check: Check<'_>,
        ) -> Option<Result<Verdict<MemoryTicket>, StoreError>> {
            self.checks.fetch_add(1, Ordering::Relaxed);
            self.inner.check_sync(bound, check)
        }

        async fn check(
            &self,
            bound: &Self::Bound,
            check: Check<'_>,
        ) -> Result<Verdict<MemoryTicket>, StoreError> {
            self.checks.fetch_add(1, Ordering::Relaxed);
            self.inner.check(bound, check).await
        }

        async fn settle(
            &self,
            bound: &Self::Bound,
            ticket: MemoryTicket,
            cost: u64,
        ) -> Result<(), StoreError> {
            self.inner.settle(bound, ticket, cost).await
        }

        async fn settle_tiers(
            &self,
            bound: &Self::Bound,
            ticket: &mut MemoryTicket,
            costs: &[(usize, u64)],
        ) -> Result<(), StoreError> {
            self.inner.settle_tiers(bound, ticket, costs).await
        }
    }

    const MB: u64 = 1_000_000;

    fn upload_policy() -> Policy {
        Policy::builder("upload")
            .tier("bytes", Quota::per_second(MB).counting(Unit::RequestBytes))
            .build()
            .unwrap()
    }

    /// What the handlers read: per frame, when and how many bytes.
    type Log = Arc<Mutex<Vec<(Duration, u64)>>>;

    /// Ten chunked uploads of 1 MB at once from one key, in frames of `frame` bytes, against
    /// 1 MB/s (burst 1 MB): the statuses, the log of what the handlers read, the store.
    async fn ten_uploads(mode: StreamMode, frame: usize) -> (Vec<StatusCode>, Log, Counted) {
        let store = Counted::new();
        let layer = RateLimitLayer::builder(upload_policy())
            .key(GlobalKey)
            .store(store.clone())
            .on_stream(mode)
            .build()
            .unwrap();
        let log: Log = Arc::default();
        let start = Instant::now();
        let handler_log = Arc::clone(&log);
        let svc = layer.layer(service_fn(move |req: Request<RequestBody<Turns>>| {
            let log = Arc::clone(&handler_log);
            async move {
                let mut body = req.into_body();
                while let Some(frame) = body.frame().await {
                    let len = frame.unwrap().into_data().unwrap().len() as u64;
                    log.lock().unwrap().push((start.elapsed(), len));
                }
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("stored"))))
            }
        }));
        let uploads: Vec<_> = (0..10)
            .map(|_| {
                let body = Turns {
                    frames: Frames { left: MB as usize, frame, sized: false },
                    ready: false,
                };
                tokio::spawn(svc.clone().oneshot(Request::post("/").body(body).unwrap()))
            })
            .collect();
        let mut statuses = Vec::new();
        for upload in uploads {
            statuses.push(upload.await.unwrap().unwrap().status());
        }
        (statuses, log, store)
    }

    /// At every read, what all streams read so far is within the bound: burst + rate x
    /// elapsed + one frame per stream.
    fn assert_bound(log: &Log, streams: u64, frame: u64) {
        let mut log = log.lock().unwrap().clone();
        log.sort_by_key(|(at, _)| *at);
        let mut accepted = 0;
        for (at, len) in log {
            accepted += len;
            let allowed = MB + (MB as f64 * at.as_secs_f64()) as u64 + streams * frame;
            assert!(accepted <= allowed, "{accepted} bytes read by {at:?}, bound {allowed}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn shaping_paces_concurrent_uploads_one_lease_per_store_call() {
        let start = Instant::now();
        let (statuses, log, store) = ten_uploads(StreamMode::Shape, 4_096).await;
        let elapsed = start.elapsed();
        assert_eq!(statuses, vec![StatusCode::OK; 10]);
        let read: u64 = log.lock().unwrap().iter().map(|(_, len)| len).sum();
        assert_eq!(read, 10 * MB);
        // 1 MB of burst, 9 MB at 1 MB/s (the ten admission units are given back at the end;
        // the last 64 KiB lease is taken when the body still has 16,960 bytes to go).
        assert!(elapsed >= Duration::from_secs(9), "{elapsed:?}");
        assert!(elapsed <= Duration::from_millis(9_700), "{elapsed:?}");
        assert_bound(&log, 10, 4_096);
        // Ten admissions, then 21 leases per 1 MB stream: what its frames need until it used
        // a quarter of 64 KiB, then growing by doubling what it used, up to 64 KiB: one store
        // call per lease, not one per frame (245 frames per stream).
        assert_eq!(store.checks(), 10 + 10 * 21);
    }

    #[tokio::test(start_paused = true)]
    async fn policing_stops_uploads_past_the_burst_and_gives_the_unused_leases_back() {
        let (statuses, log, store) = ten_uploads(StreamMode::Police, 4_096).await;
        // The streams take turns: each is refused mid-way, none having its 1 MB from a 1 MB
        // burst, and the layer answers in its handler's place.
        assert_eq!(statuses, vec![StatusCode::TOO_MANY_REQUESTS; 10]);
        let read: u64 = log.lock().unwrap().iter().map(|(_, len)| len).sum();
        // Time stood still (nothing slept): the burst, less the ten admission units, plus
        // less than a frame per stream past its last lease (cut to what the tier had left).
        assert!(read > MB - 10 - 10 * 4_096 && read < MB - 10 + 10 * 4_096, "{read}");
        assert_bound(&log, 10, 4_096);
        // Exactly what was read is charged: the unread parts of the leases came back, what
        // passed beyond them was charged when the bodies were dropped, and the unit each
        // request was charged at admission was given back when it was stopped. At 1 byte/us,
        // the next byte fits once that debt is paid.
        let limiter = Limiter::with_store(upload_policy(), store.clone()).unwrap();
        let charged = read;
        let now = limiter.check(&Key::Global, 1).await.unwrap();
        let expected = charged.checked_sub(MB).map(|over| Duration::from_micros(over + 1));
        assert_eq!(now.retry_after(), expected, "{read} read");
    }

    #[tokio::test(start_paused = true)]
    async fn frames_larger_than_a_lease_are_owed_and_paid_before_the_next_read() {
        // Frames of 100,000 bytes: each overshoots a 64 KiB lease; the debt is paid from the
        // next leases before the next frame is read, so the bound holds with one frame per
        // stream.
        let (statuses, log, _store) = ten_uploads(StreamMode::Shape, 100_000).await;
        assert_eq!(statuses, vec![StatusCode::OK; 10]);
        assert_bound(&log, 10, 100_000);
    }

    #[tokio::test(start_paused = true)]
    async fn a_shaped_download_is_cut_to_its_leases_and_paced() {
        let store = Counted::new();
        let policy = Policy::builder("download")
            .tier(
                "bytes",
                Quota::per_second(MB).with_burst(STREAM_LEASE).counting(Unit::ResponseBytes),
            )
            .build()
            .unwrap();
        let layer = RateLimitLayer::builder(policy)
            .key(GlobalKey)
            .store(store.clone())
            .on_stream(StreamMode::Shape)
            .build()
            .unwrap();
        let svc = layer.layer(service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
            let body = Frames { left: 2 * MB as usize, frame: 256 * 1024, sized: true };
            Ok::<_, Infallible>(Response::new(body))
        }));
        let start = Instant::now();
        let res = svc.oneshot(Request::new(Full::default())).await.unwrap();
        let mut body = res.into_body();
        let (mut read, mut largest) = (0, 0);
        // As hyper does: nothing more is polled once the body says it ended.
        while !body.is_end_stream() {
            let frame = body.frame().await.unwrap();
            let len = frame.unwrap().into_data().unwrap().len() as u64;
            read += len;
            largest = largest.max(len);
        }
        let elapsed = start.elapsed();
        assert_eq!(read, 2 * MB);
        assert_eq!(largest, STREAM_LEASE, "frames are cut to their lease");
        // A burst of one lease, then 1 MB/s: (2 MB - 65,536) / 1 MB/s.
        let expected = Duration::from_micros(2 * MB - STREAM_LEASE);
        assert!(
            elapsed >= expected && elapsed <= expected + Duration::from_millis(70),
            "{elapsed:?}"
        );
        // One admission, then 30 leases of 64 KiB and a last one of the 33,920 bytes left.
        assert_eq!(store.checks(), 1 + 31);
    }

    #[tokio::test(start_paused = true)]
    async fn an_upload_with_a_content_length_is_charged_at_admission() {
        let store = Counted::new();
        let layer = RateLimitLayer::builder(upload_policy())
            .key(GlobalKey)
            .store(store.clone())
            .on_stream(StreamMode::Police)
            .build()
            .unwrap();
        let svc = layer.layer(service_fn(|req: Request<RequestBody<Frames>>| async move {
            let read = req.into_body().collect().await.unwrap().to_bytes().len();
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(read.to_string()))))
        }));
        let upload = |len: usize| {
            Request::post("/")
                .header("content-length", len)
                .body(Frames { left: len, frame: 4_096, sized: true })
                .unwrap()
        };
        let first = svc.clone().oneshot(upload(600_000)).await.unwrap();
        assert_eq!(first.status(), StatusCode::OK);
        let second = svc.clone().oneshot(upload(600_000)).await.unwrap();
        assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
        // Two admissions, no lease.
        assert_eq!(store.checks(), 2);
    }

    fn grpc_layer(policy: Policy, store: &Counted) -> RateLimitLayer<GlobalKey, Counted> {
        RateLimitLayer::builder(policy)
            .key(GlobalKey)
            .store(store.clone())
            .on_stream(StreamMode::Police)
            .build()
            .unwrap()
    }

    fn grpc_call<B>(body: B) -> Request<B> {
        Request::post("/pkg.Service/Method")
            .header("content-type", "application/grpc")
            .body(body)
            .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_grpc_upload_stopped_before_the_answer_gets_resource_exhausted() {
        let store = Counted::new();
        let svc = grpc_layer(upload_policy(), &store).layer(service_fn(
            |req: Request<RequestBody<Frames>>| async move {
                req.into_body().collect().await.unwrap();
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            },
        ));
        let body = Frames { left: 2 * MB as usize, frame: 4_096, sized: false };
        let res = svc.oneshot(grpc_call(body)).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers()["grpc-status"], "8");
        assert!(res.headers().contains_key("grpc-retry-pushback-ms"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_grpc_response_past_its_tier_ends_with_resource_exhausted_trailers() {
        let store = Counted::new();
        let policy = Policy::builder("download")
            .tier("bytes", Quota::per_second(MB).counting(Unit::ResponseBytes))
            .build()
            .unwrap();
        let svc = grpc_layer(policy, &store).layer(service_fn(
            |_req: Request<RequestBody<Full<Bytes>>>| async {
                let body = Frames { left: 2 * MB as usize, frame: 16_384, sized: false };
                Ok::<_, Infallible>(Response::new(body))
            },
        ));
        let res = svc.oneshot(grpc_call(Full::default())).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        let mut body = res.into_body();
        let (mut read, mut trailers) = (0, None);
        while !body.is_end_stream() {
            match body.frame().await.unwrap().unwrap().into_data() {
                Ok(data) => read += data.len() as u64,
                Err(frame) => trailers = frame.into_trailers().ok(),
            }
        }
        // The burst less the unit charged at admission (time stands still: nothing refills),
        // the last lease cut to what the tier had left; then the trailers.
        assert_eq!(read, MB - 1);
        let trailers = trailers.expect("trailers end the response");
        assert_eq!(trailers["grpc-status"], "8");
        assert!(trailers.contains_key("grpc-retry-pushback-ms"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_plain_http_response_under_policing_is_shaped() {
        let store = Counted::new();
        let policy = Policy::builder("download")
            .tier("bytes", Quota::per_second(MB).counting(Unit::ResponseBytes))
            .build()
            .unwrap();
        let svc = grpc_layer(policy, &store).layer(service_fn(
            |_req: Request<RequestBody<Full<Bytes>>>| async {
                let body = Frames { left: 2 * MB as usize, frame: 16_384, sized: false };
                Ok::<_, Infallible>(Response::new(body))
            },
        ));
        let start = Instant::now();
        let res = svc.oneshot(Request::new(Full::default())).await.unwrap();
        let read = res.into_body().collect().await.unwrap().to_bytes().len() as u64;
        assert_eq!(read, 2 * MB);
        // 1 MB of burst (less the admission unit), then 1 MB/s.
        let elapsed = start.elapsed();
        assert!(
            elapsed >= Duration::from_millis(900) && elapsed <= Duration::from_millis(1_100),
            "{elapsed:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_dry_run_neither_stops_nor_slows_a_stream() {
        let store = Counted::new();
        let layer = RateLimitLayer::builder(upload_policy())
            .key(GlobalKey)
            .store(store.clone())
            .on_stream(StreamMode::Police)
            .dry_run(true)
            .build()
            .unwrap();
        let svc = layer.layer(service_fn(|req: Request<RequestBody<Frames>>| async move {
            let read = req.into_body().collect().await.unwrap().to_bytes().len();
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(read.to_string()))))
        }));
        let start = Instant::now();
        let body = Frames { left: 2 * MB as usize, frame: 4_096, sized: false };
        let res = svc.oneshot(Request::post("/").body(body).unwrap()).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "2000000");
        assert_eq!(start.elapsed(), Duration::ZERO);
        // The admission, and no lease: the bytes are settled when the body ends.
        assert_eq!(store.checks(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_dropped_while_its_lease_is_reserved_ahead_gives_it_back() {
        let store = Counted::new();
        let policy = Policy::builder("upload")
            .tier(
                "bytes",
                Quota::per_second(MB).with_burst(STREAM_LEASE).counting(Unit::RequestBytes),
            )
            .build()
            .unwrap();
        let limiter = Limiter::with_store(policy, store.clone()).unwrap();
        let mut leases = Leases::new(
            &limiter,
            Key::Global,
            Priority::Standard,
            Unit::RequestBytes,
            StreamMode::Shape,
            false,
        );
        let mut cx = Context::from_waker(Waker::noop());
        // The burst: one lease at once, spent whole.
        assert!(matches!(
            leases.poll_room(&mut cx, None, STREAM_LEASE),
            Poll::Ready(Ok(STREAM_LEASE))
        ));
        leases.spend(STREAM_LEASE);
        // The next lease is reserved 65,536 us ahead: the body waits for it.
        assert!(leases.poll_room(&mut cx, None, STREAM_LEASE).is_pending());
        assert_eq!(store.checks(), 2);
        drop(leases);
        // Given back: the next byte fits after 1 us, as after the first lease alone.
        let next = limiter.check(&Key::Global, 1).await.unwrap();
        assert_eq!(next.retry_after(), Some(Duration::from_micros(1)));
    }
}

#[cfg(test)]
mod message_tests {
    //! Tiers counting gRPC messages, metered as bodies stream (paused time).
    use std::collections::VecDeque;
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicU64, Ordering};

    use bytes::{BufMut, Bytes, BytesMut};
    use http::{Request, Response};
    use http_body::{Body, Frame};
    use http_body_util::{BodyExt, Full};
    use tokio::time::Instant;
    use tower::{Layer, ServiceExt, service_fn};

    use super::*;
    use crate::key::GlobalKey;
    use crate::policy::Policy;
    use crate::quota::Quota;
    use crate::{RateLimitLayer, RequestBody};

    /// The bytes of one gRPC message: 8 bytes of payload, 13 in all.
    const MESSAGE: usize = 13;

    /// A gRPC body: `frames` frames of `per_frame` messages each, all ready at once.
    struct Grpc(VecDeque<Bytes>);

    impl Grpc {
        fn new(frames: usize, per_frame: usize) -> Self {
            let mut n = 0u64;
            Self(
                (0..frames)
                    .map(|_| {
                        let mut frame = BytesMut::new();
                        for _ in 0..per_frame {
                            frame.put_u8(0);
                            frame.put_u32(8);
                            frame.put_u64(n);
                            n += 1;
                        }
                        frame.freeze()
                    })
                    .collect(),
            )
        }
    }

    impl Body for Grpc {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Ready(self.0.pop_front().map(|f| Ok(Frame::data(f))))
        }

        fn is_end_stream(&self) -> bool {
            self.0.is_empty()
        }
    }

    use super::tests::Counted;

    fn layer(unit: Unit, mode: StreamMode, store: &Counted) -> RateLimitLayer<GlobalKey, Counted> {
        let policy = Policy::builder("messages")
            .tier("messages", Quota::per_second(100).counting(unit))
            .build()
            .unwrap();
        RateLimitLayer::builder(policy)
            .key(GlobalKey)
            .store(store.clone())
            .on_stream(mode)
            .build()
            .unwrap()
    }

    fn grpc_call<B>(body: B) -> Request<B> {
        Request::post("/pkg.Service/Method")
            .header("content-type", "application/grpc")
            .body(body)
            .unwrap()
    }

    /// Polices a gRPC upload of 40 frames of `per_frame` messages against 100 messages
    /// (burst 100): the messages the handler read, the status, the store's checks.
    async fn police_upload(per_frame: usize) -> (u64, String, u64) {
        let store = Counted::new();
        let read = Arc::new(AtomicU64::new(0));
        let handler_read = Arc::clone(&read);
        let svc = layer(Unit::RequestMessages, StreamMode::Police, &store).layer(service_fn(
            move |req: Request<RequestBody<Grpc>>| {
                let read = Arc::clone(&handler_read);
                async move {
                    let mut body = req.into_body();
                    while let Some(frame) = body.frame().await {
                        let len = frame.unwrap().into_data().unwrap().len();
                        read.fetch_add((len / MESSAGE) as u64, Ordering::SeqCst);
                    }
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
                }
            },
        ));
        let res = svc.oneshot(grpc_call(Grpc::new(40, per_frame))).await.unwrap();
        let status = res.headers()["grpc-status"].to_str().unwrap().to_owned();
        (read.load(Ordering::SeqCst), status, store.checks())
    }

    #[tokio::test(start_paused = true)]
    async fn policing_an_upload_stops_it_at_the_budget_with_one_store_call_per_lease() {
        // Five messages to a frame: a frame is read only while the tier has room for its
        // first message, so exactly the budget (20 frames) is read.
        let (read, status, checks) = police_upload(5).await;
        assert_eq!((read, status.as_str()), (100, "8"));
        // The admission (the first message); leases growing with what the stream used (5,
        // 10, then five of 16: 96 charged, 100 read: 4 owed); and the refused lease that
        // stops the stream: the 4 the tier has left pay the debt but leave no room.
        assert_eq!(checks, 1 + 7 + 1);
    }

    #[tokio::test(start_paused = true)]
    async fn several_messages_in_one_frame_pass_the_budget_by_less_than_a_frame() {
        // Seven to a frame: the 15th frame is read with 1 message of room left and lets 6
        // more through (a request's frame cannot be split): the bound is the budget plus
        // one frame's messages less one.
        let (read, status, _) = police_upload(7).await;
        assert_eq!((read, status.as_str()), (105, "8"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_shaped_server_stream_is_cut_at_message_boundaries_and_paced() {
        let store = Counted::new();
        let svc = layer(Unit::ResponseMessages, StreamMode::Shape, &store).layer(service_fn(
            |_req: Request<RequestBody<Full<Bytes>>>| async {
                // 250 messages, 50 to a frame.
                Ok::<_, Infallible>(Response::new(Grpc::new(5, 50)))
            },
        ));
        let start = Instant::now();
        let res = svc.oneshot(grpc_call(Full::default())).await.unwrap();
        let mut body = res.into_body();
        let (mut messages, mut largest) = (0, 0);
        while !body.is_end_stream() {
            let data = body.frame().await.unwrap().unwrap().into_data().unwrap();
            assert_eq!(data.len() % MESSAGE, 0, "whole messages");
            messages += data.len() / MESSAGE;
            largest = largest.max(data.len() / MESSAGE);
        }
        assert_eq!((messages, largest), (250, 16));
        // A burst of 100, then 100/s. Leases of 16 (the messages in hand, at most 16), the
        // seventh cut to the 4 the burst had left (taken now rather than 16 reserved
        // ahead): the last lease (messages 245 to 260) fits at (260 - 100) / 100 s.
        assert_eq!(start.elapsed(), Duration::from_millis(1_600));
        // The admission (which charged no message: shaping), then 17 leases.
        assert_eq!(store.checks(), 1 + 17);
    }

    #[tokio::test(start_paused = true)]
    async fn a_plain_http_request_counts_as_one_message() {
        let store = Counted::new();
        let svc = layer(Unit::RequestMessages, StreamMode::Police, &store).layer(service_fn(
            |req: Request<RequestBody<Grpc>>| async move {
                req.into_body().collect().await.unwrap();
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            },
        ));
        // Not gRPC: its body is not framed, and it costs one message at admission.
        for _ in 0..100 {
            let req = Request::post("/").body(Grpc::new(3, 5)).unwrap();
            assert_eq!(svc.clone().oneshot(req).await.unwrap().status(), 200);
        }
        let req = Request::post("/").body(Grpc::new(3, 5)).unwrap();
        assert_eq!(svc.oneshot(req).await.unwrap().status(), 429);
    }
}
