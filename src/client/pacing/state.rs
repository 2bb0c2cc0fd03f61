//! What the pacing layer keeps per partition (one server, by default): its quotas, the wait
//! a 429 asked for, the requests in flight and the tickets that track them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use http::{Response, StatusCode};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::quota::*;
use super::*;
use crate::hints::{self, MAX_QUOTAS, Reported};

/// What one partition's server said, and the requests it has in flight.
#[derive(Default)]
pub(super) struct Partition {
    pub(super) state: Mutex<State>,
    /// Woken when a response arrives or a request ends: waiters look again.
    pub(super) changed: Notify,
}

impl Partition {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reserves a place now, if the server would accept a request now.
    pub(super) fn try_acquire(self: &Arc<Self>) -> Option<Ticket> {
        let seq = self.lock().try_reserve(Instant::now()).ok()?;
        Some(Ticket { partition: Arc::clone(self), seq, open: true })
    }

    /// Waits until the server would accept a request, and reserves its place.
    pub(super) async fn acquire(self: Arc<Self>) -> Ticket {
        loop {
            // Registered before looking, so a change between the look and the wait wakes us.
            let notified = self.changed.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            let now = Instant::now();
            let outcome = self.lock().try_reserve(now);
            match outcome {
                Ok(seq) => return Ticket { partition: Arc::clone(&self), seq, open: true },
                Err(Some(until)) => {
                    tracing::trace!(wait = ?until.saturating_duration_since(now), "tollgate: pacing");
                    let _ = tokio::time::timeout_at(until, notified).await;
                }
                Err(None) => notified.await,
            }
        }
    }
}

#[derive(Debug, Default, Clone)]
pub(super) struct State {
    pub(super) quotas: Vec<PartitionQuota>,
    /// A 429's `Retry-After`: no request before this.
    pub(super) blocked_until: Option<Instant>,
    /// The sequence number of the last request reserved (they start at 1).
    pub(super) last_seq: u64,
    /// The requests sent and not yet answered: sequence number, and when it was sent.
    pub(super) open: BTreeMap<u64, Instant>,
    /// Whether a response has been read: before, one request at a time.
    pub(super) informed: bool,
}

/// `now + d`, capped at [`MAX_WAIT`].
pub(super) fn after(now: Instant, d: Duration) -> Instant {
    now + d.min(MAX_WAIT)
}

impl State {
    pub(super) fn in_flight(&self) -> u64 {
        self.open.len() as u64
    }

    /// Reserves one unit of every quota when each has one (the request may go; its sequence
    /// number), or says until when to wait: `Some(instant)`, or `None` for "until a response
    /// in flight".
    pub(super) fn try_reserve(&mut self, now: Instant) -> Result<u64, Option<Instant>> {
        if let Some(until) = self.blocked_until {
            if now < until {
                return Err(Some(until));
            }
            self.blocked_until = None;
        }
        if !self.informed && !self.open.is_empty() {
            // Nothing known yet: the first response tells how much may follow it.
            return Err(None);
        }
        let (in_flight, last_seq) = (self.in_flight(), self.last_seq);
        self.quotas.retain_mut(|q| {
            // Full again with an unknown limit: unknown now.
            if !q.settle(now, in_flight, last_seq) {
                return false;
            }
            // Nothing left, nothing that brings units back, no response to come: nothing to
            // wait on.
            !(q.remaining <= 0 && q.next_unit(1).is_none() && in_flight == 0)
        });
        // With requests in flight, one unit stays: a server can decide a request at an instant
        // before one it decided earlier (it read its clock, then waited for a lock), which
        // costs that request the refill of the delay.
        let needed = if in_flight > 0 { 2 } else { 1 };
        let mut exhausted = false;
        let mut until: Option<Instant> = None;
        for q in self.quotas.iter().filter(|q| q.remaining < needed) {
            exhausted = true;
            if let Some(at) = q.next_unit(needed) {
                until = Some(until.map_or(at, |u| u.max(at)));
            }
        }
        if exhausted {
            return Err(until);
        }
        self.last_seq += 1;
        for q in &mut self.quotas {
            q.reserve(self.last_seq);
        }
        self.open.insert(self.last_seq, now);
        Ok(self.last_seq)
    }

    /// Whether a request would go now and nothing is in flight.
    pub(super) fn is_idle(&self, now: Instant) -> bool {
        self.open.is_empty() && self.clone().try_reserve(now).is_ok()
    }

    /// Ends request `seq` without an answer (an error, or dropped): whether the server
    /// counted it is unknown, so its unit stays spent.
    pub(super) fn abandon(&mut self, seq: u64) {
        self.open.remove(&seq);
        for q in &mut self.quotas {
            q.end(seq);
        }
    }

    /// Takes in what the response to request `seq` said, and ends it.
    pub(super) fn observe(
        &mut self,
        now: Instant,
        seq: u64,
        status: StatusCode,
        reported: Vec<Reported>,
        retry_after: Option<Duration>,
    ) {
        let sent_at = self.open.remove(&seq);
        self.informed = true;
        let in_flight = self.in_flight();
        let refused = status == StatusCode::TOO_MANY_REQUESTS;
        if refused {
            for q in &mut self.quotas {
                if q.interval.is_some() {
                    // Refused although the learned rate let it through: stop extrapolating.
                    q.learns = false;
                    q.interval = None;
                    q.anchor = None;
                }
            }
        }
        let mut seen = [false; MAX_QUOTAS];
        for r in reported {
            let i = match self.quotas.iter().position(|q| q.name == r.name) {
                Some(i) => i,
                None if self.quotas.len() < MAX_QUOTAS => {
                    let mut quota = PartitionQuota::new(r.name.clone());
                    // In flight before the quota was known: every report of it is compared.
                    for &open in self.open.keys() {
                        quota.sent.insert(open, Sent { reads: 0, admitted: 0 });
                    }
                    self.quotas.push(quota);
                    self.quotas.len() - 1
                }
                None => continue,
            };
            seen[i] = true;
            let answer = Answer { seq, sent_at, in_flight, admitted: !refused };
            self.quotas[i].read(now, r, answer);
        }
        for (q, _) in self.quotas.iter_mut().zip(seen).filter(|(_, seen)| !seen) {
            q.end(seq);
        }
        if refused {
            if let Some(wait) = retry_after {
                let until = after(now, wait);
                self.blocked_until = Some(self.blocked_until.map_or(until, |b| b.max(until)));
            }
        }
    }
}

/// A request's place in its partition: released when the response is read or the request is
/// dropped.
pub(super) struct Ticket {
    pub(super) partition: Arc<Partition>,
    pub(super) seq: u64,
    pub(super) open: bool,
}

impl Ticket {
    /// Reads the response's rate-limit fields into the partition and releases the place.
    pub(super) fn observe<B>(mut self, res: &Response<B>) {
        let headers = res.headers();
        let reported = hints::reported(headers);
        let retry_after = hints::retry_after(headers);
        self.partition.lock().observe(
            Instant::now(),
            self.seq,
            res.status(),
            reported,
            retry_after,
        );
        self.open = false;
        self.partition.changed.notify_waiters();
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.open {
            self.partition.lock().abandon(self.seq);
            self.partition.changed.notify_waiters();
        }
    }
}
