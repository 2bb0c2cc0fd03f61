//! Tiers as the algorithms run them: what [`Policy`](crate::Policy) compiles a tier's
//! [`Quota`](crate::Quota), [`Concurrency`], [`Calendar`](crate::Calendar) and [`Penalty`]
//! into, in the policy's time unit.

use std::sync::Arc;

use super::calendar::CalendarSpec;
use crate::quota::{Concurrency, Penalty};

/// A validated [`Penalty`], in the policy's time unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Block {
    pub(crate) spec: Penalty,
    /// The block, in units (>= 1).
    pub(crate) block: u64,
    /// Breaches that block (>= 1).
    pub(crate) refusals: u64,
    /// The window breaches are counted in, in units (0 when `refusals` is 1).
    pub(crate) within: u64,
}

/// A tier's kind, with what deciding it needs.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    /// A rate, run by the policy's algorithm over `Tier::rate`.
    Rate,
    /// Requests in flight.
    Concurrency(Slots),
    /// Calendar windows.
    Calendar(Arc<CalendarSpec>),
}

/// A concurrency tier, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Slots {
    pub(crate) spec: Concurrency,
    /// Slots per key.
    pub(crate) max: u64,
    /// A slot's time to live on shared stores, whole milliseconds.
    pub(crate) ttl_ms: u64,
    /// The typical hold before any was observed, nanoseconds (at least 1 ms).
    pub(crate) initial_hold: u64,
}

/// A quota in the algorithms' units: counts, and time in the policy's unit (nanoseconds, or
/// microseconds for a policy with a long span; see [`Policy::unit`](crate::Policy::unit)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Rate {
    /// Units per period.
    pub(crate) count: u64,
    /// Period in time units (>= 1).
    pub(crate) period: u64,
    /// Capacity in units.
    pub(crate) burst: u64,
}
