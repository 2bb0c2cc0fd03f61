//! Priority reserves under shaping ([`Reserve`]): standard requests waiting for their slots
//! never take the critical reserve. Over real HTTP (the layer shaping, the class from a
//! header) on the memory store and on a real redis-server: after standard traffic has booked
//! the schedule seconds ahead, critical requests are still served at once, up to the reserve.
//! And over random traces of classes and shaping, on both stores: what leaves (each request
//! at the instant its wait ends) never exceeds the tier's limit, and a critical request is
//! admitted at once whenever the reserve has had time to come back.

use crate::support;

use std::time::Duration;

use axum::Router;
use axum::routing::get;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use tollgate::clock::{Clock, FakeClock};
use tollgate::key::{GlobalKey, Key};
use tollgate::store::{Check, Store};
use tollgate::{Policy, Priority, Quota, RateLimitLayer, Reserve};

/// 10 a second (T = 100 ms, burst 10), 3 of them kept for critical requests.
fn policy(name: &str) -> Policy {
    Policy::builder(name)
        .tier("second", Quota::per_second(10))
        .reserve("second", Reserve::new().critical(3))
        .build()
        .unwrap()
}

/// One request to `url` with class `class`: its status, `RateLimit` header, and how long it
/// took on tokio's clock.
async fn ask(client: &support::HttpClient, url: &str, class: &str) -> (u16, String, Duration) {
    let start = tokio::time::Instant::now();
    let r = support::get(client, url, &[("x-priority", class)]).await;
    let header = r.header("ratelimit").unwrap_or_default().to_owned();
    (r.status.as_u16(), header, start.elapsed())
}

/// The layer of `policy` on `store`, shaping within `max_delay`, the class from a header.
fn app<St: Store>(policy: Policy, store: St, max_delay: Duration) -> Router {
    let layer = RateLimitLayer::builder(policy)
        .key(GlobalKey)
        .store(store)
        .priority_header(http::HeaderName::from_static("x-priority"))
        .shape(max_delay)
        .build()
        .unwrap();
    Router::new().route("/", get(|| async { "ok" })).layer(layer)
}

/// 7 standard requests to `url`, one after another, each admitted and told what is left of
/// the standard share (6 down to 0); then 20 more sent at once. How long each of the 7 took,
/// and the 20 on their way.
async fn fill_the_standard_share_then_book_twenty(
    client: &support::HttpClient,
    url: &str,
) -> (Vec<Duration>, Vec<tokio::task::JoinHandle<(u16, String, Duration)>>) {
    let mut took = Vec::new();
    for left in (0..7).rev() {
        let (status, header, t) = ask(client, url, "standard").await;
        assert_eq!(status, 200);
        assert!(header.contains(&format!("\"second\";r={left};")), "{header}");
        took.push(t);
    }
    let waiting = (0..20)
        .map(|_| {
            let (client, url) = (client.clone(), url.to_owned());
            tokio::spawn(async move { ask(&client, &url, "standard").await })
        })
        .collect();
    (took, waiting)
}

/// On the memory store, its clock standing still, and tokio's clock paused (it moves only for
/// the layer's waits): 7 standard requests fill the standard share at once; 20 more book the
/// next 2 s and wait 100 ms to 2 s. The store's clock has not moved: the 20 are still booked
/// ahead. 3 critical requests are served at once, each told what is left of the reserve; a 4th
/// waits behind the whole schedule, and so does the next standard request.
#[tokio::test(start_paused = true)]
async fn over_http_shaped_standard_traffic_never_takes_the_critical_reserve_in_memory() {
    let store = support::memory_store(&support::clock_at_hour());
    let server = support::serve(app(policy("reserve-shape"), store, Duration::from_secs(3))).await;
    let client = support::client();
    let url = server.url("/");
    let (took, waiting) = fill_the_standard_share_then_book_twenty(&client, &url).await;
    assert_eq!(took, [Duration::ZERO; 7]);
    let mut waits = Vec::new();
    for w in waiting {
        let (status, _, took) = w.await.unwrap();
        assert_eq!(status, 200);
        waits.push(took);
    }
    waits.sort();
    assert_eq!((waits[0], waits[19]), (Duration::from_millis(100), Duration::from_secs(2)));
    for left in (0..3).rev() {
        let (status, header, took) = ask(&client, &url, "critical").await;
        assert_eq!((status, took), (200, Duration::ZERO), "{header}");
        assert!(header.contains(&format!("\"second\";r={left};")), "{header}");
    }
    // The reserve used, the next waits behind the 30 units booked: 31 - 10 intervals.
    let (status, _, took) = ask(&client, &url, "critical").await;
    assert_eq!((status, took), (200, Duration::from_millis(2_100)));
    // A standard request waits behind them too, at its own line: 32 - 7 intervals.
    let (status, _, took) = ask(&client, &url, "standard").await;
    assert_eq!((status, took), (200, Duration::from_millis(2_500)));
}

/// On `store` (its clock standing still) over tokio's real clock, at 1 a second: 7 standard
/// requests fill the standard share at once, 20 more book the next 20 seconds and wait.
/// While they wait, 3 critical requests are served at once (within a second; behind the
/// schedule they would wait 18 s), each told what is left of the reserve.
async fn critical_requests_pass_standard_requests_booked_ahead<St: Store + Clone>(store: St) {
    let policy = Policy::builder("reserve-shape-slow")
        .tier("second", Quota::per_second(1).with_burst(10))
        .reserve("second", Reserve::new().critical(3))
        .build()
        .unwrap();
    let bound = store.bind(&policy).unwrap();
    let server = support::serve(app(policy, store.clone(), Duration::from_secs(30))).await;
    let client = support::client();
    let url = server.url("/");
    let (_, waiting) = fill_the_standard_share_then_book_twenty(&client, &url).await;
    // Booked once the key is full again 27 s after the (standing) clock's now.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let query = store.check(&bound, Check::new(&Key::Global, 0)).await.unwrap().decision;
        if query.tiers()[0].reset_after() == Duration::from_secs(27) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "not booked: {query:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for left in (0..3).rev() {
        let critical = ask(&client, &url, "critical");
        let answered = tokio::time::timeout(Duration::from_millis(900), critical).await;
        let (status, header, _) = answered.expect("a critical request served at once");
        assert_eq!(status, 200);
        assert!(header.contains(&format!("\"second\";r={left};")), "{header}");
    }
    assert!(waiting.iter().all(|w| !w.is_finished()), "the standard requests still wait");
    for w in waiting {
        w.abort();
    }
}

#[tokio::test]
async fn critical_requests_pass_standard_requests_booked_ahead_in_memory() {
    let store = support::memory_store(&support::clock_at_hour());
    critical_requests_pass_standard_requests_booked_ahead(store).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn critical_requests_pass_standard_requests_booked_ahead_on_redis() {
    let Some(server) = support::redis::Server::start("redis-server") else { return };
    let store = support::stores::redis::frozen_on(&server, "reserve-shape:");
    critical_requests_pass_standard_requests_booked_ahead(store).await;
}

/// A trace: per step, the class (0 critical), the cost, whether it is shaped, and how far
/// the clock moves after it (ms).
type Trace = Vec<(u8, u64, bool, u64)>;

fn traces() -> impl Strategy<Value = Trace> {
    let step = (
        prop_oneof![3 => Just(0u8), 5 => Just(1u8), 2 => Just(2u8)],
        prop_oneof![6 => Just(1u64), 1 => 2u64..=3],
        proptest::bool::weighted(0.8),
        prop_oneof![4 => Just(0u64), 3 => 0u64..=60, 1 => 0u64..=1_500],
    );
    proptest::collection::vec(step, 1..=120)
}

/// Replays `trace` on `store` (its clock `clock`): 10 a second, burst 10, reserves 3
/// critical and 2 standard, shaping within 2 s. Returns the checks of the promise made.
async fn replay<St: Store>(store: St, clock: &FakeClock, trace: &Trace) -> Result<u64, String> {
    const T: u64 = 100_000_000;
    const TAU: u64 = 10 * T;
    const BUDGET: Duration = Duration::from_secs(2);
    let policy = Policy::builder("trace")
        .tier("second", Quota::per_second(10))
        .reserve("second", Reserve::new().critical(3).standard(2))
        .build()
        .unwrap();
    let bound = store.bind(&policy).map_err(|e| e.to_string())?;
    let key = Key::text("k");
    // (departure, cost) of every admitted request.
    let mut left: Vec<(u64, u64)> = Vec::new();
    // When the last critical request left.
    let mut last_critical = None::<u64>;
    let mut promised = 0;
    for (i, &(class, cost, shaped, advance)) in trace.iter().enumerate() {
        let now = clock.now();
        let class =
            [Priority::Critical, Priority::Standard, Priority::Sheddable][usize::from(class)];
        let mut check = Check::new(&key, cost).with_priority(class);
        if shaped {
            check = check.shape(BUDGET);
        }
        let d = store.check(&bound, check).await.map_err(|e| e.to_string())?.decision;
        // The reserve comes back once what was booked when a critical request last took it
        // has left (the budget) and that request's own units have (τ).
        let rested = last_critical.is_none_or(|at| now >= at + duration_ns(BUDGET) + TAU);
        if class == Priority::Critical && cost <= 3 && rested {
            promised += 1;
            if !d.is_allowed() || d.delay() != Duration::ZERO {
                return Err(format!("step {i}: a critical request with its reserve unused: {d:?}"));
            }
        }
        if d.is_allowed() {
            let at = now + duration_ns(d.delay());
            left.push((at, cost));
            if class == Priority::Critical {
                last_critical = Some(last_critical.map_or(at, |l| l.max(at)));
            }
        }
        clock.advance(Duration::from_millis(advance));
    }
    // What leaves conforms to the tier's limit: GCRA over the departures, in their order.
    left.sort_by_key(|(at, _)| *at);
    let mut tat = 0u64;
    for (at, cost) in left {
        tat = tat.max(at) + cost * T;
        if tat - TAU > at {
            return Err(format!("more left at {at} than the limit allows (TAT {tat})"));
        }
    }
    Ok(promised)
}

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap()
}

/// Runs `cases` traces from a fixed seed through the stores `make` builds on a clock.
fn run<St: Store>(cases: u32, make: impl Fn(&FakeClock, u64) -> St) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[34; 32]);
    let config = Config { cases, failure_persistence: None, ..Config::default() };
    let mut runner = TestRunner::new_with_rng(config, rng);
    let (case, promised) = (std::cell::Cell::new(0u64), std::cell::Cell::new(0u64));
    let result = runner.run(&traces(), |trace| {
        let clock = support::clock_at_hour();
        let store = make(&clock, case.replace(case.get() + 1));
        let p = rt.block_on(replay(store, &clock, &trace)).map_err(TestCaseError::fail)?;
        promised.set(promised.get() + p);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    assert!(promised.get() > u64::from(cases), "the promise is exercised: {}", promised.get());
}

#[test]
fn what_leaves_stays_within_the_limit_and_the_reserve_comes_back_in_memory() {
    run(512, |clock, _| support::memory_store(clock));
}

#[cfg(feature = "redis")]
#[test]
fn what_leaves_stays_within_the_limit_and_the_reserve_comes_back_on_redis() {
    use support::stores::redis::on_clock;
    use tollgate::store::RedisStore;
    let Some(server) = support::redis::Server::start("redis-server") else { return };
    let url = server.url();
    run(96, |clock, n| on_clock(RedisStore::builder(&url), clock, &format!("reserve-trace{n}:")));
}
