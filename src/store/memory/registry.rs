//! The table slots bindings share: one per policy, given up when nothing binds it and it
//! holds no key, retired (cleared) before it is used again.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::Inner;
use super::table::{Core, lock};
use crate::policy::Policy;

impl Inner {
    /// The table slot of `policy`'s state: the one that holds it already, else a new one
    /// (after clearing the tables of slots given up). Returns the slot, its core, and whether
    /// it held the policy already.
    pub(super) fn slot_for(&self, policy: &Policy) -> (usize, Arc<Core>, bool) {
        let mut registry = lock(&self.registry);
        let registry = &mut *registry;
        if let Some(&id) = registry.by_policy.get(policy) {
            if let Some(slot) = registry.slots.get_mut(id) {
                if let Some(core) = &slot.core {
                    slot.handles += 1;
                    return (id, Arc::clone(core), true);
                }
            }
        }
        self.clear_retired(registry);
        let id = registry.free.pop().unwrap_or_else(|| {
            registry.next += 1;
            registry.next - 1
        });
        if registry.slots.len() <= id {
            registry.slots.resize_with(id + 1, Slot::default);
        }
        let core = Arc::new(Core::new(policy));
        registry.slots[id] =
            Slot { core: Some(Arc::clone(&core)), handles: 1, preds: 0, successor: None };
        registry.by_policy.insert(policy.clone(), id);
        (id, core, false)
    }

    /// A binding of slot `id` was dropped.
    pub(super) fn unbind(&self, id: usize) {
        let mut registry = lock(&self.registry);
        if let Some(slot) = registry.slots.get_mut(id) {
            slot.handles = slot.handles.saturating_sub(1);
        }
        Self::give_up(&mut registry, id);
    }

    /// Gives slot `id` up when nothing needs it any more: no binding, no replaced binding
    /// deciding on it, and no longer found by its policy. A slot still found by its policy
    /// keeps its keys for the next binding of that policy (as Redis keeps them under the
    /// policy's name) until they are idle: then the sweeper gives it up
    /// ([`give_up_idle`](Self::give_up_idle)).
    pub(super) fn give_up(registry: &mut Registry, id: usize) {
        let Some(slot) = registry.slots.get(id) else { return };
        let found =
            slot.core.as_ref().is_some_and(|c| registry.by_policy.get(&c.policy) == Some(&id));
        if slot.handles == 0 && slot.preds == 0 && !found {
            Self::retire(registry, id);
        }
    }

    /// Retires slot `id` (its tables are cleared before it is used again), and then the slot
    /// it handed its keys over to, if nothing else needs that one.
    pub(super) fn retire(registry: &mut Registry, id: usize) {
        let Some(slot) = registry.slots.get_mut(id) else { return };
        let Some(core) = slot.core.take() else { return };
        let successor = slot.successor.take();
        if registry.by_policy.get(&core.policy) == Some(&id) {
            registry.by_policy.remove(&core.policy);
        }
        registry.retired.push(id);
        if let Some(next) = successor {
            if let Some(slot) = registry.slots.get_mut(next) {
                slot.preds = slot.preds.saturating_sub(1);
            }
            Self::give_up(registry, next);
        }
    }

    /// Gives up the slots that nothing binds any more and that hold no key (the sweeper has
    /// evicted them as idle).
    pub(super) fn give_up_idle(&self) {
        let mut registry = lock(&self.registry);
        let unbound: Vec<usize> = registry
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.core.is_some() && s.handles == 0 && s.preds == 0)
            .map(|(id, _)| id)
            .collect();
        for id in unbound {
            if self.shards.iter().all(|shard| shard.keys_of(id) == 0) {
                Self::retire(&mut registry, id);
            }
        }
    }

    /// Marks slot `from` (holding `policy`) as replaced by slot `to`, when `from` has at most
    /// one binding and was not replaced before; returns whether it did. A replaced slot is no
    /// longer found by its policy: binding that policy again starts a new one.
    pub(super) fn supersede(&self, from: usize, policy: &Policy, to: usize) -> bool {
        let mut registry = lock(&self.registry);
        let sole =
            registry.slots.get(from).is_some_and(|s| s.handles <= 1 && s.successor.is_none());
        if !sole {
            return false;
        }
        if registry.by_policy.get(policy) == Some(&from) {
            registry.by_policy.remove(policy);
        }
        registry.slots[from].successor = Some(to);
        if let Some(slot) = registry.slots.get_mut(to) {
            slot.preds += 1;
        }
        true
    }

    /// Drops the tables of bindings that were dropped, and frees their slots.
    pub(super) fn clear_retired(&self, registry: &mut Registry) {
        if registry.retired.is_empty() {
            return;
        }
        let mut removed = 0;
        for shard in &self.shards {
            for &id in &registry.retired {
                removed += shard.drop_tables(id);
            }
        }
        self.len.fetch_sub(removed, Ordering::Relaxed);
        let retired = std::mem::take(&mut registry.retired);
        registry.free.extend(retired);
    }
}

/// The table slots: which policy each one holds and what refers to it, which are free, and
/// which were given up (their tables are cleared before the slot is used again).
#[derive(Default)]
pub(super) struct Registry {
    pub(super) next: usize,
    pub(super) free: Vec<usize>,
    pub(super) retired: Vec<usize>,
    /// The slot holding each policy's state, by identity (name, algorithm, tiers): binding the
    /// same policy again shares it.
    pub(super) by_policy: HashMap<Policy, usize>,
    /// By slot.
    pub(super) slots: Vec<Slot>,
}

/// One table slot in use.
#[derive(Default)]
pub(super) struct Slot {
    pub(super) core: Option<Arc<Core>>,
    /// Its bindings ([`MemoryPolicy`](crate::store::MemoryPolicy)) alive.
    pub(super) handles: usize,
    /// Replaced bindings whose unchanged tiers live in it.
    pub(super) preds: usize,
    /// The slot that replaced it in a reload.
    pub(super) successor: Option<usize>,
}
