//! ShouldRateLimit's semantics, over gRPC, with exact counts: matching, hits, codes, statuses,
//! shadow mode, unlimited, replaces, quotas, refunds, headers.

use std::time::Duration;

use tollgate_server::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus,
};
use tollgate_server::pb::google::protobuf::UInt64Value;

use crate::support::*;

fn reference(name: &str) -> String {
    std::fs::read_to_string(format!("{}/tests/data/reference/{name}", env!("CARGO_MANIFEST_DIR")))
        .unwrap()
}

#[tokio::test]
async fn nested_descriptors_and_default_values_count_per_value() {
    // Example 2: 5 marketing messages a day per number, 100 messages a day per number.
    let mut s = serve(&[("config.yaml", &reference("example02a.yaml"))], &[]).await;
    let both = req(
        "messaging",
        vec![
            desc(&[("message_type", "marketing"), ("to_number", "2061111111")]),
            desc(&[("to_number", "2061111111")]),
        ],
    );
    assert_eq!(admitted(&mut s, &both, 8).await, 5);
    // Another number has its own counters.
    let other =
        req("messaging", vec![desc(&[("message_type", "marketing"), ("to_number", "2062222222")])]);
    assert_eq!(admitted(&mut s, &other, 7).await, 5);
    // The three refused requests were not counted on the per-number limit: 95 of 100 remain.
    let plain = one("messaging", &[("to_number", "2061111111")]);
    assert_eq!(admitted(&mut s, &plain, 100).await, 95);
    // A new day, a new window.
    s.advance(Duration::from_secs(86_400));
    assert_eq!(admitted(&mut s, &plain, 101).await, 100);
}

#[tokio::test]
async fn a_value_beats_the_default_and_zero_refuses_everything() {
    // Example 3: 10 a second per address, 0 for 50.0.0.5.
    let mut s = serve(&[("config.yaml", &reference("example03a.yaml"))], &[]).await;
    let ip = one("edge_proxy_per_ip", &[("remote_address", "50.0.0.1")]);
    let blocked = one("edge_proxy_per_ip", &[("remote_address", "50.0.0.5")]);
    assert_eq!(admitted(&mut s, &ip, 12).await, 10);
    assert_eq!(admitted(&mut s, &blocked, 3).await, 0);
    let r = s.call(blocked.clone()).await;
    let limit = r.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!((limit.requests_per_unit, limit.unit, r.statuses[0].limit_remaining), (0, 1, 0));
    s.advance(Duration::from_secs(1));
    assert_eq!(admitted(&mut s, &ip, 12).await, 10);
}

#[tokio::test]
async fn a_descriptor_deeper_or_shallower_than_the_limit_is_not_limited() {
    // Example 4 (first file): the limit is at depth 1; a request of depth 2 is not limited.
    let mut s = serve(&[("config.yaml", &reference("example04a.yaml"))], &[]).await;
    let deep = one("example4", &[("key", "value"), ("subkey", "subvalue")]);
    let r = s.call(deep.clone()).await;
    assert_eq!(
        (code(r.overall_code), r.statuses[0].current_limit.clone(), r.statuses[0].limit_remaining),
        (Code::Ok, None, 0)
    );
    assert_eq!(admitted(&mut s, &deep, 400).await, 400);
    let exact = one("example4", &[("key", "value")]);
    assert_eq!(admitted(&mut s, &exact, 301).await, 300);
    // Second file: the limit is at depth 2.
    let mut s = serve(&[("config.yaml", &reference("example04b.yaml"))], &[]).await;
    assert_eq!(admitted(&mut s, &deep, 301).await, 300);
    assert_eq!(s.call(one("example4", &[("key", "value")])).await.statuses[0].current_limit, None);
}

#[tokio::test]
async fn unlimited_answers_ok_with_the_largest_remaining() {
    // Example 5.
    let mut s = serve(&[("config.yaml", &reference("example05a.yaml"))], &[]).await;
    let r = s.call(one("internal", &[("ldap", "x")])).await;
    assert_eq!(
        (code(r.overall_code), r.statuses[0].limit_remaining, r.statuses[0].current_limit.clone()),
        (Code::Ok, u32::MAX, None)
    );
    assert_eq!(admitted(&mut s, &one("internal", &[("azure", "x")]), 101).await, 100);
}

#[tokio::test]
async fn shadow_mode_counts_but_never_refuses() {
    // Example 6: user-a is 10/s in shadow mode, user-b 20/s.
    let mut s = serve(&[("config.yaml", &reference("example06a.yaml"))], &[]).await;
    let a = one("example6", &[("service", "auth-service"), ("user", "user-a")]);
    let b = one("example6", &[("service", "auth-service"), ("user", "user-b")]);
    assert_eq!(admitted(&mut s, &a, 15).await, 15);
    let r = s.call(a.clone()).await;
    // Over its limit: OK, with nothing remaining.
    assert_eq!((code(r.statuses[0].code), r.statuses[0].limit_remaining), (Code::Ok, 0));
    assert_eq!(admitted(&mut s, &b, 25).await, 20);
}

#[tokio::test]
async fn replaces_drops_the_named_limit() {
    // Example 7.
    let mut s = serve(&[("config.yaml", &reference("example07a.yaml"))], &[]).await;
    let k1 = desc(&[("key_1", "value_1"), ("user", "bkthomps")]);
    let k2 = desc(&[("key_2", "value_2"), ("user", "bkthomps")]);
    // Both: the 5/s limit is replaced, the 10/s one applies.
    let both = req("example7", vec![k1.clone(), k2.clone()]);
    assert_eq!(admitted(&mut s, &both, 12).await, 10);
    let r = s.call(both.clone()).await;
    assert_eq!(r.statuses[0].current_limit, None);
    // The 5/s limit was not charged by them.
    s.advance(Duration::from_secs(1));
    assert_eq!(admitted(&mut s, &req("example7", vec![k1]), 7).await, 5);
}

#[tokio::test]
async fn wildcards_match_anywhere_in_the_value() {
    let mut s = serve(&[("config.yaml", &reference("example09b.yaml"))], &[]).await;
    assert_eq!(admitted(&mut s, &one("example9", &[("path", "/api/123/action")]), 21).await, 20);
    // Each matching value has its own counter.
    assert_eq!(
        admitted(&mut s, &one("example9", &[("path", "/api/user-id/action")]), 21).await,
        20
    );
    let r = s.call(one("example9", &[("path", "/api/123/other")])).await;
    assert_eq!(r.statuses[0].current_limit, None);
}

#[tokio::test]
async fn share_threshold_counts_every_match_together() {
    // Example 11: files/* share 10 an hour; files_no_share/* have 10 each.
    let mut s = serve(&[("config.yaml", &reference("example11a.yaml"))], &[]).await;
    assert_eq!(admitted(&mut s, &one("example11", &[("files", "files/a.pdf")]), 5).await, 5);
    assert_eq!(admitted(&mut s, &one("example11", &[("files", "files/b.csv")]), 5).await, 5);
    assert_eq!(admitted(&mut s, &one("example11", &[("files", "files/c.txt")]), 1).await, 0);
    assert_eq!(
        admitted(&mut s, &one("example11", &[("files_no_share", "files_no_share/a.pdf")]), 11)
            .await,
        10
    );
    assert_eq!(
        admitted(&mut s, &one("example11", &[("files_no_share", "files_no_share/b.csv")]), 11)
            .await,
        10
    );
}

const HITS: &str = "
domain: d
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 10, name: ten}
  - key: q
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: r
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 4}
";

#[tokio::test]
async fn hits_addend_of_the_request_and_of_the_descriptor() {
    let mut s = serve(&[("config.yaml", HITS)], &[]).await;
    let mut r = one("d", &[("k", "a")]);
    r.hits_addend = 4;
    let resp = s.call(r.clone()).await;
    assert_eq!((code(resp.overall_code), resp.statuses[0].limit_remaining), (Code::Ok, 6));
    // The descriptor's own hits_addend wins; 0 only looks.
    r.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
    let resp = s.call(r.clone()).await;
    assert_eq!((code(resp.overall_code), resp.statuses[0].limit_remaining), (Code::Ok, 6));
    r.descriptors[0].hits_addend = Some(UInt64Value { value: 7 });
    // 4 used + 7 > 10: refused, and not counted.
    let resp = s.call(r.clone()).await;
    assert_eq!((code(resp.overall_code), resp.statuses[0].limit_remaining), (Code::OverLimit, 0));
    r.descriptors[0].hits_addend = Some(UInt64Value { value: 6 });
    let resp = s.call(r.clone()).await;
    assert_eq!((code(resp.overall_code), resp.statuses[0].limit_remaining), (Code::Ok, 0));
    // More hits than the limit can ever take.
    let mut big = one("d", &[("k", "b")]);
    big.hits_addend = 11;
    assert_eq!(s.codes(big.clone()).await.0, Code::OverLimit);
    big.descriptors[0].hits_addend = Some(UInt64Value { value: u64::MAX });
    assert_eq!(s.codes(big).await.0, Code::OverLimit);
}

#[tokio::test]
async fn statuses_say_the_limit_what_remains_and_when_the_window_ends() {
    let mut s = serve(&[("config.yaml", HITS)], &[]).await;
    s.advance(Duration::from_secs(15));
    let resp = s.call(req("d", vec![desc(&[("k", "a")]), desc(&[("nothing", "x")])])).await;
    let st = &resp.statuses[0];
    let limit = st.current_limit.as_ref().unwrap();
    assert_eq!((limit.name.as_str(), limit.requests_per_unit, limit.unit), ("ten", 10, 2));
    assert_eq!((st.limit_remaining, st.duration_until_reset.as_ref().unwrap().seconds), (9, 45));
    // A descriptor that matches nothing: OK and nothing else.
    assert_eq!(resp.statuses[1], DescriptorStatus { code: Code::Ok as i32, ..Default::default() });
    // An unknown domain: every descriptor OK.
    let resp = s.call(one("elsewhere", &[("k", "a")])).await;
    assert_eq!(
        (code(resp.overall_code), resp.statuses.len(), resp.statuses[0].current_limit.clone()),
        (Code::Ok, 1, None)
    );
}

#[tokio::test]
async fn the_overall_code_is_the_worst_and_a_refused_request_charges_nothing() {
    let mut s = serve(&[("config.yaml", HITS)], &[]).await;
    let mut k = one("d", &[("k", "shared")]);
    k.hits_addend = 9;
    assert_eq!(s.codes(k).await, (Code::Ok, vec![Code::Ok]));
    // `k` admits 1 more, `k2` none: the request is refused, and `k` keeps its 1.
    let mut k2 = one("d", &[("k", "full")]);
    k2.hits_addend = 10;
    assert_eq!(s.codes(k2).await.0, Code::Ok);
    let both = req("d", vec![desc(&[("k", "shared")]), desc(&[("k", "full")])]);
    for _ in 0..3 {
        assert_eq!(s.codes(both.clone()).await, (Code::OverLimit, vec![Code::Ok, Code::OverLimit]));
    }
    assert_eq!(admitted(&mut s, &one("d", &[("k", "shared")]), 2).await, 1);
}

#[tokio::test]
async fn quota_mode_refuses_only_when_every_quota_is_spent() {
    let mut s = serve(&[("config.yaml", HITS)], &[]).await;
    let both = req("d", vec![desc(&[("q", "x")]), desc(&[("r", "x")])]);
    // q admits 2, r 4: the request passes while either has room.
    assert_eq!(s.codes(both.clone()).await, (Code::Ok, vec![Code::Ok, Code::Ok]));
    assert_eq!(s.codes(both.clone()).await, (Code::Ok, vec![Code::Ok, Code::Ok]));
    assert_eq!(s.codes(both.clone()).await, (Code::Ok, vec![Code::OverLimit, Code::Ok]));
    assert_eq!(s.codes(both.clone()).await, (Code::Ok, vec![Code::OverLimit, Code::Ok]));
    assert_eq!(
        s.codes(both.clone()).await,
        (Code::OverLimit, vec![Code::OverLimit, Code::OverLimit])
    );
}

#[tokio::test]
async fn negative_hits_give_units_back() {
    let mut s = serve(&[("config.yaml", HITS)], &[]).await;
    let mut take = one("d", &[("k", "a")]);
    take.hits_addend = 10;
    assert_eq!(s.codes(take).await.0, Code::Ok);
    assert_eq!(s.codes(one("d", &[("k", "a")])).await.0, Code::OverLimit);
    let mut refund = one("d", &[("k", "a")]);
    refund.descriptors[0].hits_addend = Some(UInt64Value { value: 3 });
    refund.descriptors[0].is_negative_hits = true;
    let resp = s.call(refund).await;
    assert_eq!((code(resp.overall_code), resp.statuses[0].limit_remaining), (Code::Ok, 3));
    assert_eq!(admitted(&mut s, &one("d", &[("k", "a")]), 4).await, 3);
}

#[tokio::test]
async fn an_envoy_limit_override_is_applied() {
    let mut s = serve(&[("config.yaml", HITS)], &[]).await;
    let mut r = one("d", &[("anything", "x")]);
    r.descriptors[0].limit = Some(tollgate_server::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride {
        requests_per_unit: 3,
        unit: 3,
    });
    assert_eq!(admitted(&mut s, &r, 5).await, 3);
    let st = &s.call(r).await.statuses[0];
    assert_eq!(st.current_limit.as_ref().map(|l| (l.requests_per_unit, l.unit)), Some((3, 3)));
}

#[tokio::test]
async fn a_request_without_domain_or_descriptors_is_an_error() {
    let mut s = serve(&[("config.yaml", HITS)], &[]).await;
    let e = s.client.should_rate_limit(req("", vec![desc(&[("k", "a")])])).await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (tonic::Code::Unknown, "rate limit domain must not be empty")
    );
    let e = s.client.should_rate_limit(req("d", vec![])).await.unwrap_err();
    assert_eq!(
        (e.code(), e.message()),
        (tonic::Code::Unknown, "rate limit descriptor list must not be empty")
    );
}

#[tokio::test]
async fn legacy_headers_name_the_descriptor_closest_to_its_limit() {
    let mut s = serve(&[("config.yaml", HITS)], &["--headers", "legacy"]).await;
    s.advance(Duration::from_secs(20));
    let mut k = one("d", &[("k", "a")]);
    k.hits_addend = 3;
    s.call(k).await;
    let resp = s.call(req("d", vec![desc(&[("k", "a")]), desc(&[("k", "b")])])).await;
    let h: Vec<(String, String)> =
        resp.response_headers_to_add.iter().map(|h| (h.key.clone(), h.value.clone())).collect();
    assert_eq!(
        h,
        [
            ("RateLimit-Limit".into(), "10".into()),
            ("RateLimit-Remaining".into(), "6".into()),
            ("RateLimit-Reset".into(), "40".into())
        ]
    );
}

#[tokio::test]
async fn ietf_headers_list_every_limited_descriptor() {
    let mut s = serve(&[("config.yaml", HITS)], &["--headers", "ietf"]).await;
    s.advance(Duration::from_secs(20));
    let resp = s.call(req("d", vec![desc(&[("k", "a")]), desc(&[("q", "b")])])).await;
    let h: Vec<(String, String)> =
        resp.response_headers_to_add.iter().map(|h| (h.key.clone(), h.value.clone())).collect();
    assert_eq!(
        h,
        [
            ("RateLimit-Policy".into(), r#""ten";q=10;w=60, "d.q";q=2;w=60"#.into()),
            ("RateLimit".into(), r#""ten";r=9;t=40, "d.q";r=1;t=40"#.into()),
        ]
    );
}
