//! Redis Sentinel: the store finds the master through three sentinels the test starts (a
//! master and one replica, all on loopback), and follows a failover without a restart.
//!
//! Under load, the master is killed (SIGKILL); the sentinels promote the replica. The failover
//! time is measured from the sentinels (`SENTINEL GET-MASTER-ADDR-BY-NAME` polled until one of
//! them names the replica). Asserted, with the local fallback and without one: nothing panics;
//! no check waits longer than the store's timeout plus a margin; in between, the failure policy
//! decides (the fallback, or a `StoreError` for the layer to fail open or closed); every check
//! made from the failover time + 1 s on is decided by Redis, on the promoted master; a fresh
//! key's limit is then exact; the charges lost in the failover (admitted by the old master,
//! missing on the promoted one: replication is asynchronous) are no more than the old master
//! admitted in its last 10 ms.
//!
//! The scenarios run one at a time (they measure latency on a 2-core machine).
#![cfg(feature = "redis")]
use crate::support;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::outage::{MARGIN, connect, wait_for_promotion, with_fallback};
use support::redis::Sentinels;
use tollgate::key::Key;
use tollgate::store::{BreakerState, RedisStore, Store};
use tollgate::{Limiter, Policy, Quota, Source};

/// The store's per-call timeout in these tests. Killed servers refuse at once, so it bounds
/// only how long a check waits for a server that stalls: at 150 ms, on this shared 2-core
/// machine under other load, calls to a healthy server now and then stalled past it (and the
/// fallback decided), which says nothing of a failover.
const TIMEOUT: Duration = Duration::from_millis(500);
/// Concurrent checks kept in flight.
const WORKERS: usize = 32;
/// Checks each worker makes at most (so a run is bounded even if time is not).
const PER_WORKER: usize = 2000;
/// Pause between one worker's checks.
const PACE: Duration = Duration::from_millis(5);
/// From the failover on, by when checks are decided by Redis again.
const RESUME: Duration = Duration::from_secs(1);

use crate::ONE_AT_A_TIME;

/// What one check was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// Decided by Redis.
    Redis,
    /// Decided by the local fallback.
    Fallback,
    /// A `StoreError`, for the layer's failure policy.
    Failed,
}

struct Sample {
    started: Instant,
    took: Duration,
    seen: Seen,
    /// Admitted.
    allowed: bool,
    /// `n` of the key `k{n}` checked before the kill (after it, keys are `p{n}`).
    before_kill: Option<usize>,
    error: Option<String>,
}

fn seen(result: &Result<tollgate::Decision, tollgate::StoreError>) -> Seen {
    match result {
        Ok(d) if d.source() == Source::Store => Seen::Redis,
        Ok(_) => Seen::Fallback,
        Err(_) => Seen::Failed,
    }
}

/// The scenario with the local fallback (`fallback`) or without one.
async fn scenario(fallback: bool) {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(mut group) = Sentinels::start() else { return };
    let old = group.master.addr();
    let promoted = group.replica.addr();
    let builder = RedisStore::sentinel_builder(group.urls(), group.name.clone())
        .timeout(TIMEOUT)
        .circuit_breaker(3, Duration::from_millis(300));
    let store = with_fallback(builder, fallback);
    let name = if fallback { "Fallback" } else { "NoFallback" };
    connect(&store, 20, Duration::from_millis(100), &format!("{name}: ")).await;
    if fallback {
        let unknown = RedisStore::sentinel_builder(group.urls(), "unknown")
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap();
        let error = unknown.connect().await.unwrap_err().to_string();
        assert!(error.contains("\"unknown\""), "names the master it asked for: {error}");
    }
    let servers: Vec<String> = store.servers().into_iter().map(|s| s.addr).collect();
    assert_eq!(servers, std::slice::from_ref(&old), "the sentinels named the master");

    let policy = Policy::single("sentinel", Quota::per_hour(50)).unwrap();
    let limiter = Arc::new(Limiter::with_store(policy.clone(), store.clone()).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let kill = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let (limiter, stop, kill) =
                (Arc::clone(&limiter), Arc::clone(&stop), Arc::clone(&kill));
            tokio::spawn(async move {
                let mut samples = Vec::new();
                for i in 0..PER_WORKER {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    // Keys checked before the kill are not checked after it, so what the
                    // promoted master holds of them is what was replicated.
                    let n = (w * 7 + i) % 1000;
                    let before_kill = (!kill.load(Ordering::Relaxed)).then_some(n);
                    let key =
                        Key::text(format!("{}{n}", if before_kill.is_some() { 'k' } else { 'p' }));
                    let started = Instant::now();
                    let result = limiter.check(&key, 1).await;
                    let error = result.as_ref().err().map(ToString::to_string);
                    samples.push(Sample {
                        started,
                        took: started.elapsed(),
                        seen: seen(&result),
                        allowed: result.as_ref().is_ok_and(tollgate::Decision::is_allowed),
                        before_kill,
                        error,
                    });
                    tokio::time::sleep(PACE).await;
                }
                samples
            })
        })
        .collect();

    tokio::time::sleep(Duration::from_millis(500)).await;
    // Checks that end while the kill is under way may already fail.
    kill.store(true, Ordering::Relaxed);
    let killing = Instant::now();
    group.master.kill();
    let killed = Instant::now();
    // The failover time: until one of the sentinels names the replica.
    let (group, failed_over, named) = wait_for_promotion(group, old, killed).await;
    let failover = failed_over - killed;
    assert_eq!(named, promoted, "{}", group.logs());
    tokio::time::sleep_until((failed_over + RESUME + Duration::from_secs(1)).into()).await;
    stop.store(true, Ordering::Relaxed);

    let mut samples = Vec::new();
    for w in workers {
        samples.extend(w.await.expect("no worker panicked"));
    }
    let before: Vec<&Sample> = samples.iter().filter(|s| s.started + s.took < killing).collect();
    let between: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.started >= killing && s.started < failed_over + RESUME)
        .collect();
    let after: Vec<&Sample> =
        samples.iter().filter(|s| s.started >= failed_over + RESUME).collect();
    let count = |of: &[&Sample], seen| of.iter().filter(|s| s.seen == seen).count();
    // The first check made after the kill that Redis decided, from the failover time.
    let resumed = samples
        .iter()
        .filter(|s| s.started >= killed && s.seen == Seen::Redis)
        .map(|s| s.started + s.took)
        .min()
        .map(|at| at.saturating_duration_since(failed_over));
    eprintln!(
        "{name}: failover {failover:?} after the kill; first check decided by the promoted \
         master {resumed:?} after it; checks before/between/after: {}/{}/{}; between: {} by \
         Redis, {} by the fallback, {} failed",
        before.len(),
        between.len(),
        after.len(),
        count(&between, Seen::Redis),
        count(&between, Seen::Fallback),
        count(&between, Seen::Failed),
    );

    let slowest = samples.iter().map(|s| s.took).max().unwrap();
    assert!(slowest <= TIMEOUT + MARGIN, "{name}: a check took {slowest:?}");
    assert!(before.len() >= WORKERS, "{name}: only {} checks before the kill", before.len());
    assert_eq!(
        count(&before, Seen::Redis),
        before.len(),
        "{name}: Redis decided before the kill; {:?}",
        before
            .iter()
            .filter(|s| s.seen != Seen::Redis)
            .map(|s| (s.started, s.took, &s.error))
            .take(30)
            .collect::<Vec<_>>()
    );
    let policy_decided = if fallback {
        assert_eq!(count(&between, Seen::Failed), 0, "{name}: the fallback always decides");
        count(&between, Seen::Fallback)
    } else {
        assert_eq!(count(&between, Seen::Fallback), 0, "{name}: no fallback");
        count(&between, Seen::Failed)
    };
    assert!(policy_decided > 0, "{name}: the failure policy decided during the failover");
    assert!(after.len() >= WORKERS, "{name}: only {} checks after the failover", after.len());
    assert_eq!(
        count(&after, Seen::Redis),
        after.len(),
        "{name}: from the failover time + {RESUME:?} on, Redis decides every check \
         (failover {failover:?} after the kill); {:?}",
        after
            .iter()
            .filter(|s| s.seen != Seen::Redis)
            .map(|s| (s.started.saturating_duration_since(failed_over), s.took, &s.error))
            .take(40)
            .collect::<Vec<_>>()
    );

    // The store follows the promoted master; the old one's breaker is its own.
    let states = store.breaker_states();
    assert!(states.contains(&(promoted.clone(), BreakerState::Closed)), "{name}: {states:?}");
    assert_eq!(states.len(), 2, "{name}: {states:?}");
    assert_eq!(store.breaker_state(), BreakerState::Closed, "{name}");

    // A fresh key gets its 50, no more, decided by Redis on the promoted master.
    let fresh = Key::text("fresh");
    let mut allowed = 0;
    for _ in 0..60 {
        let decision = limiter.check(&fresh, 1).await.unwrap();
        assert_eq!(decision.source(), Source::Store, "{name}");
        allowed += usize::from(decision.is_allowed());
    }
    assert_eq!(allowed, 50, "{name}");
    let state = store.bind(&policy).unwrap().state_key(&fresh);
    let exists: i64 = redis::cmd("EXISTS").arg(&state).query(&mut group.replica.conn()).unwrap();
    assert_eq!(exists, 1, "{name}: decided on the promoted master");

    // Charges lost in the failover: admitted by the old master, not on the promoted one.
    let mut admitted: HashMap<usize, u64> = HashMap::new();
    for s in &samples {
        if let (Some(n), Seen::Redis, true) = (s.before_kill, s.seen, s.allowed) {
            *admitted.entry(n).or_default() += 1;
        }
    }
    let mut lost = 0;
    for (n, admitted) in &admitted {
        let query = limiter.check(&Key::text(format!("k{n}")), 0).await.unwrap();
        assert_eq!(query.source(), Source::Store, "{name}");
        let charged = 50 - query.tiers()[0].remaining();
        lost += admitted.saturating_sub(charged);
    }
    let last = |window: Duration| {
        samples
            .iter()
            .filter(|s| s.before_kill.is_some() && s.seen == Seen::Redis && s.allowed)
            .filter(|s| s.started + s.took + window >= killing)
            .count()
    };
    eprintln!(
        "{name}: {lost} charges lost of {} admitted on {} keys by the old master; it admitted {} \
         in its last 10 ms, {} in its last 100 ms",
        admitted.values().sum::<u64>(),
        admitted.len(),
        last(Duration::from_millis(10)),
        last(Duration::from_millis(100)),
    );
    // The bound in the store's docs: no more than the old master admitted in its last
    // replication lag, which on loopback stays under 10 ms.
    assert!(
        lost <= last(Duration::from_millis(10)) as u64,
        "{name}: {lost} charges lost, more than the old master admitted in its last 10 ms"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_under_load_is_followed_with_the_fallback_deciding_in_between() {
    scenario(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_under_load_is_followed_with_errors_in_between_without_a_fallback() {
    scenario(false).await;
}

#[test]
fn sentinel_settings_are_checked_when_built() {
    let invalid = |built: Result<RedisStore, tollgate::ConfigError>| match built {
        Err(tollgate::ConfigError::Invalid { setting, .. }) => setting,
        other => panic!("expected an invalid setting, got {other:?}"),
    };
    let sentinels = ["redis://127.0.0.1:1/"];
    assert_eq!(invalid(RedisStore::sentinel_builder(sentinels, "").build()), "master_name");
    assert_eq!(invalid(RedisStore::sentinel_builder(Vec::<String>::new(), "m").build()), "url");
    assert_eq!(invalid(RedisStore::sentinel_builder(["not a url"], "m").build()), "url");
    assert_eq!(
        invalid(RedisStore::sentinel_builder(sentinels, "m").master_url("nope").build()),
        "master_url"
    );
    assert_eq!(
        invalid(RedisStore::builder("redis://127.0.0.1:1/").master_url("redis://m/").build()),
        "master_url"
    );
    let store = RedisStore::sentinel_builder(sentinels, "m")
        .master_url("redis://user:pass@master/3")
        .build()
        .unwrap();
    assert!(format!("{store:?}").contains("sentinel: true"));
}

#[tokio::test]
async fn with_no_sentinel_answering_the_failure_policy_decides() {
    // Closed loopback ports: every sentinel refuses at once.
    let closed = ["redis://127.0.0.1:1/", "redis://127.0.0.1:2/"];
    let policy = Policy::single("sentinel", Quota::per_hour(50)).unwrap();
    let key = Key::text("k");

    let store = RedisStore::sentinel_builder(closed, "m").timeout(TIMEOUT).build().unwrap();
    let error = store.connect().await.unwrap_err().to_string();
    assert!(
        error.contains("127.0.0.1:1") && error.contains("127.0.0.1:2"),
        "each sentinel's answer: {error}"
    );
    let limiter = Limiter::with_store(policy.clone(), store.clone()).unwrap();
    let decision = limiter.check(&key, 1).await.unwrap();
    assert_eq!((decision.source(), decision.is_allowed()), (Source::Fallback, true));
    assert!(store.servers().is_empty());
    assert!(store.breaker_states().is_empty());

    let store =
        RedisStore::sentinel_builder(closed, "m").timeout(TIMEOUT).no_fallback().build().unwrap();
    let limiter = Limiter::with_store(policy, store).unwrap();
    assert!(matches!(limiter.check(&key, 1).await, Err(tollgate::StoreError::Backend(_))));
}
