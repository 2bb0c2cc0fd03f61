//! [`MemoryStoreBuilder`]: a [`MemoryStore`]'s clock, capacity, sweep interval and shards.

use super::*;

/// Configures a [`MemoryStore`]; see [`MemoryStore::builder`].
///
/// ```
/// use std::time::Duration;
/// use tollgate::clock::FakeClock;
/// use tollgate::store::MemoryStore;
/// use tollgate::ConfigError;
///
/// let store = MemoryStore::builder()
///     .clock(FakeClock::new())
///     .max_keys(100_000)
///     .sweep_interval(Duration::from_secs(30))
///     .build()
///     .unwrap();
/// assert!(store.is_empty());
///
/// let err = MemoryStore::builder().max_keys(0).build().unwrap_err();
/// assert!(matches!(err, ConfigError::Invalid { setting: "max_keys", .. }));
/// ```
#[derive(Clone, Debug)]
#[must_use]
pub struct MemoryStoreBuilder {
    pub(super) clock: AnyClock,
    pub(super) max_keys: usize,
    pub(super) sweep_interval: Duration,
    pub(super) shards: usize,
}

impl MemoryStoreBuilder {
    /// The clock (default [`MonotonicClock`](crate::clock::MonotonicClock)). Tests inject a
    /// [`FakeClock`](crate::clock::FakeClock), or a [`TokioClock`](crate::clock::TokioClock)
    /// to follow `tokio::time::pause()`.
    ///
    /// A clock that can step back (a wall clock, a fake one) is handled as on the Redis store:
    /// each key of a policy with window, log or calendar tiers (or tiers of several kinds)
    /// remembers the instant of its last charge and decides at the later of now and that
    /// instant, so a step back never reopens a window; a refused check never moves it; a key
    /// whose state has become idle is forgotten with it. GCRA and the buckets only grow
    /// stricter when time goes back and decide at now. After any step back between checks
    /// both stores answer alike.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = AnyClock::new(clock);
        self
    }

    /// The clock, already recognised.
    #[cfg(feature = "redis")]
    pub(crate) fn any_clock(mut self, clock: AnyClock) -> Self {
        self.clock = clock;
        self
    }

    /// The store of the default settings and this builder's clock (never invalid).
    #[cfg(any(feature = "redis", feature = "testing"))]
    pub(crate) fn assembled(self) -> MemoryStore {
        self.assemble()
    }

    /// Hard cap on keys held (default 1,000,000); at least 1.
    pub fn max_keys(mut self, max_keys: usize) -> Self {
        self.max_keys = max_keys;
        self
    }

    /// How often the sweeper removes idle keys (default 10 s); at least 1 ms.
    pub fn sweep_interval(mut self, every: Duration) -> Self {
        self.sweep_interval = every;
        self
    }

    /// Number of shards, rounded up to a power of two (default: 4 per available core); 1 to
    /// 65,536.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards;
        self
    }

    /// Builds the store.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming `max_keys` (0), `sweep_interval` (under 1 ms) or
    /// `shards` (0 or more than 65,536).
    pub fn build(self) -> Result<MemoryStore, ConfigError> {
        let invalid = |setting, reason: &str| {
            Err(ConfigError::Invalid { setting, reason: reason.to_owned() })
        };
        if self.max_keys == 0 {
            return invalid("max_keys", "must be at least 1");
        }
        if self.sweep_interval < Duration::from_millis(1) {
            return invalid("sweep_interval", "must be at least 1 ms");
        }
        if !(1..=1 << 16).contains(&self.shards) {
            return invalid("shards", "must be between 1 and 65,536");
        }
        Ok(self.assemble())
    }

    /// The store these settings describe (already validated).
    pub(super) fn assemble(self) -> MemoryStore {
        let shards = self.shards.clamp(1, 1 << 16).next_power_of_two();
        MemoryStore {
            inner: Arc::new(Inner {
                shards: (0..shards).map(|_| Shard::default()).collect(),
                hasher: random_hasher(),
                clock: self.clock,
                len: AtomicUsize::new(0),
                max_keys: self.max_keys.max(1),
                sweep_interval: self.sweep_interval,
                sweeper: AtomicBool::new(false),
                registry: Mutex::new(Registry::default()),
                rebinding: Mutex::new(()),
            }),
        }
    }
}
