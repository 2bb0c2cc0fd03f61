//! Refusals answered by this process: a key Redis refused until an instant is refused here,
//! with the decision Redis would give, until that instant or until something this process
//! sees could make the refusal false.
//!
//! A refusal stays true while time passes: other nodes can only spend more of the key. What
//! may change before the refusal's end is the rest of the decision (a tier's `remaining` grows
//! as a bucket drains, a window ends), so an entry is kept only until the first instant any
//! part of it could change, computed per tier from the tier's kind and algorithm:
//!
//! - a refused tier: until its own `retry_after`;
//! - a fixed window or calendar tier: until its current window ends, when its count starts
//!   over (a full tier is stable for ever);
//! - a GCRA tier: until the instant its `remaining` could grow by one (from its `reset_after`,
//!   rounded down a unit);
//! - any other tier that is not full (buckets, sliding windows and logs): not cached, since
//!   their `remaining` grows at instants the decision does not tell.
//!
//! Until then every duration of the decision counts down from the instant Redis decided, and
//! every count stays, which is what the scripts decide at each instant of that span (a
//! differential test replays random traces with and without this cache).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use crate::algorithm::calendar;
use crate::algorithm::compiled::Kind;
use crate::clock::duration_to_nanos;
use crate::decision::{Decision, NONE, Outcome};
use crate::key::Key;
use crate::policy::Policy;
use crate::quota::{Algorithm, Priority};

use super::Check;

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// Stripes of keys counting their give-backs ([`Refusals::epoch`]).
const STRIPES: usize = 256;

/// Shards of a binding's map, so that checks on many cores lock different mutexes.
const SHARDS: usize = 16;

/// The parameters of a check that its decision depends on besides the key and the instant.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Asked {
    costs: SmallVec<[u64; 4]>,
    max_delay: Option<Duration>,
    priority: Priority,
}

impl Asked {
    fn of(policy: &Policy, check: &Check<'_>) -> Self {
        Self {
            costs: (0..policy.tiers().len())
                .map(|i| policy.tier_cost(i, check.cost, check.costs))
                .collect(),
            max_delay: check.max_delay,
            priority: check.priority,
        }
    }
}

/// One refusal: the decision Redis made at `decided` (nanoseconds, on the clock the scripts
/// decide with), valid for checks asking the same while `now < until`.
#[derive(Debug, Clone)]
struct Entry {
    key: Key,
    asked: Asked,
    decision: Decision,
    decided: u64,
    until: u64,
    /// Without an injected clock: this process's monotonic instant at which the check was
    /// sent, no later than the server's `decided` (see [`Refusals::now`]).
    sent: Option<Instant>,
}

#[derive(Default)]
struct Shard {
    /// By the key's hash ([`Refusals::hash`], already random: used as is); the entry holds
    /// the key.
    map: Mutex<HashMap<u64, Entry, BuildHasherDefault<Ready>>>,
    /// Entries in `map`, read without the lock so that a binding with no refusal costs a
    /// check one atomic load.
    len: AtomicUsize,
}

/// A hasher for keys that are already hashes.
#[derive(Default)]
struct Ready(u64);

impl Hasher for Ready {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// A binding's refusals, at most `capacity` entries (spread over [`SHARDS`] shards; a full
/// shard evicts an ended entry, or a random one).
pub(crate) struct Refusals {
    shards: Box<[Shard]>,
    per_shard: usize,
    hasher: ahash::RandomState,
    /// Checks answered here.
    answered: AtomicU64,
    /// The latest instant Redis decided a check of this binding at (or a settlement, with an
    /// injected clock: see [`forget`](Self::forget)).
    latest: AtomicU64,
    /// Give-backs begun or ended, per stripe of keys ([`STRIPES`]): a refusal is kept only if
    /// none began or ended on its stripe while its check was in flight.
    gives: Box<[AtomicU64]>,
}

impl std::fmt::Debug for Refusals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Refusals").field("capacity", &(self.per_shard * SHARDS)).finish()
    }
}

impl Refusals {
    /// A map of `capacity` entries for `policy`, or `None` when `capacity` is 0 or the policy
    /// has tiers whose refusals may end before their `retry_after`: concurrency tiers (a slot
    /// released on another node frees the key early) and penalty boxes (a refusal outside a
    /// block counts as a breach in Redis, which a local answer would not count).
    pub(crate) fn new(policy: &Policy, capacity: usize) -> Option<Self> {
        if capacity == 0 || policy.has_concurrency() || policy.has_penalty() {
            return None;
        }
        let per_shard = capacity.div_ceil(SHARDS);
        Some(Self {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            per_shard,
            hasher: ahash::RandomState::with_seeds(
                fastrand::u64(..),
                fastrand::u64(..),
                fastrand::u64(..),
                fastrand::u64(..),
            ),
            answered: AtomicU64::new(0),
            latest: AtomicU64::new(0),
            gives: (0..STRIPES).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// What the entry of `key` is found by (and what a ticket keeps, to forget it).
    pub(crate) fn hash(&self, key: &Key) -> u64 {
        self.hasher.hash_one(key)
    }

    fn stripe(&self, hash: u64) -> &AtomicU64 {
        #[allow(clippy::cast_possible_truncation)]
        &self.gives[((hash >> 32) % STRIPES as u64) as usize]
    }

    /// Read before a check is sent and handed to [`learn`](Self::learn): a refund of the key
    /// sent before the check may be applied after it, making its refusal false by the time
    /// its answer comes back.
    pub(crate) fn epoch(&self, key: &Key) -> u64 {
        self.stripe(self.hash(key)).load(Ordering::Acquire)
    }

    fn shard(&self, hash: u64) -> &Shard {
        #[allow(clippy::cast_possible_truncation)]
        &self.shards[(hash % SHARDS as u64) as usize]
    }

    /// The instant now on the clock the entry was decided on: the injected clock's `now`, or
    /// the server's instant estimated as `decided` plus the time since the check was sent.
    /// The server decided after the check was sent, so the estimate is never earlier than the
    /// server's clock (barring drift between the clocks): an entry may end a little early,
    /// never late.
    fn now(entry: &Entry, clock_now: Option<u64>) -> u64 {
        match (clock_now, entry.sent) {
            (Some(now), _) => now,
            (None, Some(sent)) => entry.decided.saturating_add(duration_to_nanos(sent.elapsed())),
            (None, None) => u64::MAX,
        }
    }

    /// The decision for `check` if this binding holds a refusal of its key, asking the same,
    /// that is still valid now.
    pub(crate) fn answer(
        &self,
        policy: &Policy,
        check: &Check<'_>,
        clock_now: Option<u64>,
    ) -> Option<Decision> {
        let hash = self.hash(check.key);
        let shard = self.shard(hash);
        if shard.len.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let mut map = shard.map.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = map.get(&hash)?;
        let now = Self::now(entry, clock_now);
        if now >= entry.until || now < entry.decided {
            // Ended, or the injected clock stepped back: ask Redis (which replaces it).
            map.remove(&hash);
            shard.len.store(map.len(), Ordering::Relaxed);
            return None;
        }
        if entry.key != *check.key || entry.asked != Asked::of(policy, check) {
            return None;
        }
        let decision = counted_down(&entry.decision, now - entry.decided);
        drop(map);
        self.answered.fetch_add(1, Ordering::Relaxed);
        Some(decision)
    }

    /// Records what Redis decided for `check` at `decided`: a refusal that can be kept
    /// replaces the key's entry; anything else removes it (a decision made since is newer).
    pub(crate) fn learn(
        &self,
        policy: &Policy,
        check: &Check<'_>,
        decision: &Decision,
        decided: u64,
        sent: Option<Instant>,
        epoch: u64,
    ) {
        let hash = self.hash(check.key);
        let asked = Asked::of(policy, check);
        // With an injected clock every instance shares one time base, so a decision made
        // before one already seen means that the clock stepped back: Redis then decides window
        // and log tiers at a key's last charge, which may be later than `decided`, and its
        // decision does not count down until the clock gets there.
        let behind = sent.is_none() && self.latest.fetch_max(decided, Ordering::Relaxed) > decided;
        // A critical request on a tier with a line (see `algorithm::line`) may be admitted
        // again when the lower classes' schedule leaves, an instant its decision does not
        // tell: its refusals are not kept.
        let lined = asked.priority == Priority::Critical
            && (0..policy.tiers().len()).any(|i| policy.line_reserve(i).is_some());
        let kept = if behind || lined {
            None
        } else {
            stable_for(policy, &asked.costs, decision, decided)
        };
        let Some(span) = kept else {
            // Only an admission changes the key (a refusal charges nothing): refusals in
            // flight meanwhile are not kept, and one held is dropped unless Redis decided it
            // after this (later, or at this instant for the same request, which cannot have
            // been refused before it was admitted).
            if decision.outcome == Outcome::Allowed {
                self.stripe(hash).fetch_add(1, Ordering::AcqRel);
                self.drop_entry(hash, |e| {
                    behind || e.decided < decided || (e.decided == decided && e.asked != asked)
                });
            }
            return;
        };
        let shard = self.shard(hash);
        let entry = Entry {
            key: check.key.clone(),
            asked,
            decision: decision.clone(),
            decided,
            until: decided.saturating_add(span),
            sent,
        };
        let mut map = shard.map.lock().unwrap_or_else(PoisonError::into_inner);
        // Under the lock, which `forget` takes after counting: a give-back (or an admission)
        // that began or ended since the check was sent either shows here or removes the
        // entry after.
        if self.stripe(hash).load(Ordering::Acquire) != epoch {
            return;
        }
        if map.get(&hash).is_some_and(|e| e.decided > decided) {
            // A later refusal of the key is already held.
            return;
        }
        if map.len() >= self.per_shard && !map.contains_key(&hash) {
            // An entry that ended before this decision, or else any: a flood of distinct
            // refused keys replaces entries, it never grows the map.
            let evict = map
                .iter()
                .find(|(_, e)| e.until <= decided)
                .map(|(k, _)| *k)
                .or_else(|| map.keys().nth(fastrand::usize(..map.len())).copied());
            if let Some(k) = evict {
                map.remove(&k);
            }
        }
        map.insert(hash, entry);
        shard.len.store(map.len(), Ordering::Relaxed);
    }

    /// Forgets the refusal of the key of `hash` ([`hash`](Self::hash)): a refund, a
    /// settlement, a release or a lease's give-back through this process could make it false.
    /// Called when a give-back begins and again when it ends, so that no check in flight
    /// meanwhile keeps a refusal.
    ///
    /// `now`, the injected clock's instant, counts as one Redis decided at (see `latest`):
    /// a settlement of units moves the key's clock guard to its instant, and Redis decides
    /// the key's window and log tiers at the later of now and that guard, so after the clock
    /// steps back behind it a refusal counts down only once the clock gets there, and is not
    /// kept (as for a check decided before one already seen).
    pub(crate) fn forget(&self, hash: u64, now: Option<u64>) {
        if let Some(now) = now {
            self.latest.fetch_max(now, Ordering::Relaxed);
        }
        self.stripe(hash).fetch_add(1, Ordering::AcqRel);
        let shard = self.shard(hash);
        let mut map = shard.map.lock().unwrap_or_else(PoisonError::into_inner);
        map.remove(&hash);
        shard.len.store(map.len(), Ordering::Relaxed);
    }

    /// Drops the entry of `hash` if `stale` says so.
    fn drop_entry(&self, hash: u64, stale: impl FnOnce(&Entry) -> bool) {
        let shard = self.shard(hash);
        if shard.len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut map = shard.map.lock().unwrap_or_else(PoisonError::into_inner);
        if map.get(&hash).is_some_and(stale) {
            map.remove(&hash);
            shard.len.store(map.len(), Ordering::Relaxed);
        }
    }

    /// Checks answered here so far.
    pub(crate) fn answered(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }

    /// Entries held now (ended ones included until they are looked up or evicted).
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.len.load(Ordering::Relaxed)).sum()
    }
}

/// `d` made `elapsed` nanoseconds later: every duration counts down (one that reaches 0 stays
/// there), the counts stay.
fn counted_down(d: &Decision, elapsed: u64) -> Decision {
    let down = |n: u64| if n == NONE { NONE } else { n.saturating_sub(elapsed) };
    let mut d = d.clone();
    d.retry_after = down(d.retry_after);
    for t in &mut d.tiers {
        t.reset_after = down(t.reset_after);
        t.retry_after = down(t.retry_after);
    }
    d
}

/// For how long after `decided` (nanoseconds) a refusal decided then stays the decision of
/// the same check, each tier's part only counting down; `None` when it is not kept at all.
/// The end is where the scripts' decision, made in the policy's unit, first differs: the
/// durations reported in nanoseconds count down to the ends of units, so spans here end at
/// the end of a unit too.
fn stable_for(policy: &Policy, costs: &[u64], d: &Decision, decided: u64) -> Option<u64> {
    if d.outcome != Outcome::Limited || d.retry_after == NONE || d.retry_after == 0 {
        return None;
    }
    let unit = policy.unit();
    let at = decided / unit;
    let mut span = d.retry_after;
    for ((tier, t), cost) in policy.tiers().iter().zip(&d.tiers).zip(costs) {
        if t.violated {
            if t.retry_after == NONE {
                return None;
            }
            span = span.min(t.retry_after);
        }
        let full = t.remaining >= t.limit() && t.reset_after == 0;
        if full {
            continue;
        }
        // A window's count stays until the window ends (its `reset_after` may be later, when
        // shaping reserved units in a later window).
        let window_end = match &tier.kind {
            Kind::Calendar(spec) => {
                let end = calendar::window_at(spec, decided).1;
                Some(u64::try_from(end).unwrap_or(0).saturating_mul(NANOS_PER_SEC))
            }
            Kind::Rate if policy.algorithm() == Algorithm::FixedWindow => {
                let period = tier.rate.period;
                Some((at / period).saturating_add(1).saturating_mul(period).saturating_mul(unit))
            }
            Kind::Rate => None,
            Kind::Concurrency(_) => return None,
        };
        if let Some(end) = window_end {
            span = span.min(end.saturating_sub(decided));
            continue;
        }
        // A cost-1 refusal with nothing left stays at 0 until the tier admits one, which is
        // its own `retry_after`, counted above.
        if t.violated && t.remaining == 0 && *cost == 1 {
            continue;
        }
        if tier.kind == Kind::Rate && policy.algorithm() == Algorithm::Gcra {
            // The backlog `b` (scaled by `count`) is in ((R - 1) * count, R * count] for a
            // reset of R units; `remaining` grows once `b` falls to (burst - remaining - 1)
            // periods, not before R - 1 - ceil((burst - remaining - 1) * period / count) units.
            let r = tier.rate;
            let reset_units = (decided.saturating_add(t.reset_after) / unit).saturating_sub(at);
            let left = r.burst.saturating_sub(t.remaining).saturating_sub(1);
            let drain = u128::from(left) * u128::from(r.period);
            let drain = u64::try_from(drain.div_ceil(u128::from(r.count))).unwrap_or(u64::MAX);
            let units = reset_units.saturating_sub(1).saturating_sub(drain);
            if units == 0 {
                return None;
            }
            let end = at.saturating_add(units).saturating_mul(unit);
            span = span.min(end.saturating_sub(decided));
            continue;
        }
        return None;
    }
    (span > 0).then_some(span)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::{TierDecision, Tiers};
    use crate::{Concurrency, Penalty, Quota};

    const S: u64 = 1_000_000_000;

    fn refused(retry: u64, tiers: &[(u64, u64, u64, Option<u64>)]) -> Decision {
        let tiers: Tiers = tiers
            .iter()
            .map(|&(limit, remaining, reset, r)| {
                TierDecision::new(limit, remaining, reset, r, r.is_some())
            })
            .collect();
        Decision::new(Outcome::Limited, 0, Some(retry), tiers)
    }

    #[test]
    fn a_refusal_is_kept_until_any_part_of_it_could_change() {
        // GCRA, 2 per second and 100 per hour: refused by the second until 0.5 s; the hour
        // tier has 98 left with 72 s of backlog (36 s per unit): its `remaining` grows at
        // 36 s, after the refusal ends.
        let p = Policy::builder("p")
            .tier("second", Quota::per_second(2))
            .tier("hour", Quota::per_hour(100))
            .build()
            .unwrap();
        let d = refused(S / 2, &[(2, 0, S, Some(S / 2)), (100, 98, 72 * S, None)]);
        assert_eq!(stable_for(&p, &[1, 1], &d, 10 * S), Some(S / 2));
        // The hour tier's next unit comes back in under 0.5 s: kept until just before.
        let d = refused(S / 2, &[(2, 0, S, Some(S / 2)), (100, 98, 36 * S + S / 4, None)]);
        assert_eq!(stable_for(&p, &[1, 1], &d, 10 * S), Some(S / 4 - 1));
        // A token bucket's `remaining` grows at instants the decision does not tell.
        let tb = Policy::builder("tb")
            .algorithm(Algorithm::TokenBucket)
            .tier("second", Quota::per_second(2))
            .tier("hour", Quota::per_hour(100))
            .build()
            .unwrap();
        assert_eq!(stable_for(&tb, &[1, 1], &d, 10 * S), None);
        // ... unless it is full, or refuses a cost of 1 with nothing left.
        let full = refused(S / 2, &[(2, 0, S, Some(S / 2)), (100, 100, 0, None)]);
        assert_eq!(stable_for(&tb, &[1, 1], &full, 10 * S), Some(S / 2));
        assert_eq!(stable_for(&tb, &[2, 2], &full, 10 * S), None);
        // A fixed window: until its window ends (at 11 s), whatever its `reset_after` says.
        let fw = Policy::builder("fw")
            .algorithm(Algorithm::FixedWindow)
            .tier("minute", Quota::per_minute(5))
            .tier("second", Quota::per_second(3))
            .build()
            .unwrap();
        let d = refused(50 * S, &[(5, 0, 50 * S, Some(50 * S)), (3, 2, 2 * S, None)]);
        assert_eq!(stable_for(&fw, &[1, 1], &d, 10 * S + S / 4), Some(3 * S / 4));
        // Admitted, or a cost above capacity: nothing to keep.
        let mut admitted = d.clone();
        admitted.outcome = Outcome::Allowed;
        assert_eq!(stable_for(&fw, &[1, 1], &admitted, 0), None);
    }

    #[test]
    fn concurrency_and_penalty_policies_keep_no_refusal() {
        let slots = Policy::builder("c")
            .tier("second", Quota::per_second(2))
            .concurrency("slots", Concurrency::new(2))
            .build()
            .unwrap();
        assert!(Refusals::new(&slots, 64).is_none());
        let boxed = Policy::builder("b")
            .tier("second", Quota::per_second(2))
            .penalty("second", Penalty::new(Duration::from_secs(60)))
            .build()
            .unwrap();
        assert!(Refusals::new(&boxed, 64).is_none());
        let plain = Policy::single("p", Quota::per_second(2)).unwrap();
        assert!(Refusals::new(&plain, 0).is_none());
    }

    #[test]
    fn answers_count_down_and_give_backs_in_flight_keep_nothing() {
        let p = Policy::single("p", Quota::per_second(2)).unwrap();
        let r = Refusals::new(&p, 64).unwrap();
        let key = Key::text("k");
        let check = Check::new(&key, 1);
        let d = refused(S / 2, &[(2, 0, S, Some(S / 2))]);
        r.learn(&p, &check, &d, 10 * S, None, r.epoch(&key));
        let a = r.answer(&p, &check, Some(10 * S + S / 8)).unwrap();
        assert_eq!(a.retry_after(), Some(Duration::from_nanos(3 * S / 8)));
        assert_eq!(a.tiers()[0].reset_after(), Duration::from_nanos(7 * S / 8));
        assert_eq!(a.tiers()[0].retry_after(), Some(Duration::from_nanos(3 * S / 8)));
        assert!(r.answer(&p, &Check::new(&key, 2), Some(10 * S + 1)).is_none());
        assert!(r.answer(&p, &check, Some(10 * S + S / 2)).is_none());
        assert_eq!((r.answered(), r.len()), (1, 0));
        // A give-back begun while the check was in flight: its refusal is not kept.
        let epoch = r.epoch(&key);
        r.forget(r.hash(&key), None);
        r.learn(&p, &check, &d, 11 * S, None, epoch);
        assert_eq!(r.len(), 0);
        // A decision older than one already seen (the clock stepped back): not kept.
        r.learn(&p, &check, &d, 10 * S, None, r.epoch(&key));
        assert_eq!(r.len(), 0);
    }

    #[test]
    fn a_refusal_decided_before_a_settlement_on_the_injected_clock_is_not_kept() {
        let p = Policy::single("p", Quota::per_second(2)).unwrap();
        let r = Refusals::new(&p, 64).unwrap();
        let key = Key::text("k");
        let check = Check::new(&key, 1);
        let d = refused(S / 2, &[(2, 0, S, Some(S / 2))]);
        // A settlement at 20 s, then the clock steps back to 19 s: Redis decides the key at
        // its guard (20 s), so a refusal decided "at 19 s" does not count down from there.
        r.forget(r.hash(&key), Some(20 * S));
        r.learn(&p, &check, &d, 19 * S, None, r.epoch(&key));
        assert_eq!(r.len(), 0);
        // Decided at or after the settlement: kept.
        r.learn(&p, &check, &d, 20 * S, None, r.epoch(&key));
        assert_eq!(r.len(), 1);
        // Without an injected clock a settlement moves nothing (the server's instants are
        // estimated from the time a check was sent).
        let r = Refusals::new(&p, 64).unwrap();
        r.forget(r.hash(&key), None);
        r.learn(&p, &check, &d, 19 * S, None, r.epoch(&key));
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn a_flood_of_keys_never_holds_more_than_the_capacity() {
        let p = Policy::single("p", Quota::per_hour(1)).unwrap();
        let r = Refusals::new(&p, 64).unwrap();
        let d = refused(3600 * S, &[(1, 0, 3600 * S, Some(3600 * S))]);
        for i in 0..10_000u64 {
            let key = Key::text(format!("k{i}"));
            r.learn(&p, &Check::new(&key, 1), &d, S + i, None, r.epoch(&key));
            assert!(r.len() <= 64);
        }
        assert_eq!(r.len(), 64);
    }
}
