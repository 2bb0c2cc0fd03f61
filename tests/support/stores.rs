//! Stores for scenarios written once, generic over the store (`async fn scenario<St: Store>(store:
//! St)`), and run on each: the in-memory store, Redis, Valkey and a Redis Cluster. A frozen store
//! reads a clock that stands still, so that what a scenario charged can be read back exactly.

use tollgate::clock::FakeClock;
use tollgate::store::MemoryStore;

/// An in-memory store on a clock of its own that never moves.
pub fn frozen_memory() -> MemoryStore {
    MemoryStore::builder().clock(FakeClock::new()).build().unwrap()
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

    /// A frozen store (see [`frozen`]) on a standalone `redis-server` or `valkey-server`.
    pub fn frozen_on(server: &Server, prefix: &str) -> RedisStore {
        frozen(RedisStore::builder(server.url()), prefix)
    }

    /// A frozen store (see [`frozen`]) on a Redis Cluster.
    pub fn frozen_on_cluster(cluster: &Cluster, prefix: &str) -> RedisStore {
        frozen(RedisStore::cluster_builder(cluster.urls()), prefix)
    }
}
