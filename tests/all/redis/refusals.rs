//! Local refusals: a key Redis refused until an instant is refused by the store itself until
//! then.

use super::*;

// ---------------------------------------------------------------------------------------------
// Local refusals: a key Redis refused until an instant is refused by the store itself until
// then, with the decision Redis would give, and without a script call.

/// Script calls the server has run (`EVALSHA` in `INFO commandstats`).
pub(super) fn script_calls(conn: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(conn).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

/// Traces that hammer keys already refused: many cost-1 checks a few milliseconds apart, now
/// and then another cost, shaping budget or settlement, on one or two keys.
fn hot_trace() -> impl Strategy<Value = Trace> {
    let step = || {
        let cost = || prop_oneof![8 => Just(1u64), 2 => 0u64..=3];
        let check = check_step(2, cost, 0.15, 1_000_000_000);
        prop_oneof![
            1 => (0u64..=1_000).prop_map(Step::Advance),
            3 => (0u64..=20_000_000).prop_map(Step::Advance),
            1 => (0u64..=1_000_000_000).prop_map(Step::Advance),
            12 => check,
            1 => (0usize..64, 0u64..=2).prop_map(|(which, cost)| Step::Settle { which, cost }),
        ]
    };
    (proptest::sample::select(Algorithm::ALL.to_vec()), proptest::bool::weighted(0.3))
        .prop_flat_map(move |(algorithm, grid)| {
            (
                proptest::collection::vec(tier(algorithm, grid), 1..=2),
                prop_oneof![
                    3 => Just(Vec::new()),
                    1 => (1u64..=20, 0usize..2).prop_map(|(c, p)| vec![Extra::Calendar(c, p, 0)]),
                ],
                0u64..=1_000_000_000_000,
                proptest::collection::vec(step(), 20..=150),
            )
                .prop_map(move |parts| Trace::new(algorithm, parts))
        })
}

/// The differential with local refusals on (the default) and off, on traces of refused hot
/// keys: both decide exactly like the memory store, so exactly like each other, and the
/// store with them on answered many checks itself.
#[test]
fn local_refusals_decide_exactly_like_memory_store_and_like_redis_without_them() {
    let Some(server) = Server::start("redis-server") else { return };
    let url = server.url();
    let on = differential_of(hot_trace(), 128, stores_on(&server, "on"));
    let off = differential_of(hot_trace(), 32, |clock, prefix| {
        fake_clock_store(RedisStore::builder(&url).local_refusals(0), clock, format!("off{prefix}"))
    });
    assert_eq!(off, 0);
    assert!(on > 500, "only {on} checks were answered locally");
}

/// A Redis store and a memory store on one fake clock (at 1,000 s), one policy bound on each.
pub(super) struct Twins {
    pub(super) clock: FakeClock,
    pub(super) store: RedisStore,
    pub(super) bound: <RedisStore as Store>::Bound,
    memory: MemoryStore,
    m_bound: <MemoryStore as Store>::Bound,
}

impl Twins {
    /// `policy` on a store on `server`, its keys under `prefix`, and in memory.
    pub(super) fn new(server: &Server, prefix: &str, policy: &Policy) -> Self {
        let (clock, store) = clocked(RedisStore::builder(server.url()), 1_000_000_000_000, prefix);
        let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let (bound, m_bound) = (store.bind(policy).unwrap(), memory.bind(policy).unwrap());
        Self { clock, store, bound, memory, m_bound }
    }

    /// `check` through both stores: their decisions are equal.
    pub(super) async fn same(&self, check: Check<'_>) -> Decision {
        let r = self.store.check(&self.bound, check).await.unwrap().decision;
        let m = self.memory.check(&self.m_bound, check).await.unwrap().decision;
        assert_eq!(r, m);
        r
    }
}

/// A refused hot key costs no script call until its refusal ends; each local answer is the
/// memory store's decision at that instant (retry_after counting down to the same instant);
/// at that instant Redis is asked again and admits.
#[tokio::test]
async fn a_refused_hot_key_asks_redis_only_when_its_refusal_ends() {
    let Some(server) = Server::start("redis-server") else { return };
    let mut conn = server.conn();
    let policy = Policy::builder("hot")
        .tier("second", Quota::per_second(2))
        .tier("hour", Quota::per_hour(100))
        .build()
        .unwrap();
    let twins = Twins::new(&server, "hot:", &policy);
    let (clock, store, bound) = (&twins.clock, &twins.store, &twins.bound);
    let key = Key::text("hot");
    let both = |check| twins.same(check);
    assert!(both(Check::new(&key, 1)).await.is_allowed());
    assert!(both(Check::new(&key, 1)).await.is_allowed());
    let refused = both(Check::new(&key, 1)).await;
    let retry = refused.retry_after().unwrap();
    assert_eq!(retry, Duration::from_millis(500));
    let calls = script_calls(&mut conn);
    assert_eq!(bound.refused_locally(), 0);
    // 499 more checks, a millisecond apart, up to a nanosecond before the refusal ends.
    for ms in 1..500 {
        clock.advance(Duration::from_millis(1));
        let d = both(Check::new(&key, 1)).await;
        assert_eq!(d.retry_after(), Some(retry - Duration::from_millis(ms)));
    }
    clock.advance(Duration::from_millis(1) - Duration::from_nanos(1));
    let last = both(Check::new(&key, 1)).await;
    assert_eq!(last.retry_after(), Some(Duration::from_nanos(1)));
    // Through the synchronous path too.
    let sync = store.check_sync(bound, Check::new(&key, 1)).unwrap().unwrap().decision;
    assert_eq!(sync, last);
    assert_eq!(script_calls(&mut conn), calls);
    assert_eq!(bound.refused_locally(), 501);
    // At the refusal's end: Redis again, which admits.
    clock.advance(Duration::from_nanos(1));
    assert!(store.check_sync(bound, Check::new(&key, 1)).is_none());
    assert!(both(Check::new(&key, 1)).await.is_allowed());
    assert_eq!(script_calls(&mut conn), calls + 1);
    // Another cost, or a shaping budget, is not the check that was refused: Redis decides.
    both(Check::new(&key, 1)).await;
    let before = script_calls(&mut conn);
    both(Check::new(&key, 2)).await;
    both(Check::new(&key, 1).shape(Duration::from_millis(1))).await;
    assert_eq!(script_calls(&mut conn), before + 2);
}

/// What this instance gives back forgets the key's refusal: the next check asks Redis, which
/// admits with the units given back.
#[tokio::test]
async fn a_settlement_through_this_instance_clears_the_refusal() {
    let Some(server) = Server::start("redis-server") else { return };
    let mut conn = server.conn();
    let (_, store) = clocked(RedisStore::builder(server.url()), 1_000_000_000_000, "set:");
    for algorithm in [Algorithm::FixedWindow, Algorithm::Gcra] {
        let policy = Policy::builder(format!("{algorithm:?}"))
            .algorithm(algorithm)
            .tier("minute", Quota::per_minute(2))
            .build()
            .unwrap();
        let bound = store.bind(&policy).unwrap();
        let key = Key::text("alice");
        let a = store.check(&bound, Check::new(&key, 1).with_ticket()).await.unwrap();
        let b = store.check(&bound, Check::new(&key, 1).with_ticket()).await.unwrap();
        assert!(a.decision.is_allowed() && b.decision.is_allowed());
        for _ in 0..3 {
            let d = store.check(&bound, Check::new(&key, 1)).await.unwrap().decision;
            assert!(!d.is_allowed(), "{algorithm:?}");
        }
        assert_eq!(bound.refused_locally(), 2, "{algorithm:?}");
        assert_eq!(bound.local_refusals(), 1);
        // The first ticket gives its unit back.
        store.settle(&bound, a.ticket.unwrap(), 0).await.unwrap();
        assert_eq!(bound.local_refusals(), 0);
        let calls = script_calls(&mut conn);
        let d = store.check(&bound, Check::new(&key, 1)).await.unwrap().decision;
        assert!(d.is_allowed(), "{algorithm:?}: the refund was not seen");
        assert_eq!(script_calls(&mut conn), calls + 1);
        // Settling a ticket tier by tier forgets it too.
        let mut b = b.ticket.unwrap();
        store.check(&bound, Check::new(&key, 1)).await.unwrap();
        assert_eq!(bound.local_refusals(), 1);
        store.settle_tiers(&bound, &mut b, &[(0, 0)]).await.unwrap();
        assert_eq!(bound.local_refusals(), 0);
        assert!(store.check(&bound, Check::new(&key, 1)).await.unwrap().decision.is_allowed());
    }
}

/// A task looping on checks that the instance answers itself (a refused key) yields now and
/// then, as a check sent to Redis would: on a one-thread runtime, another task runs while the
/// loop is still going.
#[tokio::test]
async fn a_loop_of_checks_answered_locally_lets_other_tasks_run() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let Some(server) = Server::start("redis-server") else { return };
    let (_, store) = clocked(RedisStore::builder(server.url()), 1_000_000_000_000, "coop:");
    let policy = Policy::single("coop", Quota::per_minute(1)).unwrap();
    let limiter = Limiter::with_store(policy, store).unwrap();
    let key = Key::text("alice");
    assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    assert!(!limiter.check(&key, 1).await.unwrap().is_allowed());
    let ran = Arc::new(AtomicBool::new(false));
    let other = tokio::spawn({
        let ran = Arc::clone(&ran);
        async move { ran.store(true, Ordering::SeqCst) }
    });
    let mut ran_during = false;
    for _ in 0..1_000 {
        assert!(!limiter.check(&key, 1).await.unwrap().is_allowed());
        ran_during |= ran.load(Ordering::SeqCst);
    }
    assert!(ran_during, "the other task never ran during 1,000 local refusals");
    assert_eq!(limiter.bound().refused_locally(), 1_000);
    other.await.unwrap();
}

/// A concurrency tier's slot can come back early (released on another instance): its
/// refusals are never answered locally, and neither are those of a policy that has one.
#[tokio::test]
async fn concurrency_tiers_are_never_answered_locally() {
    let Some(server) = Server::start("redis-server") else { return };
    let mut conn = server.conn();
    let (_, store) = clocked(RedisStore::builder(server.url()), 1_000_000_000_000, "conc:");
    let policy = Policy::builder("conc")
        .tier("minute", Quota::per_minute(2))
        .concurrency("slots", Concurrency::new(1))
        .build()
        .unwrap();
    let key = Key::text("alice");
    let bound = store.bind(&policy).unwrap();
    let held = store.check(&bound, Check::new(&key, 1).with_ticket()).await.unwrap();
    assert!(held.decision.is_allowed());
    let calls = script_calls(&mut conn);
    // Refused by the slots, then by the rate once the slot is free again.
    for _ in 0..5 {
        let d = store.check(&bound, Check::new(&key, 1)).await.unwrap().decision;
        assert_eq!(d.violated().collect::<Vec<_>>(), [1]);
    }
    store.release(&bound, held.ticket.unwrap()).await.unwrap();
    // Kept until the calls are counted: dropped, its slot is given back by a call of its own
    // (spawned, so at a time of the runtime's choosing).
    let again = store.check(&bound, Check::new(&key, 1)).await.unwrap();
    assert!(again.decision.is_allowed());
    for _ in 0..5 {
        let d = store.check(&bound, Check::new(&key, 1)).await.unwrap().decision;
        assert!(!d.is_allowed() && d.tiers()[0].is_violated());
    }
    assert_eq!(script_calls(&mut conn), calls + 1 + 5 + 1 + 5);
    drop(again);
    assert_eq!((bound.refused_locally(), bound.local_refusals()), (0, 0));
}

/// A flood of distinct refused keys replaces entries: the map never holds more than its
/// capacity, and every refusal is still answered exactly (by Redis once evicted).
#[tokio::test]
async fn a_flood_of_refused_keys_stays_within_the_capacity() {
    let Some(server) = Server::start("redis-server") else { return };
    let builder = RedisStore::builder(server.url()).local_refusals(32);
    let (clock, store) = clocked(builder, 1_000_000_000_000, "flood:");
    let policy = Policy::single("flood", Quota::per_hour(1)).unwrap();
    let bound = store.bind(&policy).unwrap();
    let keys: Vec<Key> = (0..400).map(|i| Key::text(format!("k{i}"))).collect();
    for key in &keys {
        assert!(store.check(&bound, Check::new(key, 1)).await.unwrap().decision.is_allowed());
        let d = store.check(&bound, Check::new(key, 1)).await.unwrap().decision;
        assert_eq!(d.retry_after(), Some(Duration::from_secs(3600)));
        assert!(bound.local_refusals() <= 32, "{} entries", bound.local_refusals());
    }
    assert!(bound.local_refusals() >= 16);
    // The keys held are answered at once, the others by Redis: all with the same decision.
    clock.advance(Duration::from_secs(1));
    let held = bound.local_refusals();
    let mut answered = 0;
    for key in &keys {
        if let Some(verdict) = store.check_sync(&bound, Check::new(key, 1)) {
            assert_eq!(verdict.unwrap().decision.retry_after(), Some(Duration::from_secs(3599)));
            answered += 1;
        }
    }
    assert_eq!(answered, held);
    for key in &keys {
        let d = store.check(&bound, Check::new(key, 1)).await.unwrap().decision;
        assert_eq!(d.retry_after(), Some(Duration::from_secs(3599)));
        assert!(bound.local_refusals() <= 32);
    }
}

/// On the server's clock (no injected clock): refusals are answered locally, each counting
/// down from the one Redis gave, until the key is admitted again.
#[tokio::test]
async fn on_server_time_a_refusal_is_answered_locally_until_it_ends() {
    let Some(server) = Server::start("redis-server") else { return };
    let store = RedisStore::builder(server.url()).prefix("srv:").build().unwrap();
    let policy = Policy::single("srv", Quota::per_second(5).with_burst(1)).unwrap();
    let bound = store.bind(&policy).unwrap();
    let key = Key::text("alice");
    assert!(store.check(&bound, Check::new(&key, 1)).await.unwrap().decision.is_allowed());
    let d = store.check(&bound, Check::new(&key, 1)).await.unwrap().decision;
    let mut last = d.retry_after().unwrap();
    assert!(last <= Duration::from_millis(200));
    loop {
        let d = store.check(&bound, Check::new(&key, 1)).await.unwrap().decision;
        let Some(retry) = d.retry_after() else { break };
        // Local answers count on an estimate of the server's clock that leads it by up to a
        // round trip, so Redis's next answer may be that much longer.
        assert!(retry <= last + Duration::from_millis(20), "{retry:?} after {last:?}");
        last = retry;
        tokio::task::yield_now().await;
    }
    assert!(bound.refused_locally() > 0);
}
