//! Reserved capacity by priority class on Redis.

use super::*;

// ---------------------------------------------------------------------------------------------
// Reserved capacity by priority.

/// The reserve scenarios decide on Redis (the store's injected clock) exactly as they say: each
/// class refused at its own threshold with its own retry, the critical reserve never taken by
/// the lower classes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_class_decides_exactly_at_its_threshold_on_redis() {
    let Some(server) = Server::start("redis-server") else { return };
    let clock = clock_at(3_600_000_000_000);
    priorities::every_scenario(&clock, limiters_on(&server, &clock, "class:")).await;
}

/// 3x overload with a mix of classes on Redis: no critical request refused, the total within
/// 1 % of the limit; and the same counts as in memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_times_overload_refuses_no_critical_request_on_redis() {
    let Some(server) = Server::start("redis-server") else { return };
    let (clock, store) = clocked(RedisStore::builder(server.url()), 3_600_000_000_000, "ov:");
    let limiter = Limiter::with_store(priorities::overload_policy("overload"), store).unwrap();
    let on_redis = priorities::three_times_overload(&clock, &limiter).await;
    let clock = clock_at(3_600_000_000_000);
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let limiter = Limiter::with_store(priorities::overload_policy("overload"), memory).unwrap();
    let in_memory = priorities::overload(&clock, &limiter, 30).await;
    assert_eq!(on_redis, in_memory);
}

/// Random traces (GCRA, other kinds and penalty boxes now and then) with reserves on their
/// first tier and checks of every class, through both stores on one fake clock, from a fixed
/// seed: not one decision differs.
#[test]
fn reserves_decide_exactly_like_memory() {
    let Some(server) = Server::start("redis-server") else { return };
    // Half of them with the clock stepping back between checks.
    // Now and then a penalty box too: a refusal at a class's threshold is a breach.
    let penalty = proptest::option::weighted(
        0.3,
        (0usize..5, 1_000_000u64..=20_000_000_000, 1u32..=3, 1_000_000u64..=10_000_000_000),
    );
    let traces = (
        proptest::bool::ANY.prop_flat_map(trace),
        (0u64..=3, 0u64..=3),
        proptest::collection::vec(0u8..3, 80),
        penalty,
    )
        .prop_map(|(mut trace, reserve, classes, penalty)| {
            trace.algorithm = Algorithm::Gcra;
            trace.reserve = Some(reserve);
            trace.classes = classes;
            trace.penalty = penalty;
            trace
        });
    seeded_differential(traces, 5, 256, stores_on(&server, "reserve"));
}

/// The same with most checks shaped, critical reserves of at least an eighth of the tier and
/// a third of the checks critical: the lower classes' schedules push the tier's TAT past their
/// line, and critical requests are admitted ahead of them on the tier's line (see `Reserve`),
/// alike on both stores, the clock stepping back in half of them.
#[test]
fn reserves_under_shaping_decide_exactly_like_memory() {
    let Some(server) = Server::start("redis-server") else { return };
    let traces = (
        proptest::bool::ANY.prop_flat_map(trace),
        (1u64..=3, 0u64..=3),
        proptest::collection::vec(0u8..3, 80),
        proptest::collection::vec(proptest::option::weighted(0.8, 0u64..=2_000_000_000), 80),
    )
        .prop_map(|(mut trace, reserve, classes, budgets)| {
            trace.algorithm = Algorithm::Gcra;
            trace.reserve = Some(reserve);
            trace.classes = classes;
            for (step, budget) in trace.steps.iter_mut().zip(budgets) {
                if let Step::Check { shape, .. } = step {
                    *shape = budget;
                }
            }
            trace
        });
    seeded_differential(traces, 7, 256, stores_on(&server, "reshape"));
}

/// A refusal of one priority class is not the answer for another: a standard request refused
/// at the critical reserve is refused locally for standard requests only, and a critical one
/// asks Redis, which admits it.
#[tokio::test]
async fn a_local_refusal_is_kept_per_priority_class() {
    let Some(server) = Server::start("redis-server") else { return };
    let policy = Policy::builder("prio")
        .tier("second", Quota::per_second(10))
        .reserve("second", Reserve::new().critical(5))
        .build()
        .unwrap();
    let twins = Twins::new(&server, "prio:", &policy);
    let bound = &twins.bound;
    let key = Key::text("alice");
    let standard = Check::new(&key, 1);
    let critical = Check::new(&key, 1).with_priority(Priority::Critical);
    for _ in 0..5 {
        assert!(twins.same(standard).await.is_allowed());
    }
    assert!(!twins.same(standard).await.is_allowed());
    assert!(!twins.same(standard).await.is_allowed());
    assert_eq!(bound.refused_locally(), 1);
    let mut conn = server.conn();
    let calls = script_calls(&mut conn);
    assert!(twins.same(critical).await.is_allowed());
    assert_eq!(script_calls(&mut conn), calls + 1);
    assert_eq!(bound.refused_locally(), 1);
}
