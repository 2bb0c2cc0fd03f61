//! Redis: the reference's key layout for fixed windows (a fleet mixing both services admits
//! exactly the limit per window), tollgate's policies, Cluster and Sentinel, failure modes.

use std::sync::Arc;
use std::time::Duration;

use redis::Commands;
use tollgate::clock::FakeClock;
use tollgate_server::engine::Backends;
use tollgate_server::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tollgate_server::pb::google::protobuf::UInt64Value;
use tollgate_server::settings::{RedisKind, RedisTarget};

use crate::redis_support::{Cluster, Sentinels, Server as Redis};
use crate::support::*;

const CONFIG: &str = "
domain: rl
descriptors:
  - key: generic_key
    value: slow
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: a
    descriptors:
      - key: b
        rate_limit: {unit: hour, requests_per_unit: 3}
  - key: files
    value: files/*
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 4}
  - key: gcra
    rate_limit: {unit: second, requests_per_unit: 5}
  - key: window
    rate_limit: {unit: second, requests_per_unit: 100}
";

const EXT: &str = "
domain: rl
failure_mode: closed
limits:
  - descriptor: [gcra]
    algorithm: gcra
    tiers: [{name: per-second, requests_per_unit: 5, unit: second, burst: 5}]
  - descriptor: [window]
    algorithm: fixed_window
    lease: {max_block: 8, lifetime: 1s}
";

async fn on_redis(target: RedisTarget, files: &[(&str, &str)], prefix: &str) -> Server {
    let clock = FakeClock::new();
    clock.set(T0 * 1_000_000_000);
    let backends = Backends::redis(target, Duration::from_secs(2), prefix, 0, Some(clock.clone()))
        .await
        .expect("connect to the test Redis");
    serve_on(files, &[], Arc::new(backends), clock).await
}

fn single(redis: &Redis) -> RedisTarget {
    RedisTarget { kind: RedisKind::Single, nodes: vec![redis.url()] }
}

/// One request of the reference's fixed-window logic on `key`: `INCRBY`, then admitted when
/// the count is within the limit (its `EXPIRE` follows).
fn reference_hit(conn: &mut redis::Connection, key: &str, limit: u64) -> bool {
    let after: u64 = conn.incr(key, 1).unwrap();
    let _: () = conn.expire(key, 60).unwrap();
    after <= limit
}

#[tokio::test]
async fn fixed_windows_count_on_the_references_keys() {
    let Some(redis) = Redis::start("redis-server") else { return };
    let mut s = on_redis(single(&redis), &[("config.yaml", CONFIG)], "").await;
    let mut conn = redis.conn();
    let window = T0 / 60 * 60;
    let key = format!("rl_generic_key_slow_{window}");
    // The reference counted 3 in this window already.
    let _: () = conn.set(&key, 3).unwrap();
    let slow = one("rl", &[("generic_key", "slow")]);
    assert_eq!(admitted(&mut s, &slow, 9).await, 7);
    assert_eq!(conn.get::<_, u64>(&key).unwrap(), 10);
    let ttl: i64 = conn.ttl(&key).unwrap();
    assert!((1..=60).contains(&ttl), "ttl {ttl}");
    // Nested entries and a shared wildcard: the key has every entry, the pattern for the value.
    let nested = one("rl", &[("a", "1"), ("b", "2")]);
    assert_eq!(admitted(&mut s, &nested, 1).await, 1);
    assert_eq!(conn.get::<_, u64>(format!("rl_a_1_b_2_{}", T0 / 3600 * 3600)).unwrap(), 1);
    assert_eq!(admitted(&mut s, &one("rl", &[("files", "files/x")]), 2).await, 2);
    assert_eq!(admitted(&mut s, &one("rl", &[("files", "files/y")]), 3).await, 2);
    assert_eq!(conn.get::<_, u64>(format!("rl_files_files/*_{}", T0 / 3600 * 3600)).unwrap(), 4);
    // The next window is another key.
    s.advance(Duration::from_secs(60));
    assert_eq!(admitted(&mut s, &slow, 11).await, 10);
    assert_eq!(conn.get::<_, u64>(format!("rl_generic_key_slow_{}", window + 60)).unwrap(), 10);
}

#[tokio::test]
async fn a_fleet_of_both_services_admits_exactly_the_limit() {
    let Some(redis) = Redis::start("redis-server") else { return };
    let mut s = on_redis(single(&redis), &[("config.yaml", CONFIG)], "pfx_").await;
    let mut conn = redis.conn();
    let key = format!("pfx_rl_generic_key_slow_{}", T0 / 60 * 60);
    let slow = one("rl", &[("generic_key", "slow")]);
    let mut ours = 0;
    let mut theirs = 0;
    for round in 0..30 {
        if round % 3 == 0 {
            theirs += usize::from(reference_hit(&mut conn, &key, 10));
        } else {
            ours += admitted(&mut s, &slow, 1).await;
        }
    }
    assert_eq!(ours + theirs, 10, "ours {ours}, theirs {theirs}");
    assert!(ours > 0 && theirs > 0);
}

#[tokio::test]
async fn a_refused_request_gives_back_and_negative_hits_refund_on_redis() {
    let Some(redis) = Redis::start("redis-server") else { return };
    let mut s = on_redis(single(&redis), &[("config.yaml", CONFIG)], "").await;
    let mut conn = redis.conn();
    let slow_key = format!("rl_generic_key_slow_{}", T0 / 60 * 60);
    let b_key = format!("rl_a_1_b_2_{}", T0 / 3600 * 3600);
    let both = req("rl", vec![desc(&[("generic_key", "slow")]), desc(&[("a", "1"), ("b", "2")])]);
    assert_eq!(admitted(&mut s, &both, 5).await, 3);
    // The two refused requests took nothing from generic_key.
    assert_eq!(conn.get::<_, u64>(&slow_key).unwrap(), 3);
    assert_eq!(conn.get::<_, u64>(&b_key).unwrap(), 3);
    let mut refund = one("rl", &[("a", "1"), ("b", "2")]);
    refund.descriptors[0].hits_addend = Some(UInt64Value { value: 2 });
    refund.descriptors[0].is_negative_hits = true;
    let r = s.call(refund.clone()).await;
    assert_eq!((code(r.overall_code), r.statuses[0].limit_remaining), (Code::Ok, 2));
    assert_eq!(conn.get::<_, u64>(&b_key).unwrap(), 1);
    // Never below 0.
    refund.descriptors[0].hits_addend = Some(UInt64Value { value: 9 });
    s.call(refund).await;
    assert_eq!(conn.get::<_, u64>(&b_key).unwrap(), 0);
}

#[tokio::test]
async fn extension_policies_run_on_tollgates_redis_store() {
    let Some(redis) = Redis::start("redis-server") else { return };
    let mut s =
        on_redis(single(&redis), &[("config.yaml", CONFIG), ("rl.tollgate.yaml", EXT)], "").await;
    let gcra = one("rl", &[("gcra", "k")]);
    assert_eq!(admitted(&mut s, &gcra, 7).await, 5);
    // GCRA: one more every 200 ms.
    s.advance(Duration::from_millis(200));
    assert_eq!(admitted(&mut s, &gcra, 3).await, 1);
    let st = &s.call(gcra).await.statuses[0];
    assert_eq!(
        st.current_limit.as_ref().map(|l| (l.name.as_str(), l.requests_per_unit)),
        Some(("per-second", 5))
    );
    // A leased fixed window admits exactly its limit.
    let window = one("rl", &[("window", "k")]);
    assert_eq!(admitted(&mut s, &window, 110).await, 100);
}

#[tokio::test]
async fn a_failed_store_answers_as_the_domains_failure_mode_says() {
    let Some(mut redis) = Redis::start("redis-server") else { return };
    let modes = "
domain: open
descriptors: [{key: k, rate_limit: {unit: minute, requests_per_unit: 2}}]
";
    let files = [
        ("rl.yaml", CONFIG),
        ("rl.tollgate.yaml", EXT),
        ("open.yaml", modes),
        ("open.tollgate.yaml", "domain: open\nfailure_mode: open\n"),
        ("error.yaml", &modes.replace("domain: open", "domain: error")),
        ("local.yaml", &modes.replace("domain: open", "domain: local")),
        ("local.tollgate.yaml", "domain: local\nfailure_mode: local\n"),
    ];
    let mut s = on_redis(single(&redis), &files, "").await;
    assert_eq!(admitted(&mut s, &one("open", &[("k", "a")]), 1).await, 1);
    redis.kill();
    // open: admitted, uncounted, no limit reported.
    let r = s.call(one("open", &[("k", "a")])).await;
    assert_eq!((code(r.overall_code), r.statuses[0].current_limit.clone()), (Code::Ok, None));
    // closed (rl's companion): refused.
    assert_eq!(s.codes(one("rl", &[("generic_key", "slow")])).await.0, Code::OverLimit);
    // error (the default): the call fails, as the reference's does.
    let e = s.client.should_rate_limit(one("error", &[("k", "a")])).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    // local: this server decides alone, exactly.
    assert_eq!(admitted(&mut s, &one("local", &[("k", "a")]), 3).await, 2);
}

#[tokio::test]
async fn fixed_windows_on_a_redis_cluster() {
    let Some(cluster) = Cluster::start() else { return };
    let target = RedisTarget { kind: RedisKind::Cluster, nodes: cluster.urls() };
    let mut s = on_redis(target, &[("config.yaml", CONFIG), ("rl.tollgate.yaml", EXT)], "").await;
    let both = req("rl", vec![desc(&[("generic_key", "slow")]), desc(&[("a", "1"), ("b", "2")])]);
    assert_eq!(admitted(&mut s, &both, 5).await, 3);
    let key = format!("rl_generic_key_slow_{}", T0 / 60 * 60);
    assert_eq!(cluster.node_of(&key).conn().get::<_, u64>(&key).unwrap(), 3);
    assert_eq!(admitted(&mut s, &one("rl", &[("gcra", "k")]), 7).await, 5);
}

#[tokio::test]
async fn fixed_windows_through_redis_sentinel() {
    let Some(group) = Sentinels::start() else { return };
    let target = RedisTarget {
        kind: RedisKind::Sentinel { master: group.name.clone(), node: None },
        nodes: group.urls(),
    };
    let mut s = on_redis(target, &[("config.yaml", CONFIG), ("rl.tollgate.yaml", EXT)], "").await;
    assert_eq!(admitted(&mut s, &one("rl", &[("generic_key", "slow")]), 12).await, 10);
    let key = format!("rl_generic_key_slow_{}", T0 / 60 * 60);
    assert_eq!(group.master.conn().get::<_, u64>(&key).unwrap(), 10);
    assert_eq!(admitted(&mut s, &one("rl", &[("gcra", "k")]), 7).await, 5);
}
