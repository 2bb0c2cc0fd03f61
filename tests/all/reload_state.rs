//! What a configuration reload (`ReloadHandle::reload`) keeps of each key's state, on the
//! in-memory store and on a real redis-server, as the config module's "Reloading" section
//! lists it: penalty blocks and breaches, concurrency slots held, and per kind of tier (rate
//! tiers of every algorithm, calendar tiers, tiers counting bytes, messages or reported units,
//! reserves) what is kept and what starts afresh. Over HTTP, the login guard whose block is
//! lengthened while an attacker is blocked. Random traces of checks, holds, releases, reloads
//! of random parameters and clock steps hold the invariants: no reload unblocks a blocked key,
//! the slots in flight never exceed the max, and no slot or charge of an unchanged tier is
//! lost.
#![cfg(feature = "config")]

use crate::support;

use std::time::Duration;

use axum::Router;
use axum::routing::get;
use http::StatusCode;
use proptest::prelude::*;
use tollgate::clock::FakeClock;
use tollgate::config::{LimitsConfig, LimitsLayer, ReloadHandle};
use tollgate::key::Key;
use tollgate::store::{Check, MemoryStore, Store};
use tollgate::{Decision, Limiter, Priority};

const MINUTE: Duration = Duration::from_secs(60);

/// Midnight UTC, 2 June 2025 (a Monday): calendar days start here.
const MIDNIGHT: u64 = 1_748_822_400_000_000_000;

/// A configuration of the one policy `toml` defines (its `[policies.p]` and tiers).
fn config(toml: &str) -> LimitsConfig {
    LimitsConfig::from_toml(toml, "reload.toml").unwrap()
}

/// The memory store on `clock`.
fn memory(clock: &FakeClock) -> MemoryStore {
    MemoryStore::builder().clock(clock.clone()).build().unwrap()
}

/// The running limiter of policy `p`.
fn limiter<St: Store>(handle: &ReloadHandle<St>) -> Limiter<St> {
    handle.limiter("p").expect("policy p is running")
}

/// A query (cost 0) of `key` through the running limiter.
async fn query<St: Store>(handle: &ReloadHandle<St>, key: &Key) -> Decision {
    limiter(handle).check(key, 0).await.expect("the store answers")
}

/// What remains of each tier of `key`, by a query as a critical request sees it.
async fn remaining<St: Store>(handle: &ReloadHandle<St>, key: &Key) -> Vec<u64> {
    let d = limiter(handle).check_as(key, 0, Priority::Critical).await.expect("the store answers");
    d.tiers().iter().map(tollgate::TierDecision::remaining).collect()
}

/// One request of `key` costing `costs` per tier through the running limiter, its slots (if
/// any) given back at once.
async fn spend<St: Store>(handle: &ReloadHandle<St>, key: &Key, costs: &[u64]) -> Decision {
    let limiter = limiter(handle);
    let check = Check::new(key, 1).with_costs(costs);
    let verdict = limiter.store().check(limiter.bound(), check).await.expect("the store answers");
    if let Some(ticket) = verdict.ticket {
        limiter.store().release(limiter.bound(), ticket).await.expect("released");
    }
    verdict.decision
}

/// Reloads `toml`; asserts the policy changed.
fn reload<St: Store>(handle: &ReloadHandle<St>, toml: &str) {
    let report = handle.reload(config(toml)).unwrap();
    assert_eq!(report.changed(), ["p"], "{toml}");
}

// ---------------------------------------------------------------------------------------------
// The login guard, over HTTP.

/// 2 logins a minute per user; the first refusal blocks the user for `block`.
fn guard(block: &str) -> LimitsConfig {
    config(&format!(
        r#"
[policies.p]
tiers = [{{ name = "per-minute", count = 2, period = "1m", block = "{block}" }}]

[[rules]]
name = "login"
paths = ["/login"]
key = "header:x-user"
policy = "p"
"#
    ))
}

/// Mallory breaches the guard and is blocked for 15 minutes; a minute later the block is
/// lengthened to 30 minutes. She stays blocked until her block ends (14 minutes on), not
/// longer: a changed block applies from the next breach, which then blocks her for 30
/// minutes. Alice, never blocked, is admitted throughout. (Before blocks were carried, the
/// reload admitted Mallory at once, on both stores.)
async fn login_guard<St: Store>(store: St, clock: &FakeClock) {
    let layer = LimitsLayer::with_store(guard("15m"), store).unwrap();
    let app = Router::new().route("/login", get(|| async { "ok" })).layer(layer.clone());
    let server = support::serve(app).await;
    let client = support::client();
    let login = |user: &'static str| {
        let (client, url) = (client.clone(), server.url("/login"));
        async move { support::get(&client, &url, &[("x-user", user)]).await }
    };
    let retry = |r: &support::Reply| r.header("retry-after").map(str::to_owned);
    for _ in 0..2 {
        assert_eq!(login("mallory").await.status, StatusCode::OK);
    }
    let refused = login("mallory").await;
    assert_eq!(
        (refused.status, retry(&refused)),
        (StatusCode::TOO_MANY_REQUESTS, Some("900".into()))
    );
    clock.advance(MINUTE);
    let report = layer.handle().reload(guard("30m")).unwrap();
    assert_eq!(report.changed(), ["p"]);
    let blocked = login("mallory").await;
    assert_eq!(
        (blocked.status, retry(&blocked)),
        (StatusCode::TOO_MANY_REQUESTS, Some("840".into()))
    );
    assert_eq!(login("alice").await.status, StatusCode::OK);
    clock.advance(14 * MINUTE - Duration::from_nanos(1));
    let last = login("mallory").await;
    assert_eq!((last.status, retry(&last)), (StatusCode::TOO_MANY_REQUESTS, Some("1".into())));
    // The block ends when it was going to; then the new configuration's count and block.
    clock.advance(Duration::from_nanos(1));
    for _ in 0..2 {
        assert_eq!(login("mallory").await.status, StatusCode::OK);
    }
    let again = login("mallory").await;
    assert_eq!((again.status, retry(&again)), (StatusCode::TOO_MANY_REQUESTS, Some("1800".into())));
}

#[tokio::test]
async fn a_lengthened_block_keeps_the_blocked_user_blocked_until_the_block_ends_in_memory() {
    let clock = FakeClock::new();
    clock.set(MIDNIGHT);
    login_guard(memory(&clock), &clock).await;
}

// ---------------------------------------------------------------------------------------------
// What a reload keeps, per kind of tier.

/// Tiers `a` (`a` units) and `b` (`b` units), rates (an hour, a day) or calendar tiers (a day,
/// a month), beside a concurrency tier of `max`, under `algorithm`; `a` with a penalty box
/// when `boxed`.
fn two_tiers(algorithm: &str, calendar: bool, (a, b): (u64, u64), max: u64, boxed: bool) -> String {
    let tier = |name: &str, count: u64, period: &str| {
        let kind = if calendar { r#"kind = "calendar", "# } else { "" };
        let block = if boxed && name == "a" { r#", block = "1m""# } else { "" };
        format!(r#"{{ name = "{name}", {kind}count = {count}, period = "{period}"{block} }}"#)
    };
    let (pa, pb) = if calendar { ("day", "month") } else { ("1h", "1day") };
    format!(
        "[policies.p]\nalgorithm = \"{algorithm}\"\ntiers = [{}, {}, \
         {{ name = \"c\", kind = \"concurrency\", max = {max} }}]\n",
        tier("a", a, pa),
        tier("b", b, pb),
    )
}

/// A key spends 3 of tiers `a` (10) and `b` (20), rates of every algorithm or calendar tiers.
/// A reload that changes the concurrency tier and gives `a` a penalty box keeps both on either
/// store (neither is their state); one that changes `b` keeps `a` in memory, and starts both
/// afresh on Redis (its state key is named by every rate and calendar tier). (Before, the
/// first reload started both tiers afresh on Redis, and in memory `a`, whose box changed.)
async fn rates_and_calendars<St: Store>(store: St, redis: bool) {
    for (algorithm, calendar) in [
        ("gcra", false),
        ("token_bucket", false),
        ("leaky_bucket", false),
        ("fixed_window", false),
        ("sliding_counter", false),
        ("sliding_log", false),
        ("gcra", true),
    ] {
        let what = format!("{algorithm}, calendar tiers: {calendar}");
        let key = Key::text(what.as_str());
        let toml = |b, max, boxed| two_tiers(algorithm, calendar, (10, b), max, boxed);
        let layer = LimitsLayer::with_store(config(&toml(20, 4, false)), store.clone()).unwrap();
        let handle = layer.handle();
        for _ in 0..3 {
            assert!(spend(&handle, &key, &[1, 1, 0]).await.is_allowed(), "{what}");
        }
        assert_eq!(remaining(&handle, &key).await, [7, 17, 4], "{what}");
        reload(&handle, &toml(20, 6, true));
        assert_eq!(remaining(&handle, &key).await, [7, 17, 6], "{what}: slots and a box");
        reload(&handle, &toml(40, 6, true));
        let a = if redis { 10 } else { 7 };
        assert_eq!(remaining(&handle, &key).await, [a, 40, 6], "{what}: b changed");
    }
}

/// Tiers counting requests, request bytes, messages and reported units (a calendar day of
/// tokens), and, with `max`, a concurrency tier.
fn units(requests: u64, max: Option<u64>) -> String {
    let slots = max.map_or(String::new(), |m| {
        format!(",\n  {{ name = \"c\", kind = \"concurrency\", max = {m} }}")
    });
    format!(
        r#"
[policies.p]
tiers = [
  {{ name = "requests", count = {requests}, period = "1h" }},
  {{ name = "bytes", count = 10000, period = "1h", unit = "request_bytes" }},
  {{ name = "messages", count = 50, period = "1h", unit = "request_messages" }},
  {{ name = "tokens", kind = "calendar", count = 1000, period = "day", unit = "reported" }}{slots}
]
"#
    )
}

/// Tiers of other units than requests keep or reset as rate and calendar tiers do: a reload
/// that adds a concurrency tier keeps them all; one that changes the request tier keeps the
/// others in memory and starts every one afresh on Redis.
async fn other_units<St: Store>(store: St, redis: bool) {
    let key = Key::text("units");
    let layer = LimitsLayer::with_store(config(&units(100, None)), store).unwrap();
    let handle = layer.handle();
    for _ in 0..2 {
        assert!(spend(&handle, &key, &[1, 500, 2, 30]).await.is_allowed());
    }
    assert_eq!(remaining(&handle, &key).await, [98, 9000, 46, 940]);
    reload(&handle, &units(100, Some(2)));
    assert_eq!(remaining(&handle, &key).await, [98, 9000, 46, 940, 2]);
    reload(&handle, &units(200, Some(2)));
    let kept = if redis { [200, 10_000, 50, 1000, 2] } else { [200, 9000, 46, 940, 2] };
    assert_eq!(remaining(&handle, &key).await, kept);
}

/// A GCRA tier of 10 a minute whose reserve keeps `critical` units for critical requests.
fn reserved(critical: u64, carry: &str) -> String {
    format!(
        r#"
[policies.p]
changed_tiers = "{carry}"
tiers = [{{ name = "a", count = 10, period = "1m", reserve_critical = {critical} }}]
"#
    )
}

/// A reserve is part of its tier: a changed reserve is a changed tier, started full (or, in
/// memory, with the share used when the policy says so).
async fn reserves<St: Store>(store: St, redis: bool) {
    let key = Key::text("reserved");
    let layer = LimitsLayer::with_store(config(&reserved(2, "start_full")), store).unwrap();
    let handle = layer.handle();
    for _ in 0..5 {
        assert!(spend(&handle, &key, &[1]).await.is_allowed());
    }
    assert_eq!(remaining(&handle, &key).await, [5]);
    reload(&handle, &reserved(3, "carry_used_fraction"));
    assert_eq!(remaining(&handle, &key).await, [if redis { 10 } else { 5 }]);
    reload(&handle, &reserved(4, "start_full"));
    assert_eq!(remaining(&handle, &key).await, [10]);
}

/// A rate tier beside a concurrency tier of `max` slots (leased for an hour on Redis).
fn slots(max: u64) -> String {
    format!(
        r#"
[policies.p]
tiers = [
  {{ name = "minute", count = 100, period = "1m" }},
  {{ name = "c", kind = "concurrency", max = {max}, lease = "1h" }},
]
"#
    )
}

/// The free slots of `key`, by a query.
async fn free<St: Store>(handle: &ReloadHandle<St>, key: &Key) -> u64 {
    query(handle, key).await.tiers()[1].remaining()
}

/// Three requests hold the key's three slots; a reload lowers the max to 2: they still count,
/// so the key has no slot free and a new request is refused until two of them end. A reload
/// to 5 counts the two still held (one through the configuration before); when every holder
/// ends, all 5 are free: none was lost, none leaked. (Before, each reload started the tier with
/// no slot held, admitting 2 and then 5 more beside the holders, on both stores.)
async fn concurrency<St: Store>(store: St) {
    let key = Key::text("slots");
    let layer = LimitsLayer::with_store(config(&slots(3)), store).unwrap();
    let handle = layer.handle();
    let hold = || async { limiter(&handle).reserve(&key, 1).await.expect("the store answers") };
    let mut held = Vec::new();
    for _ in 0..3 {
        let r = hold().await;
        assert!(r.decision().is_allowed());
        held.push(r);
    }
    assert_eq!(free(&handle, &key).await, 0);
    reload(&handle, &slots(2));
    assert_eq!(free(&handle, &key).await, 0);
    let refused = hold().await;
    assert!(!refused.decision().is_allowed() && refused.decision().tiers()[1].is_violated());
    held.pop().unwrap().release().await.unwrap();
    assert_eq!(free(&handle, &key).await, 0, "2 held of 2");
    assert!(!hold().await.decision().is_allowed());
    held.pop().unwrap().release().await.unwrap();
    assert_eq!(free(&handle, &key).await, 1);
    let mine = hold().await;
    assert!(mine.decision().is_allowed());
    assert_eq!(free(&handle, &key).await, 0);
    reload(&handle, &slots(5));
    assert_eq!(free(&handle, &key).await, 3, "one held through v1, one through v2");
    held.pop().unwrap().release().await.unwrap();
    mine.release().await.unwrap();
    assert_eq!(free(&handle, &key).await, 5, "every slot came back to the running tier");
}

/// 2 a minute; the third breach within `window` blocks for 10 minutes (`count`, `window` and
/// the box itself as given).
fn strikes(count: u64, window: Option<&str>) -> String {
    let block = window.map_or(String::new(), |w| {
        format!(r#", block = "10m", block_after = 3, block_window = "{w}""#)
    });
    format!("[policies.p]\ntiers = [{{ name = \"m\", count = {count}, period = \"1m\"{block} }}]\n")
}

/// The breaches counted are kept: two breaches, then a reload that widens the window they are
/// counted in; two minutes on (past the old window, within the new one) a third breach blocks
/// for 10 minutes. A reload that raises the quota keeps the block; one that removes the box
/// frees the key. (Before, the reload started a fresh box: the third breach counted as the
/// first, and nothing blocked.)
async fn breaches<St: Store>(store: St, clock: &FakeClock) {
    let key = Key::text("breaches");
    let layer = LimitsLayer::with_store(config(&strikes(2, Some("1m"))), store).unwrap();
    let handle = layer.handle();
    let once = || async { spend(&handle, &key, &[1]).await };
    for expected in [true, true, false, false] {
        assert_eq!(once().await.is_allowed(), expected);
    }
    reload(&handle, &strikes(2, Some("5m")));
    clock.advance(2 * MINUTE);
    for expected in [true, true, false] {
        assert_eq!(once().await.is_allowed(), expected);
    }
    assert_eq!(once().await.retry_after(), Some(10 * MINUTE), "blocked by the third breach");
    clock.advance(MINUTE);
    reload(&handle, &strikes(5, Some("5m")));
    let d = once().await;
    assert_eq!((d.is_allowed(), d.retry_after()), (false, Some(9 * MINUTE)), "{d:?}");
    reload(&handle, &strikes(5, None));
    assert!(once().await.is_allowed(), "no box: only the tier decides");
}

/// A request waiting (shaping) for a slot through the configuration a reload replaced is woken
/// by the releases of the new one's holders, which count on the same slots. (Before, it was
/// woken by the replaced binding's releases alone: only its polling, every 100 ms, found the
/// slot the new one's holder freed.)
#[tokio::test(start_paused = true)]
async fn a_request_waiting_for_a_slot_across_a_reload_is_woken_by_the_new_configuration() {
    use tollgate::clock::TokioClock;
    let store = MemoryStore::builder().clock(TokioClock::new()).build().unwrap();
    let layer = LimitsLayer::with_store(config(&slots(1)), store).unwrap();
    let handle = layer.handle();
    let key = Key::text("waiting");
    let v1 = limiter(&handle);
    let first = v1.reserve(&key, 1).await.unwrap();
    assert!(first.decision().is_allowed());
    let waiter = tokio::spawn({
        let key = key.clone();
        async move {
            let check = Check::new(&key, 1).shape(Duration::from_secs(60));
            let r = v1.reserve_with(check).await.unwrap();
            (r.decision().is_allowed(), tokio::time::Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    reload(&handle, &slots(2));
    let second = limiter(&handle).reserve(&key, 1).await.unwrap();
    assert!(second.decision().is_allowed(), "one of 2 free");
    tokio::time::sleep(Duration::from_secs(1)).await;
    first.release().await.unwrap();
    // (Off the waiter's polling, every 100 ms from the first release.)
    tokio::time::sleep(Duration::from_millis(1_050)).await;
    assert!(!waiter.is_finished(), "the waiter's configuration allows 1, and 1 is held");
    let released = tokio::time::Instant::now();
    second.release().await.unwrap();
    assert_eq!(waiter.await.unwrap(), (true, released));
}

/// A memory store full of keys holding slots (`max_keys` 2, both taken by the old binding)
/// still carries their slots to the new binding: their holders give them back there. (Before,
/// the carry stopped at the cap: the new binding counted no slot held, and admitted as many
/// again beside the holders.)
#[tokio::test]
async fn slots_are_carried_however_full_the_store() {
    let store = MemoryStore::builder().clock(FakeClock::new()).max_keys(2).build().unwrap();
    let layer = LimitsLayer::with_store(config(&slots(1)), store).unwrap();
    let handle = layer.handle();
    let keys = [Key::text("a"), Key::text("b")];
    let mut held = Vec::new();
    for key in &keys {
        let r = limiter(&handle).reserve(key, 1).await.unwrap();
        assert!(r.decision().is_allowed());
        held.push(r);
    }
    reload(&handle, &slots(2));
    for key in &keys {
        assert_eq!(free(&handle, key).await, 1, "{key}: one of 2 held");
    }
    for r in held {
        r.release().await.unwrap();
    }
    for key in &keys {
        assert_eq!(free(&handle, key).await, 2, "{key}");
    }
}

#[tokio::test]
async fn a_reload_keeps_what_each_kind_of_tier_keeps_in_memory() {
    let clock = FakeClock::new();
    clock.set(MIDNIGHT + 3_600_000_000_000);
    rates_and_calendars(memory(&clock), false).await;
    other_units(memory(&clock), false).await;
    reserves(memory(&clock), false).await;
    concurrency(memory(&clock)).await;
    breaches(memory(&clock), &clock).await;
}

// ---------------------------------------------------------------------------------------------
// Random traces: checks, holds and releases of two keys, reloads of random parameters, clock
// steps, against a model of the penalty boxes, the slots held and a calendar day that no
// reload changes.

/// A configuration: a rate tier of `count` a minute under `algorithm` whose box blocks for
/// `block` seconds from the `after`-th breach within `within` seconds; `max` slots (leased for
/// a day); 1,000 a calendar day.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Setup {
    algorithm: &'static str,
    count: u64,
    block: u64,
    after: u32,
    within: u64,
    max: u64,
}

impl Setup {
    fn toml(&self) -> String {
        let window = if self.after > 1 {
            format!("block_window = \"{}s\"\n", self.within)
        } else {
            String::new()
        };
        format!(
            "[policies.p]\nalgorithm = \"{}\"\n\
             [[policies.p.tiers]]\nname = \"rate\"\ncount = {}\nperiod = \"1m\"\n\
             block = \"{}s\"\nblock_after = {}\n{window}\
             [[policies.p.tiers]]\nname = \"slots\"\nkind = \"concurrency\"\nmax = {}\nlease = \"1day\"\n\
             [[policies.p.tiers]]\nname = \"day\"\nkind = \"calendar\"\ncount = 1000\nperiod = \"day\"\n",
            self.algorithm, self.count, self.block, self.after, self.max
        )
    }

    /// The window breaches are counted in, nanoseconds (none when one breach blocks).
    fn within(&self) -> u64 {
        if self.after > 1 { self.within * 1_000_000_000 } else { 0 }
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// A check of key 0 or 1 (its slot given back at once).
    Check(usize),
    /// A reservation of key 0 or 1, held until released.
    Hold(usize),
    /// Releases the held reservation at this index (modulo how many are held).
    Release(usize),
    /// Milliseconds on the clock.
    Advance(u64),
    Reload(Setup),
}

fn setup() -> impl Strategy<Value = Setup> {
    const ALGORITHMS: [&str; 6] =
        ["gcra", "token_bucket", "leaky_bucket", "fixed_window", "sliding_counter", "sliding_log"];
    (
        proptest::sample::select(&ALGORITHMS[..]),
        1u64..=4,
        1u64..=300,
        1u32..=3,
        1u64..=300,
        1u64..=3,
    )
        .prop_map(|(algorithm, count, block, after, within, max)| Setup {
            algorithm,
            count,
            block,
            after,
            within,
            max,
        })
}

fn trace() -> impl Strategy<Value = (Setup, Vec<Op>)> {
    let op = prop_oneof![
        6 => (0usize..2).prop_map(Op::Check),
        3 => (0usize..2).prop_map(Op::Hold),
        2 => any::<usize>().prop_map(Op::Release),
        3 => (0u64..=90_000).prop_map(Op::Advance),
        2 => setup().prop_map(Op::Reload),
    ];
    (setup(), proptest::collection::vec(op, 1..80))
}

/// A key's penalty box (`Strikes`), in nanoseconds, and what the unchanged day counted.
#[derive(Default)]
struct Box_ {
    until: u64,
    at: Vec<u64>,
}

impl Box_ {
    /// What a decision forgets at `now` with breaches counted within `within`.
    fn prune(&mut self, now: u64, within: u64) {
        if self.until <= now {
            self.until = 0;
        }
        self.at.retain(|t| t + within > now);
    }
}

/// Replays `ops` from `first` through a `LimitsLayer` over `store` on `clock` (at `start`),
/// asserting after every step that:
/// - a key the model says is blocked is refused, for at least the rest of its block (a reload
///   never unblocks it, nor forgets a breach counted);
/// - the slots held never exceed the running max, and a query counts exactly those held
///   (none lost, none leaked, across reloads);
/// - the calendar day, which no reload changes, counts exactly the admitted requests: in
///   memory across every reload; on Redis per state key (algorithm and rate quota), which a
///   reload back finds again.
async fn replay<St: Store>(
    store: St,
    clock: &FakeClock,
    (first, ops): &(Setup, Vec<Op>),
    redis: bool,
) -> Result<Seen, String> {
    use std::collections::HashMap;
    let mut seen = Seen::default();
    let layer = LimitsLayer::with_store(config(&first.toml()), store).unwrap();
    let handle = layer.handle();
    let keys = [Key::text("k0"), Key::text("k1")];
    let mut setup = first.clone();
    let mut now = MIDNIGHT + 60_000_000_000;
    clock.set(now);
    let mut boxes = [Box_::default(), Box_::default()];
    // Per key and state key: admitted requests.
    let mut day: [HashMap<(&str, u64), u64>; 2] = Default::default();
    let state = |s: &Setup| if redis { (s.algorithm, s.count) } else { ("", 0) };
    // Held: the key, the reservation, and the window of the configuration it was taken under
    // (its release prunes the box as that configuration says).
    let mut held: Vec<(usize, tollgate::Reservation<St>, u64)> = Vec::new();
    let fail = |what: String| Err::<Seen, String>(what);
    for (step, op) in ops.iter().enumerate() {
        let at = format!("step {step} ({op:?}) under {setup:?}");
        match op {
            Op::Check(k) | Op::Hold(k) => {
                let k = *k;
                boxes[k].prune(now, setup.within());
                let limiter = limiter(&handle);
                let (d, reservation) = match op {
                    Op::Hold(_) => {
                        let r = limiter.reserve(&keys[k], 1).await.map_err(|e| e.to_string())?;
                        (r.decision().clone(), Some(r))
                    }
                    _ => (limiter.check(&keys[k], 1).await.map_err(|e| e.to_string())?, None),
                };
                let b = &mut boxes[k];
                if b.until > now {
                    let left = Duration::from_nanos(b.until - now);
                    if d.is_allowed() || d.retry_after().is_none_or(|r| r < left) {
                        return fail(format!("{at}: blocked for {left:?} more, but {d:?}"));
                    }
                } else if !d.is_allowed() && d.tiers()[0].is_violated() {
                    b.at.push(now);
                    if b.at.len() >= setup.after as usize {
                        b.at.clear();
                        b.until = now + setup.block * 1_000_000_000;
                    }
                }
                if d.is_allowed() {
                    *day[k].entry(state(&setup)).or_default() += 1;
                    if let Some(r) = reservation {
                        held.push((k, r, setup.within()));
                        let holding = held.iter().filter(|h| h.0 == k).count() as u64;
                        if holding > setup.max {
                            return fail(format!("{at}: {holding} held of {}", setup.max));
                        }
                    }
                }
            }
            Op::Release(i) if !held.is_empty() => {
                let (k, r, within) = held.remove(i % held.len());
                r.release().await.map_err(|e| e.to_string())?;
                boxes[k].prune(now, within);
            }
            Op::Release(_) => {}
            Op::Advance(ms) => {
                now += ms * 1_000_000;
                clock.set(now);
            }
            Op::Reload(next) if *next != setup => {
                handle.reload(config(&next.toml())).map_err(|e| e.to_string())?;
                seen.blocked += u64::from(boxes.iter().any(|b| b.until > now));
                seen.holding += u64::from(!held.is_empty());
                setup = next.clone();
            }
            Op::Reload(_) => {}
        }
        for k in 0..2 {
            boxes[k].prune(now, setup.within());
            let d = query(&handle, &keys[k]).await;
            let holding = held.iter().filter(|h| h.0 == k).count() as u64;
            let used = day[k].get(&state(&setup)).copied().unwrap_or(0);
            let got = (d.tiers()[1].remaining(), d.tiers()[2].remaining());
            if got != (setup.max.saturating_sub(holding), 1000 - used) {
                return fail(format!("{at}: key {k}: {holding} held, {used} used: {d:?}"));
            }
            if boxes[k].until > now && d.tiers()[0].remaining() != 0 {
                return fail(format!("{at}: key {k} blocked, but {d:?}"));
            }
        }
    }
    for (k, r, _) in held {
        r.release().await.map_err(|e| e.to_string())?;
        let d = query(&handle, &keys[k]).await;
        if d.tiers()[1].remaining() > setup.max {
            return fail(format!("more than the max free at the end: {d:?}"));
        }
    }
    for key in &keys {
        let free = query(&handle, key).await.tiers()[1].remaining();
        if free != setup.max {
            return fail(format!("{key}: {free} of {} free once every holder ended", setup.max));
        }
    }
    Ok(seen)
}

/// How many reloads of a trace found a key blocked, and slots held.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    blocked: u64,
    holding: u64,
}

/// Runs `cases` traces from a fixed seed, each through a store `connect` makes on a fake
/// clock under a prefix of its own.
fn traces<St: Store>(cases: u32, redis: bool, connect: impl Fn(&FakeClock, String) -> St) {
    use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[32; 32]);
    let config = Config { cases, failure_persistence: None, ..Config::default() };
    let mut runner = TestRunner::new_with_rng(config, rng);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let case = std::sync::atomic::AtomicU64::new(0);
    let seen = std::sync::Mutex::new(Seen::default());
    let result = runner.run(&trace(), |trace| {
        let n = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let clock = FakeClock::new();
        let store = connect(&clock, format!("trace{n}:"));
        let one = rt.block_on(replay(store, &clock, &trace, redis)).map_err(TestCaseError::fail)?;
        let mut all = seen.lock().unwrap();
        (all.blocked, all.holding) = (all.blocked + one.blocked, all.holding + one.holding);
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    // The traces reload while keys are blocked and while slots are held, many times.
    let seen = seen.into_inner().unwrap();
    assert!(
        seen.blocked >= u64::from(cases) / 4 && seen.holding >= u64::from(cases) / 4,
        "{seen:?}"
    );
}

#[test]
fn random_reloads_never_unblock_a_key_nor_lose_a_slot_in_memory() {
    traces(256, false, |clock, _| memory(clock));
}

/// The stores on a real redis-server, each on the fake clock `clock`, its keys under a prefix
/// of its own.
#[cfg(feature = "redis")]
mod on_redis {
    use super::*;
    use crate::support::redis::Server;
    use crate::support::stores::redis::on_clock;
    use tollgate::store::{Lease, RedisStore};

    #[test]
    fn random_reloads_never_unblock_a_key_nor_lose_a_slot_on_redis() {
        let Some(server) = Server::start("redis-server") else { return };
        traces(64, true, |clock, prefix| {
            on_clock(RedisStore::builder(server.url()), clock, &prefix)
        });
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lengthened_block_keeps_the_blocked_user_blocked_until_the_block_ends_on_redis() {
        let Some(server) = Server::start("redis-server") else { return };
        let clock = FakeClock::new();
        clock.set(MIDNIGHT);
        login_guard(on_clock(RedisStore::builder(server.url()), &clock, "guard:"), &clock).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reload_keeps_what_each_kind_of_tier_keeps_on_redis() {
        let Some(server) = Server::start("redis-server") else { return };
        let clock = FakeClock::new();
        clock.set(MIDNIGHT + 3_600_000_000_000);
        let store = |prefix: &str| on_clock(RedisStore::builder(server.url()), &clock, prefix);
        rates_and_calendars(store("rates:"), true).await;
        other_units(store("units:"), true).await;
        reserves(store("reserves:"), true).await;
        concurrency(store("slots:")).await;
        breaches(store("breaches:"), &clock).await;
    }

    /// GCRA, 100 an hour, its tier named `tier`, leased in blocks of at most 8.
    fn leased(tier: &str) -> String {
        format!("[policies.p]\ntiers = [{{ name = \"{tier}\", count = 100, period = \"1h\" }}]\n")
    }

    /// In lease mode an instance holds at most one block of a key (its stated bound counts one
    /// per instance): a reload that keeps the state keys (a tier renamed) hands the block the
    /// running binding holds to the new one, which spends it without a call. (Before, the new
    /// binding took a block of its own beside it: two blocks of one key in one instance.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reload_that_keeps_the_state_keys_keeps_the_leased_block() {
        let Some(server) = Server::start("redis-server") else { return };
        let clock = FakeClock::new();
        clock.set(MIDNIGHT);
        let lease = Lease::new().max_block(8).lifetime(Duration::from_secs(30));
        let builder = RedisStore::builder(server.url()).lease_policy("p", lease);
        let layer =
            LimitsLayer::with_store(config(&leased("hourly")), on_clock(builder, &clock, "lease:"))
                .unwrap();
        let handle = layer.handle();
        let key = Key::text("hot");
        // A first block of one unit, spent; the next of two, one of them spent.
        for _ in 0..2 {
            assert!(limiter(&handle).check(&key, 1).await.unwrap().is_allowed());
        }
        let before = limiter(&handle).bound().lease_stats();
        assert_eq!((before.grants, before.units_granted, before.decided_locally), (2, 3, 0));
        reload(&handle, &leased("per-hour"));
        let d = limiter(&handle).check(&key, 1).await.unwrap();
        assert!(d.is_allowed());
        let after = limiter(&handle).bound().lease_stats();
        assert_eq!((after.grants, after.decided_locally), (2, 1), "the block held, spent here");
        // What Redis charged is what was granted: 3 of the 100.
        let exact = LimitsLayer::with_store(
            config(&leased("per-hour")),
            on_clock(RedisStore::builder(server.url()), &clock, "lease:"),
        )
        .unwrap();
        assert_eq!(remaining(&exact.handle(), &key).await, [97]);
    }
}
