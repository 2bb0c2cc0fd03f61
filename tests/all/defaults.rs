//! Right by default, over real HTTP/1.1 on loopback: a tier counting request bytes holds with
//! no stream setting (streams are metered as the layer decides requests), an upload larger
//! than a tier can ever hold is shaped through or refused with 413, an HTTP/1 client reads the
//! refusals of uploads it is still sending, and a stream's grants are never a breach of the
//! key's penalty box nor keep concurrent bodies that fit from being admitted.
#![cfg(feature = "axum")]

use crate::streams::{Frames, Log, MB, uploads_behind};
use crate::support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::serve;
use support::stores::frozen_memory;
use tollgate::key::{GlobalKey, Key};
use tollgate::store::MemoryStore;
use tollgate::{Penalty, Policy, Quota, RateLimitLayer, Unit};

/// A request-bytes tier of `burst` bytes refilled at `rate` a second.
fn bytes_tier(rate: u64, burst: u64) -> Policy {
    Policy::builder("upload")
        .tier("bytes", Quota::per_second(rate).with_burst(burst).counting(Unit::RequestBytes))
        .build()
        .unwrap()
}

/// The bytes the handler read, in all.
fn read(log: &Log) -> u64 {
    log.lock().unwrap().iter().map(|(_, len)| len).sum()
}

/// The status of `n` uploads sent at once to `url` (`None`: the connection failed before an
/// answer).
async fn at_once(url: &str, n: usize, body: impl Fn() -> Frames) -> Vec<Option<StatusCode>> {
    let client: Client<_, Frames> = Client::builder(TokioExecutor::new()).build_http();
    let uploads: Vec<_> = (0..n)
        .map(|_| {
            let req = http::Request::post(url).body(body()).unwrap();
            let client = client.clone();
            tokio::spawn(async move {
                let res = client.request(req).await.ok()?;
                let status = res.status();
                res.into_body().collect().await.ok()?;
                Some(status)
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for upload in uploads {
        statuses.push(upload.await.unwrap());
    }
    statuses
}

/// Ten chunked uploads of 1 MB and 64 KiB at once against a burst of 1 MB, under a layer with
/// no stream setting: policed as they stream, the handler reads at most the burst and one
/// 16 KiB frame per stream (the clock stands still: nothing refills), none is stored whole
/// (not even one that ran alone), and the key is charged exactly what was read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_uploads_are_policed_as_they_stream_by_default() {
    let layer = RateLimitLayer::builder(bytes_tier(MB, MB))
        .key(GlobalKey)
        .store(frozen_memory())
        .build()
        .unwrap();
    let limiter = layer.limiter().clone();
    let log = Log::default();
    let server = serve(uploads_behind(layer, &log, Instant::now())).await;
    let body = || Frames::new(MB + 64 * 1024, 16 * 1024, false);
    let statuses = at_once(&server.url("/upload"), 10, body).await;
    assert!(!statuses.contains(&Some(StatusCode::OK)), "{statuses:?}");
    let read = read(&log);
    assert!((MB - 10 * 16 * 1024..=MB + 10 * 16 * 1024).contains(&read), "{read}");
    // What passed is charged (past the burst by less than a frame per stream).
    let left = limiter.check(&Key::Global, 0).await.unwrap().tiers()[0].remaining();
    assert_eq!(left, MB.saturating_sub(read));
}

/// A 300 KB upload with a `Content-Length` against 100 KB/s (burst 100 KB), the layer
/// shaping: larger than the tier can ever hold at once, it is admitted and metered as it
/// streams, stored whole at the tier's rate (about 2 s; no sooner than the bound allows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sized_upload_larger_than_the_burst_is_shaped_through() {
    let layer = RateLimitLayer::builder(bytes_tier(100_000, 100_000))
        .key(GlobalKey)
        .shape(Duration::from_secs(5))
        .build()
        .unwrap();
    let log = Log::default();
    let start = Instant::now();
    let server = serve(uploads_behind(layer, &log, start)).await;
    let client: Client<_, Frames> = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::post(server.url("/upload"))
        .body(Frames::new(300_000, 16 * 1024, true))
        .unwrap();
    let res = client.request(req).await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "300000");
    // 100 KB of burst, then 200 KB at 100 KB/s, less what the bound lets a stream be ahead
    // of the rate: its last grant (at most 64 KiB) and a frame read before a grant (16 KiB).
    let elapsed = start.elapsed();
    let ahead = (64 + 16) * 1024;
    let least = Duration::from_secs_f64((300_000 - 100_000 - ahead) as f64 / 100_000.0);
    assert!(elapsed >= least, "{elapsed:?}");
}

/// Sends `tries` uploads of `len` bytes with a `Content-Length`, one after the other, each on
/// the connection hyper's client picks: how many got `expected`.
async fn answered(url: &str, tries: usize, len: usize, expected: StatusCode) -> usize {
    let client = support::client();
    let mut seen = 0;
    for _ in 0..tries {
        let req = http::Request::post(url).body(Full::new(Bytes::from(vec![b'x'; len]))).unwrap();
        if let Ok(res) = client.request(req).await {
            let status = res.status();
            if res.into_body().collect().await.is_ok() && status == expected {
                seen += 1;
            }
        }
    }
    seen
}

/// Policing, a 3 MB upload with a `Content-Length` against a burst of 1 MB can never be
/// admitted: 413 Content Too Large with a problem+json body naming the tier and its capacity,
/// no `Retry-After`, and a `RateLimit` whose `t` is not 0. Answered before the body is read,
/// hyper's HTTP/1 client reads it (the rest of the upload is read off and dropped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sized_upload_no_tier_can_hold_gets_413_when_policing() {
    let layer = RateLimitLayer::builder(bytes_tier(MB, MB))
        .key(GlobalKey)
        .store(frozen_memory())
        .build()
        .unwrap();
    let log = Log::default();
    let server = serve(uploads_behind(layer, &log, Instant::now())).await;
    let req = http::Request::post(server.url("/upload"))
        .body(Full::new(Bytes::from(vec![b'x'; 3 * MB as usize])))
        .unwrap();
    let res = support::send(&support::client(), req).await;
    assert_eq!(res.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(res.header("content-type"), Some("application/problem+json"));
    assert_eq!(res.header("retry-after"), None);
    assert_eq!(res.header("connection"), Some("close"));
    assert_eq!(res.header("ratelimit"), Some(r#""bytes";r=1000000;t=1"#));
    let problem = res.json();
    assert_eq!(problem["status"], 413);
    assert_eq!(problem["title"], "Content Too Large");
    assert_eq!(problem["violated-policies"], serde_json::json!(["bytes"]));
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("`bytes` holds 1000000 bytes"), "{detail}");
    assert_eq!(read(&log), 0);
    let url = server.url("/upload");
    let seen = answered(&url, 100, 3 * MB as usize, StatusCode::PAYLOAD_TOO_LARGE).await;
    assert!(seen >= 99, "{seen} of 100");
}

/// Policing, uploads with a `Content-Length` past what the key has left are refused with 429
/// before their body is read; hyper's HTTP/1 client reads the 429 in at least 99 of 100 tries
/// (before the body was read off, about a quarter failed with a broken pipe).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_client_reads_the_429_of_an_upload_it_is_still_sending() {
    let layer = RateLimitLayer::builder(bytes_tier(4 * MB, 4 * MB))
        .key(GlobalKey)
        .store(frozen_memory())
        .build()
        .unwrap();
    let log = Log::default();
    let server = serve(uploads_behind(layer, &log, Instant::now())).await;
    let url = server.url("/upload");
    assert_eq!(answered(&url, 1, 3 * MB as usize, StatusCode::OK).await, 1);
    let seen = answered(&url, 100, 3 * MB as usize, StatusCode::TOO_MANY_REQUESTS).await;
    assert!(seen >= 99, "{seen} of 100");
    assert_eq!(read(&log), 3 * MB);
}

/// A tier of 100,000 bytes an hour whose first breach blocks the key for 10 minutes: chunked
/// uploads of 10 KiB are admitted while they fit (the fifth at 41 KB used, the ninth at
/// 82 KB); the streams' grants are never counted as breaches. The tenth runs past the budget:
/// refused, and the key blocked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_within_the_budget_never_trip_the_penalty_box() {
    let policy = Policy::builder("upload")
        .tier("bytes", Quota::per_hour(100_000).counting(Unit::RequestBytes))
        .penalty("bytes", Penalty::new(Duration::from_secs(600)))
        .build()
        .unwrap();
    let layer =
        RateLimitLayer::builder(policy).key(GlobalKey).store(frozen_memory()).build().unwrap();
    let log = Log::default();
    let server = serve(uploads_behind(layer, &log, Instant::now())).await;
    let client: Client<_, Frames> = Client::builder(TokioExecutor::new()).build_http();
    let upload = || {
        let req = http::Request::post(server.url("/upload"))
            .body(Frames::new(10 * 1024, 2 * 1024, false))
            .unwrap();
        client.request(req)
    };
    for i in 1..=9 {
        let res = upload().await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "upload {i}");
    }
    // 92,160 bytes used: the tenth does not fit.
    let tenth = upload().await.map(|res| res.status());
    assert!(matches!(tenth, Ok(StatusCode::TOO_MANY_REQUESTS) | Err(_)), "{tenth:?}");
    let blocked = upload().await.unwrap();
    assert_eq!(blocked.status(), StatusCode::TOO_MANY_REQUESTS);
    let wait: u64 = blocked.headers()["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((599..=600).contains(&wait), "{wait}");
}

/// Six chunked uploads of 600 bytes at once against a tier of 4,000 bytes (the clock stands
/// still): they fit together, so all are admitted, whatever grants their streams took; three
/// rounds, each on a store of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_uploads_that_fit_together_are_all_admitted() {
    for round in 0..3 {
        let layer = RateLimitLayer::builder(bytes_tier(1, 4_000))
            .key(GlobalKey)
            .store(MemoryStore::builder().clock(tollgate::clock::FakeClock::new()).build().unwrap())
            .build()
            .unwrap();
        let limiter = layer.limiter().clone();
        let log = Log::default();
        let server = serve(uploads_behind(layer, &log, Instant::now())).await;
        let statuses = at_once(&server.url("/upload"), 6, || Frames::new(600, 600, false)).await;
        assert_eq!(statuses, vec![Some(StatusCode::OK); 6], "round {round}");
        let left = limiter.check(&Key::Global, 0).await.unwrap().tiers()[0].remaining();
        assert_eq!(left, 4_000 - 6 * 600, "round {round}");
    }
}

/// Every builder option the layer ignores in its combination says so once, at build time,
/// naming itself; a layer whose options all apply says nothing.
#[test]
fn an_option_the_combination_ignores_is_logged_when_the_layer_is_built() {
    use tollgate::{HeaderFormat, HeaderStyle, MissingKey, Priority, StreamMode};
    type Builder = Box<dyn Fn() -> tollgate::RateLimitLayerBuilder>;
    fn requests() -> Policy {
        Policy::single("plain", Quota::per_second(10)).unwrap()
    }
    let cases: Vec<(&str, Builder)> = vec![
        ("max_waiters", Box::new(|| RateLimitLayer::builder(requests()).max_waiters(10))),
        (
            "on_stream",
            Box::new(|| RateLimitLayer::builder(requests()).on_stream(StreamMode::Settle)),
        ),
        (
            "tarpit",
            Box::new(|| {
                RateLimitLayer::builder(requests()).tarpit(Duration::from_secs(1)).dry_run(true)
            }),
        ),
        (
            "shape",
            Box::new(|| {
                RateLimitLayer::builder(requests()).shape(Duration::from_secs(1)).dry_run(true)
            }),
        ),
        (
            "priority",
            Box::new(|| RateLimitLayer::builder(requests()).priority(|_| Priority::Critical)),
        ),
        (
            "settle_cost",
            Box::new(|| RateLimitLayer::builder(bytes_tier(MB, MB)).settle_cost(|_| Some(1))),
        ),
        (
            "header_format",
            Box::new(|| {
                RateLimitLayer::builder(requests())
                    .headers(HeaderStyle::Legacy)
                    .header_format(HeaderFormat::Draft7)
            }),
        ),
        (
            "explain_missing_key",
            Box::new(|| {
                RateLimitLayer::builder(requests())
                    .missing_key(MissingKey::Allow)
                    .explain_missing_key(true)
            }),
        ),
    ];
    for (option, build) in &cases {
        let logs = support::logs::Captured::start(tracing::Level::WARN);
        build().build().unwrap();
        let text = logs.text();
        assert_eq!(text.matches("is ignored").count(), 1, "{option}: {text}");
        assert!(text.contains(&format!("`{option}` is ignored")), "{option}: {text}");
    }
    // The same options where they apply: nothing is logged.
    let logs = support::logs::Captured::start(tracing::Level::WARN);
    RateLimitLayer::builder(bytes_tier(MB, MB))
        .shape(Duration::from_secs(1))
        .max_waiters(10)
        .tarpit(Duration::from_secs(1))
        .on_stream(StreamMode::Settle)
        .headers(HeaderStyle::Both)
        .header_format(HeaderFormat::Draft7)
        .explain_missing_key(true)
        .build()
        .unwrap();
    assert_eq!(logs.text(), "");
}

/// Policing, chunked uploads of 20 MB (no `Content-Length`) against a burst of 1 MB, the tier
/// full again before each: each is stopped mid-way, when the burst runs out. The layer
/// answers 429 while the client is still sending, and reads the rest of the upload off:
/// hyper's HTTP/1 client reads the 429 in at least 99 of 100 tries (without the reading off,
/// most failed with a broken pipe or a reset connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http1_client_reads_the_429_of_an_upload_stopped_mid_way() {
    let clock = tollgate::clock::FakeClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let layer = RateLimitLayer::builder(bytes_tier(MB, MB)).key(GlobalKey).store(store).build();
    let log = Log::default();
    let server = serve(uploads_behind(layer.unwrap(), &log, Instant::now())).await;
    let client: Client<_, Frames> = Client::builder(TokioExecutor::new()).build_http();
    let mut refused = 0;
    for _ in 0..100 {
        clock.advance(Duration::from_secs(2));
        let req = http::Request::post(server.url("/upload"))
            .body(Frames::new(20 * MB, 16 * 1024, false))
            .unwrap();
        if let Ok(res) = client.request(req).await {
            let status = res.status();
            if res.into_body().collect().await.is_ok() && status == StatusCode::TOO_MANY_REQUESTS {
                refused += 1;
            }
        }
    }
    assert!(refused >= 99, "{refused} of 100");
    // Each upload: the burst and less than a frame past it reached the handler.
    let read = read(&log);
    assert!((100 * MB..100 * (MB + 16 * 1024)).contains(&read), "{read}");
}
