//! The decision made in `call`: a request's route, key and check, answered at once when the
//! store can (policing, a store without I/O), else handed to [`run`](super::run::run).

use std::sync::Arc;

use http::{Request, Response};
use tower_service::Service;

use super::future::{Refund, RefundByStatus, State, Untracked};
use super::linger::refused;
use super::plan::Demand;
use super::run::run;
use super::scope::Route;
use super::service::{Carry, MeteredBy};
use super::{Config, Observed};
use crate::error::StoreError;
use crate::grpc::is_grpc;
use crate::headers::PreparedHeaders;
use crate::key::{Key, KeyExtractor, RequestHead};
use crate::rejection::Rejection;
use crate::store::{Check, Store, Verdict};

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
    let mut req = req;
    let head = RequestHead::from(&req);
    // Filters, allow-lists and the selector, only when one is set.
    let mut policy = 0;
    if let Some(scope) = &config.scope {
        match scope.route(&head, |name| config.position(name)) {
            Route::Limit(i) => policy = i,
            // Called here and now: the service that was polled ready, no clone.
            Route::Pass => {
                return State::inner(inner.call(C::request(req)), PreparedHeaders::default(), None);
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
            return State::inner(inner.call(C::request(req)), PreparedHeaders::default(), None);
        }
    }
    // The common case, decided here and now: policing, a key, and a store that answers
    // without I/O. Whatever has to wait goes to `run`, with what was read and decided.
    let (mut decided, mut demand) = (None, None);
    if let (Some(key), true) = (&key, config.plan_at(policy).at_once) {
        let read = Demand::read(config, policy, &head);
        match at_once::<C, _, _, _, _, _>(inner, shared, (policy, collect), key, &read, req) {
            AtOnce::Answered(state) => return state,
            AtOnce::Later(answer, req_back) => {
                (decided, demand, req) = (answer, Some(read), req_back);
            }
        }
    }
    // Called later: take the service that was polled ready, leave a fresh clone in its place.
    let clone = inner.clone();
    let inner = std::mem::replace(inner, clone);
    let config = Arc::clone(shared);
    let req = C::request(req);
    let asked = (key, demand, decided);
    let future = run::<C, _, _, _, _, _>(config, (policy, collect), inner, metered, req, asked);
    State::slow(Box::pin(future))
}

/// What [`at_once`] did with a request.
enum AtOnce<F, R, E, T, B> {
    /// Answered here: admitted (the inner service called), or refused.
    Answered(State<F, R, E>),
    /// To be decided or answered later: the store's answer if it gave one, and the request.
    Later(Option<Result<Verdict<T>, StoreError>>, Request<B>),
}

/// Checks a policed request on a store that answers without I/O, as `demand` says, and
/// answers it when that is all it takes: admitted without anything to meter (the headers
/// prepared, the charge a status may give back kept beside), or refused without a tarpit.
#[inline]
#[allow(clippy::type_complexity)]
fn at_once<C, S, K, St, ReqB, ResB>(
    inner: &mut S,
    shared: &Arc<Config<K, St>>,
    (policy, collect): (usize, bool),
    key: &Key,
    demand: &Demand,
    req: Request<ReqB>,
) -> AtOnce<S::Future, C::Res, S::Error, St::Ticket, ReqB>
where
    C: Carry<ReqB, ResB>,
    S: Service<Request<C::Req>, Response = Response<ResB>>,
    K: KeyExtractor,
    St: Store,
    ReqB: http_body::Body + Send + 'static,
{
    let config = &**shared;
    let (limiter, plan) = (config.limiter_at(policy), config.plan_at(policy));
    let mut check = Check::new(key, demand.cost).with_priority(demand.priority);
    if let Some(costs) = &demand.costs {
        check = check.with_costs(costs);
    }
    check.ticket = plan.ticket;
    let verdict = match limiter.check_sync(check) {
        None => return AtOnce::Later(None, req),
        Some(Ok(verdict)) => verdict,
        Some(error) => return AtOnce::Later(Some(error), req),
    };
    let admitted = verdict.decision.is_allowed();
    if admitted && (verdict.ticket.is_none() || plan.answers_with_ticket) {
        let outcome = Observed::Admitted;
        if config.observer.active() {
            let head = RequestHead::from(&req);
            let seen = (limiter.policy(), key, &head);
            config.observer.at_once(policy, seen, &verdict.decision, outcome);
        }
        let fields = config.settings.headers;
        let headers = limiter.surface().headers.prepare(fields, &verdict.decision, collect);
        // Called here and now: the service that was polled ready, no clone.
        let future = inner.call(C::request(req));
        let refund = Refunding { shared, policy, key, demand, collect };
        return AtOnce::Answered(refund.state(future, headers, verdict.ticket));
    }
    if admitted || config.settings.tarpit.is_some() {
        return AtOnce::Later(Some(Ok(verdict)), req);
    }
    if config.observer.active() {
        let head = RequestHead::from(&req);
        let seen = (limiter.policy(), key, &head);
        config.observer.at_once(policy, seen, &verdict.decision, Observed::Limited);
    }
    let grpc = demand.grpc(req.headers());
    let res = config.reject(limiter, key, verdict.decision, None, grpc, collect);
    AtOnce::Answered(State::ready(refused(req, res).map(C::refusal)))
}

/// What a request admitted at once needs to give its charge back when its response's status
/// says so (a `405`, `refund_if`).
struct Refunding<'a, K, St: Store> {
    shared: &'a Arc<Config<K, St>>,
    policy: usize,
    key: &'a Key,
    demand: &'a Demand,
    collect: bool,
}

impl<K, St> Refunding<'_, K, St>
where
    K: KeyExtractor,
    St: Store,
{
    /// The state of an admitted request: its inner `future` and `headers`, with what gives
    /// its charge back: by key when it came without a `ticket` (and the store gives back
    /// exactly that way), else by settling the ticket at nothing.
    #[inline]
    fn state<F, R, E>(
        self,
        future: F,
        headers: PreparedHeaders,
        ticket: Option<St::Ticket>,
    ) -> State<F, R, E> {
        let Self { shared, policy, key, demand, collect } = self;
        let priority = demand.priority;
        let Some(ticket) = ticket else {
            if !shared.plan_at(policy).untracked {
                return State::inner(future, headers, None);
            }
            let charge = Untracked {
                hook: Arc::clone(shared) as Arc<dyn RefundByStatus>,
                policy,
                key: key.clone(),
                cost: demand.cost,
                any_status: shared.plan_at(policy).refund_if,
                collect,
                priority,
            };
            return State::inner(future, headers, Some(charge));
        };
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
        State::refundable(future, headers, refund)
    }
}
