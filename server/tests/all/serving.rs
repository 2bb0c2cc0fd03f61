//! Serving: the gRPC health service, a graceful shutdown, the one command.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use tokio_stream::StreamExt;
use tollgate_server::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::support::*;

const CONFIG: &str =
    "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";
const SERVICE: &str = "envoy.service.ratelimit.v3.RateLimitService";

#[tokio::test]
async fn health_turns_not_serving_before_the_port_closes() {
    let s = serve(&[("config.yaml", CONFIG)], &[]).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", s.running.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    for service in ["", SERVICE] {
        let r = health
            .check(HealthCheckRequest { service: service.into() })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.status(), ServingStatus::Serving, "{service:?}");
    }
    let mut watch =
        health.watch(HealthCheckRequest { service: SERVICE.into() }).await.unwrap().into_inner();
    assert_eq!(watch.next().await.unwrap().unwrap().status(), ServingStatus::Serving);
    let grpc = s.running.grpc;
    let stop = tokio::spawn(s.running.shutdown());
    assert_eq!(watch.next().await.unwrap().unwrap().status(), ServingStatus::NotServing);
    drop(watch);
    drop(health);
    let mut client = s.client;
    drop(client.clone());
    tokio::time::timeout(Duration::from_secs(10), stop).await.unwrap().unwrap();
    assert!(tokio::net::TcpStream::connect(grpc).await.is_err(), "the port still accepts");
    assert!(client.should_rate_limit(one("d", &[("k", "a")])).await.is_err());
}

#[tokio::test]
async fn the_one_command_serves_the_example_and_stops_on_sigterm() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/example");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tollgate-server"))
        .args(["--config", example, "--listen", "127.0.0.1:0", "--grace", "200ms"])
        .env_remove("REDIS_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = lines.next().unwrap().unwrap();
    assert!(line.contains("tollgate-server: serving ShouldRateLimit on 127.0.0.1:"), "{line}");
    assert!(line.contains("(memory store; 1 domains, 5 limits from "), "{line}");
    let addr = line.split("on ").nth(1).unwrap().split(' ').next().unwrap().to_owned();
    let mut client = tollgate_server::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::connect(
        format!("http://{addr}"),
    )
    .await
    .unwrap();
    // The example: 100 a minute per client address.
    let mut ok = 0;
    for _ in 0..101 {
        let r = client
            .should_rate_limit(one("edge", &[("remote_address", "192.0.2.1")]))
            .await
            .unwrap()
            .into_inner();
        ok += usize::from(code(r.overall_code) == Code::Ok);
    }
    assert!(ok == 100 || ok == 101, "{ok}: at most one window boundary may pass during the test");
    // The client keeps its connection open: the server closes it after the grace period.
    let pid = child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
}

/// Connections are served on several threads (one per CPU): the calls of many connections,
/// at once, share one count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_on_many_connections_at_once_share_one_limit() {
    const LIMIT: &str = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 20}\n";
    let s = serve(&[("config.yaml", LIMIT)], &[]).await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        // A connection of its own: the server hands connections to its threads in turn.
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", s.running.grpc))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let client = tollgate_server::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::new(channel);
        tasks.push(tokio::spawn(async move {
            let calls = (0..5).map(|_| {
                let mut c = client.clone();
                async move {
                    let r = c.should_rate_limit(one("d", &[("k", "shared")])).await.unwrap();
                    code(r.into_inner().overall_code) == Code::Ok
                }
            });
            futures_util::future::join_all(calls).await.into_iter().filter(|ok| *ok).count()
        }));
    }
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap();
    }
    // 40 calls on 8 connections against one limit of 20 a minute (the clock stands still).
    assert_eq!(admitted, 20);
    s.running.shutdown().await;
}
