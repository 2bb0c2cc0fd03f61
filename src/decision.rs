//! Decisions: what a store answers for one request. Owned values, no borrows, so they cross
//! `.await` points and threads freely.

use std::sync::Arc;
use std::time::Duration;

use crate::quota::Quota;

/// What happened to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// Admitted now (or, when shaping, after [`Decision::delay`]); every tier was charged.
    Allowed,
    /// Rejected: some tier has no room for it now (and, when shaping, not within the wait
    /// budget). No tier was charged. [`Decision::retry_after`] says when it would fit.
    Limited,
    /// Rejected: the request's cost exceeds some tier's capacity, so it can never be admitted.
    /// There is no meaningful retry time.
    CostExceedsCapacity,
}

/// Which part of the system made the decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Source {
    /// The configured store.
    #[default]
    Store,
    /// The local in-memory fallback of a remote store that is failing (SPEC §8).
    Fallback,
}

/// One tier's part of a decision, as reported in the `RateLimit` headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierDecision {
    pub(crate) name: Arc<str>,
    pub(crate) quota: Quota,
    pub(crate) limit: u64,
    pub(crate) remaining: u64,
    pub(crate) reset_after: Duration,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) violated: bool,
}

impl TierDecision {
    /// The tier's name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tier's quota.
    #[must_use]
    pub fn quota(&self) -> Quota {
        self.quota
    }

    /// The tier's capacity in units (`burst` for GCRA and the buckets, `count` for windows).
    #[must_use]
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Units that could be consumed right now after this decision (0 when exhausted).
    #[must_use]
    pub fn remaining(&self) -> u64 {
        self.remaining
    }

    /// Time until this tier's state is back to full capacity (nanosecond precision).
    #[must_use]
    pub fn reset_after(&self) -> Duration {
        self.reset_after
    }

    /// For a tier that rejected the request: time until it alone would admit it.
    /// `None` for a tier that had room, and for a tier whose capacity is below the cost.
    #[must_use]
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// Whether this tier rejected the request (no room, or capacity below the cost).
    #[must_use]
    pub fn is_violated(&self) -> bool {
        self.violated
    }
}

/// A store's answer for one request: the outcome, the shaping delay, when to retry, and one
/// [`TierDecision`] per tier (SPEC §1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub(crate) outcome: Outcome,
    pub(crate) delay: Duration,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) tiers: Vec<TierDecision>,
    pub(crate) source: Source,
}

impl Decision {
    /// The outcome.
    #[must_use]
    pub fn outcome(&self) -> Outcome {
        self.outcome
    }

    /// Whether the request was admitted.
    #[must_use]
    pub fn is_allowed(&self) -> bool {
        self.outcome == Outcome::Allowed
    }

    /// When shaping: how long to hold the request before passing it on (its reserved slot).
    /// Zero when policing.
    #[must_use]
    pub fn delay(&self) -> Duration {
        self.delay
    }

    /// For [`Outcome::Limited`]: the earliest time from now at which the same request would be
    /// admitted by every tier (exact to the nanosecond; a retry a nanosecond earlier is still
    /// rejected). `None` when allowed and for [`Outcome::CostExceedsCapacity`].
    #[must_use]
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// Per-tier details, in the policy's tier order.
    #[must_use]
    pub fn tiers(&self) -> &[TierDecision] {
        &self.tiers
    }

    /// Who decided.
    #[must_use]
    pub fn source(&self) -> Source {
        self.source
    }

    /// Names of the tiers that rejected the request (empty when allowed).
    pub fn violated(&self) -> impl Iterator<Item = &str> {
        self.tiers.iter().filter(|t| t.violated).map(TierDecision::name)
    }
}
