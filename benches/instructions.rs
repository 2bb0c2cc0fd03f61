//! One process per measurement, run under valgrind's callgrind by `benches/instructions.sh`:
//! requests through an axum `Router` with one route, driven as a `tower::Service` on a
//! current-thread runtime, behind tollgate's layer, tower_governor's, or nothing (`bare`).
//!
//! ```text
//! instructions <stack> <case> <keys> <requests>
//!   stack:    bare | tollgate | tollgate_lean | tower_governor | noop_pass | noop_wrap
//!   case:     allowed | allowed_no_headers | limited
//!   keys:     distinct client IPs, taken in turn (each seen once before counting starts)
//!   requests: requests sent after that warm-up
//! ```
//!
//! `tollgate_lean` is tollgate's layer made lean (`RateLimitLayer::lean`: bodies not wrapped).
//! `noop_pass` is a tower layer that hands the request on and the response back unchanged;
//! `noop_wrap` one that wraps both bodies in a newtype body, as a layer that observes bodies
//! must: the difference is what axum's re-boxing of a foreign body type costs per request.
//!
//! Callgrind counts inside [`measured`] only, so start-up, the warm-up and one-time set-up
//! (the clock's calibration, which runs for a stretch of wall time) stay out of the count. The
//! script runs each stack at two request counts and divides the difference of the instruction
//! totals by the difference of the counts, so that what the first requests pay once cancels
//! out; the bare router's count per request is subtracted. The
//! memory store's sweeper (timer-driven work, whose cost grows with wall time, which valgrind
//! stretches) is set to run once an hour, so it never runs during a measurement.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::routing::get;
use http::{Request, StatusCode};
use tollgate::store::MemoryStore;
use tollgate::{HeaderStyle, Policy, Quota, RateLimitLayer};
use tower::ServiceExt;
use tower::{Layer, Service};
use tower_governor::GovernorLayer;
use tower_governor::governor::GovernorConfigBuilder;

/// A no-op layer: `WRAP` decides whether both bodies travel in [`Wrapped`].
#[derive(Clone, Copy)]
struct Noop<const WRAP: bool>;

impl<S, const WRAP: bool> Layer<S> for Noop<WRAP> {
    type Service = NoopService<S, WRAP>;
    fn layer(&self, inner: S) -> Self::Service {
        NoopService(inner)
    }
}

#[derive(Clone)]
struct NoopService<S, const WRAP: bool>(S);

// Both variants box their future alike, so that the bodies are the one difference.
impl<S, B, ResB> Service<Request<B>> for NoopService<S, false>
where
    S: Service<Request<B>, Response = http::Response<ResB>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<ResB>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }
    fn call(&mut self, req: Request<B>) -> Self::Future {
        let fut = self.0.call(req);
        Box::pin(async move { Ok(fut.await?.map(std::convert::identity)) })
    }
}

impl<S, B, ResB> Service<Request<B>> for NoopService<S, true>
where
    S: Service<Request<Wrapped<B>>, Response = http::Response<ResB>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Wrapped<ResB>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }
    fn call(&mut self, req: Request<B>) -> Self::Future {
        let fut = self.0.call(req.map(Wrapped));
        Box::pin(async move { Ok(fut.await?.map(Wrapped)) })
    }
}

/// A body newtype that only forwards, standing for any body type of a layer's own.
struct Wrapped<B>(B);

impl<B: http_body::Body + Unpin> http_body::Body for Wrapped<B> {
    type Data = B::Data;
    type Error = B::Error;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
        Pin::new(&mut self.0).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }
    fn size_hint(&self) -> http_body::SizeHint {
        self.0.size_hint()
    }
}

fn request(i: u32) -> Request<Body> {
    let mut req = Request::get("/").body(Body::empty()).unwrap();
    let ip = IpAddr::V4(Ipv4Addr::from(0x0a00_0000 + i));
    req.extensions_mut().insert(ConnectInfo(SocketAddr::new(ip, 4711)));
    req
}

fn app(stack: &str, case: &str) -> Router {
    let route = Router::new().route("/", get(|| async { "ok" }));
    let allowed = case != "limited";
    let headers = case != "allowed_no_headers";
    let app = match stack {
        "bare" => route,
        "tollgate" | "tollgate_lean" => {
            let quota = if allowed { Quota::per_second(1_000_000_000) } else { Quota::per_hour(1) };
            let store =
                MemoryStore::builder().sweep_interval(Duration::from_secs(3600)).build().unwrap();
            let layer = RateLimitLayer::builder(Policy::single("bench", quota).unwrap())
                .headers(if headers { HeaderStyle::Ietf } else { HeaderStyle::None })
                .store(store)
                .build()
                .unwrap();
            if stack == "tollgate_lean" {
                route.layer(layer.lean().unwrap())
            } else {
                route.layer(layer)
            }
        }
        "noop_pass" => route.layer(Noop::<false>),
        "noop_wrap" => route.layer(Noop::<true>),
        "tower_governor" => {
            let mut config = GovernorConfigBuilder::default();
            if allowed {
                config.per_nanosecond(1).burst_size(u32::MAX);
            } else {
                config.per_second(3600).burst_size(1);
            }
            if headers {
                route.layer(GovernorLayer::new(Arc::new(config.use_headers().finish().unwrap())))
            } else {
                route.layer(GovernorLayer::new(Arc::new(config.finish().unwrap())))
            }
        }
        other => panic!("unknown stack {other}"),
    };
    // As `axum::serve` runs a router: handlers turned into routes once, not per request.
    app.with_state::<()>(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let [stack, case, keys, requests] = &args[..] else {
        eprintln!("usage: instructions <stack> <case> <keys> <requests>");
        std::process::exit(2);
    };
    let keys: u32 = keys.parse().expect("keys");
    let requests: u32 = requests.parse().expect("requests");
    let app = app(stack, case);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let expect = if case == "limited" && stack != "bare" {
        StatusCode::TOO_MANY_REQUESTS
    } else {
        StatusCode::OK
    };
    // Every key seen once (and, when limited, its one unit spent); lazily initialised state
    // (the store's clock calibration, the runtime's) is set up here, outside the count.
    measured_not(&rt, &app, keys);
    measured(&rt, &app, keys, requests, expect);
}

/// The warm-up: not counted.
#[inline(never)]
fn measured_not(rt: &tokio::runtime::Runtime, app: &Router, keys: u32) {
    rt.block_on(async {
        for i in 0..keys {
            let res = app.clone().oneshot(request(i)).await.unwrap();
            assert_eq!(res.status(), StatusCode::OK);
        }
    });
}

/// What the script counts: callgrind collects inside this function only
/// (`--collect-atstart=no --toggle-collect=instructions::measured`).
#[inline(never)]
fn measured(
    rt: &tokio::runtime::Runtime,
    app: &Router,
    keys: u32,
    requests: u32,
    expect: StatusCode,
) {
    rt.block_on(async {
        for i in 0..requests {
            let res = app.clone().oneshot(request(i % keys)).await.unwrap();
            assert_eq!(res.status(), expect);
            std::hint::black_box(res);
        }
    });
}
