//! Concurrency slots held in Redis: never over the limit, freed when their time to live ends,
//! refreshed while held.

use super::*;

// ---------------------------------------------------------------------------------------------
// Concurrency slots as leases.

fn slots_policy(name: &str, max: u64, lease: Duration) -> Policy {
    Policy::builder(name)
        .concurrency("in-flight", Concurrency::new(max).with_ttl(lease))
        .build()
        .unwrap()
}

/// 1,000 tasks on two threads each wait for one of 4 slots of one key (polling Redis), count
/// themselves in while they hold it, and release it: never more than 4 inside, 4 at some moment,
/// and every task gets its turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_holders_on_redis_never_exceed_four_in_flight() {
    use crate::support::stores::most_in_flight;
    let Some(server) = Server::start("redis-server") else { return };
    let policy = slots_policy("thousand", 4, Duration::from_secs(60));
    let limiter =
        Limiter::with_store(policy, timed(RedisStore::builder(server.url()), 10)).unwrap();
    let most =
        most_in_flight(&limiter, &Key::text("api-key"), 1000, 4, Duration::from_secs(300)).await;
    assert_eq!(most, 4);
    let d = limiter.check(&Key::text("api-key"), 0).await.unwrap();
    assert_eq!((d.tiers()[0].remaining(), d.source()), (4, Source::Store));
    // Every lease is gone: so is the set.
    let set = lease_set(&limiter.bound().state_key(&Key::text("api-key")), "in-flight");
    assert_eq!(pttl(&mut server.conn(), &set), -2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_of_a_crashed_holder_frees_itself_when_its_lease_expires() {
    let Some(server) = Server::start("redis-server") else { return };
    let clock = clock_at(instant("2025-06-02T10:00:00Z"));
    let policy = slots_policy("crash", 1, Duration::from_secs(10));
    // App server A takes the slot and crashes: it never releases nor refreshes.
    {
        let store =
            fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "crash:".into());
        let a = Limiter::with_store(policy.clone(), store).unwrap();
        let held = a.reserve(&Key::Global, 1).await.unwrap();
        assert!(held.decision().is_allowed());
        assert_eq!(held.refresh_every(), Some(Duration::from_secs(10) / 3));
        std::mem::forget(held);
    }
    let store = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "crash:".into());
    let b = Limiter::with_store(policy, store).unwrap();
    let d = b.check(&Key::Global, 1).await.unwrap();
    assert_eq!(d.outcome(), tollgate::Outcome::Limited);
    assert_eq!(d.retry_after(), Some(Duration::from_secs(1)), "the default typical hold");
    // The lease set lives as long as its longest lease (plus the test's grace of an hour).
    let set = lease_set(&b.bound().state_key(&Key::Global), "in-flight");
    let ttl = pttl(&mut server.conn(), &set);
    assert!(ttl > 3_600_000 && ttl <= 3_610_000, "{ttl}");
    clock.advance(Duration::from_millis(9_999));
    assert!(!b.check(&Key::Global, 1).await.unwrap().is_allowed(), "leased for 10 s");
    clock.advance(Duration::from_millis(1));
    let d = b.check(&Key::Global, 1).await.unwrap();
    assert!(d.is_allowed(), "expired after 10 s: {d:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refreshed_lease_lasts_and_an_expired_one_says_so() {
    let Some(server) = Server::start("redis-server") else { return };
    let builder = RedisStore::builder(server.url());
    let (clock, store) = clocked(builder, instant("2025-06-02T10:00:00Z"), "fresh:");
    let limiter =
        Limiter::with_store(slots_policy("refresh", 1, Duration::from_secs(9)), store).unwrap();
    let held = limiter.reserve(&Key::Global, 1).await.unwrap();
    for _ in 0..3 {
        clock.advance(Duration::from_secs(6));
        assert!(held.refresh().await.unwrap(), "still leased");
        assert!(!limiter.check(&Key::Global, 1).await.unwrap().is_allowed());
    }
    // 18 s after it was taken, the slot is still held; released, it is free at once, and the
    // hold (18 s) becomes the typical hold.
    held.release().await.unwrap();
    let other = limiter.reserve(&Key::Global, 1).await.unwrap();
    assert!(other.decision().is_allowed());
    let d = limiter.check(&Key::Global, 1).await.unwrap();
    assert_eq!(d.retry_after(), Some(Duration::from_secs(18)));
    // Not refreshed for a whole lease: gone, and the refresh says so.
    clock.advance(Duration::from_secs(9));
    assert!(!other.refresh().await.unwrap());
}

/// On the server's clock: a held reservation keeps its short lease alive by itself, and its
/// slot comes back when it is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_reservation_refreshes_its_lease_until_it_is_dropped() {
    let Some(server) = Server::start("redis-server") else { return };
    let store = timed(RedisStore::builder(server.url()), 5);
    let limiter =
        Limiter::with_store(slots_policy("held", 1, Duration::from_millis(900)), store).unwrap();
    let held = limiter.reserve(&Key::Global, 1).await.unwrap().hold();
    // Four leases long. (Refreshed every 300 ms: a refresh may be 600 ms late before the lease
    // runs out, which a machine busy with other builds needs; with a 300 ms lease, one refresh
    // came more than 200 ms late in a CI run.)
    tokio::time::sleep(Duration::from_millis(3600)).await;
    assert!(!limiter.check(&Key::Global, 1).await.unwrap().is_allowed(), "refreshed");
    drop(held);
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while !limiter.check(&Key::Global, 1).await.unwrap().is_allowed() {
        assert!(std::time::Instant::now() < deadline, "the dropped hold was not released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Without a refresh (forgotten, as by a crash), the lease lapses on the server's clock.
    let lost = limiter.reserve(&Key::Global, 1).await.unwrap();
    std::mem::forget(lost);
    assert!(!limiter.check(&Key::Global, 1).await.unwrap().is_allowed());
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert!(limiter.check(&Key::Global, 1).await.unwrap().is_allowed());
}
