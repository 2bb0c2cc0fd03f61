//! [`PacingLayer`], [`Pacing`] and its [`ResponseFuture`]: requests held until the server would
//! accept them, from what its responses said.
mod quota;
mod state;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response};
use tokio::time::Instant;
use tower_layer::Layer;
use tower_service::Service;

use crate::key::{Key, KeyExtractor, RequestHead};
use state::Partition;

/// Partitions beyond this many are swept of those that would delay nothing.
const MAX_PARTITIONS: usize = 4096;

/// The longest wait a response can impose (one year): later instants would overflow
/// [`Instant`], and no server means them.
const MAX_WAIT: Duration = Duration::from_secs(365 * 86_400);

/// The reports a quota keeps for the requests in flight, at most.
const MAX_RECENT: usize = 64;

/// The shortest span from which a refill rate is learned: over a shorter one the anchor's round
/// trip (in the span) and the unit given up for the whole part of `r` leave a weak bound.
const MIN_LEARNING_SPAN: Duration = Duration::from_secs(1);

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

/// A client-side Tower layer that paces requests by what the server said, holding each one
/// until the server would accept it instead of sending it to be refused. Each partition (by
/// default each server, [`AuthorityKey`]) is paced on its own, from the rate-limit fields of
/// its responses (see [how pacing works](super#how-pacing-works)).
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
///
/// Waits are not bounded by the layer: bound them with a timeout (`tower::timeout`) where a
/// server's daily quota could hold requests for hours. A request dropped while it waits takes
/// nothing. Time is tokio's ([`tokio::time::Instant`]), so tests under `tokio::time::pause()`
/// see exact delays. Clones of the layer, and every service it makes, share one state.
///
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
    /// A layer that keeps one state per `key` of a request, a request without a key going
    /// unpaced. [`GlobalKey`](crate::key::GlobalKey) paces everything together, and
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
            Ok(_) => Some(Duration::ZERO),
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

/// The service made by [`PacingLayer`]: holds each request until its partition's server would
/// accept it, then sends it and reads the response's rate-limit fields. See [`PacingLayer`] for
/// an example.
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
    inner_service_accessors!();
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
///
/// See [`PacingLayer`] for an example.
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
