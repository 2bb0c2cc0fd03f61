//! What the outage scenarios (`faults`, `redis_busy`, `sentinel`, `sentinel_slots`) share: the
//! failure policy a scenario configures, the request and key they send, connecting on a busy
//! machine, and waiting for the sentinels to promote the replica.
#![cfg(feature = "redis")]
use crate::support;

use std::convert::Infallible;
use std::time::{Duration, Instant};

use axum::body::Body;
use http::{Request, Response};
use support::redis::Sentinels;
use tollgate::OnStoreError;
use tollgate::key::Key;
use tollgate::store::{MemoryStore, RedisStore, RedisStoreBuilder};
use tower::Service;

/// What a request may take beyond the store's timeout: the fallback decision and scheduling on
/// a busy 2-core machine.
pub(crate) const MARGIN: Duration = Duration::from_millis(250);
/// How long the sentinels get to promote the replica.
pub(crate) const FAILOVER_LIMIT: Duration = Duration::from_secs(15);

/// What a store that cannot reach Redis does: decide with the local fallback, or fail the
/// request closed or open (the layer's `OnStoreError`, without a fallback).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Configured {
    Fallback,
    FailClosed,
    FailOpen,
}

impl Configured {
    pub(crate) const ALL: [Self; 3] = [Self::Fallback, Self::FailClosed, Self::FailOpen];

    /// The store `builder` makes, with the local fallback or without one.
    pub(crate) fn build(self, builder: RedisStoreBuilder) -> RedisStore {
        with_fallback(builder, self == Self::Fallback)
    }

    /// The layer's failure outcome (what it does once the store gives up without a fallback).
    pub(crate) fn on_store_error(self) -> OnStoreError {
        match self {
            Self::FailOpen => OnStoreError::FailOpen,
            _ => OnStoreError::FailClosed,
        }
    }
}

/// The store `builder` makes, with a local `MemoryStore` fallback or none.
pub(crate) fn with_fallback(builder: RedisStoreBuilder, fallback: bool) -> RedisStore {
    if fallback { builder.fallback(MemoryStore::new()) } else { builder.no_fallback() }
        .build()
        .unwrap()
}

/// What the layer answers.
type Reply = Response<tollgate::layer::ResponseBody<Body>>;

/// The service a scenario drives: an inner service behind the rate limit layer.
pub(crate) trait Layered:
    Service<Request<Body>, Response = Reply, Error = Infallible, Future: Send> + Clone + Send + 'static
{
}

impl<S> Layered for S where
    S: Service<Request<Body>, Response = Reply, Error = Infallible, Future: Send>
        + Clone
        + Send
        + 'static
{
}

/// The key of a request: its `x-key` header.
pub(crate) fn by_header(parts: &tollgate::key::RequestHead<'_>) -> Option<Key> {
    parts.headers.get("x-key").and_then(|v| v.to_str().ok()).map(Key::text)
}

/// `GET /` with `x-key: key`.
pub(crate) fn request(key: &str) -> Request<Body> {
    Request::get("/").header("x-key", key).body(Body::empty()).unwrap()
}

/// Opens the store's connections and loads the scripts: setup, not the scenario, so on a
/// loaded machine a connect that misses the timeout is tried again, `tries` times at most,
/// `pause` apart. `what` names the scenario in the panic.
pub(crate) async fn connect(store: &RedisStore, tries: u32, pause: Duration, what: &str) {
    for attempt in 1.. {
        match store.connect().await {
            Ok(()) => return,
            Err(e) if attempt == tries => panic!("{what}connect: {e}"),
            Err(_) => tokio::time::sleep(pause).await,
        }
    }
}

/// Waits (within [`FAILOVER_LIMIT`] of `killed`) until one of the sentinels names a master
/// other than `old`; returns the group, when it was named, and its address.
pub(crate) async fn wait_for_promotion(
    group: Sentinels,
    old: String,
    killed: Instant,
) -> (Sentinels, Instant, String) {
    tokio::task::spawn_blocking(move || {
        loop {
            let named =
                (0..group.sentinels.len()).find_map(|i| group.master_addr(i).filter(|a| *a != old));
            if let Some(new) = named {
                return (group, Instant::now(), new);
            }
            assert!(
                killed.elapsed() < FAILOVER_LIMIT,
                "no failover within {FAILOVER_LIMIT:?}\n{}",
                group.logs()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    })
    .await
    .unwrap()
}
