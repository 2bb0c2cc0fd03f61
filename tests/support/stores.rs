//! Stores for scenarios written once, generic over the store (`async fn scenario<St: Store>(store:
//! St)`), and run on each: the in-memory store, Redis, Valkey and a Redis Cluster. A frozen store
//! reads a clock that stands still, so that what a scenario charged can be read back exactly.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tollgate::Limiter;
use tollgate::clock::FakeClock;
use tollgate::key::Key;
use tollgate::store::{MemoryStore, Store};

/// An in-memory store on a clock of its own that never moves.
pub fn frozen_memory() -> MemoryStore {
    MemoryStore::builder().clock(FakeClock::new()).build().unwrap()
}

/// `holders` tasks each take a slot of `key` through `limiter` (waiting for one up to `wait`),
/// count themselves in while they hold it (never more than `max`, asserted), yield a little,
/// and release it: the most that were inside at once.
pub async fn most_in_flight<St>(
    limiter: &Limiter<St>,
    key: &Key,
    holders: usize,
    max: usize,
    wait: Duration,
) -> usize
where
    St: Store + Clone + Send + Sync + 'static,
    St::Bound: Send + Sync,
    St::Ticket: Send,
{
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..holders)
        .map(|_| {
            let (limiter, inside, most) = (limiter.clone(), inside.clone(), most.clone());
            let key = key.clone();
            tokio::spawn(async move {
                let slot = limiter.acquire(&key, 1, wait).await.expect("a slot within the wait");
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                assert!(now <= max, "{now} in flight");
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                inside.fetch_sub(1, Ordering::SeqCst);
                slot.release().await.expect("released");
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    most.load(Ordering::SeqCst)
}

/// The servers a scenario runs on beside the in-memory store.
#[cfg(feature = "redis")]
pub mod redis {
    use super::*;
    use crate::support::redis::{Cluster, Server};
    use std::time::Duration;
    use tollgate::store::{RedisStore, RedisStoreBuilder};

    /// A store of `builder` whose clock stands still, its keys under `prefix`. Redis expires
    /// keys on its own clock, when their state would be full again on the store's: with that
    /// clock frozen, a key charged one byte (1 ms of refill) would vanish after 1 ms of real
    /// time, so keys are kept a minute longer; a slow moment of a loaded machine then does not
    /// empty a key the frozen clock says is charged. The timeout is 5 s (a loaded test machine
    /// is slow, never the loopback).
    pub fn frozen(builder: RedisStoreBuilder, prefix: &str) -> RedisStore {
        builder
            .prefix(prefix)
            .clock(FakeClock::new())
            .ttl_grace(Duration::from_secs(60))
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap()
    }

    /// A store of `builder` on `clock` (a fake clock, standing still in real time unless a test
    /// moves it), its keys under `prefix` and kept an hour past their state's needs; the
    /// timeout is 5 s.
    pub fn on_clock(builder: RedisStoreBuilder, clock: &FakeClock, prefix: &str) -> RedisStore {
        builder
            .clock(clock.clone())
            .prefix(prefix)
            .ttl_grace(Duration::from_secs(3600))
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap()
    }

    /// A frozen store (see [`frozen`]) on a standalone `redis-server` or `valkey-server`.
    pub fn frozen_on(server: &Server, prefix: &str) -> RedisStore {
        frozen(RedisStore::builder(server.url()), prefix)
    }

    /// A frozen store (see [`frozen`]) on a Redis Cluster.
    pub fn frozen_on_cluster(cluster: &Cluster, prefix: &str) -> RedisStore {
        frozen(RedisStore::cluster_builder(cluster.urls()), prefix)
    }
}
