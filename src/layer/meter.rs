//! What the layer measures while a request runs under a policy with concurrency tiers or tiers
//! counting something other than requests: the slots it holds, the request bytes that stream
//! in, the response bytes that stream out, and the units the handler reports ([`Usage`]).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::{Extensions, HeaderMap};

use super::messages::Framer;
use super::stream::{Gate, Signal, Stopped};
use crate::key::RequestHead;
use crate::policy::Policy;
use crate::quota::{TierKind, Unit};

/// Units a handler reports for the request it serves, for a policy's tiers counting
/// [`Unit::Reported`] (for example the tokens an LLM call used). The layer puts one in the
/// request's extensions when the policy has such a tier, charges one unit at admission, and
/// settles the tier at the total reported when the response body ends.
///
/// ```
/// use axum::{Extension, Router, routing::post};
/// use tollgate::{Policy, Quota, RateLimitLayer, Unit, Usage};
///
/// # fn main() -> Result<(), tollgate::ConfigError> {
/// let policy = Policy::builder("llm")
///     .tier("requests", Quota::per_minute(60))
///     .tier("tokens", Quota::per_minute(100_000).counting(Unit::Reported))
///     .build()?;
/// let app: Router = Router::new()
///     .route("/complete", post(|Extension(usage): Extension<Usage>| async move {
///         let tokens_used = 1_234; // what the model reports
///         usage.report(tokens_used);
///         "done"
///     }))
///     .route_layer(RateLimitLayer::builder(policy).build()?);
/// # let _ = app;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Default)]
pub struct Usage(Arc<AtomicU64>);

impl Usage {
    /// Adds `units` to what this request used (saturating at `u64::MAX`).
    pub fn report(&self, units: u64) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| Some(u.saturating_add(units)));
    }

    /// The units reported so far.
    #[must_use]
    pub fn reported(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// What a policy needs measured, decided from its tiers once, when the layer is built.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Needs {
    /// Concurrency slots to hold until the response ends.
    slots: bool,
    request_bytes: bool,
    response_bytes: bool,
    request_messages: bool,
    response_messages: bool,
    reported: bool,
}

impl Needs {
    pub(super) fn of(policy: &Policy) -> Self {
        let mut needs = Self::default();
        if policy.is_plain() {
            return needs;
        }
        for tier in policy.tiers() {
            match (tier.kind(), tier.unit()) {
                (TierKind::Concurrency, _) => needs.slots = true,
                (_, Unit::RequestBytes) => needs.request_bytes = true,
                (_, Unit::ResponseBytes) => needs.response_bytes = true,
                (_, Unit::Reported) => needs.reported = true,
                (_, Unit::RequestMessages) => needs.request_messages = true,
                (_, Unit::ResponseMessages) => needs.response_messages = true,
                (_, _) => {}
            }
        }
        needs
    }

    /// Whether the request must be held (and its reservation kept) until its response ends.
    pub(super) fn any(self) -> bool {
        self.slots
            || self.request_bytes
            || self.response_bytes
            || self.request_messages
            || self.response_messages
            || self.reported
    }

    /// Whether some tier counts request bytes.
    pub(super) fn request_bytes(self) -> bool {
        self.request_bytes
    }

    /// Whether some tier counts response bytes.
    pub(super) fn response_bytes(self) -> bool {
        self.response_bytes
    }

    /// Whether the policy has concurrency slots to hold (an upgraded socket holds them).
    #[cfg(feature = "ws")]
    pub(super) fn slots(self) -> bool {
        self.slots
    }

    /// Whether some tier counts request messages.
    pub(super) fn request_messages(self) -> bool {
        self.request_messages
    }

    /// Whether some tier counts response messages.
    pub(super) fn response_messages(self) -> bool {
        self.response_messages
    }
}

/// The request's `Content-Length`, when it has exactly one valid one.
pub(super) fn content_length(head: &RequestHead<'_>) -> Option<u64> {
    let mut values = head.headers.get_all(http::header::CONTENT_LENGTH).iter();
    match (values.next(), values.next()) {
        (Some(v), None) => v.to_str().ok()?.trim().parse().ok(),
        _ => None,
    }
}

/// The counters of one request, filled while it runs and read when its response ends.
#[derive(Default)]
pub(super) struct Counters {
    /// Request bytes counted as the body streams (when its length was not known up front).
    request_bytes: Option<Arc<AtomicU64>>,
    /// Counting response bytes.
    response_bytes: bool,
    usage: Option<Usage>,
    /// The request body is metered as it streams ([`StreamMode`](super::StreamMode)): its
    /// tiers are charged by leases, and the unit charged at admission is given back.
    request_streamed: bool,
    /// The messages of a gRPC call counted as its bodies stream, under
    /// [`StreamMode::Settle`](super::StreamMode::Settle): settled when the response ends.
    pub(super) request_messages: Option<Arc<AtomicU64>>,
    pub(super) response_messages: Option<Arc<AtomicU64>>,
}

impl Counters {
    /// Prepares the counters `needs` asks for: puts a [`Usage`] in the request's extensions
    /// and, for a body of unknown length that is not metered as it streams (`streamed`),
    /// a counter of its bytes, which the caller hands to the body
    /// ([`request_bytes`](Self::request_bytes)).
    pub(super) fn install(
        needs: Needs,
        extensions: &mut Extensions,
        length_known: bool,
        streamed: bool,
    ) -> Self {
        let mut counters = Self { response_bytes: needs.response_bytes, ..Self::default() };
        if needs.reported {
            let usage = Usage::default();
            extensions.insert(usage.clone());
            counters.usage = Some(usage);
        }
        if streamed {
            counters.request_streamed = true;
        } else if needs.request_bytes && !length_known {
            counters.request_bytes = Some(Arc::new(AtomicU64::new(0)));
        }
        counters
    }

    /// The counter the request body adds its bytes to, when they are counted as it streams.
    pub(super) fn request_bytes(&self) -> Option<Arc<AtomicU64>> {
        self.request_bytes.clone()
    }
}

/// Ends a held request: settles what was counted and releases its slots (a type-erased
/// [`Held::finish`](crate::limiter::Held::finish)).
pub(super) type Finish = Box<dyn FnOnce(&[(Unit, u64)]) + Send>;

/// Renders the trailers that end a gRPC response stopped by policing.
pub(super) type StopTrailers = Box<dyn Fn(&Stopped) -> HeaderMap + Send>;

/// What a response body metered as it streams needs.
#[derive(Default)]
pub(crate) struct Streamed {
    /// The response bytes' leases.
    pub(crate) gate: Option<Box<dyn Gate>>,
    /// The response messages' leases (a gRPC call), and where the response stands in its
    /// messages.
    pub(crate) messages: Option<(Box<dyn Gate>, Framer)>,
    /// Where the request body tells that policing stopped it (a gRPC call only).
    pub(crate) signal: Option<Arc<Signal>>,
    /// The trailers of a gRPC response stopped by policing.
    pub(crate) trailers: Option<StopTrailers>,
    /// The part of a data frame past its lease, handed on when the next lease comes.
    pub(crate) rest: Bytes,
    /// Stopped: nothing more is sent.
    pub(crate) ended: bool,
}

/// The measuring part of a response body: counts response bytes, and when the body ends or is
/// dropped (a client disconnect), settles the request's counted units and releases its slots.
pub(crate) struct Meter {
    finish: Option<Finish>,
    counters: Counters,
    pub(crate) stream: Streamed,
    /// Response bytes so far.
    sent: u64,
    /// Settlements decided from the response head (a refund, a settled cost), applied with
    /// the counts.
    from_head: Vec<(Unit, u64)>,
}

impl fmt::Debug for Meter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Meter").field("sent", &self.sent).finish_non_exhaustive()
    }
}

impl Meter {
    pub(super) fn new(finish: Finish, counters: Counters, from_head: Vec<(Unit, u64)>) -> Self {
        Self { finish: Some(finish), counters, sent: 0, from_head, stream: Streamed::default() }
    }

    /// Meters the response as it streams.
    pub(super) fn streamed(mut self, stream: Streamed) -> Self {
        self.stream = stream;
        self
    }

    /// Whether the response is metered as it streams.
    #[inline]
    pub(super) fn streams(&self) -> bool {
        self.stream.gate.is_some() || self.stream.signal.is_some() || self.stream.messages.is_some()
    }

    /// A data frame of `len` bytes went out.
    #[inline]
    pub(super) fn sent(&mut self, len: usize) {
        self.sent = self.sent.saturating_add(len as u64);
    }

    /// The response ended (or was abandoned): settle and release, once.
    pub(super) fn done(&mut self) {
        let Some(finish) = self.finish.take() else { return };
        let mut settled = std::mem::take(&mut self.from_head);
        // A refund from the head settles every unit at 0: counts do not apply.
        let refunded = |unit: Unit| settled.iter().any(|(u, _)| *u == unit);
        let mut counted = Vec::with_capacity(3);
        // A streamed body's bytes were charged by its leases: the unit charged at admission
        // is given back.
        if let Some(bytes) = &self.counters.request_bytes {
            counted.push((Unit::RequestBytes, bytes.load(Ordering::Relaxed)));
        } else if self.counters.request_streamed {
            counted.push((Unit::RequestBytes, 0));
        }
        if self.stream.gate.is_some() {
            counted.push((Unit::ResponseBytes, 0));
        } else if self.counters.response_bytes {
            counted.push((Unit::ResponseBytes, self.sent));
        }
        if let Some(messages) = &self.counters.request_messages {
            counted.push((Unit::RequestMessages, messages.load(Ordering::Relaxed)));
        }
        if let Some(messages) = &self.counters.response_messages {
            counted.push((Unit::ResponseMessages, messages.load(Ordering::Relaxed)));
        }
        if let Some(usage) = &self.counters.usage {
            counted.push((Unit::Reported, usage.reported()));
        }
        counted.retain(|(unit, _)| !refunded(*unit));
        settled.extend(counted);
        finish(&settled);
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        self.done();
    }
}
