//! The layer over real HTTP: two app instances, one Redis, one limit.

use super::*;

// ---------------------------------------------------------------------------------------------
// The layer over real HTTP: two app instances, one Redis, one limit.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_app_instances_enforce_one_limit_over_http() {
    let Some(server) = Server::start("redis-server") else { return };
    let policy = Policy::single("fleet", Quota::per_hour(30)).unwrap();
    let mut apps = Vec::new();
    for _ in 0..2 {
        // Each instance has its own store (own connection); PeerIp keys both by 127.0.0.1.
        let store =
            RedisStore::builder(server.url()).timeout(Duration::from_secs(5)).build().unwrap();
        let layer = RateLimitLayer::builder(policy.clone()).store(store).build().unwrap();
        let app =
            axum::Router::new().route("/", axum::routing::get(|| async { "ok" })).layer(layer);
        apps.push(support::serve(app).await);
    }
    let client = support::client();
    let requests: Vec<_> = (0..100)
        .map(|i| {
            let (client, url) = (client.clone(), apps[i % 2].url("/"));
            tokio::spawn(async move { support::get(&client, &url, &[]).await })
        })
        .collect();
    let (mut ok, mut limited) = (0, 0);
    for r in requests {
        let reply = r.await.unwrap();
        match reply.status {
            http::StatusCode::OK => ok += 1,
            http::StatusCode::TOO_MANY_REQUESTS => {
                limited += 1;
                let retry: u64 = reply.header("retry-after").unwrap().parse().unwrap();
                assert!(retry >= 1);
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!((ok, limited), (30, 70));
}
