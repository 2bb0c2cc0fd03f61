//! Limits from `tollgate.toml`, changed while serving: loads a copy of the sample file, serves
//! an axum app on an ephemeral loopback port, sends requests, then edits the copy to change one
//! quota (the free plan, 100 a minute down to 2) and shows the watcher's reload taking effect
//! while the unchanged per-address policy keeps counting from where it was. Last, it adds the
//! SaaS plan of the configuration guide (`tollgate::guide::config_file`: calendar, concurrency
//! and byte tiers) to the file and uploads under it. Exits by itself.
//!
//! Run: `cargo run --example config --features config`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tollgate::config::{LimitsConfig, LimitsLayer};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// The configuration guide's SaaS plan, per API key on `/upload`: 10,000 requests a month in
/// Europe/Berlin, 4 in flight, 1 GB of uploads a day.
const SAAS: &str = r#"
[policies.saas]
tiers = [
    { name = "monthly", kind = "calendar", count = 10_000, period = "month", time_zone = "Europe/Berlin" },
    { name = "in-flight", kind = "concurrency", max = 4 },
    { name = "daily-uploads", kind = "calendar", count = 1_000_000_000, period = "day", time_zone = "Europe/Berlin", unit = "request_bytes" },
]

[[rules]]
name = "saas"
paths = ["/upload"]
key = "header:x-api-key"
policy = "saas"
"#;

/// Uploads `bytes` bytes to `url` with an API key and prints the status and every tier's state.
async fn upload(
    client: &HttpClient,
    url: &str,
    bytes: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let body = Full::new(Bytes::from(vec![b'x'; bytes]));
    let req = http::Request::post(url).header("x-api-key", "k1").body(body)?;
    let res = client.request(req).await?;
    let state = res.headers().get("ratelimit").map_or("(none)", |v| v.to_str().unwrap_or("?"));
    println!("   {} upload of {bytes} bytes  RateLimit: {state}", res.status().as_u16());
    Ok(())
}

/// Sends `GET url` with an API key (on the free plan) and prints the status and the state of
/// every tier that applied.
async fn call(client: &HttpClient, url: &str) -> Result<(), Box<dyn std::error::Error>> {
    let req = http::Request::get(url).header("x-api-key", "k1").body(Full::default())?;
    let res = client.request(req).await?;
    let state = res.headers().get("ratelimit").map_or("(none)", |v| v.to_str().unwrap_or("?"));
    println!(
        "   {} {}  RateLimit: {state}",
        res.status().as_u16(),
        url.rsplit('/').next().unwrap_or("")
    );
    Ok(())
}

/// A directory of its own for the copy, removed at the end.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The watcher logs each reload (and each refused file) through `tracing`.
    tracing_subscriber::fmt().with_target(false).without_time().init();

    let dir = TempDir(std::env::temp_dir().join(format!("tollgate-config-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0)?;
    let path = dir.0.join("tollgate.toml");
    let sample =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tollgate.toml"))?;
    std::fs::write(&path, &sample)?;

    let layer = LimitsLayer::new(LimitsConfig::load(&path)?)?;
    let handle = layer.handle();
    let watcher = tokio::spawn(handle.clone().watch(path.clone(), Duration::from_millis(100)));

    let app = Router::new()
        .route("/api/items", get(|| async { "items\n" }))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/upload", post(|body: Bytes| async move { format!("{} bytes\n", body.len()) }))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await
    });
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let url = |path: &str| format!("http://{addr}{path}");

    println!("== {} served on {addr}", path.display());
    println!("   policies: {:?}", handle.config().policies().map(|p| p.name()).collect::<Vec<_>>());
    println!("== health checks are not limited:");
    call(&client, &url("/healthz")).await?;
    println!("== the API, per address and per API key on the free plan (100 a minute):");
    for _ in 0..3 {
        call(&client, &url("/api/items")).await?;
    }

    println!("== editing the copy: the free plan becomes 2 a minute");
    let edited = sample.replace(
        r#"tiers = [{ name = "free", count = 100, period = "1m" }]"#,
        r#"tiers = [{ name = "free", count = 2, period = "1m" }]"#,
    );
    assert_ne!(edited, sample, "the sample's free plan is where this example expects it");
    std::fs::write(&path, &edited)?;
    let free_count = || handle.config().policy("free").map(|p| p.tiers()[0].quota().count());
    for _ in 0..50 {
        if free_count() == Some(2) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if free_count() != Some(2) {
        return Err("the watcher did not reload the file within 5 s".into());
    }
    println!(
        "== after the reload: the key keeps its used share of the free plan (3 of 100 is 0.06 of \
         2: changed_tiers = \"carry_used_fraction\"), per-ip keeps its count:"
    );
    for _ in 0..3 {
        call(&client, &url("/api/items")).await?;
    }

    println!("== a broken edit is refused (the error is logged below) and the limits stay:");
    std::fs::write(&path, sample.replace(r#"period = "1h""#, r#"period = "1 fortnight""#))?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    call(&client, &url("/api/items")).await?;

    println!("== the guide's SaaS plan added to the file: a month in Berlin, 4 in flight, bytes:");
    std::fs::write(&path, format!("{edited}{SAAS}"))?;
    for _ in 0..50 {
        if handle.config().policy("saas").is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if handle.config().policy("saas").is_none() {
        return Err("the watcher did not reload the file within 5 s".into());
    }
    for bytes in [1_000, 250_000] {
        upload(&client, &url("/upload"), bytes).await?;
    }

    watcher.abort();
    server.abort();
    Ok(())
}
