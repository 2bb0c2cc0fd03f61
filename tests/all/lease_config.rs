//! Configuring lease mode: which policies can lease, and a `lease_policy` name that no bound
//! policy uses, which says so once (a `warn` log and a metric) instead of running exact mode
//! without a word.
#![cfg(feature = "redis")]

use crate::support;

use std::time::Duration;

use support::logs::Captured;
use support::redis::Server;
use tollgate::key::Key;
use tollgate::store::{Check, Lease, RedisStore, Store};
use tollgate::{Algorithm, Calendar, ConfigError, Policy, Quota};
use tracing::Level;

/// Calendar tiers lease (beside the rate tiers of GCRA, the buckets and the fixed window);
/// what cannot lease is refused at binding, naming the tier.
#[test]
fn calendar_tiers_lease_and_what_cannot_lease_is_refused_naming_the_tier() {
    let leasing = |name: &str| {
        RedisStore::builder("redis://127.0.0.1:1/")
            .lease_policy(name, Lease::new())
            .build()
            .unwrap()
    };
    for algorithm in [Algorithm::Gcra, Algorithm::FixedWindow, Algorithm::TokenBucket] {
        let daily = Policy::builder("daily")
            .algorithm(algorithm)
            .tier("second", Quota::per_second(10))
            .calendar("day", Calendar::per_day(1_000))
            .build()
            .unwrap();
        assert_eq!(leasing("daily").bind(&daily).unwrap().lease(), Some(Lease::new()));
    }
    let bytes = Policy::builder("upload")
        .tier("second", Quota::per_second(10))
        .tier("bytes", Quota::per_second(1_000_000).counting(tollgate::Unit::RequestBytes))
        .build()
        .unwrap();
    match leasing("upload").bind(&bytes) {
        Err(ConfigError::UnsupportedByStore { tier, .. }) => assert_eq!(tier, "bytes"),
        other => panic!("{other:?}"),
    }
}

/// `lease_policy("serch-…")` beside a policy named `search-…`: the first check logs the name
/// once at `warn`, with the policies bound, and counts it once; later checks say nothing more.
#[tokio::test(flavor = "current_thread")]
async fn a_lease_policy_name_no_bound_policy_uses_is_logged_once_and_counted() {
    let Some(server) = Server::start("redis-server") else { return };
    let prometheus = support::prometheus::handle();
    let logs = Captured::start(Level::WARN);
    let store = RedisStore::builder(server.url())
        .lease_policy("serch-lease-config", Lease::new())
        .lease_policy("search-lease-config", Lease::new())
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let search = Policy::single("search-lease-config", Quota::per_second(100)).unwrap();
    let login = Policy::single("login-lease-config", Quota::per_minute(5)).unwrap();
    let bound = store.bind(&search).unwrap();
    let other = store.bind(&login).unwrap();
    assert_eq!(bound.lease(), Some(Lease::new()));
    assert_eq!(other.lease(), None);
    assert_eq!(logs.text(), "", "nothing is said at binding: another binding may follow");
    let key = Key::text("k");
    for _ in 0..3 {
        assert!(store.check(&bound, Check::new(&key, 1)).await.unwrap().decision.is_allowed());
        assert!(store.check(&other, Check::new(&key, 1)).await.unwrap().decision.is_allowed());
    }
    let text = logs.text();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "{text}");
    for part in [
        "WARN",
        "setting=\"lease_policy\"",
        "policy=serch-lease-config",
        "\"login-lease-config\"",
        "\"search-lease-config\"",
        "no policy bound to this store uses",
    ] {
        assert!(lines[0].contains(part), "{part} in {text}");
    }
    let rendered = prometheus.render();
    let series =
        r#"tollgate_config_warnings_total{policy="serch-lease-config",setting="lease_policy"} 1"#;
    assert!(rendered.contains(series), "{rendered}");
    let bound_series =
        r#"tollgate_config_warnings_total{policy="search-lease-config",setting="lease_policy"}"#;
    assert!(!rendered.contains(bound_series), "a bound name is not counted");
}
