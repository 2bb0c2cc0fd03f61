//! Byte tiers metered while a body streams ([`StreamMode::Shape`], [`StreamMode::Police`]):
//! grants of bytes taken from the store chunk by chunk, and what a body does when the tier
//! has no room for the next one.

mod gate;
mod grants;
#[cfg(test)]
mod tests;

pub(crate) use gate::{Gate, Signal, Stopped, Tally};
pub(crate) use grants::Grants;

use std::time::Duration;

/// The largest grant of bytes a streamed body takes from the store at once: 64 KiB.
///
/// A body metered with [`StreamMode::Shape`] or [`StreamMode::Police`] asks the store for
/// this many bytes (fewer when the tier's capacity, or the bytes the body has left, are
/// fewer) when it has spent its previous grant: one store call per grant, whatever the size
/// of its frames (two when the store refuses it first: policing, a tier with less than a
/// grant left, asked again for what it has; shaping, a grant with room ahead that does not
/// fit now, asked again for what the body needs; or more than a second of grants reserved
/// ahead, asked again when it is within a second). When the body is dropped (a server drops a
/// body once it ended; or unfinished), one more settles the last grant at what it carried,
/// unless it carried exactly its size.
pub const STREAM_GRANT: u64 = 64 * 1024;

/// The largest grant of messages a gRPC stream takes from the store at once: 16.
///
/// A gRPC call (or a WebSocket metered through `tollgate::ws`, cargo feature `ws`) metered
/// with [`StreamMode::Shape`] or [`StreamMode::Police`] under a tier counting
/// [`Unit::RequestMessages`](crate::Unit::RequestMessages) or
/// [`Unit::ResponseMessages`](crate::Unit::ResponseMessages) asks the store for this many
/// messages (fewer when the tier's capacity is smaller, or, policing, when the tier has
/// fewer left) when it has spent its previous grant: one store call per grant, never one per
/// message. The part of the last grant the stream did not use is given back when it ends.
pub const MESSAGE_GRANT: u64 = 16;

/// How long a shaped grant may be reserved ahead: a grant that would have to wait longer is
/// not reserved, and asked for again when the store says it would fit.
pub(super) const SHAPE_AHEAD: Duration = Duration::from_secs(1);

/// How tiers counting bytes or messages meter what streams, in grants of at most
/// [`STREAM_GRANT`](Self::STREAM_GRANT) bytes or [`MESSAGE_GRANT`](Self::MESSAGE_GRANT)
/// messages. Unless [`on_stream`](crate::RateLimitLayerBuilder::on_stream) says otherwise it
/// follows the layer, [`Police`](Self::Police) when the layer polices and
/// [`Shape`](Self::Shape) when it [shapes](crate::RateLimitLayerBuilder::shape), while
/// [`Settle`](Self::Settle) suits billing-style tiers that charge a body when it ends.
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
/// What streams is a request body whose length was not charged at admission, every response
/// body, and the messages of a gRPC call or a WebSocket. With [`Shape`](Self::Shape) or
/// [`Police`](Self::Police) the body is charged as its frames pass, in grants of at most
/// [`STREAM_GRANT`] bytes (64 KiB) taken from the store when the previous one is spent: one
/// store call per grant, never one per frame. The unit a response's bytes were charged at
/// admission counts as its first byte (given back if it sends none), a request's is given back
/// when its body ends, and so is the part of the last grant a body did not use (dropped
/// unfinished too).
///
/// # The bound
///
/// Over any span of time, the bytes that all the streams of one key let through are at most
/// what the tier admits (for GCRA and the buckets, `burst + rate x elapsed`), plus, per
/// stream, the part of one frame past the end of its grant: a response body is cut to its
/// grant, so it adds nothing; a request body is let through a frame at a time, so each adds
/// less than one frame (hyper's HTTP/2 frames are at most 16 KiB; on HTTP/1 a frame is at most
/// one chunk of a chunked upload and what one read of the connection returned). A request
/// with a valid `Content-Length` is charged it at admission, as in
/// [`Settle`](Self::Settle). A [dry run](crate::RateLimitLayerBuilder::dry_run) meters every
/// body as `Settle` does: it never slows nor stops a stream. A response whose status gives
/// the charge back (a `405`, [`refund_if`](crate::RateLimitLayerBuilder::refund_if)) gives
/// back what was charged at admission; the grants of bytes that did stream stay charged.
/// The store errors of a grant follow
/// [`on_store_error`](crate::RateLimitLayerBuilder::on_store_error): failing open lets the
/// grant through uncharged, failing closed stops the stream as policing does (a plain HTTP
/// response under way is let through).
///
/// # Concurrency, and streams that end early
///
/// A stream paused by shaping is still in flight: the concurrency slots its request took
/// (a [`Concurrency`](crate::Concurrency) tier) stay taken until it ends, so the key's next
/// request may be refused meanwhile. A stream that ends early (stopped by policing, or
/// cancelled: an HTTP/2 stream reset, a connection closed, a response body dropped, a request
/// timeout that drops the handler) gives its slots back at once, on either store, and its
/// tiers are charged exactly what streamed: the unused part of its last grant is given back,
/// and so is the unit a byte tier was charged at admission (a frame read by the layer but
/// never handed to the handler is charged to no tier; a message tier keeps the first message
/// policing charged at admission, as a unary call's). One limit: an HTTP/1.1 upload paused by
/// shaping is not read, so the server cannot see its client go away (TCP delivers the close only after the
/// bytes the connection still holds) until the upload resumes and reads to its end; over
/// HTTP/2, gRPC included, a reset or a closed connection is seen at once. A request timeout
/// outside the layer (for example tower-http's `TimeoutLayer`) bounds how long a vanished
/// HTTP/1.1 client holds its slot.
///
/// # Messages
///
/// Tiers counting [`Unit::RequestMessages`](crate::Unit::RequestMessages) or
/// [`Unit::ResponseMessages`](crate::Unit::ResponseMessages) meter the messages of a gRPC call
/// (and of a WebSocket, through the handler: `tollgate::ws::MessageBudget`, cargo feature
/// `ws`) the same way (a request that is not a gRPC call counts as one message,
/// charged at admission). Each length-prefixed message of the HTTP/2 body counts once, read
/// from its 5-byte prefix (the payload is never decoded, compressed or not; a message split
/// across frames counts once, several in one frame each count), in grants of at most
/// [`MESSAGE_GRANT`] (16) messages: one store call per grant, never one per message.
/// Policing charges the call's first message each way at admission, as a unary call's (so a
/// unary call costs one message each way, and is refused at once when its key has spent the
/// tier); shaping charges none there and lets the first grant wait. Shaping delays the next
/// message: a request frame is not read, a response frame not sent, until the tier has room.
/// Policing stops the stream at the first message past the tier (what the client sees: see
/// [`Police`](Self::Police)). The bound: a response is cut at the start of the first message
/// past its grant, so the messages sent are exactly what the tier admits; a request's frame
/// cannot be cut, and is read when the grant has room for at least one message, so each
/// stream adds at most the messages of one HTTP/2 DATA frame, less one (none when each
/// message comes in a frame of its own). The end of a stream is never refused: a grant
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
    /// Backpressure: when the tier has no room for the next grant, the body's next frame
    /// waits until it has (a request body is then no longer read from the connection, so
    /// the client's flow control slows it; a response body is no longer written, as nginx
    /// `limit_rate` does). A grant is reserved up to 1 s ahead, so concurrent streams of one
    /// key take turns in the order they asked.
    ///
    /// Only flow control stops an HTTP/2 client while its stream is not read, and hyper's
    /// HTTP/2 server ends a connection that holds too many small DATA frames unread (about
    /// half the connection window's worth of framing overhead): when shaping a stream of
    /// small messages sent one per frame, keep the stream window small (for tonic,
    /// `Server::builder().initial_stream_window_size(16 * 1024)`).
    Shape,
    /// The stream is stopped when the tier has no room for its next grant. What the client
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
    /// has room for the grant it refused: near the limit, what the stream needed (its next
    /// frame's bytes, one message); far from it, at most [`STREAM_GRANT`] bytes or
    /// [`MESSAGE_GRANT`] messages.
    Police,
}

impl StreamMode {
    /// The largest grant of bytes a stream takes from the store at once: 64 KiB (see
    /// [`STREAM_GRANT`]).
    pub const STREAM_GRANT: u64 = STREAM_GRANT;

    /// The largest grant of messages a stream takes from the store at once: 16 (see
    /// [`MESSAGE_GRANT`]).
    pub const MESSAGE_GRANT: u64 = MESSAGE_GRANT;

    /// Whether bodies are metered as they stream.
    pub(crate) fn streams(self) -> bool {
        self != Self::Settle
    }
}
