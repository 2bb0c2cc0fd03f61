//! [`RequestBody`]: the request body the inner service receives, counted as it streams;
//! [`ResponseBody`]: the inner service's body, or the bytes of a response the layer made.

use std::fmt;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project_lite::pin_project;
use smallvec::SmallVec;

use super::messages::Framer;
use super::meter::Meter;
use super::stream::{Gate, Signal, Stopped};

pin_project! {
    /// The request body that the service inside [`RateLimit`](crate::RateLimit) (and
    /// [`Limits`](crate::config::Limits)) receives: the request's own body `B`, whatever its
    /// type (hyper's `Incoming`, axum's `Body`, tonic's `Body`, `http_body_util::Limited<_>`,
    /// a boxed body, a user's own), with its frames, errors, end and size hint passed through
    /// unchanged.
    ///
    /// Under a policy with a tier counting [`Unit::RequestBytes`](crate::Unit::RequestBytes),
    /// a request without a valid `Content-Length` is charged the bytes of the data frames that
    /// pass through this body as the handler reads them (settled once, when the response body
    /// finishes or is abandoned: see [`ResponseBody`]); a request with one is charged its
    /// `Content-Length` at admission. No other work is done
    /// per frame, and nothing is allocated for a request that is not counted. Under a layer
    /// metering streams ([`StreamMode::Shape`](crate::StreamMode::Shape),
    /// [`Police`](crate::StreamMode::Police)), the next frame of such a body waits for the
    /// tier's next lease: its frames, errors and end are still the body's own, delivered
    /// later, and a body stopped by policing yields nothing more (the layer answers in the
    /// handler's place). Under tiers counting [`Unit::RequestMessages`](crate::Unit), the
    /// gRPC messages of a call's body are counted from their 5-byte prefixes as the frames
    /// pass (read in place, never copied nor decoded), and metered the same way.
    ///
    /// With a body-size limit, put tower-http's `RequestBodyLimitLayer` outside the rate limit
    /// in the same `ServiceBuilder` (`ServiceBuilder::new().layer(limit).layer(rate_limit)`),
    /// or use axum's `DefaultBodyLimit`: an upload over the limit then gets 413 and is charged
    /// the bytes read (up to the limit and the frame that crossed it). A separate
    /// `Router::layer` call between the two boxes the body once more, and axum's extractors
    /// look for a length-limit error through two such boxes only (answering 400 beyond).
    ///
    /// axum's and tonic's routers take any body type, so nothing changes for them. A plain
    /// hyper handler behind the layer names this type:
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
    pub struct RequestBody<B> {
        #[pin]
        inner: B,
        // Where the bytes of data frames are added: one counter per layer counting them.
        counters: SmallVec<[Arc<AtomicU64>; 1]>,
        // The leases of the layers metering the body as it streams; `None` (one pointer, no
        // allocation) for every other request.
        gates: Option<Box<SmallVec<[Gated; 1]>>>,
    }
}

/// One layer's leases on a request body, and where a stop by policing is told.
pub(crate) struct Gated {
    gate: Box<dyn Gate>,
    signal: Arc<Signal>,
    stopped: bool,
    /// Counting gRPC messages rather than bytes: where the body stands in its messages.
    framer: Option<Framer>,
    /// Policing messages: the tier refused the next lease; the stream stops at its next
    /// message.
    refused: Option<Stopped>,
}

impl<B> RequestBody<B> {
    /// `body`, counted by no one (until a layer counts it).
    pub fn new(body: B) -> Self {
        Self { inner: body, counters: SmallVec::new(), gates: None }
    }

    /// The request's own body.
    pub fn get_ref(&self) -> &B {
        &self.inner
    }

    /// The request's own body, mutably.
    pub fn get_mut(&mut self) -> &mut B {
        &mut self.inner
    }

    /// The request's own body; what it yields from now on is not counted.
    pub fn into_inner(self) -> B {
        self.inner
    }

    /// Adds the bytes of every data frame from now on to `counter`.
    pub(crate) fn count_into(&mut self, counter: Arc<AtomicU64>) {
        self.counters.push(counter);
    }

    /// Meters the data frames from now on with `gate`, telling `signal` when policing stops
    /// the body.
    pub(crate) fn gate(&mut self, gate: Box<dyn Gate>, signal: Arc<Signal>) {
        let gated = Gated { gate, signal, stopped: false, framer: None, refused: None };
        self.gates.get_or_insert_with(Box::default).push(gated);
    }

    /// Meters the gRPC messages of the data frames from now on with `gate` (a lease of
    /// messages), telling `signal` when policing stops the body.
    pub(crate) fn gate_messages(&mut self, gate: Box<dyn Gate>, signal: Arc<Signal>) {
        let framer = Some(Framer::default());
        let gated = Gated { gate, signal, stopped: false, framer, refused: None };
        self.gates.get_or_insert_with(Box::default).push(gated);
    }

    /// One body counted by both layers of a body wrapped twice (nested layers), so that
    /// nesting does not nest types.
    #[cfg(feature = "config")]
    pub(crate) fn flatten(nested: RequestBody<RequestBody<B>>) -> Self {
        let RequestBody { inner: mut body, counters, gates } = nested;
        body.counters.extend(counters);
        if let Some(gates) = gates {
            body.gates.get_or_insert_with(Box::default).extend(*gates);
        }
        body
    }
}

impl<B: Default> Default for RequestBody<B> {
    fn default() -> Self {
        Self::new(B::default())
    }
}

impl<B> fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestBody")
            .field("counted", &!self.counters.is_empty())
            .field("streamed", &self.gates.is_some())
            .finish()
    }
}

impl<B: Body> Body for RequestBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.project();
        if let Some(gates) = this.gates.as_deref_mut() {
            if !this.inner.is_end_stream() {
                for gated in gates.iter_mut() {
                    // Stopped by policing: nothing more is read (the layer answers, or ends a
                    // gRPC response, in the handler's place).
                    if gated.stopped {
                        return Poll::Pending;
                    }
                    // Messages: a refused lease stops the stream at the next message only
                    // (what comes first may be the end of the stream, or the rest of a
                    // message already counted).
                    if gated.refused.is_some() {
                        continue;
                    }
                    // Within the lease: nothing to poll.
                    if gated.gate.ready() > 0 {
                        continue;
                    }
                    let remaining =
                        if gated.framer.is_some() { None } else { this.inner.size_hint().exact() };
                    match gated.gate.poll_room(cx, remaining) {
                        Poll::Ready(Ok(_)) => {}
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Err(why)) if gated.framer.is_some() => {
                            gated.refused = Some(why);
                        }
                        Poll::Ready(Err(why)) => {
                            gated.stopped = true;
                            gated.signal.stop(why);
                            return Poll::Pending;
                        }
                    }
                }
            }
        }
        let frame = this.inner.poll_frame(cx);
        if let (Some(gates), Poll::Ready(Some(Ok(frame)))) = (this.gates.as_deref_mut(), &frame) {
            if let Some(data) = frame.data_ref() {
                let len = bytes::Buf::remaining(data) as u64;
                // What each gate spends: the messages the frame starts, or its bytes. Counted
                // before any is spent: a frame that does not reach the handler is charged to
                // no tier.
                let mut spent: SmallVec<[u64; 2]> = SmallVec::new();
                for gated in gates.iter_mut() {
                    let Some(framer) = &mut gated.framer else {
                        spent.push(len);
                        continue;
                    };
                    let messages = framer.count(data);
                    match gated.refused.take() {
                        // A message the tier had no room for: the stream stops before it.
                        Some(why) if messages > 0 => {
                            gated.stopped = true;
                            gated.signal.stop(why);
                            return Poll::Pending;
                        }
                        refused => gated.refused = refused,
                    }
                    spent.push(messages);
                }
                for (gated, spent) in gates.iter_mut().zip(spent) {
                    gated.gate.spend(spent);
                }
            }
        }
        if !this.counters.is_empty() {
            if let Poll::Ready(Some(Ok(frame))) = &frame {
                if let Some(data) = frame.data_ref() {
                    let len = bytes::Buf::remaining(data) as u64;
                    for counter in this.counters.iter() {
                        counter.fetch_add(len, Ordering::Relaxed);
                    }
                }
            }
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project! {
    /// The response body of [`RateLimit`](crate::RateLimit) (and of
    /// [`Limits`](crate::config::Limits)): the inner service's body `B` unchanged, or the
    /// bytes of a response the layer made itself (a 429, a 503, a 400). No boxing either way,
    /// however many layers limited the request.
    ///
    /// Under a policy with concurrency tiers or tiers counting bytes, messages or reported
    /// units, the body also ends the request's hold, by one rule for every layer that meters
    /// it (and for the request's body, counted with it):
    ///
    /// - **Finished**: the body handed on its last frame (a data frame after which it
    ///   reports [`is_end_stream`](Body::is_end_stream), so that a client that saw the end
    ///   finds the slot free; or its end), or an error, which ends it there.
    /// - **Abandoned**: the body was dropped before it finished (a client disconnect, an
    ///   HTTP/2 reset, a timeout, a server that stopped polling it).
    ///
    /// Either way, once per request and at that moment: the concurrency slots are released;
    /// tiers counting response bytes or messages are charged what was handed on, exactly;
    /// tiers counting request bytes or messages, what the handler read of the request body
    /// until then (a request with a valid `Content-Length` was charged it at admission);
    /// tiers counting [`Usage`](crate::Usage), what the handler reported. The units charged
    /// at admission are replaced by these counts (given back where they are fewer), and a
    /// body metered as it streams gives back the unused part of its last lease (see
    /// [`StreamMode`](crate::StreamMode)). A response whose status gives the charge back
    /// settles every such tier at nothing instead. A request whose handler fails or panics,
    /// or that is dropped before its response, keeps its admission charge, less the tiers
    /// metered by leases, which are charged what streamed.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
        // What each layer that meters the response measures, innermost first: each sees the
        // frames as the layers inside it let them out. `None` (one pointer, no allocation)
        // for a response nothing meters.
        meters: Option<Box<Meters>>,
    }
}

/// The meters of one response body, innermost first.
type Meters = SmallVec<[Meter; 1]>;

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Inner { #[pin] body: B },
        Own { #[pin] body: Full<Bytes> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self { kind: Kind::Inner { body }, meters: None }
    }

    pub(crate) fn own(body: Full<Bytes>) -> Self {
        Self { kind: Kind::Own { body }, meters: None }
    }

    /// The inner service's body, measured by `meter`.
    pub(crate) fn metered(body: B, meter: Meter) -> Self {
        let mut meters = Meters::new();
        meters.push(meter);
        Self { kind: Kind::Inner { body }, meters: Some(Box::new(meters)) }
    }

    /// One body metered by both layers of a body wrapped twice (nested layers), so that
    /// nesting does not nest types: the outer layer's meter sees what the inner one lets
    /// out, as it did wrapped.
    #[cfg(feature = "config")]
    pub(crate) fn flatten(nested: ResponseBody<ResponseBody<B>>) -> Self {
        let ResponseBody { kind, meters: outer } = nested;
        match kind {
            Kind::Inner { body: mut inner } => {
                if let Some(outer) = outer {
                    inner.meters.get_or_insert_with(Box::default).extend(*outer);
                }
                inner
            }
            // The outer layer answered in the inner one's place.
            Kind::Own { body } => ResponseBody { kind: Kind::Own { body }, meters: outer },
        }
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
        match (this.kind.project(), this.meters.as_deref_mut()) {
            (KindProj::Inner { body }, None) => body.poll_frame(cx),
            (KindProj::Inner { body }, Some(meters)) => poll_metered(meters, body, cx),
            (KindProj::Own { body }, None) => body.poll_frame(cx).map_err(|never| match never {}),
            (KindProj::Own { body }, Some(meters)) => {
                poll_metered(meters, body, cx).map_err(|never| match never {})
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match (&self.kind, self.meters.as_deref()) {
            (Kind::Inner { body }, None) => body.is_end_stream(),
            (Kind::Inner { body }, Some(meters)) => end(meters, body),
            (Kind::Own { body }, None) => body.is_end_stream(),
            (Kind::Own { body }, Some(meters)) => end(meters, body),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.kind, self.meters.as_deref()) {
            (Kind::Inner { body }, None) => body.size_hint(),
            (Kind::Inner { body }, Some(meters)) => hint(meters, body),
            (Kind::Own { body }, None) => body.size_hint(),
            (Kind::Own { body }, Some(meters)) => hint(meters, body),
        }
    }
}

/// The next frame of `body` as the outermost of `meters` lets it out (each meter reads
/// what the ones inside it let out).
fn poll_metered<S>(
    meters: &mut [Meter],
    body: Pin<&mut S>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, S::Error>>>
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
                meter.sent(data.len());
            }
            // The last frame: the response is complete before the frame is handed on, so a
            // client that saw it end finds the slot free.
            if source.is_end_stream() {
                meter.done();
            }
        }
        Poll::Ready(_) => meter.done(),
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
            meter.stream.ended || (meter.stream.rest.is_empty() && end(below, body))
        }
        Some((_, below)) => end(below, body),
    }
}

/// The size hint of `body` as the outermost of `meters` lets it out.
fn hint<S: Body>(meters: &[Meter], body: &S) -> SizeHint {
    match meters.split_last() {
        None => body.size_hint(),
        Some((meter, below)) if meter.streams() => {
            let rest = meter.stream.rest.len() as u64;
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
    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, S::Error>>> {
        poll_metered(self.meters, self.body.as_mut(), cx)
    }

    fn is_end_stream(&self) -> bool {
        end(self.meters, &*self.body)
    }

    fn size_hint(&self) -> SizeHint {
        hint(self.meters, &*self.body)
    }
}

/// A response body metered as it streams: each data frame waits for its lease (cut to what
/// the lease covers, the rest kept for the next call; with message tiers, cut before the
/// prefix of the first message past the lease), and a gRPC response ends with
/// `RESOURCE_EXHAUSTED` trailers when policing stops its request or its response.
fn poll_streamed<S>(
    meter: &mut Meter,
    mut body: Below<'_, S>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<Frame<Bytes>, S::Error>>>
where
    S: Body<Data = Bytes>,
{
    if meter.stream.ended {
        return Poll::Ready(None);
    }
    if let Some(Poll::Ready(why)) = meter.stream.signal.as_ref().map(|s| s.poll_stopped(cx)) {
        return end_stopped(meter, &why);
    }
    if meter.stream.rest.is_empty() {
        match body.poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) if data.is_empty() => return Poll::Ready(Some(Ok(Frame::data(data)))),
                Ok(data) => meter.stream.rest = data,
                Err(frame) => {
                    if body.is_end_stream() {
                        meter.done();
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
            },
            Poll::Ready(end) => {
                meter.done();
                return Poll::Ready(end);
            }
            Poll::Pending => return Poll::Pending,
        }
    }
    let rest = meter.stream.rest.len() as u64;
    // What may pass: the bytes the byte tiers' lease covers, cut at the message past the
    // message tiers' lease.
    let mut room = rest;
    if let Some(gate) = meter.stream.gate.as_mut() {
        // Within the lease (most frames): a comparison, no size hint, no poll.
        let mut bytes = gate.ready();
        if bytes == 0 {
            let remaining = body.size_hint().exact().map(|left| left.saturating_add(rest));
            bytes = match gate.poll_room(cx, remaining) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(why)) => return end_stopped(meter, &why),
                Poll::Ready(Ok(bytes)) => bytes,
            };
        }
        room = room.min(bytes);
    }
    // `room` <= `rest`, a `usize`.
    let mut take = room as usize;
    if let Some((gate, framer)) = meter.stream.messages.as_mut() {
        let window = &meter.stream.rest[..take];
        // Bytes that end no prefix (a payload's rest) pass without a lease.
        let mut scan = framer.scan(window, 0);
        if scan.bytes < window.len() {
            match gate.poll_room(cx, None) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(why)) => return end_stopped(meter, &why),
                Poll::Ready(Ok(messages)) => scan = framer.scan(window, messages),
            }
        }
        *framer = scan.next;
        gate.spend(scan.messages);
        take = scan.bytes;
    }
    let data = if take == meter.stream.rest.len() {
        std::mem::take(&mut meter.stream.rest)
    } else {
        meter.stream.rest.split_to(take)
    };
    if let Some(gate) = meter.stream.gate.as_mut() {
        gate.spend(data.len() as u64);
    }
    meter.sent(data.len());
    if meter.stream.rest.is_empty() && body.is_end_stream() {
        meter.done();
    }
    Poll::Ready(Some(Ok(Frame::data(data))))
}

/// Ends a gRPC response stopped by policing: its trailers say `RESOURCE_EXHAUSTED` (or
/// `UNAVAILABLE`, when failing closed), and the request is settled.
fn end_stopped<E>(meter: &mut Meter, why: &Stopped) -> Poll<Option<Result<Frame<Bytes>, E>>> {
    meter.stream.ended = true;
    meter.stream.rest = Bytes::new();
    let trailers = meter.stream.trailers.as_ref().map(|f| f(why));
    meter.done();
    match trailers {
        Some(trailers) => Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
        None => Poll::Ready(None),
    }
}
