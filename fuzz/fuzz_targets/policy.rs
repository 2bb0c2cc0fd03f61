//! Policy configuration and decisions from arbitrary numbers (SECURITY.md, "hostile
//! configuration"). Input: an algorithm, up to three tiers of raw `(count, period in ns,
//! burst)`, then operations (advance the clock, a request of some cost, police or shape).
//!
//! Checked: building never panics and refuses what it cannot run with an error; deciding never
//! panics; an admitted request fits every tier's capacity, a rejected one charges nothing, and a
//! limited one has a retry time.
#![no_main]

use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tollgate::clock::FakeClock;
use tollgate::key::Key;
use tollgate::store::{Check, MemoryStore};
use tollgate::{Algorithm, Outcome, Policy, Quota};

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(*b)
    }

    fn u64(&mut self) -> Option<u64> {
        let bytes: [u8; 8] = self.0.get(..8)?.try_into().ok()?;
        self.0 = &self.0[8..];
        Some(u64::from_le_bytes(bytes))
    }
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input(data);
    let Some(alg) = input.byte() else { return };
    let Some(ntiers) = input.byte() else { return };
    let mut builder = Policy::builder("fuzz").algorithm(Algorithm::ALL[usize::from(alg) % 6]);
    for i in 0..(ntiers % 4) {
        let (Some(count), Some(period), Some(burst)) = (input.u64(), input.u64(), input.u64()) else {
            return;
        };
        // Small numbers are the interesting ones; keep the raw value now and then.
        let shrink = |v: u64| if v >> 63 == 1 { v } else { v % 1000 };
        let quota = Quota::new(shrink(count), Duration::from_nanos(shrink(period).saturating_mul(1_000_000)))
            .with_burst(shrink(burst));
        builder = builder.tier(format!("t{i}"), quota);
    }
    let Ok(policy) = builder.build() else { return };
    let clock = FakeClock::new();
    let Ok(store) = MemoryStore::builder().clock(clock.clone()).build() else { return };
    let bound = store.bind_policy(&policy);
    let key = Key::Global;
    while let (Some(op), Some(arg)) = (input.byte(), input.u64()) {
        match op % 3 {
            0 => clock.advance(Duration::from_nanos(arg % 10_000_000_000)),
            op => {
                let cost = arg % 64;
                let mut check = Check::new(&key, cost);
                if op == 2 {
                    check = check.shape(Duration::from_nanos(arg >> 8));
                }
                let before = store.check_now(&bound, Check::new(&key, 0));
                let v = store.check_now(&bound, check);
                let d = v.decision;
                match d.outcome() {
                    Outcome::Allowed => {
                        assert!(policy.tiers().iter().all(|t| cost <= t.capacity()));
                    }
                    Outcome::Limited => {
                        assert!(d.retry_after().is_some_and(|r| !r.is_zero()));
                        let after = store.check_now(&bound, Check::new(&key, 0));
                        assert_eq!(before.decision.tiers(), after.decision.tiers(), "a rejection charged");
                    }
                    Outcome::CostExceedsCapacity => {
                        assert!(policy.tiers().iter().any(|t| cost > t.capacity()));
                        assert_eq!(d.retry_after(), None);
                    }
                    _ => {}
                }
            }
        }
    }
});
