//! Tiers beyond request rates, on the in-memory store: concurrency slots (exact under
//! concurrency, released and waited for), costs per tier (bytes, tokens; all or nothing), and
//! calendar windows across daylight-saving changes and month ends, on injected clocks.

use std::time::Duration;

use crate::support::stores::most_in_flight;
use proptest::prelude::*;
use tollgate::clock::{FakeClock, TokioClock};
use tollgate::key::Key;
use tollgate::store::{Check, MemoryStore};
use tollgate::{
    Algorithm, Calendar, Concurrency, Decision, Limiter, Outcome, Policy, Quota, Rejection,
    TierKind, Unit,
};

fn limiter_on(policy: Policy, clock: FakeClock) -> Limiter {
    let store = MemoryStore::builder().clock(clock).build().unwrap();
    Limiter::with_store(policy, store).unwrap()
}

/// A limiter of policy `policy` with one calendar tier, `tier`, on `clock`.
fn calendar_limiter(policy: &str, tier: &str, calendar: Calendar, clock: &FakeClock) -> Limiter {
    limiter_on(Policy::builder(policy).calendar(tier, calendar).build().unwrap(), clock.clone())
}

/// An LLM API's policy `llm`: 100 requests, 10,000 response bytes (tier `bytes_tier`) and
/// 5,000 reported tokens an hour.
pub(crate) fn llm_policy(bytes_tier: &str) -> Policy {
    Policy::builder("llm")
        .tier("requests", Quota::per_hour(100))
        .tier(bytes_tier, Quota::per_hour(10_000).counting(Unit::ResponseBytes))
        .tier("tokens", Quota::per_hour(5_000).counting(Unit::Reported))
        .build()
        .unwrap()
}

/// Nanoseconds since the epoch of an RFC 3339 instant.
fn at(s: &str) -> u64 {
    let ts: jiff::Timestamp = s.parse().unwrap();
    u64::try_from(ts.as_nanosecond()).unwrap()
}

fn secs(d: Option<Duration>) -> Option<u64> {
    d.map(|d| d.as_secs())
}

// ---------------------------------------------------------------------------------------------
// Concurrency.

/// 1,000 tasks on two worker threads each take a slot (waiting for one up to a minute), count
/// themselves in while they hold it, and release it: never more than 4 inside, and 4 at some
/// moment; every task gets its turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_holders_never_exceed_four_in_flight() {
    let policy =
        Policy::builder("slow").concurrency("in-flight", Concurrency::new(4)).build().unwrap();
    let limiter = Limiter::new(policy);
    let most =
        most_in_flight(&limiter, &Key::text("api-key"), 1000, 4, Duration::from_secs(60)).await;
    assert_eq!(most, 4);
    let d = limiter.check(&Key::text("api-key"), 0).await.unwrap();
    assert_eq!(d.tiers()[0].remaining(), 4, "every slot came back");
}

/// Policing: of 1,000 holders on four threads, exactly 4 get a slot while nobody releases.
#[test]
fn exactly_four_of_a_thousand_threads_get_a_slot() {
    let policy = Policy::builder("p").concurrency("c", Concurrency::new(4)).build().unwrap();
    let store = MemoryStore::new();
    let bound = store.bind_policy(&policy);
    let held = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..250 {
                    let v = store.check_now(&bound, Check::new(&Key::Global, 1));
                    if let Some(ticket) = v.ticket {
                        held.lock().unwrap().push(ticket);
                    }
                }
            });
        }
    });
    assert_eq!(held.lock().unwrap().len(), 4);
    drop(held.lock().unwrap().pop());
    assert!(store.check_now(&bound, Check::new(&Key::Global, 1)).decision.is_allowed());
}

/// Calendar and byte tiers under concurrency: of 1,000 requests from four threads, exactly the
/// quota is admitted (the concurrency tier beside them never fills).
#[test]
fn calendar_and_byte_tiers_admit_exactly_their_quota_from_four_threads() {
    let slots = || Concurrency::new(10_000);
    for policy in [
        Policy::builder("calendar")
            .calendar("year", Calendar::per_year(100))
            .concurrency("slots", slots())
            .build()
            .unwrap(),
        Policy::builder("bytes")
            .tier("bytes", Quota::per_day(100_000).counting(Unit::RequestBytes))
            .concurrency("slots", slots())
            .build()
            .unwrap(),
    ] {
        let clock = FakeClock::new();
        clock.set(at("2025-06-02T10:00:00Z"));
        let store = MemoryStore::builder().clock(clock).build().unwrap();
        let bound = store.bind_policy(&policy);
        let costs = policy.costs(1, Some(1_000));
        let held = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..250 {
                        let check = Check::new(&Key::Global, 1).with_costs(&costs);
                        let v = store.check_now(&bound, check);
                        if v.decision.is_allowed() {
                            held.lock().unwrap().push(v.ticket.expect("a slot was taken"));
                        }
                    }
                });
            }
        });
        assert_eq!(held.lock().unwrap().len(), 100, "{}", policy.name());
    }
}

#[tokio::test]
async fn a_full_tier_refuses_with_the_typical_hold_and_learns_it_from_releases() {
    let clock = FakeClock::new();
    let policy = Policy::builder("p")
        .concurrency("c", Concurrency::new(1).with_typical_hold(Duration::from_millis(750)))
        .tier("rate", Quota::per_hour(100))
        .build()
        .unwrap();
    let limiter = limiter_on(policy.clone(), clock.clone());
    let key = Key::Global;
    let first = limiter.reserve(&key, 1).await.unwrap();
    assert!(first.decision().is_allowed());
    assert_eq!(first.decision().tiers()[0].remaining(), 0);
    assert_eq!(first.decision().tiers()[0].reset_after(), Duration::from_millis(750));
    let refused = limiter.reserve(&key, 1).await.unwrap();
    let d = refused.decision();
    assert_eq!(d.outcome(), Outcome::Limited);
    assert_eq!(d.retry_after(), Some(Duration::from_millis(750)));
    assert_eq!(d.violated_names(&policy).collect::<Vec<_>>(), ["c"]);
    assert_eq!(d.tiers()[0].retry_after(), Some(Duration::from_millis(750)));
    assert_eq!(d.tiers()[1].remaining(), 99, "the refusal charged no tier");
    // Held 200 ms: the first observation is the typical hold.
    clock.advance(Duration::from_millis(200));
    first.release().await.unwrap();
    let second = limiter.reserve(&key, 1).await.unwrap();
    assert!(second.decision().is_allowed());
    assert_eq!(second.decision().tiers()[0].reset_after(), Duration::from_millis(200));
    // Held 1 s: the average moves an eighth of the way, to 300 ms.
    clock.advance(Duration::from_secs(1));
    drop(second);
    let third = limiter.reserve(&key, 1).await.unwrap();
    let d = limiter.check(&key, 1).await.unwrap();
    assert_eq!(d.retry_after(), Some(Duration::from_millis(300)));
    drop(third);
}

#[tokio::test(start_paused = true)]
async fn a_waiter_gets_the_slot_the_moment_it_is_released_or_gives_up_at_its_deadline() {
    let policy = Policy::builder("p").concurrency("c", Concurrency::new(1)).build().unwrap();
    let store = MemoryStore::builder().clock(TokioClock::new()).build().unwrap();
    let limiter = Limiter::with_store(policy, store).unwrap();
    let holder = limiter.reserve(&Key::Global, 1).await.unwrap();
    // Nobody releases within 2 s: refused at the deadline, with the typical hold.
    let start = tokio::time::Instant::now();
    match limiter.until_ready(&Key::Global, 1, Duration::from_secs(2)).await {
        Err(Rejection::Limited(limited)) => {
            assert_eq!(limited.retry_after(), Some(Duration::from_secs(1)));
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    // Released after 700 ms: the waiter is admitted then.
    let waiter = {
        let limiter = limiter.clone();
        tokio::spawn(async move {
            let r = limiter.acquire(&Key::Global, 1, Duration::from_secs(5)).await.unwrap();
            (tokio::time::Instant::now(), r.holds_slots())
        })
    };
    tokio::time::sleep(Duration::from_millis(700)).await;
    let released = tokio::time::Instant::now();
    drop(holder);
    assert_eq!(waiter.await.unwrap(), (released, true));
}

// ---------------------------------------------------------------------------------------------
// Costs per tier.

fn upload_policy() -> Policy {
    Policy::builder("upload")
        .tier("requests", Quota::per_second(5))
        .tier("bytes", Quota::per_second(1_000_000).counting(Unit::RequestBytes))
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_request_that_fits_the_request_tier_but_not_the_byte_tier_charges_neither() {
    let limiter = limiter_on(upload_policy(), FakeClock::new());
    let policy = limiter.policy().clone();
    let key = Key::text("client");
    let check = |bytes| {
        let costs = policy.costs(1, Some(bytes));
        let limiter = limiter.clone();
        let key = key.clone();
        async move { limiter.reserve_with(Check::new(&key, 1).with_costs(&costs)).await.unwrap() }
    };
    let r = check(900_000).await;
    assert!(r.decision().is_allowed());
    assert_eq!(
        (r.decision().tiers()[0].remaining(), r.decision().tiers()[1].remaining()),
        (4, 100_000)
    );
    drop(r);
    let refused = check(200_000).await;
    let d = refused.decision();
    assert_eq!(d.outcome(), Outcome::Limited);
    assert_eq!(d.violated_names(&policy).collect::<Vec<_>>(), ["bytes"]);
    // 100,000 bytes more come back in 100 ms.
    assert_eq!(d.retry_after(), Some(Duration::from_millis(100)));
    assert_eq!((d.tiers()[0].remaining(), d.tiers()[1].remaining()), (4, 100_000));
    // Bigger than the byte tier's capacity: never.
    let d = check(1_000_001).await;
    assert_eq!(d.decision().outcome(), Outcome::CostExceedsCapacity);
    // A body-less request costs no bytes, even with the byte tier exhausted.
    assert!(check(100_000).await.decision().is_allowed());
    let d = check(0).await;
    assert!(d.decision().is_allowed());
    assert_eq!(d.decision().tiers()[0].remaining(), 2);
}

#[tokio::test]
async fn response_bytes_and_tokens_are_settled_tier_by_tier() {
    let policy = llm_policy("out");
    let limiter = limiter_on(policy.clone(), FakeClock::new());
    let key = Key::text("k");
    let remaining = |d: Decision| d.tiers().iter().map(|t| t.remaining()).collect::<Vec<_>>();
    let mut r = limiter.reserve(&key, 1).await.unwrap();
    assert_eq!(remaining(r.decision().clone()), [99, 9_999, 4_999], "one unit of each estimate");
    r.settle_unit(Unit::Reported, 1_200).await.unwrap();
    assert_eq!(remaining(limiter.check(&key, 0).await.unwrap()), [99, 9_999, 3_800]);
    // Settling again counts from the last settlement.
    r.settle_unit(Unit::Reported, 1_000).await.unwrap();
    r.settle_tiers(&[(1, 2_500)]).await.unwrap();
    assert_eq!(remaining(limiter.check(&key, 0).await.unwrap()), [99, 7_500, 4_000]);
    // A streamed body larger than the whole tier: charged anyway (the bytes were sent), a debt
    // the next requests wait out.
    let held = limiter.reserve(&key, 1).await.unwrap().hold();
    held.finish(&[(Unit::ResponseBytes, 12_000)]);
    let d = limiter.check(&key, 1).await.unwrap();
    assert_eq!(d.outcome(), Outcome::Limited);
    assert_eq!(d.violated_names(&policy).collect::<Vec<_>>(), ["out"]);
    // Cancelling gives every tier back.
    r.settle(0).await.unwrap();
    let d = limiter.check(&key, 0).await.unwrap();
    assert_eq!(remaining(d)[0], 99);
}

// ---------------------------------------------------------------------------------------------
// Calendar windows.

#[tokio::test]
async fn a_daily_quota_in_berlin_resets_at_local_midnight_across_daylight_saving_changes() {
    let clock = FakeClock::new();
    let berlin = Calendar::per_day(2).in_time_zone("Europe/Berlin");
    let limiter = calendar_limiter("daily", "day", berlin, &clock);
    let key = Key::Global;
    // 2025-03-29 23:00 CET (22:00 UTC): the day ends in an hour.
    clock.set(at("2025-03-29T22:00:00Z"));
    assert!(limiter.check(&key, 2).await.unwrap().is_allowed());
    let d = limiter.check(&key, 1).await.unwrap();
    assert_eq!(d.outcome(), Outcome::Limited);
    assert_eq!(d.retry_after(), Some(Duration::from_secs(3600)));
    // Midnight, 23:00 UTC: a new day of 23 hours (clocks skip 02:00-03:00).
    clock.set(at("2025-03-29T23:00:00Z"));
    let d = limiter.check(&key, 1).await.unwrap();
    assert!(d.is_allowed());
    assert_eq!(d.tiers()[0].reset_after(), Duration::from_secs(23 * 3600));
    assert_eq!(d.tiers()[0].remaining(), 1);
    // The October change: Sunday 2025-10-26 lasts 25 hours.
    clock.set(at("2025-10-25T22:00:00Z")); // 00:00 CEST
    assert!(limiter.check(&key, 2).await.unwrap().is_allowed());
    clock.set(at("2025-10-26T22:30:00Z")); // 23:30 CET, 24.5 h later: still the same day
    let d = limiter.check(&key, 1).await.unwrap();
    assert_eq!(d.outcome(), Outcome::Limited);
    assert_eq!(d.retry_after(), Some(Duration::from_secs(1800)));
    clock.set(at("2025-10-26T23:00:00Z"));
    assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
}

#[tokio::test]
async fn a_monthly_quota_resets_on_the_first_in_the_customers_zone() {
    let clock = FakeClock::new();
    let new_york = Calendar::per_month(10_000).in_time_zone("America/New_York");
    let limiter = calendar_limiter("plan", "month", new_york, &clock);
    // 2025-01-31 23:00 in New York (2025-02-01 04:00 UTC): January still.
    clock.set(at("2025-02-01T04:00:00Z"));
    let d = limiter.check(&Key::Global, 10_000).await.unwrap();
    assert!(d.is_allowed());
    assert_eq!(d.tiers()[0].reset_after(), Duration::from_secs(3600));
    let d = limiter.check(&Key::Global, 1).await.unwrap();
    assert_eq!(secs(d.retry_after()), Some(3600));
    clock.set(at("2025-02-01T05:00:00Z"));
    let d = limiter.check(&Key::Global, 1).await.unwrap();
    assert!(d.is_allowed());
    // February: 28 days until March 1st, 00:00 EST.
    assert_eq!(d.tiers()[0].reset_after(), Duration::from_secs(28 * 86_400));
}

#[tokio::test]
async fn shaping_reserves_in_the_next_window_but_no_further_than_eight_windows() {
    let clock = FakeClock::new();
    clock.set(at("2025-06-02T10:00:45Z"));
    let limiter = calendar_limiter("m", "minute", Calendar::per_minute(2), &clock);
    let key = Key::Global;
    let r = limiter.reserve_within(&key, 2, Duration::from_secs(60)).await.unwrap();
    assert_eq!(r.decision().delay(), Duration::ZERO);
    drop(r);
    // The next minute starts in 15 s.
    let r = limiter.reserve_within(&key, 2, Duration::from_secs(60)).await.unwrap();
    assert_eq!(r.decision().delay(), Duration::from_secs(15));
    drop(r);
    // Six more minutes fill the lookahead; the ninth window is beyond it: refused, to try again
    // when the current window ends (and the lookahead moves on).
    for minute in 1..7u64 {
        let r = limiter.reserve_within(&key, 2, Duration::from_secs(3600)).await.unwrap();
        assert_eq!(r.decision().delay(), Duration::from_secs(15 + 60 * minute));
        drop(r);
    }
    let r = limiter.reserve_within(&key, 2, Duration::from_secs(3600)).await.unwrap();
    assert_eq!(r.decision().outcome(), Outcome::Limited);
    assert_eq!(r.decision().retry_after(), Some(Duration::from_secs(15)));
}

/// A leaky bucket of 1 a second (burst 20) under a calendar tier of 3 a minute.
fn leaky_three_a_minute() -> Policy {
    Policy::builder("paced")
        .algorithm(Algorithm::LeakyBucket)
        .tier("rate", Quota::per_second(1).with_burst(20))
        .calendar("minute", Calendar::per_minute(3))
        .build()
        .unwrap()
}

/// What a shaped request got: `Ok(delay)` or `Err(retry after)`, in whole seconds.
fn shaped(d: &Decision) -> Result<u64, Option<u64>> {
    if d.is_allowed() { Ok(d.delay().as_secs()) } else { Err(secs(d.retry_after())) }
}

/// Ten requests at second :58, shaped within 120 s: the bucket lets one leave a second, and a
/// minute takes three. Each is charged in the minute it leaves in, which had room for it: two
/// leave in that minute, three in each of the next two, and the last two would leave in the
/// fourth minute, past the budget; a retry succeeds exactly when that departure is within it.
#[tokio::test]
async fn shaping_never_fills_a_calendar_minute_past_its_limit() {
    let clock = FakeClock::new();
    let start = at("2025-06-02T10:00:58Z");
    clock.set(start);
    let limiter = limiter_on(leaky_three_a_minute(), clock.clone());
    let budget = Duration::from_secs(120);
    let mut got = Vec::new();
    let mut per_minute = std::collections::BTreeMap::<u64, u64>::new();
    for _ in 0..10 {
        let r = limiter.reserve_within(&Key::Global, 1, budget).await.unwrap();
        if let Ok(delay) = shaped(r.decision()) {
            *per_minute.entry((start / 1_000_000_000 + delay) / 60 % 60).or_default() += 1;
        }
        got.push(shaped(r.decision()));
        drop(r);
    }
    let refused = Err(Some(2));
    assert_eq!(got, [Ok(0), Ok(1), Ok(2), Ok(3), Ok(4), Ok(62), Ok(63), Ok(64), refused, refused]);
    assert_eq!(per_minute.into_iter().collect::<Vec<_>>(), [(0, 2), (1, 3), (2, 3)]);
    clock.advance(Duration::from_secs(1));
    let r = limiter.reserve_within(&Key::Global, 1, budget).await.unwrap();
    assert_eq!(shaped(r.decision()), Err(Some(1)));
    clock.advance(Duration::from_secs(1));
    // 10:01:00, leaving at 10:03:00.
    let r = limiter.reserve_within(&Key::Global, 1, budget).await.unwrap();
    assert_eq!(shaped(r.decision()), Ok(120));
}

/// A departure a rate tier puts past a calendar tier's eight windows is refused (the Redis
/// store holds the bounds of no later window), whatever the budget: not before the current
/// window ends, when the windows move on; never admitted uncharged.
#[tokio::test]
async fn a_departure_past_the_calendar_lookahead_is_refused() {
    let clock = FakeClock::new();
    clock.set(at("2025-06-02T10:00:30Z"));
    let policy = Policy::builder("slow")
        .tier("rate", Quota::new(1, Duration::from_secs(600)))
        .calendar("minute", Calendar::per_minute(5))
        .build()
        .unwrap();
    let limiter = limiter_on(policy, clock.clone());
    let hour = Duration::from_secs(3600);
    let r = limiter.reserve_within(&Key::Global, 1, hour).await.unwrap();
    assert_eq!(shaped(r.decision()), Ok(0));
    drop(r);
    // The next may leave ten minutes on, in the eleventh window.
    let d = limiter.reserve_within(&Key::Global, 1, hour).await.unwrap();
    assert_eq!(shaped(d.decision()), Err(Some(30)));
    assert_eq!(limiter.check(&Key::Global, 0).await.unwrap().tiers()[1].remaining(), 4);
    // At 10:03:00 the eleventh window is the eighth.
    clock.set(at("2025-06-02T10:02:59Z"));
    let d = limiter.reserve_within(&Key::Global, 1, hour).await.unwrap();
    assert_eq!(shaped(d.decision()), Err(Some(1)));
    clock.set(at("2025-06-02T10:03:00Z"));
    let d = limiter.reserve_within(&Key::Global, 1, hour).await.unwrap();
    assert_eq!(shaped(d.decision()), Ok(450));
}

// ---------------------------------------------------------------------------------------------
// All or nothing, over random policies mixing every kind.

#[derive(Debug, Clone)]
enum TierSpec {
    Rate(u64, u64, Unit),
    Slots(u64),
    Calendar(u64, usize, bool),
}

fn tier_spec() -> impl Strategy<Value = TierSpec> {
    let unit = prop::sample::select(vec![
        Unit::Requests,
        Unit::RequestBytes,
        Unit::ResponseBytes,
        Unit::Reported,
    ]);
    prop_oneof![
        (1u64..=8, 1u64..=3000, unit).prop_map(|(c, ms, u)| TierSpec::Rate(c, ms, u)),
        (1u64..=4).prop_map(TierSpec::Slots),
        (1u64..=8, 0usize..3, any::<bool>()).prop_map(|(c, p, z)| TierSpec::Calendar(c, p, z)),
    ]
}

fn build(algorithm: Algorithm, specs: &[TierSpec]) -> Policy {
    let mut b = Policy::builder("mix").algorithm(algorithm);
    for (i, spec) in specs.iter().enumerate() {
        let name = format!("t{i}");
        b = match *spec {
            TierSpec::Rate(c, ms, u) => {
                b.tier(name, Quota::new(c, Duration::from_millis(ms)).counting(u))
            }
            TierSpec::Slots(n) => b.concurrency(name, Concurrency::new(n)),
            TierSpec::Calendar(c, p, zone) => {
                let cal = match p {
                    0 => Calendar::per_minute(c),
                    1 => Calendar::per_hour(c),
                    _ => Calendar::per_day(c),
                };
                b.calendar(name, if zone { cal.in_time_zone("Europe/Berlin") } else { cal })
            }
        };
    }
    b.build().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    /// A refused request changes no tier (every tier reports what it reported before); an
    /// admitted one takes its cost from every tier.
    #[test]
    fn every_tier_or_none(
        algorithm in prop::sample::select(Algorithm::ALL.to_vec()),
        specs in proptest::collection::vec(tier_spec(), 1..=4),
        steps in proptest::collection::vec((0u64..=2_000, proptest::collection::vec(0u64..=5, 4), any::<bool>()), 1..60),
    ) {
        let policy = build(algorithm, &specs);
        let clock = FakeClock::new();
        clock.set(at("2025-10-26T00:59:00Z"));
        let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let bound = store.bind_policy(&policy);
        let key = Key::Global;
        let mut held = Vec::new();
        for (advance, costs, release) in steps {
            clock.advance(Duration::from_millis(advance));
            if release && !held.is_empty() {
                held.remove(0);
            }
            let before = store.check_now(&bound, Check::new(&key, 0)).decision;
            let v = store.check_now(&bound, Check::new(&key, 1).with_costs(&costs));
            let after = store.check_now(&bound, Check::new(&key, 0)).decision;
            let n = policy.tiers().len();
            // A policy of request rates only takes the check's cost on every tier.
            let plain = policy.tiers().iter().all(|t| t.kind() == TierKind::Rate && t.unit() == Unit::Requests);
            if v.decision.is_allowed() {
                for (i, cost) in costs.iter().enumerate().take(n) {
                    let cost = if plain { 1 } else { *cost };
                    let (b, a) = (before.tiers()[i].remaining(), after.tiers()[i].remaining());
                    prop_assert_eq!(a, b - cost, "tier {} charged {}", i, cost);
                }
                if let Some(t) = v.ticket { held.push(t); }
            } else {
                let rem = |d: &Decision| d.tiers().iter().map(|t| (t.remaining(), t.reset_after())).collect::<Vec<_>>();
                prop_assert_eq!(rem(&before), rem(&after), "a refusal changed a tier");
            }
        }
    }
}
