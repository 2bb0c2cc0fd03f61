//! The sweeper: a background task that removes idle keys and the tables of dropped bindings,
//! and stops when the store is dropped.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use super::Inner;
use super::table::lock;

impl Inner {
    pub(super) fn sweep(&self) -> usize {
        {
            let mut registry = lock(&self.registry);
            self.clear_retired(&mut registry);
        }
        let now = self.clock.now();
        let removed = self.shards.iter().map(|shard| shard.evict_idle(now)).sum();
        self.len.fetch_sub(removed, Ordering::Relaxed);
        self.give_up_idle();
        removed
    }

    /// Starts the sweeper on the current tokio runtime, once. Called when a key is stored: with
    /// no keys there is nothing to sweep, and the check's fast path stays free of it.
    #[inline]
    pub(super) fn start_sweeper(self: &Arc<Self>) {
        if !self.sweeper.load(Ordering::Relaxed) {
            self.spawn_sweeper();
        }
    }

    #[cold]
    pub(super) fn spawn_sweeper(self: &Arc<Self>) {
        let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
        if self.sweeper.swap(true, Ordering::AcqRel) {
            return;
        }
        let weak: Weak<Self> = Arc::downgrade(self);
        let every = self.sweep_interval;
        handle.spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(inner) = weak.upgrade() else { break };
                let removed = inner.sweep();
                tracing::trace!(removed, "tollgate: swept idle keys");
                crate::metrics::memory_keys(inner.len.load(Ordering::Relaxed));
            }
        });
    }
}
