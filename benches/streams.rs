#![allow(missing_docs)] // criterion_group! generates undocumented items.
//! The cost of metering a streamed response: a 100 MB body (frames of 16 KiB) through an axum
//! `Router` with the layer, driven as a `tower::Service` (no network) on a current-thread
//! runtime, the body read to its end. Every case admits the request and lets every byte
//! through (the byte tier is far from its limit), so the difference is the metering alone:
//!
//! - `no-byte-tier`: a policy with one rate tier (the reference);
//! - `bytes-settle`: the same policy plus a response-bytes tier, settled once when the body
//!   ends (`StreamMode::Settle`);
//! - `bytes-shape` / `bytes-police`: the byte tier charged as the body streams, one store call
//!   per grant of 64 KiB (`StreamMode::Shape`, `StreamMode::Police`);
//! - `bytes-default`: no `on_stream`: the layer's own mode (policing), as a user gets it;
//! - `bare`: the router without the layer.
//!
//! `streams/loopback-100MB/*`: the same cases served by `axum::serve` on a loopback port and
//! downloaded with hyper's client, so that the socket's cost is counted too (what a server
//! pays per streamed byte).
//!
//! `streams/loopback-cpu-100MB/*`: the same download over loopback, timed in CPU time rather
//! than wall time: `iter_custom` returns the process's user + system time (`getrusage`) spent
//! while the response was served and read (server and client are in this process, on one
//! thread, and nothing else runs meanwhile). Each iteration of a case with a byte tier also
//! downloads from the case without one, just before or just after it (in turn), and the
//! ratio of each such pair is printed at the end of the group (median and range): pairs taken
//! moments apart share the machine's load, where criterion's per-case estimates, seconds
//! apart, may not.
//!
//! `cargo bench --bench streams`, or one group:
//! `cargo bench --bench streams -- loopback-cpu --warm-up-time 1 --measurement-time 3`

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body as AxumBody;
use axum::routing::get;
use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use http::Request;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tollgate::key::GlobalKey;
use tollgate::{Policy, Quota, RateLimitLayer, StreamMode, Unit};
use tower::ServiceExt;

/// Bytes per response.
const LEN: u64 = 100 * 1024 * 1024;
/// Bytes per frame.
const FRAME: usize = 16 * 1024;

/// `left` bytes in frames of [`FRAME`] (one shared buffer, sliced: no copy per frame).
struct Frames {
    left: u64,
    frame: Bytes,
}

impl Body for Frames {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let len = self.left.min(FRAME as u64);
        self.left -= len;
        Poll::Ready(Some(Ok(Frame::data(self.frame.slice(..len as usize)))))
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

fn router() -> Router {
    let frame = Bytes::from(vec![b'x'; FRAME]);
    Router::new().route(
        "/",
        get(move || {
            let frame = frame.clone();
            async move { AxumBody::new(Frames { left: LEN, frame }) }
        }),
    )
}

fn layered(bytes: bool, mode: Option<StreamMode>) -> Router {
    let mut policy = Policy::builder("download").tier("requests", Quota::per_second(1_000_000));
    if bytes {
        // 4 GB a millisecond (a burst of 4 GB): never the limit here.
        policy = policy.tier(
            "response-bytes",
            Quota::new(4_000_000_000, Duration::from_millis(1)).counting(Unit::ResponseBytes),
        );
    }
    let layer = RateLimitLayer::builder(policy.build().unwrap()).key(GlobalKey);
    let layer = match mode {
        Some(mode) => layer.on_stream(mode),
        None => layer,
    };
    router().layer(layer.build().unwrap())
}

/// The cases compared, by name.
fn cases() -> [(&'static str, Router); 6] {
    [
        ("bare", router()),
        ("no-byte-tier", layered(false, None)),
        ("bytes-settle", layered(true, Some(StreamMode::Settle))),
        ("bytes-shape", layered(true, Some(StreamMode::Shape))),
        ("bytes-police", layered(true, Some(StreamMode::Police))),
        ("bytes-default", layered(true, None)),
    ]
}

/// Reads a successful response's body to its end, checking that every byte came.
async fn read_all<B>(res: http::Response<B>)
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Debug,
{
    assert!(res.status().is_success());
    let mut body = res.into_body();
    let mut read = 0u64;
    while let Some(frame) = body.frame().await {
        read += frame.unwrap().data_ref().map_or(0, |d| d.len() as u64);
    }
    assert_eq!(read, LEN);
}

fn streams(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut g = c.benchmark_group("streams/100MB");
    g.throughput(Throughput::Bytes(LEN))
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    for (name, app) in cases() {
        g.bench_function(name, |b| {
            b.iter(|| {
                rt.block_on(async {
                    let req = Request::get("/").body(AxumBody::empty()).unwrap();
                    read_all(app.clone().oneshot(req).await.unwrap()).await;
                });
            });
        });
    }
    g.finish();

    // Over loopback HTTP/1.1, a multi-thread runtime as a server has.
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut g = c.benchmark_group("streams/loopback-100MB");
    g.throughput(Throughput::Bytes(LEN))
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(8));
    let client: Client<_, AxumBody> = Client::builder(TokioExecutor::new()).build_http();
    for (name, app) in cases() {
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let server = rt.spawn(async move { axum::serve(listener, app).await });
        let url: http::Uri = format!("http://{addr}/").parse().unwrap();
        g.bench_function(name, |b| {
            b.iter(|| {
                rt.block_on(async {
                    let req = Request::get(url.clone()).body(AxumBody::empty()).unwrap();
                    read_all(client.request(req).await.unwrap()).await;
                });
            });
        });
        server.abort();
    }
    g.finish();
}

/// The CPU time this process has used so far, user and system, all threads.
fn cpu_time() -> Duration {
    use nix::sys::resource::{UsageWho, getrusage};
    use nix::sys::time::TimeValLike;
    let usage = getrusage(UsageWho::RUSAGE_SELF).expect("getrusage");
    let micros = usage.user_time().num_microseconds() + usage.system_time().num_microseconds();
    Duration::from_micros(u64::try_from(micros).expect("CPU time is positive"))
}

/// The CPU time a 100 MB download from `url` costs the process (server and client).
fn download_cpu(
    rt: &tokio::runtime::Runtime,
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, AxumBody>,
    url: &http::Uri,
) -> Duration {
    let start = cpu_time();
    rt.block_on(async {
        let req = Request::get(url.clone()).body(AxumBody::empty()).unwrap();
        read_all(client.request(req).await.unwrap()).await;
    });
    cpu_time() - start
}

/// Median and range of `ratios`.
fn summary(ratios: &mut [f64]) -> String {
    ratios.sort_by(f64::total_cmp);
    let median = ratios[ratios.len() / 2];
    let (low, high) = (ratios[0], ratios[ratios.len() - 1]);
    format!("{median:.3}x [{low:.3}–{high:.3}] over {} pairs", ratios.len())
}

fn streams_cpu(c: &mut Criterion) {
    // One thread serves and reads: how the socket's buffers fill between the two (so how
    // many reads and writes 100 MB take) then depends on the runtime alone, not on how a
    // loaded machine schedules two threads, and the CPU time is comparable from run to run.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client: Client<_, AxumBody> = Client::builder(TokioExecutor::new()).build_http();
    // Every case served at once, each on its own port.
    let mut served = Vec::new();
    for (name, app) in cases() {
        if name == "bare" {
            continue;
        }
        let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let url: http::Uri = format!("http://{}/", listener.local_addr().unwrap()).parse().unwrap();
        let server = rt.spawn(async move { axum::serve(listener, app).await });
        served.push((name, url, server));
    }
    let reference = served[0].1.clone();
    let mut g = c.benchmark_group("streams/loopback-cpu-100MB");
    g.throughput(Throughput::Bytes(LEN))
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    let mut pairs = Vec::new();
    for (name, url, _) in &served {
        let mut ratios = Vec::new();
        g.bench_function(*name, |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    if *url == reference {
                        spent += download_cpu(&rt, &client, url);
                        continue;
                    }
                    // Each pair in turn starts with the case or with the reference, so that
                    // the order within a pair favours neither.
                    let first = ratios.len() % 2 == 0;
                    let without =
                        if first { Duration::ZERO } else { download_cpu(&rt, &client, &reference) };
                    let cpu = download_cpu(&rt, &client, url);
                    let without =
                        if first { download_cpu(&rt, &client, &reference) } else { without };
                    spent += cpu;
                    ratios.push(cpu.as_secs_f64() / without.as_secs_f64());
                }
                spent
            });
        });
        if !ratios.is_empty() {
            pairs.push((*name, ratios));
        }
    }
    g.finish();
    for (name, mut ratios) in pairs {
        println!("streams/loopback-cpu-100MB/{name}: CPU / no-byte-tier {}", summary(&mut ratios));
    }
    for (_, _, server) in served {
        server.abort();
    }
}

criterion_group!(benches, streams, streams_cpu);
criterion_main!(benches);
