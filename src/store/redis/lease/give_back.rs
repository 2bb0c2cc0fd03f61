//! Giving blocks back: the sweeper of ended blocks, and the give-back when the binding is
//! dropped.

use super::*;

impl Leases {
    /// The slots whose block ended (every slot holding a block, with `all`), and with `all`
    /// their rests taken out; idle slots holding nothing are dropped.
    pub(super) fn ended(
        &self,
        clock_now: Option<u64>,
        all: bool,
    ) -> (Vec<Arc<Slot>>, Vec<(Key, Rest)>) {
        let (mut slots, mut rests) = (Vec::new(), Vec::new());
        for shard in &*self.shards {
            let mut map = shard.lock().unwrap_or_else(PoisonError::into_inner);
            map.retain(|key, slot| {
                let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
                let now = held.now(clock_now);
                if all {
                    if let Some(rest) = self.take_rest(&mut held) {
                        rests.push((key.clone(), rest));
                    }
                } else if held.charges.is_some() && !held.live(now) {
                    slots.push(Arc::clone(slot));
                }
                // Kept while in use, or while its block (or its history) may still matter.
                Arc::strong_count(slot) > 1 || held.charges.is_some() || held.live(now)
            });
        }
        (slots, rests)
    }

    /// Gives back the rests of the blocks that ended, each with its slot's refill lock held
    /// until Redis answers, so that the key's next block is taken after it.
    pub(crate) async fn sweep(&self) {
        let Some(back) = &self.back else { return };
        let clock_now = || back.inner.settings.clock.as_ref().map(crate::clock::AnyClock::now);
        let (slots, _) = self.ended(clock_now(), false);
        for slot in slots {
            let _refill = slot.refill.lock().await;
            let rest = {
                let mut held = slot.held.lock().unwrap_or_else(PoisonError::into_inner);
                let now = held.now(clock_now());
                if held.live(now) {
                    None
                } else {
                    // The next block: what was spent of this one in its lifetime.
                    held.next = held.spent().clamp(1, self.config.max_block);
                    self.take_rest(&mut held).map(|r| (held.key.clone(), r))
                }
            };
            if let Some((Some(key), rest)) = rest {
                let units = rest.granted - rest.spent;
                if back.give(&key, &rest).await.is_ok() {
                    self.returned(units);
                }
            }
        }
    }

    /// Whether the sweeper must be started (once).
    pub(crate) fn start_sweeper(&self) -> bool {
        !self.sweeping.swap(true, Ordering::AcqRel)
    }
}

impl Drop for Leases {
    fn drop(&mut self) {
        let Some(back) = self.back.take() else { return };
        let (_, rests) = self.ended(None, true);
        if rests.is_empty() {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
        handle.spawn(async move {
            for (key, rest) in rests {
                if let Err(error) = back.give(&key, &rest).await {
                    tracing::debug!(%error, "tollgate: could not give a leased block back; its units come back with the key's state");
                }
            }
        });
    }
}

/// What giving a block back needs.
pub(crate) struct Back {
    pub(crate) inner: Arc<crate::store::redis::Inner>,
    pub(crate) prepared: Arc<crate::store::redis::Prepared>,
    pub(crate) key_parts: (String, String),
    pub(crate) key_names: crate::store::redis::KeyNames,
    /// The binding's local refusals, which a give-back must not leave a refusal of its key
    /// in (see `RedisPolicy::forgetting`).
    pub(crate) refusals: Option<Arc<crate::store::redis::Refusals>>,
}

impl Back {
    /// Settles the block of `key` at what was spent of it (a give-back of this instance: a
    /// refusal of the key held here is forgotten, as when the next block gives the rest back).
    pub(super) async fn give(&self, key: &Key, rest: &Rest) -> Result<(), crate::StoreError> {
        let hash = self.refusals.as_ref().map_or(0, |r| r.hash(key));
        let _forgetting =
            crate::store::redis::forgetting(self.refusals.as_deref(), &self.inner, hash);
        let (granted, spent) = (rest.granted, rest.spent);
        let now = self.inner.bounds_now(&self.prepared);
        let record = self.prepared.settle(&rest.charges, |_| granted, |_| spent, false, now);
        let state_key = state_key(&self.key_parts, &self.key_names, key);
        let keys = self.prepared.keys(state_key);
        self.inner.submit(&self.prepared, keys, record, 0).await.map(drop)
    }
}

/// Gives back ended blocks every lifetime while the binding lives.
pub(crate) async fn sweeper(leases: Weak<Leases>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(leases) = leases.upgrade() else { return };
        leases.sweep().await;
    }
}
