//! What one script call sends (keys, arguments) and how its reply becomes a [`Decision`].
//!
//! The argument layout is the one `limit.lua` documents at its top.

use std::borrow::Cow;
use std::time::Duration;

use redis::ScriptInvocation;

use crate::algorithm::{Charge, Charges};
use crate::clock::duration_to_nanos;
use crate::decision::{Decision, Outcome, TierDecision, Tiers};
use crate::error::{ConfigError, StoreError};
use crate::key::Key;
use crate::quota::{Algorithm, Policy};
use crate::store::Ticket;

/// The longest span the script represents, 2^50 ns (about 13 days): it computes in Lua's
/// doubles, exact for integers below 2^53, relative to the current instant.
pub(crate) const MAX_HORIZON_NANOS: u64 = 1 << 50;

/// The shortest window period on Redis: windows are indexed by `unix time / period`, which must
/// stay below 2^53.
const MIN_WINDOW_PERIOD_NANOS: u64 = 1_000_000;

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// Which instant the script decides at.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Now {
    /// The Redis server's `TIME`.
    Server,
    /// This instant of the store's injected clock, in nanoseconds.
    At(u64),
}

/// Checks that the script can represent every tier of `policy` exactly.
pub(crate) fn validate(policy: &Policy) -> Result<(), ConfigError> {
    let unsupported = |tier: &str, why: String| {
        Err(ConfigError::UnsupportedByStore(format!("RedisStore, tier `{tier}`: {why}")))
    };
    let max = Duration::from_nanos(MAX_HORIZON_NANOS);
    for tier in policy.tiers() {
        let r = tier.rate;
        if r.period > MAX_HORIZON_NANOS {
            return unsupported(
                tier.name(),
                format!(
                    "period {:?} exceeds the longest supported, {max:?}",
                    tier.quota().period()
                ),
            );
        }
        let tau = u128::from(r.burst) * u128::from(r.period) / u128::from(r.count);
        if tau > u128::from(MAX_HORIZON_NANOS) {
            return unsupported(
                tier.name(),
                format!("burst x period / count exceeds the longest supported span, {max:?}"),
            );
        }
        let window = matches!(
            policy.algorithm(),
            Algorithm::FixedWindow | Algorithm::SlidingCounter | Algorithm::SlidingLog
        );
        if window && r.period < MIN_WINDOW_PERIOD_NANOS {
            return unsupported(
                tier.name(),
                "window algorithms need a period of at least 1 ms on Redis".to_owned(),
            );
        }
    }
    Ok(())
}

/// Escapes the characters that would end a Redis Cluster hash tag early (`{`, `}`) or make the
/// `policy|key` split ambiguous (`|`), and the escape character itself.
fn escape(s: &str) -> Cow<'_, str> {
    if !s.bytes().any(|b| matches!(b, b'{' | b'}' | b'|' | b'%')) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c {
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            '|' => out.push_str("%7C"),
            '%' => out.push_str("%25"),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// A stable 32-bit fingerprint of what the stored state means — the algorithm and every tier's
/// count, period and burst — and of how it is stored. A reconfigured policy gets new keys, so
/// state written under the old one is never read under the new one; the old keys expire on
/// their TTL.
fn fingerprint(policy: &Policy) -> u32 {
    // The policy's meaning (hashed when it was built) and the representation: the fast path
    // keeps a string, the general script a hash.
    let representation: u64 = if policy.whole_gcra { 0x5354_5249_4e47 } else { 0x4841_5348 };
    let h = (policy.meaning ^ representation).wrapping_mul(0x0100_0000_01b3);
    #[allow(clippy::cast_possible_truncation)] // folding 64 bits into 32 on purpose
    let folded = (h ^ (h >> 32)) as u32;
    folded
}

/// The key of the hash holding every tier's state of `key` under `policy`:
/// `{prefix}{{policy}|{key}}:{fingerprint}`. Everything that identifies the limit is inside the
/// hash tag, so a policy's tiers (and sliding-log sets) share one Redis Cluster slot.
pub(crate) fn state_key(prefix: &str, policy: &Policy, key: &Key) -> String {
    let key = key.to_string();
    format!("{prefix}{{{}|{}}}:{:08x}", escape(policy.name()), escape(&key), fingerprint(policy))
}

/// The sorted set of tier `i` (1-based) of a sliding-log policy.
fn log_key(state_key: &str, i: usize) -> String {
    format!("{state_key}:z{i}")
}

/// A prepared script call: the script, and `KEYS` and `ARGV` as it documents them.
pub(crate) struct Call {
    pub(crate) keys: Vec<String>,
    pub(crate) args: Vec<Vec<u8>>,
    fast: bool,
}

impl Call {
    /// Starts a call: the state key (and the sliding-log sets), then
    /// `op, clock, now_sec, now_nsec, algorithm, ttl_grace_ms, ntiers, (count, period, burst)*`.
    fn new(op: &str, state_key: String, policy: &Policy, now: Now, grace_ms: u64) -> Self {
        let ntiers = policy.tiers().len();
        let (flag, secs, nanos) = match now {
            Now::Server => ("S", 0, 0),
            Now::At(t) => ("C", t / NANOS_PER_SEC, t % NANOS_PER_SEC),
        };
        // The fast path (`gcra.lua`) for whole-nanosecond GCRA tiers.
        if policy.whole_gcra {
            // op, clock, now_sec, now_nsec, ttl_grace_ms, ntiers, (T, tau)*
            let mut call = Self {
                keys: vec![state_key],
                args: Vec::with_capacity(10 + 2 * ntiers),
                fast: true,
            };
            call.arg(op).arg(flag).arg(secs).arg(nanos).arg(grace_ms).arg(ntiers);
            for t in policy.tiers() {
                let interval = t.rate.period / t.rate.count;
                call.arg(interval).arg(interval * t.rate.burst);
            }
            return call;
        }
        let mut keys = Vec::with_capacity(1 + ntiers);
        if policy.algorithm() == Algorithm::SlidingLog {
            keys.extend((1..=ntiers).map(|i| log_key(&state_key, i)));
        }
        keys.insert(0, state_key);
        let mut call = Self { keys, args: Vec::with_capacity(10 + 3 * ntiers), fast: false };
        call.arg(op).arg(flag).arg(secs).arg(nanos).arg(policy.algorithm().name());
        call.arg(grace_ms).arg(ntiers);
        for t in policy.tiers() {
            call.arg(t.rate.count).arg(t.rate.period).arg(t.rate.burst);
        }
        call
    }

    fn arg(&mut self, v: impl redis::ToRedisArgs) -> &mut Self {
        v.write_redis_args(&mut self.args);
        self
    }

    /// Decides `cost` units; `max_delay` `None` polices, `Some` shapes (clamped to
    /// [`MAX_HORIZON_NANOS`]).
    pub(crate) fn check(
        state_key: String,
        policy: &Policy,
        now: Now,
        grace_ms: u64,
        cost: u64,
        max_delay: Option<Duration>,
    ) -> Self {
        let mut call = Self::new("check", state_key, policy, now, grace_ms);
        let max_delay = max_delay.map_or(-1, |d| {
            i64::try_from(duration_to_nanos(d).min(MAX_HORIZON_NANOS)).unwrap_or(-1)
        });
        call.arg(cost).arg(max_delay);
        call
    }

    /// Settles `ticket` at `cost` units: `old_cost, new_cost, (at_sec, at_nsec, id)*`.
    pub(crate) fn settle(
        state_key: String,
        ticket: &Ticket,
        now: Now,
        grace_ms: u64,
        cost: u64,
    ) -> Self {
        let mut call = Self::new("settle", state_key, &ticket.inner.policy, now, grace_ms);
        call.arg(ticket.inner.cost).arg(cost);
        if call.fast {
            // Every tier was charged at the same instant.
            let at = ticket.inner.charges.first().map_or(0, |c| c.at);
            call.arg(at / NANOS_PER_SEC).arg(at % NANOS_PER_SEC);
            return call;
        }
        for c in &ticket.inner.charges {
            call.arg(c.at / NANOS_PER_SEC).arg(c.at % NANOS_PER_SEC).arg(c.id);
        }
        call
    }

    /// The script invocation.
    pub(crate) fn invocation(&self) -> ScriptInvocation<'static> {
        let script = if self.fast { &*super::FAST } else { &*super::SCRIPT };
        let mut inv = script.prepare_invoke();
        for k in &self.keys {
            inv.key(k.as_str());
        }
        for a in &self.args {
            inv.arg(a.as_slice());
        }
        inv
    }
}

/// Reply layout: `outcome (1 allowed, 0 limited, 2 cost above capacity), delay, retry, now_sec,
/// now_nsec`, then per tier `remaining, reset, own retry (-1 none), violated, at_sec, at_nsec,
/// id`. Durations in nanoseconds.
const HEAD: usize = 5;
const PER_TIER: usize = 7;

fn bad_reply(what: &str) -> StoreError {
    StoreError::Backend(format!("unexpected reply from the tollgate script: {what}"))
}

fn nanos(v: i64) -> Result<u64, StoreError> {
    u64::try_from(v).map_err(|_| bad_reply("negative duration"))
}

fn optional(v: i64) -> Result<Option<u64>, StoreError> {
    if v < 0 { Ok(None) } else { nanos(v).map(Some) }
}

/// The decision of a `check` call, and for an admitted request what each tier was charged.
pub(crate) fn decode(
    policy: &Policy,
    cost: u64,
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
    let mut decided = Tiers::with_capacity(tiers.len());
    let mut charges = Charges::with_capacity(tiers.len());
    for (tier, r) in tiers.iter().zip(reply[HEAD..].chunks_exact(PER_TIER)) {
        decided.push(TierDecision::new(
            tier.capacity(),
            nanos(r[0])?,
            nanos(r[1])?,
            optional(r[2])?,
            r[3] != 0,
        ));
        let at = nanos(r[4])?.saturating_mul(NANOS_PER_SEC).saturating_add(nanos(r[5])?);
        charges.push(Charge { at, cost, id: nanos(r[6])? });
    }
    let decision = Decision::new(outcome, nanos(reply[1])?, optional(reply[2])?, decided);
    let charges = (outcome == Outcome::Allowed).then_some(charges);
    Ok((decision, charges))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::Quota;

    fn policy(name: &str, alg: Algorithm) -> Policy {
        Policy::builder(name)
            .algorithm(alg)
            .tier("a", Quota::per_second(10))
            .tier("b", Quota::per_hour(100))
            .build()
            .unwrap()
    }

    #[test]
    fn keys_keep_the_hash_tag_whole_and_unambiguous() {
        let p = policy("api", Algorithm::Gcra);
        let k = state_key("tollgate:", &p, &Key::text("a}b{c|d%"));
        let fp = format!("{:08x}", fingerprint(&p));
        assert_eq!(k, format!("tollgate:{{api|s8:a%7Db%7Bc%7Cd%25}}:{fp}"));
        // The hash tag is everything between the first `{` and the first `}` after it.
        let tag = &k[k.find('{').unwrap() + 1..k.find('}').unwrap()];
        assert_eq!(tag, "api|s8:a%7Db%7Bc%7Cd%25");
        // `|` in a policy name cannot be confused with the separator.
        let a = state_key("", &policy("a|b", Algorithm::Gcra), &Key::text("c"));
        let b = state_key("", &policy("a", Algorithm::Gcra), &Key::text("b|s1:c"));
        assert_ne!(a.split(':').next(), b.split(':').next());
    }

    #[test]
    fn reconfigured_policies_get_new_keys() {
        let a = policy("api", Algorithm::Gcra);
        let b = policy("api", Algorithm::TokenBucket);
        let c = Policy::builder("api")
            .tier("a", Quota::per_second(10).with_burst(11))
            .tier("b", Quota::per_hour(100))
            .build()
            .unwrap();
        let keys: Vec<_> = [&a, &b, &c].iter().map(|p| state_key("", p, &Key::Global)).collect();
        assert_ne!(keys[0], keys[1]);
        assert_ne!(keys[0], keys[2]);
        assert_eq!(state_key("", &a, &Key::Global), keys[0], "stable");
    }

    #[test]
    fn sliding_log_calls_carry_one_set_per_tier_after_the_hash() {
        let p = policy("api", Algorithm::SlidingLog);
        let call = Call::check("h".into(), &p, Now::At(1_500_000_000), 0, 2, None);
        assert_eq!(call.keys, ["h", "h:z1", "h:z2"]);
        let args: Vec<String> =
            call.args.iter().map(|a| String::from_utf8(a.clone()).unwrap()).collect();
        assert_eq!(
            args,
            [
                "check",
                "C",
                "1",
                "500000000",
                "sliding_log",
                "0",
                "2",
                "10",
                "1000000000",
                "10",
                "100",
                "3600000000000",
                "100",
                "2",
                "-1"
            ]
        );
    }

    #[test]
    fn policies_beyond_the_horizon_are_refused() {
        let long = Policy::single("p", Quota::new(1, Duration::from_secs(30 * 86_400))).unwrap();
        assert!(matches!(validate(&long), Err(ConfigError::UnsupportedByStore(_))));
        let wide = Policy::single("p", Quota::per_day(1).with_burst(14)).unwrap();
        assert!(matches!(validate(&wide), Err(ConfigError::UnsupportedByStore(_))));
        let fine = Policy::single("p", Quota::per_day(1).with_burst(13)).unwrap();
        assert_eq!(validate(&fine), Ok(()));
        let tiny = Policy::builder("p")
            .algorithm(Algorithm::FixedWindow)
            .tier("t", Quota::new(1, Duration::from_micros(100)))
            .build()
            .unwrap();
        assert!(matches!(validate(&tiny), Err(ConfigError::UnsupportedByStore(_))));
    }

    #[test]
    fn decode_rebuilds_the_decision_and_the_charges() {
        let p = policy("api", Algorithm::Gcra);
        let reply = [1, 5, -1, 7, 9, 9, 100, -1, 0, 7, 9, 0, 99, 36_000_000_000, -1, 0, 7, 9, 0];
        let (d, charges) = decode(&p, 1, &reply).unwrap();
        assert_eq!(d.outcome(), Outcome::Allowed);
        assert_eq!(d.delay(), Duration::from_nanos(5));
        assert_eq!(d.tiers()[1].remaining(), 99);
        assert_eq!(d.tiers()[1].reset_after(), Duration::from_secs(36));
        assert_eq!(charges.unwrap()[0], Charge { at: 7_000_000_009, cost: 1, id: 0 });
        let limited = [0, 0, 50, 7, 9, 0, 100, 50, 1, 0, 0, 0, 99, 1, -1, 0, 0, 0, 0];
        let (d, charges) = decode(&p, 1, &limited).unwrap();
        assert_eq!(d.retry_after(), Some(Duration::from_nanos(50)));
        assert_eq!(d.violated_names(&p).collect::<Vec<_>>(), ["a"]);
        assert!(charges.is_none());
        assert!(decode(&p, 1, &reply[..10]).is_err());
        assert!(decode(&p, 1, &[3; 19]).is_err());
    }
}
