//! What a call receives: the reply's numbers turned back into decisions and charges.

use super::*;

/// The numbers of a packed reply (integers below 2^53, as doubles).
pub(crate) fn numbers(reply: &[u8]) -> Result<Vec<i64>, StoreError> {
    if reply.len() % 8 != 0 {
        return Err(bad_reply("not packed doubles"));
    }
    #[allow(clippy::cast_possible_truncation)] // integers below 2^53
    let numbers = reply
        .chunks_exact(8)
        .map(|c| {
            let mut b = [0u8; 8];
            b.copy_from_slice(c);
            f64::from_le_bytes(b) as i64
        })
        .collect();
    Ok(numbers)
}

/// Reply layout per check: `outcome (1 allowed, 0 limited, 2 cost above capacity), delay,
/// retry`, then per tier `remaining, reset, own retry (-1 none), violated, entry id`; durations
/// in units from the unit `now` falls in.
pub(crate) const HEAD: usize = 3;
pub(crate) const PER_TIER: usize = 5;

pub(super) fn bad_reply(what: &str) -> StoreError {
    StoreError::backend(format!("unexpected reply from the tollgate script: {what}"))
}

pub(super) fn units(v: i64) -> Result<u64, StoreError> {
    u64::try_from(v).map_err(|_| bad_reply("negative duration"))
}

pub(super) fn optional(v: i64) -> Result<Option<u64>, StoreError> {
    if v < 0 { Ok(None) } else { units(v).map(Some) }
}

/// The decision of a check (its part of the reply) made at `now` (nanoseconds), and for an
/// admitted request what each tier was charged (`cost` on every tier).
pub(crate) fn decode(
    policy: &Policy,
    cost: u64,
    now: u64,
    reply: &[i64],
) -> Result<(Decision, Option<Charges>), StoreError> {
    decode_costs(policy, &|_| cost, 0, Priority::Standard, now, reply)
}

/// [`decode`] with a cost per tier, and the holder id of the concurrency tiers' slots (charged
/// at the decision's instant, not after its delay: they are held from then on), for a request
/// of `class` (each tier's limit is what the class may use of it).
pub(crate) fn decode_costs(
    policy: &Policy,
    cost: &dyn Fn(usize) -> u64,
    holder: u64,
    class: Priority,
    now: u64,
    reply: &[i64],
) -> Result<(Decision, Option<Charges>), StoreError> {
    let tiers = policy.tiers();
    if reply.len() != HEAD + PER_TIER * tiers.len() {
        return Err(bad_reply("wrong length"));
    }
    let outcome = match reply[0] {
        1 => Outcome::Allowed,
        0 => Outcome::Limited,
        2 => Outcome::CostExceedsCapacity,
        _ => return Err(bad_reply("unknown outcome")),
    };
    let unit = policy.unit();
    let at = now / unit;
    let delay = units(reply[1])?;
    let mut decided = Tiers::with_capacity(tiers.len());
    let mut charges = Charges::with_capacity(tiers.len());
    for (i, (tier, r)) in tiers.iter().zip(reply[HEAD..].chunks_exact(PER_TIER)).enumerate() {
        decided.push(TierDecision::new(
            tier.capacity_for(class),
            units(r[0])?,
            units(r[1])?,
            optional(r[2])?,
            r[3] != 0,
        ));
        charges.push(match tier.kind {
            Kind::Concurrency(_) => Charge { at, cost: cost(i), id: holder },
            _ => Charge { at: at.saturating_add(delay), cost: cost(i), id: units(r[4])? },
        });
    }
    let mut decision = Decision::new(outcome, delay, optional(reply[2])?, decided);
    if unit > 1 {
        decision.rescale(at, unit, now);
    }
    let charges = (outcome == Outcome::Allowed).then_some(charges);
    Ok((decision, charges))
}

/// The instant a batch was decided at, from the last two numbers of its reply.
pub(crate) fn decided_at(reply: &[i64]) -> Result<u64, StoreError> {
    match reply {
        [.., s, ns] => {
            let (s, ns) = (units(*s)?, units(*ns)?);
            Ok(s.saturating_mul(NANOS_PER_SEC).saturating_add(ns))
        }
        _ => Err(bad_reply("no instant")),
    }
}
