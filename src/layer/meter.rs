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
    /// tiers are charged by grants, and the unit charged at admission is given back.
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

/// What a response body metered as it streams is handed: its gates, where it hears that
/// policing stopped its request, and how a gRPC response stopped by policing ends.
#[derive(Default)]
pub(crate) struct Streamed {
    /// The response bytes' grants.
    pub(crate) gate: Option<Box<dyn Gate>>,
    /// The response messages' grants (a gRPC call), and where the response stands in its
    /// messages.
    pub(crate) messages: Option<(Box<dyn Gate>, Framer)>,
    /// Where the request body tells that policing stopped it (a gRPC call only).
    pub(crate) signal: Option<Arc<Signal>>,
    /// The trailers of a gRPC response stopped by policing.
    pub(crate) trailers: Option<StopTrailers>,
}

/// What ends a held request when the body observed ends: the hold's finish, the counters
/// read then, and what the response head settled.
struct Settlement {
    finish: Finish,
    counters: Counters,
    /// Settlements decided from the response head (a refund, a settled cost), applied with
    /// the counts.
    from_head: Vec<(Unit, u64)>,
}

/// What one layer observes of one body, request or response: the one type behind
/// [`RequestBody`](super::RequestBody) and [`ResponseBody`](super::ResponseBody). The two
/// sides differ only in what they are handed: a request body's meter gets the gates of its
/// bytes or messages, the stop signal it tells, and the counter its bytes are added to; a
/// response body's meter gets its gates, the stop signal it hears, the trailers of a stopped
/// gRPC call, and the request's hold with its counters ([`Meter::new`]).
///
/// The rule for the end of an observed body, on both sides ([`Meter::end`]):
///
/// - **finished** (the body handed on its last frame, or its end): the meter ends there;
/// - **abandoned** (the inner body yielded an error): the meter ends there too, at what
///   was handed on before the error;
/// - **dropped** unfinished: the meter ends when it is dropped, at what was handed on.
///
/// Ending, once: a meter handed the request's hold settles it (tiers counting response
/// bytes at the bytes handed on, the request's bytes and messages at their counters, reported
/// units at what the handler reported, the tiers metered by grants at nothing) and releases
/// its concurrency slots; a meter without one (a request body's) settles nothing itself: its
/// counts are read by the response's meter when that ends. Its grants (dropped with it) give
/// back the unused part of their last grant.
pub(crate) struct Meter {
    /// Bytes of the data frames handed on.
    passed: u64,
    /// Where the bytes handed on are also added: a request body's bytes, settled by the
    /// response's meter.
    tally: Option<Arc<AtomicU64>>,
    /// The grants of the body's bytes.
    pub(super) bytes: Option<Box<dyn Gate>>,
    /// The grants (or the tally) of the body's gRPC messages, and where it stands in them.
    pub(super) messages: Option<(Box<dyn Gate>, Framer)>,
    /// Where a stop by policing is told (a request body) or heard (a gRPC response).
    pub(super) signal: Option<Arc<Signal>>,
    /// A request body's message tier refused the next grant: the stream stops at its next
    /// message (what comes first may be the end, or the rest of a message already counted).
    pub(super) refused: Option<Stopped>,
    /// A request body's byte tier refused the next grant with nothing owed: the stream stops
    /// at its next data frame (what comes first may be its end).
    pub(super) refused_bytes: Option<Stopped>,
    /// Stopped by policing: nothing more passes.
    pub(super) stopped: bool,
    /// The part of a response's data frame past its grant, handed on when the next grant
    /// comes.
    pub(super) rest: Bytes,
    /// The trailers of a gRPC response stopped by policing.
    pub(super) trailers: Option<StopTrailers>,
    /// The request's hold, ended with the body (a response body's meter only); `None` once
    /// ended.
    settlement: Option<Settlement>,
}

impl fmt::Debug for Meter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Meter").field("passed", &self.passed).finish_non_exhaustive()
    }
}

impl Default for Meter {
    fn default() -> Self {
        Self::ending(None)
    }
}

impl Meter {
    fn ending(settlement: Option<Settlement>) -> Self {
        Self {
            passed: 0,
            tally: None,
            bytes: None,
            messages: None,
            signal: None,
            refused: None,
            refused_bytes: None,
            stopped: false,
            rest: Bytes::new(),
            trailers: None,
            settlement,
        }
    }

    /// A meter that ends the request's hold with `finish`, settling `counters` and what the
    /// response head settled (a response body's).
    pub(super) fn new(finish: Finish, counters: Counters, from_head: Vec<(Unit, u64)>) -> Self {
        Self::ending(Some(Settlement { finish, counters, from_head }))
    }

    /// Meters the response as it streams.
    pub(super) fn streamed(mut self, stream: Streamed) -> Self {
        let Streamed { gate, messages, signal, trailers } = stream;
        self.bytes = gate;
        self.messages = messages;
        self.signal = signal;
        self.trailers = trailers;
        self
    }

    /// Adds the bytes handed on from now on to `counter`.
    pub(super) fn count_into(&mut self, counter: Arc<AtomicU64>) {
        self.tally = Some(counter);
    }

    /// Whether the body is metered as it streams (gated, or its messages counted).
    #[inline]
    pub(super) fn streams(&self) -> bool {
        self.bytes.is_some() || self.signal.is_some() || self.messages.is_some() || self.stopped
    }

    /// Whether the bytes handed on are counted into a counter.
    pub(super) fn counts(&self) -> bool {
        self.tally.is_some()
    }

    /// A data frame of `len` bytes was handed on.
    #[inline]
    pub(super) fn passed(&mut self, len: usize) {
        self.passed = self.passed.saturating_add(len as u64);
        if let Some(tally) = &self.tally {
            tally.fetch_add(len as u64, Ordering::Relaxed);
        }
    }

    /// The body was finished, abandoned or dropped (see [`Meter`]): settle and release, once.
    pub(super) fn end(&mut self) {
        // The grants end with the body: the unused part of each last grant is given back now,
        // not when the body is dropped later.
        let mut gate = self.bytes.take();
        let leased_bytes = gate.is_some();
        // What the grants kept of the units the admission charged (they counted it as paid).
        let kept_admission = gate.as_mut().map_or(0, |g| g.end());
        drop(gate);
        self.messages = None;
        let Some(Settlement { finish, counters, from_head }) = self.settlement.take() else {
            return;
        };
        let mut settled = from_head;
        // A refund from the head settles every unit at 0: counts do not apply.
        let refunded = |unit: Unit| settled.iter().any(|(u, _)| *u == unit);
        let mut counted = Vec::with_capacity(3);
        // A streamed body's bytes were charged by its grants: the unit charged at admission
        // is given back, unless the grants counted it as paid.
        if let Some(bytes) = &counters.request_bytes {
            counted.push((Unit::RequestBytes, bytes.load(Ordering::Relaxed)));
        } else if counters.request_streamed {
            counted.push((Unit::RequestBytes, 0));
        }
        if leased_bytes {
            counted.push((Unit::ResponseBytes, kept_admission));
        } else if counters.response_bytes {
            counted.push((Unit::ResponseBytes, self.passed));
        }
        if let Some(messages) = &counters.request_messages {
            counted.push((Unit::RequestMessages, messages.load(Ordering::Relaxed)));
        }
        if let Some(messages) = &counters.response_messages {
            counted.push((Unit::ResponseMessages, messages.load(Ordering::Relaxed)));
        }
        if let Some(usage) = &counters.usage {
            counted.push((Unit::Reported, usage.reported()));
        }
        counted.retain(|(unit, _)| !refunded(*unit));
        settled.extend(counted);
        finish(&settled);
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        self.end();
    }
}
