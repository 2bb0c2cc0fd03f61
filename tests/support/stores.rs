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

/// Tests of scenarios written once over the store, one test function each, all with the
/// attribute given first (and a row's own attributes before it):
/// - `name: scenario(source);` is the test `name` running `scenario(store)` on the store
///   `source` gives with what must outlive it, or returning at once where it gives none
///   (sources: [`in_memory`], [`on_system_clock`], with Redis [`redis::frozen_server`],
///   [`redis::server`], [`redis::cluster`]);
/// - `scenario(prefix): on_redis, on_valkey;` is the two tests running `scenario` on a
///   frozen store of a fresh `redis-server` and one of a fresh `valkey-server`, its keys under
///   `prefix` (with the `redis` feature only);
/// - `name: on_a_cluster[scenario(prefix), ...];` is the test running the scenarios one after
///   another on one Redis Cluster (forming one takes seconds), on frozen stores each under
///   its own prefix.
#[allow(unused_macros)]
macro_rules! store_tests {
    (#[$attr:meta] $($(#[$row:meta])* $name:ident: $scenario:ident($source:expr);)*) => {
        $(
            $(#[$row])*
            #[$attr]
            async fn $name() {
                let Some((_server, store)) = $source else { return };
                $scenario(store).await;
            }
        )*
    };
    (#[$attr:meta] $($scenario:ident($prefix:literal): $on_redis:ident, $on_valkey:ident;)*) => {
        $crate::support::stores::store_tests! {
            #[$attr]
            $(
                $on_redis:
                    $scenario($crate::support::stores::redis::frozen_server("redis-server", $prefix));
                $on_valkey:
                    $scenario($crate::support::stores::redis::frozen_server("valkey-server", $prefix));
            )*
        }
    };
    (#[$attr:meta] $name:ident: on_a_cluster[$($scenario:ident($prefix:literal)),* $(,)?];) => {
        #[$attr]
        async fn $name() {
            let Some(cluster) = $crate::support::redis::Cluster::start() else { return };
            $($scenario($crate::support::stores::redis::frozen_on_cluster(&cluster, $prefix)).await;)*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use store_tests;

/// A [`frozen_memory`] store, for [`store_tests!`].
pub fn in_memory() -> Option<((), MemoryStore)> {
    Some(((), frozen_memory()))
}

/// An in-memory store on the system's clock, for [`store_tests!`].
pub fn on_system_clock() -> Option<((), MemoryStore)> {
    Some(((), MemoryStore::new()))
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

    /// A fresh `bin` server (`redis-server` or `valkey-server`) and a frozen store on it
    /// (see [`frozen`]), for [`store_tests!`]; `None` where `bin` is not installed.
    pub fn frozen_server(bin: &str, prefix: &str) -> Option<(Server, RedisStore)> {
        let server = Server::start(bin)?;
        let store = frozen_on(&server, prefix);
        Some((server, store))
    }

    /// A fresh `bin` server and its [`Server::store`] (on the system's clock), for
    /// [`store_tests!`]; `None` where `bin` is not installed.
    pub fn server(bin: &str, prefix: &str) -> Option<(Server, RedisStore)> {
        let server = Server::start(bin)?;
        let store = server.store(prefix);
        Some((server, store))
    }

    /// A fresh Redis Cluster and a store on it (on the system's clock), its keys under
    /// `prefix`, for [`store_tests!`]; `None` where Redis is not installed.
    pub fn cluster(prefix: &str) -> Option<(Cluster, RedisStore)> {
        let cluster = Cluster::start()?;
        let store = RedisStore::cluster_builder(cluster.urls()).prefix(prefix).build().unwrap();
        Some((cluster, store))
    }

    /// A frozen store (see [`frozen`]) on a Redis Cluster.
    pub fn frozen_on_cluster(cluster: &Cluster, prefix: &str) -> RedisStore {
        frozen(RedisStore::cluster_builder(cluster.urls()), prefix)
    }
}
