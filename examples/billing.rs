//! A SaaS API with limits beyond requests per second, shown with real HTTP traffic: an axum
//! app on an ephemeral loopback port, called by a hyper client, limited per API key with one
//! policy per plan (free or pro, chosen for each request by an authentication middleware).
//!
//! Each plan's policy mixes five kinds of tier, checked all or nothing:
//!
//! | tier           | kind                                 | free          | pro             |
//! |----------------|--------------------------------------|---------------|-----------------|
//! | `per-second`   | GCRA, requests per second (= burst)  | 10            | 100             |
//! | `in-flight`    | concurrency, requests in flight      | 4             | 4               |
//! | `upload-bytes` | request bytes per second             | 1,000,000     | 1,000,000       |
//! | `monthly`      | requests per calendar month, Berlin  | 20            | 100,000         |
//! | `daily-tokens` | reported tokens per calendar day     | 10,000        | 10,000          |
//!
//! The example makes each tier refuse a request, prints what the client saw (the tier named in
//! the 429's `violated-policies`, the `RateLimit` header, `Retry-After`) and exits with status 1
//! if anything differs from what it says.
//!
//! Run: `cargo run --example billing`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use bytes::Bytes;
use http::{HeaderName, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use jiff::{Timestamp, ToSpan, tz::TimeZone};
use tokio::sync::{Notify, watch};
use tollgate::key::HeaderKey;
use tollgate::layer::Unselected;
use tollgate::{Calendar, Concurrency, Policy, Quota, RateLimitLayer, Unit, Usage};

const ZONE: &str = "Europe/Berlin";
/// What a call to `/complete` reports using, as an LLM API would report tokens.
const TOKENS_PER_COMPLETION: u64 = 4_000;

/// The plan of a caller, set by the authentication middleware.
#[derive(Clone, Copy)]
struct Plan(&'static str);

/// A plan's policy: every tier kind the crate has, in one all-or-nothing check.
fn plan(name: &str, per_second: u64, monthly: u64) -> Result<Policy, tollgate::ConfigError> {
    Policy::builder(name)
        .tier("per-second", Quota::per_second(per_second))
        .concurrency("in-flight", Concurrency::new(4))
        .tier("upload-bytes", Quota::per_second(1_000_000).counting(Unit::RequestBytes))
        .calendar("monthly", Calendar::per_month(monthly).in_time_zone(ZONE))
        .calendar(
            "daily-tokens",
            Calendar::per_day(10_000).counting(Unit::Reported).in_time_zone(ZONE),
        )
        .build()
}

/// Looks the API key up (here: a fixed table) and records the caller's plan.
async fn authenticate(mut req: Request, next: Next) -> Response {
    let plan = match req.headers().get("x-api-key").and_then(|v| v.to_str().ok()) {
        Some("key-bob") => Plan("free"),
        Some("key-acme") => Plan("pro"),
        _ => return (StatusCode::UNAUTHORIZED, "unknown API key").into_response(),
    };
    req.extensions_mut().insert(plan);
    next.run(req).await
}

/// The slow `/report` endpoint: it works until the gate opens, counting who is inside.
#[derive(Clone)]
struct Reports {
    inside: Arc<AtomicUsize>,
    entered: Arc<Notify>,
    gate: watch::Receiver<bool>,
}

async fn report(Extension(reports): Extension<Reports>) -> &'static str {
    reports.inside.fetch_add(1, Ordering::SeqCst);
    reports.entered.notify_one();
    let mut gate = reports.gate.clone();
    let _ = gate.wait_for(|open| *open).await;
    reports.inside.fetch_sub(1, Ordering::SeqCst);
    "quarterly report"
}

async fn complete(Extension(usage): Extension<Usage>) -> &'static str {
    usage.report(TOKENS_PER_COMPLETION); // what the model said the call used
    "completion"
}

/// What the client saw of one response.
struct Seen {
    status: StatusCode,
    ratelimit: String,
    retry_after: Option<u64>,
    violated: Vec<String>,
    detail: String,
}

impl Seen {
    /// `r` of the `RateLimit` item of `tier`.
    fn remaining(&self, tier: &str) -> Option<u64> {
        let item = self.ratelimit.split(", ").find(|i| i.starts_with(&format!("\"{tier}\";")))?;
        item.split(';').find_map(|p| p.strip_prefix("r="))?.parse().ok()
    }

    fn print(&self, what: &str) {
        println!("   {what}: {}", self.status);
        if self.status.is_client_error() {
            println!("     violated-policies: {:?}", self.violated);
            println!("     retry-after: {:?} s", self.retry_after);
            println!("     detail: {}", self.detail);
        }
        println!("     ratelimit: {}", self.ratelimit);
    }
}

struct Api {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
}

impl Api {
    async fn call(&self, method: &str, path: &str, api_key: &str, body: Vec<u8>) -> Seen {
        let req = http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("x-api-key", api_key)
            .body(Full::new(Bytes::from(body)))
            .expect("request");
        let res = self.client.request(req).await.expect("the server answers");
        let (head, body) = res.into_parts();
        let body = body.collect().await.expect("body").to_bytes();
        let header = |name: &str| head.headers.get(name).and_then(|v| v.to_str().ok());
        let problem: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        Seen {
            status: head.status,
            ratelimit: header("ratelimit").unwrap_or_default().to_owned(),
            retry_after: header("retry-after").and_then(|v| v.parse().ok()),
            violated: problem["violated-policies"]
                .as_array()
                .map(|a| a.iter().filter_map(|v| Some(v.as_str()?.to_owned())).collect())
                .unwrap_or_default(),
            detail: problem["detail"].as_str().unwrap_or_default().to_owned(),
        }
    }

    async fn get(&self, path: &str, api_key: &str) -> Seen {
        self.call("GET", path, api_key, Vec::new()).await
    }
}

/// The checks the example makes; any failure makes it exit with status 1.
#[derive(Default)]
struct Checks(Vec<String>);

impl Checks {
    fn expect(&mut self, ok: bool, what: &str) {
        println!("   [{}] {what}", if ok { "ok" } else { "FAILED" });
        if !ok {
            self.0.push(what.to_owned());
        }
    }

    fn refused_by(&mut self, seen: &Seen, tier: &str) {
        self.expect(
            seen.status == StatusCode::TOO_MANY_REQUESTS && seen.violated == [tier],
            &format!("429 naming `{tier}` alone"),
        );
        self.expect(seen.retry_after.is_some_and(|s| s >= 1), "Retry-After of at least 1 s");
    }
}

/// The instant `seconds` from now, in the plans' time zone.
fn in_berlin(seconds: u64) -> jiff::ZonedDateTime {
    let tz = TimeZone::get(ZONE).expect("the time zone");
    let seconds = i64::try_from(seconds).expect("seconds");
    (Timestamp::now() + seconds.seconds()).to_zoned_datetime(tz)
}

/// Whether `at` is within a few seconds after the start of the day or month after `now`.
fn is_next_reset(now: &jiff::ZonedDateTime, at: &jiff::ZonedDateTime, monthly: bool) -> bool {
    let next = if monthly {
        now.first_of_month().and_then(|d| d.start_of_day()?.checked_add(1.month()))
    } else {
        now.start_of_day().and_then(|d| d.checked_add(1.day()))
    }
    .expect("next reset");
    let late = at.timestamp().duration_since(next.timestamp());
    !late.is_negative() && late.as_secs() <= 2
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (open_gate, gate) = watch::channel(false);
    let reports = Reports { inside: Arc::default(), entered: Arc::new(Notify::new()), gate };
    let limits = RateLimitLayer::builder(plan("free", 10, 20)?)
        .policy(plan("pro", 100, 100_000)?)
        .key(HeaderKey::new(HeaderName::from_static("x-api-key")))
        .select(|head| head.extensions.get::<Plan>().map(|plan| plan.0))
        .unselected(Unselected::Reject(StatusCode::FORBIDDEN))
        .build()?;
    let app = Router::new()
        .route("/hello", get(|| async { "hello" }))
        .route("/report", get(report))
        .route("/upload", post(|body: Bytes| async move { format!("stored {} bytes", body.len()) }))
        .route("/complete", post(complete))
        .layer(limits)
        .layer(middleware::from_fn(authenticate))
        .layer(Extension(reports.clone()));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    println!("tollgate billing example: serving on http://{addr}");
    let api = Api {
        // HTTP/2 (cleartext, prior knowledge): a refused upload ends its stream while the
        // connection stays up. Over HTTP/1 the server closes the connection rather than read a
        // body it refused, and a client still writing that body may see a broken pipe instead
        // of the 429.
        client: Client::builder(TokioExecutor::new()).http2_only(true).build_http(),
        base: format!("http://{addr}"),
    };
    let mut checks = Checks::default();

    // 1. The per-second burst (free plan: 10/s): requests at once until one is refused.
    println!("\n== per-second: bob (free) sends requests back to back");
    let mut admitted = 0;
    let refused = loop {
        let seen = api.get("/hello", "key-bob").await;
        if seen.status != StatusCode::OK || admitted == 50 {
            break seen;
        }
        admitted += 1;
    };
    println!("   {admitted} admitted, then:");
    refused.print("GET /hello");
    checks.refused_by(&refused, "per-second");
    checks.expect(admitted >= 10, "the burst of 10 admitted first");

    // 2. The monthly quota (free plan: 20 a month in Berlin): paced under 10/s, the 21st
    //    request of the month is refused until the 1st of next month, 00:00 in Berlin.
    println!("\n== monthly: bob goes on at 8 requests/s");
    let refused = loop {
        tokio::time::sleep(std::time::Duration::from_millis(125)).await;
        let seen = api.get("/hello", "key-bob").await;
        if seen.status != StatusCode::OK || admitted == 50 {
            break seen;
        }
        admitted += 1;
    };
    println!("   {admitted} admitted this month in all, then:");
    refused.print("GET /hello");
    checks.refused_by(&refused, "monthly");
    checks.expect(admitted == 20, "exactly 20 admitted in the month (refusals charge nothing)");
    let now = Timestamp::now().to_zoned_datetime(TimeZone::get(ZONE)?);
    let reset = in_berlin(refused.retry_after.unwrap_or(0));
    println!("     the quota resets at {reset}");
    checks.expect(is_next_reset(&now, &reset, true), "Retry-After points at the next month");

    // 3. Concurrency (4 in flight per key): acme (pro) starts 5 slow reports at once.
    println!("\n== in-flight: acme (pro) asks for 5 slow reports at once");
    let api = Arc::new(api);
    let running: Vec<_> = (0..4)
        .map(|_| {
            let api = Arc::clone(&api);
            tokio::spawn(async move { api.get("/report", "key-acme").await })
        })
        .collect();
    while reports.inside.load(Ordering::SeqCst) < 4 {
        reports.entered.notified().await;
    }
    println!("   4 reports are being computed");
    let fifth = api.get("/report", "key-acme").await;
    fifth.print("the 5th GET /report");
    checks.refused_by(&fifth, "in-flight");
    open_gate.send(true)?;
    let mut done = 0;
    for report in running {
        done += usize::from(report.await?.status == StatusCode::OK);
    }
    println!("   the 4 reports finished ({done} with 200); their slots are back:");
    let again = api.get("/report", "key-acme").await;
    again.print("GET /report");
    checks.expect(done == 4 && again.status == StatusCode::OK, "the slots came back");
    checks.expect(again.remaining("in-flight") == Some(3), "3 of 4 slots free while it runs");

    // 4. Upload bytes (1 MB/s): 600 kB passes, 1 MB right after it does not, 2 MB never
    //    will (413 Content Too Large); neither refusal charges the request tiers.
    println!("\n== upload-bytes: acme uploads 600 kB, 1 MB, then 2 MB");
    let before = api.get("/hello", "key-acme").await;
    let first = api.call("POST", "/upload", "key-acme", vec![b'x'; 600_000]).await;
    first.print("POST /upload (600 kB)");
    // 1 MB needs 600 ms of refill after the first upload: refused when sent at once.
    let second = api.call("POST", "/upload", "key-acme", vec![b'x'; 1_000_000]).await;
    second.print("POST /upload (1 MB)");
    checks.refused_by(&second, "upload-bytes");
    let huge = api.call("POST", "/upload", "key-acme", vec![b'x'; 2_000_000]).await;
    huge.print("POST /upload (2 MB)");
    checks.expect(
        huge.status == StatusCode::PAYLOAD_TOO_LARGE
            && huge.violated == ["upload-bytes"]
            && huge.retry_after.is_none(),
        "2 MB refused for good with 413 (no Retry-After: it can never fit)",
    );
    let after = api.get("/hello", "key-acme").await;
    let monthly = (before.remaining("monthly"), after.remaining("monthly"));
    println!("   monthly remaining before and after the uploads: {monthly:?}");
    checks.expect(
        matches!(monthly, (Some(b), Some(a)) if b - a == 2),
        "the monthly quota counts only the admitted upload and the GET",
    );

    // 5. Reported tokens (10,000 a day): each completion reports 4,000 tokens when it ends.
    //    A call needs one token free to start; the third runs into debt; the fourth waits for
    //    midnight in Berlin.
    println!("\n== daily-tokens: acme calls /complete, {TOKENS_PER_COMPLETION} tokens each");
    let mut statuses = Vec::new();
    let refused = loop {
        let seen = api.call("POST", "/complete", "key-acme", Vec::new()).await;
        if seen.status != StatusCode::OK || statuses.len() == 10 {
            break seen;
        }
        println!(
            "   POST /complete: 200, daily-tokens left when it started: {:?}",
            seen.remaining("daily-tokens")
        );
        statuses.push(seen.status);
    };
    refused.print("POST /complete");
    checks.refused_by(&refused, "daily-tokens");
    checks.expect(statuses.len() == 3, "3 completions (12,000 tokens) before the refusal");
    let now = Timestamp::now().to_zoned_datetime(TimeZone::get(ZONE)?);
    let reset = in_berlin(refused.retry_after.unwrap_or(0));
    println!("     the tokens come back at {reset}");
    checks.expect(is_next_reset(&now, &reset, false), "Retry-After points at midnight");

    if checks.0.is_empty() {
        println!("\nevery tier refused a request as shown");
        Ok(())
    } else {
        eprintln!("\nnot as described: {:?}", checks.0);
        std::process::exit(1);
    }
}
