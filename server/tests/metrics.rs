//! Prometheus metrics under envoyproxy/ratelimit's names, as its statsd-to-Prometheus mapping
//! renders them, beside tollgate's own; in a binary of its own, as the recorder is
//! process-wide.
#![allow(unreachable_pub, dead_code)]

#[path = "all/support.rs"]
mod support;

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tollgate::clock::FakeClock;
use tollgate_server::engine::Backends;
use tollgate_server::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tollgate_server::server::start_with;
use tollgate_server::settings::Settings;

use support::*;

const CONFIG: &str = "
domain: rl
descriptors:
  - key: generic_key
    value: slow
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: user
    detailed_metric: true
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: route
    descriptors:
      - key: method
        rate_limit: {unit: minute, requests_per_unit: 100}
";

async fn get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

fn value(page: &str, series: &str) -> Option<u64> {
    page.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

#[tokio::test]
async fn the_references_stat_names_are_served_to_prometheus() {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder().unwrap();
    let dir = temp_dir();
    std::fs::write(dir.join("config.yaml"), CONFIG).unwrap();
    let args = [
        "--config",
        &dir.display().to_string(),
        "--listen",
        "127.0.0.1:0",
        "--http",
        "127.0.0.1:0",
        "--metrics",
        "127.0.0.1:0",
    ]
    .map(String::from);
    let settings = Settings::parse(args, |_| None).unwrap();
    let clock = FakeClock::new();
    clock.set(T0 * 1_000_000_000);
    let running = start_with(settings, Some(handle), Arc::new(Backends::memory_with_clock(clock)))
        .await
        .unwrap();
    let mut client =
        RateLimitServiceClient::connect(format!("http://{}", running.grpc)).await.unwrap();
    for _ in 0..12 {
        client.should_rate_limit(one("rl", &[("generic_key", "slow")])).await.unwrap();
    }
    for _ in 0..3 {
        client.should_rate_limit(one("rl", &[("user", "10.1.2.3")])).await.unwrap();
    }
    client.should_rate_limit(one("rl", &[("route", "/a"), ("method", "GET")])).await.unwrap();
    let page = get(running.metrics.unwrap(), "/metrics").await;
    let slow = r#"{domain="rl",key1="generic_key_slow"}"#;
    for (stat, n) in
        [("total_hits", 12), ("within_limit", 10), ("near_limit", 2), ("over_limit", 2)]
    {
        assert_eq!(
            value(&page, &format!("ratelimit_service_rate_limit_{stat}{slow}")),
            Some(n),
            "{stat}\n{page}"
        );
    }
    // detailed_metric: named by the value (an IPv4 address's dots made `_`); shadow_mode counts
    // what it let through over the limit.
    let user = r#"{domain="rl",key1="user_10_1_2_3"}"#;
    assert_eq!(
        value(&page, &format!("ratelimit_service_rate_limit_shadow_mode{user}")),
        Some(2),
        "{page}"
    );
    assert_eq!(
        value(&page, &format!("ratelimit_service_rate_limit_total_hits{user}")),
        Some(3),
        "{page}"
    );
    // Three parts: key2.
    let route = r#"{domain="rl",key1="route",key2="method"}"#;
    assert_eq!(
        value(&page, &format!("ratelimit_service_rate_limit_total_hits{route}")),
        Some(1),
        "{page}"
    );
    assert_eq!(value(&page, "ratelimit_service_config_load_success"), Some(1), "{page}");
    // tollgate's own, beside them.
    let own = r#"tollgate_decisions_total{policy="rl.generic_key_slow",tier="minute",outcome="#;
    assert_eq!(value(&page, &format!(r#"{own}"admitted"}}"#)), Some(10), "{page}");
    assert_eq!(value(&page, &format!(r#"{own}"limited"}}"#)), Some(2), "{page}");
    // The HTTP port: /healthcheck, and the metrics too.
    let health = get(running.http.unwrap(), "/healthcheck").await;
    assert!(health.starts_with("HTTP/1.0 200") && health.ends_with("OK"), "{health}");
    assert!(
        get(running.http.unwrap(), "/metrics")
            .await
            .contains("ratelimit_service_rate_limit_total_hits")
    );
    tokio::time::timeout(Duration::from_secs(10), running.shutdown()).await.unwrap();
}
