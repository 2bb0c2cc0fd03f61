//! Companion files: tollgate's extensions to envoyproxy/ratelimit's limits, keyed by domain
//! and descriptor, in files of their own (a name ending in `.tollgate.yaml`), since the
//! reference's format refuses keys it does not know.
//!
//! ```yaml
//! domain: rl                      # the domain of a reference file
//! failure_mode: open              # error (default), open, closed or local
//! limits:
//!   - descriptor: [generic_key=slow]   # the path of a descriptor with a rate_limit
//!     algorithm: gcra                  # gcra, token_bucket, leaky_bucket, fixed_window,
//!                                      # sliding_log, sliding_counter
//!     tiers:                           # default: one tier, the descriptor's rate_limit
//!       - {name: per-second, requests_per_unit: 10, unit: second, burst: 20}
//!       - {name: monthly, requests_per_unit: 100000, calendar: month, time_zone: Europe/Paris}
//!     penalty: {tier: per-second, after: 3, within: 1m, block: 15m}
//!     lease: {max_block: 64, lifetime: 100ms}   # Redis only; `lease: true` for the defaults
//! ```
//!
//! A file is read against the reference files already read, so that an entry naming a
//! descriptor that has no limit, or a policy that cannot be built, is refused with its line
//! and column. `domain` comes before `limits`.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use tollgate::store::Lease;
use tollgate::{Algorithm, Calendar, CalendarPeriod, Penalty, Policy, Quota};

use super::yaml::{RawDescriptor, RawRoot};
use super::{ConfigError, Source, Unit};

/// What a decision does when its store cannot decide (unreachable, timed out), per domain.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FailureMode {
    /// The call fails (gRPC UNAVAILABLE), as envoyproxy/ratelimit's does: Envoy's
    /// `failure_mode_deny` then decides (by default Envoy lets the request through).
    #[default]
    Error,
    /// The descriptor is admitted (OK), uncounted.
    Open,
    /// The descriptor is refused (OVER_LIMIT).
    Closed,
    /// Each server decides alone on its own memory (a fleet of n admits up to n times the
    /// limit until the store is back).
    Local,
}

impl FailureMode {
    fn from_name(s: &str) -> Option<Self> {
        Some(match s {
            "error" => Self::Error,
            "open" => Self::Open,
            "closed" => Self::Closed,
            "local" => Self::Local,
            _ => return None,
        })
    }
}

/// Which rate-limit headers a response carries, in `response_headers_to_add`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum HeaderStyle {
    /// None (the default, as envoyproxy/ratelimit's).
    #[default]
    None,
    /// envoyproxy/ratelimit's three headers (`LIMIT_RESPONSE_HEADERS_ENABLED`): by default
    /// `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset`, of the descriptor closest
    /// to its limit.
    Legacy,
    /// The IETF httpapi draft's `RateLimit-Policy` and `RateLimit` structured fields, one item
    /// per limited descriptor.
    Ietf,
}

impl HeaderStyle {
    /// `none`, `legacy` or `ietf`.
    #[must_use]
    pub fn from_name(s: &str) -> Option<Self> {
        Some(match s {
            "none" => Self::None,
            "legacy" => Self::Legacy,
            "ietf" => Self::Ietf,
            _ => return None,
        })
    }
}

/// How a tier is reported in a descriptor's status (`current_limit`).
#[derive(Debug, Clone)]
pub struct Report {
    /// Units per `unit` (`requests_per_unit`).
    pub count: u32,
    /// The unit.
    pub unit: Unit,
    /// The tier's name.
    pub name: Arc<str>,
}

/// A descriptor's extension: the policy that replaces its fixed window.
#[derive(Debug, Clone)]
pub struct Extension {
    /// The companion file.
    pub file: String,
    /// The policy, named by the descriptor's full key.
    pub policy: Policy,
    /// Per tier of the policy, how it is reported.
    pub reports: Vec<Report>,
    /// Lease mode on Redis.
    pub lease: Option<Lease>,
}

/// What a limit of the reference files looks like, for the companion files to refer to.
#[derive(Debug, Clone)]
pub(super) struct Known {
    full_key: String,
    limit: Option<(u32, Unit)>,
    name: String,
}

/// Per domain, the limits of the reference files by path of composite names.
pub(super) type Seed = HashMap<String, HashMap<Vec<String>, Known>>;

/// The limits of `roots`, for [`parse`].
pub(super) fn seed(roots: &[(&str, RawRoot)]) -> Seed {
    fn walk(
        out: &mut HashMap<Vec<String>, Known>,
        parent: &str,
        path: &mut Vec<String>,
        ds: &[RawDescriptor],
    ) {
        for d in ds {
            let name = d.composite();
            let full_key = format!("{parent}{name}");
            path.push(name);
            if let Some(rl) = &d.rate_limit {
                let limit =
                    if rl.unlimited { None } else { rl.unit.map(|u| (rl.requests_per_unit, u)) };
                out.insert(
                    path.clone(),
                    Known { full_key: full_key.clone(), limit, name: rl.name.clone() },
                );
            }
            walk(out, &format!("{full_key}."), path, &d.descriptors);
            path.pop();
        }
    }
    let mut seed = Seed::new();
    for (_, root) in roots {
        let known = seed.entry(root.domain.clone()).or_default();
        walk(known, &format!("{}.", root.domain), &mut Vec::new(), &root.descriptors);
    }
    seed
}

/// A companion file, read.
#[derive(Debug)]
pub(super) struct File {
    pub(super) name: String,
    pub(super) domain: String,
    pub(super) failure_mode: FailureMode,
    pub(super) limits: Vec<(Vec<String>, Extension)>,
}

/// Reads a companion file against `seed`.
pub(super) fn parse(source: &Source, seed: &Seed) -> Result<File, ConfigError> {
    let de = serde_yaml_ng::Deserializer::from_str(&source.text);
    let mut file = FileSeed { seed, file: &source.name }
        .deserialize(de)
        .map_err(|e| ConfigError::yaml(&source.name, &e))?;
    if file.domain.is_empty() {
        return Err(ConfigError::whole(&source.name, "a companion file needs `domain`"));
    }
    file.name.clone_from(&source.name);
    Ok(file)
}

struct FileSeed<'a> {
    seed: &'a Seed,
    file: &'a str,
}

impl<'de> DeserializeSeed<'de> for FileSeed<'_> {
    type Value = File;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<File, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for FileSeed<'_> {
    type Value = File;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map with `domain` and `limits`")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<File, A::Error> {
        let mut file = File {
            name: String::new(),
            domain: String::new(),
            failure_mode: FailureMode::default(),
            limits: Vec::new(),
        };
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "domain" => file.domain = map.next_value()?,
                "failure_mode" => {
                    let name: String = map.next_value()?;
                    file.failure_mode = FailureMode::from_name(&name).ok_or_else(|| {
                        de::Error::custom(format_args!(
                            "unknown failure_mode '{name}': expected error, open, closed or local"
                        ))
                    })?;
                }
                "limits" => {
                    if file.domain.is_empty() {
                        return Err(de::Error::custom("`domain` must come before `limits`"));
                    }
                    let Some(known) = self.seed.get(&file.domain) else {
                        return Err(de::Error::custom(format_args!(
                            "domain '{}' is in no rate limit config file",
                            file.domain
                        )));
                    };
                    file.limits = map.next_value_seed(LimitsSeed { known, file: self.file })?;
                }
                k => {
                    return Err(de::Error::custom(format_args!(
                        "unknown key '{k}': expected domain, failure_mode or limits"
                    )));
                }
            }
        }
        Ok(file)
    }
}

struct LimitsSeed<'a> {
    known: &'a HashMap<Vec<String>, Known>,
    file: &'a str,
}

impl<'de> DeserializeSeed<'de> for LimitsSeed<'_> {
    type Value = Vec<(Vec<String>, Extension)>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for LimitsSeed<'_> {
    type Value = Vec<(Vec<String>, Extension)>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of limits")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out: Vec<(Vec<String>, Extension)> = Vec::new();
        while let Some(entry) =
            seq.next_element_seed(EntrySeed { known: self.known, file: self.file })?
        {
            if out.iter().any(|(p, _)| *p == entry.0) {
                return Err(de::Error::custom(format_args!(
                    "descriptor {:?} has two entries",
                    entry.0
                )));
            }
            out.push(entry);
        }
        Ok(out)
    }
}

/// A tier as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TierSpec {
    name: Option<String>,
    requests_per_unit: u64,
    unit: Option<String>,
    burst: Option<u64>,
    calendar: Option<String>,
    time_zone: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PenaltySpec {
    tier: Option<String>,
    #[serde(with = "humantime_serde_compat")]
    block: Duration,
    after: Option<u32>,
    #[serde(default, with = "humantime_serde_compat::option")]
    within: Option<Duration>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct LeaseSpec {
    max_block: Option<u64>,
    #[serde(default, with = "humantime_serde_compat::option")]
    lifetime: Option<Duration>,
    prefetch: Option<bool>,
}

/// `lease: true`, `lease: false` or a map of [`LeaseSpec`].
struct LeaseField(Option<LeaseSpec>);

impl<'de> Deserialize<'de> for LeaseField {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = LeaseField;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("true, false or a map (max_block, lifetime, prefetch)")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<LeaseField, E> {
                Ok(LeaseField(v.then(LeaseSpec::default)))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<LeaseField, A::Error> {
                LeaseSpec::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(|s| LeaseField(Some(s)))
            }
        }
        d.deserialize_any(V)
    }
}

struct EntrySeed<'a> {
    known: &'a HashMap<Vec<String>, Known>,
    file: &'a str,
}

impl<'de> DeserializeSeed<'de> for EntrySeed<'_> {
    type Value = (Vec<String>, Extension);
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for EntrySeed<'_> {
    type Value = (Vec<String>, Extension);
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a limit (a map with `descriptor`)")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut descriptor: Option<Vec<String>> = None;
        let mut algorithm = Algorithm::Gcra;
        let mut tiers: Option<Vec<TierSpec>> = None;
        let mut penalty: Option<PenaltySpec> = None;
        let mut lease: Option<LeaseSpec> = None;
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "descriptor" => descriptor = Some(map.next_value()?),
                "algorithm" => {
                    let name: String = map.next_value()?;
                    algorithm = Algorithm::ALL.into_iter().find(|a| a.name() == name).ok_or_else(|| {
                        de::Error::custom(format_args!(
                            "unknown algorithm '{name}': expected gcra, token_bucket, leaky_bucket, fixed_window, sliding_log or sliding_counter"
                        ))
                    })?;
                }
                "tiers" => tiers = Some(map.next_value()?),
                "penalty" => penalty = Some(map.next_value()?),
                "lease" => lease = map.next_value::<LeaseField>()?.0,
                k => {
                    return Err(de::Error::custom(format_args!(
                        "unknown key '{k}': expected descriptor, algorithm, tiers, penalty or lease"
                    )));
                }
            }
        }
        let Some(descriptor) = descriptor else {
            return Err(de::Error::custom("a limit needs `descriptor`"));
        };
        let path: Vec<String> = descriptor
            .iter()
            .map(|e| match e.split_once('=') {
                Some((k, v)) if !v.is_empty() => format!("{k}_{v}"),
                Some((k, _)) => k.to_owned(),
                None => e.clone(),
            })
            .collect();
        let Some(known) = self.known.get(&path) else {
            return Err(de::Error::custom(format_args!(
                "descriptor {descriptor:?} has no rate_limit in the domain's config files"
            )));
        };
        let ext =
            build(known, algorithm, tiers, penalty, lease, self.file).map_err(de::Error::custom)?;
        Ok((path, ext))
    }
}

fn calendar_period(name: &str) -> Option<(CalendarPeriod, Unit)> {
    Some(match name {
        "minute" => (CalendarPeriod::Minute, Unit::Minute),
        "hour" => (CalendarPeriod::Hour, Unit::Hour),
        "day" => (CalendarPeriod::Day, Unit::Day),
        "week" => (CalendarPeriod::Week, Unit::Week),
        "month" => (CalendarPeriod::Month, Unit::Month),
        "year" => (CalendarPeriod::Year, Unit::Year),
        _ => return None,
    })
}

fn build(
    known: &Known,
    algorithm: Algorithm,
    tiers: Option<Vec<TierSpec>>,
    penalty: Option<PenaltySpec>,
    lease: Option<LeaseSpec>,
    file: &str,
) -> Result<Extension, String> {
    let default_name =
        if known.name.is_empty() { known.full_key.clone() } else { known.name.clone() };
    let tiers = match tiers {
        Some(t) if t.is_empty() => return Err("`tiers` is empty".into()),
        Some(t) => t,
        None => {
            let Some((count, unit)) = known.limit else {
                return Err(format!("`{}` is unlimited: give `tiers` to limit it", known.full_key));
            };
            vec![TierSpec {
                name: Some(default_name.clone()),
                requests_per_unit: u64::from(count),
                unit: Some(unit.name().to_owned()),
                burst: None,
                calendar: None,
                time_zone: None,
            }]
        }
    };
    let mut builder = Policy::builder(known.full_key.clone()).algorithm(algorithm);
    let mut reports = Vec::with_capacity(tiers.len());
    for (i, t) in tiers.iter().enumerate() {
        let name = t
            .name
            .clone()
            .unwrap_or_else(|| if i == 0 { default_name.clone() } else { format!("tier{i}") });
        let count = u32::try_from(t.requests_per_unit)
            .map_err(|_| format!("tier `{name}`: requests_per_unit above {}", u32::MAX))?;
        let unit = match (&t.calendar, &t.unit) {
            (Some(_), Some(_)) => {
                return Err(format!("tier `{name}`: give `unit` or `calendar`, not both"));
            }
            (Some(c), None) => {
                let (period, unit) = calendar_period(c).ok_or_else(|| {
                    format!("tier `{name}`: unknown calendar '{c}': expected minute, hour, day, week, month or year")
                })?;
                if t.burst.is_some() {
                    return Err(format!("tier `{name}`: a calendar tier takes no `burst`"));
                }
                let mut cal = Calendar::new(t.requests_per_unit, period);
                if let Some(z) = &t.time_zone {
                    cal = cal.in_time_zone(z.clone());
                }
                builder = builder.calendar(name.clone(), cal);
                unit
            }
            (None, Some(u)) => {
                let unit = Unit::from_name(u)
                    .ok_or_else(|| format!("tier `{name}`: invalid unit '{u}'"))?;
                if t.time_zone.is_some() {
                    return Err(format!("tier `{name}`: `time_zone` is for calendar tiers"));
                }
                let mut quota =
                    Quota::new(t.requests_per_unit, Duration::from_secs(unit.seconds()));
                if let Some(b) = t.burst {
                    quota = quota.with_burst(b);
                }
                builder = builder.tier(name.clone(), quota);
                unit
            }
            (None, None) => return Err(format!("tier `{name}`: needs `unit` or `calendar`")),
        };
        reports.push(Report { count, unit, name: Arc::from(name.as_str()) });
    }
    if let Some(p) = penalty {
        let tier = match p.tier {
            Some(t) => t,
            None if reports.len() == 1 => reports[0].name.to_string(),
            None => return Err("penalty: name its `tier` (the policy has several)".into()),
        };
        let mut penalty = Penalty::new(p.block);
        match (p.after, p.within) {
            (Some(n), Some(w)) => penalty = penalty.after(n, w),
            (None, None) => {}
            _ => return Err("penalty: give `after` and `within` together".into()),
        }
        builder = builder.penalty(tier, penalty);
    }
    let policy = builder.build().map_err(|e| e.to_string())?;
    let lease = lease.map(|l| {
        let mut lease = Lease::new();
        if let Some(b) = l.max_block {
            lease = lease.max_block(b);
        }
        if let Some(t) = l.lifetime {
            lease = lease.lifetime(t);
        }
        if let Some(p) = l.prefetch {
            lease = lease.prefetch(p);
        }
        lease
    });
    Ok(Extension { file: file.to_owned(), policy, reports, lease })
}

/// The extensions of every companion file, by domain and path, taken as the trees are built.
#[derive(Debug, Default)]
pub(crate) struct Index {
    limits: HashMap<(String, Vec<String>), Extension>,
    failure_modes: HashMap<String, FailureMode>,
}

impl Index {
    pub(super) fn new(files: Vec<File>) -> Result<Self, ConfigError> {
        let mut index = Index::default();
        for f in files {
            if index.failure_modes.insert(f.domain.clone(), f.failure_mode).is_some() {
                return Err(ConfigError::whole(
                    &f.name,
                    format!("domain '{}' has a second companion file", f.domain),
                ));
            }
            for (path, ext) in f.limits {
                index.limits.insert((f.domain.clone(), path), ext);
            }
        }
        Ok(index)
    }

    pub(super) fn take(&mut self, domain: &str, path: &[String]) -> Option<Extension> {
        self.limits.remove(&(domain.to_owned(), path.to_vec()))
    }

    pub(super) fn failure_mode(&self, domain: &str) -> FailureMode {
        self.failure_modes.get(domain).copied().unwrap_or_default()
    }
}

/// Durations written as humantime reads them (`"250ms"`, `"15m"`, `"1h 30m"`).
mod humantime_serde_compat {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, de};

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s)
            .map_err(|e| de::Error::custom(format_args!("duration '{s}': {e}")))
    }

    pub(super) mod option {
        use super::*;

        pub(in super::super) fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Option<Duration>, D::Error> {
            super::deserialize(d).map(Some)
        }
    }
}
