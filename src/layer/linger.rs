//! Refusals answered before the request body is read, as HTTP/1 needs them: the response
//! says `Connection: close`, and the body the client is still sending is read off and
//! discarded for a while (a lingering close, RFC 9112 §9.6), so that closing the connection
//! does not reset it under the client before it has read the refusal.
//!
//! # How it works
//!
//! A server that closes a TCP connection while unread bytes wait in its receive buffer sends
//! a reset, and a client still writing its upload then fails with a broken pipe or a reset,
//! often before it has read the response that came first (hyper's client reports the failed
//! write). Reading the rest of the body off avoids the reset: the layer hands the body to a
//! task that reads and drops its frames until it ends, at most [`LINGER`] after the refusal,
//! as nginx does for the body of a request it refuses (`lingering_time`). Not when the request
//! expects `100 Continue`: a client that waits for it sends no body, and reading the body
//! would ask for it. HTTP/2 needs none of this: hyper ends the refused stream with
//! `RST_STREAM` after the response, and the connection stays.

use std::pin::pin;
use std::task::Poll;
use std::time::Duration;

use http::{HeaderValue, Request, Response, header};
use http_body::Body;

/// The longest a refused request's body is read off and discarded: 30 s, nginx's
/// `lingering_time`.
pub(super) const LINGER: Duration = Duration::from_secs(30);

/// The longest declared body, in bytes, a refusal leaves for the server to read off and keep
/// its connection: hyper's first read buffer (8 KiB), in which a small body sent with its
/// head has arrived.
const DRAINED: u64 = 8 * 1024;

/// `res`, the answer to `req` given without reading its body. When the body is one the server
/// will not read off (an HTTP/1.x body declared longer than [`DRAINED`] bytes or of unknown
/// length), the response says `Connection: close` (a client not told so may send its next
/// request on the connection as it closes), and the body is read off and discarded for at
/// most [`LINGER`] (see the module docs). HTTP/2 streams end on their own; nothing is added.
pub(super) fn refused<B, ResB>(req: Request<B>, mut res: Response<ResB>) -> Response<ResB>
where
    B: Body + Send + 'static,
{
    if unread_body(&req) {
        close(&mut res);
        linger(req);
    }
    res
}

/// Marks `res` as the last response of its connection (`Connection: close`).
pub(super) fn close<B>(res: &mut Response<B>) {
    res.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
}

/// Whether answering `req` without reading its body leaves an HTTP/1.x connection with a body
/// the server will not read off ([`refused`]): a declared length above [`DRAINED`] (or one
/// that is not a number), or `Transfer-Encoding`.
pub(super) fn unread_body<B>(req: &Request<B>) -> bool {
    if req.version() >= http::Version::HTTP_2 {
        return false;
    }
    let headers = req.headers();
    let declared = |v: &HeaderValue| v.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok());
    headers.contains_key(header::TRANSFER_ENCODING)
        || headers
            .get(header::CONTENT_LENGTH)
            .is_some_and(|v| declared(v).is_none_or(|n| n > DRAINED))
}

/// Whether a refused request's body is read off: not when it expects `100 Continue` (a client
/// that waits for it sends no body, and reading would ask for it).
pub(super) fn reads_off<B>(req: &Request<B>) -> bool {
    !req.headers()
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

/// Reads `req`'s body off and drops it, for at most [`LINGER`], on a task of its own; not for
/// a request that expects `100 Continue`, nor without a tokio runtime.
fn linger<B: Body + Send + 'static>(req: Request<B>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
    if !reads_off(&req) {
        return;
    }
    let body = req.into_body();
    runtime.spawn(async move {
        let mut body = pin!(body);
        // Frames are dropped as they come: nothing of the body's types is held across a wait.
        let read_off = std::future::poll_fn(move |cx| {
            loop {
                match body.as_mut().poll_frame(cx) {
                    Poll::Ready(Some(Ok(_))) => {}
                    Poll::Ready(_) => return Poll::Ready(()),
                    Poll::Pending => return Poll::Pending,
                }
            }
        });
        let _ = tokio::time::timeout(LINGER, read_off).await;
    });
}
