//! The seam matrix's harness (tests/all/seams.rs): random policies over the features that can
//! meet, random traces over them, and a runner that drives a store through the public API
//! (`Store::check`, `settle`, `settle_tiers`, `release`, `Limiter::rebind`) on a fake clock,
//! checking each decision against the reference model ([`super::seams_model`]) and the promises
//! of each feature ([`super::seams_bounds`]) as it goes.
//!
//! A **seam** is a set of features met in one policy and its trace, named by labels:
//!
//! | labels | what |
//! |---|---|
//! | `gcra`, `window` | a rate tier counting requests (the policy runs GCRA, or fixed windows) |
//! | `calendar` | a calendar tier (UTC minutes or hours) |
//! | `concurrency` | a concurrency tier |
//! | `bytes` | a rate tier counting request bytes (costs known at admission) |
//! | `reported` | a rate tier counting reported units (one at admission, settled later) |
//! | `penalty` | a penalty box on a rate or calendar tier |
//! | `reserve` | reserved capacity on the GCRA requests tier, and requests of all three classes |
//! | `shape` | shaped checks beside policed ones |
//! | `hold` | tickets kept and their slots released later |
//! | `refund` | tickets cancelled (every charge given back) |
//! | `settle` | tickets settled per tier (`settle_tiers`), more or less than charged |
//! | `reload` | the policy rebound mid-trace (`Limiter::rebind`, the same definition) |
//! | `back` | the clock stepping back |
#![allow(dead_code, unreachable_pub)]

use std::fmt;
use std::time::Duration;

use proptest::prelude::*;
use tollgate::clock::FakeClock;
use tollgate::key::Key;
use tollgate::store::{Check, Store};
use tollgate::{
    Algorithm, Calendar, CalendarPeriod, Concurrency, Decision, Limiter, Outcome, Penalty, Policy,
    Priority, Quota, Reserve, Unit,
};

use super::seams_bounds::{Event, Log};
use super::seams_model::{Charged, Model};

pub const MS: u64 = 1_000_000;
pub const S: u64 = 1_000_000_000;

/// One tier of a seam's policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TierChoice {
    /// `count` requests per `period_ms`, a burst of `count * burst_x / 2` (at least 1; windows:
    /// `count`).
    Requests { count: u64, period_ms: u64, burst_x: u64 },
    /// `count` per UTC minute, or hour.
    Calendar { count: u64, hour: bool },
    /// `max` in flight (slots live a day: the traces never outlive them, so the stores agree).
    Concurrency { max: u64 },
    /// `count` request bytes per `period_ms`.
    Bytes { count: u64, period_ms: u64 },
    /// `count` reported units per `period_ms`.
    Reported { count: u64, period_ms: u64 },
    /// `count` request messages per `period_ms` (one per check; a stream's grants are
    /// checks of that tier alone).
    Messages { count: u64, period_ms: u64 },
}

/// Which kinds of steps a trace takes, beside policed checks and ticks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Mix {
    pub shape: bool,
    pub hold: bool,
    pub refund: bool,
    pub settle: bool,
    pub reload: bool,
    pub back: bool,
}

impl Mix {
    /// The switch of the step kind `label` names (`shape`, `hold`, `refund`, `settle`,
    /// `reload`, `back`); `None` for another label.
    fn switch(&mut self, label: &str) -> Option<&mut bool> {
        Some(match label {
            "shape" => &mut self.shape,
            "hold" => &mut self.hold,
            "refund" => &mut self.refund,
            "settle" => &mut self.settle,
            "reload" => &mut self.reload,
            "back" => &mut self.back,
            _ => return None,
        })
    }
}

/// A seam: a policy of the features that meet, and the steps its traces take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// GCRA or fixed windows for every rate tier.
    pub window: bool,
    pub tiers: Vec<TierChoice>,
    /// On tier `.0`: a block after `.1` breaches within `.3` ms, lasting `.2` ms.
    pub penalty: Option<(usize, u32, u64, u64)>,
    /// On tier `.0` (a GCRA requests tier): `.1` units for critical requests, `.2` more for
    /// standard ones.
    pub reserve: Option<(usize, u64, u64)>,
    pub mix: Mix,
}

impl Config {
    /// The policy, named `seam`; tiers `t0`, `t1`, ...
    pub fn policy(&self) -> Policy {
        let mut b = Policy::builder("seam").algorithm(if self.window {
            Algorithm::FixedWindow
        } else {
            Algorithm::Gcra
        });
        for (i, t) in self.tiers.iter().enumerate() {
            let name = format!("t{i}");
            let ms = Duration::from_millis;
            b = match *t {
                TierChoice::Requests { count, period_ms, burst_x } => {
                    let q = Quota::new(count, ms(period_ms));
                    let burst = if self.window { count } else { (count * burst_x / 2).max(1) };
                    b.tier(name, q.with_burst(burst))
                }
                TierChoice::Calendar { count, hour } => {
                    let p = if hour { CalendarPeriod::Hour } else { CalendarPeriod::Minute };
                    b.calendar(name, Calendar::new(count, p))
                }
                TierChoice::Concurrency { max } => {
                    b.concurrency(name, Concurrency::new(max).with_ttl(Duration::from_secs(86_400)))
                }
                TierChoice::Bytes { count, period_ms } => {
                    b.tier(name, Quota::new(count, ms(period_ms)).counting(Unit::RequestBytes))
                }
                TierChoice::Reported { count, period_ms } => {
                    b.tier(name, Quota::new(count, ms(period_ms)).counting(Unit::Reported))
                }
                TierChoice::Messages { count, period_ms } => {
                    b.tier(name, Quota::new(count, ms(period_ms)).counting(Unit::RequestMessages))
                }
            };
        }
        if let Some((i, refusals, block, within)) = self.penalty {
            let p = Penalty::new(Duration::from_millis(block));
            let p = if refusals > 1 { p.after(refusals, Duration::from_millis(within)) } else { p };
            b = b.penalty(format!("t{i}"), p);
        }
        if let Some((i, critical, standard)) = self.reserve {
            b = b.reserve(format!("t{i}"), Reserve::new().critical(critical).standard(standard));
        }
        b.build().expect("a seam's policy builds")
    }

    /// The seam's labels (see the module docs).
    pub fn labels(&self) -> Vec<&'static str> {
        let mut l = Vec::new();
        for t in &self.tiers {
            l.push(match t {
                TierChoice::Requests { .. } if self.window => "window",
                TierChoice::Requests { .. } => "gcra",
                TierChoice::Calendar { .. } => "calendar",
                TierChoice::Concurrency { .. } => "concurrency",
                TierChoice::Bytes { .. } => "bytes",
                TierChoice::Reported { .. } => "reported",
                TierChoice::Messages { .. } => "messages",
            });
        }
        let m = self.mix;
        let features = [
            (self.penalty.is_some(), "penalty"),
            (self.reserve.is_some(), "reserve"),
            (m.shape, "shape"),
            (m.hold, "hold"),
            (m.refund, "refund"),
            (m.settle, "settle"),
            (m.reload, "reload"),
            (m.back, "back"),
        ];
        l.extend(features.iter().filter(|(on, _)| *on).map(|(_, n)| *n));
        // Every tier a rate counting requests: the stores' plain path.
        if self.penalty.is_none()
            && self.reserve.is_none()
            && self.tiers.iter().all(|t| matches!(t, TierChoice::Requests { .. }))
        {
            l.push("plain");
        }
        l.sort_unstable();
        l.dedup();
        l
    }

    /// Whether the seam has every label of `labels`.
    pub fn has(&self, labels: &[&str]) -> bool {
        let mine = self.labels();
        labels.iter().all(|l| mine.contains(l))
    }

    /// The shortest emission interval of the policy's rate tiers (or a second), ns.
    fn short(&self) -> u64 {
        self.tiers
            .iter()
            .filter_map(|t| match *t {
                TierChoice::Requests { count, period_ms, .. } => Some(period_ms * MS / count),
                TierChoice::Bytes { period_ms, .. } => Some(period_ms * MS / 8),
                TierChoice::Reported { count, period_ms }
                | TierChoice::Messages { count, period_ms } => Some(period_ms * MS / count),
                _ => None,
            })
            .min()
            .unwrap_or(S)
    }

    /// The longest period or window of the policy, ns.
    fn long(&self) -> u64 {
        self.tiers
            .iter()
            .map(|t| match *t {
                TierChoice::Requests { period_ms, .. }
                | TierChoice::Bytes { period_ms, .. }
                | TierChoice::Reported { period_ms, .. }
                | TierChoice::Messages { period_ms, .. } => period_ms * MS,
                TierChoice::Calendar { hour: true, .. } => 3_600 * S,
                TierChoice::Calendar { hour: false, .. } => 60 * S,
                TierChoice::Concurrency { .. } => S,
            })
            .max()
            .unwrap_or(S)
            .max(self.penalty.map_or(0, |p| p.2 * MS))
    }

    /// A tick's length in ns.
    pub fn tick(&self, scale: u8, frac: u16) -> u64 {
        let f = u128::from(frac);
        let of = |span: u64| u64::try_from(u128::from(span) * f / 65_535).unwrap();
        match scale % 4 {
            0 => 0,
            1 => of(2 * self.short()),
            2 => of(self.long()),
            _ => of(2 * self.long()),
        }
    }

    /// A shaping budget in ns.
    pub fn budget(&self, frac: u16) -> u64 {
        let span = 3 * self.short().max(self.long() / 4);
        u64::try_from(u128::from(span) * u128::from(frac) / 65_535).unwrap()
    }

    /// The bytes a request carries, from its share of the bytes tier's burst.
    pub fn bytes(&self, frac: u16) -> u64 {
        let count = self.tiers.iter().find_map(|t| match *t {
            TierChoice::Bytes { count, .. } => Some(count),
            _ => None,
        });
        count.map_or(0, |c| c * 5 / 4 * u64::from(frac) / 65_535)
    }
}

/// One step of a trace. Indices of holds count among the tickets held when the step runs.
#[derive(Clone, PartialEq, Eq)]
pub enum Step {
    /// The clock moves forward (see [`Config::tick`]).
    Tick { scale: u8, frac: u16 },
    /// The clock steps back by a share of the longest period.
    Back { frac: u16 },
    /// A check of key `k{key}`: `requests` requests (0: a query), `bytes` as a share of the
    /// bytes tier's burst; shaped within a budget, or policed; its ticket kept, or released at
    /// once.
    Call { key: u8, class: Priority, requests: u64, bytes: u16, shape: Option<u16>, hold: bool },
    /// Settles every rate and calendar tier of a held ticket: tier `i` at `to + i % 2`.
    Settle { hold: usize, to: u64 },
    /// Cancels a held ticket: every charge given back, its slots released.
    Cancel { hold: usize },
    /// Releases a held ticket's slots, keeping its charges.
    Release { hold: usize },
    /// Rebinds the policy (the same definition), as a configuration reload does.
    Reload,
}

impl fmt::Debug for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tick { scale, frac } => write!(f, "Tick({scale}, {frac})"),
            Self::Back { frac } => write!(f, "Back({frac})"),
            Self::Call { key, class, requests, bytes, shape, hold } => {
                write!(f, "Call(k{key}, {class:?}, {requests}, bytes {bytes}")?;
                if let Some(s) = shape {
                    write!(f, ", shape {s}")?;
                }
                if *hold {
                    write!(f, ", hold")?;
                }
                write!(f, ")")
            }
            Self::Settle { hold, to } => write!(f, "Settle(#{hold}, {to})"),
            Self::Cancel { hold } => write!(f, "Cancel(#{hold})"),
            Self::Release { hold } => write!(f, "Release(#{hold})"),
            Self::Reload => write!(f, "Reload"),
        }
    }
}

/// Seams the matrix draws from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    /// Every tier kind and feature (memory, and Redis in exact mode).
    All,
    /// What lease mode takes (`Lease`: rate and calendar tiers counting requests; no
    /// penalty, reserve nor concurrency): the traces police, shape, refund and reload.
    Lease,
}

fn requests_tier(window: bool) -> impl Strategy<Value = TierChoice> {
    (
        prop::sample::select(vec![2u64, 3, 5, 8]),
        prop::sample::select(vec![1_000u64, 10_000, 60_000]),
    )
        .prop_flat_map(move |(count, period_ms)| {
            let burst = if window {
                Just(2u64).boxed()
            } else {
                prop::sample::select(vec![1u64, 2, 4]).boxed()
            };
            burst.prop_map(move |burst_x| TierChoice::Requests { count, period_ms, burst_x })
        })
}

fn tier(window: bool, space: Space) -> BoxedStrategy<TierChoice> {
    let calendar = (prop::sample::select(vec![3u64, 6, 10]), any::<bool>())
        .prop_map(|(count, hour)| TierChoice::Calendar { count, hour });
    if space == Space::Lease {
        return prop_oneof![3 => requests_tier(window), 1 => calendar].boxed();
    }
    prop_oneof![
        3 => requests_tier(window),
        1 => calendar,
        1 => (1u64..=3).prop_map(|max| TierChoice::Concurrency { max }),
        1 => prop::sample::select(vec![1_000u64, 4_000])
            .prop_map(|count| TierChoice::Bytes { count, period_ms: 1_000 }),
        1 => (prop::sample::select(vec![10u64, 30]), prop::sample::select(vec![10_000u64, 60_000]))
            .prop_map(|(count, period_ms)| TierChoice::Reported { count, period_ms }),
        1 => prop::sample::select(vec![4u64, 16])
            .prop_map(|count| TierChoice::Messages { count, period_ms: 1_000 }),
    ]
    .boxed()
}

/// Seams of `space`: one to three tiers, a penalty and a reserve where they can go, and the
/// steps the traces take.
pub fn config(space: Space) -> impl Strategy<Value = Config> {
    let lease = space == Space::Lease;
    any::<bool>()
        .prop_flat_map(move |window| {
            let tiers = prop::collection::vec(tier(window, space), 1..=3);
            let mix = (any::<[bool; 6]>()).prop_map(move |f| Mix {
                shape: f[0],
                hold: f[1] && !lease,
                refund: f[2],
                settle: f[3] && !lease,
                reload: f[4],
                back: f[5] && !lease,
            });
            let penalty = (any::<bool>(), any::<prop::sample::Index>(), 1u32..=3).prop_flat_map(
                |(on, at, refusals)| {
                    (
                        Just((on, at, refusals)),
                        prop::sample::select(vec![500u64, 5_000, 60_000, 600_000]),
                        prop::sample::select(vec![1_000u64, 10_000, 60_000]),
                    )
                },
            );
            let reserve =
                (any::<bool>(), any::<prop::sample::Index>(), any::<prop::sample::Index>());
            (Just(window), tiers, mix, penalty, reserve)
        })
        .prop_map(move |(window, tiers, mix, ((on, at, refusals), block, within), reserve)| {
            let penalized: Vec<usize> = (0..tiers.len())
                .filter(|&i| !matches!(tiers[i], TierChoice::Concurrency { .. }))
                .collect();
            let penalty = (on && !lease && !penalized.is_empty())
                .then(|| (penalized[at.index(penalized.len())], refusals, block, within));
            let reservable: Vec<(usize, u64)> = tiers
                .iter()
                .enumerate()
                .filter_map(|(i, t)| match *t {
                    TierChoice::Requests { count, burst_x, .. } if !window => {
                        Some((i, (count * burst_x / 2).max(1)))
                    }
                    _ => None,
                })
                .filter(|(_, burst)| *burst >= 3)
                .collect();
            let (r_on, r_at, r_split) = reserve;
            let reserve = (r_on && !lease && !reservable.is_empty()).then(|| {
                let (i, burst) = reservable[r_at.index(reservable.len())];
                // critical >= 1 and critical + standard < burst.
                let critical = 1 + r_split.index(usize::try_from(burst - 2).unwrap()) as u64;
                let standard = (burst - 1 - critical) / 2;
                (i, critical, standard)
            });
            Config { window, tiers, penalty, reserve, mix }
        })
}

/// `c` made to have every label of `labels` (a known seam's own test draws only seams that
/// have its labels): the steps' labels switched on, a tier of each kind added (or the first
/// replaced, past three tiers), a penalty put on the first rate or calendar tier, a reserve on
/// a GCRA requests tier (the policy made GCRA).
pub fn require(mut c: Config, labels: &[&str]) -> Config {
    let add = |c: &mut Config, t: TierChoice| {
        if c.tiers.len() < 3 {
            c.tiers.push(t);
        } else {
            c.tiers[2] = t;
        }
    };
    for label in labels {
        if let Some(on) = c.mix.switch(label) {
            *on = true;
        }
    }
    let kind = |c: &Config, f: fn(&TierChoice) -> bool| c.tiers.iter().any(f);
    if labels.contains(&"plain") {
        c.tiers.retain(|t| matches!(t, TierChoice::Requests { .. }));
        if c.tiers.is_empty() {
            c.tiers.push(TierChoice::Requests { count: 5, period_ms: 10_000, burst_x: 2 });
        }
        c.penalty = None;
        c.reserve = None;
        return c;
    }
    if labels.contains(&"window") {
        c.window = true;
        c.reserve = None;
    }
    if labels.contains(&"gcra") || labels.contains(&"reserve") {
        c.window = false;
    }
    let requests = |t: &TierChoice| matches!(t, TierChoice::Requests { .. });
    if (labels.contains(&"gcra") || labels.contains(&"window")) && !kind(&c, requests) {
        add(&mut c, TierChoice::Requests { count: 5, period_ms: 10_000, burst_x: 2 });
    }
    type Is = fn(&TierChoice) -> bool;
    let pairs: [(&str, Is, TierChoice); 5] = [
        (
            "calendar",
            |t| matches!(t, TierChoice::Calendar { .. }),
            TierChoice::Calendar { count: 6, hour: false },
        ),
        (
            "concurrency",
            |t| matches!(t, TierChoice::Concurrency { .. }),
            TierChoice::Concurrency { max: 2 },
        ),
        (
            "bytes",
            |t| matches!(t, TierChoice::Bytes { .. }),
            TierChoice::Bytes { count: 1_000, period_ms: 1_000 },
        ),
        (
            "reported",
            |t| matches!(t, TierChoice::Reported { .. }),
            TierChoice::Reported { count: 10, period_ms: 10_000 },
        ),
        (
            "messages",
            |t| matches!(t, TierChoice::Messages { .. }),
            TierChoice::Messages { count: 4, period_ms: 1_000 },
        ),
    ];
    for (label, is, t) in pairs {
        if labels.contains(&label) && !kind(&c, is) {
            add(&mut c, t);
        }
    }
    if labels.contains(&"reserve") && c.reserve.is_none() {
        // The first tier: a GCRA requests tier of burst 10, 2 kept for critical, 3 more for
        // standard requests.
        c.tiers[0] = TierChoice::Requests { count: 5, period_ms: 10_000, burst_x: 4 };
        c.reserve = Some((0, 2, 3));
    }
    if let Some((i, ..)) = c.reserve {
        if !matches!(c.tiers[i], TierChoice::Requests { .. }) {
            c.reserve = None;
        }
    }
    if labels.contains(&"penalty") && c.penalty.is_none() {
        let at = c.tiers.iter().position(|t| !matches!(t, TierChoice::Concurrency { .. }));
        let at = at.unwrap_or_else(|| {
            c.tiers[0] = TierChoice::Requests { count: 5, period_ms: 10_000, burst_x: 2 };
            0
        });
        c.penalty = Some((at, 1, 60_000, 10_000));
    }
    if let Some((i, ..)) = c.penalty {
        if matches!(c.tiers[i], TierChoice::Concurrency { .. }) {
            c.penalty = None;
        }
    }
    c
}

/// Steps of a trace of `config`.
pub fn step(config: &Config) -> BoxedStrategy<Step> {
    let m = config.mix;
    let classes = config.reserve.is_some();
    let call = (
        0u8..2,
        prop::sample::select(if classes {
            vec![Priority::Critical, Priority::Standard, Priority::Standard, Priority::Sheddable]
        } else {
            vec![Priority::Standard]
        }),
        prop_oneof![8 => Just(1u64), 1 => Just(0u64), 2 => 2u64..=4, 1 => 5u64..=20],
        any::<u16>(),
        if m.shape { prop::option::of(any::<u16>()).boxed() } else { Just(None).boxed() },
        if m.hold || m.refund || m.settle { any::<bool>().boxed() } else { Just(false).boxed() },
    )
        .prop_map(|(key, class, requests, bytes, shape, hold)| Step::Call {
            key,
            class,
            requests,
            bytes,
            shape,
            hold,
        });
    let scale = prop_oneof![3 => Just(0u8), 4 => Just(1u8), 2 => Just(2u8), 1 => Just(3u8)];
    let tick = (scale, any::<u16>()).prop_map(|(scale, frac)| Step::Tick { scale, frac });
    let w = |on: bool, weight: u32| if on { weight } else { 0 };
    prop_oneof![
        12 => call,
        5 => tick,
        w(m.settle, 2) => (0usize..4, 0u64..12).prop_map(|(hold, to)| Step::Settle { hold, to }),
        w(m.refund, 2) => (0usize..4).prop_map(|hold| Step::Cancel { hold }),
        w(m.hold || m.refund || m.settle, 2) => (0usize..4).prop_map(|hold| Step::Release { hold }),
        w(m.reload, 1) => Just(Step::Reload),
        w(m.back, 1) => any::<u16>().prop_map(|frac| Step::Back { frac }),
    ]
    .boxed()
}

/// A seam of `space` that has every label of `labels`, adjusted by `adjust`, and a trace of
/// it.
pub fn case(
    space: Space,
    labels: &'static [&'static str],
    adjust: impl Fn(Config) -> Config + Clone + 'static,
    steps: std::ops::Range<usize>,
) -> impl Strategy<Value = (Config, Vec<Step>)> {
    config(space).prop_map(move |c| adjust(require(c, labels))).prop_flat_map(move |c| {
        let s = prop::collection::vec(step(&c), steps.clone());
        (Just(c), s)
    })
}

/// `c` without label `label` where it can go (a step kind, a penalty, a reserve, a tier kind
/// when another tier is left; a plain policy gets a calendar tier); `None` when it cannot.
pub fn without(mut c: Config, label: &str) -> Option<Config> {
    let kind: Option<fn(&TierChoice) -> bool> = match label {
        "calendar" => Some(|t| matches!(t, TierChoice::Calendar { .. })),
        "concurrency" => Some(|t| matches!(t, TierChoice::Concurrency { .. })),
        "bytes" => Some(|t| matches!(t, TierChoice::Bytes { .. })),
        "reported" => Some(|t| matches!(t, TierChoice::Reported { .. })),
        "messages" => Some(|t| matches!(t, TierChoice::Messages { .. })),
        "gcra" | "window" => Some(|t| matches!(t, TierChoice::Requests { .. })),
        _ => None,
    };
    if let Some(on) = c.mix.switch(label) {
        *on = false;
        return Some(c);
    }
    match label {
        "penalty" => c.penalty = None,
        "reserve" => c.reserve = None,
        "plain" => c.tiers.push(TierChoice::Calendar { count: 6, hour: false }),
        _ => {
            let is = kind?;
            let keep: Vec<usize> = (0..c.tiers.len()).filter(|&i| !is(&c.tiers[i])).collect();
            if keep.is_empty() {
                return None;
            }
            let index = |i: usize| keep.iter().position(|k| *k == i);
            c.penalty = c.penalty.and_then(|(i, a, b, w)| index(i).map(|i| (i, a, b, w)));
            c.reserve = c.reserve.and_then(|(i, a, b)| index(i).map(|i| (i, a, b)));
            c.tiers = keep.iter().map(|&i| c.tiers[i]).collect();
        }
    }
    Some(c)
}

/// What one step gave: the decision of a check, or whether a settlement or release went
/// through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    Decided(Decision),
    Done(Result<(), String>),
    Nothing,
}

/// A ticket held, with the limiter whose binding issued it and what the model charged.
struct Hold<St: Store> {
    limiter: Limiter<St>,
    ticket: St::Ticket,
    charged: Charged,
    class: Priority,
}

/// What the runner checks as it goes.
pub struct Checks {
    /// Each decision against the model.
    pub model: bool,
    /// The promises of each feature (bounds, reserves) over the decisions.
    pub promises: bool,
}

impl<St: Store> Hold<St> {
    /// Cancels the held ticket, every charge given back: what it had charged, and the store's
    /// answer; once it is done, the settlement to 0 of each tier `settled` names is logged.
    async fn cancel(
        self,
        log: &mut Log,
        now: u64,
        settled: impl Fn(usize) -> bool,
    ) -> (Charged, Result<(), tollgate::StoreError>) {
        let r = self.limiter.store().settle(self.limiter.bound(), self.ticket, 0).await;
        if r.is_ok() {
            let (key, at) = (self.charged.key, self.charged.at);
            for (tier, &was) in self.charged.costs.iter().enumerate() {
                if settled(tier) {
                    log.push(Event::Settled { key, tier, at, now, was, to: 0 });
                }
            }
        }
        (self.charged, r)
    }
}

/// What a [`Step::Call`] of a seam asks: its key, its costs per tier, its shaping budget (ns).
struct Ask {
    key: Key,
    costs: tollgate::Costs,
    budget: Option<u64>,
}

impl Ask {
    fn new(
        config: &Config,
        policy: &Policy,
        key: u8,
        requests: u64,
        bytes: u16,
        shape: Option<u16>,
    ) -> Self {
        let costs = policy.costs(requests, Some(config.bytes(bytes)));
        let budget = shape.map(|f| config.budget(f));
        Self { key: Key::text(format!("k{key}")), costs, budget }
    }

    /// The store's verdict on `requests` requests of `class` so asked through `limiter`, its
    /// ticket kept when `hold`.
    async fn check<St: Store>(
        &self,
        limiter: &Limiter<St>,
        requests: u64,
        class: Priority,
        hold: bool,
    ) -> Result<tollgate::store::Verdict<St::Ticket>, String> {
        let mut check =
            Check::new(&self.key, requests).with_costs(&self.costs).with_priority(class);
        if let Some(b) = self.budget {
            check = check.shape(Duration::from_nanos(b));
        }
        if hold {
            check = check.with_ticket();
        }
        let verdict = limiter.store().check(limiter.bound(), check).await;
        verdict.map_err(|e| format!("store error: {e}"))
    }
}

/// The instant traces start: 2026-01-05T00:00:00Z, a Monday, on a whole hour (ns).
pub const START: u64 = 1_767_571_200 * S;

/// Runs `trace` of `config` on `store` (whose clock is `clock`), and returns what each step
/// gave; with `checks`, fails at the first step that breaks the model or a promise, saying
/// which and where.
pub async fn run<St: Store>(
    config: &Config,
    trace: &[Step],
    store: St,
    clock: &FakeClock,
    checks: &Checks,
) -> Result<Vec<Seen>, String> {
    let policy = config.policy();
    let mut limiter = Limiter::with_store(policy.clone(), store).map_err(|e| e.to_string())?;
    let mut model = Model::new(&policy);
    let mut log = Log::new(config, &policy);
    let mut holds: Vec<Hold<St>> = Vec::new();
    let mut seen = Vec::with_capacity(trace.len());
    let mut now = START;
    let mut back = false;
    clock.set(now);
    for (n, step) in trace.iter().enumerate() {
        let at = |what: String| format!("step {n} ({step:?}) at +{}ns: {what}", now - START);
        let got = match step {
            Step::Tick { scale, frac } => {
                now += config.tick(*scale, *frac);
                clock.set(now);
                Seen::Nothing
            }
            Step::Back { frac } => {
                now = now.saturating_sub(config.tick(2, *frac)).max(START);
                clock.set(now);
                // From here on, each key decides at the later of now and its last charge
                // (`MemoryStoreBuilder::clock`): what the stores promise is that they answer
                // alike, which the Redis matrix holds.
                back = true;
                log.stepped_back();
                Seen::Nothing
            }
            Step::Call { key, class, requests, bytes, shape, hold } => {
                let ask = Ask::new(config, &policy, *key, *requests, *bytes, *shape);
                let (costs, budget) = (&ask.costs, ask.budget);
                if checks.promises {
                    log.before(&mut model, *key, now, costs, *class, budget).map_err(&at)?;
                }
                let verdict = ask.check(&limiter, *requests, *class, *hold).await.map_err(&at)?;
                let d = verdict.decision;
                let (expect, charged) = model.decide(*key, now, costs, *class, budget);
                if checks.model && !back {
                    compare(&d, &expect).map_err(&at)?;
                }
                if checks.promises {
                    log.after(*key, now, costs, *class, budget, &d).map_err(&at)?;
                }
                match (verdict.ticket, charged) {
                    (Some(ticket), Some(charged)) if *hold => {
                        holds.push(Hold {
                            limiter: limiter.clone(),
                            ticket,
                            charged,
                            class: *class,
                        });
                    }
                    (ticket, charged) => {
                        if let Some(ticket) = ticket {
                            let r = limiter.store().release(limiter.bound(), ticket).await;
                            r.map_err(|e| at(format!("release: {e}")))?;
                        }
                        if let Some(c) = charged {
                            if d.is_allowed() {
                                model.release(&c);
                                log.push(Event::Released { key: c.key, costs: c.costs });
                            }
                        }
                    }
                }
                Seen::Decided(d)
            }
            Step::Settle { hold, to } => match holds.len() {
                0 => Seen::Nothing,
                len => {
                    let h = &mut holds[hold % len];
                    let costs: Vec<(usize, u64)> = policy
                        .tiers()
                        .iter()
                        .enumerate()
                        .filter(|(_, t)| t.kind() != tollgate::TierKind::Concurrency)
                        .map(|(i, _)| (i, to + i as u64 % 2))
                        .collect();
                    let r = h
                        .limiter
                        .store()
                        .settle_tiers(h.limiter.bound(), &mut h.ticket, &costs)
                        .await;
                    if r.is_ok() {
                        for &(i, c) in &costs {
                            let was = h.charged.costs[i];
                            if c > was {
                                let (key, at) = (h.charged.key, h.charged.at);
                                log.debt(key, i, at, now, c - was);
                            }
                            model.settle_tier(&mut h.charged, i, c, now);
                            log.push(Event::Settled {
                                key: h.charged.key,
                                tier: i,
                                at: h.charged.at,
                                now,
                                was,
                                to: c,
                            });
                        }
                    }
                    Seen::Done(r.map_err(|e| e.to_string()))
                }
            },
            Step::Cancel { hold } => match holds.len() {
                0 => Seen::Nothing,
                len => {
                    let rate =
                        |i: usize| policy.tiers()[i].kind() != tollgate::TierKind::Concurrency;
                    let (charged, r) = holds.remove(hold % len).cancel(&mut log, now, rate).await;
                    if r.is_ok() {
                        log.push(Event::Released {
                            key: charged.key,
                            costs: charged.costs.clone(),
                        });
                        model.settle(charged, 0, now);
                    }
                    Seen::Done(r.map_err(|e| e.to_string()))
                }
            },
            Step::Release { hold } => match holds.len() {
                0 => Seen::Nothing,
                len => {
                    let h = holds.remove(hold % len);
                    let r = h.limiter.store().release(h.limiter.bound(), h.ticket).await;
                    if r.is_ok() {
                        model.release(&h.charged);
                        log.push(Event::Released { key: h.charged.key, costs: h.charged.costs });
                    }
                    Seen::Done(r.map_err(|e| e.to_string()))
                }
            },
            Step::Reload => {
                limiter = limiter.rebind(policy.clone()).map_err(|e| at(format!("rebind: {e}")))?;
                Seen::Nothing
            }
        };
        seen.push(got);
    }
    if checks.promises {
        log.bounds().map_err(|e| format!("at the end: {e}"))?;
    }
    Ok(seen)
}

/// Whether decision `d` is what the model expects: the outcome, the shaping delay, and the
/// `retry_after` where the docs make it exact.
fn compare(d: &Decision, e: &super::seams_model::Expect) -> Result<(), String> {
    let delay = u64::try_from(d.delay().as_nanos()).unwrap();
    let retry = d.retry_after().map(|r| u64::try_from(r.as_nanos()).unwrap());
    let what = match (d.outcome(), e.outcome) {
        (a, b) if a == b => None,
        (Outcome::Allowed, _) => Some("over-admission: admitted where the model refuses"),
        (_, Outcome::Allowed) => Some("under-admission: refused where the model admits"),
        _ => Some("another refusal than the model's"),
    };
    if let Some(what) = what {
        return Err(format!("{what}: {d:?}, model {e:?}"));
    }
    if d.is_allowed() && delay != e.delay {
        return Err(format!("shaping delay {delay} ns, the model's {} ns: {d:?}", e.delay));
    }
    if let (Some(expected), Outcome::Limited) = (e.retry, d.outcome()) {
        if retry != Some(expected) {
            return Err(format!("retry_after {retry:?} ns, the model's {expected} ns: {d:?}"));
        }
    }
    Ok(())
}

/// What a lease-mode run checks beyond the bounds (issue 32): that an admitted check decided
/// from a block reports `remaining` within one block of what an exact query of the key says
/// right after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseHeaders {
    Unchecked,
    WithinABlock,
}

/// Runs `trace` of `config` (a [`Space::Lease`] seam) on `leasing` instances in lease mode and
/// one `exact` instance, sharing one budget and `clock`: step `n` goes through instance
/// `n % (leasing + 1)` (the last is exact). Holds every rate tier to its bound plus `N · B`
/// (`Lease::bound`), and windows and calendar tiers to theirs exactly (`Lease`: "Scaling past
/// one Redis").
pub async fn run_leased<St: Store>(
    config: &Config,
    trace: &[Step],
    leasing: Vec<St>,
    exact: St,
    slack: u64,
    clock: &FakeClock,
    headers: LeaseHeaders,
) -> Result<(), String> {
    let policy = config.policy();
    let bind = |s: St| Limiter::with_store(policy.clone(), s).map_err(|e| e.to_string());
    let mut nodes: Vec<Limiter<St>> = leasing.into_iter().map(bind).collect::<Result<_, _>>()?;
    let exact = bind(exact)?;
    nodes.push(exact.clone());
    let mut log = Log::new(config, &policy).with_slack(slack);
    let mut holds: Vec<Hold<St>> = Vec::new();
    let mut now = START;
    clock.set(now);
    for (n, step) in trace.iter().enumerate() {
        let at = |what: String| format!("step {n} ({step:?}) at +{}ns: {what}", now - START);
        let node = n % nodes.len();
        match step {
            Step::Tick { scale, frac } => {
                now += config.tick(*scale, *frac);
                clock.set(now);
            }
            Step::Call { key, class, requests, bytes, shape, hold } => {
                let ask = Ask::new(config, &policy, *key, *requests, *bytes, *shape);
                let (k, costs, budget) = (&ask.key, &ask.costs, ask.budget);
                let limiter = &nodes[node];
                let verdict = ask.check(limiter, *requests, *class, *hold).await.map_err(&at)?;
                let d = verdict.decision;
                log.after(*key, now, costs, *class, budget, &d).map_err(&at)?;
                let leased = node + 1 < nodes.len() && budget.is_none() && *requests > 0;
                if headers == LeaseHeaders::WithinABlock && leased && d.is_allowed() {
                    let q = exact.check(k, 0).await.map_err(|e| at(e.to_string()))?;
                    for (i, (got, exact)) in d.tiers().iter().zip(q.tiers()).enumerate() {
                        let (r, e) = (got.remaining(), exact.remaining());
                        if r + slack / (nodes.len() as u64 - 1).max(1) < e {
                            return Err(at(format!(
                                "tier t{i} reports {r} left from a block, an exact query {e}: \
                                 more than a block apart"
                            )));
                        }
                    }
                }
                if let (Some(ticket), true) = (verdict.ticket, *hold && d.is_allowed()) {
                    // Charged at its departure (a leased ticket is settled as an exact charge
                    // made at its block's grant, in the same window: `Lease`).
                    let at = now + u64::try_from(d.delay().as_nanos()).unwrap();
                    let charged = Charged { key: *key, at, costs: costs.to_vec() };
                    holds.push(Hold { limiter: limiter.clone(), ticket, charged, class: *class });
                }
            }
            Step::Cancel { hold } if !holds.is_empty() => {
                let len = holds.len();
                let (_, r) = holds.remove(hold % len).cancel(&mut log, now, |_| true).await;
                r.map_err(|e| at(format!("cancel: {e}")))?;
            }
            Step::Reload => {
                let i = n % (nodes.len() - 1);
                nodes[i] =
                    nodes[i].rebind(policy.clone()).map_err(|e| at(format!("rebind: {e}")))?;
            }
            _ => {}
        }
    }
    Ok(())
}
