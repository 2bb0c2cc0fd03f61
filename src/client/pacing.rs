//! [`PacingLayer`], [`Pacing`] and its [`ResponseFuture`]: requests held until the server would
//! accept them, from what its responses said.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tokio::sync::Notify;
use tokio::time::Instant;
use tower_layer::Layer;
use tower_service::Service;

use crate::hints::{self, MAX_QUOTAS, Reported};
use crate::key::{Key, KeyExtractor, RequestHead};

/// Partitions beyond this many are swept of those that would delay nothing.
const MAX_PARTITIONS: usize = 4096;

/// The longest wait a response can impose (one year): later instants would overflow
/// [`Instant`], and no server means them.
const MAX_WAIT: Duration = Duration::from_secs(365 * 86_400);

/// The reports a quota keeps for the requests in flight, at most.
const MAX_RECENT: usize = 64;

/// The shortest span from which a refill rate is learned: over a shorter one the anchor's round
/// trip (in the span) and the unit given up for the whole part of `r` leave a weak bound.
const MIN_LEARNING_SPAN: Duration = Duration::from_secs(1);

/// The default partition key of [`PacingLayer`]: the URI's authority (host, lower-cased, and
/// port when the URI gives one), so every server is paced on its own. A request whose URI has
/// no authority (a relative URI) is not paced.
///
/// ```
/// use tollgate::client::AuthorityKey;
/// use tollgate::key::{Key, KeyExtractor, RequestHead};
///
/// let req = http::Request::get("https://API.example:8443/v1/items").body(()).unwrap();
/// assert_eq!(AuthorityKey.extract(&RequestHead::from(&req)), Some(Key::text("api.example:8443")));
/// let relative = http::Request::get("/v1/items").body(()).unwrap();
/// assert_eq!(AuthorityKey.extract(&RequestHead::from(&relative)), None);
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct AuthorityKey;

impl KeyExtractor for AuthorityKey {
    fn extract(&self, head: &RequestHead<'_>) -> Option<Key> {
        let host = head.uri.host()?.to_ascii_lowercase();
        Some(match head.uri.port_u16() {
            Some(port) => Key::text(format!("{host}:{port}")),
            None => Key::text(host),
        })
    }
}

/// A client-side Tower layer that paces requests by what the server said: it delays a request
/// until the server would accept it, instead of sending it to be refused.
///
/// **What it reads**, from every response: the IETF `RateLimit-Policy` / `RateLimit` fields
/// (draft-ietf-httpapi-ratelimit-headers-10, RFC 9651 structured fields: for each quota policy,
/// `q` units per `w` seconds, `r` units remaining, full again in `t` seconds), else the common
/// `X-RateLimit-Limit` / `-Remaining` / `-Reset` (`Reset` in seconds from now, or, above 10^9,
/// a Unix timestamp taken relative to the response's `Date` header, else the system clock),
/// and a 429's `Retry-After` (RFC 9110 §10.2.3: delay-seconds, or an HTTP-date relative to the
/// response's `Date`). Fields that do not parse are ignored.
///
/// **What it keeps**, per partition (a [`KeyExtractor`] over the request; default
/// [`AuthorityKey`], one partition per server): for each quota, the units believed left, when
/// it is full again, the refill rate learned so far, and the reports read while requests are
/// in flight; until when a 429 asked to wait; the requests in flight, numbered in the order
/// they were sent.
///
/// **Before the first response** of a partition, its requests go one at a time: the first
/// answer says how many may follow (a server that sends no rate-limit fields then limits
/// nothing). A first request that fails or is dropped lets the next one go, alone.
///
/// **How it paces**: a request waits while a 429's `Retry-After` runs, and while any quota of
/// its partition has no unit left, until the quota has one again: at its reset (`t`, when `q`
/// is believed left, less the requests still in flight), or sooner by the refill rate it has
/// learned. A request that goes reserves one unit of every quota before it is sent, so
/// concurrent requests never send more than the server last allowed. While others are in
/// flight, a request goes only if a unit would be left after it: a server can decide a
/// request at an instant before one it decided earlier (it read its clock, then waited for a
/// lock, as tollgate's memory store can under contention), which costs that request the
/// refill of the delay; the unit kept covers a delay of up to one emission interval
/// (`1 / rate`). A request with nothing in flight may take the last unit. Every response
/// replaces the count, and no order is assumed: requests on separate connections overtake
/// one another on the way to the server and back. The count is the least `r` among this response
/// and those read while its request was in flight, less every request still in flight.
/// Whichever of those responses the server decided last, the requests decided after it are
/// all still in flight (the ones answered before this request was sent were decided before
/// it), and its `r` is that least `r` or above (a refill can only raise a later `r`): the count
/// is never more than the server has once the requests in flight are decided. A request in
/// flight that was decided earlier is subtracted although `r` counted it, until its own
/// answer arrives: once every request is answered the count is the server's last `r`
/// exactly. After the layer refilled a quota at its reset, answers to requests sent before
/// describe the window before and do not set the count. A quota reported without a reset
/// time (`t`) and with nothing left is forgotten when no request is in flight to tell more.
///
/// **How the rate is learned**: the headers give whole seconds (`w`, `t`), which hide a refill
/// faster than a window (tollgate renders 50 per second with a burst of 10 as `q=10;w=1`). The
/// learning starts at a response read with no other request in flight and none answered
/// while it was (its anchor: `r_a` units left; its request sent at instant `a`), usually the
/// first. At a later response arriving at `b` with `r_b` left, the server has spent at least
/// `n` units since the anchor (the admitted requests answered before this one was sent, and
/// this one: all decided between the two), so it refilled more than `r_b + n - r_a - 1` units
/// in `b - a` seconds (`r` is the whole part of what is left; a quota that was full meanwhile
/// refilled less, and a request decided between the two but answered later is not in `n`, so
/// this stays a lower bound). The span runs from the anchor's sending to the later answer's
/// arrival, so it holds the time between the two decisions whatever the latencies: the bound
/// never exceeds the true rate. The learned rate is the largest such bound, in units per
/// second, over spans of at least one second. A quota with no unit left then has one
/// `1 / rate` seconds after the last response (up to `q` less the requests in flight, which
/// may not be decided yet), instead of at its reset; as
/// the refill is underestimated, the server holds more than the layer believes, reports it in
/// `r`, and the layer sends it: the rate the server allows is reached even while the estimate
/// is low. Units are requests and seconds throughout.
///
/// **Quotas that refill all at once** (a fixed window, a sliding log) look, across their
/// reset, like a bucket that refilled: the rate learned from them can let one request go too
/// early. The server refuses it (429), and from then on the layer learns no rate for that
/// quota and waits for its resets. The same happens when other clients spend the same quota,
/// and when a request that ended without an answer (an error, a dropped future) is decided
/// after a later answer was read. Against a bucket (tollgate's GCRA, token and leaky buckets)
/// that this layer alone spends, no request is refused, in whatever order the requests reach
/// the server and their answers come back.
///
/// Waits are not bounded by the layer: bound them with a timeout (`tower::timeout`) where a
/// server's daily quota could hold requests for hours. A request dropped while it waits takes
/// nothing. Time is tokio's ([`tokio::time::Instant`]), so tests under `tokio::time::pause()`
/// see exact delays. Clones of the layer, and every service it makes, share one state.
///
/// ```
/// use std::convert::Infallible;
/// use std::time::Duration;
/// use http::{Request, Response};
/// use tollgate::client::PacingLayer;
/// use tower::{Layer, ServiceExt, service_fn};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)] async fn main() {
/// // A server that allows one request per 5 seconds and says so.
/// let server = service_fn(|_req: Request<()>| async {
///     let res = Response::builder()
///         .header("ratelimit-policy", r#""slow";q=1;w=5"#)
///         .header("ratelimit", r#""slow";r=0;t=5"#)
///         .body(())
///         .unwrap();
///     Ok::<_, Infallible>(res)
/// });
/// let client = PacingLayer::new().layer(server);
/// let start = tokio::time::Instant::now();
/// for _ in 0..3 {
///     let req = Request::get("http://api.example/").body(()).unwrap();
///     client.clone().oneshot(req).await.unwrap();
/// }
/// assert_eq!(start.elapsed(), Duration::from_secs(10)); // sent at 0 s, 5 s and 10 s
/// # }
/// ```
pub struct PacingLayer<K = AuthorityKey> {
    shared: Arc<Shared<K>>,
}

impl<K> Clone for PacingLayer<K> {
    fn clone(&self) -> Self {
        Self { shared: Arc::clone(&self.shared) }
    }
}

impl<K: fmt::Debug> fmt::Debug for PacingLayer<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PacingLayer")
            .field("partition", &self.shared.key)
            .field("partitions", &self.shared.len())
            .finish()
    }
}

impl PacingLayer {
    /// A layer that paces each server ([`AuthorityKey`]) on its own.
    #[must_use]
    pub fn new() -> Self {
        Self::with_partition(AuthorityKey)
    }
}

impl Default for PacingLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: KeyExtractor> PacingLayer<K> {
    /// A layer that partitions requests by `key`: one state per key, requests without a key
    /// are not paced. [`GlobalKey`](crate::key::GlobalKey) paces everything together;
    /// [`HeaderKey`](crate::key::HeaderKey) on an API key header paces each credential.
    #[must_use]
    pub fn with_partition(key: K) -> Self {
        Self { shared: Arc::new(Shared { key, partitions: Mutex::new(HashMap::new()) }) }
    }

    /// How long a request of `head` would wait if it were sent now (zero when it would go at
    /// once), from what the server said so far. Reserves nothing.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tollgate::client::PacingLayer;
    /// use tollgate::key::RequestHead;
    ///
    /// let layer = PacingLayer::new();
    /// let req = http::Request::get("http://api.example/").body(()).unwrap();
    /// assert_eq!(layer.delay(&RequestHead::from(&req)), Some(Duration::ZERO)); // unknown: go
    /// ```
    ///
    /// `None` when the request waits for a response in flight rather than for an instant.
    #[must_use]
    pub fn delay(&self, head: &RequestHead<'_>) -> Option<Duration> {
        let Some(partition) = self.shared.existing(head) else { return Some(Duration::ZERO) };
        let now = Instant::now();
        match partition.lock().clone().try_reserve(now) {
            Ok(_) => Some(Duration::ZERO),
            Err(Some(until)) => Some(until.saturating_duration_since(now)),
            Err(None) => None,
        }
    }
}

impl<S, K> Layer<S> for PacingLayer<K> {
    type Service = Pacing<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        Pacing { inner, shared: Arc::clone(&self.shared) }
    }
}

/// The state shared by a layer and its services.
struct Shared<K> {
    key: K,
    partitions: Mutex<HashMap<Key, Arc<Partition>>>,
}

impl<K> Shared<K> {
    fn len(&self) -> usize {
        self.partitions.lock().unwrap_or_else(PoisonError::into_inner).len()
    }
}

impl<K: KeyExtractor> Shared<K> {
    /// The partition of a request, if the layer knows it.
    fn existing(&self, head: &RequestHead<'_>) -> Option<Arc<Partition>> {
        let key = self.key.extract(head)?;
        self.partitions.lock().unwrap_or_else(PoisonError::into_inner).get(&key).cloned()
    }

    /// The partition of a request, made on first use; `None` when the request has no key.
    fn partition(&self, head: &RequestHead<'_>) -> Option<Arc<Partition>> {
        let key = self.key.extract(head)?;
        let mut map = self.partitions.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(p) = map.get(&key) {
            return Some(Arc::clone(p));
        }
        if map.len() >= MAX_PARTITIONS {
            // Forget the partitions that no request holds and that would delay nothing.
            let now = Instant::now();
            map.retain(|_, p| Arc::strong_count(p) > 1 || !p.lock().is_idle(now));
        }
        let partition = Arc::new(Partition::default());
        map.insert(key, Arc::clone(&partition));
        Some(partition)
    }
}

/// What one partition's server said, and the requests it has in flight.
#[derive(Default)]
struct Partition {
    state: Mutex<State>,
    /// Woken when a response arrives or a request ends: waiters look again.
    changed: Notify,
}

impl Partition {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reserves a place now, if the server would accept a request now.
    fn try_acquire(self: &Arc<Self>) -> Option<Ticket> {
        let seq = self.lock().try_reserve(Instant::now()).ok()?;
        Some(Ticket { partition: Arc::clone(self), seq, open: true })
    }

    /// Waits until the server would accept a request, and reserves its place.
    async fn acquire(self: Arc<Self>) -> Ticket {
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

/// Where the learning of a quota's refill rate starts: a response read with no other request
/// in flight and none answered while it was, so that every request answered after it was
/// decided after it.
#[derive(Debug, Clone, Copy)]
struct Anchor {
    /// When its request was sent (before the server decided it).
    at: Instant,
    /// The units it reported left (`r`).
    remaining: u64,
    /// The quota's count of admitted responses read, this one included.
    admitted: u64,
}

/// What a quota knew when a request was sent.
#[derive(Debug, Clone, Copy)]
struct Sent {
    /// How many of its reports had been read.
    reads: u64,
    /// How many admitted responses reporting it had been read.
    admitted: u64,
}

/// One report read, kept while a request sent before it is in flight.
#[derive(Debug, Clone, Copy)]
struct Read {
    /// Its place among the quota's reads (from 1).
    index: u64,
    /// The units it reported left (`r`).
    remaining: u64,
    /// When it said the quota is full again.
    reset_at: Option<Instant>,
}

/// One quota of a partition, as last reported and counted down locally since.
#[derive(Debug, Clone)]
struct Quota {
    /// The quota policy's name (`None`: the legacy `X-RateLimit-*` fields).
    name: Option<Box<str>>,
    /// Units per window, when reported: what is left once the quota is full again, and the
    /// most the learned refill can bring back.
    limit: Option<u64>,
    /// Units believed left at `as_of`, less the requests reserved since; below zero when more
    /// are in flight than the server had left.
    remaining: i64,
    /// The instant `remaining` refers to: a learned refill adds one unit per `interval` after it.
    as_of: Instant,
    /// When the quota is full again; `None` after the layer refilled it and before a response
    /// said when.
    reset_at: Option<Instant>,
    /// The last request sent before the layer refilled the quota at its reset: responses to
    /// it and to earlier requests describe the window before and do not set the count.
    refilled_after: u64,
    /// Reports read so far.
    reads: u64,
    /// Admitted responses reporting this quota read so far.
    admitted: u64,
    /// What the quota knew when each request in flight was sent, by sequence number.
    sent: BTreeMap<u64, Sent>,
    /// The reports read since the oldest request in flight was sent.
    recent: VecDeque<Read>,
    /// The learned refill: at most this long per unit (the server refills at least
    /// `1 / interval` units per second).
    interval: Option<Duration>,
    /// Where the learning starts; `None` until a response read alone.
    anchor: Option<Anchor>,
    /// Whether the rate may be learned: false once the server refused a request the learned
    /// rate let through (it does not refill continuously, or others spend the same quota).
    learns: bool,
}

impl Quota {
    fn new(name: Option<Box<str>>) -> Self {
        Self {
            name,
            limit: None,
            remaining: 0,
            as_of: Instant::now(),
            reset_at: None,
            refilled_after: 0,
            reads: 0,
            admitted: 0,
            sent: BTreeMap::new(),
            recent: VecDeque::new(),
            interval: None,
            anchor: None,
            learns: true,
        }
    }

    /// The learned refill interval, when it may be used (a known limit caps it).
    fn refill(&self) -> Option<(Duration, u64)> {
        Some((self.interval?, self.limit?))
    }

    /// Brings `remaining` up to `now`: full again at the reset (less what is in flight), or
    /// one unit per learned interval up to the limit (less what is in flight). `false` when
    /// the quota is full again but its limit is unknown: it should be forgotten.
    fn settle(&mut self, now: Instant, in_flight: u64, last_seq: u64) -> bool {
        if self.reset_at.is_some_and(|at| now >= at) {
            let Some(limit) = self.limit else { return false };
            // Requests in flight may be decided after the reset: counted against the new
            // window. Their responses, older than this refill, no longer set the count.
            self.remaining = units(limit).saturating_sub(units(in_flight));
            self.as_of = now;
            self.reset_at = None;
            self.refilled_after = last_seq;
            return true;
        }
        if let Some((interval, limit)) = self.refill() {
            // The server holds at most `limit`, and the requests in flight may not be decided
            // yet: the count, which has them taken off, refills up to `limit` less them.
            let limit = units(limit).saturating_sub(units(in_flight));
            if self.remaining >= limit {
                self.as_of = now;
            } else {
                let per = interval.as_nanos().max(1);
                let gained = now.saturating_duration_since(self.as_of).as_nanos() / per;
                let gained = i64::try_from(gained).unwrap_or(i64::MAX);
                match self.remaining.saturating_add(gained) {
                    full if full >= limit => {
                        self.remaining = limit;
                        self.as_of = now;
                    }
                    left => {
                        self.remaining = left;
                        // `gained` intervals fit in the time elapsed, so this is before `now`.
                        self.as_of += Duration::from_nanos(
                            u64::try_from(per.saturating_mul(gained.unsigned_abs().into()))
                                .unwrap_or(u64::MAX),
                        );
                    }
                }
            }
        }
        true
    }

    /// When this quota, with fewer than `needed` units left, has them: its reset, or the
    /// learned refill's next units (whichever is sooner); `None` when neither is known.
    fn next_unit(&self, needed: i64) -> Option<Instant> {
        let refill = self.refill().map(|(interval, _)| {
            let owed = u32::try_from(needed.saturating_sub(self.remaining)).unwrap_or(u32::MAX);
            after(self.as_of, interval.saturating_mul(owed))
        });
        match (self.reset_at, refill) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Takes one unit for request `seq`, sent now.
    fn reserve(&mut self, seq: u64) {
        self.remaining -= 1;
        self.sent.insert(seq, Sent { reads: self.reads, admitted: self.admitted });
    }

    /// Forgets request `seq`, ended without a report of this quota.
    fn end(&mut self, seq: u64) {
        self.sent.remove(&seq);
        self.prune();
    }

    /// Drops the reads no request in flight needs, and merges the oldest two while more than
    /// [`MAX_RECENT`] are kept (a request in flight that long then compares with the lower
    /// of them, and the later reset: less exact, never more).
    fn prune(&mut self) {
        let oldest = self.sent.values().map(|s| s.reads).min().unwrap_or(self.reads);
        while self.recent.front().is_some_and(|r| r.index <= oldest) {
            self.recent.pop_front();
        }
        while self.recent.len() > MAX_RECENT {
            let (Some(a), Some(b)) = (self.recent.pop_front(), self.recent.pop_front()) else {
                break;
            };
            self.recent.push_front(Read {
                index: b.index,
                remaining: a.remaining.min(b.remaining),
                reset_at: later_of(a.reset_at, b.reset_at),
            });
        }
    }

    /// Takes in one report of this quota, from a response read at `now`.
    ///
    /// On separate connections requests overtake one another, on the way to the server and
    /// back, so the count is taken from the response the server decided last among this one
    /// and those read while it was in flight. Whichever that was, every request decided after
    /// it is still in flight: the requests answered before this one was sent were decided
    /// before it, and the ones answered while it was in flight are among those compared.
    /// Since that response the server lost at most one unit per request in flight, and its
    /// `r` is the least of theirs or above it (a refill can only raise a later `r`): the
    /// least `r` of them, less every request in flight, is never more than the server has.
    fn read(&mut self, now: Instant, r: Reported, answer: Answer) {
        let Answer { seq, sent_at, in_flight, admitted } = answer;
        if r.limit.is_some() {
            self.limit = r.limit;
        }
        let sent = self.sent.remove(&seq);
        self.reads += 1;
        let reset_at = r.reset.map(|t| after(now, t));
        let (mut least, mut reset) = (r.remaining, reset_at);
        // A quota first reported now: no other response reported it.
        let since = sent.map_or(0, |s| s.reads);
        for read in self.recent.iter().filter(|read| read.index > since) {
            least = least.min(read.remaining);
            reset = later_of(reset, read.reset_at);
        }
        let overlapped = since + 1 < self.reads;
        if admitted {
            self.admitted += 1;
            if self.learns {
                let anchor_at = sent_at.filter(|_| !overlapped && in_flight == 0);
                self.learn(now, r.remaining, sent, anchor_at);
            }
        }
        self.recent.push_back(Read { index: self.reads, remaining: r.remaining, reset_at });
        self.prune();
        if seq <= self.refilled_after {
            return;
        }
        self.remaining = units(least).saturating_sub(units(in_flight));
        self.as_of = now;
        self.reset_at = reset;
    }

    /// Learns a lower bound of the refill rate from the anchor to this response: the server
    /// had `L_a` units at the anchor (`r_a <= L_a < r_a + 1`), spent at least `n` since (the
    /// admitted requests answered before this one was sent, and this one), and has
    /// `L_b >= r_b` now, so it refilled more than `r_b + n - r_a - 1` units in the time
    /// between (fewer if it was full meanwhile, or spent more than `n`: still a lower bound).
    ///
    /// The span runs from when the anchor's request was sent to when this response arrived:
    /// it holds the time between the two decisions whatever the latencies, so the bound never
    /// exceeds the true rate.
    fn learn(
        &mut self,
        now: Instant,
        remaining: u64,
        sent: Option<Sent>,
        anchor_at: Option<Instant>,
    ) {
        let Some(anchor) = self.anchor else {
            if let Some(at) = anchor_at {
                self.anchor = Some(Anchor { at, remaining, admitted: self.admitted });
            }
            return;
        };
        // Sent before the anchor was read: not known to be decided after it.
        let Some(sent) = sent.filter(|s| s.admitted >= anchor.admitted) else { return };
        let span = now.saturating_duration_since(anchor.at);
        if span < MIN_LEARNING_SPAN {
            return;
        }
        let spent = sent.admitted - anchor.admitted + 1;
        let refilled = u128::from(remaining) + u128::from(spent);
        let refilled = refilled.saturating_sub(u128::from(anchor.remaining) + 1);
        if refilled == 0 {
            return;
        }
        let nanos = span.as_nanos().div_ceil(refilled);
        let interval = Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX));
        if self.interval.is_none_or(|i| interval < i) {
            self.interval = Some(interval);
        }
    }
}

/// A response, as the partition saw it.
#[derive(Debug, Clone, Copy)]
struct Answer {
    /// Its request's sequence number.
    seq: u64,
    /// When its request was sent; `None` when it was not in flight.
    sent_at: Option<Instant>,
    /// The other requests still in flight.
    in_flight: u64,
    /// Not refused: its request spent a unit.
    admitted: bool,
}

/// The later of two resets, or the one that is known.
fn later_of(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

/// A count of units as a signed number, saturating.
fn units(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[derive(Debug, Default, Clone)]
struct State {
    quotas: Vec<Quota>,
    /// A 429's `Retry-After`: no request before this.
    blocked_until: Option<Instant>,
    /// The sequence number of the last request reserved (they start at 1).
    last_seq: u64,
    /// The requests sent and not yet answered: sequence number, and when it was sent.
    open: BTreeMap<u64, Instant>,
    /// Whether a response has been read: before, one request at a time.
    informed: bool,
}

/// `now + d`, capped at [`MAX_WAIT`].
fn after(now: Instant, d: Duration) -> Instant {
    now + d.min(MAX_WAIT)
}

impl State {
    fn in_flight(&self) -> u64 {
        self.open.len() as u64
    }

    /// Reserves one unit of every quota when each has one (the request may go; its sequence
    /// number), or says until when to wait: `Some(instant)`, or `None` for "until a response
    /// in flight".
    fn try_reserve(&mut self, now: Instant) -> Result<u64, Option<Instant>> {
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
    fn is_idle(&self, now: Instant) -> bool {
        self.open.is_empty() && self.clone().try_reserve(now).is_ok()
    }

    /// Ends request `seq` without an answer (an error, or dropped): whether the server
    /// counted it is unknown, so its unit stays spent.
    fn abandon(&mut self, seq: u64) {
        self.open.remove(&seq);
        for q in &mut self.quotas {
            q.end(seq);
        }
    }

    /// Takes in what the response to request `seq` said, and ends it.
    fn observe(
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
                    let mut quota = Quota::new(r.name.clone());
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
struct Ticket {
    partition: Arc<Partition>,
    seq: u64,
    open: bool,
}

impl Ticket {
    /// Reads the response's rate-limit fields into the partition and releases the place.
    fn observe<B>(mut self, res: &Response<B>) {
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

/// The service made by [`PacingLayer`]: holds each request until its partition's server would
/// accept it, then sends it and reads the response's rate-limit fields.
///
/// `poll_ready` is the inner service's. A request that may go at once is sent on the service
/// that was polled ready; one that must wait is sent, after the wait, on that service taken out
/// of `self` (a clone takes its place), as tower's discipline asks.
pub struct Pacing<S, K = AuthorityKey> {
    inner: S,
    shared: Arc<Shared<K>>,
}

impl<S: Clone, K> Clone for Pacing<S, K> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone(), shared: Arc::clone(&self.shared) }
    }
}

impl<S: fmt::Debug, K> fmt::Debug for Pacing<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pacing").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl<S, K> Pacing<S, K> {
    inner_service_accessors!();
}

impl<S, K, ReqB, ResB> Service<Request<ReqB>> for Pacing<S, K>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: 'static,
    K: KeyExtractor,
    ReqB: Send + 'static,
    ResB: 'static,
{
    type Response = Response<ResB>;
    type Error = S::Error;
    type Future = ResponseFuture<Response<ResB>, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        let Some(partition) = self.shared.partition(&RequestHead::from(&req)) else {
            return ResponseFuture::new(self.inner.call(req));
        };
        if let Some(ticket) = partition.try_acquire() {
            let future = self.inner.call(req);
            return ResponseFuture::new(async move {
                let res = future.await;
                if let Ok(res) = &res {
                    ticket.observe(res);
                }
                res
            });
        }
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::new(async move {
            let ticket = partition.acquire().await;
            let res = inner.call(req).await;
            if let Ok(res) = &res {
                ticket.observe(res);
            }
            res
        })
    }
}

/// The response future of [`Pacing`]: the wait for the partition, then the inner service's
/// future (boxed, as the wait is an `async` state machine). `T` is the response, `E` the inner
/// service's error, passed through unchanged.
pub struct ResponseFuture<T, E> {
    inner: Pin<Box<dyn Future<Output = Result<T, E>> + Send>>,
}

impl<T, E> ResponseFuture<T, E> {
    fn new(future: impl Future<Output = Result<T, E>> + Send + 'static) -> Self {
        Self { inner: Box::pin(future) }
    }
}

impl<T, E> fmt::Debug for ResponseFuture<T, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<T, E> Future for ResponseFuture<T, E> {
    type Output = Result<T, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(remaining: u64, reset: Option<u64>) -> Reported {
        Reported {
            name: Some("q".into()),
            limit: Some(10),
            remaining,
            reset: reset.map(Duration::from_secs),
        }
    }

    fn remaining(state: &State) -> Vec<i64> {
        state.quotas.iter().map(|q| q.remaining).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn units_spent_do_not_come_back_from_late_responses() {
        let now = Instant::now();
        let mut state = State { informed: true, ..State::default() };
        let seqs: Vec<u64> = (0..3).map(|_| state.try_reserve(now).unwrap()).collect();
        assert_eq!(seqs, [1, 2, 3]);
        // Answered out of order: the second request's r=5 arrives first.
        state.observe(now, 2, StatusCode::OK, vec![quota(5, Some(1))], None);
        assert_eq!(remaining(&state), [3], "r=5 less both requests in flight, either may be later");
        state.observe(now, 1, StatusCode::OK, vec![quota(7, Some(1))], None);
        assert_eq!(remaining(&state), [4], "a late r=7 does not bring units back: r=5 less one");
        state.observe(now, 3, StatusCode::OK, vec![quota(4, Some(1))], None);
        assert_eq!(remaining(&state), [4], "the third request was counted once, not twice");
        assert_eq!(state.in_flight(), 0);
    }

    /// Every order in which the server can decide four concurrent requests, and every order in
    /// which their answers can come back (each after its decision): the count never exceeds
    /// what the server has once the requests in flight are decided, and is exact at the end.
    #[tokio::test(start_paused = true)]
    async fn requests_overtaking_one_another_never_make_the_count_too_high() {
        #[derive(Clone, Copy, Debug, PartialEq)]
        enum Event {
            Decide(u64),
            Answer(u64),
        }
        /// All sequences of the events left in which each answer follows its decision.
        fn orders(decided: &mut Vec<u64>, left: &mut Vec<Event>, out: &mut Vec<Vec<Event>>) {
            if left.is_empty() {
                return;
            }
            for i in 0..left.len() {
                let event = left[i];
                if let Event::Answer(seq) = event
                    && !decided.contains(&seq)
                {
                    continue;
                }
                left.remove(i);
                if let Event::Decide(seq) = event {
                    decided.push(seq);
                }
                let mut rest = Vec::new();
                orders(decided, left, &mut rest);
                if rest.is_empty() {
                    out.push(vec![event]);
                }
                for mut tail in rest {
                    tail.insert(0, event);
                    out.push(tail);
                }
                if let Event::Decide(_) = event {
                    decided.pop();
                }
                left.insert(i, event);
            }
        }
        let now = Instant::now();
        let seqs = [2, 3, 4, 5];
        let mut all = Vec::new();
        let mut events: Vec<Event> =
            seqs.iter().flat_map(|&s| [Event::Decide(s), Event::Answer(s)]).collect();
        orders(&mut Vec::new(), &mut events, &mut all);
        assert_eq!(all.len(), 2520, "8! / 2^4 orders");
        for order in all {
            // The first request alone: 10 units, 9 left.
            let mut state = State::default();
            let first = state.try_reserve(now).unwrap();
            state.observe(now, first, StatusCode::OK, vec![quota(9, None)], None);
            for &seq in &seqs {
                assert_eq!(state.try_reserve(now), Ok(seq));
            }
            let mut level: i64 = 9;
            let mut told: HashMap<u64, u64> = HashMap::new();
            let mut undecided = seqs.len() as i64;
            for event in &order {
                match *event {
                    Event::Decide(seq) => {
                        level -= 1;
                        undecided -= 1;
                        told.insert(seq, level.unsigned_abs());
                    }
                    Event::Answer(seq) => {
                        state.observe(
                            now,
                            seq,
                            StatusCode::OK,
                            vec![quota(told[&seq], None)],
                            None,
                        );
                        let believed = state.quotas[0].remaining;
                        assert!(
                            believed <= level - undecided,
                            "{order:?}: {believed} at {event:?}"
                        );
                    }
                }
            }
            assert_eq!(remaining(&state), [5], "{order:?}: exact once all are answered");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_long_request_compares_with_every_answer_read_meanwhile_in_bounded_memory() {
        let now = Instant::now();
        let mut state = State::default();
        let first = state.try_reserve(now).unwrap();
        state.observe(now, first, StatusCode::OK, vec![quota(200, None)], None);
        let long = state.try_reserve(now).unwrap();
        for i in 0..100 {
            let seq = state.try_reserve(now).unwrap();
            let r = if i == 3 { 5 } else { 150 };
            state.observe(now, seq, StatusCode::OK, vec![quota(r, None)], None);
            assert!(state.quotas[0].recent.len() <= MAX_RECENT);
        }
        // The long request may have been decided after the one that said 5.
        state.observe(now, long, StatusCode::OK, vec![quota(150, None)], None);
        assert_eq!(remaining(&state), [5]);
        assert!(state.quotas[0].recent.is_empty() && state.quotas[0].sent.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn the_learned_refill_stops_at_the_limit_less_the_requests_in_flight() {
        let now = Instant::now();
        let mut state = State::default();
        let first = state.try_reserve(now).unwrap();
        state.observe(now, first, StatusCode::OK, vec![quota(4, None)], None);
        state.quotas[0].interval = Some(Duration::from_millis(100));
        for _ in 0..3 {
            state.try_reserve(now).unwrap();
        }
        // Ten seconds later the server holds at most 10 units, and the three requests in
        // flight may still take three of them; one stays while requests are in flight.
        let later = now + Duration::from_secs(10);
        let sent = std::iter::from_fn(|| state.try_reserve(later).ok()).count();
        assert_eq!(sent, 6);
    }

    #[tokio::test(start_paused = true)]
    async fn with_requests_in_flight_the_last_unit_waits_for_them() {
        let now = Instant::now();
        let mut state = State::default();
        let first = state.try_reserve(now).unwrap();
        state.observe(now, first, StatusCode::OK, vec![quota(3, None)], None);
        assert_eq!(state.try_reserve(now), Ok(2));
        assert_eq!(state.try_reserve(now), Ok(3));
        // One unit left and two requests in flight: it waits for them.
        assert_eq!(state.try_reserve(now), Err(None));
        state.observe(now, 2, StatusCode::OK, vec![quota(2, None)], None);
        assert_eq!(state.try_reserve(now), Err(None));
        state.observe(now, 3, StatusCode::OK, vec![quota(1, None)], None);
        // Alone, a request may take the last unit.
        assert_eq!(state.try_reserve(now), Ok(4));
        assert_eq!(remaining(&state), [0]);
    }

    #[tokio::test(start_paused = true)]
    async fn requests_in_flight_are_subtracted_once() {
        let now = Instant::now();
        let mut state = State { informed: true, ..State::default() };
        for _ in 0..4 {
            state.try_reserve(now).unwrap();
        }
        // The server answers in order: each r already counts the requests sent before.
        for (seq, r) in [(1, 9), (2, 8), (3, 7), (4, 6)] {
            state.observe(now, seq, StatusCode::OK, vec![quota(r, Some(1))], None);
            assert_eq!(remaining(&state), [6], "after request {seq}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_quota_full_again_is_refilled_less_what_is_in_flight() {
        let now = Instant::now();
        let mut state = State::default();
        let first = state.try_reserve(now).unwrap();
        state.observe(now, first, StatusCode::OK, vec![quota(1, Some(2))], None);
        // One left: one request goes, the next waits for the reset at 2 s.
        let second = state.try_reserve(now).unwrap();
        assert_eq!(state.try_reserve(now), Err(Some(now + Duration::from_secs(2))));
        // At 2 s, with that request still in flight: 10 - 1 = 9 left, one taken now.
        let later = now + Duration::from_secs(2);
        state.try_reserve(later).unwrap();
        assert_eq!(remaining(&state), [8]);
        assert_eq!(state.quotas[0].reset_at, None);
        assert_eq!(state.in_flight(), 2);
        // The answer to the request sent before the refill is older than it: not read.
        state.observe(later, second, StatusCode::OK, vec![quota(0, Some(1))], None);
        assert_eq!(remaining(&state), [8]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_exhausted_quota_without_a_reset_waits_for_answers_then_is_forgotten() {
        let now = Instant::now();
        let mut state = State { informed: true, ..State::default() };
        state.try_reserve(now).unwrap();
        state.try_reserve(now).unwrap();
        let no_reset = Reported { name: Some("q".into()), limit: None, remaining: 0, reset: None };
        state.observe(now, 2, StatusCode::OK, vec![no_reset], None);
        // Nothing left and no reset time: wait for the response still in flight.
        assert_eq!(state.try_reserve(now), Err(None));
        state.abandon(1);
        // Nothing more will come: the quota is forgotten, the request goes.
        assert_eq!(state.try_reserve(now), Ok(3));
        assert!(state.quotas.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn before_the_first_answer_requests_go_one_at_a_time() {
        let now = Instant::now();
        let mut state = State::default();
        assert_eq!(state.try_reserve(now), Ok(1));
        assert_eq!(state.try_reserve(now), Err(None));
        // The first request failed: the next one goes, alone.
        state.abandon(1);
        assert_eq!(state.try_reserve(now), Ok(2));
        assert_eq!(state.try_reserve(now), Err(None));
        // An answer without rate-limit fields: nothing limits what follows.
        state.observe(now, 2, StatusCode::OK, vec![], None);
        assert_eq!(state.try_reserve(now), Ok(3));
        assert_eq!(state.try_reserve(now), Ok(4));
    }

    #[tokio::test(start_paused = true)]
    async fn the_refill_rate_is_learned_as_a_lower_bound() {
        // A server refilling 4 units per second, capacity 10: empty, it is full again in 2.5 s,
        // which its `t` rounds up to 3 s.
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut state = State::default();
        let send = |state: &mut State, now: Instant, r: u64, t: u64| {
            let seq = state.try_reserve(now).unwrap();
            state.observe(now, seq, StatusCode::OK, vec![quota(r, Some(t))], None);
        };
        for r in (0..10).rev() {
            send(&mut state, at(0), r, 3);
        }
        assert_eq!(state.quotas[0].interval, None, "no refill seen yet");
        assert_eq!(state.try_reserve(at(0)), Err(Some(at(3000))));
        // At the reset the server is full: r=9. From the first answer (r=9 at 0 s), 10
        // requests spent and 9 + 10 - 9 - 1 = 9 units refilled in 3 s at least.
        send(&mut state, at(3000), 9, 1);
        let interval = Duration::from_nanos(333_333_334);
        assert_eq!(state.quotas[0].interval, Some(interval));
        for r in (0..9).rev() {
            send(&mut state, at(3000), r, 3);
        }
        assert_eq!(state.quotas[0].interval, Some(interval));
        // Nothing left: the next unit is one interval away, not at the reset (6 s).
        assert_eq!(state.try_reserve(at(3000)), Err(Some(at(3000) + interval)));
        assert_eq!(state.try_reserve(at(3333)), Err(Some(at(3000) + interval)));
        let seq = state.try_reserve(at(3334)).unwrap();
        // The server had 4/3 units: r=0; 0 + 20 - 9 - 1 = 10 refilled in 3.334 s.
        state.observe(at(3334), seq, StatusCode::OK, vec![quota(0, Some(3))], None);
        assert_eq!(state.quotas[0].interval, Some(interval), "333.4 ms is no better");
        // A refusal while extrapolating: the rate is dropped and never learned again.
        let seq = state.try_reserve(at(3668)).unwrap();
        state.observe(at(3668), seq, StatusCode::TOO_MANY_REQUESTS, vec![quota(0, Some(3))], None);
        assert_eq!(state.quotas[0].interval, None);
        assert!(!state.quotas[0].learns);
        assert_eq!(state.try_reserve(at(3668)), Err(Some(at(6668))));
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_first_answer_does_not_raise_the_bound_above_the_rate() {
        // 4 units per second, capacity 100. The anchor was sent and decided at 0 s with 50
        // left, and its answer took 500 ms; the next was sent, decided and answered at 1.5 s
        // with 50 + 6 - 1 = 55 left. Timed from the anchor's arrival, 5 units in 1 s would be
        // 5/s; timed from when it was sent, they take 1.5 s: 300 ms each, under 4/s.
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let report = |r| Reported {
            name: Some("q".into()),
            limit: Some(100),
            remaining: r,
            reset: Some(Duration::from_secs(13)),
        };
        let mut state = State::default();
        let first = state.try_reserve(at(0)).unwrap();
        state.observe(at(500), first, StatusCode::OK, vec![report(50)], None);
        let second = state.try_reserve(at(1500)).unwrap();
        state.observe(at(1500), second, StatusCode::OK, vec![report(55)], None);
        let learned = state.quotas[0].interval.unwrap();
        assert_eq!(learned, Duration::from_millis(300));
        assert!(learned >= Duration::from_millis(250), "never faster than the server refills");
    }

    #[tokio::test(start_paused = true)]
    async fn a_429_blocks_until_its_retry_after_and_huge_values_do_not_overflow() {
        let now = Instant::now();
        let mut state = State::default();
        let seq = state.try_reserve(now).unwrap();
        state.observe(
            now,
            seq,
            StatusCode::TOO_MANY_REQUESTS,
            vec![],
            Some(Duration::from_secs(3)),
        );
        assert_eq!(state.try_reserve(now), Err(Some(now + Duration::from_secs(3))));
        state.observe(now, 9, StatusCode::TOO_MANY_REQUESTS, vec![], Some(Duration::MAX));
        assert_eq!(state.try_reserve(now), Err(Some(now + MAX_WAIT)));
        // A 503's Retry-After is the retry policy's business, not the pacing's.
        let mut state = State::default();
        state.observe(
            now,
            1,
            StatusCode::SERVICE_UNAVAILABLE,
            vec![],
            Some(Duration::from_secs(3)),
        );
        assert_eq!(state.try_reserve(now), Ok(1));
    }

    #[tokio::test(start_paused = true)]
    async fn quotas_per_partition_are_bounded() {
        let now = Instant::now();
        let mut state = State::default();
        for round in 0..3 {
            let reported = (0..MAX_QUOTAS)
                .map(|i| Reported {
                    name: Some(format!("q{round}-{i}").into()),
                    limit: Some(5),
                    remaining: 5,
                    reset: Some(Duration::from_secs(1)),
                })
                .collect();
            state.observe(now, round + 1, StatusCode::OK, reported, None);
        }
        assert_eq!(state.quotas.len(), MAX_QUOTAS);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_partitions_are_swept_when_there_are_too_many() {
        let layer = PacingLayer::new();
        let head = |i: usize| {
            http::Request::get(format!("http://h{i}.test/")).body(()).unwrap().into_parts().0
        };
        let busy = layer.shared.partition(&RequestHead::from(&head(0))).unwrap();
        busy.lock().blocked_until = Some(Instant::now() + Duration::from_secs(5));
        drop(busy);
        for i in 1..MAX_PARTITIONS {
            layer.shared.partition(&RequestHead::from(&head(i)));
        }
        assert_eq!(layer.shared.len(), MAX_PARTITIONS);
        // One more: every idle partition goes, the one that still delays stays.
        layer.shared.partition(&RequestHead::from(&head(MAX_PARTITIONS)));
        assert_eq!(layer.shared.len(), 2);
        assert_eq!(layer.delay(&RequestHead::from(&head(0))), Some(Duration::from_secs(5)));
    }
}
