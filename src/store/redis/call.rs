//! What one script call sends (keys, arguments) and how its reply becomes a [`Decision`].
//!
//! The argument layout is the one `limit.lua` documents at its top.

use std::borrow::Cow;
use std::time::Duration;

use redis::{ScriptInvocation, ToRedisArgs};

use crate::algorithm::{Charge, Charges};
use crate::clock::duration_to_nanos;
use crate::decision::{Decision, Outcome, TierDecision, Tiers};
use crate::error::{ConfigError, StoreError};
use crate::key::Key;
use crate::quota::{Algorithm, Policy};

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
    let unsupported = |tier: &str, reason: String| {
        Err(ConfigError::UnsupportedByStore { store: "RedisStore", tier: tier.to_owned(), reason })
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

/// FNV-1a over the algorithm's name and every tier's count, period and burst: what a stored
/// state means.
fn meaning(policy: &Policy) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    feed(policy.algorithm().name().as_bytes());
    for t in policy.tiers() {
        for v in [t.rate.count, t.rate.period, t.rate.burst] {
            feed(&v.to_le_bytes());
        }
    }
    h
}

/// Whether the fast path (`gcra.lua`) applies: GCRA, every tier's emission interval a whole
/// number of nanoseconds.
pub(crate) fn whole_gcra(policy: &Policy) -> bool {
    policy.algorithm() == Algorithm::Gcra
        && policy.tiers().iter().all(|t| t.rate.period % t.rate.count == 0)
}

/// A stable 32-bit fingerprint of what the stored state means (the algorithm and every tier's
/// count, period and burst) and of how it is stored. A reconfigured policy gets new keys, so
/// state written under the old one is never read under the new one; the old keys expire on
/// their TTL.
fn fingerprint(policy: &Policy) -> u32 {
    // The representation: the fast path keeps a string, the general script a hash.
    let representation: u64 = if whole_gcra(policy) { 0x5354_5249_4e47 } else { 0x4841_5348 };
    let h = (meaning(policy) ^ representation).wrapping_mul(0x0100_0000_01b3);
    #[allow(clippy::cast_possible_truncation)] // folding 64 bits into 32 on purpose
    let folded = (h ^ (h >> 32)) as u32;
    folded
}

/// The parts of a policy's state keys around the key itself:
/// `{prefix}{{policy}|` and `}:{fingerprint}`. Everything that identifies the limit is inside
/// the hash tag, so a policy's tiers (and sliding-log sets) share one Redis Cluster slot.
pub(crate) fn key_parts(prefix: &str, policy: &Policy) -> (String, String) {
    (format!("{prefix}{{{}|", escape(policy.name())), format!("}}:{:08x}", fingerprint(policy)))
}

/// The key of the hash holding every tier's state of `key`, between the parts of
/// [`key_parts`].
pub(crate) fn state_key(parts: &(String, String), key: &Key) -> String {
    let key = key.to_string();
    let key = escape(&key);
    let mut out = String::with_capacity(parts.0.len() + key.len() + parts.1.len());
    out.push_str(&parts.0);
    out.push_str(&key);
    out.push_str(&parts.1);
    out
}

/// The sorted set of tier `i` (1-based) of a sliding-log policy.
fn log_key(state_key: &str, i: usize) -> String {
    format!("{state_key}:z{i}")
}

/// What a bound policy's calls send every time, rendered when it is bound: which script, the
/// policy's part of `ARGV`, and how many sliding-log sets follow the state key.
#[derive(Debug)]
pub(crate) struct Prepared {
    fast: bool,
    /// `ttl_grace_ms, ntiers, (T, tau)*` for the fast path;
    /// `algorithm, ttl_grace_ms, ntiers, (count, period, burst)*` for the general script.
    args: Vec<Vec<u8>>,
    log_sets: usize,
}

impl Prepared {
    pub(crate) fn new(policy: &Policy, grace_ms: u64) -> Self {
        let ntiers = policy.tiers().len();
        let mut args = Vec::new();
        let mut arg = |v: u64| v.write_redis_args(&mut args);
        let fast = whole_gcra(policy);
        if fast {
            arg(grace_ms);
            arg(ntiers as u64);
            for t in policy.tiers() {
                let interval = t.rate.period / t.rate.count;
                arg(interval);
                arg(interval * t.rate.burst);
            }
        } else {
            args.push(policy.algorithm().name().as_bytes().to_vec());
            let mut arg = |v: u64| v.write_redis_args(&mut args);
            arg(grace_ms);
            arg(ntiers as u64);
            for t in policy.tiers() {
                arg(t.rate.count);
                arg(t.rate.period);
                arg(t.rate.burst);
            }
        }
        let log_sets = if policy.algorithm() == Algorithm::SlidingLog { ntiers } else { 0 };
        Self { fast, args, log_sets }
    }
}

/// A script call: `KEYS` and `ARGV` as the script documents them.
pub(crate) struct Call<'a> {
    pub(crate) keys: Vec<String>,
    prepared: &'a Prepared,
    /// `op, clock, now_sec, now_nsec`.
    head: Vec<Vec<u8>>,
    /// The request's own arguments, after the policy's.
    tail: Vec<Vec<u8>>,
}

impl<'a> Call<'a> {
    /// Starts a call: the state key (and the sliding-log sets), then `op, clock, now_sec,
    /// now_nsec` and the policy's arguments.
    fn new(op: &str, state_key: String, prepared: &'a Prepared, now: Now) -> Self {
        let (flag, secs, nanos) = match now {
            Now::Server => ("S", 0, 0),
            Now::At(t) => ("C", t / NANOS_PER_SEC, t % NANOS_PER_SEC),
        };
        let mut keys = Vec::with_capacity(1 + prepared.log_sets);
        keys.extend((1..=prepared.log_sets).map(|i| log_key(&state_key, i)));
        keys.insert(0, state_key);
        let mut head = Vec::with_capacity(4);
        head.push(op.as_bytes().to_vec());
        head.push(flag.as_bytes().to_vec());
        secs.write_redis_args(&mut head);
        nanos.write_redis_args(&mut head);
        Self { keys, prepared, head, tail: Vec::with_capacity(2 + 3 * prepared.log_sets) }
    }

    fn arg(&mut self, v: impl redis::ToRedisArgs) -> &mut Self {
        v.write_redis_args(&mut self.tail);
        self
    }

    /// Decides `cost` units; `max_delay` `None` polices, `Some` shapes (clamped to
    /// [`MAX_HORIZON_NANOS`]).
    pub(crate) fn check(
        state_key: String,
        prepared: &'a Prepared,
        now: Now,
        cost: u64,
        max_delay: Option<Duration>,
    ) -> Self {
        let mut call = Self::new("check", state_key, prepared, now);
        let max_delay = max_delay.map_or(-1, |d| {
            i64::try_from(duration_to_nanos(d).min(MAX_HORIZON_NANOS)).unwrap_or(-1)
        });
        call.arg(cost).arg(max_delay);
        call
    }

    /// Settles a charge of `charged` units (`charges` per tier) at `cost` units:
    /// `old_cost, new_cost, (at_sec, at_nsec, id)*`.
    pub(crate) fn settle(
        state_key: String,
        prepared: &'a Prepared,
        now: Now,
        charged: u64,
        charges: &Charges,
        cost: u64,
    ) -> Self {
        let mut call = Self::new("settle", state_key, prepared, now);
        call.arg(charged).arg(cost);
        if prepared.fast {
            // Every tier was charged at the same instant.
            let at = charges.first().map_or(0, |c| c.at);
            call.arg(at / NANOS_PER_SEC).arg(at % NANOS_PER_SEC);
            return call;
        }
        for c in charges {
            call.arg(c.at / NANOS_PER_SEC).arg(c.at % NANOS_PER_SEC).arg(c.id);
        }
        call
    }

    /// The script invocation.
    pub(crate) fn invocation(&self) -> ScriptInvocation<'static> {
        let script = if self.prepared.fast { &*super::FAST } else { &*super::SCRIPT };
        let mut inv = script.prepare_invoke();
        for k in &self.keys {
            inv.key(k.as_str());
        }
        for a in self.head.iter().chain(&self.prepared.args).chain(&self.tail) {
            inv.arg(a.as_slice());
        }
        inv
    }

    /// `ARGV` as sent (tests).
    #[cfg(test)]
    fn args(&self) -> Vec<String> {
        self.head
            .iter()
            .chain(&self.prepared.args)
            .chain(&self.tail)
            .map(|a| String::from_utf8(a.clone()).unwrap())
            .collect()
    }
}

/// Reply layout: `outcome (1 allowed, 0 limited, 2 cost above capacity), delay, retry, now_sec,
/// now_nsec`, then per tier `remaining, reset, own retry (-1 none), violated, at_sec, at_nsec,
/// id`. Durations in nanoseconds.
const HEAD: usize = 5;
const PER_TIER: usize = 7;

fn bad_reply(what: &str) -> StoreError {
    StoreError::backend(format!("unexpected reply from the tollgate script: {what}"))
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
        let k = state_key(&key_parts("tollgate:", &p), &Key::text("a}b{c|d%"));
        let fp = format!("{:08x}", fingerprint(&p));
        assert_eq!(k, format!("tollgate:{{api|s8:a%7Db%7Bc%7Cd%25}}:{fp}"));
        // The hash tag is everything between the first `{` and the first `}` after it.
        let tag = &k[k.find('{').unwrap() + 1..k.find('}').unwrap()];
        assert_eq!(tag, "api|s8:a%7Db%7Bc%7Cd%25");
        // `|` in a policy name cannot be confused with the separator.
        let a = state_key(&key_parts("", &policy("a|b", Algorithm::Gcra)), &Key::text("c"));
        let b = state_key(&key_parts("", &policy("a", Algorithm::Gcra)), &Key::text("b|s1:c"));
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
        let key = |p: &Policy| state_key(&key_parts("", p), &Key::Global);
        let keys: Vec<_> = [&a, &b, &c].into_iter().map(key).collect();
        assert_ne!(keys[0], keys[1]);
        assert_ne!(keys[0], keys[2]);
        assert_eq!(key(&a), keys[0], "stable");
    }

    #[test]
    fn sliding_log_calls_carry_one_set_per_tier_after_the_hash() {
        let p = policy("api", Algorithm::SlidingLog);
        let prepared = Prepared::new(&p, 0);
        let call = Call::check("h".into(), &prepared, Now::At(1_500_000_000), 2, None);
        assert_eq!(call.keys, ["h", "h:z1", "h:z2"]);
        assert_eq!(
            call.args(),
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
        assert!(matches!(validate(&long), Err(ConfigError::UnsupportedByStore { .. })));
        let wide = Policy::single("p", Quota::per_day(1).with_burst(14)).unwrap();
        assert!(matches!(validate(&wide), Err(ConfigError::UnsupportedByStore { .. })));
        let fine = Policy::single("p", Quota::per_day(1).with_burst(13)).unwrap();
        assert_eq!(validate(&fine), Ok(()));
        let tiny = Policy::builder("p")
            .algorithm(Algorithm::FixedWindow)
            .tier("t", Quota::new(1, Duration::from_micros(100)))
            .build()
            .unwrap();
        assert!(matches!(validate(&tiny), Err(ConfigError::UnsupportedByStore { .. })));
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
