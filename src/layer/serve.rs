//! Serving an admitted request whose policy meters nothing while it runs: its response head
//! settles the charge (a refund by status, a settled cost) before the response is handed on.

use http::{Request, Response};
use tower_service::Service;

use super::Config;
use super::service::Carry;
use crate::headers::PreparedHeaders;
use crate::key::Key;
use crate::limiter::Reservation;
use crate::quota::Unit;
use crate::store::Store;

/// Serves an admitted request whose policy meters nothing while it runs: its response head
/// settles the charge (a refund by status, a settled cost) before the response is handed on.
pub(super) async fn serve<C, S, K, St, ReqB, ResB>(
    config: &Config<K, St>,
    (policy, collect): (usize, bool),
    mut inner: S,
    req: Request<C::Req>,
    (key, priority): (&Key, crate::Priority),
    reservation: Reservation<St>,
    headers: PreparedHeaders,
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

/// What the response head settles for a held request: a refund gives back every unit it
/// counts (the slots are released when the body ends), a settled cost sets its requests.
pub(super) fn settled_by_head<K, St: Store>(
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
pub(super) async fn settle<K, St: Store>(
    config: &Config<K, St>,
    reservation: Reservation<St>,
    head: &http::response::Parts,
) -> bool {
    let settings = &config.settings;
    let refund = config.refunds(head.status);
    let cost = if refund { Some(0) } else { settings.settle_cost.as_ref().and_then(|f| f(head)) };
    let Some(cost) = cost else {
        reservation.keep();
        return false;
    };
    if let Err(error) = reservation.settle(cost).await {
        tracing::warn!(%error, "tollgate: could not settle a charge");
    }
    true
}
