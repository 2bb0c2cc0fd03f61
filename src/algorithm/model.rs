//! Property tests of every algorithm against reference models (SECURITY.md, "algorithm
//! promises").
//!
//! Each reference replays the algorithm's *definition* over the full history of admitted
//! requests, formulated independently of the implementation: GCRA as ITU-T I.371's
//! continuous-state leaky bucket (the implementation uses the virtual-scheduling TAT), the
//! buckets as explicit level replays, the windows and the log as sums over the history. On random
//! traces every decision must match the reference exactly, and:
//!
//! - a retry exactly at `retry_after` is admitted, one a nanosecond earlier is not (the whole
//!   policy, and each violated tier alone);
//! - a cost of exactly `remaining` fits at the same instant, one more does not;
//! - the tier is full again exactly at `reset_after`, and not a nanosecond earlier;
//! - a rejected request leaves every tier as it was; an admitted one charges every tier;
//! - over the whole run, with shaping too, admissions never exceed what the algorithm promises
//!   in any window.

use proptest::prelude::*;

use super::{Mode, TierState, decide};
use crate::algorithm::compiled::Rate;
use crate::decision::{Decision, Outcome};
use crate::policy::Policy;
use crate::quota::{Algorithm, Quota};

/// What a reference says of one tier at `now`.
#[derive(Debug, PartialEq, Eq)]
struct Said {
    /// Whether `cost` more fits now.
    fits: bool,
    remaining: u64,
    reset: u64,
}

fn ceil_div(a: u128, b: u128) -> u128 {
    a.div_ceil(b)
}

/// The reference of one tier: `history` holds `(instant, cost)` of every admitted request, in
/// order of admission (police: non-decreasing instants).
fn reference(alg: Algorithm, r: Rate, history: &[(u64, u64)], now: u64, cost: u64) -> Said {
    let (c, p, b) = (u128::from(r.count), u128::from(r.period), u128::from(r.burst));
    let now_w = u128::from(now);
    let cost_w = u128::from(cost);
    let narrow = |v: u128| u64::try_from(v).unwrap();
    match alg {
        Algorithm::Gcra => {
            // Continuous-state leaky bucket, in units of 1/count ns: each admission adds its
            // increment cost*T (= cost*p) after draining one unit per unit of time.
            let mut content = 0u128;
            let mut last: Option<u128> = None;
            for &(t, k) in history {
                let t = u128::from(t) * c;
                content = last.map_or(0, |l| content.saturating_sub(t - l)) + u128::from(k) * p;
                last = Some(t);
            }
            let backlog = last.map_or(0, |l| content.saturating_sub(now_w * c - l));
            Said {
                fits: backlog + cost_w * p <= b * p,
                remaining: narrow((b * p).saturating_sub(backlog) / p),
                reset: narrow(ceil_div(backlog, c)),
            }
        }
        Algorithm::TokenBucket => {
            // Tokens in units of 1/period, refilled by `count` per ns up to burst*period.
            let full = b * p;
            let mut tokens = full;
            let mut last: Option<u128> = None;
            let refill = |tokens: u128, last: Option<u128>, t: u128| {
                last.map_or(full, |l| (tokens + (t - l) * c).min(full))
            };
            for &(t, k) in history {
                let t = u128::from(t);
                tokens = refill(tokens, last, t) - u128::from(k) * p;
                last = Some(t);
            }
            let now_tokens = refill(tokens, last, now_w);
            Said {
                fits: now_tokens >= cost_w * p,
                remaining: narrow(now_tokens / p),
                reset: narrow(ceil_div(full - now_tokens, c)),
            }
        }
        Algorithm::LeakyBucket => {
            // Water in units of 1/period, draining `count` per ns.
            let mut water = 0u128;
            let mut last: Option<u128> = None;
            let drain = |water: u128, last: Option<u128>, t: u128| {
                last.map_or(0, |l| water.saturating_sub((t - l) * c))
            };
            for &(t, k) in history {
                let t = u128::from(t);
                water = drain(water, last, t) + u128::from(k) * p;
                last = Some(t);
            }
            let now_water = drain(water, last, now_w);
            Said {
                fits: now_water + cost_w * p <= b * p,
                remaining: narrow((b * p - now_water) / p),
                reset: narrow(ceil_div(now_water, c)),
            }
        }
        Algorithm::FixedWindow => {
            let k = now_w / p;
            let used: u128 = history
                .iter()
                .filter(|(t, _)| u128::from(*t) / p == k)
                .map(|(_, x)| u128::from(*x))
                .sum();
            Said {
                fits: used + cost_w <= c,
                remaining: narrow(c.saturating_sub(used)),
                reset: if used > 0 { narrow((k + 1) * p - now_w) } else { 0 },
            }
        }
        Algorithm::SlidingCounter => {
            let k = now_w / p;
            let e = now_w - k * p;
            let sum = |w: u128| -> u128 {
                history
                    .iter()
                    .filter(|(t, _)| u128::from(*t) / p == w)
                    .map(|(_, x)| u128::from(*x))
                    .sum()
            };
            let cur = sum(k);
            let prev = if k > 0 { sum(k - 1) } else { 0 };
            let weighted = prev * (p - e) + cur * p;
            Said {
                fits: weighted + cost_w * p <= c * p,
                remaining: narrow((c * p).saturating_sub(weighted) / p),
                reset: if cur > 0 {
                    narrow((k + 2) * p - now_w)
                } else if prev > 0 {
                    narrow((k + 1) * p - now_w)
                } else {
                    0
                },
            }
        }
        Algorithm::SlidingLog => {
            let live: Vec<_> = history.iter().filter(|(t, _)| u128::from(*t) + p > now_w).collect();
            let weight: u128 = live.iter().map(|(_, x)| u128::from(*x)).sum();
            let newest = live.iter().map(|(t, _)| u128::from(*t)).max();
            Said {
                fits: weight + cost_w <= c,
                remaining: narrow(c.saturating_sub(weight)),
                reset: newest.map_or(0, |t| narrow(t + p - now_w)),
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Step {
    Advance(u64),
    /// A request of `cost`; `shape` is a shaping budget in nanoseconds.
    Check {
        cost: u64,
        shape: Option<u64>,
    },
}

#[derive(Debug, Clone)]
struct Trace {
    algorithm: Algorithm,
    tiers: Vec<(u64, u64, u64)>,
    steps: Vec<Step>,
}

impl Trace {
    fn policy(&self) -> Policy {
        let mut b = Policy::builder("model").algorithm(self.algorithm);
        for (i, (count, period, burst)) in self.tiers.iter().enumerate() {
            let q = Quota::new(*count, std::time::Duration::from_nanos(*period)).with_burst(*burst);
            b = b.tier(format!("t{i}"), q);
        }
        b.build().unwrap()
    }
}

fn trace(shaping: bool) -> impl Strategy<Value = Trace> {
    (prop::sample::select(Algorithm::ALL.to_vec()), prop::bool::weighted(0.4)).prop_flat_map(
        move |(algorithm, grid)| {
            let window = matches!(
                algorithm,
                Algorithm::FixedWindow | Algorithm::SlidingLog | Algorithm::SlidingCounter
            );
            let round = (1u64..=50).prop_map(|k| k * 10_000_000);
            let period =
                if grid { round.boxed() } else { prop_oneof![1u64..=3_000_000_000, round].boxed() };
            let tier = (1u64..=12, period, 0u64..=30).prop_map(move |(c, p, extra)| {
                (c, p, if window { c } else { 1 + extra % (2 * c + 2) })
            });
            let advance = if grid {
                (0u64..=60).prop_map(|k| k * 10_000_000).boxed()
            } else {
                prop_oneof![0u64..=1_000, 0u64..=100_000_000, 0u64..=4_000_000_000].boxed()
            };
            let shape = if shaping {
                proptest::option::weighted(0.5, 0u64..=2_000_000_000).boxed()
            } else {
                Just(None).boxed()
            };
            let step = prop_oneof![
                2 => advance.prop_map(Step::Advance),
                5 => (prop_oneof![4 => Just(1u64), 2 => 0u64..=5, 1 => 0u64..=14], shape)
                    .prop_map(|(cost, shape)| Step::Check { cost, shape }),
            ];
            (proptest::collection::vec(tier, 1..=3), proptest::collection::vec(step, 1..=80))
                .prop_map(move |(tiers, steps)| Trace { algorithm, tiers, steps })
        },
    )
}

fn fresh(policy: &Policy, now: u64) -> Vec<TierState> {
    policy.tiers().iter().map(|t| TierState::fresh(policy.algorithm(), t.rate, now)).collect()
}

fn police(policy: &Policy, states: &[TierState], at: u64, cost: u64) -> Decision {
    let mut states = states.to_vec();
    decide(policy, &mut states, at, cost, Mode::Police).0
}

/// The policy made of tier `i` alone, and that tier's state.
fn alone(policy: &Policy, states: &[TierState], i: usize) -> (Policy, Vec<TierState>) {
    let t = &policy.tiers()[i];
    let p = Policy::builder("alone")
        .algorithm(policy.algorithm())
        .tier(t.name(), t.quota())
        .build()
        .unwrap();
    (p, vec![states[i].clone()])
}

fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap()
}

/// The consistency rules of one decision made at `now` (states are those after it).
fn consistent(
    policy: &Policy,
    states: &[TierState],
    now: u64,
    cost: u64,
    d: &Decision,
) -> Result<(), TestCaseError> {
    if d.outcome() == Outcome::Limited {
        let r = nanos(d.retry_after().expect("limited has a retry"));
        prop_assert!(r > 0);
        prop_assert_eq!(
            police(policy, states, now + r, cost).outcome(),
            Outcome::Allowed,
            "retry at retry_after"
        );
        prop_assert_eq!(
            police(policy, states, now + r - 1, cost).outcome(),
            Outcome::Limited,
            "retry 1 ns early"
        );
    }
    for (i, tier) in d.tiers().iter().enumerate() {
        let (p, s) = alone(policy, states, i);
        if let Some(r) = tier.retry_after() {
            let r = nanos(r);
            prop_assert_eq!(
                police(&p, &s, now + r, cost).outcome(),
                Outcome::Allowed,
                "tier {} retry",
                i
            );
            prop_assert_eq!(
                police(&p, &s, now + r - 1, cost).outcome(),
                Outcome::Limited,
                "tier {} early",
                i
            );
        }
        let m = tier.remaining();
        if m > 0 {
            prop_assert_eq!(
                police(&p, &s, now, m).outcome(),
                Outcome::Allowed,
                "tier {}: remaining fits",
                i
            );
        }
        if m < tier.limit() {
            prop_assert_ne!(
                police(&p, &s, now, m + 1).outcome(),
                Outcome::Allowed,
                "tier {}: remaining + 1",
                i
            );
        }
        let reset = nanos(tier.reset_after());
        let full_at = police(&p, &s, now + reset, 0);
        prop_assert_eq!(full_at.tiers()[0].remaining(), tier.limit(), "tier {}: full at reset", i);
        if reset > 0 {
            let before = police(&p, &s, now + reset - 1, 0);
            prop_assert!(
                before.tiers()[0].remaining() < tier.limit(),
                "tier {}: not full before reset",
                i
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    /// Policing: every decision equals the reference replayed over the history, and obeys the
    /// consistency rules; rejected requests change nothing.
    #[test]
    fn decisions_match_the_reference_models(trace in trace(false)) {
        let policy = trace.policy();
        let alg = policy.algorithm();
        let mut now = 0u64;
        let mut states = fresh(&policy, now);
        let mut history: Vec<(u64, u64)> = Vec::new();
        for step in &trace.steps {
            let cost = match *step {
                Step::Advance(by) => { now += by; continue }
                Step::Check { cost, .. } => cost,
            };
            let before = states.clone();
            let d = decide(&policy, &mut states, now, cost, Mode::Police).0;
            let over = policy.tiers().iter().any(|t| cost > t.capacity());
            let said: Vec<Said> = policy.tiers().iter().map(|t| reference(alg, t.rate, &history, now, cost)).collect();
            let expected = if over {
                Outcome::CostExceedsCapacity
            } else if cost == 0 || said.iter().all(|s| s.fits) {
                Outcome::Allowed
            } else {
                Outcome::Limited
            };
            prop_assert_eq!(d.outcome(), expected, "at {} cost {}", now, cost);
            if expected == Outcome::Allowed && cost > 0 {
                history.push((now, cost));
            } else {
                // Atomic: nothing changed but what pruning forgets.
                let mut pruned = before;
                for (s, t) in pruned.iter_mut().zip(policy.tiers()) {
                    s.prune(alg, t.rate, now);
                }
                prop_assert_eq!(&pruned, &states, "a rejected request changed a tier");
            }
            for (i, (tier, t)) in d.tiers().iter().zip(policy.tiers()).enumerate() {
                let after = reference(alg, t.rate, &history, now, cost);
                prop_assert_eq!(tier.remaining(), after.remaining, "tier {} remaining at {}", i, now);
                prop_assert_eq!(nanos(tier.reset_after()), after.reset, "tier {} reset at {}", i, now);
                let violated = match expected {
                    Outcome::CostExceedsCapacity => cost > t.capacity(),
                    Outcome::Limited => !said[i].fits,
                    _ => false,
                };
                prop_assert_eq!(tier.is_violated(), violated, "tier {} violated", i);
                if expected == Outcome::Allowed && cost > 0 {
                    prop_assert_eq!(tier.remaining(), said[i].remaining - cost, "tier {} charged", i);
                }
            }
            consistent(&policy, &states, now, cost, &d)?;
        }
    }

    /// With shaping too: over the whole run, the admitted requests (at the instants they were
    /// let through) never exceed what the algorithm promises in any window.
    #[test]
    fn admissions_never_exceed_the_promise(trace in trace(true)) {
        let policy = trace.policy();
        let alg = policy.algorithm();
        let mut now = 0u64;
        let mut states = fresh(&policy, now);
        let mut admitted: Vec<(u64, u64)> = Vec::new();
        for step in &trace.steps {
            match *step {
                Step::Advance(by) => now += by,
                Step::Check { cost, shape } => {
                    let mode = shape.map_or(Mode::Police, Mode::Shape);
                    let d = decide(&policy, &mut states, now, cost, mode).0;
                    if d.is_allowed() && cost > 0 {
                        admitted.push((now + nanos(d.delay()), cost));
                    }
                }
            }
        }
        admitted.sort_unstable();
        for t in policy.tiers() {
            let (c, p, b) = (u128::from(t.rate.count), u128::from(t.rate.period), u128::from(t.rate.burst));
            let in_range = |lo: u128, hi: u128| -> u128 {
                admitted.iter().filter(|(x, _)| (lo..=hi).contains(&u128::from(*x))).map(|(_, k)| u128::from(*k)).sum()
            };
            for &(a, _) in &admitted {
                let a = u128::from(a);
                match alg {
                    // Rate algorithms: at most burst plus what the rate refills, in any span.
                    // Instants are whole nanoseconds rounded up from exact (fractional) slot
                    // times, each late by less than 1 ns, so a span's exact length is below
                    // its measured length + 1 ns.
                    Algorithm::Gcra | Algorithm::TokenBucket | Algorithm::LeakyBucket => {
                        for &(z, _) in admitted.iter().filter(|(z, _)| u128::from(*z) >= a) {
                            let z = u128::from(z);
                            let promise = b + (z - a + 1) * c / p;
                            prop_assert!(in_range(a, z) <= promise, "{:?}: [{}, {}]", alg, a, z);
                        }
                    }
                    // Exact over any window of one period.
                    Algorithm::SlidingLog => {
                        prop_assert!(in_range((a + 1).saturating_sub(p), a) <= c, "log window ending {}", a);
                    }
                    // At most count in each aligned window.
                    Algorithm::FixedWindow | Algorithm::SlidingCounter => {
                        let k = a / p;
                        prop_assert!(in_range(k * p, (k + 1) * p - 1) <= c, "window {}", k);
                    }
                }
            }
        }
    }
}

#[test]
fn the_references_know_the_documented_numbers() {
    // redis-cell's documented example, through the reference: capacity 16, 15 left, reset 2 s.
    let q = Quota::redis_cell(15, 30, std::time::Duration::from_secs(60));
    let r = Rate { count: q.count(), period: 60_000_000_000, burst: q.burst() };
    let said = reference(Algorithm::Gcra, r, &[(0, 1)], 0, 1);
    assert_eq!(said, Said { fits: true, remaining: 15, reset: 2_000_000_000 });
    // Fixed window: 2 per second, both used at 0.5 s: full, resets at 1 s.
    let r = Rate { count: 2, period: 1_000_000_000, burst: 2 };
    let said = reference(Algorithm::FixedWindow, r, &[(500_000_000, 2)], 600_000_000, 1);
    assert_eq!(said, Said { fits: false, remaining: 0, reset: 400_000_000 });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    /// The whole-nanosecond GCRA the in-memory store keeps in one atomic decides exactly like
    /// the scaled GCRA: same decisions, same state after charges, refunds and extra charges.
    #[test]
    fn whole_nanosecond_gcra_decides_like_the_scaled_one(
        count in 1u64..=50,
        t in 1u64..=200_000_000,
        burst in 1u64..=40,
        steps in proptest::collection::vec(
            (0u64..=300_000_000, 0u64..=45, proptest::option::of(0u64..=2_000_000_000), 0u8..4),
            1..100,
        ),
    ) {
        let period = count * t;
        let q = Quota::new(count, std::time::Duration::from_nanos(period)).with_burst(burst);
        let policy = Policy::builder("w").tier("t", q).build().unwrap();
        let rate = policy.tiers()[0].rate;
        let w = super::WholeGcra::of(rate).expect("whole interval");
        let mut now = 0u64;
        let mut states = fresh(&policy, now);
        let mut tat = 0u64;
        let mut last_charge: Option<(u64, u64)> = None;
        for (advance, cost, shape, settle) in steps {
            now += advance;
            let mode = shape.map_or(Mode::Police, Mode::Shape);
            let (expected, charges) = decide(&policy, &mut states, now, cost, mode);
            let (got, verdict) = super::decide_whole(&w, tat, now, cost, mode);
            prop_assert_eq!(&got, &expected, "at {} cost {}", now, cost);
            if let super::GcraStep::Admit { tat: new, at, .. } = verdict {
                tat = new;
                prop_assert_eq!(Some(at), charges.as_ref().map(|c| c[0].at));
                last_charge = Some((at, cost));
            }
            // Now and then settle the last admitted request at another cost.
            if let (Some((at, charged)), 1..) = (last_charge, settle) {
                let new_cost = u64::from(settle) * charged / 2;
                let alg = policy.algorithm();
                let charge = super::Charge { at, cost: charged, id: 0 };
                if new_cost < charged {
                    states[0].refund(alg, rate, charge, charged - new_cost);
                    tat = w.refund(tat, charged - new_cost);
                } else if new_cost > charged {
                    states[0].charge(alg, rate, now, at.max(now), new_cost - charged);
                    tat = w.charge(tat, at.max(now), new_cost - charged);
                }
                last_charge = None;
            }
            let (got, _) = super::decide_whole(&w, tat, now, 0, Mode::Police);
            let (expected, _) = decide(&policy, &mut states, now, 0, Mode::Police);
            prop_assert_eq!(got, expected, "status after settling at {}", now);
        }
    }
}
