//! Releasing concurrency slots while Redis does not answer (a master down, a Sentinel failover
//! under way): a release that fails is retried in the background until it lands or the slots'
//! time to live runs out, instead of leaving the slots taken until then.
//!
//! A release gives back the members of the ticket's lease id and settles nothing else, so it
//! can be sent again safely: one that reached Redis although its answer was lost finds nothing
//! left to remove. The retries wait [`FIRST`], then twice as long each time up to [`EVERY`]:
//! once the store reaches a server again (for Sentinel, the promoted master, found again as
//! soon as a call fails), the slots come back within about [`EVERY`], where they would stay
//! taken for the rest of their time to live (30 s by default). They stop by themselves: the
//! slots' time to live, counted from the first attempt, bounds them (it was last refreshed
//! before that, so by then Redis has let the slots expire anyway).

use std::time::{Duration, Instant};

use super::{Charges, HeldSlots};

/// The first retry's wait.
const FIRST: Duration = Duration::from_millis(100);

/// The longest wait between two retries.
const EVERY: Duration = Duration::from_millis(500);

impl HeldSlots {
    /// Retries, on a spawned task, the release of the slots `charges` took on `state_key`, whose
    /// first attempt failed, until it lands or the slots' time to live runs out. Without a tokio
    /// runtime, nothing is retried (the slots come back when their time to live runs out).
    pub(super) fn release_later(self, state_key: String, charges: Charges) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
        let ttl = self.policy.tiers().iter().filter_map(|t| t.concurrency()).map(|c| c.ttl());
        let until = Instant::now() + ttl.max().unwrap_or_default();
        handle.spawn(async move {
            let mut wait = FIRST;
            let mut tries = 0u32;
            while Instant::now() + wait < until {
                tokio::time::sleep(wait).await;
                tries += 1;
                let new: Vec<u64> = charges.iter().map(|c| c.cost).collect();
                let store = &self.store;
                let record = self.prepared.settle(
                    &charges,
                    |i| charges[i].cost,
                    |i| new[i],
                    true,
                    store.bounds_now(&self.prepared),
                );
                let keys = self.prepared.keys(state_key.clone());
                match store.submit(&self.prepared, keys, record, 0).await {
                    Ok(_) => {
                        tracing::debug!(tries, "tollgate: concurrency slots released on a retry");
                        return;
                    }
                    Err(error) => {
                        tracing::debug!(%error, tries, "tollgate: a slot release failed again")
                    }
                }
                wait = (wait * 2).min(EVERY);
            }
            tracing::warn!(
                tries,
                "tollgate: could not release concurrency slots before their time to live ended; \
                 Redis lets them expire"
            );
        });
    }
}
