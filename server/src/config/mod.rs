//! The service's configuration: envoyproxy/ratelimit's YAML files, unchanged, and tollgate's
//! companion files beside them.
//!
//! A [`Config`] is built from [`Source`]s (a file's name and text) in one go: every file is read,
//! every limit is bound to its store, or the whole configuration is refused with the first
//! error's `file:line:column`, and the running one stays.
//!
//! # Matching
//!
//! A request's descriptor (a list of entries `key=value`) is matched as envoyproxy/ratelimit
//! matches it, entry by entry down the domain's tree: at each level the node named
//! `key_value` wins, then a wildcard node whose name (`key_prefix*`, or with `*` anywhere)
//! matches `key_value`, then the node named `key` alone (any value). A limit applies when it
//! is on the node matched by the descriptor's last entry; a descriptor longer or shorter than
//! the tree's path to a limit is not limited.

mod ext;
mod tree;
mod yaml;

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use ext::{Extension, FailureMode, HeaderStyle, Report};
pub use tree::{Matched, Rule};

use crate::engine::Backends;
use tree::Node;

/// A rate limit unit: a window of this many seconds, aligned to the Unix epoch as
/// envoyproxy/ratelimit aligns it (a month is 30 days, a year 365).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    /// 1 s.
    Second,
    /// 60 s.
    Minute,
    /// 3,600 s.
    Hour,
    /// 86,400 s.
    Day,
    /// 7 days.
    Week,
    /// 30 days.
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    /// The unit named `name`, in any case (`second`, `SECOND`); `None` for another name.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name.to_ascii_uppercase().as_str() {
            "SECOND" => Self::Second,
            "MINUTE" => Self::Minute,
            "HOUR" => Self::Hour,
            "DAY" => Self::Day,
            "WEEK" => Self::Week,
            "MONTH" => Self::Month,
            "YEAR" => Self::Year,
            _ => return None,
        })
    }

    /// The window's length in seconds.
    #[must_use]
    pub const fn seconds(self) -> u64 {
        match self {
            Self::Second => 1,
            Self::Minute => 60,
            Self::Hour => 3_600,
            Self::Day => 86_400,
            Self::Week => 7 * 86_400,
            Self::Month => 30 * 86_400,
            Self::Year => 365 * 86_400,
        }
    }

    /// The unit's number in the RLS protocol (`RateLimitResponse.RateLimit.Unit`).
    #[must_use]
    pub const fn proto(self) -> i32 {
        match self {
            Self::Second => 1,
            Self::Minute => 2,
            Self::Hour => 3,
            Self::Day => 4,
            Self::Month => 5,
            Self::Year => 6,
            Self::Week => 7,
        }
    }

    /// The unit of protocol number `n`; `None` for UNKNOWN (0) and numbers it does not know.
    #[must_use]
    pub const fn from_proto(n: i32) -> Option<Self> {
        Some(match n {
            1 => Self::Second,
            2 => Self::Minute,
            3 => Self::Hour,
            4 => Self::Day,
            5 => Self::Month,
            6 => Self::Year,
            7 => Self::Week,
            _ => return None,
        })
    }

    /// The lowercase name (`"minute"`).
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Second => "second",
            Self::Minute => "minute",
            Self::Hour => "hour",
            Self::Day => "day",
            Self::Week => "week",
            Self::Month => "month",
            Self::Year => "year",
        }
    }
}

/// A configuration refused: where and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file}:{line}:{column}: {message}")]
pub struct ConfigError {
    /// The file's name as given in its [`Source`].
    pub file: String,
    /// 1-based line (1 when the error is about the whole file).
    pub line: usize,
    /// 1-based column.
    pub column: usize,
    /// What is wrong.
    pub message: String,
}

impl ConfigError {
    pub(crate) fn whole(file: &str, message: impl Into<String>) -> Self {
        Self { file: file.to_owned(), line: 1, column: 1, message: message.into() }
    }

    pub(crate) fn yaml(file: &str, e: &serde_yaml_ng::Error) -> Self {
        let (line, column) = e.location().map_or((1, 1), |l| (l.line(), l.column()));
        let mut message = e.to_string();
        // The library appends the location; it is already in front.
        if let Some(at) = message.rfind(" at line ") {
            message.truncate(at);
        }
        Self { file: file.to_owned(), line, column, message }
    }
}

/// One file's name (as errors show it) and text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// The name errors give: the path as it was found.
    pub name: String,
    /// The file's text.
    pub text: String,
}

impl Source {
    /// Whether this is a companion file of tollgate's extensions (a name ending in
    /// `.tollgate.yaml` or `.tollgate.yml`) rather than one of envoyproxy/ratelimit's.
    #[must_use]
    pub fn is_extension(&self) -> bool {
        let name = self.name.to_ascii_lowercase();
        name.ends_with(".tollgate.yaml") || name.ends_with(".tollgate.yml")
    }
}

/// Reads the sources at `path`: the file, or every file under the directory (recursively, in
/// name order, skipping names that start with a dot, such as a Kubernetes ConfigMap's
/// `..data`, which the visible names link into).
///
/// # Errors
/// A [`ConfigError`] naming the path when it cannot be read.
pub fn read_sources(path: &Path) -> Result<Vec<Source>, ConfigError> {
    let io =
        |p: &Path, e: std::io::Error| ConfigError::whole(&p.display().to_string(), e.to_string());
    let meta = std::fs::metadata(path).map_err(|e| io(path, e))?;
    let mut files = Vec::new();
    if meta.is_dir() {
        collect(path, &mut files).map_err(|e| io(path, e))?;
    } else {
        files.push(path.to_path_buf());
    }
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p).map_err(|e| io(&p, e))?;
            Ok(Source { name: p.display().to_string(), text })
        })
        .collect()
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        // Follows links, as ConfigMap mounts are links.
        let meta = std::fs::metadata(&path)?;
        if meta.is_dir() {
            collect(&path, out)?;
        } else if meta.is_file() {
            out.push(path);
        }
    }
    Ok(())
}

/// Options of loading that come from the environment rather than the files.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Several files may add to one domain (envoyproxy/ratelimit's `MERGE_DOMAIN_CONFIG`);
    /// otherwise a second file of a domain is refused.
    pub merge_domains: bool,
}

/// A domain: its tree of limits, and its extension settings.
#[derive(Debug)]
pub struct Domain {
    pub(crate) name: Arc<str>,
    pub(crate) root: Node,
    /// What a decision does when the store fails.
    pub failure_mode: FailureMode,
}

impl Domain {
    /// The domain's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// A checked configuration with every limit bound to its store.
#[derive(Debug, Default)]
pub struct Config {
    pub(crate) domains: HashMap<Arc<str>, Domain>,
    /// How many limits (descriptors with a `rate_limit`) it holds.
    pub limits: usize,
}

impl Config {
    /// Reads, checks and binds `sources`.
    ///
    /// ```
    /// use tollgate_server::config::{Config, LoadOptions, Source};
    /// use tollgate_server::engine::Backends;
    ///
    /// let text = "domain: rl\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 10}\n";
    /// let sources = [Source { name: "rl.yaml".into(), text: text.into() }];
    /// let config = Config::build(&sources, LoadOptions::default(), &Backends::memory()).unwrap();
    /// assert_eq!((config.domain_names(), config.limits), (vec!["rl"], 1));
    ///
    /// let bad = [Source { name: "rl.yaml".into(), text: text.replace("minute", "moon") }];
    /// let e = Config::build(&bad, LoadOptions::default(), &Backends::memory()).unwrap_err();
    /// assert_eq!(e.to_string(), "rl.yaml:4:17: descriptors[0].rate_limit: invalid rate limit unit 'moon'");
    /// ```
    ///
    /// # Errors
    /// The first [`ConfigError`]: a file that is not YAML, a key the reference does not know,
    /// a duplicate domain or descriptor, an invalid unit, a companion entry naming a
    /// descriptor that has no limit, a policy the store cannot run.
    pub fn build(
        sources: &[Source],
        options: LoadOptions,
        backends: &Backends,
    ) -> Result<Self, ConfigError> {
        let mut roots = Vec::new();
        for source in sources.iter().filter(|s| !s.is_extension()) {
            let raw = yaml::parse(&source.text).map_err(|e| ConfigError::yaml(&source.name, &e))?;
            if raw.domain.is_empty() {
                return Err(ConfigError::whole(
                    &source.name,
                    "config file cannot have empty domain",
                ));
            }
            roots.push((source.name.as_str(), raw));
        }
        let seed = ext::seed(&roots);
        let files = sources
            .iter()
            .filter(|s| s.is_extension())
            .map(|s| ext::parse(s, &seed))
            .collect::<Result<Vec<_>, _>>()?;
        let leases = files
            .iter()
            .flat_map(|f| &f.limits)
            .filter_map(|(_, x)| x.lease.map(|l| (x.policy.name().to_owned(), l)))
            .collect();
        let binder = backends.binder(leases).map_err(|e| {
            ConfigError::whole(sources.iter().find(|s| s.is_extension()).map_or("", |s| &s.name), e)
        })?;
        let mut exts = ext::Index::new(files)?;
        let mut config = Config::default();
        for (file, raw) in roots {
            let domain: Arc<str> = Arc::from(raw.domain.as_str());
            let mut root = match config.domains.remove(&domain) {
                Some(_) if !options.merge_domains => {
                    return Err(ConfigError::whole(
                        file,
                        format!("duplicate domain '{domain}' in config file"),
                    ));
                }
                Some(existing) => existing.root,
                None => Node::default(),
            };
            config.limits +=
                tree::load(&mut root, file, &domain, &raw.descriptors, &mut exts, &binder)?;
            let failure_mode = exts.failure_mode(&domain);
            config.domains.insert(domain.clone(), Domain { name: domain, root, failure_mode });
        }
        Ok(config)
    }

    /// The domain named `name`.
    #[must_use]
    pub fn domain(&self, name: &str) -> Option<&Domain> {
        self.domains.get(name)
    }

    /// The domains' names, sorted.
    #[must_use]
    pub fn domain_names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.domains.keys().map(|k| &**k).collect();
        v.sort_unstable();
        v
    }
}

impl fmt::Display for Unit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
