//! [`RequestBody`]: the request body the inner service receives, counted as it streams;
//! [`ResponseBody`]: the inner service's body, or the bytes of a response the layer made.
//! Both are one [`Metered`] body, observed by one [`Meter`] per layer that meters it, with one
//! rule for a body that finishes, is abandoned or is dropped (see [`Meter`]).

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project_lite::pin_project;
use smallvec::SmallVec;

use super::messages::Framer;
use super::meter::Meter;
use super::stream::{Gate, Signal, Stopped};

/// The meters of one body, innermost layer first.
type Meters = SmallVec<[Meter; 1]>;

/// What polling a body for its next frame gives.
type Polled<D, E> = Poll<Option<Result<Frame<D>, E>>>;

pin_project! {
    /// A body and the meters of the layers that observe it, innermost first: the one type
    /// behind [`RequestBody`] and [`ResponseBody`]. A request's frames cannot be cut (their
    /// data is any `Buf`): each waits, whole, until every gate has room
    /// ([`poll_whole`](Self::poll_whole)). A response's frames are cut to their grants, each
    /// meter reading what the meters inside it let out ([`poll_cut`](Self::poll_cut)).
    pub(crate) struct Metered<B> {
        #[pin]
        body: B,
        // `None` (one pointer, no allocation) for a body nothing meters.
        meters: Option<Box<Meters>>,
    }
}

impl<B> Metered<B> {
    fn new(body: B) -> Self {
        Self { body, meters: None }
    }

    fn with(body: B, meter: Meter) -> Self {
        let mut meters = Meters::new();
        meters.push(meter);
        Self { body, meters: Some(Box::new(meters)) }
    }

    /// The meter of the layer that just wrapped the body (the only one, until bodies are
    /// flattened), made on first use.
    fn own_meter(&mut self) -> &mut Meter {
        let meters = self.meters.get_or_insert_with(Box::default);
        if meters.is_empty() {
            meters.push(Meter::default());
        }
        let last = meters.len() - 1;
        &mut meters[last]
    }

    /// Adds the meters of an outer layer, which see what this body's own meters let out.
    #[cfg(feature = "config")]
    fn metered_by(&mut self, outer: Option<Box<Meters>>) {
        if let Some(outer) = outer {
            self.meters.get_or_insert_with(Box::default).extend(*outer);
        }
    }

    fn meters(&self) -> &[Meter] {
        self.meters.as_deref().map_or(&[], |m| m.as_slice())
    }
}

pin_project! {
    /// The request body that the service inside [`RateLimit`](crate::layer::RateLimit) (and
    /// [`Limits`](crate::config::Limits)) receives: the request's own body `B`, whatever its
    /// type (hyper's `Incoming`, axum's `Body`, tonic's `Body`, `http_body_util::Limited<_>`,
    /// a boxed body, a user's own), with its frames, errors, end and size hint passed through
    /// unchanged.
    ///
    /// axum's and tonic's routers take any body type, so nothing changes for them; a plain
    /// hyper handler behind the layer names this type.
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::{BodyExt, Full};
    /// use tollgate::{Policy, Quota, RateLimitLayer, RequestBody};
    /// use tower::{Layer, service_fn};
    ///
    /// # fn main() -> Result<(), tollgate::ConfigError> {
    /// let handler = service_fn(|req: Request<RequestBody<Full<Bytes>>>| async move {
    ///     let bytes = req.into_body().collect().await?.to_bytes();
    ///     Ok::<_, Infallible>(Response::new(Full::new(bytes)))
    /// });
    /// let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_second(10))?).build()?;
    /// let svc = layer.layer(handler);
    /// # let _ = svc;
    /// # Ok(()) }
    /// ```
    ///
    /// # How it works
    ///
    /// Under a policy with a tier counting [`Unit::RequestBytes`](crate::Unit::RequestBytes),
    /// a request without a valid `Content-Length` is charged the bytes of the data frames that
    /// pass through this body as the handler reads them (settled once, when the response body
    /// ends, by the rule both bodies share: see [`ResponseBody`]); a request with one is
    /// charged its `Content-Length` at admission. No other work is done per frame, and nothing
    /// is allocated for a request that is not counted. Under a layer metering streams
    /// ([`StreamMode::Shape`](crate::StreamMode::Shape),
    /// [`Police`](crate::StreamMode::Police)), the next frame of such a body waits for the
    /// tier's next grant: its frames, errors and end are still the body's own, delivered
    /// later, and a body stopped by policing yields nothing more (the layer answers in the
    /// handler's place). Under tiers counting
    /// [`Unit::RequestMessages`](crate::Unit::RequestMessages), the gRPC messages of a call's
    /// body are counted from their 5-byte prefixes as the frames pass (read in place, never
    /// copied nor decoded), and metered the same way.
    ///
    /// # With a body-size limit
    ///
    /// With a body-size limit, put tower-http's `RequestBodyLimitLayer` outside the rate limit
    /// in the same `ServiceBuilder` (`ServiceBuilder::new().layer(limit).layer(rate_limit)`),
    /// or use axum's `DefaultBodyLimit`: an upload over the limit then gets 413 and is charged
    /// the bytes read (up to the limit and the frame that crossed it). A separate
    /// `Router::layer` call between the two boxes the body once more, and axum's extractors
    /// look for a length-limit error through two such boxes only (answering 400 beyond).
    pub struct RequestBody<B> {
        #[pin]
        metered: Metered<B>,
    }
}

impl<B> RequestBody<B> {
    /// `body`, counted by no one (until a layer counts it).
    pub fn new(body: B) -> Self {
        Self { metered: Metered::new(body) }
    }

    /// The request's own body.
    pub fn get_ref(&self) -> &B {
        &self.metered.body
    }

    /// The request's own body, mutably.
    pub fn get_mut(&mut self) -> &mut B {
        &mut self.metered.body
    }

    /// The request's own body; what it yields from now on is not counted.
    pub fn into_inner(self) -> B {
        self.metered.body
    }

    /// Adds the bytes of every data frame from now on to `counter`.
    pub(crate) fn count_into(&mut self, counter: Arc<AtomicU64>) {
        self.metered.own_meter().count_into(counter);
    }

    /// Meters the data frames from now on with `gate`, telling `signal` when policing stops
    /// the body.
    pub(crate) fn gate(&mut self, gate: Box<dyn Gate>, signal: Arc<Signal>) {
        let meter = self.metered.own_meter();
        meter.bytes = Some(gate);
        meter.signal.get_or_insert(signal);
    }

    /// Meters the gRPC messages of the data frames from now on with `gate` (a grant of
    /// messages, or a tally), telling `signal` when policing stops the body.
    pub(crate) fn gate_messages(&mut self, gate: Box<dyn Gate>, signal: Arc<Signal>) {
        let meter = self.metered.own_meter();
        meter.messages = Some((gate, Framer::default()));
        meter.signal.get_or_insert(signal);
    }

    /// One body counted by both layers of a body wrapped twice (nested layers), so that
    /// nesting does not nest types.
    #[cfg(feature = "config")]
    pub(crate) fn flatten(nested: RequestBody<RequestBody<B>>) -> Self {
        let Metered { body: mut inner, meters: outer } = nested.metered;
        inner.metered.metered_by(outer);
        inner
    }
}

impl<B: Default> Default for RequestBody<B> {
    fn default() -> Self {
        Self::new(B::default())
    }
}

impl<B> fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let meters = self.metered.meters();
        f.debug_struct("RequestBody")
            .field("counted", &meters.iter().any(Meter::counts))
            .field("streamed", &meters.iter().any(Meter::streams))
            .finish()
    }
}

impl<B: Body> Body for RequestBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    #[inline]
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        self.project().metered.poll_whole(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.metered.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.metered.body.size_hint()
    }
}

impl<B: Body> Metered<B> {
    /// The next frame of a body whose frames pass whole (a request's): it waits until every
    /// meter's gate has room, and is counted as it passes.
    fn poll_whole(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled<B::Data, B::Error> {
        let this = self.project();
        let Some(meters) = this.meters.as_deref_mut() else { return this.body.poll_frame(cx) };
        if !this.body.is_end_stream() {
            for meter in meters.iter_mut() {
                // Stopped by policing: nothing more reaches the handler (the layer answers, or
                // ends a gRPC response, in its place); the rest is read off and dropped when
                // the layer asks (an HTTP/1 upload it answered).
                if meter.stopped {
                    let signal = meter.signal.as_deref().filter(|s| s.lingers());
                    return match signal {
                        Some(signal) => read_off(this.body, signal, cx),
                        None => Poll::Pending,
                    };
                }
                // Within the grant (most frames): nothing to poll. A refusal stops the body
                // at its next data frame: its end is never refused.
                let gate = meter.bytes.as_mut().filter(|gate| gate.ready() == 0);
                if let (Some(gate), None) = (gate, &meter.refused_bytes) {
                    match gate.poll_room(cx, this.body.size_hint().exact(), 1) {
                        Poll::Ready(Ok(_)) => {}
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Err(why)) => meter.refused_bytes = Some(why),
                    }
                }
                // Messages: a refused grant stops the stream at the next message only.
                if meter.refused.is_some() {
                    continue;
                }
                if let Some((gate, _)) = meter.messages.as_mut().filter(|(g, _)| g.ready() == 0) {
                    match gate.poll_room(cx, None, 1) {
                        Poll::Ready(Ok(_)) => {}
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Err(why)) => meter.refused = Some(why),
                    }
                }
            }
        }
        let frame = this.body.poll_frame(cx);
        match &frame {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    if let Some(stopped) = pass_frame(meters, data) {
                        return stopped;
                    }
                }
            }
            // Finished, or abandoned.
            Poll::Ready(_) => meters.iter_mut().for_each(Meter::end),
            Poll::Pending => {}
        }
        frame
    }
}

/// Counts a data frame of a body whose frames pass whole on every meter, or stops the stream
/// before it (`Some`) when a byte or message tier had no room for it.
fn pass_frame<D: bytes::Buf, T>(meters: &mut Meters, data: &D) -> Option<Poll<T>> {
    // A byte tier had no room for more: the stream stops before this frame.
    if data.has_remaining() {
        if let Some(meter) = meters.iter_mut().find(|m| m.refused_bytes.is_some()) {
            let why = meter.refused_bytes.take();
            return Some(stop_whole(meter, why.expect("found")));
        }
    }
    // What each meter's message gate spends: the messages the frame starts. Counted before
    // any is spent: a frame that does not reach the handler is charged to no tier.
    let mut spent: SmallVec<[u64; 2]> = SmallVec::new();
    for meter in meters.iter_mut() {
        let Some((_, framer)) = &mut meter.messages else {
            spent.push(0);
            continue;
        };
        let messages = framer.count(data);
        match meter.refused.take() {
            // A message the tier had no room for: the stream stops before it.
            Some(why) if messages > 0 => return Some(stop_whole(meter, why)),
            refused => meter.refused = refused,
        }
        spent.push(messages);
    }
    let len = data.remaining();
    for (meter, messages) in meters.iter_mut().zip(spent) {
        if let Some(gate) = meter.bytes.as_mut() {
            gate.spend(len as u64);
        }
        if let Some((gate, _)) = meter.messages.as_mut() {
            gate.spend(messages);
        }
        meter.passed(len);
    }
    None
}

/// Reads a stopped body's frames off and drops them, telling `signal` when it ended: the
/// handler sees none of them (it waits for ever, until the layer drops it).
fn read_off<B: Body, T>(mut body: Pin<&mut B>, signal: &Signal, cx: &mut Context<'_>) -> Poll<T> {
    loop {
        match body.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(_))) => {}
            Poll::Ready(_) => {
                signal.drained();
                return Poll::Pending;
            }
            Poll::Pending => return Poll::Pending,
        }
    }
}

/// A request body stopped by policing: nothing more is read, and the layer is told.
fn stop_whole<T>(meter: &mut Meter, why: Stopped) -> Poll<T> {
    meter.stopped = true;
    if let Some(signal) = &meter.signal {
        signal.stop(why);
    }
    Poll::Pending
}

pin_project! {
    /// The response body of [`RateLimit`](crate::layer::RateLimit) (and of
    /// [`Limits`](crate::config::Limits)): the inner service's body `B` unchanged, or the
    /// bytes of a response the layer made itself (a 429, a 503, a 400). No boxing either way,
    /// however many layers limited the request.
    ///
    /// # How a body ends
    ///
    /// Under a policy with concurrency tiers or tiers counting bytes, messages or reported
    /// units, the body also ends the request's hold. One rule ends every body the layer
    /// observes, this one and the [`RequestBody`] the handler read, for every layer that
    /// meters it:
    ///
    /// - **Finished**: the body handed on its last frame (a data frame after which it
    ///   reports [`is_end_stream`](Body::is_end_stream), so that a client that saw the end
    ///   finds the slot free; or its end).
    /// - **Abandoned**: the inner body yielded an error; it ends there, at what it handed
    ///   on before.
    /// - **Dropped** unfinished: a client disconnect, an HTTP/2 reset, a timeout, a server
    ///   that stopped polling it; it ends when dropped, at what it handed on.
    ///
    /// In each case, once per request and at that moment: the concurrency slots are
    /// released; tiers counting response bytes or messages are charged what was handed on,
    /// exactly; tiers counting request bytes or messages, what the handler read of the
    /// request body until then (a request with a valid `Content-Length` was charged it at
    /// admission); tiers counting [`Usage`](crate::Usage), what the handler reported. The
    /// units charged at admission are replaced by these counts (given back where they are
    /// fewer), and a body metered as it streams gives back the unused part of its last grant
    /// when it is dropped (see [`StreamMode`](crate::StreamMode)). A request body that
    /// finishes, is abandoned or is dropped settles nothing itself: what it handed on is
    /// settled when the response body ends, and its grants give back their unused part when
    /// it is dropped. A response whose status gives the charge back settles every such tier
    /// at nothing instead. A request whose handler fails or panics, or that is dropped
    /// before its response, keeps its admission charge, less the tiers metered by grants,
    /// which are charged what streamed.
    pub struct ResponseBody<B> {
        #[pin]
        metered: Metered<Kind<B>>,
    }
}

pin_project! {
    /// The inner service's body, or the bytes of a response the layer made.
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Own { #[pin] body: Full<Bytes> },
    }
}

impl<B: Body<Data = Bytes>> Body for Kind<B> {
    type Data = Bytes;
    type Error = B::Error;

    #[inline]
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project() {
            KindProj::Inner { body } => body.poll_frame(cx),
            KindProj::Own { body } => body.poll_frame(cx).map_err(|never| match never {}),
        }
    }

    #[inline]
    fn is_end_stream(&self) -> bool {
        match self {
            Kind::Inner { body } => body.is_end_stream(),
            Kind::Own { body } => body.is_end_stream(),
        }
    }

    #[inline]
    fn size_hint(&self) -> SizeHint {
        match self {
            Kind::Inner { body } => body.size_hint(),
            Kind::Own { body } => body.size_hint(),
        }
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self { metered: Metered::new(Kind::Inner { body }) }
    }

    pub(crate) fn own(body: Full<Bytes>) -> Self {
        Self { metered: Metered::new(Kind::Own { body }) }
    }

    /// The inner service's body, measured by `meter`.
    pub(crate) fn metered(body: B, meter: Meter) -> Self {
        Self { metered: Metered::with(Kind::Inner { body }, meter) }
    }

    /// One body metered by both layers of a body wrapped twice (nested layers), so that
    /// nesting does not nest types: the outer layer's meter sees what the inner one lets
    /// out, as it did wrapped.
    #[cfg(feature = "config")]
    pub(crate) fn flatten(nested: ResponseBody<ResponseBody<B>>) -> Self {
        let Metered { body: kind, meters: outer } = nested.metered;
        match kind {
            Kind::Inner { body: mut inner } => {
                inner.metered.metered_by(outer);
                inner
            }
            // The outer layer answered in the inner one's place.
            Kind::Own { body } => {
                ResponseBody { metered: Metered { body: Kind::Own { body }, meters: outer } }
            }
        }
    }
}

impl<B> fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.metered.body {
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

    #[inline]
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        self.project().metered.poll_cut(cx)
    }

    #[inline]
    fn is_end_stream(&self) -> bool {
        let Metered { body, meters } = &self.metered;
        match meters.as_deref() {
            None => body.is_end_stream(),
            Some(meters) => end(meters, body),
        }
    }

    #[inline]
    fn size_hint(&self) -> SizeHint {
        let Metered { body, meters } = &self.metered;
        match meters.as_deref() {
            None => body.size_hint(),
            Some(meters) => hint(meters, body),
        }
    }
}

impl<B: Body<Data = Bytes>> Metered<B> {
    /// The next frame of a body whose frames may be cut (a response's), as the outermost
    /// meter lets it out.
    #[inline]
    fn poll_cut(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Polled<Bytes, B::Error> {
        let this = self.project();
        match this.meters.as_deref_mut() {
            None => this.body.poll_frame(cx),
            Some(meters) => poll_metered(meters, this.body, cx),
        }
    }
}

/// The next frame of `body` as the outermost of `meters` lets it out (each meter reads
/// what the ones inside it let out).
fn poll_metered<S>(
    meters: &mut [Meter],
    body: Pin<&mut S>,
    cx: &mut Context<'_>,
) -> Polled<Bytes, S::Error>
where
    S: Body<Data = Bytes>,
{
    let Some((meter, below)) = meters.split_last_mut() else { return body.poll_frame(cx) };
    let mut source = Below { meters: below, body };
    if meter.streams() {
        return poll_streamed(meter, source, cx);
    }
    let frame = source.poll_frame(cx);
    match &frame {
        Poll::Ready(Some(Ok(frame))) => {
            if let Some(data) = frame.data_ref() {
                meter.passed(data.len());
            }
            // The last frame: the response is complete before the frame is handed on, so a
            // client that saw it end finds the slot free.
            if source.is_end_stream() {
                meter.end();
            }
        }
        Poll::Ready(_) => meter.end(),
        Poll::Pending => {}
    }
    frame
}

/// Whether `body`, as the outermost of `meters` lets it out, has ended.
fn end<S: Body>(meters: &[Meter], body: &S) -> bool {
    match meters.split_last() {
        None => body.is_end_stream(),
        // A frame's rest still to send, or stopped by policing.
        Some((meter, below)) if meter.streams() => {
            meter.stopped || (meter.rest.is_empty() && end(below, body))
        }
        Some((_, below)) => end(below, body),
    }
}

/// The size hint of `body` as the outermost of `meters` lets it out.
fn hint<S: Body>(meters: &[Meter], body: &S) -> SizeHint {
    match meters.split_last() {
        None => body.size_hint(),
        Some((meter, below)) if meter.streams() => {
            let rest = meter.rest.len() as u64;
            let inner = hint(below, body);
            let mut hint = SizeHint::new();
            hint.set_lower(inner.lower().saturating_add(rest));
            if let Some(upper) = inner.upper() {
                hint.set_upper(upper.saturating_add(rest));
            }
            hint
        }
        Some((_, below)) => hint(below, body),
    }
}

/// What a meter reads from: the body as the meters inside it let it out.
struct Below<'a, S> {
    meters: &'a mut [Meter],
    body: Pin<&'a mut S>,
}

impl<S: Body<Data = Bytes>> Below<'_, S> {
    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Polled<Bytes, S::Error> {
        poll_metered(self.meters, self.body.as_mut(), cx)
    }

    fn is_end_stream(&self) -> bool {
        end(self.meters, &*self.body)
    }

    fn size_hint(&self) -> SizeHint {
        hint(self.meters, &*self.body)
    }
}

/// A response body metered as it streams: each data frame waits for its grant (cut to what
/// the grant covers, the rest kept for the next call; with message tiers, cut before the
/// prefix of the first message past the grant), and a gRPC response ends with
/// `RESOURCE_EXHAUSTED` trailers when policing stops its request or its response.
fn poll_streamed<S>(
    meter: &mut Meter,
    mut body: Below<'_, S>,
    cx: &mut Context<'_>,
) -> Polled<Bytes, S::Error>
where
    S: Body<Data = Bytes>,
{
    if meter.stopped {
        return Poll::Ready(None);
    }
    if let Some(Poll::Ready(why)) = meter.signal.as_ref().map(|s| s.poll_stopped(cx)) {
        return end_stopped(meter, &why);
    }
    if meter.rest.is_empty() {
        match body.poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) if data.is_empty() => return Poll::Ready(Some(Ok(Frame::data(data)))),
                Ok(data) => meter.rest = data,
                Err(frame) => {
                    if body.is_end_stream() {
                        meter.end();
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
            },
            Poll::Ready(end) => {
                meter.end();
                return Poll::Ready(end);
            }
            Poll::Pending => return Poll::Pending,
        }
    }
    let rest = meter.rest.len() as u64;
    // What may pass: the bytes the byte tiers' grant covers, cut at the message past the
    // message tiers' grant.
    let mut room = rest;
    if let Some(gate) = meter.bytes.as_mut() {
        // Within the grant (most frames): a comparison, no size hint, no poll.
        let mut bytes = gate.ready();
        if bytes == 0 {
            let remaining = body.size_hint().exact().map(|left| left.saturating_add(rest));
            bytes = match gate.poll_room(cx, remaining, rest) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(why)) => return end_stopped(meter, &why),
                Poll::Ready(Ok(bytes)) => bytes,
            };
        }
        room = room.min(bytes);
    }
    // `room` <= `rest`, a `usize`.
    let take = match cut_at_messages(meter, room as usize, cx) {
        Poll::Pending => return Poll::Pending,
        Poll::Ready(Err(why)) => return end_stopped(meter, &why),
        Poll::Ready(Ok(take)) => take,
    };
    let data = if take == meter.rest.len() {
        std::mem::take(&mut meter.rest)
    } else {
        meter.rest.split_to(take)
    };
    if let Some(gate) = meter.bytes.as_mut() {
        gate.spend(data.len() as u64);
    }
    meter.passed(data.len());
    if meter.rest.is_empty() && body.is_end_stream() {
        meter.end();
    }
    Poll::Ready(Some(Ok(Frame::data(data))))
}

/// How much of the first `take` bytes of a response's pending data may pass as its message
/// tiers' grant says: cut at the start of the first message past it (bytes that end no
/// prefix, a payload's rest, pass without a grant). All of them without message tiers.
fn cut_at_messages(
    meter: &mut Meter,
    take: usize,
    cx: &mut Context<'_>,
) -> Poll<Result<usize, Stopped>> {
    let Some((gate, framer)) = meter.messages.as_mut() else { return Poll::Ready(Ok(take)) };
    let window = &meter.rest[..take];
    let mut scan = framer.scan(window, 0);
    if scan.bytes < window.len() {
        // The messages this frame starts: what the grant may cover at once.
        let want = framer.scan(window, u64::MAX).messages.max(1);
        match gate.poll_room(cx, None, want) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Err(why)) => return Poll::Ready(Err(why)),
            Poll::Ready(Ok(messages)) => scan = framer.scan(window, messages),
        }
    }
    *framer = scan.next;
    gate.spend(scan.messages);
    Poll::Ready(Ok(scan.bytes))
}

/// Ends a gRPC response stopped by policing: its trailers say `RESOURCE_EXHAUSTED` (or
/// `UNAVAILABLE`, when failing closed), and the request is settled.
fn end_stopped<E>(meter: &mut Meter, why: &Stopped) -> Polled<Bytes, E> {
    meter.stopped = true;
    meter.rest = Bytes::new();
    let trailers = meter.trailers.as_ref().map(|f| f(why));
    meter.end();
    match trailers {
        Some(trailers) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
        None => Poll::Ready(None),
    }
}
