//! What the pacing layer believes of one quota of a server: the units left, its reset, the
//! refill rate it learned, and the reports read while requests are in flight.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use super::state::*;
use super::*;
use crate::hints::Reported;

/// Where the learning of a quota's refill rate starts: a response read with no other request
/// in flight and none answered while it was, so that every request answered after it was
/// decided after it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Anchor {
    /// When its request was sent (before the server decided it).
    pub(super) at: Instant,
    /// The units it reported left (`r`).
    pub(super) remaining: u64,
    /// The quota's count of admitted responses read, this one included.
    pub(super) admitted: u64,
}

/// What a quota knew when a request was sent.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sent {
    /// How many of its reports had been read.
    pub(super) reads: u64,
    /// How many admitted responses reporting it had been read.
    pub(super) admitted: u64,
}

/// One report read, kept while a request sent before it is in flight.
#[derive(Debug, Clone, Copy)]
pub(super) struct Read {
    /// Its place among the quota's reads (from 1).
    pub(super) index: u64,
    /// The units it reported left (`r`).
    pub(super) remaining: u64,
    /// When it said the quota is full again.
    pub(super) reset_at: Option<Instant>,
}

/// One quota of a partition, as last reported and counted down locally since.
#[derive(Debug, Clone)]
pub(super) struct PartitionQuota {
    /// The quota policy's name (`None`: the legacy `X-RateLimit-*` fields).
    pub(super) name: Option<Box<str>>,
    /// Units per window, when reported: what is left once the quota is full again, and the
    /// most the learned refill can bring back.
    pub(super) limit: Option<u64>,
    /// Units believed left at `as_of`, less the requests reserved since; below zero when more
    /// are in flight than the server had left.
    pub(super) remaining: i64,
    /// The instant `remaining` refers to: a learned refill adds one unit per `interval` after it.
    pub(super) as_of: Instant,
    /// When the quota is full again; `None` after the layer refilled it and before a response
    /// said when.
    pub(super) reset_at: Option<Instant>,
    /// The last request sent before the layer refilled the quota at its reset: responses to
    /// it and to earlier requests describe the window before and do not set the count.
    pub(super) refilled_after: u64,
    /// Reports read so far.
    pub(super) reads: u64,
    /// Admitted responses reporting this quota read so far.
    pub(super) admitted: u64,
    /// What the quota knew when each request in flight was sent, by sequence number.
    pub(super) sent: BTreeMap<u64, Sent>,
    /// The reports read since the oldest request in flight was sent.
    pub(super) recent: VecDeque<Read>,
    /// The learned refill: at most this long per unit (the server refills at least
    /// `1 / interval` units per second).
    pub(super) interval: Option<Duration>,
    /// Where the learning starts; `None` until a response read alone.
    pub(super) anchor: Option<Anchor>,
    /// Whether the rate may be learned: false once the server refused a request the learned
    /// rate let through (it does not refill continuously, or others spend the same quota).
    pub(super) learns: bool,
}

impl PartitionQuota {
    pub(super) fn new(name: Option<Box<str>>) -> Self {
        Self {
            name,
            limit: None,
            remaining: 0,
            as_of: Instant::now(),
            reset_at: None,
            refilled_after: 0,
            reads: 0,
            admitted: 0,
            sent: BTreeMap::new(),
            recent: VecDeque::new(),
            interval: None,
            anchor: None,
            learns: true,
        }
    }

    /// The learned refill interval, when it may be used (a known limit caps it).
    pub(super) fn refill(&self) -> Option<(Duration, u64)> {
        Some((self.interval?, self.limit?))
    }

    /// Brings `remaining` up to `now`: full again at the reset (less what is in flight), or
    /// one unit per learned interval up to the limit (less what is in flight). `false` when
    /// the quota is full again but its limit is unknown: it should be forgotten.
    pub(super) fn settle(&mut self, now: Instant, in_flight: u64, last_seq: u64) -> bool {
        if self.reset_at.is_some_and(|at| now >= at) {
            let Some(limit) = self.limit else { return false };
            // Requests in flight may be decided after the reset: counted against the new
            // window. Their responses, older than this refill, no longer set the count.
            self.remaining = units(limit).saturating_sub(units(in_flight));
            self.as_of = now;
            self.reset_at = None;
            self.refilled_after = last_seq;
            return true;
        }
        if let Some((interval, limit)) = self.refill() {
            // The server holds at most `limit`, and the requests in flight may not be decided
            // yet: the count, which has them taken off, refills up to `limit` less them.
            let limit = units(limit).saturating_sub(units(in_flight));
            if self.remaining >= limit {
                self.as_of = now;
            } else {
                let per = interval.as_nanos().max(1);
                let gained = now.saturating_duration_since(self.as_of).as_nanos() / per;
                let gained = i64::try_from(gained).unwrap_or(i64::MAX);
                match self.remaining.saturating_add(gained) {
                    full if full >= limit => {
                        self.remaining = limit;
                        self.as_of = now;
                    }
                    left => {
                        self.remaining = left;
                        // `gained` intervals fit in the time elapsed, so this is before `now`.
                        self.as_of += Duration::from_nanos(
                            u64::try_from(per.saturating_mul(gained.unsigned_abs().into()))
                                .unwrap_or(u64::MAX),
                        );
                    }
                }
            }
        }
        true
    }

    /// When this quota, with fewer than `needed` units left, has them: its reset, or the
    /// learned refill's next units (whichever is sooner); `None` when neither is known.
    pub(super) fn next_unit(&self, needed: i64) -> Option<Instant> {
        let refill = self.refill().map(|(interval, _)| {
            let owed = u32::try_from(needed.saturating_sub(self.remaining)).unwrap_or(u32::MAX);
            after(self.as_of, interval.saturating_mul(owed))
        });
        match (self.reset_at, refill) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Takes one unit for request `seq`, sent now.
    pub(super) fn reserve(&mut self, seq: u64) {
        self.remaining -= 1;
        self.sent.insert(seq, Sent { reads: self.reads, admitted: self.admitted });
    }

    /// Forgets request `seq`, ended without a report of this quota.
    pub(super) fn end(&mut self, seq: u64) {
        self.sent.remove(&seq);
        self.prune();
    }

    /// Drops the reads no request in flight needs, and merges the oldest two while more than
    /// [`MAX_RECENT`] are kept (a request in flight that long then compares with the lower
    /// of them, and the later reset: less exact, never more).
    pub(super) fn prune(&mut self) {
        let oldest = self.sent.values().map(|s| s.reads).min().unwrap_or(self.reads);
        while self.recent.front().is_some_and(|r| r.index <= oldest) {
            self.recent.pop_front();
        }
        while self.recent.len() > MAX_RECENT {
            let (Some(a), Some(b)) = (self.recent.pop_front(), self.recent.pop_front()) else {
                break;
            };
            self.recent.push_front(Read {
                index: b.index,
                remaining: a.remaining.min(b.remaining),
                reset_at: later_of(a.reset_at, b.reset_at),
            });
        }
    }

    /// Takes in one report of this quota, from a response read at `now`.
    ///
    /// On separate connections requests overtake one another, on the way to the server and
    /// back, so the count is taken from the response the server decided last among this one
    /// and those read while it was in flight. Whichever that was, every request decided after
    /// it is still in flight: the requests answered before this one was sent were decided
    /// before it, and the ones answered while it was in flight are among those compared.
    /// Since that response the server lost at most one unit per request in flight, and its
    /// `r` is the least of theirs or above it (a refill can only raise a later `r`): the
    /// least `r` of them, less every request in flight, is never more than the server has.
    pub(super) fn read(&mut self, now: Instant, r: Reported, answer: Answer) {
        let Answer { seq, sent_at, in_flight, admitted } = answer;
        if r.limit.is_some() {
            self.limit = r.limit;
        }
        let sent = self.sent.remove(&seq);
        self.reads += 1;
        let reset_at = r.reset.map(|t| after(now, t));
        let (mut least, mut reset) = (r.remaining, reset_at);
        // A quota first reported now: no other response reported it.
        let since = sent.map_or(0, |s| s.reads);
        for read in self.recent.iter().filter(|read| read.index > since) {
            least = least.min(read.remaining);
            reset = later_of(reset, read.reset_at);
        }
        let overlapped = since + 1 < self.reads;
        if admitted {
            self.admitted += 1;
            if self.learns {
                let anchor_at = sent_at.filter(|_| !overlapped && in_flight == 0);
                self.learn(now, r.remaining, sent, anchor_at);
            }
        }
        self.recent.push_back(Read { index: self.reads, remaining: r.remaining, reset_at });
        self.prune();
        if seq <= self.refilled_after {
            return;
        }
        self.remaining = units(least).saturating_sub(units(in_flight));
        self.as_of = now;
        self.reset_at = reset;
    }

    /// Learns a lower bound of the refill rate from the anchor to this response: the server
    /// had `L_a` units at the anchor (`r_a <= L_a < r_a + 1`), spent at least `n` since (the
    /// admitted requests answered before this one was sent, and this one), and has
    /// `L_b >= r_b` now, so it refilled more than `r_b + n - r_a - 1` units in the time
    /// between (fewer if it was full meanwhile, or spent more than `n`: still a lower bound).
    ///
    /// The span runs from when the anchor's request was sent to when this response arrived:
    /// it holds the time between the two decisions whatever the latencies, so the bound never
    /// exceeds the true rate.
    pub(super) fn learn(
        &mut self,
        now: Instant,
        remaining: u64,
        sent: Option<Sent>,
        anchor_at: Option<Instant>,
    ) {
        let Some(anchor) = self.anchor else {
            if let Some(at) = anchor_at {
                self.anchor = Some(Anchor { at, remaining, admitted: self.admitted });
            }
            return;
        };
        // Sent before the anchor was read: not known to be decided after it.
        let Some(sent) = sent.filter(|s| s.admitted >= anchor.admitted) else { return };
        let span = now.saturating_duration_since(anchor.at);
        if span < MIN_LEARNING_SPAN {
            return;
        }
        let spent = sent.admitted - anchor.admitted + 1;
        let refilled = u128::from(remaining) + u128::from(spent);
        let refilled = refilled.saturating_sub(u128::from(anchor.remaining) + 1);
        if refilled == 0 {
            return;
        }
        let nanos = span.as_nanos().div_ceil(refilled);
        let interval = Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX));
        if self.interval.is_none_or(|i| interval < i) {
            self.interval = Some(interval);
        }
    }
}

/// A response, as the partition saw it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Answer {
    /// Its request's sequence number.
    pub(super) seq: u64,
    /// When its request was sent; `None` when it was not in flight.
    pub(super) sent_at: Option<Instant>,
    /// The other requests still in flight.
    pub(super) in_flight: u64,
    /// Not refused: its request spent a unit.
    pub(super) admitted: bool,
}

/// The later of two resets, or the one that is known.
pub(super) fn later_of(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// A count of units as a signed number, saturating.
pub(super) fn units(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}
