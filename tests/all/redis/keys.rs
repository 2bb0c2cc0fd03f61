//! State keys: hash tags, TTLs, script reloads, keyed hashes that keep API keys secret, and
//! key material kept as data; every binding of one policy on one store shares one budget.

use super::*;

// ---------------------------------------------------------------------------------------------
// Keys: hash tags, TTLs, script reloads.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policys_keys_share_one_cluster_slot_and_keys_spread_over_nodes() {
    let Some(cluster) = Cluster::start() else { return };
    let store = timed(RedisStore::cluster_builder(cluster.urls()), 5);
    let policy = Policy::builder("log")
        .algorithm(Algorithm::SlidingLog)
        .tier("second", Quota::per_second(5))
        .tier("minute", Quota::per_minute(50))
        .build()
        .unwrap();
    let mut owners = std::collections::HashSet::new();
    for i in 0..30 {
        let key = Key::text(format!("user-{i}"));
        assert!(decide(&store, &policy, &key, 1).await.is_allowed());
        let state = state_key(&store, &policy, &key);
        let node = cluster.node_of(&state);
        let mut conn = node.conn();
        // The hash and both tiers' sets live on the node of the hash's slot (a multi-key script
        // across slots would have been refused with CROSSSLOT).
        for k in [state.clone(), format!("{state}:z1"), format!("{state}:z2")] {
            let exists: i64 = redis::cmd("EXISTS").arg(&k).query(&mut conn).unwrap();
            assert_eq!(exists, 1, "{k}");
        }
        owners.insert(node.port);
    }
    assert_eq!(owners.len(), 3, "30 keys land on all three masters");
}

// ---------------------------------------------------------------------------------------------
// Keys stay secret: Redis holds a keyed hash of each key, never the key.

/// An API key: what must not be readable in Redis.
const API_KEY: &str = "sk_live_SECRET";

/// One policy per algorithm with two rate tiers, and one per algorithm with a concurrency and
/// a calendar tier beside its rate (sliding-log sets, lease sets and calendar windows).
fn secret_policies() -> Vec<Policy> {
    let lease = Concurrency::new(5).with_ttl(Duration::from_secs(600));
    let mut out = Vec::new();
    for algorithm in Algorithm::ALL {
        let plain = Policy::builder(format!("plain-{}", algorithm.name()))
            .algorithm(algorithm)
            .tier("second", Quota::per_second(5))
            .tier("day", Quota::per_day(1000))
            .build()
            .unwrap();
        let kinds = Policy::builder(format!("kinds-{}", algorithm.name()))
            .algorithm(algorithm)
            .tier("minute", Quota::per_minute(50))
            .concurrency("slots", lease)
            .calendar("month", Calendar::per_month(1000))
            .build()
            .unwrap();
        out.extend([plain, kinds]);
    }
    out
}

/// The keys checked: the API key alone, and with an address.
fn secret_keys() -> [Key; 2] {
    let ip = Key::Ip("203.0.113.7".parse().unwrap());
    [Key::text(API_KEY), Key::Tuple(vec![ip, Key::text(API_KEY)].into())]
}

/// Two requests through the layer keyed by an `x-api-key` header (policy `layer`), then two
/// reservations per policy and key (held, so leases are in Redis when it is read), and a
/// settlement of one of them at another cost.
async fn secret_checks(store: &RedisStore) -> Vec<tollgate::Reservation<RedisStore>> {
    use tower::{Layer as _, ServiceExt as _};
    let layer = RateLimitLayer::builder(Policy::single("layer", Quota::per_minute(10)).unwrap())
        .key(tollgate::key::HeaderKey::new(http::HeaderName::from_static("x-api-key")))
        .store(store.clone())
        .build()
        .unwrap();
    let service = layer.layer(support::ok_service());
    // GCRA, 10 a minute: each request is 6 s until the bucket is full again.
    for (remaining, full_in) in [(9, 6), (8, 12)] {
        let request = http::Request::get("/").header("x-api-key", API_KEY);
        let request = request.body(axum::body::Body::empty()).unwrap();
        let res = service.clone().oneshot(request).await.unwrap();
        assert_eq!(res.status(), http::StatusCode::OK);
        assert_eq!(res.headers()["ratelimit"], format!("\"layer\";r={remaining};t={full_in}"));
    }
    let mut held = Vec::new();
    for policy in secret_policies() {
        let limiter = Limiter::with_store(policy.clone(), store.clone()).unwrap();
        for key in secret_keys() {
            let first = limiter.reserve(&key, 1).await.expect("redis answers");
            let second = limiter.reserve(&key, 1).await.expect("redis answers");
            let name = policy.name();
            assert!(first.decision().is_allowed() && second.decision().is_allowed(), "{name}");
            assert_eq!(first.decision().source(), Source::Store, "{name}");
            first.settle(2).await.expect("settled");
            held.push(second);
        }
    }
    held
}

/// Every key name on a server (`SCAN`) with its value: a string's bytes (`GET`), a sorted set's
/// members (`ZRANGE`); any other type fails the test.
fn everything_in(conn: &mut redis::Connection) -> Vec<(String, Vec<Vec<u8>>)> {
    let mut names: Vec<Vec<u8>> = Vec::new();
    let mut cursor = 0_u64;
    loop {
        let (next, batch): (u64, Vec<Vec<u8>>) =
            redis::cmd("SCAN").arg(cursor).arg("COUNT").arg(1000).query(conn).unwrap();
        names.extend(batch);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    names
        .into_iter()
        .map(|name| {
            let kind: String = redis::cmd("TYPE").arg(&name).query(conn).unwrap();
            let values: Vec<Vec<u8>> = match kind.as_str() {
                "string" => vec![redis::cmd("GET").arg(&name).query(conn).unwrap()],
                "zset" => redis::cmd("ZRANGE").arg(&name).arg(0).arg(-1).query(conn).unwrap(),
                other => panic!("unexpected {other} at {}", String::from_utf8_lossy(&name)),
            };
            (String::from_utf8(name).expect("key names are text"), values)
        })
        .collect()
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// Asserts that no key name or value holds the API key's secret part, and that every policy's
/// keys are there: a state key per policy and key, sliding-log sets and lease sets.
fn assert_secret_kept(everything: &[(String, Vec<Vec<u8>>)]) {
    for (name, values) in everything {
        assert!(!contains(name.as_bytes(), "SECRET") && !name.contains("sk_live"), "{name}");
        for v in values {
            assert!(!contains(v, "SECRET") && !contains(v, "sk_live"), "{name}: {v:?}");
        }
    }
    let states = secret_policies().len() * secret_keys().len();
    let count = |suffix: &str| everything.iter().filter(|(n, _)| n.ends_with(suffix)).count();
    // Sliding logs: two sets for a plain policy, one beside the concurrency tier; every kinds
    // policy holds a lease set.
    assert_eq!(count(":z1"), 2 * secret_keys().len(), "log sets");
    assert_eq!(count(":z2"), secret_keys().len(), "log sets");
    let sets = count(":c:slots");
    assert_eq!(sets, secret_policies().len() / 2 * secret_keys().len(), "lease sets");
    // And the layer's key.
    assert_eq!(everything.len(), states + 1 + count(":z1") + count(":z2") + sets);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_holds_no_api_key_in_key_names_or_values() {
    let Some(server) = Server::start("redis-server") else { return };
    let url = server.url();
    let builders = [
        RedisStore::builder(&url),
        RedisStore::builder(&url).key_secret("per-deployment secret"),
        RedisStore::builder(&url).raw_keys().key_secret(b"\x00\xff"),
    ];
    for builder in builders {
        let store = builder.timeout(Duration::from_secs(5)).build().unwrap();
        let held = secret_checks(&store).await;
        let mut conn = server.conn();
        let everything = everything_in(&mut conn);
        assert_secret_kept(&everything);
        for policy in secret_policies() {
            let bound = store.bind(&policy).unwrap();
            for key in secret_keys() {
                let state = bound.state_key(&key);
                assert!(everything.iter().any(|(n, _)| *n == state), "{state}");
            }
        }
        drop(held);
        let () = redis::cmd("FLUSHALL").query(&mut conn).unwrap();
    }
    // The same checks under raw key names do show the key: what the test looks for is there.
    let store = RedisStore::builder(&url).raw_keys().timeout(Duration::from_secs(5)).build();
    let held = secret_checks(&store.unwrap()).await;
    let everything = everything_in(&mut server.conn());
    let shown = everything.iter().filter(|(n, _)| n.contains("s14:sk_live_SECRET")).count();
    assert_eq!(shown, everything.len());
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_hashed_keys_hide_the_api_key_and_keep_each_keys_tiers_in_one_slot() {
    let Some(cluster) = Cluster::start() else { return };
    let store = RedisStore::cluster_builder(cluster.urls())
        .key_secret("per-deployment secret")
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let held = secret_checks(&store).await;
    let mut everything = Vec::new();
    // Which node holds each hash tag: one node per tag, so a key's state and its sets share a
    // slot (a script over several slots is refused with CROSSSLOT anyway).
    let mut tags: std::collections::HashMap<String, u16> = std::collections::HashMap::new();
    for node in &cluster.nodes {
        for (name, values) in everything_in(&mut node.conn()) {
            let tag = name[name.find('{').unwrap() + 1..name.find('}').unwrap()].to_owned();
            assert!(tag.contains("|#"), "{name}");
            assert_eq!(*tags.entry(tag).or_insert(node.port), node.port, "{name}");
            everything.push((name, values));
        }
    }
    assert_secret_kept(&everything);
    assert_eq!(tags.len(), secret_policies().len() * secret_keys().len() + 1);
    drop(held);
}

/// `PTTL` of `key` in milliseconds (-2 when it does not exist).
pub(super) fn pttl(conn: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query(conn).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_lives_as_long_as_its_state_needs() {
    let Some(server) = Server::start("redis-server") else { return };
    let store = RedisStore::builder(server.url()).timeout(Duration::from_secs(5)).build().unwrap();
    let mut conn = server.conn();
    for algorithm in Algorithm::ALL {
        let policy = Policy::builder(format!("ttl-{}", algorithm.name()))
            .algorithm(algorithm)
            .tier("t", Quota::new(10, Duration::from_millis(400)))
            .build()
            .unwrap();
        let d = decide(&store, &policy, &Key::Global, 3).await;
        let state = state_key(&store, &policy, &Key::Global);
        let mut keys = vec![state.clone()];
        if algorithm == Algorithm::SlidingLog {
            keys.push(format!("{state}:z1"));
        }
        // TTL = the time until the state is back to full, rounded up to ms (no grace).
        let need =
            i64::try_from(d.tiers()[0].reset_after().as_nanos().div_ceil(1_000_000)).unwrap();
        // At most one period; two for the sliding counter, whose window still weighs in
        // during the next one.
        assert!(need > 0 && need <= 800, "{algorithm:?}: {need}");
        for k in &keys {
            let ttl = pttl(&mut conn, k);
            assert!(ttl <= need && ttl > need - 150, "{algorithm:?} {k}: pttl {ttl}, need {need}");
        }
        // ... after which the keys are gone by themselves.
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        while keys.iter().any(|k| pttl(&mut conn, k) != -2) {
            assert!(
                std::time::Instant::now() < deadline,
                "{algorithm:?}: keys outlived their state"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // A rejected request on a fresh key writes nothing.
    let policy = Policy::single("none", Quota::per_second(2)).unwrap();
    assert!(!decide(&store, &policy, &Key::Global, 3).await.is_allowed());
    assert_eq!(pttl(&mut conn, &state_key(&store, &policy, &Key::Global)), -2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flushed_script_is_reloaded_transparently() {
    let Some(server) = Server::start("redis-server") else { return };
    let store = RedisStore::builder(server.url()).timeout(Duration::from_secs(5)).build().unwrap();
    store.connect().await.unwrap();
    let policy = Policy::single("flush", Quota::per_minute(2)).unwrap();
    assert!(decide(&store, &policy, &Key::Global, 1).await.is_allowed());
    let () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut server.conn()).unwrap();
    let d = decide(&store, &policy, &Key::Global, 1).await;
    assert_eq!((d.is_allowed(), d.tiers()[0].remaining()), (true, 0));
    assert!(!decide(&store, &policy, &Key::Global, 1).await.is_allowed());
}

#[test]
fn settings_and_policies_the_store_cannot_run_are_refused_when_built() {
    let store = RedisStore::builder("redis://127.0.0.1:1/").build().unwrap();
    let tiny = Policy::builder("tiny")
        .algorithm(Algorithm::FixedWindow)
        .tier("t", Quota::new(1, Duration::from_micros(100)))
        .build()
        .unwrap();
    let err = tollgate::RateLimitLayer::builder(tiny).store(store).build().unwrap_err();
    assert!(matches!(err, tollgate::ConfigError::UnsupportedByStore { .. }), "{err}");
    let bad = RedisStore::builder("not a url").build().unwrap_err();
    assert!(matches!(bad, tollgate::ConfigError::Invalid { setting: "url", .. }), "{bad}");
    let tag = RedisStore::builder("redis://127.0.0.1:1/").prefix("a{b}").build().unwrap_err();
    assert!(matches!(tag, tollgate::ConfigError::Invalid { setting: "prefix", .. }), "{tag}");
    let empty = RedisStore::builder("redis://127.0.0.1:1/").key_secret("").build().unwrap_err();
    assert!(matches!(empty, tollgate::ConfigError::Invalid { setting: "key_secret", .. }));
    assert_eq!(empty.to_string(), "key_secret: must not be empty");
    let url = "redis://127.0.0.1:1/";
    let err = RedisStore::builder(url).timeout(Duration::ZERO).build().unwrap_err();
    assert!(matches!(err, tollgate::ConfigError::Invalid { setting: "timeout", .. }), "{err}");
    let err = RedisStore::builder(url).circuit_breaker(0, Duration::from_secs(1)).build();
    let err = err.unwrap_err();
    assert!(matches!(err, tollgate::ConfigError::Invalid { setting: "circuit_breaker", .. }));
    let err = RedisStore::cluster_builder(Vec::<String>::new()).build().unwrap_err();
    assert!(matches!(err, tollgate::ConfigError::Invalid { setting: "url", .. }), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Key material is data (SECURITY.md, "script or key injection").

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_key_material_stays_data() {
    let Some(server) = Server::start("redis-server") else { return };
    let store = RedisStore::builder(server.url()).timeout(Duration::from_secs(5)).build().unwrap();
    let mut conn = server.conn();
    let () = redis::cmd("SET").arg("victim").arg("intact").query(&mut conn).unwrap();
    let hostile = [
        "\"]] redis.call('FLUSHALL') --",
        "'); redis.call('DEL', 'victim'); ('",
        "*",
        "{victim}",
        "a}b{c",
        "line\r\nFLUSHALL\r\n",
        "\u{0}\u{1}\u{7f}",
        "%7B%7D",
    ];
    let policy = Policy::single("hostile", Quota::per_minute(1)).unwrap();
    for text in hostile {
        let key = Key::text(text);
        assert!(decide(&store, &policy, &key, 1).await.is_allowed(), "{text:?}");
        assert!(!decide(&store, &policy, &key, 1).await.is_allowed(), "{text:?}");
        let exists: i64 =
            redis::cmd("EXISTS").arg(state_key(&store, &policy, &key)).query(&mut conn).unwrap();
        assert_eq!(exists, 1, "{text:?} has its own key");
    }
    let victim: String = redis::cmd("GET").arg("victim").query(&mut conn).unwrap();
    assert_eq!(victim, "intact");
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    assert_eq!(keys.len(), hostile.len() + 1, "one key per hostile text, and the victim: {keys:?}");
}

/// Found by the differential test: sliding-log ids restart when an empty log's key is deleted, so
/// a late cancel could delete the entry of a later request that reused the id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_ticket_cannot_cancel_a_later_entry() {
    let Some(server) = Server::start("redis-server") else { return };
    let clock = FakeClock::new();
    let store = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "stale:".into());
    let policy = Policy::builder("log")
        .algorithm(Algorithm::SlidingLog)
        .tier("t", Quota::per_second(1))
        .build()
        .unwrap();
    let limiter = Limiter::with_store(policy, store).unwrap();
    let stale = limiter.reserve(&Key::Global, 1).await.unwrap();
    clock.advance(Duration::from_secs(1));
    // The log is empty again: a query that charges nothing drops its keys, and ids start over.
    assert_eq!(limiter.check(&Key::Global, 0).await.unwrap().tiers()[0].remaining(), 1);
    let mut conn = server.conn();
    let state = limiter.bound().state_key(&Key::Global);
    assert_eq!(redis::cmd("EXISTS").arg(&state).query::<i64>(&mut conn).unwrap(), 0);
    assert!(limiter.check(&Key::Global, 1).await.unwrap().is_allowed());
    stale.settle(0).await.unwrap();
    let d = limiter.check(&Key::Global, 1).await.unwrap();
    assert!(!d.is_allowed(), "the later entry still counts");
}

// ---------------------------------------------------------------------------------------------
// One budget per policy and store: every binding of a policy names the same keys.

/// Of 100 requests of one key against 5 an hour: how many a limiter built for each request
/// from one policy admits, and how many two layers built separately from one policy admit
/// together (alternating), on `store`.
async fn one_policy_one_budget<St: Store>(store: St) -> (usize, usize) {
    use tower::{Layer as _, ServiceExt as _};
    let policy = Policy::single("per-request", Quota::per_hour(5)).unwrap();
    let mut per_request = 0;
    for _ in 0..100 {
        let limiter = Limiter::with_store(policy.clone(), store.clone()).unwrap();
        per_request += usize::from(limiter.check(&Key::text("k"), 1).await.unwrap().is_allowed());
    }
    let policy = Policy::single("two-layers", Quota::per_hour(5)).unwrap();
    let layer = || {
        let layer = RateLimitLayer::builder(policy.clone()).key(GlobalKey).store(store.clone());
        layer.build().unwrap().layer(support::ok_service())
    };
    let (a, b) = (layer(), layer());
    let mut layered = 0;
    for i in 0..100 {
        let svc = if i % 2 == 0 { a.clone() } else { b.clone() };
        let res = svc.oneshot(http::Request::new(axum::body::Body::empty())).await.unwrap();
        layered += usize::from(res.status() == http::StatusCode::OK);
    }
    (per_request, layered)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_policy_on_one_store_is_one_budget_in_memory_as_on_redis() {
    let Some(server) = Server::start("redis-server") else { return };
    let redis = RedisStore::builder(server.url()).timeout(Duration::from_secs(10)).build().unwrap();
    assert_eq!(one_policy_one_budget(redis).await, (5, 5));
    assert_eq!(one_policy_one_budget(MemoryStore::new()).await, (5, 5));
}
