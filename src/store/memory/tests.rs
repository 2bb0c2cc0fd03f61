//! MemoryStore's unit tests: reloads, capacity, sweeping, bindings and settlements.

use std::net::{IpAddr, Ipv4Addr};

use super::*;
use crate::clock::FakeClock;
use crate::decision::Outcome;
use crate::quota::{Algorithm, Quota};

fn ip(i: u32) -> Key {
    Key::Ip(IpAddr::V4(Ipv4Addr::from(i)))
}

fn store(clock: &FakeClock, max_keys: usize, shards: usize) -> MemoryStore {
    MemoryStore::builder().clock(clock.clone()).max_keys(max_keys).shards(shards).build().unwrap()
}

fn allowed(store: &MemoryStore, bound: &MemoryPolicy, key: &Key) -> bool {
    store.check_now(bound, Check::new(key, 1)).decision.is_allowed()
}

/// What remains of each tier of `bound` for `key`, by a query.
fn remaining(store: &MemoryStore, bound: &MemoryPolicy, key: &Key) -> Vec<u64> {
    let d = store.check_now(bound, Check::new(key, 0)).decision;
    d.tiers().iter().map(crate::TierDecision::remaining).collect()
}

fn two_tiers(alg: Algorithm, hourly: u64) -> Policy {
    Policy::builder("p")
        .algorithm(alg)
        .tier("minute", Quota::per_minute(1_000))
        .tier("hour", Quota::per_hour(hourly))
        .build()
        .unwrap()
}

#[test]
fn a_reload_carries_the_used_fraction_of_changed_tiers_for_every_algorithm() {
    for alg in Algorithm::ALL {
        let clock = FakeClock::new();
        clock.set(7_200_000_000_000); // on a window boundary: windows start with the test
        let store = store(&clock, 100, 2);
        let key = Key::text("k");
        let v1 = store.bind_policy(&two_tiers(alg, 100));
        assert!(store.check_now(&v1, Check::new(&key, 30)).decision.is_allowed(), "{alg:?}");
        assert_eq!(remaining(&store, &v1, &key), [970, 70], "{alg:?}");
        // Doubled: 30 of 100 used is 60 of 200; the unchanged tier keeps its state.
        let carried = store.rebind_policy(&v1, &two_tiers(alg, 200), Carry::UsedFraction);
        assert_eq!(remaining(&store, &carried, &key), [970, 140], "{alg:?}");
        // Lowered: 30% of 15 is 4.5, counted as 5 used.
        let lowered = store.rebind_policy(&v1, &two_tiers(alg, 15), Carry::UsedFraction);
        assert_eq!(remaining(&store, &lowered, &key), [970, 10], "{alg:?}");
        // The default starts the changed tier full.
        let full = store.rebind_policy(&v1, &two_tiers(alg, 200), Carry::StartFull);
        assert_eq!(remaining(&store, &full, &key), [970, 200], "{alg:?}");
        // Another key, never seen: full everywhere; and the old binding is untouched.
        assert_eq!(remaining(&store, &carried, &Key::text("new")), [1_000, 200], "{alg:?}");
        assert_eq!(remaining(&store, &v1, &key), [970, 70], "{alg:?}");
    }
}

#[test]
fn a_carried_gcra_tier_refills_at_its_new_rate() {
    let clock = FakeClock::new();
    let store = store(&clock, 100, 2);
    let key = Key::text("k");
    // One GCRA tier: the compact form, on both sides.
    let v1 = store.bind_policy(&Policy::single("p", Quota::per_hour(100)).unwrap());
    assert!(store.check_now(&v1, Check::new(&key, 30)).decision.is_allowed());
    let v2 = Policy::single("p", Quota::per_hour(200)).unwrap();
    let carried = store.rebind_policy(&v1, &v2, Carry::UsedFraction);
    assert_eq!(remaining(&store, &carried, &key), [140]);
    // One unit comes back every 18 s (3,600 s / 200), not every 36 s.
    clock.advance(Duration::from_secs(18));
    assert_eq!(remaining(&store, &carried, &key), [141]);
    // Bound again while `carried` holds it, the same policy shares its state: one policy on
    // one store is one budget, and nothing is carried.
    let again = store.rebind_policy(&v1, &v2, Carry::StartFull);
    assert_eq!(remaining(&store, &again, &key), [141]);
    drop(again);
    // The same tier in a renamed policy keeps its TATs as they are.
    let renamed = Policy::builder("renamed").tier("p", Quota::per_hour(100)).build().unwrap();
    let kept = store.rebind_policy(&v1, &renamed, Carry::StartFull);
    assert_eq!(remaining(&store, &kept, &key), [70]);
    // From the compact form to general tables and back, matched by tier name.
    let wider = Policy::builder("p")
        .tier("p", Quota::per_hour(100))
        .tier("day", Quota::per_day(1_000))
        .build()
        .unwrap();
    let general = store.rebind_policy(&carried, &wider, Carry::UsedFraction);
    // 59 of 200 used: 29.5 of 100, counted as 30.
    assert_eq!(remaining(&store, &general, &key), [70, 1_000]);
    // (Another policy than `carried`'s, whose state the store keeps for it.)
    let doubled = Policy::builder("q").tier("p", Quota::per_hour(200)).build().unwrap();
    let back = store.rebind_policy(&general, &doubled, Carry::UsedFraction);
    assert_eq!(remaining(&store, &back, &key), [140]);
    // By default a changed tier starts full.
    let fresh = Policy::builder("r").tier("p", Quota::per_hour(200)).build().unwrap();
    let fresh = store.rebind_policy(&v1, &fresh, Carry::StartFull);
    assert_eq!(remaining(&store, &fresh, &key), [200]);
}

#[test]
fn an_unchanged_tier_keeps_its_count_between_the_compact_form_and_general_tables() {
    let clock = FakeClock::new();
    let store = store(&clock, 100, 2);
    let key = Key::text("k");
    let hour = Policy::builder("p").tier("hour", Quota::per_hour(100)).build().unwrap();
    let both = Policy::builder("p")
        .tier("sec", Quota::per_second(1_000))
        .tier("hour", Quota::per_hour(100))
        .build()
        .unwrap();
    let v1 = store.bind_policy(&hour);
    assert!(store.check_now(&v1, Check::new(&key, 90)).decision.is_allowed());
    let added = store.rebind_policy(&v1, &both, Carry::StartFull);
    assert_eq!(remaining(&store, &added, &key), [1_000, 10]);
    let removed = store.rebind_policy(&added, &hour, Carry::StartFull);
    assert_eq!(remaining(&store, &removed, &key), [10]);
}

#[test]
fn calendar_tiers_carry_their_used_fraction_and_concurrency_tiers_keep_their_slots() {
    let clock = FakeClock::new();
    let store = store(&clock, 100, 2);
    let key = Key::text("k");
    let policy = |max: u64, daily: u64| {
        Policy::builder("p")
            .concurrency("slots", crate::Concurrency::new(max))
            .calendar("daily", crate::Calendar::per_day(daily))
            .build()
            .unwrap()
    };
    let v1 = store.bind_policy(&policy(4, 100));
    let held = store.check_now(&v1, Check::new(&key, 1).with_costs(&[1, 30]).with_ticket());
    assert!(held.decision.is_allowed());
    assert_eq!(remaining(&store, &v1, &key), [3, 70]);
    let v2 = store.rebind_policy(&v1, &policy(8, 1_000), Carry::UsedFraction);
    // The slot held through v1 counts on v2, whatever its new max.
    assert_eq!(remaining(&store, &v2, &key), [7, 700]);
    // Its release frees v2's slot (which v1 decides on now too).
    drop(held);
    assert_eq!(remaining(&store, &v2, &key), [8, 700]);
    assert_eq!(remaining(&store, &v1, &key), [4, 70]);
}

#[test]
fn full_store_keeps_established_keys_and_shares_one_overflow_bucket() {
    let clock = FakeClock::new();
    let store = store(&clock, 10, 4);
    let bound = store.bind_policy(&Policy::single("p", Quota::per_hour(2)).unwrap());
    for i in 0..10 {
        assert!(allowed(&store, &bound, &ip(i)));
    }
    assert_eq!(store.len(), 10);
    // 100 new keys: none is held; together they get the overflow bucket's 2 units.
    let admitted = (100..200).filter(|i| allowed(&store, &bound, &ip(*i))).count();
    assert_eq!(admitted, 2);
    assert_eq!(store.len(), 10);
    // Established keys keep their own state: one unit left each.
    assert!(allowed(&store, &bound, &ip(3)));
    assert!(!allowed(&store, &bound, &ip(3)));
}

#[test]
fn a_full_shard_is_scanned_for_room_at_most_every_100_ms() {
    let clock = FakeClock::new();
    let store = store(&clock, 10, 1);
    let bound =
        store.bind_policy(&Policy::single("p", Quota::new(1, Duration::from_millis(20))).unwrap());
    for i in 0..10 {
        assert!(allowed(&store, &bound, &ip(i)));
    }
    // Full and nothing idle: scanned, then key 100 goes to the overflow bucket.
    assert!(allowed(&store, &bound, &ip(100)));
    assert_eq!(store.len(), 10);
    // 50 ms later every key is idle, but the shard was scanned 50 ms ago: overflow again
    // (the overflow bucket is idle too, so key 101 is admitted there, not stored).
    clock.advance(Duration::from_millis(50));
    assert!(allowed(&store, &bound, &ip(101)));
    assert_eq!(store.len(), 10);
    // 100 ms after the last scan, the next new key scans, evicts the ten idle keys and is
    // stored.
    clock.advance(Duration::from_millis(50));
    assert!(allowed(&store, &bound, &ip(102)));
    assert_eq!(store.len(), 1);
}

#[test]
fn sweep_removes_only_idle_keys() {
    let clock = FakeClock::new();
    let store = store(&clock, 100, 4);
    let fast = store.bind_policy(&Policy::single("fast", Quota::per_second(1)).unwrap());
    let slow = store.bind_policy(&Policy::single("slow", Quota::per_hour(1)).unwrap());
    assert!(allowed(&store, &fast, &ip(1)));
    assert!(allowed(&store, &slow, &ip(1)));
    assert_eq!(store.sweep(), 0);
    clock.advance(Duration::from_secs(1));
    assert_eq!(store.sweep(), 1, "the 1/s key is back to full, the 1/h key is not");
    assert_eq!(store.len(), 1);
    assert!(!allowed(&store, &slow, &ip(1)));
}

#[test]
fn bindings_keep_apart_whatever_their_names() {
    // Two layers on one store with the same policy name and other quotas: each keeps its
    // own state, exactly (the old per-name table made them wipe each other).
    let store = MemoryStore::builder().clock(FakeClock::new()).build().unwrap();
    let a = store.bind_policy(&Policy::single("api", Quota::per_hour(3)).unwrap());
    let b = store.bind_policy(&Policy::single("api", Quota::per_hour(5)).unwrap());
    let mut admitted = (0, 0);
    for _ in 0..10 {
        admitted.0 += usize::from(allowed(&store, &a, &Key::Global));
        admitted.1 += usize::from(allowed(&store, &b, &Key::Global));
    }
    assert_eq!(admitted, (3, 5));
}

#[test]
fn a_dropped_bindings_keys_stay_for_its_policy_until_idle_then_its_slot_is_freed() {
    let clock = FakeClock::new();
    let store = store(&clock, 100, 4);
    let policy = Policy::single("p", Quota::per_hour(1)).unwrap();
    let first = store.bind_policy(&policy);
    for i in 0..5 {
        assert!(allowed(&store, &first, &ip(i)));
    }
    assert_eq!(store.len(), 5);
    drop(first);
    // The state is the store's: the next binding of the policy finds it.
    let second = store.bind_policy(&policy);
    assert_eq!(second.id, 0);
    assert_eq!(store.len(), 5);
    assert!(!allowed(&store, &second, &ip(0)));
    drop(second);
    // Idle an hour later: swept, and the slot is given up.
    clock.advance(Duration::from_secs(3_600));
    assert_eq!(store.sweep(), 5);
    // Another policy reuses it, after clearing it: its keys start fresh.
    let other = store.bind_policy(&Policy::single("q", Quota::per_hour(1)).unwrap());
    assert_eq!(other.id, 0);
    assert_eq!(store.len(), 0);
    assert!(allowed(&store, &other, &ip(0)));
}

#[test]
fn one_policy_on_one_store_is_one_budget_however_often_it_is_bound() {
    let store = store(&FakeClock::new(), 100, 4);
    // A binding per request, each dropped after its request: 5 of 100.
    let hourly = Policy::single("api", Quota::per_hour(5)).unwrap();
    let admitted =
        (0..100).filter(|_| allowed(&store, &store.bind_policy(&hourly), &Key::Global)).count();
    assert_eq!(admitted, 5);
    // Two bindings alive at once, in general tables: one budget.
    let two = Policy::builder("api")
        .tier("minute", Quota::per_minute(1_000))
        .tier("hour", Quota::per_hour(5))
        .build()
        .unwrap();
    let (a, b) = (store.bind_policy(&two), store.bind_policy(&two));
    let admitted =
        (0..100).filter(|i| allowed(&store, if i % 2 == 0 { &a } else { &b }, &Key::Global));
    assert_eq!(admitted.count(), 5);
    // The same name with other tiers is another policy: its own budget.
    let other = store.bind_policy(&Policy::single("api", Quota::per_hour(3)).unwrap());
    assert_eq!((0..10).filter(|_| allowed(&store, &other, &Key::Global)).count(), 3);
}

#[test]
fn a_replaced_binding_charges_its_unchanged_tiers_where_they_now_live() {
    let clock = FakeClock::new();
    let store = store(&clock, 100, 4);
    let key = Key::text("k");
    // The compact form, then general tables, then the compact form again.
    let daily = Policy::builder("p").tier("day", Quota::per_day(10)).build().unwrap();
    let both = Policy::builder("p")
        .tier("minute", Quota::per_minute(2))
        .tier("day", Quota::per_day(10))
        .build()
        .unwrap();
    let v1 = store.bind_policy(&daily);
    assert!(store.check_now(&v1, Check::new(&key, 2)).decision.is_allowed());
    let v2 = store.rebind_policy(&v1, &both, Carry::StartFull);
    // A request still going through v1 charges the daily tier that v2 decides on, and
    // sees v2's charges.
    assert!(store.check_now(&v1, Check::new(&key, 1)).decision.is_allowed());
    assert_eq!(remaining(&store, &v2, &key), [2, 7]);
    assert!(allowed(&store, &v2, &key));
    assert_eq!(remaining(&store, &v1, &key), [6]);
    // Through a second reload, both old bindings charge the newest; v2 keeps its own
    // per-minute tier (both units used now).
    let v3 = store.rebind_policy(&v2, &daily, Carry::StartFull);
    assert_ne!(v3.id, v1.id, "a replaced binding's state is no longer its policy's");
    assert!(allowed(&store, &v1, &key));
    assert!(allowed(&store, &v2, &key));
    assert_eq!(remaining(&store, &v3, &key), [4]);
    assert!(!allowed(&store, &v2, &key), "v2's own per-minute tier is spent");
    assert_eq!(remaining(&store, &v3, &key), [4], "a refused request charges nothing");
    // A key first seen through an old binding lands in the newest too.
    let other = Key::text("other");
    assert!(store.check_now(&v1, Check::new(&other, 4)).decision.is_allowed());
    assert_eq!(remaining(&store, &v3, &other), [6]);
    // A charge taken through v1 and cancelled is given back where it was taken.
    let ticket = store.check_now(&v1, Check::new(&key, 2).with_ticket()).ticket.unwrap();
    assert_eq!(remaining(&store, &v3, &key), [2]);
    store.settle_now(&v1, ticket, 0);
    assert_eq!(remaining(&store, &v3, &key), [4]);
    // Once the old bindings are dropped, the newest alone holds the policy's state.
    drop((v1, v2));
    assert_eq!(remaining(&store, &v3, &key), [4]);
    assert_eq!(remaining(&store, &store.bind_policy(&daily), &key), [4]);
}

#[test]
fn a_policy_other_bindings_share_stays_theirs_when_one_of_them_is_rebound() {
    let store = store(&FakeClock::new(), 100, 4);
    let key = Key::Global;
    let daily = Policy::builder("p").tier("day", Quota::per_day(10)).build().unwrap();
    let both = Policy::builder("p")
        .tier("minute", Quota::per_minute(100))
        .tier("day", Quota::per_day(10))
        .build()
        .unwrap();
    let (a, b) = (store.bind_policy(&daily), store.bind_policy(&daily));
    assert!(store.check_now(&a, Check::new(&key, 2)).decision.is_allowed());
    let reloaded = store.rebind_policy(&a, &both, Carry::StartFull);
    assert_eq!(remaining(&store, &reloaded, &key), [100, 8]);
    // `a` and `b` keep sharing the daily policy's budget, apart from the new one's.
    assert!(store.check_now(&a, Check::new(&key, 1)).decision.is_allowed());
    assert_eq!(remaining(&store, &b, &key), [7]);
    assert_eq!(remaining(&store, &reloaded, &key), [100, 8]);
}

#[test]
fn reloads_lose_no_charge_of_requests_still_deciding_through_the_old_binding() {
    // 1,000 requests on four threads, each through whichever binding is current when it
    // starts, while another thread reloads 200 times, adding and removing a per-minute
    // tier beside a daily tier of 500 that never changes: exactly 500 admitted.
    let daily = Policy::builder("api").tier("day", Quota::per_day(500)).build().unwrap();
    let both = Policy::builder("api")
        .tier("minute", Quota::per_minute(100_000))
        .tier("day", Quota::per_day(500))
        .build()
        .unwrap();
    let store = store(&FakeClock::new(), 1_000, 4);
    let current = Mutex::new(Arc::new(store.bind_policy(&daily)));
    let admitted = AtomicUsize::new(0);
    let load = || Arc::clone(&*lock(&current));
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..250 {
                    let bound = load();
                    std::thread::yield_now();
                    if allowed(&store, &bound, &Key::Global) {
                        admitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
        s.spawn(|| {
            for i in 0..200 {
                let next = if i % 2 == 0 { &both } else { &daily };
                let new = Arc::new(store.rebind_policy(&load(), next, Carry::StartFull));
                *lock(&current) = new;
                std::thread::yield_now();
            }
        });
    });
    assert_eq!(admitted.load(Ordering::Relaxed), 500);
}

#[tokio::test(start_paused = true)]
async fn sweeper_runs_on_its_interval_and_stops_with_the_store() {
    let store = MemoryStore::builder()
        .clock(crate::clock::TokioClock::new())
        .sweep_interval(Duration::from_secs(5))
        .build()
        .unwrap();
    let bound = store.bind_policy(&Policy::single("p", Quota::per_second(1)).unwrap());
    assert!(allowed(&store, &bound, &ip(1)));
    assert_eq!(store.len(), 1);
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(store.len(), 0);
    let weak = Arc::downgrade(&store.inner);
    drop((store, bound));
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert!(weak.upgrade().is_none(), "the sweeper holds no strong reference");
}

/// A sweeper started on one runtime sweeps there: a check made on another runtime (dropped
/// afterwards, as a sweeper spawned there would be) leaves it where it is.
#[test]
fn a_sweeper_started_ahead_runs_on_its_own_runtime() {
    let runtime =
        || tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build();
    let clock = FakeClock::new();
    let store = MemoryStore::builder()
        .clock(clock.clone())
        .sweep_interval(Duration::from_secs(5))
        .build()
        .unwrap();
    let bound = store.bind_policy(&Policy::single("p", Quota::per_second(1)).unwrap());
    let background = runtime().unwrap();
    background.block_on(async { store.start_sweeping() });
    runtime().unwrap().block_on(async { assert!(allowed(&store, &bound, &ip(1))) });
    assert_eq!(store.len(), 1);
    clock.advance(Duration::from_secs(2));
    // Paused, the background runtime's time moves on to the sweeper's next tick.
    background.block_on(async { tokio::time::sleep(Duration::from_secs(11)).await });
    assert_eq!(store.len(), 0, "swept on the background runtime");
}

#[test]
fn threads_never_over_admit() {
    let store = MemoryStore::new();
    let bound = store.bind_policy(&Policy::single("p", Quota::per_hour(1000)).unwrap());
    let admitted = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..1000 {
                    if allowed(&store, &bound, &Key::Global) {
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
    let store = store(&FakeClock::new(), 100, 4);
    let bound = store.bind_policy(&Policy::single("p", Quota::per_hour(10)).unwrap());
    let key = ip(7);
    let c = Check::new(&key, 4).with_ticket();
    let ticket = store.check_now(&bound, c).ticket.unwrap();
    store.settle_now(&bound, ticket, 9);
    let d = store.check_now(&bound, Check::new(&key, 1)).decision;
    assert_eq!(d.tiers()[0].remaining(), 0);
    let query = store.check_now(&bound, Check::new(&key, 0).with_ticket());
    assert!(query.ticket.is_none(), "cost 0 charges nothing");
    let d = store.check_now(&bound, Check::new(&key, 1)).decision;
    assert_eq!(d.outcome(), Outcome::Limited);
}

#[test]
fn a_stale_ticket_cannot_cancel_an_entry_of_the_keys_next_life() {
    // Sliding-log entry ids restart when an idle key is evicted; a ticket from before must
    // not give back the entry that reuses its id.
    let clock = FakeClock::new();
    let store = store(&clock, 100, 4);
    let policy = Policy::builder("log")
        .algorithm(Algorithm::SlidingLog)
        .tier("t", Quota::per_second(1))
        .build()
        .unwrap();
    let bound = store.bind_policy(&policy);
    let key = Key::Global;
    let reserve = Check::new(&key, 1).with_ticket();
    let stale = store.check_now(&bound, reserve).ticket.unwrap();
    clock.advance(Duration::from_secs(1));
    assert_eq!(store.sweep(), 1, "idle: evicted, ids start over");
    assert!(store.check_now(&bound, reserve).decision.is_allowed());
    store.settle_now(&bound, stale, 0);
    assert!(!store.check_now(&bound, reserve).decision.is_allowed(), "the new entry counts");
}

#[test]
fn cost_above_capacity_on_a_new_key_leaves_no_state() {
    let store = MemoryStore::new();
    let bound = store.bind_policy(&Policy::single("p", Quota::per_second(2)).unwrap());
    let v = store.check_now(&bound, Check::new(&Key::Global, 3));
    assert_eq!(v.decision.outcome(), Outcome::CostExceedsCapacity);
    assert!(store.is_empty());
}

#[test]
fn builder_refuses_out_of_range_settings_by_name() {
    let err = |b: MemoryStoreBuilder| match b.build() {
        Err(ConfigError::Invalid { setting, .. }) => setting,
        other => panic!("expected an error, got {other:?}"),
    };
    assert_eq!(err(MemoryStore::builder().max_keys(0)), "max_keys");
    assert_eq!(err(MemoryStore::builder().sweep_interval(Duration::ZERO)), "sweep_interval");
    assert_eq!(err(MemoryStore::builder().shards(0)), "shards");
    assert_eq!(err(MemoryStore::builder().shards((1 << 16) + 1)), "shards");
}
