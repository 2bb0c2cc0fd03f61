//! Whether a Redis server keeps up, judged by its replies: when a check's deadline passes, is
//! it the server that is late, or this machine that has not got round to the check?
//!
//! A check waits for its answer until its deadline (submitted + the store's timeout). Past it,
//! it gives up at once if the server is **behind**: it owes a reply (a call is in flight, or a
//! call went unanswered within its call timeout) and has sent none for a whole timeout.
//! Otherwise the server answers as fast as it is asked, and the check is late only because
//! this machine is slower than the server (a burst larger than it turns round within the
//! timeout, scripts made slow by cores busy with other work): it keeps waiting, for its turn
//! and its call, until the server falls behind, or [`PATIENCE`] times the timeout has passed
//! since it was submitted.
//!
//! The bounds: no check waits longer than [`PATIENCE`] times the timeout (plus the time its
//! task takes to be polled). When the server stops answering, a check submitted from then on
//! waits its timeout; one already waiting waits until a timeout after the server's last reply,
//! or its own deadline if later.
//!
//! Time is tokio's clock, so `tokio::time::pause()` drives it in tests.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::clock::duration_to_nanos;

/// How many timeouts a check waits at most while the server keeps answering: enough for a
/// burst of thousands of checks on a script that costs Redis 100 µs each, on a machine whose
/// cores are shared with other work.
pub(crate) const PATIENCE: u32 = 10;

pub(crate) struct Health {
    timeout: Duration,
    origin: Instant,
    /// Calls sent and neither answered nor given up on.
    outstanding: AtomicUsize,
    /// Nanoseconds since `origin` from which the server owes a reply: its last reply, or the
    /// sending of a call when none was owed.
    since: AtomicU64,
    /// A call went unanswered within its call timeout, and no reply has come since.
    unanswered: AtomicBool,
}

/// A call in flight, from its sending to its reply. Dropped without a verdict (its future
/// cancelled, or the connection failed), it is no longer waited for and says nothing of the
/// server.
pub(crate) struct Pending<'a> {
    health: &'a Health,
}

impl Health {
    pub(crate) fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            origin: Instant::now(),
            outstanding: AtomicUsize::new(0),
            since: AtomicU64::new(0),
            unanswered: AtomicBool::new(false),
        }
    }

    fn nanos(&self, at: Instant) -> u64 {
        duration_to_nanos(at.saturating_duration_since(self.origin))
    }

    /// A call is being sent.
    pub(crate) fn sending(&self) -> Pending<'_> {
        let idle = self.outstanding.fetch_add(1, Ordering::AcqRel) == 0;
        if idle && !self.unanswered.load(Ordering::Acquire) {
            self.since.fetch_max(self.nanos(Instant::now()), Ordering::AcqRel);
        }
        Pending { health: self }
    }

    /// `None` when a check with this deadline gives up at `now`; otherwise the instant to look
    /// again (its answer may come first).
    pub(crate) fn gives_up(&self, deadline: Instant, now: Instant) -> Option<Instant> {
        if now < deadline {
            return Some(deadline);
        }
        let last = later(deadline, self.timeout.saturating_mul(PATIENCE - 1));
        if now >= last {
            return None;
        }
        let owed =
            self.outstanding.load(Ordering::Acquire) > 0 || self.unanswered.load(Ordering::Acquire);
        let next = if owed {
            let since =
                later(self.origin, Duration::from_nanos(self.since.load(Ordering::Acquire)));
            let behind = later(since, self.timeout);
            if now >= behind {
                return None;
            }
            behind
        } else {
            // Nothing owed: the next call starts the clock.
            later(now, self.timeout)
        };
        Some(next.min(last))
    }
}

/// `at + by`, or about thirty years after `at` when that is past what an instant can hold (a
/// timeout of `Duration::MAX`).
pub(crate) fn later(at: Instant, by: Duration) -> Instant {
    at.checked_add(by).unwrap_or_else(|| at + Duration::from_secs(30 * 365 * 86_400))
}

impl Pending<'_> {
    /// The server replied (a result or an error of its own).
    pub(crate) fn answered(self) {
        let h = self.health;
        h.since.fetch_max(h.nanos(Instant::now()), Ordering::AcqRel);
        h.unanswered.store(false, Ordering::Release);
    }

    /// No reply within the call timeout.
    pub(crate) fn unanswered(self) {
        self.health.unanswered.store(true, Ordering::Release);
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        self.health.outstanding.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_millis(100);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[tokio::test(start_paused = true)]
    async fn before_its_deadline_a_check_waits() {
        let h = Health::new(T);
        let deadline = Instant::now() + T;
        assert_eq!(h.gives_up(deadline, Instant::now()), Some(deadline));
    }

    #[tokio::test(start_paused = true)]
    async fn past_its_deadline_a_check_gives_up_once_a_call_waited_a_whole_timeout() {
        let h = Health::new(T);
        let submitted = Instant::now();
        let deadline = submitted + T;
        tokio::time::advance(ms(70)).await;
        let _call = h.sending(); // sent at 70 ms, never answered
        tokio::time::advance(ms(30)).await;
        // At the deadline (100 ms) the call has waited 30 ms: the server is not behind yet.
        assert_eq!(h.gives_up(deadline, Instant::now()), Some(submitted + ms(170)));
        tokio::time::advance(ms(69)).await;
        assert!(h.gives_up(deadline, Instant::now()).is_some());
        tokio::time::advance(ms(1)).await;
        assert_eq!(h.gives_up(deadline, Instant::now()), None, "behind at 170 ms");
    }

    #[tokio::test(start_paused = true)]
    async fn a_check_submitted_while_the_server_is_silent_gives_up_at_its_deadline() {
        let h = Health::new(T);
        let _call = h.sending(); // never answered
        tokio::time::advance(ms(10)).await;
        let deadline = Instant::now() + T;
        tokio::time::advance(T).await;
        assert_eq!(h.gives_up(deadline, Instant::now()), None);
    }

    #[tokio::test(start_paused = true)]
    async fn replies_keep_a_late_check_waiting_up_to_its_patience() {
        let h = Health::new(T);
        let submitted = Instant::now();
        let deadline = submitted + T;
        let mut call = h.sending();
        // The server answers every 90 ms while this check waits its turn.
        let mut waited = Duration::ZERO;
        while waited + ms(90) < T * PATIENCE {
            tokio::time::advance(ms(90)).await;
            waited += ms(90);
            call.answered();
            call = h.sending();
            assert!(h.gives_up(deadline, Instant::now()).is_some(), "at {waited:?}");
        }
        tokio::time::advance(T * PATIENCE - waited).await;
        call.answered();
        assert_eq!(h.gives_up(deadline, Instant::now()), None, "at {PATIENCE} timeouts");
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_unanswered_in_its_call_timeout_leaves_the_server_behind_until_a_reply() {
        let h = Health::new(T);
        let call = h.sending();
        tokio::time::advance(2 * T).await;
        call.unanswered();
        let deadline = Instant::now();
        // Nothing in flight now, but a reply is owed since 0 ms.
        assert_eq!(h.gives_up(deadline, Instant::now()), None);
        // A new call does not restart the clock ...
        let next = h.sending();
        assert_eq!(h.gives_up(deadline, Instant::now()), None);
        // ... a reply does.
        next.answered();
        assert_eq!(h.gives_up(deadline, Instant::now()), Some(deadline + T));
    }

    #[tokio::test(start_paused = true)]
    async fn with_nothing_sent_a_late_check_waits_for_the_next_call() {
        let h = Health::new(T);
        let deadline = Instant::now() + T;
        tokio::time::advance(T).await;
        let now = Instant::now();
        assert_eq!(h.gives_up(deadline, now), Some(now + T));
        tokio::time::advance(ms(10)).await;
        let call = h.sending(); // sent at 110 ms: behind from 210 ms
        tokio::time::advance(ms(40)).await;
        assert_eq!(h.gives_up(deadline, Instant::now()), Some(deadline + ms(110)));
        tokio::time::advance(ms(60)).await;
        assert_eq!(h.gives_up(deadline, Instant::now()), None);
        drop(call);
    }

    #[tokio::test(start_paused = true)]
    async fn a_timeout_too_long_for_an_instant_does_not_panic() {
        let h = Health::new(Duration::MAX);
        let deadline = later(Instant::now(), Duration::MAX);
        assert!(deadline > Instant::now() + Duration::from_secs(86_400 * 365));
        let _call = h.sending();
        assert!(h.gives_up(Instant::now(), Instant::now()).is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_that_failed_without_a_reply_says_nothing() {
        let h = Health::new(T);
        let deadline = Instant::now();
        drop(h.sending()); // connection refused: no verdict
        assert_eq!(h.gives_up(deadline, Instant::now()), Some(deadline + T));
    }
}
