//! `RedisStore` against real servers the tests start themselves: standalone Redis, a
//! three-master Redis Cluster, and Valkey. Differential traces against `MemoryStore`,
//! concurrency, TTLs, script reloads, restarts and the failure policy.
#![cfg(feature = "redis")]

use crate::support;
use crate::support::penalty as scenarios;
use crate::support::priority as priorities;

use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use support::redis::{Cluster, Server};
use tollgate::clock::FakeClock;
use tollgate::key::{GlobalKey, Key};
use tollgate::store::{
    BreakerState, Check, MemoryStore, MemoryTicket, RedisStore, RedisTicket, Store,
};
use tollgate::{
    Algorithm, Calendar, CalendarPeriod, Concurrency, Decision, Limiter, OnStoreError, Penalty,
    Policy, Priority, Quota, RateLimitLayer, Reservation, Reserve, Source, StoreError, Unit,
};

/// One check of `cost` units for `key` under `policy`, through `store`.
async fn decide(store: &RedisStore, policy: &Policy, key: &Key, cost: u64) -> Decision {
    let limiter = Limiter::with_store(policy.clone(), store.clone()).expect("binds");
    limiter.check(key, cost).await.expect("redis answers")
}

/// The Redis key of `key`'s state under `policy`.
fn state_key(store: &RedisStore, policy: &Policy, key: &Key) -> String {
    store.bind(policy).expect("binds").state_key(key)
}

/// The lease set of concurrency tier `tier` of the key whose state key is `state`: the state
/// key less its `:{fingerprint}` (8 hexadecimal digits), then `:c:{tier}`.
fn lease_set(state: &str, tier: &str) -> String {
    format!("{}:c:{tier}", &state[..state.len() - 9])
}

// ---------------------------------------------------------------------------------------------
// Differential traces: the same random requests through MemoryStore and RedisStore on one
// fake clock must give identical decisions. Policies are request rates (any algorithm), and
// now and then mix in tiers of other kinds: concurrency slots, calendar windows (UTC, Berlin,
// New York; traces start near daylight-saving changes too), rates counting other units.
// Checks then carry a cost per tier, and tickets are settled tier by tier and released.

#[derive(Debug, Clone)]
enum Step {
    /// Moves the clock forward by this many nanoseconds.
    Advance(u64),
    /// Steps the clock back by this many nanoseconds (NTP, a failover to a server whose clock
    /// is behind), to no earlier than the trace's start.
    Back(u64),
    /// A request of `cost` (and `costs` per tier) on key `key`; `shape` is the shaping budget
    /// in nanoseconds.
    Check { key: u8, cost: u64, costs: Vec<u64>, shape: Option<u64> },
    /// Settles the `which`-th ticket still held (modulo their number) at `cost`.
    Settle { which: usize, cost: u64 },
    /// Settles tier `tier` (modulo the tiers) of the `which`-th ticket at `cost`, keeping it.
    SettleTier { which: usize, tier: usize, cost: u64 },
    /// Releases the `which`-th ticket's slots, keeping its charges.
    Release { which: usize },
}

/// A tier of another kind than the trace's rates.
#[derive(Debug, Clone)]
enum Extra {
    /// A concurrency tier of this many slots.
    Slots(u64),
    /// A calendar tier: count, period (minute, hour, day, month), zone (UTC, Berlin, New York).
    Calendar(u64, usize, usize),
    /// A rate (of the trace's algorithm) counting request bytes, response bytes or reported
    /// units: count, period in ns, burst, unit.
    Units(u64, u64, u64, usize),
}

#[derive(Debug, Clone)]
struct Trace {
    algorithm: Algorithm,
    /// `(count, period in ns, burst)` per tier.
    tiers: Vec<(u64, u64, u64)>,
    /// Tiers of other kinds, after those.
    extra: Vec<Extra>,
    /// The clock's first instant, in nanoseconds.
    start: u64,
    steps: Vec<Step>,
    /// A penalty box on a tier: `(tier, block ns, refusals, window ns)`, the tier counted over
    /// the rates then the other kinds (a concurrency tier, which cannot have one, gives it to
    /// the first rate).
    penalty: Option<(usize, u64, u32, u64)>,
    /// Reserves on the first rate tier, in eighths of its capacity: `(critical, standard)`
    /// (each 0 to 3, so at most 6/8 of it; the trace then runs GCRA).
    reserve: Option<(u64, u64)>,
    /// The class of the check at each step (0 critical, 1 standard, 2 sheddable; standard
    /// past the end).
    classes: Vec<u8>,
}

/// Long enough that no lease expires within a trace (in memory slots do not expire).
const TRACE_LEASE: Duration = Duration::from_secs(20 * 365 * 86_400);

/// A trace's tiers, other kinds, first instant and steps, as the strategies draw them.
type TraceParts = (Vec<(u64, u64, u64)>, Vec<Extra>, u64, Vec<Step>);

impl Trace {
    /// A trace without penalty boxes, reserves or classes.
    fn new(algorithm: Algorithm, (tiers, extra, start, steps): TraceParts) -> Self {
        Self {
            algorithm,
            tiers,
            extra,
            start,
            steps,
            penalty: None,
            reserve: None,
            classes: Vec::new(),
        }
    }

    fn policy(&self) -> Policy {
        let mut b = Policy::builder("diff").algorithm(self.algorithm);
        for (i, (count, period, burst)) in self.tiers.iter().enumerate() {
            b = b.tier(
                format!("t{i}"),
                Quota::new(*count, Duration::from_nanos(*period)).with_burst(*burst),
            );
        }
        for (i, extra) in self.extra.iter().enumerate() {
            let name = format!("x{i}");
            b = match *extra {
                Extra::Slots(n) => b.concurrency(name, Concurrency::new(n).with_ttl(TRACE_LEASE)),
                Extra::Calendar(count, period, zone) => {
                    let period = [
                        CalendarPeriod::Minute,
                        CalendarPeriod::Hour,
                        CalendarPeriod::Day,
                        CalendarPeriod::Month,
                    ][period];
                    let zone = ["UTC", "Europe/Berlin", "America/New_York"][zone];
                    b.calendar(name, Calendar::new(count, period).in_time_zone(zone))
                }
                Extra::Units(count, period, burst, unit) => {
                    let unit = [Unit::RequestBytes, Unit::ResponseBytes, Unit::Reported][unit];
                    let q = Quota::new(count, Duration::from_nanos(period)).with_burst(burst);
                    b.tier(name, q.counting(unit))
                }
            };
        }
        if let Some((tier, block, refusals, within)) = self.penalty {
            let tier = tier % (self.tiers.len() + self.extra.len());
            let name = match tier.checked_sub(self.tiers.len()).map(|j| &self.extra[j]) {
                None => format!("t{tier}"),
                Some(Extra::Slots(_)) => "t0".to_owned(),
                Some(_) => format!("x{}", tier - self.tiers.len()),
            };
            let (block, within) = (Duration::from_nanos(block), Duration::from_nanos(within));
            b = b.penalty(name, Penalty::new(block).after(refusals, within));
        }
        if let Some((critical, standard)) = self.reserve {
            let burst = self.tiers[0].2;
            let r = Reserve::new().critical(burst * critical / 8).standard(burst * standard / 8);
            b = b.reserve("t0", r);
        }
        b.build().expect("generated policies are valid")
    }
}

fn tier(algorithm: Algorithm, grid: bool) -> impl Strategy<Value = (u64, u64, u64)> {
    let max_count: u64 = if algorithm == Algorithm::SlidingLog { 12 } else { 30 };
    // Periods from 1 ms to 5 s: most not a multiple of the count (inexact T), some round
    // (multiples of 10 ms) so that instants land exactly on window and expiry edges.
    let round = (1u64..=100).prop_map(|k| k * 10_000_000);
    let period =
        if grid { round.boxed() } else { prop_oneof![1_000_000u64..=5_000_000_000, round].boxed() };
    // Now and then a long horizon, a day to 400 days: such policies decide in microseconds.
    let period = prop_oneof![
        8 => period,
        1 => (1u64..=400 * 86_400_000).prop_map(|ms| ms * 1_000_000),
    ];
    // Half the time a whole-nanosecond emission interval (period = count x T): GCRA policies
    // made only of such tiers run on the Redis store's fast path (`gcra.lua`).
    let whole = prop::bool::weighted(0.5);
    (1u64..=max_count, period, 0u64..=40, whole, 100_000u64..=200_000_000).prop_map(
        move |(c, p, extra, whole, t)| {
            let window = matches!(
                algorithm,
                Algorithm::FixedWindow | Algorithm::SlidingLog | Algorithm::SlidingCounter
            );
            let burst = if window { c } else { 1 + extra % (2 * c + 2) };
            let p = if whole && !window && p < 86_400_000_000_000 { c * t } else { p };
            (c, p, burst)
        },
    )
}

fn extra(algorithm: Algorithm, grid: bool) -> impl Strategy<Value = Extra> {
    prop_oneof![
        (1u64..=4).prop_map(Extra::Slots),
        (1u64..=20, 0usize..4, 0usize..3).prop_map(|(c, p, z)| Extra::Calendar(c, p, z)),
        (tier(algorithm, grid), 0usize..3).prop_map(|((c, p, b), u)| Extra::Units(c, p, b, u)),
    ]
}

/// `grid`: every advance a multiple of 10 ms, like the periods, so that instants land exactly
/// on window and expiry edges. `back`: clock steps both ways between checks, settlements
/// and releases.
fn step(grid: bool, back: bool) -> impl Strategy<Value = Step> {
    let round = (0u64..=100).prop_map(|k| k * 10_000_000);
    let advance = if grid {
        round.boxed()
    } else {
        prop_oneof![
            2 => 0u64..=1_000,
            3 => 0u64..=50_000_000,
            2 => 0u64..=300_000_000,
            1 => 0u64..=6_000_000_000,
            2 => round,
            1 => 0u64..=40 * 86_400_000_000_000,
        ]
        .boxed()
    };
    let cost = || prop_oneof![6 => Just(1u64), 3 => 0u64..=4, 1 => 0u64..=12];
    let check = (
        0u8..3,
        cost(),
        proptest::collection::vec(cost(), 5),
        proptest::option::weighted(0.4, 0u64..=3_000_000_000),
    )
        .prop_map(|(key, cost, costs, shape)| Step::Check { key, cost, costs, shape });
    if back {
        let back = prop_oneof![0u64..=1_000, 0u64..=300_000_000, 0u64..=6_000_000_000];
        return prop_oneof![
            2 => advance.prop_map(Step::Advance),
            2 => back.prop_map(Step::Back),
            7 => check,
            1 => (0usize..64, 0u64..=8).prop_map(|(which, cost)| Step::Settle { which, cost }),
            1 => (0usize..64, 0usize..8, 0u64..=8)
                .prop_map(|(which, tier, cost)| Step::SettleTier { which, tier, cost }),
            1 => (0usize..64).prop_map(|which| Step::Release { which }),
        ]
        .boxed();
    }
    prop_oneof![
        2 => advance.prop_map(Step::Advance),
        7 => check,
        1 => (0usize..64, 0u64..=8).prop_map(|(which, cost)| Step::Settle { which, cost }),
        1 => (0usize..64, 0usize..8, 0u64..=8)
            .prop_map(|(which, tier, cost)| Step::SettleTier { which, tier, cost }),
        1 => (0usize..64).prop_map(|which| Step::Release { which }),
    ]
    .boxed()
}

/// Nanoseconds since the epoch of an RFC 3339 instant.
fn instant(s: &str) -> u64 {
    let ts: jiff::Timestamp = s.parse().unwrap();
    u64::try_from(ts.as_nanosecond()).unwrap()
}

/// `back`: see [`step`].
fn trace(back: bool) -> impl Strategy<Value = Trace> {
    let grid = proptest::bool::weighted(0.35);
    // Near the epoch, or within two hours of a daylight-saving change in Berlin and New York.
    let start = prop_oneof![
        4 => 0u64..=1_000_000_000_000,
        1 => (0u64..=7_200_000_000_000).prop_map(|d| instant("2025-03-30T00:00:00Z") + d),
        1 => (0u64..=7_200_000_000_000).prop_map(|d| instant("2025-10-26T00:00:00Z") + d),
        1 => (0u64..=7_200_000_000_000).prop_map(|d| instant("2025-11-02T05:00:00Z") + d),
    ];
    (proptest::sample::select(Algorithm::ALL.to_vec()), grid).prop_flat_map(
        move |(algorithm, grid)| {
            (
                proptest::collection::vec(tier(algorithm, grid), 1..=3),
                prop_oneof![
                    3 => Just(Vec::new()),
                    2 => proptest::collection::vec(extra(algorithm, grid), 1..=2),
                ],
                start.clone(),
                proptest::collection::vec(step(grid, back), 1..=60),
            )
                .prop_map(move |parts| Trace::new(algorithm, parts))
        },
    )
}

fn keys() -> [Key; 3] {
    [Key::text("alice"), Key::Ip("203.0.113.7".parse().unwrap()), Key::Global]
}

/// Replays `trace` through both stores, calling them directly (a store's own decisions, no
/// waiting for slots); the first difference is the error. Returns how many checks the Redis
/// store answered from its local refusals.
async fn replay(store: RedisStore, clock: FakeClock, trace: &Trace) -> Result<u64, String> {
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let policy = trace.policy();
    let memory = Limiter::with_store(policy.clone(), memory).unwrap();
    let store = Limiter::with_store(policy.clone(), store).unwrap();
    let (m_store, m_bound) = (memory.store(), memory.bound());
    let (r_store, r_bound) = (store.store(), store.bound());
    let keys = keys();
    let mut tickets: Vec<(MemoryTicket, RedisTicket)> = Vec::new();
    for (i, step) in trace.steps.iter().enumerate() {
        let redis_error = |e: StoreError| format!("step {i} ({step:?}): {e}");
        match step {
            Step::Advance(by) => clock.advance(Duration::from_nanos(*by)),
            Step::Back(by) => clock.set(clock_now(&clock).saturating_sub(*by).max(trace.start)),
            Step::Check { key, cost, costs, shape } => {
                let key = &keys[usize::from(*key)];
                let class = match trace.classes.get(i) {
                    Some(0) => Priority::Critical,
                    Some(2) => Priority::Sheddable,
                    _ => Priority::Standard,
                };
                let mut check =
                    Check::new(key, *cost).with_costs(costs).with_ticket().with_priority(class);
                if let Some(max) = shape {
                    check = check.shape(Duration::from_nanos(*max));
                }
                let m = m_store.check(m_bound, check).await.map_err(|e| e.to_string())?;
                let r = r_store.check(r_bound, check).await.map_err(redis_error)?;
                if m.decision != r.decision || m.ticket.is_some() != r.ticket.is_some() {
                    return Err(format!(
                        "step {i} ({step:?}) at {} ns differs:\nmemory: {:?} {:?}\nredis:  {:?} {:?}",
                        clock_now(&clock),
                        m.decision,
                        m.ticket.is_some(),
                        r.decision,
                        r.ticket.is_some(),
                    ));
                }
                if let (Some(a), Some(b)) = (m.ticket, r.ticket) {
                    tickets.push((a, b));
                }
            }
            Step::Settle { which, cost } => {
                if tickets.is_empty() {
                    continue;
                }
                let (a, b) = tickets.remove(which % tickets.len());
                m_store.settle(m_bound, a, *cost).await.map_err(|e| e.to_string())?;
                r_store.settle(r_bound, b, *cost).await.map_err(redis_error)?;
            }
            Step::SettleTier { which, tier, cost } => {
                if tickets.is_empty() {
                    continue;
                }
                let n = tickets.len();
                let (a, b) = &mut tickets[which % n];
                let costs = [(tier % policy.tiers().len(), *cost)];
                m_store.settle_tiers(m_bound, a, &costs).await.map_err(|e| e.to_string())?;
                r_store.settle_tiers(r_bound, b, &costs).await.map_err(redis_error)?;
            }
            Step::Release { which } => {
                if tickets.is_empty() {
                    continue;
                }
                let (a, b) = tickets.remove(which % tickets.len());
                m_store.release(m_bound, a).await.map_err(|e| e.to_string())?;
                r_store.release(r_bound, b).await.map_err(redis_error)?;
            }
        }
    }
    // What is still held is released, and both agree after.
    for (a, b) in tickets {
        m_store.release(m_bound, a).await.map_err(|e| e.to_string())?;
        r_store.release(r_bound, b).await.map_err(|e| e.to_string())?;
    }
    for key in &keys {
        let check = Check::new(key, 0);
        let m = m_store.check(m_bound, check).await.map_err(|e| e.to_string())?;
        let r = r_store.check(r_bound, check).await.map_err(|e| e.to_string())?;
        if m.decision != r.decision {
            return Err(format!(
                "after the releases, {key}:\nmemory: {:?}\nredis:  {:?}",
                m.decision, r.decision
            ));
        }
    }
    Ok(r_bound.refused_locally())
}

fn clock_now(clock: &FakeClock) -> u64 {
    use tollgate::clock::Clock;
    clock.now()
}

/// Runs `cases` random traces against the store that `connect` builds for a clock and a
/// per-case key prefix.
fn differential(cases: u32, connect: impl Fn(FakeClock, String) -> RedisStore) {
    differential_of(trace(false), cases, connect);
}

/// The seeds of the traces [`differential_of`] runs in CI, half of its cases each.
const DIFFERENTIAL_SEEDS: [u8; 2] = [0x3c, 0xd1];

/// [`differential`] of `traces`: in CI the same `cases` traces on every run (from
/// [`DIFFERENTIAL_SEEDS`]); under `TOLLGATE_LONG_TESTS=1` ten times as many, drawn at random.
/// Returns how many checks were answered from local refusals.
fn differential_of(
    traces: impl Strategy<Value = Trace> + 'static,
    cases: u32,
    connect: impl Fn(FakeClock, String) -> RedisStore,
) -> u64 {
    let traces = traces.boxed();
    if std::env::var("TOLLGATE_LONG_TESTS").is_ok_and(|v| v == "1") {
        let config = Config { cases: cases * 10, failure_persistence: None, ..Config::default() };
        return differential_in(TestRunner::new(config), traces, connect);
    }
    let per_seed = cases.div_ceil(2);
    DIFFERENTIAL_SEEDS
        .iter()
        .map(|&seed| {
            seeded_differential(traces.clone(), seed, per_seed, |clock, prefix| {
                connect(clock, format!("s{seed:x}{prefix}"))
            })
        })
        .sum()
}

/// [`differential_of`] from a fixed seed (`seed` in each of the RNG's 32 bytes): the same
/// traces on every run.
fn seeded_differential(
    traces: impl Strategy<Value = Trace>,
    seed: u8,
    cases: u32,
    connect: impl Fn(FakeClock, String) -> RedisStore,
) -> u64 {
    use proptest::test_runner::{RngAlgorithm, TestRng};
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]);
    let config = Config { cases, failure_persistence: None, ..Config::default() };
    differential_in(TestRunner::new_with_rng(config, rng), traces, connect)
}

/// Replays the traces `runner` draws through both stores (see [`replay`]): panics at the first
/// difference; returns how many checks the Redis stores answered from their local refusals.
fn differential_in(
    mut runner: TestRunner,
    traces: impl Strategy<Value = Trace>,
    connect: impl Fn(FakeClock, String) -> RedisStore,
) -> u64 {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let case = std::sync::atomic::AtomicU64::new(0);
    let local = std::sync::atomic::AtomicU64::new(0);
    let result = runner.run(&traces, |trace| {
        let n = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let clock = FakeClock::new();
        clock.set(trace.start);
        let store = connect(clock.clone(), format!("diff{n}:"));
        let answered = rt.block_on(replay(store, clock, &trace)).map_err(TestCaseError::fail)?;
        local.fetch_add(answered, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    local.into_inner()
}

/// Replays a kept `trace` as [`differential_in`] replays a drawn one (the clock at its start).
fn replay_kept(server: &Server, trace: &Trace) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let clock = FakeClock::new();
    clock.set(trace.start);
    let store = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "kept:".into());
    rt.block_on(replay(store, clock, trace)).unwrap();
}

fn fake_clock_store(
    builder: tollgate::store::RedisStoreBuilder,
    clock: FakeClock,
    prefix: String,
) -> RedisStore {
    builder
        .clock(clock)
        .prefix(prefix)
        // The fake clock stands still in real time: keep keys for the whole test.
        .ttl_grace(Duration::from_secs(3600))
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

#[test]
fn standalone_decides_exactly_like_memory_store() {
    let Some(server) = Server::start("redis-server") else { return };
    let url = server.url();
    differential(256, |clock, prefix| fake_clock_store(RedisStore::builder(&url), clock, prefix));
}

/// Clock steps back (NTP, a failover to a server whose clock is behind) between checks,
/// settlements and releases: a key decides at the later of now and its last charge (or
/// settlement of units) on both stores, so they answer alike.
#[test]
fn a_clock_stepping_back_decides_exactly_like_memory_store() {
    let Some(server) = Server::start("redis-server") else { return };
    let url = server.url();
    differential_of(trace(true), 256, |clock, prefix| {
        fake_clock_store(RedisStore::builder(&url), clock, prefix)
    });
}

/// A trace the test above once drew (about 1 in 40 runs), kept: a sliding log of one request
/// per 2,028,818 ns settled up to 2 a nanosecond after its charge, the clock stepped back that
/// nanosecond, three shaped checks queued behind the entries, then policed checks.
#[test]
fn a_settled_up_log_after_the_clock_steps_back_decides_exactly_like_memory_store() {
    let Some(server) = Server::start("redis-server") else { return };
    let w = 2_028_818;
    let check = |shape: Option<u64>| Step::Check { key: 2, cost: 1, costs: vec![1; 5], shape };
    let steps = vec![
        check(None),
        Step::Advance(1),
        Step::Settle { which: 0, cost: 2 },
        Step::Back(1),
        check(Some(w)),
        check(Some(2 * w)),
        check(Some(3 * w)),
        check(None),
        Step::Advance(1),
        check(None),
    ];
    let trace = Trace::new(Algorithm::SlidingLog, (vec![(1, w, 1)], vec![], 0, steps));
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let clock = FakeClock::new();
    let store = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "log:".into());
    rt.block_on(replay(store, clock, &trace)).unwrap();
}

/// A trace the clock-step test drew (about 1 in 10 runs), kept: two GCRA tiers, a check
/// shaped behind the first, the first check's second tier settled up, its first refunded (the
/// key idle: Redis deletes it), the whole check settled to its charge (Redis writes the key
/// afresh), then the clock stepped back: a fresh tier's TAT is in the past on both stores.
#[test]
fn a_settlement_per_tier_then_a_step_back_decides_exactly_like_memory_store() {
    let Some(server) = Server::start("redis-server") else { return };
    let check = |shape: Option<u64>| Step::Check { key: 0, cost: 1, costs: vec![1; 5], shape };
    let steps = vec![
        check(None),
        check(Some(1_000_000)),
        Step::SettleTier { which: 0, tier: 1, cost: 2 },
        Step::Advance(1_200_000),
        Step::SettleTier { which: 0, tier: 0, cost: 0 },
        Step::Settle { which: 0, cost: 1 },
        Step::Back(100_001),
    ];
    let trace = Trace::new(
        Algorithm::Gcra,
        (vec![(1, 1_000_000, 1), (10, 1_000_000, 1)], vec![], 0, steps),
    );
    replay_kept(&server, &trace);
}

/// Another trace the clock-step test drew, kept: a fractional emission interval (9 per
/// millisecond) beside a whole one, a refund that leaves the key idle, one tier settled up.
#[test]
fn a_fresh_tier_beside_a_settled_one_decides_exactly_like_memory_store() {
    let Some(server) = Server::start("redis-server") else { return };
    let check = |cost: u64| Step::Check { key: 0, cost, costs: vec![1; 5], shape: None };
    let steps = vec![
        check(1),
        check(1),
        check(6),
        Step::Advance(888_889),
        check(1),
        check(1),
        Step::Settle { which: 2, cost: 0 },
        Step::SettleTier { which: 0, tier: 0, cost: 2 },
        Step::Back(1),
    ];
    let trace = Trace::new(
        Algorithm::Gcra,
        (vec![(9, 1_000_000, 9), (10, 1_000_000, 9)], vec![], 0, steps),
    );
    replay_kept(&server, &trace);
}

/// A trace the clock-step test drew (about 1 in 20 runs), kept, and its leaky-bucket twin: a
/// tier refunded to idle (Redis deletes the key), then settled up again (Redis writes the other
/// tier fresh), then the clock stepped back a nanosecond: a fresh bucket is full (empty) far in
/// the past on both stores, never as of now, which would project backwards.
#[test]
fn a_fresh_bucket_beside_a_settled_one_decides_exactly_like_memory_store() {
    let Some(server) = Server::start("redis-server") else { return };
    let check = Step::Check { key: 0, cost: 1, costs: vec![1; 5], shape: None };
    let steps = vec![
        check,
        Step::Advance(10_000_000),
        Step::SettleTier { which: 0, tier: 0, cost: 0 },
        Step::SettleTier { which: 0, tier: 0, cost: 1 },
        Step::Back(1),
    ];
    for algorithm in [Algorithm::LeakyBucket, Algorithm::TokenBucket] {
        let tiers = vec![(1, 10_000_000, 2), (3, 10_000_000, 1)];
        replay_kept(&server, &Trace::new(algorithm, (tiers, vec![], 0, steps.clone())));
    }
}

/// A calendar key charged, then the clock stepped back two hours (past the 60 s the calendar
/// windows sent reach either side of now): a shaped check, settlements up and down and policed
/// checks are decided at the key's last charge on both stores, the Redis calls sent again with
/// windows reaching it (they once failed: "the calendar windows sent do not cover").
#[test]
fn a_calendar_key_two_hours_ahead_of_the_clock_decides_exactly_like_memory_store() {
    let Some(server) = Server::start("redis-server") else { return };
    let check = |shape: Option<u64>| Step::Check { key: 0, cost: 1, costs: vec![1; 5], shape };
    let hour = 3_600_000_000_000;
    let steps = vec![
        check(None),
        Step::Advance(hour / 2),
        check(None),
        Step::Back(2 * hour),
        check(Some(hour)),
        Step::SettleTier { which: 0, tier: 1, cost: 3 },
        check(None),
        Step::Settle { which: 1, cost: 0 },
        check(None),
        Step::Advance(hour),
        check(None),
    ];
    for (period, zone) in [(0, 0), (1, 1), (2, 2)] {
        let extra = vec![Extra::Calendar(3, period, zone)];
        let start = instant("2025-10-26T00:00:00Z") + 3 * hour;
        let tiers = vec![(10, 1_000_000_000, 10)];
        replay_kept(&server, &Trace::new(Algorithm::Gcra, (tiers, extra, start, steps.clone())));
    }
}

#[test]
fn valkey_decides_exactly_like_memory_store() {
    let Some(server) = Server::start("valkey-server") else { return };
    let url = server.url();
    differential(64, |clock, prefix| fake_clock_store(RedisStore::builder(&url), clock, prefix));
}

#[test]
fn cluster_decides_exactly_like_memory_store() {
    let Some(cluster) = Cluster::start() else { return };
    let urls = cluster.urls();
    differential(64, |clock, prefix| {
        fake_clock_store(RedisStore::cluster_builder(urls.clone()), clock, prefix)
    });
}

/// Every algorithm on its own, so a regression names the algorithm, on stores `store` makes
/// for a fake clock.
fn every_algorithm_admits_then_limits<St: Store>(store: impl Fn(FakeClock) -> St) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    for algorithm in Algorithm::ALL {
        let clock = FakeClock::new();
        let store = store(clock.clone());
        let policy = Policy::builder(algorithm.name())
            .algorithm(algorithm)
            .tier("fast", Quota::per_second(3))
            .tier("slow", Quota::per_minute(5))
            .build()
            .unwrap();
        let decide = |cost| {
            let limiter = Limiter::with_store(policy.clone(), store.clone()).expect("binds");
            async move { limiter.check(&Key::Global, cost).await.expect("the store answers") }
        };
        rt.block_on(async {
            let d: Decision = decide(3).await;
            assert!(d.is_allowed(), "{algorithm:?}");
            assert_eq!(d.tiers()[0].remaining(), 0, "{algorithm:?}");
            assert_eq!(d.tiers()[1].remaining(), 2, "{algorithm:?}");
            let d = decide(1).await;
            assert!(!d.is_allowed(), "{algorithm:?}");
            assert_eq!(d.violated_names(&policy).collect::<Vec<_>>(), ["fast"], "{algorithm:?}");
            // Two seconds: the sliding counter still weighs the whole previous window at 1 s.
            clock.advance(Duration::from_secs(2));
            assert!(decide(2).await.is_allowed(), "{algorithm:?}");
            let d = decide(1).await;
            assert_eq!(d.violated_names(&policy).collect::<Vec<_>>(), ["slow"], "{algorithm:?}");
        });
    }
}

#[test]
fn every_algorithm_admits_then_limits_on_redis() {
    let Some(server) = Server::start("redis-server") else { return };
    every_algorithm_admits_then_limits(|clock| {
        fake_clock_store(RedisStore::builder(server.url()), clock, "a:".into())
    });
}

#[test]
fn every_algorithm_admits_then_limits_in_memory() {
    every_algorithm_admits_then_limits(|clock| {
        MemoryStore::builder().clock(clock).build().unwrap()
    });
}

#[test]
fn every_algorithm_admits_then_limits_on_valkey() {
    let Some(server) = Server::start("valkey-server") else { return };
    every_algorithm_admits_then_limits(|clock| {
        fake_clock_store(RedisStore::builder(server.url()), clock, "a:".into())
    });
}

#[test]
fn every_algorithm_admits_then_limits_on_a_cluster() {
    let Some(cluster) = Cluster::start() else { return };
    every_algorithm_admits_then_limits(|clock| {
        fake_clock_store(RedisStore::cluster_builder(cluster.urls()), clock, "a:".into())
    });
}

// ---------------------------------------------------------------------------------------------
// Concurrency: many tasks, one key, pipelined on one multiplexed connection.

/// 12 days: long enough that no window boundary (aligned to the Unix epoch on server time) falls
/// inside the test, short enough for the store's horizon.
const LONG: Duration = Duration::from_secs(12 * 86_400);

/// Sends `n` checks of one key at once, each from its own task, released together by a
/// barrier; returns how many were admitted.
async fn admitted_concurrently(store: &RedisStore, policy: &Policy, n: usize) -> usize {
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (store, policy, barrier) = (store.clone(), policy.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                decide(&store, &policy, &Key::Global, 1).await.is_allowed()
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += usize::from(t.await.unwrap());
    }
    admitted
}

fn long_policy(algorithm: Algorithm) -> Policy {
    Policy::builder(format!("conc-{}", algorithm.name()))
        .algorithm(algorithm)
        .tier("t", Quota::new(100, LONG))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_admits_exactly_100_of_1000_concurrent_on_one_connection() {
    let Some(server) = Server::start("redis-server") else { return };
    let store = RedisStore::builder(server.url()).timeout(Duration::from_secs(10)).build().unwrap();
    for algorithm in Algorithm::ALL {
        let admitted = admitted_concurrently(&store, &long_policy(algorithm), 1000).await;
        assert_eq!(admitted, 100, "{algorithm:?}");
    }
    // Six thousand requests, one multiplexed connection (plus this inspecting one).
    let info: String = redis::cmd("INFO").arg("clients").query(&mut server.conn()).unwrap();
    assert!(info.contains("connected_clients:2\r\n"), "{info}");
}

/// Policies of the other kinds: a yearly calendar quota (a year boundary falls inside the
/// test only on New Year's Eve at midnight), a rate counting bytes, both with a concurrency tier
/// that never fills up, and a concurrency tier of 100 slots nobody releases.
fn kinds_policies() -> Vec<Policy> {
    let slots = || Concurrency::new(1000).with_ttl(Duration::from_secs(600));
    vec![
        Policy::builder("conc-calendar")
            .calendar("year", Calendar::per_year(100))
            .concurrency("slots", slots())
            .build()
            .unwrap(),
        Policy::builder("conc-bytes")
            .tier("bytes", Quota::new(100, LONG).counting(Unit::RequestBytes))
            .concurrency("slots", slots())
            .build()
            .unwrap(),
        Policy::builder("conc-held")
            .concurrency("slots", Concurrency::new(100).with_ttl(Duration::from_secs(600)))
            .build()
            .unwrap(),
    ]
}

/// Sends `n` reservations of one key at once and keeps the admitted ones; returns how many.
async fn held_concurrently(store: &RedisStore, policy: &Policy, n: usize) -> usize {
    let limiter = Limiter::with_store(policy.clone(), store.clone()).unwrap();
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (limiter, barrier) = (limiter.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let r = limiter.reserve(&Key::Global, 1).await.expect("redis answers");
                assert_eq!(r.decision().source(), Source::Store);
                r.decision().is_allowed().then_some(r)
            })
        })
        .collect();
    let mut held = Vec::new();
    for t in tasks {
        held.extend(t.await.unwrap());
    }
    held.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_admits_exactly_100_of_1000_concurrent_on_redis() {
    let Some(server) = Server::start("redis-server") else { return };
    let store = RedisStore::builder(server.url()).timeout(Duration::from_secs(10)).build().unwrap();
    for policy in kinds_policies() {
        assert_eq!(held_concurrently(&store, &policy, 1000).await, 100, "{}", policy.name());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_admits_exactly_100_of_1000_concurrent() {
    let Some(cluster) = Cluster::start() else { return };
    let store = RedisStore::cluster_builder(cluster.urls())
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    for algorithm in [Algorithm::Gcra, Algorithm::SlidingLog, Algorithm::SlidingCounter] {
        let admitted = admitted_concurrently(&store, &long_policy(algorithm), 1000).await;
        assert_eq!(admitted, 100, "{algorithm:?}");
    }
    for policy in kinds_policies() {
        assert_eq!(held_concurrently(&store, &policy, 1000).await, 100, "{}", policy.name());
    }
}

// ---------------------------------------------------------------------------------------------
// Keys: hash tags, TTLs, script reloads.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policys_keys_share_one_cluster_slot_and_keys_spread_over_nodes() {
    let Some(cluster) = Cluster::start() else { return };
    let store = RedisStore::cluster_builder(cluster.urls())
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let policy = Policy::builder("log")
        .algorithm(Algorithm::SlidingLog)
        .tier("second", Quota::per_second(5))
        .tier("minute", Quota::per_minute(50))
        .build()
        .unwrap();
    let mut owners = std::collections::HashSet::new();
    for i in 0..30 {
        let key = Key::text(format!("user-{i}"));
        assert!(decide(&store, &policy, &key, 1).await.is_allowed());
        let state = state_key(&store, &policy, &key);
        let node = cluster.node_of(&state);
        let mut conn = node.conn();
        // The hash and both tiers' sets live on the node of the hash's slot (a multi-key script
        // across slots would have been refused with CROSSSLOT).
        for k in [state.clone(), format!("{state}:z1"), format!("{state}:z2")] {
            let exists: i64 = redis::cmd("EXISTS").arg(&k).query(&mut conn).unwrap();
            assert_eq!(exists, 1, "{k}");
        }
        owners.insert(node.port);
    }
    assert_eq!(owners.len(), 3, "30 keys land on all three masters");
}

// ---------------------------------------------------------------------------------------------
// Keys stay secret: Redis holds a keyed hash of each key, never the key.

/// An API key: what must not be readable in Redis.
const API_KEY: &str = "sk_live_SECRET";

/// One policy per algorithm with two rate tiers, and one per algorithm with a concurrency and
/// a calendar tier beside its rate (sliding-log sets, lease sets and calendar windows).
fn secret_policies() -> Vec<Policy> {
    let lease = Concurrency::new(5).with_ttl(Duration::from_secs(600));
    let mut out = Vec::new();
    for algorithm in Algorithm::ALL {
        let plain = Policy::builder(format!("plain-{}", algorithm.name()))
            .algorithm(algorithm)
            .tier("second", Quota::per_second(5))
            .tier("day", Quota::per_day(1000))
            .build()
            .unwrap();
        let kinds = Policy::builder(format!("kinds-{}", algorithm.name()))
            .algorithm(algorithm)
            .tier("minute", Quota::per_minute(50))
            .concurrency("slots", lease)
            .calendar("month", Calendar::per_month(1000))
            .build()
            .unwrap();
        out.extend([plain, kinds]);
    }
    out
}

/// The keys checked: the API key alone, and with an address.
fn secret_keys() -> [Key; 2] {
    let ip = Key::Ip("203.0.113.7".parse().unwrap());
    [Key::text(API_KEY), Key::Tuple(vec![ip, Key::text(API_KEY)].into())]
}

/// Two requests through the layer keyed by an `x-api-key` header (policy `layer`), then two
/// reservations per policy and key (held, so leases are in Redis when it is read), and a
/// settlement of one of them at another cost.
async fn secret_checks(store: &RedisStore) -> Vec<tollgate::Reservation<RedisStore>> {
    use tower::{Layer as _, ServiceExt as _};
    let layer = RateLimitLayer::builder(Policy::single("layer", Quota::per_minute(10)).unwrap())
        .key(tollgate::key::HeaderKey::new(http::HeaderName::from_static("x-api-key")))
        .store(store.clone())
        .build()
        .unwrap();
    let service = layer.layer(support::ok_service());
    // GCRA, 10 a minute: each request is 6 s until the bucket is full again.
    for (remaining, full_in) in [(9, 6), (8, 12)] {
        let request = http::Request::get("/").header("x-api-key", API_KEY);
        let request = request.body(axum::body::Body::empty()).unwrap();
        let res = service.clone().oneshot(request).await.unwrap();
        assert_eq!(res.status(), http::StatusCode::OK);
        assert_eq!(res.headers()["ratelimit"], format!("\"layer\";r={remaining};t={full_in}"));
    }
    let mut held = Vec::new();
    for policy in secret_policies() {
        let limiter = Limiter::with_store(policy.clone(), store.clone()).unwrap();
        for key in secret_keys() {
            let first = limiter.reserve(&key, 1).await.expect("redis answers");
            let second = limiter.reserve(&key, 1).await.expect("redis answers");
            let name = policy.name();
            assert!(first.decision().is_allowed() && second.decision().is_allowed(), "{name}");
            assert_eq!(first.decision().source(), Source::Store, "{name}");
            first.settle(2).await.expect("settled");
            held.push(second);
        }
    }
    held
}

/// Every key name on a server (`SCAN`) with its value: a string's bytes (`GET`), a sorted set's
/// members (`ZRANGE`); any other type fails the test.
fn everything_in(conn: &mut redis::Connection) -> Vec<(String, Vec<Vec<u8>>)> {
    let mut names: Vec<Vec<u8>> = Vec::new();
    let mut cursor = 0_u64;
    loop {
        let (next, batch): (u64, Vec<Vec<u8>>) =
            redis::cmd("SCAN").arg(cursor).arg("COUNT").arg(1000).query(conn).unwrap();
        names.extend(batch);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    names
        .into_iter()
        .map(|name| {
            let kind: String = redis::cmd("TYPE").arg(&name).query(conn).unwrap();
            let values: Vec<Vec<u8>> = match kind.as_str() {
                "string" => vec![redis::cmd("GET").arg(&name).query(conn).unwrap()],
                "zset" => redis::cmd("ZRANGE").arg(&name).arg(0).arg(-1).query(conn).unwrap(),
                other => panic!("unexpected {other} at {}", String::from_utf8_lossy(&name)),
            };
            (String::from_utf8(name).expect("key names are text"), values)
        })
        .collect()
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle.as_bytes())
}

/// Asserts that no key name or value holds the API key's secret part, and that every policy's
/// keys are there: a state key per policy and key, sliding-log sets and lease sets.
fn assert_secret_kept(everything: &[(String, Vec<Vec<u8>>)]) {
    for (name, values) in everything {
        assert!(!contains(name.as_bytes(), "SECRET") && !name.contains("sk_live"), "{name}");
        for v in values {
            assert!(!contains(v, "SECRET") && !contains(v, "sk_live"), "{name}: {v:?}");
        }
    }
    let states = secret_policies().len() * secret_keys().len();
    let count = |suffix: &str| everything.iter().filter(|(n, _)| n.ends_with(suffix)).count();
    // Sliding logs: two sets for a plain policy, one beside the concurrency tier; every kinds
    // policy holds a lease set.
    assert_eq!(count(":z1"), 2 * secret_keys().len(), "log sets");
    assert_eq!(count(":z2"), secret_keys().len(), "log sets");
    let sets = count(":c:slots");
    assert_eq!(sets, secret_policies().len() / 2 * secret_keys().len(), "lease sets");
    // And the layer's key.
    assert_eq!(everything.len(), states + 1 + count(":z1") + count(":z2") + sets);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_holds_no_api_key_in_key_names_or_values() {
    let Some(server) = Server::start("redis-server") else { return };
    let url = server.url();
    let builders = [
        RedisStore::builder(&url),
        RedisStore::builder(&url).key_secret("per-deployment secret"),
        RedisStore::builder(&url).raw_keys().key_secret(b"\x00\xff"),
    ];
    for builder in builders {
        let store = builder.timeout(Duration::from_secs(5)).build().unwrap();
        let held = secret_checks(&store).await;
        let mut conn = server.conn();
        let everything = everything_in(&mut conn);
        assert_secret_kept(&everything);
        for policy in secret_policies() {
            let bound = store.bind(&policy).unwrap();
            for key in secret_keys() {
                let state = bound.state_key(&key);
                assert!(everything.iter().any(|(n, _)| *n == state), "{state}");
            }
        }
        drop(held);
        let () = redis::cmd("FLUSHALL").query(&mut conn).unwrap();
    }
    // The same checks under raw key names do show the key: what the test looks for is there.
    let store = RedisStore::builder(&url).raw_keys().timeout(Duration::from_secs(5)).build();
    let held = secret_checks(&store.unwrap()).await;
    let everything = everything_in(&mut server.conn());
    let shown = everything.iter().filter(|(n, _)| n.contains("s14:sk_live_SECRET")).count();
    assert_eq!(shown, everything.len());
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_hashed_keys_hide_the_api_key_and_keep_each_keys_tiers_in_one_slot() {
    let Some(cluster) = Cluster::start() else { return };
    let store = RedisStore::cluster_builder(cluster.urls())
        .key_secret("per-deployment secret")
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let held = secret_checks(&store).await;
    let mut everything = Vec::new();
    // Which node holds each hash tag: one node per tag, so a key's state and its sets share a
    // slot (a script over several slots is refused with CROSSSLOT anyway).
    let mut tags: std::collections::HashMap<String, u16> = std::collections::HashMap::new();
    for node in &cluster.nodes {
        for (name, values) in everything_in(&mut node.conn()) {
            let tag = name[name.find('{').unwrap() + 1..name.find('}').unwrap()].to_owned();
            assert!(tag.contains("|#"), "{name}");
            assert_eq!(*tags.entry(tag).or_insert(node.port), node.port, "{name}");
            everything.push((name, values));
        }
    }
    assert_secret_kept(&everything);
    assert_eq!(tags.len(), secret_policies().len() * secret_keys().len() + 1);
    drop(held);
}

/// `PTTL` of `key` in milliseconds (-2 when it does not exist).
fn pttl(conn: &mut redis::Connection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query(conn).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_lives_as_long_as_its_state_needs() {
    let Some(server) = Server::start("redis-server") else { return };
    let store = RedisStore::builder(server.url()).timeout(Duration::from_secs(5)).build().unwrap();
    let mut conn = server.conn();
    for algorithm in Algorithm::ALL {
        let policy = Policy::builder(format!("ttl-{}", algorithm.name()))
            .algorithm(algorithm)
            .tier("t", Quota::new(10, Duration::from_millis(400)))
            .build()
            .unwrap();
        let d = decide(&store, &policy, &Key::Global, 3).await;
        let state = state_key(&store, &policy, &Key::Global);
        let mut keys = vec![state.clone()];
        if algorithm == Algorithm::SlidingLog {
            keys.push(format!("{state}:z1"));
        }
        // TTL = the time until the state is back to full, rounded up to ms (no grace).
        let need =
            i64::try_from(d.tiers()[0].reset_after().as_nanos().div_ceil(1_000_000)).unwrap();
        // At most one period; two for the sliding counter, whose window still weighs in
        // during the next one.
        assert!(need > 0 && need <= 800, "{algorithm:?}: {need}");
        for k in &keys {
            let ttl = pttl(&mut conn, k);
            assert!(ttl <= need && ttl > need - 150, "{algorithm:?} {k}: pttl {ttl}, need {need}");
        }
        // ... after which the keys are gone by themselves.
        let deadline = std::time::Instant::now() + Duration::from_secs(3);
        while keys.iter().any(|k| pttl(&mut conn, k) != -2) {
            assert!(
                std::time::Instant::now() < deadline,
                "{algorithm:?}: keys outlived their state"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // A rejected request on a fresh key writes nothing.
    let policy = Policy::single("none", Quota::per_second(2)).unwrap();
    assert!(!decide(&store, &policy, &Key::Global, 3).await.is_allowed());
    assert_eq!(pttl(&mut conn, &state_key(&store, &policy, &Key::Global)), -2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flushed_script_is_reloaded_transparently() {
    let Some(server) = Server::start("redis-server") else { return };
    let store = RedisStore::builder(server.url()).timeout(Duration::from_secs(5)).build().unwrap();
    store.connect().await.unwrap();
    let policy = Policy::single("flush", Quota::per_minute(2)).unwrap();
    assert!(decide(&store, &policy, &Key::Global, 1).await.is_allowed());
    let () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut server.conn()).unwrap();
    let d = decide(&store, &policy, &Key::Global, 1).await;
    assert_eq!((d.is_allowed(), d.tiers()[0].remaining()), (true, 0));
    assert!(!decide(&store, &policy, &Key::Global, 1).await.is_allowed());
}

#[test]
fn settings_and_policies_the_store_cannot_run_are_refused_when_built() {
    let store = RedisStore::builder("redis://127.0.0.1:1/").build().unwrap();
    let tiny = Policy::builder("tiny")
        .algorithm(Algorithm::FixedWindow)
        .tier("t", Quota::new(1, Duration::from_micros(100)))
        .build()
        .unwrap();
    let err = tollgate::RateLimitLayer::builder(tiny).store(store).build().unwrap_err();
    assert!(matches!(err, tollgate::ConfigError::UnsupportedByStore { .. }), "{err}");
    let bad = RedisStore::builder("not a url").build().unwrap_err();
    assert!(matches!(bad, tollgate::ConfigError::Invalid { setting: "url", .. }), "{bad}");
    let tag = RedisStore::builder("redis://127.0.0.1:1/").prefix("a{b}").build().unwrap_err();
    assert!(matches!(tag, tollgate::ConfigError::Invalid { setting: "prefix", .. }), "{tag}");
    let empty = RedisStore::builder("redis://127.0.0.1:1/").key_secret("").build().unwrap_err();
    assert!(matches!(empty, tollgate::ConfigError::Invalid { setting: "key_secret", .. }));
    assert_eq!(empty.to_string(), "key_secret: must not be empty");
    let url = "redis://127.0.0.1:1/";
    let err = RedisStore::builder(url).timeout(Duration::ZERO).build().unwrap_err();
    assert!(matches!(err, tollgate::ConfigError::Invalid { setting: "timeout", .. }), "{err}");
    let err = RedisStore::builder(url).circuit_breaker(0, Duration::from_secs(1)).build();
    let err = err.unwrap_err();
    assert!(matches!(err, tollgate::ConfigError::Invalid { setting: "circuit_breaker", .. }));
    let err = RedisStore::cluster_builder(Vec::<String>::new()).build().unwrap_err();
    assert!(matches!(err, tollgate::ConfigError::Invalid { setting: "url", .. }), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Long horizons: monthly and yearly quotas, at microsecond precision, as in memory.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn yearly_and_monthly_quotas_decide_exactly_like_memory() {
    let Some(server) = Server::start("redis-server") else { return };
    const DAY: u64 = 86_400_000_000_000;
    for algorithm in Algorithm::ALL {
        let (year, month) = if algorithm == Algorithm::SlidingLog {
            (10_000, 1_000)
        } else {
            (10_000_000, 1_000_000)
        };
        let policy = Policy::builder(format!("plan-{}", algorithm.name()))
            .algorithm(algorithm)
            .tier("year", Quota::new(year, Duration::from_secs(365 * 86_400)))
            .tier("month", Quota::new(month, Duration::from_secs(30 * 86_400)))
            .build()
            .unwrap();
        assert_eq!(policy.precision(), Duration::from_micros(1));
        let clock = FakeClock::new();
        clock.set(1_700_000_000_123_456_789);
        let redis =
            fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "long:".into());
        let redis = Limiter::with_store(policy.clone(), redis).unwrap();
        let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        let memory = Limiter::with_store(policy, memory).unwrap();
        // Spend most of the month at once (one unit at a time for the log), then probe past the
        // month's end and across the year.
        let big = if algorithm == Algorithm::SlidingLog { 1 } else { month - 3 };
        let steps: &[(u64, u64)] =
            &[(0, big), (0, 2), (0, 5), (DAY, 1), (29 * DAY, 3), (2 * DAY, 4), (200 * DAY, 7)];
        for (i, &(advance, cost)) in steps.iter().enumerate() {
            clock.advance(Duration::from_nanos(advance));
            let m = memory.check(&Key::Global, cost).await.unwrap();
            let r = redis.check(&Key::Global, cost).await.unwrap();
            assert_eq!(m, r, "{algorithm:?} step {i}");
            assert_eq!(r.source(), Source::Store);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Failure policy: the server killed mid-run and restarted.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_falls_back_locally_opens_the_breaker_and_recovers() {
    let Some(mut server) = Server::start("redis-server") else { return };
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_millis(300))
        .circuit_breaker(2, Duration::from_millis(200))
        .fallback(MemoryStore::new())
        .build()
        .unwrap();
    let policy = Policy::single("restart", Quota::per_hour(5)).unwrap();
    let limiter = Limiter::with_store(policy, store.clone()).unwrap();
    let key = Key::text("k");
    let decide = |cost| {
        let limiter = limiter.clone();
        let key = key.clone();
        async move {
            let d = limiter.check(&key, cost).await.expect("a fallback never errors");
            (d.source(), d.is_allowed(), d.tiers()[0].remaining())
        }
    };
    assert_eq!(decide(1).await, (Source::Store, true, 4));
    assert_eq!(decide(1).await, (Source::Store, true, 3));

    server.kill();
    // Redis is gone: the local fallback decides, from its own state.
    assert_eq!(decide(1).await, (Source::Fallback, true, 4));
    assert_eq!(decide(1).await, (Source::Fallback, true, 3));
    assert_eq!(store.breaker_state(), BreakerState::Open, "two failures open it");
    for remaining in [2, 1, 0] {
        assert_eq!(decide(1).await, (Source::Fallback, true, remaining));
    }
    assert_eq!(decide(1).await, (Source::Fallback, false, 0), "the fallback limits too");

    server.restart(); // returns once the server answers PING
    // Limiting by Redis resumes within 1 s: as soon as the breaker is half-open, the next call
    // is the probe, and one probe suffices (a refused reconnect is retried within the call).
    let restarted = std::time::Instant::now();
    while store.breaker_state() != BreakerState::HalfOpen {
        assert!(restarted.elapsed() < Duration::from_secs(1), "breaker never half-opened");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Cost 0 queries without charging.
    let (source, _, remaining) = decide(0).await;
    assert_eq!(source, Source::Store, "the first probe after the restart reaches Redis");
    assert_eq!(remaining, 5, "the restarted server is empty (--save \"\")");
    assert!(restarted.elapsed() < Duration::from_secs(1));
    assert_eq!(store.breaker_state(), BreakerState::Closed);
    for remaining in [4, 3, 2, 1, 0] {
        assert_eq!(decide(1).await, (Source::Store, true, remaining));
    }
    assert_eq!(decide(1).await, (Source::Store, false, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_fallback_the_layer_fails_closed_or_open_as_configured() {
    use tower::{Layer as _, ServiceExt as _};
    let Some(mut server) = Server::start("redis-server") else { return };
    let store = RedisStore::builder(server.url())
        .timeout(Duration::from_millis(300))
        .circuit_breaker(1, Duration::from_secs(600))
        .no_fallback()
        .build()
        .unwrap();
    let policy = Policy::single("outage", Quota::per_hour(5)).unwrap();
    let layer = |on_error| {
        RateLimitLayer::builder(policy.clone())
            .key(GlobalKey)
            .store(store.clone())
            .on_store_error(on_error)
            .build()
            .unwrap()
    };
    let closed = layer(OnStoreError::FailClosed).layer(support::ok_service());
    let open = layer(OnStoreError::FailOpen).layer(support::ok_service());
    let request = || http::Request::new(axum::body::Body::empty());

    let res = closed.clone().oneshot(request()).await.unwrap();
    assert_eq!(res.status(), http::StatusCode::OK);
    assert_eq!(res.headers()["ratelimit"], "\"outage\";r=4;t=720");

    server.kill();
    let res = closed.clone().oneshot(request()).await.unwrap();
    assert_eq!(res.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "1");
    assert_eq!(store.breaker_state(), BreakerState::Open);
    // Open: the store is not called at all, so nothing waits for the timeout.
    let limiter = Limiter::with_store(policy.clone(), store.clone()).unwrap();
    let err = limiter.check(&Key::Global, 1).await.unwrap_err();
    assert!(matches!(err, StoreError::CircuitOpen), "{err}");
    let res = closed.clone().oneshot(request()).await.unwrap();
    assert_eq!(res.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    // Failing open passes the request on, without rate-limit headers (nothing was decided).
    let res = open.oneshot(request()).await.unwrap();
    assert_eq!(res.status(), http::StatusCode::OK);
    assert!(res.headers().get("ratelimit").is_none());
}

// ---------------------------------------------------------------------------------------------
// The layer over real HTTP: two app instances, one Redis, one limit.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_app_instances_enforce_one_limit_over_http() {
    let Some(server) = Server::start("redis-server") else { return };
    let policy = Policy::single("fleet", Quota::per_hour(30)).unwrap();
    let mut apps = Vec::new();
    for _ in 0..2 {
        // Each instance has its own store (own connection); PeerIp keys both by 127.0.0.1.
        let store =
            RedisStore::builder(server.url()).timeout(Duration::from_secs(5)).build().unwrap();
        let layer = RateLimitLayer::builder(policy.clone()).store(store).build().unwrap();
        let app =
            axum::Router::new().route("/", axum::routing::get(|| async { "ok" })).layer(layer);
        apps.push(support::serve(app).await);
    }
    let client = support::client();
    let requests: Vec<_> = (0..100)
        .map(|i| {
            let (client, url) = (client.clone(), apps[i % 2].url("/"));
            tokio::spawn(async move { support::get(&client, &url, &[]).await })
        })
        .collect();
    let (mut ok, mut limited) = (0, 0);
    for r in requests {
        let reply = r.await.unwrap();
        match reply.status {
            http::StatusCode::OK => ok += 1,
            http::StatusCode::TOO_MANY_REQUESTS => {
                limited += 1;
                let retry: u64 = reply.header("retry-after").unwrap().parse().unwrap();
                assert!(retry >= 1);
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!((ok, limited), (30, 70));
}

// ---------------------------------------------------------------------------------------------
// Clocks (SECURITY.md, "clock skew"): app servers whose clocks disagree, and a server clock
// that steps back.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn skewed_app_clocks_loosen_a_limit_unless_time_comes_from_redis() {
    let Some(server) = Server::start("redis-server") else { return };
    let policy = Policy::single("skew", Quota::per_hour(10)).unwrap();
    let admitted = |a: RedisStore, b: RedisStore| {
        let policy = policy.clone();
        async move {
            let mut n = 0;
            for store in [a, b] {
                for _ in 0..10 {
                    n += usize::from(decide(&store, &policy, &Key::Global, 1).await.is_allowed());
                }
            }
            n
        }
    };
    // Two instances whose clocks are an hour apart, deciding on their own clocks: the one
    // ahead sees the other's charges as refilled, and the pair admits twice the limit.
    let (slow, fast) = (FakeClock::new(), FakeClock::new());
    slow.set(10_000_000_000_000);
    fast.set(10_000_000_000_000 + 3_600_000_000_000);
    let on = |clock: FakeClock| {
        fake_clock_store(RedisStore::builder(server.url()), clock, "skew1:".into())
    };
    assert_eq!(admitted(on(slow), on(fast)).await, 20);
    // The default, Redis's TIME: whatever the app servers' clocks say, the limit holds.
    let server_time = || RedisStore::builder(server.url()).prefix("skew2:").build().unwrap();
    assert_eq!(admitted(server_time(), server_time()).await, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_stepping_back_does_not_reopen_a_window() {
    let Some(server) = Server::start("redis-server") else { return };
    for algorithm in Algorithm::ALL {
        let clock = FakeClock::new();
        clock.set(10_500_000_000); // 10.5 s: the middle of window 10 of one second
        let store =
            fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "back:".into());
        let policy = Policy::builder(format!("back-{}", algorithm.name()))
            .algorithm(algorithm)
            .tier("t", Quota::per_second(3))
            .build()
            .unwrap();
        let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
        assert!(decide(&store, &policy, &Key::Global, 3).await.is_allowed(), "{algorithm:?}");
        let memory = Limiter::with_store(policy.clone(), memory).unwrap();
        assert!(memory.check(&Key::Global, 3).await.unwrap().is_allowed(), "{algorithm:?}");
        // The clock steps back 0.6 s, into window 9, forgotten long ago.
        clock.set(9_900_000_000);
        let d = decide(&store, &policy, &Key::Global, 1).await;
        assert!(!d.is_allowed(), "{algorithm:?}: a step back reopened the limit");
        assert_eq!(d.tiers()[0].remaining(), 0, "{algorithm:?}");
        // The in-memory store decides alike.
        assert_eq!(memory.check(&Key::Global, 1).await.unwrap(), d, "{algorithm:?}");
    }
}

/// One step of a clock-step scenario.
#[derive(Debug, Clone, Copy)]
enum Tick {
    /// A check of `cost` this many nanoseconds after the scenario's start.
    At(u64, u64),
    /// A check of `cost` this many nanoseconds after the last admitted check (a step back when
    /// a later check was refused).
    Since(u64, u64),
}

const WEEK: u64 = 604_800_000_000_000;

/// Runs `ticks` through memory and Redis on one fake clock (starting on a window boundary of a
/// week), never back before the last admission; every decision must be the same in both.
/// Returns the decisions.
async fn both_stores(
    server: &Server,
    policy: &Policy,
    prefix: &str,
    ticks: &[Tick],
) -> Vec<Decision> {
    let start = 2811 * WEEK; // 2023-11-16T00:00:00Z, a Thursday: weeks count from the epoch
    let clock = FakeClock::new();
    let redis = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), prefix.into());
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let redis = Limiter::with_store(policy.clone(), redis).unwrap();
    let memory = Limiter::with_store(policy.clone(), memory).unwrap();
    let (mut admitted, mut out) = (start, Vec::new());
    for (i, tick) in ticks.iter().enumerate() {
        let (at, cost) = match *tick {
            Tick::At(after, cost) => (start + after, cost),
            Tick::Since(after, cost) => (admitted + after, cost),
        };
        clock.set(at);
        let m = memory.check(&Key::Global, cost).await.unwrap();
        let r = redis.check(&Key::Global, cost).await.expect("redis answers");
        assert_eq!(m, r, "{}: step {i} ({tick:?}): memory, then redis", policy.name());
        if m.is_allowed() && cost > 0 {
            admitted = at;
        }
        out.push(m);
    }
    out
}

/// A refused check (limited, or over the capacity) never moves a key's clock guard, even when
/// it rewrites the key's state (pruning, or rebasing a sliding log's scores): after the clock
/// steps back to the last admission, Redis decides as memory does, for every algorithm, with
/// and without a calendar tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_check_does_not_move_the_clock_guard() {
    let Some(server) = Server::start("redis-server") else { return };
    let week = Duration::from_nanos(WEEK);
    for algorithm in Algorithm::ALL {
        for calendar in [false, true] {
            let policy = |count: u64| {
                let mut b =
                    Policy::builder(format!("guard-{}-{count}-{calendar}", algorithm.name()))
                        .algorithm(algorithm)
                        .tier("week", Quota::new(count, week));
                if calendar {
                    b = b.calendar("month", Calendar::new(100, CalendarPeriod::Month));
                }
                b.build().unwrap()
            };
            let name = format!("{algorithm:?}, calendar {calendar}");
            // One a week, spent; refused a nanosecond before the week is over (a sliding log
            // decided in nanoseconds rebases its scores then); back at the start, a whole week
            // (two for the sliding counter, which weighs the previous window in full at its
            // end) to wait.
            let p = policy(1);
            let ticks =
                [Tick::At(0, 1), Tick::At(WEEK - 1, 1), Tick::Since(0, 1), Tick::At(WEEK, 1)];
            let d = both_stores(&server, &p, &format!("{}:", p.name()), &ticks).await;
            assert!(!d[1].is_allowed() && !d[2].is_allowed(), "{name}");
            let whole = if algorithm == Algorithm::SlidingCounter { 2 * WEEK } else { WEEK };
            assert_eq!(d[2].retry_after(), Some(Duration::from_nanos(whole)), "{name}");
            // Two a week, spent at 0 and half a week; two more a week on (the log refuses them,
            // pruning the first; the others admit), then a cost above the capacity two weeks on (every
            // window pruned); back at the last admission, what is left decides alike.
            let p = policy(2);
            let ticks = [
                Tick::At(0, 1),
                Tick::At(WEEK / 2, 1),
                Tick::At(WEEK + 1, 2),
                Tick::Since(0, 1),
                Tick::At(2 * WEEK, 3),
                Tick::Since(0, 2),
                Tick::Since(0, 1),
                Tick::Since(WEEK / 4, 1),
                Tick::Since(WEEK + 1, 2),
            ];
            let d = both_stores(&server, &p, &format!("{}:", p.name()), &ticks).await;
            assert_eq!(d[4].outcome(), tollgate::Outcome::CostExceedsCapacity, "{name}");
        }
    }
}

/// A refusal that counts a breach rewrites the key's state (its penalty box) but does not move
/// its clock guard: back at the last admission, Redis decides as memory does, and the block
/// the second breach starts there ends two weeks after that instant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counted_breach_does_not_move_the_clock_guard() {
    let Some(server) = Server::start("redis-server") else { return };
    let week = Duration::from_nanos(WEEK);
    for algorithm in Algorithm::ALL {
        let policy = Policy::builder(format!("guard-box-{}", algorithm.name()))
            .algorithm(algorithm)
            .tier("week", Quota::new(1, week))
            .penalty("week", Penalty::new(2 * week).after(2, 4 * week))
            .build()
            .unwrap();
        let ticks = [
            Tick::At(0, 1),
            Tick::At(WEEK / 2, 1),
            Tick::Since(0, 1),
            Tick::Since(2 * WEEK - 1, 1),
            Tick::Since(2 * WEEK, 1),
        ];
        let d = both_stores(&server, &policy, &format!("{}:", policy.name()), &ticks).await;
        let name = format!("{algorithm:?}");
        // The sliding counter weighs the first week in full at its end: two weeks to wait.
        let whole = if algorithm == Algorithm::SlidingCounter { 2 * WEEK } else { WEEK };
        let own = Some(Duration::from_nanos(whole - WEEK / 2));
        assert_eq!(d[1].retry_after(), own, "{name}: {:?}", d[1]);
        assert_eq!(d[2].retry_after(), Some(2 * week), "{name}: {:?}", d[2]);
        assert_eq!(d[3].retry_after(), Some(Duration::from_nanos(1)), "{name}: {:?}", d[3]);
        assert!(d[4].is_allowed(), "{name}: {:?}", d[4]);
    }
}

// ---------------------------------------------------------------------------------------------
// Key material is data (SECURITY.md, "script or key injection").

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_key_material_stays_data() {
    let Some(server) = Server::start("redis-server") else { return };
    let store = RedisStore::builder(server.url()).timeout(Duration::from_secs(5)).build().unwrap();
    let mut conn = server.conn();
    let () = redis::cmd("SET").arg("victim").arg("intact").query(&mut conn).unwrap();
    let hostile = [
        "\"]] redis.call('FLUSHALL') --",
        "'); redis.call('DEL', 'victim'); ('",
        "*",
        "{victim}",
        "a}b{c",
        "line\r\nFLUSHALL\r\n",
        "\u{0}\u{1}\u{7f}",
        "%7B%7D",
    ];
    let policy = Policy::single("hostile", Quota::per_minute(1)).unwrap();
    for text in hostile {
        let key = Key::text(text);
        assert!(decide(&store, &policy, &key, 1).await.is_allowed(), "{text:?}");
        assert!(!decide(&store, &policy, &key, 1).await.is_allowed(), "{text:?}");
        let exists: i64 =
            redis::cmd("EXISTS").arg(state_key(&store, &policy, &key)).query(&mut conn).unwrap();
        assert_eq!(exists, 1, "{text:?} has its own key");
    }
    let victim: String = redis::cmd("GET").arg("victim").query(&mut conn).unwrap();
    assert_eq!(victim, "intact");
    let keys: Vec<String> = redis::cmd("KEYS").arg("*").query(&mut conn).unwrap();
    assert_eq!(keys.len(), hostile.len() + 1, "one key per hostile text, and the victim: {keys:?}");
}

/// Found by the differential test: sliding-log ids restart when an empty log's key is deleted, so
/// a late cancel could delete the entry of a later request that reused the id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_ticket_cannot_cancel_a_later_entry() {
    let Some(server) = Server::start("redis-server") else { return };
    let clock = FakeClock::new();
    let store = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "stale:".into());
    let policy = Policy::builder("log")
        .algorithm(Algorithm::SlidingLog)
        .tier("t", Quota::per_second(1))
        .build()
        .unwrap();
    let limiter = Limiter::with_store(policy, store).unwrap();
    let stale = limiter.reserve(&Key::Global, 1).await.unwrap();
    clock.advance(Duration::from_secs(1));
    // The log is empty again: a query that charges nothing drops its keys, and ids start over.
    assert_eq!(limiter.check(&Key::Global, 0).await.unwrap().tiers()[0].remaining(), 1);
    let mut conn = server.conn();
    let state = limiter.bound().state_key(&Key::Global);
    assert_eq!(redis::cmd("EXISTS").arg(&state).query::<i64>(&mut conn).unwrap(), 0);
    assert!(limiter.check(&Key::Global, 1).await.unwrap().is_allowed());
    stale.cancel().await.unwrap();
    let d = limiter.check(&Key::Global, 1).await.unwrap();
    assert!(!d.is_allowed(), "the later entry still counts");
}

// ---------------------------------------------------------------------------------------------
// Concurrency slots as leases.

fn slots_policy(name: &str, max: u64, lease: Duration) -> Policy {
    Policy::builder(name)
        .concurrency("in-flight", Concurrency::new(max).with_ttl(lease))
        .build()
        .unwrap()
}

/// 1,000 tasks on two threads each wait for one of 4 slots of one key (polling Redis), count
/// themselves in while they hold it, and release it: never more than 4 inside, 4 at some moment,
/// and every task gets its turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_holders_on_redis_never_exceed_four_in_flight() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let Some(server) = Server::start("redis-server") else { return };
    let store = RedisStore::builder(server.url()).timeout(Duration::from_secs(10)).build().unwrap();
    let limiter =
        Limiter::with_store(slots_policy("thousand", 4, Duration::from_secs(60)), store).unwrap();
    let inside = std::sync::Arc::new(AtomicUsize::new(0));
    let most = std::sync::Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..1000)
        .map(|_| {
            let (limiter, inside, most) = (limiter.clone(), inside.clone(), most.clone());
            tokio::spawn(async move {
                let slot = limiter
                    .acquire(&Key::text("api-key"), 1, Duration::from_secs(300))
                    .await
                    .expect("a slot within five minutes");
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                assert!(now <= 4, "{now} in flight");
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                inside.fetch_sub(1, Ordering::SeqCst);
                slot.release().await.expect("released");
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(most.load(Ordering::SeqCst), 4);
    let d = limiter.check(&Key::text("api-key"), 0).await.unwrap();
    assert_eq!((d.tiers()[0].remaining(), d.source()), (4, Source::Store));
    // Every lease is gone: so is the set.
    let set = lease_set(&limiter.bound().state_key(&Key::text("api-key")), "in-flight");
    assert_eq!(pttl(&mut server.conn(), &set), -2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_of_a_crashed_holder_frees_itself_when_its_lease_expires() {
    let Some(server) = Server::start("redis-server") else { return };
    let clock = FakeClock::new();
    clock.set(instant("2025-06-02T10:00:00Z"));
    let policy = slots_policy("crash", 1, Duration::from_secs(10));
    // App server A takes the slot and crashes: it never releases nor refreshes.
    {
        let store =
            fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "crash:".into());
        let a = Limiter::with_store(policy.clone(), store).unwrap();
        let held = a.reserve(&Key::Global, 1).await.unwrap();
        assert!(held.decision().is_allowed());
        assert_eq!(held.refresh_every(), Some(Duration::from_secs(10) / 3));
        std::mem::forget(held);
    }
    let store = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "crash:".into());
    let b = Limiter::with_store(policy, store).unwrap();
    let d = b.check(&Key::Global, 1).await.unwrap();
    assert_eq!(d.outcome(), tollgate::Outcome::Limited);
    assert_eq!(d.retry_after(), Some(Duration::from_secs(1)), "the default typical hold");
    // The lease set lives as long as its longest lease (plus the test's grace of an hour).
    let set = lease_set(&b.bound().state_key(&Key::Global), "in-flight");
    let ttl = pttl(&mut server.conn(), &set);
    assert!(ttl > 3_600_000 && ttl <= 3_610_000, "{ttl}");
    clock.advance(Duration::from_millis(9_999));
    assert!(!b.check(&Key::Global, 1).await.unwrap().is_allowed(), "leased for 10 s");
    clock.advance(Duration::from_millis(1));
    let d = b.check(&Key::Global, 1).await.unwrap();
    assert!(d.is_allowed(), "expired after 10 s: {d:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refreshed_lease_lasts_and_an_expired_one_says_so() {
    let Some(server) = Server::start("redis-server") else { return };
    let clock = FakeClock::new();
    clock.set(instant("2025-06-02T10:00:00Z"));
    let store = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "fresh:".into());
    let limiter =
        Limiter::with_store(slots_policy("refresh", 1, Duration::from_secs(9)), store).unwrap();
    let held = limiter.reserve(&Key::Global, 1).await.unwrap();
    for _ in 0..3 {
        clock.advance(Duration::from_secs(6));
        assert!(held.refresh().await.unwrap(), "still leased");
        assert!(!limiter.check(&Key::Global, 1).await.unwrap().is_allowed());
    }
    // 18 s after it was taken, the slot is still held; released, it is free at once, and the
    // hold (18 s) becomes the typical hold.
    held.release().await.unwrap();
    let other = limiter.reserve(&Key::Global, 1).await.unwrap();
    assert!(other.decision().is_allowed());
    let d = limiter.check(&Key::Global, 1).await.unwrap();
    assert_eq!(d.retry_after(), Some(Duration::from_secs(18)));
    // Not refreshed for a whole lease: gone, and the refresh says so.
    clock.advance(Duration::from_secs(9));
    assert!(!other.refresh().await.unwrap());
}

/// On the server's clock: a held reservation keeps its short lease alive by itself, and its
/// slot comes back when it is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_reservation_refreshes_its_lease_until_it_is_dropped() {
    let Some(server) = Server::start("redis-server") else { return };
    let store = RedisStore::builder(server.url()).timeout(Duration::from_secs(5)).build().unwrap();
    let limiter =
        Limiter::with_store(slots_policy("held", 1, Duration::from_millis(900)), store).unwrap();
    let held = limiter.reserve(&Key::Global, 1).await.unwrap().hold();
    // Four leases long. (Refreshed every 300 ms: a refresh may be 600 ms late before the lease
    // runs out, which a machine busy with other builds needs; with a 300 ms lease, one refresh
    // came more than 200 ms late in a CI run.)
    tokio::time::sleep(Duration::from_millis(3600)).await;
    assert!(!limiter.check(&Key::Global, 1).await.unwrap().is_allowed(), "refreshed");
    drop(held);
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while !limiter.check(&Key::Global, 1).await.unwrap().is_allowed() {
        assert!(std::time::Instant::now() < deadline, "the dropped hold was not released");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Without a refresh (forgotten, as by a crash), the lease lapses on the server's clock.
    let lost = limiter.reserve(&Key::Global, 1).await.unwrap();
    std::mem::forget(lost);
    assert!(!limiter.check(&Key::Global, 1).await.unwrap().is_allowed());
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert!(limiter.check(&Key::Global, 1).await.unwrap().is_allowed());
}

// ---------------------------------------------------------------------------------------------
// Calendar windows and costs per tier on Redis, next to memory.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calendar_windows_across_daylight_saving_and_month_ends_decide_like_memory() {
    let Some(server) = Server::start("redis-server") else { return };
    let policy = Policy::builder("cal")
        .calendar("day", Calendar::per_day(3).in_time_zone("Europe/Berlin"))
        .calendar("month", Calendar::per_month(5).in_time_zone("America/New_York"))
        .tier("burst", Quota::per_second(10))
        .build()
        .unwrap();
    let clock = FakeClock::new();
    let redis = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "cal:".into());
    let redis = Limiter::with_store(policy.clone(), redis).unwrap();
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let memory = Limiter::with_store(policy, memory).unwrap();
    let mut retries = Vec::new();
    for (when, cost) in [
        ("2025-03-29T22:59:59Z", 3), // the last second of Saturday in Berlin
        ("2025-03-29T22:59:59.5Z", 1),
        ("2025-03-29T23:00:00Z", 2), // Sunday (23 hours long); March's 5 are used up
        ("2025-04-01T03:59:00Z", 1), // March 31st, 23:59 in New York
        ("2025-04-01T04:00:00Z", 1), // April
        ("2025-10-25T22:00:00Z", 3), // Sunday October 26th, 00:00 CEST
        ("2025-10-26T22:59:00Z", 1), // 23:59 CET, 25 hours later: still Sunday
        ("2025-10-26T23:00:00Z", 1),
    ] {
        clock.set(instant(when));
        let m = memory.check(&Key::Global, cost).await.unwrap();
        let r = redis.check(&Key::Global, cost).await.unwrap();
        assert_eq!(m, r, "at {when}");
        retries.push(r.retry_after().map(|d| d.as_millis()));
    }
    assert_eq!(
        retries,
        [None, Some(500), None, Some(60_000), None, None, Some(60_000), None],
        "refused until the next window: Sunday in Berlin, April in New York"
    );
}

/// Policed checks and releases of a GCRA rate tier (a whole-unit interval) beside a calendar
/// and a concurrency tier, the case the Redis script decides on its flat path, decide like
/// memory through each kind of refusal: the slots full (the typical hold), the rate, the day
/// spent (until midnight in Berlin) and a cost above capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcra_beside_a_calendar_and_slots_refuses_like_memory() {
    let Some(server) = Server::start("redis-server") else { return };
    let policy = Policy::builder("flat")
        .tier("rate", Quota::per_second(2).with_burst(3))
        .calendar("day", Calendar::per_day(5).in_time_zone("Europe/Berlin"))
        .concurrency("slots", Concurrency::new(2).with_typical_hold(Duration::from_millis(250)))
        .build()
        .unwrap();
    let clock = FakeClock::new();
    clock.set(instant("2025-03-29T22:59:58Z")); // 23:59:58 on Saturday in Berlin
    let redis = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "flat:".into());
    let redis = Limiter::with_store(policy.clone(), redis).unwrap();
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let memory = Limiter::with_store(policy, memory).unwrap();
    let mut held = Vec::new();
    let mut seen = Vec::new();
    // (milliseconds to advance, cost to reserve; 0 releases the oldest reservation held)
    let steps = [
        (0, 1),
        (0, 1),
        (0, 1), // both slots held
        (0, 0),
        (0, 1),
        (0, 0),
        (0, 0),
        (0, 1), // the rate: 3 in 0 s with a burst of 3
        (500, 1),
        (0, 0),
        (1_000, 1), // the day's fifth
        (0, 0),
        (400, 1), // the day spent, 100 ms before midnight in Berlin
        (100, 1), // Sunday
        (0, 4),   // above the burst and the slots
    ];
    for (advance, cost) in steps {
        clock.advance(Duration::from_millis(advance));
        if cost == 0 {
            let (m, r): (Reservation<MemoryStore>, Reservation<RedisStore>) = held.remove(0);
            m.release().await.unwrap();
            r.release().await.unwrap();
            continue;
        }
        let m = memory.reserve(&Key::Global, cost).await.unwrap();
        let r = redis.reserve(&Key::Global, cost).await.unwrap();
        assert_eq!(m.decision(), r.decision(), "check {}", seen.len());
        let d = r.decision();
        seen.push((d.is_allowed(), d.retry_after().map(|d| d.as_millis())));
        if d.is_allowed() {
            held.push((m, r));
        }
    }
    assert_eq!(
        seen,
        [
            (true, None),
            (true, None),
            (false, Some(250)),
            (true, None),
            (false, Some(500)),
            (true, None),
            (true, None),
            (false, Some(100)),
            (true, None),
            (false, None),
        ]
    );
}

// ---------------------------------------------------------------------------------------------
// Shaping with calendar tiers: a request is charged in the window it leaves in, on Redis as in
// memory, and a departure Redis could not charge is refused by both.

/// Ten requests at second :58 through a leaky bucket of 1 a second (burst 20) and 3 a minute,
/// shaped within 120 s: on Redis as in memory, two leave in that minute and three in each of
/// the next two; the last two are refused for the 2 s until their departure is in the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shaping_never_fills_a_calendar_minute_past_its_limit_on_redis() {
    let Some(server) = Server::start("redis-server") else { return };
    let policy = Policy::builder("paced")
        .algorithm(Algorithm::LeakyBucket)
        .tier("rate", Quota::per_second(1).with_burst(20))
        .calendar("minute", Calendar::per_minute(3))
        .build()
        .unwrap();
    let clock = FakeClock::new();
    let start = instant("2025-06-02T10:00:58Z");
    clock.set(start);
    let redis = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "paced:".into());
    let redis = Limiter::with_store(policy.clone(), redis).unwrap();
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let memory = Limiter::with_store(policy, memory).unwrap();
    let budget = Duration::from_secs(120);
    let mut per_minute = std::collections::BTreeMap::<u64, u64>::new();
    let mut refused = Vec::new();
    for _ in 0..10 {
        let m = memory.reserve_within(&Key::Global, 1, budget).await.unwrap();
        let r = redis.reserve_within(&Key::Global, 1, budget).await.unwrap();
        assert_eq!(m.decision(), r.decision());
        let d = r.decision();
        if d.is_allowed() {
            *per_minute
                .entry((start / 1_000_000_000 + d.delay().as_secs()) / 60 % 60)
                .or_default() += 1;
        } else {
            refused.push(d.retry_after());
        }
        m.commit();
        r.commit();
    }
    assert_eq!(per_minute.into_iter().collect::<Vec<_>>(), [(0, 2), (1, 3), (2, 3)]);
    assert_eq!(refused, [Some(Duration::from_secs(2)); 2]);
    clock.advance(Duration::from_secs(2));
    let m = memory.reserve_within(&Key::Global, 1, budget).await.unwrap();
    let r = redis.reserve_within(&Key::Global, 1, budget).await.unwrap();
    assert_eq!(m.decision(), r.decision());
    assert_eq!(r.decision().delay(), Duration::from_secs(120));
}

/// Shaped traces over every algorithm, with long rate tiers (seconds to hours) and calendar
/// tiers (minutes, hours, days; UTC, Berlin, New York), budgets up to three hours so that
/// departures reach later windows and past the calendar lookahead; from a fixed seed.
fn shaping_trace(algorithm: Algorithm) -> impl Strategy<Value = Trace> {
    let window = matches!(
        algorithm,
        Algorithm::FixedWindow | Algorithm::SlidingLog | Algorithm::SlidingCounter
    );
    let max_count: u64 = if algorithm == Algorithm::SlidingLog { 8 } else { 12 };
    let sec = 1_000_000_000u64;
    let period = prop_oneof![
        3 => (1u64..=120).prop_map(move |s| s * sec),
        2 => (1u64..=7_200).prop_map(move |s| s * sec),
        1 => (1u64..=5_000).prop_map(|ms| ms * 1_000_000),
    ];
    let tier = (1u64..=max_count, period, 0u64..=24).prop_map(move |(c, p, extra)| {
        let burst = if window { c } else { 1 + extra % (2 * c + 2) };
        (c, p, burst)
    });
    let calendar =
        (1u64..=6, prop_oneof![4 => Just(0usize), 2 => Just(1), 1 => Just(2)], 0usize..3)
            .prop_map(|(c, p, z)| Extra::Calendar(c, p, z));
    let extra = prop_oneof![
        6 => calendar.clone(),
        1 => (1u64..=4).prop_map(Extra::Slots),
    ];
    let advance = prop_oneof![
        3 => 0u64..=2 * sec,
        3 => 0u64..=90 * sec,
        1 => 0u64..=2 * 3_600 * sec,
    ];
    let budget = prop_oneof![
        1 => Just(None),
        2 => (0u64..=180 * sec).prop_map(Some),
        2 => (0u64..=3 * 3_600 * sec).prop_map(Some),
    ];
    let cost = || prop_oneof![8 => Just(1u64), 2 => 0u64..=3];
    let step = prop_oneof![
        2 => advance.prop_map(Step::Advance),
        8 => (0u8..2, cost(), proptest::collection::vec(cost(), 5), budget)
            .prop_map(|(key, cost, costs, shape)| Step::Check { key, cost, costs, shape }),
        1 => (0usize..64, 0u64..=3).prop_map(|(which, cost)| Step::Settle { which, cost }),
        1 => (0usize..64).prop_map(|which| Step::Release { which }),
    ];
    // Two seconds before a minute ends, or near daylight-saving changes in Berlin and New York.
    let start = prop_oneof![
        2 => (0u64..=1_000_000).prop_map(move |m| (m * 60 + 58) * sec),
        1 => (0u64..=7_200 * sec).prop_map(|d| instant("2025-03-30T00:00:00Z") + d),
        1 => (0u64..=7_200 * sec).prop_map(|d| instant("2025-11-02T05:00:00Z") + d),
    ];
    (
        proptest::collection::vec(tier, 1..=2),
        prop_oneof![
            3 => proptest::collection::vec(calendar, 1..=2),
            1 => proptest::collection::vec(extra, 1..=2),
        ],
        start,
        proptest::collection::vec(step, 20..=80),
    )
        .prop_map(move |parts| Trace::new(algorithm, parts))
}

#[test]
fn shaping_with_long_and_calendar_tiers_decides_exactly_like_memory_for_every_algorithm() {
    let Some(server) = Server::start("redis-server") else { return };
    let url = server.url();
    for (a, algorithm) in Algorithm::ALL.into_iter().enumerate() {
        let seed = u8::try_from(a).unwrap() + 1;
        seeded_differential(shaping_trace(algorithm), seed, 64, |clock, prefix| {
            fake_clock_store(RedisStore::builder(&url), clock, format!("shape{a}-{prefix}"))
        });
    }
}

/// Of 100 requests of one key against 5 an hour: how many a limiter built for each request
/// from one policy admits, and how many two layers built separately from one policy admit
/// together (alternating), on `store`.
async fn one_policy_one_budget<St: Store>(store: St) -> (usize, usize) {
    use tower::{Layer as _, ServiceExt as _};
    let policy = Policy::single("per-request", Quota::per_hour(5)).unwrap();
    let mut per_request = 0;
    for _ in 0..100 {
        let limiter = Limiter::with_store(policy.clone(), store.clone()).unwrap();
        per_request += usize::from(limiter.check(&Key::text("k"), 1).await.unwrap().is_allowed());
    }
    let policy = Policy::single("two-layers", Quota::per_hour(5)).unwrap();
    let layer = || {
        let layer = RateLimitLayer::builder(policy.clone()).key(GlobalKey).store(store.clone());
        layer.build().unwrap().layer(support::ok_service())
    };
    let (a, b) = (layer(), layer());
    let mut layered = 0;
    for i in 0..100 {
        let svc = if i % 2 == 0 { a.clone() } else { b.clone() };
        let res = svc.oneshot(http::Request::new(axum::body::Body::empty())).await.unwrap();
        layered += usize::from(res.status() == http::StatusCode::OK);
    }
    (per_request, layered)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_policy_on_one_store_is_one_budget_in_memory_as_on_redis() {
    let Some(server) = Server::start("redis-server") else { return };
    let redis = RedisStore::builder(server.url()).timeout(Duration::from_secs(10)).build().unwrap();
    assert_eq!(one_policy_one_budget(redis).await, (5, 5));
    assert_eq!(one_policy_one_budget(MemoryStore::new()).await, (5, 5));
}

// ---------------------------------------------------------------------------------------------
// Penalty boxes.

/// A 10-a-minute tier with a 15-minute block, and the third-refusal-within-a-minute variant,
/// decide on Redis (the store's injected clock) exactly as the scenarios say: blocked for
/// exactly 15 minutes, another key untouched. The state key's TTL covers the block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_breach_blocks_the_key_for_exactly_the_block_on_redis() {
    let Some(server) = Server::start("redis-server") else { return };
    let clock = FakeClock::new();
    clock.set(3_600_000_000_000);
    let url = server.url();
    scenarios::every_scenario(&clock, |policy| {
        let store = fake_clock_store(RedisStore::builder(&url), clock.clone(), "box:".into());
        async move { Limiter::with_store(policy, store).unwrap() }
    })
    .await;
    // Without a grace, a blocked key's state lives exactly as long as its block.
    let store = RedisStore::builder(server.url())
        .clock(clock.clone())
        .prefix("ttl:")
        .ttl_grace(Duration::ZERO)
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let policy = scenarios::fifteen_minute_policy("ttl");
    let limiter = Limiter::with_store(policy.clone(), store.clone()).unwrap();
    let key = Key::text("erin");
    for _ in 0..9 {
        assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    }
    let first_write = std::time::Instant::now();
    assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    let day_ttl = pttl(&mut server.conn(), &state_key(&store, &policy, &key));
    let first_read = i64::try_from(first_write.elapsed().as_millis()).unwrap() + 2;
    let read = std::time::Instant::now();
    assert!(!limiter.check(&key, 1).await.unwrap().is_allowed());
    let ttl = pttl(&mut server.conn(), &state_key(&store, &policy, &key));
    // The calendar day keeps the state until its end (22 h 59 min on); the block alone would
    // keep it 15 min. A penalty on a rate tier alone shows the block's own TTL. (The TTL runs
    // down in real time after each write, and the fake clock gives both writes one expiry:
    // the first read may already have run down by up to what it took, however long a busy
    // machine took.)
    let waited = i64::try_from(read.elapsed().as_millis()).unwrap() + 2;
    assert!(
        ttl >= day_ttl - waited && ttl <= day_ttl + first_read,
        "{ttl} vs {day_ttl} ({waited} ms, first read {first_read} ms)"
    );
    let alone = Policy::builder("ttl-alone")
        .tier("minute", Quota::per_minute(10))
        .penalty("minute", Penalty::new(scenarios::MINUTE * 15))
        .build()
        .unwrap();
    let limiter = Limiter::with_store(alone.clone(), store.clone()).unwrap();
    // Each TTL runs down in real time from its write: allow what the reads took.
    let since = |at: std::time::Instant| i64::try_from(at.elapsed().as_millis()).unwrap() + 2;
    for _ in 0..9 {
        assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    }
    let written = std::time::Instant::now();
    assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    let before = pttl(&mut server.conn(), &state_key(&store, &alone, &key));
    let waited = since(written);
    assert!(before >= 60_000 - waited && before <= 60_000, "pttl {before}: the minute's refill");
    let written = std::time::Instant::now();
    assert!(!limiter.check(&key, 1).await.unwrap().is_allowed());
    let ttl = pttl(&mut server.conn(), &state_key(&store, &alone, &key));
    let waited = since(written);
    assert!(ttl >= 900_000 - waited && ttl <= 900_000, "pttl {ttl} ({waited} ms)");
}

/// Random traces with a penalty box on one of their tiers (any algorithm, with other kinds
/// now and then; blocks of 1 ms to 20 s, 1 to 4 refusals within up to 10 s), through both
/// stores on one fake clock, from a fixed seed: not one decision differs.
#[test]
fn penalty_boxes_decide_exactly_like_memory() {
    let Some(server) = Server::start("redis-server") else { return };
    let url = server.url();
    let penalty = (
        0usize..5,
        prop_oneof![
            2 => 1_000_000u64..=20_000_000_000,
            1 => (1u64..=200).prop_map(|k| k * 10_000_000),
        ],
        prop_oneof![2 => Just(1u32), 3 => 2u32..=4],
        // Mostly on the 10 ms grid of the grid traces, so that refusals land exactly on the
        // window's edge.
        prop_oneof![
            1 => 1_000_000u64..=10_000_000_000,
            2 => (1u64..=100).prop_map(|k| k * 10_000_000),
        ],
    );
    // Half of them with the clock stepping back between checks.
    let traces =
        (proptest::bool::ANY.prop_flat_map(trace), penalty).prop_map(|(mut trace, penalty)| {
            trace.penalty = Some(penalty);
            trace
        });
    seeded_differential(traces, 24, 256, |clock, prefix| {
        fake_clock_store(RedisStore::builder(&url), clock, format!("penalty{prefix}"))
    });
}

// ---------------------------------------------------------------------------------------------
// Local refusals: a key Redis refused until an instant is refused by the store itself until
// then, with the decision Redis would give, and without a script call.

/// Script calls the server has run (`EVALSHA` in `INFO commandstats`).
fn script_calls(conn: &mut redis::Connection) -> u64 {
    let info: String = redis::cmd("INFO").arg("commandstats").query(conn).unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

/// Traces that hammer keys already refused: many cost-1 checks a few milliseconds apart, now
/// and then another cost, shaping budget or settlement, on one or two keys.
fn hot_trace() -> impl Strategy<Value = Trace> {
    let step = || {
        let cost = || prop_oneof![8 => Just(1u64), 2 => 0u64..=3];
        let check = (
            0u8..2,
            cost(),
            proptest::collection::vec(cost(), 5),
            proptest::option::weighted(0.15, 0u64..=1_000_000_000),
        )
            .prop_map(|(key, cost, costs, shape)| Step::Check { key, cost, costs, shape });
        prop_oneof![
            1 => (0u64..=1_000).prop_map(Step::Advance),
            3 => (0u64..=20_000_000).prop_map(Step::Advance),
            1 => (0u64..=1_000_000_000).prop_map(Step::Advance),
            12 => check,
            1 => (0usize..64, 0u64..=2).prop_map(|(which, cost)| Step::Settle { which, cost }),
        ]
    };
    (proptest::sample::select(Algorithm::ALL.to_vec()), proptest::bool::weighted(0.3))
        .prop_flat_map(move |(algorithm, grid)| {
            (
                proptest::collection::vec(tier(algorithm, grid), 1..=2),
                prop_oneof![
                    3 => Just(Vec::new()),
                    1 => (1u64..=20, 0usize..2).prop_map(|(c, p)| vec![Extra::Calendar(c, p, 0)]),
                ],
                0u64..=1_000_000_000_000,
                proptest::collection::vec(step(), 20..=150),
            )
                .prop_map(move |parts| Trace::new(algorithm, parts))
        })
}

/// The differential with local refusals on (the default) and off, on traces of refused hot
/// keys: both decide exactly like the memory store, so exactly like each other, and the
/// store with them on answered many checks itself.
#[test]
fn local_refusals_decide_exactly_like_memory_store_and_like_redis_without_them() {
    let Some(server) = Server::start("redis-server") else { return };
    let url = server.url();
    let on = differential_of(hot_trace(), 128, |clock, prefix| {
        fake_clock_store(RedisStore::builder(&url), clock, format!("on{prefix}"))
    });
    let off = differential_of(hot_trace(), 32, |clock, prefix| {
        fake_clock_store(RedisStore::builder(&url).local_refusals(0), clock, format!("off{prefix}"))
    });
    assert_eq!(off, 0);
    assert!(on > 500, "only {on} checks were answered locally");
}

/// `check` through a Redis store and a memory store: their decisions are equal.
async fn same(
    (store, bound, memory, m_bound): (
        &RedisStore,
        &<RedisStore as Store>::Bound,
        &MemoryStore,
        &<MemoryStore as Store>::Bound,
    ),
    check: Check<'_>,
) -> Decision {
    let r = store.check(bound, check).await.unwrap().decision;
    let m = memory.check(m_bound, check).await.unwrap().decision;
    assert_eq!(r, m);
    r
}

/// A refused hot key costs no script call until its refusal ends; each local answer is the
/// memory store's decision at that instant (retry_after counting down to the same instant);
/// at that instant Redis is asked again and admits.
#[tokio::test]
async fn a_refused_hot_key_asks_redis_only_when_its_refusal_ends() {
    let Some(server) = Server::start("redis-server") else { return };
    let mut conn = server.conn();
    let clock = FakeClock::new();
    clock.set(1_000_000_000_000);
    let store = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "hot:".into());
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let policy = Policy::builder("hot")
        .tier("second", Quota::per_second(2))
        .tier("hour", Quota::per_hour(100))
        .build()
        .unwrap();
    let (bound, m_bound) = (store.bind(&policy).unwrap(), memory.bind(&policy).unwrap());
    let key = Key::text("hot");
    let pair = (&store, &bound, &memory, &m_bound);
    let both = |check| same(pair, check);
    assert!(both(Check::new(&key, 1)).await.is_allowed());
    assert!(both(Check::new(&key, 1)).await.is_allowed());
    let refused = both(Check::new(&key, 1)).await;
    let retry = refused.retry_after().unwrap();
    assert_eq!(retry, Duration::from_millis(500));
    let calls = script_calls(&mut conn);
    assert_eq!(bound.refused_locally(), 0);
    // 499 more checks, a millisecond apart, up to a nanosecond before the refusal ends.
    for ms in 1..500 {
        clock.advance(Duration::from_millis(1));
        let d = both(Check::new(&key, 1)).await;
        assert_eq!(d.retry_after(), Some(retry - Duration::from_millis(ms)));
    }
    clock.advance(Duration::from_millis(1) - Duration::from_nanos(1));
    let last = both(Check::new(&key, 1)).await;
    assert_eq!(last.retry_after(), Some(Duration::from_nanos(1)));
    // Through the synchronous path too.
    let sync = store.check_sync(&bound, Check::new(&key, 1)).unwrap().unwrap().decision;
    assert_eq!(sync, last);
    assert_eq!(script_calls(&mut conn), calls);
    assert_eq!(bound.refused_locally(), 501);
    // At the refusal's end: Redis again, which admits.
    clock.advance(Duration::from_nanos(1));
    assert!(store.check_sync(&bound, Check::new(&key, 1)).is_none());
    assert!(both(Check::new(&key, 1)).await.is_allowed());
    assert_eq!(script_calls(&mut conn), calls + 1);
    // Another cost, or a shaping budget, is not the check that was refused: Redis decides.
    both(Check::new(&key, 1)).await;
    let before = script_calls(&mut conn);
    both(Check::new(&key, 2)).await;
    both(Check::new(&key, 1).shape(Duration::from_millis(1))).await;
    assert_eq!(script_calls(&mut conn), before + 2);
}

/// What this instance gives back forgets the key's refusal: the next check asks Redis, which
/// admits with the units given back.
#[tokio::test]
async fn a_settlement_through_this_instance_clears_the_refusal() {
    let Some(server) = Server::start("redis-server") else { return };
    let mut conn = server.conn();
    let clock = FakeClock::new();
    clock.set(1_000_000_000_000);
    let store = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "set:".into());
    for algorithm in [Algorithm::FixedWindow, Algorithm::Gcra] {
        let policy = Policy::builder(format!("{algorithm:?}"))
            .algorithm(algorithm)
            .tier("minute", Quota::per_minute(2))
            .build()
            .unwrap();
        let bound = store.bind(&policy).unwrap();
        let key = Key::text("alice");
        let a = store.check(&bound, Check::new(&key, 1).with_ticket()).await.unwrap();
        let b = store.check(&bound, Check::new(&key, 1).with_ticket()).await.unwrap();
        assert!(a.decision.is_allowed() && b.decision.is_allowed());
        for _ in 0..3 {
            let d = store.check(&bound, Check::new(&key, 1)).await.unwrap().decision;
            assert!(!d.is_allowed(), "{algorithm:?}");
        }
        assert_eq!(bound.refused_locally(), 2, "{algorithm:?}");
        assert_eq!(bound.local_refusals(), 1);
        // The first ticket gives its unit back.
        store.settle(&bound, a.ticket.unwrap(), 0).await.unwrap();
        assert_eq!(bound.local_refusals(), 0);
        let calls = script_calls(&mut conn);
        let d = store.check(&bound, Check::new(&key, 1)).await.unwrap().decision;
        assert!(d.is_allowed(), "{algorithm:?}: the refund was not seen");
        assert_eq!(script_calls(&mut conn), calls + 1);
        // Settling a ticket tier by tier forgets it too.
        let mut b = b.ticket.unwrap();
        store.check(&bound, Check::new(&key, 1)).await.unwrap();
        assert_eq!(bound.local_refusals(), 1);
        store.settle_tiers(&bound, &mut b, &[(0, 0)]).await.unwrap();
        assert_eq!(bound.local_refusals(), 0);
        assert!(store.check(&bound, Check::new(&key, 1)).await.unwrap().decision.is_allowed());
    }
}

/// A task looping on checks that the instance answers itself (a refused key) yields now and
/// then, as a check sent to Redis would: on a one-thread runtime, another task runs while the
/// loop is still going.
#[tokio::test]
async fn a_loop_of_checks_answered_locally_lets_other_tasks_run() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let Some(server) = Server::start("redis-server") else { return };
    let clock = FakeClock::new();
    clock.set(1_000_000_000_000);
    let store = fake_clock_store(RedisStore::builder(server.url()), clock, "coop:".into());
    let policy = Policy::single("coop", Quota::per_minute(1)).unwrap();
    let limiter = Limiter::with_store(policy, store).unwrap();
    let key = Key::text("alice");
    assert!(limiter.check(&key, 1).await.unwrap().is_allowed());
    assert!(!limiter.check(&key, 1).await.unwrap().is_allowed());
    let ran = Arc::new(AtomicBool::new(false));
    let other = tokio::spawn({
        let ran = Arc::clone(&ran);
        async move { ran.store(true, Ordering::SeqCst) }
    });
    let mut ran_during = false;
    for _ in 0..1_000 {
        assert!(!limiter.check(&key, 1).await.unwrap().is_allowed());
        ran_during |= ran.load(Ordering::SeqCst);
    }
    assert!(ran_during, "the other task never ran during 1,000 local refusals");
    assert_eq!(limiter.bound().refused_locally(), 1_000);
    other.await.unwrap();
}

/// A concurrency tier's slot can come back early (released on another instance): its
/// refusals are never answered locally, and neither are those of a policy that has one.
#[tokio::test]
async fn concurrency_tiers_are_never_answered_locally() {
    let Some(server) = Server::start("redis-server") else { return };
    let mut conn = server.conn();
    let clock = FakeClock::new();
    clock.set(1_000_000_000_000);
    let store = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "conc:".into());
    let policy = Policy::builder("conc")
        .tier("minute", Quota::per_minute(2))
        .concurrency("slots", Concurrency::new(1))
        .build()
        .unwrap();
    let bound = store.bind(&policy).unwrap();
    let key = Key::text("alice");
    let held = store.check(&bound, Check::new(&key, 1).with_ticket()).await.unwrap();
    assert!(held.decision.is_allowed());
    let calls = script_calls(&mut conn);
    // Refused by the slots, then by the rate once the slot is free again.
    for _ in 0..5 {
        let d = store.check(&bound, Check::new(&key, 1)).await.unwrap().decision;
        assert_eq!(d.violated().collect::<Vec<_>>(), [1]);
    }
    store.release(&bound, held.ticket.unwrap()).await.unwrap();
    // Kept until the calls are counted: dropped, its slot is given back by a call of its own
    // (spawned, so at a time of the runtime's choosing).
    let again = store.check(&bound, Check::new(&key, 1)).await.unwrap();
    assert!(again.decision.is_allowed());
    for _ in 0..5 {
        let d = store.check(&bound, Check::new(&key, 1)).await.unwrap().decision;
        assert!(!d.is_allowed() && d.tiers()[0].is_violated());
    }
    assert_eq!(script_calls(&mut conn), calls + 1 + 5 + 1 + 5);
    drop(again);
    assert_eq!((bound.refused_locally(), bound.local_refusals()), (0, 0));
}

/// A flood of distinct refused keys replaces entries: the map never holds more than its
/// capacity, and every refusal is still answered exactly (by Redis once evicted).
#[tokio::test]
async fn a_flood_of_refused_keys_stays_within_the_capacity() {
    let Some(server) = Server::start("redis-server") else { return };
    let clock = FakeClock::new();
    clock.set(1_000_000_000_000);
    let builder = RedisStore::builder(server.url()).local_refusals(32);
    let store = fake_clock_store(builder, clock.clone(), "flood:".into());
    let policy = Policy::single("flood", Quota::per_hour(1)).unwrap();
    let bound = store.bind(&policy).unwrap();
    let keys: Vec<Key> = (0..400).map(|i| Key::text(format!("k{i}"))).collect();
    for key in &keys {
        assert!(store.check(&bound, Check::new(key, 1)).await.unwrap().decision.is_allowed());
        let d = store.check(&bound, Check::new(key, 1)).await.unwrap().decision;
        assert_eq!(d.retry_after(), Some(Duration::from_secs(3600)));
        assert!(bound.local_refusals() <= 32, "{} entries", bound.local_refusals());
    }
    assert!(bound.local_refusals() >= 16);
    // The keys held are answered at once, the others by Redis: all with the same decision.
    clock.advance(Duration::from_secs(1));
    let held = bound.local_refusals();
    let mut answered = 0;
    for key in &keys {
        if let Some(verdict) = store.check_sync(&bound, Check::new(key, 1)) {
            assert_eq!(verdict.unwrap().decision.retry_after(), Some(Duration::from_secs(3599)));
            answered += 1;
        }
    }
    assert_eq!(answered, held);
    for key in &keys {
        let d = store.check(&bound, Check::new(key, 1)).await.unwrap().decision;
        assert_eq!(d.retry_after(), Some(Duration::from_secs(3599)));
        assert!(bound.local_refusals() <= 32);
    }
}

/// On the server's clock (no injected clock): refusals are answered locally, each counting
/// down from the one Redis gave, until the key is admitted again.
#[tokio::test]
async fn on_server_time_a_refusal_is_answered_locally_until_it_ends() {
    let Some(server) = Server::start("redis-server") else { return };
    let store = RedisStore::builder(server.url()).prefix("srv:").build().unwrap();
    let policy = Policy::single("srv", Quota::per_second(5).with_burst(1)).unwrap();
    let bound = store.bind(&policy).unwrap();
    let key = Key::text("alice");
    assert!(store.check(&bound, Check::new(&key, 1)).await.unwrap().decision.is_allowed());
    let d = store.check(&bound, Check::new(&key, 1)).await.unwrap().decision;
    let mut last = d.retry_after().unwrap();
    assert!(last <= Duration::from_millis(200));
    loop {
        let d = store.check(&bound, Check::new(&key, 1)).await.unwrap().decision;
        let Some(retry) = d.retry_after() else { break };
        // Local answers count on an estimate of the server's clock that leads it by up to a
        // round trip, so Redis's next answer may be that much longer.
        assert!(retry <= last + Duration::from_millis(20), "{retry:?} after {last:?}");
        last = retry;
        tokio::task::yield_now().await;
    }
    assert!(bound.refused_locally() > 0);
}

// ---------------------------------------------------------------------------------------------
// Reserved capacity by priority.

/// The reserve scenarios decide on Redis (the store's injected clock) exactly as they say: each
/// class refused at its own threshold with its own retry, the critical reserve never taken by
/// the lower classes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_class_decides_exactly_at_its_threshold_on_redis() {
    let Some(server) = Server::start("redis-server") else { return };
    let clock = FakeClock::new();
    clock.set(3_600_000_000_000);
    let url = server.url();
    priorities::every_scenario(&clock, |policy| {
        let store = fake_clock_store(RedisStore::builder(&url), clock.clone(), "class:".into());
        async move { Limiter::with_store(policy, store).unwrap() }
    })
    .await;
}

/// 3x overload with a mix of classes on Redis: no critical request refused, the total within
/// 1 % of the limit; and the same counts as in memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_times_overload_refuses_no_critical_request_on_redis() {
    let Some(server) = Server::start("redis-server") else { return };
    let clock = FakeClock::new();
    clock.set(3_600_000_000_000);
    let store = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "ov:".into());
    let limiter = Limiter::with_store(priorities::overload_policy("overload"), store).unwrap();
    let on_redis = priorities::three_times_overload(&clock, &limiter).await;
    let clock = FakeClock::new();
    clock.set(3_600_000_000_000);
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let limiter = Limiter::with_store(priorities::overload_policy("overload"), memory).unwrap();
    let in_memory = priorities::overload(&clock, &limiter, 30).await;
    assert_eq!(on_redis, in_memory);
}

/// Random traces (GCRA, other kinds and penalty boxes now and then) with reserves on their
/// first tier and checks of every class, through both stores on one fake clock, from a fixed
/// seed: not one decision differs.
#[test]
fn reserves_decide_exactly_like_memory() {
    let Some(server) = Server::start("redis-server") else { return };
    let url = server.url();
    // Half of them with the clock stepping back between checks.
    // Now and then a penalty box too: a refusal at a class's threshold is a breach.
    let penalty = proptest::option::weighted(
        0.3,
        (0usize..5, 1_000_000u64..=20_000_000_000, 1u32..=3, 1_000_000u64..=10_000_000_000),
    );
    let traces = (
        proptest::bool::ANY.prop_flat_map(trace),
        (0u64..=3, 0u64..=3),
        proptest::collection::vec(0u8..3, 80),
        penalty,
    )
        .prop_map(|(mut trace, reserve, classes, penalty)| {
            trace.algorithm = Algorithm::Gcra;
            trace.reserve = Some(reserve);
            trace.classes = classes;
            trace.penalty = penalty;
            trace
        });
    seeded_differential(traces, 5, 256, |clock, prefix| {
        fake_clock_store(RedisStore::builder(&url), clock, format!("reserve{prefix}"))
    });
}

/// The same with most checks shaped, critical reserves of at least an eighth of the tier and
/// a third of the checks critical: the lower classes' schedules push the tier's TAT past their
/// line, and critical requests are admitted ahead of them on the tier's line (see `Reserve`),
/// alike on both stores, the clock stepping back in half of them.
#[test]
fn reserves_under_shaping_decide_exactly_like_memory() {
    let Some(server) = Server::start("redis-server") else { return };
    let url = server.url();
    let traces = (
        proptest::bool::ANY.prop_flat_map(trace),
        (1u64..=3, 0u64..=3),
        proptest::collection::vec(0u8..3, 80),
        proptest::collection::vec(proptest::option::weighted(0.8, 0u64..=2_000_000_000), 80),
    )
        .prop_map(|(mut trace, reserve, classes, budgets)| {
            trace.algorithm = Algorithm::Gcra;
            trace.reserve = Some(reserve);
            trace.classes = classes;
            for (step, budget) in trace.steps.iter_mut().zip(budgets) {
                if let Step::Check { shape, .. } = step {
                    *shape = budget;
                }
            }
            trace
        });
    seeded_differential(traces, 7, 256, |clock, prefix| {
        fake_clock_store(RedisStore::builder(&url), clock, format!("reshape{prefix}"))
    });
}

/// A refusal of one priority class is not the answer for another: a standard request refused
/// at the critical reserve is refused locally for standard requests only, and a critical one
/// asks Redis, which admits it.
#[tokio::test]
async fn a_local_refusal_is_kept_per_priority_class() {
    let Some(server) = Server::start("redis-server") else { return };
    let mut conn = server.conn();
    let clock = FakeClock::new();
    clock.set(1_000_000_000_000);
    let store = fake_clock_store(RedisStore::builder(server.url()), clock.clone(), "prio:".into());
    let memory = MemoryStore::builder().clock(clock.clone()).build().unwrap();
    let policy = Policy::builder("prio")
        .tier("second", Quota::per_second(10))
        .reserve("second", Reserve::new().critical(5))
        .build()
        .unwrap();
    let (bound, m_bound) = (store.bind(&policy).unwrap(), memory.bind(&policy).unwrap());
    let pair = (&store, &bound, &memory, &m_bound);
    let key = Key::text("alice");
    let standard = Check::new(&key, 1);
    let critical = Check::new(&key, 1).with_priority(Priority::Critical);
    for _ in 0..5 {
        assert!(same(pair, standard).await.is_allowed());
    }
    assert!(!same(pair, standard).await.is_allowed());
    assert!(!same(pair, standard).await.is_allowed());
    assert_eq!(bound.refused_locally(), 1);
    let calls = script_calls(&mut conn);
    assert!(same(pair, critical).await.is_allowed());
    assert_eq!(script_calls(&mut conn), calls + 1);
    assert_eq!(bound.refused_locally(), 1);
}
