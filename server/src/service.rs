//! `ShouldRateLimit`: a request's descriptors matched, decided and answered as
//! envoyproxy/ratelimit answers them.
//!
//! Each descriptor is matched to its limit ([`config`](crate::config)); limits named in another
//! matched limit's `replaces` are dropped, `unlimited` ones answer OK with a remaining of
//! 2^32 - 1; each other one is charged its hits (the descriptor's `hits_addend`, else the
//! request's, else 1; 0 only looks) and answered with its code, `current_limit`,
//! `limit_remaining` and `duration_until_reset`. A `shadow_mode` limit answers OK where it
//! would refuse. `overall_code` is OVER_LIMIT when a descriptor is (a `quota_mode` one only
//! when every quota descriptor is).
//!
//! Unlike the reference, a refused request is not counted: a refused descriptor is not
//! charged, and when the request is refused, the descriptors that admitted it are given their
//! charge back, so one client's refused requests do not use up a limit it shares with others
//! (until the give-back, other requests may see those units taken: fewer admissions, never
//! more).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use tonic::{Request, Response, Status};

use crate::config::{Config, FailureMode, HeaderStyle, Matched, Rule, Unit};
use crate::engine::{Backends, Charge};
use crate::stats::{self, RuleStats};

/// What the service is told besides the configuration.
#[derive(Debug, Clone)]
pub struct Options {
    /// `NEAR_LIMIT_RATIO`.
    pub near_limit_ratio: f32,
    /// `SHADOW_MODE`: answer OK whatever the limits say.
    pub shadow_mode: bool,
    /// Headers to add.
    pub headers: HeaderStyle,
    /// The legacy headers' names: limit, remaining, reset.
    pub header_names: [String; 3],
}

impl Default for Options {
    fn default() -> Self {
        Self {
            near_limit_ratio: 0.8,
            shadow_mode: false,
            headers: HeaderStyle::None,
            header_names: [
                "RateLimit-Limit".into(),
                "RateLimit-Remaining".into(),
                "RateLimit-Reset".into(),
            ],
        }
    }
}

/// The rate limit service: the running configuration, swapped whole on reload. It implements
/// the generated `RateLimitService` trait, for tonic.
///
/// ```
/// use std::sync::Arc;
/// use tollgate_server::config::{Config, LoadOptions, Source};
/// use tollgate_server::engine::Backends;
/// use tollgate_server::pb::envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor::Entry};
/// use tollgate_server::pb::envoy::service::ratelimit::v3::RateLimitRequest;
/// use tollgate_server::service::{Options, RateLimiter};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let text = "domain: rl\ndescriptors:\n  - key: user\n    rate_limit: {unit: day, requests_per_unit: 2}\n";
/// let backends = Arc::new(Backends::memory());
/// let sources = [Source { name: "rl.yaml".into(), text: text.into() }];
/// let config = Config::build(&sources, LoadOptions::default(), &backends).unwrap();
/// let service = RateLimiter::new(config, backends, Options::default());
/// let entry = Entry { key: "user".into(), value: "alice".into() };
/// let request = RateLimitRequest {
///     domain: "rl".into(),
///     descriptors: vec![RateLimitDescriptor { entries: vec![entry], ..Default::default() }],
///     hits_addend: 1,
/// };
/// let response = service.should_rate_limit(&request).await.unwrap();
/// assert_eq!(response.statuses[0].limit_remaining, 1);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct RateLimiter {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: ArcSwap<Config>,
    backends: Arc<Backends>,
    options: Options,
    /// Limits Envoy sends in a descriptor (`limit`), by requests per unit and unit.
    overrides: Mutex<HashMap<(u32, Unit), Arc<Rule>>>,
}

/// One descriptor on its way through a request.
enum Slot<'a> {
    /// No limit applies.
    Free,
    Unlimited,
    Limited {
        rule: Arc<Rule>,
        matched: Option<Matched<'a>>,
        stats_key: Option<String>,
    },
}

impl RateLimiter {
    /// A service answering from `config`.
    #[must_use]
    pub fn new(config: Config, backends: Arc<Backends>, options: Options) -> Self {
        Self {
            inner: Arc::new(Inner {
                config: ArcSwap::from_pointee(config),
                backends,
                options,
                overrides: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Replaces the configuration; requests already being decided finish on the old one.
    pub fn reload(&self, config: Config) {
        self.inner.config.store(Arc::new(config));
    }

    /// The running configuration.
    #[must_use]
    pub fn config(&self) -> Arc<Config> {
        self.inner.config.load_full()
    }

    /// The stores.
    #[must_use]
    pub fn backends(&self) -> &Arc<Backends> {
        &self.inner.backends
    }

    fn override_rule(&self, requests_per_unit: u32, unit: Unit) -> Result<Arc<Rule>, Status> {
        let mut map =
            self.inner.overrides.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(r) = map.get(&(requests_per_unit, unit)) {
            return Ok(r.clone());
        }
        let name = format!("override.{requests_per_unit}.{}", unit.name());
        let binder = self.inner.backends.binder(Vec::new()).map_err(Status::internal)?;
        let engine = binder
            .engine(&name, Some((requests_per_unit, unit)), None)
            .map_err(Status::internal)?;
        let rule = Arc::new(Rule {
            stats: RuleStats::new(&name, &name, unit.name()),
            full_key: Arc::from(name.as_str()),
            limit: Some((requests_per_unit, unit)),
            name: Arc::from(""),
            replaces: Box::new([]),
            shadow_mode: false,
            quota_mode: false,
            detailed_metric: false,
            engine,
        });
        map.insert((requests_per_unit, unit), rule.clone());
        Ok(rule)
    }

    /// Answers one request.
    ///
    /// # Errors
    /// [`Status`] UNKNOWN for a request without domain or descriptors (as the reference), and
    /// UNAVAILABLE when a store fails under `failure_mode: error`.
    pub async fn should_rate_limit(
        &self,
        request: &RateLimitRequest,
    ) -> Result<RateLimitResponse, Status> {
        if request.domain.is_empty() {
            stats::service_error("service_error");
            return Err(Status::unknown("rate limit domain must not be empty"));
        }
        if request.descriptors.is_empty() {
            stats::service_error("service_error");
            return Err(Status::unknown("rate limit descriptor list must not be empty"));
        }
        let config = self.inner.config.load();
        let domain = config.domain(&request.domain);
        let mut slots: Vec<Slot<'_>> = Vec::with_capacity(request.descriptors.len());
        // `replaces`: a named limit that a matched limit (unlimited ones included) replaces is
        // not applied.
        let mut replaced: Vec<Arc<str>> = Vec::new();
        for d in &request.descriptors {
            let slot = if let Some(o) = &d.limit {
                let unit = Unit::from_proto(o.unit).ok_or_else(|| {
                    Status::invalid_argument("a descriptor's limit override has no unit")
                })?;
                Slot::Limited {
                    rule: self.override_rule(o.requests_per_unit, unit)?,
                    matched: None,
                    stats_key: Some(override_key(&request.domain, d)),
                }
            } else {
                let m = domain.and_then(|dom| dom.root.matching(&request.domain, &d.entries));
                if let Some(m) = &m {
                    replaced.extend(m.rule.replaces.iter().cloned());
                }
                match m {
                    None => Slot::Free,
                    Some(m) if m.rule.engine.is_unlimited() => Slot::Unlimited,
                    Some(m) => {
                        let rule = m.rule.clone();
                        let stats_key = m.stats_key.clone();
                        Slot::Limited { rule, matched: Some(m), stats_key }
                    }
                }
            };
            slots.push(slot);
        }
        if !replaced.is_empty() {
            for slot in &mut slots {
                if let Slot::Limited { rule, .. } = slot
                    && !rule.name.is_empty()
                    && replaced.contains(&rule.name)
                {
                    *slot = Slot::Free;
                }
            }
        }
        let limited = slots.iter().filter(|s| matches!(s, Slot::Limited { .. })).count();
        // All or nothing: with two limits or more, charges stay revocable until the answer.
        let revocable = limited > 1;
        let failure = domain.map_or(FailureMode::Error, |d| d.failure_mode);
        let now = self.inner.backends.now_secs();

        // On the memory store every decision is made at once: no need to poll them together.
        let decisions: Vec<_> = if self.inner.backends.is_redis() {
            futures_util::future::join_all(
                slots
                    .iter()
                    .zip(&request.descriptors)
                    .map(|(s, d)| decide_slot(s, d, request, revocable, failure, now)),
            )
            .await
        } else {
            let mut v = Vec::with_capacity(slots.len());
            for (s, d) in slots.iter().zip(&request.descriptors) {
                v.push(decide_slot(s, d, request, revocable, failure, now).await);
            }
            v
        };

        let mut statuses = Vec::with_capacity(slots.len());
        let mut charges: Vec<Charge> = Vec::new();
        let mut error = None;
        let (mut failed, mut quota_failed, mut quotas) = (0usize, 0usize, 0usize);
        // For the legacy headers: the descriptor closest to its limit (an over-limit one wins).
        let mut closest: Option<(u64, usize)> = None;
        let mut ietf: Vec<(String, u32, u64, u64, u64)> = Vec::new();
        for (i, (slot, decision)) in slots.iter().zip(decisions).enumerate() {
            let d = &request.descriptors[i];
            let status = match (slot, decision) {
                (Slot::Unlimited, _) => DescriptorStatus {
                    code: Code::Ok as i32,
                    limit_remaining: u32::MAX,
                    ..Default::default()
                },
                (Slot::Free, _) | (_, None) => {
                    DescriptorStatus { code: Code::Ok as i32, ..Default::default() }
                }
                (Slot::Limited { rule, stats_key, .. }, Some(result)) => {
                    let hits = if d.is_negative_hits { 0 } else { hits_of(request, d) };
                    let verdict = match result {
                        Ok(v) => v,
                        Err(e) => {
                            stats::service_error("redis_error");
                            match failure {
                                FailureMode::Error | FailureMode::Local => {
                                    error.get_or_insert(e);
                                    statuses.push(DescriptorStatus::default());
                                    continue;
                                }
                                FailureMode::Open => {
                                    tracing::debug!(error = %e, "tollgate-server: store failed; admitting (failure_mode: open)");
                                    statuses.push(DescriptorStatus {
                                        code: Code::Ok as i32,
                                        ..Default::default()
                                    });
                                    continue;
                                }
                                FailureMode::Closed => {
                                    tracing::debug!(error = %e, "tollgate-server: store failed; refusing (failure_mode: closed)");
                                    failed += 1;
                                    statuses.push(DescriptorStatus {
                                        code: Code::OverLimit as i32,
                                        ..Default::default()
                                    });
                                    continue;
                                }
                            }
                        }
                    };
                    let dynamic;
                    let rule_stats = match stats_key {
                        Some(k) => {
                            dynamic = RuleStats::new(k, &rule.full_key, rule.stats.first_tier());
                            &dynamic
                        }
                        None => &rule.stats,
                    };
                    if !d.is_negative_hits {
                        stats::count(
                            rule_stats,
                            verdict.capacity,
                            self.inner.options.near_limit_ratio,
                            hits,
                            verdict.before,
                            verdict.after,
                            verdict.admitted,
                            rule.shadow_mode,
                        );
                    }
                    if !d.is_negative_hits {
                        let first = rule.stats.first_tier();
                        let tier = verdict.name.as_deref().filter(|n| *n != first);
                        stats::decision(&rule.stats, tier, verdict.admitted, rule.shadow_mode);
                    }
                    let over = !verdict.admitted;
                    let code = if over && !rule.shadow_mode { Code::OverLimit } else { Code::Ok };
                    let quota = rule.quota_mode;
                    if quota {
                        quotas += 1;
                    }
                    let remaining = if code == Code::OverLimit { 0 } else { verdict.remaining };
                    if code == Code::OverLimit {
                        if quota {
                            quota_failed += 1;
                        } else {
                            failed += 1;
                            closest = Some((0, i));
                        }
                    } else if closest.is_none_or(|(r, _)| remaining < r) {
                        closest = Some((remaining, i));
                    }
                    let name = verdict.name.clone().unwrap_or_else(|| rule.name.clone());
                    if self.inner.options.headers == HeaderStyle::Ietf {
                        let header_name = if name.is_empty() {
                            rule.full_key.to_string()
                        } else {
                            name.to_string()
                        };
                        ietf.push((
                            header_name,
                            verdict.count,
                            verdict.unit.seconds(),
                            remaining,
                            verdict.reset,
                        ));
                    }
                    if !matches!(verdict.charge, Charge::None) {
                        charges.push(verdict.charge);
                    }
                    DescriptorStatus {
                        code: code as i32,
                        current_limit: Some(RateLimit {
                            name: name.to_string(),
                            requests_per_unit: verdict.count,
                            unit: verdict.unit.proto(),
                        }),
                        limit_remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
                        duration_until_reset: Some(PbDuration {
                            seconds: i64::try_from(verdict.reset).unwrap_or(i64::MAX),
                            nanos: 0,
                        }),
                        quota: None,
                    }
                }
            };
            statuses.push(status);
        }
        let mut overall = if failed > 0 || (quotas > 0 && quotas == quota_failed) {
            Code::OverLimit
        } else {
            Code::Ok
        };
        if overall == Code::OverLimit && self.inner.options.shadow_mode {
            metrics::counter!("ratelimit_service_global_shadow_mode").increment(1);
            overall = Code::Ok;
        }
        if let Some(e) = error {
            for c in charges {
                c.give_back().await;
            }
            return Err(Status::unavailable(format!("rate limit store failed: {e}")));
        }
        if overall == Code::OverLimit {
            for c in charges {
                c.give_back().await;
            }
        } else {
            charges.into_iter().for_each(Charge::keep);
        }
        let response_headers_to_add = match self.inner.options.headers {
            HeaderStyle::None => Vec::new(),
            HeaderStyle::Legacy => match closest {
                Some((_, i)) => {
                    let s = &statuses[i];
                    let limit = s.current_limit.as_ref().map_or(0, |l| l.requests_per_unit);
                    let reset = s.duration_until_reset.as_ref().map_or(0, |d| d.seconds);
                    let [l, r, t] = &self.inner.options.header_names;
                    vec![
                        header(l, limit.to_string()),
                        header(r, s.limit_remaining.to_string()),
                        header(t, reset.to_string()),
                    ]
                }
                None => Vec::new(),
            },
            HeaderStyle::Ietf if ietf.is_empty() => Vec::new(),
            HeaderStyle::Ietf => ietf_headers(&ietf),
        };
        Ok(RateLimitResponse {
            overall_code: overall as i32,
            statuses,
            response_headers_to_add,
            ..Default::default()
        })
    }
}

/// Decides one descriptor (`None` when no limit applies), deciding locally when the store fails
/// and the domain says `local`.
async fn decide_slot(
    slot: &Slot<'_>,
    d: &RateLimitDescriptor,
    request: &RateLimitRequest,
    revocable: bool,
    failure: FailureMode,
    now: u64,
) -> Option<Result<crate::engine::Verdict, tollgate::StoreError>> {
    let Slot::Limited { rule, matched, .. } = slot else { return None };
    let base = counter_key(&request.domain, d, matched.as_ref().map_or(&[][..], |m| &m.shared[..]));
    let hits = hits_of(request, d);
    let engine = &rule.engine;
    let result = if d.is_negative_hits {
        engine.refund(&base, hits, now).await
    } else {
        engine.decide(&base, hits, revocable, now).await
    };
    Some(match result {
        Ok(v) => Ok(v),
        Err(e) if failure == FailureMode::Local && engine.has_local() => {
            tracing::debug!(error = %e, "tollgate-server: store failed; deciding locally");
            engine.decide_local(&base, hits, revocable, now).await.map_err(|_| e)
        }
        Err(e) => Err(e),
    })
}

fn header(key: &str, value: String) -> HeaderValue {
    HeaderValue { key: key.to_owned(), value, raw_value: Vec::new() }
}

/// An sf-string: printable ASCII, `"` and `\` escaped; other characters become `?`.
fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('?'),
        }
    }
    out.push('"');
    out
}

/// `RateLimit-Policy: "name";q=100;w=60, ...` and `RateLimit: "name";r=40;t=30, ...` (IETF
/// httpapi ratelimit-headers draft), one item per limited descriptor.
fn ietf_headers(items: &[(String, u32, u64, u64, u64)]) -> Vec<HeaderValue> {
    let policy: Vec<String> =
        items.iter().map(|(n, q, w, _, _)| format!("{};q={q};w={w}", sf_string(n))).collect();
    let state: Vec<String> = items
        .iter()
        .map(|(n, q, _, r, t)| format!("{};r={};t={t}", sf_string(n), r.min(&u64::from(*q))))
        .collect();
    vec![header("RateLimit-Policy", policy.join(", ")), header("RateLimit", state.join(", "))]
}

/// A descriptor's hits: its own `hits_addend` (0 only looks), else the request's, else 1.
fn hits_of(request: &RateLimitRequest, d: &RateLimitDescriptor) -> u64 {
    match &d.hits_addend {
        Some(h) => h.value,
        None => u64::from(request.hits_addend.max(1)),
    }
}

/// The counter's name: `<domain>_<key1>_<value1>_..._` (the reference's cache key without its
/// prefix and window), a `share_threshold` wildcard's pattern standing for its value.
pub(crate) fn counter_key(
    domain: &str,
    d: &RateLimitDescriptor,
    shared: &[(usize, &str)],
) -> String {
    let len =
        domain.len() + 1 + d.entries.iter().map(|e| e.key.len() + e.value.len() + 2).sum::<usize>();
    let mut key = String::with_capacity(len);
    key.push_str(domain);
    key.push('_');
    for (i, e) in d.entries.iter().enumerate() {
        key.push_str(&e.key);
        key.push('_');
        match shared.iter().find(|(j, _)| *j == i) {
            Some((_, pattern)) => key.push_str(pattern),
            None => key.push_str(&e.value),
        }
        key.push('_');
    }
    key
}

/// The stats key of a descriptor with a limit override: `domain.key_value.key2_value2`.
fn override_key(domain: &str, d: &RateLimitDescriptor) -> String {
    let mut key = String::from(domain);
    for e in &d.entries {
        key.push('.');
        key.push_str(&e.key);
        if !e.value.is_empty() {
            key.push('_');
            key.push_str(&e.value);
        }
    }
    key
}

#[tonic::async_trait]
impl RateLimitService for RateLimiter {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        metrics::counter!("ratelimit_service_total_requests", "grpc_method" => "ShouldRateLimit")
            .increment(1);
        RateLimiter::should_rate_limit(self, request.get_ref()).await.map(Response::new)
    }
}
