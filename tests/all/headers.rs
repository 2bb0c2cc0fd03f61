//! The rate-limit header fields clients read, checked over random policies (every algorithm,
//! one to three tiers, bursts), random traffic, every header format, on both stores: each
//! field parses as an RFC 9651 structured field, the remaining count never exceeds the quota
//! of the same item, and a 429 carries `Retry-After` of at least one second.
#[cfg(feature = "redis")]
use crate::support;

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Empty;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use tollgate::RequestBody;
use tollgate::clock::FakeClock;
use tollgate::key::GlobalKey;
use tollgate::store::{MemoryStore, Store};
use tollgate::{Algorithm, HeaderFormat, HeaderStyle, Policy, Quota, RateLimitLayer};
use tower::{Layer, ServiceExt, service_fn};

#[derive(Debug, Clone)]
struct Case {
    algorithm: Algorithm,
    /// `(count, period in ms, burst)` per tier.
    tiers: Vec<(u64, u64, Option<u64>)>,
    format: HeaderFormat,
    /// `(ms to advance the clock by, cost)` per request.
    steps: Vec<(u64, u64)>,
}

impl Case {
    fn policy(&self) -> Policy {
        let mut b = Policy::builder("p").algorithm(self.algorithm);
        for (i, (count, period, burst)) in self.tiers.iter().enumerate() {
            let mut q = Quota::new(*count, Duration::from_millis(*period));
            if let Some(burst) = burst {
                q = q.with_burst(*burst);
            }
            b = b.tier(format!("t{i}"), q);
        }
        b.build().expect("a valid policy")
    }
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::sample::select(Algorithm::ALL.to_vec()),
        prop::collection::vec((1u64..=20, 100u64..=3_600_000, prop::option::of(1u64..=40)), 1..=3),
        prop::sample::select(vec![
            HeaderFormat::Draft10,
            HeaderFormat::Draft7,
            HeaderFormat::Draft6,
        ]),
        prop::collection::vec((0u64..=2_000, 1u64..=3), 1..=30),
    )
        .prop_map(|(algorithm, tiers, format, steps)| {
            // Bursts apply to the bucket algorithms; the windows admit `count` per period.
            let bursts = matches!(
                algorithm,
                Algorithm::Gcra | Algorithm::TokenBucket | Algorithm::LeakyBucket
            );
            let tiers = tiers.into_iter().map(|(c, p, b)| (c, p, b.filter(|_| bursts))).collect();
            Case { algorithm, tiers, format, steps }
        })
}

/// An RFC 9651 integer item's value.
fn sf_integer(value: &str) -> Result<i64, String> {
    let item: sfv::Item = sfv::Parser::new(value).parse().map_err(|e| format!("{value:?}: {e}"))?;
    item.bare_item.as_integer().map(i64::from).ok_or_else(|| format!("{value:?} is no integer"))
}

/// A list item: its bare item (as text) and integer parameters.
type ListItem = (String, Vec<(String, i64)>);

/// An RFC 9651 list: per item, its bare item (as text) and integer parameters.
fn sf_list(value: &str) -> Result<Vec<ListItem>, String> {
    let list: sfv::List = sfv::Parser::new(value).parse().map_err(|e| format!("{value:?}: {e}"))?;
    list.into_iter()
        .map(|entry| match entry {
            sfv::ListEntry::Item(item) => {
                let bare = match &item.bare_item {
                    sfv::BareItem::String(s) => format!("\"{}\"", s.as_str()),
                    sfv::BareItem::Integer(i) => i64::from(*i).to_string(),
                    other => return Err(format!("unexpected item {other:?} in {value:?}")),
                };
                let params = item
                    .params
                    .iter()
                    .map(|(k, v)| {
                        let v = v.as_integer().ok_or_else(|| format!("{k} in {value:?}"))?;
                        Ok((k.as_str().to_owned(), i64::from(v)))
                    })
                    .collect::<Result<_, String>>()?;
                Ok((bare, params))
            }
            sfv::ListEntry::InnerList(_) => Err(format!("inner list in {value:?}")),
        })
        .collect()
}

fn param(params: &[(String, i64)], name: &str) -> Result<i64, String> {
    params.iter().find(|(k, _)| k == name).map(|(_, v)| *v).ok_or_else(|| format!("no {name}"))
}

/// Checks one response's header fields against the policy's tiers.
fn check(res: &Response<impl Sized>, case: &Case, policy: &Policy) -> Result<(), String> {
    let h = res.headers();
    let get = |name: &str| -> Result<&str, String> {
        h.get(name).ok_or_else(|| format!("no {name}"))?.to_str().map_err(|e| e.to_string())
    };
    let capacities: Vec<i64> =
        policy.tiers().iter().map(|t| i64::try_from(t.capacity()).unwrap()).collect();
    // The policy: one item per tier, `q` its capacity, `w` at least a second.
    let items = sf_list(get("ratelimit-policy")?)?;
    if items.len() != capacities.len() {
        return Err(format!("{} policy items for {} tiers", items.len(), capacities.len()));
    }
    for (i, ((bare, params), q)) in items.iter().zip(&capacities).enumerate() {
        let quota = match case.format {
            HeaderFormat::Draft10 => {
                if *bare != format!("\"t{i}\"") {
                    return Err(format!("item {i} is {bare}"));
                }
                param(params, "q")?
            }
            _ => bare.parse::<i64>().map_err(|e| e.to_string())?,
        };
        if quota != *q || param(params, "w")? < 1 {
            return Err(format!("policy item {i}: {bare} {params:?}, capacity {q}"));
        }
    }
    // The state: the remaining count never above the quota of the same item.
    let mut limit_remaining = Vec::new();
    match case.format {
        HeaderFormat::Draft10 => {
            let state = sf_list(get("ratelimit")?)?;
            if state.len() != capacities.len() {
                return Err(format!("{} state items for {} tiers", state.len(), capacities.len()));
            }
            for (i, ((bare, params), q)) in state.iter().zip(&capacities).enumerate() {
                let (r, t) = (param(params, "r")?, param(params, "t")?);
                if *bare != format!("\"t{i}\"") || r < 0 || r > *q || t < 0 {
                    return Err(format!("state item {i}: {bare} r={r} t={t}, q={q}"));
                }
            }
        }
        HeaderFormat::Draft7 => {
            let dict: sfv::Dictionary =
                sfv::Parser::new(get("ratelimit")?).parse().map_err(|e| e.to_string())?;
            let int = |k: &str| -> Result<i64, String> {
                match dict.get(k) {
                    Some(sfv::ListEntry::Item(item)) => {
                        item.bare_item.as_integer().map(i64::from).ok_or_else(|| k.to_owned())
                    }
                    _ => Err(format!("no {k}")),
                }
            };
            limit_remaining.push((int("limit")?, int("remaining")?, int("reset")?));
        }
        _ => {
            let triple = (
                sf_integer(get("ratelimit-limit")?)?,
                sf_integer(get("ratelimit-remaining")?)?,
                sf_integer(get("ratelimit-reset")?)?,
            );
            limit_remaining.push(triple);
        }
    }
    limit_remaining.push((
        sf_integer(get("x-ratelimit-limit")?)?,
        sf_integer(get("x-ratelimit-remaining")?)?,
        sf_integer(get("x-ratelimit-reset")?)?,
    ));
    for (limit, remaining, reset) in limit_remaining {
        if !capacities.contains(&limit) || remaining < 0 || remaining > limit || reset < 0 {
            return Err(format!("limit={limit} remaining={remaining} reset={reset}"));
        }
    }
    // `Retry-After` on a refusal only, at least a second.
    match res.status() {
        StatusCode::TOO_MANY_REQUESTS => {
            let secs = sf_integer(get("retry-after")?)?;
            if secs < 1 {
                return Err(format!("Retry-After: {secs}"));
            }
        }
        StatusCode::OK if h.contains_key("retry-after") => return Err("Retry-After on 200".into()),
        StatusCode::OK => {}
        other => return Err(format!("status {other}")),
    }
    Ok(())
}

async fn replay<St: Store + Clone>(store: St, clock: FakeClock, case: Case) -> Result<(), String> {
    let policy = case.policy();
    let min_capacity = policy.tiers().iter().map(|t| t.capacity()).min().unwrap_or(1);
    let layer = RateLimitLayer::builder(policy.clone())
        .store(store)
        .key(GlobalKey)
        .headers(HeaderStyle::Both)
        .header_format(case.format)
        .cost_fn(move |head| {
            let asked = head.headers.get("x-cost").and_then(|v| v.to_str().ok()?.parse().ok());
            asked.unwrap_or(1).min(min_capacity)
        })
        .build()
        .map_err(|e| e.to_string())?;
    let svc = layer.layer(service_fn(|_req: Request<RequestBody<Empty<Bytes>>>| async {
        Ok::<_, Infallible>(Response::new(()))
    }));
    for (i, (advance, cost)) in case.steps.iter().enumerate() {
        clock.advance(Duration::from_millis(*advance));
        let req = Request::get("/").header("x-cost", cost.to_string()).body(Empty::new()).unwrap();
        let res = svc.clone().oneshot(req).await.map_err(|e| format!("{e:?}"))?;
        check(&res, &case, &policy).map_err(|e| format!("request {i}: {e}"))?;
    }
    Ok(())
}

fn run<St: Store + Clone>(cases: u32, store: impl Fn(FakeClock, u64) -> St) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let mut runner =
        TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() });
    let n = std::sync::atomic::AtomicU64::new(0);
    let result = runner.run(&case(), |case| {
        let clock = FakeClock::new();
        clock.set(1_700_000_000_000_000_000);
        let store = store(clock.clone(), n.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        rt.block_on(replay(store, clock, case)).map_err(TestCaseError::fail)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn header_fields_parse_and_never_promise_more_than_the_quota_in_memory() {
    run(512, |clock, _| MemoryStore::builder().clock(clock).build().unwrap());
}

#[cfg(feature = "redis")]
#[test]
fn header_fields_parse_and_never_promise_more_than_the_quota_on_redis() {
    use tollgate::store::RedisStore;
    let Some(server) = support::redis::Server::start("redis-server") else { return };
    let url = server.url();
    run(96, |clock, n| {
        RedisStore::builder(&url)
            .clock(clock)
            .prefix(format!("headers{n}:"))
            .ttl_grace(Duration::from_secs(3600))
            .timeout(Duration::from_secs(5))
            .no_fallback()
            .build()
            .unwrap()
    });
}

#[test]
fn each_format_renders_as_its_draft_says() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let policy = Policy::builder("api")
        .tier("burst", Quota::per_second(10))
        .tier("daily", Quota::per_day(1000))
        .build()
        .unwrap();
    let fields = |format: HeaderFormat| {
        let layer = RateLimitLayer::builder(policy.clone())
            .store(MemoryStore::builder().clock(FakeClock::new()).build().unwrap())
            .key(GlobalKey)
            .cost(3)
            .header_format(format)
            .build()
            .unwrap();
        let svc = layer.layer(service_fn(|_req: Request<RequestBody<Empty<Bytes>>>| async {
            Ok::<_, Infallible>(Response::new(()))
        }));
        let res = rt.block_on(svc.oneshot(Request::new(Empty::new()))).unwrap();
        let mut out: Vec<String> = res
            .headers()
            .iter()
            .filter(|(n, _)| n.as_str().starts_with("ratelimit"))
            .map(|(n, v)| format!("{n}: {}", v.to_str().unwrap()))
            .collect();
        out.sort();
        out
    };
    assert_eq!(
        fields(HeaderFormat::Draft10),
        [
            "ratelimit-policy: \"burst\";q=10;w=1, \"daily\";q=1000;w=86400",
            "ratelimit: \"burst\";r=7;t=1, \"daily\";r=997;t=260",
        ]
    );
    assert_eq!(
        fields(HeaderFormat::Draft7),
        ["ratelimit-policy: 10;w=1, 1000;w=86400", "ratelimit: limit=10, remaining=7, reset=1"]
    );
    assert_eq!(
        fields(HeaderFormat::Draft6),
        [
            "ratelimit-limit: 10",
            "ratelimit-policy: 10;w=1, 1000;w=86400",
            "ratelimit-remaining: 7",
            "ratelimit-reset: 1",
        ]
    );
}
