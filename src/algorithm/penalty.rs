//! A tier's penalty box (see [`Penalty`](crate::Penalty)): until when a key is blocked, and
//! the breaches counted towards its next block. Instants in the policy's unit.

use crate::algorithm::compiled::Block;

/// One key's box for one tier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Strikes {
    /// The key is blocked while `now < until` (0: never blocked, or the block ended).
    pub(crate) until: u64,
    /// The instants of the breaches still in the window, in the order they were counted (at
    /// most `refusals - 1`).
    pub(crate) at: Vec<u64>,
}

impl Strikes {
    /// Forgets a block that has ended and the breaches that left the window at `now`: a
    /// breach at `t` counts while `now < t + within`.
    pub(crate) fn prune(&mut self, b: &Block, now: u64) {
        if self.until <= now {
            self.until = 0;
        }
        if !self.at.is_empty() {
            self.at.retain(|t| t.saturating_add(b.within) > now);
        }
    }

    /// The end of the block, if the key is blocked at `now`.
    pub(crate) fn blocked(&self, now: u64) -> Option<u64> {
        (self.until > now).then_some(self.until)
    }

    /// Counts a breach at `now`; when it is the `refusals`-th in the window, the block starts
    /// (and the count starts over). Returns the block's end when it started.
    pub(crate) fn breach(&mut self, b: &Block, now: u64) -> Option<u64> {
        self.at.push(now);
        if (self.at.len() as u64) < b.refusals {
            return None;
        }
        self.at.clear();
        self.until = now.saturating_add(b.block);
        Some(self.until)
    }

    /// Whether the box decides like a fresh one at `now`: no block and no breach counted.
    pub(crate) fn is_idle(&self, b: &Block, now: u64) -> bool {
        self.until <= now && self.at.iter().all(|t| t.saturating_add(b.within) <= now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Penalty;
    use std::time::Duration;

    fn block(refusals: u64, within: u64) -> Block {
        Block { spec: Penalty::new(Duration::from_nanos(100)), block: 100, refusals, within }
    }

    #[test]
    fn the_kth_breach_within_the_window_blocks_and_old_ones_are_forgotten() {
        let b = block(3, 10);
        let mut s = Strikes::default();
        assert_eq!(s.breach(&b, 0), None);
        assert_eq!(s.breach(&b, 5), None);
        // At 10 the breach at 0 has left the window (0 + 10 <= 10).
        s.prune(&b, 10);
        assert_eq!(s.at, [5]);
        assert_eq!(s.breach(&b, 10), None);
        assert_eq!(s.breach(&b, 14), Some(114));
        assert!(s.at.is_empty());
        assert_eq!((s.blocked(113), s.blocked(114)), (Some(114), None));
        assert!(!s.is_idle(&b, 113) && s.is_idle(&b, 114));
        s.prune(&b, 114);
        assert_eq!(s, Strikes::default());
    }

    #[test]
    fn one_refusal_blocks_at_once_and_keeps_no_instants() {
        let b = block(1, 0);
        let mut s = Strikes::default();
        assert_eq!(s.breach(&b, 7), Some(107));
        assert!(s.at.is_empty());
    }
}
