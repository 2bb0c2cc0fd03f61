//! Testing your limits: a virtual clock, the rate-limit headers as typed values, and one-line
//! assertions.
//!
//! - [`VirtualClock`] starts at an instant the test chooses and then follows tokio's clock, so
//!   under `tokio::time::pause()` (or `#[tokio::test(start_paused = true)]`) one
//!   `tokio::time::advance` moves the [`MemoryStore`], a `RedisStore` given the same clock,
//!   calendar windows (computed from the store's clock) and the layer's shaping waits (which
//!   are tokio sleeps) together. A month passes in microseconds of test time.
//! - [`RateLimitHeaders`] reads a response's `RateLimit` / `RateLimit-Policy`
//!   (draft-ietf-httpapi-ratelimit-headers-10), legacy `X-RateLimit-*` and `Retry-After`
//!   (RFC 9110 §10.2.3).
//! - [`assert_admitted`] and [`assert_limited_until`] check a response in one line and, when it
//!   is not what the test expected, panic with its status and headers.
//!
//! An axum app with a monthly quota in Berlin, tested across the change to summer time (the
//! night of 28 to 29 March 2026, when Sunday has 23 hours):
//!
//! ```
//! use std::time::Duration;
//! use axum::{Router, body::Body, routing::get};
//! use http::Request;
//! use tollgate::key::GlobalKey;
//! use tollgate::testing::{VirtualClock, assert_admitted, assert_limited_until};
//! use tollgate::{Calendar, Policy, RateLimitLayer};
//! use tower::ServiceExt;
//!
//! // In your tests: #[tokio::test(start_paused = true)] async fn monthly_quota() -> ...
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let clock = VirtualClock::starting_at("2026-03-28T12:00:00+01:00")?;
//! let policy = Policy::builder("plan")
//!     .calendar("monthly", Calendar::per_month(3).in_time_zone("Europe/Berlin"))
//!     .build()?;
//! let layer = RateLimitLayer::builder(policy).key(GlobalKey).store(clock.memory_store());
//! let app = Router::new().route("/", get(|| async { "ok" })).layer(layer.build()?);
//! let call = || app.clone().oneshot(Request::get("/").body(Body::empty()).unwrap());
//!
//! for _ in 0..3 {
//!     assert_admitted(&call().await?);
//! }
//! // Refused until midnight of the 1st in Berlin: 83 hours away, not 84.
//! assert_limited_until(&call().await?, clock.until("2026-04-01T00:00:00+02:00")?);
//! assert_limited_until(&call().await?, Duration::from_secs(83 * 3600));
//!
//! clock.advance_to("2026-03-31T23:59:59+02:00").await?;
//! assert_limited_until(&call().await?, Duration::from_secs(1));
//! clock.advance(Duration::from_secs(1)).await;
//! let headers = assert_admitted(&call().await?);
//! let monthly = headers.get("monthly").unwrap();
//! assert_eq!(monthly.remaining, 2);
//! assert_eq!(monthly.reset, Some(Duration::from_secs(30 * 24 * 3600))); // April: 30 days
//! # Ok(()) }
//! ```

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, Response, StatusCode, header};

use crate::clock::{Clock, duration_to_nanos};
use crate::hints;
use crate::store::MemoryStore;

/// A timestamp that [`VirtualClock`] could not take: not RFC 3339 with an offset, before the
/// Unix epoch or after 2554 (the clocks count `u64` nanoseconds from the epoch), or an instant
/// the clock cannot move to (one before its now).
///
/// ```
/// use tollgate::testing::VirtualClock;
///
/// let err = VirtualClock::starting_at("next Tuesday").unwrap_err();
/// assert!(err.to_string().starts_with("invalid timestamp \"next Tuesday\""));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid timestamp {input:?}: {reason}")]
pub struct InvalidTimestamp {
    input: String,
    reason: String,
}

impl InvalidTimestamp {
    fn new(input: &str, reason: impl fmt::Display) -> Self {
        Self { input: input.to_owned(), reason: reason.to_string() }
    }
}

/// Nanoseconds since the Unix epoch of an RFC 3339 timestamp with an offset (`Z`, `+01:00`; a
/// trailing `[Europe/Berlin]` annotation is allowed and ignored).
fn parse_nanos(rfc3339: &str) -> Result<u64, InvalidTimestamp> {
    let ts: jiff::Timestamp = rfc3339.parse().map_err(|e| InvalidTimestamp::new(rfc3339, e))?;
    u64::try_from(ts.as_nanosecond()).map_err(|_| {
        InvalidTimestamp::new(rfc3339, "outside 1970-01-01 to 2554-07-21 (u64 nanoseconds)")
    })
}

/// An instant as RFC 3339 in UTC, for messages.
fn show(nanos: u64) -> String {
    jiff::Timestamp::from_nanosecond(i128::from(nanos))
        .map_or_else(|_| format!("{nanos} ns since the Unix epoch"), |t| t.to_string())
}

/// The clock of tests: [`TokioClock`](crate::clock::TokioClock), started at an instant the
/// test chooses ([`starting_at`](crate::clock::TokioClock::starting_at)), then following
/// tokio's clock, so that `tokio::time::advance` moves the store, calendar windows and shaping
/// waits together. Give one clock (clones share it) to the [`MemoryStore`]
/// ([`memory_store`](crate::clock::TokioClock::memory_store)) or to `RedisStoreBuilder::clock`.
///
/// ```
/// use std::time::Duration;
/// use tollgate::clock::Clock;
/// use tollgate::testing::VirtualClock;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// let clock = VirtualClock::starting_at("2026-03-28T12:00:00+01:00").unwrap();
/// assert_eq!(clock.now(), 1_774_695_600_000_000_000); // 11:00 UTC
/// tokio::time::advance(Duration::from_millis(1500)).await;
/// assert_eq!(clock.now(), 1_774_695_601_500_000_000);
/// assert_eq!(format!("{clock:?}"), "TokioClock(2026-03-28T11:00:01.5Z)");
/// # }
/// ```
pub type VirtualClock = crate::clock::TokioClock;

/// The constructors and moves of a clock for tests: [`VirtualClock`] is [`TokioClock`]
/// (feature `testing`).
///
/// [`TokioClock`]: crate::clock::TokioClock
impl crate::clock::TokioClock {
    /// A clock at `time` now (an instant before the Unix epoch counts as the epoch).
    ///
    /// ```
    /// use std::time::{Duration, UNIX_EPOCH};
    /// use tollgate::clock::Clock;
    /// use tollgate::testing::VirtualClock;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let clock = VirtualClock::at(UNIX_EPOCH + Duration::from_secs(86_400));
    /// assert_eq!(clock.now(), 86_400_000_000_000);
    /// # }
    /// ```
    #[must_use]
    pub fn at(time: SystemTime) -> Self {
        let start = time.duration_since(UNIX_EPOCH).map_or(0, duration_to_nanos);
        Self::from_unix(start)
    }

    /// A clock at the RFC 3339 timestamp `rfc3339` now: `"2026-03-28T12:00:00+01:00"`,
    /// `"2026-03-28T11:00:00Z"` (an offset is required; a trailing `[Europe/Berlin]` is
    /// allowed and ignored).
    ///
    /// # Errors
    ///
    /// [`InvalidTimestamp`] when `rfc3339` does not parse, or is before 1970 or after 2554.
    ///
    /// ```
    /// use tollgate::testing::VirtualClock;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let a = VirtualClock::starting_at("2026-03-29T03:00:00+02:00").unwrap();
    /// let b = VirtualClock::starting_at("2026-03-29T01:00:00Z[Europe/Berlin]").unwrap();
    /// assert_eq!(a.now_time(), b.now_time());
    /// assert!(VirtualClock::starting_at("2026-03-29T03:00:00").is_err()); // no offset
    /// assert!(VirtualClock::starting_at("1969-12-31T23:59:59Z").is_err());
    /// # }
    /// ```
    pub fn starting_at(rfc3339: &str) -> Result<Self, InvalidTimestamp> {
        let start = parse_nanos(rfc3339)?;
        Ok(Self::from_unix(start))
    }

    /// The clock's now as a [`SystemTime`].
    ///
    /// ```
    /// use std::time::{Duration, UNIX_EPOCH};
    /// use tollgate::testing::VirtualClock;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let clock = VirtualClock::starting_at("1970-01-02T00:00:00Z").unwrap();
    /// assert_eq!(clock.now_time(), UNIX_EPOCH + Duration::from_secs(86_400));
    /// # }
    /// ```
    #[must_use]
    pub fn now_time(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_nanos(self.now())
    }

    /// How long from the clock's now until the RFC 3339 timestamp `rfc3339` (as
    /// [`starting_at`](Self::starting_at) reads it): what [`assert_limited_until`] expects of a
    /// request refused until then.
    ///
    /// # Errors
    ///
    /// [`InvalidTimestamp`] when `rfc3339` does not parse or is before the clock's now.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::testing::VirtualClock;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// // Saturday noon to Sunday noon in Berlin, across the change to summer time: 23 hours.
    /// let clock = VirtualClock::starting_at("2026-03-28T12:00:00+01:00").unwrap();
    /// let sunday_noon = clock.until("2026-03-29T12:00:00+02:00").unwrap();
    /// assert_eq!(sunday_noon, Duration::from_secs(23 * 3600));
    /// assert!(clock.until("2026-03-28T11:59:59+01:00").is_err());
    /// # }
    /// ```
    pub fn until(&self, rfc3339: &str) -> Result<Duration, InvalidTimestamp> {
        let at = parse_nanos(rfc3339)?;
        let now = self.now();
        at.checked_sub(now).map(Duration::from_nanos).ok_or_else(|| {
            InvalidTimestamp::new(rfc3339, format_args!("before the clock's now, {}", show(now)))
        })
    }

    /// Moves tokio's paused clock, and with it this clock, forward by `by`, running the
    /// timers that fall due ([`tokio::time::advance`]).
    ///
    /// # Panics
    ///
    /// As [`tokio::time::advance`] does: outside a tokio runtime, or when tokio's clock is not
    /// paused (`tokio::time::pause()`, `#[tokio::test(start_paused = true)]`).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::testing::VirtualClock;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let clock = VirtualClock::starting_at("2026-01-31T00:00:00Z").unwrap();
    /// clock.advance(Duration::from_secs(86_400)).await;
    /// assert_eq!(clock.until("2026-02-01T00:00:00Z").unwrap(), Duration::ZERO);
    /// # }
    /// ```
    pub async fn advance(&self, by: Duration) {
        tokio::time::advance(by).await;
    }

    /// Moves tokio's paused clock, and with it this clock, forward to the RFC 3339 timestamp
    /// `rfc3339` (see [`advance`](Self::advance)).
    ///
    /// # Errors
    ///
    /// [`InvalidTimestamp`] when `rfc3339` does not parse or is before the clock's now (the
    /// clock does not go back); the clock is then not moved.
    ///
    /// # Panics
    ///
    /// As [`advance`](Self::advance).
    ///
    /// ```
    /// use tollgate::testing::VirtualClock;
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
    /// let clock = VirtualClock::starting_at("2026-03-28T12:00:00+01:00").unwrap();
    /// clock.advance_to("2026-04-01T00:00:00+02:00").await.unwrap();
    /// assert_eq!(format!("{clock:?}"), "TokioClock(2026-03-31T22:00:00Z)");
    /// assert!(clock.advance_to("2026-03-31T00:00:00Z").await.is_err());
    /// # }
    /// ```
    pub async fn advance_to(&self, rfc3339: &str) -> Result<(), InvalidTimestamp> {
        let by = self.until(rfc3339)?;
        self.advance(by).await;
        Ok(())
    }

    /// Moves tokio's running clock, and with it this clock, forward by `by`: pauses it,
    /// advances it (see [`advance`](Self::advance)) and resumes it.
    ///
    /// For tests that talk to a server, as with a `RedisStore`: they cannot run on a paused
    /// clock, because a paused runtime with nothing to do but wait for the network moves its
    /// clock to the next timer (tokio's auto-advance), so that round trips take virtual seconds
    /// (the store's timeouts, the connection's timers). Such a test runs on tokio's real clock
    /// (which this clock follows from the instant the test chose), and jumps. Between jumps real
    /// time passes: a few milliseconds, which whole-second headers such as `Retry-After` do not
    /// show when the test starts on a whole second.
    ///
    /// # Panics
    ///
    /// As [`tokio::time::pause`] does: outside a current-thread tokio runtime, or when tokio's
    /// clock is already paused (then call [`advance`](Self::advance)).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::clock::Clock;
    /// use tollgate::testing::VirtualClock;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let clock = VirtualClock::starting_at("2026-03-28T12:00:00+01:00").unwrap();
    /// clock.jump(Duration::from_secs(83 * 3600 - 1)).await;
    /// // One second to midnight in Berlin, less the real time the test took so far.
    /// let left = clock.until("2026-04-01T00:00:00+02:00").unwrap();
    /// assert!(left <= Duration::from_secs(1), "{left:?}");
    /// # }
    /// ```
    pub async fn jump(&self, by: Duration) {
        tokio::time::pause();
        tokio::time::advance(by).await;
        tokio::time::resume();
    }

    /// A [`MemoryStore`] of the default settings on this clock.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::key::Key;
    /// use tollgate::testing::VirtualClock;
    /// use tollgate::{Limiter, Policy, Quota};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let clock = VirtualClock::starting_at("2026-03-28T12:00:00+01:00")?;
    /// let policy = Policy::single("p", Quota::per_minute(1))?;
    /// let limiter = Limiter::with_store(policy, clock.memory_store())?;
    /// assert!(limiter.check(&Key::Global, 1).await?.is_allowed());
    /// assert!(!limiter.check(&Key::Global, 1).await?.is_allowed());
    /// tokio::time::advance(Duration::from_secs(60)).await;
    /// assert!(limiter.check(&Key::Global, 1).await?.is_allowed());
    /// # Ok(()) }
    /// ```
    #[must_use]
    pub fn memory_store(&self) -> MemoryStore {
        MemoryStore::builder().clock(*self).assembled()
    }
}

/// One quota a response reports: an item of the `RateLimit` field with what the
/// `RateLimit-Policy` item of the same name says about it
/// (draft-ietf-httpapi-ratelimit-headers-10), or the legacy `X-RateLimit-*` fields.
///
/// Times are whole seconds, as the fields carry them (tollgate rounds them up).
///
/// ```
/// use std::time::Duration;
/// use http::HeaderMap;
/// use tollgate::testing::RateLimitHeaders;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("ratelimit-policy", r#""burst";q=10;w=1, "upload";q=1000;w=1;qu="content-bytes""#.parse().unwrap());
/// headers.insert("ratelimit", r#""burst";r=7;t=1, "upload";r=0;t=1"#.parse().unwrap());
/// let parsed = RateLimitHeaders::from_headers(&headers);
/// let upload = parsed.get("upload").unwrap();
/// assert_eq!(upload.name.as_deref(), Some("upload"));
/// assert_eq!((upload.remaining, upload.quota), (0, Some(1000)));
/// assert_eq!(upload.window, Some(Duration::from_secs(1)));
/// assert_eq!(upload.reset, Some(Duration::from_secs(1)));
/// assert_eq!(upload.unit.as_deref(), Some("content-bytes"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReportedQuota {
    /// The quota policy's name (the item's key); `None` for the legacy `X-RateLimit-*` fields.
    pub name: Option<String>,
    /// Units left now (`r`; `X-RateLimit-Remaining`).
    pub remaining: u64,
    /// How long until the quota is full again (`t`; `X-RateLimit-Reset`, seconds from now),
    /// when reported.
    pub reset: Option<Duration>,
    /// Units per window (`q` of `RateLimit-Policy`; `X-RateLimit-Limit`), when reported.
    pub quota: Option<u64>,
    /// The window (`w` of `RateLimit-Policy`), when reported.
    pub window: Option<Duration>,
    /// The quota unit (`qu` of `RateLimit-Policy`: `"content-bytes"`,
    /// `"concurrent-requests"`); `None` when not given, which means requests.
    pub unit: Option<String>,
}

/// The rate-limit headers of a response as typed values, every quota it reports and its
/// `Retry-After`. Reading is total, a field that does not parse counting as absent.
///
/// ```
/// use std::time::Duration;
/// use http::Response;
/// use tollgate::testing::RateLimitHeaders;
///
/// let res = Response::builder()
///     .status(429)
///     .header("retry-after", "60")
///     .header("ratelimit-policy", r#""burst";q=10;w=1, "daily";q=1000;w=86400"#)
///     .header("ratelimit", r#""burst";r=7;t=1, "daily";r=0;t=60"#)
///     .body(())
///     .unwrap();
/// let headers = RateLimitHeaders::from_response(&res);
/// assert_eq!(headers.retry_after, Some(Duration::from_secs(60)));
/// assert_eq!(headers.quotas.len(), 2);
/// let daily = headers.get("daily").unwrap();
/// assert_eq!((daily.remaining, daily.quota), (0, Some(1000)));
/// assert_eq!(daily.window, Some(Duration::from_secs(86_400)));
/// assert_eq!(daily.reset, Some(Duration::from_secs(60)));
/// ```
///
/// # Which fields are read
///
/// Quotas come from the IETF `RateLimit` field (each item's `r` and `t`, with `q`, `w` and
/// `qu` of the `RateLimit-Policy` item of the same name; the first 16 items) when it is present
/// and valid, otherwise from the legacy `X-RateLimit-Limit` / `-Remaining` / `-Reset` (one
/// quota, unnamed; a `-Reset` above 10^9 is a Unix timestamp, taken relative to the `Date`
/// header, else the system clock). Drafts 7 and 6 of the IETF fields
/// ([`HeaderFormat`](crate::HeaderFormat)) are read through the `X-RateLimit-*` fields only:
/// test them with [`HeaderStyle::Both`](crate::HeaderStyle::Both).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RateLimitHeaders {
    /// The quotas reported, in the order of the field.
    pub quotas: Vec<ReportedQuota>,
    /// `Retry-After` (RFC 9110 §10.2.3): delay-seconds, or an HTTP-date relative to the `Date`
    /// header (else the system clock); `None` when absent or malformed.
    pub retry_after: Option<Duration>,
}

impl RateLimitHeaders {
    /// Reads the headers of `res` (see [`from_headers`](Self::from_headers)).
    ///
    /// ```
    /// use http::Response;
    /// use tollgate::testing::RateLimitHeaders;
    ///
    /// let res = Response::builder().header("x-ratelimit-remaining", "4").body(()).unwrap();
    /// let quota = &RateLimitHeaders::from_response(&res).quotas[0];
    /// assert_eq!((quota.name.as_deref(), quota.remaining), (None, 4));
    /// ```
    #[must_use]
    pub fn from_response<B>(res: &Response<B>) -> Self {
        Self::from_headers(res.headers())
    }

    /// Reads `headers`; what is absent or malformed is left out.
    ///
    /// ```
    /// use http::HeaderMap;
    /// use tollgate::testing::RateLimitHeaders;
    ///
    /// let mut headers = HeaderMap::new();
    /// headers.insert("ratelimit", "((".parse().unwrap());
    /// headers.insert("retry-after", "soon".parse().unwrap());
    /// assert_eq!(RateLimitHeaders::from_headers(&headers), RateLimitHeaders::default());
    /// ```
    #[must_use]
    pub fn from_headers(headers: &HeaderMap) -> Self {
        let quotas = match hints::ietf_items(headers) {
            Some(items) => items
                .into_iter()
                .map(|item| ReportedQuota {
                    name: Some(item.name.into()),
                    remaining: item.remaining,
                    reset: item.reset,
                    quota: item.quota,
                    window: item.window,
                    unit: item.unit.map(Into::into),
                })
                .collect(),
            None => hints::legacy(headers)
                .into_iter()
                .map(|legacy| ReportedQuota {
                    name: None,
                    remaining: legacy.remaining,
                    reset: legacy.reset,
                    quota: legacy.limit,
                    window: None,
                    unit: None,
                })
                .collect(),
        };
        Self { quotas, retry_after: hints::retry_after(headers) }
    }

    /// The quota named `name`, if reported.
    ///
    /// ```
    /// use http::Response;
    /// use tollgate::testing::RateLimitHeaders;
    ///
    /// let res = Response::builder().header("ratelimit", r#""daily";r=3;t=9"#).body(()).unwrap();
    /// let headers = RateLimitHeaders::from_response(&res);
    /// assert_eq!(headers.get("daily").map(|q| q.remaining), Some(3));
    /// assert!(headers.get("monthly").is_none());
    /// ```
    #[must_use]
    pub fn get(&self, name: &str) -> Option<&ReportedQuota> {
        self.quotas.iter().find(|q| q.name.as_deref() == Some(name))
    }
}

/// The status line and headers of `res`, one per line, for a panic message.
fn describe<B>(res: &Response<B>) -> String {
    let mut out = format!("{:?} {}", res.version(), res.status());
    for (name, value) in res.headers() {
        out.push_str("\n  ");
        out.push_str(name.as_str());
        out.push_str(": ");
        out.push_str(&String::from_utf8_lossy(value.as_bytes()));
    }
    out
}

/// gRPC's `RESOURCE_EXHAUSTED` and `UNAVAILABLE`, as `grpc-status` values.
fn grpc_refusal<B>(res: &Response<B>) -> bool {
    res.headers().get("grpc-status").is_some_and(|s| s == "8" || s == "14")
}

/// Asserts that `res` was admitted: its status is neither 429 (limited) nor 503 (a store
/// failure that fails closed, or the handler's own), it carries no `Retry-After`, and no
/// `grpc-status` of `RESOURCE_EXHAUSTED` (8) or `UNAVAILABLE` (14). Returns its rate-limit
/// headers for further checks.
///
/// # Panics
///
/// When `res` is not admitted, with a message showing its status and headers.
///
/// ```
/// use http::Response;
/// use tollgate::testing::assert_admitted;
///
/// let ok = Response::builder().header("ratelimit", r#""burst";r=9;t=1"#).body(()).unwrap();
/// assert_eq!(assert_admitted(&ok).get("burst").unwrap().remaining, 9);
///
/// let refused = Response::builder().status(429).header("retry-after", "1").body(()).unwrap();
/// let check = std::panic::AssertUnwindSafe(|| assert_admitted(&refused));
/// let panic = std::panic::catch_unwind(check).unwrap_err();
/// let message = panic.downcast_ref::<String>().unwrap();
/// assert!(message.starts_with("expected the request to be admitted, got HTTP/1.1 429"));
/// assert!(message.contains("\n  retry-after: 1"));
/// ```
#[track_caller]
pub fn assert_admitted<B>(res: &Response<B>) -> RateLimitHeaders {
    let status = res.status();
    let refused = status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::SERVICE_UNAVAILABLE
        || res.headers().contains_key(header::RETRY_AFTER)
        || grpc_refusal(res);
    assert!(!refused, "expected the request to be admitted, got {}", describe(res));
    RateLimitHeaders::from_response(res)
}

/// Asserts that `res` is a refusal (429) whose `Retry-After` tells the client to come back in
/// `expected`, rounded up to whole seconds and at least 1, as the layer writes it. For a
/// refusal until an instant, pass [`VirtualClock::until`] of it. Returns its rate-limit
/// headers for further checks.
///
/// # Panics
///
/// When `res` is not a 429, or its `Retry-After` is absent or not the expected one, with a
/// message showing its status and headers.
///
/// ```
/// use std::time::Duration;
/// use http::Response;
/// use tollgate::testing::assert_limited_until;
///
/// let res = Response::builder()
///     .status(429)
///     .header("retry-after", "2")
///     .header("ratelimit", r#""burst";r=0;t=2"#)
///     .body(())
///     .unwrap();
/// let headers = assert_limited_until(&res, Duration::from_millis(1500)); // 1.5 s: "2"
/// assert_eq!(headers.get("burst").unwrap().remaining, 0);
///
/// let check = std::panic::AssertUnwindSafe(|| assert_limited_until(&res, Duration::from_secs(3)));
/// let panic = std::panic::catch_unwind(check).unwrap_err();
/// let message = panic.downcast_ref::<String>().unwrap();
/// assert!(message.starts_with("expected a refusal with Retry-After: 3 (3s), got HTTP/1.1 429"));
/// ```
#[track_caller]
pub fn assert_limited_until<B>(res: &Response<B>, expected: Duration) -> RateLimitHeaders {
    let secs = crate::headers::ceil_secs(expected).max(1);
    let retry_after = res.headers().get(header::RETRY_AFTER);
    let matches = res.status() == StatusCode::TOO_MANY_REQUESTS
        && retry_after.is_some_and(|v| v.to_str().is_ok_and(|v| v.trim() == secs.to_string()));
    assert!(
        matches,
        "expected a refusal with Retry-After: {secs} ({expected:?}), got {}",
        describe(res)
    );
    RateLimitHeaders::from_response(res)
}
