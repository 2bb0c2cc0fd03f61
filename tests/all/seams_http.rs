//! The seam matrix over real HTTP/1.1 on loopback (issue 33): bodies metered as they stream
//! meet penalty boxes, shaping, concurrent bodies, sized and chunked uploads, downloads, and
//! the memory and Redis stores, in seeded random traces.
//!
//! A trace is a run of batches on one key: each batch sends one to five uploads (or
//! downloads) at once, of random sizes, frames and framing (`Content-Length` or chunked),
//! through the layer's default stream metering (policing) or a shaping layer, to a tier of a
//! random capacity whose clock stands still (nothing refills, so what is left is exactly the
//! capacity less what was charged). What each feature's docs promise, checked after each
//! batch:
//!
//! - **Budget left, no breach** (`StreamMode`, `Penalty`, issue 33): a batch whose bodies fit
//!   together in what the key has left is admitted whole, each body read (or sent) to its end,
//!   with or without a penalty box (a stream's grants are never a breach of the key's).
//! - **The bound** (`StreamMode`, "The bound"): the bytes the handler read are at most what the
//!   tier had left plus less than one frame per stream; a download is cut to its grant, so a
//!   client receives at most what the tier had left.
//! - **Charged what streamed**: what the key has left afterwards is the capacity less the
//!   bytes the handlers read (or sent), on both stores alike.
//!
//! `TOLLGATE_LONG_TESTS=1` runs ten times as many seeds.
#![cfg(feature = "axum")]

use crate::streams::{Frames, Log, uploads_behind};
use crate::support;

use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body as AxumBody;
use axum::extract::Path;
use axum::routing::get;
use http::StatusCode;
use http_body_util::BodyExt;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::serve;
use tollgate::key::{GlobalKey, Key};
use tollgate::store::Store;
use tollgate::{Limiter, Penalty, Policy, Quota, RateLimitLayer, Unit};

/// One body of a batch.
#[derive(Debug, Clone, Copy)]
struct Body {
    len: u64,
    frame: usize,
    /// With a `Content-Length` (else chunked).
    sized: bool,
}

/// A trace: the tier's capacity, its features, and the batches sent.
#[derive(Debug, Clone)]
struct Trace {
    capacity: u64,
    penalty: bool,
    shape: bool,
    download: bool,
    batches: Vec<Vec<Body>>,
}

/// The trace of `seed`: uploads or downloads, policed or shaped, with or without a
/// penalty box. Shaping waits, on a clock that stands still, forever: its batches, and
/// downloads' (a plain HTTP response that has started is shaped when it runs out), fit.
///
/// Out of the known seams (each has an ignored test below): a chunked upload is sent alone
/// ([`chunked_uploads_that_fit_together_on_memory`],
/// [`shaped_chunked_uploads_that_fit_together_on_memory`]).
fn trace(seed: u64) -> Trace {
    let mut rng = fastrand::Rng::with_seed(seed);
    let capacity = [4_000, 20_000, 100_000][rng.usize(..3)];
    let (penalty, shape, download) = (rng.bool(), rng.u8(..4) == 0, rng.u8(..3) == 0);
    let must_fit = shape || download;
    let mut left = capacity;
    let mut batches = Vec::new();
    for _ in 0..rng.usize(3..8) {
        let mut batch = Vec::new();
        let size = rng.usize(1..=5);
        for _ in 0..size {
            let len = rng.u64(1..=capacity / 3);
            if must_fit && len > left {
                continue;
            }
            left = left.saturating_sub(len);
            let frame = [256, 1_024, 4_096, 16_384][rng.usize(..4)];
            let sized = size > 1 || rng.bool();
            batch.push(Body { len, frame, sized });
        }
        if !batch.is_empty() {
            batches.push(batch);
        }
    }
    Trace { capacity, penalty, shape, download, batches }
}

fn policy(t: &Trace) -> Policy {
    let unit = if t.download { Unit::ResponseBytes } else { Unit::RequestBytes };
    let mut b = Policy::builder("bodies")
        .tier("bytes", Quota::per_second(1).with_burst(t.capacity).counting(unit));
    if t.penalty {
        b = b.penalty("bytes", Penalty::new(Duration::from_secs(600)));
    }
    b.build().unwrap()
}

/// The app: uploads read frame by frame into `log` on `/upload`; `/download/{len}/{frame}`
/// answers `len` bytes in frames of `frame`.
fn app<St: Store>(t: &Trace, store: St, log: &Log) -> (Router, Limiter<St>) {
    let mut b = RateLimitLayer::builder(policy(t)).key(GlobalKey).store(store);
    if t.shape {
        b = b.shape(Duration::from_secs(1));
    }
    let layer = b.build().unwrap();
    let limiter = layer.limiter().clone();
    if !t.download {
        return (uploads_behind(layer, log, Instant::now()), limiter);
    }
    let download = get(|Path((len, frame)): Path<(u64, usize)>| async move {
        AxumBody::new(Frames::new(len, frame, true))
    });
    (Router::new().route("/download/{len}/{frame}", download).layer(layer), limiter)
}

/// Sends `batch` at once to `base`; per body, its status and the bytes the client received
/// (`None`: no answer within the wait).
async fn send(base: &str, download: bool, batch: &[Body]) -> Vec<Option<(StatusCode, u64)>> {
    let client: Client<_, Frames> = Client::builder(TokioExecutor::new()).build_http();
    let calls: Vec<_> = batch
        .iter()
        .map(|b| {
            let req = if download {
                http::Request::get(format!("{base}/download/{}/{}", b.len, b.frame))
                    .body(Frames::new(0, 1, true))
            } else {
                http::Request::post(format!("{base}/upload"))
                    .body(Frames::new(b.len, b.frame, b.sized))
            };
            let (req, client) = (req.unwrap(), client.clone());
            tokio::spawn(async move {
                let call = async {
                    let res = client.request(req).await.ok()?;
                    let status = res.status();
                    let mut body = res.into_body();
                    let mut got = 0;
                    while let Some(Ok(frame)) = body.frame().await {
                        got += frame.into_data().map_or(0, |d| d.len() as u64);
                    }
                    Some((status, got))
                };
                tokio::time::timeout(Duration::from_secs(10), call).await.ok().flatten()
            })
        })
        .collect();
    let mut out = Vec::new();
    for c in calls {
        out.push(c.await.unwrap());
    }
    out
}

async fn left<St: Store>(limiter: &Limiter<St>) -> u64 {
    limiter.check(&Key::Global, 0).await.unwrap().tiers()[0].remaining()
}

/// Runs trace `seed` on `store`; what went wrong, if anything.
async fn run<St: Store>(seed: u64, store: St) -> Result<(), String> {
    run_trace(seed, trace(seed), store).await
}

/// Runs trace `t` (of seed `seed`, for the messages) on `store`.
async fn run_trace<St: Store>(seed: u64, t: Trace, store: St) -> Result<(), String> {
    let log = Log::default();
    let (router, limiter) = app(&t, store, &log);
    let server = serve(router).await;
    let base = server.url("");
    let base = base.trim_end_matches('/');
    let mut moved = 0; // bytes read by the handlers, or received by the client
    let mut blocked = false;
    for (n, batch) in t.batches.iter().enumerate() {
        let before = left(&limiter).await;
        let wanted: u64 = batch.iter().map(|b| b.len).sum();
        let got = send(base, t.download, batch).await;
        let read: u64 = if t.download {
            got.iter().flatten().map(|(_, len)| len).sum()
        } else {
            log.lock().unwrap().iter().map(|(_, len)| len).sum::<u64>() - moved
        };
        moved += read;
        let at = |what: String| {
            format!(
                "seed {seed}, batch {n} of {t:?}: {batch:?}, {before} left: {what}; got {got:?}"
            )
        };
        let fits = wanted <= before && !blocked;
        if fits && got.iter().any(|g| g.is_none_or(|(s, _)| s != StatusCode::OK)) {
            return Err(at("bodies that fit what is left are all admitted".into()));
        }
        if fits && read != wanted {
            return Err(at(format!("all {wanted} bytes stream, not {read}")));
        }
        let frames: u64 = batch.iter().map(|b| b.frame as u64).sum();
        let bound = if t.download { before } else { before + frames };
        if read > bound {
            return Err(at(format!("{read} bytes moved, more than the bound {bound}")));
        }
        // A refusal of a body that did not fit is the key's breach: a blocked key reports
        // nothing left (`Penalty`).
        blocked |= t.penalty && got.iter().any(|g| g.is_none_or(|(s, _)| s != StatusCode::OK));
        let after = left(&limiter).await;
        if !blocked && after != t.capacity.saturating_sub(moved) {
            return Err(at(format!(
                "{after} left, not the capacity less the {moved} bytes that streamed"
            )));
        }
    }
    Ok(())
}

/// The seeds of a run.
fn seeds() -> std::ops::Range<u64> {
    let long = std::env::var("TOLLGATE_LONG_TESTS").is_ok_and(|v| v == "1");
    0..if long { 240 } else { 24 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_that_fit_stream_whole_and_the_rest_keeps_the_bound_on_memory() {
    for seed in seeds() {
        if let Err(e) = run(seed, support::stores::frozen_memory()).await {
            panic!("{e}");
        }
    }
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_that_fit_stream_whole_and_the_rest_keeps_the_bound_on_redis() {
    let Some(redis) = support::redis::Server::start("redis-server") else { return };
    for seed in seeds() {
        let store = support::stores::redis::frozen_on(&redis, &format!("seamshttp{seed}:"));
        if let Err(e) = run(seed, store).await {
            panic!("{e}");
        }
    }
}

/// Runs `t` `n` times on stores `store` makes (the failures of concurrent streams come and go
/// with their timing), and fails at the first run that breaks a promise.
async fn runs<St: Store>(n: usize, t: &Trace, store: impl Fn(usize) -> St) {
    for i in 0..n {
        if let Err(e) = run_trace(0, t.clone(), store(i)).await {
            panic!("run {i} of {n}: {e}");
        }
    }
}

/// Chunked uploads that fit together, sent at once when policing: the streams' grants hold
/// room beyond their bodies, so one is refused (three chunked ones, 10,168 of 11,951 bytes
/// left; and two sized beside two chunked, 2,872 of 3,630: a sized one, charged its
/// `Content-Length` at admission). Not every run: the grants' timing decides.
fn chunked_uploads() -> [Trace; 2] {
    let body = |len, frame, sized| Body { len, frame, sized };
    let chunked =
        vec![body(1_948, 1_024, false), body(6_565, 16_384, false), body(1_655, 256, false)];
    let mixed = vec![
        body(552, 4_096, true),
        body(194, 256, false),
        body(1_107, 4_096, false),
        body(1_019, 256, true),
    ];
    let trace = |capacity, batch| Trace {
        capacity,
        penalty: false,
        shape: false,
        download: false,
        batches: vec![batch],
    };
    [trace(11_951, chunked), trace(3_630, mixed)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_uploads_that_fit_together_on_memory() {
    for t in chunked_uploads() {
        runs(20, &t, |_| support::stores::frozen_memory()).await;
    }
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_uploads_that_fit_together_on_redis() {
    let Some(redis) = support::redis::Server::start("redis-server") else { return };
    for (n, t) in chunked_uploads().iter().enumerate() {
        let store = |i| support::stores::redis::frozen_on(&redis, &format!("chunked{n}-{i}:"));
        runs(20, t, store).await;
    }
}

/// Five chunked uploads that fit together (13,980 of 14,258 bytes left), sent at once through
/// a shaping layer: one waits for room the others' grants hold beyond their bodies (on a clock
/// that stands still, for good). Not every run.
fn shaped_chunked() -> Trace {
    let body = |len, frame| Body { len, frame, sized: false };
    let batch = vec![
        body(5_957, 16_384),
        body(6_141, 1_024),
        body(1_317, 1_024),
        body(503, 16_384),
        body(62, 1_024),
    ];
    Trace { capacity: 14_258, penalty: false, shape: true, download: false, batches: vec![batch] }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "issue 33: stream grants × small concurrent bodies, when shaping (new), fixed by owner"]
async fn shaped_chunked_uploads_that_fit_together_on_memory() {
    runs(20, &shaped_chunked(), |_| support::stores::frozen_memory()).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "issue 33: stream grants × small concurrent bodies, when shaping (new), fixed by owner"]
async fn shaped_chunked_uploads_that_fit_together_on_redis() {
    let Some(redis) = support::redis::Server::start("redis-server") else { return };
    let store = |i| support::stores::redis::frozen_on(&redis, &format!("shaped{i}:"));
    runs(20, &shaped_chunked(), store).await;
}

/// Three downloads that fit exactly what is left (1,650 bytes), at once, on a tier with a
/// penalty box, on Redis: one stops and waits (about 2 runs of 3); without the penalty box,
/// or on memory, all three are sent whole.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_downloads_that_fit_under_a_penalty_box_on_redis() {
    let Some(redis) = support::redis::Server::start("redis-server") else { return };
    let body = |len| Body { len, frame: 1_024, sized: true };
    let batch = vec![body(942), body(643), body(65)];
    let t = Trace {
        capacity: 1_650,
        penalty: true,
        shape: false,
        download: true,
        batches: vec![batch],
    };
    let store = |i| support::stores::redis::frozen_on(&redis, &format!("downloads{i}:"));
    runs(20, &t, store).await;
}
