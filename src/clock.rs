//! Time sources.
//!
//! Every algorithm is a pure state transition over an instant read from a [`Clock`], so tests
//! drive it with a [`FakeClock`] (or a [`TokioClock`] under `tokio::time::pause()`) and the Redis
//! scripts can be checked against the Rust version on the same trace. Instants are
//! **nanoseconds** as `u64` (about 584 years); the built-in clocks count from the Unix epoch,
//! so that windows line up with Redis's (which uses the server's `TIME`) and with the
//! calendar.
//!
//! Stores read their clock on every decision, so the built-in clocks are dispatched without a
//! dynamic call; any other [`Clock`] works too, behind one pointer.
//!
//! ```
//! use std::time::Duration;
//! use tollgate::clock::FakeClock;
//! use tollgate::key::Key;
//! use tollgate::store::MemoryStore;
//! use tollgate::{Limiter, Policy, Quota};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let clock = FakeClock::new();
//! let store = MemoryStore::builder().clock(clock.clone()).build()?;
//! let limiter = Limiter::with_store(Policy::single("p", Quota::per_second(1))?, store)?;
//! let key = Key::text("k");
//! assert!(limiter.check(&key, 1).await?.is_allowed());
//! assert!(!limiter.check(&key, 1).await?.is_allowed());
//! clock.advance(Duration::from_secs(1)); // time moves only when the test says so
//! assert!(limiter.check(&key, 1).await?.is_allowed());
//! # Ok(()) }
//! ```

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A source of monotonic instants, in nanoseconds since a clock-specific epoch.
///
/// Implementations should never go backwards; the algorithms treat an instant earlier than the
/// last one seen as "no time has passed" (no refill), never as a reason to admit more.
///
/// ```
/// use tollgate::clock::Clock;
///
/// /// A clock that stands still at one instant.
/// struct Frozen(u64);
///
/// impl Clock for Frozen {
///     fn now(&self) -> u64 {
///         self.0
///     }
/// }
/// assert_eq!(Frozen(7).now(), 7);
/// ```
pub trait Clock: Send + Sync + 'static {
    /// The current instant, in nanoseconds since this clock's epoch.
    fn now(&self) -> u64;
}

/// The stores' default clock, monotonic, in nanoseconds since the Unix epoch. The system clock
/// is read once, when the clock is made, and the monotonic clock counts from there, so a later
/// step of the system clock does not move it. It does not follow `tokio::time::pause()`
/// (tests on a paused tokio clock use [`TokioClock`]).
///
/// ```
/// use tollgate::clock::{Clock, MonotonicClock};
///
/// let clock = MonotonicClock::new();
/// let (a, b) = (clock.now(), clock.now());
/// assert!(b >= a); // never backwards
/// assert!(a > 1_700_000_000_000_000_000); // nanoseconds since 1970: after November 2023
/// ```
///
/// # How it works
///
/// It reads the CPU's time-stamp counter where it is reliable (an invariant TSC), calibrated
/// against the OS clock, and the OS's monotonic clock otherwise (the
/// [`quanta`](https://docs.rs/quanta) crate, which governor uses too). A reading of the TSC
/// costs a fraction of what `std::time::Instant::now()` costs.
#[derive(Debug, Clone)]
pub struct MonotonicClock {
    // An instance rather than quanta's global clock: reading it skips the thread-local mock
    // check the global one makes on every call.
    clock: quanta::Clock,
    /// The raw counter at creation: instants are scaled deltas from it, with no `Duration` in
    /// between.
    origin: u64,
    /// Nanoseconds since the Unix epoch at creation.
    unix: u64,
}

/// Nanoseconds since the Unix epoch now, by the system clock (0 before 1970).
fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, duration_to_nanos)
}

impl MonotonicClock {
    /// A clock reading the system clock once, now.
    #[must_use]
    pub fn new() -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        Self { clock, origin, unix: unix_now() }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    #[inline]
    fn now(&self) -> u64 {
        self.unix.saturating_add(self.clock.delta_as_nanos(self.origin, self.clock.raw()))
    }
}

/// tokio's clock ([`tokio::time::Instant`]), as nanoseconds since the Unix epoch (the system
/// clock is read once, when the clock is made, and tokio's clock counts from there).
///
/// Because it reads tokio's clock, a test that calls `tokio::time::pause()` (or uses
/// `#[tokio::test(start_paused = true)]`) controls it together with every `tokio::time::sleep`
/// the layer makes while shaping: delays come out exact.
///
/// ```
/// use std::time::Duration;
/// use tollgate::clock::{Clock, TokioClock};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let clock = TokioClock::new();
/// let start = clock.now();
/// tokio::time::sleep(Duration::from_secs(3)).await; // paused: returns at once
/// assert_eq!(clock.now() - start, 3_000_000_000);
/// # }
/// ```
#[derive(Clone, Copy)]
pub struct TokioClock {
    origin: tokio::time::Instant,
    /// Nanoseconds since the Unix epoch at creation.
    unix: u64,
}

impl TokioClock {
    /// A clock reading the system clock once, now.
    #[must_use]
    pub fn new() -> Self {
        Self::from_unix(unix_now())
    }

    /// A clock at `unix` nanoseconds since the Unix epoch now.
    pub(crate) fn from_unix(unix: u64) -> Self {
        Self { origin: tokio::time::Instant::now(), unix }
    }
}

impl fmt::Debug for TokioClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let now = self.now();
        match jiff::Timestamp::from_nanosecond(i128::from(now)) {
            Ok(at) => write!(f, "TokioClock({at})"),
            Err(_) => write!(f, "TokioClock({now} ns since the Unix epoch)"),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    fn now(&self) -> u64 {
        let elapsed = tokio::time::Instant::now().saturating_duration_since(self.origin);
        self.unix.saturating_add(duration_to_nanos(elapsed))
    }
}

/// A clock that only moves when told to: for deterministic tests. It starts at 0 (the Unix
/// epoch) unless [`set`](Self::set).
///
/// Clones share the same instant.
///
/// ```
/// use std::time::Duration;
/// use tollgate::clock::{Clock, FakeClock};
///
/// let clock = FakeClock::new();
/// clock.advance(Duration::from_millis(1500));
/// assert_eq!(clock.now(), 1_500_000_000);
/// ```
#[derive(Debug, Clone, Default)]
pub struct FakeClock {
    nanos: Arc<AtomicU64>,
}

impl FakeClock {
    /// A fake clock at instant 0.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the clock forward by `by` (saturating at `u64::MAX` nanoseconds).
    pub fn advance(&self, by: Duration) {
        let by = duration_to_nanos(by);
        let _ = self
            .nanos
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| Some(t.saturating_add(by)));
    }

    /// Sets the clock to `nanos` nanoseconds since its epoch (it may go backwards: tests of
    /// clock steps use this).
    pub fn set(&self, nanos: u64) {
        self.nanos.store(nanos, Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> u64 {
        self.nanos.load(Ordering::SeqCst)
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> u64 {
        (**self).now()
    }
}

/// A clock as stores keep it: the built-in clocks inline (a `match`, no dynamic call per
/// decision), any other behind a pointer.
#[derive(Clone)]
pub(crate) enum AnyClock {
    Monotonic(MonotonicClock),
    Tokio(TokioClock),
    Fake(FakeClock),
    Other(Arc<dyn Clock>),
}

impl AnyClock {
    /// Recognises the built-in clocks.
    pub(crate) fn new<C: Clock>(clock: C) -> Self {
        let any = &clock as &dyn Any;
        if let Some(c) = any.downcast_ref::<MonotonicClock>() {
            return Self::Monotonic(c.clone());
        }
        if let Some(c) = any.downcast_ref::<TokioClock>() {
            return Self::Tokio(*c);
        }
        if let Some(c) = any.downcast_ref::<FakeClock>() {
            return Self::Fake(c.clone());
        }
        if let Some(c) = any.downcast_ref::<Arc<dyn Clock>>() {
            return Self::Other(Arc::clone(c));
        }
        Self::Other(Arc::new(clock))
    }

    #[inline]
    pub(crate) fn now(&self) -> u64 {
        match self {
            Self::Monotonic(c) => c.now(),
            Self::Tokio(c) => c.now(),
            Self::Fake(c) => c.now(),
            Self::Other(c) => c.now(),
        }
    }
}

impl std::fmt::Debug for AnyClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Monotonic(_) => "MonotonicClock",
            Self::Tokio(_) => "TokioClock",
            Self::Fake(_) => "FakeClock",
            Self::Other(_) => "Clock",
        })
    }
}

impl Default for AnyClock {
    fn default() -> Self {
        Self::Monotonic(MonotonicClock::new())
    }
}

/// A `Duration` as whole nanoseconds, saturating at `u64::MAX` (about 584 years).
pub(crate) fn duration_to_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
