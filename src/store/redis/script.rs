//! The scripts (`lua/`) and what a call sends and receives: one script per algorithm family,
//! each a shared prelude, the family's arithmetic and the one driver (`lua/kinds.lua`, which
//! decides plain policies as its all-rate, same-cost case) assembled at compile time; but the
//! GCRA fast path, `lua/gcra.lua`, chosen when a plain policy is bound, which is whole: it runs
//! on every lease call and most checks, and leaves out the prelude's helpers, which a call
//! would create every time. Every check of a batch is packed as little-endian doubles; the
//! reply is turned back into decisions.

#[cfg(test)]
mod differential;
mod keys;
mod record;
mod reply;
#[cfg(test)]
mod tests;

use std::borrow::Cow;
use std::fmt;
use std::hash::Hasher as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::Script;
use siphasher::sip128::{Hasher128 as _, SipHasher24};

use crate::algorithm::calendar::CalendarSpec;
use crate::algorithm::calendar::{self, LOOKAHEAD};
use crate::algorithm::compiled::Kind;
use crate::algorithm::{Charge, Charges};
use crate::clock::duration_to_nanos;
use crate::decision::{Decision, Outcome, TierDecision, Tiers};
use crate::error::{ConfigError, StoreError};
use crate::key::Key;
use crate::policy::Policy;
use crate::quota::{Algorithm, Priority};

use keys::escape;
pub(crate) use keys::{
    DEFAULT_KEY_SECRET, KeyNames, derive_secret, hash_tag, key_parts, state_key,
};
pub(crate) use record::{Now, PolicyArgs, Prepared, batch, header};
pub(crate) use reply::{HEAD, PER_TIER, decided_at, decode, decode_costs, numbers};

/// What is left of a lease-mode block, to be given back in the script call that takes the
/// next one: the units granted, the units spent, the charges.
pub(crate) struct Rest {
    pub(crate) granted: u64,
    pub(crate) spent: u64,
    pub(crate) charges: Charges,
}

/// The longest span (period, burst x period / count, shaping budget) a script represents, in
/// the policy's unit: 2^50. Scripts compute in Lua's doubles, exact below 2^53, relative to now.
/// Policies keep to it by construction (see `Policy::precision`); shaping budgets are clamped.
const MAX_SPAN_UNITS: u64 = 1 << 50;

/// The shortest window period on Redis: windows are indexed by `unix time / period`, which must
/// stay below 2^53.
const MIN_WINDOW_PERIOD_NANOS: u64 = 1_000_000;

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// How far (seconds) the Redis server's clock may be from this process's for calendar tiers:
/// each check sends the bounds of the calendar windows from `now - 60 s` to the window holding
/// `now + 60 s` (and, when it shapes, the lookahead after it), and the script decides in the
/// window its own clock falls in.
const CALENDAR_MARGIN_SECS: u64 = 60;

/// The scripts' families: a batch holds checks of one family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Family {
    /// Plain policies of GCRA with whole-unit emission intervals: `lua/gcra.lua`
    /// (self-contained, no prelude).
    Gcra,
    /// Every other policy whose rates are GCRA or the buckets: `lua/rate.lua` and
    /// `lua/kinds.lua`.
    Rate,
    /// ... whose rates are fixed windows or sliding window counters: `lua/window.lua` and
    /// `lua/kinds.lua`.
    Window,
    /// ... whose rates are sliding logs: `lua/log.lua` and `lua/kinds.lua`.
    Log,
}

/// The source of [`Family::Gcra`]'s script.
const GCRA_SOURCE: &str = include_str!("lua/gcra.lua");

static GCRA: LazyLock<Script> = LazyLock::new(|| Script::new(GCRA_SOURCE));

/// A family's script: the prelude, the family's arithmetic (`$family`) and the driver.
macro_rules! kinds_source {
    ($family:literal) => {
        concat!(
            include_str!("lua/prelude.lua"),
            include_str!($family),
            include_str!("lua/line.lua"),
            include_str!("lua/boxes.lua"),
            include_str!("lua/cover.lua"),
            include_str!("lua/kinds.lua"),
            include_str!("lua/kinds_flat.lua"),
            include_str!("lua/kinds_general.lua")
        )
    };
}

/// The source of [`Family::Rate`]'s script.
const KINDS_RATE_SOURCE: &str = kinds_source!("lua/rate.lua");

static KINDS_RATE: LazyLock<Script> = LazyLock::new(|| Script::new(KINDS_RATE_SOURCE));
static KINDS_WINDOW: LazyLock<Script> =
    LazyLock::new(|| Script::new(kinds_source!("lua/window.lua")));
static KINDS_LOG: LazyLock<Script> = LazyLock::new(|| Script::new(kinds_source!("lua/log.lua")));

impl Family {
    pub(crate) const ALL: [Self; 4] = [Self::Gcra, Self::Rate, Self::Window, Self::Log];

    pub(crate) fn script(self) -> &'static Script {
        match self {
            Self::Gcra => &GCRA,
            Self::Rate => &KINDS_RATE,
            Self::Window => &KINDS_WINDOW,
            Self::Log => &KINDS_LOG,
        }
    }
}

/// Checks that the scripts can represent every tier of `policy` exactly.
pub(crate) fn validate(policy: &Policy) -> Result<(), ConfigError> {
    let window = matches!(
        policy.algorithm(),
        Algorithm::FixedWindow | Algorithm::SlidingCounter | Algorithm::SlidingLog
    );
    for tier in policy.tiers().iter().filter(|t| t.kind == Kind::Rate) {
        let period_nanos = u128::from(tier.rate.period) * u128::from(policy.unit());
        if window && period_nanos < u128::from(MIN_WINDOW_PERIOD_NANOS) {
            return Err(ConfigError::UnsupportedByStore {
                store: "RedisStore",
                tier: tier.name().to_owned(),
                reason: "window algorithms need a period of at least 1 ms on Redis".to_owned(),
            });
        }
    }
    Ok(())
}

/// FNV-1a over the algorithm's name, the unit and every rate and calendar tier's count, period
/// and burst: what a stored state means. Concurrency tiers and penalty boxes store nothing in
/// the state key (their slots and boxes live in keys named by their tiers, see
/// [`Prepared::keys`]): a policy that changes only them keeps its keys' state.
fn meaning(policy: &Policy) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    feed(policy.algorithm().name().as_bytes());
    feed(&policy.unit().to_le_bytes());
    for t in policy.tiers().iter().filter(|t| !matches!(t.kind, Kind::Concurrency(_))) {
        for v in [t.rate.count, t.rate.period, t.rate.burst] {
            feed(&v.to_le_bytes());
        }
        // Other kinds (plain policies hash as they always did: their keys stay).
        if let Kind::Calendar(spec) = &t.kind {
            feed(b"calendar");
            feed(spec.calendar.period().name().as_bytes());
            feed(spec.calendar.time_zone().as_bytes());
        }
        // A reserve is part of the tier's definition, as in memory: a policy whose reserves
        // differ is another budget on both stores (tiers without one hash as before).
        if let Some(r) = t.reserve {
            feed(b"reserve");
            for v in [r.critical_units(), r.standard_units()] {
                feed(&v.to_le_bytes());
            }
        }
    }
    h
}

/// The family of `policy`'s scripts.
pub(crate) fn family(policy: &Policy) -> Family {
    match policy.algorithm() {
        Algorithm::Gcra
            if policy.is_plain()
                && policy.tiers().iter().all(|t| t.rate.period % t.rate.count == 0)
                && !general_forced() =>
        {
            Family::Gcra
        }
        Algorithm::Gcra | Algorithm::TokenBucket | Algorithm::LeakyBucket => Family::Rate,
        Algorithm::FixedWindow | Algorithm::SlidingCounter => Family::Window,
        Algorithm::SlidingLog => Family::Log,
    }
}

#[cfg(test)]
thread_local! {
    /// Whether [`family`] sends plain GCRA policies of whole-unit emission intervals to the
    /// general scripts (`lua/rate.lua` and `lua/kinds.lua`) on this thread: see [`general`].
    static GENERAL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Tests: runs `f` (which binds policies: [`Prepared::new`]) with the GCRA fast path
/// (`lua/gcra.lua`) switched off on this thread, so that its plain policies are bound to the
/// general scripts, which decide them alike (`differential.rs` holds them to that).
#[cfg(test)]
pub(crate) fn general<T>(f: impl FnOnce() -> T) -> T {
    GENERAL.with(|g| g.set(true));
    let out = f();
    GENERAL.with(|g| g.set(false));
    out
}

#[cfg(test)]
fn general_forced() -> bool {
    GENERAL.with(std::cell::Cell::get)
}

#[cfg(not(test))]
const fn general_forced() -> bool {
    false
}

/// How `policy`'s state is stored, as a number its keys' fingerprint mixes in. It names the
/// layout, not the script that reads it: the numbers were those of the seven scripts that
/// once ran (whole-unit GCRA; plain GCRA or buckets, windows, logs, each with a driver of its
/// own; the same with other kinds of tiers), and they stay, so that a plain policy's state
/// keeps its keys, read and written alike by nodes of either version during a rolling deploy.
fn layout(policy: &Policy) -> u64 {
    // A critical reserve keeps a line per key after the calendar windows (`lua/line.lua`).
    if (0..policy.tiers().len()).any(|i| policy.line_reserve(i).is_some()) {
        return 7;
    }
    match (family(policy), policy.is_plain()) {
        (Family::Gcra, _) => 0,
        (Family::Rate, true) => 1,
        (Family::Window, true) => 2,
        (Family::Log, true) => 3,
        (Family::Rate, false) => 4,
        (Family::Window, false) => 5,
        (Family::Log, false) => 6,
    }
}

/// A stable 32-bit fingerprint of what the stored state means and of how it is stored (the
/// layout and its version). A reconfigured policy gets new keys, so state written under the
/// old one is never read under the new one; the old keys expire on their TTL.
fn fingerprint(policy: &Policy) -> u32 {
    let layout: u64 = 0x7632_0000 | layout(policy); // "v2" and the layout
    let h = (meaning(policy) ^ layout).wrapping_mul(0x0100_0000_01b3);
    #[allow(clippy::cast_possible_truncation)] // folding 64 bits into 32 on purpose
    let folded = (h ^ (h >> 32)) as u32;
    folded
}
