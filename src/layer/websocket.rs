//! WebSocket messages as a tier's unit: the layer cannot see the frames of an upgraded
//! connection, so it hands the handler a [`MessageBudget`] that meters the socket the
//! handler wraps with it, in the same grants as the messages of a gRPC stream.

use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::extract::FromRequestParts;
use axum::extract::ws::{CloseFrame, Message, WebSocket, close_code};
use axum::response::{IntoResponse, Response};
use futures_core::Stream;
use futures_core::stream::FusedStream;
use futures_sink::Sink;
use http::StatusCode;
use smallvec::SmallVec;

use super::meter::Finish;
use super::stream::{Gate, Grants, Stopped, StreamMode, Tally};
use crate::key::Key;
use crate::limiter::Limiter;
use crate::quota::{Priority, Unit};
use crate::store::Store;

/// How long a socket stopped by policing waits for the client's Close frame before it ends
/// anyway (RFC 6455 §7.1.1: the server should wait for the client's reply before closing
/// the TCP connection, and ends it itself after a reasonable time).
const CLOSE_WAIT: Duration = Duration::from_secs(5);

/// Makes the gate of one socket direction (`None` when no tier counts it).
type MakeGate = dyn Fn(Unit) -> Option<Box<dyn Gate>> + Send + Sync;

/// An admitted upgrade held for as long as its socket lives: the request is finished (its
/// concurrency slots released, its counted units settled) when the `101` response has ended
/// and the last [`MessageBudget`] and [`MeteredWebSocket`] of it are dropped, whichever
/// comes last.
pub(crate) struct Linger {
    /// Finishes the held request.
    finish: Mutex<Option<Finish>>,
    /// What the end of the response settled, to settle with the socket's counts.
    settled: Mutex<Vec<(Unit, u64)>>,
    /// The messages each way, counted under [`StreamMode::Settle`] (and in a dry run): when
    /// the socket ends, the message charged each way at admission is settled at its count.
    tallies: Option<[Arc<AtomicU64>; 2]>,
    /// Whether a socket was wrapped to count them: a request that ended without one (dropped
    /// before its response, or a handler that never wrapped its socket) keeps its estimate.
    wrapped: AtomicBool,
    /// Whether the handler took the [`MessageBudget`]: an upgrade answered `101` without it
    /// has a socket nothing meters, and is refused instead.
    asked: AtomicBool,
}

impl Linger {
    /// Holds `finish` until the socket ends; `tally` counts the socket's messages to settle
    /// them then.
    pub(crate) fn new(finish: Finish, tally: bool) -> Self {
        Self {
            finish: Mutex::new(Some(finish)),
            settled: Mutex::default(),
            tallies: tally.then(Default::default),
            wrapped: AtomicBool::new(false),
            asked: AtomicBool::new(false),
        }
    }

    /// Whether the handler took the budget (extracted it as an argument).
    pub(crate) fn asked(&self) -> bool {
        self.asked.load(Ordering::Relaxed)
    }

    /// The response ended, settling `settled`: kept until the socket ends.
    pub(crate) fn ended(&self, settled: &[(Unit, u64)]) {
        self.settled.lock().unwrap_or_else(PoisonError::into_inner).extend_from_slice(settled);
    }

    /// The counter of `unit`'s messages, when they are tallied.
    fn tally(&self, unit: Unit) -> Option<&Arc<AtomicU64>> {
        let [received, sent] = self.tallies.as_ref()?;
        Some(if unit == Unit::RequestMessages { received } else { sent })
    }
}

impl Drop for Linger {
    fn drop(&mut self) {
        let mut settled =
            std::mem::take(self.settled.get_mut().unwrap_or_else(PoisonError::into_inner));
        let wrapped = self.wrapped.load(Ordering::Relaxed);
        for unit in [Unit::RequestMessages, Unit::ResponseMessages].into_iter().filter(|_| wrapped)
        {
            // A refund by the response's status settled every unit at 0 already.
            if let (Some(count), false) =
                (self.tally(unit), settled.iter().any(|(u, _)| *u == unit))
            {
                settled.push((unit, count.load(Ordering::Relaxed)));
            }
        }
        if let Some(finish) = self.finish.get_mut().unwrap_or_else(PoisonError::into_inner).take() {
            finish(&settled);
        }
    }
}

/// The message budget of one admitted WebSocket upgrade, an axum extractor whose
/// [`wrap`](Self::wrap) meters the handler's socket. The [`MeteredWebSocket`] it gives charges
/// each Text or Binary message received to the tiers counting [`Unit::RequestMessages`], and
/// each sent to those counting [`Unit::ResponseMessages`], shaped or policed as the layer
/// decides requests. An upgrade whose handler does not take the budget of a policy counting
/// messages is refused with a `500`.
///
/// ```
/// use axum::extract::ws::{Message, WebSocketUpgrade};
/// use axum::{Router, response::Response, routing::get};
/// use tollgate::ws::MessageBudget;
/// use tollgate::{Policy, Quota, RateLimitLayer, Unit};
///
/// async fn echo(up: WebSocketUpgrade, budget: MessageBudget) -> Response {
///     up.on_upgrade(move |socket| async move {
///         let mut socket = budget.wrap(socket);
///         // Ends when the client closes, or when policing closed the socket.
///         while let Some(Ok(message)) = socket.recv().await {
///             if matches!(message, Message::Text(_)) && socket.send(message).await.is_err() {
///                 break;
///             }
///         }
///     })
/// }
///
/// # fn main() -> Result<(), tollgate::ConfigError> {
/// // 100 messages a second from each client, burst 100.
/// let policy = Policy::builder("chat")
///     .tier("messages", Quota::per_second(100).counting(Unit::RequestMessages))
///     .build()?;
/// let app: Router = Router::new()
///     .route("/chat", get(echo))
///     .route_layer(RateLimitLayer::builder(policy).build()?);
/// # let _ = app;
/// # Ok(()) }
/// ```
///
/// What the client sees when a tier runs out, and how the upgrade is held: see
/// [how it works](crate::ws#how-it-works).
#[derive(Clone, Default)]
pub struct MessageBudget {
    /// One per layer that admitted the upgrade under a policy counting messages (layers may
    /// be stacked): a message is charged to each.
    parts: Vec<Arc<Part>>,
}

/// What one layer meters a socket with.
struct Part {
    make: Box<MakeGate>,
    /// Holds the upgrade this layer admitted until the socket ends.
    linger: Arc<Linger>,
}

impl fmt::Debug for MessageBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MessageBudget").field("layers", &self.parts.len()).finish()
    }
}

impl MessageBudget {
    /// Adds the budget of `key` under `limiter`'s policy; `mode` is already
    /// [`StreamMode::Settle`] in a dry run; `linger` holds the admitted upgrade (tallying its
    /// messages under `Settle`).
    pub(crate) fn and<St: Store>(
        mut self,
        limiter: &Limiter<St>,
        key: Key,
        priority: Priority,
        (mode, fail_open): (StreamMode, bool),
        linger: Arc<Linger>,
    ) -> Self {
        let limiter = limiter.clone();
        let counting = Arc::clone(&linger);
        let make = move |unit: Unit| {
            if !limiter.policy().tiers().iter().any(|t| t.unit() == unit) {
                return None;
            }
            if let Some([received, sent]) = &counting.tallies {
                counting.wrapped.store(true, Ordering::Relaxed);
                let counted = if unit == Unit::RequestMessages { received } else { sent };
                return Some(Box::new(Tally(Arc::clone(counted))) as Box<dyn Gate>);
            }
            let gate = Grants::new(&limiter, key.clone(), priority, unit, mode, fail_open);
            // The upgrade was charged one message each way at admission.
            Some(Box::new(gate.prepaid(1)) as Box<dyn Gate>)
        };
        self.parts.push(Arc::new(Part { make: Box::new(make), linger }));
        self
    }

    /// The budget, as a handler takes it: each layer that gave a part of it learns so.
    fn taken(&self) -> Self {
        for part in &self.parts {
            part.linger.asked.store(true, Ordering::Relaxed);
        }
        self.clone()
    }

    /// The gate of `unit`'s messages: every layer's that counts them.
    fn gate(&self, unit: Unit) -> Option<Box<dyn Gate>> {
        let mut gates: SmallVec<[Box<dyn Gate>; 1]> =
            self.parts.iter().filter_map(|part| (part.make)(unit)).collect();
        match gates.len() {
            0 | 1 => gates.pop(),
            _ => Some(Box::new(AllOf(gates))),
        }
    }

    /// Meters `socket`: each Text or Binary message received is charged to the tiers
    /// counting [`Unit::RequestMessages`], each sent to those counting
    /// [`Unit::ResponseMessages`].
    #[must_use]
    pub fn wrap(&self, socket: WebSocket) -> MeteredWebSocket {
        MeteredWebSocket {
            socket,
            receiving: self.gate(Unit::RequestMessages),
            sending: self.gate(Unit::ResponseMessages),
            received: None,
            outgoing: None,
            state: State::Open,
            spent: None,
            _parts: self.parts.clone(),
        }
    }

    /// Whether the socket is metered at all: `false` when the layer let the upgrade through
    /// without a policy counting messages (a request passed by a
    /// [filter](crate::RateLimitLayerBuilder::filter) or an allow-list, a key missing under
    /// [`MissingKey::Allow`](crate::MissingKey::Allow), a store error failing open, a dry
    /// run's refusal, or a policy with no tier counting messages).
    #[must_use]
    pub fn is_metered(&self) -> bool {
        !self.parts.is_empty()
    }
}

/// The messages of a socket charged to the tiers of several stacked layers: each must have
/// room.
struct AllOf(SmallVec<[Box<dyn Gate>; 1]>);

impl Gate for AllOf {
    fn poll_room(
        &mut self,
        cx: &mut Context<'_>,
        remaining: Option<u64>,
        want: u64,
    ) -> Poll<Result<u64, Stopped>> {
        let mut room = u64::MAX;
        for gate in &mut self.0 {
            room = room.min(ready!(gate.poll_room(cx, remaining, want))?);
        }
        Poll::Ready(Ok(room))
    }

    fn spend(&mut self, len: u64) {
        self.0.iter_mut().for_each(|gate| gate.spend(len));
    }

    fn ready(&self) -> u64 {
        self.0.iter().map(|gate| gate.ready()).min().unwrap_or(u64::MAX)
    }
}

/// Puts a budget that meters nothing in the extensions of a WebSocket upgrade the layer lets
/// through without one, so that its handler's [`MessageBudget`] is refused only when no
/// layer is in front of it.
pub(crate) fn unmetered<B>(req: &mut http::Request<B>) {
    if is_upgrade(req.method(), req.headers()) && req.extensions().get::<MessageBudget>().is_none()
    {
        req.extensions_mut().insert(MessageBudget::default());
    }
}

/// Extracts the [`MessageBudget`] the layer put in the request's extensions.
///
/// # Errors
/// [`MissingBudget`] (a `500 Internal Server Error`) when there is none: the route is not
/// behind a [`RateLimitLayer`](crate::RateLimitLayer), or the request does not ask for a
/// WebSocket upgrade. `Option<MessageBudget>` is `None` then instead.
impl<S: Send + Sync> FromRequestParts<S> for MessageBudget {
    type Rejection = MissingBudget;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Self>().map(Self::taken).ok_or(MissingBudget)
    }
}

/// `Option<MessageBudget>`: `None` when the layer put no budget in the request.
impl<S: Send + Sync> axum::extract::OptionalFromRequestParts<S> for MessageBudget {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<Self>().map(Self::taken))
    }
}

/// The answer in place of a `101` whose handler did not take the [`MessageBudget`] of a policy
/// counting messages: `500 Internal Server Error` with a problem+json body saying so (the
/// socket would not be metered; no upgrade happens).
pub(crate) fn unmetered_upgrade() -> http::Response<bytes::Bytes> {
    let body = r#"{"type":"about:blank","title":"Internal Server Error","status":500,"detail":"the route's rate-limit policy counts WebSocket messages, but its handler does not meter the socket: take a tollgate::ws::MessageBudget and wrap the socket with it"}"#;
    let mut res = http::Response::new(bytes::Bytes::from_static(body.as_bytes()));
    *res.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
    res.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/problem+json"),
    );
    res
}

/// The refusal of a handler asking for a [`MessageBudget`] that the layer did not give: a
/// server misconfiguration, answered `500 Internal Server Error` with a plain-text reason
/// (the route is not behind a `RateLimitLayer`, or the request is not a WebSocket upgrade).
///
/// ```
/// use axum::response::IntoResponse;
/// use http::StatusCode;
/// use tollgate::ws::MissingBudget;
///
/// // A handler asking for a `MessageBudget` on a route without the layer gets this answer:
/// assert_eq!(MissingBudget.into_response().status(), StatusCode::INTERNAL_SERVER_ERROR);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MissingBudget;

impl fmt::Display for MissingBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "no message budget: the route is not behind a RateLimitLayer, or the request is not \
             a WebSocket upgrade",
        )
    }
}

impl std::error::Error for MissingBudget {}

impl IntoResponse for MissingBudget {
    fn into_response(self) -> Response {
        (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
    }
}

/// Why a [`MeteredWebSocket`] was closed by policing: the error its sends return from then
/// on (inside the [`axum::Error`]: `error.into_inner().downcast::<BudgetSpent>()`), also
/// told by [`MeteredWebSocket::spent`]. [`MeteredWebSocket`]'s example reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetSpent {
    unit: Unit,
    retry_after: Option<Duration>,
    unavailable: bool,
}

impl BudgetSpent {
    /// The direction whose tier had no room: [`Unit::RequestMessages`] (messages received)
    /// or [`Unit::ResponseMessages`] (messages sent).
    #[must_use]
    pub fn unit(&self) -> Unit {
        self.unit
    }

    /// How long until the tier has room for the grant it refused (at most
    /// [`MESSAGE_GRANT`](crate::StreamMode::MESSAGE_GRANT) messages); `None` when that grant can never
    /// fit, or when the store could not decide.
    #[must_use]
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// Whether the store could not decide and the layer fails closed (the socket was closed
    /// with code 1013, try again later), rather than the tier being spent (code 1008).
    #[must_use]
    pub fn unavailable(&self) -> bool {
        self.unavailable
    }

    /// The Close frame that tells the client: 1008 and `rate limited; retry-after=N` (whole
    /// seconds rounded up, at least 1; `rate limited` alone when the grant can never fit), or
    /// 1013 and `rate limit unavailable`.
    fn close_frame(&self) -> CloseFrame {
        if self.unavailable {
            return CloseFrame { code: close_code::AGAIN, reason: "rate limit unavailable".into() };
        }
        let reason = match self.retry_after {
            Some(wait) => {
                let secs = u64::try_from(wait.as_nanos().div_ceil(1_000_000_000))
                    .unwrap_or(u64::MAX)
                    .max(1);
                format!("rate limited; retry-after={secs}")
            }
            None => "rate limited".to_owned(),
        };
        CloseFrame { code: close_code::POLICY, reason: reason.into() }
    }
}

impl fmt::Display for BudgetSpent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let direction = match self.unit {
            Unit::RequestMessages => "received",
            _ => "sent",
        };
        match (self.unavailable, self.retry_after) {
            (true, _) => write!(f, "the rate limit of messages {direction} could not be decided"),
            (false, Some(wait)) => {
                let secs = wait.as_secs_f64();
                write!(f, "the budget of messages {direction} is spent; room in {secs:.3} s")
            }
            (false, None) => write!(f, "the budget of messages {direction} is spent"),
        }
    }
}

impl std::error::Error for BudgetSpent {}

/// Where the socket stands.
enum State {
    Open,
    /// Policing stopped it: the Close frame to send.
    Closing(Option<Message>),
    /// The Close frame is sent: reading on, discarding, until the client's Close comes back
    /// or the wait is over.
    Draining(Pin<Box<tokio::time::Sleep>>),
    Ended,
}

/// An axum [`WebSocket`] whose messages are charged to the layer's message tiers (made by
/// [`MessageBudget::wrap`]): a [`Stream`] of the messages received and a [`Sink`] of those
/// to send, as `WebSocket` is, with the same [`recv`](Self::recv) and [`send`](Self::send).
///
/// ```
/// use axum::extract::ws::Message;
/// use tollgate::ws::MeteredWebSocket;
///
/// /// Pushes updates until the client goes or policing closes the socket.
/// async fn push(mut socket: MeteredWebSocket, updates: Vec<String>) {
///     for update in updates {
///         if socket.send(Message::Text(update.into())).await.is_err() {
///             if let Some(spent) = socket.spent() {
///                 eprintln!("closed by the rate limit: {spent}");
///                 // Close gracefully: receive until the client answers the Close frame.
///                 while socket.recv().await.is_some() {}
///             }
///             return;
///         }
///     }
/// }
/// ```
///
/// Under [`StreamMode::Police`], when a tier has no room for the next message the socket
/// sends the Close frame the [ws module](crate::ws#how-it-works) describes and then: a message
/// past the budget
/// that was received is not delivered, and the stream of messages ends (`None`) once the
/// client answered the Close (or after 5 seconds); a message past the budget that was to be
/// sent is dropped, and that send fails with [`BudgetSpent`], as every send after it does.
/// To close gracefully after a refused send, keep receiving until `None`.
///
/// Dropping the socket gives back the unused part of each direction's last grant.
pub struct MeteredWebSocket {
    socket: WebSocket,
    receiving: Option<Box<dyn Gate>>,
    sending: Option<Box<dyn Gate>>,
    /// A data message received, waiting for room.
    received: Option<Message>,
    /// A data message to send, waiting for room.
    outgoing: Option<Message>,
    state: State,
    spent: Option<BudgetSpent>,
    /// Last: the grants above are settled before the requests are finished.
    _parts: Vec<Arc<Part>>,
}

impl fmt::Debug for MeteredWebSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MeteredWebSocket")
            .field("socket", &self.socket)
            .field("spent", &self.spent)
            .finish_non_exhaustive()
    }
}

/// Whether `message` counts: Text and Binary do, control frames do not.
fn is_data(message: &Message) -> bool {
    matches!(message, Message::Text(_) | Message::Binary(_))
}

impl MeteredWebSocket {
    /// Receives the next message: `None` once the socket ended (the client closed it, or
    /// policing did). Waits while shaping holds a message for room.
    ///
    /// # Errors
    /// The socket's own errors ([`axum::Error`]).
    pub async fn recv(&mut self) -> Option<Result<Message, axum::Error>> {
        std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await
    }

    /// Sends `message` and flushes it. Waits while shaping holds it for room.
    ///
    /// # Errors
    /// The socket's own errors; after policing closed the socket, [`BudgetSpent`] (inside
    /// the [`axum::Error`]).
    pub async fn send(&mut self, message: Message) -> Result<(), axum::Error> {
        let mut this = Pin::new(&mut *self);
        std::future::poll_fn(|cx| this.as_mut().poll_ready(cx)).await?;
        this.as_mut().start_send(message)?;
        std::future::poll_fn(|cx| this.as_mut().poll_flush(cx)).await
    }

    /// Why policing closed the socket, once it did.
    #[must_use]
    pub fn spent(&self) -> Option<&BudgetSpent> {
        self.spent.as_ref()
    }

    /// The socket metered.
    #[must_use]
    pub fn get_ref(&self) -> &WebSocket {
        &self.socket
    }

    /// Stops the socket: the Close frame is queued, and what waited for room is dropped.
    fn stop(&mut self, unit: Unit, why: Stopped) -> BudgetSpent {
        let spent = match why {
            Stopped::Limited(decision) => {
                BudgetSpent { unit, retry_after: decision.retry_after(), unavailable: false }
            }
            Stopped::Unavailable(_) => BudgetSpent { unit, retry_after: None, unavailable: true },
        };
        tracing::debug!(%spent, "tollgate: closing a WebSocket");
        self.received = None;
        self.outgoing = None;
        if matches!(self.state, State::Open) {
            self.state = State::Closing(Some(Message::Close(Some(spent.close_frame()))));
        }
        self.spent = Some(spent.clone());
        spent
    }

    /// The error of a send after the socket was stopped.
    fn spent_error(&self) -> axum::Error {
        let spent = self.spent.clone().unwrap_or(BudgetSpent {
            unit: Unit::ResponseMessages,
            retry_after: None,
            unavailable: false,
        });
        axum::Error::new(spent)
    }

    /// Sends the Close frame of a stopped socket, then waits for the client's.
    fn poll_closing(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), axum::Error>> {
        loop {
            match &mut self.state {
                State::Open | State::Ended => return Poll::Ready(Ok(())),
                State::Closing(close) => {
                    let mut socket = Pin::new(&mut self.socket);
                    if close.is_some() {
                        let sent = ready!(socket.as_mut().poll_ready(cx)).and_then(|()| {
                            let frame = close.take().unwrap_or(Message::Close(None));
                            socket.as_mut().start_send(frame)
                        });
                        if let Err(error) = sent {
                            self.state = State::Ended;
                            return Poll::Ready(Err(error));
                        }
                    }
                    if let Err(error) = ready!(socket.poll_flush(cx)) {
                        self.state = State::Ended;
                        return Poll::Ready(Err(error));
                    }
                    self.state = State::Draining(Box::pin(tokio::time::sleep(CLOSE_WAIT)));
                }
                State::Draining(wait) => {
                    if wait.as_mut().poll(cx).is_ready() {
                        self.state = State::Ended;
                        continue;
                    }
                    match ready!(Pin::new(&mut self.socket).poll_next(cx)) {
                        // The client's messages past the budget are dropped.
                        Some(Ok(_)) => {}
                        Some(Err(_)) | None => self.state = State::Ended,
                    }
                }
            }
        }
    }

    /// Sends the message waiting for room, once it has room.
    fn poll_outgoing(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), axum::Error>> {
        if self.outgoing.is_none() {
            return Poll::Ready(Ok(()));
        }
        if let Some(gate) = &mut self.sending {
            match ready!(gate.poll_room(cx, None, 1)) {
                Ok(_) => {}
                Err(why) => {
                    let spent = self.stop(Unit::ResponseMessages, why);
                    // The client is told now: the handler may not poll again.
                    let _ = self.poll_closing(cx);
                    return Poll::Ready(Err(axum::Error::new(spent)));
                }
            }
        }
        let mut socket = Pin::new(&mut self.socket);
        ready!(socket.as_mut().poll_ready(cx))?;
        let Some(message) = self.outgoing.take() else { return Poll::Ready(Ok(())) };
        if let Some(gate) = &mut self.sending {
            gate.spend(1);
        }
        Poll::Ready(socket.start_send(message))
    }
}

impl Stream for MeteredWebSocket {
    type Item = Result<Message, axum::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if !matches!(this.state, State::Open) {
                // Stopped: the Close goes out, the client's answer is awaited, then the end.
                return match ready!(this.poll_closing(cx)) {
                    Ok(()) => Poll::Ready(None),
                    Err(error) => Poll::Ready(Some(Err(error))),
                };
            }
            if let Some(message) = this.received.take() {
                let Some(gate) = &mut this.receiving else {
                    return Poll::Ready(Some(Ok(message)));
                };
                match gate.poll_room(cx, None, 1) {
                    Poll::Pending => {
                        // Held until there is room: the socket is not read meanwhile.
                        this.received = Some(message);
                        return Poll::Pending;
                    }
                    Poll::Ready(Ok(_)) => {
                        gate.spend(1);
                        return Poll::Ready(Some(Ok(message)));
                    }
                    Poll::Ready(Err(why)) => {
                        this.stop(Unit::RequestMessages, why);
                        continue;
                    }
                }
            }
            match ready!(Pin::new(&mut this.socket).poll_next(cx)) {
                Some(Ok(message)) if is_data(&message) && this.receiving.is_some() => {
                    this.received = Some(message);
                }
                other => return Poll::Ready(other),
            }
        }
    }
}

impl FusedStream for MeteredWebSocket {
    fn is_terminated(&self) -> bool {
        matches!(self.state, State::Ended) || self.socket.is_terminated()
    }
}

impl Sink<Message> for MeteredWebSocket {
    type Error = axum::Error;

    /// Ready when the message given before has gone to the socket (it waits for room while
    /// shaping) and the socket is ready.
    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        let this = self.get_mut();
        if !matches!(this.state, State::Open) {
            return Poll::Ready(Err(this.spent_error()));
        }
        ready!(this.poll_outgoing(cx))?;
        Pin::new(&mut this.socket).poll_ready(cx)
    }

    /// A Text or Binary message is held until the next `poll_ready`, `poll_flush` or
    /// `poll_close` finds room for it; other messages go to the socket at once.
    fn start_send(self: Pin<&mut Self>, item: Message) -> Result<(), Self::Error> {
        let this = self.get_mut();
        if !matches!(this.state, State::Open) {
            return Err(this.spent_error());
        }
        if is_data(&item) && this.sending.is_some() {
            this.outgoing = Some(item);
            return Ok(());
        }
        Pin::new(&mut this.socket).start_send(item)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        let this = self.get_mut();
        if !matches!(this.state, State::Open) {
            return Poll::Ready(Err(this.spent_error()));
        }
        ready!(this.poll_outgoing(cx))?;
        Pin::new(&mut this.socket).poll_flush(cx)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        let this = self.get_mut();
        if matches!(this.state, State::Open) {
            ready!(this.poll_outgoing(cx))?;
        } else {
            ready!(this.poll_closing(cx))?;
        }
        Pin::new(&mut this.socket).poll_close(cx)
    }
}

/// Whether a request asks for a WebSocket upgrade: HTTP/1.1's `Upgrade: websocket` (RFC 6455
/// §4.1), or HTTP/2's extended `CONNECT` (RFC 8441).
pub(crate) fn is_upgrade(method: &http::Method, headers: &http::HeaderMap) -> bool {
    // An extended CONNECT for a WebSocket carries `Sec-WebSocket-Version` (RFC 8441 §5); a
    // proxy's CONNECT does not.
    (*method == http::Method::CONNECT && headers.contains_key(http::header::SEC_WEBSOCKET_VERSION))
        || headers
            .get_all(http::header::UPGRADE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|p| p.trim().eq_ignore_ascii_case("websocket"))
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, HeaderValue, Method};

    use super::*;

    fn spent(retry_after: Option<Duration>, unavailable: bool) -> BudgetSpent {
        BudgetSpent { unit: Unit::RequestMessages, retry_after, unavailable }
    }

    #[test]
    fn the_close_frame_tells_the_wait_in_whole_seconds_rounded_up() {
        let frame = spent(Some(Duration::from_millis(160)), false).close_frame();
        assert_eq!((frame.code, frame.reason.as_str()), (1008, "rate limited; retry-after=1"));
        let frame = spent(Some(Duration::from_millis(2_001)), false).close_frame();
        assert_eq!(frame.reason.as_str(), "rate limited; retry-after=3");
        // Never 0: a client told to retry at once would be refused again.
        let frame = spent(Some(Duration::ZERO), false).close_frame();
        assert_eq!(frame.reason.as_str(), "rate limited; retry-after=1");
        // A grant that can never fit has no wait to tell.
        let frame = spent(None, false).close_frame();
        assert_eq!((frame.code, frame.reason.as_str()), (1008, "rate limited"));
        // The store could not decide, failing closed: try again later.
        let frame = spent(None, true).close_frame();
        assert_eq!((frame.code, frame.reason.as_str()), (1013, "rate limit unavailable"));
    }

    #[test]
    fn the_longest_reason_fits_a_close_frame() {
        // RFC 6455 §5.5: a control frame's payload is at most 125 bytes, 2 of them the code.
        let frame = spent(Some(Duration::MAX), false).close_frame();
        assert!(frame.reason.as_str().len() <= 123, "{}", frame.reason.as_str());
    }

    fn upgrade(method: Method, values: &[&'static str]) -> bool {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append(http::header::UPGRADE, HeaderValue::from_static(v));
        }
        is_upgrade(&method, &headers)
    }

    #[test]
    fn a_websocket_upgrade_is_recognised_by_its_upgrade_header_or_an_extended_connect() {
        assert!(upgrade(Method::GET, &["websocket"]));
        assert!(upgrade(Method::GET, &["WebSocket"]));
        assert!(upgrade(Method::GET, &["h2c, websocket"]));
        assert!(upgrade(Method::GET, &["h2c", "websocket"]));
        let mut connect = HeaderMap::new();
        connect.insert(http::header::SEC_WEBSOCKET_VERSION, HeaderValue::from_static("13"));
        assert!(is_upgrade(&Method::CONNECT, &connect));
        assert!(!upgrade(Method::CONNECT, &[]), "a proxy's CONNECT");
        assert!(!upgrade(Method::GET, &[]));
        assert!(!upgrade(Method::GET, &["h2c"]));
        assert!(!upgrade(Method::POST, &["websockets"]));
    }
}
