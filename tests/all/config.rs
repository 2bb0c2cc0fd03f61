//! Hostile configuration (SECURITY.md, "hostile configuration"): policies built from arbitrary
//! numbers and names either build or fail with a typed error, never panic; the policies that
//! build decide without panicking and keep their invariants. The always-on twin of the
//! `fuzz/` target `policy`.

use std::time::Duration;

use proptest::prelude::*;
use tollgate::clock::FakeClock;
use tollgate::key::Key;
use tollgate::store::{Check, MemoryStore};
use tollgate::{Algorithm, ConfigError, Outcome, Policy, Quota};

fn number() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => 0u64..=50,
        1 => prop::sample::select(vec![
            0, 1, Quota::MAX_SLIDING_LOG, Quota::MAX_SLIDING_LOG + 1, Quota::MAX_COUNT, Quota::MAX_COUNT + 1, u64::MAX,
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
                let unsupported = matches!(e, ConfigError::UnsupportedByStore { .. });
                prop_assert!(!unsupported, "a policy refused for a store: {}", e);
                return Ok(());
            }
        };
        let clock = FakeClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let bound = store.bind_policy(&policy);
        let status = |store: &MemoryStore| {
            store.check_now(&bound, Check::new(&Key::Global, 0)).decision.tiers().to_vec()
        };
        for op in ops {
            match op {
                Op::Advance(by) => clock.advance(Duration::from_nanos(by)),
                Op::Check { cost, shape } => {
                    let before = status(&store);
                    let mut c = Check::new(&Key::Global, cost);
                    if let Some(shape) = shape {
                        c = c.shape(Duration::from_nanos(shape));
                    }
                    let d = store.check_now(&bound, c).decision;
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

#[test]
fn every_configuration_error_names_what_is_wrong() {
    let tier = |q| Policy::builder("p").tier("t", q).build().unwrap_err().to_string();
    assert_eq!(tier(Quota::per_second(0)), "tier `t`: count must be at least 1");
    assert_eq!(tier(Quota::new(1, Duration::ZERO)), "tier `t`: period must be at least 1 ns");
    assert_eq!(tier(Quota::per_second(1).with_burst(0)), "tier `t`: burst must be at least 1");
    assert_eq!(
        tier(Quota::per_second(Quota::MAX_COUNT + 1)),
        format!(
            "tier `t`: count {} exceeds the maximum {}",
            Quota::MAX_COUNT + 1,
            Quota::MAX_COUNT
        )
    );
    let window =
        |alg, q| Policy::builder("p").algorithm(alg).tier("t", q).build().unwrap_err().to_string();
    assert_eq!(
        window(Algorithm::FixedWindow, Quota::per_second(5).with_burst(6)),
        "tier `t`: the fixed_window algorithm admits `count` per window; burst 6 != count 5"
    );
    assert_eq!(
        window(Algorithm::SlidingLog, Quota::per_second(Quota::MAX_SLIDING_LOG + 1)),
        format!(
            "tier `t`: sliding log limit {} exceeds {}; use the sliding window counter for large limits",
            Quota::MAX_SLIDING_LOG + 1,
            Quota::MAX_SLIDING_LOG
        )
    );
    let q = Quota::per_second(1);
    assert_eq!(
        Policy::builder("p").tier("t", q).tier("t", q).build().unwrap_err(),
        ConfigError::DuplicateTier("t".into())
    );
    assert_eq!(Policy::builder("p").build().unwrap_err(), ConfigError::NoTiers("p".into()));
    assert_eq!(
        Policy::builder("p").tier("é", q).build().unwrap_err(),
        ConfigError::BadName("é".into())
    );

    // The layer's settings.
    let policy = Policy::single("p", Quota::per_second(5)).unwrap();
    let layer = || tollgate::RateLimitLayer::builder(policy.clone());
    assert_eq!(
        layer().cost(6).build().unwrap_err().to_string(),
        "cost: 6 units exceed the capacity of tier `p` (5 units)"
    );
    assert!(matches!(
        layer().shape(Duration::from_millis(10)).max_waiters(0).build().unwrap_err(),
        ConfigError::Invalid { setting: "max_waiters", .. }
    ));
    assert!(matches!(
        layer().tarpit(Duration::from_millis(10)).max_waiters(0).build().unwrap_err(),
        ConfigError::Invalid { setting: "max_waiters", .. }
    ));
    // The memory store's.
    for (builder, setting) in [
        (MemoryStore::builder().max_keys(0), "max_keys"),
        (MemoryStore::builder().sweep_interval(Duration::ZERO), "sweep_interval"),
        (MemoryStore::builder().shards(0), "shards"),
    ] {
        let err = builder.build().unwrap_err();
        assert!(matches!(err, ConfigError::Invalid { setting: s, .. } if s == setting), "{err}");
    }
    // Trusted proxies.
    let err = tollgate::key::ClientIp::from_cidrs(["10.0.0.0/8", "ten"]).unwrap_err();
    assert_eq!(err.to_string(), "trusted proxies: \"ten\" is not a CIDR or an address");
}
