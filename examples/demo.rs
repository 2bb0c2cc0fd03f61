//! The main job: serves an axum app with three per-route policies on an ephemeral loopback port,
//! drives it for a few seconds with real HTTP requests, and prints what happened.
//!
//! - `/police`: 10 requests/s per client IP, burst 5, rejected with 429 beyond that.
//! - `/shape`: 5 requests/s per client IP, burst 1, held up to 300 ms for a free slot.
//! - `/upload`: stacked tiers (20 units/s and 60 units per 3 s) with a cost in units from the
//!   `Content-Length` (one unit per KiB, rounded up).
//! - `/beta`: a stricter limit (3 requests/s) tried in dry run: nothing is refused, every
//!   would-be refusal is logged and counted.
//! - `/metrics`: the layer's metrics in the Prometheus text format
//!   (`metrics-exporter-prometheus`); the demo scrapes it at the end.
//!
//! Run: `cargo run --example demo`.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::{Router, routing::get, routing::post};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate::{Algorithm, Policy, Quota, RateLimitLayer};

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

#[derive(Default)]
struct Tally {
    allowed: usize,
    limited: usize,
    delays: Vec<Duration>,
    sample_ok: Option<http::HeaderMap>,
    sample_429: Option<(http::HeaderMap, String)>,
}

impl Tally {
    async fn record(&mut self, res: http::Response<hyper::body::Incoming>, took: Duration) {
        let status = res.status();
        let (head, body) = res.into_parts();
        let body = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        if status == http::StatusCode::TOO_MANY_REQUESTS {
            self.limited += 1;
            self.sample_429.get_or_insert_with(|| {
                (head.headers.clone(), String::from_utf8_lossy(&body).into_owned())
            });
        } else {
            self.allowed += 1;
            self.delays.push(took);
            self.sample_ok.get_or_insert_with(|| head.headers.clone());
        }
    }

    fn print(&self, route: &str, delayed_over: Duration) {
        let mut d = self.delays.clone();
        d.sort();
        let delayed = d.iter().filter(|x| **x >= delayed_over).count();
        println!("== {route}");
        println!(
            "   allowed {}  limited {}  delayed (>= {delayed_over:?}) {delayed}",
            self.allowed, self.limited
        );
        if let (Some(min), Some(max)) = (d.first(), d.last()) {
            println!(
                "   latency of allowed: min {min:.1?}  median {:.1?}  max {max:.1?}",
                d[d.len() / 2]
            );
        }
        let show = |h: &http::HeaderMap| {
            for name in ["ratelimit-policy", "ratelimit", "retry-after", "content-type"] {
                if let Some(v) = h.get(name) {
                    println!("     {name}: {}", v.to_str().unwrap_or("?"));
                }
            }
        };
        if let Some(h) = &self.sample_ok {
            println!("   sample allowed response headers:");
            show(h);
        }
        if let Some((h, body)) = &self.sample_429 {
            println!("   sample 429 response:");
            show(h);
            println!("     body: {body}");
        }
    }
}

async fn get_req(
    client: &HttpClient,
    url: String,
) -> (http::Response<hyper::body::Incoming>, Duration) {
    let start = Instant::now();
    let res = client.get(url.parse().expect("url")).await.expect("request");
    (res, start.elapsed())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Before any layer is built: layers register their metrics when they are built.
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    let police =
        Policy::builder("per-ip").tier("per-ip", Quota::per_second(10).with_burst(5)).build()?;
    let shape =
        Policy::builder("smooth").tier("smooth", Quota::per_second(5).with_burst(1)).build()?;
    let upload = Policy::builder("upload")
        .tier("second", Quota::per_second(20))
        .tier("3s", Quota::new(60, Duration::from_secs(3)))
        .algorithm(Algorithm::SlidingCounter)
        .build()?;
    let beta = Policy::single("beta", Quota::per_second(3))?;

    let app =
        Router::new()
            .route("/police", get(|| async { "ok" }))
            .route_layer(RateLimitLayer::builder(police).build()?)
            .merge(Router::new().route("/shape", get(|| async { "ok" })).route_layer(
                RateLimitLayer::builder(shape).shape(Duration::from_millis(300)).build()?,
            ))
            .merge(
                Router::new().route("/upload", post(|| async { "stored" })).route_layer(
                    RateLimitLayer::builder(upload)
                        .cost_fn(|parts| {
                            parts
                                .headers
                                .get(http::header::CONTENT_LENGTH)
                                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                                .map_or(1, |bytes| bytes.div_ceil(1024).max(1))
                        })
                        .build()?,
                ),
            )
            .merge(
                Router::new()
                    .route("/beta", get(|| async { "ok" }))
                    .route_layer(RateLimitLayer::builder(beta).dry_run(true).build()?),
            )
            .route("/metrics", get(move || std::future::ready(prometheus.render())));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await
    });
    println!("tollgate demo: serving on http://{addr}");

    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let base = format!("http://{addr}");

    // /police: 12 rounds of 8 concurrent requests, 150 ms apart (~53 req/s offered against 10/s).
    let mut police_tally = Tally::default();
    for _ in 0..12 {
        let batch: Vec<_> = (0..8).map(|_| get_req(&client, format!("{base}/police"))).collect();
        for (res, took) in futures_join(batch).await {
            police_tally.record(res, took).await;
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }

    // /shape: 12 requests at once: about 2 pass at once or within 300 ms (5/s, burst 1), the rest are over budget.
    let mut shape_tally = Tally::default();
    let batch: Vec<_> = (0..12).map(|_| get_req(&client, format!("{base}/shape"))).collect();
    for (res, took) in futures_join(batch).await {
        shape_tally.record(res, took).await;
    }

    // /upload: 60 uploads of 0.5 to 4 KiB, 25 ms apart.
    let mut upload_tally = Tally::default();
    for i in 0..60u64 {
        let size = 512 * (1 + (i * 7) % 8);
        let req = http::Request::post(format!("{base}/upload"))
            .header(http::header::CONTENT_LENGTH, size)
            .body(Full::new(Bytes::from(vec![b'x'; usize::try_from(size)?])))?;
        let start = Instant::now();
        let res = client.request(req).await?;
        upload_tally.record(res, start.elapsed()).await;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }

    // /beta: 10 requests at once against a dry-run 3/s: all served, 7 would-be refusals.
    let mut beta_tally = Tally::default();
    let batch: Vec<_> = (0..10).map(|_| get_req(&client, format!("{base}/beta"))).collect();
    for (res, took) in futures_join(batch).await {
        beta_tally.record(res, took).await;
    }

    police_tally.print("/police (police, 10/s burst 5, per IP)", Duration::from_millis(50));
    shape_tally.print("/shape (shape, 5/s burst 1, max delay 300 ms)", Duration::from_millis(50));
    upload_tally
        .print("/upload (stacked tiers 20/s + 60/3s, cost = KiB)", Duration::from_millis(50));
    beta_tally.print("/beta (dry run, 3/s)", Duration::from_millis(50));

    let (scrape, _) = get_req(&client, format!("{base}/metrics")).await;
    let scrape = scrape.into_body().collect().await?.to_bytes();
    let scrape = String::from_utf8_lossy(&scrape);
    let decisions: Vec<_> = scrape
        .lines()
        .filter(|l| l.starts_with("tollgate_decisions_total{") && !l.ends_with(" 0"))
        .collect();
    println!("== GET /metrics (tollgate_decisions_total, non-zero series)");
    for line in &decisions {
        println!("   {line}");
    }

    let counted = |needle: &str| decisions.iter().any(|l| l.contains(needle));
    let ok = counted("outcome=\"limited\"")
        && counted("outcome=\"dry_run_limited\"")
        && beta_tally.limited == 0
        && police_tally.allowed > 0
        && police_tally.limited > 0
        && shape_tally.delays.iter().any(|d| *d >= Duration::from_millis(100))
        && upload_tally.limited > 0
        && upload_tally.allowed > 0;
    server.abort();
    if !ok {
        return Err(
            "the demo did not show policing, shaping, stacked tiers, dry run and metrics".into()
        );
    }
    println!("demo finished: policing, shaping, stacked tiers, dry run and metrics all observed");
    Ok(())
}

/// Runs futures concurrently on the current task and returns their outputs in order.
async fn futures_join<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output> {
    let handles: Vec<_> = futs.into_iter().map(Box::pin).collect();
    let mut out = Vec::with_capacity(handles.len());
    let mut pending: Vec<_> = handles.into_iter().map(Some).collect();
    let mut results: Vec<Option<F::Output>> = (0..pending.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut done = true;
        for (i, slot) in pending.iter_mut().enumerate() {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => {
                        results[i] = Some(v);
                        *slot = None;
                    }
                    std::task::Poll::Pending => done = false,
                }
            }
        }
        if done { std::task::Poll::Ready(()) } else { std::task::Poll::Pending }
    })
    .await;
    out.extend(results.into_iter().flatten());
    out
}
