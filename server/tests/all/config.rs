//! Configuration: envoyproxy/ratelimit's documented files load as they are, bad files are
//! refused with file:line:column, a directory is watched and reloaded.

use std::time::Duration;

use tollgate_server::config::{Config, ConfigError, LoadOptions, Source};
use tollgate_server::engine::Backends;
use tollgate_server::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;

use crate::support::*;

fn build(files: &[(&str, &str)]) -> Result<Config, ConfigError> {
    let sources: Vec<Source> =
        files.iter().map(|(n, t)| Source { name: (*n).into(), text: (*t).into() }).collect();
    Config::build(&sources, LoadOptions::default(), &Backends::memory())
}

fn error(files: &[(&str, &str)]) -> String {
    build(files).unwrap_err().to_string()
}

#[test]
fn every_example_of_the_reference_documentation_loads() {
    let dir = format!("{}/tests/data/reference", env!("CARGO_MANIFEST_DIR"));
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.retain(|n| n.ends_with(".yaml"));
    names.sort();
    assert_eq!(names.len(), 16);
    let expected_limits = [2, 2, 2, 1, 1, 2, 2, 2, 2, 1, 1, 1, 1, 1, 2, 1];
    for (name, limits) in names.iter().zip(expected_limits) {
        let text = std::fs::read_to_string(format!("{dir}/{name}")).unwrap();
        let config = build(&[(name, &text)]).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(config.limits, limits, "{name}");
    }
}

#[test]
fn bad_files_are_refused_with_their_line_and_column() {
    assert_eq!(
        error(&[(
            "a.yaml",
            "domain: d\ndescriptors:\n  - key: k\n    rate_limt:\n      unit: second\n"
        )]),
        "a.yaml:3:5: descriptors[0]: unknown key 'rate_limt'"
    );
    assert_eq!(
        error(&[(
            "b.yaml",
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 1\n"
        )]),
        "b.yaml:5:7: descriptors[0].rate_limit: invalid rate limit unit 'fortnight'"
    );
    assert_eq!(
        error(&[("c.yaml", "domain: d\ndescriptors:\n  - key: k\n  - key: k\n")]),
        "c.yaml:3:3: descriptors: duplicate descriptor composite key 'k'"
    );
    assert_eq!(
        error(&[("d.yaml", "descriptors: []\n")]),
        "d.yaml:1:1: config file cannot have empty domain"
    );
    assert_eq!(
        error(&[(
            "e.yaml",
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unlimited: true\n      unit: second\n"
        )]),
        "e.yaml:5:7: descriptors[0].rate_limit: should not specify rate limit unit when unlimited"
    );
    assert_eq!(
        error(&[("f.yaml", "domain: d\n"), ("g.yaml", "domain: d\n")]),
        "g.yaml:1:1: duplicate domain 'd' in config file"
    );
    assert!(error(&[("h.yaml", "domain: d\ndescriptors: [\n")]).starts_with("h.yaml:3:1: "));
    // A key the reference knows, in a place where it means nothing, is ignored as it ignores it.
    build(&[("i.yaml", "domain: d\ndescriptors:\n  - key: k\n    unit: second\n")]).unwrap();
}

const BASE: &str =
    "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 3}\n";

#[test]
fn companion_files_are_checked_against_the_reference_files() {
    let ext = "domain: d\nlimits:\n  - descriptor: [k]\n    algorithm: gcra\n";
    build(&[("a.yaml", BASE), ("a.tollgate.yaml", ext)]).unwrap();
    assert_eq!(
        error(&[
            ("a.yaml", BASE),
            ("a.tollgate.yaml", "domain: d\nlimits:\n  - descriptor: [k=v]\n")
        ]),
        "a.tollgate.yaml:3:5: limits[0]: descriptor [\"k=v\"] has no rate_limit in the domain's config files"
    );
    assert_eq!(
        error(&[
            ("a.yaml", BASE),
            ("a.tollgate.yaml", "domain: d\nlimits:\n  - descriptor: [k]\n    algorithm: gcrb\n")
        ]),
        "a.tollgate.yaml:3:5: limits[0]: unknown algorithm 'gcrb': expected gcra, token_bucket, leaky_bucket, fixed_window, sliding_log or sliding_counter"
    );
    assert_eq!(
        error(&[
            ("a.yaml", BASE),
            (
                "a.tollgate.yaml",
                "domain: d\nlimits:\n  - descriptor: [k]\n    tiers: [{requests_per_unit: 0, unit: second}]\n"
            )
        ]),
        "a.tollgate.yaml:3:5: limits[0]: tier `d.k`: count must be at least 1"
    );
}

#[tokio::test]
async fn a_watched_directory_is_reloaded_and_a_bad_file_refused() {
    let mut s = serve(&[("config.yaml", BASE)], &["--watch", "10ms"]).await;
    let r = one("d", &[("k", "a")]);
    assert_eq!(admitted(&mut s, &r, 2).await, 2);
    // A bad file: refused, the running limits stay (and keep their counts).
    std::fs::write(s.dir.join("config.yaml"), "domain: d\ndescriptors: [\n").unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(admitted(&mut s, &r, 2).await, 1);
    // A good one: applied; an unchanged limit keeps its count, a new one starts.
    std::fs::write(
        s.dir.join("config.yaml"),
        format!("{BASE}  - key: n\n    rate_limit: {{unit: minute, requests_per_unit: 1}}\n"),
    )
    .unwrap();
    let n = one("d", &[("n", "a")]);
    let mut waited = 0;
    while s.call(n.clone()).await.statuses[0].current_limit.is_none() {
        assert!(waited < 100, "the change was not applied");
        tokio::time::sleep(Duration::from_millis(20)).await;
        waited += 1;
    }
    assert_eq!(admitted(&mut s, &r, 1).await, 0);
    assert_eq!(s.codes(n).await.0, Code::OverLimit);
}

#[tokio::test]
async fn companion_files_may_live_apart() {
    let apart = temp_dir();
    std::fs::write(
        apart.join("d.tollgate.yaml"),
        "domain: d\nlimits:\n  - descriptor: [k]\n    algorithm: gcra\n    tiers: [{name: burst, requests_per_unit: 3, unit: minute, burst: 1}]\n",
    )
    .unwrap();
    let mut s = serve(&[("config.yaml", BASE)], &["--extensions", apart.to_str().unwrap()]).await;
    // GCRA with a burst of 1: one now, the next 20 s later (the fixed window would admit 3).
    let r = one("d", &[("k", "a")]);
    assert_eq!(admitted(&mut s, &r, 3).await, 1);
    assert_eq!(s.call(r.clone()).await.statuses[0].current_limit.as_ref().unwrap().name, "burst");
    s.advance(Duration::from_secs(20));
    assert_eq!(admitted(&mut s, &r, 2).await, 1);
}
