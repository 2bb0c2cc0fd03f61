//! [`Grants`]: the bytes or messages of one stream, charged to the store in grants as they
//! pass.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use smallvec::SmallVec;

use super::gate::{Gate, Stopped};
use super::{MESSAGE_GRANT, SHAPE_AHEAD, STREAM_GRANT, StreamMode};

/// A grant holds room ahead of what its stream needs only up to this share of what the tiers
/// had left (1/64): concurrent streams of a key near its limit ask for what they need.
const AHEAD_SHARE: u64 = 64;
use crate::decision::Decision;
use crate::error::StoreError;
use crate::key::Key;
use crate::limiter::Limiter;
use crate::quota::{Priority, TierKind, Unit};
use crate::store::{Check, Store, Verdict};

type Asking<T> = Pin<Box<dyn Future<Output = Result<Verdict<T>, StoreError>> + Send>>;

enum State<T> {
    /// Nothing under way.
    Idle,
    /// A grant of `.1` bytes asked for, the store not having answered yet.
    Asking(Asking<T>, u64),
    /// Waiting for the instant a shaped grant was reserved at, or for a refused one to fit.
    Sleeping(Pin<Box<tokio::time::Sleep>>),
}

/// A [`Gate`] on a store: the grants of one body under one policy and key.
pub(crate) struct Grants<St: Store> {
    limiter: Limiter<St>,
    key: Key,
    priority: Priority,
    /// The tiers counting the body's unit, charged each grant.
    tiers: SmallVec<[usize; 2]>,
    /// Per tier of the policy, what the next grant costs: its size on `tiers`, 0 elsewhere
    /// (neither checked nor charged); built once, its sizes written per grant.
    costs: SmallVec<[u64; 4]>,
    /// The largest grant the tiers can ever admit.
    largest: u64,
    /// Some tier it charges has a penalty box: a grant asks only for what the stream really
    /// let through or has in hand, so that a refusal is a breach by the key.
    penalized: bool,
    /// What the stream let through so far: the next grant may be as large again (grants grow
    /// by doubling, from what the first frame needs up to `largest`).
    used: u64,
    /// What the tiers had left at the last decision, the least of them: a grant asks no more
    /// while that covers what the stream needs (it would be refused, or wait, for nothing).
    known_left: Option<u64>,
    police: bool,
    fail_open: bool,
    /// The ticket of the current grant, to give back what it did not use; `None` when it
    /// was given uncharged (failing open) or there is none.
    grant: Option<St::Ticket>,
    /// The size of the current grant.
    granted: u64,
    /// What the current grant still covers.
    left: u64,
    /// Bytes let through past the grants, paid from the next ones.
    owed: u64,
    /// Units the admission charged these tiers that the first grant larger than them counts
    /// as paid (see [`credited`](Self::credited)), until it is taken.
    credit: u64,
    /// The credit the grant being asked for counts, and the one the current grant counted.
    asking_credit: u64,
    grant_credit: u64,
    /// The admission's units a grant counted: they stay charged when the stream ends.
    credit_kept: u64,
    /// Shaping, a grant with room ahead is asked for only if it fits now: when it does not,
    /// the grant of what the stream needs (this) is asked for next, shaped.
    fallback: Option<u64>,
    state: State<St::Ticket>,
}

impl<St: Store> Grants<St> {
    /// The grants of a body counted in `unit` under `limiter`'s policy, for `key`.
    pub(crate) fn new(
        limiter: &Limiter<St>,
        key: Key,
        priority: Priority,
        unit: Unit,
        mode: StreamMode,
        fail_open: bool,
    ) -> Self {
        let policy = limiter.policy();
        let counting =
            |t: &&crate::policy::Tier| t.unit() == unit && t.kind() != TierKind::Concurrency;
        let tiers: SmallVec<[usize; 2]> = policy
            .tiers()
            .iter()
            .enumerate()
            .filter(|(_, t)| counting(t))
            .map(|(i, _)| i)
            .collect();
        let largest = policy
            .tiers()
            .iter()
            .filter(counting)
            .map(|t| t.capacity_for(priority))
            .min()
            .unwrap_or(STREAM_GRANT)
            .min(match unit {
                Unit::RequestMessages | Unit::ResponseMessages => MESSAGE_GRANT,
                _ => STREAM_GRANT,
            });
        let costs = SmallVec::from_elem(0, policy.tiers().len());
        let penalized = tiers.iter().any(|&i| policy.tiers()[i].penalty().is_some());
        Self {
            limiter: limiter.clone(),
            key,
            priority,
            tiers,
            costs,
            largest,
            penalized,
            used: 0,
            known_left: None,
            police: mode == StreamMode::Police,
            fail_open,
            grant: None,
            granted: 0,
            left: 0,
            owed: 0,
            credit: 0,
            asking_credit: 0,
            grant_credit: 0,
            credit_kept: 0,
            fallback: None,
            state: State::Idle,
        }
    }

    /// The first `units` were charged at admission: they pass without a grant (a call's
    /// first message each way, charged as a unary call's).
    pub(crate) fn prepaid(mut self, units: u64) -> Self {
        self.left = units;
        self
    }

    /// The admission charged these tiers `units` that the stream's first grant larger than
    /// them counts as paid: it asks the store for the rest only, so that concurrent streams of
    /// a key do not hold their admission's units twice while they run. Whether a grant kept
    /// them is told by [`Gate::end`]; the layer gives the others back when the body ends.
    pub(crate) fn credited(mut self, units: u64) -> Self {
        self.credit = units;
        self
    }

    /// The size of the next grant, and what the stream needs of it: what it owes and has in
    /// hand (`want`); and, once it used a quarter of the largest grant, but under a penalty
    /// box, room ahead as large as what it used so far (grants grow by doubling), at most a
    /// 64th of what the tiers had left (near the limit a stream asks for what it needs, so
    /// that what other streams of the key hold unused never stops bodies that fit together;
    /// shaping a stream past what the tiers have, all of it: the grant sets its pace).
    /// Never more than the body has left (`remaining`, when known), than the tiers had left at
    /// the last decision when that covers the need, nor than the largest grant; shaping, what
    /// the tiers had left when that is less than the need (a response's frame is cut to it).
    fn next_size(&self, remaining: Option<u64>, want: u64) -> (u64, u64) {
        let ahead = match (self.penalized || self.used < self.largest / 4, self.known_left) {
            (true, _) => 0,
            // Shaping past what the tiers have now: the grant is reserved ahead in time, and
            // its size is the stream's pace (one store call per grant, not per frame).
            (false, Some(0)) if !self.police => self.used,
            (false, left) => self.used.min(left.unwrap_or(0) / AHEAD_SHARE),
        };
        let mut need = self.owed.saturating_add(want).clamp(1, self.largest);
        let mut size = self.owed.saturating_add(want.max(ahead)).clamp(1, self.largest);
        if let Some(left) = remaining {
            let body = self.owed.saturating_add(left).max(1);
            (size, need) = (size.min(body), need.min(body));
        }
        match self.known_left {
            Some(left) if left >= need => size = size.min(left),
            Some(left) if !self.police && left > 0 => (size, need) = (left, left),
            _ => {}
        }
        (size, need)
    }

    /// Notes what the tiers have left after `decision`.
    fn note(&mut self, decision: &Decision) {
        let tiers = decision.tiers();
        self.known_left =
            self.tiers.iter().filter_map(|&i| tiers.get(i)).map(|t| t.remaining()).min();
    }

    /// Asks the store for a grant of `size` bytes, or, shaping, when it holds room ahead of
    /// what the stream needs (`need`), for one that fits now (then `need`, shaped): the answer
    /// if it came at once.
    fn ask_for(&mut self, size: u64, need: u64) -> Option<Result<Verdict<St::Ticket>, StoreError>> {
        let room_now = self.known_left != Some(0);
        self.fallback = (!self.police && room_now && size > need).then_some(need);
        self.ask(size)
    }

    /// Asks the store for a grant of `size` bytes: the answer if it came at once.
    fn ask(&mut self, size: u64) -> Option<Result<Verdict<St::Ticket>, StoreError>> {
        self.asking_credit = if size > self.credit { self.credit } else { 0 };
        for &i in &self.tiers {
            self.costs[i] = size - self.asking_credit;
        }
        // Policed: the grant of a policing stream, or one with room ahead that must fit now.
        let police = self.police || self.fallback.is_some();
        let mut check =
            Check::new(&self.key, 1).with_costs(&self.costs).with_priority(self.priority);
        check.ticket = true;
        if !police {
            check.max_delay = Some(SHAPE_AHEAD);
        }
        if let Some(answer) = self.limiter.check_sync(check) {
            return Some(answer);
        }
        let (limiter, key, priority, costs) =
            (self.limiter.clone(), self.key.clone(), self.priority, self.costs.clone());
        self.state = State::Asking(
            Box::pin(async move {
                let mut check = Check::new(&key, 1).with_costs(&costs).with_priority(priority);
                check.ticket = true;
                if !police {
                    check.max_delay = Some(SHAPE_AHEAD);
                }
                limiter.decide(check).await
            }),
            size,
        );
        None
    }

    /// Takes the store's answer to a grant of `size`: `Err` when the stream stops.
    fn answered(
        &mut self,
        size: u64,
        answer: Result<Verdict<St::Ticket>, StoreError>,
    ) -> Result<(), Stopped> {
        if let Ok(verdict) = &answer {
            self.note(&verdict.decision);
        }
        let fallback = self.fallback.take();
        match answer {
            Ok(verdict) if verdict.decision.is_allowed() => {
                let delay = verdict.decision.delay();
                // The previous grant is spent: dropping its ticket keeps its charge.
                self.grant = verdict.ticket;
                let credit = std::mem::take(&mut self.asking_credit);
                self.grant(size, credit);
                if !delay.is_zero() {
                    self.state = State::Sleeping(Box::pin(tokio::time::sleep(delay)));
                }
                Ok(())
            }
            // Room ahead that does not fit now: what the stream needs, shaped.
            Ok(_) if fallback.is_some() => {
                let need = fallback.unwrap_or(size);
                match self.ask(need) {
                    Some(answer) => self.answered(need, answer),
                    None => Ok(()),
                }
            }
            Ok(verdict) => match verdict.decision.retry_after() {
                // Policing: what the stream let through is charged whatever the tiers say
                // (the handler has it: the bound allows it), and a smaller grant of what the
                // tier has left is asked for, when that lets a unit through (once per
                // refusal).
                _ if self.police => {
                    let paid = self.close_grant();
                    match self.smaller(size, &verdict.decision, paid) {
                        Some(smaller) => match self.ask(smaller) {
                            Some(answer) => self.answered(smaller, answer),
                            None => Ok(()),
                        },
                        None => Err(Stopped::Limited(verdict.decision)),
                    }
                }
                Some(wait) if !self.police => {
                    self.state = State::Sleeping(Box::pin(tokio::time::sleep(wait)));
                    Ok(())
                }
                // Policing, or a grant that can never fit (a reserve withholding the tier).
                _ => Err(Stopped::Limited(verdict.decision)),
            },
            Err(error) if self.fail_open => {
                tracing::warn!(%error, "tollgate: a stream's grant could not be decided; failing open");
                self.grant = None;
                // Uncharged: the admission's units stay the stream's credit.
                self.grant(size, 0);
                Ok(())
            }
            Err(error) => {
                tracing::warn!(%error, "tollgate: a stream's grant could not be decided; failing closed");
                Err(Stopped::Unavailable(Arc::new(error)))
            }
        }
    }

    /// What the tiers have left after refusing a grant of `size`, less `paid` (what the
    /// stream was charged since): when that is less than `size` and lets a unit through.
    fn smaller(&self, size: u64, refusal: &Decision, paid: u64) -> Option<u64> {
        let tiers = refusal.tiers();
        let left = self.tiers.iter().filter_map(|&i| tiers.get(i)).map(|t| t.remaining()).min()?;
        let left = left.saturating_sub(paid);
        (left < size && left > 0).then_some(left)
    }

    /// Ends the current grant at what the stream used of it, its debt included (charged
    /// whatever the tiers say: it passed): the unused part is given back, the debt paid.
    /// Returns the debt.
    fn close_grant(&mut self) -> u64 {
        let debt = std::mem::take(&mut self.owed);
        let used = (self.granted - self.left).saturating_add(debt);
        let granted = std::mem::take(&mut self.granted);
        self.left = 0;
        // The store charged the grant less the admission's units it counted; a stream that
        // used less than those leaves them to be given back when it ends.
        let credit = std::mem::take(&mut self.grant_credit);
        if used < credit {
            self.credit_kept -= credit;
        }
        let Some(mut ticket) = self.grant.take() else { return debt };
        if used == granted {
            return debt;
        }
        let charged = used.saturating_sub(credit);
        let settled: SmallVec<[(usize, u64); 2]> =
            self.tiers.iter().map(|&i| (i, charged)).collect();
        let limiter = self.limiter.clone();
        crate::limiter::run_or_spawn(async move {
            let settling = limiter.store().settle_tiers(limiter.bound(), &mut ticket, &settled);
            if let Err(error) = settling.await {
                tracing::warn!(%error, "tollgate: could not settle a stream's grant");
            }
        });
        debt
    }

    /// A grant of `size` bytes was granted, `credit` of them the admission's units (see
    /// [`credited`](Self::credited)): it pays what is owed first.
    fn grant(&mut self, size: u64, credit: u64) {
        self.credit -= credit;
        self.credit_kept += credit;
        self.grant_credit = credit;
        let paid = size.min(self.owed);
        self.owed -= paid;
        self.granted = size;
        self.left = size - paid;
    }
}

impl<St: Store> Gate for Grants<St> {
    fn poll_room(
        &mut self,
        cx: &mut Context<'_>,
        remaining: Option<u64>,
        want: u64,
    ) -> Poll<Result<u64, Stopped>> {
        loop {
            match &mut self.state {
                State::Sleeping(sleep) => {
                    if sleep.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    self.state = State::Idle;
                }
                State::Asking(future, size) => {
                    let size = *size;
                    let Poll::Ready(answer) = future.as_mut().poll(cx) else {
                        return Poll::Pending;
                    };
                    self.state = State::Idle;
                    if let Err(stopped) = self.answered(size, answer) {
                        return Poll::Ready(Err(stopped));
                    }
                }
                State::Idle => {
                    if self.owed == 0 && self.left > 0 {
                        return Poll::Ready(Ok(self.left));
                    }
                    let (size, need) = self.next_size(remaining, want);
                    if let Some(answer) = self.ask_for(size, need) {
                        if let Err(stopped) = self.answered(size, answer) {
                            return Poll::Ready(Err(stopped));
                        }
                    }
                }
            }
        }
    }

    fn spend(&mut self, len: u64) {
        self.used = self.used.saturating_add(len);
        let covered = len.min(self.left);
        self.left -= covered;
        self.owed = self.owed.saturating_add(len - covered);
    }

    #[inline]
    fn ready(&self) -> u64 {
        match self.state {
            State::Idle if self.owed == 0 => self.left,
            _ => 0,
        }
    }

    fn end(&mut self) -> u64 {
        self.close_grant();
        self.credit_kept
    }
}

impl<St: Store> Drop for Grants<St> {
    /// Gives back the part of the last grant the body did not use (all of it when the body
    /// was dropped while waiting for its reserved instant), or charges what it let through
    /// past it.
    fn drop(&mut self) {
        self.close_grant();
    }
}
