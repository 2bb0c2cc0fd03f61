//! Hostile configuration (SECURITY.md, "hostile configuration"): policies built from arbitrary
//! numbers and names either build or fail with a typed error, never panic; the policies that
//! build decide without panicking and keep their invariants. The always-on twin of the
//! `fuzz/` target `policy`.

use std::time::Duration;

use proptest::prelude::*;
use tollgate::clock::FakeClock;
use tollgate::key::Key;
use tollgate::quota::{MAX_COUNT, MAX_SLIDING_LOG};
use tollgate::store::Check;
use tollgate::{Algorithm, ConfigError, MemoryStore, Outcome, Policy, Quota};

fn number() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => 0u64..=50,
        1 => prop::sample::select(vec![
            0, 1, MAX_SLIDING_LOG, MAX_SLIDING_LOG + 1, MAX_COUNT, MAX_COUNT + 1, u64::MAX,
        ]),
        1 => any::<u64>(),
    ]
}

fn period() -> impl Strategy<Value = Duration> {
    prop_oneof![
        3 => (1u64..=5_000).prop_map(Duration::from_millis),
        1 => any::<u64>().prop_map(Duration::from_nanos),
        1 => prop::sample::select(vec![Duration::ZERO, Duration::from_nanos(1), Duration::MAX]),
    ]
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-z]{1,8}",
        1 => prop::sample::select(vec!["", " ", "\"", "\\", "é", "a\u{0}b", "\t", "{}|%"])
            .prop_map(str::to_owned),
    ]
}

/// `(name, count, period, burst)`: hostile, or plausible (so that policies build and decide).
fn tier() -> impl Strategy<Value = (String, u64, Duration, u64)> {
    prop_oneof![
        (name(), number(), period(), number()),
        ("[a-z]{1,8}", 1u64..=50, (1u64..=5_000).prop_map(Duration::from_millis), 0u64..=3)
            .prop_map(|(n, c, p, extra)| (n, c, p, if extra == 0 { c } else { c + extra })),
    ]
}

#[derive(Debug, Clone)]
enum Op {
    Advance(u64),
    Check { cost: u64, shape: Option<u64> },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u64..=10_000_000_000).prop_map(Op::Advance),
        (number(), proptest::option::of(number()))
            .prop_map(|(cost, shape)| Op::Check { cost, shape }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn any_configuration_builds_or_is_refused_and_then_decides_sanely(
        policy_name in name(),
        algorithm in prop::sample::select(Algorithm::ALL.to_vec()),
        tiers in proptest::collection::vec(tier(), 0..4),
        ops in proptest::collection::vec(op(), 0..30),
    ) {
        let mut builder = Policy::builder(policy_name).algorithm(algorithm);
        for (name, count, period, burst) in &tiers {
            builder = builder.tier(name.clone(), Quota::new(*count, *period).with_burst(*burst));
        }
        let policy = match builder.build() {
            Ok(p) => p,
            // Refusals are typed and say why.
            Err(e) => {
                prop_assert!(!e.to_string().is_empty());
                prop_assert!(!matches!(e, ConfigError::UnsupportedByStore(_)));
                return Ok(());
            }
        };
        let clock = FakeClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let status = |store: &MemoryStore| {
            let c = Check { policy: &policy, key: &Key::Global, cost: 0, max_delay: None, reserve: false };
            store.check_now(c).unwrap().decision.tiers().to_vec()
        };
        for op in ops {
            match op {
                Op::Advance(by) => clock.advance(Duration::from_nanos(by)),
                Op::Check { cost, shape } => {
                    let before = status(&store);
                    let max_delay = shape.map(Duration::from_nanos);
                    let c = Check { policy: &policy, key: &Key::Global, cost, max_delay, reserve: false };
                    let d = store.check_now(c).unwrap().decision;
                    let fits = policy.tiers().iter().all(|t| cost <= t.capacity());
                    match d.outcome() {
                        Outcome::Allowed => prop_assert!(fits),
                        Outcome::Limited => {
                            prop_assert!(d.retry_after().is_some_and(|r| !r.is_zero()));
                            prop_assert_eq!(before, status(&store), "a rejection charged");
                        }
                        Outcome::CostExceedsCapacity => {
                            prop_assert!(!fits);
                            prop_assert_eq!(d.retry_after(), None);
                            prop_assert_eq!(before, status(&store), "a rejection charged");
                        }
                        other => prop_assert!(false, "unknown outcome {:?}", other),
                    }
                }
            }
        }
    }
}
