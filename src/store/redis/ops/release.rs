//! Releases of concurrency slots, and their refreshes while held.

use super::*;

impl RedisStore {
    pub(super) async fn release_on_redis(
        &self,
        bound: &RedisPolicy,
        ticket: RedisTicket,
    ) -> Result<(), StoreError> {
        let Charged::Remote(mut remote) = ticket.0 else { return Ok(()) };
        let Some(slots) = remote.slots.take() else { return Ok(()) };
        let _forgetting = bound.forgetting(&self.inner, remote.refusal);
        let new: Vec<u64> = remote.charges.iter().map(|c| c.cost).collect();
        let state_key = std::mem::take(&mut remote.state_key);
        let prepared = &bound.prepared;
        let released = settle_remote(
            &self.inner,
            prepared,
            &bound.policy,
            &bound.holds,
            state_key.clone(),
            &remote.charges,
            &new,
            true,
        )
        .await;
        if released.is_err() {
            // Retried in the background until it lands or the slots' time to live runs out.
            slots.release_later(state_key, remote.charges.clone());
        }
        released
    }

    pub(super) async fn refresh_on_redis(
        &self,
        bound: &RedisPolicy,
        ticket: &RedisTicket,
    ) -> Result<bool, StoreError> {
        let Charged::Remote(remote) = &ticket.0 else { return Ok(true) };
        let Some(slots) = &remote.slots else { return Ok(true) };
        let prepared = &bound.prepared;
        let record = prepared.refresh(&remote.charges, slots.id);
        let keys = prepared.keys(remote.state_key.clone());
        let (reply, _) =
            self.inner.submit(prepared, keys, record, prepared.refresh_reply_len()).await?;
        Ok(reply.iter().all(|held| *held == 1))
    }
}
