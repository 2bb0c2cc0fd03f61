//! The local ledger: one slot per leased key, holding the block this process spends.

use super::*;

/// One key's block, and the lock that makes one check at a time take the next one.
#[derive(Default)]
pub(crate) struct Slot {
    pub(super) held: Mutex<HeldBlock>,
    pub(crate) refill: tokio::sync::Mutex<()>,
}

#[derive(Default)]
pub(super) struct HeldBlock {
    /// Units of the block not spent yet.
    pub(super) left: u64,
    /// Units the block was granted with.
    pub(super) granted: u64,
    /// What Redis charged for it (to give back the rest); `None` once given back.
    pub(super) charges: Option<Charges>,
    /// The instant Redis granted it (nanoseconds, on the clock the scripts decide with).
    pub(super) decided: u64,
    /// Without an injected clock: this process's instant the call was sent.
    pub(super) sent: Option<Instant>,
    /// The end of its lifetime (same clock as `decided`).
    pub(super) until: u64,
    /// Until when (same clock) this instance refuses the checks its block cannot serve,
    /// waiting for a useful block to build up in Redis; 0 for none.
    pub(super) hold: u64,
    /// The useful block the last grant asked for (see [`Begin::useful`]): the tiers that had
    /// less than that left in Redis are those this instance waits on until `hold`.
    pub(super) useful: u64,
    /// The grant's decision (limits and resets), for the checks decided from the block.
    pub(super) decision: Option<Decision>,
    /// The size of the next block to ask for (0: a key not leased yet, which asks for 1).
    pub(super) next: u64,
    /// What Redis had left of the key (the least over its tiers) at the last grant.
    pub(super) room: Option<u64>,
    /// The key, for the sweeper.
    pub(super) key: Option<Key>,
    /// Whether a call asking for the next block ahead of need is in flight (or about to be).
    pub(super) fetching: bool,
    /// Units of `left` from an earlier grant, which a prefetched block joined: spent first,
    /// and no longer after `older_until`.
    pub(super) older: u64,
    /// The end of the lifetime of the `older` units (same clock as `decided`).
    pub(super) older_until: u64,
    /// Units of the block whose lifetime ended unspent (the `older` units, past
    /// `older_until`): no longer spendable, given back with the block's rest.
    pub(super) expired: u64,
    /// For a block leased from the key's schedule ([`Lease::schedule`]), per tier: the
    /// instant the last unit held conforms, and the tier's emission interval (nanoseconds);
    /// the unit `p` places before the last conforms `p` intervals earlier. Empty: every unit
    /// held conforms now. With `older` units, those of the newest grant only.
    pub(super) paced: Paced,
    /// The same for the `older` units (of the grant a prefetched block joined).
    pub(super) older_paced: Paced,
    /// After Redis refused a lease of the key's schedule, per tier: the instant the key's
    /// TAT less the tolerance τ (when a unit charged then would conform), and the emission
    /// interval (nanoseconds). A check of `cost` is admitted no earlier than `cost`
    /// intervals after it on every tier, which the refusals while waiting say (the wait for
    /// a useful block alone can be shorter). Empty otherwise.
    pub(super) waits: Paced,
}

/// Per tier, the instant a block's last unit conforms and the emission interval, in
/// nanoseconds (see `HeldBlock::paced`).
pub(crate) type Paced = smallvec::SmallVec<[(u64, u64); 2]>;

/// The instant the unit `after` places before the last of a paced block conforms on every
/// tier (0 for a block that is not paced).
pub(super) fn pace_at(paced: &Paced, after: u64) -> u64 {
    paced.iter().map(|(end, t)| end.saturating_sub(after.saturating_mul(*t))).max().unwrap_or(0)
}

/// How many of the first of `n` units of a paced block (the last `n`) conform at `now`.
pub(super) fn pace_count(paced: &Paced, n: u64, now: u64) -> u64 {
    paced
        .iter()
        .map(|(end, t)| n.saturating_sub(end.saturating_sub(now).div_ceil((*t).max(1))))
        .min()
        .unwrap_or(n)
}

impl HeldBlock {
    /// Now on the clock the block was granted on (see `Refusals::now`): never earlier than
    /// the server's clock, so a block ends early rather than late.
    pub(super) fn now(&self, clock_now: Option<u64>) -> u64 {
        match (clock_now, self.sent) {
            (Some(now), _) => now,
            (None, Some(sent)) => self.decided.saturating_add(duration_to_nanos(sent.elapsed())),
            (None, None) => u64::MAX,
        }
    }

    pub(super) fn live(&self, now: u64) -> bool {
        now < self.until && now >= self.decided
    }

    /// Units of the block spent (or given to checks), not to be given back.
    pub(super) fn spent(&self) -> u64 {
        self.granted - self.left - self.expired
    }

    /// The instant the next `cost` units held all conform (the last of them, on every
    /// tier), 0 when they do now (a block not leased from the schedule). The `older` units
    /// are spent first, each no earlier than its own grant's pace.
    pub(super) fn ready(&self, cost: u64) -> u64 {
        let older = self.older.min(self.left);
        let newer = self.left - older;
        let (from_older, from_newer) = (cost.min(older), cost.saturating_sub(older));
        let mut ready = 0;
        if from_older > 0 {
            ready = ready.max(pace_at(&self.older_paced, older - from_older));
        }
        if from_newer > 0 {
            ready = ready.max(pace_at(&self.paced, newer.saturating_sub(from_newer)));
        }
        ready
    }

    /// Units held that conform at `now`, in the order they are spent (those an instance can
    /// promise now).
    pub(super) fn conforming(&self, now: u64) -> u64 {
        let older = self.older.min(self.left);
        let newer = self.left - older;
        let ready = pace_count(&self.older_paced, older, now);
        if ready < older { ready } else { older + pace_count(&self.paced, newer, now) }
    }

    /// The `older` units whose lifetime ended at `now` are no longer spendable.
    pub(super) fn expire_older(&mut self, now: u64) {
        if self.older > 0 && now >= self.older_until {
            let gone = self.older.min(self.left);
            self.left -= gone;
            self.expired += gone;
            self.older = 0;
        }
    }
}

/// Whether, at `now`, this instance waits on a tier that had `rest` units left in Redis at
/// the last grant: it waits for a useful block (until `held.hold`), and the tier had less than
/// one. Such a tier's units in Redis are not this instance's to promise until the wait ends.
pub(super) fn waits_on(held: &HeldBlock, now: u64) -> impl Fn(u64) -> bool + use<> {
    let (waiting, useful) = (now < held.hold, held.useful);
    move |rest| waiting && rest < useful
}

/// What a decision made from a block reports as a tier's `remaining`: the tier's rest in
/// Redis at the last lease call (`t.remaining` of the decision kept) plus `left`, the units
/// held that this instance can spend now, at most the tier's limit; `left` alone on a tier it
/// waits on (see [`waits_on`]).
pub(super) fn promised(t: &crate::decision::TierDecision, left: u64, waits: bool) -> u64 {
    let rest = if waits { 0 } else { t.remaining };
    rest.saturating_add(left).min(t.limit())
}

impl Leases {
    pub(super) fn shard(&self, key: &Key) -> &Shard {
        #[allow(clippy::cast_possible_truncation)]
        &self.shards[(self.hasher.hash_one(key) % SHARDS as u64) as usize]
    }

    /// The slot of `key`, made if needed; `None` when the binding holds as many keys as it
    /// may and none can be dropped (the check is then exact).
    pub(crate) fn slot(&self, key: &Key) -> Option<Arc<Slot>> {
        let mut map = self.shard(key).lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = map.get(key) {
            return Some(Arc::clone(slot));
        }
        if map.len() >= self.per_shard {
            // A slot nobody uses that holds nothing to give back.
            let idle = map
                .iter()
                .find(|(_, s)| {
                    Arc::strong_count(s) == 1
                        && s.held.lock().unwrap_or_else(PoisonError::into_inner).charges.is_none()
                })
                .map(|(k, _)| k.clone())?;
            map.remove(&idle);
        }
        let slot = Arc::new(Slot::default());
        slot.held.lock().unwrap_or_else(PoisonError::into_inner).key = Some(key.clone());
        map.insert(key.clone(), Arc::clone(&slot));
        Some(slot)
    }

    /// Keys holding a slot now.
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len()).sum()
    }
}
