//! Differential tests of the scripts on a throw-away `redis-server` (started by the integration
//! tests' helper, `tests/support/redis.rs`; skipped with a note when it is not installed,
//! except under `CI=true`): two ways the scripts decide the same thing must decide it alike,
//! batch after batch of generated records (made by [`Prepared`], as the store makes them),
//! on two databases of one server, their replies and stored state compared after each batch.
//!
//! - `lua/kinds.lua`'s flat path (`flat_batch`) against its general driver.
//! - `lua/gcra.lua`, the fast path of plain GCRA policies of whole-unit emission intervals,
//!   against the general scripts (`lua/rate.lua` and `lua/kinds.lua`) that decide every other
//!   policy of the rate family.
//!
//! Fixed seeds in CI; `TOLLGATE_LONG_TESTS=1` runs ten times as many batches per seed.

use std::collections::HashMap;
use std::time::Duration;

use super::*;
use crate::quota::{Calendar, Concurrency, Quota, Unit};

#[allow(dead_code, unreachable_pub, missing_docs)]
#[path = "../../../../tests/support/redis.rs"]
mod server;

const SECOND: u64 = 1_000_000_000;

/// The seeds CI runs (each test runs every one).
const SEEDS: [u64; 2] = [0x5eed_0001, 0x5eed_0002];

/// Batches per seed: `ci`, ten times as many under `TOLLGATE_LONG_TESTS=1`.
fn batches(ci: usize) -> usize {
    if std::env::var("TOLLGATE_LONG_TESTS").is_ok_and(|v| v == "1") { ci * 10 } else { ci }
}

/// Emission intervals (ns) the generated rate tiers draw from.
const INTERVALS: [u64; 4] = [50_000_000, 250_000_000, SECOND, 3 * SECOND];

/// Steps of the clock between batches (ns): none, a nanosecond, across half seconds and
/// minutes (calendar windows), and back 300 ms now and then (the stored guard).
fn step(rng: &mut fastrand::Rng, mut now: u64) -> u64 {
    if rng.u8(..10) == 0 {
        // On the next minute's boundary (a calendar window's end), or 1 ns before it.
        now = (now / (60 * SECOND) + 1) * 60 * SECOND - u64::from(rng.bool());
    }
    let steps: [i64; 11] = [
        0,
        0,
        1,
        1_000_000,
        100_000_000,
        250_000_000,
        499_999_999,
        500_000_000,
        3_000_000_000,
        20_000_000_000,
        61_000_000_000,
    ];
    let s = if rng.u8(..20) == 0 { -300_000_000 } else { steps[rng.usize(..steps.len())] };
    now.saturating_add_signed(s)
}

/// A rate tier of a whole-unit emission interval of [`INTERVALS`]: `count` per `count`
/// intervals, a burst of 1 to twice the count.
fn rate(rng: &mut fastrand::Rng) -> Quota {
    let interval = INTERVALS[rng.usize(..INTERVALS.len())];
    let count = rng.u64(1..=6);
    Quota::new(count, Duration::from_nanos(count * interval)).with_burst(rng.u64(1..=2 * count))
}

/// A rate tier whose span exceeds 2^50 ns: its policy counts in microseconds.
fn long_rate(rng: &mut fastrand::Rng) -> Quota {
    let count = rng.u64(1..=3);
    Quota::new(count, Duration::from_secs(count * 15 * 86_400)).with_burst(rng.u64(1..=count))
}

/// A script's reply as its doubles, or the server's error.
type Reply = Result<Vec<f64>, String>;

/// What a key holds after a batch: its value (a string's, or a sorted set's members and
/// scores; nil when absent), and when it expires, in nanoseconds of the scripts' clock (see
/// [`Side`]).
struct Stored {
    value: redis::Value,
    exists: bool,
    expires: Option<i128>,
}

impl fmt::Debug for Stored {
    /// A state string as its doubles.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.value {
            redis::Value::BulkString(b) => write!(f, "{:?}", doubles_of(b))?,
            other => write!(f, "{other:?}")?,
        }
        write!(f, " expiring at {:?}", self.expires)
    }
}

/// How far apart two expiries of one state may be (ns): a script's PX is whole milliseconds,
/// rounded up from an instant counted from the unit (1 ns or 1 us) its now falls in.
const EXPIRY_ROUNDING: i128 = 2_000_000;

/// Whether two keys hold the same and expire at the same instant.
fn same(a: &Stored, b: &Stored) -> bool {
    a.value == b.value && same_expiry(a, b)
}

/// Whether two keys both exist or not, and expire at the same instant (within
/// [`EXPIRY_ROUNDING`]).
fn same_expiry(a: &Stored, b: &Stored) -> bool {
    let expiry = match (a.expires, b.expires) {
        (Some(x), Some(y)) => (x - y).abs() <= EXPIRY_ROUNDING,
        (x, y) => x == y,
    };
    a.exists == b.exists && expiry
}

/// The doubles of a packed string.
fn doubles_of(bytes: &[u8]) -> Vec<f64> {
    bytes.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
}

/// A policy's tiers in brief, for failure messages: `kind(count, period, burst)`, and its unit.
fn brief(policy: &Policy) -> String {
    let tiers: Vec<String> = policy
        .tiers()
        .iter()
        .map(|t| {
            let r = t.rate;
            match &t.kind {
                Kind::Rate => format!("rate({}, {}, {})", r.count, r.period, r.burst),
                Kind::Concurrency(c) => format!("slots({}, {} ms)", c.max, c.ttl_ms),
                Kind::Calendar(_) => format!("minute({})", r.count),
            }
        })
        .collect();
    format!("{} unit {}: {}", policy.name(), policy.unit(), tiers.join(" "))
}

/// A script whose `SET ... PX` and `PEXPIRE` calls also log each key's TTL (ms) in the hash
/// `__px`, so that [`Side`] can keep the keys' expiries on the scripts' clock. Nothing else
/// changes: the script's `call` (its local `redis.call`) is wrapped.
fn logging(source: &str) -> String {
    let at = source.find("\nlocal call,").expect("the script binds `call`") + 1;
    let end = at + source[at..].find('\n').expect("a line");
    let wrap = "\ndo local rc = call; call = function(c, ...) \
                if c == 'SET' then local k, _, _, px = ...; rc('HSET', '__px', k, px) \
                elseif c == 'PEXPIRE' then local k, ms = ...; rc('HSET', '__px', k, ms) end \
                return rc(c, ...) end end";
    format!("{}{wrap}{}", &source[..end], &source[end..])
}

/// One database of the test server, on which the scripts decide at instants of a clock of
/// the test's (each batch's `now`), far from the server's: the keys' TTLs are kept on that
/// clock. After each call the keys it wrote are made persistent and their expiries (the
/// batch's now plus the TTL the script gave them, logged by [`logging`]) kept here; before
/// each call the keys whose expiry has passed are deleted ([`expire`]). The keys then expire
/// as they would were the scripts deciding on the server's clock, and never otherwise.
struct Side {
    conn: redis::Connection,
    expiries: HashMap<String, i128>,
}

impl Side {
    fn open(server: &server::Server, db: u8) -> Self {
        let mut conn = server.conn();
        redis::cmd("SELECT").arg(db).exec(&mut conn).expect("SELECT");
        redis::cmd("FLUSHDB").exec(&mut conn).expect("FLUSHDB");
        Self { conn, expiries: HashMap::new() }
    }

    /// Runs `script` (made by [`logging`]) on a batch of `checks` (each its key index into
    /// `keys`, its policy and its record) decided at `now` (ns); then reads what `read` hold.
    fn run(
        &mut self,
        script: &Script,
        now: u64,
        keys: &[String],
        checks: &[(usize, &PolicyArgs, &[f64])],
        read: &[&String],
    ) -> (Reply, Vec<Stored>) {
        let (policies, records) = batch(checks.iter().map(|(k, p, r)| (*k, *p, *r)));
        let mut inv = script.prepare_invoke();
        for k in keys {
            inv.key(k);
        }
        inv.arg(header(Now::At(now))).arg(policies).arg(records);
        let reply = inv.invoke::<Vec<u8>>(&mut self.conn).map_err(|e| e.to_string());
        let reply = reply.map(|b| doubles_of(&b));
        let (logged,): (HashMap<String, f64>,) = redis::pipe()
            .cmd("HGETALL")
            .arg("__px")
            .cmd("DEL")
            .arg("__px")
            .ignore()
            .query(&mut self.conn)
            .expect("the TTLs logged");
        let mut pipe = redis::pipe();
        for (k, ms) in &logged {
            #[allow(clippy::cast_possible_truncation)] // whole milliseconds below 2^53
            let ms = *ms as i128;
            self.expiries.insert(k.clone(), i128::from(now) + ms * 1_000_000);
            pipe.cmd("PERSIST").arg(k).ignore();
        }
        for k in read {
            if k.contains(":c:") {
                pipe.cmd("ZRANGE").arg(k).arg(0).arg(-1).arg("WITHSCORES");
            } else {
                pipe.cmd("GET").arg(k);
            }
            pipe.cmd("EXISTS").arg(k);
        }
        let values: Vec<redis::Value> = pipe.query(&mut self.conn).expect("read the keys");
        let stored = values
            .chunks_exact(2)
            .zip(read)
            .map(|(v, k)| {
                let exists: bool = redis::from_redis_value(&v[1]).expect("EXISTS");
                if !exists {
                    self.expiries.remove(*k);
                }
                let expires = self.expiries.get(*k).copied();
                assert!(!exists || expires.is_some(), "{k} was written without a TTL: {v:?}");
                Stored { value: v[0].clone(), exists, expires }
            })
            .collect();
        (reply, stored)
    }

    /// The number stored at `key` (0 when absent).
    fn counter(&mut self, key: &str) -> u64 {
        redis::cmd("GET").arg(key).query::<Option<u64>>(&mut self.conn).expect("GET").unwrap_or(0)
    }

    fn flush(&mut self) {
        redis::cmd("FLUSHDB").exec(&mut self.conn).expect("FLUSHDB");
        self.expiries.clear();
    }
}

/// Deletes, on both sides, the keys that either side has expiring at or before `now`.
fn expire(now: u64, a: &mut Side, b: &mut Side) {
    let now = i128::from(now);
    let mut gone: Vec<String> = Vec::new();
    for side in [&*a, &*b] {
        gone.extend(side.expiries.iter().filter(|(_, e)| **e <= now).map(|(k, _)| k.clone()));
    }
    for side in [a, b] {
        for k in &gone {
            side.expiries.remove(k);
            redis::cmd("DEL").arg(k).exec(&mut side.conn).expect("DEL");
        }
    }
}

/// The integers of a reply's part, as the store decodes them.
#[allow(clippy::cast_possible_truncation)] // integers below 2^53
fn ints(reply: &[f64]) -> Vec<i64> {
    reply.iter().map(|v| *v as i64).collect()
}

// ---------------------------------------------------------------------------------------------
// kinds.lua: the flat path against the general driver.

/// A policy the flat path takes (not plain; rate tiers of GCRA of whole-unit emission
/// intervals, no reserve, no penalty box): one to four tiers of rates, minute calendars and
/// concurrency limits in any order; one policy in three counts in microseconds.
fn flat_policy(rng: &mut fastrand::Rng, name: &str) -> Policy {
    let mut b = Policy::builder(name);
    let mut other = false;
    let mut rates = Vec::new();
    for t in 0..rng.usize(1..=4) {
        let tier = format!("t{t}");
        match rng.u8(..5) {
            0 | 1 => rates.push(tier),
            2 | 3 => {
                other = true;
                b = b.calendar(tier, Calendar::per_minute(rng.u64(1..=8)));
            }
            _ => {
                other = true;
                let ttl = [100, 300, 2000][rng.usize(..3)];
                let slots = Concurrency::new(rng.u64(1..=3)).with_ttl(Duration::from_millis(ttl));
                b = b.concurrency(tier, slots);
            }
        }
    }
    for (i, tier) in rates.into_iter().enumerate() {
        let mut q = rate(rng);
        // Rate tiers alone are plain (gcra.lua's) unless one counts other units.
        if i == 0 && !other {
            q = q.counting(Unit::RequestBytes);
        }
        b = b.tier(tier, q);
    }
    if rng.u8(..3) == 0 {
        b = b.tier("long", long_rate(rng));
    }
    let policy = b.build().expect("a valid policy");
    assert!(!policy.is_plain(), "{policy:?}");
    policy
}

/// The flat side's script: `Family::Rate`'s, counting in `__flat` the batches that take the
/// flat path (the general side runs it too, and must never take it).
fn counting_flat() -> Script {
    let marker = "if flat_batch() then";
    assert_eq!(KINDS_RATE_SOURCE.matches(marker).count(), 1, "kinds_flat.lua's branch");
    Script::new(&logging(&KINDS_RATE_SOURCE.replacen(
        marker,
        "if flat_batch() then redis.call('INCR', '__flat')",
        1,
    )))
}

/// A record of a batch and what the trace remembers of it.
enum Sent {
    /// A check of these per-tier costs, its slots' holder id and class (its reply follows).
    Check { key: usize, costs: Vec<u64>, holder: u64, class: Priority },
    /// A settlement (no reply).
    Settle,
}

/// `lua/kinds.lua` decides every batch its flat path takes (policed checks and releases of
/// policies whose rate tiers are GCRA of whole-unit emission intervals, beside calendar and
/// concurrency tiers, without reserves or penalty boxes) as its general driver does.
///
/// Invariant: the same batch run as is (database 0: the flat path, which the test checks it
/// took) and with a trailing check of a policy the flat path does not take, on a key of its
/// own (database 1: the general driver, which the test checks it took), gives the same reply
/// (but the trailing check's part) and leaves every key of the batch alike: equal values
/// (state strings, slot sets with their scores), expiring at the same instant of the scripts'
/// clock (see [`Side`] and [`same`]). Batches of one to five records over two keys of five random
/// policies (drawn again every 300 batches): the same key twice, costs 0 to above capacity,
/// every class, releases of slots held, released already or never held, and a clock that
/// crosses calendar windows and now and then steps back 300 ms.
#[test]
fn kinds_flat_path_decides_as_the_general_driver() {
    let Some(server) = server::Server::start("redis-server") else { return };
    let (mut flat, mut general) = (Side::open(&server, 0), Side::open(&server, 1));
    let script = counting_flat();
    // The forcing record: a plain policy of a non-whole emission interval (1/3 s).
    let force = Policy::single("force", Quota::new(3, Duration::from_secs(1))).expect("valid");
    let forced = Prepared::new(&force, 1000);
    let force_key = "force:00000000".to_owned();
    let force_record = forced.check(&[1], None, 0, Priority::Standard, 0);
    let classes = [Priority::Critical, Priority::Standard, Priority::Sheddable];
    let per_seed = batches(3000);
    for seed in SEEDS {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut now = 1_700_000_050 * SECOND;
        let mut policies: Vec<(Policy, Prepared)> = Vec::new();
        // Per (key, policy): the charges of checks admitted and not released.
        let mut held: HashMap<(usize, usize), Vec<Charges>> = HashMap::new();
        let mut next_holder = 1;
        // Batches that took the flat path on each side.
        let (mut took_flat, mut took_general) = (0, 0);
        // Checks limited, allowed and above capacity, and releases of slots held: the trace
        // reaches every one.
        let (mut seen, mut releases) = ([0u64; 4], 0);
        for n in 0..per_seed {
            if n % 300 == 0 {
                took_flat += flat.counter("__flat");
                took_general += general.counter("__flat");
                policies = (0..5)
                    .map(|i| {
                        let p = flat_policy(&mut rng, &format!("p{i}"));
                        let prepared = Prepared::new(&p, 1000);
                        assert_eq!(prepared.family, Family::Rate);
                        (p, prepared)
                    })
                    .collect();
                held.clear();
                flat.flush();
                general.flush();
            }
            now = step(&mut rng, now);
            let mut keys: Vec<String> = Vec::new();
            let mut records: Vec<(usize, usize, Vec<f64>)> = Vec::new();
            let mut sent = Vec::new();
            for _ in 0..rng.usize(1..=5) {
                let key = rng.usize(..2);
                let p = if rng.u8(..10) < 7 { key } else { rng.usize(..5) };
                let (policy, prepared) = &policies[p];
                let index = keys.len() + 1;
                keys.extend(prepared.keys(format!("k{key}p{p}:00000000")));
                let admitted = held.entry((key, p)).or_default();
                if !admitted.is_empty() && rng.u8(..10) < 4 {
                    // A release: of slots held, or (one in seven) of a holder that never held any.
                    let charges = if rng.u8(..7) == 0 {
                        let at = now / policy.unit();
                        policy
                            .tiers()
                            .iter()
                            .map(|t| Charge {
                                at,
                                cost: rng.u64(1..=2),
                                id: if matches!(t.kind, Kind::Concurrency(_)) {
                                    next_holder + 10_000_000
                                } else {
                                    0
                                },
                            })
                            .collect()
                    } else {
                        releases += 1;
                        admitted.swap_remove(rng.usize(..admitted.len()))
                    };
                    let same = |i: usize| charges[i].cost;
                    let release = rng.u8(..4) != 0;
                    records.push((index, p, prepared.settle(&charges, same, same, release, now)));
                    sent.push(Sent::Settle);
                } else {
                    let holder = next_holder;
                    next_holder += 1;
                    let costs: Vec<u64> = policy
                        .tiers()
                        .iter()
                        .map(|t| {
                            if rng.u8(..12) == 0 {
                                t.capacity_for(Priority::Critical) + 1
                            } else {
                                [0, 1, 1, 1, 2, 3, 4, 6][rng.usize(..8)]
                            }
                        })
                        .collect();
                    let class = classes[rng.usize(..3)];
                    records.push((index, p, prepared.check(&costs, None, holder, class, now)));
                    sent.push(Sent::Check { key, costs, holder, class });
                }
            }
            // Every key of the batch, once, to compare.
            let mut read: Vec<&String> = Vec::new();
            for k in &keys {
                if !read.contains(&k) {
                    read.push(k);
                }
            }
            let checks: Vec<(usize, &PolicyArgs, &[f64])> = records
                .iter()
                .map(|(k, p, r)| (*k, &*policies[*p].1.policy, r.as_slice()))
                .collect();
            expire(now, &mut flat, &mut general);
            let (a, state_a) = flat.run(&script, now, &keys, &checks, &read);
            let mut forcing_keys = keys.clone();
            forcing_keys.push(force_key.clone());
            let mut forcing = checks.clone();
            forcing.push((forcing_keys.len(), &*forced.policy, &force_record));
            let (b, state_b) = general.run(&script, now, &forcing_keys, &forcing, &read);
            let b = b.map(|mut b| {
                let end = b.len() - 2;
                b.drain(end - forced.check_reply_len()..end);
                b
            });
            let context = || {
                let policies: Vec<String> = policies.iter().map(|p| brief(&p.0)).collect();
                format!(
                    "seed {seed:#x}, batch {n}, now {now}, policies {policies:#?}, records {records:?}"
                )
            };
            assert_eq!(a, b, "replies differ (flat, general): {}", context());
            let a = a.unwrap_or_else(|e| panic!("the batch failed: {e}: {}", context()));
            for (k, (x, y)) in read.iter().zip(state_a.iter().zip(&state_b)) {
                assert!(same(x, y), "{k} differs (flat, general): {x:?} {y:?}: {}", context());
            }
            // The slots of admitted checks, for later releases.
            let mut at = 0;
            for (s, (_, p, _)) in sent.iter().zip(&records) {
                let Sent::Check { key, costs, holder, class } = s else { continue };
                let (policy, prepared) = &policies[*p];
                let part = ints(&a[at..at + prepared.check_reply_len()]);
                at += prepared.check_reply_len();
                seen[usize::try_from(part[0]).expect("an outcome")] += 1;
                let (_, charges) = decode_costs(policy, &|i| costs[i], *holder, *class, now, &part)
                    .expect("decodes");
                if let Some(charges) = charges.filter(|_| costs.iter().any(|c| *c > 0)) {
                    held.entry((*key, *p)).or_default().push(charges);
                }
            }
        }
        took_flat += flat.counter("__flat");
        took_general += general.counter("__flat");
        seen[3] = releases;
        assert!(
            seen.iter().all(|n| *n > 0),
            "limited, allowed, above capacity, released: {seen:?}"
        );
        let batches = u64::try_from(per_seed).expect("small");
        assert_eq!(took_flat, batches, "every batch took the flat path");
        assert_eq!(took_general, 0, "no forced batch took it");
        flat.flush();
        general.flush();
    }
}

// ---------------------------------------------------------------------------------------------
// gcra.lua against rate.lua and kinds.lua.

/// A plain GCRA policy of whole-unit emission intervals (gcra.lua's): one to three rate tiers;
/// one policy in three counts in microseconds.
fn gcra_policy(rng: &mut fastrand::Rng, name: &str) -> Policy {
    let mut b = Policy::builder(name);
    for t in 0..rng.usize(1..=3) {
        b = b.tier(format!("t{t}"), rate(rng));
    }
    if rng.u8(..3) == 0 {
        b = b.tier("long", long_rate(rng));
    }
    b.build().expect("a valid policy")
}

/// The TATs (absolute `(seconds, units)` per tier) of a plain GCRA policy's stored state, in
/// either layout: gcra.lua's (the pairs), or rate.lua's under kinds.lua (a guard, then per tier
/// the TAT, its fraction, which whole-unit intervals keep 0, and the bucket's last instant,
/// which GCRA never moves); `None` when absent.
fn tats(value: &redis::Value, ntiers: usize, general: bool) -> Option<Vec<(f64, f64)>> {
    let v = match value {
        redis::Value::Nil => return None,
        redis::Value::BulkString(b) => doubles_of(b),
        other => panic!("a state key holds {other:?}"),
    };
    if !general {
        assert_eq!(v.len(), 2 * ntiers, "gcra.lua's layout: {v:?}");
        return Some(v.chunks_exact(2).map(|p| (p[0], p[1])).collect());
    }
    assert_eq!(v.len(), 2 + 5 * ntiers, "kinds.lua's plain layout: {v:?}");
    Some(
        v[2..]
            .chunks_exact(5)
            .map(|t| {
                assert_eq!(t[2], 0.0, "a whole-unit TAT has no fraction: {v:?}");
                (t[0], t[1])
            })
            .collect(),
    )
}

/// `lua/gcra.lua` decides plain GCRA policies of whole-unit emission intervals as the general
/// scripts (`lua/rate.lua` under `lua/kinds.lua`) that the same policies are bound to when the
/// fast path is switched off ([`general`]).
///
/// Invariant: the same trace, each record made by the `Prepared` of either binding, gives
/// equal replies (every decision, delay, retry, each tier's remaining, reset and own retry,
/// each lease's units and hold, the instant decided at), and leaves each key's TATs equal
/// (the layouts differ: see [`tats`]), expiring at the same instant of the scripts' clock
/// ([`same_expiry`]). Batches of one to four records over three keys of three random policies
/// (drawn again every 300 batches): policed and shaped checks of costs 0 to above capacity,
/// settlements of admitted checks to smaller, equal or larger costs per tier, lease calls
/// (with and without a useful block) giving back the previous lease's rest, a clock that
/// crosses whole seconds and now and then steps back 300 ms.
#[test]
fn gcra_fast_path_decides_as_the_general_scripts() {
    let Some(server) = server::Server::start("redis-server") else { return };
    let (mut fast, mut slow) = (Side::open(&server, 2), Side::open(&server, 3));
    let gcra = Script::new(&logging(GCRA_SOURCE));
    let rate = Script::new(&logging(KINDS_RATE_SOURCE));
    let per_seed = batches(3000);
    for seed in SEEDS {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut now = 1_700_000_050 * SECOND;
        let mut policies: Vec<(Policy, Prepared, Prepared)> = Vec::new();
        // Per key: the charges of admitted checks not settled, and the last lease granted.
        let mut held: Vec<Vec<Charges>> = Vec::new();
        let mut leased: Vec<Option<(u64, Charges)>> = Vec::new();
        // Checks limited, allowed now and above capacity, allowed later, leases granted and
        // settlements: the trace reaches every one.
        let mut seen = [0u64; 6];
        for n in 0..per_seed {
            if n % 300 == 0 {
                policies = (0..3)
                    .map(|i| {
                        let p = gcra_policy(&mut rng, &format!("g{i}"));
                        let fast = Prepared::new(&p, 1000);
                        let slow = general(|| Prepared::new(&p, 1000));
                        assert_eq!((fast.family, slow.family), (Family::Gcra, Family::Rate));
                        (p, fast, slow)
                    })
                    .collect();
                held = vec![Vec::new(); 3];
                leased = vec![None; 3];
                fast.flush();
                slow.flush();
            }
            now = step(&mut rng, now);
            let mut keys: Vec<String> = Vec::new();
            // Per record: its key, then either side's record, and what its reply holds.
            let mut records: Vec<(usize, Vec<f64>, Vec<f64>, Op)> = Vec::new();
            for _ in 0..rng.usize(1..=4) {
                let key = rng.usize(..3);
                let (policy, f, s) = &policies[key];
                keys.push(format!("g{key}:00000000"));
                let what = rng.u8(..20);
                let (a, b, op) = if what >= 15 {
                    let cost = [0, 1, 1, 2][rng.usize(..4)];
                    let block = cost + rng.u64(0..=8);
                    let useful = if rng.bool() { 0 } else { rng.u64(cost..=block) };
                    let rest = leased[key].take().filter(|_| rng.u8(..10) < 7).map(
                        |(granted, charges)| Rest { granted, spent: rng.u64(0..=granted), charges },
                    );
                    let (a, b) = (
                        f.lease(cost, block, useful, rest.as_ref()),
                        s.lease(cost, block, useful, rest.as_ref()),
                    );
                    (a, b, Op::Lease)
                } else if what >= 11 && !held[key].is_empty() {
                    let pick = rng.usize(..held[key].len());
                    let charges = held[key].swap_remove(pick);
                    let new: Vec<u64> = charges.iter().map(|c| rng.u64(0..=c.cost + 2)).collect();
                    let old = |i: usize| charges[i].cost;
                    let (a, b) = (
                        f.settle(&charges, old, |i| new[i], false, now),
                        s.settle(&charges, old, |i| new[i], false, now),
                    );
                    (a, b, Op::Settle)
                } else {
                    let capacity =
                        policy.tiers().iter().map(|t| t.rate.burst).min().expect("tiers");
                    let cost = match rng.u8(..12) {
                        0 => capacity + 1,
                        1 => capacity,
                        _ => [0, 1, 1, 2, 3][rng.usize(..5)],
                    };
                    let t = policy.tiers()[0].rate;
                    let interval = t.period / t.count * policy.unit();
                    let delay =
                        [0, interval / 2, interval, 3 * interval, 20 * interval][rng.usize(..5)];
                    let shape = rng.u8(..5) < 2;
                    let max_delay = shape.then(|| Duration::from_nanos(delay));
                    let costs = vec![cost; policy.tiers().len()];
                    let standard = Priority::Standard;
                    let (a, b) = (
                        f.check(&costs, max_delay, 0, standard, now),
                        s.check(&costs, max_delay, 0, standard, now),
                    );
                    (a, b, Op::Check(cost))
                };
                records.push((key, a, b, op));
            }
            let read: Vec<&String> = (0..3)
                .filter_map(|k| keys.iter().find(|n| n.starts_with(&format!("g{k}:"))))
                .collect();
            let side = |fast: bool| -> Vec<(usize, &PolicyArgs, &[f64])> {
                records
                    .iter()
                    .enumerate()
                    .map(|(i, (key, a, b, _))| {
                        let (_, f, s) = &policies[*key];
                        if fast {
                            (i + 1, &*f.policy, a.as_slice())
                        } else {
                            (i + 1, &*s.policy, b.as_slice())
                        }
                    })
                    .collect()
            };
            expire(now, &mut fast, &mut slow);
            let (a, state_a) = fast.run(&gcra, now, &keys, &side(true), &read);
            let (b, state_b) = slow.run(&rate, now, &keys, &side(false), &read);
            let context = || {
                let policies: Vec<String> = policies.iter().map(|p| brief(&p.0)).collect();
                format!(
                    "seed {seed:#x}, batch {n}, now {now}, policies {policies:#?}, records {records:?}"
                )
            };
            assert_eq!(a, b, "replies differ (gcra.lua, kinds.lua): {}", context());
            let a = a.unwrap_or_else(|e| panic!("the batch failed: {e}: {}", context()));
            for (k, (x, y)) in read.iter().zip(state_a.iter().zip(&state_b)) {
                let key: usize = k[1..2].parse().expect("a key's index");
                let ntiers = policies[key].0.tiers().len();
                let (tx, ty) = (tats(&x.value, ntiers, false), tats(&y.value, ntiers, true));
                assert!(
                    tx == ty && same_expiry(x, y),
                    "{k} differs (gcra.lua, kinds.lua): {tx:?} {:?} {ty:?} {:?}: {}",
                    x.expires,
                    y.expires,
                    context()
                );
            }
            // What the trace settles and gives back later.
            let mut at = 0;
            for (key, _, _, op) in &records {
                let (policy, f, _) = &policies[*key];
                let len = f.check_reply_len();
                match op {
                    Op::Settle => seen[5] += 1,
                    Op::Check(cost) => {
                        let part = ints(&a[at..at + len]);
                        // Limited, allowed, above capacity; or allowed after a delay.
                        let outcome = usize::try_from(part[0]).expect("an outcome");
                        seen[if outcome == 1 && part[1] > 0 { 3 } else { outcome }] += 1;
                        let (_, charges) = decode(policy, *cost, now, &part).expect("decodes");
                        held[*key].extend(charges.filter(|_| *cost > 0));
                        at += len;
                    }
                    Op::Lease => {
                        let part = ints(&a[at..at + len + 2]);
                        let take = u64::try_from(part[len]).expect("units granted");
                        seen[4] += u64::from(take > 0);
                        let (_, charges) =
                            decode(policy, take, now, &part[..len]).expect("decodes");
                        leased[*key] = charges.map(|c| (take, c));
                        at += len + 2;
                    }
                }
            }
        }
        assert!(
            seen.iter().all(|n| *n > 0),
            "limited, allowed, above capacity, delayed, leases granted, settled: {seen:?}"
        );
        fast.flush();
        slow.flush();
    }
}

/// What a record of the GCRA trace was.
#[derive(Debug)]
enum Op {
    /// A check of this cost.
    Check(u64),
    Settle,
    Lease,
}
