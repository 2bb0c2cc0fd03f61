//! A fleet on one Redis: N independent limiters (each its own `RedisStore` and connection) in
//! one process hammer one hot key (and 10,000 cold keys) with 64 tasks for a fixed time, in
//! exact mode and in lease mode, beside a plain `INCR` loop on one key with the same tasks.
//!
//! Run: `cargo run --release --example fleet --features redis -- [seconds per line]`
//! (default 3; or `FLEET_SECS`; `FLEET_N=1,2,4,8` picks the fleet sizes,
//! `FLEET_TIERS=window,gcra,gcra-hot,attack` the tiers; `FLEET_DEBUG=1` prints each instance's lease
//! counts and the server's `INFO commandstats` per line; `FLEET_PREFETCH=0` leases without
//! [`Lease::prefetch`](tollgate::store::Lease::prefetch), to compare; `FLEET_SCHEDULE=0`
//! leases without [`Lease::schedule`](tollgate::store::Lease::schedule); `FLEET_BLOCK` sets the
//! largest block, 1,024 by default, and with it the bound). It exits with an error when a
//! line admitted more than its bound. It starts its own `redis-server` (which must be on `PATH`) on a free
//! 127.0.0.1 port with `--save ""` and kills it at the end.
//!
//! One line per (mode, tier, n):
//!
//! - `checks_per_s`: checks decided per second, hot and cold, admitted or refused (56 tasks
//!   check the hot key, 8 the cold keys);
//! - `redis_cpu_us_per_admitted`: the server's CPU (`INFO cpu`, `used_cpu_sys +
//!   used_cpu_user`, before and after) per admitted check, hot and cold, in lease mode the
//!   give-back of the blocks held at the end included
//!   (`redis_cpu_us_per_refused` too on the attack lines);
//! - `admitted_worst_window`, `limit_per_window`: for the window tier, the most the hot key
//!   admitted in one fixed window (each admission placed in its window by the decision's
//!   reset, which a fixed window counts to the window's end) and its limit; for GCRA, what it
//!   admitted over the whole run and what exact GCRA allows over that interval (burst + rate x
//!   time);
//! - `utilization`: admitted over what the limit allows (full windows only, for windows);
//! - `over_admitted`: admitted beyond the exact limit (worst window; the run for GCRA);
//! - `bound`: the stated bound for the line (0 but for GCRA in lease mode: N x block);
//! - `errors`: checks Redis did not decide within the timeout (the stores have no local
//!   fallback here, so that every admission counted is one Redis decided).
//!
//! The `gcra-hot` lines (lease mode only) are the GCRA tier with the 8 cold tasks idle: the
//! hot key's own share of the Redis CPU, beside the lines of the whole mix. The attack tier is
//! one key far over its limit (100 a second), every check on it.

#[path = "common/redis_server.rs"]
mod redis_server;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tollgate::key::Key;
use tollgate::store::{Lease, RedisStore};
use tollgate::{Algorithm, Limiter, Policy, Quota};

const TASKS: usize = 64;
const COLD: usize = 10_000;
/// The hot key's window tier: 400,000 a second.
const WINDOW_LIMIT: u64 = 400_000;
/// The hot key's GCRA tier: 400,000 a second, a burst of 4,000.
const GCRA_RATE: u64 = 400_000;
const GCRA_BURST: u64 = 4_000;
/// The attack tier: 100 a second.
const ATTACK_LIMIT: u64 = 100;
/// Blocks of at most 1,024 units (2.56 ms of the hot key's rate; or `FLEET_BLOCK`), spent
/// within 100 ms, the next asked for ahead of need (`FLEET_PREFETCH=0` turns that off, to
/// compare), leased from the key's schedule (`FLEET_SCHEDULE=0` turns that off, to compare).
fn lease() -> Lease {
    let prefetch = std::env::var("FLEET_PREFETCH").map_or(true, |v| v != "0");
    let block = std::env::var("FLEET_BLOCK").ok().and_then(|b| b.parse().ok()).unwrap_or(1_024);
    let schedule = std::env::var("FLEET_SCHEDULE").map_or(true, |v| v != "0");
    Lease::new()
        .max_block(block)
        .lifetime(Duration::from_millis(100))
        .prefetch(prefetch)
        .schedule(schedule)
}

/// `used_cpu_user + used_cpu_sys` of the server, in seconds.
fn server_cpu(conn: &mut redis::Connection) -> f64 {
    let info: String = redis::cmd("INFO").arg("cpu").query(conn).expect("INFO cpu");
    ["used_cpu_user:", "used_cpu_sys:"]
        .iter()
        .filter_map(|f| info.lines().find_map(|l| l.strip_prefix(f)))
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum()
}

fn unix_nanos() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tier {
    Window,
    Gcra,
    /// The GCRA tier with the cold tasks idle, lease mode only: the hot key's share of the
    /// Redis CPU, reported beside the lines of the whole mix (not instead of them).
    GcraHot,
    Attack,
}

impl Tier {
    fn name(self) -> &'static str {
        match self {
            Self::Window => "window",
            Self::Gcra => "gcra",
            Self::GcraHot => "gcra-hot",
            Self::Attack => "attack",
        }
    }

    fn policy(self) -> Policy {
        let builder = Policy::builder("fleet");
        match self {
            Self::Window => builder
                .algorithm(Algorithm::FixedWindow)
                .tier("second", Quota::per_second(WINDOW_LIMIT)),
            Self::Gcra | Self::GcraHot => {
                builder.tier("second", Quota::per_second(GCRA_RATE).with_burst(GCRA_BURST))
            }
            Self::Attack => builder
                .algorithm(Algorithm::FixedWindow)
                .tier("second", Quota::per_second(ATTACK_LIMIT)),
        }
        .build()
        .expect("a valid policy")
    }
}

/// What the tasks of one line counted.
#[derive(Default)]
struct Counts {
    checks: u64,
    /// Checks the store could not decide (no fallback here: they are not admitted).
    errors: u64,
    /// Admitted, hot and cold.
    all_admitted: u64,
    /// Admitted on the hot key.
    admitted: u64,
    /// Hot admissions per fixed window (windows tiers).
    windows: HashMap<u64, u64>,
}

/// Runs and prints one line; `false` when it admitted more than its bound.
async fn line(
    url: &str,
    lease: bool,
    tier: Tier,
    n: usize,
    secs: f64,
    info: &mut redis::Connection,
) -> bool {
    let policy = tier.policy();
    let prefix = format!("fleet{}:", fastrand::u64(..));
    let mut limiters = Vec::new();
    for _ in 0..n {
        // No local fallback: a check Redis does not decide in time is an error, counted, so
        // that what is measured is what Redis decided.
        let mut builder = RedisStore::builder(url)
            .prefix(prefix.as_str())
            .timeout(Duration::from_secs(1))
            .no_fallback();
        if lease {
            builder = builder.lease_policy("fleet", self::lease());
        }
        let store = builder.build().expect("a valid store");
        store.connect().await.expect("redis answers");
        limiters.push(Limiter::with_store(policy.clone(), store).expect("binds"));
    }
    let cold: Arc<Vec<Key>> = Arc::new((0..COLD).map(|i| Key::text(format!("cold-{i}"))).collect());
    let hot = Key::text("hot");
    // The last eighth of the tasks check cold keys (one call each in both modes), the others
    // the hot key; on the attack lines every task checks the hot key. Task `t` uses limiter
    // `t % n`, so at N = 1, 2, 4 and 8 each limiter has 56 / N hot tasks and 8 / N cold ones
    // (numbering the cold tasks `t % 8 == 7` left a limiter of eight with no hot task).
    let cold_task = |t: usize| tier != Tier::Attack && t >= TASKS - TASKS / 8;
    let debug = std::env::var("FLEET_DEBUG").is_ok();
    if debug {
        let () = redis::cmd("CONFIG").arg("RESETSTAT").query(info).expect("CONFIG RESETSTAT");
    }
    let cpu_before = server_cpu(info);
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let limiter = limiters[t % n].clone();
        let (cold, hot) = (Arc::clone(&cold), hot.clone());
        let is_cold = cold_task(t);
        let idle = is_cold && tier == Tier::GcraHot;
        tasks.push(tokio::spawn(async move {
            let mut counts = Counts::default();
            if idle {
                return counts;
            }
            let mut i = 0u64;
            loop {
                if i % 16 == 0 {
                    if Instant::now() >= deadline {
                        return counts;
                    }
                    // Checks answered locally complete without waiting: let the other tasks
                    // (and the replies they wait for) run.
                    tokio::task::yield_now().await;
                }
                i += 1;
                let key = if is_cold { &cold[(t * 7_919 + i as usize) % COLD] } else { &hot };
                counts.checks += 1;
                let d = match limiter.check(key, 1).await {
                    Ok(d) => d,
                    Err(_) => {
                        counts.errors += 1;
                        continue;
                    }
                };
                if d.is_allowed() {
                    counts.all_admitted += 1;
                }
                if d.is_allowed() && !is_cold {
                    counts.admitted += 1;
                    if !matches!(tier, Tier::Gcra | Tier::GcraHot) {
                        // A fixed window's reset is the end of the window it was charged to.
                        let end = unix_nanos() + d.tiers()[0].reset_after().as_nanos() as u64;
                        let window = (end + 500_000_000) / 1_000_000_000;
                        *counts.windows.entry(window).or_default() += 1;
                    }
                }
            }
        }));
    }
    let mut total = Counts::default();
    for task in tasks {
        let c = task.await.expect("task");
        total.checks += c.checks;
        total.errors += c.errors;
        total.all_admitted += c.all_admitted;
        total.admitted += c.admitted;
        for (w, a) in c.windows {
            *total.windows.entry(w).or_default() += a;
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    if lease {
        // The blocks still held are given back within this line's Redis CPU (not the next
        // line's, as when the limiters' drop gave them back): once their lifetime (100 ms)
        // ended.
        tokio::time::sleep(Duration::from_millis(110)).await;
        for l in &limiters {
            l.bound().return_ended_leases().await;
        }
    }
    if debug {
        for l in &limiters {
            eprintln!("{:?} keys={}", l.bound().lease_stats(), l.bound().leased_keys());
        }
    }
    let cpu_us = (server_cpu(info) - cpu_before) * 1e6;
    if debug {
        let stats: String = redis::cmd("INFO").arg("commandstats").query(info).expect("INFO");
        for l in stats.lines().filter(|l| l.starts_with("cmdstat_")) {
            eprintln!("  {l}");
        }
    }
    let refused = total.checks - total.all_admitted - total.errors;
    let (worst, limit, utilization, over, bound) = match tier {
        Tier::Gcra | Tier::GcraHot => {
            let allowed = GCRA_BURST + (GCRA_RATE as f64 * elapsed) as u64;
            let over = total.admitted.saturating_sub(allowed);
            let bound = if lease { self::lease().bound(n as u64) } else { 0 };
            (total.admitted, allowed, total.admitted as f64 / allowed as f64, over, bound)
        }
        Tier::Window | Tier::Attack => {
            let limit = if tier == Tier::Window { WINDOW_LIMIT } else { ATTACK_LIMIT };
            let worst = total.windows.values().copied().max().unwrap_or(0);
            // Full windows: all but the first and the last.
            let mut ws: Vec<_> = total.windows.iter().collect();
            ws.sort();
            let full: Vec<u64> = ws.iter().skip(1).rev().skip(1).map(|(_, a)| **a).collect();
            let utilization = if full.is_empty() {
                f64::NAN
            } else {
                full.iter().sum::<u64>() as f64 / (full.len() as u64 * limit) as f64
            };
            (worst, limit, utilization, worst.saturating_sub(limit), 0)
        }
    };
    let mode = if lease { "lease" } else { "exact" };
    let per_admitted = cpu_us / total.all_admitted.max(1) as f64;
    let mut out = format!(
        "mode={mode} tier={} n={n} checks_per_s={:.0} redis_cpu_us_per_admitted={per_admitted:.3} \
         admitted_worst_window={worst} limit_per_window={limit} utilization={utilization:.3} \
         over_admitted={over} bound={bound} errors={}",
        tier.name(),
        total.checks as f64 / elapsed,
        total.errors,
    );
    if tier == Tier::Attack {
        out.push_str(&format!(" redis_cpu_us_per_refused={:.4}", cpu_us / refused.max(1) as f64));
    }
    println!("{out}");
    over <= bound
}

async fn incr(url: &str, secs: f64) {
    let client = redis::Client::open(url).expect("url");
    let conn = client.get_multiplexed_async_connection().await.expect("connects");
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let mut conn = conn.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while n % 64 != 0 || Instant::now() < deadline {
                let _: i64 =
                    redis::cmd("INCR").arg("incr:hot").query_async(&mut conn).await.expect("INCR");
                n += 1;
            }
            n
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.expect("task");
    }
    println!("mode=incr checks_per_s={:.0}", total as f64 / start.elapsed().as_secs_f64());
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let secs: f64 = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("FLEET_SECS").ok())
        .map_or(Ok(3.0), |s| s.parse())?;
    let sizes: Vec<usize> = std::env::var("FLEET_N")
        .unwrap_or_else(|_| "1,2,4,8".into())
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()?;
    let (_server, url) = redis_server::start_redis()?;
    let mut info = redis::Client::open(url.as_str())?.get_connection()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let held = rt.block_on(async {
        incr(&url, secs).await;
        let mut held = true;
        let tiers =
            std::env::var("FLEET_TIERS").unwrap_or_else(|_| "window,gcra,gcra-hot,attack".into());
        for tier in [Tier::Window, Tier::Gcra, Tier::GcraHot, Tier::Attack] {
            if !tiers.split(',').any(|t| t.trim() == tier.name()) {
                continue;
            }
            for &n in &sizes {
                // Interleaved: exact, then lease, for each size.
                for lease in [false, true] {
                    if tier == Tier::GcraHot && !lease {
                        continue;
                    }
                    held &= line(&url, lease, tier, n, secs, &mut info).await;
                }
            }
        }
        incr(&url, secs).await;
        held
    });
    if !held {
        return Err("a line admitted more than its bound (over_admitted > bound)".into());
    }
    Ok(())
}
