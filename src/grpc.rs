//! gRPC: how the layer recognises a gRPC request and what it answers one.
//!
//! A gRPC client reads the outcome of a call from `grpc-status`, not from the HTTP status, and
//! reads the body as length-prefixed messages: an HTTP 429 with a problem+json body reaches a
//! tonic client as `INTERNAL: protocol error`. So when a request is gRPC ([`is_grpc`]), every
//! refusal of the layer is a *trailers-only* response (gRPC over HTTP/2 protocol, "Responses"):
//! HTTP 200, `content-type: application/grpc`, `grpc-status`, a percent-encoded
//! `grpc-message`, `grpc-retry-pushback-ms` (gRFC A6) and the rate-limit headers, with an
//! empty body. See [`RateLimited::to_grpc_response`](crate::RateLimited::to_grpc_response) and
//! [`Rejection::to_grpc_response`](crate::Rejection::to_grpc_response) for the exact fields.
//!
//! gRPC-Web (`application/grpc-web`, `application/grpc-web-text`, ...) is not gRPC here: its
//! clients run in browsers over HTTP/1.1 or HTTP/2 through a proxy that translates the status,
//! so they keep the HTTP 429 with its problem+json body, as any other HTTP request.
//!
//! The keys that matter for gRPC: [`GrpcMethod`](crate::key::GrpcMethod) (one bucket or one
//! policy per `/package.Service/Method`), [`HeaderKey`](crate::key::HeaderKey) for ASCII
//! metadata (an API key in `x-api-key` metadata is that HTTP/2 header), and with the `tonic`
//! feature [`PeerIp`](crate::key::PeerIp) / [`ClientIp`](crate::key::ClientIp) read the peer
//! address from tonic's `TcpConnectInfo`.
//!
//! ```
//! use http::HeaderMap;
//! use tollgate::grpc::is_grpc;
//!
//! let mut headers = HeaderMap::new();
//! headers.insert("content-type", "application/grpc+proto".parse().unwrap());
//! assert!(is_grpc(&headers));
//! headers.insert("content-type", "application/grpc-web+proto".parse().unwrap());
//! assert!(!is_grpc(&headers));
//! ```

use http::{HeaderMap, HeaderName, HeaderValue, header};
use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};

pub(crate) const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
pub(crate) const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
pub(crate) const GRPC_RETRY_PUSHBACK_MS: HeaderName =
    HeaderName::from_static("grpc-retry-pushback-ms");
pub(crate) const APPLICATION_GRPC: HeaderValue = HeaderValue::from_static("application/grpc");

/// The gRPC status codes the layer answers with (`google.rpc.Code`).
pub(crate) mod code {
    pub(crate) const INVALID_ARGUMENT: u8 = 3;
    pub(crate) const PERMISSION_DENIED: u8 = 7;
    pub(crate) const RESOURCE_EXHAUSTED: u8 = 8;
    pub(crate) const UNAVAILABLE: u8 = 14;
    pub(crate) const UNAUTHENTICATED: u8 = 16;
}

/// The `grpc-status` value of `code`, without rendering it per response.
pub(crate) fn status_value(code: u8) -> HeaderValue {
    match code {
        code::INVALID_ARGUMENT => HeaderValue::from_static("3"),
        code::PERMISSION_DENIED => HeaderValue::from_static("7"),
        code::RESOURCE_EXHAUSTED => HeaderValue::from_static("8"),
        code::UNAVAILABLE => HeaderValue::from_static("14"),
        code::UNAUTHENTICATED => HeaderValue::from_static("16"),
        other => HeaderValue::from(u16::from(other)),
    }
}

/// What the gRPC over HTTP/2 protocol requires to be percent-encoded in `grpc-message`: every
/// byte outside `0x20..=0x7E` (non-ASCII bytes are always encoded), and `%` itself.
const MESSAGE: &AsciiSet = &CONTROLS.add(b'%');

/// `text` as a `grpc-message` value: UTF-8, percent-encoded as the gRPC over HTTP/2 protocol
/// specifies ("Percent-Encoded"), so any text is a valid header value.
pub(crate) fn message(text: &str) -> HeaderValue {
    let encoded = utf8_percent_encode(text, MESSAGE).to_string();
    HeaderValue::from_str(&encoded).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// Whether a request with these headers is a gRPC call: its `content-type` is
/// `application/grpc`, or starts with `application/grpc+` (`+proto`, `+json`, ...) or
/// `application/grpc;` (ASCII case-insensitive). gRPC-Web (`application/grpc-web...`) is not.
///
/// The layer answers the refusals of gRPC calls in gRPC form (see the [module docs](self)).
#[must_use]
pub fn is_grpc(headers: &HeaderMap) -> bool {
    const PREFIX: &[u8] = b"application/grpc";
    let Some(value) = headers.get(header::CONTENT_TYPE) else { return false };
    let value = value.as_bytes();
    match value.get(..PREFIX.len()) {
        Some(start) if start.eq_ignore_ascii_case(PREFIX) => {
            matches!(value.get(PREFIX.len()), None | Some(b'+' | b';'))
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_types() {
        let grpc = |ct: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, ct.parse().unwrap());
            is_grpc(&headers)
        };
        assert!(grpc("application/grpc"));
        assert!(grpc("application/grpc+proto"));
        assert!(grpc("Application/GRPC+json"));
        assert!(grpc("application/grpc; charset=utf-8"));
        assert!(!grpc("application/grpc-web"));
        assert!(!grpc("application/grpc-web+proto"));
        assert!(!grpc("application/grpc-web-text"));
        assert!(!grpc("application/grpcx"));
        assert!(!grpc("application/json"));
        assert!(!grpc("application/grp"));
        assert!(!is_grpc(&HeaderMap::new()));
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(message("quota exceeded: 100% used"), "quota exceeded: 100%25 used");
        assert_eq!(message("caf\u{e9}\n"), "caf%C3%A9%0A");
        assert_eq!(message("`api` ~"), "`api` ~");
    }
}
