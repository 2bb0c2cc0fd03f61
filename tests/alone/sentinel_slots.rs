//! Redis Sentinel × concurrency slots: two slots released while the master is down (one by
//! `Store::release`, one by dropping its ticket) fail to reach Redis, are retried, and come
//! back once the store reaches the promoted master: within 2 s of the sentinels naming it
//! (the store's own bound: it finds the new master within about a second, and retries a
//! release every 500 ms at most), where they would stay taken until their time to live runs
//! out (30 s).
#![cfg(feature = "redis")]
use crate::support;

use std::time::{Duration, Instant};

use crate::outage::{connect, wait_for_promotion};
use support::redis::Sentinels;
use tollgate::key::Key;
use tollgate::store::{Check, RedisPolicy, RedisStore, RedisTicket, Store};
use tollgate::{Concurrency, Policy, Source};

use crate::ONE_AT_A_TIME;

/// How long after the promotion the slots may take to come back.
const BACK_WITHIN: Duration = Duration::from_secs(2);

/// A slot taken by Redis (not the fallback: there is none), or `None`.
async fn take(store: &RedisStore, bound: &RedisPolicy, key: &Key) -> Option<RedisTicket> {
    let verdict = store.check(bound, Check::new(key, 1)).await.ok()?;
    (verdict.decision.is_allowed() && verdict.decision.source() == Source::Store)
        .then(|| verdict.ticket.expect("slots come with a ticket"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_released_during_a_failover_come_back_soon_after_the_promotion() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(mut group) = Sentinels::start() else { return };
    let old = group.master.addr();
    let store = RedisStore::sentinel_builder(group.urls(), group.name.clone())
        .timeout(Duration::from_millis(500))
        .circuit_breaker(3, Duration::from_millis(300))
        .no_fallback()
        .build()
        .unwrap();
    connect(&store, 20, Duration::from_millis(100), "").await;
    let policy =
        Policy::builder("sentinel-slots").concurrency("in-flight", Concurrency::new(2)).build();
    let bound = store.bind(&policy.unwrap()).unwrap();
    let key = Key::text("k");
    let first = take(&store, &bound, &key).await.expect("a slot");
    let second = take(&store, &bound, &key).await.expect("a slot");
    assert!(take(&store, &bound, &key).await.is_none(), "two slots at most");
    // The replica holds both slots before the master dies.
    let acked: i64 = redis::cmd("WAIT").arg(1).arg(5_000).query(&mut group.master.conn()).unwrap();
    assert_eq!(acked, 1);

    group.master.kill();
    let killed = Instant::now();
    // Released while the master is down: both fail to reach Redis.
    assert!(store.release(&bound, first).await.is_err(), "the master is down");
    drop(second);
    let (group, promoted, _) = wait_for_promotion(group, old, killed).await;
    // Both slots free: two requests each take one, decided by the promoted master.
    let back = loop {
        if let Some(a) = take(&store, &bound, &key).await {
            let b = take(&store, &bound, &key).await;
            let now = Instant::now();
            store.release(&bound, a).await.unwrap();
            if let Some(b) = b {
                store.release(&bound, b).await.unwrap();
                break now;
            }
        }
        assert!(
            promoted.elapsed() < Duration::from_secs(10),
            "the slots did not come back within 10 s of the promotion\n{}",
            group.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let after = back.saturating_duration_since(promoted);
    assert!(after <= BACK_WITHIN, "the slots came back {after:?} after the promotion");
    assert!(
        store.servers().iter().any(|s| s.addr == group.replica.addr()),
        "on the promoted master"
    );
}
