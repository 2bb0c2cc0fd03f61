//! Whether a Redis server keeps up, judged by its replies: when a check's deadline passes, is
//! it the server that is late, or this process that has not got round to the check?
//!
//! A check waits for its answer until its deadline (submitted + the store's timeout). Past it,
//! it gives up at once if the server is **behind**: a call has been waiting a whole timeout for
//! a reply with no reply arriving meanwhile, or a call got no reply at all within its call
//! timeout and nothing has been heard since. Otherwise the server answers as fast as it is
//! asked, and the check is late only because this machine is (a burst larger than it turns
//! round within the timeout, cores busy with other work): it keeps waiting, for its turn and
//! its call, until the server falls behind or twice the timeout has passed since it was
//! submitted, whichever comes first.
//!
//! The bound: no check waits longer than twice the timeout (plus the time its task takes to be
//! polled). With the server silent from an instant on, a check submitted after it waits the
//! timeout; one already waiting then waits until a timeout after the server's last reply.
//!
//! Time is tokio's clock, so `tokio::time::pause()` drives it in tests.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::clock::duration_to_nanos;

pub(crate) struct Health {
    timeout: Duration,
    origin: Instant,
    /// Calls sent and neither answered nor given up on.
    outstanding: AtomicUsize,
    /// Nanoseconds since `origin`: the last reply, or the last send that found no call
    /// outstanding, whichever came later. The server owes a reply since then.
    since: AtomicU64,
    /// A call got no reply within its call timeout, and no reply has come since.
    silent: AtomicBool,
}

/// A call in flight, from its sending to its reply. Dropped without a verdict (its future
/// cancelled), it is no longer waited for and says nothing of the server.
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
            silent: AtomicBool::new(false),
        }
    }

    fn nanos(&self, at: Instant) -> u64 {
        duration_to_nanos(at.saturating_duration_since(self.origin))
    }

    /// A call is being sent.
    pub(crate) fn sending(&self) -> Pending<'_> {
        if self.outstanding.fetch_add(1, Ordering::AcqRel) == 0 {
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
        let last = deadline + self.timeout;
        if now >= last || self.silent.load(Ordering::Acquire) {
            return None;
        }
        let patience = self.timeout;
        let next = if self.outstanding.load(Ordering::Acquire) > 0 {
            let since = self.origin + Duration::from_nanos(self.since.load(Ordering::Acquire));
            let behind = since + patience;
            if now >= behind {
                return None;
            }
            behind
        } else {
            // Nothing sent yet: the next call starts the clock.
            now + patience
        };
        Some(next.min(last))
    }
}

impl Pending<'_> {
    /// The server replied (a result or an error of its own).
    pub(crate) fn answered(self) {
        let h = self.health;
        h.since.fetch_max(h.nanos(Instant::now()), Ordering::AcqRel);
        h.silent.store(false, Ordering::Release);
    }

    /// No reply within the call timeout.
    pub(crate) fn unanswered(self) {
        self.health.silent.store(true, Ordering::Release);
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
    async fn replies_keep_a_late_check_waiting_up_to_twice_the_timeout() {
        let h = Health::new(T);
        let submitted = Instant::now();
        let deadline = submitted + T;
        let mut call = h.sending();
        // The server answers every 40 ms while this check waits its turn.
        for _ in 0..4 {
            tokio::time::advance(ms(40)).await;
            call.answered();
            call = h.sending();
            assert!(h.gives_up(deadline, Instant::now()).is_some());
        }
        tokio::time::advance(ms(40)).await; // 200 ms
        call.answered();
        assert_eq!(h.gives_up(deadline, Instant::now()), None, "at twice the timeout");
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_unanswered_in_its_call_timeout_gives_up_every_late_check_until_a_reply() {
        let h = Health::new(T);
        let call = h.sending();
        tokio::time::advance(2 * T).await;
        call.unanswered();
        let deadline = Instant::now();
        // Nothing outstanding now, but the server has been silent.
        assert_eq!(h.gives_up(deadline, Instant::now()), None);
        let next = h.sending();
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
        let call = h.sending(); // sent at 110 ms: behind from 210 ms, past the cap (200 ms)
        tokio::time::advance(ms(40)).await;
        assert_eq!(h.gives_up(deadline, Instant::now()), Some(deadline + T));
        tokio::time::advance(ms(50)).await;
        assert_eq!(h.gives_up(deadline, Instant::now()), None);
        drop(call);
    }
}
