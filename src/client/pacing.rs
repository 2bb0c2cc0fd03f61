//! [`PacingLayer`], [`Pacing`] and its [`ResponseFuture`]: requests held until the server would
//! accept them, from what its responses said.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tokio::sync::Notify;
use tokio::time::Instant;
use tower_layer::Layer;
use tower_service::Service;

use super::hints::{self, MAX_QUOTAS, Reported};
use crate::key::{Key, KeyExtractor, RequestHead};

/// Partitions beyond this many are swept of those that would delay nothing.
const MAX_PARTITIONS: usize = 4096;

/// The longest wait a response can impose (one year): later instants would overflow
/// [`Instant`], and no server means them.
const MAX_WAIT: Duration = Duration::from_secs(365 * 86_400);

/// The default partition key of [`PacingLayer`]: the URI's authority (host, lower-cased, and
/// port when the URI gives one), so every server is paced on its own. A request whose URI has
/// no authority (a relative URI) is not paced.
///
/// ```
/// use tollgate::client::AuthorityKey;
/// use tollgate::key::{Key, KeyExtractor, RequestHead};
///
/// let req = http::Request::get("https://API.example:8443/v1/items").body(()).unwrap();
/// assert_eq!(AuthorityKey.extract(&RequestHead::from(&req)), Some(Key::text("api.example:8443")));
/// let relative = http::Request::get("/v1/items").body(()).unwrap();
/// assert_eq!(AuthorityKey.extract(&RequestHead::from(&relative)), None);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct AuthorityKey;

impl KeyExtractor for AuthorityKey {
    fn extract(&self, head: &RequestHead<'_>) -> Option<Key> {
        let host = head.uri.host()?.to_ascii_lowercase();
        Some(match head.uri.port_u16() {
            Some(port) => Key::text(format!("{host}:{port}")),
            None => Key::text(host),
        })
    }
}

/// A client-side Tower layer that paces requests by what the server said: it delays a request
/// until the server would accept it, instead of sending it to be refused.
///
/// **What it reads**, from every response: the IETF `RateLimit-Policy` / `RateLimit` fields
/// (draft-ietf-httpapi-ratelimit-headers-10, RFC 9651 structured fields: for each quota policy,
/// `q` units per `w` seconds, `r` units remaining, full again in `t` seconds), else the common
/// `X-RateLimit-Limit` / `-Remaining` / `-Reset` (`Reset` in seconds from now, or, above 10^9,
/// a Unix timestamp taken relative to the response's `Date` header, else the system clock),
/// and a 429's `Retry-After` (RFC 9110 §10.2.3: delay-seconds, or an HTTP-date relative to the
/// response's `Date`). Fields that do not parse are ignored.
///
/// **What it keeps**, per partition (a [`KeyExtractor`] over the request; default
/// [`AuthorityKey`], one partition per server): for each quota, the units believed left and
/// when it is full again, and until when a 429 asked to wait. Requests whose partition the
/// layer knows nothing about go at once.
///
/// **How it paces**: a request waits while a 429's `Retry-After` runs, and while any quota of
/// its partition has no unit left, until that quota is full again (its `t`; the quota's `q` is
/// then believed left, less the requests still in flight) or until a response says more. A
/// request that goes reserves one unit of every quota before it is sent, so concurrent
/// requests never send more than the server last allowed. Every response corrects the count:
/// the units it reports left, less the other requests still in flight (which the server may
/// not have counted yet), and never more than was believed left until the quota's reset, so a
/// late response cannot bring back units already spent. A quota reported without a reset time
/// (`t`) and with nothing left is forgotten when no request is in flight to tell more.
///
/// Waits are not bounded by the layer: bound them with a timeout (`tower::timeout`) where a
/// server's daily quota could hold requests for hours. A request dropped while it waits takes
/// nothing. Time is tokio's ([`tokio::time::Instant`]), so tests under `tokio::time::pause()`
/// see exact delays. Clones of the layer, and every service it makes, share one state.
///
/// ```
/// use std::convert::Infallible;
/// use std::time::Duration;
/// use http::{Request, Response};
/// use tollgate::client::PacingLayer;
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// // A server that allows one request per 5 seconds and says so.
/// let server = service_fn(|_req: Request<()>| async {
///     let res = Response::builder()
///         .header("ratelimit-policy", r#""slow";q=1;w=5"#)
///         .header("ratelimit", r#""slow";r=0;t=5"#)
///         .body(())
///         .unwrap();
///     Ok::<_, Infallible>(res)
/// });
/// let client = PacingLayer::new().layer(server);
/// let start = tokio::time::Instant::now();
/// for _ in 0..3 {
///     let req = Request::get("http://api.example/").body(()).unwrap();
///     client.clone().oneshot(req).await.unwrap();
/// }
/// assert_eq!(start.elapsed(), Duration::from_secs(10)); // sent at 0 s, 5 s and 10 s
/// # }
/// ```
pub struct PacingLayer<K = AuthorityKey> {
    shared: Arc<Shared<K>>,
}

impl<K> Clone for PacingLayer<K> {
    fn clone(&self) -> Self {
        Self { shared: Arc::clone(&self.shared) }
    }
}

impl<K: fmt::Debug> fmt::Debug for PacingLayer<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PacingLayer")
            .field("partition", &self.shared.key)
            .field("partitions", &self.shared.len())
            .finish()
    }
}

impl PacingLayer {
    /// A layer that paces each server ([`AuthorityKey`]) on its own.
    #[must_use]
    pub fn new() -> Self {
        Self::with_partition(AuthorityKey)
    }
}

impl Default for PacingLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: KeyExtractor> PacingLayer<K> {
    /// A layer that partitions requests by `key`: one state per key, requests without a key
    /// are not paced. [`GlobalKey`](crate::key::GlobalKey) paces everything together;
    /// [`HeaderKey`](crate::key::HeaderKey) on an API key header paces each credential.
    #[must_use]
    pub fn with_partition(key: K) -> Self {
        Self { shared: Arc::new(Shared { key, partitions: Mutex::new(HashMap::new()) }) }
    }

    /// How long a request of `head` would wait if it were sent now (zero when it would go at
    /// once), from what the server said so far. Reserves nothing.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::client::PacingLayer;
    /// use tollgate::key::RequestHead;
    ///
    /// let layer = PacingLayer::new();
    /// let req = http::Request::get("http://api.example/").body(()).unwrap();
    /// assert_eq!(layer.delay(&RequestHead::from(&req)), Some(Duration::ZERO)); // unknown: go
    /// ```
    ///
    /// `None` when the request waits for a response in flight rather than for an instant.
    #[must_use]
    pub fn delay(&self, head: &RequestHead<'_>) -> Option<Duration> {
        let Some(partition) = self.shared.existing(head) else { return Some(Duration::ZERO) };
        let now = Instant::now();
        match partition.lock().clone().try_reserve(now) {
            Ok(()) => Some(Duration::ZERO),
            Err(Some(until)) => Some(until.saturating_duration_since(now)),
            Err(None) => None,
        }
    }
}

impl<S, K> Layer<S> for PacingLayer<K> {
    type Service = Pacing<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        Pacing { inner, shared: Arc::clone(&self.shared) }
    }
}

/// The state shared by a layer and its services.
struct Shared<K> {
    key: K,
    partitions: Mutex<HashMap<Key, Arc<Partition>>>,
}

impl<K> Shared<K> {
    fn len(&self) -> usize {
        self.partitions.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

impl<K: KeyExtractor> Shared<K> {
    /// The partition of a request, if the layer knows it.
    fn existing(&self, head: &RequestHead<'_>) -> Option<Arc<Partition>> {
        let key = self.key.extract(head)?;
        self.partitions.lock().unwrap_or_else(PoisonError::into_inner).get(&key).cloned()
    }

    /// The partition of a request, made on first use; `None` when the request has no key.
    fn partition(&self, head: &RequestHead<'_>) -> Option<Arc<Partition>> {
        let key = self.key.extract(head)?;
        let mut map = self.partitions.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(p) = map.get(&key) {
            return Some(Arc::clone(p));
        }
        if map.len() >= MAX_PARTITIONS {
            // Forget the partitions that no request holds and that would delay nothing.
            let now = Instant::now();
            map.retain(|_, p| Arc::strong_count(p) > 1 || !p.lock().is_idle(now));
        }
        let partition = Arc::new(Partition::default());
        map.insert(key, Arc::clone(&partition));
        Some(partition)
    }
}

/// What one partition's server said, and the requests it has in flight.
#[derive(Default)]
struct Partition {
    state: Mutex<State>,
    /// Woken when a response arrives or a request ends: waiters look again.
    changed: Notify,
}

impl Partition {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reserves a place now, if the server would accept a request now.
    fn try_acquire(self: &Arc<Self>) -> Option<Ticket> {
        self.lock().try_reserve(Instant::now()).ok()?;
        Some(Ticket { partition: Arc::clone(self), open: true })
    }

    /// Waits until the server would accept a request, and reserves its place.
    async fn acquire(self: Arc<Self>) -> Ticket {
        loop {
            // Registered before looking, so a change between the look and the wait wakes us.
            let notified = self.changed.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            let now = Instant::now();
            let outcome = self.lock().try_reserve(now);
            match outcome {
                Ok(()) => return Ticket { partition: Arc::clone(&self), open: true },
                Err(Some(until)) => {
                    tracing::trace!(wait = ?until.saturating_duration_since(now), "tollgate: pacing");
                    let _ = tokio::time::timeout_at(until, notified).await;
                }
                Err(None) => notified.await,
            }
        }
    }
}

/// One quota of a partition, as last reported and counted down locally since.
#[derive(Debug, Clone)]
struct Quota {
    /// The quota policy's name (`None`: the legacy `X-RateLimit-*` fields).
    name: Option<Box<str>>,
    /// Units per window, when reported: what is left once the quota is full again.
    limit: Option<u64>,
    /// Units believed left.
    remaining: u64,
    /// When the quota is full again; `None` after the layer refilled it and before a response
    /// said when.
    reset_at: Option<Instant>,
}

#[derive(Debug, Default, Clone)]
struct State {
    quotas: Vec<Quota>,
    /// A 429's `Retry-After`: no request before this.
    blocked_until: Option<Instant>,
    /// Requests sent and not yet answered.
    in_flight: u64,
}

/// `now + d`, capped at [`MAX_WAIT`].
fn after(now: Instant, d: Duration) -> Instant {
    now + d.min(MAX_WAIT)
}

impl State {
    /// Reserves one unit of every quota when each has one (the request may go), or says
    /// until when to wait: `Some(instant)`, or `None` for "until a response in flight".
    fn try_reserve(&mut self, now: Instant) -> Result<(), Option<Instant>> {
        if let Some(until) = self.blocked_until {
            if now < until {
                return Err(Some(until));
            }
            self.blocked_until = None;
        }
        let in_flight = self.in_flight;
        self.quotas.retain_mut(|q| {
            if q.reset_at.is_some_and(|at| now >= at) {
                // Full again, less what is in flight; an unknown limit makes it unknown.
                let Some(limit) = q.limit else { return false };
                q.remaining = limit.saturating_sub(in_flight);
                q.reset_at = None;
            }
            // Nothing left, no reset to wait for, no response to come: nothing to wait on.
            !(q.remaining == 0 && q.reset_at.is_none() && in_flight == 0)
        });
        let mut exhausted = false;
        let mut until: Option<Instant> = None;
        for q in self.quotas.iter().filter(|q| q.remaining == 0) {
            exhausted = true;
            if let Some(at) = q.reset_at {
                until = Some(until.map_or(at, |u| u.max(at)));
            }
        }
        if exhausted {
            return Err(until);
        }
        for q in &mut self.quotas {
            q.remaining -= 1;
        }
        self.in_flight += 1;
        Ok(())
    }

    /// Whether a request would go now and nothing is in flight.
    fn is_idle(&self, now: Instant) -> bool {
        self.in_flight == 0 && self.clone().try_reserve(now).is_ok()
    }

    /// Takes in what the response to one of the requests in flight said.
    fn observe(
        &mut self,
        now: Instant,
        status: StatusCode,
        reported: Vec<Reported>,
        retry_after: Option<Duration>,
    ) {
        // The other requests in flight may not have been counted by the server yet.
        let others = self.in_flight.saturating_sub(1);
        for r in reported {
            let left = r.remaining.saturating_sub(others);
            let reset_at = r.reset.map(|t| after(now, t));
            match self.quotas.iter().position(|q| q.name == r.name) {
                Some(i) => {
                    let q = &mut self.quotas[i];
                    if r.limit.is_some() {
                        q.limit = r.limit;
                    }
                    if q.reset_at.is_some_and(|at| now >= at) {
                        // What was known is out of date: the server's word replaces it.
                        q.remaining = left;
                        q.reset_at = reset_at;
                    } else {
                        // Within one window, units spent do not come back: responses may
                        // arrive out of order.
                        q.remaining = q.remaining.min(left);
                        q.reset_at = match (q.reset_at, reset_at) {
                            (Some(a), Some(b)) => Some(a.max(b)),
                            (a, b) => a.or(b),
                        };
                    }
                }
                None if self.quotas.len() < MAX_QUOTAS => self.quotas.push(Quota {
                    name: r.name,
                    limit: r.limit,
                    remaining: left,
                    reset_at,
                }),
                None => {}
            }
        }
        if status == StatusCode::TOO_MANY_REQUESTS {
            if let Some(wait) = retry_after {
                let until = after(now, wait);
                self.blocked_until = Some(self.blocked_until.map_or(until, |b| b.max(until)));
            }
        }
    }
}

/// A request's place in its partition: released when the response is read or the request is
/// dropped.
struct Ticket {
    partition: Arc<Partition>,
    open: bool,
}

impl Ticket {
    /// Reads the response's rate-limit fields into the partition and releases the place.
    fn observe<B>(mut self, res: &Response<B>) {
        let headers = res.headers();
        let reported = hints::reported(headers);
        let retry_after = hints::retry_after(headers);
        {
            let mut state = self.partition.lock();
            state.observe(Instant::now(), res.status(), reported, retry_after);
            state.in_flight = state.in_flight.saturating_sub(1);
        }
        self.open = false;
        self.partition.changed.notify_waiters();
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.open {
            {
                let mut state = self.partition.lock();
                state.in_flight = state.in_flight.saturating_sub(1);
            }
            self.partition.changed.notify_waiters();
        }
    }
}

/// The service made by [`PacingLayer`]: holds each request until its partition's server would
/// accept it, then sends it and reads the response's rate-limit fields.
///
/// `poll_ready` is the inner service's. A request that may go at once is sent on the service
/// that was polled ready; one that must wait is sent, after the wait, on that service taken out
/// of `self` (a clone takes its place), as tower's discipline asks.
pub struct Pacing<S, K = AuthorityKey> {
    inner: S,
    shared: Arc<Shared<K>>,
}

impl<S: Clone, K> Clone for Pacing<S, K> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone(), shared: Arc::clone(&self.shared) }
    }
}

impl<S: fmt::Debug, K> fmt::Debug for Pacing<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pacing").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl<S, K> Pacing<S, K> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Consumes the pacing service, returning the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, K, ReqB, ResB> Service<Request<ReqB>> for Pacing<S, K>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: 'static,
    K: KeyExtractor,
    ReqB: Send + 'static,
    ResB: 'static,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = ResponseFuture<Response<ResB>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let Some(partition) = self.shared.partition(&RequestHead::from(&req)) else {
            return ResponseFuture::new(self.inner.call(req));
        };
        if let Some(ticket) = partition.try_acquire() {
            let future = self.inner.call(req);
            return ResponseFuture::new(async move {
                let res = future.await;
                if let Ok(res) = &res {
                    ticket.observe(res);
                }
                res
            });
        }
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(async move {
            let ticket = partition.acquire().await;
            let res = inner.call(req).await;
            if let Ok(res) = &res {
                ticket.observe(res);
            }
            res
        })
    }
}

/// The response future of [`Pacing`]: the wait for the partition, then the inner service's
/// future (boxed, as the wait is an `async` state machine). `T` is the response, `E` the inner
/// service's error, passed through unchanged.
pub struct ResponseFuture<T, E> {
    inner: Pin<Box<dyn Future<Output = Result<T, E>> + Send>>,
}

impl<T, E> ResponseFuture<T, E> {
    fn new(future: impl Future<Output = Result<T, E>> + Send + 'static) -> Self {
        Self { inner: Box::pin(future) }
    }
}

impl<T, E> fmt::Debug for ResponseFuture<T, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<T, E> Future for ResponseFuture<T, E> {
    type Output = Result<T, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(remaining: u64, reset: Option<u64>) -> Reported {
        Reported {
            name: Some("q".into()),
            limit: Some(10),
            remaining,
            reset: reset.map(Duration::from_secs),
        }
    }

    fn remaining(state: &State) -> Vec<u64> {
        state.quotas.iter().map(|q| q.remaining).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn units_spent_in_a_window_do_not_come_back_from_late_responses() {
        let now = Instant::now();
        let mut state = State::default();
        for _ in 0..3 {
            state.try_reserve(now).unwrap();
        }
        // Answers in the order the server did not decide them: r=7 arrives after r=5.
        state.observe(now, StatusCode::OK, vec![quota(5, Some(1))], None);
        state.in_flight -= 1;
        assert_eq!(remaining(&state), [3], "r=5 less the two others still in flight");
        state.observe(now, StatusCode::OK, vec![quota(7, Some(1))], None);
        state.in_flight -= 1;
        assert_eq!(remaining(&state), [3], "a stale r=7 does not bring units back");
        state.observe(now, StatusCode::OK, vec![quota(6, Some(1))], None);
        state.in_flight -= 1;
        assert_eq!(remaining(&state), [3]);
        assert_eq!(state.in_flight, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_quota_full_again_is_refilled_less_what_is_in_flight() {
        let now = Instant::now();
        let mut state = State::default();
        state.try_reserve(now).unwrap();
        state.observe(now, StatusCode::OK, vec![quota(1, Some(2))], None);
        state.in_flight -= 1;
        // One left: one request goes, the next waits for the reset at 2 s.
        state.try_reserve(now).unwrap();
        assert_eq!(state.try_reserve(now), Err(Some(now + Duration::from_secs(2))));
        // At 2 s, with that request still in flight: 10 - 1 = 9 left, one taken now.
        let later = now + Duration::from_secs(2);
        state.try_reserve(later).unwrap();
        assert_eq!(remaining(&state), [8]);
        assert_eq!(state.quotas[0].reset_at, None);
        assert_eq!(state.in_flight, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn an_exhausted_quota_without_a_reset_waits_for_answers_then_is_forgotten() {
        let now = Instant::now();
        let mut state = State::default();
        state.try_reserve(now).unwrap();
        state.try_reserve(now).unwrap();
        let no_reset = Reported { name: Some("q".into()), limit: None, remaining: 0, reset: None };
        state.observe(now, StatusCode::OK, vec![no_reset], None);
        state.in_flight -= 1;
        // Nothing left and no reset time: wait for the response still in flight.
        assert_eq!(state.try_reserve(now), Err(None));
        state.in_flight -= 1;
        // Nothing more will come: the quota is forgotten, the request goes.
        assert_eq!(state.try_reserve(now), Ok(()));
        assert!(state.quotas.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_429_blocks_until_its_retry_after_and_huge_values_do_not_overflow() {
        let now = Instant::now();
        let mut state = State::default();
        state.try_reserve(now).unwrap();
        state.observe(now, StatusCode::TOO_MANY_REQUESTS, vec![], Some(Duration::from_secs(3)));
        state.in_flight -= 1;
        assert_eq!(state.try_reserve(now), Err(Some(now + Duration::from_secs(3))));
        state.observe(now, StatusCode::TOO_MANY_REQUESTS, vec![], Some(Duration::MAX));
        assert_eq!(state.try_reserve(now), Err(Some(now + MAX_WAIT)));
        // A 503's Retry-After is the retry policy's business, not the pacing's.
        let mut state = State::default();
        state.observe(now, StatusCode::SERVICE_UNAVAILABLE, vec![], Some(Duration::from_secs(3)));
        assert_eq!(state.try_reserve(now), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn quotas_per_partition_are_bounded() {
        let now = Instant::now();
        let mut state = State::default();
        for round in 0..3 {
            let reported = (0..MAX_QUOTAS)
                .map(|i| Reported {
                    name: Some(format!("q{round}-{i}").into()),
                    limit: Some(5),
                    remaining: 5,
                    reset: Some(Duration::from_secs(1)),
                })
                .collect();
            state.observe(now, StatusCode::OK, reported, None);
        }
        assert_eq!(state.quotas.len(), MAX_QUOTAS);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_partitions_are_swept_when_there_are_too_many() {
        let layer = PacingLayer::new();
        let head = |i: usize| {
            http::Request::get(format!("http://h{i}.test/")).body(()).unwrap().into_parts().0
        };
        let busy = layer.shared.partition(&RequestHead::from(&head(0))).unwrap();
        busy.lock().blocked_until = Some(Instant::now() + Duration::from_secs(5));
        drop(busy);
        for i in 1..MAX_PARTITIONS {
            layer.shared.partition(&RequestHead::from(&head(i)));
        }
        assert_eq!(layer.shared.len(), MAX_PARTITIONS);
        // One more: every idle partition goes, the one that still delays stays.
        layer.shared.partition(&RequestHead::from(&head(MAX_PARTITIONS)));
        assert_eq!(layer.shared.len(), 2);
        assert_eq!(layer.delay(&RequestHead::from(&head(0))), Some(Duration::from_secs(5)));
    }
}
