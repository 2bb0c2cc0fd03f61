//! What a call sends: a batch's header, each policy's part ([`PolicyArgs`], [`Prepared`])
//! and each check's record, packed as little-endian doubles.

use super::*;

/// Which instant the script decides at.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Now {
    /// The Redis server's `TIME`.
    Server,
    /// This instant of the store's injected clock, in nanoseconds.
    At(u64),
}

/// The header of a batch: `ARGV[1]`.
pub(crate) fn header(now: Now) -> Vec<u8> {
    let (flag, t) = match now {
        Now::Server => (0.0, 0),
        Now::At(t) => (1.0, t),
    };
    doubles(&[flag, (t / NANOS_PER_SEC) as f64, (t % NANOS_PER_SEC) as f64])
}

pub(super) fn doubles(values: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 * values.len());
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// An integer below 2^53 as a double (exact); larger values never reach here.
#[allow(clippy::cast_precision_loss)] // every value sent is below 2^53
pub(super) fn f(v: u64) -> f64 {
    v as f64
}

/// A policy's part of a batch (`ARGV[2]`): `unit, grace, algorithm, tiers` and each tier's
/// parameters, sent once per batch however many of its checks the batch holds.
#[derive(Debug)]
pub(crate) struct PolicyArgs {
    /// Unique per binding: a batch sends each policy once.
    pub(crate) id: u64,
    pub(crate) args: Vec<f64>,
}

/// What a bound policy's checks send, rendered when it is bound.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub(crate) family: Family,
    pub(crate) policy: Arc<PolicyArgs>,
    /// Sliding-log sets after the state key (one per rate tier).
    pub(super) log_sets: usize,
    /// Tiers.
    pub(super) ntiers: usize,
    /// Nanoseconds per unit.
    pub(crate) unit: u64,
    /// For a policy that is not plain: the slot sets after the log sets (one per concurrency
    /// tier), then the penalty boxes, and the calendar tiers, whose window bounds each record
    /// carries.
    pub(super) kinds: Option<Kinds>,
}

/// What records of a policy of several kinds need.
#[derive(Debug)]
pub(super) struct Kinds {
    /// Concurrency tiers.
    pub(super) conc: usize,
    /// The names of the slot sets and penalty boxes after a key's name: `:c:{tier}` per
    /// concurrency tier, then `:p:{tier}` per tier with a box (see [`Prepared::keys`]).
    pub(super) named: Vec<String>,
    /// The calendar tiers' windows, in tier order.
    pub(super) calendars: Vec<Arc<CalendarSpec>>,
    /// The kind of each tier: 0 rate, 1 concurrency, 2 calendar.
    pub(super) tags: Vec<u8>,
    /// The latest instant (nanoseconds; 0: none) at which a script found a key deciding that
    /// the windows sent did not cover: the bounds reach it while it lies ahead (see
    /// `lua/cover.lua`).
    pub(super) cover: AtomicU64,
}

impl Prepared {
    pub(crate) fn new(policy: &Policy, grace_ms: u64) -> Self {
        static IDS: AtomicU64 = AtomicU64::new(1);
        let family = family(policy);
        let ntiers = policy.tiers().len();
        let alg = match policy.algorithm() {
            Algorithm::Gcra => 0,
            Algorithm::TokenBucket => 1,
            Algorithm::LeakyBucket => 2,
            Algorithm::FixedWindow => 3,
            Algorithm::SlidingCounter => 4,
            Algorithm::SlidingLog => 5,
        };
        let mut args = vec![f(policy.unit()), f(grace_ms), f(alg), f(ntiers as u64)];
        if family != Family::Gcra {
            args.push(f(u64::from(policy.is_plain())));
        }
        let mut kinds = Kinds {
            conc: 0,
            named: Vec::new(),
            calendars: Vec::new(),
            tags: Vec::new(),
            cover: AtomicU64::new(0),
        };
        for t in policy.tiers() {
            let r = t.rate;
            if family != Family::Gcra {
                match &t.kind {
                    Kind::Rate => args.extend([0.0, f(r.count), f(r.period), f(r.burst)]),
                    Kind::Concurrency(s) => {
                        kinds.conc += 1;
                        kinds.named.push(format!(":c:{}", escape(t.name())));
                        args.extend([1.0, f(s.max), f(s.ttl_ms), 0.0]);
                    }
                    Kind::Calendar(spec) => {
                        kinds.calendars.push(Arc::clone(spec));
                        args.extend([2.0, f(r.count), 0.0, 0.0]);
                    }
                }
                match t.penalty {
                    Some(b) => args.extend([f(b.block), f(b.refusals), f(b.within)]),
                    None => args.extend([0.0; 3]),
                }
                let r = t.reserve.unwrap_or_default();
                args.extend([f(r.critical_units()), f(r.standard_units())]);
                kinds.tags.push(match t.kind {
                    Kind::Rate => 0,
                    Kind::Concurrency(_) => 1,
                    Kind::Calendar(_) => 2,
                });
            } else {
                let interval = r.period / r.count;
                args.extend([f(interval), f(interval * r.burst)]);
            }
        }
        let boxed = policy.tiers().iter().filter(|t| t.penalty.is_some());
        kinds.named.extend(boxed.map(|t| format!(":p:{}", escape(t.name()))));
        let id = IDS.fetch_add(1, Ordering::Relaxed);
        let rates = policy.tiers().iter().filter(|t| t.kind == Kind::Rate).count();
        let log_sets = if family == Family::Log { rates } else { 0 };
        Self {
            family,
            policy: Arc::new(PolicyArgs { id, args }),
            log_sets,
            ntiers,
            unit: policy.unit(),
            kinds: (!policy.is_plain()).then_some(kinds),
        }
    }

    /// The keys of a check on `state_key`: it, then the sliding-log sets (`{state_key}:z1`,
    /// ...), then the slot sets and the penalty boxes. Those two hold state a reload keeps
    /// (see `MemoryStore::rebind_policy`): they are named by the policy, the key and the tier
    /// (`{prefix}{{policy}|{key}}:c:{tier}`, `...:p:{tier}`), not by the policy's fingerprint,
    /// so every definition of a policy of that name finds them.
    pub(crate) fn keys(&self, state_key: String) -> Vec<String> {
        let named = self.kinds.as_ref().map_or(&[][..], |k| &k.named[..]);
        let mut keys = Vec::with_capacity(1 + self.log_sets + named.len());
        keys.push(String::new());
        keys.extend((1..=self.log_sets).map(|i| format!("{state_key}:z{i}")));
        // The state key less its `:{fingerprint}` (`key_parts`).
        let base = state_key.get(..state_key.len().saturating_sub(9)).unwrap_or_default();
        keys.extend(named.iter().map(|n| format!("{base}{n}")));
        keys[0] = state_key;
        keys
    }

    /// Whether the policy is not plain (its checks give a cost per tier, it may hold slots).
    pub(crate) fn is_kinds(&self) -> bool {
        self.kinds.is_some()
    }

    /// The calendar bounds of a record made at `now` (nanoseconds of this process's clock),
    /// through `lookahead` - 1 windows after the one holding `now + margin`. A policed check
    /// leaves now or not at all, so it needs no lookahead: it sends one or two windows.
    pub(super) fn bounds(&self, record: &mut Vec<f64>, now: u64, lookahead: usize) {
        let Some(kinds) = &self.kinds else { return };
        let until = kinds.cover.load(Ordering::Relaxed);
        for spec in &kinds.calendars {
            let b = calendar::bounds(spec, now, until, CALENDAR_MARGIN_SECS, lookahead);
            record.push(f(b.len() as u64));
            #[allow(clippy::cast_precision_loss)] // seconds since the epoch, below 2^53
            record.extend(b.iter().map(|s| *s as f64));
        }
    }

    /// Whether the policy has calendar tiers, whose records carry window bounds.
    pub(crate) fn has_calendars(&self) -> bool {
        self.kinds.as_ref().is_some_and(|k| !k.calendars.is_empty())
    }

    /// `record` (a check or settlement of [`check`](Self::check) or
    /// [`settle`](Self::settle)) with its calendar bounds made again at `now`, to
    /// reach `need` (nanoseconds: a key's instant a script asked for) and any later record's;
    /// `None` for another record.
    pub(crate) fn rebound(&self, record: &[f64], now: u64, need: u64) -> Option<Vec<f64>> {
        let kinds = self.kinds.as_ref()?;
        kinds.cover.fetch_max(need, Ordering::Relaxed);
        let n = self.ntiers;
        let op = *record.first()?;
        let (start, lookahead) = if op == 1.0 {
            (7 + n, if *record.get(4)? >= 0.0 { LOOKAHEAD } else { 1 })
        } else if op == 2.0 {
            (5 + 5 * n, LOOKAHEAD)
        } else {
            return None;
        };
        let mut end = start;
        for _ in &kinds.calendars {
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // a count we wrote
            let count = *record.get(end)? as usize;
            end += 1 + count;
        }
        let mut out = record.get(..start)?.to_vec();
        self.bounds(&mut out, now, lookahead);
        out.extend_from_slice(record.get(end..)?);
        out[3] = f(out.len() as u64);
        Some(out)
    }

    /// A check: `costs` per tier (resolved: a plain policy's are all the check's cost),
    /// `max_delay` `None` polices and `Some` shapes (clamped to the longest span), the holder
    /// id of its slots (0 for none), the request's class, and `now` (this process's clock, for
    /// the calendar bounds). The key and policy indices (the second and third numbers) are set
    /// when the batch is assembled. `gcra.lua` reads `op, key, policy, cost, budget`; the
    /// other scripts `op, key, policy, length, budget, holder, costs.., class, bounds..`.
    pub(crate) fn check(
        &self,
        costs: &[u64],
        max_delay: Option<Duration>,
        holder: u64,
        class: Priority,
        now: u64,
    ) -> Vec<f64> {
        let budget =
            max_delay.map_or(-1.0, |d| f((duration_to_nanos(d) / self.unit).min(MAX_SPAN_UNITS)));
        if self.family == Family::Gcra {
            return vec![1.0, 0.0, 0.0, f(costs.first().copied().unwrap_or(0)), budget];
        }
        let mut record = Vec::with_capacity(7 + self.ntiers);
        record.extend([1.0, 0.0, 0.0, 0.0, budget, f(holder)]);
        record.extend(costs.iter().map(|c| f(*c)));
        record.push(f(class.index()));
        self.bounds(&mut record, now, if max_delay.is_some() { LOOKAHEAD } else { 1 });
        record[3] = f(record.len() as u64);
        record
    }

    /// A settlement: per tier its charge (instant and entry id in `charges`), settled from
    /// `old(i)` units to `new(i)`, the slots given back with `release`; `now` as for
    /// [`check`](Self::check). `gcra.lua` reads per tier the same five numbers after op, key
    /// and policy; the other scripts also a length and `release` before them, and the
    /// calendar tiers' bounds and windows after.
    pub(crate) fn settle(
        &self,
        charges: &Charges,
        old: impl Fn(usize) -> u64,
        new: impl Fn(usize) -> u64,
        release: bool,
        now: u64,
    ) -> Vec<f64> {
        let per_sec = NANOS_PER_SEC / self.unit;
        let mut record = Vec::with_capacity(5 + 5 * self.ntiers);
        if self.family == Family::Gcra {
            record.extend([2.0, 0.0, 0.0]);
        } else {
            record.extend([2.0, 0.0, 0.0, 0.0, f(u64::from(release))]);
        }
        for (i, c) in charges.iter().enumerate() {
            record.extend([f(old(i)), f(new(i)), f(c.at / per_sec), f(c.at % per_sec), f(c.id)]);
        }
        if self.family == Family::Gcra {
            return record;
        }
        // The whole lookahead: a charge grown after a step back of the server's clock goes to
        // the window holding the key's later now, which may lie in it.
        self.bounds(&mut record, now, LOOKAHEAD);
        // The window holding each calendar tier's charge: a tier that cost nothing when the
        // request was decided did not hold its departure to the lookahead, and what it is
        // charged now belongs to the window the request left in, wherever that is.
        if let Some(kinds) = &self.kinds {
            let at = kinds.tags.iter().zip(charges).filter(|(t, _)| **t == 2).map(|(_, c)| c.at);
            for (spec, at) in kinds.calendars.iter().zip(at) {
                let (start, end) = calendar::window_at(spec, at.saturating_mul(self.unit));
                #[allow(clippy::cast_precision_loss)] // seconds since the epoch, below 2^53
                record.extend([start as f64, end as f64]);
            }
        }
        record[3] = f(record.len() as u64);
        record
    }

    /// A refresh of the slots `holder` holds: those of each concurrency tier, from the
    /// charges.
    pub(crate) fn refresh(&self, charges: &Charges, holder: u64) -> Vec<f64> {
        let tags = self.kinds.as_ref().map_or(&[][..], |k| &k.tags[..]);
        let mut record = vec![4.0, 0.0, 0.0, 0.0, f(holder)];
        record.extend(tags.iter().zip(charges).filter(|(t, _)| **t == 1).map(|(_, c)| f(c.cost)));
        record[3] = f(record.len() as u64);
        record
    }

    /// The numbers a refresh adds to the reply: one per concurrency tier.
    pub(crate) fn refresh_reply_len(&self) -> usize {
        self.kinds.as_ref().map_or(0, |k| k.conc)
    }

    /// A lease: at least `cost` units and at most `block` (Redis grants at most a quarter of
    /// what the key has left beyond `cost`, or up to `useful` of it when that is more), after
    /// settling the previous block `rest` at what was spent of it. With `useful` above 0 the
    /// reply also says when `useful` units will be there again.
    pub(crate) fn lease(
        &self,
        cost: u64,
        block: u64,
        useful: u64,
        rest: Option<&Rest>,
    ) -> Vec<f64> {
        let per_sec = NANOS_PER_SEC / self.unit;
        if self.family == Family::Gcra {
            let mut record = Vec::with_capacity(8 + 3 * self.ntiers);
            record.extend([3.0, 0.0, 0.0, f(cost), f(block), f(useful)]);
            match rest {
                Some(rest) => {
                    record.extend([f(rest.granted), f(rest.spent)]);
                    for c in &rest.charges {
                        record.extend([f(c.at / per_sec), f(c.at % per_sec), f(c.id)]);
                    }
                }
                None => record.extend(std::iter::repeat_n(0.0, 2 + 3 * self.ntiers)),
            }
            return record;
        }
        // `kinds.lua`: op, key, policy, length, then the lease, then per tier the previous
        // lease's settlement as a settlement's (old and new cost, instant, entry id).
        let mut record = Vec::with_capacity(7 + 5 * self.ntiers);
        record.extend([3.0, 0.0, 0.0, f(7 + 5 * self.ntiers as u64), f(cost), f(block), f(useful)]);
        match rest {
            Some(rest) => {
                for c in &rest.charges {
                    record.extend([
                        f(rest.granted),
                        f(rest.spent),
                        f(c.at / per_sec),
                        f(c.at % per_sec),
                        f(c.id),
                    ]);
                }
            }
            None => record.extend(std::iter::repeat_n(0.0, 5 * self.ntiers)),
        }
        record
    }

    /// A lease of the key's schedule (GCRA of whole units only, `lua/gcra.lua`): as
    /// [`lease`](Self::lease), but when the key has less than `useful` units now, Redis
    /// grants `useful` units (at most `block`) of those that come next, as long as the last
    /// of them conforms within `horizon` units of now; the reply's wait is then until a
    /// useful block fits the horizon again.
    pub(crate) fn lease_ahead(
        &self,
        cost: u64,
        block: u64,
        useful: u64,
        rest: Option<&Rest>,
        horizon: u64,
    ) -> Vec<f64> {
        debug_assert_eq!(self.family, Family::Gcra);
        let mut record = self.lease(cost, block, useful, rest);
        record[0] = 4.0;
        record.push(f(horizon.min(MAX_SPAN_UNITS)));
        record
    }

    /// The numbers a lease adds to the reply: a check's, then the units granted and when a
    /// useful block will be there again (in the policy's time units from the unit `now` falls
    /// in; 0 for now).
    pub(crate) fn lease_reply_len(&self) -> usize {
        self.check_reply_len() + 2
    }

    /// The policy's time unit, in nanoseconds.
    pub(crate) fn unit(&self) -> u64 {
        self.unit
    }

    /// The numbers a check adds to the reply.
    pub(crate) fn check_reply_len(&self) -> usize {
        HEAD + PER_TIER * self.ntiers
    }
}

/// The batch's `ARGV[2]` (its policies) and `ARGV[3]` (its checks), given each check's key
/// index (1-based, into `KEYS`), policy and record.
pub(crate) fn batch<'a>(
    checks: impl Iterator<Item = (usize, &'a PolicyArgs, &'a [f64])>,
) -> (Vec<u8>, Vec<u8>) {
    let mut ids: Vec<u64> = Vec::new();
    let mut policies = Vec::new();
    let mut records = Vec::new();
    for (key, policy, record) in checks {
        let index = match ids.iter().position(|id| *id == policy.id) {
            Some(i) => i + 1,
            None => {
                ids.push(policy.id);
                for v in &policy.args {
                    policies.extend_from_slice(&v.to_le_bytes());
                }
                ids.len()
            }
        };
        for (i, v) in record.iter().enumerate() {
            let v = match i {
                1 => f(key as u64),
                2 => f(index as u64),
                _ => *v,
            };
            records.extend_from_slice(&v.to_le_bytes());
        }
    }
    (policies, records)
}
