//! Every tier kind and layer setting in the configuration file: each kind read from TOML is the
//! policy built in code (and decides like it on the same fake-clock trace), the SaaS plan of
//! the configuration guide is read as printed, each bad value is refused at its file, line,
//! column and field, and the rule settings that took a closure or an option in code act when
//! served from a file.
#![cfg(feature = "config")]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use crate::support::config_files::Says::{At, Is};
use crate::support::config_files::refused;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use proptest::prelude::*;
use tollgate::clock::FakeClock;
use tollgate::config::{ConfigFileError, LimitsConfig, LimitsLayer};
use tollgate::key::Key;
use tollgate::store::{Check, MemoryStore};
use tollgate::{
    Algorithm, Calendar, CalendarPeriod, Concurrency, ConfigError, Decision, Penalty, Policy,
    Quota, RequestBody, Reserve, Unit, Usage,
};
use tower::{Layer, ServiceExt, service_fn};

/// Nanoseconds since the epoch of an RFC 3339 instant.
fn at(s: &str) -> u64 {
    let ts: jiff::Timestamp = s.parse().unwrap();
    u64::try_from(ts.as_nanosecond()).unwrap()
}

fn load(text: &str) -> LimitsConfig {
    LimitsConfig::from_toml(text, "tollgate.toml").unwrap_or_else(|e| panic!("{e}"))
}

/// Reads `text` as `tollgate.toml` and returns its error.
fn error(text: &str) -> ConfigFileError {
    LimitsConfig::from_toml(text, "tollgate.toml").expect_err("the file should be refused")
}

/// The error's place and field.
fn place(e: &ConfigFileError) -> (Option<usize>, Option<usize>, Option<&str>) {
    (e.line(), e.column(), e.field())
}

/// Policy `p` with one rate tier, `r` (5 a minute), and `fields` besides, in a file.
fn rate_tier(fields: &str) -> String {
    format!("[policies.p]\ntiers = [{{ name = \"r\", count = 5, period = \"1m\", {fields} }}]\n")
}

/// Asserts that `config` reads `policy` (by its name) as built in code, and that it decides a
/// trace of 400 steps alike, admitting some and refusing some.
fn reads_as(config: &LimitsConfig, policy: &Policy) {
    let read = config.policy(policy.name()).unwrap();
    assert_eq!(read, policy);
    let decisions = same_decisions(read, policy, "2025-03-30T00:30:00Z", 400);
    // The trace exercises the tiers: both admissions and refusals.
    assert!(decisions.iter().any(Decision::is_allowed), "{}", policy.name());
    assert!(decisions.iter().any(|d| !d.is_allowed()), "{}", policy.name());
}

/// The ```toml block that follows `heading` in `doc`, with the `//! ` of a module's docs
/// removed.
fn toml_block(doc: &str, heading: &str) -> String {
    let from = doc.find(heading).unwrap_or_else(|| panic!("no {heading:?}"));
    let open = doc[from..].find("```toml\n").expect("a TOML block") + from + "```toml\n".len();
    let len = doc[open..].find("```\n").expect("its end");
    doc[open..open + len]
        .lines()
        .map(|l| match l.strip_prefix("//!") {
            Some(rest) => rest.strip_prefix(' ').unwrap_or(rest),
            None => l,
        })
        .map(|l| format!("{l}\n"))
        .collect()
}

/// Runs the same trace on `a` and `b`, each bound to a memory store of its own on a fake clock
/// starting at `start`: checks of one request with a body of various sizes, holding slots of
/// concurrency tiers and releasing them out of order, with the clock moving between them in
/// steps from a millisecond to a few days. Returns the decisions, after asserting that they
/// are the same.
fn same_decisions(a: &Policy, b: &Policy, start: &str, steps: usize) -> Vec<Decision> {
    let run = |policy: &Policy| {
        let clock = FakeClock::new();
        clock.set(at(start));
        let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let bound = store.bind_policy(policy);
        let mut held = Vec::new();
        let mut decisions = Vec::new();
        // A fixed xorshift sequence: the same trace for both policies, and on every run.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..steps {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = Key::text(if x % 5 == 0 { "acme" } else { "bob" });
            let bytes = [0, 1, 700, 65_536, 40_000_000][(x >> 8) as usize % 5];
            let costs = policy.costs(1, Some(bytes));
            let v = store.check_now(&bound, Check::new(&key, 1).with_costs(&costs));
            if let Some(ticket) = v.ticket {
                held.push(ticket);
            }
            decisions.push(v.decision);
            if (x >> 16) % 3 == 0 && !held.is_empty() {
                let i = (x >> 20) as usize % held.len();
                drop(held.swap_remove(i));
            }
            let step =
                [1, 250, 60_000, 3_600_000, 86_400_000, 3 * 86_400_000][(x >> 24) as usize % 6];
            clock.advance(Duration::from_millis(step));
        }
        decisions
    };
    let (da, db) = (run(a), run(b));
    for (i, (x, y)) in da.iter().zip(&db).enumerate() {
        assert_eq!(x, y, "step {i}: {} and {} decide differently", a.name(), b.name());
    }
    da
}

// ---------------------------------------------------------------------------------------------
// Each kind, from the file and from code.

/// Every kind, with every field it takes, against the builder calls it stands for.
#[test]
fn every_tier_kind_reads_as_the_policy_built_in_code() {
    let config = load(
        r#"
[policies.rates]
algorithm = "token_bucket"
tiers = [
    { name = "per-second", count = 10, period = "1s", burst = 25 },
    { name = "upload-bytes", kind = "rate", count = 1_000_000, period = "1s", unit = "request_bytes" },
    { name = "download-bytes", count = 50_000_000, period = "1m", unit = "response_bytes" },
    { name = "tokens", count = 100_000, period = "1h", unit = "reported" },
    { name = "requests", count = 5, period = "1h 30m", unit = "requests" },
]

[policies.slots]
tiers = [
    { name = "default", kind = "concurrency", max = 4 },
    { name = "leased", kind = "concurrency", max = 2, lease = "1m", typical_hold = "250ms" },
]

[policies.calendars]
algorithm = "sliding_log"
tiers = [
    { name = "minute", kind = "calendar", count = 3, period = "minute" },
    { name = "hour", kind = "calendar", count = 20, period = "hour", time_zone = "Asia/Kolkata" },
    { name = "day", kind = "calendar", count = 40, period = "day", time_zone = "America/New_York" },
    { name = "week", kind = "calendar", count = 100, period = "week", time_zone = "UTC" },
    { name = "month", kind = "calendar", count = 300, period = "month", time_zone = "Europe/Berlin" },
    { name = "year", kind = "calendar", count = 1000, period = "year", unit = "requests" },
    { name = "daily-upload", kind = "calendar", count = 100_000_000, period = "day", unit = "request_bytes" },
    { name = "daily-tokens", kind = "calendar", count = 30, period = "day", time_zone = "Europe/Berlin", unit = "reported" },
    { name = "hourly-download", kind = "calendar", count = 20, period = "hour", unit = "response_bytes" },
]
"#,
    );
    let rates = Policy::builder("rates")
        .algorithm(Algorithm::TokenBucket)
        .tier("per-second", Quota::per_second(10).with_burst(25))
        .tier("upload-bytes", Quota::per_second(1_000_000).counting(Unit::RequestBytes))
        .tier("download-bytes", Quota::per_minute(50_000_000).counting(Unit::ResponseBytes))
        .tier("tokens", Quota::per_hour(100_000).counting(Unit::Reported))
        .tier("requests", Quota::new(5, Duration::from_secs(5400)))
        .build()
        .unwrap();
    let slots = Policy::builder("slots")
        .concurrency("default", Concurrency::new(4))
        .concurrency(
            "leased",
            Concurrency::new(2)
                .with_ttl(Duration::from_secs(60))
                .with_typical_hold(Duration::from_millis(250)),
        )
        .build()
        .unwrap();
    let calendars = Policy::builder("calendars")
        .algorithm(Algorithm::SlidingLog)
        .calendar("minute", Calendar::per_minute(3))
        .calendar("hour", Calendar::per_hour(20).in_time_zone("Asia/Kolkata"))
        .calendar("day", Calendar::per_day(40).in_time_zone("America/New_York"))
        .calendar("week", Calendar::per_week(100).in_time_zone("UTC"))
        .calendar("month", Calendar::new(300, CalendarPeriod::Month).in_time_zone("Europe/Berlin"))
        .calendar("year", Calendar::per_year(1000).counting(Unit::Requests))
        .calendar("daily-upload", Calendar::per_day(100_000_000).counting(Unit::RequestBytes))
        .calendar(
            "daily-tokens",
            Calendar::per_day(30).in_time_zone("Europe/Berlin").counting(Unit::Reported),
        )
        .calendar("hourly-download", Calendar::per_hour(20).counting(Unit::ResponseBytes))
        .build()
        .unwrap();
    let expected = [rates, slots, calendars];
    assert_eq!(config.policies().cloned().collect::<Vec<_>>(), expected);
    for policy in &expected {
        reads_as(&config, policy);
    }
}

/// A penalty box (`block`, `block_after`, `block_window`) on a rate and a calendar tier reads
/// as the policy built with `PolicyBuilder::penalty`, and decides like it; its settings are
/// checked at their place.
#[test]
fn a_penalty_box_reads_as_the_policy_built_in_code() {
    let config = load(
        r#"
[policies.login]
[[policies.login.tiers]]
name = "per-minute"
count = 2
period = "1m"
block = "15m"
[[policies.login.tiers]]
name = "daily"
kind = "calendar"
count = 5
period = "day"
block = "1h"
block_after = 3
block_window = "10m"
"#,
    );
    let minute = Duration::from_secs(60);
    let login = Policy::builder("login")
        .tier("per-minute", Quota::per_minute(2))
        .penalty("per-minute", Penalty::new(15 * minute))
        .calendar("daily", Calendar::per_day(5))
        .penalty("daily", Penalty::new(60 * minute).after(3, 10 * minute))
        .build()
        .unwrap();
    reads_as(&config, &login);

    let e = error(&rate_tier("block_after = 2"));
    assert_eq!(place(&e), (Some(2), Some(64), Some("policies.p.tiers[0].block_after")));
    assert_eq!(
        e.message(),
        "`block_after` sets a penalty box, which needs `block` (how long a breach blocks)"
    );
    let e = error(&rate_tier("block = \"1m\", block_after = 2"));
    assert_eq!(place(&e), (Some(2), Some(19), Some("policies.p.tiers[0].block_window")));
    let e = error(
        "[policies.p]\ntiers = [{ name = \"c\", kind = \"concurrency\", max = 2, block = \"1m\" }]\n",
    );
    assert_eq!(place(&e).2, Some("policies.p.tiers[0].block"));
    assert!(e.message().starts_with("a concurrency tier has no `block` (rate and calendar"));
    // Out of range (the builder's refusal), at the field refused (tests/all/config_errors.rs
    // has every field).
    let e = error(&rate_tier("block = \"1m\", block_after = 5000, block_window = \"1m\""));
    assert_eq!(place(&e), (Some(2), Some(78), Some("policies.p.tiers[0].block_after")));
    assert!(e.to_string().contains("penalty"), "{e}");
}

/// Reserved capacity (`reserve_critical`, `reserve_standard`) on a rate tier reads as the
/// policy built with `PolicyBuilder::reserve`, and decides like it; a reserve the builder
/// refuses is refused at its field, and a calendar tier has no reserve.
#[test]
fn a_reserve_reads_as_the_policy_built_in_code() {
    let config = load(
        "[policies.api]\ntiers = [{ name = \"hour\", count = 4, period = \"1h\", reserve_critical = 1, \
         reserve_standard = 1 }]\n",
    );
    let api = Policy::builder("api")
        .tier("hour", Quota::per_hour(4))
        .reserve("hour", Reserve::new().critical(1).standard(1))
        .build()
        .unwrap();
    reads_as(&config, &api);
    // One field alone reserves that much, the other nothing.
    let config = load(&rate_tier("reserve_standard = 1"));
    assert_eq!(config.policy("p").unwrap().tiers()[0].reserve(), Some(Reserve::new().standard(1)));

    let e = error(&rate_tier("reserve_critical = 5"));
    assert_eq!(place(&e).2, Some("policies.p.tiers[0].reserve_critical"));
    assert_eq!(
        e.message(),
        "tier `r`: reserve: critical 5 + standard 0 must be less than the capacity 5"
    );
    let e = error(
        "[policies.p]\nalgorithm = \"token_bucket\"\ntiers = [{ name = \"r\", count = 5, period = \"1m\", reserve_standard = 1 }]\n",
    );
    assert_eq!(place(&e).2, Some("policies.p.tiers[0].reserve_standard"));
    assert!(e.message().ends_with("reserved capacity runs on gcra only, not token_bucket"), "{e}");
    let e = error(
        "[policies.p]\ntiers = [{ name = \"d\", kind = \"calendar\", count = 5, period = \"day\", reserve_critical = 1 }]\n",
    );
    assert_eq!(place(&e).2, Some("policies.p.tiers[0].reserve_critical"));
    assert!(e.message().starts_with("a calendar tier has no `reserve_critical`"), "{e}");
}

/// A field of another kind, or a kind's required field left out, is refused at its place.
#[test]
fn a_field_of_another_kind_is_refused_where_it_is() {
    let e = error(
        "[policies.p]\n[[policies.p.tiers]]\nname = \"in-flight\"\nkind = \"concurrency\"\nmax = 4\nburst = 8\n",
    );
    assert_eq!(
        e.to_string(),
        "tollgate.toml:6:9: policies.p.tiers[0].burst: a concurrency tier has no `burst` (rate \
         tiers have it); it takes max, lease, typical_hold"
    );
    let e = error(
        "[policies.p]\ntiers = [{ name = \"m\", kind = \"calendar\", count = 5, period = \"month\", lease = \"1m\" }]\n",
    );
    assert_eq!(place(&e), (Some(2), Some(80), Some("policies.p.tiers[0].lease")));
    assert_eq!(
        e.message(),
        "a calendar tier has no `lease` (concurrency tiers have it); it takes count, period, \
         time_zone, unit, block, block_after, block_window"
    );
    let e = error(
        "[policies.p]\ntiers = [{ name = \"r\", count = 5, period = \"1m\", time_zone = \"Europe/Berlin\" }]\n",
    );
    assert_eq!(place(&e), (Some(2), Some(62), Some("policies.p.tiers[0].time_zone")));
    assert!(e.message().starts_with("a rate tier has no `time_zone` (calendar tiers have it)"));
    // `count` on a concurrency tier: the limit is its `max`.
    let e = error("[policies.p]\ntiers = [{ name = \"c\", kind = \"concurrency\", count = 4 }]\n");
    assert_eq!(place(&e), (Some(2), Some(54), Some("policies.p.tiers[0].count")));
    // `unit` on a concurrency tier.
    let e = error(
        "[policies.p]\ntiers = [{ name = \"c\", kind = \"concurrency\", max = 4, unit = \"request_bytes\" }]\n",
    );
    assert_eq!(
        e.message(),
        "a concurrency tier has no `unit` (rate and calendar tiers have it); it takes max, \
         lease, typical_hold"
    );

    // Missing fields: named, at the tier's name.
    let e = error("[policies.p]\ntiers = [{ name = \"c\", kind = \"concurrency\" }]\n");
    assert_eq!(
        e.to_string(),
        "tollgate.toml:2:19: policies.p.tiers[0].max: missing field `max`: a concurrency tier \
         needs it"
    );
    let e = error("[policies.p]\ntiers = [{ name = \"r\", count = 5 }]\n");
    assert_eq!(place(&e), (Some(2), Some(19), Some("policies.p.tiers[0].period")));
    assert_eq!(e.message(), "missing field `period`: a rate tier needs it");
    let e = error(
        "[policies.p]\ntiers = [{ name = \"m\", kind = \"calendar\", period = \"month\" }]\n",
    );
    assert_eq!(place(&e), (Some(2), Some(19), Some("policies.p.tiers[0].count")));
    // An unknown kind: at its value.
    let e = error("[policies.p]\ntiers = [{ name = \"w\", kind = \"window\", count = 5 }]\n");
    assert_eq!(place(&e), (Some(2), Some(31), Some("policies.p.tiers[0].kind")));
    assert!(e.message().starts_with("unknown variant `window`, expected one of"), "{e}");
    // An unknown field: the schema's own error.
    let e =
        error("[policies.p]\ntiers = [{ name = \"r\", count = 5, period = \"1s\", bursts = 9 }]\n");
    assert_eq!(place(&e), (Some(2), Some(50), Some("policies.p.tiers[0].bursts")));
}

/// Each value the builders refuse points at its field: a zero count or `max`, an unknown time
/// zone, a lease out of range, periods of the wrong grammar for the kind, an unknown unit.
#[test]
fn bad_values_of_each_kind_are_refused_at_their_field() {
    let tier =
        |fields: &str| format!("[policies.p]\n[[policies.p.tiers]]\nname = \"t\"\n{fields}\n");

    // An unknown time zone: the builder's typed error, at `time_zone`.
    let e = error(&tier(
        "kind = \"calendar\"\ncount = 10000\nperiod = \"month\"\ntime_zone = \"Europe/Atlantis\"",
    ));
    assert_eq!(place(&e), (Some(7), Some(13), Some("policies.p.tiers[0].time_zone")));
    assert!(e.message().starts_with("tier `t`: unknown time zone \"Europe/Atlantis\": "), "{e}");
    let source = std::error::Error::source(&e).unwrap().downcast_ref::<ConfigError>().unwrap();
    assert!(
        matches!(source, ConfigError::UnknownTimeZone { tier, zone, .. } if tier == "t" && zone == "Europe/Atlantis")
    );

    // Zero counts.
    let e = error(&tier("kind = \"calendar\"\ncount = 0\nperiod = \"day\""));
    assert_eq!(
        e.to_string(),
        "tollgate.toml:5:9: policies.p.tiers[0].count: tier `t`: count must be at least 1"
    );
    let e = error(&tier("kind = \"concurrency\"\nmax = 0"));
    assert_eq!(
        e.to_string(),
        "tollgate.toml:5:7: policies.p.tiers[0].max: tier `t`: count must be at least 1"
    );
    assert_eq!(
        std::error::Error::source(&e).unwrap().downcast_ref::<ConfigError>(),
        Some(&ConfigError::ZeroCount { tier: "t".into() })
    );
    let e = error(&tier("kind = \"concurrency\"\nmax = 4294967296"));
    assert_eq!(place(&e), (Some(5), Some(7), Some("policies.p.tiers[0].max")));
    assert_eq!(e.message(), "tier `t`: max 4294967296 exceeds the maximum 4294967295");
    let e = error(&tier("count = 4294967296\nperiod = \"1d\"\nunit = \"request_bytes\""));
    assert_eq!(place(&e), (Some(4), Some(9), Some("policies.p.tiers[0].count")));

    // A lease out of range.
    let e = error(&tier("kind = \"concurrency\"\nmax = 4\nlease = \"0s\""));
    assert_eq!(place(&e), (Some(6), Some(9), Some("policies.p.tiers[0].lease")));
    assert!(e.message().starts_with("tier `t`: lease 0ns must be between 1ms and "), "{e}");
    let e = error(&tier("kind = \"concurrency\"\nmax = 4\ntypical_hold = \"soon\""));
    assert_eq!(place(&e), (Some(6), Some(16), Some("policies.p.tiers[0].typical_hold")));
    assert!(e.message().starts_with("invalid duration \"soon\""), "{e}");

    // A calendar period that is a duration, and a rate period that is a calendar unit.
    let e = error(&tier("kind = \"calendar\"\ncount = 5\nperiod = \"1d\""));
    assert_eq!(
        e.to_string(),
        "tollgate.toml:6:10: policies.p.tiers[0].period: \"1d\" is not a calendar period; \
         expected one of minute, hour, day, week, month, year"
    );
    let e = error(&tier("count = 5\nperiod = \"month\""));
    assert_eq!(place(&e), (Some(5), Some(10), Some("policies.p.tiers[0].period")));
    assert!(e.message().starts_with("invalid duration \"month\": "), "{e}");
    assert!(
        e.message().ends_with(
            "; for windows of the calendar (from the start of each month), write kind = \"calendar\""
        ),
        "{e}"
    );

    // An unknown unit, at its value.
    let e = error(&tier("count = 5\nperiod = \"1s\"\nunit = \"tokens\""));
    assert_eq!(
        e.to_string(),
        "tollgate.toml:6:8: policies.p.tiers[0].unit: unknown unit \"tokens\"; expected one of \
         requests, request_bytes, response_bytes, reported, request_messages, response_messages"
    );

    // A burst beside a window algorithm is refused at the burst, as before; and a duplicate
    // name across kinds at the second one.
    let e = error(
        "[policies.p]\ntiers = [\n  { name = \"t\", kind = \"concurrency\", max = 4 },\n  { name = \"t\", kind = \"calendar\", count = 9, period = \"day\" },\n]\n",
    );
    assert_eq!(
        e.to_string(),
        "tollgate.toml:4:12: policies.p.tiers[1].name: duplicate tier name `t`"
    );
}

// ---------------------------------------------------------------------------------------------
// The configuration guide's SaaS plan.

/// The plan the configuration guide prints: 10,000 requests a month in
/// Europe/Berlin, 4 in flight, 1 GB of uploads a day.
fn saas_in_code() -> Policy {
    Policy::builder("saas")
        .calendar("monthly", Calendar::per_month(10_000).in_time_zone("Europe/Berlin"))
        .concurrency("in-flight", Concurrency::new(4))
        .calendar(
            "daily-uploads",
            Calendar::per_day(1_000_000_000)
                .counting(Unit::RequestBytes)
                .in_time_zone("Europe/Berlin"),
        )
        .build()
        .unwrap()
}

fn readme_toml() -> String {
    toml_block(include_str!("../../src/guide/config_file.md"), "## A SaaS plan per API key")
}

/// The guide's TOML, exactly as printed, is the plan built in code, and decides like it
/// across a month's end in Berlin.
#[test]
fn the_readme_saas_plan_is_the_policy_built_in_code() {
    let text = readme_toml();
    let config = load(&text);
    let expected = saas_in_code();
    assert_eq!(config.policies().collect::<Vec<_>>(), [&expected]);
    assert_eq!(config.rule_names().collect::<Vec<_>>(), ["saas"]);
    // Berlin's June ends at 22:00 UTC.
    let decisions =
        same_decisions(config.policy("saas").unwrap(), &expected, "2025-06-30T21:00:00Z", 600);
    assert!(decisions.iter().any(|d| !d.is_allowed()));
}

async fn call(
    layer: &LimitsLayer,
    api_key: &str,
    body: &'static [u8],
    handler: fn(&Request<RequestBody<Full<Bytes>>>) -> StatusCode,
) -> Response<tollgate::config::LimitsBody<Full<Bytes>>> {
    let svc = layer.layer(service_fn(move |req: Request<RequestBody<Full<Bytes>>>| async move {
        let status = handler(&req);
        let mut res = Response::new(Full::new(Bytes::from_static(b"ok")));
        *res.status_mut() = status;
        Ok::<_, Infallible>(res)
    }));
    let mut req = Request::post("/api/upload")
        .header("x-api-key", api_key)
        .header("content-length", body.len().to_string())
        .body(Full::new(Bytes::from_static(body)))
        .unwrap();
    req.extensions_mut().insert("192.0.2.1:4000".parse::<SocketAddr>().unwrap());
    svc.oneshot(req).await.unwrap()
}

fn header<B>(res: &Response<B>, name: &str) -> Option<String> {
    res.headers().get(name).map(|v| v.to_str().unwrap().to_owned())
}

/// Served from the guide's file: each API key has 4 slots, counts uploads in bytes
/// (`Content-Length`) and requests per month, per key.
#[tokio::test]
async fn the_readme_saas_plan_serves_its_tiers() {
    let clock = FakeClock::new();
    clock.set(at("2025-06-30T21:00:00Z"));
    let store = MemoryStore::builder().clock(clock).build().unwrap();
    let layer = LimitsLayer::with_store(load(&readme_toml()), store).unwrap();
    let ok = |_: &Request<_>| StatusCode::OK;
    let res = call(&layer, "k1", b"0123456789", ok).await;
    assert_eq!(res.status(), StatusCode::OK);
    // An hour to Berlin's midnight, and to the month's end.
    assert_eq!(
        header(&res, "ratelimit").unwrap(),
        r#""monthly";r=9999;t=3600, "in-flight";r=3;t=1, "daily-uploads";r=999999990;t=3600"#
    );
    drop(res.into_body().collect().await.unwrap());
    let res = call(&layer, "k2", b"", ok).await;
    assert_eq!(
        header(&res, "ratelimit").unwrap(),
        r#""monthly";r=9999;t=3600, "in-flight";r=3;t=1, "daily-uploads";r=1000000000;t=0"#,
        "another key, another budget"
    );
    // Without an API key: 401.
    let svc = layer.layer(service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    }));
    let mut req = Request::get("/api/items").body(Full::new(Bytes::new())).unwrap();
    req.extensions_mut().insert("192.0.2.1:4000".parse::<SocketAddr>().unwrap());
    assert_eq!(svc.oneshot(req).await.unwrap().status(), StatusCode::UNAUTHORIZED);
}

/// A reload that raises the guide plan's monthly quota carries each key's used share of it
/// (`changed_tiers = "carry_used_fraction"`) and keeps its count of the unchanged daily bytes.
#[tokio::test]
async fn a_reload_of_the_readme_plan_keeps_the_unchanged_tiers_and_carries_the_changed_one() {
    let clock = FakeClock::new();
    clock.set(at("2025-06-30T21:00:00Z"));
    let store = MemoryStore::builder().clock(clock).build().unwrap();
    let text = readme_toml();
    let layer = LimitsLayer::with_store(load(&text), store).unwrap();
    let ok = |_: &Request<_>| StatusCode::OK;
    for _ in 0..3 {
        let res = call(&layer, "k1", &[b'x'; 1000], ok).await;
        assert_eq!(res.status(), StatusCode::OK);
        drop(res.into_body().collect().await.unwrap());
    }
    let raised = text
        .replace("count = 10_000", "count = 20_000")
        .replace("[policies.saas]\n", "[policies.saas]\nchanged_tiers = \"carry_used_fraction\"\n");
    let reloaded = layer.handle().reload(load(&raised)).unwrap();
    assert_eq!(reloaded.changed(), ["saas"]);
    let res = call(&layer, "k1", &[b'x'; 1000], ok).await;
    // 3 of 10,000 used is 6 of 20,000; 3,000 bytes of the day's 1,000,000,000 stay used.
    assert_eq!(
        header(&res, "ratelimit").unwrap(),
        r#""monthly";r=19993;t=3600, "in-flight";r=3;t=1, "daily-uploads";r=999996000;t=3600"#
    );
}

// ---------------------------------------------------------------------------------------------
// Units and rule settings, served.

const POLICY: &str = "[policies.p]\ntiers = [{ name = \"p\", count = 5, period = \"1m\" }]\n";

fn rule(extra: &str) -> String {
    format!(
        "{POLICY}[[rules]]\nname = \"r\"\nkey = \"header:x-api-key\"\npolicy = \"p\"\n{extra}\n"
    )
}

fn layer(text: &str) -> LimitsLayer {
    let store = MemoryStore::builder().clock(FakeClock::new()).build().unwrap();
    LimitsLayer::with_store(load(text), store).unwrap()
}

/// Tokens the handler reports through `Usage` settle a `unit = "reported"` tier read from the
/// file; request bytes are charged from `Content-Length`.
#[tokio::test]
async fn reported_units_and_request_bytes_are_charged_from_the_file() {
    let layer = layer(
        "[policies.llm]\ntiers = [\n  { name = \"tokens\", count = 10000, period = \"1h\", unit = \"reported\" },\n  { name = \"bytes\", count = 100, period = \"1h\", unit = \"request_bytes\" },\n]\n[[rules]]\nname = \"llm\"\nkey = \"header:x-api-key\"\npolicy = \"llm\"\n",
    );
    let report = |req: &Request<RequestBody<Full<Bytes>>>| {
        req.extensions().get::<Usage>().expect("a Usage for a reported tier").report(4_000);
        StatusCode::OK
    };
    let res = call(&layer, "k", b"0123456789012345678901234567890123456789", report).await;
    assert_eq!(res.status(), StatusCode::OK);
    drop(res.into_body().collect().await.unwrap());
    let res = call(&layer, "k", b"", |_| StatusCode::OK).await;
    // 10,000 - 4,000 tokens, settled when the first body ended, and the unit this request is
    // charged at admission; 100 - 40 bytes (its own body is empty: no byte is charged).
    assert_eq!(
        header(&res, "ratelimit").unwrap(),
        r#""tokens";r=5999;t=1441, "bytes";r=60;t=1440"#
    );
    drop(res.into_body().collect().await.unwrap());
    // 70 bytes do not fit in the 60 left.
    let res = call(&layer, "k", &[b'x'; 70], |_| StatusCode::OK).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
}

/// `header_format`, `explain_missing_key` and `refund_on` act as their builder calls do.
#[tokio::test]
async fn header_format_explain_missing_key_and_refund_on_are_applied() {
    let ok = |_: &Request<_>| StatusCode::OK;
    let draft7 = layer(&rule("header_format = \"draft7\""));
    let res = call(&draft7, "k", b"", ok).await;
    assert_eq!(header(&res, "ratelimit").unwrap(), "limit=5, remaining=4, reset=12");
    assert_eq!(header(&res, "ratelimit-policy").unwrap(), "5;w=60");

    // Refunds: a 503 gives the charge back, a 500 is not listed, a 4xx class is.
    let refunds = layer(&rule("refund_on = [\"503\", \"4xx\"]"));
    // The headers say what is left after the refund.
    let res = call(&refunds, "k", b"", |_| StatusCode::SERVICE_UNAVAILABLE).await;
    assert_eq!(header(&res, "ratelimit").unwrap(), r#""p";r=5;t=0"#);
    drop(res.into_body().collect().await.unwrap());
    let res = call(&refunds, "k", b"", |_| StatusCode::NOT_FOUND).await;
    assert_eq!(header(&res, "ratelimit").unwrap(), r#""p";r=5;t=0"#, "the 503 was refunded");
    drop(res.into_body().collect().await.unwrap());
    let res = call(&refunds, "k", b"", |_| StatusCode::INTERNAL_SERVER_ERROR).await;
    assert_eq!(header(&res, "ratelimit").unwrap(), r#""p";r=4;t=12"#, "the 404 was refunded");
    drop(res.into_body().collect().await.unwrap());
    let res = call(&refunds, "k", b"", ok).await;
    assert_eq!(header(&res, "ratelimit").unwrap(), r#""p";r=3;t=24"#, "2 of 4 charged");

    // A missing key explained, or not, whatever the build.
    for (explain, explained) in [("true", true), ("false", false)] {
        let layer = layer(&rule(&format!("explain_missing_key = {explain}")));
        let svc = layer.layer(service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
        }));
        let res = svc.oneshot(Request::get("/").body(Full::new(Bytes::new())).unwrap()).await;
        let res = res.unwrap();
        assert_eq!(res.status(), StatusCode::BAD_REQUEST);
        let body = res.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8_lossy(&body);
        assert_eq!(body.contains("x-api-key"), explained, "{body}");
    }
}

/// `priority_header` reads each request's class from that header: with a reserve on the
/// policy's tier, sheddable requests are refused first and critical ones still served.
#[tokio::test]
async fn priority_header_gives_each_request_its_class() {
    let text = "[policies.p]\ntiers = [{ name = \"m\", count = 4, period = \"1m\", reserve_critical = 1, reserve_standard = 1 }]\n[[rules]]\nname = \"r\"\nkey = \"header:x-api-key\"\npolicy = \"p\"\npriority_header = \"x-priority\"\n";
    let layer = layer(text);
    let svc = layer.layer(service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
    }));
    let status = |class: &'static str| {
        let svc = svc.clone();
        async move {
            let req = Request::get("/")
                .header("x-api-key", "k")
                .header("x-priority", class)
                .body(Full::new(Bytes::new()))
                .unwrap();
            svc.oneshot(req).await.unwrap().status()
        }
    };
    // 4 a minute: sheddable requests may use 2, standard 3, critical all 4.
    assert_eq!(status("sheddable").await, StatusCode::OK);
    assert_eq!(status("sheddable").await, StatusCode::OK);
    assert_eq!(status("sheddable").await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(status("standard").await, StatusCode::OK);
    assert_eq!(status("standard").await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(status("critical").await, StatusCode::OK);
    assert_eq!(status("critical").await, StatusCode::TOO_MANY_REQUESTS);

    let e = error(&rule("priority_header = \"bad header\""));
    assert_eq!(place(&e).2, Some("rules[0].priority_header"));
}

#[test]
fn bad_rule_settings_are_refused_at_their_field() {
    let e = error(&rule("header_format = \"draft8\""));
    assert_eq!(place(&e), (Some(7), Some(17), Some("rules[0].header_format")));
    assert!(e.message().starts_with("unknown variant `draft8`"), "{e}");
    #[rustfmt::skip]
    let cases = [
        // (the rule's extra settings, the error expected)
        ("refund_on = [\"5xx\", \"6xx\"]", Is("tollgate.toml:7:21: rules[0].refund_on[1]: \"6xx\" is not a status (\"503\") or a class of them (\"5xx\")")),
        ("refund_on = [\"99\"]", At(7, 14, "rules[0].refund_on[0]")),
        ("refund_on = []", At(7, 13, "rules[0].refund_on")),
        ("explain_missing_key = \"yes\"", At(7, 23, "rules[0].explain_missing_key")),
    ];
    refused(&cases.map(|(extra, says)| (rule(extra), says)));
}

/// The example in the module documentation's "Tiers" section reads as the builder calls it
/// documents.
#[test]
fn the_documented_tier_example_is_the_policy_built_in_code() {
    let text = toml_block(include_str!("../../src/config/mod.rs"), "//! # Tiers");
    let config = load(&text);
    let expected = Policy::builder("llm")
        .tier("per-second", Quota::per_second(10).with_burst(20))
        .concurrency(
            "in-flight",
            Concurrency::new(4)
                .with_ttl(Duration::from_secs(60))
                .with_typical_hold(Duration::from_secs(2)),
        )
        .tier("upload-bytes", Quota::per_second(1_000_000).counting(Unit::RequestBytes))
        .tier("download-bytes", Quota::per_minute(50_000_000).counting(Unit::ResponseBytes))
        .calendar("monthly", Calendar::per_month(100_000).in_time_zone("Europe/Berlin"))
        .calendar(
            "daily-tokens",
            Calendar::per_day(1_000_000).in_time_zone("Europe/Berlin").counting(Unit::Reported),
        )
        .build()
        .unwrap();
    assert_eq!(config.policies().cloned().collect::<Vec<_>>(), [expected]);
}

// ---------------------------------------------------------------------------------------------
// Hostile files.

/// One field of a tier: any of the names a tier may have, with a value of a plausible or a
/// wrong type and form.
fn tier_field() -> impl Strategy<Value = String> {
    let name = prop::sample::select(vec![
        "kind",
        "count",
        "period",
        "burst",
        "unit",
        "time_zone",
        "max",
        "lease",
        "typical_hold",
    ]);
    let value = prop_oneof![
        prop::sample::select(vec![
            "\"rate\"",
            "\"concurrency\"",
            "\"calendar\"",
            "\"month\"",
            "\"day\"",
            "\"1s\"",
            "\"0s\"",
            "\"1 fortnight\"",
            "\"Europe/Berlin\"",
            "\"Mars/Olympus\"",
            "\"\"",
            "\"request_bytes\"",
            "\"reported\"",
            "0",
            "1",
            "4294967295",
            "4294967296",
            "-1",
            "true",
            "[]",
            "{}",
            "1.5",
        ])
        .prop_map(str::to_owned),
        any::<u64>().prop_map(|n| n.to_string()),
        "[a-z0-9 /_]{0,12}".prop_map(|s| format!("{s:?}")),
    ];
    (name, value).prop_map(|(n, v)| format!("{n} = {v}"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    /// Any mix of tier fields is read, or refused with a line, a column and a field; never a
    /// panic. What is read builds the policy its fields say.
    #[test]
    fn any_tier_is_read_or_refused_at_a_field(fields in proptest::collection::vec(tier_field(), 0..6)) {
        let mut seen = std::collections::HashSet::new();
        // TOML refuses a key given twice; keep the first.
        let fields: Vec<_> = fields
            .into_iter()
            .filter(|f| seen.insert(f.split(" = ").next().unwrap_or_default().to_owned()))
            .collect();
        let text = format!("[policies.p]\n[[policies.p.tiers]]\nname = \"t\"\n{}\n", fields.join("\n"));
        match LimitsConfig::from_toml(&text, "tollgate.toml") {
            Ok(config) => prop_assert_eq!(config.policy("p").unwrap().tiers().len(), 1),
            Err(e) => {
                prop_assert!(e.line().is_some() && e.column().is_some(), "{}", e);
                prop_assert!(e.field().is_some_and(|f| f.starts_with("policies.p")), "{}", e);
            }
        }
    }
}

/// `on_stream` read from the file meters response bytes as they stream: policed, a gRPC
/// response past its tier ends with `RESOURCE_EXHAUSTED` trailers instead of its data, as it
/// does by default (the rule polices); `settle` settles when the body ends. A bad mode is
/// refused at its place.
#[tokio::test]
async fn on_stream_from_the_file_polices_a_grpc_response() {
    let text = |extra: &str| {
        format!(
            "[policies.dl]\ntiers = [{{ name = \"bytes\", count = 1, period = \"1h\", unit = \"response_bytes\" }}]\n[[rules]]\nname = \"r\"\nkey = \"header:x-api-key\"\npolicy = \"dl\"\n{extra}\n"
        )
    };
    for (extra, policed) in
        [("", true), ("on_stream = \"settle\"", false), ("on_stream = \"police\"", true)]
    {
        let layer = layer(&text(extra));
        let svc = layer.layer(service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        }));
        let req = Request::post("/pkg.Files/Get")
            .header("x-api-key", "k")
            .header("content-type", "application/grpc")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let res = svc.oneshot(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        let body = res.into_body().collect().await.unwrap();
        let trailers = body.trailers().cloned();
        let data = body.to_bytes();
        if policed {
            // The unit charged at admission took the tier's only byte.
            assert_eq!(data, "", "{extra}");
            assert_eq!(trailers.expect("trailers")["grpc-status"], "8", "{extra}");
        } else {
            assert_eq!(data, "ok", "{extra}");
            assert!(trailers.is_none(), "{extra}");
        }
    }
    let e = error(&text("on_stream = \"throttle\""));
    assert_eq!(place(&e), (Some(7), Some(13), Some("rules[0].on_stream")));
    assert!(e.message().starts_with("unknown variant `throttle`"), "{e}");
}

/// Two rules that meter one response: the body is one, metered by both rules in turn. Each
/// rule's slot is taken while it streams and freed when it ends, and each rule's byte tier is
/// charged the bytes sent; a body dropped unfinished frees both slots and charges nothing sent.
#[tokio::test]
async fn two_rules_meter_one_response_body() {
    let layer = layer(concat!(
        "[policies.a]\ntiers = [\n",
        "  { name = \"a-slot\", kind = \"concurrency\", max = 1 },\n",
        "  { name = \"a-out\", count = 100, period = \"1h\", unit = \"response_bytes\" },\n]\n",
        "[policies.b]\ntiers = [\n",
        "  { name = \"b-slot\", kind = \"concurrency\", max = 1 },\n",
        "  { name = \"b-out\", count = 50, period = \"1h\", unit = \"response_bytes\" },\n]\n",
        "[[rules]]\nname = \"a\"\nkey = \"header:x-api-key\"\npolicy = \"a\"\n",
        "[[rules]]\nname = \"b\"\nkey = \"header:x-api-key\"\npolicy = \"b\"\n",
    ));
    let ok = |_: &Request<_>| StatusCode::OK;
    let first = call(&layer, "k", b"", ok).await;
    assert_eq!(first.status(), StatusCode::OK);
    // One unit of each byte tier at admission; settled when the body ends.
    assert_eq!(
        header(&first, "ratelimit").unwrap(),
        r#""a-slot";r=0;t=1, "a-out";r=99;t=36, "b-slot";r=0;t=1, "b-out";r=49;t=72"#
    );
    // Streaming: the first rule's slot is taken.
    let held = call(&layer, "k", b"", ok).await;
    assert_eq!(held.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(first.into_body().collect().await.unwrap().to_bytes(), "ok");
    // Ended: both slots free, each byte tier charged the 2 bytes sent.
    let second = call(&layer, "k", b"", ok).await;
    assert_eq!(
        header(&second, "ratelimit").unwrap(),
        r#""a-slot";r=0;t=1, "a-out";r=97;t=108, "b-slot";r=0;t=1, "b-out";r=47;t=216"#
    );
    // Dropped before a byte was sent: both slots free, nothing charged for it.
    drop(second);
    let third = call(&layer, "k", b"", ok).await;
    assert_eq!(
        header(&third, "ratelimit").unwrap(),
        r#""a-slot";r=0;t=1, "a-out";r=97;t=108, "b-slot";r=0;t=1, "b-out";r=47;t=216"#
    );
}

/// Two rules writing both header families: a refusal by the second carries the first's items
/// too, and the legacy set of the tightest tier of both; its `Retry-After` is the refusal's.
#[tokio::test]
async fn a_refusal_by_a_later_rule_carries_every_rules_headers() {
    let layer = layer(concat!(
        "[policies.a]\ntiers = [{ name = \"a\", count = 10, period = \"1h\" }]\n",
        "[policies.b]\ntiers = [{ name = \"b\", count = 1, period = \"1h\" }]\n",
        "[[rules]]\nname = \"a\"\nkey = \"header:x-api-key\"\npolicy = \"a\"\nheaders = \"both\"\n",
        "[[rules]]\nname = \"b\"\nkey = \"header:x-api-key\"\npolicy = \"b\"\nheaders = \"both\"\n",
    ));
    let ok = |_: &Request<_>| StatusCode::OK;
    let legacy = |res: &Response<_>| {
        ["x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset"]
            .map(|n| header(res, n).unwrap())
    };
    let first = call(&layer, "k", b"", ok).await;
    assert_eq!(first.status(), StatusCode::OK);
    assert_eq!(header(&first, "ratelimit-policy").unwrap(), r#""a";q=10;w=3600, "b";q=1;w=3600"#);
    assert_eq!(header(&first, "ratelimit").unwrap(), r#""a";r=9;t=360, "b";r=0;t=3600"#);
    assert_eq!(legacy(&first), ["1", "0", "3600"]);
    assert_eq!(header(&first, "retry-after"), None);
    // Refused by the second rule, after the first charged it.
    let second = call(&layer, "k", b"", ok).await;
    assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&second, "retry-after").unwrap(), "3600");
    assert_eq!(header(&second, "ratelimit").unwrap(), r#""a";r=8;t=720, "b";r=0;t=3600"#);
    assert_eq!(legacy(&second), ["1", "0", "3600"]);
}
