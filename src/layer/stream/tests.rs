//! Streams metered as they pass (paused time): bytes, then gRPC messages.

mod bytes {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicU64, Ordering};

    use bytes::Bytes;
    use http::{Request, Response, StatusCode};
    use http_body::{Body, Frame, SizeHint};
    use http_body_util::{BodyExt, Full};
    use tokio::time::Instant;
    use tower::{Layer, ServiceExt, service_fn};

    use std::pin::Pin;
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll, Waker};
    use std::time::Duration;

    use crate::clock::TokioClock;
    use crate::error::ConfigError;
    use crate::error::StoreError;
    use crate::key::GlobalKey;
    use crate::key::Key;
    use crate::layer::stream::gate::*;
    use crate::layer::stream::grants::*;
    use crate::layer::stream::*;
    use crate::limiter::Limiter;
    use crate::policy::Policy;
    use crate::quota::Quota;
    use crate::quota::{Priority, Unit};
    use crate::store::{Check, Store, Verdict};
    use crate::store::{MemoryStore, MemoryTicket};
    use crate::{RateLimitLayer, RequestBody};

    /// A body of `left` bytes in frames of `frame` bytes, all ready at once; its length is
    /// told in its size hint when `sized`.
    struct Frames {
        left: usize,
        frame: usize,
        sized: bool,
    }

    /// A [`Frames`] that is pending once before each frame (waking itself), as a body read
    /// from a connection is, so that concurrent streams take turns.
    struct Turns {
        frames: Frames,
        ready: bool,
    }

    impl Body for Turns {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            if !std::mem::replace(&mut self.ready, false) {
                self.ready = true;
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Pin::new(&mut self.frames).poll_frame(cx)
        }

        fn is_end_stream(&self) -> bool {
            self.frames.is_end_stream()
        }
    }

    impl Body for Frames {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            if self.left == 0 {
                return Poll::Ready(None);
            }
            let len = self.frame.min(self.left);
            self.left -= len;
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(vec![7; len])))))
        }

        fn is_end_stream(&self) -> bool {
            self.left == 0
        }

        fn size_hint(&self) -> SizeHint {
            if self.sized { SizeHint::with_exact(self.left as u64) } else { SizeHint::default() }
        }
    }

    /// A memory store on tokio's clock, counting the checks it decides (grants included).
    #[derive(Clone)]
    pub(super) struct Counted {
        inner: MemoryStore,
        checks: Arc<AtomicU64>,
        /// While set, every check fails (a store that cannot be reached).
        down: Arc<std::sync::atomic::AtomicBool>,
    }

    impl Counted {
        pub(super) fn new() -> Self {
            let inner = MemoryStore::builder().clock(TokioClock::new()).build().unwrap();
            Self { inner, checks: Arc::default(), down: Arc::default() }
        }

        fn down(&self) -> Option<StoreError> {
            let down = self.down.load(Ordering::Relaxed);
            down.then(|| StoreError::backend("down"))
        }

        pub(super) fn checks(&self) -> u64 {
            self.checks.load(Ordering::Relaxed)
        }
    }

    impl Store for Counted {
        type Bound = <MemoryStore as Store>::Bound;
        type Ticket = MemoryTicket;

        fn bind(&self, policy: &Policy) -> Result<Self::Bound, ConfigError> {
            self.inner.bind(policy)
        }

        fn check_sync(
            &self,
            bound: &Self::Bound,
            check: Check<'_>,
        ) -> Option<Result<Verdict<MemoryTicket>, StoreError>> {
            self.checks.fetch_add(1, Ordering::Relaxed);
            if let Some(error) = self.down() {
                return Some(Err(error));
            }
            self.inner.check_sync(bound, check)
        }

        async fn check(
            &self,
            bound: &Self::Bound,
            check: Check<'_>,
        ) -> Result<Verdict<MemoryTicket>, StoreError> {
            self.checks.fetch_add(1, Ordering::Relaxed);
            if let Some(error) = self.down() {
                return Err(error);
            }
            self.inner.check(bound, check).await
        }

        async fn settle(
            &self,
            bound: &Self::Bound,
            ticket: MemoryTicket,
            cost: u64,
        ) -> Result<(), StoreError> {
            self.inner.settle(bound, ticket, cost).await
        }

        async fn settle_tiers(
            &self,
            bound: &Self::Bound,
            ticket: &mut MemoryTicket,
            costs: &[(usize, u64)],
        ) -> Result<(), StoreError> {
            self.inner.settle_tiers(bound, ticket, costs).await
        }
    }

    const MB: u64 = 1_000_000;

    fn upload_policy() -> Policy {
        Policy::builder("upload")
            .tier("bytes", Quota::per_second(MB).counting(Unit::RequestBytes))
            .build()
            .unwrap()
    }

    /// What the handlers read: per frame, when and how many bytes.
    type Log = Arc<Mutex<Vec<(Duration, u64)>>>;

    /// Ten chunked uploads of 1 MB at once from one key, in frames of `frame` bytes, against
    /// 1 MB/s (burst 1 MB): the statuses, the log of what the handlers read, the store.
    async fn ten_uploads(mode: StreamMode, frame: usize) -> (Vec<StatusCode>, Log, Counted) {
        let store = Counted::new();
        let layer = RateLimitLayer::builder(upload_policy())
            .key(GlobalKey)
            .store(store.clone())
            .on_stream(mode)
            .build()
            .unwrap();
        let log: Log = Arc::default();
        let start = Instant::now();
        let handler_log = Arc::clone(&log);
        let svc = layer.layer(service_fn(move |req: Request<RequestBody<Turns>>| {
            let log = Arc::clone(&handler_log);
            async move {
                let mut body = req.into_body();
                while let Some(frame) = body.frame().await {
                    let len = frame.unwrap().into_data().unwrap().len() as u64;
                    log.lock().unwrap().push((start.elapsed(), len));
                }
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("stored"))))
            }
        }));
        let uploads: Vec<_> = (0..10)
            .map(|_| {
                let body = Turns {
                    frames: Frames { left: MB as usize, frame, sized: false },
                    ready: false,
                };
                tokio::spawn(svc.clone().oneshot(Request::post("/").body(body).unwrap()))
            })
            .collect();
        let mut statuses = Vec::new();
        for upload in uploads {
            statuses.push(upload.await.unwrap().unwrap().status());
        }
        (statuses, log, store)
    }

    /// At every read, what all streams read so far is within the bound: burst + rate x
    /// elapsed + one frame per stream.
    fn assert_bound(log: &Log, streams: u64, frame: u64) {
        let mut log = log.lock().unwrap().clone();
        log.sort_by_key(|(at, _)| *at);
        let mut accepted = 0;
        for (at, len) in log {
            accepted += len;
            let allowed = MB + (MB as f64 * at.as_secs_f64()) as u64 + streams * frame;
            assert!(accepted <= allowed, "{accepted} bytes read by {at:?}, bound {allowed}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn shaping_paces_concurrent_uploads_one_grant_per_store_call() {
        let start = Instant::now();
        let (statuses, log, store) = ten_uploads(StreamMode::Shape, 4_096).await;
        let elapsed = start.elapsed();
        assert_eq!(statuses, vec![StatusCode::OK; 10]);
        let read: u64 = log.lock().unwrap().iter().map(|(_, len)| len).sum();
        assert_eq!(read, 10 * MB);
        // 1 MB of burst, 9 MB at 1 MB/s, less the bound's frame per stream (the last frames
        // pass as the grant that pays them is taken; the ten admission units are given back
        // at the end).
        assert!(
            elapsed >= Duration::from_secs(9) - Duration::from_micros(10 * 4_096),
            "{elapsed:?}"
        );
        assert!(elapsed <= Duration::from_millis(9_700), "{elapsed:?}");
        assert_bound(&log, 10, 4_096);
        // Ten admissions, then about 31 store calls per 1 MB stream: its grants are what its
        // frames need until it used a quarter of 64 KiB, then grow by doubling what it used,
        // within the burst up to a 64th of what the key has left (a grant with room ahead that
        // does not fit now is asked again for what the stream needs), past it up to 64 KiB
        // reserved ahead: one store call per grant, not one per frame (245 frames a stream).
        assert_eq!(store.checks(), 10 + 306);
    }

    #[tokio::test(start_paused = true)]
    async fn policing_stops_uploads_past_the_burst_and_gives_the_unused_grants_back() {
        let (statuses, log, store) = ten_uploads(StreamMode::Police, 4_096).await;
        // The streams take turns: each is refused mid-way, none having its 1 MB from a 1 MB
        // burst, and the layer answers in its handler's place.
        assert_eq!(statuses, vec![StatusCode::TOO_MANY_REQUESTS; 10]);
        let read: u64 = log.lock().unwrap().iter().map(|(_, len)| len).sum();
        // Time stood still (nothing slept): the burst, less the ten admission units, plus
        // less than a frame per stream past its last grant (cut to what the tier had left).
        assert!(read > MB - 10 - 10 * 4_096 && read < MB - 10 + 10 * 4_096, "{read}");
        assert_bound(&log, 10, 4_096);
        // Exactly what was read is charged: the unread parts of the grants came back, what
        // passed beyond them was charged when the bodies were dropped, and the unit each
        // request was charged at admission was given back when it was stopped. At 1 byte/us,
        // the next byte fits once that debt is paid.
        let limiter = Limiter::with_store(upload_policy(), store.clone()).unwrap();
        let charged = read;
        let now = limiter.check(&Key::Global, 1).await.unwrap();
        let expected = charged.checked_sub(MB).map(|over| Duration::from_micros(over + 1));
        assert_eq!(now.retry_after(), expected, "{read} read");
    }

    #[tokio::test(start_paused = true)]
    async fn frames_larger_than_a_grant_are_owed_and_paid_before_the_next_read() {
        // Frames of 100,000 bytes: each overshoots a 64 KiB grant; the debt is paid from the
        // next grants before the next frame is read, so the bound holds with one frame per
        // stream.
        let (statuses, log, _store) = ten_uploads(StreamMode::Shape, 100_000).await;
        assert_eq!(statuses, vec![StatusCode::OK; 10]);
        assert_bound(&log, 10, 100_000);
    }

    #[tokio::test(start_paused = true)]
    async fn a_shaped_download_is_cut_to_its_grants_and_paced() {
        let store = Counted::new();
        let policy = Policy::builder("download")
            .tier(
                "bytes",
                Quota::per_second(MB).with_burst(STREAM_GRANT).counting(Unit::ResponseBytes),
            )
            .build()
            .unwrap();
        let layer = RateLimitLayer::builder(policy)
            .key(GlobalKey)
            .store(store.clone())
            .on_stream(StreamMode::Shape)
            .build()
            .unwrap();
        let svc = layer.layer(service_fn(|_req: Request<RequestBody<Full<Bytes>>>| async {
            let body = Frames { left: 2 * MB as usize, frame: 256 * 1024, sized: true };
            Ok::<_, Infallible>(Response::new(body))
        }));
        let start = Instant::now();
        let res = svc.oneshot(Request::new(Full::default())).await.unwrap();
        let mut body = res.into_body();
        let (mut read, mut largest) = (0, 0);
        // As hyper does: nothing more is polled once the body says it ended.
        while !body.is_end_stream() {
            let frame = body.frame().await.unwrap();
            let len = frame.unwrap().into_data().unwrap().len() as u64;
            read += len;
            largest = largest.max(len);
        }
        let elapsed = start.elapsed();
        assert_eq!(read, 2 * MB);
        assert_eq!(largest, STREAM_GRANT, "frames are cut to their grant");
        // A burst of one grant, then 1 MB/s: (2 MB - 65,536) / 1 MB/s.
        let expected = Duration::from_micros(2 * MB - STREAM_GRANT);
        assert!(
            elapsed >= expected && elapsed <= expected + Duration::from_millis(70),
            "{elapsed:?}"
        );
        // One admission, then 30 grants of 64 KiB and a last one of the 33,920 bytes left.
        assert_eq!(store.checks(), 1 + 31);
    }

    #[tokio::test(start_paused = true)]
    async fn an_upload_with_a_content_length_is_charged_at_admission() {
        let store = Counted::new();
        let layer = RateLimitLayer::builder(upload_policy())
            .key(GlobalKey)
            .store(store.clone())
            .on_stream(StreamMode::Police)
            .build()
            .unwrap();
        let svc = layer.layer(service_fn(|req: Request<RequestBody<Frames>>| async move {
            let read = req.into_body().collect().await.unwrap().to_bytes().len();
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(read.to_string()))))
        }));
        let upload = |len: usize| {
            Request::post("/")
                .header("content-length", len)
                .body(Frames { left: len, frame: 4_096, sized: true })
                .unwrap()
        };
        let first = svc.clone().oneshot(upload(600_000)).await.unwrap();
        assert_eq!(first.status(), StatusCode::OK);
        let second = svc.clone().oneshot(upload(600_000)).await.unwrap();
        assert_eq!(second.status(), StatusCode::TOO_MANY_REQUESTS);
        // Two admissions, no grant.
        assert_eq!(store.checks(), 2);
    }

    /// 1 MB/s of response bytes (a burst of 1 MB).
    fn download_policy() -> Policy {
        Policy::builder("download")
            .tier("bytes", Quota::per_second(MB).counting(Unit::ResponseBytes))
            .build()
            .unwrap()
    }

    /// A handler answering 2 MB in 16 KiB frames.
    async fn two_mb(
        _req: Request<RequestBody<Full<Bytes>>>,
    ) -> Result<Response<Frames>, Infallible> {
        Ok(Response::new(Frames { left: 2 * MB as usize, frame: 16_384, sized: false }))
    }

    fn grpc_layer(policy: Policy, store: &Counted) -> RateLimitLayer<GlobalKey, Counted> {
        RateLimitLayer::builder(policy)
            .key(GlobalKey)
            .store(store.clone())
            .on_stream(StreamMode::Police)
            .build()
            .unwrap()
    }

    fn grpc_call<B>(body: B) -> Request<B> {
        Request::post("/pkg.Service/Method")
            .header("content-type", "application/grpc")
            .body(body)
            .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_grpc_upload_stopped_before_the_answer_gets_resource_exhausted() {
        let store = Counted::new();
        let svc = grpc_layer(upload_policy(), &store).layer(service_fn(
            |req: Request<RequestBody<Frames>>| async move {
                req.into_body().collect().await.unwrap();
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            },
        ));
        let body = Frames { left: 2 * MB as usize, frame: 4_096, sized: false };
        let res = svc.oneshot(grpc_call(body)).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers()["grpc-status"], "8");
        assert!(res.headers().contains_key("grpc-retry-pushback-ms"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_grpc_response_past_its_tier_ends_with_resource_exhausted_trailers() {
        let svc = grpc_layer(download_policy(), &Counted::new()).layer(service_fn(two_mb));
        let res = svc.oneshot(grpc_call(Full::default())).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        let mut body = res.into_body();
        let (mut read, mut trailers) = (0, None);
        while !body.is_end_stream() {
            match body.frame().await.unwrap().unwrap().into_data() {
                Ok(data) => read += data.len() as u64,
                Err(frame) => trailers = frame.into_trailers().ok(),
            }
        }
        // The burst (time stands still: nothing refills), the unit charged at admission
        // counted as the body's first and the last grant cut to what the tier had left; then
        // the trailers.
        assert_eq!(read, MB);
        let trailers = trailers.expect("trailers end the response");
        assert_eq!(trailers["grpc-status"], "8");
        assert!(trailers.contains_key("grpc-retry-pushback-ms"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_plain_http_response_under_policing_is_shaped() {
        let svc = grpc_layer(download_policy(), &Counted::new()).layer(service_fn(two_mb));
        let start = Instant::now();
        let res = svc.oneshot(Request::new(Full::default())).await.unwrap();
        let read = res.into_body().collect().await.unwrap().to_bytes().len() as u64;
        assert_eq!(read, 2 * MB);
        // 1 MB of burst (less the admission unit), then 1 MB/s.
        let elapsed = start.elapsed();
        assert!(
            elapsed >= Duration::from_millis(900) && elapsed <= Duration::from_millis(1_100),
            "{elapsed:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_dry_run_neither_stops_nor_slows_a_stream() {
        let store = Counted::new();
        let layer = RateLimitLayer::builder(upload_policy())
            .key(GlobalKey)
            .store(store.clone())
            .on_stream(StreamMode::Police)
            .dry_run(true)
            .build()
            .unwrap();
        let svc = layer.layer(service_fn(|req: Request<RequestBody<Frames>>| async move {
            let read = req.into_body().collect().await.unwrap().to_bytes().len();
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(read.to_string()))))
        }));
        let start = Instant::now();
        let body = Frames { left: 2 * MB as usize, frame: 4_096, sized: false };
        let res = svc.oneshot(Request::post("/").body(body).unwrap()).await.unwrap();
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.into_body().collect().await.unwrap().to_bytes(), "2000000");
        assert_eq!(start.elapsed(), Duration::ZERO);
        // The admission, and no grant: the bytes are settled when the body ends.
        assert_eq!(store.checks(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_dropped_while_its_grant_is_reserved_ahead_gives_it_back() {
        let store = Counted::new();
        let policy = Policy::builder("upload")
            .tier(
                "bytes",
                Quota::per_second(MB).with_burst(STREAM_GRANT).counting(Unit::RequestBytes),
            )
            .build()
            .unwrap();
        let limiter = Limiter::with_store(policy, store.clone()).unwrap();
        let mut grants = Grants::new(
            &limiter,
            Key::Global,
            Priority::Standard,
            Unit::RequestBytes,
            StreamMode::Shape,
            false,
        );
        let mut cx = Context::from_waker(Waker::noop());
        // The burst: one grant at once, spent whole.
        assert!(matches!(
            grants.poll_room(&mut cx, None, STREAM_GRANT),
            Poll::Ready(Ok(STREAM_GRANT))
        ));
        grants.spend(STREAM_GRANT);
        // The next grant is reserved 65,536 us ahead: the body waits for it.
        assert!(grants.poll_room(&mut cx, None, STREAM_GRANT).is_pending());
        assert_eq!(store.checks(), 2);
        drop(grants);
        // Given back: the next byte fits after 1 us, as after the first grant alone.
        let next = limiter.check(&Key::Global, 1).await.unwrap();
        assert_eq!(next.retry_after(), Some(Duration::from_micros(1)));
    }

    /// The unit the admission charged counts as the first of the first grant larger than it:
    /// the store is asked for the rest, and the unit is kept when the stream used it, left to
    /// be given back when it did not (a body dropped before its first byte passed).
    #[tokio::test(start_paused = true)]
    async fn the_admissions_unit_is_the_first_grants_first_and_kept_only_when_used() {
        let policy = Policy::builder("download")
            .tier("bytes", Quota::per_hour(1_000).counting(Unit::ResponseBytes))
            .build()
            .unwrap();
        for used in [0, 1, 300] {
            let store = MemoryStore::builder().clock(TokioClock::new()).build().unwrap();
            let limiter = Limiter::with_store(policy.clone(), store).unwrap();
            // The admission's unit.
            assert!(limiter.check(&Key::Global, 1).await.unwrap().is_allowed());
            let mut grants = Grants::new(
                &limiter,
                Key::Global,
                Priority::Standard,
                Unit::ResponseBytes,
                StreamMode::Police,
                false,
            )
            .credited(1);
            let mut cx = Context::from_waker(Waker::noop());
            let room = grants.poll_room(&mut cx, Some(300), 300);
            assert!(matches!(room, Poll::Ready(Ok(300))), "{room:?}");
            // 300 granted, 299 of them charged now: the admission's unit is the first.
            let left = limiter.check(&Key::Global, 0).await.unwrap().tiers()[0].remaining();
            assert_eq!(left, 1_000 - 300);
            grants.spend(used);
            let kept = grants.end();
            assert_eq!(kept, u64::from(used > 0), "used {used}");
            // What the grants charged once ended: what passed, less the unit kept.
            let left = limiter.check(&Key::Global, 0).await.unwrap().tiers()[0].remaining();
            assert_eq!(left, 1_000 - 1 - (used - kept), "used {used}");
        }
    }

    /// A grant given uncharged because the store failed (failing open) leaves the admission's
    /// unit where the first grant put it: kept, as that grant used it.
    #[tokio::test(start_paused = true)]
    async fn a_grant_failing_open_keeps_the_admissions_unit_the_first_grant_used() {
        let store = Counted::new();
        let policy = Policy::builder("download")
            .tier("bytes", Quota::per_hour(1_000).counting(Unit::ResponseBytes))
            .build()
            .unwrap();
        let limiter = Limiter::with_store(policy, store.clone()).unwrap();
        let mut grants = Grants::new(
            &limiter,
            Key::Global,
            Priority::Standard,
            Unit::ResponseBytes,
            StreamMode::Shape,
            true,
        )
        .credited(1);
        let mut cx = Context::from_waker(Waker::noop());
        assert!(matches!(grants.poll_room(&mut cx, Some(600), 300), Poll::Ready(Ok(300))));
        grants.spend(300);
        store.down.store(true, Ordering::Relaxed);
        assert!(matches!(grants.poll_room(&mut cx, Some(300), 300), Poll::Ready(Ok(300))));
        assert_eq!(grants.end(), 1, "the first grant used the admission's unit");
    }
}

mod messages {
    //! Tiers counting gRPC messages, metered as bodies stream (paused time).
    use std::collections::VecDeque;
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicU64, Ordering};

    use bytes::{BufMut, Bytes, BytesMut};
    use http::{Request, Response};
    use http_body::{Body, Frame};
    use http_body_util::{BodyExt, Full};
    use tokio::time::Instant;
    use tower::{Layer, ServiceExt, service_fn};

    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll};
    use std::time::Duration;

    use crate::quota::Unit;

    use crate::key::GlobalKey;
    use crate::layer::stream::*;
    use crate::policy::Policy;
    use crate::quota::Quota;
    use crate::{RateLimitLayer, RequestBody};

    /// The bytes of one gRPC message: 8 bytes of payload, 13 in all.
    const MESSAGE: usize = 13;

    /// A gRPC body: `frames` frames of `per_frame` messages each, all ready at once.
    struct Grpc(VecDeque<Bytes>);

    impl Grpc {
        fn new(frames: usize, per_frame: usize) -> Self {
            let mut n = 0u64;
            Self(
                (0..frames)
                    .map(|_| {
                        let mut frame = BytesMut::new();
                        for _ in 0..per_frame {
                            frame.put_u8(0);
                            frame.put_u32(8);
                            frame.put_u64(n);
                            n += 1;
                        }
                        frame.freeze()
                    })
                    .collect(),
            )
        }
    }

    impl Body for Grpc {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
            Poll::Ready(self.0.pop_front().map(|f| Ok(Frame::data(f))))
        }

        fn is_end_stream(&self) -> bool {
            self.0.is_empty()
        }
    }

    use super::bytes::Counted;

    fn layer(unit: Unit, mode: StreamMode, store: &Counted) -> RateLimitLayer<GlobalKey, Counted> {
        let policy = Policy::builder("messages")
            .tier("messages", Quota::per_second(100).counting(unit))
            .build()
            .unwrap();
        RateLimitLayer::builder(policy)
            .key(GlobalKey)
            .store(store.clone())
            .on_stream(mode)
            .build()
            .unwrap()
    }

    fn grpc_call<B>(body: B) -> Request<B> {
        Request::post("/pkg.Service/Method")
            .header("content-type", "application/grpc")
            .body(body)
            .unwrap()
    }

    /// Polices a gRPC upload of 40 frames of `per_frame` messages against 100 messages
    /// (burst 100): the messages the handler read, the status, the store's checks.
    async fn police_upload(per_frame: usize) -> (u64, String, u64) {
        let store = Counted::new();
        let read = Arc::new(AtomicU64::new(0));
        let handler_read = Arc::clone(&read);
        let svc = layer(Unit::RequestMessages, StreamMode::Police, &store).layer(service_fn(
            move |req: Request<RequestBody<Grpc>>| {
                let read = Arc::clone(&handler_read);
                async move {
                    let mut body = req.into_body();
                    while let Some(frame) = body.frame().await {
                        let len = frame.unwrap().into_data().unwrap().len();
                        read.fetch_add((len / MESSAGE) as u64, Ordering::SeqCst);
                    }
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
                }
            },
        ));
        let res = svc.oneshot(grpc_call(Grpc::new(40, per_frame))).await.unwrap();
        let status = res.headers()["grpc-status"].to_str().unwrap().to_owned();
        (read.load(Ordering::SeqCst), status, store.checks())
    }

    #[tokio::test(start_paused = true)]
    async fn policing_an_upload_stops_it_at_the_budget_with_one_store_call_per_grant() {
        // Five messages to a frame: a frame is read only while the tier has room for its
        // first message, so exactly the budget (20 frames) is read.
        let (read, status, checks) = police_upload(5).await;
        assert_eq!((read, status.as_str()), (100, "8"));
        // The admission (the first message); a grant per frame (a tier of 100 is never far
        // enough from its limit for a stream to take room ahead); and the refused grant that
        // stops the stream.
        assert_eq!(checks, 1 + 19 + 1);
    }

    #[tokio::test(start_paused = true)]
    async fn several_messages_in_one_frame_pass_the_budget_by_less_than_a_frame() {
        // Seven to a frame: the 15th frame is read with 1 message of room left and lets 6
        // more through (a request's frame cannot be split): the bound is the budget plus
        // one frame's messages less one.
        let (read, status, _) = police_upload(7).await;
        assert_eq!((read, status.as_str()), (105, "8"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_shaped_server_stream_is_cut_at_message_boundaries_and_paced() {
        let store = Counted::new();
        let svc = layer(Unit::ResponseMessages, StreamMode::Shape, &store).layer(service_fn(
            |_req: Request<RequestBody<Full<Bytes>>>| async {
                // 250 messages, 50 to a frame.
                Ok::<_, Infallible>(Response::new(Grpc::new(5, 50)))
            },
        ));
        let start = Instant::now();
        let res = svc.oneshot(grpc_call(Full::default())).await.unwrap();
        let mut body = res.into_body();
        let (mut messages, mut largest) = (0, 0);
        while !body.is_end_stream() {
            let data = body.frame().await.unwrap().unwrap().into_data().unwrap();
            assert_eq!(data.len() % MESSAGE, 0, "whole messages");
            messages += data.len() / MESSAGE;
            largest = largest.max(data.len() / MESSAGE);
        }
        assert_eq!((messages, largest), (250, 16));
        // A burst of 100, then 100/s. Grants of the messages in hand, at most 16 (16, 16, 16,
        // then the 2 the first frame has left), the eighth cut to the 2 the burst had left
        // (taken now rather than 16 reserved ahead): the last grant (messages 245 to 260)
        // fits at (260 - 100) / 100 s.
        assert_eq!(start.elapsed(), Duration::from_millis(1_600));
        // The admission (which charged no message: shaping), then 18 grants.
        assert_eq!(store.checks(), 1 + 18);
    }

    #[tokio::test(start_paused = true)]
    async fn a_plain_http_request_counts_as_one_message() {
        let store = Counted::new();
        let svc = layer(Unit::RequestMessages, StreamMode::Police, &store).layer(service_fn(
            |req: Request<RequestBody<Grpc>>| async move {
                req.into_body().collect().await.unwrap();
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            },
        ));
        // Not gRPC: its body is not framed, and it costs one message at admission.
        for _ in 0..100 {
            let req = Request::post("/").body(Grpc::new(3, 5)).unwrap();
            assert_eq!(svc.clone().oneshot(req).await.unwrap().status(), 200);
        }
        let req = Request::post("/").body(Grpc::new(3, 5)).unwrap();
        assert_eq!(svc.oneshot(req).await.unwrap().status(), 429);
    }
}
