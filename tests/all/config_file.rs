//! Policies and rules from a TOML file: the sample `tollgate.toml` read and served, each class
//! of error located at its file, line, column and field, and reloads: under concurrent traffic
//! over real HTTP on loopback, from a file, refused, and by the file watcher.
#![cfg(feature = "config")]
use crate::support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::{get as route_get, post as route_post};
use http::{Request, StatusCode};
use support::config_files::Says::{At, Is};
use support::config_files::refused;
use support::logs::Captured;
use support::{client, get, serve};
use tollgate::RequestBody;
use tollgate::clock::TokioClock;
use tollgate::config::{ConfigFileError, LimitsConfig, LimitsLayer, ReloadHandle};
use tollgate::key::Key;
use tollgate::store::MemoryStore;
use tollgate::{Algorithm, Policy, Quota};
use tower::{Layer, Service, ServiceExt, service_fn};

fn sample_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tollgate.toml")
}

/// A directory of its own under the system's temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("tollgate-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }

    fn write(&self, file: &str, text: &str) -> PathBuf {
        let path = self.0.join(file);
        std::fs::write(&path, text).expect("write config");
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn the_sample_file_parses_into_exactly_the_expected_policies() {
    let config = LimitsConfig::load(sample_path()).unwrap();
    let expected = vec![
        Policy::builder("per-ip")
            .algorithm(Algorithm::Gcra)
            .tier("per-ip-burst", Quota::per_second(20).with_burst(40))
            .tier("per-ip-hourly", Quota::per_hour(5000))
            .build()
            .unwrap(),
        Policy::single("free", Quota::per_minute(100)).unwrap(),
        Policy::builder("pro")
            .tier("pro", Quota::per_minute(1000))
            .tier("pro-daily", Quota::per_day(200_000))
            .build()
            .unwrap(),
        Policy::builder("uploads")
            .algorithm(Algorithm::TokenBucket)
            .tier("uploads", Quota::per_hour(100))
            .build()
            .unwrap(),
    ];
    assert_eq!(config.policies().cloned().collect::<Vec<_>>(), expected);
    assert_eq!(config.rule_names().collect::<Vec<_>>(), ["per-ip", "plans", "uploads"]);
    assert_eq!(config.file(), sample_path().display().to_string());
    assert_eq!(config.path(), Some(sample_path().as_path()));
}

/// The sample file served over a memory store on the paused clock, from `peer`.
async fn sample_call(
    layer: &LimitsLayer,
    method: &str,
    path: &str,
    peer: &str,
    headers: &[(&str, &str)],
) -> http::Response<tollgate::config::LimitsBody<Body>> {
    let svc = layer.layer(service_fn(|_req: Request<RequestBody<Body>>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(Body::from("ok")))
    }));
    let mut req = Request::builder().method(method).uri(path);
    for (n, v) in headers {
        req = req.header(*n, *v);
    }
    let mut req = req.body(Body::empty()).unwrap();
    req.extensions_mut().insert(peer.parse::<SocketAddr>().unwrap());
    svc.oneshot(req).await.unwrap()
}

fn header<B>(res: &http::Response<B>, name: &str) -> Option<String> {
    res.headers().get(name).map(|v| v.to_str().unwrap().to_owned())
}

#[tokio::test(start_paused = true)]
async fn the_sample_file_limits_as_it_says() {
    let store = MemoryStore::builder().clock(TokioClock::new()).build().unwrap();
    let layer = LimitsLayer::with_store(LimitsConfig::load(sample_path()).unwrap(), store).unwrap();
    let client = "203.0.113.7:4000";
    let key = [("x-api-key", "k1")];

    // Health checks and preflights: no rule applies.
    for path in ["/healthz", "/readyz"] {
        let res = sample_call(&layer, "GET", path, client, &[]).await;
        assert_eq!((res.status(), header(&res, "ratelimit")), (StatusCode::OK, None));
    }
    let res = sample_call(&layer, "OPTIONS", "/api/items", client, &[]).await;
    assert_eq!((res.status(), header(&res, "ratelimit")), (StatusCode::OK, None));

    // Outside the API: per address only.
    let res = sample_call(&layer, "GET", "/", client, &[]).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        header(&res, "ratelimit-policy").unwrap(),
        r#""per-ip-burst";q=40;w=2, "per-ip-hourly";q=5000;w=3600"#
    );
    assert_eq!(
        header(&res, "ratelimit").unwrap(),
        r#""per-ip-burst";r=39;t=1, "per-ip-hourly";r=4999;t=1"#
    );

    // The API without a key: refused by the plan rule (after the address was charged).
    let res = sample_call(&layer, "GET", "/api/items", client, &[]).await;
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);

    // With a key and no plan: free, listed after the address's tiers.
    let res = sample_call(&layer, "GET", "/api/items", client, &key).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        header(&res, "ratelimit-policy").unwrap(),
        r#""per-ip-burst";q=40;w=2, "per-ip-hourly";q=5000;w=3600, "free";q=100;w=60"#
    );
    assert_eq!(
        header(&res, "ratelimit").unwrap(),
        r#""per-ip-burst";r=37;t=1, "per-ip-hourly";r=4997;t=3, "free";r=99;t=1"#
    );
    // A plan the file does not know: free too; "pro": pro.
    let res = sample_call(&layer, "GET", "/api/items", client, &[key[0], ("x-plan", "gold")]).await;
    assert!(header(&res, "ratelimit").unwrap().ends_with(r#""free";r=98;t=2"#));
    let res = sample_call(&layer, "GET", "/api/items", client, &[key[0], ("x-plan", "pro")]).await;
    assert!(
        header(&res, "ratelimit")
            .unwrap()
            .ends_with(r#""pro";r=999;t=1, "pro-daily";r=199999;t=1"#)
    );

    // An upload costs 10 units of the upload budget, 1 of the others.
    let res = sample_call(&layer, "POST", "/api/upload", client, &key).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        header(&res, "ratelimit").unwrap(),
        r#""per-ip-burst";r=34;t=1, "per-ip-hourly";r=4994;t=5, "free";r=97;t=2, "uploads";r=90;t=360"#
    );
    for _ in 0..9 {
        let res = sample_call(&layer, "POST", "/api/upload", client, &key).await;
        assert_eq!(res.status(), StatusCode::OK);
    }
    let res = sample_call(&layer, "POST", "/api/upload", client, &key).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&res, "retry-after").unwrap(), "360");
    // The refusal carries every applied rule's state: the upload tier's is 0.
    assert!(header(&res, "ratelimit").unwrap().ends_with(r#""uploads";r=0;t=3600"#));

    // The office network is not limited per address; its API calls still count per key.
    let res = sample_call(&layer, "GET", "/", "172.20.1.2:5000", &[]).await;
    assert_eq!((res.status(), header(&res, "ratelimit")), (StatusCode::OK, None));
    let res = sample_call(&layer, "GET", "/api/items", "172.20.1.2:5000", &key).await;
    assert_eq!(header(&res, "ratelimit-policy").unwrap(), r#""free";q=100;w=60"#);
    // An allow-listed key is not limited per key; its address still is.
    let res =
        sample_call(&layer, "GET", "/api/items", client, &[("x-api-key", "internal-batch-job")])
            .await;
    assert_eq!(
        header(&res, "ratelimit-policy").unwrap(),
        r#""per-ip-burst";q=40;w=2, "per-ip-hourly";q=5000;w=3600"#
    );
}

/// Reads `text` as `tollgate.toml` and returns its error.
fn error(text: &str) -> ConfigFileError {
    LimitsConfig::from_toml(text, "tollgate.toml").expect_err("the file should be refused")
}

/// The error's place and field.
fn place(e: &ConfigFileError) -> (Option<usize>, Option<usize>, Option<&str>) {
    (e.line(), e.column(), e.field())
}

const FREE: &str = "[policies.free]\ntiers = [{ name = \"free\", count = 100, period = \"1m\" }]\n";

#[test]
fn an_unknown_field_is_named_where_it_is() {
    let e = error(&format!("{FREE}\n[[rules]]\nname = \"api\"\npolicy = \"free\"\nburts = 5\n"));
    assert_eq!(place(&e), (Some(7), Some(1), Some("rules[0].burts")));
    assert!(e.message().starts_with("unknown field `burts`, expected one of `name`, "), "{e}");
    assert!(e.to_string().starts_with("tollgate.toml:7:1: rules[0].burts: unknown field `burts`"));

    let e = error("[policies.free]\nalgorithm = \"gcra\"\nteirs = []\n");
    assert_eq!(place(&e), (Some(3), Some(1), Some("policies.free.teirs")));
    let e = error("[limits]\nx = 1\n");
    assert_eq!(place(&e), (Some(1), Some(2), Some("limits")));
}

#[test]
fn a_bad_duration_is_named_with_its_value() {
    let e = error(
        "[policies.free]\nalgorithm = \"gcra\"\n\n[[policies.free.tiers]]\nname = \"free\"\ncount = 100\nperiod = \"1 fortnight\"\n",
    );
    assert_eq!(place(&e), (Some(7), Some(10), Some("policies.free.tiers[0].period")));
    assert_eq!(
        e.to_string(),
        "tollgate.toml:7:10: policies.free.tiers[0].period: invalid duration \"1 fortnight\": \
         unknown time unit \"fortnight\", supported units: ns, us/µs, ms, sec, min, hours, days, \
         weeks, months, years (and few variations)"
    );
}

#[test]
fn a_zero_count_is_refused_at_the_count() {
    let e = error("[policies.free]\ntiers = [{ name = \"free\", count = 0, period = \"1m\" }]\n");
    assert_eq!(
        e.to_string(),
        "tollgate.toml:2:35: policies.free.tiers[0].count: tier `free`: count must be at least 1"
    );
    let source = std::error::Error::source(&e).unwrap();
    assert_eq!(
        source.downcast_ref::<tollgate::ConfigError>(),
        Some(&tollgate::ConfigError::ZeroCount { tier: "free".into() })
    );
}

#[test]
fn values_the_builders_refuse_point_at_their_field() {
    #[rustfmt::skip]
    let cases = [
        // Burst 0.
        ("[policies.p]\n[[policies.p.tiers]]\nname = \"t\"\ncount = 5\nperiod = \"1s\"\nburst = 0\n".to_owned(), Is("tollgate.toml:6:9: policies.p.tiers[0].burst: tier `t`: burst must be at least 1")),
        // A burst on a window algorithm.
        ("[policies.p]\nalgorithm = \"fixed_window\"\ntiers = [{ name = \"t\", count = 5, period = \"1s\", burst = 9 }]\n".to_owned(), At(3, 58, "policies.p.tiers[0].burst")),
        // Two tiers with one name: the second.
        ("[policies.p]\ntiers = [\n  { name = \"t\", count = 5, period = \"1s\" },\n  { name = \"t\", count = 9, period = \"1m\" },\n]\n".to_owned(), Is("tollgate.toml:4:12: policies.p.tiers[1].name: duplicate tier name `t`")),
        // No tiers.
        ("[policies.p]\ntiers = []\n".to_owned(), Is("tollgate.toml:2:9: policies.p.tiers: policy `p` has no tiers")),
        // A cost above the capacity.
        (format!("{FREE}[[rules]]\nname = \"up\"\npolicy = \"free\"\ncost = 200\n"), Is("tollgate.toml:6:8: rules[0].cost: cost: 200 units exceed the capacity of tier `free` (100 units)")),
        // A zero period.
        ("[policies.p]\ntiers = [{ name = \"t\", count = 5, period = \"0s\" }]\n".to_owned(), At(2, 44, "policies.p.tiers[0].period")),
    ];
    refused(&cases);
    // The first error in the file is the one reported, whatever the policies' names.
    let e = error("[policies.zz]\ntiers = []\n[policies.aa]\ntiers = []\n");
    assert_eq!(e.field(), Some("policies.zz.tiers"));
    // Shaping with no room to wait.
    let e = error(&format!(
        "{FREE}[[rules]]\nname = \"s\"\npolicy = \"free\"\nmax_delay = \"1s\"\nmax_waiters = 0\n"
    ));
    assert_eq!(place(&e), (Some(7), Some(15), Some("rules[0].max_waiters")));
    assert_eq!(e.message(), "max_waiters: must be at least 1 when shaping or with a tarpit");
}

#[test]
fn an_unknown_algorithm_is_named() {
    let e = error(
        "[policies.free]\nalgorithm = \"gcra2\"\ntiers = [{ name = \"free\", count = 1, period = \"1m\" }]\n",
    );
    assert_eq!(
        e.to_string(),
        "tollgate.toml:2:13: policies.free.algorithm: unknown algorithm \"gcra2\"; expected one of \
         gcra, token_bucket, leaky_bucket, fixed_window, sliding_log, sliding_counter"
    );
}

#[test]
fn an_unknown_key_extractor_is_named_in_its_list() {
    let e = error(&format!(
        "{FREE}\n[[rules]]\nname = \"api\"\npolicy = \"free\"\nkey = [\"peer_ip\", \"ip_address\"]\n"
    ));
    assert_eq!(place(&e), (Some(7), Some(19), Some("rules[0].key[1]")));
    assert_eq!(
        e.message(),
        "unknown key extractor \"ip_address\"; expected peer_ip, client_ip, header:<name>, route, \
         method, global, grpc_method, grpc_service"
    );
    let e =
        error(&format!("{FREE}[[rules]]\nname = \"api\"\npolicy = \"free\"\nkey = \"header:\"\n"));
    assert_eq!(e.to_string(), "tollgate.toml:6:7: rules[0].key: \"\" is not a header name");
    // client_ip without the proxies it trusts.
    let e = error(&format!(
        "{FREE}[[rules]]\nname = \"api\"\npolicy = \"free\"\nkey = \"client_ip\"\n"
    ));
    assert_eq!(place(&e), (Some(6), Some(7), Some("rules[0].key")));
}

#[test]
fn a_rule_naming_an_unknown_policy_is_refused() {
    let rule = |rest: &str| format!("{FREE}[[rules]]\nname = \"api\"\n{rest}");
    #[rustfmt::skip]
    let cases = [
        (rule("policy = \"fre\"\n"), Is("tollgate.toml:5:10: rules[0].policy: no policy named \"fre\"; defined: free")),
        (rule("plan = { header = \"x-plan\", policies = [\"free\", \"gold\"], otherwise = \"pass\" }\n"), At(5, 49, "rules[0].plan.policies[1]")),
        (rule("plan = { header = \"x-plan\", policies = [\"free\"], otherwise = \"policy:pro\" }\n"), Is("tollgate.toml:5:62: rules[0].plan.otherwise: \"pro\" is not one of the plan's policies (free)")),
        // A rule without a policy; two rules with one name.
        (rule(""), At(4, 8, "rules[0]")),
        (rule("policy = \"free\"\n[[rules]]\nname = \"api\"\npolicy = \"free\"\n"), Is("tollgate.toml:7:8: rules[1].name: a rule named \"api\" is already defined on line 4")),
    ];
    refused(&cases);
}

#[test]
fn settings_for_another_key_are_refused() {
    let rule =
        |extra: &str| format!("{FREE}[[rules]]\nname = \"api\"\npolicy = \"free\"\n{extra}\n");
    #[rustfmt::skip]
    let cases = [
        // (the rule's extra settings, the error expected)
        ("trusted_proxies = [\"10.0.0.0/8\"]", Is("tollgate.toml:6:19: rules[0].trusted_proxies: applies to the `client_ip` key only")),
        ("key = \"method\"\nipv6_prefix = 48", At(7, 15, "rules[0].ipv6_prefix")),
        ("ipv6_prefix = 129", Is("tollgate.toml:6:15: rules[0].ipv6_prefix: must be at most 128 (bits)")),
        ("forwarded_header = \"x-real-ip\"", At(6, 20, "rules[0].forwarded_header")),
    ];
    refused(&cases.map(|(extra, says)| (rule(extra), says)));
    let e = error(&rule("key = \"client_ip\"\ntrusted_proxies = []\nforwarded_header = \"via\""));
    assert_eq!(place(&e), (Some(8), Some(20), Some("rules[0].forwarded_header")));
    assert!(e.message().starts_with("unknown variant `via`"), "{e}");
}

/// The example in the module's documentation is a valid file.
#[test]
fn the_documented_example_parses() {
    let docs = include_str!("../../src/config/mod.rs");
    let start = docs.find("//! ```toml\n").expect("a TOML example") + "//! ```toml\n".len();
    let len = docs[start..].find("//! ```\n").expect("its end");
    let text: String = docs[start..start + len]
        .lines()
        .map(|l| l.strip_prefix("//!").unwrap_or(l).strip_prefix(' ').unwrap_or(""))
        .map(|l| format!("{l}\n"))
        .collect();
    let config = LimitsConfig::from_toml(&text, "docs.toml").unwrap();
    assert_eq!(config.policies().map(Policy::name).collect::<Vec<_>>(), ["per-ip", "free", "pro"]);
    assert_eq!(config.rule_names().collect::<Vec<_>>(), ["per-ip", "plans"]);
}

#[test]
fn a_bad_cidr_is_named_in_its_list() {
    #[rustfmt::skip]
    let cases = [
        (format!("{FREE}[[rules]]\nname = \"api\"\npolicy = \"free\"\nallow_cidrs = [\"10.0.0.0/8\", \"10.0.0.0/33\"]\n"), Is("tollgate.toml:6:30: rules[0].allow_cidrs[1]: \"10.0.0.0/33\" is not a CIDR (\"10.0.0.0/8\") or an address")),
        (format!("{FREE}[[rules]]\nname = \"api\"\npolicy = \"free\"\nkey = \"client_ip\"\ntrusted_proxies = [\"proxy.internal\"]\n"), At(7, 20, "rules[0].trusted_proxies[0]")),
    ];
    refused(&cases);
}

#[test]
fn syntax_errors_and_unreadable_files_say_where_they_can() {
    let e = error("[policies.free]\n[policies.free]\n");
    assert_eq!((e.line(), e.field()), (Some(2), None));
    assert!(e.to_string().starts_with("tollgate.toml:2:"), "{e}");
    let e = error("[[rules]\n");
    assert_eq!((e.line(), e.field()), (Some(1), None));

    let missing = Path::new(env!("CARGO_MANIFEST_DIR")).join("no-such-file.toml");
    let e = LimitsConfig::load(&missing).unwrap_err();
    assert_eq!((e.line(), e.column(), e.field()), (None, None, None));
    assert_eq!(e.file(), missing.display().to_string());
    assert!(e.message().starts_with("cannot read: "), "{e}");
    let io = std::error::Error::source(&e).unwrap().downcast_ref::<std::io::Error>().unwrap();
    assert_eq!(io.kind(), std::io::ErrorKind::NotFound);

    let dir = TempDir::new("utf8");
    let path = dir.0.join("bad.toml");
    std::fs::write(&path, b"[policies.a]\n# caf\xe9\n").unwrap();
    let e = LimitsConfig::load(&path).unwrap_err();
    assert_eq!(place(&e), (Some(2), Some(6), None));
    assert_eq!(e.message(), "not UTF-8");
}

/// Two policies on global keys: `stable`, 40 an hour on `/stable`, and `changing`, `count` an
/// hour on `/changing`.
fn two_policies(count: u64) -> String {
    format!(
        r#"
[policies.stable]
tiers = [{{ name = "stable", count = 40, period = "1h" }}]
[policies.changing]
tiers = [{{ name = "changing", count = {count}, period = "1h" }}]

[[rules]]
name = "stable"
paths = ["/stable"]
key = "global"
policy = "stable"

[[rules]]
name = "changing"
paths = ["/changing"]
key = "global"
policy = "changing"
"#
    )
}

fn two_routes(layer: LimitsLayer) -> Router {
    Router::new()
        .route("/stable", route_get(|| async { "stable" }))
        .route("/changing", route_get(|| async { "changing" }))
        .layer(layer)
}

/// Waits (on real time, at most 10 s) until `done` reaches `n`.
async fn until(done: &AtomicUsize, n: usize) {
    for _ in 0..10_000 {
        if done.load(Ordering::SeqCst) >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!("only {} of {n} requests answered", done.load(Ordering::SeqCst));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_under_traffic_fail_no_request_and_keep_unchanged_counts() {
    let layer =
        LimitsLayer::new(LimitsConfig::from_toml(&two_policies(5), "v0.toml").unwrap()).unwrap();
    let handle = layer.handle();
    let server = serve(two_routes(layer)).await;
    let url = Arc::new((server.url("/stable"), server.url("/changing")));

    // 8 clients, 40 requests each, half to each route: 320 requests, 160 to `/stable`.
    let done = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for _ in 0..8 {
        let (url, done) = (Arc::clone(&url), Arc::clone(&done));
        clients.push(tokio::spawn(async move {
            let c = client();
            let mut stable_admitted = 0;
            let mut statuses = Vec::new();
            for i in 0..40 {
                let target = if i % 2 == 0 { &url.0 } else { &url.1 };
                let reply = get(&c, target, &[]).await;
                if i % 2 == 0 && reply.status == StatusCode::OK {
                    stable_admitted += 1;
                }
                statuses.push(reply.status);
                done.fetch_add(1, Ordering::SeqCst);
            }
            (stable_admitted, statuses)
        }));
    }
    // Five reloads while they run, after every 40 answers: `changing` changes each time (bound
    // afresh), `stable` never does.
    for (i, count) in [10, 20, 30, 40, 50].into_iter().enumerate() {
        until(&done, 40 * (i + 1)).await;
        let config = LimitsConfig::from_toml(&two_policies(count), format!("v{}.toml", i + 1));
        let report = handle.reload(config.unwrap()).unwrap();
        assert_eq!(
            (report.kept(), report.changed()),
            (&["stable".to_owned()][..], &["changing".to_owned()][..])
        );
    }
    assert!(done.load(Ordering::SeqCst) < 320, "the reloads happened under traffic");

    let mut stable_admitted = 0;
    for client in clients {
        let (admitted, statuses) = client.await.expect("no client task failed");
        stable_admitted += admitted;
        for status in statuses {
            assert!(
                status == StatusCode::OK || status == StatusCode::TOO_MANY_REQUESTS,
                "{status}"
            );
        }
    }
    // Exactly its quota across five reloads: its limiter, and its count, were kept.
    assert_eq!(stable_admitted, 40);
    assert_eq!(handle.config().file(), "v5.toml");

    // A changed quota applies to the requests after the reload, from a full budget.
    handle.reload(LimitsConfig::from_toml(&two_policies(3), "v6.toml").unwrap()).unwrap();
    let c = client();
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let reply = get(&c, &url.1, &[]).await;
        assert_eq!(reply.header("ratelimit-policy"), Some(r#""changing";q=3;w=3600"#));
        statuses.push(reply.status.as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    assert_eq!(get(&c, &url.0, &[]).await.status, StatusCode::TOO_MANY_REQUESTS);
}

/// One policy, `count` an hour on a global key, starting changed tiers as `carry` says.
fn carrying(count: u64, carry: &str) -> String {
    crate::support::config_files::global_api(&format!(
        "changed_tiers = \"{carry}\"\ntiers = [{{ name = \"api\", count = {count}, period = \"1h\" }}]"
    ))
}

#[tokio::test]
async fn a_reload_can_carry_the_used_share_of_a_changed_quota() {
    let config = |count, carry, file| LimitsConfig::from_toml(&carrying(count, carry), file);
    let layer = LimitsLayer::new(config(10, "carry_used_fraction", "v1.toml").unwrap()).unwrap();
    let handle = layer.handle();
    let server = serve(Router::new().route("/", route_get(|| async { "ok" })).layer(layer)).await;
    let c = client();
    let url = server.url("/");
    for _ in 0..4 {
        assert_eq!(get(&c, &url, &[]).await.status, StatusCode::OK);
    }
    // Doubled: 4 of 10 used is 8 of 20, so the next request leaves 11.
    handle.reload(config(20, "carry_used_fraction", "v2.toml").unwrap()).unwrap();
    let reply = get(&c, &url, &[]).await;
    let ratelimit = reply.header("ratelimit").unwrap_or_default();
    assert!(ratelimit.starts_with(r#""api";r=11;"#), "{ratelimit}");
    // The default starts a changed tier full.
    handle.reload(config(30, "start_full", "v3.toml").unwrap()).unwrap();
    let reply = get(&c, &url, &[]).await;
    let ratelimit = reply.header("ratelimit").unwrap_or_default();
    assert!(ratelimit.starts_with(r#""api";r=29;"#), "{ratelimit}");
    // A misspelt rule is refused where it is written.
    let e = error(&carrying(30, "carry_everything"));
    assert_eq!(place(&e).2, Some("policies.api.changed_tiers"), "{e}");
}

#[tokio::test]
async fn a_refused_file_leaves_the_running_configuration() {
    let dir = TempDir::new("refused");
    let path = dir.write("tollgate.toml", &two_policies(2));
    let layer = LimitsLayer::new(LimitsConfig::load(&path).unwrap()).unwrap();
    let handle = layer.handle();
    let server = serve(two_routes(layer)).await;
    let c = client();
    assert_eq!(get(&c, &server.url("/changing"), &[]).await.status, StatusCode::OK);

    // A zero count: refused at its line, nothing changes.
    std::fs::write(&path, two_policies(0)).unwrap();
    let e = handle.reload_from(&path).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}:5:39: policies.changing.tiers[0].count: tier `changing`: count must be at least 1",
            path.display()
        )
    );
    // Not TOML, then gone: refused too.
    std::fs::write(&path, "[policies\n").unwrap();
    assert_eq!(handle.reload_from(&path).unwrap_err().line(), Some(1));
    std::fs::remove_file(&path).unwrap();
    assert_eq!(handle.reload_from(&path).unwrap_err().line(), None);

    // The running configuration still counts from where it was: one left, then none.
    let statuses = [
        get(&c, &server.url("/changing"), &[]).await.status.as_u16(),
        get(&c, &server.url("/changing"), &[]).await.status.as_u16(),
    ];
    assert_eq!(statuses, [200, 429]);
    assert_eq!(handle.config().policy("changing").unwrap().tiers()[0].quota().count(), 2);
}

/// Runs the watcher until `done` holds, on the paused clock (which does not jump while the
/// watcher reads the file): at most 100 ticks.
async fn watch_until(
    handle: &ReloadHandle,
    logs: &Captured,
    done: impl Fn(&ReloadHandle, &str) -> bool,
) {
    for _ in 0..100 {
        if done(handle, &logs.text()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the watcher did not get there; logs:\n{}", logs.text());
}

#[tokio::test(start_paused = true)]
async fn the_watcher_reloads_changes_and_logs_refused_files() {
    let logs = Captured::start(tracing::Level::INFO);

    let dir = TempDir::new("watch");
    let path = dir.write("tollgate.toml", &two_policies(2));
    let store = MemoryStore::builder().clock(TokioClock::new()).build().unwrap();
    let layer = LimitsLayer::with_store(LimitsConfig::load(&path).unwrap(), store).unwrap();
    let handle = layer.handle();
    let stable = handle.limiter("stable").unwrap();
    stable.check(&Key::Global, 3).await.unwrap();
    let watcher = tokio::spawn(handle.clone().watch(path.clone(), Duration::from_millis(100)));

    // A change: reloaded, and the unchanged policy keeps its count.
    std::fs::write(&path, two_policies(7)).unwrap();
    watch_until(&handle, &logs, |h, _| {
        h.config().policy("changing").unwrap().tiers()[0].quota().count() == 7
    })
    .await;
    let left = handle.limiter("stable").unwrap().check(&Key::Global, 0).await.unwrap();
    assert_eq!(left.tiers()[0].remaining(), 37);
    assert!(logs.text().contains("tollgate: limits reloaded"), "{}", logs.text());
    assert!(logs.text().contains(r#"kept=["stable"] changed=["changing"]"#), "{}", logs.text());

    // A refused file: logged with its place, the running configuration stays.
    std::fs::write(
        &path,
        two_policies(7)
            .replace("count = 40, period = \"1h\"", "count = 40, period = \"1 fortnight\""),
    )
    .unwrap();
    let place =
        format!("{}:3:50: policies.stable.tiers[0].period: invalid duration", path.display());
    watch_until(&handle, &logs, |_, text| text.contains(&place)).await;
    assert!(logs.text().contains("tollgate: limits file refused; the running configuration stays"));
    assert_eq!(handle.config().policy("changing").unwrap().tiers()[0].quota().count(), 7);
    assert_eq!(
        handle.limiter("stable").unwrap().check(&Key::Global, 0).await.unwrap().tiers()[0]
            .remaining(),
        37
    );
    // Refused once, logged once, however many ticks pass.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(logs.text().matches(&place).count(), 1);

    // Fixed: reloaded again.
    std::fs::write(&path, two_policies(9)).unwrap();
    watch_until(&handle, &logs, |h, _| {
        h.config().policy("changing").unwrap().tiers()[0].quota().count() == 9
    })
    .await;

    // The watcher ends by itself when nothing serves the configuration any more.
    drop((layer, handle, stable));
    tokio::time::timeout(Duration::from_secs(1), watcher)
        .await
        .expect("the watcher ended")
        .unwrap();
}

#[tokio::test]
async fn limits_services_pass_the_inner_error_through_and_poll_it_ready() {
    let config = LimitsConfig::from_toml(&two_policies(1), "t.toml").unwrap();
    let mut svc = LimitsLayer::new(config).unwrap().layer(service_fn(
        |_req: Request<RequestBody<Body>>| async { Err::<http::Response<Body>, _>("inner failed") },
    ));
    std::future::poll_fn(|cx| svc.poll_ready(cx)).await.unwrap();
    let req = Request::get("/elsewhere").body(Body::empty()).unwrap();
    assert_eq!(svc.call(req).await.unwrap_err(), "inner failed");
    let req = Request::get("/stable").body(Body::empty()).unwrap();
    assert_eq!(svc.ready().await.unwrap().call(req).await.unwrap_err(), "inner failed");
}

#[tokio::test]
async fn rules_apply_to_their_methods_only() {
    let config = LimitsConfig::from_toml(
        &format!("{FREE}[[rules]]\nname = \"writes\"\nmethods = [\"POST\"]\nkey = \"global\"\npolicy = \"free\"\n"),
        "t.toml",
    )
    .unwrap();
    let layer = LimitsLayer::new(config).unwrap();
    let app = Router::new()
        .route("/items", route_get(|| async { "list" }).merge(route_post(|| async { "made" })))
        .layer(layer);
    let server = serve(app).await;
    let c = client();
    assert_eq!(get(&c, &server.url("/items"), &[]).await.header("ratelimit"), None);
    let req = Request::post(server.url("/items")).body(http_body_util::Full::default()).unwrap();
    let reply = support::send(&c, req).await;
    assert_eq!(reply.header("ratelimit"), Some(r#""free";r=99;t=1"#));
}

/// One rule shaping global requests under `p`, `count` a second, held up to 5 s.
fn shaping(count: u64) -> String {
    format!(
        "[policies.p]\ntiers = [{{ name = \"p\", count = {count}, period = \"1s\" }}]\n\
         [[rules]]\nname = \"p\"\nkey = \"global\"\npolicy = \"p\"\nmax_delay = \"5s\"\n"
    )
}

#[tokio::test(start_paused = true)]
async fn a_request_in_progress_finishes_under_the_configuration_it_started_with() {
    let store = MemoryStore::builder().clock(TokioClock::new()).build().unwrap();
    let config = LimitsConfig::from_toml(&shaping(1), "v1.toml").unwrap();
    let layer = LimitsLayer::with_store(config, store).unwrap();
    let handle = layer.handle();
    let svc = layer.layer(service_fn(|_req: Request<RequestBody<Body>>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(Body::from("ok")))
    }));
    let request = || Request::get("/").body(Body::empty()).unwrap();
    let first = svc.clone().oneshot(request()).await.unwrap();
    assert_eq!(header(&first, "ratelimit-policy").unwrap(), r#""p";q=1;w=1"#);
    // The second is held for its slot, 1 s away ...
    let start = tokio::time::Instant::now();
    let held = tokio::spawn(svc.clone().oneshot(request()));
    tokio::task::yield_now().await;
    assert!(!held.is_finished());
    // ... while the configuration changes under it.
    let report = handle.reload(LimitsConfig::from_toml(&shaping(100), "v2.toml").unwrap()).unwrap();
    assert_eq!(report.changed(), ["p"]);
    let after = svc.clone().oneshot(request()).await.unwrap();
    assert_eq!(header(&after, "ratelimit-policy").unwrap(), r#""p";q=100;w=1"#);
    assert_eq!(start.elapsed(), Duration::ZERO, "the new configuration has a full budget");
    // It finishes under the old one: its slot, its headers.
    let held = held.await.unwrap().unwrap();
    assert_eq!(held.status(), StatusCode::OK);
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    assert_eq!(header(&held, "ratelimit-policy").unwrap(), r#""p";q=1;w=1"#);
}

/// A reload never lifts every limit by accident: a file with no policy (an empty file reads
/// as valid TOML) or with none of the running ones is refused unless it says so.
#[test]
fn a_reload_that_drops_every_policy_is_refused_unless_the_file_says_so() {
    let config = LimitsConfig::from_toml(&two_policies(2), "v1.toml").unwrap();
    let layer = LimitsLayer::new(config).unwrap();
    let handle = layer.handle();
    let before = handle.limiter("stable").unwrap();
    assert!(before.check_now(&Key::Global, 1).is_allowed());

    let empty = handle.reload(LimitsConfig::from_toml("", "empty.toml").unwrap()).unwrap_err();
    assert_eq!(empty.line(), None);
    assert!(empty.to_string().starts_with("empty.toml: defines no policy"), "{empty}");
    let renamed = "[policies.other]\ntiers = [{ name = \"other\", count = 1, period = \"1h\" }]\n";
    let renamed = handle.reload(LimitsConfig::from_toml(renamed, "renamed.toml").unwrap());
    let renamed = renamed.unwrap_err().to_string();
    assert!(renamed.starts_with("renamed.toml: keeps none of the running policies"), "{renamed}");
    // Refused: the running configuration and its state stay.
    assert_eq!(handle.config().file(), "v1.toml");
    let left = handle.limiter("stable").unwrap().check_now(&Key::Global, 0);
    assert_eq!(left.tiers()[0].remaining(), 39);

    // Said explicitly: applied.
    let none = LimitsConfig::from_toml("replace_all = true\n", "none.toml").unwrap();
    assert!(none.replaces_all());
    let report = handle.reload(none).unwrap();
    assert_eq!(report.removed(), ["changing", "stable"]);
    assert!(handle.limiter("stable").is_none());
}

/// A file rewritten in place (truncated, then written again with the same content, as `cp`,
/// a shell redirection or an editor do) keeps every limit, and every key's state, throughout.
#[tokio::test(start_paused = true)]
async fn the_watcher_keeps_the_limits_while_the_file_is_rewritten_in_place() {
    let logs = Captured::start(tracing::Level::INFO);
    let dir = TempDir::new("rewrite");
    let text = "[policies.hourly]\ntiers = [{ name = \"hourly\", count = 5, period = \"1h\" }]\n";
    let path = dir.write("tollgate.toml", text);
    let store = MemoryStore::builder().clock(TokioClock::new()).build().unwrap();
    let layer = LimitsLayer::with_store(LimitsConfig::load(&path).unwrap(), store).unwrap();
    let handle = layer.handle();
    let admitted = |n: usize| {
        let limiter = handle.limiter("hourly").unwrap();
        (0..n).filter(|_| limiter.check_now(&Key::Global, 1).is_allowed()).count()
    };
    assert_eq!(admitted(5), 5);
    let watcher = tokio::spawn(handle.clone().watch(path.clone(), Duration::from_millis(100)));

    std::fs::write(&path, "").unwrap();
    watch_until(&handle, &logs, |_, text| text.contains("defines no policy")).await;
    assert_eq!(admitted(1), 0, "the truncated file lifted the limit");
    std::fs::write(&path, text).unwrap();
    watch_until(&handle, &logs, |_, text| text.contains(r#"kept=["hourly"]"#)).await;
    assert_eq!(admitted(3), 0, "the rewritten file started the quota afresh");
    watcher.abort();
}

/// `api`: a daily quota of 500 on a global key, with `minute` a per-minute tier beside it that
/// never limits.
fn daily(minute: bool) -> String {
    let extra = if minute { r#"{ name = "minute", count = 100000, period = "1m" }, "# } else { "" };
    format!(
        "[policies.api]\ntiers = [{extra}{{ name = \"day\", count = 500, period = \"1d\" }}]\n\
         [[rules]]\nname = \"api\"\nkey = \"global\"\npolicy = \"api\"\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_lose_no_charge_made_during_them_on_an_unchanged_tier() {
    // 1,000 requests in flight while 200 reloads add and remove the per-minute tier: each
    // request decides under the configuration it loaded, and the daily tier, unchanged, admits
    // exactly its 500 (the clock stands still: nothing refills).
    let store = MemoryStore::builder().clock(tollgate::clock::FakeClock::new()).build().unwrap();
    let config = LimitsConfig::from_toml(&daily(false), "v0.toml").unwrap();
    let layer = LimitsLayer::with_store(config, store).unwrap();
    let handle = layer.handle();
    let svc = layer.layer(service_fn(|_req: Request<RequestBody<Body>>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(Body::empty()))
    }));
    let requests: Vec<_> = (0..1_000)
        .map(|_| {
            let svc = svc.clone();
            tokio::spawn(async move {
                tokio::task::yield_now().await;
                let req = Request::get("/").body(Body::empty()).unwrap();
                svc.oneshot(req).await.unwrap().status()
            })
        })
        .collect();
    let reloads = std::thread::spawn(move || {
        for i in 0..200 {
            let config = LimitsConfig::from_toml(&daily(i % 2 == 0), format!("v{i}.toml"));
            handle.reload(config.unwrap()).unwrap();
            std::thread::yield_now();
        }
    });
    let mut admitted = 0;
    for request in requests {
        let status = request.await.unwrap();
        assert!(status == StatusCode::OK || status == StatusCode::TOO_MANY_REQUESTS, "{status}");
        admitted += usize::from(status == StatusCode::OK);
    }
    reloads.join().unwrap();
    assert_eq!(admitted, 500);
}
