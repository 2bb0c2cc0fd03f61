//! What lease mode's decisions report (`RateLimit: r=`, `t=`), against a real redis-server:
//! several leasing instances and one exact instance on one key and one fake clock, random
//! checks. The bounds stated in `Lease`'s docs ("Headers") hold at every admitted check, and a
//! client that paces on `remaining` and `reset_after` alone is refused only when other checks
//! took, since the last lease call of the instance that answered it, the units it was told of.
#![cfg(feature = "redis")]

use crate::support;

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use support::redis::Server;
use support::stores::redis::on_clock;
use tollgate::clock::{Clock, FakeClock};
use tollgate::key::Key;
use tollgate::store::{Check, Lease, LeaseStats, RedisPolicy, RedisStore, Store};
use tollgate::{Algorithm, Calendar, Decision, Policy, Quota};

const MS: u64 = 1_000_000;
const S: u64 = 1_000 * MS;

/// One store and its binding of the policy.
type Node = (RedisStore, RedisPolicy);

/// A store on `url` and its binding of `policy`, leasing it with `lease`, or exact.
fn node(url: &str, clock: &FakeClock, prefix: &str, policy: &Policy, lease: Option<Lease>) -> Node {
    let mut builder = RedisStore::builder(url);
    if let Some(lease) = lease {
        builder = builder.lease_policy(policy.name(), lease);
    }
    let store = on_clock(builder, clock, prefix);
    let bound = store.bind(policy).unwrap();
    assert_eq!(bound.lease(), lease);
    (store, bound)
}

async fn check(node: &Node, key: &Key, cost: u64) -> Decision {
    node.0.check(&node.1, Check::new(key, cost)).await.expect("redis answers").decision
}

/// The policies the traces run: every algorithm that leases, several tiers, a calendar tier.
fn policy(kind: u8, count: u64, burst: u64) -> Policy {
    let second = Quota::per_second(count);
    match kind {
        0 => Policy::single("h", second.with_burst(burst)).unwrap(),
        1 => Policy::builder("h")
            .algorithm(Algorithm::FixedWindow)
            .tier("second", second)
            .build()
            .unwrap(),
        2 | 3 => Policy::builder("h")
            .algorithm(if kind == 2 { Algorithm::TokenBucket } else { Algorithm::LeakyBucket })
            .tier("second", second.with_burst(burst))
            .build()
            .unwrap(),
        4 => Policy::builder("h")
            .tier("second", second.with_burst(burst))
            .tier("minute", Quota::per_minute(count * 12))
            .build()
            .unwrap(),
        _ => Policy::builder("h")
            .tier("second", second.with_burst(burst))
            .calendar("day", Calendar::per_day(count * 8))
            .build()
            .unwrap(),
    }
}

/// A random lease trace.
#[derive(Debug, Clone)]
struct Trace {
    kind: u8,
    count: u64,
    burst: u64,
    max_block: u64,
    lifetime_ms: u64,
    schedule: bool,
    instances: usize,
    /// (who: an instance, or `instances` for the exact one; cost; then the clock moves µs).
    steps: Vec<(usize, u64, u64)>,
}

fn traces() -> impl Strategy<Value = Trace> {
    (
        0u8..6,
        5u64..=60,
        2usize..=3,
        1u64..=12,
        prop_oneof![Just(1_000u64), Just(3_000)],
        any::<bool>(),
    )
        .prop_flat_map(|(kind, count, instances, max_block, lifetime_ms, schedule)| {
            let step = (
                0..=instances,
                prop_oneof![4 => Just(1u64), 1 => Just(2)],
                prop_oneof![6 => 0u64..=20_000, 3 => 0u64..=200, 1 => 100_000u64..=1_500_000],
            );
            (2..=count, proptest::collection::vec(step, 40..=140)).prop_map(
                move |(burst, steps)| Trace {
                    kind,
                    count,
                    burst,
                    max_block,
                    lifetime_ms,
                    schedule,
                    instances,
                    steps,
                },
            )
        })
}

/// Units a rate tier (count per period, in ns) refills in `ns`, rounded up, plus one.
fn refill(count: u64, period_ns: u64, ns: u64) -> u64 {
    (u128::from(ns) * u128::from(count)).div_ceil(u128::from(period_ns)) as u64 + 1
}

/// What a client pinned to one instance paces on: its last answer, when it came, and the cost
/// it answered.
#[derive(Default)]
struct Client {
    last: Option<(u64, Decision, u64)>,
}

impl Client {
    /// Whether the last answer says a check of `cost` is admitted at `now` (a refusal's
    /// `retry_after`, for a check costing no more than the one refused; else every tier's
    /// `remaining`, or its reset once passed), and if so, per tier, the units it said the
    /// tier has then.
    fn promised(&self, now: u64, cost: u64) -> Option<Vec<u64>> {
        let Some((at, d, asked)) = &self.last else { return Some(Vec::new()) };
        if !d.is_allowed() && cost <= *asked {
            let retry = d.retry_after()?.as_nanos() as u64;
            return (now >= at + retry).then(|| d.tiers().iter().map(|_| cost).collect());
        }
        d.tiers()
            .iter()
            .map(|t| {
                let reset = at + t.reset_after().as_nanos() as u64;
                if now >= reset {
                    Some(t.limit())
                } else {
                    (t.remaining() >= cost).then_some(t.remaining())
                }
            })
            .collect()
    }
}

/// What the test knows of one leasing instance.
#[derive(Default)]
struct Seen {
    stats: LeaseStats,
    /// Units this instance's admitted checks took from its blocks.
    spent: u64,
    /// The instant of its last lease call, and the totals taken by the others and given back
    /// by all, then.
    call: Option<(u64, u64, u64)>,
}

/// Replays `trace`: returns how many admitted checks were held to the bounds, and how many
/// refusals the pacing clients met that their last answer did not predict (each one allowed
/// by what others took).
async fn replay(url: &str, n: u64, trace: &Trace) -> Result<(u64, u64), String> {
    let policy = policy(trace.kind, trace.count, trace.burst);
    let lease = Lease::new()
        .max_block(trace.max_block)
        .lifetime(Duration::from_millis(trace.lifetime_ms))
        .schedule(trace.schedule);
    let clock = FakeClock::new();
    clock.set(20_000 * 86_400 * S + 3_600 * S);
    let prefix = format!("hdr{n}:");
    let nodes: Vec<Node> =
        (0..trace.instances).map(|_| node(url, &clock, &prefix, &policy, Some(lease))).collect();
    let exact = node(url, &clock, &prefix, &policy, None);
    let key = Key::text("hot");
    let mut seen: Vec<Seen> = (0..trace.instances).map(|_| Seen::default()).collect();
    let mut clients: Vec<Client> = (0..trace.instances).map(|_| Client::default()).collect();
    // Units taken from Redis by each instance (blocks granted) and by the exact one.
    let mut taken = vec![0u64; trace.instances + 1];
    // The useful block an instance may wait for (see `Lease`, "Block size"): a waiting
    // tier's rest in Redis, which it does not promise, is below it.
    let useful = useful_block(&policy, trace.max_block).max(2);
    let (mut held_to, mut surprises) = (0, 0);
    for (step, &(who, cost, advance_us)) in trace.steps.iter().enumerate() {
        let now = clock.now();
        if who == trace.instances {
            if check(&exact, &key, cost).await.is_allowed() {
                taken[who] += cost;
            }
            clock.advance(Duration::from_micros(advance_us));
            continue;
        }
        let promised = clients[who].promised(now, cost);
        let Some(promised) = promised else {
            // The client waits: its last answer said this check would be refused.
            clock.advance(Duration::from_micros(advance_us));
            continue;
        };
        // The lease call the last answer was based on (a refusal is judged against it).
        let before = seen[who].call;
        let d = check(&nodes[who], &key, cost).await;
        let stats = nodes[who].1.lease_stats();
        taken[who] += stats.units_granted - seen[who].stats.units_granted;
        let returned_all: u64 = seen
            .iter()
            .enumerate()
            .map(|(i, s)| if i == who { stats.units_returned } else { s.stats.units_returned })
            .sum();
        let others = |taken: &[u64]| {
            taken.iter().enumerate().filter(|(i, _)| *i != who).map(|(_, t)| t).sum::<u64>()
        };
        if stats.decided_on_redis > seen[who].stats.decided_on_redis {
            seen[who].call = Some((now, others(&taken), returned_all));
        }
        seen[who].stats = stats;
        let what = || format!("step {step}: {d:?}\n{trace:?}");
        let (call, others_then, returned_then) =
            seen[who].call.ok_or_else(|| format!("no lease call yet: {}", what()))?;
        let taken_since = others(&taken) - others_then;
        if d.is_allowed() {
            seen[who].spent += cost;
            let held = stats.units_granted - stats.units_returned - seen[who].spent;
            // Refreshed by every instance's counters, whatever gave back meanwhile.
            let returned_now: u64 =
                (0..trace.instances).map(|i| nodes[i].1.lease_stats().units_returned).sum();
            let truth = check(&exact, &key, 0).await;
            for (j, (t, e)) in d.tiers().iter().zip(truth.tiers()).enumerate() {
                let (r, e) = (t.remaining(), e.remaining());
                // Never above what Redis has, what this instance holds, and what the others
                // took since its last lease call.
                if r > (e + held + taken_since).min(t.limit()) {
                    return Err(format!(
                        "tier {j}: r={r} above E={e} + held {held} + taken since {taken_since}: {}",
                        what()
                    ));
                }
                // Never below what Redis has, less what refilled or came back since that
                // call, and a waiting tier's rest (less than a useful block).
                let tier = &policy.tiers()[j];
                let refilled = match (tier.calendar(), policy.algorithm()) {
                    (None, Algorithm::FixedWindow) | (Some(_), _) => 0,
                    (None, _) => {
                        let q = tier.quota();
                        refill(q.count(), q.period().as_nanos() as u64, now - call)
                    }
                };
                let slack = refilled + (returned_now - returned_then) + useful;
                if r + slack < e {
                    return Err(format!(
                        "tier {j}: r={r} below E={e} by more than {slack} (refill {refilled}): {}",
                        what()
                    ));
                }
            }
            held_to += 1;
        } else if !promised.is_empty() {
            // A refusal the last answer did not predict: only when the others took, since
            // the lease call that answer was based on, what it promised beyond this check.
            let (call, others_then, _) = before.ok_or_else(|| format!("no call: {}", what()))?;
            let taken_since = others(&taken) - others_then;
            let allowed = d
                .tiers()
                .iter()
                .zip(&promised)
                .any(|(t, p)| t.is_violated() && taken_since + cost > *p);
            if !allowed {
                return Err(format!(
                    "a refusal the last answer ({:?}) did not predict; others took {taken_since} \
                     since the call at {call}: {}",
                    clients[who].last,
                    what()
                ));
            }
            surprises += 1;
        }
        clients[who].last = Some((now, d, cost));
        clock.advance(Duration::from_micros(advance_us));
    }
    Ok((held_to, surprises))
}

/// `Lease`'s useful block (`lease::useful_block`): what every rate tier refills in 2 ms, a
/// quarter of its burst at most, `max_block` at most, at least 1; 0 for fixed windows.
fn useful_block(policy: &Policy, max_block: u64) -> u64 {
    if policy.algorithm() == Algorithm::FixedWindow {
        return 0;
    }
    policy
        .tiers()
        .iter()
        .filter(|t| t.calendar().is_none())
        .map(|t| {
            let q = t.quota();
            let per = q.period().as_nanos() as u64;
            (2 * MS * q.count() / per).min(q.burst() / 4)
        })
        .fold(max_block, u64::min)
        .max(1)
}

#[test]
fn leased_headers_stay_within_the_stated_bounds_and_pacing_clients_are_not_surprised() {
    let Some(server) = Server::start("redis-server") else { return };
    let long = std::env::var("TOLLGATE_LONG_TESTS").is_ok_and(|v| v == "1");
    let cases = if long { 1_000 } else { 48 };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[33; 32]);
    let config = Config { cases, failure_persistence: None, ..Config::default() };
    let mut runner = TestRunner::new_with_rng(config, rng);
    let case = std::sync::atomic::AtomicU64::new(0);
    let held = std::sync::atomic::AtomicU64::new(0);
    let surprised = std::sync::atomic::AtomicU64::new(0);
    let url = server.url();
    let result = runner.run(&traces(), |trace| {
        let n = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (h, s) = rt.block_on(replay(&url, n, &trace)).map_err(TestCaseError::fail)?;
        held.fetch_add(h, std::sync::atomic::Ordering::Relaxed);
        surprised.fetch_add(s, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let (held, surprised) = (held.into_inner(), surprised.into_inner());
    assert!(held > u64::from(cases) * 10, "the traces admit from leases: {held}");
    // Other checks take from the key between an instance's calls: the allowance is used.
    assert!(surprised > 0, "no refusal came from what others took");
}
