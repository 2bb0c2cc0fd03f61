//! End-to-end over real HTTP on loopback: status codes, headers (parsed with an RFC 9651
//! parser), Retry-After, problem+json, per-route policies, keys, refunds, concurrency.
#![cfg(feature = "axum")]

use crate::support;

use std::time::Duration;

use axum::Router;
use axum::routing::get as route_get;
use http::StatusCode;
use support::{client, get, serve, serve_without_connect_info};
use tollgate::key::{ClientIp, HeaderKey};
use tollgate::{Algorithm, HeaderStyle, MissingKey, Policy, Quota, RateLimitLayer};

/// `[(name, [(param, integer)])]` from a structured-field List, asserting its syntax.
fn sf_list(value: &str) -> Vec<(String, Vec<(String, i64)>)> {
    let list: sfv::List = sfv::Parser::new(value).parse().expect("RFC 9651 list");
    list.into_iter()
        .map(|entry| match entry {
            sfv::ListEntry::Item(item) => {
                let name = item.bare_item.as_string().expect("policy name is a String");
                let params = item
                    .params
                    .iter()
                    .map(|(k, v)| {
                        (k.as_str().to_owned(), i64::from(v.as_integer().expect("integer")))
                    })
                    .collect();
                (name.as_str().to_owned(), params)
            }
            sfv::ListEntry::InnerList(_) => panic!("unexpected inner list in {value}"),
        })
        .collect()
}

fn p(pairs: &[(&str, i64)]) -> Vec<(String, i64)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
}

fn app(
    layer: RateLimitLayer<impl tollgate::key::KeyExtractor, tollgate::store::MemoryStore>,
) -> Router {
    Router::new().route("/", route_get(|| async { "ok" })).layer(layer)
}

#[tokio::test]
async fn police_429_headers_retry_after_and_problem_body() {
    let policy = Policy::builder("api")
        .tier("burst", Quota::per_second(1).with_burst(2))
        .tier("daily", Quota::per_day(1000))
        .build()
        .unwrap();
    let server = serve(app(RateLimitLayer::builder(policy).build().unwrap())).await;
    let c = client();

    let first = get(&c, &server.url("/"), &[]).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(
        sf_list(first.header("ratelimit-policy").unwrap()),
        [
            // q is the capacity (the burst of 2), w the time to refill it (2 s at 1/s): r never
            // exceeds q.
            ("burst".to_owned(), p(&[("q", 2), ("w", 2)])),
            ("daily".to_owned(), p(&[("q", 1000), ("w", 86400)]))
        ]
    );
    let state = sf_list(first.header("ratelimit").unwrap());
    assert_eq!(state[0], ("burst".to_owned(), p(&[("r", 1), ("t", 1)])));
    // 1,000 per day: one unit back every 86.4 s.
    assert_eq!(state[1], ("daily".to_owned(), p(&[("r", 999), ("t", 87)])));

    let second = get(&c, &server.url("/"), &[]).await;
    assert_eq!(second.status, StatusCode::OK);
    let third = get(&c, &server.url("/"), &[]).await;
    assert_eq!(third.status, StatusCode::TOO_MANY_REQUESTS);
    // About a second to wait, rounded up to whole seconds, never 0.
    assert_eq!(third.header("retry-after"), Some("1"));
    assert_eq!(third.header("cache-control"), Some("no-store"));
    assert_eq!(third.header("content-type"), Some("application/problem+json"));
    let state = sf_list(third.header("ratelimit").unwrap());
    assert_eq!(state[0].1[0], ("r".to_owned(), 0));
    assert_eq!(state[1].1[0], ("r".to_owned(), 998), "a rejected request charges no tier");
    let body = third.json();
    assert_eq!(body["type"], "https://iana.org/assignments/http-problem-types#quota-exceeded");
    assert_eq!(body["status"], 429);
    assert_eq!(body["title"], "Too Many Requests");
    assert_eq!(body["violated-policies"], serde_json::json!(["burst"]));
    assert_eq!(
        body["detail"],
        "quota exceeded; retry after the number of seconds in the Retry-After header"
    );
}

#[tokio::test]
async fn retry_after_rounds_up_whole_seconds() {
    // 1 per 2.5 s: after one request the next fits in 2.5 s -> Retry-After 3.
    let policy = Policy::single("slow", Quota::new(1, Duration::from_millis(2500))).unwrap();
    let server = serve(app(RateLimitLayer::builder(policy).build().unwrap())).await;
    let c = client();
    assert_eq!(get(&c, &server.url("/"), &[]).await.status, StatusCode::OK);
    let r = get(&c, &server.url("/"), &[]).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("retry-after"), Some("3"));
    assert_eq!(sf_list(r.header("ratelimit-policy").unwrap())[0].1, p(&[("q", 1), ("w", 3)]));
}

#[tokio::test]
async fn cost_above_capacity_has_no_retry_after() {
    let policy = Policy::single("p", Quota::per_second(5)).unwrap();
    // A fixed cost above the capacity is refused when the layer is built ...
    let err = RateLimitLayer::builder(policy.clone()).cost(6).build().unwrap_err();
    assert_eq!(err.to_string(), "cost: 6 units exceed the capacity of tier `p` (5 units)");
    // ... a cost computed per request is refused per request.
    let layer = RateLimitLayer::builder(policy).cost_fn(|_| 6).build().unwrap();
    let server = serve(app(layer)).await;
    let r = get(&client(), &server.url("/"), &[]).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.header("retry-after"), None);
    let body = r.json();
    assert_eq!(
        body["detail"],
        "the request costs more than the capacity of the violated policies; it can never be admitted"
    );
    assert_eq!(body["violated-policies"], serde_json::json!(["p"]));
}

#[tokio::test]
async fn per_route_policies_have_separate_budgets() {
    let a =
        RateLimitLayer::builder(Policy::single("a", Quota::per_hour(2)).unwrap()).build().unwrap();
    let b =
        RateLimitLayer::builder(Policy::single("b", Quota::per_hour(1)).unwrap()).build().unwrap();
    let app = Router::new()
        .route("/a", route_get(|| async { "a" }))
        .route_layer(a)
        .merge(Router::new().route("/b", route_get(|| async { "b" })).route_layer(b))
        .route("/free", route_get(|| async { "free" }));
    let server = serve(app).await;
    let c = client();
    let mut statuses = Vec::new();
    for path in ["/a", "/b", "/a", "/b", "/a", "/free", "/free"] {
        statuses.push(get(&c, &server.url(path), &[]).await.status.as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 200, 200]);
    let free = get(&c, &server.url("/free"), &[]).await;
    assert_eq!(free.header("ratelimit"), None, "unlimited routes carry no headers");
}

#[tokio::test]
async fn thousand_concurrent_requests_on_one_key_admit_exactly_the_quota() {
    let policy = Policy::single("hot", Quota::per_hour(100)).unwrap();
    let server = serve(app(RateLimitLayer::builder(policy).build().unwrap())).await;
    let c = client();
    let url = server.url("/");
    let tasks: Vec<_> = (0..1000)
        .map(|_| {
            let c = c.clone();
            let url = url.clone();
            tokio::spawn(async move { get(&c, &url, &[]).await.status })
        })
        .collect();
    let mut ok = 0;
    let mut limited = 0;
    for t in tasks {
        match t.await.unwrap() {
            StatusCode::OK => ok += 1,
            StatusCode::TOO_MANY_REQUESTS => limited += 1,
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!((ok, limited), (100, 900));
}

/// The app allowing `count` requests an hour to each client address, read from the forwarding
/// headers of a peer in `trusted` (a CIDR).
async fn per_client_ip(count: u64, trusted: &str) -> support::Server {
    let policy = Policy::single("ip", Quota::per_hour(count)).unwrap();
    let key = ClientIp::from_cidrs([trusted]).unwrap();
    serve(app(RateLimitLayer::builder(policy).key(key).build().unwrap())).await
}

#[tokio::test]
async fn forged_forwarding_headers_from_an_untrusted_peer_do_not_change_the_key() {
    // The test client connects from 127.0.0.1, which is not trusted here.
    let server = per_client_ip(3, "10.0.0.0/8").await;
    let c = client();
    let mut statuses = Vec::new();
    for i in 0..6 {
        let forged = format!("203.0.113.{i}");
        let r = get(&c, &server.url("/"), &[("x-forwarded-for", &forged), ("x-real-ip", &forged)])
            .await;
        statuses.push(r.status.as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429]);
}

#[tokio::test]
async fn trusted_proxy_forwards_the_right_most_untrusted_hop() {
    let server = per_client_ip(1, "127.0.0.0/8").await;
    let c = client();
    let mut statuses = Vec::new();
    // Two clients behind the proxy, each with a spoofed left part that must be ignored.
    for (spoof, client_ip) in
        [("1.1.1.1", "203.0.113.1"), ("2.2.2.2", "203.0.113.2"), ("3.3.3.3", "203.0.113.1")]
    {
        let xff = format!("{spoof}, {client_ip}");
        statuses
            .push(get(&c, &server.url("/"), &[("x-forwarded-for", &xff)]).await.status.as_u16());
    }
    assert_eq!(statuses, [200, 200, 429]);
}

#[tokio::test]
async fn missing_key_is_a_clear_400_or_passes_when_configured() {
    let policy = Policy::single("p", Quota::per_second(1)).unwrap();
    let brief = RateLimitLayer::builder(policy.clone()).explain_missing_key(false).build().unwrap();
    let server = serve_without_connect_info(app(brief)).await;
    let r = get(&client(), &server.url("/"), &[]).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.json()["detail"], "no rate-limit key could be read from the request");

    let layer = RateLimitLayer::builder(policy.clone())
        .key(HeaderKey::new(http::HeaderName::from_static("x-api-key")))
        .missing_key(MissingKey::Allow)
        .build()
        .unwrap();
    let server = serve(app(layer)).await;
    let c = client();
    for _ in 0..3 {
        assert_eq!(get(&c, &server.url("/"), &[]).await.status, StatusCode::OK);
    }
    assert_eq!(get(&c, &server.url("/"), &[("x-api-key", "k")]).await.status, StatusCode::OK);
    assert_eq!(
        get(&c, &server.url("/"), &[("x-api-key", "k")]).await.status,
        StatusCode::TOO_MANY_REQUESTS
    );

    let layer = RateLimitLayer::builder(policy)
        .key(HeaderKey::new(http::HeaderName::from_static("x-api-key")))
        .missing_key(MissingKey::Shared)
        .build()
        .unwrap();
    let server = serve(app(layer)).await;
    assert_eq!(get(&c, &server.url("/"), &[]).await.status, StatusCode::OK);
    assert_eq!(get(&c, &server.url("/"), &[]).await.status, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test]
async fn refund_on_server_error_gives_the_charge_back() {
    let policy = Policy::single("p", Quota::per_hour(2)).unwrap();
    let layer = RateLimitLayer::builder(policy).refund_if(|s| s.is_server_error()).build().unwrap();
    let app = Router::new()
        .route("/fail", route_get(|| async { (StatusCode::INTERNAL_SERVER_ERROR, "boom") }))
        .route("/ok", route_get(|| async { "ok" }))
        .layer(layer);
    let server = serve(app).await;
    let c = client();
    for _ in 0..5 {
        assert_eq!(
            get(&c, &server.url("/fail"), &[]).await.status,
            StatusCode::INTERNAL_SERVER_ERROR
        );
    }
    let mut statuses = Vec::new();
    for _ in 0..3 {
        statuses.push(get(&c, &server.url("/ok"), &[]).await.status.as_u16());
    }
    assert_eq!(statuses, [200, 200, 429]);
}

#[tokio::test]
async fn legacy_headers_and_custom_rejection() {
    let policy = Policy::builder("p")
        .tier("minute", Quota::per_minute(2))
        .algorithm(Algorithm::FixedWindow)
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(policy)
        .headers(HeaderStyle::Legacy)
        .rejection(|limited| {
            let names: Vec<&str> = limited.violated_tiers().map(|t| t.name()).collect();
            let mut res = http::Response::new(format!("slow down: {}", names.join(",")));
            *res.status_mut() = limited.status();
            res
        })
        .build()
        .unwrap();
    let server = serve(app(layer)).await;
    let c = client();
    let first = get(&c, &server.url("/"), &[]).await;
    assert_eq!(first.header("x-ratelimit-limit"), Some("2"));
    assert_eq!(first.header("x-ratelimit-remaining"), Some("1"));
    assert_eq!(first.header("ratelimit"), None);
    get(&c, &server.url("/"), &[]).await;
    let third = get(&c, &server.url("/"), &[]).await;
    assert_eq!(third.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(&third.body[..], b"slow down: minute");
    assert_eq!(third.header("x-ratelimit-remaining"), Some("0"));
    // The layer adds Retry-After to a custom rejection that has none.
    assert!(third.header("retry-after").is_some());
}

#[tokio::test]
async fn dry_run_reports_but_never_blocks() {
    let policy = Policy::single("p", Quota::per_hour(1)).unwrap();
    let server = serve(app(RateLimitLayer::builder(policy).dry_run(true).build().unwrap())).await;
    let c = client();
    // The first request is admitted and told the truth: nothing remains.
    let r = get(&c, &server.url("/"), &[]).await;
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(sf_list(r.header("ratelimit").unwrap())[0].1[0], ("r".to_owned(), 0));
    // Those the limit would refuse get the handler's response untouched: no `RateLimit`
    // header that would tell a well-behaved client to stop, no `Retry-After`, nothing added.
    for _ in 0..2 {
        let r = get(&c, &server.url("/"), &[]).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.header("ratelimit"), None);
        assert_eq!(r.header("retry-after"), None);
        assert_eq!(r.header("ratelimit-policy"), None);
    }
}

#[tokio::test]
async fn shaping_over_http_delays_then_rejects_over_budget() {
    // 10/s, burst 1, wait at most 250 ms: of 5 simultaneous requests, slots at 0, 100 and
    // 200 ms pass; the other two would wait 300 and 400 ms and are rejected at once.
    let policy =
        Policy::builder("s").tier("s", Quota::per_second(10).with_burst(1)).build().unwrap();
    let layer = RateLimitLayer::builder(policy).shape(Duration::from_millis(250)).build().unwrap();
    let server = serve(app(layer)).await;
    let c = client();
    let url = server.url("/");
    let start = tokio::time::Instant::now();
    let tasks: Vec<_> = (0..5)
        .map(|_| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move {
                let r = get(&c, &url, &[]).await;
                (r.status, start.elapsed())
            })
        })
        .collect();
    let mut ok: Vec<Duration> = Vec::new();
    let mut limited = 0;
    for t in tasks {
        let (status, took) = t.await.unwrap();
        match status {
            StatusCode::OK => ok.push(took),
            StatusCode::TOO_MANY_REQUESTS => limited += 1,
            other => panic!("{other}"),
        }
    }
    ok.sort();
    assert_eq!((ok.len(), limited), (3, 2));
    // Wall-clock lower bounds only: each passed request waited at least for its slot.
    assert!(ok[1] >= Duration::from_millis(100) - Duration::from_millis(5), "{ok:?}");
    assert!(ok[2] >= Duration::from_millis(200) - Duration::from_millis(5), "{ok:?}");
}

#[tokio::test]
async fn layers_sharing_a_store_and_a_policy_name_keep_their_own_budgets() {
    // One store for two routes, the same policy name with different quotas: each route is
    // limited exactly by its own quota (a store keyed by policy name would mix or wipe them).
    let store = tollgate::store::MemoryStore::new();
    let layer = |count| {
        RateLimitLayer::builder(Policy::single("api", Quota::per_hour(count)).unwrap())
            .store(store.clone())
            .build()
            .unwrap()
    };
    let app = Router::new()
        .route("/a", route_get(|| async { "a" }).layer(layer(2)))
        .route("/b", route_get(|| async { "b" }).layer(layer(3)));
    let server = serve(app).await;
    let c = client();
    let (mut a, mut b) = (0, 0);
    for _ in 0..6 {
        a += usize::from(get(&c, &server.url("/a"), &[]).await.status == StatusCode::OK);
        b += usize::from(get(&c, &server.url("/b"), &[]).await.status == StatusCode::OK);
    }
    assert_eq!((a, b), (2, 3));
    assert_eq!(store.len(), 2, "one key per binding");
}

#[tokio::test]
async fn a_handler_matches_on_the_rejection_of_its_own_limiter() {
    use axum::extract::State;
    use axum::response::{IntoResponse, Response};
    use tollgate::key::Key;
    use tollgate::{Limiter, Rejection};

    async fn export(State(limiter): State<Limiter>) -> Response {
        match limiter.enforce(&Key::text("exports"), 1).await {
            Ok(decision) => {
                format!("exported; {} left", decision.tiers()[0].remaining()).into_response()
            }
            Err(Rejection::Limited(limited)) => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("exports paused for {} s", limited.retry_after_secs().unwrap_or(0)),
            )
                .into_response(),
            Err(other) => other.into_response(),
        }
    }
    async fn report(State(limiter): State<Limiter>) -> Result<&'static str, Rejection> {
        limiter.enforce(&Key::text("reports"), 1).await?;
        Ok("report")
    }

    let limiter = Limiter::new(Policy::single("jobs", Quota::per_minute(1)).unwrap());
    let app = Router::new()
        .route("/export", route_get(export))
        .route("/report", route_get(report))
        .with_state(limiter);
    let server = serve(app).await;
    let c = client();
    let first = get(&c, &server.url("/export"), &[]).await;
    assert_eq!((first.status, &first.body[..]), (StatusCode::OK, &b"exported; 0 left"[..]));
    let second = get(&c, &server.url("/export"), &[]).await;
    assert_eq!(
        (second.status, &second.body[..]),
        (StatusCode::SERVICE_UNAVAILABLE, &b"exports paused for 60 s"[..])
    );
    assert_eq!(get(&c, &server.url("/report"), &[]).await.status, StatusCode::OK);
    // `?` turns the rejection into the default 429.
    let limited = get(&c, &server.url("/report"), &[]).await;
    assert_eq!(limited.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(limited.header("retry-after"), Some("60"));
    assert_eq!(limited.header("ratelimit"), Some(r#""jobs";r=0;t=60"#));
    assert_eq!(limited.json()["violated-policies"], serde_json::json!(["jobs"]));
}

/// `POST /login` and `GET /users/{id}` (only user 1 exists: others are the handler's own
/// 404) behind one `route_layer`, on `store`.
fn login_app<St: tollgate::store::Store>(store: St, charge_405: bool) -> Router {
    use axum::extract::Path;
    use axum::routing::post;
    let policy = Policy::single("login", Quota::per_hour(3)).unwrap();
    let layer = RateLimitLayer::builder(policy)
        .store(store)
        .charge_method_not_allowed(charge_405)
        .build()
        .unwrap();
    Router::new()
        .route("/login", post(|| async { "welcome" }))
        .route(
            "/users/{id}",
            route_get(|Path(id): Path<u32>| async move {
                if id == 1 { Ok("ann") } else { Err(StatusCode::NOT_FOUND) }
            }),
        )
        .route_layer(layer)
}

/// Sends `method path` and returns the status, the `Allow` and the `RateLimit` headers.
async fn call(
    c: &support::HttpClient,
    server: &support::Server,
    method: &str,
    path: &str,
) -> (u16, Option<String>, Option<String>) {
    let req = http::Request::builder()
        .method(method)
        .uri(server.url(path))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let reply = support::send(c, req).await;
    let header = |name| reply.header(name).map(str::to_owned);
    (reply.status.as_u16(), header("allow"), header("ratelimit"))
}

/// The login scenario over real HTTP on `store`: three `GET /login`, which axum answers 405
/// from inside the `route_layer`, leave the three `POST`s of the budget; a handler's own 404s
/// are charged; `charge_method_not_allowed(true)` charges the 405s too.
async fn router_refusals_are_not_charged<St: tollgate::store::Store>(store: impl Fn() -> St) {
    let c = client();
    let server = serve(login_app(store(), false)).await;
    for _ in 0..3 {
        let (status, allow, _) = call(&c, &server, "GET", "/login").await;
        assert_eq!((status, allow.as_deref()), (405, Some("POST")));
    }
    let mut posts = Vec::new();
    for _ in 0..4 {
        let (status, _, ratelimit) = call(&c, &server, "POST", "/login").await;
        posts.push((status, ratelimit));
    }
    let r = |n: u32| Some(format!(r#""login";r={n};t={}"#, 1200 * (3 - n)));
    assert_eq!(posts, [(200, r(2)), (200, r(1)), (200, r(0)), (429, r(0))]);
    // Spent: a 405 is now refused like any request.
    assert_eq!(call(&c, &server, "GET", "/login").await.0, 429);

    // A handler's 404 (an id that does not exist) is charged.
    let server = serve(login_app(store(), false)).await;
    let statuses: Vec<u16> = {
        let mut s = Vec::new();
        for path in ["/users/7", "/users/8", "/users/9", "/users/1"] {
            s.push(call(&c, &server, "GET", path).await.0);
        }
        s
    };
    assert_eq!(statuses, [404, 404, 404, 429]);

    // Charged by choice.
    let server = serve(login_app(store(), true)).await;
    for _ in 0..3 {
        assert_eq!(call(&c, &server, "GET", "/login").await.0, 405);
    }
    assert_eq!(call(&c, &server, "POST", "/login").await.0, 429);
}

#[tokio::test]
async fn method_not_allowed_under_route_layer_gives_its_charge_back() {
    use tollgate::clock::FakeClock;
    use tollgate::store::MemoryStore;
    // A clock that stands still: nothing refills while the test runs.
    router_refusals_are_not_charged(|| {
        MemoryStore::builder().clock(FakeClock::new()).build().unwrap()
    })
    .await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn method_not_allowed_under_route_layer_gives_its_charge_back_on_redis() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tollgate::clock::FakeClock;
    use tollgate::store::RedisStore;
    let Some(redis) = support::redis::Server::start("redis-server") else { return };
    let url = redis.url();
    let n = AtomicUsize::new(0);
    router_refusals_are_not_charged(|| {
        RedisStore::builder(&url)
            .clock(FakeClock::new())
            // One prefix per app: each starts with the whole budget.
            .prefix(format!("t{}:", n.fetch_add(1, Ordering::Relaxed)))
            .ttl_grace(Duration::from_secs(3600))
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap()
    })
    .await;
}

/// The 405 is given back whatever decides the policy: the memory store's compact form (given
/// back by key, without a ticket), its general tables (a ticket: other algorithms, a calendar
/// tier beside the rate, a penalty box), and a shaping layer (decided on the slow path).
#[tokio::test]
async fn a_405_is_given_back_on_every_path_of_the_memory_store() {
    use axum::routing::post;
    use tollgate::clock::FakeClock;
    use tollgate::store::MemoryStore;
    use tollgate::{Calendar, Penalty};
    let hour = Duration::from_secs(3600);
    let policies = [
        ("gcra", Policy::builder("p").tier("t", Quota::per_hour(3)), None),
        (
            "token bucket",
            Policy::builder("p").algorithm(Algorithm::TokenBucket).tier("t", Quota::per_hour(3)),
            None,
        ),
        (
            "sliding log",
            Policy::builder("p").algorithm(Algorithm::SlidingLog).tier("t", Quota::per_hour(3)),
            None,
        ),
        (
            "calendar beside",
            Policy::builder("p")
                .tier("t", Quota::per_hour(3))
                .calendar("d", Calendar::per_day(100)),
            None,
        ),
        (
            "penalty box",
            Policy::builder("p").tier("t", Quota::per_hour(3)).penalty("t", Penalty::new(hour)),
            None,
        ),
        (
            "shaping",
            Policy::builder("p").tier("t", Quota::per_hour(3)),
            Some(Duration::from_millis(1)),
        ),
    ]
    .map(|(name, p, shape)| (name, p.build().unwrap(), shape));
    let c = client();
    for (name, policy, shape) in policies {
        let store = MemoryStore::builder().clock(FakeClock::new()).build().unwrap();
        let mut builder = RateLimitLayer::builder(policy).store(store);
        if let Some(max) = shape {
            builder = builder.shape(max);
        }
        let layer = builder.build().unwrap();
        let app = Router::new().route("/login", post(|| async { "welcome" })).route_layer(layer);
        let server = serve(app).await;
        let mut seen = Vec::new();
        for method in ["GET", "GET", "GET", "POST", "POST", "POST", "POST"] {
            seen.push(call(&c, &server, method, "/login").await.0);
        }
        assert_eq!(seen, [405, 405, 405, 200, 200, 200, 429], "{name}");
    }
}

/// Under `Router::layer` the 405 reaches the layer with its `Allow` header, and is given back
/// too; the router's 404 for an unknown path cannot be told from a handler's, and is charged.
#[tokio::test]
async fn under_router_layer_a_405_is_given_back_and_a_404_is_charged() {
    use axum::routing::post;
    use tollgate::clock::FakeClock;
    use tollgate::store::MemoryStore;
    let store = MemoryStore::builder().clock(FakeClock::new()).build().unwrap();
    let policy = Policy::single("login", Quota::per_hour(3)).unwrap();
    let layer = RateLimitLayer::builder(policy).store(store).build().unwrap();
    let app = Router::new().route("/login", post(|| async { "welcome" })).layer(layer);
    let server = serve(app).await;
    let c = client();
    let mut seen = Vec::new();
    for (method, path) in [
        ("GET", "/login"),
        ("PUT", "/login"),
        ("POST", "/login"),
        ("GET", "/nowhere"),
        ("POST", "/login"),
        ("POST", "/login"),
    ] {
        seen.push(call(&c, &server, method, path).await.0);
    }
    assert_eq!(seen, [405, 405, 200, 404, 200, 429]);
}

/// The README's login recipe, over real HTTP on a clock moved by hand: a sliding log of
/// `Quota::per_minute(3)` admits at most 3 `POST /login` in any 60 s, `(t - 60 s, t]`, and the
/// same quota under GCRA (the default) admits 5 in the first minute (a burst of 3, then one
/// every 20 s).
#[tokio::test]
async fn login_recipe_admits_at_most_three_in_any_minute() {
    use axum::routing::post;
    use tollgate::clock::FakeClock;
    use tollgate::store::MemoryStore;

    /// The most instants of `admitted` (ms, ascending) in any `(t - 60 s, t]`: such a window
    /// holds the most when it ends at an admitted instant.
    fn most_in_any_minute(admitted: &[u64]) -> usize {
        let window =
            |&end: &u64| admitted.iter().filter(|&&a| a + 60_000 > end && a <= end).count();
        admitted.iter().map(window).max().unwrap_or(0)
    }

    // Gaps between requests: 500 ms for 4 minutes, then 4 minutes of pseudo-random ones
    // (0 to 30 s, several requests in one instant included).
    let mut seed = 0x2545_f491_u64;
    let random = std::iter::from_fn(move || {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        Some(match (seed >> 33) % 4 {
            0 => 0,
            _ => (seed >> 40) % 30_001,
        })
    });
    let regular = std::iter::repeat_n(500, 480);
    for (algorithm, first_minute, most) in [(Algorithm::SlidingLog, 3, 3), (Algorithm::Gcra, 5, 5)]
    {
        for (schedule, gaps) in [
            ("regular", regular.clone().collect::<Vec<_>>()),
            (
                "random",
                random
                    .clone()
                    .scan(0, |t, gap| {
                        (*t < 240_000).then(|| {
                            *t += gap;
                            gap
                        })
                    })
                    .collect(),
            ),
        ] {
            let clock = FakeClock::new();
            let store = MemoryStore::builder().clock(clock.clone()).build().unwrap();
            let login = Policy::builder("login")
                .algorithm(algorithm)
                .tier("minute", Quota::per_minute(3))
                .build()
                .unwrap();
            let layer = RateLimitLayer::builder(login).store(store).build().unwrap();
            let app =
                Router::new().route("/login", post(|| async { "welcome" })).route_layer(layer);
            let server = serve(app).await;
            let c = client();
            let (mut now, mut admitted) = (0, Vec::new());
            let mut gaps = gaps.into_iter();
            // The first request at 0.
            let mut gap = 0;
            loop {
                clock.advance(Duration::from_millis(gap));
                now += gap;
                let (status, _, _) = call(&c, &server, "POST", "/login").await;
                match status {
                    200 => admitted.push(now),
                    429 => {}
                    other => panic!("status {other}"),
                }
                match gaps.next() {
                    Some(next) => gap = next,
                    None => break,
                }
            }
            let case = format!("{algorithm:?}, {schedule} schedule");
            if schedule == "regular" {
                let first = admitted.iter().filter(|&&a| a < 60_000).count();
                assert_eq!(first, first_minute, "{case}: admitted {admitted:?}");
            }
            assert_eq!(most_in_any_minute(&admitted), most, "{case}: admitted {admitted:?}");
        }
    }
}

/// An HTTP/1.1 upload refused before its body is read is answered with `Connection: close`
/// (the server will not read the rest, and closes): the client sends its next request on a
/// new connection, never on the one closing. Requests without a body, or with a small one the
/// server reads off, keep their connection.
#[tokio::test]
async fn a_refused_upload_closes_its_connection_and_the_next_request_is_served() {
    let policy = Policy::single("uploads", Quota::per_hour(1000)).unwrap();
    let layer = RateLimitLayer::builder(policy)
        .key(HeaderKey::new(http::HeaderName::from_static("x-api-key")))
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/",
            route_get(|| async { "ok" })
                .post(|body: axum::body::Bytes| async move { body.len().to_string() }),
        )
        .layer(layer);
    let server = serve(app).await;
    let c = client();
    let post = |key: &str, len: usize| {
        http::Request::post(server.url("/"))
            .header("x-api-key", key)
            .body(http_body_util::Full::new(bytes::Bytes::from(vec![b'x'; len])))
            .unwrap()
    };
    let upload = |key: &str| post(key, 1 << 20);
    // Key "a" spends its burst of 1,000 on requests without a body: connections kept.
    for _ in 0..1000 {
        let ok = get(&c, &server.url("/"), &[("x-api-key", "a")]).await;
        assert_eq!(ok.status, StatusCode::OK);
        assert_eq!(ok.header("connection"), None);
    }
    let refused = get(&c, &server.url("/"), &[("x-api-key", "a")]).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.header("connection"), None, "a refusal without a body keeps the connection");
    for round in 0..20 {
        let small = support::send(&c, post("a", 100)).await;
        assert_eq!(small.status, StatusCode::TOO_MANY_REQUESTS, "round {round}");
        assert_eq!(small.header("connection"), None, "round {round}");
        let refused = support::send(&c, upload("a")).await;
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "round {round}");
        assert_eq!(refused.header("connection"), Some("close"), "round {round}");
        let served = support::send(&c, upload("b")).await;
        assert_eq!(served.status, StatusCode::OK, "round {round}");
        assert_eq!(served.body, (1 << 20).to_string(), "round {round}");
        assert_eq!(served.header("connection"), None, "round {round}");
    }
}

/// A 2 MB upload the limit refuses before its body is read, over a real connection: a client
/// that sends `Expect: 100-continue` and waits gets the 429 (with `Connection: close`) and no
/// `100 Continue`, so it sends no body (RFC 9110 §10.1.1); over HTTP/2 a client that writes the
/// whole body gets each 429, the stream ending and the connection staying. (Over HTTP/1 without
/// the expectation, the server closes a connection whose body it will not read, and a client
/// still writing may see a broken pipe instead: what the README warns of.)
#[tokio::test]
async fn a_refused_large_upload_is_answered_with_100_continue_expected_and_over_http2() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let policy = Policy::single("uploads", Quota::per_hour(1)).unwrap();
    let app = Router::new()
        .route("/", route_get(|| async { "ok" }))
        .route(
            "/upload",
            axum::routing::post(|body: bytes::Bytes| async move { body.len().to_string() }),
        )
        .layer(RateLimitLayer::builder(policy).build().unwrap());
    let server = serve(app).await;
    // The peer's one request an hour.
    assert_eq!(get(&client(), &server.url("/"), &[]).await.status, StatusCode::OK);

    let mut stream = tokio::net::TcpStream::connect(server.addr).await.unwrap();
    stream
        .write_all(
            b"POST /upload HTTP/1.1\r\nhost: localhost\r\ncontent-length: 2000000\r\n\
              expect: 100-continue\r\n\r\n",
        )
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut buf))
            .await
            .expect("an answer without the body")
            .unwrap();
        assert!(n > 0, "closed before an answer: {:?}", String::from_utf8_lossy(&head));
        head.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 429 too many requests\r\n"), "{head}");
    assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
    assert!(head.contains("\r\nretry-after: "), "{head}");

    let h2: hyper_util::client::legacy::Client<_, http_body_util::Full<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http();
    for _ in 0..5 {
        let req = http::Request::post(server.url("/upload"))
            .body(http_body_util::Full::new(bytes::Bytes::from(vec![b'x'; 2_000_000])))
            .unwrap();
        let res = h2.request(req).await.expect("the 429, not a failed write");
        assert_eq!(res.version(), http::Version::HTTP_2);
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(res.headers().get(http::header::CONNECTION).is_none());
        // The refusal says its length once (the layer's own; the router adds none).
        let lengths: Vec<_> = res.headers().get_all(http::header::CONTENT_LENGTH).iter().collect();
        assert_eq!(lengths.len(), 1);
        let length: usize = lengths[0].to_str().unwrap().parse().unwrap();
        use http_body_util::BodyExt;
        assert_eq!(res.into_body().collect().await.unwrap().to_bytes().len(), length);
    }
}
