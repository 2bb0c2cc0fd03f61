//! What the layer reports of each decision: metrics, the decision hook, and log events whose
//! keys are redacted unless asked otherwise.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::decision::Decision;
use crate::key::{Key, RequestHead};
use crate::metrics::{Counted, Failed, PolicyMetrics};
use crate::policy::Policy;

/// What happened to a request, as the layer reports it to the
/// [decision hook](super::RateLimitLayerBuilder::on_decision) and to metrics.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use bytes::Bytes;
/// use http::{Request, Response};
/// use http_body_util::Full;
/// use tollgate::layer::Observed;
/// use tollgate::{Policy, Quota, RateLimitLayer, key::GlobalKey};
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let seen = Arc::new(Mutex::new(Vec::new()));
/// let log = Arc::clone(&seen);
/// let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_minute(1)).unwrap())
///     .key(GlobalKey)
///     .on_decision(move |event| log.lock().unwrap().push(event.outcome))
///     .build()
///     .unwrap();
/// let svc = layer.layer(service_fn(|_req| async {
///     Ok::<_, std::convert::Infallible>(Response::new(Full::<Bytes>::default()))
/// }));
/// for _ in 0..2 {
///     svc.clone().oneshot(Request::new(Full::<Bytes>::default())).await.unwrap();
/// }
/// assert_eq!(*seen.lock().unwrap(), [Observed::Admitted, Observed::Limited]);
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Observed {
    /// Admitted at once.
    Admitted,
    /// Admitted after being held this long (shaping).
    Shaped(Duration),
    /// Refused.
    Limited,
    /// Would have been refused, and was let through: the layer runs in dry run.
    DryRunLimited,
    /// The store could not decide; the request was let through (fail open).
    FailedOpen,
    /// The store could not decide; the request was refused (fail closed).
    FailedClosed,
}

/// One decision the layer made, as the [decision hook](super::RateLimitLayerBuilder::on_decision)
/// sees it. It borrows from the request, so the hook copies what it keeps.
///
/// ```
/// use tollgate::key::Redacted;
/// use tollgate::layer::{DecisionEvent, Observed};
/// use tollgate::{Policy, Quota, RateLimitLayer};
///
/// // An audit line for each refusal: the route, the redacted key, the tiers that refused.
/// let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_second(5)).unwrap())
///     .on_decision(|event: &DecisionEvent<'_>| {
///         if let (Observed::Limited, Some(decision)) = (event.outcome, event.decision) {
///             let tiers: Vec<&str> = decision.violated_names(event.policy).collect();
///             eprintln!("{} {} limited by {tiers:?}", event.head.uri, Redacted(event.key));
///         }
///     })
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct DecisionEvent<'a> {
    /// The policy that decided.
    pub policy: &'a Policy,
    /// The key decided for (raw: the hook is code, not a log; redact it yourself before logging
    /// it, e.g. with [`key::Redacted`](crate::key::Redacted)).
    pub key: &'a Key,
    /// The request's head.
    pub head: &'a RequestHead<'a>,
    /// The store's decision; `None` when the store could not decide.
    pub decision: Option<&'a Decision>,
    /// What the layer did.
    pub outcome: Observed,
}

/// How keys appear in the layer's log events.
///
/// ```
/// use tollgate::layer::LogKeys;
/// use tollgate::{Policy, Quota, RateLimitLayer};
///
/// assert_eq!(LogKeys::default(), LogKeys::Redacted);
/// // Keys as they are in the log, while debugging:
/// let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_second(10)).unwrap())
///     .log_keys(LogKeys::Raw)
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "config", derive(serde::Deserialize), serde(rename_all = "snake_case"))]
#[non_exhaustive]
pub enum LogKeys {
    /// A keyed hash of the key, stable within the process ([`key::Redacted`](crate::key::Redacted)):
    /// API keys and user ids do not end up in log files (default).
    #[default]
    Redacted,
    /// The key itself, for debugging.
    Raw,
}

pub(super) type HookFn = Arc<dyn for<'a> Fn(&DecisionEvent<'a>) + Send + Sync>;

/// The layer's observers: per policy its metric handles, the hook, the key format.
pub(super) struct Observer {
    metrics: Box<[PolicyMetrics]>,
    hook: Option<HookFn>,
    pub(super) keys: LogKeys,
}

impl Observer {
    pub(super) fn new<'a>(
        policies: impl Iterator<Item = &'a Policy>,
        hook: Option<HookFn>,
        keys: LogKeys,
    ) -> Self {
        Self { metrics: policies.map(PolicyMetrics::new).collect(), hook, keys }
    }

    /// Whether a decision must be reported (metrics are always on with the `metrics` feature;
    /// handles without a recorder cost nothing).
    #[inline]
    pub(super) fn active(&self) -> bool {
        cfg!(feature = "metrics") || self.hook.is_some()
    }

    /// Reports a decision made at once by the policy at `index`, `outcome` being
    /// [`Observed::Admitted`] or [`Observed::Limited`]: with no hook, only its counters are
    /// touched (each a pointer test when no recorder is installed).
    // Always: out of line, the call and its arguments cost more than the counters.
    #[inline(always)]
    pub(super) fn at_once(
        &self,
        index: usize,
        (policy, key, head): (&Policy, &Key, &RequestHead<'_>),
        decision: &Decision,
        outcome: Observed,
    ) {
        if self.hook.is_some() {
            self.decided(index, policy, key, head, Some(decision), outcome);
        } else if let Some(metrics) = self.metrics.get(index) {
            let counted =
                if outcome == Observed::Limited { Counted::Limited } else { Counted::Admitted };
            metrics.decided(counted, decision);
        }
    }

    /// Reports a decision of the policy at `index`.
    #[inline(never)]
    pub(super) fn decided(
        &self,
        index: usize,
        policy: &Policy,
        key: &Key,
        head: &RequestHead<'_>,
        decision: Option<&Decision>,
        outcome: Observed,
    ) {
        if let Some(metrics) = self.metrics.get(index) {
            match (outcome, decision) {
                (Observed::Admitted, Some(d)) => metrics.decided(Counted::Admitted, d),
                (Observed::Shaped(_), Some(d)) => metrics.decided(Counted::Shaped, d),
                (Observed::Limited, Some(d)) => metrics.decided(Counted::Limited, d),
                (Observed::DryRunLimited, Some(d)) => metrics.decided(Counted::DryRunLimited, d),
                (Observed::FailedOpen, _) => metrics.failed(Failed::Open),
                (Observed::FailedClosed, _) => metrics.failed(Failed::Closed),
                _ => {}
            }
        }
        if outcome == Observed::DryRunLimited {
            tracing::info!(
                policy = policy.name(),
                key = %self.show(key),
                violated = %Violated(policy, decision),
                "tollgate: dry run: would have limited"
            );
        }
        if let Some(hook) = &self.hook {
            hook(&DecisionEvent { policy, key, head, decision, outcome });
        }
    }

    /// `key` as log events show it.
    pub(super) fn show<'a>(&self, key: &'a Key) -> Shown<'a> {
        Shown { key, raw: self.keys == LogKeys::Raw }
    }
}

/// A key for a log event: redacted or raw.
pub(super) struct Shown<'a> {
    key: &'a Key,
    raw: bool,
}

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.raw { self.key.fmt(f) } else { crate::key::Redacted(self.key).fmt(f) }
    }
}

/// The names of the tiers a decision violated, comma-separated.
struct Violated<'a>(&'a Policy, Option<&'a Decision>);

impl fmt::Display for Violated<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(decision) = self.1 else { return Ok(()) };
        for (i, name) in decision.violated_names(self.0).enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            f.write_str(name)?;
        }
        Ok(())
    }
}

/// Whether the store is failing, so that a failure is logged once when it starts (a `warn`),
/// and once when it ends (an `info`), not on every request.
#[derive(Default)]
pub(super) struct Failing(std::sync::atomic::AtomicBool);

impl Failing {
    pub(super) fn failed(&self, policy: &str, error: &crate::StoreError, what: &'static str) {
        use std::sync::atomic::Ordering;
        if self.0.swap(true, Ordering::Relaxed) {
            tracing::debug!(%error, policy, "tollgate: store failed; {what}");
        } else {
            tracing::warn!(%error, policy, "tollgate: store failed; {what} until it answers");
        }
    }

    #[inline]
    pub(super) fn recovered(&self, policy: &str) {
        use std::sync::atomic::Ordering;
        if self.0.load(Ordering::Relaxed) && self.0.swap(false, Ordering::Relaxed) {
            tracing::info!(policy, "tollgate: store answers again");
        }
    }
}

/// Whether a request without a key was refused yet: the first is logged as a `warn` with the
/// extractor's explanation (a setup mistake shows at once), later ones at `debug`.
#[derive(Default)]
pub(super) struct MissingKeys(std::sync::atomic::AtomicBool);

impl MissingKeys {
    pub(super) fn refused(&self, policy: &str, why: &crate::key::KeyMissing) {
        use std::sync::atomic::Ordering;
        if self.0.load(Ordering::Relaxed) || self.0.swap(true, Ordering::Relaxed) {
            tracing::debug!(policy, %why, "tollgate: refused a request without a key");
        } else {
            tracing::warn!(
                policy,
                %why,
                "tollgate: refused a request without a key (logged once; later ones at debug)"
            );
        }
    }
}

/// Whether a WebSocket upgrade was refused yet because its handler did not take the
/// [`MessageBudget`](crate::ws::MessageBudget) that meters its socket (the first is logged as
/// an error, later ones at debug; each is counted).
#[cfg(feature = "ws")]
#[derive(Debug, Default)]
pub(super) struct Unmetered(std::sync::atomic::AtomicBool);

#[cfg(feature = "ws")]
impl Unmetered {
    /// An upgrade answered `101` without its budget taken: refused (or, in a dry run, let
    /// through unmetered).
    pub(super) fn seen(&self, policy: &str, dry_run: bool) {
        use std::sync::atomic::Ordering;
        crate::metrics::config_warning(policy, "message_budget");
        let what = if dry_run { "dry run: would have refused" } else { "refused" };
        if self.0.swap(true, Ordering::Relaxed) {
            tracing::debug!(
                policy,
                "tollgate: {what} a WebSocket upgrade its handler does not meter"
            );
        } else {
            tracing::error!(
                policy,
                "tollgate: {what} a WebSocket upgrade: the policy counts messages, but the \
                 handler did not take a MessageBudget to meter its socket (add a `budget: \
                 MessageBudget` argument and `budget.wrap(socket)`); logged once, later ones \
                 at debug"
            );
        }
    }
}
