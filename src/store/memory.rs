//! The in-memory store: sharded maps behind short-held mutexes, bounded in keys, with idle keys
//! evicted by a background sweeper that stops when the store is dropped.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use super::{Check, Store, Ticket, Verdict};
use crate::algorithm::{Mode, TierState, decide};

use crate::clock::{Clock, MonotonicClock, duration_to_nanos};
use crate::error::StoreError;
use crate::key::Key;
use crate::quota::Policy;

/// Default hard cap on keys held: 1,000,000.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;

/// Default interval of the idle-key sweeper: 10 s.
pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(10);

/// The default store: all state in this process.
///
/// - Safe for any number of tasks and threads: keys are spread over shards, each a `HashMap`
///   behind a `std::sync::Mutex` held only for one decision (never across an `.await`).
/// - All tiers of a request are decided under one lock: all-or-nothing.
/// - Idle keys (whose state equals a fresh one) are removed by a sweeper task that runs every
///   [`MemoryStoreBuilder::sweep_interval`] on the tokio runtime of the first check, holds only
///   a weak reference, and ends when the last clone of the store is dropped. Eviction is
///   lossless: only keys that would decide exactly like new ones are removed.
/// - At most [`MemoryStoreBuilder::max_keys`] keys are held. When full, a new key first makes
///   room by evicting idle keys of its shard (a shard is scanned at most every 100 ms, so a
///   flood of new keys cannot make every request walk it); if none are idle it is decided by
///   **one overflow bucket per policy**, shared by all keys that did not fit. Established keys
///   keep their own state, and an IP flood cannot grow memory nor obtain a fresh bucket per
///   request.
///
/// Policy names are namespaces: two different policies must not share a name in one store.
///
/// Clones share the same state.
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("keys", &self.len())
            .field("max_keys", &self.inner.max_keys)
            .finish_non_exhaustive()
    }
}

type StateMap = HashMap<(Arc<str>, Key), Entry>;

/// How often a full shard may be scanned for idle keys to make room for a new key, in
/// nanoseconds of the store's clock (100 ms). Between scans, new keys of a full shard go to the
/// overflow bucket at once: scanning on every new key would let a flood of new keys make every
/// request cost a walk over the whole shard.
const FULL_RESCAN_NANOS: u64 = 100_000_000;

/// One shard: its keys, and when it may next be scanned for room.
#[derive(Default)]
struct Shard {
    map: StateMap,
    next_scan: u64,
}

/// One key's state, with the policy it was made under (the sweeper needs the rates).
struct Entry {
    policy: Policy,
    states: Vec<TierState>,
}

impl Entry {
    fn new(policy: &Policy, now: u64) -> Self {
        let states = policy
            .tiers()
            .iter()
            .map(|t| TierState::fresh(policy.algorithm(), t.rate, now))
            .collect();
        Self { policy: policy.clone(), states }
    }

    fn is_idle(&self, now: u64) -> bool {
        let alg = self.policy.algorithm();
        self.states.iter().zip(self.policy.tiers()).all(|(s, t)| s.is_idle(alg, t.rate, now))
    }

    /// Decides under `policy`; a key whose policy was reconfigured (same name, other tiers)
    /// starts over under the new one.
    fn decide(
        &mut self,
        policy: &Policy,
        now: u64,
        cost: u64,
        max_delay: Option<Duration>,
    ) -> (crate::Decision, Option<crate::algorithm::Charges>) {
        if !self.policy.same(policy) {
            *self = Self::new(policy, now);
        }
        decide(policy, &mut self.states, now, cost, mode(max_delay))
    }
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
    len: AtomicUsize,
    max_keys: usize,
    sweep_interval: Duration,
    sweeper: AtomicBool,
    /// One shared state per policy for keys that arrive when the store is full.
    overflow: Mutex<HashMap<Arc<str>, Entry>>,
}

/// Configures a [`MemoryStore`].
#[derive(Clone)]
#[must_use]
pub struct MemoryStoreBuilder {
    clock: Arc<dyn Clock>,
    max_keys: usize,
    sweep_interval: Duration,
    shards: usize,
}

impl std::fmt::Debug for MemoryStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStoreBuilder")
            .field("max_keys", &self.max_keys)
            .field("sweep_interval", &self.sweep_interval)
            .field("shards", &self.shards)
            .finish_non_exhaustive()
    }
}

impl MemoryStoreBuilder {
    /// The clock (default [`MonotonicClock`]). Tests inject a
    /// [`FakeClock`](crate::clock::FakeClock).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Hard cap on keys held (default [`DEFAULT_MAX_KEYS`]); at least 1.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys.max(1);
        self
    }

    /// How often the sweeper removes idle keys (default [`DEFAULT_SWEEP_INTERVAL`]).
    pub fn sweep_interval(mut self, every: Duration) -> Self {
        self.sweep_interval = every.max(Duration::from_millis(1));
        self
    }

    /// Number of shards (default: 4 per available core, rounded up to a power of two).
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards.max(1);
        self
    }

    /// Builds the store.
    #[must_use]
    pub fn build(self) -> MemoryStore {
        let shards = self.shards.next_power_of_two();
        MemoryStore {
            inner: Arc::new(Inner {
                shards: (0..shards).map(|_| Mutex::new(Shard::default())).collect(),
                hasher: RandomState::new(),
                clock: self.clock,
                len: AtomicUsize::new(0),
                max_keys: self.max_keys,
                sweep_interval: self.sweep_interval,
                sweeper: AtomicBool::new(false),
                overflow: Mutex::new(HashMap::new()),
            }),
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

/// Locks a mutex, recovering from poisoning: the maps hold plain data that a panicking thread
/// cannot leave half-written (every update is a single assignment after the decision).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl MemoryStore {
    /// A store with the default clock and limits.
    #[must_use]
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Starts configuring a store.
    pub fn builder() -> MemoryStoreBuilder {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        MemoryStoreBuilder {
            clock: Arc::new(MonotonicClock::new()),
            max_keys: DEFAULT_MAX_KEYS,
            sweep_interval: DEFAULT_SWEEP_INTERVAL,
            shards: cores * 4,
        }
    }

    /// Keys currently held (not counting the overflow buckets).
    #[must_use]
    pub fn len(&self) -> usize {
        self.inner.len.load(Ordering::Relaxed)
    }

    /// Whether no key is held.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes every idle key now; returns how many were removed. The sweeper calls this.
    pub fn sweep(&self) -> usize {
        self.inner.sweep()
    }

    /// Decides synchronously (the [`Store::check`] future is this, already complete).
    ///
    /// # Errors
    /// Never fails today; the `Result` matches [`Store::check`].
    pub fn check_now(&self, check: Check<'_>) -> Result<Verdict, StoreError> {
        self.start_sweeper();
        Ok(self.inner.check(check))
    }

    /// Settles synchronously; see [`Store::settle`].
    pub fn settle_now(&self, ticket: &Ticket, cost: u64) {
        self.inner.settle(ticket, cost);
    }

    fn start_sweeper(&self) {
        if self.inner.sweeper.load(Ordering::Relaxed) {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
        if self.inner.sweeper.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak: Weak<Inner> = Arc::downgrade(&self.inner);
        let every = self.inner.sweep_interval;
        handle.spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { break };
                let removed = inner.sweep();
                tracing::trace!(removed, "tollgate: swept idle keys");
            }
        });
    }
}

fn mode(max_delay: Option<Duration>) -> Mode {
    max_delay.map_or(Mode::Police, |d| Mode::Shape(duration_to_nanos(d)))
}

impl Inner {
    fn shard(&self, key: &(Arc<str>, Key)) -> &Mutex<Shard> {
        let h = self.hasher.hash_one(key);
        &self.shards[usize::try_from(h).unwrap_or(0) & (self.shards.len() - 1)]
    }

    fn check(&self, check: Check<'_>) -> Verdict {
        let Check { policy, key, cost, max_delay } = check;
        let now = self.clock.now();
        let map_key = (policy.name_arc(), key.clone());
        let mut shard = lock(self.shard(&map_key));
        let (decision, charges) = match shard.map.get_mut(&map_key) {
            Some(entry) => entry.decide(policy, now, cost, max_delay),
            None => {
                let mut entry = Entry::new(policy, now);
                let out = entry.decide(policy, now, cost, max_delay);
                // A rejected request on a fresh key (cost above capacity) leaves no state.
                if out.1.is_some() {
                    if !self.make_room(&mut shard, now) {
                        drop(shard);
                        return self.check_overflow(policy, key, cost, max_delay, now);
                    }
                    shard.map.insert(map_key, entry);
                    self.len.fetch_add(1, Ordering::Relaxed);
                }
                out
            }
        };
        let ticket = charges.filter(|_| cost > 0).map(|charges| Ticket {
            policy: policy.clone(),
            key: key.clone(),
            cost,
            charges,
            overflow: false,
            fallback: false,
        });
        Verdict { decision, ticket }
    }

    /// Whether a new key may be inserted, evicting idle keys of this shard when full (at most
    /// once per [`FULL_RESCAN_NANOS`]).
    fn make_room(&self, shard: &mut Shard, now: u64) -> bool {
        if self.len.load(Ordering::Relaxed) < self.max_keys {
            return true;
        }
        if now < shard.next_scan {
            return false;
        }
        shard.next_scan = now.saturating_add(FULL_RESCAN_NANOS);
        let before = shard.map.len();
        shard.map.retain(|_, entry| !entry.is_idle(now));
        let removed = before - shard.map.len();
        self.len.fetch_sub(removed, Ordering::Relaxed);
        removed > 0
    }

    fn check_overflow(
        &self,
        policy: &Policy,
        key: &Key,
        cost: u64,
        max_delay: Option<Duration>,
        now: u64,
    ) -> Verdict {
        let mut overflow = lock(&self.overflow);
        let entry = overflow.entry(policy.name_arc()).or_insert_with(|| Entry::new(policy, now));
        let (decision, charges) = entry.decide(policy, now, cost, max_delay);
        tracing::debug!(policy = policy.name(), "tollgate: key cap reached, using overflow bucket");
        let ticket = charges.filter(|_| cost > 0).map(|charges| Ticket {
            policy: policy.clone(),
            key: key.clone(),
            cost,
            charges,
            overflow: true,
            fallback: false,
        });
        Verdict { decision, ticket }
    }

    fn settle(&self, ticket: &Ticket, cost: u64) {
        if cost == ticket.cost {
            return;
        }
        let now = self.clock.now();
        let policy = &ticket.policy;
        let alg = policy.algorithm();
        let apply = |entry: &mut Entry| {
            if !entry.policy.same(policy) {
                return;
            }
            for ((state, tier), charge) in
                entry.states.iter_mut().zip(policy.tiers()).zip(&ticket.charges)
            {
                if cost < ticket.cost {
                    state.refund(alg, tier.rate, *charge, ticket.cost - cost);
                } else {
                    state.charge(alg, tier.rate, now, charge.at.max(now), cost - ticket.cost);
                }
            }
        };
        if ticket.overflow {
            if let Some(entry) = lock(&self.overflow).get_mut(policy.name()) {
                apply(entry);
            }
            return;
        }
        let map_key = (policy.name_arc(), ticket.key.clone());
        let mut shard = lock(self.shard(&map_key));
        if let Some(entry) = shard.map.get_mut(&map_key) {
            apply(entry);
        } else if cost > ticket.cost {
            // Evicted since: the extra is charged to a fresh state.
            let mut entry = Entry::new(policy, now);
            apply(&mut entry);
            shard.map.insert(map_key, entry);
            self.len.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn sweep(&self) -> usize {
        let now = self.clock.now();
        let mut removed = 0;
        for shard in &self.shards {
            let mut shard = lock(shard);
            let before = shard.map.len();
            shard.map.retain(|_, entry| !entry.is_idle(now));
            removed += before - shard.map.len();
        }
        self.len.fetch_sub(removed, Ordering::Relaxed);
        removed
    }
}

impl Store for MemoryStore {
    fn check(
        &self,
        check: Check<'_>,
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send + 'static {
        std::future::ready(self.check_now(check))
    }

    fn settle(
        &self,
        ticket: Ticket,
        cost: u64,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'static {
        self.settle_now(&ticket, cost);
        std::future::ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use super::*;
    use crate::clock::FakeClock;
    use crate::decision::Outcome;
    use crate::quota::Quota;

    fn ip(i: u32) -> Key {
        Key::Ip(IpAddr::V4(Ipv4Addr::from(i)))
    }

    fn check<'a>(policy: &'a Policy, key: &'a Key) -> Check<'a> {
        Check { policy, key, cost: 1, max_delay: None }
    }

    #[test]
    fn full_store_keeps_established_keys_and_shares_one_overflow_bucket() {
        let clock = FakeClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).max_keys(10).shards(4).build();
        let policy = Policy::single("p", Quota::per_hour(2)).unwrap();
        for i in 0..10 {
            assert!(store.check_now(check(&policy, &ip(i))).unwrap().decision.is_allowed());
        }
        assert_eq!(store.len(), 10);
        // 100 new keys: none is held; together they get the overflow bucket's 2 units.
        let admitted = (100..200)
            .filter(|i| store.check_now(check(&policy, &ip(*i))).unwrap().decision.is_allowed())
            .count();
        assert_eq!(admitted, 2);
        assert_eq!(store.len(), 10);
        // Established keys keep their own state: one unit left each.
        assert!(store.check_now(check(&policy, &ip(3))).unwrap().decision.is_allowed());
        assert!(!store.check_now(check(&policy, &ip(3))).unwrap().decision.is_allowed());
    }

    #[test]
    fn a_full_shard_is_scanned_for_room_at_most_every_100_ms() {
        let clock = FakeClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).max_keys(10).shards(1).build();
        let policy = Policy::single("p", Quota::new(1, Duration::from_millis(20))).unwrap();
        let allowed = |i| store.check_now(check(&policy, &ip(i))).unwrap().decision.is_allowed();
        for i in 0..10 {
            assert!(allowed(i));
        }
        // Full and nothing idle: scanned, then key 100 goes to the overflow bucket.
        assert!(allowed(100));
        assert_eq!(store.len(), 10);
        // 50 ms later every key is idle, but the shard was scanned 50 ms ago: overflow again
        // (the overflow bucket is idle too, so key 101 is admitted there, not stored).
        clock.advance(Duration::from_millis(50));
        assert!(allowed(101));
        assert_eq!(store.len(), 10);
        // 100 ms after the last scan, the next new key scans, evicts the ten idle keys and is
        // stored.
        clock.advance(Duration::from_millis(50));
        assert!(allowed(102));
        assert_eq!(store.len(), 1);
    }

    #[test]
    fn sweep_removes_only_idle_keys() {
        let clock = FakeClock::new();
        let store = MemoryStore::builder().clock(clock.clone()).build();
        let fast = Policy::single("fast", Quota::per_second(1)).unwrap();
        let slow = Policy::single("slow", Quota::per_hour(1)).unwrap();
        store.check_now(check(&fast, &ip(1))).unwrap();
        store.check_now(check(&slow, &ip(1))).unwrap();
        assert_eq!(store.sweep(), 0);
        clock.advance(Duration::from_secs(1));
        assert_eq!(store.sweep(), 1, "the 1/s key is back to full, the 1/h key is not");
        assert_eq!(store.len(), 1);
        assert!(!store.check_now(check(&slow, &ip(1))).unwrap().decision.is_allowed());
    }

    #[tokio::test(start_paused = true)]
    async fn sweeper_runs_on_its_interval_and_stops_with_the_store() {
        let store = MemoryStore::builder().sweep_interval(Duration::from_secs(5)).build();
        let policy = Policy::single("p", Quota::per_second(1)).unwrap();
        store.check_now(check(&policy, &ip(1))).unwrap();
        assert_eq!(store.len(), 1);
        tokio::time::sleep(Duration::from_secs(6)).await;
        assert_eq!(store.len(), 0);
        let weak = Arc::downgrade(&store.inner);
        drop(store);
        tokio::time::sleep(Duration::from_secs(11)).await;
        assert!(weak.upgrade().is_none(), "the sweeper holds no strong reference");
    }

    #[test]
    fn threads_never_over_admit() {
        let store = MemoryStore::new();
        let policy = Policy::single("p", Quota::per_hour(1000)).unwrap();
        let admitted = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        if store
                            .check_now(check(&policy, &Key::Global))
                            .unwrap()
                            .decision
                            .is_allowed()
                        {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(admitted.load(Ordering::Relaxed), 1000);
    }

    #[test]
    fn settle_refunds_and_charges_extra() {
        let clock = FakeClock::new();
        let store = MemoryStore::builder().clock(clock).build();
        let policy = Policy::single("p", Quota::per_hour(10)).unwrap();
        let key = ip(7);
        let c = Check { policy: &policy, key: &key, cost: 4, max_delay: None };
        let ticket = store.check_now(c).unwrap().ticket.unwrap();
        store.settle_now(&ticket, 9);
        let d = store.check_now(check(&policy, &key)).unwrap().decision;
        assert_eq!(d.tiers()[0].remaining(), 0);
        let ticket = store.check_now(Check { cost: 0, ..c }).unwrap();
        assert!(ticket.ticket.is_none(), "cost 0 charges nothing");
        let d = store.check_now(check(&policy, &key)).unwrap().decision;
        assert_eq!(d.outcome(), Outcome::Limited);
    }

    #[test]
    fn cost_above_capacity_on_a_new_key_leaves_no_state() {
        let store = MemoryStore::new();
        let policy = Policy::single("p", Quota::per_second(2)).unwrap();
        let c = Check { policy: &policy, key: &Key::Global, cost: 3, max_delay: None };
        let v = store.check_now(c).unwrap();
        assert_eq!(v.decision.outcome(), Outcome::CostExceedsCapacity);
        assert!(store.is_empty());
    }
}
