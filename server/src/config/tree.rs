//! A domain's descriptor tree and the matching of a request's descriptor against it (see the
//! [module docs](super)).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;

use super::yaml::RawDescriptor;
use super::{ConfigError, Unit, ext};
use crate::engine::{Binder, Engine};
use crate::stats::RuleStats;

type Map<V> = HashMap<Box<str>, V, ahash::RandomState>;

/// A node of the tree: its children by name (`key` or `key_value`), the wildcard children in
/// file order, and the limit it carries.
#[derive(Debug, Default)]
pub(crate) struct Node {
    children: Map<Node>,
    wildcards: Vec<Wildcard>,
    rule: Option<Arc<Rule>>,
    value_to_metric: bool,
    share_threshold: bool,
}

/// A child whose name has a `*`, split at the stars once, at load time.
#[derive(Debug)]
struct Wildcard {
    name: Box<str>,
    parts: Vec<Box<str>>,
}

impl Wildcard {
    /// Whether `text` matches: each `*` stands for any run of characters, possibly empty.
    fn matches(&self, text: &str) -> bool {
        let parts = &self.parts;
        let (first, last) = (&parts[0], &parts[parts.len() - 1]);
        if parts.len() == 1 {
            return **first == *text;
        }
        let fixed: usize = parts.iter().map(|p| p.len()).sum();
        if text.len() < fixed || !text.starts_with(&**first) || !text.ends_with(&**last) {
            return false;
        }
        let mut rest = &text[first.len()..text.len() - last.len()];
        for part in &parts[1..parts.len() - 1] {
            match rest.find(&**part) {
                Some(at) => rest = &rest[at + part.len()..],
                None => return false,
            }
        }
        true
    }
}

/// A limit of the configuration: a descriptor's `rate_limit` (or an Envoy-supplied override),
/// with the engine that decides it and its statistics.
#[derive(Debug)]
pub struct Rule {
    /// `domain.key_value.key2`: the path of config keys, as the reference names its stats.
    pub full_key: Arc<str>,
    /// `requests_per_unit` per `unit`; `None` when unlimited.
    pub limit: Option<(u32, Unit)>,
    /// `rate_limit.name`, for `replaces`; empty when unnamed.
    pub name: Arc<str>,
    /// The names of the limits this one replaces.
    pub replaces: Box<[Arc<str>]>,
    /// Decide and count, but never refuse.
    pub shadow_mode: bool,
    /// A quota: the request is refused only when every quota descriptor is over its limit.
    pub quota_mode: bool,
    /// Stats named by the request's values rather than the config's keys.
    pub detailed_metric: bool,
    pub(crate) engine: Engine,
    pub(crate) stats: RuleStats,
}

/// A descriptor matched to a limit.
#[derive(Debug)]
pub struct Matched<'a> {
    /// The limit.
    pub rule: &'a Arc<Rule>,
    /// The stats key when it is not the rule's `full_key` (`detailed_metric`,
    /// `value_to_metric`).
    pub stats_key: Option<String>,
    /// For entries matched by a wildcard with `share_threshold`, the pattern that stands for
    /// the entry's value in the counter's key (one counter for every matching value).
    pub shared: Vec<(usize, &'a str)>,
}

/// How one level of a descriptor was matched, for the stats key.
#[derive(Clone, Copy)]
struct Level<'a> {
    node: Option<&'a Node>,
    wildcard: Option<&'a Wildcard>,
    by_value: bool,
}

impl Node {
    /// The limit for `entries` in domain `domain` (see the [module docs](super)).
    pub(crate) fn matching<'a>(&'a self, domain: &str, entries: &[Entry]) -> Option<Matched<'a>> {
        let mut at = self;
        let mut found: Option<&'a Arc<Rule>> = None;
        let mut shared: Vec<(usize, &'a str)> = Vec::new();
        let mut levels: Vec<Level<'a>> = Vec::with_capacity(entries.len());
        let mut name = String::new();
        let mut metric_values = false;
        for (i, entry) in entries.iter().enumerate() {
            name.clear();
            name.push_str(&entry.key);
            name.push('_');
            name.push_str(&entry.value);
            let mut next = at.children.get(name.as_str());
            let mut wildcard = None;
            if next.is_none()
                && let Some(w) = at.wildcards.iter().find(|w| w.matches(&name))
            {
                next = at.children.get(&w.name);
                wildcard = Some(w);
            }
            let by_value = next.is_some();
            if next.is_none() {
                next = at.children.get(entry.key.as_str());
            }
            if let (Some(w), Some(n)) = (wildcard, next)
                && n.share_threshold
            {
                let pattern = w.name.strip_prefix(entry.key.as_str()).unwrap_or(&w.name);
                shared.push((i, pattern.strip_prefix('_').unwrap_or(pattern)));
            }
            metric_values |= next.is_some_and(|n| n.value_to_metric);
            levels.push(Level { node: next, wildcard, by_value });
            if let Some(rule) = next.and_then(|n| n.rule.as_ref())
                && i + 1 == entries.len()
            {
                found = Some(rule);
            }
            match next {
                Some(n) if !n.children.is_empty() => at = n,
                _ => break,
            }
        }
        let rule = found?;
        let stats_key = if rule.detailed_metric {
            Some(detailed_key(domain, entries, &shared))
        } else if metric_values {
            let key = value_key(domain, entries, &levels, &shared);
            (*key != *rule.full_key).then_some(key)
        } else {
            None
        };
        Some(Matched { rule, stats_key, shared })
    }
}

/// `domain.key_value.key2_value2`: the stats key of a `detailed_metric` limit (a wildcard entry
/// with `share_threshold` is named by its pattern).
fn detailed_key(domain: &str, entries: &[Entry], shared: &[(usize, &str)]) -> String {
    let mut key = String::from(domain);
    for (i, e) in entries.iter().enumerate() {
        key.push('.');
        key.push_str(&e.key);
        match shared.iter().find(|(j, _)| *j == i) {
            Some((_, pattern)) => {
                key.push('_');
                key.push_str(pattern);
            }
            None if !shared.is_empty() => {
                if !e.value.is_empty() {
                    key.push('_');
                    key.push_str(&e.value);
                }
            }
            None => {
                key.push('_');
                key.push_str(&e.value);
            }
        }
    }
    key
}

/// The stats key of a path where some node has `value_to_metric`: such a node matched by its
/// key alone or by a wildcard is named by the request's value.
fn value_key(
    domain: &str,
    entries: &[Entry],
    levels: &[Level<'_>],
    shared: &[(usize, &str)],
) -> String {
    let mut key = String::from(domain);
    for (i, (e, level)) in entries.iter().zip(levels).enumerate() {
        key.push('.');
        key.push_str(&e.key);
        let Some(node) = level.node else { continue };
        let value: &str = if let Some(w) = level.wildcard {
            if let Some((_, pattern)) = shared.iter().find(|(j, _)| *j == i) {
                pattern
            } else if node.value_to_metric {
                &e.value
            } else {
                let p = w.name.strip_prefix(e.key.as_str()).unwrap_or(&w.name);
                p.strip_prefix('_').unwrap_or(p)
            }
        } else if level.by_value || node.value_to_metric {
            &e.value
        } else {
            ""
        };
        if !value.is_empty() {
            let _ = write!(key, "_{value}");
        }
    }
    key
}

/// Loads `descriptors` under `node` (the domain's root, or a node of a merged domain),
/// binding each limit. Returns how many limits were loaded.
pub(super) fn load(
    node: &mut Node,
    file: &str,
    domain: &str,
    descriptors: &[RawDescriptor],
    exts: &mut ext::Index,
    binder: &Binder,
) -> Result<usize, ConfigError> {
    let mut path = Vec::new();
    load_level(node, file, domain, &format!("{domain}."), descriptors, &mut path, exts, binder)
}

#[allow(clippy::too_many_arguments)]
fn load_level(
    node: &mut Node,
    file: &str,
    domain: &str,
    parent: &str,
    descriptors: &[RawDescriptor],
    path: &mut Vec<String>,
    exts: &mut ext::Index,
    binder: &Binder,
) -> Result<usize, ConfigError> {
    let mut count = 0;
    for d in descriptors {
        let name = d.composite();
        let full_key = format!("{parent}{name}");
        if node.children.contains_key(name.as_str()) {
            return Err(ConfigError::whole(
                file,
                format!("duplicate descriptor composite key '{full_key}'"),
            ));
        }
        path.push(name.clone());
        let rule = match &d.rate_limit {
            None => None,
            Some(rl) => {
                count += 1;
                let limit =
                    if rl.unlimited { None } else { rl.unit.map(|u| (rl.requests_per_unit, u)) };
                let extension = exts.take(domain, path);
                let engine = binder.engine(&full_key, limit, extension.as_ref()).map_err(|e| {
                    match &extension {
                        Some(x) => ConfigError::whole(&x.file, format!("{full_key}: {e}")),
                        None => ConfigError::whole(file, format!("{full_key}: {e}")),
                    }
                })?;
                let tier = match &extension {
                    Some(x) => x.reports[0].name.to_string(),
                    None => limit.map_or("unlimited", |(_, u)| u.name()).to_owned(),
                };
                let full_key: Arc<str> = Arc::from(full_key.as_str());
                Some(Arc::new(Rule {
                    stats: RuleStats::new(&full_key, &full_key, &tier),
                    full_key,
                    limit,
                    name: Arc::from(rl.name.as_str()),
                    replaces: rl.replaces.iter().map(|r| Arc::from(r.as_str())).collect(),
                    shadow_mode: d.shadow_mode,
                    quota_mode: d.quota_mode,
                    detailed_metric: d.detailed_metric,
                    engine,
                }))
            }
        };
        let mut child = Node {
            rule,
            value_to_metric: d.value_to_metric,
            share_threshold: d.share_threshold,
            ..Node::default()
        };
        if d.has_metadata {
            crate::once::warn(
                "metadata",
                "tollgate-server: descriptor `metadata` is read but not sent as response dynamic metadata",
            );
        }
        count += load_level(
            &mut child,
            file,
            domain,
            &format!("{full_key}."),
            &d.descriptors,
            path,
            exts,
            binder,
        )?;
        path.pop();
        if name.contains('*') {
            node.wildcards.push(Wildcard {
                parts: name.split('*').map(Box::from).collect(),
                name: Box::from(name.as_str()),
            });
        }
        node.children.insert(Box::from(name.as_str()), child);
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(name: &str) -> Wildcard {
        Wildcard { parts: name.split('*').map(Box::from).collect(), name: Box::from(name) }
    }

    #[test]
    fn wildcards_match_like_the_reference() {
        assert!(w("path_/foo*").matches("path_/foo/bar"));
        assert!(w("path_/foo*").matches("path_/foo"));
        assert!(!w("path_/fo*").matches("path_/bar"));
        assert!(w("path_a*b*c").matches("path_aXbYc"));
        assert!(w("path_a*b*c").matches("path_abc"));
        assert!(!w("path_a*b*c").matches("path_acb"));
        // The fixed parts may not overlap.
        assert!(!w("k_ab*ba").matches("k_aba"));
        assert!(w("k_exact").matches("k_exact"));
        assert!(!w("k_exact").matches("k_exactly"));
    }
}
