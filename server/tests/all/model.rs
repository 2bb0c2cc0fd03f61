//! Generated traces against a model: any sequence of requests of one or two descriptors, any
//! hits, any steps of the clock. Invariant: each answer (overall code, each descriptor's code
//! and remaining) is the model's, where a window admits a descriptor while its count plus the
//! hits stays within the limit, and a refused request changes no count.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use tollgate::clock::FakeClock;
use tollgate_server::config::{Config, LoadOptions, Source};
use tollgate_server::engine::Backends;
use tollgate_server::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tollgate_server::service::{Options, RateLimiter};

use crate::support::*;

const CONFIG: &str = "
domain: m
descriptors:
  - key: a
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: b
    rate_limit: {unit: second, requests_per_unit: 3}
";

fn limit(key: &str) -> (u64, u64) {
    if key == "a" { (5, 60) } else { (3, 1) }
}

#[derive(Debug, Clone)]
struct Step {
    descriptors: Vec<(&'static str, &'static str)>,
    hits: u32,
    advance_ms: u64,
}

fn step() -> impl Strategy<Value = Step> {
    let d = (prop::sample::select(vec!["a", "b"]), prop::sample::select(vec!["x", "y"]));
    (
        prop::collection::vec(d, 1..=2),
        0u32..5,
        prop::sample::select(vec![0u64, 0, 0, 250, 1_000, 30_000]),
    )
        .prop_map(|(descriptors, hits, advance_ms)| Step { descriptors, hits, advance_ms })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn answers_match_the_model(steps in prop::collection::vec(step(), 1..60)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let clock = FakeClock::new();
            clock.set(T0 * 1_000_000_000);
            let backends = Arc::new(Backends::memory_with_clock(clock.clone()));
            let sources = [Source { name: "m.yaml".into(), text: CONFIG.into() }];
            let config = Config::build(&sources, LoadOptions::default(), &backends).unwrap();
            let service = RateLimiter::new(config, backends, Options::default());
            let mut counts: HashMap<(String, String, u64), u64> = HashMap::new();
            let mut now_ms = T0 * 1_000;
            for s in steps {
                clock.advance(Duration::from_millis(s.advance_ms));
                now_ms += s.advance_ms;
                let mut r = req("m", s.descriptors.iter().map(|(k, v)| desc(&[(k, v)])).collect());
                r.hits_addend = s.hits;
                let got = service.should_rate_limit(&r).await.unwrap();
                let hits = u64::from(s.hits.max(1));
                let mut trial = counts.clone();
                let mut want = Vec::new();
                for (k, v) in &s.descriptors {
                    let (max, unit) = limit(k);
                    let window = now_ms / 1_000 / unit;
                    let c = trial.entry(((*k).into(), (*v).into(), window)).or_insert(0);
                    if *c + hits <= max {
                        *c += hits;
                        want.push((Code::Ok, max - *c));
                    } else {
                        want.push((Code::OverLimit, 0));
                    }
                }
                let refused = want.iter().any(|(c, _)| *c == Code::OverLimit);
                if !refused {
                    counts = trial;
                }
                let overall = if refused { Code::OverLimit } else { Code::Ok };
                let got_statuses: Vec<(Code, u64)> =
                    got.statuses.iter().map(|st| (code(st.code), u64::from(st.limit_remaining))).collect();
                prop_assert_eq!((code(got.overall_code), got_statuses), (overall, want), "step {:?}", s);
            }
            Ok(())
        })?;
    }
}
