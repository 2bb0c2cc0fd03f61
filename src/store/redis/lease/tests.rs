//! Lease mode's unit tests: sizing, spending, prefetch and give-back, on an injected clock.

use super::*;
use crate::algorithm::Charge;
use crate::decision::{TierDecision, Tiers};
use crate::quota::{Calendar, Concurrency, Penalty, Quota};
use smallvec::smallvec;

const MS: u64 = 1_000_000;
const S: u64 = 1_000 * MS;

/// What Redis answers to a grant: admitted, with `remaining` left in Redis.
fn grant(limit: u64, remaining: u64, reset: u64) -> Decision {
    let tiers: Tiers = smallvec![TierDecision::new(limit, remaining, reset, None, false)];
    Decision::new(Outcome::Allowed, 0, None, tiers)
}

/// What Redis answers to a grant at `_at` leaving `remaining` (the reset is immaterial).
fn grant_at(remaining: u64, _at: u64) -> Decision {
    grant(4_000, remaining, 10 * MS)
}

fn charges(take: u64, at: u64) -> Charges {
    smallvec![Charge { at, cost: take, id: 0 }]
}

/// A grant of `take` units at `at` (charged as `charged` units), waiting until `hold`.
fn block(take: u64, charged: u64, at: u64, hold: u64) -> Grant {
    Grant {
        take,
        charges: charges(charged, at),
        at,
        hold,
        useful: 1,
        sent: None,
        paced: Paced::new(),
    }
}

/// A block of the key's schedule: each unit is spent once it conforms (refused until
/// then, with the exact wait), `remaining` counts the units that conform now, and a
/// prefetched block joining it keeps each grant's own pace.
#[test]
fn units_of_the_schedule_are_spent_at_their_own_grants_pace() {
    let p = Policy::single("p", Quota::per_second(100_000).with_burst(1_000)).unwrap();
    let l = Arc::new(Leases::new(&p, Lease::new().max_block(64).schedule(true)));
    assert!(l.horizon > 0);
    let slot = l.slot(&Key::text("k")).unwrap();
    let t = 10_000; // T: 10 µs
    // 8 units granted at S: the check's own conforms now, the last at S + 70 µs.
    let mut g = block(8, 8, S, 0);
    g.paced = smallvec![(S + 7 * t, t)];
    let d = l.granted(&slot, 1, grant_at(0, S), g);
    assert_eq!((d.outcome, d.tiers[0].remaining), (Outcome::Allowed, 0));
    let (d, granted) = l.spend(&slot, 1, Some(S)).unwrap();
    assert_eq!((d.outcome, d.retry_after, granted), (Outcome::Limited, t, None));
    assert_eq!((d.tiers[0].remaining, d.tiers[0].retry_after), (0, t));
    // 5 ns after the second unit's instant: the first two conform.
    let (d, granted) = l.spend(&slot, 1, Some(S + 2 * t + 5)).unwrap();
    assert_eq!((d.outcome, d.tiers[0].remaining, granted), (Outcome::Allowed, 1, Some(S)));
    // Two more (the units of 20 and 30 µs) need the later one's instant.
    let (d, _) = l.spend(&slot, 2, Some(S + 2 * t + 5)).unwrap();
    assert_eq!((d.outcome, d.retry_after), (Outcome::Limited, t - 5));
    // A prefetch at 30 µs takes the next 4 units of the schedule, at 90 to 120 µs
    // (another instance took 80 µs): the 6 held keep their instants, 20 to 70 µs.
    let mut g = block(4, 4, S + 3 * t, 0);
    g.paced = smallvec![(S + 12 * t, t)];
    l.prefetched(&slot, grant_at(0, S + 3 * t), g);
    for remaining in (0..6).rev() {
        let (d, granted) = l.spend(&slot, 1, Some(S + 7 * t)).unwrap();
        assert_eq!((d.outcome, d.tiers[0].remaining), (Outcome::Allowed, remaining));
        assert_eq!(granted, Some(S + 3 * t), "the block's instant is the last grant's");
    }
    let (d, _) = l.spend(&slot, 1, Some(S + 7 * t)).unwrap();
    assert_eq!((d.outcome, d.retry_after), (Outcome::Limited, 2 * t));
    for remaining in [1, 0] {
        let (d, _) = l.spend(&slot, 1, Some(S + 10 * t)).unwrap();
        assert_eq!((d.outcome, d.tiers[0].remaining), (Outcome::Allowed, remaining));
    }
    let (d, _) = l.spend(&slot, 1, Some(S + 11 * t - 1)).unwrap();
    assert_eq!((d.outcome, d.retry_after), (Outcome::Limited, 1));
    let (d, _) = l.spend(&slot, 1, Some(S + 11 * t)).unwrap();
    assert_eq!((d.outcome, d.tiers[0].remaining), (Outcome::Allowed, 0));
    let (d, _) = l.spend(&slot, 1, Some(S + 11 * t)).unwrap();
    assert_eq!((d.outcome, d.retry_after), (Outcome::Limited, t));
    let (d, _) = l.spend(&slot, 1, Some(S + 12 * t)).unwrap();
    assert_eq!((d.outcome, d.tiers[0].remaining), (Outcome::Allowed, 0));
    // Spent, with no wait: the next check asks Redis.
    assert!(l.spend(&slot, 1, Some(S + 12 * t)).is_none());
    assert_eq!(l.stats().refused_locally, 5);
}

#[test]
fn blocks_double_while_spent_and_shrink_to_what_a_lifetime_spent() {
    let p = Policy::single("p", Quota::per_second(100)).unwrap();
    let l =
        Arc::new(Leases::new(&p, Lease::new().max_block(16).lifetime(Duration::from_millis(10))));
    let key = Key::text("k");
    let slot = l.slot(&key).unwrap();
    let mut sizes = Vec::new();
    for _ in 0..6 {
        let b = l.begin(&slot, 1, Some(S));
        assert!(b.rest.is_none(), "every block was spent");
        sizes.push(b.block);
        let d = l.granted(&slot, 1, grant(100, 50, S), block(b.block, b.block, S, 0));
        // What exact mode reports at the grant: Redis's rest plus the block's.
        assert_eq!(d.tiers()[0].remaining(), (50 + b.block - 1).min(100));
        for left in (0..b.block - 1).rev() {
            let (d, granted_at) = l.spend(&slot, 1, Some(S + MS)).unwrap();
            assert_eq!(granted_at, Some(S));
            // Then Redis's rest at the grant plus what this instance still holds: never
            // the block alone (50 left in Redis), and the reset counted down.
            assert_eq!(d.tiers()[0].remaining(), 50 + left);
            assert_eq!(d.tiers()[0].reset_after(), Duration::from_nanos(S - MS));
        }
        assert!(l.spend(&slot, 1, Some(S + MS)).is_none());
    }
    assert_eq!(sizes, [1, 2, 4, 8, 16, 16]);
    // A block of 16 with 5 spent when its lifetime ends: the next is 5, and the 11 left
    // are given back by the call that takes it.
    let b = l.begin(&slot, 1, Some(S));
    l.granted(&slot, 1, grant(100, 50, S), block(b.block, 16, S, 0));
    for _ in 0..4 {
        assert!(l.spend(&slot, 1, Some(S + 9 * MS)).is_some());
    }
    assert!(l.spend(&slot, 1, Some(S + 10 * MS)).is_none(), "never after its lifetime");
    assert!(l.spend(&slot, 1, Some(S - 1)).is_none(), "nor before its grant");
    let b = l.begin(&slot, 1, Some(S + 10 * MS));
    assert_eq!(b.block, 5);
    let rest = b.rest.unwrap();
    assert_eq!((rest.granted, rest.spent), (16, 5));
    // A check costing more than the largest block asks for its cost.
    assert_eq!(l.begin(&slot, 40, Some(S + 10 * MS)).block, 40);
    let stats = l.stats();
    assert_eq!((stats.grants, stats.units_granted), (7, 1 + 2 + 4 + 8 + 16 + 16 + 16));
}

#[test]
fn the_useful_block_is_two_milliseconds_of_refill_and_a_quarter_of_the_burst_at_most() {
    let gcra = |rate, burst| Policy::single("p", Quota::per_second(rate).with_burst(burst));
    assert_eq!(useful_block(&gcra(400_000, 4_000).unwrap(), 2_048), 800);
    assert_eq!(useful_block(&gcra(400_000, 4_000).unwrap(), 512), 512);
    assert_eq!(useful_block(&gcra(400_000, 4_000).unwrap(), 64), 64);
    assert_eq!(useful_block(&gcra(400_000, 800).unwrap(), 512), 200);
    // A slow key waits for its next unit: a refusal's own wait.
    assert_eq!(useful_block(&gcra(100, 100).unwrap(), 512), 1);
    let two = Policy::builder("p")
        .tier("second", Quota::per_second(400_000).with_burst(4_000))
        .tier("minute", Quota::per_minute(6_000_000).with_burst(1_200))
        .build()
        .unwrap();
    assert_eq!(useful_block(&two, 512), 200);
    let bucket = Policy::builder("b")
        .algorithm(Algorithm::TokenBucket)
        .tier("second", Quota::per_second(50_000).with_burst(10_000))
        .build()
        .unwrap();
    assert_eq!(useful_block(&bucket, 512), 100);
    let window = Policy::builder("w")
        .algorithm(Algorithm::FixedWindow)
        .tier("second", Quota::per_second(400_000))
        .build()
        .unwrap();
    assert_eq!(useful_block(&window, 512), 0);
}

#[test]
fn the_useful_block_grows_to_two_round_trips_of_refill_when_calls_take_longer() {
    // 400,000 a second, a burst of 40,000, blocks of at most 4,096: 800 units refill in
    // 2 ms.
    let p = Policy::single("p", Quota::per_second(400_000).with_burst(40_000)).unwrap();
    let l = Arc::new(Leases::new(&p, Lease::new().max_block(4_096)));
    assert_eq!((l.useful_now(), l.stats().round_trip), (800, Duration::ZERO));
    // Round trips up to 1 ms: 2 ms of refill, as before any call.
    l.observe(None, Some(S), Some(S + MS));
    assert_eq!((l.useful_now(), l.stats().round_trip), (800, Duration::from_millis(1)));
    // 1.2 ms: 2.4 ms of refill, 960 units, which a check taking a new block asks for.
    l.round_trip.store(1_200_000, Ordering::Relaxed);
    assert_eq!(l.useful_now(), 960);
    let slot = l.slot(&Key::text("k")).unwrap();
    slot.held.lock().unwrap().next = 4_096;
    let b = l.begin(&slot, 1, Some(S));
    assert_eq!((b.block, b.useful), (4_096, 960));
    // 20 ms: 16,000 units refill; a quarter of the burst (10,000) and the largest block
    // (4,096) at most, so the bound stays N x max_block.
    l.round_trip.store(20 * MS, Ordering::Relaxed);
    assert_eq!(l.useful_now(), 4_096);
    let large = Leases::new(&p, Lease::new().max_block(20_000));
    large.round_trip.store(20 * MS, Ordering::Relaxed);
    assert_eq!(large.useful_now(), 10_000);
    // Windows wait for no useful block, however long the calls.
    let window = Policy::builder("w")
        .algorithm(Algorithm::FixedWindow)
        .tier("second", Quota::per_second(400_000))
        .build()
        .unwrap();
    let l = Leases::new(&window, Lease::new().max_block(512));
    l.round_trip.store(2 * MS, Ordering::Relaxed);
    assert_eq!(l.useful_now(), 0);
}

#[test]
fn a_key_checked_again_only_after_the_lifetime_keeps_its_block_size() {
    let p = Policy::single("p", Quota::per_second(100)).unwrap();
    let l =
        Arc::new(Leases::new(&p, Lease::new().max_block(16).lifetime(Duration::from_millis(10))));
    let slot = l.slot(&Key::text("cold")).unwrap();
    for at in [S, 2 * S, 3 * S] {
        let b = l.begin(&slot, 1, Some(at));
        assert_eq!(b.block, 1, "nothing to give back later");
        l.granted(&slot, 1, grant(100, 99, S), block(1, 1, at, 0));
    }
    // Asked again within the lifetime of the spent block: it doubles.
    assert_eq!(l.begin(&slot, 1, Some(3 * S + 9 * MS)).block, 2);
}

#[test]
fn a_spent_block_refuses_until_a_useful_block_is_back_with_that_retry() {
    let p = Policy::single("p", Quota::per_second(400_000).with_burst(4_000)).unwrap();
    let l =
        Arc::new(Leases::new(&p, Lease::new().max_block(512).lifetime(Duration::from_millis(100))));
    let slot = l.slot(&Key::text("k")).unwrap();
    let b = l.begin(&slot, 1, Some(S));
    assert_eq!((b.block, b.useful), (1, 1));
    // Redis had 3 units: all of them granted, and 400 there again 1 ms after the grant.
    let d = l.granted(&slot, 1, grant(4_000, 0, 10 * MS), block(3, 3, S, S + MS));
    assert_eq!((d.outcome(), d.tiers()[0].remaining()), (Outcome::Allowed, 2));
    for _ in 0..2 {
        let (d, granted_at) = l.spend(&slot, 1, Some(S + 100_000)).unwrap();
        assert_eq!((d.outcome(), granted_at), (Outcome::Allowed, Some(S)));
    }
    let (d, granted_at) = l.spend(&slot, 1, Some(S + 250_000)).unwrap();
    assert_eq!(granted_at, None, "a refusal holds no units");
    assert_eq!(d.outcome(), Outcome::Limited);
    assert_eq!(d.retry_after(), Some(Duration::from_nanos(750_000)));
    let t = d.tiers()[0];
    assert_eq!((t.remaining(), t.is_violated()), (0, true));
    assert_eq!(t.retry_after(), Some(Duration::from_nanos(750_000)));
    assert_eq!(t.reset_after(), Duration::from_nanos(10 * MS - 250_000));
    // A check costing more than is left is refused the same way.
    let (d, _) = l.spend(&slot, 2, Some(S + MS - 1)).unwrap();
    assert_eq!(d.retry_after(), Some(Duration::from_nanos(1)));
    // At the instant, Redis is asked again.
    assert!(l.spend(&slot, 1, Some(S + MS)).is_none());
    let stats = l.stats();
    assert_eq!((stats.decided_locally, stats.refused_locally), (2, 2));
    // The next block doubles: the last was spent.
    let b = l.begin(&slot, 1, Some(S + MS));
    assert_eq!((b.block, b.useful), (6, 6));
    assert!(b.rest.is_none());
    // A grant that needs no wait: a spent block asks Redis at once.
    l.granted(&slot, 1, grant(4_000, 3_000, 10 * MS), block(1, 1, S + MS, 0));
    assert!(l.spend(&slot, 1, Some(S + MS)).is_none());
}

#[test]
fn an_instance_that_got_a_share_waits_in_proportion_up_to_half_the_bursts_refill() {
    // 400,000 a second, a burst of 4,000: half the burst refills in 5 ms.
    let p = Policy::single("p", Quota::per_second(400_000).with_burst(4_000)).unwrap();
    let l = Arc::new(Leases::new(&p, Lease::new().max_block(512)));
    assert_eq!(l.longest_wait, 5 * MS);
    // 200 of a useful 400, a useful block back in 1 ms: 2 ms.
    assert_eq!(l.wait_until(S, S + MS, 200, 400), S + 2 * MS);
    // 50 of 400: 8 ms, at most 5 ms; nothing (a refusal): the same.
    assert_eq!(l.wait_until(S, S + MS, 50, 400), S + 5 * MS);
    assert_eq!(l.wait_until(S, S + MS, 0, 400), S + 5 * MS);
    // A useful block taken, or none to wait for: as Redis said.
    assert_eq!(l.wait_until(S, S + MS, 400, 400), S + MS);
    assert_eq!(l.wait_until(S, 0, 10, 400), 0);
    // A longer wait (the key in debt) stays as it is.
    assert_eq!(l.wait_until(S, S + 6 * MS, 100, 400), S + 6 * MS);
}

#[test]
fn a_refused_lease_call_waits_for_a_useful_block_and_says_so() {
    let p = Policy::single("p", Quota::per_second(400_000).with_burst(4_000)).unwrap();
    let l = Arc::new(Leases::new(&p, Lease::new().max_block(512)));
    let slot = l.slot(&Key::text("k")).unwrap();
    // Redis refused: the next unit in 2.5 µs, a useful block in 1 ms.
    let tiers: Tiers = smallvec![TierDecision::new(4_000, 0, 10 * MS, Some(2_500), true)];
    let refusal = Decision::new(Outcome::Limited, 0, Some(2_500), tiers);
    let d = l.refused(&slot, refusal.clone(), S, S + MS, 1, None, Paced::new());
    assert_eq!(d.retry_after(), Some(Duration::from_millis(1)));
    assert_eq!(d.tiers()[0].retry_after(), Some(Duration::from_millis(1)));
    let (d, granted) = l.spend(&slot, 1, Some(S + 400_000)).unwrap();
    assert_eq!((granted, d.retry_after()), (None, Some(Duration::from_nanos(600_000))));
    assert_eq!(d.tiers()[0].reset_after(), Duration::from_nanos(10 * MS - 400_000));
    assert!(l.spend(&slot, 1, Some(S + MS)).is_none());
    assert_eq!(l.stats().refused_locally, 1);
    // No wait beyond the refusal's own: the refusal as Redis made it.
    let other = l.slot(&Key::text("k2")).unwrap();
    assert_eq!(l.refused(&other, refusal.clone(), S, 0, 1, None, Paced::new()), refusal);
    assert!(l.spend(&other, 1, Some(S)).is_none());
}

/// Prefetching leases of GCRA at 400,000/s (burst 4,000; blocks of at most 512 lasting
/// 100 ms), and the slot of key `k`, whose next block asked for is `next` units.
fn prefetching(next: u64) -> (Arc<Leases>, Arc<Slot>) {
    let p = Policy::single("p", Quota::per_second(400_000).with_burst(4_000)).unwrap();
    let lease = Lease::new().max_block(512).lifetime(Duration::from_millis(100));
    let l = Arc::new(Leases::new(&p, lease.prefetch(true)));
    let slot = l.slot(&Key::text("k")).unwrap();
    slot.held.lock().unwrap().next = next;
    (l, slot)
}

/// What the block of `slot` holds: (left, granted, older, expired, next, fetching).
fn holding(slot: &Slot) -> (u64, u64, u64, u64, u64, bool) {
    let h = slot.held.lock().unwrap();
    (h.left, h.granted, h.older, h.expired, h.next, h.fetching)
}

#[test]
fn a_prefetch_is_due_when_half_the_block_is_spent_and_tops_it_up_to_the_largest() {
    let (l, slot) = prefetching(256);
    let b = l.begin(&slot, 1, Some(S));
    assert_eq!((b.block, b.useful), (256, 256));
    l.granted(&slot, 1, grant(4_000, 3_000, 10 * MS), block(256, 256, S, 0));
    // 255 held: due when 128 are left (half the block asked for), once.
    let due: Vec<bool> =
        (0..129).map(|_| l.take(&slot, 1, Some(S + MS)).unwrap().prefetch).collect();
    assert_eq!(due.iter().position(|d| *d), Some(126));
    assert_eq!(due.iter().filter(|d| **d).count(), 1, "one in flight at most");
    assert_eq!(holding(&slot), (126, 256, 0, 0, 256, true));
    // It asks for what tops the 126 held up to the largest block: 512 at most held.
    let (ahead, key) = l.ahead(&slot, Some(S + MS)).unwrap();
    assert_eq!((ahead.block, ahead.useful, key), (386, 386, Key::text("k")));
    // Two more spent while it is in flight; 386 granted at S + 2 ms.
    for _ in 0..2 {
        assert!(!l.take(&slot, 1, Some(S + 2 * MS)).unwrap().prefetch);
    }
    let grant = Grant { useful: 386, ..block(386, 386, S + 2 * MS, 0) };
    l.prefetched(&slot, grant_at(2_000, S + 2 * MS), grant);
    slot.held.lock().unwrap().fetching = false;
    assert_eq!(holding(&slot), (510, 642, 124, 0, 512, false));
    // The 124 held before are spent first, and end with their own lifetime (S + 100 ms):
    // 24 spent, then the other 100 are no longer spendable.
    for _ in 0..24 {
        assert!(!l.take(&slot, 1, Some(S + 50 * MS)).unwrap().prefetch);
    }
    assert_eq!(holding(&slot).2, 100);
    let t = l.take(&slot, 1, Some(S + 100 * MS)).unwrap();
    assert_eq!(t.granted, Some(S + 2 * MS));
    assert_eq!(holding(&slot), (385, 642, 0, 100, 512, false));
    // The new units last until S + 102 ms.
    assert!(l.take(&slot, 1, Some(S + 102 * MS)).is_none());
    // Given back together: what was not spent, the expired units included.
    let (_, rests) = l.ended(Some(S + 102 * MS), true);
    let r: Vec<_> = rests.iter().map(|(_, r)| (r.granted, r.spent)).collect();
    assert_eq!(r, [(642, 157)]);
    assert_eq!(l.stats().units_granted, 642);
}

#[test]
fn no_second_prefetch_while_units_of_an_earlier_block_are_held() {
    let (l, slot) = prefetching(256);
    let b = l.begin(&slot, 1, Some(S));
    l.granted(&slot, 1, grant(4_000, 3_000, 10 * MS), block(b.block, b.block, S, 0));
    let due = (0..129).filter(|_| l.take(&slot, 1, Some(S + MS)).unwrap().prefetch).count();
    assert_eq!(due, 1);
    // Redis grants 10 of the 386 asked for: 136 held, 126 of them from the first block,
    // which keep its lifetime (S + 100 ms).
    let grant = Grant { useful: 386, ..block(10, 10, S + 2 * MS, 0) };
    l.prefetched(&slot, grant_at(2_000, S + 2 * MS), grant);
    slot.held.lock().unwrap().fetching = false;
    assert_eq!(holding(&slot).2, 126);
    // Fewer than half of the next block are held, but a second prefetch would merge the
    // first one's units into the older ones' lifetime: none until those are spent.
    let due: Vec<bool> =
        (0..127).map(|_| l.take(&slot, 1, Some(S + 50 * MS)).unwrap().prefetch).collect();
    assert_eq!(due.iter().position(|d| *d), Some(125), "{:?}", holding(&slot));
}

/// Leasing the schedule, a refused prefetch: once the units held are spent, the checks
/// refused while this instance waits for a useful block to fit the horizon are told when
/// their own units conform (others took the schedule up to 80 ms), not when it asks Redis
/// again (40 ms).
#[test]
fn after_a_refused_prefetch_of_the_schedule_refusals_say_when_the_units_conform() {
    let p = Policy::single("p", Quota::per_second(100)).unwrap();
    let l = Arc::new(Leases::new(&p, Lease::new().max_block(64).schedule(true)));
    let slot = l.slot(&Key::text("k")).unwrap();
    let t = 10 * MS; // T
    let mut g = block(2, 2, S, 0);
    g.paced = smallvec![(S + t, t)];
    assert!(l.granted(&slot, 1, grant_at(0, S), g).is_allowed());
    let tiers: Tiers = smallvec![TierDecision::new(100, 0, 1_080 * MS, Some(80 * MS), true)];
    let refusal = Decision::new(Outcome::Limited, 0, Some(80 * MS), tiers);
    let waits = smallvec![(S + 70 * MS, t)];
    l.prefetch_refused(&slot, &refusal, S + MS, S + 40 * MS, 2, waits);
    let (d, _) = l.spend(&slot, 1, Some(S + t)).unwrap();
    assert!(d.is_allowed());
    let (d, _) = l.spend(&slot, 1, Some(S + 12 * MS)).unwrap();
    assert_eq!((d.outcome, d.retry_after), (Outcome::Limited, 68 * MS));
    let (d, _) = l.spend(&slot, 3, Some(S + 12 * MS)).unwrap();
    assert_eq!(d.retry_after, 88 * MS);
    // Redis said a useful block fits at 40 ms: the instance asks then.
    assert!(l.spend(&slot, 1, Some(S + 40 * MS)).is_none());
}

/// Leasing the schedule, a check of more units than are held, while this instance waits
/// for a useful block (until 80 ms): told when its units conform (the 2 held at 60 and 70
/// ms, 3 more at 80, 90 and 100 ms), not when the instance asks Redis again.
#[test]
fn a_check_of_more_than_the_units_held_of_the_schedule_is_told_when_they_conform() {
    let p = Policy::single("p", Quota::per_second(100)).unwrap();
    let l = Arc::new(Leases::new(&p, Lease::new().max_block(64).schedule(true)));
    let slot = l.slot(&Key::text("k")).unwrap();
    let t = 10 * MS; // T
    // 8 units at 0, 10, ... 70 ms.
    let mut g = block(8, 8, S, S + 80 * MS);
    g.paced = smallvec![(S + 7 * t, t)];
    assert!(l.granted(&slot, 1, grant_at(0, S), g).is_allowed());
    for _ in 0..5 {
        assert!(l.spend(&slot, 1, Some(S + 5 * t)).unwrap().0.is_allowed());
    }
    let (d, _) = l.spend(&slot, 5, Some(S + 5 * t)).unwrap();
    assert_eq!((d.outcome, d.retry_after), (Outcome::Limited, 50 * MS));
    // 2 units are held, conforming in 10 and 20 ms: a check of 2 waits for them alone.
    let (d, _) = l.spend(&slot, 2, Some(S + 5 * t)).unwrap();
    assert_eq!((d.outcome, d.retry_after), (Outcome::Limited, 20 * MS));
}

#[test]
fn while_waiting_a_prefetch_starts_half_a_round_trip_before_a_useful_block_is_back() {
    let (l, slot) = prefetching(512);
    l.begin(&slot, 1, Some(S));
    // 400 granted, a useful block back at S + 1 ms.
    l.granted(&slot, 1, grant(4_000, 0, 10 * MS), block(400, 400, S, S + MS));
    for _ in 0..399 {
        assert!(!l.take(&slot, 1, Some(S + 100_000)).unwrap().prefetch);
    }
    // Lease calls take 600 µs: the prefetch starts half of that, 300 µs, before the wait
    // ends (Redis decides it about then).
    l.observe(None, Some(S), Some(S + 600_000));
    assert_eq!(l.round_trip.load(Ordering::Relaxed), 600_000);
    let t = l.take(&slot, 1, Some(S + 699_999)).unwrap();
    assert_eq!((t.decision.outcome, t.prefetch), (Outcome::Limited, false));
    let t = l.take(&slot, 1, Some(S + 700_000)).unwrap();
    assert_eq!((t.decision.outcome, t.prefetch), (Outcome::Limited, true));
    assert_eq!(t.decision.retry_after, 300_000);
    let (ahead, _) = l.ahead(&slot, Some(S + 700_000)).unwrap();
    assert_eq!((ahead.block, ahead.useful), (512, 512));
    // Redis refused it (others took what built up): refused until its share is back,
    // half the burst's refill at most, and still no call before.
    let tiers: Tiers = smallvec![TierDecision::new(4_000, 0, 10 * MS, Some(2_500), true)];
    let refusal = Decision::new(Outcome::Limited, 0, Some(2_500), tiers);
    l.prefetch_refused(&slot, &refusal, S + 850_000, S + 1_850_000, 512, Paced::new());
    slot.held.lock().unwrap().fetching = false;
    let t = l.take(&slot, 1, Some(S + MS)).unwrap();
    assert_eq!((t.decision.outcome, t.decision.retry_after), (Outcome::Limited, 4_850_000));
    // Half a round trip before that, the next prefetch.
    assert!(l.take(&slot, 1, Some(S + 5_550_000)).unwrap().prefetch);
    // Moving average of the round trips.
    l.observe(None, Some(S), Some(S + 1_000_000));
    assert_eq!(l.round_trip.load(Ordering::Relaxed), 700_000);
}

#[test]
fn no_prefetch_for_keys_whose_blocks_are_small_windows_or_without_asking() {
    let gcra = Policy::single("p", Quota::per_second(400_000).with_burst(4_000)).unwrap();
    let window = Policy::builder("w")
        .algorithm(Algorithm::FixedWindow)
        .tier("second", Quota::per_second(400_000))
        .build()
        .unwrap();
    let on = Lease::new().max_block(512).prefetch(true);
    for (p, lease, next, due) in [
        (&gcra, on, 1, false),
        (&gcra, on, 8, false),
        (&gcra, on, 16, true),
        (&gcra, Lease::new().max_block(2).prefetch(true), 2, true),
        (&gcra, on.prefetch(false), 512, false),
        (&window, on, 512, false),
    ] {
        let l = Arc::new(Leases::new(p, lease));
        let slot = l.slot(&Key::text("k")).unwrap();
        slot.held.lock().unwrap().next = next;
        let b = l.begin(&slot, 1, Some(S));
        l.granted(&slot, 1, grant(4_000, 3_000, 10 * MS), block(b.block, b.block, S, 0));
        let mut any = false;
        while let Some(t) = l.take(&slot, 1, Some(S)) {
            any |= t.prefetch;
        }
        assert_eq!(any, due, "{lease:?}, blocks of {next}");
    }
    assert!(on.prefetches() && !Lease::new().prefetches());
}

#[test]
fn a_fixed_window_block_ends_with_its_window() {
    let p = Policy::builder("w")
        .algorithm(Algorithm::FixedWindow)
        .tier("second", Quota::per_second(10))
        .tier("minute", Quota::per_minute(100))
        .build()
        .unwrap();
    let l = Arc::new(Leases::new(&p, Lease::new().max_block(8).lifetime(Duration::from_secs(10))));
    let slot = l.slot(&Key::text("k")).unwrap();
    let at = 61 * S + 900 * MS;
    l.granted(&slot, 1, grant(10, 2, 100 * MS), block(8, 8, at, 0));
    assert!(l.spend(&slot, 1, Some(62 * S - 1)).is_some());
    assert!(l.spend(&slot, 1, Some(62 * S)).is_none(), "the second's window ended");
    // The sweeper's part: the rest of an ended block, taken out once.
    let (ended, _) = l.ended(Some(62 * S), false);
    assert_eq!(ended.len(), 1);
    let (_, rests) = l.ended(Some(62 * S), true);
    assert_eq!(rests.iter().map(|(_, r)| (r.granted, r.spent)).collect::<Vec<_>>(), [(8, 2)]);
    assert!(l.ended(Some(62 * S), true).1.is_empty());
}

#[test]
fn policies_lease_only_where_the_bound_is_stated() {
    let base = || Policy::builder("p").tier("s", Quota::per_second(10));
    for alg in
        [Algorithm::Gcra, Algorithm::TokenBucket, Algorithm::LeakyBucket, Algorithm::FixedWindow]
    {
        assert_eq!(unleasable(&base().algorithm(alg).build().unwrap()), None);
    }
    let exact = [
        base().algorithm(Algorithm::SlidingCounter).build().unwrap(),
        base().algorithm(Algorithm::SlidingLog).build().unwrap(),
        base().concurrency("c", Concurrency::new(2)).build().unwrap(),
        base().tier("b", Quota::per_second(1_000).counting(Unit::RequestBytes)).build().unwrap(),
        base().penalty("s", Penalty::new(Duration::from_secs(60))).build().unwrap(),
    ];
    for p in &exact {
        assert!(unleasable(p).is_some(), "{p:?}");
    }
    assert_eq!(unleasable(&exact[3]).unwrap().0, "b");
    let daily = base().algorithm(Algorithm::FixedWindow).calendar("d", Calendar::per_day(100));
    assert_eq!(unleasable(&daily.build().unwrap()), None);
    assert!(Lease::new().max_block(0).validate().is_err());
    assert!(Lease::new().lifetime(Duration::from_micros(999)).validate().is_err());
    assert_eq!(Lease::new().bound(4), 256);
}

#[test]
fn a_full_map_drops_idle_slots_that_hold_nothing() {
    let p = Policy::single("p", Quota::per_second(100)).unwrap();
    let l = Arc::new(Leases::new(&p, Lease::new()));
    for i in 0..10_000 {
        let key = Key::text(format!("k{i}"));
        let slot = l.slot(&key).unwrap();
        // Blocks of one unit, spent at once: nothing to give back.
        l.granted(&slot, 1, grant(100, 99, 0), block(1, 1, 0, 0));
    }
    assert!(l.len() <= CAPACITY + SHARDS, "{}", l.len());
    // A slot holding units is kept: when every slot of a shard holds some, keys past it
    // are checked exactly.
    let l = Arc::new(Leases::new(&p, Lease::new()));
    let mut held = Vec::new();
    let mut refused = 0;
    for i in 0..10_000 {
        let key = Key::text(format!("k{i}"));
        match l.slot(&key) {
            Some(slot) => {
                l.granted(&slot, 1, grant(100, 96, 0), block(4, 4, 0, 0));
                held.push(slot);
            }
            None => refused += 1,
        }
    }
    assert_eq!(held.len() + refused, 10_000);
    assert!(held.len() <= CAPACITY + SHARDS && refused > 0);
}
