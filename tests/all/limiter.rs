//! `Limiter` used from code, on a paused tokio clock: `until_ready` waits exactly for its slot,
//! refuses what would wait too long, gives a slot back when the waiter goes away, and jitters
//! within its bound.

use std::time::Duration;

use tokio::time::Instant;
use tollgate::clock::TokioClock;
use tollgate::key::Key;
use tollgate::store::MemoryStore;
use tollgate::{Limiter, Policy, Quota, Rejection};

fn limiter(quota: Quota) -> Limiter {
    let store = MemoryStore::builder().clock(TokioClock::new()).build().unwrap();
    Limiter::with_store(Policy::single("jobs", quota).unwrap(), store).unwrap()
}

#[tokio::test(start_paused = true)]
async fn until_ready_waits_exactly_for_each_slot() {
    let limiter = limiter(Quota::per_second(4).with_burst(2));
    let start = Instant::now();
    let mut at = Vec::new();
    for _ in 0..6 {
        let d = limiter.until_ready(&Key::Global, 1, Duration::from_secs(10)).await.unwrap();
        assert!(d.is_allowed());
        at.push(start.elapsed());
    }
    let ms = Duration::from_millis;
    assert_eq!(at, [ms(0), ms(0), ms(250), ms(500), ms(750), ms(1000)]);
}

#[tokio::test(start_paused = true)]
async fn until_ready_refuses_what_would_wait_longer_than_allowed() {
    let limiter = limiter(Quota::per_second(1));
    limiter.until_ready(&Key::Global, 1, Duration::ZERO).await.unwrap();
    match limiter.until_ready(&Key::Global, 1, Duration::from_millis(400)).await {
        Err(Rejection::Limited(limited)) => {
            assert_eq!(limited.shaping_budget(), Some(Duration::from_millis(400)));
            // It would have fitted 600 ms after the budget.
            assert_eq!(limited.retry_after(), Some(Duration::from_millis(600)));
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // A cost above the capacity never fits.
    let err = limiter.until_ready(&Key::Global, 2, Duration::from_secs(60)).await.unwrap_err();
    assert!(matches!(err, Rejection::Limited(l) if l.retry_after().is_none()));
}

#[tokio::test(start_paused = true)]
async fn a_waiter_that_goes_away_gives_its_slot_back() {
    let limiter = limiter(Quota::per_second(1));
    limiter.until_ready(&Key::Global, 1, Duration::ZERO).await.unwrap();
    // Reserves the slot at 1 s, then is dropped at 0.5 s.
    let waiting = limiter.until_ready(&Key::Global, 1, Duration::from_secs(5));
    assert!(tokio::time::timeout(Duration::from_millis(500), waiting).await.is_err());
    tokio::task::yield_now().await; // the give-back runs on a spawned task
    let start = Instant::now();
    limiter.until_ready(&Key::Global, 1, Duration::from_secs(5)).await.unwrap();
    assert_eq!(start.elapsed(), Duration::from_millis(500), "the slot at 1 s was free again");
}

#[tokio::test(start_paused = true)]
async fn jitter_stays_within_its_bound_and_keeps_the_slot() {
    let limiter = limiter(Quota::per_second(10).with_burst(1));
    let jitter = Duration::from_millis(50);
    let start = Instant::now();
    let mut last = Duration::ZERO;
    for i in 0..20u32 {
        limiter
            .until_ready_with_jitter(&Key::Global, 1, Duration::from_secs(60), jitter)
            .await
            .unwrap();
        let now = start.elapsed();
        // The slot of the i-th request is at i x 100 ms after the previous one's release.
        assert!(now >= last, "monotonic");
        if i == 0 {
            assert!(now <= jitter, "{now:?}");
        }
        last = now;
    }
    // 20 requests at 10/s, each jittered by at most 50 ms after its slot.
    assert!(
        last >= Duration::from_millis(1900) && last <= Duration::from_millis(1900) + 20 * jitter,
        "{last:?}"
    );
}
