//! Serving an admitted request whose policy meters something while it runs: concurrency slots
//! held, bytes or messages counted or granted as they stream, units reported.

use super::meter::Needs;
use crate::limiter::Limiter;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::task::Poll;

use http::{Request, Response};
use smallvec::SmallVec;
use tower_service::Service;

use super::body::{RequestBody, ResponseBody};
use super::linger::{LINGER, close, reads_off, unread_body};
use super::messages::Framer;
use super::meter::{Counters, Finish, Meter, StopTrailers, Streamed};
use super::plan::Demand;
use super::serve::settled_by_head;
use super::service::{Carry, Metered};
use super::stream::{Gate, Grants, Signal, Stopped, StreamMode, Tally};
use super::{Config, OnStoreError};
use crate::headers::PreparedHeaders;
use crate::key::{Key, KeyExtractor};
use crate::limiter::{Held, Reservation};
use crate::quota::Unit;
use crate::store::Store;

/// Serves an admitted request whose policy meters something while it runs: concurrency slots
/// held, bytes or messages counted or granted as they stream, units reported.
#[allow(clippy::too_many_arguments)]
pub(super) async fn serve_metered<S, K, St, ReqB, ResB>(
    config: Arc<Config<K, St>>,
    (policy, collect): (usize, bool),
    mut inner: S,
    mut req: Request<RequestBody<ReqB>>,
    (key, demand): (Key, Demand),
    reservation: Reservation<St>,
    headers: PreparedHeaders,
) -> Result<Response<ResponseBody<ResB>>, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + 'static,
    S::Future: Send,
    S::Error: Send,
    K: KeyExtractor,
    St: Store,
    ReqB: http_body::Body + Send + 'static,
    ResB: Send + 'static,
{
    let grpc = demand.grpc(req.headers());
    let metering = Metering::new(&config, (policy, grpc), &key, &demand);
    let requested = metering.request(&mut req);
    // Held while the handler runs and its response streams: its concurrency slots (leases
    // refreshed on a shared store), and the units counted on the way. A handler that fails or
    // panics, or a client that disconnects, drops the hold: the slots are released and the
    // estimates kept.
    let held =
        Holding { held: Some(reservation.hold()), settled: requested.streamed_units.clone() };
    #[cfg(feature = "ws")]
    let (held, linger) = metering.socket(&mut req, held);
    // Policing that stops an upload answers without reading the rest of it.
    let closes = requested.signal.is_some() && unread_body(&req);
    let signal = requested.signal.clone();
    if let (Some(signal), true) = (&signal, closes && reads_off(&req)) {
        signal.linger();
    }
    let res = match raced(inner.call(req), signal.as_ref()).await {
        Ok(res) => res?,
        Err(why) => {
            held.finish();
            let res = config.stopped(metering.limiter, &key, why, (grpc, collect));
            let mut res = res.map(<Metered as Carry<ReqB, ResB>>::refusal);
            if closes {
                close(&mut res);
            }
            return Ok(res);
        }
    };
    // A socket nothing meters would let every message through: an upgrade whose handler did
    // not take its budget is refused (500), logged once and counted.
    #[cfg(feature = "ws")]
    if let Some(refused) = metering.unmetered_upgrade(&res, linger.as_deref()) {
        return Ok(refused.map(<Metered as Carry<ReqB, ResB>>::refusal));
    }
    let (mut head, body) = res.into_parts();
    headers.apply_parts(&mut head);
    let finish = held.into_finish();
    // An upgraded socket's request ends with the socket: the response's end only settles.
    #[cfg(feature = "ws")]
    let finish = match linger {
        Some(linger) => Box::new(move |settled: &[(Unit, u64)]| linger.ended(settled)) as Finish,
        None => finish,
    };
    let meter = metering.response(&head, finish, requested);
    Ok(Response::from_parts(head, ResponseBody::metered(body, meter)))
}

/// The inner service's response, or why policing stopped the request's upload first (the
/// handler may still be reading it: the layer then answers in its place). An HTTP/1 upload
/// stopped so has the rest of its body read off and dropped (as a refusal at admission has:
/// see `layer::linger`): the handler is kept on a task of its own, seeing nothing more, until
/// the body ended or [`LINGER`] passed.
async fn raced<F>(call: F, signal: Option<&Arc<Signal>>) -> Result<F::Output, Stopped>
where
    F: Future + Send + 'static,
{
    let Some(signal) = signal else { return Ok(call.await) };
    let mut call = Box::pin(call);
    let stopped = std::future::poll_fn(|cx| {
        if let Poll::Ready(res) = call.as_mut().poll(cx) {
            return Poll::Ready(Ok(res));
        }
        signal.poll_stopped(cx).map(Err)
    })
    .await;
    if stopped.is_err() && signal.lingers() {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let signal = Arc::clone(signal);
            runtime.spawn(async move {
                let drained = std::future::poll_fn(|cx| {
                    let done = call.as_mut().poll(cx).is_ready();
                    if done || signal.poll_drained(cx).is_ready() {
                        return Poll::Ready(());
                    }
                    Poll::Pending
                });
                let _ = tokio::time::timeout(LINGER, drained).await;
            });
        }
    }
    stopped
}

/// How one admitted request of a metered policy is metered: its policy, key, class and mode.
struct Metering<'a, K, St: Store> {
    config: &'a Arc<Config<K, St>>,
    policy: usize,
    limiter: &'a Limiter<St>,
    key: &'a Key,
    demand: &'a Demand,
    needs: Needs,
    /// Whether the request is a gRPC call.
    grpc: bool,
    /// A dry run never stops nor slows a stream: its bodies are settled when they end.
    mode: StreamMode,
    fail_open: bool,
    /// A gRPC call's messages are metered as they stream. Policing charged the first message
    /// each way at admission (as for a unary call); shaping charged none.
    prepaid: u64,
}

/// What metering the request left for its response: the counters, where policing tells that
/// it stopped the upload, the messages tallied under `Settle`, and the tiers metered by grants
/// (settled at nothing, the grants having charged what streamed).
struct Requested {
    counters: Counters,
    signal: Option<Arc<Signal>>,
    response_tally: Option<Streamed>,
    streamed_units: SmallVec<[(Unit, u64); 2]>,
}

impl<'a, K: KeyExtractor, St: Store> Metering<'a, K, St> {
    fn new(
        config: &'a Arc<Config<K, St>>,
        (policy, grpc): (usize, bool),
        key: &'a Key,
        demand: &'a Demand,
    ) -> Self {
        let settings = &config.settings;
        let mode = if settings.dry_run { StreamMode::Settle } else { settings.stream() };
        Self {
            config,
            policy,
            limiter: config.limiter_at(policy),
            key,
            demand,
            needs: config.plan_at(policy).needs,
            grpc,
            mode,
            fail_open: settings.on_store_error == OnStoreError::FailOpen,
            prepaid: u64::from(mode == StreamMode::Police),
        }
    }

    /// The grants of `unit` for this request's key.
    fn grants(&self, unit: Unit, mode: StreamMode, fail_open: bool) -> Grants<St> {
        let (key, priority) = (self.key.clone(), self.demand.priority);
        Grants::new(self.limiter, key, priority, unit, mode, fail_open)
    }

    /// What the admission charged every tier counting `unit` (the least of them).
    fn admitted(&self, unit: Unit) -> u64 {
        let Some(costs) = &self.demand.costs else { return 0 };
        let tiers = self.limiter.policy().tiers().iter().enumerate();
        let counting =
            tiers.filter(|(_, t)| t.unit() == unit && t.kind() != crate::TierKind::Concurrency);
        counting.filter_map(|(i, _)| costs.get(i).copied()).min().unwrap_or(0)
    }

    /// Meters the request body: its bytes granted as it streams (a body whose length was not
    /// charged at admission) or counted, its gRPC messages granted or tallied.
    fn request<ReqB>(&self, req: &mut Request<RequestBody<ReqB>>) -> Requested {
        let (needs, mode, grpc) = (self.needs, self.mode, self.grpc);
        let stream_bytes = mode.streams() && needs.request_bytes() && self.demand.length.is_none();
        let request_messages = mode.streams() && grpc && needs.request_messages();
        let signal = (stream_bytes || request_messages).then(|| Arc::new(Signal::default()));
        let length_known = self.demand.length.is_some();
        let mut counters =
            Counters::install(needs, req.extensions_mut(), length_known, stream_bytes);
        if let (true, Some(signal)) = (stream_bytes, &signal) {
            let gate = self.grants(Unit::RequestBytes, mode, self.fail_open);
            req.body_mut().gate(Box::new(gate), Arc::clone(signal));
        } else if let Some(counter) = counters.request_bytes() {
            req.body_mut().count_into(counter);
        }
        if let (true, Some(signal)) = (request_messages, &signal) {
            let gate = self.grants(Unit::RequestMessages, mode, self.fail_open);
            req.body_mut().gate_messages(Box::new(gate.prepaid(self.prepaid)), Arc::clone(signal));
        }
        // Settling (or a dry run): a gRPC call's messages are counted, and the message each
        // way charged at admission settled at the count when the response ends.
        let tally = !mode.streams() && grpc;
        if tally && needs.request_messages() {
            let counted = Arc::new(AtomicU64::new(0));
            // Nothing waits for this signal: a tally never stops the body.
            req.body_mut().gate_messages(Box::new(Tally(Arc::clone(&counted))), Arc::default());
            counters.request_messages = Some(counted);
        }
        let response_tally = (tally && needs.response_messages()).then(|| {
            let counted = Arc::new(AtomicU64::new(0));
            counters.response_messages = Some(Arc::clone(&counted));
            Streamed {
                messages: Some((Box::new(Tally(counted)) as Box<dyn Gate>, Framer::default())),
                ..Streamed::default()
            }
        });
        // The tiers metered by grants were charged a unit at admission (policing) that the
        // grants replace: given back however the request ends, stopped or dropped before its
        // response (a client gone) included, so that such a tier is charged what streamed.
        let mut streamed_units = SmallVec::new();
        if stream_bytes {
            streamed_units.push((Unit::RequestBytes, 0));
        }
        if mode.streams() && needs.response_bytes() {
            streamed_units.push((Unit::ResponseBytes, 0));
        }
        Requested { counters, signal, response_tally, streamed_units }
    }

    /// The meter of the response body, ending the request's hold with `finish`: its bytes
    /// and gRPC messages granted as they stream (not for a response whose status gives the
    /// charge back: its units are settled at nothing when it ends), or its messages tallied.
    fn response(
        &self,
        head: &http::response::Parts,
        finish: Finish,
        requested: Requested,
    ) -> Meter {
        let Requested { counters, signal, response_tally, .. } = requested;
        let (config, needs, grpc) = (self.config, self.needs, self.grpc);
        let meter = Meter::new(finish, counters, settled_by_head(config, head));
        let refunded = config.refunds(head.status);
        let response_bytes = needs.response_bytes() && !refunded;
        let response_messages =
            self.mode.streams() && grpc && needs.response_messages() && !refunded;
        let streams = response_bytes || (grpc && signal.is_some()) || response_messages;
        if !(self.mode.streams() && streams) {
            return match response_tally {
                Some(streamed) => meter.streamed(streamed),
                None => meter,
            };
        }
        // A plain HTTP response under way cannot be failed (its status is sent, its body's
        // error type is the handler's): policing shapes it, and a store error lets it on.
        let (mode, fail_open) = match grpc {
            true => (self.mode, self.fail_open),
            false => (StreamMode::Shape, true),
        };
        let gate = response_bytes.then(|| {
            let grants = self.grants(Unit::ResponseBytes, mode, fail_open);
            Box::new(grants.credited(self.admitted(Unit::ResponseBytes))) as Box<dyn Gate>
        });
        let policy = self.policy;
        let trailers = grpc.then(|| {
            let config: Arc<Config<K, St>> = Arc::clone(config);
            Box::new(move |why: &Stopped| config.stop_trailers(policy, why)) as StopTrailers
        });
        let messages = response_messages.then(|| {
            let gate = self.grants(Unit::ResponseMessages, mode, fail_open);
            (Box::new(gate.prepaid(self.prepaid)) as Box<dyn Gate>, Framer::default())
        });
        let signal = if grpc { signal } else { None };
        meter.streamed(Streamed { gate, messages, signal, trailers })
    }

    /// Holds an admitted WebSocket upgrade until its socket ends. The layer cannot see an
    /// upgraded socket's messages: the handler meters them with the [`MessageBudget`] put in
    /// the request, and the request (its concurrency slots too: "N open sockets per key") is
    /// held until the socket ends, with or without a response before.
    ///
    /// [`MessageBudget`]: super::websocket::MessageBudget
    #[cfg(feature = "ws")]
    fn socket<ReqB>(
        &self,
        req: &mut Request<RequestBody<ReqB>>,
        held: Holding<St>,
    ) -> (Holding<St>, Option<Arc<super::websocket::Linger>>) {
        use super::websocket::{Linger, MessageBudget, is_upgrade};
        let needs = self.needs;
        let counts = needs.request_messages() || needs.response_messages() || needs.slots();
        if self.grpc || !counts || !is_upgrade(req.method(), req.headers()) {
            return (held, None);
        }
        let linger = Arc::new(Linger::new(held.into_finish(), !self.mode.streams()));
        // A layer in front of this one may have given its budget already: both meter.
        let budget = req.extensions_mut().remove::<MessageBudget>().unwrap_or_default().and(
            self.limiter,
            self.key.clone(),
            self.demand.priority,
            (self.mode, self.fail_open),
            Arc::clone(&linger),
        );
        req.extensions_mut().insert(budget);
        (Holding { held: None, settled: SmallVec::new() }, Some(linger))
    }

    /// The refusal of an upgrade answered `101` whose handler did not take its budget, under
    /// a policy counting messages (logged once and counted; in a dry run, let through).
    #[cfg(feature = "ws")]
    fn unmetered_upgrade<B>(
        &self,
        res: &Response<B>,
        linger: Option<&super::websocket::Linger>,
    ) -> Option<Response<bytes::Bytes>> {
        let linger = linger?;
        let counts = self.needs.request_messages() || self.needs.response_messages();
        if !counts || res.status() != http::StatusCode::SWITCHING_PROTOCOLS || linger.asked() {
            return None;
        }
        let dry_run = self.config.settings.dry_run;
        self.config.unmetered.seen(self.limiter.policy().name(), dry_run);
        (!dry_run).then(super::websocket::unmetered_upgrade)
    }
}

/// A request held while its handler runs: when it ends before a response (stopped by
/// policing, or dropped), it settles the tiers metered by grants at nothing (their grants
/// charged what streamed), then releases its slots.
struct Holding<St: Store> {
    held: Option<Held<St>>,
    settled: SmallVec<[(Unit, u64); 2]>,
}

impl<St: Store> Holding<St> {
    /// The hold, finished by whatever ends the request (its response body, or an upgraded
    /// socket): with what that settles, and the tiers metered by grants at nothing unless it
    /// settled them itself (a response body that ended does).
    fn into_finish(mut self) -> Finish {
        let (held, units) = (self.held.take(), std::mem::take(&mut self.settled));
        Box::new(move |settled: &[(Unit, u64)]| {
            let Some(held) = held else { return };
            if units.iter().all(|&(unit, _)| settled.iter().any(|&(u, _)| u == unit)) {
                return held.finish(settled);
            }
            let missing = |&&(unit, _): &&(Unit, u64)| !settled.iter().any(|&(u, _)| u == unit);
            let mut all: SmallVec<[(Unit, u64); 8]> = settled.iter().copied().collect();
            all.extend(units.iter().filter(missing).copied());
            held.finish(&all);
        })
    }

    /// Settles and releases now.
    fn finish(self) {
        drop(self);
    }
}

impl<St: Store> Drop for Holding<St> {
    fn drop(&mut self) {
        match self.held.take() {
            // Nothing metered by grants: dropped as before, keeping every estimate.
            Some(held) if self.settled.is_empty() => drop(held),
            Some(held) => held.finish(&self.settled),
            None => {}
        }
    }
}
