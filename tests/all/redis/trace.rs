//! Random traces for the differential tests: policies, steps and their replay through
//! `MemoryStore` and `RedisStore` on one fake clock.

use super::*;

// ---------------------------------------------------------------------------------------------
// Differential traces: the same random requests through MemoryStore and RedisStore on one
// fake clock must give identical decisions. Policies are request rates (any algorithm), and
// now and then mix in tiers of other kinds: concurrency slots, calendar windows (UTC, Berlin,
// New York; traces start near daylight-saving changes too), rates counting other units.
// Checks then carry a cost per tier, and tickets are settled tier by tier and released.

#[derive(Debug, Clone)]
pub(super) enum Step {
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
pub(super) enum Extra {
    /// A concurrency tier of this many slots.
    Slots(u64),
    /// A calendar tier: count, period (minute, hour, day, month), zone (UTC, Berlin, New York).
    Calendar(u64, usize, usize),
    /// A rate (of the trace's algorithm) counting request bytes, response bytes or reported
    /// units: count, period in ns, burst, unit.
    Units(u64, u64, u64, usize),
}

#[derive(Debug, Clone)]
pub(super) struct Trace {
    pub(super) algorithm: Algorithm,
    /// `(count, period in ns, burst)` per tier.
    pub(super) tiers: Vec<(u64, u64, u64)>,
    /// Tiers of other kinds, after those.
    pub(super) extra: Vec<Extra>,
    /// The clock's first instant, in nanoseconds.
    pub(super) start: u64,
    pub(super) steps: Vec<Step>,
    /// A penalty box on a tier: `(tier, block ns, refusals, window ns)`, the tier counted over
    /// the rates then the other kinds (a concurrency tier, which cannot have one, gives it to
    /// the first rate).
    pub(super) penalty: Option<(usize, u64, u32, u64)>,
    /// Reserves on the first rate tier, in eighths of its capacity: `(critical, standard)`
    /// (each 0 to 3, so at most 6/8 of it; the trace then runs GCRA).
    pub(super) reserve: Option<(u64, u64)>,
    /// The class of the check at each step (0 critical, 1 standard, 2 sheddable; standard
    /// past the end).
    pub(super) classes: Vec<u8>,
}

/// Long enough that no lease expires within a trace (in memory slots do not expire).
const TRACE_LEASE: Duration = Duration::from_secs(20 * 365 * 86_400);

/// A trace's tiers, other kinds, first instant and steps, as the strategies draw them.
type TraceParts = (Vec<(u64, u64, u64)>, Vec<Extra>, u64, Vec<Step>);

impl Trace {
    /// A trace without penalty boxes, reserves or classes.
    pub(super) fn new(algorithm: Algorithm, (tiers, extra, start, steps): TraceParts) -> Self {
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

    pub(super) fn policy(&self) -> Policy {
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

pub(super) fn tier(algorithm: Algorithm, grid: bool) -> impl Strategy<Value = (u64, u64, u64)> {
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

pub(super) fn extra(algorithm: Algorithm, grid: bool) -> impl Strategy<Value = Extra> {
    prop_oneof![
        (1u64..=4).prop_map(Extra::Slots),
        (1u64..=20, 0usize..4, 0usize..3).prop_map(|(c, p, z)| Extra::Calendar(c, p, z)),
        (tier(algorithm, grid), 0usize..3).prop_map(|((c, p, b), u)| Extra::Units(c, p, b, u)),
    ]
}

/// `grid`: every advance a multiple of 10 ms, like the periods, so that instants land exactly
/// on window and expiry edges. `back`: clock steps both ways between checks, settlements
/// and releases.
pub(super) fn step(grid: bool, back: bool) -> impl Strategy<Value = Step> {
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
    let check = check_step(3, cost, 0.4, 3_000_000_000);
    let advance = advance.prop_map(Step::Advance);
    let settle = (0usize..64, 0u64..=8).prop_map(|(which, cost)| Step::Settle { which, cost });
    let part = (0usize..64, 0usize..8, 0u64..=8).prop_map(|(which, tier, cost)| Step::SettleTier {
        which,
        tier,
        cost,
    });
    let release = (0usize..64).prop_map(|which| Step::Release { which });
    // One union each way (a step back of weight 0 would draw other traces from the seeds).
    if back {
        let back = prop_oneof![0u64..=1_000, 0u64..=300_000_000, 0u64..=6_000_000_000];
        let back = back.prop_map(Step::Back);
        return prop_oneof![2 => advance, 2 => back, 7 => check, 1 => settle, 1 => part, 1 => release]
            .boxed();
    }
    prop_oneof![2 => advance, 7 => check, 1 => settle, 1 => part, 1 => release].boxed()
}

/// A check on one of `keys` keys, of a cost `cost` draws (and one per tier), shaped with a
/// budget of up to `max_shape` ns at odds `shaped`.
pub(super) fn check_step<C: Strategy<Value = u64>>(
    keys: u8,
    cost: impl Fn() -> C,
    shaped: f64,
    max_shape: u64,
) -> impl Strategy<Value = Step> {
    (
        0u8..keys,
        cost(),
        proptest::collection::vec(cost(), 5),
        proptest::option::weighted(shaped, 0u64..=max_shape),
    )
        .prop_map(|(key, cost, costs, shape)| Step::Check { key, cost, costs, shape })
}

/// Nanoseconds since the epoch of an RFC 3339 instant.
pub(super) fn instant(s: &str) -> u64 {
    let ts: jiff::Timestamp = s.parse().unwrap();
    u64::try_from(ts.as_nanosecond()).unwrap()
}

/// `back`: see [`step`].
pub(super) fn trace(back: bool) -> impl Strategy<Value = Trace> {
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

pub(super) fn keys() -> [Key; 3] {
    [Key::text("alice"), Key::Ip("203.0.113.7".parse().unwrap()), Key::Global]
}

/// Replays `trace` through both stores, calling them directly (a store's own decisions, no
/// waiting for slots); the first difference is the error. Returns how many checks the Redis
/// store answered from its local refusals.
pub(super) async fn replay(
    store: RedisStore,
    clock: FakeClock,
    trace: &Trace,
) -> Result<u64, String> {
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
pub(super) fn differential(cases: u32, connect: impl Fn(FakeClock, String) -> RedisStore) {
    differential_of(trace(false), cases, connect);
}

/// The seeds of the traces [`differential_of`] runs in CI, half of its cases each.
const DIFFERENTIAL_SEEDS: [u8; 2] = [0x3c, 0xd1];

/// [`differential`] of `traces`: in CI the same `cases` traces on every run (from
/// [`DIFFERENTIAL_SEEDS`]); under `TOLLGATE_LONG_TESTS=1` ten times as many, drawn at random.
/// Returns how many checks were answered from local refusals.
pub(super) fn differential_of(
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
pub(super) fn seeded_differential(
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

/// Replays kept `traces`, one after the other on one redis-server, as [`differential_in`]
/// replays a drawn one (the clock at its start).
pub(super) fn replay_kept(traces: impl IntoIterator<Item = Trace>) {
    let Some(server) = Server::start("redis-server") else { return };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    for trace in traces {
        let (clock, store) = clocked(RedisStore::builder(server.url()), trace.start, "kept:");
        rt.block_on(replay(store, clock, &trace)).unwrap();
    }
}

/// The stores the differential tests connect with: on `server`, each reading the clock it is
/// given, its keys under `prefix` and then the case's own prefix.
pub(super) fn stores_on(server: &Server, prefix: &str) -> impl Fn(FakeClock, String) -> RedisStore {
    let (url, prefix) = (server.url(), prefix.to_owned());
    move |clock, case| fake_clock_store(RedisStore::builder(&url), clock, format!("{prefix}{case}"))
}

/// [`differential`] on a `bin` server the test starts (skipped without it), `cases` traces.
pub(super) fn differential_on(bin: &str, cases: u32) {
    let Some(server) = Server::start(bin) else { return };
    differential(cases, stores_on(&server, ""));
}

pub(super) fn fake_clock_store(
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
