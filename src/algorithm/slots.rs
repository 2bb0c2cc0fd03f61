//! Concurrency tiers: slots held per key, and the typical hold each tier reports as its
//! `Retry-After`.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::algorithm::compiled::Kind;
use crate::decision::{Decision, NONE, Outcome};
use crate::policy::Policy;

/// No hold observed yet.
const UNSEEN: u64 = u64::MAX;

/// The shortest typical hold reported: 1 ms.
const MIN_HOLD: u64 = 1_000_000;

/// The typical hold of each concurrency tier of a bound policy: an exponentially weighted
/// average (weight 1/8) of the holds observed at release, in nanoseconds. Kept by the binding,
/// so each process learns from the slots it released; until its first release a tier reports
/// its configured [`typical_hold`](crate::Concurrency::typical_hold).
#[derive(Debug)]
pub(crate) struct Holds {
    /// Per tier (non-concurrency tiers unused): the average, or [`UNSEEN`].
    average: Box<[AtomicU64]>,
    /// Per tier: the configured typical hold.
    initial: Box<[u64]>,
}

impl Holds {
    pub(crate) fn new(policy: &Policy) -> Self {
        let initial: Box<[u64]> = policy
            .tiers()
            .iter()
            .map(|t| match &t.kind {
                Kind::Concurrency(s) => s.initial_hold,
                _ => 0,
            })
            .collect();
        let average = initial.iter().map(|_| AtomicU64::new(UNSEEN)).collect();
        Self { average, initial }
    }

    /// Tier `i`'s typical hold now, nanoseconds (at least 1 ms).
    pub(crate) fn typical(&self, i: usize) -> u64 {
        let avg = self.average.get(i).map_or(UNSEEN, |a| a.load(Ordering::Relaxed));
        let hold = if avg == UNSEEN { self.initial.get(i).copied().unwrap_or(0) } else { avg };
        hold.max(MIN_HOLD)
    }

    /// Records that tier `i` held a slot for `hold` nanoseconds.
    pub(crate) fn observe(&self, i: usize, hold: u64) {
        let Some(avg) = self.average.get(i) else { return };
        let _ = avg.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
            Some(if old == UNSEEN { hold } else { ewma(old, hold) })
        });
    }
}

/// `old + (new - old) / 8`, rounded down, exactly.
fn ewma(old: u64, new: u64) -> u64 {
    let step = (i128::from(new) - i128::from(old)).div_euclid(8);
    u64::try_from(i128::from(old) + step).unwrap_or(old)
}

/// Completes a decision of a policy with concurrency tiers: each concurrency tier's
/// `reset_after` (its typical hold while it holds slots), a refused tier's `retry_after` (the
/// typical hold), and the decision's `retry_after` (at least the longest of those).
pub(crate) fn fill(policy: &Policy, holds: &Holds, decision: &mut Decision) {
    let mut longest = 0;
    for (i, (tier, d)) in policy.tiers().iter().zip(decision.tiers.iter_mut()).enumerate() {
        if !matches!(tier.kind, Kind::Concurrency(_)) {
            continue;
        }
        let hold = holds.typical(i);
        d.reset_after = if d.remaining < u64::from(d.limit) { hold } else { 0 };
        if d.violated && decision.outcome == Outcome::Limited {
            d.retry_after = hold;
            longest = longest.max(hold);
        }
    }
    if longest > 0 {
        let rate = if decision.retry_after == NONE { 0 } else { decision.retry_after };
        decision.retry_after = rate.max(longest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_average_starts_at_the_first_hold_and_moves_by_an_eighth() {
        assert_eq!(ewma(800, 1600), 900);
        assert_eq!(ewma(800, 0), 700);
        assert_eq!(ewma(7, 0), 6, "rounded down");
        let policy = Policy::builder("p")
            .concurrency(
                "c",
                crate::Concurrency::new(1).with_typical_hold(std::time::Duration::from_millis(250)),
            )
            .build()
            .unwrap();
        let holds = Holds::new(&policy);
        assert_eq!(holds.typical(0), 250_000_000);
        holds.observe(0, 80_000_000);
        assert_eq!(holds.typical(0), 80_000_000);
        holds.observe(0, 160_000_000);
        assert_eq!(holds.typical(0), 90_000_000);
        holds.observe(0, 0);
        holds.observe(0, 0);
        assert!(holds.typical(0) >= MIN_HOLD, "never below 1 ms");
    }
}
