//! The circuit breaker in front of each Redis server.
//!
//! After `threshold` consecutive failed calls the breaker **opens**: calls are not attempted
//! (the store answers at once from its fallback, or with [`StoreError::CircuitOpen`]) so that
//! requests stop paying the timeout while Redis is down. After `open_for` it lets **one** probe
//! call through (half-open); the probe's success closes it, its failure (or its future being
//! dropped unfinished) opens it for another `open_for`.
//!
//! Time is tokio's clock, so `tokio::time::pause()` drives it in tests.
//!
//! [`StoreError::CircuitOpen`]: crate::StoreError::CircuitOpen

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::clock::duration_to_nanos;

/// The state of a [`RedisStore`](super::RedisStore)'s circuit breaker.
///
/// ```
/// use tollgate::store::{BreakerState, RedisStore};
///
/// # fn main() -> Result<(), tollgate::ConfigError> {
/// let store = RedisStore::builder("redis://127.0.0.1:6380/").build()?;
/// // No call has failed yet: calls go to Redis.
/// assert_eq!(store.breaker_state(), BreakerState::Closed);
/// assert_eq!(store.breaker_states(), [("127.0.0.1:6380".to_owned(), BreakerState::Closed)]);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BreakerState {
    /// Calls go to Redis.
    Closed,
    /// Recent calls failed: calls are not attempted until the open period ends.
    Open,
    /// The open period is over and one probe call is (or may be) on its way; others are still
    /// not attempted.
    HalfOpen,
}

pub(crate) struct Breaker {
    /// The node's address, for the log.
    node: std::sync::Arc<str>,
    threshold: u32,
    open_for: u64,
    origin: Instant,
    /// Consecutive failures while closed.
    failures: AtomicU32,
    /// 0 when closed; otherwise the instant (nanoseconds since `origin`, at least 1) from which
    /// a probe may be sent.
    open_until: AtomicU64,
    /// A probe is in flight.
    probing: AtomicBool,
    /// Whether the store decides on its local fallback while this breaker is open (for the
    /// log: what an open breaker means for the limits).
    fallback: bool,
}

/// Whether a call may go to Redis.
pub(crate) enum Admit<'a> {
    /// Closed: call, then report with [`Breaker::success`] / [`Breaker::failure`].
    Call,
    /// Half-open: this call is the probe; report through the guard.
    Probe(Probe<'a>),
    /// Open: do not call.
    Reject,
}

impl Breaker {
    pub(crate) fn new(node: std::sync::Arc<str>, threshold: u32, open_for: Duration) -> Self {
        Self {
            node,
            threshold: threshold.max(1),
            open_for: duration_to_nanos(open_for),
            origin: Instant::now(),
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            probing: AtomicBool::new(false),
            fallback: true,
        }
    }

    /// Says whether the store has a local fallback (the default), for the log.
    pub(crate) fn with_fallback(mut self, fallback: bool) -> Self {
        self.fallback = fallback;
        self
    }

    fn now(&self) -> u64 {
        // +1 keeps a real instant distinct from the "closed" marker 0.
        duration_to_nanos(Instant::now().saturating_duration_since(self.origin)).saturating_add(1)
    }

    pub(crate) fn state(&self) -> BreakerState {
        match self.open_until.load(Ordering::Acquire) {
            0 => BreakerState::Closed,
            until if self.now() < until => BreakerState::Open,
            _ => BreakerState::HalfOpen,
        }
    }

    pub(crate) fn admit(&self) -> Admit<'_> {
        let until = self.open_until.load(Ordering::Acquire);
        if until == 0 {
            return Admit::Call;
        }
        if self.now() < until {
            return Admit::Reject;
        }
        match self.probing.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Admit::Probe(Probe { breaker: self, done: false }),
            Err(_) => Admit::Reject,
        }
    }

    /// A call admitted while closed succeeded.
    pub(crate) fn success(&self) {
        self.failures.store(0, Ordering::Release);
    }

    /// A call admitted while closed failed.
    pub(crate) fn failure(&self) {
        let n = self.failures.fetch_add(1, Ordering::AcqRel).saturating_add(1);
        if n >= self.threshold {
            let until = self.now().saturating_add(self.open_for);
            // Only the transition from closed opens (and logs); late failures of calls that
            // were in flight do not extend the open period.
            if self
                .open_until
                .compare_exchange(0, until, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                let open_for = Duration::from_nanos(self.open_for);
                if self.fallback {
                    tracing::warn!(
                        node = %self.node,
                        failures = n,
                        ?open_for,
                        "tollgate: redis circuit breaker opened: this server's keys are now \
                         limited by this instance's local fallback, so the limits are \
                         per instance (N instances admit up to N times each limit) until the \
                         server answers again; calls are not attempted for `open_for`, then \
                         one probe is sent"
                    );
                } else {
                    tracing::warn!(
                        node = %self.node,
                        failures = n,
                        ?open_for,
                        "tollgate: redis circuit breaker opened: with no fallback, this \
                         server's checks fail until it answers again, and the layer answers \
                         them as `on_store_error` says (503 by default); calls are not \
                         attempted for `open_for`, then one probe is sent"
                    );
                }
            }
        }
    }
}

/// The one call let through while half-open. Dropped without a verdict it counts as failed.
pub(crate) struct Probe<'a> {
    breaker: &'a Breaker,
    done: bool,
}

impl Probe<'_> {
    pub(crate) fn success(mut self) {
        self.done = true;
        let b = self.breaker;
        b.failures.store(0, Ordering::Release);
        b.open_until.store(0, Ordering::Release);
        b.probing.store(false, Ordering::Release);
        tracing::info!(node = %b.node, "tollgate: redis answered the probe; circuit breaker closed");
    }

    pub(crate) fn failure(mut self) {
        self.done = true;
        self.reopen();
    }

    fn reopen(&self) {
        let b = self.breaker;
        b.open_until.store(b.now().saturating_add(b.open_for), Ordering::Release);
        b.probing.store(false, Ordering::Release);
        tracing::debug!(node = %b.node, "tollgate: redis probe failed; circuit breaker stays open");
    }
}

impl Drop for Probe<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.reopen();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPEN_FOR: Duration = Duration::from_millis(500);

    fn call(b: &Breaker) -> bool {
        matches!(b.admit(), Admit::Call)
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_threshold_consecutive_failures_only() {
        let b = Breaker::new("test".into(), 3, OPEN_FOR);
        b.failure();
        b.failure();
        b.success(); // resets the run
        b.failure();
        b.failure();
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(call(&b));
        b.failure();
        assert_eq!(b.state(), BreakerState::Open);
        assert!(matches!(b.admit(), Admit::Reject));
    }

    #[tokio::test(start_paused = true)]
    async fn half_open_lets_exactly_one_probe_through() {
        let b = Breaker::new("test".into(), 1, OPEN_FOR);
        b.failure();
        tokio::time::advance(OPEN_FOR - Duration::from_nanos(1)).await;
        assert!(matches!(b.admit(), Admit::Reject), "still open 1 ns before the end");
        tokio::time::advance(Duration::from_nanos(1)).await;
        assert_eq!(b.state(), BreakerState::HalfOpen);
        let Admit::Probe(probe) = b.admit() else { panic!("expected the probe") };
        assert!(matches!(b.admit(), Admit::Reject), "a second caller is not a probe");
        probe.success();
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(call(&b));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_or_abandoned_probe_reopens_for_a_full_period() {
        let b = Breaker::new("test".into(), 1, OPEN_FOR);
        b.failure();
        tokio::time::advance(OPEN_FOR).await;
        let Admit::Probe(probe) = b.admit() else { panic!("expected the probe") };
        probe.failure();
        assert_eq!(b.state(), BreakerState::Open);
        tokio::time::advance(OPEN_FOR).await;
        let Admit::Probe(probe) = b.admit() else { panic!("expected the probe") };
        drop(probe);
        assert_eq!(b.state(), BreakerState::Open);
        tokio::time::advance(OPEN_FOR).await;
        assert!(matches!(b.admit(), Admit::Probe(_)));
    }

    /// The warning an open breaker logs says what it means for the limits.
    #[test]
    fn the_opening_warning_says_what_the_limits_become() {
        use std::sync::{Arc, Mutex};
        #[derive(Clone, Default)]
        struct Buffer(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        let _entered = runtime.enter();
        for (fallback, says) in [
            (true, "limited by this instance's local fallback, so the limits are per instance"),
            (false, "with no fallback, this server's checks fail"),
        ] {
            let buffer = Buffer::default();
            let writer = buffer.clone();
            let subscriber = tracing_subscriber::fmt()
                .with_ansi(false)
                .with_writer(move || writer.clone())
                .finish();
            tracing::subscriber::with_default(subscriber, || {
                let b = Breaker::new("127.0.0.1:1".into(), 2, OPEN_FOR).with_fallback(fallback);
                b.failure();
                b.failure();
                b.failure(); // already open: not logged again
            });
            let logged = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
            assert_eq!(logged.matches("WARN").count(), 1, "{logged}");
            assert!(logged.contains(says), "{logged}");
            assert!(logged.contains("node=127.0.0.1:1 failures=2 open_for=500ms"), "{logged}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn late_failures_do_not_extend_the_open_period() {
        let b = Breaker::new("test".into(), 1, OPEN_FOR);
        b.failure();
        tokio::time::advance(OPEN_FOR / 2).await;
        b.failure(); // a call that was in flight when the breaker opened
        tokio::time::advance(OPEN_FOR / 2).await;
        assert_eq!(b.state(), BreakerState::HalfOpen);
    }
}
