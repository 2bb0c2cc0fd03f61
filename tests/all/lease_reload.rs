//! Lease mode across configuration reloads under traffic: two app instances, each a
//! `LimitsLayer` over its own leasing `RedisStore`, share one fixed window on a real
//! redis-server. A reload that keeps the policy keeps its binding and its blocks; one that
//! changes the quota binds it anew. Either way the window admits exactly its limit (lease mode
//! admits no unit beyond a window's limit), counted over both instances.
#![cfg(all(feature = "redis", feature = "config"))]

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use http::StatusCode;
use support::redis::Server;
use tollgate::clock::FakeClock;
use tollgate::config::{LimitsConfig, LimitsLayer};
use tollgate::store::{Lease, RedisStore};

/// `count` requests an hour in a fixed window, on one key for every request.
fn config(count: u64, name: &str) -> LimitsConfig {
    let text = format!(
        r#"
[policies.api]
algorithm = "fixed_window"
tiers = [{{ name = "hourly", count = {count}, period = "1h" }}]

[[rules]]
name = "api"
key = "global"
policy = "api"
"#
    );
    LimitsConfig::from_toml(&text, name).unwrap()
}

/// Two instances of the app, each with its own store and connection, leasing `api` in blocks
/// of at most 8; the stores' clock stands still, so the window never ends during the test.
async fn fleet(server: &Server) -> Vec<(LimitsLayer<RedisStore>, support::Server)> {
    let clock = FakeClock::new();
    let prefix = format!("lease-reload{}:", fastrand::u32(..));
    let mut apps = Vec::new();
    for _ in 0..2 {
        let store = RedisStore::builder(server.url())
            .lease_policy("api", Lease::new().max_block(8).lifetime(Duration::from_secs(30)))
            .clock(clock.clone())
            .prefix(prefix.clone())
            // The fake clock stands still in real time: keep keys for the whole test.
            .ttl_grace(Duration::from_secs(3600))
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        let layer = LimitsLayer::with_store(config(100, "v1.toml"), store).unwrap();
        let app = Router::new().route("/", get(|| async { "ok" })).layer(layer.clone());
        apps.push((layer, support::serve(app).await));
    }
    apps
}

/// Sends `n` requests to each instance in turn, one at a time: the admitted ones.
async fn drain(apps: &[(LimitsLayer<RedisStore>, support::Server)], n: usize) -> usize {
    let client = support::client();
    let mut ok = 0;
    for i in 0..2 * n {
        let reply = support::get(&client, &apps[i % 2].1.url("/"), &[]).await;
        match reply.status {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => {}
            other => panic!("unexpected {other}"),
        }
    }
    ok
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leasing_instances_admit_the_window_exactly_across_reloads_under_traffic() {
    let Some(server) = Server::start("redis-server") else { return };
    let apps = Arc::new(fleet(&server).await);

    // 8 clients, 40 requests each, alternating instances: 320 asks for a window of 100.
    let done = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for c in 0..8 {
        let (apps, done) = (Arc::clone(&apps), Arc::clone(&done));
        clients.push(tokio::spawn(async move {
            let client = support::client();
            let mut ok = 0;
            for i in 0..40 {
                let reply = support::get(&client, &apps[(c + i) % 2].1.url("/"), &[]).await;
                match reply.status {
                    StatusCode::OK => ok += 1,
                    StatusCode::TOO_MANY_REQUESTS => {}
                    other => panic!("unexpected {other}"),
                }
                done.fetch_add(1, Ordering::SeqCst);
            }
            ok
        }));
    }
    // After 60 answers, both instances reload a file that keeps the policy: its binding (and
    // the blocks it holds) stay.
    for _ in 0..10_000 {
        if done.load(Ordering::SeqCst) >= 60 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    for (layer, _) in apps.iter() {
        let reloaded = layer.handle().reload(config(100, "v2.toml")).unwrap();
        assert_eq!(reloaded.kept(), &["api".to_owned()][..]);
    }
    assert!(done.load(Ordering::SeqCst) < 320, "the reloads happened under traffic");
    let mut ok = 0;
    for client in clients {
        ok += client.await.expect("no client task failed");
    }
    // Whatever the instances still hold is spent by asking each of them again: exactly the
    // window's 100 over the whole run, not one more, none stranded.
    ok += drain(&apps, 20).await;
    assert_eq!(ok, 100);
    // Both instances decided from blocks, through the reload, on the binding they started with.
    for (layer, _) in apps.iter() {
        let stats = layer.handle().limiter("api").expect("bound").bound().lease_stats();
        assert!(stats.grants > 0 && stats.decided_locally > 0, "{stats:?}");
    }

    // A changed quota binds the policy anew, from a full window of the new count; the old
    // binding's blocks are not spent for it.
    for (layer, _) in apps.iter() {
        let reloaded = layer.handle().reload(config(150, "v3.toml")).unwrap();
        assert_eq!(reloaded.changed(), &["api".to_owned()][..]);
    }
    assert_eq!(drain(&apps, 100).await, 150);
}
