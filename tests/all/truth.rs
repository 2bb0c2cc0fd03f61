//! The rate-limit headers tell the truth once the decision is final: after a refund by status
//! and after a cost settled from the response head, over random policies (every algorithm,
//! one to three tiers) and random traffic on a clock the test moves. With one client and no
//! one else spending the key, what a response says is exactly what a query says right after,
//! and a client that sends only what the last response said fits is never refused.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Empty;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tollgate::clock::FakeClock;
use tollgate::key::{GlobalKey, Key};
use tollgate::store::MemoryStore;
use tollgate::{Algorithm, Policy, Quota, RateLimitLayer, RequestBody};
use tower::{Layer, ServiceExt, service_fn};

/// What the handler answers: kept, refunded (a 503, `refund_if`), or settled at a cost read
/// from the response head.
#[derive(Debug, Clone, Copy)]
enum Answer {
    Kept,
    Refunded,
    Settled(u64),
}

#[derive(Debug, Clone)]
struct Case {
    algorithm: Algorithm,
    /// `(count, period in ms)` per tier.
    tiers: Vec<(u64, u64)>,
    /// `(ms to advance, cost, answer)` per request.
    steps: Vec<(u64, u64, Answer)>,
}

fn case() -> impl Strategy<Value = Case> {
    let answer = prop_oneof![
        Just(Answer::Kept),
        Just(Answer::Refunded),
        (0u64..=4).prop_map(Answer::Settled),
    ];
    (
        prop::sample::select(Algorithm::ALL.to_vec()),
        prop::collection::vec((2u64..=12, 1_000u64..=60_000), 1..=3),
        prop::collection::vec((0u64..=3_000, 1u64..=3, answer), 1..=25),
    )
        .prop_map(|(algorithm, tiers, steps)| Case { algorithm, tiers, steps })
}

/// The `r` and `t` of each item of a `RateLimit` field (`"name";r=R;t=T, ...`).
fn items(value: &str) -> Vec<(u64, u64)> {
    value
        .split(", ")
        .map(|item| {
            let mut r = None;
            let mut t = None;
            for param in item.split(';').skip(1) {
                match param.split_once('=') {
                    Some(("r", v)) => r = v.parse().ok(),
                    Some(("t", v)) => t = v.parse().ok(),
                    _ => {}
                }
            }
            (r.expect("r"), t.expect("t"))
        })
        .collect()
}

/// Runs `case`; `settles`: whether the layer settles costs from the response head (else it
/// only refunds, on the path decided without waiting).
fn run(case: &Case, settles: bool) -> Result<(), TestCaseError> {
    let mut builder = Policy::builder("truth").algorithm(case.algorithm);
    for (i, (count, period)) in case.tiers.iter().enumerate() {
        builder = builder.tier(format!("t{i}"), Quota::new(*count, Duration::from_millis(*period)));
    }
    let Ok(policy) = builder.build() else { return Ok(()) };
    let clock = FakeClock::new();
    let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let builder = RateLimitLayer::builder(policy)
        .key(GlobalKey)
        .store(store)
        .cost_fn(|head| head.headers["x-cost"].to_str().unwrap().parse().unwrap())
        .refund_if(|status| status == StatusCode::SERVICE_UNAVAILABLE);
    let layer = match settles {
        true => builder.settle_cost(|head| head.headers.get("x-used")?.to_str().ok()?.parse().ok()),
        false => builder,
    };
    let layer = layer.build().unwrap();
    let limiter = layer.limiter().clone();
    let svc = layer.layer(service_fn(|req: Request<RequestBody<Empty<Bytes>>>| async move {
        let mut res = Response::new(Empty::<Bytes>::new());
        match req.headers().get("x-answer").map(|v| v.to_str().unwrap()) {
            Some("refund") => *res.status_mut() = StatusCode::SERVICE_UNAVAILABLE,
            Some(used) if used != "keep" => {
                res.headers_mut().insert("x-used", used.parse().unwrap());
            }
            _ => {}
        }
        Ok::<_, Infallible>(res)
    }));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    // What the last response said each tier had left.
    let mut said: Option<Vec<u64>> = None;
    for (i, (advance, cost, answer)) in case.steps.iter().enumerate() {
        clock.advance(Duration::from_millis(*advance));
        let answer_header = match answer {
            Answer::Kept => "keep".to_owned(),
            Answer::Refunded => "refund".to_owned(),
            Answer::Settled(used) => used.to_string(),
        };
        let req = Request::get("/")
            .header("x-cost", cost.to_string())
            .header("x-answer", answer_header)
            .body(Empty::new())
            .unwrap();
        let res = rt.block_on(svc.clone().oneshot(req)).unwrap();
        let fits_said = said.as_ref().is_some_and(|r| r.iter().all(|r| r >= cost));
        if res.status() == StatusCode::TOO_MANY_REQUESTS {
            // A client pacing on the headers is never surprised.
            prop_assert!(!fits_said, "step {i}: refused although the last response said {said:?}");
            let state = items(res.headers()["ratelimit"].to_str().unwrap());
            prop_assert!(state.iter().all(|(_, t)| *t >= 1) || state.iter().any(|(r, _)| r < cost));
            said = Some(state.iter().map(|(r, _)| *r).collect());
            continue;
        }
        let state = items(res.headers()["ratelimit"].to_str().unwrap());
        // The truth: a query right after, at the same instant, says the same.
        let now = rt.block_on(limiter.check(&Key::Global, 0)).unwrap();
        let truth: Vec<(u64, u64)> = now
            .tiers()
            .iter()
            .map(|t| (t.remaining(), t.reset_after().as_nanos().div_ceil(1_000_000_000) as u64))
            .collect();
        prop_assert_eq!(&state, &truth, "step {}: {:?} answered {:?}", i, cost, answer);
        said = Some(state.iter().map(|(r, _)| *r).collect());
    }
    Ok(())
}

#[test]
fn headers_say_what_is_left_after_refunds_and_settlements() {
    let mut runner = TestRunner::new(Config { cases: 128, ..Config::default() });
    runner.run(&case(), |case| run(&case, true)).unwrap();
}

#[test]
fn headers_say_what_is_left_after_refunds_decided_at_once() {
    let mut runner = TestRunner::new(Config { cases: 128, ..Config::default() });
    runner.run(&case(), |case| run(&case, false)).unwrap();
}
