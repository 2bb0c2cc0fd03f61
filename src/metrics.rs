//! Metrics through the [`metrics`](https://docs.rs/metrics) facade (cargo feature `metrics`):
//! install a recorder (for example `metrics-exporter-prometheus`) **before** building layers
//! and stores, whose handles are registered when they are built. Labels are policy and tier
//! names and Redis server addresses, never keys, so the number of series stays bounded.
//!
//! | metric | kind | labels | what |
//! |---|---|---|---|
//! | `tollgate_decisions_total` | counter | `policy`, `tier`, `outcome` | per request and tier: `admitted`, `limited` (this tier refused it), `shaped` (admitted after a wait), `dry_run_limited` (would have been refused) |
//! | `tollgate_store_failures_total` | counter | `policy`, `outcome` | requests the store could not decide: `fail_open`, `fail_closed`, `fallback` (decided locally) |
//! | `tollgate_shaping_delay_seconds` | histogram | `policy` | how long shaped requests were held |
//! | `tollgate_store_call_seconds` | histogram | `node` | Redis script calls, each deciding a batch |
//! | `tollgate_breaker_state` | gauge | `node` | a Redis server's circuit breaker: 0 closed, 1 half-open, 2 open |
//! | `tollgate_memory_keys` | gauge | | keys a `MemoryStore` holds (updated by its sweeper) |
//! | `tollgate_lease_grants_total` | counter | `policy` | blocks Redis granted to this instance (`RedisStore` lease mode) |
//! | `tollgate_lease_block_units` | histogram | `policy` | units in each block granted |
//! | `tollgate_lease_returned_units_total` | counter | `policy` | unspent units of blocks given back to Redis |
//! | `tollgate_config_warnings_total` | counter | `policy`, `setting` | settings that cannot work as set, each logged once: a `lease_policy` no bound policy uses, an option its combination ignores, a WebSocket upgrade whose handler did not meter its socket (`setting="message_budget"`) |
//! | `tollgate_lease_checks_total` | counter | `policy`, `decided` | leasing checks: `local` (from a block, no call), `redis` (a call: a block granted, or refused) or `held` (refused with no call while the instance waits for a GCRA or bucket key to refill a useful block) |
//!
//! ```
//! use metrics_exporter_prometheus::PrometheusBuilder;
//! use tollgate::{Policy, Quota, RateLimitLayer};
//!
//! # #[cfg(feature = "metrics")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let recorder = PrometheusBuilder::new().build_recorder();
//! let prometheus = recorder.handle(); // serve `prometheus.render()` on /metrics
//! metrics::set_global_recorder(recorder)?; // first, then build the layers
//! let layer = RateLimitLayer::builder(Policy::single("api", Quota::per_second(5))?).build()?;
//! assert!(prometheus.render().contains(
//!     r#"tollgate_decisions_total{policy="api",tier="api",outcome="limited"} 0"#
//! ));
//! # let _ = layer;
//! # Ok(()) }
//! # #[cfg(not(feature = "metrics"))]
//! # fn main() {}
//! ```

/// Names of the metrics.
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub(crate) mod names {
    pub(crate) const DECISIONS: &str = "tollgate_decisions_total";
    pub(crate) const STORE_FAILURES: &str = "tollgate_store_failures_total";
    pub(crate) const SHAPING_DELAY: &str = "tollgate_shaping_delay_seconds";
    pub(crate) const STORE_CALL: &str = "tollgate_store_call_seconds";
    pub(crate) const BREAKER_STATE: &str = "tollgate_breaker_state";
    pub(crate) const MEMORY_KEYS: &str = "tollgate_memory_keys";
    pub(crate) const LEASE_GRANTS: &str = "tollgate_lease_grants_total";
    pub(crate) const LEASE_BLOCK: &str = "tollgate_lease_block_units";
    pub(crate) const LEASE_RETURNED: &str = "tollgate_lease_returned_units_total";
    pub(crate) const LEASE_CHECKS: &str = "tollgate_lease_checks_total";
    pub(crate) const CONFIG_WARNINGS: &str = "tollgate_config_warnings_total";
}

/// Counts a setting of `policy` that cannot work as set (see `tollgate_config_warnings_total`).
#[inline]
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn config_warning(policy: &str, setting: &'static str) {
    #[cfg(feature = "metrics")]
    metrics::counter!(names::CONFIG_WARNINGS, "policy" => policy.to_owned(), "setting" => setting)
        .increment(1);
}

/// A leasing binding's metrics (`RedisStore` lease mode).
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) struct LeaseMetrics {
    #[cfg(feature = "metrics")]
    grants: metrics::Counter,
    #[cfg(feature = "metrics")]
    block: metrics::Histogram,
    #[cfg(feature = "metrics")]
    returned: metrics::Counter,
    /// Local, Redis, held.
    #[cfg(feature = "metrics")]
    checks: [metrics::Counter; 3],
}

#[cfg_attr(not(feature = "redis"), allow(dead_code))]
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
impl LeaseMetrics {
    pub(crate) fn new(policy: &str) -> Self {
        #[cfg(feature = "metrics")]
        {
            let p = || policy.to_owned();
            Self {
                grants: metrics::counter!(names::LEASE_GRANTS, "policy" => p()),
                block: metrics::histogram!(names::LEASE_BLOCK, "policy" => p()),
                returned: metrics::counter!(names::LEASE_RETURNED, "policy" => p()),
                checks: [
                    metrics::counter!(names::LEASE_CHECKS, "policy" => p(), "decided" => "local"),
                    metrics::counter!(names::LEASE_CHECKS, "policy" => p(), "decided" => "redis"),
                    metrics::counter!(names::LEASE_CHECKS, "policy" => p(), "decided" => "held"),
                ],
            }
        }
        #[cfg(not(feature = "metrics"))]
        Self {}
    }

    /// A block of `units` was granted.
    #[inline]
    pub(crate) fn granted(&self, units: u64) {
        #[cfg(feature = "metrics")]
        {
            self.grants.increment(1);
            #[allow(clippy::cast_precision_loss)] // a block is far below 2^53
            self.block.record(units as f64);
        }
    }

    /// `units` were given back.
    #[inline]
    pub(crate) fn returned(&self, units: u64) {
        #[cfg(feature = "metrics")]
        self.returned.increment(units);
    }

    /// A check was decided from a block.
    #[inline]
    pub(crate) fn local(&self) {
        #[cfg(feature = "metrics")]
        self.checks[0].increment(1);
    }

    /// A leasing check called Redis.
    #[inline]
    pub(crate) fn remote(&self) {
        #[cfg(feature = "metrics")]
        self.checks[1].increment(1);
    }

    /// A leasing check was refused here while the instance waited for a useful block.
    #[inline]
    pub(crate) fn held(&self) {
        #[cfg(feature = "metrics")]
        self.checks[2].increment(1);
    }
}

/// A Redis node's metrics.
#[derive(Clone)]
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) struct NodeMetrics {
    #[cfg(feature = "metrics")]
    call: metrics::Histogram,
    #[cfg(feature = "metrics")]
    breaker: metrics::Gauge,
}

#[cfg_attr(not(feature = "redis"), allow(dead_code))]
impl NodeMetrics {
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn new(node: &str) -> Self {
        Self {
            #[cfg(feature = "metrics")]
            call: metrics::histogram!(names::STORE_CALL, "node" => node.to_owned()),
            #[cfg(feature = "metrics")]
            breaker: metrics::gauge!(names::BREAKER_STATE, "node" => node.to_owned()),
        }
    }

    /// A script call took `took`.
    #[inline]
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn call(&self, took: std::time::Duration) {
        #[cfg(feature = "metrics")]
        self.call.record(took.as_secs_f64());
    }

    /// The breaker is now 0 closed, 1 half-open or 2 open.
    #[inline]
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn breaker(&self, state: u8) {
        #[cfg(feature = "metrics")]
        self.breaker.set(f64::from(state));
    }
}

/// A memory store's key count.
#[inline]
#[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
pub(crate) fn memory_keys(keys: usize) {
    #[cfg(feature = "metrics")]
    #[allow(clippy::cast_precision_loss)] // a key count is far below 2^53
    metrics::gauge!(names::MEMORY_KEYS).set(keys as f64);
}

/// A policy's decision metrics, registered when its layer is built.
pub(crate) struct PolicyMetrics {
    /// Per tier: admitted, limited, shaped, dry-run limited.
    #[cfg(feature = "metrics")]
    tiers: Box<[[metrics::Counter; 4]]>,
    /// Fail open, fail closed, fallback.
    #[cfg(feature = "metrics")]
    failures: [metrics::Counter; 3],
    #[cfg(feature = "metrics")]
    delay: metrics::Histogram,
}

/// What a decision counted as, for [`PolicyMetrics`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counted {
    Admitted,
    Limited,
    Shaped,
    DryRunLimited,
}

/// A request the store could not decide, for [`PolicyMetrics`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
pub(crate) enum Failed {
    Open,
    Closed,
    Fallback,
}

impl PolicyMetrics {
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn new(policy: &crate::Policy) -> Self {
        #[cfg(feature = "metrics")]
        {
            let name = policy.name().to_owned();
            let counter = |tier: &str, outcome: &'static str| metrics::counter!(names::DECISIONS, "policy" => name.clone(), "tier" => tier.to_owned(), "outcome" => outcome);
            let tiers = policy
                .tiers()
                .iter()
                .map(|t| {
                    [
                        counter(t.name(), "admitted"),
                        counter(t.name(), "limited"),
                        counter(t.name(), "shaped"),
                        counter(t.name(), "dry_run_limited"),
                    ]
                })
                .collect();
            let failure = |outcome: &'static str| metrics::counter!(names::STORE_FAILURES, "policy" => name.clone(), "outcome" => outcome);
            Self {
                tiers,
                failures: [failure("fail_open"), failure("fail_closed"), failure("fallback")],
                delay: metrics::histogram!(names::SHAPING_DELAY, "policy" => name.clone()),
            }
        }
        #[cfg(not(feature = "metrics"))]
        Self {}
    }

    /// Counts `decision`: every tier for an admission, the violated tiers for a refusal.
    // Always: where the layer decides, each counter is a pointer test without a recorder;
    // out of line (as the compiler once chose) the call cost more than the counting.
    #[inline(always)]
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn decided(&self, counted: Counted, decision: &crate::Decision) {
        #[cfg(feature = "metrics")]
        {
            let column = counted as usize;
            for (tier, counters) in decision.tiers().iter().zip(self.tiers.iter()) {
                let counts = match counted {
                    Counted::Admitted | Counted::Shaped => true,
                    Counted::Limited | Counted::DryRunLimited => tier.is_violated(),
                };
                if counts {
                    counters[column].increment(1);
                }
            }
            if counted == Counted::Shaped {
                self.delay.record(decision.delay().as_secs_f64());
            }
            if decision.source() == crate::Source::Fallback {
                self.failures[Failed::Fallback as usize].increment(1);
            }
        }
    }

    /// Counts a request the store could not decide.
    #[inline]
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn failed(&self, failed: Failed) {
        #[cfg(feature = "metrics")]
        self.failures[failed as usize].increment(1);
    }
}
