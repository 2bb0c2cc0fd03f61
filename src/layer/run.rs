//! Every path that waits: a store doing I/O, shaping, a tarpit, a missing key, a store error;
//! then the refusal, or serving the admitted request.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use tower_service::Service;

use super::linger::refused;
use super::plan::Demand;
use super::serve::serve;
use super::service::{Carry, MeteredBy};
use super::{Config, MissingKey, Observed, OnStoreError};
use crate::decision::Decision;
use crate::error::StoreError;
use crate::headers::PreparedHeaders;
use crate::key::{Key, KeyExtractor, RequestHead};
use crate::limiter::Reservation;
use crate::rejection::Rejection;
use crate::store::{Check, Store, Verdict};

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
/// What `call` read and decided of a request before handing it on: its key (`None`: the
/// extractor found none), what it asks (`None`: not read yet) and the store's answer (`None`:
/// not asked yet).
pub(super) type Asked<T> = (Option<Key>, Option<Demand>, Option<Result<Verdict<T>, StoreError>>);

pub(super) async fn run<C, S, K, St, ReqB, ResB>(
    config: Arc<Config<K, St>>,
    (policy, collect): (usize, bool),
    inner: S,
    metered: MeteredBy<C, S, K, St, ReqB, ResB>,
    req: Request<C::Req>,
    (key, demand, decided): Asked<St::Ticket>,
) -> Result<Response<C::Res>, S::Error>
where
    C: Carry<ReqB, ResB>,
    S: Service<Request<C::Req>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    K: KeyExtractor,
    St: Store,
{
    // Read once: `call` read it when it tried to decide at once.
    let demand = demand.unwrap_or_else(|| Demand::read(&config, policy, &RequestHead::from(&req)));
    let grpc = demand.grpc(req.headers());
    let key = match key {
        Some(key) => key,
        None => match missing_key(&config, policy, &req, grpc) {
            Keyed::Key(key) => key,
            Keyed::Refused(res) => return Ok(refused(req, res).map(C::refusal)),
            Keyed::Pass => return pass::<C, _, _, _>(inner, req).await,
        },
    };
    let (reserved, permit, budget) = reserve(&config, policy, &key, &demand, decided).await;
    let limiter = config.limiter_at(policy);
    let reservation = match reserved {
        Ok(reservation) => {
            config.failing.recovered(limiter.policy().name());
            reservation
        }
        Err(error) => {
            drop(permit);
            let failed = (&key, grpc, error);
            return store_failed::<C, _, _, _, _, _>(&config, policy, inner, req, failed).await;
        }
    };
    let outcome = observed(&config, policy, &key, &req, reservation.decision());
    if outcome == Observed::Limited {
        drop(permit);
        let res = refuse_limited(&config, (policy, collect), &key, reservation, budget, grpc).await;
        return Ok(refused(req, res).map(C::refusal));
    }

    // Admitted (or dry run): wait for the reserved slot; a request dropped meanwhile gives it
    // back.
    let reservation = reservation.wait().await;
    drop(permit);
    let headers = if outcome == Observed::DryRunLimited {
        PreparedHeaders::default()
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
    grpc: bool,
) -> Keyed {
    let settings = &config.settings;
    match settings.missing_key {
        MissingKey::Reject(status) => {
            let why = config.key.explain_missing(&RequestHead::from(req));
            config.missing.refused(config.limiter_at(policy).policy().name(), &why);
            let explained = settings.explain_missing.then_some(why);
            Keyed::Refused(config.refuse(&Rejection::MissingKey { status, explained }, grpc))
        }
        MissingKey::Allow => Keyed::Pass,
        MissingKey::Shared => Keyed::Key(Key::Missing),
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
    (key, grpc, error): (&Key, bool, StoreError),
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
