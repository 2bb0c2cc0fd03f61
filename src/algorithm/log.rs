//! Sliding window log: one weighted entry per admitted request.
//!
//! An entry admitted at `ts` counts against every window `(t - period, t]` with
//! `ts > t - period`. Only admitted requests are recorded (recording rejected ones too would let
//! a client that keeps retrying extend its own ban), each entry carries a unique id (two
//! requests in one nanosecond stay two entries), and a cost above 1 is one entry with that
//! weight.
//!
//! Entries are kept ascending by instant, each with the running total of the weights up to it,
//! so the weight of any suffix of the log is one subtraction and the entries that must expire
//! for a request to fit are found by binary search: a check (admitted or not) costs
//! O(log n) for n entries, plus the entries it prunes. Only a charge behind a later entry (a
//! shaped reservation, or an extra charge at a ticket's instant) or a refund also shifts the
//! totals of the entries after it.

use std::collections::VecDeque;

use crate::algorithm::compiled::Rate;

/// One admitted request (or shaped reservation): instant, running total, unique id.
#[derive(Debug, Clone, Copy)]
struct Entry {
    ts: u64,
    /// `Log::base` plus the weights of every entry up to and including this one, wrapping (only
    /// differences are read, and a live log weighs far less than 2^64).
    total: u64,
    id: u64,
}

/// Entries ascending by `ts` (in order of recording within one instant), and the next id to
/// hand out.
#[derive(Debug, Clone, Default)]
pub(crate) struct Log {
    entries: VecDeque<Entry>,
    /// The running total before the first entry: what the pruned entries weighed, wrapping.
    base: u64,
    next_id: u64,
}

/// Logs are equal when they hold the same entries (instant, weight, id) and hand out the same
/// next id, whatever they weighed before.
impl PartialEq for Log {
    fn eq(&self, other: &Self) -> bool {
        self.next_id == other.next_id
            && self.entries.len() == other.entries.len()
            && (0..self.entries.len()).all(|i| {
                let (a, b) = (&self.entries[i], &other.entries[i]);
                a.ts == b.ts && a.id == b.id && self.weight(i) == other.weight(i)
            })
    }
}

impl Eq for Log {}

impl Log {
    /// Whether the log holds no entry.
    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The running total before entry `i`.
    fn total_before(&self, i: usize) -> u64 {
        match i.checked_sub(1) {
            Some(j) => self.entries[j].total,
            None => self.base,
        }
    }

    /// The weight of entry `i`.
    fn weight(&self, i: usize) -> u64 {
        self.entries[i].total.wrapping_sub(self.total_before(i))
    }

    /// The weight of the entries from `i` on.
    fn weight_from(&self, i: usize) -> u64 {
        self.total_before(self.entries.len()).wrapping_sub(self.total_before(i))
    }

    /// The index of the first entry still live at `t`.
    fn first_live(&self, r: Rate, t: u64) -> usize {
        self.entries.partition_point(|e| !live(r, e, t))
    }

    /// Adds `delta` to the running totals of the entries from `i` on (wrapping: a negative
    /// `delta` as its two's complement).
    fn shift(&mut self, i: usize, delta: u64) {
        for e in self.entries.range_mut(i..) {
            e.total = e.total.wrapping_add(delta);
        }
    }
}

fn live(r: Rate, e: &Entry, t: u64) -> bool {
    e.ts.saturating_add(r.period) > t
}

pub(crate) fn prune(log: &mut Log, r: Rate, now: u64) {
    let gone = log.first_live(r, now);
    if gone > 0 {
        log.base = log.entries[gone - 1].total;
        log.entries.drain(..gone);
    }
}

fn weight_at(log: &Log, r: Rate, t: u64) -> u64 {
    log.weight_from(log.first_live(r, t))
}

/// Earliest instant >= `from` at which `cost` more fits (`cost <= count`): the oldest entries
/// live at `from` leave (those of one instant together) until the rest has room.
pub(crate) fn earliest(log: &Log, r: Rate, from: u64, cost: u64) -> u64 {
    let first = log.first_live(r, from);
    let fits = |i: usize| log.weight_from(i).saturating_add(cost) <= r.count;
    if first == log.entries.len() || fits(first) {
        return from;
    }
    // The fewest leading entries whose leaving makes room: the weight from `i` on only falls
    // as `i` grows. The last of them sets the instant; any entry of the same instant after it
    // leaves together with it, which can only free more.
    let (mut lo, mut hi) = (first + 1, log.entries.len());
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) { hi = mid } else { lo = mid + 1 }
    }
    log.entries[lo - 1].ts.saturating_add(r.period)
}

/// Records `cost` at `at`; returns the entry's id.
pub(crate) fn charge(log: &mut Log, at: u64, cost: u64) -> u64 {
    let id = log.next_id;
    log.next_id = log.next_id.wrapping_add(1);
    let pos = log.entries.partition_point(|e| e.ts <= at);
    let total = log.total_before(pos).wrapping_add(cost);
    log.entries.insert(pos, Entry { ts: at, total, id });
    log.shift(pos + 1, cost);
    id
}

/// Takes `cost` off the entry `id` recorded at `at` with weight `charged` (removing it when
/// nothing is left). All must match: ids restart when a key's state is dropped, so a stale
/// ticket's id alone could name an entry of the key's next life; its instant, always earlier
/// than any of those, cannot. (The weight is part of the entry's name on Redis; an entry whose
/// ticket was since settled higher, the extra being an entry of its own, is not refunded.)
pub(crate) fn refund(log: &mut Log, id: u64, at: u64, charged: u64, cost: u64) {
    let from = log.entries.partition_point(|e| e.ts < at);
    let to = log.entries.partition_point(|e| e.ts <= at);
    let Some(p) = (from..to).find(|&i| log.entries[i].id == id && log.weight(i) == charged) else {
        return;
    };
    let taken = charged.min(cost);
    log.shift(p, taken.wrapping_neg());
    if taken == charged {
        log.entries.remove(p);
    }
}

pub(crate) fn status(log: &Log, r: Rate, now: u64) -> (u64, u64) {
    let remaining = r.count.saturating_sub(weight_at(log, r, now));
    let reset = log.entries.back().map_or(0, |e| e.ts.saturating_add(r.period).saturating_sub(now));
    (remaining, reset)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The log as it was first written: a plain list scanned whole on every check. The
    /// reference the running totals must decide exactly like.
    mod naive {
        use super::Rate;

        #[derive(Debug, Clone, Default)]
        pub(super) struct Log {
            /// `(ts, weight, id)`, ascending by `ts`.
            pub(super) entries: Vec<(u64, u64, u64)>,
            next_id: u64,
        }

        fn live(r: Rate, ts: u64, t: u64) -> bool {
            ts.saturating_add(r.period) > t
        }

        pub(super) fn prune(log: &mut Log, r: Rate, now: u64) {
            log.entries.retain(|e| live(r, e.0, now));
        }

        fn weight_at(log: &Log, r: Rate, t: u64) -> u64 {
            log.entries.iter().filter(|e| live(r, e.0, t)).map(|e| e.1).sum()
        }

        pub(super) fn earliest(log: &Log, r: Rate, from: u64, cost: u64) -> u64 {
            let mut total = weight_at(log, r, from);
            let mut t = from;
            let mut entries = log.entries.iter().filter(|e| live(r, e.0, from)).peekable();
            while total.saturating_add(cost) > r.count {
                let Some(e) = entries.next() else { break };
                total -= e.1;
                t = e.0.saturating_add(r.period);
                while let Some(n) = entries.next_if(|n| n.0 == e.0) {
                    total -= n.1;
                }
            }
            t
        }

        pub(super) fn charge(log: &mut Log, at: u64, cost: u64) -> u64 {
            let id = log.next_id;
            log.next_id += 1;
            let pos = log.entries.partition_point(|e| e.0 <= at);
            log.entries.insert(pos, (at, cost, id));
            id
        }

        pub(super) fn refund(log: &mut Log, id: u64, at: u64, charged: u64, cost: u64) {
            if let Some(p) = log.entries.iter().position(|e| *e == (at, charged, id)) {
                log.entries[p].1 = charged.saturating_sub(cost);
                if log.entries[p].1 == 0 {
                    log.entries.remove(p);
                }
            }
        }

        pub(super) fn status(log: &Log, r: Rate, now: u64) -> (u64, u64) {
            let remaining = r.count.saturating_sub(weight_at(log, r, now));
            let reset = log.entries.last().map_or(0, |e| e.0.saturating_add(r.period) - now);
            (remaining, reset)
        }
    }

    fn listed(log: &Log) -> Vec<(u64, u64, u64)> {
        (0..log.entries.len())
            .map(|i| (log.entries[i].ts, log.weight(i), log.entries[i].id))
            .collect()
    }

    #[derive(Debug, Clone)]
    enum Op {
        /// Moves time on and prunes.
        Advance(u64),
        /// Asks the earliest instant `ahead` ns from now on for `cost` (a fraction of the count).
        Earliest { ahead: u64, cost: u64 },
        /// Records `cost` `ahead` ns from now (a shaped reservation when ahead > 0, possibly
        /// behind a later one).
        Charge { ahead: u64, cost: u64 },
        /// Refunds `cost` of the `which`-th recorded charge (modulo their number).
        Refund { which: usize, cost: u64 },
    }

    fn op(period: u64, count: u64) -> impl Strategy<Value = Op> {
        prop_oneof![
            2 => prop_oneof![0..=period / 4, 0..=2 * period].prop_map(Op::Advance),
            3 => (0..=2 * period, 1..=count).prop_map(|(ahead, cost)| Op::Earliest { ahead, cost }),
            4 => (prop_oneof![Just(0), 0..=period], 1..=count)
                .prop_map(|(ahead, cost)| Op::Charge { ahead, cost }),
            1 => (0usize..64, 0..=count).prop_map(|(which, cost)| Op::Refund { which, cost }),
        ]
    }

    fn trace() -> impl Strategy<Value = (u64, u64, Vec<Op>)> {
        (prop_oneof![1u64..=12, 1u64..=10_000], 1u64..=5_000).prop_flat_map(|(count, period)| {
            (Just(count), Just(period), proptest::collection::vec(op(period, count), 1..200))
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

        /// Running totals and binary search decide exactly like a scan of the whole log, with
        /// weighted entries, reservations behind later ones, entries sharing an instant, and
        /// partial and whole refunds.
        #[test]
        fn the_running_totals_decide_like_a_scan_of_the_log((count, period, ops) in trace()) {
            let r = Rate { count, period, burst: count };
            let (mut log, mut reference) = (Log::default(), naive::Log::default());
            let mut charged: Vec<(u64, u64, u64)> = Vec::new();
            let mut now = 0u64;
            for op in ops {
                match op {
                    Op::Advance(by) => {
                        now += by;
                        prune(&mut log, r, now);
                        naive::prune(&mut reference, r, now);
                    }
                    Op::Earliest { ahead, cost } => prop_assert_eq!(
                        earliest(&log, r, now + ahead, cost),
                        naive::earliest(&reference, r, now + ahead, cost),
                        "earliest {} ns ahead for {}", ahead, cost
                    ),
                    Op::Charge { ahead, cost } => {
                        let id = charge(&mut log, now + ahead, cost);
                        prop_assert_eq!(id, naive::charge(&mut reference, now + ahead, cost));
                        charged.push((id, now + ahead, cost));
                    }
                    Op::Refund { which, cost } => {
                        if charged.is_empty() {
                            continue;
                        }
                        let (id, at, was) = charged.remove(which % charged.len());
                        refund(&mut log, id, at, was, cost);
                        naive::refund(&mut reference, id, at, was, cost);
                    }
                }
                prop_assert_eq!(listed(&log), reference.entries.clone());
                prop_assert_eq!(status(&log, r, now), naive::status(&reference, r, now));
            }
        }
    }

    #[test]
    fn a_check_finds_the_entries_to_expire_by_binary_search() {
        let r = Rate { count: 10, period: 100, burst: 10 };
        let mut log = Log::default();
        for (at, cost) in [(0, 2), (10, 3), (10, 1), (20, 4)] {
            charge(&mut log, at, cost);
        }
        // Full at 50: 1 more needs the first entry gone (at 100), 3 more the first two
        // instants (the entries at 10 leave together, at 110), 7 more all of them (at 120).
        assert_eq!(earliest(&log, r, 50, 1), 100);
        assert_eq!(earliest(&log, r, 50, 3), 110);
        assert_eq!(earliest(&log, r, 50, 6), 110);
        assert_eq!(earliest(&log, r, 50, 7), 120);
        assert_eq!(earliest(&log, r, 105, 1), 105);
        assert_eq!(status(&log, r, 50), (0, 70));
        prune(&mut log, r, 110);
        assert_eq!(listed(&log), [(20, 4, 3)]);
        assert_eq!(status(&log, r, 110), (6, 10));
        // A refund in the middle moves the totals after it: 2 of the 5 at 30.
        charge(&mut log, 40, 1);
        let id = charge(&mut log, 30, 5);
        refund(&mut log, id, 30, 5, 2);
        assert_eq!(listed(&log), [(20, 4, 3), (30, 3, 5), (40, 1, 4)]);
        assert_eq!(status(&log, r, 110), (2, 30));
    }
}
