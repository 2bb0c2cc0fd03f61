//! [`RateLimit`], the service: a thin adapter from HTTP requests to a
//! [`Limiter`] and its [`Reservation`].

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, header};
use http_body_util::Full;
use smallvec::SmallVec;
use tower_service::Service;

use super::body::{RequestBody, ResponseBody};
use super::future::{Refund, RefundByStatus, ResponseFuture, Slow, State, Untracked};
use super::linger::{close, refused, unread_body};
use super::messages::Framer;
use super::meter::{Counters, Finish, Meter, Needs, StopTrailers, Streamed, content_length};
use super::scope::Route;
use super::stream::{Gate, Leases, Signal, Stopped, StreamMode, Tally};
use super::{Config, Cost, MissingKey, Observed, OnStoreError};
use crate::decision::Decision;
use crate::error::StoreError;
use crate::grpc::is_grpc;
use crate::headers::{Fields, HeaderStyle, Prepared};
use crate::key::{Key, KeyExtractor, RequestHead};
use crate::limiter::{Held, Limiter, Reservation};
use crate::quota::Unit;
use crate::rejection::{Rejection, grpc_resource_exhausted, too_many_requests};
use crate::store::{Check, Store, Verdict};

/// The rate-limiting service made by [`RateLimitLayer`](crate::RateLimitLayer).
///
/// Decides in `call`, never in `poll_ready` (which is delegated to the inner service), so no
/// capacity is taken for a request that never comes. Limits become responses; the inner
/// service's error passes through unchanged.
pub struct RateLimit<S, K, St: Store> {
    inner: S,
    config: Arc<Config<K, St>>,
    /// One of several layers limiting each request (the rules of a configuration file that
    /// apply together): the rate-limit headers are handed on in the response's extensions,
    /// for the outermost to write them once.
    collect: bool,
}

impl<S: Clone, K, St: Store> Clone for RateLimit<S, K, St> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone(), config: Arc::clone(&self.config), collect: self.collect }
    }
}

impl<S: fmt::Debug, K, St: Store> fmt::Debug for RateLimit<S, K, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("policy", &self.config.limiter.policy().name())
            .finish_non_exhaustive()
    }
}

impl<S, K, St: Store> RateLimit<S, K, St> {
    pub(crate) fn new(inner: S, config: Arc<Config<K, St>>) -> Self {
        Self { inner, config, collect: false }
    }

    /// This service, handing its rate-limit headers on as values
    /// ([`Collected`](crate::headers::Collected)) instead of writing them.
    #[cfg(feature = "config")]
    pub(crate) fn collecting(mut self) -> Self {
        self.collect = true;
        self
    }

    inner_service_accessors!();
}

impl<S, K, St, ReqB, ResB> Service<Request<ReqB>> for RateLimit<S, K, St>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    K: KeyExtractor,
    St: Store,
    ReqB: http_body::Body + Send + 'static,
    ResB: Send + 'static,
{
    type Response = Response<ResponseBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let metered = Some(metered::<S, K, St, ReqB, ResB> as _);
        decide::<Observing, _, _, _, _, _>(
            &mut self.inner,
            &self.config,
            self.collect,
            metered,
            req,
        )
        .into()
    }
}

/// How a service of the layer hands bodies on and back. [`Observing`] wraps both in the
/// layer's own bodies ([`RequestBody`], [`ResponseBody`]) so that it can meter them; [`Lean`]
/// hands on the request's own body and answers with the inner service's own response body,
/// for policies that observe no body. The decision steps are written once, over this.
pub(super) trait Carry<ReqB, ResB>: 'static {
    /// The request body the inner service receives.
    type Req: http_body::Body + Send + 'static;
    /// The response body the service answers with.
    type Res: Send + 'static;
    /// The request as the inner service receives it.
    fn request(req: Request<ReqB>) -> Request<Self::Req>;
    /// The inner service's response body as the service answers with it.
    fn response(body: ResB) -> Self::Res;
    /// The body of a response the layer made (a refusal).
    fn refusal(body: Bytes) -> Self::Res;
}

/// [`RateLimit`]'s bodies: both wrapped, to be metered.
pub(super) enum Observing {}

impl<ReqB: http_body::Body + Send + 'static, ResB: Send + 'static> Carry<ReqB, ResB> for Observing {
    type Req = RequestBody<ReqB>;
    type Res = ResponseBody<ResB>;

    #[inline]
    fn request(req: Request<ReqB>) -> Request<Self::Req> {
        req.map(RequestBody::new)
    }

    #[inline]
    fn response(body: ResB) -> Self::Res {
        ResponseBody::inner(body)
    }

    #[inline]
    fn refusal(body: Bytes) -> Self::Res {
        ResponseBody::own(Full::new(body))
    }
}

/// The lean service's bodies: handed on and back as they are; a refusal's made from its bytes.
pub(super) enum Lean {}

impl<ReqB: http_body::Body + Send + 'static, ResB: From<Bytes> + Send + 'static> Carry<ReqB, ResB>
    for Lean
{
    type Req = ReqB;
    type Res = ResB;

    // The request itself, not taken apart and put together again.
    #[inline]
    fn request(req: Request<ReqB>) -> Request<Self::Req> {
        req
    }

    #[inline]
    fn response(body: ResB) -> Self::Res {
        body
    }

    #[inline]
    fn refusal(body: Bytes) -> Self::Res {
        ResB::from(body)
    }
}

/// How a service serves an admitted request whose policy meters something while it runs
/// ([`RateLimit`]'s: [`serve_metered`]). A function pointer handed to the shared steps rather
/// than a method of [`Carry`]: the inner service's bounds, written over `Carry`'s associated
/// body types, do not carry over to a generic method's implementations.
type Metered<S, K, St, Q, R, E> = fn(
    Arc<Config<K, St>>,
    (usize, bool),
    S,
    Request<Q>,
    (Key, Demand),
    Reservation<St>,
    Prepared,
) -> Slow<R, E>;

/// The [`Metered`] of a service carrying bodies as `C` does; `None` for one that meters nothing.
type MeteredBy<C, S, K, St, ReqB, ResB> = Option<
    Metered<
        S,
        K,
        St,
        <C as Carry<ReqB, ResB>>::Req,
        <C as Carry<ReqB, ResB>>::Res,
        <S as Service<Request<<C as Carry<ReqB, ResB>>::Req>>>::Error,
    >,
>;

/// [`serve_metered`], boxed: [`RateLimit`]'s [`Metered`].
fn metered<S, K, St, ReqB, ResB>(
    config: Arc<Config<K, St>>,
    policy: (usize, bool),
    inner: S,
    req: Request<RequestBody<ReqB>>,
    demand: (Key, Demand),
    reservation: Reservation<St>,
    headers: Prepared,
) -> Slow<ResponseBody<ResB>, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    K: KeyExtractor,
    St: Store,
    ReqB: http_body::Body + Send + 'static,
    ResB: Send + 'static,
{
    Box::pin(serve_metered(config, policy, inner, req, demand, reservation, headers))
}

/// Decides a request in `call`: the common case (policing, a key, a store that answers without
/// I/O) here and now, whatever has to wait on a boxed future running [`run`]. `inner` is the
/// service that was polled ready; `collect` whether the rate-limit headers are handed on
/// ([`RateLimit::collecting`]); `metered` serves an admitted request whose policy meters
/// something while it runs (`None`: a service that meters nothing, whose layer was built only
/// for policies that need nothing metered).
// Out of line: inlined into `call`, the state it returns is built on the stack and copied
// into the response future once more (measured: 20 to 40 instructions per request more).
#[inline(never)]
pub(super) fn decide<C, S, K, St, ReqB, ResB>(
    inner: &mut S,
    shared: &Arc<Config<K, St>>,
    collect: bool,
    metered: MeteredBy<C, S, K, St, ReqB, ResB>,
    req: Request<ReqB>,
) -> State<S::Future, C::Res, S::Error>
where
    C: Carry<ReqB, ResB>,
    S: Service<Request<C::Req>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    K: KeyExtractor,
    St: Store,
    ReqB: http_body::Body + Send + 'static,
    ResB: Send + 'static,
{
    #[cfg(feature = "ws")]
    let req = {
        let mut req = req;
        super::websocket::unmetered(&mut req);
        req
    };
    // The body is wrapped where the request is handed on: built in place there, the
    // request is not copied once more.
    let config = &**shared;
    let head = RequestHead::from(&req);
    // Filters, allow-lists and the selector, only when one is set.
    let mut policy = 0;
    if let Some(scope) = &config.scope {
        match scope.route(&head, |name| config.position(name)) {
            Route::Limit(i) => policy = i,
            // Called here and now: the service that was polled ready, no clone.
            Route::Pass => {
                return State::inner(inner.call(C::request(req)), Prepared::default(), None);
            }
            Route::Refuse(status) => {
                let grpc = is_grpc(req.headers());
                let res = config.refuse(&Rejection::Unselected(status), grpc);
                return State::ready(refused(req, res).map(C::refusal));
            }
        }
    }
    let key = config.key.extract(&head);
    if let (Some(scope), Some(key)) = (&config.scope, &key) {
        if scope.allows(key) {
            return State::inner(inner.call(C::request(req)), Prepared::default(), None);
        }
    }
    let limiter = config.limiter_at(policy);
    let plan = config.plan_at(policy);
    // The common case, decided here and now: policing, a key, and a store that answers
    // without I/O. Whatever has to wait goes to `run`, with the decision already made.
    let mut decided = None;
    if let (Some(key), true) = (&key, plan.at_once) {
        let cost = config.cost(&head);
        // Per-tier costs, for a policy with tiers of other kinds or units only.
        let costs =
            (!plan.plain).then(|| plan.costs(limiter.policy(), cost, content_length(&head), &head));
        let priority = config.priority(&head);
        let mut check = Check::new(key, cost).with_priority(priority);
        if let Some(costs) = &costs {
            check = check.with_costs(costs);
        }
        check.ticket = plan.ticket;
        match limiter.check_sync(check) {
            Some(Ok(Verdict { decision, ticket }))
                if decision.is_allowed() && (ticket.is_none() || plan.answers_with_ticket) =>
            {
                if config.observer.active() {
                    let policy_ = limiter.policy();
                    config.observer.at_once(
                        policy,
                        (policy_, key, &head),
                        &decision,
                        Observed::Admitted,
                    );
                }
                let fields = config.settings.headers;
                let headers = limiter.surface().headers.prepare(fields, &decision, collect);
                // Called here and now: the service that was polled ready, no clone.
                let future = inner.call(C::request(req));
                let Some(ticket) = ticket else {
                    if plan.untracked {
                        let charge = Untracked {
                            hook: Arc::clone(shared) as Arc<dyn RefundByStatus>,
                            policy,
                            key: key.clone(),
                            cost,
                            any_status: plan.refund_if,
                            collect,
                            priority,
                        };
                        return State::inner(future, headers, Some(charge));
                    }
                    return State::inner(future, headers, None);
                };
                // A charge the response's status may give back (a 405, `refund_if`).
                let config = Arc::clone(shared);
                let key = key.clone();
                let refund: Refund = Box::new(move |status| {
                    // Not given back: dropping the ticket keeps the charge.
                    config.refunds(status).then(|| {
                        Box::pin(async move {
                            let limiter = config.limiter_at(policy);
                            if let Err(error) = limiter.settle(ticket, 0).await {
                                tracing::warn!(%error, "tollgate: could not give a charge back");
                            }
                            config.headers_now(policy, &key, priority, collect).await
                        }) as _
                    })
                });
                return State::refundable(future, headers, refund);
            }
            Some(Ok(verdict))
                if !verdict.decision.is_allowed() && config.settings.tarpit.is_none() =>
            {
                if config.observer.active() {
                    let (policy_, d) = (limiter.policy(), &verdict.decision);
                    config.observer.at_once(policy, (policy_, key, &head), d, Observed::Limited);
                }
                let grpc = is_grpc(req.headers());
                let (decision, collect) = (verdict.decision, collect);
                let res = config.reject(limiter, key, decision, None, grpc, collect);
                return State::ready(refused(req, res).map(C::refusal));
            }
            Some(result) => decided = Some(result),
            None => {}
        }
    }
    // Called later: take the service that was polled ready, leave a fresh clone in its place.
    let clone = inner.clone();
    let inner = std::mem::replace(inner, clone);
    let config = Arc::clone(shared);
    let req = C::request(req);
    let future =
        run::<C, _, _, _, _, _>(config, (policy, collect), inner, metered, req, key, decided);
    State::slow(Box::pin(future))
}

impl<K, St: Store> Config<K, St> {
    /// The limiter of the policy at `index`: 0 is the builder's own, then those added with
    /// `policy` in order.
    #[inline]
    pub(super) fn limiter_at(&self, index: usize) -> &Limiter<St> {
        match (index, &self.scope) {
            (0, _) | (_, None) => &self.limiter,
            (i, Some(scope)) => scope.others.get(i - 1).unwrap_or(&self.limiter),
        }
    }

    /// The index of the policy named `name`.
    pub(super) fn position(&self, name: &str) -> Option<usize> {
        if self.limiter.policy().name() == name {
            return Some(0);
        }
        let others = self.scope.as_ref().map_or(&[][..], |s| &s.others[..]);
        others.iter().position(|l| l.policy().name() == name).map(|i| i + 1)
    }

    /// Reports a decision of the policy at `index`.
    #[inline(never)]
    fn observe(
        &self,
        index: usize,
        key: &Key,
        head: &RequestHead<'_>,
        decision: Option<&Decision>,
        outcome: Observed,
    ) {
        let policy = self.limiter_at(index).policy();
        self.observer.decided(index, policy, key, head, decision, outcome);
    }

    /// The [`Plan`] of the policy at `index` ([`limiter_at`](Self::limiter_at)'s order).
    #[inline]
    fn plan_at(&self, index: usize) -> &Plan {
        self.plans.get(index).unwrap_or(&self.plans[0])
    }

    /// Whether a response of `status` gives its request's charge back: a `405 Method Not
    /// Allowed` (unless charged by choice), or a status of `refund_if`.
    pub(super) fn refunds(&self, status: http::StatusCode) -> bool {
        (status == http::StatusCode::METHOD_NOT_ALLOWED && !self.settings.charge_method_not_allowed)
            || self.settings.refund_if.as_ref().is_some_and(|f| f(status))
    }

    /// The request's cost in units.
    #[inline]
    fn cost(&self, head: &RequestHead<'_>) -> u64 {
        match &self.settings.cost {
            Cost::Fixed(units) => *units,
            Cost::PerRequest(f) => f(head),
        }
    }

    /// The rate-limit headers of `key`'s state now (a query, charging nothing): what a
    /// response says after a refund or a settlement changed its charge. None when the store
    /// cannot tell: no header rather than a wrong one.
    async fn headers_now(
        &self,
        policy: usize,
        key: &Key,
        priority: crate::Priority,
        collect: bool,
    ) -> Prepared {
        let limiter = self.limiter_at(policy);
        let query = Check::new(key, 0).with_priority(priority);
        match limiter.decide(query).await {
            Ok(verdict) => {
                limiter.surface().headers.prepare(self.settings.headers, &verdict.decision, collect)
            }
            Err(_) => Prepared::default(),
        }
    }

    /// The request's class ([`Priority::Standard`](crate::Priority::Standard) unless the layer picks it).
    #[inline]
    fn priority(&self, head: &RequestHead<'_>) -> crate::Priority {
        self.settings.priority.as_ref().map_or(crate::Priority::Standard, |f| f(head))
    }

    /// The response to a request `limiter` refused; `budget` is the shaping budget it
    /// exceeded; `grpc` whether the request is a gRPC call, answered in gRPC form (never
    /// through the custom rejection: a gRPC client could not read it); `collect` whether its
    /// rate-limit headers are handed on (in the response's
    /// [`Collected`](crate::headers::Collected)) rather than written.
    fn reject(
        &self,
        limiter: &Limiter<St>,
        key: &Key,
        decision: Decision,
        budget: Option<std::time::Duration>,
        grpc: bool,
        collect: bool,
    ) -> Response<Bytes> {
        if collect {
            let headers = limiter.surface().headers.prepare(self.settings.headers, &decision, true);
            let style = Fields { style: HeaderStyle::None, ..self.settings.headers };
            let mut res = self.reject_with(limiter, key, decision, budget, grpc, style);
            headers.apply(&mut res);
            return res;
        }
        self.reject_with(limiter, key, decision, budget, grpc, self.settings.headers)
    }

    /// [`reject`](Self::reject), writing the rate-limit headers of `style`.
    fn reject_with(
        &self,
        limiter: &Limiter<St>,
        key: &Key,
        decision: Decision,
        budget: Option<std::time::Duration>,
        grpc: bool,
        style: Fields,
    ) -> Response<Bytes> {
        tracing::debug!(
            policy = limiter.policy().name(),
            key = %self.observer.show(key),
            outcome = ?decision.outcome(),
            grpc,
            "tollgate: limited"
        );
        if grpc {
            return grpc_resource_exhausted(limiter.surface(), &decision, style);
        }
        match &self.settings.rejection {
            None => too_many_requests(limiter.surface(), &decision, style),
            Some(f) => {
                let limited = limiter.rate_limited(decision, budget);
                let mut res = f(&limited);
                // The callback's own `Retry-After` wins.
                let own = res.headers().get(header::RETRY_AFTER).cloned();
                limited.add_headers(style, &mut res);
                if let Some(value) = own {
                    res.headers_mut().insert(header::RETRY_AFTER, value);
                }
                res
            }
        }
    }

    /// The answer to a request whose upload policing stopped before the handler answered: a
    /// refusal as at admission, or a 503 when the store could not decide (failing closed).
    fn stopped(
        &self,
        limiter: &Limiter<St>,
        key: &Key,
        why: Stopped,
        (grpc, collect): (bool, bool),
    ) -> Response<Bytes> {
        match why {
            Stopped::Limited(decision) => self.reject(limiter, key, decision, None, grpc, collect),
            Stopped::Unavailable(error) => {
                let error = StoreError::backend(error.to_string());
                self.refuse(&Rejection::Unavailable(error), grpc)
            }
        }
    }

    /// The trailers ending a gRPC response of the policy at `index` stopped by policing: the
    /// status of its refusal (`RESOURCE_EXHAUSTED`, or `UNAVAILABLE` failing closed), its
    /// message and `grpc-retry-pushback-ms`.
    fn stop_trailers(&self, index: usize, why: &Stopped) -> http::HeaderMap {
        let style = self.settings.headers;
        let res = match why {
            Stopped::Limited(decision) => {
                grpc_resource_exhausted(self.limiter_at(index).surface(), decision, style)
            }
            Stopped::Unavailable(error) => {
                let error = StoreError::backend(error.to_string());
                Rejection::Unavailable(error).grpc_response(style)
            }
        };
        let mut trailers = res.into_parts().0.headers;
        trailers.remove(header::CONTENT_TYPE);
        trailers
    }

    /// A refusal other than a 429, in gRPC form for a gRPC call.
    fn refuse(&self, rejection: &Rejection, grpc: bool) -> Response<Bytes> {
        let style = self.settings.headers;
        if grpc { rejection.grpc_response(style) } else { rejection.response(style) }
    }
}

/// What the requests of one bound policy need, derived from the layer's settings and the
/// policy's tiers when the layer is built, so that a request only reads it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    /// What a request must have measured while it runs (slots, bytes, reported units).
    needs: Needs,
    /// Every tier a rate counting requests: the request's cost is every tier's cost.
    plain: bool,
    /// Policing, not in dry run: a decision made at once can be answered at once.
    at_once: bool,
    /// Whether a check decided at once asks for a ticket.
    ticket: bool,
    /// Admitted without a ticket, its charge given back by key when the response's status
    /// says so (the store can, exactly, and nothing else needs the ticket).
    untracked: bool,
    /// Whether an admission that came with a ticket is still answered at once: nothing is
    /// metered and no cost is settled from the response head.
    answers_with_ticket: bool,
    /// Whether a check that may wait asks for a ticket (beside shaping, which always does).
    ticket_to_wait: bool,
    /// Whether a `refund_if` predicate is set (statuses other than 405 may give back).
    refund_if: bool,
    /// Shaping streamed bodies: their byte tiers (and a gRPC call's message tiers) are not
    /// checked at admission (the body's first lease waits for room instead of the request
    /// being refused).
    shape_streams: bool,
}

impl Plan {
    pub(super) fn new<St: Store>(settings: &super::Settings, limiter: &Limiter<St>) -> Self {
        let policy = limiter.policy();
        let needs = Needs::of(policy);
        let metered = needs.any();
        // Whether a response's status may give its request's charge back.
        let refunds_by_status = !settings.charge_method_not_allowed || settings.refund_if.is_some();
        // Whether the charge may be given back after the response.
        let needs_ticket = refunds_by_status || settings.settle_cost.is_some();
        let untracked = !metered
            && settings.settle_cost.is_none()
            && refunds_by_status
            && limiter.refunds_sync();
        let shape_streams = settings.stream() == StreamMode::Shape
            && !settings.dry_run
            && (needs.request_bytes()
                || needs.response_bytes()
                || needs.request_messages()
                || needs.response_messages());
        Self {
            needs,
            plain: policy.is_plain(),
            // A request whose body is shaped as it streams may be admitted without a ticket
            // (its byte tiers cost nothing at admission): it always takes the general path.
            at_once: settings.max_delay.is_none() && !settings.dry_run && !shape_streams,
            ticket: (needs_ticket && !untracked) || metered,
            untracked,
            answers_with_ticket: !metered && settings.settle_cost.is_none(),
            ticket_to_wait: needs_ticket || metered,
            refund_if: settings.refund_if.is_some(),
            shape_streams,
        }
    }

    /// The length of a request body charged at admission: its `Content-Length`, unless the
    /// layer shapes streams and some tier counting request bytes can never hold it at once
    /// (for `priority`): such a body streams, metered as it passes.
    fn admitted_length(
        &self,
        policy: &crate::Policy,
        length: Option<u64>,
        priority: crate::Priority,
    ) -> Option<u64> {
        let length = length?;
        let too_large = |t: &crate::Tier| {
            t.unit() == Unit::RequestBytes
                && t.kind() != crate::TierKind::Concurrency
                && length > t.capacity_for(priority)
        };
        match self.shape_streams && policy.tiers().iter().any(too_large) {
            true => None,
            false => Some(length),
        }
    }

    /// The per-tier costs of a request costing `cost` whose body is `length` long, if known.
    #[inline]
    fn costs(
        &self,
        policy: &crate::Policy,
        cost: u64,
        length: Option<u64>,
        head: &RequestHead<'_>,
    ) -> crate::Costs {
        let mut costs = policy.costs(cost, length);
        if self.shape_streams {
            costs.unstream(policy, length.is_some(), is_grpc(head.headers));
        }
        costs
    }
}

/// Passes a request on unlimited.
async fn pass<C, S, ReqB, ResB>(
    mut inner: S,
    req: Request<C::Req>,
) -> Result<Response<C::Res>, S::Error>
where
    C: Carry<ReqB, ResB>,
    S: Service<Request<C::Req>, Response = Response<ResB>>,
{
    let res = inner.call(req).await?;
    Ok(res.map(C::response))
}

/// Every path that waits: a store doing I/O, shaping, a tarpit, a settlement, a missing key, a
/// store error. `policy` is the index of the chosen policy ([`Config::limiter_at`]); `decided`
/// is the store's answer when `call` already asked it. In steps: the key (or the answer for a
/// request without one), the request's demand read once, the reservation (or the answer when
/// the store fails), the refusal, and serving the admitted request with what its policy
/// meters.
async fn run<C, S, K, St, ReqB, ResB>(
    config: Arc<Config<K, St>>,
    (policy, collect): (usize, bool),
    inner: S,
    metered: MeteredBy<C, S, K, St, ReqB, ResB>,
    req: Request<C::Req>,
    key: Option<Key>,
    decided: Option<Result<Verdict<St::Ticket>, StoreError>>,
) -> Result<Response<C::Res>, S::Error>
where
    C: Carry<ReqB, ResB>,
    S: Service<Request<C::Req>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    K: KeyExtractor,
    St: Store,
{
    let key = match key {
        Some(key) => key,
        None => match missing_key(&config, policy, &req) {
            Keyed::Key(key) => key,
            Keyed::Refused(res) => return Ok(refused(req, res).map(C::refusal)),
            Keyed::Pass => return pass::<C, _, _, _>(inner, req).await,
        },
    };
    let demand = Demand::read(&config, policy, &req);
    let (reserved, permit, budget) = reserve(&config, policy, &key, &demand, decided).await;
    let limiter = config.limiter_at(policy);
    let reservation = match reserved {
        Ok(reservation) => {
            config.failing.recovered(limiter.policy().name());
            reservation
        }
        Err(error) => {
            drop(permit);
            return store_failed::<C, _, _, _, _, _>(&config, policy, inner, req, &key, error)
                .await;
        }
    };
    let outcome = observed(&config, policy, &key, &req, reservation.decision());
    if outcome == Observed::Limited {
        drop(permit);
        let grpc = is_grpc(req.headers());
        let res = refuse_limited(&config, (policy, collect), &key, reservation, budget, grpc).await;
        return Ok(refused(req, res).map(C::refusal));
    }

    // Admitted (or dry run): wait for the reserved slot; a request dropped meanwhile gives it
    // back.
    let reservation = reservation.wait().await;
    drop(permit);
    let headers = if outcome == Observed::DryRunLimited {
        Prepared::default()
    } else {
        limiter.surface().headers.prepare(config.settings.headers, reservation.decision(), collect)
    };

    match metered {
        Some(metered)
            if config.plan_at(policy).needs.any() && reservation.decision().is_allowed() =>
        {
            metered(config, (policy, collect), inner, req, (key, demand), reservation, headers)
                .await
        }
        _ => {
            let (who, serving) = ((&key, demand.priority), (policy, collect));
            serve::<C, _, _, _, _, _>(&config, serving, inner, req, who, reservation, headers).await
        }
    }
}

/// Serves an admitted request whose policy meters nothing while it runs: its response head
/// settles the charge (a refund by status, a settled cost) before the response is handed on.
async fn serve<C, S, K, St, ReqB, ResB>(
    config: &Config<K, St>,
    (policy, collect): (usize, bool),
    mut inner: S,
    req: Request<C::Req>,
    (key, priority): (&Key, crate::Priority),
    reservation: Reservation<St>,
    headers: Prepared,
) -> Result<Response<C::Res>, S::Error>
where
    C: Carry<ReqB, ResB>,
    S: Service<Request<C::Req>, Response = Response<ResB>>,
    St: Store,
{
    // From here the request is served: dropping it (a client disconnect) keeps the charge.
    let res = inner.call(req).await?;
    let (mut head, body) = res.into_parts();
    // A refund or a settled cost changes the charge: the headers say what is left after it.
    match settle(config, reservation, &head).await {
        true => config.headers_now(policy, key, priority, collect).await.apply_parts(&mut head),
        false => headers.apply_parts(&mut head),
    }
    Ok(Response::from_parts(head, C::response(body)))
}

/// What [`missing_key`] decided for a request its extractor found no key in.
enum Keyed {
    /// Limited under this key.
    Key(Key),
    /// Refused with this answer.
    Refused(Response<Bytes>),
    /// Passed on unlimited.
    Pass,
}

/// The layer's `missing_key` setting applied to a request without a key.
fn missing_key<K: KeyExtractor, St: Store, B>(
    config: &Config<K, St>,
    policy: usize,
    req: &Request<B>,
) -> Keyed {
    let settings = &config.settings;
    match settings.missing_key {
        MissingKey::Reject(status) => {
            let why = config.key.explain_missing(&RequestHead::from(req));
            config.missing.refused(config.limiter_at(policy).policy().name(), &why);
            let explained = settings.explain_missing.then_some(why);
            let grpc = is_grpc(req.headers());
            Keyed::Refused(config.refuse(&Rejection::MissingKey { status, explained }, grpc))
        }
        MissingKey::Allow => Keyed::Pass,
        MissingKey::Shared => Keyed::Key(Key::Missing),
    }
}

/// What a request asks of its policy, read once from its head.
pub(super) struct Demand {
    /// Units per request (the layer's cost).
    cost: u64,
    /// The body's declared length (`Content-Length`), in bytes.
    length: Option<u64>,
    /// The request's class for reserved capacity.
    priority: crate::Priority,
    /// The cost of each tier, for a policy that is not plain.
    costs: Option<crate::Costs>,
}

impl Demand {
    fn read<K: KeyExtractor, St: Store, B>(
        config: &Config<K, St>,
        policy: usize,
        req: &Request<B>,
    ) -> Self {
        let head = RequestHead::from(req);
        let (cost, priority) = (config.cost(&head), config.priority(&head));
        let plan = config.plan_at(policy);
        let limiter = config.limiter_at(policy);
        let length = plan.admitted_length(limiter.policy(), content_length(&head), priority);
        let costs = (!plan.plain).then(|| plan.costs(limiter.policy(), cost, length, &head));
        Demand { cost, length, priority, costs }
    }
}

/// The request's reservation: the store's answer `call` already has, or a check made here,
/// shaped within `max_delay` when the waiting room has a place (taken before deciding, so
/// that a full room polices instead of reserving slots it cannot wait for). Returns the place
/// and the shaping budget with it.
async fn reserve<K: KeyExtractor, St: Store>(
    config: &Config<K, St>,
    policy: usize,
    key: &Key,
    demand: &Demand,
    decided: Option<Result<Verdict<St::Ticket>, StoreError>>,
) -> (
    Result<Reservation<St>, StoreError>,
    Option<tokio::sync::OwnedSemaphorePermit>,
    Option<std::time::Duration>,
) {
    let (settings, limiter) = (&config.settings, config.limiter_at(policy));
    if let Some(verdict) = decided {
        return (verdict.map(|verdict| limiter.reservation(verdict)), None, None);
    }
    let permit = match (&config.waiters, settings.max_delay, settings.dry_run) {
        (Some(room), Some(_), false) => Arc::clone(room).try_acquire_owned().ok(),
        _ => None,
    };
    let budget = permit.as_ref().and(settings.max_delay);
    let mut check = Check::new(key, demand.cost).with_priority(demand.priority);
    if let Some(costs) = &demand.costs {
        check = check.with_costs(costs);
    }
    check.max_delay = budget;
    check.ticket = budget.is_some() || config.plan_at(policy).ticket_to_wait;
    let reserved = if budget.is_some() && limiter.policy().has_concurrency() {
        // Shaping waits for a free slot too, within the budget.
        limiter.reserve_with(check).await
    } else {
        limiter.decide(check).await.map(|verdict| limiter.reservation(verdict))
    };
    (reserved, permit, budget)
}

/// The answer when the store failed to decide: the request passed on (failing open) or
/// refused with 503 (failing closed), as the layer's `on_store_error` says.
async fn store_failed<C, S, K, St, ReqB, ResB>(
    config: &Config<K, St>,
    policy: usize,
    inner: S,
    req: Request<C::Req>,
    key: &Key,
    error: StoreError,
) -> Result<Response<C::Res>, S::Error>
where
    C: Carry<ReqB, ResB>,
    S: Service<Request<C::Req>, Response = Response<ResB>>,
    K: KeyExtractor,
    St: Store,
{
    let name = config.limiter_at(policy).policy().name();
    let head = RequestHead::from(&req);
    match config.settings.on_store_error {
        OnStoreError::FailOpen => {
            config.failing.failed(name, &error, "failing open");
            config.observe(policy, key, &head, None, Observed::FailedOpen);
            pass::<C, _, _, _>(inner, req).await
        }
        OnStoreError::FailClosed => {
            config.failing.failed(name, &error, "failing closed");
            config.observe(policy, key, &head, None, Observed::FailedClosed);
            let grpc = is_grpc(req.headers());
            let res = config.refuse(&Rejection::Unavailable(error), grpc);
            Ok(refused(req, res).map(C::refusal))
        }
    }
}

/// What the decision means for the request (a dry run's refusal lets it on), observed.
fn observed<K: KeyExtractor, St: Store, B>(
    config: &Config<K, St>,
    policy: usize,
    key: &Key,
    req: &Request<B>,
    decision: &Decision,
) -> Observed {
    let outcome = match (decision.is_allowed(), config.settings.dry_run) {
        (false, false) => Observed::Limited,
        (false, true) => Observed::DryRunLimited,
        (true, _) if !decision.delay().is_zero() => Observed::Shaped(decision.delay()),
        (true, _) => Observed::Admitted,
    };
    if config.observer.active() || outcome == Observed::DryRunLimited {
        config.observe(policy, key, &RequestHead::from(req), Some(decision), outcome);
    }
    outcome
}

/// The refusal of a limited request (a gRPC call's with `grpc`), after the tarpit's delay when
/// one is set.
async fn refuse_limited<K: KeyExtractor, St: Store>(
    config: &Config<K, St>,
    (policy, collect): (usize, bool),
    key: &Key,
    reservation: Reservation<St>,
    budget: Option<std::time::Duration>,
    grpc: bool,
) -> Response<Bytes> {
    let decision = reservation.decision().clone();
    drop(reservation);
    if let Some(delay) = config.settings.tarpit {
        // Only with a place in the waiting room: a flood is answered at once, not held.
        if let Some(_place) = config.waiters.as_ref().and_then(|w| w.try_acquire().ok()) {
            tokio::time::sleep(delay).await;
        }
    }
    config.reject(config.limiter_at(policy), key, decision, budget, grpc, collect)
}

/// Serves an admitted request whose policy meters something while it runs: concurrency slots
/// held, bytes or messages counted or leased as they stream, units reported.
#[allow(clippy::too_many_arguments)]
async fn serve_metered<S, K, St, ReqB, ResB>(
    config: Arc<Config<K, St>>,
    (policy, collect): (usize, bool),
    mut inner: S,
    req: Request<RequestBody<ReqB>>,
    (key, demand): (Key, Demand),
    reservation: Reservation<St>,
    headers: Prepared,
) -> Result<Response<ResponseBody<ResB>>, S::Error>
where
    S: Service<Request<RequestBody<ReqB>>, Response = Response<ResB>>,
    K: KeyExtractor,
    St: Store,
    ReqB: http_body::Body + Send + 'static,
    ResB: Send + 'static,
{
    let settings = &config.settings;
    let limiter = config.limiter_at(policy);
    let needs = config.plan_at(policy).needs;
    let Demand { length, priority, .. } = demand;
    // Held while the handler runs and its response streams: its concurrency slots (leases
    // refreshed on a shared store), and the units counted on the way. A handler that fails or
    // panics, or a client that disconnects, drops the hold: the slots are released and the
    // estimates kept.
    let mut req = req;
    // A dry run never stops nor slows a stream: its bodies are settled when they end.
    let mode = if settings.dry_run { StreamMode::Settle } else { settings.stream() };
    let grpc = is_grpc(req.headers());
    let fail_open = settings.on_store_error == OnStoreError::FailOpen;
    // A request body of unknown length, metered as it streams: its leases, and where
    // policing tells that it stopped the body.
    let stream_bytes = mode.streams() && needs.request_bytes() && length.is_none();
    // A gRPC call's messages, metered as they stream. Policing charged the first message
    // each way at admission (as for a unary call); shaping charged none.
    let stream_messages = mode.streams() && grpc;
    let prepaid = u64::from(mode == StreamMode::Police);
    let request_messages = stream_messages && needs.request_messages();
    let signal = (stream_bytes || request_messages).then(|| Arc::new(Signal::default()));
    let streamed = signal.as_ref().filter(|_| stream_bytes).map(|signal| {
        let gate = Leases::new(limiter, key.clone(), priority, Unit::RequestBytes, mode, fail_open);
        (Box::new(gate) as Box<dyn Gate>, Arc::clone(signal))
    });
    let mut counters =
        Counters::install(needs, req.extensions_mut(), length.is_some(), streamed.is_some());
    if let Some((gate, signal)) = streamed {
        req.body_mut().gate(gate, signal);
    } else if let Some(counter) = counters.request_bytes() {
        req.body_mut().count_into(counter);
    }
    if let (true, Some(signal)) = (request_messages, &signal) {
        let unit = Unit::RequestMessages;
        let gate = Leases::new(limiter, key.clone(), priority, unit, mode, fail_open);
        req.body_mut().gate_messages(Box::new(gate.prepaid(prepaid)), Arc::clone(signal));
    }
    // Settling (or a dry run): a gRPC call's messages are counted, and the message each way
    // charged at admission settled at the count when the response ends.
    let tally = !mode.streams() && grpc;
    if tally && needs.request_messages() {
        let counted = Arc::new(AtomicU64::new(0));
        let gate = Box::new(Tally(Arc::clone(&counted)));
        // Nothing waits for this signal: a tally never stops the body.
        req.body_mut().gate_messages(gate, Arc::default());
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
    // The tiers metered by leases were charged a unit at admission (policing) that the leases
    // replace: given back however the request ends, stopped or dropped before its response
    // (a client gone) included, so that such a tier is charged exactly what streamed.
    let mut streamed_units = SmallVec::new();
    if stream_bytes {
        streamed_units.push((Unit::RequestBytes, 0));
    }
    if mode.streams() && needs.response_bytes() {
        streamed_units.push((Unit::ResponseBytes, 0));
    }
    let held = Holding { held: Some(reservation.hold()), settled: streamed_units };
    #[cfg(feature = "ws")]
    let (held, linger) = if !grpc
        && (needs.request_messages() || needs.response_messages() || needs.slots())
        && super::websocket::is_upgrade(req.method(), req.headers())
    {
        // The layer cannot see an upgraded socket's messages: the handler meters them, and
        // the request (its concurrency slots too: "N open sockets per key") is held until the
        // socket ends.
        use super::websocket::{Linger, MessageBudget};
        // Finished when the socket ends, with or without a response before.
        let linger = Arc::new(Linger::new(held.into_finish(), !mode.streams()));
        // A layer in front of this one may have given its budget already: both meter.
        let budget = req.extensions_mut().remove::<MessageBudget>().unwrap_or_default().and(
            limiter,
            key.clone(),
            priority,
            (mode, fail_open),
            Arc::clone(&linger),
        );
        req.extensions_mut().insert(budget);
        (Holding { held: None, settled: SmallVec::new() }, Some(linger))
    } else {
        (held, None)
    };
    // Policing that stops an upload answers without reading the rest of it.
    let closes = signal.is_some() && unread_body(&req);
    let call = inner.call(req);
    let res = match &signal {
        None => call.await?,
        Some(signal) => {
            // The handler may still be reading when policing stops its upload: the layer
            // answers in its place.
            let mut call = std::pin::pin!(call);
            let raced = std::future::poll_fn(|cx| {
                if let Poll::Ready(res) = call.as_mut().poll(cx) {
                    return Poll::Ready(Ok(res));
                }
                signal.poll_stopped(cx).map(Err)
            })
            .await;
            match raced {
                Ok(res) => res?,
                Err(why) => {
                    held.finish();
                    let res = config.stopped(limiter, &key, why, (grpc, collect));
                    let mut res = res.map(<Observing as Carry<ReqB, ResB>>::refusal);
                    if closes {
                        close(&mut res);
                    }
                    return Ok(res);
                }
            }
        }
    };
    // A socket nothing meters would let every message through: an upgrade whose handler did
    // not take its budget is refused (500), logged once and counted.
    #[cfg(feature = "ws")]
    if let Some(linger) = &linger {
        let counts = needs.request_messages() || needs.response_messages();
        if counts && res.status() == http::StatusCode::SWITCHING_PROTOCOLS && !linger.asked() {
            config.unmetered.seen(limiter.policy().name(), settings.dry_run);
            if !settings.dry_run {
                let res = super::websocket::unmetered_upgrade();
                return Ok(res.map(<Observing as Carry<ReqB, ResB>>::refusal));
            }
        }
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
    let mut meter = Meter::new(finish, counters, settled_by_head(&config, &head));
    // A response whose status gives the charge back is not metered: its units are settled at
    // nothing when it ends.
    let refunded = config.refunds(head.status);
    let response_bytes = needs.response_bytes() && !refunded;
    let response_messages = stream_messages && needs.response_messages() && !refunded;
    if mode.streams() && (response_bytes || (grpc && signal.is_some()) || response_messages) {
        // A plain HTTP response under way cannot be failed (its status is sent, its body's
        // error type is the handler's): policing shapes it, and a store error lets it on.
        let (mode, fail_open) = match grpc {
            true => (mode, fail_open),
            false => (StreamMode::Shape, true),
        };
        let gate = response_bytes.then(|| {
            let gate =
                Leases::new(limiter, key.clone(), priority, Unit::ResponseBytes, mode, fail_open);
            Box::new(gate) as Box<dyn Gate>
        });
        let trailers = grpc.then(|| {
            let config = Arc::clone(&config);
            Box::new(move |why: &Stopped| config.stop_trailers(policy, why)) as StopTrailers
        });
        let messages = response_messages.then(|| {
            let unit = Unit::ResponseMessages;
            let gate = Leases::new(limiter, key.clone(), priority, unit, mode, fail_open);
            (Box::new(gate.prepaid(prepaid)) as Box<dyn Gate>, Framer::default())
        });
        let signal = if grpc { signal } else { None };
        meter = meter.streamed(Streamed { gate, messages, signal, trailers });
    } else if let Some(streamed) = response_tally {
        meter = meter.streamed(streamed);
    }
    Ok(Response::from_parts(head, ResponseBody::metered(body, meter)))
}

/// A request held while its handler runs: when it ends before a response (stopped by
/// policing, or dropped), it settles the tiers metered by leases at nothing (their leases
/// charged what streamed), then releases its slots.
struct Holding<St: Store> {
    held: Option<Held<St>>,
    settled: SmallVec<[(Unit, u64); 2]>,
}

impl<St: Store> Holding<St> {
    /// The hold, finished by whatever ends the request (its response body, or an upgraded
    /// socket): with what that settles, and the tiers metered by leases at nothing unless it
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
            // Nothing metered by leases: dropped as before, keeping every estimate.
            Some(held) if self.settled.is_empty() => drop(held),
            Some(held) => held.finish(&self.settled),
            None => {}
        }
    }
}

/// What the response head settles for a held request: a refund gives back every unit it
/// counts (the slots are released when the body ends), a settled cost sets its requests.
fn settled_by_head<K, St: Store>(
    config: &Config<K, St>,
    head: &http::response::Parts,
) -> Vec<(Unit, u64)> {
    let settings = &config.settings;
    if config.refunds(head.status) {
        return vec![
            (Unit::Requests, 0),
            (Unit::RequestBytes, 0),
            (Unit::ResponseBytes, 0),
            (Unit::Reported, 0),
            (Unit::RequestMessages, 0),
            (Unit::ResponseMessages, 0),
        ];
    }
    match settings.settle_cost.as_ref().and_then(|f| f(head)) {
        Some(cost) => vec![(Unit::Requests, cost)],
        None => Vec::new(),
    }
}

/// Applies the refund predicate and the response-settled cost; otherwise commits.
/// Returns whether the charge changed.
async fn settle<K, St: Store>(
    config: &Config<K, St>,
    reservation: Reservation<St>,
    head: &http::response::Parts,
) -> bool {
    let settings = &config.settings;
    let refund = config.refunds(head.status);
    let cost = if refund { Some(0) } else { settings.settle_cost.as_ref().and_then(|f| f(head)) };
    let Some(cost) = cost else {
        reservation.commit();
        return false;
    };
    if let Err(error) = reservation.settle(cost).await {
        tracing::warn!(%error, "tollgate: could not settle a charge");
    }
    true
}

impl<K, St> RefundByStatus for Config<K, St>
where
    K: Send + Sync,
    St: Store,
{
    fn refund_by_status(
        &self,
        status: http::StatusCode,
        policy: usize,
        key: &Key,
        (cost, priority): (u64, crate::Priority),
        collect: bool,
    ) -> Option<Prepared> {
        if !self.refunds(status) {
            return None;
        }
        let limiter = self.limiter_at(policy);
        limiter.refund_sync(key, cost);
        let query = Check::new(key, 0).with_priority(priority);
        let Some(Ok(verdict)) = limiter.check_sync(query) else { return Some(Prepared::default()) };
        Some(limiter.surface().headers.prepare(self.settings.headers, &verdict.decision, collect))
    }
}
