//! From the document to checked policies and rules, and from those to limiters and layers.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use http::{HeaderName, Method};
use toml::Spanned;

use super::LimitsConfig;
use super::error::{ConfigFileError, Source, Span, toml_key};
use super::key::{ConfKey, KeySpec};
use super::schema::{
    KeyPart, Otherwise, PathPattern, RawFile, RawPolicy, RawRule, RawTier, StatusMatch,
    TierKindName, calendar_period, rate_period,
};
use crate::error::ConfigError;
use crate::headers::{HeaderFormat, HeaderStyle};
use crate::layer::{LogKeys, MissingKey, OnStoreError, RateLimitLayer, StreamMode, Unselected};
use crate::limiter::Limiter;
use crate::policy::{Policy, PolicyBuilder};
use crate::quota::{
    Algorithm, Calendar, Concurrency, MAX_PENALTY_REFUSALS, Penalty, Quota, Reserve, Unit,
};
use crate::store::{Carry, Store};

/// A checked policy, with the places of its values.
#[derive(Debug, Clone)]
pub(super) struct PolicyDef {
    pub(super) policy: Policy,
    /// Where a reload starts the tiers of this policy that changed.
    pub(super) carry: Carry,
    places: PolicyPlaces,
}

/// Where a policy's values are written.
#[derive(Debug, Clone)]
struct PolicyPlaces {
    /// `policies.NAME`.
    path: String,
    algorithm: Algorithm,
    /// The policy's table.
    span: Span,
    tiers_span: Span,
    tiers: Vec<TierSpans>,
}

/// Where a tier's values are written, and the values a refusal is traced back to its field
/// with.
#[derive(Debug, Clone)]
struct TierSpans {
    name: String,
    kind: TierKindName,
    /// The span of each field the tier sets, by its name in the file (`name` first).
    fields: Vec<(&'static str, Span)>,
    /// A rate tier's quota.
    quota: Option<Quota>,
    /// The tier's penalty box, as given.
    penalty: Option<Penalty>,
    /// The tier's reserve, as given.
    reserve: Option<Reserve>,
}

impl TierSpans {
    fn span(&self, field: &str) -> Option<&Span> {
        self.fields.iter().find(|(f, _)| *f == field).map(|(_, s)| s)
    }
}

/// A checked rule, with the places of the values the layer builder checks.
#[derive(Debug, Clone)]
pub(super) struct RuleDef {
    pub(super) name: String,
    /// `rules[i]`.
    path: String,
    name_span: Span,
    pub(super) matcher: Matcher,
    key: KeySpec,
    missing_key: Option<MissingKey>,
    /// The policies the rule may apply: the first is the layer's own, the others are chosen
    /// by the plan.
    policies: Vec<String>,
    plan: Option<PlanDef>,
    cost: Option<(u64, Span)>,
    allow_keys: Vec<String>,
    allow_cidrs: Option<(Vec<String>, Span)>,
    dry_run: bool,
    max_delay: Option<Duration>,
    max_waiters: Option<(usize, Span)>,
    tarpit: Option<Duration>,
    headers: Option<HeaderStyle>,
    on_store_error: Option<OnStoreError>,
    on_stream: Option<StreamMode>,
    log_keys: Option<LogKeys>,
    header_format: Option<HeaderFormat>,
    explain_missing_key: Option<bool>,
    /// The statuses whose responses give the charge back.
    refund_on: Option<Arc<[StatusMatch]>>,
    /// The header the request's class is read from.
    priority_header: Option<HeaderName>,
}

#[derive(Debug, Clone)]
struct PlanDef {
    header: HeaderName,
    /// The policy for a request whose header names none of the plan's.
    fallback: Option<&'static str>,
    unselected: Option<Unselected>,
    span: Span,
}

/// Which requests a rule applies to.
#[derive(Debug, Clone)]
pub(super) struct Matcher {
    paths: Option<Box<[PathPattern]>>,
    skip_paths: Box<[PathPattern]>,
    methods: Option<Box<[Method]>>,
    skip_methods: Box<[Method]>,
}

impl Matcher {
    /// Whether the rule applies to a request with this method and path.
    #[inline]
    pub(super) fn matches(&self, method: &Method, path: &str) -> bool {
        self.methods.as_ref().is_none_or(|m| m.contains(method))
            && !self.skip_methods.contains(method)
            && self.paths.as_ref().is_none_or(|p| p.iter().any(|p| p.matches(path)))
            && !self.skip_paths.iter().any(|p| p.matches(path))
    }
}

/// Checks the document: policies built, rules consistent and referring to defined policies.
pub(super) fn check(
    raw: RawFile,
    src: Source<'_>,
) -> Result<(Vec<PolicyDef>, Vec<RuleDef>), ConfigFileError> {
    // In file order, so that the first error in the file is the one reported.
    let mut raw_policies: Vec<_> = raw.policies.into_iter().collect();
    raw_policies.sort_by_key(|(_, p)| p.span().start);
    let policies = raw_policies
        .into_iter()
        .map(|(name, raw)| policy(name, raw, src))
        .collect::<Result<Vec<_>, _>>()?;
    let names: HashSet<&str> = policies.iter().map(|p| p.policy.name()).collect();
    let mut rules: Vec<RuleDef> = Vec::with_capacity(raw.rules.len());
    for (i, raw) in raw.rules.into_iter().enumerate() {
        let rule = rule(i, raw.into_inner(), &names, src)?;
        if let Some(first) = rules.iter().find(|r| r.name == rule.name) {
            let line = src.line(first.name_span.start);
            return Err(src.error(
                Some(&rule.name_span),
                Some(format!("{}.name", rule.path)),
                format!("a rule named {:?} is already defined on line {line}", rule.name),
            ));
        }
        rules.push(rule);
    }
    Ok((policies, rules))
}

fn policy(
    name: String,
    raw: Spanned<RawPolicy>,
    src: Source<'_>,
) -> Result<PolicyDef, ConfigFileError> {
    let span = raw.span();
    let raw = raw.into_inner();
    let algorithm = raw.algorithm.map_or(Algorithm::default(), |a| a.0);
    let carry = raw.changed_tiers.unwrap_or_default();
    let tiers_span = raw.tiers.span();
    let path = format!("policies.{}", toml_key(&name));
    let mut builder = Policy::builder(name.clone()).algorithm(algorithm);
    let mut tiers = Vec::new();
    for (i, t) in raw.tiers.into_inner().into_iter().enumerate() {
        let spans;
        (builder, spans) = tier(builder, t, &format!("{path}.tiers[{i}]"), src)?;
        tiers.push(spans);
    }
    let places = PolicyPlaces { path, algorithm, span, tiers_span, tiers };
    match builder.build() {
        Ok(policy) => Ok(PolicyDef { policy, carry, places }),
        Err(e) => Err(places.locate(&name, e, src)),
    }
}

/// The fields each kind of tier takes, after `name` and `kind`.
const fn kind_fields(kind: TierKindName) -> &'static [&'static str] {
    match kind {
        TierKindName::Rate => &[
            "count",
            "period",
            "burst",
            "unit",
            "block",
            "block_after",
            "block_window",
            "reserve_critical",
            "reserve_standard",
        ],
        TierKindName::Concurrency => &["max", "lease", "typical_hold"],
        TierKindName::Calendar => {
            &["count", "period", "time_zone", "unit", "block", "block_after", "block_window"]
        }
    }
}

/// Adds tier `t` (at `path`, `policies.NAME.tiers[i]`) to `builder`: the fields of its kind
/// checked for presence and form here, their values by the builder.
fn tier(
    builder: PolicyBuilder,
    t: RawTier,
    path: &str,
    src: Source<'_>,
) -> Result<(PolicyBuilder, TierSpans), ConfigFileError> {
    let kind = t.kind.as_ref().map_or(TierKindName::Rate, |k| *k.get_ref());
    let err = |span: &Span, field: &str, message: String| {
        src.error(Some(span), Some(format!("{path}.{field}")), message)
    };
    let name_span = t.name.span();
    let mut fields = vec![("name", name_span.clone())];
    if let Some(k) = &t.kind {
        fields.push(("kind", k.span()));
    }
    let given = [
        ("count", t.count.as_ref().map(Spanned::span)),
        ("period", t.period.as_ref().map(Spanned::span)),
        ("burst", t.burst.as_ref().map(Spanned::span)),
        ("unit", t.unit.as_ref().map(Spanned::span)),
        ("time_zone", t.time_zone.as_ref().map(Spanned::span)),
        ("max", t.max.as_ref().map(Spanned::span)),
        ("lease", t.lease.as_ref().map(Spanned::span)),
        ("typical_hold", t.typical_hold.as_ref().map(Spanned::span)),
        ("block", t.block.as_ref().map(Spanned::span)),
        ("block_after", t.block_after.as_ref().map(Spanned::span)),
        ("block_window", t.block_window.as_ref().map(Spanned::span)),
        ("reserve_critical", t.reserve_critical.as_ref().map(Spanned::span)),
        ("reserve_standard", t.reserve_standard.as_ref().map(Spanned::span)),
    ];
    let takes = kind_fields(kind);
    for (field, span) in given {
        let Some(span) = span else { continue };
        if !takes.contains(&field) {
            let kinds: Vec<&str> =
                [TierKindName::Rate, TierKindName::Concurrency, TierKindName::Calendar]
                    .into_iter()
                    .filter(|k| kind_fields(*k).contains(&field))
                    .map(TierKindName::name)
                    .collect();
            return Err(err(
                &span,
                field,
                format!(
                    "a {} tier has no `{field}` ({} tiers have it); it takes {}",
                    kind.name(),
                    kinds.join(" and "),
                    takes.join(", ")
                ),
            ));
        }
        fields.push((field, span));
    }
    let missing = |field: &str| {
        err(&name_span, field, format!("missing field `{field}`: a {} tier needs it", kind.name()))
    };
    let name = t.name.into_inner();
    let unit = t.unit.map_or(Unit::Requests, |u| u.into_inner().0);
    let mut rate = None;
    // The penalty box of a rate or calendar tier: `block`, and with `block_after` above 1,
    // `block_window`. Values out of range are the builder's to refuse (`PolicyPlaces::locate`
    // finds the field it refused).
    let penalty = match (t.block, t.block_after, t.block_window) {
        (None, None, None) => None,
        (None, Some(s), _) => {
            return Err(err(&s.span(), "block_after", needs_block("block_after")));
        }
        (None, None, Some(s)) => {
            return Err(err(&s.span(), "block_window", needs_block("block_window")));
        }
        (Some(block), after, window) => {
            let p = Penalty::new(block.into_inner().0);
            let after = after.map(Spanned::into_inner);
            match (after, window) {
                (None | Some(1), None) => Some(p),
                (None | Some(1), Some(w)) => {
                    return Err(err(
                        &w.span(),
                        "block_window",
                        "`block_window` counts breaches only when `block_after` is above 1 (the \
                         first breach blocks); leave it out, or set `block_after`"
                            .to_owned(),
                    ));
                }
                (Some(n), Some(w)) => Some(p.after(n, w.into_inner().0)),
                (Some(n), None) if (2..=MAX_PENALTY_REFUSALS).contains(&n) => {
                    return Err(err(
                        &name_span,
                        "block_window",
                        "missing field `block_window`: `block_after` above 1 counts breaches \
                         within it"
                            .to_owned(),
                    ));
                }
                // Out of range: refused by the builder, at `block_after`.
                (Some(n), None) => Some(p.after(n, Duration::ZERO)),
            }
        }
    };
    let builder = match kind {
        TierKindName::Rate => {
            let count = t.count.ok_or_else(|| missing("count"))?;
            let period = t.period.ok_or_else(|| missing("period"))?;
            let period = rate_period(period.get_ref())
                .map_err(|message| err(&period.span(), "period", message))?;
            let mut quota = Quota::new(count.into_inner(), period).counting(unit);
            if let Some(burst) = t.burst {
                quota = quota.with_burst(burst.into_inner());
            }
            rate = Some(quota);
            builder.tier(name.clone(), quota)
        }
        TierKindName::Concurrency => {
            let max = t.max.ok_or_else(|| missing("max"))?;
            let mut limit = Concurrency::new(max.into_inner());
            if let Some(lease) = t.lease {
                limit = limit.with_ttl(lease.into_inner().0);
            }
            if let Some(hold) = t.typical_hold {
                limit = limit.with_typical_hold(hold.into_inner().0);
            }
            builder.concurrency(name.clone(), limit)
        }
        TierKindName::Calendar => {
            let count = t.count.ok_or_else(|| missing("count"))?;
            let period = t.period.ok_or_else(|| missing("period"))?;
            let period = calendar_period(period.get_ref())
                .map_err(|message| err(&period.span(), "period", message))?;
            let mut quota = Calendar::new(count.into_inner(), period).counting(unit);
            if let Some(zone) = t.time_zone {
                quota = quota.in_time_zone(zone.into_inner());
            }
            builder.calendar(name.clone(), quota)
        }
    };
    let builder = match penalty {
        Some(p) => builder.penalty(name.clone(), p),
        None => builder,
    };
    // Reserved capacity of a rate tier: either field alone reserves that much, the other 0.
    let reserve = match (t.reserve_critical, t.reserve_standard) {
        (None, None) => None,
        (critical, standard) => {
            let units = |v: Option<Spanned<u64>>| v.map_or(0, Spanned::into_inner);
            Some(Reserve::new().critical(units(critical)).standard(units(standard)))
        }
    };
    let builder = match reserve {
        Some(r) => builder.reserve(name.clone(), r),
        None => builder,
    };
    Ok((builder, TierSpans { name, kind, fields, quota: rate, penalty, reserve }))
}

impl PolicyPlaces {
    /// Where a refusal of policy `name` (by its builder or a store) points: the tier's field
    /// it names, else the policy.
    fn locate(&self, name: &str, e: ConfigError, src: Source<'_>) -> ConfigFileError {
        let tier = |tier: &str, nth: usize| {
            self.tiers.iter().enumerate().filter(|(_, t)| t.name == tier).nth(nth)
        };
        // The first of `fields` the tier sets (a burst left out is the count, say), else its
        // table, at its name.
        let at = |tier_name: &str, nth: usize, fields: &[&str]| {
            tier(tier_name, nth).map(|(i, t)| {
                let path = format!("{}.tiers[{i}]", self.path);
                match fields.iter().find_map(|f| t.span(f).map(|s| (*f, s))) {
                    Some((field, span)) => (span.clone(), format!("{path}.{field}")),
                    None => (t.fields[0].1.clone(), path),
                }
            })
        };
        let count = |tier: &str| {
            let concurrency =
                self.tiers.iter().any(|t| t.name == tier && t.kind == TierKindName::Concurrency);
            if concurrency { "max" } else { "count" }
        };
        let found = match &e {
            ConfigError::ZeroCount { tier } | ConfigError::SlidingLogTooLarge { tier, .. } => {
                at(tier, 0, &[count(tier)])
            }
            ConfigError::TooLarge { tier, what, .. } => at(tier, 0, &[what, "count"]),
            ConfigError::ZeroPeriod { tier } => at(tier, 0, &["period"]),
            ConfigError::SpanTooLong { tier, .. } => {
                let field = self.first(tier).map_or("period", |t| self.span_field(t));
                at(tier, 0, &[field, "period"])
            }
            ConfigError::ZeroBurst { tier } | ConfigError::BurstNotSupported { tier, .. } => {
                at(tier, 0, &["burst", "count"])
            }
            ConfigError::LeaseOutOfRange { tier, .. } => at(tier, 0, &["lease"]),
            ConfigError::UnknownTimeZone { tier, .. } => at(tier, 0, &["time_zone"]),
            ConfigError::Penalty { tier, .. } => {
                let field = self.first(tier).and_then(|t| t.penalty).map_or("block", penalty_field);
                at(tier, 0, &[field, "block"])
            }
            ConfigError::Reserve { tier, .. } => {
                let field = self.first(tier).map_or("reserve_critical", |t| self.reserve_field(t));
                at(tier, 0, &[field, "reserve_critical", "reserve_standard"])
            }
            ConfigError::DuplicateTier(tier) => at(tier, 1, &["name"]),
            ConfigError::NoTiers(_) => {
                Some((self.tiers_span.clone(), format!("{}.tiers", self.path)))
            }
            ConfigError::BadName(bad) if bad != name => at(bad, 0, &["name"]),
            ConfigError::UnsupportedByStore { tier, .. } => {
                at(tier, 0, &["period", "lease", "max"])
            }
            _ => None,
        };
        let (span, field) = found.unwrap_or_else(|| (self.span.clone(), self.path.clone()));
        src.caused(&span, field, e)
    }
}

impl PolicyPlaces {
    /// The first tier named `name`.
    fn first(&self, name: &str) -> Option<&TierSpans> {
        self.tiers.iter().find(|t| t.name == name)
    }

    /// Which field of rate tier `t` makes its span too long: its period, when the period
    /// alone is refused, else its burst (whose refill, `burst x period / count`, is).
    fn span_field(&self, t: &TierSpans) -> &'static str {
        let Some(q) = t.quota else { return "period" };
        let period_alone = Quota::new(q.count(), q.period());
        let refused = Policy::builder("probe")
            .algorithm(self.algorithm)
            .tier("t", period_alone)
            .build()
            .is_err_and(|e| matches!(e, ConfigError::SpanTooLong { .. }));
        if refused { "period" } else { "burst" }
    }

    /// Which field of tier `t`'s reserve the builder refuses: `reserve_critical` when it is
    /// given and refused alone, else `reserve_standard` when given (it is the standard reserve
    /// on top of the critical one that does not fit).
    fn reserve_field(&self, t: &TierSpans) -> &'static str {
        let critical = t.span("reserve_critical").is_some();
        let standard = t.span("reserve_standard").is_some();
        let (Some(q), Some(r)) = (t.quota, t.reserve) else { return "reserve_critical" };
        let refused = |r: Reserve| {
            Policy::builder("probe")
                .algorithm(self.algorithm)
                .tier("t", q)
                .reserve("t", r)
                .build()
                .is_err()
        };
        if critical && (!standard || refused(Reserve::new().critical(r.critical_units()))) {
            "reserve_critical"
        } else {
            "reserve_standard"
        }
    }
}

/// Which field of penalty box `p` the builder refuses: each value is tried beside valid ones
/// (the builder's ranges stay in one place, `Policy::build`).
fn penalty_field(p: Penalty) -> &'static str {
    let refused = |p: Penalty| {
        Policy::builder("probe").tier("t", Quota::per_second(1)).penalty("t", p).build().is_err()
    };
    let valid = Duration::from_secs(1);
    if refused(Penalty::new(p.block())) {
        "block"
    } else if refused(Penalty::new(valid).after(p.refusals(), valid)) {
        "block_after"
    } else {
        "block_window"
    }
}

/// The message for a penalty setting given without `block`.
fn needs_block(field: &str) -> String {
    format!("`{field}` sets a penalty box, which needs `block` (how long a breach blocks)")
}

/// "no policy named ..." with the names there are.
fn unknown_policy(name: &str, names: &HashSet<&str>) -> String {
    if names.is_empty() {
        return format!("no policy named {name:?}: the file defines no policies");
    }
    let mut defined: Vec<_> = names.iter().copied().collect();
    defined.sort_unstable();
    format!("no policy named {name:?}; defined: {}", defined.join(", "))
}

fn rule(
    i: usize,
    raw: RawRule,
    names: &HashSet<&str>,
    src: Source<'_>,
) -> Result<RuleDef, ConfigFileError> {
    let path = format!("rules[{i}]");
    let field = |f: &str| Some(format!("{path}.{f}"));
    let err = |span: &Span, f: &str, message: String| src.error(Some(span), field(f), message);
    let name_span = raw.name.span();
    let name = raw.name.into_inner();
    if name.is_empty() {
        return Err(err(&name_span, "name", "a rule's name must not be empty".into()));
    }

    let (policies, plan) = match (raw.policy, raw.plan) {
        (Some(policy), None) => {
            if !names.contains(policy.get_ref().as_str()) {
                return Err(err(&policy.span(), "policy", unknown_policy(policy.get_ref(), names)));
            }
            (vec![policy.into_inner()], None)
        }
        (None, Some(plan)) => {
            let span = plan.span();
            let plan = plan.into_inner();
            let list_span = plan.policies.span();
            let mut chosen: Vec<String> = Vec::new();
            for (j, p) in plan.policies.into_inner().into_iter().enumerate() {
                let f = format!("plan.policies[{j}]");
                if !names.contains(p.get_ref().as_str()) {
                    return Err(err(&p.span(), &f, unknown_policy(p.get_ref(), names)));
                }
                if chosen.contains(p.get_ref()) {
                    return Err(err(&p.span(), &f, format!("{:?} is listed twice", p.get_ref())));
                }
                chosen.push(p.into_inner());
            }
            if chosen.is_empty() {
                return Err(err(&list_span, "plan.policies", "name at least one policy".into()));
            }
            let (fallback, unselected) = match plan.otherwise.get_ref() {
                Otherwise::Policy(p) if chosen.contains(p) => (Some(interned(p)), None),
                Otherwise::Policy(p) => {
                    return Err(err(
                        &plan.otherwise.span(),
                        "plan.otherwise",
                        format!("{p:?} is not one of the plan's policies ({})", chosen.join(", ")),
                    ));
                }
                Otherwise::Pass => (None, Some(Unselected::Pass)),
                Otherwise::Reject(status) => (None, Some(Unselected::Reject(*status))),
            };
            (chosen, Some(PlanDef { header: plan.header.0, fallback, unselected, span }))
        }
        (Some(_), Some(plan)) => {
            return Err(err(
                &plan.span(),
                "plan",
                "a rule has either `policy` or `plan`, not both".into(),
            ));
        }
        (None, None) => {
            return Err(src.error(
                Some(&name_span),
                Some(path),
                "a rule needs `policy` (one policy) or `plan` (a policy chosen per request)",
            ));
        }
    };

    let mut key = KeySpec::default();
    let key_span = raw.key.as_ref().map_or(name_span.clone(), Spanned::span);
    if let Some(spec) = raw.key {
        let span = spec.span();
        key.parts = spec.into_inner().0.into_iter().map(Spanned::into_inner).collect();
        if key.parts.is_empty() {
            return Err(err(&span, "key", "an empty list: name at least one key extractor".into()));
        }
    }
    let client = key.parts.contains(&KeyPart::ClientIp);
    match raw.trusted_proxies {
        Some(nets) if !client => {
            return Err(err(
                &nets.span(),
                "trusted_proxies",
                "applies to the `client_ip` key only".into(),
            ));
        }
        Some(nets) => key.trusted = nets.into_inner().into_iter().map(|c| c.net).collect(),
        None if client => {
            return Err(err(
                &key_span,
                "key",
                "`client_ip` needs `trusted_proxies`: the networks of the proxies whose \
                 forwarding headers are believed"
                    .into(),
            ));
        }
        None => {}
    }
    if let Some(header) = raw.forwarded_header {
        if !client {
            return Err(err(
                &header.span(),
                "forwarded_header",
                "applies to the `client_ip` key only".into(),
            ));
        }
        key.forwarded = header.into_inner();
    }
    if let Some(bits) = raw.ipv6_prefix {
        if !client && !key.parts.contains(&KeyPart::PeerIp) {
            return Err(err(
                &bits.span(),
                "ipv6_prefix",
                "applies to the `peer_ip` and `client_ip` keys only".into(),
            ));
        }
        if *bits.get_ref() > 128 {
            return Err(err(&bits.span(), "ipv6_prefix", "must be at most 128 (bits)".into()));
        }
        key.ipv6_prefix = Some(*bits.get_ref());
    }

    let methods = match raw.methods {
        Some(m) if m.get_ref().is_empty() => {
            return Err(err(
                &m.span(),
                "methods",
                "an empty list would match no request; leave `methods` out to match every method"
                    .into(),
            ));
        }
        m => m.map(|m| m.into_inner().into_iter().map(|m| m.0).collect()),
    };
    let paths = match raw.paths {
        Some(p) if p.get_ref().is_empty() => {
            return Err(err(
                &p.span(),
                "paths",
                "an empty list would match no request; leave `paths` out to match every path"
                    .into(),
            ));
        }
        p => p.map(Spanned::into_inner).map(Vec::into_boxed_slice),
    };
    let matcher = Matcher {
        paths,
        skip_paths: raw.skip_paths.into(),
        methods,
        skip_methods: raw.skip_methods.into_iter().map(|m| m.0).collect(),
    };

    let refund_on = match raw.refund_on {
        Some(list) if list.get_ref().is_empty() => {
            return Err(err(
                &list.span(),
                "refund_on",
                "an empty list would refund nothing; leave `refund_on` out".into(),
            ));
        }
        list => list.map(|l| l.into_inner().into()),
    };

    Ok(RuleDef {
        name,
        path,
        name_span,
        matcher,
        key,
        missing_key: raw.missing_key.map(|m| m.0),
        policies,
        plan,
        cost: raw.cost.map(|c| (*c.get_ref(), c.span())),
        allow_keys: raw.allow_keys,
        allow_cidrs: raw.allow_cidrs.map(|c| {
            let span = c.span();
            (c.into_inner().into_iter().map(|c| c.text).collect(), span)
        }),
        dry_run: raw.dry_run,
        max_delay: raw.max_delay.map(|d| d.0),
        max_waiters: raw.max_waiters.map(|m| (*m.get_ref(), m.span())),
        tarpit: raw.tarpit.map(|d| d.0),
        headers: raw.headers,
        on_store_error: raw.on_store_error,
        on_stream: raw.on_stream,
        log_keys: raw.log_keys,
        header_format: raw.header_format,
        explain_missing_key: raw.explain_missing_key,
        refund_on,
        priority_header: raw.priority_header.map(|h| h.0),
    })
}

/// A policy name that lives as long as the process: the selector returns names borrowed from
/// the request or `'static` ones, and a plan's fallback is neither. Each distinct name is kept
/// once, so reloading again and again does not grow memory.
fn interned(name: &str) -> &'static str {
    static NAMES: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let mut names = NAMES.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(n) = names.iter().find(|n| **n == name) {
        return n;
    }
    let n: &'static str = Box::leak(name.to_owned().into_boxed_str());
    names.push(n);
    n
}

/// A rule's layer, ready to serve.
pub(super) struct BuiltRule<St: Store> {
    pub(super) matcher: Matcher,
    pub(super) layer: RateLimitLayer<ConfKey, St>,
}

/// A configuration bound to a store.
pub(super) struct Bound<St: Store> {
    /// One limiter per policy, by name: every rule that applies a policy decides through its
    /// limiter (one budget per key, whichever rule charges it).
    pub(super) limiters: HashMap<String, Limiter<St>>,
    pub(super) rules: Box<[BuiltRule<St>]>,
}

/// Binds `config`'s policies to `store` and builds its rules' layers. `running` are the
/// limiters of the configuration being replaced, if any: see [`rebind`].
///
/// # Errors
/// What the store or the layer builder refuses, located in the file.
pub(super) fn assemble<St: Store>(
    config: &LimitsConfig,
    store: &St,
    running: Option<&HashMap<String, Limiter<St>>>,
) -> Result<Bound<St>, ConfigFileError> {
    let src = config.source();
    let mut limiters = HashMap::with_capacity(config.policies.len());
    for def in &config.policies {
        let name = def.policy.name();
        let old = running.and_then(|r| r.get(name));
        let limiter = rebind(old, def.policy.clone(), def.carry, store)
            .map_err(|e| def.places.locate(name, e, src))?;
        limiters.insert(name.to_owned(), limiter);
    }
    let rules = config
        .rules
        .iter()
        .map(|rule| {
            let layer = rule.layer(&limiters).map_err(|e| rule.locate(e, src))?;
            Ok(BuiltRule { matcher: rule.matcher.clone(), layer })
        })
        .collect::<Result<_, ConfigFileError>>()?;
    Ok(Bound { limiters, rules })
}

/// The limiter of policy `new` in a configuration being built; `old` is the limiter of the
/// policy of the same name in the running configuration, if there is one.
///
/// The rule: a policy whose definition did not change (same name, same algorithm, same tiers
/// with the same quotas: `Policy`'s equality) keeps its limiter, and with it every key's
/// state: a reload does not hand out fresh quotas. A changed policy is bound through
/// [`Limiter::rebind_with`]: the store carries over each key's state of the tiers that did not
/// change (a `MemoryStore` does; see `Store::rebind`), and starts the changed tiers as the
/// policy's `changed_tiers` says (`carry`: full by default). A new policy is bound afresh.
fn rebind<St: Store>(
    old: Option<&Limiter<St>>,
    new: Policy,
    carry: Carry,
    store: &St,
) -> Result<Limiter<St>, ConfigError> {
    match old {
        Some(old) if *old.policy() == new => Ok(old.clone()),
        // Changed: the store carries over the state of the tiers that did not change.
        Some(old) => old.rebind_with(new, carry),
        None => Limiter::with_store(new, store.clone()),
    }
}

impl RuleDef {
    /// The rule's layer, over the limiters of its policies.
    fn layer<St: Store>(
        &self,
        limiters: &HashMap<String, Limiter<St>>,
    ) -> Result<RateLimitLayer<ConfKey, St>, ConfigError> {
        let limiter = |name: &String| {
            limiters.get(name).cloned().ok_or_else(|| ConfigError::Invalid {
                setting: "policy",
                reason: format!("no policy named {name:?}"),
            })
        };
        let mut policies = self.policies.iter();
        let first = policies.next().ok_or_else(|| ConfigError::Invalid {
            setting: "policy",
            reason: "no policy".into(),
        })?;
        let mut b = RateLimitLayer::with_limiter(limiter(first)?).key(self.key.extractor());
        for name in policies {
            b = b.policy_limiter(limiter(name)?);
        }
        if let Some(plan) = &self.plan {
            let header = plan.header.clone();
            let names: Box<[Box<str>]> = self.policies.iter().map(|p| p.as_str().into()).collect();
            let fallback = plan.fallback;
            b = b.select(move |head| {
                let value = head.headers.get(&header).and_then(|v| v.to_str().ok());
                value.filter(|v| names.iter().any(|n| **n == **v)).or(fallback)
            });
            if let Some(unselected) = plan.unselected {
                b = b.unselected(unselected);
            }
        }
        if let Some((cost, _)) = self.cost {
            b = b.cost(cost);
        }
        if let Some(missing) = self.missing_key {
            b = b.missing_key(missing);
        }
        if !self.allow_keys.is_empty() {
            b = b.allow_keys(self.allow_keys.iter().map(String::as_str));
        }
        if let Some((cidrs, _)) = &self.allow_cidrs {
            b = b.allow_cidrs(cidrs);
        }
        if let Some(max_delay) = self.max_delay {
            b = b.shape(max_delay);
        }
        if let Some((n, _)) = self.max_waiters {
            b = b.max_waiters(n);
        }
        if let Some(delay) = self.tarpit {
            b = b.tarpit(delay);
        }
        if let Some(style) = self.headers {
            b = b.headers(style);
        }
        if let Some(on_error) = self.on_store_error {
            b = b.on_store_error(on_error);
        }
        if let Some(mode) = self.on_stream {
            b = b.on_stream(mode);
        }
        if let Some(keys) = self.log_keys {
            b = b.log_keys(keys);
        }
        if let Some(format) = self.header_format {
            b = b.header_format(format);
        }
        if let Some(on) = self.explain_missing_key {
            b = b.explain_missing_key(on);
        }
        if let Some(header) = &self.priority_header {
            b = b.priority_header(header.clone());
        }
        if let Some(statuses) = &self.refund_on {
            let statuses = Arc::clone(statuses);
            b = b.refund_if(move |status| statuses.iter().any(|s| s.matches(status)));
        }
        b.dry_run(self.dry_run).build()
    }

    /// Where a refusal of the layer builder points: the setting it names, else the rule.
    fn locate(&self, e: ConfigError, src: Source<'_>) -> ConfigFileError {
        let here = |span: Option<&Span>, field: &str| {
            span.map(|s| (s.clone(), format!("{}.{field}", self.path)))
        };
        let found = match &e {
            ConfigError::CostExceedsCapacity { .. } => {
                here(self.cost.as_ref().map(|c| &c.1), "cost")
            }
            ConfigError::Invalid { setting: "max_waiters", .. } => {
                here(self.max_waiters.as_ref().map(|m| &m.1), "max_waiters")
            }
            ConfigError::Invalid { setting: "allow_cidrs", .. } => {
                here(self.allow_cidrs.as_ref().map(|c| &c.1), "allow_cidrs")
            }
            ConfigError::Invalid { setting: "policy" | "unselected", .. } => {
                here(self.plan.as_ref().map(|p| &p.span), "plan")
            }
            _ => None,
        };
        let (span, field) = found.unwrap_or_else(|| (self.name_span.clone(), self.path.clone()));
        src.caused(&span, field, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::Key;
    use crate::store::MemoryStore;

    #[tokio::test]
    async fn an_unchanged_policy_keeps_its_limiter_and_a_changed_one_keeps_its_unchanged_tiers() {
        let store = MemoryStore::new();
        let policy = Policy::single("p", Quota::per_hour(10)).unwrap();
        let old = rebind(None, policy.clone(), Carry::StartFull, &store).unwrap();
        old.check(&Key::Global, 4).await.unwrap();
        let kept = rebind(Some(&old), policy, Carry::StartFull, &store).unwrap();
        assert_eq!(kept.check(&Key::Global, 0).await.unwrap().tiers()[0].remaining(), 6);
        let changed = Policy::single("p", Quota::per_hour(11)).unwrap();
        let fresh = rebind(Some(&old), changed, Carry::StartFull, &store).unwrap();
        assert_eq!(fresh.check(&Key::Global, 0).await.unwrap().tiers()[0].remaining(), 11);
        // A tier added beside an unchanged one: the unchanged tier keeps its count, the new
        // one starts full, the old binding still decides for requests it began.
        let two = |daily| {
            Policy::builder("q")
                .tier("hour", Quota::per_hour(10))
                .tier("day", Quota::per_day(daily))
                .build()
                .unwrap()
        };
        let old = rebind(None, two(100), Carry::StartFull, &store).unwrap();
        old.check(&Key::Global, 4).await.unwrap();
        let raised = rebind(Some(&old), two(200), Carry::StartFull, &store).unwrap();
        let tiers = raised.check(&Key::Global, 0).await.unwrap();
        let remaining: Vec<u64> = tiers.tiers().iter().map(|t| t.remaining()).collect();
        assert_eq!(remaining, [6, 200]);
        assert_eq!(old.check(&Key::Global, 0).await.unwrap().tiers()[1].remaining(), 96);
        // Another algorithm is a change too.
        let other = Policy::builder("p")
            .algorithm(Algorithm::TokenBucket)
            .tier("p", Quota::per_hour(10))
            .build()
            .unwrap();
        let fresh = rebind(Some(&old), other, Carry::StartFull, &store).unwrap();
        assert_eq!(fresh.check(&Key::Global, 0).await.unwrap().tiers()[0].remaining(), 10);
    }

    #[test]
    fn fallback_names_are_kept_once() {
        let a = interned(&String::from("fallback-name"));
        let b = interned(&String::from("fallback-name"));
        assert!(std::ptr::eq(a, b));
        assert_eq!(a, "fallback-name");
    }

    #[test]
    fn matchers_combine_paths_and_methods() {
        let path = |s: &str| PathPattern::try_from(s.to_owned()).unwrap();
        let m = Matcher {
            paths: Some(Box::new([path("/api/*"), path("/login")])),
            skip_paths: Box::new([path("/api/health")]),
            methods: None,
            skip_methods: Box::new([Method::OPTIONS]),
        };
        assert!(m.matches(&Method::GET, "/api/items"));
        assert!(m.matches(&Method::POST, "/login"));
        assert!(!m.matches(&Method::GET, "/api/health"));
        assert!(!m.matches(&Method::OPTIONS, "/api/items"));
        assert!(!m.matches(&Method::GET, "/"));
        let m = Matcher { paths: None, methods: Some(Box::new([Method::POST])), ..m };
        assert!(m.matches(&Method::POST, "/anything"));
        assert!(!m.matches(&Method::GET, "/anything"));
    }
}
