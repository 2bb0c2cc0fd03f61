//! envoyproxy/ratelimit's statistics, named as its statsd-to-Prometheus mapping names them.
//!
//! The reference counts, per limit, `ratelimit.service.rate_limit.<key>.total_hits`,
//! `over_limit`, `near_limit`, `within_limit` and `shadow_mode`, `<key>` being the limit's
//! full key (`domain.key_value.key2`, or the request's values with `detailed_metric`), with
//! `:` and `|` made `_`, and the dots of an IPv4 address too. Its Prometheus mapping turns
//! them into `ratelimit_service_rate_limit_<stat>` with the labels `domain` and `key1` (the
//! key's first two parts), and `key2` (its third) when the key has more parts. So do these.
//! Hits are counted as the reference counts them: a request of `n` hits adds `n`.

use metrics::{Counter, Label};

/// The counters of one stats key.
#[derive(Debug, Clone)]
pub(crate) struct RuleStats {
    pub(crate) total_hits: Counter,
    pub(crate) over_limit: Counter,
    pub(crate) near_limit: Counter,
    pub(crate) within_limit: Counter,
    pub(crate) shadow_mode: Counter,
    /// tollgate's own `tollgate_decisions_total` of the limit's first tier: admitted, limited,
    /// dry_run_limited.
    decisions: [Counter; 3],
    policy: std::sync::Arc<str>,
    tier: std::sync::Arc<str>,
}

impl RuleStats {
    /// The counters of `key` (`domain.key_value...`), whose decisions are tollgate's
    /// `policy` and `tier`.
    pub(crate) fn new(key: &str, policy: &str, tier: &str) -> Self {
        let labels = labels(&sanitize(key));
        let c = |name: &'static str| metrics::counter!(name, labels.clone());
        let d = |outcome: &'static str| {
            metrics::counter!(
                "tollgate_decisions_total",
                "policy" => policy.to_owned(),
                "tier" => tier.to_owned(),
                "outcome" => outcome
            )
        };
        Self {
            decisions: [d("admitted"), d("limited"), d("dry_run_limited")],
            policy: std::sync::Arc::from(policy),
            tier: std::sync::Arc::from(tier),
            total_hits: c("ratelimit_service_rate_limit_total_hits"),
            over_limit: c("ratelimit_service_rate_limit_over_limit"),
            near_limit: c("ratelimit_service_rate_limit_near_limit"),
            within_limit: c("ratelimit_service_rate_limit_within_limit"),
            shadow_mode: c("ratelimit_service_rate_limit_shadow_mode"),
        }
    }
}

impl RuleStats {
    /// The tier the pre-registered decision counters are labelled with.
    pub(crate) fn first_tier(&self) -> &str {
        &self.tier
    }
}

/// `domain`, `key1` and, for a key of three parts or more, `key2`.
fn labels(key: &str) -> Vec<Label> {
    let mut parts = key.split('.');
    let mut out = Vec::with_capacity(3);
    for name in ["domain", "key1", "key2"] {
        match parts.next() {
            Some(p) => out.push(Label::new(name, p.to_owned())),
            None => break,
        }
    }
    out
}

/// The reference's clean-up of a stat name: `:` and `|` become `_`, and so do the dots of
/// anything shaped like an IPv4 address.
pub(crate) fn sanitize(key: &str) -> String {
    let s: String = key.chars().map(|c| if c == ':' || c == '|' { '_' } else { c }).collect();
    let b = s.as_bytes();
    let mut out = b.to_vec();
    // Find runs of d{1,3}.d{1,3}.d{1,3}.d{1,3} (leftmost, non-overlapping) and replace their dots.
    let mut i = 0;
    while i < b.len() {
        if let Some(len) = ipv4_at(b, i) {
            for c in &mut out[i..i + len] {
                if *c == b'.' {
                    *c = b'_';
                }
            }
            i += len;
        } else {
            i += 1;
        }
    }
    String::from_utf8(out).unwrap_or(s)
}

/// The length of the longest `d{1,3}(.d{1,3}){3}` at `i` (a regular expression's leftmost
/// match: greedy digits, backing off when the dots do not follow).
fn ipv4_at(b: &[u8], i: usize) -> Option<usize> {
    fn group(b: &[u8], i: usize, rest: usize) -> Option<usize> {
        let digits = b[i..].iter().take(3).take_while(|c| c.is_ascii_digit()).count();
        (1..=digits).rev().find_map(|n| {
            if rest == 0 {
                return Some(n);
            }
            let j = i + n;
            (b.get(j) == Some(&b'.') && j + 1 < b.len())
                .then(|| group(b, j + 1, rest - 1).map(|m| n + 1 + m))
                .flatten()
        })
    }
    group(b, i, 3)
}

/// Counts one descriptor's hits as the reference does: every hit in `total_hits`; of a
/// refused request the hits past the limit in `over_limit` (and those between the near-limit
/// threshold and the limit in `near_limit`); of an admitted one all in `within_limit`, and
/// those past the threshold in `near_limit`; `shadow_mode` takes the over-limit hits of a
/// shadow limit.
#[allow(clippy::too_many_arguments)]
pub(crate) fn count(
    stats: &RuleStats,
    limit: u64,
    near_ratio: f32,
    hits: u64,
    before: u64,
    after: u64,
    admitted: bool,
    shadow: bool,
) {
    stats.total_hits.increment(hits);
    // The reference computes the threshold in 32-bit floating point.
    let near = (limit as f32 * near_ratio).floor() as u64;
    if admitted {
        stats.within_limit.increment(hits);
        if after > near {
            stats.near_limit.increment(if before >= near { hits } else { after - near });
        }
    } else {
        let over = if before >= limit { hits } else { after.saturating_sub(limit) };
        stats.over_limit.increment(over);
        if before < limit {
            stats.near_limit.increment(limit.saturating_sub(near.max(before)));
        }
        if shadow {
            stats.shadow_mode.increment(over);
        }
    }
}

/// tollgate's own `tollgate_decisions_total{policy, tier, outcome}` of a limit's decision:
/// `admitted`, `limited`, or `dry_run_limited` (a shadow-mode limit that would have refused).
/// `tier` is the tier reported when it is not the first (a policy of several tiers).
pub(crate) fn decision(stats: &RuleStats, tier: Option<&str>, admitted: bool, shadow: bool) {
    let i = match (admitted, shadow) {
        (true, _) => 0,
        (false, false) => 1,
        (false, true) => 2,
    };
    match tier {
        None => stats.decisions[i].increment(1),
        Some(tier) => {
            let outcome = ["admitted", "limited", "dry_run_limited"][i];
            metrics::counter!(
                "tollgate_decisions_total",
                "policy" => stats.policy.to_string(),
                "tier" => tier.to_owned(),
                "outcome" => outcome
            )
            .increment(1);
        }
    }
}

/// Service-wide counters.
pub(crate) fn service_error(kind: &'static str) {
    metrics::counter!("ratelimit_service_should_rate_limit_error", "err_type" => kind).increment(1);
}

/// A configuration loaded (`true`) or refused.
pub(crate) fn config_load(ok: bool) {
    if ok {
        metrics::counter!("ratelimit_service_config_load_success").increment(1);
    } else {
        metrics::counter!("ratelimit_service_config_load_error").increment(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_cleaned_as_the_reference_cleans_them() {
        assert_eq!(sanitize("rl.remote_address_10.0.0.1"), "rl.remote_address_10_0_0_1");
        assert_eq!(sanitize("rl.a:b|c"), "rl.a_b_c");
        assert_eq!(sanitize("rl.version_1.2.3"), "rl.version_1.2.3");
        assert_eq!(sanitize("1234.5.6.7"), "1234_5_6_7");
    }

    #[test]
    fn labels_follow_the_default_mapping() {
        let l = labels("rl.generic_key_slow");
        assert_eq!(
            l.iter().map(|l| (l.key(), l.value())).collect::<Vec<_>>(),
            [("domain", "rl"), ("key1", "generic_key_slow")]
        );
        let l = labels("rl.a.b.c");
        assert_eq!(l.len(), 3);
        assert_eq!(l[2].value(), "b");
    }
}
