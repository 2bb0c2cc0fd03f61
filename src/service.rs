//! [`RateLimit`], the service.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response, StatusCode, header};
use tower_service::Service;

use crate::decision::Decision;
use crate::error::StoreError;
use crate::future::{BoxError, ResponseFuture};
use crate::key::{Key, KeyExtractor};
use crate::layer::{Config, MissingKey, OnStoreError};
use crate::response::{problem, too_many_requests};
use crate::store::{Check, Store, Ticket, Verdict};

/// The rate-limiting service made by [`RateLimitLayer`](crate::RateLimitLayer).
///
/// Decides in `call`, never in `poll_ready` (which is delegated to the inner service), so no
/// capacity is taken for a request that never comes. Limits become responses; the inner
/// service's error passes through unchanged.
pub struct RateLimit<S, K, St> {
    inner: S,
    config: Arc<Config<K, St>>,
}

impl<S: Clone, K, St> Clone for RateLimit<S, K, St> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone(), config: Arc::clone(&self.config) }
    }
}

impl<S: fmt::Debug, K, St> fmt::Debug for RateLimit<S, K, St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimit")
            .field("inner", &self.inner)
            .field("policy", &self.config.policy.name())
            .finish_non_exhaustive()
    }
}

impl<S, K, St> RateLimit<S, K, St> {
    pub(crate) fn new(inner: S, config: Arc<Config<K, St>>) -> Self {
        Self { inner, config }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the limiter, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, K, St, ReqB, ResB> Service<Request<ReqB>> for RateLimit<S, K, St>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    K: KeyExtractor,
    St: Store,
    ReqB: Send + 'static,
    ResB: http_body::Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let config = &self.config;
        let (parts, body) = req.into_parts();
        let key = config.key.extract(&parts);
        // The common case, decided here and now: policing, a key, and a store that answers
        // without I/O. Whatever has to wait goes to `run`, with the decision already made.
        let mut decided = None;
        if let (Some(key), None, false) = (&key, config.settings.max_delay, config.settings.dry_run)
        {
            let cost = cost(config, &parts);
            let check = Check {
                policy: &config.policy,
                key,
                cost,
                max_delay: None,
                reserve: reserve(config, None),
            };
            match config.store.check_sync(check) {
                Some(Ok(Verdict { decision, ticket: None })) if decision.is_allowed() => {
                    let headers = config.headers.prepare(&decision);
                    // Called here and now: the service that was polled ready, no clone.
                    let future = self.inner.call(Request::from_parts(parts, body));
                    return ResponseFuture::inner(future, headers);
                }
                Some(Ok(verdict))
                    if !verdict.decision.is_allowed() && config.settings.tarpit.is_none() =>
                {
                    return ResponseFuture::ready(reject(config, key, &verdict.decision));
                }
                Some(result) => decided = Some((cost, result)),
                None => {}
            }
        }
        // Called later: take the service that was polled ready, leave a fresh clone in its place.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = Arc::clone(&self.config);
        ResponseFuture::slow(Box::pin(run(config, inner, parts, body, key, decided)))
    }
}

/// The request's cost in units.
fn cost<K, St>(config: &Config<K, St>, parts: &Parts) -> u64 {
    config.settings.cost.as_ref().map_or(1, |f| f(parts))
}

/// Whether to ask for a ticket: when the charge may be given back — a refund or settlement from
/// the response, or a shaped wait (`max_delay`) that may be cancelled.
fn reserve<K, St>(config: &Config<K, St>, max_delay: Option<std::time::Duration>) -> bool {
    max_delay.is_some()
        || config.settings.refund_if.is_some()
        || config.settings.settle_cost.is_some()
}

/// The response to a rejected request, with its rate-limit headers.
fn reject<K, St>(config: &Config<K, St>, key: &Key, decision: &Decision) -> Response<Body> {
    tracing::debug!(policy = config.policy.name(), %key, outcome = ?decision.outcome(), "tollgate: limited");
    let mut res = match &config.settings.rejection {
        Some(f) => f(decision),
        None => too_many_requests(&config.policy, decision),
    };
    config.headers.write(res.headers_mut(), decision);
    res
}

/// Gives a shaped reservation back if the request is dropped while it waits for its slot.
struct CancelOnDrop<St: Store> {
    store: St,
    ticket: Option<Ticket>,
}

impl<St: Store> CancelOnDrop<St> {
    /// The wait is over: keep the charge.
    fn disarm(mut self) -> Option<Ticket> {
        self.ticket.take()
    }
}

impl<St: Store> Drop for CancelOnDrop<St> {
    fn drop(&mut self) {
        let Some(ticket) = self.ticket.take() else { return };
        tracing::debug!(policy = ticket.policy().name(), "tollgate: waiter dropped; slot returned");
        let settle = self.store.settle(ticket, 0);
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(settle);
        }
    }
}

/// Every path that waits: a store doing I/O, shaping, a tarpit, a settlement, a missing key, a
/// store error. `decided` is the `(cost, result)` when `call` already asked the store.
async fn run<S, K, St, ReqB, ResB>(
    config: Arc<Config<K, St>>,
    mut inner: S,
    parts: Parts,
    body: ReqB,
    key: Option<Key>,
    decided: Option<(u64, Result<Verdict, StoreError>)>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<ReqB>, Response = Response<ResB>>,
    K: KeyExtractor,
    St: Store,
    ResB: http_body::Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let key = match key {
        Some(key) => key,
        None => match config.settings.missing_key {
            MissingKey::Reject(status) => {
                tracing::debug!(policy = config.policy.name(), "tollgate: request without a key");
                return Ok(problem(
                    status,
                    "about:blank",
                    status.canonical_reason().unwrap_or("Bad Request"),
                    "no rate-limit key could be read from the request",
                    &[],
                ));
            }
            MissingKey::Allow => {
                let res = inner.call(Request::from_parts(parts, body)).await?;
                return Ok(res.map(Body::new));
            }
            MissingKey::Shared => Key::Missing,
        },
    };

    let mut permit = None;
    let result = match decided {
        Some((_, result)) => result,
        None => {
            let cost = cost(&config, &parts);
            // A place in the waiting room, taken before deciding so a full room polices instead
            // of reserving slots it cannot wait for.
            permit = match (&config.waiters, config.settings.max_delay) {
                (Some(sem), Some(_)) if !config.settings.dry_run => {
                    Arc::clone(sem).try_acquire_owned().ok()
                }
                _ => None,
            };
            let max_delay = permit.as_ref().and(config.settings.max_delay);
            let reserve = reserve(&config, max_delay);
            let check = Check { policy: &config.policy, key: &key, cost, max_delay, reserve };
            config.store.check(check).await
        }
    };
    let verdict = match result {
        Ok(v) => v,
        Err(error) => {
            drop(permit);
            return match config.settings.on_store_error {
                OnStoreError::FailOpen => {
                    tracing::warn!(%error, policy = config.policy.name(), "tollgate: store failed; failing open");
                    let res = inner.call(Request::from_parts(parts, body)).await?;
                    Ok(res.map(Body::new))
                }
                OnStoreError::FailClosed => {
                    tracing::warn!(%error, policy = config.policy.name(), "tollgate: store failed; failing closed");
                    let mut res = problem(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "about:blank",
                        "Service Unavailable",
                        "the rate limiter cannot decide right now",
                        &[],
                    );
                    res.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                    Ok(res)
                }
            };
        }
    };
    let decision = verdict.decision;

    if !decision.is_allowed() && !config.settings.dry_run {
        drop(permit);
        if let Some(delay) = config.settings.tarpit {
            // Only with a place in the waiting room: a flood is answered at once, not held.
            if let Some(_place) = config.waiters.as_ref().and_then(|w| w.try_acquire().ok()) {
                tokio::time::sleep(delay).await;
            }
        }
        return Ok(reject(&config, &key, &decision));
    }

    let mut ticket = verdict.ticket;
    if !decision.delay().is_zero() {
        tracing::debug!(policy = config.policy.name(), %key, delay = ?decision.delay(), "tollgate: delayed");
        let guard = CancelOnDrop { store: config.store.clone(), ticket: ticket.take() };
        tokio::time::sleep(decision.delay()).await;
        ticket = guard.disarm();
    }
    drop(permit);

    // From here the request is served: dropping it (a client disconnect) keeps the charge.
    let res = inner.call(Request::from_parts(parts, body)).await?;
    let (mut head, body) = res.into_parts();
    if let Some(ticket) = ticket {
        settle(&config, ticket, &head).await;
    }
    config.headers.write(&mut head.headers, &decision);
    Ok(Response::from_parts(head, Body::new(body)))
}

/// Applies the refund predicate and the response-settled cost.
async fn settle<K, St: Store>(
    config: &Config<K, St>,
    ticket: Ticket,
    head: &http::response::Parts,
) {
    let refund = config.settings.refund_if.as_ref().is_some_and(|f| f(head.status));
    let cost =
        if refund { Some(0) } else { config.settings.settle_cost.as_ref().and_then(|f| f(head)) };
    let Some(cost) = cost else { return };
    if cost == ticket.cost() {
        return;
    }
    if let Err(error) = config.store.settle(ticket, cost).await {
        tracing::warn!(%error, "tollgate: could not settle a charge");
    }
}
