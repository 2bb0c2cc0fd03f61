//! Lease mode across configuration reloads under traffic: two app instances, each a
//! `LimitsLayer` over its own leasing `RedisStore`, share one fixed window on a real
//! redis-server. A reload that keeps the policy keeps its binding and its blocks; one that
//! changes the quota binds it anew. Either way the window admits exactly its limit (lease mode
//! admits no unit beyond a window's limit), counted over both instances. The same for a GCRA
//! policy leased with prefetching, on a clock that stands still (nothing refills, so the
//! burst is what may be admitted, and what the instances hold or fetch ahead through the
//! reload is neither lost nor admitted twice).
#![cfg(all(feature = "redis", feature = "config"))]

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use http::StatusCode;
use support::redis::Server;
use support::stores::redis::on_clock;
use tollgate::clock::FakeClock;
use tollgate::config::{LimitsConfig, LimitsLayer};
use tollgate::store::{Lease, LeaseStats, RedisStore};

/// `count` requests an hour in a fixed window, on one key for every request.
fn config(count: u64, name: &str) -> LimitsConfig {
    config_of("fixed_window", count, name)
}

/// `count` requests an hour with `algorithm` (a burst of `count` for GCRA), on one key for
/// every request.
fn config_of(algorithm: &str, count: u64, name: &str) -> LimitsConfig {
    let text = support::config_files::global_api(&format!(
        "algorithm = \"{algorithm}\"\ntiers = [{{ name = \"hourly\", count = {count}, period = \"1h\" }}]"
    ));
    LimitsConfig::from_toml(&text, name).unwrap()
}

/// Two instances of the app, each with its own store and connection, leasing `api` in blocks
/// of at most 8; the stores' clock stands still, so the window never ends during the test.
async fn fleet(server: &Server) -> Vec<(LimitsLayer<RedisStore>, support::Server)> {
    let lease = Lease::new().max_block(8).lifetime(Duration::from_secs(30));
    fleet_of(server, lease, config(100, "v1.toml")).await
}

/// Two instances of the app serving `config`, each with its own store and connection, leasing
/// `api` with `lease`, on one clock that stands still.
async fn fleet_of(
    server: &Server,
    lease: Lease,
    config: LimitsConfig,
) -> Vec<(LimitsLayer<RedisStore>, support::Server)> {
    let clock = FakeClock::new();
    let prefix = format!("lease-reload{}:", fastrand::u32(..));
    let mut apps = Vec::new();
    for _ in 0..2 {
        let builder = RedisStore::builder(server.url()).lease_policy("api", lease);
        let store = on_clock(builder, &clock, &prefix);
        let layer = LimitsLayer::with_store(config.clone(), store).unwrap();
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

/// The instances of a fleet, each with its server.
type Apps = Arc<Vec<(LimitsLayer<RedisStore>, support::Server)>>;

/// 8 clients sending `each` requests, alternating instances: the count of answers so far, and
/// each client's task, which returns how many of its requests were admitted.
fn traffic(apps: &Apps, each: usize) -> (Arc<AtomicUsize>, Vec<tokio::task::JoinHandle<usize>>) {
    let done = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for c in 0..8 {
        let (apps, done) = (Arc::clone(apps), Arc::clone(&done));
        clients.push(tokio::spawn(async move {
            let client = support::client();
            let mut ok = 0;
            for i in 0..each {
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
    (done, clients)
}

/// Returns once `n` requests were answered (at most 10 s).
async fn answered(done: &AtomicUsize, n: usize) {
    for _ in 0..10_000 {
        if done.load(Ordering::SeqCst) >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Reloads every instance with `config`; asserts that the reload kept `api`'s binding
/// (`kept`), or bound it anew.
fn reload_all(apps: &Apps, config: &LimitsConfig, kept: bool) {
    for (layer, _) in apps.iter() {
        let reloaded = layer.handle().reload(config.clone()).unwrap();
        let api = &["api".to_owned()][..];
        assert_eq!(if kept { reloaded.kept() } else { reloaded.changed() }, api);
    }
}

/// How many requests the clients' tasks saw admitted, once they are done.
async fn admitted(clients: Vec<tokio::task::JoinHandle<usize>>) -> usize {
    let mut ok = 0;
    for client in clients {
        ok += client.await.expect("no client task failed");
    }
    ok
}

/// Each instance's lease statistics for `api`.
fn lease_stats(apps: &Apps) -> Vec<LeaseStats> {
    let bound = |layer: &LimitsLayer<RedisStore>| layer.handle().limiter("api").expect("bound");
    apps.iter().map(|(layer, _)| bound(layer).bound().lease_stats()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leasing_instances_admit_the_window_exactly_across_reloads_under_traffic() {
    let Some(server) = Server::start("redis-server") else { return };
    let apps = Arc::new(fleet(&server).await);

    // 8 clients, 40 requests each, alternating instances: 320 asks for a window of 100.
    let (done, clients) = traffic(&apps, 40);
    // After 60 answers, both instances reload a file that keeps the policy: its binding (and
    // the blocks it holds) stay.
    answered(&done, 60).await;
    reload_all(&apps, &config(100, "v2.toml"), true);
    assert!(done.load(Ordering::SeqCst) < 320, "the reloads happened under traffic");
    let mut ok = admitted(clients).await;
    // Whatever the instances still hold is spent by asking each of them again: exactly the
    // window's 100 over the whole run, not one more, none stranded.
    ok += drain(&apps, 20).await;
    assert_eq!(ok, 100);
    // Both instances decided from blocks, through the reload, on the binding they started with.
    for stats in lease_stats(&apps) {
        assert!(stats.grants > 0 && stats.decided_locally > 0, "{stats:?}");
    }

    // A changed quota binds the policy anew, from a full window of the new count; the old
    // binding's blocks are not spent for it.
    reload_all(&apps, &config(150, "v3.toml"), false);
    assert_eq!(drain(&apps, 100).await, 150);
}

/// A GCRA policy leased with prefetching (blocks of at most 64, fetched ahead in the
/// background), reloaded under traffic by both instances: a reload that keeps the policy keeps
/// its binding, its blocks and the prefetches in flight, so the burst (400; the clock stands
/// still, nothing refills) is admitted exactly once over both instances, none of it stranded
/// and none beyond it (the stated bound, 2 x 64 over any interval, is not even used: with
/// nothing refilling, what Redis charges is all that can be admitted). A changed quota binds
/// it anew, from a full burst of the new count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetching_gcra_instances_admit_the_burst_exactly_across_reloads_under_traffic() {
    let lease = Lease::new().max_block(64).lifetime(Duration::from_secs(30)).prefetch(true);
    burst_across_reloads(lease).await;
}

/// The same with blocks leased from the key's schedule: a key with its burst to spend is
/// leased as without it, and once the burst is spent a unit leased ahead (one each 9 s,
/// within the 15 s horizon) never conforms on the stores' clock, which stands still: the
/// burst is admitted exactly, across reloads, and nothing beyond it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_leasing_the_schedule_admit_the_burst_exactly_across_reloads_under_traffic() {
    let lease =
        Lease::new().max_block(64).lifetime(Duration::from_secs(30)).prefetch(true).schedule(true);
    burst_across_reloads(lease).await;
}

async fn burst_across_reloads(lease: Lease) {
    let Some(server) = Server::start("redis-server") else { return };
    let apps = Arc::new(fleet_of(&server, lease, config_of("gcra", 400, "v1.toml")).await);

    // 8 clients, 100 requests each, alternating instances: 800 asks for a burst of 400.
    let (done, clients) = traffic(&apps, 100);
    // Once blocks have grown enough to be fetched ahead (200 answers), both instances reload
    // a file that keeps the policy.
    answered(&done, 200).await;
    let prefetched_before: u64 = lease_stats(&apps).iter().map(|s| s.prefetched).sum();
    reload_all(&apps, &config_of("gcra", 400, "v2.toml"), true);
    assert!(done.load(Ordering::SeqCst) < 800, "the reloads happened under traffic");
    let mut ok = admitted(clients).await;
    // What the instances still hold is spent by asking each of them again: the burst exactly.
    ok += drain(&apps, 100).await;
    assert_eq!(ok, 400);
    let stats = lease_stats(&apps);
    let prefetched: u64 = stats.iter().map(|s| s.prefetched).sum();
    assert!(prefetched_before > 0, "blocks were fetched ahead before the reload: {stats:?}");
    for s in &stats {
        // Every admission came from a block of the binding started with, kept by the reload.
        assert!(s.grants > 0 && s.decided_locally > 0, "{s:?}");
        assert!(s.units_granted - s.units_returned <= 400, "{s:?}");
    }
    assert!(prefetched >= prefetched_before);

    // A changed quota binds the policy anew, from a full burst of the new count.
    reload_all(&apps, &config_of("gcra", 500, "v3.toml"), false);
    assert_eq!(drain(&apps, 300).await, 500);
}
