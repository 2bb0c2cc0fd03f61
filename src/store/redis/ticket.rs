//! [`RedisTicket`]: what an admitted request was charged, and the settlement that gives
//! units or concurrency slots back.

use super::*;

/// What an admitted request was charged through a [`RedisStore`] (see [`Store::Ticket`]): in
/// Redis, or in the local fallback when Redis could not decide. A [`Reservation`] holds one
/// (its example settles a ticket, on the memory store).
///
/// [`Reservation`]: crate::Reservation
#[derive(Debug)]
pub struct RedisTicket(pub(super) Charged);

#[derive(Debug)]
pub(super) enum Charged {
    Remote(Box<Remote>),
    Local(MemoryTicket),
}

#[derive(Debug)]
pub(super) struct Remote {
    pub(super) state_key: String,
    /// The key's hash in the binding's local refusals, forgotten when charges come back.
    pub(super) refusal: u64,
    /// What each tier was charged (a tier's cost follows its settlements).
    pub(super) charges: Charges,
    /// The concurrency slots it holds: released when it is dropped.
    pub(super) slots: Option<HeldSlots>,
}

/// Concurrency slots held, and what releasing them needs.
pub(super) struct HeldSlots {
    pub(super) id: u64,
    pub(super) store: Arc<Inner>,
    pub(super) prepared: Arc<Prepared>,
    pub(super) policy: Policy,
    pub(super) holds: Arc<Holds>,
}

impl fmt::Debug for HeldSlots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HeldSlots").field("id", &self.id).finish_non_exhaustive()
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        let Some(slots) = self.slots.take() else { return };
        let Ok(handle) = tokio::runtime::Handle::try_current() else { return };
        let (state_key, charges) = (std::mem::take(&mut self.state_key), self.charges.clone());
        handle.spawn(async move {
            let new: Vec<u64> = charges.iter().map(|c| c.cost).collect();
            if let Err(error) = slots.settle(state_key.clone(), &charges, &new, true).await {
                tracing::debug!(%error, "tollgate: could not release concurrency slots; retrying");
                slots.release_later(state_key, charges);
            }
        });
    }
}

impl HeldSlots {
    /// Settles `charges` at `new` (per tier) in Redis, releasing the slots with `release`
    /// (and recording their holds).
    pub(super) async fn settle(
        &self,
        state_key: String,
        charges: &Charges,
        new: &[u64],
        release: bool,
    ) -> Result<(), StoreError> {
        settle_remote(
            &self.store,
            &self.prepared,
            &self.policy,
            &self.holds,
            state_key,
            charges,
            new,
            release,
        )
        .await
    }
}

/// Settles `charges` of `state_key` at `new` per tier on a policy of several kinds, releasing
/// its slots with `release` and recording how long they were held.
#[allow(clippy::too_many_arguments)]
pub(super) async fn settle_remote(
    inner: &Inner,
    prepared: &Prepared,
    policy: &Policy,
    holds: &Holds,
    state_key: String,
    charges: &Charges,
    new: &[u64],
    release: bool,
) -> Result<(), StoreError> {
    let record = prepared.settle(
        charges,
        |i| charges[i].cost,
        |i| new[i],
        release,
        inner.bounds_now(prepared),
    );
    let keys = prepared.keys(state_key);
    let (_, at) = inner.submit(prepared, keys, record, 0).await?;
    if release {
        let unit = policy.unit();
        for (i, (t, c)) in policy.tiers().iter().zip(charges).enumerate() {
            if matches!(t.kind, Kind::Concurrency(_)) && c.cost > 0 {
                holds.observe(i, at.saturating_sub(c.at.saturating_mul(unit)));
            }
        }
    }
    Ok(())
}
