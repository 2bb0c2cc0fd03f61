//! Penalty boxes on Redis, exactly as in memory.

use super::*;

// ---------------------------------------------------------------------------------------------
// Penalty boxes.

/// A 10-a-minute tier with a 15-minute block, and the third-refusal-within-a-minute variant,
/// decide on Redis (the store's injected clock) exactly as the scenarios say: blocked for
/// exactly 15 minutes, another key untouched. The state key's TTL covers the block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_breach_blocks_the_key_for_exactly_the_block_on_redis() {
    let Some(server) = Server::start("redis-server") else { return };
    let clock = clock_at(3_600_000_000_000);
    scenarios::every_scenario(&clock, limiters_on(&server, &clock, "box:")).await;
    // Without a grace, a blocked key's state lives exactly as long as its block.
    let store = RedisStore::builder(server.url())
        .clock(clock.clone())
        .prefix("ttl:")
        .ttl_grace(Duration::ZERO)
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let policy = scenarios::fifteen_minute_policy("ttl");
    let limiter = Limiter::with_store(policy.clone(), store.clone()).unwrap();
    let key = Key::text("erin");
    for _ in 0..9 {
        assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    }
    let first_write = std::time::Instant::now();
    assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    let day_ttl = pttl(&mut server.conn(), &state_key(&store, &policy, &key));
    let first_read = i64::try_from(first_write.elapsed().as_millis()).unwrap() + 2;
    let read = std::time::Instant::now();
    assert!(!limiter.check(&key, 1).await.unwrap().is_allowed());
    let ttl = pttl(&mut server.conn(), &state_key(&store, &policy, &key));
    // The calendar day keeps the state until its end (22 h 59 min on); the block alone would
    // keep it 15 min. A penalty on a rate tier alone shows the block's own TTL. (The TTL runs
    // down in real time after each write, and the fake clock gives both writes one expiry:
    // the first read may already have run down by up to what it took, however long a busy
    // machine took.)
    let waited = i64::try_from(read.elapsed().as_millis()).unwrap() + 2;
    assert!(
        ttl >= day_ttl - waited && ttl <= day_ttl + first_read,
        "{ttl} vs {day_ttl} ({waited} ms, first read {first_read} ms)"
    );
    let alone = Policy::builder("ttl-alone")
        .tier("minute", Quota::per_minute(10))
        .penalty("minute", Penalty::new(scenarios::MINUTE * 15))
        .build()
        .unwrap();
    let limiter = Limiter::with_store(alone.clone(), store.clone()).unwrap();
    // Each TTL runs down in real time from its write: allow what the reads took.
    let since = |at: std::time::Instant| i64::try_from(at.elapsed().as_millis()).unwrap() + 2;
    for _ in 0..9 {
        assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    }
    let written = std::time::Instant::now();
    assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    let before = pttl(&mut server.conn(), &state_key(&store, &alone, &key));
    let waited = since(written);
    assert!(before >= 60_000 - waited && before <= 60_000, "pttl {before}: the minute's refill");
    let written = std::time::Instant::now();
    assert!(!limiter.check(&key, 1).await.unwrap().is_allowed());
    let ttl = pttl(&mut server.conn(), &state_key(&store, &alone, &key));
    let waited = since(written);
    assert!(ttl >= 900_000 - waited && ttl <= 900_000, "pttl {ttl} ({waited} ms)");
}

/// Random traces with a penalty box on one of their tiers (any algorithm, with other kinds
/// now and then; blocks of 1 ms to 20 s, 1 to 4 refusals within up to 10 s), through both
/// stores on one fake clock, from a fixed seed: not one decision differs.
#[test]
fn penalty_boxes_decide_exactly_like_memory() {
    let Some(server) = Server::start("redis-server") else { return };
    let penalty = (
        0usize..5,
        prop_oneof![
            2 => 1_000_000u64..=20_000_000_000,
            1 => (1u64..=200).prop_map(|k| k * 10_000_000),
        ],
        prop_oneof![2 => Just(1u32), 3 => 2u32..=4],
        // Mostly on the 10 ms grid of the grid traces, so that refusals land exactly on the
        // window's edge.
        prop_oneof![
            1 => 1_000_000u64..=10_000_000_000,
            2 => (1u64..=100).prop_map(|k| k * 10_000_000),
        ],
    );
    // Half of them with the clock stepping back between checks.
    let traces =
        (proptest::bool::ANY.prop_flat_map(trace), penalty).prop_map(|(mut trace, penalty)| {
            trace.penalty = Some(penalty);
            trace
        });
    seeded_differential(traces, 24, 256, stores_on(&server, "penalty"));
}
