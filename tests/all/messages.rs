//! gRPC messages as a tier's unit, end to end: a tonic server behind the layer, called by
//! tonic's client over real HTTP/2 on 127.0.0.1. The service (`test.Messages`) is written
//! against tonic's generic server and client with a codec of raw bytes, so no protobuf code
//! is generated: `Upload` is client-streaming (answers how many messages it read), `Download`
//! server-streaming (sends as many messages as the request's 8-byte count), `Chat`
//! bidirectional (answers each message with how many came), `Echo` unary.
#![cfg(feature = "tonic")]

use crate::support;

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes};
use http::uri::PathAndQuery;
use tokio::net::TcpListener;
use tokio_stream::StreamExt;
use tollgate::clock::FakeClock;
use tollgate::key::{GlobalKey, KeyExtractor};
use tollgate::store::{MemoryStore, Store};
use tollgate::{Policy, Quota, RateLimitLayer, StreamMode, Unit};
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::server::NamedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status, Streaming};
use tower::{Service, service_fn};

/// Messages as raw bytes. Each message the client encodes is sent as its own chunk (a yield
/// threshold of one byte), so that each reaches the server in its own HTTP/2 DATA frame.
#[derive(Clone, Copy, Default)]
struct Raw;

impl Codec for Raw {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = Raw;
    type Decoder = Raw;

    fn encoder(&mut self) -> Raw {
        Raw
    }

    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl Encoder for Raw {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::new(64, 1)
    }
}

impl Decoder for Raw {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

/// The `test.Messages` service; `received` is how many messages `Upload` read so far.
#[derive(Clone, Default)]
struct Messages {
    received: Arc<AtomicU64>,
}

impl NamedService for Messages {
    const NAME: &'static str = "test.Messages";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl Service<http::Request<tonic::body::Body>> for Messages {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let received = Arc::clone(&self.received);
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(Raw);
            Ok(match req.uri().path() {
                "/test.Messages/Upload" => {
                    let upload = service_fn(move |req: tonic::Request<Streaming<Bytes>>| {
                        let received = Arc::clone(&received);
                        async move {
                            let mut messages = req.into_inner();
                            let mut read = 0u64;
                            while messages.message().await?.is_some() {
                                read += 1;
                                received.store(read, Ordering::SeqCst);
                            }
                            Ok::<_, Status>(tonic::Response::new(count(read)))
                        }
                    });
                    grpc.client_streaming(upload, req).await
                }
                "/test.Messages/Download" => {
                    let download = service_fn(|req: tonic::Request<Bytes>| async move {
                        let n = req.into_inner().get_u64();
                        let messages = (0..n).map(|i| Ok::<_, Status>(count(i)));
                        Ok::<_, Status>(tonic::Response::new(tokio_stream::iter(messages)))
                    });
                    grpc.server_streaming(download, req).await
                }
                "/test.Messages/Chat" => {
                    let chat = service_fn(move |req: tonic::Request<Streaming<Bytes>>| {
                        let received = Arc::clone(&received);
                        async move {
                            // Each message read is answered at once, with how many came.
                            let answers = req.into_inner().map(move |message| {
                                message.map(|_| count(received.fetch_add(1, Ordering::SeqCst) + 1))
                            });
                            Ok::<_, Status>(tonic::Response::new(answers))
                        }
                    });
                    grpc.streaming(chat, req).await
                }
                "/test.Messages/Echo" => {
                    let echo = service_fn(|req: tonic::Request<Bytes>| async move {
                        Ok::<_, Status>(tonic::Response::new(req.into_inner()))
                    });
                    grpc.unary(echo, req).await
                }
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

fn count(n: u64) -> Bytes {
    Bytes::copy_from_slice(&n.to_be_bytes())
}

/// A tonic server on a free loopback port, stopped when this is dropped.
struct GrpcServer {
    client: tonic::client::Grpc<Channel>,
    received: Arc<AtomicU64>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn serve<K: KeyExtractor, St: Store>(layer: RateLimitLayer<K, St>) -> GrpcServer {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let service = Messages::default();
    let received = Arc::clone(&service.received);
    let stop = support::spawn_until_stopped(|stopped| {
        // A shaped request stream is paused by not reading it, and only HTTP/2 flow control
        // stops the client: h2 ends a connection that buffers too many small DATA frames
        // unread (about half the connection window's worth of framing overhead), so the
        // stream's window is kept small enough for a client sending one 13-byte frame per
        // message to be stopped first.
        Server::builder()
            .initial_stream_window_size(16 * 1024)
            .layer(layer)
            .add_service(service)
            .serve_with_incoming_shutdown(TcpIncoming::from(listener), stopped)
    });
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    GrpcServer { client: tonic::client::Grpc::new(channel), received, _stop: stop }
}

/// Reads the stream a call answered to its end, each message the count after the one before
/// it from `first` on: how many came, then how the stream ended (the call's own refusal: none
/// came).
async fn counted(
    res: Result<tonic::Response<tonic::Streaming<Bytes>>, Status>,
    first: u64,
) -> (u64, Result<(), Status>) {
    let mut messages = match res {
        Ok(res) => res.into_inner(),
        Err(status) => return (0, Err(status)),
    };
    let mut came = 0;
    loop {
        match messages.message().await {
            Ok(Some(message)) => {
                assert_eq!(message, count(first + came), "in order, whole");
                came += 1;
            }
            Ok(None) => return (came, Ok(())),
            Err(status) => return (came, Err(status)),
        }
    }
}

impl GrpcServer {
    /// Streams `n` messages of 8 bytes to `Upload`: the count it answers.
    async fn upload(&mut self, n: u64) -> Result<u64, Status> {
        self.client.ready().await.expect("ready");
        let messages = tokio_stream::iter((0..n).map(count));
        let path = PathAndQuery::from_static("/test.Messages/Upload");
        let res = self.client.client_streaming(tonic::Request::new(messages), path, Raw).await?;
        Ok(res.into_inner().get_u64())
    }

    /// Asks `Download` for `n` messages: those that came, then how the stream ended.
    async fn download(&mut self, n: u64) -> (u64, Result<(), Status>) {
        self.client.ready().await.expect("ready");
        let path = PathAndQuery::from_static("/test.Messages/Download");
        let res = self.client.server_streaming(tonic::Request::new(count(n)), path, Raw).await;
        counted(res, 0).await
    }

    /// Sends `n` messages to `Chat`: the answers that came, then how the stream ended.
    async fn chat(&mut self, n: u64) -> (u64, Result<(), Status>) {
        self.client.ready().await.expect("ready");
        let messages = tokio_stream::iter((0..n).map(count));
        let path = PathAndQuery::from_static("/test.Messages/Chat");
        let res = self.client.streaming(tonic::Request::new(messages), path, Raw).await;
        counted(res, 1).await
    }

    /// Offers `n` messages to `Chat` at `per_ms` messages each millisecond: the instant each
    /// answer came, then how the stream ended.
    async fn chat_offered(&mut self, n: u64, per_ms: u64) -> (Vec<Instant>, Result<(), Status>) {
        self.client.ready().await.expect("ready");
        let (offer, offered) = tokio::sync::mpsc::channel(1_024);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            for i in 0..n {
                if i % per_ms == 0 {
                    tick.tick().await;
                }
                if offer.send(count(i)).await.is_err() {
                    return;
                }
            }
        });
        let messages = tokio_stream::wrappers::ReceiverStream::new(offered);
        let path = PathAndQuery::from_static("/test.Messages/Chat");
        let res = match self.client.streaming(tonic::Request::new(messages), path, Raw).await {
            Ok(res) => res,
            Err(status) => return (Vec::new(), Err(status)),
        };
        let mut answers = res.into_inner();
        let mut came = Vec::new();
        loop {
            match answers.message().await {
                Ok(Some(_)) => came.push(Instant::now()),
                Ok(None) => return (came, Ok(())),
                Err(status) => return (came, Err(status)),
            }
        }
    }

    async fn echo(&mut self) -> Result<Bytes, Status> {
        self.client.ready().await.expect("ready");
        let path = PathAndQuery::from_static("/test.Messages/Echo");
        let res = self.client.unary(tonic::Request::new(count(7)), path, Raw).await?;
        Ok(res.into_inner())
    }
}

/// A metadata entry of a status, as text.
fn meta<'a>(status: &'a Status, name: &str) -> Option<&'a str> {
    status.metadata().get(name).map(|v| v.to_str().expect("ascii metadata"))
}

/// 100 messages per second, burst 100, of `unit`, on one key for every call.
fn layer(
    unit: Unit,
    mode: StreamMode,
    store: MemoryStore,
) -> RateLimitLayer<GlobalKey, MemoryStore> {
    layer_at(100, unit, mode, store)
}

/// `rate` messages per second, burst `rate`, of `unit`, on one key for every call.
fn layer_at(
    rate: u64,
    unit: Unit,
    mode: StreamMode,
    store: MemoryStore,
) -> RateLimitLayer<GlobalKey, MemoryStore> {
    let policy = Policy::builder("messages")
        .tier("messages", Quota::per_second(rate).counting(unit))
        .build()
        .unwrap();
    RateLimitLayer::builder(policy).key(GlobalKey).store(store).on_stream(mode).build().unwrap()
}

fn frozen(clock: &FakeClock) -> MemoryStore {
    MemoryStore::builder().clock(clock.clone()).build().unwrap()
}

#[tokio::test]
async fn policing_stops_a_client_stream_after_exactly_the_budget_shared_with_unary_calls() {
    // Time stands still: nothing refills while the test runs.
    let clock = FakeClock::new();
    let mut server = serve(layer(Unit::RequestMessages, StreamMode::Police, frozen(&clock))).await;
    // Thirty unary calls take one request message each from the budget of 100.
    for _ in 0..30 {
        assert_eq!(server.echo().await.unwrap(), count(7));
    }
    // A stream of 1,000 messages: the handler reads exactly the 70 left, then the layer
    // answers in its place.
    let refused = server.upload(1_000).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert_eq!(server.received.load(Ordering::SeqCst), 70);
    // The pushback is the wait for the refused grant: near the limit a grant is what the
    // stream needs, one message at 100/s.
    assert_eq!(meta(&refused, "grpc-retry-pushback-ms"), Some("10"));
    // A unary call of the same key is refused while the budget is spent.
    let refused = server.echo().await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert_eq!(meta(&refused, "grpc-retry-pushback-ms"), Some("10"));
    // The quota unit is told (not one the IETF draft registers).
    assert_eq!(meta(&refused, "ratelimit-policy"), Some(r#""messages";q=100;w=1;qu="messages""#));
    // Ten messages' worth later, a stream gets exactly ten.
    clock.advance(Duration::from_millis(100));
    server.received.store(0, Ordering::SeqCst);
    assert_eq!(server.upload(1_000).await.unwrap_err().code(), Code::ResourceExhausted);
    assert_eq!(server.received.load(Ordering::SeqCst), 10);
}

#[tokio::test]
async fn a_client_stream_within_the_budget_is_not_stopped_at_its_end() {
    let clock = FakeClock::new();
    let mut server = serve(layer(Unit::RequestMessages, StreamMode::Police, frozen(&clock))).await;
    // Exactly the budget: the stream ends when the last message leaves nothing.
    assert_eq!(server.upload(100).await.unwrap(), 100);
    assert_eq!(server.echo().await.unwrap_err().code(), Code::ResourceExhausted);
}

#[tokio::test]
async fn shaping_paces_a_client_stream_to_the_rate() {
    // The store on the real clock: 300 messages at 100/s after a burst of 100.
    let mut server =
        serve(layer(Unit::RequestMessages, StreamMode::Shape, MemoryStore::new())).await;
    let start = Instant::now();
    assert_eq!(server.upload(300).await.unwrap(), 300);
    let elapsed = start.elapsed();
    // (300 - 100) / 100 per second = 2 s, less the grant taken ahead of the last message.
    assert!(elapsed >= Duration::from_millis(1_900), "{elapsed:?}");
}

#[tokio::test]
async fn a_server_stream_is_counted_per_message_and_ends_with_resource_exhausted() {
    let clock = FakeClock::new();
    let mut server = serve(layer(Unit::ResponseMessages, StreamMode::Police, frozen(&clock))).await;
    // The server's messages go out many to a DATA frame: they are cut at the message past
    // the budget.
    let (came, end) = server.download(250).await;
    assert_eq!(came, 100);
    let refused = end.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert_eq!(meta(&refused, "grpc-retry-pushback-ms"), Some("10"));
    // A unary call of the same key is refused at once.
    assert_eq!(server.echo().await.unwrap_err().code(), Code::ResourceExhausted);
    // Within the budget, a stream runs to its end.
    clock.advance(Duration::from_secs(1));
    let (came, end) = server.download(40).await;
    assert_eq!((came, end.map_err(|s| s.code())), (40, Ok(())));
}

#[tokio::test]
async fn policing_ends_a_bidirectional_stream_with_resource_exhausted_trailers() {
    let clock = FakeClock::new();
    let mut server = serve(layer(Unit::RequestMessages, StreamMode::Police, frozen(&clock))).await;
    // The handler answered (its response streams) before the budget ran out: the response
    // ends with the status in its trailers, after the answers to the messages it read.
    let (came, end) = server.chat(1_000).await;
    assert_eq!(server.received.load(Ordering::SeqCst), 100);
    assert_eq!(came, 100);
    let refused = end.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert_eq!(meta(&refused, "grpc-retry-pushback-ms"), Some("10"));
}

#[tokio::test]
async fn policing_a_bidirectional_stream_offered_ten_times_the_rate_admits_exactly_the_budget() {
    let clock = FakeClock::new();
    let store = frozen(&clock);
    let mut server = serve(layer_at(1_000, Unit::RequestMessages, StreamMode::Police, store)).await;
    // 10,000 messages offered at 10,000/s against 1,000/s with a burst of 1,000, time frozen.
    let (came, end) = server.chat_offered(10_000, 10).await;
    assert_eq!(server.received.load(Ordering::SeqCst), 1_000);
    assert_eq!(came.len(), 1_000);
    assert_eq!(end.unwrap_err().code(), Code::ResourceExhausted);
}

#[tokio::test]
async fn shaping_paces_a_bidirectional_stream_offered_ten_times_the_rate_to_the_rate() {
    // The store on the real clock: 4,000 messages offered at 10,000/s against 1,000/s, burst
    // 1,000. The burst, and what refills while it is offered, pass at once; the rest is paced.
    let store = MemoryStore::new();
    let mut server = serve(layer_at(1_000, Unit::RequestMessages, StreamMode::Shape, store)).await;
    let (came, end) = server.chat_offered(4_000, 10).await;
    end.unwrap();
    assert_eq!(came.len(), 4_000);
    // The rate over the last 2,000 answers, all paced. A grant of 16 messages is taken as a
    // whole, so a block may pass up to 16 ms early (0.8 % of 2 s); the rest of the ±2 % is
    // for the loopback and the scheduler.
    let paced = came[3_999].duration_since(came[1_999]).as_secs_f64();
    let rate = 2_000.0 / paced;
    assert!((980.0..=1_020.0).contains(&rate), "{rate:.1} messages/s over {paced:.3} s");
}

#[tokio::test]
async fn settling_lets_a_stream_run_and_charges_its_messages_when_it_ends() {
    let clock = FakeClock::new();
    let mut server = serve(layer(Unit::RequestMessages, StreamMode::Settle, frozen(&clock))).await;
    // Never stopped: 250 messages against a budget of 100.
    assert_eq!(server.upload(250).await.unwrap(), 250);
    // Charged 250: 150 past the burst are owed, at 100/s, then one more message fits after
    // 10 ms.
    clock.advance(Duration::from_millis(1_500));
    let refused = server.echo().await.unwrap_err();
    assert_eq!(meta(&refused, "grpc-retry-pushback-ms"), Some("10"));
    clock.advance(Duration::from_millis(10));
    assert_eq!(server.echo().await.unwrap(), count(7));
}

/// A stream within the budget is charged exactly its messages (the unused part of its last
/// grant comes back), and a stream past it gets exactly what is left; the tier refills one
/// message every 36 s, so nothing refills meanwhile.
async fn a_stream_is_charged_exactly_its_messages<St: Store>(store: St) {
    let policy = Policy::builder("slow")
        .tier("messages", Quota::per_hour(100).counting(Unit::RequestMessages))
        .build()
        .unwrap();
    let layer = RateLimitLayer::builder(policy)
        .key(GlobalKey)
        .store(store)
        .on_stream(StreamMode::Police)
        .build()
        .unwrap();
    let limiter = layer.limiter().clone();
    let mut server = serve(layer).await;
    let left = || async {
        // The settlement of the last grant may still be on its way to a remote store.
        tokio::time::sleep(Duration::from_millis(100)).await;
        limiter.check(&tollgate::key::Key::Global, 0).await.unwrap().tiers()[0].remaining()
    };
    // 40 messages: the first charged at admission, then three grants of 16, nine of them
    // unused and given back.
    assert_eq!(server.upload(40).await.unwrap(), 40);
    assert_eq!(left().await, 60);
    let refused = server.upload(1_000).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    assert_eq!(server.received.load(Ordering::SeqCst), 60);
    assert_eq!(left().await, 0);
}

support::stores::store_tests! {
    #[tokio::test]
    a_stream_is_charged_exactly_its_messages_in_memory: a_stream_is_charged_exactly_its_messages(support::stores::on_system_clock());
    #[cfg(feature = "redis")]
    a_stream_is_charged_exactly_its_messages_on_redis: a_stream_is_charged_exactly_its_messages(support::stores::redis::server("redis-server", "messages:"));
}

#[tokio::test]
async fn settling_counts_a_server_stream_and_charges_it_when_it_ends() {
    let clock = FakeClock::new();
    let mut server = serve(layer(Unit::ResponseMessages, StreamMode::Settle, frozen(&clock))).await;
    let (came, end) = server.download(250).await;
    assert_eq!((came, end.map_err(|s| s.code())), (250, Ok(())));
    // Charged 250, as for the upload above.
    clock.advance(Duration::from_millis(1_500));
    let refused = server.echo().await.unwrap_err();
    assert_eq!(meta(&refused, "grpc-retry-pushback-ms"), Some("10"));
    clock.advance(Duration::from_millis(10));
    assert_eq!(server.echo().await.unwrap(), count(7));
}

// Concurrency while calls are paused or stopped: one call in flight (a concurrency tier of
// 1) beside a tier of 40 messages and a tier of 1 MB, on a store whose clock stands still,
// so that what the tiers charged can be read back exactly. The tiers refill one unit a
// second: a shaped grant past the burst waits more than a second (it is not reserved
// ahead), and the keys a Redis store expires when a tier would be full again (in real
// time) outlive the test.

/// The bytes of one message on the wire: the 5-byte prefix and 8 bytes of payload.
const WIRE: u64 = 13;

fn one_call<St: Store>(unit: Unit, mode: StreamMode, store: St) -> RateLimitLayer<GlobalKey, St> {
    let bytes = match unit {
        Unit::RequestMessages => Unit::RequestBytes,
        _ => Unit::ResponseBytes,
    };
    let policy = Policy::builder("one-call")
        .concurrency("in-flight", tollgate::Concurrency::new(1))
        .tier("messages", Quota::per_second(1).with_burst(40).counting(unit))
        .tier("bytes", Quota::per_second(1).with_burst(1_000_000).counting(bytes))
        .build()
        .unwrap();
    RateLimitLayer::builder(policy).key(GlobalKey).store(store).on_stream(mode).build().unwrap()
}

/// Free slots, messages left, bytes left.
async fn left<St: Store>(limiter: &tollgate::Limiter<St>) -> (u64, u64, u64) {
    let peek = limiter.check(&tollgate::key::Key::Global, 0).await.unwrap();
    let tiers = peek.tiers();
    (tiers[0].remaining(), tiers[1].remaining(), tiers[2].remaining())
}

/// Waits until `done` says so, or 10 s (the assertions that follow then say what is
/// missing).
async fn until<F: Future<Output = bool>>(mut done: impl FnMut() -> F) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !done().await && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A client-streaming call paused by shaping (its grants, growing with what it used, have
/// taken the burst of 40 messages; the clock is frozen) holds its slot: a unary call of the
/// key is refused. The client cancels the call (the HTTP/2 stream is reset): the slot comes
/// back, the message tier is charged the 40 messages read and the byte tier their bytes (the
/// rest of its last byte grant given back).
async fn a_paused_call_holds_its_slot_until_cancelled<St: Store>(store: St) {
    let layer = one_call(Unit::RequestMessages, StreamMode::Shape, store);
    let limiter = layer.limiter().clone();
    let mut server = serve(layer).await;
    let mut client = server.client.clone();
    let call = tokio::spawn(async move {
        client.ready().await.expect("ready");
        let messages = tokio_stream::iter((0..1_000).map(count));
        let path = PathAndQuery::from_static("/test.Messages/Upload");
        let _ = client.client_streaming(tonic::Request::new(messages), path, Raw).await;
    });
    until(|| async { server.received.load(Ordering::SeqCst) >= 40 }).await;
    assert_eq!(server.received.load(Ordering::SeqCst), 40);
    // Paused, in flight: the one slot is taken, the messages spent.
    assert_eq!(server.echo().await.unwrap_err().code(), Code::ResourceExhausted);
    let (slots, messages, _) = left(&limiter).await;
    assert_eq!((slots, messages), (0, 0));
    call.abort();
    let expected = (1, 0, 1_000_000 - 40 * WIRE);
    until(|| async { left(&limiter).await == expected }).await;
    assert_eq!(left(&limiter).await, expected);
    assert_eq!(server.received.load(Ordering::SeqCst), 40);
}

/// A server-streaming call paused by shaping (cut where its grants took the burst of 40
/// messages) holds its slot; the client drops the stream: the slot comes back, charged
/// exactly the 40 messages and their bytes.
async fn a_paused_server_stream_holds_its_slot_until_dropped<St: Store>(store: St) {
    let layer = one_call(Unit::ResponseMessages, StreamMode::Shape, store);
    let limiter = layer.limiter().clone();
    let mut server = serve(layer).await;
    let path = PathAndQuery::from_static("/test.Messages/Download");
    let mut client = server.client.clone();
    client.ready().await.expect("ready");
    let res = client.server_streaming(tonic::Request::new(count(1_000)), path, Raw).await;
    let mut messages = res.expect("admitted").into_inner();
    for i in 0..40 {
        assert_eq!(messages.message().await.unwrap(), Some(count(i)));
    }
    assert_eq!(server.echo().await.unwrap_err().code(), Code::ResourceExhausted);
    drop(messages);
    // The unary call above was refused before it was charged anything.
    let expected = (1, 0, 1_000_000 - 40 * WIRE);
    until(|| async { left(&limiter).await == expected }).await;
    assert_eq!(left(&limiter).await, expected);
}

/// A client-streaming call stopped by policing (`RESOURCE_EXHAUSTED` after exactly the 40
/// messages) gives its slot back, charged exactly the 40 messages and their bytes.
async fn a_policed_call_gives_its_slot_back_when_stopped<St: Store>(store: St) {
    let layer = one_call(Unit::RequestMessages, StreamMode::Police, store);
    let limiter = layer.limiter().clone();
    let mut server = serve(layer).await;
    let refused = server.upload(1_000).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert_eq!(server.received.load(Ordering::SeqCst), 40);
    let expected = (1, 0, 1_000_000 - 40 * WIRE);
    until(|| async { left(&limiter).await == expected }).await;
    assert_eq!(left(&limiter).await, expected);
}

support::stores::store_tests! {
    #[tokio::test]
    a_paused_call_holds_its_slot_until_cancelled_in_memory: a_paused_call_holds_its_slot_until_cancelled(support::stores::in_memory());
    a_paused_server_stream_holds_its_slot_until_dropped_in_memory: a_paused_server_stream_holds_its_slot_until_dropped(support::stores::in_memory());
    a_policed_call_gives_its_slot_back_when_stopped_in_memory: a_policed_call_gives_its_slot_back_when_stopped(support::stores::in_memory());
}

#[cfg(feature = "redis")]
mod paused_on_redis {
    use super::*;

    support::stores::store_tests! {
        #[tokio::test]
        a_paused_call_holds_its_slot_until_cancelled("call:"): a_paused_call_holds_its_slot_until_cancelled_on_redis, a_paused_call_holds_its_slot_until_cancelled_on_valkey;
        a_paused_server_stream_holds_its_slot_until_dropped("down:"): a_paused_server_stream_holds_its_slot_until_dropped_on_redis, a_paused_server_stream_holds_its_slot_until_dropped_on_valkey;
        a_policed_call_gives_its_slot_back_when_stopped("police:"): a_policed_call_gives_its_slot_back_when_stopped_on_redis, a_policed_call_gives_its_slot_back_when_stopped_on_valkey;
    }

    support::stores::store_tests! {
        #[tokio::test]
        paused_and_stopped_calls_hold_and_give_back_their_slots_on_a_cluster: on_a_cluster[a_paused_call_holds_its_slot_until_cancelled("call:"), a_paused_server_stream_holds_its_slot_until_dropped("down:"), a_policed_call_gives_its_slot_back_when_stopped("police:")];
    }
}
