//! The scripts (`lua/`) and what a call sends and receives: one script per algorithm family,
//! each a shared prelude, the family's arithmetic and the one driver (`lua/kinds.lua`, which
//! decides plain policies as its all-rate, same-cost case) assembled at compile time; but the
//! GCRA fast path, `lua/gcra.lua`, chosen when a plain policy is bound, which is whole: it runs
//! on every lease call and most checks, and leaves out the prelude's helpers, which a call
//! would create every time. Every check of a batch is packed as little-endian doubles; the
//! reply is turned back into decisions.

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

static GCRA: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("lua/gcra.lua")));

static KINDS_RATE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("lua/prelude.lua"),
        include_str!("lua/rate.lua"),
        include_str!("lua/line.lua"),
        include_str!("lua/boxes.lua"),
        include_str!("lua/cover.lua"),
        include_str!("lua/kinds.lua")
    ))
});
static KINDS_WINDOW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("lua/prelude.lua"),
        include_str!("lua/window.lua"),
        include_str!("lua/line.lua"),
        include_str!("lua/boxes.lua"),
        include_str!("lua/cover.lua"),
        include_str!("lua/kinds.lua")
    ))
});
static KINDS_LOG: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        include_str!("lua/prelude.lua"),
        include_str!("lua/log.lua"),
        include_str!("lua/line.lua"),
        include_str!("lua/boxes.lua"),
        include_str!("lua/cover.lua"),
        include_str!("lua/kinds.lua")
    ))
});

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

/// Which instant the script decides at.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Now {
    /// The Redis server's `TIME`.
    Server,
    /// This instant of the store's injected clock, in nanoseconds.
    At(u64),
}

/// The header of a batch: `ARGV[1]`.
pub(crate) fn header(now: Now) -> Vec<u8> {
    let (flag, t) = match now {
        Now::Server => (0.0, 0),
        Now::At(t) => (1.0, t),
    };
    doubles(&[flag, (t / NANOS_PER_SEC) as f64, (t % NANOS_PER_SEC) as f64])
}

fn doubles(values: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 * values.len());
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// An integer below 2^53 as a double (exact); larger values never reach here.
#[allow(clippy::cast_precision_loss)] // every value sent is below 2^53
fn f(v: u64) -> f64 {
    v as f64
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

/// Escapes the characters that would end a Redis Cluster hash tag early (`{`, `}`) or make the
/// `policy|key` split ambiguous (`|`), and the escape character itself.
fn escape(s: &str) -> Cow<'_, str> {
    if !s.bytes().any(|b| matches!(b, b'{' | b'}' | b'|' | b'%')) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            '|' => out.push_str("%7C"),
            '%' => out.push_str("%25"),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
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
                && policy.tiers().iter().all(|t| t.rate.period % t.rate.count == 0) =>
        {
            Family::Gcra
        }
        Algorithm::Gcra | Algorithm::TokenBucket | Algorithm::LeakyBucket => Family::Rate,
        Algorithm::FixedWindow | Algorithm::SlidingCounter => Family::Window,
        Algorithm::SlidingLog => Family::Log,
    }
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

/// The parts of a policy's state keys around the key itself:
/// `{prefix}{{policy}|` and `}:{fingerprint}`. Everything that identifies the limit is inside
/// the hash tag, so a policy's tiers (and sliding-log sets) share one Redis Cluster slot.
pub(crate) fn key_parts(prefix: &str, policy: &Policy) -> (String, String) {
    (format!("{prefix}{{{}|", escape(policy.name())), format!("}}:{:08x}", fingerprint(policy)))
}

/// How state keys name the key they limit.
#[derive(Clone, Copy)]
pub(crate) enum KeyNames {
    /// `#` and 32 hexadecimal digits: SipHash-2-4 (128-bit output) of the key's `Display`
    /// form, keyed with these 16 bytes (derived from the deployment's secret by
    /// [`derive_secret`]).
    Hashed([u8; 16]),
    /// The key's `Display` form itself, escaped (for debugging).
    Raw,
}

impl fmt::Debug for KeyNames {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The secret stays out of logs and panics.
        f.write_str(match self {
            Self::Hashed(_) => "Hashed",
            Self::Raw => "Raw",
        })
    }
}

/// The secret state keys are hashed with when none is given: 16 ASCII bytes, documented, so a
/// fleet that sets none still shares budgets.
pub(crate) const DEFAULT_KEY_SECRET: &[u8] = b"tollgate:default";

/// The 16-byte SipHash key of a deployment's secret (of any length): SipHash-2-4 with a
/// fixed, public key over a domain label and the secret. The result is as hard to guess as
/// the secret, up to 128 bits.
pub(crate) fn derive_secret(secret: &[u8]) -> [u8; 16] {
    let mut h = SipHasher24::new_with_key(&[0; 16]);
    h.write(b"tollgate redis key secret\0");
    h.write(secret);
    u128::from(h.finish128()).to_le_bytes()
}

/// Streams formatted text into a hasher, so a key is hashed without first being rendered.
struct Feed<'a>(&'a mut SipHasher24);

impl fmt::Write for Feed<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.0.write(s.as_bytes());
        Ok(())
    }
}

/// The keyed 128-bit hash of `key`: of its `Display` form, which is the same on every
/// platform and version (unlike `Key::feed`, whose lengths are `usize`), so every node of a
/// fleet names a key alike.
fn key_hash(secret: &[u8; 16], key: &Key) -> u128 {
    use std::fmt::Write as _;
    let mut h = SipHasher24::new_with_key(secret);
    // `Feed` never fails, and `Key`'s `Display` only fails when its writer does.
    let _ = write!(Feed(&mut h), "{key}");
    u128::from(h.finish128())
}

/// The key of the string holding every tier's state of `key`, between the parts of
/// [`key_parts`], the key named as `names` says.
pub(crate) fn state_key(parts: &(String, String), names: &KeyNames, key: &Key) -> String {
    match names {
        KeyNames::Hashed(secret) => {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            let hash = key_hash(secret, key);
            let mut out = String::with_capacity(parts.0.len() + 33 + parts.1.len());
            out.push_str(&parts.0);
            out.push('#');
            // `{:032x}`, without the formatting machinery (a third of the naming's cost).
            out.extend((0..32).rev().map(|i| char::from(HEX[(hash >> (4 * i)) as usize & 0xf])));
            out.push_str(&parts.1);
            out
        }
        KeyNames::Raw => {
            let key = key.to_string();
            let key = escape(&key);
            let mut out = String::with_capacity(parts.0.len() + key.len() + parts.1.len());
            out.push_str(&parts.0);
            out.push_str(&key);
            out.push_str(&parts.1);
            out
        }
    }
}

/// The hash tag of a state key: what its Redis Cluster slot is computed from.
pub(crate) fn hash_tag(state_key: &str) -> &str {
    let Some(open) = state_key.find('{') else { return state_key };
    match state_key[open + 1..].find('}') {
        Some(len) if len > 0 => &state_key[open + 1..open + 1 + len],
        _ => state_key,
    }
}

/// A policy's part of a batch (`ARGV[2]`): `unit, grace, algorithm, tiers` and each tier's
/// parameters, sent once per batch however many of its checks the batch holds.
#[derive(Debug)]
pub(crate) struct PolicyArgs {
    /// Unique per binding: a batch sends each policy once.
    pub(crate) id: u64,
    pub(crate) args: Vec<f64>,
}

/// What a bound policy's checks send, rendered when it is bound.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub(crate) family: Family,
    pub(crate) policy: Arc<PolicyArgs>,
    /// Sliding-log sets after the state key (one per rate tier).
    log_sets: usize,
    /// Tiers.
    ntiers: usize,
    /// Nanoseconds per unit.
    pub(crate) unit: u64,
    /// For a policy that is not plain: the lease sets after the log sets (one per concurrency
    /// tier), then the penalty boxes, and the calendar tiers, whose window bounds each record
    /// carries.
    kinds: Option<Kinds>,
}

/// What records of a policy of several kinds need.
#[derive(Debug)]
struct Kinds {
    /// Concurrency tiers.
    conc: usize,
    /// The names of the lease sets and penalty boxes after a key's name: `:c:{tier}` per
    /// concurrency tier, then `:p:{tier}` per tier with a box (see [`Prepared::keys`]).
    named: Vec<String>,
    /// The calendar tiers' windows, in tier order.
    calendars: Vec<Arc<CalendarSpec>>,
    /// The kind of each tier: 0 rate, 1 concurrency, 2 calendar.
    tags: Vec<u8>,
    /// The latest instant (nanoseconds; 0: none) at which a script found a key deciding that
    /// the windows sent did not cover: the bounds reach it while it lies ahead (see
    /// `lua/cover.lua`).
    cover: AtomicU64,
}

impl Prepared {
    pub(crate) fn new(policy: &Policy, grace_ms: u64) -> Self {
        static IDS: AtomicU64 = AtomicU64::new(1);
        let family = family(policy);
        let ntiers = policy.tiers().len();
        let alg = match policy.algorithm() {
            Algorithm::Gcra => 0,
            Algorithm::TokenBucket => 1,
            Algorithm::LeakyBucket => 2,
            Algorithm::FixedWindow => 3,
            Algorithm::SlidingCounter => 4,
            Algorithm::SlidingLog => 5,
        };
        let mut args = vec![f(policy.unit()), f(grace_ms), f(alg), f(ntiers as u64)];
        if family != Family::Gcra {
            args.push(f(u64::from(policy.is_plain())));
        }
        let mut kinds = Kinds {
            conc: 0,
            named: Vec::new(),
            calendars: Vec::new(),
            tags: Vec::new(),
            cover: AtomicU64::new(0),
        };
        for t in policy.tiers() {
            let r = t.rate;
            if family != Family::Gcra {
                match &t.kind {
                    Kind::Rate => args.extend([0.0, f(r.count), f(r.period), f(r.burst)]),
                    Kind::Concurrency(s) => {
                        kinds.conc += 1;
                        kinds.named.push(format!(":c:{}", escape(t.name())));
                        args.extend([1.0, f(s.max), f(s.lease_ms), 0.0]);
                    }
                    Kind::Calendar(spec) => {
                        kinds.calendars.push(Arc::clone(spec));
                        args.extend([2.0, f(r.count), 0.0, 0.0]);
                    }
                }
                match t.penalty {
                    Some(b) => args.extend([f(b.block), f(b.refusals), f(b.within)]),
                    None => args.extend([0.0; 3]),
                }
                let r = t.reserve.unwrap_or_default();
                args.extend([f(r.critical_units()), f(r.standard_units())]);
                kinds.tags.push(match t.kind {
                    Kind::Rate => 0,
                    Kind::Concurrency(_) => 1,
                    Kind::Calendar(_) => 2,
                });
            } else {
                let interval = r.period / r.count;
                args.extend([f(interval), f(interval * r.burst)]);
            }
        }
        let boxed = policy.tiers().iter().filter(|t| t.penalty.is_some());
        kinds.named.extend(boxed.map(|t| format!(":p:{}", escape(t.name()))));
        let id = IDS.fetch_add(1, Ordering::Relaxed);
        let rates = policy.tiers().iter().filter(|t| t.kind == Kind::Rate).count();
        let log_sets = if family == Family::Log { rates } else { 0 };
        Self {
            family,
            policy: Arc::new(PolicyArgs { id, args }),
            log_sets,
            ntiers,
            unit: policy.unit(),
            kinds: (!policy.is_plain()).then_some(kinds),
        }
    }

    /// The keys of a check on `state_key`: it, then the sliding-log sets (`{state_key}:z1`,
    /// ...), then the lease sets and the penalty boxes. Those two hold state a reload keeps
    /// (see `MemoryStore::rebind_policy`): they are named by the policy, the key and the tier
    /// (`{prefix}{{policy}|{key}}:c:{tier}`, `...:p:{tier}`), not by the policy's fingerprint,
    /// so every definition of a policy of that name finds them.
    pub(crate) fn keys(&self, state_key: String) -> Vec<String> {
        let named = self.kinds.as_ref().map_or(&[][..], |k| &k.named[..]);
        let mut keys = Vec::with_capacity(1 + self.log_sets + named.len());
        keys.push(String::new());
        keys.extend((1..=self.log_sets).map(|i| format!("{state_key}:z{i}")));
        // The state key less its `:{fingerprint}` (`key_parts`).
        let base = state_key.get(..state_key.len().saturating_sub(9)).unwrap_or_default();
        keys.extend(named.iter().map(|n| format!("{base}{n}")));
        keys[0] = state_key;
        keys
    }

    /// Whether the policy is not plain (its checks give a cost per tier, it may hold slots).
    pub(crate) fn is_kinds(&self) -> bool {
        self.kinds.is_some()
    }

    /// The calendar bounds of a record made at `now` (nanoseconds of this process's clock),
    /// through `lookahead` - 1 windows after the one holding `now + margin`. A policed check
    /// leaves now or not at all, so it needs no lookahead: it sends one or two windows.
    fn bounds(&self, record: &mut Vec<f64>, now: u64, lookahead: usize) {
        let Some(kinds) = &self.kinds else { return };
        let until = kinds.cover.load(Ordering::Relaxed);
        for spec in &kinds.calendars {
            let b = calendar::bounds(spec, now, until, CALENDAR_MARGIN_SECS, lookahead);
            record.push(f(b.len() as u64));
            #[allow(clippy::cast_precision_loss)] // seconds since the epoch, below 2^53
            record.extend(b.iter().map(|s| *s as f64));
        }
    }

    /// Whether the policy has calendar tiers, whose records carry window bounds.
    pub(crate) fn has_calendars(&self) -> bool {
        self.kinds.as_ref().is_some_and(|k| !k.calendars.is_empty())
    }

    /// `record` (a check or settlement of [`check_kinds`](Self::check_kinds) or
    /// [`settle_kinds`](Self::settle_kinds)) with its calendar bounds made again at `now`, to
    /// reach `need` (nanoseconds: a key's instant a script asked for) and any later record's;
    /// `None` for another record.
    pub(crate) fn rebound(&self, record: &[f64], now: u64, need: u64) -> Option<Vec<f64>> {
        let kinds = self.kinds.as_ref()?;
        kinds.cover.fetch_max(need, Ordering::Relaxed);
        let n = self.ntiers;
        let op = *record.first()?;
        let (start, lookahead) = if op == 1.0 {
            (7 + n, if *record.get(4)? >= 0.0 { LOOKAHEAD } else { 1 })
        } else if op == 2.0 {
            (5 + 5 * n, LOOKAHEAD)
        } else {
            return None;
        };
        let mut end = start;
        for _ in &kinds.calendars {
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // a count we wrote
            let count = *record.get(end)? as usize;
            end += 1 + count;
        }
        let mut out = record.get(..start)?.to_vec();
        self.bounds(&mut out, now, lookahead);
        out.extend_from_slice(record.get(end..)?);
        out[3] = f(out.len() as u64);
        Some(out)
    }

    /// A check of a policy of several kinds: `costs` per tier (resolved), `max_delay` as for
    /// [`check`](Self::check), the lease id of its slots, the request's class, and `now` (this
    /// process's clock, for the calendar bounds).
    pub(crate) fn check_kinds(
        &self,
        costs: &[u64],
        max_delay: Option<Duration>,
        lease: u64,
        class: Priority,
        now: u64,
    ) -> Vec<f64> {
        let budget =
            max_delay.map_or(-1.0, |d| f((duration_to_nanos(d) / self.unit).min(MAX_SPAN_UNITS)));
        let mut record = vec![1.0, 0.0, 0.0, 0.0, budget, f(lease)];
        record.extend(costs.iter().map(|c| f(*c)));
        record.push(f(class.index()));
        self.bounds(&mut record, now, if max_delay.is_some() { LOOKAHEAD } else { 1 });
        record[3] = f(record.len() as u64);
        record
    }

    /// A settlement of a policy of several kinds: per tier the charge and the cost it is
    /// settled at (`new`), the slots given back with `release`; `now` as for
    /// [`check_kinds`](Self::check_kinds).
    pub(crate) fn settle_kinds(
        &self,
        charges: &Charges,
        new: &[u64],
        release: bool,
        now: u64,
    ) -> Vec<f64> {
        let per_sec = NANOS_PER_SEC / self.unit;
        let mut record = vec![2.0, 0.0, 0.0, 0.0, f(u64::from(release))];
        for (c, new) in charges.iter().zip(new) {
            record.extend([f(c.cost), f(*new), f(c.at / per_sec), f(c.at % per_sec), f(c.id)]);
        }
        // The whole lookahead: a charge grown after a step back of the server's clock goes to
        // the window holding the key's later now, which may lie in it.
        self.bounds(&mut record, now, LOOKAHEAD);
        // The window holding each calendar tier's charge: a tier that cost nothing when the
        // request was decided did not hold its departure to the lookahead, and what it is
        // charged now belongs to the window the request left in, wherever that is.
        if let Some(kinds) = &self.kinds {
            let at = kinds.tags.iter().zip(charges).filter(|(t, _)| **t == 2).map(|(_, c)| c.at);
            for (spec, at) in kinds.calendars.iter().zip(at) {
                let (start, end) = calendar::window_at(spec, at.saturating_mul(self.unit));
                #[allow(clippy::cast_precision_loss)] // seconds since the epoch, below 2^53
                record.extend([start as f64, end as f64]);
            }
        }
        record[3] = f(record.len() as u64);
        record
    }

    /// A refresh of the leases `lease` holds: the slots of each concurrency tier, from the
    /// charges.
    pub(crate) fn refresh(&self, charges: &Charges, lease: u64) -> Vec<f64> {
        let tags = self.kinds.as_ref().map_or(&[][..], |k| &k.tags[..]);
        let mut record = vec![4.0, 0.0, 0.0, 0.0, f(lease)];
        record.extend(tags.iter().zip(charges).filter(|(t, _)| **t == 1).map(|(_, c)| f(c.cost)));
        record[3] = f(record.len() as u64);
        record
    }

    /// The numbers a refresh adds to the reply: one per concurrency tier.
    pub(crate) fn refresh_reply_len(&self) -> usize {
        self.kinds.as_ref().map_or(0, |k| k.conc)
    }

    /// A check of `cost` units on every tier of a plain policy; `max_delay` `None` polices,
    /// `Some` shapes (clamped to the longest span). The key and policy indices (the second and
    /// third numbers) are set when the batch is assembled. `gcra.lua` reads `op, key, policy,
    /// cost, budget`; `kinds.lua` a check of [`check_kinds`](Self::check_kinds)'s layout (no
    /// slots, the standard class, no calendar bounds).
    pub(crate) fn check(&self, cost: u64, max_delay: Option<Duration>) -> Vec<f64> {
        let budget =
            max_delay.map_or(-1.0, |d| f((duration_to_nanos(d) / self.unit).min(MAX_SPAN_UNITS)));
        if self.family == Family::Gcra {
            return vec![1.0, 0.0, 0.0, f(cost), budget];
        }
        let mut record = Vec::with_capacity(7 + self.ntiers);
        record.extend([1.0, 0.0, 0.0, f(7 + self.ntiers as u64), budget, 0.0]);
        record.extend(std::iter::repeat_n(f(cost), self.ntiers));
        record.push(f(Priority::Standard.index()));
        record
    }

    /// Settles a plain policy's charges (`charges` per tier, instants in units): tier `i` from
    /// `old(i)` units to `new(i)` (a plain policy is the same-cost case of the general one, and
    /// settles its tiers alike: [`Store::settle_tiers`](crate::store::Store::settle_tiers)).
    /// For `kinds.lua` a settlement of [`settle_kinds`](Self::settle_kinds)'s layout giving no
    /// slots back; for `gcra.lua` the same per tier, after op, key and policy.
    pub(crate) fn settle(
        &self,
        charges: &Charges,
        old: impl Fn(usize) -> u64,
        new: impl Fn(usize) -> u64,
    ) -> Vec<f64> {
        let per_sec = NANOS_PER_SEC / self.unit;
        let mut record = Vec::with_capacity(5 + 5 * self.ntiers);
        if self.family == Family::Gcra {
            record.extend([2.0, 0.0, 0.0]);
        } else {
            record.extend([2.0, 0.0, 0.0, f(5 + 5 * self.ntiers as u64), 0.0]);
        }
        for (i, c) in charges.iter().enumerate() {
            record.extend([f(old(i)), f(new(i)), f(c.at / per_sec), f(c.at % per_sec), f(c.id)]);
        }
        record
    }

    /// A lease: at least `cost` units and at most `block` (Redis grants at most a quarter of
    /// what the key has left beyond `cost`, or up to `useful` of it when that is more), after
    /// settling the previous block `rest` at what was spent of it. With `useful` above 0 the
    /// reply also says when `useful` units will be there again.
    pub(crate) fn lease(
        &self,
        cost: u64,
        block: u64,
        useful: u64,
        rest: Option<&Rest>,
    ) -> Vec<f64> {
        let per_sec = NANOS_PER_SEC / self.unit;
        if self.family == Family::Gcra {
            let mut record = Vec::with_capacity(8 + 3 * self.ntiers);
            record.extend([3.0, 0.0, 0.0, f(cost), f(block), f(useful)]);
            match rest {
                Some(rest) => {
                    record.extend([f(rest.granted), f(rest.spent)]);
                    for c in &rest.charges {
                        record.extend([f(c.at / per_sec), f(c.at % per_sec), f(c.id)]);
                    }
                }
                None => record.extend(std::iter::repeat_n(0.0, 2 + 3 * self.ntiers)),
            }
            return record;
        }
        // `kinds.lua`: op, key, policy, length, then the lease, then per tier the previous
        // lease's settlement as a settlement's (old and new cost, instant, entry id).
        let mut record = Vec::with_capacity(7 + 5 * self.ntiers);
        record.extend([3.0, 0.0, 0.0, f(7 + 5 * self.ntiers as u64), f(cost), f(block), f(useful)]);
        match rest {
            Some(rest) => {
                for c in &rest.charges {
                    record.extend([
                        f(rest.granted),
                        f(rest.spent),
                        f(c.at / per_sec),
                        f(c.at % per_sec),
                        f(c.id),
                    ]);
                }
            }
            None => record.extend(std::iter::repeat_n(0.0, 5 * self.ntiers)),
        }
        record
    }

    /// A lease of the key's schedule (GCRA of whole units only, `lua/gcra.lua`): as
    /// [`lease`](Self::lease), but when the key has less than `useful` units now, Redis
    /// grants `useful` units (at most `block`) of those that come next, as long as the last
    /// of them conforms within `horizon` units of now; the reply's wait is then until a
    /// useful block fits the horizon again.
    pub(crate) fn lease_ahead(
        &self,
        cost: u64,
        block: u64,
        useful: u64,
        rest: Option<&Rest>,
        horizon: u64,
    ) -> Vec<f64> {
        debug_assert_eq!(self.family, Family::Gcra);
        let mut record = self.lease(cost, block, useful, rest);
        record[0] = 4.0;
        record.push(f(horizon.min(MAX_SPAN_UNITS)));
        record
    }

    /// The numbers a lease adds to the reply: a check's, then the units granted and when a
    /// useful block will be there again (in the policy's time units from the unit `now` falls
    /// in; 0 for now).
    pub(crate) fn lease_reply_len(&self) -> usize {
        self.check_reply_len() + 2
    }

    /// The policy's time unit, in nanoseconds.
    pub(crate) fn unit(&self) -> u64 {
        self.unit
    }

    /// The numbers a check adds to the reply.
    pub(crate) fn check_reply_len(&self) -> usize {
        HEAD + PER_TIER * self.ntiers
    }
}

/// The batch's `ARGV[2]` (its policies) and `ARGV[3]` (its checks), given each check's key
/// index (1-based, into `KEYS`), policy and record.
pub(crate) fn batch<'a>(
    checks: impl Iterator<Item = (usize, &'a PolicyArgs, &'a [f64])>,
) -> (Vec<u8>, Vec<u8>) {
    let mut ids: Vec<u64> = Vec::new();
    let mut policies = Vec::new();
    let mut records = Vec::new();
    for (key, policy, record) in checks {
        let index = match ids.iter().position(|id| *id == policy.id) {
            Some(i) => i + 1,
            None => {
                ids.push(policy.id);
                for v in &policy.args {
                    policies.extend_from_slice(&v.to_le_bytes());
                }
                ids.len()
            }
        };
        for (i, v) in record.iter().enumerate() {
            let v = match i {
                1 => f(key as u64),
                2 => f(index as u64),
                _ => *v,
            };
            records.extend_from_slice(&v.to_le_bytes());
        }
    }
    (policies, records)
}

/// The numbers of a packed reply (integers below 2^53, as doubles).
pub(crate) fn numbers(reply: &[u8]) -> Result<Vec<i64>, StoreError> {
    if reply.len() % 8 != 0 {
        return Err(bad_reply("not packed doubles"));
    }
    #[allow(clippy::cast_possible_truncation)] // integers below 2^53
    let numbers = reply
        .chunks_exact(8)
        .map(|c| {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            f64::from_le_bytes(b) as i64
        })
        .collect();
    Ok(numbers)
}

/// Reply layout per check: `outcome (1 allowed, 0 limited, 2 cost above capacity), delay,
/// retry`, then per tier `remaining, reset, own retry (-1 none), violated, entry id`; durations
/// in units from the unit `now` falls in.
pub(crate) const HEAD: usize = 3;
pub(crate) const PER_TIER: usize = 5;

fn bad_reply(what: &str) -> StoreError {
    StoreError::backend(format!("unexpected reply from the tollgate script: {what}"))
}

fn units(v: i64) -> Result<u64, StoreError> {
    u64::try_from(v).map_err(|_| bad_reply("negative duration"))
}

fn optional(v: i64) -> Result<Option<u64>, StoreError> {
    if v < 0 { Ok(None) } else { units(v).map(Some) }
}

/// The decision of a check (its part of the reply) made at `now` (nanoseconds), and for an
/// admitted request what each tier was charged (`cost` on every tier).
pub(crate) fn decode(
    policy: &Policy,
    cost: u64,
    now: u64,
    reply: &[i64],
) -> Result<(Decision, Option<Charges>), StoreError> {
    decode_costs(policy, &|_| cost, 0, Priority::Standard, now, reply)
}

/// [`decode`] with a cost per tier, and the lease id of the concurrency tiers' slots (charged
/// at the decision's instant, not after its delay: they are held from then on), for a request
/// of `class` (each tier's limit is what the class may use of it).
pub(crate) fn decode_costs(
    policy: &Policy,
    cost: &dyn Fn(usize) -> u64,
    lease: u64,
    class: Priority,
    now: u64,
    reply: &[i64],
) -> Result<(Decision, Option<Charges>), StoreError> {
    let tiers = policy.tiers();
    if reply.len() != HEAD + PER_TIER * tiers.len() {
        return Err(bad_reply("wrong length"));
    }
    let outcome = match reply[0] {
        1 => Outcome::Allowed,
        0 => Outcome::Limited,
        2 => Outcome::CostExceedsCapacity,
        _ => return Err(bad_reply("unknown outcome")),
    };
    let unit = policy.unit();
    let at = now / unit;
    let delay = units(reply[1])?;
    let mut decided = Tiers::with_capacity(tiers.len());
    let mut charges = Charges::with_capacity(tiers.len());
    for (i, (tier, r)) in tiers.iter().zip(reply[HEAD..].chunks_exact(PER_TIER)).enumerate() {
        decided.push(TierDecision::new(
            tier.capacity_for(class),
            units(r[0])?,
            units(r[1])?,
            optional(r[2])?,
            r[3] != 0,
        ));
        charges.push(match tier.kind {
            Kind::Concurrency(_) => Charge { at, cost: cost(i), id: lease },
            _ => Charge { at: at.saturating_add(delay), cost: cost(i), id: units(r[4])? },
        });
    }
    let mut decision = Decision::new(outcome, delay, optional(reply[2])?, decided);
    if unit > 1 {
        decision.rescale(at, unit, now);
    }
    let charges = (outcome == Outcome::Allowed).then_some(charges);
    Ok((decision, charges))
}

/// The instant a batch was decided at, from the last two numbers of its reply.
pub(crate) fn decided_at(reply: &[i64]) -> Result<u64, StoreError> {
    match reply {
        [.., s, ns] => {
            let (s, ns) = (units(*s)?, units(*ns)?);
            Ok(s.saturating_mul(NANOS_PER_SEC).saturating_add(ns))
        }
        _ => Err(bad_reply("no instant")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::Quota;

    fn policy(name: &str, alg: Algorithm) -> Policy {
        Policy::builder(name)
            .algorithm(alg)
            .tier("a", Quota::per_second(10))
            .tier("b", Quota::per_hour(100))
            .build()
            .unwrap()
    }

    #[test]
    fn keys_keep_the_hash_tag_whole_and_unambiguous() {
        let p = policy("api", Algorithm::Gcra);
        let raw = |parts: &(String, String), key: &Key| state_key(parts, &KeyNames::Raw, key);
        let k = raw(&key_parts("tollgate:", &p), &Key::text("a}b{c|d%"));
        let fp = format!("{:08x}", fingerprint(&p));
        assert_eq!(k, format!("tollgate:{{api|s8:a%7Db%7Bc%7Cd%25}}:{fp}"));
        assert_eq!(hash_tag(&k), "api|s8:a%7Db%7Bc%7Cd%25");
        // `|` in a policy name cannot be confused with the separator.
        let a = raw(&key_parts("", &policy("a|b", Algorithm::Gcra)), &Key::text("c"));
        let b = raw(&key_parts("", &policy("a", Algorithm::Gcra)), &Key::text("b|s1:c"));
        assert_ne!(hash_tag(&a), hash_tag(&b));
    }

    #[test]
    fn hashed_keys_hide_the_key_and_keep_the_policy_in_the_hash_tag() {
        let p = policy("api", Algorithm::Gcra);
        let parts = key_parts("tollgate:", &p);
        let default = KeyNames::Hashed(derive_secret(DEFAULT_KEY_SECRET));
        let secret = Key::text("sk_live_SECRET");
        let k = state_key(&parts, &default, &secret);
        // Pinned: nodes of one fleet on different versions must name a key alike, so a change
        // of the hash, its input or the derivation of the secret must be deliberate. Checked
        // against an independent SipHash-2-4-128 (the reference vectors' implementation):
        // the secret is SipHash(key 0, "tollgate redis key secret\0tollgate:default"), the
        // name SipHash(secret, "s14:sk_live_SECRET"), its two halves as one u128 (the first
        // the low 64 bits) in hexadecimal.
        let fp = format!("{:08x}", fingerprint(&p));
        assert_eq!(k, format!("tollgate:{{api|#58973adca6b7b56939004a2f862241c6}}:{fp}"));
        assert_eq!(k.len(), "tollgate:{api|#}:".len() + 32 + 8);
        assert!(!k.contains("SECRET") && !k.contains("sk_live"), "{k}");
        assert_eq!(hash_tag(&k), &k["tollgate:{".len().."tollgate:{".len() + 37]);
        assert!(hash_tag(&k).starts_with("api|#"));
        assert_eq!(k, state_key(&parts, &default, &Key::text("sk_live_SECRET")), "stable");
        // Another secret, another name; keys whose texts look alike stay apart.
        let other = KeyNames::Hashed(derive_secret(b"another deployment"));
        assert_ne!(k, state_key(&parts, &other, &secret));
        let names = [Key::Global, Key::text("g"), Key::Missing, Key::text("m"), Key::text("")];
        let all: std::collections::HashSet<_> =
            names.iter().map(|key| state_key(&parts, &default, key)).collect();
        assert_eq!(all.len(), names.len());
        // The derivation reads every byte of the secret, whatever its length.
        assert_ne!(derive_secret(b"a"), derive_secret(b"a\0"));
        assert_ne!(derive_secret(DEFAULT_KEY_SECRET), *DEFAULT_KEY_SECRET.first_chunk().unwrap());
        assert_eq!(format!("{default:?}"), "Hashed", "the secret stays out of Debug");
    }

    #[test]
    fn reconfigured_policies_get_new_keys() {
        let a = policy("api", Algorithm::Gcra);
        let b = policy("api", Algorithm::TokenBucket);
        let c = Policy::builder("api")
            .tier("a", Quota::per_second(10).with_burst(11))
            .tier("b", Quota::per_hour(100))
            .build()
            .unwrap();
        let names = KeyNames::Hashed(derive_secret(DEFAULT_KEY_SECRET));
        let key = |p: &Policy| state_key(&key_parts("", p), &names, &Key::Global);
        let keys: Vec<_> = [&a, &b, &c].into_iter().map(key).collect();
        assert_ne!(keys[0], keys[1]);
        assert_ne!(keys[0], keys[2]);
        assert_eq!(key(&a), keys[0], "stable");
    }

    #[test]
    fn a_batch_sends_each_policy_once_and_every_check_as_doubles() {
        let doubles = |b: &[u8]| -> Vec<f64> {
            b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect()
        };
        let p = policy("api", Algorithm::SlidingLog);
        let prepared = Prepared::new(&p, 7);
        assert_eq!(prepared.keys("h".into()), ["h", "h:z1", "h:z2"]);
        let (a, b) = (prepared.check(2, None), prepared.check(0, Some(Duration::from_nanos(5))));
        let checks = [(1, a.as_slice()), (4, b.as_slice())];
        let (policies, records) = batch(checks.iter().map(|(k, r)| (*k, &*prepared.policy, *r)));
        // unit, grace, algorithm, tiers, plain, then per tier its kind, count, period, burst, no
        // penalty box, no reserve.
        let z = [0.0; 5];
        let mut expected = vec![1.0, 7.0, 5.0, 2.0, 1.0, 0.0, 10.0, 1e9, 10.0];
        expected.extend(z);
        expected.extend([0.0, 100.0, 3.6e12, 100.0]);
        expected.extend(z);
        assert_eq!(doubles(&policies), expected);
        // op, key, policy, length, budget, no slots, the cost on each tier, the standard class.
        assert_eq!(
            doubles(&records),
            [
                1.0, 1.0, 1.0, 9.0, -1.0, 0.0, 2.0, 2.0, 1.0, 1.0, 4.0, 1.0, 9.0, 5.0, 0.0, 0.0,
                0.0, 1.0
            ]
        );
        assert_eq!(prepared.check_reply_len(), 13);
    }

    #[test]
    fn plain_settlements_and_leases_are_records_of_the_one_driver() {
        let p = policy("api", Algorithm::TokenBucket);
        let prepared = Prepared::new(&p, 0);
        assert_eq!(prepared.family, Family::Rate);
        let charges: Charges =
            [Charge { at: 7_000_000_009, cost: 3, id: 0 }, Charge { at: 5, cost: 3, id: 2 }]
                .into_iter()
                .collect();
        // op, key, policy, length, no release, then per tier old, new, instant, entry id; the
        // tiers at costs of their own.
        assert_eq!(
            prepared.settle(&charges, |_| 3, |i| [1, 2][i]),
            [2.0, 0.0, 0.0, 15.0, 0.0, 3.0, 1.0, 7.0, 9.0, 0.0, 3.0, 2.0, 0.0, 5.0, 2.0]
        );
        // gcra.lua's: op, key, policy, then the same per tier.
        let whole = Prepared::new(&policy("api", Algorithm::Gcra), 0);
        assert_eq!(whole.family, Family::Gcra);
        assert_eq!(
            whole.settle(&charges, |_| 3, |i| [1, 2][i]),
            [2.0, 0.0, 0.0, 3.0, 1.0, 7.0, 9.0, 0.0, 3.0, 2.0, 0.0, 5.0, 2.0]
        );
        // op, key, policy, length, cost, block, useful, then the previous lease settled.
        let rest = Rest { granted: 3, spent: 2, charges };
        assert_eq!(
            prepared.lease(1, 64, 4, Some(&rest)),
            [3.0, 0.0, 0.0, 17.0, 1.0, 64.0, 4.0, 3.0, 2.0, 7.0, 9.0, 0.0, 3.0, 2.0, 0.0, 5.0, 2.0]
        );
        let fresh = prepared.lease(1, 64, 0, None);
        assert_eq!(fresh[..7], [3.0, 0.0, 0.0, 17.0, 1.0, 64.0, 0.0]);
        assert_eq!(fresh[7..], [0.0; 10]);
        assert_eq!(prepared.lease_reply_len(), 15);
    }

    /// A rolling deploy runs nodes of the version with a driver per kind of policy beside
    /// nodes of this one on one Redis: a plain policy's state keys, hence its fingerprint
    /// (which mixes in how the state is laid out), must not change. Pinned: computed by an
    /// independent FNV-1a of the algorithm's name, the unit and each tier's count, period and
    /// burst (little-endian u64s), xor `0x7632_0000 | n`, times the FNV prime, folded to 32
    /// bits, with n the number of the script the version before ran (0 `gcra.lua`, 1 GCRA or
    /// buckets, 2 windows, 3 sliding logs).
    #[test]
    fn plain_policies_keep_their_state_keys() {
        let two = |alg| {
            Policy::builder("api")
                .algorithm(alg)
                .tier("a", Quota::per_second(10).with_burst(10))
                .tier("b", Quota::per_hour(100).with_burst(100))
                .build()
                .unwrap()
        };
        let fractional =
            Policy::builder("api").tier("a", Quota::per_second(3).with_burst(3)).build().unwrap();
        let cases = [
            (two(Algorithm::Gcra), Family::Gcra, 0xc0b1_cd28),
            (fractional, Family::Rate, 0xefda_d502),
            (two(Algorithm::TokenBucket), Family::Rate, 0x80b9_075d),
            (two(Algorithm::LeakyBucket), Family::Rate, 0x5936_fcc4),
            (two(Algorithm::FixedWindow), Family::Window, 0x8657_4f76),
            (two(Algorithm::SlidingCounter), Family::Window, 0x5d8a_11a1),
            (two(Algorithm::SlidingLog), Family::Log, 0xecff_edc9),
        ];
        for (p, family, pinned) in cases {
            assert_eq!(
                (super::family(&p), fingerprint(&p)),
                (family, pinned),
                "{:?}",
                p.algorithm()
            );
        }
        // A policy of the same family that is not plain keeps a layout of its own.
        let boxed = Policy::builder("api")
            .algorithm(Algorithm::TokenBucket)
            .tier("a", Quota::per_second(10).with_burst(10))
            .tier("b", Quota::per_hour(100).with_burst(100))
            .penalty("a", crate::quota::Penalty::new(Duration::from_secs(1)))
            .build()
            .unwrap();
        assert_eq!(family(&boxed), Family::Rate);
        assert_ne!(layout(&boxed), layout(&two(Algorithm::TokenBucket)));
    }

    #[test]
    fn a_penalty_box_gets_its_own_keys_and_its_numbers_with_its_tier() {
        use crate::quota::{Calendar, Penalty};
        let box_ = Penalty::new(Duration::from_secs(900)).after(3, Duration::from_secs(60));
        let base = || Policy::builder("api").tier("a", Quota::per_minute(10));
        let plain = base().build().unwrap();
        let calendar = base().calendar("d", Calendar::per_day(5)).build().unwrap();
        let boxed = base().penalty("a", box_).build().unwrap();
        let other = base().penalty("a", box_.after(4, Duration::from_secs(60))).build().unwrap();
        let fps: std::collections::HashSet<_> =
            [&plain, &calendar, &boxed].into_iter().map(fingerprint).collect();
        assert_eq!(fps.len(), 3, "a box changes how the state is kept (the policy is not plain)");
        // The box lives apart, named by its tier: another box keeps the state key, and finds
        // the box of the key where it was.
        assert_eq!(fingerprint(&boxed), fingerprint(&other));
        let keys = |p: &Policy| Prepared::new(p, 0).keys("tollgate:{api|k}:0123abcd".into());
        assert_eq!(keys(&boxed), ["tollgate:{api|k}:0123abcd", "tollgate:{api|k}:p:a"]);
        assert_eq!(keys(&boxed), keys(&other));
        assert_eq!(family(&boxed), Family::Rate);
        // Per tier of a policy of several kinds: kind, three parameters, then the box (block,
        // refusals, window; zeros for none), then the reserves (critical, standard).
        let args = |p: &Policy| Prepared::new(p, 0).policy.args.clone();
        let block = 900_000_000_000.0;
        assert_eq!(
            args(&boxed),
            [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 10.0, 6e10, 10.0, block, 3.0, 6e10, 0.0, 0.0]
        );
        assert_eq!(
            args(&calendar)[5..],
            [
                0.0, 10.0, 6e10, 10.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                0.0, 0.0
            ]
        );
    }

    #[test]
    fn a_reserve_gets_its_own_keys_its_numbers_and_the_class_in_the_record() {
        use crate::quota::Reserve;
        let base = || Policy::builder("api").tier("a", Quota::per_minute(10));
        let plain = base().build().unwrap();
        let reserved = base().reserve("a", Reserve::new().critical(2).standard(3)).build().unwrap();
        let other = base().reserve("a", Reserve::new().critical(3).standard(2)).build().unwrap();
        let fps: std::collections::HashSet<_> =
            [&plain, &reserved, &other].into_iter().map(fingerprint).collect();
        assert_eq!(fps.len(), 3);
        assert_eq!(family(&reserved), Family::Rate);
        let prepared = Prepared::new(&reserved, 0);
        assert_eq!(
            prepared.policy.args,
            [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 10.0, 6e10, 10.0, 0.0, 0.0, 0.0, 2.0, 3.0]
        );
        // op, key, policy, length, budget, lease, the costs, then the class (2 sheddable).
        let record = prepared.check_kinds(&[1], None, 0, Priority::Sheddable, 0);
        assert_eq!(record, [1.0, 0.0, 0.0, 8.0, -1.0, 0.0, 1.0, 2.0]);
    }

    #[test]
    fn a_policed_calendar_check_sends_the_windows_around_now_and_a_shaped_one_the_lookahead() {
        use crate::quota::Calendar;
        let p = Policy::builder("api")
            .tier("a", Quota::per_minute(10))
            .calendar("d", Calendar::per_day(5))
            .build()
            .unwrap();
        let prepared = Prepared::new(&p, 0);
        // 2025-06-15 15:06:40 UTC: the day holds now - 60 s and now + 60 s.
        let now = 1_750_000_000 * NANOS_PER_SEC;
        let (start, end) = (1_749_945_600.0, 1_750_032_000.0);
        // op, key, policy, length, budget, lease, the costs, the class, then the bounds.
        let policed = prepared.check_kinds(&[1, 1], None, 0, Priority::Standard, now);
        assert_eq!(policed, [1.0, 0.0, 0.0, 12.0, -1.0, 0.0, 1.0, 1.0, 1.0, 2.0, start, end]);
        // Shaped: the day and the seven after it.
        let shaped =
            prepared.check_kinds(&[1, 1], Some(Duration::from_secs(1)), 0, Priority::Standard, now);
        let days: Vec<f64> = (0..9).map(|d| start + f64::from(d) * 86_400.0).collect();
        assert_eq!(shaped[9], 9.0);
        assert_eq!(shaped[10..], days[..]);
        // Near midnight, a policed check sends both days the server's clock may be in.
        let late = prepared.check_kinds(
            &[1, 1],
            None,
            0,
            Priority::Standard,
            (end as u64 - 30) * NANOS_PER_SEC,
        );
        assert_eq!(late[9..], [3.0, start, end, end + 86_400.0]);
    }

    #[test]
    fn windows_below_a_millisecond_are_refused() {
        let tiny = Policy::builder("p")
            .algorithm(Algorithm::FixedWindow)
            .tier("t", Quota::new(1, Duration::from_micros(100)))
            .build()
            .unwrap();
        assert!(matches!(validate(&tiny), Err(ConfigError::UnsupportedByStore { .. })));
        let monthly =
            Policy::single("m", Quota::new(1000, Duration::from_secs(30 * 86_400))).unwrap();
        assert_eq!(validate(&monthly), Ok(()));
    }

    #[test]
    fn decode_rebuilds_the_decision_and_the_charges() {
        let p = policy("api", Algorithm::Gcra);
        let reply = [1, 5, -1, 9, 100, -1, 0, 0, 99, 36_000_000_000, -1, 0, 0];
        let (d, charges) = decode(&p, 1, 7_000_000_009, &reply).unwrap();
        assert_eq!(d.outcome(), Outcome::Allowed);
        assert_eq!(d.delay(), Duration::from_nanos(5));
        assert_eq!(d.tiers()[1].remaining(), 99);
        assert_eq!(d.tiers()[1].reset_after(), Duration::from_secs(36));
        assert_eq!(charges.unwrap()[0], Charge { at: 7_000_000_014, cost: 1, id: 0 });
        let limited = [0, 0, 50, 0, 100, 50, 1, 0, 99, 1, -1, 0, 0];
        let (d, charges) = decode(&p, 1, 0, &limited).unwrap();
        assert_eq!(d.retry_after(), Some(Duration::from_nanos(50)));
        assert_eq!(d.violated_names(&p).collect::<Vec<_>>(), ["a"]);
        assert!(charges.is_none());
        assert!(decode(&p, 1, 0, &reply[..10]).is_err());
        assert!(decode(&p, 1, 0, &[3; 13]).is_err());
    }
}
