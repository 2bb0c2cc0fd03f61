//! Sliding window log: one weighted entry per admitted request.
//!
//! An entry admitted at `ts` counts against every window `(t - period, t]` with
//! `ts > t - period`. Only admitted requests are recorded (recording rejected ones too would let
//! a client that keeps retrying extend its own ban), each entry carries a unique id (two
//! requests in one nanosecond stay two entries), and a cost above 1 is one entry with that
//! weight.

use std::collections::VecDeque;

use crate::quota::Rate;

/// One admitted request (or shaped reservation): instant, weight, unique id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) ts: u64,
    pub(crate) weight: u64,
    pub(crate) id: u64,
}

/// Entries ascending by `ts`, and the next id to hand out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Log {
    pub(crate) entries: VecDeque<Entry>,
    pub(crate) next_id: u64,
}

fn live(r: Rate, e: &Entry, t: u64) -> bool {
    e.ts.saturating_add(r.period) > t
}

pub(crate) fn prune(log: &mut Log, r: Rate, now: u64) {
    while log.entries.front().is_some_and(|e| !live(r, e, now)) {
        log.entries.pop_front();
    }
}

fn weight_at(log: &Log, r: Rate, t: u64) -> u64 {
    log.entries.iter().filter(|e| live(r, e, t)).map(|e| e.weight).sum()
}

/// Earliest instant >= `from` at which `cost` more fits (`cost <= count`).
pub(crate) fn earliest(log: &Log, r: Rate, from: u64, cost: u64) -> u64 {
    let mut total = weight_at(log, r, from);
    let mut t = from;
    let mut entries = log.entries.iter().filter(|e| live(r, e, from)).peekable();
    while total.saturating_add(cost) > r.count {
        let Some(e) = entries.next() else { break };
        total -= e.weight;
        t = e.ts.saturating_add(r.period);
        // Entries of the same instant leave the window together.
        while let Some(n) = entries.next_if(|n| n.ts == e.ts) {
            total -= n.weight;
        }
    }
    t
}

/// Records `cost` at `at`; returns the entry's id.
pub(crate) fn charge(log: &mut Log, at: u64, cost: u64) -> u64 {
    let id = log.next_id;
    log.next_id = log.next_id.wrapping_add(1);
    let pos = log.entries.partition_point(|e| e.ts <= at);
    log.entries.insert(pos, Entry { ts: at, weight: cost, id });
    id
}

/// Takes `cost` off the entry `id` recorded at `at` with weight `charged` (removing it when
/// nothing is left). All must match: ids restart when a key's state is dropped, so a stale
/// ticket's id alone could name an entry of the key's next life; its instant, always earlier
/// than any of those, cannot. (The weight is part of the entry's name on Redis; an entry whose
/// ticket was since settled higher, the extra being an entry of its own, is not refunded.)
pub(crate) fn refund(log: &mut Log, id: u64, at: u64, charged: u64, cost: u64) {
    let named = |e: &Entry| e.id == id && e.ts == at && e.weight == charged;
    if let Some(p) = log.entries.iter().position(named) {
        let e = &mut log.entries[p];
        e.weight = e.weight.saturating_sub(cost);
        if e.weight == 0 {
            log.entries.remove(p);
        }
    }
}

pub(crate) fn status(log: &Log, r: Rate, now: u64) -> (u64, u64) {
    let remaining = r.count.saturating_sub(weight_at(log, r, now));
    let reset = log.entries.back().map_or(0, |e| e.ts.saturating_add(r.period).saturating_sub(now));
    (remaining, reset)
}
