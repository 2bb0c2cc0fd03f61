//! Policies and rules from a TOML file, reloaded without a restart (cargo feature `config`).
//!
//! A [`LimitsConfig`] is a checked file: its policies, and rules that say which requests each
//! policy limits and how. A [`LimitsLayer`] serves it as a Tower layer, over a
//! [`MemoryStore`] or any other [`Store`](crate::store::Store); its
//! [`ReloadHandle`] swaps in a new configuration while requests are being served, from a
//! [`LimitsConfig`], by re-reading the file, or by [watching](ReloadHandle::watch) it.
//!
//! ```no_run
//! use std::net::SocketAddr;
//! use std::time::Duration;
//! use axum::{Router, routing::get};
//! use tollgate::config::{LimitsConfig, LimitsLayer};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let layer = LimitsLayer::new(LimitsConfig::load("tollgate.toml")?)?;
//! // Reload when the file changes, checking every 5 s; a bad file is logged and ignored.
//! tokio::spawn(layer.handle().watch("tollgate.toml", Duration::from_secs(5)));
//! let app = Router::new().route("/api/items", get(|| async { "items" })).layer(layer);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
//! # Ok(()) }
//! ```
//!
//! # The file
//!
//! ```toml
//! # replace_all = true        # let a reload drop every running policy (or leave none); off by
//!                             # default, so a file caught mid-rewrite never lifts the limits
//!
//! # A policy: a name, an algorithm, one or more tiers on the same key (every tier must admit).
//! [policies.per-ip]
//! algorithm = "gcra"            # gcra (default), token_bucket, leaky_bucket, fixed_window,
//!                               # sliding_log, sliding_counter
//! changed_tiers = "start_full"  # on a reload that changes a tier: start_full (default), or
//!                               # carry_used_fraction (each key keeps its used share)
//! [[policies.per-ip.tiers]]
//! name = "burst"                # shown in the RateLimit headers
//! count = 20                    # units per period
//! period = "1s"                 # "500ms", "1m", "1h 30m", "1day" (humantime's form)
//! burst = 40                    # optional, default: count
//! [[policies.per-ip.tiers]]
//! name = "hourly"
//! count = 5000
//! period = "1h"
//!
//! [policies.free]
//! tiers = [{ name = "free", count = 100, period = "1m" }]
//! [policies.pro]
//! tiers = [{ name = "pro", count = 1000, period = "1m" }]
//!
//! # A rule: which requests, keyed how, limited by which policy. Every rule whose paths and
//! # methods match a request applies to it, in file order.
//! [[rules]]
//! name = "per-ip"
//! skip_paths = ["/healthz"]     # "/exact", "/prefix/*", "*"; default: no path is skipped
//! skip_methods = ["OPTIONS"]
//! key = "client_ip"             # peer_ip (default), client_ip, header:<name>, route, method,
//!                               # global, grpc_method, grpc_service, or a list (a tuple key)
//! trusted_proxies = ["10.0.0.0/8"]
//! allow_cidrs = ["172.16.0.0/12"]
//! policy = "per-ip"
//!
//! [[rules]]
//! name = "plans"
//! paths = ["/api/*"]            # default: every path
//! key = "header:x-api-key"
//! missing_key = "reject:401"    # reject (400), reject:<status>, allow, shared
//! plan = { header = "x-plan", policies = ["free", "pro"], otherwise = "policy:free" }
//! ```
//!
//! Policies: `[policies.NAME]` with `algorithm` and `changed_tiers` (both optional) and
//! `tiers` ([`Policy`], [`Carry`](crate::store::Carry)); each tier has a `name` and the fields
//! of its `kind` (see [Tiers](#tiers)).
//!
//! Rules (`[[rules]]`), each mapped onto a [`RateLimitLayerBuilder`](crate::RateLimitLayerBuilder):
//!
//! | field | meaning | builder |
//! |---|---|---|
//! | `name` | required, unique: shown in errors | |
//! | `paths`, `skip_paths` | `"/login"` exactly, `"/api/*"` everything under `/api/`, `"*"` all; `paths` left out: every path | |
//! | `methods`, `skip_methods` | only these methods; never these (case-sensitive, RFC 9110 §9.1) | |
//! | `key` | the key extractor, or a list of them (a tuple key) | [`key`](crate::RateLimitLayerBuilder::key) |
//! | `trusted_proxies`, `forwarded_header`, `ipv6_prefix` | for `client_ip` (required with it; `"x-forwarded-for"`, `"forwarded"`, `"x-real-ip"`) and `peer_ip` | [`ClientIp`](crate::key::ClientIp), [`PeerIp`](crate::key::PeerIp) |
//! | `missing_key` | `"reject"` (400), `"reject:<status>"`, `"allow"`, `"shared"` | [`missing_key`](crate::RateLimitLayerBuilder::missing_key) |
//! | `policy` | the policy | [`with_limiter`](crate::RateLimitLayer::with_limiter) |
//! | `plan` | `header` whose value names one of `policies`; `otherwise`: `"policy:<name>"` (one of them), `"pass"`, `"reject"` (403) or `"reject:<status>"` | [`select`](crate::RateLimitLayerBuilder::select), [`unselected`](crate::RateLimitLayerBuilder::unselected) |
//! | `cost` | units per request (default 1) | [`cost`](crate::RateLimitLayerBuilder::cost) |
//! | `allow_keys`, `allow_cidrs` | never limited | [`allow_keys`](crate::RateLimitLayerBuilder::allow_keys), [`allow_cidrs`](crate::RateLimitLayerBuilder::allow_cidrs) |
//! | `dry_run` | decide and report, never refuse | [`dry_run`](crate::RateLimitLayerBuilder::dry_run) |
//! | `max_delay`, `max_waiters` | shape (hold up to this long) instead of police | [`shape`](crate::RateLimitLayerBuilder::shape), [`max_waiters`](crate::RateLimitLayerBuilder::max_waiters) |
//! | `tarpit` | delay every refusal | [`tarpit`](crate::RateLimitLayerBuilder::tarpit) |
//! | `headers` | `"ietf"` (default), `"legacy"`, `"both"`, `"none"` | [`headers`](crate::RateLimitLayerBuilder::headers) |
//! | `on_store_error` | `"fail_closed"` (default) or `"fail_open"` | [`on_store_error`](crate::RateLimitLayerBuilder::on_store_error) |
//! | `on_stream` | `"police"`, `"shape"` or `"settle"` (default: as the rule decides requests, shaped with `max_delay`, else policed): how tiers counting bytes or messages meter a stream | [`on_stream`](crate::RateLimitLayerBuilder::on_stream) |
//! | `log_keys` | `"redacted"` (default) or `"raw"` | [`log_keys`](crate::RateLimitLayerBuilder::log_keys) |
//! | `header_format` | `"draft10"` (default), `"draft7"`, `"draft6"`: the revision of the IETF draft the `RateLimit*` fields follow | [`header_format`](crate::RateLimitLayerBuilder::header_format) |
//! | `explain_missing_key` | `true`: a refusal for a missing key says what the extractor looked for; default: on in debug builds | [`explain_missing_key`](crate::RateLimitLayerBuilder::explain_missing_key) |
//! | `refund_on` | statuses (`"503"`) and classes (`"5xx"`) whose responses give the charge back | [`refund_if`](crate::RateLimitLayerBuilder::refund_if) |
//! | `priority_header` | a header whose value, `critical`, `standard` or `sheddable`, is the request's class for reserved capacity (missing or unknown: standard) | [`priority_header`](crate::RateLimitLayerBuilder::priority_header) |
//!
//! Durations (`period` of a rate tier, `lease`, `typical_hold`, `max_delay`, `tarpit`) are
//! written in humantime's form: `"250ms"`, `"1m"`, `"1h 30m"`.
//!
//! The layer builder's closures (`cost_fn`, `settle_cost`, `rejection`, `on_decision`,
//! `filter`, a `select` other than a plan header) have no spelling in the file: a rule's
//! `paths`, `methods`, `plan` and its policies' tier units cover the declarative cases.
//!
//! # Tiers
//!
//! A tier is a rate (the default), a concurrency limit or a calendar quota, as its `kind`
//! says. Each kind takes its own fields; a field of another kind (`burst` on a concurrency
//! tier, `time_zone` on a rate) is refused, as is a kind's required field left out.
//!
//! | `kind` | fields | builder |
//! |---|---|---|
//! | `"rate"` (default) | `count` units per `period` (a duration); `burst`, the units that may be spent at once (default `count`; `1` as [`Quota::at_most`](crate::Quota::at_most); redis-cell's `max_burst` + 1 as [`Quota::redis_cell`](crate::Quota::redis_cell)); `unit` | [`PolicyBuilder::tier`](crate::PolicyBuilder::tier), [`Quota`](crate::Quota) |
//! | `"concurrency"` | `max` requests in flight; `lease` of a slot on a shared store (default 30 s); `typical_hold`, the `Retry-After` until a release was observed (default 1 s) | [`PolicyBuilder::concurrency`](crate::PolicyBuilder::concurrency), [`Concurrency`](crate::Concurrency) |
//! | `"calendar"` | `count` units per `period`: `"minute"`, `"hour"`, `"day"`, `"week"` (ISO, from Monday), `"month"` or `"year"` of `time_zone`'s clock (an IANA name, default `"UTC"`); `unit` | [`PolicyBuilder::calendar`](crate::PolicyBuilder::calendar), [`Calendar`](crate::Calendar) |
//!
//! `unit` says what a rate or calendar tier counts, and so what a request costs on it
//! ([`Unit`](crate::Unit)): `"requests"` (default: the rule's `cost`, 1 unless set),
//! `"request_bytes"` (the body's `Content-Length`, or its bytes counted as it streams),
//! `"response_bytes"` (settled when the response body ends), `"reported"` (what the handler
//! reports through the [`Usage`](crate::Usage) request extension, e.g. an LLM call's tokens),
//! `"request_messages"` or `"response_messages"` (gRPC messages each way: one per call, or
//! each message of a stream with the layer's `on_stream`).
//! A concurrency tier takes one slot per request.
//!
//! ```toml
//! [policies.llm]
//! [[policies.llm.tiers]]
//! name = "per-second"
//! count = 10
//! period = "1s"
//! burst = 20
//! [[policies.llm.tiers]]
//! name = "in-flight"
//! kind = "concurrency"
//! max = 4
//! lease = "1m"                  # a slot on Redis lasts this long without a refresh
//! typical_hold = "2s"
//! [[policies.llm.tiers]]
//! name = "upload-bytes"
//! count = 1_000_000             # bytes per second
//! period = "1s"
//! unit = "request_bytes"
//! [[policies.llm.tiers]]
//! name = "download-bytes"
//! count = 50_000_000
//! period = "1m"
//! unit = "response_bytes"
//! [[policies.llm.tiers]]
//! name = "monthly"
//! kind = "calendar"
//! count = 100_000
//! period = "month"              # from 00:00 on the 1st, Berlin time
//! time_zone = "Europe/Berlin"
//! [[policies.llm.tiers]]
//! name = "daily-tokens"
//! kind = "calendar"
//! count = 1_000_000
//! period = "day"
//! time_zone = "Europe/Berlin"
//! unit = "reported"
//! ```
//!
//! is the policy
//!
//! ```
//! # use std::time::Duration;
//! use tollgate::{Calendar, Concurrency, Policy, Quota, Unit};
//!
//! let llm = Policy::builder("llm")
//!     .tier("per-second", Quota::per_second(10).with_burst(20))
//!     .concurrency(
//!         "in-flight",
//!         Concurrency::new(4)
//!             .with_ttl(Duration::from_secs(60))
//!             .with_typical_hold(Duration::from_secs(2)),
//!     )
//!     .tier("upload-bytes", Quota::per_second(1_000_000).counting(Unit::RequestBytes))
//!     .tier("download-bytes", Quota::per_minute(50_000_000).counting(Unit::ResponseBytes))
//!     .calendar("monthly", Calendar::per_month(100_000).in_time_zone("Europe/Berlin"))
//!     .calendar(
//!         "daily-tokens",
//!         Calendar::per_day(1_000_000).in_time_zone("Europe/Berlin").counting(Unit::Reported),
//!     )
//!     .build()?;
//! # Ok::<(), tollgate::ConfigError>(())
//! ```
//!
//! A rate tier of a GCRA policy may reserve part of its capacity for the higher request
//! classes ([`Reserve`](crate::Reserve)): `reserve_critical`, units only critical requests may
//! use, and `reserve_standard`, units more that sheddable requests may not use (each 0 when
//! left out; `reserve_critical = 20, reserve_standard = 30` on a tier of 100 is
//! `.reserve(tier, Reserve::new().critical(20).standard(30))`). The class of each request is
//! the layer's ([`RateLimitLayerBuilder::priority`](crate::RateLimitLayerBuilder::priority)).
//!
//! A rate or calendar tier may carry a penalty box ([`Penalty`](crate::Penalty)): `block`, how
//! long a key that breaches the tier is refused (a duration); `block_after`, the breaches that
//! start a block (default 1), and `block_window`, the window they are counted in (needed when
//! `block_after` is above 1, refused otherwise: the first breach would block regardless).
//!
//! ```toml
//! [policies.login]
//! [[policies.login.tiers]]
//! name = "per-minute"
//! count = 10
//! period = "1m"
//! block = "15m"                 # refused for 15 minutes from the 3rd breach within a minute
//! block_after = 3
//! block_window = "1m"
//! ```
//!
//! is the policy
//!
//! ```
//! # use std::time::Duration;
//! use tollgate::{Penalty, Policy, Quota};
//!
//! let minute = Duration::from_secs(60);
//! let login = Policy::builder("login")
//!     .tier("per-minute", Quota::per_minute(10))
//!     .penalty("per-minute", Penalty::new(15 * minute).after(3, minute))
//!     .build()?;
//! # Ok::<(), tollgate::ConfigError>(())
//! ```
//!
//! # Several rules, one policy
//!
//! Every rule that matches a request applies, in file order, as if their layers were stacked
//! with the first rule outermost: a request refused by a later rule has been charged by the
//! earlier ones (a client over its plan still spends its per-address budget). The response's
//! `RateLimit-Policy` and `RateLimit` headers list the tiers of every rule that applied, first
//! rule first (RFC 9651 lists combine by joining them); the legacy `X-RateLimit-*` headers,
//! draft 6's `RateLimit-Limit` / `-Remaining` / `-Reset` and draft 7's `RateLimit` dictionary
//! (whose keys cannot repeat) are those of the tier with the fewest units left among all the
//! rules' tiers (the first rule's of equals). Each rule contributes the fields of its own
//! `headers` and `header_format`; rules that apply together should share one format: where a
//! draft 7 rule applies beside current-draft rules, `RateLimit` is the current draft's list
//! (the draft 7 rule's policy is still listed in `RateLimit-Policy`).
//!
//! Each policy has one [`Limiter`](crate::Limiter): rules that apply the same policy share its
//! budget (for the same key). Define two policies for two budgets. A policy that no rule
//! applies is still bound, for code: [`ReloadHandle::limiter`].
//!
//! # Errors
//!
//! A file that cannot be read, is not TOML, has a field this schema does not know, or has a
//! value the policy and layer builders refuse is refused whole, with a [`ConfigFileError`]
//! naming the file, line, column and field: `tollgate.toml:14:9:
//! policies.free.tiers[0].period: invalid duration "1 fortnight": ...`, `tollgate.toml:7:13:
//! policies.saas.tiers[0].time_zone: tier `monthly`: unknown time zone "Europe/Atlantis": ...`,
//! `tollgate.toml:6:9: policies.saas.tiers[1].burst: a concurrency tier has no `burst` (rate
//! tiers have it); it takes max, lease, typical_hold`. A value the builders refuse keeps their
//! [`ConfigError`](crate::ConfigError) as its [`source`](std::error::Error::source).
//!
//! # Reloading
//!
//! [`ReloadHandle::reload`] builds the new configuration beside the running one and swaps it
//! in atomically: a request uses the configuration that was current when it arrived from start
//! to end, and none waits or fails because of a reload. What happens to the state:
//!
//! - a policy whose definition did not change (same name, algorithm and tiers, quotas
//!   included) keeps its limiter, and every key keeps its count;
//! - a changed policy is bound anew, and each key keeps its state in the tiers that did not
//!   change (same name and definition, same algorithm), on a `MemoryStore`; a changed tier
//!   starts full, or, with `changed_tiers = "carry_used_fraction"`, with the share of it each
//!   key had used (30 of 100 becomes 60 of 200; [`Carry::UsedFraction`](crate::store::Carry));
//!   concurrency tiers start with no slot held. Requests still in progress under the old
//!   configuration charge the unchanged tiers where the new one counts them, so no charge is
//!   lost to a reload: an unchanged tier admits exactly its quota however often the file
//!   changes. On Redis a changed policy starts full in every tier (its keys are named by the
//!   policy's fingerprint). See [`Store::rebind`](crate::store::Store::rebind);
//! - a removed policy's state stays in the store until it is idle (on a `MemoryStore`; on
//!   Redis until its keys expire): a policy that comes back unchanged finds it again, as any
//!   binding of the same policy to the same store does
//!   ([one policy, one budget](crate::store#one-policy-on-one-store-is-one-budget)).
//!
//! A refused file changes nothing: the running configuration stays.

mod build;
mod error;
mod key;
mod layer;
mod schema;
mod service;
mod state;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use error::ConfigFileError;
pub use layer::{LimitsLayer, ReloadHandle, Reloaded};
pub use service::{Limits, LimitsBody, LimitsFuture};

use build::{PolicyDef, RuleDef};
use error::{Source, toml_key};
use schema::RawFile;

use crate::policy::Policy;
use crate::store::MemoryStore;

/// A checked configuration file: policies, and the rules that apply them.
///
/// Everything the policy and layer builders check is checked when the file is read, so a
/// `LimitsConfig` that exists can be served: only a store that refuses a policy (say, a span
/// [`RedisStore`](crate::store) cannot represent) can still refuse it, in
/// [`LimitsLayer::with_store`] or [`ReloadHandle::reload`].
///
/// ```
/// use std::time::Duration;
/// use tollgate::config::LimitsConfig;
///
/// let config = LimitsConfig::from_toml(
///     r#"
///     [policies.api]
///     tiers = [{ name = "api", count = 100, period = "1m" }]
///
///     [[rules]]
///     name = "api"
///     paths = ["/api/*"]
///     policy = "api"
///     "#,
///     "inline.toml",
/// )
/// .unwrap();
/// let api = config.policy("api").unwrap();
/// assert_eq!(api.tiers()[0].quota().period(), Duration::from_secs(60));
/// assert_eq!(config.rule_names().collect::<Vec<_>>(), ["api"]);
/// ```
#[derive(Clone)]
pub struct LimitsConfig {
    file: String,
    path: Option<PathBuf>,
    text: Arc<str>,
    /// `replace_all = true`: a reload to this file may drop every running policy.
    replace_all: bool,
    policies: Vec<PolicyDef>,
    rules: Vec<RuleDef>,
}

impl fmt::Debug for LimitsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LimitsConfig")
            .field("file", &self.file)
            .field("policies", &self.policies().map(Policy::name).collect::<Vec<_>>())
            .field("rules", &self.rule_names().collect::<Vec<_>>())
            .finish()
    }
}

impl LimitsConfig {
    /// Reads a configuration from TOML text. `file` names it in errors (a path, or
    /// `"inline.toml"`).
    ///
    /// # Errors
    /// [`ConfigFileError`] with the line, column and field of the first problem: a TOML syntax
    /// error, a field the schema does not know, a value of the wrong type or form (a duration,
    /// an algorithm, a key extractor, a CIDR, a header name, a method, a status), a reference
    /// to a policy the file does not define, a duplicate rule name, or a value the builders
    /// refuse (a zero count, period or burst, a cost above a tier's capacity, ...).
    pub fn from_toml(text: &str, file: impl Into<String>) -> Result<Self, ConfigFileError> {
        Self::parse(text.into(), file.into(), None)
    }

    /// Reads the configuration file at `path` (named by it in errors).
    ///
    /// # Errors
    /// [`ConfigFileError`] without a line when the file cannot be read (its
    /// [`source`](std::error::Error::source) is the [`std::io::Error`]), or is not UTF-8 (with
    /// the line of the first bad byte); else as [`from_toml`](Self::from_toml).
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ConfigFileError> {
        let path = path.as_ref();
        let file = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|e| {
            ConfigFileError::unlocated(&file, format!("cannot read: {e}"), Some(Box::new(e)))
        })?;
        Self::from_bytes(bytes, file, Some(path.to_owned()))
    }

    /// Reads a file's bytes.
    fn from_bytes(
        bytes: Vec<u8>,
        file: String,
        path: Option<PathBuf>,
    ) -> Result<Self, ConfigFileError> {
        let text = match String::from_utf8(bytes) {
            Ok(text) => text,
            Err(e) => {
                let at = e.utf8_error().valid_up_to();
                let text = String::from_utf8_lossy(e.as_bytes());
                let src = Source { file: &file, text: &text };
                return Err(src.error(Some(&(at..at)), None, "not UTF-8"));
            }
        };
        Self::parse(text.into(), file, path)
    }

    fn parse(text: Arc<str>, file: String, path: Option<PathBuf>) -> Result<Self, ConfigFileError> {
        let src = Source { file: &file, text: &text };
        let de = toml::Deserializer::parse(&text)
            .map_err(|e| src.error(e.span().as_ref(), None, e.message()))?;
        let raw: RawFile = serde_path_to_error::deserialize(de).map_err(|e| {
            let field = field_path(e.path());
            let e = e.into_inner();
            src.error(e.span().as_ref(), Some(field), e.message())
        })?;
        let replace_all = raw.replace_all;
        let (policies, rules) = build::check(raw, src)?;
        let config = Self { file, path, text, replace_all, policies, rules };
        // What the layer builder refuses is refused now rather than when the configuration is
        // served: build it once over a store that refuses no policy.
        build::assemble(&config, &MemoryStore::new(), None)?;
        Ok(config)
    }

    /// The file's name in errors: the path it was [loaded](Self::load) from, or the name given
    /// to [`from_toml`](Self::from_toml).
    #[must_use]
    pub fn file(&self) -> &str {
        &self.file
    }

    /// The path it was [loaded](Self::load) from; `None` when it was read
    /// [from text](Self::from_toml).
    #[must_use]
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The TOML text it was read from.
    #[must_use]
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Whether the file says `replace_all = true`: then a [reload](ReloadHandle::reload) to it
    /// may drop every running policy, or leave none. Without it such a reload is refused, since
    /// a file caught mid-rewrite (truncated by an editor, `cp` or a shell redirection) reads as
    /// an empty, valid TOML document.
    #[must_use]
    pub fn replaces_all(&self) -> bool {
        self.replace_all
    }

    /// The policies, in the order the file defines them.
    pub fn policies(&self) -> impl ExactSizeIterator<Item = &Policy> {
        self.policies.iter().map(|p| &p.policy)
    }

    /// The policy named `name`.
    #[must_use]
    pub fn policy(&self, name: &str) -> Option<&Policy> {
        self.policies().find(|p| p.name() == name)
    }

    /// The rules' names, in file order (the order in which they apply).
    pub fn rule_names(&self) -> impl ExactSizeIterator<Item = &str> {
        self.rules.iter().map(|r| r.name.as_str())
    }

    fn source(&self) -> Source<'_> {
        Source { file: &self.file, text: &self.text }
    }
}

/// A field's path as `serde_path_to_error` tracked it, without the segments of
/// `toml::Spanned`'s private fields: `policies.free.tiers[0].period`.
fn field_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for segment in path.iter() {
        let name = match segment {
            Segment::Seq { index } => {
                out.push_str(&format!("[{index}]"));
                continue;
            }
            Segment::Map { key } if key.starts_with("$__serde_spanned_private") => continue,
            Segment::Map { key } => toml_key(key),
            Segment::Enum { variant } => toml_key(variant),
            Segment::Unknown => "?".to_owned(),
        };
        if !out.is_empty() {
            out.push('.');
        }
        out.push_str(&name);
    }
    out
}
